"""The fused attention prologue (q/k norm + RoPE, v norm, K/V cache write) in Triton's interpreter: equal
bit for bit to the unfused kernels it replaces, and to the torch reference within rounding."""

from __future__ import annotations

import pytest
import torch

from g4serve.kernels.kv_cache_write import kv_cache_write
from g4serve.kernels.norm_rope import norm_rope
from g4serve.kernels.qkv_prep import qkv_prep, qkv_prep_reference
from g4serve.layers.rotary import rope_cos_sin, text_inv_freq

ROPES = {
    "default": {"rope_theta": 10000.0},
    "proportional": {"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
}


def _case(dtype, v_is_k, rope, head_dim=32, hq=4, hkv=2, seed=0, repeat=1):
    """Six tokens (``repeat`` times: several token blocks per program grid), two of them graph padding."""
    gen = torch.Generator().manual_seed(seed)
    t = 6 * repeat
    qkv = (3 * torch.randn(t, (hq + hkv * (1 if v_is_k else 2)) * head_dim, generator=gen)).to(dtype)
    wq, wk = torch.randn(head_dim, generator=gen).to(dtype), torch.randn(head_dim, generator=gen).to(dtype)
    positions = torch.tensor([0, 3, 7, 100, 9, 4095]).repeat(repeat)
    cos, sin = rope_cos_sin(positions, text_inv_freq(ROPES[rope], head_dim), dtype)
    slots = torch.tensor([3, -1, 0, 7, 5, -1]).repeat(repeat)  # -1: graph padding rows, never written
    slots = torch.where(slots >= 0, slots + 10 * (torch.arange(t) // 6), slots)
    cache = torch.full((2, 10 * repeat, hkv, head_dim), 9.0, dtype=dtype)
    return qkv, wq, wk, cos, sin, slots, cache


@pytest.mark.parametrize("v_is_k", [False, True])
@pytest.mark.parametrize("rope", list(ROPES))
@pytest.mark.parametrize("head_dim,repeat", [(32, 1), (256, 7)])  # 42 tokens of 256: three blocks of 16
def test_bf16_equals_the_unfused_kernels(v_is_k, rope, head_dim, repeat):
    qkv, wq, wk, cos, sin, slots, cache = _case(
        torch.bfloat16, v_is_k, rope, head_dim=head_dim, repeat=repeat
    )
    hq, hkv, d = 4, 2, head_dim
    fused_cache = cache.clone()
    q = qkv_prep(qkv, hq, hkv, wq, wk, 1e-6, cos, sin, fused_cache[0], fused_cache[1], slots, v_is_k=v_is_k)
    heads = qkv.view(qkv.shape[0], -1, d)
    k_raw = heads[:, hq : hq + hkv]
    v_raw = k_raw if v_is_k else heads[:, hq + hkv :]
    q_ref = norm_rope(heads[:, :hq], wq, 1e-6, cos, sin)
    kv_cache_write(
        norm_rope(k_raw, wk, 1e-6, cos, sin), norm_rope(v_raw, None, 1e-6), cache[0], cache[1], slots
    )
    assert torch.equal(q, q_ref)
    assert torch.equal(fused_cache, cache)
    written = torch.zeros(cache.shape[1], dtype=torch.bool)
    written[slots[slots >= 0]] = True
    assert (fused_cache[:, ~written] == 9.0).all()  # slots nobody writes are untouched


@pytest.mark.parametrize("v_is_k", [False, True])
def test_fp32_matches_torch_reference(v_is_k):
    qkv, wq, wk, cos, sin, slots, cache = _case(
        torch.float32, v_is_k, "default", head_dim=64, hq=2, hkv=1, seed=3
    )
    ref_cache = cache.clone()
    q = qkv_prep(qkv, 2, 1, wq, wk, 1e-6, cos, sin, cache[0], cache[1], slots, v_is_k=v_is_k)
    q_ref = qkv_prep_reference(
        qkv, 2, 1, wq, wk, 1e-6, cos, sin, ref_cache[0], ref_cache[1], slots, v_is_k=v_is_k
    )
    torch.testing.assert_close(q, q_ref, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(cache, ref_cache, atol=2e-6, rtol=2e-6)
