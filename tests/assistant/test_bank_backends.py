"""One contract, three backends: ``SQLiteBank``, ``PostgresBank`` (a real server: conftest.py) and
``HTTPBank`` over the REST API (fake_bank.py serving a ``SQLiteBank`` with uvicorn) must answer alike.
Customers are isolated, money moves once under an idempotency key, migrated and imported data reads the
same. Then what only HTTP has: a bank that fails, hangs, refuses our key, or answers what the API does not
allow."""

from __future__ import annotations

import concurrent.futures
import datetime as dt
import json
import socket
import time
from pathlib import Path

import httpx
import pytest
from fake_bank import FakeBank, FakeBankServer
from legacy_schema import LEGACY_PAYEE_VERSION, PENDING_TRANSFER, build_legacy_db

from g4serve_assistant.bank import (
    MAX_AMOUNT_MINOR,
    MAX_PAYEES,
    BankBackend,
    BankUnavailableError,
    CustomerBank,
    UnknownCustomerError,
)
from g4serve_assistant.db import DEMO_CUSTOMER_2_ID, DEMO_CUSTOMER_ID, Payee, SQLBank, SQLiteBank, demo_bank
from g4serve_assistant.http_bank import MAX_RESPONSE_BYTES, Breaker, HTTPBank, InvalidBankResponseError
from g4serve_assistant.payees import PayeeIndex

DATA = Path(__file__).parent / "data"
API_KEY = "test-key-7f3a"
TODAY = dt.date(2025, 5, 7)


@pytest.fixture(scope="module")
def server():
    with FakeBankServer(FakeBank(SQLiteBank(), api_key=API_KEY)) as srv:
        yield srv


@pytest.fixture(params=["sqlite", "postgresql", "http"])
def kind(request) -> str:
    return request.param


@pytest.fixture
def new_bank(kind, request):
    """``new_bank(demo=False)``: a new bank the test fills through its own methods, in the database under
    test: PostgreSQL for the 'postgresql' kind, else SQLite (which the fake API serves)."""
    if kind == "postgresql":
        return request.getfixturevalue("postgres_banks")
    return lambda demo=False: demo_bank() if demo else SQLiteBank()


@pytest.fixture
def wrap(kind, request):
    """Turns a bank from ``new_bank`` into the backend under test: the bank itself, or an ``HTTPBank``
    talking to the fake API that serves it."""
    if kind != "http":
        yield lambda bank: bank
        return
    srv = request.getfixturevalue("server")
    opened: list[HTTPBank] = []

    def over_http(bank: SQLBank) -> HTTPBank:
        srv.fake.bank, srv.fake.fault, srv.fake.delay_s, srv.fake.api_key = bank, None, 0.0, API_KEY
        opened.append(HTTPBank(srv.url, api_key=API_KEY))
        return opened[-1]

    yield over_http
    for client in opened:
        client.close()


@pytest.fixture
def backend(wrap, new_bank) -> BankBackend:
    return wrap(new_bank(demo=True))


@pytest.fixture
def one(backend) -> CustomerBank:
    return backend.customer(DEMO_CUSTOMER_ID)


@pytest.fixture
def two(backend) -> CustomerBank:
    return backend.customer(DEMO_CUSTOMER_2_ID)


# --- customers ----------------------------------------------------------------------------------------
def test_customers_and_unknown_customers(backend, one):
    assert isinstance(backend, BankBackend) and isinstance(one, CustomerBank)
    assert backend.customer_name(DEMO_CUSTOMER_ID) == "Alex Morgan"
    assert backend.customer_name(DEMO_CUSTOMER_2_ID) == "Sam Okafor"
    assert one.customer_id == DEMO_CUSTOMER_ID
    for bad in ("cust-404", "../cust-001", "cust-001/payees", "", "CUST-001"):
        with pytest.raises(UnknownCustomerError):
            backend.customer(bad)
        with pytest.raises(UnknownCustomerError):
            backend.customer_name(bad)


# --- isolation ----------------------------------------------------------------------------------------
def test_payees_are_scoped(one, two):
    assert one.payee("priya_patel").display_name == "Priya Patel"
    assert two.payee("priya_patel").display_name == "Priya Patil"  # same id, another person
    assert one.payee("thames_water") is None and two.payee("john_smith") is None
    assert {p.display_name for p in one.payees()}.isdisjoint({"Thames Water", "Priya Sharma", "Priya Patil"})
    assert two.payee("priya_patel").aliases == ("Pri",) and one.payee("priya_patel").aliases == ()


def test_accounts_and_transactions_are_scoped(one, two):
    with pytest.raises(KeyError):
        two.balance("chk-001")
    assert two.recent_transactions(5, "chk-001") == []
    assert one.account_for_currency("GBP") is None
    assert two.account_for_currency("GBP")["account_id"] == "chk-002"
    assert {t["account_id"] for t in two.recent_transactions(100)} <= {
        a["account_id"] for a in two.accounts()
    }


def test_cards_are_scoped(one, two):
    two.set_card_locked("card-debit", True)  # cust-002's card of that id, not cust-001's
    assert [c["locked"] for c in two.cards()] == [True, False]
    assert [c["locked"] for c in one.cards()] == [False, False]
    for view, other_card in ((one, "card-travel"), (two, "card-credit")):
        with pytest.raises(KeyError):
            view.set_card_locked(other_card, True)
    assert not any(c["locked"] for c in one.cards())


def test_transfers_are_scoped(one, two):
    tid = one.create_transfer("s1", "john_smith", 1000, "USD", "transfer")
    assert two.transfer(tid) is None and two.transfers() == []
    with pytest.raises(ValueError):
        two.execute_transfer(tid, "k-two")
    two.cancel_transfer(tid)  # a no-op: not cust-002's to cancel
    assert one.transfer(tid)["status"] == "pending"
    with pytest.raises(ValueError):
        two.create_transfer("s2", "john_smith", 100, "GBP", "transfer")  # cust-001's payee
    with pytest.raises(ValueError):
        two.create_transfer(
            "s2", "jon_smith", 100, "USD", "transfer", from_account_id="chk-001"
        )  # and account
    assert one.execute_transfer(tid, "k-one", today=TODAY)["status"] == "executed"
    assert two.balance()["balance_minor"] == 245_000 and two.transfers() == []


# --- transfers ----------------------------------------------------------------------------------------
def test_a_transfer_executes_once_under_its_key(one):
    tid = one.create_transfer("s1", "john_smith", 5000, "USD", "transfer")
    pending = one.transfer(tid)
    assert (pending["status"], pending["idempotency_key"], pending["customer_id"]) == (
        "pending",
        None,
        "cust-001",
    )
    assert one.balance()["balance_minor"] == 123_456  # creating moves nothing
    done = one.execute_transfer(tid, "turn-42", today=TODAY)
    assert (done["status"], done["from_account_id"], done["idempotency_key"]) == (
        "executed",
        "chk-001",
        "turn-42",
    )
    assert one.balance()["balance_minor"] == 123_456 - 5000
    newest = one.recent_transactions(1)[0]
    assert (newest["description"], newest["amount_minor"], newest["posted_on"]) == (
        "Transfer to John Smith",
        -5000,
        "2025-05-07",
    )
    assert one.execute_transfer(tid, "turn-42", today=TODAY) == done  # a retry: the stored answer
    assert one.balance()["balance_minor"] == 123_456 - 5000
    assert len(one.recent_transactions(1000)) == 21
    with pytest.raises(ValueError, match="executed, not pending"):
        one.execute_transfer(tid, "turn-43")
    assert one.balance()["balance_minor"] == 123_456 - 5000 and one.transfer(tid) == done


def test_a_cancelled_transfer_cannot_execute(one):
    tid = one.create_transfer("s1", "city_electric", 1000, "USD", "bill_payment")
    one.cancel_transfer(tid)
    one.cancel_transfer(tid)  # idempotent
    with pytest.raises(ValueError, match="cancelled"):
        one.execute_transfer(tid, "k")
    assert [t["status"] for t in one.transfers()] == ["cancelled"]
    assert one.transfers(status="pending") == [] and one.balance()["balance_minor"] == 123_456


def test_insufficient_funds_fail_and_stay_failed(one):
    tid = one.create_transfer("s1", "john_smith", 200_000, "USD", "transfer")
    failed = one.execute_transfer(tid, "k1")
    assert (failed["status"], failed["note"]) == ("failed", "insufficient funds")
    assert one.execute_transfer(tid, "k1") == failed
    with pytest.raises(ValueError, match="failed, not pending"):
        one.execute_transfer(tid, "k2")
    assert one.balance()["balance_minor"] == 123_456


def test_a_later_date_is_scheduled_not_paid(one):
    tid = one.create_transfer("s1", "john_smith", 100, "USD", "transfer", scheduled_for=dt.date(2025, 6, 1))
    done = one.execute_transfer(tid, "k", today=TODAY)
    assert (done["status"], done["scheduled_for"]) == ("scheduled", "2025-06-01")
    assert one.balance()["balance_minor"] == 123_456


def test_a_transfer_pays_from_the_account_in_its_currency(one, two):
    one.execute_transfer(one.create_transfer("s1", "yuki_tanaka", 5000, "JPY", "transfer"), "k")
    assert one.balance("jpy-001")["balance_minor"] == 250_000 - 5000
    tid = two.create_transfer("s2", "thames_water", 3850, "GBP", "bill_payment")
    assert two.execute_transfer(tid, "k")["from_account_id"] == "chk-002"  # the same key: another customer's
    assert two.recent_transactions(1)[0]["description"] == "Payment to Thames Water"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("s", "john_smith", 100, "USD", "gift"), "kind"),
        (("s", "john_smith", 0, "USD", "transfer"), "positive"),
        (("s", "john_smith", -5, "USD", "transfer"), "positive"),
        (("s", "john_smith", True, "USD", "transfer"), "positive"),
        (("s", "john_smith", 12.5, "USD", "transfer"), "positive"),
        (("s", "john_smith", "100", "USD", "transfer"), "positive"),
        (("s", "john_smith", MAX_AMOUNT_MINOR + 1, "USD", "transfer"), "at most"),
        (("s", "ghost", 100, "USD", "transfer"), "unknown payee"),
        (("s", "john_smith", 100, "GBP", "transfer"), "no account in GBP"),
        (("s", "john_smith", 100, "USD", "transfer", "eur-001"), "not in USD"),
        (("s", "john_smith", 100, "USD", "transfer", None, dt.datetime(2025, 6, 1)), "date"),
        (("", "john_smith", 100, "USD", "transfer"), "session_id"),
    ],
)
def test_create_transfer_validates(one, args, message):
    with pytest.raises(ValueError, match=message):
        one.create_transfer(*args)
    assert one.transfers() == []


def test_card_lock(one):
    one.set_card_locked("card-debit", True)
    assert {c["card_id"]: c["locked"] for c in one.cards()} == {"card-debit": True, "card-credit": False}
    one.set_card_locked("card-debit", False)
    assert not any(c["locked"] for c in one.cards())
    with pytest.raises(KeyError):
        one.set_card_locked("card-nope", True)


def test_balances_and_transactions(one):
    assert one.balance() == {
        "account_id": "chk-001",
        "name": "checking",
        "balance_minor": 123_456,
        "currency": "USD",
    }
    assert one.balance("jpy-001")["currency"] == "JPY"
    with pytest.raises(KeyError):
        one.balance("nope")
    txns = one.recent_transactions(5)
    assert len(txns) == 5 and [t["posted_on"] for t in txns] == sorted(
        (t["posted_on"] for t in txns), reverse=True
    )
    assert {t["account_id"] for t in one.recent_transactions(10, account_id="eur-001")} == {"eur-001"}
    assert one.recent_transactions(0) == []


# --- versions, imports, migrations --------------------------------------------------------------------
def test_the_payee_version_follows_the_database(wrap, new_bank):
    bank = new_bank(demo=True)
    one = wrap(bank).customer(DEMO_CUSTOMER_ID)
    version = one.version
    bank.customer(DEMO_CUSTOMER_ID).upsert_payee(Payee("zeb", "Zeb Quarterman", "friend", "person"))
    assert one.version == version + 1 and one.payee("zeb").display_name == "Zeb Quarterman"
    assert wrap(bank).customer(DEMO_CUSTOMER_2_ID).version == 1


def test_imported_customers_cards_and_payees(wrap, new_bank, tmp_path):
    bank = new_bank()
    (tmp_path / "c.csv").write_text(
        "customer_id,name,account_id,account_name,currency,balance_minor\n"
        "c-100,Ada Lovelace,a-chk,checking,USD,250000\nc-100,Ada Lovelace,a-eur,euro,EUR,900\n"
    )
    (tmp_path / "k.csv").write_text(
        "customer_id,card_id,account_id,kind,network,last4\nc-100,k1,a-chk,debit,visa,0042\n"
    )
    bank.import_customers_csv(tmp_path / "c.csv")
    bank.import_cards_csv(tmp_path / "k.csv")
    bank.import_payees_csv(DATA / "payees.csv", "c-100")
    ada = wrap(bank).customer("c-100")
    assert ada.accounts()[1] == {
        "account_id": "a-eur",
        "name": "euro",
        "balance_minor": 900,
        "currency": "EUR",
    }
    assert ada.cards()[0]["last4"] == "0042" and ada.payee("city_electric").kind == "biller"
    tid = ada.create_transfer("s", "hans_muller", 900, "EUR", "transfer")
    assert (
        ada.execute_transfer(tid, "k")["status"] == "executed" and ada.balance("a-eur")["balance_minor"] == 0
    )


def test_the_issue_repro_finds_only_the_customers_own_payees(wrap, new_bank, tmp_path):
    """Issue 20: after import-payees into a fresh database, "who is priya" found the demo's Priya Patel too
    and "pay the water bill" chose the demo's Metro Water Utility. Nothing is seeded unasked any more."""
    bank = new_bank()
    bank.add_customer("c-100", "Ada Lovelace")
    (tmp_path / "p.csv").write_text("payee_id,display_name,relationship\npriya_shah,Priya Shah,friend\n")
    bank.import_payees_csv(tmp_path / "p.csv", "c-100")
    ada = wrap(bank).customer("c-100")
    index = PayeeIndex(ada)
    assert [c.display_name for c in index.search("priya")] == ["Priya Shah"]
    assert index.find_in_utterance("pay the water bill") == []
    assert {p.display_name for p in ada.payees()} == {"Priya Shah"}


@pytest.mark.parametrize("kind", ["sqlite", "http"])  # version 0 was an SQLite file; PostgreSQL starts at 1
def test_a_migrated_version_0_database_serves_its_customer(wrap, tmp_path):
    path = tmp_path / "old.db"
    build_legacy_db(path)
    alex = wrap(SQLiteBank(path)).customer("cust-001")
    assert alex.version == LEGACY_PAYEE_VERSION and alex.payee("zed_newman").aliases == ("zed",)
    assert alex.balance()["balance_minor"] == 123_456 - 5000
    assert alex.transfer(PENDING_TRANSFER)["customer_id"] == "cust-001"
    assert alex.execute_transfer(PENDING_TRANSFER, "k", today=TODAY)["status"] == "executed"
    assert alex.balance()["balance_minor"] == 123_456 - 5000 - 2500


# --- HTTP only: a bank that fails -----------------------------------------------------------------------
def _calls(view: CustomerBank) -> list:
    return [
        lambda: view.version,
        view.payees,
        lambda: view.payee("john_smith"),
        view.accounts,
        view.balance,
        lambda: view.account_for_currency("USD"),
        view.recent_transactions,
        view.cards,
        lambda: view.set_card_locked("card-debit", True),
        lambda: view.create_transfer("s", "john_smith", 100, "USD", "transfer"),
        lambda: view.transfer("t-1"),
        lambda: view.execute_transfer("t-1", "k"),
        lambda: view.cancel_transfer("t-1"),
        view.transfers,
    ]


@pytest.mark.parametrize("status", [500, 502, 503, 429])
def test_a_failing_bank_is_unavailable_for_every_call(server, status):
    bank = demo_bank()
    server.fake.bank, server.fake.api_key, server.fake.delay_s = bank, API_KEY, 0.0
    client = HTTPBank(server.url, api_key=API_KEY)
    server.fake.fault = None
    view = client.customer(DEMO_CUSTOMER_ID)
    server.fake.fault = status
    try:
        for call in _calls(view):
            with pytest.raises(BankUnavailableError, match=f"HTTP {status}: injected fault") as info:
                call()
            assert type(info.value) is BankUnavailableError  # the bank is down, not speaking another API
        with pytest.raises(BankUnavailableError):
            client.customer(DEMO_CUSTOMER_ID)
    finally:
        server.fake.fault = None
        client.close()
    assert bank.customer(DEMO_CUSTOMER_ID).transfers() == []


def test_a_lost_answer_is_retried_under_the_same_key_and_pays_once(server):
    """The bank executes, but its answer arrives after our timeout: unavailable, and the money has moved.
    Executing again under the same key returns the stored result and moves nothing more."""
    bank = demo_bank()
    server.fake.bank, server.fake.api_key, server.fake.fault = bank, API_KEY, None
    client = HTTPBank(server.url, api_key=API_KEY, timeout_s=0.3)
    one = client.customer(DEMO_CUSTOMER_ID)
    tid = one.create_transfer("s1", "john_smith", 5000, "USD", "transfer")
    server.fake.delay_s = 1.0
    try:
        started = time.monotonic()
        with pytest.raises(BankUnavailableError, match="Timeout"):
            one.execute_transfer(tid, "turn-7", today=TODAY)
        assert time.monotonic() - started < 0.9
    finally:
        server.fake.delay_s = 0.0
    assert bank.customer(DEMO_CUSTOMER_ID).balance()["balance_minor"] == 123_456 - 5000  # it did happen
    assert one.execute_transfer(tid, "turn-7", today=TODAY)["status"] == "executed"
    assert one.balance()["balance_minor"] == 123_456 - 5000
    executes = [r for r in server.fake.requests if r[1].endswith(f"/transfers/{tid}/execute")]
    assert [r[2]["idempotency-key"] for r in executes] == ["turn-7", "turn-7"]
    assert all(r[2]["authorization"] == f"Bearer {API_KEY}" for r in server.fake.requests[-5:])
    client.close()


def test_a_bank_that_stops_answering_is_not_waited_on_by_every_call(server):
    """Finding: every call to a bank that had stopped answering waited the whole timeout (5 s), each in a
    worker thread, so an outage seen by a handful of customers held the default pool (6 threads on 2 cores)
    and queued every other turn behind it. After 3 calls in a row without an answer the bank is left alone
    for ``breaker_open_s``: calls fail at once, nothing is sent; then one call at a time probes it."""
    bank = demo_bank()
    server.fake.bank, server.fake.api_key, server.fake.fault = bank, API_KEY, None
    client = HTTPBank(server.url, api_key=API_KEY, timeout_s=1.0, breaker_open_s=0.5)
    view = client.customer(DEMO_CUSTOMER_ID)
    server.fake.delay_s = 2.0  # the bank hangs
    try:
        for _ in range(3):
            with pytest.raises(BankUnavailableError, match="Timeout"):
                view.balance()
        sent = len(server.fake.requests)
        started = time.monotonic()
        with pytest.raises(BankUnavailableError, match="this customer's last 3 requests") as info:
            view.transfers()
        assert time.monotonic() - started < 0.05 and len(server.fake.requests) == sent
        assert type(info.value) is BankUnavailableError
        time.sleep(0.5)
        server.fake.delay_s = 0.6  # back, slowly: the first call after the pause is the one probe
        probe = concurrent.futures.ThreadPoolExecutor(1).submit(view.balance)
        time.sleep(0.2)
        with pytest.raises(BankUnavailableError, match="one request at a time"):  # not a second probe
            view.transfers()
        assert probe.result(timeout=5)["balance_minor"] == 123_456
        server.fake.delay_s = 0.0
        assert view.transfers() == []  # answered: closed again
        server.fake.delay_s = 2.0
        for _ in range(2):  # the count starts anew after an answer
            with pytest.raises(BankUnavailableError, match="Timeout"):
                view.balance()
        server.fake.delay_s = 0.0
        assert view.balance()["balance_minor"] == 123_456
    finally:
        server.fake.delay_s = 0.0
        client.close()


def test_one_customers_hanging_calls_pause_only_that_customer():
    """Finding: the breaker counted every customer's calls as one, so a customer whose own calls hang at the
    bank (say, a history it made slow to list) paused every other customer's bank calls for ``open_s`` after 3
    turns, again and again. Now 3 in a row without an answer pause only their customer; the whole bank is
    paused when the calls in a row without an answer come from more than one customer."""
    breaker = Breaker(failures=3, open_s=60.0)
    for _ in range(3):
        assert breaker.admit("GET", "mallory") is None
        breaker.record(False, None, "mallory")
    with pytest.raises(BankUnavailableError, match="this customer's last 3 requests"):
        breaker.admit("GET", "mallory")
    assert breaker.admit("GET", "alice") is None  # others are still served
    breaker.record(True, None, "alice")
    with pytest.raises(BankUnavailableError, match="this customer's last 3"):
        breaker.admit("GET", "mallory")
    # an outage: the calls in a row without an answer come from several customers
    for customer in ("alice", "bob", "carol"):
        assert breaker.admit("GET", customer) is None
        breaker.record(False, None, customer)
    with pytest.raises(BankUnavailableError, match="did not answer 3 requests in a row"):
        breaker.admit("GET", "dave")


def test_a_paused_customer_is_probed_once_then_served_again():
    breaker = Breaker(failures=2, open_s=0.05)
    for _ in range(2):
        breaker.record(False, breaker.admit("GET", "mallory"), "mallory")
    time.sleep(0.06)
    probe = breaker.admit("GET", "mallory")
    assert probe == "mallory"
    with pytest.raises(BankUnavailableError, match="one request at a time"):  # not a second probe
        breaker.admit("GET", "mallory")
    breaker.record(True, probe, "mallory")
    assert breaker.admit("GET", "mallory") is None


def test_a_bank_that_is_not_there_is_unavailable():
    with socket.socket() as s:  # a port nobody listens on once this closes
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = HTTPBank(f"http://127.0.0.1:{port}", timeout_s=1.0)
    with pytest.raises(BankUnavailableError, match="ConnectError"):
        client.customer(DEMO_CUSTOMER_ID)


def test_a_refused_key_is_unavailable_and_never_shown(server):
    server.fake.bank, server.fake.api_key, server.fake.fault, server.fake.delay_s = (
        demo_bank(),
        API_KEY,
        None,
        0,
    )
    client = HTTPBank(server.url, api_key="wrong-key")
    with pytest.raises(BankUnavailableError, match="HTTP 401: the bank refused our API key") as info:
        client.customer(DEMO_CUSTOMER_ID)
    assert "wrong-key" not in str(info.value) and "wrong-key" not in repr(client)


# --- HTTP only: answers the API does not allow ----------------------------------------------------------
ACCOUNT = {"account_id": "chk-001", "name": "checking", "balance_minor": 100, "currency": "USD"}
CUSTOMER = {"customer_id": "cust-001", "name": "Alex Morgan", "payee_version": 3}
TRANSFER = {
    "transfer_id": "t-1",
    "customer_id": "cust-001",
    "session_id": "s",
    "payee_id": "john_smith",
    "from_account_id": "chk-001",
    "amount_minor": 100,
    "currency": "USD",
    "kind": "transfer",
    "status": "pending",
    "scheduled_for": None,
    "note": None,
    "idempotency_key": None,
    "created_at": 1.0,
    "updated_at": 1.0,
}


def _mock_bank(answers: dict[str, httpx.Response], timeout_s: float = 5.0) -> HTTPBank:
    """An HTTPBank whose bank answers ``answers[path]`` (the customer record unless given)."""

    def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path in answers:
            return answers[path]
        if path == "/v1/customers/cust-001":
            return httpx.Response(200, json=CUSTOMER)
        return httpx.Response(404, json={"error": {"code": "not_found", "message": "no"}})

    client = httpx.Client(transport=httpx.MockTransport(handler))
    return HTTPBank("http://bank.test", timeout_s=timeout_s, client=client)


def _accounts(*accounts: object) -> dict:
    body = json.dumps(
        {"accounts": list(accounts)}
    )  # ASCII: "\\ud800" travels escaped, as a bank could send it
    return {"/v1/customers/cust-001/accounts": httpx.Response(200, content=body.encode())}


@pytest.mark.parametrize(
    ("answers", "message"),
    [
        (_accounts(dict(ACCOUNT, balance_minor="100")), r"accounts\[0\].balance_minor: expected an integer"),
        (_accounts(dict(ACCOUNT, balance_minor=100.5)), r"balance_minor: expected an integer"),
        (_accounts(dict(ACCOUNT, balance_minor=True)), r"balance_minor: expected an integer"),
        (_accounts(dict(ACCOUNT, balance_minor=2**60)), r"balance_minor: expected an integer in"),
        (
            _accounts({k: v for k, v in ACCOUNT.items() if k != "currency"}),
            r"accounts\[0\].currency: missing",
        ),
        (_accounts(dict(ACCOUNT, currency="usd")), r"currency: expected an ISO currency code"),
        (_accounts(dict(ACCOUNT, name="check\ud800ing")), r"name: control characters"),
        (_accounts(dict(ACCOUNT, account_id="../x")), r"account_id: expected an id"),
        (_accounts(*[ACCOUNT] * 10_001), r"response.accounts: expected a list of at most 10000"),
        ({"/v1/customers/cust-001/accounts": httpx.Response(200, json=[ACCOUNT])}, r"expected an object"),
        ({"/v1/customers/cust-001/accounts": httpx.Response(200, text="<html>")}, r"answer is not JSON"),
        ({"/v1/customers/cust-001/accounts": httpx.Response(200, text="[" * 100_000)}, r"answer is not JSON"),
        (
            {"/v1/customers/cust-001/accounts": httpx.Response(200, content=b" " * (MAX_RESPONSE_BYTES + 1))},
            r"answer of \d+ bytes",
        ),
        (
            {"/v1/customers/cust-001/accounts": httpx.Response(302, headers={"location": "/x"})},
            r"unexpected HTTP 302",
        ),
        ({"/v1/customers/cust-001/accounts": httpx.Response(404)}, r"404 for a list"),
        ({"/v1/customers/cust-001/accounts": httpx.Response(200)}, r"HTTP 200 without a JSON answer"),
        (
            {"/v1/customers/cust-001/accounts": httpx.Response(200, json=None)},
            r"HTTP 200 without a JSON answer",
        ),
    ],
)
def test_answers_outside_the_api_are_refused(answers, message):
    view = _mock_bank(answers).customer(DEMO_CUSTOMER_ID)
    with pytest.raises(InvalidBankResponseError, match=message):
        view.accounts()


def test_a_bank_listing_more_payees_than_a_customer_holds_is_refused():
    """Every turn scores a customer's whole payee list on a shared thread: the bank's API may not hand the
    assistant more payees than an import may give a customer (10,000 took ~1.4 s a lookup)."""
    payee = {
        "payee_id": "p-1",
        "display_name": "Jon Smith",
        "relationship": "friend",
        "kind": "person",
        "aliases": [],
    }
    body = json.dumps({"payees": [dict(payee, payee_id=f"p-{i}") for i in range(MAX_PAYEES + 1)]})
    view = _mock_bank({"/v1/customers/cust-001/payees": httpx.Response(200, content=body.encode())})
    with pytest.raises(
        InvalidBankResponseError, match=f"response.payees: expected a list of at most {MAX_PAYEES},"
    ):
        view.customer(DEMO_CUSTOMER_ID).payees()
    body = json.dumps({"payees": [dict(payee, payee_id=f"p-{i}") for i in range(MAX_PAYEES)]})
    view = _mock_bank({"/v1/customers/cust-001/payees": httpx.Response(200, content=body.encode())})
    assert len(view.customer(DEMO_CUSTOMER_ID).payees()) == MAX_PAYEES


def test_a_streamed_answer_over_the_bound_is_cut_off():
    def chunks():
        while True:
            yield b" " * 65536

    answers = {"/v1/customers/cust-001/cards": httpx.Response(200, content=chunks())}  # no Content-Length
    with pytest.raises(InvalidBankResponseError, match=f"answer over {MAX_RESPONSE_BYTES} bytes"):
        _mock_bank(answers).customer(DEMO_CUSTOMER_ID).cards()


def test_a_bank_trickling_its_answer_runs_out_of_time():
    """httpx's timeout bounds each read; a bank sending a byte now and then must still finish in time."""

    def trickle():
        for _ in range(100):
            time.sleep(0.05)
            yield b" "

    answers = {"/v1/customers/cust-001/cards": httpx.Response(200, content=trickle())}
    view = _mock_bank(answers, timeout_s=0.3).customer(DEMO_CUSTOMER_ID)
    started = time.monotonic()
    with pytest.raises(BankUnavailableError, match=r"no full answer within 0.3 s"):
        view.cards()
    assert time.monotonic() - started < 1.0


def test_another_customers_transfer_in_the_answer_is_refused():
    leaked = {
        "/v1/customers/cust-001/transfers/t-1": httpx.Response(
            200, json=dict(TRANSFER, customer_id="cust-002")
        )
    }
    with pytest.raises(InvalidBankResponseError, match=r"customer_id: asked for 'cust-001', got 'cust-002'"):
        _mock_bank(leaked).customer(DEMO_CUSTOMER_ID).transfer("t-1")


def test_an_execute_answer_must_carry_our_key():
    answers = {
        "/v1/customers/cust-001/transfers/t-1/execute": httpx.Response(
            200, json=dict(TRANSFER, status="executed", idempotency_key="someone-else")
        )
    }
    with pytest.raises(InvalidBankResponseError, match="under key 'someone-else'"):
        _mock_bank(answers).customer(DEMO_CUSTOMER_ID).execute_transfer("t-1", "mine")


def test_a_new_transfer_must_be_recorded_as_asked():
    answers = {
        "/v1/customers/cust-001/transfers": httpx.Response(201, json=dict(TRANSFER, amount_minor=10_000))
    }
    with pytest.raises(InvalidBankResponseError, match="not what was asked"):
        _mock_bank(answers).customer(DEMO_CUSTOMER_ID).create_transfer(
            "s", "john_smith", 100, "USD", "transfer"
        )


def test_error_answers_map_to_the_protocols_errors():
    def error(status: int, code: str) -> httpx.Response:
        return httpx.Response(status, json={"error": {"code": code, "message": f"{code} says the bank"}})

    view = _mock_bank(
        {
            "/v1/customers/cust-001/transfers": error(422, "invalid"),
            "/v1/customers/cust-001/transfers/t-1/execute": error(409, "conflict"),
            "/v1/customers/cust-001/payees": error(404, "unknown_customer"),
        }
    ).customer(DEMO_CUSTOMER_ID)
    with pytest.raises(ValueError, match="invalid says the bank"):
        view.create_transfer("s", "john_smith", 100, "USD", "transfer")
    with pytest.raises(ValueError, match="conflict says the bank"):
        view.execute_transfer("t-1", "k")
    with pytest.raises(ValueError, match="no transfer 't-2'"):
        view.execute_transfer("t-2", "k")  # 404 not_found
    with pytest.raises(UnknownCustomerError):
        view.payees()  # the customer went away
    assert view.payee("john_smith") is None and view.transfer("t-9") is None
    with pytest.raises(KeyError):
        view.balance("chk-9")


def test_requests_carry_json_the_api_describes():
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path.endswith("/execute"):
            return httpx.Response(200, json=dict(TRANSFER, status="executed", idempotency_key="k-1"))
        if request.url.path.endswith("/transfers"):
            return httpx.Response(201, json=dict(TRANSFER, scheduled_for="2025-06-01"))
        return httpx.Response(200, json=CUSTOMER)

    client = HTTPBank(
        "http://bank.test/base/",
        api_key="s3cret",
        client=httpx.Client(transport=httpx.MockTransport(handler)),
    )
    view = client.customer(DEMO_CUSTOMER_ID)
    view.create_transfer("s", "john_smith", 100, "USD", "transfer", scheduled_for=dt.date(2025, 6, 1))
    view.execute_transfer("t-1", "k-1", today=TODAY)
    create, execute = seen[1], seen[2]
    assert (create.method, create.url.path) == ("POST", "/base/v1/customers/cust-001/transfers")
    assert json.loads(create.content) == {
        "session_id": "s",
        "payee_id": "john_smith",
        "amount_minor": 100,
        "currency": "USD",
        "kind": "transfer",
        "from_account_id": None,
        "scheduled_for": "2025-06-01",
    }
    assert execute.headers["idempotency-key"] == "k-1" and json.loads(execute.content) == {
        "today": "2025-05-07"
    }
    assert all(r.headers["authorization"] == "Bearer s3cret" for r in seen)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"base_url": "ftp://bank.test"}, "http"),
        ({"base_url": "http://bank.test/?x=1"}, "http"),
        ({"base_url": "http://[::1"}, "http"),
        ({"base_url": "/relative"}, "http"),
        ({"base_url": "http://bank.test", "timeout_s": 0}, "timeout"),
        ({"base_url": "http://bank.test", "api_key": "two words"}, "API key"),
        ({"base_url": "http://bank.test", "api_key": "line\nbreak"}, "API key"),
    ],
)
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HTTPBank(**kwargs)
