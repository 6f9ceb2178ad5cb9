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

A prefetch launch finishes only when its lines have landed, so in the step's chain of kernels it would cost
what loading them costs (measured: an e4b step at B = 1 went from 3.98 to 4.83 ms). ``issue`` therefore
launches it on a side stream that forks from the step's stream at the point and runs beside the norms and
attention; ``join`` (at the end of the decoder's forward) makes the step's stream wait for it once, so a
captured graph has one branch per point, joined before the logits.
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
# lanes a program and bytes a lane of the side launches: ~48 programs for 24 MB either way, so the
# fetch is asked for from many SMs at once (one program's asks are slow: bench/l2_prefetch.py)
LAUNCH = {"bulk": dict(chunk=1 << 14, lanes=32), "line": dict(chunk=1 << 12, lanes=128)}
_SIDE: dict[torch.device, torch.cuda.Stream] = {}
_UNJOINED: set[torch.device] = set()


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
    """Launch a point's prefetch when the step is decode-sized (``x``: the layer's rows), on the side stream,
    after everything the step's stream has launched so far."""
    if not regions or x.shape[0] > MAX_ROWS or not x.is_cuda:
        return
    main = torch.cuda.current_stream(x.device)
    side = _SIDE.get(x.device)
    if side is None:
        side = _SIDE[x.device] = torch.cuda.Stream(x.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        _kernel.l2_prefetch(regions, bulk=MODE == "bulk", dependent=False, **LAUNCH[MODE])
    _UNJOINED.add(x.device)


def join(device: torch.device) -> None:
    """Make ``device``'s current stream wait for the prefetches ``issue`` launched (a captured graph must
    end with its side branches joined); nothing when none is pending."""
    if device in _UNJOINED:
        torch.cuda.current_stream(device).wait_stream(_SIDE[device])
        _UNJOINED.discard(device)
