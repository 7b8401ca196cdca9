"""What a compact-Sudoku policy writes, cell by cell (a diagnostic, not training; docs/experiments.md "Why Sudoku's seed
2 stays at ~0.2"). Each cell of the turn-1 view is a clue (a digit) or an empty cell with 1-4 candidates (its letter);
each digit of the greedy 16-digit answer below it is the unique solution's digit, another digit, or 0 ("no answer"). A
policy that fills every single-candidate cell each turn (0 elsewhere) solves all 200 test puzzles within 3 turns
(174 in 4 with the view before 2026-11-30's narrowing), so "1 cand" cells written with the solution's digit is the
first thing to read. Last, the whole 4-turn greedy episodes: how many fail, and how many of those end with a wrong
digit on the grid (a guess never taken back):

    python docs/sudoku_cells.py ~/.cache/at-grpo-mini/tiny-base-sudoku-mas-s2-HASH          # an untrained base
    python docs/sudoku_cells.py runs/sudoku-s2/ckpt/policy-tool+plan  # a trained policy

The tool agent answers the view; the plan agent answers the view after the tool agent's greedy answer."""
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import envs as E  # noqa: E402

OUTCOMES = ("solution", "other", "0")
EVAL_TURNS = 4  # the tiny presets' eval_turns


def cell_counts(env, answer):
    """Counter of (cell kind, outcome) for a 16-digit `answer` to `env`'s current grid: kind "clue" (a filled cell)
    or "N cand" (an empty cell the view gives N candidates, `envs.Sudoku.candidates`); outcome as in OUTCOMES. An
    answer that is not 16 digits counts once as ("answer", "unparseable")."""
    t = (answer or "").strip()
    if len(t) != 16 or not t.isdigit():
        return collections.Counter({("answer", "unparseable"): 1})
    sol = E.sudoku_solutions(env.clues, limit=1)[0]
    shown = E.Sudoku.candidates(env.grid)
    out = collections.Counter()
    for i, ch in enumerate(t):
        r, c, d = i // 4, i % 4, int(ch)
        if env.grid[r][c]:
            kind = "clue"
        else:
            kind = f"{len(shown[r, c])} cand"
        out[kind, "0" if d == 0 else "solution" if d == sol[r][c] else "other"] += 1
    return out


def wrong_digits(env):
    """Cells of `env`'s grid holding a digit that is not the unique solution's: a wrong fill the policy left there
    (the compact view shows a fill as it shows a clue, so a policy cannot see which digit to take back)."""
    sol = E.sudoku_solutions(env.clues, limit=1)[0]
    return sum(1 for r in range(4) for c in range(4) if env.grid[r][c] and env.grid[r][c] != sol[r][c])


def main(path, n=200):
    from transformers import AutoTokenizer
    from policies import make_engine
    from rollout import Agents, every_role, plain_rollout
    agents = Agents(AutoTokenizer.from_pretrained(path), [make_engine("torch", path, seed=0, max_len=512)],
                    {"tool": 0, "plan": 0}, max_prompt_tokens=256)
    sp = every_role(temperature=0.0, top_p=1.0, max_new_tokens=E.TASKS["sudoku"]["answer_tokens"])

    def answer(role, envs):
        outs = agents.generate(role, [agents.render(e.observe(role)) for e in envs], 1, sp[role])
        return [agents.decode(o[0]) for o in outs]

    envs = E.test_set("sudoku", n=n, compact=True, workflow="mas")  # fresh instances: the tool's step may change them
    tool = answer("tool", envs)
    counts = {"tool": sum((cell_counts(e, a) for e, a in zip(envs, tool)), collections.Counter())}
    for e, a in zip(envs, tool):
        e.step("tool", a)
    counts["plan"] = sum((cell_counts(e, a) for e, a in zip(envs, answer("plan", envs))), collections.Counter())
    print(f"{path}: turn 1, greedy, {n} test puzzles; cells by kind and what the answer wrote there")
    print("| role | cell kind | " + " | ".join(OUTCOMES) + " |\n|---|---|" + "---|" * len(OUTCOMES))
    for role, cnt in counts.items():
        for kind in sorted({k for k, _ in cnt} - {"answer"}):
            print(f"| {role} | {kind} | " + " | ".join(str(cnt[kind, o]) for o in OUTCOMES) + " |")
    print("unparseable answers: " + ", ".join(f"{role} {cnt['answer', 'unparseable']}" for role, cnt in counts.items()))
    # the whole greedy episodes, as eval.py plays them: where do the failures end?
    envs = E.test_set("sudoku", n=n, compact=True, workflow="mas")
    _, trajs = plain_rollout(envs, agents, 1, EVAL_TURNS, sp)
    ends = [t[0] for t in trajs if not t[0].success]
    counts["episodes"] = {"failed": len(ends), "wrong digit on the grid": sum(wrong_digits(e) > 0 for e in ends)}
    print(f"{EVAL_TURNS}-turn greedy episodes: {len(ends)} of {n} failed, "
          f"{counts['episodes']['wrong digit on the grid']} of them ending with a wrong digit on the grid")
    return counts


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python docs/sudoku_cells.py MODEL_DIR (a tiny base or a ckpt/policy-* folder)")
    main(sys.argv[1])
