"""Per-head RMSNorm followed by rotary embedding (Gemma 4's q/k norm + RoPE, and the v norm without
either weight or RoPE) as one kernel over (token, head) rows, and its torch reference.

Reads strided [T, H, D] views (e.g. slices of a fused QKV projection) and writes a contiguous
[T, H, D]. The norm result is rounded to the input dtype before the rotation, as the unfused model
rounds it; the rotation itself runs in fp32 and is rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from g4serve.kernels._launch import DualKernel, next_pow2, pdl, wait_for_previous_kernel
from g4serve.kernels.rms_norm import rms_norm_reference
from g4serve.layers.rotary import apply_axial_rope, apply_rope


@triton.jit
def normed_head_row(base, W, Cos, Sin, eps,
                    HEAD_DIM: tl.constexpr, PARTS: tl.constexpr, PART: tl.constexpr, BLOCK_PART: tl.constexpr,
                    HAS_W: tl.constexpr, HAS_ROPE: tl.constexpr, OUT_TY: tl.constexpr):
    """One head row at ``base`` as [PARTS, BLOCK_PART] pieces of PART dims: rms-normed (times W), rounded to
    OUT_TY as the unfused model rounds it, then rotated in fp32 with the row's cos/sin (at Cos/Sin). RoPE
    rotates each pair of pieces (2j, 2j+1) as one rotate_half section: one section is the text models'
    RoPE, two the vision tower's axial x/y RoPE. -> (row in fp32, offsets, mask)."""
    part = tl.arange(0, PARTS)[:, None]
    col = tl.arange(0, BLOCK_PART)[None, :]
    mask = (col < PART) & (part < PARTS)
    offs = part * PART + col
    x = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(tl.sum(x * x, 1), 0) / HEAD_DIM + eps)
    y = x * inv
    if HAS_W:
        y = y * tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    y = y.to(OUT_TY).to(tl.float32)
    if HAS_ROPE:
        # rotate_half within each section: the first piece takes -(second), the second takes +(first)
        partner = (part ^ 1) * PART + col
        yp = tl.load(base + partner, mask=mask, other=0.0).to(tl.float32) * inv
        if HAS_W:
            yp = yp * tl.load(W + partner, mask=mask, other=0.0).to(tl.float32)
        yp = yp.to(OUT_TY).to(tl.float32)
        sign = tl.where(part % 2 == 0, -1.0, 1.0)
        c = tl.load(Cos + offs, mask=mask, other=0.0).to(tl.float32)
        sn = tl.load(Sin + offs, mask=mask, other=0.0).to(tl.float32)
        y = y * c + sign * yp * sn
    return y, offs, mask


def _norm_rope_fn(
    X, W, Cos, Sin, Out,
    eps,
    stride_xt, stride_xh, stride_ot, stride_oh, stride_ct, stride_st, cos_head_stride,
    HEAD_DIM: tl.constexpr, PARTS: tl.constexpr, PART: tl.constexpr, BLOCK_PART: tl.constexpr,
    HAS_W: tl.constexpr, HAS_ROPE: tl.constexpr, USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    y, offs, mask = normed_head_row(X + t * stride_xt + h * stride_xh, W, Cos + t * stride_ct + h * cos_head_stride,
                                    Sin + t * stride_st + h * cos_head_stride, eps, HEAD_DIM, PARTS, PART,
                                    BLOCK_PART, HAS_W, HAS_ROPE, Out.dtype.element_ty)
    tl.store(Out + t * stride_ot + h * stride_oh + offs, y.to(Out.dtype.element_ty), mask=mask)


_norm_rope = DualKernel(_norm_rope_fn)


def norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor | None = None,
              sin: torch.Tensor | None = None, sections: int = 1) -> torch.Tensor:
    """x [T, H, D] (unit last stride) -> rms_norm over D (times ``weight``), then RoPE with cos/sin [T, D]
    when given (``sections`` 2: the vision tower's axial RoPE, each half of D rotated on its own); a new
    contiguous [T, H, D] in x's dtype."""
    num_tokens, num_heads, head_dim = x.shape
    assert x.stride(-1) == 1 and head_dim % (2 * sections) == 0
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    has_rope = cos is not None
    if has_rope:
        assert cos.stride(-1) == 1 and sin.stride(-1) == 1
    parts = 2 * sections if has_rope else 2
    part = head_dim // parts
    _norm_rope[x.device][(num_tokens, num_heads)](
        x, weight if weight is not None else x, cos if has_rope else x, sin if has_rope else x, out,
        eps, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
        cos.stride(0) if has_rope else 0, sin.stride(0) if has_rope else 0, 0,
        HEAD_DIM=head_dim, PARTS=parts, PART=part, BLOCK_PART=next_pow2(part),
        HAS_W=weight is not None, HAS_ROPE=has_rope, **pdl(x.device, num_tokens),
        num_warps=1 if head_dim <= 256 else 2,
    )
    return out


def norm_rope_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor | None = None,
                        sin: torch.Tensor | None = None, sections: int = 1) -> torch.Tensor:
    y = rms_norm_reference(x, weight, eps)
    if cos is None:
        return y
    if sections == 1:
        return apply_rope(y, cos, sin)
    return apply_axial_rope(y.unsqueeze(0), cos.unsqueeze(0), sin.unsqueeze(0)).squeeze(0)


__all__ = ["norm_rope", "norm_rope_reference"]
