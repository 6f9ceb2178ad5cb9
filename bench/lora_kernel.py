"""The batched multi-adapter LoRA op on the GPU at Gemma 4 E4B shapes: the Triton kernels vs the torch
reference, beside the dense base projection ``x @ W.T`` it is added to.

For every projection (q 2560->2048, k/v 2560->512, o 2048->2560, MLP gate/up 2560->10240, down
10240->2560), rank, adapter count and token count, the script times ``add_lora`` replayed from a CUDA graph
(cycling over copies of the adapter stacks and over token-to-slot maps that spread the tokens over all
adapters in shuffled order, as a captured decode step runs it), the reference eagerly (it syncs, so it
cannot be captured; torch.cuda.Event over many calls), and the dense projection from a CUDA graph cycling
over weight copies (>= ``--stream-mb``, so weights come from HBM). ``--sweep`` also tries tile configs.
Writes JSON (git commit, device, torch/triton versions, command, shapes, every time in microseconds) to
bench/results/.

    python bench/lora_kernel.py                                  # the full grid
    python bench/lora_kernel.py --projections q down --tokens 1 64 --ranks 16 --sweep
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

from g4serve.bench.meta import cuda_environment, kernel_result_path
from g4serve.bench.timing import graph_replay_ms
from g4serve.kernels.lora import LoraTiles, add_lora, add_lora_reference, lora_tiles

ROOT = Path(__file__).resolve().parent.parent
# name -> (N out, K in) of Gemma 4 E4B: hidden 2560, 8 q heads x 256, 2 kv heads x 256, MLP 10240
PROJECTIONS = {
    "q": (2048, 2560),
    "kv": (512, 2560),
    "o": (2560, 2048),
    "gate_up": (10240, 2560),
    "down": (2560, 10240),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--projections", nargs="+", default=list(PROJECTIONS), choices=list(PROJECTIONS))
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 64])
    p.add_argument("--adapters", type=int, nargs="+", default=[1, 4])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512, 2048])
    p.add_argument(
        "--layouts",
        nargs="+",
        default=["interleaved", "runs"],
        choices=["interleaved", "runs"],
        help="token order of the slots: shuffled (a decode batch) or one run per adapter (prefill chunks)",
    )
    p.add_argument("--stream-mb", type=int, default=256, help="bytes of weight copies each graph cycles over")
    p.add_argument("--max-copies", type=int, default=64, help="at most this many adapter-stack copies")
    p.add_argument("--calls-per-graph", type=int, default=64)
    p.add_argument("--graph-replays", type=int, default=7)
    p.add_argument("--reference-ms", type=int, default=100, help="eager timing of the reference (do_bench)")
    p.add_argument("--sweep", action="store_true", help="also time a set of tile configs per shape")
    p.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    return p.parse_args(argv)


def _shrink_variants(num_tokens: int, k: int) -> list[dict]:
    if num_tokens <= 64:
        return [{"k_per_split": c} for c in (128, 256, 512, 1024)]
    return [
        {"shrink_block_m": bm, "block_k": bk, "k_per_split": max(bk, k // parts), "shrink_warps": w}
        for bm in (64, 128)
        for bk in (64, 128)
        for parts in (1, 2, 4, 8)
        for w in (4, 8)
    ]


def _expand_variants(num_tokens: int) -> list[dict]:
    block_ms = (16,) if num_tokens <= 64 else (32, 64, 128)
    return [
        {"expand_block_m": bm, "block_n": bn, "expand_warps": w}
        for bm in block_ms
        for bn in (32, 64, 128, 256)
        for w in (4, 8)
    ]


def sweep(num_tokens: int, n: int, k: int, time_tiles) -> dict:
    """Coordinate search from the default tiles: the shrink's, then the expand's."""
    best_tiles = lora_tiles(num_tokens, n, k)
    best_us = time_tiles(best_tiles)
    trials = [{"tiles": vars(best_tiles), "lora_graph_us": best_us}]
    for variants in (_shrink_variants(num_tokens, k), _expand_variants(num_tokens)):
        base = best_tiles
        for change in variants:
            tiles = dataclasses.replace(base, **change)
            if tiles == base:
                continue
            try:
                t_us = time_tiles(tiles)
            except Exception as exc:  # noqa: BLE001 - a tile the compiler rejects (registers, shared memory)
                print(f"    {vars(tiles)}: {type(exc).__name__}")
                continue
            trials.append({"tiles": vars(tiles), "lora_graph_us": t_us})
            if t_us < best_us:
                best_tiles, best_us = tiles, t_us
    return {"best": vars(best_tiles), "best_us": best_us, "trials": trials}


def _slot_maps(num_tokens: int, num_slots: int, layout: str, gen: torch.Generator) -> list[torch.Tensor]:
    """Every token on an adapter, each on ~T/S tokens: shuffled, or in S runs of consecutive tokens."""
    if layout == "runs":
        return [(torch.arange(num_tokens, device="cuda") * num_slots // num_tokens).int()]
    by_token = torch.arange(num_tokens, device="cuda") % num_slots
    return [by_token[torch.randperm(num_tokens, device="cuda", generator=gen)].int() for _ in range(8)]


def dense_us(args, n: int, k: int, num_tokens: int) -> float:
    gen = torch.Generator("cuda").manual_seed(n + k)
    x = torch.randn(num_tokens, k, device="cuda", generator=gen).bfloat16()
    copies = max(2, -(-args.stream_mb * 2**20 // (n * k * 2)))
    weights = [torch.randn(n, k, device="cuda", generator=gen).bfloat16() for _ in range(copies)]
    calls = [lambda w=w: torch.nn.functional.linear(x, w) for w in weights]
    return graph_replay_ms(calls, args.calls_per_graph, args.graph_replays) * 1e3


def bench_shape(
    args, name: str, n: int, k: int, rank: int, num_slots: int, num_tokens: int, layout: str, dense: float
) -> dict:
    gen = torch.Generator("cuda").manual_seed(n + k + rank + num_slots + num_tokens)
    stack_bytes = num_slots * rank * (n + k) * 2
    copies = max(2, min(args.max_copies, -(-args.stream_mb * 2**20 // stack_bytes)))
    stacks = [
        (
            (torch.randn(num_slots, rank, k, device="cuda", generator=gen) * k**-0.5).bfloat16(),
            (torch.randn(num_slots, n, rank, device="cuda", generator=gen) * 1e-3).bfloat16(),
        )
        for _ in range(copies)
    ]
    slot_maps = _slot_maps(num_tokens, num_slots, layout, gen)
    x = torch.randn(num_tokens, k, device="cuda", generator=gen).bfloat16()
    y = torch.randn(num_tokens, n, device="cuda", generator=gen).bfloat16()

    def lora_calls(tiles: LoraTiles | None = None):
        return [
            lambda a=a, b=b, s=slot_maps[i % len(slot_maps)]: add_lora(y, x, a, b, s, tiles=tiles)
            for i, (a, b) in enumerate(stacks)
        ]

    def us(calls) -> float:
        return graph_replay_ms(calls, args.calls_per_graph, args.graph_replays) * 1e3

    lora_us = us(lora_calls())
    a0, b0 = stacks[0]
    reference_us = (
        do_bench(lambda: add_lora_reference(y, x, a0, b0, slot_maps[0]), warmup=10, rep=args.reference_ms)
        * 1e3
    )
    cfg = lora_tiles(num_tokens, n, k)
    row = {
        "projection": name,
        "n": n,
        "k": k,
        "rank": rank,
        "adapters": num_slots,
        "tokens": num_tokens,
        "slot_layout": layout,
        "tiles": vars(cfg),
        "lora_graph_us": lora_us,
        "reference_eager_us": reference_us,
        "dense_graph_us": dense,
        "lora_over_dense": lora_us / dense,
        "speedup_vs_reference": reference_us / lora_us,
        "adapter_bytes": stack_bytes,
        "adapter_stack_copies": copies,
    }
    if args.sweep:
        row["sweep"] = sweep(num_tokens, n, k, lambda t: us(lora_calls(t)))
    stacks.clear()
    torch.cuda.empty_cache()
    return row


def cases(args):
    """(projection, rank, adapters, tokens, layout); one layout where they coincide (one adapter or token)."""
    for name, rank, num_slots, num_tokens in itertools.product(
        args.projections, args.ranks, args.adapters, args.tokens
    ):
        layouts = args.layouts if num_slots > 1 and num_tokens > 1 else args.layouts[:1]
        for layout in layouts:
            yield name, rank, num_slots, num_tokens, layout


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/lora_kernel.py needs a CUDA device", file=sys.stderr)
        return 2
    env = cuda_environment()
    print(json.dumps(env, indent=2))
    head = (
        f"{'proj':>8s} {'N':>6s} {'K':>6s} {'R':>3s} {'S':>2s} {'T':>5s} {'layout':>11s} {'lora us':>9s} "
        f"{'ref us':>9s} {'dense us':>9s} {'lora/dense':>10s}"
    )
    print(head + (f" {'best us':>8s}  best tiles" if args.sweep else ""))
    rows, dense = [], {}
    for name, rank, num_slots, num_tokens, layout in cases(args):
        n, k = PROJECTIONS[name]
        if (n, k, num_tokens) not in dense:
            dense[n, k, num_tokens] = dense_us(args, n, k, num_tokens)
        r = bench_shape(args, name, n, k, rank, num_slots, num_tokens, layout, dense[n, k, num_tokens])
        rows.append(r)
        line = (
            f"{name:>8s} {n:6d} {k:6d} {rank:3d} {num_slots:2d} {num_tokens:5d} {layout:>11s} "
            f"{r['lora_graph_us']:9.2f} {r['reference_eager_us']:9.1f} {r['dense_graph_us']:9.2f} "
            f"{r['lora_over_dense']:10.3f}"
        )
        if args.sweep:
            line += f" {r['sweep']['best_us']:8.2f}  {r['sweep']['best']}"
        print(line, flush=True)

    path = kernel_result_path(args.out_dir, "lora_kernel", env, "e4b")
    units = {
        "*_us": "microseconds per call",
        "lora_graph_us": "add_lora (shrink + expand kernels), CUDA-graph replay",
        "reference_eager_us": "add_lora_reference, eager (torch.cuda.Event via triton do_bench)",
        "dense_graph_us": "F.linear(x, W) of the base projection, CUDA-graph replay, W from HBM",
        "adapter_bytes": "bytes of one copy of the A and B stacks (bf16)",
    }
    path.write_text(
        json.dumps(
            {
                "environment": env,
                "preset": "e4b",
                "dtype": "bfloat16",
                "shapes": {name: dict(zip(("n", "k"), PROJECTIONS[name])) for name in args.projections},
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
