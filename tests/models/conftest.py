"""Fixtures shared by the model tests: quantized tiny checkpoints, built once per session for every file
that uses them."""

from __future__ import annotations

from pathlib import Path

import pytest
from quant_checkpoints import SPECS, build_quantized_checkpoint


@pytest.fixture(scope="session")
def quantized_checkpoint(hf_checkpoint, tmp_path_factory):
    """``quantized_checkpoint(name) -> (compressed dir, dense dir)``, built once per session."""
    cache: dict[str, tuple[Path, Path]] = {}

    def get(name: str) -> tuple[Path, Path]:
        if name not in cache:
            out = tmp_path_factory.mktemp(f"ct-{name}")
            cache[name] = build_quantized_checkpoint(hf_checkpoint(SPECS[name][0]), out, name)
        return cache[name]

    return get
