"""bench/moe_kernels.py on the CPU: ``--groups``' choice of tile orders and tiles (with stand-in timings: the
script's own timings need CUDA graphs), and the script's refusal without CUDA."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from bench_scripts import load_script

from g4serve.kernels.fused_moe import GemmTiles, QuantExpertWeights, moe_tiles

bench = load_script("moe_kernels")


def _gemm_ms(cfg) -> tuple[float, float]:
    """Stand-in per-GEMM times (ms): gate/up fastest in order 4, faster still as 64 x 64 on 8 warps; down
    fastest in order 2, faster still as 128 x 64 at 3 stages (neither the default tiles)."""
    g, d = cfg.gate_up, cfg.down
    gate_up = 1.0 - 0.2 * (g.group_m == 4) - 0.05 * (g == GemmTiles(64, 64, 8, 4, 4))
    down = 2.0 - 0.5 * (d.group_m == 2) - 0.3 * (d == GemmTiles(128, 64, 8, 3, 2))
    return gate_up, down


def test_groups_pick_each_gemms_fastest_order_then_its_fastest_tiles(monkeypatch):
    timed = []
    monkeypatch.setattr(bench, "graph_ms", lambda calls, args: timed.append(calls[0]) or 1.0)
    args = types.SimpleNamespace(groups=[0, 1, 2, 4, 8])
    tiles = moe_tiles(4096 * 8, 128)
    seen = []

    def gemm_ms(gate_up, down, cfg):
        seen.append(cfg)
        return _gemm_ms(cfg)

    out = bench.sweep_groups(args, tiles, gemm_ms, lambda cfg=None: [cfg], (None, None), 4096 * 8, 2816, 704)
    # every order with both GEMMs in it, then the other tiles in each GEMM's best order
    assert [(c.gate_up.group_m, c.down.group_m) for c in seen[:5]] == [(g, g) for g in args.groups]
    assert all((c.gate_up.group_m, c.down.group_m) == (4, 2) for c in seen[5:]) and len(seen) == 8
    assert out["best"] == {"gate_up": 4, "down": 2}
    assert out["chosen"]["gate_up"] == vars(GemmTiles(64, 64, 8, 4, 4))
    assert out["chosen"]["down"] == vars(GemmTiles(128, 64, 8, 3, 2))
    assert len(out["other_tiles"]) == 3
    # the block timed with the chosen tiles, then with the default tiles in the 2-D grid's order
    assert timed[0].gate_up == GemmTiles(64, 64, 8, 4, 4) and timed[0].down == GemmTiles(128, 64, 8, 3, 2)
    assert timed[1] == tiles.ordered(0)
    flops = out["trials"][0]["gate_up_tflop_per_s"] * out["trials"][0]["gate_up_ms"] * 1e9
    assert abs(flops - 4 * 4096 * 8 * 704 * 2816) < 1e3


def test_without_cuda_it_refuses(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--tokens", "8"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def _experts(dtype: torch.dtype) -> QuantExpertWeights:
    """Stand-in quantized experts (meta tensors: only their format is read), per-channel scales."""
    weight = torch.empty(4, 256, 256, dtype=dtype, device="meta")
    return QuantExpertWeights(weight, torch.empty(4, 256, 1, device="meta"), (1, 256), 256)


@pytest.mark.parametrize("fmt", ["fp8", "int4", "bf16"])
def test_sweep_times_the_path_the_engine_takes(monkeypatch, fmt):
    """FP8 experts are searched on the W8A8 path over its own tiles, from the quantized default; int4 ones
    dequantized in registers over the bf16 lists; bf16 ones from the bf16 default. Every token tile meets
    every gate/up candidate, then the best of those every down candidate, each in the default's tile order;
    the fastest trial wins."""
    quant = {"fp8": (_experts(torch.float8_e4m3fn),) * 2, "int4": (_experts(torch.int32),) * 2}.get(fmt)
    gate_up_list, down_list = (
        (bench.W8A8_GATE_UP_TILES, bench.W8A8_DOWN_TILES)
        if fmt == "fp8"
        else (bench.GATE_UP_TILES, bench.DOWN_TILES)
    )
    fast_gate_up, fast_down = gate_up_list[2], down_list[3]  # stand-in timings: these two are faster
    timed = []  # (tiles, weights, w8a8_min) of each trial

    def fused_calls(cfg=None, weights=None, w8a8_min=0):
        timed.append((cfg, weights, w8a8_min))
        return [cfg]

    def graph_ms(calls, args):
        cfg = calls[0]
        return 1.0 - 0.2 * (_order0(cfg.gate_up) == fast_gate_up) - 0.5 * (_order0(cfg.down) == fast_down)

    monkeypatch.setattr(bench, "graph_ms", graph_ms)
    n, experts = 4096 * 8, 128
    out = bench.sweep_formats(None, fused_calls, quant, n, experts)
    default = moe_tiles(n, experts, quantized=quant is not None)
    assert timed[0][0] == default and out["default"] == bench._tiles_dict(default)
    assert all(w is quant and m == (1 if fmt == "fp8" else 0) for _, w, m in timed)
    block_ms = bench.block_m_choices(n / experts)
    first = [c for c, _, _ in timed[1 : 1 + len(block_ms) * len(gate_up_list)]]
    assert [(c.block_m, _order0(c.gate_up)) for c in first] == [
        (b, g) for b in block_ms for g in gate_up_list
    ]
    assert all(c.gate_up.group_m == default.gate_up.group_m and c.down == default.down for c in first)
    second = [c for c, _, _ in timed[1 + len(first) :]]
    assert [_order0(c.down) for c in second] == down_list
    assert all(c.down.group_m == default.down.group_m for c in second)
    assert all(_order0(c.gate_up) == fast_gate_up and c.block_m == block_ms[0] for c in second)
    assert out["best_ms"] == pytest.approx(0.3)
    assert out["best"]["down"] == vars(dataclasses.replace(fast_down, group_m=default.down.group_m))


def _order0(t: GemmTiles) -> GemmTiles:
    return dataclasses.replace(t, group_m=0)
