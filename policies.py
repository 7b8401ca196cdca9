"""
The policies' models, optimizers and engines, built from config.resolve's role -> policy map
(which roles share a policy, what each starts from and trains with: config.py, "roles and
policies"). Several policies on one base take turns in one engine (PolicySwitch).
"""
import os

import torch

import common as C
import config
import model as M
from model import iter_hf_state
from engines import TorchEngine, VLLMEngine
from scripted import ScriptedEngine


def describe(cfg, p, policy, opt):
    """One line per policy at the start of a run: its base, its settings, what it trains."""
    n_train = sum(q.numel() for g in opt.param_groups for q in g["params"])
    lora = f" + LoRA r={cfg['lora_rank']} alpha={cfg['lora_alpha']:g}" if policy.adapter else ""
    return (f"policy {p} {policy.name}: base {policy.base}{lora}, lr {policy.lr:g}, micro_batch_tokens "
            f"{policy.micro_batch_tokens}, minibatches {policy.minibatches}; trains {n_train / 1e6:.2f}M params "
            f"(AdamW state {8 * n_train / 2 ** 20:.1f} MiB)")


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
            m = M.Qwen3(config.model_config(cfg, src))
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
