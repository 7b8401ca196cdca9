"""
Qwen3 written by hand, in reading order, with Hugging Face parameter names.

    from model import Qwen3, load_model
    model = load_model("path/to/Qwen3-1.7B")           # a HF folder: config.json + *.safetensors
    logits = model(input_ids)                           # right-padded [B, T] batch
    lp = token_logprobs(model, input_ids, targets, temperature=1.0)

Parameter names are exactly HF's (`model.layers.0.self_attn.q_proj.weight`, ...), so our
checkpoints, transformers and vLLM read each other's files unchanged, and weight sync into vLLM is a
plain name->tensor stream. What this file leaves out: sliding-window attention (Qwen3 dense models
do not use it), rope scaling (not used at the context lengths of the paper), attention bias, MoE.

Also here: the model sizes (`SIZES`: the tiny one and the real Qwen3 shapes), LoRA in PEFT's layout
(its adapter files: common.save_adapter), an FSDP2 sharding helper, and the KV-cache forward that
the pure-torch sampler in engines.py decodes with. A random model of any size with its byte
tokenizer: tiny.build_tiny.
"""
import json
import os
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

# -----------------------------------------------------------------------------
# config


@dataclass
class Qwen3Config:
    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 6144
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 128  # read from config: != hidden/heads for 0.6B and 4B
    max_position_embeddings: int = 40960
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    tie_word_embeddings: bool = True
    bos_token_id: int = 151643
    eos_token_id: int = 151645

    @classmethod
    def from_hf(cls, d: dict) -> "Qwen3Config":
        """From a parsed HF config.json. Accepts `rope_theta` (transformers < 5) and
        `rope_parameters` (>= 5)."""
        arch = d.get("model_type") or ""
        if arch != "qwen3":
            raise ValueError(f"config has model_type={arch!r}, but this code implements only Qwen3 "
                             "(model_type 'qwen3'); point --model at a Qwen3 checkpoint such as "
                             "Qwen/Qwen3-1.7B")
        kw = {f.name: d[f.name] for f in fields(cls) if f.name in d and d[f.name] is not None}
        rp = d.get("rope_parameters") or {}
        if "rope_theta" in rp:
            kw["rope_theta"] = rp["rope_theta"]
        if rp.get("rope_type", "default") != "default" or d.get("rope_scaling"):
            raise ValueError("rope scaling is not implemented; use the checkpoint's default rope settings")
        if isinstance(kw.get("eos_token_id"), list):
            kw["eos_token_id"] = kw["eos_token_id"][0]
        kw.setdefault("head_dim", d["hidden_size"] // d["num_attention_heads"])
        return cls(**kw)

    def to_hf(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_act="silu",
                 attention_bias=False, attention_dropout=0.0, use_sliding_window=False,
                 sliding_window=None, max_window_layers=self.num_hidden_layers,
                 initializer_range=0.02, torch_dtype="float32", use_cache=True, rope_scaling=None)
        return d


# the real checkpoints' shapes (vocab 151936, rope_theta 1e6, head_dim 128), and the embedded tiny
# one
SIZES = {
    "0.6B": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8),
    "1.7B": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8),
    "4B": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
               num_attention_heads=32, num_key_value_heads=8),
    "8B": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
               num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
    # ~2M parameters; vocab = 256 bytes + 5 specials, padded to 264 (a sampled padded row ends the
    # sequence)
    "tiny": dict(vocab_size=264, hidden_size=192, intermediate_size=576, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, max_position_embeddings=2048, rope_theta=10000.0, bos_token_id=256,
                 eos_token_id=258),
}
# a smaller tiny model with the same vocabulary (a second size for heterogeneous teams: --policy
# tool=tiny-small)
SIZES["tiny-small"] = {**SIZES["tiny"], **dict(hidden_size=128, intermediate_size=384,
                                               num_hidden_layers=2, num_attention_heads=2,
                                               num_key_value_heads=1)}

# -----------------------------------------------------------------------------
# modules


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # normalize in fp32 (fp64 stays fp64: the exactness tests), cast back, then scale: the
        # order HF uses (it matters in bf16)
        dtype = x.dtype
        x = x.to(torch.promote_types(dtype, torch.float32))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rotary(nn.Module):
    """RoPE's cos/sin tables, from an fp32 inv_freq like HF's. Not a buffer: `model.to(bf16)` casts
    floating buffers, and a bf16 inv_freq puts the angle at position p off by up to ~p * 2^-9 rad
    (it tripled the bf16 forward's logit error at 512 positions, measured on CPU and on an H100; HF
    keeps inv_freq in fp32)."""

    def __init__(self, cfg):
        super().__init__()
        self.head_dim, self.theta = cfg.head_dim, cfg.rope_theta
        self._inv_freq = {}  # device -> fp32 table

    def inv_freq(self, device):
        if device not in self._inv_freq:
            exps = torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim
            self._inv_freq[device] = (1.0 / (self.theta ** exps)).to(device)
        return self._inv_freq[device]

    def reset(self):
        """Forget the tables (after changing theta)."""
        self._inv_freq.clear()

    # pos [B, T] -> cos, sin [B, 1, T, head_dim], computed in fp32 like HF
    def forward(self, pos, dtype):
        freqs = pos.float()[..., None] * self.inv_freq(pos.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)
        # per head, before RoPE (Qwen3's change from Qwen2)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask=None, cache=None, start=0):
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.nh, self.hd)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, T, self.nkv, self.hd)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        # static cache [B, nkv, L, hd]: write this step, attend to everything so far
        if cache is not None:
            cache[0][:, :, start:start + T] = k
            cache[1][:, :, start:start + T] = v
            k, v = cache[0][:, :, :start + T], cache[1][:, :, :start + T]
        gqa = self.nh != self.nkv
        # right-padded training batch: causal alone is right, pads only follow real tokens
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        # packed rows on CUDA (batching.collate): the block structure, no dense T x T mask
        elif isinstance(mask, BlockMask):
            y = flex(q, k, v, block_mask=mask, enable_gqa=gqa)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.nh * self.hd))


_FLEX = {}
# compiles flex may make per call site: batching.flex_shapes(16384, 32768) has 91 micro-batch shapes,
# each compiled with and without grad (the pi_old pass): Dynamo's default of 8 would send the rest to
# eager flex, which builds the T x T scores (out of memory at real lengths)
FLEX_RECOMPILE_LIMIT = 192


def flex(q, k, v, **kw):
    """flex attention, compiled once per device type: on CUDA the compiled kernel skips the
    masked-out blocks of a packed row (the siblings' blocks) and never builds a dense mask; eager
    flex is a slow reference and has no backward on CPU, so the CPU path trains with SDPA and a
    dense mask and tests use this forward only. Static shapes (dynamic=False): packed rows come in
    bucketed lengths (batching.bucket_length), one kernel each, never a symbolic-length one."""
    if q.device.type not in _FLEX:
        if q.device.type == "cuda":
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                                       FLEX_RECOMPILE_LIMIT)
            _FLEX["cuda"] = compiled_flex()
        else:
            _FLEX[q.device.type] = flex_attention
    return _FLEX[q.device.type](q, k, v, **kw)


def compiled_flex():
    """flex_attention through Inductor, once for every layer (as torchtitan's
    `models/common/attention.py`), its kernel wrapped as one op (inductor_compiled_code) that
    selective checkpointing sees and keeps; unwrapped, backward recomputes it. One compiled region
    per checkpointed layer: torch 2.11's SAC keeps one queue for all of them."""
    return torch.compile(flex_attention, dynamic=False, options={"wrap_inductor_compiled_regions": True})


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# Activation checkpointing per decoder layer (--grad_checkpoint): off keeps every activation; full
# keeps the layer's input and recomputes the layer in backward; selective keeps the outputs of
# matmuls and attention, recomputing only the norms, RoPE, SiLU and adds (torchtitan's SelectiveAC,
# distributed/activation_checkpoint.py, saves these ops too and recomputes every second matmul)
CHECKPOINT_MODES = ("off", "selective", "full")  # from the most activations kept to the least
SELECTIVE_SAVE = {getattr(torch.ops.aten, op).default for op in (
    "mm", "addmm", "bmm", "linear", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention")} | {torch._higher_order_ops.flex_attention,
                                                torch._higher_order_ops.inductor_compiled_code}


def _keep_matmuls(ctx, func, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if func in SELECTIVE_SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context():
    return create_selective_checkpoint_contexts(_keep_matmuls)


class DecoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        # activation checkpointing inside forward keeps parameter names HF names
        self.checkpoint = "off"  # one of CHECKPOINT_MODES

    def _forward(self, x, cos, sin, mask, cache, start):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, start)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(self, x, cos, sin, mask=None, cache=None, start=0):
        if self.checkpoint == "off" or not self.training or cache is not None:
            return self._forward(x, cos, sin, mask, cache, start)
        args = (x, cos, sin, mask, None, 0)
        if self.checkpoint == "full":
            return checkpoint(self._forward, *args, use_reentrant=False)
        assert self.checkpoint == "selective", self.checkpoint
        return checkpoint(self._forward, *args, use_reentrant=False, context_fn=selective_context)


class Body(nn.Module):  # HF's `model.` prefix
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg)


class LMHead(nn.Linear):
    """`lm_head` (an nn.Linear, so the HF name `lm_head.weight` is unchanged). Given targets it
    returns per-token fp32 log-probs [B, T] computed over chunks of positions under activation
    checkpointing, so at most one [chunk, vocab] block of logits (151936 wide for Qwen3) is alive at
    a time in forward and backward. The loop is inside this module's forward so that FSDP2 gathers
    the head once per forward, not once per chunk."""

    def forward(self, h, targets=None, temperature=1.0, chunk=1024, entropy=False):
        if targets is None:
            return super().forward(h)
        B, T, H = h.shape
        h, t = h.reshape(B * T, H), targets.reshape(B * T)
        per_token = torch.is_tensor(temperature)  # [B, T]: each sample at the temperature it was sampled at
        if per_token:
            temperature = temperature.reshape(B * T, 1)
        out = []
        for s in range(0, B * T, chunk):
            temp = temperature[s:s + chunk] if per_token else temperature
            args = (h[s:s + chunk], self.weight, t[s:s + chunk], temp, entropy)
            if torch.is_grad_enabled() and (h.requires_grad or self.weight.requires_grad):
                out.append(checkpoint(_chunk_logprobs, *args, use_reentrant=False))
            else:
                out.append(_chunk_logprobs(*args))
        # not a view: FSDP2 hooks the root module's output
        return torch.cat(out).view(B, T, *out[0].shape[1:]).clone()


class Qwen3(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.config = cfg
        self.model = Body(cfg)
        self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_weights(self, std=0.02, generator=None):
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            else:
                nn.init.normal_(p, 0.0, std, generator=generator)

    def hidden(self, input_ids, position_ids=None, mask=None, cache=None, start=0):
        """Final hidden states [B, T, hidden] (before lm_head)."""
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(start, start + T, device=input_ids.device).expand(B, T)
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary(position_ids, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, mask, None if cache is None else cache[i], start)
        return self.model.norm(x)

    def forward(self, input_ids, targets=None, temperature=1.0, position_ids=None, mask=None,
                cache=None, start=0, chunk=1024, select=None, entropy=False):
        """Logits [B, T, vocab]; or, given `targets`, fp32 log softmax(logits /
        temperature)[targets] as [B, T] (see LMHead; `temperature`: a number, or [B, T], one per
        target); with `entropy`, [B, T, 2]: (that log-prob, the full distribution's entropy) per
        position. `select` [B, N]: score only the hidden states at
        these positions (targets then [B, N]): the positions that predict response tokens, so prompt
        positions never reach the 151936-wide head. Going through module calls (never reaching into
        a weight from outside) matters: FSDP2 unshards a unit's weights in its forward hooks."""
        h = self.hidden(input_ids, position_ids, mask, cache, start)
        if select is not None:
            h = h.gather(1, select[..., None].expand(-1, -1, h.shape[-1]))
        return self.lm_head(h, targets, temperature, chunk, entropy)

    def new_cache(self, batch, length, dtype=None, device=None):
        p = self.lm_head.weight
        shape = (batch, self.config.num_key_value_heads, length, self.config.head_dim)
        return [(torch.zeros(shape, dtype=dtype or p.dtype, device=device or p.device),
                 torch.zeros(shape, dtype=dtype or p.dtype, device=device or p.device)) for _ in self.model.layers]

    def num_params(self):
        return sum(p.numel() for p in self.parameters())


# -----------------------------------------------------------------------------
# per-token log-probs without materializing [B, T, vocab]


def _chunk_logprobs(h, w, targets, temperature, entropy=False):
    logits = h @ w.t()  # at least fp32 (fp64 stays fp64: the exactness tests)
    logp = (logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature).log_softmax(-1)
    lp = torch.gather(logp, -1, targets[..., None])[..., 0]
    return torch.stack((lp, -(logp.exp() * logp).sum(-1)), -1) if entropy else lp


def token_logprobs(model, input_ids, targets, temperature=1.0, chunk=1024):
    """Per-token log-probs of `targets` under `model` for a right-padded [B, T] batch (fp32 [B,
    T])."""
    return model(input_ids, targets=targets, temperature=temperature, chunk=chunk)


# -----------------------------------------------------------------------------
# HF checkpoint I/O


def load_model(path, dtype=torch.float32, device="cpu") -> Qwen3:
    cfg_path = os.path.join(str(path), "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"no config.json in {path!r}: --model must be a Hugging Face Qwen3 "
                                "folder (config.json + *.safetensors), e.g. one written by save_model "
                                "or downloaded with huggingface-cli")
    with open(cfg_path) as f:
        cfg = Qwen3Config.from_hf(json.load(f))
    from safetensors.torch import load_file
    files = sorted(x for x in os.listdir(path) if x.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path!r}")
    with torch.device("meta"):
        model = Qwen3(cfg)
    model.to_empty(device=device)
    state = {}
    for fn in files:
        state.update(load_file(os.path.join(path, fn), device=str(device)))
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        model.lm_head.weight = model.model.embed_tokens.weight
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"checkpoint {path!r} does not match Qwen3: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    return model.to(dtype)


def iter_hf_state(model, dtype=None):
    """Yield (HF name, full tensor) one parameter at a time, lm_head skipped when tied. Under FSDP2
    each tensor is gathered from the shards (a collective: every rank iterates in the same order);
    with `dtype` the local shard is cast *before* the gather, so a bf16 sync moves and holds 2 bytes
    per element, never the fp32 full tensor. The caller owns each tensor only until it asks for the
    next one: this is what keeps weight sync and checkpoint export at one tensor (or one bucket) of
    extra memory instead of a whole model (verl `fsdp_workers.py` `rollout_mode` streams a generator
    the same way). With LoRA adapters (`add_lora`) a targeted weight comes out merged with the
    active adapter, and the adapters themselves are not yielded: what an engine or HF loads."""
    lora = {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    for name, p in model.state_dict().items():
        if model.config.tie_word_embeddings and name == "lm_head.weight":
            continue
        if ".lora_" in name:
            continue
        if name.removesuffix(".weight") in lora:
            yield name, lora[name.removesuffix(".weight")].merged_weight(dtype)
            continue
        p = p.detach()
        if dtype is not None:
            p = p.to(dtype)
        yield name, (p.full_tensor() if hasattr(p, "full_tensor") else p)


# the class tiny.build_tokenizer writes (transformers 5's name for a tokenizer.json tokenizer, and its
# older one); AutoTokenizer resolves the same class but first imports transformers' model registry
# (~2 s a process on 2 cores: every run, eval and test subprocess; docs/tests.md)
PLAIN_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path):
    """The folder's tokenizer, as AutoTokenizer.from_pretrained(path) loads it: the plain
    tokenizer.json class directly, any other (a real Qwen3's Qwen2Tokenizer) through AutoTokenizer."""
    import transformers
    conf = os.path.join(str(path), "tokenizer_config.json")
    name = None
    if os.path.isfile(conf):  # (without one, AutoTokenizer reads the model's type from config.json)
        with open(conf) as f:
            name = json.load(f).get("tokenizer_class")
    if name in PLAIN_TOKENIZERS:
        return transformers.PreTrainedTokenizerFast.from_pretrained(path)
    return transformers.AutoTokenizer.from_pretrained(path)


def hf_state_dict(model):
    """name -> full tensor, HF names; lm_head dropped when tied. Holds the whole model: tests and
    tiny models only."""
    return dict(iter_hf_state(model))


def save_model(model, path, state=None, dtype=None, shard_bytes=4 * 2**30, write=True):
    """HF folder: config.json + safetensors. Streams: tensors are gathered one at a time
    (`iter_hf_state`; under FSDP2 every rank must call this, and only the rank with `write=True`
    keeps and writes anything) and written in files of at most `shard_bytes`
    (model-0000i-of-0000n.safetensors + model.safetensors.index.json, as HF does for big models), so
    the writer holds at most one file's worth of CPU memory. Pass `state` (a dict) when already
    gathered."""
    from safetensors.torch import save_file
    if write:
        os.makedirs(path, exist_ok=True)
    items = state.items() if state is not None else iter_hf_state(model, dtype)
    files, cur, size = [], {}, 0

    def flush():
        nonlocal cur, size
        if cur and write:
            fn = f"part-{len(files):05d}.safetensors"
            save_file(cur, os.path.join(path, fn), metadata={"format": "pt"})
            files.append((fn, list(cur)))
        cur, size = {}, 0
    for k, v in items:
        if write:
            v = (v.to(dtype) if dtype else v).detach().contiguous().cpu()
            if cur and size + v.numel() * v.element_size() > shard_bytes:
                flush()
            cur[k] = v
            size += v.numel() * v.element_size()
        del v  # the gathered tensor goes now, not at the next iteration
    flush()
    if not write:
        return
    n = len(files)
    if n == 1:
        os.replace(os.path.join(path, files[0][0]), os.path.join(path, "model.safetensors"))
    else:
        weight_map = {}
        for i, (fn, keys) in enumerate(files):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(os.path.join(path, fn), os.path.join(path, final))
            weight_map.update({k: final for k in keys})
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
    cfg = model.config.to_hf()
    if dtype is not None:
        cfg["torch_dtype"] = str(dtype).replace("torch.", "")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


# -----------------------------------------------------------------------------
# LoRA: one frozen base, one low-rank adapter per policy, in HF PEFT's layout and file format


# every linear of a layer:
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# for RL the attention-only default of early LoRA papers trains worse than adapting the MLPs too
# ("LoRA Without Regret", Thinking Machines 2025); PEFT calls this target_modules="all-linear"


def gathered(t):
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class LoRALinear(nn.Linear):
    """A frozen nn.Linear (its `weight` keeps the HF name) plus one adapter per policy, named as
    PEFT names them: `lora_A.<policy>.weight` [r, in] and `lora_B.<policy>.weight` [out, r]; B
    starts at zero, so every policy starts as the base. `active` picks the adapter: y = x W^T +
    (alpha / r) (x A^T) B^T."""

    def __init__(self, base: nn.Linear, names, r, alpha):
        super().__init__(base.in_features, base.out_features, bias=False, device="meta")
        self.weight = base.weight
        self.weight.requires_grad_(False)
        kw = dict(bias=False, device=base.weight.device, dtype=base.weight.dtype)
        # PEFT's init: kaiming-uniform A
        self.lora_A = nn.ModuleDict({n: nn.Linear(base.in_features, r, **kw) for n in names})
        self.lora_B = nn.ModuleDict({n: nn.Linear(r, base.out_features, **kw) for n in names})
        for b in self.lora_B.values():
            nn.init.zeros_(b.weight)
        self.scale, self.active = alpha / r, names[0]

    def forward(self, x):
        return super().forward(x) + self.lora_B[self.active](self.lora_A[self.active](x)) * self.scale

    def merged_weight(self, dtype=None):
        """W + scale B A of the active adapter, full (gathered under FSDP2), computed in fp32."""
        w = gathered(self.weight).float()
        lora_B = gathered(self.lora_B[self.active].weight).float()
        lora_A = gathered(self.lora_A[self.active].weight).float()
        w = w + self.scale * (lora_B @ lora_A)
        return w.to(dtype or self.weight.dtype)


def add_lora(model, names, r, alpha, targets=LORA_TARGETS, seed=0):
    """In place, before sharding: freeze every weight, wrap each targeted linear of every layer in a
    LoRALinear with one adapter per name. Parameter names of the base stay HF names."""
    if r <= 0:
        raise ValueError(f"LoRA rank must be >= 1, not {r} (--lora_rank)")
    model.requires_grad_(False)
    torch.manual_seed(seed)
    for layer in model.model.layers:
        for block in (layer.self_attn, layer.mlp):
            for t in targets:
                if hasattr(block, t):
                    setattr(block, t, LoRALinear(getattr(block, t), list(names), r, alpha))
    model.lora = dict(r=r, alpha=alpha, targets=list(targets), names=list(names))
    return model


def set_adapter(model, name):
    for m in model.modules():
        if isinstance(m, LoRALinear):
            m.active = name


def adapter_parameters(model, name):
    return [p for n, p in model.named_parameters() if f".lora_A.{name}." in n or f".lora_B.{name}." in n]


# -----------------------------------------------------------------------------
# FSDP2


def shard(model, mesh=None, checkpoint="off", param_dtype=None, compile=False):
    """FSDP2 in place (parameter names unchanged), the torchtitan way
    (`torchtitan/distributed/fsdp.py`):
    - one unit per decoder layer, the embedding its own unit and [final norm, lm_head] one unit, so
      no weights stay unsharded between forward and backward; tied embeddings (0.6B/1.7B/4B) are one
      parameter, so there the embedding, final norm and head form one unit;
    - mixed precision through FSDP2, not autocast: `param_dtype` (bf16 on GPU) is what the
      all-gather moves and the forward computes in, gradients are reduced in fp32 into fp32 master
      shards. (Autocast around an fp32 FSDP2 model keeps bf16 weight copies alive outside FSDP2's
      reshard: +2 B/param measured in the review.) None = fp32;
    - activation checkpointing per layer (`checkpoint`: one of CHECKPOINT_MODES) and optional
      `torch.compile` per layer (`nn.Module.compile`, in place), applied before sharding as
      torchtitan does.
    On CPU pass an explicit CPU mesh (or none: one is built over all ranks)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    import torch.distributed as dist
    if mesh is None:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (dist.get_world_size(),))
    if checkpoint not in CHECKPOINT_MODES:
        raise ValueError(f"checkpoint={checkpoint!r}: one of {CHECKPOINT_MODES}")
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    body = model.model
    for layer in body.layers:
        layer.checkpoint = checkpoint
        if compile:
            layer.compile()
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    if model.config.tie_word_embeddings:
        fully_shard([body.embed_tokens, body.norm, model.lm_head], mesh=mesh, mp_policy=mp)
    else:
        fully_shard(body.embed_tokens, mesh=mesh, mp_policy=mp)
        fully_shard([body.norm, model.lm_head], mesh=mesh, mp_policy=mp)
    # the root: no parameters left, it drives lazy init and prefetch
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model
