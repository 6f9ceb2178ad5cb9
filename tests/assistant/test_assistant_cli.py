"""``g4serve assistant`` is registered lazily from the separate ``g4serve_assistant`` package; without the
``assistant`` extra (or without the package) it exits 2 with one line saying what to install, and
``g4serve-assistant`` is the same command. Which bank it serves: a SQLite database that is never seeded
unasked (``--demo``), filled by ``import-customers``, ``import-cards`` and ``import-payees``, or a bank's API
(``--bank-url``); end to end through the app for both."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
from fake_bank import FakeBank, FakeBankServer
from starlette.testclient import TestClient

from g4serve.cli import build_parser, main
from g4serve_assistant.access_cli import audit_key
from g4serve_assistant.audit import AuditLog
from g4serve_assistant.auth import TokenSigner
from g4serve_assistant.cli import build_from_args, open_bank
from g4serve_assistant.db import DEMO_CUSTOMER_2_ID, SQLiteBank, demo_bank
from g4serve_assistant.http_bank import HTTPBank

HINT = "the assistant needs its extra: pip install 'g4serve[assistant]'"


def test_the_assistant_subcommand_comes_from_the_assistant_package(capsys):
    args = build_parser().parse_args(["assistant", "--no-llm", "--port", "9000"])
    from g4serve_assistant.cli import run

    assert args.func is run and args.no_llm and args.port == 9000
    with pytest.raises(SystemExit) as exit_info:
        main(["assistant", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: g4serve assistant") and "--no-llm" in out and "import-payees" in out
    for argv in (["assistant", "--no-such-flag"], ["make-tiny", "/tmp/x", "--no-such-flag"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["assistant", "--no-llm", "--db", ":memory:"],
        ["assistant", "import-payees", "x.csv", "--customer", "c1"],
        ["assistant", "import-customers", "x.csv"],
    ],
)
def test_without_the_extra_the_assistant_exits_2_with_the_install_hint(monkeypatch, capsys, argv):
    for name in ("rapidfuzz", "pocketsphinx"):
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed: find_spec and import both fail
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"g4serve assistant: error: {HINT} (missing: rapidfuzz, pocketsphinx)\n"


def test_without_the_assistant_package_the_other_commands_still_work(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "g4serve_assistant", None)
    monkeypatch.delitem(sys.modules, "g4serve_assistant.cli", raising=False)
    assert build_parser().parse_args(["make-tiny", "/tmp/x"]).dir == "/tmp/x"
    assert main(["assistant", "--port", "9000", "--no-llm"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"g4serve assistant: error: {HINT} (missing: g4serve_assistant")
    assert err.count("\n") == 1 and "Traceback" not in err


def _script(name: str) -> str:
    path = Path(sys.executable).parent / name
    if not path.exists():
        pytest.skip(f"{name} is not installed next to {sys.executable} (pip install -e .)")
    return str(path)


def test_the_g4serve_assistant_console_script(tmp_path):
    script = _script("g4serve-assistant")
    proc = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: g4serve-assistant")
    assert "--no-llm" in proc.stdout and "import-payees" in proc.stdout
    missing = tmp_path / "missing.csv"
    proc = subprocess.run(
        [script, "import-payees", str(missing), "--customer", "c1", "--db", str(tmp_path / "bank.db")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2 and proc.stderr == f"g4serve-assistant: error: {missing}: no such file\n"


def test_the_console_script_without_the_extra_in_a_subprocess():
    """End to end, as a venv without the extra runs it: exit 2, one line on stderr, no traceback."""
    code = (
        "import sys\n"
        "sys.modules['silero_vad'] = None\n"
        "from g4serve_assistant.cli import main\n"
        "sys.exit(main(['--no-llm']))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == f"g4serve-assistant: error: {HINT} (missing: silero_vad)\n"


# --- the bank: imports, --demo, --bank-url ----------------------------------------------------------------
CUSTOMERS = (
    "customer_id,name,account_id,account_name,currency,balance_minor\n"
    "c-100,Ada Lovelace,a-chk,checking,USD,25000\n"
)
CARDS = "customer_id,card_id,account_id,kind,network,last4\nc-100,k1,a-chk,debit,visa,0042\n"
PAYEES = "payee_id,display_name,relationship\npriya_shah,Priya Shah,friend\n"


def _files(tmp_path: Path) -> dict[str, str]:
    paths = {}
    for name, text in (("customers", CUSTOMERS), ("cards", CARDS), ("payees", PAYEES)):
        (tmp_path / f"{name}.csv").write_text(text)
        paths[name] = str(tmp_path / f"{name}.csv")
    return paths


def _serve(argv: list[str]):
    return build_from_args(build_parser().parse_args(["assistant", "--no-llm", "--test-login", *argv]))


def _turns(client: TestClient, customer_id: str, *texts: str) -> list[dict]:
    token = client.post("/test-login", json={"customer_id": customer_id}).json()["token"]
    headers = {"authorization": f"Bearer {token}"}
    session = client.post("/v1/assistant/sessions", json={}, headers=headers).json()["session_id"]
    results = []
    for text in texts:
        r = client.post("/v1/assistant/turn", json={"session_id": session, "text": text}, headers=headers)
        assert r.status_code == 200, r.text
        results.append(r.json())
    return results


def test_imports_fill_a_fresh_database_and_the_assistant_serves_only_them(tmp_path, capsys):
    """Issue 20's repro from the command line: import-payees into a fresh database brought the demo's payees
    along. Now a fresh database has nothing until imported, and the customer hears only their own payees."""
    db, files = str(tmp_path / "bank.db"), _files(tmp_path)
    assert main(["assistant", "import-customers", files["customers"], "--db", db]) == 0
    assert main(["assistant", "import-cards", files["cards"], "--db", db]) == 0
    assert main(["assistant", "import-payees", files["payees"], "--customer", "c-100", "--db", db]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [
        f"imported 1 customers with 1 accounts into {db}",
        f"imported 1 cards into {db}",
        f"imported 1 payees of c-100 into {db}",
    ]
    bank = SQLiteBank(db)
    assert [c["customer_id"] for c in bank.customers()] == ["c-100"] and not bank.holds_demo_data()
    bank.close()
    with TestClient(_serve(["--db", db])) as client:
        who, water, balance = _turns(
            client, "c-100", "send 10 dollars to priya", "pay the water bill", "balance"
        )
    assert who["entities"]["payee_id"] == "priya_shah" and [c["id"] for c in who["candidates"]] == [
        "priya_shah"
    ]
    assert water["entities"].get("payee_id") is None and water["candidates"] == []  # no demo biller
    assert "$250.00" in balance["reply"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["import-payees", "{payees}", "--customer", "c-404"], "customer 'c-404' is not in the database"),
        (["import-customers", "{payees}"], "line 1, column 'payee_id': unknown column"),
        (["import-cards", "{missing}"], "missing.csv: no such file"),
    ],
)
def test_import_errors_exit_2_with_one_line(tmp_path, capsys, argv, message):
    files = {**_files(tmp_path), "missing": str(tmp_path / "missing.csv")}
    argv = [a.format(**files) for a in argv]
    assert main(["assistant", *argv, "--db", str(tmp_path / "bank.db")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_import_payees_needs_a_customer(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["assistant", "import-payees", _files(tmp_path)["payees"]])
    assert exit_info.value.code == 2 and "--customer" in capsys.readouterr().err


def test_demo_and_imports_never_share_a_database(tmp_path, capsys):
    demo_db_path, real_db_path, files = str(tmp_path / "demo.db"), str(tmp_path / "real.db"), _files(tmp_path)
    bank = open_bank(build_parser().parse_args(["assistant", "--demo", "--db", demo_db_path]))
    assert [c["customer_id"] for c in bank.customers()] == ["cust-001", DEMO_CUSTOMER_2_ID]
    bank.close()
    assert main(["assistant", "import-customers", files["customers"], "--db", demo_db_path]) == 2
    assert "holds demo data; import into a new database" in capsys.readouterr().err
    assert main(["assistant", "import-customers", files["customers"], "--db", real_db_path]) == 0
    with pytest.raises(ValueError, match="not demo data"):
        open_bank(build_parser().parse_args(["assistant", "--demo", "--db", real_db_path]))
    again = open_bank(build_parser().parse_args(["assistant", "--demo", "--db", demo_db_path]))  # idempotent
    assert len(again.customers()) == 2


def test_without_demo_a_new_database_stays_empty(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="g4serve_assistant"):
        bank = open_bank(build_parser().parse_args(["assistant", "--db", str(tmp_path / "new.db")]))
    assert bank.customers() == [] and "has no customers" in caplog.text
    bank.close()


def test_the_demo_is_served_with_both_customers():
    with TestClient(_serve(["--demo", "--db", ":memory:"])) as client:
        (alex,) = _turns(client, "cust-001", "what's my balance")
        (sam,) = _turns(client, DEMO_CUSTOMER_2_ID, "what's my balance")
    assert "$1,234.56" in alex["reply"] and "£2,450.00" in sam["reply"]


def test_bank_url_serves_over_the_banks_api(tmp_path):
    """End to end: the assistant's turns read and move money through HTTPBank, the fake bank's API and its
    SQLite store; the key comes from its file and travels as a bearer token."""
    key_file = tmp_path / "bank.key"
    key_file.write_text("  cli-test-key-9  \n")
    store = demo_bank()
    fake = FakeBank(store, api_key="cli-test-key-9")
    with FakeBankServer(fake) as server:
        argv = ["--bank-url", server.url, "--bank-api-key-file", str(key_file), "--audit-db", ":memory:"]
        app = _serve(argv)
        assert isinstance(app.state.assistant.bank, HTTPBank)
        with TestClient(app) as client:
            balance, proposal = _turns(
                client, "cust-001", "what's my balance", "send 10 dollars to john smith"
            )
    assert "$1,234.56" in balance["reply"] and proposal["needs_confirmation"] is True
    pending = store.customer("cust-001").transfers(status="pending")
    assert [(t["payee_id"], t["amount_minor"]) for t in pending] == [("john_smith", 1000)]
    assert all(headers["authorization"] == "Bearer cli-test-key-9" for _, _, headers in fake.requests)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--bank-url", "http://bank.test", "--db", "x.db"], "neither --db nor --demo"),
        (["--bank-url", "http://bank.test", "--demo"], "neither --db nor --demo"),
        (["--bank-api-key-file", "key"], "--bank-api-key-file: only with --bank-url"),
        (["--bank-url", "ftp://bank.test"], "bank URL must be http"),
        (["--bank-url", "http://bank.test", "--bank-timeout", "0"], "timeout"),
    ],
)
def test_bank_flag_errors(argv, message):
    with pytest.raises(ValueError, match=message):
        open_bank(build_parser().parse_args(["assistant", *argv]))


def test_an_empty_bank_key_file_is_refused(tmp_path):
    (tmp_path / "empty.key").write_text("\n")
    args = build_parser().parse_args(
        ["assistant", "--bank-url", "http://bank.test", "--bank-api-key-file", str(tmp_path / "empty.key")]
    )
    with pytest.raises(ValueError, match="bank API key"):
        open_bank(args)


def test_tokens_minted_with_the_secret_open_sessions_and_the_audit_is_keyed(tmp_path, capsys):
    """What a deployment does: the bank's login mints tokens with the shared secret; the operator reads and
    verifies the audit with the operator key; no test login."""
    secret, admin = tmp_path / "secret", tmp_path / "admin.key"
    secret.write_bytes(b"0123456789abcdef0123456789abcdef-extra\n")
    admin.write_text("operator-key-0123456789\n")
    db = str(tmp_path / "bank.db")
    assert (
        main(["assistant", "mint-token", "--customer", "cust-001", "--session-secret-file", str(secret)]) == 0
    )
    token = capsys.readouterr().out.strip()
    argv = ["assistant", "--no-llm", "--demo", "--db", db, "--session-secret-file", str(secret)]
    argv += ["--admin-api-key-file", str(admin)]
    app = build_from_args(build_parser().parse_args(argv))
    with TestClient(app) as client:
        ok = client.post("/v1/assistant/sessions", json={}, headers={"authorization": f"Bearer {token}"})
        assert ok.status_code == 201 and ok.json()["customer_id"] == "cust-001"
        session = ok.json()["session_id"]
        r = client.post(
            "/v1/assistant/turn",
            json={"session_id": session, "text": "what's my balance"},
            headers={"authorization": f"Bearer {token}"},
        )
        assert r.status_code == 200 and r.json()["intent"] == "balance_inquiry"
        forged = TokenSigner(b"x" * 32).mint("cust-001")
        assert (
            client.post(
                "/v1/assistant/sessions", json={}, headers={"authorization": f"Bearer {forged}"}
            ).status_code
            == 401
        )
        operator = {"authorization": "Bearer operator-key-0123456789"}
        check = client.get("/v1/assistant/admin/audit/verify", headers=operator).json()
        assert check["ok"] and check["rows"] >= 3
    # The chain is keyed from the secret: it verifies with it, not without.
    assert AuditLog(db, key=audit_key(secret.read_bytes().strip())).verify().ok
    assert not AuditLog(db).verify().ok


def test_access_flag_errors(tmp_path):
    short = tmp_path / "short"
    short.write_text("too short")
    for argv, message in [
        (["--session-secret-file", str(short)], "at least 32 bytes"),
        (["--allowed-origin", "evil.example"], "allowed origin"),
        (["--rate-limit-customer", "0"], "--rate-limit-customer"),
    ]:
        with pytest.raises(ValueError, match=message):
            build_from_args(build_parser().parse_args(["assistant", "--no-llm", "--db", ":memory:", *argv]))
