"""The FP8 prefill path (per-token or static activation quantization, then torch._scaled_mm with one weight
scale per row) against the dequantized weight, on CPU (torch runs _scaled_mm there too): per-channel, and
stacked per-tensor parts whose scales cover a block of rows each."""

from __future__ import annotations

import pytest
import torch

from g4serve.kernels.fp8_rows import quantize_rows_reference
from g4serve.layers.quant import QuantLinear, _fp8_scaled_mm, stack_linears
from g4serve.quant_config import ActivationQuant, WeightQuant


def _layer(n: int, strategy: str, activations: ActivationQuant, gen: torch.Generator) -> QuantLinear:
    block = (1, 0) if strategy == "channel" else (0, 0)
    layer = QuantLinear(64, n, WeightQuant("fp8", strategy, block), activations, compute_dtype=torch.bfloat16)
    layer.quantize_from(torch.randn(n, 64, generator=gen) * 0.1)
    return layer


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("stacked", [False, True])
def test_fp8_scaled_mm_matches_the_dequantized_weight(static, stacked):
    gen = torch.Generator().manual_seed(0)
    acts = ActivationQuant(False, "tensor") if static else ActivationQuant(True, "token")
    if stacked:  # q/k/v-like parts with a scale each: rows 0-31, 32-47, 48-63 of the stacked weight
        layer = stack_linears([_layer(n, "tensor", acts, gen) for n in (32, 16, 16)])
        assert layer.scale_block[0] == 1 and layer.weight_scale.shape == (64, 1)
    else:
        layer = _layer(48, "channel", acts, gen)
    x = torch.randn(80, 64, generator=gen).to(torch.bfloat16)
    if static:
        layer.input_scale.fill_(x.abs().max().item() / 448)
    got = _fp8_scaled_mm(x, layer).float()
    ref = x.float() @ layer.dequantize(torch.float32).T
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 6e-2


def test_row_scales_are_kept_until_the_weight_scales_change():
    """The per-row scales ``_fp8_scaled_mm`` hands to ``torch._scaled_mm``: built once, rebuilt when the
    layer's scales are written again (a reload, ``quantize_from``)."""
    gen = torch.Generator().manual_seed(2)
    layer = stack_linears([_layer(n, "tensor", ActivationQuant(True, "token"), gen) for n in (32, 16, 16)])
    first = layer.row_scales()
    assert first.shape == (1, 64) and first is layer.row_scales()
    want = torch.cat([layer.weight_scale[i, 0].float().expand(n) for i, n in ((0, 32), (32, 16), (48, 16))])
    assert torch.equal(first[0], want)
    with torch.no_grad():
        layer.weight_scale.mul_(2)
    again = layer.row_scales()
    assert again is not first and torch.equal(again, first * 2)


def test_stacked_equal_parts_keep_one_scale_per_part():
    gen = torch.Generator().manual_seed(1)
    acts = ActivationQuant(True, "token")
    layer = stack_linears([_layer(32, "tensor", acts, gen), _layer(32, "tensor", acts, gen)])
    assert layer.scale_block == (32, 64) and layer.weight_scale.shape == (2, 1)
    x = torch.randn(70, 64, generator=gen).to(torch.bfloat16)
    ref = x.float() @ layer.dequantize(torch.float32).T
    got = _fp8_scaled_mm(x, layer).float()
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 6e-2


def test_per_token_activation_scales():
    x = torch.tensor([[1.0, -2.0], [0.0, 0.0], [448.0, 4.0]])
    q, scale = quantize_rows_reference(x, None)
    assert scale.shape == (3, 1) and scale[0, 0] == 2.0 / 448 and scale[2, 0] == 1.0
    assert torch.equal(q.float() * scale, torch.tensor([[1.0, -2.0], [0.0, 0.0], [448.0, 4.0]]))


def test_an_offered_quantized_input_is_taken_by_that_tensor_only():
    """``QuantLinear.offer_quantized_input``: the next call takes the values for the offered tensor alone,
    and the offer ends at that call whichever tensor it gets."""
    gen = torch.Generator().manual_seed(3)
    layer = _layer(32, "channel", ActivationQuant(True, "token"), gen)
    x, other = torch.randn(2, 64).bfloat16(), torch.randn(2, 64).bfloat16()
    held = (torch.zeros(2, 64, dtype=torch.float8_e4m3fn), torch.ones(2, 1))
    layer.offer_quantized_input(x, *held)
    assert layer.take_quantized_input(other) is None
    assert layer.take_quantized_input(x) is None  # ended by the call before
    layer.offer_quantized_input(x, *held)
    got = layer.take_quantized_input(x)
    assert got[0] is held[0] and got[1] is held[1]
    assert layer.take_quantized_input(x) is None


def test_quant_linear_multiplies_the_offered_values_without_quantizing_again(monkeypatch):
    """On the W8A8 decode path (here in Triton's interpreter on CPU tensors), an input offered by the norm
    kernel goes to the GEMM as offered: the same result as quantizing it there, and no quantizing launch."""
    import g4serve.layers.quant as quant
    from g4serve.kernels.fp8_matmul import quantize_groups
    from g4serve.kernels.gemv import GATE_UP

    gen = torch.Generator().manual_seed(4)
    layer = _layer(64, "channel", ActivationQuant(True, "token"), gen)  # 2 x 32 rows: a stacked gate/up
    x = torch.randn(3, 64, generator=gen).bfloat16()
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(quant, "_fp8_matmul_ok", lambda x, layer: True)
    assert quant.takes_fp8_groups(x, layer) and not quant.takes_fp8_groups(torch.randn(65, 64), layer)
    want = quant.quant_linear(x, layer, GATE_UP, "gelu_pytorch_tanh")
    layer.offer_quantized_input(x, *quantize_groups(x))

    def refuse(*args, **kwargs):
        raise AssertionError("quantized again")

    monkeypatch.setattr(quant, "fp8_matmul", refuse)
    assert torch.equal(quant.quant_linear(x, layer, GATE_UP, "gelu_pytorch_tanh"), want)
