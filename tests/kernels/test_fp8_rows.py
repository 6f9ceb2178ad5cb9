"""The one-launch per-token FP8 quantizer against the torch ops it replaces (Triton's interpreter on CPU):
equal bits and equal scales, dynamic and static, across K block boundaries and awkward rows; the launch
compiles for sm_90 with programmatic dependent launch."""

from __future__ import annotations

import pytest
import torch

import g4serve.kernels.fp8_rows as fp8_rows_module
from g4serve.kernels.fp8_rows import quantize_rows_fp8, quantize_rows_reference
from g4serve.kernels.kv_cache_write import activation_scale_reference


def _bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,k", [(1, 16), (5, 100), (3, 2048), (4, 2500), (2, 5376)])
@pytest.mark.parametrize("static", [False, True])
def test_equal_to_the_torch_quantizer(dtype, m, k, static):
    gen = torch.Generator().manual_seed(m * 7 + k)
    x = (torch.randn(m, k, generator=gen) * torch.logspace(-3, 2, m)[:, None]).to(dtype)
    # zeros of both signs, a tiny value, a saturating one
    x[0, : min(k, 4)] = torch.tensor([0.0, -0.0, 1e-8, -3e4][: min(k, 4)], dtype=dtype)
    if m > 2:
        x[2] = 0  # an all-zero row: the 1e-12 floor
    static_scale = torch.tensor([x.float().abs().max().item() / 300], dtype=torch.float32) if static else None
    want_q, want_s = quantize_rows_reference(x, static_scale)
    got_q, got_s = quantize_rows_fp8(x, static_scale)
    assert got_q.dtype == torch.float8_e4m3fn and got_s.shape == (m, 1)
    assert torch.equal(got_s, want_s)
    assert torch.equal(_bits(got_q), _bits(want_q))


def test_row_strided_input_and_empty():
    x = torch.randn(6, 96, dtype=torch.bfloat16)[::2]  # a row stride of 192, unit last stride
    want_q, want_s = quantize_rows_reference(x, None)
    got_q, got_s = quantize_rows_fp8(x, None)
    assert torch.equal(_bits(got_q), _bits(want_q)) and torch.equal(got_s, want_s)
    q, s = quantize_rows_fp8(x[:0], None)
    assert q.shape == (0, 96) and s.shape == (0, 1)


def test_the_reference_scale_is_divided_correctly_rounded():
    """``activation_scale_reference`` is amax / 448 rounded once (float64 quotients, exact to far past
    float32, rounded to the nearest float32), as the kernels' ``tl.div_rn``: not amax * (1 / 448), which CUDA
    torch computes for a Python-number divisor and which is an ulp off for some amax."""
    amax = torch.rand(100_000, generator=torch.Generator().manual_seed(0)) * torch.logspace(-6, 4, 100_000)
    want = (amax.double() / 448).float().clamp_min(1e-12)
    assert torch.equal(activation_scale_reference(amax), want)
    by_reciprocal = amax * torch.tensor(1 / 448, dtype=torch.float32)
    assert not torch.equal(by_reciprocal, want)  # the rounding the reference must not take
    assert torch.equal(activation_scale_reference(torch.zeros(2)), torch.full((2,), 1e-12))  # the floor


@pytest.mark.parametrize("k", [2816, 5376])
@pytest.mark.parametrize("static", [False, True])
def test_launches_compile_for_sm90(monkeypatch, k, static):
    """26B-A4B's and 31B's hidden sizes (two and three 2,048-column blocks), with dependent launch on."""
    from test_kv_fp8_sm90_compile import _compile, _launches

    x = torch.empty(30, k, dtype=torch.bfloat16, device="meta")
    scale = torch.empty(1, device="meta") if static else None
    launches = _launches(monkeypatch, fp8_rows_module, "_quantize_rows", lambda: quantize_rows_fp8(x, scale))
    ((fn, args, kwargs),) = launches
    assert kwargs["BLOCK"] == 2048
    assert _compile(fn, args, kwargs, use_pdl=True).asm["cubin"]
