"""A KV-producing attention layer's whole prologue in one kernel: q/k norm + RoPE, the v norm, and the
new K/V rows written into their paged-cache slots, straight from the fused QKV projection's output.

Unfused that is four launches per layer (norm_rope on q, on k, on v, then kv_cache_write) and a round
trip of K/V through memory. Grid: (token block, head row) over Hq + 2 Hkv rows; a row is a q head (normed
with q_norm, rotated, stored to a contiguous [T, Hq, D] q), a k head (k_norm, rotated, stored to the
K cache) or a v head (weightless norm, stored to the V cache). K/V rows of tokens with slot -1 (graph
padding) are dropped. Rounding follows ``norm_rope``: the norm's result is rounded to the input dtype
before the rotation, the rotation runs in fp32 and is rounded once. An FP8 (e4m3) cache gets that rounded
row divided by its KV head's scale (``kv_cache_write.quantize_fp8``), as the unfused path quantizes the
model-dtype K and V it is handed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from g4serve.kernels._launch import DualKernel, next_pow2, pdl, wait_for_previous_kernel
from g4serve.kernels.kv_cache_write import KV_FP8_DTYPE, kv_cache_write_reference, quantize_fp8
from g4serve.kernels.norm_rope import norm_rope_reference, normed_head_rows, rows_per_program


def _qkv_prep_fn(
    QKV,
    Wq,
    Wk,
    Cos,
    Sin,
    QOut,
    KCache,
    VCache,
    Slots,
    KScale,
    VScale,
    eps,
    num_tokens,
    stride_t,
    stride_qo_t,
    stride_qo_h,
    stride_kc_t,
    stride_kc_h,
    stride_vc_t,
    stride_vc_h,
    stride_ct,
    stride_st,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    V_HEAD0: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PART: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    KV_FP8: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Grid (token blocks, head rows): BLOCK_T tokens of one q, k or v head per program."""
    wait_for_previous_kernel(USE_PDL)
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)[:, None]
    h = tl.program_id(1)
    t_ok = t < num_tokens
    row = QKV + t * stride_t
    cos = Cos + t * stride_ct
    sin = Sin + t * stride_st
    out_ty = QOut.dtype.element_ty
    if h < HQ:
        y, col, mask = normed_head_rows(
            row + h * HEAD_DIM, Wq, cos, sin, t_ok, eps, HEAD_DIM, PART, BLOCK_D, True, True, out_ty
        )
        tl.store(QOut + t * stride_qo_t + h * stride_qo_h + col, y.to(out_ty), mask=mask)
    else:
        slot = tl.load(Slots + t, mask=t_ok, other=-1).to(tl.int64)
        keep = slot >= 0
        if h < HQ + HKV:
            y, col, mask = normed_head_rows(
                row + h * HEAD_DIM, Wk, cos, sin, keep, eps, HEAD_DIM, PART, BLOCK_D, True, True, out_ty
            )
            # a new name, not y: the compiler needs y of one type after the runtime `if h < HQ` (fp32 there)
            if KV_FP8:
                k = quantize_fp8(y.to(out_ty), tl.load(KScale + h - HQ), KCache.dtype.element_ty)
            else:
                k = y.to(KCache.dtype.element_ty)
            tl.store(KCache + slot * stride_kc_t + (h - HQ) * stride_kc_h + col, k, mask=mask)
        else:
            y, col, mask = normed_head_rows(
                row + (V_HEAD0 + h - HQ - HKV) * HEAD_DIM,
                Wk,
                cos,
                sin,
                keep,
                eps,
                HEAD_DIM,
                PART,
                BLOCK_D,
                False,
                False,
                out_ty,
            )
            if KV_FP8:
                v = quantize_fp8(y.to(out_ty), tl.load(VScale + h - HQ - HKV), VCache.dtype.element_ty)
            else:
                v = y.to(VCache.dtype.element_ty)
            tl.store(VCache + slot * stride_vc_t + (h - HQ - HKV) * stride_vc_h + col, v, mask=mask)


_qkv_prep = DualKernel(_qkv_prep_fn)


def qkv_prep(
    qkv: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    v_is_k: bool = False,
) -> torch.Tensor:
    """qkv [T, (Hq + Hkv (+ Hkv)) * D] (unit last stride; raw v heads after k unless ``v_is_k``: V is then
    the raw K projection, as with attention_k_eq_v) -> q [T, Hq, D] normed and rotated; normed+rotated
    K and normed V go into k_cache / v_cache [S, Hkv, D] rows ``slots`` [T] (-1: skip). An FP8 cache takes
    ``k_scale`` / ``v_scale`` [Hkv] fp32 and stores K / k_scale and V / v_scale (the scales follow the
    slots so that ``AttentionBackend.kv_write_target``'s tuple can be passed as it is)."""
    num_tokens = qkv.shape[0]
    head_dim = k_cache.shape[-1]
    assert qkv.stride(-1) == 1 and head_dim % 2 == 0 and cos.stride(-1) == 1 and sin.stride(-1) == 1
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert not isinstance(k_scale, bool), "v_is_k is keyword-only"
    fp8 = k_cache.dtype == KV_FP8_DTYPE
    assert not fp8 or (k_scale is not None and v_scale is not None), "an FP8 cache needs its scales"
    q = torch.empty((num_tokens, num_q_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q
    block_t, num_warps = rows_per_program(num_tokens, head_dim)
    _qkv_prep[qkv.device][(triton.cdiv(num_tokens, block_t), num_q_heads + 2 * num_kv_heads)](
        qkv,
        q_weight,
        k_weight,
        cos,
        sin,
        q,
        k_cache,
        v_cache,
        slots,
        k_scale if fp8 else slots,  # never read without KV_FP8
        v_scale if fp8 else slots,
        eps,
        num_tokens,
        qkv.stride(0),
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        cos.stride(0),
        sin.stride(0),
        HQ=num_q_heads,
        HKV=num_kv_heads,
        V_HEAD0=num_q_heads + (0 if v_is_k else num_kv_heads),
        HEAD_DIM=head_dim,
        PART=head_dim // 2,
        BLOCK_D=next_pow2(head_dim),
        BLOCK_T=block_t,
        KV_FP8=fp8,
        **pdl(qkv.device, num_tokens),
        num_warps=num_warps,
    )
    return q


def qkv_prep_reference(
    qkv: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    v_is_k: bool = False,
) -> torch.Tensor:
    """The unfused ops: norm_rope on q and k, the weightless v norm, then the cache write."""
    t, d = qkv.shape[0], k_cache.shape[-1]
    heads = qkv.view(t, -1, d)
    q = norm_rope_reference(heads[:, :num_q_heads], q_weight, eps, cos, sin)
    k_raw = heads[:, num_q_heads : num_q_heads + num_kv_heads]
    v_raw = k_raw if v_is_k else heads[:, num_q_heads + num_kv_heads : num_q_heads + 2 * num_kv_heads]
    k = norm_rope_reference(k_raw, k_weight, eps, cos, sin)
    v = norm_rope_reference(v_raw, None, eps)
    kv_cache_write_reference(k, v, k_cache, v_cache, slots, k_scale, v_scale)
    return q


__all__ = ["qkv_prep", "qkv_prep_reference"]
