"""Dense int4 (w4a16) GEMMs on torch's own int4 kernel, tinygemm (``aten._weight_int4pack_mm``: the kernel
gpt-fast and torchao serve int4 weights with), for decode-sized batches.

``kernels/quant_matmul.py`` dequantizes compressed-tensors' int32 words in registers; tinygemm wants its own
layout instead: the weight's unsigned nibbles (q + 8, 0..15) repacked once into tensor-core tiles
(``aten._convert_weight_to_int4pack``, ``inner_k_tiles`` K tiles of 16 per load), and per group of ``g``
columns one (scale, zero) pair in bf16, [K / g, N, 2], meaning w = (u - 8) * scale + zero. compressed-tensors'
w = (q - z) * s = (u - 8) * s - z * s, so scale = s and zero = -z * s (0 when symmetric). Both are rounded to
bf16 here (the kernel multiplies in bf16), which is the difference from ``dequantize_reference``'s fp32
product rounded once: a bf16 step of the scale at most.

tinygemm takes bf16 activations, groups of 32 / 64 / 128 / 256 columns (one scale row per group: ``bn`` = 1),
N a multiple of 16 and K a multiple of the group and of 16 * inner_k_tiles. On the CPU torch has the same
kernel under other names (``..._for_cpu``, its packing from the int32 values): the tests run the whole path
there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from g4serve.kernels.quant_matmul import int4_nibbles

GROUPS = (32, 64, 128, 256)  # the group sizes tinygemm has kernels for


@dataclass(frozen=True)
class TinygemmWeight:
    """One projection in tinygemm's layout: ``packed`` (the device's tile layout), ``scales_and_zeros`` bf16
    [K / group, N, 2], ``group`` columns per scale."""

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    group: int


def tinygemm_supported(out_features: int, in_features: int, scale_block: tuple[int, int]) -> bool:
    """Whether a projection of this shape and scale grid has a tinygemm layout."""
    bn, group = scale_block
    return (
        bn == 1
        and group in GROUPS
        and out_features % 16 == 0  # CUDA's packing asks 8, the CPU's 16
        and in_features % group == 0
        and in_features % 32 == 0  # 16 * inner_k_tiles with the smallest tile count
    )


def inner_k_tiles(in_features: int) -> int:
    """K tiles of 16 each packed word spans: 8 where K allows (the widest loads), else 4 or 2."""
    return next(t for t in (8, 4, 2) if in_features % (16 * t) == 0)


def nibble_bytes(values: torch.Tensor) -> torch.Tensor:
    """int32 [N, K] of 0..15 -> uint8 [N, K / 2], element 2i in the high nibble of byte i and 2i + 1 in the
    low one: the CUDA packer's input (torch's own tests of ``_weight_int4pack_mm`` build it so)."""
    return ((values[:, ::2] << 4) | values[:, 1::2]).to(torch.uint8)


def scales_and_zeros(scale: torch.Tensor, zero_point: torch.Tensor | None) -> torch.Tensor:
    """Per-group scales [N, K / g] (and int8 zero points z, or None) -> bf16 [K / g, N, 2] of (s, -z * s)."""
    s = scale.float()
    zero = -zero_point.float() * s if zero_point is not None else torch.zeros_like(s)
    return torch.stack([s, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)


def pack_tinygemm(
    weight: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    in_features: int,
    group: int,
) -> TinygemmWeight:
    """A ``QuantLinear``'s int4 weight, scales and zero points in tinygemm's layout on their device."""
    values = int4_nibbles(weight, in_features).contiguous()
    tiles = inner_k_tiles(in_features)
    if weight.is_cuda:
        packed = torch.ops.aten._convert_weight_to_int4pack(nibble_bytes(values), tiles)
    else:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, tiles)
    return TinygemmWeight(packed, scales_and_zeros(scale, zero_point), group)


def tinygemm_matmul(x: torch.Tensor, w: TinygemmWeight) -> torch.Tensor:
    """bf16 x [M, K] @ dequant(W)^T -> bf16 [M, N] (no bias, no epilogue)."""
    op = torch.ops.aten._weight_int4pack_mm if x.is_cuda else torch.ops.aten._weight_int4pack_mm_for_cpu
    return op(x, w.packed, w.group, w.scales_and_zeros)


def tinygemm_reference_weight(
    weight: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, in_features: int, group: int
) -> torch.Tensor:
    """The dense fp32 weight [N, K] tinygemm multiplies by: (u - 8) * scale + zero with the bf16 scale and
    zero, in fp32."""
    sz = scales_and_zeros(scale, zero_point).float().repeat_interleave(group, dim=0)  # [K, N, 2]
    u = int4_nibbles(weight, in_features).float()
    return (u - 8) * sz[..., 0].t() + sz[..., 1].t()


__all__ = [
    "GROUPS",
    "TinygemmWeight",
    "inner_k_tiles",
    "nibble_bytes",
    "pack_tinygemm",
    "scales_and_zeros",
    "tinygemm_matmul",
    "tinygemm_reference_weight",
    "tinygemm_supported",
]
