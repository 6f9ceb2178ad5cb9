"""The files of a PEFT adapter and the edits that break them, for the LoRA tests of this directory (the
writable adapter itself: the ``adapter`` fixture, ``conftest.py``)."""

from __future__ import annotations

import json

from safetensors.torch import load_file, save_file

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
LM = "base_model.model.model.language_model.layers"
Q0 = f"{LM}.0.self_attn.q_proj"


def edit_config(path, **changes):
    config = json.loads((path / CONFIG).read_text())
    config.update(changes)
    (path / CONFIG).write_text(json.dumps(config))


def edit_weights(path, edit):
    tensors = load_file(path / WEIGHTS)
    edit(tensors)
    save_file(tensors, path / WEIGHTS)
