"""Kernel timing from CUDA-graph replays: what a kernel costs inside the engine's captured steps."""

from __future__ import annotations

from collections.abc import Callable

import torch


def graph_replay_ms(
    calls: list[Callable[[], object]], min_calls_per_graph: int = 32, replays: int = 7, warm_all: bool = True
) -> float:
    """Median time of one call, from a CUDA graph that cycles over ``calls`` (at least
    ``min_calls_per_graph`` per replay, so launch gaps amortise), over ``replays`` replays. ``warm_all=False``
    runs only the first call before the capture (every call runs the same kernel: a sweep's small shapes
    cycle over hundreds of weight copies)."""
    for call in calls if warm_all else calls[:1]:  # compile and allocate outside the capture
        call()
    per_graph = max(len(calls), min_calls_per_graph)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for i in range(per_graph):
            calls[i % len(calls)]()
    torch.cuda.synchronize()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / per_graph)
    del graph
    return sorted(times)[len(times) // 2]


def time_sweep(configs: list[dict], time_config: Callable[[dict], float]) -> dict:
    """Times every tile config of a kernel sweep with ``time_config`` (ms) -> {"best", "best_ms", "trials"};
    a config the compiler rejects (registers, shared memory) is reported and left out."""
    trials = []
    for cfg in configs:
        try:
            ms = time_config(cfg)
        except Exception as exc:  # noqa: BLE001 - a tile the compiler rejects: reported, the sweep goes on
            print(f"    {cfg}: {type(exc).__name__}")
            continue
        trials.append({"config": cfg, "ms": ms})
    best = min(trials, key=lambda t: t["ms"])
    return {"best": best["config"], "best_ms": best["ms"], "trials": trials}
