"""Hypothesis-generated bodies POSTed to a live server on the tiny model: every answer is < 500, a 4xx has
the OpenAI error shape without a Python object repr, a 200 parses, and ``/health`` answers afterwards.

``REGRESSIONS`` are the raw requests the fuzzer (and its hand-written hostile shapes) found answered with a
5xx or a malformed error; each is its own test.
"""

from __future__ import annotations

import httpx
import pytest
from fuzzlib import (
    MAX_BODY_BYTES,
    any_values,
    bounded,
    check_answer,
    deep,
    dumps,
    fuzz_settings,
    mutated_body,
)
from hypothesis import given
from hypothesis import strategies as st

ENDPOINTS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
TIMEOUT = httpx.Timeout(60.0)
USER = '"messages":[{"role":"user","content":"hi"}],"max_tokens":2'


def post(server, path: str, raw: bytes, headers: dict | None = None) -> httpx.Response:
    """One request on a fresh connection (after a 500 uvicorn closes the connection it answered on)."""
    headers = {"content-type": "application/json", **(headers or {})}
    return httpx.post(server.base_url + path, content=raw, headers=headers, timeout=TIMEOUT)


def check_alive(server) -> None:
    health = httpx.get(server.base_url + "/health", timeout=TIMEOUT)
    assert health.status_code == 200, f"/health after the request: {health.status_code} {health.text}"


def exchange(server, path: str, raw: bytes) -> None:
    resp = post(server, path, raw)
    where = f"POST {path} {raw[:300]!r}"
    check_answer(resp.status_code, resp.headers.get("content-type", ""), resp.text, where)
    check_alive(server)


@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
@fuzz_settings("http_examples")
@given(data=st.data())
def test_mutated_bodies(fuzz_server, endpoint, data):
    body = bounded(data.draw(mutated_body(endpoint), label="body"))
    exchange(fuzz_server, ENDPOINTS[endpoint], dumps(body))


@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
@fuzz_settings("http_examples")
@given(body=st.one_of(any_values, st.binary(max_size=64)))
def test_arbitrary_bodies(fuzz_server, endpoint, body):
    raw = body if isinstance(body, bytes) else dumps(body)
    exchange(fuzz_server, ENDPOINTS[endpoint], raw)


# ---- found cases ------------------------------------------------------------------------------------------
def _raw(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


REGRESSIONS = {
    # A seed past int64: the engine's generator overflows in the step ("Overflow when unpacking long long").
    "seed-2**64": ("chat", _raw("{" + USER + ',"seed":18446744073709551616}')),
    # The largest seed the engine takes, fanned out over n choices (seed, seed + 1): the second overflows.
    "seed-max-n-2": ("chat", _raw("{" + USER + ',"seed":18446744073709551615,"n":2}')),
    "seed--2**63-1": ("completion", _raw('{"prompt":"hi","max_tokens":2,"seed":-9223372036854775809}')),
    # A content part whose "type" is unhashable: `kind in _PART_MODALITY` raises TypeError.
    "part-type-list": (
        "chat",
        _raw('{"messages":[{"role":"user","content":[{"type":["x"]}]}],"max_tokens":2}'),
    ),
    "part-type-object": (
        "chat",
        _raw('{"messages":[{"role":"user","content":[{"type":{}}]}],"max_tokens":2}'),
    ),
    # JSON nested deeper than the recursion limit: json.loads raises RecursionError.
    "nesting-5000-list": ("chat", dumps({"messages": deep(5000)})),
    "nesting-5000-dict": ("completion", dumps({"prompt": "hi", "max_tokens": 2, "x": deep(5000, "dict")})),
    # An integer literal of more than 4300 digits: int() refuses it with ValueError.
    "int-5000-digits": ("chat", _raw("{" + USER + ',"top_k":' + "9" * 5000 + "}")),
    # A lone surrogate in a message: the tokenizer raises TypeError ("TextInputSequence must be str").
    "lone-surrogate-chat": (
        "chat",
        _raw('{"messages":[{"role":"user","content":"\\ud800"}],"max_tokens":2}'),
    ),
    "lone-surrogate-prompt": ("completion", _raw('{"prompt":"a\\udfffb","max_tokens":2}')),
}


@pytest.mark.parametrize("case", sorted(REGRESSIONS))
def test_found_case_is_not_a_server_error(fuzz_server, case):
    endpoint, raw = REGRESSIONS[case]
    exchange(fuzz_server, ENDPOINTS[endpoint], raw)


NON_FINITE = {
    "temperature-Infinity": '"temperature":Infinity',
    "temperature-1e400": '"temperature":1e400',
    "top_p-Infinity": '"top_p":Infinity',
    "repetition_penalty-Infinity": '"repetition_penalty":Infinity',
    "min_p-NaN": '"min_p":NaN',
    "presence_penalty-NaN": '"presence_penalty":NaN',
}


@pytest.mark.parametrize("case", sorted(NON_FINITE))
def test_non_finite_sampling_numbers_are_400(fuzz_server, case):
    """NaN and +-Infinity (Python's json reads the tokens and 1e400 as inf) are not sampling parameters."""
    resp = post(fuzz_server, ENDPOINTS["chat"], _raw("{" + USER + "," + NON_FINITE[case] + "}"))
    assert resp.status_code == 400, f"{resp.status_code} {resp.text[:300]}"
    check_answer(resp.status_code, resp.headers.get("content-type", ""), resp.text, case)


def test_oversized_body_is_413(fuzz_server):
    raw = _raw("{" + USER + ',"pad":"' + "a" * MAX_BODY_BYTES + '"}')
    resp = post(fuzz_server, ENDPOINTS["chat"], raw)
    assert resp.status_code == 413
    check_answer(resp.status_code, resp.headers.get("content-type", ""), resp.text, "oversized")

    def chunks():  # no content-length: the limit applies while the body is read
        yield raw[: len(raw) // 2]
        yield raw[len(raw) // 2 :]

    resp = httpx.post(
        fuzz_server.base_url + ENDPOINTS["chat"],
        content=chunks(),
        headers={"content-type": "application/json"},
        timeout=TIMEOUT,
    )
    assert resp.status_code == 413
    check_answer(resp.status_code, resp.headers.get("content-type", ""), resp.text, "oversized chunked")
    check_alive(fuzz_server)
