"""The fused elementwise kernels (RMSNorm chains, q/k norm + RoPE, activation × up) against their torch
references, in Triton's interpreter on CPU tensors: fp32 to rounding noise, bf16 to one bf16 step."""

from __future__ import annotations

import pytest
import torch

from g4serve.kernels.act_mul import act_mul, act_mul_reference
from g4serve.kernels.norm_rope import norm_rope, norm_rope_reference
from g4serve.kernels.rms_norm import (
    fused_rms_norm,
    fused_rms_norm_reference,
    moe_input_norms,
    moe_input_norms_reference,
)
from g4serve.layers.rotary import rope_cos_sin, text_inv_freq

TOL = {torch.float32: 2e-6, torch.bfloat16: 2e-2}


def _close(out, ref, dtype):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [48, 100])  # a power of two and a masked tail
@pytest.mark.parametrize(
    "with_residual,with_scale,with_next",
    [(False, False, False), (True, False, True), (True, True, False), (False, True, True)],
)
def test_fused_rms_norm(dtype, n, with_residual, with_scale, with_next):
    gen = torch.Generator().manual_seed(n)
    x = (3 * torch.randn(5, n, generator=gen)).to(dtype)
    w = torch.randn(n, generator=gen).to(dtype)
    w2 = torch.randn(n, generator=gen).to(dtype) if with_next else None
    res = torch.randn(5, n, generator=gen).to(dtype) if with_residual else None
    scale = torch.tensor([0.7]).to(dtype) if with_scale else None
    out, out2 = fused_rms_norm(x, w, 1e-6, residual=res, scale=scale, next_weight=w2)
    ref, ref2 = fused_rms_norm_reference(x, w, 1e-6, residual=res, scale=scale, next_weight=w2)
    _close(out, ref, dtype)
    if with_next:
        _close(out2, ref2, dtype)
    else:
        assert out2 is None and ref2 is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [48, 100])
@pytest.mark.parametrize("with_next", [False, True])
def test_fused_rms_norm_of_two_branches(dtype, n, with_next):
    """A MoE layer's post-feed-forward pass: norm_a(x) + norm_b(xb) summed in the same launch as the
    residual add, the layer scalar and the next norm."""
    gen = torch.Generator().manual_seed(n + 1)
    x, xb, res = ((3 * torch.randn(5, n, generator=gen)).to(dtype) for _ in range(3))
    w, wa, wb, w2 = (torch.randn(n, generator=gen).to(dtype) for _ in range(4))
    scale = torch.tensor([0.7]).to(dtype)
    kw = dict(residual=res, scale=scale, next_weight=w2 if with_next else None, branches=(xb, wa, wb))
    out, out2 = fused_rms_norm(x, w, 1e-6, **kw)
    ref, ref2 = fused_rms_norm_reference(x, w, 1e-6, **kw)
    _close(out, ref, dtype)
    if with_next:
        _close(out2, ref2, dtype)
    # the reference is the unfused chain
    summed = fused_rms_norm_reference(x, wa, 1e-6)[0] + fused_rms_norm_reference(xb, wb, 1e-6)[0]
    assert torch.equal(ref, fused_rms_norm_reference(summed, w, 1e-6, residual=res, scale=scale)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slots", [2, 8])
def test_the_branch_may_be_a_moes_unsummed_expert_outputs(dtype, slots):
    """xb [T, k, N] (``fused_moe(sum_slots=False)``): the pass sums the k rows in fp32 in slot order and
    rounds once, then goes on as with the summed branch: in fp32 the same bits as that, in bf16 within the
    rounding of the sum (Triton's interpreter truncates where the GPU rounds to nearest even: the GPU test
    checks the bits, tests/gpu/test_moe_gpu.py), and near the reference."""
    gen = torch.Generator().manual_seed(slots)
    n = 100
    x, res = ((3 * torch.randn(5, n, generator=gen)).to(dtype) for _ in range(2))
    xb = torch.randn(5, slots, n, generator=gen).to(dtype)
    w, wa, wb, w2 = (torch.randn(n, generator=gen).to(dtype) for _ in range(4))
    summed = xb[:, 0].float()
    for j in range(1, slots):
        summed = summed + xb[:, j].float()
    kw = dict(residual=res, next_weight=w2)
    got = fused_rms_norm(x, w, 1e-6, **kw, branches=(xb, wa, wb))
    want = fused_rms_norm(x, w, 1e-6, **kw, branches=(summed.to(dtype), wa, wb))
    for g, s in zip(got, want):
        assert torch.equal(g, s) if dtype == torch.float32 else (g.float() - s.float()).abs().max() < 0.1
    for g, r in zip(got, fused_rms_norm_reference(x, w, 1e-6, **kw, branches=(xb, wa, wb))):
        # bf16: a few truncations more than the reference's roundings, on values of a few units
        torch.testing.assert_close(
            g.float(), r.float(), atol=1e-5 if dtype == torch.float32 else 0.1, rtol=0.02
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [48, 100])
def test_moe_input_norms(dtype, n):
    """The experts' input rms_norm(x, w) and the router's rms_norm(x) * scale * root from one launch."""
    gen = torch.Generator().manual_seed(n + 2)
    x = (3 * torch.randn(2, 3, n, generator=gen)).to(dtype)
    w, scale = (torch.randn(n, generator=gen).to(dtype) for _ in range(2))
    got = moe_input_norms(x, w, scale, n**-0.5, 1e-6)
    want = moe_input_norms_reference(x, w, scale, n**-0.5, 1e-6)
    for g, r in zip(got, want):
        _close(g, r, dtype)


def test_fused_rms_norm_rows_of_a_3d_tensor_without_weight():
    x = torch.randn(3, 4, 32)
    out, _ = fused_rms_norm(x, None, 1e-6)
    _close(out, fused_rms_norm_reference(x, None, 1e-6)[0], torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,partial", [(32, 1.0), (64, 0.25)])  # sliding (full RoPE) / proportional
def test_norm_rope_on_a_strided_view(dtype, head_dim, partial):
    gen = torch.Generator().manual_seed(head_dim)
    t, heads = 6, 3
    # q as a slice of a fused projection: rows strided past the other heads' columns
    fused = torch.randn(t, (heads + 2) * head_dim, generator=gen).to(dtype)
    q = fused[:, : heads * head_dim].view(t, heads, head_dim)
    w = torch.randn(head_dim, generator=gen).to(dtype)
    rope = (
        {"rope_theta": 10000.0}
        if partial == 1.0
        else {"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": partial}
    )
    cos, sin = rope_cos_sin(torch.tensor([0, 1, 5, 17, 300, 4095]), text_inv_freq(rope, head_dim), dtype)
    _close(norm_rope(q, w, 1e-6, cos, sin), norm_rope_reference(q, w, 1e-6, cos, sin), dtype)
    # v norm: no weight, no rotation
    _close(norm_rope(q, None, 1e-6), norm_rope_reference(q, None, 1e-6), dtype)


@pytest.mark.parametrize("sections", [1, 2])
def test_norm_rope_over_several_token_blocks(sections):
    """More tokens than one program takes (a partial last block), and a head width that is not a power of
    two (its columns are padded to the next one)."""
    from g4serve.kernels.norm_rope import rows_per_program

    t, heads, head_dim = 150, 2, 48
    block_t, _ = rows_per_program(t, head_dim)
    assert block_t < t and t % block_t
    gen = torch.Generator().manual_seed(sections)
    x = torch.randn(t, heads, head_dim, generator=gen).to(torch.bfloat16)
    w = torch.randn(head_dim, generator=gen).to(torch.bfloat16)
    angles = torch.rand(t, head_dim, generator=gen) * 6
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    _close(
        norm_rope(x, w, 1e-6, cos, sin, sections),
        norm_rope_reference(x, w, 1e-6, cos, sin, sections),
        torch.bfloat16,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_rope_axial_sections(dtype):
    """The vision tower's q/k norm + axial RoPE: x and y halves of the head rotated separately."""
    from g4serve.layers.rotary import vision_cos_sin, vision_inv_freq

    gen = torch.Generator().manual_seed(3)
    t, heads, head_dim = 7, 2, 32
    x = torch.randn(t, heads, head_dim, generator=gen).to(dtype)
    w = torch.randn(head_dim, generator=gen).to(dtype)
    xy = torch.randint(0, 40, (1, t, 2), generator=gen)
    cos, sin = vision_cos_sin(xy, vision_inv_freq(100.0, head_dim), dtype)
    cos, sin = cos[0], sin[0]
    _close(
        norm_rope(x, w, 1e-6, cos, sin, sections=2),
        norm_rope_reference(x, w, 1e-6, cos, sin, sections=2),
        dtype,
    )
    # and a single section is not the same rotation
    assert not torch.allclose(
        norm_rope(x, w, 1e-6, cos, sin).float(),
        norm_rope_reference(x, w, 1e-6, cos, sin, sections=2).float(),
        atol=1e-3,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["gelu_pytorch_tanh", "silu"])
def test_act_mul(dtype, activation):
    gen = torch.Generator().manual_seed(1)
    gate_up = (4 * torch.randn(3, 2 * 300, generator=gen)).to(dtype)  # halves of a fused projection
    a, b = gate_up[:, :300], gate_up[:, 300:]
    _close(act_mul(activation, a, b, block=128), act_mul_reference(activation, a, b), dtype)


def test_programmatic_dependent_launch_is_for_small_cuda_launches_only():
    from g4serve.kernels._launch import PDL_MAX_ROWS, pdl

    assert pdl(torch.device("cpu"), 1) == {"USE_PDL": False}  # the interpreter has no grid dependency control
    if torch.cuda.is_available():
        assert pdl(torch.device("cuda"), PDL_MAX_ROWS + 1) == {"USE_PDL": False}
