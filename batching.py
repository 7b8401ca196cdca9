"""
The training batch: samples -> mini-batches (one optimizer step each) -> rows -> micro-batches by
token budget -> padded tensors.

A step's samples split into mini-batches (split_minibatches), each laid out as rows (make_rows:
one sample a row, or a sibling group packed into one); the rows are cut into micro-batches that
fit `--micro_batch_tokens`, every rank padded to the same number of FSDP forwards, and each
micro-batch's tensors built with the attention mask of packed rows: a dense bool mask for SDPA on
CPU, a flex-attention BlockMask on CUDA at a bounded set of bucketed shapes (so flex compiles a
bounded number of times). Imports torch only.
"""
import functools
from dataclasses import dataclass

import torch

# -----------------------------------------------------------------------------
# samples -> mini-batches -> rows


@dataclass
class Row:
    """One row of a training micro-batch. Plain: one sample, its prompt then its response. Packed
    (`--pack`): samples that share a prompt (AT-GRPO's K siblings share it by construction) in one
    row: the prompt once, then each response in its own segment, which sees the prompt and itself
    only, with positions that continue from the prompt's end, so every response token has exactly
    the context it was sampled with and the prompt is trained once, not K times. `sel` are the
    positions whose next-token distribution scores each target (the prompt's last position for every
    response's first token); per target: `tgt`, `adv`, `slp` (the sampler's log-prob), `temp` (the
    temperature it was sampled at)."""
    ids: list
    pos: list
    seg: list  # 0: prompt; k + 1: response k (its last token is a target only, never an input)
    sel: list
    tgt: list
    adv: list
    slp: list
    temp: list
    # pi_old's log-probs of `tgt` (a tensor), for mini-batches after the step's first
    old: object = None


def make_rows(samples, pack):
    """The rows of one mini-batch, in the samples' order: one per sample, or with `pack` one per
    group of samples with the same prompt; a sample with no response has no row."""
    groups = {}
    for i, s in enumerate(samples):
        if s.response_ids:
            groups.setdefault(tuple(s.prompt_ids) if pack else i, []).append(s)
    rows = []
    for g in groups.values():
        p = len(g[0].prompt_ids)
        r = Row(ids=list(g[0].prompt_ids), pos=list(range(p)), seg=[0] * p, sel=[], tgt=[], adv=[], slp=[],
                temp=[])
        for k, s in enumerate(g):
            n, start = len(s.response_ids), len(r.ids)
            r.ids += s.response_ids[:-1]
            r.pos += range(p, p + n - 1)
            r.seg += [k + 1] * (n - 1)
            r.sel += [p - 1] + list(range(start, start + n - 1))
            r.tgt += s.response_ids
            r.adv += [s.adv] * n
            r.slp += s.sampler_logprobs
            r.temp += [s.temperature] * n
        rows.append(r)
    return rows


def split_minibatches(samples, n_mini, how):
    """The samples of each optimizer step. strided: sample i goes to mini-batch i mod n, so a tree
    group's K siblings spread over the mini-batches and every step sees every env. groups: a group
    of samples that share a prompt (AT-GRPO's K siblings) stays in one mini-batch, groups dealt
    round-robin; packing needs this (siblings must meet in a row), and verl does the same in effect:
    its rollouts repeat each prompt's n responses contiguously (`repeat(interleave=True)`) and its
    mini-batches are contiguous slices (verl `workers/actor/dp_actor.py`)."""
    if how == "strided":
        return [samples[i::n_mini] for i in range(n_mini)]
    groups = {}
    for s in samples:
        groups.setdefault(tuple(s.prompt_ids), []).append(s)
    chunks = [[] for _ in range(n_mini)]
    for i, g in enumerate(groups.values()):
        chunks[i % n_mini] += g
    return chunks


# -----------------------------------------------------------------------------
# rows -> micro-batches -> tensors

# a zero-weight row: keeps every rank's FSDP collectives in step
DUMMY = Row(ids=[0, 0], pos=[0, 1], seg=[0, 0], sel=[0], tgt=[0], adv=[0.0], slp=[0.0], temp=[1.0])


BLOCK = 128  # flex attention's block: a packed row on CUDA is whole blocks long


def bucket_length(n):
    """The padded length of a packed flex row of n tokens: whole 128-blocks, the block count rounded
    up to 4 values per octave (1-8 blocks, then 10 12 14 16, 20 24 28 32, ...): at most 25% padding,
    and 24 lengths in all up to 16k tokens. Flex attention and its block mask compile once per
    shape, so a bounded set of lengths compiles a bounded number of times; torchtitan gets there by
    packing every row to one fixed seq_len (torchtitan `torchtitan/models/attention.py`, its document
    mask), which a sibling group of 1k-10k tokens cannot use without splitting it."""
    blocks = -(-n // BLOCK)
    step = 1 if blocks <= 8 else 2 ** (blocks.bit_length() - 3)  # keep the top 3 bits
    return -(-blocks // step) * step * BLOCK


def flex_shapes(budget, longest):
    """Every micro-batch shape (B, T) that micro_batches(..., bucket=True) and collate can make for
    rows up to `longest` tokens: T a bucket length, B a power of two with B x T within the budget
    (a row over the budget goes alone). Its size bounds the compiles (model.FLEX_RECOMPILE_LIMIT)."""
    out = set()
    for T in {bucket_length(n) for n in range(1, longest + 1, BLOCK)} | {bucket_length(longest)}:
        B = 1
        while B == 1 or B * T <= budget:
            out.add((B, T))
            B *= 2
    return out


def micro_batches(rows, budget, all_max=lambda n: n, bucket=False):
    """Greedy packing of rows by padded token count, longest first; then padded with zero-weight
    DUMMY micro-batches to the most any rank has (`all_max` over ranks): every rank runs the same
    number of FSDP forwards. `bucket` (packed rows on CUDA): a row counts at its bucket_length and a
    micro-batch of n rows is cut into powers of two (6 -> 4 + 2), so the shapes (B, T) flex
    compiles for are a small set (flex_shapes), whatever the lengths."""
    padded = bucket_length if bucket else int  # int: a row counts at its own length
    rows = sorted(rows, key=lambda r: -len(r.ids))
    out, cur = [], []
    for r in rows:
        if cur and (len(cur) + 1) * padded(len(cur[0].ids)) > budget:
            out.append(cur)
            cur = []
        cur.append(r)
    out += [cur] if cur else []
    if bucket:
        cut = []
        for mb in out:
            while mb:
                n = 2 ** (len(mb).bit_length() - 1)
                cut.append(mb[:n])
                mb = mb[n:]
        out = cut
    return out + [[DUMMY]] * (all_max(len(out)) - len(out))


@dataclass
class Batch:
    ids: torch.Tensor
    pos: torch.Tensor
    sel: torch.Tensor
    # None (causal), a [B, 1, T, T] bool mask or a flex BlockMask (packed rows, packed_mask)
    attn: object
    tgt: torch.Tensor
    w: torch.Tensor    # 1 for a real target, 0 for padding
    adv: torch.Tensor
    slp: torch.Tensor
    temp: torch.Tensor  # each target's sampling temperature (the trainer divides its logits by it)
    # pi_old's log-probs [B, N], or None: pi_old is the current policy (the first mini-batch)
    old: object


@functools.cache
def _block_mask_builder(compiled):
    """create_block_mask, compiled once (CUDA): eager, it evaluates the mask on the dense B x T x T
    grid; compiled, it works block by block (torchtitan `torchtitan/models/attention.py` compiles it
    for the same reason). CPU tests run it eagerly. Static shapes: one compile per bucketed shape
    (bucket_length), like model.flex, under the recompile limit model.flex raises."""
    from torch.nn.attention.flex_attention import create_block_mask
    return torch.compile(create_block_mask, dynamic=False) if compiled else create_block_mask


def packed_mask(seg, device, flex):
    """Who sees whom in packed rows (`seg`: 0 prompt, k response k, -1 padding): causal, and a key
    is visible if it is in the prompt or in the query's own segment (a pad query sees the pads
    before it, so no row is empty). On CUDA a flex-attention BlockMask: it stores which 128x128
    blocks are empty, full or partial, so at the paper's lengths (~1k prompt + K x 2k) the kernel
    skips the siblings' blocks and no dense mask exists (a dense bool one would be 81 MB per row).
    On CPU a dense [B, 1, T, T] bool mask for SDPA (flex has no CPU backward), ~10 KB per row at the
    CPU default's ~100 tokens."""
    T = seg.shape[1]
    if flex:
        sg = seg.to(device)

        def visible(b, h, q, k):
            return (k <= q) & ((sg[b, k] == 0) | (sg[b, k] == sg[b, q]))
        build = _block_mask_builder(torch.device(device).type == "cuda")
        return build(visible, seg.shape[0], None, T, T, device=device)
    i = torch.arange(T)
    sq, sk = seg[:, :, None], seg[:, None, :]
    return ((i[None, :] <= i[:, None]) & ((sk == 0) | (sk == sq)))[:, None].to(device)


def batch_shape(mb, flex):
    """(B, T) of a collated micro-batch: its longest row, and with flex its bucket_length (whole
    128-blocks also because below 128 query rows torch 2.11 lowers flex to its decoding kernel,
    which has no config for a GQA training batch on an H100)."""
    T = max(len(r.ids) for r in mb)
    return len(mb), bucket_length(T) if flex else T


def collate(mb, device, flex=None):
    """Right-padded tensors of a micro-batch. The attention mask is None (plain causal) unless a row
    is packed (`packed_mask`)."""
    packed = any(max(r.seg) > 1 for r in mb)
    flex = packed and (device.type == "cuda" if flex is None else flex)
    B, T = batch_shape(mb, flex)
    N = max(len(r.tgt) for r in mb)
    ids = torch.zeros(B, T, dtype=torch.long)
    pos = torch.zeros(B, T, dtype=torch.long)
    seg = torch.full((B, T), -1)
    sel = torch.zeros(B, N, dtype=torch.long)
    tgt = torch.zeros(B, N, dtype=torch.long)
    w, adv, slp = torch.zeros(B, N), torch.zeros(B, N), torch.zeros(B, N)
    temp = torch.ones(B, N)
    # pi_old in the dtype it was computed in (fp32, or fp64 in the exactness tests)
    old = torch.zeros(B, N, dtype=mb[0].old.dtype) if mb[0].old is not None else None
    for b, r in enumerate(mb):
        T_r, n = len(r.ids), len(r.tgt)
        ids[b, :T_r] = torch.tensor(r.ids)
        pos[b, :T_r] = torch.tensor(r.pos)
        seg[b, :T_r] = torch.tensor(r.seg)
        sel[b, :n] = torch.tensor(r.sel)
        tgt[b, :n] = torch.tensor(r.tgt)
        w[b, :n] = float(r is not DUMMY)
        adv[b, :n] = torch.tensor(r.adv, dtype=torch.float32)
        slp[b, :n] = torch.tensor(r.slp, dtype=torch.float32)
        temp[b, :n] = torch.tensor(r.temp, dtype=torch.float32)
        if old is not None:
            old[b, :n] = r.old
    attn = packed_mask(seg, device, flex) if packed else None
    ids, pos, sel, tgt, w, adv, slp, temp = (x.to(device) for x in (ids, pos, sel, tgt, w, adv, slp, temp))
    old = None if old is None else old.to(device)
    return Batch(ids=ids, pos=pos, sel=sel, attn=attn, tgt=tgt, w=w, adv=adv, slp=slp, temp=temp, old=old)
