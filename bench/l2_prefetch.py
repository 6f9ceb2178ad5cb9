"""What an L2 prefetch buys a decode GEMV that follows a stretch of idle HBM (kernels/l2_prefetch.py).

Each call of the chain is: a prefetch of the weight's first X MB (none at X = 0), a kernel that only spins
for T microseconds (standing in for the norms and attention between two projections), then the one-row GEMV
over the weight (the engine's own ``layers.fused.project``), all with programmatic dependent launch as in a
decode step. The chain cycles over enough weight copies that each GEMV's bytes come from HBM unless
prefetched; it is replayed from a CUDA graph. Without a prefetch a call takes T + the GEMV; with one it can
take as little as max(T, X / bandwidth) + the GEMV's remaining bytes: the table gives each mode's saving
against X = 0 at the same T, and the JSON every time. Modes are ``bulk:<chunk>:<lanes>`` (one
``cp.async.bulk.prefetch.L2`` per lane and chunk) and ``line:<chunk>:<lanes>`` (a prefetch per 128-byte line),
launched in the chain before the spin; ``side-bulk:...`` and ``side-line:...`` launch them on a second stream
forked there and joined after the GEMV, as the decode step does (``layers.prefetch``).

    python bench/l2_prefetch.py
    python bench/l2_prefetch.py --shapes 20480x2560 --spin-us 0 8 --prefetch-mb 0 16 --modes bulk:65536:32
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from g4serve.bench.meta import cuda_environment, kernel_result_path
from g4serve.bench.timing import graph_replay_ms
from g4serve.kernels._launch import pdl, wait_for_previous_kernel
from g4serve.kernels.l2_prefetch import l2_prefetch
from g4serve.layers.fused import project

ROOT = Path(__file__).resolve().parent.parent


@triton.jit
def _now(dummy):
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l,r", [dummy], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def _spin_kernel(ns, USE_PDL: tl.constexpr):
    wait_for_previous_kernel(USE_PDL)
    start = _now(tl.program_id(0))
    now = start
    while now - start < ns:
        now = _now(tl.program_id(0))


def spin(ns: int, device: torch.device) -> None:
    _spin_kernel[(1,)](ns, num_warps=1, **pdl(device, 1))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--shapes", nargs="+", default=["20480x2560", "2560x2048"], help="weights N x K (bf16)")
    p.add_argument("--spin-us", type=float, nargs="+", default=[0, 4, 8, 16])
    p.add_argument("--prefetch-mb", type=float, nargs="+", default=[0, 8, 16, 32])
    p.add_argument(
        "--modes",
        nargs="+",
        default=["line:4096:128", "side-bulk:16384:32", "side-line:4096:128", "side-line:1024:128"],
    )
    p.add_argument(
        "--stream-mb", type=int, default=1024, help="bytes of weight copies each graph cycles over"
    )
    p.add_argument("--calls-per-graph", type=int, default=32)
    p.add_argument("--graph-replays", type=int, default=7)
    p.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    return p.parse_args(argv)


def bench_shape(args, n: int, k: int) -> list[dict]:
    device = torch.device("cuda")
    nbytes = n * k * 2
    copies = max(2, -(-args.stream_mb * (1 << 20) // nbytes))
    weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(copies)]
    x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    rows = []
    for spin_us in args.spin_us:
        for mb in args.prefetch_mb:
            size = min(int(mb * (1 << 20)), nbytes)
            for mode in args.modes if size else ["none"]:
                kind, chunk, lanes = (mode.split(":") + ["0", "0"])[:3]
                beside = kind.startswith("side-")

                def call(w, size=size, bulk=kind.endswith("bulk"), chunk=int(chunk), lanes=int(lanes)):
                    main = torch.cuda.current_stream()
                    if size and beside:  # forked after the previous call, joined after this GEMV
                        side.wait_stream(main)
                        with torch.cuda.stream(side):
                            l2_prefetch([(w, 0, size)], bulk=bulk, chunk=chunk, lanes=lanes, dependent=False)
                    elif size:
                        l2_prefetch([(w, 0, size)], bulk=bulk, chunk=chunk, lanes=lanes)
                    if spin_us:
                        spin(int(spin_us * 1000), device)
                    project(x, w)
                    if size and beside:
                        main.wait_stream(side)

                us = 1e3 * graph_replay_ms(
                    [lambda w=w: call(w) for w in weights], args.calls_per_graph, args.graph_replays
                )
                mb_done = size / (1 << 20)
                rows.append(
                    {"n": n, "k": k, "spin_us": spin_us, "prefetch_mb": mb_done, "mode": mode, "us": us}
                )
                base = next((r["us"] for r in rows if r["spin_us"] == spin_us and r["mode"] == "none"), us)
                print(
                    f"  {n}x{k} spin {spin_us:4.0f} us  prefetch {size / (1 << 20):5.1f} MB {mode:16s}"
                    f" {us:8.2f} us  saved {base - us:6.2f} us"
                )
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/l2_prefetch.py times CUDA kernels: no CUDA device here", file=sys.stderr)
        return 2
    env = cuda_environment()
    props = torch.cuda.get_device_properties(0)
    rows = []
    for shape in args.shapes:
        n, k = (int(v) for v in shape.split("x"))
        rows += bench_shape(args, n, k)
        torch.cuda.empty_cache()
    out = kernel_result_path(args.out_dir, "l2_prefetch", env, "shapes")
    result = {"benchmark": "l2_prefetch", **env, "l2_bytes": props.L2_cache_size, "rows": rows}
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
