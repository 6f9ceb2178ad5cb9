"""``g4serve bench`` (run a sweep, write results.json / results.md / plots) and ``g4serve bench compare``.

``add_bench_arguments(subparsers)`` registers both on the top-level ``g4serve`` parser. Without
``--base-url`` the run starts its own g4serve on a free port (a ``g4serve serve`` subprocess, or uvicorn
in a thread of this process with ``--in-process-server``) and stops it at the end; ``--offline`` drives
``LLMEngine`` with no HTTP at all. What ``bench grid`` (``grid.py``) shares with it (argument groups,
the target server, the probes, the run environment) is in ``common.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from g4serve.bench import loadgen, report
from g4serve.bench.common import (
    add_request_arguments,
    add_target_arguments,
    count_prompt_tokens,
    floats,
    ints,
    ms,
    run_environment,
    served_model,
    serving_target,
)
from g4serve.bench.grid import add_grid_arguments
from g4serve.bench.meta import device_name
from g4serve.bench.workloads import WORKLOADS, Workload, make_workload, request_bytes

DEFAULT_RATES = "1,2,4"
DEFAULT_CONCURRENCY = "1,2,4,8"


# ---- argparse ----------------------------------------------------------------------------------------------
def _seconds_range(text: str) -> tuple[float, float]:
    values = floats(text)
    if len(values) not in (1, 2):
        raise argparse.ArgumentTypeError(f"expected MIN,MAX seconds, got {text!r}")
    return (values[0], values[-1])


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
        "--video-format",
        choices=("jpeg", "mp4"),
        default="jpeg",
        help="video workload: the frames as JPEG data URLs (default), or one H.264 MP4 at 30 fps that the "
        "server decodes as a container",
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
        type=floats,
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
        type=ints,
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
            args.concurrency = ints(DEFAULT_CONCURRENCY)
        else:
            args.rates = floats(DEFAULT_RATES)
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
        video_format=args.video_format,
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


# Above this share of one core the client's own event loop starts to delay what it measures.
CLIENT_CPU_WARNING = 0.8


def _progress(point: dict[str, Any]) -> None:
    x = point.get("rate_qps", point.get("concurrency"))
    print(
        f"[bench] {point['mode']}={x}: {point['requests_completed']}/{point['requests_sent']} ok, "
        f"{point['errors']} errors, TTFT p50 {ms(point['ttft_p50_s'])} ms, "
        f"ITL p50 {ms(point['itl_p50_s'])} ms, "
        f"{point['output_tokens_per_s']:.1f} tok/s",
        file=sys.stderr,
        flush=True,
    )
    share = point.get("client_cpu_share")
    if share is not None and share > CLIENT_CPU_WARNING:
        print(
            f"[bench] warning: the client itself used {share:.0%} of a core at this point: its TTFT and ITL "
            "may be late; split the load over several clients",
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


# ---- online ------------------------------------------------------------------------------------------------
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
        model = args.model or await served_model(client, base_url)
        if workload.target_prompt_tokens is not None and args.calibrate:
            counts = [
                await count_prompt_tokens(client, chat_url, r, model, args.extra_body)
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
            if location.startswith("in-process"):  # the server's CPU is this process's too
                run.client_cpu_s = None
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


if __name__ == "__main__":
    sys.exit(main())
