"""Gemma 4 routed mixture-of-experts block (26B-A4B): router and expert weights.

CUDA tensors take the Triton kernels (fused routing, grouped expert GEMMs; no host sync, so capturable in
a CUDA graph); elsewhere the torch reference, bit-exact with transformers. Names follow the HF checkpoints.
"""

from __future__ import annotations

import torch
from torch import nn

from g4serve.kernels.fused_moe import fused_moe, fused_moe_reference
from g4serve.kernels.moe_route import moe_route, moe_route_reference
from g4serve.layers.norm import rms_norm


class MoERouter(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, eps: float):
        super().__init__()
        self.top_k = top_k
        self.eps = eps
        self.hidden = hidden
        self.proj = nn.Linear(hidden, num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(hidden))
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] fp32, expert ids [T, k]); softmax, top-k, renormalise, per-expert
        scale."""
        x = rms_norm(x, None, self.eps) * self.scale * self.hidden**-0.5
        logits = self.proj(x)
        route = moe_route if logits.is_cuda else moe_route_reference
        return route(logits, self.per_expert_scale, self.top_k)


class MoEExperts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int, activation: str):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.activation = activation

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], experts / weights [T, k] -> [T, H]: each token's experts, weighted and summed."""
        moe = fused_moe if x.is_cuda else fused_moe_reference
        return moe(x, self.gate_up_proj, self.down_proj, experts, weights, self.activation)
