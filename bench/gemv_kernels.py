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
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from g4serve.bench.meta import cuda_environment
from g4serve.bench.timing import graph_replay_ms
from g4serve.config import PRESETS
from g4serve.kernels.act_mul import act_mul
from g4serve.kernels.gemv import GATE_UP, MUL, PLAIN, gemv_config, skinny_matmul, use_skinny

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


def _configs(m: int) -> list[dict[str, int]]:
    if m == 1:
        return [
            {"block_n": bn, "block_k": bk, "num_warps": w, "num_stages": 1}
            for bn, bk, w in itertools.product((1, 2, 4, 8), (512, 1024, 2048), (4, 8))
        ]
    return [
        {"block_n": bn, "block_k": bk, "num_warps": w, "num_stages": s}
        for bn, bk, w, s in itertools.product((16, 32, 64), (64, 128, 256), (4,), (3, 4))
    ]


def bench_shape(args, name: str, ep: int, n: int, k: int, m: int, act: str) -> dict:
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
        y = F.linear(x, w)
        if ep == GATE_UP:
            return act_mul(act, y[:, :n], y[:, n:])
        return act_mul(act, y, other) if ep == MUL else y

    def time(fn) -> float:
        return graph_replay_ms([lambda w=w: fn(w) for w in weights], args.calls_per_graph, args.graph_replays)

    base = time(cublas)
    default_cfg = gemv_config(m, n, k, ep)
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
        "engine_uses_skinny": use_skinny(m, n, k, ep),
    }
    if args.sweep:
        trials = []
        for cfg in _configs(m):
            try:
                ms = time(lambda w, cfg=cfg: skinny_matmul(x, w, ep, activation, other, config=cfg))
            except Exception as exc:  # noqa: BLE001 - a tile the compiler rejects (registers, shared memory)
                print(f"    {cfg}: {type(exc).__name__}")
                continue
            trials.append({"config": cfg, "ms": ms})
        best = min(trials, key=lambda t: t["ms"])
        row["sweep"] = {"best": best["config"], "best_ms": best["ms"], "trials": trials}
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
    act = PRESETS[args.preset]().text.hidden_activation
    shapes = decode_shapes(args.preset)
    results = []
    head = (
        f"{'shape':>15s} {'N':>7s} {'K':>6s} {'M':>2s} {'x/step':>6s} {'cuBLAS us':>10s} {'skinny us':>10s} "
        f"{'GB/s':>6s} {'speedup':>7s}" + (f" {'best us':>8s}  best tiles" if args.sweep else "")
    )
    print(head)
    for m in args.rows:
        for name, ep, n, k, count in shapes:
            r = bench_shape(args, name, ep, n, k, m, act)
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
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    device = env["device_name"].lower().replace(" ", "-")
    path = out_dir / f"gemv_kernels_{stamp}_{device}_{args.preset}.json"
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
                "results": results,
            },
            indent=2,
        )
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
