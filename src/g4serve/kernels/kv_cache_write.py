"""Scatter a step's new K/V rows into their paged-cache slots (slot -1: skip), and its torch reference.

One program per token copies all its KV heads; unlike ``PagedKVCache.write`` it needs no host sync to
drop the -1 slots, so it can sit inside a CUDA graph.
"""

from __future__ import annotations

import torch
import triton.language as tl

from g4serve.kernels._launch import DualKernel, next_pow2, pdl, wait_for_previous_kernel


def _kv_cache_write_fn(
    K,
    V,
    KCache,
    VCache,
    Slots,
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
    USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    t = tl.program_id(0)
    slot = tl.load(Slots + t).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < NUM_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
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
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """k/v [T, Hkv, D] -> k_cache/v_cache [S, Hkv, D] rows ``slots`` [T] (long or int32; -1: skip)."""
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    _kv_cache_write[k.device][(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slots,
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
        **pdl(k.device, num_tokens),
        num_warps=4 if num_heads * head_dim <= 2048 else 8,
    )


def kv_cache_write_reference(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    keep = slots >= 0
    k_cache.index_copy_(0, slots[keep].long(), k[keep].to(k_cache.dtype))
    v_cache.index_copy_(0, slots[keep].long(), v[keep].to(v_cache.dtype))


__all__ = ["kv_cache_write", "kv_cache_write_reference"]
