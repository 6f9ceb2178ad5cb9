"""The assistant's request bodies under the limits the API server and the routers keep (``server.guard``),
against a live assistant on a real socket: a deadline for a whole body (408, connection closed), a budget
over the bodies held at once (503 + Retry-After), and the cap (413, audited). The budget counts a body as it
is read, never from a declared length, and no route reads a body before it checked the token: a client
without one holds none of the budget."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
import raw_http
from raw_http import read_answer
from served import UvicornThread
from test_app import ADMIN, DEMO_CUSTOMER_ID, access

from g4serve.server.body_budget import BodyLimits
from g4serve_assistant.access_cli import access_from_args
from g4serve_assistant.app import AccessSettings, build_app
from g4serve_assistant.cli import build_parser
from g4serve_assistant.db import demo_bank
from g4serve_assistant.pipeline import Assistant

CAP = 64 << 10
LIMITS = BodyLimits(max_request_body_bytes=CAP, max_buffered_body_bytes=96 << 10, request_body_timeout_s=2.0)
TURN = "/v1/assistant/turn"


@pytest.fixture(scope="module")
def served():
    assistant = Assistant(demo_bank(), None)
    app = build_app(assistant, access(test_login=True, body_limits=LIMITS), warmup=False)
    with UvicornThread(app) as server:
        server.assistant, server.app = assistant, app
        yield server


@pytest.fixture(scope="module")
def token(served) -> str:
    url = f"{served.url}/v1/assistant/admin/tokens"
    r = httpx.post(url, json={"customer_id": DEMO_CUSTOMER_ID}, headers=ADMIN)
    assert r.status_code == 200, r.text
    return r.json()["token"]


def held(server) -> int:
    return server.app.state.body_budget.held_bytes


def open_body(server, path: str, length: int, sent: bytes, token: str | None = None) -> socket.socket:
    """A connection whose request declared ``length`` bytes of body and sent only ``sent`` of them."""
    return raw_http.open_body(
        server.url, path, length, sent, {"Authorization": f"Bearer {token}"} if token else None
    )


def wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("path", ["/test-login", TURN], ids=["no-token", "customer"])
def test_a_body_that_never_arrives_whole_gets_a_408_and_the_connection_closes(served, token, path):
    """A client that sent its headers and then its body a byte at a time held the request and its connection
    for as long as it liked (uvicorn has no body timeout), on /test-login without any token."""
    started = time.monotonic()  # before the headers go: the server's deadline starts once they arrive
    with open_body(served, path, 1000, b'{"customer_id": ', token) as s:
        while time.monotonic() - started < LIMITS.request_body_timeout_s - 0.3:  # a byte every 0.1 s
            time.sleep(0.1)
            s.sendall(b" ")
        status, headers, body = read_answer(s)
        elapsed = time.monotonic() - started
    assert status == 408 and b"connection: close" in headers, body
    assert "whole request body did not arrive" in json.loads(body)["error"]["message"]
    assert LIMITS.request_body_timeout_s <= elapsed < LIMITS.request_body_timeout_s + 1.0, elapsed
    assert held(served) == 0


def test_bodies_held_at_once_are_bounded_and_a_declared_length_holds_nothing(served, token):
    """Each body under the cap, many at once made the assistant hold their sum. Bodies count as they arrive
    (not from their declared length: the token is checked before a route reads a body), and one past what is
    left of the budget is a 503 with Retry-After."""
    body = json.dumps({"text": "what is my balance", "pad": " " * 59_000}).encode()
    with open_body(served, "/test-login", len(body), b"", None) as unread:  # declared, never sent, no token
        time.sleep(0.2)
        assert held(served) == 0
        with open_body(served, TURN, len(body), body[:-1], token) as first:  # all but a byte: held
            wait_until(lambda: held(served) == len(body) - 1)
            with httpx.Client(base_url=served.url, timeout=20) as client:
                auth = {"authorization": f"Bearer {token}", "content-type": "application/json"}
                refused = client.post(TURN, content=body, headers=auth)
                assert refused.status_code == 503, refused.text
                assert refused.headers["retry-after"] == "1"
                assert "buffered request bodies" in refused.json()["error"]["message"]
                first.sendall(body[-1:])
                status, _, answer = read_answer(first)  # read whole: "pad" is no field of a turn
                assert status == 400 and json.loads(answer)["error"]["param"] == "pad", answer
                wait_until(lambda: held(served) == 0)
                no_token = client.post(TURN, content=body, headers={"content-type": "application/json"})
                assert no_token.status_code == 401, no_token.text
        read_answer(unread)
    assert held(served) == 0


def test_a_body_past_the_cap_is_a_413_before_it_is_read_and_audited(served, token):
    too_big = b" " * (CAP + 1)
    auth = {"authorization": f"Bearer {token}", "content-type": "application/json"}
    r = httpx.post(f"{served.url}{TURN}", content=too_big, headers=auth, timeout=20)
    assert r.status_code == 413 and f"limit of {CAP} bytes" in r.json()["error"]["message"], r.text

    def chunked():  # no Content-Length: refused once what arrived is past the cap
        yield from (too_big[i : i + 8192] for i in range(0, len(too_big), 8192))

    r = httpx.post(f"{served.url}{TURN}", content=chunked(), headers=auth, timeout=20)
    assert r.status_code == 413, r.text
    rejected = [e for e in served.assistant.audit.entries(limit=10) if e["detail"].get("status") == 413]
    assert len(rejected) >= 2
    assert held(served) == 0


def test_the_assistant_takes_the_servers_body_flags():
    flags = "--max-request-body-bytes 1000 --max-buffered-body-bytes 4000 --request-body-timeout 5".split()
    settings, _ = access_from_args(build_parser().parse_args(flags))
    assert settings.body_limits == BodyLimits(1000, 4000, 5.0)
    settings, _ = access_from_args(build_parser().parse_args([]))
    assert (
        settings.body_limits == BodyLimits(8 << 20, 256 << 20, 60.0) == AccessSettings.ephemeral().body_limits
    )
    with pytest.raises(ValueError, match="--max-buffered-body-bytes"):
        access_from_args(build_parser().parse_args("--max-buffered-body-bytes 10".split()))
