"""
The benchmarks behind the README's speed numbers (not tests: these machines are shared and noisy, so each number
is a median over repeats, reported as a ratio against a reference measured in the same process where there is one).

    python bench.py model      # forward+backward: our Qwen3 vs transformers' on the same config and batch
    python bench.py sampler    # tokens/s: the pure-torch sampler vs vLLM on the tiny model
    python bench.py sandbox    # sandbox executions/s: a trivial program and a typical CodeContests test
    python bench.py gpu        # CUDA only: bf16 parity vs transformers, and fwd+bwd throughput/MFU of Qwen3-1.7B at 4096
"""
import json
import os
import statistics
import sys
import tempfile
import time

import torch

import model as M


def timeit(fn, repeats):
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def bench_model(repeats=7):
    from transformers import Qwen3ForCausalLM
    d = tempfile.mkdtemp()
    ours = M.build_tiny(d, size="tiny")
    hf = Qwen3ForCausalLM.from_pretrained(d, dtype=torch.float32)
    x = torch.randint(0, 261, (16, 256))

    def step(m, hf_style):
        m.zero_grad(set_to_none=True)
        logits = m(x).logits if hf_style else m(x)
        logits.float().log_softmax(-1).mean().backward()
    for m, h in ((ours, False), (hf, True)):
        step(m, h)  # warm-up
    ratios, t_ours, t_hf = [], [], []
    for _ in range(repeats):  # interleaved, so load changes hit both alike
        a = timeit(lambda: step(ours, False), 1)
        b = timeit(lambda: step(hf, True), 1)
        t_ours.append(a)
        t_hf.append(b)
        ratios.append(a / b)
    print(json.dumps({"bench": "model fwd+bwd, tiny Qwen3, batch 16x256, fp32 CPU", "ours_s": statistics.median(t_ours),
                      "transformers_s": statistics.median(t_hf), "median_ratio_ours_over_hf": statistics.median(ratios)}))


def bench_sampler(repeats=5):
    from rollout import make_engine
    d = tempfile.mkdtemp()
    M.build_tiny(d, size="tiny", std=0.1)
    prompts = [[257] + [40 + (i * 7 + j) % 50 for j in range(40)] for i in range(64)]
    res = {}
    for kind in ("torch", "vllm"):
        eng = make_engine(kind, d, seed=0, max_len=512)
        eng.generate(prompts, n=4, temperature=1.0, max_new_tokens=32)  # warm-up
        toks, secs = [], []
        for r in range(repeats):
            t0 = time.perf_counter()
            outs = eng.generate(prompts, n=4, temperature=1.0, max_new_tokens=32, seed=r)
            secs.append(time.perf_counter() - t0)
            toks.append(sum(len(c.ids) for o in outs for c in o))
        res[kind] = statistics.median(t / s for t, s in zip(toks, secs))
    print(json.dumps({"bench": "sampler tokens/s, tiny model, 64 prompts x n=4, 40-token prompts, <=32 new tokens, fp32 CPU",
                      "torch_tok_s": res["torch"], "vllm_tok_s": res["vllm"], "vllm_over_torch": res["vllm"] / res["torch"]}))


def bench_sandbox(n=64):
    import envs as E
    trivial = [("print(1)", "", 5.0)] * n
    t0 = time.perf_counter()
    E.run_many(trivial)
    a = n / (time.perf_counter() - t0)
    row = E.load_split("code", "test", ["code/test/code_contests_test.jsonl"])[0]
    t = row["tests"][0]
    prog = "import sys\ndata = sys.stdin.read().split()\nn, m = int(data[0]), int(data[1])\nprint(' '.join(str(i + 1) for i in range(n)))\n"
    jobs = [(prog, t["input"], 5.0)] * n
    t0 = time.perf_counter()
    E.run_many(jobs)
    b = n / (time.perf_counter() - t0)
    print(json.dumps({"bench": f"sandbox executions/s, {n} runs, 16 threads, 2 cores", "trivial_per_s": a,
                      "codecontests_test_per_s": b}))


def bench_gpu():
    """CUDA only. (1) bf16 parity of our Qwen3 vs transformers on a 4-layer 1.7B-shaped random model; (2) fwd+bwd+AdamW
    throughput and MFU of the full Qwen3-1.7B shape at sequence length 4096 through the training path (FSDP2 with the
    bf16 param / fp32 reduce policy on a 1-rank NCCL group), eager and per-block compiled, with and without activation
    checkpointing, each with its peak memory next to memory.py's estimate for the same micro-batch."""
    assert torch.cuda.is_available(), "bench.py gpu needs CUDA"
    import torch.distributed as dist
    import memory
    from transformers import Qwen3ForCausalLM
    d = tempfile.mkdtemp()
    cfg = M.Qwen3Config(**{**M.SIZES["1.7B"], "num_hidden_layers": 4})
    torch.manual_seed(0)
    ours = M.Qwen3(cfg)
    ours.init_weights(0.02)
    M.save_model(ours, d)
    hf = Qwen3ForCausalLM.from_pretrained(d, dtype=torch.bfloat16).cuda().eval()
    ours = ours.to(torch.bfloat16).cuda().eval()
    x = torch.randint(0, cfg.vocab_size, (2, 512), device="cuda")
    with torch.no_grad():
        a, b = ours(x).float(), hf(x).logits.float()
        lp_ours = M.token_logprobs(ours, x[:, :-1], x[:, 1:])
        lp_hf = b[:, :-1].log_softmax(-1).gather(-1, x[:, 1:, None])[..., 0]
    print(json.dumps({"bench": "bf16 CUDA parity, 4-layer 1.7B-shaped, 2x512", "max_abs_dlogit": (a - b).abs().max().item(),
                      "mean_abs_dlogit": (a - b).abs().mean().item(), "argmax_agree": (a.argmax(-1) == b.argmax(-1)).float().mean().item(),
                      "mean_abs_dlogp": (lp_ours - lp_hf).abs().mean().item()}), flush=True)
    del hf, ours
    torch.cuda.empty_cache()
    if not dist.is_initialized():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    cfg = M.Qwen3Config(**M.SIZES["1.7B"])
    T, B = 4096, 2
    x = torch.randint(0, cfg.vocab_size, (B, T), device="cuda")
    peak = float(os.environ.get("PEAK_TFLOPS", "989")) * 1e12  # H100 SXM dense bf16
    for compiled, ckpt in ((False, True), (False, False), (True, True)):
        torch.manual_seed(0)
        m = M.Qwen3(cfg)
        m.init_weights(0.02)
        M.shard(m, checkpoint=ckpt, param_dtype=torch.bfloat16, compile=compiled)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-6)

        def step():
            lp = m(x[:, :-1], targets=x[:, 1:])
            (-lp.mean()).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        first = time.perf_counter() - t0
        torch.cuda.reset_peak_memory_stats()
        s = timeit(step, 5)
        mem = torch.cuda.max_memory_allocated() / 2 ** 30
        plan = memory.plan(cfg, world=1, gpu_gb=80, n_policies=1, micro_batch_tokens=B * T, grad_checkpoint=ckpt, engine="torch", rows=0)
        est = plan["totals"]["train"] - memory.CONTEXT_GIB - plan["rows"][1][1]["train"]  # allocator only, no engine
        tok_s = B * (T - 1) / s
        print(json.dumps({"bench": f"Qwen3-1.7B shape, fwd+bwd+AdamW, FSDP2 bf16 policy (1 rank), B={B} T={T}, "
                          f"checkpointing {ckpt}, compiled {compiled}", "step_s": s, "first_step_s": first, "tokens_per_s": tok_s,
                          "mfu": M.flops_per_token(cfg, T) * tok_s / peak, "peak_alloc_gib": mem, "planner_train_gib": est,
                          "gpu": torch.cuda.get_device_name()}), flush=True)
        del m, opt
        torch.cuda.empty_cache()


if __name__ == "__main__":
    torch.set_num_threads(os.cpu_count() or 1)
    which = sys.argv[1] if len(sys.argv) > 1 else "model"
    {"model": bench_model, "sampler": bench_sampler, "sandbox": bench_sandbox, "gpu": bench_gpu}[which]()
