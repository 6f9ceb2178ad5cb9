"""``g4serve assistant``: serve the voice banking assistant, or ``import-payees CSV`` into its database."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from g4serve.config import PRESETS

log = logging.getLogger("g4serve.assistant")

DEFAULT_DB_NAME = "assistant.db"


def add_assistant_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="checkpoint directory or preset (tiny, e2b, e4b, 26b-a4b, 31b: random weights) for the "
        "Gemma extraction and QnA; default: the embedded tiny model",
    )
    p.add_argument(
        "--no-llm",
        action="store_true",
        help="no model: unsure utterances get a clarifying question, QnA answers extractively",
    )
    db_help = (
        f"SQLite database (default: <cache>/assistant/{DEFAULT_DB_NAME}, <cache> being $G4SERVE_CACHE or "
        "~/.cache/g4serve; seeded with demo data when it does not exist yet; ':memory:' for a throwaway one)"
    )
    # Resolved at run time, not here: `g4serve --help` must not create the cache directory.
    p.add_argument("--db", default=None, help=db_help)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument(
        "--kv-cache-bytes", type=int, default=None, help="explicit KV-cache budget (CPU default 256 MiB)"
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.5,
        help="the assistant's prompts are short: half the GPU is plenty by default",
    )
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    p.add_argument("--seed", type=int, default=0, help="seed of random preset weights")
    p.add_argument(
        "--asr",
        default="pocketsphinx",
        help="speech recogniser: pocketsphinx (domain LM, default), pocketsphinx-jsgf, pocketsphinx-general",
    )
    p.add_argument(
        "--intent-threshold",
        type=float,
        default=0.75,
        help="fast-path confidence below which Gemma extracts the intent",
    )
    p.add_argument("--log-level", default="info")
    sub = p.add_subparsers(dest="assistant_command")
    imp = sub.add_parser(
        "import-payees",
        help="load payees from a CSV (payee_id,display_name,relationship[,kind][,aliases]) into the database",
    )
    imp.add_argument("csv")
    # Own dest: argparse lets a subparser's default overwrite the parent's value of the same name.
    imp.add_argument("--db", dest="import_db", default=None, help="database (default: as for the assistant)")
    p.set_defaults(func=run)


def default_db_path() -> Path:
    """``<cache>/assistant/assistant.db``, its directory created: a bare ``g4serve assistant`` must not
    litter the working directory with the database and its SQLite ``-wal``/``-shm`` files."""
    from g4serve.tiny import cache_dir

    path = cache_dir() / "assistant" / DEFAULT_DB_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def resolve_db(path: str | None) -> str:
    """``--db`` as given, else the default database in the cache directory."""
    return path if path is not None else str(default_db_path())


def open_db(path: str):
    """The database at ``path``; a new one (or ':memory:') is seeded with the demo customer."""
    from g4serve.assistant.db import BankDB

    new = path == ":memory:" or not Path(path).exists()
    db = BankDB(path)
    if new:
        db.seed_demo()
        log.info("created %s with demo data", path)
    return db


def build_engine(args: argparse.Namespace):
    """The engine as ``g4serve serve`` builds it, text-only (the assistant sends no media to the model)."""
    from g4serve.engine.async_engine import AsyncLLMEngine
    from g4serve.engine.engine import EngineConfig

    model = args.model
    if model is not None and model not in PRESETS and not Path(model).is_dir():
        raise ValueError(
            f"--model: {model!r} is neither a checkpoint directory nor a preset "
            f"({', '.join(sorted(PRESETS))})"
        )
    config = EngineConfig(
        model=model,
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_bytes=args.kv_cache_bytes,
        enable_prefix_caching=True,
        text_only=True,
        seed=args.seed,
        attention_backend=args.attention_backend,
    )
    return AsyncLLMEngine.from_config(config)


def build_from_args(args: argparse.Namespace):
    """The app (separate from ``run`` so tests can build it in-process)."""
    from g4serve.assistant.app import build_app
    from g4serve.assistant.pipeline import Assistant

    if not 0.0 < args.intent_threshold <= 1.0:
        raise ValueError(f"--intent-threshold: must be in (0, 1], got {args.intent_threshold}")
    db_path = resolve_db(args.db)
    log.info("database %s", db_path)  # the default lives in the cache directory: say where
    db = open_db(db_path)
    engine = None if args.no_llm else build_engine(args)
    assistant = Assistant(db, engine, recognizer=args.asr, intent_threshold=args.intent_threshold)
    return build_app(assistant)


def run(args: argparse.Namespace) -> int:
    if args.assistant_command == "import-payees":
        return import_payees(args.csv, resolve_db(args.import_db or args.db))
    import uvicorn

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    app = build_from_args(args)
    log.info("assistant on http://%s:%d (web page at /)", args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_keep_alive=30)
    return 0


def import_payees(csv_path: str, db_path: str) -> int:
    if not Path(csv_path).is_file():
        raise FileNotFoundError(f"{csv_path}: no such file")
    db = open_db(db_path)
    try:
        n = db.import_payees_csv(csv_path)
    finally:
        db.close()
    print(f"imported {n} payees into {db_path}")
    return 0
