"""A dense decoder layer's MLP block at decode sizes in one persistent launch.

At batch 1-8 the block is ``gate_up`` (skinny GEMM with the activation fused), ``down`` (skinny GEMM or
cuBLAS) and the post-feed-forward ``add_rms_norm``: three launches, each of which waits for the one before
to drain before its weight stream starts in earnest. Here one grid of persistent programs takes the block's
tasks from a ticket counter, in dependency order:

1. ``gate_up`` tiles: ``act(x W_gate^T) * (x W_up^T)`` for ``BN_A`` intermediate units each, into a [M, I]
   workspace, rounded to the activation dtype exactly as the unfused kernels round it;
2. ``down`` tiles: ``BN_B`` hidden columns each, over the whole intermediate, into a [M, H] workspace;
3. one task per token row: ``out = (residual + rms_norm(y) * w) * scale`` and ``next_norm(out)``, the
   ``add_rms_norm`` of ``layers.fused``.

Each ``down`` task loads its first weight tile, then waits for the phase before it (a counter of finished
``gate_up`` tiles), so the weight stream of phase 2 overlaps the tail of phase 1; a program takes its next
ticket while it works on the current one. Tickets are handed out in dependency order, so a waiting task only
waits on tasks that running programs already hold: no deadlock whatever the grid size or residency (and in
Triton's interpreter, which runs the programs one after another, the first program takes every task in
order). Finished tiles are published with a CTA barrier and a release increment, read after an acquire with
L2-only (``.cg``) loads. The last program to leave puts the four counters back to zero for the next launch
(and the next replay of a captured CUDA graph), so each call site owns one counter buffer.

The block is the fused path of ``layers.fused.decode_mlp_block``, off unless ``G4SERVE_DECODE_MLP=1``: it
has interpreter tests and sm_90 compile tests; ``bench/decode_mlp.py`` measures it against the three
launches on a GPU before it may become the default.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from g4serve.kernels._launch import (
    DualKernel,
    dot_settings,
    next_pow2,
    pdl,
    sm_count,
    wait_for_previous_kernel,
)
from g4serve.kernels.act_mul import _KINDS
from g4serve.kernels.gemv import GATE_UP, MAX_ROWS, gated_epilogue, skinny_matmul_reference
from g4serve.kernels.rms_norm import fused_rms_norm_reference

COUNTERS = 4  # tickets handed out, gate_up tiles done, down tiles done, programs gone


@triton.jit
def _wait_count(C, target):
    """Spin until the counter at C reaches ``target`` (acquire), then let every thread of the program on."""
    done = tl.atomic_add(C, 0, sem="acquire")
    while done < target:
        done = tl.atomic_add(C, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit
def _signal(C):
    """Publish this program's stores: every thread's are issued (barrier), then a release increment."""
    tl.debug_barrier()
    tl.atomic_add(C, 1, sem="release")


@triton.jit
def _products(  # noqa: C901 - Triton helper: its branches test tl.constexpr flags (WAIT, GATED, USE_DOT, UPCAST), specialised away at compile time
    X,
    stride_x,
    W,
    stride_w,
    up_offset,
    offs_m,
    m_mask,
    offs_n,
    n_mask,
    K,
    C,
    target,
    WAIT: tl.constexpr,
    GATED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """fp32 products of token rows ``X[offs_m, :K]`` with weight rows ``W[offs_n, :K]`` -> (y, y_up), each
    [BLOCK_M, BLOCK_N] (``y_up``: the rows ``up_offset`` elements further, when GATED). The first weight tile
    is loaded before the wait for X (WAIT 0: the previous kernel, under PDL; 1: the counter at C reaching
    ``target``, X then read from L2); each next one before the current tile's math."""
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_w + offs_k[None, :]
    x_ptrs = X + offs_m[:, None] * stride_x + offs_k[None, :]
    w_mask = n_mask[:, None] & (offs_k < K)[None, :]
    w = tl.load(w_ptrs, mask=w_mask, other=0.0, eviction_policy="evict_first")
    u = w
    if GATED:
        u = tl.load(w_ptrs + up_offset, mask=w_mask, other=0.0, eviction_policy="evict_first")
    if WAIT == 0:
        wait_for_previous_kernel(USE_PDL)
    else:
        _wait_count(C, target)
    if USE_DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x_mask = m_mask[:, None] & ((k0 + offs_k) < K)[None, :]
        if WAIT == 0:
            x = tl.load(x_ptrs, mask=x_mask, other=0.0)
        else:
            x = tl.load(x_ptrs, mask=x_mask, other=0.0, cache_modifier=".cg")
        next_mask = n_mask[:, None] & ((k0 + BLOCK_K + offs_k) < K)[None, :]
        w_next = tl.load(w_ptrs + BLOCK_K, mask=next_mask, other=0.0, eviction_policy="evict_first")
        u_next = w_next
        if GATED:
            u_next = tl.load(
                w_ptrs + BLOCK_K + up_offset, mask=next_mask, other=0.0, eviction_policy="evict_first"
            )
        if USE_DOT:
            if UPCAST:
                x = x.to(tl.float32)
                w = w.to(tl.float32)
                u = u.to(tl.float32)
            acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
            if GATED:
                acc_up += tl.dot(x, tl.trans(u), input_precision=DOT_PRECISION)
        else:
            xf = x.to(tl.float32)  # [1, BLOCK_K]
            acc += w.to(tl.float32) * xf
            if GATED:
                acc_up += u.to(tl.float32) * xf
        w = w_next
        u = u_next
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if USE_DOT:
        y = acc
        y_up = acc_up
    else:
        y = tl.sum(acc, axis=1)[None, :]
        y_up = tl.sum(acc_up, axis=1)[None, :]
    return y, y_up


@triton.jit
def _add_norm_row(
    Y,
    Res,
    NormW,
    NextW,
    Scale,
    Out,
    Out2,
    row,
    H,
    eps,
    stride_r,
    HAS_SCALE: tl.constexpr,
    HAS_NORM2: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """``kernels.rms_norm``'s chain for one row of the [M, H] down output, in column chunks: statistics in
    fp32, each intermediate rounded where the unfused model rounds it."""
    cols = tl.arange(0, BLOCK_C)
    y_row = Y + row * H
    squares = tl.zeros([BLOCK_C], tl.float32)
    for c0 in range(0, H, BLOCK_C):
        x = tl.load(y_row + c0 + cols, mask=c0 + cols < H, other=0.0, cache_modifier=".cg").to(tl.float32)
        squares += x * x
    denom = tl.sqrt(tl.sum(squares, 0) / H + eps)
    out_ty = Out.dtype.element_ty
    squares2 = tl.zeros([BLOCK_C], tl.float32)
    for c0 in range(0, H, BLOCK_C):
        mask = c0 + cols < H
        x = tl.load(y_row + c0 + cols, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        y = (x / denom * tl.load(NormW + c0 + cols, mask=mask, other=0.0).to(tl.float32)).to(out_ty)
        r = tl.load(Res + row * stride_r + c0 + cols, mask=mask, other=0.0)
        y = (r.to(tl.float32) + y.to(tl.float32)).to(out_ty)
        if HAS_SCALE:
            y = (y.to(tl.float32) * tl.load(Scale).to(tl.float32)).to(out_ty)
        tl.store(Out + row * H + c0 + cols, y, mask=mask)
        z = y.to(tl.float32)
        squares2 += z * z
    if HAS_NORM2:
        denom2 = tl.sqrt(tl.sum(squares2, 0) / H + eps)
        tl.debug_barrier()
        for c0 in range(0, H, BLOCK_C):
            mask = c0 + cols < H
            z = tl.load(Out + row * H + c0 + cols, mask=mask, other=0.0).to(tl.float32)
            z = z / denom2 * tl.load(NextW + c0 + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(Out2 + row * H + c0 + cols, z.to(Out2.dtype.element_ty), mask=mask)


def _decode_mlp_fn(
    X,
    Res,
    Wgu,
    Wd,
    NormW,
    NextW,
    Scale,
    Inter,
    Y,
    Out,
    Out2,
    C,
    M,
    H,
    INTER,
    eps,
    stride_x,
    stride_r,
    BLOCK_M: tl.constexpr,
    BN_A: tl.constexpr,
    BK_A: tl.constexpr,
    BN_B: tl.constexpr,
    BK_B: tl.constexpr,
    BLOCK_C: tl.constexpr,
    ACT: tl.constexpr,
    USE_DOT: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_NORM2: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    num_a = tl.cdiv(INTER, BN_A)
    num_b = tl.cdiv(H, BN_B)
    total = num_a + num_b + M
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    task = tl.atomic_add(C, 1)
    while task < total:
        ticket = tl.atomic_add(C, 1)  # the next task, taken while this one runs
        if task < num_a:  # gate_up tile -> Inter[:, tile]
            offs_n = task * BN_A + tl.arange(0, BN_A)
            n_mask = offs_n < INTER
            y, y_up = _products(
                X, stride_x, Wgu, H, INTER * H, offs_m, m_mask, offs_n, n_mask, H, C, 0,
                0, True, BLOCK_M, BN_A, BK_A, USE_DOT, UPCAST, DOT_PRECISION, USE_PDL,
            )  # fmt: skip
            y = gated_epilogue(y, y_up, Inter, Inter, offs_m, offs_n, m_mask, n_mask, 0, 1, ACT)
            tl.store(
                Inter + offs_m[:, None] * INTER + offs_n[None, :],
                y.to(Inter.dtype.element_ty),
                mask=m_mask[:, None] & n_mask[None, :],
            )
            _signal(C + 1)
        elif task < num_a + num_b:  # down tile -> Y[:, tile], once every gate_up tile is done
            offs_n = (task - num_a) * BN_B + tl.arange(0, BN_B)
            n_mask = offs_n < H
            y, _ = _products(
                Inter, INTER, Wd, INTER, 0, offs_m, m_mask, offs_n, n_mask, INTER, C + 1, num_a,
                1, False, BLOCK_M, BN_B, BK_B, USE_DOT, UPCAST, DOT_PRECISION, USE_PDL,
            )  # fmt: skip
            tl.store(
                Y + offs_m[:, None] * H + offs_n[None, :],
                y.to(Y.dtype.element_ty),
                mask=m_mask[:, None] & n_mask[None, :],
            )
            _signal(C + 2)
        else:  # one token row's add_rms_norm, once every down tile is done
            _wait_count(C + 2, num_b)
            wait_for_previous_kernel(USE_PDL)  # the residual is the previous kernel's output
            _add_norm_row(
                Y, Res, NormW, NextW, Scale, Out, Out2, task - num_a - num_b, H, eps, stride_r,
                HAS_SCALE, HAS_NORM2, BLOCK_C,
            )  # fmt: skip
        task = ticket
    # Every program has taken its last ticket before it counts itself out: the last one resets the counters.
    gone = tl.atomic_add(C + 3, 1, sem="acq_rel")
    if gone == tl.num_programs(0) - 1:
        tl.atomic_xchg(C, 0)
        tl.atomic_xchg(C + 1, 0)
        tl.atomic_xchg(C + 2, 0)
        tl.atomic_xchg(C + 3, 0)


_decode_mlp = DualKernel(_decode_mlp_fn)


def decode_mlp_config(m: int, h: int, i: int) -> dict[str, int]:
    """Tiles and grid. One row: elementwise products (no tensor cores at M = 1), 8 gate and 8 up rows of
    1024-column tiles per ``gate_up`` task and 4 rows per ``down`` task, so a program streams about 80 KB a
    task and two programs per SM keep the weight loads in flight. More rows: 16-row tensor-core tiles of 32
    columns. Starting points for ``bench/decode_mlp.py --sweep`` on a GPU, not measured yet."""
    if m == 1:
        return {
            "bn_a": 8,
            "bk_a": min(1024, next_pow2(h)),
            "bn_b": 4,
            "bk_b": min(1024, next_pow2(i)),
            "num_warps": 8,
            "programs_per_sm": 2,
        }
    return {
        "bn_a": 32,
        "bk_a": min(128, max(16, next_pow2(h))),
        "bn_b": 32,
        "bk_b": min(128, max(16, next_pow2(i))),
        "num_warps": 4,
        "programs_per_sm": 2,
    }


def new_counters(device: torch.device | str) -> torch.Tensor:
    """A call site's counter buffer: zeros, and zeros again after every launch."""
    return torch.zeros(COUNTERS, dtype=torch.int32, device=device)


def decode_mlp(
    x: torch.Tensor,
    residual: torch.Tensor,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    activation: str,
    counters: torch.Tensor,
    scale: torch.Tensor | None = None,
    next_weight: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
    programs: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The MLP block of a dense layer for x [M, H] (the normed input, M <= 8) and its residual [M, H]:
    ``out = (residual + rms_norm(down(act(gate(x)) * up(x)), norm_weight)) * scale`` and
    ``rms_norm(out, next_weight)`` (None without ``next_weight``), as ``decode_mlp_reference``.

    ``gate_up_weight`` [2I, H] is [gate; up] stacked, ``down_weight`` [H, I]; both contiguous and never
    written by the kernel just before this one (their first tiles are read before the PDL wait).
    ``counters``: ``new_counters``, used by one call site at a time. ``programs``: the grid (default: by
    SM count on CUDA, 3 in the interpreter so that several programs share the tickets)."""
    m, h = x.shape
    i = down_weight.shape[1]
    assert 0 < m <= MAX_ROWS and x.stride(-1) == 1 and residual.shape == (m, h)
    assert gate_up_weight.shape == (2 * i, h) and down_weight.shape == (h, i)
    assert gate_up_weight.is_contiguous() and down_weight.is_contiguous() and residual.stride(-1) == 1
    assert counters.dtype == torch.int32 and counters.numel() == COUNTERS and counters.device == x.device
    cfg = config or decode_mlp_config(m, h, i)
    inter = torch.empty((m, i), dtype=x.dtype, device=x.device)
    y = torch.empty((m, h), dtype=x.dtype, device=x.device)
    out = torch.empty((m, h), dtype=x.dtype, device=x.device)
    out2 = torch.empty_like(out) if next_weight is not None else out
    use_dot = m > 1
    upcast, precision = dot_settings(x.dtype, x.device)
    total = -(-i // cfg["bn_a"]) + -(-h // cfg["bn_b"]) + m
    if programs is None:
        programs = 3 if x.device.type == "cpu" else cfg["programs_per_sm"] * sm_count(x.device.index or 0)
    _decode_mlp[x.device][(max(1, min(programs, total)),)](
        x,
        residual,
        gate_up_weight,
        down_weight,
        norm_weight,
        next_weight if next_weight is not None else norm_weight,
        scale if scale is not None else norm_weight,
        inter,
        y,
        out,
        out2,
        counters,
        m,
        h,
        i,
        eps,
        x.stride(0),
        residual.stride(0),
        BLOCK_M=16 if use_dot else 1,
        BN_A=cfg["bn_a"],
        BK_A=cfg["bk_a"],
        BN_B=cfg["bn_b"],
        BK_B=cfg["bk_b"],
        BLOCK_C=min(1024, next_pow2(h)),
        ACT=_KINDS[activation],
        USE_DOT=use_dot,
        HAS_SCALE=scale is not None,
        HAS_NORM2=next_weight is not None,
        UPCAST=upcast,
        DOT_PRECISION=precision,
        **pdl(x.device, m),
        num_warps=cfg["num_warps"],
        num_stages=1,
    )
    return out, (out2 if next_weight is not None else None)


def decode_mlp_reference(
    x: torch.Tensor,
    residual: torch.Tensor,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    activation: str,
    scale: torch.Tensor | None = None,
    next_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The unfused ops the model runs without the kernel: gate_up with its activation, down, add_rms_norm."""
    inter = skinny_matmul_reference(x, gate_up_weight, GATE_UP, activation)
    y = torch.nn.functional.linear(inter, down_weight)
    return fused_rms_norm_reference(
        y, norm_weight, eps, residual=residual, scale=scale, next_weight=next_weight
    )


__all__ = ["COUNTERS", "decode_mlp", "decode_mlp_config", "decode_mlp_reference", "new_counters"]
