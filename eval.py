"""
Evaluate checkpoints on a task's test set with the paper's protocol (SPEC §7). Tables and curves of training runs:
tools/runs.py.

    python eval.py --task plan --model runs/default/ckpt/policy-tool+plan            # MAS, greedy, one sample
    python eval.py --task plan --model M --workflow single                   # the single-agent baseline
    python eval.py --task plan --policy tool=A --policy plan=B               # any checkpoint per role (role swaps)
    python eval.py --task math --team 2,2 --model M                          # N reasoners + M tool agents + a judge
    python eval.py --task math --model M --k 4 --temperature 0.6             # math default: avg@4 and pass@4

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
    firsts = defaultdict(set)  # role -> its distinct first-turn answers (first sample of each instance)
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
            if s.turn == 0 and s.traj == 0:
                st["instances"] += 1
                firsts[s.role].add(tuple(s.response_ids))
    agents.seed_base = old_seed
    if world > 1:
        import torch.distributed as dist
        allr, alls, allf = [None] * world, [None] * world, [None] * world
        dist.all_gather_object(allr, results)
        dist.all_gather_object(alls, {r: dict(v) for r, v in role_stats.items()})
        dist.all_gather_object(allf, dict(firsts))
        firsts = defaultdict(set)
        for part in allf:
            for r, v in part.items():
                firsts[r] |= v
        results = [x for part in allr for x in part]
        merged = defaultdict(lambda: defaultdict(float))
        for part in alls:
            for r, v in part.items():
                for kk, vv in v.items():
                    merged[r][kk] += vv
        role_stats = merged
    results.sort()
    per_instance = [r[1] for r in results]  # each test instance's k outcomes, in test-set order
    res = summarize(per_instance, k)
    res["per_instance"] = per_instance
    res["per_role"] = {r: {"calls": int(v["calls"]), "format_error_rate": v["format_errors"] / max(1, v["calls"]),
                           "local_reward": v["local_reward"] / max(1, v["calls"]),
                           "answer_tokens": v["answer_tokens"] / max(1, v["calls"]),
                           # 1 of n: the same answer to every instance, an open-loop policy that ignores what it sees
                           "distinct_first_answers": len(firsts[r]), "instances": int(v["instances"])}
                       for r, v in role_stats.items()}
    by_turn = defaultdict(int)  # episodes that succeeded, by the turn count they ended after
    for _, succ, t in results:
        for s, tt in zip(succ, t):
            if s:
                by_turn[tt] += 1
    total = len(results) * k
    res["success_by_turn"] = {f"<= {t}": sum(v for tt, v in by_turn.items() if tt <= t) / max(1, total) for t in range(1, turns + 1)}
    return res


# -----------------------------------------------------------------------------
# command line


def markdown(res, title):
    lines = [f"### {title}", "", "| metric | value | 95% CI |", "|---|---|---|"]
    lines.append(f"| accuracy | {res['accuracy']:.3f} | {res['ci'][0]:.3f}-{res['ci'][1]:.3f} |")
    if res["k"] > 1:
        lines.append(f"| avg@{res['k']} | {res['avg@k']:.3f} | {res['avg@k_ci'][0]:.3f}-{res['avg@k_ci'][1]:.3f} |")
        lines.append(f"| pass@{res['k']} | {res['pass@k']:.3f} | {res['pass@k_ci'][0]:.3f}-{res['pass@k_ci'][1]:.3f} |")
    lines += ["", "| role | calls | format errors | local reward | answer tokens | distinct first answers |", "|---|---|---|---|---|---|"]
    for r, v in res["per_role"].items():
        lines.append(f"| {r} | {v['calls']} | {v['format_error_rate']:.3f} | {v['local_reward']:+.3f} | {v['answer_tokens']:.1f} "
                     f"| {v['distinct_first_answers']} of {v['instances']} |")
    lines += ["", "success by turn: " + ", ".join(f"{k}: {v:.3f}" for k, v in res["success_by_turn"].items()), ""]
    return "\n".join(lines)


FLAGS = {  # name: (default, what it does); a list default means the flag repeats (or takes several values)
    "task": (None, "plan | sokoban | sudoku | code | math (required unless --plot / --summary)"),
    "model": (None, "HF folder (a train.py ckpt/policy-NAME) for every role not given by --policy"),
    "policy": ([], "ROLE=PATH, repeatable: that role's model (role swaps: give each role the other's checkpoint)"),
    "workflow": ("mas", "mas: all agents; single: the plan agent / coder / reasoner alone"),
    "team": (None, "math: N,M = N reasoners + M tool agents + a judge (as train.py --team)"),
    "team_mode": ("aggregate", "--team: aggregate (one turn, the reference's workflow) or refine (as train.py)"),
    "k": (None, "samples per problem: 4 for math (avg@4, pass@4), else 1"),
    "temperature": (None, "0.6 for math, else 0 (greedy)"),
    "split": ("test", "only the test split is evaluated here"),
    "limit": (None, "evaluate the first N instances only (default: all; games: 200 test seeds for tiny models, as train.py, else 100)"),
    "turns": (None, "max turns per episode: the reference's evaluation scripts (games 3, code 5, math 5); tiny models 4"),
    "thinking": ("false", "true: Qwen3's chat-template thinking on (as the run was trained; train.py --thinking)"),
    "engine": ("vllm", "vllm | torch (the pure-torch sampler)"),
    "out": (None, "write OUT.json and OUT.md (with --plot: the png)"),
    "files": ([], "code/math: test jsonl files (shipped paths or your own in the same schema); default: all of the task's"),
    "compact": (None, "true/false: the compact game prompts; default: true for tiny models"),
    "max_new_tokens": (None, "response budget per call: the compact answer's length for tiny models (8; Sudoku 17), else 8192 (the reference's)"),
    "max_model_len": (None, "engine context: 512 for tiny models, else max_new_tokens + 8192 (at most the model's context)"),
}


def usage():
    return "usage: python eval.py --task T --model M [--flag value ...]\n\n" + "\n".join(
        f"  --{k:<16} {str(d):<8} {h}" for k, (d, h) in FLAGS.items())


def parse_args(argv):
    if "--help" in argv or "-h" in argv:
        print(usage())
        raise SystemExit(0)
    a = {k: (list(d) if isinstance(d, list) else d) for k, (d, _) in FLAGS.items()}
    i = 0
    while i < len(argv):
        name, val = (argv[i][2:].split("=", 1) + [None])[:2] if argv[i].startswith("--") else (None, None)
        if name is None or name not in a:
            raise SystemExit(f"unknown argument {argv[i]!r}; flags: {', '.join('--' + k for k in a)}")
        if val is None:
            if i + 1 >= len(argv):
                raise SystemExit(f"--{name} needs a value")
            val, i = argv[i + 1], i + 1
        if name in ("policy", "files"):
            a[name].append(val)
        else:
            a[name] = val
        i += 1
    return a


# Real models: the reference's evaluation scripts (pettingllms 4362c77 scripts/evaluate/{stateful,code,math}/evaluate_L1.sh:
# MAX_TURNS 3 / 5 / 5, MAX_RESPONSE_LENGTH 8192), and SPEC §7's math sampling (docs/paper_preset.md says why).
# Tiny models: train.py's tiny presets (4 turns, the compact answer's length).
EVAL_TURNS = {"plan": 3, "sokoban": 3, "sudoku": 3, "code": 5, "math": 5}
EVAL_RESPONSE_TOKENS = 8192


def protocol(a, task, tiny):
    """(k, temperature, turns, max_new_tokens): the flags given, else the defaults above."""
    is_math = task == "math"
    k = int(a["k"] or (4 if is_math else 1))
    temp = float(a["temperature"] if a["temperature"] is not None else (0.6 if is_math else 0.0))
    if k > 1 and temp == 0.0:
        raise SystemExit(f"--k {k} with greedy decoding gives k identical samples: set --temperature (paper: 0.6)")
    turns = int(a["turns"] or (4 if tiny else EVAL_TURNS[task]))
    max_new = int(a["max_new_tokens"] or (E.COMPACT_ANSWER_TOKENS.get(task, 8) if tiny else EVAL_RESPONSE_TOKENS))
    return k, temp, turns, max_new


def budgets(a, tiny, max_new, context):
    """(engine context, prompt budget, response budget): 512 / 256 for tiny models, else the response budget + 8192
    prompt tokens, fitted to the models' context as train.py fits them (common.fit_context)."""
    from common import fit_context
    return fit_context(int(a["max_model_len"] or (512 if tiny else max_new + 8192)), 256 if tiny else 8192, max_new, context)


def main(argv):
    a = parse_args(argv)
    task, workflow = a["task"], a["workflow"]
    if task is None:
        raise SystemExit("--task is required (plan, sokoban, sudoku, code, math); tables and plots of training runs: tools/runs.py")
    try:
        E.check_task(task, workflow)
    except ValueError as e:
        raise SystemExit(str(e))
    try:
        team = E.parse_team(a["team"], task, workflow, a["team_mode"])
    except ValueError as e:
        raise SystemExit(str(e))
    roles = E.team_roles(*team[:2]) if team else E.TASKS[task]["roles"] if workflow == "mas" else (E.TASKS[task]["single"],)
    paths = {r: a["model"] for r in roles}
    for spec in a["policy"]:
        if "=" not in spec:
            raise SystemExit(f"--policy takes ROLE=PATH, not {spec!r}")
        r, p = spec.split("=", 1)
        if r not in roles:
            raise SystemExit(f"task {task!r} ({workflow}) has no role {r!r}: its roles are {', '.join(roles)}")
        paths[r] = p
    for r, p in paths.items():
        if not p:
            raise SystemExit(f"no model for role {r!r}: pass --model PATH or --policy {r}=PATH")
        if not os.path.isfile(os.path.join(p, "config.json")):
            raise SystemExit(f"model for role {r!r} not found: {p!r} has no config.json (a HF folder or a train.py ckpt/policyN)")
    if a["split"] != "test":
        raise SystemExit("--split: only 'test' is evaluated here (training instances are generated or drawn by train.py)")
    # a model trained by the embedded default plays the compact game; real checkpoints the full prompts
    cfgs = [json.load(open(os.path.join(p, "config.json"))) for p in paths.values()]
    tiny = cfgs[0].get("vocab_size", 0) < 1000
    k, temp, turns, max_new = protocol(a, task, tiny)
    max_len, max_prompt, max_new = budgets(a, tiny, max_new, min(c.get("max_position_embeddings", 40960) for c in cfgs))
    compact = tiny and task in ("plan", "sokoban", "sudoku") if a["compact"] is None else a["compact"].lower() in ("1", "true")
    limit = int(a["limit"]) if a["limit"] else None
    n_games = 200 if tiny else 100  # train.py's --eval_n of its tiny and paper presets
    test_envs = E.test_set(task, n=n_games, compact=compact, workflow=workflow, files=a["files"] or None, limit=limit, team=team)

    from transformers import AutoTokenizer
    from policies import make_engine
    from rollout import Agents
    uniq = sorted(set(paths.values()))
    engines = [make_engine(a["engine"], p, seed=0, max_len=max_len) for p in uniq]
    agents = Agents(AutoTokenizer.from_pretrained(uniq[0]), engines, {r: uniq.index(p) for r, p in paths.items()},
                    max_prompt_tokens=max_prompt, thinking=a["thinking"].lower() in ("1", "true", "yes"))
    res = evaluate(test_envs, agents, turns, k=k, temperature=temp, max_new_tokens=max_new, progress=True)
    proto = f"{task}, {workflow}, {'greedy' if temp == 0 else f'T={temp}'}, k={k}, turns={turns}, n={res['n']}"
    res.update(task=task, workflow=workflow, policies=paths, protocol=proto)
    md = markdown(res, f"{task} ({proto}); " + ", ".join(f"{r}={p}" for r, p in paths.items()))
    print(md)
    if a["out"]:
        os.makedirs(os.path.dirname(os.path.abspath(a["out"])), exist_ok=True)
        with open(a["out"] + ".json" if not a["out"].endswith(".json") else a["out"], "w") as f:
            json.dump(res, f, indent=2)
        with open(a["out"].removesuffix(".json") + ".md", "w") as f:
            f.write(md)
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
