"""Replicas of the SQL bank on one database, on SQLite and on a real PostgreSQL server alike: concurrent
payments from one account never overdraw it, an idempotency key executes once whichever replicas race, a
payment and a cancel race to one outcome, another customer's records stay unknown, amounts are refused
before the database, seeding from replicas at once seeds once. Then PostgreSQL's schema version, a URL
opening the bank on its engine, and the CLI's ``--db postgresql://``. (The schema's own guarantees, on both
engines: test_db.py.)"""

from __future__ import annotations

import datetime as dt
import threading
from collections import Counter
from collections.abc import Callable

import pytest

from g4serve_assistant.bank import MAX_AMOUNT_MINOR
from g4serve_assistant.bank_sql import SchemaTooNewError, SQLCustomerBank
from g4serve_assistant.db import DEMO_CUSTOMER_2_ID, DEMO_CUSTOMER_ID

CHECKING = 123_456  # cust-001's checking balance, minor units
TODAY = dt.date(2025, 5, 7)


def _together(jobs: list[Callable[[], object]]) -> tuple[list, list[BaseException]]:
    """Runs the jobs on threads released at once; (results, errors) in no particular order."""
    start = threading.Barrier(len(jobs))
    results: list = []
    errors: list[BaseException] = []

    def run(job: Callable[[], object]) -> None:
        start.wait()
        try:
            results.append(job())
        except BaseException as exc:  # noqa: BLE001 - reported to the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, errors


# --- money --------------------------------------------------------------------------------------------
def test_replicas_paying_from_one_account_never_overdraw(bank_replicas):
    """20 payments of 100.00 from 1,234.56, executed at once by 8 threads on two replicas: 12 go through,
    8 fail for funds, and the balance is exactly what the 12 left."""
    a, b = bank_replicas(demo=True), bank_replicas()
    views = [a.customer(DEMO_CUSTOMER_ID), b.customer(DEMO_CUSTOMER_ID)]
    tids = [views[i % 2].create_transfer("s1", "john_smith", 10_000, "USD", "transfer") for i in range(20)]

    def pay(thread: int) -> list[dict]:
        view = views[thread % 2]
        return [view.execute_transfer(tid, f"key-{tid}", today=TODAY) for tid in tids[thread::8]]

    results, errors = _together([lambda n=n: pay(n) for n in range(8)])
    assert errors == []
    outcomes = Counter(t["status"] for batch in results for t in batch)
    assert outcomes == {"executed": 12, "failed": 8}
    for view in views:
        assert view.balance()["balance_minor"] == CHECKING - 12 * 10_000
        assert len(view.transfers(status="executed")) == 12
        failed = view.transfers(status="failed")
        assert len(failed) == 8 and {t["note"] for t in failed} == {"insufficient funds"}
        debits = [t for t in view.recent_transactions(1000) if t["posted_on"] == TODAY.isoformat()]
        assert sum(t["amount_minor"] for t in debits) == -12 * 10_000


def test_one_key_on_one_transfer_executes_once_across_replicas(bank_replicas):
    """A retried confirmation arriving on every replica at once: one debit, the same answer everywhere."""
    a, b = bank_replicas(demo=True), bank_replicas()
    views = [a.customer(DEMO_CUSTOMER_ID), b.customer(DEMO_CUSTOMER_ID)]
    tid = views[0].create_transfer("s1", "john_smith", 700, "USD", "transfer")
    results, errors = _together(
        [lambda v=views[n % 2]: v.execute_transfer(tid, "turn-7", today=TODAY) for n in range(8)]
    )
    assert errors == [] and len(results) == 8 and all(r == results[0] for r in results)
    assert results[0]["status"] == "executed" and results[0]["idempotency_key"] == "turn-7"
    assert views[1].balance()["balance_minor"] == CHECKING - 700
    assert [t["amount_minor"] for t in views[1].recent_transactions(1000)].count(-700) == 1


def test_one_key_on_two_transfers_at_once_executes_one(bank_replicas):
    """Two transfers raced under one key on two replicas, round after round: one executes, the other is
    refused naming it, stays pending without a key, and moves nothing."""
    a, b = bank_replicas(demo=True), bank_replicas()
    one_a, one_b = a.customer(DEMO_CUSTOMER_ID), b.customer(DEMO_CUSTOMER_ID)
    for round_ in range(10):
        first = one_a.create_transfer("s1", "john_smith", 100, "USD", "transfer")
        second = one_b.create_transfer("s1", "john_smith", 100, "USD", "transfer")
        key = f"shared-{round_}"
        results, errors = _together(
            [
                lambda: one_a.execute_transfer(first, key, today=TODAY),
                lambda: one_b.execute_transfer(second, key, today=TODAY),
            ]
        )
        assert len(results) == 1 and len(errors) == 1, errors
        winner = results[0]["transfer_id"]
        loser = second if winner == first else first
        assert isinstance(errors[0], ValueError) and f"already used for transfer {winner}" in str(errors[0])
        assert (
            one_a.transfer(loser)["status"] == "pending" and one_a.transfer(loser)["idempotency_key"] is None
        )
        assert one_b.balance()["balance_minor"] == CHECKING - 100 * (round_ + 1)


def test_a_key_taken_after_the_check_is_refused_by_the_schema(bank_replicas, monkeypatch):
    """The race above at its narrowest, made certain: the key was free when this execution checked it, and
    another transfer's execution took it before this one wrote. The unique key refuses the write; the
    whole transaction, debit included, rolls back, and the refusal names the transfer that holds the key."""
    one = bank_replicas(demo=True).customer(DEMO_CUSTOMER_ID)
    first = one.create_transfer("s1", "john_smith", 100, "USD", "transfer")
    second = one.create_transfer("s1", "john_smith", 250, "USD", "transfer")
    one.execute_transfer(first, "k", today=TODAY)
    real_holder = SQLCustomerBank._key_holder
    blind = [True]

    def holder_unseen_once(self, tx, key):
        if blind.pop() if blind else False:
            return None  # as if the other execution had not committed yet when this one looked
        return real_holder(self, tx, key)

    monkeypatch.setattr(SQLCustomerBank, "_key_holder", holder_unseen_once)
    with pytest.raises(ValueError, match=f"already used for transfer {first}"):
        one.execute_transfer(second, "k", today=TODAY)
    assert one.transfer(second)["status"] == "pending" and one.transfer(second)["idempotency_key"] is None
    assert one.balance()["balance_minor"] == CHECKING - 100
    assert len(one.recent_transactions(1000)) == 21  # 20 seeded, one debit


def test_a_payment_and_a_cancel_at_once_leave_one_outcome(bank_replicas):
    a, b = bank_replicas(demo=True), bank_replicas()
    one_a, one_b = a.customer(DEMO_CUSTOMER_ID), b.customer(DEMO_CUSTOMER_ID)
    for round_ in range(5):
        tid = one_a.create_transfer("s1", "john_smith", 100, "USD", "transfer")
        _, errors = _together(
            [
                lambda: one_a.execute_transfer(tid, f"k{round_}", today=TODAY),
                lambda: one_b.cancel_transfer(tid),
            ]
        )
        status = one_b.transfer(tid)["status"]
        assert status in ("executed", "cancelled")
        assert (status == "cancelled") == (len(errors) == 1)  # execute lost: refused, "cancelled"
    executed = len(one_a.transfers(status="executed"))
    assert one_a.balance()["balance_minor"] == CHECKING - 100 * executed


# --- customers and amounts ----------------------------------------------------------------------------
def test_another_customers_records_are_unknown_on_every_replica(bank_replicas):
    a, b = bank_replicas(demo=True), bank_replicas()
    one, two = a.customer(DEMO_CUSTOMER_ID), b.customer(DEMO_CUSTOMER_2_ID)
    tid = one.create_transfer("s1", "john_smith", 1000, "USD", "transfer")
    with pytest.raises(ValueError, match="no transfer"):
        two.execute_transfer(tid, "k-two", today=TODAY)
    two.cancel_transfer(tid)
    assert two.transfer(tid) is None and two.transfers() == []
    with pytest.raises(ValueError, match="unknown payee"):
        two.create_transfer("s2", "john_smith", 100, "GBP", "transfer")
    with pytest.raises(ValueError, match="does not exist"):
        two.create_transfer("s2", "jon_smith", 100, "USD", "transfer", from_account_id="chk-001")
    with pytest.raises(KeyError):
        two.set_card_locked("card-credit", True)
    with pytest.raises(KeyError):
        two.balance("chk-001")
    assert one.transfer(tid)["status"] == "pending" and one.balance()["balance_minor"] == CHECKING
    assert not any(c["locked"] for c in one.cards())


@pytest.mark.parametrize(
    "amount", [0, -1, -(2**63), 12.5, float("inf"), True, "100", None, MAX_AMOUNT_MINOR + 1, 2**63, 2**64]
)
def test_amounts_are_refused_before_the_database(bank_replicas, amount):
    one = bank_replicas(demo=True).customer(DEMO_CUSTOMER_ID)
    with pytest.raises(ValueError, match="amount_minor must be a positive int"):
        one.create_transfer("s1", "john_smith", amount, "USD", "transfer")
    assert one.transfers() == []


def test_replicas_seeding_at_once_seed_once(bank_replicas):
    bank_replicas().close()  # the schema first, as a deployment's first replica makes it
    results, errors = _together([lambda: bank_replicas(demo=True) for _ in range(4)])
    assert errors == []
    one = results[0].customer(DEMO_CUSTOMER_ID)
    assert (len(one.payees()), len(one.recent_transactions(1000)), one.version) == (30, 20, 1)
    assert [c["customer_id"] for c in results[1].customers()] == [DEMO_CUSTOMER_ID, DEMO_CUSTOMER_2_ID]


# --- PostgreSQL's schema -----------------------------------------------------------------------------------
def test_postgresql_schema_is_versioned_in_step_with_sqlite(postgres_banks, postgres_url, postgres_schema):
    import psycopg

    from g4serve_assistant import bank_postgres, db

    assert bank_postgres.SCHEMA_VERSION == db.SCHEMA_VERSION
    bank = postgres_banks(demo=True)
    assert bank.schema_version == db.SCHEMA_VERSION
    again = postgres_banks()  # a second replica opens it as it is
    assert again.customer(DEMO_CUSTOMER_ID).balance()["balance_minor"] == CHECKING
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(
            f"UPDATE {postgres_schema}.bank_meta SET value = %s WHERE key = 'schema_version'",
            (str(db.SCHEMA_VERSION + 1),),
        )
    with pytest.raises(SchemaTooNewError, match=rf"bank schema version {db.SCHEMA_VERSION + 1} is newer"):
        postgres_banks()


def test_a_url_opens_the_bank_on_its_engine(postgres_url, postgres_schema, tmp_path):
    import psycopg

    from g4serve_assistant.bank_postgres import PostgresBank
    from g4serve_assistant.db import SQLiteBank, open_sql_bank

    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {postgres_schema}")
    url = f"{postgres_url}&options=-csearch_path%3D{postgres_schema}"
    opened = [
        open_sql_bank(url),
        open_sql_bank(tmp_path / "a.db"),
        open_sql_bank(f"sqlite:///{tmp_path}/b.db"),
    ]
    assert [type(b) for b in opened] == [PostgresBank, SQLiteBank, SQLiteBank]
    assert opened[2].path == f"{tmp_path}/b.db"
    for bank in opened:
        bank.close()
    secret = open_sql_bank(url.replace("postgres@", "postgres:hunter2@"))  # trust auth ignores it
    assert "hunter2" not in secret.name and "***" in secret.name
    secret.close()


# --- selected by the CLI -----------------------------------------------------------------------------------
def test_the_cli_serves_and_imports_a_postgresql_bank(postgres_url, postgres_schema, tmp_path, capsys):
    """``--db postgresql://…`` everywhere a bank is opened: imports, ``--demo``, and two servers whose bank,
    sessions and audit all live in that one database (the state store defaults to the bank's database)."""
    import psycopg
    from cli_replicas import pay_across_two_replicas

    from g4serve_assistant.cli import build_parser, main, open_bank

    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {postgres_schema}")
    url = f"{postgres_url}&options=-csearch_path%3D{postgres_schema}"
    customers = tmp_path / "c.csv"
    customers.write_text(
        "customer_id,name,account_id,account_name,currency,balance_minor\nc-1,Ada,a1,main,USD,9\n"
    )
    assert main(["import-customers", str(customers), "--db", url]) == 0
    assert capsys.readouterr().out.startswith("imported 1 customers with 1 accounts into postgresql://")
    imported = open_bank(build_parser().parse_args(["--db", url]))
    assert imported.customer("c-1").balance()["balance_minor"] == 9
    imported.close()
    with pytest.raises(ValueError, match="not demo data"):
        open_bank(build_parser().parse_args(["--demo", "--db", url]))
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA {postgres_schema} CASCADE")
        conn.execute(f"CREATE SCHEMA {postgres_schema}")

    argv = ["--no-llm", "--demo", "--db", url]
    a, b, headers, turn = pay_across_two_replicas(argv, DEMO_CUSTOMER_ID, tmp_path / "secret")
    assert not b.post("/v1/assistant/turn", json=turn, headers=headers).json()["executed"]
    balance = {"session_id": turn["session_id"], "text": "what's my balance"}
    assert "$1,184.56" in b.post("/v1/assistant/turn", json=balance, headers=headers).json()["reply"]
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        listed = conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = %s", (postgres_schema,)
        )
        assert {"transfers", "accounts", "assistant_sessions", "audit_chain"} <= {row[0] for row in listed}
    for client in (a, b):
        client.app.state.assistant.state.close()
        client.app.state.assistant.bank.close()
