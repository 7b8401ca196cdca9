"""Which compact-Sokoban rooms a policy solves (a diagnostic, not training; docs/experiments.md "Where Sokoban's 15
minutes go"). The 200 test rooms are split by the length of their shortest solution (BFS, docs/sft_probe.py's
`shortest`) and by whether the player starts on the push spot (the room needs pushes only, no walk). A policy that
learned to push but not to walk solves the first rows and the "on the spot" rooms only:

    python docs/sokoban_lengths.py ~/.cache/at-grpo-mini/tiny-base-sokoban-mas-s1-HASH             # an untrained base
    python docs/sokoban_lengths.py runs/sokoban-s1/ckpt/policy-tool+plan   # a trained policy

Greedy, both agents, the episode's 4 turns: eval.py's held-out protocol (train.py's evaluations), per room."""
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import envs as E  # noqa: E402
from sft_probe import shortest  # noqa: E402


def table(envs, solved):
    """Counter of (split, value) -> [rooms, solved] for rooms `envs` (untouched) and their outcomes `solved`: split
    "moves" by the shortest solution's length, "on spot" by whether the player starts on the push spot."""
    out = collections.defaultdict(lambda: [0, 0])
    for env, ok in zip(envs, solved):
        for key in (("moves", len(shortest(env))), ("on spot", env.player == env.push_spot())):
            out[key][0] += 1
            out[key][1] += bool(ok)
    return dict(out)


def main(path, n=200):
    from transformers import AutoTokenizer
    from policies import make_engine
    from rollout import Agents, evaluate, every_role
    agents = Agents(AutoTokenizer.from_pretrained(path), [make_engine("torch", path, seed=0, max_len=512)],
                    {"tool": 0, "plan": 0}, max_prompt_tokens=256)
    envs = E.test_set("sokoban", n=n, compact=True, workflow="mas")
    greedy = every_role(temperature=0.0, max_new_tokens=E.TASKS["sokoban"]["answer_tokens"])
    res = evaluate(envs, agents, 4, greedy)  # plays clones of envs
    rows = table(envs, [x[0] for x in res["per_instance"]])
    print(f"{path}: greedy, 4 turns, {n} test rooms, held-out success {res['accuracy']:.3f}")
    print("| shortest solution (moves) | rooms | solved |\n|---|---|---|")
    for v in sorted(v for split, v in rows if split == "moves"):
        print(f"| {v} | {rows['moves', v][0]} | {rows['moves', v][1]} |")
    print("| player starts on the push spot | rooms | solved |\n|---|---|---|")
    for v in (True, False):
        if ("on spot", v) in rows:
            print(f"| {'yes' if v else 'no'} | {rows['on spot', v][0]} | {rows['on spot', v][1]} |")
    return rows


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python docs/sokoban_lengths.py MODEL_DIR (a tiny base or a ckpt/policy-* folder)")
    main(sys.argv[1])
