"""The norm kernel quantizing its output for the W8A8 GEMM that reads it (``G4SERVE_FP8_NORM_QUANT``), on
CUDA: bit for bit what the GEMM's own quantizing launch gives at e4b's and 31b's widths, and an FP8 engine
writes the same tokens with it as without it (captured graphs), the offers taken on the way."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("rows", [1, 8, 64])
@pytest.mark.parametrize("n", [2560, 5376])
def test_kernel_equals_the_quantizing_launch(rows, n):
    from g4serve.kernels.fp8_matmul import quantize_groups
    from g4serve.kernels.rms_norm import fp8_next_buffers, fused_rms_norm

    gen = torch.Generator(device="cuda").manual_seed(rows + n)
    x = (torch.randn(rows, n, device="cuda", generator=gen) * 3).bfloat16()
    residual = torch.randn(rows, n, device="cuda", generator=gen).bfloat16()
    w, w2 = (1 + 0.1 * torch.randn(2, n, device="cuda", generator=gen)).bfloat16()
    fp8 = fp8_next_buffers(x)
    _, out2 = fused_rms_norm(x, w, 1e-6, residual=residual, next_weight=w2, fp8_next=fp8)
    q, sx = quantize_groups(out2)
    assert torch.equal(fp8[0].view(torch.uint8), q.view(torch.uint8)) and torch.equal(fp8[1], sx)


def test_fp8_engine_tokens_equal_without_the_fused_quantizer(hf_checkpoint, monkeypatch):
    from test_decode_tail_gpu import greedy_tokens

    import g4serve.layers.fused as fused
    from g4serve.layers.quant import QuantLinear

    checkpoint = hf_checkpoint("31b")
    separate = greedy_tokens(checkpoint, dtype="bfloat16", quantization="fp8")
    taken = []
    take = QuantLinear.take_quantized_input

    def recording_take(self, x):
        got = take(self, x)
        taken.append(got is not None)
        return got

    monkeypatch.setattr(fused, "FP8_NORM_QUANT", True)
    monkeypatch.setattr(QuantLinear, "take_quantized_input", recording_take)
    assert greedy_tokens(checkpoint, dtype="bfloat16", quantization="fp8") == separate
    assert any(taken)  # the W8A8 projections took the norms' quantized outputs
