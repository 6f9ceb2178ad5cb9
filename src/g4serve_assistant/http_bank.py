"""``HTTPBank``: the ``BankBackend`` over a bank's own REST API (docs/assistant.md, "Bank backends"). The bank
is trusted less than our own database: every answer is bounded in size and time and type-checked before any
of it is used, and whatever is wrong with it becomes a ``BankUnavailableError``, never a crash later."""

from __future__ import annotations

import datetime as dt
import json
import math
import re
import threading
import time
import unicodedata
from collections.abc import Callable
from typing import Any

import httpx

from g4serve_assistant.bank import (
    MAX_AMOUNT_MINOR,
    MAX_PAYEES,
    PAYEE_KINDS,
    TRANSFER_KINDS,
    TRANSFER_STATUSES,
    BankUnavailableError,
    Payee,
    UnknownCustomerError,
    check_amount_minor,
    check_idempotency_key,
)

API_PREFIX = "/v1"
MAX_RESPONSE_BYTES = 4 << 20  # a customer's payees, cards or a page of transfers: far below this
MAX_LIST_ITEMS = 10_000
MAX_TRANSACTIONS = 1000
_MAX_JSON_INT = 2**53 - 1  # what a JSON number holds exactly in every client, JavaScript's included
# Ids are path segments: unreserved URL characters only, no leading dot (so never "." or "..").
_ID = re.compile(r"[A-Za-z0-9_~-][A-Za-z0-9_.~-]{0,127}")
_CURRENCY = re.compile(r"[A-Z]{3}")
_LAST4 = re.compile(r"[0-9]{4}")


class InvalidBankResponseError(BankUnavailableError):
    """The bank answered, but not as the API says: wrong status, too large, not JSON, or a field of the
    wrong type. Treated as the bank being unavailable: none of the answer is used."""


class _Invalid(Exception):
    """A field of a response that is not what the API says; ``HTTPBank._call`` names the request."""


# --- response checks ---------------------------------------------------------------------------------------
def _got(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _obj(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise _Invalid(f"{where}: expected an object, got {_got(value)}")
    return value


def _field(d: dict, key: str, where: str) -> Any:
    if key not in d:
        raise _Invalid(f"{where}.{key}: missing")
    return d[key]


def _str(
    d: dict, key: str, where: str, max_chars: int = 200, *, empty: bool = True, null: bool = False
) -> Any:
    value = _field(d, key, where)
    if value is None and null:
        return None
    if not isinstance(value, str) or len(value) > max_chars or (not value and not empty):
        raise _Invalid(
            f"{where}.{key}: expected a string of {int(not empty)}-{max_chars} characters, got {_got(value)}"
        )
    # Control characters and lone surrogates (JSON can spell "\ud800"): read aloud, shown, audited, such a
    # string breaks whatever encodes it later.
    if any(unicodedata.category(ch) in ("Cc", "Cs") for ch in value):
        raise _Invalid(f"{where}.{key}: control characters in {_got(value)}")
    return value


def _id(d: dict, key: str, where: str, expected: str | None = None) -> str:
    value = _field(d, key, where)
    if not isinstance(value, str) or not _ID.fullmatch(value):
        raise _Invalid(f"{where}.{key}: expected an id, got {_got(value)}")
    if expected is not None and value != expected:
        raise _Invalid(f"{where}.{key}: asked for {expected!r}, got {value!r}")
    return value


def _int(d: dict, key: str, where: str, lo: int = -_MAX_JSON_INT, hi: int = _MAX_JSON_INT) -> int:
    value = _field(d, key, where)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise _Invalid(f"{where}.{key}: expected an integer in [{lo}, {hi}], got {_got(value)}")
    return value


def _bool(d: dict, key: str, where: str) -> bool:
    value = _field(d, key, where)
    if not isinstance(value, bool):
        raise _Invalid(f"{where}.{key}: expected true or false, got {_got(value)}")
    return value


def _time(d: dict, key: str, where: str) -> float:
    value = _field(d, key, where)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _Invalid(f"{where}.{key}: expected Unix seconds, got {_got(value)}")
    return float(value)


def _date(d: dict, key: str, where: str, *, null: bool = False) -> str | None:
    value = _str(d, key, where, 10, null=null)
    if value is None:
        return None
    try:
        dt.date.fromisoformat(value)
    except ValueError:
        raise _Invalid(f"{where}.{key}: expected a date YYYY-MM-DD, got {_got(value)}") from None
    return value


def _currency(d: dict, key: str, where: str) -> str:
    value = _field(d, key, where)
    if not isinstance(value, str) or not _CURRENCY.fullmatch(value):
        raise _Invalid(f"{where}.{key}: expected an ISO currency code, got {_got(value)}")
    return value


def _list(value: Any, key: str, parse: Callable[[Any, str], Any], max_items: int = MAX_LIST_ITEMS) -> list:
    items = _field(_obj(value, "response"), key, "response")
    if not isinstance(items, list) or len(items) > max_items:
        raise _Invalid(f"response.{key}: expected a list of at most {max_items}, got {_got(items)}")
    return [parse(item, f"{key}[{i}]") for i, item in enumerate(items)]


def _payee(value: Any, where: str = "payee") -> Payee:
    d = _obj(value, where)
    kind = _field(d, "kind", where)
    if kind not in PAYEE_KINDS:
        raise _Invalid(f"{where}.kind: expected one of {PAYEE_KINDS}, got {_got(kind)}")
    aliases = _field(d, "aliases", where)
    if not isinstance(aliases, list) or len(aliases) > 200:
        raise _Invalid(f"{where}.aliases: expected a list of at most 200 names, got {_got(aliases)}")
    return Payee(
        _id(d, "payee_id", where),
        _str(d, "display_name", where, empty=False),
        _str(d, "relationship", where),
        kind,
        tuple(
            _str({"alias": a}, "alias", f"{where}.aliases[{i}]", empty=False) for i, a in enumerate(aliases)
        ),
    )


def _account(value: Any, where: str = "account") -> dict:
    d = _obj(value, where)
    return {
        "account_id": _id(d, "account_id", where),
        "name": _str(d, "name", where),
        "balance_minor": _int(d, "balance_minor", where),
        "currency": _currency(d, "currency", where),
    }


def _transaction(value: Any, where: str) -> dict:
    d = _obj(value, where)
    return {
        "account_id": _id(d, "account_id", where),
        "posted_on": _date(d, "posted_on", where),
        "description": _str(d, "description", where, 500),
        "amount_minor": _int(d, "amount_minor", where),
        "currency": _currency(d, "currency", where),
    }


def _card(value: Any, where: str = "card") -> dict:
    d = _obj(value, where)
    last4 = _str(d, "last4", where, 4)
    if not _LAST4.fullmatch(last4):
        raise _Invalid(f"{where}.last4: expected 4 digits, got {_got(last4)}")
    return {
        "card_id": _id(d, "card_id", where),
        "account_id": _id(d, "account_id", where),
        "kind": _str(d, "kind", where, 30, empty=False),
        "network": _str(d, "network", where, 30, empty=False),
        "last4": last4,
        "locked": _bool(d, "locked", where),
    }


def _transfer(value: Any, where: str, customer_id: str) -> dict:
    d = _obj(value, where)
    kind, status = _field(d, "kind", where), _field(d, "status", where)
    if kind not in TRANSFER_KINDS:
        raise _Invalid(f"{where}.kind: expected one of {TRANSFER_KINDS}, got {_got(kind)}")
    if status not in TRANSFER_STATUSES:
        raise _Invalid(f"{where}.status: expected one of {TRANSFER_STATUSES}, got {_got(status)}")
    return {
        "transfer_id": _id(d, "transfer_id", where),
        # Another customer's transfer in this customer's answer is a leak on the bank's side: refuse it.
        "customer_id": _id(d, "customer_id", where, customer_id),
        "session_id": _str(d, "session_id", where, 1000),
        "payee_id": _id(d, "payee_id", where),
        "from_account_id": _id(d, "from_account_id", where),
        "amount_minor": _int(d, "amount_minor", where, 1, MAX_AMOUNT_MINOR),
        "currency": _currency(d, "currency", where),
        "kind": kind,
        "status": status,
        "scheduled_for": _date(d, "scheduled_for", where, null=True),
        "note": _str(d, "note", where, 500, null=True),
        "idempotency_key": _str(d, "idempotency_key", where, 255, null=True),
        "created_at": _time(d, "created_at", where),
        "updated_at": _time(d, "updated_at", where),
    }


def _error_message(body: Any, status: int) -> tuple[str | None, str]:
    """(code, message) of an error answer ``{"error": {"code", "message"}}``, bounded for logs and replies."""
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        code = error.get("code") if isinstance(error.get("code"), str) else None
        message = error.get("message") if isinstance(error.get("message"), str) else f"HTTP {status}"
        return code, message[:300]
    return None, f"HTTP {status}"


# --- the client --------------------------------------------------------------------------------------------
_WHOLE_BANK = "*"  # the breaker's scope of every customer: no customer id can be "*" (bank_csv.ID_PATTERN)


class Breaker:
    """A bank that stopped answering is not waited on by every call. Calls that got no answer (timed out,
    refused, reset) pause, for ``open_s`` seconds with nothing sent, either one customer or the whole bank:

    - ``failures`` of one customer's calls in a row without an answer pause that customer's calls;
    - ``failures`` calls in a row without an answer, from more than one customer, pause every call.

    Then one call at a time goes through as a probe of what was paused, and an answer (any status) ends the
    pause. Without a breaker each call held a worker thread for the whole timeout, and an outage seen by a
    few customers queued every other turn behind theirs; with one that counted every customer's calls as one,
    a customer whose own calls hang paused every other customer. Error answers (a 503 sent at once) cost no
    wait and do not count. Thread-safe: the bank is called from worker threads."""

    MAX_TRACKED = 10_000  # customers whose last calls went unanswered, kept; the oldest go first

    def __init__(self, failures: int = 3, open_s: float = 5.0):
        self.failures = failures
        self.open_s = open_s
        self._lock = threading.Lock()
        self._streak: list[str] = []  # the customers of the bank's last calls in a row without an answer
        self._missed: dict[str, int] = {}  # a customer's own calls in a row without an answer
        self._until: dict[str, float] = {}  # scope -> monotonic time its pause ends
        self._probing: set[str] = set()  # scopes whose probe is out

    def admit(self, what: str, customer: str) -> str | None:
        """The scope this call probes (``customer``, or the whole bank's), or None for a plain call;
        ``BankUnavailableError`` while a pause covers it."""
        with self._lock:
            for scope in (_WHOLE_BANK, customer):
                if scope in self._until:
                    left = self._until[scope] - time.monotonic()
                    if left > 0 or scope in self._probing:
                        raise BankUnavailableError(
                            f"{what}: not sent: {self._why(scope)} (tried again in "
                            f"{max(left, 0.0):.1f} s, one request at a time)"
                        )
                    self._probing.add(scope)
                    return scope
            return None

    def _why(self, scope: str) -> str:
        if scope == _WHOLE_BANK:
            return f"the bank did not answer {self.failures} requests in a row, of several customers"
        return f"the bank did not answer this customer's last {self.failures} requests"

    def record(self, answered: bool, probe: str | None, customer: str) -> None:
        with self._lock:
            self._probing.discard(probe)
            if answered:
                self._streak.clear()
                self._missed.pop(customer, None)
                self._until.pop(customer, None)
                self._until.pop(_WHOLE_BANK, None)
                return
            self._streak = [*self._streak[-(self.failures - 1) :], customer]
            self._missed[customer] = self._missed.pop(customer, 0) + 1
            if len(self._missed) > self.MAX_TRACKED:
                oldest = next(iter(self._missed))
                del self._missed[oldest]
                self._until.pop(oldest, None)
            if self._missed[customer] >= self.failures:
                self._until[customer] = time.monotonic() + self.open_s
            if len(self._streak) >= self.failures and len(set(self._streak)) > 1:
                self._until[_WHOLE_BANK] = time.monotonic() + self.open_s


class HTTPBank:
    """``BankBackend`` over ``{base_url}/v1/customers/...``; ``api_key`` goes as ``Authorization: Bearer``.
    ``timeout_s`` bounds each request as a whole; after 3 requests in a row without an answer, a customer's
    calls (or, from several customers, every call) fail at once for ``breaker_open_s`` (``Breaker``). A
    ``client`` given is used as is and not closed."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        timeout_s: float = 5.0,
        client: httpx.Client | None = None,
        breaker_open_s: float = 5.0,
    ):
        try:
            url = httpx.URL(base_url)
        except (httpx.InvalidURL, TypeError):
            raise ValueError(f"bank URL must be http(s)://host[:port][/path], got {base_url!r}") from None
        if url.scheme not in ("http", "https") or not url.host or url.query or url.fragment:
            raise ValueError(f"bank URL must be http(s)://host[:port][/path], got {base_url!r}")
        if not (isinstance(timeout_s, int | float) and 0 < timeout_s <= 300):
            raise ValueError(f"bank timeout must be in (0, 300] seconds, got {timeout_s!r}")
        if api_key is not None and (not api_key or not all("!" <= ch <= "~" for ch in api_key)):
            raise ValueError("bank API key must be printable ASCII without spaces")
        self.base_url = str(url).rstrip("/")
        self.timeout_s = float(timeout_s)
        self._headers = {"Accept": "application/json", "Accept-Encoding": "identity"}
        if api_key is not None:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._owns_client = client is None
        self._client = client if client is not None else httpx.Client(follow_redirects=False)
        self.breaker = Breaker(open_s=breaker_open_s)

    def __repr__(self) -> str:
        return f"HTTPBank({self.base_url!r})"  # never the key

    def close(self) -> None:
        if self._owns_client:
            self._client.close()

    def customer(self, customer_id: str) -> HTTPCustomerBank:
        self.customer_name(customer_id)
        return HTTPCustomerBank(self, customer_id)

    def customer_name(self, customer_id: str) -> str:
        return self._customer_record(customer_id)["name"]

    def _customer_record(self, customer_id: str) -> dict:
        if not isinstance(customer_id, str) or not _ID.fullmatch(customer_id):
            raise UnknownCustomerError(customer_id)

        def parse(body: Any) -> dict:
            if body is None:
                raise UnknownCustomerError(customer_id)
            d = _obj(body, "customer")
            return {
                "customer_id": _id(d, "customer_id", "customer", customer_id),
                "name": _str(d, "name", "customer", empty=False),
                "payee_version": _int(d, "payee_version", "customer", 0),
            }

        return self._call("GET", f"/customers/{customer_id}", customer_id, parse)

    def _call(
        self,
        method: str,
        path: str,
        customer_id: str,
        parse: Callable[[Any], Any],
        *,
        body: dict | None = None,
        params: dict | None = None,
        headers: dict | None = None,
    ) -> Any:
        """One request; ``parse`` gets the JSON answer, or None for a 404 that is not about the customer.
        UnknownCustomerError, ValueError (409, 422, 400), BankUnavailableError as docs/assistant.md says."""
        what = f"bank API {method} {API_PREFIX}{path}"
        status, data = self._send(method, path, what, customer_id, body, params, headers)
        if status in (200, 201):
            if data is None:
                raise InvalidBankResponseError(f"{what}: HTTP {status} without a JSON answer")
        elif status == 404:
            code, _ = _error_message(data, status)
            if code == "unknown_customer":
                raise UnknownCustomerError(customer_id)
            data = None
        elif status in (400, 409, 422):
            raise ValueError(f"{what}: {_error_message(data, status)[1]}")
        elif status in (401, 403):
            raise BankUnavailableError(f"{what}: HTTP {status}: the bank refused our API key")
        elif status == 429 or status >= 500:
            raise BankUnavailableError(f"{what}: HTTP {status}: {_error_message(data, status)[1]}")
        else:
            raise InvalidBankResponseError(f"{what}: unexpected HTTP {status}")
        try:
            return parse(data)
        except _Invalid as exc:
            raise InvalidBankResponseError(f"{what}: {exc}") from None

    def _send(
        self,
        method: str,
        path: str,
        what: str,
        customer_id: str,
        body: dict | None,
        params: dict | None,
        headers: dict | None,
    ) -> tuple[int, Any]:
        """(status, JSON or None) within the time and size bounds; BankUnavailableError otherwise."""
        probe = self.breaker.admit(what, customer_id)
        answered = False
        try:
            status, raw = self._exchange(method, path, what, body, params, headers)
            answered = True
        except InvalidBankResponseError:  # an answer, if not one of the API's
            answered = True
            raise
        finally:
            self.breaker.record(answered, probe, customer_id)
        if not raw:
            return status, None
        try:
            return status, json.loads(raw)
        except (ValueError, RecursionError):  # RecursionError: "[[[[..." nested past the parser's stack
            if status in (200, 201):
                raise InvalidBankResponseError(f"{what}: answer is not JSON") from None
            return status, None  # an error page from a proxy: its status says enough

    def _exchange(
        self, method: str, path: str, what: str, body: dict | None, params: dict | None, headers: dict | None
    ) -> tuple[int, bytes]:
        """(status, raw answer) within the time and size bounds; BankUnavailableError for no answer."""
        deadline = time.monotonic() + self.timeout_s
        try:
            with self._client.stream(
                method,
                self.base_url + API_PREFIX + path,
                json=body,
                params={k: v for k, v in (params or {}).items() if v is not None},
                headers={**self._headers, **(headers or {})},
                timeout=self.timeout_s,
            ) as response:
                declared = response.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > MAX_RESPONSE_BYTES:
                    raise InvalidBankResponseError(f"{what}: answer of {declared} bytes")
                raw = bytearray()
                # httpx's timeout bounds each read; a bank trickling bytes could still take forever, so the
                # whole answer gets the same deadline.
                for chunk in response.iter_bytes():
                    raw += chunk
                    if len(raw) > MAX_RESPONSE_BYTES:
                        raise InvalidBankResponseError(f"{what}: answer over {MAX_RESPONSE_BYTES} bytes")
                    if time.monotonic() > deadline:
                        raise BankUnavailableError(f"{what}: no full answer within {self.timeout_s:g} s")
                return response.status_code, bytes(raw)
        except httpx.RequestError as exc:  # refused, reset, DNS, TLS, every kind of timeout, a broken gzip
            raise BankUnavailableError(f"{what}: {type(exc).__name__}: {exc}") from exc


class HTTPCustomerBank:
    """One customer's view of an ``HTTPBank``: ``/v1/customers/{customer_id}/...``."""

    def __init__(self, bank: HTTPBank, customer_id: str):
        self.bank = bank
        self.customer_id = customer_id
        self._path = f"/customers/{customer_id}"

    def __repr__(self) -> str:
        return f"HTTPCustomerBank({self.bank.base_url!r}, {self.customer_id!r})"

    def _call(self, method: str, path: str, parse: Callable[[Any], Any], **kwargs: Any) -> Any:
        return self.bank._call(method, self._path + path, self.customer_id, parse, **kwargs)

    def _list(
        self,
        path: str,
        key: str,
        parse: Callable[[Any, str], Any],
        params: dict | None = None,
        max_items: int = MAX_LIST_ITEMS,
    ) -> list:
        def parse_list(body: Any) -> list:
            if body is None:
                raise _Invalid("404 for a list")
            return _list(body, key, parse, max_items)

        return self._call("GET", path, parse_list, params=params)

    # --- payees -----------------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self.bank._customer_record(self.customer_id)["payee_version"]

    def payees(self) -> list[Payee]:
        return self._list("/payees", "payees", _payee, max_items=MAX_PAYEES)

    def payee(self, payee_id: str) -> Payee | None:
        if not isinstance(payee_id, str) or not _ID.fullmatch(payee_id):
            return None

        def parse(body: Any) -> Payee | None:
            if body is None:
                return None
            payee = _payee(body)
            if payee.payee_id != payee_id:
                raise _Invalid(f"payee.payee_id: asked for {payee_id!r}, got {payee.payee_id!r}")
            return payee

        return self._call("GET", f"/payees/{payee_id}", parse)

    # --- accounts, cards, transactions ------------------------------------------------------------------
    def accounts(self) -> list[dict]:
        return self._list("/accounts", "accounts", _account)

    def balance(self, account_id: str | None = None) -> dict:
        if account_id is None:
            accounts = self.accounts()
            if not accounts:
                raise KeyError("no accounts")
            return accounts[0]
        if not isinstance(account_id, str) or not _ID.fullmatch(account_id):
            raise KeyError(f"no account {account_id!r}")

        def parse(body: Any) -> dict:
            if body is None:
                raise KeyError(f"no account {account_id!r}")
            account = _account(body)
            if account["account_id"] != account_id:
                raise _Invalid(f"account.account_id: asked for {account_id!r}, got {account['account_id']!r}")
            return account

        return self._call("GET", f"/accounts/{account_id}", parse)

    def account_for_currency(self, currency: str) -> dict | None:
        accounts = self._list("/accounts", "accounts", _account, params={"currency": currency})
        return next((a for a in accounts if a["currency"] == currency), None)

    def recent_transactions(self, limit: int = 5, account_id: str | None = None) -> list[dict]:
        limit = min(max(0, int(limit)), MAX_TRANSACTIONS)
        if account_id is not None and (not isinstance(account_id, str) or not _ID.fullmatch(account_id)):
            return []
        return self._list(
            "/transactions",
            "transactions",
            _transaction,
            params={"limit": limit, "account_id": account_id},
            max_items=limit,
        )

    def cards(self) -> list[dict]:
        return self._list("/cards", "cards", _card)

    def set_card_locked(self, card_id: str, locked: bool) -> None:
        if not isinstance(card_id, str) or not _ID.fullmatch(card_id):
            raise KeyError(f"no card {card_id!r}")

        def parse(body: Any) -> None:
            if body is None:
                raise KeyError(f"no card {card_id!r}")
            card = _card(body)
            if card["card_id"] != card_id or card["locked"] != bool(locked):
                raise _Invalid(f"card: asked to set {card_id!r} locked={bool(locked)}, got {_got(card)}")

        self._call("PATCH", f"/cards/{card_id}", parse, body={"locked": bool(locked)})

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
        # The same checks as the SQLite bank, before anything leaves: the bank's own are its business.
        if kind not in TRANSFER_KINDS:
            raise ValueError(f"kind must be one of {TRANSFER_KINDS}, got {kind!r}")
        check_amount_minor(amount_minor)
        if not isinstance(session_id, str) or not session_id:
            raise ValueError(f"session_id must be a non-empty string, got {session_id!r}")
        for name, value in (
            ("payee_id", payee_id),
            ("currency", currency),
            ("from_account_id", from_account_id),
        ):
            if not isinstance(value, str | None) or (value is None and name != "from_account_id"):
                raise ValueError(f"{name} must be a string, got {value!r}")
        if scheduled_for is not None and (
            isinstance(scheduled_for, dt.datetime) or not isinstance(scheduled_for, dt.date)
        ):
            raise ValueError(f"scheduled_for must be a date, got {scheduled_for!r}")
        sent = {
            "session_id": session_id,
            "payee_id": payee_id,
            "amount_minor": amount_minor,
            "currency": currency,
            "kind": kind,
            "from_account_id": from_account_id,
            "scheduled_for": scheduled_for.isoformat() if scheduled_for else None,
        }

        def parse(body: Any) -> str:
            if body is None:
                raise _Invalid("404 for a new transfer")
            t = _transfer(body, "transfer", self.customer_id)
            got = {k: t[k] for k in ("payee_id", "amount_minor", "currency", "kind", "status")}
            if got != {**{k: sent[k] for k in got if k != "status"}, "status": "pending"}:
                raise _Invalid(f"transfer: the bank recorded {got}, not what was asked")
            return t["transfer_id"]

        return self._call("POST", "/transfers", parse, body=sent)

    def transfer(self, transfer_id: str) -> dict | None:
        if not isinstance(transfer_id, str) or not _ID.fullmatch(transfer_id):
            return None
        return self._call("GET", f"/transfers/{transfer_id}", self._one_transfer(transfer_id, None))

    def _one_transfer(self, transfer_id: str, if_missing: Callable[[], Any] | None) -> Callable[[Any], Any]:
        def parse(body: Any) -> dict | None:
            if body is None:
                return if_missing() if if_missing else None
            t = _transfer(body, "transfer", self.customer_id)
            if t["transfer_id"] != transfer_id:
                raise _Invalid(f"transfer.transfer_id: asked for {transfer_id!r}, got {t['transfer_id']!r}")
            return t

        return parse

    def execute_transfer(self, transfer_id: str, idempotency_key: str, today: dt.date | None = None) -> dict:
        check_idempotency_key(idempotency_key)
        if not isinstance(transfer_id, str) or not _ID.fullmatch(transfer_id):
            raise ValueError(f"no transfer {transfer_id!r}")

        def missing() -> None:
            raise ValueError(f"no transfer {transfer_id!r}")

        t = self._call(
            "POST",
            f"/transfers/{transfer_id}/execute",
            self._one_transfer(transfer_id, missing),
            body={"today": today.isoformat() if today else None},
            headers={"Idempotency-Key": idempotency_key},
        )
        if t["status"] == "pending" or t["idempotency_key"] != idempotency_key:
            raise InvalidBankResponseError(
                f"bank API execute {transfer_id}: answered {t['status']} under key {t['idempotency_key']!r}"
            )
        return t

    def cancel_transfer(self, transfer_id: str) -> None:
        if isinstance(transfer_id, str) and _ID.fullmatch(transfer_id):
            self._call("POST", f"/transfers/{transfer_id}/cancel", self._one_transfer(transfer_id, None))

    def transfers(self, status: str | None = None) -> list[dict]:
        def parse(item: Any, where: str) -> dict:
            t = _transfer(item, where, self.customer_id)
            if status is not None and t["status"] != status:
                raise _Invalid(f"{where}.status: asked for {status!r}, got {t['status']!r}")
            return t

        return self._list("/transfers", "transfers", parse, params={"status": status})
