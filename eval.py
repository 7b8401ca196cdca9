"""
Evaluate checkpoints on a task's test set with the paper's protocol (SPEC §7), or plot training curves.

    python eval.py --task plan --model runs/default/ckpt/policy0            # MAS, greedy, one sample
    python eval.py --task plan --model M --workflow single                   # the single-agent baseline
    python eval.py --task plan --policy tool=A --policy plan=B               # any checkpoint per role (role swaps)
    python eval.py --task math --model M --k 4 --temperature 0.6             # math default: avg@4 and pass@4
    python eval.py --plot runs/default runs/grpo --out curves.png            # curves from metrics.jsonl

Rollouts are the same code as training (plain rollouts, no tree). Accuracy = fraction of instances whose
episode ends in success. With k samples per instance: avg@k = mean success over all samples, pass@k = unbiased
estimator 1 - C(n-c, k)/C(n, k) averaged over instances (here n = k). 95% intervals: Wilson for a proportion
(k = 1), else a normal interval over the per-instance values (t-free, n is in the hundreds).
"""
import json
import math
import os
import sys
from collections import defaultdict

import envs as E

# -----------------------------------------------------------------------------
# metrics


def pass_at_k(n, c, k):
    """Unbiased pass@k from n samples with c successes (Chen et al. 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def wilson(successes, n, z=1.96):
    if n == 0:
        return (0.0, 0.0)
    p = successes / n
    d = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / d
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (max(0.0, centre - half), min(1.0, centre + half))


def mean_ci(values, z=1.96):
    n = len(values)
    if n == 0:
        return (0.0, 0.0)
    m = sum(values) / n
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / max(1, n - 1))
    return (max(0.0, m - z * sd / math.sqrt(n)), min(1.0, m + z * sd / math.sqrt(n)))


def summarize(per_instance, k):
    """per_instance: list of lists of k booleans -> accuracy/avg@k/pass@k with intervals."""
    n = len(per_instance)
    avg = [sum(x) / len(x) for x in per_instance]
    pk = [pass_at_k(len(x), sum(x), k) for x in per_instance]
    res = {"n": n, "k": k, "avg@k": sum(avg) / max(1, n), "pass@k": sum(pk) / max(1, n)}
    if k == 1:
        s = sum(x[0] for x in per_instance)
        res.update(accuracy=s / max(1, n), ci=wilson(s, n))
        res["avg@k_ci"] = res["pass@k_ci"] = res["ci"]
    else:
        res.update(accuracy=res["avg@k"], ci=mean_ci(avg), **{"avg@k_ci": mean_ci(avg), "pass@k_ci": mean_ci(pk)})
    return res


# -----------------------------------------------------------------------------
# evaluation (also called by train.py)


def evaluate(test_envs, agents, turns, k=1, temperature=0.0, max_new_tokens=256, rank=0, world=1, seed=1234, progress=False):
    """Plain rollouts of every test env (this rank's shard), k samples each; results gathered over ranks."""
    from rollout import plain_rollout
    mine = list(range(rank, len(test_envs), world))
    sp = dict(temperature=temperature, top_p=1.0, max_new_tokens=max_new_tokens)
    old_seed = getattr(agents, "seed_base", None)
    agents.seed_base, agents.calls = seed + rank, 0
    results, role_stats = [], defaultdict(lambda: defaultdict(float))
    batch = 64
    it = range(0, len(mine), batch)
    if progress:
        from tqdm import tqdm
        it = tqdm(it, desc="eval", unit="batch")
    for b in it:
        idx = mine[b:b + batch]
        samples, trajs = plain_rollout([test_envs[i].clone() for i in idx], agents, k, turns, sp)
        for j, i in enumerate(idx):
            results.append((i, [bool(e.success) for e in trajs[j]], [e.turn for e in trajs[j]]))
        for s in samples:
            st = role_stats[s.role]
            st["calls"] += 1
            st["format_errors"] += not s.formatted
            st["local_reward"] += s.local
            st["answer_tokens"] += len(s.response_ids)
    agents.seed_base = old_seed
    if world > 1:
        import torch.distributed as dist
        allr, alls = [None] * world, [None] * world
        dist.all_gather_object(allr, results)
        dist.all_gather_object(alls, {r: dict(v) for r, v in role_stats.items()})
        results = [x for part in allr for x in part]
        merged = defaultdict(lambda: defaultdict(float))
        for part in alls:
            for r, v in part.items():
                for kk, vv in v.items():
                    merged[r][kk] += vv
        role_stats = merged
    results.sort()
    res = summarize([r[1] for r in results], k)
    res["per_role"] = {r: {"calls": int(v["calls"]), "format_error_rate": v["format_errors"] / max(1, v["calls"]),
                           "local_reward": v["local_reward"] / max(1, v["calls"]),
                           "answer_tokens": v["answer_tokens"] / max(1, v["calls"])} for r, v in role_stats.items()}
    by_turn = defaultdict(int)  # episodes that succeeded, by the turn count they ended after
    for _, succ, t in results:
        for s, tt in zip(succ, t):
            if s:
                by_turn[tt] += 1
    total = len(results) * k
    res["success_by_turn"] = {f"<= {t}": sum(v for tt, v in by_turn.items() if tt <= t) / max(1, total) for t in range(1, turns + 1)}
    return res
