"""Sampling over vocabulary chunks: temperature, top-k (up to ``MAX_TOP_K``), top-p over it, and min-p, with
every pass spread over many programs a row.

The sampler draws a token as the exponential race ``argmax_i p_i / q_i`` (q ~ Exp(1)) over the tokens its
filters keep (``layers/sampler.py``). ``kernels/top_p_sample.py`` runs it in one program per row, which reads
the row several times from one SM (latency-bound: ~0.14 ms at one row on an H100), after a launch that
writes the [B, V] noise and a float copy of the logits; a top-k went through ``torch.topk`` over the whole
vocabulary instead. Here the row is cut into chunks of ``CHUNK`` logits, a program each, and the work is:

1. ``_chunk_scan``: each chunk's max of the scaled logits (x = logit / temperature) and, with top-k, its K
   best values (``tl.topk``, K the batch's largest k rounded up to a power of two): the row's K best values
   are among the chunks' K best, as a multiset (ties included);
2. ``_row_floor`` (top-k only), a program a row: the k-th best value t_k from the chunks' candidates; with
   top-p, the mass of the top-k set, exp(x - x_max) summed over the tokens scoring at least t_k (the tokens
   above t_k are all candidates; those equal to it are counted over the row in the rare case they fill the
   candidates to the end), then top-p over that set: a token is kept when the kept tokens scoring more than
   it hold less than ``top_p`` of the set's mass (ties stay together, as in ``top_p_sample``). The row's
   floor is the lowest kept value: the kept set is exactly the tokens scoring at least the floor;
3. ``_chunk_race``: each chunk's race winner among the tokens at or above the floor and above the min-p cut
   (e = exp(x - x_max) >= min_p), with the noise drawn in place (``philox.exponential_draws``: the same
   draws ``exponential_noise`` writes, keyed by seed, position and token);
4. ``_race_winner``: the row's winner over its chunks, the first index on ties as ``argmax``.

Rows with top-p but no top-k (their set may run to the whole vocabulary) keep ``top_p_sample``'s search; the
caller sends a batch here only when every sampled row fits (``SamplingBatch.chunk_top_k``). Same token as
``top_p_sample`` and the torch masks on the same noise, up to the rounding of the mass sums at the top-p
boundary (summed here over the sorted candidates).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from g4serve.kernels._launch import DualKernel
from g4serve.kernels.philox import exponential_draws

CHUNK = 4096  # logits a program scans (262,144 / 4,096 = 64 programs a row)
MAX_TOP_K = 128  # the largest top-k the chunks' candidates serve


@triton.jit
def _row_max(ChunkMax, row, S, S_POW2: tl.constexpr):
    """The row's max scaled logit, from its chunks' maxima."""
    s_offs = tl.arange(0, S_POW2)
    return tl.max(tl.load(ChunkMax + row * S + s_offs, mask=s_offs < S, other=float("-inf")), 0)


@triton.jit
def _scaled(Logits, row, stride_l, idx, V, inv_t):
    """The row's logits at ``idx`` (-inf past the vocabulary) in fp32, times 1 / temperature."""
    return tl.load(Logits + row * stride_l + idx, mask=idx < V, other=float("-inf")).to(tl.float32) * inv_t


def _chunk_scan_fn(
    Logits, Temperature, ChunkMax, Cands, V, stride_l, S,
    HAS_TOP_K: tl.constexpr, K: tl.constexpr, C: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    idx = chunk * C + tl.arange(0, C)
    x = _scaled(Logits, row, stride_l, idx, V, 1.0 / tl.load(Temperature + row))
    tl.store(ChunkMax + row * S + chunk, tl.max(x, 0))
    if HAS_TOP_K:
        tl.store(Cands + (row * S + chunk) * K + tl.arange(0, K), tl.topk(x, K))


def _row_floor_fn(
    Logits,
    Temperature,
    TopK,
    TopP,
    ChunkMax,
    Cands,
    Floor,
    V,
    stride_l,
    S,
    K: tl.constexpr,
    S_POW2: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    k = tl.load(TopK + row)
    floor = tl.full([], float("-inf"), tl.float32)
    if (k > 0) & (k < V):
        c_offs = tl.arange(0, S_POW2 * K)
        cands = tl.load(Cands + row * S * K + c_offs, mask=c_offs < S * K, other=float("-inf"))
        v = tl.topk(cands, K)  # the row's K best values, best first
        ranks = tl.arange(0, K)
        t_k = tl.max(tl.where(ranks == k - 1, v, float("-inf")), 0)
        floor = t_k
        top_p = tl.load(TopP + row)
        if top_p < 1.0:  # the top-k set's mass is top-p's budget; top-k alone needs only t_k
            x_max = _row_max(ChunkMax, row, S, S_POW2)
            e = tl.exp(v - x_max)
            mass = tl.sum(tl.where(v > t_k, e, 0.0), 0)
            ties = tl.sum((v == t_k).to(tl.int32), 0)
            if (tl.min(v, 0) == t_k) & (K < V):  # ties may run past the candidates: count them over the row
                inv_t = 1.0 / tl.load(Temperature + row)
                count = tl.zeros([BLOCK], tl.int32)
                for start in range(0, V, BLOCK):
                    idx = start + tl.arange(0, BLOCK)
                    count += (_scaled(Logits, row, stride_l, idx, V, inv_t) == t_k).to(tl.int32)
                ties = tl.sum(count, 0)
            if t_k > float("-inf"):
                mass += ties.to(tl.float32) * tl.exp(t_k - x_max)
            # the mass of the candidates scoring strictly more than each candidate
            above = tl.sum(tl.where(v[None, :] > v[:, None], e[None, :], 0.0), 1)
            kept = (v >= t_k) & (above < top_p * mass)
            floor = tl.min(tl.where(kept, v, float("inf")), 0)
    tl.store(Floor + row, floor)


def _chunk_race_fn(
    Logits,
    Temperature,
    MinP,
    Seeds,
    Positions,
    ChunkMax,
    Floor,
    Score,
    Index,
    V,
    stride_l,
    S,
    HAS_FLOOR: tl.constexpr,
    S_POW2: tl.constexpr,
    C: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    x_max = _row_max(ChunkMax, row, S, S_POW2)
    idx = chunk * C + tl.arange(0, C)
    valid = idx < V
    x = _scaled(Logits, row, stride_l, idx, V, 1.0 / tl.load(Temperature + row))
    e = tl.exp(x - x_max)
    q = exponential_draws(tl.load(Seeds + row), tl.load(Positions + row), idx)
    kept = valid & (e >= tl.load(MinP + row))
    if HAS_FLOOR:
        kept = kept & (x >= tl.load(Floor + row))
    score = tl.where(kept, e / q, -1.0)
    best = tl.max(score, 0)
    tl.store(Score + row * S + chunk, best)
    tl.store(Index + row * S + chunk, tl.min(tl.where(score == best, idx, V), 0))


def _race_winner_fn(Score, Index, Out, S, S_POW2: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    s_offs = tl.arange(0, S_POW2)
    score = tl.load(Score + row * S + s_offs, mask=s_offs < S, other=-2.0)
    index = tl.load(Index + row * S + s_offs, mask=s_offs < S, other=2**31 - 1)
    best = tl.max(score, 0)
    tl.store(Out + row, tl.min(tl.where(score == best, index, 2**31 - 1), 0).to(tl.int64))


_chunk_scan = DualKernel(_chunk_scan_fn)
_row_floor = DualKernel(_row_floor_fn)
_chunk_race = DualKernel(_chunk_race_fn)
_race_winner = DualKernel(_race_winner_fn)


def chunked_sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    max_top_k: int = 0,
    chunk: int = CHUNK,
) -> torch.Tensor:
    """logits [B, V] (any float dtype, unit last stride), temperature / min_p [B] fp32 (temperature > 0),
    seeds / positions [B] int64 (the noise's key and counter) -> [B] long: per row the race's winner over
    the tokens top-k (``top_k`` [B] integers, 0 or >= V: off), then top-p (``top_p`` [B]: only rows with a
    top-k may set one below 1), then min-p keep. ``max_top_k``: at least every row's top-k, at most
    ``MAX_TOP_K`` (0: no top-k)."""
    rows, vocab = logits.shape
    assert logits.stride(-1) == 1
    assert 0 <= max_top_k <= MAX_TOP_K and (max_top_k == 0 or top_k is not None)
    out = torch.empty(rows, dtype=torch.long, device=logits.device)
    if rows == 0:
        return out
    cands_k = triton.next_power_of_2(max_top_k) if max_top_k else 1
    c = max(min(chunk, triton.next_power_of_2(vocab)), cands_k)
    s = triton.cdiv(vocab, c)
    s_pow2 = triton.next_power_of_2(s)
    dev = logits.device
    temperature = temperature.float().contiguous()
    chunk_max = torch.empty(rows, s, dtype=torch.float32, device=dev)
    cands = torch.empty(rows, s, cands_k, dtype=torch.float32, device=dev) if max_top_k else chunk_max
    floor = torch.empty(rows, dtype=torch.float32, device=dev) if max_top_k else chunk_max
    score = torch.empty(rows, s, dtype=torch.float32, device=dev)
    index = torch.empty(rows, s, dtype=torch.int32, device=dev)
    warps = 8 if c >= 4096 else 4
    _chunk_scan[dev][(rows, s)](
        logits, temperature, chunk_max, cands, vocab, logits.stride(0), s,
        HAS_TOP_K=bool(max_top_k), K=cands_k, C=c, num_warps=warps,
    )  # fmt: skip
    if max_top_k:
        assert top_k is not None
        top_p = top_p if top_p is not None else torch.ones(rows, device=dev)
        _row_floor[dev][(rows,)](
            logits, temperature, top_k.to(torch.int32).contiguous(), top_p.float().contiguous(), chunk_max,
            cands, floor, vocab, logits.stride(0), s, K=cands_k, S_POW2=s_pow2, BLOCK=c, num_warps=warps,
        )  # fmt: skip
    _chunk_race[dev][(rows, s)](
        logits, temperature, min_p.float().contiguous(), seeds.contiguous(), positions.contiguous(),
        chunk_max, floor, score, index, vocab, logits.stride(0), s,
        HAS_FLOOR=bool(max_top_k), S_POW2=s_pow2, C=c, num_warps=warps,
    )  # fmt: skip
    _race_winner[dev][(rows,)](score, index, out, s, S_POW2=s_pow2)
    return out


__all__ = ["CHUNK", "MAX_TOP_K", "chunked_sample"]
