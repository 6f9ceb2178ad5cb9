"""Random PEFT LoRA adapters of a model's shapes, written without ``peft``: for GPU tests and benchmarks on
presets (the tests on CPU make theirs with ``peft`` itself)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from g4serve.config import TextConfig
from g4serve.layers.lora import ATTENTION_MODULES, LORA_MODULES, projection_shapes


def write_random_adapter(
    path: str | Path,
    cfg: TextConfig,
    rank: int,
    seed: int = 0,
    std: float = 0.02,
    modules: tuple[str, ...] = LORA_MODULES,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """A PEFT LoRA directory (``lora_alpha = 2 * rank``) on ``modules`` of every layer, N(0, std) weights."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for (layer, module), (n_in, n_out) in projection_shapes(cfg).items():
        if module not in modules:
            continue
        block = "self_attn" if module in ATTENTION_MODULES else "mlp"
        key = f"base_model.model.model.language_model.layers.{layer}.{block}.{module}"
        tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, n_in, generator=gen) * std).to(dtype)
        tensors[f"{key}.lora_B.weight"] = (torch.randn(n_out, rank, generator=gen) * std).to(dtype)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(modules)}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


__all__ = ["write_random_adapter"]
