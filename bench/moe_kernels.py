"""MoE experts on the GPU at 26B-A4B shapes: the Triton path (align + two grouped GEMMs) vs the torch loop.

For each token count T the script times ``fused_moe`` replayed from a CUDA graph (cycling over input copies
with different routings, as the engine's captured step runs it) and eagerly, the reference per-expert loop
eagerly (it syncs, so it cannot be captured), and the pieces (align: the one-program kernel, the torch ops
and the three-launch parallel kernel; the two GEMMs; routing: kernel vs torch ops). Reports achieved weight
bandwidth (bytes of the experts the batch touches) and TFLOP/s; writes JSON (device, versions, git commit,
every figure with its unit) to bench/results/.
``--quant`` also times the same experts quantized (``MoEExperts.quantize_from``: FP8 per channel or 128 x 128
blocks, int4 in groups of 128 or 32), dequantized in registers by the same kernels, against bf16; FP8 experts
also on the FP8 tensor cores (W8A8, ``w8a8_*``: activations quantized per token and 128-column group).

    python bench/moe_kernels.py                    # T = 1, 8, 32, 64, 512
    python bench/moe_kernels.py --tokens 1 64 --sweep   # also search tile configs per T
    python bench/moe_kernels.py --quant w4a16 --tokens 1 4 16 64 1024   # quantized experts vs bf16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from triton.testing import do_bench

from g4serve.bench.meta import cuda_environment, kernel_result_path
from g4serve.bench.timing import graph_replay_ms
from g4serve.config import PRESETS
from g4serve.kernels.fused_moe import (
    GemmTiles,
    MoETiles,
    _grouped_gemm,
    _w8a8_weights,
    fused_moe,
    fused_moe_reference,
    moe_align,
    moe_align_kernel,
    moe_align_parallel,
    moe_tiles,
)
from g4serve.kernels.moe_route import moe_route, moe_route_reference
from g4serve.layers.moe import MoEExperts
from g4serve.quant_config import QUANTIZATION_PRESETS

ROOT = Path(__file__).resolve().parent.parent
GATE_UP_TILES = [
    GemmTiles(16, 128, 4, 4),
    GemmTiles(32, 128, 4, 4),
    GemmTiles(64, 128, 4, 3),
    GemmTiles(64, 64, 4, 4),
    GemmTiles(32, 64, 4, 4),
    GemmTiles(128, 64, 8, 3),
    # prefill sizes (hundreds of rows per expert): taller and deeper pipelines
    GemmTiles(64, 64, 4, 5),
    GemmTiles(64, 64, 8, 4),
    GemmTiles(128, 64, 8, 4),
    GemmTiles(128, 32, 8, 5),
]
DOWN_TILES = [
    GemmTiles(32, 128, 4, 4),
    GemmTiles(64, 128, 4, 4),
    GemmTiles(64, 64, 4, 4),
    GemmTiles(32, 64, 4, 4),
    GemmTiles(128, 64, 8, 3),
    GemmTiles(128, 128, 8, 3),
    GemmTiles(128, 64, 8, 4),
    GemmTiles(256, 64, 8, 3),
    GemmTiles(128, 64, 4, 4),
]

# The W8A8 products (FP8 experts on the FP8 tensor cores) take K tiles of the activations' 128-column scale
# group whatever block_k says; their 1-byte tiles leave room for taller, deeper pipelines
W8A8_GATE_UP_TILES = [
    GemmTiles(32, 128, 4, 4),
    GemmTiles(64, 128, 4, 3),
    GemmTiles(64, 128, 4, 4),
    GemmTiles(64, 128, 8, 4),
    GemmTiles(128, 128, 4, 3),
    GemmTiles(128, 128, 8, 3),
    GemmTiles(128, 128, 8, 4),
]
W8A8_DOWN_TILES = [
    GemmTiles(64, 128, 4, 3),
    GemmTiles(64, 128, 4, 4),
    GemmTiles(128, 128, 4, 4),
    GemmTiles(128, 128, 8, 3),
    GemmTiles(128, 128, 8, 4),
    GemmTiles(256, 128, 8, 3),
    GemmTiles(256, 128, 8, 4),
]

# Tried by --groups in each GEMM's best order, beside the default tiles (pairs: gate/up, down)
GROUP_GATE_UP_TILES = [GemmTiles(64, 64, 8, 4), GemmTiles(64, 64, 4, 4), GemmTiles(128, 64, 8, 3)]
GROUP_DOWN_TILES = [GemmTiles(128, 64, 8, 3), GemmTiles(256, 64, 8, 4), GemmTiles(128, 128, 8, 3)]


def block_m_choices(rows_per_expert: float) -> tuple[int, ...]:
    """Token tiles worth trying at this many rows per expert (taller tiles waste padding on few rows)."""
    if rows_per_expert <= 8:
        return (16, 32)
    if rows_per_expert <= 64:
        return (16, 32, 64)
    return (32, 64, 128)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--preset", default="26b-a4b")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 64, 512])
    p.add_argument("--copies", type=int, default=8, help="input copies (routings) a graph cycles over")
    p.add_argument("--calls-per-graph", type=int, default=32)
    p.add_argument("--graph-replays", type=int, default=7)
    p.add_argument("--warmup-ms", type=int, default=10, help="eager timing (do_bench)")
    p.add_argument("--rep-ms", type=int, default=50, help="eager timing (do_bench)")
    p.add_argument("--sweep", action="store_true", help="search block_m x gate_up tiles, then down tiles")
    p.add_argument(
        "--quant",
        choices=list(QUANTIZATION_PRESETS),
        help="also time the experts quantized by this --quantization preset (--sweep then sweeps them)",
    )
    p.add_argument(
        "--groups",
        type=int,
        nargs="*",
        default=[],
        help="also time each GEMM in these tile orders (GemmTiles.group_m; 0: the 2-D grid, blocks fastest)",
    )
    p.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    return p.parse_args(argv)


def graph_ms(calls: list[Callable[[], object]], args) -> float:
    """Median time of one call, replayed from a CUDA graph that cycles over ``calls``."""
    return graph_replay_ms(calls, args.calls_per_graph, args.graph_replays)


def bench_tokens(
    args, num_tokens: int, gate_up: torch.Tensor, down: torch.Tensor, activation: str, quant=None
) -> dict:
    """``quant``: (gate_up, down) as ``QuantExpertWeights`` of the same experts, or None."""
    num_experts, two_inter, hidden = gate_up.shape
    inter = two_inter // 2
    top_k = args.top_k
    n = num_tokens * top_k
    scale = torch.rand(num_experts, device="cuda").add_(0.5).bfloat16()
    inputs = []
    for _ in range(args.copies):
        logits = torch.randn(num_tokens, num_experts, device="cuda").bfloat16()
        weights, experts = moe_route_reference(logits, scale, top_k)
        x = torch.randn(num_tokens, hidden, device="cuda").bfloat16()
        inputs.append((x, experts, weights, logits))
    touched = sum(torch.unique(e).numel() for _, e, _, _ in inputs) / len(inputs)
    expert_bytes = (gate_up[0].numel() + down[0].numel()) * gate_up.element_size()
    weight_bytes = touched * expert_bytes
    flops = 2 * n * (two_inter * hidden + hidden * inter)
    tiles = moe_tiles(n, num_experts)

    def fused_calls(cfg: MoETiles | None = None, weights=(gate_up, down), w8a8_min: int = 0, w8a8_rows=None):
        return [
            lambda x=x, e=e, w=w: fused_moe(
                x, *weights, e, w, activation, tiles=cfg, w8a8_min=w8a8_min, w8a8_rows=w8a8_rows
            )
            for x, e, w, _ in inputs
        ]

    fused_graph = graph_ms(fused_calls(), args)
    x0, e0, w0, l0 = inputs[0]
    fused_eager = do_bench(fused_calls()[0], warmup=args.warmup_ms, rep=args.rep_ms)
    reference_eager = do_bench(
        lambda: fused_moe_reference(x0, gate_up, down, e0, w0, activation),
        warmup=args.warmup_ms,
        rep=args.rep_ms,
    )

    # pieces, each from a graph over the copies
    align_kernel = graph_ms(
        [lambda e=e: moe_align_kernel(e, num_experts, tiles.block_m) for _, e, _, _ in inputs], args
    )
    align_torch = graph_ms(
        [lambda e=e: moe_align(e, num_experts, tiles.block_m) for _, e, _, _ in inputs], args
    )
    align_parallel = graph_ms(
        [lambda e=e: moe_align_parallel(e, num_experts, tiles.block_m) for _, e, _, _ in inputs], args
    )
    aligned = [moe_align_kernel(e, num_experts, tiles.block_m) for _, e, _, _ in inputs]
    hidden_act = torch.empty(n, inter, dtype=x0.dtype, device="cuda")
    per_slot = torch.empty(n, hidden, dtype=x0.dtype, device="cuda")

    def gemm_ms(w_gate_up, w_down, cfg: MoETiles = tiles) -> tuple[float, float]:
        gemm1 = graph_ms(
            [
                lambda x=x, a=a: _grouped_gemm(
                    x,
                    w_gate_up,
                    hidden_act,
                    inter,
                    *a,
                    cfg.block_m,
                    cfg.gate_up,
                    a_row_div=top_k,
                    activation=activation,
                )
                for (x, _, _, _), a in zip(inputs, aligned, strict=True)
            ],
            args,
        )
        gemm2 = graph_ms(
            [
                lambda w=w, a=a: _grouped_gemm(
                    hidden_act,
                    w_down,
                    per_slot,
                    hidden,
                    *a,
                    cfg.block_m,
                    cfg.down,
                    a_row_div=1,
                    route_weights=w.reshape(-1),
                )
                for (_, _, w, _), a in zip(inputs, aligned, strict=True)
            ],
            args,
        )
        return gemm1, gemm2

    gemm1, gemm2 = gemm_ms(gate_up, down)
    route_kernel = graph_ms([lambda lg=lg: moe_route(lg, scale, top_k) for _, _, _, lg in inputs], args)
    route_torch = graph_ms(
        [lambda lg=lg: moe_route_reference(lg, scale, top_k) for _, _, _, lg in inputs], args
    )

    row = {
        "tokens": num_tokens,
        "assignments": n,
        "experts_touched_mean": touched,
        "tiles": _tiles_dict(tiles),
        "fused_graph_ms": fused_graph,
        "fused_eager_ms": fused_eager,
        "reference_eager_ms": reference_eager,
        "speedup_graph_vs_reference": reference_eager / fused_graph,
        "align_kernel_ms": align_kernel,
        "align_torch_ms": align_torch,
        "align_parallel_ms": align_parallel,
        "gate_up_gemm_ms": gemm1,
        "down_gemm_ms": gemm2,
        "route_kernel_ms": route_kernel,
        "route_torch_ms": route_torch,
        "weight_bytes": weight_bytes,
        "achieved_weight_gb_per_s": weight_bytes / fused_graph / 1e6,
        "gemms_weight_gb_per_s": weight_bytes / (gemm1 + gemm2) / 1e6,
        "achieved_tflop_per_s": flops / fused_graph / 1e9,
    }
    if quant is not None:
        quant_graph = graph_ms(fused_calls(weights=quant), args)
        quant_gemm1, quant_gemm2 = gemm_ms(*quant)
        quant_bytes = touched * sum(_expert_bytes(w) for w in quant)
        row.update(
            quant_fused_graph_ms=quant_graph,
            quant_gate_up_gemm_ms=quant_gemm1,
            quant_down_gemm_ms=quant_gemm2,
            quant_weight_bytes=quant_bytes,
            quant_speedup_graph_vs_bf16=fused_graph / quant_graph,
            quant_gemms_speedup_vs_bf16=(gemm1 + gemm2) / (quant_gemm1 + quant_gemm2),
            quant_achieved_weight_gb_per_s=quant_bytes / quant_graph / 1e6,
            quant_gemms_weight_gb_per_s=quant_bytes / (quant_gemm1 + quant_gemm2) / 1e6,
        )
        if all(_w8a8_weights(w) for w in quant):  # FP8 experts: also on the FP8 tensor cores (W8A8)
            w8a8_graph = graph_ms(fused_calls(weights=quant, w8a8_min=1), args)
            # activations per 128-column group where the default quantizes them per token (FP8-Dynamic)
            groups_graph = graph_ms(fused_calls(weights=quant, w8a8_min=1, w8a8_rows=False), args)
            row.update(
                w8a8_fused_graph_ms=w8a8_graph,
                w8a8_groups_fused_graph_ms=groups_graph,
                w8a8_speedup_vs_quant=quant_graph / w8a8_graph,
                w8a8_speedup_vs_bf16=fused_graph / w8a8_graph,
                w8a8_achieved_tflop_per_s=flops / w8a8_graph / 1e9,
            )
    if args.sweep:
        row["sweep"] = sweep_formats(args, fused_calls, quant, n, num_experts)
    if args.groups:
        row["groups"] = sweep_groups(args, tiles, gemm_ms, fused_calls, (gate_up, down), n, hidden, inter)
        if quant is not None:  # the quantized block (FP8: on the FP8 tensor cores) in each order, as a whole
            qtiles = moe_tiles(n, num_experts, quantized=True)
            w8a8 = int(all(_w8a8_weights(w) for w in quant))
            row["quant_groups"] = {
                g: graph_ms(fused_calls(qtiles.ordered(g), quant, w8a8_min=w8a8), args) for g in args.groups
            }
            print(
                "    quantized block by group_m: "
                + ", ".join(f"{g}: {ms * 1e3:.1f} us" for g, ms in row["quant_groups"].items()),
                flush=True,
            )
    return row


def _expert_bytes(w) -> float:
    """Bytes of one expert's quantized projection: weight, scales and zero points."""
    tensors = [w.weight, w.scale] + ([w.zero_point] if w.zero_point is not None else [])
    return sum(t[0].numel() * t.element_size() for t in tensors)


def quantized_experts(preset: str, gate_up: torch.Tensor, down: torch.Tensor, activation: str):
    """The experts quantized as ``--quantization preset`` quantizes them: (gate_up, down) views."""
    scheme = QUANTIZATION_PRESETS[preset].groups[0].weights
    num_experts, two_inter, hidden = gate_up.shape
    layer = MoEExperts(
        num_experts,
        hidden,
        two_inter // 2,
        activation,
        quant={"gate_up_proj": scheme, "down_proj": scheme},
        scale_dtype=torch.float32 if scheme.kind == "fp8" else gate_up.dtype,
        compute_dtype=gate_up.dtype,
        device=gate_up.device,
    )
    layer.quantize_from("gate_up_proj", gate_up)
    layer.quantize_from("down_proj", down)
    return layer.projection("gate_up_proj"), layer.projection("down_proj")


def _tiles_dict(t: MoETiles) -> dict:
    return {"block_m": t.block_m, "gate_up": vars(t.gate_up), "down": vars(t.down)}


def sweep(
    args,
    fused_calls,
    n: int,  # assignments (tokens x top-k)
    num_experts: int,
    default: MoETiles | None = None,
    gate_up_tiles: list[GemmTiles] = GATE_UP_TILES,
    down_tiles: list[GemmTiles] = DOWN_TILES,
) -> dict:
    """Coordinate search: block_m x ``gate_up_tiles`` (the down tiles ``default``'s, by default
    ``moe_tiles``'), then ``down_tiles``; each candidate in its GEMM's tile order in ``default``."""
    default = default or moe_tiles(n, num_experts)
    trials = []

    def trial(cfg: MoETiles) -> float:
        try:
            ms = graph_ms(fused_calls(cfg), args)
        except Exception as exc:  # a config the compiler rejects (e.g. out of shared memory)
            print(f"    {_tiles_dict(cfg)}: {type(exc).__name__}")
            return float("inf")
        trials.append({"tiles": _tiles_dict(cfg), "fused_graph_ms": ms})
        print(f"    {_tiles_dict(cfg)}: {ms * 1e3:.1f} us", flush=True)
        return ms

    def gate_up(g: GemmTiles) -> GemmTiles:
        return dataclasses.replace(g, group_m=default.gate_up.group_m)

    def down(d: GemmTiles) -> GemmTiles:
        return dataclasses.replace(d, group_m=default.down.group_m)

    block_ms = block_m_choices(n / num_experts)
    candidates = [MoETiles(bm, gate_up(g), default.down) for bm in block_ms for g in gate_up_tiles]
    best_ms, best = min(((trial(c), c) for c in [default, *candidates]), key=lambda p: p[0])
    for d in down_tiles:
        cfg = MoETiles(best.block_m, best.gate_up, down(d))
        ms = trial(cfg)
        if ms < best_ms:
            best_ms, best = ms, cfg
    return {"default": _tiles_dict(default), "best": _tiles_dict(best), "best_ms": best_ms, "trials": trials}


def sweep_formats(args, fused_calls, quant, n: int, num_experts: int) -> dict:
    """``sweep`` of the path the engine takes: bf16 experts (``quant`` None); FP8 experts on the FP8 tensor
    cores (W8A8, with its own tiles); other quantized experts dequantized in registers."""
    if quant is None:
        return sweep(args, fused_calls, n, num_experts)
    default = moe_tiles(n, num_experts, quantized=True)
    if all(_w8a8_weights(w) for w in quant):
        calls = lambda cfg=None: fused_calls(cfg, quant, w8a8_min=1)  # noqa: E731
        return sweep(args, calls, n, num_experts, default, W8A8_GATE_UP_TILES, W8A8_DOWN_TILES)
    return sweep(args, lambda cfg=None: fused_calls(cfg, quant), n, num_experts, default)


def sweep_groups(args, tiles: MoETiles, gemm_ms, fused_calls, weights, n: int, hidden: int, inter: int):
    """Each GEMM at the default tiles in each tile order (``GemmTiles.group_m``), then other tiles of the same
    token tile (``GROUP_*_TILES``) in each GEMM's fastest order, then the whole expert block with each GEMM's
    fastest tiles against the default tiles in the 2-D grid's order."""
    flops = {"gate_up": 4 * n * inter * hidden, "down": 2 * n * hidden * inter}
    trials = []
    for g in args.groups:
        cfg = tiles.ordered(g)
        ms = dict(zip(("gate_up", "down"), gemm_ms(*weights, cfg=cfg), strict=True))
        trials.append(
            {"group_m": g, **{f"{k}_ms": v for k, v in ms.items()}}
            | {f"{k}_tflop_per_s": flops[k] / v / 1e9 for k, v in ms.items()}
        )
        print(
            f"    group_m {g:3d}: gate_up {ms['gate_up'] * 1e3:8.1f} us "
            f"({flops['gate_up'] / ms['gate_up'] / 1e9:5.0f} TFLOP/s), down {ms['down'] * 1e3:8.1f} us "
            f"({flops['down'] / ms['down'] / 1e9:5.0f} TFLOP/s)",
            flush=True,
        )
    fastest = {k: min(trials, key=lambda t: t[f"{k}_ms"]) for k in ("gate_up", "down")}
    best = {k: t["group_m"] for k, t in fastest.items()}
    chosen = {k: dataclasses.replace(getattr(tiles, k), group_m=g) for k, g in best.items()}
    chosen_ms = {k: t[f"{k}_ms"] for k, t in fastest.items()}
    others = []  # other tiles of the same token tile, each GEMM in its best order
    for gate_up_tiles, down_tiles in zip(GROUP_GATE_UP_TILES, GROUP_DOWN_TILES, strict=True):
        pair = {
            "gate_up": dataclasses.replace(gate_up_tiles, group_m=best["gate_up"]),
            "down": dataclasses.replace(down_tiles, group_m=best["down"]),
        }
        try:
            ms = dict(zip(pair, gemm_ms(*weights, cfg=MoETiles(tiles.block_m, *pair.values())), strict=True))
        except Exception as exc:  # a config the compiler rejects (e.g. out of shared memory)
            print(f"    {pair}: {type(exc).__name__}")
            continue
        others.append({k: vars(t) for k, t in pair.items()} | {f"{k}_ms": v for k, v in ms.items()})
        print("    " + "; ".join(f"{pair[k]}: {ms[k] * 1e3:8.1f} us" for k in pair), flush=True)
        for k in pair:
            if ms[k] < chosen_ms[k]:
                chosen[k], chosen_ms[k] = pair[k], ms[k]
    cfg = MoETiles(tiles.block_m, chosen["gate_up"], chosen["down"])
    base = tiles.ordered(0)
    return {
        "trials": trials,
        "best": best,
        "other_tiles": others,
        "chosen": _tiles_dict(cfg),
        "fused_graph_ms_best": graph_ms(fused_calls(cfg), args),
        "fused_graph_ms_unordered": graph_ms(fused_calls(base), args),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/moe_kernels.py needs a CUDA device", file=sys.stderr)
        return 2
    text = PRESETS[args.preset]().text
    assert text.enable_moe_block, f"preset {args.preset} has no MoE block"
    args.top_k = text.top_k_experts
    env = cuda_environment()
    print(json.dumps(env, indent=2))
    gen = torch.Generator("cuda").manual_seed(0)
    e, h, i = text.num_experts, text.hidden_size, text.moe_intermediate_size
    gate_up = torch.randn(e, 2 * i, h, device="cuda", generator=gen).mul_(h**-0.5).bfloat16()
    down = torch.randn(e, h, i, device="cuda", generator=gen).mul_(i**-0.5).bfloat16()
    quant = quantized_experts(args.quant, gate_up, down, text.hidden_activation) if args.quant else None
    torch.cuda.synchronize()
    rows = []
    for t in args.tokens:
        row = bench_tokens(args, t, gate_up, down, text.hidden_activation, quant)
        rows.append(row)
        print(
            f"T={t:5d} fused {row['fused_graph_ms'] * 1e3:8.1f} us (graph) "
            f"{row['fused_eager_ms'] * 1e3:8.1f} us (eager) | loop {row['reference_eager_ms'] * 1e3:8.1f} us "
            f"| x{row['speedup_graph_vs_reference']:.1f}"
            + (
                f" | {args.quant} {row['quant_fused_graph_ms'] * 1e3:8.1f} us (graph) "
                f"x{row['quant_speedup_graph_vs_bf16']:.2f} vs bf16"
                if quant
                else ""
            )
            + (
                f" | w8a8 {row['w8a8_fused_graph_ms'] * 1e3:8.1f} us x{row['w8a8_speedup_vs_quant']:.2f} vs "
                f"dequantizing, x{row['w8a8_speedup_vs_bf16']:.2f} vs bf16 (per 128-column group: "
                f"{row['w8a8_groups_fused_graph_ms'] * 1e3:.1f} us)"
                if "w8a8_fused_graph_ms" in row
                else ""
            )
            + (f" | sweep best {row['sweep']['best_ms'] * 1e3:.1f} us" if args.sweep else ""),
            flush=True,
        )

    print(
        f"\n{args.preset}: E={e} top-k={args.top_k} H={h} I={i} bf16, times in us "
        f"(graph = replayed from a CUDA graph)"
    )
    cols = [
        "T",
        "fused",
        "eager",
        "loop",
        "speedup",
        "align_k",
        "align_t",
        "align_p",
        "gemm1",
        "gemm2",
        "route_k",
        "route_t",
        "experts",
        "GB/s",
        "TFLOP/s",
    ]
    print("".join(f"{c:>9s}" for c in cols))
    for r in rows:
        vals = [
            r["tokens"],
            r["fused_graph_ms"] * 1e3,
            r["fused_eager_ms"] * 1e3,
            r["reference_eager_ms"] * 1e3,
            r["speedup_graph_vs_reference"],
            r["align_kernel_ms"] * 1e3,
            r["align_torch_ms"] * 1e3,
            r["align_parallel_ms"] * 1e3,
            r["gate_up_gemm_ms"] * 1e3,
            r["down_gemm_ms"] * 1e3,
            r["route_kernel_ms"] * 1e3,
            r["route_torch_ms"] * 1e3,
            r["experts_touched_mean"],
            r["achieved_weight_gb_per_s"],
            r["achieved_tflop_per_s"],
        ]
        print("".join(f"{v:9d}" if isinstance(v, int) else f"{v:9.1f}" for v in vals))
    if quant:
        print(
            f"\n{args.preset} experts quantized as --quantization {args.quant} (times in us, graph replays)"
        )
        cols = ["T", "bf16", args.quant, "speedup", "gemm1", "q_gemm1", "gemm2", "q_gemm2", "GB/s", "q_GB/s"]
        print("".join(f"{c:>10s}" for c in cols))
        for r in rows:
            vals = [
                r["tokens"],
                r["fused_graph_ms"] * 1e3,
                r["quant_fused_graph_ms"] * 1e3,
                r["quant_speedup_graph_vs_bf16"],
                r["gate_up_gemm_ms"] * 1e3,
                r["quant_gate_up_gemm_ms"] * 1e3,
                r["down_gemm_ms"] * 1e3,
                r["quant_down_gemm_ms"] * 1e3,
                r["achieved_weight_gb_per_s"],
                r["quant_achieved_weight_gb_per_s"],
            ]
            print("".join(f"{v:10d}" if isinstance(v, int) else f"{v:10.2f}" for v in vals))

    suffix = f"_{args.quant}" if args.quant else ""
    path = kernel_result_path(args.out_dir, "moe_kernels", env, args.preset, suffix)
    units = {
        "*_ms": "milliseconds per call",
        "weight_bytes": "bytes of expert weights the batch touches",
        "quant_weight_bytes": "bytes of quantized expert weights (scales and zero points included) touched",
        "quant_*speedup*": "bf16 time / quantized time",
        "*_gb_per_s": "1e9 bytes/s of touched expert weights",
        "achieved_tflop_per_s": "1e12 FLOP/s",
    }
    path.write_text(
        json.dumps(
            {
                "environment": env,
                "preset": args.preset,
                "dtype": "bfloat16",
                "quant": args.quant,
                "quant_scheme": repr(QUANTIZATION_PRESETS[args.quant].groups[0].weights)
                if args.quant
                else None,
                "shapes": {"experts": e, "top_k": args.top_k, "hidden": h, "intermediate": i},
                "units": units,
                "results": rows,
            },
            indent=2,
        )
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
