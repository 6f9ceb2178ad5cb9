"""A database as the single-customer assistant wrote it (schema version 0, before customers owned their rows):
its schema text copied verbatim from that db.py, and the rows its seed_demo, import-payees and a few turns
left, so the migration tests start from what users have on disk."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from g4serve_assistant.demo_data import DEMO_1

# db.py's _SCHEMA at commit 002abfa, unchanged.
LEGACY_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS customers (customer_id TEXT PRIMARY KEY, name TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS accounts (
    account_id TEXT PRIMARY KEY, customer_id TEXT NOT NULL REFERENCES customers, name TEXT NOT NULL,
    currency TEXT NOT NULL, balance_minor INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS payees (
    payee_id TEXT PRIMARY KEY, display_name TEXT NOT NULL, relationship TEXT NOT NULL DEFAULT '',
    kind TEXT NOT NULL CHECK (kind IN ('person', 'biller')), aliases TEXT NOT NULL DEFAULT '');
CREATE TABLE IF NOT EXISTS contacts (
    contact_id TEXT PRIMARY KEY, name TEXT NOT NULL, phone TEXT, email TEXT, payee_id TEXT REFERENCES payees);
CREATE TABLE IF NOT EXISTS cards (
    card_id TEXT PRIMARY KEY, account_id TEXT NOT NULL REFERENCES accounts, kind TEXT NOT NULL,
    network TEXT NOT NULL, last4 TEXT NOT NULL, locked INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS transactions (
    txn_id INTEGER PRIMARY KEY AUTOINCREMENT, account_id TEXT NOT NULL REFERENCES accounts,
    posted_on TEXT NOT NULL, description TEXT NOT NULL, amount_minor INTEGER NOT NULL, \
currency TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS transfers (
    transfer_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, payee_id TEXT NOT NULL REFERENCES payees,
    from_account_id TEXT NOT NULL REFERENCES accounts, amount_minor INTEGER NOT NULL CHECK (amount_minor > 0),
    currency TEXT NOT NULL, kind TEXT NOT NULL CHECK (kind IN ('transfer', 'bill_payment')),
    status TEXT NOT NULL, scheduled_for TEXT, note TEXT, created_at REAL NOT NULL, updated_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS audit (
    audit_id INTEGER PRIMARY KEY AUTOINCREMENT, ts REAL NOT NULL, session_id TEXT NOT NULL,
    stage TEXT NOT NULL, event TEXT NOT NULL, detail TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS audit_by_session ON audit (session_id, audit_id);
INSERT OR IGNORE INTO meta (key, value) VALUES ('payee_version', 0);
"""

LEGACY_PAYEE_VERSION = 7
EXECUTED_TRANSFER = "t-legacy-done"
PENDING_TRANSFER = "t-legacy-open"


def build_legacy_db(path: Path, *, seeded: bool = True) -> None:
    """A version-0 file at ``path``: when ``seeded``, cust-001 Alex Morgan as its seed_demo wrote him (the
    same rows the demo's cust-001 has today), one imported payee beside them, a locked card, one executed and
    one pending transfer, and audit rows; unseeded, only an imported payee (the CLI never made that, the
    class did)."""
    conn = sqlite3.connect(path)
    conn.executescript(LEGACY_SCHEMA)
    demo = DEMO_1
    with conn:
        if seeded:
            conn.execute("INSERT INTO customers VALUES ('cust-001', 'Alex Morgan')")
            conn.executemany("INSERT INTO accounts VALUES (?, 'cust-001', ?, ?, ?)", demo["accounts"])
            conn.executemany("INSERT INTO payees VALUES (?, ?, ?, ?, ?)", demo["payees"])
            conn.executemany("INSERT INTO contacts VALUES (?, ?, ?, ?, ?)", demo["contacts"])
            conn.executemany("INSERT INTO cards VALUES (?, ?, ?, ?, ?, 0)", demo["cards"])
            conn.executemany(
                "INSERT INTO transactions (account_id, posted_on, description, amount_minor, currency) "
                "VALUES (?, ?, ?, ?, ?)",
                demo["transactions"],
            )
            conn.execute("UPDATE cards SET locked = 1 WHERE card_id = 'card-credit'")
            conn.execute(
                "INSERT INTO transfers VALUES (?, 's-old', 'john_smith', 'chk-001', 5000, 'USD', 'transfer', "
                "'executed', NULL, NULL, 1.0, 2.0)",
                (EXECUTED_TRANSFER,),
            )
            conn.execute(
                "UPDATE accounts SET balance_minor = balance_minor - 5000 WHERE account_id = 'chk-001'"
            )
            conn.execute(
                "INSERT INTO transactions (account_id, posted_on, description, amount_minor, currency) "
                "VALUES ('chk-001', '2025-05-03', 'Transfer to John Smith', -5000, 'USD')"
            )
            conn.execute(
                "INSERT INTO transfers VALUES (?, 's-old', 'city_electric', 'chk-001', 2500, 'USD', "
                "'bill_payment', 'pending', NULL, NULL, 3.0, 3.0)",
                (PENDING_TRANSFER,),
            )
        conn.execute("INSERT INTO payees VALUES ('zed_newman', 'Zed Newman', 'friend', 'person', 'zed')")
        conn.execute("UPDATE meta SET value = ? WHERE key = 'payee_version'", (LEGACY_PAYEE_VERSION,))
        conn.executemany(
            "INSERT INTO audit (ts, session_id, stage, event, detail) VALUES (?, ?, ?, ?, ?)",
            [(1.0, "s-old", "intent", "transfer_money", "{}"), (2.0, "s-old", "policy", "executed", "{}")],
        )
    conn.close()
