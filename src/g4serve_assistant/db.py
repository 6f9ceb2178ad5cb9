"""SQLite store of the voice banking assistant: customer, accounts, payees, contacts, cards, transactions,
transfers and the audit trail. One connection behind a lock, so any thread may call any method."""

from __future__ import annotations

import csv
import datetime as dt
import json
import os
import re
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

PAYEE_KINDS = ("person", "biller")
TRANSFER_KINDS = ("transfer", "bill_payment")
CSV_REQUIRED = ("payee_id", "display_name", "relationship")
CSV_OPTIONAL = ("kind", "aliases")
_PAYEE_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_MAX_NAME_CHARS = 100

_SCHEMA = """
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


@dataclass(frozen=True)
class Payee:
    payee_id: str
    display_name: str
    relationship: str
    kind: str  # 'person' | 'biller'
    aliases: tuple[str, ...] = ()  # other names the customer uses: "mom", "electricity", contact names


class BankDB:
    """The bank's records for one demo customer, plus transfers and the audit trail."""

    def __init__(self, path: str | os.PathLike = ":memory:"):
        self.path = str(path)
        # One connection shared by all threads: sqlite3 objects are not thread-safe, so every use holds
        # the lock (statements are microseconds, so contention is negligible at voice-turn rates).
        self._conn = sqlite3.connect(self.path, check_same_thread=False)
        self._conn.row_factory = sqlite3.Row
        self._lock = threading.RLock()
        with self._lock, self._conn:
            if self.path != ":memory:":
                self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA foreign_keys=ON")
            self._conn.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    # --- payees -------------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        """Bumped on every change to payees or contacts; the payee index rebuilds when it moves.

        Kept in the database (not in this object) so a second connection to the same file sees it too.
        """
        with self._lock:
            return self._conn.execute("SELECT value FROM meta WHERE key = 'payee_version'").fetchone()[0]

    def _bump_version(self) -> None:
        self._conn.execute("UPDATE meta SET value = value + 1 WHERE key = 'payee_version'")

    def payees(self) -> list[Payee]:
        with self._lock:
            rows = self._conn.execute("SELECT * FROM payees ORDER BY payee_id").fetchall()
            contacts = self._contact_names()
        return [_payee(r, contacts.get(r["payee_id"], ())) for r in rows]

    def payee(self, payee_id: str) -> Payee | None:
        with self._lock:
            row = self._conn.execute("SELECT * FROM payees WHERE payee_id = ?", (payee_id,)).fetchone()
            contacts = self._contact_names() if row else {}
        return _payee(row, contacts.get(payee_id, ())) if row else None

    def _contact_names(self) -> dict[str, tuple[str, ...]]:
        names: dict[str, list[str]] = {}
        for r in self._conn.execute("SELECT payee_id, name FROM contacts WHERE payee_id IS NOT NULL"):
            names.setdefault(r["payee_id"], []).append(r["name"])
        return {k: tuple(v) for k, v in names.items()}

    def upsert_payee(self, payee: Payee) -> None:
        with self._lock, self._conn:
            self._upsert_payees([payee])

    def _upsert_payees(self, payees: Iterable[Payee]) -> int:
        n = 0
        for p in payees:
            self._conn.execute(
                "INSERT INTO payees (payee_id, display_name, relationship, kind, aliases) "
                "VALUES (?, ?, ?, ?, ?) "
                "ON CONFLICT (payee_id) DO UPDATE SET display_name = excluded.display_name, "
                "relationship = excluded.relationship, kind = excluded.kind, aliases = excluded.aliases",
                (p.payee_id, p.display_name, p.relationship, p.kind, ",".join(p.aliases)),
            )
            n += 1
        if n:
            self._bump_version()
        return n

    def contacts(self) -> list[dict]:
        with self._lock:
            return [dict(r) for r in self._conn.execute("SELECT * FROM contacts ORDER BY contact_id")]

    def add_contact(
        self, name: str, payee_id: str | None = None, phone: str | None = None, email: str | None = None
    ) -> str:
        """A phone-book entry; when linked to a payee its name becomes one more way to say that payee."""
        contact_id = f"c-{uuid.uuid4().hex[:10]}"
        with self._lock, self._conn:
            self._conn.execute(
                "INSERT INTO contacts VALUES (?, ?, ?, ?, ?)", (contact_id, name, phone, email, payee_id)
            )
            if payee_id is not None:
                self._bump_version()
        return contact_id

    def import_payees_csv(self, path: str | os.PathLike) -> int:
        """Upserts payees from a CSV with columns payee_id,display_name,relationship[,kind][,aliases].

        The whole file is validated first and written in one transaction: a bad row imports nothing.
        ``aliases`` is ';'-separated. Raises ValueError naming the file, line and column of the first problem.
        """
        rows = _read_payees_csv(Path(path))
        with self._lock, self._conn:
            return self._upsert_payees(rows)

    # --- accounts, cards, transactions ------------------------------------------------------------------
    def accounts(self) -> list[dict]:
        with self._lock:
            return [
                dict(r)
                for r in self._conn.execute(
                    "SELECT account_id, name, balance_minor, currency FROM accounts ORDER BY rowid"
                )
            ]

    def balance(self, account_id: str | None = None) -> dict:
        """One account's balance; without an id, the customer's first (main checking) account."""
        with self._lock:
            if account_id is None:
                row = self._conn.execute(
                    "SELECT account_id, name, balance_minor, currency FROM accounts ORDER BY rowid LIMIT 1"
                ).fetchone()
            else:
                row = self._conn.execute(
                    "SELECT account_id, name, balance_minor, currency FROM accounts WHERE account_id = ?",
                    (account_id,),
                ).fetchone()
        if row is None:
            raise KeyError(f"no account {account_id!r}" if account_id else "no accounts")
        return dict(row)

    def recent_transactions(self, limit: int = 5, account_id: str | None = None) -> list[dict]:
        """Newest first."""
        sql = "SELECT * FROM transactions"
        args: tuple = ()
        if account_id is not None:
            sql += " WHERE account_id = ?"
            args = (account_id,)
        sql += " ORDER BY posted_on DESC, txn_id DESC LIMIT ?"
        with self._lock:
            return [dict(r) for r in self._conn.execute(sql, (*args, max(0, int(limit))))]

    def cards(self) -> list[dict]:
        with self._lock:
            rows = self._conn.execute("SELECT * FROM cards ORDER BY rowid").fetchall()
        return [dict(r, locked=bool(r["locked"])) for r in rows]

    def set_card_locked(self, card_id: str, locked: bool) -> None:
        with self._lock, self._conn:
            cur = self._conn.execute("UPDATE cards SET locked = ? WHERE card_id = ?", (int(locked), card_id))
        if cur.rowcount == 0:
            raise KeyError(f"no card {card_id!r}")

    # --- transfers ------------------------------------------------------------------------------------
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
        kind, amount, payee or account.
        """
        if kind not in TRANSFER_KINDS:
            raise ValueError(f"kind must be one of {TRANSFER_KINDS}, got {kind!r}")
        if isinstance(amount_minor, bool) or not isinstance(amount_minor, int) or amount_minor <= 0:
            raise ValueError(f"amount_minor must be a positive int, got {amount_minor!r}")
        transfer_id = f"t-{uuid.uuid4().hex[:12]}"
        now = time.time()
        with self._lock, self._conn:
            if self._conn.execute("SELECT 1 FROM payees WHERE payee_id = ?", (payee_id,)).fetchone() is None:
                raise ValueError(f"unknown payee {payee_id!r}")
            account = self._paying_account(currency, from_account_id)
            self._conn.execute(
                "INSERT INTO transfers (transfer_id, session_id, payee_id, from_account_id, amount_minor, "
                "currency, kind, status, scheduled_for, created_at, updated_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, 'pending', ?, ?, ?)",
                (
                    transfer_id,
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

    def account_for_currency(self, currency: str) -> dict | None:
        """The first account held in ``currency``, which pays transfers in that currency."""
        with self._lock:
            row = self._conn.execute(
                "SELECT account_id, name, balance_minor, currency FROM accounts "
                "WHERE currency = ? ORDER BY rowid LIMIT 1",
                (currency,),
            ).fetchone()
        return dict(row) if row else None

    def _paying_account(self, currency: str, account_id: str | None) -> str:
        if account_id is None:
            row = self._conn.execute(
                "SELECT account_id FROM accounts WHERE currency = ? ORDER BY rowid LIMIT 1", (currency,)
            ).fetchone()
            if row is None:
                raise ValueError(f"no account in {currency}")
            return row["account_id"]
        row = self._conn.execute(
            "SELECT currency FROM accounts WHERE account_id = ?", (account_id,)
        ).fetchone()
        if row is None or row["currency"] != currency:
            raise ValueError(f"account {account_id!r} does not exist or is not in {currency}")
        return account_id

    def transfer(self, transfer_id: str) -> dict | None:
        with self._lock:
            row = self._conn.execute(
                "SELECT * FROM transfers WHERE transfer_id = ?", (transfer_id,)
            ).fetchone()
        return dict(row) if row else None

    def execute_transfer(self, transfer_id: str, today: dt.date | None = None) -> dict:
        """Moves the money of a pending transfer, atomically, at most once.

        A transfer scheduled after ``today`` becomes 'scheduled' (a job outside this demo would run it);
        one the account cannot cover becomes 'failed'. Raises ValueError unless the transfer is pending.
        """
        today = today or dt.date.today()
        with self._lock, self._conn:
            t = self._conn.execute("SELECT * FROM transfers WHERE transfer_id = ?", (transfer_id,)).fetchone()
            if t is None:
                raise ValueError(f"no transfer {transfer_id!r}")
            if t["status"] != "pending":
                raise ValueError(f"transfer {transfer_id} is {t['status']}, not pending")
            status, note = "executed", None
            if t["scheduled_for"] and dt.date.fromisoformat(t["scheduled_for"]) > today:
                status = "scheduled"
            else:
                balance = self._conn.execute(
                    "SELECT balance_minor FROM accounts WHERE account_id = ?", (t["from_account_id"],)
                ).fetchone()["balance_minor"]
                if balance < t["amount_minor"]:
                    status, note = "failed", "insufficient funds"
                else:
                    payee = self._conn.execute(
                        "SELECT display_name FROM payees WHERE payee_id = ?", (t["payee_id"],)
                    ).fetchone()
                    what = "Payment to" if t["kind"] == "bill_payment" else "Transfer to"
                    self._conn.execute(
                        "UPDATE accounts SET balance_minor = balance_minor - ? WHERE account_id = ?",
                        (t["amount_minor"], t["from_account_id"]),
                    )
                    self._conn.execute(
                        "INSERT INTO transactions "
                        "(account_id, posted_on, description, amount_minor, currency) "
                        "VALUES (?, ?, ?, ?, ?)",
                        (
                            t["from_account_id"],
                            today.isoformat(),
                            f"{what} {payee['display_name']}",
                            -t["amount_minor"],
                            t["currency"],
                        ),
                    )
            self._conn.execute(
                "UPDATE transfers SET status = ?, note = ?, updated_at = ? WHERE transfer_id = ?",
                (status, note, time.time(), transfer_id),
            )
            return dict(
                self._conn.execute("SELECT * FROM transfers WHERE transfer_id = ?", (transfer_id,)).fetchone()
            )

    def cancel_transfer(self, transfer_id: str) -> None:
        """Cancels a pending transfer; cancelling one that is no longer pending is a no-op (idempotent)."""
        with self._lock, self._conn:
            self._conn.execute(
                "UPDATE transfers SET status = 'cancelled', updated_at = ? "
                "WHERE transfer_id = ? AND status = 'pending'",
                (time.time(), transfer_id),
            )

    def transfers(self, status: str | None = None) -> list[dict]:
        sql, args = "SELECT * FROM transfers", ()
        if status is not None:
            sql, args = sql + " WHERE status = ?", (status,)
        with self._lock:
            return [dict(r) for r in self._conn.execute(sql + " ORDER BY created_at, rowid", args)]

    # --- audit ----------------------------------------------------------------------------------------
    def audit(self, session_id: str, stage: str, event: str, detail: dict) -> None:
        self.audit_many(session_id, [(stage, event, detail)])

    def audit_many(self, session_id: str, rows: Iterable[tuple[str, str, dict]]) -> None:
        """Several audit rows in one transaction (one commit per turn, not per normalization rule)."""
        now = time.time()
        values = [
            (now, session_id, stage, event, json.dumps(detail, default=str, sort_keys=True))
            for stage, event, detail in rows
        ]
        if values:
            with self._lock, self._conn:
                self._conn.executemany(
                    "INSERT INTO audit (ts, session_id, stage, event, detail) VALUES (?, ?, ?, ?, ?)", values
                )

    def audit_log(self, session_id: str | None = None) -> list[dict]:
        sql, args = "SELECT * FROM audit", ()
        if session_id is not None:
            sql, args = sql + " WHERE session_id = ?", (session_id,)
        with self._lock:
            rows = self._conn.execute(sql + " ORDER BY audit_id", args).fetchall()
        return [dict(r, detail=json.loads(r["detail"])) for r in rows]

    # --- demo data ------------------------------------------------------------------------------------
    def seed_demo(self) -> None:
        """One customer with accounts, ~30 payees (confusable names on purpose), 2 cards and ~20 transactions.

        Idempotent: rows that exist are left alone, and the payee version only moves if payees were added.
        """
        with self._lock, self._conn:
            c = self._conn
            c.execute("INSERT OR IGNORE INTO customers VALUES ('cust-001', 'Alex Morgan')")
            c.executemany("INSERT OR IGNORE INTO accounts VALUES (?, 'cust-001', ?, ?, ?)", _DEMO_ACCOUNTS)
            added = 0
            for payee_id, name, relationship, kind, aliases in _DEMO_PAYEES:
                added += c.execute(
                    "INSERT OR IGNORE INTO payees VALUES (?, ?, ?, ?, ?)",
                    (payee_id, name, relationship, kind, aliases),
                ).rowcount
            for contact in _DEMO_CONTACTS:
                added += c.execute("INSERT OR IGNORE INTO contacts VALUES (?, ?, ?, ?, ?)", contact).rowcount
            c.executemany("INSERT OR IGNORE INTO cards VALUES (?, ?, ?, ?, ?, 0)", _DEMO_CARDS)
            if c.execute("SELECT COUNT(*) FROM transactions").fetchone()[0] == 0:
                c.executemany(
                    "INSERT INTO transactions (account_id, posted_on, description, amount_minor, currency) "
                    "VALUES (?, ?, ?, ?, ?)",
                    _DEMO_TRANSACTIONS,
                )
            if added:
                self._bump_version()


def _payee(row: sqlite3.Row, contact_names: tuple[str, ...]) -> Payee:
    aliases = tuple(a for a in row["aliases"].split(",") if a) + contact_names
    return Payee(row["payee_id"], row["display_name"], row["relationship"], row["kind"], aliases)


def _check_payees_header(path: Path, header: list[str]) -> None:
    for col in header:
        if col not in CSV_REQUIRED + CSV_OPTIONAL:
            raise ValueError(
                f"{path}: line 1, column {col!r}: unknown column "
                f"(expected {', '.join(CSV_REQUIRED + CSV_OPTIONAL)})"
            )
    for col in CSV_REQUIRED:
        if col not in header:
            raise ValueError(f"{path}: line 1, column {col!r}: missing required column")
    if len(set(header)) != len(header):
        raise ValueError(f"{path}: line 1: duplicate column names")


def _read_payees_csv(path: Path) -> list[Payee]:
    with path.open(newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise ValueError(f"{path}: line 1: empty file, expected header {','.join(CSV_REQUIRED)}")
        header = [h.strip().lower() for h in header]
        _check_payees_header(path, header)
        payees: list[Payee] = []
        seen: dict[str, int] = {}
        for fields in reader:
            line = reader.line_num
            if not any(f.strip() for f in fields):
                continue  # blank line
            if len(fields) != len(header):
                raise ValueError(f"{path}: line {line}: expected {len(header)} fields, got {len(fields)}")
            row = {col: value.strip() for col, value in zip(header, fields, strict=True)}
            payee_id, name = row["payee_id"], row["display_name"]
            kind = row.get("kind") or "person"
            if not _PAYEE_ID.fullmatch(payee_id):
                raise ValueError(
                    f"{path}: line {line}, column 'payee_id': {payee_id!r} is not 1-64 of A-Z a-z 0-9 _ . -"
                )
            if payee_id in seen:
                raise ValueError(
                    f"{path}: line {line}, column 'payee_id': {payee_id!r} repeats line {seen[payee_id]}"
                )
            if not name or len(name) > _MAX_NAME_CHARS:
                raise ValueError(
                    f"{path}: line {line}, column 'display_name': must be 1-{_MAX_NAME_CHARS} characters"
                )
            if kind not in PAYEE_KINDS:
                raise ValueError(
                    f"{path}: line {line}, column 'kind': {kind!r} is not one of {', '.join(PAYEE_KINDS)}"
                )
            aliases = tuple(a.strip() for a in row.get("aliases", "").split(";") if a.strip())
            seen[payee_id] = line
            payees.append(Payee(payee_id, name, row["relationship"], kind, aliases))
    return payees


# Demo data. Confusable names are deliberate: they exercise the phonetic index and the ambiguity path.
_DEMO_ACCOUNTS = [
    ("chk-001", "checking", "USD", 123_456),
    ("sav-001", "savings", "USD", 825_000),
    ("eur-001", "euro", "EUR", 150_000),
    ("jpy-001", "yen", "JPY", 250_000),
]
_DEMO_PAYEES = [
    ("john_smith", "John Smith", "friend", "person", ""),
    ("jon_smythe", "Jon Smythe", "colleague", "person", ""),
    ("joan_smith", "Joan Smith", "sister", "person", ""),
    ("katherine_lee", "Katherine Lee", "friend", "person", ""),
    ("catherine_li", "Catherine Li", "colleague", "person", ""),
    ("mary_johnson", "Mary Johnson", "mother", "person", "mom,mum,mommy"),
    ("robert_brown", "Robert Brown", "father", "person", "dad,daddy"),
    ("sean_obrien", "Sean O'Brien", "friend", "person", ""),
    ("stephen_clarke", "Stephen Clarke", "colleague", "person", ""),
    ("steven_clark", "Steven Clark", "neighbor", "person", ""),
    ("priya_patel", "Priya Patel", "friend", "person", ""),
    ("aisha_khan", "Aisha Khan", "friend", "person", ""),
    ("li_wei", "Li Wei", "colleague", "person", ""),
    ("jose_garcia", "José García", "friend", "person", ""),
    ("maria_gonzalez", "Maria Gonzalez", "landlord", "person", "rent"),
    ("ahmed_hassan", "Ahmed Hassan", "friend", "person", ""),
    ("yuki_tanaka", "Yuki Tanaka", "friend", "person", ""),
    ("hans_muller", "Hans Müller", "colleague", "person", ""),
    ("francois_dubois", "François Dubois", "friend", "person", ""),
    ("olga_ivanova", "Olga Ivanova", "babysitter", "person", "nanny"),
    ("tom_wilson", "Tom Wilson", "brother", "person", ""),
    ("city_electric", "City Electric", "utility", "biller", "electric,electricity,power,electric company"),
    ("metro_water", "Metro Water Utility", "utility", "biller", "water"),
    ("skyline_mobile", "Skyline Mobile", "phone", "biller", "phone,cell phone,mobile,phone company"),
    ("northside_internet", "Northside Internet", "internet", "biller", "internet,broadband,wifi"),
    ("evergreen_gas", "Evergreen Gas", "utility", "biller", "gas"),
    ("microsoft", "Microsoft", "subscription", "biller", ""),
    ("harbor_insurance", "Harbor Insurance", "insurance", "biller", "insurance,car insurance"),
    ("platinum_card", "Platinum Card Services", "credit card", "biller", "credit card"),
    ("streamflix", "StreamFlix", "subscription", "biller", "streaming"),
]
_DEMO_CONTACTS = [
    ("c-demo-01", "Johnny", "+1 555 0101", None, "john_smith"),
    ("c-demo-02", "Kate", "+1 555 0102", None, "katherine_lee"),
    ("c-demo-03", "Gran", "+1 555 0103", None, None),  # in the phone book, not a payee: cannot be paid
]
_DEMO_CARDS = [
    ("card-debit", "chk-001", "debit", "visa", "4201"),
    ("card-credit", "chk-001", "credit", "mastercard", "8812"),
]
_DEMO_TRANSACTIONS = [
    ("chk-001", "2025-04-18", "Payroll Acme Corp", 310_000, "USD"),
    ("chk-001", "2025-04-19", "Corner Coffee", -450, "USD"),
    ("chk-001", "2025-04-20", "Fresh Market", -8_732, "USD"),
    ("chk-001", "2025-04-21", "City Electric", -9_420, "USD"),
    ("chk-001", "2025-04-22", "Transfer to John Smith", -5_000, "USD"),
    ("chk-001", "2025-04-23", "Metro Transit", -275, "USD"),
    ("chk-001", "2025-04-24", "Skyline Mobile", -6_500, "USD"),
    ("chk-001", "2025-04-25", "Book Nook", -2_399, "USD"),
    ("chk-001", "2025-04-26", "Fresh Market", -6_110, "USD"),
    ("chk-001", "2025-04-27", "Rent Maria Gonzalez", -150_000, "USD"),
    ("chk-001", "2025-04-28", "Corner Coffee", -525, "USD"),
    ("chk-001", "2025-04-29", "StreamFlix", -1_599, "USD"),
    ("chk-001", "2025-04-30", "ATM withdrawal", -10_000, "USD"),
    ("chk-001", "2025-05-01", "Northside Internet", -5_999, "USD"),
    ("chk-001", "2025-05-02", "Pizza Place", -3_240, "USD"),
    ("sav-001", "2025-04-20", "Interest", 1_234, "USD"),
    ("sav-001", "2025-05-01", "Transfer from checking", 50_000, "USD"),
    ("eur-001", "2025-04-22", "Café de Paris", -1_850, "EUR"),
    ("eur-001", "2025-04-29", "Transfer to François Dubois", -4_000, "EUR"),
    ("jpy-001", "2025-04-25", "Tokyo Ramen", -1_200, "JPY"),
]


def demo_db(path: str | os.PathLike = ":memory:") -> BankDB:
    """A seeded database: the shortest way to a working assistant in tests and demos."""
    db = BankDB(path)
    db.seed_demo()
    return db
