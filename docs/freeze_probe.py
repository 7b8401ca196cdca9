"""What the K siblings of a frozen run say (issue 74, the freeze: nearly every group without a signal).

    python docs/freeze_probe.py runs/S/ckpt/policy-tool+plan                      # at the preset's 0.5
    python docs/freeze_probe.py runs/S/ckpt/policy-tool+plan --temperature 1.0

One tree rollout as training makes it (K candidates per (agent, turn), the best branch continues) of 64 fresh
compact Plan-Path puzzles (`random.Random(5)`) with the checkpoint in the torch sampler. It counts the groups whose
K rewards are equal (no signal), of them those whose K answers are one answer, and prints the first eight such
groups under a reward of 0.5. A probe: it reads, it does not train. The step log's `nll_p0` cannot tell this apart,
because it is taken over the samples trained, the few that varied."""
import argparse
import collections
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import envs as E  # noqa: E402
import eval as EV  # noqa: E402
from rollout import tree_rollout  # noqa: E402


def probe(ckpt, temperature="0.5", K=4, puzzles=64):
    """One tree rollout of `puzzles` fresh puzzles with the checkpoint at `temperature`: (the groups, those
    without a signal, those of them whose K answers are one answer, the puzzles solved, the tokenizer)."""
    # eval.py's flags resolve the tiny-plan preset; its eval sampling at the training temperature
    cfg, paths = EV.configure(["--task", "plan", "--model", ckpt, "--engine", "torch",
                               "--eval_temperature", str(temperature)])
    agents = EV.load_agents(cfg, paths)
    rng = random.Random(5)
    turns = cfg["eval_turns"]
    envs = [E.train_env("plan", rng, compact=cfg["compact"], turns=turns) for _ in range(puzzles)]
    samples = tree_rollout(envs, agents, K, turns, cfg["role_eval_sampling"], 1.0, "greedy", rng)
    groups = collections.defaultdict(list)  # (env, role, turn) -> its K candidates
    for s in samples:
        groups[(s.env, s.role, s.turn)].append(s)
    no_signal = [g for g in groups.values() if len({round(s.reward, 6) for s in g}) == 1]
    one_answer = [g for g in no_signal if len({tuple(s.response_ids) for s in g}) == 1]
    return list(groups.values()), no_signal, one_answer, sum(e.success for e in envs), agents.tok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("--temperature", default="0.5")
    ap.add_argument("--K", type=int, default=4)
    ap.add_argument("--puzzles", type=int, default=64)
    args = ap.parse_args()
    if args.K < 1 or args.puzzles < 1:
        ap.error(f"--K {args.K} --puzzles {args.puzzles}: use at least 1 of each")
    groups, no_signal, one_answer, solved, tok = probe(args.ckpt, args.temperature, args.K, args.puzzles)
    print(f"T={args.temperature}: {len(groups)} groups, {len(no_signal)} without a signal, "
          f"{len(one_answer)} of them one answer; solved {solved} of {args.puzzles}")
    for g in [g for g in no_signal if g[0].reward < 0.5][:8]:
        answers = [tok.decode(s.response_ids, skip_special_tokens=True) for s in g]
        print(f"  {g[0].role} turn {g[0].turn} reward {g[0].reward:+.3f}: {answers}")


if __name__ == "__main__":
    main()
