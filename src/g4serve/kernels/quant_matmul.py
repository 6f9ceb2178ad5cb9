"""GEMMs against quantized weights (FP8 e4m3 or packed int4), the weight dequantized in registers.

``x [M, K] @ dequant(W)^T`` with ``dequant(W)[n, k] = (q[n, k] - z[n, k // bk]) * s[n // bn, k // bk]``: one
scale per ``bn x bk`` block of the weight (per tensor: the whole weight; per channel: a row; FP8 blocks:
128 x 128; int4 groups: 1 x g), zero points (int4, optional) per scale entry. int4 weights stay in
compressed-tensors' packing: int32 words of 8 nibbles along K, nibble i of word j is element 8j + i, stored
as q + 8. Weights are read once, in their quantized bytes, which is the point at decode sizes.

- ``M == 1``: elementwise FMAs into fp32 accumulators, the next raw tile loaded before this tile's math, the
  first before the programmatic-dependent-launch wait (as ``gemv.py``); int4 by nibble planes against x's
  planes (``_int4_row_products``, three instructions an element);
- ``M > 1``: tiles dequantized to the activation dtype and multiplied on the tensor cores; up to
  ``SKINNY_ROWS`` rows in one row tile (every weight element loaded once for the batch), more rows over a
  2-D grid (a prefill GEMM that never writes a dequantized copy of the weight). int4 tiles go nibble plane
  by nibble plane (``_int4_products``, shared with the MoE experts: K tiles of at least 128, or 256 with the
  operands swapped past 16-row tiles), never reshaping the unpacked tile; tiles of up to 16 rows make their
  planes two words at a time on bf16x2 lanes (``_PLANES_ASM``);
- ``config["split_k"]`` > 1 (int4's 2-16-row defaults, ``int4_matmul_config``; opt-in otherwise): K cut
  into that many ranges, fp32 partials summed in order by a second kernel that applies the epilogue
  (deterministic, no atomics).

Epilogues as in ``gemv.py``: ``gate_up`` act(x W_gate^T) * (x W_up^T) from one stacked weight, ``mul``
act(x W^T) * e. The torch reference dequantizes to the compute dtype, then ``F.linear``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from g4serve import envs
from g4serve.kernels._launch import (
    DualKernel,
    dot_settings,
    next_pow2,
    pdl,
    sm_count,
    wait_for_previous_kernel,
)
from g4serve.kernels.act_mul import _KINDS
from g4serve.kernels.gemv import (
    GATE_UP,
    MUL,
    PLAIN,
    rows_first,
    skinny_matmul_reference,
    store_gated,
    zero_accumulators,
)

SKINNY_ROWS = 64  # rows multiplied in one row tile (decode batches); more take the 2-D grid


@triton.jit
def _load_raw(
    W,
    S,
    Z,
    rows,
    n_mask,
    k0,
    K,
    num_groups,
    stride_wn,
    stride_sn,
    stride_zn,
    scale_bn,
    scale_bk,
    BLOCK_K: tl.constexpr,
    INT4: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    GROUPS: tl.constexpr,
):
    """The raw tile of weight rows ``rows`` at K offset ``k0``: quantized values (int4: packed words
    [BLOCK_N, BLOCK_K // 8]), scales and zero points [BLOCK_N, GROUPS]."""
    rows64 = rows.to(tl.int64)
    if INT4:
        offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        w_mask = n_mask[:, None] & (offs_w < (K + 7) // 8)[None, :]
        w = tl.load(W + rows64[:, None] * stride_wn + offs_w[None, :], mask=w_mask, other=0)
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w_mask = n_mask[:, None] & (offs_k < K)[None, :]
        w = tl.load(
            W + rows64[:, None] * stride_wn + offs_k[None, :],
            mask=w_mask,
            other=0.0,
            eviction_policy="evict_first",
        )
    groups = k0 // scale_bk + tl.arange(0, GROUPS)
    s_mask = n_mask[:, None] & (groups < num_groups)[None, :]
    s = tl.load(
        S + (rows // scale_bn).to(tl.int64)[:, None] * stride_sn + groups[None, :], mask=s_mask, other=0.0
    )
    z = s
    if HAS_ZERO:
        z = tl.load(Z + rows64[:, None] * stride_zn + groups[None, :], mask=s_mask, other=0)
    return w, s, z


# 2^23 as fp32 bits: a nibble OR-ed into its mantissa reads as 2^23 + q, exactly (``_nibbles_f32``).
MAGIC_BITS = tl.constexpr(0x4B000000)
MAGIC = tl.constexpr(8388608.0)


@triton.jit
def _nibble(w, i: tl.constexpr):
    """Nibble ``i`` (0..15) of packed int32 words ``w`` (a logical shift: no sign to clear)."""
    return (w.to(tl.uint32, bitcast=True) >> (4 * i)) & 0xF


@triton.jit
def _nibbles_f32(q):
    """int4 nibbles q (0..15) -> fp32 2^23 + q: one OR and a free bitcast, where converting takes an
    I2F at a fraction of the FP32 rate. Callers subtract 2^23 with the offset (exact: both are integers
    under 2^24), so ``(q - offset) * s`` keeps its bits."""
    return (q | MAGIC_BITS).to(tl.float32, bitcast=True)


@triton.jit
def _dequant(
    w,
    s,
    z,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INT4: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    GROUPS: tl.constexpr,
):
    """A raw tile -> fp32 [BLOCK_N, BLOCK_K]: (q - z) * s, exact before the product's one rounding."""
    if INT4:
        shifts = tl.arange(0, 8) * 4
        q = (w[:, :, None] >> shifts[None, None, :]) & 0xF  # [BLOCK_N, BLOCK_K // 8, 8], nibble i = 8j + i
        q = _nibbles_f32(tl.reshape(q, [BLOCK_N, GROUPS, BLOCK_K // GROUPS]))
        offset = tl.full([BLOCK_N, GROUPS], MAGIC + 8.0, tl.float32)
        if HAS_ZERO:
            offset += z.to(tl.float32)
        deq = (q - offset[:, :, None]) * s.to(tl.float32)[:, :, None]
    else:
        q = tl.reshape(w.to(tl.float32), [BLOCK_N, GROUPS, BLOCK_K // GROUPS])
        deq = q * s.to(tl.float32)[:, :, None]
    return tl.reshape(deq, [BLOCK_N, BLOCK_K])


@triton.jit
def _round_to(x, dtype: tl.constexpr):
    """fp32 x rounded to ``dtype`` (round to nearest even), returned as fp32.

    bf16 by bit arithmetic: the same as the GPU's conversion, and also right in Triton's interpreter, whose
    fp32 -> bf16 cast truncates (a bias of half a bf16 step per rounding).
    """
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dtype).to(tl.float32)


@triton.jit
def _to_words(t, BLOCK_N: tl.constexpr, WORDS: tl.constexpr, GROUPS: tl.constexpr):
    """[BLOCK_N, GROUPS] per-group values -> per packed word [BLOCK_N, WORDS] (kept [BLOCK_N, 1] for one
    group: broadcast where used)."""
    if GROUPS > 1:
        t = tl.reshape(tl.broadcast_to(t[:, :, None], [BLOCK_N, GROUPS, WORDS // GROUPS]), [BLOCK_N, WORDS])
    return t


@triton.jit
def _plane_scales(
    s, z, BLOCK_N: tl.constexpr, WORDS: tl.constexpr, HAS_ZERO: tl.constexpr, GROUPS: tl.constexpr
):
    """A raw int4 tile's scales and offsets (2^23 + 8 + zero point, for ``_nibbles_f32``) [BLOCK_N, GROUPS]
    -> fp32 per packed word [BLOCK_N, WORDS] (a group spans whole words: groups are powers of two >= 8)."""
    off = tl.full([BLOCK_N, GROUPS], MAGIC + 8.0, tl.float32)
    if HAS_ZERO:
        off += z.to(tl.float32)
    return _to_words(s.to(tl.float32), BLOCK_N, WORDS, GROUPS), _to_words(off, BLOCK_N, WORDS, GROUPS)


@triton.jit
def _int4_plane(w, s, off, i: tl.constexpr, dot_ty: tl.constexpr, UPCAST: tl.constexpr):
    """Nibble ``i`` of every packed word [BLOCK_N, WORDS] (K elements 8j + i), dequantized ((q - z) * s as
    ``_dequant``, exact in fp32) and rounded to ``dot_ty``."""
    wf = (_nibbles_f32(_nibble(w, i)) - off) * s
    if UPCAST:
        return _round_to(wf, dot_ty)
    else:
        return wf.to(dot_ty)


# Nibble planes of two packed words at once on bf16x2 lanes (PTX, ``_int4_planes_packed``'s GPU path):
# lane 0 of every output holds the first word's element, lane 1 the second's. prmt gathers the words' low
# (then high) halves into one register; (t >> 4i) & 0x000F000F | 0x43004300 puts nibble i of each half into
# the mantissa of bf16 128.0 (lop3, LUT 0xEA = (a & b) | c), i.e. 128 + q; one fma subtracts 128 + 8 + z
# ($10 holds its negation; exact: integers under 256) and one multiplies by the scale ($11; + -0.0, so the
# product is rounded once, as ``_int4_plane``'s fp32 product rounded to bf16). Two instructions an element
# where the fp32 path takes about five.
_PLANES_ASM = tl.constexpr(
    """
{
.reg .b32 lo, hi, t, one, nz;
mov.b32 one, 0x3F803F80;
mov.b32 nz, 0x80008000;
prmt.b32 lo, $8, $9, 0x5410;
prmt.b32 hi, $8, $9, 0x7632;
"""
    + "".join(
        (f"shr.b32 t, {half}, {4 * j};\n" if j else f"mov.b32 t, {half};\n")
        + "lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA;\n"
        + "fma.rn.bf16x2 t, t, one, $10;\n"
        + f"fma.rn.bf16x2 ${4 * h + j}, t, $11, nz;\n"
        for h, half in enumerate(("lo", "hi"))
        for j in range(4)
    )
    + "}"
)


# How ``_int4_products`` makes its nibble planes (its PLANES constexpr): FP32 plane by plane
# (``_int4_plane``); PTX all 8 at once on bf16x2 lanes (CUDA, bf16 activations and scales:
# ``_PLANES_ASM``); EMULATED the PTX's values, all 8 at once, in Triton arithmetic (the interpreter's check
# of the PTX path's structure).
# One-row int4 launches (the FMA path) take ROWS: nibble planes against x's planes, the scale once a word
# (``_int4_row_products``), where FP32 dequantizes whole tiles (``_dequant``).
PLANES_FP32, PLANES_PTX, PLANES_EMULATED, PLANES_ROWS = 0, 1, 2, 3
_BY_FP32, _BY_PTX = tl.constexpr(PLANES_FP32), tl.constexpr(PLANES_PTX)
_BY_PLANE_ROWS = tl.constexpr(PLANES_ROWS)


@triton.jit
def _int4_planes_packed(w, s, neg_off, PLANES: tl.constexpr, dot_ty: tl.constexpr, UPCAST: tl.constexpr):
    """The 8 nibble planes of packed words ``w`` [BLOCK_N, WORDS] as a tuple of ``dot_ty`` tensors, plane i
    holding elements 8j + i: (q - z) * s rounded once, as ``_int4_plane``. ``s`` and ``neg_off`` (-(128 + 8
    + z)) are bf16 per word (``_packed_scales``)."""
    if PLANES == _BY_PTX:
        return tl.inline_asm_elementwise(
            _PLANES_ASM,
            "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r",
            [w, neg_off, s],
            dtype=(tl.bfloat16,) * 8,
            is_pure=True,
            pack=2,
        )
    else:
        sf = s.to(tl.float32)
        off = MAGIC - 128.0 - neg_off.to(tl.float32)  # 2^23 + 8 + z, as ``_plane_scales``
        return (
            _int4_plane(w, sf, off, 0, dot_ty, UPCAST),
            _int4_plane(w, sf, off, 1, dot_ty, UPCAST),
            _int4_plane(w, sf, off, 2, dot_ty, UPCAST),
            _int4_plane(w, sf, off, 3, dot_ty, UPCAST),
            _int4_plane(w, sf, off, 4, dot_ty, UPCAST),
            _int4_plane(w, sf, off, 5, dot_ty, UPCAST),
            _int4_plane(w, sf, off, 6, dot_ty, UPCAST),
            _int4_plane(w, sf, off, 7, dot_ty, UPCAST),
        )


@triton.jit
def _packed_scales(
    s, z, BLOCK_N: tl.constexpr, WORDS: tl.constexpr, HAS_ZERO: tl.constexpr, GROUPS: tl.constexpr
):
    """A raw int4 tile's scales and zero points [BLOCK_N, GROUPS] -> bf16 per packed word [BLOCK_N, WORDS]:
    the scale and -(128 + 8 + z), both exact in bf16 (scales are stored in bf16, |z| <= 8); one group stays
    [BLOCK_N, 1] (the planes broadcast it)."""
    neg_off = tl.full([BLOCK_N, GROUPS], -136.0, tl.float32)
    if HAS_ZERO:
        neg_off -= z.to(tl.float32)
    s = _to_words(s.to(tl.bfloat16), BLOCK_N, WORDS, GROUPS)
    return s, _to_words(neg_off.to(tl.bfloat16), BLOCK_N, WORDS, GROUPS)


@triton.jit
def _activation_planes(a_rows, k0, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    """A's tile [BLOCK_M, BLOCK_K] at K offset ``k0`` (``a_rows``: each row's pointer; one contiguous load a
    row, columns past K read as 0) as its 8 nibble planes [BLOCK_M, BLOCK_K / 8], plane i holding columns
    8j + i: the tile's last axis cut into 2 x 2 x 2 (i = 4 b2 + 2 b1 + b0) and split three times."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    a = tl.load(a_rows + offs_k[None, :], mask=(offs_k < K)[None, :], other=0.0)
    if UPCAST:
        a = a.to(tl.float32)
    even, odd = tl.split(tl.reshape(a, [BLOCK_M, BLOCK_K // 8, 2, 2, 2]))  # b0
    b00, b10 = tl.split(even)  # b1 of the b0 = 0 half: columns 8j + {0, 4} and 8j + {2, 6}
    b01, b11 = tl.split(odd)
    p0, p4 = tl.split(b00)  # b2
    p2, p6 = tl.split(b10)
    p1, p5 = tl.split(b01)
    p3, p7 = tl.split(b11)
    return p0, p1, p2, p3, p4, p5, p6, p7


@triton.jit
def _int4_products(  # noqa: C901 - Triton helper: its branches test tl.constexpr flags, specialised away at compile time
    A,
    W,
    S,
    Z,
    rows,
    valid,
    cols,
    col_ok,
    K,
    num_groups,
    gate_offset,
    scale_up_offset,
    stride_am,
    stride_wn,
    stride_sn,
    stride_zn,
    scale_bn,
    scale_bk,
    GATED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    GROUPS: tl.constexpr,
    SWAP: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PLANES: tl.constexpr,
    k_start,
):
    """fp32 products [BLOCK_M, BLOCK_N] of the rows ``rows`` of A with packed int4 weight rows ``cols`` (and
    the up rows ``gate_offset`` rows on, their scales ``scale_up_offset`` scale rows on), over K tiles of
    BLOCK_K elements from ``k_start`` (a multiple of BLOCK_K) to ``K``: each raw tile (``_load_raw``:
    [BLOCK_N, BLOCK_K / 8] words) is taken apart nibble by nibble, 8 planes of BLOCK_K / 8 elements
    (8j + i), each multiplied with the matching plane of A's tile (up to 16 rows: one load a tile, split by
    ``_activation_planes``; taller tiles: a strided load a plane). No reshape of the unpacked weight tile
    (``_dequant``'s took the experts' kernel to half bf16's speed on an H100). PLANES: the weight planes one
    at a time in fp32, or all 8 from two words at a time on bf16x2 lanes (``_int4_planes_packed``). Rows
    that are not ``valid`` read row 0 (no row masks; the caller never stores them). SWAP: weights as the
    MMA's M side (BLOCK_N) and the few tokens as its N, for taller token tiles."""
    WORDS: tl.constexpr = BLOCK_K // 8
    dot_ty = A.dtype.element_ty
    a_rows = A + tl.where(valid, rows, 0).to(tl.int64)[:, None] * stride_am
    acc, acc_up = zero_accumulators(SWAP, BLOCK_M, BLOCK_N)
    for k0 in range(k_start, K, BLOCK_K):
        w, s, z = _load_raw(
            W, S, Z, cols, col_ok, k0, K, num_groups, stride_wn, stride_sn, stride_zn, scale_bn, scale_bk,
            BLOCK_K, True, HAS_ZERO, GROUPS,
        )  # fmt: skip
        u, su, zu = w, s, z
        if GATED:
            u, su, zu = _load_raw(
                W + gate_offset * stride_wn, S + scale_up_offset * stride_sn, Z + gate_offset * stride_zn,
                cols, col_ok, k0, K, num_groups, stride_wn, stride_sn, stride_zn, scale_bn, scale_bk, BLOCK_K,
                True, HAS_ZERO, GROUPS,
            )  # fmt: skip
        if PLANES == _BY_FP32:
            s, off = _plane_scales(s, z, BLOCK_N, WORDS, HAS_ZERO, GROUPS)
            su, off_u = _plane_scales(su, zu, BLOCK_N, WORDS, HAS_ZERO, GROUPS)
            planes = (w,)  # unused: the fp32 planes are made one at a time below
            planes_u = (u,)
        else:
            s, off = _packed_scales(s, z, BLOCK_N, WORDS, HAS_ZERO, GROUPS)
            planes = _int4_planes_packed(w, s, off, PLANES, dot_ty, UPCAST)
            planes_u = planes
            if GATED:
                su, off_u = _packed_scales(su, zu, BLOCK_N, WORDS, HAS_ZERO, GROUPS)
                planes_u = _int4_planes_packed(u, su, off_u, PLANES, dot_ty, UPCAST)
        if BLOCK_M <= 16:
            a_planes = _activation_planes(a_rows, k0, K, BLOCK_M, BLOCK_K, UPCAST)
        else:
            a_planes = (a_rows,)  # taller token tiles load each plane's strided columns below
        for i in tl.static_range(8):
            if PLANES == _BY_FP32:
                wd = _int4_plane(w, s, off, i, dot_ty, UPCAST)
                ud = _int4_plane(u, su, off_u, i, dot_ty, UPCAST)
            else:
                wd = planes[i]
                ud = planes_u[i]
            if BLOCK_M <= 16:
                a = a_planes[i]
                if SWAP:
                    a = tl.trans(a)
            else:
                # a plane's strided columns loaded as the MMA takes them ([K, tokens] swapped), masked rows:
                # loaded [tokens, K] and transposed, rows clamped, the experts' 32-row tiles took 2.1x as
                # long on an H100 (26b-a4b, 512 tokens: 1,622 against 779 us)
                k = k0 + 8 * tl.arange(0, WORDS) + i
                if SWAP:
                    a_mask = valid[None, :] & (k < K)[:, None]
                    a = tl.load(A + rows[None, :] * stride_am + k[:, None], mask=a_mask, other=0.0)
                else:
                    a_mask = valid[:, None] & (k < K)[None, :]
                    a = tl.load(A + rows[:, None] * stride_am + k[None, :], mask=a_mask, other=0.0)
                if UPCAST:
                    a = a.to(tl.float32)
            if SWAP:
                acc = tl.dot(wd, a, acc, input_precision=DOT_PRECISION)
                if GATED:
                    acc_up = tl.dot(ud, a, acc_up, input_precision=DOT_PRECISION)
            else:
                acc = tl.dot(a, tl.trans(wd), acc, input_precision=DOT_PRECISION)
                if GATED:
                    acc_up = tl.dot(a, tl.trans(ud), acc_up, input_precision=DOT_PRECISION)
    return rows_first(acc, acc_up, SWAP)


@triton.jit
def _row_words(
    w, s, z, xs, BLOCK_N: tl.constexpr, WORDS: tl.constexpr, HAS_ZERO: tl.constexpr, GROUPS: tl.constexpr
):
    """A raw int4 tile's products with one token row, per packed word [BLOCK_N, WORDS] (fp32, the scale
    applied once a word): sum_i (q_i - 8 - z) x_i. Nibble i is masked in place in its half-word (w, or w >> 16
    for i >= 4) and OR-ed into 2^23's mantissa: 2^23 + q 16^j (j = i % 4, under 2^23) in one LOP3, and one
    subtract of 2^23 + (8 + z) 16^j leaves (q - 8 - z) 16^j exactly; ``xs`` holds x's planes times 16^-j.
    Three instructions an element (LOP3, FADD, FFMA) where shifting each nibble down takes five."""
    eight_z = tl.full([BLOCK_N, GROUPS], 8.0, tl.float32)
    if HAS_ZERO:
        eight_z += z.to(tl.float32)
    sw = _to_words(s.to(tl.float32), BLOCK_N, WORDS, GROUPS)
    hi = w.to(tl.uint32, bitcast=True) >> 16
    t = tl.zeros([BLOCK_N, WORDS], tl.float32)
    for j in tl.static_range(4):
        off_g = (
            eight_z * (1 << (4 * j)) + MAGIC
        )  # the tensor first: the interpreter's constexpr + tensor fails
        off = _to_words(off_g, BLOCK_N, WORDS, GROUPS)
        lo = ((w & (0xF << (4 * j))) | MAGIC_BITS).to(tl.float32, bitcast=True)
        up = ((hi & (0xF << (4 * j))) | MAGIC_BITS).to(tl.float32, bitcast=True)
        t += (lo - off) * xs[j]
        t += (up - off) * xs[j + 4]
    return t * sw


@triton.jit
def _int4_row_products(
    W,
    S,
    Z,
    x_row,
    offs_n,
    N,
    k_start,
    k_end,
    num_groups,
    stride_wn,
    stride_sn,
    stride_zn,
    scale_bn,
    scale_bk,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    GROUPS: tl.constexpr,
    GATED: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One token row against int4 weight rows ``offs_n`` (and their up rows N on, ``GATED``) over K in
    [k_start, k_end): fp32 [1, BLOCK_N] products on the CUDA cores, by nibble planes as the row tiles take
    them (``x_row``: the row's pointer [1, 1]; its tile split by ``_activation_planes``; ``_row_words``: three
    instructions an element, the scale once a word). The first raw tile is requested before the
    dependent-launch wait, each next one before this one's math."""
    WORDS: tl.constexpr = BLOCK_K // 8
    n_mask = offs_n < N
    w, s, z = _load_raw(
        W, S, Z, offs_n, n_mask, k_start, k_end, num_groups, stride_wn, stride_sn, stride_zn, scale_bn,
        scale_bk, BLOCK_K, True, HAS_ZERO, GROUPS,
    )  # fmt: skip
    u, su, zu = w, s, z
    if GATED:
        u, su, zu = _load_raw(
            W, S, Z, offs_n + N, n_mask, k_start, k_end, num_groups, stride_wn, stride_sn, stride_zn,
            scale_bn, scale_bk, BLOCK_K, True, HAS_ZERO, GROUPS,
        )  # fmt: skip
    wait_for_previous_kernel(USE_PDL)
    acc = tl.zeros([BLOCK_N, WORDS], tl.float32)
    acc_up = tl.zeros([BLOCK_N, WORDS], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        xp = _activation_planes(x_row, k0, k_end, 1, BLOCK_K, True)
        w_next, s_next, z_next = _load_raw(
            W, S, Z, offs_n, n_mask, k0 + BLOCK_K, k_end, num_groups, stride_wn, stride_sn, stride_zn,
            scale_bn, scale_bk, BLOCK_K, True, HAS_ZERO, GROUPS,
        )  # fmt: skip
        u_next, su_next, zu_next = w_next, s_next, z_next
        if GATED:
            u_next, su_next, zu_next = _load_raw(
                W, S, Z, offs_n + N, n_mask, k0 + BLOCK_K, k_end, num_groups, stride_wn, stride_sn,
                stride_zn, scale_bn, scale_bk, BLOCK_K, True, HAS_ZERO, GROUPS,
            )  # fmt: skip
        # x's planes times 16^-(i % 4), exact: nibble i stays at bit 4 (i % 4) of its half-word (below)
        xs = (xp[0], xp[1] * 0.0625, xp[2] * 0.00390625, xp[3] * 0.000244140625)
        xs = xs + (xp[4], xp[5] * 0.0625, xp[6] * 0.00390625, xp[7] * 0.000244140625)
        acc += _row_words(w, s, z, xs, BLOCK_N, WORDS, HAS_ZERO, GROUPS)
        if GATED:
            acc_up += _row_words(u, su, zu, xs, BLOCK_N, WORDS, HAS_ZERO, GROUPS)
        w, s, z = w_next, s_next, z_next
        u, su, zu = u_next, su_next, zu_next
    return tl.sum(acc, axis=1)[None, :], tl.sum(acc_up, axis=1)[None, :]


@triton.jit
def _products(  # noqa: C901 - Triton helper: its branches test tl.constexpr flags, specialised away at compile time
    X,
    W,
    S,
    Z,
    offs_m,
    offs_n,
    M,
    N,
    k_start,
    k_end,
    num_groups,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_zn,
    scale_bn,
    scale_bk,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUPS: tl.constexpr,
    INT4: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    EPILOGUE: tl.constexpr,
    USE_DOT: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
    SWAP: tl.constexpr,
    PLANES: tl.constexpr,
):
    """fp32 products [BLOCK_M, BLOCK_N] of rows ``offs_m`` by weight rows ``offs_n`` over K in
    [k_start, k_end) (``k_start`` a multiple of BLOCK_K), and of the up half for ``gate_up``; waits on the
    previous kernel once the first raw tile is requested (FP8 tiles and the one-row path: each raw tile
    dequantized whole, the next one requested before this one's math). int4 row tiles: ``_int4_products``'
    nibble planes (SWAP its operand order), after the wait."""
    if INT4 and USE_DOT:
        wait_for_previous_kernel(USE_PDL)
        # the stacked [gate; up] weight: the up rows N rows on, their scales too (int4 scales are per row)
        y, y_up = _int4_products(
            X, W, S, Z, offs_m.to(tl.int64), offs_m < M, offs_n, offs_n < N, k_end, num_groups, N, N,
            stride_xm, stride_wn, stride_sn, stride_zn, scale_bn, scale_bk, EPILOGUE == 1, BLOCK_M, BLOCK_N,
            BLOCK_K, HAS_ZERO, GROUPS, SWAP, UPCAST, DOT_PRECISION, PLANES, k_start,
        )  # fmt: skip
    elif INT4 and PLANES == _BY_PLANE_ROWS:
        y, y_up = _int4_row_products(
            W, S, Z, X + offs_m[:, None].to(tl.int64) * stride_xm, offs_n, N, k_start, k_end, num_groups,
            stride_wn, stride_sn, stride_zn, scale_bn, scale_bk, BLOCK_N, BLOCK_K, HAS_ZERO, GROUPS,
            EPILOGUE == 1, USE_PDL,
        )  # fmt: skip
    else:
        offs_k = tl.arange(0, BLOCK_K)
        n_mask = offs_n < N
        m_mask = offs_m < M
        up_rows = offs_n + N  # the up half of a stacked [gate; up] weight
        x_ptrs = X + offs_m[:, None].to(tl.int64) * stride_xm + k_start + offs_k[None, :]
        # Weights are never written during a step: the first raw tile is requested before waiting on the
        # previous kernel (programmatic dependent launch).
        w, s, z = _load_raw(
            W, S, Z, offs_n, n_mask, k_start, k_end, num_groups, stride_wn, stride_sn, stride_zn, scale_bn,
            scale_bk, BLOCK_K, INT4, HAS_ZERO, GROUPS,
        )  # fmt: skip
        u, su, zu = w, s, z
        if EPILOGUE == 1:
            u, su, zu = _load_raw(
                W, S, Z, up_rows, n_mask, k_start, k_end, num_groups, stride_wn, stride_sn, stride_zn,
                scale_bn, scale_bk, BLOCK_K, INT4, HAS_ZERO, GROUPS,
            )  # fmt: skip
        wait_for_previous_kernel(USE_PDL)
        if USE_DOT:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        else:
            acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
            acc_up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            x = tl.load(x_ptrs, mask=m_mask[:, None] & ((k0 + offs_k) < k_end)[None, :], other=0.0)
            # the next raw tile before this one's math (masked off past k_end)
            w_next, s_next, z_next = _load_raw(
                W, S, Z, offs_n, n_mask, k0 + BLOCK_K, k_end, num_groups, stride_wn, stride_sn, stride_zn,
                scale_bn, scale_bk, BLOCK_K, INT4, HAS_ZERO, GROUPS,
            )  # fmt: skip
            u_next, su_next, zu_next = w_next, s_next, z_next
            if EPILOGUE == 1:
                u_next, su_next, zu_next = _load_raw(
                    W, S, Z, up_rows, n_mask, k0 + BLOCK_K, k_end, num_groups, stride_wn, stride_sn,
                    stride_zn, scale_bn, scale_bk, BLOCK_K, INT4, HAS_ZERO, GROUPS,
                )  # fmt: skip
            wf = _dequant(w, s, z, BLOCK_N, BLOCK_K, INT4, HAS_ZERO, GROUPS)
            if USE_DOT:
                # the dequantized tile rounded to the activation dtype, as the reference's dequantized weight
                if UPCAST:
                    xd = x.to(tl.float32)
                    wd = _round_to(wf, x.dtype)
                else:
                    xd = x
                    wd = wf.to(x.dtype)
                acc += tl.dot(xd, tl.trans(wd), input_precision=DOT_PRECISION)
                if EPILOGUE == 1:
                    uf = _dequant(u, su, zu, BLOCK_N, BLOCK_K, INT4, HAS_ZERO, GROUPS)
                    ud = _round_to(uf, x.dtype) if UPCAST else uf.to(x.dtype)
                    acc_up += tl.dot(xd, tl.trans(ud), input_precision=DOT_PRECISION)
            else:
                xf = x.to(tl.float32)  # [1, BLOCK_K]
                acc += wf * xf
                if EPILOGUE == 1:
                    acc_up += _dequant(u, su, zu, BLOCK_N, BLOCK_K, INT4, HAS_ZERO, GROUPS) * xf
            w, s, z = w_next, s_next, z_next
            u, su, zu = u_next, su_next, zu_next
            x_ptrs += BLOCK_K

        if USE_DOT:
            y = acc
            y_up = acc_up
        else:
            y = tl.sum(acc, axis=1)[None, :]  # [1, BLOCK_N]
            y_up = tl.sum(acc_up, axis=1)[None, :]
    return y, y_up


def _quant_matmul_fn(
    X,
    W,
    S,
    Z,
    E,
    Y,
    M,
    N,
    K,
    num_groups,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_zn,
    stride_em,
    stride_ym,
    scale_bn,
    scale_bk,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUPS: tl.constexpr,
    INT4: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    EPILOGUE: tl.constexpr,
    ACT: tl.constexpr,
    USE_DOT: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
    SWAP: tl.constexpr,
    PLANES: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    y, y_up = _products(
        X, W, S, Z, offs_m, offs_n, M, N, 0, K, num_groups, stride_xm, stride_wn, stride_sn, stride_zn,
        scale_bn, scale_bk, BLOCK_M, BLOCK_N, BLOCK_K, GROUPS, INT4, HAS_ZERO, EPILOGUE, USE_DOT, UPCAST,
        DOT_PRECISION, USE_PDL, SWAP, PLANES,
    )  # fmt: skip
    n_mask = offs_n < N
    m_mask = offs_m < M
    store_gated(y, y_up, Y, E, offs_m, offs_n, m_mask, n_mask, stride_em, stride_ym, EPILOGUE, ACT)


def _quant_matmul_split_fn(
    X,
    W,
    S,
    Z,
    P,
    M,
    N,
    K,
    num_groups,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_zn,
    scale_bn,
    scale_bk,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUPS: tl.constexpr,
    INT4: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    EPILOGUE: tl.constexpr,
    USE_DOT: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
    SWAP: tl.constexpr,
    PLANES: tl.constexpr,
):
    """Split-K: program (n, m, split) writes its fp32 partial products over one K range (a whole number of K
    tiles) to P [splits, 1 or 2 (gate, up), M, N]; ``_split_reduce_fn`` sums them in split order."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    splits = tl.num_programs(2)
    k_per_split = tl.cdiv(tl.cdiv(K, splits), BLOCK_K) * BLOCK_K
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    y, y_up = _products(
        X, W, S, Z, offs_m, offs_n, M, N, k_start, k_end, num_groups, stride_xm, stride_wn, stride_sn,
        stride_zn, scale_bn, scale_bk, BLOCK_M, BLOCK_N, BLOCK_K, GROUPS, INT4, HAS_ZERO, EPILOGUE, USE_DOT,
        UPCAST, DOT_PRECISION, USE_PDL, SWAP, PLANES,
    )  # fmt: skip
    n_mask = offs_n < N
    m_mask = offs_m < M
    parts: tl.constexpr = 2 if EPILOGUE == 1 else 1
    mask = m_mask[:, None] & n_mask[None, :]
    p_ptrs = P + ((pid_k * parts) * M + offs_m[:, None]).to(tl.int64) * N + offs_n[None, :]
    tl.store(p_ptrs, y, mask=mask)
    if EPILOGUE == 1:
        tl.store(p_ptrs + tl.cast(M, tl.int64) * N, y_up, mask=mask)


def _split_reduce_fn(
    P,
    E,
    Y,
    M,
    N,
    splits,
    stride_em,
    stride_ym,
    BLOCK_N: tl.constexpr,
    EPILOGUE: tl.constexpr,
    ACT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One row's BLOCK_N outputs: the split partials summed in split order (deterministic), then the
    epilogue."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m + tl.arange(0, 1)
    n_mask = offs_n < N
    m_mask = offs_m < M
    parts: tl.constexpr = 2 if EPILOGUE == 1 else 1
    wait_for_previous_kernel(USE_PDL)
    p_ptrs = P + pid_m.to(tl.int64) * N + offs_n
    y = tl.zeros([BLOCK_N], tl.float32)
    y_up = tl.zeros([BLOCK_N], tl.float32)
    for _ in range(0, splits):
        y += tl.load(p_ptrs, mask=n_mask, other=0.0)
        if EPILOGUE == 1:
            y_up += tl.load(p_ptrs + tl.cast(M, tl.int64) * N, mask=n_mask, other=0.0)
        p_ptrs += parts * tl.cast(M, tl.int64) * N  # (tl.cast: M == 1 arrives as a constexpr int)
    store_gated(
        y[None, :], y_up[None, :], Y, E, offs_m, offs_n, m_mask, n_mask, stride_em, stride_ym, EPILOGUE, ACT
    )


_quant_matmul = DualKernel(_quant_matmul_fn)
_quant_matmul_split = DualKernel(_quant_matmul_split_fn)
_split_reduce = DualKernel(_split_reduce_fn)


def quant_matmul_config(m: int, n: int, k: int, epilogue: int = PLAIN) -> dict[str, int]:
    """Tiles per shape, chosen without a device sweep (bench/engine_microbench.py --quantization measures
    them). One row: ``gemv.py``'s tiles (one or two weight rows per program, K steps of 512/1024). Up to
    ``SKINNY_ROWS`` rows: one row tile of the padded batch, 32 columns (16 for narrow N). More rows: 64 x 128
    tiles (128 x 128 past 256 rows) with K steps of 64."""
    k_pow2 = max(16, next_pow2(k))
    if m == 1:
        if k <= 512:
            return {"block_m": 1, "block_n": 4, "block_k": k_pow2, "num_warps": 4, "num_stages": 1}
        block_k = 1024 if k % 1024 == 0 else 512
        return {
            "block_m": 1,
            "block_n": 2 if block_k == 1024 else 1,
            "block_k": block_k,
            "num_warps": 8 if n <= 512 else 4,
            "num_stages": 1,
        }
    if m <= SKINNY_ROWS:
        block_n = 16 if n <= 512 else 32
        return {
            "block_m": max(16, next_pow2(m)),
            "block_n": block_n,
            "block_k": min(128, k_pow2),
            "num_warps": 4,
            "num_stages": 3,
        }
    block_m = 64 if m <= 256 else 128
    return {"block_m": block_m, "block_n": 128, "block_k": min(64, k_pow2), "num_warps": 8, "num_stages": 3}


PTX_PLANES_MAX_ROWS = 16


def int4_planes(x: torch.Tensor, scale: torch.Tensor, block_m: int) -> int:
    """How int4 tiles of ``block_m`` token rows make their nibble planes for activations ``x`` and weight
    scales ``scale`` (``G4SERVE_INT4_PLANES=fp32``: always ``PLANES_FP32``, the kernels before the planes):
    one row ``PLANES_ROWS``; ``PLANES_PTX`` for bf16 activations and scales on a CUDA device of compute
    capability 8.0 or later (bf16x2 fma) in tiles of at most ``PTX_PLANES_MAX_ROWS`` rows; else
    ``PLANES_FP32``. Taller tiles (prefill, the experts past 8 rows an expert) keep the fp32 planes: the PTX
    planes hold all 8 planes of the gate and up tiles at once, and were measured in 16-row tiles only."""
    if not _planes_on():
        return PLANES_FP32
    if block_m == 1:
        return PLANES_ROWS
    if x.dtype != torch.bfloat16 or scale.dtype != torch.bfloat16 or x.device.type != "cuda":
        return PLANES_FP32
    if block_m > PTX_PLANES_MAX_ROWS:
        return PLANES_FP32
    return PLANES_PTX if torch.cuda.get_device_capability(x.device.index or 0) >= (8, 0) else PLANES_FP32


@functools.cache
def _planes_on() -> bool:
    return envs.get("G4SERVE_INT4_PLANES") == "ptx"


def int4_matmul_config(m: int, n: int, k: int, epilogue: int = PLAIN, sm_count: int = 132) -> dict[str, int]:
    """int4 tiles per shape, from a device sweep (``bench/gemv_kernels.py --quant w4a16 --sweep``, e4b's
    shapes on an H100). One row: the FMA path, 4 weight rows a program over K steps of 512 on 2 warps (2 rows
    and 2,048 on 4 warps from K = 4,096; narrow N: 2 rows over 4,096 on 8): 1.98 ms a step's int4
    projections against 3.07 with ``quant_matmul_config``'s (swept on whole-tile dequantization; by nibble
    planes, ``_int4_row_products``, the same tiles take 1.74 ms). 2-16 rows: a 16-row tile on the PTX
    planes, 64 columns a program over K tiles of 128, K split 4 ways (2 past one tile per SM, none past
    two); gated projections 32 columns over K tiles of 256, unsplit, as are short K: 2.87 ms at 16 rows
    against 4.39 with the generic row tile (tinygemm: 5.76). More rows: ``quant_matmul_config``."""
    if m == 1:
        if n <= 512:
            return {"block_m": 1, "block_n": 2, "block_k": 4096, "num_warps": 8, "num_stages": 1}
        if k >= 4096:
            return {"block_m": 1, "block_n": 2, "block_k": 2048, "num_warps": 4, "num_stages": 1}
        return {
            "block_m": 1,
            "block_n": 4,
            "block_k": min(512, max(256, next_pow2(k))),
            "num_warps": 2,
            "num_stages": 1,
        }
    if m > PTX_PLANES_MAX_ROWS:
        return quant_matmul_config(m, n, k, epilogue)
    if epilogue == GATE_UP or k <= 256:
        return {"block_m": 16, "block_n": 32, "block_k": 256, "num_warps": 4, "num_stages": 3}
    tiles = triton.cdiv(n, 64)
    cfg = {"block_m": 16, "block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 3}
    if tiles < 2 * sm_count and k >= 4 * 128:
        cfg["split_k"] = 4 if tiles <= sm_count else 2
    return cfg


def int4_block_k(block_m: int) -> int:
    """K tile of the int4 tensor-core GEMMs (the experts' and ``quant_matmul``'s row tiles): 8 nibble planes
    of at least 16 elements (the MMA's K), whatever the tiles say; their operands swap past 16-row token
    tiles (``int4_swap``). Measured on an H100 at 26B-A4B shapes (w4a16, whole expert block): with 16-row
    token tiles the unswapped planes of K 128 took 55 µs at T=1 against 64-68 swapped; past them (SWAP) K 256
    took 943 µs at T=512 against 1014 with K 128 and 1861 unswapped."""
    return 128 if block_m <= 16 else 256


def int4_swap(block_m: int) -> bool:
    """Whether the int4 plane products put the weight rows on the MMA's M side (see ``int4_block_k``)."""
    return block_m > 16


def int4_tiles(cfg: dict[str, int], int4: bool) -> dict[str, int]:
    """``cfg`` with int4 row tiles' K tile at least ``int4_block_k`` (nibble planes of at least 16 elements;
    a longer one as given, e.g. by a tile sweep), the one-row path's as it is."""
    if not int4 or cfg["block_m"] == 1:
        return cfg
    return {**cfg, "block_k": max(cfg["block_k"], int4_block_k(cfg["block_m"]))}


def _groups_per_tile(block_k: int, scale_bk: int, k: int) -> int:
    """Scale columns one K tile spans; a tile never straddles a partial scale block."""
    if scale_bk >= k or scale_bk % block_k == 0:
        return 1
    assert block_k % scale_bk == 0, f"K tile {block_k} and scale block {scale_bk} must nest"
    return block_k // scale_bk


def quant_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    scale_block: tuple[int, int],
    in_features: int,
    zero_point: torch.Tensor | None = None,
    epilogue: int = PLAIN,
    activation: str | None = None,
    other: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """x [M, K] (unit last stride) against a quantized weight -> [M, N] in x's dtype.

    ``weight``: float8_e4m3fn [N or 2N, K], or int32 [N or 2N, ceil(K / 8)] packed int4; ``scale``
    [ceil(rows / bn), ceil(K / bk)] for ``scale_block`` = (bn, bk); ``zero_point`` int8 [rows, ceil(K / bk)]
    (int4 only).
    Epilogues as ``gemv.skinny_matmul``. ``config``: quant_matmul_config's keys, optionally ``split_k``."""
    m, k = x.shape
    int4 = weight.dtype == torch.int32
    assert k == in_features and x.stride(-1) == 1 and weight.is_contiguous() and scale.is_contiguous()
    assert weight.shape[1] == ((k + 7) // 8 if int4 else k)
    n = weight.shape[0] // 2 if epilogue == GATE_UP else weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    # int4 scales are per row (groups along K, or a channel): the gated planes find the up rows' N rows on
    assert not int4 or scale_block[0] == 1, f"int4 scale blocks are 1 x g, got {scale_block}"
    if config is None and int4:
        sms = sm_count(x.device.index or 0) if x.is_cuda else 132
        config = int4_matmul_config(m, n, k, epilogue, sms)
    cfg = int4_tiles(config or quant_matmul_config(m, n, k, epilogue), int4)
    block_m = cfg["block_m"]
    bn, bk = scale_block
    groups = _groups_per_tile(cfg["block_k"], bk, k)
    upcast, precision = dot_settings(x.dtype, x.device)
    if epilogue == MUL:
        assert other is not None and other.shape == (m, n) and other.stride(-1) == 1
    if cfg.get("split_k", 1) > 1:
        _split_k_matmul(
            x, weight, scale, scale_block, zero_point, epilogue, activation, other, cfg, groups, y
        )
        return y
    grid = (triton.cdiv(n, cfg["block_n"]), triton.cdiv(m, block_m))
    _quant_matmul[x.device][grid](
        x,
        weight,
        scale,
        zero_point if zero_point is not None else scale,
        other if other is not None else y,
        y,
        m,
        n,
        k,
        scale.shape[1],
        x.stride(0),
        weight.stride(0),
        scale.stride(0),
        zero_point.stride(0) if zero_point is not None else 0,
        other.stride(0) if other is not None else 0,
        y.stride(0),
        bn,
        bk,
        BLOCK_M=block_m,
        BLOCK_N=cfg["block_n"],
        BLOCK_K=cfg["block_k"],
        GROUPS=groups,
        INT4=int4,
        HAS_ZERO=zero_point is not None,
        EPILOGUE=epilogue,
        ACT=_KINDS[activation] if epilogue != PLAIN else 0,
        USE_DOT=block_m > 1,
        UPCAST=upcast,
        DOT_PRECISION=precision,
        SWAP=int4 and block_m > 1 and int4_swap(block_m),
        PLANES=int4_planes(x, scale, block_m) if int4 else PLANES_FP32,
        **pdl(x.device, m),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return y


def _split_k_matmul(x, weight, scale, scale_block, zero_point, epilogue, activation, other, cfg, groups, y):
    """``config["split_k"]`` > 1: K cut into that many ranges of whole K tiles, each program's fp32 partials
    written to a workspace, then summed in split order by a second kernel that applies the epilogue (no
    atomics: deterministic, and capturable in a CUDA graph)."""
    m, k = x.shape
    n = y.shape[1]
    splits = cfg["split_k"]
    parts = 2 if epilogue == GATE_UP else 1
    partials = torch.empty((splits, parts, m, n), dtype=torch.float32, device=x.device)
    upcast, precision = dot_settings(x.dtype, x.device)
    launch = pdl(x.device, m)
    grid = (triton.cdiv(n, cfg["block_n"]), triton.cdiv(m, cfg["block_m"]), splits)
    _quant_matmul_split[x.device][grid](
        x,
        weight,
        scale,
        zero_point if zero_point is not None else scale,
        partials,
        m,
        n,
        k,
        scale.shape[1],
        x.stride(0),
        weight.stride(0),
        scale.stride(0),
        zero_point.stride(0) if zero_point is not None else 0,
        scale_block[0],
        scale_block[1],
        BLOCK_M=cfg["block_m"],
        BLOCK_N=cfg["block_n"],
        BLOCK_K=cfg["block_k"],
        GROUPS=groups,
        INT4=weight.dtype == torch.int32,
        HAS_ZERO=zero_point is not None,
        EPILOGUE=epilogue,
        USE_DOT=cfg["block_m"] > 1,
        UPCAST=upcast,
        DOT_PRECISION=precision,
        SWAP=weight.dtype == torch.int32 and cfg["block_m"] > 1 and int4_swap(cfg["block_m"]),
        PLANES=int4_planes(x, scale, cfg["block_m"]) if weight.dtype == torch.int32 else PLANES_FP32,
        **launch,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    block_n = min(1024, max(16, next_pow2(n)))
    _split_reduce[x.device][(triton.cdiv(n, block_n), m)](
        partials,
        other if other is not None else y,
        y,
        m,
        n,
        splits,
        other.stride(0) if other is not None else 0,
        y.stride(0),
        BLOCK_N=block_n,
        EPILOGUE=epilogue,
        ACT=_KINDS[activation] if epilogue != PLAIN else 0,
        **launch,
        num_warps=4,
    )


def int4_nibbles(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """int32 [R, ceil(K / 8)] of compressed-tensors' packing -> int32 [R, K] of the stored nibbles q + 8
    (0..15): element 8j + i is nibble i of word j."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF
    return nibbles.reshape(packed.shape[0], -1)[:, :in_features]


def unpack_int4(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """int32 [R, ceil(K / 8)] of compressed-tensors' packing -> int8 [R, K] in [-8, 7]."""
    return (int4_nibbles(packed, in_features) - 8).to(torch.int8)


def _expand(t: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    """A per-block tensor repeated over its blocks, cropped to ``shape``."""
    rows = torch.arange(shape[0], device=t.device) // block[0]
    cols = torch.arange(shape[1], device=t.device) // block[1]
    return t[rows][:, cols]


def dequantize_reference(
    weight: torch.Tensor,
    scale: torch.Tensor,
    scale_block: tuple[int, int],
    in_features: int,
    zero_point: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The dense weight [N, K]: (q - z) * s in fp32 (one rounding), then rounded to ``dtype``."""
    if weight.dtype == torch.int32:
        q = unpack_int4(weight, in_features).float()
    else:
        q = weight.float()
    shape = (q.shape[0], in_features)
    if zero_point is not None:
        q = q - _expand(zero_point, (1, scale_block[1]), shape).float()
    return (q * _expand(scale.float(), scale_block, shape)).to(dtype)


def quant_matmul_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    scale_block: tuple[int, int],
    in_features: int,
    zero_point: torch.Tensor | None = None,
    epilogue: int = PLAIN,
    activation: str | None = None,
    other: torch.Tensor | None = None,
) -> torch.Tensor:
    """The weight dequantized to x's dtype, then the unfused ops (``gemv.skinny_matmul_reference``: F.linear,
    the activation kernel's math)."""
    w = dequantize_reference(weight, scale, scale_block, in_features, zero_point, x.dtype)
    return skinny_matmul_reference(x, w, epilogue, activation, other)


__all__ = [
    "SKINNY_ROWS",
    "dequantize_reference",
    "quant_matmul",
    "quant_matmul_config",
    "quant_matmul_reference",
    "int4_nibbles",
    "unpack_int4",
]
