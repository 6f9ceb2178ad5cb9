"""The bank on PostgreSQL (``PostgresBank``): bank_sql.py's ``SQLBank`` over sql.py's ``PostgresDatabase``,
for replicas on several machines. Its schema is db.py's SQLite schema in PostgreSQL's types, created (or
brought up to date) under an advisory lock when a replica opens it, its version in ``bank_meta``."""

from __future__ import annotations

from collections.abc import Sequence

from g4serve_assistant.bank_sql import SchemaTooNewError, SQLBank
from g4serve_assistant.sql import SCHEMA_LOCK_KEY, PostgresDatabase, SQLDatabase

# Where the SQLite schema says INTEGER, REAL and TEXT: BIGINT (PostgreSQL's INTEGER is 32-bit, and amounts
# reach MAX_AMOUNT_MINOR, 10^13), DOUBLE PRECISION (its REAL is 32-bit: a Unix time would lose its seconds)
# and TEXT COLLATE "C" for the ids (compared and sorted by byte, as SQLite does, whatever the server's
# locale). `rowid` numbers rows in insertion order, which SQLite's implicit rowid does and the queries sort
# by (the first account is the main one).
_ID = 'TEXT COLLATE "C"'
_ROWID = "rowid BIGINT GENERATED ALWAYS AS IDENTITY UNIQUE"
_SCHEMA_1 = (
    f"""CREATE TABLE customers (
    customer_id {_ID} PRIMARY KEY, name TEXT NOT NULL,
    demo INTEGER NOT NULL DEFAULT 0 CHECK (demo IN (0, 1)),
    payee_version BIGINT NOT NULL DEFAULT 0, {_ROWID})""",
    f"""CREATE TABLE accounts (
    customer_id {_ID} NOT NULL REFERENCES customers, account_id {_ID} NOT NULL, name TEXT NOT NULL,
    currency TEXT NOT NULL, balance_minor BIGINT NOT NULL, {_ROWID},
    PRIMARY KEY (customer_id, account_id))""",
    f"""CREATE TABLE payees (
    customer_id {_ID} NOT NULL REFERENCES customers, payee_id {_ID} NOT NULL, display_name TEXT NOT NULL,
    relationship TEXT NOT NULL DEFAULT '', kind TEXT NOT NULL CHECK (kind IN ('person', 'biller')),
    aliases TEXT NOT NULL DEFAULT '', {_ROWID},
    PRIMARY KEY (customer_id, payee_id))""",
    f"""CREATE TABLE contacts (
    customer_id {_ID} NOT NULL REFERENCES customers, contact_id {_ID} NOT NULL, name TEXT NOT NULL,
    phone TEXT, email TEXT, payee_id {_ID}, {_ROWID},
    PRIMARY KEY (customer_id, contact_id),
    FOREIGN KEY (customer_id, payee_id) REFERENCES payees (customer_id, payee_id))""",
    f"""CREATE TABLE cards (
    customer_id {_ID} NOT NULL, card_id {_ID} NOT NULL, account_id {_ID} NOT NULL, kind TEXT NOT NULL,
    network TEXT NOT NULL, last4 TEXT NOT NULL, locked INTEGER NOT NULL DEFAULT 0, {_ROWID},
    PRIMARY KEY (customer_id, card_id),
    FOREIGN KEY (customer_id, account_id) REFERENCES accounts (customer_id, account_id))""",
    f"""CREATE TABLE transactions (
    txn_id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, customer_id {_ID} NOT NULL,
    account_id {_ID} NOT NULL, posted_on {_ID} NOT NULL, description TEXT NOT NULL,
    amount_minor BIGINT NOT NULL, currency TEXT NOT NULL,
    FOREIGN KEY (customer_id, account_id) REFERENCES accounts (customer_id, account_id))""",
    "CREATE INDEX transactions_by_account ON transactions (customer_id, account_id, posted_on)",
    f"""CREATE TABLE transfers (
    transfer_id {_ID} PRIMARY KEY, customer_id {_ID} NOT NULL, session_id TEXT NOT NULL,
    payee_id {_ID} NOT NULL, from_account_id {_ID} NOT NULL,
    amount_minor BIGINT NOT NULL CHECK (amount_minor > 0), currency TEXT NOT NULL,
    kind TEXT NOT NULL CHECK (kind IN ('transfer', 'bill_payment')),
    status TEXT NOT NULL CHECK (status IN ('pending', 'executed', 'scheduled', 'failed', 'cancelled')),
    scheduled_for TEXT, note TEXT, idempotency_key {_ID}, created_at DOUBLE PRECISION NOT NULL,
    updated_at DOUBLE PRECISION NOT NULL, {_ROWID},
    FOREIGN KEY (customer_id, payee_id) REFERENCES payees (customer_id, payee_id),
    FOREIGN KEY (customer_id, from_account_id) REFERENCES accounts (customer_id, account_id),
    UNIQUE (customer_id, idempotency_key))""",
    "CREATE INDEX transfers_by_customer ON transfers (customer_id, status)",
)
# The DDL of each schema version, as db.MIGRATIONS has one step per version for SQLite: STEPS[i] takes the
# schema from version i to i + 1. Append only, in step with db.MIGRATIONS (a test checks the counts agree).
# There is no version 0 to migrate from here: a new database gets every step.
STEPS: list[Sequence[str]] = [_SCHEMA_1]
SCHEMA_VERSION = len(STEPS)


def create_or_upgrade(db: SQLDatabase) -> int:
    """Brings the bank's tables in ``db`` to ``SCHEMA_VERSION`` in one transaction, under the server-wide
    schema lock (replicas starting at once take turns; the later ones find it done), and returns the
    version it found (0: a new database). SchemaTooNewError for tables newer than this code."""
    with db.transaction() as tx:
        tx.serialize(SCHEMA_LOCK_KEY)
        tx.run("CREATE TABLE IF NOT EXISTS bank_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        rows = tx.query("SELECT value FROM bank_meta WHERE key = 'schema_version'")
        found = int(rows[0]["value"]) if rows else 0
        if found > SCHEMA_VERSION:
            raise SchemaTooNewError(
                f"{db.name}: bank schema version {found} is newer than this g4serve_assistant's "
                f"{SCHEMA_VERSION}; upgrade g4serve or use another database"
            )
        for step in STEPS[found:]:
            for statement in step:
                tx.run(statement)
        tx.run(
            "INSERT INTO bank_meta (key, value) VALUES ('schema_version', ?) "
            "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            (str(SCHEMA_VERSION),),
        )
    return found


class PostgresBank(SQLBank):
    """The bank in a PostgreSQL database: ``url`` (``postgresql://user@host/db``; ``schema``, a schema of
    its own there) or an open ``PostgresDatabase``. Every replica opens it alike; the tables are created on
    first use."""

    def __init__(self, url: str | PostgresDatabase, *, schema: str | None = None):
        db = url if isinstance(url, PostgresDatabase) else PostgresDatabase(url, schema=schema)
        try:
            create_or_upgrade(db)
        except BaseException:
            db.close()
            raise
        super().__init__(db)

    @property
    def schema_version(self) -> int:
        with self.db.read() as tx:
            return int(tx.query("SELECT value FROM bank_meta WHERE key = 'schema_version'")[0]["value"])
