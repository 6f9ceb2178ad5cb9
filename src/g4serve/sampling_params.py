"""Sampling parameters with vLLM's names and defaults, validated at the edge."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from g4serve.structured import StructuredSpec


class SamplingParamsError(ValueError):
    """An invalid sampling parameter; the message starts with the parameter's name."""


# Bounds that keep every value representable where the engine puts it (fp32/int64 tensors, torch.Generator
# seeds) and meaningful: past these a request is not asking for anything different, only for an overflow.
MAX_INT_PARAM = 2**31 - 1  # n, top_k, max_tokens, min_tokens, stop_token_ids
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes
MAX_TEMPERATURE = 100.0  # the distribution is uniform long before this
# Temperatures below this take the argmax, as vLLM's do: 1e-300 is 0 in fp32 and 1e-40's inverse overflows it
# (logits / t are +-inf and the softmax NaN), and long before either the race is the argmax anyway.
GREEDY_BELOW_TEMPERATURE = 1e-5
MAX_REPETITION_PENALTY = 100.0
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: -100 bans a token, +100 all but forces it
MAX_LOGIT_BIAS_ENTRIES = 1024
# Every stop string is searched for after every token, on the engine thread that steps all requests: 20,000
# one-character stops cost 1.6 ms a token on a 2-core CPU (bench/hostile_inputs.py); OpenAI takes 4 stops.
# Stop token ids are walked per step while min_tokens holds them back.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024


def check_logit_bias_size(bias: dict) -> None:
    """SamplingParamsError past ``MAX_LOGIT_BIAS_ENTRIES`` tokens (before anything walks the keys)."""
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise SamplingParamsError(f"logit_bias: at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got {len(bias)}")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 (or under GREEDY_BELOW_TEMPERATURE) means greedy
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
    # Added to a token's logit before sampling (OpenAI's logit_bias): token id -> bias in [-100, 100].
    logit_bias: dict[int, float] | None = None
    # Constrained decoding: output must match this spec (StructuredSpec.from_response_format, .json_schema,
    # .regex, .choice, ...); the engine compiles it when the request is made.
    structured_output: StructuredSpec | None = field(default=None, repr=False)
    # Thinking is on (Gemma 4's thought channel may open first): structured_output applies after the channel
    # closes, not from the first token (structured/reasoning.py).
    thinking: bool = False
    # Thought tokens after which the engine forces the channel's closing marker (None: no budget).
    max_reasoning_tokens: int | None = None

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

        check(
            _is_int(self.n) and 1 <= self.n <= MAX_INT_PARAM, "n", f"must be an integer >= 1, got {self.n!r}"
        )
        check(
            _is_number(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE,
            "temperature",
            f"must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}",
        )
        check(
            _is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p!r}"
        )
        check(
            _is_int(self.top_k) and 0 <= self.top_k <= MAX_INT_PARAM,
            "top_k",
            f"must be -1, 0 or a positive integer, got {self.top_k!r}",
        )
        check(
            _is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p!r}"
        )
        check(
            self.seed is None or (_is_int(self.seed) and MIN_SEED <= self.seed <= MAX_SEED),
            "seed",
            f"must be an integer in [-2^63, 2^64 - 1], got {self.seed!r}",
        )
        check(
            self.max_tokens is None or (_is_int(self.max_tokens) and 1 <= self.max_tokens <= MAX_INT_PARAM),
            "max_tokens",
            f"must be an integer in [1, {MAX_INT_PARAM}], got {self.max_tokens!r}",
        )
        check(
            _is_int(self.min_tokens) and 0 <= self.min_tokens <= MAX_INT_PARAM,
            "min_tokens",
            f"must be an integer in [0, {MAX_INT_PARAM}], got {self.min_tokens!r}",
        )
        check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
        )
        check(
            len(self.stop) <= MAX_STOP_STRINGS,
            "stop",
            f"at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}",
        )
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        check(
            all(len(s) <= MAX_STOP_STRING_CHARS for s in self.stop),
            "stop",
            f"each string at most {MAX_STOP_STRING_CHARS} characters",
        )
        check(
            len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
            "stop_token_ids",
            f"at most {MAX_STOP_TOKEN_IDS} token ids, got {len(self.stop_token_ids)}",
        )
        bad = [t for t in self.stop_token_ids if not (_is_int(t) and 0 <= t <= MAX_INT_PARAM)]
        check(  # the first bad one, cut short: the error does not echo a list back
            not bad, "stop_token_ids", f"must be non-negative token ids, got {str(bad[:1])[:40]}"
        )
        check(
            self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20),
            "logprobs",
            f"must be an integer in [0, 20], got {self.logprobs!r}",
        )
        check(
            _is_number(self.repetition_penalty) and 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY,
            "repetition_penalty",
            f"must be in (0, {MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty!r}",
        )
        check(
            _is_number(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
            "presence_penalty",
            f"must be in [-2, 2], got {self.presence_penalty!r}",
        )
        check(
            _is_number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
            "frequency_penalty",
            f"must be in [-2, 2], got {self.frequency_penalty!r}",
        )
        check(isinstance(self.thinking, bool), "thinking", f"must be a boolean, got {self.thinking!r}")
        check(
            self.max_reasoning_tokens is None
            or (_is_int(self.max_reasoning_tokens) and 0 <= self.max_reasoning_tokens <= MAX_INT_PARAM),
            "max_reasoning_tokens",
            f"must be an integer in [0, {MAX_INT_PARAM}], got {self.max_reasoning_tokens!r}",
        )
        self._check_logit_bias()

    def for_choice(self, index: int) -> SamplingParams:
        """The parameters of choice ``index`` of an ``n``-choice request: one choice, seeded ``seed + index``
        (wrapping within the seed range) so the choices differ and each is reproducible."""
        seed = self.seed
        if seed is not None:
            seed = MIN_SEED + (seed + index - MIN_SEED) % (MAX_SEED - MIN_SEED + 1)
        return replace(self, n=1, seed=seed)

    def _check_logit_bias(self) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            raise SamplingParamsError(f"logit_bias: must map token ids to numbers, got {type(bias).__name__}")
        check_logit_bias_size(bias)
        for token, value in bias.items():
            if not (_is_int(token) and 0 <= token <= MAX_INT_PARAM):
                raise SamplingParamsError(f"logit_bias: keys must be token ids, got {str(token)[:40]!r}")
            if not (_is_number(value) and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
                raise SamplingParamsError(
                    f"logit_bias[{token}]: must be a number in [-100, 100], got {str(value)[:40]}"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        """Repetition, presence or frequency penalties reshape the logits from the token history."""
        return self.repetition_penalty != 1 or bool(self.presence_penalty) or bool(self.frequency_penalty)


def _is_number(x: object) -> bool:
    """A finite int or float: NaN and the infinities are refused wherever a number is taken."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)  # True is not n=1
