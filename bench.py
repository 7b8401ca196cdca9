"""
The benchmarks behind the README's speed numbers (not tests: these machines are shared and noisy, so each number
is a median over repeats, reported as a ratio against a reference measured in the same process where there is one).

    python bench.py model      # forward+backward: our Qwen3 vs transformers' on the same config and batch
    python bench.py sampler    # tokens/s: the pure-torch sampler vs vLLM on the tiny model
    python bench.py sandbox    # sandbox executions/s: a trivial program and a typical CodeContests test, with and without bubblewrap
    python bench.py env        # environment seconds per step, math and code, scripted policy: serial vs the default
    python bench.py train      # the CPU default's update: packed rows (prompt once per sibling group) vs one row per sample
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


def bench_sandbox(n=64, repeats=3):
    """Executions per second through run_many, bubblewrap vs the process guard alone, same programs (cache off)."""
    import envs as E
    import sandbox as S
    row = E.load_split("code", "test", ["code/test/code_contests_test.jsonl"])[0]
    prog = "import sys\ndata = sys.stdin.read().split()\nn, m = int(data[0]), int(data[1])\nprint(' '.join(str(i + 1) for i in range(n)))\n"
    res = {}
    for mode in ("bwrap", "guard"):
        S._BWRAP_OK = S.bwrap_available() if mode == "bwrap" else False  # the guard alone: what runs without namespaces
        for name, jobs in (("trivial", [("print(1)", "", 5.0)] * n), ("codecontests", [(prog, row["tests"][0]["input"], 5.0)] * n)):
            rates = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                list(S._WAITERS.map(lambda j: S.run_code(*j, cache=False), jobs))
                rates.append(n / (time.perf_counter() - t0))
            res[f"{name}_{mode}_per_s"] = statistics.median(rates)
    S._BWRAP_OK = None
    res["bwrap_over_guard_trivial"] = res["trivial_bwrap_per_s"] / res["trivial_guard_per_s"]
    res["bwrap_over_guard_codecontests"] = res["codecontests_bwrap_per_s"] / res["codecontests_guard_per_s"]
    print(json.dumps({"bench": f"sandbox executions/s, {n} runs, {S.WORKERS} at a time, {os.cpu_count()} cores, median of {repeats}", **res}))


def bench_env_one(task):
    """One scripted tree rollout (16 envs, K=4, 2 turns, 5% looping programs): environment seconds. The pools and the
    cache read SANDBOX_WORKERS / SCORE_THREADS / SANDBOX_CACHE at import, so each configuration is its own process."""
    import random
    import envs as E
    from rollout import Agents, DefaultScript, ScriptedEngine, tree_rollout
    from transformers import AutoTokenizer
    d = tempfile.mkdtemp()
    M.build_tokenizer(d)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(M.Qwen3Config(**M.SIZES["tiny"]).to_hf(), f)
    eng = ScriptedEngine(d, seed=0, script=DefaultScript(p_wrong=0.3, p_loop=0.05, p_hostile=0.02))
    agents = Agents(AutoTokenizer.from_pretrained(d), [eng], {r: 0 for r in ("tool", "coder", "tester", "reasoner")}, 100000)
    rows = E.load_split(task, "train")
    rng = random.Random(0)
    envs = [E.train_env(task, rng, "mas", False, rows) for _ in range(16)]
    timer = {}
    tree_rollout(envs, agents, 4, 2, dict(temperature=1.0, top_p=1.0, max_new_tokens=100000), 1.0, "greedy", random.Random(0), timer)
    import sandbox as S
    print(json.dumps({"env_s": timer["env"], "runs": S.stats["runs"], "cached": S.stats["cached"]}))


def bench_env():
    """Serial (one program at a time, one scoring thread, no cache) vs the default, on the same scripted answers."""
    import subprocess
    out = {}
    for task in ("math", "code"):
        for mode, env in (("serial", {"SANDBOX_WORKERS": "1", "SCORE_THREADS": "1", "SANDBOX_CACHE": "0"}), ("default", {})):
            r = subprocess.run([sys.executable, __file__, "env_one", task], env={**os.environ, **env}, capture_output=True, text=True)
            out[f"{task}_{mode}"] = json.loads(r.stdout.strip().splitlines()[-1])
        out[f"{task}_default_over_serial"] = out[f"{task}_default"]["env_s"] / out[f"{task}_serial"]["env_s"]
    print(json.dumps({"bench": "environment seconds per step, scripted policy, 16 envs, K=4, 2 turns, 5% looping programs, "
                      f"tool timeout 5 s, test timeout 6 s, {os.cpu_count()} cores", **out}))


def bench_train(n_rollouts=3, repeats=5):
    """Trained tokens and update seconds per step on the CPU default's real rollouts (the tiny base model, compact
    Plan-Path, 16 envs, K = 4, T = 4, the default's 4 PPO mini-batches), packed vs one row per sample. The same
    rollouts and starting weights for both, interleaved, medians."""
    import copy
    import random
    import envs as E
    import train as T
    from grpo_mas import compute_advantages
    from rollout import Agents, make_engine, tree_rollout
    from transformers import AutoTokenizer
    cfg = {k: getattr(T, k) for k in T.config_keys}
    cfg.update({k: v for k, v in T.DEFAULTS["tiny"].items()})
    base = os.path.join("runs", "tiny-base-plan-s0")
    T.build_tiny_base(base, "plan", cfg)  # cached: the same base every default run starts from
    tok = AutoTokenizer.from_pretrained(base)
    agents = Agents(tok, [make_engine("torch", base, seed=0, max_len=cfg["max_model_len"])], {"tool": 0, "plan": 0},
                    cfg["max_prompt_tokens"])
    rollouts = []
    for r in range(n_rollouts):
        rng = random.Random(f"bench-{r}")
        envs = [E.train_env("plan", rng, "mas", True) for _ in range(cfg["envs_per_step"])]
        agents.seed_base = r
        samples = tree_rollout(envs, agents, cfg["K"], cfg["turns"], dict(temperature=1.0, top_p=1.0, max_new_tokens=cfg["max_new_tokens"]),
                               1.0, "greedy", rng)
        rollouts.append(compute_advantages(samples, "at_grpo")[0])
    model0 = M.load_model(base)
    res = {True: [], False: []}
    toks = {}
    for _ in range(repeats):
        for pack in (False, True):
            for samples in rollouts:
                m = copy.deepcopy(model0)
                opt = torch.optim.AdamW(m.parameters(), lr=cfg["lr"])
                t0 = time.perf_counter()
                st = T.update_policy(m, opt, samples, {**cfg, "pack": pack}, 1, torch.device("cpu"))
                res[pack].append(time.perf_counter() - t0)
                toks.setdefault(pack, []).append(st["trained_tokens"])
    print(json.dumps({"bench": f"update of the CPU default on {n_rollouts} real rollouts (tiny base, compact Plan-Path, 16 envs, "
                      f"K=4, T=4, 4 mini-batches), {repeats} interleaved repeats, medians",
                      "samples_per_step": statistics.median(len(s) for s in rollouts),
                      "response_tokens_per_step": statistics.median(sum(len(x.response_ids) for x in s) for s in rollouts),
                      "trained_tokens_unpacked": statistics.median(toks[False]), "trained_tokens_packed": statistics.median(toks[True]),
                      "update_s_unpacked": statistics.median(res[False]), "update_s_packed": statistics.median(res[True]),
                      "packed_over_unpacked": statistics.median(res[True]) / statistics.median(res[False])}))


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
    if which == "env_one":
        bench_env_one(sys.argv[2])
    else:
        {"model": bench_model, "sampler": bench_sampler, "sandbox": bench_sandbox, "env": bench_env, "train": bench_train,
         "gpu": bench_gpu}[which]()
