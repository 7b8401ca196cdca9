"""Capacity probe for compact Sokoban and Sudoku (a diagnostic, not training; docs/experiments.md "Do the trained
policies read the room at all?"). RL leaves the tiny policy open-loop (one answer to every room or puzzle). Is that the
model's size or the view? This fine-tunes the cached tiny base on *solver* answers from the state shown (on training
instances, and on states along their solutions as later turns see them) and saves it for eval.py:

    python docs/sft_probe.py sokoban ~/.cache/at-grpo-mini/tiny-base-sokoban-mas-s1-HASH runs/sft-probe-sokoban-s1 600
    python eval.py --task sokoban --model runs/sft-probe-sokoban-s1

Sokoban's answer: the first 7 moves of a BFS-shortest solution (the tiny budget: 7 moves and the end of turn).
Sudoku's: the 16-digit grid with the unique solution's digit in every empty cell and 0 ("no answer") elsewhere.
If this reaches what RL does not, the model and the view can hold an instance-dependent policy and RL's signal is
what is missing. The format warm-up's optimiser settings and step (tiny.sft_step), 32 answers per step."""
import os
import random
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import threads  # noqa: E402, F401  (before torch: OpenMP's settings)
import torch  # noqa: E402
import envs as E  # noqa: E402
import model as M  # noqa: E402
import tiny as T  # noqa: E402
from rollout import Agents  # noqa: E402


def shortest(g):
    """Sokoban: a shortest move list to the goal from the room's state (the env's own BFS)."""
    return E.bfs(
        (g.player, g.box), lambda s: [(a, n) for a in "UDLR" for n in [g.move(s, a)] if n], lambda s: s[1] == g.goal
    )


def teacher(task, env, rng):
    """Move `env` 0-4 steps along a solution (the states later turns see); then the solver's answer from there, or
    None when nothing is left to do."""
    if task == "sokoban":
        for _ in range(rng.randint(0, 4)):
            path = shortest(env)
            if not path or len(path) < 2:
                break
            env.apply(path[:1])
        path = shortest(env)
        return "".join(path[:7]) if path else None
    empty = [(r, c) for r in range(4) for c in range(4) if not env.grid[r][c]]
    sol = E.sudoku_solutions(env.clues, limit=1)[0]
    for r, c in rng.sample(empty, rng.randint(0, min(4, len(empty) - 1))):
        env.apply([(r, c, sol[r][c])])
    # the 16-digit answer: the solution's digit in every cell still empty, 0 ("no answer") elsewhere
    return "".join(str(sol[r][c]) if not env.grid[r][c] else "0" for r in range(4) for c in range(4))


def main(task, base, out, steps):
    if task not in ("sokoban", "sudoku"):
        raise SystemExit(f"task {task!r}: the probe covers sokoban and sudoku (Plan-Path learns with RL)")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(base)
    m = M.load_model(base)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.0)
    agents, rng, end = Agents(tok, [], {}), random.Random(0), tok.convert_tokens_to_ids("<|im_end|>")
    for it in range(steps):
        batch = []
        while len(batch) < 32:
            env = E.train_env(task, rng, compact=True)
            answer = teacher(task, env, rng)
            if not answer:
                continue
            role = rng.choice(["tool", "plan"])
            if role == "plan" and rng.random() < 0.7:  # the plan agent sees a tool answer, good or random
                env.step("tool", answer if rng.random() < 0.5 else env.random_answer("tool", rng, 4))
            batch.append((agents.render(env.observe(role)), tok.encode(answer, add_special_tokens=False) + [end]))
        loss = T.sft_step(m, opt, batch)
        if (it + 1) % 100 == 0:
            print(f"sft {it + 1}/{steps}: loss {loss:.3f}", flush=True)
    shutil.copytree(base, out, dirs_exist_ok=True)
    M.save_model(m, out)


if __name__ == "__main__":
    if len(sys.argv) < 4:
        raise SystemExit("usage: python docs/sft_probe.py sokoban|sudoku BASE_DIR OUT_DIR [STEPS=600]")
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 600)
