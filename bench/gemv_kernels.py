"""Decode projections on the GPU: the skinny-GEMM kernel (kernels/gemv.py) against cuBLAS.

For every projection of one decoder step of a preset (q/k/v, o, MLP gate/up with its activation, down, PLE
gate with its product, PLE projection, the per-layer-input projection, the LM head) and M = 1, 2, 4, 8 token
rows, the script times what the model ran before (``F.linear``, plus the activation kernel for the gated
ones) and the skinny kernel with its default tiles, each replayed from a CUDA graph that cycles over enough
weight copies (>= 4x the L2 size) that every call streams its weight from HBM. ``--sweep`` also searches
tiles per shape. Reports microseconds and weight GB/s; writes JSON (device, versions, commit) to
bench/results/.

    python bench/gemv_kernels.py                        # e4b, M = 1 2 4 8
    python bench/gemv_kernels.py --rows 1 8 --sweep
    python bench/gemv_kernels.py --rows 64 32 16 8 --sweep --compile-workers 14

``--sweep`` at 9-64 rows searches the swapped tiles (the weight as the warpgroup MMA's M side, ``SWAP_TILES``;
past 16 rows also ``SWAP_WIDE_TILES``, 128 or 256 weight rows at 8 warps) unsplit and split K;
``--compile-workers`` compiles the sweep's kernels in parallel processes first.

``--quant PRESET`` (a ``--quantization`` preset: fp8, fp8-block, w4a16, w4a16-g32) times the quantized-weight
GEMM (kernels/quant_matmul.py) instead, with its default tiles, on weights quantized from random bf16 by
layers/quant.py, for every projection the preset quantizes (the LM head, the tied embedding, stays bf16;
26b-a4b's experts are not among the dense projections), beside the bf16 cuBLAS and skinny-kernel times. It
reports weight GB/s of the quantized bytes (scales included) and their fraction of a device-to-device copy's
bandwidth, measured once. ``--sweep`` searches tiles per shape (``sweep_configs``: the M=1 FMA path, the
tensor-core row tile for 2..64 rows, split-K where a tile leaves SMs idle) and writes the best tiles per
(preset, row tile, N, K), also as a python dict to paste. ``--compile-workers`` compiles the sweep's kernels
in parallel processes first (Triton's on-disk cache), which is most of a sweep's time otherwise.

    python bench/gemv_kernels.py --quant fp8 --rows 1 2 4 8 --sweep --compile-workers 12
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import torch
import torch.nn.functional as F

from g4serve.bench.meta import cuda_environment, kernel_result_path
from g4serve.bench.timing import graph_replay_ms, time_sweep
from g4serve.config import PRESETS
from g4serve.kernels._launch import next_pow2
from g4serve.kernels.gemv import GATE_UP, MUL, PLAIN, gemv_config, skinny_matmul, use_skinny
from g4serve.kernels.int4_tinygemm import pack_tinygemm, tinygemm_matmul, tinygemm_supported
from g4serve.kernels.quant_matmul import SKINNY_ROWS, int4_matmul_config, quant_matmul, quant_matmul_config
from g4serve.layers.quant import epilogue_after, quantize_weight
from g4serve.quant_config import FP8, INT4, QUANTIZATION_PRESETS, WeightQuant

ROOT = Path(__file__).resolve().parent.parent
EPILOGUE_NAMES = {PLAIN: "plain", GATE_UP: "gate_up+act", MUL: "act*other"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--preset", default="e4b")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--stream-mb", type=int, default=256, help="bytes of weight copies each graph cycles over")
    p.add_argument("--calls-per-graph", type=int, default=64)
    p.add_argument("--graph-replays", type=int, default=7)
    p.add_argument("--sweep", action="store_true", help="search tiles per shape and row count")
    p.add_argument(
        "--quant",
        choices=sorted(QUANTIZATION_PRESETS),
        help="time the quantized-weight GEMM (kernels/quant_matmul.py) on weights quantized with this preset",
    )
    p.add_argument(
        "--sweep-top",
        type=int,
        default=6,
        help="--quant --sweep: the full grid runs at the largest row count of each row tile; the other row "
        "counts of that tile time its N best configs (and the default)",
    )
    p.add_argument(
        "--compile-workers",
        type=int,
        default=0,
        help="--sweep: processes that compile the sweep's kernels into Triton's cache before timing",
    )
    p.add_argument("--copy-mb", type=int, default=1024, help="--quant: MiB of the reference device copy")
    p.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    return p.parse_args(argv)


def decode_shapes(preset: str) -> list[tuple[str, int, int, int, int]]:
    """(name, epilogue, N, K, count per step) for one decode step's projections, deduplicated by shape."""
    t = PRESETS[preset]().text
    h, seen, out = t.hidden_size, {}, []
    for i in range(t.num_hidden_layers):
        hd, kv = t.layer_head_dim(i), t.layer_num_kv_heads(i)
        q = t.num_attention_heads * hd
        kv_cols = 0 if i >= t.first_kv_shared_layer else kv * hd * (1 if t.layer_uses_k_as_v(i) else 2)
        rows = [
            ("qkv" if kv_cols else "q", PLAIN, q + kv_cols, h),
            ("o", PLAIN, h, q),
            ("gate_up", GATE_UP, t.layer_intermediate_size(i), h),
            ("down", PLAIN, h, t.layer_intermediate_size(i)),
        ]
        if t.hidden_size_per_layer_input:
            rows += [
                ("ple_gate", MUL, t.hidden_size_per_layer_input, h),
                ("ple_proj", PLAIN, h, t.hidden_size_per_layer_input),
            ]
        for row in rows:
            seen[row] = seen.get(row, 0) + 1
    if t.hidden_size_per_layer_input:
        seen[("ple_model_proj", PLAIN, t.num_hidden_layers * t.hidden_size_per_layer_input, h)] = 1
    seen[("lm_head", PLAIN, t.vocab_size, h)] = 1
    for (name, ep, n, k), count in seen.items():
        out.append((name, ep, n, k, count))
    return out


# The bf16 sweep's grid at 2..64 rows: the 16-row tensor-core tiles (up to 16 rows), and the swapped tiles
# (the weight as the warpgroup MMA's M side: (weight rows, K tile) a program) at 3-5 stages, unsplit and
# split K where the column tiles give fewer than 4 programs per SM; pipelines over ~200 KB of shared memory
# are left out.
SWAP_TILES = ((64, 64), (64, 128), (64, 256), (128, 64), (128, 128))
# Past 16 rows the batch's K tile costs as many bytes as a 64-row weight tile, read again from L2 for every
# column tile: wider weight tiles (two warpgroups at 8 warps) read it once per 128 or 256 weight rows.
SWAP_WIDE_TILES = ((128, 64), (128, 128), (256, 64))
SWAP_STAGES = (3, 4, 5)
SWAP_SPLITS = (2, 3, 4, 8)  # 3: 31B's N = 5,376 (84 column tiles of 64) into about two waves of 132 SMs
SHARED_BYTES = 200 * 1024


def _configs(m: int, ep: int = PLAIN, n: int = 4096, k: int = 4096, sms: int = 132) -> list[dict[str, int]]:
    if m == 1:
        return [
            {"block_n": bn, "block_k": bk, "num_warps": w, "num_stages": 1}
            for bn, bk, w in itertools.product((1, 2, 4, 8), (512, 1024, 2048), (4, 8))
        ]
    out = []
    if m <= 16:
        out += [
            {"block_n": bn, "block_k": bk, "num_warps": w, "num_stages": s}
            for bn, bk, w, s in itertools.product((16, 32, 64), (64, 128, 256), (4,), (3, 4))
        ]
    block_m = max(16, next_pow2(m))
    weights = 2 if ep == GATE_UP else 1
    grid = [(t, 4) for t in SWAP_TILES] + ([(t, 8) for t in SWAP_WIDE_TILES] if m > 16 else [])
    for ((bn, bk), warps), stages in itertools.product(grid, SWAP_STAGES):
        if bk > max(16, next_pow2(k)) or stages * (weights * bn + block_m) * bk * 2 > SHARED_BYTES:
            continue
        cfg = {"block_m": block_m, "block_n": bn, "block_k": bk, "num_warps": warps, "num_stages": stages}
        out.append(cfg | {"swap_ab": 1})
        tiles, k_tiles = -(-n // bn), -(-k // bk)
        out += [
            cfg | {"swap_ab": 1, "split_k": split}
            for split in SWAP_SPLITS
            if tiles * split <= 4 * sms and k_tiles >= 2 * split
        ]
    return out


def bench_shape(args, name: str, ep: int, n: int, k: int, m: int, act: str, sms: int) -> dict:
    rows = 2 * n if ep == GATE_UP else n
    weight_bytes = rows * k * 2
    copies = max(2, -(-args.stream_mb * 2**20 // weight_bytes))
    gen = torch.Generator("cuda").manual_seed(n * 7 + k)
    weights = [
        torch.randn(rows, k, device="cuda", generator=gen).mul_(k**-0.5).bfloat16() for _ in range(copies)
    ]
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    other = torch.randn(m, n, device="cuda", generator=gen).bfloat16() if ep == MUL else None
    activation = act if ep != PLAIN else None

    def cublas(w):
        return epilogue_after(F.linear(x, w), ep, activation, other)

    def time(fn) -> float:
        return graph_replay_ms([lambda w=w: fn(w) for w in weights], args.calls_per_graph, args.graph_replays)

    base = time(cublas)
    default_cfg = gemv_config(m, n, k, ep, sms)
    skinny = time(lambda w: skinny_matmul(x, w, ep, activation, other))
    row = {
        "name": name,
        "epilogue": EPILOGUE_NAMES[ep],
        "n": n,
        "k": k,
        "rows": m,
        "weight_bytes": weight_bytes,
        "cublas_ms": base,
        "skinny_ms": skinny,
        "skinny_config": default_cfg,
        "cublas_gb_per_s": weight_bytes / base / 1e6,
        "skinny_gb_per_s": weight_bytes / skinny / 1e6,
        "speedup": base / skinny,
        "engine_uses_skinny": use_skinny(m, n, k, ep, sms),
    }
    if args.sweep:
        row["sweep"] = time_sweep(
            _configs(m, ep, n, k, sms),
            lambda cfg: time(lambda w: skinny_matmul(x, w, ep, activation, other, config=cfg)),
        )
    weights.clear()
    torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/gemv_kernels.py needs a CUDA device", file=sys.stderr)
        return 2
    env = cuda_environment()
    print(json.dumps(env, indent=2))
    if args.quant:
        return run_quant(args, env)
    act = PRESETS[args.preset]().text.hidden_activation
    shapes = decode_shapes(args.preset)
    results = []
    compile_report = None
    sms = env["device_sm_count"]
    if args.sweep and args.compile_workers > 0:
        configs = {(ep, n, k, m): _configs(m, ep, n, k, sms) for _, ep, n, k, _ in shapes for m in args.rows}
        compile_report = precompile(compile_jobs(None, shapes, args.rows, configs), act, args.compile_workers)
    head = (
        f"{'shape':>15s} {'N':>7s} {'K':>6s} {'M':>2s} {'x/step':>6s} {'cuBLAS us':>10s} {'skinny us':>10s} "
        f"{'GB/s':>6s} {'speedup':>7s}" + (f" {'best us':>8s}  best tiles" if args.sweep else "")
    )
    print(head)
    for m in args.rows:
        for name, ep, n, k, count in shapes:
            r = bench_shape(args, name, ep, n, k, m, act, sms)
            r["per_step"] = count
            results.append(r)
            line = (
                f"{name:>15s} {n:7d} {k:6d} {m:2d} {count:6d} {r['cublas_ms'] * 1e3:10.2f} "
                f"{r['skinny_ms'] * 1e3:10.2f} {r['skinny_gb_per_s']:6.0f} {r['speedup']:7.2f}"
            )
            if args.sweep:
                line += f" {r['sweep']['best_ms'] * 1e3:8.2f}  {r['sweep']['best']}"
            print(line, flush=True)
    print("\nper decode step (sum of count x time), us:")
    for m in args.rows:
        rs = [r for r in results if r["rows"] == m]
        base = sum(r["cublas_ms"] * r["per_step"] for r in rs) * 1e3
        skinny = sum(r["skinny_ms"] * r["per_step"] for r in rs) * 1e3
        best = sum(min(r["skinny_ms"], r["cublas_ms"]) * r["per_step"] for r in rs) * 1e3
        engine = (
            sum((r["skinny_ms"] if r["engine_uses_skinny"] else r["cublas_ms"]) * r["per_step"] for r in rs)
            * 1e3
        )
        print(
            f"  M={m}: cuBLAS {base:8.1f}   skinny {skinny:8.1f}   min of both {best:8.1f}   "
            f"engine's choice (use_skinny) {engine:8.1f}"
        )
    path = kernel_result_path(args.out_dir, "gemv_kernels", env, args.preset)
    units = {
        "*_ms": "milliseconds per call (CUDA-graph replay, weights streamed from HBM)",
        "*_gb_per_s": "1e9 bytes/s of weight",
        "per_step": "calls of this shape in one decode step",
    }
    path.write_text(
        json.dumps(
            {
                "environment": env,
                "preset": args.preset,
                "dtype": "bfloat16",
                "units": units,
                "compile": compile_report,
                "results": results,
            },
            indent=2,
        )
    )
    print(f"wrote {path}")
    return 0


# ---- --quant: the quantized-weight GEMM (kernels/quant_matmul.py) ------------------------------------------
# The sweep's grid. One row (the FMA path): BLOCK_N weight rows x BLOCK_K per program, kept to 16..64 fp32
# accumulator elements per thread (fewer: short loads, little in flight; more: register spills; gate_up has
# two accumulators: 16..32, as 64 spilled in sm_90 builds of the FP8 kernel, 255 registers); the
# STAGED tiles (around the default) also at 2 and 3 pipeline stages. 2..64 rows (tensor-core row tile of
# quant_matmul's BLOCK_M rows): 8..64 dequantized elements per thread, 8 warps only for 32+ columns.
M1_TILES = tuple(
    (bn, bk, w)
    for bn, bk, w in itertools.product((1, 2, 4, 8, 16), (256, 512, 1024, 2048, 4096), (2, 4, 8))
    if 16 <= bn * bk // (32 * w) <= 64
)
M1_STAGED = ((2, 1024, 4), (4, 1024, 4), (4, 2048, 8), (8, 1024, 8))
DOT_TILES = tuple(
    (bn, bk, w)
    for bn, bk, w in itertools.product((16, 32, 64), (64, 128, 256), (4, 8))
    if 8 <= bn * bk // (32 * w) <= 64 and (w == 4 or bn >= 32)
)
DOT_STAGES = (2, 3, 4)
# int4 row tiles (K tiles of at least 128: ``quant_matmul.int4_tiles``): the nibble planes on bf16x2 lanes
# take ~2 instructions an element, so wider tiles, whose activation planes serve more weight rows, go
# further; also timed at one row (the tensor cores on a 16-row tile of which one row is real).
INT4_DOT_TILES = (
    (32, 256, 4),
    (64, 256, 4),
    (64, 512, 4),
    (128, 256, 4),
    (128, 256, 8),
    (128, 512, 8),
    (256, 256, 8),
)
# split-K for tiles that give fewer than 2 programs per SM (4 warps; the dot path at 3 stages)
SPLITS = (2, 4)


def quant_shapes(preset: str) -> list[tuple[str, int, int, int, int]]:
    """``decode_shapes`` that a ``--quantization`` preset quantizes: all but the LM head (the tied embedding
    stays bf16: ``quant_loader.plan_quantize`` takes the decoder's ``nn.Linear`` projections)."""
    return [shape for shape in decode_shapes(preset) if shape[0] != "lm_head"]


def row_tile(m: int) -> int:
    """The m-bucket: 1 (the FMA path) or quant_matmul's BLOCK_M for m rows (``SKINNY_ROWS`` at most)."""
    return 1 if m == 1 else max(16, 1 << (m - 1).bit_length())


def scale_block(weights: WeightQuant, epilogue: int, n: int, k: int) -> tuple[int, int]:
    """(rows, cols) per scale entry of the projection as the engine stacks it (``stack_linears``): a part's
    own block when it tiles the part's N rows, else per row; per-tensor parts keep one scale per part."""
    bn, bk = weights.scale_block(n, k)
    if n % bn:
        bn = 1
    return bn, bk


def _nests(block_k: int, scale_bk: int, k: int) -> bool:
    """quant_matmul's rule: a K tile never straddles a partial scale block."""
    return scale_bk >= k or scale_bk % block_k == 0 or block_k % scale_bk == 0


def _splits_nonempty(k: int, block_k: int, splits: int) -> bool:
    per_split = _cdiv(_cdiv(k, splits), block_k) * block_k  # quant_matmul's split: whole K tiles each
    return (splits - 1) * per_split < k


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def default_config(m: int, n: int, k: int, epilogue: int, int4: bool, sm_count: int) -> dict[str, int]:
    """The tiles ``quant_matmul`` takes without a config (int4: ``int4_matmul_config``)."""
    return int4_matmul_config(m, n, k, epilogue, sm_count) if int4 else quant_matmul_config(m, n, k, epilogue)


def sweep_configs(
    m: int, n: int, k: int, epilogue: int, scale_bk: int, sm_count: int, int4: bool = False
) -> list[dict[str, int]]:
    """The tiles the sweep times for one shape at m rows: the grid pruned to tiles that fit the shape (K
    tiles no longer than K's power of two, nesting with the scale block), split-K variants of the tiles
    with fewer than two programs per SM, and quant_matmul's default first. int4 adds ``INT4_DOT_TILES``
    (at one row too, on a 16-row tile)."""
    grid = []
    if m == 1:
        grid = [(1, bn, bk, w, 1) for bn, bk, w in M1_TILES] + [
            (1, bn, bk, w, s) for bn, bk, w in M1_STAGED for s in (2, 3)
        ]
    else:
        grid = [(row_tile(m), bn, bk, w, s) for bn, bk, w in DOT_TILES for s in DOT_STAGES]
    if int4:
        grid += [(max(16, row_tile(m)), bn, bk, w, s) for bn, bk, w in INT4_DOT_TILES for s in DOT_STAGES]
    out = [default_config(m, n, k, epilogue, int4, sm_count)]
    for block_m, bn, bk, w, stages in grid:
        dot = block_m > 1
        max_k, max_n = (
            (max(64, next_pow2(k)), max(16, next_pow2(n))) if dot else (max(256, next_pow2(k)), next_pow2(n))
        )
        if bk > max_k or bn > max_n or not _nests(bk, scale_bk, k):
            continue
        if not dot and epilogue == GATE_UP and bn * bk // (32 * w) > 32:
            continue
        cfg = {"block_m": block_m, "block_n": bn, "block_k": bk, "num_warps": w, "num_stages": stages}
        if cfg not in out:
            out.append(cfg)
        if stages == (3 if dot else 1) and w == 4 and _cdiv(n, bn) < 2 * sm_count:
            splits = [{**cfg, "split_k": s} for s in SPLITS if _splits_nonempty(k, bk, s)]
            out += [c for c in splits if c not in out]
    return out


def lead_rows(rows: list[int]) -> dict[int, int]:
    """Each row count -> the row count of its row tile that runs the full grid (the largest: the most
    work per weight byte); the others time that one's best configs."""
    return {m: max(r for r in rows if row_tile(r) == row_tile(m)) for m in rows}


def row_order(rows: list[int]) -> list[int]:
    """Row counts in the order a shape times them: each row tile's lead first."""
    lead = lead_rows(rows)
    return sorted(dict.fromkeys(rows), key=lambda m: (row_tile(m), m != lead[m], m))


def quantized_weights(
    quant: str, epilogue: int, n: int, k: int, copies: int | None, stream_bytes: int = 0, device: str = "cuda"
):
    """Random bf16 weights ([2N, K] for gate_up) quantized with preset ``quant`` as the engine stores them
    (FP8 scales fp32, int4 scales bf16: the model's dtype), as (weight, scale, zero point or None) tuples,
    ``copies`` of them (None: enough to cycle over ``stream_bytes``; at least 2), and the scale block."""
    wq = QUANTIZATION_PRESETS[quant].groups[0].weights
    rows = 2 * n if epilogue == GATE_UP else n
    block = scale_block(wq, epilogue, n, k)
    gen = torch.Generator(device).manual_seed(n * 7 + k)
    dense = torch.randn(rows, k, device=device, generator=gen).mul_(k**-0.5).bfloat16()
    q, scale, zero = quantize_weight(dense, wq.kind, block, asymmetric=not wq.symmetric)
    del dense
    scale = scale.float() if wq.kind == FP8 else scale.bfloat16()
    first = (q, scale, zero)
    nbytes = sum(t.numel() * t.element_size() for t in first if t is not None)
    if copies is None:
        copies = max(2, -(-stream_bytes // nbytes))
    weights = [first] + [
        tuple(t.clone() if t is not None else None for t in first) for _ in range(copies - 1)
    ]
    return weights, block, nbytes


def _graph_ms(calls, min_calls_per_graph: int, replays: int) -> float:
    return graph_replay_ms(calls, min_calls_per_graph, replays, warm_all=False)


def copy_gb_per_s(nbytes: int, device: str = "cuda", reps: int = 10) -> float:
    """Device-to-device copy of ``nbytes``: 1e9 bytes/s read plus written (median of ``reps``)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / (sorted(times)[len(times) // 2] * 1e-3) / 1e9


# ---- compiling in parallel: every kernel of the sweep into Triton's on-disk cache -------------------------
def _spec(v: int) -> int:
    """How Triton specialises an integer argument: == 1, divisible by 16, or neither."""
    return 1 if v == 1 else (16 if v % 16 == 0 else 0)


def compile_jobs(
    quant: str | None, shapes: list, rows: list[int], configs: dict
) -> list[tuple[tuple[str, int, int, int], int, dict]]:
    """((quant, epilogue, N, K), m, config) for every kernel the sweep may launch, one per compiled variant
    (the constexprs, and Triton's specialisation of the integer arguments: M, N, K, the packed and scale
    widths, the scale block). ``quant`` None: the bf16 skinny kernel (kernels/gemv.py)."""
    jobs, seen = [], set()
    for _, ep, n, k, _ in shapes:
        if quant is None:
            ints = (n, k)
        else:
            bn, bk = scale_block(QUANTIZATION_PRESETS[quant].groups[0].weights, ep, n, k)
            ints = (n, k, -(-k // 8), -(-k // bk), bn, bk)
        for m in rows:
            for cfg in configs[(ep, n, k, m)]:
                # split-K counts are a launch argument: one compiled kernel for all of them
                tiles = {**cfg, "split_k": min(2, cfg.get("split_k", 1))}
                key = (ep, _spec(m), *map(_spec, ints), tuple(sorted(tiles.items())))
                if key not in seen:
                    seen.add(key)
                    jobs.append(((quant, ep, n, k), m, cfg))
    return jobs


@functools.lru_cache(maxsize=2)
def _compile_inputs(quant: str | None, ep: int, n: int, k: int, device: str):
    """Tensors laid out as ``quantized_weights`` makes them (what a kernel compiles for), without the
    quantizer's temporaries: a dozen workers at once."""
    rows = 2 * n if ep == GATE_UP else n
    if quant is None:
        return (torch.empty(rows, k, device=device, dtype=torch.bfloat16),), None
    wq = QUANTIZATION_PRESETS[quant].groups[0].weights
    bn, bk = scale_block(wq, ep, n, k)
    if wq.kind == FP8:
        q = torch.empty(rows, k, device=device, dtype=torch.float8_e4m3fn)
    else:
        q = torch.empty(rows, _cdiv(k, 8), device=device, dtype=torch.int32)
    scale_dtype = torch.float32 if wq.kind == FP8 else torch.bfloat16
    scale = torch.ones(_cdiv(rows, bn), _cdiv(k, bk), device=device, dtype=scale_dtype)
    zero = None if wq.symmetric else torch.zeros(scale.shape, device=device, dtype=torch.int8)
    return (q, scale, zero), (bn, bk)


def compile_task(jobs: list, act: str, device: str = "cuda") -> tuple[int, list[str]]:
    """Run each job's kernel once (a worker process: Triton compiles it and caches it on disk); returns
    (launches, errors)."""
    done, errors = 0, []
    for (quant, ep, n, k), m, cfg in jobs:
        (q, *scales), block = _compile_inputs(quant, ep, n, k, device)
        scale, zero = scales if scales else (None, None)
        x = torch.ones(m, k, device=device, dtype=torch.bfloat16)
        other = torch.ones(m, n, device=device, dtype=torch.bfloat16) if ep == MUL else None
        activation = act if ep != PLAIN else None
        try:
            if quant is None:
                skinny_matmul(x, q, ep, activation, other, config=cfg)
            else:
                quant_matmul(x, q, scale, block, k, zero, ep, activation, other, config=cfg)
            done += 1
        except Exception as exc:  # noqa: BLE001 - a tile the compiler rejects: the sweep reports it
            errors.append(f"{cfg}: {type(exc).__name__}")
    if device == "cuda":
        torch.cuda.synchronize()
    return done, errors


def precompile(jobs: list, act: str, workers: int, device: str = "cuda", per_task: int = 4) -> dict:
    """``compile_task`` over ``workers`` spawned processes, jobs of one shape per task (each worker keeps
    the last shapes' weights); failures are reported, the sweep then compiles what is missing itself."""
    t0 = time.perf_counter()
    tasks = [jobs[i : i + per_task] for i in range(0, len(jobs), per_task)]
    done, errors = 0, []
    ctx = multiprocessing.get_context("spawn")
    try:
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
            futures = [pool.submit(compile_task, task, act, device) for task in tasks]
            for future in as_completed(futures):
                n_done, errs = future.result()
                done += n_done
                errors += errs
    except Exception as exc:  # noqa: BLE001 - a broken pool only costs compile time later
        errors.append(f"pool: {type(exc).__name__}: {exc}")
    seconds = time.perf_counter() - t0
    print(f"compiled {done} of {len(jobs)} kernels in {seconds:.1f} s on {workers} processes", flush=True)
    for err in errors[:20]:
        print(f"    {err}")
    return {"jobs": len(jobs), "launched": done, "errors": errors, "seconds": seconds, "workers": workers}


# ---- timing ------------------------------------------------------------------------------------------------
def bench_quant_shape(
    args, shape, act: str, copy_gbps: float, configs: dict | None, sm_count: int, device: str = "cuda"
) -> list[dict]:
    """One projection shape at every row count of ``args.rows``: the default tiles, the bf16 references and
    (``configs``: (ep, n, k, m) -> grid) the sweep, the full grid at each row tile's lead row count."""
    name, ep, n, k, count = shape
    weights, block, quant_bytes = quantized_weights(
        args.quant, ep, n, k, None, args.stream_mb * 2**20, device
    )
    rows = 2 * n if ep == GATE_UP else n
    bf16_bytes = rows * k * 2
    gen = torch.Generator(device).manual_seed(n * 7 + k + 1)
    dense_copies = max(2, -(-args.stream_mb * 2**20 // bf16_bytes))
    dense = [torch.randn(rows, k, device=device, generator=gen).mul_(k**-0.5).bfloat16()]
    dense += [dense[0].clone() for _ in range(dense_copies - 1)]
    activation = act if ep != PLAIN else None
    tiny = _tinygemm_weights(weights, rows, k, block)
    lead = lead_rows(args.rows)
    out, by_m = [], {}
    for m in row_order(args.rows):
        x = torch.randn(m, k, device=device, generator=gen).bfloat16()
        other = torch.randn(m, n, device=device, generator=gen).bfloat16() if ep == MUL else None

        def quant_ms(cfg, x=x, other=other) -> float:
            calls = [
                lambda w=w: quant_matmul(x, w[0], w[1], block, k, w[2], ep, activation, other, config=cfg)
                for w in weights
            ]
            return _graph_ms(calls, args.calls_per_graph, args.graph_replays)

        def bf16_ms(fn) -> float:
            return _graph_ms([lambda w=w: fn(w) for w in dense], args.calls_per_graph, args.graph_replays)

        def cublas(w, x=x, other=other):
            return epilogue_after(F.linear(x, w), ep, activation, other)

        def tinygemm_ms(x=x, other=other) -> float | None:
            calls = [lambda w=w: epilogue_after(tinygemm_matmul(x, w), ep, activation, other) for w in tiny]
            return _graph_ms(calls, args.calls_per_graph, args.graph_replays) if calls else None

        default_cfg = default_config(m, n, k, ep, weights[0][0].dtype == torch.int32, sm_count)
        default_ms = quant_ms(default_cfg)
        row = {
            "name": name,
            "epilogue": EPILOGUE_NAMES[ep],
            "n": n,
            "k": k,
            "rows": m,
            "row_tile": row_tile(m),
            "per_step": count,
            "scale_block": list(block),
            "quant_bytes": quant_bytes,
            "bf16_weight_bytes": bf16_bytes,
            "weight_copies": len(weights),
            "quant_ms": default_ms,
            "quant_config": default_cfg,
            "quant_gb_per_s": quant_bytes / default_ms / 1e6,
            "quant_copy_fraction": quant_bytes / default_ms / 1e6 / copy_gbps,
            "bf16_cublas_ms": bf16_ms(cublas),
            "bf16_skinny_ms": (
                bf16_ms(lambda w, x=x, other=other: skinny_matmul(x, w, ep, activation, other))
                if m <= 16
                else None
            ),
            "tinygemm_ms": tinygemm_ms(),  # torch's int4 kernel and the epilogue after it (int4 only)
        }
        if configs is not None:
            if lead[m] == m:
                grid = configs[(ep, n, k, m)]
            else:  # the lead row count's best configs, and the default
                ranked = sorted((t for t in by_m[lead[m]]["trials"] if "ms" in t), key=lambda t: t["ms"])
                grid = [t["config"] for t in ranked[: args.sweep_top]]
                grid += [] if default_cfg in grid else [default_cfg]
            row["sweep"] = by_m[m] = _sweep(grid, quant_ms, default_cfg, default_ms, quant_bytes, copy_gbps)
            row["sweep"]["full_grid"] = lead[m] == m
        out.append(row)
        _print_quant_row(row)
    weights.clear()
    dense.clear()
    tiny.clear()
    torch.cuda.empty_cache()
    return sorted(out, key=lambda r: r["rows"])


def _tinygemm_weights(weights: list, rows: int, k: int, block: tuple[int, int]) -> list:
    """The int4 weight copies in tinygemm's layout (the engine's ``G4SERVE_INT4_MATMUL=tinygemm`` path, the
    stacked gate_up as one [2N, K] weight), or [] for FP8 and shapes tinygemm has no layout for."""
    q, scale, zero = weights[0]
    if q.dtype != torch.int32 or not tinygemm_supported(rows, k, block):
        return []
    return [pack_tinygemm(q, s, z, k, block[1]) for q, s, z in weights]


def _sweep(grid: list[dict], quant_ms, default_cfg: dict, default_ms: float, nbytes: int, copy_gbps: float):
    """Each config of ``grid`` timed (the default's time reused), and the best."""
    trials = []
    for cfg in grid:
        if cfg == default_cfg:
            trials.append({"config": cfg, "ms": default_ms})
            continue
        try:
            trials.append({"config": cfg, "ms": quant_ms(cfg)})
        except Exception as exc:  # noqa: BLE001 - a tile the compiler rejects (registers, shared memory)
            print(f"    {cfg}: {type(exc).__name__}")
            trials.append({"config": cfg, "error": type(exc).__name__})
    timed = [t for t in trials if "ms" in t] or [{"config": default_cfg, "ms": default_ms}]
    best = min(timed, key=lambda t: t["ms"])
    return {
        "best": best["config"],
        "best_ms": best["ms"],
        "best_gb_per_s": nbytes / best["ms"] / 1e6,
        "best_copy_fraction": nbytes / best["ms"] / 1e6 / copy_gbps,
        "speedup_vs_default": default_ms / best["ms"],
        "trials": trials,
    }


QUANT_HEAD = (
    f"{'shape':>15s} {'N':>6s} {'K':>6s} {'M':>2s} {'x/step':>6s} {'bf16 cuBLAS':>11s} {'bf16 skinny':>11s} "
    f"{'quant us':>9s} {'GB/s':>6s} {'copy':>5s} {'tinygemm':>8s}"
)


def _print_quant_row(row: dict) -> None:
    skinny = row["bf16_skinny_ms"]
    line = (
        f"{row['name']:>15s} {row['n']:6d} {row['k']:6d} {row['rows']:2d} {row['per_step']:6d} "
        f"{row['bf16_cublas_ms'] * 1e3:11.2f} {(skinny * 1e3 if skinny else float('nan')):11.2f} "
        f"{row['quant_ms'] * 1e3:9.2f} {row['quant_gb_per_s']:6.0f} {row['quant_copy_fraction']:5.2f} "
        f"{(row['tinygemm_ms'] or float('nan')) * 1e3:8.2f}"
    )
    if "sweep" in row:
        sw = row["sweep"]
        line += f"  best {sw['best_ms'] * 1e3:8.2f} us {sw['best_gb_per_s']:6.0f} GB/s "
        line += f"{sw['best_copy_fraction']:5.2f}  "
        line += json.dumps(sw["best"])
    print(line, flush=True)


# ---- the best tiles per (preset, row tile, N, K) -----------------------------------------------------------
def bucket_best(quant: str, results: list[dict]) -> list[dict]:
    """Per shape and row tile: the config with the least summed time over the tile's row counts, among
    the configs timed at all of them (each row tile's lead ran the full grid, the others its best)."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        if "sweep" in r:
            groups.setdefault((r["name"], r["epilogue"], r["n"], r["k"], r["row_tile"]), []).append(r)
    entries = []
    for (name, epilogue, n, k, tile), rs in groups.items():
        per_config: dict[str, list[float]] = {}
        for r in rs:
            for t in r["sweep"]["trials"]:
                if "ms" in t:
                    per_config.setdefault(json.dumps(t["config"], sort_keys=True), []).append(t["ms"])
        complete = {c: sum(ms) for c, ms in per_config.items() if len(ms) == len(rs)}
        if not complete:
            continue
        best = min(complete, key=complete.get)
        entries.append(
            {
                "kind": quant,
                "m_bucket": tile,
                "n": n,
                "k": k,
                "name": name,
                "epilogue": epilogue,
                "rows": sorted(r["rows"] for r in rs),
                "config": _ordered(json.loads(best)),
                "best_ms_sum": complete[best],
                "default_ms_sum": sum(r["quant_ms"] for r in rs),
            }
        )
    return entries


CONFIG_KEYS = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "split_k")


def _ordered(cfg: dict) -> dict:
    """A config's keys in quant_matmul_config's order (they went through a sorted JSON key)."""
    return {
        key: cfg[key] for key in sorted(cfg, key=lambda k: CONFIG_KEYS.index(k) if k in CONFIG_KEYS else 99)
    }


def best_configs_python(entries: list[dict]) -> str:
    """The best tiles as python source: ``QUANT_MATMUL_CONFIGS[(preset, row tile, N, K)] = config`` (N per
    half for gate_up, as ``quant_matmul_config`` gets it; row tile 1 or quant_matmul's BLOCK_M)."""
    lines = ["QUANT_MATMUL_CONFIGS = {  # (quantization preset, row tile, N, K) -> quant_matmul config"]
    keys = {}
    for e in sorted(entries, key=lambda e: (e["kind"], e["m_bucket"], e["n"], e["k"])):
        key = (e["kind"], e["m_bucket"], e["n"], e["k"])
        if key in keys:  # two epilogues of one (N, K): the second keeps its epilogue in the key
            key += (e["epilogue"],)
        keys[key] = e
        us, default_us = e["best_ms_sum"] * 1e3, e["default_ms_sum"] * 1e3
        lines.append(
            f"    {key!r}: {e['config']!r},  # {e['name']} ({e['epilogue']}) M={e['rows']}: "
            f"{us:.2f} us vs {default_us:.2f} default"
        )
    lines.append("}")
    return "\n".join(lines) + "\n"


def step_totals(results: list[dict], entries: list[dict], rows: list[int]) -> dict[str, dict]:
    """Per row count, microseconds of one decode step's quantized projections (count x time)."""
    chosen = {
        (e["name"], e["n"], e["k"], e["m_bucket"]): json.dumps(e["config"], sort_keys=True) for e in entries
    }
    totals = {}
    for m in rows:
        rs = [r for r in results if r["rows"] == m]
        t = {
            "quant_default_us": sum(r["quant_ms"] * r["per_step"] for r in rs) * 1e3,
            "bf16_cublas_us": sum(r["bf16_cublas_ms"] * r["per_step"] for r in rs) * 1e3,
            "quant_bytes": sum(r["quant_bytes"] * r["per_step"] for r in rs),
        }
        if rs and all(r.get("tinygemm_ms") is not None for r in rs):
            t["tinygemm_us"] = sum(r["tinygemm_ms"] * r["per_step"] for r in rs) * 1e3
        if all(r["bf16_skinny_ms"] is not None for r in rs):
            t["bf16_skinny_us"] = sum(r["bf16_skinny_ms"] * r["per_step"] for r in rs) * 1e3
        if rs and all("sweep" in r for r in rs):
            t["quant_best_us"] = sum(r["sweep"]["best_ms"] * r["per_step"] for r in rs) * 1e3
            chosen_us = 0.0
            for r in rs:
                cfg = chosen.get((r["name"], r["n"], r["k"], r["row_tile"]))
                ms = [x["ms"] for x in r["sweep"]["trials"] if json.dumps(x["config"], sort_keys=True) == cfg]
                chosen_us += (ms[0] if ms else r["quant_ms"]) * r["per_step"]
            t["quant_chosen_us"] = chosen_us * 1e3  # summed as the best's, so equal times give equal sums
        totals[str(m)] = t
    return totals


def run_quant(args, env: dict, device: str = "cuda") -> int:
    assert all(1 <= m <= SKINNY_ROWS for m in args.rows), f"--quant times 1..{SKINNY_ROWS} rows"
    act = PRESETS[args.preset]().text.hidden_activation
    shapes = quant_shapes(args.preset)
    sm_count = env["device_sm_count"]
    copy_gbps = copy_gb_per_s(args.copy_mb * 2**20, device)
    print(f"device copy: {copy_gbps:.0f} GB/s (read + write, {args.copy_mb} MiB)")
    wq = QUANTIZATION_PRESETS[args.quant].groups[0].weights
    configs, compile_report = None, None
    if args.sweep:
        configs = {
            (ep, n, k, m): sweep_configs(m, n, k, ep, scale_block(wq, ep, n, k)[1], sm_count, wq.kind == INT4)
            for _, ep, n, k, _ in shapes
            for m in args.rows
        }
        if args.compile_workers > 0:
            jobs = compile_jobs(args.quant, shapes, args.rows, configs)
            compile_report = precompile(jobs, act, args.compile_workers)
    path = kernel_result_path(args.out_dir, "gemv_kernels", env, args.preset, f"_{args.quant}")
    units = {
        "*_ms": "milliseconds per call (CUDA-graph replay, weights streamed from HBM)",
        "*_us": "microseconds per decode step (sum over projections of per_step x time)",
        "*_gb_per_s": "1e9 bytes/s of quantized weight (values, scales and zero points)",
        "*_copy_fraction": "quant GB/s over copy_gb_per_s",
        "copy_gb_per_s": "device-to-device copy, 1e9 bytes/s read plus written",
        "quant_bytes": "bytes of the quantized weight (values, scales and zero points)",
        "per_step": "calls of this shape in one decode step",
        "row_tile": "the m-bucket: 1 (FMA path) or quant_matmul's BLOCK_M",
    }
    results: list[dict] = []

    def save(complete: bool) -> dict:
        entries = bucket_best(args.quant, results)
        doc = {
            "environment": env,
            "preset": args.preset,
            "quant": args.quant,
            "weight_kind": wq.kind,
            "weight_strategy": wq.strategy,
            "dtype": "bfloat16",
            "rows": args.rows,
            "copy_gb_per_s": copy_gbps,
            "sweep": args.sweep,
            "compile": compile_report,
            "complete": complete,
            "units": units,
            "results": results,
            "step_totals": step_totals(results, entries, args.rows) if complete else None,
            "best_configs": entries,
            "best_configs_python": best_configs_python(entries),
        }
        path.write_text(json.dumps(doc, indent=2))
        return doc

    print(QUANT_HEAD)
    for shape in shapes:
        results += bench_quant_shape(args, shape, act, copy_gbps, configs, sm_count, device)
        save(complete=False)  # a run cut short keeps what it measured
    doc = save(complete=True)
    print(f"\nper decode step ({args.quant}, quantized projections; the LM head stays bf16), us:")
    for m, t in doc["step_totals"].items():
        line = (
            f"  M={m}: bf16 cuBLAS {t['bf16_cublas_us']:8.1f}"
            f"   bf16 skinny {t.get('bf16_skinny_us', float('nan')):8.1f}"
            f"   quant default {t['quant_default_us']:8.1f}"
            f" ({t['quant_bytes'] / t['quant_default_us'] / 1e3:5.0f} GB/s)"
        )
        if "tinygemm_us" in t:
            line += f"   tinygemm {t['tinygemm_us']:8.1f}"
        if "quant_best_us" in t:
            line += (
                f"   best per M {t['quant_best_us']:8.1f}   chosen per row tile {t['quant_chosen_us']:8.1f}"
            )
        print(line)
    floor_us = doc["step_totals"][str(args.rows[0])]["quant_bytes"] / copy_gbps / 1e3
    print(f"  bytes at the copy bandwidth: {floor_us:.1f} us")
    if args.sweep:
        print("\n" + doc["best_configs_python"])
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
