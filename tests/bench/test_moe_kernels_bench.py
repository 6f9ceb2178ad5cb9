"""bench/moe_kernels.py on the CPU: ``--groups``' choice of tile orders and tiles (with stand-in timings: the
script's own timings need CUDA graphs), and the script's refusal without CUDA."""

from __future__ import annotations

import types

import torch
from bench_scripts import load_script

from g4serve.kernels.fused_moe import GemmTiles, moe_tiles

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
