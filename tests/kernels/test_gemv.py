"""The skinny (decode) GEMM kernel and its fused gate epilogues against the unfused ops, in Triton's
interpreter on CPU tensors: both the M=1 (elementwise) and the M>1 (tensor-core tile) paths, even and
ragged K, partial column blocks. fp32 to rounding noise; bf16 within one bf16 step of an fp32 product."""

from __future__ import annotations

import pytest
import torch

from g4serve.kernels.act_mul import act_mul_reference
from g4serve.kernels.gemv import GATE_UP, MUL, PLAIN, gemv_config, skinny_matmul, skinny_matmul_reference

EPILOGUES = {"plain": PLAIN, "gate_up": GATE_UP, "mul": MUL}


def _inputs(m, n, k, epilogue, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    rows = 2 * n if epilogue == GATE_UP else n
    w = (torch.randn(rows, k, generator=gen) * k**-0.5).to(dtype)
    # the PLE operand is a strided view (one layer's slice of [T, L, P]), as the model passes it
    other = torch.randn(m, 3, n, generator=gen).to(dtype)[:, 1] if epilogue == MUL else None
    return x, w, other


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("epilogue", list(EPILOGUES))
@pytest.mark.parametrize(
    "m,n,k,block_n,block_k",
    [
        (1, 40, 64, 8, 32),  # M=1, even K, full column blocks
        (1, 37, 100, 4, 32),  # M=1, ragged K and a partial last column block
        (3, 40, 96, 16, 32),  # M>1: tensor-core tiles with padded rows, partial column block
        (8, 16, 80, 16, 32),  # M>1, ragged K
    ],
)
def test_skinny_matmul_matches_unfused_ops(dtype, epilogue, m, n, k, block_n, block_k):
    ep = EPILOGUES[epilogue]
    x, w, other = _inputs(m, n, k, ep, dtype, seed=m * 1000 + n + k)
    act = "gelu_pytorch_tanh" if ep != PLAIN else None
    cfg = {"block_n": block_n, "block_k": block_k, "num_warps": 4, "num_stages": 1}
    out = skinny_matmul(x, w, ep, act, other, config=cfg)
    assert out.shape == (m, n) and out.dtype == dtype
    if dtype == torch.float32:
        ref = skinny_matmul_reference(x, w, ep, act, other)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    else:
        # fp32 products, rounded where the unfused path rounds (GEMM output, activation, result)
        ref = skinny_matmul_reference(x.float(), w.float(), PLAIN)
        if ep == GATE_UP:
            gate, up = ref.chunk(2, dim=-1)
            ref = act_mul_reference(act, gate.to(dtype), up.to(dtype))
        elif ep == MUL:
            ref = act_mul_reference(act, ref.to(dtype), other)
        torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=2e-2)


def test_silu_gate_up():
    x, w, _ = _inputs(1, 24, 64, GATE_UP, torch.float32, seed=7)
    out = skinny_matmul(
        x, w, GATE_UP, "silu", config={"block_n": 8, "block_k": 32, "num_warps": 4, "num_stages": 1}
    )
    torch.testing.assert_close(out, skinny_matmul_reference(x, w, GATE_UP, "silu"), atol=2e-5, rtol=2e-5)


def test_default_configs_cover_decode_shapes():
    # every e4b decode projection gets tiles that divide into whole K steps or a masked tail
    for m in (1, 2, 8):
        for n, k in ((3072, 2560), (2560, 2048), (10240, 2560), (2560, 10240), (256, 2560), (2560, 256)):
            cfg = gemv_config(m, n, k)
            assert cfg["block_k"] <= max(16, 1 << (k - 1).bit_length())
            assert cfg["block_n"] >= (16 if m > 1 else 1)


def test_layers_dispatch_keeps_the_cpu_reference_path():
    """On CPU tensors the model's projections stay F.linear + the reference activation (bit-exact with
    transformers); the kernel is only taken for CUDA inputs."""
    from torch import nn

    from g4serve.layers.fused import gate_up_act, linear, linear_act_mul

    gen = torch.Generator().manual_seed(3)
    layer = nn.Linear(32, 48, bias=False)
    x = torch.randn(1, 32, generator=gen)
    assert torch.equal(linear(x, layer), layer(x))
    gate, up = layer(x).chunk(2, dim=-1)
    assert torch.equal(
        gate_up_act(x, layer, "gelu_pytorch_tanh"), act_mul_reference("gelu_pytorch_tanh", gate, up)
    )
    other = torch.randn(1, 48, generator=gen)
    assert torch.equal(
        linear_act_mul(x, layer, other, "silu"), skinny_matmul_reference(x, layer.weight, MUL, "silu", other)
    )
