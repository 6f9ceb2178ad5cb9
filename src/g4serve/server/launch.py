"""``g4serve serve``: flags (named as ``vllm serve`` names them), engine start-up and uvicorn."""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

from g4serve.config import PRESETS

log = logging.getLogger("g4serve.server")

MODALITIES = ("image", "video", "audio")


def parse_mm_limits(text: str) -> dict[str, int]:
    """``'{"image": 2, "audio": 1}'`` (vLLM's JSON form) or ``image=2,audio=1``; unnamed modalities keep
    defaults."""
    text = text.strip()
    try:
        raw = (
            json.loads(text)
            if text.startswith("{")
            else dict(kv.split("=", 1) for kv in text.split(",") if kv)
        )
    except (ValueError, json.JSONDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"--limit-mm-per-prompt: cannot parse {text!r}: {exc}") from None
    out = {}
    for key, value in raw.items():
        if key not in MODALITIES:
            raise argparse.ArgumentTypeError(f"--limit-mm-per-prompt: unknown modality {key!r}")
        try:
            out[key] = int(value)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"--limit-mm-per-prompt: {key} must be an integer") from None
        if out[key] < 0:
            raise argparse.ArgumentTypeError(f"--limit-mm-per-prompt: {key} must be >= 0")
    return out


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
        default=os.environ.get("G4SERVE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 (default: $G4SERVE_API_KEY)",
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument(
        "--kv-cache-bytes", type=int, default=None, help="explicit KV-cache budget (CPU default 256 MiB)"
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "torch", "triton"],
        help="auto: Triton kernels on CUDA, the PyTorch reference on CPU",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run decode steps eagerly (default on CUDA: captured CUDA graphs replayed per batch size)",
    )
    p.add_argument(
        "--max-cuda-graph-batch",
        type=int,
        default=None,
        help="largest decode batch replayed as a CUDA graph (default: --max-num-seqs)",
    )
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="launch each step before the previous step's tokens are read back, so scheduling and "
        "output processing overlap the GPU (a stopped request computes one discarded token; "
        "default: on)",
    )
    p.add_argument(
        "--overlap-encoder",
        action="store_true",
        help="encode images, video and audio ahead of the prefills that need them, on a side CUDA "
        "stream, while other requests keep decoding (default: inside the step, before its forward)",
    )
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument(
        "--limit-mm-per-prompt",
        type=parse_mm_limits,
        default={},
        help='media per prompt, e.g. \'{"image": 4, "video": 1, "audio": 2}\'; all 0 = text-only',
    )
    p.add_argument("--text-only", action="store_true", help="do not load the vision/audio towers")
    p.add_argument(
        "--allowed-local-media-path",
        default=None,
        help="allow file:// media under this directory (default: data: URLs only)",
    )
    p.add_argument("--max-request-body-bytes", type=int, default=64 << 20)
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds to let running requests finish on shutdown before aborting them",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of random preset weights")
    p.add_argument("--log-level", default="info")


def engine_config_from_args(args: argparse.Namespace):
    from g4serve.engine.engine import EngineConfig

    model = args.preset or args.model
    if model is not None and model not in PRESETS and not Path(model).is_dir():
        raise SystemExit(
            f"g4serve serve: error: {model!r} is neither a checkpoint directory nor a preset "
            f"({', '.join(sorted(PRESETS))})"
        )
    config = EngineConfig(
        model=model,
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_bytes=args.kv_cache_bytes,
        enable_prefix_caching=args.enable_prefix_caching,
        text_only=args.text_only,
        seed=args.seed,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        max_cuda_graph_batch=args.max_cuda_graph_batch,
        async_scheduling=args.async_scheduling,
        overlap_encoder=args.overlap_encoder,
    )
    if not args.text_only and args.limit_mm_per_prompt:
        config.limit_mm_per_prompt = {**config.limit_mm_per_prompt, **args.limit_mm_per_prompt}
    return config


def served_names(args: argparse.Namespace) -> list[str]:
    if args.served_model_name:
        return list(args.served_model_name)
    model = args.preset or args.model
    return [model if model is not None else "g4serve-tiny"]


def build_from_args(args: argparse.Namespace):
    """Load the engine and build the app (separate from ``serve`` so tests can run it in-process)."""
    from g4serve.engine.async_engine import AsyncLLMEngine
    from g4serve.server.app import ServerConfig, build_app

    engine = AsyncLLMEngine.from_config(engine_config_from_args(args))
    config = ServerConfig(
        served_model_names=served_names(args),
        api_key=args.api_key,
        max_request_body_bytes=args.max_request_body_bytes,
        allowed_local_media_path=args.allowed_local_media_path,
        drain_timeout_s=args.drain_timeout,
        limit_mm_per_prompt=dict(engine.engine.config.limit_mm_per_prompt),
    )
    return build_app(engine, config)


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    app = build_from_args(args)
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
