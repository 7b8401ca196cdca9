"""
Grouping, advantages and the PPO-clip loss for multi-agent GRPO. Pure functions; imports torch only.

The three algorithms differ only in two things, both visible in `KEYS` below:
  which samples share a baseline (the group key), and what scalar is normalized inside the group.

    algo      group key                 normalized value                      statistics over
    at_grpo   (env, agent, turn)        the call's reward a*team + local      the K sibling candidates (tree)
    grpo      (env,)                    the agent's trajectory return         the K trajectories x agents
    dr_mas    (env, agent)              the call's reward a*team + local      that agent's calls, all turns, K trajectories

    A = (x - mean(x)) / (std(x) + 1e-6)       std: population std over the group's units
    A = x - mean(x)                           scale="none" (Dr. GRPO; TRL scale_rewards="none", verl
                                              norm_adv_by_std_in_grpo=False): a group whose rewards differ by
                                              0.01 is not blown up to the same +-1 as one that differs by 10
    A = (x - mean(x)) / (std_batch + 1e-6)    scale="batch" (TRL scale_rewards="batch"; "Lite PPO", Liu et al.
                                              2025): the group's mean, one std over every unit of the step on
                                              every rank, so advantages keep a unit scale without that blow-up
    A = (x - mean(x)) / (max(std, floor) + 1e-6)   std_floor > 0 (with group or batch): a std under the floor is
                                              taken as the floor, so a group whose rewards differ by a wall bump
                                              (0.1) is not blown up to +-1.7 while one that differs by reaching
                                              the goal (std ~0.5-1) keeps the paper's unit scale

For `grpo` the return of a sample is the sum of its own agent's per-call rewards over its trajectory (team term
included), and a group's statistics are taken over the distinct (trajectory, agent) returns, so a trajectory is
not counted once per turn. One baseline across agents with different reward scales is exactly what Dr. MAS fixes.
"""
import functools
import math
from collections import defaultdict
from dataclasses import dataclass

import torch

# -----------------------------------------------------------------------------
# groups and advantages

KEYS = {
    "at_grpo": lambda s: (s.env, s.role, s.turn),
    "grpo": lambda s: (s.env,),
    "dr_mas": lambda s: (s.env, s.role),
}
VALUE = {  # (unit, value): statistics are over distinct units
    "at_grpo": lambda s: (id(s), s.reward),
    "grpo": lambda s: ((s.traj, s.role), s.ret),
    "dr_mas": lambda s: (id(s), s.reward),
}


def compute_advantages(samples, algo, drop_zero_var=False, scale="group", all_sum=lambda v: v, eps=1e-6, std_floor=0.0):
    """Sets s.adv on every sample; returns (kept samples, diagnostics). The one explicit dict-keyed loop.
    `scale`: "group" divides by the group's std (GRPO), "none" only subtracts its mean (Dr. GRPO), "batch" divides by
    the std of every unit of the step; `all_sum` sums a list of floats over ranks (each rank holds its own envs);
    `std_floor`: the least std either divides by, in reward units (0 = the paper)."""
    if algo not in KEYS:
        raise ValueError(f"unknown algo {algo!r}: use --algo at_grpo, grpo or dr_mas")
    if scale not in ("group", "none", "batch"):
        raise ValueError(f"unknown scale {scale!r}: use --scale_rewards group, none or batch")
    if not std_floor >= 0.0:
        raise ValueError(f"std_floor {std_floor!r} must be >= 0: use --std_floor 0 (off) or a reward-unit floor such as 0.25")
    groups = defaultdict(list)
    for s in samples:
        groups[KEYS[algo](s)].append(s)
    units = {key: list(dict(VALUE[algo](s) for s in g).values()) for key, g in groups.items()}
    batch_sd = 0.0
    if scale == "batch":  # population std of every unit's value on every rank
        vals = [v for x in units.values() for v in x]
        n, s1, s2 = all_sum([float(len(vals)), sum(vals), sum(v * v for v in vals)])
        batch_sd = math.sqrt(max(0.0, s2 / max(n, 1.0) - (s1 / max(n, 1.0)) ** 2))
    kept, zero_var, sizes = [], 0, []
    for key, g in groups.items():
        x = units[key]
        mu = sum(x) / len(x)
        sd = math.sqrt(sum((v - mu) ** 2 for v in x) / len(x))
        sizes.append(len(g))
        if sd < 1e-12:
            zero_var += 1
        div = 1.0 if scale == "none" else max(sd if scale == "group" else batch_sd, std_floor) + eps
        for s in g:
            s.adv = (VALUE[algo](s)[1] - mu) / div
        if not (drop_zero_var and sd < 1e-12):
            kept += g
    diag = {"groups": len(groups), "zero_var_frac": zero_var / max(1, len(groups)),
            "group_size": sum(sizes) / max(1, len(sizes)), "dropped": len(samples) - len(kept)}
    advs = [s.adv for s in kept]
    if advs:
        m = sum(advs) / len(advs)
        diag.update(adv_mean=m, adv_std=math.sqrt(sum((a - m) ** 2 for a in advs) / len(advs)))
    return kept, diag


def trajectory_returns(samples):
    """s.ret = sum of the rewards of s's agent in s's trajectory (for algo=grpo)."""
    tot = defaultdict(float)
    for s in samples:
        tot[(s.env, s.traj, s.role)] += s.reward
    for s in samples:
        s.ret = tot[(s.env, s.traj, s.role)]


def by_agent_turn(samples):
    """Mean reward per agent and per (agent, turn): the per-agent / per-turn diagnostics."""
    acc = defaultdict(list)
    for s in samples:
        acc[s.role].append(s.reward)
        acc[f"{s.role}@t{s.turn}"].append(s.reward)
    return {k: sum(v) / len(v) for k, v in sorted(acc.items())}


# -----------------------------------------------------------------------------
# the training batch: samples -> mini-batches (one optimizer step each) -> rows -> micro-batches -> tensors


@dataclass
class Row:
    """One row of a training micro-batch. Plain: one sample, its prompt then its response. Packed (`--pack`): samples
    that share a prompt (AT-GRPO's K siblings share it by construction) in one row: the prompt once, then each response
    in its own segment, which sees the prompt and itself only, with positions that continue from the prompt's end, so
    every response token has exactly the context it was sampled with and the prompt is trained once, not K times.
    `sel` are the positions whose next-token distribution scores each target (the prompt's last position for every
    response's first token); per target: `tgt`, `adv`, `slp` (the sampler's log-prob)."""
    ids: list
    pos: list
    seg: list  # 0: prompt; k + 1: response k (its last token is a target only, never an input)
    sel: list
    tgt: list
    adv: list
    slp: list
    old: object = None  # pi_old's log-probs of `tgt` (a tensor), when the step has several mini-batches


def make_rows(samples, pack):
    groups = {}
    for s in samples:
        if s.response_ids:
            groups.setdefault(tuple(s.prompt_ids) if pack else id(s), []).append(s)
    rows = []
    for g in groups.values():
        p = len(g[0].prompt_ids)
        r = Row(list(g[0].prompt_ids), list(range(p)), [0] * p, [], [], [], [])
        for k, s in enumerate(g):
            n, start = len(s.response_ids), len(r.ids)
            r.ids += s.response_ids[:-1]
            r.pos += range(p, p + n - 1)
            r.seg += [k + 1] * (n - 1)
            r.sel += [p - 1] + list(range(start, start + n - 1))
            r.tgt += s.response_ids
            r.adv += [s.adv] * n
            r.slp += s.sampler_logprobs
        rows.append(r)
    return rows


def split_minibatches(samples, n_mini, how):
    """The samples of each optimizer step. strided: sample i goes to mini-batch i mod n, so a tree group's K siblings
    spread over the mini-batches and every step sees every env. groups: a group of samples that share a prompt
    (AT-GRPO's K siblings) stays in one mini-batch, groups dealt round-robin; packing needs this (siblings must meet
    in a row), and verl does the same in effect: its rollouts repeat each prompt's n responses contiguously
    (`repeat(interleave=True)`) and its mini-batches are contiguous slices (verl `workers/actor/dp_actor.py`)."""
    if how == "strided":
        return [samples[i::n_mini] for i in range(n_mini)]
    groups = {}
    for s in samples:
        groups.setdefault(tuple(s.prompt_ids), []).append(s)
    chunks = [[] for _ in range(n_mini)]
    for i, g in enumerate(groups.values()):
        chunks[i % n_mini] += g
    return chunks


def micro_batches(rows, budget, all_max=lambda n: n):
    """Greedy packing of rows by padded token count, longest first; then padded with zero-weight DUMMY micro-batches
    to the most any rank has (`all_max` over ranks): every rank runs the same number of FSDP forwards."""
    rows = sorted(rows, key=lambda r: -len(r.ids))
    out, cur = [], []
    for r in rows:
        if cur and (len(cur) + 1) * len(cur[0].ids) > budget:
            out.append(cur)
            cur = []
        cur.append(r)
    out += [cur] if cur else []
    return out + [[DUMMY]] * (all_max(len(out)) - len(out))


def collate(mb, device, flex=None):
    """Right-padded tensors of a micro-batch. The attention mask is None (plain causal) unless a row is packed
    (`packed_mask`)."""
    B, T, N = len(mb), max(len(r.ids) for r in mb), max(len(r.tgt) for r in mb)
    packed = any(max(r.seg) > 1 for r in mb)
    flex = packed and (device.type == "cuda" if flex is None else flex)
    if flex:  # whole 128-blocks: below 128 query rows torch 2.11 lowers flex to its decoding kernel, which found no
        T = -(-T // 128) * 128  # valid config for a GQA training batch (H100); 128 is flex's block size anyway
    ids, pos, seg = torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T, dtype=torch.long), torch.full((B, T), -1)
    sel, tgt = torch.zeros(B, N, dtype=torch.long), torch.zeros(B, N, dtype=torch.long)
    w, adv, slp = torch.zeros(B, N), torch.zeros(B, N), torch.zeros(B, N)
    old = torch.zeros(B, N) if mb[0].old is not None else None
    for b, r in enumerate(mb):
        ids[b, :len(r.ids)], pos[b, :len(r.ids)], seg[b, :len(r.ids)] = torch.tensor(r.ids), torch.tensor(r.pos), torch.tensor(r.seg)
        n = len(r.tgt)
        sel[b, :n], tgt[b, :n], w[b, :n] = torch.tensor(r.sel), torch.tensor(r.tgt), float(r is not DUMMY)
        adv[b, :n], slp[b, :n] = torch.tensor(r.adv, dtype=torch.float32), torch.tensor(r.slp, dtype=torch.float32)
        if old is not None:
            old[b, :n] = r.old
    attn = packed_mask(seg, device, flex) if packed else None
    dev = [x.to(device) for x in (ids, pos, sel, tgt, w, adv, slp)]
    return Batch(*dev[:3], attn, *dev[3:], None if old is None else old.to(device))


@functools.cache
def _block_mask_builder(compiled):
    """create_block_mask, compiled once (CUDA): eager, it evaluates the mask on the dense B x T x T grid; compiled, it
    works block by block (torchtitan `torchtitan/models/attention.py` compiles it for the same reason). CPU tests
    run it eagerly."""
    from torch.nn.attention.flex_attention import create_block_mask
    return torch.compile(create_block_mask) if compiled else create_block_mask


def packed_mask(seg, device, flex):
    """Who sees whom in packed rows (`seg`: 0 prompt, k response k, -1 padding): causal, and a key is visible if it is
    in the prompt or in the query's own segment (a pad query sees the pads before it, so no row is empty).
    On CUDA a flex-attention BlockMask: it stores which 128x128 blocks are empty, full or partial, so at the paper's
    lengths (~1k prompt + K x 2k) the kernel skips the siblings' blocks and no dense mask exists (a dense bool one
    would be 81 MB per row). On CPU a dense [B, 1, T, T] bool mask for SDPA (flex has no CPU backward), ~10 KB
    per row at the CPU default's ~100 tokens."""
    T = seg.shape[1]
    if flex:
        sg = seg.to(device)

        def visible(b, h, q, k):
            return (k <= q) & ((sg[b, k] == 0) | (sg[b, k] == sg[b, q]))
        return _block_mask_builder(torch.device(device).type == "cuda")(visible, seg.shape[0], None, T, T, device=device)
    i = torch.arange(T)
    sq, sk = seg[:, :, None], seg[:, None, :]
    return ((i[None, :] <= i[:, None]) & ((sk == 0) | (sk == sq)))[:, None].to(device)


@dataclass
class Batch:
    ids: torch.Tensor
    pos: torch.Tensor
    sel: torch.Tensor
    attn: object  # None (causal), a [B, 1, T, T] bool mask or a flex BlockMask (packed rows, packed_mask)
    tgt: torch.Tensor
    w: torch.Tensor    # 1 for a real target, 0 for padding
    adv: torch.Tensor
    slp: torch.Tensor
    old: object  # pi_old's log-probs [B, N], or None: pi_old is the current policy (one mini-batch per step)


DUMMY = Row([0, 0], [0, 1], [0, 0], [0], [0], [0.0], [0.0])  # a zero-weight row: keeps every rank's FSDP collectives in step


# -----------------------------------------------------------------------------
# the PPO-clip loss

LOG_RATIO_CLAMP = 20.0  # |log pi/pi_old| above this is clamped (verl `verl/trainer/ppo/core_algos.py`: [-20, 20])


def ppo_loss(logp, old_logp, adv, mask, n_tokens, eps_low=0.2, eps_high=0.2, dual_clip=3.0, ref_logp=None, kl_coef=0.0,
             sampler_logp=None, tis_cap=0.0, entropy=None, entropy_coef=0.0):
    """Token-level PPO-clip with dual clip, summed and divided by `n_tokens` (the response-token count of the
    whole optimizer step across all ranks), so the gradient does not depend on how samples are split into
    micro-batches or ranks. Shapes: logp/old_logp/mask/ref_logp/sampler_logp [B, T], adv [B] (one per row) or [B, T]
    (one per token: a packed row holds several samples). Returns (loss, stats).

    Truncated importance sampling (`tis_cap` C > 0): the tokens were sampled by the engine (bf16 vLLM on GPU), not by
    the trainer's pi_old, so each token's PPO term is weighted by min(exp(old_logp - sampler_logp), C), a constant
    (no gradient). On GPU the two differ by ~1e-2 nats per token (bf16 kernels); on the fp32 CPU path the weight is
    1 to ~1e-7. As trl (`vllm_importance_sampling_correction`, cap 2 by default), OpenRLHF (`enable_vllm_is_correction`)
    and verl (TIS, verl#2953) do.

    Entropy bonus (`entropy` [B, T], each position's full-vocabulary entropy, with gradient; `entropy_coef` > 0): each
    token's loss minus entropy_coef x entropy, token-mean like the rest (verl `workers/actor/dp_actor.py`: the policy
    loss minus `entropy_coeff` x the aggregated entropy). It keeps the sampler's siblings diverse where the policy would
    otherwise turn deterministic (identical siblings = a zero-variance group, no signal)."""
    adv = adv if adv.dim() == 2 else adv[:, None]
    log_ratio = logp - old_logp
    clamped = log_ratio.detach().abs() > LOG_RATIO_CLAMP
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # verl clamps it: one overflow never NaNs a step
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1 - eps_low, 1 + eps_high)
    pg = torch.maximum(pg1, pg2)
    if dual_clip:  # negative advantages: cap the loss at -c*A so a huge ratio cannot blow up the update
        pg = torch.where(adv < 0, torch.minimum(pg, -dual_clip * adv), pg)
    if tis_cap and sampler_logp is not None:
        pg = pg * torch.exp(old_logp - sampler_logp).clamp(max=tis_cap).detach()
    tok = pg
    kl = torch.zeros_like(logp)
    if ref_logp is not None:  # k3 estimator of KL(pi || ref): exp(r) - r - 1 >= 0, r = ref - logp
        r = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        kl = torch.exp(r) - r - 1
        tok = tok + kl_coef * kl
    if entropy is not None and entropy_coef:
        tok = tok - entropy_coef * entropy
    m = mask.float()
    loss = (tok * m).sum() / n_tokens
    with torch.no_grad():
        clipped = ((pg2 > pg1) & (m > 0)).float().sum()
        stats = {"clip_tokens": clipped.item(), "kl_sum": (kl * m).sum().item(), "tokens": m.sum().item(),
                 "clamped_tokens": (clamped & (m > 0)).float().sum().item(),
                 "entropy_sum": (entropy * m).sum().item() if entropy is not None else 0.0}
    return loss, stats
