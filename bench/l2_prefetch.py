"""What an L2 prefetch buys a decode GEMV that follows a stretch of idle HBM: the experiment behind the
finding in docs/benchmarks.md ("H100: L2 prefetch of a decode step's next weights"), kept to be rerun.

Between a decode step's projections run kernels that stream almost nothing from HBM (norms, the attention
prologue, attention and its merge). The idea: ask L2 for the next projection's first bytes before such a
stretch, so HBM works through it and the GEMV reads its head from L2. The prefetch kernel below takes up to
``MAX_REGIONS`` byte ranges (grid axis 1 picks the range), each lane of a program covering ``CHUNK`` bytes:
one ``cp.async.bulk.prefetch.L2`` per lane (``bulk``) or one ``prefetch.global.L2`` per 128-byte line
(``line``). Neither returns data or changes a tensor; measured on an H100, a program that issued them does
not finish before its lines arrive.

Each call of the chain is: a prefetch of the weight's first X MB (none at X = 0), a kernel that only spins
for T microseconds (standing in for the norms and attention), then the one-row GEMV over the weight (the
engine's own ``layers.fused.project``), with programmatic dependent launch as in a decode step. The chain
cycles over enough weight copies that each GEMV's bytes come from HBM unless prefetched; it is replayed from
a CUDA graph. Without a prefetch a call takes T + the GEMV; a prefetch that overlapped the spin would save
up to min(T, X / bandwidth) of the GEMV. Modes are ``bulk:<chunk>:<lanes>`` and ``line:<chunk>:<lanes>``,
launched in the chain before the spin, and ``side-bulk:...`` / ``side-line:...``, launched on a second
stream forked there and joined after the GEMV. The table gives each mode's saving against X = 0 at the
same T; the JSON every time.

    python bench/l2_prefetch.py
    python bench/l2_prefetch.py --shapes 20480x2560 --spin-us 0 8 --prefetch-mb 0 16 \
        --modes side-line:4096:128
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
import triton
import triton.language as tl

from g4serve.bench.meta import cuda_environment, kernel_result_path
from g4serve.bench.timing import graph_replay_ms
from g4serve.kernels._launch import pdl, wait_for_previous_kernel
from g4serve.layers.fused import project

ROOT = Path(__file__).resolve().parent.parent


MAX_REGIONS = 4
ALIGN = 16  # the bulk form's address and size granularity


@triton.jit
def _l2_prefetch_kernel(
    a0, n0, a1, n1, a2, n2, a3, n3,
    CHUNK: tl.constexpr, LANES: tl.constexpr, BULK: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may start: nothing here is read by it
    region = tl.program_id(1)
    base = tl.where(region == 0, a0, tl.where(region == 1, a1, tl.where(region == 2, a2, a3))).to(tl.int64)
    size = tl.where(region == 0, n0, tl.where(region == 1, n1, tl.where(region == 2, n2, n3))).to(tl.int64)
    lane = tl.program_id(0) * LANES + tl.arange(0, LANES)
    start = lane.to(tl.int64) * CHUNK
    length = tl.minimum(size - start, CHUNK)
    if BULK:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s64 p, $2, 0; "
            "@p cp.async.bulk.prefetch.L2.global [$1], $3; mov.u32 $0, 0; }",
            "=r,l,l,r",
            [base + start, length, length.to(tl.int32)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
    else:
        for line in tl.static_range(0, CHUNK, 128):  # a prefetch.global.L2 asks for one 128-byte line
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.gt.s64 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                "=r,l,l",
                [base + start + line, length - line],
                dtype=tl.int32,
                is_pure=False,
                pack=1,
            )
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # exit after the previous kernel: the next one's wait covers both


def clip(tensor: torch.Tensor, offset: int, nbytes: int) -> tuple[int, int] | None:
    """(address, bytes) of ``tensor``'s storage bytes [offset, offset + nbytes), shrunk inward to 16-byte
    boundaries and to the tensor's own bytes; None when nothing is left."""
    total = tensor.numel() * tensor.element_size()
    begin = tensor.data_ptr() + max(0, offset)
    end = tensor.data_ptr() + min(total, offset + nbytes)
    begin = -(-begin // ALIGN) * ALIGN
    end = end // ALIGN * ALIGN
    return (begin, end - begin) if end > begin else None


def launch_shape(sizes: Sequence[int], chunk: int, lanes: int) -> tuple[int, int]:
    """The grid (programs, regions) that gives every ``chunk`` of the largest region a lane."""
    per_program = chunk * lanes
    return max(-(-size // per_program) for size in sizes), len(sizes)


def launch_args(
    spans: Sequence[tuple[int, int]], bulk: bool, chunk: int | None, lanes: int
) -> tuple[tuple[int, int], list[int], dict]:
    """(grid, arguments, meta-parameters) of the launch that prefetches ``spans`` ((address, bytes), at most
    ``MAX_REGIONS``, 16-byte aligned): ``chunk`` bytes a lane (default 64 KB in bulk, 4 KB by lines)."""
    if len(spans) > MAX_REGIONS:
        raise ValueError(f"l2_prefetch takes at most {MAX_REGIONS} ranges a launch, got {len(spans)}")
    chunk = chunk or (1 << 16 if bulk else 1 << 12)
    args: list[int] = []
    for address, size in list(spans) + [(0, 0)] * (MAX_REGIONS - len(spans)):
        args += [address, size]
    meta = dict(CHUNK=chunk, LANES=lanes, BULK=bulk, num_warps=max(1, lanes // 32))
    return launch_shape([n for _, n in spans], chunk, lanes), args, meta


def l2_prefetch(
    regions: Sequence[tuple[torch.Tensor, int, int]],
    bulk: bool = True,
    chunk: int | None = None,
    lanes: int = 32,
    dependent: bool = True,
) -> None:
    """Start fetching ``regions`` (tensor, byte offset, bytes) into L2: one launch of at most ``MAX_REGIONS``
    ranges, on the current stream (captured into CUDA graphs like any kernel). Ranges on the CPU, or empty
    after alignment, are skipped. ``dependent``: with programmatic dependent launch, for a launch inside a
    chain of such kernels. The launch finishes only when its lines have arrived (measured on an H100: a
    kernel's prefetches hold it like loads), so a chain waits for it; the ``side-`` modes launch it on a
    stream of its own beside the chain."""
    spans = [span for t, off, n in regions if t.is_cuda and (span := clip(t, off, n)) is not None]
    if not spans:
        return
    device = next(t.device for t, _, _ in regions if t.is_cuda)
    grid, args, meta = launch_args(spans, bulk, chunk, lanes)
    launch = pdl(device, 1) if dependent else {"USE_PDL": False}
    _l2_prefetch_kernel[grid](*args, **meta, **launch)


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
