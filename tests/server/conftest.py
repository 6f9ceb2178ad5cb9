"""Real g4serve servers (uvicorn on a localhost port, in a background thread) on the tiny model."""

from __future__ import annotations

import argparse
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

uvicorn = pytest.importorskip("uvicorn")

from g4serve.server.launch import add_serve_arguments, build_from_args  # noqa: E402


@dataclass
class RunningServer:
    base_url: str
    app: object
    server: object

    @property
    def engine(self):
        """The synchronous engine behind the server (to inspect KV pools)."""
        return self.app.state.engine.engine

    def wait_idle(self, timeout_s: float = 20.0) -> None:
        """Wait until no request is in the engine and every KV block is free again."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            engine = self.engine
            if not engine.requests and all(p.num_free == p.num_blocks for p in engine.kv.pools.values()):
                return
            time.sleep(0.05)
        pools = {name: (p.num_free, p.num_blocks) for name, p in self.engine.kv.pools.items()}
        raise AssertionError(
            f"engine not idle: requests={list(self.engine.requests)} pools(free, total)={pools}"
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir, *extra: str) -> tuple[RunningServer, threading.Thread]:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    port = _free_port()
    args = parser.parse_args(
        [
            str(model_dir),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--port",
            str(port),
            "--kv-cache-bytes",
            str(32 << 20),
            *extra,
        ]
    )
    app = build_from_args(args)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=5)
    )
    thread = threading.Thread(target=server.run, name="g4serve-test-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("test server did not start")
        time.sleep(0.02)
    return RunningServer(f"http://127.0.0.1:{port}", app, server), thread


def stop_server(running: RunningServer, thread: threading.Thread) -> None:
    running.server.should_exit = True
    thread.join(timeout=30)


@pytest.fixture(scope="module")
def server(tiny_model_dir) -> Iterator[RunningServer]:
    running, thread = start_server(
        tiny_model_dir,
        "--served-model-name",
        "tiny",
        "g4-tiny",
        "--max-model-len",
        "1024",
        "--limit-mm-per-prompt",
        '{"image": 2, "video": 1, "audio": 1}',
        "--max-request-body-bytes",
        str(4 << 20),
        "--max-num-seqs",
        "64",
    )
    yield running
    stop_server(running, thread)


@pytest.fixture(scope="module")
def server_factory():
    """``start(model_dir, *flags) -> RunningServer``; every server started is stopped at module end."""
    started = []

    def start(model_dir, *flags: str) -> RunningServer:
        running, thread = start_server(model_dir, *flags)
        started.append((running, thread))
        return running

    yield start
    for running, thread in started:
        stop_server(running, thread)
