"""The policy between understanding and the bank: money moves only after an explicit yes that names the
pending action, in the same session of the same customer; payees, accounts, amounts, dates and limits are
re-checked against the customer's own records; every turn returns its audit rows."""

from __future__ import annotations

import datetime as dt
import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from g4serve_assistant.audit import AuditRow
from g4serve_assistant.bank import BankUnavailableError, CustomerBank, Payee
from g4serve_assistant.intents import (
    ACTION_INTENTS,
    CONFLICTING_INTENTS,
    MONEY_INTENTS,
    IntentResult,
    close_candidates,
    confirmation_of,
)
from g4serve_assistant.normalize import format_money, is_known_currency

log = logging.getLogger("g4serve_assistant")

DEFAULT_LIMITS_MINOR = {
    "USD": 500_000,
    "EUR": 500_000,
    "GBP": 400_000,
    "CAD": 700_000,
    "AUD": 700_000,
    "CHF": 500_000,
    "JPY": 500_000,
    "INR": 40_000_000,
    "MXN": 10_000_000,
}
CONFIRM_TTL_S = 60.0
MAX_SCHEDULE_AHEAD_DAYS = 366
MAX_SPOKEN_TRANSACTIONS = 10

# Refusal codes (Decision.refused).
UNKNOWN_PAYEE = "unknown_payee"
OVER_LIMIT = "over_limit"
UNSUPPORTED_CURRENCY = "unsupported_currency"
NO_ACCOUNT = "no_account_in_currency"
INSUFFICIENT_FUNDS = "insufficient_funds"
INVALID_AMOUNT = "invalid_amount"
DATE_IN_PAST = "date_in_past"
UNKNOWN_ACCOUNT = "unknown_account"
INVALID_DATE = "invalid_date"
CONFIRMATION_MISMATCH = "confirmation_mismatch"

_ORDINALS = {
    "first": 0,
    "1st": 0,
    "second": 1,
    "2nd": 1,
    "third": 2,
    "3rd": 2,
    "fourth": 3,
    "4th": 3,
    "fifth": 4,
    "5th": 4,
    "last": -1,
}


@dataclass
class PendingAction:
    kind: str  # the intent: transfer_money, bill_payment, card_lock, card_unlock
    transfer_id: str | None
    entities: dict
    created_at: float
    awaiting: str = "confirmation"  # or a missing slot: "amount" | "payee" | "card" | "date"
    choices: list[str] = field(default_factory=list)  # payee or card ids offered for the missing slot
    # What a confirmation must name: unguessable, one per proposal, so a "yes" can only confirm the action
    # its client was shown (not one that replaced it meanwhile). It is also the execution's idempotency key.
    action_id: str = field(default_factory=lambda: f"a-{secrets.token_urlsafe(16)}")

    def expires_at(self, ttl_s: float) -> float:
        return self.created_at + ttl_s


@dataclass
class SessionState:
    session_id: str
    customer_id: str
    pending: PendingAction | None = None
    turns: int = 0
    # A shared store's hold on this session while a turn runs (state_sql.py); None in memory.
    lease: str | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class StaleAction:
    """A proposal no confirmation can reach any more, owed its cancellation in the bank (sweeper.py)."""

    customer_id: str
    session_id: str
    action_id: str
    kind: str
    transfer_id: str
    reason: str  # 'expired': its confirmation window passed; 'evicted': its dialogue state was


@dataclass
class Decision:
    intent: str
    reply: str
    needs_confirmation: bool
    executed: bool
    refused: str | None
    action: dict | None  # what was done or proposed
    audit: list[AuditRow] = field(default_factory=list)  # the turn's rows, for the caller to append
    pending: dict | None = None  # the action awaiting a confirmation: {action_id, kind, expires_at}


class SessionStore:
    """Session states by id: created on first use, least recently used evicted beyond ``max_sessions``.

    Logging out cancels the session's pending transfer in the bank (``Policy.end``). A proposal that no yes
    can reach any more is taken out of its state and owed to the sweeper (``stale``, sweeper.py), which
    cancels it in the bank: an evicted state's at once, an abandoned one's (its session expired, or the
    customer walked away) once its confirmation window has passed. Never here, by a bank call: eviction
    happens inside another customer's turn, under this store's lock, where a remote bank would stall or fail
    that turn. Nor while a turn holds the state (from ``begin`` to ``commit`` or ``release``, ``lease_s`` at
    most, as a shared store's lease), so that taking a proposal cannot interleave with a decision on it: a
    state evicted during its own turn is handed over when that turn ends. At most ``max_owed`` cancellations
    wait for the bank; an evicted proposal beyond them is logged as an error and stays pending (the bank
    has then stopped answering cancellations).
    """

    def __init__(self, max_sessions: int = 10_000, max_owed: int = 10_000, lease_s: float = 30.0):
        self.max_sessions = max_sessions
        self.max_owed = max_owed
        self.lease_s = lease_s
        self._sessions: OrderedDict[str, SessionState] = OrderedDict()
        self._turns: dict[int, tuple[SessionState, float]] = {}  # id(state) -> (state, held until)
        self._owed: dict[str, list] = {}  # action id -> [StaleAction, next try at], oldest first
        self._lock = threading.Lock()

    def get(self, session_id: str, customer_id: str) -> SessionState:
        """The dialogue state of a session; the session ids are server-issued per customer, and a state is
        never handed to another customer even if an id were reused."""
        with self._lock:
            return self._get(session_id, customer_id)

    def _get(self, session_id: str, customer_id: str) -> SessionState:
        state = self._sessions.get(session_id)
        if state is not None and state.customer_id != customer_id:
            raise PermissionError(f"session {session_id} belongs to another customer")
        if state is None:
            state = self._sessions[session_id] = SessionState(session_id, customer_id)
            while len(self._sessions) > self.max_sessions:
                _, evicted = self._sessions.popitem(last=False)
                if not self._held(evicted):  # else its turn hands it over when it ends
                    self._owe(evicted, "evicted")
        else:
            self._sessions.move_to_end(session_id)
        return state

    def drop(self, session_id: str) -> None:
        with self._lock:
            self._sessions.pop(session_id, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    # --- the ConversationStore interface (state.py). In memory the state is the live object, and the
    # policy's lock already lets one decision run at a time, so there is nothing to write back.
    def begin(self, session_id: str, customer_id: str) -> SessionState:
        with self._lock:
            state = self._get(session_id, customer_id)
            self._turns[id(state)] = (state, time.monotonic() + self.lease_s)
            return state

    def commit(self, state: SessionState) -> bool:
        self.release(state)
        return True

    def release(self, state: SessionState) -> None:
        with self._lock:
            self._turns.pop(id(state), None)
            if self._sessions.get(state.session_id) is not state:  # evicted while this turn ran
                self._owe(state, "evicted")

    def claim(self, state: SessionState, pending: PendingAction, now: float, ttl_s: float) -> bool:
        # The sweeper takes proposals only out of states no turn holds, and a turn's begin waits on this
        # store's lock: a confirmation never races it here.
        return True

    def settle(self, state: SessionState, pending: PendingAction, done: bool) -> None:
        pass

    def stale(self, now: float, ttl_s: float, retry_s: float, limit: int) -> list[StaleAction]:
        with self._lock:
            for key, (state, _) in list(self._turns.items()):
                # A turn that never ended (its task was cancelled) on a state evicted meanwhile.
                if not self._held(state) and self._sessions.get(state.session_id) is not state:
                    del self._turns[key]
                    self._owe(state, "evicted")
            # About 0.5 ms for 10,000 states, 1,000 of them with a proposal (the 2-core development machine).
            for state in self._sessions.values():
                pending = state.pending
                if pending is not None and now - pending.created_at > ttl_s and not self._held(state):
                    self._owe(state, "expired")
            due = [entry for entry in self._owed.values() if entry[1] <= now][:limit]
            for entry in due:
                entry[1] = now + retry_s
            return [action for action, _ in due]

    def cancelled(self, action: StaleAction) -> bool:
        with self._lock:
            return self._owed.pop(action.action_id, None) is not None

    def _held(self, state: SessionState) -> bool:
        turn = self._turns.get(id(state))  # the entry keeps its state alive, so the id is not reused
        return turn is not None and turn[1] > time.monotonic()

    def _owe(self, state: SessionState, reason: str) -> None:
        """Takes the state's proposal (one with a transfer in the bank) into the owed cancellations."""
        pending = state.pending
        if pending is None or pending.transfer_id is None or pending.awaiting != "confirmation":
            return
        if len(self._owed) >= self.max_owed:
            if reason == "evicted":  # an expired one stays in its state, taken once there is room
                log.error(
                    "%d cancellations already wait for the bank: transfer %s of customer %s stays pending",
                    len(self._owed),
                    pending.transfer_id,
                    state.customer_id,
                )
            return
        state.pending = None
        action = StaleAction(
            state.customer_id,
            state.session_id,
            pending.action_id,
            pending.kind,
            pending.transfer_id,
            reason,
        )
        self._owed[action.action_id] = [action, float("-inf")]


class ActionClaims(Protocol):
    """Where a pending action is taken for execution, once: a shared store (state_sql.py) makes two
    replicas' confirmations of one action race for a single row, and only one wins."""

    def claim(self, state: SessionState, pending: PendingAction, now: float, ttl_s: float) -> bool:
        """True for the one caller that may execute ``pending`` now: it is this session's, of this
        customer, still waiting, and younger than ``ttl_s``."""

    def settle(self, state: SessionState, pending: PendingAction, done: bool) -> None:
        """After a claim: ``done`` (executed, or found no longer pending) ends the action for good; otherwise
        it waits again for a retried yes (the bank did not answer)."""


class Policy:
    """Turns an ``IntentResult`` (fast path or Gemma) into a checked, audited ``Decision``.

    Confirmation rules:
    - a transfer or bill payment always ends its turn as a pending proposal with an ``action_id``; only a
      later turn of the same session that is a plain yes (``confirmation_of`` on the literal words, never
      a model's reading) and names that ``action_id`` executes it, once (the id is the idempotency key);
      a plain no or cancel cancels it; it expires after ``confirm_ttl_s``;
    - a new transfer, bill payment or card request replaces the pending action (which is cancelled); what
      the new money request leaves unsaid comes from the replaced one ("make it sixty dollars");
    - any other turn (balance, question, unclear words) is answered and the action keeps waiting, with a
      reminder. A question of ours ("how much?", "which card?") is instead dropped when not answered;
    - card lock runs at once (it only protects the customer, and unlock undoes it); card unlock needs a
      yes like money, and so does a lock the fast path was unsure of.
    """

    def __init__(
        self,
        db: CustomerBank,
        limits_minor: dict[str, int] | None = None,
        confirm_ttl_s: float = CONFIRM_TTL_S,
        clock: Callable[[], float] = time.time,
        claims: ActionClaims | None = None,
    ):
        self.db = db  # one customer's records: every id the policy acts on is looked up in them
        self.limits_minor = dict(DEFAULT_LIMITS_MINOR if limits_minor is None else limits_minor)
        self.confirm_ttl_s = confirm_ttl_s
        self.clock = clock
        # One decision at a time: a turn reads and then writes session and bank state, and two turns of
        # one session (a retried request) must not both execute the same confirmation, from whichever thread
        # they come. The assistant also serialises each customer's decisions across its policies
        # (``Assistant._customer_decision``), never across customers: a slow bank call holds up only its own.
        self._lock = threading.RLock()
        # Across processes the lock is not enough: a confirmation also claims its action in the shared store.
        self.claims = claims

    def is_confirmation(self, text: str) -> bool | None:
        return confirmation_of(text)

    def wants_llm(self, session: SessionState, result: IntentResult) -> bool:
        """Whether the model should look at this turn: the fast path is unsure and no pending question
        of this session can take the answer as it is (a bare amount after "how much?" needs no model)."""
        if not result.needs_llm:
            return False
        pending = session.pending
        if pending is None or pending.awaiting == "confirmation":
            return True
        if pending.awaiting == "amount":
            return "amount_minor" not in result.entities
        if pending.awaiting == "payee":
            return "payee_id" not in result.entities and not result.candidates
        return "card" not in result.entities

    # --- the turn -----------------------------------------------------------------------------------
    def decide(
        self, session: SessionState, result: IntentResult, text: str, action_id: str | None = None
    ) -> Decision:
        """Handles a pending confirmation or question first, then the request; ``action_id`` is what the
        client's confirmation names. The decision carries its audit rows (``Decision.audit``)."""
        if session.customer_id != self.db.customer_id:
            raise PermissionError("the session and the bank view belong to different customers")
        with self._lock:
            session.turns += 1
            rows: list[tuple[str, str, dict]] = [
                (
                    "intent",
                    result.intent,
                    {
                        "text": text,
                        "confidence": result.confidence,
                        "entities": result.entities,
                        "needs_llm": result.needs_llm,
                        "ambiguity_reason": result.ambiguity_reason,
                        "rules": result.rules,
                    },
                )
            ]
            if result.candidates:
                rows.append(
                    (
                        "lookup",
                        "payee_candidates",
                        {
                            "candidates": [
                                {
                                    "payee_id": c.payee_id,
                                    "score": c.score,
                                    "phonetic": c.phonetic,
                                    "span": c.span,
                                }
                                for c in result.candidates
                            ]
                        },
                    )
                )
            decision = self._decide(session, result, text, rows, action_id)
            asking = session.pending is not None and session.pending.awaiting != "confirmation"
            outcome = (
                "refused"
                if decision.refused
                else "executed"
                if decision.executed
                else "proposed"
                if decision.needs_confirmation
                else "asked"
                if asking
                else "answered"
            )
            pending = session.pending
            if pending is not None and pending.awaiting == "confirmation":
                decision.pending = {
                    "action_id": pending.action_id,
                    "kind": pending.kind,
                    "expires_at": round(pending.expires_at(self.confirm_ttl_s), 3),
                }
            rows.append(
                (
                    "policy",
                    outcome,
                    {
                        "intent": decision.intent,
                        "reply": decision.reply,
                        "refused": decision.refused,
                        "action": decision.action,
                        "pending": pending.kind if pending else None,
                        "action_id": pending.action_id if pending else None,
                        "confirmation_named": action_id,
                    },
                )
            )
            decision.audit = [AuditRow(stage, event, detail) for stage, event, detail in rows[:-1]]
            decision.audit.append(AuditRow(*rows[-1], outcome=outcome))
            return decision

    def _decide(  # noqa: C901 - the state machine of a pending action: expire, cancel, confirm, fill a slot, replace, abandon
        self, session: SessionState, result: IntentResult, text: str, rows: list, action_id: str | None
    ) -> Decision:
        pending = session.pending
        confirm = confirmation_of(text)  # the literal words, never a model's reading of them
        expired = pending is not None and self.clock() - pending.created_at > self.confirm_ttl_s
        if expired:
            self._drop(session, "expired", rows)
            pending = None
        if pending is None:
            if confirm is not None and result.intent == "unknown":
                reply = (
                    "That request timed out, so I didn't do anything. Please ask again."
                    if expired
                    else "There's nothing waiting for confirmation."
                )
                return Decision("unknown", reply, False, False, None, None)
            return self._request(session, result, result.entities, text, rows)

        if confirm is False:
            self._drop(session, "cancelled", rows)
            return Decision(
                pending.kind,
                "Okay, I've cancelled that.",
                False,
                False,
                None,
                {"type": "cancelled", "kind": pending.kind, "transfer_id": pending.transfer_id},
            )
        if pending.awaiting == "confirmation":
            if confirm is True:
                if action_id is None or not secrets.compare_digest(action_id, pending.action_id):
                    # A yes confirms only the action its client names: never "whatever is pending now".
                    rows.append(
                        ("policy", "confirmation_refused", {"named": action_id, "pending": pending.action_id})
                    )
                    return self._refuse(
                        pending.kind,
                        CONFIRMATION_MISMATCH,
                        "That confirmation doesn't match the request waiting: "
                        f"{self._summary(pending)}. Confirm it on screen, or say no to cancel.",
                        {"type": "confirmation", "named": action_id},
                    )
                return self._execute(session, pending, rows)
        else:
            filled = self._fill(pending, result, text, confirm)
            if filled is not None:
                session.pending = None
                rows.append(("policy", "slot_filled", {"slot": pending.awaiting, "entities": filled}))
                return self._request(session, result, filled, text, rows, intent=pending.kind)
            if confirm is True or _no_such_day(pending, result):  # "yes" does not answer "how much?"
                return Decision(pending.kind, self._question(pending), False, False, None, None)

        if result.intent in ACTION_INTENTS:
            entities = dict(result.entities)
            if result.intent in MONEY_INTENTS and pending.kind in MONEY_INTENTS:
                entities = _inherit(pending.entities, result)
            self._drop(session, "replaced", rows)
            return self._request(session, result, entities, text, rows)

        if pending.awaiting != "confirmation":
            # The customer moved on instead of answering our question: the draft is dropped.
            self._drop(session, "abandoned", rows)
            return self._request(session, result, result.entities, text, rows)
        # Not an answer and not a new action: answer it and keep the action waiting for its yes.
        decision = self._request(session, result, result.entities, text, rows)
        reply = "" if decision.intent == "unknown" else decision.reply  # unclear words: just the reminder
        decision.reply = f"{reply} {self._reminder(pending)}".strip()
        decision.needs_confirmation = pending.awaiting == "confirmation"
        return decision

    # --- requests -----------------------------------------------------------------------------------
    def _request(
        self,
        session: SessionState,
        result: IntentResult,
        entities: dict,
        text: str,
        rows: list,
        intent: str | None = None,
    ) -> Decision:
        """A request of this turn, or (``intent`` given) a draft whose missing slot this turn filled."""
        fresh = intent is None
        intent = intent or result.intent
        if fresh and CONFLICTING_INTENTS in (result.ambiguity_reason or ""):
            return Decision(
                intent,
                "I can do one thing at a time. What would you like to do first?",
                False,
                False,
                None,
                None,
            )
        if intent in MONEY_INTENTS:
            return self._money(session, intent, entities, result, rows)
        if intent in ("card_lock", "card_unlock"):
            # unsure: the fast path still is, or the model chose (merge_into_result clears needs_llm)
            unsure = result.needs_llm or "gemma_extraction" in (result.rules or [])
            return self._card(session, intent, entities, unsure=fresh and unsure)
        if intent == "balance_inquiry":
            return self._balance(entities)
        if intent == "recent_transactions":
            return self._transactions(entities)
        if intent == "recipient_lookup":
            return self._lookup(entities, result)
        if intent == "human_handoff":
            return Decision(
                intent, "Connecting you to an agent now.", False, False, None, {"type": "handoff"}
            )
        if intent == "qna":
            # The app answers from the knowledge base (qna.py); this reply is only the fallback.
            return Decision(
                intent, "Let me look that up for you.", False, False, None, {"type": "qna", "question": text}
            )
        return Decision(
            "unknown",
            "Sorry, I didn't catch that. You can ask for your balance, recent transactions, "
            "a transfer, a bill payment, or to lock or unlock a card.",
            False,
            False,
            None,
            None,
        )

    def _money(
        self, session: SessionState, intent: str, entities: dict, result: IntentResult, rows: list
    ) -> Decision:
        payee, refusal = self._payee(session, intent, entities, result)
        if refusal is not None:
            return refusal
        assert payee is not None
        intent = "bill_payment" if payee.kind == "biller" else "transfer_money"  # the payee settles which
        kind = "bill_payment" if intent == "bill_payment" else "transfer"
        verb = "pay" if kind == "bill_payment" else "send"
        amount = entities.get("amount_minor")
        if amount is None:
            session.pending = PendingAction(
                intent,
                None,
                {**entities, "payee_id": payee.payee_id, "payee_name": payee.display_name},
                self.clock(),
                awaiting="amount",
            )
            return Decision(
                intent,
                self._question(session.pending),
                False,
                False,
                None,
                {"type": kind, "payee_id": payee.payee_id, "missing": "amount"},
            )
        currency = str(entities.get("currency") or self._default_currency()).upper()
        proposal = {
            "type": kind,
            "payee_id": payee.payee_id,
            "payee_name": payee.display_name,
            "amount_minor": amount,
            "currency": currency,
        }
        if isinstance(amount, int) and not isinstance(amount, bool) and amount <= 0:
            return self._refuse(
                intent,
                INVALID_AMOUNT,
                f"I can only {verb} an amount above zero"
                + (f", and {format_money(amount, currency)} is below it." if amount < 0 else ".")
                + " How much would you like to "
                + verb
                + "?",
                proposal,
            )
        if isinstance(amount, bool) or not isinstance(amount, int) or not is_known_currency(currency):
            return self._refuse(
                intent,
                INVALID_AMOUNT,
                "Sorry, I couldn't understand the amount. Please say it again, for example fifty dollars.",
                proposal,
            )
        limit = self.limits_minor.get(currency)
        if limit is None:
            return self._refuse(
                intent, UNSUPPORTED_CURRENCY, f"Sorry, I can't make payments in {currency}.", proposal
            )
        if amount > limit:
            return self._refuse(
                intent,
                OVER_LIMIT,
                f"Sorry, that's over your limit of {format_money(limit, currency)} per payment.",
                proposal,
            )
        account, refusal = self._paying_account(intent, entities.get("account"), currency, proposal)
        if refusal is not None:
            return refusal
        if account["balance_minor"] < amount:
            return self._refuse(
                intent,
                INSUFFICIENT_FUNDS,
                f"Your {account['name']} balance of "
                f"{format_money(account['balance_minor'], currency)} isn't enough to {verb} "
                f"{format_money(amount, currency)}.",
                proposal,
            )
        scheduled, refusal = self._schedule(session, intent, entities, payee, proposal, rows)
        if refusal is not None:
            return refusal
        transfer_id = self.db.create_transfer(
            session.session_id,
            payee.payee_id,
            amount,
            currency,
            kind,
            from_account_id=account["account_id"],
            scheduled_for=scheduled,
        )
        proposal |= {
            "transfer_id": transfer_id,
            "from_account_id": account["account_id"],
            "scheduled_for": scheduled.isoformat() if scheduled else None,
            "status": "pending",
        }
        session.pending = PendingAction(intent, transfer_id, proposal, self.clock())
        proposal["action_id"] = session.pending.action_id
        rows.append(("policy", "transfer_created", proposal))
        return Decision(intent, self._question(session.pending), True, False, None, proposal)

    def _schedule(
        self, session: SessionState, intent: str, entities: dict, payee: Payee, proposal: dict, rows: list
    ) -> tuple[dt.date | None, Decision | None]:
        """The date a payment is scheduled for (None: now), or the decision that asks or refuses instead."""
        today = dt.date.fromtimestamp(self.clock())
        date = _as_date(entities.get("date"))
        if entities.get("date") is not None and date is None:
            # An impossible date ("8888-00-95") is a question, never a value: nothing is scheduled on it.
            draft = {k: v for k, v in entities.items() if k != "date"} | {
                "payee_id": payee.payee_id,
                "payee_name": payee.display_name,
            }
            session.pending = PendingAction(intent, None, draft, self.clock(), awaiting="date")
            rows.append(("policy", "invalid_date", {"date": str(entities.get("date"))[:100]}))
            question = self._question(session.pending)
            return None, Decision(intent, question, False, False, None, proposal | {"missing": "date"})
        if date is not None and date < today:
            return None, self._refuse(
                intent, DATE_IN_PAST, "I can't schedule a payment in the past.", proposal
            )
        if date is not None and (date - today).days > MAX_SCHEDULE_AHEAD_DAYS:
            return None, self._refuse(
                intent, INVALID_DATE, "I can only schedule a payment up to a year ahead.", proposal
            )
        return (date if date is not None and date > today else None), None

    def _payee(
        self, session: SessionState, intent: str, entities: dict, result: IntentResult
    ) -> tuple[Payee | None, Decision | None]:
        """The payee, re-read from the database, or the decision that asks or refuses instead."""
        kind = "bill_payment" if intent == "bill_payment" else "transfer"
        payee_id = entities.get("payee_id")
        if payee_id is not None:
            payee = self.db.payee(str(payee_id))
            if payee is None:  # an id from the model or a stale index: never trusted without the database
                return None, self._refuse(
                    intent,
                    UNKNOWN_PAYEE,
                    "I can't find that payee among your saved payees, so I can't send money there.",
                    {"type": kind, "payee_id": payee_id},
                )
            return payee, None
        name = entities.get("payee_name")
        if name:
            exact = [p for p in self.db.payees() if p.display_name.lower() == str(name).lower()]
            if len(exact) == 1:
                return exact[0], None
        # Close candidates but no id: the fast path found several, or the model chose none of them.
        # Either way the customer picks; nothing is guessed.
        close = close_candidates(result.candidates)
        if close:
            session.pending = PendingAction(
                intent,
                None,
                dict(entities),
                self.clock(),
                awaiting="payee",
                choices=[c.payee_id for c in close],
            )
            return None, Decision(
                intent,
                self._question(session.pending),
                False,
                False,
                None,
                {"type": kind, "missing": "payee", "choices": session.pending.choices},
            )
        if name or result.candidates:
            said = str(name or result.candidates[0].span)
            return None, self._refuse(
                intent,
                UNKNOWN_PAYEE,
                f"I couldn't find {said} among your saved payees. "
                "For your security I can only send money to saved payees.",
                {"type": kind, "payee_name": said},
            )
        session.pending = PendingAction(intent, None, dict(entities), self.clock(), awaiting="payee")
        return None, Decision(
            intent, self._question(session.pending), False, False, None, {"type": kind, "missing": "payee"}
        )

    def _paying_account(
        self, intent: str, requested: Any, currency: str, proposal: dict
    ) -> tuple[dict | None, Decision | None]:
        if requested is not None:
            account = self._resolve_account(requested)
            if account is None:
                return None, self._refuse(intent, UNKNOWN_ACCOUNT, "I couldn't find that account.", proposal)
            if account["currency"] == currency:
                return account, None
        account = self.db.account_for_currency(currency)
        if account is None:
            return None, self._refuse(
                intent, NO_ACCOUNT, f"You don't have an account in {currency} to pay from.", proposal
            )
        return account, None

    def _card(self, session: SessionState, intent: str, entities: dict, unsure: bool) -> Decision:
        lock = intent == "card_lock"
        cards = self.db.cards()
        card = _resolve_card(cards, entities.get("card"))
        if card is None:
            relevant = [c for c in cards if c["locked"] != lock]  # lock: unlocked cards; unlock: locked ones
            if not relevant:
                reply = "All your cards are already locked." if lock else "None of your cards is locked."
                return Decision(intent, reply, False, False, None, None)
            if len(relevant) > 1:
                session.pending = PendingAction(
                    intent,
                    None,
                    dict(entities),
                    self.clock(),
                    awaiting="card",
                    choices=[c["card_id"] for c in relevant],
                )
                return Decision(
                    intent,
                    self._question(session.pending),
                    False,
                    False,
                    None,
                    {"type": intent, "missing": "card", "choices": session.pending.choices},
                )
            card = relevant[0]
        action = {"type": intent, "card_id": card["card_id"], "card": _card_name(card)}
        if card["locked"] == lock:
            state = "locked" if lock else "unlocked"
            return Decision(
                intent, f"Your {_card_name(card)} is already {state}.", False, False, None, action
            )
        if lock and not unsure:
            # Locking only protects the customer and is undone by an unlock, so it runs without a yes.
            self.db.set_card_locked(card["card_id"], True)
            return Decision(
                intent,
                f"I've locked your {_card_name(card)}. Say unlock my card when you find it.",
                False,
                True,
                None,
                action | {"status": "locked"},
            )
        session.pending = PendingAction(intent, None, action, self.clock())
        return Decision(
            intent,
            self._question(session.pending),
            True,
            False,
            None,
            action | {"status": "pending", "action_id": session.pending.action_id},
        )

    def _balance(self, entities: dict) -> Decision:
        account = self._resolve_account(entities["account"]) if entities.get("account") else None
        if account is None:
            account = self.db.balance()
        reply = (
            f"Your {account['name']} balance is "
            f"{format_money(account['balance_minor'], account['currency'])}."
        )
        return Decision("balance_inquiry", reply, False, False, None, {"type": "balance", **account})

    def _transactions(self, entities: dict) -> Decision:
        limit = min(int(entities.get("limit") or 3), MAX_SPOKEN_TRANSACTIONS)
        account = self._resolve_account(entities["account"]) if entities.get("account") else None
        txns = self.db.recent_transactions(limit, account["account_id"] if account else None)
        if not txns:
            return Decision("recent_transactions", "You have no transactions yet.", False, False, None, None)
        spoken = "; ".join(
            f"{t['description']}, {_signed_money(t['amount_minor'], t['currency'])} on "
            f"{_spoken_date(t['posted_on'], weekday=False)}"
            for t in txns
        )
        noun = "transaction" if len(txns) == 1 else f"{len(txns)} transactions"
        return Decision(
            "recent_transactions",
            f"Your last {noun}: {spoken}.",
            False,
            False,
            None,
            {"type": "transactions", "transaction_ids": [t.get("txn_id") for t in txns]},
        )

    def _lookup(self, entities: dict, result: IntentResult) -> Decision:
        intent = "recipient_lookup"
        if entities.get("payee_id"):
            payee = self.db.payee(str(entities["payee_id"]))
            if payee is not None:
                return Decision(
                    intent,
                    f"Yes, {payee.display_name} is one of your saved payees ({payee.relationship}).",
                    False,
                    False,
                    None,
                    {"type": "lookup", "payee_ids": [payee.payee_id]},
                )
        close = close_candidates(result.candidates)
        if close:
            return Decision(
                intent,
                f"I found {_spoken_list([c.display_name for c in close])}.",
                False,
                False,
                None,
                {"type": "lookup", "payee_ids": [c.payee_id for c in close]},
            )
        said = entities.get("payee_name") or (result.candidates[0].span if result.candidates else None)
        if said:
            return Decision(
                intent,
                f"I couldn't find {said} among your saved payees.",
                False,
                False,
                None,
                {"type": "lookup", "payee_ids": []},
            )
        payees = self.db.payees()
        first = _spoken_list([p.display_name for p in payees[:5]])
        return Decision(
            intent,
            f"You have {len(payees)} saved payees, including {first}.",
            False,
            False,
            None,
            {"type": "lookup", "payee_ids": [p.payee_id for p in payees]},
        )

    # --- pending actions ------------------------------------------------------------------------------
    def _execute(self, session: SessionState, pending: PendingAction, rows: list) -> Decision:
        session.pending = None
        if self.claims is None:
            return self._execute_claimed(session, pending, rows)
        if not self.claims.claim(session, pending, self.clock(), self.confirm_ttl_s):
            # Another replica's turn executed (or is executing) it, or it was replaced or expired there.
            rows.append(("policy", "claim_lost", {"action_id": pending.action_id}))
            return self._refuse(pending.kind, "not_pending", "That request is no longer waiting.", None)
        done = True
        try:
            return self._execute_claimed(session, pending, rows)
        except BankUnavailableError:
            done = False  # whether it moved is unknown: the action waits for the retried yes (same key)
            raise
        finally:
            self.claims.settle(session, pending, done)

    def _execute_claimed(self, session: SessionState, pending: PendingAction, rows: list) -> Decision:
        today = dt.date.fromtimestamp(self.clock())
        if pending.kind in MONEY_INTENTS:
            try:
                transfer = self.db.transfer(pending.transfer_id or "")
                # Executed under this very key: an earlier try whose answer was lost. The bank returns
                # what it did, and nothing moves again.
                retried = transfer is not None and transfer.get("idempotency_key") == pending.action_id
                if (
                    transfer is None
                    or transfer["session_id"] != session.session_id
                    or (transfer["status"] != "pending" and not retried)
                ):
                    return self._refuse(
                        pending.kind, "not_pending", "That request is no longer waiting.", None
                    )
                done = self.db.execute_transfer(
                    transfer["transfer_id"], idempotency_key=pending.action_id, today=today
                )
            except ValueError:
                # No longer pending after all: cancelled in the bank since it was read (the sweeper, a
                # logout on another replica). The bank lets one of the two win, and here it was the cancel.
                return self._refuse(pending.kind, "not_pending", "That request is no longer waiting.", None)
            except BankUnavailableError:
                # Whether the money moved is unknown: the action waits, and the customer's retried yes
                # sends the same idempotency key, so the bank pays at most once.
                session.pending = pending
                raise
            rows.append(("execution", done["status"], done))
            action = pending.entities | {"status": done["status"]}
            what = (
                f"{format_money(done['amount_minor'], done['currency'])} to {pending.entities['payee_name']}"
            )
            if done["status"] == "failed":
                return Decision(
                    pending.kind,
                    f"Sorry, that payment failed: {done['note']}.",
                    False,
                    False,
                    INSUFFICIENT_FUNDS,
                    action,
                )
            if done["status"] == "scheduled":
                return Decision(
                    pending.kind,
                    f"Done. {what} is scheduled for {_spoken_date(done['scheduled_for'])}.",
                    False,
                    True,
                    None,
                    action,
                )
            verb = "paid" if pending.kind == "bill_payment" else "sent"
            return Decision(pending.kind, f"Done. I've {verb} {what}.", False, True, None, action)
        card_id = pending.entities["card_id"]
        lock = pending.kind == "card_lock"
        self.db.set_card_locked(card_id, lock)
        rows.append(("execution", "card_locked" if lock else "card_unlocked", {"card_id": card_id}))
        state = "locked" if lock else "unlocked"
        return Decision(
            pending.kind,
            f"Done. Your {pending.entities['card']} is {state}.",
            False,
            True,
            None,
            pending.entities | {"status": state},
        )

    def end(self, session: SessionState) -> list[AuditRow]:
        """The session is ending (logout): its pending action is cancelled as a replacing request cancels
        it, transfer included, since nothing could confirm it afterwards. Returns the audit rows. (A session
        that ends another way leaves its proposal to the sweeper: ``SessionStore.stale``, sweeper.py.)"""
        if session.customer_id != self.db.customer_id:
            raise PermissionError("the session and the bank view belong to different customers")
        with self._lock:
            pending, rows = session.pending, []
            try:
                self._drop(session, "ended", rows)
            except BaseException:
                session.pending = pending  # the bank did not answer: a retried logout cancels it
                raise
            return [AuditRow(stage, event, detail) for stage, event, detail in rows]

    def _drop(self, session: SessionState, why: str, rows: list) -> None:
        pending = session.pending
        session.pending = None
        if pending is None:
            return
        if pending.transfer_id:
            self.db.cancel_transfer(pending.transfer_id)
        rows.append(
            (
                "policy",
                f"pending_{why}",
                {"kind": pending.kind, "transfer_id": pending.transfer_id, "awaiting": pending.awaiting},
            )
        )

    def _fill(  # noqa: C901 - one branch per kind of slot (amount, payee, date, card), then the carried slots
        self, pending: PendingAction, result: IntentResult, text: str, confirm: bool | None
    ) -> dict | None:
        """The draft's entities with the missing slot taken from this turn, or None if it is not there.

        A yes answers "did you mean John Smith?" when that was the only choice offered."""
        if result.intent not in ("unknown", pending.kind) and not _is_bare_unsure(result):
            return None
        entities = dict(pending.entities)
        if pending.awaiting == "amount":
            if result.entities.get("amount_minor") is None:
                return None
            entities["amount_minor"] = result.entities["amount_minor"]
            entities["currency"] = result.entities.get("currency")
        elif pending.awaiting == "payee":
            payee_id = self._choice(pending, result, text, confirm)
            if payee_id is None:
                return None
            payee = self.db.payee(payee_id)
            entities["payee_id"], entities["payee_name"] = payee_id, payee.display_name if payee else None
        elif pending.awaiting == "date":
            date = _as_date(result.entities.get("date"))
            if date is None:
                return None
            entities["date"] = date
        else:
            card_id = self._card_choice(pending, result, text, confirm)
            if card_id is None:
                return None
            entities["card"] = card_id
        for key in ("amount_minor", "currency", "date"):
            if entities.get(key) is None and result.entities.get(key) is not None:
                entities[key] = result.entities[key]
        return entities

    def _card_choice(
        self, pending: PendingAction, result: IntentResult, text: str, confirm: bool | None
    ) -> str | None:
        card = _resolve_card(self.db.cards(), result.entities.get("card"))
        return card["card_id"] if card else _ordinal_choice(text, pending.choices, confirm)

    def _choice(
        self, pending: PendingAction, result: IntentResult, text: str, confirm: bool | None
    ) -> str | None:
        payee_id = result.entities.get("payee_id")
        if payee_id is not None and (not pending.choices or payee_id in pending.choices):
            return str(payee_id)
        if pending.choices:
            among = close_candidates([c for c in result.candidates if c.payee_id in pending.choices])
            if len(among) == 1:
                return among[0].payee_id
            return _ordinal_choice(text, pending.choices, confirm)
        return None

    def _question(self, pending: PendingAction) -> str:
        e = pending.entities
        if pending.awaiting == "amount":
            verb = "pay" if pending.kind == "bill_payment" else "send to"
            return f"How much would you like to {verb} {e.get('payee_name')}?"
        if pending.awaiting == "payee":
            if pending.choices:
                names = [p.display_name for p in map(self.db.payee, pending.choices) if p is not None]
                return f"Did you mean {_spoken_list(names, 'or')}?"
            return "Who would you like to pay?"
        if pending.awaiting == "card":
            cards = {c["card_id"]: c for c in self.db.cards()}
            names = [f"your {_card_name(cards[c])}" for c in pending.choices if c in cards]
            verb = "lock" if pending.kind == "card_lock" else "unlock"
            return f"Which card should I {verb}: {_spoken_list(names, 'or')}?"
        if pending.awaiting == "date":
            verb = "pay" if pending.kind == "bill_payment" else "send"
            return f"I didn't catch a valid date. On which day should I {verb} this to {e.get('payee_name')}?"
        summary = self._summary(pending)
        return f"{summary[0].upper()}{summary[1:]}? Say yes to confirm or no to cancel."

    def _summary(self, pending: PendingAction) -> str:
        e = pending.entities
        if pending.kind in MONEY_INTENTS:
            verb = "pay" if pending.kind == "bill_payment" else "send"
            when = f" on {_spoken_date(e['scheduled_for'])}" if e.get("scheduled_for") else ""
            return f"{verb} {format_money(e['amount_minor'], e['currency'])} to {e['payee_name']}{when}"
        return f"{'lock' if pending.kind == 'card_lock' else 'unlock'} your {e['card']}"

    def _reminder(self, pending: PendingAction) -> str:
        if pending.awaiting == "confirmation":
            return (
                f"You still have a request waiting: {self._summary(pending)}. "
                "Say yes to confirm or no to cancel."
            )
        return self._question(pending)

    # --- helpers --------------------------------------------------------------------------------------
    def _refuse(self, intent: str, code: str, reply: str, action: dict | None) -> Decision:
        return Decision(intent, reply, False, False, code, action)

    def _default_currency(self) -> str:
        return self.db.balance()["currency"]

    def _resolve_account(self, value: Any) -> dict | None:
        word = str(value).lower()
        for a in self.db.accounts():
            if word in (a["account_id"].lower(), a["name"].lower(), a["currency"].lower()):
                return a
        return None


def _is_bare_unsure(result: IntentResult) -> bool:
    # A fragment ("fifty dollars", "to john smith") is an answer, not a new request.
    return any(r.endswith(":fragment") for r in result.rules)


def _no_such_day(pending: PendingAction, result: IntentResult) -> bool:
    """An answer to "on which day?" that names no real day either ("february 30th"): asked again with the
    draft kept, not taken for the customer moving on (which dropped the draft)."""
    said = result.entities.get("date")
    return (
        pending.awaiting == "date"
        and said is not None
        and _as_date(said) is None
        and result.intent in ("unknown", pending.kind)
    )


def _inherit(previous: dict, result: IntentResult) -> dict:
    """A new money request, with what it leaves unsaid taken from the request it replaces."""
    entities = dict(result.entities)
    if entities.get("amount_minor") is None and previous.get("amount_minor") is not None:
        entities["amount_minor"], entities["currency"] = previous["amount_minor"], previous.get("currency")
    if entities.get("payee_id") is None and not result.candidates and not entities.get("payee_name"):
        if previous.get("payee_id") is not None:
            entities["payee_id"], entities["payee_name"] = previous["payee_id"], previous.get("payee_name")
    if entities.get("date") is None and previous.get("scheduled_for"):
        entities["date"] = previous["scheduled_for"]
    return entities


def _resolve_card(cards: list[dict], value: Any) -> dict | None:
    if value is None:
        return None
    word = str(value).lower()
    matches = [c for c in cards if word in (c["card_id"], c["kind"], c["network"], c["last4"])]
    return matches[0] if len(matches) == 1 else None


def _ordinal_choice(text: str, choices: list[str], confirm: bool | None = None) -> str | None:
    if confirm is True and len(choices) == 1:
        return choices[0]
    for word in text.lower().split():
        index = _ORDINALS.get(word.strip(".,!?"))
        if index is not None and -len(choices) <= index < len(choices):
            return choices[index]
    return None


def _card_name(card: dict) -> str:
    return f"{card['kind']} card ending in {card['last4']}"


def _as_date(value: Any) -> dt.date | None:
    if value is None or isinstance(value, dt.date):
        return value
    try:
        return dt.date.fromisoformat(str(value))
    except ValueError:
        return None


def _spoken_date(value: str | dt.date, weekday: bool = True) -> str:
    date = _as_date(value)
    if date is None:
        return str(value)
    return f"{date:%A, %B} {date.day}" if weekday else f"{date:%B} {date.day}"


def _signed_money(amount_minor: int, currency: str) -> str:
    return (
        f"plus {format_money(amount_minor, currency)}"
        if amount_minor > 0
        else format_money(-amount_minor, currency)
    )


def _spoken_list(items: list[str], conjunction: str = "and") -> str:
    if len(items) <= 1:
        return "".join(items)
    return f"{', '.join(items[:-1])} {conjunction} {items[-1]}"
