"""``g4serve serve``: flags (named as ``vllm serve`` names them), engine start-up and uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import traceback

from g4serve import envs
from g4serve.config import PRESETS
from g4serve.engine.config import EngineConfig
from g4serve.engine_args import add_engine_arguments
from g4serve.engine_args import engine_config_from_args as engine_config
from g4serve.server.body_budget import BodyLimits, add_body_limit_arguments, body_limits_from_args

log = logging.getLogger("g4serve.server")


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="checkpoint directory or preset (tiny, e2b, e4b, 26b-a4b, 31b: random weights); "
        "default: the embedded tiny model",
    )
    p.add_argument(
        "--preset", default=None, choices=sorted(PRESETS), help="full-size shapes with random weights"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients use in 'model' (default: the model path or preset)",
    )
    p.add_argument(
        "--api-key",
        default=envs.get("G4SERVE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every path but /health, /metrics included unless "
        "--metrics-public (default: $G4SERVE_API_KEY)",
    )
    p.add_argument(
        "--metrics-public",
        action="store_true",
        help="serve /metrics without the API key (for a Prometheus scraper inside the network)",
    )
    p.add_argument(
        "--max-waiting-requests",
        type=int,
        default=1024,
        help="requests being prepared or queued for the engine past which new ones are answered 429 with "
        "Retry-After (0: no limit)",
    )
    p.add_argument(
        "--allowed-local-media-path",
        default=None,
        help="allow file:// media under this directory (default: data: URLs only)",
    )
    p.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=BodyLimits.max_request_body_bytes,
        help="a request body past this gets a 413 (at once when its Content-Length says so)",
    )
    add_body_limit_arguments(p)  # with --ray, they bound each ingress replica too
    p.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="accept a chat template in a request's chat_template_kwargs.chat_template (rendered in a "
        "sandboxed worker process with time, memory and size limits); default: refused with a 400",
    )
    p.add_argument(
        "--trust-message-control-tokens",
        action="store_true",
        help="read the model's control tokens spelled in messages and tools ('<|turn>', '<eos>', ...) as "
        "those tokens, as transformers and vLLM do; default: as words, so a client's text (or a tool "
        "result) cannot close its turn and write one of its own",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds to let running requests finish on shutdown before aborting them",
    )
    p.add_argument(
        "--responses-store-max-entries",
        type=int,
        default=1024,
        help="/v1/responses kept in memory for previous_response_id (least recently used out first; 0: none)",
    )
    p.add_argument(
        "--responses-store-max-bytes",
        type=int,
        default=256 << 20,
        help="bytes of stored /v1/responses (their JSON, media data URLs included) past which the least "
        "recently used go",
    )
    p.add_argument(
        "--lora-root",
        default=None,
        help="turn on run-time LoRA loading (POST /v1/load_lora_adapter, /v1/unload_lora_adapter) for "
        "adapter directories under this one; needs --api-key (default: off, --lora-modules only)",
    )
    p.add_argument("--log-level", default="info")
    add_engine_arguments(p)  # every EngineConfig option, with its default and help from the field


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    from g4serve.models.gemma4.loader import CheckpointError, checkpoint_dir

    model = args.preset or args.model
    if model is not None:
        try:
            checkpoint_dir(model)  # before anything loads: a typo exits at once
        except CheckpointError as exc:
            raise SystemExit(f"g4serve serve: error: {exc}") from None
    return engine_config(args, model=model)


def served_names(args: argparse.Namespace) -> list[str]:
    if args.served_model_name:
        return list(args.served_model_name)
    model = args.preset or args.model
    return [model if model is not None else "g4serve-tiny"]


def build_from_args(args: argparse.Namespace):
    """Load the engine and build the app (separate from ``serve`` so tests can run it in-process)."""
    from g4serve.engine.async_engine import AsyncLLMEngine
    from g4serve.server.app import ServerConfig, build_app

    body_limits = body_limits_from_args(args)  # ValueError: main prints it and exits 2, before any loading
    if args.lora_root is not None:
        if not args.api_key:
            raise SystemExit(
                "g4serve serve: error: --lora-root needs --api-key: run-time adapter loads change what every "
                "client's requests naming the adapter compute"
            )
        if not os.path.isdir(args.lora_root):
            raise SystemExit(f"g4serve serve: error: --lora-root {args.lora_root}: not a directory")
    engine_config = engine_config_from_args(args)
    engine_config.enable_lora = engine_config.enable_lora or args.lora_root is not None
    engine = AsyncLLMEngine.from_config(engine_config)
    config = ServerConfig(
        served_model_names=served_names(args),
        api_key=args.api_key,
        body_limits=body_limits,
        allowed_local_media_path=args.allowed_local_media_path,
        drain_timeout_s=args.drain_timeout,
        max_waiting_requests=args.max_waiting_requests or None,
        metrics_public=args.metrics_public,
        limit_mm_per_prompt=dict(engine.config.limit_mm_per_prompt),
        trust_request_chat_template=args.trust_request_chat_template,
        trust_message_control_tokens=args.trust_message_control_tokens,
        responses_store_max_entries=args.responses_store_max_entries,
        responses_store_max_bytes=args.responses_store_max_bytes,
        lora_root=args.lora_root,
    )
    return build_app(engine, config)


def serve(args: argparse.Namespace) -> int:
    log_to_stderr(args.log_level)
    envs.get_float("G4SERVE_STEP_STALL_S")  # a bad value fails the start, not every /health
    dump_stacks_on_sigusr1()
    return run_http(build_from_args(args), args)


def dump_stacks_on_sigusr1() -> None:
    """``kill -USR1 <pid>`` writes every thread's Python stack to stderr and the server goes on: what a
    server that stopped answering is doing (the engine thread, the event loop, the media workers). The
    handler runs in the main thread, under the interpreter lock, reading ``sys._current_frames()``: safe
    while the other threads run (faulthandler's dump reads their frames without the lock and can crash a
    busy process)."""
    if hasattr(signal, "SIGUSR1"):  # not on Windows
        signal.signal(signal.SIGUSR1, _dump_stacks)


def _dump_stacks(signum: int, frame: object) -> None:
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = [f"--- stacks of {len(names)} threads (SIGUSR1) ---"]
    for ident, top in sys._current_frames().items():
        parts.append(f"Thread {names.get(ident, '?')} ({ident:#x}):")
        parts.append("".join(traceback.format_stack(top)).rstrip())
    print("\n".join(parts), file=sys.stderr, flush=True)


def log_to_stderr(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def run_http(app, args: argparse.Namespace) -> int:
    """Serve ``app`` on ``args.host``:``args.port`` until stopped; a stop gives in-flight requests
    ``args.drain_timeout`` seconds (``g4serve serve`` and ``g4serve router``)."""
    import uvicorn

    log.info("listening on http://%s:%d", args.host, args.port)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=args.drain_timeout,
        timeout_keep_alive=30,
    )
    return 0
