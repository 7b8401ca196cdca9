"""Counterfactual for compact Sudoku (a diagnostic, not the paper's reward; docs/experiments.md "Why a run turns into a
guesser"). The spec pays +0.1 for every legal fill, right or wrong, and AT-GRPO's per-turn rewards never charge a wrong
guess for the puzzle it leaves unsolvable, so the tiny policy learns to guess. This runs train.py with one change: a
legal fill that is not the unique solution's digit earns -0.3 (an illegal fill's penalty) instead of +0.1 (train.py's
`--sudoku_wrong_fill -0.3`; the spec's is +0.1). The rules, the held-out success metric, the cached base and every
flag are train.py's:

    python docs/sudoku_solution_reward.py --seed 2 --out_dir runs/sudoku-solreward-s2  (train.py's flags)

The tree's branch follows the sibling with the best reward, so under this reward it also follows right fills: the
training success it prints is not comparable with train.py's; the greedy held-out score is."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train as T  # noqa: E402

WRONG_FILL_REWARD = -0.3

if __name__ == "__main__":
    if any(a == "--task" or a.startswith("--task=") for a in sys.argv[1:]):
        raise SystemExit("this counterfactual changes Sudoku's reward only and sets --task sudoku itself: drop --task")
    T.main(["--task", "sudoku", "--sudoku_wrong_fill", str(WRONG_FILL_REWARD)] + sys.argv[1:])
