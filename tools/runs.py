"""
Tables and curves of train.py runs (lab tooling: it reads run folders, never trains).

    python tools/runs.py --summary runs/a-s0 runs/a-s1 runs/b-s0 runs/b-s1   # seeds grouped by configuration
    python tools/runs.py --summary runs/a-s0 runs/b-s0 --at_step 100           # step-matched (runs of different speeds)
    python tools/runs.py --plot runs/default runs/grpo --out curves.png        # curves from metrics.jsonl
    python tools/runs.py --plot runs/a-s0 runs/b-s0 --at_step 100 --x steps    # curves against the step
    python tools/runs.py --plot runs/a-s0 runs/b-s0 --x tokens                 # against the tokens generated so far
    python tools/runs.py --summary runs/a-s0 runs/b-s0 --at_tokens 50000       # token-matched (budgets per step differ)
    python tools/runs.py --grad_spikes runs/a-s0 runs/b-s0                     # max / median grad norm per policy
    python tools/runs.py --targets runs/a-s0 runs/a-s1 --slower 2.5            # the README's three targets per run,
                                                                               # as on a machine 2.5x slower
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def plot(run_dirs, out_png, x="minutes", at_step=None, at_tokens=None):
    """Training curves of one or several runs (ablations side by side) from their metrics.jsonl. Runs of one
    configuration (seeds) share a colour in the held-out panel: each seed faint, their mean bold. x: "minutes"
    (wall clock), "steps" (runs made on different machines or core counts line up by step) or "tokens" (response
    tokens generated so far: schemes that spend different budgets per step line up by what they spent); at_step: as
    summary's; at_tokens: as summary's."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [("eval_success", "held-out success (greedy)"), ("reward", "train reward per agent"),
              ("dlogp", "sampler vs trainer |dlogp|"), ("grad_norm", "grad norm")]
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.2))
    if x not in ("minutes", "steps", "tokens"):
        raise SystemExit(f"--x {x!r}: minutes, steps or tokens")
    groups = group_runs(run_dirs, need_config=False, at_step=at_step, at_tokens=at_tokens)
    spent = {d: tokens_spent(rec) for runs in groups.values() for d, rec in runs}
    xof = {"minutes": lambda d, r: r.get("time", 0) / 60, "steps": lambda d, r: r["step"],
           "tokens": lambda d, r: spent[d][r["step"]]}[x]
    for n, (label, runs) in enumerate(groups.items()):
        color = f"C{n % 10}"
        curves = [[(r["step"], xof(d, r), r["eval_success"]) for r in rec if "eval_success" in r] for d, rec in runs]
        if len(runs) == 1:  # one run: its own curve
            axes[0].plot(
                [m for _, m, _ in curves[0]], [y for _, _, y in curves[0]], marker="o", color=color, label=label
            )
        else:  # several seeds: each faint, their mean (at the steps all evaluated) bold
            for c in curves:
                axes[0].plot([m for _, m, _ in c], [y for _, _, y in c], color=color, alpha=0.3, linewidth=1)
            mc = mean_curve(curves)
            axes[0].plot(
                [m for m, _ in mc],
                [y for _, y in mc],
                color=color,
                linewidth=2.5,
                label=f"{label} (mean of {len(runs)})",
            )
    # the records group_runs read (and cut at at_step); each run in its configuration's colour (as
    # in the held-out panel), each agent or policy a line style: runs of several tasks stay readable
    styles = ["-", "--", ":", "-."]
    coloured = [(f"C{n % 10}", d, rec) for n, runs in enumerate(groups.values()) for d, rec in runs]
    for color, d, rec in coloured:
        name = os.path.basename(os.path.normpath(d))
        # the panel, its keys' prefix, where a key's label starts (the agent; the policy, "p0")
        panels_of_run = ((axes[1], "reward_", 7), (axes[2], "dlogp_p", 6), (axes[3], "grad_norm_p", 10))
        for ax, prefix, cut in panels_of_run:
            keys = sorted({k for r in rec for k in r if k.startswith(prefix)})
            for i, key in enumerate(keys):
                v = [(xof(d, r), r[key]) for r in rec if key in r]
                ys = [max(y, 1e-12) if prefix == "dlogp_p" else y for _, y in v]
                draw = ax.semilogy if prefix == "dlogp_p" else ax.plot
                draw([x for x, _ in v], ys, color=color, linestyle=styles[i % 4], alpha=0.7,
                     label=f"{name} {key[cut:]}")
    for ax, (_, title) in zip(axes, panels):
        ax.set_title(title)
        ax.set_xlabel({"minutes": "wall-clock minutes", "steps": "training step", "tokens": "response tokens"}[x])
        ax.grid(alpha=0.3)
        if 0 < len(ax.get_legend_handles_labels()[0]) <= 12:  # none for an empty panel, or one too long to read
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    return out_png


def read_metrics(d):
    """A run directory's records; a path that is not one (a log file given by a glob) stops in one line."""
    path = os.path.join(d, "metrics.jsonl")
    if not os.path.isfile(path):
        raise SystemExit(f"{d!r} is not a train.py run directory (no metrics.jsonl in it)")
    return [json.loads(line) for line in open(path) if line.strip()]


def tokens_spent(rec):
    """{step: response tokens generated up to and including that step} from a run's metrics records."""
    spent, total = {}, 0
    for r in sorted(rec, key=lambda r: r["step"]):
        total += r.get("resp_tokens", 0)
        spent[r["step"]] = total
    return spent


RUN_LENGTH = ("stop_step", "time_limit_min")  # where a run stops: with at_step they do not tell configurations apart


def flag_defaults():
    """train.py's defaults of the flags that have no preset (a run folder from before a flag was added lacks it)."""
    import train as T
    return dict(T.FLAGS)


def preset_keys():
    """The values a preset sets, and those resolved from them (each role's sampling settings, the split --pack sets)."""
    import train as T
    return {k for p in T.PRESETS.values() for k in p} | {"role_sampling", "role_eval_sampling", "split"}


def num(x, spec=".2f"):
    """A number for a table, or "-" where a run has none (no evaluation, no step: nan)."""
    return "-" if x != x else format(x, spec)


def group_runs(run_dirs, need_config=True, at_step=None, at_tokens=None):
    """{label: [(run dir, metrics records)]}: runs grouped by configuration (config.json without the seed and
    out_dir), labelled by the config values that differ between the runs given. A run without config.json (only
    allowed with need_config=False) is a group of its own, labelled by its directory name. at_step: keep each run's
    records up to that step only (step-matched comparisons of runs of different lengths or speeds); every run must
    have reached it, and then the settings that only say where a run stops (RUN_LENGTH) are not configuration.
    at_tokens: the same, each run cut at its last step within that many response tokens generated (schemes that
    spend different budgets per step compared at one budget)."""
    runs, defaults = [], flag_defaults()
    matched = at_step is not None or at_tokens is not None
    for d in run_dirs:
        cpath, mpath = os.path.join(d, "config.json"), os.path.join(d, "metrics.jsonl")
        if not os.path.exists(mpath) or (need_config and not os.path.exists(cpath)):
            raise SystemExit(f"{d!r} is not a train.py run directory (config.json and metrics.jsonl)")
        cfg = None
        if os.path.exists(cpath):
            skip = ("seed", "out_dir", "resume", "resolved_policies", "role_defaults") + (RUN_LENGTH if matched else ())
            # a flag missing from an older run's config.json was added after it, with the old behaviour as its default
            cfg = {k: v for k, v in {**defaults, **json.load(open(cpath))}.items() if k not in skip}
        rec = read_metrics(d)
        if matched:
            rec = cut_at(d, rec, at_step, at_tokens)
        runs.append((d, cfg, rec))
    cfgs = [c for _, c, _ in runs if c is not None]
    varying = sorted({k for c in cfgs for k in c if any(c.get(k) != c2.get(k) for c2 in cfgs)})
    if "preset" in varying:  # runs of different tasks: the preset names what it sets (readable)
        varying = [k for k in varying if k not in preset_keys()]
    groups = {}
    for d, c, rec in runs:
        label = os.path.basename(os.path.normpath(d)) if c is None else (
            " ".join(f"--{k} {c.get(k)}" for k in varying) or "(one configuration)")
        groups.setdefault(label, []).append((d, rec))
    return groups


def cut_at(d, rec, at_step, at_tokens):
    """Run d's records up to step at_step, then up to its last step within at_tokens response tokens; an error
    naming the fix if the run stopped short of either."""
    if at_step is not None:
        last = max((r["step"] for r in rec), default=0)
        if last < at_step:
            raise SystemExit(f"{d!r} stopped at step {last}, before --at_step {at_step}: give a smaller "
                             "--at_step or drop the run")
        rec = [r for r in rec if r["step"] <= at_step]
    if at_tokens is not None:
        spent = tokens_spent(rec)
        total = max(spent.values(), default=0)
        if total < at_tokens:
            raise SystemExit(f"{d!r} generated {total} tokens, fewer than --at_tokens {at_tokens}: give a smaller "
                             "--at_tokens or drop the run")
        first = min((tokens for step, tokens in spent.items() if step >= 1), default=0)
        if first > at_tokens:  # not one training step fits: nothing to compare at this budget
            raise SystemExit(f"{d!r} generated {first} tokens in its first step, more than "
                             f"--at_tokens {at_tokens}: give --at_tokens {first} or more")
        last = max(step for step, tokens in spent.items() if tokens <= at_tokens)
        rec = [r for r in rec if r["step"] <= last]
    return rec


def mean_curve(curves):
    """Seeds' held-out curves [(step, minutes, success)] -> [(mean minutes, mean success)] at the steps every seed
    evaluated (seeds run at different speeds, so steps, not minutes, line them up)."""
    common = set.intersection(*[{st for st, _, _ in c} for c in curves])
    out = []
    for st in sorted(common):
        pts = [next((m, y) for s2, m, y in c if s2 == st) for c in curves]
        out.append((sum(m for m, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)))
    return out


def upper_median(xs):
    """The middle value (the upper one of an even count: always a value that occurred); nan for none."""
    return sorted(xs)[len(xs) // 2] if xs else float("nan")


def reached(ev, threshold):
    """(index of the first evaluation >= threshold, the lowest from there on) over [(x, held-out)];
    (None, nan) where none reaches it."""
    hit = next((i for i, (_, y) in enumerate(ev) if y >= threshold), None)
    return hit, float("nan") if hit is None else min(y for _, y in ev[hit:])


def summary(run_dirs, threshold=0.8, at_step=None, at_tokens=None):
    """Markdown table of train.py runs grouped by configuration (config.json without the seed and out_dir), one row
    per group: seeds, steps, median seconds per step, median samples (trained calls) per step (the cost that does not
    depend on the machine), the untrained model's held-out success (the step-0 evaluation),
    final held-out success as mean [min-max] over seeds and its ratio to the untrained one, best, the
    training minutes at which each seed first reached `threshold`, and each seed's lowest evaluation after that
    (does it stay learned?). Labels are the config values that differ between the runs given. at_step: every
    column as of that step ("final" = the evaluation at it), for runs of different lengths or speeds, and the first
    time at `threshold` as a step (minutes are not comparable between runs on different machines or core counts).
    at_tokens: the same at one budget of response tokens ("final" = the last evaluation within it); a column says
    each configuration's response tokens per step."""
    runs = group_runs(run_dirs, at_step=at_step, at_tokens=at_tokens)
    groups = {label: [rec for _, rec in group] for label, group in runs.items()}
    by_step = at_step is not None or at_tokens is not None
    lines = [
        "| configuration | seeds | steps | s/step | samples/step | untrained (step 0), mean "
        "| final held-out, mean [min-max] | final / untrained | best (mean) "
        f"| first >= {threshold} ({'step' if by_step else 'min'}, per seed) | lowest after that (per seed) |"
        + (" tokens/step |" if at_tokens is not None else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if at_tokens is not None else ""),
    ]
    for label, recs in groups.items():
        finals, bases, bests, firsts, lows, steps, sps, smp, tps = [], [], [], [], [], [], [], [], []
        for rec in recs:
            ev = [
                (r["step"] if by_step else r.get("time", 0.0) / 60, r["eval_success"])
                for r in rec
                if "eval_success" in r
            ]
            finals.append(ev[-1][1] if ev else float("nan"))
            bases.append(next((r["eval_success"] for r in rec if r["step"] == 0 and "eval_success" in r), float("nan")))
            bests.append(max((y for _, y in ev), default=float("nan")))
            hit, lowest = reached(ev, threshold)
            if hit is None:
                firsts.append("never")
            else:
                firsts.append(str(ev[hit][0]) if by_step else f"{ev[hit][0]:.1f}")
            lows.append("-" if hit is None else f"{lowest:.2f}")
            steps.append(max((r["step"] for r in rec), default=0))
            sps.append(upper_median([r["t_step"] for r in rec if "t_step" in r]))
            smp.append(upper_median([r["samples"] for r in rec if "samples" in r]))
            tps.append(upper_median([r["resp_tokens"] for r in rec if "resp_tokens" in r]))
        n = len(recs)
        base, final = sum(bases) / n, sum(finals) / n
        ratio = f"{final / base:.1f}x" if base == base and base else "-"  # none without step 0's
        lines.append(
            f"| {label} | {n} | {sum(steps) / n:.0f} | {num(upper_median(sps))} "
            f"| {num(upper_median(smp), '.0f')} | {num(base)} | {num(final)} "
            f"[{num(min(finals))}-{num(max(finals))}] | {ratio} | "
            f"{num(sum(bests) / n)} | {', '.join(firsts)} | {', '.join(lows)} |"
            + (f" {num(upper_median(tps), '.0f')} |" if at_tokens is not None else "")
        )
    return "\n".join(lines)


TARGETS = (0.80, 0.70, 0.90)  # the CPU default's promise (README): reach, never fall below after, end at
TARGET_MINUTES = (10.0, 15.0)  # by minutes: reach 0.80 within the first, read the end at the second
TARGET_STEPS = 0.8  # by step (--at_step N): reach 0.80 by 0.8 N (120 of 150), read the end at step N


def targets(run_dirs, slower=1.0, at_step=None):
    """Each run's three targets as the README reads them: held-out >= 0.80 within 10 minutes, never below 0.70
    after, >= 0.90 at the end (the last evaluation within 15 minutes). slower: the run read as on a machine that
    many times slower, its clock times that (a run's evaluations are its seed's on any machine, only the step its
    clock reaches moves: docs/experiments.md, 2026-12-07), so an alone run stands for a slower machine's; its end
    is read at the last evaluation inside the clock, up to --eval_every steps before a real slower run's last.
    at_step N: by step instead, 0.80 by step 0.8 N and the end at step N."""
    lines = ["| run | steps | first >= 0.80 | lowest after | at the end | targets 1 2 3 |", "|---|---|---|---|---|---|"]
    met = 0
    for d in run_dirs:
        rec = read_metrics(d)
        if at_step is not None:
            rec = cut_at(d, rec, at_step, None)
            reach, where = TARGET_STEPS * at_step, [r["step"] for r in rec]
        else:
            reach, where = TARGET_MINUTES[0], [r.get("time", 0.0) * slower / 60 for r in rec]
            stop = next((i for i, t in enumerate(where) if t >= TARGET_MINUTES[1]), len(rec) - 1)
            rec, where = rec[:stop + 1], where[:stop + 1]  # the clock stops the run after this step
        ev = [(x, r["eval_success"]) for r, x in zip(rec, where) if "eval_success" in r]
        if not ev:
            raise SystemExit(f"{d!r} has no evaluation inside the clock: run it with --eval_every")
        if at_step is None and where[-1] < TARGET_MINUTES[1]:  # its end would be read before the clock's
            raise SystemExit(f"{d!r} stops at {where[-1]:.1f} minutes on the clock x {slower:g}, before "
                             f"{TARGET_MINUTES[1]:g}: read it by step (--at_step N), or as slower (--slower)")
        hit, lowest = reached(ev, TARGETS[0])
        first = hit is not None and ev[hit][0] <= reach
        kept = None if hit is None else lowest >= TARGETS[1]  # "-": never reached
        end = ev[-1][1] >= TARGETS[2]
        met += bool(first and kept and end)
        unit = "step {:d}" if at_step is not None else "{:.1f} min"
        when = "never" if hit is None else unit.format(ev[hit][0])
        verdict = " ".join({None: "-", True: "yes", False: "no"}[ok] for ok in (first, kept, end))
        lines.append(f"| {d} | {rec[-1]['step']} | {when} | {num(lowest)} | {ev[-1][1]:.3f} | {verdict} |")
    how = f"by step {at_step}" if at_step is not None else f"by minutes, the clock x {slower:g}"
    return "\n".join(lines + ["", f"{met} of {len(run_dirs)} meet all three ({how})"])


def grad_spikes(run_dirs, at_step=None, at_tokens=None):
    """Per configuration and policy: the gradient norms' max / median over a run's steps (Dr. MAS's measure of
    spikes), each seed's, and the calls per step of each agent."""
    lines = ["| configuration | policy | max / median grad norm, per seed | median grad norm, per seed |",
             "|---|---|---|---|"]
    groups = group_runs(run_dirs, at_step=at_step, at_tokens=at_tokens)
    for label, runs in groups.items():
        recs = [rec for _, rec in runs]
        policies = sorted({k for rec in recs for r in rec for k in r if k.startswith("grad_norm_p")})
        for key in policies:
            series = [[r[key] for r in rec if key in r] for rec in recs]
            ratio = [max(s) / max(1e-12, upper_median(s)) for s in series if s]
            med = [upper_median(s) for s in series if s]
            lines.append(f"| {label} | {key[len('grad_norm_'):]} | {', '.join(f'{x:.1f}' for x in ratio)} | "
                         f"{', '.join(f'{x:.2f}' for x in med)} |")
    lines += ["", "| configuration | agent | calls per step (median over steps, mean over seeds) | response tokens per "
              "step |", "|---|---|---|---|"]
    for label, runs in groups.items():
        recs = [rec for _, rec in runs]
        agents = sorted({k[len("calls_"):] for rec in recs for r in rec for k in r if k.startswith("calls_")})
        for agent in agents:
            calls = [upper_median([r[f"calls_{agent}"] for r in rec if f"calls_{agent}" in r]) for rec in recs]
            tokens = [upper_median([r[f"tokens_{agent}"] for r in rec if f"tokens_{agent}" in r]) for rec in recs]
            lines.append(f"| {label} | {agent} | {sum(calls) / len(calls):.0f} | {sum(tokens) / len(tokens):.0f} |")
    return "\n".join(lines)


def main(argv):
    """--summary RUN_DIR ... | --plot RUN_DIR ... [--out PNG] [--x minutes|steps|tokens] | --grad_spikes RUN_DIR ...
    | --targets RUN_DIR ... [--slower F]; --at_step N or --at_tokens N for each (--targets: --at_step)."""
    a, i = {"summary": [], "plot": [], "grad_spikes": [], "targets": [], "out": "curves.png", "x": "minutes",
            "at_step": None, "at_tokens": None, "slower": "1"}, 0
    while i < len(argv):
        name = argv[i][2:] if argv[i].startswith("--") else None
        if name not in a:
            raise SystemExit(f"unknown argument {argv[i]!r}: " + main.__doc__)
        if name in ("summary", "plot", "grad_spikes", "targets"):  # every following non-flag argument
            j = i + 1
            while j < len(argv) and not argv[j].startswith("--"):
                j += 1
            a[name], i = argv[i + 1:j], j
            continue
        if i + 1 >= len(argv):
            raise SystemExit(f"--{name} needs a value")
        a[name], i = argv[i + 1], i + 2
    at = {k: None if a[k] is None else int(a[k]) for k in ("at_step", "at_tokens")}
    if a["plot"]:
        return plot(a["plot"], a["out"], x=a["x"], **at)
    if a["summary"]:
        return summary(a["summary"], **at)
    if a["grad_spikes"]:
        return grad_spikes(a["grad_spikes"], **at)
    if a["targets"]:
        try:
            slower = float(a["slower"])
        except ValueError:
            slower = float("nan")
        if not 0 < slower < float("inf"):  # nan fails too
            raise SystemExit(f"--slower {a['slower']!r}: give how many times slower, a number above 0 (2.5)")
        return targets(a["targets"], slower, at["at_step"])
    raise SystemExit(main.__doc__)


if __name__ == "__main__":
    print(main(sys.argv[1:]))
