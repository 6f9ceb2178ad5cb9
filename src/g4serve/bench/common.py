"""What ``g4serve bench`` (``cli.py``) and ``g4serve bench grid`` (``grid.py``) share: argument parsers and
groups, the target server (``--base-url``, or a g4serve started here and stopped at the end), the probes
they send it (served model, prompt-token count) and the run environment recorded in every results file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import IO, Any

from g4serve.bench.meta import device_name, git_commit
from g4serve.engine_args import parse_json_object


# ---- argparse ----------------------------------------------------------------------------------------------
def floats(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def ints(text: str) -> list[int]:
    values = floats(text)
    if any(v != int(v) for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    return [int(v) for v in values]


def add_request_arguments(g) -> None:
    """How each request is sent (shared by ``bench`` and ``bench grid``)."""
    g.add_argument(
        "--request-timeout", type=float, default=600.0, help="per-request HTTP timeout (default 600)"
    )
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="do not send ignore_eos (for peers that reject it; output lengths then vary)",
    )
    g.add_argument(
        "--skip-special-tokens",
        action="store_true",
        help="with ignore_eos, leave skip_special_tokens at the server's default (true): special tokens "
        "generated past the natural end then stream no chunk (default: send false)",
    )


def add_target_arguments(g) -> None:
    """Which server receives the requests (shared by ``bench`` and ``bench grid``)."""
    g.add_argument("--base-url", default=None, help="an OpenAI-compatible server (default: start a g4serve)")
    g.add_argument("--model", default=None, help="model name to request (default: the first of /v1/models)")
    g.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    g.add_argument(
        "--extra-body",
        type=parse_json_object,
        default=None,
        help="a JSON object whose fields are added to every request body (a peer's own extensions, "
        "e.g. transformers serve's generation_config)",
    )
    g.add_argument(
        "--serve-args",
        default="",
        help="flags for the g4serve this run starts (or for the engine with --offline), as for "
        '`g4serve serve`, e.g. "--preset e4b --max-num-seqs 128"',
    )
    g.add_argument(
        "--in-process-server",
        action="store_true",
        help="run the own server on uvicorn in a thread of this process (starts faster, but it shares "
        "the GIL with the load generator, which skews latencies; default: a `g4serve serve` "
        "subprocess)",
    )
    g.add_argument("--http-client", choices=["auto", "aiohttp", "httpx"], default="auto")


# ---- results -----------------------------------------------------------------------------------------------
def ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1e3:.1f}"


def run_environment(args: argparse.Namespace) -> dict[str, Any]:
    """Where and how a load run ran: the server flags, commit, date, device, versions and command line
    (every results file's meta ends with these)."""
    return {
        "serve_args": args.serve_args or None,
        "git_commit": git_commit(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "device": device_name(),
        "torch_version": _torch_version(),
        "python_version": platform.python_version(),
        "host": platform.node(),
        "command": command_line(args),
    }


def command_line(args: argparse.Namespace) -> str:
    """The command as typed: ``g4serve bench ...`` whether run as ``g4serve``, ``python -m g4serve.cli`` or
    ``python -m g4serve.bench.cli``."""
    return getattr(args, "command_line", None) or shlex.join(["g4serve", *sys.argv[1:]])


def _torch_version() -> str | None:
    try:
        import torch

        return torch.__version__
    except ImportError:
        return None


# ---- target ------------------------------------------------------------------------------------------------
@contextmanager
def serving_target(args: argparse.Namespace) -> Iterator[tuple[str, str, bool]]:
    """(base URL, location, whether we started the server): ``--base-url`` as given, or a server started
    here from ``--serve-args`` (in this process with ``--in-process-server``) and stopped on exit."""
    if args.base_url:
        yield args.base_url.rstrip("/").removesuffix("/v1"), "external", False
        return
    server = (InProcessServer if args.in_process_server else SubprocessServer)(shlex.split(args.serve_args))
    try:
        yield server.base_url, server.location, True
    finally:
        server.stop()


async def served_model(client, base_url: str) -> str | None:
    try:
        status, text = await client.get(base_url + "/v1/models")
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"--base-url: cannot reach {base_url}/v1/models: {exc}") from None
    if status != 200:
        raise ValueError(f"--base-url: {base_url}/v1/models answered HTTP {status}: {text[:200]}")
    data = json.loads(text).get("data") or []
    return data[0]["id"] if data else None


async def count_prompt_tokens(
    client, chat_url: str, request, model: str | None, extra_body: dict[str, Any] | None = None
) -> int:
    """The server's ``usage.prompt_tokens`` for a request (a 1-token, non-streamed probe without schema)."""
    body = {**request.body(model, ignore_eos=False, stream=False), **(extra_body or {})}
    body.pop("response_format", None)
    body["max_tokens"] = 1
    status, text = await client.post(chat_url, json.dumps(body).encode())
    if status != 200:
        raise ValueError(f"calibration probe failed: HTTP {status}: {text[:300]}")
    return int(json.loads(text)["usage"]["prompt_tokens"])


# ---- own server --------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_argv(serve_args: list[str], port: int) -> list[str]:
    return [*serve_args, "--host", "127.0.0.1", "--port", str(port)]


class InProcessServer:
    """g4serve on uvicorn in a background thread of this process (shares the GIL with the load generator)."""

    location = "in-process g4serve"

    def __init__(self, serve_args: list[str], start_timeout_s: float = 600.0):
        import uvicorn

        from g4serve.server.launch import add_serve_arguments, build_from_args

        parser = argparse.ArgumentParser(prog="--serve-args")
        add_serve_arguments(parser)
        port = free_port()
        args = parser.parse_args(_serve_argv(serve_args, port))
        app = build_from_args(args)
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=5)
        )
        self.thread = threading.Thread(target=self.server.run, name="g4serve-bench-server", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the in-process g4serve did not start")
            time.sleep(0.02)
        self.base_url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


class SubprocessServer:
    """``g4serve serve`` in a child process; waits for /health, stops it with SIGTERM (then SIGKILL)."""

    location = "subprocess g4serve"

    def __init__(
        self,
        serve_args: list[str],
        start_timeout_s: float = 900.0,
        *,
        env: dict[str, str] | None = None,
        cwd: str | os.PathLike | None = None,
        log: IO | None = None,
    ):
        """``env`` / ``cwd``: the child's (another tree's sources, a GPU); ``log``: its output (default: this
        process's)."""
        import urllib.request

        port = free_port()
        cmd = [
            sys.executable,
            "-m",
            "g4serve.cli",
            "serve",
            *_serve_argv(serve_args, port),
            "--log-level",
            "warning",
        ]
        self.proc = subprocess.Popen(
            cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT if log is not None else None
        )
        self.base_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + start_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"g4serve serve exited with status {self.proc.returncode}: {shlex.join(cmd)}"
                )
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"g4serve serve did not become healthy in {start_timeout_s:.0f} s")
            time.sleep(0.25)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
