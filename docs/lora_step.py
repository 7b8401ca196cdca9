"""How far one training step moves the policy: the full model against LoRA adapters, on the same samples.

    python docs/lora_step.py          # seed 0's first step of the tiny default (about 5 minutes on 2 cores)
    python docs/lora_step.py --first_update   # where the first optimizer step points (about 2 minutes)

The samples are the tiny default's first step (seed 0, its cached base under runs/, built if missing): 16 envs,
the tree rollout, AT-GRPO's advantages. Each configuration starts from the same base and takes that one step
(its optimizer steps, its lr) on them; the line says how far its log-probs of those tokens moved: mean and max
|logp_after - logp_before| per token, and the share of tokens whose ratio left PPO's clip range [0.8, 1.2].
A LoRA adapter starts at B = 0 (the base exactly), so every configuration starts from the same policy.

--first_update: the first optimizer step alone, as a change dW of every adapted weight (LoRA: of W + (alpha/r) B A),
against the loss's gradient g of those weights at the base (a full model per role computes it; the same base and the
same first mini-batch, so the same point): the step's size |dW|, its cosine with -g, and the first-order drop of the
loss it buys, -<g, dW>."""
import copy
import os
import random
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.chdir(ROOT)
import threads  # noqa: E402, F401  (before torch: OpenMP's settings)
import torch  # noqa: E402

import model as M  # noqa: E402

import common as C  # noqa: E402
import config  # noqa: E402
import envs as E  # noqa: E402
import policies as P  # noqa: E402
import tiny  # noqa: E402
import train as T  # noqa: E402
from batching import collate, make_rows  # noqa: E402
from grpo_mas import compute_advantages  # noqa: E402
from rollout import Agents, Sampling, tree_rollout  # noqa: E402

CONFIGS = [  # label: train.py flags
    ("one shared full model (the default)", []),
    ("a full model per role", ["--policies", "per_role"]),
    *[(f"LoRA per role, r 16, alpha 32, lr x{m}", ["--policies", "lora", "--lora_rank", "16", "--lora_alpha", "32",
                                                   "--lora_lr_mult", m])
      for m in ("1", "2", "3", "5", "10")],
    ("LoRA per role, r 64, alpha 128, lr x3 (the tiny preset)", ["--policies", "lora", "--lora_rank", "64",
                                                                 "--lora_alpha", "128", "--lora_lr_mult", "3"]),
    ("LoRA per role, r 4, alpha 8, lr x10", ["--policies", "lora", "--lora_rank", "4", "--lora_alpha", "8",
                                             "--lora_lr_mult", "10"]),
]  # every LoRA value explicit: the rows stay what they say when the preset changes


def build(flags):
    cfg = T.configure(["--engine", "torch", "--seed", "0", "--out_dir", "runs/lora-step"] + flags)
    pols, role_to_policy = config.resolve(cfg)
    bases = tiny.bases(cfg, pols, True, 1)
    torch.manual_seed(cfg["seed"])
    models, opts, _, engines = P.build(cfg, pols, bases, os.path.join(cfg["out_dir"], "none"), 0, C.DEVICE)
    return cfg, pols, role_to_policy, bases, models, opts, engines


def first_step_samples():
    """The tiny default's step-1 samples of seed 0, with AT-GRPO's advantages (the step's std)."""
    cfg, _, role_to_policy, bases, _, _, engines = build([])
    from transformers import AutoTokenizer
    agents = Agents(AutoTokenizer.from_pretrained(bases[0]), engines, role_to_policy, cfg["max_prompt_tokens"])
    rng = random.Random("0-0-0")  # train.py's step-0 rng of seed 0, rank 0
    agents.reseed(T.step_seed(0, 0, 0))
    envs = [E.train_env("plan", rng, "mas", True, None, turns=cfg["turns"]) for _ in range(cfg["envs_per_step"])]
    sampling = {r: Sampling(**s) for r, s in cfg["role_sampling"].items()}
    samples = tree_rollout(envs, agents, cfg["K"], cfg["turns"], sampling, cfg["alpha"], "greedy", rng, {})
    kept, _ = compute_advantages(samples, "at_grpo", False, "batch")
    return kept


def logprobs(model, samples):
    rows = make_rows(samples, False)
    with torch.no_grad():
        lp = T.row_logprobs(model, collate(rows, C.DEVICE))
    return torch.cat([lp[i, :len(r.tgt)] for i, r in enumerate(rows)])


def policy_batch(samples, role_to_policy, models, opts, pols, p):
    """Policy p's share of the samples (marked as its own), its model, its optimizer at its lr."""
    mine = [copy.copy(s) for s in samples if role_to_policy[s.role] == p]
    for s in mine:
        s.policy = p
    for group in opts[p].param_groups:
        group["lr"] = pols[p].lr
    return mine, P.use_policy(models, pols, p)


def one_step(flags, samples):
    """logp_after - logp_before of every trained token after each optimizer step (a list, the last
    = after the whole training step) of this configuration."""
    cfg, pols, role_to_policy, _, models, opts, _ = build(flags)
    moved = []
    for p, pol in enumerate(pols):
        mine, model = policy_batch(samples, role_to_policy, models, opts, pols, p)
        before = logprobs(model, mine)
        after_each = []
        adam_step = opts[p].step

        def step_and_measure(adam_step=adam_step, model=model, mine=mine, after_each=after_each):
            adam_step()
            after_each.append(logprobs(model, mine) - before)

        opts[p].step = step_and_measure
        T.update_policy(model, opts[p], mine, config.settings(cfg, pol), 1, C.DEVICE)
        moved.append(after_each)
    # per optimizer step k: every policy's tokens, moved from the start
    return pols[0].lr, [torch.cat(per_policy) for per_policy in zip(*moved)]


class FirstStepTaken(Exception):
    pass


def first_update(flags, samples):
    """{weight's path: (dW of the first optimizer step, the gradient at the base)} over both policies."""
    cfg, pols, role_to_policy, _, models, opts, _ = build(flags)
    out = {}
    for p, pol in enumerate(pols):
        mine, model = policy_batch(samples, role_to_policy, models, opts, pols, p)
        linears = {n: m for n, m in model.named_modules() if n.split(".")[-1] in M.LORA_TARGETS}

        def weight(m):  # LoRA: the active adapter merged in
            return (m.merged_weight() if isinstance(m, M.LoRALinear) else m.weight).detach().clone()

        before = {n: weight(m) for n, m in linears.items()}
        adam_step = opts[p].step

        def step_once(adam_step=adam_step, linears=linears, before=before, p=p):
            grads = {n: m.weight.grad for n, m in linears.items()}  # None where W is frozen (LoRA)
            adam_step()
            for n, m in linears.items():
                g = grads[n].clone() if grads[n] is not None else None
                out[f"p{p}.{n}"] = (weight(m) - before[n], g)
            raise FirstStepTaken

        opts[p].step = step_once
        try:
            T.update_policy(model, opts[p], mine, config.settings(cfg, pol), 1, C.DEVICE)
        except FirstStepTaken:
            pass
    return out


def print_first_update(samples):
    full = first_update(["--policies", "per_role"], samples)
    grad = torch.cat([g.flatten() for _, g in full.values()])
    print("| configuration | lr | abs dW | cosine(dW, -g) | first-order loss drop -<g, dW> |\n|---|---|---|---|---|")
    for label, flags in CONFIGS[1:]:
        dw = torch.cat([d.flatten() for d, _ in first_update(flags, samples).values()])
        lr = T.configure(["--engine", "torch"] + flags)["role_defaults"]["lr"]
        cos = -(dw @ grad) / (dw.norm() * grad.norm())
        print(f"| {label} | {lr:.1e} | {dw.norm():.4f} | {cos:.3f} | {-(dw @ grad):.2e} |", flush=True)


def main():
    samples = first_step_samples()
    if "--first_update" in sys.argv:
        return print_first_update(samples)
    print(f"{len(samples)} samples, {sum(len(s.response_ids) for s in samples)} response tokens")
    print("| configuration | lr | mean abs dlogp | max | share outside [0.8, 1.2] "
          "| after optimizer step 1, 2, 3, 4 | moved by step 1, 2, 3, 4 |\n|---|---|---|---|---|---|---|")
    for label, flags in CONFIGS:
        lr, after_each = one_step(flags, samples)
        d = after_each[-1]
        outside = ((d.exp() > 1.2) | (d.exp() < 0.8)).float().mean()
        # from the start after each optimizer step, and by that optimizer step alone
        cumulative = " / ".join(f"{a.abs().mean():.3f}" for a in after_each)
        by_step = [after_each[0]] + [b - a for a, b in zip(after_each, after_each[1:])]
        increments = " / ".join(f"{x.abs().mean():.3f}" for x in by_step)
        print(f"| {label} | {lr:.1e} | {d.abs().mean():.4f} | {d.abs().max():.3f} | {outside:.3f} "
              f"| {cumulative} | {increments} |", flush=True)


if __name__ == "__main__":
    main()
