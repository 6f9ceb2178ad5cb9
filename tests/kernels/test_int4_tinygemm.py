"""int4 projections in torch's tinygemm layout (kernels/int4_tinygemm.py), on the CPU kernel torch ships
beside the CUDA one: the repacking of compressed-tensors' words, scales and zero points, the product against
the weight it stands for and against ``dequantize_reference``, and which projections get the layout."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from g4serve.kernels import int4_tinygemm as tg
from g4serve.kernels.quant_matmul import dequantize_reference, int4_nibbles
from g4serve.layers import quant
from g4serve.layers.quant import QuantLinear
from g4serve.quant_config import FP8, INT4, WeightQuant


def _int4_layer(n: int, k: int, group: int, symmetric: bool, seed: int = 0) -> QuantLinear:
    gen = torch.Generator().manual_seed(seed)
    layer = QuantLinear(k, n, WeightQuant(INT4, "group", (1, group), symmetric=symmetric))
    dense = torch.randn(n, k, generator=gen) * k**-0.5
    dense[0, :group] += 0.3  # a group whose range is off centre (a zero point far from 0 when asymmetric)
    layer.quantize_from(dense)
    return layer


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize(
    "n,k,group",
    [
        (64, 256, 128),
        (48, 256, 32),
        (32, 192, 64),
        (16, 224, 32),
        (32, 512, 256),
    ],  # inner K tiles 8, 8, 4, 2, 8
)
def test_the_product_is_the_weight_tinygemm_stands_for(n, k, group, symmetric):
    layer = _int4_layer(n, k, group, symmetric)
    assert tg.tinygemm_supported(n, k, layer.scale_block)
    packed = tg.pack_tinygemm(layer.weight, layer.weight_scale, layer.weight_zero_point, k, group)
    assert (
        packed.scales_and_zeros.shape == (k // group, n, 2)
        and packed.scales_and_zeros.dtype == torch.bfloat16
    )
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    got = tg.tinygemm_matmul(x, packed)
    assert got.shape == (5, n) and got.dtype == torch.bfloat16
    w = tg.tinygemm_reference_weight(layer.weight, layer.weight_scale, layer.weight_zero_point, k, group)
    want = x.float() @ w.t()
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1e-2)  # bf16 output and partial sums
    # the weight it stands for is the checkpoint's, but for the scale and zero rounded to bf16: within two
    # bf16 steps of each weight's magnitude bound (|q - z| <= 15 scale steps)
    exact = dequantize_reference(
        layer.weight, layer.weight_scale, layer.scale_block, k, layer.weight_zero_point
    )
    bound = 15 * layer.weight_scale.float().repeat_interleave(group, dim=1) * 2**-7
    assert ((w - exact).abs() <= bound).all()
    if symmetric:
        assert torch.equal(packed.scales_and_zeros[..., 1], torch.zeros(k // group, n, dtype=torch.bfloat16))


def test_nibble_bytes_put_the_even_element_high():
    values = torch.tensor([[1, 2, 3, 4], [15, 0, 0, 15]], dtype=torch.int32)
    assert tg.nibble_bytes(values).tolist() == [[0x12, 0x34], [0xF0, 0x0F]]


def test_int4_nibbles_are_the_stored_ones():
    q = torch.tensor([[-8, -1, 0, 7, 3, -4, 5, 6, 1]], dtype=torch.int32)
    assert int4_nibbles(quant.pack_int4(q), 9).tolist() == [(q + 8).tolist()[0]]


def test_which_shapes_have_a_layout():
    assert tg.inner_k_tiles(2560) == 8 and tg.inner_k_tiles(192) == 4 and tg.inner_k_tiles(224) == 2
    assert tg.tinygemm_supported(2048, 2560, (1, 128))
    assert not tg.tinygemm_supported(2048, 2560, (1, 16))  # no kernel for groups of 16
    assert not tg.tinygemm_supported(2048, 2560, (128, 128))  # scales shared across rows
    assert not tg.tinygemm_supported(2040, 2560, (1, 128))  # N not a multiple of 16
    assert not tg.tinygemm_supported(2048, 2500, (1, 128))  # K not a multiple of the group
    assert not tg.tinygemm_supported(2048, 2560, (1, 2560))  # one scale per row


def test_prepare_int4_layouts_only_with_the_switch(monkeypatch):
    model = nn.ModuleDict(
        {
            "int4": _int4_layer(32, 256, 128, True),
            "int4_row": QuantLinear(512, 32, WeightQuant(INT4, "channel", (1, 0))),  # a scale per row of 512
            "fp8": QuantLinear(256, 32, WeightQuant(FP8, "channel", (1, 0))),
            "dense": nn.Linear(256, 32),
        }
    )
    monkeypatch.setattr(quant, "INT4_MATMUL", "triton")
    assert quant.prepare_int4_layouts(model) == 0
    assert model["int4"].tinygemm is None
    for choice in ("tinygemm", "auto"):  # auto (the default) takes tinygemm at 2-7 rows
        monkeypatch.setattr(quant, "INT4_MATMUL", choice)
        assert quant.prepare_int4_layouts(model) == 1
    assert model["int4"].tinygemm is not None and model["int4_row"].tinygemm is None
    assert model["fp8"].tinygemm is None
    # the CPU forward stays the exact reference, whatever the layout
    x = torch.randn(3, 256).bfloat16()
    want = torch.nn.functional.linear(x, model["int4"].dequantize(torch.bfloat16))
    assert torch.equal(model["int4"](x), want)


def test_int4_rows_take_the_faster_kernel(monkeypatch):
    """``G4SERVE_INT4_MATMUL``: auto sends 2-7 rows to tinygemm, one row and 8+ to the Triton kernel (the
    faster at each size on an H100); tinygemm takes every decode size, triton none."""
    monkeypatch.setattr(quant, "INT4_MATMUL", "auto")
    assert [m for m in range(1, 17) if quant._takes_tinygemm(m)] == [2, 3, 4, 5, 6, 7]
    monkeypatch.setattr(quant, "INT4_MATMUL", "tinygemm")
    assert all(quant._takes_tinygemm(m) for m in range(1, 65))
