"""Decode GEMMs that prefetch their weight rows into L2 before the dependent-launch wait
(``G4SERVE_PREFETCH_BYTES``) give the same bits as without: the prefetch only moves data into a cache. Run the
file with ``G4SERVE_PDL_TRIGGER=first`` too (``bench/device/env_ab.sh``'s GPU tests): each kernel then lets
its successor be scheduled before its own wait, and every launch below still reads finished inputs."""

from __future__ import annotations

import pytest
import torch

import g4serve.kernels._launch as launch_module
from g4serve.kernels.fp8_matmul import fp8_matmul, fp8_matmul_config, one_row_config
from g4serve.kernels.gemv import GATE_UP, MUL, PLAIN, skinny_matmul
from g4serve.layers.quant import quantize_weight

pytestmark = pytest.mark.gpu

# (n, k, epilogue): e4b o, e4b gate/up stacked, 31B o (split K on the tensor cores), a PLE-like gated row
SHAPES = [(2560, 2048, PLAIN), (10240, 2560, GATE_UP), (5376, 8192, PLAIN), (256, 2560, MUL)]


def _inputs(n: int, k: int, ep: int, m: int, gen: torch.Generator):
    rows = 2 * n if ep == GATE_UP else n
    dense = (torch.randn(rows, k, generator=gen, device="cuda") * k**-0.5).to(torch.bfloat16)
    x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
    other = torch.randn(m, n, generator=gen, device="cuda").to(torch.bfloat16) if ep == MUL else None
    return dense, x, other, ("gelu_pytorch_tanh" if ep != PLAIN else None)


def _twice(monkeypatch, call) -> tuple[torch.Tensor, torch.Tensor]:
    """``call()`` without prefetching, then prefetching 1,000 bytes (rounded down to 992) of every row, and
    then the whole row (more bytes than any row holds)."""
    outs = []
    for nbytes in (0, 1000, 1 << 20):
        monkeypatch.setattr(launch_module, "PREFETCH_BYTES", nbytes)
        outs.append(call())
    torch.cuda.synchronize()
    return outs


@pytest.mark.parametrize("m", [1, 8, 48])
def test_prefetching_changes_no_bit_of_the_bf16_skinny_gemm(monkeypatch, m):
    gen = torch.Generator(device="cuda").manual_seed(m)
    for n, k, ep in SHAPES:
        w, x, other, act = _inputs(n, k, ep, m, gen)
        outs = _twice(monkeypatch, lambda: skinny_matmul(x, w, ep, act, other))
        for out in outs[1:]:
            assert torch.equal(outs[0], out), (m, n, k, ep)


@pytest.mark.parametrize("one_row", ["mma", "fma"])
@pytest.mark.parametrize("m", [1, 8])
def test_prefetching_changes_no_bit_of_the_w8a8_gemm(monkeypatch, one_row, m):
    if m > 1 and one_row == "fma":
        pytest.skip("the CUDA cores' kernel takes one row")
    gen = torch.Generator(device="cuda").manual_seed(m + 3)
    for n, k, ep in SHAPES:
        w, x, other, act = _inputs(n, k, ep, m, gen)
        q, scale, _ = quantize_weight(w.float(), "fp8", (1, k))
        cfg = (
            one_row_config(n, k, ep)
            if one_row == "fma"
            else fp8_matmul_config(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count,
                                   one_row="mma", epilogue=ep)
        )  # fmt: skip
        outs = _twice(monkeypatch, lambda: fp8_matmul(x, q, scale, (1, k), ep, act, other, cfg))
        for out in outs[1:]:
            assert torch.equal(outs[0], out), (one_row, m, n, k, ep)
