"""g4serve: fast serving for Google's Gemma 4 family (text, image, video, audio).

Public API (vLLM-compatible names): ``LLM``, ``SamplingParams``, ``RequestOutput``, ``LoRARequest``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["LLM", "LoRARequest", "RequestOutput", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from g4serve.llm import LLM
    from g4serve.lora import LoRARequest
    from g4serve.outputs import RequestOutput
    from g4serve.sampling_params import SamplingParams


def __getattr__(name: str):
    # Lazy so that light modules (config, CLI help) do not import torch.
    if name == "LLM":
        from g4serve.llm import LLM

        return LLM
    if name == "SamplingParams":
        from g4serve.sampling_params import SamplingParams

        return SamplingParams
    if name == "LoRARequest":
        from g4serve.lora import LoRARequest

        return LoRARequest
    if name == "RequestOutput":
        from g4serve.outputs import RequestOutput

        return RequestOutput
    raise AttributeError(f"module 'g4serve' has no attribute {name!r}")
