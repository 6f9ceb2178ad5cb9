"""LoRA adapters: PEFT directories read and checked (``adapter``; ``alpha_pattern`` keys matched at a bounded
cost by ``patterns``), and the loaded ones by name, each in a slot of the decoder's stacked adapter weights
(``registry``; the weights and the per-token op live in ``g4serve.layers.lora`` and
``g4serve.kernels.lora``)."""

from __future__ import annotations

from dataclasses import dataclass

from g4serve.lora.adapter import LoRAAdapter, LoRAAdapterError, load_peft_adapter
from g4serve.lora.registry import LoRARegistry


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's ``LoRARequest``: the adapter one ``LLM.generate`` call runs with, loaded on first use."""

    lora_name: str
    lora_int_id: int = 0  # accepted for vLLM compatibility; adapters are told apart by name
    lora_path: str | None = None


__all__ = ["LoRAAdapter", "LoRAAdapterError", "LoRARegistry", "LoRARequest", "load_peft_adapter"]
