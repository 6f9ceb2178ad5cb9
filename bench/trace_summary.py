"""Where a profiled server's host time goes, from a torch.profiler Chrome trace (``POST /stop_profile`` writes
one; with ``G4SERVE_TORCH_PROFILER_WITH_STACK=1`` it holds every Python call as a ``python_function`` event).

For each thread that did work in the trace: its busy time, the Python functions with the most inclusive time
(an instance inside a call of the same function is not counted twice) and the most self time (time in the
function's own code: not in a callee, a torch op or a CUDA runtime call), the torch ops and CUDA runtime calls
with the most self time, how many kernels and graphs the thread launched, and its host syncs
(``cudaStreamSynchronize`` and the like: the host waiting for the device) by the Python functions they came
from; and the device's work by CUDA stream (busy time, and the time beside the busiest stream: how much of
a side stream's encodes ran under the steps). ``--focus NAME`` narrows the threads' tables to what ran inside
the functions whose name contains NAME (e.g. ``_launch`` or ``encoder``), each figure a share of their time.
Markdown on stdout; ``--json`` writes the same numbers as JSON.

    python3 bench/trace_summary.py /tmp/res-stall/gpumedia/profile/g4serve-*.trace.json.gz --top 30
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

HOST_CATEGORIES = ("python_function", "cpu_op", "cuda_runtime", "user_annotation")
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
# CUDA runtime calls that block the host until the device catches up (a blocking cudaMemcpy too)
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
GRAPH_LAUNCHES = ("cudaGraphLaunch", "cuGraphLaunch")


@dataclass
class Event:
    name: str
    cat: str
    ts: float  # microseconds
    dur: float
    children: list[Event] = field(default_factory=list)

    @property
    def self_us(self) -> float:
        return self.dur - sum(c.dur for c in self.children)


def load(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def thread_events(trace: dict) -> tuple[dict[tuple, list[Event]], dict[tuple, str]]:
    """The host events of each (pid, tid), and the threads' names where the trace gives them."""
    by_thread: dict[tuple, list[Event]] = defaultdict(list)
    names: dict[tuple, str] = {}
    for e in trace.get("traceEvents", []):
        key = (e.get("pid"), e.get("tid"))
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            names[key] = str(e.get("args", {}).get("name", ""))
        elif e.get("ph") == "X" and e.get("cat") in HOST_CATEGORIES:
            by_thread[key].append(Event(str(e["name"]), e["cat"], float(e["ts"]), float(e.get("dur", 0.0))))
    return by_thread, names


def nest(events: list[Event]) -> list[Event]:
    """The events as trees, by time: an event starting inside another (and ending by its end) is its child."""
    roots: list[Event] = []
    stack: list[Event] = []
    for e in sorted(events, key=lambda e: (e.ts, -e.dur)):
        while stack and e.ts >= stack[-1].ts + stack[-1].dur:
            stack.pop()
        (stack[-1].children if stack else roots).append(e)
        stack.append(e)
    return roots


def focus_roots(roots: list[Event], focus: str | None) -> list[Event]:
    """The outermost events whose name contains ``focus`` (all roots without one)."""
    if not focus:
        return roots
    found: list[Event] = []

    def walk(e: Event) -> None:
        if focus in e.name:
            found.append(e)
        else:
            for c in e.children:
                walk(c)

    for r in roots:
        walk(r)
    return found


@dataclass
class ThreadSummary:
    name: str
    busy_us: float = 0.0
    inclusive: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    self_us: dict[tuple[str, str], float] = field(default_factory=lambda: defaultdict(float))
    kernel_launches: int = 0
    graph_launches: int = 0
    # host syncs by where they came from: "sync call < innermost Python function < its caller" -> [n, us]
    syncs: dict[str, list[float]] = field(default_factory=lambda: defaultdict(lambda: [0, 0.0]))


def summarize_thread(name: str, roots: list[Event], caller_depth: int = 2) -> ThreadSummary:
    """``caller_depth``: how many Python frames name a host sync's origin."""
    s = ThreadSummary(name)
    s.busy_us = sum(r.dur for r in roots)

    def walk(e: Event, open_names: frozenset[str], python: tuple[str, ...]) -> None:
        if e.name not in open_names:  # a recursive call's time is its outer call's already
            s.inclusive[e.name] += e.dur
        s.calls[e.name] += 1
        s.self_us[(e.cat, e.name)] += e.self_us
        runtime = e.cat == "cuda_runtime"
        s.kernel_launches += runtime and e.name in LAUNCHES
        s.graph_launches += runtime and e.name in GRAPH_LAUNCHES
        if runtime and e.name in SYNCS:
            origin = s.syncs[" < ".join((e.name, *python[::-1][:caller_depth]))]
            origin[0] += 1
            origin[1] += e.dur
        if e.cat == "python_function" and not e.name.startswith("<built-in"):
            python = (*python, e.name)
        for c in e.children:
            walk(c, open_names | {e.name}, python)

    for r in roots:
        walk(r, frozenset(), ())
    return s


def summarize(trace: dict, focus: str | None = None, min_busy_ms: float = 1.0) -> list[ThreadSummary]:
    """The threads busy at least ``min_busy_ms`` (within ``focus``), busiest first."""
    by_thread, names = thread_events(trace)
    out = []
    for key, events in by_thread.items():
        roots = focus_roots(nest(events), focus)
        s = summarize_thread(names.get(key) or f"tid {key[1]}", roots)
        if s.busy_us > 0 and s.busy_us >= min_busy_ms * 1e3:
            out.append(s)
    return sorted(out, key=lambda s: -s.busy_us)


def _rows(items: list[tuple[str, float, int]], total_us: float) -> list[str]:
    return [
        f"| {ms / 1e3:.1f} | {100 * ms / total_us:.1f}% | {calls} | `{name[:110]}` |"
        for name, ms, calls in items
    ]


DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _overlap_us(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """The time two unions of intervals (each sorted and disjoint) share."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _device_work(trace: dict) -> dict[str, list[tuple[float, float, str]]]:
    """The trace's kernels and copies by CUDA stream: (start, end, name), in microseconds."""
    by_stream: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES:
            stream = str(e.get("args", {}).get("stream", e.get("tid")))
            start = float(e["ts"])
            by_stream[stream].append((start, start + float(e.get("dur", 0.0)), e["name"]))
    return by_stream


def _busy_intervals(
    by_stream: dict[str, list[tuple[float, float, str]]],
) -> dict[str, list[tuple[float, float]]]:
    """Each stream's busy intervals: the union of its work."""
    return {k: _union([(start, end) for start, end, _ in v]) for k, v in by_stream.items()}


def _busy_us(unions: dict[str, list[tuple[float, float]]]) -> dict[str, float]:
    """Each stream's busy time (us), from its busy intervals: what ranks the streams."""
    return {k: sum(end - start for start, end in u) for k, u in unions.items()}


def device_streams(trace: dict) -> dict:
    """The device's work by CUDA stream: each stream's kernels (and copies), the time it was busy (their
    union) and the time it ran beside the busiest stream (with ``--overlap-encoder``: how much of the side
    stream's encodes ran under the steps' work)."""
    by_stream = _device_work(trace)
    unions = _busy_intervals(by_stream)
    busy = _busy_us(unions)
    main = max(busy, key=busy.get, default=None)
    return {
        k: {
            "launches": len(by_stream[k]),
            "busy_ms": round(busy[k] / 1e3, 3),
            "beside_busiest_ms": round(_overlap_us(unions[k], unions[main]) / 1e3, 3) if k != main else None,
        }
        for k in sorted(busy, key=busy.get, reverse=True)
    }


def kernel_chain(trace: dict) -> dict[str, dict[str, float]]:
    """What each kernel name adds to its stream's timeline: a kernel's end minus the later of its start and
    the end of the stream's work before it, summed by name (with the launch count and the kernels' own
    durations). Under programmatic dependent launch a kernel starts before the one ahead of it ends and its
    own duration includes that wait, so own durations summed overstate the small kernels (a norm that waits
    on a GEMM); the chain's shares add up to the stream's busy time. The busiest stream only (by its busy
    time, as ``device_streams`` ranks them)."""
    by_stream = _device_work(trace)
    if not by_stream:
        return {}
    busy = _busy_us(_busy_intervals(by_stream))
    events = sorted(by_stream[max(busy, key=busy.get)])
    chain: dict[str, dict[str, float]] = defaultdict(lambda: {"launches": 0, "chain_us": 0.0, "own_us": 0.0})
    reached = events[0][0]
    for start, end, name in events:
        row = chain[name]
        row["launches"] += 1
        row["own_us"] += end - start
        row["chain_us"] += max(0.0, end - max(reached, start))
        reached = max(reached, end)
    return dict(sorted(chain.items(), key=lambda kv: -kv[1]["chain_us"]))


def render_chain(chain: dict[str, dict[str, float]], steps: int, top: int) -> str:
    """``kernel_chain``'s rows per step (of ``steps`` the trace holds), as Markdown."""
    total = sum(row["chain_us"] for row in chain.values()) / steps
    lines = [
        f"## the busiest stream's timeline: {total / 1e3:.3f} ms a step",
        "",
        "| kernel | launches a step | on the timeline (us) | own duration (us) |",
        "|---|---:|---:|---:|",
    ]
    for name, row in list(chain.items())[:top]:
        lines.append(
            f"| {name[:80]} | {row['launches'] / steps:g} | {row['chain_us'] / steps:.1f} | "
            f"{row['own_us'] / steps:.1f} |"
        )
    return "\n".join(lines) + "\n"


def render_streams(streams: dict) -> str:
    if not streams:
        return ""
    lines = [
        "## device: work by CUDA stream",
        "",
        "| stream | launches | busy ms | of it beside the busiest |",
    ]
    lines.append("|---|---:|---:|---:|")
    for k, v in streams.items():
        beside = "–" if v["beside_busiest_ms"] is None else f"{v['beside_busiest_ms']:.1f}"
        lines.append(f"| {k} | {v['launches']} | {v['busy_ms']:.1f} | {beside} |")
    return "\n".join(lines) + "\n"


def render(threads: list[ThreadSummary], top: int, focus: str | None) -> str:
    lines = []
    for s in threads:
        where = f" inside `{focus}`" if focus else ""
        lines += [
            f"## {s.name}: {s.busy_us / 1e3:.1f} ms in traced calls{where}; "
            f"{s.kernel_launches} kernel launches, {s.graph_launches} graph launches",
            "",
        ]
        functions = [(n, v, s.calls[n]) for n, v in s.inclusive.items()]
        python = [(n, v, s.calls[n]) for (c, n), v in s.self_us.items() if c == "python_function"]
        native = [(f"{c}: {n}", v, s.calls[n]) for (c, n), v in s.self_us.items() if c != "python_function"]
        syncs = [(origin, us, int(n)) for origin, (n, us) in s.syncs.items()]
        for title, items in (
            ("inclusive", functions),
            ("self time, Python", python),
            ("self time, torch ops and CUDA runtime", native),
            ("host syncs, by the Python functions they came from", syncs),
        ):
            if not items and title.startswith("host syncs"):
                continue
            lines += [f"**{title}**", "", "| ms | share | calls | name |", "|---:|---:|---:|---|"]
            lines += _rows(sorted(items, key=lambda t: -t[1])[:top], s.busy_us or 1.0)
            lines.append("")
    return "\n".join(lines)


def as_json(threads: list[ThreadSummary], top: int) -> list[dict]:
    def best(d: dict, key=lambda k: k) -> list[list]:
        return [[key(k), round(v / 1e3, 3)] for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:top]]

    return [
        {
            "thread": s.name,
            "busy_ms": round(s.busy_us / 1e3, 3),
            "kernel_launches": s.kernel_launches,
            "graph_launches": s.graph_launches,
            "inclusive_ms": best(s.inclusive),
            "self_ms": best(s.self_us, key=lambda k: f"{k[0]}: {k[1]}"),
            "syncs": {
                origin: {"calls": int(n), "ms": round(us / 1e3, 3)} for origin, (n, us) in s.syncs.items()
            },
        }
        for s in threads
    ]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", type=Path)
    p.add_argument("--top", type=int, default=25, help="rows per table")
    p.add_argument("--focus", help="only what ran inside functions whose name contains this")
    p.add_argument("--min-busy-ms", type=float, default=1.0, help="leave out threads busy for less")
    p.add_argument("--json", type=Path, help="also write the summary here")
    p.add_argument(
        "--chain",
        type=int,
        metavar="STEPS",
        help="instead: each kernel's share of the busiest stream's timeline (kernel_chain), per one of STEPS",
    )
    args = p.parse_args(argv)
    trace = load(args.trace)
    if args.chain:
        print(render_chain(kernel_chain(trace), args.chain, args.top))
        return
    threads = summarize(trace, args.focus, args.min_busy_ms)
    streams = device_streams(trace) if not args.focus else {}
    print(f"# {args.trace.name}\n")
    print(render_streams(streams))
    print(render(threads, args.top, args.focus))
    if args.json:
        summary = {"threads": as_json(threads, args.top), "streams": streams}
        args.json.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
