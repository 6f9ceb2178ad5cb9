"""A dense layer's MLP block at decode sizes on the GPU: the persistent kernel (kernels/decode_mlp.py) against
the three launches the model runs without it.

For each distinct MLP shape of a preset's decoder (hidden H, intermediate I, and how many layers have it)
and M = 1, 2, 4, 8 token rows, the script times the model's separate ops (``layers.fused``: ``gate_up_act``
with its fused activation, the ``down`` projection, ``add_rms_norm`` with the layer scalar and the next
norm, each with the engine's own kernel choice) and the persistent kernel (default tiles), each replayed
from a CUDA graph that cycles over enough weight copies (>= ``--stream-mb``) that every call streams its
weights from HBM. It checks the two agree (max |difference| of both outputs, in bf16 steps) and reports
microseconds per block and weight GB/s. ``--sweep`` also searches the kernel's tiles, warps and programs
per SM. Writes JSON (device, versions, commit, command) to bench/results/.

    python bench/decode_mlp.py                         # e4b and 31b, M = 1 2 4 8
    python bench/decode_mlp.py --presets e2b --rows 1 --sweep
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
from torch import nn

from g4serve.bench.meta import command_line, cuda_environment, kernel_result_path
from g4serve.bench.timing import graph_replay_ms
from g4serve.config import PRESETS
from g4serve.kernels.decode_mlp import decode_mlp, decode_mlp_config, new_counters
from g4serve.layers.fused import add_rms_norm, gate_up_act, linear
from g4serve.layers.norm import RMSNorm

ROOT = Path(__file__).resolve().parent.parent
EPS = 1e-6


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--presets", nargs="+", default=["e4b", "31b"])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--stream-mb", type=int, default=512, help="bytes of weight copies each graph cycles over")
    p.add_argument("--calls-per-graph", type=int, default=32)
    p.add_argument("--graph-replays", type=int, default=7)
    p.add_argument("--sweep", action="store_true", help="search the kernel's tiles per shape and row count")
    p.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    return p.parse_args(argv)


def mlp_shapes(preset: str) -> list[tuple[int, int, int, str]]:
    """(H, I, layers with that shape, activation) of a dense preset's MLP blocks; MoE presets have none the
    kernel serves (their block adds the experts)."""
    t = PRESETS[preset]().text
    if t.enable_moe_block:
        return []
    counts: dict[int, int] = {}
    for i in range(t.num_hidden_layers):
        counts[t.layer_intermediate_size(i)] = counts.get(t.layer_intermediate_size(i), 0) + 1
    return [(t.hidden_size, i, n, t.hidden_activation) for i, n in sorted(counts.items())]


def sweep_configs(m: int) -> list[dict[str, int]]:
    if m == 1:
        grid = itertools.product((4, 8, 16), (512, 1024), (2, 4, 8), (1024, 2048), (4, 8), (1, 2, 3))
        keys = ("bn_a", "bk_a", "bn_b", "bk_b", "num_warps", "programs_per_sm")
    else:
        grid = itertools.product((16, 32, 64), (64, 128, 256), (16, 32), (128, 256), (4, 8), (1, 2))
        keys = ("bn_a", "bk_a", "bn_b", "bk_b", "num_warps", "programs_per_sm")
    return [dict(zip(keys, values)) for values in grid]


class Block:
    """One copy of an MLP block's weights, as the model holds them after ``fuse_projections``."""

    def __init__(self, h: int, i: int, gen: torch.Generator):
        def weight(rows: int, cols: int) -> torch.Tensor:
            return torch.randn(rows, cols, device="cuda", generator=gen).mul_(cols**-0.5).bfloat16()

        self.gate_up = nn.Linear(h, 2 * i, bias=False, device="cuda", dtype=torch.bfloat16)
        self.down = nn.Linear(i, h, bias=False, device="cuda", dtype=torch.bfloat16)
        self.gate_up.weight.data, self.down.weight.data = weight(2 * i, h), weight(h, i)
        self.norm = RMSNorm(h, EPS).to("cuda", torch.bfloat16)
        self.next_norm = RMSNorm(h, EPS).to("cuda", torch.bfloat16)
        self.counters = new_counters("cuda")


def bench_shape(args, h: int, i: int, layers: int, act: str, m: int) -> dict:
    weight_bytes = 3 * h * i * 2
    copies = max(2, -(-args.stream_mb * 2**20 // weight_bytes))
    gen = torch.Generator("cuda").manual_seed(h * 7 + i)
    blocks = [Block(h, i, gen) for _ in range(copies)]
    x = torch.randn(m, h, device="cuda", generator=gen).bfloat16()
    residual = torch.randn(m, h, device="cuda", generator=gen).bfloat16()
    scale = torch.tensor([0.5], device="cuda", dtype=torch.bfloat16)

    def separate(b: Block):
        y = linear(gate_up_act(x, b.gate_up, act), b.down)
        return add_rms_norm(y, b.norm, residual, scale, b.next_norm)

    def fused(b: Block, cfg: dict | None = None):
        w = b.next_norm.weight
        return decode_mlp(
            x, residual, b.gate_up.weight, b.down.weight, b.norm.weight, EPS, act, b.counters, scale, w, cfg
        )

    def time(fn) -> float:
        return graph_replay_ms([lambda b=b: fn(b) for b in blocks], args.calls_per_graph, args.graph_replays)

    want, got = separate(blocks[0]), fused(blocks[0])
    step = 2.0**-7  # a bf16 step at 1.0
    diffs = [float((g.float() - w.float()).abs().max()) / step for g, w in zip(got, want)]
    base_ms, fused_ms = time(separate), time(fused)
    row = {
        "hidden": h,
        "intermediate": i,
        "layers": layers,
        "rows": m,
        "weight_bytes": weight_bytes,
        "separate_ms": base_ms,
        "fused_ms": fused_ms,
        "fused_config": decode_mlp_config(m, h, i),
        "separate_gb_per_s": weight_bytes / base_ms / 1e6,
        "fused_gb_per_s": weight_bytes / fused_ms / 1e6,
        "speedup": base_ms / fused_ms,
        "saved_ms_per_step": (base_ms - fused_ms) * layers,
        "max_diff_bf16_steps": {"out": diffs[0], "next_norm": diffs[1]},
    }
    print(
        f"  H={h} I={i} M={m}: separate {base_ms * 1e3:.1f} us, fused {fused_ms * 1e3:.1f} us "
        f"({row['fused_gb_per_s']:.0f} GB/s, x{row['speedup']:.2f}), max diff {max(diffs):.1f} bf16 steps"
    )
    if args.sweep:
        trials = []
        for cfg in sweep_configs(m):
            try:
                ms = time(lambda b, cfg=cfg: fused(b, cfg))
            except Exception as exc:  # noqa: BLE001 - a tile the compiler rejects (registers, shared memory)
                print(f"    {cfg}: {type(exc).__name__}")
                continue
            trials.append({"config": cfg, "ms": ms})
        best = min(trials, key=lambda t: t["ms"])
        row["sweep"] = {"best": best["config"], "best_ms": best["ms"], "trials": trials}
        print(f"    best {best['ms'] * 1e3:.1f} us with {best['config']}")
    blocks.clear()
    torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/decode_mlp.py times CUDA kernels: no CUDA device here", file=sys.stderr)
        return 2
    env = cuda_environment()
    for preset in args.presets:
        shapes = mlp_shapes(preset)
        if not shapes:
            print(f"{preset}: no dense MLP block (MoE layers add the experts): skipped")
            continue
        print(f"{preset}:")
        rows = [bench_shape(args, h, i, n, act, m) for h, i, n, act in shapes for m in args.rows]
        out = kernel_result_path(args.out_dir, "decode_mlp", env, preset)
        result = {"benchmark": "decode_mlp", "command": command_line(), "preset": preset, **env, "rows": rows}
        out.write_text(json.dumps(result, indent=2))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
