"""The bank in SQL (``SQLBank``, one customer's ``SQLCustomerBank``): accounts, cards, payees, contacts,
transactions and transfers, one code path on either database of sql.py. db.py opens it on SQLite
(``SQLiteBank``, the embedded default) and bank_postgres.py on PostgreSQL (``PostgresBank``), each with its
schema; any thread of any replica may call any method.

Why money moves once and no account is overdrawn, however many replicas share the database: a transfer
executes in one transaction that locks its row first (``SELECT … FOR UPDATE`` on PostgreSQL; SQLite has one
writer at a time), so a second execution waits and then finds it settled; the debit is one conditional
``UPDATE … WHERE balance_minor >= amount`` that re-checks the balance under the account row's lock; an
idempotency key is unique per customer in the schema itself."""

from __future__ import annotations

import datetime as dt
import os
import time
import uuid
from collections.abc import Iterable
from pathlib import Path

from g4serve_assistant.bank import (
    MAX_PAYEES,
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
from g4serve_assistant.demo_data import DEMO_CUSTOMERS
from g4serve_assistant.sql import SQLDatabase, SQLExecutor, is_unique_violation

_MAX_TRANSACTIONS = 1000  # recent_transactions' cap: a reply reads a few, an API page stays bounded
_DEMO_DATA_ERROR = "holds demo data; import into a new database"
# The advisory lock (PostgreSQL) of what changes the set of customers: seeding, imports, add_customer. Their
# checks (demo or not, the customer there or not) and writes must not interleave across replicas: two
# replicas seeding at once would otherwise both find no demo transactions and both insert them.
CUSTOMERS_LOCK_KEY = 7204552
# Columns as the protocols name them. Never SELECT *: PostgreSQL's tables carry a `rowid` column of their own.
_TRANSFER_COLUMNS = (
    "transfer_id, customer_id, session_id, payee_id, from_account_id, amount_minor, currency, kind, status, "
    "scheduled_for, note, idempotency_key, created_at, updated_at"
)
_PAYEE_COLUMNS = "payee_id, display_name, relationship, kind, aliases"
_ACCOUNT_COLUMNS = "account_id, name, balance_minor, currency"


class SchemaTooNewError(ValueError):
    """The database was written by a newer version of this code; opening it could corrupt it."""


class SQLBank:
    """All customers of a bank in an SQL database whose schema is in place (``SQLiteBank`` and
    ``PostgresBank`` make sure of that); ``customer(id)`` is the view the policy gets. ``name`` says which
    database in messages (a PostgreSQL URL without its password)."""

    def __init__(self, db: SQLDatabase):
        self.db = db
        self.name = db.name

    def close(self) -> None:
        self.db.close()

    # --- customers --------------------------------------------------------------------------------------
    def customer(self, customer_id: str) -> SQLCustomerBank:
        self.customer_name(customer_id)
        return SQLCustomerBank(self, customer_id)

    def customer_name(self, customer_id: str) -> str:
        with self.db.read() as tx:
            rows = tx.query("SELECT name FROM customers WHERE customer_id = ?", (customer_id,))
        if not rows:
            raise UnknownCustomerError(customer_id)
        return rows[0]["name"]

    def customers(self) -> list[dict]:
        """``[{customer_id, name, demo: bool}]`` in the order they were added."""
        with self.db.read() as tx:
            rows = tx.query("SELECT customer_id, name, demo FROM customers ORDER BY rowid")
        return [dict(r, demo=bool(r["demo"])) for r in rows]

    def holds_demo_data(self) -> bool:
        with self.db.read() as tx:
            return bool(tx.query("SELECT 1 FROM customers WHERE demo = 1 LIMIT 1"))

    def add_customer(self, customer_id: str, name: str) -> SQLCustomerBank:
        """A new customer without accounts; ValueError for a bad or taken id, a bad name, or a database that
        holds demo data (real and demo customers never share one)."""
        if not isinstance(customer_id, str) or not ID_PATTERN.fullmatch(customer_id):
            raise ValueError(f"customer id {customer_id!r} is not 1-64 of A-Z a-z 0-9 _ . - (no leading dot)")
        if text_problem(name):
            raise ValueError(f"customer name: {text_problem(name)}")
        with self.db.transaction() as tx:
            self._refuse_demo(tx)
            if tx.query("SELECT 1 FROM customers WHERE customer_id = ?", (customer_id,)):
                raise ValueError(f"customer {customer_id!r} exists")
            tx.run("INSERT INTO customers (customer_id, name) VALUES (?, ?)", (customer_id, name))
        return SQLCustomerBank(self, customer_id)

    def _refuse_demo(self, tx: SQLExecutor) -> None:
        """Takes the customers lock (every caller is about to change customers), then refuses a demo bank."""
        tx.serialize(CUSTOMERS_LOCK_KEY)
        if tx.query("SELECT 1 FROM customers WHERE demo = 1 LIMIT 1"):
            raise ValueError(f"{self.name}: {_DEMO_DATA_ERROR}")

    # --- imports ----------------------------------------------------------------------------------------
    def import_payees_csv(self, path: str | os.PathLike, customer_id: str) -> int:
        """Upserts one customer's payees from a CSV with columns payee_id,display_name,relationship[,kind]
        [,aliases] (``aliases`` ';'-separated) and returns how many rows it wrote.

        The whole file is validated first and written in one transaction: a bad row imports nothing.
        ValueError naming the file, line and column of the first problem; naming the customer when it is
        not in the database; and for a database that holds demo data.
        """
        rows = read_payees_csv(Path(path))
        with self.db.transaction() as tx:
            self._refuse_demo(tx)
            if not tx.query("SELECT 1 FROM customers WHERE customer_id = ?", (customer_id,)):
                raise ValueError(
                    f"{path}: customer {customer_id!r} is not in the database (import-customers first)"
                )
            n = _upsert_payees(tx, customer_id, rows)
            held = tx.query("SELECT COUNT(*) AS n FROM payees WHERE customer_id = ?", (customer_id,))[0]["n"]
            if held > MAX_PAYEES:  # raised inside the transaction: nothing of the file is written
                raise ValueError(
                    f"{path}: customer {customer_id!r} would hold {held} payees, more than {MAX_PAYEES}"
                )
            return n

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
        with self.db.transaction() as tx:
            self._refuse_demo(tx)
            for line, row in rows:
                tx.run(
                    "INSERT INTO customers (customer_id, name) VALUES (?, ?) "
                    "ON CONFLICT (customer_id) DO UPDATE SET name = excluded.name",
                    (row["customer_id"], row["name"]),
                )
                old = tx.query(
                    "SELECT currency FROM accounts WHERE customer_id = ? AND account_id = ?",
                    (row["customer_id"], row["account_id"]),
                )
                if old and old[0]["currency"] != row["currency"]:
                    raise ValueError(
                        f"{path}: line {line}, column 'currency': account {row['account_id']!r} is held in "
                        f"{old[0]['currency']}, not {row['currency']} (an account's currency does not change)"
                    )
                tx.run(
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
        with self.db.transaction() as tx:
            self._refuse_demo(tx)
            for line, row in rows:
                cid, aid = row["customer_id"], row["account_id"]
                if not tx.query("SELECT 1 FROM customers WHERE customer_id = ?", (cid,)):
                    raise ValueError(f"{path}: line {line}, column 'customer_id': no customer {cid!r}")
                if not tx.query(
                    "SELECT 1 FROM accounts WHERE customer_id = ? AND account_id = ?", (cid, aid)
                ):
                    raise ValueError(
                        f"{path}: line {line}, column 'account_id': customer {cid!r} has no account {aid!r}"
                    )
                tx.run(
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
        with self.db.transaction() as tx:
            tx.serialize(CUSTOMERS_LOCK_KEY)
            if tx.query("SELECT 1 FROM customers WHERE demo = 0 LIMIT 1"):
                raise ValueError(
                    f"{self.name}: holds customers that are not demo data; "
                    "the demo seeds only a new or demo database"
                )
            for customer_id, name, data in DEMO_CUSTOMERS:
                _seed_customer(tx, customer_id, name, data)


class SQLCustomerBank:
    """One customer's view of an ``SQLBank``: every statement is scoped to ``customer_id``."""

    def __init__(self, bank: SQLBank, customer_id: str):
        self.bank = bank
        self.customer_id = customer_id

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.bank.name!r}, {self.customer_id!r})"

    # --- payees -----------------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        """Moves on every change to this customer's payees or contacts; the payee index rebuilds when it does.

        Kept in the database (not in this object) so every replica sees it.
        """
        with self.bank.db.read() as tx:
            rows = tx.query("SELECT payee_version FROM customers WHERE customer_id = ?", (self.customer_id,))
        if not rows:
            raise UnknownCustomerError(self.customer_id)
        return rows[0]["payee_version"]

    def payees(self) -> list[Payee]:
        with self.bank.db.read() as tx:
            rows = tx.query(
                f"SELECT {_PAYEE_COLUMNS} FROM payees WHERE customer_id = ? ORDER BY payee_id",
                (self.customer_id,),
            )
            contacts = self._contact_names(tx)
        return [_payee(r, contacts.get(r["payee_id"], ())) for r in rows]

    def payee(self, payee_id: str) -> Payee | None:
        with self.bank.db.read() as tx:
            rows = tx.query(
                f"SELECT {_PAYEE_COLUMNS} FROM payees WHERE customer_id = ? AND payee_id = ?",
                (self.customer_id, payee_id),
            )
            contacts = self._contact_names(tx) if rows else {}
        return _payee(rows[0], contacts.get(payee_id, ())) if rows else None

    def _contact_names(self, tx: SQLExecutor) -> dict[str, tuple[str, ...]]:
        names: dict[str, list[str]] = {}
        for r in tx.query(
            "SELECT payee_id, name FROM contacts WHERE customer_id = ? AND payee_id IS NOT NULL "
            "ORDER BY rowid",
            (self.customer_id,),
        ):
            names.setdefault(r["payee_id"], []).append(r["name"])
        return {k: tuple(v) for k, v in names.items()}

    def upsert_payee(self, payee: Payee) -> None:
        """Adds or replaces one of this customer's payees (tests and tools; the bank-level imports are what
        keep demo and real data apart)."""
        with self.bank.db.transaction() as tx:
            _upsert_payees(tx, self.customer_id, [payee])

    def import_payees_csv(self, path: str | os.PathLike) -> int:
        """``SQLBank.import_payees_csv`` for this customer, without its demo-data guard: it edits this
        customer's list whatever the database holds (tests add payees to a demo customer this way)."""
        rows = read_payees_csv(Path(path))
        with self.bank.db.transaction() as tx:
            return _upsert_payees(tx, self.customer_id, rows)

    def contacts(self) -> list[dict]:
        with self.bank.db.read() as tx:
            return tx.query(
                "SELECT contact_id, name, phone, email, payee_id FROM contacts WHERE customer_id = ? "
                "ORDER BY contact_id",
                (self.customer_id,),
            )

    def add_contact(
        self, name: str, payee_id: str | None = None, phone: str | None = None, email: str | None = None
    ) -> str:
        """A phone-book entry; when linked to a payee its name becomes one more way to say that payee.
        ValueError for a payee that is not this customer's."""
        contact_id = f"c-{uuid.uuid4().hex[:10]}"
        with self.bank.db.transaction() as tx:
            if payee_id is not None and not tx.query(
                "SELECT 1 FROM payees WHERE customer_id = ? AND payee_id = ?", (self.customer_id, payee_id)
            ):
                raise ValueError(f"unknown payee {payee_id!r}")
            tx.run(
                "INSERT INTO contacts (customer_id, contact_id, name, phone, email, payee_id) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (self.customer_id, contact_id, name, phone, email, payee_id),
            )
            if payee_id is not None:
                _bump_version(tx, self.customer_id)
        return contact_id

    # --- accounts, cards, transactions ------------------------------------------------------------------
    def accounts(self) -> list[dict]:
        with self.bank.db.read() as tx:
            return tx.query(
                f"SELECT {_ACCOUNT_COLUMNS} FROM accounts WHERE customer_id = ? ORDER BY rowid",
                (self.customer_id,),
            )

    def balance(self, account_id: str | None = None) -> dict:
        """One account's balance; without an id, the customer's first (main checking) account."""
        sql = f"SELECT {_ACCOUNT_COLUMNS} FROM accounts WHERE customer_id = ?"
        args: tuple = (self.customer_id,)
        if account_id is not None:
            sql, args = sql + " AND account_id = ?", (*args, account_id)
        with self.bank.db.read() as tx:
            rows = tx.query(sql + " ORDER BY rowid LIMIT 1", args)
        if not rows:
            raise KeyError(f"no account {account_id!r}" if account_id else "no accounts")
        return rows[0]

    def account_for_currency(self, currency: str) -> dict | None:
        """The first account held in ``currency``, which pays transfers in that currency."""
        with self.bank.db.read() as tx:
            rows = tx.query(
                f"SELECT {_ACCOUNT_COLUMNS} FROM accounts WHERE customer_id = ? AND currency = ? "
                "ORDER BY rowid LIMIT 1",
                (self.customer_id, currency),
            )
        return rows[0] if rows else None

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
        with self.bank.db.read() as tx:
            return tx.query(sql, (*args, min(max(0, int(limit)), _MAX_TRANSACTIONS)))

    def cards(self) -> list[dict]:
        with self.bank.db.read() as tx:
            rows = tx.query(
                "SELECT card_id, account_id, kind, network, last4, locked FROM cards WHERE customer_id = ? "
                "ORDER BY rowid",
                (self.customer_id,),
            )
        return [dict(r, locked=bool(r["locked"])) for r in rows]

    def set_card_locked(self, card_id: str, locked: bool) -> None:
        with self.bank.db.transaction() as tx:
            changed = tx.run(
                "UPDATE cards SET locked = ? WHERE customer_id = ? AND card_id = ?",
                (int(bool(locked)), self.customer_id, card_id),
            )
            if changed == 0:
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
        with self.bank.db.transaction() as tx:
            if not tx.query(
                "SELECT 1 FROM payees WHERE customer_id = ? AND payee_id = ?", (self.customer_id, payee_id)
            ):
                raise ValueError(f"unknown payee {payee_id!r}")
            account = self._paying_account(tx, currency, from_account_id)
            tx.run(
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

    def _paying_account(self, tx: SQLExecutor, currency: str, account_id: str | None) -> str:
        if account_id is None:
            rows = tx.query(
                "SELECT account_id FROM accounts WHERE customer_id = ? AND currency = ? "
                "ORDER BY rowid LIMIT 1",
                (self.customer_id, currency),
            )
            if not rows:
                raise ValueError(f"no account in {currency}")
            return rows[0]["account_id"]
        rows = tx.query(
            "SELECT currency FROM accounts WHERE customer_id = ? AND account_id = ?",
            (self.customer_id, account_id),
        )
        if not rows or rows[0]["currency"] != currency:
            raise ValueError(f"account {account_id!r} does not exist or is not in {currency}")
        return account_id

    def _transfer_row(self, tx: SQLExecutor, transfer_id: str, *, lock: bool = False) -> dict | None:
        rows = tx.query(
            f"SELECT {_TRANSFER_COLUMNS} FROM transfers WHERE customer_id = ? AND transfer_id = ?"
            + (tx.for_update if lock else ""),
            (self.customer_id, transfer_id),
        )
        return rows[0] if rows else None

    def transfer(self, transfer_id: str) -> dict | None:
        with self.bank.db.read() as tx:
            return self._transfer_row(tx, transfer_id)

    def execute_transfer(self, transfer_id: str, idempotency_key: str, today: dt.date | None = None) -> dict:
        """Moves the money of a pending transfer, atomically, at most once, and returns the transfer.

        A transfer scheduled after ``today`` becomes 'scheduled' (a job outside this demo would run it);
        one the account cannot cover becomes 'failed'. The key is stored on the transfer: the same call
        again returns it as stored and moves nothing. ValueError for an unknown transfer, a bad key, a key
        this customer used on another transfer, and a transfer that is no longer pending.
        """
        check_idempotency_key(idempotency_key)
        today = today or dt.date.today()
        try:
            with self.bank.db.transaction() as tx:
                # Locked first: a second execution of this transfer (another thread, another replica)
                # waits here until this one commits, then reads its outcome below.
                t = self._transfer_row(tx, transfer_id, lock=True)
                if t is None:
                    raise ValueError(f"no transfer {transfer_id!r}")
                if t["idempotency_key"] == idempotency_key:
                    return t  # a retry of the call that already ran
                if t["status"] != "pending":
                    raise ValueError(f"transfer {transfer_id} is {t['status']}, not pending")
                other = self._key_holder(tx, idempotency_key)
                if other is not None:
                    raise ValueError(f"idempotency key already used for transfer {other}")
                status, note = self._settle(tx, t, today)
                tx.run(
                    "UPDATE transfers SET status = ?, note = ?, idempotency_key = ?, updated_at = ? "
                    "WHERE customer_id = ? AND transfer_id = ?",
                    (status, note, idempotency_key, time.time(), self.customer_id, transfer_id),
                )
                return self._transfer_row(tx, transfer_id)
        except Exception as exc:
            if not is_unique_violation(exc):
                raise
        # The key was free when checked, but another transfer's execution took it and committed first (two
        # PostgreSQL transactions at once): the unique key refused ours, and its rollback moved nothing back.
        with self.bank.db.read() as tx:
            other = self._key_holder(tx, idempotency_key)
        raise ValueError(f"idempotency key already used for transfer {other}")

    def _key_holder(self, tx: SQLExecutor, idempotency_key: str) -> str | None:
        rows = tx.query(
            "SELECT transfer_id FROM transfers WHERE customer_id = ? AND idempotency_key = ?",
            (self.customer_id, idempotency_key),
        )
        return rows[0]["transfer_id"] if rows else None

    def _settle(self, tx: SQLExecutor, t: dict, today: dt.date) -> tuple[str, str | None]:
        """Debits the paying account for a transfer due today; (status, note) of the outcome."""
        if t["scheduled_for"] and dt.date.fromisoformat(t["scheduled_for"]) > today:
            return "scheduled", None
        # The balance check and the debit are one statement: under the account row's lock it sees the
        # balance every earlier debit left, whichever replica made it, so concurrent payments never overdraw.
        debited = tx.run(
            "UPDATE accounts SET balance_minor = balance_minor - ? "
            "WHERE customer_id = ? AND account_id = ? AND balance_minor >= ?",
            (t["amount_minor"], self.customer_id, t["from_account_id"], t["amount_minor"]),
        )
        if debited == 0:
            return "failed", "insufficient funds"
        payee = tx.query(
            "SELECT display_name FROM payees WHERE customer_id = ? AND payee_id = ?",
            (self.customer_id, t["payee_id"]),
        )[0]
        what = "Payment to" if t["kind"] == "bill_payment" else "Transfer to"
        tx.run(
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
        with self.bank.db.transaction() as tx:
            tx.run(
                "UPDATE transfers SET status = 'cancelled', updated_at = ? "
                "WHERE customer_id = ? AND transfer_id = ? AND status = 'pending'",
                (time.time(), self.customer_id, transfer_id),
            )

    def transfers(self, status: str | None = None) -> list[dict]:
        sql = f"SELECT {_TRANSFER_COLUMNS} FROM transfers WHERE customer_id = ?"
        args: tuple = (self.customer_id,)
        if status is not None:
            sql, args = sql + " AND status = ?", (*args, status)
        with self.bank.db.read() as tx:
            return tx.query(sql + " ORDER BY created_at, rowid", args)


# --- rows -------------------------------------------------------------------------------------------------
def _payee(row: dict, contact_names: tuple[str, ...]) -> Payee:
    aliases = tuple(a for a in row["aliases"].split(",") if a) + contact_names
    return Payee(row["payee_id"], row["display_name"], row["relationship"], row["kind"], aliases)


def _bump_version(tx: SQLExecutor, customer_id: str) -> None:
    tx.run("UPDATE customers SET payee_version = payee_version + 1 WHERE customer_id = ?", (customer_id,))


def _upsert_payees(tx: SQLExecutor, customer_id: str, payees: Iterable[Payee]) -> int:
    n = 0
    for p in payees:
        tx.run(
            "INSERT INTO payees (customer_id, payee_id, display_name, relationship, kind, aliases) "
            "VALUES (?, ?, ?, ?, ?, ?) "
            "ON CONFLICT (customer_id, payee_id) DO UPDATE SET display_name = excluded.display_name, "
            "relationship = excluded.relationship, kind = excluded.kind, aliases = excluded.aliases",
            (customer_id, p.payee_id, p.display_name, p.relationship, p.kind, ",".join(p.aliases)),
        )
        n += 1
    if n:
        _bump_version(tx, customer_id)
    return n


def _seed_customer(tx: SQLExecutor, customer_id: str, name: str, data: dict) -> None:
    tx.run(
        "INSERT INTO customers (customer_id, name, demo) VALUES (?, ?, 1) ON CONFLICT DO NOTHING",
        (customer_id, name),
    )
    for account in data["accounts"]:
        tx.run(
            "INSERT INTO accounts (customer_id, account_id, name, currency, balance_minor) "
            "VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
            (customer_id, *account),
        )
    added = 0
    for payee in data["payees"]:
        added += tx.run(
            "INSERT INTO payees (customer_id, payee_id, display_name, relationship, kind, aliases) "
            "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
            (customer_id, *payee),
        )
    for contact in data["contacts"]:
        added += tx.run(
            "INSERT INTO contacts (customer_id, contact_id, name, phone, email, payee_id) "
            "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
            (customer_id, *contact),
        )
    for card in data["cards"]:
        tx.run(
            "INSERT INTO cards (customer_id, card_id, account_id, kind, network, last4) "
            "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
            (customer_id, *card),
        )
    if not tx.query("SELECT 1 FROM transactions WHERE customer_id = ? LIMIT 1", (customer_id,)):
        for txn in data["transactions"]:
            tx.run(
                "INSERT INTO transactions "
                "(customer_id, account_id, posted_on, description, amount_minor, currency) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (customer_id, *txn),
            )
    if added:
        _bump_version(tx, customer_id)
