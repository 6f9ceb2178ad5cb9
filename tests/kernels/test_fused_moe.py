"""The MoE kernels (alignment, grouped expert GEMMs, routing) against their torch references, in Triton's
interpreter on CPU tensors, at tiny shapes: fp32 to rounding noise, bf16 to a bf16 step or two."""

from __future__ import annotations

import pytest
import torch
import triton.language as tl

from g4serve.kernels import fused_moe as fused_moe_module
from g4serve.kernels._launch import DualKernel
from g4serve.kernels.fused_moe import (
    GemmTiles,
    MoETiles,
    QuantExpertWeights,
    fused_moe,
    fused_moe_reference,
    moe_align,
    moe_align_kernel,
    moe_align_parallel,
    moe_tiles,
)
from g4serve.kernels.moe_route import moe_route, moe_route_reference
from g4serve.layers.moe import MoEExperts, MoERouter

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
# Small tiles so that the interpreter sees several N tiles, a ragged K (I=48 over BLOCK_K=32) and experts
# spanning more than one block.
SMALL = MoETiles(16, GemmTiles(16, 32, 4, 2), GemmTiles(32, 32, 4, 2))


def _routing(num_tokens: int, num_experts: int, top_k: int, gen: torch.Generator, skew: str | None = None):
    """(experts [T, k] int64, weights [T, k] fp32): k distinct experts per token.

    skew "one": every token's first expert is expert 1 (one expert takes all tokens);
    "unused": expert 0 and the last expert never appear."""
    scores = torch.rand(num_tokens, num_experts, generator=gen)
    if skew == "one":
        scores[:, 1] = 2.0
    elif skew == "unused":
        scores[:, 0] = scores[:, -1] = -1.0
    weights, experts = torch.topk(scores, top_k, dim=-1)
    return experts, (weights / weights.sum(-1, keepdim=True)).float()


def _weights(num_experts: int, hidden: int, inter: int, dtype: torch.dtype, gen: torch.Generator):
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    down = torch.randn(num_experts, hidden, inter, generator=gen) * inter**-0.5
    return gate_up.to(dtype), down.to(dtype)


def _check_alignment(experts: torch.Tensor, num_experts: int, block_m: int, sorted_ids, block_expert) -> None:
    n = experts.numel()
    flat = experts.reshape(-1)
    num_blocks = -(-(n + min(num_experts, n) * (block_m - 1)) // block_m)
    assert sorted_ids.shape == (num_blocks * block_m,) and block_expert.shape == (num_blocks,)
    assert sorted_ids.dtype == block_expert.dtype == torch.int32
    real = sorted_ids[sorted_ids != n]
    # every assignment exactly once, every other slot the sentinel
    assert torch.equal(real.sort().values, torch.arange(n, dtype=torch.int32))
    assert ((sorted_ids >= 0) & (sorted_ids <= n)).all()
    blocks = sorted_ids.view(num_blocks, block_m)
    used = block_expert >= 0
    # the used blocks come first, experts ascending; each holds one expert's assignments (token order)
    assert not used[used.long().cumsum(0) < torch.arange(1, num_blocks + 1)].any()
    assert (block_expert[used].diff() >= 0).all()
    for b in range(num_blocks):
        ids = blocks[b][blocks[b] != n].long()
        if not used[b]:
            assert ids.numel() == 0
            continue
        assert ids.numel() > 0 and (flat[ids] == block_expert[b]).all()
        assert (ids.diff() > 0).all()
    # each expert's run: ceil(count / block_m) blocks
    counts = torch.bincount(flat, minlength=num_experts)
    runs = torch.bincount(block_expert[used].long(), minlength=num_experts)
    assert torch.equal(runs, (counts + block_m - 1) // block_m)


@pytest.mark.parametrize(
    "num_tokens,num_experts,top_k,block_m,skew",
    [
        (1, 4, 2, 16, None),
        (5, 8, 2, 16, None),
        (17, 8, 2, 16, "one"),
        (17, 8, 2, 16, "unused"),
        (33, 8, 2, 32, None),
        (40, 128, 8, 16, None),
        (3, 4, 1, 16, None),
    ],
)
def test_moe_align_invariants(num_tokens, num_experts, top_k, block_m, skew):
    gen = torch.Generator().manual_seed(num_tokens)
    experts, _ = _routing(num_tokens, num_experts, top_k, gen, skew)
    sorted_ids, block_expert = moe_align(experts, num_experts, block_m)
    _check_alignment(experts, num_experts, block_m, sorted_ids, block_expert)
    # the one-program kernel: the same alignment, bit for bit (int32 ids too)
    for ids in (experts, experts.int()):
        k_ids, k_blocks = moe_align_kernel(ids, num_experts, block_m)
        assert torch.equal(k_ids, sorted_ids) and torch.equal(k_blocks, block_expert)


@pytest.mark.parametrize(
    "num_tokens,num_experts,top_k,block_m",
    [(1, 8, 2, 16), (37, 8, 2, 16), (300, 16, 4, 64), (1000, 128, 8, 128), (513, 6, 2, 32)],
)
@pytest.mark.parametrize("skew", [None, "one", "unused"])
def test_moe_align_parallel_equals_the_sort(num_tokens, num_experts, top_k, block_m, skew):
    """The three-launch alignment for prefill sizes gives ``moe_align``'s outputs exactly: the same slots in
    the same token order, the same padding and block owners, across chunk boundaries (1,000 x 8 assignments
    span 63 chunks of 128), with experts left unused or all traffic on one."""
    gen = torch.Generator().manual_seed(num_tokens + num_experts)
    experts, _ = _routing(num_tokens, num_experts, top_k, gen, skew)
    want = moe_align(experts, num_experts, block_m)
    got = moe_align_parallel(experts, num_experts, block_m)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    empty = moe_align_parallel(experts[:0], num_experts, block_m)
    assert empty[0].numel() == 0 and empty[1].numel() == 0


def test_moe_align_skewed_counts():
    # all 17 tokens pick expert 1 -> its run is 2 blocks (32 slots, 15 padding); experts 0 and 3 are unused
    experts = torch.tensor([[1, 2]] * 17)
    for align in (moe_align, moe_align_kernel):
        sorted_ids, block_expert = align(experts, 4, 16)
        assert block_expert.tolist()[:4] == [1, 1, 2, 2] and (block_expert[4:] == -1).all()
        assert sorted_ids[:17].tolist() == list(range(0, 34, 2)) and (sorted_ids[17:32] == 34).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 5, 17])
@pytest.mark.parametrize(
    "num_experts,hidden,inter,activation,skew",
    [
        (4, 32, 16, "gelu_pytorch_tanh", None),
        (8, 64, 48, "gelu_pytorch_tanh", "unused"),
        (8, 32, 48, "silu", "one"),
    ],
)
def test_fused_moe_vs_reference(dtype, num_tokens, num_experts, hidden, inter, activation, skew):
    gen = torch.Generator().manual_seed(num_tokens * 31 + hidden)
    experts, weights = _routing(num_tokens, num_experts, 2, gen, skew)
    gate_up, down = _weights(num_experts, hidden, inter, dtype, gen)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    out = fused_moe(x, gate_up, down, experts, weights, activation, tiles=SMALL)
    ref = fused_moe_reference(x, gate_up, down, experts, weights, activation)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    if dtype == torch.bfloat16:
        # Rounded where the model rounds (round-to-nearest-even), and with k=2 the reference's bf16
        # index_add rounds the pair's sum once, as the fp32 sum does: equal bits except where a different
        # fp32 summation order flips an intermediate rounding.
        assert (out == ref).float().mean() >= 0.98


def test_unsummed_expert_outputs_sum_to_the_summed_ones(monkeypatch):
    """``sum_slots=False``: [T, k, H], each token's k weighted expert outputs, whose fp32 sum is the default
    output bit for bit; past ``CHUNK_TOKENS`` tokens the output is summed anyway."""
    gen = torch.Generator().manual_seed(4)
    experts, weights = _routing(7, 8, 3, gen)
    gate_up, down = _weights(8, 64, 48, torch.bfloat16, gen)
    x = torch.randn(7, 64, generator=gen).bfloat16()
    summed = fused_moe(x, gate_up, down, experts, weights, "gelu_pytorch_tanh", tiles=SMALL)
    slots = fused_moe(x, gate_up, down, experts, weights, "gelu_pytorch_tanh", tiles=SMALL, sum_slots=False)
    assert slots.shape == (7, 3, 64) and slots.dtype == torch.bfloat16
    assert torch.equal(slots.sum(1, dtype=torch.float32).bfloat16(), summed)
    empty = fused_moe(x[:0], gate_up, down, experts[:0], weights[:0], "gelu_pytorch_tanh", sum_slots=False)
    assert empty.shape == (0, 3, 64)
    monkeypatch.setattr(fused_moe_module, "CHUNK_TOKENS", 4)
    chunked = fused_moe(x, gate_up, down, experts, weights, "gelu_pytorch_tanh", tiles=SMALL, sum_slots=False)
    assert torch.equal(chunked, summed)


def test_fused_moe_default_tiles_torch_align_and_chunks(monkeypatch):
    """The H100 tiles (BLOCK_K past H, BLOCK_N past I: masked), the torch alignment, and token chunks."""
    gen = torch.Generator().manual_seed(3)
    experts, weights = _routing(11, 8, 2, gen)
    gate_up, down = _weights(8, 64, 48, torch.float32, gen)
    x = torch.randn(11, 64, generator=gen)
    ref = fused_moe_reference(x, gate_up, down, experts, weights, "gelu_pytorch_tanh")
    assert moe_tiles(22, 8).block_m == 16
    out = fused_moe(x, gate_up, down, experts, weights, "gelu_pytorch_tanh")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(fused_moe_module, "CHUNK_TOKENS", 4)
    out = fused_moe(x, gate_up, down, experts, weights, "gelu_pytorch_tanh", tiles=SMALL, align_kernel_max=0)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(fused_moe_module, "PREFILL_ALIGN", "parallel")  # G4SERVE_MOE_ALIGN=parallel
    out = fused_moe(x, gate_up, down, experts, weights, "gelu_pytorch_tanh", tiles=SMALL, align_kernel_max=0)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_fused_moe_prefill_tiles():
    """The tall tiles of prefill-sized chunks (past 64 rows per expert: 128 token rows per program, a
    256-wide down GEMM; N and K masked at these small widths) give the reference's result. Quantized experts
    and fp32 activations keep the 64-row tiles (fp32 tall tiles need 288 KB of shared memory: an H200 failed
    to launch them)."""
    tall = moe_tiles(8 * 65, 8)
    assert (tall.block_m, tall.down.block_n) == (128, 256)
    assert moe_tiles(8 * 65, 8, quantized=True).block_m == 64
    assert moe_tiles(8 * 65, 8, itemsize=4).block_m == 64
    gen = torch.Generator().manual_seed(5)
    experts, weights = _routing(270, 8, 2, gen)  # 540 assignments: 67.5 rows per expert
    gate_up, down = _weights(8, 64, 48, torch.bfloat16, gen)
    x = torch.randn(270, 64, generator=gen).to(torch.bfloat16)
    out = fused_moe(x, gate_up, down, experts, weights, "silu")
    ref = fused_moe_reference(x, gate_up, down, experts, weights, "silu")
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16])


@pytest.mark.parametrize("setting", [None, 0, 3])
def test_prefill_tile_orders(monkeypatch, setting):
    """The tile order each prefill tile takes (``GemmTiles.group_m``): the tall bf16 tiles gate/up 4 blocks at
    a time and down 2; the 64-row tiles (32-64 rows per expert, quantized experts, fp32) 4 in both GEMMs; the
    decode tiles (at most 32 rows per expert) the 2-D grid. G4SERVE_MOE_GROUP_M (``PREFILL_GROUP_M``) sets
    every prefill tile's, the decode tiles' never."""
    monkeypatch.setattr(fused_moe_module, "PREFILL_GROUP_M", setting)

    def orders(tiles):
        return tiles.block_m, tiles.gate_up.group_m, tiles.down.group_m

    tall, rows64 = (
        (4, 2) if setting is None else (setting, setting),
        (4, 4) if setting is None else (setting,) * 2,
    )
    assert orders(moe_tiles(128 * 65, 128)) == (128, *tall)
    assert orders(moe_tiles(128 * 64, 128)) == (64, *rows64)
    assert orders(moe_tiles(128 * 65, 128, quantized=True)) == (64, *rows64)
    assert orders(moe_tiles(128 * 65, 128, itemsize=4)) == (64, *rows64)
    assert orders(moe_tiles(128 * 32, 128)) == (32, 0, 0)
    assert orders(moe_tiles(128 * 8, 128, quantized=True)) == (16, 0, 0)


def _tile_map_fn(Out, num_n, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    pid_m, pid_n = fused_moe_module._grouped_tile(pid, tl.num_programs(0), num_n, GROUP_M)
    tl.store(Out + 2 * pid, pid_m)
    tl.store(Out + 2 * pid + 1, pid_n)


_tile_map = DualKernel(_tile_map_fn)


@pytest.mark.parametrize("num_m,num_n,group_m", [(13, 3, 5), (13, 3, 1), (4, 6, 4), (3, 11, 8), (7, 1, 2)])
def test_grouped_tile_order_covers_every_tile_once(num_m, num_n, group_m):
    """``GemmTiles.group_m``'s order: every (block, N tile) exactly once; within a group of ``group_m`` blocks
    (the last one ragged) the block varies fastest, and a group's N tiles all come before the next group."""
    out = torch.full((num_m * num_n, 2), -1, dtype=torch.int32)
    _tile_map[out.device][(num_m * num_n,)](out, num_n, GROUP_M=group_m)
    pairs = [tuple(p) for p in out.tolist()]
    assert sorted(pairs) == [(m, n) for m in range(num_m) for n in range(num_n)]
    expected = [
        (m, n)
        for first in range(0, num_m, group_m)
        for n in range(num_n)
        for m in range(first, min(first + group_m, num_m))
    ]
    assert pairs == expected


@pytest.mark.parametrize("group_m", [1, 3, 5])
def test_fused_moe_tile_order_changes_no_bit(group_m):
    """The grouped order (a 1-D grid) computes every tile as the 2-D grid does: the same bits, at several
    blocks per expert, a ragged last group and ragged N and K tiles."""
    gen = torch.Generator().manual_seed(group_m)
    experts, weights = _routing(40, 8, 2, gen, "one")
    gate_up, down = _weights(8, 64, 48, torch.bfloat16, gen)
    x = torch.randn(40, 64, generator=gen).to(torch.bfloat16)
    ordered = SMALL.ordered(group_m)
    assert (ordered.gate_up.group_m, ordered.down.group_m, ordered.block_m) == (group_m, group_m, 16)
    out = fused_moe(x, gate_up, down, experts, weights, "gelu_pytorch_tanh", tiles=ordered)
    base = fused_moe(x, gate_up, down, experts, weights, "gelu_pytorch_tanh", tiles=SMALL)
    assert torch.equal(out, base)
    ref = fused_moe_reference(x, gate_up, down, experts, weights, "gelu_pytorch_tanh")
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16])


def test_fused_moe_routing_weights_and_empty_batch():
    gen = torch.Generator().manual_seed(4)
    experts, weights = _routing(5, 4, 2, gen)
    gate_up, down = _weights(4, 32, 16, torch.float32, gen)
    x = torch.randn(5, 32, generator=gen)
    # zero weight on slot 1: only slot 0's expert counts
    only_first = weights * torch.tensor([1.0, 0.0])
    out = fused_moe(x, gate_up, down, experts, only_first, "silu", tiles=SMALL)
    ref = fused_moe_reference(x, gate_up, down, experts[:, :1], only_first[:, :1], "silu")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    empty = fused_moe(x[:0], gate_up, down, experts[:0], weights[:0], "silu")
    assert empty.shape == (0, 32)


def _distinct_logits(num_tokens: int, num_experts: int, gen: torch.Generator) -> torch.Tensor:
    """Logits without ties (exact in bf16): at a tie the kernel takes the lowest id, torch.topk any."""
    rows = [torch.randperm(num_experts, generator=gen).float() / 16 for _ in range(num_tokens)]
    return torch.stack(rows) - 4.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 8, 2), (5, 128, 8), (3, 4, 4)])
def test_moe_route_vs_reference(dtype, num_tokens, num_experts, top_k):
    gen = torch.Generator().manual_seed(num_experts)
    logits = _distinct_logits(num_tokens, num_experts, gen).to(dtype)
    scale = (torch.rand(num_experts, generator=gen) + 0.5).to(dtype)
    weights, experts = moe_route(logits, scale, top_k)
    ref_weights, ref_experts = moe_route_reference(logits, scale, top_k)
    assert weights.dtype == ref_weights.dtype == torch.float32 and experts.dtype == ref_experts.dtype
    assert torch.equal(experts, ref_experts)
    torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-6)


def test_moe_layers_on_cpu_are_the_reference():
    """CPU modules keep the torch path (bit-exact with transformers): the same values as the references."""
    gen = torch.Generator().manual_seed(5)
    router = MoERouter(32, 8, 2, 1e-6)
    experts_layer = MoEExperts(8, 32, 16, "gelu_pytorch_tanh")
    with torch.no_grad():
        for p in (*router.parameters(), *experts_layer.parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        x = torch.randn(6, 32, generator=gen)
        weights, experts = router(x)
        out = experts_layer(x, experts, weights)
    ref = fused_moe_reference(
        x,
        experts_layer.gate_up_proj.detach(),
        experts_layer.down_proj.detach(),
        experts,
        weights,
        "gelu_pytorch_tanh",
    )
    assert torch.equal(out, ref)


def test_the_tile_order_setting_refuses_what_is_no_count_with_the_variables_name(monkeypatch):
    """``G4SERVE_MOE_GROUP_M``: unset or empty leaves the measured orders, a count >= 0 sets every prefill
    GEMM's; anything else is refused naming the variable (a negative one would launch the 1-D grid the 2-D
    way)."""
    parse = fused_moe_module._group_m_setting
    monkeypatch.delenv("G4SERVE_MOE_GROUP_M", raising=False)
    assert parse() is None
    for value, expected in (("", None), ("0", 0), ("8", 8)):
        monkeypatch.setenv("G4SERVE_MOE_GROUP_M", value)
        assert parse() == expected
    for bad in ("-1", "four", "2.5"):
        monkeypatch.setenv("G4SERVE_MOE_GROUP_M", bad)
        with pytest.raises(ValueError, match="G4SERVE_MOE_GROUP_M"):
            parse()


@pytest.mark.parametrize("tokens", [2048, 4096])
@pytest.mark.parametrize("group_m", [None, 0])
def test_prefill_gemms_compile_for_sm90(monkeypatch, tokens, group_m):
    """The prefill tiles at 26B-A4B's shapes (E = 128, H = 2,816, I = 704, top-8), bf16, in their measured
    orders (None) and the 2-D grid's (``G4SERVE_MOE_GROUP_M=0``): the gate/up and down launches compile to
    sm_90 cubins whose pipelines fit an H100 SM's 227 KB of shared memory."""
    from test_kv_fp8_sm90_compile import _compile, _launches

    monkeypatch.setattr(fused_moe_module, "PREFILL_GROUP_M", group_m)
    e, h, i, t, k = 128, 2816, 704, tokens, 8
    tiles = moe_tiles(t * k, e)
    expected = (4, 2) if group_m is None else (group_m, group_m)
    assert (tiles.block_m, tiles.gate_up.group_m, tiles.down.group_m) == (128, *expected)
    blocks = -(-(t * k + e * (tiles.block_m - 1)) // tiles.block_m)
    meta = dict(dtype=torch.bfloat16, device="meta")
    sorted_ids = torch.empty(blocks * tiles.block_m, dtype=torch.int32, device="meta")
    block_expert = torch.empty(blocks, dtype=torch.int32, device="meta")
    x, act = torch.empty(t, h, **meta), torch.empty(t * k, i, **meta)
    gate_up, down = torch.empty(e, 2 * i, h, **meta), torch.empty(e, h, i, **meta)
    per_slot, weights = torch.empty(t * k, h, **meta), torch.empty(t * k, device="meta")

    def calls():
        fused_moe_module._grouped_gemm(
            x, gate_up, act, i, sorted_ids, block_expert, tiles.block_m, tiles.gate_up, a_row_div=k,
            activation="gelu_pytorch_tanh",
        )  # fmt: skip
        fused_moe_module._grouped_gemm(
            act, down, per_slot, h, sorted_ids, block_expert, tiles.block_m, tiles.down, a_row_div=1,
            route_weights=weights,
        )  # fmt: skip

    launches = _launches(monkeypatch, fused_moe_module, "_moe_gemm", calls)
    assert [kw["GROUP_M"] for _, _, kw in launches] == list(expected)
    for fn, args, kwargs in launches:
        assert _compile(fn, args, kwargs).metadata.shared <= 227 * 1024


@pytest.mark.parametrize("tokens", [30, 4096])
@pytest.mark.parametrize("rows", [True, False])
def test_w8a8_gemms_compile_for_sm90(monkeypatch, tokens, rows):
    """FP8-Dynamic experts (per-channel scales) on the FP8 tensor cores at 26B-A4B's shapes, with the
    activations' scales per token (summed across K, scaled once) and per 128-column group: both launches
    compile to sm_90 cubins within an H100 SM's shared memory, the per-token one specialised as such."""
    from test_kv_fp8_sm90_compile import _compile, _launches

    e, h, i, t, k = 128, 2816, 704, tokens, 8
    tiles = moe_tiles(t * k, e, quantized=True)
    blocks = -(-(t * k + e * (tiles.block_m - 1)) // tiles.block_m)
    fp8 = dict(dtype=torch.float8_e4m3fn, device="meta")
    sorted_ids = torch.empty(blocks * tiles.block_m, dtype=torch.int32, device="meta")
    block_expert = torch.empty(blocks, dtype=torch.int32, device="meta")

    def experts(n: int, kdim: int, parts: int) -> QuantExpertWeights:
        scale = torch.empty(e, n, 1, device="meta")
        return QuantExpertWeights(torch.empty(e, n, kdim, **fp8), scale, (1, kdim), kdim, parts=parts)

    def scales(m: int, kdim: int) -> torch.Tensor:
        return torch.empty(m, 1 if rows else -(-kdim // 128), device="meta")

    x, act = torch.empty(t, h, **fp8), torch.empty(t * k, i, **fp8)
    act_out = torch.empty(t * k, i, dtype=torch.bfloat16, device="meta")
    per_slot = torch.empty(t * k, h, dtype=torch.bfloat16, device="meta")
    weights = torch.empty(t * k, device="meta")

    def calls():
        fused_moe_module._grouped_gemm(
            x, experts(2 * i, h, 2), act_out, i, sorted_ids, block_expert, tiles.block_m, tiles.gate_up,
            a_row_div=k, activation="gelu_pytorch_tanh", a_scales=scales(t, h),
        )  # fmt: skip
        fused_moe_module._grouped_gemm(
            act, experts(h, i, 1), per_slot, h, sorted_ids, block_expert, tiles.block_m, tiles.down,
            a_row_div=1, route_weights=weights, a_scales=scales(t * k, i),
        )  # fmt: skip

    launches = _launches(monkeypatch, fused_moe_module, "_moe_gemm", calls)
    assert [(kw["W8A8"], kw["W8A8_ROWS"]) for _, _, kw in launches] == [(True, rows)] * 2
    for fn, args, kwargs in launches:
        assert _compile(fn, args, kwargs).metadata.shared <= 227 * 1024
