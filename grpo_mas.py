"""
Grouping, advantages and the PPO-clip loss for multi-agent GRPO. Pure functions; imports torch only.

The four schemes differ in which samples share a baseline (the group key) and what scalar is
normalized inside the group (docs/method.md §4): one entry of the table below (`ALGOS`) each, with
its rollout and the flags it accepts. The first three feed one loop (`compute_advantages`); GiGPO
adds a second level of groups, the calls made from one state, in a function of its own
(`gigpo_advantages`). `advantages` dispatches --algo, with the std schedule, for every scheme.

    algo      group key             normalized value                   statistics over
    at_grpo   (env, agent, turn)    the call's reward a*team + local   the K sibling candidates (tree)
    grpo      (env,)                the agent's trajectory return      the K trajectories x agents
    dr_mas    (env, agent)          the call's reward a*team + local   that agent's calls, all turns, K trajectories
    gigpo     (env, agent) and      the trajectory's total, plus       the agent's calls in K trajectories,
              (env, agent, anchor)  the env step's discounted return   and the calls made from one state

    A = (value - mean) / (std + 1e-6)    --scale_rewards group: the group's population std (the paper)
    A = value - mean                     --scale_rewards none (Dr. GRPO)
    A = (value - mean) / (std_step + 1e-6)   --scale_rewards batch: one std over every unit of the step
    --std_floor f: a std below f counts as f, so tiny reward differences are not blown up to +-1
    gigpo: none (verl-agent's mean_norm) or group (mean_std_norm, the unbiased std); no batch

Then DAPO's dynamic sampling (which groups train) and the loss; the batch from samples to rows,
micro-batches and tensors is batching.py.
"""
import math
from collections import defaultdict
from dataclasses import dataclass, fields

import torch

# -----------------------------------------------------------------------------
# groups and advantages

SCALES = ("group", "none", "batch")


@dataclass(frozen=True)
class Algo:
    """One --algo: a new scheme is one entry of ALGOS, read by train.py (the rollout), this file
    (the groups and values; plain_values: the returns and --reward outcome), config.py (its checks,
    --algo's choices) and the tests (a smoke run of each)."""
    rollout: str        # "tree": K candidates per (agent, turn), the best continues; "plain": K
                        # independent trajectories per env
    key: object         # which samples share a baseline (None: gigpo makes its own groups)
    value: object       # what is normalized inside the group (compute_advantages)
    unit: object        # one value per unit: grpo counts an agent's return once per trajectory
    returns: bool       # s.ret, the agent's return in its trajectory, is needed (trajectory_returns)
    anchor_groups: bool  # gigpo's second level: the calls made from one state (gigpo_advantages)
    scales: tuple       # the --scale_rewards it accepts
    outcome: bool       # --reward outcome applies: every call has a final outcome (plain rollouts)
    fixed: dict         # flags a preset does not set for it (a flag given by hand is checked)

    def __post_init__(self):  # `advantages` dispatches on this: a key, or groups of its own
        if (self.key is None) != self.anchor_groups:
            raise TypeError("an Algo has a key (compute_advantages' groups) or anchor_groups (its own, "
                            "gigpo_advantages'), not both, not neither")


ALGOS = {
    "at_grpo": Algo(rollout="tree", key=lambda s: (s.env, s.role, s.turn), value=lambda s: s.reward,
                    unit=id, returns=False, anchor_groups=False, scales=SCALES, outcome=False,
                    fixed={}),
    "grpo": Algo(rollout="plain", key=lambda s: (s.env,), value=lambda s: s.ret,
                 unit=lambda s: (s.traj, s.role), returns=True, anchor_groups=False, scales=SCALES,
                 outcome=True, fixed={}),
    "dr_mas": Algo(rollout="plain", key=lambda s: (s.env, s.role), value=lambda s: s.reward,
                   unit=id, returns=False, anchor_groups=False, scales=SCALES, outcome=True,
                   fixed={}),
    # gigpo normalizes within its own two kinds of groups (episodes and anchor states, both made by
    # gigpo_advantages, so no key, value or unit here): DAPO's filter and the step's std do not apply
    "gigpo": Algo(rollout="plain", key=None, value=None, unit=None, returns=False,
                  anchor_groups=True, scales=("group", "none"), outcome=True,
                  fixed={"dynamic_sampling": 0, "scale_rewards": "group", "batch_std_steps": 0}),
}
ZERO_VAR = 1e-12  # a group whose values' std is below this has no signal (advantage 0)


@dataclass
class GroupStats:
    """What the grouping saw in a step (the step log's zero_var_frac and group_size)."""
    groups: int
    zero_var_frac: float  # groups whose values are all equal: advantage 0, no signal
    group_size: float     # samples per group, mean
    dropped: int          # samples left out (--drop_zero_var)


@dataclass
class Scheme:
    """How --algo turns rewards into advantages: train.py's flags of the same names."""
    algo: str = "at_grpo"
    scale_rewards: str = "group"
    batch_std_steps: int = 0    # with scale_rewards group: the first N steps use the step's std
    std_floor: float = 0.0
    drop_zero_var: bool = False
    gigpo_gamma: float = 0.95
    gigpo_step_weight: float = 1.0
    gigpo_episode: str = "agent"  # gigpo's episode groups: per agent, trajectory or call

    @classmethod
    def of(cls, cfg):
        return cls(**{f.name: cfg[f.name] for f in fields(cls)})


def groups_of(samples, algo):
    """{group key: its samples, in generation order} for the algo's key."""
    groups = defaultdict(list)
    for s in samples:
        groups[ALGOS[algo].key(s)].append(s)
    return groups


def population_std(x):
    mean = sum(x) / len(x)
    return math.sqrt(sum((v - mean) ** 2 for v in x) / len(x))


def group_values(group, algo):
    """The values a group's mean and std are taken over: one per unit (one per sample, except for
    grpo, where an agent's return is the same on each of its turns and counts once per (trajectory,
    agent))."""
    units = {}
    for s in group:
        units.setdefault(ALGOS[algo].unit(s), ALGOS[algo].value(s))
    return list(units.values())


def compute_advantages(samples, algo, drop_zero_var=False, scale="group", all_sum=lambda v: v, eps=1e-6,
                       std_floor=0.0):
    """Sets s.adv on every sample; returns (the samples kept for training, GroupStats).
    `all_sum` sums a list of floats over ranks (scale "batch": every rank holds its own envs)."""
    if algo not in ALGOS or ALGOS[algo].key is None:
        keyed = [name for name, a in ALGOS.items() if a.key]
        raise ValueError(f"compute_advantages groups by a scheme's key: algo {', '.join(keyed)}, not "
                         f"{algo!r} (gigpo: gigpo_advantages)")
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}: use --scale_rewards group, none or batch")
    if not std_floor >= 0.0:
        raise ValueError(f"std_floor {std_floor!r} must be >= 0: use --std_floor 0 (off) or a reward-unit floor "
                         "such as 0.25")
    # 1. the groups: the samples that share a baseline
    groups = groups_of(samples, algo)
    # 2. each group's values, one per unit the statistics count (grpo: one return per trajectory and
    # agent)
    values = {key: group_values(group, algo) for key, group in groups.items()}
    # 3. scale "batch": the population std of every value of the step, on every rank
    batch_std = 0.0
    if scale == "batch":
        every = [v for vs in values.values() for v in vs]
        n, total, squares = all_sum([float(len(every)), sum(every), sum(v * v for v in every)])
        n = max(n, 1.0)
        batch_std = math.sqrt(max(0.0, squares / n - (total / n) ** 2))
    # 4. A = (value - the group's mean) / its divisor
    kept, zero_var, sizes = [], 0, []
    for key, group in groups.items():
        x = values[key]
        mean, std = sum(x) / len(x), population_std(x)
        if scale == "none":
            divisor = 1.0
        elif scale == "group":
            divisor = max(std, std_floor) + eps
        else:
            divisor = max(batch_std, std_floor) + eps
        for s in group:
            s.adv = (ALGOS[algo].value(s) - mean) / divisor
        sizes.append(len(group))
        if std < ZERO_VAR:  # all K equal: advantage 0, no signal
            zero_var += 1
        if not (drop_zero_var and std < ZERO_VAR):
            kept += group
    stats = GroupStats(groups=len(groups), zero_var_frac=zero_var / max(1, len(groups)),
                       group_size=sum(sizes) / max(1, len(sizes)), dropped=len(samples) - len(kept))
    return kept, stats


GIGPO_EPISODES = ("call", "trajectory", "agent")


def gigpo_advantages(samples, gamma=0.95, step_weight=1.0, scale="none", eps=1e-6, penalty=0.0,
                     episode="agent"):
    """GiGPO (Feng et al. 2025, arXiv 2505.10978) in a multi-agent system as Dr. MAS runs it (its fork
    of verl, verl/trainer/ppo/core_algos.py; the rules with file:line: docs/method.md §4), over K
    plain trajectories per env. The paper's A = A^E + w A^S, one number per call, in the reference's
    steps:
      1. returns   each call's episode value R(tau) and step return G_t (gigpo_returns)
      2. groups    episode groups by `episode`, anchor (step) groups within them (gigpo_groups)
      3. A^E       R(tau) normalized within its episode group (gigpo_normalize)
      4. A^S       G_t normalized within its anchor group: the calls made from one state
    scale "none" subtracts the group's mean (mean_norm, verl-agent's default); "group" divides by
    the unbiased std + eps too (mean_std_norm). `penalty`: subtracted from both values, after
    discounting, for an ill-formed answer (verl-agent's invalid-action penalty)."""
    if episode not in GIGPO_EPISODES:
        raise ValueError(f"unknown gigpo episode groups {episode!r}: use call, trajectory or agent")
    if scale not in ("none", "group"):
        raise ValueError(f"gigpo normalizes with scale none or group, not {scale!r}")
    episode_value, step_return = gigpo_returns(samples, gamma, penalty)
    by_episode, by_anchor = gigpo_groups(samples, episode)
    # what one value stands for: a call, or (episode groups per trajectory) the trajectory
    units = [s.traj if episode == "trajectory" else i for i, s in enumerate(samples)]
    a_episode, zero_episode = gigpo_normalize(by_episode, episode_value, scale, eps, "zero", units)
    a_step, zero_step = gigpo_normalize(by_anchor, step_return, scale, eps, "own", range(len(samples)))
    for i, s in enumerate(samples):
        s.adv = a_episode[i] + step_weight * a_step[i]
    n_groups = len(by_episode) + len(by_anchor)
    return samples, GroupStats(groups=n_groups, zero_var_frac=(zero_episode + zero_step) / max(1, n_groups),
                               group_size=len(samples) / max(1, len(by_anchor)), dropped=0)


def gigpo_returns(samples, gamma, penalty):
    """Each call's two values, in the samples' order: its trajectory's total reward, and its env
    step's discounted return G_t = r_t + gamma G_(t+1) over the trajectory's turns, r_t the sum of
    the turn's calls' rewards, shared by every call of the turn (gamma once per env step:
    core_algos.py:156-173)."""
    trajectories = defaultdict(list)
    for i, s in enumerate(samples):
        trajectories[s.env, s.traj].append(i)
    episode_value, step_return = [0.0] * len(samples), [0.0] * len(samples)
    for calls in trajectories.values():
        total, future = sum(samples[i].reward for i in calls), 0.0
        turn_reward = defaultdict(float)  # the env step's reward: what its calls earned together
        for i in calls:
            turn_reward[samples[i].turn] += samples[i].reward
        turn_return = {}
        for turn in sorted(turn_reward, reverse=True):
            future = turn_reward[turn] + gamma * future
            turn_return[turn] = future
        for i in calls:
            invalid = penalty * (not samples[i].formatted)
            episode_value[i] = total - invalid
            step_return[i] = turn_return[samples[i].turn] - invalid
    return episode_value, step_return


def gigpo_groups(samples, episode):
    """(episode groups, anchor groups), each {key: the indices of its samples}. Episode groups
    (core_algos.py:281-285, ray_trainer.py:269-274): per (env, agent) for "agent" (Dr. MAS's
    group_by_agent_id=True), else per env. Anchor groups lie within them (core_algos.py:340-349):
    the calls made from one state of the env (`s.anchor`, the env's own observation, the
    reference's `anchor_obs`; the prompt where a sample has none), by any trajectory at any turn."""
    by_episode, by_anchor = defaultdict(list), defaultdict(list)
    for i, s in enumerate(samples):
        index = (s.env, s.role) if episode == "agent" else (s.env,)
        anchor = s.anchor if s.anchor is not None else tuple(s.prompt_ids)
        by_episode[index].append(i)
        by_anchor[index, anchor].append(i)
    return by_episode, by_anchor


def gigpo_normalize(groups, values, scale, eps, lone, units):
    """Each group's members normalized by its mean and unbiased std over its units: one value per
    unit (`units[i]`; the first member's value stands for a unit of several, core_algos.py:281). A
    group of one unit (`lone`): "zero", an episode group, has mean 0 and std 1 (core_algos.py:288-290);
    "own", a step group, its own value as mean (advantage 0, core_algos.py:430-432). Returns (the
    advantages in the samples' order, the groups whose values are all equal)."""
    if lone not in ("zero", "own"):
        raise ValueError(f"lone {lone!r}: zero (an episode group) or own (a step group)")
    out, zero = [0.0] * len(values), 0
    for group in groups.values():
        per_unit = {}
        for i in group:
            per_unit.setdefault(units[i], values[i])
        x = list(per_unit.values())
        if len(x) == 1:
            mean, std = (x[0] if lone == "own" else 0.0), 1.0
        else:
            mean = sum(x) / len(x)
            std = math.sqrt(sum((v - mean) ** 2 for v in x) / (len(x) - 1))
        zero += len(x) > 1 and max(x) == min(x)
        for i in group:
            out[i] = values[i] - mean if scale == "none" else (values[i] - mean) / (std + eps)
    return out, zero


def advantages(samples, scheme, step, all_sum=lambda v: v):
    """Every --algo's advantages, one entry point: sets s.adv on every sample; returns (the samples
    kept for training, GroupStats). The std schedule: with scale_rewards group, the first
    batch_std_steps steps divide by the step's std instead (a quiet start: few groups have a
    signal). `all_sum` sums a list of floats over ranks."""
    scale = scheme.scale_rewards
    if scale == "group" and step < scheme.batch_std_steps:
        scale = "batch"
    # an entry has a key or its own groups, never both (Algo.__post_init__)
    if ALGOS[scheme.algo].anchor_groups:  # gigpo: episode groups plus anchor-state step groups
        return gigpo_advantages(samples, scheme.gigpo_gamma, scheme.gigpo_step_weight, scale,
                                episode=scheme.gigpo_episode)
    return compute_advantages(samples, scheme.algo, scheme.drop_zero_var, scale, all_sum,
                              std_floor=scheme.std_floor)


def trajectory_returns(samples):
    """s.ret = sum of the rewards of s's agent in s's trajectory (for algo=grpo)."""
    tot = defaultdict(float)
    for s in samples:
        tot[(s.env, s.traj, s.role)] += s.reward
    for s in samples:
        s.ret = tot[(s.env, s.traj, s.role)]


def plain_values(samples, trajectories, algo, reward, alpha, penalty):
    """A plain rollout's samples made ready for --algo's value: with --reward outcome every call
    takes its trajectory's final outcome (Dr. MAS), and a scheme whose value is a return (grpo's
    s.ret) sums each agent's rewards over its trajectory."""
    if reward == "outcome":
        outcome_rewards(samples, trajectories, alpha, penalty)
    if ALGOS[algo].returns:
        trajectory_returns(samples)


def outcome_rewards(samples, trajectories, alpha, penalty):
    """--reward outcome, Dr. MAS's assignment: every call's reward is alpha x its trajectory's final
    team reward (the episode's outcome), minus `penalty` for an ill-formed answer (the penalty knobs:
    envs.FORMAT_PENALTY's comment). It replaces the immediate reward the rollout wrote (a*team +
    local). `trajectories`: the final envs, K per env, as plain_rollout returns them."""
    for s in samples:
        s.team = trajectories[s.env][s.traj].team_reward()
        s.local = -penalty if not s.formatted else 0.0
        s.reward = alpha * s.team + s.local


def by_agent_turn(samples):
    """Mean reward per agent and per (agent, turn): the per-agent / per-turn diagnostics."""
    acc = defaultdict(list)
    for s in samples:
        acc[s.role].append(s.reward)
        acc[f"{s.role}@t{s.turn}"].append(s.reward)
    return {k: sum(v) / len(v) for k, v in sorted(acc.items())}


# -----------------------------------------------------------------------------
# DAPO's dynamic sampling: only groups with a signal train


def signal_groups(samples, algo):
    """The algo's groups whose values are not all equal (they carry a signal), in the order their first
    sample was generated, and how many groups there were in all."""
    groups = groups_of(samples, algo)
    informative = [g for g in groups.values() if population_std(group_values(g, algo)) >= ZERO_VAR]
    return informative, len(groups)


@dataclass
class Filled:
    """What DAPO's dynamic sampling generated in a step and what it keeps."""
    generated: list        # every sample of every rollout (the step's cost)
    kept: list             # the samples of the first `target` groups with a signal
    rollouts: int          # rollouts made, the first included
    zero_var_frac: float   # of every group generated: the freeze, as without the filter


def refill_envs(missing, found, envs_so_far, batch_envs):
    """--refill missing: the fresh envs that should carry the `missing` groups, at the rate of groups
    with a signal per env seen so far (found / envs_so_far); at least one, at most a batch; none when
    this rank has its groups (it waits for the others)."""
    if missing <= 0:
        return 0
    if found == 0:
        return batch_envs
    return min(batch_envs, math.ceil(missing * envs_so_far / found))


def dapo_fill(first, more, algo, max_rollouts, refill="batch", all_sum=lambda v: v):
    """DAPO's dynamic sampling (Yu et al. 2025; verl recipe/dapo/dapo_ray_trainer.py, filter_groups):
    keep only the groups with a signal; while they number fewer than the groups of the first rollout
    (DAPO: the train batch's prompts), roll out fresh envs (`more(n_envs)`); stop at max_rollouts in
    all (DAPO raises there; here the step trains on what it has, and the log's `rollouts` shows it).
    Groups beyond the target are dropped, as DAPO cuts its batch. Every rank keeps rolling out until
    all reach their own target (one all_sum per rollout). refill: how many envs a refill rolls out,
    `batch` (as many as the first rollout, DAPO's generation batch) or `missing` (refill_envs)."""
    groups, target = signal_groups(first, algo)
    batch_envs = len({s.env for s in first})
    generated, seen, rollouts, envs_so_far = list(first), target, 1, batch_envs
    while rollouts < max_rollouts and all_sum([float(len(groups) < target)])[0] > 0:
        n_envs = batch_envs
        if refill == "missing":
            n_envs = refill_envs(target - len(groups), len(groups), envs_so_far, batch_envs)
        new = more(n_envs)
        informative, n = signal_groups(new, algo)
        groups += informative
        generated += new
        seen += n
        rollouts += 1
        envs_so_far += n_envs
    kept = [s for group in groups[:target] for s in group]
    return Filled(generated, kept, rollouts, 1 - len(groups) / max(1, seen))


def ended(samples, stops):
    """--mask_truncated: DAPO's overlong filtering (TRL's mask_truncated_completions): the samples
    whose answer holds a stop token; one the budget cut trains nothing. Taken after the advantages,
    so a cut answer's reward still sets its group's baseline, as in TRL."""
    stops = set(stops)
    return [s for s in samples if stops.intersection(s.response_ids)]


# -----------------------------------------------------------------------------
# the PPO-clip loss

# |log pi/pi_old| above this is clamped (verl `verl/trainer/ppo/core_algos.py`: [-20, 20])
LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True)
class LossConfig:
    """The loss's knobs: the run's --eps_low ... --entropy_coef (train.py's flags, the same for
    every policy), read from its cfg by `of`. The defaults: the paper's clip and dual clip, every
    extra term off."""
    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip: float = 3.0   # 0: off
    kl_coef: float = 0.0     # the KL to a frozen reference
    tis_cap: float = 0.0     # truncated importance sampling against the sampler
    entropy_coef: float = 0.0

    @classmethod
    def of(cls, cfg):
        return cls(**{f.name: cfg[f.name] for f in fields(cls)})


@dataclass
class LossStats:
    """Sums over a micro-batch's response tokens, for the step log."""
    tokens: float
    clip_tokens: float     # where the PPO clip was active
    clamped_tokens: float  # whose log-ratio hit LOG_RATIO_CLAMP (a broken sync or an overflow)
    kl_sum: float
    entropy_sum: float


def ppo_clip(logp, old_logp, adv, eps_low=0.2, eps_high=0.2, dual_clip=3.0):
    """The paper's per-token objective, as a loss: max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))
    with r = pi / pi_old; for A < 0 at most -c A (dual clip: a huge ratio cannot blow up the
    update). Returns (per-token loss, where the clip was active)."""
    # one overflow never NaNs a step
    log_ratio = (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - eps_low, 1 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    if dual_clip:
        loss = torch.where(adv < 0, torch.minimum(loss, -dual_clip * adv), loss)
    return loss, clipped > unclipped


def ppo_loss(logp, old_logp, adv, mask, n_tokens, knobs=LossConfig(), ref_logp=None, sampler_logp=None,
             entropy=None):
    """The loss of one micro-batch: PPO-clip per token, plus the optional terms (each off by
    default), summed over the real tokens and divided by `n_tokens`, the response tokens of the
    whole optimizer step on every rank, so the gradient does not depend on how samples are cut into
    micro-batches or ranks (a token-mean). Shapes: logp, old_logp, mask, ref_logp, sampler_logp,
    entropy [B, T]; adv [B] or [B, T]; `knobs` a LossConfig. Returns (loss, stats).

      x min(exp(old_logp - sampler_logp), tis_cap)   truncated importance sampling: the engine sampled the tokens
                                                     (bf16 vLLM on GPU), not the trainer's pi_old
                                                     (trl, verl, OpenRLHF)
      + kl_coef x KL(pi || ref)                      k3 estimator exp(q) - q - 1, q = ref_logp - logp
      - entropy_coef x entropy                       an entropy bonus (verl's entropy_coeff)
    """
    adv = adv if adv.dim() == 2 else adv[:, None]
    per_token, clip_active = ppo_clip(logp, old_logp, adv, knobs.eps_low, knobs.eps_high,
                                      knobs.dual_clip)
    if knobs.tis_cap and sampler_logp is not None:
        per_token = per_token * torch.exp(old_logp - sampler_logp).clamp(max=knobs.tis_cap).detach()
    kl = torch.zeros_like(logp)
    if ref_logp is not None:
        q = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        kl = torch.exp(q) - q - 1
        per_token = per_token + knobs.kl_coef * kl
    if entropy is not None and knobs.entropy_coef:
        per_token = per_token - knobs.entropy_coef * entropy
    m = mask.float()
    loss = (per_token * m).sum() / n_tokens
    with torch.no_grad():
        real = m > 0
        clamped = (logp - old_logp).abs() > LOG_RATIO_CLAMP
        stats = LossStats(tokens=m.sum().item(),
                          clip_tokens=(clip_active & real).float().sum().item(),
                          clamped_tokens=(clamped & real).float().sum().item(),
                          kl_sum=(kl * m).sum().item(),
                          entropy_sum=(entropy * m).sum().item() if entropy is not None else 0.0)
    return loss, stats
