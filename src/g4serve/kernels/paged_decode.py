"""Paged decode attention (one query token per sequence) over ``PagedKVCache``, and its torch reference.

Grid (sequence, KV head, split): a program loads the query rows of every q head that shares its KV
head (GQA) as one [BLOCK_H, D] tile, so each K/V row is read from memory once per group, and streams
its share of the context in BLOCK_N-key tiles with an online softmax in fp32. Long contexts are split
over several programs (flash-decoding); a second kernel merges their partial (max, sum, acc). The
split count is fixed per launch (a CUDA graph fixes it for the longest context it serves), so a short
context leaves most splits without tiles: those write nothing and the merge reads only the used ones.
Merging in the split kernel's last program per (sequence, KV head) instead (an acq_rel counter, as the FP8
split-K GEMM does) was measured slower on an H100 (`5e91fab`, reverted): e4b B = 1 4.02 against 3.94 ms, 31B
FP8 12.96 against 12.87 ms; the second kernel's launch hides under dependent launch, and its merge runs
over a program per head where the last program merges a KV head's group alone.
Sliding layers start at the tile holding ``seq_len - window``: older blocks are never touched (a
sliding pool may already have freed them; their table entries are -1). An FP8 (e4m3) cache is widened to
q's dtype as it is loaded (exactly: every e4m3 value is a bf16 / fp16 value); its KV head's K scale
multiplies the scores and its V scale the accumulator, so no dequantized tile is ever rounded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from g4serve import envs
from g4serve.kernels._launch import DualKernel, dot_settings, next_pow2, pdl, wait_for_previous_kernel
from g4serve.kernels.kv_cache_write import KV_FP8_DTYPE
from g4serve.kernels.paged_prefill import paged_prefill_reference

LOG2E = 1.4426950408889634
# The split-KV policy's target of programs per SM (G4SERVE_DECODE_PROGRAMS_PER_SM; A/B runs). A captured CUDA
# graph keeps the split count it was captured with.
PROGRAMS_PER_SM = envs.get_int("G4SERVE_DECODE_PROGRAMS_PER_SM")
# Sequence lengths, the first tile's block-table entries and the KV scales loaded before the dependent-launch
# wait (G4SERVE_DECODE_EARLY_TABLE=0: after it; A/B runs). No kernel of a step writes them, and what the
# kernels before the previous one wrote is visible here: each kernel lets its successor launch only after its
# own wait. On an H100 (2026-12-07) a small gain: 31B FP8 + FP8 KV at batch 1 13.37 against 13.38-13.39 ms;
# e4b bf16 at 4,096-token contexts, batch 8, 5.33 against 5.37-5.38.
EARLY_TABLE = envs.get("G4SERVE_DECODE_EARLY_TABLE") == "1"


@triton.jit
def _split_tiles(
    ctx, span_hi, window, num_splits, BLOCK_N: tl.constexpr, SLIDING: tl.constexpr, HAS_SPANS: tl.constexpr
):
    """The key tiles of a sequence's query and their split: (first key, first tile, number of tiles,
    tiles per split). Keys [start, end): the causal context [0, ctx) (the query sits at ctx - 1), widened
    by a bidirectional span ending at ``span_hi``, cut by the sliding window. Splits from
    cdiv(num_tiles, tiles_per_split) on have no tiles."""
    end = ctx
    if HAS_SPANS:
        end = tl.maximum(end, span_hi)
    start = ctx * 0
    if SLIDING:
        start = tl.maximum(ctx - window, 0)
    first_tile = start // BLOCK_N
    num_tiles = tl.cdiv(end, BLOCK_N) - first_tile
    return start, first_tile, num_tiles, tl.cdiv(num_tiles, num_splits)


@triton.jit
def _tile_keys(tile, offs_n0, ctx, span_lo, span_hi, start, BLOCK_N: tl.constexpr, HAS_SPANS: tl.constexpr):
    """A key tile's positions and which of them the query sees (causal, its span, the window's start)."""
    offs_n = tile * BLOCK_N + offs_n0
    visible = offs_n < ctx
    if HAS_SPANS:
        visible = visible | ((offs_n >= span_lo) & (offs_n < span_hi))
    return offs_n, visible & (offs_n >= start)


def _paged_decode_fn(  # noqa: C901 - Triton kernel body: its branches test tl.constexpr flags (HAS_SPANS, UPCAST, KV_FP8, SPLIT), specialised away at compile time
    Q,
    K,
    V,
    BlockTables,
    SeqLens,
    SpanLo,
    SpanHi,
    Out,
    PartM,
    PartL,
    PartAcc,
    KScale,
    VScale,
    stride_qb,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_ob,
    stride_oh,
    stride_pb,
    stride_ph,  # PartM / PartL [B, Hq, S] (split stride 1)
    stride_ab,
    stride_ah,
    stride_as,  # PartAcc [B, Hq, S, D] (dim stride 1)
    qk_scale,
    window,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    SLIDING: tl.constexpr,
    HAS_SPANS: tl.constexpr,
    SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
    EARLY_TABLE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if not EARLY_TABLE:
        wait_for_previous_kernel(USE_PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if KV_FP8:
        qk_scale = qk_scale * tl.load(KScale + kvh)  # the K scale, applied to the scores

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n0 = tl.arange(0, BLOCK_N)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_h

    ctx = tl.load(SeqLens + b)
    span_lo = ctx
    span_hi = ctx
    if HAS_SPANS:
        span_lo = tl.load(SpanLo + b)
        span_hi = tl.load(SpanHi + b)
    start, first_tile, num_tiles, tiles_per_split = _split_tiles(
        ctx, span_hi, window, num_splits, BLOCK_N, SLIDING, HAS_SPANS
    )
    tile_lo = first_tile + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, first_tile + num_tiles)
    table = BlockTables + b * stride_bt
    # the first tile's pages, loaded with the lengths (the loop's other tiles load their own)
    offs_n, visible = _tile_keys(tile_lo, offs_n0, ctx, span_lo, span_hi, start, BLOCK_N, HAS_SPANS)
    first_pages = tl.load(table + offs_n // PAGE_SIZE, mask=visible & (tile_lo < tile_hi), other=0)
    if EARLY_TABLE:  # lengths, tables and scales are written before the step: only q and K/V need the wait
        wait_for_previous_kernel(USE_PDL)

    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    k_base = K + kvh * stride_kh
    v_base = V + kvh * stride_vh

    for tile in range(tile_lo, tile_hi):
        offs_n, visible = _tile_keys(tile, offs_n0, ctx, span_lo, span_hi, start, BLOCK_N, HAS_SPANS)
        later = tile != tile_lo  # (a load masked off reads nothing)
        page = tl.load(table + offs_n // PAGE_SIZE, mask=visible & later, other=0)
        page = tl.where(later, page, first_pages)
        slot = tl.maximum(page, 0).to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE
        kv_mask = visible[:, None] & d_mask[None, :]
        k = tl.load(k_base + slot[:, None] * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + slot[:, None] * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0)
        if KV_FP8:
            k = k.to(Q.dtype.element_ty)
            v = v.to(Q.dtype.element_ty)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_H, BLOCK_N], log2 units
        s = tl.where(visible[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a fully masked tile must not make NaNs
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(v.dtype)  # as flash kernels do: P rounded to the V dtype, products accumulated in fp32
        if UPCAST:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new
    if KV_FP8:
        acc = acc * tl.load(VScale + kvh)  # the V scale; partials of a split merge linearly

    if SPLIT:
        used = h_mask & (split * tiles_per_split < num_tiles)  # a split without tiles writes nothing
        row = b * stride_pb + heads * stride_ph + split
        tl.store(PartM + row, m_i, mask=used)
        tl.store(PartL + row, l_i, mask=used)
        acc_ptrs = PartAcc + b * stride_ab + heads[:, None] * stride_ah + split * stride_as + offs_d[None, :]
        tl.store(acc_ptrs, acc, mask=used[:, None] & d_mask[None, :])
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        out_ptrs = Out + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptrs, out.to(Out.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])


def _paged_decode_reduce_fn(
    PartM,
    PartL,
    PartAcc,
    Out,
    SeqLens,
    SpanHi,
    stride_pb,
    stride_ph,
    stride_ab,
    stride_ah,
    stride_as,
    stride_ob,
    stride_oh,
    window,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SLIDING: tl.constexpr,
    HAS_SPANS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    ctx = tl.load(SeqLens + b)
    span_hi = ctx
    if HAS_SPANS:
        span_hi = tl.load(SpanHi + b)
    _, _, num_tiles, tiles_per_split = _split_tiles(
        ctx, span_hi, window, num_splits, BLOCK_N, SLIDING, HAS_SPANS
    )
    m = float("-inf")
    l_sum = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s in range(tl.cdiv(num_tiles, tiles_per_split)):  # the used splits only
        m_s = tl.load(PartM + b * stride_pb + h * stride_ph + s)
        l_s = tl.load(PartL + b * stride_pb + h * stride_ph + s)
        acc_s = tl.load(
            PartAcc + b * stride_ab + h * stride_ah + s * stride_as + offs_d, mask=d_mask, other=0.0
        )
        m_new = tl.maximum(m, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # empty splits carry (-inf, 0, 0)
        alpha = tl.exp2(m - m_safe)
        beta = tl.exp2(m_s - m_safe)
        acc = acc * alpha + acc_s * beta
        l_sum = l_sum * alpha + l_s * beta
        m = m_new
    out = acc / tl.where(l_sum == 0.0, 1.0, l_sum)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=d_mask)


_paged_decode = DualKernel(_paged_decode_fn)
_paged_decode_reduce = DualKernel(_paged_decode_reduce_fn)


def decode_config(head_dim: int, kv_fp8: bool = False) -> dict[str, int]:
    """Tile sizes per head dim and cache dtype. On an H100 the bf16 ones reach 2.0-3.0 TB/s from 8 x 4096
    tokens up; a sweep (bench/attention_kernels.py --sweep) found other tiles within 3%.

    A [BLOCK_N, 512] bf16 K or V tile is 32 KiB at BLOCK_N=32; two pipeline stages of K and V then fill
    128 KiB of shared memory, so D=512 halves BLOCK_N rather than the number of stages. An FP8 (``kv_fp8``)
    tile holds half the bytes, so the same bytes in flight take twice the keys: on an H100 at 26b-a4b's
    seed shapes (30 sequences) the bf16 tiles left the FP8 kernel at 1.4-1.6 TB/s, 0.087 / 0.192 ms at
    D = 256 / 512 (1,024 / 3,000 keys) where its sweep's best took 0.076 (64 keys, 8 warps, 2 stages) and
    0.118 ms (64 keys, 4 warps, 1 stage): a [64, 512] e4m3 tile is the 32 KiB of bf16's [32, 512].
    """
    if kv_fp8:
        if head_dim <= 256:
            return {"block_n": 64, "num_warps": 8, "num_stages": 2}
        return {"block_n": 64, "num_warps": 4, "num_stages": 1}
    if head_dim <= 256:
        return {"block_n": 64, "num_warps": 4, "num_stages": 2}
    return {"block_n": 32, "num_warps": 8, "num_stages": 2}


def decode_num_splits(
    num_seqs: int,
    num_kv_heads: int,
    max_kv_len: int,
    block_n: int,
    num_sms: int = 132,
    min_tiles_per_split: int = 4,
    max_splits: int = 64,
    programs_per_sm: int | None = None,
) -> int:
    """Split-KV policy: enough programs for ``programs_per_sm`` per SM (default ``PROGRAMS_PER_SM``, 4), each
    with at least ``min_tiles_per_split`` tiles.

    Deterministic in its (host-side) inputs, so a CUDA-graph capture can fix it per batch size by
    passing the longest context the graph will serve. At a large batch that cuts short contexts into
    splits of a tile or two; giving a split at least 4 tiles there (one program and no merge for a short
    context) measured slower on an H100 (e4b B = 64: 6.10 against 6.01 ms; docs/benchmarks.md, 2026-12-06).
    """
    programs = num_seqs * num_kv_heads
    per_sm = PROGRAMS_PER_SM if programs_per_sm is None else programs_per_sm
    want = -(-per_sm * num_sms // max(programs, 1))
    by_length = -(-max(max_kv_len, 1) // (block_n * min_tiles_per_split))
    return max(1, min(want, by_length, max_splits))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    window: int | None = None,
    span_lo: torch.Tensor | None = None,
    span_hi: torch.Tensor | None = None,
    scale: float = 1.0,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    num_sms: int = 132,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, Hq, D] (one query per sequence, at position ``seq_lens[b] - 1``); k/v_cache [S, Hkv, D];
    block_tables [B, max_blocks] int32; seq_lens [B] int32 -> [B, Hq, D] in q's dtype.

    Keys [0, seq_len) are visible; with ``window`` only keys >= seq_len - window. ``span_lo/hi`` [B]
    int32 (-1: none) add keys [lo, hi) (a bidirectional span holding the query; hi <= the number of
    keys in the cache). ``num_splits`` None: chosen from ``max_seq_len`` (or the longest seq_len,
    which costs a device sync) by ``decode_num_splits``. An FP8 cache takes ``k_scale`` / ``v_scale``
    [Hkv] fp32: its rows hold K / k_scale and V / v_scale.
    """
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    assert num_q_heads % num_kv_heads == 0
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    group = num_q_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    fp8 = k_cache.dtype == KV_FP8_DTYPE
    assert not fp8 or (k_scale is not None and v_scale is not None), "an FP8 cache needs its scales"
    cfg = decode_config(head_dim, fp8)
    block_n = block_n or cfg["block_n"]
    if num_splits is None:
        if max_seq_len is None:
            max_seq_len = max(int(seq_lens.max()), int(span_hi.max()) if span_hi is not None else 0)
        kv_len = min(max_seq_len, window + block_n) if window else max_seq_len
        num_splits = decode_num_splits(batch, num_kv_heads, kv_len, block_n, num_sms)
    upcast, precision = dot_settings(q.dtype, q.device)
    has_spans = span_lo is not None
    if not has_spans:
        span_lo = span_hi = seq_lens  # never read
    split = num_splits > 1
    if split:
        part_m = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(batch, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = out  # never written
    block_d = max(16, next_pow2(head_dim))
    _paged_decode[q.device][(batch, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        span_lo,
        span_hi,
        out,
        part_m,
        part_l,
        part_acc,
        k_scale if fp8 else seq_lens,  # never read without KV_FP8
        v_scale if fp8 else seq_lens,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        part_m.stride(0) if split else 0,
        part_m.stride(1) if split else 0,
        *(part_acc.stride()[:3] if split else (0, 0, 0)),
        scale * LOG2E,
        int(window or 0),
        num_splits,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        GROUP=group,
        BLOCK_H=max(16, next_pow2(group)),
        BLOCK_N=block_n,
        PAGE_SIZE=page_size,
        SLIDING=bool(window),
        HAS_SPANS=has_spans,
        SPLIT=split,
        UPCAST=upcast,
        DOT_PRECISION=precision,
        KV_FP8=fp8,
        EARLY_TABLE=EARLY_TABLE,
        **pdl(q.device, batch),
        num_warps=num_warps or cfg["num_warps"],
        num_stages=num_stages or cfg["num_stages"],
    )
    if split:
        _paged_decode_reduce[q.device][(batch, num_q_heads)](
            part_m,
            part_l,
            part_acc,
            out,
            seq_lens,
            span_hi,
            part_m.stride(0),
            part_m.stride(1),
            part_acc.stride(0),
            part_acc.stride(1),
            part_acc.stride(2),
            out.stride(0),
            out.stride(1),
            int(window or 0),
            num_splits,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_N=block_n,
            SLIDING=bool(window),
            HAS_SPANS=has_spans,
            **pdl(q.device, batch),
            num_warps=4 if head_dim <= 256 else 8,
        )
    return out


def paged_decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    window: int | None = None,
    span_lo: torch.Tensor | None = None,
    span_hi: torch.Tensor | None = None,
    scale: float = 1.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same contract as ``paged_decode_attention``, in fp32: the one-query-per-sequence case of
    ``paged_prefill_reference`` (query at position seq_len - 1; keys up to a span's end past it)."""
    positions = seq_lens.long() - 1
    key_lens = seq_lens.long() if span_hi is None else torch.maximum(seq_lens.long(), span_hi.long())
    query_start_loc = torch.arange(q.shape[0] + 1, device=q.device)
    return paged_prefill_reference(
        q,
        k_cache,
        v_cache,
        block_tables,
        key_lens,
        query_start_loc,
        positions,
        page_size,
        window=window,
        span_lo=span_lo,
        span_hi=span_hi,
        scale=scale,
        k_scale=k_scale,
        v_scale=v_scale,
    )


__all__ = ["decode_config", "decode_num_splits", "paged_decode_attention", "paged_decode_reference"]
