"""The norm kernel's FP8 output (``fused_rms_norm(..., fp8_next=...)``): the next norm's output quantized for
the W8A8 GEMM that reads it, in the same pass. In Triton's interpreter it equals, bit for bit, what the
GEMM's own quantizing launch (``fp8_matmul.quantize_groups``) computes from that output, at widths under one
group, ragged and whole; the norm outputs are unchanged; the torch reference fills the same buffers from its
own output. Then the launch compiles to sm_90 at e4b's and 31b's widths."""

from __future__ import annotations

import pytest
import torch

import g4serve.kernels.rms_norm as rms_norm_module
from g4serve.kernels.fp8_matmul import quantize_activation_groups, quantize_groups
from g4serve.kernels.rms_norm import fp8_next_buffers, fused_rms_norm, fused_rms_norm_reference


def _row(rows: int, n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, n, generator=gen) * 3).bfloat16()
    residual = torch.randn(rows, n, generator=gen).bfloat16()
    w, w2 = (1 + 0.1 * torch.randn(2, n, generator=gen)).bfloat16()
    return x, residual, w, w2


def _bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


@pytest.mark.parametrize("rows,n", [(2, 64), (3, 200), (1, 512), (4, 384)])
def test_kernel_quantizes_as_the_gemms_own_launch(rows, n):
    x, residual, w, w2 = _row(rows, n, seed=rows * 1000 + n)
    scale = torch.tensor([0.5]).bfloat16()
    plain = fused_rms_norm(x, w, 1e-6, residual=residual, scale=scale, next_weight=w2)
    fp8 = fp8_next_buffers(x)
    out, out2 = fused_rms_norm(x, w, 1e-6, residual=residual, scale=scale, next_weight=w2, fp8_next=fp8)
    assert torch.equal(out, plain[0]) and torch.equal(out2, plain[1])
    q, sx = quantize_groups(out2)  # the separate launch the W8A8 GEMM would make
    assert torch.equal(_bits(fp8[0]), _bits(q)) and torch.equal(fp8[1], sx)
    assert fp8[1].shape == (rows, -(-n // 128))


@pytest.mark.parametrize("with_next", [False, True])
def test_loads_before_the_wait_change_no_bit(monkeypatch, with_next):
    """``G4SERVE_NORM_EARLY_LOADS``: the weights, residual and scalar loaded first, the same outputs."""
    x, residual, w, w2 = _row(3, 200, seed=3)
    kw = dict(residual=residual, scale=torch.tensor([0.5]).bfloat16(), next_weight=w2 if with_next else None)
    monkeypatch.setattr(rms_norm_module, "EARLY_LOADS", False)
    plain = fused_rms_norm(x, w, 1e-6, **kw)
    monkeypatch.setattr(rms_norm_module, "EARLY_LOADS", True)
    early = fused_rms_norm(x, w, 1e-6, **kw)
    assert torch.equal(early[0], plain[0])
    assert (early[1] is None) == (not with_next) and (not with_next or torch.equal(early[1], plain[1]))


def test_reference_fills_the_buffers_from_its_own_output():
    x, residual, w, w2 = _row(3, 200, seed=1)
    fp8 = fp8_next_buffers(x)
    _, out2 = fused_rms_norm_reference(x, w, 1e-6, residual=residual, next_weight=w2, fp8_next=fp8)
    q, sx = quantize_activation_groups(out2)
    assert torch.equal(_bits(fp8[0]), _bits(q)) and torch.equal(fp8[1], sx)


def test_quantizing_needs_the_next_norm():
    x, residual, w, _ = _row(2, 64, seed=2)
    with pytest.raises(AssertionError, match="next norm"):
        fused_rms_norm(x, w, 1e-6, residual=residual, fp8_next=fp8_next_buffers(x))


@pytest.mark.parametrize("n,early", [(2560, True), (5376, True), (5376, False)])
def test_kernel_compiles_for_sm90(monkeypatch, n, early):
    """Under dependent launch; with ``EARLY_LOADS`` (the default) the PTX loads before its
    ``griddepcontrol.wait``."""
    from test_kv_fp8_sm90_compile import _compile, _launches

    monkeypatch.setattr(rms_norm_module, "EARLY_LOADS", early)
    meta = dict(dtype=torch.bfloat16, device="meta")
    x, w = torch.empty(8, n, **meta), torch.empty(n, **meta)
    fp8 = (
        torch.empty(8, n, dtype=torch.float8_e4m3fn, device="meta"),
        torch.empty(8, -(-n // 128), device="meta"),
    )
    launches = _launches(
        monkeypatch,
        rms_norm_module,
        "_rms_norm",
        lambda: fused_rms_norm(x, w, 1e-6, residual=x, scale=w[:1], next_weight=w, fp8_next=fp8),
    )
    for fn, args, kwargs in launches:
        ptx = _compile(fn, args, kwargs, use_pdl=True).asm["ptx"]
        before_wait = ptx[: ptx.index("griddepcontrol.wait")]
        assert ("ld.global" in before_wait) == early


@pytest.mark.parametrize("slots", [1, 8])
def test_the_moe_branch_pass_compiles_for_sm90(monkeypatch, slots):
    """26B-A4B's post-feed-forward pass (two branches, the experts' k unsummed rows or their sum)."""
    from test_kv_fp8_sm90_compile import _compile, _launches

    meta = dict(dtype=torch.bfloat16, device="meta")
    n = 2816
    x, w = torch.empty(8, n, **meta), torch.empty(n, **meta)
    xb = torch.empty(8, slots, n, **meta) if slots > 1 else torch.empty(8, n, **meta)
    launches = _launches(
        monkeypatch,
        rms_norm_module,
        "_rms_norm",
        lambda: fused_rms_norm(x, w, 1e-6, residual=x, scale=w[:1], next_weight=w, branches=(xb, w, w)),
    )
    for fn, args, kwargs in launches:
        _compile(fn, args, kwargs, use_pdl=True)
