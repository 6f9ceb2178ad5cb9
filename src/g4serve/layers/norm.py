"""Gemma 4 RMSNorm: fp32 statistics, weight used as-is (no ``1 + w``), optional scale."""

from __future__ import annotations

import torch
from torch import nn

from g4serve.kernels.rms_norm import fused_rms_norm, rms_norm_reference


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Normalise the last dim of ``x``; math in fp32, result in ``x``'s dtype (as transformers does).

    CUDA tensors take the one-pass Triton kernel; elsewhere the torch reference, bit-exact with transformers.
    """
    if x.is_cuda:
        return fused_rms_norm(x, weight, eps)[0]
    return rms_norm_reference(x, weight, eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
