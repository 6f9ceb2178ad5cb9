"""g4serve/transfer.py: ``to_device`` and ``fill_at`` give what ``torch.tensor`` and indexed assignment give
(their point, no host sync on CUDA, is checked on the device by tests/gpu/test_cuda_engine.py)."""

from __future__ import annotations

import pytest
import torch

from g4serve.transfer import fill_at, to_device


def test_to_device_equals_torch_tensor():
    got = to_device([[1, 2], [3, 4]], torch.long, "cpu")
    assert torch.equal(got, torch.tensor([[1, 2], [3, 4]])) and got.dtype == torch.long


@pytest.mark.parametrize(
    ("dtype", "value"), [(torch.bool, True), (torch.bool, False), (torch.int32, -1), (torch.float32, 2.5)]
)
def test_fill_at_equals_indexed_assignment(dtype, value):
    base = torch.arange(24).reshape(4, 6).to(dtype) if dtype != torch.bool else torch.rand(4, 6) > 0.5
    rows, cols = torch.tensor([0, 2, 2, 3]), torch.tensor([5, 1, 1, 0])  # a repeated pair too
    want = base.clone()
    want[rows, cols] = value
    got = base.clone()
    fill_at(got, (rows, cols), value)
    assert torch.equal(got, want)
    flat = base.flatten().clone()
    fill_at(flat, (torch.tensor([1, 7]),), value)
    expected = base.flatten().clone()
    expected[torch.tensor([1, 7])] = value
    assert torch.equal(flat, expected)
