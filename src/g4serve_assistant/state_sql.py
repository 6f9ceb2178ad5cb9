"""``SQLStateStore``: the assistant's sessions, dialogue states, pending confirmations and audit trail in one
SQL database (sql.py: SQLite or PostgreSQL) that every replica shares.

Why it is safe across replicas: a turn holds its session by a lease (a conditional UPDATE on the session's
row, so one turn at a time per session, whichever replica runs it), and a confirmation executes only after
it moved its action from 'waiting' to 'executing' with another conditional UPDATE: of two replicas that
confirm one action, exactly one changes the row, and only that one moves money. A proposal past its
confirmation window is the sweeper's (sweeper.py): it holds the row the same way before it cancels the
transfer, so a late yes and the cancellation cannot both win, and the rows it still owes the bank outlive
any replica."""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Callable

from g4serve_assistant.audit import AuditLog
from g4serve_assistant.auth import AuthError, Session
from g4serve_assistant.policy import PendingAction, SessionState, StaleAction
from g4serve_assistant.sql import SQLDatabase, SQLExecutor, open_database
from g4serve_assistant.state import SessionBusyError, pending_from_json, pending_to_json

STATE_SCHEMA_VERSION = 1
_SESSION_ID_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
MAX_SESSION_ID_CHARS = 128
# A proposal owed its cancellation (its arguments: the newest created_at that is past the confirmation window,
# and now): one with a transfer, past its window, unsettled and not held, by a live claim or another
# sweeper. A lapsed claim is owed too: its replica died mid-execution (the bank's cancel is a no-op if the
# money moved).
_OWED = (
    "transfer_id IS NOT NULL AND created_at < ? AND status IN ('waiting', 'executing') "
    "AND (claimed_until IS NULL OR claimed_until < ?)"
)

# The SQL both dialects accept (SQLite reads DOUBLE PRECISION as REAL).
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS assistant_state_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    """CREATE TABLE IF NOT EXISTS assistant_sessions (
    session_id TEXT PRIMARY KEY, customer_id TEXT NOT NULL, created_at DOUBLE PRECISION NOT NULL,
    expires_at DOUBLE PRECISION NOT NULL, client TEXT NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS assistant_sessions_by_customer "
    "ON assistant_sessions (customer_id, created_at)",
    "CREATE INDEX IF NOT EXISTS assistant_sessions_by_expiry ON assistant_sessions (expires_at)",
    # One row per session that has had a turn: its dialogue state, and the lease of the turn running now.
    """CREATE TABLE IF NOT EXISTS assistant_conversations (
    session_id TEXT PRIMARY KEY, customer_id TEXT NOT NULL, turns INTEGER NOT NULL DEFAULT 0, pending TEXT,
    lease_owner TEXT, lease_until DOUBLE PRECISION, updated_at DOUBLE PRECISION NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS assistant_conversations_by_age ON assistant_conversations (updated_at)",
    # Each proposal awaiting a yes, by its action id: the row a confirmation must win before it executes.
    """CREATE TABLE IF NOT EXISTS assistant_pending_actions (
    action_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, customer_id TEXT NOT NULL, kind TEXT NOT NULL,
    transfer_id TEXT, created_at DOUBLE PRECISION NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('waiting', 'executing', 'done', 'dropped')),
    claimed_until DOUBLE PRECISION, updated_at DOUBLE PRECISION NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS assistant_pending_by_session "
    "ON assistant_pending_actions (session_id, status)",
    "CREATE INDEX IF NOT EXISTS assistant_pending_by_age ON assistant_pending_actions (updated_at)",
    "INSERT INTO assistant_state_meta (key, value) VALUES ('schema_version', '1') "
    "ON CONFLICT (key) DO NOTHING",
)


class SQLStateStore:
    """Sessions (``sessions``), dialogue states and confirmations (``conversations``) and the audit chain
    (``audit``) in one database. ``lease_s``: how long a turn may hold its session before another replica
    may take it over (a replica that died mid-turn blocks its session no longer than that)."""

    def __init__(
        self,
        db: SQLDatabase,
        *,
        audit_key: bytes | None = None,
        session_ttl_s: float = 3600.0,
        max_per_customer: int = 32,
        lease_s: float = 30.0,
        lease_wait_s: float = 15.0,
        clock: Callable[[], float] = time.time,
    ):
        self.db = db
        db.create_schema(_SCHEMA)
        with db.transaction() as tx:
            found = int(
                tx.query("SELECT value FROM assistant_state_meta WHERE key = 'schema_version'")[0]["value"]
            )
        if found > STATE_SCHEMA_VERSION:
            raise ValueError(
                f"{db.name}: assistant state schema {found} is newer than this code's "
                f"{STATE_SCHEMA_VERSION}; upgrade g4serve or use another database"
            )
        self.audit = AuditLog(db, key=audit_key)
        self.conversations = SQLConversationStore(
            db, lease_s=lease_s, lease_wait_s=lease_wait_s, retention_s=session_ttl_s, clock=clock
        )
        self.sessions = SQLSessionRegistry(
            db, ttl_s=session_ttl_s, max_per_customer=max_per_customer, clock=clock, on_create=self.purge
        )

    def purge(self) -> None:
        """Forgets what no live session can reach: states and actions idle for a whole session lifetime."""
        self.conversations.purge()

    def close(self) -> None:
        self.db.close()


class SQLSessionRegistry:
    """``auth.SessionRegistry`` in the database: 256-bit random ids bound to one customer, absolute expiry,
    the oldest of a customer's sessions ended beyond ``max_per_customer``."""

    def __init__(
        self,
        db: SQLDatabase,
        ttl_s: float = 3600.0,
        max_per_customer: int = 32,
        clock: Callable[[], float] = time.time,
        on_create: Callable[[], None] | None = None,
    ):
        self.db = db
        self.ttl_s = ttl_s
        self.max_per_customer = max_per_customer
        self.clock = clock
        self._on_create = on_create

    def create(self, customer_id: str, client: dict | None = None) -> Session:
        now = self.clock()
        session = Session(secrets.token_urlsafe(32), customer_id, now, now + self.ttl_s, dict(client or {}))
        with self.db.transaction() as tx:
            tx.run("DELETE FROM assistant_sessions WHERE expires_at <= ?", (now,))
            mine = tx.query(
                "SELECT session_id FROM assistant_sessions WHERE customer_id = ? "
                "ORDER BY created_at, session_id",
                (customer_id,),
            )
            for old in mine[: max(0, len(mine) - self.max_per_customer + 1)]:  # oldest of this customer go
                tx.run("DELETE FROM assistant_sessions WHERE session_id = ?", (old["session_id"],))
            tx.run(
                "INSERT INTO assistant_sessions (session_id, customer_id, created_at, expires_at, client) "
                "VALUES (?, ?, ?, ?, ?)",
                (
                    session.session_id,
                    customer_id,
                    now,
                    session.expires_at,
                    json.dumps(session.client, default=str, ensure_ascii=True),
                ),
            )
        if self._on_create is not None:
            self._on_create()
        return session

    def get(self, session_id: object, customer_id: str) -> Session:
        """The live session of this customer; one error for unknown, expired, another customer's and
        malformed ids (a malformed one never reaches the database)."""
        refused = AuthError(
            403, "session_id: no such session for this customer (or it expired)", "session_id"
        )
        if not _well_formed(session_id):
            raise refused
        with self.db.transaction() as tx:
            rows = tx.query("SELECT * FROM assistant_sessions WHERE session_id = ?", (session_id,))
        if not rows or rows[0]["customer_id"] != customer_id or rows[0]["expires_at"] <= self.clock():
            raise refused
        r = rows[0]
        return Session(
            r["session_id"], r["customer_id"], r["created_at"], r["expires_at"], json.loads(r["client"])
        )

    def end(self, session_id: str, customer_id: str) -> bool:
        if not _well_formed(session_id):
            return False
        with self.db.transaction() as tx:
            return (
                tx.run(
                    "DELETE FROM assistant_sessions WHERE session_id = ? AND customer_id = ?",
                    (session_id, customer_id),
                )
                > 0
            )

    def __len__(self) -> int:
        with self.db.transaction() as tx:
            rows = tx.query(
                "SELECT COUNT(*) AS n FROM assistant_sessions WHERE expires_at > ?", (self.clock(),)
            )
        return int(rows[0]["n"])


class SQLConversationStore:
    """Dialogue states under per-session leases, and the pending actions' claims (``ConversationStore``)."""

    def __init__(
        self,
        db: SQLDatabase,
        *,
        lease_s: float = 30.0,
        lease_wait_s: float = 15.0,
        retention_s: float = 3600.0,
        claim_lease_s: float = 60.0,
        clock: Callable[[], float] = time.time,
    ):
        self.db = db
        self.lease_s = lease_s
        self.lease_wait_s = lease_wait_s
        self.retention_s = retention_s
        # A claim of a replica that died before settling lapses after this, so the customer's retried yes can
        # claim again; the bank's idempotency key (the action id) keeps that from paying twice.
        self.claim_lease_s = claim_lease_s
        self.clock = clock

    # --- a turn's hold on its session -------------------------------------------------------------------
    def begin(self, session_id: str, customer_id: str) -> SessionState:
        lease = secrets.token_hex(12)
        deadline = time.monotonic() + self.lease_wait_s
        delay = 0.005
        while True:
            with self.db.transaction() as tx:
                now = self.clock()
                tx.run(
                    "INSERT INTO assistant_conversations (session_id, customer_id, updated_at) "
                    "VALUES (?, ?, ?) ON CONFLICT (session_id) DO NOTHING",
                    (session_id, customer_id, now),
                )
                held = tx.run(
                    "UPDATE assistant_conversations SET lease_owner = ?, lease_until = ? "
                    "WHERE session_id = ? AND customer_id = ? AND (lease_owner IS NULL OR lease_until < ?)",
                    (lease, now + self.lease_s, session_id, customer_id, now),
                )
                row = tx.query(
                    "SELECT customer_id, turns, pending FROM assistant_conversations WHERE session_id = ?",
                    (session_id,),
                )[0]
            if row["customer_id"] != customer_id:
                raise PermissionError(f"session {session_id} belongs to another customer")
            if held:
                return SessionState(
                    session_id, customer_id, pending_from_json(row["pending"]), row["turns"], lease=lease
                )
            if time.monotonic() > deadline:
                raise SessionBusyError(f"session {session_id}: another turn is still running")
            time.sleep(delay)
            delay = min(delay * 2, 0.1)

    def commit(self, state: SessionState) -> bool:
        pending = state.pending
        confirm = pending if pending is not None and pending.awaiting == "confirmation" else None
        with self.db.transaction() as tx:
            now = self.clock()
            written = tx.run(
                "UPDATE assistant_conversations SET turns = ?, pending = ?, lease_owner = NULL, "
                "lease_until = NULL, updated_at = ? WHERE session_id = ? AND lease_owner = ?",
                (state.turns, pending_to_json(pending), now, state.session_id, state.lease),
            )
            if written:
                # A proposal replaced, cancelled or expired in this turn can never be claimed again. One a
                # sweeper holds stays the sweeper's to settle: it may not have reached the bank yet.
                tx.run(
                    "UPDATE assistant_pending_actions SET status = 'dropped', updated_at = ? "
                    "WHERE session_id = ? AND status = 'waiting' AND claimed_until IS NULL "
                    "AND action_id <> ?",
                    (now, state.session_id, confirm.action_id if confirm else ""),
                )
                if confirm is not None:
                    tx.run(
                        "INSERT INTO assistant_pending_actions (action_id, session_id, customer_id, kind, "
                        "transfer_id, created_at, status, updated_at) "
                        "VALUES (?, ?, ?, ?, ?, ?, 'waiting', ?) ON CONFLICT (action_id) DO NOTHING",
                        (
                            confirm.action_id,
                            state.session_id,
                            state.customer_id,
                            confirm.kind,
                            confirm.transfer_id,
                            confirm.created_at,
                            now,
                        ),
                    )
        state.lease = None
        return bool(written)

    def release(self, state: SessionState) -> None:
        if state.lease is None:
            return
        with self.db.transaction() as tx:
            tx.run(
                "UPDATE assistant_conversations SET lease_owner = NULL, lease_until = NULL "
                "WHERE session_id = ? AND lease_owner = ?",
                (state.session_id, state.lease),
            )
        state.lease = None

    def drop(self, session_id: str) -> None:
        with self.db.transaction() as tx:
            tx.run("DELETE FROM assistant_conversations WHERE session_id = ?", (session_id,))
            tx.run(
                "UPDATE assistant_pending_actions SET status = 'dropped', updated_at = ? "
                "WHERE session_id = ? AND status = 'waiting' AND claimed_until IS NULL",
                (self.clock(), session_id),
            )

    # --- a confirmation's one execution -----------------------------------------------------------------
    def claim(self, state: SessionState, pending: PendingAction, now: float, ttl_s: float) -> bool:
        """The conditional UPDATE that exactly one confirmation of an action wins: the action must be this
        session's and this customer's, waiting (or claimed by a replica whose claim lapsed), and younger than
        ``ttl_s`` on the policy's clock ``now``."""
        with self.db.transaction() as tx:
            wall = self.clock()
            return (
                tx.run(
                    "UPDATE assistant_pending_actions SET status = 'executing', claimed_until = ?, "
                    "updated_at = ? WHERE action_id = ? AND session_id = ? AND customer_id = ? "
                    "AND created_at > ? AND ((status = 'waiting' AND claimed_until IS NULL) "
                    "OR (status = 'executing' AND claimed_until < ?))",
                    (
                        wall + self.claim_lease_s,
                        wall,
                        pending.action_id,
                        state.session_id,
                        state.customer_id,
                        now - ttl_s,
                        wall,
                    ),
                )
                == 1
            )

    def settle(self, state: SessionState, pending: PendingAction, done: bool) -> None:
        with self.db.transaction() as tx:
            tx.run(
                "UPDATE assistant_pending_actions SET status = ?, claimed_until = NULL, updated_at = ? "
                "WHERE action_id = ? AND status = 'executing'",
                ("done" if done else "waiting", self.clock(), pending.action_id),
            )

    def action_status(self, action_id: str) -> str | None:
        """'waiting', 'executing', 'done' or 'dropped'; None for an action never proposed here."""
        with self.db.transaction() as tx:
            rows = tx.query("SELECT status FROM assistant_pending_actions WHERE action_id = ?", (action_id,))
        return rows[0]["status"] if rows else None

    # --- the proposals no yes can reach any more (sweeper.py) -------------------------------------------
    def stale(self, now: float, ttl_s: float, retry_s: float, limit: int) -> list[StaleAction]:
        """The proposals owed a cancellation, each held (``claimed_until``: a claim's condition fails on it,
        and so does another sweeper's ``stale``) for ``retry_s``; the owed rows are the queue, so a restart
        loses none of them."""
        taken = []
        with self.db.transaction() as tx:
            wall = self.clock()
            owed = (now - ttl_s, wall)
            rows = tx.query(
                "SELECT action_id, session_id, customer_id, kind, transfer_id "
                f"FROM assistant_pending_actions WHERE {_OWED} ORDER BY created_at LIMIT ?",
                (*owed, limit),
            )
            for r in rows:
                held = tx.run(
                    "UPDATE assistant_pending_actions SET claimed_until = ?, updated_at = ? "
                    f"WHERE action_id = ? AND {_OWED}",
                    (wall + retry_s, wall, r["action_id"], *owed),
                )
                if held:
                    _forget_proposal(tx, r["session_id"], r["action_id"], wall)
                    taken.append(
                        StaleAction(
                            r["customer_id"],
                            r["session_id"],
                            r["action_id"],
                            r["kind"],
                            r["transfer_id"],
                            "expired",
                        )
                    )
        return taken

    def cancelled(self, action: StaleAction) -> bool:
        with self.db.transaction() as tx:
            return (
                tx.run(
                    "UPDATE assistant_pending_actions SET status = 'dropped', claimed_until = NULL, "
                    "updated_at = ? WHERE action_id = ? AND status IN ('waiting', 'executing')",
                    (self.clock(), action.action_id),
                )
                == 1
            )

    def purge(self) -> None:
        """Forgets the states and settled actions idle for ``retention_s``; never a transfer still owed its
        cancellation (the sweeper's queue)."""
        cutoff = self.clock() - self.retention_s
        with self.db.transaction() as tx:
            tx.run(
                "DELETE FROM assistant_conversations WHERE updated_at < ? "
                "AND (lease_owner IS NULL OR lease_until < ?)",
                (cutoff, self.clock()),
            )
            tx.run(
                "DELETE FROM assistant_pending_actions WHERE updated_at < ? "
                "AND (status IN ('done', 'dropped') OR (status = 'waiting' AND transfer_id IS NULL))",
                (cutoff,),
            )


def _forget_proposal(tx: SQLExecutor, session_id: str, action_id: str, now: float) -> None:
    """Takes a swept proposal out of its dialogue state, so the session's next turn finds nothing to confirm
    (nor to cancel again); a lapsed lease goes with it, as a turn that outlived it may not write back. A turn
    holding the session now keeps its state: it expires the proposal itself (the bank's cancel is a no-op the
    second time)."""
    rows = tx.query("SELECT pending FROM assistant_conversations WHERE session_id = ?", (session_id,))
    text = rows[0]["pending"] if rows else None
    if text is not None and pending_from_json(text).action_id == action_id:
        tx.run(
            "UPDATE assistant_conversations SET pending = NULL, lease_owner = NULL, lease_until = NULL "
            "WHERE session_id = ? AND pending = ? AND (lease_owner IS NULL OR lease_until < ?)",
            (session_id, text, now),
        )


def _well_formed(session_id: object) -> bool:
    # Server-issued ids are URL-safe base64; anything else (a NUL, a lone surrogate) is refused here, as
    # PostgreSQL would refuse to even compare it.
    return (
        isinstance(session_id, str)
        and 0 < len(session_id) <= MAX_SESSION_ID_CHARS
        and set(session_id) <= _SESSION_ID_CHARS
    )


def open_state_store(
    url: str | os.PathLike, *, audit_key: bytes | None = None, session_ttl_s: float = 3600.0
) -> SQLStateStore:
    """The shared store at ``url``: a ``postgresql://`` URL, or an SQLite file (``sqlite:///path`` or a
    plain path; ``:memory:`` for a throwaway one)."""
    return SQLStateStore(open_database(url), audit_key=audit_key, session_ttl_s=session_ttl_s)
