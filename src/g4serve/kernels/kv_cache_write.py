"""Scatter a step's new K/V rows into their paged-cache slots (slot -1: skip), and its torch reference.

One program per token copies all its KV heads; unlike ``PagedKVCache.write`` it needs no host sync to
drop the -1 slots, so it can sit inside a CUDA graph. An FP8 (e4m3) cache stores each row divided by its
KV head's scale and saturated to +-448 (``quantize_fp8``); the attention kernels multiply it back
(``dequantize_kv_reference`` is the torch form both references use).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from g4serve.kernels._launch import DualKernel, next_pow2, pdl, wait_for_previous_kernel

KV_FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value; larger magnitudes saturate to it


@triton.jit
def activation_scale(amax):
    """The dynamic e4m3 scale of values whose largest magnitude is ``amax``: max(amax / 448, 1e-12), divided
    correctly rounded (as torch divides). One formula for every activation quantizer (per row, per 128-column
    group, and the norm that quantizes its output for the W8A8 GEMM), so their scales agree bit for bit."""
    return tl.maximum(tl.div_rn(amax, 448.0), 1e-12)  # 448: FP8_MAX


def activation_scale_reference(amax: torch.Tensor) -> torch.Tensor:
    """``activation_scale`` in torch, on any device: amax (fp32) / 448 correctly rounded, at least 1e-12.

    Not ``amax / FP8_MAX``: CUDA torch multiplies by the reciprocal of a Python-number divisor, which is one
    ulp off for some amax (the H200 showed it), so a kernel that divides correctly would not match bit for
    bit. A divisor tensor on amax's own device makes torch divide."""
    amax = amax.float()
    return torch.div(amax, torch.full_like(amax, FP8_MAX)).clamp_min(1e-12)


@triton.jit
def quantize_fp8(x, scale, OUT_TY: tl.constexpr):
    """x / scale in fp32 (correctly rounded, as torch divides), saturated to +-448, rounded to the nearest
    e4m3 value (ties to even) and stored as OUT_TY (e4m3): bit for bit ``quantize_kv_reference``.

    The rounding is done here in fp32, so that the cast only changes the type: the GPU's cvt.rn would round
    the same way, but Triton's interpreter rounds fp8 casts its own way (ties away from zero, subnormals
    truncated). Adding 1.5 * 2^(e + 20) to |y| (e: y's exponent, at least -6, where e4m3's subnormal step
    2^-9 begins) leaves an fp32 sum whose last bit is worth e4m3's step 2^(e - 3), so the addition itself
    rounds |y| to that step, ties to even; subtracting it again is exact."""
    y = tl.div_rn(x.to(tl.float32), scale)
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    bits = y.to(tl.int32, bitcast=True)
    exponent = tl.maximum((bits >> 23) & 0xFF, 121)  # biased; 121 = 127 - 6
    magic = (((exponent + 20) << 23) | 0x400000).to(tl.float32, bitcast=True)
    rounded = (tl.abs(y) + magic) - magic
    # y's sign bit put back by bits, not by negating: compiled code negates +0.0 into +0.0, and torch casts a
    # negative value that rounds to zero as -0.0 (0x80; seen on an H100)
    sign = (bits >> 31) << 31
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True).to(OUT_TY)


def _kv_cache_write_fn(
    K,
    V,
    KCache,
    VCache,
    Slots,
    KScale,
    VScale,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ct,
    stride_ch,
    stride_dt,
    stride_dh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_FP8: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    t = tl.program_id(0)
    slot = tl.load(Slots + t).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = offs_h < NUM_HEADS
    mask = h_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    if KV_FP8:
        k = quantize_fp8(k, tl.load(KScale + offs_h, mask=h_ok, other=1.0)[:, None], KCache.dtype.element_ty)
        v = quantize_fp8(v, tl.load(VScale + offs_h, mask=h_ok, other=1.0)[:, None], VCache.dtype.element_ty)
    tl.store(
        KCache + slot * stride_ct + offs_h[:, None] * stride_ch + offs_d[None, :],
        k.to(KCache.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        VCache + slot * stride_dt + offs_h[:, None] * stride_dh + offs_d[None, :],
        v.to(VCache.dtype.element_ty),
        mask=mask,
    )


_kv_cache_write = DualKernel(_kv_cache_write_fn)


def kv_cache_write(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """k/v [T, Hkv, D] -> k_cache/v_cache [S, Hkv, D] rows ``slots`` [T] (long or int32; -1: skip).

    An FP8 cache takes ``k_scale`` / ``v_scale`` [Hkv] fp32: it stores k / k_scale and v / v_scale."""
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    fp8 = k_cache.dtype == KV_FP8_DTYPE
    assert not fp8 or (k_scale is not None and v_scale is not None), "an FP8 cache needs its scales"
    _kv_cache_write[k.device][(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slots,
        k_scale if fp8 else slots,  # never read without KV_FP8
        v_scale if fp8 else slots,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=next_pow2(num_heads),
        BLOCK_D=next_pow2(head_dim),
        KV_FP8=fp8,
        **pdl(k.device, num_tokens),
        num_warps=4 if num_heads * head_dim <= 2048 else 8,
    )


def quantize_kv_reference(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., Hkv, D] -> e4m3 x / scale (scale [Hkv] fp32), saturated to +-448."""
    return (x.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(KV_FP8_DTYPE)


def dequantize_kv_reference(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Cached rows [..., Hkv, D] -> fp32 values: times ``scale`` [Hkv] for an FP8 cache (None: as stored)."""
    return x.float() if scale is None else x.float() * scale[:, None]


def kv_cache_write_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    keep = slots >= 0
    rows = slots[keep].long()
    if k_cache.dtype == KV_FP8_DTYPE:
        # index_copy_ has no float8 kernel on CPU: copy the bytes
        k_cache.view(torch.uint8).index_copy_(
            0, rows, quantize_kv_reference(k[keep], k_scale).view(torch.uint8)
        )
        v_cache.view(torch.uint8).index_copy_(
            0, rows, quantize_kv_reference(v[keep], v_scale).view(torch.uint8)
        )
        return
    k_cache.index_copy_(0, rows, k[keep].to(k_cache.dtype))
    v_cache.index_copy_(0, rows, v[keep].to(v_cache.dtype))


__all__ = [
    "FP8_MAX",
    "KV_FP8_DTYPE",
    "activation_scale_reference",
    "dequantize_kv_reference",
    "kv_cache_write",
    "kv_cache_write_reference",
    "quantize_fp8",
    "quantize_kv_reference",
]
