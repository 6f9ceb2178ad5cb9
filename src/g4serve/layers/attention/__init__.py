"""Attention of the text decoder over the paged KV cache, and the encoders' dense attention.

- ``metadata.py``: ``AttentionMetadata`` (one step's addressing) and ``contiguous_metadata``;
- ``torch_backend.py``: the ``AttentionBackend`` interface, the ``KVTensors`` protocol of the cache the
  backends receive, ``TorchAttention`` (the exact reference) and ``dense_attention``;
- ``triton_backend.py``: ``TritonAttention``, the same backend on the paged Triton kernels
  (``g4serve.kernels``).
"""

from g4serve.layers.attention.metadata import AttentionMetadata, contiguous_metadata
from g4serve.layers.attention.torch_backend import (
    AttentionBackend,
    KVTensors,
    TorchAttention,
    dense_attention,
)
from g4serve.layers.attention.triton_backend import TritonAttention

BACKENDS = {"torch": TorchAttention, "triton": TritonAttention}


def resolve_backend_name(name: str, device_type: str) -> str:
    """A key of ``BACKENDS`` for ``name`` (``EngineConfig`` has checked it): ``auto`` is the Triton kernels
    on CUDA, the torch reference elsewhere (Triton on CPU runs in its interpreter, for tests only)."""
    if name == "auto":
        return "triton" if device_type == "cuda" else "torch"
    return name


__all__ = [
    "BACKENDS",
    "AttentionBackend",
    "AttentionMetadata",
    "KVTensors",
    "TorchAttention",
    "TritonAttention",
    "contiguous_metadata",
    "dense_attention",
    "resolve_backend_name",
]
