"""The CSV files a bank's own customers are imported from: customers with their accounts, cards, and one
customer's payees. Each file is read and validated whole before anything is written; an error names the
file, line and column."""

from __future__ import annotations

import csv
import re
import unicodedata
from collections.abc import Iterator
from pathlib import Path

from g4serve_assistant.bank import MAX_AMOUNT_MINOR, MAX_PAYEES, PAYEE_KINDS, Payee

CSV_REQUIRED = ("payee_id", "display_name", "relationship")
CSV_OPTIONAL = ("kind", "aliases")
CUSTOMERS_CSV = ("customer_id", "name", "account_id", "account_name", "currency", "balance_minor")
CARDS_CSV = ("customer_id", "card_id", "account_id", "kind", "network", "last4")
CARD_KINDS = ("debit", "credit")
# Ids travel in URL paths (http_bank) and audit rows: a leading dot is refused so "." and ".." never name one.
ID_PATTERN = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}")
MAX_NAME_CHARS = 100


def text_problem(value: object, max_chars: int = MAX_NAME_CHARS) -> str | None:
    """Why ``value`` is not a usable name (read aloud, shown on a page, written to audit rows), or None."""
    if not isinstance(value, str) or not value or len(value) > max_chars:
        return f"must be 1-{max_chars} characters"
    if any(unicodedata.category(ch) in ("Cc", "Cs") for ch in value):  # Cs: lone surrogates encode nowhere
        return "holds control characters"
    return None


def _read_csv(
    path: Path, required: tuple[str, ...], optional: tuple[str, ...] = ()
) -> Iterator[tuple[int, dict]]:
    """(line, {column: stripped value}) of each non-blank row, after checking the header; ValueError naming
    the file, line and column of the first problem."""
    try:
        with path.open(newline="", encoding="utf-8-sig") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            if header is None:
                raise ValueError(f"{path}: line 1: empty file, expected header {','.join(required)}")
            header = [h.strip().lower() for h in header]
            _check_header(path, header, required, optional)
            for fields in reader:
                line = reader.line_num
                if not any(f.strip() for f in fields):
                    continue  # blank line
                if len(fields) != len(header):
                    raise ValueError(f"{path}: line {line}: expected {len(header)} fields, got {len(fields)}")
                yield line, {col: value.strip() for col, value in zip(header, fields, strict=True)}
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    except csv.Error as exc:
        raise ValueError(f"{path}: line {reader.line_num}: {exc}") from None


def _check_header(
    path: Path, header: list[str], required: tuple[str, ...], optional: tuple[str, ...]
) -> None:
    for col in header:
        if col not in required + optional:
            raise ValueError(
                f"{path}: line 1, column {col!r}: unknown column (expected {', '.join(required + optional)})"
            )
    for col in required:
        if col not in header:
            raise ValueError(f"{path}: line 1, column {col!r}: missing required column")
    if len(set(header)) != len(header):
        raise ValueError(f"{path}: line 1: duplicate column names")


def _check_id(path: Path, line: int, column: str, value: str) -> None:
    if not ID_PATTERN.fullmatch(value):
        raise ValueError(
            f"{path}: line {line}, column {column!r}: {value!r} is not 1-64 of A-Z a-z 0-9 _ . - "
            "(no leading dot)"
        )


def _check_text(path: Path, line: int, column: str, value: str, required: bool = True) -> None:
    problem = text_problem(value) if (value or required) else None
    if problem:
        raise ValueError(f"{path}: line {line}, column {column!r}: {problem}")


def _check_unique(path: Path, line: int, column: str, key: object, seen: dict, label: str) -> None:
    if key in seen:
        raise ValueError(f"{path}: line {line}, column {column!r}: {label} repeats line {seen[key]}")
    seen[key] = line


def read_payees_csv(path: Path) -> list[Payee]:
    payees: list[Payee] = []
    seen: dict[str, int] = {}
    for line, row in _read_csv(path, CSV_REQUIRED, CSV_OPTIONAL):
        if len(payees) == MAX_PAYEES:
            raise ValueError(
                f"{path}: line {line}: more than {MAX_PAYEES} payees (a customer holds at most so many)"
            )
        payee_id, name = row["payee_id"], row["display_name"]
        kind = row.get("kind") or "person"
        _check_id(path, line, "payee_id", payee_id)
        _check_unique(path, line, "payee_id", payee_id, seen, repr(payee_id))
        _check_text(path, line, "display_name", name)
        _check_text(path, line, "relationship", row["relationship"], required=False)
        if kind not in PAYEE_KINDS:
            raise ValueError(
                f"{path}: line {line}, column 'kind': {kind!r} is not one of {', '.join(PAYEE_KINDS)}"
            )
        aliases = tuple(a.strip() for a in row.get("aliases", "").split(";") if a.strip())
        for alias in aliases:
            if "," in alias or text_problem(alias):  # stored ','-joined
                raise ValueError(f"{path}: line {line}, column 'aliases': {alias!r} is not a name")
        payees.append(Payee(payee_id, name, row["relationship"], kind, aliases))
    return payees


_BALANCE = re.compile(r"-?[0-9]{1,16}")  # ASCII digits only: int() would also take "1_000" and "١٢"


def read_customers_csv(path: Path) -> list[tuple[int, dict]]:
    from g4serve_assistant.normalize import is_known_currency  # the normalizer's currencies, and only those

    rows: list[tuple[int, dict]] = []
    accounts: dict[tuple[str, str], int] = {}
    names: dict[str, tuple[str, int]] = {}
    for line, row in _read_csv(path, CUSTOMERS_CSV):
        _check_id(path, line, "customer_id", row["customer_id"])
        _check_text(path, line, "name", row["name"])
        _check_id(path, line, "account_id", row["account_id"])
        _check_text(path, line, "account_name", row["account_name"])
        key = (row["customer_id"], row["account_id"])
        _check_unique(path, line, "account_id", key, accounts, f"account {row['account_id']!r} of {key[0]!r}")
        name, first = names.setdefault(row["customer_id"], (row["name"], line))
        if name != row["name"]:
            raise ValueError(
                f"{path}: line {line}, column 'name': {row['name']!r}, but line {first} says {name!r}"
            )
        if not is_known_currency(row["currency"]):
            raise ValueError(
                f"{path}: line {line}, column 'currency': {row['currency']!r} is not a known ISO code"
            )
        text = row["balance_minor"]
        if not _BALANCE.fullmatch(text) or abs(int(text)) > MAX_AMOUNT_MINOR:
            raise ValueError(
                f"{path}: line {line}, column 'balance_minor': {text!r} is not an integer of minor units "
                f"(12.50 USD is 1250) within ±{MAX_AMOUNT_MINOR}"
            )
        rows.append((line, dict(row, currency=row["currency"].upper(), balance=int(text))))
    return rows


def read_cards_csv(path: Path) -> list[tuple[int, dict]]:
    rows: list[tuple[int, dict]] = []
    seen: dict[tuple[str, str], int] = {}
    for line, row in _read_csv(path, CARDS_CSV):
        _check_id(path, line, "customer_id", row["customer_id"])
        _check_id(path, line, "card_id", row["card_id"])
        _check_id(path, line, "account_id", row["account_id"])
        key = (row["customer_id"], row["card_id"])
        _check_unique(path, line, "card_id", key, seen, f"card {row['card_id']!r} of {key[0]!r}")
        kind, network = row["kind"].lower(), row["network"].lower()
        if kind not in CARD_KINDS:
            raise ValueError(
                f"{path}: line {line}, column 'kind': {row['kind']!r} is not one of {', '.join(CARD_KINDS)}"
            )
        if not re.fullmatch(r"[a-z][a-z ]{0,29}", network):
            raise ValueError(f"{path}: line {line}, column 'network': {row['network']!r} is not 1-30 letters")
        if not re.fullmatch(r"[0-9]{4}", row["last4"]):
            raise ValueError(f"{path}: line {line}, column 'last4': {row['last4']!r} is not 4 digits")
        rows.append((line, dict(row, kind=kind, network=network)))
    return rows
