"""
On-policy RL of a multi-agent LLM system: AT-GRPO and the baselines.

    python train.py                                        # CPU: tiny Qwen3 on compact Plan-Path, learns in minutes
    python train.py --algo grpo                            # ablations: --algo grpo|dr_mas, --policies per_role, ...
    torchrun --nproc_per_node=8 train.py --task plan --model /path/Qwen3-1.7B     # the paper's setting

One step: sample E fresh envs per rank -> tree rollouts (rollout.py) -> groups and advantages (grpo_mas.py) ->
one PPO-clip update per policy on its roles' samples -> push the new weights into each policy's engine -> log,
evaluate, checkpoint. Who plays which role is policies.py; flags, torchrun and checkpoints are common.py; the tiny
default's base model is tiny.py.

What this script simplifies, and why:
 1. Rollout and training take turns on the same devices (no separate generation pool). On CUDA the vLLM engine
    sleeps during the update (its weights and KV cache freed) and wakes for the weight sync and for generation;
    on CPU it stays up. Simple and enough for a node; pipelining the two is an optimization.
 2. pi_old is the policy that sampled (SPEC §3.3): with one mini-batch per step it is pi_theta detached; with
    `--minibatches N` the trainer recomputes it before the first optimizer step.
 3. Every rank holds one engine and generates for its own envs; there is no central scheduler. Several policies
    on one base take turns in that engine (weights swapped in from a host copy, policies.PolicySwitch).
 4. No critic, no KL and no entropy bonus by default (the paper's setting); `--kl_coef` adds a k3 KL to the
    initial weights, `--entropy_coef` an entropy bonus.
 5. Before loading anything, memory.py plans the per-rank GPU memory of the configuration and a GPU run that
    cannot fit stops with the flag to change (`--dry_run` prints the plan and exits).
 6. Without --model the run is the embedded default: a tiny random Qwen3 warmed up on the answer format only
    (tiny.py) on a compact game, through the same code path, with its own row of PRESETS (why each value differs
    from the paper's: docs/design.md, "The tiny default").
"""
import json
import math
import os
import random
import sys
import time

import torch

import common as C
import envs as E
import model as M
import policies as P
import sandbox
from grpo_mas import DUMMY, by_agent_turn, collate, compute_advantages, make_rows, micro_batches, ppo_loss, \
    split_minibatches, trajectory_returns
from rollout import Agents, plain_rollout, tree_rollout

# -----------------------------------------------------------------------------
# config: every global below is a flag (--name value or --name=value); so is every row of PRESETS
task = "plan"              # plan | sokoban | sudoku | code | math
model = ""                 # HF Qwen3 folder; "" = the embedded tiny model and the compact task configuration
preset = ""                # a column of PRESETS; "" = paper with --model, else tiny (tiny-sokoban, tiny-sudoku for those games)
algo = "at_grpo"           # at_grpo | grpo | dr_mas: the group key and the normalization scope (grpo_mas.py)
workflow = "mas"           # mas: both agents; single: the plan agent / coder / reasoner alone
policies = "shared"        # shared | per_role | per_type | lora: which roles share a policy (policies.py)
team = ""                  # --task math: "N,M" = N reasoners and M tool agents answer in parallel, then a judge (N+M+1 agents)
team_mode = "aggregate"    # --team: aggregate (one turn, 1/0 rewards, no team term: the reference's) | refine (--turns turns)
policy = ""                # ROLE=PATH (repeatable): that role's base model (a HF folder, or tiny / tiny-small); roles naming one path share a policy
lora_rank = 16             # --policies lora: adapter rank r (every linear of every layer, model.LORA_TARGETS)
lora_alpha = 32.0          # --policies lora: adapter scale alpha / r
K = 4                      # candidates per (agent, turn) node (at_grpo) or trajectories per env (grpo, dr_mas)
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
std_floor = 0.0            # group/batch: divide by max(std, this), in reward units; 0 = the paper's plain std
top_p = 1.0                # 1.0 so that the sampler's log-probs are the trainer's full-softmax log-probs
engine = "vllm"            # vllm | torch (the pure-torch KV-cache sampler) | scripted (answers from the data: tests, benchmarks)
seed = 0                   # seeds the tiny base, the envs, sampling and the adapters' initialisation
out_dir = "runs/default"   # metrics.jsonl, config.json, a copy of the code, ckpt/; the tiny base is cached next to it
resume = False             # continue from out_dir/ckpt
stop_step = 0              # stop (with a final eval and checkpoint) after this step; 0 = at --steps. The lr schedule still
                           # spans --steps, so a run stopped at step N equals the first N steps of the full run
compile = False            # torch.compile each decoder layer (in place, HF names kept)
pack = False               # true: samples sharing a prompt (tree siblings) train as one row, the prompt once (grpo_mas.Row)
split = "strided"          # how a batch is cut into --minibatches: strided (sample i -> mini-batch i mod N) or groups (whole
                           # sibling groups, verl's way); --pack true needs and sets groups
dry_run = False            # print the per-rank GPU memory plan of this configuration and exit (--model may be 0.6B|1.7B|4B|8B)
world = 0                  # --dry_run: ranks to plan for (0 = this launch's WORLD_SIZE)
gpu_gb = 0.0               # GiB per GPU to plan for (0 = the GPU's own, or 80 for --dry_run without one)
nccl_timeout_min = 60.0    # collective timeout: above the worst rank skew (sandbox timeouts, checkpoint writes)
wandb = ""                 # PROJECT: also log every metrics line to Weights & Biases (pip install wandb; not installed by setup.sh)
tool_timeout = 5.0         # seconds for a tool agent's program (games, math) in the sandbox
test_timeout = 6.0         # seconds per code test (LiveCodeBench's own limit)

PRESET_NAMES = ("paper", "paper-math", "paper-code", "tiny", "tiny-sokoban", "tiny-sudoku")
# PRESETS: each flag's value in each preset, in PRESET_NAMES' order. paper: the reference's scripts and SPEC §6, value
# by value in docs/paper_preset.md; tiny: the 2-core CPU default, why each value in docs/design.md ("The tiny default")
PRESETS = {
    "turns":                  (3,       3,       3,       4,       4,       4),       # T, max turns per episode
    "envs_per_step":          (128,     128,     128,     16,      16,      16),      # E, env instances per step over all ranks
    "mini_batch_rows":        (32,      32,      32,      0,       0,       0),       # samples per optimizer step, all ranks (verl's); 0: --minibatches
    "minibatches":            (2,       2,       2,       4,       4,       4),       # --mini_batch_rows 0: optimizer steps per batch; tool=2,plan=4
    "steps":                  (400,     400,     400,     250,     250,     50),      # training steps; the lr schedule spans them
    "lr":                     (1e-6,    1e-6,    1e-6,    5e-4,    5e-4,    5e-4),    # AdamW learning rate; per role: tool=1e-6,plan=2e-6
    "lora_lr_mult":           (1.0,     1.0,     1.0,     10.0,    10.0,    10.0),    # --policies lora without --lr: this x the preset's lr
    "lr_decay":               (0.0,     0.0,     0.0,     1.0,     1.0,     1.0),     # last fraction of --steps: lr falls (half cosine) to lr_min x lr; 0 = constant
    "scale_rewards":          ("group", "group", "group", "batch", "group", "group"), # group: (r - mean) / group std; none: r - mean; batch: / the step's std
    "batch_std_steps":        (0,       0,       0,       60,      60,      60),      # with --scale_rewards group: the first N steps use the step's std
    "temperature":            (0.6,     0.6,     0.6,     0.7,     1.0,     1.0),     # training temperature (the trainer divides logits by it too)
    "thinking":               (False,   False,   False,   False,   False,   False),   # Qwen3's chat-template thinking switch
    "max_new_tokens":         (2048,    8192,    4096,    8,       8,       17),      # response tokens per call (tiny: the compact answer)
    "max_prompt_tokens":      (8192,    8192,    8192,    256,     256,     256),     # prompt tokens per call (head and tail kept)
    "max_model_len":          (10240,   16384,   12288,   512,     512,     512),     # engine context (clamped to the model's)
    "micro_batch_tokens":     (16384,   16384,   16384,   8192,    8192,    8192),    # padded tokens per micro-batch; tool=8192,plan=16384
    "eval_every":             (20,      20,      20,      10,      10,      10),      # held-out eval every N steps (0 = never), and at 0 and the end
    "eval_n":                 (100,     100,     100,     200,     200,     200),     # held-out instances (games: test seeds; code/math: first N rows)
    "ckpt_every":             (20,      20,      20,      10,      10,      10),      # checkpoint every N steps
    "time_limit_min":         (0.0,     0.0,     0.0,     15.0,    15.0,    15.0),    # stop (final eval + checkpoint) after N minutes; 0 = no limit
    "warmup_steps":           (0,       0,       0,       150,     600,     600),     # tiny only: format warm-up steps (valid answers, no solutions)
    "warmup_moves":           (0,       0,       0,       4,       4,       16),      # tiny only: warm-up answers of 1..N moves (Sudoku: fills)
    "grad_checkpoint":        (True,    True,    True,    False,   False,   False),   # activation checkpointing per decoder layer
    "tis_cap":                (2.0,     2.0,     2.0,     0.0,     0.0,     0.0),     # truncated IS: loss x min(exp(old - sampler logp), C); 0 = off
    "gpu_memory_utilization": (0.5,     0.5,     0.5,     0.3,     0.3,     0.3),     # vLLM's share of each GPU while awake
}
CHOICES = {"task": list(E.TASKS), "algo": ["at_grpo", "grpo", "dr_mas"], "workflow": ["mas", "single"], "preset": ["", *PRESET_NAMES], "team_mode": ["aggregate", "refine"],
           "policies": ["shared", "per_role", "per_type", "lora"], "split": ["strided", "groups"],
           "engine": ["vllm", "torch", "scripted"], "branch": ["greedy", "random"], "scale_rewards": ["group", "none", "batch"]}
FLAGS = {k: v for k, v in globals().items() if not k.startswith("_") and isinstance(v, (int, float, bool, str))}


def configure(argv):
    """Flags -> the run's whole configuration: the preset's column, every flag given on top, checks before anything
    loads. Returns the cfg dict (printed at start, saved as config.json)."""
    cfg = {**FLAGS, **{k: v[0] for k, v in PRESETS.items()}}  # the paper's values give each preset flag its type
    help_text = ("usage: python train.py [--flag value | --flag=value ...]\n\n"
                 + C.usage(__file__, set(cfg)) + "\n\n(preset flags show their value in " + ", ".join(PRESET_NAMES) + ")")
    given = C.parse_flags(argv, cfg, CHOICES, per_role=P.PER_ROLE, repeatable=("policy",), help_text=help_text)
    cfg["preset"] = cfg["preset"] or ("tiny" + {"sokoban": "-sokoban", "sudoku": "-sudoku"}.get(cfg["task"], "")
                                      if P.is_tiny(cfg) else "paper" + {"math": "-math", "code": "-code"}.get(cfg["task"], ""))
    row = {k: v[PRESET_NAMES.index(cfg["preset"])] for k, v in PRESETS.items()}
    cfg.update({k: v for k, v in row.items() if k not in given})
    if cfg["policies"] == "lora":  # adapters without --lr (and roles --lr does not name): lora_lr_mult x the preset's
        row["lr"] *= cfg["lora_lr_mult"]
        cfg["lr"] = cfg["lr"] if "lr" in given else row["lr"]
    cfg["role_defaults"] = {k: row[k] for k in P.PER_ROLE}  # a per-role flag's value for the roles it does not name
    if cfg["pack"] and "split" not in given:
        cfg["split"] = "groups"
    if "batch_std_steps" in given and cfg["batch_std_steps"] > 0 and cfg["scale_rewards"] != "group":
        raise SystemExit(f"--batch_std_steps switches from the step's std to the group's: use it with --scale_rewards group "
                         f"(not {cfg['scale_rewards']}), or drop --batch_std_steps")
    check(cfg)
    context = min(P.model_config(cfg, p.base).max_position_embeddings for p in P.resolve(cfg)[0])
    cfg["max_model_len"], cfg["max_prompt_tokens"], cfg["max_new_tokens"] = C.fit_context(
        cfg["max_model_len"], cfg["max_prompt_tokens"], cfg["max_new_tokens"], context)
    return cfg


def check(cfg):
    """Every misuse that can be named before anything loads, with the flag to change."""
    E.check_task(cfg["task"], cfg["workflow"])
    pols, _ = P.resolve(cfg)  # every role/policy misuse
    if torch.cuda.is_available() and cfg["engine"] == "vllm" and len({p.base for p in pols}) > 1:
        raise SystemExit("different base models per role need one vLLM engine each, and vLLM 0.32 allows one sleep-mode "
                         "engine per process (one CuMem allocator): give every role the same base (--policies per_role "
                         "trains a model per role on it), or use --engine torch")
    if cfg["wandb"]:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise SystemExit("--wandb needs the wandb package: pip install wandb (or drop --wandb)")
    if not (0 <= cfg["lr_decay"] <= 1 and 0 <= cfg["lr_min"] <= 1):
        raise SystemExit("--lr_decay (a fraction of --steps) and --lr_min (a fraction of --lr) must lie in [0, 1]")
    if not 0 <= cfg["stop_step"] <= cfg["steps"]:
        raise SystemExit(f"--stop_step {cfg['stop_step']} must lie in [0, --steps {cfg['steps']}] (0 = run all the steps)")
    tiny = P.is_tiny(cfg)
    if tiny and cfg["task"] in ("plan", "sokoban") and not 1 <= cfg["warmup_moves"] <= cfg["max_new_tokens"] - 1:
        raise SystemExit(f"--warmup_moves {cfg['warmup_moves']} must lie in [1, --max_new_tokens - 1 = "
                         f"{cfg['max_new_tokens'] - 1}]: a warm-up answer and its end of turn must fit the response budget")
    if tiny and cfg["task"] == "sudoku" and not 1 <= cfg["warmup_moves"] <= 16:
        raise SystemExit(f"--warmup_moves {cfg['warmup_moves']} must lie in [1, 16]: Sudoku's warm-up answers fill that many of the 16 cells")
    if cfg["pack"] and cfg["split"] != "groups":
        raise SystemExit("--pack true trains each sibling group as one row, so a group must stay in one mini-batch: "
                         "use --split groups")
    if cfg["pack"] and torch.cuda.is_available() and not P.is_tiny(cfg):  # past Dynamo's recompile limit flex runs eager
        raise SystemExit("--pack true is for CPU and the tiny model for now: on CUDA flex attention and its block mask "
                         "compile again for every packed row length (an H100's first packed 1.7B update had not finished "
                         "after 2 min; docs/gpu.md): drop --pack")
    named = cfg["model"] in M.SIZES and not os.path.exists(cfg["model"])
    if cfg["model"] and not named and not os.path.isfile(os.path.join(cfg["model"], "config.json")):
        raise SystemExit(f"--model {cfg['model']!r} is not a Hugging Face model folder (no config.json): "
                         "download one (e.g. huggingface-cli download Qwen/Qwen3-1.7B --local-dir ...) or omit --model")
    if named and not cfg["dry_run"]:
        raise SystemExit(f"--model {cfg['model']} is a named size without weights: use it with --dry_run, or point --model "
                         "at a Qwen3 folder")
    if not tiny and not cfg["dry_run"] and (unseen := C.unseen_gpus()):  # else a real model trains on the CPU, for days
        raise SystemExit(f"nvidia-smi lists {unseen} GPU(s) but torch {torch.__version__} (CUDA "
                         f"{torch.version.cuda}) cannot use them: install a driver that serves that CUDA version, or a torch "
                         "build for this driver, until python -c 'import torch; print(torch.cuda.is_available())' says True")
    if cfg["top_p"] != 1.0:  # vLLM's processed log-probs are renormalised over the nucleus; the trainer's are not
        raise SystemExit("--top_p must be 1.0 for training: the sampler's log-probs must be the trainer's full softmax")
    if cfg["batch_std_steps"] < 0:
        raise SystemExit(f"--batch_std_steps {cfg['batch_std_steps']} must be >= 0 (0 = off)")
    if not cfg["std_floor"] >= 0.0:
        raise SystemExit(f"--std_floor {cfg['std_floor']} must be >= 0 (0 = off; a floor in reward units, e.g. 0.25)")
    if cfg["resume"] and not os.path.exists(os.path.join(cfg["out_dir"], "ckpt", "state.pt")):
        raise SystemExit(f"--resume: no checkpoint in {os.path.join(cfg['out_dir'], 'ckpt')!r}")
    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg["envs_per_step"] % world_env:
        raise SystemExit(f"--envs_per_step {cfg['envs_per_step']} does not divide over {world_env} ranks: use a multiple of {world_env}")


# -----------------------------------------------------------------------------
# the update of one policy


def row_logprobs(model, b, cfg, entropy=False):
    """Per-token log-probs [B, T] of a collated batch; with `entropy`, (log-probs, entropies) [B, T] each."""
    out = model(b.ids, targets=b.tgt, temperature=cfg["temperature"], position_ids=b.pos, mask=b.attn, select=b.sel,
                entropy=entropy)
    return (out[..., 0], out[..., 1]) if entropy else out


def update_policy(model, opt, samples, cfg, world, device, ref=None):
    """PPO-clip on this rank's samples of one policy: one optimizer step per mini-batch, each a token-mean over all
    ranks. Every rank runs the same number of FSDP forwards (micro_batches pads with zero-weight rows)."""
    samples = [s for s in samples if s.response_ids]
    n_mini = cfg["minibatches"]
    if cfg["mini_batch_rows"]:  # verl: each rank's batch cut into mini-batches of ppo_mini_batch_size x n / world rows
        n_mini = C.all_max(max(1, math.ceil(len(samples) / max(1, cfg["mini_batch_rows"] // world))))
    chunks = [make_rows(c, cfg["pack"]) for c in split_minibatches(samples, n_mini, cfg["split"])]
    rows = [r for c in chunks for r in c]
    stats = dict(loss=0.0, clip_tokens=0.0, tokens=0.0, clamped_tokens=0.0, dlogp=0.0, kl_sum=0.0, entropy_sum=0.0, grad_norm=0.0,
                 rows=len(rows), trained_tokens=float(sum(len(r.ids) for r in rows)), opt_steps=0)
    if n_mini > 1:  # pi_old: the trainer's log-probs before the first update (not the sampler's)
        with torch.no_grad():
            for chunk in chunks:
                for mb in micro_batches(chunk, cfg["micro_batch_tokens"], C.all_max):
                    lp = row_logprobs(model, collate(mb, device), cfg)  # no autocast: FSDP2 computes in bf16 on GPU
                    for r, lr in zip(mb, lp):
                        if r is not DUMMY:
                            r.old = lr[:len(r.tgt)]
    for chunk in chunks:
        n_tok = C.all_sum([float(sum(len(r.tgt) for r in chunk))])[0]
        if n_tok == 0:
            continue
        for mb in micro_batches(chunk, cfg["micro_batch_tokens"], C.all_max):
            b = collate(mb, device)
            lp, ent = row_logprobs(model, b, cfg, entropy=True) if cfg["entropy_coef"] else (row_logprobs(model, b, cfg), None)
            old = lp.detach() if b.old is None else b.old
            ref_lp = None
            if ref is not None:
                with torch.no_grad():
                    ref_lp = row_logprobs(ref, b, cfg)
            loss, st = ppo_loss(lp, old, b.adv, b.w, n_tok, cfg["eps_low"], cfg["eps_high"], cfg["dual_clip"], ref_lp,
                                cfg["kl_coef"], sampler_logp=b.slp, tis_cap=cfg["tis_cap"], entropy=ent,
                                entropy_coef=cfg["entropy_coef"])
            (loss * world).backward()  # FSDP averages gradients over ranks; the token-mean already spans all ranks
            stats["loss"] += loss.item()
            for k, v in st.items():
                stats[k] += v
            stats["dlogp"] += ((old - b.slp).abs() * b.w).sum().item()  # sampler vs trainer before this step's updates
        gn = torch.nn.utils.clip_grad_norm_([q for g in opt.param_groups for q in g["params"]], cfg["grad_clip"])
        gn = gn.full_tensor() if hasattr(gn, "full_tensor") else gn
        stats["grad_norm"] = max(stats["grad_norm"], float(gn))
        stats["opt_steps"] += 1
        opt.step()
        opt.zero_grad(set_to_none=True)
    return stats


def lr_factor(cfg, step):
    """The lr of training step `step` (0-based) as a fraction of --lr: constant, then over the last --lr_decay of
    --steps a half cosine down to --lr_min (warmup-stable-decay without the warmup)."""
    start = round(cfg["steps"] * (1 - cfg["lr_decay"]))
    if not cfg["lr_decay"] or step < start:
        return 1.0
    t = min(1.0, (step - start) / max(1, cfg["steps"] - start))
    return cfg["lr_min"] + (1 - cfg["lr_min"]) * 0.5 * (1 + math.cos(math.pi * t))


# -----------------------------------------------------------------------------
# the step's log: one metrics.jsonl record and one printed line


def step_record(cfg, step, roles, local, pstats, opts, dlogp_hist, master):
    """The step's metrics, summed or averaged over ranks. |dlogp| (sampler vs trainer log-probs) is the stale-sync
    alarm: bf16 vLLM vs the trainer sits near 1e-2 on GPU (fp32 CPU: 1e-7), so only a jump against this run's own
    recent level means something (an engine that stopped receiving weights)."""
    allr = C.gather(local)
    world, n_s = len(allr), sum(x["n"] for x in allr)
    rec = {"step": step + 1, "success": sum(x["success"] for x in allr) / world, "samples": n_s,
           "samples_per_rank": [x["n"] for x in allr], "loss": sum(x["loss"] for x in allr),
           "format_ok": sum(x["fmt"] for x in allr) / max(1, n_s), "resp_tokens": sum(x["resp_tok"] for x in allr),
           "lr_factor": lr_factor(cfg, step), "timeouts": sum(x["timeouts"] for x in allr)}  # sandbox programs killed
    for r in roles:
        vals = [x["rewards"][r] for x in allr if r in x["rewards"]]
        rec[f"reward_{r}"] = sum(vals) / max(1, len(vals))
    for k in ("zero_var_frac", "group_size"):
        rec[k] = sum(x["diag"][k] for x in allr) / world
    for p, st in enumerate(pstats):
        tot = C.all_sum([st["clip_tokens"], st["tokens"], st["dlogp"], st["kl_sum"], st["trained_tokens"], st["entropy_sum"],
                         st["clamped_tokens"]])
        rec["trained_tokens"] = rec.get("trained_tokens", 0.0) + tot[4]  # forward/backward tokens (prompts once if packed)
        rec[f"clip_frac_p{p}"] = tot[0] / max(1, tot[1])
        rec[f"dlogp_p{p}"] = tot[2] / max(1, tot[1])
        rec[f"clamped_p{p}"] = int(tot[6])  # tokens whose log-ratio hit the clamp (a broken sync or an overflow)
        prev = sorted(dlogp_hist[p][-10:])
        rec[f"dlogp_jump_p{p}"] = bool(prev) and rec[f"dlogp_p{p}"] > max(1e-5, 3 * prev[len(prev) // 2])
        dlogp_hist[p].append(rec[f"dlogp_p{p}"])
        if rec[f"dlogp_jump_p{p}"] and master:
            print(f"warning: policy {p}'s sampler/trainer |dlogp| jumped to {rec[f'dlogp_p{p}']:.1e} (recent median "
                  f"{prev[len(prev) // 2]:.1e}): is the engine receiving the weights?", flush=True)
        rec[f"grad_norm_p{p}"] = st["grad_norm"]
        rec[f"opt_steps_p{p}"] = st["opt_steps"]  # optimizer steps this training step (the same on every rank)
        rec[f"lr_p{p}"] = opts[p].param_groups[0]["lr"]
        if cfg["kl_coef"]:
            rec[f"kl_p{p}"] = tot[3] / max(1, tot[1])
        if cfg["entropy_coef"]:  # mean full-vocabulary entropy over the step's trained tokens (nats)
            rec[f"entropy_p{p}"] = tot[5] / max(1, tot[1])
    if C.DEVICE.type == "cuda":  # per-phase peak of torch's allocator, max over ranks (GiB)
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


# -----------------------------------------------------------------------------
# main: set up, then each step rollout -> advantages -> update -> weight sync -> log -> evaluate / checkpoint


def setup(cfg, rank, world, master):
    """Everything the loop needs: the policies with their models, optimizers and engines, the agents, the data, the
    held-out set, the run's folder and the log."""
    import tiny
    from eval import evaluate
    from transformers import AutoTokenizer
    if master:
        print("config: preset " + cfg["preset"] + "; " + ", ".join(f"{k} {cfg[k]}" for k in PRESETS), flush=True)
    if master:
        print(P.optimizer_steps_line(cfg), flush=True)
    if master and P.is_tiny(cfg) and cfg["task"] in ("code", "math"):
        print(f"note: the tiny model cannot learn {cfg['task']} (it only exercises the code path); use --model for real runs")
    pols, role_to_policy = P.resolve(cfg)
    bases = [tiny.base_path(cfg, p.base) for p in pols] if P.is_tiny(cfg) else [p.base for p in pols]
    if P.is_tiny(cfg):
        if master:
            for b, p in zip(bases, pols):
                tiny.build_base(b, cfg, p.base)
        if world > 1:
            torch.distributed.barrier()
    start = C.open_run(cfg, pols, master)
    tok = AutoTokenizer.from_pretrained(bases[0])  # Qwen3 sizes share one tokenizer (and the tiny sizes theirs)
    torch.manual_seed(cfg["seed"])
    models, opts, refs, engines = P.build(cfg, pols, bases, os.path.join(cfg["out_dir"], "ckpt"), rank, C.DEVICE)
    for p, pol in enumerate(pols if master else []):
        n_train = sum(q.numel() for g in opts[p].param_groups for q in g["params"])
        lora_note = f" + LoRA r={cfg['lora_rank']} alpha={cfg['lora_alpha']:g}" if pol.adapter else ""
        print(f"policy {p} {pol.name}: base {pol.base}{lora_note}, lr {pol.lr:g}, micro_batch_tokens "
              f"{pol.micro_batch_tokens}, minibatches {pol.minibatches}; trains {n_train / 1e6:.2f}M params "
              f"(AdamW state {8 * n_train / 2 ** 20:.1f} MiB)", flush=True)
    compact = P.is_tiny(cfg) and cfg["task"] in ("plan", "sokoban", "sudoku")
    team = P.parse_team(cfg)
    E.TOOL_TIMEOUT, E.TEST_TIMEOUT = cfg["tool_timeout"], cfg["test_timeout"]
    if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1:  # the node's cores shared by its ranks, not each rank all of them
        sandbox.set_workers(sandbox.per_rank(int(os.environ["LOCAL_WORLD_SIZE"])))
    agents = Agents(tok, engines, role_to_policy, cfg["max_prompt_tokens"], thinking=cfg["thinking"])
    test_envs = E.test_set(cfg["task"], n=cfg["eval_n"], compact=compact, workflow=cfg["workflow"], limit=cfg["eval_n"], team=team)

    def run_eval(step):
        res = evaluate(test_envs, agents, cfg["turns"], k=1, temperature=0.0, max_new_tokens=cfg["max_new_tokens"],
                       rank=rank, world=world)
        if master:
            print(f"eval step {step}: held-out success {res['accuracy']:.3f} "
                  f"(95% CI {res['ci'][0]:.3f}-{res['ci'][1]:.3f}, n={res['n']}, greedy)")
        return res
    wb = None
    if master and cfg["wandb"]:
        import wandb
        wb = wandb.init(project=cfg["wandb"], name=os.path.basename(os.path.abspath(cfg["out_dir"])), config=cfg)

    def log(rec):  # metrics.jsonl on rank 0, and the same numbers to wandb
        if master:
            with open(os.path.join(cfg["out_dir"], "metrics.jsonl"), "a") as f:
                f.write(json.dumps(rec) + "\n")
        if wb is not None:
            wb.log({k: v for k, v in rec.items() if isinstance(v, (int, float)) and k != "step"}, step=rec["step"])
    return dict(pols=pols, models=models, opts=opts, refs=refs, engines=engines, agents=agents, tok=tok, start=start,
                compact=compact, team=team, run_eval=run_eval, log=log, wb=wb,
                rows=E.load_split(cfg["task"], "train") if cfg["task"] in ("code", "math") else None)


def main(argv):
    import memory
    cfg = configure(argv)
    if cfg["dry_run"]:
        print(P.optimizer_steps_line(cfg))
        raise SystemExit(memory.print_plan(cfg))
    memory.refuse_if_too_big(cfg)  # a GPU run that cannot fit stops before anything loads
    rank, world = C.setup_dist(cfg["nccl_timeout_min"])
    S = setup(cfg, rank, world, master := rank == 0)
    pols, models, opts, engines, agents = S["pols"], S["models"], S["opts"], S["engines"], S["agents"]
    roles = P.task_roles(cfg)
    sp = dict(temperature=cfg["temperature"], top_p=cfg["top_p"], max_new_tokens=cfg["max_new_tokens"])
    t_proc = time.time()
    t_start = t_proc - S["start"].time_before  # "time" in the log and --time_limit_min count the whole run, across resumes
    if S["start"].step == 0 and cfg["eval_every"]:
        r = S["run_eval"](0)
        S["log"]({"step": 0, "eval_success": r["accuracy"], "eval_ci": r["ci"], "time": 0.0})
    C.cuda_peak_gib()
    dlogp_hist = [[] for _ in pols]
    for step in range(S["start"].step, cfg["steps"]):
        t0, timer, timeouts0 = time.time(), {}, sandbox.stats["timeouts"]
        # --- rollout: this rank's share of the step's fresh envs
        rng = random.Random(f"{cfg['seed']}-{step}-{rank}")
        envs = [E.train_env(cfg["task"], rng, cfg["workflow"], S["compact"], S["rows"], team=S["team"])
                for _ in range(cfg["envs_per_step"] // world)]
        agents.seed_base, agents.calls = (cfg["seed"] * 7919 + step * 104729 + rank * 15485863) % (2 ** 31), 0
        if cfg["algo"] == "at_grpo":  # K candidates per (agent, turn), the best branch continues
            samples = tree_rollout(envs, agents, cfg["K"], cfg["turns"], sp, cfg["alpha"], cfg["branch"], rng, timer)
            success = sum(e.success for e in envs) / len(envs)
        else:  # K independent trajectories per env
            samples, trajs = plain_rollout(envs, agents, cfg["K"], cfg["turns"], sp, cfg["alpha"], timer)
            trajectory_returns(samples)
            success = sum(e.success for ts in trajs for e in ts) / (len(trajs) * cfg["K"])
        # --- advantages: the group key and the normalized value of --algo
        scale = "batch" if step < cfg["batch_std_steps"] and cfg["scale_rewards"] == "group" else cfg["scale_rewards"]
        kept, diag = compute_advantages(samples, cfg["algo"], cfg["drop_zero_var"], scale, C.all_sum, std_floor=cfg["std_floor"])
        mem = {"mem_rollout": C.cuda_peak_gib()}
        # --- update: one PPO-clip update per policy on its roles' samples (CUDA: the engines sleep meanwhile)
        for e in P.distinct_engines(engines):
            e.sleep()
        t1 = time.time()
        pstats = []
        for p, pol in enumerate(pols):  # the lr schedule is a function of the step alone: a resumed run follows it
            for g in opts[p].param_groups:
                g["lr"] = pol.lr * lr_factor(cfg, step)
            pcfg = {**cfg, **{k: getattr(pol, k) for k in P.PER_ROLE}}
            pstats.append(update_policy(P.use_policy(models, pols, p), opts[p], [s for s in kept if s.policy == p],
                                        pcfg, world, C.DEVICE, S["refs"][p]))
        mem["mem_train"] = C.cuda_peak_gib()
        t2 = time.time()
        # --- weight sync: each policy's new weights into its engine (streamed; wakes the engine first)
        for p in range(len(pols)):
            engines[p].sync(P.use_policy(models, pols, p))
        mem["mem_sync"] = C.cuda_peak_gib()
        t3 = time.time()
        # --- log, evaluate, checkpoint
        local = dict(success=success, n=len(samples), loss=sum(st["loss"] for st in pstats),
                     resp_tok=sum(len(s.response_ids) for s in samples), fmt=sum(s.formatted for s in samples),
                     rewards=by_agent_turn(samples), diag=diag, mem=mem, timeouts=sandbox.stats["timeouts"] - timeouts0)
        rec = step_record(cfg, step, roles, local, pstats, opts, dlogp_hist, master)
        rec.update(t_gen=timer.get("gen", 0.0), t_env=timer.get("env", 0.0), t_train=t2 - t1, t_sync=t3 - t2,
                   t_step=t3 - t0, time=time.time() - t_start)
        eta = C.eta_seconds(cfg, step + 1, step + 1 - S["start"].step, time.time() - t_proc, time.time() - t_start)
        if master:
            print(step_line(rec, roles, len(pols), eta), flush=True)
        last = step + 1
        out_of_time = C.out_of_time_all(cfg, time.time() - t_start)
        final = last in (cfg["steps"], cfg["stop_step"]) or out_of_time
        if cfg["eval_every"] and (last % cfg["eval_every"] == 0 or final):
            r = S["run_eval"](last)
            rec.update(eval_success=r["accuracy"], eval_ci=r["ci"])
        S["log"](rec)
        if cfg["ckpt_every"] and (last % cfg["ckpt_every"] == 0 or final):
            save(cfg, S, last, rank, time.time() - t_start)
        C.cuda_peak_gib()
        if out_of_time and master:
            print(f"time limit of {cfg['time_limit_min']} min reached after step {last}")
        if final:
            break
    teardown(S)


def save(cfg, S, step, rank, elapsed):
    """A checkpoint after `step` (CUDA: the engines park their weights on the host while it gathers)."""
    for e in P.distinct_engines(S["engines"]):
        e.sleep(level=1)
    C.save_checkpoint(cfg["out_dir"], step, S["models"], S["opts"], S["pols"], S["tok"], rank,
                      os.path.join(cfg["out_dir"], "metrics.jsonl"), None if P.is_tiny(cfg) else torch.bfloat16, elapsed)


def teardown(S):
    for e in P.distinct_engines(S["engines"]):  # engines first: vLLM's own process groups go before the default group
        e.close()
    if S["wb"] is not None:
        S["wb"].finish()
    if C.OWN_GROUP:
        C.close_dist()


if __name__ == "__main__":
    main(sys.argv[1:])
