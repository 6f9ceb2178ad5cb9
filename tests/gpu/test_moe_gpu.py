"""The compiled MoE kernels on CUDA at 26B-A4B shapes (128 experts, top-8, H=2816, I=704; bf16) against
the torch references, and the whole MoE block (router + experts) captured in a CUDA graph."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from g4serve.config import PRESETS
from g4serve.kernels import fused_moe as fused_moe_module
from g4serve.kernels.fused_moe import (
    ALIGN_KERNEL_MAX_ASSIGNMENTS,
    CHUNK_TOKENS,
    fused_moe,
    fused_moe_reference,
    moe_align,
    moe_align_kernel,
    moe_align_parallel,
    moe_tiles,
)
from g4serve.kernels.moe_route import moe_route, moe_route_reference
from g4serve.layers.moe import MoEExperts, MoERouter

pytestmark = pytest.mark.gpu

_TEXT = PRESETS["26b-a4b"]().text
E, TOP_K, H, INTER = _TEXT.num_experts, _TEXT.top_k_experts, _TEXT.hidden_size, _TEXT.moe_intermediate_size
ACT = _TEXT.hidden_activation
# 1 / 8 / 64: decode (BLOCK_M 16, one-program align); 300: BLOCK_M 32; 1024: BLOCK_M 64 and the torch
# align; 5000: two token chunks.
TOKENS = [1, 8, 64, 300, 1024, CHUNK_TOKENS + 904]


@pytest.fixture(scope="module")
def expert_weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator("cuda").manual_seed(0)
    gate_up = torch.randn(E, 2 * INTER, H, device="cuda", generator=gen).mul_(H**-0.5).bfloat16()
    down = torch.randn(E, H, INTER, device="cuda", generator=gen).mul_(INTER**-0.5).bfloat16()
    return {"gate_up": gate_up, "down": down}


def _routing(num_tokens: int, gen: torch.Generator, skew: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(num_tokens, E, device="cuda", generator=gen)
    if skew:  # every token's first expert is expert 5: one expert's run spans many blocks
        logits[:, 5] += 6.0
    return moe_route_reference(logits, torch.ones(E, device="cuda"), TOP_K)


@pytest.mark.parametrize("num_tokens", TOKENS)
def test_fused_moe_vs_fp32_reference(expert_weights, num_tokens):
    gen = torch.Generator("cuda").manual_seed(num_tokens)
    weights, experts = _routing(num_tokens, gen, skew=num_tokens == 300)
    x = torch.randn(num_tokens, H, device="cuda", generator=gen).bfloat16()
    gate_up, down = expert_weights["gate_up"], expert_weights["down"]
    out = fused_moe(x, gate_up, down, experts, weights, ACT)
    ref32 = fused_moe_reference(x.float(), gate_up.float(), down.float(), experts, weights, ACT)
    ref16 = fused_moe_reference(x, gate_up, down, experts, weights, ACT)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref32, atol=2e-2, rtol=2e-2)
    # no worse than the bf16 loop (which also accumulates the k experts in bf16)
    err, err16 = (out.float() - ref32).abs().max().item(), (ref16.float() - ref32).abs().max().item()
    assert err <= 1.25 * err16 + 1e-3, (err, err16)
    # deterministic: the same bits on a second call
    assert torch.equal(fused_moe(x, gate_up, down, experts, weights, ACT), out)


@pytest.mark.parametrize("num_tokens", [1024, 2048])
@pytest.mark.parametrize("group_m", [1, 4, 8, 16])
def test_tile_order_changes_no_bit(expert_weights, num_tokens, group_m):
    """Prefill tiles in the grouped order (``GemmTiles.group_m``, a 1-D grid) give the 2-D grid's bits."""
    gen = torch.Generator("cuda").manual_seed(num_tokens + group_m)
    weights, experts = _routing(num_tokens, gen, skew=group_m == 4)
    x = torch.randn(num_tokens, H, device="cuda", generator=gen).bfloat16()
    tiles = moe_tiles(num_tokens * TOP_K, E)
    ordered, base = tiles.ordered(group_m), tiles.ordered(0)
    gate_up, down = expert_weights["gate_up"], expert_weights["down"]
    out = fused_moe(x, gate_up, down, experts, weights, ACT, tiles=ordered)
    assert torch.equal(out, fused_moe(x, gate_up, down, experts, weights, ACT, tiles=base))


@pytest.mark.parametrize("num_tokens", [1, 8, 64, 300, 1024, 4096])
def test_moe_align_kernel_matches_torch(num_tokens):
    gen = torch.Generator("cuda").manual_seed(num_tokens)
    _, experts = _routing(num_tokens, gen, skew=num_tokens == 64)
    block_m = moe_tiles(num_tokens * TOP_K, E).block_m
    sorted_ids, block_expert = moe_align(experts, E, block_m)
    for align in (moe_align_kernel, moe_align_parallel):
        k_ids, k_blocks = align(experts, E, block_m)
        assert torch.equal(k_ids, sorted_ids) and torch.equal(k_blocks, block_expert), align.__name__
    n = experts.numel()
    real = sorted_ids[sorted_ids != n]
    assert torch.equal(real.sort().values, torch.arange(n, device="cuda", dtype=torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 64, 1024])
def test_moe_route_vs_reference(dtype, num_tokens):
    gen = torch.Generator("cuda").manual_seed(num_tokens)
    # distinct logits, exact in bf16 (at a tie the kernel takes the lowest id, torch.topk any)
    logits = torch.stack([torch.randperm(E, device="cuda", generator=gen) for _ in range(num_tokens)])
    logits = (logits.float() / 32 - 2.0).to(dtype)
    scale = (torch.rand(E, device="cuda", generator=gen) + 0.5).to(dtype)
    weights, experts = moe_route(logits, scale, TOP_K)
    ref_weights, ref_experts = moe_route_reference(logits, scale, TOP_K)
    assert torch.equal(experts, ref_experts)
    torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-5)


def _moe_block(expert_weights) -> tuple[MoERouter, MoEExperts]:
    gen = torch.Generator("cuda").manual_seed(1)
    router = MoERouter(H, E, TOP_K, 1e-6).to("cuda", torch.bfloat16)
    with torch.no_grad():
        router.proj.weight.copy_(torch.randn(E, H, device="cuda", generator=gen) * H**-0.5)
        router.scale.copy_(torch.rand(H, device="cuda", generator=gen) + 0.5)
        router.per_expert_scale.copy_(torch.rand(E, device="cuda", generator=gen) + 0.5)
    with torch.device("meta"):
        experts = MoEExperts(E, H, INTER, ACT)
    experts.gate_up_proj = nn.Parameter(expert_weights["gate_up"], requires_grad=False)
    experts.down_proj = nn.Parameter(expert_weights["down"], requires_grad=False)
    return router, experts


# 1: the one-program align inside the graph; 64 and 1024: the three-launch align; 1024 "sort": torch's sort
@pytest.mark.parametrize(
    "num_tokens,align", [(1, "parallel"), (64, "parallel"), (1024, "parallel"), (1024, "sort")]
)
@torch.no_grad()
def test_moe_block_cuda_graph(expert_weights, num_tokens, align, monkeypatch):
    assert (num_tokens * TOP_K > ALIGN_KERNEL_MAX_ASSIGNMENTS) == (num_tokens > 1)
    monkeypatch.setattr(fused_moe_module, "PREFILL_ALIGN", align)
    router, experts = _moe_block(expert_weights)
    gen = torch.Generator("cuda").manual_seed(num_tokens)
    static_x = torch.randn(num_tokens, H, device="cuda", generator=gen).bfloat16()

    def block() -> torch.Tensor:
        weights, ids = router(static_x)
        return experts(static_x, ids, weights)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile the kernels and warm the allocator outside the capture
        block()
        block()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = block()

    previous = None
    for seed in (10, 11):
        static_x.copy_(torch.randn(num_tokens, H, device="cuda", generator=gen.manual_seed(seed)).bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        eager = block()
        assert torch.equal(static_out, eager)  # new routing, same bits as eager
        weights, ids = router(static_x)
        ref = fused_moe_reference(
            static_x.float(), experts.gate_up_proj.float(), experts.down_proj.float(), ids, weights, ACT
        )
        torch.testing.assert_close(static_out.float(), ref, atol=2e-2, rtol=2e-2)
        if previous is not None:
            assert not torch.equal(previous, static_out)
        previous = static_out.clone()


@pytest.mark.parametrize("num_tokens", [1, 8, 64])
def test_the_next_norm_sums_the_expert_outputs(expert_weights, num_tokens):
    """``fused_moe(sum_slots=False)`` then the post-feed-forward pass summing the k rows (fp32, in slot
    order, rounded once): bit for bit the pass over that sum made in torch, and the sum within a bf16 step
    of the experts' own (torch's reduction adds the slots in another order)."""
    from g4serve.kernels.rms_norm import fused_rms_norm

    gen = torch.Generator("cuda").manual_seed(num_tokens)
    x = torch.randn(num_tokens, H, device="cuda", generator=gen).bfloat16()
    logits = torch.randn(num_tokens, E, device="cuda", generator=gen)
    weights, experts = moe_route(logits, torch.ones(E, device="cuda"), TOP_K)
    args = (x, expert_weights["gate_up"], expert_weights["down"], experts, weights, ACT)
    summed, slots = fused_moe(*args), fused_moe(*args, sum_slots=False)
    assert slots.shape == (num_tokens, TOP_K, H)
    in_order = slots[:, 0].float()
    for j in range(1, TOP_K):
        in_order = in_order + slots[:, j].float()
    in_order = in_order.bfloat16()
    assert ((in_order.float() - summed.float()).abs() <= summed.float().abs() * 2**-7 + 1e-6).all()
    dense, res = (torch.randn(num_tokens, H, device="cuda", generator=gen).bfloat16() for _ in range(2))
    w, wa, wb, w2 = (torch.rand(H, device="cuda", generator=gen).bfloat16() for _ in range(4))
    kw = dict(residual=res, next_weight=w2)
    want = fused_rms_norm(dense, w, 1e-6, **kw, branches=(in_order, wa, wb))
    got = fused_rms_norm(dense, w, 1e-6, **kw, branches=(slots, wa, wb))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
