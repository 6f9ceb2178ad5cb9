"""Per-head RMSNorm followed by rotary embedding (Gemma 4's q/k norm + RoPE, and the v norm without
either weight or RoPE) as one kernel over (token, head) rows, and its torch reference.

Reads strided [T, H, D] views (e.g. slices of a fused QKV projection) and writes a contiguous
[T, H, D]. The norm result is rounded to the input dtype before the rotation, as the unfused model
rounds it; the rotation itself runs in fp32 and is rounded once.
"""

from __future__ import annotations

import torch
import triton.language as tl

from g4serve.kernels._launch import DualKernel, next_pow2
from g4serve.kernels.rms_norm import rms_norm_reference
from g4serve.layers.rotary import apply_rope


def _norm_rope_fn(
    X, W, Cos, Sin, Out,
    eps,
    stride_xt, stride_xh, stride_ot, stride_oh, stride_ct, stride_st,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, HAS_W: tl.constexpr, HAS_ROPE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK_HALF)
    mask = offs < HALF
    base = X + t * stride_xt + h * stride_xh
    x1 = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / (2 * HALF) + eps)
    y1 = x1 * inv
    y2 = x2 * inv
    if HAS_W:
        y1 = y1 * tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
        y2 = y2 * tl.load(W + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    y1 = y1.to(Out.dtype.element_ty).to(tl.float32)
    y2 = y2.to(Out.dtype.element_ty).to(tl.float32)
    if HAS_ROPE:
        c1 = tl.load(Cos + t * stride_ct + offs, mask=mask, other=0.0).to(tl.float32)
        c2 = tl.load(Cos + t * stride_ct + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(Sin + t * stride_st + offs, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(Sin + t * stride_st + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        # x * cos + rotate_half(x) * sin, with rotate_half(x) = (-x2, x1)
        y1, y2 = y1 * c1 - y2 * s1, y2 * c2 + y1 * s2
    out = Out + t * stride_ot + h * stride_oh
    tl.store(out + offs, y1.to(Out.dtype.element_ty), mask=mask)
    tl.store(out + HALF + offs, y2.to(Out.dtype.element_ty), mask=mask)


_norm_rope = DualKernel(_norm_rope_fn)


def norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor | None = None,
              sin: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H, D] (unit last stride) -> rms_norm over D (times ``weight``), then RoPE with cos/sin [T, D]
    when given; a new contiguous [T, H, D] in x's dtype."""
    num_tokens, num_heads, head_dim = x.shape
    assert x.stride(-1) == 1 and head_dim % 2 == 0
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    has_rope = cos is not None
    if has_rope:
        assert cos.stride(-1) == 1 and sin.stride(-1) == 1
    half = head_dim // 2
    _norm_rope[x.device][(num_tokens, num_heads)](
        x, weight if weight is not None else x, cos if has_rope else x, sin if has_rope else x, out,
        eps, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
        cos.stride(0) if has_rope else 0, sin.stride(0) if has_rope else 0,
        HALF=half, BLOCK_HALF=next_pow2(half), HAS_W=weight is not None, HAS_ROPE=has_rope,
        num_warps=1 if head_dim <= 256 else 2,
    )
    return out


def norm_rope_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor | None = None,
                        sin: torch.Tensor | None = None) -> torch.Tensor:
    y = rms_norm_reference(x, weight, eps)
    return apply_rope(y, cos, sin) if cos is not None else y


__all__ = ["norm_rope", "norm_rope_reference"]
