"""The assistant's audit trail: every attempt (accepted or rejected) with customer, client and outcome, in an
append-only table (SQLite or PostgreSQL) where each row carries a keyed hash of the one before it, so any edit
shows. Replicas sharing one database append to one chain."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from g4serve_assistant.sql import SQLDatabase, SQLiteDatabase, open_database

GENESIS = "0" * 64
MAX_DETAIL_CHARS = 64 << 10  # one row's detail; a larger one is cut (and says so), never dropped

_SQLITE_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS audit_chain (
    seq INTEGER PRIMARY KEY, ts REAL NOT NULL, customer_id TEXT, session_id TEXT, client TEXT NOT NULL,
    stage TEXT NOT NULL, event TEXT NOT NULL, outcome TEXT, detail TEXT NOT NULL,
    prev_hash TEXT NOT NULL, hash TEXT NOT NULL UNIQUE)""",
    "CREATE INDEX IF NOT EXISTS audit_chain_by_session ON audit_chain (customer_id, session_id, seq)",
    """CREATE TRIGGER IF NOT EXISTS audit_chain_no_update BEFORE UPDATE ON audit_chain
    BEGIN SELECT RAISE(ABORT, 'audit_chain is append-only'); END""",
    """CREATE TRIGGER IF NOT EXISTS audit_chain_no_delete BEFORE DELETE ON audit_chain
    BEGIN SELECT RAISE(ABORT, 'audit_chain is append-only'); END""",
)
_POSTGRES_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS audit_chain (
    seq BIGINT PRIMARY KEY, ts DOUBLE PRECISION NOT NULL, customer_id TEXT, session_id TEXT,
    client TEXT NOT NULL, stage TEXT NOT NULL, event TEXT NOT NULL, outcome TEXT, detail TEXT NOT NULL,
    prev_hash TEXT NOT NULL, hash TEXT NOT NULL UNIQUE)""",
    "CREATE INDEX IF NOT EXISTS audit_chain_by_session ON audit_chain (customer_id, session_id, seq)",
    """CREATE OR REPLACE FUNCTION audit_chain_append_only() RETURNS trigger LANGUAGE plpgsql AS
    $$ BEGIN RAISE EXCEPTION 'audit_chain is append-only'; END $$""",
    """CREATE OR REPLACE TRIGGER audit_chain_no_change BEFORE UPDATE OR DELETE ON audit_chain
    FOR EACH ROW EXECUTE FUNCTION audit_chain_append_only()""",
    """CREATE OR REPLACE TRIGGER audit_chain_no_truncate BEFORE TRUNCATE ON audit_chain
    FOR EACH STATEMENT EXECUTE FUNCTION audit_chain_append_only()""",
)
_VERIFY_BATCH = 5000  # rows read at a time while verifying: the chain may outgrow memory
_FIELDS = ("seq", "ts", "customer_id", "session_id", "client", "stage", "event", "outcome", "detail")


@dataclass(frozen=True)
class AuditRow:
    """One event of an attempt: ``stage`` (http, asr, normalize, intent, lookup, llm, policy, execution,
    turn, qna, auth), ``event`` within it, and the attempt's ``outcome`` when the row settles it."""

    stage: str
    event: str
    detail: dict
    outcome: str | None = None


@dataclass(frozen=True)
class ChainCheck:
    ok: bool
    rows: int
    first_bad_seq: int | None = None
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "rows": self.rows, "first_bad_seq": self.first_bad_seq, "reason": self.reason}


class AuditLog:
    """Append-only audit rows. ``key`` makes the chain an HMAC chain: whoever can write the file but lacks
    the key cannot rewrite a suffix of it and recompute hashes that verify. Without a key it is a plain
    SHA-256 chain (tampering with one row shows; a rewrite of the whole suffix does not)."""

    def __init__(self, path: str | os.PathLike | SQLDatabase = ":memory:", key: bytes | None = None):
        """``path``: an SQLite file (or ``:memory:``), a ``postgresql://`` URL, or an open database (the
        state store's, shared with its sessions)."""
        self.db = path if hasattr(path, "transaction") else open_database(path)
        self.path = self.db.name
        self._key = key
        self.db.create_schema(_POSTGRES_SCHEMA if self.db.dialect == "postgresql" else _SQLITE_SCHEMA)

    @property
    def _conn(self):
        """The SQLite connection (tests poke the table directly)."""
        assert isinstance(self.db, SQLiteDatabase)
        return self.db.conn

    def close(self) -> None:
        self.db.close()

    def _digest(self, prev_hash: str, fields: tuple) -> str:
        message = prev_hash.encode() + json.dumps(fields, separators=(",", ":"), ensure_ascii=True).encode()
        if self._key is not None:
            return hmac.new(self._key, message, hashlib.sha256).hexdigest()
        return hashlib.sha256(message).hexdigest()

    def append(
        self,
        rows: Iterable[AuditRow],
        *,
        customer_id: str | None,
        session_id: str | None,
        client: dict | None,
    ) -> list[int]:
        """Appends the rows of one attempt in one transaction; returns their sequence numbers."""
        rows = list(rows)
        if not rows:
            return []
        client_json = _dumps(client or {})
        now = time.time()
        with self.db.transaction() as tx:
            if self.db.dialect == "postgresql":
                # The chain's head must not move under us (SQLite's BEGIN IMMEDIATE already holds its one
                # write lock). Readers are not blocked: EXCLUSIVE mode still allows SELECT.
                tx.run("LOCK TABLE audit_chain IN EXCLUSIVE MODE")
            head = tx.query("SELECT seq, hash FROM audit_chain ORDER BY seq DESC LIMIT 1")
            seq, prev = (head[0]["seq"], head[0]["hash"]) if head else (0, GENESIS)
            written = []
            for row in rows:
                seq += 1
                fields = (
                    seq,
                    now,
                    customer_id,
                    session_id,
                    client_json,
                    row.stage,
                    row.event,
                    row.outcome,
                    _dumps(row.detail),
                )
                digest = self._digest(prev, fields)
                tx.run(
                    "INSERT INTO audit_chain (seq, ts, customer_id, session_id, client, stage, event, "
                    "outcome, detail, prev_hash, hash) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (*fields, prev, digest),
                )
                written.append(seq)
                prev = digest
        return written

    def entries(
        self, customer_id: str | None = None, session_id: str | None = None, limit: int | None = None
    ) -> list[dict]:
        """Rows oldest first (the newest ``limit`` of them), filtered by customer and session."""
        where, args = [], []
        if customer_id is not None:
            where.append("customer_id = ?")
            args.append(customer_id)
        if session_id is not None:
            where.append("session_id = ?")
            args.append(session_id)
        sql = "SELECT * FROM audit_chain" + (" WHERE " + " AND ".join(where) if where else "")
        sql += " ORDER BY seq DESC"
        if limit is not None:
            sql += " LIMIT ?"
            args.append(int(limit))
        with self.db.transaction() as tx:
            rows = tx.query(sql, args)
        return [_entry(r) for r in reversed(rows)]

    def head(self) -> tuple[int, str]:
        """``(seq, hash)`` of the newest row: publish it elsewhere to anchor the chain."""
        with self.db.transaction() as tx:
            rows = tx.query("SELECT seq, hash FROM audit_chain ORDER BY seq DESC LIMIT 1")
        return (rows[0]["seq"], rows[0]["hash"]) if rows else (0, GENESIS)

    def verify(self) -> ChainCheck:
        """Walks the whole chain: sequence without gaps, each row's prev_hash the hash before, each hash
        recomputed from the row's fields."""
        prev, expected_seq, n = GENESIS, 1, 0
        while True:
            with self.db.transaction() as tx:
                batch = tx.query(
                    "SELECT * FROM audit_chain WHERE seq >= ? ORDER BY seq LIMIT ?",
                    (expected_seq, _VERIFY_BATCH),
                )
            for r in batch:
                n += 1
                if r["seq"] != expected_seq:
                    return ChainCheck(False, n, r["seq"], f"sequence gap: expected {expected_seq}")
                if r["prev_hash"] != prev:
                    return ChainCheck(False, n, r["seq"], "prev_hash is not the previous row's hash")
                fields = tuple(r[f] for f in _FIELDS)
                if not hmac.compare_digest(self._digest(prev, fields), r["hash"]):
                    return ChainCheck(False, n, r["seq"], "hash does not match the row")
                prev, expected_seq = r["hash"], expected_seq + 1
            if len(batch) < _VERIFY_BATCH:
                return ChainCheck(True, n)


def _dumps(value: Any) -> str:
    # ensure_ascii: a lone surrogate (or any odd code point) is stored escaped, and reads back as it came.
    text = json.dumps(value, default=str, sort_keys=True, ensure_ascii=True)
    if len(text) > MAX_DETAIL_CHARS:
        text = json.dumps({"truncated": True, "chars": len(text), "head": text[: MAX_DETAIL_CHARS // 2]})
    return text


def _entry(r: dict) -> dict:
    return {
        "seq": r["seq"],
        "ts": r["ts"],
        "customer_id": r["customer_id"],
        "session_id": r["session_id"],
        "client": json.loads(r["client"]),
        "stage": r["stage"],
        "event": r["event"],
        "outcome": r["outcome"],
        "detail": json.loads(r["detail"]),
        "hash": r["hash"],
    }
