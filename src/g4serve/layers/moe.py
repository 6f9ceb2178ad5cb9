"""Gemma 4 routed mixture-of-experts block (26B-A4B): router and expert weights.

The reference path loops over the experts that received tokens; a grouped-GEMM kernel
replaces it on GPU. Parameter names follow the Hugging Face checkpoints.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from g4serve.layers.activation import ACTIVATIONS
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
        """x [T, H] -> (weights [T, k] fp32, expert ids [T, k]); softmax, top-k, renormalise, per-expert scale."""
        x = rms_norm(x, None, self.eps) * self.scale * self.hidden**-0.5
        probs = torch.softmax(self.proj(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, k=self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[experts], experts


class MoEExperts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int, activation: str):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.act = ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        token_ids = torch.arange(x.shape[0], device=x.device).unsqueeze(1).expand_as(experts)
        for e in torch.unique(experts).tolist():
            hit = experts == e
            tokens = token_ids[hit]
            gate, up = F.linear(x[tokens], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(self.act(gate) * up, self.down_proj[e]) * weights[hit].unsqueeze(-1)
            out.index_add_(0, tokens, y.to(out.dtype))
        return out
