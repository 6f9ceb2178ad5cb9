"""``g4serve router`` in front of two real ``g4serve serve`` processes on the embedded tiny model: a
conversation returns to its replica and hits that replica's prefix cache; a replica killed mid-stream
fails only its own stream, with an error event, and the router serves on with the other."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from conversation import second_turn_hits_the_first_turns_replica
from fake_replicas import Served

from g4serve.deploy.proxy import RouterConfig, build_router_app

pytestmark = pytest.mark.distributed

SYSTEM = "You are the assistant of a bank. Answer briefly and never invent an account number. " * 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def replicas():
    """Two ``g4serve serve`` processes: ``[(process, url), ...]``, healthy."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    started = []
    for _ in range(2):
        port = free_port()
        command = [sys.executable, "-m", "g4serve.cli", "serve", "--device", "cpu", "--dtype", "float32"]
        command += ["--kv-cache-bytes", str(32 << 20), "--port", str(port), "--log-level", "warning"]
        process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        started.append((process, f"http://127.0.0.1:{port}"))
    try:
        deadline = time.monotonic() + 120
        for process, url in started:
            while True:
                assert process.poll() is None, f"{url} exited with {process.returncode}"
                assert time.monotonic() < deadline, f"{url} did not start"
                try:
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.3)
        yield started
    finally:
        for process, _ in started:
            if process.poll() is None:
                process.terminate()
        for process, _ in started:
            process.wait(timeout=30)


@pytest.fixture(scope="module")
def router(replicas):
    config = RouterConfig(replicas=[url for _, url in replicas], health_interval_s=0.5)
    with Served(build_router_app(config)) as served:
        yield served.url


def chat(text: str, **fields) -> dict:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]
    return {"model": "g4serve-tiny", "messages": messages, "max_tokens": 2, **fields}


def test_a_conversation_returns_to_its_replica_and_hits_its_prefix_cache(router):
    with httpx.Client(base_url=router, timeout=60) as client:
        body = chat("What is my balance?")
        second_turn_hits_the_first_turns_replica(client, body)
        sessions = {
            client.post("/v1/chat/completions", json=chat("hi"), headers={"X-Session-Id": f"s{i}"}).headers[
                "x-g4serve-replica"
            ]
            for i in range(12)
        }
        assert len(sessions) == 2  # sessions spread over both replicas
        metrics = client.get("/metrics").text
        assert 'key="prefix",placement="home"' in metrics and 'key="session",placement="home"' in metrics


def stream_events(url: str, body: dict, headers: dict, out: list, first: threading.Event) -> None:
    with httpx.Client(base_url=url, timeout=120) as client:
        with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    out.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
                    first.set()
    first.set()


def test_a_replica_killed_mid_stream_fails_only_its_stream(router, replicas):
    (doomed_process, doomed_url), (_, survivor_url) = replicas
    doomed_name, survivor_name = doomed_url.removeprefix("http://"), survivor_url.removeprefix("http://")
    body = {**chat("tell me a story", stream=True), "max_tokens": 400, "ignore_eos": True}
    results, threads = {}, []
    for name, tokens in ((doomed_name, 400), (survivor_name, 150)):
        results[name], started = [], threading.Event()
        args = (router, {**body, "max_tokens": tokens}, {"X-G4Serve-Replica": name}, results[name], started)
        thread = threading.Thread(target=stream_events, args=args, daemon=True)
        thread.start()
        threads.append((thread, started))
    assert all(started.wait(60) for _, started in threads)
    doomed_process.send_signal(signal.SIGKILL)
    for thread, _ in threads:
        thread.join(120)
    doomed, survivor = results[doomed_name], results[survivor_name]
    error = doomed[-2]["error"]
    assert error["code"] == 502 and doomed_name in error["message"] and doomed[-1] == "[DONE]"
    assert "error" not in json.dumps(survivor) and survivor[-1] == "[DONE]"
    assert [c["finish_reason"] for e in survivor[:-1] for c in e["choices"] if c["finish_reason"]] == [
        "length"
    ]
    # new requests, keyed anywhere, reach the survivor
    with httpx.Client(base_url=router, timeout=60) as client:
        for i in range(6):
            response = client.post("/v1/chat/completions", json=chat(f"question {i}"))
            assert response.status_code == 200 and response.headers["x-g4serve-replica"] == survivor_name
        assert client.get("/health").json() == {"status": "ok", "replicas": 2, "healthy": 1}
