"""Show that a refactor changed no behaviour: run the same short trainings at two commits and compare their
metrics.jsonl field by field (every field but the timings). Runs are exactly reproducible on one machine, so any
difference in success, rewards, loss, clip fraction, grad norm, |dlogp| or an evaluation is a behaviour change.

    python docs/same_metrics.py OLD NEW                       # commits (or "worktree" for the uncommitted files)
    python docs/same_metrics.py 21a8b2f worktree --configs default,grpo --steps 20

Each commit is checked out (git worktree) under --work; its runs and its tiny base live there, so the base is rebuilt
by each commit's own code (a change in the base's birth shows up too). The runs go one after another: torch's CPU
kernels may round differently when two runs share the cores."""
import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {  # name: extra flags of `python train.py --steps N --stop_step N --time_limit_min 0`
    "default": [],
    "grpo": ["--algo", "grpo"],
    "dr_mas": ["--algo", "dr_mas"],
    "gigpo": ["--algo", "gigpo"],
    "per_role": ["--policies", "per_role"],
    "lora": ["--policies", "lora"],
    "search": ["--task", "search"],
    "sokoban": ["--task", "sokoban"],
    "unpacked": ["--pack", "false"],  # Plan-Path in the layout before 2026-11-28 (--steps is set for every config)
    "torch": ["--engine", "torch"],  # the tiny presets' sampler since 2026-11-29 (before: vLLM)
    "vllm": ["--engine", "vllm"],  # the engine of the tiny default before 2026-11-29
}
TIMING = ("time", "eta", "load_per_core")  # fields of the clock or the machine; every t_* and mem_* field too


def timing(key):
    return key in TIMING or key.startswith("t_") or key.startswith("mem_")


def checkout(commit, work):
    """The commit's files in a folder of their own (the repository's own files for "worktree")."""
    if commit == "worktree":
        return ROOT
    path = os.path.join(work, "src-" + commit)
    if not os.path.exists(path):
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", "--force", path, commit], check=True,
                       stdout=subprocess.DEVNULL)
    return path


def run(commit, config, steps, work, python):
    src = checkout(commit, work)
    out = os.path.join(work, f"runs-{commit}", config)
    metrics = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(os.path.join(out, "done")):
        cmd = [python, "train.py", "--steps", str(steps), "--stop_step", str(steps), "--time_limit_min", "0",
               "--out_dir", out] + CONFIGS[config]
        print(f"[{commit} {config}] {' '.join(cmd[1:])}", flush=True)
        # each commit builds its own tiny base (commits that cache it under ~/.cache read this variable)
        env = dict(os.environ, AT_GRPO_MINI_CACHE=os.path.join(work, f"runs-{commit}", "tiny-cache"))
        with open(os.path.join(work, f"log-{commit}-{config}.txt"), "w") as log:
            subprocess.run(cmd, cwd=src, check=True, stdout=log, stderr=subprocess.STDOUT, env=env)
        open(os.path.join(out, "done"), "w").close()
    return [json.loads(line) for line in open(metrics)]


def compare(a, b):
    """(differences in the fields both logs have: 'step S field: A != B' lines, fields only one log has) between two
    metrics logs; ([], set()) = identical. A field only one side has is a new (or dropped) metric, not a changed one."""
    diffs, only = [], set()
    if len(a) != len(b):
        diffs.append(f"{len(a)} lines != {len(b)} lines")
    for ra, rb in zip(a, b):
        only |= {k for k in set(ra) ^ set(rb) if not timing(k)}
        keys = sorted(k for k in set(ra) & set(rb) if not timing(k))
        diffs += [f"step {ra.get('step')} {k}: {ra[k]!r} != {rb[k]!r}" for k in keys if ra[k] != rb[k]]
    return diffs, only


def main(argv):
    flags = {"--configs": ",".join(CONFIGS), "--steps": "20", "--work": "/tmp/same_metrics",
             "--python": os.path.join(ROOT, ".venv", "bin", "python")}
    pos = []
    while argv:
        a = argv.pop(0)
        if a in flags:
            flags[a] = argv.pop(0)
        elif a.startswith("--"):
            raise SystemExit(f"unknown flag {a}; known: {', '.join(flags)}")
        else:
            pos.append(a)
    if len(pos) != 2:
        raise SystemExit(__doc__)
    os.makedirs(flags["--work"], exist_ok=True)
    if "worktree" in pos:  # files that change between calls: never reuse their runs (nor the tiny base beside them)
        shutil.rmtree(os.path.join(flags["--work"], "runs-worktree"), ignore_errors=True)
    bad = 0
    for config in flags["--configs"].split(","):
        if config not in CONFIGS:
            raise SystemExit(f"unknown config {config!r}; known: {', '.join(CONFIGS)}")
        logs = [run(c, config, int(flags["--steps"]), flags["--work"], flags["--python"]) for c in pos]
        diffs, only = compare(*logs)
        fields = sorted({k for r in logs[0] for k in r if not timing(k) and k not in only})
        print(f"{config}: {len(logs[0])} rows x {len(fields)} shared non-timing fields: "
              + ("identical" if not diffs else f"{len(diffs)} differences")
              + (f"; fields in one log only: {', '.join(sorted(only))}" if only else ""), flush=True)
        for d in diffs[:20]:
            print("   ", d)
        bad += bool(diffs)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
