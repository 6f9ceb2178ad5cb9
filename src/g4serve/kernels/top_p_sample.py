"""Temperature, top-k, top-p and min-p sampling without sorting the vocabulary: one program per row.

The sampler draws a token as the exponential race ``argmax_i p_i / q_i`` (q ~ Exp(1), per-row noise) over
the tokens its filters keep. Top-p keeps the smallest prefix of the tokens sorted by probability whose mass
reaches ``top_p``, so a token j is kept exactly when the tokens more likely than it hold less than ``top_p``
of the mass. Instead of sorting 262k logits per row (a torch sort: ~3.5 ms a step at 64 rows on an H100),
each program searches from the top down:

1. one pass: the row's max logit and softmax normaliser (online, per lane);
2. rounds of two passes: j = the race's winner among the tokens more likely than ``low`` (and above the
   min-p floor); if the tokens more likely than j hold less than ``top_p`` of the mass, j is the answer;
   otherwise j and every token at most as likely are out of the top-p set, so ``low`` = p_j and again.

The answer is the race's winner over the kept set itself: it won a race over a superset and belongs to the
set. So with the same noise this returns what masking and racing over the whole row returns (up to the
rounding of the mass sums at the top-p boundary, and ties in probability, which the sort orders by index).
Each round removes at least the winner, and a winner outside the set is drawn with probability 1 - top_p,
so a row takes 1-2 rounds on average. Min-p keeps tokens with p >= min_p * p_max: a floor under the search.

Top-k (``HAS_TOP_K``; a row's k in [1, V) keeps the tokens scoring at least its k-th best, ties included)
finds that k-th best value by a radix select instead of ``torch.topk``: the scaled logits as order-keeping
32-bit keys, four passes of a 256-bin histogram of one byte each (among the keys that share the bytes found so
far), each pass keeping the bin where the count from the top reaches k. One more pass sums the kept tokens'
weight, which top-p's budget is a fraction of (top-p after top-k renormalises over the top-k set), and the
race above runs over the kept tokens only. So top-k costs five passes over the row, against a topk kernel and
the torch softmax, cumsum and scatter over its candidates.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from g4serve.kernels._launch import DualKernel


@triton.jit
def _order_key(x):
    """fp32 -> uint32 keys in the order of the values (negatives' bits inverted, positives' sign bit set)."""
    bits = x.to(tl.uint32, bitcast=True)
    return bits ^ tl.where((bits >> 31) == 1, 0xFFFFFFFF, 0x80000000).to(tl.uint32)


@triton.jit
def _kth_largest(logits, inv_t, k, V, offs, BLOCK: tl.constexpr):
    """The k-th largest of the row's scaled logits (1 <= k <= V): radix select, a byte a pass from the top."""
    prefix = tl.full([], 0, tl.uint32)
    rank = k  # the rank still sought among the keys that share ``prefix``
    bins = tl.arange(0, 256)
    for byte in tl.static_range(4):
        shift = 24 - 8 * byte
        counts = tl.zeros([256], tl.int32)
        for start in range(0, V, BLOCK):
            idx = start + offs
            valid = idx < V
            key = _order_key(tl.load(logits + idx, mask=valid, other=0.0).to(tl.float32) * inv_t)
            if byte > 0:
                valid = valid & ((key >> (shift + 8)) == prefix)
            counts += tl.histogram(((key >> shift) & 0xFF).to(tl.int32), 256, mask=valid)
        at_least = tl.sum(counts, 0) - tl.cumsum(counts, 0) + counts  # keys whose byte is >= the bin's
        pick = tl.max(tl.where(at_least >= rank, bins, -1), 0)
        rank -= tl.sum(tl.where(bins > pick, counts, 0), 0)
        prefix = (prefix << 8) | pick.to(tl.uint32)
    bits = prefix ^ tl.where((prefix >> 31) == 1, 0x80000000, 0xFFFFFFFF).to(tl.uint32)
    return bits.to(tl.float32, bitcast=True)


def _top_p_sample_fn(  # noqa: C901 - Triton kernel body: its branches test HAS_TOP_K and runtime row settings
    Logits,
    Noise,
    Temperature,
    TopP,
    MinP,
    TopK,
    Out,
    V,
    stride_l,
    stride_n,
    HAS_TOP_K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    logits = Logits + row * stride_l
    noise = Noise + row * stride_n
    inv_t = 1.0 / tl.load(Temperature + row)
    top_p = tl.load(TopP + row)
    min_p = tl.load(MinP + row)
    offs = tl.arange(0, BLOCK)

    # Pass 1: max and sum of exp(x - max) per lane, merged at the end (x = logit / temperature).
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        idx = start + offs
        x = tl.load(logits + idx, mask=idx < V, other=float("-inf")).to(tl.float32) * inv_t
        m_new = tl.maximum(m, x)
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # lanes that saw only -inf keep s = 0
        s = s * tl.exp(m - shift) + tl.exp(x - shift)
        m = m_new
    x_max = tl.max(m, 0)
    total = tl.sum(s * tl.exp(m - x_max), 0)
    floor = tl.full([], float("-inf"), tl.float32)  # top-k: tokens must score at least this
    if HAS_TOP_K:
        k = tl.load(TopK + row)
        if (k > 0) & (k < V):
            floor = _kth_largest(logits, inv_t, k.to(tl.int32), V, offs, BLOCK)
            kept = tl.zeros([BLOCK], tl.float32)
            for start in range(0, V, BLOCK):
                idx = start + offs
                x = tl.load(logits + idx, mask=idx < V, other=float("-inf")).to(tl.float32) * inv_t
                kept += tl.where(x >= floor, tl.exp(x - x_max), 0.0)
            total = tl.sum(kept, 0)
    budget = top_p * total  # in units of exp(x - x_max): the most likely token weighs 1

    low = tl.full([], -1.0, tl.float32)  # tokens must weigh more than this
    token = tl.full([], 0, tl.int32)
    searching = tl.full([], 1, tl.int32)
    while searching == 1:
        # The race among the tokens above ``low`` and the min-p floor (first index on ties, as argmax).
        best = tl.full([BLOCK], -1.0, tl.float32)
        best_idx = tl.full([BLOCK], 0, tl.int32)
        best_e = tl.zeros([BLOCK], tl.float32)
        for start in range(0, V, BLOCK):
            idx = start + offs
            valid = idx < V
            x = tl.load(logits + idx, mask=valid, other=float("-inf")).to(tl.float32) * inv_t
            q = tl.load(noise + idx, mask=valid, other=1.0)
            e = tl.exp(x - x_max)
            score = tl.where(valid & (e > low) & (e >= min_p) & (x >= floor), e / q, -1.0)
            better = score > best
            best = tl.where(better, score, best)
            best_idx = tl.where(better, idx, best_idx)
            best_e = tl.where(better, e, best_e)
        winner = tl.max(best, 0)
        token = tl.min(tl.where(best == winner, best_idx, V), 0)
        # the winner's weight as this pass computed it: ``low`` then excludes it for sure
        e_token = tl.max(tl.where((best == winner) & (best_idx == token), best_e, -1.0), 0)
        if (top_p >= 1.0) | (winner < 0.0):  # no top-p; or nothing left (NaN logits): stop
            searching = 0
        else:
            above = tl.zeros([BLOCK], tl.float32)
            for start in range(0, V, BLOCK):
                idx = start + offs
                x = tl.load(logits + idx, mask=idx < V, other=float("-inf")).to(tl.float32) * inv_t
                e = tl.exp(x - x_max)
                above += tl.where(e > e_token, e, 0.0)
            if tl.sum(above, 0) < budget:
                searching = 0
            else:
                low = e_token
    tl.store(Out + row, token)


_top_p_sample = DualKernel(_top_p_sample_fn)


def top_p_sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    noise: torch.Tensor,
    block: int = 8192,
    top_k: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [B, V] (unit last stride), temperature / top_p / min_p [B] fp32 (temperature > 0), noise [B, V]
    fp32 Exp(1) draws -> [B] long: per row, ``argmax(softmax(logits / t) / noise)`` over the tokens that
    top-k (``top_k`` [B] integers, 0 or >= V: off), then top-p, then min-p keep (``layers/sampler.py``'s
    filters)."""
    rows, vocab = logits.shape
    assert logits.stride(-1) == 1 and noise.stride(-1) == 1 and noise.shape == logits.shape
    out = torch.empty(rows, dtype=torch.int32, device=logits.device)
    if rows:
        block = min(block, triton.next_power_of_2(vocab))
        _top_p_sample[logits.device][(rows,)](
            logits,
            noise,
            temperature.float().contiguous(),
            top_p.float().contiguous(),
            min_p.float().contiguous(),
            top_k.to(torch.int32).contiguous() if top_k is not None else out,
            out,
            vocab,
            logits.stride(0),
            noise.stride(0),
            HAS_TOP_K=top_k is not None,
            BLOCK=block,
            num_warps=16 if block >= 4096 else 4,
        )
    return out.long()


__all__ = ["top_p_sample"]
