"""A dense layer's tail after attention at decode sizes on the GPU: the persistent kernel
(kernels/decode_tail.py) against the separate launches the model runs without it.

For each distinct tail shape of a preset's decoder (hidden H, attention width Q, intermediate I, PLE width
P, and how many layers have it) and M = 1, 2, 4, 8 token rows, the script times the model's separate ops
(``layers.fused``: ``o_proj``, ``add_rms_norm``, ``gate_up_act`` with its fused activation, ``down``,
``add_rms_norm``, and on E-type presets the PLE gate with its product, its projection and the last
``add_rms_norm``; each with the engine's own kernel choice) and the persistent kernel (default tiles), each
replayed from a CUDA graph that cycles over enough weight copies (>= ``--stream-mb``) that every call streams
its weights from HBM. It checks the two agree (largest difference of both outputs, in bf16 steps) and
reports microseconds per tail, weight GB/s and what a decode step would save over its layers. ``--sweep``
also searches the kernel's tiles, warps and programs per SM. ``--trace`` runs the default config (and the
sweep's best) once more with the kernel's trace on (``decode_tail(trace=...)``: each program's clock where
it left each phase) and prints the phases' timeline: when the last program left each phase, relative to
the first program's start. Writes JSON (device, versions, commit, command) to bench/results/.

    python bench/decode_tail.py                         # e4b and 31b, M = 1 2 4 8
    python bench/decode_tail.py --presets e2b --rows 1 --sweep
    python bench/decode_tail.py --presets e4b --rows 1 --sweep --sweep-grid coarse   # MLP per SM
    python bench/decode_tail.py --presets e4b --rows 1 --trace   # where a launch's time goes, by phase
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
from torch import nn

from g4serve.bench.meta import cuda_environment, kernel_result_path
from g4serve.bench.timing import graph_replay_ms, time_sweep
from g4serve.config import PRESETS
from g4serve.kernels.decode_tail import (
    TRACE_PHASES,
    decode_tail_config,
    default_programs,
    new_counters,
    new_trace,
)
from g4serve.layers.fused import add_rms_norm, decode_tail_block, gate_up_act, linear, linear_act_mul
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
    p.add_argument(
        "--sweep-grid",
        choices=("full", "coarse", "tickets"),
        default="full",
        help="coarse: at one row, small tiles on 4 warps with 4-12 programs per SM (gemv.py's way of keeping "
        "weight bytes in flight), 36 configs against the full grid's 486; tickets: the default tiles with "
        "1-8 tickets a grab and norm chunks of 256 or 1,024 columns (8 configs)",
    )
    p.add_argument(
        "--trace", action="store_true", help="the phases' timeline of one launch (and of the sweep's best)"
    )
    p.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    return p.parse_args(argv)


def tail_shapes(preset: str) -> list[tuple[int, int, int, int, int, str]]:
    """(H, Q, I, P, layers with that shape, activation) of a dense preset's tails; MoE presets have none the
    kernel serves (their feed-forward adds the experts)."""
    t = PRESETS[preset]().text
    if t.enable_moe_block:
        return []
    counts: dict[tuple[int, int], int] = {}
    for layer in range(t.num_hidden_layers):
        key = (t.num_attention_heads * t.layer_head_dim(layer), t.layer_intermediate_size(layer))
        counts[key] = counts.get(key, 0) + 1
    p = t.hidden_size_per_layer_input or 0
    return [(t.hidden_size, q, i, p, n, t.hidden_activation) for (q, i), n in sorted(counts.items())]


def tail_sweep(m: int, grid_name: str = "full") -> list[dict[str, int]]:
    """The grid ``--sweep`` searches: the big phases' tiles (o, gate/up and down share a K tile), warps and
    programs per SM; the PLE phases keep their default tiles. ``coarse`` (one row): small tiles on 4 warps and
    4-12 programs per SM around the default (8 programs of 64 registers a thread), the question the first H200
    run left (one program of 8 warps per SM, ~250 registers a thread, streamed 1.4 TB/s; gemv.py streams 3.3
    with many small programs). Its first coarse run (2026-11-29) kept the PLE projection's 16-row tiles, which
    held every config to 2-3 resident programs per SM. ``tickets``: the default tiles with 1, 2, 4 or 8
    tickets a grab (``_next_ticket``) and norm chunks of 256 or 1,024 columns (the norms are chunked phases
    since): after the coarse grid's second run (H100, 2026-12-07) every config from 8 programs per SM on sat
    at 106-145 us, and halving the gate/up tasks (1 row a task to 2) saved 15 us, ~3 ns a task, what a queue
    of read-modify-writes at the one ticket address could cost."""
    if grid_name == "tickets":  # fewer read-modify-writes at the ticket counter; other norm chunks
        return [
            {"grab": grab, "norm_cols": cols} for grab, cols in itertools.product((1, 2, 4, 8), (256, 1024))
        ]
    keys = ("bn_o", "bn_a", "bn_b", "bk", "num_warps", "programs_per_sm")
    if m == 1 and grid_name == "coarse":
        # gemv.py's shape of parallelism: small tiles, 4 warps, several programs per SM (o and down alike)
        grid = [
            (bn, bn_a, bn, bk, 4, pps)
            for bn, bn_a, bk, pps in itertools.product((2, 4), (1, 2, 4), (512, 1024), (4, 8, 12))
        ]
    elif m == 1:
        grid = itertools.product((2, 4, 8), (4, 8, 16), (2, 4, 8), (512, 1024, 2048), (4, 8), (1, 2, 3))
    else:
        grid = itertools.product((16, 32), (16, 32, 64), (16, 32), (64, 128, 256), (4, 8), (1, 2))
    out = []
    for values in grid:
        cfg = dict(zip(keys, values))
        bk = cfg.pop("bk")
        out.append(cfg | {"bk_o": bk, "bk_a": bk, "bk_b": bk})
    return out


def trace_timeline(trace: torch.Tensor, programs: int) -> dict:
    """A traced launch's records (``new_trace``'s [programs, slots, (clock ns, ticket)]) as a timeline in
    microseconds from the first program's start: for each phase the tail has, the moment the first and the
    last program left it (the last: when its results were all written) and its share of the critical path
    (the last leaving it minus the last leaving the phase before); when the last program started, and when
    the last held its first ticket (the grabs' atomics on one counter, in line); how many programs ran at
    once at most (a grid the SMs cannot hold all at once starts the rest as the first exit); the last exit."""
    rows = trace[:programs].cpu()
    rows = rows[rows[:, 1, 1] >= 0]  # the grid's (a launch with fewer tasks than programs runs fewer)
    clock = rows[:, :, 0].double()
    t0 = float(clock[:, 0].min())

    def us(values: torch.Tensor) -> float:
        return round((float(values) - t0) / 1e3, 3)

    timeline, before = [], t0
    for slot, name in enumerate(TRACE_PHASES, start=2):
        if (rows[:, slot, 1] < 0).any():  # a phase this tail has not
            continue
        last = float(clock[:, slot].max())
        timeline.append(
            {
                "phase": name,
                "first_out_us": us(clock[:, slot].min()),
                "last_out_us": us(last),
                "critical_us": round((last - before) / 1e3, 3),
            }
        )
        before = last
    # programs running at once: +1 at each start, -1 at each exit (an exit first where they tie)
    events = sorted([(float(t), 1) for t in clock[:, 0]] + [(float(t), -1) for t in clock[:, -1]])
    running = resident = 0
    for _, step in events:
        running += step
        resident = max(resident, running)
    return {
        "programs": len(rows),
        "start_spread_us": us(clock[:, 0].max()),
        "first_ticket_us": us(clock[:, 1].max()),
        "max_resident": resident,
        "phases": timeline,
        "last_exit_us": us(clock[:, -1].max()),
    }


def _print_timeline(label: str, t: dict) -> None:
    cells = " ".join(f"{p['phase']} {p['last_out_us']:.1f} (+{p['critical_us']:.1f})" for p in t["phases"])
    print(
        f"    trace {label}: {t['programs']} programs started within {t['start_spread_us']:.1f} us "
        f"(at most {t['max_resident']} at once), all held a ticket by {t['first_ticket_us']:.1f}; "
        f"last out of {cells}; "
        f"last exit {t['last_exit_us']:.1f} us"
    )


class Tail:
    """One copy of a tail's weights, as the model holds them after ``fuse_projections``."""

    def __init__(self, h: int, q: int, i: int, p: int, gen: torch.Generator):
        def linear_layer(cols: int, rows: int) -> nn.Linear:
            layer = nn.Linear(cols, rows, bias=False, device="cuda", dtype=torch.bfloat16)
            layer.weight.data = (
                torch.randn(rows, cols, device="cuda", generator=gen).mul_(cols**-0.5).bfloat16()
            )
            return layer

        def norm() -> RMSNorm:
            return RMSNorm(h, EPS).to("cuda", torch.bfloat16)

        self.o, self.gate_up, self.down = linear_layer(q, h), linear_layer(h, 2 * i), linear_layer(i, h)
        self.post_attn, self.pre_ff, self.post_ff, self.next = norm(), norm(), norm(), norm()
        self.ple = (linear_layer(h, p), linear_layer(p, h), norm()) if p else None
        self.counters = new_counters("cuda")


def bench_shape(args, h: int, q: int, i: int, p: int, layers: int, act: str, m: int) -> dict:
    weight_bytes = (h * q + 3 * h * i + 2 * h * p) * 2
    copies = max(2, -(-args.stream_mb * 2**20 // weight_bytes))
    gen = torch.Generator("cuda").manual_seed(h * 7 + q + i)
    tails = [Tail(h, q, i, p, gen) for _ in range(copies)]
    attn = torch.randn(m, q, device="cuda", generator=gen).bfloat16()
    residual = torch.randn(m, h, device="cuda", generator=gen).bfloat16()
    per_layer = torch.randn(m, 8, p or 1, device="cuda", generator=gen).bfloat16()[:, 3]
    scale = torch.tensor([0.5], device="cuda", dtype=torch.bfloat16)

    def separate(t: Tail):
        h1, x1 = add_rms_norm(linear(attn, t.o), t.post_attn, residual, next_norm=t.pre_ff)
        y = linear(gate_up_act(x1, t.gate_up, act), t.down)
        if t.ple is None:
            return add_rms_norm(y, t.post_ff, h1, scale, t.next)
        gate, proj, post = t.ple
        h2, _ = add_rms_norm(y, t.post_ff, h1)
        return add_rms_norm(linear(linear_act_mul(h2, gate, per_layer, act), proj), post, h2, scale, t.next)

    def fused(t: Tail):
        ple = (t.ple[0], t.ple[1], per_layer, t.ple[2]) if t.ple is not None else None
        return decode_tail_block(
            attn, residual, t.o, t.post_attn, t.pre_ff, t.gate_up, t.down, t.post_ff, act, t.counters, ple,
            scale, t.next,
        )  # fmt: skip

    def time(fn) -> float:
        return graph_replay_ms([lambda t=t: fn(t) for t in tails], args.calls_per_graph, args.graph_replays)

    want, got = separate(tails[0]), fused(tails[0])
    step = 2.0**-7  # a bf16 step at 1.0
    diffs = [float((g.float() - w.float()).abs().max()) / step for g, w in zip(got, want)]
    base_ms, fused_ms = time(separate), time(fused)
    row = {
        "hidden": h,
        "attention_width": q,
        "intermediate": i,
        "ple": p,
        "layers": layers,
        "rows": m,
        "weight_bytes": weight_bytes,
        "separate_ms": base_ms,
        "fused_ms": fused_ms,
        "fused_config": decode_tail_config(m, h, q, i, p),
        "separate_gb_per_s": weight_bytes / base_ms / 1e6,
        "fused_gb_per_s": weight_bytes / fused_ms / 1e6,
        "speedup": base_ms / fused_ms,
        "saved_ms_per_step": (base_ms - fused_ms) * layers,
        "max_diff_bf16_steps": {"out": diffs[0], "next_norm": diffs[1]},
    }
    print(
        f"  H={h} Q={q} I={i} P={p} M={m}: separate {base_ms * 1e3:.1f} us, fused {fused_ms * 1e3:.1f} us "
        f"({row['fused_gb_per_s']:.0f} GB/s, x{row['speedup']:.2f}), max diff {max(diffs):.1f} bf16 steps"
    )
    if args.sweep:
        default = decode_tail_config(m, h, q, i, p)
        row["sweep"] = sweep = time_sweep(
            [default | cfg for cfg in tail_sweep(m, args.sweep_grid)],
            lambda cfg: time(lambda t: _fused_with(t, attn, residual, per_layer, scale, act, cfg)),
        )
        print(f"    best {sweep['best_ms'] * 1e3:.1f} us with {sweep['best']}")
    if args.trace:
        configs = {"default": decode_tail_config(m, h, q, i, p)}
        if args.sweep:
            configs["best"] = row["sweep"]["best"]
        row["trace"] = {}
        for label, cfg in configs.items():
            programs = default_programs(cfg, torch.device("cuda", 0))
            trace = new_trace(programs, "cuda")
            # tails[0]: the replays streamed the other copies' weights after it (>= --stream-mb): cold
            _fused_with(tails[0], attn, residual, per_layer, scale, act, cfg, trace)
            torch.cuda.synchronize()
            row["trace"][label] = timeline = trace_timeline(trace, programs)
            _print_timeline(label, timeline)
    tails.clear()
    torch.cuda.empty_cache()
    return row


def _fused_with(t: Tail, attn, residual, per_layer, scale, act: str, cfg: dict, trace=None):
    """The kernel with the tiles ``cfg`` (the sweep's), on the tail ``t``; ``trace``: its records."""
    from g4serve.kernels.decode_tail import PerLayerInput, TailWeights, decode_tail

    ple = PerLayerInput(t.ple[0].weight, t.ple[1].weight, per_layer, t.ple[2].weight) if t.ple else None
    weights = TailWeights(
        t.o.weight, t.post_attn.weight, t.pre_ff.weight, t.gate_up.weight, t.down.weight, t.post_ff.weight
    )
    return decode_tail(
        attn, residual, weights, EPS, act, t.counters, ple, scale, t.next.weight, cfg, trace=trace
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/decode_tail.py times CUDA kernels: no CUDA device here", file=sys.stderr)
        return 2
    env = cuda_environment()
    for preset in args.presets:
        shapes = tail_shapes(preset)
        if not shapes:
            print(f"{preset}: no dense layer tail (MoE layers add the experts): skipped")
            continue
        print(f"{preset}:")
        rows = [bench_shape(args, h, q, i, p, n, act, m) for h, q, i, p, n, act in shapes for m in args.rows]
        out = kernel_result_path(args.out_dir, "decode_tail", env, preset)
        result = {"benchmark": "decode_tail", "preset": preset, **env, "rows": rows}  # env: command, commit
        out.write_text(json.dumps(result, indent=2))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
