"""Where the assistant keeps what outlives one request: customer sessions, each session's dialogue state with
its pending confirmation, and the audit trail. ``StateStore`` is the interface: in memory for one process
(auth.SessionRegistry, policy.SessionStore) or in a database that every replica shares (state_sql.py:
SQLite, PostgreSQL), so that any replica can take any turn."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any, Protocol

from g4serve_assistant.audit import AuditRow, ChainCheck
from g4serve_assistant.auth import Session
from g4serve_assistant.policy import ActionClaims, PendingAction, SessionState, StaleAction


class SessionBusyError(RuntimeError):
    """Another turn of this session held it for longer than a turn may wait (a retry will do)."""


class CustomerSessions(Protocol):
    """Server-issued sessions bound to the customer whose token created them, with an absolute expiry
    (auth.SessionRegistry in memory)."""

    ttl_s: float

    def create(self, customer_id: str, client: dict | None = None) -> Session: ...

    def get(self, session_id: object, customer_id: str) -> Session:
        """The live session of this customer; AuthError 403, the same for unknown, expired and another
        customer's ids."""

    def end(self, session_id: str, customer_id: str) -> bool: ...


class ConversationStore(ActionClaims, Protocol):
    """Each session's dialogue state (the pending action included). A turn ``begin``s (the state is then
    this turn's alone, until ``commit`` writes it back or ``release`` lets it go unchanged), a confirmation
    ``claim``s its action before executing it, and the sweeper (sweeper.py) takes the proposals no yes can
    reach any more (``stale``) to cancel them in the bank."""

    def begin(self, session_id: str, customer_id: str) -> SessionState:
        """PermissionError when the session is another customer's; SessionBusyError when another turn
        holds it too long."""

    def commit(self, state: SessionState) -> bool:
        """Writes the state back; False when this turn's hold had lapsed and another turn took the session
        (its state stands)."""

    def release(self, state: SessionState) -> None: ...

    def drop(self, session_id: str) -> None: ...

    def stale(self, now: float, ttl_s: float, retry_s: float, limit: int) -> list[StaleAction]:
        """Up to ``limit`` proposals with a transfer in the bank that no confirmation can claim any more
        (made more than ``ttl_s`` before ``now``, or their dialogue state is gone), taken out of their
        dialogue state and held for this caller to cancel: no claim wins them from now on, and no other
        sweeper for ``retry_s``, after which they come back here until ``cancelled``."""

    def cancelled(self, action: StaleAction) -> bool:
        """The bank cancelled it (or found it no longer pending): it is never handed out again. False when
        it was settled already (another sweeper, or its session's own turn), so there is nothing to record."""


class AuditTrail(Protocol):
    """The hash-chained audit rows (audit.AuditLog, on SQLite or PostgreSQL)."""

    def append(
        self, rows: list[AuditRow], *, customer_id: str | None, session_id: str | None, client: dict | None
    ) -> list[int]: ...

    def entries(
        self, customer_id: str | None = None, session_id: str | None = None, limit: int | None = None
    ) -> list[dict]: ...

    def head(self) -> tuple[int, str]: ...

    def verify(self) -> ChainCheck: ...


class StateStore(Protocol):
    sessions: CustomerSessions
    conversations: ConversationStore
    audit: AuditTrail

    def close(self) -> None: ...


# --- the pending action as stored ------------------------------------------------------------------------
def pending_to_json(pending: PendingAction | None) -> str | None:
    if pending is None:
        return None
    return json.dumps(
        {
            "kind": pending.kind,
            "transfer_id": pending.transfer_id,
            "entities": pending.entities,
            "created_at": pending.created_at,
            "awaiting": pending.awaiting,
            "choices": pending.choices,
            "action_id": pending.action_id,
        },
        default=_encode,
        sort_keys=True,
    )


def pending_from_json(text: str | None) -> PendingAction | None:
    if text is None:
        return None
    data = json.loads(text, object_hook=_decode)
    return PendingAction(
        data["kind"],
        data["transfer_id"],
        data["entities"],
        data["created_at"],
        awaiting=data["awaiting"],
        choices=list(data["choices"]),
        action_id=data["action_id"],
    )


def _encode(value: Any) -> Any:
    # A draft's entities may hold a date (a filled "date" slot); it must come back a date, not a string.
    if isinstance(value, dt.date) and not isinstance(value, dt.datetime):
        return {"$date": value.isoformat()}
    if isinstance(value, (tuple, set)):
        return list(value)
    return str(value)  # nothing the policy reads: kept for the record, as the audit trail keeps it


def _decode(obj: dict) -> Any:
    return dt.date.fromisoformat(obj["$date"]) if obj.keys() == {"$date"} else obj
