"""The SQLite bank (``SQLiteBank``, the embedded ``BankBackend``): customers' accounts, cards, payees,
contacts, transactions and transfers; the schema migrated under ``PRAGMA user_version``; demo seeding
(demo_data.py) and imports (bank_csv.py). One connection behind a lock: any thread may call any method."""

from __future__ import annotations

import datetime as dt
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from g4serve_assistant.bank import (
    TRANSFER_KINDS,
    Payee,
    UnknownCustomerError,
    check_amount_minor,
    check_idempotency_key,
)
from g4serve_assistant.bank_csv import (
    ID_PATTERN,
    read_cards_csv,
    read_customers_csv,
    read_payees_csv,
    text_problem,
)
from g4serve_assistant.demo_data import DEMO_CUSTOMER_2_ID, DEMO_CUSTOMER_ID, DEMO_CUSTOMERS

__all__ = [
    "DEMO_CUSTOMER_2_ID",
    "DEMO_CUSTOMER_ID",
    "SCHEMA_VERSION",
    "MigrationError",
    "Payee",
    "SQLiteBank",
    "SQLiteCustomerBank",
    "SchemaTooNewError",
    "demo_bank",
    "demo_db",
]

_MAX_TRANSACTIONS = 1000  # recent_transactions' cap: a reply reads a few, an API page stays bounded
_DEMO_DATA_ERROR = "holds demo data; import into a new database"


class SchemaTooNewError(ValueError):
    """The database was written by a newer version of this code; opening it could corrupt it."""


class MigrationError(RuntimeError):
    """A migration found data it cannot place; the database is left as it was."""


# --- schema and migrations --------------------------------------------------------------------------------
# Version 1: every row belongs to a customer. Composite keys make a cross-customer reference impossible in
# the schema itself: a card, transaction or transfer can only name an account (or payee) of its own customer.
_SCHEMA_1 = (
    """CREATE TABLE customers (
    customer_id TEXT PRIMARY KEY, name TEXT NOT NULL,
    demo INTEGER NOT NULL DEFAULT 0 CHECK (demo IN (0, 1)),
    payee_version INTEGER NOT NULL DEFAULT 0)""",
    """CREATE TABLE accounts (
    customer_id TEXT NOT NULL REFERENCES customers, account_id TEXT NOT NULL, name TEXT NOT NULL,
    currency TEXT NOT NULL, balance_minor INTEGER NOT NULL,
    PRIMARY KEY (customer_id, account_id))""",
    """CREATE TABLE payees (
    customer_id TEXT NOT NULL REFERENCES customers, payee_id TEXT NOT NULL, display_name TEXT NOT NULL,
    relationship TEXT NOT NULL DEFAULT '', kind TEXT NOT NULL CHECK (kind IN ('person', 'biller')),
    aliases TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (customer_id, payee_id))""",
    """CREATE TABLE contacts (
    customer_id TEXT NOT NULL REFERENCES customers, contact_id TEXT NOT NULL, name TEXT NOT NULL,
    phone TEXT, email TEXT, payee_id TEXT,
    PRIMARY KEY (customer_id, contact_id),
    FOREIGN KEY (customer_id, payee_id) REFERENCES payees (customer_id, payee_id))""",
    """CREATE TABLE cards (
    customer_id TEXT NOT NULL, card_id TEXT NOT NULL, account_id TEXT NOT NULL, kind TEXT NOT NULL,
    network TEXT NOT NULL, last4 TEXT NOT NULL, locked INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (customer_id, card_id),
    FOREIGN KEY (customer_id, account_id) REFERENCES accounts (customer_id, account_id))""",
    """CREATE TABLE transactions (
    txn_id INTEGER PRIMARY KEY AUTOINCREMENT, customer_id TEXT NOT NULL, account_id TEXT NOT NULL,
    posted_on TEXT NOT NULL, description TEXT NOT NULL, amount_minor INTEGER NOT NULL, currency TEXT NOT NULL,
    FOREIGN KEY (customer_id, account_id) REFERENCES accounts (customer_id, account_id))""",
    "CREATE INDEX transactions_by_account ON transactions (customer_id, account_id, posted_on)",
    """CREATE TABLE transfers (
    transfer_id TEXT PRIMARY KEY, customer_id TEXT NOT NULL, session_id TEXT NOT NULL,
    payee_id TEXT NOT NULL, from_account_id TEXT NOT NULL,
    amount_minor INTEGER NOT NULL CHECK (amount_minor > 0), currency TEXT NOT NULL,
    kind TEXT NOT NULL CHECK (kind IN ('transfer', 'bill_payment')),
    status TEXT NOT NULL CHECK (status IN ('pending', 'executed', 'scheduled', 'failed', 'cancelled')),
    scheduled_for TEXT, note TEXT, idempotency_key TEXT, created_at REAL NOT NULL, updated_at REAL NOT NULL,
    FOREIGN KEY (customer_id, payee_id) REFERENCES payees (customer_id, payee_id),
    FOREIGN KEY (customer_id, from_account_id) REFERENCES accounts (customer_id, account_id),
    UNIQUE (customer_id, idempotency_key))""",
    "CREATE INDEX transfers_by_customer ON transfers (customer_id, status)",
)
# Tables of the single-customer schema (user_version 0) that version 1 rebuilds. Its `audit` table is not the
# bank's any more (audit.py keeps its own): it stays as it is, rows and all.
_LEGACY_TABLES = ("meta", "customers", "accounts", "payees", "contacts", "cards", "transactions", "transfers")
_LEGACY_OWNED = ("payees", "contacts", "transfers")  # rows with no customer column in version 0
_LEGACY_DEMO_CUSTOMER = ("cust-001", "Alex Morgan")  # what version 0's seed_demo wrote


def _tables(conn: sqlite3.Connection) -> set[str]:
    return {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def _count(conn: sqlite3.Connection, table: str) -> int:
    return conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]  # noqa: S608 - our own table names


# Version 0's rows into version 1's tables. A card or transaction belongs to its account's customer (a LEFT
# JOIN, so that an orphan fails the NOT NULL and the migration instead of vanishing); payees, contacts and
# transfers to the database's one customer, :owner.
_LEGACY_COPIES = {
    "accounts": "INSERT INTO accounts SELECT customer_id, account_id, name, currency, balance_minor "
    "FROM v0_accounts ORDER BY rowid",
    "payees": "INSERT INTO payees SELECT :owner, payee_id, display_name, relationship, kind, aliases "
    "FROM v0_payees ORDER BY rowid",
    "contacts": "INSERT INTO contacts SELECT :owner, contact_id, name, phone, email, payee_id "
    "FROM v0_contacts ORDER BY rowid",
    "cards": "INSERT INTO cards SELECT a.customer_id, c.card_id, c.account_id, c.kind, c.network, "
    "c.last4, c.locked FROM v0_cards c LEFT JOIN v0_accounts a USING (account_id) ORDER BY c.rowid",
    "transactions": "INSERT INTO transactions SELECT t.txn_id, a.customer_id, t.account_id, t.posted_on, "
    "t.description, t.amount_minor, t.currency FROM v0_transactions t "
    "LEFT JOIN v0_accounts a USING (account_id) ORDER BY t.txn_id",
    "transfers": "INSERT INTO transfers SELECT transfer_id, :owner, session_id, payee_id, from_account_id, "
    "amount_minor, currency, kind, status, scheduled_for, note, NULL, created_at, updated_at "
    "FROM v0_transfers ORDER BY rowid",
}


def _migrate_1_customers_own_their_rows(conn: sqlite3.Connection) -> None:
    """Creates the version-1 schema; a version-0 database's rows move into it, its payees, contacts and
    transfers given to its one customer (cust-001 when it was seeded)."""
    legacy = _tables(conn) & set(_LEGACY_TABLES)
    if legacy and "customers" not in legacy:
        raise MigrationError(f"tables {sorted(legacy)} without customers: not an assistant database")
    for table in legacy:
        conn.execute(f"ALTER TABLE {table} RENAME TO v0_{table}")
    for statement in _SCHEMA_1:
        conn.execute(statement)
    if not legacy:
        return  # a new database
    owner = _move_legacy_customers(conn, legacy)
    for table, sql in _LEGACY_COPIES.items():
        if table in legacy:
            conn.execute(sql, {"owner": owner})
            old, new = _count(conn, f"v0_{table}"), _count(conn, table)
            if old != new:
                raise MigrationError(f"{table}: {old} rows, {new} copied")
    for table in legacy:
        conn.execute(f"DROP TABLE v0_{table}")


def _move_legacy_customers(conn: sqlite3.Connection, legacy: set[str]) -> str | None:
    """Copies version 0's customers and returns the one that owns its payees, contacts and transfers. The
    customer version 0's seed wrote is marked demo: that database holds the demo data (and whatever was
    imported beside it, which is why imports now refuse a demo database)."""
    owned = sum(_count(conn, f"v0_{t}") for t in _LEGACY_OWNED if t in legacy)
    customers = [tuple(r) for r in conn.execute("SELECT customer_id, name FROM v0_customers ORDER BY rowid")]
    if owned and len(customers) > 1:
        raise MigrationError(
            f"the database has {len(customers)} customers and payees, contacts or transfers without one: "
            "whose they are cannot be told"
        )
    if owned and not customers:  # payees imported into a never-seeded database: they get a customer
        customers = [(DEMO_CUSTOMER_ID, "Customer")]
    owner = customers[0][0] if customers else None
    version = 0
    if "meta" in legacy:
        row = conn.execute("SELECT value FROM v0_meta WHERE key = 'payee_version'").fetchone()
        version = row[0] if row else 0
    for customer_id, name in customers:
        conn.execute(
            "INSERT INTO customers (customer_id, name, demo, payee_version) VALUES (?, ?, ?, ?)",
            (
                customer_id,
                name,
                int((customer_id, name) == _LEGACY_DEMO_CUSTOMER),
                version * (customer_id == owner),
            ),
        )
    return owner


# The ordered migrations: MIGRATIONS[i] takes a database from user_version i to i + 1, in one transaction.
# Append only; a released step never changes.
MIGRATIONS: list[Callable[[sqlite3.Connection], None]] = [_migrate_1_customers_own_their_rows]
SCHEMA_VERSION = len(MIGRATIONS)


def _user_version(conn: sqlite3.Connection) -> int:
    return conn.execute("PRAGMA user_version").fetchone()[0]


def migrate(conn: sqlite3.Connection, name: str = "database") -> int:
    """Brings the database at ``conn`` (autocommit mode) to ``SCHEMA_VERSION``, one transaction per step, and
    returns the version it found. SchemaTooNewError for a database newer than this code."""
    found = _user_version(conn)
    if found > len(MIGRATIONS):
        raise SchemaTooNewError(
            f"{name}: schema version {found} is newer than this g4serve_assistant's {len(MIGRATIONS)}; "
            "upgrade g4serve or use another database"
        )
    for target in range(found + 1, len(MIGRATIONS) + 1):
        # Tables are renamed and rebuilt, so foreign keys are checked once at the end of the step (the
        # pragma cannot change inside a transaction). IMMEDIATE: a second process waits, then sees the step
        # done and skips it.
        conn.execute("PRAGMA foreign_keys = OFF")
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                if _user_version(conn) < target:
                    MIGRATIONS[target - 1](conn)
                    bad = [tuple(r) for r in conn.execute("PRAGMA foreign_key_check")]
                    if bad:
                        raise MigrationError(f"{name}: step {target} leaves broken references: {bad[:3]}")
                    conn.execute(f"PRAGMA user_version = {target}")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
        finally:
            conn.execute("PRAGMA foreign_keys = ON")
    return found


# --- the bank ---------------------------------------------------------------------------------------------
class SQLiteBank:
    """All customers of the embedded bank; ``customer(id)`` is the view the policy gets."""

    def __init__(self, path: str | os.PathLike = ":memory:"):
        self.path = str(path)
        # One connection shared by all threads: sqlite3 objects are not thread-safe, so every use holds
        # the lock (statements are microseconds, so contention is negligible at voice-turn rates).
        # isolation_level=None: transactions are ours (BEGIN IMMEDIATE ... COMMIT), not the module's guesses.
        self._conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._conn.row_factory = sqlite3.Row
        self._lock = threading.RLock()
        try:
            with self._lock:
                if self.path != ":memory:":
                    self._conn.execute("PRAGMA journal_mode=WAL")
                self._conn.execute("PRAGMA foreign_keys=ON")
                migrate(self._conn, self.path)
        except BaseException:
            self._conn.close()
            raise

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction: all of it or none of it. IMMEDIATE takes the write lock up front, so a
        second connection to the file waits instead of failing half-way."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
                self._conn.execute("COMMIT")
            except BaseException:
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                raise

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        """Several reads that see one state of the database (another connection may write in between)."""
        with self._lock:
            self._conn.execute("BEGIN")
            try:
                yield self._conn
            finally:
                self._conn.execute("COMMIT")

    @property
    def schema_version(self) -> int:
        with self._lock:
            return _user_version(self._conn)

    # --- customers --------------------------------------------------------------------------------------
    def customer(self, customer_id: str) -> SQLiteCustomerBank:
        self.customer_name(customer_id)
        return SQLiteCustomerBank(self, customer_id)

    def customer_name(self, customer_id: str) -> str:
        with self._lock:
            row = self._conn.execute(
                "SELECT name FROM customers WHERE customer_id = ?", (customer_id,)
            ).fetchone()
        if row is None:
            raise UnknownCustomerError(customer_id)
        return row["name"]

    def customers(self) -> list[dict]:
        """``[{customer_id, name, demo: bool}]`` in the order they were added."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT customer_id, name, demo FROM customers ORDER BY rowid"
            ).fetchall()
        return [dict(r, demo=bool(r["demo"])) for r in rows]

    def holds_demo_data(self) -> bool:
        with self._lock:
            return self._conn.execute("SELECT 1 FROM customers WHERE demo = 1 LIMIT 1").fetchone() is not None

    def add_customer(self, customer_id: str, name: str) -> SQLiteCustomerBank:
        """A new customer without accounts; ValueError for a bad or taken id, a bad name, or a database that
        holds demo data (real and demo customers never share one)."""
        if not isinstance(customer_id, str) or not ID_PATTERN.fullmatch(customer_id):
            raise ValueError(f"customer id {customer_id!r} is not 1-64 of A-Z a-z 0-9 _ . - (no leading dot)")
        if text_problem(name):
            raise ValueError(f"customer name: {text_problem(name)}")
        with self._write() as c:
            self._refuse_demo(c)
            if c.execute("SELECT 1 FROM customers WHERE customer_id = ?", (customer_id,)).fetchone():
                raise ValueError(f"customer {customer_id!r} exists")
            c.execute("INSERT INTO customers (customer_id, name) VALUES (?, ?)", (customer_id, name))
        return SQLiteCustomerBank(self, customer_id)

    def _refuse_demo(self, c: sqlite3.Connection) -> None:
        if c.execute("SELECT 1 FROM customers WHERE demo = 1 LIMIT 1").fetchone():
            raise ValueError(f"{self.path}: {_DEMO_DATA_ERROR}")

    # --- imports ----------------------------------------------------------------------------------------
    def import_payees_csv(self, path: str | os.PathLike, customer_id: str) -> int:
        """Upserts one customer's payees from a CSV with columns payee_id,display_name,relationship[,kind]
        [,aliases] (``aliases`` ';'-separated) and returns how many rows it wrote.

        The whole file is validated first and written in one transaction: a bad row imports nothing.
        ValueError naming the file, line and column of the first problem; naming the customer when it is
        not in the database; and for a database that holds demo data.
        """
        rows = read_payees_csv(Path(path))
        with self._write() as c:
            self._refuse_demo(c)
            if not c.execute("SELECT 1 FROM customers WHERE customer_id = ?", (customer_id,)).fetchone():
                raise ValueError(
                    f"{path}: customer {customer_id!r} is not in the database (import-customers first)"
                )
            return _upsert_payees(c, customer_id, rows)

    def import_customers_csv(self, path: str | os.PathLike) -> tuple[int, int]:
        """Customers and their accounts from a CSV with one row per account:
        customer_id,name,account_id,account_name,currency,balance_minor (an integer of minor units).

        New customers and accounts are added; those already there get the file's name and balance (an
        account's currency never changes: that is an error). Validated whole first, written in one
        transaction; ValueError naming file, line and column, or the demo data. Returns (customers,
        accounts) in the file.
        """
        path = Path(path)
        rows = read_customers_csv(path)
        with self._write() as c:
            self._refuse_demo(c)
            for line, row in rows:
                c.execute(
                    "INSERT INTO customers (customer_id, name) VALUES (?, ?) "
                    "ON CONFLICT (customer_id) DO UPDATE SET name = excluded.name",
                    (row["customer_id"], row["name"]),
                )
                old = c.execute(
                    "SELECT currency FROM accounts WHERE customer_id = ? AND account_id = ?",
                    (row["customer_id"], row["account_id"]),
                ).fetchone()
                if old is not None and old["currency"] != row["currency"]:
                    raise ValueError(
                        f"{path}: line {line}, column 'currency': account {row['account_id']!r} is held in "
                        f"{old['currency']}, not {row['currency']} (an account's currency does not change)"
                    )
                c.execute(
                    "INSERT INTO accounts (customer_id, account_id, name, currency, balance_minor) "
                    "VALUES (?, ?, ?, ?, ?) ON CONFLICT (customer_id, account_id) DO UPDATE SET "
                    "name = excluded.name, balance_minor = excluded.balance_minor",
                    (
                        row["customer_id"],
                        row["account_id"],
                        row["account_name"],
                        row["currency"],
                        row["balance"],
                    ),
                )
        return len({r["customer_id"] for _, r in rows}), len(rows)

    def import_cards_csv(self, path: str | os.PathLike) -> int:
        """Cards from a CSV customer_id,card_id,account_id,kind,network,last4, each on an account its customer
        holds (import-customers first). Upserts; a card already there keeps its lock. Validated whole first,
        written in one transaction; ValueError naming file, line and column, or the demo data."""
        path = Path(path)
        rows = read_cards_csv(path)
        with self._write() as c:
            self._refuse_demo(c)
            for line, row in rows:
                cid, aid = row["customer_id"], row["account_id"]
                if not c.execute("SELECT 1 FROM customers WHERE customer_id = ?", (cid,)).fetchone():
                    raise ValueError(f"{path}: line {line}, column 'customer_id': no customer {cid!r}")
                if not c.execute(
                    "SELECT 1 FROM accounts WHERE customer_id = ? AND account_id = ?", (cid, aid)
                ).fetchone():
                    raise ValueError(
                        f"{path}: line {line}, column 'account_id': customer {cid!r} has no account {aid!r}"
                    )
                c.execute(
                    "INSERT INTO cards (customer_id, card_id, account_id, kind, network, last4) "
                    "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (customer_id, card_id) DO UPDATE SET "
                    "account_id = excluded.account_id, kind = excluded.kind, network = excluded.network, "
                    "last4 = excluded.last4",
                    (cid, row["card_id"], aid, row["kind"], row["network"], row["last4"]),
                )
        return len(rows)

    # --- demo data --------------------------------------------------------------------------------------
    def seed_demo(self) -> None:
        """The two demo customers (``DEMO_CUSTOMER_ID``, ``DEMO_CUSTOMER_2_ID``), marked demo: accounts,
        payees with confusable names, contacts, cards and transactions. Idempotent: rows that exist are left
        alone and a payee version moves only if payees were added. ValueError when the database holds
        customers that are not demo data."""
        with self._write() as c:
            if c.execute("SELECT 1 FROM customers WHERE demo = 0 LIMIT 1").fetchone():
                raise ValueError(
                    f"{self.path}: holds customers that are not demo data; "
                    "the demo seeds only a new or demo database"
                )
            for customer_id, name, data in DEMO_CUSTOMERS:
                _seed_customer(c, customer_id, name, data)


class SQLiteCustomerBank:
    """One customer's view of a ``SQLiteBank``: every statement is scoped to ``customer_id``."""

    def __init__(self, bank: SQLiteBank, customer_id: str):
        self.bank = bank
        self.customer_id = customer_id

    def __repr__(self) -> str:
        return f"SQLiteCustomerBank({self.bank.path!r}, {self.customer_id!r})"

    # --- payees -----------------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        """Moves on every change to this customer's payees or contacts; the payee index rebuilds when it does.

        Kept in the database (not in this object) so a second connection to the same file sees it too.
        """
        with self.bank._lock:
            row = self.bank._conn.execute(
                "SELECT payee_version FROM customers WHERE customer_id = ?", (self.customer_id,)
            ).fetchone()
        if row is None:
            raise UnknownCustomerError(self.customer_id)
        return row[0]

    def payees(self) -> list[Payee]:
        with self.bank._read() as c:
            rows = c.execute(
                "SELECT * FROM payees WHERE customer_id = ? ORDER BY payee_id", (self.customer_id,)
            ).fetchall()
            contacts = self._contact_names(c)
        return [_payee(r, contacts.get(r["payee_id"], ())) for r in rows]

    def payee(self, payee_id: str) -> Payee | None:
        with self.bank._read() as c:
            row = c.execute(
                "SELECT * FROM payees WHERE customer_id = ? AND payee_id = ?", (self.customer_id, payee_id)
            ).fetchone()
            contacts = self._contact_names(c) if row else {}
        return _payee(row, contacts.get(payee_id, ())) if row else None

    def _contact_names(self, c: sqlite3.Connection) -> dict[str, tuple[str, ...]]:
        names: dict[str, list[str]] = {}
        for r in c.execute(
            "SELECT payee_id, name FROM contacts WHERE customer_id = ? AND payee_id IS NOT NULL "
            "ORDER BY rowid",
            (self.customer_id,),
        ):
            names.setdefault(r["payee_id"], []).append(r["name"])
        return {k: tuple(v) for k, v in names.items()}

    def upsert_payee(self, payee: Payee) -> None:
        """Adds or replaces one of this customer's payees (tests and tools; the bank-level imports are what
        keep demo and real data apart)."""
        with self.bank._write() as c:
            _upsert_payees(c, self.customer_id, [payee])

    def import_payees_csv(self, path: str | os.PathLike) -> int:
        """``SQLiteBank.import_payees_csv`` for this customer, without its demo-data guard: it edits this
        customer's list whatever the database holds (tests add payees to a demo customer this way)."""
        rows = read_payees_csv(Path(path))
        with self.bank._write() as c:
            return _upsert_payees(c, self.customer_id, rows)

    def contacts(self) -> list[dict]:
        with self.bank._lock:
            rows = self.bank._conn.execute(
                "SELECT contact_id, name, phone, email, payee_id FROM contacts WHERE customer_id = ? "
                "ORDER BY contact_id",
                (self.customer_id,),
            ).fetchall()
        return [dict(r) for r in rows]

    def add_contact(
        self, name: str, payee_id: str | None = None, phone: str | None = None, email: str | None = None
    ) -> str:
        """A phone-book entry; when linked to a payee its name becomes one more way to say that payee.
        ValueError for a payee that is not this customer's."""
        contact_id = f"c-{uuid.uuid4().hex[:10]}"
        with self.bank._write() as c:
            if (
                payee_id is not None
                and not c.execute(
                    "SELECT 1 FROM payees WHERE customer_id = ? AND payee_id = ?",
                    (self.customer_id, payee_id),
                ).fetchone()
            ):
                raise ValueError(f"unknown payee {payee_id!r}")
            c.execute(
                "INSERT INTO contacts (customer_id, contact_id, name, phone, email, payee_id) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (self.customer_id, contact_id, name, phone, email, payee_id),
            )
            if payee_id is not None:
                _bump_version(c, self.customer_id)
        return contact_id

    # --- accounts, cards, transactions ------------------------------------------------------------------
    _ACCOUNT_COLUMNS = "account_id, name, balance_minor, currency"

    def accounts(self) -> list[dict]:
        with self.bank._lock:
            rows = self.bank._conn.execute(
                f"SELECT {self._ACCOUNT_COLUMNS} FROM accounts WHERE customer_id = ? ORDER BY rowid",
                (self.customer_id,),
            ).fetchall()
        return [dict(r) for r in rows]

    def balance(self, account_id: str | None = None) -> dict:
        """One account's balance; without an id, the customer's first (main checking) account."""
        sql = f"SELECT {self._ACCOUNT_COLUMNS} FROM accounts WHERE customer_id = ?"
        args: tuple = (self.customer_id,)
        if account_id is not None:
            sql, args = sql + " AND account_id = ?", (*args, account_id)
        with self.bank._lock:
            row = self.bank._conn.execute(sql + " ORDER BY rowid LIMIT 1", args).fetchone()
        if row is None:
            raise KeyError(f"no account {account_id!r}" if account_id else "no accounts")
        return dict(row)

    def account_for_currency(self, currency: str) -> dict | None:
        """The first account held in ``currency``, which pays transfers in that currency."""
        with self.bank._lock:
            row = self.bank._conn.execute(
                f"SELECT {self._ACCOUNT_COLUMNS} FROM accounts WHERE customer_id = ? AND currency = ? "
                "ORDER BY rowid LIMIT 1",
                (self.customer_id, currency),
            ).fetchone()
        return dict(row) if row else None

    def recent_transactions(self, limit: int = 5, account_id: str | None = None) -> list[dict]:
        """Newest first, at most ``limit`` (capped at 1000)."""
        sql = (
            "SELECT account_id, posted_on, description, amount_minor, currency FROM transactions "
            "WHERE customer_id = ?"
        )
        args: tuple = (self.customer_id,)
        if account_id is not None:
            sql, args = sql + " AND account_id = ?", (*args, account_id)
        sql += " ORDER BY posted_on DESC, txn_id DESC LIMIT ?"
        with self.bank._lock:
            rows = self.bank._conn.execute(
                sql, (*args, min(max(0, int(limit)), _MAX_TRANSACTIONS))
            ).fetchall()
        return [dict(r) for r in rows]

    def cards(self) -> list[dict]:
        with self.bank._lock:
            rows = self.bank._conn.execute(
                "SELECT card_id, account_id, kind, network, last4, locked FROM cards WHERE customer_id = ? "
                "ORDER BY rowid",
                (self.customer_id,),
            ).fetchall()
        return [dict(r, locked=bool(r["locked"])) for r in rows]

    def set_card_locked(self, card_id: str, locked: bool) -> None:
        with self.bank._write() as c:
            cur = c.execute(
                "UPDATE cards SET locked = ? WHERE customer_id = ? AND card_id = ?",
                (int(bool(locked)), self.customer_id, card_id),
            )
            if cur.rowcount == 0:
                raise KeyError(f"no card {card_id!r}")

    # --- transfers --------------------------------------------------------------------------------------
    def create_transfer(
        self,
        session_id: str,
        payee_id: str,
        amount_minor: int,
        currency: str,
        kind: str,
        from_account_id: str | None = None,
        scheduled_for: dt.date | None = None,
    ) -> str:
        """Records a proposed transfer with status 'pending'; nothing moves until ``execute_transfer``.

        Without ``from_account_id`` the first account in ``currency`` pays. Raises ValueError on a bad
        kind, amount, date, payee or account.
        """
        if kind not in TRANSFER_KINDS:
            raise ValueError(f"kind must be one of {TRANSFER_KINDS}, got {kind!r}")
        check_amount_minor(amount_minor)
        if not isinstance(session_id, str) or not session_id:
            raise ValueError(f"session_id must be a non-empty string, got {session_id!r}")
        # A datetime is a date too, but its isoformat() would not read back as one.
        if scheduled_for is not None and (
            isinstance(scheduled_for, dt.datetime) or not isinstance(scheduled_for, dt.date)
        ):
            raise ValueError(f"scheduled_for must be a date, got {scheduled_for!r}")
        transfer_id = f"t-{uuid.uuid4().hex[:12]}"
        now = time.time()
        with self.bank._write() as c:
            if not c.execute(
                "SELECT 1 FROM payees WHERE customer_id = ? AND payee_id = ?", (self.customer_id, payee_id)
            ).fetchone():
                raise ValueError(f"unknown payee {payee_id!r}")
            account = self._paying_account(c, currency, from_account_id)
            c.execute(
                "INSERT INTO transfers (transfer_id, customer_id, session_id, payee_id, from_account_id, "
                "amount_minor, currency, kind, status, scheduled_for, note, idempotency_key, created_at, "
                "updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 'pending', ?, NULL, NULL, ?, ?)",
                (
                    transfer_id,
                    self.customer_id,
                    session_id,
                    payee_id,
                    account,
                    amount_minor,
                    currency,
                    kind,
                    scheduled_for.isoformat() if scheduled_for else None,
                    now,
                    now,
                ),
            )
        return transfer_id

    def _paying_account(self, c: sqlite3.Connection, currency: str, account_id: str | None) -> str:
        if account_id is None:
            row = c.execute(
                "SELECT account_id FROM accounts WHERE customer_id = ? AND currency = ? "
                "ORDER BY rowid LIMIT 1",
                (self.customer_id, currency),
            ).fetchone()
            if row is None:
                raise ValueError(f"no account in {currency}")
            return row["account_id"]
        row = c.execute(
            "SELECT currency FROM accounts WHERE customer_id = ? AND account_id = ?",
            (self.customer_id, account_id),
        ).fetchone()
        if row is None or row["currency"] != currency:
            raise ValueError(f"account {account_id!r} does not exist or is not in {currency}")
        return account_id

    def _transfer_row(self, c: sqlite3.Connection, transfer_id: str) -> sqlite3.Row | None:
        return c.execute(
            "SELECT * FROM transfers WHERE customer_id = ? AND transfer_id = ?",
            (self.customer_id, transfer_id),
        ).fetchone()

    def transfer(self, transfer_id: str) -> dict | None:
        with self.bank._lock:
            row = self._transfer_row(self.bank._conn, transfer_id)
        return dict(row) if row else None

    def execute_transfer(self, transfer_id: str, idempotency_key: str, today: dt.date | None = None) -> dict:
        """Moves the money of a pending transfer, atomically, at most once, and returns the transfer.

        A transfer scheduled after ``today`` becomes 'scheduled' (a job outside this demo would run it);
        one the account cannot cover becomes 'failed'. The key is stored on the transfer: the same call
        again returns it as stored and moves nothing. ValueError for an unknown transfer, a bad key, a key
        this customer used on another transfer, and a transfer that is no longer pending.
        """
        check_idempotency_key(idempotency_key)
        today = today or dt.date.today()
        with self.bank._write() as c:
            t = self._transfer_row(c, transfer_id)
            if t is None:
                raise ValueError(f"no transfer {transfer_id!r}")
            if t["idempotency_key"] == idempotency_key:
                return dict(t)  # a retry of the call that already ran
            if t["status"] != "pending":
                raise ValueError(f"transfer {transfer_id} is {t['status']}, not pending")
            other = c.execute(
                "SELECT transfer_id FROM transfers WHERE customer_id = ? AND idempotency_key = ?",
                (self.customer_id, idempotency_key),
            ).fetchone()
            if other is not None:
                raise ValueError(f"idempotency key already used for transfer {other['transfer_id']}")
            status, note = self._settle(c, t, today)
            c.execute(
                "UPDATE transfers SET status = ?, note = ?, idempotency_key = ?, updated_at = ? "
                "WHERE customer_id = ? AND transfer_id = ?",
                (status, note, idempotency_key, time.time(), self.customer_id, transfer_id),
            )
            return dict(self._transfer_row(c, transfer_id))

    def _settle(self, c: sqlite3.Connection, t: sqlite3.Row, today: dt.date) -> tuple[str, str | None]:
        """Debits the paying account for a transfer due today; (status, note) of the outcome."""
        if t["scheduled_for"] and dt.date.fromisoformat(t["scheduled_for"]) > today:
            return "scheduled", None
        balance = c.execute(
            "SELECT balance_minor FROM accounts WHERE customer_id = ? AND account_id = ?",
            (self.customer_id, t["from_account_id"]),
        ).fetchone()["balance_minor"]
        if balance < t["amount_minor"]:
            return "failed", "insufficient funds"
        payee = c.execute(
            "SELECT display_name FROM payees WHERE customer_id = ? AND payee_id = ?",
            (self.customer_id, t["payee_id"]),
        ).fetchone()
        what = "Payment to" if t["kind"] == "bill_payment" else "Transfer to"
        c.execute(
            "UPDATE accounts SET balance_minor = balance_minor - ? WHERE customer_id = ? AND account_id = ?",
            (t["amount_minor"], self.customer_id, t["from_account_id"]),
        )
        c.execute(
            "INSERT INTO transactions "
            "(customer_id, account_id, posted_on, description, amount_minor, currency) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (
                self.customer_id,
                t["from_account_id"],
                today.isoformat(),
                f"{what} {payee['display_name']}",
                -t["amount_minor"],
                t["currency"],
            ),
        )
        return "executed", None

    def cancel_transfer(self, transfer_id: str) -> None:
        """Cancels a pending transfer; a no-op for one no longer pending (idempotent) or not this
        customer's."""
        with self.bank._write() as c:
            c.execute(
                "UPDATE transfers SET status = 'cancelled', updated_at = ? "
                "WHERE customer_id = ? AND transfer_id = ? AND status = 'pending'",
                (time.time(), self.customer_id, transfer_id),
            )

    def transfers(self, status: str | None = None) -> list[dict]:
        sql, args = "SELECT * FROM transfers WHERE customer_id = ?", (self.customer_id,)
        if status is not None:
            sql, args = sql + " AND status = ?", (*args, status)
        with self.bank._lock:
            return [dict(r) for r in self.bank._conn.execute(sql + " ORDER BY created_at, rowid", args)]


# --- rows -------------------------------------------------------------------------------------------------
def _payee(row: sqlite3.Row, contact_names: tuple[str, ...]) -> Payee:
    aliases = tuple(a for a in row["aliases"].split(",") if a) + contact_names
    return Payee(row["payee_id"], row["display_name"], row["relationship"], row["kind"], aliases)


def _bump_version(c: sqlite3.Connection, customer_id: str) -> None:
    c.execute("UPDATE customers SET payee_version = payee_version + 1 WHERE customer_id = ?", (customer_id,))


def _upsert_payees(c: sqlite3.Connection, customer_id: str, payees: Iterable[Payee]) -> int:
    n = 0
    for p in payees:
        c.execute(
            "INSERT INTO payees (customer_id, payee_id, display_name, relationship, kind, aliases) "
            "VALUES (?, ?, ?, ?, ?, ?) "
            "ON CONFLICT (customer_id, payee_id) DO UPDATE SET display_name = excluded.display_name, "
            "relationship = excluded.relationship, kind = excluded.kind, aliases = excluded.aliases",
            (customer_id, p.payee_id, p.display_name, p.relationship, p.kind, ",".join(p.aliases)),
        )
        n += 1
    if n:
        _bump_version(c, customer_id)
    return n


def _seed_customer(c: sqlite3.Connection, customer_id: str, name: str, data: dict) -> None:
    c.execute(
        "INSERT OR IGNORE INTO customers (customer_id, name, demo) VALUES (?, ?, 1)", (customer_id, name)
    )
    c.executemany(
        "INSERT OR IGNORE INTO accounts (customer_id, account_id, name, currency, balance_minor) "
        "VALUES (?, ?, ?, ?, ?)",
        [(customer_id, *a) for a in data["accounts"]],
    )
    added = 0
    for payee in data["payees"]:
        added += c.execute(
            "INSERT OR IGNORE INTO payees (customer_id, payee_id, display_name, relationship, kind, aliases) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (customer_id, *payee),
        ).rowcount
    for contact in data["contacts"]:
        added += c.execute(
            "INSERT OR IGNORE INTO contacts (customer_id, contact_id, name, phone, email, payee_id) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (customer_id, *contact),
        ).rowcount
    c.executemany(
        "INSERT OR IGNORE INTO cards (customer_id, card_id, account_id, kind, network, last4) "
        "VALUES (?, ?, ?, ?, ?, ?)",
        [(customer_id, *card) for card in data["cards"]],
    )
    if not c.execute("SELECT 1 FROM transactions WHERE customer_id = ? LIMIT 1", (customer_id,)).fetchone():
        c.executemany(
            "INSERT INTO transactions "
            "(customer_id, account_id, posted_on, description, amount_minor, currency) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            [(customer_id, *t) for t in data["transactions"]],
        )
    if added:
        _bump_version(c, customer_id)


def demo_bank(path: str | os.PathLike = ":memory:") -> SQLiteBank:
    """A bank seeded with the two demo customers: the shortest way to a working assistant in tests and
    demos."""
    bank = SQLiteBank(path)
    bank.seed_demo()
    return bank


def demo_db(path: str | os.PathLike = ":memory:") -> SQLiteCustomerBank:
    """The first demo customer's view of a fresh ``demo_bank`` (for tests of payees and intents)."""
    return demo_bank(path).customer(DEMO_CUSTOMER_ID)
