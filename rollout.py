"""
The multi-agent episode driver: AT-GRPO's tree rollouts for training, plain rollouts for the
baselines and the held-out evaluation (with its statistics). The engines it calls are engines.py.

    samples = tree_rollout(envs, agents, K, turns, sampling)          # K candidates per node
    samples, trajs = plain_rollout(envs, agents, K, turns, sampling)  # K trajectories per env
    res = evaluate(test_envs, agents, turns, sampling)                # accuracy, 95% interval

`sampling` maps each role to its Sampling (temperature, top-p, response budget, thinking): agents
of one policy may sample differently, and each sample is trained at the temperature it was drawn at.

One stage of one turn, as the method draws it (docs/method.md, "The tree"):

    state s --> K candidates a_1 .. a_K of the agent, each sampled from s
            --> each applied to its own copy of s: branch b_k, reward r_k = alpha*team + local
            --> the K siblings are one group (env, agent, turn); the best branch is the next s

A plain rollout is the same driver with one candidate per node on K copies of each env, so the
baselines, the evaluation and the tree build their samples through the same code.
"""
import math
import os
import random
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import sandbox
from engines import Completion

# -----------------------------------------------------------------------------
# what a rollout produces


@dataclass(frozen=True)
class Sampling:
    """How one role samples."""
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    thinking: bool = False  # Qwen3's chat-template switch


def every_role(**settings):
    """The same Sampling for every role: {role: Sampling(**settings)} for any role asked."""
    return defaultdict(lambda: Sampling(**settings))


@dataclass
class Sample:
    """One model call and what it earned: the unit the trainer groups and trains on."""
    policy: int          # index of the policy that produced it (role -> policy map)
    env: int             # env index in this rollout (train.Rollouts.more: past the step's earlier envs)
    role: str
    turn: int
    traj: int            # trajectory index within the env (plain rollouts); 0 for tree rollouts
    prompt_ids: list
    response_ids: list
    sampler_logprobs: list
    reward: float        # alpha * team + local of this call
    local: float = 0.0
    team: float = 0.0
    formatted: bool = True  # False when the answer got the format penalty
    temperature: float = 1.0  # the temperature it was sampled at (the trainer scores it at the same)
    adv: float = 0.0
    ret: float = 0.0     # --algo grpo: the agent's return over its trajectory
    anchor: object = None  # the env's state as it was answered (env.anchor): gigpo's step groups


@dataclass
class Candidate:
    """One of the K answers an agent gives from one env state, and the branch it leads to."""
    env: int                 # index into the rollout's envs
    role: str
    prompt_ids: list
    completion: Completion   # the sampled token ids and their log-probs
    text: str                # the decoded answer, what the env parses
    temperature: float       # what it was sampled at
    local_alone: float = 0.0  # its local reward alone (a parallel stage's provisional pick)
    branch: object = None    # a copy of the env after this answer
    local: float = 0.0       # the agent's own reward on that branch
    team: float = 0.0        # the team's reward on that branch
    reward: float = 0.0      # alpha * team + local: what the group normalizes
    formatted: bool = True   # False when the answer got the format penalty
    anchor: object = None    # the env's observation of the state answered (env.anchor), for gigpo


class Agents:
    """role -> (policy index, engine) plus the tokenizer: how a rollout reaches the models."""

    def __init__(self, tokenizer, engines, role_to_policy, max_prompt_tokens=4096):
        self.tok = tokenizer
        self.engines = engines
        self.role_to_policy = role_to_policy
        self.max_prompt = max_prompt_tokens
        self._cache = {}
        self.seed_base = None  # sampling seeds: seed_base + 7 x call index (reproducible)
        self.calls = 0

    def reseed(self, seed):
        """Start a new series of per-call sampling seeds (a training step, an evaluation)."""
        self.seed_base, self.calls = seed, 0

    def render(self, messages, thinking=False):
        """Chat-template the observation and tokenize once; never re-tokenize sampled text."""
        text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                            enable_thinking=thinking)
        ids = self._cache.get(text)
        if ids is None:
            ids = self.tok.encode(text, add_special_tokens=False)
            if len(ids) > self.max_prompt:  # keep the head (instructions) and the tail
                h = self.max_prompt // 2
                ids = ids[:h] + ids[-(self.max_prompt - h):]
            if len(self._cache) > 50000:
                self._cache.clear()
            self._cache[text] = ids
        return ids

    def generate(self, role, prompts, n, sampling):
        """n completions per prompt from the engine of `role`'s policy, sampled as `sampling` says."""
        engine = self.engines[self.role_to_policy[role]]
        seed = None
        if self.seed_base is not None:
            seed = self.seed_base + 7 * self.calls
            self.calls += 1
        return engine.generate(prompts, n=n, seed=seed, temperature=sampling.temperature,
                               top_p=sampling.top_p, max_new_tokens=sampling.max_new_tokens)

    def decode(self, completion):
        return self.tok.decode(completion.ids, skip_special_tokens=True)


# -----------------------------------------------------------------------------
# the tree


def tree_rollout(envs, agents, K, turns, sampling, alpha=1.0, branch="greedy", rng=None,
                 timer=None):
    """AT-GRPO tree sampling: at every (env, agent, turn) K candidates from the same state, each
    scored on its own branch; the best branch continues. Within a turn the env says who speaks next
    (`env.speakers()`: one agent, several at once, or nobody when the turn is over); envs waiting for
    the same speakers answer in one stage. `envs` is updated in place to each env's final state.
    Returns every candidate as a Sample."""
    rng = rng or random.Random(0)
    timer = timer if timer is not None else {}
    sandbox.clear_cache()  # a program's result is reused within this rollout only
    samples = []
    for turn in range(turns):
        in_turn = [i for i, env in enumerate(envs) if not env.done]
        if not in_turn:
            break
        # who answered in this turn, per env: the rollout's own record, so an env that forgets to add
        # a role to its `spoken` (or lets it speak twice) is caught (check_speaks_once)
        answered = {i: set() for i in in_turn}
        while True:
            asked = {i: envs[i].speakers() for i in in_turn if not envs[i].done}  # once a pass
            waiting = [i for i, who in asked.items() if who]
            if not waiting:
                break
            stage = asked[waiting[0]]
            live = [i for i in waiting if asked[i] == stage]
            for i in live:
                check_speaks_once(envs[i], stage, answered[i], turn)
                answered[i].update(stage)
            samples += run_stage(envs, live, stage, turn, agents, K, sampling, alpha, branch, rng, timer)
        with timed(timer, "env"):  # the envs whose turn is over (not those that ended inside it)
            pmap(end_turn, [envs[i] for i in in_turn if not envs[i].speakers()])
    return samples


def check_speaks_once(env, stage, answered, turn):
    """An agent answers once per turn: a second answer would join its first one's group (env, agent,
    turn) unseen. An env whose agents may answer again says so (`speaks_again`)."""
    again = [role for role in stage if role in answered]
    if again and not env.speaks_again:
        raise ValueError(f"{type(env).__name__}: agent {again[0]!r} speaks twice in turn {turn}, and its "
                         "two answers would share one group (env, agent, turn): give the second answer a "
                         "turn of its own, or set speaks_again = True on the env class")


def run_stage(envs, live, stage, turn, agents, K, sampling, alpha, branch, rng, timer):
    """The agents of `stage` answer the live envs, K candidates each; envs[i] becomes the state
    after the stage. rng is used by the random picks only, once per group in order: runs reproduce."""
    # 1. K candidates per (env, agent), all sampled from the stage-start state
    groups = sample_groups(envs, live, stage, agents, K, sampling, timer)  # (env, role) -> K candidates
    candidates = [c for group in groups.values() for c in group]
    with timed(timer, "env"):
        # 2. several agents at once: each one's provisional best, by its local reward alone
        provisional = {}  # (env, role) -> the answer the other agents' branches assume
        if len(stage) > 1:
            def alone(c):
                c.local_alone = envs[c.env].clone().step(c.role, c.text)
            pmap(alone, candidates)
            for key, group in groups.items():
                provisional[key] = max(group, key=lambda c: c.local_alone).text

        # 3. each candidate on a branch of its own: the others' provisional answers, then its own
        def score(c):
            c.branch = envs[c.env].clone()
            for other in stage:
                if other != c.role:
                    c.branch.step(other, provisional[c.env, other])
            c.local = c.branch.step(c.role, c.text)
            c.team = c.branch.team_reward()
            c.reward = alpha * c.team + c.local
            c.formatted = c.branch.format_ok
        pmap(score, candidates)

        # 4. each group's winner: the highest reward, ties to the first (random: the ablation)
        winners = {key: pick(group, rng, branch) for key, group in groups.items()}

        # 5. the env continues from its winners: one agent, the winner's branch; several, every
        #    winner's answer applied in stage order
        def advance(i):
            if len(stage) == 1:
                return winners[i, stage[0]].branch
            nxt = envs[i].clone()
            for role in stage:
                nxt.step(role, winners[i, role].text)
            return nxt
        for i, nxt in zip(live, pmap(advance, live)):
            envs[i] = nxt
    return [to_sample(c, agents, turn) for c in candidates]


def sample_groups(envs, live, stage, agents, K, sampling, timer):
    """K candidates per (env, agent) of the stage, from the stage-start state: one engine call per
    agent. The groups are in env-major order (env, then the stage's agents), the order picks and
    samples follow."""
    groups = {(i, role): [] for i in live for role in stage}
    for role in stage:
        how = sampling[role]
        prompts = [agents.render(envs[i].observe(role), how.thinking) for i in live]
        with timed(timer, "gen"):
            outputs = agents.generate(role, prompts, K, how)
        for i, prompt, completions in zip(live, prompts, outputs):
            anchor = envs[i].anchor(role)  # the state, without the prompt's turn counter
            groups[i, role] = [Candidate(i, role, prompt, c, agents.decode(c), how.temperature,
                                         anchor=anchor) for c in completions]
    return groups


def pick(group, rng, branch):
    """The candidate whose branch continues: the highest reward (the first on a tie), or any."""
    if branch == "random":
        return group[rng.randrange(len(group))]
    return max(group, key=lambda c: c.reward)


def to_sample(c, agents, turn, traj=0):
    """A candidate as the trainer sees it."""
    return Sample(policy=agents.role_to_policy[c.role], env=c.env, role=c.role, turn=turn, traj=traj,
                  prompt_ids=c.prompt_ids, response_ids=c.completion.ids,
                  sampler_logprobs=c.completion.logprobs, reward=float(c.reward),
                  local=float(c.local), team=float(c.team), formatted=c.formatted,
                  temperature=c.temperature, anchor=c.anchor)


def end_turn(env):
    env.end_turn()


def plain_rollout(envs, agents, K, turns, sampling, alpha=1.0, timer=None):
    """K independent trajectories per env (the grpo / dr_mas baselines, and evaluation with K=1):
    the tree driver with one candidate per node, on K copies of each env (trajectory k of env i is
    copy i*K + k). Returns (samples, the final envs as a list of K per env)."""
    copies = [env.clone() for env in envs for _ in range(K)]
    samples = tree_rollout(copies, agents, 1, turns, sampling, alpha, "greedy", None, timer)
    for s in samples:
        s.env, s.traj = divmod(s.env, K)
    trajectories = [copies[i * K:(i + 1) * K] for i in range(len(envs))]
    return samples, trajectories


@contextmanager
def timed(timer, key):
    """Adds the block's wall-clock seconds to timer[key] (the step log's gen / env columns)."""
    t0 = time.time()
    try:
        yield
    finally:
        timer[key] = timer.get(key, 0.0) + time.time() - t0


# Scoring candidates runs programs (tool agents, code tests) in the sandbox, so a stage's candidates
# are scored concurrently: these threads only wait on sandbox runs (sandbox.py bounds how many
# programs run at once, and runs the same program on the same input once). Picks stay in the calling
# thread, in order: runs are reproducible.
SCORE_THREADS = int(os.environ.get("SCORE_THREADS", "64"))
_SCORER = ThreadPoolExecutor(max_workers=SCORE_THREADS)


def pmap(fn, items):
    items = list(items)
    if SCORE_THREADS <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    return list(_SCORER.map(fn, items))


# -----------------------------------------------------------------------------
# held-out evaluation (train.py's monitor and eval.py): plain rollouts of a test set, statistics


TOP_FIRST = 5  # evaluate: the most common first answers reported per role


def evaluate(test_envs, agents, turns, sampling, k=1, rank=0, world=1, seed=1234, progress=False):
    """Plain rollouts of every test env (this rank's shard), k samples each; results gathered over
    ranks. Accuracy = the fraction of instances whose episode ends in success; with k > 1 also avg@k
    and pass@k."""
    mine = list(range(rank, len(test_envs), world))
    old_seed = agents.seed_base
    agents.reseed(seed + rank)
    results = []  # (test index, its k outcomes, the turn each ended after)
    role_stats = defaultdict(lambda: defaultdict(float))
    # role -> first-turn answer (first sample of each instance) -> [instances, solved]
    firsts = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    batch = 64
    starts = range(0, len(mine), batch)
    if progress:
        from tqdm import tqdm
        starts = tqdm(starts, desc="eval", unit="batch")
    for b in starts:
        idx = mine[b:b + batch]
        samples, trajs = plain_rollout([test_envs[i].clone() for i in idx], agents, k, turns, sampling)
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
                first = firsts[s.role][tuple(s.response_ids)]
                first[0] += 1
                first[1] += bool(trajs[s.env][0].success)
    agents.seed_base = old_seed
    if world > 1:
        results, role_stats, firsts = _gather_eval(results, role_stats, firsts, world)
    results.sort()
    # each test instance's k outcomes, in test-set order
    per_instance = [outcomes for _, outcomes, _ in results]
    res = summarize(per_instance, k)
    res["per_instance"] = per_instance
    res["per_role"] = {}
    for r, v in role_stats.items():
        calls = max(1, v["calls"])
        res["per_role"][r] = {
            "calls": int(v["calls"]), "format_error_rate": v["format_errors"] / calls,
            "local_reward": v["local_reward"] / calls, "answer_tokens": v["answer_tokens"] / calls,
            # 1 of n: the same answer to every instance, an open-loop policy that ignores what it
            # sees
            "distinct_first_answers": len(firsts[r]), "instances": int(v["instances"]),
            # the most common first answers: [text, instances, solved]; a few answers covering
            # every instance are a lookup, and greedy success moves by whole answers
            "top_first_answers": [
                [agents.tok.decode(list(ids), skip_special_tokens=True), n, solved]
                for ids, (n, solved) in sorted(firsts[r].items(), key=lambda kv: -kv[1][0])[:TOP_FIRST]]}
    by_turn = defaultdict(int)  # episodes that succeeded, by the turn count they ended after
    for _, outcomes, ended in results:
        for success, turn in zip(outcomes, ended):
            if success:
                by_turn[turn] += 1
    total = max(1, len(results) * k)
    res["success_by_turn"] = {f"<= {t}": sum(v for tt, v in by_turn.items() if tt <= t) / total
                              for t in range(1, turns + 1)}
    return res


def _gather_eval(results, role_stats, firsts, world):
    """Every rank's results, role statistics and first answers, merged."""
    import torch.distributed as dist
    all_results, all_stats, all_firsts = [None] * world, [None] * world, [None] * world
    dist.all_gather_object(all_results, results)
    dist.all_gather_object(all_stats, {r: dict(v) for r, v in role_stats.items()})
    dist.all_gather_object(all_firsts, {r: {a: list(c) for a, c in v.items()} for r, v in firsts.items()})
    merged_firsts = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for part in all_firsts:
        for r, v in part.items():
            for answer, (n, solved) in v.items():
                merged_firsts[r][answer][0] += n
                merged_firsts[r][answer][1] += solved
    merged_stats = defaultdict(lambda: defaultdict(float))
    for part in all_stats:
        for r, v in part.items():
            for key, value in v.items():
                merged_stats[r][key] += value
    return [x for part in all_results for x in part], merged_stats, merged_firsts


def pass_at_k(n, c, k):
    """Unbiased pass@k from n samples with c successes (Chen et al. 2021): 1 - C(n-c, k) / C(n,
    k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def wilson(successes, n, z=1.96):
    """Wilson's 95% interval for a proportion (k = 1)."""
    if n == 0:
        return (0.0, 0.0)
    p = successes / n
    d = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / d
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (max(0.0, centre - half), min(1.0, centre + half))


def mean_ci(values, z=1.96):
    """A normal 95% interval over per-instance values (k > 1; n is in the hundreds)."""
    n = len(values)
    if n == 0:
        return (0.0, 0.0)
    m = sum(values) / n
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / max(1, n - 1))
    return (max(0.0, m - z * sd / math.sqrt(n)), min(1.0, m + z * sd / math.sqrt(n)))


def summarize(per_instance, k):
    """per_instance: list of lists of k booleans -> accuracy / avg@k / pass@k with intervals."""
    n = len(per_instance)
    avg = [sum(x) / len(x) for x in per_instance]
    pk = [pass_at_k(len(x), sum(x), k) for x in per_instance]
    res = {"n": n, "k": k, "avg@k": sum(avg) / max(1, n), "pass@k": sum(pk) / max(1, n)}
    if k == 1:
        s = sum(x[0] for x in per_instance)
        res.update(accuracy=s / max(1, n), ci=wilson(s, n))
        res["avg@k_ci"] = res["pass@k_ci"] = res["ci"]
    else:
        res.update(accuracy=res["avg@k"], ci=mean_ci(avg))
        res["avg@k_ci"] = mean_ci(avg)
        res["pass@k_ci"] = mean_ci(pk)
    return res
