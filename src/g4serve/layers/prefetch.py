"""Which weights a decode step asks L2 for, and at which points of a layer (``kernels/l2_prefetch.py``).

A decode step reads its projections' weights in a fixed order, the *weight stream*: per layer the q/k/v
projection, ``o_proj``, gate/up, ``down_proj`` and the PLE gate and projection. Between some of them run
kernels that leave HBM idle (norms, the attention prologue, attention, its merge). A *prefetch point* is a
place in the layer's code where a launch asks L2 for the stream's next bytes, up to ``G4SERVE_L2_PREFETCH_MB``
past the first weight read after the point, less what an earlier point already asked for:

- ``attn``: before the layer's input projection (q/k/v);
- ``mlp``: after ``o_proj``, before the post-attention norm (the window reaches into gate/up);
- ``tail``: after ``down_proj`` (the PLE weights and the next layer's q/k/v).

The plan is made once per model (``plan``, from ``Gemma4TextModel.plan_l2_prefetch``) and holds the weight
tensors themselves, so their addresses are read at each launch (and baked into a captured graph). Only decode
sizes prefetch (``MAX_ROWS`` token rows): a prefill is compute-bound and reads each weight many times.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from g4serve import envs
from g4serve.kernels import l2_prefetch as _kernel
from g4serve.kernels._launch import PDL_MAX_ROWS
from g4serve.layers.quant import FP8, QuantLinear

MODE = envs.get("G4SERVE_L2_PREFETCH")
BUDGET_BYTES = int(envs.get_float("G4SERVE_L2_PREFETCH_MB") * (1 << 20))
POINTS = tuple(p for p in envs.get("G4SERVE_L2_PREFETCH_AT").split(",") if p)
KNOWN_POINTS = ("attn", "mlp", "tail")
MAX_ROWS = PDL_MAX_ROWS

Region = tuple[torch.Tensor, int, int]  # (tensor, byte offset, bytes)


def streamed_weight(module: nn.Module | None) -> torch.Tensor | None:
    """The tensor a decode-sized call of ``module`` streams from memory: a plain projection's weight, an FP8
    projection's e4m3 weight; None for what the stream leaves out (int4 layouts, which the decode kernels
    read in a repacked form, and anything else)."""
    if type(module) is nn.Linear:
        return module.weight
    if isinstance(module, QuantLinear) and module.kind == FP8:
        return module.weight
    return None


@dataclass(frozen=True)
class Point:
    key: object  # what the caller looks the regions up by, e.g. (layer index, "mlp")
    index: int  # the stream entry read first after the point


def plan(stream: Sequence[torch.Tensor], points: Sequence[Point], budget: int) -> dict[object, list[Region]]:
    """Each point's regions: the stream's bytes from its entry on, to ``budget`` bytes past the entry's start,
    less what the points before it (in step order) already asked for; at most ``l2_prefetch.MAX_REGIONS``
    tensors a point (the window stops at the last one)."""
    starts = [0]
    for weight in stream:
        starts.append(starts[-1] + weight.numel() * weight.element_size())
    asked = 0  # the stream's bytes asked for so far: [0, asked)
    out: dict[object, list[Region]] = {}
    for point in points:
        begin, end = max(starts[point.index], asked), starts[point.index] + budget
        regions: list[Region] = []
        for i in range(point.index, len(stream)):
            lo, hi = max(begin, starts[i]), min(end, starts[i + 1])
            if starts[i] >= end or len(regions) == _kernel.MAX_REGIONS:
                break
            if hi > lo:
                regions.append((stream[i], lo - starts[i], hi - lo))
                asked = hi
        if regions:
            out[point.key] = regions
    return out


def enabled(device: torch.device) -> bool:
    """Whether steps on ``device`` prefetch: switched on, CUDA, and the bulk form where Hopper is there."""
    if MODE == "0" or device.type != "cuda" or not POINTS:
        return False
    unknown = set(POINTS) - set(KNOWN_POINTS)
    if unknown:
        raise ValueError(f"G4SERVE_L2_PREFETCH_AT: unknown points {sorted(unknown)}; known: {KNOWN_POINTS}")
    return MODE != "bulk" or torch.cuda.get_device_capability(device)[0] >= 9


def issue(regions: list[Region] | None, x: torch.Tensor) -> None:
    """Launch a point's prefetch when the step is decode-sized (``x``: the layer's rows)."""
    if regions and x.shape[0] <= MAX_ROWS:
        _kernel.l2_prefetch(regions, bulk=MODE == "bulk")
