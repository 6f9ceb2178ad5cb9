"""What a decode step's small kernels cost in the chain of dependent launches, alone and right after the
projection they follow.

A B = 1 step of 31B in FP8 spends ~21 us a layer in small kernels while HBM idles, and its profile gives each
RMSNorm chain 4.0-4.4 us against ~1 us for a quantizer (docs/benchmarks.md, fifteenth session); loading the
norms' weights before the wait and changing their warps moved nothing. This script tells apart the two
readings of those 4 us: the norm's own latency (then a chain of norms alone shows it), or the projection
before it draining (then the norm costs more after a projection than alone).

For each preset, one token row, each item replayed from a CUDA graph (``graph_replay_ms``; launches of at most
64 rows use programmatic dependent launch, as in the engine), projections cycling over weight copies of at
least ``--stream-mb`` so every call streams its weights from HBM:

- ``norm``: the post-attention ``add_rms_norm`` chain (norm, residual add, the pre-feed-forward norm) of
  ``hidden`` columns; ``quantize`` (``--quantization fp8``): the W8A8 activation quantizer of one row;
- ``o_proj`` (attention width -> hidden, the engine's own kernel choice: ``layers.fused.linear``; in FP8 its
  activation quantizer included), then
  ``o_proj+norm`` and ``o_proj+quantize``: the pair, one after the other, per pair; ``o_proj>norm``: the norm
  of the projection's own output (the engine's dependency; ``o_proj+norm``'s norm reads a fixed row);
- ``decode``: paged decode attention of one sequence at ``--context`` tokens on the sliding layers' shape, its
  split count fixed for ``--graph-context`` as a captured graph fixes it (the merge kernel included).

``--max-split-k`` repeats the FP8 items with the tensor cores' serial split-K capped there (1: none): whether
the split's last-arrival reduction is what a norm after the projection waits for.

It prints us per call and, for each pair, what the second kernel adds after the projection against what it
costs alone. Writes JSON (device, versions, commit, command) to ``--out-dir``. ``--device cpu`` runs the same
items once each on tiny shapes (Triton's interpreter; no timing worth reading): the CPU tests' smoke run.

    python bench/chain_latency.py --presets e4b 31b --quantization none fp8
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_kernels import _paged_inputs  # noqa: E402

from g4serve.bench.meta import cuda_environment, kernel_result_path  # noqa: E402
from g4serve.bench.timing import graph_replay_ms  # noqa: E402
from g4serve.config import PRESETS, SLIDING  # noqa: E402
from g4serve.kernels import fp8_matmul  # noqa: E402
from g4serve.kernels.fp8_matmul import quantize_groups  # noqa: E402
from g4serve.kernels.paged_decode import decode_num_splits, paged_decode_attention  # noqa: E402
from g4serve.layers.fused import add_rms_norm, linear  # noqa: E402
from g4serve.layers.norm import RMSNorm  # noqa: E402
from g4serve.layers.quant import ActivationQuant, QuantLinear, WeightQuant  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PAGE = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--presets", nargs="+", default=["e4b", "31b"])
    p.add_argument("--quantization", nargs="+", choices=("none", "fp8"), default=["none", "fp8"])
    p.add_argument("--context", type=int, default=128, help="tokens of the decoded sequence")
    p.add_argument("--graph-context", type=int, default=4096, help="the context a graph's split count is for")
    p.add_argument(
        "--stream-mb", type=int, default=256, help="bytes of weight copies a projection cycles over"
    )
    p.add_argument(
        "--max-split-k", type=int, nargs="+", default=[0], help="FP8 split-K caps to run (0: as shipped)"
    )
    p.add_argument(
        "--trace",
        nargs="*",
        default=[],
        help="items whose kernels to trace (torch.profiler over one replay): each kernel's start and end",
    )
    p.add_argument("--calls-per-graph", type=int, default=64)
    p.add_argument("--graph-replays", type=int, default=7)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    return p.parse_args(argv)


def shapes(preset: str, device: str) -> dict:
    """The preset's one-row shapes: hidden size, the sliding layers' attention width, their q / KV heads and
    head size; on the CPU a tiny stand-in of the same structure."""
    t = PRESETS[preset]().text
    layer = t.layer_types.index(SLIDING)
    s = {
        "hidden": t.hidden_size,
        "q_heads": t.num_attention_heads,
        "kv_heads": t.layer_num_kv_heads(layer),
        "head_dim": t.layer_head_dim(layer),
        "window": t.sliding_window,
        "eps": t.rms_norm_eps,
    }
    if device == "cpu":
        s |= {"hidden": 256, "q_heads": 4, "kv_heads": 2, "head_dim": 64}
    return s


def projection(k: int, n: int, quantization: str, device: str, dtype: torch.dtype, gen) -> nn.Module:
    """A k -> n projection as the engine holds it: bf16 ``nn.Linear``, or FP8 weights per channel with
    dynamic per-token activations (W8A8)."""
    w = torch.randn(n, k, generator=gen, device=device) * k**-0.5
    if quantization == "fp8":
        layer = QuantLinear(
            k, n, WeightQuant("fp8", "channel", (1, 0)), ActivationQuant(True, "token"), device=device
        )
        layer.quantize_from(w)
        return layer
    layer = nn.Linear(k, n, bias=False, device=device, dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(w)
    return layer.requires_grad_(False)


def build_items(
    s: dict, quantization: str, args, device: str, dtype: torch.dtype
) -> dict[str, tuple[list, int]]:
    """name -> (the calls one replay cycles over, calls per item: 2 for a pair, which runs in turn)."""
    gen = torch.Generator(device=device).manual_seed(0)
    hidden, width = s["hidden"], s["q_heads"] * s["head_dim"]
    one = torch.randn(1, hidden, generator=gen, device=device).to(dtype)
    residual = torch.randn(1, hidden, generator=gen, device=device).to(dtype)
    attn = torch.randn(1, width, generator=gen, device=device).to(dtype)
    norm, next_norm = (RMSNorm(hidden, s["eps"]).to(device=device, dtype=dtype) for _ in range(2))
    weight_bytes = hidden * width * (1 if quantization == "fp8" else 2)
    copies = 1 if device == "cpu" else max(1, -(-args.stream_mb * 2**20 // weight_bytes))
    projs = [projection(width, hidden, quantization, device, dtype, gen) for _ in range(copies)]
    singles = {
        "norm": lambda: add_rms_norm(one, norm, residual=residual, next_norm=next_norm),
        "quantize": lambda: quantize_groups(one),
    }
    if quantization != "fp8":
        del singles["quantize"]
    proj = [(lambda layer=layer: linear(attn, layer)) for layer in projs]
    items = {"o_proj": (proj, 1)} | {name: ([call], 1) for name, call in singles.items()}
    for name, call in singles.items():
        items[f"o_proj+{name}"] = ([c for p in proj for c in (p, call)], 2)
    items["o_proj>norm"] = (
        [
            (
                lambda layer=layer: add_rms_norm(
                    linear(attn, layer), norm, residual=residual, next_norm=next_norm
                )
            )
            for layer in projs
        ],
        1,
    )
    cache = SimpleNamespace(page_size=PAGE, kv_heads=s["kv_heads"], q_heads=s["q_heads"])
    k_cache, v_cache, tables, q, _ = _paged_inputs(
        1, args.context, cache, s["head_dim"], dtype, 1, device=device
    )
    lens = torch.tensor([args.context], dtype=torch.int32, device=device)
    splits = decode_num_splits(1, s["kv_heads"], min(args.graph_context, s["window"] + 64), 64)
    decode = lambda: paged_decode_attention(  # noqa: E731
        q, k_cache, v_cache, tables, lens, PAGE, window=s["window"], num_splits=splits
    )
    items["decode"] = ([decode], 1)
    return items


def per_item_us(calls: list, per_item: int, args, device: str) -> float:
    """us an item takes (a pair's two calls together): from a CUDA graph; elsewhere one eager pass (the CPU
    smoke run: no figure worth reading)."""
    if device != "cuda":
        start = time.perf_counter()
        for call in calls:
            call()
        return (time.perf_counter() - start) * per_item / len(calls) * 1e6
    return graph_replay_ms(calls, args.calls_per_graph, args.graph_replays) * per_item * 1e3


def kernel_timeline(calls: list, per_graph: int = 16) -> list[dict]:
    """Each kernel of one replay of a graph of ``calls`` (cycled to ``per_graph``), as the profiler saw it:
    name, start and end in us from the first kernel's start."""
    from torch.profiler import ProfilerActivity, profile

    for call in calls:
        call()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for i in range(per_graph):
            calls[i % len(calls)]()
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    path = Path(f"/tmp/chain_trace_{time.time_ns()}.json")
    prof.export_chrome_trace(str(path))
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("cat") == "kernel"]
    path.unlink()
    events.sort(key=lambda e: e["ts"])
    t0 = events[0]["ts"] if events else 0.0
    return [{"name": e["name"][:40], "start": e["ts"] - t0, "end": e["ts"] + e["dur"] - t0} for e in events]


def print_timeline(label: str, timeline: list[dict]) -> None:
    """The middle third of a timeline: each kernel's start, end and end minus the previous end."""
    third = len(timeline) // 3
    prev_end = timeline[third - 1]["end"] if third else 0.0
    print(f"  trace {label}:")
    for k in timeline[third : 2 * third]:
        print(f"    {k['name']:40s} start {k['start']:8.2f} end {k['end']:8.2f} +{k['end'] - prev_end:6.2f}")
        prev_end = k["end"]


def run_case(preset: str, quantization: str, cap: int, s: dict, args, device: str, dtype) -> dict:
    """One preset, quantization and split-K cap: every item's us, and what each paired kernel adds."""
    shipped = fp8_matmul.MAX_SPLIT_K
    fp8_matmul.MAX_SPLIT_K = cap or shipped
    try:
        items = build_items(s, quantization, args, device, dtype)
        us = {name: per_item_us(calls, per_item, args, device) for name, (calls, per_item) in items.items()}
        traces = {}
        if device == "cuda" and args.trace:  # the same weight copies (256 MB a projection) as timed
            traces = {name: kernel_timeline(items[name][0]) for name in args.trace}
    finally:
        fp8_matmul.MAX_SPLIT_K = shipped
    after = {name[len("o_proj+") :]: t - us["o_proj"] for name, t in us.items() if name.startswith("o_proj+")}
    after["norm of its output"] = us["o_proj>norm"] - us["o_proj"]
    label = f"{preset} {quantization}" + (f" split<={cap}" if cap else "")
    print(
        f"{label}: us an item: "
        + ", ".join(f"{k} {v:.2f}" for k, v in us.items())
        + "; after o_proj: "
        + ", ".join(f"{k} {v:.2f} (alone {us[k.split()[0]]:.2f})" for k, v in after.items()),
        flush=True,
    )
    for name, timeline in traces.items():
        print_timeline(name, timeline)
    return {
        "preset": preset,
        "quantization": quantization,
        "max_split_k": cap or shipped,
        "shapes": s,
        "us": us,
        "after_us": after,
        "traces": traces,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    results = []
    for preset in args.presets:
        s = shapes(preset, device)
        for quantization in args.quantization:
            for cap in args.max_split_k if quantization == "fp8" else [0]:
                results.append(run_case(preset, quantization, cap, s, args, device, dtype))
    if device == "cuda":
        env = cuda_environment()
        path = kernel_result_path(args.out_dir, "chain_latency", env, "-".join(args.presets))
        path.write_text(json.dumps({"benchmark": "chain_latency", **env, "results": results}, indent=1))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
