"""The request bodies the API server holds at once, and how long a client may take to send one, against one
live server on the tiny model started with small limits: a budget over all bodies being read and prepared
(--max-buffered-body-bytes: 503 + Retry-After when full, given back on every path) and a deadline for a
whole body (--request-body-timeout: 408, connection closed); a decode running beside them is unharmed."""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time
from typing import Any

import httpx
import pytest
import raw_http
from raw_http import read_answer

from g4serve.cli import build_parser
from g4serve.server.body_budget import BodyLimits, body_limits_from_args
from g4serve.server.config import ServerConfig
from g4serve.server.launch import add_serve_arguments, build_from_args

CHAT = "/v1/chat/completions"
CAP = 64 << 10  # --max-request-body-bytes
BUDGET = 96 << 10  # --max-buffered-body-bytes: one body near the cap fits, two do not
DEADLINE_S = 3.0  # --request-body-timeout
NEAR_CAP = 60_000


@pytest.fixture(scope="module")
def limited(tiny_model_dir, server_factory):
    return server_factory(
        tiny_model_dir,
        "--text-only",
        "--served-model-name",
        "tiny",
        "--max-request-body-bytes",
        str(CAP),
        "--max-buffered-body-bytes",
        str(BUDGET),
        "--request-body-timeout",
        str(DEADLINE_S),
    )


def held(server: Any) -> int:
    return server.app.state.body_budget.held_bytes


def wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def chat_body(size: int = 0, **fields) -> bytes:
    """A valid chat request, padded with JSON whitespace to ``size`` bytes."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}
    text = json.dumps(body).encode()
    return text + b" " * max(size - len(text), 0)


def open_body(server: Any, length: int, sent: bytes) -> socket.socket:
    return raw_http.open_body(server.base_url, CHAT, length, sent)


DECODE_TOKENS = 1000
# Each engine step waits this long while the decode beside runs: its 1,000 steps then take at least 5 s,
# past every deadline here whatever the machine (unpaced, a fast CI machine finished them in ~3 s, before a
# trickled body's 408).
STEP_PAUSE_S = 0.005


def decode_beside(server: Any, answers: list) -> threading.Thread:
    """A long decode, in the engine (its body given back) when this returns, run while the hostile bodies
    arrive; ``assert_decoded`` ends its pacing."""
    body = chat_body(max_tokens=DECODE_TOKENS, ignore_eos=True, temperature=0)
    engine, step = server.engine, server.engine.step

    def paced():
        time.sleep(STEP_PAUSE_S)
        return step()

    engine.step = paced  # the engine thread looks it up at every step

    def run() -> None:
        answers.append(httpx.post(f"{server.base_url}{CHAT}", content=body, timeout=120))

    thread = threading.Thread(target=run)
    thread.start()
    wait_until(lambda: server.engine.requests)
    wait_until(lambda: held(server) == 0)
    return thread


def assert_decoded(server: Any, thread: threading.Thread, answers: list) -> None:
    thread.join(120)
    del server.engine.step  # the class's again
    assert answers and answers[0].status_code == 200, answers
    assert answers[0].json()["usage"]["completion_tokens"] == DECODE_TOKENS


def test_serve_takes_the_body_limit_flags():
    """``g4serve serve`` holds bodies under the router's flags, defaults and checks (one definition)."""
    parse = build_parser().parse_args
    args = parse(["serve"])
    assert body_limits_from_args(args) == BodyLimits() == BodyLimits(64 << 20, 256 << 20, 60.0)
    assert ServerConfig(served_model_names=["x"]).body_limits == BodyLimits()
    # four bodies at the cap, and never less than at the default cap: a raised cap still starts
    raised = parse(["serve", "--max-request-body-bytes", str(512 << 20)])
    assert body_limits_from_args(raised).max_buffered_body_bytes == 2 << 30
    assert body_limits_from_args(parse(["serve", "--max-request-body-bytes", "1000"])) == BodyLimits(1000)
    limits = "--max-request-body-bytes 500 --max-buffered-body-bytes 1000 --request-body-timeout 2".split()
    assert body_limits_from_args(parse(["serve", *limits])) == BodyLimits(500, 1000, 2.0)
    assert body_limits_from_args(parse(["serve", "--ray", *limits])) == BodyLimits(500, 1000, 2.0)
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    for bad, message in (
        (["--max-buffered-body-bytes", "1000"], "a body at the cap"),
        (["--request-body-timeout", "0"], "--request-body-timeout"),
    ):
        with pytest.raises(ValueError, match=message):  # before the model is loaded
            build_from_args(parser.parse_args(["no-such-model", *bad]))


def test_bodies_past_the_budget_get_a_503_at_once_and_the_budget_comes_back(limited):
    """Each body was held whole under the per-request cap alone: N clients each sending a body near the cap
    made the server hold N times the cap. One budget bounds the bytes of bodies held at once."""
    answers: list = []
    decode = decode_beside(limited, answers)
    body = chat_body(NEAR_CAP)
    with open_body(limited, len(body), body[:1000]) as first:
        wait_until(lambda: held(limited) == len(body))  # its declared length, held from its headers on
        with httpx.Client(base_url=limited.base_url, timeout=20) as client:
            refused = client.post(CHAT, content=body)  # its Content-Length is past what is left
            assert refused.status_code == 503, refused.text
            assert refused.headers["retry-after"] == "1"
            assert "buffered request bodies" in refused.json()["error"]["message"]

            def chunked():  # no Content-Length: refused once what arrived is past what is left
                yield from (body[i : i + 8192] for i in range(0, len(body), 8192))

            assert client.post(CHAT, content=chunked()).status_code == 503
            assert held(limited) == len(body) and decode.is_alive()
            first.sendall(body[1000:])  # the held body arrives whole: served
            status, _, answer = read_answer(first)
            assert status == 200, answer
            wait_until(lambda: held(limited) == 0)
            assert client.post(CHAT, content=body).status_code == 200
            assert client.post(CHAT, content=chunked()).status_code == 200
    assert held(limited) == 0
    assert_decoded(limited, decode, answers)


@pytest.mark.parametrize("trickle", [False, True], ids=["never", "trickled"])
def test_a_body_that_never_arrives_whole_gets_a_408_and_the_connection_closes(limited, trickle):
    """A client that sent its headers, then its body a byte at a time (or never), held a request, its
    connection and what it had sent for as long as it liked (slowloris: uvicorn has no body timeout)."""
    answers: list = []
    decode = decode_beside(limited, answers)
    started = time.monotonic()  # before the headers go: the server's deadline starts once they arrive
    with open_body(limited, 1000, b'{"messages": ') as s:
        # a byte every 0.1 s, stopped short of the deadline (a byte arriving as the server closes would reset
        # the connection): a timeout reset by every read would answer a deadline after the last one
        while trickle and time.monotonic() - started < DEADLINE_S - 0.3:
            time.sleep(0.1)
            s.sendall(b" ")
        status, headers, body = read_answer(s)  # until the server closes the connection
        elapsed = time.monotonic() - started
        assert decode.is_alive()
    assert status == 408 and b"connection: close" in headers
    assert "whole request body" in json.loads(body)["error"]["message"]
    assert DEADLINE_S <= elapsed < DEADLINE_S + 1.0, elapsed
    assert held(limited) == 0
    assert_decoded(limited, decode, answers)
    assert httpx.post(f"{limited.base_url}{CHAT}", content=chat_body(), timeout=20).status_code == 200


def test_the_claim_ends_when_the_request_is_handed_to_the_engine(limited):
    """A body counts while it is read, parsed and prepared; once its request is in the engine the raw bytes
    are not needed, so a long decode does not keep its body's share of the budget."""
    answers: list = []
    body = chat_body(NEAR_CAP, max_tokens=300, ignore_eos=True)
    thread = threading.Thread(
        target=lambda: answers.append(httpx.post(f"{limited.base_url}{CHAT}", content=body, timeout=120))
    )
    thread.start()
    wait_until(lambda: limited.engine.requests)
    assert held(limited) == 0  # decoding, its body given back
    with open_body(limited, len(body), b"") as s:  # another near-cap body fits beside it
        wait_until(lambda: held(limited) == len(body))
        s.sendall(body)
        assert read_answer(s)[0] == 200
    thread.join(120)
    assert answers[0].status_code == 200 and answers[0].json()["usage"]["completion_tokens"] == 300
    wait_until(lambda: held(limited) == 0)


def test_the_body_budget_comes_back_on_every_path(limited, monkeypatch):
    """A request's body is given back once it is in the engine, or as its answer starts, or (a client gone
    before its body arrived) as the request ends."""

    def back() -> None:
        assert held(limited) == 0

    with httpx.Client(base_url=limited.base_url, timeout=20) as client:
        assert client.post(CHAT, content=chat_body(NEAR_CAP)).status_code == 200
        assert held(limited) == 0
        with client.stream("POST", CHAT, content=chat_body(NEAR_CAP, stream=True)) as stream:
            assert held(limited) == 0  # given back before the first event
            lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        assert held(limited) == 0
        bad_json = b'{"model": "tiny", "messages": [' + b" " * NEAR_CAP
        refused = client.post(CHAT, content=bad_json)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "body"
        back()
        assert client.post(CHAT, content=chat_body(NEAR_CAP, model="nope")).status_code == 404
        back()
        assert client.post(CHAT, content=b" " * (CAP + 1)).status_code == 413  # declared past the cap
        too_long = chat_body(CAP + 1)

        def chunked():
            yield from (too_long[i : i + 8192] for i in range(0, len(too_long), 8192))

        assert client.post(CHAT, content=chunked()).status_code == 413  # found past the cap as it arrives
        back()
        with pytest.raises(httpx.ReadTimeout):  # the client leaves while its request decodes
            client.post(CHAT, content=chat_body(max_tokens=2000, ignore_eos=True), timeout=0.3)
        back()
        limited.wait_idle()
        with monkeypatch.context() as patched:  # the server's own failure: a 500, the budget still back
            chat = limited.app.state.serving_chat

            async def broken(request):
                await request.body()
                raise RuntimeError("server bug (test)")

            patched.setattr(chat, "create", broken)
            assert client.post(CHAT, content=chat_body(NEAR_CAP)).status_code == 500
        back()
    errors = limited.app.state.metrics.errors
    gone_before = errors.labels("tiny", "499")._value.get()
    with open_body(limited, NEAR_CAP, b"{" * 5000):  # the client leaves half-way through its body
        wait_until(lambda: held(limited) == NEAR_CAP)
    wait_until(lambda: held(limited) == 0)  # once the server sees it gone
    # a 499 in the error metric, not a logged 500 with a traceback
    wait_until(lambda: errors.labels("tiny", "499")._value.get() == gone_before + 1)
    assert errors.labels("tiny", "500")._value.get() == 1  # the server bug's above
    assert httpx.post(f"{limited.base_url}{CHAT}", content=chat_body(), timeout=20).status_code == 200
