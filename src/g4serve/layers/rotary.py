"""Rotary position embeddings used by Gemma 4.

- text sliding layers: default RoPE over the whole head dim;
- text full layers: "proportional" RoPE: only the first ``partial_rotary_factor`` of the
  frequency slots rotate, the rest get frequency 0 (cos 1, sin 0), with exponents over the
  *whole* head dim;
- vision: axial 2-D RoPE, half the head dim per spatial axis.
The inverse frequencies are computed with the same expressions as transformers so that
fp32 results are bit-identical. This file makes the cos/sin tables; applying them (``apply_rope``,
``apply_axial_rope``) is the torch reference of the fused norm + RoPE kernel, beside it in
``kernels/norm_rope.py``.
"""

from __future__ import annotations

from typing import Any

import torch


def text_inv_freq(rope: dict[str, Any], head_dim: int) -> torch.Tensor:
    base = rope["rope_theta"]
    if rope.get("rope_type", "default") == "default":
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    # proportional
    factor = rope.get("factor", 1.0)
    rope_angles = int(rope.get("partial_rotary_factor", 1.0) * head_dim // 2)
    inv = 1.0 / (base ** (torch.arange(0, 2 * rope_angles, 2, dtype=torch.int64).to(torch.float) / head_dim))
    nope = head_dim // 2 - rope_angles
    if nope > 0:
        inv = torch.cat((inv, torch.zeros(nope, dtype=torch.float32)))
    return inv / factor


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [..., head_dim] for integer ``positions`` [...]."""
    freqs = positions[..., None].float() * inv_freq.to(device=positions.device, dtype=torch.float)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def vision_inv_freq(theta: float, head_dim: int) -> torch.Tensor:
    spatial_dim = head_dim // 2
    return 1.0 / (theta ** (torch.arange(0, spatial_dim, 2, dtype=torch.float) / spatial_dim))


def vision_cos_sin(
    positions_xy: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Axial tables for patch positions [B, N, 2] -> cos/sin [B, N, head_dim] laid out x-x-y-y."""
    freqs = positions_xy[..., None].float() * inv_freq.to(device=positions_xy.device, dtype=torch.float)
    cos, sin = freqs.cos(), freqs.sin()
    cos = torch.cat([cos[:, :, 0], cos[:, :, 0], cos[:, :, 1], cos[:, :, 1]], dim=-1)
    sin = torch.cat([sin[:, :, 0], sin[:, :, 0], sin[:, :, 1], sin[:, :, 1]], dim=-1)
    return cos.to(dtype), sin.to(dtype)
