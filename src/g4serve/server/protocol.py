"""OpenAI request bodies (pydantic, strict types) and their translation to engine sampling parameters.

Field names and defaults follow the OpenAI API, plus vLLM's common extensions (``top_k``,
``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``chat_template_kwargs``, ``priority``). Types are strict: a string where a number belongs is a
400 naming the field, never a silent coercion.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr

from g4serve.sampling_params import SamplingParams, SamplingParamsError, check_logit_bias_size

Number = float  # strict mode: ints and floats pass, strings and booleans do not


class _Request(BaseModel):
    # Unknown fields are ignored (clients send many optional extras, e.g. "user", "store").
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class _SamplingFields(_Request):
    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    min_p: Number | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    n: StrictInt = 1
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    repetition_penalty: Number | None = None
    logit_bias: dict[StrictStr, Number] | None = None  # OpenAI: token id (as a string) -> bias in [-100, 100]
    min_tokens: StrictInt = 0
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    response_format: dict[str, Any] | None = None
    priority: StrictInt = 0
    # vLLM's: KV blocks are shared only between requests of the same salt (none: all unsalted requests)
    cache_salt: StrictStr | None = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Engine parameters; ``SamplingParamsError`` (naming the field) on bad values."""
        kwargs: dict[str, Any] = dict(
            n=self.n,
            max_tokens=max_tokens,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
        )
        # OpenAI's defaults where the field is absent (temperature 1, no truncation, no penalties).
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            value = getattr(self, name)
            if value is not None:
                kwargs[name] = value
        if self.top_k is not None:
            kwargs["top_k"] = self.top_k
        if self.logit_bias:
            kwargs["logit_bias"] = _token_keys(self.logit_bias)
        return SamplingParams(**kwargs)


def _token_keys(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's logit_bias keys are token ids written as strings ("50256"). The count is checked first: 3
    million keys were parsed here before SamplingParams refused them (0.8 s of the event loop)."""
    check_logit_bias_size(bias)
    out = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10):
            raise SamplingParamsError(f"logit_bias: keys must be token ids, got {key[:40]!r}")
        out[int(key)] = value
    return out


class ChatCompletionRequest(_SamplingFields):
    messages: list[dict[str, Any]]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: StrictStr | None = None  # vLLM's field; refused unless --trust-request-chat-template
    add_generation_prompt: StrictBool = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None  # "auto" | "none" | "required" | a named function
    parallel_tool_calls: StrictBool = True
    reasoning_effort: StrictStr | None = None  # any effort but "none" turns Gemma 4's thinking on
    # Thought tokens after which the engine closes the thought channel; thinking_token_budget is vLLM's name.
    max_reasoning_tokens: StrictInt | None = None
    thinking_token_budget: StrictInt | None = None

    def reasoning_budget(self) -> int | None:
        """max_reasoning_tokens (or vLLM's thinking_token_budget); SamplingParamsError if both differ."""
        a, b = self.max_reasoning_tokens, self.thinking_token_budget
        if a is not None and b is not None and a != b:
            raise SamplingParamsError(
                f"max_reasoning_tokens: ({a}) and its alias thinking_token_budget ({b}) disagree"
            )
        return a if a is not None else b

    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0


class CompletionRequest(_SamplingFields):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    suffix: StrictStr | None = None

    def prompts(self) -> list[str | dict[str, list[int]]]:
        """Each prompt as a string or ``{"prompt_token_ids": [...]}`` (the engine's prompt forms)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            return []
        if all(isinstance(x, str) for x in p):
            return list(p)
        if all(isinstance(x, int) for x in p):
            return [{"prompt_token_ids": list(p)}]
        return [{"prompt_token_ids": list(x)} for x in p]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


FinishReason = Literal["stop", "length", "abort"]


def usage(
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int = 0,
    forced_tokens: int = 0,
    reasoning_tokens: int | None = None,
) -> dict[str, Any]:
    """OpenAI's usage object; ``forced_tokens`` (of the completion tokens, those jump-forward appended
    without decoding them, ``--jump-forward``) goes into ``completion_tokens_details`` when there are any,
    ``reasoning_tokens`` (those of the thought channel, its markers included) whenever it is not None."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    details: dict[str, int] = {}
    if reasoning_tokens is not None:
        details["reasoning_tokens"] = reasoning_tokens
    if forced_tokens:
        details["forced_tokens"] = forced_tokens
    if details:
        out["completion_tokens_details"] = details
    return out


__all__ = [
    "ChatCompletionRequest",
    "CompletionRequest",
    "ErrorInfo",
    "ErrorResponse",
    "FinishReason",
    "StreamOptions",
    "usage",
]
