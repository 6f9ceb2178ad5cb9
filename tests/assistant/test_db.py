"""The SQLite store: demo seed, payee CSV import and its errors, versioning, transfers that execute at most
once, card locks, the audit trail, and use from several threads."""

from __future__ import annotations

import datetime as dt
import threading
from pathlib import Path

import pytest

from g4serve_assistant.db import BankDB, Payee, demo_db

DATA = Path(__file__).parent / "data"


@pytest.fixture
def db() -> BankDB:
    return demo_db()


def test_seed_demo_is_idempotent(db):
    counts = (len(db.payees()), len(db.accounts()), len(db.cards()), len(db.recent_transactions(100)))
    version = db.version
    db.seed_demo()
    assert (len(db.payees()), len(db.accounts()), len(db.cards()), len(db.recent_transactions(100))) == counts
    assert db.version == version
    assert counts[0] >= 30 and counts[2] == 2 and counts[3] >= 20


def test_demo_has_confusable_names_and_billers(db):
    names = {p.display_name for p in db.payees()}
    assert {"John Smith", "Jon Smythe", "Joan Smith", "Katherine Lee", "Catherine Li"} <= names
    billers = {p.display_name for p in db.payees() if p.kind == "biller"}
    assert {"City Electric", "Metro Water Utility", "Skyline Mobile"} <= billers
    assert {a["currency"] for a in db.accounts()} >= {"USD", "EUR", "JPY"}


def test_payee_lookup(db):
    john = db.payee("john_smith")
    assert (john.display_name, john.relationship, john.kind) == ("John Smith", "friend", "person")
    assert "Johnny" in john.aliases  # a contact linked to the payee
    assert db.payee("nobody") is None


def test_balance(db):
    assert db.balance() == {
        "account_id": "chk-001",
        "name": "checking",
        "balance_minor": 123_456,
        "currency": "USD",
    }
    assert db.balance("jpy-001")["currency"] == "JPY"
    with pytest.raises(KeyError, match="nope"):
        db.balance("nope")


def test_recent_transactions_newest_first(db):
    txns = db.recent_transactions(5)
    assert len(txns) == 5
    assert [t["posted_on"] for t in txns] == sorted((t["posted_on"] for t in txns), reverse=True)
    assert all(t["account_id"] == "eur-001" for t in db.recent_transactions(10, account_id="eur-001"))


def test_card_lock(db):
    db.set_card_locked("card-debit", True)
    assert {c["card_id"]: c["locked"] for c in db.cards()} == {"card-debit": True, "card-credit": False}
    db.set_card_locked("card-debit", False)
    assert not any(c["locked"] for c in db.cards())
    with pytest.raises(KeyError):
        db.set_card_locked("card-nope", True)


def test_transfer_executes_once_and_moves_money(db):
    tid = db.create_transfer("s1", "john_smith", 5000, "USD", "transfer")
    assert db.transfer(tid)["status"] == "pending"
    assert db.balance()["balance_minor"] == 123_456  # creating moves nothing
    done = db.execute_transfer(tid, today=dt.date(2025, 5, 7))
    assert done["status"] == "executed" and done["from_account_id"] == "chk-001"
    assert db.balance()["balance_minor"] == 123_456 - 5000
    newest = db.recent_transactions(1)[0]
    assert (newest["description"], newest["amount_minor"]) == ("Transfer to John Smith", -5000)
    with pytest.raises(ValueError, match="executed, not pending"):
        db.execute_transfer(tid)
    assert db.balance()["balance_minor"] == 123_456 - 5000


def test_cancelled_transfer_cannot_execute(db):
    tid = db.create_transfer("s1", "city_electric", 1000, "USD", "bill_payment")
    db.cancel_transfer(tid)
    db.cancel_transfer(tid)  # idempotent
    with pytest.raises(ValueError, match="cancelled"):
        db.execute_transfer(tid)
    assert [t["status"] for t in db.transfers()] == ["cancelled"]
    assert db.transfers(status="pending") == []


def test_transfer_pays_from_the_account_in_its_currency(db):
    tid = db.create_transfer("s1", "yuki_tanaka", 5000, "JPY", "transfer")
    db.execute_transfer(tid)
    assert db.balance("jpy-001")["balance_minor"] == 250_000 - 5000


def test_scheduled_and_failed_transfers(db):
    later = db.create_transfer("s1", "john_smith", 100, "USD", "transfer", scheduled_for=dt.date(2025, 6, 1))
    assert db.execute_transfer(later, today=dt.date(2025, 5, 7))["status"] == "scheduled"
    assert db.balance()["balance_minor"] == 123_456
    too_much = db.create_transfer("s1", "john_smith", 200_000, "USD", "transfer")
    failed = db.execute_transfer(too_much)
    assert (failed["status"], failed["note"]) == ("failed", "insufficient funds")
    assert db.balance()["balance_minor"] == 123_456


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("s", "john_smith", 100, "USD", "gift"), "kind"),
        (("s", "john_smith", 0, "USD", "transfer"), "positive"),
        (("s", "john_smith", -5, "USD", "transfer"), "positive"),
        (("s", "john_smith", True, "USD", "transfer"), "positive"),
        (("s", "john_smith", 12.5, "USD", "transfer"), "positive"),
        (("s", "ghost", 100, "USD", "transfer"), "unknown payee"),
        (("s", "john_smith", 100, "GBP", "transfer"), "no account in GBP"),
    ],
)
def test_create_transfer_validates(db, args, message):
    with pytest.raises(ValueError, match=message):
        db.create_transfer(*args)
    assert db.transfers() == []


def test_import_csv_upserts_and_bumps_version():
    db = BankDB()
    v0 = db.version
    assert db.import_payees_csv(DATA / "payees.csv") == 7
    assert db.version == v0 + 1
    assert db.payee("city_electric").kind == "biller"
    assert db.payee("city_electric").aliases == ("electric", "electricity", "power")
    assert db.payee("priya_patel").kind == "person"  # kind defaults to person
    assert db.import_payees_csv(DATA / "payees.csv") == 7  # upsert: same rows again
    assert len(db.payees()) == 7


def test_version_bumps_on_every_payee_change(db):
    v = db.version
    db.upsert_payee(Payee("new_one", "New One", "friend", "person"))
    assert db.version == v + 1
    db.add_contact("Newbie", payee_id="new_one")
    assert db.version == v + 2
    db.add_contact("Plumber", phone="+1 555 0000")  # not a payee: payees unchanged
    assert db.version == v + 2


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", r"line 1: empty file"),
        ("payee_id,display_name\nx,X\n", r"line 1, column 'relationship': missing required column"),
        (
            "payee_id,display_name,relationship,nickname\nx,X,friend,xx\n",
            r"line 1, column 'nickname': unknown column",
        ),
        (
            "payee_id,display_name,relationship\nok,Fine,friend\nbad id,Bad,friend\n",
            r"line 3, column 'payee_id'",
        ),
        ("payee_id,display_name,relationship\nx,,friend\n", r"line 2, column 'display_name'"),
        ("payee_id,display_name,relationship,kind\nx,X,friend,robot\n", r"line 2, column 'kind': 'robot'"),
        (
            "payee_id,display_name,relationship\nx,X,friend\nx,Y,friend\n",
            r"line 3, column 'payee_id': 'x' repeats line 2",
        ),
        ("payee_id,display_name,relationship\nx,X,friend,extra\n", r"line 2: expected 3 fields, got 4"),
        ("payee_id,display_name,relationship\nx,X\n", r"line 2: expected 3 fields, got 2"),
        (f"payee_id,display_name,relationship\nx,{'A' * 101},friend\n", r"line 2, column 'display_name'"),
    ],
)
def test_import_csv_errors_name_line_and_column(tmp_path, content, message):
    db = BankDB()
    path = tmp_path / "bad.csv"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        db.import_payees_csv(path)
    assert db.payees() == []  # all or nothing
    assert db.version == 0


def test_import_csv_accepts_bom_blank_lines_and_header_case(tmp_path):
    path = tmp_path / "ok.csv"
    path.write_text("\ufeffPayee_ID,Display_Name,Relationship\n\nx,X Person,friend\n\n", encoding="utf-8")
    db = BankDB()
    assert db.import_payees_csv(path) == 1
    assert db.payee("x").display_name == "X Person"


def test_audit_trail(db):
    db.audit("s1", "normalize", "rule", {"rule": "nfkc", "date": dt.date(2025, 5, 7)})
    db.audit_many("s2", [("intent", "balance_inquiry", {"confidence": 0.9}), ("policy", "answered", {})])
    assert [(r["stage"], r["event"]) for r in db.audit_log("s2")] == [
        ("intent", "balance_inquiry"),
        ("policy", "answered"),
    ]
    first = db.audit_log("s1")[0]
    assert first["detail"] == {"rule": "nfkc", "date": "2025-05-07"} and first["ts"] > 0
    assert len(db.audit_log()) == 3


def test_file_database_is_shared_between_connections(tmp_path):
    path = tmp_path / "bank.sqlite"
    a = demo_db(path)
    b = BankDB(path)
    assert len(b.payees()) == len(a.payees())
    a.upsert_payee(Payee("late", "Late Arrival", "friend", "person"))
    assert b.version == a.version  # the version lives in the database, not in one connection
    assert b.payee("late") is not None
    a.close()
    b.close()


def test_many_threads(db):
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for j in range(25):
                db.audit(f"t{i}", "stage", "event", {"j": j})
                tid = db.create_transfer(f"t{i}", "john_smith", 1, "USD", "transfer")
                db.execute_transfer(tid)
                db.payees()
        except BaseException as e:  # noqa: BLE001 - reported to the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(db.audit_log()) == 100
    assert len(db.transfers(status="executed")) == 100
    assert db.balance()["balance_minor"] == 123_456 - 100
