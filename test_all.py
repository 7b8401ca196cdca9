"""
The whole test suite, CPU only: `./setup.sh && .venv/bin/python -m pytest -x -q test_all.py`.

Every test checks behaviour against an independent reference: transformers' Qwen3 for the model, vLLM
against the torch sampler and HF generate, a single process for FSDP2, brute-force solvers for the games,
hand-computed rewards for the envs and the loss. Sections follow the files: model, engines, FSDP2, envs,
sandbox, grouping/loss, rollouts, training, eval.
"""
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time

import pytest
import torch

import model as M

HERE = os.path.dirname(os.path.abspath(__file__))
PY = sys.executable
torch.set_num_threads(2)

# -----------------------------------------------------------------------------
# fixtures: one tiny model folder and one vLLM engine for the session (vLLM takes ~25 s to start on CPU)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tiny"))
    M.build_tiny(d, seed=0, std=0.1)  # std 0.1: peaked logits, so greedy has no near-ties between implementations
    return d


@pytest.fixture(scope="session")
def vllm_engine(tiny_dir):
    from rollout import make_engine
    return make_engine("vllm", tiny_dir, seed=0, max_len=1024)


def hf_model(path, dtype=torch.float32):
    from transformers import Qwen3ForCausalLM
    return Qwen3ForCausalLM.from_pretrained(path, dtype=dtype).eval()


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
# model.py against transformers

PARITY_CONFIGS = [  # tied/untied, head_dim*heads != hidden, GQA ratio 1, 2, 4
    dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=32, tie_word_embeddings=True),
    dict(vocab_size=101, hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=24, tie_word_embeddings=False),
    dict(vocab_size=89, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, rope_theta=1e6),
]


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
    # bf16 has 8 mantissa bits: logits of magnitude ~5 are rounded at ~0.03. Both sides round at the same
    # places (same op order), so we see a max |diff| of 0 to ~0.06; assert 0.1 absolute and a high argmax match.
    cfg = M.Qwen3Config(**{**M.SIZES["tiny"], **PARITY_CONFIGS[1]})
    torch.manual_seed(0)
    ours = M.Qwen3(cfg)
    ours.init_weights(0.05)
    M.save_model(ours, str(tmp_path))
    hf = hf_model(str(tmp_path), torch.bfloat16)
    ours = ours.to(torch.bfloat16)
    ids, mask = random_batch(cfg.vocab_size, [64, 40], seed=1)
    with torch.no_grad():
        a, b = ours(ids).float(), hf(input_ids=ids, attention_mask=mask).logits.float()
    valid = mask.bool()
    diff = (a[valid] - b[valid]).abs().max().item()
    agree = (a[valid].argmax(-1) == b[valid].argmax(-1)).float().mean().item()
    print(f"bf16 max|dlogit|={diff:.4f} argmax agreement={agree:.4f}")
    assert diff <= 0.1 and agree >= 0.97


def test_config_spellings_and_sizes():
    base = {"model_type": "qwen3", "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 8,
            "num_hidden_layers": 1, "num_key_value_heads": 2, "vocab_size": 10}
    assert M.Qwen3Config.from_hf({**base, "rope_theta": 5.0}).rope_theta == 5.0
    assert M.Qwen3Config.from_hf({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 7.0}}).rope_theta == 7.0
    assert M.Qwen3Config.from_hf(base).head_dim == 16  # absent head_dim -> hidden / heads
    with torch.device("meta"):  # named sizes have the published parameter counts
        counts = {k: M.Qwen3(M.Qwen3Config(**M.SIZES[k])).num_params() / 1e9 for k in ("0.6B", "1.7B", "4B", "8B")}
    assert abs(counts["0.6B"] - 0.596) < 0.01 and abs(counts["1.7B"] - 1.72) < 0.02
    assert abs(counts["4B"] - 4.02) < 0.03 and abs(counts["8B"] - 8.19) < 0.03


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


# -----------------------------------------------------------------------------
# engines: vLLM, torch sampler, HF generate


def _prompts():
    return [[257, 84, 82, 68, 81, 198], list(range(40, 80)), [257, 71, 68, 75, 75, 78, 220, 86, 78], [5] * 3]


def _greedy_ours(model, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(torch.tensor([ids]))[0, -1].argmax())
            ids.append(nxt)
            if nxt in (256, 258):
                break
    return ids[len(prompt):]


def test_greedy_same_tokens_vllm_torch_hf(tiny_dir, vllm_engine):
    from rollout import make_engine
    te = make_engine("torch", tiny_dir, seed=0, max_len=1024)
    hf = hf_model(tiny_dir)
    a = vllm_engine.generate(_prompts(), n=1, temperature=0, max_new_tokens=24)
    b = te.generate(_prompts(), n=1, temperature=0, max_new_tokens=24)
    for p, x, y in zip(_prompts(), a, b):
        out = hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, eos_token_id=[256, 258], pad_token_id=256)
        ref = out[0, len(p):].tolist()
        ref = ref[:next((j + 1 for j, t in enumerate(ref) if t in (256, 258)), len(ref))]
        assert x[0].ids == y[0].ids == ref
        assert max(abs(u - v) for u, v in zip(x[0].logprobs, y[0].logprobs)) < 1e-4


def test_engine_rejects_too_long_prompt(vllm_engine):
    with pytest.raises(ValueError, match="context"):
        vllm_engine.generate([[1] * 1020], n=1, max_new_tokens=10)


def test_torch_sampler_statistics(tiny_dir):
    # sampled ids' log-probs are the trainer's temperature-scaled log-probs, and top-p keeps only the nucleus
    from rollout import make_engine
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


# -----------------------------------------------------------------------------
# FSDP2: 2 processes (gloo) against one process


FSDP_WORKER = r'''
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, os.environ["HERE"])
import model as M
from rollout import TorchEngine
dist.init_process_group("gloo")
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
    torch.save({"loss": tot, "grads": grads, "state": state, "engine": dict(eng.model.named_parameters())}, os.environ["OUTF"])
dist.destroy_process_group()
'''


def test_fsdp2_two_processes_match_single(tiny_dir, tmp_path):
    ids, _ = random_batch(261, [33] * 6, seed=5)
    torch.save(ids, tmp_path / "batch.pt")
    (tmp_path / "w.py").write_text(FSDP_WORKER)
    env = {**os.environ, "HERE": HERE, "TINY": tiny_dir, "BATCH": str(tmp_path / "batch.pt"), "OUTF": str(tmp_path / "out.pt"),
           "OMP_NUM_THREADS": "1"}
    r = subprocess.run([PY, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29531", str(tmp_path / "w.py")],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt")
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
