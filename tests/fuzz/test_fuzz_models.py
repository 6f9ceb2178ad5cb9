"""Property tests of the request models and parsing helpers, in process: for any JSON-ish input, parsing
succeeds or raises its documented error (pydantic ``ValidationError``, ``ValueError``,
``SamplingParamsError``, the server's ``APIError``), never RecursionError, OverflowError, TypeError,
KeyError, ...

Each ``@example`` is a case the fuzzer found (or a known hostile shape), kept as a deterministic
regression test.
"""

from __future__ import annotations

import math

import pytest
from fuzzlib import any_values, deep, fuzz_settings, json_values, mutated_body, strings
from hypothesis import example, given
from hypothesis import strategies as st
from pydantic import ValidationError

from g4serve.processing.chat import split_chat_messages
from g4serve.sampling_params import SamplingParams, SamplingParamsError
from g4serve.server.errors import APIError
from g4serve.server.protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse, StreamOptions
from g4serve.server.serving_base import OpenAIServing, field_path

MODELS = [ChatCompletionRequest, CompletionRequest, StreamOptions, ErrorResponse]


def _validate(model, body):
    """``model.model_validate(body)`` -> the model or None (a ValidationError, whose every location must
    map to a field path); any other exception propagates (a failure)."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        for err in exc.errors():
            path = field_path(err["loc"], body) if isinstance(body, dict) else ""
            assert isinstance(path, str)
            assert isinstance(err["msg"], str)
        return None


def _sampling(req, max_tokens, logprobs):
    """The server's translation to engine parameters: an ``APIError`` (400) or SamplingParams."""
    try:
        params = OpenAIServing.sampling_params(req, max_tokens, logprobs)
    except APIError as exc:
        assert 400 <= exc.status < 500, exc.status
        return None
    assert isinstance(params, SamplingParams)
    return params


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
@fuzz_settings()
@given(body=any_values)
def test_models_validate_any_json(model, body):
    _validate(model, body)


@fuzz_settings()
@given(body=mutated_body("chat"))
@example(body={"messages": [{"role": "user", "content": "hi"}], "seed": 2**64})
@example(body={"messages": [{"role": "user", "content": "hi"}], "temperature": float("nan")})
@example(body={"messages": [{"role": "user", "content": [{"type": ["x"]}]}]})
@example(body={"messages": [{"role": "user", "content": [{"type": {"a": 1}}]}]})
@example(body={"messages": [{"role": {"a": 1}, "content": "x"}]})
@example(body={"messages": deep(3000)})
@example(body={"messages": [{"role": "user", "content": "x"}], "response_format": deep(3000, "dict")})
@example(body={"messages": [{"role": "user", "content": "x"}], "stop": [""], "top_k": 2**64})
def test_chat_request_parses_or_names_the_field(body):
    """Body -> ChatCompletionRequest -> messages split -> sampling params: each step succeeds or raises its
    documented error type."""
    req = _validate(ChatCompletionRequest, body)
    if req is None:
        return
    try:
        split_chat_messages(req.messages, allow_local_files=False)
    except ValueError as exc:
        assert str(exc)
    _sampling(req, req.effective_max_tokens(), req.num_logprobs())


@fuzz_settings()
@given(body=mutated_body("completion"))
@example(body={"prompt": [2**64], "max_tokens": 2**64})
@example(body={"prompt": deep(3000)})
@example(body={"prompt": "x", "logprobs": 2**64, "n": 2**64})
def test_completion_request_parses_or_names_the_field(body):
    req = _validate(CompletionRequest, body)
    if req is None:
        return
    req.prompts()
    _sampling(req, req.max_tokens, req.logprobs)


@fuzz_settings()
@given(messages=st.one_of(any_values, st.lists(any_values, max_size=3)), allow=st.booleans())
@example(messages=[{"role": "user", "content": [{"type": ["image"]}]}], allow=False)
@example(messages=[{"role": "user", "content": [{"type": {}}]}], allow=False)
@example(
    messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": 5}}]}], allow=False
)
@example(messages=[{"role": "user", "content": [{"type": "input_audio", "input_audio": "x"}]}], allow=True)
@example(messages=[{"role": "user", "content": [{"type": "video", "video": [1, "data:,"]}]}], allow=True)
@example(
    messages=[{"role": "user", "content": [{"type": "image", "image": "data:image/png;base64,!"}]}], allow=1
)
def test_split_chat_messages_raises_value_error_only(messages, allow):
    try:
        out, media = split_chat_messages(messages, allow_local_files=allow)
    except ValueError as exc:
        assert str(exc)
        return
    assert len(out) == len(messages)
    assert set(media.as_dict()) <= {"image", "video", "audio"}


_PARAM_VALUES = st.one_of(json_values, st.sampled_from([2**64, -(2**64), math.inf, -math.inf, math.nan]))
_PARAM_NAMES = [
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "max_tokens",
    "min_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "logprobs",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
]


@fuzz_settings()
@given(kwargs=st.dictionaries(st.sampled_from(_PARAM_NAMES), _PARAM_VALUES, max_size=5))
@example(kwargs={"stop": {"a": 1}})
@example(kwargs={"stop_token_ids": "abc"})
@example(kwargs={"stop": [None]})
@example(kwargs={"stop_token_ids": [None]})
@example(kwargs={"max_tokens": 2, "min_tokens": "3"})
@example(kwargs={"max_tokens": "3"})
@example(kwargs={"temperature": "1"})
@example(kwargs={"n": 2**64, "seed": 2**64, "top_k": 2**64})
def test_sampling_params_raise_sampling_params_error_only(kwargs):
    try:
        params = SamplingParams(**kwargs)
    except SamplingParamsError as exc:
        assert str(exc).split(":")[0] in _PARAM_NAMES, str(exc)
        return
    params.validate()  # idempotent


@fuzz_settings()
@given(
    loc=st.lists(st.one_of(st.integers(0, 10), strings), max_size=6).map(tuple),
    body=st.one_of(st.dictionaries(strings, json_values, max_size=4), json_values),
)
@example(loc=("messages", 0, "content"), body={"messages": []})
@example(loc=("messages", 5), body={"messages": {"5": 1}})
@example(loc=("prompt", "list[int]", 0), body={"prompt": ["x"]})
@example(loc=("a", "b", "c"), body={"a": "not a dict"})
def test_field_path_never_raises(loc, body):
    """``field_path`` turns pydantic's error location into the request's field path for any body shape."""
    assert isinstance(field_path(loc, body), str)
