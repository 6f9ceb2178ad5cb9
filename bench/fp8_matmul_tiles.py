"""The W8A8 FP8 decode GEMM (kernels/fp8_matmul.py) on a preset's decode projections: where its time goes
and which tiles stream the weight fastest.

For every projection one decode step quantizes (``gemv_kernels.quant_shapes``) and each row count, the
script times, each from a CUDA graph cycling over enough weight copies that every call reads HBM:
the activation quantizer alone (``quantize_groups``), the GEMM alone on pre-quantized activations with each
tile of the grid (row tile x column tile x warps x stages, with and without ``swap_ab``, split-K), the whole
``fp8_matmul`` with its default tiles, the dequantizing kernel (``quant_matmul``, FP8 weights widened in
registers, bf16 activations) and bf16's skinny kernel on the same shape for scale. It prints
microseconds and weight GB/s per shape, a decode step's sums (count x time) against the FP8 bytes' floor at
the device's copy bandwidth, and writes JSON (device, versions, commit, every trial) to bench/results/.

    python bench/fp8_matmul_tiles.py --preset 31b --rows 1 8
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemv_kernels import _graph_ms, copy_gb_per_s, quant_shapes, quantized_weights  # noqa: E402

from g4serve.bench.meta import command_line, cuda_environment, kernel_result_path  # noqa: E402
from g4serve.config import PRESETS  # noqa: E402
from g4serve.kernels.fp8_matmul import (  # noqa: E402
    fp8_matmul,
    fp8_matmul_config,
    fp8_matmul_quantized,
    quantize_groups,
)
from g4serve.kernels.gemv import MUL, PLAIN, skinny_matmul  # noqa: E402
from g4serve.kernels.quant_matmul import quant_matmul  # noqa: E402

# block_n, num_warps, num_stages, swap_ab: the grid of decode tiles (row tile: the batch padded to 16). A
# first sweep (H100, 31B, M = 1 and 8) never found 16-column tiles or 8 warps below 64 columns best, and
# swap_ab at least as fast everywhere; both sides stay in the grid at the two column tiles that won.
GRID = tuple(
    (bn, w, s, swap)
    for bn, w, s, swap in itertools.product((32, 64, 128), (4, 8), (3, 4, 6, 8), (0, 1))
    if (w == 4 or bn == 128) and (swap or bn < 128)
)
SPLITS = (2, 3, 4, 6)  # split-K, for shapes whose column tiles leave SMs idle (at 64 columns, swap_ab)
# --quick: the tiles that won the full grid, and split-K from 2 to 16 at 32 and 64 columns (small models'
# narrow projections)
QUICK_GRID = ((32, 4, 4, 1), (64, 4, 4, 1), (64, 4, 6, 1), (128, 4, 4, 1))
QUICK_SPLITS = ((32, 64), (4,), (2, 3, 4, 6, 8, 12, 16))
# one row on the CUDA cores (``_fp8_gemv``): weight rows a program x columns a step x warps
ONE_ROW_GRID = tuple(
    {"one_row": 1, "block_n": bn, "block_k": bk, "num_warps": w}
    for bn, bk, w in itertools.product((4, 8, 16, 32, 64), (128, 256, 512, 1024, 2048), (4, 8))
    if 2048 <= bn * bk <= 8192
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--preset", default="31b")
    p.add_argument("--quant", default="fp8", help="an FP8 --quantization preset with dynamic activations")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    p.add_argument("--stream-mb", type=int, default=256, help="bytes of weight copies each graph cycles over")
    p.add_argument("--calls-per-graph", type=int, default=16)
    p.add_argument("--graph-replays", type=int, default=5)
    p.add_argument("--copy-mb", type=int, default=1024)
    p.add_argument("--no-sweep", action="store_true", help="time the default tiles only")
    p.add_argument("--quick", action="store_true", help="a small grid with wide split-K (QUICK_GRID)")
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    return p.parse_args(argv)


def bench_shape(args, shape, act: str, copy_gbps: float, sm_count: int) -> list[dict]:
    name, ep, n, k, count = shape
    weights, block, nbytes = quantized_weights(args.quant, ep, n, k, None, args.stream_mb * 2**20)
    rows = weights[0][0].shape[0]
    gen = torch.Generator("cuda").manual_seed(n + k)
    dense = [torch.randn(rows, k, device="cuda", generator=gen).bfloat16()]
    dense += [dense[0].clone() for _ in range(max(2, -(-args.stream_mb * 2**20 // (rows * k * 2))) - 1)]
    activation = act if ep != PLAIN else None
    out = []
    for m in args.rows:
        x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        other = torch.randn(m, n, device="cuda", generator=gen).bfloat16() if ep == MUL else None
        xq, sx = quantize_groups(x)

        def timed(fn, copies) -> float:
            return _graph_ms([lambda w=w: fn(w) for w in copies], args.calls_per_graph, args.graph_replays)

        def gemm(cfg, x=x, xq=xq, sx=sx, other=other):
            return lambda w: fp8_matmul_quantized(
                xq, sx, x.dtype, w[0], w[1], block, ep, activation, other, cfg
            )

        default_cfg = fp8_matmul_config(m, n, k, sm_count, epilogue=ep)
        mma_cfg = fp8_matmul_config(m, n, k, sm_count, one_row="mma")  # the tensor cores' tiles
        row = {
            "name": name,
            "n": n,
            "k": k,
            "rows": m,
            "per_step": count,
            "quant_bytes": nbytes,
            "floor_ms": nbytes / copy_gbps / 1e6,
            "quantize_ms": timed(lambda w, x=x: quantize_groups(x), weights[:2]),
            "total_ms": timed(
                lambda w, x=x, other=other: fp8_matmul(x, w[0], w[1], block, ep, activation, other), weights
            ),
            "gemm_default_ms": timed(gemm(default_cfg), weights),
            "default_config": default_cfg,
            "gemm_mma_ms": timed(gemm(mma_cfg), weights) if m == 1 else None,
            "dequant_ms": timed(
                lambda w, x=x, other=other: quant_matmul(
                    x, w[0], w[1], block, k, w[2], ep, activation, other
                ),
                weights,
            ),
            "bf16_skinny_ms": timed(
                lambda w, x=x, other=other: skinny_matmul(x, w, ep, activation, other), dense
            )
            if m <= 16
            else None,
        }
        if not args.no_sweep:
            trials = []
            grid = [
                {
                    "block_m": mma_cfg["block_m"],
                    "block_n": bn,
                    "num_warps": w,
                    "num_stages": s,
                    "swap_ab": swap,
                }
                for bn, w, s, swap in (QUICK_GRID if args.quick else GRID)
            ]
            block_ns, stages, splits = QUICK_SPLITS if args.quick else ((64,), (4, 6, 8), SPLITS)
            grid += [
                {"block_m": mma_cfg["block_m"], "block_n": bn, "num_warps": 4, "num_stages": s}
                | {"swap_ab": 1, "split_k": split}
                for bn in block_ns
                for s in stages
                for split in splits
                if -(-n // bn) < sm_count and split * 2 <= -(-k // 128)
            ]
            if m == 1:
                grid += list(ONE_ROW_GRID)
            for cfg in grid:
                try:
                    trials.append({"config": cfg, "ms": timed(gemm(cfg), weights)})
                except Exception as exc:  # noqa: BLE001 - a tile the compiler rejects (registers, shared memory)
                    trials.append({"config": cfg, "error": type(exc).__name__})
            best = min((t for t in trials if "ms" in t), key=lambda t: t["ms"])
            row.update(gemm_best_ms=best["ms"], best_config=best["config"], trials=trials)
        out.append(row)
        best_ms = row.get("gemm_best_ms", row["gemm_default_ms"])
        print(
            f"{name:>8s} {n:6d} {k:6d} {m:2d} {count:3d} | floor {row['floor_ms'] * 1e3:7.2f} | bf16 "
            f"{(row['bf16_skinny_ms'] or float('nan')) * 1e3:7.2f} | "
            f"dequant {row['dequant_ms'] * 1e3:6.2f} quantize {row['quantize_ms'] * 1e3:5.2f} "
            f"gemm {row['gemm_default_ms'] * 1e3:7.2f} "
            f"(mma {(row['gemm_mma_ms'] or float('nan')) * 1e3:7.2f}) "
            f"total {row['total_ms'] * 1e3:7.2f} | best gemm "
            f"{best_ms * 1e3:7.2f} ({nbytes / best_ms / 1e6:5.0f} GB/s) {json.dumps(row.get('best_config'))}",
            flush=True,
        )
    weights.clear()
    dense.clear()
    torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/fp8_matmul_tiles.py needs a CUDA device", file=sys.stderr)
        return 2
    env = cuda_environment()
    act = PRESETS[args.preset]().text.hidden_activation
    copy_gbps = copy_gb_per_s(args.copy_mb * 2**20)
    print(f"{env['device_name']}: copy {copy_gbps:.0f} GB/s (read + write)")
    results = []
    for shape in quant_shapes(args.preset):
        results += bench_shape(args, shape, act, copy_gbps, env["device_sm_count"])
    totals = {}
    for m in args.rows:
        rs = [r for r in results if r["rows"] == m]

        def step_us(key, rs=rs):
            return sum(r[key] * r["per_step"] for r in rs if r.get(key) is not None) * 1e3

        totals[str(m)] = {
            key: step_us(key)
            for key in (
                "floor_ms",
                "bf16_skinny_ms",
                "dequant_ms",
                "quantize_ms",
                "gemm_default_ms",
                "gemm_mma_ms",
                "total_ms",
                "gemm_best_ms",
            )
        }
        t = totals[str(m)]
        print(
            f"M={m} per step (us): floor {t['floor_ms']:.0f}, fp8_matmul {t['total_ms']:.0f} (quantize "
            f"{t['quantize_ms']:.0f} + gemm {t['gemm_default_ms']:.0f}, tensor cores {t['gemm_mma_ms']:.0f}; "
            f"best tiles {t['gemm_best_ms']:.0f}), "
            f"bf16 skinny {t['bf16_skinny_ms']:.0f}, dequantizing kernel {t['dequant_ms']:.0f}"
        )
    path = kernel_result_path(args.out_dir, "fp8_matmul_tiles", env, args.preset, f"_{args.quant}")
    doc = {
        "environment": env,
        "command": command_line(),
        "preset": args.preset,
        "quant": args.quant,
        "rows": args.rows,
        "copy_gb_per_s": copy_gbps,
        "units": {
            "*_ms": "milliseconds per call (CUDA-graph replay, weights streamed from HBM)",
            "step totals": "microseconds per decode step (sum over projections of per_step x time)",
            "floor_ms": "quant_bytes / copy_gb_per_s",
        },
        "results": results,
        "step_totals_us": totals,
    }
    path.write_text(json.dumps(doc, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
