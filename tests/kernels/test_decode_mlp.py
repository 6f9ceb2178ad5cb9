"""The persistent decode-MLP kernel (``kernels/decode_mlp.py``) against the unfused ops, in Triton's
interpreter on CPU tensors: the M=1 (elementwise) and M>1 (tensor-core tile) paths, ragged tiles in every
phase, with and without the layer scalar and the next norm, several programs sharing the tickets; the
counters are back at zero after each launch, so a second launch (a CUDA graph's replay) computes the same.
Then the launch compiles to an sm_90 cubin (the interpreter does not apply the compiled language's rules)."""

from __future__ import annotations

import pytest
import torch

import g4serve.kernels.decode_mlp as decode_mlp_module
from g4serve.kernels.act_mul import act_mul_reference
from g4serve.kernels.decode_mlp import decode_mlp, decode_mlp_reference, new_counters
from g4serve.kernels.rms_norm import fused_rms_norm_reference

EPS = 1e-6
SMALL = {"bn_a": 16, "bk_a": 32, "bn_b": 16, "bk_b": 32, "num_warps": 4, "programs_per_sm": 1}
ONE_ROW = {"bn_a": 4, "bk_a": 32, "bn_b": 4, "bk_b": 64, "num_warps": 4, "programs_per_sm": 1}


def _inputs(m: int, h: int, i: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, h, generator=gen).to(dtype)
    residual = torch.randn(m, 2, h, generator=gen).to(dtype)[:, 1]  # a strided view, as a layer's can be
    gate_up = (torch.randn(2 * i, h, generator=gen) * h**-0.5).to(dtype)
    down = (torch.randn(h, i, generator=gen) * i**-0.5).to(dtype)
    norm_w = (1 + 0.1 * torch.randn(h, generator=gen)).to(dtype)
    next_w = (1 + 0.1 * torch.randn(h, generator=gen)).to(dtype)
    scale = torch.tensor([0.75]).to(dtype)
    return x, residual, gate_up, down, norm_w, next_w, scale


def _fp32_rounded_reference(x, residual, gate_up, down, norm_w, act, scale, next_w):
    """fp32 products, rounded to the activation dtype where the unfused path rounds them (GEMM outputs,
    activation, down output), then the norm chain."""
    dtype = x.dtype
    gate, up = (x.float() @ gate_up.float().T).chunk(2, dim=-1)
    inter = act_mul_reference(act, gate.to(dtype), up.to(dtype))
    y = (inter.float() @ down.float().T).to(dtype)
    return fused_rms_norm_reference(y, norm_w, EPS, residual=residual, scale=scale, next_weight=next_w)


@pytest.mark.parametrize(
    "m,h,i,cfg,programs",
    [
        (1, 64, 96, ONE_ROW, 3),  # one row, every tile full
        (1, 72, 100, ONE_ROW, 5),  # one row, ragged K in both phases and partial last tiles
        (3, 64, 96, SMALL, 3),  # tensor-core tiles with padded rows
        (8, 80, 120, SMALL, 2),  # eight rows, ragged everywhere
        (2, 48, 40, SMALL, 64),  # more programs than tasks
    ],
)
@pytest.mark.parametrize("with_scale,with_next", [(True, True), (False, False)])
def test_matches_the_unfused_ops_fp32(m, h, i, cfg, programs, with_scale, with_next):
    x, residual, gate_up, down, norm_w, next_w, scale = _inputs(m, h, i, torch.float32, seed=m * 100 + h + i)
    scale, next_w = (scale if with_scale else None), (next_w if with_next else None)
    counters = new_counters("cpu")
    out, out2 = decode_mlp(
        x, residual, gate_up, down, norm_w, EPS, "gelu_pytorch_tanh", counters, scale, next_w, cfg, programs
    )
    ref, ref2 = decode_mlp_reference(
        x, residual, gate_up, down, norm_w, EPS, "gelu_pytorch_tanh", scale, next_w
    )
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    if with_next:
        torch.testing.assert_close(out2, ref2, atol=2e-5, rtol=2e-5)
    else:
        assert out2 is None
    assert counters.tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("m,cfg", [(1, ONE_ROW), (5, SMALL)])
def test_bf16_rounds_where_the_unfused_ops_round(m, cfg):
    x, residual, gate_up, down, norm_w, next_w, scale = _inputs(m, 96, 160, torch.bfloat16, seed=11 + m)
    counters = new_counters("cpu")
    out, out2 = decode_mlp(x, residual, gate_up, down, norm_w, EPS, "silu", counters, scale, next_w, cfg)
    ref, ref2 = _fp32_rounded_reference(x, residual, gate_up, down, norm_w, "silu", scale, next_w)
    assert out.dtype == torch.bfloat16 and out2.dtype == torch.bfloat16
    # a rounding flip of an intermediate moves a result by about one bf16 step
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(out2.float(), ref2.float(), atol=3e-2, rtol=2e-2)


def test_a_second_launch_on_the_same_counters_computes_the_same():
    x, residual, gate_up, down, norm_w, next_w, scale = _inputs(4, 64, 96, torch.float32, seed=3)
    counters = new_counters("cpu")
    first = decode_mlp(x, residual, gate_up, down, norm_w, EPS, "silu", counters, scale, next_w, SMALL, 4)
    assert counters.tolist() == [0, 0, 0, 0]
    second = decode_mlp(x, residual, gate_up, down, norm_w, EPS, "silu", counters, scale, next_w, SMALL, 4)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


def test_refuses_what_it_is_not_built_for():
    x, residual, gate_up, down, norm_w, _, _ = _inputs(9, 64, 96, torch.float32, seed=5)
    with pytest.raises(AssertionError):  # nine rows: more than a decode batch of the kernel
        decode_mlp(x, residual, gate_up, down, norm_w, EPS, "silu", new_counters("cpu"))
    with pytest.raises(AssertionError):  # counters of another dtype
        decode_mlp(x[:2], residual[:2], gate_up, down, norm_w, EPS, "silu", torch.zeros(4, dtype=torch.int64))


@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("dims", [(2560, 10240), (5376, 21504)], ids=["e4b", "31b"])
def test_kernel_compiles_for_sm90(monkeypatch, m, dims):
    from test_kv_fp8_sm90_compile import _compile, _launches

    h, i = dims
    meta = dict(dtype=torch.bfloat16, device="meta")
    x, residual = torch.empty(m, h, **meta), torch.empty(m, h, **meta)
    gate_up, down = torch.empty(2 * i, h, **meta), torch.empty(h, i, **meta)
    norm_w, scale = torch.empty(h, **meta), torch.empty(1, **meta)
    counters = torch.empty(4, dtype=torch.int32, device="meta")
    monkeypatch.setattr(decode_mlp_module, "sm_count", lambda index: 132)
    launches = _launches(
        monkeypatch,
        decode_mlp_module,
        "_decode_mlp",
        lambda: decode_mlp(
            x,
            residual,
            gate_up,
            down,
            norm_w,
            EPS,
            "gelu_pytorch_tanh",
            counters,
            scale,
            norm_w,
            programs=264,
        ),
    )
    for fn, args, kwargs in launches:
        _compile(fn, args, kwargs, use_pdl=True)


def test_a_gated_mlp_takes_the_kernel_only_where_it_applies(monkeypatch):
    """``GatedMLP.fused_block`` through ``layers.fused.decode_mlp_block``: bf16 rows of a CUDA-looking tensor
    (the kernel itself runs in the interpreter on these CPU tensors) give the separate ops' result; off, nine
    rows, no rows or two ranks give None (the caller's separate ops)."""
    import g4serve.layers.fused as fused
    from g4serve.layers.fused import add_rms_norm
    from g4serve.layers.norm import RMSNorm
    from g4serve.models.gemma4.text import GatedMLP

    torch.manual_seed(0)
    mlp = GatedMLP(64, 96, "gelu_pytorch_tanh").to(torch.bfloat16)
    norm, next_norm = RMSNorm(64, EPS).to(torch.bfloat16), RMSNorm(64, EPS).to(torch.bfloat16)
    with torch.no_grad():
        for p in (*mlp.parameters(), norm.weight, next_norm.weight):
            p.normal_(0, 0.3)
    x, residual = torch.randn(3, 64).to(torch.bfloat16), torch.randn(3, 64).to(torch.bfloat16)
    scale = torch.tensor([0.5]).to(torch.bfloat16)
    assert mlp.fused_block(x, residual, norm, scale, next_norm) is None  # not stacked, no counters
    mlp.fuse_projections()
    with torch.no_grad():
        want = add_rms_norm(mlp(x), norm, residual, scale, next_norm)
    mlp.decode_counters = new_counters("cpu")
    assert mlp.fused_block(x, residual, norm, scale, next_norm) is None  # off by default
    monkeypatch.setattr(fused, "DECODE_MLP", True)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    with torch.no_grad():
        got = mlp.fused_block(x, residual, norm, scale, next_norm)
        nine = torch.randn(9, 64).to(torch.bfloat16)
        assert mlp.fused_block(nine, nine, norm, scale, next_norm) is None
        assert mlp.fused_block(x[:0], residual[:0], norm, scale, next_norm) is None
        mlp.tp = type("TwoRanks", (), {"size": 2})()
        assert mlp.fused_block(x, residual, norm, scale, next_norm) is None
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), atol=3e-2, rtol=2e-2)
    assert mlp.decode_counters.tolist() == [0, 0, 0, 0]
