"""The two SQL databases the assistant's shared state and its bank live in, behind one small interface:
embedded SQLite (a file or ``:memory:``) and PostgreSQL (psycopg 3, imported only when a ``postgresql://``
URL is opened). Statements are written once with ``?`` placeholders in the SQL both dialects share."""

from __future__ import annotations

import os
import queue
import re
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

POSTGRES_SCHEMES = ("postgresql://", "postgres://")
SCHEMA_LOCK_KEY = 7204551  # the advisory lock every schema change in a PostgreSQL database takes
_SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")


class SQLExecutor(Protocol):
    """Statements inside one transaction."""

    # Appended to a SELECT whose rows the transaction goes on to change: PostgreSQL locks them (a second
    # transaction waits, then reads what the first wrote); SQLite's writer already holds the whole file.
    for_update: str

    def query(self, sql: str, args: Sequence[Any] = ()) -> list[dict[str, Any]]: ...

    def run(self, sql: str, args: Sequence[Any] = ()) -> int:
        """Executes a statement; the number of rows it changed."""

    def serialize(self, key: int) -> None:
        """Holds the lock named ``key`` until the transaction ends: transactions that take the same key run
        one after another, across replicas (a check-then-insert that no unique key guards). A no-op on
        SQLite, whose writers already take turns."""


class SQLDatabase(Protocol):
    dialect: str  # 'sqlite' | 'postgresql'
    name: str  # for messages: a path, or the URL without its password

    def transaction(self) -> AbstractContextManager[SQLExecutor]:
        """One transaction that writes: all of it or none of it, serialized against other writers where
        the dialect needs it (SQLite takes its write lock up front)."""

    def read(self) -> AbstractContextManager[SQLExecutor]:
        """A transaction that only reads, from one snapshot of the database, blocking no writer."""

    def create_schema(self, statements: Sequence[str]) -> None:
        """DDL in one transaction, safe when several replicas start at once."""

    def close(self) -> None: ...


def is_postgres_url(url: str) -> bool:
    return url.startswith(POSTGRES_SCHEMES)


def is_unique_violation(exc: BaseException) -> bool:
    """Whether ``exc`` is a statement refused for a duplicate in a unique key or index, on either dialect."""
    if isinstance(exc, sqlite3.IntegrityError):
        return str(exc).startswith("UNIQUE constraint failed")
    return getattr(exc, "sqlstate", None) == "23505"  # psycopg's UniqueViolation, without importing it


def open_database(url: str | os.PathLike) -> SQLDatabase:
    """``postgresql://…`` (or ``postgres://``) is a PostgreSQL server; ``sqlite:///path``, a plain path or
    ``:memory:`` an SQLite file."""
    text = str(url)
    if is_postgres_url(text):
        return PostgresDatabase(text)
    if text.startswith("sqlite:"):
        # As SQLAlchemy spells them: sqlite:///relative.db, sqlite:////absolute/path.db
        if not text.startswith("sqlite:///") or len(text) == len("sqlite:///"):
            raise ValueError(f"{url}: expected sqlite:///relative/path.db or sqlite:////absolute/path.db")
        text = text[len("sqlite:///") :]
    return SQLiteDatabase(text)


class _SQLiteExecutor:
    for_update = ""

    def __init__(self, conn: sqlite3.Connection):
        self.conn = conn

    def query(self, sql: str, args: Sequence[Any] = ()) -> list[dict[str, Any]]:
        return [dict(r) for r in self.conn.execute(sql, tuple(args)).fetchall()]

    def run(self, sql: str, args: Sequence[Any] = ()) -> int:
        return self.conn.execute(sql, tuple(args)).rowcount

    def serialize(self, key: int) -> None:
        pass  # BEGIN IMMEDIATE: this transaction is already the only writer


class SQLiteDatabase:
    """One connection behind a lock (sqlite3 objects are not thread-safe); several processes may open the
    same file, and ``BEGIN IMMEDIATE`` makes their writers take turns."""

    dialect = "sqlite"

    def __init__(self, path: str | os.PathLike = ":memory:", timeout_s: float = 30.0):
        self.path = self.name = str(path)
        # isolation_level=None: transactions are ours (BEGIN IMMEDIATE ... COMMIT), not the module's guesses.
        self.conn = sqlite3.connect(
            self.path, check_same_thread=False, isolation_level=None, timeout=timeout_s
        )
        self.conn.row_factory = sqlite3.Row
        self._lock = threading.RLock()
        if self.path != ":memory:":
            with self._lock:
                self.conn.execute("PRAGMA journal_mode=WAL")

    @contextmanager
    def transaction(self) -> Iterator[SQLExecutor]:
        with self._lock:
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                yield _SQLiteExecutor(self.conn)
                self.conn.execute("COMMIT")
            except BaseException:
                if self.conn.in_transaction:
                    self.conn.execute("ROLLBACK")
                raise

    @contextmanager
    def read(self) -> Iterator[SQLExecutor]:
        # A deferred BEGIN takes no write lock: in WAL mode it reads one snapshot while others write.
        with self._lock:
            self.conn.execute("BEGIN")
            try:
                yield _SQLiteExecutor(self.conn)
            finally:
                if self.conn.in_transaction:
                    self.conn.execute("COMMIT")

    def create_schema(self, statements: Sequence[str]) -> None:
        with self.transaction() as tx:
            for statement in statements:
                tx.run(statement)

    def close(self) -> None:
        with self._lock:
            self.conn.close()


class _PostgresExecutor:
    for_update = " FOR UPDATE"

    def __init__(self, conn: Any):
        self.conn = conn

    def query(self, sql: str, args: Sequence[Any] = ()) -> list[dict[str, Any]]:
        cur = self.conn.execute(_pg(sql), tuple(args) if args else None)
        return list(cur.fetchall()) if cur.description else []

    def run(self, sql: str, args: Sequence[Any] = ()) -> int:
        return self.conn.execute(_pg(sql), tuple(args) if args else None).rowcount

    def serialize(self, key: int) -> None:
        self.conn.execute("SELECT pg_advisory_xact_lock(%s)", (key,))


def _pg(sql: str) -> str:
    # Our statements hold no '?' or '%' of their own: every '?' is a parameter.
    return sql.replace("?", "%s")


class PostgresDatabase:
    """A small pool of autocommit connections (one per concurrent transaction, at most
    ``max_connections``); each ``transaction()`` is a real server transaction on one of them, at READ
    COMMITTED: the callers make their races safe with conditional UPDATEs and explicit locks.
    ``schema``: a schema of its own (created if missing) as the search path, e.g. one per test."""

    dialect = "postgresql"

    def __init__(self, url: str, *, schema: str | None = None, max_connections: int = 8):
        import psycopg  # the assistant extra's; only a PostgreSQL deployment needs it
        from psycopg.rows import dict_row

        if schema is not None and not _SCHEMA_NAME.fullmatch(schema):
            raise ValueError(f"schema {schema!r}: lower-case letters, digits and _ only")
        self._psycopg = psycopg
        self._connect_kwargs: dict[str, Any] = {"autocommit": True, "row_factory": dict_row}
        if schema is not None:
            self._connect_kwargs["options"] = f"-c search_path={schema}"
        self.url = url
        self.name = re.sub(r"//([^:/@]*):[^@/]*@", r"//\1:***@", url)  # never log the password
        self.schema = schema
        self._idle: queue.LifoQueue = queue.LifoQueue()
        self._slots = threading.BoundedSemaphore(max_connections)
        self._closed = False
        if schema is not None:
            with self._connection() as conn:
                conn.execute(f"CREATE SCHEMA IF NOT EXISTS {schema}")

    @contextmanager
    def _connection(self) -> Iterator[Any]:
        if self._closed:
            raise RuntimeError(f"{self.name}: closed")
        with self._slots:
            try:
                conn = self._idle.get_nowait()
            except queue.Empty:
                conn = None
            if conn is None or conn.closed:
                conn = self._psycopg.connect(self.url, **self._connect_kwargs)
            try:
                yield conn
            finally:
                if conn.broken or conn.closed or self._closed:
                    conn.close()
                else:
                    self._idle.put(conn)

    @contextmanager
    def transaction(self) -> Iterator[SQLExecutor]:
        with self._connection() as conn, conn.transaction():
            yield _PostgresExecutor(conn)

    @contextmanager
    def read(self) -> Iterator[SQLExecutor]:
        with self._connection() as conn, conn.transaction():
            # One snapshot for all its statements (READ COMMITTED would take a new one for each).
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            yield _PostgresExecutor(conn)

    def create_schema(self, statements: Sequence[str]) -> None:
        with self.transaction() as tx:
            # CREATE ... IF NOT EXISTS is not safe against itself: two replicas starting at once could both
            # try to create a table. One at a time, across the whole server.
            tx.serialize(SCHEMA_LOCK_KEY)
            for statement in statements:
                tx.run(statement)

    def close(self) -> None:
        self._closed = True
        while True:
            try:
                self._idle.get_nowait().close()
            except queue.Empty:
                return
