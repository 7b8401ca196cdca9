"""
The step's log: this rank's share of a step (StepStats), gathered over ranks into one
metrics.jsonl record, and the one line train.py prints per step.
"""
from collections import Counter
from dataclasses import dataclass

import common as C
import envs as E
import grpo_mas as G
import threads


@dataclass
class StepStats:
    """This rank's share of a step, gathered over ranks into the step's record."""
    success: float       # episodes that ended in success / episodes
    samples: int         # generated
    trained_samples: int
    rollouts: int
    loss: float          # summed over the policies' updates
    response_tokens: int
    formatted: int       # samples whose answer parsed
    rewards: dict        # mean reward per role and per role@turn (grpo_mas.by_agent_turn)
    calls: dict          # model calls per role (agents may speak a different number of times)
    tokens: dict         # response tokens per role
    zero_var_frac: float
    group_size: float
    counts: dict         # the env's counters (envs.COUNTERS)
    seconds: dict        # gen, env (the rollouts), train, sync, step
    mem: dict            # CUDA: the allocator's peak per phase, GiB


def rank_stats(cfg, batch, samples, groups, updates, clock):
    """This rank's StepStats: the rewards and tokens of every sample generated; the freeze (groups
    without a signal) over every group generated, with DAPO's refill as without it."""
    generated = batch.generated
    zero_var = batch.refill_zero_var if cfg["dynamic_sampling"] else groups.zero_var_frac
    calls = Counter(s.role for s in generated)
    tokens = {r: sum(len(s.response_ids) for s in generated if s.role == r) for r in calls}
    return StepStats(
        success=batch.success, samples=len(generated), trained_samples=len(samples),
        rollouts=batch.rollouts, loss=sum(u.loss for u in updates),
        response_tokens=sum(len(s.response_ids) for s in generated),
        formatted=sum(s.formatted for s in generated), rewards=G.by_agent_turn(generated),
        calls=calls, tokens=tokens, zero_var_frac=zero_var, group_size=groups.group_size,
        counts=batch.counts,
        seconds=dict(gen=batch.seconds.get("gen", 0.0), env=batch.seconds.get("env", 0.0),
                     train=clock.seconds["train"], sync=clock.seconds["sync"],
                     step=clock.elapsed()),
        mem={f"mem_{phase}": gib for phase, gib in clock.peak_gib.items()})


def step_record(cfg, step, roles, trained, mine, updates, opts, dlogp_hist, master, schedule):
    """The step's metrics, summed or averaged over ranks. |dlogp| (sampler vs trainer log-probs) is
    the stale-sync alarm: bf16 vLLM against the trainer sits near 1e-2 on GPU (fp32 CPU: 1e-7), so
    only a jump against this run's own recent level means something (an engine that stopped
    receiving weights)."""
    ranks = C.gather(mine)
    world = len(ranks)
    n_samples = sum(r.samples for r in ranks)
    rec = {"step": step + 1,
           "success": sum(r.success for r in ranks) / world,
           "samples": n_samples,
           "samples_per_rank": [r.samples for r in ranks],
           "loss": sum(r.loss for r in ranks),
           "format_ok": sum(r.formatted for r in ranks) / max(1, n_samples),
           "resp_tokens": sum(r.response_tokens for r in ranks),
           "lr_factor": schedule.factor(step),  # train.Schedule
           "lr_steps": schedule.steps}
    for name in mine.counts:  # the env's own counters (envs.COUNTERS)
        rec[name] = sum(r.counts[name] for r in ranks)
        if rec[name] and name in E.ALARMS and master:
            print(f"warning: {rec[name]} {E.ALARMS[name]}", flush=True)
    for role in roles:
        vals = [r.rewards[role] for r in ranks if role in r.rewards]
        rec[f"reward_{role}"] = sum(vals) / max(1, len(vals))
        rec[f"calls_{role}"] = sum(r.calls.get(role, 0) for r in ranks)
        rec[f"tokens_{role}"] = sum(r.tokens.get(role, 0) for r in ranks)
    rec["zero_var_frac"] = sum(r.zero_var_frac for r in ranks) / world
    rec["group_size"] = sum(r.group_size for r in ranks) / world
    summed = ("tokens", "clip_tokens", "clamped_tokens", "dlogp", "kl_sum", "entropy_sum", "sampled_nll",
              "trained_tokens")
    rec["trained_tokens"] = 0.0
    for p, u in enumerate(updates):
        tot = dict(zip(summed, C.all_sum([getattr(u, k) for k in summed])))
        tokens = max(1, tot["tokens"])
        rec["trained_tokens"] += tot["trained_tokens"]
        rec[f"clip_frac_p{p}"] = tot["clip_tokens"] / tokens
        rec[f"dlogp_p{p}"] = tot["dlogp"] / tokens
        rec[f"clamped_p{p}"] = int(tot["clamped_tokens"])
        # the sampled tokens' mean -log p: a one-sample estimate of the per-token entropy at the
        # sampling temperature, free (the sampler returned it); a freeze drives it toward 0
        rec[f"nll_p{p}"] = tot["sampled_nll"] / tokens
        recent = sorted(dlogp_hist[p][-10:])
        median = recent[len(recent) // 2] if recent else 0.0
        jump = bool(recent) and rec[f"dlogp_p{p}"] > max(1e-5, 3 * median)
        rec[f"dlogp_jump_p{p}"] = jump
        dlogp_hist[p].append(rec[f"dlogp_p{p}"])
        if jump and master:
            print(f"warning: policy {p}'s sampler/trainer |dlogp| jumped to {rec[f'dlogp_p{p}']:.1e} "
                  f"(recent median {median:.1e}): is the engine receiving the weights?", flush=True)
        rec[f"grad_norm_p{p}"] = u.grad_norm
        rec[f"opt_steps_p{p}"] = u.opt_steps  # the same on every rank
        rec[f"skipped_p{p}"] = u.skipped
        rec[f"lr_p{p}"] = opts[p].param_groups[0]["lr"]
        if cfg["kl_coef"]:
            rec[f"kl_p{p}"] = tot["kl_sum"] / tokens
        if cfg["entropy_coef"]:  # mean full-vocabulary entropy over the trained tokens (nats)
            rec[f"entropy_p{p}"] = tot["entropy_sum"] / tokens
    if len(trained) < len(roles):
        rec["trained_roles"] = sorted(trained)
    if cfg["dynamic_sampling"]:
        rec["rollouts"] = sum(r.rollouts for r in ranks) / world
        rec["trained_samples"] = sum(r.trained_samples for r in ranks)
    rec.update({f"t_{k}": v for k, v in mine.seconds.items()})  # rank 0's own clock
    rec["load_per_core"] = round(threads.load_per_core(), 2)  # rank 0's machine: shared or not
    if C.DEVICE.type == "cuda":  # the allocator's peak per phase, the largest over ranks (GiB)
        for k in mine.mem:
            rec[k] = max(r.mem[k] for r in ranks)
    return rec


def step_line(rec, roles, n_policies, eta):
    """The one printed line per step."""
    rewards = " ".join(f"r_{r} {rec[f'reward_{r}']:+.2f} ({rec[f'calls_{r}']})" for r in roles)
    per_policy = " ".join(f"p{p} clip {rec[f'clip_frac_p{p}']:.3f} gn {rec[f'grad_norm_p{p}']:.2f} "
                          f"|dlogp| {rec[f'dlogp_p{p}']:.1e}" for p in range(n_policies))
    if "trained_roles" in rec:
        rewards += " | trains " + ",".join(rec["trained_roles"])
    if "rollouts" in rec:  # --dynamic_sampling
        rewards += f" | rollouts {rec['rollouts']:.1f} trains {rec['trained_samples']} smp"
    line = (f"step {rec['step']:4d} | succ {rec['success']:.2f} {rewards} | fmt {rec['format_ok']:.2f} "
            f"zv {rec['zero_var_frac']:.2f} | {per_policy} | {rec['samples']} smp {rec['resp_tokens']} tok | "
            f"gen {rec['t_gen']:.1f}s env {rec['t_env']:.1f}s train {rec['t_train']:.1f}s "
            f"sync {rec['t_sync']:.1f}s")
    skipped = sum(rec[f"skipped_p{p}"] for p in range(n_policies))
    if skipped:
        line += f" | {skipped} non-finite optimizer steps skipped"
    if "mem_train" in rec:
        line += f" | GiB gen {rec['mem_rollout']:.1f} train {rec['mem_train']:.1f} sync {rec['mem_sync']:.1f}"
    return line + f" | eta {eta / 60:.1f}m"
