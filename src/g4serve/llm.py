"""vLLM-style offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))`` and ``.chat(messages)``.

Runs on the continuous-batching engine: all prompts are submitted at once and stepped
together until every one has finished.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from g4serve.engine.engine import EngineConfig, LLMEngine
from g4serve.lora import LoRARequest
from g4serve.outputs import RequestOutput
from g4serve.processing.chat import split_chat_messages
from g4serve.processing.processor import ProcessedPrompt
from g4serve.processing.tokenizer import Tokenizer
from g4serve.sampling_params import SamplingParams

PromptType = str | dict[str, Any]
LoRAType = LoRARequest | Sequence[LoRARequest | None] | None


class LLM:
    """An offline Gemma 4 model.

    ``model`` is a Hugging Face checkpoint directory, a preset name (``tiny``, ``e2b``, ``e4b``,
    ``26b-a4b``, ``31b``: random weights, for benchmarks) or None for the embedded tiny model.
    Presets use the embedded tokenizer, with the config's special-token ids mapped onto it.
    Other keyword arguments are ``EngineConfig`` fields (``max_num_seqs``, ``kv_cache_bytes``, ...).
    With ``enable_lora=True``, ``generate``/``chat`` take ``lora_request`` (one for all prompts, or one per
    prompt, None for the base model), as vLLM's do; an adapter is loaded on its first use.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        device: str = "auto",
        dtype: str = "auto",
        text_only: bool = False,
        limit_mm_per_prompt: dict[str, int] | None = None,
        **engine_kwargs: Any,
    ):
        config = EngineConfig(
            model=None if model is None else str(model),
            device=str(device),
            dtype=str(dtype),
            text_only=text_only,
            **engine_kwargs,
        )
        if limit_mm_per_prompt is not None and not text_only:
            config.limit_mm_per_prompt = {**config.limit_mm_per_prompt, **limit_mm_per_prompt}
        self._start(config)

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        """An ``LLM`` on a whole ``EngineConfig`` (e.g. from ``g4serve.engine_args``' flags)."""
        llm = cls.__new__(cls)
        llm._start(config)
        return llm

    def _start(self, config: EngineConfig) -> None:
        _check_device(str(config.device))
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine's worker processes (``tensor_parallel_size`` > 1); nothing to do otherwise."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def config(self):
        return self.engine.model_config

    @property
    def model(self):
        return self.engine.model

    @property
    def processor(self):
        return self.engine.processor

    @property
    def device(self):
        return self.engine.device

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRAType = None,
    ) -> list[RequestOutput]:
        return self._run(
            [self.engine.process_prompt(p) for p in _as_list(prompts)], sampling_params, lora_request
        )

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRAType = None,
    ) -> list[RequestOutput]:
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages: must be a non-empty list of messages (or of conversations)")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        processed = []
        for conversation in conversations:
            template_messages, media = split_chat_messages(conversation, allow_local_files=True)
            text = self.tokenizer.apply_chat_template(
                template_messages, add_generation_prompt=add_generation_prompt, **(chat_template_kwargs or {})
            )
            # The rendered template already starts with <bos>.
            processed.append(
                self.engine.process_prompt(
                    {"prompt": text, "multi_modal_data": media.as_dict()}, add_special_tokens=False
                )
            )
        return self._run(processed, sampling_params, lora_request)

    def _adapters(self, lora_request: LoRAType, count: int) -> list[str | None]:
        """The adapter name of each of ``count`` prompts, loading adapters seen for the first time."""
        if lora_request is None or isinstance(lora_request, LoRARequest):
            requests = [lora_request] * count
        else:
            requests = list(lora_request)
            if len(requests) != count:
                raise ValueError(f"lora_request: {len(requests)} given for {count} prompts")
        names = []
        for request in requests:
            if request is None:
                names.append(None)
                continue
            if self.engine.lora is None or request.lora_name not in self.engine.lora:
                if request.lora_path is None:
                    raise ValueError(
                        f"lora_request: adapter '{request.lora_name}' is not loaded and has no lora_path"
                    )
                self.engine.load_lora(request.lora_name, request.lora_path)
            names.append(request.lora_name)
        return names

    def _run(
        self,
        processed: list[ProcessedPrompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        lora_request: LoRAType = None,
    ) -> list[RequestOutput]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(processed)
        else:
            params = list(sampling_params)
            if len(params) != len(processed):
                raise ValueError(f"sampling_params: {len(params)} given for {len(processed)} prompts")
        adapters = self._adapters(lora_request, len(processed))
        # Validate every prompt before submitting any, so a bad one leaves no work behind.
        groups: list[list[str]] = []
        requests = []
        for proc, p, adapter in zip(processed, params, adapters):
            base = str(next(self._ids))
            ids = []
            for index in range(p.n):
                child = p if p.n == 1 else p.for_choice(index)
                rid = base if p.n == 1 else f"{base}-{index}"
                requests.append(self.engine.make_request(rid, proc, child, lora_name=adapter))
                ids.append(rid)
            groups.append(ids)
        for request in requests:
            self.engine.add_request(request)
        try:
            finished = self.engine.run_until_finished()
        except BaseException:
            for request in requests:
                self.engine.abort_request(request.request_id)
            raise
        results = []
        for proc, ids in zip(processed, groups):
            outs = [finished[rid] for rid in ids]
            completions = [replace(o.outputs[0], index=i) for i, o in enumerate(outs)]
            results.append(replace(outs[0], request_id=ids[0].split("-")[0], outputs=completions))
        return results


def _check_device(device: str) -> None:
    """Turn torch's device errors (a RuntimeError, or a CUDA init failure deep in the loader) into a
    ValueError that names the option."""
    if device == "auto":
        return
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device: {device!r} is not a torch device ({exc})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device: {device!r} was requested but CUDA is not available on this machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(
                f"device: {device!r} does not exist ({torch.cuda.device_count()} CUDA device(s))"
            )


def _as_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    return [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
