"""What the fuzz and soak tests share: the size of a run (short in CI, full on demand), hypothesis settings,
JSON-ish strategies (hostile numbers, odd unicode, deep nesting, wrong types), request-body mutators and the
checks every HTTP answer must pass.

``G4SERVE_FUZZ=full`` (``make test-fuzz``) selects the full sizes; anything else runs the short version that
the default ``pytest`` run (CI) takes. The short version is derandomized: the same examples every run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

FULL = os.environ.get("G4SERVE_FUZZ", "").lower() == "full"
# G4SERVE_FUZZ_EXPLORE=1 skips the @example regressions (which fail first and stop a test) to look for new
# failures past the known ones.
EXPLORE = os.environ.get("G4SERVE_FUZZ_EXPLORE", "") not in ("", "0")

# name -> (short, full)
_SIZES = {
    "model_examples": (100, 2000),  # in-process property tests (cheap)
    "http_examples": (60, 600),  # bodies POSTed to the live server
    "schemathesis_s": (60, 600),  # wall-clock budget of the schemathesis run
    "schemathesis_examples": (400, 20000),
    "soak_streams": (60, 300),
    "soak_cancels": (20, 100),
    "soak_warmup": (16, 40),
}


def size(name: str) -> int:
    short, full = _SIZES[name]
    return full if FULL else short


def fuzz_settings(examples: str = "model_examples", **overrides: Any) -> settings:
    """Deterministic in CI (``derandomize``), random and longer with ``G4SERVE_FUZZ=full``; no deadline (the
    server shares two CPU cores with the test) and no example database written into the tree."""
    kwargs: dict[str, Any] = dict(
        max_examples=size(examples),
        deadline=None,
        derandomize=not FULL,
        database=None,
        print_blob=True,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.filter_too_much,
            HealthCheck.function_scoped_fixture,
            HealthCheck.large_base_example,
        ],
    )
    if EXPLORE:
        kwargs["phases"] = [p for p in Phase if p is not Phase.explicit]
    kwargs.update(overrides)
    return settings(**kwargs)


def server_helpers():
    """tests/server/conftest.py as a module (``start_server``, ``stop_server``, ``RunningServer``): it is a
    conftest, not importable by name, so it is loaded from its file once."""
    name = "_g4serve_server_conftest"
    if name not in sys.modules:
        path = Path(__file__).resolve().parent.parent / "server" / "conftest.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


MAX_MODEL_LEN = 1024
MAX_BODY_BYTES = 1 << 20

SERVER_FLAGS = (
    "--served-model-name",
    "tiny",
    "g4-tiny",
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--limit-mm-per-prompt",
    '{"image": 2, "video": 1, "audio": 1}',
    "--max-request-body-bytes",
    str(MAX_BODY_BYTES),
    "--max-num-seqs",
    "64",
)


# ---- hostile values --------------------------------------------------------------------------------------
HUGE_INTS = [2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 2**64 + 1, -(2**63) - 1, -(2**64), 10**30]
ODD_FLOATS = [float("nan"), float("inf"), float("-inf"), 1e308, -1e308, 5e-324, -0.0, 1e-300]
ODD_STRINGS = [
    "",
    " ",
    "\x00",
    "\ud800",  # a lone surrogate: valid JSON ("\ud800"), not valid UTF-8
    "\udfff",
    "\u202e\u200b",
    "😀" * 3,
    "<start_of_turn>",
    "<bos>",
    "{{ 7*7 }}",
    "{% for x in range(10) %}x{% endfor %}",
    "data:image/png;base64,AAAA",
    "data:image/png;base64,!!!",
    "file:///etc/passwd",
    "http://127.0.0.1/x.png",
    "a" * 5000,
]

ints = st.one_of(st.integers(-1000, 1000), st.sampled_from(HUGE_INTS), st.integers())
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(ODD_FLOATS))
strings = st.one_of(
    st.text(max_size=40),
    st.sampled_from(ODD_STRINGS),
    st.text(st.characters(codec="utf-8"), max_size=20),
)
scalars = st.one_of(st.none(), st.booleans(), ints, floats, strings)


def deep(depth: int, kind: str = "list") -> Any:
    """A value nested ``depth`` levels deep: [[[...]]] or {"a": {"a": ...}} (built iteratively)."""
    value: Any = 0
    for _ in range(depth):
        value = [value] if kind == "list" else {"a": value}
    return value


deep_values = st.builds(deep, st.integers(150, 1500), st.sampled_from(["list", "dict"]))

json_values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(strings, children, max_size=4),
    ),
    max_leaves=12,
)
any_values = st.one_of(json_values, deep_values)

# ---- request bodies -------------------------------------------------------------------------------------
ROLES = ["system", "developer", "user", "assistant", "model", "tool"]
PART_TYPES = ["text", "image", "image_url", "video", "video_url", "audio", "input_audio", "audio_url", "file"]
SAMPLING_FIELDS = [
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "stream",
    "stream_options",
    "response_format",
    "priority",
]
CHAT_FIELDS = SAMPLING_FIELDS + [
    "messages",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "chat_template_kwargs",
    "add_generation_prompt",
    "tools",
]
COMPLETION_FIELDS = SAMPLING_FIELDS + ["prompt", "logprobs", "echo", "suffix"]

content_parts = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.one_of(strings, any_values)}),
    st.builds(
        lambda kind, value: {"type": kind, kind: value},
        st.sampled_from(PART_TYPES),
        st.one_of(strings, json_values, st.fixed_dictionaries({"url": st.one_of(strings, json_values)})),
    ),
    st.fixed_dictionaries({"type": any_values}),
    any_values,
)
_message_lists = st.lists(
    st.fixed_dictionaries(
        {"role": st.one_of(st.sampled_from(ROLES), st.sampled_from(ROLES), any_values)},
        optional={
            "content": st.one_of(strings, st.lists(content_parts, max_size=3), any_values),
            "name": any_values,
            "tool_calls": any_values,
        },
    ),
    min_size=1,
    max_size=3,
)
messages = st.one_of(_message_lists, _message_lists, _message_lists, any_values)
_INT_FIELDS = ["max_tokens", "top_k", "seed", "n", "min_tokens", "priority", "max_completion_tokens"]
_INT_FIELDS += ["top_logprobs"]
_FLOAT_FIELDS = [
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
]
_BOOL_FIELDS = ["ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "stream", "echo"]
_BOOL_FIELDS += ["add_generation_prompt"]
field_values: dict[str, st.SearchStrategy] = {
    "messages": messages,
    "prompt": st.one_of(
        strings,
        st.lists(strings, max_size=3),
        st.lists(ints, max_size=4),
        st.lists(st.lists(ints)),
        any_values,
    ),
    "response_format": st.one_of(
        st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "json_object", "json_schema", "regex", "choice", "grammar"])},
            optional={"json_schema": any_values, "schema": any_values, "regex": any_values},
        ),
        any_values,
    ),
    "stream_options": st.one_of(
        st.fixed_dictionaries({}, optional={"include_usage": any_values}), any_values
    ),
    "stop": st.one_of(strings, st.lists(strings, max_size=3), any_values),
    "stop_token_ids": st.one_of(st.lists(ints, max_size=3), any_values),
    "model": st.one_of(st.sampled_from(["tiny", "g4-tiny", "nope", ""]), any_values),
    "logprobs": st.one_of(st.booleans(), ints, any_values),
    "chat_template_kwargs": st.one_of(st.dictionaries(strings, json_values, max_size=3), any_values),
    **{name: st.one_of(ints, any_values) for name in _INT_FIELDS},
    **{name: st.one_of(floats, st.floats(-3, 3), ints, any_values) for name in _FLOAT_FIELDS},
    **{name: st.one_of(st.booleans(), any_values) for name in _BOOL_FIELDS},
}


@st.composite
def mutated_body(draw, endpoint: str) -> dict[str, Any]:
    """A valid small request with one to three of its fields replaced or added: plausibly typed values
    (huge, negative, NaN, infinite, odd unicode) more often than values of any type."""
    if endpoint == "chat":
        body: dict[str, Any] = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
        fields = CHAT_FIELDS
    else:
        body = {"prompt": "Hello", "max_tokens": 2}
        fields = COMPLETION_FIELDS
    names = draw(st.lists(st.sampled_from(fields), min_size=1, max_size=3, unique=True))
    if endpoint == "chat" and draw(st.booleans()):
        names = ["messages"]  # half the chat bodies: only the messages (their parts, roles, media) change
    for name in names:
        body[name] = draw(field_values.get(name, any_values))
    for _ in range(draw(st.integers(0, 1))):  # an unknown field (ignored by the models)
        body[draw(strings)] = draw(any_values)
    return body


def bounded(body: Any, limit: int = 4) -> Any:
    """The body with an in-range ``max_tokens``/``max_completion_tokens``/``n`` capped (so that a well-formed
    body costs a few decode steps, not a 1024-token generation) and ``stream`` off; a missing
    ``max_tokens`` (up to the context) gets ``limit``. Out-of-range values are left as generated."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if type(value) is int and limit < value <= 4096:
            body[key] = limit
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = limit
    if type(body.get("n")) is int and 2 < body["n"] <= 16:
        body["n"] = 2
    return body


class _Raw(str):
    pass


def dumps(value: Any) -> bytes:
    """JSON as Python's ``json`` writes it (NaN/Infinity tokens, \\ud800 escapes), iteratively: a value
    nested deeper than the recursion limit is written too (``json.dumps`` would raise RecursionError)."""
    out: list[str] = []
    stack: list[Any] = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, _Raw):
            out.append(item)
        elif isinstance(item, dict):
            parts: list[Any] = [_Raw("{")]
            for i, (key, child) in enumerate(item.items()):
                parts += [_Raw(("," if i else "") + json.dumps(str(key)) + ":"), child]
            stack.extend(reversed([*parts, _Raw("}")]))
        elif isinstance(item, (list, tuple)):
            parts = [_Raw("[")]
            for i, child in enumerate(item):
                parts += [_Raw(",")] * bool(i) + [child]
            stack.extend(reversed([*parts, _Raw("]")]))
        else:
            out.append(json.dumps(item, allow_nan=True))
    return "".join(out).encode()


# ---- checks of an HTTP answer -------------------------------------------------------------------------
OBJECT_REPR = re.compile(r"<[^<>]* object at 0x[0-9a-fA-F]+>")


def check_error_body(status: int, text: str, where: str = "") -> dict:
    """A 4xx body is ``{"error": {"message", "type", "param", "code"}}`` with no Python object repr."""
    try:
        body = json.loads(text)
    except ValueError:
        raise AssertionError(f"{where}: {status} body is not JSON: {text[:300]!r}") from None
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), f"{where}: {status} {text[:300]}"
    error = body["error"]
    assert set(error) >= {"message", "type", "param", "code"}, f"{where}: error fields {sorted(error)}"
    assert isinstance(error["message"], str) and error["message"], f"{where}: {error!r}"
    assert isinstance(error["type"], str), f"{where}: {error!r}"
    assert error["param"] is None or isinstance(error["param"], str), f"{where}: {error!r}"
    assert error["code"] == status, f"{where}: code {error['code']!r} != status {status}"
    assert not OBJECT_REPR.search(error["message"]), f"{where}: object repr in message: {error['message']!r}"
    return error


def sse_payloads(text: str) -> list[Any]:
    """The ``data:`` payloads of a server-sent-event body (``[DONE]`` as the string)."""
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def check_answer(status: int, content_type: str, text: str, where: str = "") -> None:
    """No 5xx; a 4xx has the OpenAI error shape; a 200 parses (an SSE stream has no error event, ends with
    ``[DONE]``)."""
    assert status < 500, f"{where}: server error {status}: {text[:500]}"
    if status >= 400:
        check_error_body(status, text, where)
        return
    if content_type.startswith("text/event-stream"):
        payloads = sse_payloads(text)
        assert payloads and payloads[-1] == "[DONE]", (
            f"{where}: stream did not end with [DONE]: {text[-300:]}"
        )
        errors = [p for p in payloads if isinstance(p, dict) and "error" in p]
        assert not errors, f"{where}: error event in a 200 stream: {errors[0]}"
    elif content_type.startswith("application/json"):
        json.loads(text)
