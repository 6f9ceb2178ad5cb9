"""Sampling parameters with vLLM's names and defaults, validated at the edge."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    # Extension point for constrained decoding (set by the server from response_format).
    structured_output: object | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        def check(cond: bool, name: str, msg: str) -> None:
            if not cond:
                raise SamplingParamsError(f"{name}: {msg}")

        check(isinstance(self.n, int) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n!r}")
        check(_is_number(self.temperature) and self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature!r}")
        check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p!r}")
        check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", f"must be -1, 0 or a positive integer, got {self.top_k!r}")
        check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p!r}")
        check(self.seed is None or isinstance(self.seed, int), "seed", f"must be an integer, got {self.seed!r}")
        check(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            "max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}",
        )
        check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens!r}")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be token ids")
        check(
            self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
            "logprobs", f"must be an integer in [0, 20], got {self.logprobs!r}",
        )
        check(_is_number(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty", "must be > 0")
        check(_is_number(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]")
        check(_is_number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
