"""``g4serve bench`` (run a sweep, write results.json / results.md / plots) and ``g4serve bench compare``.

``add_bench_arguments(subparsers)`` registers both on the top-level ``g4serve`` parser. Without
``--base-url`` the run starts its own g4serve on a free port (a ``g4serve serve`` subprocess, or uvicorn
in a thread of this process with ``--in-process-server``) and stops it at the end; ``--offline`` drives
``LLMEngine`` with no HTTP at all.
"""

from __future__ import annotations

import argparse
import asyncio
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
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from g4serve.bench import loadgen, report
from g4serve.bench.meta import device_name, git_commit
from g4serve.bench.workloads import WORKLOADS, Workload, make_workload, request_bytes

DEFAULT_RATES = "1,2,4"
DEFAULT_CONCURRENCY = "1,2,4,8"


# ---- argparse ----------------------------------------------------------------------------------------------
def _floats(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def _ints(text: str) -> list[int]:
    values = _floats(text)
    if any(v != int(v) for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    return [int(v) for v in values]


def _seconds_range(text: str) -> tuple[float, float]:
    values = _floats(text)
    if len(values) not in (1, 2):
        raise argparse.ArgumentTypeError(f"expected MIN,MAX seconds, got {text!r}")
    return (values[0], values[-1])


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=list(WORKLOADS), default=None, help="what to send (required to run)")
    g.add_argument(
        "--prompt-tokens",
        type=int,
        default=None,
        help="target prompt tokens (text: 500; extraction: 128/512/1024/2048, default 512)",
    )
    g.add_argument(
        "--output-tokens",
        type=int,
        default=None,
        help="max_tokens of every request (text/image/video/audio: 10; extraction: 16/32/64/128, "
        "default 32; qna: uniform in 128-512)",
    )
    g.add_argument(
        "--image-size", default="1024x768", help="image workload: WIDTHxHEIGHT or SIZE (default 1024x768)"
    )
    g.add_argument("--num-frames", type=int, default=6, help="video workload: frames per video (default 6)")
    g.add_argument(
        "--frame-size", default="854x480", help="video workload: frame WIDTHxHEIGHT (default 480p)"
    )
    g.add_argument(
        "--audio-seconds",
        type=_seconds_range,
        default=(3.0, 10.0),
        help="audio workload: clip length MIN,MAX seconds (default 3,10)",
    )
    g.add_argument(
        "--schema",
        action="store_true",
        help="extraction workload: constrain answers with a shallow JSON schema (response_format)",
    )
    g.add_argument("--seed", type=int, default=0, help="workload and arrival seed (default 0)")
    g.add_argument(
        "--no-calibrate",
        dest="calibrate",
        action="store_false",
        help="do not probe the target's tokenizer; assume 1.3 tokens per word",
    )

    g = p.add_argument_group("load")
    g.add_argument(
        "--rates",
        type=_floats,
        default=None,
        help=f"open-loop request rates in QPS (default {DEFAULT_RATES})",
    )
    g.add_argument(
        "--arrival",
        choices=["constant", "poisson"],
        default="constant",
        help="open-loop arrivals: fixed intervals or a Poisson process (default constant)",
    )
    g.add_argument(
        "--concurrency",
        type=_ints,
        default=None,
        help="closed loop: concurrent requests per point instead of rates "
        f"(offline default {DEFAULT_CONCURRENCY})",
    )
    g.add_argument(
        "--duration",
        type=float,
        default=None,
        help="seconds of sending per point (default 30 unless --num-requests)",
    )
    g.add_argument("--num-requests", type=int, default=None, help="requests per point")
    g.add_argument(
        "--warmup", type=int, default=2, help="requests sent (and excluded) before the sweep (default 2)"
    )
    g.add_argument(
        "--drain-timeout",
        type=float,
        default=60.0,
        help="seconds to wait for in-flight requests after a point's sending ends (default 60)",
    )
    add_request_arguments(g)

    g = p.add_argument_group("target")
    add_target_arguments(g)
    g.add_argument("--offline", action="store_true", help="drive LLMEngine directly (no HTTP), closed loop")

    g = p.add_argument_group("output")
    g.add_argument("--out", default=None, help="directory for results.json, results.md and the plots")
    g.add_argument(
        "--label", default=None, help="system name in plots and comparisons (stored in results.json)"
    )
    g.add_argument(
        "--save-requests", action="store_true", help="also write every request's timings to requests.jsonl"
    )
    g.add_argument("--no-plots", dest="plots", action="store_false")


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
        type=_json_object,
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


def add_bench_arguments(subparsers) -> argparse.ArgumentParser:
    """Register ``bench`` (and its ``compare`` and ``grid`` sub-modes) on the ``g4serve`` subparsers."""
    p = subparsers.add_parser(
        "bench",
        help="benchmark a server (or the engine) under load; `bench compare` sets results side by side",
        description="Run a load sweep against g4serve or any OpenAI-compatible server. "
        "`g4serve bench compare A.json B.json --out DIR` compares results files; `g4serve bench grid` "
        "runs the extraction workload over prompt sizes x output lengths x schema on/off.",
    )
    add_run_arguments(p)
    p.set_defaults(func=run_bench_command)
    sub = p.add_subparsers(dest="bench_mode", metavar="{compare,grid}")
    c = sub.add_parser(
        "compare", help="plots and a markdown table of several results.json, with ratios to the first"
    )
    c.add_argument("files", nargs="+", help="results.json files (the first is the baseline)")
    c.add_argument("--out", required=True, help="directory for compare.md and the plots")
    c.add_argument(
        "--labels", default=None, help="comma-separated names, one per file (default: their --label)"
    )
    c.add_argument("--no-plots", dest="plots", action="store_false")
    c.set_defaults(func=compare_command)
    from g4serve.bench.grid import add_grid_arguments

    add_grid_arguments(sub)
    return p


def build_parser() -> argparse.ArgumentParser:
    """A stand-alone ``g4serve``-like parser holding only ``bench``
    (tests, ``python -m g4serve.bench.cli``)."""
    parser = argparse.ArgumentParser(prog="g4serve")
    add_bench_arguments(parser.add_subparsers(dest="command", required=True))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.command_line = shlex.join(["g4serve", *argv])
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"g4serve bench: error: {exc}", file=sys.stderr)
        return 2


# ---- compare -----------------------------------------------------------------------------------------------
def compare_command(args: argparse.Namespace) -> int:
    labels = [s.strip() for s in args.labels.split(",")] if args.labels else None
    written = report.compare(args.files, args.out, labels, plots=args.plots)
    print(written["md"].read_text())
    print(f"wrote {', '.join(str(p) for p in written.values())}", file=sys.stderr)
    return 0


# ---- run ---------------------------------------------------------------------------------------------------
def _check_args(args: argparse.Namespace) -> None:  # noqa: C901 - a flat list of independent argument checks and defaults, one guard each
    if args.workload is None:
        raise ValueError("--workload is required (text, video, image, audio, extraction, qna)")
    if args.out is None:
        raise ValueError("--out DIR is required")
    if args.rates is not None and args.concurrency is not None:
        raise ValueError("give --rates (open loop) or --concurrency (closed loop), not both")
    if args.offline and args.rates is not None:
        raise ValueError("--offline runs at fixed concurrency: use --concurrency")
    if args.offline and args.base_url:
        raise ValueError("--offline drives the engine in this process; it takes no --base-url")
    if args.offline and args.extra_body:
        raise ValueError("--extra-body adds fields to HTTP request bodies; --offline sends none")
    if args.num_requests is not None and args.num_requests <= 0:
        raise ValueError("--num-requests: must be positive")
    if args.duration is not None and args.duration <= 0:
        raise ValueError("--duration: must be positive")
    if args.duration is None and args.num_requests is None:
        args.duration = 30.0
    if args.concurrency is None and (args.offline or args.rates is None):
        if args.offline:
            args.concurrency = _ints(DEFAULT_CONCURRENCY)
        else:
            args.rates = _floats(DEFAULT_RATES)
    if args.warmup < 0:
        raise ValueError("--warmup: must be >= 0")


def workload_from_args(args: argparse.Namespace) -> Workload:
    return make_workload(
        args.workload,
        seed=args.seed,
        prompt_tokens=args.prompt_tokens,
        output_tokens=args.output_tokens,
        image_size=args.image_size,
        num_frames=args.num_frames,
        frame_size=args.frame_size,
        audio_seconds=args.audio_seconds,
        schema=args.schema,
    )


def run_bench_command(args: argparse.Namespace) -> int:
    _check_args(args)
    workload = workload_from_args(args)
    if not args.calibrate:
        workload.assume_calibration()
    if args.offline:
        result = _run_offline(args, workload)
    else:
        result = _run_online(args, workload)
    note = (workload.calibration or {}).get("note")
    if note:
        print(f"[bench] warning: {note}", file=sys.stderr)
    per_request = result.pop("_requests")
    paths = report.write_results(args.out, result, plots=args.plots)
    if args.save_requests:
        paths["requests"] = Path(args.out) / "requests.jsonl"
        with paths["requests"].open("w") as f:
            for point, records in zip(result["points"], per_request):
                x = point.get("rate_qps", point.get("concurrency"))
                for record in records:
                    f.write(json.dumps({"point": x, **record}) + "\n")
    print(paths["md"].read_text())
    print(f"wrote {', '.join(str(p) for p in paths.values())}", file=sys.stderr)
    return 0


def _point_load(args: argparse.Namespace, value: float, mode: str) -> dict[str, Any]:
    if mode == "rate":
        return {"mode": "rate", "rate_qps": value, "arrival": args.arrival}
    return {"mode": "concurrency", "concurrency": int(value)}


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1e3:.1f}"


def _progress(point: dict[str, Any]) -> None:
    x = point.get("rate_qps", point.get("concurrency"))
    print(
        f"[bench] {point['mode']}={x}: {point['requests_completed']}/{point['requests_sent']} ok, "
        f"{point['errors']} errors, TTFT p50 {_ms(point['ttft_p50_s'])} ms, "
        f"ITL p50 {_ms(point['itl_p50_s'])} ms, "
        f"{point['output_tokens_per_s']:.1f} tok/s",
        file=sys.stderr,
        flush=True,
    )


def _meta(
    args: argparse.Namespace,
    workload: Workload,
    *,
    model: str | None,
    target: str,
    label: str,
    mode: str,
    http_client: str | None,
    warmup_errors: int,
) -> dict[str, Any]:
    return {
        "label": label,
        "model": model,
        "target": target,
        "workload": {**workload.params(), "calibration": workload.calibration},
        "load": {
            "mode": mode,
            "rates_qps": args.rates,
            "concurrency": args.concurrency,
            "arrival": args.arrival,
            "duration_s": args.duration,
            "num_requests": args.num_requests,
            "warmup": args.warmup,
            "warmup_errors": warmup_errors,
            "drain_timeout_s": args.drain_timeout,
            "temperature": args.temperature,
            "ignore_eos": args.ignore_eos,
            "skip_special_tokens": args.skip_special_tokens or not args.ignore_eos,
            "extra_body": getattr(args, "extra_body", None),
            "http_client": http_client,
        },
        **run_environment(args),
    }


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


# ---- online ------------------------------------------------------------------------------------------------
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


def _run_online(args: argparse.Namespace, workload: Workload) -> dict[str, Any]:
    with serving_target(args) as (base_url, location, own_server):
        return asyncio.run(_sweep(args, workload, base_url, location, own_server))


async def _sweep(
    args: argparse.Namespace, workload: Workload, base_url: str, location: str, own_server: bool
) -> dict[str, Any]:
    client = loadgen.make_http_client(args.http_client, args.api_key, args.request_timeout)
    chat_url = base_url + "/v1/chat/completions"
    pool = ThreadPoolExecutor(
        max_workers=max(2, min(8, (os.cpu_count() or 2) // 2)), thread_name_prefix="bench-build"
    )
    try:
        model = args.model or await _served_model(client, base_url)
        if workload.target_prompt_tokens is not None and args.calibrate:
            counts = [
                await _count_prompt_tokens(client, chat_url, r, model, args.extra_body)
                for r in workload.calibration_probes()
            ]
            workload.set_calibration(counts)

        def builder(namespace: str):
            return lambda i: request_bytes(
                workload.request(namespace, i),
                model,
                ignore_eos=args.ignore_eos,
                temperature=args.temperature,
                show_special_tokens=not args.skip_special_tokens,
                extra_body=args.extra_body,
            )

        warmup_errors = 0
        if args.warmup:
            conc = max(1, min(args.warmup, max(args.concurrency or [4])))
            run = await loadgen.run_concurrency_point(
                client,
                chat_url,
                builder("warmup"),
                pool,
                concurrency=conc,
                num_requests=args.warmup,
                drain_timeout_s=args.drain_timeout,
            )
            bad = [r for r in run.results if not r.ok]
            warmup_errors = len(bad)
            if bad:
                print(
                    f"[bench] warning: {len(bad)}/{len(run.results)} warm-up requests failed: {bad[0].error}",
                    file=sys.stderr,
                )
        mode = "rate" if args.rates is not None else "concurrency"
        points, per_request = [], []
        for k, value in enumerate(args.rates if mode == "rate" else args.concurrency):
            before = await loadgen.scrape_metrics(client, base_url)
            if mode == "rate":
                run = await loadgen.run_rate_point(
                    client,
                    chat_url,
                    builder(f"point{k}"),
                    pool,
                    rate_qps=value,
                    arrival=args.arrival,
                    duration_s=args.duration,
                    num_requests=args.num_requests,
                    drain_timeout_s=args.drain_timeout,
                    schedule_seed=f"{args.seed}:{k}:{value}",
                )
            else:
                run = await loadgen.run_concurrency_point(
                    client,
                    chat_url,
                    builder(f"point{k}"),
                    pool,
                    concurrency=int(value),
                    duration_s=args.duration,
                    num_requests=args.num_requests,
                    drain_timeout_s=args.drain_timeout,
                )
            after = await loadgen.scrape_metrics(client, base_url)
            point = report.summarize_point(
                run, _point_load(args, value, mode), loadgen.server_stage_split(before, after)
            )
            points.append(point)
            per_request.append([r.record() for r in run.results])
            _progress(point)
        label = args.label or ("g4serve" if own_server else urlparse(base_url).netloc or base_url)
        meta = _meta(
            args,
            workload,
            model=model,
            target=f"{location} {base_url}",
            label=label,
            mode=mode,
            http_client=client.name,
            warmup_errors=warmup_errors,
        )
        return {"meta": meta, "points": points, "_requests": per_request}
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        await client.aclose()


async def _served_model(client, base_url: str) -> str | None:
    try:
        status, text = await client.get(base_url + "/v1/models")
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"--base-url: cannot reach {base_url}/v1/models: {exc}") from None
    if status != 200:
        raise ValueError(f"--base-url: {base_url}/v1/models answered HTTP {status}: {text[:200]}")
    data = json.loads(text).get("data") or []
    return data[0]["id"] if data else None


async def _count_prompt_tokens(
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


# ---- offline -----------------------------------------------------------------------------------------------
def _run_offline(args: argparse.Namespace, workload: Workload) -> dict[str, Any]:
    from g4serve.engine.engine import LLMEngine
    from g4serve.server.launch import add_serve_arguments, engine_config_from_args

    parser = argparse.ArgumentParser(prog="--serve-args")
    add_serve_arguments(parser)
    engine = LLMEngine(engine_config_from_args(parser.parse_args(shlex.split(args.serve_args))))
    prepare = _offline_preparer(engine, args)
    if workload.target_prompt_tokens is not None and args.calibrate:
        workload.calibrate(lambda r: len(prepare(r)[0].token_ids))
    pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="bench-build")
    try:
        warmup_errors = 0
        if args.warmup:
            run = loadgen.run_offline_point(
                engine,
                lambda i: workload.request("warmup", i),
                prepare,
                pool,
                concurrency=max(1, min(args.warmup, max(args.concurrency))),
                num_requests=args.warmup,
                drain_timeout_s=args.drain_timeout,
                id_prefix="warmup",
            )
            warmup_errors = sum(not r.ok for r in run.results)
        points, per_request = [], []
        for k, conc in enumerate(args.concurrency):
            namespace = f"point{k}"
            run = loadgen.run_offline_point(
                engine,
                lambda i, ns=namespace: workload.request(ns, i),
                prepare,
                pool,
                concurrency=conc,
                duration_s=args.duration,
                num_requests=args.num_requests,
                drain_timeout_s=args.drain_timeout,
                id_prefix=f"point{k}",
            )
            point = report.summarize_point(
                run, _point_load(args, conc, "concurrency"), report.offline_stages(run)
            )
            points.append(point)
            per_request.append([r.record() for r in run.results])
            _progress(point)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    meta = _meta(
        args,
        workload,
        model=_offline_model_name(args.serve_args),
        target=f"offline LLMEngine on {engine.device}",
        label=args.label or "g4serve-offline",
        mode="concurrency",
        http_client=None,
        warmup_errors=warmup_errors,
    )
    meta["device"] = device_name(str(engine.device))
    return {"meta": meta, "points": points, "_requests": per_request}


def _offline_model_name(serve_args: str) -> str | None:
    from g4serve.server.launch import add_serve_arguments, served_names

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return served_names(parser.parse_args(shlex.split(serve_args)))[0]


def _offline_preparer(engine, args: argparse.Namespace):
    """``request -> (ProcessedPrompt, SamplingParams)`` as the server builds them from a chat body."""
    from g4serve.processing.chat import split_chat_messages
    from g4serve.sampling_params import SamplingParams

    def prepare(request):
        messages, media = split_chat_messages(request.messages, allow_local_files=False)
        prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        processed = engine.process_prompt(
            {"prompt": prompt, "multi_modal_data": media.as_dict()}, add_special_tokens=False
        )
        spec = None
        if request.response_format is not None:
            from g4serve.structured import StructuredSpec

            spec = StructuredSpec.from_response_format(request.response_format)
        params = SamplingParams(
            max_tokens=request.max_tokens,
            temperature=args.temperature,
            ignore_eos=args.ignore_eos,
            structured_output=spec,
        )
        return processed, params

    return prepare


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

    def __init__(self, serve_args: list[str], start_timeout_s: float = 900.0):
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
        self.proc = subprocess.Popen(cmd)
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


def _torch_version() -> str | None:
    try:
        import torch

        return torch.__version__
    except ImportError:
        return None


if __name__ == "__main__":
    sys.exit(main())
