"""
The embedded default's base model: a random tiny Qwen3 (build_tiny: byte tokenizer, Qwen3 chat template)
warmed up on the answer *format* only, the analogue of a real base model that knows how to answer but not how to
solve. The warm-up trains on (observation, random well-formed answer) pairs; for Sokoban and Sudoku the random
answers are legal moves in the room or grid shown, never solutions (why: docs/design.md, "The tiny default").
The base is cached in one folder for every run (cache_dir(): ~/.cache/at-grpo-mini, or
$AT_GRPO_MINI_CACHE) under a name that holds a hash of everything it was built from, so every
ablation starts from the same weights wherever its run folder is, and another setting is another
folder. The warm-up prints its progress and ETA every few seconds and saves its state every
WARMUP_SAVE_S seconds: an interrupted warm-up resumes there.
"""
import fcntl
import hashlib
import json
import os
import random
import shutil
import time

import threads  # before torch (OpenMP's settings)
import torch

import envs as E
import model as M
from rollout import Agents

TINY_VERSION = 3  # bump when the warm-up or the compact observations change: every cached base is then rebuilt
# (2: compact Sudoku's view narrows each cell by the hidden single; 3: compact Sokoban's line names
# the next leg, 2026-11-30)


# --policy ROLE=tiny-small: the embedded tiny model at that size
TINY_SIZES = ("tiny", "tiny-small")


def is_tiny(cfg):
    """The embedded default: no --model and every --policy names a tiny size (a real path means a
    real run)."""
    return not cfg["model"] and all(sp.split("=", 1)[-1] in TINY_SIZES for sp in cfg["policy"].split(",") if sp)


CACHE_ENV = "AT_GRPO_MINI_CACHE"  # the cache folder's override (the tests: their tmp_path)
WARMUP_SAVE_S = 30.0  # the warm-up's state is saved this often: an interrupt loses at most this
PROGRESS_S = 5.0      # a progress line at least this often (and at the end)


# -----------------------------------------------------------------------------
# the tiny model's birth: a random Qwen3 of any size, a byte-level tokenizer, Qwen3's chat template

# ids 256.. in this order
CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


def build_tokenizer(path, n_fill=0):
    """A byte-level tokenizer (256 bytes + Qwen3's special tokens, no merges): any text round-trips,
    and a model trained from scratch sees one token per character. Saved in HF format, so
    AutoTokenizer and vLLM load it. `n_fill` inserts that many never-encoded filler entries before
    the specials: a random model of a real Qwen3 shape then samples from ~151k real ids (so its
    answers run to the length limit, the worst case for memory), and with n_fill = 151643 - 256 the
    specials land on Qwen3's own ids (<|endoftext|> 151643, <|im_end|> 151645)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    byte_chars = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    vocab = {c: i for i, c in enumerate(sorted(byte_chars))}
    vocab.update({f"<fill{i}>": 256 + i for i in range(n_fill)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(CONTROL_TOKENS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def build_tiny(path, seed=0, size="tiny", std=0.02, dtype=None, **overrides):
    """Write a random Qwen3 + its tokenizer to `path` (HF format) and return the model. `size` other
    than "tiny" gives a random model of a real shape (benchmarks and GPU checks) with a tokenizer
    padded to Qwen3's ids."""
    cfg = M.Qwen3Config(**{**M.SIZES[size], **overrides})
    torch.manual_seed(seed)
    model = M.Qwen3(cfg)
    model.init_weights(std)
    M.save_model(model, path, dtype=dtype)
    tok = build_tokenizer(path, n_fill=0 if cfg.vocab_size < 151643 + 8 else 151643 - 256)
    assert tok.convert_tokens_to_ids("<|im_end|>") == cfg.eos_token_id and len(tok) <= cfg.vocab_size
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": cfg.bos_token_id, "eos_token_id": [cfg.eos_token_id, cfg.bos_token_id]}, f)
    return model


# -----------------------------------------------------------------------------
# the warm-up and its cache


def cache_dir():
    """Where the tiny bases live: $AT_GRPO_MINI_CACHE, else $XDG_CACHE_HOME/at-grpo-mini, else
    ~/.cache/at-grpo-mini. One folder for every run, not the run's parent: a run anywhere finds a
    base another run built (docs/design.md, "The tiny default")."""
    if os.environ.get(CACHE_ENV):
        return os.environ[CACHE_ENV]
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(home, "at-grpo-mini")


def base_path(cfg, size="tiny"):
    """The cached base of this run's task, workflow, seed, size and warm-up settings, in cache_dir()."""
    settings = dict(version=TINY_VERSION, task=cfg["task"], workflow=cfg["workflow"], seed=cfg["seed"],
                    size=size, warmup_steps=cfg["warmup_steps"], warmup_moves=cfg["warmup_moves"])
    digest = hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:8]
    sized = "" if size == "tiny" else f"-{size}"
    name = f"tiny-base-{cfg['task']}-{cfg['workflow']}-s{cfg['seed']}{sized}-{digest}"
    return os.path.join(cache_dir(), name)


def bases(cfg, pols, master, world):
    """Each policy's base as a HF folder: --model / --policy as given, or for the embedded default the
    tiny base of each size, built once by rank 0 and cached."""
    if not is_tiny(cfg):
        return [p.base for p in pols]
    paths = [base_path(cfg, p.base) for p in pols]
    if master:
        own = torch.get_num_threads()
        if world > 1:  # torchrun gives each CPU rank one thread: the warm-up takes the cores the others wait on
            torch.set_num_threads(max(own, threads.usable_cores()))
        for path, p in zip(paths, pols):
            build_base(path, cfg, p.base)
        torch.set_num_threads(own)
    if world > 1:
        torch.distributed.barrier()
    return paths


def build_base(path, cfg, size="tiny"):
    """Random tiny Qwen3 + tokenizer at `path`, then `warmup_steps` of SFT on random well-formed
    answers for the compact task. Does nothing if `path` exists (the cache). A lock file makes a
    second run that needs the same base wait for the first, not build it into the same folder."""
    if os.path.exists(os.path.join(path, "config.json")):
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # a hidden name beside the base (never unlinked: a waiter holds it open)
    lock_path = os.path.join(os.path.dirname(path), "." + os.path.basename(path) + ".lock")
    with open(lock_path, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"format warm-up: waiting for another run building {path}", flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(os.path.join(path, "config.json")):
            _build_base(path, cfg, size)


def _build_base(path, cfg, size):
    task = cfg["task"]
    tmp = path + ".tmp"
    state_path = os.path.join(tmp, "warmup-state.pt")
    state = torch.load(state_path, weights_only=False) if os.path.exists(state_path) else None
    if state is None:
        shutil.rmtree(tmp, ignore_errors=True)
    m = build_tiny(tmp, seed=cfg["seed"], size=size)
    if E.TASKS[task]["warmup"] != "none" and cfg["warmup_steps"] > 0:
        tok = M.load_tokenizer(tmp)
        rng = random.Random(cfg["seed"])
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.0)
        first = 0
        if state is not None:  # an interrupted warm-up: on from its last save, as if never stopped
            m.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            rng.setstate(state["rng"])
            first = state["step"]
        agents = Agents(tok, [], {})
        end = [tok.convert_tokens_to_ids("<|im_end|>")]
        total = cfg["warmup_steps"]
        again = f", on from step {first}" if first else ""
        print(f"format warm-up of the tiny base: {total} steps{again}, once per task, workflow, seed and "
              f"warm-up (cached in {path})", flush=True)
        t0 = t_print = t_save = time.time()
        for it in range(first, total):
            batch = warmup_batch(task, tok, agents, rng, cfg["warmup_moves"], end,
                                 workflow=cfg["workflow"])
            loss = sft_step(m, opt, batch)
            now = time.time()
            if now - t_save >= WARMUP_SAVE_S and it + 1 < total:
                save_warmup_state(state_path, m, opt, rng, it + 1)
                t_save = now
            if now - t_print >= PROGRESS_S or it + 1 == total:
                eta = (total - it - 1) * (now - t0) / (it + 1 - first)
                print(f"format warm-up {it + 1}/{total}: loss {loss:.3f}, {now - t0:.0f}s, "
                      f"eta {eta:.0f}s", flush=True)
                t_print = now
        M.save_model(m, tmp)
    kept = ("task", "workflow", "seed", "warmup_steps", "warmup_moves")
    json.dump({k: cfg[k] for k in kept} | {"size": size, "version": TINY_VERSION},
              open(os.path.join(tmp, "warmup.json"), "w"))
    if os.path.exists(state_path):
        os.remove(state_path)
    os.replace(tmp, path)


def warmup_batch(task, tok, agents, rng, moves, end, size=32, workflow="mas"):
    """One format warm-up batch: `size` (prompt ids, answer ids) pairs, each a role's observation and
    a random well-formed answer (the env's `random_answer`), drawn as the task's entry says
    (envs.TASKS: "turn" or "calls")."""
    pair = {"turn": turn_pair, "calls": calls_pair}[E.TASKS[task]["warmup"]]
    return [pair(task, workflow, tok, agents, rng, moves, end) for _ in range(size)]


def turn_pair(task, workflow, tok, agents, rng, moves, end):
    """A random role's observation of a fresh compact instance, mostly (70%) after the turn's
    earlier speakers answered (the plan agent mostly sees a tool agent's answer first)."""
    env = E.train_env(task, rng, workflow, compact=True)
    roles = E.task_roles(task, workflow)
    role = rng.choice(roles)
    if role != roles[0] and rng.random() < 0.7:
        while not env.done and env.speakers() and role not in env.speakers():
            for speaker in env.speakers():
                env.step(speaker, env.random_answer(speaker, rng, moves))
    answer = tok.encode(env.random_answer(role, rng, moves), add_special_tokens=False)
    return agents.render(env.observe(role)), answer + end


def calls_pair(task, workflow, tok, agents, rng, moves, end):
    """A fresh compact instance played for a random number of calls with random well-formed answers,
    then the next speaker's observation and answer, for a role drawn first (each role equally
    often): the workflow's routing as it happens, never the world's facts."""
    role = rng.choice(E.task_roles(task, workflow))
    while True:
        env = E.train_env(task, rng, workflow, compact=True, search=dict(topk=1))
        for _ in range(rng.randrange(6)):
            if env.done:
                break
            if not env.speakers():
                env.end_turn()
                continue
            speaker = env.speakers()[0]
            env.step(speaker, env.random_answer(speaker, rng, moves))
        if env.done or env.speakers() != (role,) or not env.warmup_view(role):
            continue
        answer = tok.encode(env.random_answer(role, rng, moves), add_special_tokens=False)
        return agents.render(env.observe(role)), answer + end


def save_warmup_state(path, m, opt, rng, step):
    """The warm-up's model, optimizer and data stream after `step` steps, written whole or not
    at all."""
    state = {"model": m.state_dict(), "opt": opt.state_dict(), "rng": rng.getstate(), "step": step}
    torch.save(state, path + ".part")
    os.replace(path + ".part", path)


def sft_step(m, opt, batch):
    """One supervised step on (prompt ids, answer ids) pairs: right-padded rows, the loss on the answers' tokens only.
    The format warm-up's step (and docs/sft_probe.py's). Returns the loss."""
    T = max(len(p) + len(a) for p, a in batch)
    ids = torch.zeros(len(batch), T, dtype=torch.long)
    mask = torch.zeros(len(batch), T - 1)
    for i, (p, a) in enumerate(batch):
        ids[i, :len(p) + len(a)] = torch.tensor(p + a)
        mask[i, len(p) - 1:len(p) + len(a) - 1] = 1
    lp = m(ids[:, :-1], targets=ids[:, 1:])
    loss = -(lp * mask).sum() / mask.sum()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()
