"""The LoRA tests' writable adapter (the session's adapters are built in ``tests/conftest.py``)."""

from __future__ import annotations

import shutil

import pytest

from g4serve.config import Gemma4Config


@pytest.fixture
def adapter(lora_adapter, tmp_path):
    """A writable copy of the "all" adapter (rank 4, lora_alpha 8) and the base model's text config."""
    base, src, _ = lora_adapter("all")
    dst = tmp_path / "adapter"
    shutil.copytree(src, dst)
    return dst, Gemma4Config.from_pretrained(base).text
