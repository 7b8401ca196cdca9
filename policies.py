"""
Who the agents are: which roles share a policy, what each policy starts from and trains with, and
the engines that sample for them. One table decides the role -> policy map (`resolve`):

    --policies   roles that share one policy                  engines
    shared       every role with the same base (the default)  one per distinct base
    per_role     none: one policy per role                    one, the policies take turns in it (PolicySwitch)
    per_type     a team's reasoners / tool agents / judge     one
    lora         none: one adapter per role on one frozen base   one, each adapter merged in when its turn comes
    --policy ROLE=PATH gives a role its own base model (different bases: one engine per base)
"""
import json
import math
import os
from dataclasses import dataclass

import torch

import common as C
import envs as E
import model as M
from model import iter_hf_state
from engines import TorchEngine, VLLMEngine
from rollout import Sampling
from scripted import ScriptedEngine

# --policy ROLE=tiny-small: the embedded tiny model at that size
TINY_SIZES = ("tiny", "tiny-small")
# the training settings a role (its policy) may set on its own
PER_ROLE = ("lr", "micro_batch_tokens", "minibatches")
# how a role samples (a role, not a policy: one policy may play two roles at two temperatures); the
# eval_ ones are evaluation's
SAMPLING = ("temperature", "top_p", "max_new_tokens", "thinking")
PER_ROLE_FLAGS = PER_ROLE + SAMPLING + tuple("eval_" + k for k in SAMPLING)


def as_bool(text):
    if str(text).lower() not in ("1", "0", "true", "false", "yes", "no"):
        raise ValueError(f"{text!r} is not true or false")
    return str(text).lower() in ("1", "true", "yes")


CASTS = {"lr": float, "micro_batch_tokens": int, "minibatches": int, "temperature": float, "top_p": float,
         "max_new_tokens": int, "thinking": as_bool}
as_bool.__name__ = "bool"
# each per-role flag's type: ROLE=VALUE,... is read into {role: value} (config.parse_flags)
CASTS_OF_FLAG = {k: CASTS[k.removeprefix("eval_")] for k in PER_ROLE_FLAGS}


@dataclass
class Policy:
    """One trained policy: the roles it plays, the base it starts from and its own training settings
    (Dr. MAS sets lr and micro-batch per agent). Checkpoints: ckpt/policy-{name} (HF),
    ckpt/train-{name} (DCP), and with LoRA ckpt/adapter-{name} (PEFT)."""
    name: str                # its roles joined by "+", e.g. "tool+plan" for the shared policy of Plan-Path
    roles: tuple
    base: str                # a HF folder, or a tiny size (TINY_SIZES) for the embedded default
    adapter: str             # --policies lora: this policy's adapter on the one shared base; "" = a full model
    lr: float
    micro_batch_tokens: int
    minibatches: int


def is_tiny(cfg):
    """The embedded default: no --model and every --policy names a tiny size (a real path means a
    real run)."""
    return not cfg["model"] and all(sp.split("=", 1)[-1] in TINY_SIZES for sp in cfg["policy"].split(",") if sp)


def parse_team(cfg):
    try:
        return E.parse_team(cfg["team"], cfg["task"], cfg["workflow"], cfg["team_mode"])
    except ValueError as e:
        raise SystemExit(str(e))


def task_roles(cfg):
    team = parse_team(cfg)
    if team:
        return E.team_roles(*team[:2])
    return E.task_roles(cfg["task"], cfg["workflow"])


def per_role(cfg, key, roles, default):
    """--lr 1e-6 (every role) or --lr tool=1e-6,plan=2e-6, read as {role: value} (the roles it does
    not name keep `default`) -> {role: value} for every role."""
    v = cfg[key]
    if not isinstance(v, dict):
        return {r: v for r in roles}
    for r in v:
        if r not in roles:
            raise SystemExit(f"--{key} {format_per_role(v)}: task {cfg['task']!r} ({cfg['workflow']}) has "
                             f"no role {r!r}; its roles are {', '.join(roles)}")
    return {r: v.get(r, default) for r in roles}


def format_per_role(values):
    """{role: value} as the flag was written: tool=1e-06,plan=2e-06."""
    return ",".join(f"{r}={x}" for r, x in values.items())


def resolve(cfg):
    """The role -> policy map and each policy's settings, from --policies, --policy ROLE=PATH and
    the per-role flags (cfg["role_defaults"]: the value of a per-role flag for the roles it does not
    name). Every role/policy misuse fails here, before anything loads. Returns ([Policy], {role:
    policy index})."""
    roles = task_roles(cfg)
    base = {r: cfg["model"] or "tiny" for r in roles}
    named = set()
    for sp in filter(None, cfg["policy"].split(",")):
        r, eq, path = sp.partition("=")
        if not eq or not path:
            raise SystemExit(f"--policy takes ROLE=PATH, not {sp!r}")
        if r in named:
            raise SystemExit(f"--policy names role {r!r} twice ({cfg['policy']}): give each role one base")
        named.add(r)
        if r not in roles:
            raise SystemExit(f"--policy {sp}: task {cfg['task']!r} ({cfg['workflow']}) has no role {r!r}; "
                             f"its roles are {', '.join(roles)}")
        if path not in TINY_SIZES and not os.path.isfile(os.path.join(path, "config.json")):
            raise SystemExit(f"--policy {sp}: {path!r} is not a Hugging Face model folder (no config.json), "
                             f"nor one of {', '.join(TINY_SIZES)}")
        base[r] = path
    tiny_bases = [b in TINY_SIZES for b in base.values()]
    if not cfg["model"] and any(tiny_bases) and not all(tiny_bases):
        raise SystemExit("--policy mixes tiny sizes with model folders: give every role a folder (or --model "
                         "for the rest)")
    settings = {k: per_role(cfg, k, roles, cfg["role_defaults"][k]) for k in PER_ROLE}
    for r in roles:
        lr = settings["lr"][r]
        if not (math.isfinite(lr) and lr > 0):  # inf trains NaN weights, nan fails in torch's optimizer
            raise SystemExit(f"--lr {lr} (role {r}): a learning rate is a finite number above 0, e.g. 1e-6 "
                             "(the paper's) or 5e-4 (the tiny default's)")
        for k in ("minibatches", "micro_batch_tokens"):
            if settings[k][r] < 1:
                raise SystemExit(f"--{k} {settings[k][r]} (role {r}): at least 1")
    if cfg["policies"] == "lora":
        if cfg["lora_rank"] <= 0:
            raise SystemExit(f"--lora_rank must be >= 1, not {cfg['lora_rank']}")
        if len(set(base.values())) > 1:
            raise SystemExit("--policies lora puts every role's adapter on one base: drop --policy ROLE=PATH, or use "
                             "--policies shared|per_role for different bases per role")
    groups = {}  # the grouping key of the table above -> roles
    for r in roles:
        key = {"per_role": r, "lora": r, "per_type": (E.role_type(r), base[r])}.get(cfg["policies"], base[r])
        groups.setdefault(key, []).append(r)
    pols = []
    for rs in groups.values():
        vals = {k: {settings[k][r] for r in rs} for k in PER_ROLE}
        for k, v in vals.items():
            if len(v) > 1:
                raise SystemExit(f"roles {', '.join(rs)} share one policy but --{k} gives them {sorted(v)}: "
                                 "give them one value, or --policies per_role")
        name = "+".join(rs)
        pols.append(Policy(name, tuple(rs), base[rs[0]], name if cfg["policies"] == "lora" else "",
                           **{k: vals[k].pop() for k in PER_ROLE}))
    return pols, {r: i for i, p in enumerate(pols) for r in p.roles}


def settings(cfg, policy):
    """The run's configuration as this policy trains: its own lr, micro_batch_tokens and
    minibatches."""
    return {**cfg, **{k: getattr(policy, k) for k in PER_ROLE}}


def describe(cfg, p, policy, opt):
    """One line per policy at the start of a run: its base, its settings, what it trains."""
    n_train = sum(q.numel() for g in opt.param_groups for q in g["params"])
    lora = f" + LoRA r={cfg['lora_rank']} alpha={cfg['lora_alpha']:g}" if policy.adapter else ""
    return (f"policy {p} {policy.name}: base {policy.base}{lora}, lr {policy.lr:g}, micro_batch_tokens "
            f"{policy.micro_batch_tokens}, minibatches {policy.minibatches}; trains {n_train / 1e6:.2f}M params "
            f"(AdamW state {8 * n_train / 2 ** 20:.1f} MiB)")


def flag_values(cfg, name):
    """Every value a flag holds: one, or one per role it names (ROLE=VALUE,...), for bounds checks
    before the roles are known to be right."""
    value = cfg[name]
    return list(value.values()) if isinstance(value, dict) else [value]


def role_sampling(cfg, prefix=""):
    """{role: Sampling} for the task's roles from the sampling flags (prefix "eval_": evaluation's),
    each one value for every role or ROLE=VALUE,... (the roles it does not name: the preset's)."""
    roles = task_roles(cfg)
    values = {k: per_role(cfg, prefix + k, roles, cfg["role_defaults"][prefix + k]) for k in SAMPLING}
    return {r: Sampling(**{k: values[k][r] for k in SAMPLING}) for r in roles}


def optimizer_steps_line(cfg):
    """What --mini_batch_rows / --minibatches imply: optimizer steps per training step, at most
    (every env playing all its turns)."""
    if not cfg["mini_batch_rows"]:
        return f"optimizer steps per training step: {cfg['minibatches']} per policy (--minibatches)"
    calls = cfg["envs_per_step"] * cfg["K"] * cfg["turns"] * len(task_roles(cfg))
    return (f"optimizer steps per training step: one per {cfg['mini_batch_rows']} samples (--mini_batch_rows), up to "
            f"{math.ceil(calls / cfg['mini_batch_rows'])} for {calls} samples (E {cfg['envs_per_step']} x "
            f"K {cfg['K']} x T {cfg['turns']} x {len(task_roles(cfg))} agents), split over the policies")


def model_config(cfg, base=None):
    """The Qwen3 config of a base: a HF folder's config.json, or a named size (M.SIZES) for
    --dry_run."""
    base = base or cfg["model"] or "tiny"
    if base in M.SIZES and not os.path.exists(base):
        return M.Qwen3Config(**M.SIZES[base])
    with open(os.path.join(base, "config.json")) as f:
        return M.Qwen3Config.from_hf(json.load(f))


# -----------------------------------------------------------------------------
# building the models, optimizers and engines


def build(cfg, pols, bases, ckpt, rank, device):
    """Per policy: the trainable model (fp32 masters; FSDP2 with a bf16 compute policy on GPU) and
    AdamW; the engine(s); the optional frozen KL reference (sharded the same way). A fresh start
    loads the HF weights on the CPU and lets fully_shard move each rank's shards to its GPU; a
    resume builds the model empty and reads each rank's DCP shards. `bases`: policy index -> HF
    folder. LoRA: one model (the frozen base + every policy's adapter), listed once per policy; each
    policy's AdamW holds only its own adapter."""
    lora = cfg["policies"] == "lora"
    models, opts, refs = [], [], []
    shared = _make_model(cfg, bases[0], device, adapters=[p.adapter for p in pols]) if lora else None
    for p, pol in enumerate(pols):  # LoRA resumes from the base + DCP adapters
        m = shared or _make_model(cfg, os.path.join(ckpt, f"policy-{pol.name}") if cfg["resume"] else bases[p], device,
                                  empty=cfg["resume"])
        params = M.adapter_parameters(m, pol.adapter) if lora else m.parameters()
        o = torch.optim.AdamW(params, lr=pol.lr, weight_decay=cfg["weight_decay"], betas=(0.9, 0.999))
        if cfg["resume"]:
            C.load_train_state(m, o, os.path.join(ckpt, f"train-{pol.name}"), frozen=not lora)
        models.append(m)
        opts.append(o)
        refs.append(_make_model(cfg, bases[p], device, trainable=False).eval().requires_grad_(False)
                    if cfg["kl_coef"] > 0 else None)
    return models, opts, refs, build_engines(cfg, pols, models, bases, ckpt, rank)


def _make_model(cfg, src, device, trainable=True, empty=False, adapters=()):
    fsdp = C.OWN_GROUP
    if empty:  # resume: the shapes only; the values come from this rank's DCP shards
        with torch.device("meta"):
            m = M.Qwen3(model_config(cfg, src))
        m.to_empty(device="cpu" if fsdp else device)
        if m.config.tie_word_embeddings:  # to_empty unties shared parameters
            m.lm_head.weight = m.model.embed_tokens.weight
    else:
        m = M.load_model(src, dtype=torch.float32, device="cpu" if fsdp else device)
    if adapters:
        M.add_lora(m, adapters, cfg["lora_rank"], cfg["lora_alpha"], seed=cfg["seed"])
    if fsdp:  # fully_shard moves each unit's shard of the CPU model to this rank's device
        compute_dtype = torch.bfloat16 if device.type == "cuda" else None
        M.shard(m, checkpoint=cfg["grad_checkpoint"] if trainable else "off", param_dtype=compute_dtype,
                compile=cfg["compile"])
    else:
        for layer in m.model.layers:
            layer.checkpoint = cfg["grad_checkpoint"]
            if cfg["compile"]:
                layer.compile()
    return m


def build_engines(cfg, pols, models, bases, ckpt, rank):
    """One engine per distinct base on each rank (vLLM: one sleep-mode engine per process is what is
    verified); the policies of one base take turns in its engine (PolicySwitch), LoRA policies as
    merged weights."""
    by_base = {}
    for p in range(len(pols)):
        by_base.setdefault(bases[p], []).append(p)
    engines = [None] * len(pols)
    for b, ps in by_base.items():
        src = os.path.join(ckpt, f"policy-{pols[ps[0]].name}") if cfg["resume"] else b
        eng = make_engine(cfg["engine"], src, seed=cfg["seed"] + 1000 * rank, max_len=cfg["max_model_len"],
                          gpu_memory_utilization=cfg["gpu_memory_utilization"] / len(by_base), sleep_mode=True,
                          max_num_seqs=engine_seqs(cfg, C.world_size()))
        if len(ps) == 1:
            engines[ps[0]] = eng
            continue
        switch = PolicySwitch(eng, len(ps))
        # host copies of every policy's starting weights (a collective: all ranks, same order)
        for j, p in enumerate(ps):
            engines[p] = switch.view(j)
            engines[p].sync(use_policy(models, pols, p))
    return engines


def engine_seqs(cfg, world):
    """The most sequences vLLM runs at once on a rank: one step's envs on the rank x K (at least 16),
    at most its max_num_batched_tokens (vLLM 0.32 refuses an engine whose batched tokens are fewer
    than its sequences, `vllm/config/scheduler.py`; a generate call with more prompts queues the
    rest). vLLM on CUDA sizes its start-up profile and CUDA graphs by it, and the memory plan counts
    the same number."""
    from engines import vllm_batched_tokens
    wanted = max(16, cfg["envs_per_step"] // max(1, world) * cfg["K"])
    return min(wanted, vllm_batched_tokens(cfg["max_model_len"]))


def use_policy(models, pols, p):
    """The model of policy p, ready to run as that policy (LoRA: its adapter selected on the shared
    base)."""
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


def make_engine(kind, model_dir, seed=0, max_len=2048, gpu_memory_utilization=0.3, sleep_mode=False, max_num_seqs=256):
    """sleep_mode: vLLM on CUDA only, and one such engine per process (training); evaluation does
    without. max_num_seqs: the most sequences one generate call holds (vLLM on CUDA sizes its
    start-up profile by it)."""
    if kind == "vllm":
        try:
            import vllm  # noqa: F401
        except ImportError as e:
            raise RuntimeError("vLLM is not installed: run ./setup.sh, or pass --engine torch to use the "
                               "pure-torch sampler") from e
        dtype = "bfloat16" if torch.cuda.is_available() else "float32"
        return VLLMEngine(model_dir, seed=seed, max_len=max_len, gpu_memory_utilization=gpu_memory_utilization,
                          sleep_mode=sleep_mode, dtype=dtype, max_num_seqs=max_num_seqs)
    if kind == "scripted":
        return ScriptedEngine(model_dir, seed=seed, max_len=max_len)
    # bf16 on GPU like vLLM; fp32 on CPU (the tests compare it with the fp32 trainer)
    if kind == "torch":
        return TorchEngine(model_dir, seed=seed, max_len=max_len,
                           dtype=torch.bfloat16 if torch.cuda.is_available() else torch.float32)
    raise ValueError(f"unknown engine {kind!r}: use --engine vllm, torch or scripted")


class PolicySwitch:
    """Several policies served by one engine (per_role training): each policy's latest weights are
    kept on the host (engine dtype), and before a call for another policy the engine's weights are
    swapped in. Storing is the only collective (FSDP2 gathers, once per update, at the same point on
    every rank); a swap is a local host-to-engine copy, so ranks whose episodes ended early and skip
    calls never stall the others. Cost: n_policies x 2 bytes/param of host memory per rank, and one
    weight load per swap. Why one engine: vLLM allows one sleep-mode engine per process, and two
    awake engines per GPU would take the memory the KV cache needs (see memory.py)."""

    def __init__(self, engine, n_policies):
        self.engine, self.host, self.loaded = engine, [None] * n_policies, 0

    def store(self, p, model):
        # the old copy goes first: one host copy per policy at any time, never two (8B: 16 GB each)
        self.host[p] = None
        self.host[p] = [(k, v.cpu()) for k, v in iter_hf_state(model, self.engine.dtype)]
        if p == self.loaded:
            self.engine.load(self.host[p])

    def use(self, p):
        if p != self.loaded:
            self.engine.load(self.host[p])
            self.loaded = p

    def view(self, p):
        return _PolicyView(self, p)


class _PolicyView:
    """The engine interface for one policy of a PolicySwitch."""

    def __init__(self, switch, p):
        self.switch, self.p = switch, p

    def generate(self, *args, **kw):
        self.switch.use(self.p)
        return self.switch.engine.generate(*args, **kw)

    def sync(self, model):
        self.switch.store(self.p, model)

    def sleep(self, level=2):
        self.switch.engine.sleep(level)

    def close(self):
        self.switch.engine.close()
