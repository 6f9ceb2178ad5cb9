"""Host values to the device without waiting for the stream.

``torch.tensor(values, device="cuda")`` copies from pageable memory with ``non_blocking=False``, which
synchronises the current stream: called after a forward was launched (the sampler's per-row parameters,
row indices), it makes the host wait for that forward, and async scheduling loses its overlap. Staged in
page-locked memory instead, the copy is queued behind the forward and the host goes on; PyTorch's caching
host allocator keeps the staging block until the copy has run.

The same trap hides in indexed assignment: ``cuda_tensor[index] = True`` turns the Python value into a CPU
scalar that ``index_put_`` copies to the device blocking, one stream sync per assignment. ``fill_at`` fills
from a scalar made on the device instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)``, queued on the current stream without a sync."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def fill_at(tensor: torch.Tensor, indices: tuple[torch.Tensor, ...], value: bool | int | float) -> None:
    """``tensor[indices] = value`` (advanced indexing by index tensors on ``tensor``'s device), without a
    host sync: the value is a 0-dim tensor filled on the device, not a host scalar copied there."""
    tensor.index_put_(indices, torch.full((), value, dtype=tensor.dtype, device=tensor.device))


__all__ = ["fill_at", "to_device"]
