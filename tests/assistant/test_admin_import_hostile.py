"""The admin CSV imports against files a bank might really send: names with digits, very many rows. The
imports already validate a file whole and write it in one transaction (tests/assistant/test_app.py); these
are what that validation let through."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402

from g4serve_assistant.app import AccessSettings, build_app  # noqa: E402
from g4serve_assistant.db import SQLiteBank  # noqa: E402
from g4serve_assistant.pipeline import Assistant  # noqa: E402

ADMIN_KEY = "operator-key-0123456789"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
CUSTOMERS = "customer_id,name,account_id,account_name,currency,balance_minor\nc-9,Ada,a1,checking,USD,1000\n"


@pytest.fixture
def app(tmp_path):
    assistant = Assistant(SQLiteBank(tmp_path / "bank.db"), None, recognizer=None)
    limits = dict(customer_rate_per_min=60_000, customer_burst=1000, ip_rate_per_min=60_000, ip_burst=1000)
    access = AccessSettings.ephemeral(admin_api_key=ADMIN_KEY, **limits)
    with TestClient(build_app(assistant, access, warmup=False)) as c:
        r = c.post("/v1/assistant/admin/import/customers", json={"csv": CUSTOMERS}, headers=ADMIN)
        assert r.status_code == 200, r.text
        c.assistant = assistant
        yield c


def _import_payees(c: TestClient, text: str):
    return c.post(
        "/v1/assistant/admin/import/payees", json={"csv": text, "customer_id": "c-9"}, headers=ADMIN
    )


def _turn(c: TestClient, customer_id: str, text: str):
    minted = c.post("/v1/assistant/admin/tokens", json={"customer_id": customer_id}, headers=ADMIN)
    headers = {"authorization": f"Bearer {minted.json()['token']}"}
    session = c.post("/v1/assistant/sessions", json={}, headers=headers).json()["session_id"]
    return c.post("/v1/assistant/turn", json={"session_id": session, "text": text}, headers=headers)


@pytest.mark.parametrize("name", ["7-Eleven", "Studio 54", "Flat 2B Rent", "x²"])
def test_a_payee_name_with_digits_leaves_the_customer_served(app, name):
    """Finding: jellyfish's match_rating_codex raises on a digit, so a payee named "7-Eleven" (imported with
    a 200) made every payee lookup of that customer raise, and every turn of theirs ("what's my balance",
    "send 5 dollars to zed") a 500. Words are keyed on their letters, a number on itself."""
    payees = (
        "payee_id,display_name,relationship,kind,aliases\nzed,Zed Newman,friend,person,\n"
        f"x,{name},,biller,store 7"
    )
    r = _import_payees(app, payees)
    assert r.status_code == 200, r.text
    for text in ("what's my balance", "send 5 dollars to zed"):
        ok = _turn(app, "c-9", text)
        assert ok.status_code == 200, ok.text
    assert ok.json()["entities"]["payee_id"] == "zed"


def _names(n: int, start: int = 0) -> str:
    """n payees named in letters only: Payee aaa, Payee aab, ..."""
    rows = []
    for i in range(start, start + n):
        word = "".join(chr(97 + i // 26**k % 26) for k in (2, 1, 0))
        rows.append(f"p{i},Payee {word},friend")
    return "payee_id,display_name,relationship\n" + "\n".join(rows) + "\n"


def test_a_customer_holds_at_most_1000_payees(app):
    """Every turn scores the customer's whole payee list on a shared thread: 100,000 payees (a 3.4 MB file,
    under the 16 MiB body cap) built in 6.3 s and took 13.7 s a lookup, each turn of that customer holding
    the interpreter lock the other customers' turns need; 1,000 take 0.06 s."""
    bank = app.assistant.bank.customer("c-9")
    too_many = _import_payees(app, _names(1001))
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "csv", too_many.text
    message = too_many.json()["error"]["message"]
    assert "line 1002" in message and "1000" in message, message
    assert bank.payees() == []
    first = _import_payees(app, _names(600))
    assert first.status_code == 200, first.text
    # 600 more of which 200 replace payees the customer has: 1,000 in all, then one more is too many.
    again = _import_payees(app, _names(600, 400))
    assert again.status_code == 200 and len(bank.payees()) == 1000, again.text
    over = _import_payees(app, _names(1, 1000))
    assert over.status_code == 400 and "1000" in over.json()["error"]["message"], over.text
    assert len(bank.payees()) == 1000  # nothing of that file
