"""The MoE router's tail in one pass per token: softmax (fp32), top-k, renormalise, per-expert scale; and
its torch reference (the model's ops, five launches)."""

from __future__ import annotations

import torch
import triton.language as tl

from g4serve.kernels._launch import DualKernel, next_pow2


def _moe_route_fn(
    Logits,
    Scale,
    Weights,
    Experts,
    num_experts,
    stride_l,
    stride_w,
    stride_e,
    TOP_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    logits = tl.load(Logits + row * stride_l + cols, mask=cols < num_experts, other=float("-inf")).to(
        tl.float32
    )
    num = tl.exp(logits - tl.max(logits, 0))
    probs = num / tl.sum(num, 0)
    slots = tl.arange(0, BLOCK_K)
    picked = tl.zeros([BLOCK_K], tl.float32)
    picked_ids = tl.zeros([BLOCK_K], tl.int32)
    # k rounds of argmax (ties: the lowest id); a taken expert drops to -1, below every probability
    for j in tl.static_range(TOP_K):
        best = tl.argmax(probs, 0)
        picked = tl.where(slots == j, tl.max(probs, 0), picked)
        picked_ids = tl.where(slots == j, best, picked_ids)
        probs = tl.where(cols == best, -1.0, probs)
    keep = slots < TOP_K
    weights = picked / tl.sum(tl.where(keep, picked, 0.0), 0)
    weights = weights * tl.load(Scale + picked_ids, mask=keep, other=0.0).to(tl.float32)
    tl.store(Weights + row * stride_w + slots, weights, mask=keep)
    tl.store(Experts + row * stride_e + slots, picked_ids.to(Experts.dtype.element_ty), mask=keep)


_moe_route = DualKernel(_moe_route_fn)


def moe_route(
    logits: torch.Tensor, per_expert_scale: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] fp32, experts [T, k] int64), experts by falling probability."""
    num_tokens, num_experts = logits.shape
    assert logits.stride(-1) == 1
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    experts = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)
    if num_tokens:
        _moe_route[logits.device][(num_tokens,)](
            logits,
            per_expert_scale,
            weights,
            experts,
            num_experts,
            logits.stride(0),
            weights.stride(0),
            experts.stride(0),
            TOP_K=top_k,
            BLOCK_E=next_pow2(max(num_experts, 16)),
            BLOCK_K=next_pow2(max(top_k, 2)),
            num_warps=1 if num_experts <= 256 else 4,
        )
    return weights, experts


def moe_route_reference(
    logits: torch.Tensor, per_expert_scale: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, k=top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * per_expert_scale[experts], experts


__all__ = ["moe_route", "moe_route_reference"]
