"""Fixtures of the assistant's tests on both SQL databases: one throwaway PostgreSQL server for the session
(postgres_server.py), a schema of each test's own in it, and ``bank_replicas``, banks on SQLite and on
PostgreSQL for the tests that hold for both, and ``state_replicas``, the conversation store the same way."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from postgres_server import SKIP_REASON, PostgresServer, find_pg_bin

REQUIRE_POSTGRES_ENV = "G4SERVE_REQUIRE_POSTGRES"


@pytest.fixture(scope="session")
def postgres_url():
    """One throwaway server for the whole test session (about a second to start); each test gets its own
    schema in it (``postgres_schema``)."""

    # CI installs postgresql and sets G4SERVE_REQUIRE_POSTGRES=1, so that a server that cannot be had fails
    # the tests instead of skipping them.
    def unavailable(reason: str) -> None:
        if os.environ.get(REQUIRE_POSTGRES_ENV) == "1":
            pytest.fail(f"{REQUIRE_POSTGRES_ENV}=1: {reason}")
        pytest.skip(reason)

    try:
        import psycopg  # noqa: F401
    except ImportError:
        unavailable("PostgreSQL tests need psycopg: pip install 'psycopg[binary]'")
    bin_dir = find_pg_bin()
    if bin_dir is None:
        unavailable(SKIP_REASON)
    server = PostgresServer(bin_dir).start()
    yield server.url
    server.stop()


@pytest.fixture
def postgres_schema(postgres_url):
    """A schema of this test's own in the server, dropped after it (the fixtures that open connections to
    it close them first: they depend on this one, so pytest tears them down before it)."""
    import psycopg

    schema = f"t_{uuid.uuid4().hex[:16]}"
    yield schema
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


class BankOpener:
    """``opener(demo=False)``: one more bank over the same database (``open_bank()``), seeded with the demo
    customers when ``demo`` (a second replica seeds the same rows again: seeding is idempotent); ``close()``
    closes them all."""

    def __init__(self, open_bank: Callable[[], Any]):
        self.open_bank = open_bank
        self.opened: list = []

    def __call__(self, demo: bool = False):
        bank = self.open_bank()
        self.opened.append(bank)
        if demo:
            bank.seed_demo()
        return bank

    def close(self) -> None:
        for bank in self.opened:
            bank.close()


@pytest.fixture
def postgres_banks(postgres_url, postgres_schema):
    """``postgres_banks(demo=False)``: one more ``PostgresBank`` on this test's schema."""
    from g4serve_assistant.bank_postgres import PostgresBank

    opener = BankOpener(lambda: PostgresBank(postgres_url, schema=postgres_schema))
    yield opener
    opener.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def bank_replicas(request, tmp_path):
    """``bank_replicas(demo=False)`` opens one more replica's bank over one database of the engine under
    test: an SQLite file, or a PostgreSQL schema of this test's own."""
    if request.param == "postgresql":
        yield request.getfixturevalue("postgres_banks")
        return
    from g4serve_assistant.db import SQLiteBank

    opener = BankOpener(lambda: SQLiteBank(tmp_path / "bank.db"))
    yield opener
    opener.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def state_replicas(request, tmp_path):
    """``state_replicas(**kwargs)`` opens one more replica's conversation store (``SQLStateStore``) over one
    database of the engine under test, as ``bank_replicas`` does banks."""
    from g4serve_assistant.state_sql import SQLStateStore

    if request.param == "sqlite":
        from g4serve_assistant.sql import SQLiteDatabase

        def database():
            return SQLiteDatabase(tmp_path / "state.db")
    else:
        from g4serve_assistant.sql import PostgresDatabase

        url, schema = request.getfixturevalue("postgres_url"), request.getfixturevalue("postgres_schema")

        def database():
            return PostgresDatabase(url, schema=schema)

    opened: list[SQLStateStore] = []

    def open_replica(**kwargs) -> SQLStateStore:
        store = SQLStateStore(database(), **kwargs)
        opened.append(store)
        return store

    yield open_replica
    for store in opened:
        store.close()
