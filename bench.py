"""
The benchmarks behind the speed numbers in docs/results.md (not tests: these machines are shared and noisy, so each
number is a median over repeats, reported as a ratio against a reference measured in the same process where there is
one).

    python bench.py model      # forward+backward: our Qwen3 vs transformers' on the same config and batch
    python bench.py sampler    # tokens/s: the pure-torch sampler vs vLLM on the tiny model
    python bench.py sandbox    # sandbox executions/s: a trivial program and a CodeContests test, +- bubblewrap
    python bench.py env        # environment seconds per step, math and code, scripted policy: serial vs the default
    python bench.py train      # the CPU default's update: packed rows (prompt once per group) vs a row per sample
    python bench.py refill     # DAPO's refill (the CPU default): tokens generated per token trained, batch vs missing
    python bench.py share      # a busy machine: warm-up and default steps alone and beside busy processes
    python bench.py ranks      # the same, train.py end to end: one process of 2 threads vs 2 ranks of 1 thread
    python bench.py quota      # a container's CPU quota: torch's own threads vs the cores it allows (root)
    python bench.py step       # where the CPU default's step goes, vLLM vs the torch sampler, against matmul peak
    python bench.py prefix     # the torch sampler's reuse of the last call's prefill: evaluation and collect, +-
    python bench.py gpu        # CUDA only: bf16 parity vs transformers, fwd+bwd MFU of Qwen3-1.7B, the update
"""
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import threads  # before torch: OpenMP spins briefly
import torch

import model as M
import tiny


def flops_per_token(cfg: M.Qwen3Config, seq_len: int) -> float:
    """Training FLOPs per token (forward+backward = 3x forward): 6*N for the matmul weights +
    attention scores."""
    h, L = cfg.hidden_size, cfg.num_hidden_layers
    attn_w = h * cfg.head_dim * (cfg.num_attention_heads * 2 + cfg.num_key_value_heads * 2)
    n = L * (attn_w + 3 * h * cfg.intermediate_size) + h * cfg.vocab_size
    # causal: half the scores
    attn = 2 * 2 * L * cfg.num_attention_heads * cfg.head_dim * seq_len / 2
    return 6 * n + 3 * attn


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
    ours = tiny.build_tiny(d, size="tiny")
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
    print(json.dumps({"bench": "model fwd+bwd, tiny Qwen3, batch 16x256, fp32 CPU",
                      "ours_s": statistics.median(t_ours), "transformers_s": statistics.median(t_hf),
                      "median_ratio_ours_over_hf": statistics.median(ratios)}))


def bench_sampler(repeats=5):
    from policies import make_engine
    d = tempfile.mkdtemp()
    tiny.build_tiny(d, size="tiny", std=0.1)
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
    print(
        json.dumps(
            {
                "bench": "sampler tokens/s, tiny model, 64 prompts x n=4, 40-token prompts, <=32 new tokens, fp32 CPU",
                "torch_tok_s": res["torch"],
                "vllm_tok_s": res["vllm"],
                "vllm_over_torch": res["vllm"] / res["torch"],
            }
        )
    )


def bench_sandbox(n=64, repeats=3):
    """Executions per second through run_many, bubblewrap vs the process guard alone, same programs (cache off)."""
    import envs as E
    import sandbox as S
    row = E.load_split("code", "test", ["code/test/code_contests_test.jsonl"])[0]
    prog = ("import sys\ndata = sys.stdin.read().split()\nn, m = int(data[0]), int(data[1])\n"
            "print(' '.join(str(i + 1) for i in range(n)))\n")
    res = {}
    for mode in ("bwrap", "guard"):
        S._BWRAP_OK = S.bwrap_available() if mode == "bwrap" else False  # the guard alone: what runs without namespaces
        workloads = (("trivial", [("print(1)", "", 5.0)] * n),
                     ("codecontests", [(prog, row["tests"][0]["input"], 5.0)] * n))
        for name, jobs in workloads:
            rates = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                list(S._WAITERS.map(lambda j: S.run_code(*j, cache=False), jobs))
                rates.append(n / (time.perf_counter() - t0))
            res[f"{name}_{mode}_per_s"] = statistics.median(rates)
    S._BWRAP_OK = None
    res["bwrap_over_guard_trivial"] = res["trivial_bwrap_per_s"] / res["trivial_guard_per_s"]
    res["bwrap_over_guard_codecontests"] = res["codecontests_bwrap_per_s"] / res["codecontests_guard_per_s"]
    what = f"sandbox executions/s, {n} runs, {S.WORKERS} at a time, {os.cpu_count()} cores, median of {repeats}"
    print(json.dumps({"bench": what, **res}))


def bench_env_one(task):
    """One scripted tree rollout (16 envs, K=4, 2 turns, 5% looping programs): environment seconds. The pools and the
    cache read SANDBOX_WORKERS / SCORE_THREADS / SANDBOX_CACHE at import, so each configuration is its own process."""
    import random
    import envs as E
    from rollout import Agents, every_role, tree_rollout
    from scripted import DefaultScript, ScriptedEngine
    d = tempfile.mkdtemp()
    tiny.build_tokenizer(d)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(M.Qwen3Config(**M.SIZES["tiny"]).to_hf(), f)
    eng = ScriptedEngine(d, seed=0, script=DefaultScript(p_wrong=0.3, p_loop=0.05, p_hostile=0.02))
    agents = Agents(
        M.load_tokenizer(d), [eng], {r: 0 for r in ("tool", "coder", "tester", "reasoner")}, 100000
    )
    rows = E.load_split(task, "train")
    rng = random.Random(0)
    envs = [E.train_env(task, rng, "mas", False, rows) for _ in range(16)]
    timer = {}
    tree_rollout(
        envs,
        agents,
        4,
        2,
        every_role(temperature=1.0, top_p=1.0, max_new_tokens=100000),
        1.0,
        "greedy",
        random.Random(0),
        timer,
    )
    import sandbox as S
    print(json.dumps({"env_s": timer["env"], "runs": S.stats["runs"], "cached": S.stats["cached"]}))


def bench_env():
    """Serial (one program at a time, one scoring thread, no cache) vs the default, on the same scripted answers."""
    import subprocess
    out = {}
    for task in ("math", "code"):
        serial = {"SANDBOX_WORKERS": "1", "SCORE_THREADS": "1", "SANDBOX_CACHE": "0"}
        for mode, env in (("serial", serial), ("default", {})):
            r = subprocess.run(
                [sys.executable, __file__, "env_one", task], env={**os.environ, **env}, capture_output=True, text=True
            )
            out[f"{task}_{mode}"] = json.loads(r.stdout.strip().splitlines()[-1])
        out[f"{task}_default_over_serial"] = out[f"{task}_default"]["env_s"] / out[f"{task}_serial"]["env_s"]
    print(
        json.dumps(
            {
                "bench": "environment seconds per step, scripted policy, 16 envs, K=4, 2 turns, 5% looping programs, "
                f"tool timeout 5 s, test timeout 6 s, {os.cpu_count()} cores",
                **out,
            }
        )
    )


# bench_train's update layouts: (rows, mini-batch split, optimizer steps per rollout batch)
TRAIN_LAYOUTS = {
    "unpacked, strided, 4": dict(pack=False, split="strided", minibatches=4),
    "packed, groups, 4": dict(pack=True, split="groups", minibatches=4),
    "packed, 1": dict(pack=True, split="groups", minibatches=1),
}


def bench_train(n_rollouts=3, repeats=5):
    """Trained tokens and update seconds per step on the CPU default's real rollouts (the tiny base model, compact
    Plan-Path, 16 envs, K = 4, T = 4) in each update layout of TRAIN_LAYOUTS. The same rollouts and starting
    weights for all, interleaved, medians; ratios against one row per sample in 4 strided mini-batches."""
    import copy
    import random
    import envs as E
    import tiny
    import train as T
    from grpo_mas import compute_advantages
    from policies import make_engine
    from rollout import Agents, every_role, tree_rollout
    cfg = T.configure([])  # the CPU default (preset tiny-plan; its rollouts here are plain, no refill)
    base = tiny.base_path(cfg)
    tiny.build_base(base, cfg)  # cached: the same base every default run starts from
    tok = M.load_tokenizer(base)
    agents = Agents(tok, [make_engine("torch", base, seed=0, max_len=cfg["max_model_len"])], {"tool": 0, "plan": 0},
                    cfg["max_prompt_tokens"])
    rollouts = []
    for r in range(n_rollouts):
        rng = random.Random(f"bench-{r}")
        envs = [E.train_env("plan", rng, "mas", True) for _ in range(cfg["envs_per_step"])]
        agents.seed_base = r
        samples = tree_rollout(
            envs,
            agents,
            cfg["K"],
            cfg["turns"],
            every_role(temperature=1.0, top_p=1.0, max_new_tokens=cfg["max_new_tokens"]),
            1.0,
            "greedy",
            rng,
        )
        rollouts.append(compute_advantages(samples, "at_grpo")[0])
    model0 = M.load_model(base)
    secs = {name: [] for name in TRAIN_LAYOUTS}
    toks = {name: [] for name in TRAIN_LAYOUTS}
    for _ in range(repeats):
        for name, layout in TRAIN_LAYOUTS.items():
            for samples in rollouts:
                m = copy.deepcopy(model0)
                opt = torch.optim.AdamW(m.parameters(), lr=cfg["lr"])
                t0 = time.perf_counter()
                st = T.update_policy(m, opt, samples, {**cfg, **layout}, 1, torch.device("cpu"))
                secs[name].append(time.perf_counter() - t0)
                toks[name].append(st.trained_tokens)
    base_s = statistics.median(secs["unpacked, strided, 4"])
    print(
        json.dumps(
            {
                "bench": f"update of the CPU default on {n_rollouts} real rollouts (tiny base, compact Plan-Path, "
                f"16 envs, K=4, T=4), {repeats} interleaved repeats, medians",
                "samples_per_step": statistics.median(len(s) for s in rollouts),
                "response_tokens_per_step": statistics.median(sum(len(x.response_ids) for x in s) for s in rollouts),
                "layouts": {
                    name: {
                        "trained_tokens": statistics.median(toks[name]),
                        "update_s": statistics.median(secs[name]),
                        "over_unpacked_strided_4": statistics.median(secs[name]) / base_s,
                    }
                    for name in TRAIN_LAYOUTS
                },
            }
        )
    )


def bench_refill(steps=3, repeats=2):
    """What DAPO's refill (the CPU default's --dynamic_sampling 3) generates per token it trains, for --refill batch
    and missing: `steps` steps of real rollouts of the tiny base (T.collect, its seeds, interleaved modes), each a
    repeat; per step, response tokens generated over response tokens trained (the kept groups' responses) and over
    the update's forward tokens (prompt + response per row: unpacked, one row per sample; packed, a row per sibling
    group). Then the update on each step's kept samples, packed vs unpacked, `repeats` interleaved times (as
    bench_train). Medians over steps."""
    import copy
    import batching
    import envs as E
    import grpo_mas as G
    import tiny
    import train as T
    from policies import make_engine
    from rollout import Agents
    cfg = T.configure([])  # the CPU default: preset tiny-plan, --dynamic_sampling 3
    base = tiny.base_path(cfg)
    tiny.build_base(base, cfg)  # cached: the same base every default run starts from
    tok = M.load_tokenizer(base)
    agents = Agents(tok, [make_engine("torch", base, seed=0, max_len=cfg["max_model_len"])], {"tool": 0, "plan": 0},
                    cfg["max_prompt_tokens"])
    tasks, _ = T.load_tasks(cfg)
    E.set_timeouts(cfg["tool_timeout"], cfg["test_timeout"])
    per = {m: [] for m in ("batch", "missing")}
    kept_by_step = []
    for step in range(steps):
        for mode in per:
            batch = T.collect({**cfg, "refill": mode}, step, 0, agents, tasks, cfg["envs_per_step"])
            gen = sum(len(x.response_ids) for x in batch.generated)
            kept = [x for x in batch.samples if x.response_ids]
            resp = sum(len(x.response_ids) for x in kept)
            fwd = {pack: sum(len(r.ids) for r in batching.make_rows(kept, pack)) for pack in (False, True)}
            per[mode].append(dict(rollouts=batch.rollouts, generated=len(batch.generated), kept=len(kept),
                                  gen_per_trained_resp=gen / max(1, resp), gen_per_fwd_unpacked=gen / max(1, fwd[0]),
                                  gen_per_fwd_packed=gen / max(1, fwd[1])))
            if mode == "batch":  # the default's samples train in the update timing below
                kept_by_step.append(G.advantages(kept, G.Scheme.of(cfg), step)[0])
    model0 = M.load_model(base)
    secs = {False: [], True: []}
    for _ in range(repeats):  # interleaved, so load changes hit both alike
        for samples in kept_by_step:
            for pack in (False, True):
                m = copy.deepcopy(model0)
                opt = torch.optim.AdamW(m.parameters(), lr=cfg["lr"])
                t0 = time.perf_counter()
                T.update_policy(m, opt, samples, {**cfg, "pack": pack, "split": "groups" if pack else "strided"}, 1,
                                torch.device("cpu"))
                secs[pack].append(time.perf_counter() - t0)
    out = {"bench": f"DAPO's refill on the CPU default (tiny base, compact Plan-Path, 16 envs, K=4, T=4, "
                    f"--dynamic_sampling 3): {steps} steps, medians"}
    for mode, rows in per.items():
        for k in rows[0]:
            out[f"{mode}_{k}"] = statistics.median(r[k] for r in rows)
    out["update_s_unpacked"] = statistics.median(secs[False])
    out["update_s_packed"] = statistics.median(secs[True])
    out["packed_over_unpacked"] = out["update_s_packed"] / out["update_s_unpacked"]
    print(json.dumps(out))


def bench_gpu(parts="parity,step,update"):
    """CUDA only (`python bench.py gpu [parity,step,update,update_fast]`). (1) parity: bf16 forward of our Qwen3 and of
    transformers, each against transformers in fp32, on a 4-layer 1.7B-shaped random model, and a control with a planted
    bug (RoPE base 1e4 instead of 1e6) to show the metric separates; (2) step: fwd+bwd+AdamW throughput and MFU of the
    full Qwen3-1.7B shape at sequence length 4096 through FSDP2 (bf16 param / fp32 reduce, 1-rank NCCL group), eager and
    per-block compiled, with and without activation checkpointing, each with its peak memory next to memory.py's
    estimate; (3) update: train.update_policy itself (pi_old forward, PPO micro-batches, clip, AdamW) on a paper-shaped
    batch of rollout samples, one row per sample vs packed sibling groups, against a bare step of the same model;
    (4) update_fast: the same for per-block compiled layouts with selective or full checkpointing."""
    if not torch.cuda.is_available():
        raise SystemExit(f"bench.py gpu needs a CUDA GPU: torch {torch.__version__} sees none (the CPU benchmarks: "
                         "model, sampler, sandbox, env, train; the GPU check: python gpu_check.py)")
    import common as C
    C.setup_dist()  # a 1-rank NCCL group, as a lone-GPU training run makes
    peak = float(os.environ.get("PEAK_TFLOPS", "989")) * 1e12  # H100 SXM dense bf16
    parts = parts.split(",")
    if "parity" in parts:
        gpu_parity()
    if "step" in parts:
        gpu_step(peak)
    for part in ("update", "update_fast"):
        if part in parts:
            gpu_update(peak, UPDATE_LAYOUTS[part])


def gpu_parity():
    from transformers import Qwen3ForCausalLM
    cfg = M.Qwen3Config(**{**M.SIZES["1.7B"], "num_hidden_layers": 4})
    torch.manual_seed(0)
    m = M.Qwen3(cfg)
    m.init_weights(0.02)
    d = tempfile.mkdtemp()
    M.save_model(m, d)
    x = torch.randint(0, cfg.vocab_size, (2, 512), device="cuda")
    with torch.no_grad():
        ref = Qwen3ForCausalLM.from_pretrained(d, dtype=torch.float32).cuda().eval()
        r = ref(x).logits
        del ref
        hf = Qwen3ForCausalLM.from_pretrained(d, dtype=torch.bfloat16).cuda().eval()
        outs = {"transformers bf16": hf(x).logits.float()}
        del hf
        ours = m.to(torch.bfloat16).cuda().eval()
        outs["ours bf16"] = ours(x).float()
        ours.model.rotary.theta = 1e4  # the planted bug
        ours.model.rotary.reset()
        outs["ours bf16, RoPE base 1e4 (planted bug)"] = ours(x).float()
    for name, a in outs.items():
        print(json.dumps({"bench": f"bf16 CUDA parity vs transformers fp32, 4-layer 1.7B-shaped, 2x512: {name}",
                          "rel_err": ((a - r).norm() / r.norm()).item(), "max_abs_dlogit": (a - r).abs().max().item(),
                          "argmax_agree": (a.argmax(-1) == r.argmax(-1)).float().mean().item()}), flush=True)
    del ours
    torch.cuda.empty_cache()


def _lm_step(m, opt, x):
    """One bare training step on a [B, T] batch: next-token log-likelihood, backward, AdamW (GPU benchmarks)."""
    (-m(x[:, :-1], targets=x[:, 1:]).mean()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()


# (compiled, --grad_checkpoint) in the order a lent GPU's time limit should cut them: the reference
# (eager full), the candidates for the defaults, then the no-checkpointing ceilings
STEP_VARIANTS = ((False, "full"), (True, "selective"), (False, "selective"), (True, "full"), (True, "off"),
                 (False, "off"))


def gpu_step(peak, variants=STEP_VARIANTS):
    """Each (compiled, --grad_checkpoint mode) variant's numbers, printed as it finishes and returned."""
    import memory
    cfg = M.Qwen3Config(**M.SIZES["1.7B"])
    Tn, B = 4096, 2
    x = torch.randint(0, cfg.vocab_size, (B, Tn), device="cuda")
    results = []
    for compiled, ckpt in variants:
        torch.manual_seed(0)
        m = M.Qwen3(cfg)
        m.init_weights(0.02)
        M.shard(m, checkpoint=ckpt, param_dtype=torch.bfloat16, compile=compiled)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-6)
        step = functools.partial(_lm_step, m, opt, x)
        t0 = time.perf_counter()
        step()
        first = time.perf_counter() - t0
        torch.cuda.reset_peak_memory_stats()
        s = timeit(step, 5)
        mem = torch.cuda.max_memory_allocated() / 2 ** 30
        plan = memory.plan(
            cfg,
            world=1,
            gpu_gb=80,
            n_policies=1,
            micro_batch_tokens=B * Tn,
            grad_checkpoint=ckpt,
            engine="torch",
            rows=0,
        )
        # allocator only, no engine
        est = plan["totals"]["train"] - memory.context_bytes(1) / memory.GiB - plan["rows"][1][1]["train"]
        tok_s = B * (Tn - 1) / s
        res = {"bench": f"Qwen3-1.7B shape, fwd+bwd+AdamW, FSDP2 bf16 policy (1 rank), B={B} T={Tn}, "
                        f"checkpointing {ckpt}, compiled {compiled}",
               "step_s": s, "first_step_s": first, "tokens_per_s": tok_s,
               "mfu": flops_per_token(cfg, Tn) * tok_s / peak, "peak_alloc_gib": mem, "planner_train_gib": est,
               "gpu": torch.cuda.get_device_name()}
        print(json.dumps(res), flush=True)
        results.append(res)
        del m, opt
        torch.cuda.empty_cache()
    return results


def gpu_update_config(pack=False):
    """train.update_policy's configuration for the update benchmark: train.py's own flags (the paper
    recipe; it failed with a KeyError when it was written by hand and train.py read a new flag), with two
    mini-batches and the layout asked for."""
    import train as T
    return {**T.FLAGS, "mini_batch_rows": 0, "minibatches": 2, "micro_batch_tokens": 16384, "tis_cap": 2.0,
            "pack": pack, "split": "groups" if pack else "strided"}


# (pack, compiled, --grad_checkpoint) of the update benchmark's layouts: "update" the ones measured
# on the H100 (2026-11-22), "update_fast" the candidates for the real models' defaults (issue 60)
UPDATE_LAYOUTS = {"update": ((False, False, "full"), (True, False, "full")),
                  "update_fast": ((True, True, "selective"), (True, True, "full"), (False, True, "selective"))}


def gpu_update(peak, layouts=UPDATE_LAYOUTS["update"], groups=8, K=4, repeats=3, profile=True):
    """`groups` sibling groups of K samples (one prompt each, 512-1536 tokens; responses 128-2048 tokens), the real
    defaults (2 mini-batches, 16384-token micro-batches, TIS cap 2), per layout (pack, compiled, checkpointing) on a
    model of its own, against a bare step of that model. Tokens/s counts every distinct token once (prompt +
    responses), so packed and unpacked rows do the same useful work."""
    import random
    from rollout import Sample
    cfg = M.Qwen3Config(**M.SIZES["1.7B"])
    rng = random.Random(0)
    samples = []
    for g in range(groups):
        prompt = [rng.randrange(151643) for _ in range(rng.randint(512, 1536))]
        for k in range(K):
            n = rng.randint(128, 2048)
            samples.append(Sample(0, g, "plan", 0, 0, prompt, [rng.randrange(151643) for _ in range(n)],
                                  [-rng.random() * 3 for _ in range(n)], 0.0, adv=rng.choice([-1.0, 1.0])))
    distinct = sum(len(s.response_ids) for s in samples) + sum(len(samples[g * K].prompt_ids) for g in range(groups))
    x = torch.randint(0, cfg.vocab_size, (2, 4096), device="cuda")
    for pack, compiled, ckpt in layouts:
        name = f"pack {pack}, compiled {compiled}, checkpointing {ckpt}"
        torch.manual_seed(0)
        m = M.Qwen3(cfg)
        m.init_weights(0.02)
        M.shard(m, checkpoint=ckpt, param_dtype=torch.bfloat16, compile=compiled)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-6)
        step = functools.partial(_lm_step, m, opt, x)  # the bare reference on the same model
        step()
        bare = 2 * 4095 / timeit(step, 5)
        print(json.dumps({"bench": f"bare fwd+bwd+AdamW, 2 x 4096, {name}", "tokens_per_s": bare}), flush=True)
        upd = functools.partial(_gpu_update_once, m, opt, samples, gpu_update_config(pack))
        t0 = time.perf_counter()
        st = upd()  # warm-up (the block-mask, flex and per-layer compiles)
        print(json.dumps({"bench": f"update_policy warm-up, {name}", "first_s": time.perf_counter() - t0}), flush=True)
        torch.cuda.reset_peak_memory_stats()
        s = timeit(upd, repeats)
        res = {"bench": f"train.update_policy, Qwen3-1.7B shape, {len(samples)} samples ({groups} groups x K={K}), "
                        f"{name}",
               "update_s": s, "distinct_tokens": distinct, "trained_tokens": st.trained_tokens,
               "tokens_per_s": distinct / s, "mfu": flops_per_token(cfg, 2048) * distinct / s / peak,
               "over_bare_step": distinct / s / bare, "peak_alloc_gib": torch.cuda.max_memory_allocated() / 2 ** 30}
        if profile:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                t0 = time.perf_counter()
                upd()
                wall = time.perf_counter() - t0
            busy = sum(e.self_device_time_total for e in prof.key_averages()) / 1e6  # kernels only
            res["gpu_busy_fraction"] = busy / wall
        print(json.dumps(res), flush=True)
        if profile:
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=6), flush=True)
        del m, opt, upd
        torch.cuda.empty_cache()


def _gpu_update_once(m, opt, samples, cfg):
    import common as C
    import train as T
    st = T.update_policy(m, opt, samples, cfg, 1, C.DEVICE)
    torch.cuda.synchronize()
    return st


# -----------------------------------------------------------------------------
# sharing the machine: each setting in a fresh process (OpenMP reads its environment when torch loads)

SHARE_SETTINGS = {  # name: (environment, torch threads). libgomp spins GOMP_SPINCOUNT times (300,000 by default,
    # ~ms) after each parallel region before it sleeps; OMP_WAIT_POLICY=PASSIVE sleeps at once
    "spin 300k, 2 threads (before)": ({"GOMP_SPINCOUNT": "300000"}, 2),
    "passive, 2 threads": ({"OMP_WAIT_POLICY": "PASSIVE"}, 2),
    "spin 10k, 2 threads": ({"GOMP_SPINCOUNT": "10000"}, 2),
    "spin 10k, 1 thread": ({"GOMP_SPINCOUNT": "10000"}, 1),
    "passive, 1 thread": ({"OMP_WAIT_POLICY": "PASSIVE"}, 1),
}
BUSY = "while True: pass"  # one busy process: a neighbour that computes and never waits


def run_child(args, prefix, env=None, cgroup=None):
    """This script in a fresh process (`python bench.py ARGS`; in `cgroup`, if given): the JSON of its one line
    that starts with `prefix`, or a stop naming the child and its stderr."""
    r = subprocess.run(in_cgroup(cgroup, [sys.executable, __file__, *args]), env=env, capture_output=True, text=True,
                       timeout=3600)
    line = [x for x in r.stdout.splitlines() if x.startswith(prefix)]
    if not line:
        raise SystemExit(f"bench.py {' '.join(args)} failed: {r.stderr[-2000:]}")
    return json.loads(line[0][len(prefix):])


def default_steps(engine, repeats):
    """The CPU default's steps on `engine` from its cached base (the first, which warms the engine's shapes, not
    counted): each step's collect (generation, the env, the refill), update and weight-sync seconds, and what
    they handled: samples and response tokens generated, distinct prompts' tokens (the K siblings of a tree node
    share one prompt, prefilled once by both engines), tokens trained."""
    import grpo_mas as G
    import train as T
    from policies import make_engine
    from rollout import Agents
    cfg = T.configure([])
    base = tiny.base_path(cfg)  # built by the parent, alone
    tok = M.load_tokenizer(base)
    eng = make_engine(engine, base, seed=0, max_len=cfg["max_model_len"])
    agents = Agents(tok, [eng], {"tool": 0, "plan": 0}, cfg["max_prompt_tokens"])
    tasks, _ = T.load_tasks(cfg)
    m = M.load_model(base)
    opt = torch.optim.AdamW(m.parameters(), lr=cfg["lr"])
    keys = ("collect", "update", "sync", "step", "rollouts", "generated", "response_tokens", "prompt_tokens",
            "trained_tokens")
    parts = {k: [] for k in keys}
    for step in range(repeats + 1):
        t0 = time.perf_counter()
        batch = T.collect(cfg, step, 0, agents, tasks, cfg["envs_per_step"])
        t1 = time.perf_counter()
        samples = G.advantages([x for x in batch.samples if x.response_ids], G.Scheme.of(cfg), step)[0]
        stats = T.update_policy(m, opt, samples, cfg, 1, torch.device("cpu"))
        t2 = time.perf_counter()
        eng.sync(m)
        t3 = time.perf_counter()
        if step:
            gen = batch.generated
            prompts = {tuple(x.prompt_ids) for x in gen}
            for k, v in zip(keys, (t1 - t0, t2 - t1, t3 - t2, t3 - t0, batch.rollouts, len(gen),
                                   sum(len(x.response_ids) for x in gen), sum(map(len, prompts)),
                                   stats.trained_tokens)):
                parts[k].append(v)
    return parts


def step_child(engine, threads_n, repeats):
    """In a child process: default_steps' lists on `engine` (printed as one JSON line)."""
    torch.set_num_threads(threads_n)
    print("STEP " + json.dumps(default_steps(engine, repeats)), flush=True)


def matmul_gflops(n=1024, repeats=20):
    """This machine's float32 matmul rate on torch's threads: the median of n x n x n products."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    return 2 * n ** 3 / timeit(lambda: a @ b, repeats) / 1e9


def bench_step(engines=("vllm", "torch"), repeats=8):
    """Where a CPU default step's seconds go, on each engine (each in a fresh process, the machine's threads, the
    same cached base and step seeds): medians over the steps of the parts and their rates, the update's FLOP/s and
    the sampler's model FLOP/s (2 x params x each distinct prompt's tokens once and every response token) against
    this machine's float32 matmul peak measured here."""
    import train as T
    cfg = T.configure([])
    base = tiny.base_path(cfg)
    tiny.build_base(base, cfg)  # alone, once (cached)
    mcfg = M.load_model(base).config
    peak = matmul_gflops()
    threads_n = torch.get_num_threads()
    rows = {}
    for engine in engines:
        p = run_child(["step_child", engine, str(threads_n), str(repeats)], "STEP ")
        med = {k: statistics.median(v) for k, v in p.items()}
        per_token = flops_per_token(mcfg, 64)  # the default's rows are short: attention is a rounding error
        gen_flops = [per_token / 3 * (a + b) / c for a, b, c in  # a forward: a third of a training step
                     zip(p["prompt_tokens"], p["response_tokens"], p["collect"])]
        upd_flops = [per_token * a / b for a, b in zip(p["trained_tokens"], p["update"])]
        rows[engine] = dict(**med, samples_per_s=statistics.median(a / b for a, b in zip(p["generated"], p["collect"])),
                            gen_gflops=statistics.median(gen_flops) / 1e9,
                            update_gflops=statistics.median(upd_flops) / 1e9)
        rows[engine]["gen_of_peak"] = rows[engine]["gen_gflops"] / peak
        rows[engine]["update_of_peak"] = rows[engine]["update_gflops"] / peak
        print(json.dumps({engine: rows[engine]}), flush=True)
    ref = rows[engines[0]]
    for engine in engines[1:]:
        rows[engine]["step_over_" + engines[0]] = rows[engine]["step"] / ref["step"]
        rows[engine]["samples_per_s_over_" + engines[0]] = rows[engine]["samples_per_s"] / ref["samples_per_s"]
    print(json.dumps({"bench": f"the CPU default's step by parts, {repeats} steps per engine after one warm-up step, "
                      f"{threads_n} threads, medians; float32 matmul peak {peak:.1f} GFLOP/s (1024^3)",
                      "rows": rows}))


def bench_prefix(repeats=5):
    """The torch sampler's reuse of the last call's prefill (engines.Prefilled; the plan agent's prompt is the tool
    agent's board and one line): the CPU default's in-run evaluation (200 held-out puzzles, greedy, the cached
    base: every episode its 4 turns) and a step's collect (generation, the env, the refill; the base's weights),
    each with the reuse and without it (Prefilled.KEEP_BYTES = 0: nothing kept), interleaved, medians."""
    import engines
    import train as T
    from policies import make_engine
    from rollout import Agents
    cfg = T.configure([])
    base = tiny.base_path(cfg)
    tiny.build_base(base, cfg)  # cached
    tok = M.load_tokenizer(base)
    tasks, test_envs = T.load_tasks(cfg)
    keep = engines.Prefilled.KEEP_BYTES
    secs = {(part, on): [] for part in ("eval", "collect") for on in (True, False)}
    for r in range(repeats + 1):  # the first, which warms the shapes, not counted
        for on in (True, False):
            engines.Prefilled.KEEP_BYTES = keep if on else 0
            agents = Agents(tok, [make_engine("torch", base, seed=0, max_len=cfg["max_model_len"])],
                            {"tool": 0, "plan": 0}, cfg["max_prompt_tokens"])
            t0 = time.perf_counter()
            acc = T.held_out(test_envs, agents, cfg, 0, 0, 1, False)["accuracy"]
            t1 = time.perf_counter()
            T.collect(cfg, r, 0, agents, tasks, cfg["envs_per_step"])
            t2 = time.perf_counter()
            if r:
                secs[("eval", on)].append(t1 - t0)
                secs[("collect", on)].append(t2 - t1)
    engines.Prefilled.KEEP_BYTES = keep
    med = {f"{part}_s_{'reuse' if on else 'none'}": statistics.median(v) for (part, on), v in secs.items()}
    print(json.dumps({"bench": f"the torch sampler's prefix reuse, the CPU default's base, {repeats} interleaved "
                      f"repeats, {torch.get_num_threads()} threads, medians", "held_out": acc, **med,
                      "eval_reuse_over_none": med["eval_s_reuse"] / med["eval_s_none"],
                      "collect_reuse_over_none": med["collect_s_reuse"] / med["collect_s_none"]}))


def share_child(kind, threads_n, repeats):
    """In a child process: the median seconds of `kind`'s parts (printed as one JSON line). warmup: the tiny base's
    format warm-up step (32 compact Plan-Path pairs). step: the CPU default's step on its engine (torch): collect
    (generation, the env, the refill), the update, the weight sync."""
    import random
    import train as T
    from rollout import Agents
    torch.set_num_threads(threads_n)
    cfg = T.configure([])
    base = tiny.base_path(cfg)  # built by the parent, alone
    tok = M.load_tokenizer(base)
    end = [tok.convert_tokens_to_ids("<|im_end|>")]
    parts = {}
    if kind == "warmup":
        m = M.load_model(base)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.0)
        rng = random.Random(0)
        batches = [tiny.warmup_batch("plan", tok, Agents(tok, [], {}), rng, 4, end) for _ in range(repeats + 1)]
        tiny.sft_step(m, opt, batches[0])  # the first step allocates
        parts["warmup_step"] = [timeit(lambda b=b: tiny.sft_step(m, opt, b), 1) for b in batches[1:]]
    else:
        parts = {k: v for k, v in default_steps(cfg["engine"], repeats).items()
                 if k in ("collect", "update", "sync", "step")}
    print("SHARE " + json.dumps({k: statistics.median(v) for k, v in parts.items()}), flush=True)


SHARE_PLAN = {"warmup": ((0, 2, 4), 8), "step": ((0, 2, 4), 4)}  # kind: (busy processes beside it, timed repeats)


def bench_share(plan=SHARE_PLAN):
    """What a busy machine costs each thread setting: the warm-up step and the default's step, alone and beside
    busy processes (on 2 cores, 4 = two per core), every setting in its own process. Medians; each loaded time
    over the same setting's time alone, and each setting over the first (the settings before) at that load."""
    import train as T
    cfg = T.configure([])
    tiny.build_base(tiny.base_path(cfg), cfg)  # alone, once (cached)
    rows = []
    for kind, (loads, repeats) in plan.items():
        for load in loads:
            for name, (env, n) in SHARE_SETTINGS.items():
                child_env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
                busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(load)]
                try:
                    parts = run_child(["share_child", kind, str(n), str(repeats)], "SHARE ", {**child_env, **env})
                finally:
                    for b in busy:
                        b.kill()
                rows.append(dict(kind=kind, load=load, setting=name, **parts))
                print(json.dumps(rows[-1]), flush=True)
    main = {"warmup": "warmup_step", "step": "step"}
    for row in rows:
        alone = next(r for r in rows if r["kind"] == row["kind"] and r["setting"] == row["setting"] and not r["load"])
        before = next(r for r in rows if r["kind"] == row["kind"] and r["load"] == row["load"]
                      and r["setting"] == next(iter(SHARE_SETTINGS)))
        key = main[row["kind"]]
        row["over_alone"] = row[key] / alone[key]
        row["over_before"] = row[key] / before[key]
    print(json.dumps({"bench": "sharing the machine: busy processes beside the warm-up step and the default's step, "
                      f"{os.cpu_count()} cores, medians", "rows": rows}))


RANKS_LOADS, RANKS_STEPS = (0, 2, 4), 12  # busy processes beside each layout; steps of each train.py run


def bench_ranks(loads=RANKS_LOADS, steps=RANKS_STEPS):
    """The CPU default as train.py runs it, two ways on the same cores: one process of torch's two threads
    (`python train.py`) and two ranks of one thread each (`torchrun --nproc_per_node=2 train.py`), alone and
    beside busy processes. Each busy process starts a session of its own, as torchrun starts each rank: where
    the kernel's autogroup is on it weighs sessions alike, so the busy ones count as the ranks do. Medians over
    each run's steps after the second: a step's seconds, generation's per rollout and the update's per thousand
    tokens trained (two ranks draw other samples and refill other steps, so a step's work differs); each over
    its own layout alone and over the first layout at that load."""
    import train as T
    cfg = T.configure([])
    tiny.build_base(tiny.base_path(cfg), cfg)  # alone, once (cached)
    here = os.path.dirname(os.path.abspath(__file__))
    args = ["train.py", "--steps", str(steps), "--stop_step", str(steps), "--eval_every", "0", "--ckpt_every", "0",
            "--time_limit_min", "0"]
    layouts = {"1 process, 2 threads": [sys.executable, *args],
               "2 ranks, 1 thread each": [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                                          "--master_port=29531", *args]}
    rows = []
    for load in loads:
        for name, argv in layouts.items():
            out = tempfile.mkdtemp()
            busy = [subprocess.Popen([sys.executable, "-c", BUSY], start_new_session=True) for _ in range(load)]
            try:
                subprocess.run([*argv, "--out_dir", os.path.join(out, "run")], cwd=here, check=True,
                               capture_output=True, timeout=3600)
            finally:
                for b in busy:
                    b.kill()
            recs = [json.loads(x) for x in open(os.path.join(out, "run", "metrics.jsonl"))][2:]
            rows.append(dict(layout=name, busy=load, step=statistics.median(r["t_step"] for r in recs),
                             gen_per_rollout=statistics.median(r["t_gen"] / r["rollouts"] for r in recs),
                             train_per_ktoken=statistics.median(1e3 * r["t_train"] / r["trained_tokens"]
                                                                for r in recs if r["trained_tokens"]),
                             rollouts=statistics.mean(r["rollouts"] for r in recs)))
            print(json.dumps(rows[-1]), flush=True)
    for row in rows:
        alone = next(r for r in rows if r["layout"] == row["layout"] and not r["busy"])
        first = next(r for r in rows if r["busy"] == row["busy"])
        for part in ("step", "gen_per_rollout", "train_per_ktoken"):
            row[part + "_over_alone"] = row[part] / alone[part]
            row[part + "_over_first_layout"] = row[part] / first[part]
    print(json.dumps({"bench": f"the CPU default, one process vs two ranks, {steps} steps each, "
                      f"{os.cpu_count()} cores, medians", "rows": rows}))


def cpu_cgroup(name, cores):
    """A cgroup of the CPU controller allowing `cores` cores' time (period 100 ms), made here: cgroup v1's
    cpu.cfs_quota_us, else v2's cpu.max (as docker --cpus sets them). OSError where this user cannot (not root, no
    writable /sys/fs/cgroup); the caller removes it (os.rmdir) once its processes have ended."""
    v1 = "/sys/fs/cgroup/cpu"
    quota = int(cores * 100000)
    if os.path.exists(f"{v1}/cpu.cfs_quota_us"):
        path, file, text = f"{v1}/{name}", "cpu.cfs_quota_us", str(quota)
    else:
        path, file, text = f"/sys/fs/cgroup/{name}", "cpu.max", f"{quota} 100000"
    os.makedirs(path, exist_ok=True)
    try:  # (v2: only where the parent's cgroup.subtree_control has +cpu)
        with open(os.path.join(path, file), "w") as f:
            f.write(text)
    except OSError:
        os.rmdir(path)
        raise
    return path


def in_cgroup(cgroup, argv):
    """`argv` as a command that first moves itself into `cgroup` (none: as it is)."""
    if cgroup is None:
        return argv
    return ["sh", "-c", f'echo $$ > "{cgroup}/cgroup.procs" && exec "$0" "$@"', *argv]


QUOTAS = (1.0, 1.2, 1.5)  # cores' time a container on this 2-core machine may use


def bench_quota(quotas=QUOTAS):
    """A container's CPU quota (docker --cpus, a Kubernetes limit): the warm-up step and the default's step in a
    cgroup allowing q cores' time, on a thread per physical core (torch's own count: before) and on
    threads.usable_cores() there (after). Medians; after over before."""
    import train as T
    cfg = T.configure([])
    tiny.build_base(tiny.base_path(cfg), cfg)  # alone, once (cached)
    rows = []
    for q in quotas:
        cgroup = cpu_cgroup(f"bench-quota-{os.getpid()}", q)
        try:
            ask = [sys.executable, "-c", "import threads; print(threads.usable_cores())"]
            usable = int(subprocess.run(in_cgroup(cgroup, ask), cwd=os.path.dirname(os.path.abspath(__file__)),
                                        capture_output=True, text=True, check=True).stdout)
            for kind, (_, repeats) in SHARE_PLAN.items():
                row = {"quota": q, "kind": kind}
                for setting, n in (("before", threads.torch_threads()), ("after", usable)):
                    parts = run_child(["share_child", kind, str(n), str(repeats)], "SHARE ", cgroup=cgroup)
                    row[setting] = {"threads": n, **parts}
                key = "warmup_step" if kind == "warmup" else "step"
                row["after_over_before"] = row["after"][key] / row["before"][key]
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            os.rmdir(cgroup)
    print(json.dumps({"bench": f"a CPU quota: warm-up and default steps in a cgroup, {threads.visible_cores()} "
                      "visible cores, medians", "rows": rows}))


if __name__ == "__main__":
    torch.set_num_threads(threads.usable_cores())
    which = sys.argv[1] if len(sys.argv) > 1 else "model"
    if which == "env_one":
        bench_env_one(sys.argv[2])
    elif which == "share_child":
        share_child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    elif which == "step_child":
        step_child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    elif which == "gpu" and len(sys.argv) > 2:
        bench_gpu(sys.argv[2])
    else:
        benches = {"model": bench_model, "sampler": bench_sampler, "sandbox": bench_sandbox, "env": bench_env,
                   "train": bench_train, "refill": bench_refill, "share": bench_share, "quota": bench_quota,
                   "step": bench_step, "prefix": bench_prefix, "ranks": bench_ranks, "gpu": bench_gpu}
        if which in ("-h", "--help"):
            print(__doc__.strip())
        elif which not in benches:
            raise SystemExit(f"no benchmark {which!r}: one of {', '.join(benches)}")
        else:
            benches[which]()
