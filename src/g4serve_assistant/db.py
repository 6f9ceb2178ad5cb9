"""The embedded bank: ``SQLiteBank``, bank_sql.py's ``SQLBank`` on an SQLite file (or ``:memory:``), its
schema migrated under ``PRAGMA user_version``; ``open_sql_bank`` for a URL (PostgreSQL: bank_postgres.py);
``demo_bank`` for tests and demos. One connection behind a lock: any thread may call any method."""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable

from g4serve_assistant.bank import Payee
from g4serve_assistant.bank_postgres import PostgresBank
from g4serve_assistant.bank_sql import SchemaTooNewError, SQLBank, SQLCustomerBank
from g4serve_assistant.demo_data import DEMO_CUSTOMER_2_ID, DEMO_CUSTOMER_ID
from g4serve_assistant.sql import SQLiteDatabase, open_database

__all__ = [
    "DEMO_CUSTOMER_2_ID",
    "DEMO_CUSTOMER_ID",
    "SCHEMA_VERSION",
    "MigrationError",
    "Payee",
    "PostgresBank",
    "SQLBank",
    "SQLCustomerBank",
    "SQLiteBank",
    "SQLiteCustomerBank",
    "SchemaTooNewError",
    "demo_bank",
    "demo_db",
    "open_sql_bank",
]

# Its old name, from when the bank was SQLite only; one class serves both databases now.
SQLiteCustomerBank = SQLCustomerBank


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
class SQLiteBank(SQLBank):
    """The bank in one SQLite file (``path``, or an open ``SQLiteDatabase``), migrated to
    ``SCHEMA_VERSION`` when opened; several processes may share the file."""

    def __init__(self, path: str | os.PathLike | SQLiteDatabase = ":memory:"):
        db = path if isinstance(path, SQLiteDatabase) else SQLiteDatabase(path)
        self.path = db.path
        # The connection and its lock are the database's: migrations (and tests) use the connection directly.
        self._conn, self._lock = db.conn, db._lock
        try:
            with self._lock:
                self._conn.execute("PRAGMA foreign_keys=ON")
                migrate(self._conn, self.path)
        except BaseException:
            db.close()
            raise
        super().__init__(db)

    @property
    def schema_version(self) -> int:
        with self._lock:
            return _user_version(self._conn)


def open_sql_bank(url: str | os.PathLike) -> SQLBank:
    """The bank at ``url``: ``postgresql://…`` (or ``postgres://``) a ``PostgresBank``; ``sqlite:///path``, a
    plain path or ``:memory:`` a ``SQLiteBank``. Created empty when new, migrated when older."""
    db = open_database(url)
    return PostgresBank(db) if db.dialect == "postgresql" else SQLiteBank(db)


def demo_bank(path: str | os.PathLike = ":memory:") -> SQLiteBank:
    """A bank seeded with the two demo customers: the shortest way to a working assistant in tests and
    demos."""
    bank = SQLiteBank(path)
    bank.seed_demo()
    return bank


def demo_db(path: str | os.PathLike = ":memory:") -> SQLCustomerBank:
    """The first demo customer's view of a fresh ``demo_bank`` (for tests of payees and intents)."""
    return demo_bank(path).customer(DEMO_CUSTOMER_ID)
