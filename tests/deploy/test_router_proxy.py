"""The standalone router (``g4serve router``, ``g4serve.deploy.proxy``) in front of two fake replicas on
real sockets: affinity, streaming passthrough, a replica dying mid-stream or before answering, health,
retries after refused connections, hostile bodies, pins and metrics."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import tracemalloc

import httpx
import pytest
from fake_replicas import Served, fake_replica
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from g4serve.cli import build_parser
from g4serve.deploy.membership import DnsTarget, dns_target, resolve
from g4serve.deploy.proxy import RouterConfig, build_router_app
from g4serve.deploy.relay import whole_events
from g4serve.deploy.replica_pool import replica_url
from g4serve.deploy.router_cli import router_config_from_args
from g4serve.server.body_budget import BodyLimits, body_limits_from_args

CHAT = "/v1/chat/completions"


def router_for(*urls: str, http: str = "auto", **config) -> Served:
    settings = {"health_interval_s": 0.1, "health_timeout_s": 1.0, **config}
    return Served(build_router_app(RouterConfig(replicas=list(urls), **settings)), http=http)


def chat(text: str, **fields) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": text}], **fields}


def sse_data(lines) -> list:
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def raw_request(port: int, request_line: str, *headers: str, body: bytes = b"") -> tuple[int, bytes]:
    """(status, body) of one request sent as written: a client's own request target, which httpx would
    normalize."""
    head = [request_line, "Host: router", "Connection: close", f"Content-Length: {len(body)}", *headers]
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        answer = b""
        while data := s.recv(1 << 16):
            answer += data
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


def wait_until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_sessions_stick_to_one_replica_and_spread_over_both(fake_replicas):
    (app_a, a), (app_b, b) = fake_replicas
    with router_for(a.url, b.url) as router, httpx.Client(base_url=router.url, timeout=10) as client:
        served_by = {}
        for session in range(12):
            names = {
                client.post(CHAT, json=chat(f"turn {turn}"), headers={"X-Session-Id": f"s{session}"}).headers[
                    "x-g4serve-replica"
                ]
                for turn in range(3)
            }
            assert len(names) == 1, f"session {session} moved: {names}"
            served_by[session] = names.pop()
        assert set(served_by.values()) == {f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"}
        # the same system prompt and first turn: the same replica, without a session id
        first = client.post(CHAT, json=chat("shared prefix")).headers["x-g4serve-replica"]
        assert all(
            client.post(CHAT, json=chat("shared prefix")).headers["x-g4serve-replica"] == first
            for _ in range(5)
        )
        metrics = client.get("/metrics").text
        assert 'g4serve_router_requests_total{key="session",placement="home"' in metrics
        assert 'g4serve_router_replica_healthy{replica="127.0.0.1:' in metrics
    assert len(app_a.state.seen) + len(app_b.state.seen) == 12 * 3 + 6


def test_events_pass_through_unbuffered(fake_replicas):
    (app_a, a), _ = fake_replicas
    with router_for(a.url) as router, httpx.Client(base_url=router.url, timeout=10) as client:
        with client.stream("POST", CHAT, json=chat("hi", stream=True, wait=True)) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            lines = response.iter_lines()
            first = next(line for line in lines if line)
            # the replica holds its second event until the gate opens: the first one arrived on its own
            assert json.loads(first[len("data: ") :])["i"] == 0
            app_a.state.gate.set()
            rest = sse_data(lines)
        assert [e["i"] for e in rest[:-1]] == [1, 2] and rest[-1] == "[DONE]"


@pytest.mark.parametrize("split", [False, True])
def test_a_replica_dying_mid_stream_fails_only_its_own_stream(fake_replicas, split):
    (app_a, a), (app_b, b) = fake_replicas
    with router_for(a.url, b.url) as router, httpx.Client(base_url=router.url, timeout=10) as client:
        pin_a = {"X-G4Serve-Replica": f"127.0.0.1:{a.port}"}
        pin_b = {"X-G4Serve-Replica": f"127.0.0.1:{b.port}"}
        with (
            client.stream(
                "POST", CHAT, json=chat("x", stream=True, wait=True, events=4), headers=pin_b
            ) as other,
            client.stream(
                "POST", CHAT, json=chat("y", stream=True, die_after=1, split=split), headers=pin_a
            ) as dying,
        ):
            other_lines = other.iter_lines()
            assert json.loads(next(line for line in other_lines if line)[6:])["i"] == 0
            events = sse_data(dying.iter_lines())
            app_b.state.gate.set()  # the healthy replica's stream goes on after the other one died
            survived = sse_data(other_lines)
        assert [e["i"] for e in events[:-2]] == [0] if split else [0, 1]
        error = events[-2]["error"]
        assert (
            error["code"] == 502 and "failed while streaming" in error["message"] and events[-1] == "[DONE]"
        )
        assert [e["i"] for e in survived[:-1]] == [1, 2, 3] and survived[-1] == "[DONE]"
        metrics = client.get("/metrics").text
        assert (
            f'g4serve_router_replica_failures_total{{replica="127.0.0.1:{a.port}",stage="stream"}} 1.0'
            in metrics
        )


def test_a_replica_dying_before_its_answer_is_whole_is_a_502(fake_replicas):
    (_, a), _ = fake_replicas
    with router_for(a.url) as router, httpx.Client(base_url=router.url, timeout=10) as client:
        response = client.post(CHAT, json=chat("x", die_after=0))
        assert response.status_code == 502
        assert "failed before finishing" in response.json()["error"]["message"]
        assert client.post(CHAT, json=chat("y")).status_code == 200  # and the router serves on


def test_a_client_that_leaves_a_non_streaming_request_aborts_it_on_the_replica(fake_replicas):
    (app_a, a), _ = fake_replicas
    with router_for(a.url) as router:
        with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=router.url, timeout=0.3) as client:
            client.post(CHAT, json=chat("x", slow=True))
        wait_until(lambda: app_a.state.abandoned == 1, timeout_s=5)
        pool = router.server.config.app.state.pool
        wait_until(lambda: pool.get(f"127.0.0.1:{a.port}").in_flight == 0)


def test_unhealthy_replicas_leave_and_come_back(fake_replicas):
    (app_a, a), (app_b, b) = fake_replicas
    with router_for(a.url, b.url) as router, httpx.Client(base_url=router.url, timeout=10) as client:
        assert client.get("/health").json() == {"status": "ok", "replicas": 2, "healthy": 2}
        app_a.state.healthy = False
        wait_until(lambda: client.get("/health").json()["healthy"] == 1)
        names = {client.post(CHAT, json=chat(f"q{i}")).headers["x-g4serve-replica"] for i in range(10)}
        assert names == {f"127.0.0.1:{b.port}"}
        app_b.state.healthy = False
        wait_until(lambda: client.get("/health").status_code == 503)
        refused = client.post(CHAT, json=chat("q"))
        assert refused.status_code == 503 and "no healthy replica" in refused.json()["error"]["message"]
        assert refused.headers["retry-after"] == "1"
        app_a.state.healthy = app_b.state.healthy = True
        wait_until(lambda: client.get("/health").json()["healthy"] == 2)


def test_a_refused_connection_is_retried_on_the_next_replica(fake_replicas):
    (_, a), _ = fake_replicas
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    dead = f"http://127.0.0.1:{dead_port}"
    with router_for(dead, a.url, health_interval_s=3600) as router:
        pool = router.server.config.app.state.pool
        pool.mark(f"127.0.0.1:{dead_port}", True)  # as if it had passed its last check, then died
        with httpx.Client(base_url=router.url, timeout=10) as client:
            # some keys have the dead replica as their home: with two replicas each key has one chance in two,
            # so 6 keys all missed it in 1.6% of runs (a CI run did); 48 miss it in 2^-48
            for i in range(48):
                response = client.post(CHAT, json=chat(f"q{i}"))
                assert (
                    response.status_code == 200
                    and response.headers["x-g4serve-replica"] == f"127.0.0.1:{a.port}"
                )
        assert not pool.get(f"127.0.0.1:{dead_port}").healthy


def test_hostile_bodies_are_forwarded_or_refused_never_crash(fake_replicas):
    (_, a), _ = fake_replicas
    with (
        router_for(a.url, body_limits=BodyLimits(max_request_body_bytes=1 << 20)) as router,
        httpx.Client(base_url=router.url) as client,
    ):
        for raw in (b"not json", b"{" * 200_000, b"[" * 100_000, b"\xff\xfe"):
            response = client.post(CHAT, content=raw, headers={"content-type": "application/json"})
            assert response.status_code == 400, raw[:20]  # the replica's answer
        odd = client.post(CHAT, json={"messages": "x", "tools": {"a": [None]}, "user": 5})
        assert odd.status_code == 200  # the fake replica takes any object; the router keyed it without fuss
        too_big = client.post(CHAT, content=b"x" * ((1 << 20) + 1))
        assert too_big.status_code == 413 and "router's limit" in too_big.json()["error"]["message"]
        big_but_fine = chat("y" * 400_000)  # parsed off the event loop
        assert client.post(CHAT, json=big_but_fine).status_code == 200
        assert client.get("/health").status_code == 200


def test_pins_reach_their_replica_or_get_a_503(fake_replicas):
    (_, a), (_, b) = fake_replicas
    with router_for(a.url, b.url) as router, httpx.Client(base_url=router.url) as client:
        for replica in (a, b):
            pin = {"X-G4Serve-Replica": f"127.0.0.1:{replica.port}"}
            assert client.get("/metrics", headers=pin).json()["replica"] in ("a", "b")
            assert (
                client.post(CHAT, json=chat("x"), headers=pin).headers["x-g4serve-replica"]
                == pin["X-G4Serve-Replica"]
            )
        missing = client.post(CHAT, json=chat("x"), headers={"X-G4Serve-Replica": "10.9.9.9:1"})
        assert missing.status_code == 503 and "10.9.9.9:1" in missing.json()["error"]["message"]


def test_a_request_target_that_is_no_path_never_reaches_another_host(fake_replicas):
    """h11 (uvicorn's parser in a plain install, without httptools) takes any request target. One such as
    ``%2F@HOST:PORT/x``, a path once decoded (so the catch-all route takes it), appended to the replica's URL
    named another host: the router fetched it (SSRF: cloud metadata, a service behind the router) and
    passed the answer back; with an Authorization header, a 500 and a request in flight forever."""
    (_, a), _ = fake_replicas
    internal = fake_replica("internal")  # a service on the router's network that is no replica
    with Served(internal) as other, router_for(a.url, http="h11") as router:
        body = json.dumps(chat("x")).encode()
        for target in (f"%2F@127.0.0.1:{other.port}/v1/chat/completions", f"%2f@127.0.0.1:{other.port}"):
            for auth in ((), ("Authorization: Bearer key",)):
                status, answer = raw_request(router.port, f"POST {target} HTTP/1.1", *auth, body=body)
                assert status == 400 and b"request target" in answer, (target, auth, status, answer)
        assert internal.state.seen == []
        assert router.server.config.app.state.pool.get(f"127.0.0.1:{a.port}").in_flight == 0
        # an origin-form target is forwarded as it came, percent-encoding kept
        status, answer = raw_request(router.port, "POST /v1/chat/completions?a=%2F@x HTTP/1.1", body=body)
        assert status == 200 and json.loads(answer)["replica"] == "a"


def holding_replica(received: threading.Event, gate: threading.Event) -> FastAPI:
    """A replica that reads a chat body without keeping it, then answers once ``gate`` opens."""
    app = FastAPI()

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> JSONResponse:
        size = sum([len(chunk) async for chunk in request.stream()])
        received.set()
        await asyncio.to_thread(gate.wait, 20)
        return JSONResponse({"bytes": size})

    return app


def test_the_router_keeps_no_parsed_body_while_the_replica_answers():
    """A body of many short strings parses to ten times its size. The router held that parsed body until
    the replica's answer was whole, minutes for a long non-streaming generation (this 6 MB body: 68 MB held;
    a few dozen such requests, gigabytes). It keeps only the bytes it forwards."""
    raw = json.dumps({**chat("hi"), "x": ["ab"] * 1_000_000})
    received, gate = threading.Event(), threading.Event()
    answers = []
    tracemalloc.start()
    try:
        with Served(holding_replica(received, gate)) as replica, router_for(replica.url) as router:
            before = tracemalloc.get_traced_memory()[0]
            post = threading.Thread(
                target=lambda: answers.append(httpx.post(f"{router.url}{CHAT}", content=raw, timeout=30))
            )
            post.start()
            assert received.wait(20)
            held = tracemalloc.get_traced_memory()[0] - before  # while the replica works on it
            gate.set()
            post.join(30)
    finally:
        gate.set()
        tracemalloc.stop()
    assert answers[0].json() == {"bytes": len(raw)}
    assert held < 4 * len(raw), f"{held >> 20} MiB held for a {len(raw) >> 20} MiB body"


def test_a_long_event_is_cut_in_linear_time():
    """An event can arrive in many reads (a streamed completion with ``echo`` carries its whole prompt in
    its first event: megabytes). Each read was appended to the bytes pending and all of them searched again:
    a 32 MB event in 64 KB reads held the router's event loop for 6.8 s, and every other stream with it."""

    async def cut(stream: bytes, read_bytes: int) -> list[bytes]:
        async def reads():
            for i in range(0, len(stream), read_bytes):
                yield stream[i : i + read_bytes]

        return [event async for event in whole_events(reads(), "r", pytest.fail)]

    long_event = b"data: " + b"x" * (32 << 20) + b"\n\n"
    started = time.perf_counter()
    assert asyncio.run(cut(long_event, 1 << 16)) == [long_event]
    assert time.perf_counter() - started < 1.5
    # an event's end split between two reads is still found
    assert b"".join(asyncio.run(cut(b"data: 1\n\ndata: 2\n\n", 1))) == b"data: 1\n\ndata: 2\n\n"
    assert asyncio.run(cut(b"data: 1\n\ndata: 2\n\n", 8)) == [b"data: 1\n\n", b"data: 2\n\n"]


def test_dns_discovery_finds_replicas(fake_replicas):
    (_, a), _ = fake_replicas
    config = RouterConfig(dns=[DnsTarget("localhost", a.port)], health_interval_s=0.1)
    with Served(build_router_app(config)) as router, httpx.Client(base_url=router.url) as client:
        assert client.get("/health").json()["healthy"] >= 1
        assert client.post(CHAT, json=chat("x")).status_code == 200


def test_resolve_and_flag_parsing():
    assert "http://127.0.0.1:8000" in asyncio.run(resolve(DnsTarget("localhost", 8000)))
    assert dns_target("svc.ns.svc.cluster.local:8000") == DnsTarget("svc.ns.svc.cluster.local", 8000)
    for bad in ("svc", "svc:", ":80", "svc:99999", "svc:http"):
        with pytest.raises(ValueError, match="--discover-dns"):
            dns_target(bad)
    assert replica_url("h1:8000") == "http://h1:8000"
    assert replica_url("http://h1:8000/") == "http://h1:8000"
    for bad in ("ftp://h1:8000", "http://h1:8000/v1", "http://h1:port", "http://"):
        with pytest.raises(ValueError, match="--replica"):
            replica_url(bad)


LIMITS = "--max-buffered-body-bytes 1000 --max-request-body-bytes 500 --request-body-timeout 2".split()


def test_router_flags():
    args = build_parser().parse_args(
        ["router", "--replica", "h1:8000", "--replica", "http://h2:8000", "--load-factor", "2", "--port", "9"]
    )
    config = router_config_from_args(args)
    assert config.replicas == ["http://h1:8000", "http://h2:8000"] and config.load_bound.factor == 2.0
    with pytest.raises(ValueError, match="--replica URL or --discover-dns"):
        router_config_from_args(build_parser().parse_args(["router"]))
    with pytest.raises(ValueError, match="load factor"):
        router_config_from_args(
            build_parser().parse_args(["router", "--replica", "h:1", "--load-factor", "0.5"])
        )
    assert config.body_limits == BodyLimits(64 << 20, 256 << 20, 60.0)
    config = router_config_from_args(build_parser().parse_args(["router", "--replica", "h:1", *LIMITS]))
    assert config.body_limits == BodyLimits(500, 1000, 2.0)
    for bad, message in (
        (["--max-buffered-body-bytes", "1000"], "a body at the cap"),
        (["--request-body-timeout", "0"], "--request-body-timeout"),
    ):
        with pytest.raises(ValueError, match=message):
            router_config_from_args(build_parser().parse_args(["router", "--replica", "h:1", *bad]))


def test_ray_serve_takes_the_routers_body_limit_flags():
    """``g4serve serve --ray``'s ingress holds bodies as ``g4serve router`` does: the same flags (the cap is
    ``serve``'s own --max-request-body-bytes, which each replica applies too), defaults and checks."""
    parse = build_parser().parse_args
    router_default = router_config_from_args(parse(["router", "--replica", "h:1"])).body_limits
    assert body_limits_from_args(parse(["serve", "--ray"])) == router_default == BodyLimits()
    assert body_limits_from_args(parse(["serve", "--ray", *LIMITS])) == BodyLimits(500, 1000, 2.0)
    for bad, message in (
        (["--max-buffered-body-bytes", "1000"], "a body at the cap"),
        (["--request-body-timeout", "-1"], "--request-body-timeout"),
    ):
        with pytest.raises(ValueError, match=message):
            body_limits_from_args(parse(["serve", "--ray", *bad]))


def budget_held(router: Served) -> int:
    return router.server.config.app.state.proxy.bodies.budget.held_bytes


def test_bodies_past_the_routers_budget_get_a_503_at_once_and_the_budget_comes_back():
    """Every body is read whole (to key it) and held while the replica answers. Under the per-request cap
    alone, N clients each sending a body near the cap made the router hold N times the cap: one budget
    bounds the bytes of bodies held at once over all requests."""
    body = json.dumps(chat("x" * 40_000)).encode()
    received, gate = threading.Event(), threading.Event()
    answers = []
    limits = BodyLimits(max_request_body_bytes=48 << 10, max_buffered_body_bytes=64 << 10)
    try:
        with (
            Served(holding_replica(received, gate)) as replica,
            router_for(replica.url, body_limits=limits) as router,
        ):
            first = threading.Thread(
                target=lambda: answers.append(httpx.post(f"{router.url}{CHAT}", content=body, timeout=30))
            )
            first.start()
            assert received.wait(20)  # the first body is held while the replica works on it
            with httpx.Client(base_url=router.url, timeout=5) as client:
                refused = client.post(CHAT, content=body)  # its Content-Length is past what is left
                assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
                assert "buffered request bodies" in refused.json()["error"]["message"]

                def chunked():  # no Content-Length: refused once what arrived is past what is left
                    yield from (body[i : i + 8192] for i in range(0, len(body), 8192))

                assert client.post(CHAT, content=chunked()).status_code == 503
                gate.set()
                first.join(30)
                assert answers[0].json() == {"bytes": len(body)}
                wait_until(lambda: budget_held(router) == 0)
                assert client.post(CHAT, content=body).json() == {"bytes": len(body)}
                assert client.post(CHAT, content=chunked()).json() == {"bytes": len(body)}
                assert budget_held(router) == 0
    finally:
        gate.set()


def test_the_body_budget_comes_back_on_every_path(fake_replicas, monkeypatch):
    (_, a), _ = fake_replicas
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    with router_for(
        a.url,
        f"http://{dead}",
        health_interval_s=3600,
        body_limits=BodyLimits(max_request_body_bytes=1 << 20),
    ) as router:
        proxy = router.server.config.app.state.proxy
        with httpx.Client(base_url=router.url, timeout=10) as client:
            assert client.post(CHAT, json=chat("ok")).status_code == 200
            with client.stream("POST", CHAT, json=chat("s", stream=True)) as stream:
                assert sse_data(stream.iter_lines())[-1] == "[DONE]"
            with client.stream("POST", CHAT, json=chat("d", stream=True, die_after=0)) as dying:
                assert "error" in sse_data(dying.iter_lines())[-2]
            assert client.post(CHAT, json=chat("x", die_after=0)).status_code == 502  # the replica failed
            pool = router.server.config.app.state.pool
            pool.mark(dead, True)
            pinned = client.post(CHAT, json=chat("x"), headers={"X-G4Serve-Replica": dead})
            assert pinned.status_code == 503  # refused connection, nowhere else to go
            assert client.post(CHAT, content=b"x" * ((1 << 20) + 1)).status_code == 413
            with pytest.raises(httpx.ReadTimeout):  # the client leaves while the replica works
                client.post(CHAT, json=chat("x", slow=True), timeout=0.3)
            wait_until(lambda: budget_held(router) == 0)
            with monkeypatch.context() as patched:  # the router's own failure: a 500, the budget still back

                async def broken(*args):
                    raise RuntimeError("router bug (test)")

                patched.setattr(proxy, "_try", broken)
                assert client.post(CHAT, json=chat("x")).status_code == 500
        # the client leaves half-way through its body
        with socket.create_connection(("127.0.0.1", router.port), timeout=10) as raw:
            head = f"POST {CHAT} HTTP/1.1\r\nHost: router\r\nContent-Length: 10000\r\n\r\n"
            raw.sendall(head.encode() + b"{" * 5000)
            wait_until(lambda: budget_held(router) == 10000)
        wait_until(lambda: budget_held(router) == 0)


@pytest.mark.parametrize("trickle", [False, True])
def test_a_body_that_never_arrives_whole_gets_a_408_and_the_connection_closes(fake_replicas, trickle):
    """A client that sends its headers, then its body a byte at a time (or never), held a request, its
    connection and what it sent of its body for as long as it liked (slowloris)."""
    (app_a, a), _ = fake_replicas
    with router_for(a.url, body_limits=BodyLimits(request_body_timeout_s=1.0)) as router:
        with socket.create_connection(("127.0.0.1", router.port), timeout=10) as s:
            head = f"POST {CHAT} HTTP/1.1\r\nHost: router\r\nContent-Length: 1000\r\n\r\n"
            s.sendall(head.encode() + b'{"messages": ')
            started = time.monotonic()
            # a byte every 0.1 s, stopped short of the deadline (a byte arriving as the router closes would
            # reset the connection): a timeout reset by every read would answer 1 s after the last one
            while trickle and time.monotonic() - started < 0.8:
                time.sleep(0.1)
                s.sendall(b" ")
            answer = b""
            while data := s.recv(1 << 16):  # until the router closes the connection
                answer += data
            elapsed = time.monotonic() - started
        status_line, _, rest = answer.partition(b"\r\n")
        headers, _, body = rest.partition(b"\r\n\r\n")
        assert status_line.split()[1] == b"408" and b"connection: close" in headers.lower()
        assert "whole request body" in json.loads(body)["error"]["message"]
        assert 1.0 <= elapsed < 1.6, elapsed
        assert budget_held(router) == 0 and app_a.state.seen == []
        with httpx.Client(base_url=router.url, timeout=10) as client:  # and everyone else is served
            assert client.post(CHAT, json=chat("x")).status_code == 200
