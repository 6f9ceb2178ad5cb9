"""A session that ends without a logout leaves no transfer pending: the proposals no confirmation can reach
any more (their 60 s passed, their dialogue state was evicted, their in-memory server stopped) are cancelled
in the bank by the sweeper (sweeper.py), once, in the background, retried until the bank answers; and a yes
racing that cancellation executes only if it won."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

from g4serve_assistant.bank import BankUnavailableError
from g4serve_assistant.bank_sql import SQLCustomerBank
from g4serve_assistant.db import DEMO_CUSTOMER_2_ID, DEMO_CUSTOMER_ID, demo_bank, demo_db
from g4serve_assistant.intents import IntentClassifier
from g4serve_assistant.normalize import normalize
from g4serve_assistant.payees import PayeeIndex
from g4serve_assistant.pipeline import Assistant, Caller
from g4serve_assistant.policy import PendingAction, Policy, SessionState, SessionStore
from g4serve_assistant.state_sql import SQLStateStore

C1, C2 = DEMO_CUSTOMER_ID, DEMO_CUSTOMER_2_ID
TTL_S = 60.0


class Later:
    """The sweeper's clock, moved by the test (proposals are made on the real one)."""

    def __init__(self):
        self.offset_s = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset_s


class BankCalls:
    """Counts the bank's cancellations; ``down`` makes them fail as an unreachable bank does, ``gate`` makes
    them wait until it is set."""

    def __init__(self, monkeypatch):
        self.tries = 0
        self.cancels: list[str] = []
        self.down = False
        self.gate: threading.Event | None = None
        self.started = threading.Event()
        real = SQLCustomerBank.cancel_transfer

        def cancel(view, transfer_id):
            self.tries += 1
            self.started.set()
            if self.gate is not None:
                assert self.gate.wait(10)
            if self.down:
                raise BankUnavailableError("injected: the bank does not answer")
            self.cancels.append(transfer_id)
            real(view, transfer_id)

        monkeypatch.setattr(SQLCustomerBank, "cancel_transfer", cancel)


@pytest.fixture
def calls(monkeypatch) -> BankCalls:
    return BankCalls(monkeypatch)


@pytest.fixture
def assistant() -> Assistant:
    assistant = Assistant(demo_bank(), None, recognizer=None)
    assistant.sweeper.clock = Later()
    return assistant


def propose(assistant: Assistant, session_id: str, customer_id: str = C1) -> dict:
    r = asyncio.run(assistant.turn(Caller(customer_id, session_id), text="send 40 dollars to Tom Wilson"))
    assert r.needs_confirmation and r.pending is not None
    return r.action | {"action_id": r.pending["action_id"]}


def status(assistant: Assistant, transfer_id: str, customer_id: str = C1) -> str:
    return assistant.bank.customer(customer_id).transfer(transfer_id)["status"]


def swept(assistant: Assistant, customer_id: str = C1) -> list[dict]:
    return [e for e in assistant.audit.entries(customer_id) if e["stage"] == "sweeper"]


# --- in memory ----------------------------------------------------------------------------------------------
def test_an_abandoned_proposal_is_cancelled_once_when_its_window_passed(assistant, calls):
    """The customer walked away (or their session expired) after a proposal: nothing can confirm it after its
    60 s, and it was left 'pending' in the bank for good."""
    proposal = propose(assistant, "s1")
    assistant.sweeper.sweep()
    assert status(assistant, proposal["transfer_id"]) == "pending"  # still confirmable: left alone
    assistant.sweeper.clock.offset_s = TTL_S + 1
    assistant.sweeper.sweep()
    assert status(assistant, proposal["transfer_id"]) == "cancelled"
    (row,) = swept(assistant)
    assert row["session_id"] == "s1" and row["event"] == "pending_expired"
    assert row["detail"]["transfer_id"] == proposal["transfer_id"] and row["detail"]["status"] == "cancelled"
    assert assistant.sessions.get("s1", C1).pending is None  # its next turn finds nothing to confirm
    assistant.sweeper.sweep()
    late = asyncio.run(assistant.turn(Caller(C1, "s1", {}, proposal["action_id"]), text="yes"))
    assert not late.executed and late.pending is None
    assert calls.cancels == [proposal["transfer_id"]] and len(swept(assistant)) == 1  # exactly once
    assert [e for e in assistant.audit.entries(C1, "s1") if e["event"] == "pending_expired"] == [row]


def test_an_evicted_proposal_is_cancelled_but_never_inside_the_evicting_turn(assistant, calls):
    """The in-process store keeps 10,000 dialogue states; the least recently used one went, and its proposal
    with it, still 'pending' in the bank. Eviction happens inside another customer's turn: that turn must
    not call the bank for it (nor wait for it, nor fail with it)."""
    assistant.sessions.max_sessions = 1
    proposal = propose(assistant, "s1")
    calls.down = True
    other = asyncio.run(assistant.turn(Caller(C2, "s2"), text="what's my balance"))  # evicts s1's state
    assert other.intent == "balance_inquiry" and not calls.started.is_set()
    assert status(assistant, proposal["transfer_id"]) == "pending"
    calls.down = False
    assistant.sweeper.sweep()  # evicted: due at once, well inside the proposal's 60 s
    assert status(assistant, proposal["transfer_id"]) == "cancelled"
    assert [r["event"] for r in swept(assistant)] == ["pending_evicted"]
    late = asyncio.run(assistant.turn(Caller(C1, "s1", {}, proposal["action_id"]), text="yes"))
    assert not late.executed and calls.cancels == [proposal["transfer_id"]]


def test_a_bank_that_does_not_answer_is_retried_until_it_does(assistant, calls):
    proposals = [propose(assistant, "s1"), propose(assistant, "s2")]
    calls.down = True
    assistant.sweeper.clock.offset_s = TTL_S + 1
    assistant.sweeper.sweep()  # no exception: the sweeper runs beside the server, nobody waits on it
    assert calls.tries == 1  # a bank that did not answer one would not answer the next: the pass ends
    assert [status(assistant, p["transfer_id"]) for p in proposals] == ["pending", "pending"]
    assert swept(assistant) == []
    calls.down = False
    assistant.sweeper.sweep()
    assert calls.tries == 1  # not hammering the bank: the next try is retry_s later
    assistant.sweeper.clock.offset_s += assistant.sweeper.retry_s
    assistant.sweeper.sweep()
    assert [status(assistant, p["transfer_id"]) for p in proposals] == ["cancelled", "cancelled"]
    assert len(swept(assistant)) == 2


def test_a_transfer_the_bank_refuses_to_cancel_holds_up_no_other(assistant, calls, monkeypatch):
    first, second = propose(assistant, "s1"), propose(assistant, "s2")
    real = SQLCustomerBank.cancel_transfer

    def refuse_the_first(view, transfer_id):
        if transfer_id == first["transfer_id"]:
            raise ValueError("injected: an answer the bank's API does not promise")
        real(view, transfer_id)

    monkeypatch.setattr(SQLCustomerBank, "cancel_transfer", refuse_the_first)
    assistant.sweeper.clock.offset_s = TTL_S + 1
    assistant.sweeper.sweep()
    assert [status(assistant, p["transfer_id"]) for p in (first, second)] == ["pending", "cancelled"]


def test_the_cancellations_owed_are_bounded_and_what_overflows_is_logged(assistant, calls, caplog):
    assistant.sessions = SessionStore(max_sessions=1, max_owed=2)
    assistant.sweeper.store = assistant.sessions
    calls.down = True
    proposals = [propose(assistant, f"s{i}") for i in range(4)]  # each evicts the one before
    lost = proposals[2]["transfer_id"]
    assert any(lost in r.getMessage() and r.levelno == logging.ERROR for r in caplog.records)
    calls.down = False
    assistant.sweeper.clock.offset_s = TTL_S + 1
    assistant.sweeper.sweep()
    assistant.sweeper.sweep()  # the owed list was full: the live expired proposal is taken next time
    assert [status(assistant, p["transfer_id"]) for p in proposals] == [
        "cancelled",
        "cancelled",
        "pending",  # logged above for an operator: the bank was not answering
        "cancelled",
    ]


def test_a_slow_bank_never_blocks_the_event_loop_or_another_customers_turn(assistant, calls):
    proposal = propose(assistant, "s1")
    calls.gate = threading.Event()
    assistant.sweeper.clock.offset_s = TTL_S + 1
    assistant.sweeper.interval_s = 0.01

    async def scenario() -> None:
        sweeping = asyncio.create_task(assistant.sweeper.run())
        for _ in range(500):
            if calls.started.is_set():
                break
            await asyncio.sleep(0.01)
        assert calls.started.is_set()  # the sweeper is inside the bank's cancel, which does not return
        other = await asyncio.wait_for(assistant.turn(Caller(C2, "s2"), text="what's my balance"), 5)
        mine = await asyncio.wait_for(assistant.turn(Caller(C1, "s3"), text="what's my balance"), 5)
        assert other.intent == mine.intent == "balance_inquiry"
        calls.gate.set()
        for _ in range(500):
            if calls.cancels:
                break
            await asyncio.sleep(0.01)
        sweeping.cancel()

    asyncio.run(scenario())
    assert status(assistant, proposal["transfer_id"]) == "cancelled"


def test_a_state_evicted_or_aged_during_its_own_turn_is_taken_only_after_the_turn():
    """Taking a proposal out of a state must not interleave with a decision on that state: a turn holds it
    from ``begin`` to ``commit``, and hands over what was evicted meanwhile when it ends."""
    store = SessionStore(max_sessions=1)
    proposal = PendingAction("transfer_money", "t-1", {}, created_at=1000.0)
    state = store.begin("s1", C1)
    state.pending = proposal
    store.begin("s2", C1)  # evicts s1 while its turn still runs
    assert store.stale(now=2000.0, ttl_s=TTL_S, retry_s=30, limit=10) == []
    assert store.commit(state)
    (owed,) = store.stale(now=2000.0, ttl_s=TTL_S, retry_s=30, limit=10)
    assert (owed.action_id, owed.transfer_id, owed.reason) == (proposal.action_id, "t-1", "evicted")

    aged = store.begin("s3", C1)
    aged.pending = PendingAction("transfer_money", "t-2", {}, created_at=1000.0)
    assert store.stale(now=2000.0, ttl_s=TTL_S, retry_s=30, limit=10) == []  # its turn holds it
    store.release(aged)
    (owed,) = store.stale(now=2000.0, ttl_s=TTL_S, retry_s=30, limit=10)
    assert owed.transfer_id == "t-2" and owed.reason == "expired" and aged.pending is None
    assert store.cancelled(owed) and not store.cancelled(owed)


# --- the reverse race: a yes arriving as its proposal is cancelled ------------------------------------------
class CancelledUnderTheYes:
    """The customer's bank view, in which the sweeper's cancellation lands between the policy's read of the
    transfer and its execution: the bank lets one of the two win, and here it is the cancellation."""

    def __init__(self, view):
        self.view = view

    def __getattr__(self, name):
        return getattr(self.view, name)

    def execute_transfer(self, transfer_id, idempotency_key, today=None):
        self.view.cancel_transfer(transfer_id)
        return self.view.execute_transfer(transfer_id, idempotency_key, today)


def test_a_yes_that_lost_to_the_cancellation_is_refused_not_an_error():
    db = demo_db()
    now = [time.time()]
    policy = Policy(db, clock=lambda: now[0])
    classifier = IntentClassifier(PayeeIndex(db))
    session = SessionState("s1", db.customer_id)
    proposed = policy.decide(session, classifier.classify(normalize("send 40 dollars to Tom Wilson")), "")
    policy.db = CancelledUnderTheYes(db)
    late = policy.decide(session, classifier.classify(normalize("yes")), "yes", proposed.pending["action_id"])
    assert not late.executed and late.refused == "not_pending"
    assert [t["status"] for t in db.transfers()] == ["cancelled"]


# --- the shared store ---------------------------------------------------------------------------------------
def _replica(bank_path, store: SQLStateStore, clock: Later) -> Assistant:
    from g4serve_assistant.db import SQLiteBank

    assistant = Assistant(SQLiteBank(bank_path), state=store, recognizer=None)
    assistant.sweeper.clock = clock
    return assistant


def _propose(store: SQLStateStore, session_id: str, created_at: float = 1000.0) -> PendingAction:
    state = store.conversations.begin(session_id, C1)
    state.pending = PendingAction("transfer_money", f"t-{session_id}", {}, created_at=created_at)
    assert store.conversations.commit(state)
    return state.pending


def test_a_restart_finds_the_proposals_left_in_the_shared_store(state_replicas, tmp_path, calls):
    bank_path = tmp_path / "bank.db"
    demo_bank(bank_path).close()
    clock = Later()  # the sweepers' and the stores' (the proposals are made on the real one)
    a = _replica(bank_path, state_replicas(clock=clock), clock)
    proposal = propose(a, "s1")
    calls.down = True
    clock.offset_s = TTL_S + 1
    a.sweeper.sweep()  # the bank is down; then this replica dies
    calls.down = False
    store = state_replicas(clock=clock)
    b = _replica(bank_path, store, clock)  # the restarted server (or any other replica)
    clock.offset_s += b.sweeper.retry_s + 1
    b.sweeper.sweep()
    assert status(b, proposal["transfer_id"]) == "cancelled"
    state = store.conversations.begin("s1", C1)
    assert state.pending is None  # its next turn finds nothing to confirm or cancel
    store.conversations.release(state)
    assert [r["event"] for r in swept(b)] == ["pending_expired"]
    b.sweeper.sweep()
    a.sweeper.sweep()
    late = asyncio.run(b.turn(Caller(C1, "s1", {}, proposal["action_id"]), text="yes"))
    assert not late.executed and late.pending is None
    assert calls.cancels == [proposal["transfer_id"]] and len(swept(b)) == 1


def test_purging_idle_rows_keeps_the_proposals_owed_a_cancellation(state_replicas, tmp_path):
    bank_path = tmp_path / "bank.db"
    demo_bank(bank_path).close()
    clock = Later()
    store = state_replicas(clock=clock, session_ttl_s=100)
    a = _replica(bank_path, store, clock)
    proposal = propose(a, "s1")
    clock.offset_s = 1000  # idle for a whole session lifetime, and not yet swept (the bank was down)
    store.purge()
    a.sweeper.sweep()
    assert status(a, proposal["transfer_id"]) == "cancelled"


def test_a_confirmation_and_the_sweeper_race_for_one_action(state_replicas):
    a, b = state_replicas(), state_replicas()
    mine = SessionState("s1", C1)
    first = _propose(a, "s1")
    (taken,) = b.conversations.stale(now=1061.0, ttl_s=TTL_S, retry_s=30, limit=10)
    assert taken.action_id == first.action_id
    # A replica whose clock is a little behind still thinks the yes is in time: the sweeper's hold wins.
    assert not a.conversations.claim(mine, first, 1030.0, TTL_S)
    assert a.conversations.stale(now=1061.0, ttl_s=TTL_S, retry_s=30, limit=10) == []  # one sweeper
    assert b.conversations.cancelled(taken) and not a.conversations.cancelled(taken)
    assert a.conversations.action_status(first.action_id) == "dropped"

    second = _propose(a, "s2")
    mine = SessionState("s2", C1)
    assert a.conversations.claim(mine, second, 1030.0, TTL_S)  # the yes won first
    assert b.conversations.stale(now=1061.0, ttl_s=TTL_S, retry_s=30, limit=10) == []
    a.conversations.settle(mine, second, done=False)  # the bank did not answer the execution
    (taken,) = b.conversations.stale(now=1061.0, ttl_s=TTL_S, retry_s=30, limit=10)
    assert taken.action_id == second.action_id  # too late for a retried yes now: the sweeper's


def test_a_turn_ending_meanwhile_leaves_what_the_sweeper_holds_to_the_sweeper(state_replicas):
    """A turn that held the session while the sweeper took its proposal (so it stayed in the turn's state)
    writes back a state without it: that must not settle the row, as the bank may not have cancelled yet."""
    a, b = state_replicas(), state_replicas()
    _propose(a, "s1")
    turn = a.conversations.begin("s1", C1)
    assert len(b.conversations.stale(now=1061.0, ttl_s=TTL_S, retry_s=0.0, limit=10)) == 1
    assert turn.pending is not None  # the turn's lease kept its state as it was
    turn.pending = None  # its yes lost the claim (a replica whose clock thought it in time)
    assert a.conversations.commit(turn)
    (again,) = b.conversations.stale(now=1061.0, ttl_s=TTL_S, retry_s=30, limit=10)  # the bank was down
    assert again.transfer_id == "t-s1"


def test_a_dead_replicas_execution_is_settled_by_the_sweeper(state_replicas):
    a, b = state_replicas(), state_replicas()
    a.conversations.claim_lease_s = 0.0  # claimed, then the replica died before settling
    pending = _propose(a, "s1")
    assert a.conversations.claim(SessionState("s1", C1), pending, 1030.0, TTL_S)
    (taken,) = b.conversations.stale(now=1061.0, ttl_s=TTL_S, retry_s=30, limit=10)
    assert taken.transfer_id == "t-s1"


# --- the app ------------------------------------------------------------------------------------------------
def _app(assistant: Assistant, **access_kwargs):
    pytest.importorskip("httpx")
    from fastapi.testclient import TestClient

    from g4serve_assistant.app import AccessSettings, build_app

    access = AccessSettings.ephemeral(admin_api_key="operator-key-0123456789", **access_kwargs)
    return TestClient(build_app(assistant, access, warmup=False)), access


def _sign_in(client, access) -> tuple[dict, str]:
    headers = {"authorization": f"Bearer {access.signer.mint(C1)}"}
    r = client.post("/v1/assistant/sessions", json={}, headers=headers)
    assert r.status_code == 201
    return headers, r.json()["session_id"]


def _propose_over_http(client, headers: dict, session_id: str) -> dict:
    body = {"session_id": session_id, "text": "send 40 dollars to Tom Wilson"}
    r = client.post("/v1/assistant/turn", json=body, headers=headers)
    assert r.status_code == 200 and r.json()["needs_confirmation"]
    return r.json()


def test_the_app_sweeps_the_proposal_of_an_expired_session(assistant):
    from g4serve_assistant.auth import SessionRegistry

    now = [time.time()]
    sessions = SessionRegistry(ttl_s=600, clock=lambda: now[0])
    assistant.sweeper.interval_s = 0.01
    client, access = _app(assistant, sessions=sessions)
    with client:
        headers, session_id = _sign_in(client, access)
        proposal = _propose_over_http(client, headers, session_id)
        now[0] += 601  # the session expired: its yes is refused, so nothing could ever confirm it
        yes = {"session_id": session_id, "text": "yes", "action_id": proposal["pending"]["action_id"]}
        assert client.post("/v1/assistant/turn", json=yes, headers=headers).status_code == 403
        assistant.sweeper.clock.offset_s = TTL_S + 1
        for _ in range(500):
            if status(assistant, proposal["action"]["transfer_id"]) == "cancelled":
                break
            time.sleep(0.01)
        assert status(assistant, proposal["action"]["transfer_id"]) == "cancelled"


def test_stopping_an_in_memory_server_cancels_its_proposals(assistant):
    """In memory the sessions die with the process: no confirmation can reach their proposals after it."""
    client, access = _app(assistant)
    with client:
        headers, session_id = _sign_in(client, access)
        proposal = _propose_over_http(client, headers, session_id)
        assert status(assistant, proposal["action"]["transfer_id"]) == "pending"
    assert status(assistant, proposal["action"]["transfer_id"]) == "cancelled"
    assert [r["event"] for r in swept(assistant)] == ["pending_stopped"]


def test_stopping_a_replica_of_a_shared_store_leaves_its_sessions_proposals_alone(state_replicas, tmp_path):
    """With the shared store the sessions outlive this process (another replica, or this one restarted, takes
    their next turn): stopping must not cancel what a customer is about to confirm elsewhere."""
    bank_path = tmp_path / "bank.db"
    demo_bank(bank_path).close()
    client, access = _app(_replica(bank_path, state_replicas(), Later()))
    with client:
        headers, session_id = _sign_in(client, access)
        proposal = _propose_over_http(client, headers, session_id)
    other = _replica(bank_path, state_replicas(), Later())
    assert status(other, proposal["action"]["transfer_id"]) == "pending"
    yes = Caller(C1, session_id, {}, proposal["pending"]["action_id"])
    assert asyncio.run(other.turn(yes, text="yes")).executed
