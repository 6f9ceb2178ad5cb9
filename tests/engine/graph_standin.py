"""A stand-in for ``cuda_graphs._capture`` on the CPU: the "graph" re-runs the captured function into the
outputs of its first run, so replays write the same static tensors a CUDA graph would (the encoder graph
runners' padding, chunking and bucketing tested without a GPU)."""

from __future__ import annotations

import torch


class ReplayEager:
    def __init__(self, forward, outputs):
        self.forward, self.outputs = forward, outputs

    def replay(self) -> None:
        fresh = self.forward()
        if isinstance(self.outputs, torch.Tensor):
            self.outputs.copy_(fresh)
            return
        for static, new in zip(self.outputs, fresh, strict=True):
            static.copy_(new)


def fake_capture(forward, pool, device, stream=None):
    """``_capture``'s signature; ``stream`` (an encoder runner's capture stream, None on the CPU) unused."""
    outputs = forward()
    return ReplayEager(forward, outputs), outputs
