"""Skinny GEMMs for decode (a few token rows against a large weight), with the gated epilogues fused.

At batch 1-8 a decode step's projections are pure weight streaming: ``x [M, K] @ W[N, K]^T`` with M
tiny. cuBLAS picks 64-wide output tiles for them, so a projection with few output columns (the PLE
gate: N=256) runs on 4 thread blocks and takes as long as one 20x its size; and every gated
activation (MLP gate/up, PLE gate) is a GEMM, a write, a re-read and a second kernel. Here each
program owns ``BLOCK_N`` output columns and streams their rows of W once:

- ``M == 1``: elementwise products into a [BLOCK_N, BLOCK_K] fp32 accumulator, one reduction at the
  end (no tensor cores: a GEMV does 1 FMA per weight element loaded); the weight stream is double-buffered
  by hand and, under programmatic dependent launch, starts before the previous kernel has finished
  (an [M, BLOCK_N, BLOCK_K] version of this path for M > 1 ran 1.2-2.3x slower than cuBLAS on an H100);
- ``M > 1``: the token rows are padded to 16 and multiplied on the tensor cores (``tl.dot``), so every
  weight element is loaded once for all M rows.

Epilogues (the product rounded to the output dtype first, exactly as the unfused GEMM's output is):
``plain`` y; ``gate_up`` act(x W_gate^T) * (x W_up^T) from one stacked [2N, K] weight (the MLP);
``mul`` act(x W^T) * e for an [M, N] operand e (the PLE gate times the per-layer input).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from g4serve.kernels._launch import (
    DualKernel,
    dot_settings,
    launch_counters,
    next_pow2,
    pdl,
    sm_count,
    wait_for_previous_kernel,
)
from g4serve.kernels.act_mul import _KINDS, act_mul_reference

PLAIN, GATE_UP, MUL = 0, 1, 2
MAX_ROWS = 8  # token rows of the 16-row tensor-core tile (and the decode tail's)
DOT_MAX_ROWS = 64  # token rows the kernel takes: 9..64 on the swapped tiles, the batch padded to 16, 32 or 64


@triton.jit
def gated_epilogue(
    y, y_up, Y, E, offs_m, offs_n, m_mask, n_mask, stride_em, EPILOGUE: tl.constexpr, ACT: tl.constexpr
):
    """The fp32 products [rows, cols] after the epilogue: ``plain`` y as is; ``gate_up`` act(y) * y_up;
    ``mul`` act(y) * e[rows, cols]. Shared with the quantized-weight GEMM (kernels/quant_matmul.py)."""
    if EPILOGUE != 0:
        out_ty = Y.dtype.element_ty
        # act(a) rounded as the unfused activation kernel rounds it, a itself rounded as a GEMM output
        a = y.to(out_ty).to(tl.float32)
        if ACT == 0:
            z = 0.7978845608028654 * (a + 0.044715 * a * a * a)
            g = a * tl.sigmoid(2.0 * z)
        else:
            g = a * tl.sigmoid(a)
        g = g.to(out_ty).to(tl.float32)
        if EPILOGUE == 1:
            b = y_up.to(out_ty).to(tl.float32)
        else:
            b = tl.load(
                E + offs_m[:, None] * stride_em + offs_n[None, :],
                mask=m_mask[:, None] & n_mask[None, :],
                other=0.0,
            ).to(tl.float32)
        y = g * b
    return y


@triton.jit
def store_gated(
    y,
    y_up,
    Y,
    E,
    offs_m,
    offs_n,
    m_mask,
    n_mask,
    stride_em,
    stride_ym,
    EPILOGUE: tl.constexpr,
    ACT: tl.constexpr,
):
    """``gated_epilogue`` of the fp32 products [rows, cols], stored to Y in its dtype (64-bit row offsets).
    The end of the quantized-weight GEMMs (kernels/quant_matmul.py, kernels/fp8_matmul.py)."""
    y = gated_epilogue(y, y_up, Y, E, offs_m, offs_n, m_mask, n_mask, stride_em, EPILOGUE, ACT)
    tl.store(
        Y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :],
        y.to(Y.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )


@triton.jit
def zero_accumulators(SWAP_AB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """fp32 zeros for a tile's products and its up half: [BLOCK_N, BLOCK_M] when the tile is swapped (W @ X^T,
    the weight on the MMA's M side), else [BLOCK_M, BLOCK_N]. Shared with the FP8 and int4 GEMMs."""
    if SWAP_AB:
        return tl.zeros([BLOCK_N, BLOCK_M], tl.float32), tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        return tl.zeros([BLOCK_M, BLOCK_N], tl.float32), tl.zeros([BLOCK_M, BLOCK_N], tl.float32)


@triton.jit
def rows_first(acc, acc_up, SWAP_AB: tl.constexpr):
    """A swapped tile's products back to [token rows, columns] (``zero_accumulators``' other end)."""
    if SWAP_AB:
        return tl.trans(acc), tl.trans(acc_up)
    else:
        return acc, acc_up


@triton.jit
def reduce_splits(
    acc, acc_up, P, C, Y, E, offs_m, offs_n, m_mask, n_mask, M, N, stride_em, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K, EPILOGUE: tl.constexpr, ACT: tl.constexpr,
):  # fmt: skip
    """Serial split-K's end (grid: column tiles, row tiles, SPLIT_K splits): this program's partials to P
    [SPLIT_K, parts, M, N] (parts: gate and up for ``gate_up``, else one), its count in the tile's counter;
    the last of the tile's programs to count sums the partials in split order, stores the tile and zeroes
    the counter for the next launch. Shared with kernels/fp8_matmul.py."""
    parts: tl.constexpr = 2 if EPILOGUE == 1 else 1
    mn_mask = m_mask[:, None] & n_mask[None, :]
    mn = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    part = N * M
    pid_k = tl.program_id(2)
    tl.store(P + (parts * pid_k) * part + mn, acc, mask=mn_mask)
    if EPILOGUE == 1:
        tl.store(P + (parts * pid_k + 1) * part + mn, acc_up, mask=mn_mask)
    tile = C + tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    # acq_rel: this program's partials are visible before its count; the last one sees every partial
    if tl.atomic_add(tile, 1, sem="acq_rel") == SPLIT_K - 1:
        total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        total_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for split in range(0, SPLIT_K):
            total += tl.load(P + (parts * split) * part + mn, mask=mn_mask, other=0.0, cache_modifier=".cg")
            if EPILOGUE == 1:
                total_up += tl.load(
                    P + (parts * split + 1) * part + mn, mask=mn_mask, other=0.0, cache_modifier=".cg"
                )
        store_gated(
            total, total_up, Y, E, offs_m, offs_n, m_mask, n_mask, stride_em, stride_ym, EPILOGUE, ACT
        )
        tl.atomic_xchg(tile, 0)


def _gemv_fn(  # noqa: C901 - Triton kernel body: its branches test tl.constexpr flags (USE_DOT, SWAP_AB, SPLIT, EPILOGUE, ACT, EVEN_K, UPCAST), specialised away at compile time
    X,
    W,
    E,
    Y,
    P,
    C,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_em,
    stride_ym,
    up_offset,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EPILOGUE: tl.constexpr,
    ACT: tl.constexpr,
    USE_DOT: tl.constexpr,
    SWAP_AB: tl.constexpr,
    SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    x_ptrs = X + offs_m[:, None] * stride_xm + offs_k[None, :]

    if USE_DOT:
        # Tensor-core tiles: the compiler pipelines these loads itself (num_stages). SWAP_AB multiplies
        # W @ X^T: the weight tile is the MMA's M side (Hopper's warpgroup MMA wants 64 rows there; the
        # batch, padded to 16-64, is its N side). SPLIT: program (n, 0, s) covers the s-th range of whole
        # K tiles and ends in reduce_splits (the split count is the grid's, one compiled kernel for all).
        k_start = 0
        k_end = K
        if SPLIT:
            k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), tl.num_programs(2)) * BLOCK_K
            k_start = tl.program_id(2) * k_per_split
            k_end = tl.minimum(K, k_start + k_per_split)
            w_ptrs += k_start
            x_ptrs += k_start
        wait_for_previous_kernel(USE_PDL)
        acc, acc_up = zero_accumulators(SWAP_AB, BLOCK_M, BLOCK_N)
        for k0 in range(k_start, k_end, BLOCK_K):
            if EVEN_K:
                w_mask = n_mask[:, None]
                x_mask = m_mask[:, None]
            else:
                k_in = (k0 + offs_k) < K
                w_mask = n_mask[:, None] & k_in[None, :]
                x_mask = m_mask[:, None] & k_in[None, :]
            w = tl.load(w_ptrs, mask=w_mask, other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=x_mask, other=0.0)
            if EPILOGUE == 1:
                u = tl.load(w_ptrs + up_offset, mask=w_mask, other=0.0, eviction_policy="evict_first")
            else:
                u = w
            if UPCAST:
                x = x.to(tl.float32)
                w = w.to(tl.float32)
                u = u.to(tl.float32)
            if SWAP_AB:
                acc += tl.dot(w, tl.trans(x), input_precision=DOT_PRECISION)
                if EPILOGUE == 1:
                    acc_up += tl.dot(u, tl.trans(x), input_precision=DOT_PRECISION)
            else:
                acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
                if EPILOGUE == 1:
                    acc_up += tl.dot(x, tl.trans(u), input_precision=DOT_PRECISION)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
    else:
        # One row: the next weight tile is loaded before this tile's math (double buffering by hand, as
        # there are no tensor-core ops for the compiler to pipeline), and the first one before waiting on
        # the previous kernel: weights are never written during a step, so under programmatic dependent
        # launch their stream starts while that kernel drains.
        w_mask = n_mask[:, None] & (offs_k < K)[None, :]
        w = tl.load(w_ptrs, mask=w_mask, other=0.0, eviction_policy="evict_first")
        u = w
        if EPILOGUE == 1:
            u = tl.load(w_ptrs + up_offset, mask=w_mask, other=0.0, eviction_policy="evict_first")
        wait_for_previous_kernel(USE_PDL)
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            else:
                x = tl.load(x_ptrs, mask=m_mask[:, None] & ((k0 + offs_k) < K)[None, :], other=0.0)
            next_mask = n_mask[:, None] & ((k0 + BLOCK_K + offs_k) < K)[None, :]
            w_next = tl.load(w_ptrs + BLOCK_K, mask=next_mask, other=0.0, eviction_policy="evict_first")
            u_next = w_next
            if EPILOGUE == 1:
                u_next = tl.load(
                    w_ptrs + BLOCK_K + up_offset, mask=next_mask, other=0.0, eviction_policy="evict_first"
                )
            xf = x.to(tl.float32)  # [1, BLOCK_K]
            acc += w.to(tl.float32) * xf
            if EPILOGUE == 1:
                acc_up += u.to(tl.float32) * xf
            w = w_next
            u = u_next
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K

    if USE_DOT:
        y, y_up = rows_first(acc, acc_up, SWAP_AB)
    else:
        y = tl.sum(acc, axis=1)[None, :]  # [1, BLOCK_N]
        y_up = tl.sum(acc_up, axis=1)[None, :]
    if SPLIT:
        reduce_splits(
            y, y_up, P, C, Y, E, offs_m, offs_n, m_mask, n_mask, M, N, stride_em, stride_ym,
            BLOCK_M, BLOCK_N, tl.num_programs(2), EPILOGUE, ACT,
        )  # fmt: skip
    else:
        store_gated(y, y_up, Y, E, offs_m, offs_n, m_mask, n_mask, stride_em, stride_ym, EPILOGUE, ACT)


_gemv = DualKernel(_gemv_fn)


# The swapped tiles' rows (bench/gemv_kernels.py --rows 64 32 16 8 --sweep, an H100, e4b's shapes): from
# SWAP_MIN_ROWS they beat cuBLAS on every projection up to 16 rows, and up to CUBLAS_FROM_ROWS - 1 rows on all
# but the narrowest plain ones; from CUBLAS_FROM_ROWS cuBLAS keeps the plain mid-size projections.
SWAP_MIN_ROWS = 8
CUBLAS_FROM_ROWS = 33


def use_skinny(m: int, n: int, k: int, epilogue: int = PLAIN, sms: int = 132) -> bool:
    """Whether this kernel beats cuBLAS (plus the separate activation kernel) for an [m, k] x [n, k]^T
    product, from bench/gemv_kernels.py --sweep on an H100 at e4b shapes. One row: always (1.1-4x over the
    shapes of a decode step; the weight streams at up to 3.2 TB/s). 2-64 rows: the fused gates (their
    activation pass is saved), short K (the PLE projection) and the LM head's vocabulary-wide N (1.04-1.6x).
    The plain projections: 8-16 rows all (the swapped tiles: 1.04-1.2x), 17-32 rows those wider than 2,048
    columns (1.04-1.15x; q at 2,048 is 7% slower), none at 2-7 rows (cuBLAS's 64x8 tiles beat the 16-row
    tile; the swapped tiles were not timed there) or 33-64 rows (cuBLAS as fast or faster). Except, from
    the same bench at 31B's shapes: at 17-32 rows, K of 8,192+ into 64-column tiles that fill at least half
    of the ``sms`` but not all (31B's o and down, N = 5,376: 84 tiles) stay on cuBLAS's split-K (1-2% faster
    at 32 rows, split 2 ways into 1.3 waves). At 8-16 rows those shapes run unsplit (``_swapped_config``)
    and beat cuBLAS by 5-12% (o 32.2 against 35.6 us, down 80.3 against 84.6 at 8 rows)."""
    if m == 1:
        return True
    if m > DOT_MAX_ROWS:
        return False
    if epilogue != PLAIN or k <= 512 or n >= 65536:
        return True
    if m > 16 and k >= 8192 and sms <= 2 * -(-n // 64) < 2 * sms:
        return False
    return SWAP_MIN_ROWS <= m < CUBLAS_FROM_ROWS and (m <= 16 or n > 2048)


def gemv_config(m: int, n: int, k: int, epilogue: int = PLAIN, sms: int = 132) -> dict[str, int]:
    """Tiles per shape, from the same sweep. One row: one or two weight rows per program so every SM
    streams (K steps of 512, or 1024 when K divides by it); short K: four rows; narrow N (the PLE gate):
    8 warps. 2-7 rows: 16-row tensor-core tiles, 32 columns (16 for narrow N, 64 for the LM head). 8-64
    rows: ``_swapped_config``, but the fused gates up to 16 rows, which keep the 16-row token tile: K tiles
    of 128, or 256 at 8-16 rows for K of 4,096+ (31B's gate/up, K = 5,376: 153.9 against 163.2 us at 8
    rows; the swapped tiles' best 153.3)."""
    k_pow2 = max(16, next_pow2(k))
    if m == 1:
        if k <= 512:
            return {"block_n": 4, "block_k": k_pow2, "num_warps": 4, "num_stages": 1}
        block_k = 1024 if k % 1024 == 0 else 512
        return {
            "block_n": 2 if block_k == 1024 else 1,
            "block_k": block_k,
            "num_warps": 8 if n <= 512 else 4,
            "num_stages": 1,
        }
    if m >= SWAP_MIN_ROWS and not (epilogue == GATE_UP and m <= 16) and not (k <= 512 and m <= 8):
        return _swapped_config(m, n, k, epilogue, sms)
    if epilogue == GATE_UP:
        block_k = 256 if m >= SWAP_MIN_ROWS and k >= 4096 else 128
        return {"block_n": 32, "block_k": min(block_k, k_pow2), "num_warps": 4, "num_stages": 3}
    if n <= 512:
        return {"block_n": 16, "block_k": min(256, k_pow2), "num_warps": 4, "num_stages": 4}
    if n >= 65536:
        return {"block_n": 64, "block_k": min(256, k_pow2), "num_warps": 4, "num_stages": 4}
    return {"block_n": 32, "block_k": min(128, k_pow2), "num_warps": 4, "num_stages": 4}


MIN_K_TILES_PER_SPLIT = 2  # K tiles each split of a split-K launch streams at least


def _swapped_config(m: int, n: int, k: int, epilogue: int, sms: int) -> dict[str, int]:
    """8-64 rows: the weight as the warpgroup MMA's M side in 64-row tiles (128 for the LM head past 16 rows)
    against the batch padded to 16, 32 or 64. The sweep's best per shape class: K tiles of 256 at 4 stages
    up to 16 rows, of 128 at 5 stages beyond and for K of 8,192+ (the MLP's down); the gates' pair of
    weight tiles in K tiles of 64 at 3 stages; short K (the PLE projection) in K tiles of 128; K split 2 ways
    where the column tiles leave SMs idle and K is long (down; o past 16 rows), 4 ways for narrow N (the PLE
    gate's 256 columns: 4 tiles), but never into a second, partial wave of programs: 31B's o and down (84
    column tiles of 132 SMs) split 2 ways took 1.3 waves and 14-19% longer than unsplit at 8-16 rows. (3 ways
    at 4 stages past 16 rows was faster kernel by kernel, e4b's down at 32 rows 22.5 against 24.5 us, but
    not in the engine: e4b decode at B = 24 / 32 / 48 5.13-5.20 / 5.12-5.21 / 5.66-5.70 ms against 5.03-5.11
    / 5.16-5.17 / 5.67-5.70 split 2 ways; H100, 2026-12-07.)"""
    k_pow2 = max(16, next_pow2(k))
    block_n, block_k, stages, split = 64, min(256 if m <= 16 else 128, k_pow2), 4, 1
    if epilogue == GATE_UP:
        block_k, stages = min(64, k_pow2), 3
    elif n >= 65536 and m > 16:
        block_n, block_k = 128, min(128, k_pow2)
    elif n <= 512:
        block_k, split = min(128, k_pow2), 4
    elif k <= 512:
        block_k = min(128, k_pow2)
    elif k >= 8192 or (m > 16 and k >= 4096):
        block_k, split = min(128, k_pow2), 2
    if block_k == 128 and epilogue != GATE_UP and n < 65536:
        stages = 5 if split != 2 or k >= 8192 else 4
    tiles = -(-n // block_n)
    if tiles >= sms or -(-k // block_k) < split * MIN_K_TILES_PER_SPLIT:
        split = 1
    elif split * tiles > sms:
        split = max(1, sms // tiles)
    return {
        "block_m": max(16, next_pow2(m)),
        "block_n": block_n,
        "block_k": block_k,
        "num_warps": 4,
        "num_stages": stages,
        "swap_ab": 1,
        "split_k": split,
    }


def skinny_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    epilogue: int = PLAIN,
    activation: str | None = None,
    other: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """x [M, K] (M <= DOT_MAX_ROWS, unit last stride) against weight [N or 2N, K] (contiguous) -> [M, N].

    ``PLAIN``: x @ weight.T; ``GATE_UP``: act(x @ gate.T) * (x @ up.T) for weight = [gate; up];
    ``MUL``: act(x @ weight.T) * other, other [M, N] with unit last stride. ``weight`` must not be written by
    the kernel just before this one in the stream (model weights): under programmatic dependent launch its
    first tile is read before waiting for that kernel. ``config``: ``gemv_config``'s keys (``block_m``,
    ``swap_ab`` and ``split_k`` optional)."""
    m, k = x.shape
    assert m <= DOT_MAX_ROWS and x.stride(-1) == 1 and weight.is_contiguous() and weight.shape[1] == k
    n = weight.shape[0] // 2 if epilogue == GATE_UP else weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    cfg = config or gemv_config(m, n, k, epilogue, sm_count(x.device.index or 0) if x.is_cuda else 132)
    use_dot = m > 1
    block_m = max(cfg.get("block_m", 16), next_pow2(m)) if use_dot else 1
    upcast, precision = dot_settings(x.dtype, x.device)
    if epilogue == MUL:
        assert other is not None and other.shape == (m, n) and other.stride(-1) == 1
    tiles = -(-n // cfg["block_n"])
    splits = cfg.get("split_k", 1) if use_dot else 1
    counters = launch_counters(x.device, tiles, "skinny_matmul") if splits > 1 else None
    if counters is None:  # (capturing before the counters exist: unsplit)
        splits = 1
    partials = y  # (unused unsplit)
    if splits > 1:
        parts = 2 if epilogue == GATE_UP else 1
        partials = torch.empty((splits, parts, m, n), dtype=torch.float32, device=x.device)
    _gemv[x.device][(tiles, 1, splits)](
        x,
        weight,
        other if other is not None else y,
        y,
        partials,
        counters if counters is not None else y,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        other.stride(0) if other is not None else 0,
        y.stride(0),
        n * weight.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=cfg["block_n"],
        BLOCK_K=cfg["block_k"],
        EPILOGUE=epilogue,
        ACT=_KINDS[activation] if epilogue != PLAIN else 0,
        USE_DOT=use_dot,
        SWAP_AB=use_dot and bool(cfg.get("swap_ab", False)),
        SPLIT=splits > 1,
        EVEN_K=k % cfg["block_k"] == 0,
        UPCAST=upcast,
        DOT_PRECISION=precision,
        **pdl(x.device, m),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return y


def skinny_matmul_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    epilogue: int = PLAIN,
    activation: str | None = None,
    other: torch.Tensor | None = None,
) -> torch.Tensor:
    """The unfused ops the model runs without this kernel: F.linear, then the activation kernel's math."""
    return epilogue_reference(F.linear(x, weight), epilogue, activation, other)


def epilogue_reference(
    y: torch.Tensor, epilogue: int, activation: str | None = None, other: torch.Tensor | None = None
) -> torch.Tensor:
    """An epilogue on a projection's rounded output ``y``: as is (``plain``), act(gate) * up of its two halves
    (``gate_up``), or act(y) * other (``mul``), with the activation kernel's math."""
    if epilogue == GATE_UP:
        gate, up = y.chunk(2, dim=-1)
        return act_mul_reference(activation, gate, up)
    return y if epilogue == PLAIN else act_mul_reference(activation, y, other)


__all__ = [
    "GATE_UP",
    "DOT_MAX_ROWS",
    "MAX_ROWS",
    "MUL",
    "PLAIN",
    "gemv_config",
    "skinny_matmul",
    "epilogue_reference",
    "skinny_matmul_reference",
    "use_skinny",
]
