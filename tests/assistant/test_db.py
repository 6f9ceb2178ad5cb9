"""The SQL bank itself, on SQLite and on PostgreSQL (conftest.py's ``bank_replicas``): the demo customers,
the schema's own guarantees, the CSV imports and their errors, idempotent execution under races, several
connections to one database and use from many threads; then SQLite's migrations (a version-0 file, a failing
step, a newer file). What every backend must do is in test_bank_backends.py; replicas racing for money in
test_bank_replicas.py."""

from __future__ import annotations

import datetime as dt
import sqlite3
import threading
from pathlib import Path

import pytest
from legacy_schema import (
    EXECUTED_TRANSFER,
    LEGACY_PAYEE_VERSION,
    PENDING_TRANSFER,
    build_legacy_db,
)

from g4serve_assistant import db as db_module
from g4serve_assistant.bank import MAX_AMOUNT_MINOR, BankBackend, CustomerBank
from g4serve_assistant.db import (
    DEMO_CUSTOMER_2_ID,
    DEMO_CUSTOMER_ID,
    SCHEMA_VERSION,
    MigrationError,
    Payee,
    SchemaTooNewError,
    SQLBank,
    SQLiteBank,
    demo_bank,
    demo_db,
)

DATA = Path(__file__).parent / "data"


@pytest.fixture
def bank(bank_replicas) -> SQLBank:
    return bank_replicas(demo=True)


@pytest.fixture
def db(bank):
    return bank.customer(DEMO_CUSTOMER_ID)


def _snapshot(view) -> tuple:
    return (view.payees(), view.accounts(), view.cards(), view.recent_transactions(1000), view.version)


def test_it_implements_the_interface(bank, db):
    assert isinstance(bank, BankBackend) and isinstance(db, CustomerBank)
    assert demo_db().customer_id == DEMO_CUSTOMER_ID


def test_two_demo_customers_seeded_idempotently(bank):
    assert bank.customers() == [
        {"customer_id": DEMO_CUSTOMER_ID, "name": "Alex Morgan", "demo": True},
        {"customer_id": DEMO_CUSTOMER_2_ID, "name": "Sam Okafor", "demo": True},
    ]
    before = [_snapshot(bank.customer(c)) for c in (DEMO_CUSTOMER_ID, DEMO_CUSTOMER_2_ID)]
    bank.seed_demo()
    assert [_snapshot(bank.customer(c)) for c in (DEMO_CUSTOMER_ID, DEMO_CUSTOMER_2_ID)] == before
    one, two = before
    assert (len(one[0]), len(one[2]), len(one[3])) == (30, 2, 20)  # cust-001: the demo of before, unchanged
    assert (len(two[0]), len(two[2]), len(two[3])) == (15, 2, 10)


def test_first_demo_customer_is_the_single_demo_customer_of_before(db):
    names = {p.display_name for p in db.payees()}
    assert {"John Smith", "Jon Smythe", "Joan Smith", "Katherine Lee", "Catherine Li"} <= names
    billers = {p.display_name for p in db.payees() if p.kind == "biller"}
    assert {"City Electric", "Metro Water Utility", "Skyline Mobile"} <= billers
    assert db.balance() == {
        "account_id": "chk-001",
        "name": "checking",
        "balance_minor": 123_456,
        "currency": "USD",
    }
    assert [a["currency"] for a in db.accounts()] == ["USD", "USD", "EUR", "JPY"]
    assert db.payee("john_smith").aliases == ("Johnny",)  # a contact linked to the payee


def test_second_demo_customer_has_its_own_confusable_names(bank):
    two = bank.customer(DEMO_CUSTOMER_2_ID)
    names = {p.payee_id: p.display_name for p in two.payees()}
    assert {names["priya_patel"], names["priya_sharma"]} == {"Priya Patil", "Priya Sharma"}
    assert {names["thames_water"], names["metro_water"]} == {"Thames Water", "Metro Water Services"}
    assert "water" in two.payee("thames_water").aliases and "water" not in two.payee("metro_water").aliases
    assert two.balance()["currency"] == "GBP" and "john_smith" not in names


def test_the_schema_itself_keeps_customers_apart(bank):
    """Composite keys: even a statement that skips the views cannot hang one customer's card, transaction or
    transfer on another customer's account or payee."""
    for statement in (
        "INSERT INTO cards (customer_id, card_id, account_id, kind, network, last4) "
        "VALUES ('cust-002', 'card-x', 'chk-001', 'debit', 'visa', '0000')",
        "INSERT INTO transfers (transfer_id, customer_id, session_id, payee_id, from_account_id, "
        "amount_minor, currency, kind, status, created_at, updated_at) "
        "VALUES ('t-x', 'cust-002', 's', 'john_smith', 'chk-002', 1, 'GBP', 'transfer', 'pending', 0, 0)",
        "INSERT INTO transactions (customer_id, account_id, posted_on, description, amount_minor, currency) "
        "VALUES ('cust-002', 'chk-001', '2025-05-07', 'x', -1, 'USD')",
    ):
        # sqlite3's IntegrityError or psycopg's ForeignKeyViolation, whose messages both say it
        with pytest.raises(Exception, match="(?i)foreign key"), bank.db.transaction() as tx:
            tx.run(statement)


def test_payee_versions_are_per_customer(bank):
    one, two = bank.customer(DEMO_CUSTOMER_ID), bank.customer(DEMO_CUSTOMER_2_ID)
    v1, v2 = one.version, two.version
    one.upsert_payee(Payee("new_one", "New One", "friend", "person"))
    assert (one.version, two.version) == (v1 + 1, v2)
    one.add_contact("Newbie", payee_id="new_one")
    assert one.version == v1 + 2
    one.add_contact("Plumber", phone="+1 555 0000")  # not linked to a payee: the payees did not change
    assert one.version == v1 + 2
    with pytest.raises(ValueError, match="unknown payee 'thames_water'"):
        one.add_contact("Thames", payee_id="thames_water")  # cust-002's payee
    assert two.payee("new_one") is None and two.version == v2


# --- transfers: what only a database can show ---------------------------------------------------------
def test_execute_races_move_money_once(db):
    """Eight threads execute one transfer under one key: one debit, eight identical answers."""
    tid = db.create_transfer("s1", "john_smith", 700, "USD", "transfer")
    results: list[dict] = []
    errors: list[BaseException] = []

    def execute() -> None:
        try:
            results.append(db.execute_transfer(tid, "race-key", today=dt.date(2025, 5, 7)))
        except BaseException as exc:  # noqa: BLE001 - reported to the main thread
            errors.append(exc)

    threads = [threading.Thread(target=execute) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(results) == 8 and all(r == results[0] for r in results)
    assert db.balance()["balance_minor"] == 123_456 - 700
    assert [t["description"] for t in db.recent_transactions(100)].count(
        "Transfer to John Smith"
    ) == 2  # 1 seeded


def test_a_key_belongs_to_one_transfer(db):
    first = db.create_transfer("s1", "john_smith", 100, "USD", "transfer")
    second = db.create_transfer("s1", "john_smith", 100, "USD", "transfer")
    db.execute_transfer(first, "key-1")
    with pytest.raises(ValueError, match=f"already used for transfer {first}"):
        db.execute_transfer(second, "key-1")
    assert db.transfer(second)["status"] == "pending" and db.transfer(second)["idempotency_key"] is None
    assert db.balance()["balance_minor"] == 123_456 - 100


@pytest.mark.parametrize("key", ["", " ", "has space", "new\nline", "é", "x" * 256, None, 5])
def test_bad_idempotency_keys_are_refused(db, key):
    tid = db.create_transfer("s1", "john_smith", 100, "USD", "transfer")
    with pytest.raises(ValueError, match="idempotency key"):
        db.execute_transfer(tid, key)
    assert db.transfer(tid)["status"] == "pending"


def test_amounts_are_bounded_in_the_database_too(db):
    tid = db.create_transfer("s1", "john_smith", MAX_AMOUNT_MINOR, "USD", "transfer")
    assert db.transfer(tid)["amount_minor"] == MAX_AMOUNT_MINOR  # the bound itself is allowed, exactly
    assert db.execute_transfer(tid, "k")["note"] == "insufficient funds"
    with pytest.raises(Exception, match="(?i)check constraint"), db.bank.db.transaction() as tx:
        tx.run("UPDATE transfers SET amount_minor = 0 WHERE transfer_id = ?", (tid,))
    assert db.transfer(tid)["amount_minor"] == MAX_AMOUNT_MINOR and db.balance()["balance_minor"] == 123_456


# --- imports ------------------------------------------------------------------------------------------
def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


CUSTOMERS = (
    "customer_id,name,account_id,account_name,currency,balance_minor\n"
    "c-100,Ada Lovelace,a-chk,checking,usd,250000\n"
    "c-100,Ada Lovelace,a-eur,euro,EUR,-1500\n"
    "c-200,Alan Turing,b-chk,checking,GBP,0\n"
)


def test_import_customers_cards_and_payees(bank_replicas, tmp_path):
    bank = bank_replicas()
    assert bank.import_customers_csv(_write(tmp_path, "c.csv", CUSTOMERS)) == (2, 3)
    ada = bank.customer("c-100")
    assert ada.accounts() == [
        {"account_id": "a-chk", "name": "checking", "balance_minor": 250_000, "currency": "USD"},
        {"account_id": "a-eur", "name": "euro", "balance_minor": -1500, "currency": "EUR"},
    ]
    assert bank.customers()[0] == {"customer_id": "c-100", "name": "Ada Lovelace", "demo": False}
    cards = "customer_id,card_id,account_id,kind,network,last4\nc-100,k1,a-chk,Debit,Visa,0042\n"
    assert bank.import_cards_csv(_write(tmp_path, "k.csv", cards)) == 1
    ada.set_card_locked("k1", True)
    assert bank.import_cards_csv(_write(tmp_path, "k.csv", cards)) == 1  # again: the lock stays
    assert ada.cards() == [
        {
            "card_id": "k1",
            "account_id": "a-chk",
            "kind": "debit",
            "network": "visa",
            "last4": "0042",
            "locked": True,
        }
    ]
    assert bank.import_payees_csv(DATA / "payees.csv", "c-100") == 7
    assert ada.version == 1 and bank.customer("c-200").payees() == []
    assert ada.payee("city_electric").aliases == ("electric", "electricity", "power")
    assert ada.payee("priya_patel").kind == "person"  # kind defaults to person
    assert bank.import_payees_csv(DATA / "payees.csv", "c-100") == 7  # upsert: same rows again
    assert len(ada.payees()) == 7 and ada.version == 2


def test_reimporting_customers_updates_names_and_balances_not_currencies(bank_replicas, tmp_path):
    bank = bank_replicas()
    bank.import_customers_csv(_write(tmp_path, "c.csv", CUSTOMERS))
    update = (
        "customer_id,name,account_id,account_name,currency,balance_minor\nc-100,Ada King,a-chk,main,USD,7\n"
    )
    assert bank.import_customers_csv(_write(tmp_path, "u.csv", update)) == (1, 1)
    assert (
        bank.customer_name("c-100") == "Ada King"
        and bank.customer("c-100").balance("a-chk")["balance_minor"] == 7
    )
    moved = update.replace("USD", "EUR").replace(",7", ",9")
    with pytest.raises(
        ValueError, match=r"line 2, column 'currency': account 'a-chk' is held in USD, not EUR"
    ):
        bank.import_customers_csv(_write(tmp_path, "m.csv", moved))
    assert bank.customer("c-100").balance("a-chk") == {
        "account_id": "a-chk",
        "name": "main",
        "balance_minor": 7,
        "currency": "USD",
    }


HEADER = "customer_id,name,account_id,account_name,currency,balance_minor\n"
GOOD = HEADER + "c0,Zoe,z1,main,USD,5\n"  # line 2: a good row, which a bad one after it must not let in


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", r"line 1: empty file"),
        ("customer_id,name,account_id,currency,balance_minor\n", r"line 1, column 'account_name': missing"),
        (GOOD + "c1,Ada,a1,main,USD,12.50\n", r"line 3, column 'balance_minor': '12.50' is not an integer"),
        (GOOD + "c1,Ada,a1,main,USD,1_000\n", r"line 3, column 'balance_minor'"),
        (GOOD + "c1,Ada,a1,main,USD,١٢\n", r"line 3, column 'balance_minor'"),
        (GOOD + f"c1,Ada,a1,main,USD,{MAX_AMOUNT_MINOR + 1}\n", r"line 3, column 'balance_minor'"),
        (GOOD + "c1,Ada,a1,main,XYZ,1\n", r"line 3, column 'currency': 'XYZ' is not a known ISO code"),
        (
            GOOD + "c0,Zoe,z1,other,USD,2\n",
            r"line 3, column 'account_id': account 'z1' of 'c0' repeats line 2",
        ),
        (GOOD + "c0,Bob,z2,other,USD,2\n", r"line 3, column 'name': 'Bob', but line 2 says 'Zoe'"),
        (GOOD + "../etc,Ada,a1,main,USD,1\n", r"line 3, column 'customer_id'"),
        (GOOD + ".hidden,Ada,a1,main,USD,1\n", r"line 3, column 'customer_id'"),
        (GOOD + "c1,Ada\x07,a1,main,USD,1\n", r"line 3, column 'name': holds control characters"),
        (GOOD + "c1,,a1,main,USD,1\n", r"line 3, column 'name': must be 1-100"),
        (GOOD + "c1,Ada,a1,main,USD\n", r"line 3: expected 6 fields, got 5"),
    ],
)
def test_import_customers_errors_name_line_and_column(bank_replicas, tmp_path, content, message):
    bank = bank_replicas()
    with pytest.raises(ValueError, match=message):
        bank.import_customers_csv(_write(tmp_path, "bad.csv", content))
    assert bank.customers() == []  # all or nothing


CARDS = "customer_id,card_id,account_id,kind,network,last4\n"


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ("c-100,k1,a-chk,debit,visa,42\n", r"line 2, column 'last4': '42' is not 4 digits"),
        ("c-100,k1,a-chk,prepaid,visa,0042\n", r"line 2, column 'kind': 'prepaid'"),
        ("c-100,k1,a-chk,debit,v1sa,0042\n", r"line 2, column 'network'"),
        ("c-999,k1,a-chk,debit,visa,0042\n", r"line 2, column 'customer_id': no customer 'c-999'"),
        ("c-200,k1,a-chk,debit,visa,0042\n", r"line 2, column 'account_id': customer 'c-200' has no account"),
        ("c-100,k1,a-chk,debit,visa,0042\nc-100,k1,a-eur,debit,visa,0043\n", r"line 3, column 'card_id'"),
    ],
)
def test_import_cards_errors_name_line_and_column(bank_replicas, tmp_path, rows, message):
    bank = bank_replicas()
    bank.import_customers_csv(_write(tmp_path, "c.csv", CUSTOMERS))
    with pytest.raises(ValueError, match=message):
        bank.import_cards_csv(_write(tmp_path, "k.csv", CARDS + rows))
    assert bank.customer("c-100").cards() == [] and bank.customer("c-200").cards() == []


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
        (
            "payee_id,display_name,relationship\nok,Fine,friend\n..,Dots,friend\n",
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
        ("payee_id,display_name,relationship\nx,X\x00Y,friend\n", r"line 2"),
        ("payee_id,display_name,relationship,aliases\nx,X,friend,ok;bad\x1b\n", r"line 2, column 'aliases'"),
    ],
)
def test_import_payees_errors_name_line_and_column(bank_replicas, tmp_path, content, message):
    bank = bank_replicas()
    bank.add_customer("c1", "Ada")
    with pytest.raises(ValueError, match=message):
        bank.import_payees_csv(_write(tmp_path, "bad.csv", content), "c1")
    assert bank.customer("c1").payees() == []  # all or nothing
    assert bank.customer("c1").version == 0


def test_import_payees_accepts_bom_blank_lines_and_header_case(bank_replicas, tmp_path):
    path = _write(tmp_path, "ok.csv", "\ufeffPayee_ID,Display_Name,Relationship\n\nx,X Person,friend\n\n")
    bank = bank_replicas()
    bank.add_customer("c1", "Ada")
    assert bank.import_payees_csv(path, "c1") == 1
    assert bank.customer("c1").payee("x").display_name == "X Person"


def test_a_file_that_is_not_utf8_is_an_error_naming_it(bank_replicas, tmp_path):
    path = tmp_path / "latin1.csv"
    path.write_bytes("payee_id,display_name,relationship\nx,Müller,friend\n".encode("latin-1"))
    bank = bank_replicas()
    bank.add_customer("c1", "Ada")
    with pytest.raises(ValueError, match=r"latin1.csv: not UTF-8 text"):
        bank.import_payees_csv(path, "c1")


def test_import_payees_for_an_unknown_customer_names_it(bank_replicas, tmp_path):
    bank = bank_replicas()
    with pytest.raises(ValueError, match=r"customer 'c-404' is not in the database"):
        bank.import_payees_csv(DATA / "payees.csv", "c-404")


# --- demo and real data never share a database --------------------------------------------------------
def test_imports_refuse_a_database_with_demo_data(bank, tmp_path):
    before = _snapshot(bank.customer(DEMO_CUSTOMER_ID))
    for attempt in (
        lambda: bank.import_payees_csv(DATA / "payees.csv", DEMO_CUSTOMER_ID),
        lambda: bank.import_customers_csv(_write(tmp_path, "c.csv", CUSTOMERS)),
        lambda: bank.import_cards_csv(
            _write(tmp_path, "k.csv", CARDS + "cust-001,k9,chk-001,debit,visa,1111\n")
        ),
        lambda: bank.add_customer("c-100", "Ada"),
    ):
        with pytest.raises(ValueError, match="holds demo data; import into a new database"):
            attempt()
    assert _snapshot(bank.customer(DEMO_CUSTOMER_ID)) == before and len(bank.customers()) == 2


def test_the_demo_refuses_a_database_with_real_customers(bank_replicas, tmp_path):
    bank = bank_replicas()
    bank.import_customers_csv(_write(tmp_path, "c.csv", CUSTOMERS))
    with pytest.raises(ValueError, match="holds customers that are not demo data"):
        bank.seed_demo()
    assert [c["customer_id"] for c in bank.customers()] == ["c-100", "c-200"]


def test_the_issue_repro_importing_payees_into_a_fresh_database(bank_replicas, tmp_path):
    """Issue 20: import-payees into a fresh database put the user's payees beside the demo's, so "who is
    priya" found both and "pay the water bill" chose the demo biller. Now nothing is seeded unasked."""
    bank = bank_replicas()
    assert bank.customers() == []
    bank.import_customers_csv(_write(tmp_path, "c.csv", CUSTOMERS))
    bank.import_payees_csv(DATA / "payees.csv", "c-100")
    names = {p.display_name for p in bank.customer("c-100").payees()}
    assert "Priya Patel" in names  # the user's own Priya...
    assert "Metro Water Utility" not in names and "Jon Smythe" not in names  # ...and nothing of the demo's
    assert len(names) == 7 and not bank.holds_demo_data()


# --- migrations ---------------------------------------------------------------------------------------
def test_a_version_0_database_migrates_with_its_data(tmp_path):
    path = tmp_path / "old.db"
    build_legacy_db(path)
    bank = SQLiteBank(path)
    assert bank.schema_version == SCHEMA_VERSION == 1
    assert bank.customers() == [{"customer_id": "cust-001", "name": "Alex Morgan", "demo": True}]
    old, fresh = bank.customer("cust-001"), demo_bank().customer(DEMO_CUSTOMER_ID)
    assert old.version == LEGACY_PAYEE_VERSION
    zed = Payee("zed_newman", "Zed Newman", "friend", "person", ("zed",))
    assert old.payees() == sorted([*fresh.payees(), zed], key=lambda p: p.payee_id)
    assert old.contacts() == fresh.contacts()
    assert old.cards() == [dict(c, locked=c["card_id"] == "card-credit") for c in fresh.cards()]
    assert old.balance()["balance_minor"] == 123_456 - 5000
    assert old.recent_transactions(1000)[1:] == fresh.recent_transactions(1000)
    assert old.transfer(EXECUTED_TRANSFER)["status"] == "executed"
    assert old.transfer(PENDING_TRANSFER)["idempotency_key"] is None
    assert old.execute_transfer(PENDING_TRANSFER, "after-migration")["status"] == "executed"
    # The audit trail is not the bank's any more, but a migration deletes no one's rows.
    assert bank._conn.execute("SELECT COUNT(*) FROM audit").fetchone()[0] == 2
    assert not {"meta", "v0_payees", "v0_customers"} & db_module._tables(bank._conn)
    bank.close()
    again = SQLiteBank(path)  # a migrated file opens as it is
    assert again.schema_version == 1 and again.customer("cust-001").version == LEGACY_PAYEE_VERSION


def test_a_never_seeded_version_0_database_gets_one_customer(tmp_path):
    path = tmp_path / "old.db"
    build_legacy_db(path, seeded=False)
    bank = SQLiteBank(path)
    assert bank.customers() == [{"customer_id": "cust-001", "name": "Customer", "demo": False}]
    assert [p.payee_id for p in bank.customer("cust-001").payees()] == ["zed_newman"]


def test_a_version_0_database_with_two_customers_and_payees_is_refused_unchanged(tmp_path):
    path = tmp_path / "old.db"
    build_legacy_db(path)
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("INSERT INTO customers VALUES ('cust-009', 'Someone Else')")
    conn.close()
    with pytest.raises(MigrationError, match="2 customers and payees"):
        SQLiteBank(path)
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 0
    assert conn.execute("SELECT COUNT(*) FROM payees").fetchone()[0] == 31
    assert "v0_payees" not in {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
    conn.close()


def test_a_failing_step_leaves_the_database_as_it_was(tmp_path, monkeypatch):
    path = tmp_path / "bank.db"
    bank = demo_bank(path)
    bank.close()

    def half_done(conn: sqlite3.Connection) -> None:
        conn.execute("CREATE TABLE half (x)")
        conn.execute("DELETE FROM payees")
        raise RuntimeError("step 2 breaks")

    monkeypatch.setattr(db_module, "MIGRATIONS", [*db_module.MIGRATIONS, half_done])
    with pytest.raises(RuntimeError, match="step 2 breaks"):
        SQLiteBank(path)
    monkeypatch.undo()
    bank = SQLiteBank(path)
    assert bank.schema_version == 1 and "half" not in db_module._tables(bank._conn)
    assert len(bank.customer(DEMO_CUSTOMER_ID).payees()) == 30


def test_a_database_newer_than_the_code_is_refused(tmp_path):
    path = tmp_path / "future.db"
    demo_bank(path).close()
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(SchemaTooNewError, match=rf"schema version {SCHEMA_VERSION + 1} is newer than"):
        SQLiteBank(path)


# --- connections and threads --------------------------------------------------------------------------
def test_one_database_is_shared_between_replicas(bank_replicas):
    a = bank_replicas(demo=True)
    b = bank_replicas()
    one_a, one_b = a.customer(DEMO_CUSTOMER_ID), b.customer(DEMO_CUSTOMER_ID)
    assert one_b.payees() == one_a.payees()
    one_a.upsert_payee(Payee("late", "Late Arrival", "friend", "person"))
    assert one_b.version == one_a.version  # the version lives in the database, not in one connection
    assert one_b.payee("late") is not None
    tid = one_a.create_transfer("s", "john_smith", 100, "USD", "transfer")
    assert one_b.execute_transfer(tid, "k")["status"] == "executed"
    assert one_a.execute_transfer(tid, "k")["status"] == "executed"  # the other connection's key, stored
    assert one_a.balance()["balance_minor"] == 123_456 - 100
    a.close()
    b.close()


def test_many_threads_and_both_customers(bank):
    errors: list[BaseException] = []

    def work(i: int) -> None:
        view = bank.customer(DEMO_CUSTOMER_ID if i % 2 else DEMO_CUSTOMER_2_ID)
        payee, currency = ("john_smith", "USD") if i % 2 else ("jon_smith", "GBP")
        try:
            for j in range(25):
                tid = view.create_transfer(f"t{i}", payee, 1, currency, "transfer")
                view.execute_transfer(tid, f"t{i}-{j}")
                view.payees()
        except BaseException as e:  # noqa: BLE001 - reported to the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    one, two = bank.customer(DEMO_CUSTOMER_ID), bank.customer(DEMO_CUSTOMER_2_ID)
    assert len(one.transfers(status="executed")) == len(two.transfers(status="executed")) == 50
    assert one.balance()["balance_minor"] == 123_456 - 50 and two.balance()["balance_minor"] == 245_000 - 50
