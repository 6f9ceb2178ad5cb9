"""Gemma 4's RMSNorm chains as one kernel per row, and their torch reference.

``out = residual + rms_norm(x) * w`` (residual optional), then optionally ``out *= scale`` (the layer
scalar) and ``out2 = rms_norm(out) * w2`` (the next norm that reads the new residual stream). Statistics
in fp32; each intermediate is rounded to the input dtype where the unfused model rounds it, so bf16
results equal the eager chain up to the last bit of the norm itself.

``fp8_next``: ``out2`` also quantized for the W8A8 GEMM that reads it (``fp8_matmul.quantize_groups``'
e4m3 values and per-128-column scales, bit for bit), so that GEMM skips its own quantizing launch.

``branches``: the chain's input is itself the sum of two normed rows, ``rms_norm(x, wa) + rms_norm(xb, wb)``
(a MoE layer's dense and expert branches, each with its post-feed-forward norm), computed in the same pass:
four launches become one. ``moe_input_norms``: a MoE layer's two norms of one row, the experts' input
(``rms_norm(x, w)``) and the router's (``rms_norm(x) * scale * root``), in one launch instead of four.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from g4serve import envs
from g4serve.kernels._launch import DualKernel, next_pow2, pdl, wait_for_previous_kernel
from g4serve.kernels.fp8_matmul import GROUP, group_buffers, quantize_activation_groups
from g4serve.kernels.kv_cache_write import activation_scale, quantize_fp8

# Under dependent launch, the pass loads its weights, the layer scalar and the residual before its wait: none
# is written by the kernel just before it (that one wrote ``x``; every earlier kernel has finished,
# ``_launch.wait_for_previous_kernel``), and after a projection that streamed tens of MB none is in L2, so
# their trips to HBM overlap the projection's tail. 31B FP8 B = 1: 12.56-12.58 ms a step against 12.77-12.78
# (H100; e4b bf16 3.87 against 3.94). G4SERVE_NORM_EARLY_LOADS=0 loads them after the wait (A/B runs).
EARLY_LOADS = envs.get("G4SERVE_NORM_EARLY_LOADS") != "0"


@triton.jit
def _normed(x, n_cols, eps):
    """A row in fp32 over its root mean square (padding columns loaded as 0)."""
    return x / tl.sqrt(tl.sum(x * x, 0) / n_cols + eps)


def _rms_norm_fn(  # noqa: C901 - Triton kernel body: its branches test tl.constexpr flags (HAS_*, EARLY, QUANT), specialised away at compile time
    X,
    XB,
    WA,
    WB,
    Res,
    W,
    W2,
    Scale,
    Out,
    Out2,
    Q,
    SX,
    n_cols,
    eps,
    stride_x,
    stride_xb,
    stride_xs,
    stride_r,
    stride_o,
    stride_o2,
    stride_q,
    stride_sx,
    HAS_BRANCHES: tl.constexpr,
    SLOTS: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_RES: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_NORM2: tl.constexpr,
    QUANT: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
    EARLY: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    if EARLY:  # see EARLY_LOADS (without dependent launch the kernel starts after the one before ends)
        if HAS_W:
            w_early = tl.load(W + cols, mask=mask, other=0.0)
        if HAS_RES:
            r_early = tl.load(Res + row * stride_r + cols, mask=mask, other=0.0)
        if HAS_SCALE:
            scale_early = tl.load(Scale)
        if HAS_NORM2:
            w2_early = tl.load(W2 + cols, mask=mask, other=0.0)
    wait_for_previous_kernel(USE_PDL)
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BRANCHES:  # x = rms_norm(x, wa) + rms_norm(xb, wb), each term and the sum rounded as eager rounds
        wa = tl.load(WA + cols, mask=mask, other=0.0).to(tl.float32)
        wb = tl.load(WB + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(XB + row * stride_xb + cols, mask=mask, other=0.0).to(tl.float32)
        if SLOTS > 1:  # xb's k rows (a MoE's expert outputs) summed in fp32 in slot order, then rounded once
            for j in tl.static_range(1, SLOTS):
                b += tl.load(XB + row * stride_xb + j * stride_xs + cols, mask=mask, other=0.0).to(tl.float32)
            b = b.to(Out.dtype.element_ty).to(tl.float32)
        a = (_normed(x, n_cols, eps) * wa).to(Out.dtype.element_ty).to(tl.float32)
        b = (_normed(b, n_cols, eps) * wb).to(Out.dtype.element_ty).to(tl.float32)
        x = (a + b).to(Out.dtype.element_ty).to(tl.float32)
    y = _normed(x, n_cols, eps)
    if HAS_W:
        w = w_early if EARLY else tl.load(W + cols, mask=mask, other=0.0)
        y = y * w.to(tl.float32)
    y = y.to(Out.dtype.element_ty)
    if HAS_RES:
        r = r_early if EARLY else tl.load(Res + row * stride_r + cols, mask=mask, other=0.0)
        y = (r.to(tl.float32) + y.to(tl.float32)).to(Out.dtype.element_ty)
    if HAS_SCALE:
        scale = scale_early if EARLY else tl.load(Scale)
        y = (y.to(tl.float32) * scale.to(tl.float32)).to(Out.dtype.element_ty)
    tl.store(Out + row * stride_o + cols, y, mask=mask)
    if HAS_NORM2:
        z = y.to(tl.float32)
        z = _normed(z, n_cols, eps)
        w2 = w2_early if EARLY else tl.load(W2 + cols, mask=mask, other=0.0)
        z = z * w2.to(tl.float32)
        tl.store(Out2 + row * stride_o2 + cols, z.to(Out2.dtype.element_ty), mask=mask)
        if QUANT:  # out2 as the W8A8 GEMM's quantizer reads it: rounded, then per 128-column group
            zr = z.to(Out2.dtype.element_ty).to(tl.float32)
            sx = activation_scale(tl.max(tl.reshape(tl.abs(zr), [BLOCK // GROUP, GROUP]), axis=1))
            sx_cols = tl.reshape(tl.broadcast_to(sx[:, None], [BLOCK // GROUP, GROUP]), [BLOCK])
            tl.store(Q + row * stride_q + cols, quantize_fp8(zr, sx_cols, Q.dtype.element_ty), mask=mask)
            groups = tl.arange(0, BLOCK // GROUP)
            tl.store(SX + row * stride_sx + groups, sx, mask=groups * GROUP < n_cols)


_rms_norm = DualKernel(_rms_norm_fn)


def fused_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    next_weight: torch.Tensor | None = None,
    fp8_next: tuple[torch.Tensor, torch.Tensor] | None = None,
    branches: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [..., N] -> (out, out2): ``out = (residual + rms_norm(x, weight)) * scale`` and
    ``out2 = rms_norm(out, next_weight)`` (None without ``next_weight``). Rows need a unit last stride.
    ``fp8_next``: (e4m3 [rows, N], fp32 [rows, ceil(N / 128)]) buffers that receive ``quantize_groups(out2)``
    (with ``next_weight`` only). ``branches``: (xb, wa, wb), and the chain reads
    ``rms_norm(x, wa) + rms_norm(xb, wb)`` in place of ``x``: xb shaped as x, or [..., k, N] whose k rows
    are summed first (in fp32, in order, rounded once: a MoE's unsummed expert outputs, ``fused_moe``)."""
    n = x.shape[-1]
    x2d = _unit_rows(x)
    xb3d, wa, wb = (
        (_slot_rows(branches[0], x), branches[1], branches[2])
        if branches is not None
        else (x2d[:, None],) * 3
    )
    out = torch.empty(x2d.shape, dtype=x.dtype, device=x.device)
    res2d = residual.reshape(-1, n) if residual is not None else x2d
    out2 = torch.empty_like(out) if next_weight is not None else out
    rows = x2d.shape[0]
    assert fp8_next is None or next_weight is not None, "fp8_next quantizes the next norm's output"
    q, sx = fp8_next if fp8_next is not None else (out, out)
    if rows:
        block = max(next_pow2(n), GROUP) if fp8_next is not None else next_pow2(n)
        _rms_norm[x.device][(rows,)](
            x2d,
            xb3d,
            wa,
            wb,
            res2d,
            weight if weight is not None else x2d,
            next_weight if next_weight is not None else x2d,
            scale if scale is not None else x2d,
            out,
            out2,
            q,
            sx,
            n,
            eps,
            x2d.stride(0),
            xb3d.stride(0),
            xb3d.stride(1),
            res2d.stride(0),
            out.stride(0),
            out2.stride(0),
            q.stride(0),
            sx.stride(0),
            HAS_BRANCHES=branches is not None,
            SLOTS=xb3d.shape[1],
            HAS_W=weight is not None,
            HAS_RES=residual is not None,
            HAS_SCALE=scale is not None,
            HAS_NORM2=next_weight is not None,
            QUANT=fp8_next is not None,
            GROUP=GROUP,
            BLOCK=block,
            **pdl(x.device, rows),
            EARLY=EARLY_LOADS,
            num_warps=min(16, max(1, block // 256)),
        )
    out = out.view(x.shape)
    return out, (out2.view(x.shape) if next_weight is not None else None)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The model's RMSNorm: fp32 statistics, result in ``x``'s dtype (as transformers computes it)."""
    xf = x.float()
    # torch.pow rather than rsqrt keeps bit-equality with the reference implementation.
    out = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        out = out * weight.float()
    return out.type_as(x)


def fused_rms_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    next_weight: torch.Tensor | None = None,
    fp8_next: tuple[torch.Tensor, torch.Tensor] | None = None,
    branches: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if branches is not None:
        xb, wa, wb = branches
        if xb.dim() == x.dim() + 1:  # unsummed slots: summed in fp32 in order, rounded once
            xb = xb.float().sum(-2).to(x.dtype)
        x = rms_norm_reference(x, wa, eps) + rms_norm_reference(xb, wb, eps)
    out = rms_norm_reference(x, weight, eps)
    if residual is not None:
        out = residual + out
    if scale is not None:
        out = out * scale
    out2 = rms_norm_reference(out, next_weight, eps) if next_weight is not None else None
    if fp8_next is not None:
        q, sx = quantize_activation_groups(out2.reshape(-1, out2.shape[-1]))
        fp8_next[0].copy_(q)
        fp8_next[1].copy_(sx)
    return out, out2


def _unit_rows(x: torch.Tensor) -> torch.Tensor:
    x2d = x.reshape(-1, x.shape[-1])
    return x2d if x2d.stride(-1) == 1 else x2d.contiguous()


def _slot_rows(xb: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A branch as [rows, k, N] with unit last stride: k = 1 when shaped as ``x``."""
    slots = xb.shape[-2] if xb.dim() == x.dim() + 1 else 1
    xb3d = xb.reshape(-1, slots, xb.shape[-1])
    return xb3d if xb3d.stride(-1) == 1 else xb3d.contiguous()


def _moe_input_norms_fn(
    X,
    W,
    S,
    Out,
    OutR,
    n_cols,
    eps,
    root,
    stride_x,
    stride_o,
    stride_r,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    normed = _normed(x, n_cols, eps)
    experts_in = normed * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + cols, experts_in.to(Out.dtype.element_ty), mask=mask)
    # the router's: rms_norm(x) * scale * root, rounded after each op as the eager ops round
    r = normed.to(OutR.dtype.element_ty).to(tl.float32) * tl.load(S + cols, mask=mask, other=0.0).to(
        tl.float32
    )
    r = r.to(OutR.dtype.element_ty).to(tl.float32) * root
    tl.store(OutR + row * stride_r + cols, r.to(OutR.dtype.element_ty), mask=mask)


_moe_input_norms = DualKernel(_moe_input_norms_fn)


def moe_input_norms(
    x: torch.Tensor, weight: torch.Tensor, router_scale: torch.Tensor, root: float, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., N] -> (``rms_norm(x, weight)``, ``rms_norm(x) * router_scale * root``): a MoE layer's experts'
    input and its router's, from one read of the residual stream."""
    n = x.shape[-1]
    x2d = _unit_rows(x)
    out, routed = torch.empty_like(x2d), torch.empty_like(x2d)
    rows = x2d.shape[0]
    if rows:
        block = next_pow2(n)
        _moe_input_norms[x.device][(rows,)](
            x2d,
            weight,
            router_scale,
            out,
            routed,
            n,
            eps,
            root,
            x2d.stride(0),
            out.stride(0),
            routed.stride(0),
            BLOCK=block,
            **pdl(x.device, rows),
            num_warps=min(16, max(1, block // 256)),
        )
    return out.view(x.shape), routed.view(x.shape)


def moe_input_norms_reference(
    x: torch.Tensor, weight: torch.Tensor, router_scale: torch.Tensor, root: float, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return rms_norm_reference(x, weight, eps), rms_norm_reference(x, None, eps) * router_scale * root


def fp8_next_buffers(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty ``fp8_next`` buffers for rows like ``x`` [..., N]: e4m3 [rows, N], fp32 [rows, ceil(N / 128)]."""
    n = x.shape[-1]
    return group_buffers(x.numel() // max(n, 1), n, x.device)


__all__ = [
    "fp8_next_buffers",
    "fused_rms_norm",
    "fused_rms_norm_reference",
    "moe_input_norms",
    "moe_input_norms_reference",
    "rms_norm_reference",
]
