"""
Evaluate checkpoints on a task's test set with the evaluation protocol (docs/method.md,
"Evaluation"). Tables and curves of training runs: tools/runs.py.

    python eval.py --task plan --model runs/default/ckpt/policy-tool+plan  # MAS, greedy
    python eval.py --task plan --model M --workflow single       # the single-agent baseline
    python eval.py --task plan --policy tool=A --policy plan=B   # a model per role (swaps)
    python eval.py --task math --team 2,2 --model M              # N reasoners, M tools, a judge
    python eval.py --task math --model M --eval_k 8              # math: avg@k, pass@k at 0.6

The flags are train.py's, resolved the same way (config.apply_preset): the task's preset (its
tiny-* preset for a tiny model, else paper, paper-math, paper-code or paper-search) over the
recipe, the flags given on top. The protocol lives in the
recipe's eval_* rows. Rollouts are the training code's (plain rollouts, no tree: rollout.evaluate).
Accuracy = the fraction of instances whose episode ends in success. With k samples per instance:
avg@k = mean success over all samples, pass@k = the unbiased estimator 1 - C(n-c, k)/C(n, k)
averaged over instances (n = k). 95% intervals: Wilson for a proportion (k = 1), else a normal
interval over the per-instance values.
"""
import glob
import json
import os
import sys

import threads  # noqa: F401  (before torch: OpenMP spins briefly, so a busy machine costs its share)
import config
import envs as E
import policies as P
import retrieval
import train as T
from model import load_tokenizer
from rollout import Agents, evaluate

# -----------------------------------------------------------------------------
# config: eval.py's own flags; the others are train.py's (TRAIN_FLAGS), with its presets
limit = 0                  # the first N instances only; 0 = all (games: --eval_n test seeds)
files = ""                 # code/math: a test jsonl (repeatable; shipped, or your own)
out = ""                   # write OUT.json and OUT.md
# -----------------------------------------------------------------------------

OWN = {"limit": limit, "files": files, "out": out}
TRAIN_FLAGS = ("task", "model", "policy", "workflow", "team", "team_mode", "engine", "preset",
               "eval_k", "eval_temperature", "eval_top_p", "eval_turns", "eval_max_new_tokens", "eval_thinking",
               "eval_n", "max_prompt_tokens", "max_model_len", "tool_timeout", "test_timeout",
               "search_test", "retriever", "search_topk", "search_metric")
FLAGS = {**{k: T.FLAGS[k] for k in TRAIN_FLAGS}, **OWN}


def help_text():
    train_flags = {k: T.FLAGS[k] for k in TRAIN_FLAGS}
    return ("usage: python eval.py --task T --model M [--flag value ...]\n\n"
            + config.usage(T.__file__, train_flags, T.PRESETS) + "\n" + config.usage(__file__, OWN)
            + "\n\nA value in [...] is a preset's own: tiny* for a tiny model, else paper*.")


def configure(argv):
    """Flags -> (cfg, {role: model folder}): the preset over the recipe, the flags given on top, and
    every check that can run before a model loads."""
    cfg = dict(FLAGS)
    choices = {k: v for k, v in T.CHOICES.items() if k in cfg}
    per_role = {k: cast for k, cast in config.CASTS_OF_FLAG.items() if k in cfg}
    given = config.parse_flags(argv, cfg, choices, help_text, per_role=per_role,
                               repeatable=("policy", "files"))
    config.check_finite(cfg)
    if not cfg["task"]:
        raise SystemExit(f"--task is required ({', '.join(E.TASKS)}); tables and plots of training runs: "
                         "tools/runs.py")
    try:
        E.check_task(cfg["task"], cfg["workflow"])
    except ValueError as e:
        raise SystemExit(str(e))
    config.check_search({**cfg, "search_train": ""})  # every row of --search_test, before a model loads
    roles = config.task_roles(cfg)
    paths = role_models(cfg, roles)
    for f in filter(None, cfg["files"].split(",")):  # your own, or a shipped one under data/
        if not os.path.isfile(f) and not os.path.isfile(os.path.join(E.DATA, f)):
            raise SystemExit(f"--files {f!r}: no such file, here or under data/ (a test jsonl in the "
                             "schema of data/README.md)")
    configs = [json.load(open(os.path.join(p, "config.json"))) for p in paths.values()]
    tiny = configs[0].get("vocab_size", 0) < 1000  # the embedded default's byte tokenizer
    config.apply_preset(cfg, given, T.PRESETS, tiny, T.FLAGS)
    config.check_compiler_paths(cfg["engine"], compile_layers=False)
    longest = max(config.flag_values(cfg, "eval_max_new_tokens"))
    if "max_model_len" not in given:  # room for a whole prompt and a whole answer
        cfg["max_model_len"] = max(cfg["max_model_len"], cfg["max_prompt_tokens"] + longest)
    for name in ("eval_k", "eval_turns", "eval_max_new_tokens", "eval_n", "max_prompt_tokens"):
        if min(config.flag_values(cfg, name)) < 1:
            raise SystemExit(f"--{name} {cfg[name]}: use at least 1")
    if cfg["limit"] < 0:
        raise SystemExit(f"--limit {cfg['limit']}: use 0 (every instance) or a number of instances")
    temperatures = config.flag_values(cfg, "eval_temperature")
    if cfg["eval_k"] > 1 and 0.0 in temperatures:
        raise SystemExit(f"--eval_k {cfg['eval_k']} with greedy decoding gives identical samples: set "
                         "--eval_temperature (math's protocol: 0.6)")
    if min(temperatures) < 0:
        raise SystemExit(f"--eval_temperature {cfg['eval_temperature']}: use 0 (greedy) or above")
    context = min(c.get("max_position_embeddings", 40960) for c in configs)
    config.fit_sampling(cfg, "eval_", context)
    # a tiny model plays the compact games
    cfg["compact"] = tiny and E.TASKS[cfg["task"]]["answer_tokens"] > 0
    return cfg, paths


def load_agents(cfg, paths):
    """The agents over one engine per distinct model folder (roles that share a folder share it)."""
    folders = sorted(set(paths.values()))
    engines = [P.make_engine(cfg["engine"], folder, seed=0, max_len=cfg["max_model_len"])
               for folder in folders]
    role_to_policy = {r: folders.index(p) for r, p in paths.items()}
    return Agents(load_tokenizer(folders[0]), engines, role_to_policy,
                  max_prompt_tokens=cfg["max_prompt_tokens"])


def role_models(cfg, roles):
    """{role: model folder}: --model for every role, --policy ROLE=PATH for the ones it names."""
    paths = {r: cfg["model"] for r in roles} | config.named_bases(cfg, roles)
    for role, path in paths.items():
        if not path:
            raise SystemExit(f"no model for role {role!r}: pass --model PATH or --policy {role}=PATH")
        # a train.py run folder (its config.json is the run's, not a model's)
        policies = sorted(glob.glob(os.path.join(path, "ckpt", "policy-*")))
        if policies:
            raise SystemExit(f"{path!r} is a training run's folder: point --model (or --policy "
                             f"{role}=...) at one of its policies: {', '.join(policies)}")
        if os.path.isfile(os.path.join(path, "metrics.jsonl")):
            raise SystemExit(f"{path!r} is a training run's folder with no checkpoint yet (it saves one every "
                             "--ckpt_every steps): point --model at a model folder")
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise SystemExit(f"model for role {role!r} not found: {path!r} has no config.json (a HF folder or "
                             "a train.py ckpt/policy-NAME)")
    return paths


def markdown(res, title):
    lines = [f"### {title}", "", "| metric | value | 95% CI |", "|---|---|---|",
             f"| accuracy | {res['accuracy']:.3f} | {res['ci'][0]:.3f}-{res['ci'][1]:.3f} |"]
    if res["k"] > 1:
        for name in ("avg@k", "pass@k"):
            lo, hi = res[f"{name}_ci"]
            lines.append(f"| {name.replace('k', str(res['k']))} | {res[name]:.3f} | {lo:.3f}-{hi:.3f} |")
    lines += ["", "| role | calls | format errors | local reward | answer tokens | distinct first answers |",
              "|---|---|---|---|---|---|"]
    for r, v in res["per_role"].items():
        lines.append(f"| {r} | {v['calls']} | {v['format_error_rate']:.3f} | {v['local_reward']:+.3f} | "
                     f"{v['answer_tokens']:.1f} | {v['distinct_first_answers']} of {v['instances']} |")
    lines.append("")
    for r, v in res["per_role"].items():  # answer instances (solved), most common first
        top = ", ".join(f"{text!r} {n} ({solved})" for text, n, solved in v["top_first_answers"])
        lines.append(f"{r}'s most common first answers, instances (solved): {top}  ")
    by_turn = ", ".join(f"{k}: {v:.3f}" for k, v in res["success_by_turn"].items())
    return "\n".join(lines + ["", "success by turn: " + by_turn, ""])


def main(argv):
    cfg, paths = configure(argv)
    task, workflow = cfg["task"], cfg["workflow"]
    E.set_timeouts(cfg["tool_timeout"], cfg["test_timeout"])
    files = [f for f in cfg["files"].split(",") if f] or None
    if cfg["search_test"]:
        files = [cfg["search_test"]]
    search = retrieval.settings(cfg)
    test_envs = E.test_set(task, n=cfg["eval_n"], compact=cfg["compact"], workflow=workflow, files=files,
                           limit=cfg["limit"] or None, team=config.parse_team(cfg), turns=cfg["eval_turns"],
                           search=search)

    agents = load_agents(cfg, paths)
    res = evaluate(test_envs, agents, cfg["eval_turns"], cfg["role_eval_sampling"], k=cfg["eval_k"],
                   progress=True)
    sampling = "greedy" if cfg["eval_temperature"] == 0 else f"T={cfg['eval_temperature']}"
    protocol = (f"{task}, {workflow}, {sampling}, k={cfg['eval_k']}, turns={cfg['eval_turns']}, "
                f"n={res['n']}")
    res.update(task=task, workflow=workflow, policies=paths, protocol=protocol)
    md = markdown(res, f"{task} ({protocol}); " + ", ".join(f"{r}={p}" for r, p in paths.items()))
    print(md)
    if cfg["out"]:
        stem = cfg["out"].removesuffix(".json")
        os.makedirs(os.path.dirname(os.path.abspath(stem)), exist_ok=True)
        with open(stem + ".json", "w") as f:
            json.dump(res, f, indent=2)
        with open(stem + ".md", "w") as f:
            f.write(md)
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
