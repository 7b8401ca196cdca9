"""
Per-rank GPU memory of a training run, computed from the configuration alone, before anything is loaded.

    python train.py --dry_run --model 8B --policies per_role --world 8 --gpu_gb 80   # the table; exit 0: fits

A real GPU run calls the same `plan` first and refuses a configuration that cannot fit, naming the flag to change.
Why a separate file: the arithmetic is one concept (what lives on the GPU in each phase of a step), it is long,
and train.py should read as the training loop. The formulas are checked against memory measured on CPU for small
random models in test_all.py (states exactly; activations within 20% without checkpointing, to the byte with
it), and against a real step on an H100 in docs/gpu.md.

What lives on a GPU, per phase of one step (N parameters, W ranks, bf16 compute, fp32 master weights):
  rollout     FSDP2 states of every policy (fp32 params + grads + AdamW m, v = 16 N / W bytes) + the engine awake
  train       states + the engine asleep + the update's working set: two decoder layers unsharded in bf16 (the one
              running and the prefetched one), the embedding/head unit, their bf16/fp32 gradients, activations of one
              micro-batch, one [chunk, vocab] block of logits, and the KL reference when --kl_coef > 0
  sync        states + the engine's weights + one gathered tensor in flight (streamed, model.iter_hf_state)
              (--pack: packed rows add only a flex BlockMask of block indices; tokens are counted as packed)
  checkpoint  states + the engine asleep (level 1: weights parked on the host) + one gathered fp32 tensor (DCP
              shards + a streamed HF export)
plus the CUDA context, cuBLAS workspace and NCCL buffers outside torch's allocator (context_bytes, an estimate).
"""
from dataclasses import dataclass

from model import CHECKPOINT_MODES

GiB = 2 ** 30
# Estimates from vLLM 0.32's and NCCL's sources and published sizes (docs/gpu.md, "Planner constants"), not measured:
# test_vllm_sleep_update_wake_sample_cycle checks the engine's two on the first GPU with vLLM.
# CUDA context + cuBLAS/cuBLASLt workspaces of the trainer and the engine, outside torch's allocator
CUDA_CONTEXT_GIB = 1.0
NCCL_COMM_GIB = 1.0  # one multi-rank NCCL communicator's buffers (the trainer's and vLLM's world group: two per rank)
SLEEPING_ENGINE_GIB = 0.5  # vLLM asleep: weights, KV, runtime and CUDA-graph pools freed or parked on the host; its
                           # persistent input buffers and attention workspaces stay
CUDA_GRAPHS_GIB = 0.5  # vLLM's CUDA-graph pool (capture sizes up to max_num_seqs), charged to its KV budget at start
HEADROOM = 0.95            # use at most this share of the GPU: allocator fragmentation


@dataclass
class Counts:
    total: int     # parameters (tied embedding counted once)
    layer: int     # one decoder layer
    embed: int     # vocab x hidden
    largest: int   # the largest single tensor (the embedding)


def counts(cfg) -> Counts:
    h, hd, I = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    layer = h * hd * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads) + 3 * h * I + 2 * h + 2 * hd
    embed = cfg.vocab_size * h
    total = cfg.num_hidden_layers * layer + embed * (1 if cfg.tie_word_embeddings else 2) + h
    return Counts(total, layer, embed, embed)


def act_bytes_per_token_layer(cfg, b=2):
    """Bytes saved for backward per token by one decoder layer without checkpointing, counted from model.py's ops
    at b bytes per activation (bf16 under the FSDP2 policy; fp32 copies made by the norms are 4):
      2 RMSNorms: fp32 copy of the input (4h) + the normalized input before the weight (b h)       -> 2 (4 + b) h
      q/k norms: the same per head (4 + b), the normed output kept for RoPE (b), rotate_half (b),
                 the rotated q/k kept by attention (b)                            -> (4 + 4b)(nh + nkv) hd
      v (b nkv hd), attention output (b nh hd) + its reshaped copy for o_proj (b nh hd), logsumexp (4 nh)
      SwiGLU: gate, silu(gate), up, their product (4 b I)"""
    h, hd, I = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    return (2 * (4 + b) * h + (4 + 4 * b) * (nh + nkv) * hd + b * nkv * hd + 2 * b * nh * hd + 4 * nh + 4 * b * I)


def selective_bytes_per_token_layer(cfg, b=2, lora_rank=0, flex_kernel=False):
    """Bytes one decoder layer keeps per token under --grad_checkpoint selective (model.SELECTIVE_SAVE):
    its input (b h) and the outputs of its matmuls and attention: q, k, v (b (nh + 2 nkv) hd), the attention
    output (b nh hd) and logsumexp (4 nh), o_proj (b h), gate and up (2 b I), down (b h). With LoRA each of the
    7 projections adds its adapter's two matmul outputs: A x (b r) and B A x (as wide as the projection's).
    `flex_kernel` (packed rows through eager layers on CUDA): the kept op is the compiled flex kernel, whose
    outputs hold what its backward needs, its inputs too: the RoPE'd q and k (b (nh + nkv) hd) stay alive."""
    h, hd, I = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    projections = b * ((nh + 2 * nkv) * hd + 2 * h + 2 * I)
    lora = projections + 7 * b * lora_rank if lora_rank else 0
    rope_qk = b * (nh + nkv) * hd if flex_kernel else 0
    return b * h + b * nh * hd + 4 * nh + projections + lora + rope_qk


def activation_bytes(cfg, tokens, checkpoint, b=2, lora_rank=0, flex_kernel=False):
    """Peak activation bytes of one micro-batch of `tokens` (padded) tokens in forward+backward
    (`checkpoint`: one of model.CHECKPOINT_MODES; `flex_kernel`: see selective_bytes_per_token_layer)."""
    L, h = cfg.num_hidden_layers, cfg.hidden_size
    layer = act_bytes_per_token_layer(cfg, b) * tokens
    residual_grads = 2 * b * h * tokens  # the incoming/outgoing gradient of the residual
    if checkpoint == "off":
        return L * layer + residual_grads
    # full: each layer keeps its input; selective: its matmul outputs too. Backward recomputes the
    # rest one layer at a time
    if checkpoint == "full":
        kept = b * h
    elif checkpoint == "selective":
        kept = selective_bytes_per_token_layer(cfg, b, lora_rank, flex_kernel)
    else:
        raise ValueError(f"checkpoint={checkpoint!r}: one of off, full, selective")
    return L * kept * tokens + layer + residual_grads


def logits_bytes(cfg, tokens, chunk, entropy=False):
    """One [chunk, vocab] block in the head's backward recompute: bf16 logits, fp32 copy, /T, log_softmax (saved), and
    its gradient chain (fp32), ~18 bytes per entry at peak; plus the head's saved input (b h per token). The entropy
    (--entropy_coef) adds p = exp(log_softmax), saved for p x log p (+4 bytes per entry: the test measures it with
    saved_tensors_hooks), and ~3 fp32 gradients in that product's backward (+12, counted from the ops, not measured on
    a GPU): +16 in all."""
    return (34 if entropy else 18) * min(chunk, tokens) * cfg.vocab_size + 2 * cfg.hidden_size * tokens


def lora_count(cfg, r):
    """Parameters of one LoRA adapter on every linear of every layer (model.LORA_TARGETS): r x (in + out) each."""
    h, hd, I = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    return cfg.num_hidden_layers * r * ((h + q) * 2 + (h + kv) * 2 + (h + I) * 3)


def block_mask_bytes(tokens, block=128):
    """A flex-attention BlockMask for packed rows (--pack), worst case one row of `tokens`: int32 block counts and
    block indices for partial and full blocks, in both the KV and the Q orientation (4 x nb^2 + 4 x nb entries).
    A dense bool mask would be tokens^2 bytes (256 MiB at 16k); the trainer never builds one on CUDA."""
    nb = -(-tokens // block)
    return 4 * (4 * nb * nb + 4 * nb)


def kv_bytes_per_token(cfg, b=2):
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * b


def context_bytes(world):
    """Outside torch's allocator on each rank: the CUDA context and GEMM workspaces, plus two multi-rank NCCL
    communicators when world > 1 (the trainer's default group, and vLLM's world group split from it eagerly)."""
    return (CUDA_CONTEXT_GIB + (2 * NCCL_COMM_GIB if world > 1 else 0)) * GiB


def engine_profile_bytes(cfg, max_num_seqs, max_num_batched_tokens, b=2):
    """What vLLM reserves inside its budget besides weights and KV (it measures this at start-up; here it is counted
    from what it runs): the larger of its profile forward (max_num_batched_tokens tokens through one decoder layer at
    a time: residual, normed input, qkv, attention output, gate_up and the SwiGLU product, in bf16) and its sampler
    profile (max_num_seqs x vocab fp32 logits: ~40 bytes an entry for the scaled logits, the sort's values and int64
    indices, softmax, cumsum and mask of top-p, the processed log-probs), plus its CUDA-graph pool. These are the
    engine's own arguments (policies.engine_seqs, engines.vllm_batched_tokens): the plan follows the flags."""
    h, hd, I = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    forward = (
        max_num_batched_tokens * b * (3 * h + (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * hd + 3 * I)
    )
    sampler = 40 * max_num_seqs * cfg.vocab_size
    return max(forward, sampler) + CUDA_GRAPHS_GIB * GiB


def checkpoint_bytes(cfg, n_policies, lora_rank=0, export_bytes=2):
    """Disk of one checkpoint (common.save_checkpoint), per policy: the HF export (export_bytes per parameter: bf16 for
    real models; LoRA: the merged model, plus the adapter in fp32) and the DCP shards of what trains: fp32 weights and
    AdamW's two moments, 12 bytes per parameter (LoRA: the model state holds every adapter of the shared base, the
    optimizer this policy's). The state dict lists a tied head apart from the embedding: 4 bytes each more."""
    c = counts(cfg)
    tied_head = 4 * c.embed if cfg.tie_word_embeddings else 0
    if lora_rank:
        a = lora_count(cfg, lora_rank)
        return n_policies * (export_bytes * c.total + 4 * a + 4 * n_policies * a + 8 * a + tied_head)
    return n_policies * (export_bytes * c.total + 12 * c.total + tied_head)


def host_bytes(cfg, n_policies, engine="vllm"):
    """Host (CPU) memory per rank, beyond the process itself: (load, steady, checkpoint).
    load        each rank reads each base itself: the fp32 model (4 N), the file's bf16 tensors (2 N) and the file's
                pages mapped while they are read (up to 2 N): 8 N, one model at a time (measured: 7.1 N)
    steady      policies sharing one engine keep their weights on the host in the engine's dtype
                (PolicySwitch): 2 N each
    checkpoint  + the engine's weights parked on the host by vLLM's level-1 sleep (2 N, pinned)"""
    n = counts(cfg).total
    steady = 2 * n * n_policies if n_policies > 1 else 0
    return 8 * n, steady, steady + (2 * n if engine == "vllm" else 0)


def plan(
    cfg,
    *,
    world,
    gpu_gb,
    n_policies,
    micro_batch_tokens,
    grad_checkpoint,
    engine="vllm",
    gpu_memory_utilization=0.5,
    sleep=True,
    rows=64,
    max_model_len=10240,
    kl=False,
    logits_chunk=1024,
    pack=False,
    compile=False,
    lora_rank=0,
    entropy=False,
    engine_seqs=256,
    engine_tokens=10240,
    export_bytes=2,
):
    """Per-rank bytes per phase. Returns dict(rows=[(item, {phase: GiB})], peak, phase, fits, limit, kv_tokens, fix).
    `n_policies` trained models share one engine (per_role: policies.PolicySwitch). `rows` is the torch engine's
    batch (prompts x K) per call; vLLM's footprint is gpu_memory_utilization x the GPU, of which its start-up reserve
    for `engine_seqs` sequences and `engine_tokens` batched tokens is not KV cache."""
    c = counts(cfg)
    G = gpu_gb * GiB
    states = n_policies * 16 * c.total / world
    if lora_rank:  # --policies lora: one frozen fp32 base (no grads, no AdamW) + per policy an adapter's 16 B/param
        states = (4 * c.total + n_policies * 16 * lora_count(cfg, lora_rank)) / world
    ref = n_policies * 4 * c.total / world if kl else 0
    unit_params = 2 * (2 * c.layer) + 2 * c.embed                    # bf16: two layers + the embedding/head unit
    unit_grads = 6 * (2 * c.layer) + 6 * c.embed                      # bf16 grad + fp32 reduce copy of the same
    flex_kernel = pack and not compile  # packed rows through eager layers: the compiled flex kernel

    def act_bytes(mode, tokens=micro_batch_tokens):  # one micro-batch's activations under a checkpoint mode
        return activation_bytes(cfg, tokens, mode, lora_rank=lora_rank, flex_kernel=flex_kernel)
    act = act_bytes(grad_checkpoint)
    logits = logits_bytes(cfg, micro_batch_tokens, logits_chunk, entropy)
    if engine == "vllm":
        awake = gpu_memory_utilization * G
        weights_only = 2 * c.total
        asleep = SLEEPING_ENGINE_GIB * GiB if sleep else awake
        reserve = engine_profile_bytes(cfg, engine_seqs, engine_tokens)
        kv = awake - weights_only - reserve
        # waking the weights restores the graphs
        synced = weights_only + asleep + CUDA_GRAPHS_GIB * GiB if sleep else awake
    else:  # model.py KV-cache sampler: bf16 weights + a static cache of rows x max_model_len; never sleeps
        kv = rows * max_model_len * kv_bytes_per_token(cfg)
        awake = 2 * c.total + kv + 4 * rows * cfg.vocab_size
        weights_only = asleep = synced = awake
        reserve = 0
    ctx = context_bytes(world)
    table = [
        (
            "FSDP2 states: fp32 params+grads+AdamW, sharded (all policies; LoRA: frozen base + adapters)",
            dict(rollout=states, train=states, sync=states, checkpoint=states),
        ),
        ("generation engine (awake / asleep)", dict(rollout=awake, train=asleep, sync=synced, checkpoint=asleep)),
        ("unsharded bf16 units in flight (2 layers + embed/head)", dict(train=unit_params)),
        ("their gradients (bf16 + fp32 reduce)", dict(train=unit_grads)),
        (f"activations, {micro_batch_tokens} tok, checkpointing {grad_checkpoint}", dict(train=act)),
        (f"logits chunk [{logits_chunk} x {cfg.vocab_size}] + head input", dict(train=logits)),
        ("packed rows: flex block mask (--pack)", dict(train=block_mask_bytes(micro_batch_tokens) if pack else 0)),
        ("KL reference (sharded)", dict(rollout=ref, train=ref, sync=ref, checkpoint=ref)),
        ("weight sync: one gathered bf16 tensor", dict(sync=2 * c.largest)),
        ("checkpoint: one gathered fp32 tensor", dict(checkpoint=4 * c.largest)),
        ("CUDA context, cuBLAS, NCCL (outside the allocator)", dict(rollout=ctx, train=ctx, sync=ctx, checkpoint=ctx)),
    ]
    phases = ["rollout", "train", "sync", "checkpoint"]
    tot = {p: sum(d.get(p, 0) for _, d in table) for p in phases}
    peak_phase = max(phases, key=lambda p: tot[p])
    peak, limit = tot[peak_phase], HEADROOM * G
    res = dict(
        rows=[(n, {p: v / GiB for p, v in d.items()}) for n, d in table],
        totals={p: v / GiB for p, v in tot.items()},
        peak=peak / GiB,
        phase=peak_phase,
        limit=limit / GiB,
        fits=peak <= limit,
        kv_gib=kv / GiB,
        engine_reserve=(reserve / GiB, engine_seqs, engine_tokens) if engine == "vllm" else None,
        disk_gb=checkpoint_bytes(cfg, n_policies, lora_rank, export_bytes) / 1e9,
        host_gb=[b / 1e9 for b in host_bytes(cfg, n_policies, engine)],
        node_ranks=min(world, 8),
        kv_tokens=int(kv / kv_bytes_per_token(cfg)),
        fix=None,
        act={mode: act_bytes(mode) / GiB for mode in CHECKPOINT_MODES},
    )
    if engine == "vllm" and kv < max_model_len * kv_bytes_per_token(cfg):
        res["fits"] = False
        res["fix"] = (
            f"the engine's KV cache ({kv / GiB:.1f} GiB) cannot hold one {max_model_len}-token sequence: raise "
            f"--gpu_memory_utilization (now {gpu_memory_utilization}) or lower --max_model_len"
        )
    if not res["fits"] and res["fix"] is None:
        res["fix"] = _fix(
            cfg,
            c,
            tot,
            peak_phase,
            limit,
            G,
            states,
            world,
            n_policies,
            micro_batch_tokens,
            grad_checkpoint,
            engine,
            gpu_memory_utilization,
            act_bytes,
        )
    return res


def _fix(cfg, c, tot, phase, limit, G, states, world, n_policies, mbt, ckpt, engine, u, act):
    need_world = next((w for w in (2, 4, 8, 16, 32, 64, 128, 256) if n_policies * 16 * c.total / w < 0.5 * limit), None)
    if states > 0.6 * limit:
        return (f"the sharded training states alone take {states / GiB:.1f} GiB per rank: use more GPUs "
                f"(torchrun --nproc_per_node / more nodes; about {need_world} ranks fit)"
                + (", or --policies shared" if n_policies > 1 else ""))
    if phase == "train":
        # keep less, in order: the first mode whose plan fits
        for mode in CHECKPOINT_MODES[CHECKPOINT_MODES.index(ckpt) + 1:]:
            if tot["train"] - act(ckpt) + act(mode) <= limit:
                return f"recompute activations in backward: --grad_checkpoint {mode}"
        if ckpt != "full":
            return "recompute each layer's activations in backward: --grad_checkpoint full"
        over = tot["train"] - limit
        per_tok = (act(ckpt) - act(ckpt, mbt // 2)) / (mbt - mbt // 2)
        smaller = int(max(1024, mbt - over / per_tok) // 1024 * 1024)
        return f"lower --micro_batch_tokens (now {mbt}) to about {smaller}"
    if engine == "vllm":
        room = (limit - (tot["rollout"] - u * G)) / G
        return f"lower --gpu_memory_utilization (now {u}) to at most {max(0.05, room):.2f}, or use more GPUs"
    return "lower --envs_per_step or --K (the torch engine's cache grows with the batch), or use --engine vllm"


def format_table(res, title):
    phases = ["rollout", "train", "sync", "checkpoint"]
    lines = [title, "", "| per rank, GiB | " + " | ".join(phases) + " |", "|---|" + "---|" * len(phases)]
    for name, d in res["rows"]:
        lines.append(f"| {name} | " + " | ".join(f"{d[p]:.1f}" if p in d and d[p] else "" for p in phases) + " |")
    lines.append("| **total** | " + " | ".join(f"**{res['totals'][p]:.1f}**" for p in phases) + " |")
    lines += [
        "",
        "activations per micro-batch by --grad_checkpoint: "
        + ", ".join(f"{mode} {gib:.1f} GiB" for mode, gib in res["act"].items()),
        f"engine KV cache: {res['kv_gib']:.1f} GiB = {res['kv_tokens'] / 1000:.0f}k tokens"
        + (
            " (after vLLM's start-up reserve: {:.1f} GiB for {} sequences x {} batched tokens, and CUDA graphs)".format(
                *res["engine_reserve"]
            )
            if res["engine_reserve"]
            else ""
        ),
        f"disk per checkpoint: {res['disk_gb']:.1f} GB (HF exports + DCP shards), twice that while the next one is "
        "written (the previous checkpoint is removed after the swap)",
        "host memory per rank: {:.1f} GB while loading, {:.1f} GB steady, {:.1f} GB at a checkpoint (x{} ranks per "
        "node)".format(*res["host_gb"], res["node_ranks"]),
        f"peak {res['peak']:.1f} GiB ({res['phase']}) vs usable {res['limit']:.1f} GiB: "
        + ("fits" if res["fits"] else "DOES NOT FIT"),
    ]
    if res["fix"]:
        lines.append("fix: " + res["fix"])
    return "\n".join(lines)


# -----------------------------------------------------------------------------
# a run's plan: train.py's --dry_run, and the refusal of a GPU run that cannot fit


def largest_base(cfg):
    """train.py's policies and the config of their largest base (plans put every policy at that size)."""
    import config
    pols, _ = config.resolve(cfg)
    return pols, max((config.model_config(cfg, p.base) for p in pols), key=lambda c: counts(c).total)


def plan_for(cfg, world, gpu_gb):
    """The plan of train.py's configuration, for the largest base with every policy at that size (an upper bound
    when bases differ per role)."""
    import policies as P
    import tiny
    from engines import vllm_batched_tokens
    pols, mc = largest_base(cfg)
    lora = cfg["policies"] == "lora"
    return plan(
        mc,
        world=world,
        gpu_gb=gpu_gb,
        n_policies=len(pols),
        micro_batch_tokens=max(p.micro_batch_tokens for p in pols),
        grad_checkpoint=cfg["grad_checkpoint"],
        engine=cfg["engine"],
        gpu_memory_utilization=cfg["gpu_memory_utilization"],
        sleep=cfg["engine"] == "vllm",
        rows=cfg["envs_per_step"] // world * cfg["K"],
        max_model_len=cfg["max_model_len"],
        kl=cfg["kl_coef"] > 0,
        entropy=cfg["entropy_coef"] > 0,
        pack=cfg["pack"],
        compile=cfg["compile"],
        lora_rank=cfg["lora_rank"] if lora else 0,
        engine_seqs=P.engine_seqs(cfg, world),
        engine_tokens=vllm_batched_tokens(cfg["max_model_len"]),
        export_bytes=4 if tiny.is_tiny(cfg) else 2,
    )  # train.save: bf16 exports for real models


def first_checkpoint_bytes(cfg):
    """Disk of train.py's first checkpoint (checkpoint_bytes; as plan_for, an upper bound when bases
    differ per role)."""
    import tiny
    pols, mc = largest_base(cfg)
    lora_rank = cfg["lora_rank"] if cfg["policies"] == "lora" else 0
    return checkpoint_bytes(mc, len(pols), lora_rank, export_bytes=4 if tiny.is_tiny(cfg) else 2)


def print_plan(cfg):
    """--dry_run: the table; returns the exit status (0 if it fits)."""
    import os
    world = cfg["world"] or int(os.environ.get("WORLD_SIZE", "1"))
    gpu_gb = cfg["gpu_gb"] or 80.0
    res = plan_for(cfg, world, gpu_gb)
    title = (
        f"memory plan: --model {cfg['model'] or 'tiny'} --policies {cfg['policies']} --world {world} "
        f"--gpu_gb {gpu_gb:g} "
        f"--micro_batch_tokens {cfg['micro_batch_tokens']} --grad_checkpoint {cfg['grad_checkpoint']} "
        f"--engine {cfg['engine']} --gpu_memory_utilization {cfg['gpu_memory_utilization']}"
    )
    print(format_table(res, title))
    import policies as P
    wanted = cfg["envs_per_step"] // max(1, world) * cfg["K"]
    if P.engine_seqs(cfg, world) < wanted:
        print(f"vLLM runs at most {P.engine_seqs(cfg, world)} of a step's {wanted} sequences per rank at once "
              "(max_num_seqs, capped at its max_num_batched_tokens as vLLM requires); the rest queue")
    return 0 if res["fits"] else 1


def refuse_if_too_big(cfg):
    """A GPU run whose planned memory does not fit stops here, before anything loads, with the flag to change."""
    import os
    import torch
    if not torch.cuda.is_available():
        return
    world = int(os.environ.get("WORLD_SIZE", "1"))
    gpu_gb = (
        cfg["gpu_gb"] or torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", "0"))).total_memory / 2**30
    )
    res = plan_for(cfg, world, gpu_gb)
    if not res["fits"]:
        raise SystemExit(f"this configuration needs {res['peak']:.1f} GiB per GPU ({res['phase']}), more than the "
                         f"{res['limit']:.1f} GiB usable: {res['fix']} (see: python train.py --dry_run ...)")
