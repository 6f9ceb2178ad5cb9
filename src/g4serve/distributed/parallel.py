"""``TensorParallel``: one rank's view of its tensor-parallel group, and the collectives the decoder needs.

Row-parallel outputs (attention's o_proj, the MLP's and the experts' down projections, vocab-parallel
embeddings) are partial sums: ``all_reduce`` adds them. The vocab-parallel LM head's logits are slices of the
vocabulary: ``all_gather`` puts them side by side. A group of one does neither, so the single-GPU path pays
nothing. The collectives run on ``device_group`` (NCCL on GPUs, gloo on CPUs); ``cpu_group`` (gloo) carries
Python objects, a step's inputs among them, without a device round trip.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    device_group: Any = None  # a torch.distributed ProcessGroup (None: a group of one)
    cpu_group: Any = None
    # Routed experts split by expert (each rank holds size-th of them whole) instead of by their units.
    expert_parallel: bool = False

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x``, in place."""
        if self.size > 1:
            dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` side by side along the last dimension, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` into every rank's ``x`` (same shape and dtype), in place."""
        if self.size > 1:
            dist.broadcast(x, src=0, group=self.device_group)
        return x

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's ``obj``, on every rank (pickled over the CPU group)."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]


SINGLE = TensorParallel()  # the group of one: no collectives
