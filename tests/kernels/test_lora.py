"""The batched multi-adapter LoRA kernels (shrink + expand) against the torch reference, in Triton's
interpreter on CPU tensors at tiny shapes, and the reference against the merged-weights identity
``x @ (W + B A).T == x @ W.T + (x @ A.T) @ B.T``. fp32 to rounding noise; bf16 to a bf16 step."""

from __future__ import annotations

import pytest
import torch

from g4serve.kernels.lora import LoraTiles, add_lora, add_lora_reference, lora_tiles

# Small tiles: several row blocks, column blocks and K splits, a ragged K (K=40 over BLOCK_K=16,
# k_per_split=32) and a partial last column block (N=24 over BLOCK_N=16).
SMALL = LoraTiles(
    shrink_block_m=16,
    block_k=16,
    k_per_split=32,
    shrink_warps=4,
    shrink_stages=1,
    expand_block_m=16,
    block_n=16,
    expand_warps=4,
)
K, N, WIDE = 40, 24, 56  # y is columns [16, 40) of a [T, 56] tensor


def _adapters(num_slots: int, rank: int, dtype: torch.dtype, gen: torch.Generator):
    """a_stack [S, R, K], b_stack [S, N, R]; slot 0 has true rank R // 2 (the rest zero padding) and, with
    S = 3, slot 2 holds no adapter (all zeros)."""
    a = torch.randn(num_slots, rank, K, generator=gen) * K**-0.5
    b = torch.randn(num_slots, N, rank, generator=gen) * rank**-0.5
    a[0, rank // 2 :] = 0
    b[0, :, rank // 2 :] = 0
    if num_slots == 3:
        a[2] = 0
        b[2] = 0
    return a.to(dtype), b.to(dtype)


def _slots(num_tokens: int, num_slots: int, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """-1 and every slot, shuffled (every value appears once T >= S + 1)."""
    values = torch.arange(num_tokens) % (num_slots + 1) - 1
    return values[torch.randperm(num_tokens, generator=gen)].to(dtype)


def _expected(y0, x, a, b, slots) -> torch.Tensor:
    """The update computed row by row in float64, rounded once to y's dtype: independent of both paths."""
    out = y0.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            delta = (x[t].double() @ a[s].double().T) @ b[s].double().T
            out[t] = (y0[t].double() + delta).to(y0.dtype)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [0, 1, 5, 33])
@pytest.mark.parametrize("num_slots", [1, 3])
@pytest.mark.parametrize("rank", [4, 16])
def test_add_lora_matches_reference(dtype, num_tokens, num_slots, rank):
    gen = torch.Generator().manual_seed(num_tokens * 100 + num_slots * 10 + rank)
    x = torch.randn(num_tokens, K, generator=gen).to(dtype)
    a, b = _adapters(num_slots, rank, dtype, gen)
    slots = _slots(num_tokens, num_slots, gen, torch.int32 if rank == 4 else torch.int64)
    wide = torch.randn(num_tokens, WIDE, generator=gen).to(dtype)
    before = wide.clone()
    y = wide[:, 16 : 16 + N]
    assert y.stride(0) == WIDE

    add_lora(y, x, a, b, slots, tiles=SMALL)

    ref_wide = before.clone()
    add_lora_reference(ref_wide[:, 16 : 16 + N], x, a, b, slots)
    expected = _expected(before[:, 16 : 16 + N], x, a, b, slots)
    # the columns outside the slice and the rows of slot -1 keep their bits
    assert torch.equal(wide[:, :16], before[:, :16]) and torch.equal(wide[:, 16 + N :], before[:, 16 + N :])
    untouched = slots == -1
    assert torch.equal(y[untouched], before[:, 16 : 16 + N][untouched])
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(y, ref_wide[:, 16 : 16 + N], **tol)
    torch.testing.assert_close(y, expected, **tol)
    torch.testing.assert_close(ref_wide[:, 16 : 16 + N], expected, **tol)
    if dtype == torch.bfloat16 and num_tokens:
        # rounded once, to nearest: at most a rare one-step flip vs float64 (truncation misses half the time)
        steps = (y.float() - expected.float()).abs() / expected.float().abs().clamp_min(1e-30)
        assert (y != expected).float().mean() <= 0.02 and (steps <= 2**-7).all()
    if num_tokens >= num_slots + 1:  # the test can fail: every non-empty adapter changed its rows
        changed = (y != before[:, 16 : 16 + N]).any(1)
        live = (slots >= 0) & (slots != 2)
        assert changed[live].all() and not changed[~live].any()


MIXED = LoraTiles(32, 32, 64, 4, 1, 16, 32, 4)  # one K split; expand row blocks unlike the shrink's


@pytest.mark.parametrize(
    "num_tokens,tiles",
    [(3, None), (70, None), (37, MIXED)],  # decode tiles; prefill tiles (64-row blocks); mixed
)
def test_add_lora_other_tiles(num_tokens, tiles):
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, K, generator=gen)
    a, b = _adapters(2, 8, torch.float32, gen)
    slots = _slots(num_tokens, 2, gen, torch.int64)
    y = torch.randn(num_tokens, N, generator=gen)
    ref = y.clone()
    add_lora(y, x, a, b, slots, tiles=tiles)
    add_lora_reference(ref, x, a, b, slots)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)


def test_reference_is_the_merged_weights_product():
    """For each adapter: x @ (W + B A).T equals x @ W.T followed by add_lora (reference and kernel)."""
    gen = torch.Generator().manual_seed(0)
    num_slots, rank, num_tokens = 3, 8, 12
    a = torch.randn(num_slots, rank, K, generator=gen) * 0.3
    b = torch.randn(num_slots, N, rank, generator=gen) * 0.3
    w = torch.randn(N, K, generator=gen) * K**-0.5
    x = torch.randn(num_tokens, K, generator=gen)
    slots = torch.tensor([2, 0, -1, 1, 1, 0, 2, -1, 0, 1, 2, 2], dtype=torch.int32)
    for add in (add_lora_reference, add_lora):
        y = x @ w.T
        add(y, x, a, b, slots)
        for t, s in enumerate(slots.tolist()):
            merged = w + (b[s] @ a[s]) if s >= 0 else w
            torch.testing.assert_close(y[t], x[t] @ merged.T, atol=1e-5, rtol=1e-5)


def test_lora_tiles_cover_k():
    for num_tokens in (1, 8, 64, 512, 2048):
        for k in (2048, 2560, 10240, 40):
            cfg = lora_tiles(num_tokens, 2048, k)
            splits = -(-k // cfg.k_per_split)
            assert cfg.k_per_split % cfg.block_k == 0 and (splits - 1) * cfg.k_per_split < k
            assert cfg.shrink_block_m == cfg.expand_block_m == (16 if num_tokens <= 64 else 64)
