"""The bank's core as the assistant sees it: ``BankBackend`` (all customers) and ``CustomerBank`` (one
customer's accounts, cards, payees and transfers). ``db.SQLiteBank`` is the embedded default and
``http_bank.HTTPBank`` calls a bank's own API; the policy only ever holds one customer's view."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

PAYEE_KINDS = ("person", "biller")
TRANSFER_KINDS = ("transfer", "bill_payment")


@dataclass(frozen=True)
class Payee:
    payee_id: str
    display_name: str
    relationship: str
    kind: str  # 'person' | 'biller'
    aliases: tuple[str, ...] = ()  # other names the customer uses: "mom", "electricity", contact names


class UnknownCustomerError(KeyError):
    """The customer id names no customer of this bank."""


@runtime_checkable
class CustomerBank(Protocol):
    """One customer's records. Every id it takes (payee, account, card, transfer) is looked up within this
    customer only: another customer's id is as unknown as a made-up one."""

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
        """``[{account_id, posted_on, description, amount_minor, currency}]``, newest first."""

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
        """Records a proposal with status 'pending' and returns its id; nothing moves. ValueError for a bad
        kind, a non-positive or non-int amount, or a payee or account that is not this customer's."""

    def transfer(self, transfer_id: str) -> dict | None:
        """``{transfer_id, session_id, payee_id, from_account_id, amount_minor, currency, kind, status,
        scheduled_for, note, idempotency_key, ...}``, or None (also for another customer's transfer)."""

    def execute_transfer(self, transfer_id: str, idempotency_key: str, today: dt.date | None = None) -> dict:
        """Moves the money of a pending transfer atomically: status 'executed', 'scheduled' (a later date)
        or 'failed' (insufficient funds). Idempotent under ``idempotency_key``: a repeat with the same key
        returns the same transfer without moving money again; any other call on a transfer that is no
        longer pending raises ValueError."""

    def cancel_transfer(self, transfer_id: str) -> None:
        """Cancels a pending transfer; a no-op when it is no longer pending."""

    def transfers(self, status: str | None = None) -> list[dict]: ...


@runtime_checkable
class BankBackend(Protocol):
    """The bank: customers and a scoped view of each."""

    def customer(self, customer_id: str) -> CustomerBank:
        """The customer's view; UnknownCustomerError when the bank has no such customer."""

    def customer_name(self, customer_id: str) -> str:
        """Display name; UnknownCustomerError when there is no such customer."""

    def close(self) -> None: ...
