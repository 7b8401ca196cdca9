"""
On-policy RL of a multi-agent LLM system: AT-GRPO and the baselines.

    python train.py                      # CPU: tiny Qwen3 on compact Plan-Path, learns in minutes
    python train.py --algo grpo          # ablations: --algo grpo|dr_mas, --policies per_role, ...
    torchrun --nproc_per_node=8 train.py --task plan --model /path/Qwen3-1.7B   # the paper's setting

One step: sample E fresh envs per rank -> tree rollouts (rollout.py) -> groups and advantages
(grpo_mas.py) -> one PPO-clip update per policy on its roles' samples -> push the new weights into
each policy's engine -> log, evaluate, checkpoint. The method in words: docs/method.md. Who plays
which role: policies.py; flags, torchrun and checkpoints: common.py; the tiny default's base:
tiny.py.

What this script simplifies, and why:
 1. Rollout and training take turns on the same devices (no separate generation pool). On CUDA the
    vLLM engine sleeps during the update (weights and KV cache freed) and wakes for the weight sync
    and for generation; on CPU it stays up. Simple and enough for a node.
 2. pi_old is the policy that sampled: with one mini-batch per step it is pi_theta detached; with
    several the trainer recomputes it before the first optimizer step.
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
import importlib.util
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass

import torch

import common as C
import envs as E
import memory
import model as M
import policies as P
import retrieval
import sandbox
import tiny
from grpo_mas import (DUMMY, SCALES, by_agent_turn, collate, compute_advantages, dapo_fill,
                      gigpo_advantages, make_rows, micro_batches, outcome_rewards, ppo_loss, split_minibatches,
                      trajectory_returns)
from rollout import Agents, Sampling, evaluate, plain_rollout, tree_rollout

# -----------------------------------------------------------------------------
# config: every global below is a flag (--name value or --name=value)
# the run
task = "plan"              # plan | sokoban | sudoku | code | math | search
model = ""                 # HF Qwen3 folder; "" = the embedded tiny model and the compact games
preset = ""                # a key of PRESETS; "" = paper with --model, else tiny (per task)
algo = "at_grpo"           # at_grpo | grpo | dr_mas | gigpo: the groups and their values (grpo_mas.py)
workflow = "mas"           # mas: every agent; single: one agent alone; math: solver_verifier too
policies = "shared"        # shared | per_role | per_type | lora: who shares a policy
team = ""                  # --task math: "N,M" = N reasoners and M tool agents, then a judge
team_mode = "aggregate"    # --team: aggregate (one turn, the reference's) | refine
policy = ""                # ROLE=PATH (repeatable): that role's base (HF folder, tiny-small)
engine = "vllm"            # vllm | torch (a pure-torch sampler) | scripted (for tests)
seed = 0                   # seeds the tiny base, the envs, sampling and the adapters
out_dir = "runs/default"   # metrics.jsonl, config.json, a copy of the code, ckpt/
resume = False             # continue from out_dir/ckpt
overwrite = False          # replace the run in out_dir (else a folder with one is refused)
stop_step = 0              # stop after this step; 0 = at --steps. The lr schedule still
                           # spans --steps: a run stopped at N is the first N steps of one
dry_run = False            # print the GPU memory plan and exit (--model 0.6B|1.7B|4B|8B)
world = 0                  # --dry_run: ranks to plan for (0 = this launch's WORLD_SIZE)
gpu_gb = 0.0               # GiB per GPU to plan for (0 = the GPU's own; 80 for --dry_run)
wandb = ""                 # PROJECT: also log to Weights & Biases (pip install wandb)
nccl_timeout_min = 60.0    # collective timeout: above the worst rank skew
tool_timeout = 5.0         # seconds for a tool agent's program (games, math) in the sandbox
test_timeout = 6.0         # seconds per code test (LiveCodeBench's own limit)
compile = False            # torch.compile each decoder layer (in place, HF names kept)
search_train = ""          # --task search: questions (jsonl, Search-R1's or HotpotQA's format); "" = generated
search_test = ""           # --task search: held-out questions (same formats); "" = generated
retriever = ""             # --task search: bm25:CORPUS.jsonl | http://HOST:8000/retrieve | "" (own passages)
search_metric = "em"       # --task search: the answer's reward, em (exact match) | f1
# the method
K = 4                      # candidates per (agent, turn) node, or trajectories per env
alpha = 1.0                # weight of the team reward in every call's reward
reward = "immediate"       # immediate: each call's alpha*team + local; outcome: the episode's (Dr. MAS)
invalid_penalty = 0.1      # --reward outcome: minus this for an ill-formed answer (Dr. MAS: 0.1 math)
train_roles = ""           # roles whose samples train (tool,plan); "" = all; the others sample, frozen
alternate_every = 0        # N > 0: the trained roles take turns, one every N steps (0 = all at once)
gigpo_gamma = 0.95         # --algo gigpo: the discount of the step returns (verl-agent's scripts)
gigpo_step_weight = 1.0    # --algo gigpo: A = A_episode + this x A_step
branch = "greedy"          # greedy: the best branch continues; random (an ablation)
eps_low = 0.2              # PPO clip range below 1
eps_high = 0.2             # PPO clip range above 1 (0.28 = asymmetric "clip-higher")
dual_clip = 3.0            # cap on the loss of negative-advantage tokens (c > 1); 0 disables
kl_coef = 0.0              # k3 KL to the initial weights; 0 = none (paper)
entropy_coef = 0.0         # entropy bonus (verl's entropy_coeff); 0 = none (paper)
drop_zero_var = False      # drop groups whose K rewards are all equal (their advantage is 0 anyway)
dynamic_sampling = 0       # N > 1: DAPO's refill: up to N rollouts a step until the groups with a signal
                           # number the first rollout's groups; zero-variance groups dropped (0 = off)
refill = "batch"           # --dynamic_sampling: a refill's envs, batch (the first rollout's number, DAPO's)
                           # | missing (the envs the missing groups need at the step's rate so far)
std_floor = 0.0            # divide by max(std, this), in reward units; 0 = the std
top_p = 1.0                # 1.0: the sampler's log-probs are the trainer's full-softmax log-probs
thinking = False           # Qwen3's chat-template thinking switch (per role: tool=true,plan=false)
lora_rank = 16             # --policies lora: adapter rank r (every linear of every layer)
lora_alpha = 32.0          # --policies lora: adapter scale alpha / r
weight_decay = 0.01        # AdamW's decoupled weight decay
grad_clip = 1.0            # clip each optimizer step's gradient to this global norm
lr_min = 0.1               # --lr_decay: the final lr as a fraction of --lr
pack = False               # true: tree siblings train as one row, their prompt once (grpo_mas.Row)
split = "strided"          # mini-batches: strided (sample i -> i mod N) or groups (whole
                           # sibling groups, verl's way); --pack true sets groups
# the recipe: the paper preset's values (docs/paper_preset.md); PRESETS below overrides them by name
turns = 3                  # T, max turns per episode
envs_per_step = 128        # E, env instances per step over all ranks
mini_batch_rows = 32       # samples per optimizer step, all ranks (verl's); 0: --minibatches
minibatches = 2            # with --mini_batch_rows 0: optimizer steps per batch
steps = 400                # training steps; the lr schedule spans them
lr = 1e-6                  # AdamW learning rate; per role: tool=1e-6,plan=2e-6
lora_lr_mult = 1.0         # --policies lora without --lr: this x the preset's lr
lr_decay = 0.0             # last fraction of --steps: lr falls (half cosine) to lr_min x lr
scale_rewards = "group"    # group: (r - mean) / group std; none: r - mean; batch: / the step's std
batch_std_steps = 0        # with --scale_rewards group: the first N steps use the step's std
temperature = 1.0          # training temperature, per role too; each sample is trained at its own
max_new_tokens = 2048      # response tokens per call, per role too (tiny: the compact answer)
max_prompt_tokens = 8192   # prompt tokens per call (head and tail kept)
max_model_len = 10240      # engine context (clamped to the model's)
micro_batch_tokens = 16384 # padded tokens per micro-batch; per role: tool=8192,plan=16384
eval_every = 20            # held-out eval every N steps (0 = never), and at 0 and the end
eval_n = 100               # held-out instances (games: test seeds; code/math: the first N rows)
eval_k = 1                 # eval.py: samples per instance (k > 1: avg@k and pass@k)
eval_temperature = 0.0     # eval.py: sampling temperature (0 = greedy)
eval_turns = 3             # eval.py: max turns per episode (the reference's evaluation scripts)
eval_max_new_tokens = 8192 # eval.py: response tokens per call
eval_top_p = 1.0           # eval.py: nucleus sampling's top-p
eval_thinking = False      # eval.py: Qwen3's thinking switch
ckpt_every = 20            # checkpoint every N steps and at the end (0 = never)
time_limit_min = 0.0       # stop (final eval + checkpoint) after N minutes; 0 = no limit
warmup_steps = 0           # tiny only: format warm-up steps (valid answers, no solutions)
warmup_moves = 0           # tiny only: warm-up answers of 1..N moves (Sudoku: fills)
grad_checkpoint = True     # activation checkpointing per decoder layer
tis_cap = 2.0              # truncated IS: loss x min(exp(old - sampler logp), C); 0 = off
search_topk = 3            # --task search: passages per search
gpu_memory_utilization = 0.5  # vLLM's share of each GPU while awake

# PRESETS: each preset's values where it differs from the recipe above (gpt-fast's named configs).
# paper*: the reference's scripts, value by value (docs/paper_preset.md). tiny*: the 2-core CPU
# default on the compact games (why each value: docs/design.md, "The tiny default").
TINY = dict(
    turns=4, envs_per_step=16, mini_batch_rows=0, minibatches=4, steps=250,
    lr=5e-4, lr_decay=1.0, scale_rewards="batch", batch_std_steps=60,
    # LoRA at width 192: rank 64 points a step twice as well as 16 (docs/experiments.md)
    lora_rank=64, lora_alpha=128.0, lora_lr_mult=3.0,
    temperature=0.7, max_new_tokens=8, max_prompt_tokens=256, max_model_len=512,
    micro_batch_tokens=8192, eval_every=10, eval_n=200, ckpt_every=10, time_limit_min=15.0,
    warmup_steps=150, warmup_moves=4, grad_checkpoint=False, tis_cap=0.0,
    gpu_memory_utilization=0.3, eval_turns=4, eval_max_new_tokens=8,
)
PRESETS = {
    "paper": {},
    "paper-math": dict(max_new_tokens=8192, max_model_len=16384,
                       eval_turns=5, eval_k=4, eval_temperature=0.6),
    "paper-code": dict(max_new_tokens=4096, max_model_len=12288, eval_turns=5),
    "paper-search": dict(turns=4, max_new_tokens=800, max_prompt_tokens=4096, max_model_len=4896,
                         eval_turns=4, eval_max_new_tokens=800),
    "tiny": TINY,
    # Plan-Path: DAPO's refill keeps the freezes off; sampling at 0.5, nearer the greedy
    # answer that is scored, met the targets on more seeds (docs/results.md)
    "tiny-plan": {**TINY, "dynamic_sampling": 3, "temperature": 0.5},
    "tiny-sokoban": {**TINY, "scale_rewards": "group", "temperature": 1.0, "warmup_steps": 600},
    "tiny-sudoku": {**TINY, "scale_rewards": "group", "temperature": 1.0, "warmup_steps": 600,
                    "steps": 50, "max_new_tokens": 17, "eval_max_new_tokens": 17,
                    "warmup_moves": 16},
    "tiny-search": {**TINY, "temperature": 1.0, "warmup_steps": 600, "max_new_tokens": 3,
                    "eval_max_new_tokens": 3, "search_topk": 1, "warmup_moves": 1},
}
CHOICES = {
    "task": list(E.TASKS),
    "preset": ["", *PRESETS],
    "algo": ["at_grpo", "grpo", "dr_mas", "gigpo"],
    "workflow": E.WORKFLOWS,
    "policies": ["shared", "per_role", "per_type", "lora"],
    "team_mode": ["aggregate", "refine"],
    "engine": ["vllm", "torch", "scripted"],
    "branch": ["greedy", "random"],
    "scale_rewards": list(SCALES),
    "reward": ["immediate", "outcome"],
    "search_metric": ["em", "f1"],
    "split": ["strided", "groups"],
    "refill": ["batch", "missing"],
}
FLAGS = {k: v for k, v in globals().items()
         if not k.startswith("_") and isinstance(v, (int, float, bool, str))}

# -----------------------------------------------------------------------------
# the configuration: flags over the preset over the recipe, checked before anything loads


def configure(argv):
    """Flags -> the run's whole configuration: the recipe, its preset's overrides, every flag given
    on top, and every check that can run before anything loads. Returns the cfg dict (printed at the
    start, saved as config.json)."""
    cfg = dict(FLAGS)
    given = C.parse_flags(argv, cfg, CHOICES, per_role=P.PER_ROLE_FLAGS, repeatable=("policy",),
                          help_text=help_text())
    if not cfg["preset"]:
        cfg["preset"] = default_preset(cfg["task"], P.is_tiny(cfg))
    overrides = PRESETS[cfg["preset"]]
    for k, v in overrides.items():
        if k not in given:
            cfg[k] = v
    # a preset's dynamic sampling filters one kind of group, and gigpo has two: off unless asked for
    if cfg["algo"] == "gigpo" and "dynamic_sampling" not in given:
        cfg["dynamic_sampling"] = 0
    # a per-role flag's value for the roles it does not name: the preset's
    cfg["role_defaults"] = {k: overrides.get(k, FLAGS[k]) for k in P.PER_ROLE_FLAGS}
    # adapters learn at lora_lr_mult x the preset's lr, unless --lr says
    if cfg["policies"] == "lora":
        cfg["role_defaults"]["lr"] *= cfg["lora_lr_mult"]
        if "lr" not in given:
            cfg["lr"] = cfg["role_defaults"]["lr"]
    if cfg["pack"] and "split" not in given:
        cfg["split"] = "groups"
    check(cfg, given)
    context = min(P.model_config(cfg, p.base).max_position_embeddings for p in P.resolve(cfg)[0])
    fit_sampling(cfg, "", context)
    return cfg


def fit_sampling(cfg, prefix, context):
    """Each role's Sampling (cfg["role_sampling"], or role_eval_sampling for prefix "eval_"), its
    response budget and the engine's context fitted to the model's context (common.fit_context);
    the flag max_new_tokens becomes the largest role's budget (the memory plan's)."""
    sampling = P.role_sampling(cfg, prefix)
    longest = max(s.max_new_tokens for s in sampling.values())
    cfg["max_model_len"], cfg["max_prompt_tokens"], fitted = C.fit_context(
        cfg["max_model_len"], cfg["max_prompt_tokens"], longest, context)
    cfg[prefix + "max_new_tokens"] = fitted
    key = "role_eval_sampling" if prefix else "role_sampling"
    cfg[key] = {r: dict(vars(s), max_new_tokens=min(s.max_new_tokens, fitted)) for r, s in sampling.items()}


def default_preset(task, tiny):
    """paper (paper-math, paper-code, paper-search) with a real model; tiny-plan (tiny-sokoban,
    tiny-sudoku, tiny-search; tiny for code and math) without."""
    if tiny:
        return {"plan": "tiny-plan", "sokoban": "tiny-sokoban", "sudoku": "tiny-sudoku",
                "search": "tiny-search"}.get(task, "tiny")
    return {"math": "paper-math", "code": "paper-code", "search": "paper-search"}.get(task, "paper")


def config_line(cfg):
    """The run's first line: its preset and the values presets set (tiny's keys and the preset's own)."""
    keys = {**TINY, **PRESETS[cfg["preset"]]}
    return f"config: preset {cfg['preset']}; " + ", ".join(f"{k} {cfg[k]}" for k in keys)


def help_text():
    return ("usage: python train.py [--flag value | --flag=value ...]\n\n"
            + C.usage(__file__, FLAGS, PRESETS)
            + "\n\nA value in [...] is a preset's own; the default is tiny (tiny-sokoban, tiny-sudoku)"
            " without --model, paper (paper-math, paper-code) with it. Per-role flags take"
            " ROLE=VALUE,...")


# The bounds of the numeric flags: (flag, holds, what to use instead). A value outside them makes
# the run meaningless, so it stops here, before anything loads.
BOUNDS = [
    ("K", lambda v: v >= 2, "at least 2: a group of one has no baseline (its advantage is always 0)"),
    ("turns", lambda v: v >= 1, "at least 1 turn per episode"),
    ("envs_per_step", lambda v: v >= 1, "at least 1 env per step"),
    ("steps", lambda v: v >= 1, "at least 1 step"),
    ("temperature", lambda v: v > 0, "above 0: training samples at it and the trainer divides its "
                                     "logits by it (greedy decoding is for evaluation)"),
    ("max_new_tokens", lambda v: v >= 1, "at least 1 response token"),
    ("max_prompt_tokens", lambda v: v >= 1, "at least 1 prompt token"),
    ("mini_batch_rows", lambda v: v >= 0, "0 (use --minibatches) or the samples per optimizer step"),
    ("eval_every", lambda v: v >= 0, "0 (never) or a number of steps"),
    ("eval_n", lambda v: v >= 1, "at least 1 held-out instance"),
    ("ckpt_every", lambda v: v >= 0, "0 (never) or a number of steps"),
    ("time_limit_min", lambda v: v >= 0, "0 (no limit) or minutes"),
    ("warmup_steps", lambda v: v >= 0, "0 (no format warm-up) or a number of steps"),
    ("batch_std_steps", lambda v: v >= 0, "0 (off) or a number of steps"),
    ("std_floor", lambda v: v >= 0, "0 (off) or a floor in reward units, e.g. 0.25"),
    ("lr_decay", lambda v: 0 <= v <= 1, "a fraction of --steps in [0, 1]"),
    ("lr_min", lambda v: 0 <= v <= 1, "a fraction of --lr in [0, 1]"),
    ("lora_lr_mult", lambda v: v > 0, "above 0"),
    ("lora_alpha", lambda v: v > 0, "above 0 (the adapter's scale is alpha / r)"),
    ("eps_low", lambda v: 0 <= v < 1, "in [0, 1) (the ratio's clip range is [1 - eps_low, 1 + eps_high])"),
    ("eps_high", lambda v: v >= 0, "at least 0"),
    ("dual_clip", lambda v: v == 0 or v > 1, "0 (off) or above 1 (the paper's 3)"),
    ("grad_clip", lambda v: v > 0, "above 0 (a global norm)"),
    ("weight_decay", lambda v: v >= 0, "at least 0"),
    ("kl_coef", lambda v: v >= 0, "0 (off) or a positive weight"),
    ("entropy_coef", lambda v: v >= 0, "0 (off) or a positive weight"),
    ("tis_cap", lambda v: v == 0 or v >= 1, "0 (off) or a cap of at least 1 (trl's default is 2)"),
    ("alpha", lambda v: v >= 0, "at least 0 (the weight of the team reward)"),
    ("invalid_penalty", lambda v: v >= 0, "at least 0"),
    ("search_topk", lambda v: v >= 1, "at least 1 passage per search"),
    ("dynamic_sampling", lambda v: v == 0 or v >= 2, "0 (off) or at least 2 rollouts per step (DAPO's "
                                                      "max_num_gen_batches)"),
    ("alternate_every", lambda v: v >= 0, "0 (every trained role every step) or a number of steps"),
    ("gpu_memory_utilization", lambda v: 0 < v <= 1, "a share of the GPU in (0, 1]"),
    ("tool_timeout", lambda v: v > 0, "above 0 seconds"),
    ("test_timeout", lambda v: v > 0, "above 0 seconds"),
    ("nccl_timeout_min", lambda v: v > 0, "above 0 minutes"),
    ("world", lambda v: v >= 0, "0 (this launch's) or a number of ranks"),
    ("gpu_gb", lambda v: v >= 0, "0 (the GPU's own) or GiB"),
]


def check(cfg, given):
    """Every misuse that can be named before anything loads, each with the flag to change."""
    for name, holds, instead in BOUNDS:
        for value in P.flag_values(cfg, name):
            if not holds(value):
                raise SystemExit(f"--{name} {value}: use {instead}")
    try:
        E.check_task(cfg["task"], cfg["workflow"])
    except ValueError as e:
        raise SystemExit(str(e))
    unknown = [r for r in cfg["train_roles"].split(",") if r and r not in P.task_roles(cfg)]
    if unknown:
        raise SystemExit(f"--train_roles {cfg['train_roles']}: task {cfg['task']!r} has no role {unknown[0]!r}; "
                         f"its roles are {', '.join(P.task_roles(cfg))}")
    if cfg["task"] == "math" and importlib.util.find_spec("math_verify") is None:
        raise SystemExit("--task math scores answers with math-verify, which is not installed: run ./setup.sh, or "
                         "pip install math-verify")
    if cfg["dynamic_sampling"] and cfg["algo"] == "gigpo":
        raise SystemExit("--dynamic_sampling filters one kind of group, and gigpo has two (episodes and anchor "
                         "states): use it with --algo at_grpo, grpo or dr_mas, or drop it")
    if cfg["refill"] != "batch" and not cfg["dynamic_sampling"]:
        raise SystemExit(f"--refill {cfg['refill']} sizes the refills of --dynamic_sampling, which is off here: "
                         "add --dynamic_sampling 3, or drop --refill")
    if cfg["reward"] == "outcome" and cfg["algo"] == "at_grpo":
        raise SystemExit("--reward outcome gives every call its trajectory's final outcome, and a tree's losing "
                         "branches have none: use it with --algo grpo or dr_mas (AT-GRPO scores each call)")
    C.refuse_empty_files(cfg, ("search_train", "search_test"))  # never a silent fallback (issue 61)
    check_search(cfg)
    pols, _ = P.resolve(cfg)  # every role and policy misuse
    tiny_run = P.is_tiny(cfg)
    if torch.cuda.is_available() and cfg["engine"] == "vllm" and len({p.base for p in pols}) > 1:
        raise SystemExit("different base models per role need one vLLM engine each, and vLLM 0.32 allows one "
                         "sleep-mode engine per process (one CuMem allocator): give every role the same base "
                         "(--policies per_role trains a model per role on it), or use --engine torch")
    if cfg["wandb"]:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise SystemExit("--wandb needs the wandb package: pip install wandb (or drop --wandb)")
    if not 0 <= cfg["stop_step"] <= cfg["steps"]:
        raise SystemExit(f"--stop_step {cfg['stop_step']} must lie in [0, --steps {cfg['steps']}] "
                         "(0 = run all the steps)")
    if "batch_std_steps" in given and cfg["batch_std_steps"] > 0 and cfg["scale_rewards"] != "group":
        raise SystemExit(f"--batch_std_steps switches from the step's std to the group's: use it with "
                         f"--scale_rewards group (not {cfg['scale_rewards']}), or drop --batch_std_steps")
    budget = min(P.flag_values(cfg, "max_new_tokens"))
    if tiny_run and cfg["task"] in ("plan", "sokoban") and not 1 <= cfg["warmup_moves"] <= budget - 1:
        raise SystemExit(f"--warmup_moves {cfg['warmup_moves']} must lie in [1, --max_new_tokens - 1 = "
                         f"{budget - 1}]: a warm-up answer and its end of turn must fit the "
                         "response budget")
    if tiny_run and cfg["task"] == "sudoku" and not 1 <= cfg["warmup_moves"] <= 16:
        raise SystemExit(f"--warmup_moves {cfg['warmup_moves']} must lie in [1, 16]: Sudoku's warm-up "
                         "answers fill that many of the 16 cells")
    if cfg["pack"] and cfg["split"] != "groups":
        raise SystemExit("--pack true trains each sibling group as one row, so a group must stay in one "
                         "mini-batch: use --split groups")
    if cfg["pack"] and torch.cuda.is_available() and not tiny_run:
        # flex attention and its block mask compile again for every packed row length (docs/gpu.md)
        raise SystemExit("--pack true is for CPU and the tiny model for now: on CUDA flex attention "
                         "recompiles for every packed row length: drop --pack")
    named = cfg["model"] in M.SIZES and not os.path.exists(cfg["model"])
    if cfg["model"] and not named and not os.path.isfile(os.path.join(cfg["model"], "config.json")):
        raise SystemExit(f"--model {cfg['model']!r} is not a Hugging Face model folder (no config.json): "
                         "download one (e.g. huggingface-cli download Qwen/Qwen3-1.7B --local-dir ...) "
                         "or omit --model")
    if named and not cfg["dry_run"]:
        raise SystemExit(f"--model {cfg['model']} is a named size without weights: use it with --dry_run, "
                         "or point --model at a Qwen3 folder")
    if not tiny_run and not cfg["dry_run"]:
        unseen = C.unseen_gpus()  # else a real model trains on the CPU, for days
        if unseen:
            raise SystemExit(f"nvidia-smi lists {unseen} GPU(s) but torch {torch.__version__} (CUDA "
                             f"{torch.version.cuda}) cannot use them: install a driver that serves that CUDA "
                             "version, or a torch build for this driver, until python -c 'import torch; "
                             "print(torch.cuda.is_available())' says True")
    if P.flag_values(cfg, "top_p") != [1.0]:  # vLLM's processed log-probs are renormalised over the nucleus
        raise SystemExit("--top_p must be 1.0 for training: the sampler's log-probs must be the trainer's "
                         "full softmax")
    if cfg["resume"] and not os.path.exists(os.path.join(cfg["out_dir"], "ckpt", "state.pt")):
        raise SystemExit(f"--resume: no checkpoint in {os.path.join(cfg['out_dir'], 'ckpt')!r}")
    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg["envs_per_step"] % world_env:
        raise SystemExit(f"--envs_per_step {cfg['envs_per_step']} does not divide over {world_env} ranks: "
                         f"use a multiple of {world_env}")


def check_search(cfg):
    """--task search's flags: its files exist, its questions bring passages or a retriever is given."""
    searching = [k for k in ("search_train", "search_test", "retriever") if cfg[k]]
    if searching and cfg["task"] != "search":
        raise SystemExit(f"--{searching[0]} is for --task search")
    for k in ("search_train", "search_test"):
        if cfg[k] and not os.path.isfile(cfg[k]):
            raise SystemExit(f"--{k} {cfg[k]!r}: no such file (a jsonl of questions, Search-R1's or HotpotQA's)")
        if cfg[k] and not cfg["retriever"]:
            try:
                rows = retrieval.load_questions(cfg[k])
            except ValueError as e:
                raise SystemExit(str(e))
            if any(row["passages"] is None for row in rows):
                raise SystemExit(f"--{k}: its questions bring no passages (no HotpotQA context): give them a "
                                 "corpus, --retriever bm25:CORPUS.jsonl or http://HOST:PORT/retrieve")
    if cfg["retriever"].startswith("bm25:") and not os.path.isfile(cfg["retriever"][5:]):
        raise SystemExit(f"--retriever {cfg['retriever']}: no such corpus file (Search-R1's jsonl: id, contents)")
    if cfg["retriever"] and not cfg["retriever"].startswith(("bm25:", "http://", "https://")):
        raise SystemExit(f"--retriever {cfg['retriever']!r}: use bm25:CORPUS.jsonl or http://HOST:PORT/retrieve")


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


def row_logprobs(model, b):
    """Per-token log-probs [B, T] of a collated batch, each at the temperature it was sampled at."""
    return model(b.ids, targets=b.tgt, temperature=b.temp, position_ids=b.pos, mask=b.attn, select=b.sel)


def row_logprobs_entropy(model, b):
    """(log-probs, full-vocabulary entropies), [B, T] each."""
    out = model(b.ids, targets=b.tgt, temperature=b.temp, position_ids=b.pos, mask=b.attn, select=b.sel,
                entropy=True)
    return out[..., 0], out[..., 1]


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
    stats = UpdateStats(trained_tokens=float(sum(len(r.ids) for c in chunks for r in c)))
    if n_mini > 1:  # pi_old: the trainer's log-probs before the first update (not the sampler's)
        with torch.no_grad():
            for chunk in chunks:
                for mb in micro_batches(chunk, cfg["micro_batch_tokens"], C.all_max):
                    # FSDP2 computes in bf16 on GPU
                    logps = row_logprobs(model, collate(mb, device))
                    for row, logp in zip(mb, logps):
                        if row is not DUMMY:
                            row.old = logp[:len(row.tgt)]
    for chunk in chunks:
        # the token-mean's denominator: every response token of this optimizer step, on every rank
        n_tokens = C.all_sum([float(sum(len(r.tgt) for r in chunk))])[0]
        if n_tokens == 0:
            continue
        for mb in micro_batches(chunk, cfg["micro_batch_tokens"], C.all_max):
            b = collate(mb, device)
            entropy = None
            if cfg["entropy_coef"]:
                logp, entropy = row_logprobs_entropy(model, b)
            else:
                logp = row_logprobs(model, b)
            old = logp.detach() if b.old is None else b.old
            ref_logp = None
            if ref is not None:
                with torch.no_grad():
                    ref_logp = row_logprobs(ref, b)
            loss, st = ppo_loss(logp, old, b.adv, b.w, n_tokens, cfg["eps_low"], cfg["eps_high"],
                                cfg["dual_clip"], ref_logp, cfg["kl_coef"], sampler_logp=b.slp,
                                tis_cap=cfg["tis_cap"], entropy=entropy, entropy_coef=cfg["entropy_coef"])
            # FSDP averages gradients over ranks; the mean already spans them
            (loss * world).backward()
            stats.loss += loss.item()
            stats.tokens += st.tokens
            stats.clip_tokens += st.clip_tokens
            stats.clamped_tokens += st.clamped_tokens
            stats.kl_sum += st.kl_sum
            stats.entropy_sum += st.entropy_sum
            stats.dlogp += ((old - b.slp).abs() * b.w).sum().item()  # sampler vs trainer
            stats.sampled_nll -= (b.slp * b.w).sum().item()
        params = [q for g in opt.param_groups for q in g["params"]]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg["grad_clip"])
        if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP2
            grad_norm = grad_norm.full_tensor()
        stats.grad_norm = max(stats.grad_norm, float(grad_norm))
        stats.opt_steps += 1
        opt.step()
        opt.zero_grad(set_to_none=True)
    return stats


def trained_roles(cfg, roles, step):
    """The roles whose samples train at `step`: --train_roles (all by default), taking turns every
    --alternate_every steps when set. A policy none of whose roles trains is not updated at all; a
    shared policy trains on its trained roles' samples only (the frozen roles still sample)."""
    chosen = [r for r in cfg["train_roles"].split(",") if r] or list(roles)
    if cfg["alternate_every"]:
        return {chosen[(step // cfg["alternate_every"]) % len(chosen)]}
    return set(chosen)


def lr_factor(cfg, step):
    """The lr of step `step` (0-based) as a fraction of --lr: constant, then over the last
    --lr_decay of --steps a half cosine down to --lr_min (warmup-stable-decay without the
    warmup)."""
    start = round(cfg["steps"] * (1 - cfg["lr_decay"]))
    if not cfg["lr_decay"] or step < start:
        return 1.0
    t = min(1.0, (step - start) / max(1, cfg["steps"] - start))
    return cfg["lr_min"] + (1 - cfg["lr_min"]) * 0.5 * (1 + math.cos(math.pi * t))


def step_seed(seed, step, rank):
    """The sampling seed of a step on a rank (each of its engine calls adds 7 x its index)."""
    return (seed * 7919 + step * 104729 + rank * 15485863) % (2 ** 31)


# -----------------------------------------------------------------------------
# the step's log: one metrics.jsonl record and one printed line


@dataclass
class Rollout:
    """One rollout of fresh envs: its samples, how many of its episodes were solved, its envs."""
    samples: list
    solved: int
    episodes: int
    envs: int


def rollout_envs(cfg, envs, agents, sampling, rng, timer):
    """The envs played by --algo's rollout: a tree (at_grpo: K candidates per (agent, turn), the best
    branch continues) or K independent trajectories per env (the others), rewards assigned."""
    if cfg["algo"] == "at_grpo":
        samples = tree_rollout(envs, agents, cfg["K"], cfg["turns"], sampling, cfg["alpha"],
                               cfg["branch"], rng, timer)
        return Rollout(samples, sum(e.success for e in envs), len(envs), len(envs))
    samples, trajs = plain_rollout(envs, agents, cfg["K"], cfg["turns"], sampling, cfg["alpha"], timer)
    if cfg["reward"] == "outcome":  # every call: its trajectory's final outcome (Dr. MAS)
        outcome_rewards(samples, trajs, cfg["alpha"], cfg["invalid_penalty"])
    trajectory_returns(samples)
    return Rollout(samples, sum(e.success for ts in trajs for e in ts), len(trajs) * cfg["K"],
                   len(trajs))


@dataclass
class StepStats:
    """This rank's share of a step, gathered over ranks into the step's record."""
    success: float       # episodes that ended in success / episodes
    samples: int
    loss: float          # summed over the policies' updates
    response_tokens: int
    formatted: int       # samples whose answer parsed
    rewards: dict        # mean reward per role and per role@turn (grpo_mas.by_agent_turn)
    calls: dict          # model calls per role (agents may speak a different number of times)
    tokens: dict         # response tokens per role
    zero_var_frac: float
    group_size: float
    timeouts: int        # sandbox programs killed at their time limit
    search_calls: int    # retrievals run, and failed (a failed search is shown to the agent as failed)
    search_failures: int
    mem: dict            # CUDA: the allocator's peak per phase, GiB


def step_record(cfg, step, roles, mine, updates, opts, dlogp_hist, master):
    """The step's metrics, summed or averaged over ranks. |dlogp| (sampler vs trainer log-probs) is
    the stale-sync alarm: bf16 vLLM against the trainer sits near 1e-2 on GPU (fp32 CPU: 1e-7), so
    only a jump against this run's own recent level means something (an engine that stopped
    receiving weights)."""
    ranks = C.gather(mine)
    world = len(ranks)
    n_samples = sum(r.samples for r in ranks)
    rec = {"step": step + 1,
           "success": sum(r.success for r in ranks) / world,
           "samples": n_samples,
           "samples_per_rank": [r.samples for r in ranks],
           "loss": sum(r.loss for r in ranks),
           "format_ok": sum(r.formatted for r in ranks) / max(1, n_samples),
           "resp_tokens": sum(r.response_tokens for r in ranks),
           "lr_factor": lr_factor(cfg, step),
           "timeouts": sum(r.timeouts for r in ranks)}
    if cfg["task"] == "search":
        rec["search_calls"] = sum(r.search_calls for r in ranks)
        rec["search_failures"] = sum(r.search_failures for r in ranks)
        if rec["search_failures"] and master:
            print(f"warning: {rec['search_failures']} of {rec['search_calls']} searches failed this step "
                  "(the agents saw them as failed; is the retriever up?)", flush=True)
    for role in roles:
        vals = [r.rewards[role] for r in ranks if role in r.rewards]
        rec[f"reward_{role}"] = sum(vals) / max(1, len(vals))
        rec[f"calls_{role}"] = sum(r.calls.get(role, 0) for r in ranks)
        rec[f"tokens_{role}"] = sum(r.tokens.get(role, 0) for r in ranks)
    rec["zero_var_frac"] = sum(r.zero_var_frac for r in ranks) / world
    rec["group_size"] = sum(r.group_size for r in ranks) / world
    summed = ("tokens", "clip_tokens", "clamped_tokens", "dlogp", "kl_sum", "entropy_sum", "sampled_nll",
              "trained_tokens")
    rec["trained_tokens"] = 0.0
    for p, u in enumerate(updates):
        tot = dict(zip(summed, C.all_sum([getattr(u, k) for k in summed])))
        tokens = max(1, tot["tokens"])
        rec["trained_tokens"] += tot["trained_tokens"]
        rec[f"clip_frac_p{p}"] = tot["clip_tokens"] / tokens
        rec[f"dlogp_p{p}"] = tot["dlogp"] / tokens
        rec[f"clamped_p{p}"] = int(tot["clamped_tokens"])
        # the sampled tokens' mean -log p: a one-sample estimate of the per-token entropy at the
        # sampling temperature, free (the sampler returned it); a freeze drives it toward 0
        rec[f"nll_p{p}"] = tot["sampled_nll"] / tokens
        recent = sorted(dlogp_hist[p][-10:])
        median = recent[len(recent) // 2] if recent else 0.0
        jump = bool(recent) and rec[f"dlogp_p{p}"] > max(1e-5, 3 * median)
        rec[f"dlogp_jump_p{p}"] = jump
        dlogp_hist[p].append(rec[f"dlogp_p{p}"])
        if jump and master:
            print(f"warning: policy {p}'s sampler/trainer |dlogp| jumped to {rec[f'dlogp_p{p}']:.1e} "
                  f"(recent median {median:.1e}): is the engine receiving the weights?", flush=True)
        rec[f"grad_norm_p{p}"] = u.grad_norm
        rec[f"opt_steps_p{p}"] = u.opt_steps  # the same on every rank
        rec[f"lr_p{p}"] = opts[p].param_groups[0]["lr"]
        if cfg["kl_coef"]:
            rec[f"kl_p{p}"] = tot["kl_sum"] / tokens
        if cfg["entropy_coef"]:  # mean full-vocabulary entropy over the trained tokens (nats)
            rec[f"entropy_p{p}"] = tot["entropy_sum"] / tokens
    if C.DEVICE.type == "cuda":  # the allocator's peak per phase, the largest over ranks (GiB)
        for k in mine.mem:
            rec[k] = max(r.mem[k] for r in ranks)
    return rec


def calls_per_role(samples):
    calls = {}
    for s in samples:
        calls[s.role] = calls.get(s.role, 0) + 1
    return calls


def tokens_per_role(samples):
    tokens = {}
    for s in samples:
        tokens[s.role] = tokens.get(s.role, 0) + len(s.response_ids)
    return tokens


def step_line(rec, roles, n_policies, eta):
    """The one printed line per step."""
    rewards = " ".join(f"r_{r} {rec[f'reward_{r}']:+.2f} ({rec[f'calls_{r}']})" for r in roles)
    per_policy = " ".join(f"p{p} clip {rec[f'clip_frac_p{p}']:.3f} gn {rec[f'grad_norm_p{p}']:.2f} "
                          f"|dlogp| {rec[f'dlogp_p{p}']:.1e}" for p in range(n_policies))
    if "trained_roles" in rec:
        rewards += " | trains " + ",".join(rec["trained_roles"])
    if "rollouts" in rec:  # --dynamic_sampling
        rewards += f" | rollouts {rec['rollouts']:.1f} trains {rec['trained_samples']} smp"
    line = (f"step {rec['step']:4d} | succ {rec['success']:.2f} {rewards} | fmt {rec['format_ok']:.2f} "
            f"zv {rec['zero_var_frac']:.2f} | {per_policy} | {rec['samples']} smp {rec['resp_tokens']} tok | "
            f"gen {rec['t_gen']:.1f}s env {rec['t_env']:.1f}s train {rec['t_train']:.1f}s "
            f"sync {rec['t_sync']:.1f}s")
    if "mem_train" in rec:
        line += f" | GiB gen {rec['mem_rollout']:.1f} train {rec['mem_train']:.1f} sync {rec['mem_sync']:.1f}"
    return line + f" | eta {eta / 60:.1f}m"


# -----------------------------------------------------------------------------
# main: set up, then each step rollout -> advantages -> update -> weight sync -> log -> eval /
# checkpoint


def main(argv):
    cfg = configure(argv)
    if cfg["dry_run"]:
        print(P.optimizer_steps_line(cfg))
        raise SystemExit(memory.print_plan(cfg))
    memory.refuse_if_too_big(cfg)  # a GPU run that cannot fit stops before anything loads
    C.check_run_folder(cfg)  # never replace a run unasked; a resume continues it as saved
    rank, world = C.setup_dist(cfg["nccl_timeout_min"])
    master = rank == 0
    if master:
        print(config_line(cfg), flush=True)
        print(P.optimizer_steps_line(cfg), flush=True)
        print("sampling: " + "; ".join(f"{r} " + ", ".join(f"{k} {v}" for k, v in s.items())
                                       for r, s in cfg["role_sampling"].items()), flush=True)
    if master and P.is_tiny(cfg) and cfg["task"] in ("code", "math"):
        print(f"note: the tiny model cannot learn {cfg['task']} (it only exercises the code path); "
              "use --model for real runs")

    # --- set up: the policies (models, optimizers, engines), the agents, the data, the run folder
    pols, role_to_policy = P.resolve(cfg)
    bases = tiny.bases(cfg, pols, master, world)  # HF folders (the tiny ones built once, cached)
    start = C.open_run(cfg, pols, master)
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(bases[0])  # Qwen3 sizes share one tokenizer
    torch.manual_seed(cfg["seed"])
    ckpt_dir = os.path.join(cfg["out_dir"], "ckpt")
    models, opts, refs, engines = P.build(cfg, pols, bases, ckpt_dir, rank, C.DEVICE)
    if master:
        for p, pol in enumerate(pols):
            print(P.describe(cfg, p, pol, opts[p]), flush=True)
    E.set_timeouts(cfg["tool_timeout"], cfg["test_timeout"])
    if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1:  # the node's cores shared by its ranks
        sandbox.set_workers(sandbox.per_rank(int(os.environ["LOCAL_WORLD_SIZE"])))
    agents = Agents(tokenizer, engines, role_to_policy, cfg["max_prompt_tokens"])
    compact = P.is_tiny(cfg) and cfg["task"] in E.GENERATED
    team = P.parse_team(cfg)
    search = search_settings(cfg)  # --task search: the retriever (a server is asked once here)
    rows = None
    if cfg["task"] in ("code", "math") or cfg["search_train"]:
        rows = E.load_split(cfg["task"], "train", [cfg["search_train"]] if cfg["search_train"] else None)
    test_files = [cfg["search_test"]] if cfg["search_test"] else None
    test_envs = E.test_set(cfg["task"], n=cfg["eval_n"], compact=compact, workflow=cfg["workflow"],
                           files=test_files, limit=cfg["eval_n"], team=team, turns=cfg["turns"],
                           search=search)
    log = MetricsLog(cfg, master)
    roles = P.task_roles(cfg)
    sampling = {r: Sampling(**s) for r, s in cfg["role_sampling"].items()}
    envs_per_rank = cfg["envs_per_step"] // world
    t_process = time.time()
    t_run = t_process - start.time_before  # the run's clock counts across resumes
    if start.step == 0 and cfg["eval_every"]:
        res = held_out(test_envs, agents, cfg, 0, rank, world, master)
        log.write({"step": 0, "eval_success": res["accuracy"], "eval_ci": res["ci"], "time": 0.0})
    C.cuda_peak_gib()
    dlogp_hist = [[] for _ in pols]

    C.finish_steps_on_signal()  # Ctrl-C / SIGTERM from here: finish the step, checkpoint, stop
    for step in range(start.step, cfg["steps"]):
        t0 = time.time()
        timer = {}  # seconds of generation ("gen") and env scoring ("env")
        timeouts_before = sandbox.stats["timeouts"]
        searches_before = dict(retrieval.stats)

        # --- rollout: this rank's share of the step's fresh envs
        rng = random.Random(f"{cfg['seed']}-{step}-{rank}")
        agents.reseed(step_seed(cfg["seed"], step, rank))
        episodes = []  # each rollout's Rollout (one unless --dynamic_sampling)

        def rollout(n_envs):  # fresh envs, numbered after this step's earlier envs
            if n_envs == 0:  # --refill missing: this rank has its groups
                return []
            envs = [E.train_env(cfg["task"], rng, cfg["workflow"], compact, rows, team=team,
                                turns=cfg["turns"], search=search)
                    for _ in range(n_envs)]
            batch = rollout_envs(cfg, envs, agents, sampling, rng, timer)
            envs_before = sum(b.envs for b in episodes)
            for s in batch.samples:
                s.env += envs_before
            episodes.append(batch)
            return batch.samples

        samples = rollout(envs_per_rank)
        filled = None
        if cfg["dynamic_sampling"]:  # DAPO: more fresh envs until enough groups carry a signal
            filled = dapo_fill(samples, rollout, cfg["algo"], cfg["dynamic_sampling"], cfg["refill"],
                               C.all_sum)
            samples = filled.generated
        success = sum(b.solved for b in episodes) / sum(b.episodes for b in episodes)

        # --- advantages: the group key and the normalized value of --algo
        scale = cfg["scale_rewards"]
        if scale == "group" and step < cfg["batch_std_steps"]:
            scale = "batch"
        if cfg["algo"] == "gigpo":  # episode groups plus anchor-state step groups
            kept, group_stats = gigpo_advantages(samples, cfg["gigpo_gamma"], cfg["gigpo_step_weight"],
                                                 "none" if scale == "none" else "group")
        else:
            trainable = filled.kept if filled else samples
            kept, group_stats = compute_advantages(trainable, cfg["algo"], cfg["drop_zero_var"], scale,
                                                   C.all_sum, std_floor=cfg["std_floor"])
            if filled:  # the freeze as without the filter: over every group generated
                group_stats.zero_var_frac = filled.zero_var_frac
        mem = {"mem_rollout": C.cuda_peak_gib()}
        trained = trained_roles(cfg, roles, step)  # --train_roles, --alternate_every: the others sit still
        kept = [s for s in kept if s.role in trained]

        # --- update: one PPO-clip update per policy on its roles' samples (CUDA: the engines sleep)
        for engine in P.distinct_engines(engines):
            engine.sleep()
        t1 = time.time()
        updates = []
        for p, pol in enumerate(pols):
            if not set(pol.roles) & trained:  # a frozen policy: no update, its weights bit-identical
                updates.append(UpdateStats())
                continue
            # the lr is a function of the step: a resume follows it
            for group in opts[p].param_groups:
                group["lr"] = pol.lr * lr_factor(cfg, step)
            its_samples = [s for s in kept if s.policy == p]
            model_p = P.use_policy(models, pols, p)
            settings = P.settings(cfg, pol)  # its own lr, micro-batch tokens, mini-batches
            updates.append(update_policy(model_p, opts[p], its_samples, settings, world, C.DEVICE,
                                         refs[p]))
        mem["mem_train"] = C.cuda_peak_gib()
        t2 = time.time()

        # --- weight sync: each policy's new weights into its engine (streamed; wakes it first)
        for p in range(len(pols)):
            engines[p].sync(P.use_policy(models, pols, p))
        mem["mem_sync"] = C.cuda_peak_gib()
        t3 = time.time()

        # --- log, evaluate, checkpoint
        step_stats = StepStats(success=success, samples=len(samples),
                               loss=sum(u.loss for u in updates),
                               response_tokens=sum(len(s.response_ids) for s in samples),
                               formatted=sum(s.formatted for s in samples),
                               rewards=by_agent_turn(samples), calls=calls_per_role(samples),
                               tokens=tokens_per_role(samples),
                               zero_var_frac=group_stats.zero_var_frac, group_size=group_stats.group_size,
                               timeouts=sandbox.stats["timeouts"] - timeouts_before, mem=mem,
                               search_calls=retrieval.stats["calls"] - searches_before["calls"],
                               search_failures=retrieval.stats["failures"] - searches_before["failures"])
        rec = step_record(cfg, step, roles, step_stats, updates, opts, dlogp_hist, master)
        if len(trained) < len(roles):
            rec["trained_roles"] = sorted(trained)
        if filled:
            rec["rollouts"] = C.all_sum([float(filled.rollouts)])[0] / world
            rec["trained_samples"] = int(C.all_sum([float(len(kept))])[0])
        rec.update(t_gen=timer.get("gen", 0.0), t_env=timer.get("env", 0.0), t_train=t2 - t1,
                   t_sync=t3 - t2, t_step=t3 - t0, time=time.time() - t_run)
        done_here = step + 1 - start.step
        eta = C.eta_seconds(cfg, step + 1, done_here, time.time() - t_process, time.time() - t_run)
        if master:
            print(step_line(rec, roles, len(pols), eta), flush=True)
        last = step + 1
        out_of_time = C.out_of_time_all(cfg, time.time() - t_run)
        stop = C.stop_requested_all(last)  # a signal on any rank: every rank checkpoints and stops
        final = last in (cfg["steps"], cfg["stop_step"]) or out_of_time
        if cfg["eval_every"] and (last % cfg["eval_every"] == 0 or final):
            res = held_out(test_envs, agents, cfg, last, rank, world, master)
            rec.update(eval_success=res["accuracy"], eval_ci=res["ci"])
        log.write(rec)
        if cfg["ckpt_every"] and (last % cfg["ckpt_every"] == 0 or final or stop):
            save(cfg, last, models, opts, pols, engines, tokenizer, rank, time.time() - t_run)
        C.cuda_peak_gib()
        if out_of_time and master:
            print(f"time limit of {cfg['time_limit_min']} min reached after step {last}")
        if final or stop:
            break

    for engine in P.distinct_engines(engines):  # engines first: vLLM's own groups go before ours
        engine.close()
    log.close()
    if C.OWN_GROUP:
        C.close_dist()
    C.exit_if_stopped(master)  # one line with the command that resumes, exit status 128 + signal


def search_settings(cfg):
    """--task search: passages per search, the retriever (None: each question's own passages: the
    generated worlds, HotpotQA's context), the answer's metric. A retrieval server is asked once here."""
    if cfg["task"] != "search":
        return None
    retriever = None
    if cfg["retriever"].startswith("bm25:"):
        retriever = retrieval.BM25(retrieval.load_corpus(cfg["retriever"][5:]))
    elif cfg["retriever"]:
        retriever = retrieval.HttpRetriever(cfg["retriever"])
        retriever.check()
    return dict(topk=cfg["search_topk"], retriever=retriever, metric=cfg["search_metric"])


def held_out(test_envs, agents, cfg, step, rank, world, master):
    """The in-run monitor: greedy plain rollouts of the held-out set (eval.py gives the paper's
    protocol)."""
    greedy = {r: Sampling(**dict(s, temperature=0.0)) for r, s in cfg["role_sampling"].items()}
    res = evaluate(test_envs, agents, cfg["turns"], greedy, k=1, rank=rank, world=world)
    if master:
        print(f"eval step {step}: held-out success {res['accuracy']:.3f} "
              f"(95% CI {res['ci'][0]:.3f}-{res['ci'][1]:.3f}, n={res['n']}, greedy)")
    return res


class MetricsLog:
    """metrics.jsonl on rank 0, and the same numbers to Weights & Biases with --wandb."""

    def __init__(self, cfg, master):
        self.path = os.path.join(cfg["out_dir"], "metrics.jsonl")
        self.master = master
        self.wandb = None
        if master and cfg["wandb"]:
            import wandb
            name = os.path.basename(os.path.abspath(cfg["out_dir"]))
            self.wandb = wandb.init(project=cfg["wandb"], name=name, config=cfg)

    def write(self, rec):
        if self.master:
            with open(self.path, "a") as f:
                f.write(json.dumps(rec) + "\n")
        if self.wandb is not None:
            numbers = {k: v for k, v in rec.items() if isinstance(v, (int, float)) and k != "step"}
            self.wandb.log(numbers, step=rec["step"])

    def close(self):
        if self.wandb is not None:
            self.wandb.finish()


def save(cfg, step, models, opts, pols, engines, tokenizer, rank, elapsed):
    """A checkpoint after `step` (CUDA: the engines park their weights on the host meanwhile)."""
    for engine in P.distinct_engines(engines):
        engine.sleep(level=1)
    export_dtype = None if P.is_tiny(cfg) else torch.bfloat16
    C.save_checkpoint(cfg["out_dir"], step, models, opts, pols, tokenizer, rank,
                      os.path.join(cfg["out_dir"], "metrics.jsonl"), export_dtype, elapsed)


if __name__ == "__main__":
    C.stop_on_signals()  # Ctrl-C and SIGTERM: one line and a resumable run, never a traceback
    main(sys.argv[1:])
