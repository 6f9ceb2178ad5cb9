"""The shared state store (state_sql.py) on SQLite and on a real PostgreSQL server, the same tests on both:
sessions, dialogue state under per-session leases, the one claim a confirmation must win, the audit chain,
and two assistant replicas sharing one store (any replica takes any turn; money moves once)."""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
import uuid

import pytest

from g4serve_assistant.auth import AuthError
from g4serve_assistant.db import DEMO_CUSTOMER_2_ID, DEMO_CUSTOMER_ID, demo_bank
from g4serve_assistant.intents import IntentClassifier
from g4serve_assistant.normalize import normalize
from g4serve_assistant.payees import PayeeIndex
from g4serve_assistant.pipeline import Assistant, Caller
from g4serve_assistant.policy import PendingAction, Policy, SessionState
from g4serve_assistant.state import SessionBusyError, pending_from_json, pending_to_json
from g4serve_assistant.state_sql import SQLStateStore

C1, C2 = DEMO_CUSTOMER_ID, DEMO_CUSTOMER_2_ID
CHECKING = 123_456  # the first demo customer's checking balance, minor units


def _pending(**kwargs) -> PendingAction:
    fields = {
        "kind": "transfer_money",
        "transfer_id": "t-1",
        "entities": {"amount_minor": 5000},
        "created_at": 1000.0,
    }
    return PendingAction(**(fields | kwargs))


def _propose(store: SQLStateStore, session_id: str, customer_id: str = C1, **kwargs) -> PendingAction:
    """A turn that leaves a proposal waiting for its yes."""
    state = store.conversations.begin(session_id, customer_id)
    state.pending = _pending(**kwargs)
    assert store.conversations.commit(state)
    return state.pending


# --- sessions ------------------------------------------------------------------------------------------
def test_sessions_are_shared_bound_to_their_customer_and_expire(state_replicas):
    now = [1000.0]
    a, b = (
        state_replicas(clock=lambda: now[0], session_ttl_s=100),
        state_replicas(clock=lambda: now[0], session_ttl_s=100),
    )
    session = a.sessions.create(C1, {"ip": "1.2.3.4"})
    assert b.sessions.get(session.session_id, C1).client == {"ip": "1.2.3.4"}  # any replica knows it
    with pytest.raises(AuthError) as refused:
        b.sessions.get(session.session_id, C2)  # another customer's: the same 403 as an unknown id
    assert refused.value.status == 403
    last = session.session_id[-1]
    one_off = session.session_id[:-1] + ("B" if last == "A" else "A")  # never the id itself (1 in 64 was)
    forged = ["x" * 43, one_off, "", "a\x00b", "\ud800", "é" * 10, "a" * 129, None, 42]
    for session_id in forged:
        with pytest.raises(AuthError):
            b.sessions.get(session_id, C1)
    now[0] += 100
    with pytest.raises(AuthError):
        b.sessions.get(session.session_id, C1)  # expired
    assert len(a.sessions) == 0


def test_sessions_end_only_by_their_customer_and_are_bounded(state_replicas):
    a, b = state_replicas(max_per_customer=3), state_replicas()
    session = a.sessions.create(C1)
    assert not b.sessions.end(session.session_id, C2)
    assert b.sessions.end(session.session_id, C1)
    with pytest.raises(AuthError):
        a.sessions.get(session.session_id, C1)
    made = [a.sessions.create(C1).session_id for _ in range(5)]
    with pytest.raises(AuthError):
        a.sessions.get(made[0], C1)  # the oldest went
    assert a.sessions.get(made[-1], C1).customer_id == C1
    assert len(a.sessions) == 3


# --- dialogue state ---------------------------------------------------------------------------------------
def test_the_state_of_a_turn_is_read_by_the_next_turn_on_another_replica(state_replicas):
    a, b = state_replicas(), state_replicas()
    state = a.conversations.begin("s1", C1)
    assert state.pending is None and state.turns == 0
    state.turns = 1
    state.pending = _pending(awaiting="date", entities={"date": dt.date(2025, 5, 9), "payee_id": "p-1"})
    assert a.conversations.commit(state)
    again = b.conversations.begin("s1", C1)
    assert again.turns == 1 and again.pending == state.pending
    assert isinstance(again.pending.entities["date"], dt.date)
    b.conversations.release(again)


def test_pending_actions_round_trip():
    pending = _pending(choices=["p-1", "p-2"], entities={"date": dt.date(2025, 1, 2), "tags": ("a",)})
    back = pending_from_json(pending_to_json(pending))
    assert (
        back.entities == {"date": dt.date(2025, 1, 2), "tags": ["a"]} and back.action_id == pending.action_id
    )
    assert pending_from_json(pending_to_json(None)) is None


def test_another_customers_session_state_is_refused(state_replicas):
    a, b = state_replicas(), state_replicas()
    a.conversations.commit(a.conversations.begin("s1", C1))
    with pytest.raises(PermissionError):
        b.conversations.begin("s1", C2)


def test_one_turn_at_a_time_per_session_across_replicas(state_replicas):
    a, b = state_replicas(lease_wait_s=0.2), state_replicas(lease_wait_s=0.2)
    held = a.conversations.begin("s1", C1)
    with pytest.raises(SessionBusyError):
        b.conversations.begin("s1", C1)
    assert b.conversations.begin("s2", C1).session_id == "s2"  # other sessions are not held up
    a.conversations.release(held)
    b.conversations.release(b.conversations.begin("s1", C1))


def test_a_lapsed_lease_is_taken_over_and_its_late_write_refused(state_replicas):
    a, b = state_replicas(lease_s=0.05), state_replicas(lease_s=5)
    slow = a.conversations.begin("s1", C1)  # a replica that stalls (or died) mid-turn
    fast = b.conversations.begin("s1", C1)  # waits out the 50 ms lease, then takes the session
    fast.turns = 7
    assert b.conversations.commit(fast)
    slow.turns = 99
    assert not a.conversations.commit(slow)  # the stale write does not overwrite the newer state
    assert b.conversations.begin("s1", C1).turns == 7


# --- confirmations --------------------------------------------------------------------------------------
def test_two_replicas_confirming_one_action_exactly_one_wins(state_replicas):
    a, b = state_replicas(), state_replicas()
    stores = [a, b, a, b]  # two threads per replica, each on its own connection where the dialect has them
    for round_ in range(10):
        session_id = f"s{round_}"
        pending = _propose(a, session_id)
        state = SessionState(session_id, C1)
        start = threading.Barrier(len(stores))
        won: list[bool] = []

        def confirm(store: SQLStateStore) -> None:
            start.wait()
            won.append(store.conversations.claim(state, pending, now=1001.0, ttl_s=60))

        threads = [threading.Thread(target=confirm, args=(s,)) for s in stores]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(won) == [False, False, False, True], round_
        assert a.conversations.action_status(pending.action_id) == "executing"


def test_a_confirmation_binds_to_its_one_action(state_replicas):
    a, b = state_replicas(), state_replicas()
    pending = _propose(a, "s1")
    mine = SessionState("s1", C1)
    assert not b.conversations.claim(SessionState("s2", C1), pending, 1001.0, 60)  # another session
    assert not b.conversations.claim(SessionState("s1", C2), pending, 1001.0, 60)  # another customer
    assert not b.conversations.claim(mine, _pending(), 1001.0, 60)  # an action never proposed
    assert not b.conversations.claim(mine, pending, 1061.0, 60)  # expired
    assert b.conversations.claim(mine, pending, 1001.0, 60)
    b.conversations.settle(mine, pending, done=False)  # the bank did not answer: it waits again
    assert a.conversations.claim(mine, pending, 1002.0, 60)
    a.conversations.settle(mine, pending, done=True)
    assert not b.conversations.claim(mine, pending, 1003.0, 60)  # replay
    assert a.conversations.action_status(pending.action_id) == "done"


def test_a_replaced_or_dropped_proposal_can_never_be_confirmed(state_replicas):
    a, b = state_replicas(), state_replicas()
    first = _propose(a, "s1")
    second = _propose(b, "s1")  # a new request replaced it
    mine = SessionState("s1", C1)
    assert a.conversations.action_status(first.action_id) == "dropped"
    assert not a.conversations.claim(mine, first, 1001.0, 60)
    b.conversations.drop("s1")  # the session ended
    assert not a.conversations.claim(mine, second, 1001.0, 60)


def test_a_dead_replicas_claim_lapses(state_replicas):
    a, b = state_replicas(), state_replicas()
    b.conversations.claim_lease_s = 0.0  # a claim that was never settled (the replica died)
    pending = _propose(a, "s1")
    mine = SessionState("s1", C1)
    assert b.conversations.claim(mine, pending, 1001.0, 60)
    assert a.conversations.claim(mine, pending, 1001.0, 60)  # the retried yes; the bank's key pays once


# --- the audit chain --------------------------------------------------------------------------------------
def test_replicas_append_to_one_chain(state_replicas):
    from g4serve_assistant.audit import AuditRow

    stores = [state_replicas(audit_key=b"k" * 32), state_replicas(audit_key=b"k" * 32)]

    def write(store: SQLStateStore, n: int) -> None:
        for i in range(20):
            store.audit.append(
                [AuditRow("turn", "fast", {"i": i, "n": n}), AuditRow("policy", "answered", {}, "answered")],
                customer_id=C1,
                session_id=f"s{n}",
                client={},
            )

    threads = [threading.Thread(target=write, args=(stores[n % 2], n)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    check = stores[1].audit.verify()
    assert check.ok and check.rows == 160
    assert stores[0].audit.head() == stores[1].audit.head()
    assert [e["detail"]["i"] for e in stores[0].audit.entries(session_id="s3")[::2]] == list(range(20))
    assert not state_replicas(audit_key=b"x" * 32).audit.verify().ok  # the key is what makes it verify


def test_the_audit_table_is_append_only(state_replicas):
    from g4serve_assistant.audit import AuditRow

    store = state_replicas()
    store.audit.append([AuditRow("turn", "fast", {})], customer_id=C1, session_id="s1", client={})
    for statement in ("UPDATE audit_chain SET outcome = 'executed'", "DELETE FROM audit_chain"):
        with pytest.raises(Exception, match="append-only"), store.db.transaction() as tx:
            tx.run(statement)
    assert store.audit.verify().ok


# --- two policies, two assistants ------------------------------------------------------------------------
class Replica:
    """One replica's policy over the shared store, on a clock the test moves; turns as the pipeline runs
    them (begin, decide, commit)."""

    def __init__(self, bank, store: SQLStateStore, clock: list[float], customer_id: str = C1):
        view = bank.customer(customer_id)
        self.classifier = IntentClassifier(PayeeIndex(view))
        self.store = store
        self.clock = clock
        self.policy = Policy(view, clock=lambda: clock[0], claims=store.conversations)

    def say(self, text: str, session_id: str, action_id: str | None = None):
        state = self.store.conversations.begin(session_id, self.policy.db.customer_id)
        try:
            now = dt.datetime.fromtimestamp(self.clock[0])
            decision = self.policy.decide(
                state, self.classifier.classify(normalize(text, now=now)), text, action_id
            )
        except BaseException:
            self.store.conversations.release(state)
            raise
        self.store.conversations.commit(state)
        return decision


def test_a_confirmation_after_expiry_fails_on_any_replica(state_replicas, tmp_path):
    bank = demo_bank(tmp_path / "bank.db")
    clock = [dt.datetime(2025, 5, 7, 10, 0).timestamp()]
    a, b = Replica(bank, state_replicas(), clock), Replica(bank, state_replicas(), clock)
    proposed = a.say("send fifty dollars to John Smith", "s1")
    clock[0] += 61
    late = b.say("yes", "s1", proposed.pending["action_id"])
    assert not late.executed and "timed out" in late.reply
    assert bank.customer(C1).transfers(status="executed") == []


def test_a_replica_that_lost_the_race_says_so(state_replicas, tmp_path):
    """Both replicas hold the proposal (read before either confirmed); the claim lets only one execute."""
    bank = demo_bank(tmp_path / "bank.db")
    clock = [dt.datetime(2025, 5, 7, 10, 0).timestamp()]
    store_a, store_b = state_replicas(), state_replicas()
    a, b = Replica(bank, store_a, clock), Replica(bank, store_b, clock)
    action_id = a.say("send fifty dollars to John Smith", "s1").pending["action_id"]
    stale = store_b.conversations.begin("s1", C1)  # as if b's turn began before a's lease
    store_b.conversations.release(stale)
    assert a.say("yes", "s1", action_id).executed
    yes = b.classifier.classify(normalize("yes"))
    late = b.policy.decide(stale, yes, "yes", action_id)
    assert not late.executed and late.refused == "not_pending"
    assert bank.customer(C1).balance("chk-001")["balance_minor"] == CHECKING - 5000


def _assistant(bank_path, store: SQLStateStore) -> Assistant:
    from g4serve_assistant.db import SQLiteBank

    return Assistant(SQLiteBank(bank_path), state=store, recognizer=None)


def test_any_replica_takes_any_turn_and_money_moves_once(state_replicas, tmp_path):
    bank_path = tmp_path / "bank.db"
    demo_bank(bank_path).close()
    key = b"k" * 32
    a, b = (
        _assistant(bank_path, state_replicas(audit_key=key)),
        _assistant(bank_path, state_replicas(audit_key=key)),
    )
    caller = Caller(C1, "s1", {"ip": "1.2.3.4"})

    proposed = asyncio.run(a.turn(caller, text="send fifty dollars to John Smith"))
    action_id = proposed.pending["action_id"]
    yes = Caller(C1, "s1", {"ip": "1.2.3.4"}, action_id)
    done = asyncio.run(b.turn(yes, text="yes"))  # the other replica
    assert done.executed and "Done" in done.reply
    replay = asyncio.run(a.turn(yes, text="yes"))
    assert not replay.executed
    stranger = Caller(C2, "s9", {}, action_id)  # another customer naming this action
    assert not asyncio.run(b.turn(stranger, text="yes")).executed

    view = b.bank.customer(C1)
    assert view.balance("chk-001")["balance_minor"] == CHECKING - 5000
    assert len(view.transfers(status="executed")) == 1
    check = a.audit.verify()
    assert check.ok and check.rows == len(b.audit.entries())
    outcomes = [
        e["outcome"] for e in b.audit.entries(session_id="s1") if e["stage"] == "policy" and e["outcome"]
    ]
    assert outcomes == ["proposed", "executed", "answered"]


def test_logging_out_on_one_replica_cancels_a_proposal_made_on_another(state_replicas, tmp_path):
    bank_path = tmp_path / "bank.db"
    demo_bank(bank_path).close()
    store_a, store_b = state_replicas(), state_replicas()
    a, b = _assistant(bank_path, store_a), _assistant(bank_path, store_b)
    proposed = asyncio.run(a.turn(Caller(C1, "s1"), text="send fifty dollars to John Smith"))
    action_id, transfer_id = proposed.pending["action_id"], proposed.action["transfer_id"]
    stale = store_a.conversations.begin("s1", C1)  # a slow turn on a read the state before the logout
    store_a.conversations.release(stale)
    asyncio.run(b.end_session(Caller(C1, "s1")))
    view = a.bank.customer(C1)
    assert view.transfer(transfer_id)["status"] == "cancelled"
    assert store_a.conversations.action_status(action_id) == "dropped"
    customer = a.customer(C1)
    late = customer.policy.decide(stale, customer.classifier.classify(normalize("yes")), "yes", action_id)
    assert not late.executed and late.refused == "not_pending"
    assert not asyncio.run(a.turn(Caller(C1, "s1", {}, action_id), text="yes")).executed
    assert view.transfers(status="executed") == []


def test_concurrent_confirmations_on_four_replicas_execute_once(state_replicas, tmp_path):
    bank_path = tmp_path / "bank.db"
    demo_bank(bank_path).close()
    # One event loop per replica, as in production (an Assistant's per-session asyncio locks are its loop's).
    four = [_assistant(bank_path, state_replicas()) for _ in range(4)]
    a = four[0]
    proposed = asyncio.run(a.turn(Caller(C1, "s1"), text="send fifty dollars to John Smith"))
    yes = Caller(C1, "s1", {}, proposed.pending["action_id"])
    start = threading.Barrier(4)
    results = []

    def confirm(assistant: Assistant) -> None:
        start.wait()
        results.append(asyncio.run(assistant.turn(yes, text="yes")))

    threads = [threading.Thread(target=confirm, args=(x,)) for x in four]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(r.executed for r in results) == 1
    assert a.bank.customer(C1).balance("chk-001")["balance_minor"] == CHECKING - 5000
    assert a.audit.verify().ok


def test_two_apps_share_sessions_and_confirmations(state_replicas, tmp_path):
    pytest.importorskip("httpx")
    from fastapi.testclient import TestClient

    from g4serve_assistant.app import AccessSettings, build_app
    from g4serve_assistant.auth import TokenSigner

    bank_path = tmp_path / "bank.db"
    demo_bank(bank_path).close()
    signer = TokenSigner(b"s" * 32)  # the bank's login signs for every replica

    def app(store: SQLStateStore) -> TestClient:
        access = AccessSettings(signer, customer_rate_per_min=6000, customer_burst=100)
        return TestClient(build_app(_assistant(bank_path, store), access, warmup=False))

    a, b = app(state_replicas()), app(state_replicas())
    headers = {"authorization": f"Bearer {signer.mint(C1)}"}
    session_id = a.post("/v1/assistant/sessions", json={}, headers=headers).json()["session_id"]
    proposed = b.post(
        "/v1/assistant/turn",
        json={"session_id": session_id, "text": "send $50 to John Smith"},
        headers=headers,
    ).json()
    action_id = proposed["pending"]["action_id"]
    turn = {"session_id": session_id, "text": "yes", "action_id": action_id}
    assert a.post("/v1/assistant/turn", json=turn, headers=headers).json()["executed"]
    assert not b.post("/v1/assistant/turn", json=turn, headers=headers).json()["executed"]

    other = {"authorization": f"Bearer {signer.mint(C2)}"}
    r = b.post("/v1/assistant/turn", json=turn, headers=other)  # another customer, this session id
    assert r.status_code == 403
    assert b.delete(f"/v1/assistant/sessions/{session_id}", headers=headers).status_code == 200
    r = a.post("/v1/assistant/turn", json=turn, headers=headers)  # ended on b: gone on a too
    assert r.status_code == 403


# --- selected by the CLI -----------------------------------------------------------------------------------
def test_the_cli_picks_the_store(tmp_path, monkeypatch):
    from g4serve_assistant.cli import STATE_DB_ENV, build_parser, state_db_url

    def url(*argv: str) -> str:
        return state_db_url(build_parser().parse_args(["--db", str(tmp_path / "bank.db"), *argv]))

    monkeypatch.delenv(STATE_DB_ENV, raising=False)
    assert url() == str(tmp_path / "bank.db")  # the embedded default: beside the bank
    assert url("--audit-db", "a.db") == "a.db"
    monkeypatch.setenv(STATE_DB_ENV, "postgresql://db/assistant")
    assert url() == "postgresql://db/assistant"
    assert url("--state-db", "s.db") == "s.db"
    with pytest.raises(ValueError, match="--audit-db"):
        url("--state-db", "s.db", "--audit-db", "a.db")


def test_two_servers_from_the_cli_share_a_postgresql_store(postgres_url, tmp_path):
    import psycopg
    from cli_replicas import pay_across_two_replicas

    schema = f"cli_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    bank = tmp_path / "bank.db"
    demo_bank(bank).close()
    argv = ["--no-llm", "--db", str(bank), "--state-db", f"{postgres_url}&options=-csearch_path%3D{schema}"]
    a, b, _, _ = pay_across_two_replicas(argv, C1, tmp_path / "secret")
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        listed = conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = %s", (schema,)
        )
        tables = {row[0] for row in listed}
        assert {"assistant_sessions", "assistant_pending_actions", "audit_chain"} <= tables
        for client in (a, b):
            client.app.state.assistant.state.close()
        conn.execute(f"DROP SCHEMA {schema} CASCADE")
