"""The bank's core as the assistant sees it: ``BankBackend`` (all customers) and ``CustomerBank`` (one
customer's accounts, cards, payees and transfers). ``db.SQLiteBank`` is the embedded default,
``bank_postgres.PostgresBank`` the same bank on PostgreSQL, and ``http_bank.HTTPBank`` calls a bank's own API;
the policy only ever holds one customer's view."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

PAYEE_KINDS = ("person", "biller")
TRANSFER_KINDS = ("transfer", "bill_payment")
TRANSFER_STATUSES = ("pending", "executed", "scheduled", "failed", "cancelled")
# 10^13 minor units: $100 billion, ¥10 trillion. Far above any payment a voice turn makes, far below the
# 2^63 of SQLite's INTEGER, so sums and differences of bounded amounts can never overflow.
MAX_AMOUNT_MINOR = 10**13
# Payees one customer holds, whichever backend keeps them: every turn scores the whole list on a shared thread
# (100,000 payees took 13.7 s a lookup, holding the interpreter lock every other customer's turn needs;
# 1,000 take 0.06 s). Imports refuse more; HTTPBank refuses a bank's list of more.
MAX_PAYEES = 1000


@dataclass(frozen=True)
class Payee:
    payee_id: str
    display_name: str
    relationship: str
    kind: str  # 'person' | 'biller'
    aliases: tuple[str, ...] = ()  # other names the customer uses: "mom", "electricity", contact names


class UnknownCustomerError(KeyError):
    """The customer id names no customer of this bank."""


class BankUnavailableError(RuntimeError):
    """The bank could not answer: unreachable, timed out, a 5xx, our credentials refused, or an answer that
    is not what the API promises. Nothing is known about the request's effect; retry with the same
    idempotency key."""


def check_idempotency_key(key: object) -> str:
    """``key`` if it is 1-255 printable ASCII characters without spaces (an HTTP header value as is), else
    ValueError."""
    if not isinstance(key, str) or not 1 <= len(key) <= 255 or not all("!" <= ch <= "~" for ch in key):
        raise ValueError(
            f"idempotency key must be 1-255 printable ASCII characters without spaces, got {key!r}"
        )
    return key


def check_amount_minor(amount_minor: object) -> int:
    """``amount_minor`` if it is an int in ``[1, MAX_AMOUNT_MINOR]``, else ValueError (bools and floats
    too: money is exact integers of minor units)."""
    if (
        isinstance(amount_minor, bool)
        or not isinstance(amount_minor, int)
        or not 0 < amount_minor <= MAX_AMOUNT_MINOR
    ):
        raise ValueError(
            f"amount_minor must be a positive int of at most {MAX_AMOUNT_MINOR}, got {amount_minor!r}"
        )
    return amount_minor


@runtime_checkable
class CustomerBank(Protocol):
    """One customer's records. Every id it takes (payee, account, card, transfer) is looked up within this
    customer only: another customer's id is as unknown as a made-up one. A remote bank's view may raise
    ``BankUnavailableError`` from any method, and ``UnknownCustomerError`` once the customer is gone."""

    customer_id: str

    @property
    def version(self) -> int:
        """Moves on every change to this customer's payees or contacts (the payee index rebuilds)."""

    def payees(self) -> list[Payee]: ...

    def payee(self, payee_id: str) -> Payee | None: ...

    def accounts(self) -> list[dict]:
        """``[{account_id, name, balance_minor, currency}]``, the main (checking) account first."""

    def balance(self, account_id: str | None = None) -> dict:
        """One account as in ``accounts()``; without an id the first. KeyError when there is none."""

    def account_for_currency(self, currency: str) -> dict | None:
        """The first account held in ``currency`` (it pays transfers in that currency)."""

    def recent_transactions(self, limit: int = 5, account_id: str | None = None) -> list[dict]:
        """``[{account_id, posted_on, description, amount_minor, currency}]``, newest first (posted_on an ISO
        date). An account that is not this customer's has none."""

    def cards(self) -> list[dict]:
        """``[{card_id, account_id, kind, network, last4, locked: bool}]``."""

    def set_card_locked(self, card_id: str, locked: bool) -> None:
        """KeyError for a card that is not this customer's."""

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
        """Records a proposal with status 'pending' and returns its id; nothing moves. Without
        ``from_account_id`` the first account in ``currency`` pays. ValueError for a bad kind, an amount
        ``check_amount_minor`` refuses, or a payee or account that is not this customer's (or an account in
        another currency)."""

    def transfer(self, transfer_id: str) -> dict | None:
        """``{transfer_id, session_id, payee_id, from_account_id, amount_minor, currency, kind, status,
        scheduled_for, note, idempotency_key, customer_id, created_at, updated_at}``, or None (also for
        another customer's transfer). ``scheduled_for`` is an ISO date or None; ``note`` says why a transfer
        failed; ``created_at``/``updated_at`` are Unix seconds."""

    def execute_transfer(self, transfer_id: str, idempotency_key: str, today: dt.date | None = None) -> dict:
        """Moves the money of a pending transfer atomically: status 'executed', 'scheduled' (a later date)
        or 'failed' (insufficient funds). Idempotent under ``idempotency_key``: a repeat with the same key
        returns the same transfer without moving money again; any other call on a transfer that is no
        longer pending raises ValueError, as do an unknown transfer and a key this customer already used on
        another transfer. A key is 1-255 printable ASCII characters without spaces (it travels as an HTTP
        header)."""

    def cancel_transfer(self, transfer_id: str) -> None:
        """Cancels a pending transfer; a no-op when it is no longer pending or is not this customer's."""

    def transfers(self, status: str | None = None) -> list[dict]:
        """This customer's transfers as in ``transfer()``, oldest first; only those in ``status`` if given."""


@runtime_checkable
class BankBackend(Protocol):
    """The bank: customers and a scoped view of each."""

    def customer(self, customer_id: str) -> CustomerBank:
        """The customer's view; UnknownCustomerError when the bank has no such customer."""

    def customer_name(self, customer_id: str) -> str:
        """Display name; UnknownCustomerError when there is no such customer."""

    def close(self) -> None: ...
