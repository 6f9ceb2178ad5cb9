"""``g4serve assistant`` (or ``g4serve-assistant``): serve the voice banking assistant over a bank (the SQL
database, SQLite or PostgreSQL, or a bank's REST API with ``--bank-url``), or import customers, cards and
payees into the database.

This module imports nothing of the ``assistant`` extra at import time: ``g4serve`` builds its parser from
``add_assistant_arguments`` whether or not the extra is installed, and ``run`` says what to install.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys
from pathlib import Path

from g4serve.engine_args import add_engine_arguments, engine_config_from_args
from g4serve_assistant.access_cli import add_access_arguments, add_mint_token_parser

log = logging.getLogger("g4serve_assistant")

DEFAULT_DB_NAME = "assistant.db"
DEFAULT_AUDIT_DB_NAME = (
    "audit.db"  # the audit trail's file when the bank is not a database of ours (--bank-url)
)
BANK_KEY_ENV = "G4SERVE_ASSISTANT_BANK_API_KEY"
STATE_DB_ENV = "G4SERVE_ASSISTANT_DB"  # --state-db's default
# Where the assistant's engine differs from `g4serve serve`'s: its prompts are short, and it shares the GPU.
ASSISTANT_ENGINE_DEFAULTS = {
    "max_model_len": 4096,
    "max_num_seqs": 32,
    "gpu_memory_utilization": 0.5,
    "jump_forward": True,  # the extraction's keys and punctuation are forced: 304 -> 35 ms on an H100
}
EXTRA_HINT = "the assistant needs its extra: pip install 'g4serve[assistant]'"
# Import names of the `assistant` extra's distributions (pyproject.toml): rapidfuzz, jellyfish, text2num,
# silero-vad, pocketsphinx, websockets (uvicorn's WebSocket transport for /v1/assistant/ws), pyjwt, httpx.
EXTRA_MODULES = (
    "rapidfuzz",
    "jellyfish",
    "text_to_num",
    "silero_vad",
    "pocketsphinx",
    "websockets",
    "jwt",
    "httpx",
)


class MissingExtraError(ValueError):
    """The ``assistant`` extra is not installed; the message says what to install."""

    def __init__(self, missing: list[str] | tuple[str, ...]):
        super().__init__(f"{EXTRA_HINT} (missing: {', '.join(missing)})")
        self.missing = tuple(missing)


def missing_extra_modules() -> list[str]:
    """The extra's modules that cannot be found (found by name only: nothing is imported)."""
    return [name for name in EXTRA_MODULES if importlib.util.find_spec(name) is None]


def require_extra() -> None:
    """Raise ``MissingExtraError`` unless every module of the ``assistant`` extra is installed."""
    missing = missing_extra_modules()
    if missing:
        raise MissingExtraError(missing)


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
    add_bank_arguments(p)
    add_state_arguments(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument(
        "--asr",
        default="pocketsphinx",
        help="speech recogniser: pocketsphinx (domain LM, default), pocketsphinx-jsgf, pocketsphinx-general, "
        "gemma (the served model hears the audio: E2B/E4B only, not with --no-llm)",
    )
    p.add_argument(
        "--intent-threshold",
        type=float,
        default=0.75,
        help="fast-path confidence below which Gemma extracts the intent",
    )
    p.add_argument("--log-level", default="info")
    # The engine's flags, as `g4serve serve` has them; the assistant sends no media (text-only, forced; audio
    # alone with --asr gemma) and its prompts are short.
    add_engine_arguments(
        p,
        exclude=(
            "text_only",
            "limit_mm_per_prompt",
            "overlap_encoder",
            "encoder_cache_tokens",
            "encoder_token_budget",
        ),
        defaults=ASSISTANT_ENGINE_DEFAULTS,
        notes={"gpu_memory_utilization": "the assistant's prompts are short: half the GPU is plenty"},
    )
    add_access_arguments(p)
    sub = p.add_subparsers(dest="assistant_command")
    add_import_commands(sub)
    add_mint_token_parser(sub)
    p.set_defaults(func=run)


def add_bank_arguments(p: argparse.ArgumentParser) -> None:
    """Which bank the assistant serves: the SQL database (``--db``, ``--demo``) or a bank's API."""
    g = p.add_argument_group("bank (docs/assistant.md, Bank backends)")
    # Resolved at run time, not here: `g4serve --help` must not create the cache directory.
    g.add_argument(
        "--db",
        default=None,
        metavar="PATH|URL",
        help="the bank's database: an SQLite file (default: "
        f"<cache>/assistant/{DEFAULT_DB_NAME}, <cache> being $G4SERVE_CACHE or ~/.cache/g4serve; "
        "':memory:' for a throwaway one), or postgresql://user@host/db for replicas on several hosts; "
        "created empty, migrated when older",
    )
    g.add_argument(
        "--demo",
        action="store_true",
        help="seed the two demo customers (cust-001, cust-002) into a new or demo database, and turn on "
        "/test-login; a database with imported customers refuses it",
    )
    g.add_argument(
        "--bank-url",
        default=None,
        metavar="URL",
        help="serve over a bank's REST API at URL (HTTPBank) instead of the --db database",
    )
    g.add_argument(
        "--bank-api-key-file",
        default=None,
        metavar="FILE",
        help=f"file holding the bearer key for --bank-url (or ${BANK_KEY_ENV})",
    )
    g.add_argument("--bank-timeout", type=float, default=5.0, help="seconds for each request to --bank-url")


def add_state_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("state (docs/assistant.md, State storage)")
    g.add_argument(
        "--state-db",
        default=None,
        metavar="URL",
        help="where sessions, pending confirmations and the audit trail live, shared by every replica: "
        "postgresql://user@host/db, or an SQLite file (a path or sqlite:///path). Default: --audit-db, "
        f"else ${STATE_DB_ENV}, else the --db database (with --bank-url, "
        f"<cache>/assistant/{DEFAULT_AUDIT_DB_NAME})",
    )


def add_import_commands(sub: argparse._SubParsersAction) -> None:
    """``import-customers``, ``import-cards`` and ``import-payees``: CSV files into the bank's database
    (SQLite or PostgreSQL), each validated whole and written in one transaction. A database with the demo
    customers refuses them."""
    for name, columns in (
        (
            "import-customers",
            "customer_id,name,account_id,account_name,currency,balance_minor: one row per account",
        ),
        ("import-cards", "customer_id,card_id,account_id,kind,network,last4"),
        ("import-payees", "payee_id,display_name,relationship[,kind][,aliases] of one customer"),
    ):
        imp = sub.add_parser(name, help=f"load a CSV ({columns}) into the database")
        imp.add_argument("csv")
        if name == "import-payees":
            imp.add_argument("--customer", required=True, metavar="ID", help="whose payees these are")
        # Own dest: argparse lets a subparser's default overwrite the parent's value of the same name.
        imp.add_argument(
            "--db",
            dest="import_db",
            default=None,
            metavar="PATH|URL",
            help="SQLite file or postgresql:// URL (default: as for the assistant)",
        )


def default_db_path() -> Path:
    """``<cache>/assistant/assistant.db``, its directory created: a bare ``g4serve assistant`` must not
    litter the working directory with the database and its SQLite ``-wal``/``-shm`` files."""
    from g4serve.tiny import cache_dir

    path = cache_dir() / "assistant" / DEFAULT_DB_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def resolve_db(path: str | None) -> str:
    """``--db`` as given (a path or a URL), else the default SQLite file in the cache directory."""
    return path if path is not None else str(default_db_path())


def open_bank(args: argparse.Namespace):
    """The ``BankBackend`` the flags name: an ``HTTPBank`` for ``--bank-url``, else the SQL database of
    ``--db`` (SQLite or PostgreSQL), seeded with the demo customers for ``--demo`` and nothing otherwise."""
    if args.bank_url is None:
        if args.bank_api_key_file is not None:
            raise ValueError("--bank-api-key-file: only with --bank-url")
        bank = open_database_bank(resolve_db(args.db), demo=args.demo)
        if not bank.customers():
            log.warning("%s has no customers: import some (import-customers) or start with --demo", bank.name)
        return bank
    if args.db is not None or args.demo:
        raise ValueError(
            "--bank-url: the bank is its API, so neither --db nor --demo (demo customers live in --db)"
        )
    from g4serve_assistant.access_cli import read_secret
    from g4serve_assistant.http_bank import HTTPBank

    key = read_secret(args.bank_api_key_file, BANK_KEY_ENV, "bank API key")
    bank = HTTPBank(
        args.bank_url, api_key=key.decode("ascii", "replace") if key else None, timeout_s=args.bank_timeout
    )
    log.info("bank API %s", bank.base_url)
    return bank


def open_database_bank(url: str, demo: bool = False):
    """The bank at ``url``, an SQLite path or a ``postgresql://`` URL (created or migrated); with ``demo``
    the demo customers are seeded (a ValueError when it holds imported ones)."""
    from g4serve_assistant.db import open_sql_bank

    bank = open_sql_bank(url)
    log.info("bank database %s", bank.name)  # the default lives in the cache directory: say where
    if demo:
        try:
            bank.seed_demo()
        except BaseException:
            bank.close()
            raise
        log.info("demo customers in %s", bank.name)
    return bank


def state_db_url(args: argparse.Namespace) -> str:
    """``--state-db``, else ``--audit-db`` (the state store keeps the audit trail), else
    $G4SERVE_ASSISTANT_DB, else the bank's database or a file in the cache (``audit_db_path``)."""
    if args.state_db is not None:
        if args.audit_db is not None:
            raise ValueError("--audit-db: the audit trail lives in --state-db; give one of them")
        return args.state_db
    if args.audit_db is None and os.environ.get(STATE_DB_ENV):
        return os.environ[STATE_DB_ENV]
    return audit_db_path(args)


def audit_db_path(args: argparse.Namespace) -> str:
    """``--audit-db``, else the bank's database (its own table there), else a file in the cache."""
    if args.audit_db is not None:
        return args.audit_db
    if args.bank_url is None:
        return resolve_db(args.db)
    return str(default_db_path().with_name(DEFAULT_AUDIT_DB_NAME))


def build_engine(args: argparse.Namespace):
    """The engine as ``g4serve serve`` builds it, text-only (the assistant sends no media to the model), or
    with the audio tower alone for ``--asr gemma`` (ValueError for a model without one)."""
    from g4serve.engine.async_engine import AsyncLLMEngine

    media: dict = {"text_only": True}
    if args.asr == "gemma":
        from g4serve_assistant.asr_gemma import audio_engine_options

        media = audio_engine_options(args.model)
    return AsyncLLMEngine.from_config(engine_config_from_args(args, model=args.model, **media))


def build_from_args(args: argparse.Namespace):
    """The app (separate from ``run`` so tests can build it in-process)."""
    from g4serve_assistant.access_cli import access_from_args
    from g4serve_assistant.app import build_app
    from g4serve_assistant.pipeline import Assistant
    from g4serve_assistant.state_sql import open_state_store

    if not 0.0 < args.intent_threshold <= 1.0:
        raise ValueError(f"--intent-threshold: must be in (0, 1], got {args.intent_threshold}")
    if args.asr == "gemma" and args.no_llm:
        raise ValueError("--asr gemma: the recogniser is the served model, so it cannot run with --no-llm")
    access, audit_key = access_from_args(args, demo=args.demo)
    bank = open_bank(args)
    state = open_state_store(state_db_url(args), audit_key=audit_key, session_ttl_s=access.session_ttl_s)
    log.info("sessions, confirmations and audit in %s", state.db.name)
    engine = None if args.no_llm else build_engine(args)
    assistant = Assistant(
        bank, engine, state=state, recognizer=args.asr, intent_threshold=args.intent_threshold
    )
    return build_app(assistant, access)


def run(args: argparse.Namespace) -> int:
    """The chosen command; ``MissingExtraError`` (a ``ValueError``) first when the extra is not installed."""
    require_extra()
    try:
        return _run(args)
    except ModuleNotFoundError as exc:  # found by name above, yet broken: still the extra's install to fix
        if (exc.name or "").partition(".")[0] in EXTRA_MODULES:
            raise MissingExtraError([exc.name]) from exc
        raise


def _run(args: argparse.Namespace) -> int:
    if args.assistant_command in IMPORTS:
        return import_csv(args.assistant_command, args.csv, resolve_db(args.import_db or args.db), args)
    if args.assistant_command == "mint-token":
        from g4serve_assistant.access_cli import mint_token

        return mint_token(args)
    import uvicorn

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    app = build_from_args(args)
    log.info("assistant on http://%s:%d (web page at /)", args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_keep_alive=30)
    return 0


IMPORTS = ("import-customers", "import-cards", "import-payees")


def import_csv(command: str, csv_path: str, db_url: str, args: argparse.Namespace) -> int:
    """One of ``IMPORTS`` into the bank's database at ``db_url`` (created when new, never seeded)."""
    if not Path(csv_path).is_file():
        raise FileNotFoundError(f"{csv_path}: no such file")
    bank = open_database_bank(db_url)
    try:
        if command == "import-customers":
            customers, accounts = bank.import_customers_csv(csv_path)
            what = f"{customers} customers with {accounts} accounts"
        elif command == "import-cards":
            what = f"{bank.import_cards_csv(csv_path)} cards"
        else:
            what = f"{bank.import_payees_csv(csv_path, args.customer)} payees of {args.customer}"
    finally:
        bank.close()
    print(f"imported {what} into {bank.name}")  # a URL's password not shown
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="g4serve-assistant",
        description="The voice banking assistant (HTTP, WebSocket, web page), as `g4serve assistant`.",
    )
    add_assistant_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The ``g4serve-assistant`` console script: errors in the input (and a missing extra) exit 2 with one
    line on stderr, as ``g4serve`` does."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"g4serve-assistant: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
