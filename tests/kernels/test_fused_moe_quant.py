"""The fused MoE GEMMs with quantized expert weights (FP8 e4m3 per tensor / channel / block, packed int4 in
groups of 8-128 with and without zero points) against the reference (each hit expert dequantized to the
activation dtype by ``quant_matmul.dequantize_reference``, then the expert loop), in Triton's interpreter:
several experts, top-2, 17 tokens (not a multiple of BLOCK_M), ragged K, blocks that do not tile a part's
rows; and ``MoEExperts`` holding quantized weights."""

from __future__ import annotations

import pytest
import torch

from g4serve.kernels import fused_moe as fused_moe_module
from g4serve.kernels.fused_moe import (
    GemmTiles,
    MoETiles,
    QuantExpertWeights,
    dequantize_expert,
    fused_moe,
    fused_moe_reference,
    fused_moe_w8a8_reference,
)
from g4serve.kernels.quant_matmul import dequantize_reference
from g4serve.layers.moe import MoEExperts
from g4serve.layers.quant import quantize_weight
from g4serve.quant_config import FP8, INT4, WeightQuant

E, H, INTER, TOP_K = 8, 128, 48, 2
ACT = "gelu_pytorch_tanh"
# FP8: K tiles of 32 (down's K = 48 ragged) and of 64 (two scale groups of 32 per tile). int4 takes its own K
# tiles (int4_block_k: 128, 256 past 16-row token tiles, where the operands swap): "m32" covers that path.
TILES = {
    "k32": MoETiles(16, GemmTiles(16, 32, 4, 2), GemmTiles(32, 32, 4, 2)),
    "k64": MoETiles(16, GemmTiles(32, 64, 4, 2), GemmTiles(32, 64, 4, 2)),
    "m32": MoETiles(32, GemmTiles(16, 64, 4, 2), GemmTiles(32, 64, 4, 2)),
}


def _quant_experts(
    kind: str,
    rows: int,
    k: int,
    block: tuple[int, int],
    zeros: bool,
    parts: int,
    gen: torch.Generator,
    scale_dtype: torch.dtype = torch.float32,
) -> QuantExpertWeights:
    """Random quantized expert weights [E, rows, k] (``parts`` parts, each on its own scale grid)."""
    part_rows = rows // parts
    grid = (-(-part_rows // block[0]), -(-k // block[1]))
    # outputs of order one: |q| ~ 100 (fp8) or ~ 5 (int4) times the scale, summed over K
    scale = (torch.rand(E, parts * grid[0], grid[1], generator=gen) + 0.5) * (0.01 if kind == FP8 else 0.2)
    scale = (scale / k**0.5).to(scale_dtype)
    zero = None
    if kind == FP8:
        weight = (torch.randn(E, rows, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    else:
        words = -(-k // 8)
        weight = torch.randint(-(2**31), 2**31 - 1, (E, rows, words), generator=gen, dtype=torch.int64)
        weight = weight.to(torch.int32)
        if zeros:
            zero = torch.randint(-8, 8, (E, rows, grid[1]), generator=gen).to(torch.int8)
    return QuantExpertWeights(weight, scale, block, k, zero, parts)


def _routing(num_tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.rand(num_tokens, E, generator=gen)
    scores[:, 0] = -1.0  # expert 0 unused
    weights, experts = torch.topk(scores, TOP_K, dim=-1)
    return experts, (weights / weights.sum(-1, keepdim=True)).float()


# name: kind, gate_up scale block, down scale block, zero points, scale dtype
FORMATS = {
    "fp8-tensor": (FP8, (INTER, H), (H, INTER), False, torch.float32),
    "fp8-channel": (FP8, (1, H), (1, INTER), False, torch.float32),
    # 16-row blocks: a gate or up part of 48 rows is 3 of them; 32-wide K blocks, down's last one partial
    "fp8-block": (FP8, (16, 32), (16, 32), False, torch.float32),
    # 128 x 128 blocks: one partial block per part, as 26B-A4B's I = 704 leaves one
    "fp8-block128": (FP8, (128, 128), (128, 128), False, torch.bfloat16),
    "int4-g32": (INT4, (1, 32), (1, 32), False, torch.float32),
    "int4-g32-asym": (INT4, (1, 32), (1, 32), True, torch.float32),
    # groups of 128: down's K = 48 is one partial group
    "int4-g128": (INT4, (1, 128), (1, 128), False, torch.bfloat16),
    "int4-g128-asym": (INT4, (1, 128), (1, 128), True, torch.float32),
    "int4-g8-asym": (INT4, (1, 8), (1, 8), True, torch.float32),
}
PARAMS = [
    (fmt, dtype, tiles)
    for fmt in FORMATS
    for dtype in (torch.float32, torch.bfloat16)
    for tiles in TILES
    if tiles == "k32"
    or (tiles == "k64" and dtype == torch.bfloat16 and FORMATS[fmt][0] == FP8)
    or (tiles == "m32" and FORMATS[fmt][0] == INT4)
]


def _weights(fmt: str, gen: torch.Generator) -> tuple[QuantExpertWeights, QuantExpertWeights]:
    kind, gate_up_block, down_block, zeros, scale_dtype = FORMATS[fmt]
    gate_up = _quant_experts(kind, 2 * INTER, H, gate_up_block, zeros, 2, gen, scale_dtype)
    down = _quant_experts(kind, H, INTER, down_block, zeros, 1, gen, scale_dtype)
    return gate_up, down


@pytest.mark.parametrize("fmt,dtype,tiles", PARAMS)
def test_quantized_fused_moe_matches_reference(fmt, dtype, tiles):
    gen = torch.Generator().manual_seed(len(fmt) * 7 + (dtype == torch.bfloat16))
    gate_up, down = _weights(fmt, gen)
    experts, weights = _routing(17, gen)
    x = torch.randn(17, H, generator=gen).to(dtype)
    # the dequantizing kernel (W8A8, the default for bf16 FP8 experts, has its own test below)
    out = fused_moe(x, gate_up, down, experts, weights, ACT, tiles=TILES[tiles], w8a8_min=0)
    ref = fused_moe_reference(x, gate_up, down, experts, weights, ACT)
    assert out.dtype == dtype and out.shape == x.shape and torch.isfinite(out).all()
    assert ref.abs().max() > 0.1  # outputs of order one, not a degenerate comparison
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    else:
        # each dequantized tile rounded to bf16 as the reference's weight: the same bits but where the fp32
        # summation order flips a rounding
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
        assert (out == ref).float().mean() >= 0.98


@pytest.mark.parametrize("fmt", ["fp8-tensor", "fp8-channel", "fp8-block128"])
@pytest.mark.parametrize("tiles", ["k32", "m32"])
def test_w8a8_fused_moe_matches_its_reference(fmt, tiles):
    """FP8 experts on the FP8 tensor cores: activations quantized per token and 128-column group (down's
    K = 48 one partial group), whatever K tile the tiles name (the kernel steps by the group)."""
    gen = torch.Generator().manual_seed(len(fmt) + len(tiles))
    gate_up, down = _weights(fmt, gen)
    experts, weights = _routing(17, gen)
    x = torch.randn(17, H, generator=gen).to(torch.bfloat16)
    out = fused_moe(x, gate_up, down, experts, weights, ACT, tiles=TILES[tiles], w8a8_min=1)
    ref = fused_moe_w8a8_reference(x, gate_up, down, experts, weights, ACT)
    assert out.dtype == torch.bfloat16 and ref.abs().max() > 0.1
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    assert (out == ref).float().mean() >= 0.98  # equal here; a summation order may flip a rounding
    # and near the dequantizing path: the activations' e4m3 rounding (3 mantissa bits) is the difference,
    # 4.4-4.7% of the output's norm on these weights
    dequantized = fused_moe_reference(x, gate_up, down, experts, weights, ACT).float()
    assert (out.float() - dequantized).norm() / dequantized.norm() < 0.06


@pytest.mark.parametrize("block", ["tensor", "channel"])
def test_w8a8_per_token_activations_where_scales_span_k(block):
    """Scales constant along K (FP8-Dynamic's per channel, or per tensor): the activations quantized per
    token, the products summed across K on the tensor cores and scaled once (``w8a8_rows``, the default),
    against its reference; K of 3 and 2 (one partial) groups, so per token and per group are different
    roundings. 128 x 128 blocks keep the groups whatever ``w8a8_rows`` says."""
    gen = torch.Generator().manual_seed(11 + len(block))
    hidden, inter = 384, 80
    blocks = {"tensor": ((inter, hidden), (hidden, inter)), "channel": ((1, hidden), (1, inter))}[block]
    gate_up = _quant_experts(FP8, 2 * inter, hidden, blocks[0], False, 2, gen)
    down = _quant_experts(FP8, hidden, inter, blocks[1], False, 1, gen)
    experts, weights = _routing(21, gen)
    x = torch.randn(21, hidden, generator=gen).to(torch.bfloat16)
    x[3, 7] = 40.0  # an outlier: its token's other groups lose precision per token, not per group
    run = lambda rows, w=(gate_up, down): fused_moe(  # noqa: E731
        x, *w, experts, weights, ACT, tiles=TILES["m32"], w8a8_min=1, w8a8_rows=rows
    )
    rows, groups = run(True), run(False)
    ref = fused_moe_w8a8_reference(x, gate_up, down, experts, weights, ACT, w8a8_rows=True)
    assert ref.abs().max() > 0.1
    torch.testing.assert_close(rows.float(), ref.float(), atol=2e-2, rtol=2e-2)
    assert (rows == ref).float().mean() >= 0.98
    assert torch.equal(
        groups, fused_moe_w8a8_reference(x, gate_up, down, experts, weights, ACT, w8a8_rows=False)
    )
    assert (rows != groups).any()
    assert torch.equal(
        fused_moe(x, gate_up, down, experts, weights, ACT, tiles=TILES["m32"], w8a8_min=1), rows
    )
    dequantized = fused_moe_reference(x, gate_up, down, experts, weights, ACT).float()
    assert (rows.float() - dequantized).norm() / dequantized.norm() < 0.06
    block128 = (
        _quant_experts(FP8, 2 * inter, hidden, (128, 128), False, 2, gen),
        _quant_experts(FP8, hidden, inter, (128, 128), False, 1, gen),
    )
    assert torch.equal(run(True, block128), run(False, block128))


def test_w8a8_only_where_it_applies():
    """Under the threshold, with scales finer than a 128-column group, or fp32 activations: the dequantizing
    path, bit for bit."""
    gen = torch.Generator().manual_seed(5)
    channel = _weights("fp8-channel", gen)
    experts, weights = _routing(9, gen)
    x = torch.randn(9, H, generator=gen).to(torch.bfloat16)
    plain = fused_moe(x, *channel, experts, weights, ACT, tiles=TILES["k32"], w8a8_min=0)
    assert torch.equal(fused_moe(x, *channel, experts, weights, ACT, tiles=TILES["k32"], w8a8_min=19), plain)
    # the default takes the FP8 tensor cores at any size
    assert torch.equal(
        fused_moe(x, *channel, experts, weights, ACT, tiles=TILES["k32"]),
        fused_moe(x, *channel, experts, weights, ACT, tiles=TILES["k32"], w8a8_min=1),
    )
    assert not torch.equal(
        fused_moe(x, *channel, experts, weights, ACT, tiles=TILES["k32"], w8a8_min=18), plain
    )
    fine = _weights("fp8-block", gen)  # 32-wide K blocks: not constant within a group
    assert torch.equal(
        fused_moe(x, *fine, experts, weights, ACT, tiles=TILES["k32"], w8a8_min=1),
        fused_moe(x, *fine, experts, weights, ACT, tiles=TILES["k32"], w8a8_min=0),
    )
    x32 = x.float()
    assert torch.equal(
        fused_moe(x32, *channel, experts, weights, ACT, tiles=TILES["k32"], w8a8_min=1),
        fused_moe(x32, *channel, experts, weights, ACT, tiles=TILES["k32"], w8a8_min=0),
    )


def test_reference_dequantizes_like_dequantize_reference():
    """``dequantize_expert``: each part by ``dequantize_reference`` on its own scale grid, to the dtype."""
    gen = torch.Generator().manual_seed(1)
    gate_up, _ = _weights("int4-g32-asym", gen)
    e = 3
    for dtype in (torch.float32, torch.bfloat16):
        parts = [
            dequantize_reference(
                gate_up.weight[e, p * INTER : (p + 1) * INTER],
                gate_up.scale[e, p * INTER : (p + 1) * INTER],
                (1, 32),
                H,
                gate_up.zero_point[e, p * INTER : (p + 1) * INTER],
                dtype,
            )
            for p in (0, 1)
        ]
        assert torch.equal(dequantize_expert(gate_up, e, dtype), torch.cat(parts))
    # the same values the dense reference computes with
    gen = torch.Generator().manual_seed(2)
    gate_up, down = _weights("fp8-block", gen)
    experts, weights = _routing(5, gen)
    x = torch.randn(5, H, generator=gen)
    dense = [torch.stack([dequantize_expert(w, i, torch.float32) for i in range(E)]) for w in (gate_up, down)]
    assert torch.equal(
        fused_moe_reference(x, gate_up, down, experts, weights, ACT),
        fused_moe_reference(x, *dense, experts, weights, ACT),
    )


def test_quantized_default_tiles_torch_align_chunks_and_empty(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    gate_up, down = _weights("int4-g128-asym", gen)
    experts, weights = _routing(11, gen)
    x = torch.randn(11, H, generator=gen)
    ref = fused_moe_reference(x, gate_up, down, experts, weights, ACT)
    torch.testing.assert_close(fused_moe(x, gate_up, down, experts, weights, ACT), ref, atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(fused_moe_module, "CHUNK_TOKENS", 4)
    out = fused_moe(x, gate_up, down, experts, weights, ACT, tiles=TILES["k32"], align_kernel_max=0)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert fused_moe(x[:0], gate_up, down, experts[:0], weights[:0], ACT).shape == (0, H)


@pytest.mark.parametrize("fmt,w8a8", [("fp8-block128", 1), ("int4-g32-asym", 0)])
def test_quantized_tile_order_changes_no_bit(fmt, w8a8):
    """Quantized experts (W8A8 FP8, in-register int4) in the grouped tile order (``GemmTiles.group_m``, the
    prefill default of their 64-row tiles) against the 2-D grid: the same bits, ragged last group included."""
    gen = torch.Generator().manual_seed(len(fmt))
    gate_up, down = _weights(fmt, gen)
    experts, weights = _routing(17, gen)
    x = torch.randn(17, H, generator=gen).to(torch.bfloat16)
    base = fused_moe(x, gate_up, down, experts, weights, ACT, tiles=TILES["k32"].ordered(0), w8a8_min=w8a8)
    ordered = fused_moe(x, gate_up, down, experts, weights, ACT, tiles=TILES["k32"].ordered(3), w8a8_min=w8a8)
    assert torch.equal(ordered, base)


def test_quantized_gate_up_beside_dense_down():
    """Each GEMM takes its own weight kind: quantized gate/up, dense down."""
    gen = torch.Generator().manual_seed(4)
    gate_up, _ = _weights("fp8-channel", gen)
    down = torch.randn(E, H, INTER, generator=gen) * INTER**-0.5
    experts, weights = _routing(9, gen)
    x = torch.randn(9, H, generator=gen)
    out = fused_moe(x, gate_up, down, experts, weights, ACT, tiles=TILES["k32"])
    torch.testing.assert_close(
        out, fused_moe_reference(x, gate_up, down, experts, weights, ACT), atol=1e-5, rtol=1e-5
    )


# ---- MoEExperts with quantized weights --------------------------------------------------------------------
SCHEMES = {
    "fp8-channel": WeightQuant(FP8, "channel", (1, 0)),
    "fp8-block": WeightQuant(FP8, "block", (16, 32)),  # 16-row blocks tile the 48-row parts
    "fp8-block128": WeightQuant(FP8, "block", (128, 128)),  # they do not: quantized expert by expert
    "int4-g32-asym": WeightQuant(INT4, "group", (1, 32), symmetric=False),
    "int4-g128": WeightQuant(INT4, "group", (1, 128)),
}


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_moe_experts_quantize_from_and_forward_on_cpu(scheme):
    gen = torch.Generator().manual_seed(5)
    wq = SCHEMES[scheme]
    layer = MoEExperts(E, H, INTER, ACT, quant=dict.fromkeys(("gate_up_proj", "down_proj"), wq))
    layer.compute_dtype = torch.float32
    dense = {
        "gate_up_proj": torch.randn(E, 2 * INTER, H, generator=gen) * H**-0.5,
        "down_proj": torch.randn(E, H, INTER, generator=gen) * INTER**-0.5,
    }
    kinds = {FP8: torch.float8_e4m3fn, INT4: torch.int32}
    for name, w in dense.items():
        layer.quantize_from(name, w)
        assert layer.get_parameter(name).dtype == kinds[wq.kind]
        # each expert's gate and up quantized on their own grids: as quantize_weight does one part
        parts = 2 if name == "gate_up_proj" else 1
        rows = w.shape[1] // parts
        block = wq.scale_block(rows, w.shape[2])
        dequantized = layer.dequantize(name, torch.float32)
        for e in (0, E - 1):
            for p in range(parts):
                q, s, z = quantize_weight(w[e, p * rows : (p + 1) * rows], wq.kind, block, not wq.symmetric)
                expected = dequantize_reference(q, s, block, w.shape[2], z, torch.float32)
                assert torch.equal(dequantized[e, p * rows : (p + 1) * rows], expected)
        error = (dequantized - w).abs().max()
        assert error <= w.abs().max() * (0.07 if wq.kind == FP8 else 0.15)
    experts, weights = _routing(6, gen)
    x = torch.randn(6, H, generator=gen)
    out = layer(x, experts, weights)
    ref = fused_moe_reference(
        x,
        layer.dequantize("gate_up_proj", x.dtype),
        layer.dequantize("down_proj", x.dtype),
        experts,
        weights,
        ACT,
    )
    assert torch.equal(out, ref)
    # the kernel (interpreted) on the module's quantized view
    kernel = fused_moe(
        x,
        layer.projection("gate_up_proj"),
        layer.projection("down_proj"),
        experts,
        weights,
        ACT,
        TILES["k32"],
    )
    torch.testing.assert_close(kernel, ref, atol=1e-5, rtol=1e-5)


def test_dense_moe_experts_keep_hf_names():
    layer = MoEExperts(4, 32, 16, ACT)
    assert [n for n, _ in layer.named_parameters()] == ["gate_up_proj", "down_proj"]
    assert not layer.quantized and layer.gate_up_proj.shape == (4, 32, 32)
    quantized = MoEExperts(4, 32, 16, ACT, quant={"down_proj": WeightQuant(INT4, "group", (1, 8), False)})
    assert [n for n, _ in quantized.named_parameters()] == [
        "gate_up_proj",
        "down_proj",
        "down_proj_scale",
        "down_proj_zero_point",
    ]
    assert quantized.down_proj.shape == (4, 32, 2) and quantized.down_proj_scale.shape == (4, 32, 2)


@pytest.mark.parametrize("fmt,tiles", [("int4-g32-asym", "k32"), ("int4-g128", "m32")])
def test_int4_expert_planes_two_words_at_a_time_give_the_same_bits(monkeypatch, fmt, tiles):
    """The experts' int4 tiles with the PTX planes' formulation (``PLANES_EMULATED``) against the fp32 planes,
    in the interpreter: the same bits (bf16 activations and scales, unswapped and swapped operands)."""
    from g4serve.kernels import quant_matmul as qm

    gen = torch.Generator().manual_seed(len(fmt) + len(tiles))
    kind, gate_up_block, down_block, zeros, _ = FORMATS[fmt]
    gate_up = _quant_experts(kind, 2 * INTER, H, gate_up_block, zeros, 2, gen, torch.bfloat16)
    down = _quant_experts(kind, H, INTER, down_block, zeros, 1, gen, torch.bfloat16)
    experts, weights = _routing(17, gen)
    x = torch.randn(17, H, generator=gen).bfloat16()
    fp32 = fused_moe(x, gate_up, down, experts, weights, ACT, tiles=TILES[tiles])
    monkeypatch.setattr(fused_moe_module, "int4_planes", lambda *args: qm.PLANES_EMULATED)
    emulated = fused_moe(x, gate_up, down, experts, weights, ACT, tiles=TILES[tiles])
    assert torch.equal(emulated, fp32)
