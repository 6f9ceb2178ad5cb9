"""Paged varlen (prefill / chunked-prefill) attention over ``PagedKVCache``, and its torch reference.

Queries are flat [T, Hq, D] with ``query_start_loc``; every key comes from the paged cache (the new
chunk is written first), so a chunk that starts mid-sequence after a prefix-cache hit needs nothing
special. Grid (query tile, sequence, KV head x output-dim chunk): a tile packs BLOCK_M // G query
tokens times the G q heads of one KV head into BLOCK_M rows, so each K/V tile is loaded once per GQA
group. Masks: causal by position, sliding window, and an optional per-query bidirectional range
[lo, hi) (image tokens on sliding layers). Scores, softmax and the accumulator are fp32. An FP8 (e4m3)
cache is widened to q's dtype as it is loaded (exact); its KV head's K scale multiplies the scores and its
V scale the output, as in ``paged_decode``.
"""

from __future__ import annotations

import torch
import triton.language as tl

from g4serve.kernels._launch import DualKernel, dot_settings, next_pow2, sm_count
from g4serve.kernels.kv_cache_write import KV_FP8_DTYPE, dequantize_kv_reference

LOG2E = 1.4426950408889634


def _paged_prefill_fn(  # noqa: C901 - Triton kernel body: its branches test tl.constexpr flags (SLIDING, HAS_SPANS, HAS_SEQ_INDICES, UPCAST, KV_FP8), specialised away at compile time
    Q,
    K,
    V,
    Out,
    BlockTables,
    SeqLens,
    QueryStartLoc,
    Positions,
    SpanLo,
    SpanHi,
    SeqIndices,
    KScale,
    VScale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_bt,
    qk_scale,
    window,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    NUM_DV_CHUNKS: tl.constexpr,
    GROUP: tl.constexpr,
    QUERIES_PER_TILE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    SLIDING: tl.constexpr,
    HAS_SPANS: tl.constexpr,
    HAS_SEQ_INDICES: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    tile_idx = tl.program_id(0)
    seq = tl.program_id(1)
    kvh = tl.program_id(2) // NUM_DV_CHUNKS
    dv_chunk = tl.program_id(2) % NUM_DV_CHUNKS
    if HAS_SEQ_INDICES:
        seq = tl.load(SeqIndices + seq)
    q_start = tl.load(QueryStartLoc + seq)
    q_end = tl.load(QueryStartLoc + seq + 1)
    tile_q0 = q_start + tile_idx * QUERIES_PER_TILE
    if tile_q0 >= q_end:
        return
    if KV_FP8:
        qk_scale = qk_scale * tl.load(KScale + kvh)  # the K scale, applied to the scores

    # Row r of the tile is query token tile_q0 + r // GROUP, q head kvh * GROUP + r % GROUP: the G heads
    # of one token are adjacent in memory, so the Q gather stays contiguous per token.
    rows = tl.arange(0, BLOCK_M)
    q_local = rows // GROUP
    q_idx = tile_q0 + q_local
    row_valid = (q_local < QUERIES_PER_TILE) & (q_idx < q_end)
    heads = kvh * GROUP + rows % GROUP
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = dv_chunk * BLOCK_DV + tl.arange(0, BLOCK_DV)
    d_mask = offs_d < HEAD_DIM
    dv_mask = offs_dv < HEAD_DIM
    offs_n0 = tl.arange(0, BLOCK_N)

    q_row = q_idx.to(tl.int64) * stride_qt + heads * stride_qh
    q = tl.load(Q + q_row[:, None] + offs_d[None, :], mask=row_valid[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    pos = tl.load(Positions + q_idx, mask=row_valid, other=0).to(tl.int32)

    # Keys this tile can see: [start, end) with end past the last query's position (or its span).
    seq_len = tl.load(SeqLens + seq)
    end = tl.max(tl.where(row_valid, pos, -1), 0) + 1
    if HAS_SPANS:
        span_lo = tl.load(SpanLo + q_idx, mask=row_valid, other=-1)
        span_hi = tl.load(SpanHi + q_idx, mask=row_valid, other=-1)
        end = tl.maximum(end, tl.max(span_hi, 0))
    end = tl.minimum(end, seq_len)
    start = end * 0
    if SLIDING:
        start = tl.maximum(tl.min(tl.where(row_valid, pos, 2147483647), 0) - window + 1, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    k_base = K + kvh * stride_kh
    v_base = V + kvh * stride_vh
    table = BlockTables + seq * stride_bt

    for n0 in range((start // BLOCK_N) * BLOCK_N, end, BLOCK_N):
        offs_n = n0 + offs_n0
        in_range = (offs_n >= start) & (offs_n < end)
        page = tl.load(table + offs_n // PAGE_SIZE, mask=in_range, other=0)
        slot = tl.maximum(page, 0).to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE
        k = tl.load(
            k_base + slot[:, None] * stride_kt + offs_d[None, :],
            mask=in_range[:, None] & d_mask[None, :],
            other=0.0,
        )
        if KV_FP8:
            k = k.to(Q.dtype.element_ty)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units

        allowed = offs_n[None, :] <= pos[:, None]
        if HAS_SPANS:
            allowed = allowed | ((offs_n[None, :] >= span_lo[:, None]) & (offs_n[None, :] < span_hi[:, None]))
        if SLIDING:
            allowed = allowed & (offs_n[None, :] > pos[:, None] - window)
        allowed = allowed & in_range[None, :]
        s = tl.where(allowed, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet stay finite
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_base + slot[:, None] * stride_vt + offs_dv[None, :],
            mask=in_range[:, None] & dv_mask[None, :],
            other=0.0,
        )
        if KV_FP8:
            v = v.to(Q.dtype.element_ty)
        p = p.to(v.dtype)  # P rounded to the V dtype as in flash kernels; products accumulate in fp32
        if UPCAST:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if KV_FP8:
        out = out * tl.load(VScale + kvh)
    o_row = q_idx.to(tl.int64) * stride_ot + heads * stride_oh
    tl.store(
        Out + o_row[:, None] + offs_dv[None, :],
        out.to(Out.dtype.element_ty),
        mask=row_valid[:, None] & dv_mask[None, :],
    )


_paged_prefill = DualKernel(_paged_prefill_fn)


def prefill_config(
    head_dim: int, group: int, num_programs_hint: int | None = None, num_sms: int | None = None
) -> dict[str, int]:
    """Tile sizes per head dim, from sweeps on an H100 (bench/attention_kernels.py --sweep).

    D=256: 128-row tiles, 64 keys, 8 warps, 2 stages (8 q / 2 KV heads, 8 x 512-token chunks at 4096
    context: 0.38 ms, ~340 TFLOP/s; the next best tiles were 1.15x slower). D=512: the fp32
    accumulator of a 128 x 512 tile needs 256 registers a thread at 8 warps (ptxas fails at 16) and
    64-row tiles leave the tensor cores underfed (1.5-1.7 ms), so the output dims are split over two
    programs that each recompute Q.K^T (``dv_chunks=2``: 1.35 ms, ~190 useful TFLOP/s).
    When those tiles would give at most half as many programs as the GPU has SMs (one short prompt on
    few KV heads), 64-row tiles on 4 warps are 1.2x faster. Dims up to 128 are untuned (tests only).
    """
    if head_dim <= 128:
        cfg = {
            "block_m": 128,
            "block_n": 64,
            "num_warps": 8 if head_dim > 64 else 4,
            "num_stages": 2,
            "dv_chunks": 1,
        }
    elif head_dim <= 256:
        cfg = {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 2, "dv_chunks": 1}
    else:
        cfg = {"block_m": 128, "block_n": 32, "num_warps": 8, "num_stages": 2, "dv_chunks": 2}
    if num_programs_hint is not None and num_sms and num_programs_hint * 2 <= num_sms and head_dim > 128:
        cfg = {
            "block_m": 64,
            "block_n": 64 if head_dim <= 256 else 32,
            "num_warps": 4,
            "num_stages": 2,
            "dv_chunks": cfg["dv_chunks"],
        }
    cfg["block_m"] = max(cfg["block_m"], next_pow2(group))
    return cfg


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    page_size: int,
    max_query_len: int,
    window: int | None = None,
    span_lo: torch.Tensor | None = None,
    span_hi: torch.Tensor | None = None,
    seq_indices: torch.Tensor | None = None,
    scale: float = 1.0,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    dv_chunks: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, Hq, D] flat; k/v_cache [S, Hkv, D]; block_tables [B, max_blocks] int32; seq_lens [B];
    query_start_loc [B+1] int32; positions [T] (absolute) -> [T, Hq, D] in q's dtype.

    Query t of sequence b sees keys k < seq_lens[b] with k <= positions[t], or lo <= k < hi for its
    ``span_lo/hi[t]`` (-1: none); with ``window`` only keys k > positions[t] - window.
    ``seq_indices`` restricts the work to those sequences (rows of other sequences are left untouched
    in ``out``); ``max_query_len`` bounds their query counts (host-side, sizes the grid). An FP8 cache
    takes ``k_scale`` / ``v_scale`` [Hkv] fp32: its rows hold K / k_scale and V / v_scale.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    assert num_q_heads % num_kv_heads == 0
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    group = num_q_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    num_seqs = seq_indices.shape[0] if seq_indices is not None else seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0 or max_query_len == 0:
        return out
    cfg = prefill_config(head_dim, group)
    if q.is_cuda and block_m is None:  # few programs (a short prompt on few KV heads): smaller tiles
        programs = -(-max_query_len // (cfg["block_m"] // group)) * num_seqs * num_kv_heads * cfg["dv_chunks"]
        cfg = prefill_config(head_dim, group, programs, sm_count(q.device.index or 0))
    block_m = max(block_m or cfg["block_m"], next_pow2(group))
    block_n = block_n or cfg["block_n"]
    dv_chunks = dv_chunks or cfg["dv_chunks"]
    block_d = max(16, next_pow2(head_dim))
    block_dv = block_d // dv_chunks
    queries_per_tile = block_m // group
    upcast, precision = dot_settings(q.dtype, q.device)
    has_spans = span_lo is not None
    if not has_spans:
        span_lo = span_hi = positions  # never read
    fp8 = k_cache.dtype == KV_FP8_DTYPE
    assert not fp8 or (k_scale is not None and v_scale is not None), "an FP8 cache needs its scales"
    grid = (-(-max_query_len // queries_per_tile), num_seqs, num_kv_heads * dv_chunks)
    _paged_prefill[q.device][grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        seq_lens,
        query_start_loc,
        positions,
        span_lo,
        span_hi,
        seq_indices if seq_indices is not None else seq_lens,
        k_scale if fp8 else seq_lens,  # never read without KV_FP8
        v_scale if fp8 else seq_lens,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        scale * LOG2E,
        int(window or 0),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_DV=block_dv,
        NUM_DV_CHUNKS=dv_chunks,
        GROUP=group,
        QUERIES_PER_TILE=queries_per_tile,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        PAGE_SIZE=page_size,
        SLIDING=bool(window),
        HAS_SPANS=has_spans,
        HAS_SEQ_INDICES=seq_indices is not None,
        UPCAST=upcast,
        DOT_PRECISION=precision,
        KV_FP8=fp8,
        num_warps=num_warps or cfg["num_warps"],
        num_stages=num_stages or cfg["num_stages"],
    )
    return out


def paged_prefill_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    page_size: int,
    window: int | None = None,
    span_lo: torch.Tensor | None = None,
    span_hi: torch.Tensor | None = None,
    scale: float = 1.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same contract as ``paged_prefill_attention``, one sequence at a time in fp32 (an FP8 cache's rows
    dequantized first: times ``k_scale`` / ``v_scale``)."""
    out = torch.zeros_like(q)
    group = q.shape[1] // k_cache.shape[1]
    starts = query_start_loc.tolist()
    for b in range(seq_lens.shape[0]):
        lo_t, hi_t = starts[b], starts[b + 1]
        if hi_t == lo_t:
            continue
        kv_pos = torch.arange(int(seq_lens[b]), device=q.device)
        q_pos = positions[lo_t:hi_t].long()
        allowed = kv_pos[None, :] <= q_pos[:, None]
        if span_lo is not None:
            lo, hi = span_lo[lo_t:hi_t].long(), span_hi[lo_t:hi_t].long()
            allowed |= (kv_pos[None, :] >= lo[:, None]) & (kv_pos[None, :] < hi[:, None])
        if window:
            allowed &= kv_pos[None, :] > q_pos[:, None] - window
        seen = allowed.any(0)  # gather only keys some query sees: freed (-1) blocks are never touched
        kv_pos, allowed = kv_pos[seen], allowed[:, seen]
        slots = block_tables[b, kv_pos // page_size].long() * page_size + kv_pos % page_size
        keys = dequantize_kv_reference(k_cache[slots], k_scale).repeat_interleave(group, dim=1)
        values = dequantize_kv_reference(v_cache[slots], v_scale).repeat_interleave(group, dim=1)
        scores = torch.einsum("lhd,shd->hls", q[lo_t:hi_t].float(), keys) * scale
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[lo_t:hi_t] = torch.einsum("hls,shd->lhd", probs, values).to(q.dtype)
    return out


__all__ = ["paged_prefill_attention", "paged_prefill_reference", "prefill_config"]
