"""
The GPU check: the first thing to run on a GPU, sized for a few minutes of it (5.1 minutes on one
H100, most of it model loads and checkpoint writes). Each part prints one verdict line, ok / FAILED /
skipped (and why), and the numbers go to a json file.

    python gpu_check.py                          # every part; numbers in gpu_check.json
    python gpu_check.py --parts step,policies    # some parts
    python gpu_check.py --out /tmp/check.json

Parts, in order:
  tests     the CUDA tests of test_all.py (pytest -m cuda; the vLLM ones skip without vLLM)
  step      one training step of a Qwen3-0.6B-shaped model (random weights, --engine torch) with its
            checkpoint, then a resumed second step; a 1.7B-shaped step; each phase's peak GPU memory
            against the memory plan's (memory.py); a gradient norm above 0 (an entropy bonus: see STEP)
  policies  a --policies per_role step and a --policies lora step (0.6B shape), every policy's
            gradient norm above 0
  mfu       fwd+bwd+AdamW of the 1.7B shape at 4096 tokens through FSDP2: tokens/s and MFU
            (PEAK_TFLOPS, default 989: an H100 SXM's dense bf16)
  vllm      a training step with --engine vllm (0.6B shape): sleep, update, sync, sample; skipped
            without vLLM

The model folders are random weights at the real shapes (tiny.build_tiny, with the tiny byte tokenizer):
what runs is the code path and its memory, not a model that knows anything.
"""
import json
import os
import subprocess
import sys
import tempfile
import time

import threads  # noqa: F401  (before torch: OpenMP's settings)
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
PARTS = ("tests", "step", "policies", "mfu", "vllm")
# small, quick steps: a turn, 4 envs x K 2, short answers, the paper preset otherwise. Random weights
# answer nothing parseable, so every reward is the format penalty, every advantage 0 and so every
# gradient (the first GPU check's steps all had grad norm 0): the entropy bonus gives each step a
# nonzero gradient through the whole model, so a backward that computes nothing cannot pass.
STEP = ["--task", "plan", "--engine", "torch", "--turns", "1", "--envs_per_step", "4", "--K", "2",
        "--max_new_tokens", "32", "--max_prompt_tokens", "1536", "--max_model_len", "1600",
        "--eval_every", "0", "--time_limit_min", "0", "--entropy_coef", "0.01"]


def verdict(results, part, ok, line, **numbers):
    status = "ok" if ok is True else ("skipped" if ok is None else "FAILED")
    print(f"{part:<9} {status:<8} {line}", flush=True)
    results[part] = {"status": status, "line": line, **numbers}


def run(args, timeout):
    """A subprocess in the project's folder; (exit status, its output's last lines)."""
    r = subprocess.run([sys.executable, *args], cwd=HERE, capture_output=True, text=True, timeout=timeout)
    return r.returncode, (r.stdout + r.stderr).strip().splitlines()[-20:]


def model_folder(work, size):
    import tiny
    path = os.path.join(work, f"random-{size}")
    if not os.path.exists(path):
        tiny.build_tiny(path, seed=0, size=size, std=0.02, dtype=torch.bfloat16)
    return path


def last_record(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return json.loads(f.readlines()[-1])


def grad_norms(rec):
    """Every policy's gradient norm in a step record, and whether each is a number above 0."""
    norms = [rec[k] for k in sorted(rec) if k.startswith("grad_norm_p")]
    return norms, bool(norms) and all(0 < n < float("inf") for n in norms)


def memory_against_plan(model_dir, extra):
    """The plan's per-phase GiB for this configuration on this GPU (memory.plan_for)."""
    import memory
    import train as T
    cfg = T.configure(["--model", model_dir, *STEP, *extra])
    gpu_gb = torch.cuda.get_device_properties(0).total_memory / 2 ** 30
    return memory.plan_for(cfg, 1, gpu_gb)["totals"]


def check_tests(results, work):
    code, out = run(["-m", "pytest", "-q", "-m", "cuda", "test_all.py"], timeout=300)
    summary = next((line for line in reversed(out) if "passed" in line or "failed" in line), out[-1:])
    verdict(results, "tests", code == 0, f"pytest -m cuda: {summary}", output=out)


def check_step(results, work):
    for size, resume in (("0.6B", True), ("1.7B", False)):
        model_dir = model_folder(work, size)
        out = os.path.join(work, f"step-{size}")
        t0 = time.time()
        ckpt = "1" if resume else "0"  # a 1.7B checkpoint is ~27 GB of fp32 weights and AdamW: not here
        code, log = run([*["train.py", "--model", model_dir], *STEP, "--steps", "2", "--stop_step", "1",
                         "--ckpt_every", ckpt, "--out_dir", out], timeout=400)
        if code != 0:
            verdict(results, f"step {size}", False, "the first step failed: " + " | ".join(log[-3:]), output=log)
            continue
        first = last_record(out)
        plan = memory_against_plan(model_dir, [])
        peaks = {k: first[f"mem_{k}"] for k in ("rollout", "train", "sync") if f"mem_{k}" in first}
        norms, moved = grad_norms(first)
        within = all(peaks[k] <= plan[k] for k in peaks)
        numbers = dict(step_s=time.time() - t0, peak_gib=peaks, plan_gib={k: plan[k] for k in peaks}, record=first)
        if resume:
            code, log = run([*["train.py", "--model", model_dir], *STEP, "--steps", "2", "--resume", "true",
                             "--ckpt_every", "0", "--out_dir", out], timeout=400)
            if code != 0:
                verdict(results, f"step {size}", False, "the resumed step failed: " + " | ".join(log[-3:]),
                        output=log, **numbers)
                continue
            numbers["resumed"] = last_record(out)
        line = (f"{size}: step {numbers['step_s']:.0f}s; grad norm {norms[0]:.3g}; peak GiB " + ", ".join(
            f"{k} {peaks[k]:.1f} (plan {plan[k]:.1f})" for k in peaks) + ("; resumed step 2" if resume else ""))
        problems = ("" if within else ": above the plan") + ("" if moved else ": no gradient")
        verdict(results, f"step {size}", within and moved, line + problems, **numbers)


def check_policies(results, work):
    model_dir = model_folder(work, "0.6B")
    for design in ("per_role", "lora"):
        out = os.path.join(work, f"policies-{design}")
        code, log = run([*["train.py", "--model", model_dir], *STEP, "--steps", "1", "--ckpt_every", "0",
                         "--policies", design, "--out_dir", out], timeout=400)
        if code != 0:
            verdict(results, design, False, " | ".join(log[-3:]), output=log)
            continue
        rec = last_record(out)
        norms, moved = grad_norms(rec)  # 0 or NaN: the failures a step can hide
        verdict(results, design, moved,
                f"--policies {design}: {len(norms)} policies, grad norms {', '.join(f'{n:.3g}' for n in norms)}",
                record=rec)


def check_mfu(results, work):
    import bench
    import common as C
    C.setup_dist()
    peak = float(os.environ.get("PEAK_TFLOPS", "989")) * 1e12
    import train as T
    # the real models' defaults: --compile, --grad_checkpoint
    compiled, ckpt = T.FLAGS["compile"], T.FLAGS["grad_checkpoint"]
    res = bench.gpu_step(peak, variants=((compiled, ckpt),))[0]
    verdict(results, "mfu", True, f"1.7B shape, 2 x 4096 tokens, compiled {compiled}, checkpointing {ckpt}: "
            f"{res['tokens_per_s']:.0f} "
            f"tokens/s, MFU {res['mfu']:.2f}, peak {res['peak_alloc_gib']:.1f} GiB (plan "
            f"{res['planner_train_gib']:.1f})", **res)


def check_vllm(results, work):
    try:
        import vllm  # noqa: F401
    except ImportError:
        verdict(results, "vllm", None, "skipped: no vLLM here (pip install vllm==0.32.0, as setup.sh does)")
        return
    model_dir = model_folder(work, "0.6B")
    out = os.path.join(work, "vllm")
    args = [a if a != "torch" else "vllm" for a in STEP]
    code, log = run(["train.py", "--model", model_dir, *args, "--steps", "2", "--ckpt_every", "0",
                     "--out_dir", out], timeout=400)
    if code != 0:
        verdict(results, "vllm", False, " | ".join(log[-3:]), output=log)
        return
    rec = last_record(out)
    verdict(results, "vllm", True, f"2 steps with vLLM: |dlogp| {rec['dlogp_p0']:.1e} (bf16 engine vs trainer, "
            f"~1e-2 expected), sync {rec['t_sync']:.1f}s", record=rec)


def main(argv):
    parts, out = list(PARTS), "gpu_check.json"
    while argv:
        flag = argv.pop(0)
        if flag == "--parts" and argv:
            parts = argv.pop(0).split(",")
        elif flag == "--out" and argv:
            out = argv.pop(0)
        elif flag in ("-h", "--help"):
            print(__doc__.strip())
            return 0
        else:
            raise SystemExit(f"unknown argument {flag!r}: python gpu_check.py [--parts {','.join(PARTS)}] [--out FILE]")
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise SystemExit(f"--parts: no part {unknown[0]!r}; the parts are {', '.join(PARTS)}")
    if not torch.cuda.is_available():
        raise SystemExit(f"gpu_check.py needs a CUDA GPU: torch {torch.__version__} sees none (on a CPU machine "
                         "the tests are `python -m pytest -q test_all.py`)")
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "started": time.time()}
    print(f"GPU check on {results['gpu']}, torch {torch.__version__}", flush=True)
    checks = {"tests": check_tests, "step": check_step, "policies": check_policies, "mfu": check_mfu,
              "vllm": check_vllm}
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as work:
        for part in parts:
            try:
                checks[part](results, work)
            except Exception as e:  # one part's crash is its verdict, not the end of the check
                verdict(results, part, False, f"{type(e).__name__}: {e}")
            with open(out, "w") as f:
                json.dump(results, f, indent=2, default=str)
    results["seconds"] = time.time() - results["started"]
    with open(out, "w") as f:
        json.dump(results, f, indent=2, default=str)
    failed = [k for k, v in results.items() if isinstance(v, dict) and v["status"] == "FAILED"]
    print(f"done in {results['seconds'] / 60:.1f} min; numbers in {out}" + (f"; FAILED: {', '.join(failed)}"
                                                                              if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
