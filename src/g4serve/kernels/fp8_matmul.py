"""W8A8 FP8 GEMM: activations quantized to FP8 e4m3 inside the kernel, multiplied with FP8 weights on the
tensor cores (Hopper's FP8 MMA), for compressed-tensors' FP8 schemes with dynamic activation scales.

``y = sum_g (q(x_g) @ W_g^T) * sx_g * sw_g`` over K groups g of ``GROUP`` (128) columns: ``q(x_g)`` is the
group of a token's row divided by its own scale ``sx_g = max(amax(|x_g|) / 448, 1e-12)`` and rounded to e4m3
(per token and 128-column group, as FP8-block's activation scheme, finer than per-token FP8-dynamic);
``sw_g`` is the weight's scale for that group (per tensor, channel or 128 x 128 block: constant within a
group). Two launches: ``_quantize_groups`` writes the e4m3 activations and their scales once (quantizing
inside the GEMM made every column program redo it: 7-8x slower than bf16 on an H100), then the GEMM reads
the weight once in its FP8 bytes and never converts it: the in-register dequantizing kernel
(``quant_matmul.py``) spends ~11 instructions per weight byte widening FP8 to fp32, which bounds an H100 at
~2.7 TB/s of weights before any memory stall; here a tile goes to the MMA as it was loaded. Epilogues as in
``gemv.py`` (``gate_up``, ``mul``). The torch reference quantizes the same groups, then multiplies in fp32.

One token row against a weight of up to ``ONE_ROW_MAX_ELEMENTS`` takes ``_fp8_gemv`` instead: the same
products on the CUDA cores, thousands of programs of a few weight rows (bf16's one-row GEMV's shape), the
e4m3 bytes read as int32 words and widened by two hardware conversions per word (``e4m3x4_to_f32``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from g4serve import envs
from g4serve.kernels._launch import (
    DualKernel,
    launch_counters,
    pdl,
    sm_count,
    wait_for_previous_kernel,
)
from g4serve.kernels.act_mul import _KINDS
from g4serve.kernels.gemv import (
    GATE_UP,
    MUL,
    PLAIN,
    epilogue_reference,
    reduce_splits,
    rows_first,
    store_gated,
    zero_accumulators,
)
from g4serve.kernels.kv_cache_write import FP8_MAX, activation_scale, activation_scale_reference, quantize_fp8

GROUP = 128  # activation columns sharing one scale, and the kernel's K step
_GROUP = tl.constexpr(GROUP)  # the kernel's view of it (a jitted function reads constexpr globals only)
FP8 = torch.float8_e4m3fn


def _quantize_groups_fn(X, Q, SX, M, K, num_groups, stride_xm, stride_qm, stride_sm, USE_PDL: tl.constexpr):
    """Program (row, group): one token's 128-column group -> e4m3 values and their scale."""
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    offs = group * _GROUP + tl.arange(0, _GROUP)
    mask = offs < K
    wait_for_previous_kernel(USE_PDL)
    x = tl.load(X + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    sx = activation_scale(tl.max(tl.abs(x), axis=0))
    tl.store(Q + row * stride_qm + offs, quantize_fp8(x, sx, Q.dtype.element_ty), mask=mask)
    tl.store(SX + row * stride_sm + group, sx)


_quantize_groups = DualKernel(_quantize_groups_fn)


def _fp8_matmul_fn(
    XQ,
    SX,
    W,
    S,
    E,
    Y,
    P,
    C,
    M,
    N,
    K,
    stride_xm,
    stride_sxm,
    stride_wn,
    stride_sn,
    stride_em,
    stride_ym,
    scale_bn,
    scale_bk,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SWAP_AB: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EPILOGUE: tl.constexpr,
    ACT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (n, m): BLOCK_M token rows x BLOCK_N output columns. ``SWAP_AB`` multiplies W @ X^T instead
    of X @ W^T: the weight tile is the MMA's M side (Hopper's warpgroup MMA wants 64 rows there, which a
    decode batch padded to 16 is not) and the tokens its N side; the accumulator is transposed once at the
    end.

    ``SPLIT_K`` > 1 (serial split-K, for shapes whose column tiles alone leave SMs idle): program (n, m, s)
    covers the s-th range of whole K groups and ends in ``gemv.reduce_splits``: fp32 partials to ``P``, a
    count in ``C`` (one int32 per output tile, zero between launches), the last program of a tile sums them in
    split order (the same bits whatever the arrival order) and runs the epilogue. One launch, no memset."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    groups_per_split = tl.cdiv(tl.cdiv(K, _GROUP), SPLIT_K)
    k_start = pid_k * groups_per_split * _GROUP
    k_end = tl.minimum(K, k_start + groups_per_split * _GROUP)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = k_start + tl.arange(0, _GROUP)
    n_mask = offs_n < N
    m_mask = offs_m < M
    x_ptrs = XQ + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    sx_ptrs = SX + offs_m.to(tl.int64) * stride_sxm + k_start // _GROUP
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    u_ptrs = w_ptrs + N * stride_wn  # the up half of a stacked [gate; up] weight
    s_rows = S + (offs_n // scale_bn).to(tl.int64) * stride_sn
    u_rows = S + ((offs_n + N) // scale_bn).to(tl.int64) * stride_sn
    acc, acc_up = zero_accumulators(SWAP_AB, BLOCK_M, BLOCK_N)
    wait_for_previous_kernel(USE_PDL)
    for k0 in range(k_start, k_end, _GROUP):
        k_mask = (offs_k + (k0 - k_start)) < K
        xq = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        sx = tl.load(sx_ptrs, mask=m_mask, other=0.0)
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0, eviction_policy="evict_first")
        sw = tl.load(s_rows + k0 // scale_bk, mask=n_mask, other=0.0).to(tl.float32)
        if SWAP_AB:
            acc += tl.dot(w, tl.trans(xq)) * sw[:, None] * sx[None, :]
        else:
            acc += tl.dot(xq, tl.trans(w)) * sx[:, None] * sw[None, :]
        if EPILOGUE == 1:
            u = tl.load(
                u_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0, eviction_policy="evict_first"
            )
            su = tl.load(u_rows + k0 // scale_bk, mask=n_mask, other=0.0).to(tl.float32)
            if SWAP_AB:
                acc_up += tl.dot(u, tl.trans(xq)) * su[:, None] * sx[None, :]
            else:
                acc_up += tl.dot(xq, tl.trans(u)) * sx[:, None] * su[None, :]
        x_ptrs += _GROUP
        sx_ptrs += 1
        w_ptrs += _GROUP
        u_ptrs += _GROUP
    acc_mn, up_mn = rows_first(acc, acc_up, SWAP_AB)
    if SPLIT_K > 1:
        reduce_splits(
            acc_mn, up_mn, P, C, Y, E, offs_m, offs_n, m_mask, n_mask, M, N, stride_em, stride_ym,
            BLOCK_M, BLOCK_N, SPLIT_K, EPILOGUE, ACT,
        )  # fmt: skip
    else:
        store_gated(acc_mn, up_mn, Y, E, offs_m, offs_n, m_mask, n_mask, stride_em, stride_ym, EPILOGUE, ACT)


_fp8_matmul = DualKernel(_fp8_matmul_fn)


# Four e4m3 bytes of one 32-bit word -> four fp32 values: two hardware conversions to f16x2 (sm_89+), then
# each half widened. Loading e4m3 as bytes and casting, Triton unpacked and repacked every byte (~12 SASS
# instructions a weight byte in the loop against ~6.4 here, the activation's included), which bounded the
# one-row kernel near 2.4 TB/s on an H100.
_E4M3X4_TO_F32 = tl.constexpr("""{
.reg .b16 lo, hi, f0, f1, f2, f3;
.reg .b32 h01, h23;
mov.b32 {lo, hi}, $4;
cvt.rn.f16x2.e4m3x2 h01, lo;
cvt.rn.f16x2.e4m3x2 h23, hi;
mov.b32 {f0, f1}, h01;
mov.b32 {f2, f3}, h23;
cvt.f32.f16 $0, f0;
cvt.f32.f16 $1, f1;
cvt.f32.f16 $2, f2;
cvt.f32.f16 $3, f3;
}""")


@triton.jit
def e4m3x4_to_f32(words, PTX: tl.constexpr):
    """int32 words of four e4m3 bytes -> four fp32 tensors of the words' shape, byte 0 (the lowest column)
    first: by ``_E4M3X4_TO_F32`` when compiled for the GPU (``PTX``), by shifts and Triton's cast in the
    interpreter (the same values: e4m3 -> f16 -> f32 is exact)."""
    if PTX:
        return tl.inline_asm_elementwise(
            _E4M3X4_TO_F32,
            "=r,=r,=r,=r,r",
            [words],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
            is_pure=True,
            pack=1,
        )
    else:
        b0 = (words & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        b1 = ((words >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        b2 = ((words >> 16) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        b3 = ((words >> 24) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        return b0, b1, b2, b3


def _fp8_gemv_fn(
    XQ,
    SX,
    W,
    S,
    E,
    Y,
    N,
    K,
    stride_wn,
    stride_sn,
    stride_em,
    scale_bn,
    scale_bk,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_SCALES: tl.constexpr,
    EPILOGUE: tl.constexpr,
    ACT: tl.constexpr,
    PTX: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One token row (the W8A8 GEMM's math on the CUDA cores): program n streams ``BLOCK_N`` weight rows once,
    ``BLOCK_K`` e4m3 columns a step as int32 words of four (``XQ``, ``W``: the e4m3 bytes viewed as int32;
    ``K`` and ``stride_wn`` in words), each step's next tile loaded before its products (double buffering
    by hand, as ``gemv``'s one-row path) and the first before the dependent-launch wait (weights are never
    written during a step). The activation is loaded in the weight tile's own layout, each row the same
    words (cache hits): a [BLOCK_K] vector broadcast to the tile went through shared memory and a barrier
    every step. The products ``w * (q(x) * sx)`` accumulate in fp32,
    exact for e4m3 operands; a weight scale constant along K multiplies the row sums once, one that varies
    along it (block scales, ``K_SCALES``: every row of the program in one scale block) joins the
    activation's scale per column."""
    BLOCK_W: tl.constexpr = BLOCK_K // 4
    GROUP_W: tl.constexpr = _GROUP // 4
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, BLOCK_W)
    n_mask = offs_n < N
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + offs_w[None, :]
    up_offset = N.to(tl.int64) * stride_wn  # the up half of a stacked [gate; up] weight
    w_mask = n_mask[:, None] & (offs_w < K)[None, :]
    w = tl.load(w_ptrs, mask=w_mask, other=0, eviction_policy="evict_first")
    u = w
    if EPILOGUE == 1:
        u = tl.load(w_ptrs + up_offset, mask=w_mask, other=0, eviction_policy="evict_first")
    s_gate = S + ((pid * BLOCK_N) // scale_bn).to(tl.int64) * stride_sn  # the program's scale row(s)
    s_up = S + ((pid * BLOCK_N + N) // scale_bn).to(tl.int64) * stride_sn
    rows0 = tl.zeros([BLOCK_N, 1], tl.int32)
    wait_for_previous_kernel(USE_PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_W], tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_W], tl.float32)
    for k0 in range(0, K, BLOCK_W):
        cols = k0 + offs_w[None, :] + rows0  # words
        k_in = cols < K
        x0, x1, x2, x3 = e4m3x4_to_f32(tl.load(XQ + cols, mask=k_in, other=0), PTX)
        if BLOCK_W == GROUP_W:  # one activation group a step: its scale is one number
            sx = tl.load(SX + k0 // GROUP_W)
        else:
            sx = tl.load(SX + cols // GROUP_W, mask=k_in, other=0.0)
        next_mask = n_mask[:, None] & ((cols + BLOCK_W) < K)
        w_next = tl.load(w_ptrs + BLOCK_W, mask=next_mask, other=0, eviction_policy="evict_first")
        u_next = w_next
        if EPILOGUE == 1:
            u_next = tl.load(
                w_ptrs + BLOCK_W + up_offset, mask=next_mask, other=0, eviction_policy="evict_first"
            )
        sg = _column_scale(sx, s_gate, cols, k_in, scale_bk, K_SCALES)
        acc = _products(acc, w, x0, x1, x2, x3, sg, PTX)
        if EPILOGUE == 1:
            su = _column_scale(sx, s_up, cols, k_in, scale_bk, K_SCALES)
            acc_up = _products(acc_up, u, x0, x1, x2, x3, su, PTX)
        w = w_next
        u = u_next
        w_ptrs += BLOCK_W
    y = tl.sum(acc, axis=1)
    y_up = tl.sum(acc_up, axis=1)
    if not K_SCALES:
        y *= tl.load(S + (offs_n // scale_bn).to(tl.int64) * stride_sn, mask=n_mask, other=0.0).to(tl.float32)
        if EPILOGUE == 1:
            y_up *= tl.load(
                S + ((offs_n + N) // scale_bn).to(tl.int64) * stride_sn, mask=n_mask, other=0.0
            ).to(tl.float32)
    offs_m = tl.arange(0, 1)
    store_gated(
        y[None, :], y_up[None, :], Y, E, offs_m, offs_n, offs_m < 1, n_mask, stride_em, 0, EPILOGUE, ACT
    )


@triton.jit
def _column_scale(sx, s_row, cols, k_in, scale_bk, K_SCALES: tl.constexpr):
    """The activation's scale for each word of a step, times the weight's where it varies along K."""
    if K_SCALES:
        return sx * tl.load(s_row + (4 * cols) // scale_bk, mask=k_in, other=0.0).to(tl.float32)
    else:
        return sx


@triton.jit
def _products(acc, words, x0, x1, x2, x3, scale, PTX: tl.constexpr):
    """acc + the four columns of each weight word times the activation's, the sum scaled (one FMA each)."""
    w0, w1, w2, w3 = e4m3x4_to_f32(words, PTX)
    part = w0 * x0
    part += w1 * x1
    part += w2 * x2
    part += w3 * x3
    return acc + part * scale


_fp8_gemv = DualKernel(_fp8_gemv_fn)


def fp8_matmul_supported(scale_block: tuple[int, int], in_features: int) -> bool:
    """Whether a weight's scales are constant within every activation group (per tensor, per channel, or
    K blocks that are whole multiples of ``GROUP``)."""
    bk = scale_block[1]
    return bk >= in_features or bk % GROUP == 0


def fp8_matmul_config(
    m: int, n: int, k: int, sm_count: int, one_row: str | None = None, epilogue: int = PLAIN
) -> dict[str, int]:
    """Tiles per shape. Up to 32 rows (decode; measured on an H100 with bench/fp8_matmul_tiles.py at E4B's
    and 31B's shapes) the weight streams through the warpgroup MMA as its M side (``swap_ab``) in 64-row
    tiles, 4 stages deep, against the batch padded to 16 or 32; a shape whose column tiles fill fewer than all
    SMs (the projections back to the hidden size, all of E4B's attention) splits K until about two programs
    run per SM, each streaming at least 4 groups (8 splits at most). 33..64 rows: such narrow shapes swap and
    split into at most 3 (each program's MMA work doubled, more splits cost more than they hide), the others
    keep the row tile of the batch padded to 64 and a column tile that leaves at least two programs per SM.
    At E4B's shapes this took a decode step's W8A8 GEMMs from 4.77 to 2.62 ms at 32 rows and from 3.78 to
    3.03 ms at 64. Larger batches take the wider tiles of a compute-bound GEMM. One row takes
    ``one_row_config`` (the CUDA cores) where ``one_row`` (None: ``ONE_ROW``) says so."""
    if m == 1 and one_row_on_cuda_cores(n, k, one_row or ONE_ROW):
        return one_row_config(n, k, epilogue)
    tiles = triton.cdiv(n, 64)
    groups = triton.cdiv(k, GROUP)
    narrow = tiles < sm_count and groups >= 2 * MIN_GROUPS_PER_SPLIT
    if m <= 32:
        cfg = {"block_m": 16 if m <= 16 else 32, "block_n": 64, "num_warps": 4, "num_stages": 4, "swap_ab": 1}
        if narrow:
            cfg["split_k"] = min(
                MAX_SPLIT_K, triton.cdiv(2 * sm_count, tiles), groups // MIN_GROUPS_PER_SPLIT
            )
        return cfg
    if m <= 64:
        if narrow:
            split = min(3, triton.cdiv(sm_count, tiles), groups // MIN_GROUPS_PER_SPLIT)
            return {
                "block_m": 64,
                "block_n": 64,
                "num_warps": 4,
                "num_stages": 4,
                "swap_ab": 1,
                "split_k": split,
            }
        block_n = 64 if n >= 64 * 264 else 32
        return {"block_m": 64, "block_n": block_n, "num_warps": 4, "num_stages": 4}
    return {"block_m": 128 if m > 256 else 64, "block_n": 128, "num_warps": 8, "num_stages": 3}


# One token row: "auto" takes ``_fp8_gemv`` (the CUDA cores: many programs of a few weight rows, as bf16's
# one-row GEMV) for weights of at most ONE_ROW_MAX_ELEMENTS output x input elements, the tensor cores' swapped
# 16-row tile past them; "fma" takes the CUDA cores for every one-row product, "mma" never.
ONE_ROW = envs.get("G4SERVE_FP8_ONE_ROW")
# bench/fp8_matmul_tiles.py --rows 1 on an H100 (2026-12-07, call 3; docs/benchmarks.md): at e4b's shapes
# (5-27M elements) the CUDA cores took 4.5-20.0 us where the tensor cores took 5.9-21.7 (o 4.46 against 5.87,
# gate/up 19.97 against 21.65, down 11.75 against 13.55); at 31B's (44-116M) they were within 4% either way
# (o 19.2 against 20.1 us, down 48.3 against 45.8), which the tensor cores keep: 31B's shapes the sweep had
# ahead on the CUDA cores, each in its best tile, made the engine's step slower (13.24 against 13.20 ms).
ONE_ROW_MAX_ELEMENTS = 1 << 25


def one_row_config(n: int, k: int, epilogue: int = PLAIN) -> dict[str, int]:
    """``_fp8_gemv``'s tiles (the same sweep): 4 weight rows a program (8 for a wide gated pair: e4b's gate/up
    19.97 against 20.85 us), 4 warps, K steps of 2,048 bytes for rows of 4,096+ that divide by it (e4b's
    down 11.75 against 16.29 us at 512), else 1,024 or 512."""
    if k >= 4096 and k % 2048 == 0:
        block_k = 2048
    else:
        block_k = 1024 if k % 1024 == 0 else 512
    block_n = 8 if epilogue == GATE_UP and n >= 8192 else 4
    return {"one_row": 1, "block_n": block_n, "block_k": block_k, "num_warps": 4}


def one_row_on_cuda_cores(n: int, k: int, mode: str) -> bool:
    """Whether a one-row product takes ``_fp8_gemv`` (``ONE_ROW``'s rule, for ``mode``)."""
    if mode != "auto":
        return mode == "fma"
    return n * k <= ONE_ROW_MAX_ELEMENTS


def one_row_supported(
    m: int, n: int, scale_block: tuple[int, int], k: int, epilogue: int, block_n: int
) -> bool:
    """Whether ``_fp8_gemv`` takes this product: one row, and where the weight's scales vary along K, every
    program's rows (gate and up) inside one scale block."""
    if m != 1 or k % 4:  # (the kernel reads e4m3 as int32 words of four)
        return False
    bn, bk = scale_block
    return bk >= k or (bn % block_n == 0 and (epilogue != GATE_UP or n % block_n == 0))


MAX_SPLIT_K = 8
MIN_GROUPS_PER_SPLIT = 4  # K groups (of 128 columns) each split streams at least


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 0 elsewhere (the interpreter: no split by default)."""
    return sm_count(device.index or 0) if device.type == "cuda" else 0


def group_buffers(rows: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty (e4m3 [rows, k], fp32 scales [rows, ceil(k / GROUP)]): what ``quantize_groups`` fills, and any
    kernel that writes the same groups for the W8A8 GEMM (``rms_norm.fused_rms_norm(fp8_next=...)``)."""
    values = torch.empty((rows, k), dtype=FP8, device=device)
    return values, torch.empty((rows, triton.cdiv(k, GROUP)), dtype=torch.float32, device=device)


def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (16-bit, unit last stride) -> (e4m3 [M, K], fp32 scales [M, ceil(K / GROUP)]) on the device:
    ``quantize_activation_groups`` as one launch."""
    m, k = x.shape
    num_groups = triton.cdiv(k, GROUP)
    xq, sx = group_buffers(m, k, x.device)
    if m:
        _quantize_groups[x.device][(m, num_groups)](
            x,
            xq,
            sx,
            m,
            k,
            num_groups,
            x.stride(0),
            xq.stride(0),
            sx.stride(0),
            **pdl(x.device, m),
            num_warps=1,
        )
    return xq, sx


def fp8_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    scale_block: tuple[int, int],
    epilogue: int = PLAIN,
    activation: str | None = None,
    other: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """x [M, K] (unit last stride, 16-bit) against an FP8 weight [N or 2N, K] with ``scale``
    [ceil(rows / bn), ceil(K / bk)] for ``scale_block`` = (bn, bk) -> [M, N] in x's dtype. Epilogues as
    ``gemv.skinny_matmul``."""
    assert x.stride(-1) == 1
    xq, sx = quantize_groups(x)
    return fp8_matmul_quantized(
        xq, sx, x.dtype, weight, scale, scale_block, epilogue, activation, other, config
    )


def fp8_matmul_quantized(
    xq: torch.Tensor,
    sx: torch.Tensor,
    out_dtype: torch.dtype,
    weight: torch.Tensor,
    scale: torch.Tensor,
    scale_block: tuple[int, int],
    epilogue: int = PLAIN,
    activation: str | None = None,
    other: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """``fp8_matmul`` on activations already quantized by ``quantize_groups`` (or a kernel that writes the
    same groups): e4m3 ``xq`` [M, K] and fp32 ``sx`` [M, ceil(K / GROUP)] -> [M, N] in ``out_dtype``."""
    m, k = xq.shape
    assert weight.dtype == FP8 and weight.shape[1] == k and weight.is_contiguous() and scale.is_contiguous()
    assert xq.stride(-1) == 1 and fp8_matmul_supported(scale_block, k)
    n = weight.shape[0] // 2 if epilogue == GATE_UP else weight.shape[0]
    y = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0:
        return y
    if epilogue == MUL:
        assert other is not None and other.shape == (m, n) and other.stride(-1) == 1
    cfg = config or fp8_matmul_config(m, n, k, _sm_count(xq.device), epilogue=epilogue)
    if cfg.get("one_row") and not one_row_supported(m, n, scale_block, k, epilogue, cfg["block_n"]):
        cfg = fp8_matmul_config(m, n, k, _sm_count(xq.device), one_row="mma", epilogue=epilogue)
    if cfg.get("one_row"):
        _fp8_gemv[xq.device][(triton.cdiv(n, cfg["block_n"]),)](
            xq.view(torch.int32),
            sx,
            weight.view(torch.int32),
            scale,
            other if other is not None else y,
            y,
            n,
            k // 4,
            weight.stride(0) // 4,
            scale.stride(0),
            other.stride(0) if other is not None else 0,
            scale_block[0],
            scale_block[1],
            BLOCK_N=cfg["block_n"],
            BLOCK_K=cfg["block_k"],
            K_SCALES=scale_block[1] < k,
            EPILOGUE=epilogue,
            ACT=_KINDS[activation] if epilogue != PLAIN else 0,
            PTX=xq.is_cuda,
            **pdl(xq.device, m),
            num_warps=cfg["num_warps"],
        )
        return y
    tiles = (triton.cdiv(n, cfg["block_n"]), triton.cdiv(m, cfg["block_m"]))
    counters = (
        launch_counters(xq.device, tiles[0] * tiles[1], "fp8_matmul") if cfg.get("split_k", 1) > 1 else None
    )
    splits = cfg["split_k"] if counters is not None else 1
    partials = y  # (unused unsplit)
    if splits > 1:
        parts = 2 if epilogue == GATE_UP else 1
        partials = torch.empty((splits, parts, m, n), dtype=torch.float32, device=xq.device)
    grid = (*tiles, splits)
    _fp8_matmul[xq.device][grid](
        xq,
        sx,
        weight,
        scale,
        other if other is not None else y,
        y,
        partials,
        counters if counters is not None else y,  # (unused unsplit)
        m,
        n,
        k,
        xq.stride(0),
        sx.stride(0),
        weight.stride(0),
        scale.stride(0),
        other.stride(0) if other is not None else 0,
        y.stride(0),
        scale_block[0],
        scale_block[1],
        BLOCK_M=cfg["block_m"],
        BLOCK_N=cfg["block_n"],
        SWAP_AB=bool(cfg.get("swap_ab", False)),
        SPLIT_K=splits,
        EPILOGUE=epilogue,
        ACT=_KINDS[activation] if epilogue != PLAIN else 0,
        **pdl(xq.device, m),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return y


def quantize_activation_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 values [M, K], fp32 scales [M, ceil(K / GROUP)]): each row's 128-column groups
    divided by max(amax / 448, 1e-12), saturated and rounded to nearest even, as the kernel does."""
    m, k = x.shape
    groups = F.pad(x.float(), (0, -k % GROUP)).view(m, -1, GROUP)
    scale = activation_scale_reference(groups.abs().amax(dim=-1))
    q = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(m, -1)[:, :k], scale


def fp8_matmul_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    scale_block: tuple[int, int],
    epilogue: int = PLAIN,
    activation: str | None = None,
    other: torch.Tensor | None = None,
) -> torch.Tensor:
    """The kernel's math in torch: per-group products of the quantized activations and the FP8 weight in
    fp32, each times its two scales, summed; then the epilogue on the rounded products."""
    m, k = x.shape
    rows = weight.shape[0]
    xq, sx = quantize_activation_groups(x)
    bn, bk = scale_block
    sw = scale.float().repeat_interleave(bn, dim=0)[:rows]  # [rows, ceil(K / bk)]
    y = torch.zeros(m, rows, dtype=torch.float32, device=x.device)
    for g, k0 in enumerate(range(0, k, GROUP)):
        part = xq[:, k0 : k0 + GROUP].float() @ weight[:, k0 : k0 + GROUP].float().t()
        y += part * sx[:, g : g + 1] * sw[:, k0 // bk][None, :]
    return epilogue_reference(y.to(x.dtype), epilogue, activation, other)


__all__ = [
    "GROUP",
    "fp8_matmul",
    "fp8_matmul_config",
    "fp8_matmul_reference",
    "fp8_matmul_supported",
    "one_row_config",
    "one_row_on_cuda_cores",
    "one_row_supported",
    "quantize_activation_groups",
]
