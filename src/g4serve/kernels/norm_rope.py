"""Per-head RMSNorm followed by rotary embedding (Gemma 4's q/k norm + RoPE, and the v norm without
either weight or RoPE) as one kernel over (token, head) rows, and its torch reference.

Reads strided [T, H, D] views (e.g. slices of a fused QKV projection) and writes a contiguous
[T, H, D]. The norm result is rounded to the input dtype before the rotation, as the unfused model
rounds it; the rotation itself runs in fp32 and is rounded once. The reference's rotations
(``apply_rope``, ``apply_axial_rope``) live here too; their cos/sin tables come from ``layers/rotary.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from g4serve.kernels._launch import DualKernel, next_pow2, pdl, wait_for_previous_kernel
from g4serve.kernels.rms_norm import rms_norm_reference

# Token rows per program: about 4k elements of a head's rows in one tile (64 tokens of a vision head, 16 of a
# 256-wide text head), fewer when the launch has fewer tokens. One (token, head) row per program, as before,
# left the vision tower's 45k-program launches at ~28 us each for 6 MB of q.
TILE_ELEMENTS = 4096


def rows_per_program(num_tokens: int, head_dim: int) -> tuple[int, int]:
    """-> (BLOCK_T, num_warps) for a launch over ``num_tokens`` rows of one ``head_dim``-wide head each."""
    block_d = next_pow2(head_dim)
    block_t = min(next_pow2(num_tokens), max(1, TILE_ELEMENTS // block_d))
    return block_t, max(1, min(4, block_t * block_d // 256))


@triton.jit
def normed_head_rows(
    X,
    W,
    Cos,
    Sin,
    row_ok,
    eps,
    HEAD_DIM: tl.constexpr,
    PART: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_ROPE: tl.constexpr,
    OUT_TY: tl.constexpr,
):
    """Head rows whose first elements are at X ([R, 1] pointers; Cos/Sin: the rows' cos/sin), valid where
    ``row_ok`` [R, 1]: rms-normed (times W), rounded to OUT_TY as the unfused model rounds it, then rotated in
    fp32. RoPE rotates each pair of PART-wide pieces (2j, 2j+1) as one rotate_half section: one section is the
    text models' RoPE, two the vision tower's axial x/y RoPE. -> (rows [R, BLOCK_D] in fp32, columns
    [1, BLOCK_D], mask)."""
    col = tl.arange(0, BLOCK_D)[None, :]
    col_ok = col < HEAD_DIM
    mask = row_ok & col_ok
    x = tl.load(X + col, mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=1, keep_dims=True) / HEAD_DIM + eps)
    y = x * inv
    if HAS_W:
        y = y * tl.load(W + col, mask=col_ok, other=0.0).to(tl.float32)
    y = y.to(OUT_TY).to(tl.float32)
    if HAS_ROPE:
        # rotate_half within each section: the first piece takes -(second), the second takes +(first)
        piece = col // PART
        partner = (piece ^ 1) * PART + col % PART
        yp = tl.load(X + partner, mask=mask, other=0.0).to(tl.float32) * inv
        if HAS_W:
            yp = yp * tl.load(W + partner, mask=col_ok, other=0.0).to(tl.float32)
        yp = yp.to(OUT_TY).to(tl.float32)
        sign = tl.where(piece % 2 == 0, -1.0, 1.0)
        c = tl.load(Cos + col, mask=mask, other=0.0).to(tl.float32)
        sn = tl.load(Sin + col, mask=mask, other=0.0).to(tl.float32)
        y = y * c + sign * yp * sn
    return y, col, mask


def _norm_rope_fn(
    X,
    W,
    Cos,
    Sin,
    Out,
    eps,
    num_tokens,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    stride_ct,
    stride_st,
    HEAD_DIM: tl.constexpr,
    PART: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_ROPE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Grid (token blocks, heads): BLOCK_T tokens of one head per program."""
    wait_for_previous_kernel(USE_PDL)
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)[:, None]
    h = tl.program_id(1)
    y, col, mask = normed_head_rows(
        X + t * stride_xt + h * stride_xh,
        W,
        Cos + t * stride_ct,
        Sin + t * stride_st,
        t < num_tokens,
        eps,
        HEAD_DIM,
        PART,
        BLOCK_D,
        HAS_W,
        HAS_ROPE,
        Out.dtype.element_ty,
    )
    tl.store(Out + t * stride_ot + h * stride_oh + col, y.to(Out.dtype.element_ty), mask=mask)


_norm_rope = DualKernel(_norm_rope_fn)


def norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    sections: int = 1,
) -> torch.Tensor:
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
    block_t, num_warps = rows_per_program(num_tokens, head_dim)
    _norm_rope[x.device][(triton.cdiv(num_tokens, block_t), num_heads)](
        x,
        weight if weight is not None else x,
        cos if has_rope else x,
        sin if has_rope else x,
        out,
        eps,
        num_tokens,
        x.stride(0),
        x.stride(1),
        out.stride(0),
        out.stride(1),
        cos.stride(0) if has_rope else 0,
        sin.stride(0) if has_rope else 0,
        HEAD_DIM=head_dim,
        PART=head_dim // (2 * sections),
        BLOCK_D=next_pow2(head_dim),
        BLOCK_T=block_t,
        HAS_W=weight is not None,
        HAS_ROPE=has_rope,
        **pdl(x.device, num_tokens),
        num_warps=num_warps,
    )
    return out


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` [T, H, D] with cos/sin [T, D]."""
    cos = cos.unsqueeze(-2)
    sin = sin.unsqueeze(-2)
    return (x * cos) + (rotate_half(x) * sin)


def apply_axial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` [B, N, H, D]: RoPE applied separately to the x half and the y half of D."""
    half = x.shape[-1] // 2
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    parts = []
    for sl in (slice(0, half), slice(half, 2 * half)):
        parts.append(x[..., sl] * cos[..., sl] + rotate_half(x[..., sl]) * sin[..., sl])
    return torch.cat(parts, dim=-1)


def norm_rope_reference(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    sections: int = 1,
) -> torch.Tensor:
    y = rms_norm_reference(x, weight, eps)
    if cos is None:
        return y
    if sections == 1:
        return apply_rope(y, cos, sin)
    return apply_axial_rope(y.unsqueeze(0), cos.unsqueeze(0), sin.unsqueeze(0)).squeeze(0)


__all__ = ["apply_axial_rope", "apply_rope", "norm_rope", "norm_rope_reference"]
