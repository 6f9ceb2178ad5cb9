"""Paged attention kernels on the GPU: decode and chunked prefill at head_dim 256 vs 512.

For every (kind, head_dim, batch, context) the script times one call from a CUDA graph (over rotating
input copies, so K/V come from HBM, not L2; plus the eager time with Python and launch overhead),
counts the bytes it must move (K/V of the context once, Q in, O out, block tables) and reports
achieved GB/s and TFLOP/s. The question it answers: does a
head_dim-512 call run within 1.3x of a head_dim-256 call per byte moved (``d512_vs_d256_time_per_byte``
<= 1.3)? Writes JSON (device, torch/triton versions, git commit, command, every figure with its unit)
to bench/results/.

    python bench/attention_kernels.py                                  # E4B heads (8 q / 2 kv), bf16
    python bench/attention_kernels.py --q-heads 32 --kv-heads 4        # 31B global-layer heads
    python bench/attention_kernels.py --sweep --batch 8 --context 4096 # try tile configs per shape
    python bench/attention_kernels.py --kinds decode --kv-cache-dtype auto fp8   # an FP8 cache beside bf16

Decode: ``batch`` sequences, one query each, at ``context`` tokens. ``--kv-cache-dtype fp8`` stores K/V in
e4m3 with a scale per KV head, as the engine's FP8 cache does (bytes moved count one byte a value).
Prefill: ``batch`` sequences each adding a ``--prefill-chunk``-token chunk at the end of ``context``
tokens (a chunked prefill after a prefix hit; causal), sized down by ``--max-prefill-tokens``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
from pathlib import Path

import torch
from triton.testing import do_bench

from g4serve.bench.meta import cuda_environment
from g4serve.bench.timing import graph_replay_ms
from g4serve.kernels.kv_cache_write import KV_FP8_DTYPE
from g4serve.kernels.paged_decode import decode_config, decode_num_splits, paged_decode_attention
from g4serve.kernels.paged_prefill import paged_prefill_attention, prefill_config

ROOT = Path(__file__).resolve().parent.parent
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--kinds", nargs="+", default=["decode", "prefill"], choices=["decode", "prefill"])
    p.add_argument("--head-dims", type=int, nargs="+", default=[256, 512])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--context", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--q-heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument(
        "--kv-cache-dtype",
        nargs="+",
        default=["auto"],
        choices=["auto", "fp8"],
        help="the cache's storage: auto (--dtype) or fp8 (e4m3, a scale per KV head); several: each in turn",
    )
    p.add_argument(
        "--window",
        type=int,
        default=None,
        help="sliding window for every run (default: none, so both head dims read the same context)",
    )
    p.add_argument("--prefill-chunk", type=int, default=512, help="new tokens per sequence in a prefill call")
    p.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=16384,
        help="prefill calls with more query tokens (batch x chunk) are skipped",
    )
    p.add_argument("--num-splits", type=int, default=None, help="decode split-KV count (default: the policy)")
    p.add_argument("--sweep", action="store_true", help="also time a grid of tile configs per shape")
    p.add_argument(
        "--cold-bytes",
        type=int,
        default=256 << 20,
        help="graph timing cycles over input copies until this many bytes lie between two uses",
    )
    p.add_argument("--graph-replays", type=int, default=7)
    p.add_argument("--warmup-ms", type=int, default=10, help="eager timing (do_bench)")
    p.add_argument("--rep-ms", type=int, default=50, help="eager timing (do_bench)")
    p.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    return p.parse_args(argv)


def _paged_inputs(
    batch: int,
    context: int,
    args,
    head_dim: int,
    dtype: torch.dtype,
    query_len: int,
    kv_fp8: bool = False,
    device: str = "cuda",
):
    """Random K/V for ``batch`` sequences of ``context`` tokens in shuffled pages, their queries, and the
    K/V scales the kernels take (an FP8 cache: e4m3 values, one fp32 scale per KV head; else none)."""
    page = args.page_size
    blocks_per_seq = -(-context // page)
    num_blocks = batch * blocks_per_seq
    k_cache = torch.randn(num_blocks * page, args.kv_heads, head_dim, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    scales = {}
    if kv_fp8:
        k_cache, v_cache = k_cache.to(KV_FP8_DTYPE), v_cache.to(KV_FP8_DTYPE)
        scale = torch.full((args.kv_heads,), 0.5, device=device, dtype=torch.float32)
        scales = {"k_scale": scale, "v_scale": scale.clone()}
    tables = torch.randperm(num_blocks, device=device).to(torch.int32).view(batch, blocks_per_seq)
    q = torch.randn(batch * query_len, args.q_heads, head_dim, device=device, dtype=dtype) * 0.25
    return k_cache, v_cache, tables, q, scales


def time_call(make_call, input_bytes: int, args) -> tuple[float, float]:
    """(kernel_ms, eager_ms) of one call.

    kernel_ms: calls replayed from a CUDA graph, cycling over enough input copies that the K/V never sit
    in L2 (>= ``--cold-bytes`` between two uses of one copy): what the kernels cost inside the engine's
    captured decode step. eager_ms: ``do_bench`` of plain calls, Python and launch overhead included.
    """
    copies = max(1, min(64, -(-args.cold_bytes // max(input_bytes, 1))))
    calls = [make_call() for _ in range(copies)]
    eager_ms = do_bench(calls[0], warmup=args.warmup_ms, rep=args.rep_ms)
    kernel_ms = graph_replay_ms(calls, 32, args.graph_replays)
    del calls
    return kernel_ms, eager_ms


def _row(
    kind: str,
    head_dim: int,
    batch: int,
    context: int,
    overrides,
    kernel_ms: float,
    eager_ms: float,
    total: int,
    kv_bytes: int,
    flops: float,
    **extra,
) -> dict:
    return {
        "kind": kind,
        "head_dim": head_dim,
        "batch": batch,
        "context": context,
        **extra,
        "config": overrides or None,
        "time_ms": kernel_ms,
        "eager_time_ms": eager_ms,
        "bytes_moved": total,
        "kv_bytes": kv_bytes,
        "achieved_gb_per_s": total / kernel_ms / 1e6,
        "achieved_tflop_per_s": flops / kernel_ms / 1e9,
    }


def bench_decode(
    args, head_dim: int, batch: int, context: int, dtype, overrides: dict | None = None, kv_fp8: bool = False
) -> dict:
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    overrides = dict(overrides or {})
    block_n = overrides.get("block_n") or decode_config(head_dim, kv_fp8)["block_n"]
    kv_len = min(context, args.window + block_n) if args.window else context
    splits = (
        overrides.pop("num_splits", None)
        or args.num_splits
        or decode_num_splits(
            batch, args.kv_heads, kv_len, block_n, torch.cuda.get_device_properties(0).multi_processor_count
        )
    )

    def make_call():
        k_cache, v_cache, tables, q, scales = _paged_inputs(batch, context, args, head_dim, dtype, 1, kv_fp8)
        out = torch.empty_like(q)
        return lambda: paged_decode_attention(
            q,
            k_cache,
            v_cache,
            tables,
            seq_lens,
            args.page_size,
            window=args.window,
            num_splits=splits,
            out=out,
            **scales,
            **overrides,
        )

    item = torch.empty((), dtype=dtype).element_size()
    kv_item = 1 if kv_fp8 else item
    keys = min(context, args.window) if args.window else context
    kv_bytes = 2 * batch * keys * args.kv_heads * head_dim * kv_item
    total = kv_bytes + 2 * batch * args.q_heads * head_dim * item + batch * -(-keys // args.page_size) * 4
    kernel_ms, eager_ms = time_call(make_call, 2 * batch * context * args.kv_heads * head_dim * kv_item, args)
    flops = 4 * batch * args.q_heads * keys * head_dim
    return _row(
        "decode",
        head_dim,
        batch,
        context,
        overrides,
        kernel_ms,
        eager_ms,
        total,
        kv_bytes,
        flops,
        num_splits=splits,
        kv_cache_dtype="fp8" if kv_fp8 else "auto",
    )


def bench_prefill(
    args, head_dim: int, batch: int, context: int, dtype, overrides: dict | None = None, kv_fp8: bool = False
) -> dict | None:
    chunk = min(args.prefill_chunk, context)
    if batch * chunk > args.max_prefill_tokens:
        return None
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    starts = torch.arange(0, (batch + 1) * chunk, chunk, dtype=torch.int32, device="cuda")
    positions = (torch.arange(context - chunk, context, device="cuda")).repeat(batch)

    def make_call():
        k_cache, v_cache, tables, q, scales = _paged_inputs(
            batch, context, args, head_dim, dtype, chunk, kv_fp8
        )
        out = torch.empty_like(q)
        return lambda: paged_prefill_attention(
            q,
            k_cache,
            v_cache,
            tables,
            seq_lens,
            starts,
            positions,
            args.page_size,
            chunk,
            window=args.window,
            out=out,
            **scales,
            **(overrides or {}),
        )

    item = torch.empty((), dtype=dtype).element_size()
    kv_item = 1 if kv_fp8 else item
    # FLOPs: keys each query sees (causal, optional window), summed. Bytes: the visible keys read once.
    q_pos = torch.arange(context - chunk, context, dtype=torch.float64)
    visible = (q_pos + 1).clamp(max=args.window) if args.window else q_pos + 1
    flops = 4 * batch * args.q_heads * head_dim * float(visible.sum())
    keys = min(context, args.window + chunk) if args.window else context
    kv_bytes = 2 * batch * keys * args.kv_heads * head_dim * kv_item
    qo_bytes = 2 * batch * chunk * args.q_heads * head_dim * item
    total = kv_bytes + qo_bytes + batch * -(-keys // args.page_size) * 4
    kernel_ms, eager_ms = time_call(make_call, 2 * batch * context * args.kv_heads * head_dim * kv_item, args)
    return _row(
        "prefill",
        head_dim,
        batch,
        context,
        overrides,
        kernel_ms,
        eager_ms,
        total,
        kv_bytes,
        flops,
        chunk=chunk,
        kv_cache_dtype="fp8" if kv_fp8 else "auto",
    )


def sweep_configs(kind: str, head_dim: int) -> list[dict]:
    if kind == "decode":  # 128-key tiles: an FP8 cache's bytes of a 64-key bf16 tile
        return [
            {"block_n": bn, "num_warps": w, "num_stages": s}
            for bn, w, s in itertools.product([16, 32, 64, 128], [4, 8], [1, 2, 3])
        ]
    if head_dim <= 256:
        grid = itertools.product([64, 128], [32, 64, 128], [4, 8, 16], [1, 2, 3], [1])
    else:  # the fp32 accumulator is BLOCK_M x 512: more warps or output-dim chunks keep it in registers
        grid = itertools.product([64, 128], [16, 32, 64], [8, 16], [1, 2], [1, 2])
    return [
        {"block_m": bm, "block_n": bn, "num_warps": w, "num_stages": s, "dv_chunks": dv}
        for bm, bn, w, s, dv in grid
    ]


def main(argv: list[str] | None = None) -> dict:  # noqa: C901 - benchmark main: the shape loop with its optional config sweep, then the head-dim ratio table
    args = parse_args(argv)
    assert torch.cuda.is_available(), "bench/attention_kernels.py needs a CUDA device"
    dtype = DTYPES[args.dtype]
    env = cuda_environment()
    print(json.dumps(env, indent=2))
    rows = []
    benches = {"decode": bench_decode, "prefill": bench_prefill}
    shapes = itertools.product(args.kinds, args.batch, args.context, args.head_dims, args.kv_cache_dtype)
    for kind, batch, context, head_dim, kv_dtype in shapes:
        fp8 = kv_dtype == "fp8"
        try:
            row = benches[kind](args, head_dim, batch, context, dtype, kv_fp8=fp8)
        except torch.cuda.OutOfMemoryError:
            row = {
                "kind": kind,
                "head_dim": head_dim,
                "batch": batch,
                "context": context,
                "kv_cache_dtype": kv_dtype,
                "skipped": "out of memory",
            }
        if row is None:
            continue
        if args.sweep:
            best = None
            for cfg in sweep_configs(kind, head_dim):
                try:
                    trial = benches[kind](args, head_dim, batch, context, dtype, cfg, kv_fp8=fp8)
                except Exception as exc:  # noqa: BLE001 - a config can exceed shared memory or registers
                    print(f"  {kind} D={head_dim} {cfg}: {type(exc).__name__}")
                    continue
                print(f"  {kind} D={head_dim} {cfg}: {trial['time_ms']:.4f} ms")
                if best is None or trial["time_ms"] < best["time_ms"]:
                    best = trial
            row["sweep_best"] = best
        rows.append(row)
        torch.cuda.empty_cache()
        if "time_ms" in row:
            best = row.get("sweep_best")
            extra = f"  best {best['time_ms']:.4f} ms {best['config']}" if best else ""
            print(
                f"{kind:8s} D={head_dim:4d} B={batch:3d} ctx={context:6d} KV {kv_dtype:4s} "
                f"{row['time_ms']:.4f} ms "
                f"(eager {row['eager_time_ms']:.4f})  "
                f"{row['achieved_gb_per_s']:7.1f} GB/s  {row['achieved_tflop_per_s']:6.1f} TFLOP/s{extra}"
            )

    # head_dim 512 vs 256: time per byte moved (1.0: the 512 kernel moves its bytes as fast as the 256 one).
    ratios = []
    for kind, batch, context in itertools.product(args.kinds, args.batch, args.context):
        pick = {
            r["head_dim"]: r
            for r in rows
            if (r["kind"], r["batch"], r["context"], r["kv_cache_dtype"]) == (kind, batch, context, "auto")
            and "time_ms" in r
        }
        if 256 in pick and 512 in pick:
            per_byte = {d: pick[d]["time_ms"] / pick[d]["bytes_moved"] for d in (256, 512)}
            ratios.append(
                {
                    "kind": kind,
                    "batch": batch,
                    "context": context,
                    "d512_vs_d256_time_per_byte": per_byte[512] / per_byte[256],
                    "within_1_3x": per_byte[512] / per_byte[256] <= 1.3,
                }
            )
    for r in ratios:
        print(
            f"{r['kind']:8s} B={r['batch']:3d} ctx={r['context']:6d}  D512/D256 time per byte "
            f"{r['d512_vs_d256_time_per_byte']:.2f}{'' if r['within_1_3x'] else '  (> 1.3)'}"
        )
    result = {
        "environment": env,
        "parameters": vars(args),
        "default_configs": {
            d: {
                "decode": decode_config(d),
                "decode_fp8": decode_config(d, kv_fp8=True),
                "prefill": prefill_config(d, args.q_heads // args.kv_heads),
            }
            for d in args.head_dims
        },
        "results": rows,
        "d512_vs_d256": ratios,
    }
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    device = env["device_name"].lower().replace(" ", "-")
    path = out_dir / f"attention_kernels_{stamp}_{device}_{args.q_heads}q{args.kv_heads}kv.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
