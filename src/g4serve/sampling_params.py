"""Sampling parameters with vLLM's names and defaults, validated at the edge."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from g4serve.structured import StructuredSpec


class SamplingParamsError(ValueError):
    """An invalid sampling parameter; the message starts with the parameter's name."""


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # number of top alternatives to return per token (0: only the chosen)
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Constrained decoding: output must match this spec (StructuredSpec.from_response_format, .json_schema,
    # .regex, .choice, ...); the engine compiles it when the request is made.
    structured_output: StructuredSpec | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        # list("</s>") or list(5) would turn a wrong type into characters or a TypeError; name the field
        # instead.
        if self.stop is not None and not isinstance(self.stop, (list, tuple)):
            raise SamplingParamsError(
                f"stop: must be a string or a list of strings, got {type(self.stop).__name__}"
            )
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise SamplingParamsError(
                f"stop_token_ids: must be a list of token ids, got {type(self.stop_token_ids).__name__}"
            )
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        def check(cond: bool, name: str, msg: str) -> None:
            if not cond:
                raise SamplingParamsError(f"{name}: {msg}")

        check(_is_int(self.n) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n!r}")
        check(
            _is_number(self.temperature) and self.temperature >= 0,
            "temperature",
            f"must be >= 0, got {self.temperature!r}",
        )
        check(
            _is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p!r}"
        )
        check(
            _is_int(self.top_k) and self.top_k >= 0,
            "top_k",
            f"must be -1, 0 or a positive integer, got {self.top_k!r}",
        )
        check(
            _is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p!r}"
        )
        check(self.seed is None or _is_int(self.seed), "seed", f"must be an integer, got {self.seed!r}")
        check(
            self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
            "max_tokens",
            f"must be an integer >= 1, got {self.max_tokens!r}",
        )
        check(
            _is_int(self.min_tokens) and self.min_tokens >= 0,
            "min_tokens",
            f"must be >= 0, got {self.min_tokens!r}",
        )
        check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
        )
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        check(
            all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            f"must be non-negative token ids, got {self.stop_token_ids!r}",
        )
        check(
            self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20),
            "logprobs",
            f"must be an integer in [0, 20], got {self.logprobs!r}",
        )
        check(
            _is_number(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty",
            "must be > 0",
        )
        check(
            _is_number(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
            "presence_penalty",
            "must be in [-2, 2]",
        )
        check(
            _is_number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
            "frequency_penalty",
            "must be in [-2, 2]",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        """Repetition, presence or frequency penalties reshape the logits from the token history."""
        return self.repetition_penalty != 1 or bool(self.presence_penalty) or bool(self.frequency_penalty)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)  # True is not n=1
