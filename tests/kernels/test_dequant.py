"""The one-launch dequantizer (``kernels/dequant.py``) against ``dequantize_reference``, bit for bit, in
Triton's interpreter: int4 words with groups and zero points (ragged K: a last word half used, ragged N,
partial tiles), FP8 with per-tensor, per-channel and block scales, bf16 and fp32 outputs, bf16 scales."""

from __future__ import annotations

import pytest
import torch

from g4serve.kernels.dequant import dequantize
from g4serve.kernels.quant_matmul import dequantize_reference

CASES = [
    # kind, n, k, scale block, zero points
    ("int4", 40, 64, (1, 32), False),
    ("int4", 37, 72, (1, 8), True),  # ragged N and K (the last word half used)
    ("int4", 24, 200, (1, 128), True),  # a partial last group
    ("int4", 16, 64, (1, 64), False),  # per channel
    ("fp8", 40, 64, (40, 64), False),  # per tensor
    ("fp8", 37, 100, (1, 100), False),  # per channel, ragged
    ("fp8", 70, 96, (32, 32), False),  # blocks, a partial row block
]


def _weight(kind: str, n: int, k: int, block: tuple[int, int], zeros: bool, gen: torch.Generator):
    grid = (-(-n // block[0]), -(-k // block[1]))
    scale = torch.rand(grid, generator=gen) + 0.5
    if kind == "fp8":
        return (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn), scale, None
    words = torch.randint(-(2**31), 2**31 - 1, (n, -(-k // 8)), generator=gen, dtype=torch.int64)
    zero = torch.randint(-8, 8, (n, grid[1]), generator=gen).to(torch.int8) if zeros else None
    return words.to(torch.int32), scale, zero


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind,n,k,block,zeros", CASES)
def test_dequantize_is_the_reference_bit_for_bit(kind, n, k, block, zeros, dtype):
    gen = torch.Generator().manual_seed(n * 1000 + k)
    weight, scale, zero = _weight(kind, n, k, block, zeros, gen)
    for s in (scale, scale.to(torch.bfloat16)):  # checkpoints store scales in fp32 or bf16
        out = dequantize(weight, s, block, k, zero, dtype, block_n=16, block_k=32)
        ref = dequantize_reference(weight, s, block, k, zero, dtype)
        assert out.shape == (n, k) and out.dtype == dtype
        assert torch.equal(out, ref)


def test_dequantize_of_nothing_is_empty():
    out = dequantize(torch.zeros(0, 8, dtype=torch.int32), torch.ones(0, 2), (1, 32), 64)
    assert out.shape == (0, 64)


@pytest.mark.parametrize(
    "kind,k,block,zeros",
    [("int4", 1024, (1, 32), True), ("int4", 1000, (1, 128), False), ("fp8", 640, (128, 128), False)],
)
def test_dequantize_with_its_own_tiles(kind, k, block, zeros):
    """The default K tile (512 wide, several scale groups a tile; ragged K) as the GPU runs it."""
    gen = torch.Generator().manual_seed(k)
    weight, scale, zero = _weight(kind, 130, k, block, zeros, gen)
    out = dequantize(weight, scale, block, k, zero)
    assert torch.equal(out, dequantize_reference(weight, scale, block, k, zero, torch.bfloat16))


def test_tile_k_nests_with_the_scale_blocks():
    from g4serve.kernels.dequant import tile_k

    assert tile_k(128, 2560) == 512 and tile_k(32, 2560) == 512 and tile_k(2048, 4096) == 512
    assert tile_k(2560, 2560) == 512  # one scale a row
    assert tile_k(48, 960) == 16  # 48 = 3 x 16
