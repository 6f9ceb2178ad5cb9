"""Pieces shared by the vision and audio towers: the clippable linear layer and the
embedder that maps encoder soft tokens into the text model's embedding space."""

from __future__ import annotations

import torch
from torch import nn

from g4serve.layers.norm import RMSNorm


class ClippableLinear(nn.Module):
    """Bias-free linear whose input and output are clamped to bounds stored in the checkpoint."""

    def __init__(self, in_features: int, out_features: int, use_clipping: bool):
        super().__init__()
        self.use_clipping = use_clipping
        self.linear = nn.Linear(in_features, out_features, bias=False)
        if use_clipping:
            # ±inf until the checkpoint's calibrated bounds are loaded.
            for name, value in (("input_min", -1), ("input_max", 1), ("output_min", -1), ("output_max", 1)):
                self.register_buffer(name, torch.tensor(value * float("inf")))

    def drop_unbounded_clipping(self) -> None:
        """Stop clamping when every bound is infinite (random presets; a checkpoint without calibration):
        the clamps change nothing and cost four elementwise kernels per call. Done once at load time."""
        if self.use_clipping and all(
            torch.isinf(getattr(self, name)).all()
            for name in ("input_min", "input_max", "output_min", "output_max")
        ):
            self.use_clipping = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_clipping:
            x = torch.clamp(x, self.input_min, self.input_max)
        x = self.linear(x)
        if self.use_clipping:
            x = torch.clamp(x, self.output_min, self.output_max)
        return x


class MultimodalEmbedder(nn.Module):
    """Soft tokens [..., in_dim] -> text embeddings [..., text_hidden]: scale-free RMSNorm, projection."""

    def __init__(self, in_dim: int, text_hidden: int, eps: float):
        super().__init__()
        self.embedding_pre_projection_norm = RMSNorm(in_dim, eps, with_scale=False)
        self.embedding_projection = nn.Linear(in_dim, text_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(self.embedding_pre_projection_norm(x))
