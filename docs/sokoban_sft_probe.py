"""Capacity probe for compact Sokoban (a diagnostic, not part of training; README "Do the trained policies read the
room at all?"). RL leaves the tiny policy open-loop (one answer to every room). Is that the model's size or the view?
This fine-tunes the cached tiny base on *solver* answers (the first 7 moves of a BFS-shortest solution from the state
shown, on training rooms and on states along their solutions) and saves it for eval.py:

    python docs/sokoban_sft_probe.py runs/tiny-base-sokoban-s1 runs/sft-probe-s1 600
    python eval.py --task sokoban --model runs/sft-probe-s1

If this reaches what RL does not, the model and the line can hold a room-dependent policy and RL's signal is what
is missing. The format warm-up's optimiser settings and step (train.sft_step), 32 answers per step."""
import os
import random
import shutil
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import envs as E  # noqa: E402
import model as M  # noqa: E402
import train as T  # noqa: E402
from rollout import Agents  # noqa: E402


def shortest(g):
    return E.bfs((g.player, g.box), lambda s: [(a, n) for a in "UDLR" for n in [g.move(s, a)] if n], lambda s: s[1] == g.goal)


def main(base, out, steps):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(base)
    m = M.load_model(base)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.0)
    agents, rng, end = Agents(tok, [], {}), random.Random(0), tok.convert_tokens_to_ids("<|im_end|>")
    for it in range(steps):
        batch = []
        while len(batch) < 32:
            env = E.train_env("sokoban", rng, compact=True)
            for _ in range(rng.randint(0, 4)):  # states along the solution too, as later turns see them
                path = shortest(env)
                if not path or len(path) < 2:
                    break
                env.apply(path[:1])
            path = shortest(env)
            if not path:
                continue
            answer = "".join(path[:7])  # the tiny budget: 7 moves and the end of turn
            role = rng.choice(["tool", "plan"])
            if role == "plan" and rng.random() < 0.7:  # the plan agent sees a tool answer, good or random
                env.step("tool", answer if rng.random() < 0.5 else T.random_answer("sokoban", rng, 4))
            batch.append((agents.render(env.observe(role)), tok.encode(answer, add_special_tokens=False) + [end]))
        loss = T.sft_step(m, opt, batch)
        if (it + 1) % 100 == 0:
            print(f"sft {it + 1}/{steps}: loss {loss:.3f}", flush=True)
    shutil.copytree(base, out, dirs_exist_ok=True)
    M.save_model(m, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 600)
