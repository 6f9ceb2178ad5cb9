"""The hash-chained, append-only audit trail (audit.py)."""

from __future__ import annotations

import sqlite3

import pytest

from g4serve_assistant.audit import GENESIS, AuditLog, AuditRow


def _fill(log: AuditLog) -> None:
    log.append(
        [AuditRow("auth", "session_created", {}, "session_created")],
        customer_id="c1",
        session_id="s1",
        client={"ip": "1.2.3.4"},
    )
    log.append(
        [
            AuditRow("intent", "transfer_money", {"text": "send fifty"}),
            AuditRow("policy", "proposed", {"amount": 5000}, "proposed"),
        ],
        customer_id="c1",
        session_id="s1",
        client={"ip": "1.2.3.4"},
    )
    log.append(
        [AuditRow("http", "rejected", {"status": 401}, "rejected")],
        customer_id=None,
        session_id=None,
        client={"ip": "6.6.6.6"},
    )


@pytest.mark.parametrize("key", [None, b"k" * 32])
def test_chain_verifies_and_rows_read_back(key):
    log = AuditLog(key=key)
    _fill(log)
    check = log.verify()
    assert check.ok and check.rows == 4
    rows = log.entries(customer_id="c1", session_id="s1")
    assert [r["event"] for r in rows] == ["session_created", "transfer_money", "proposed"]
    assert rows[-1]["outcome"] == "proposed" and rows[0]["client"] == {"ip": "1.2.3.4"}
    assert log.entries(customer_id="c1", session_id="s1", limit=1)[0]["event"] == "proposed"
    assert log.head()[0] == 4 and log.head()[1] == log.entries()[-1]["hash"]


def test_empty_chain():
    log = AuditLog()
    assert log.verify().ok and log.head() == (0, GENESIS)


def test_updates_and_deletes_are_refused_by_the_database():
    log = AuditLog()
    _fill(log)
    with pytest.raises(sqlite3.IntegrityError, match="append-only"):
        log._conn.execute("UPDATE audit_chain SET outcome = 'executed' WHERE seq = 3")
    with pytest.raises(sqlite3.IntegrityError, match="append-only"):
        log._conn.execute("DELETE FROM audit_chain WHERE seq = 4")


def _tamper(path, sql: str) -> None:
    conn = sqlite3.connect(path)
    conn.execute("DROP TRIGGER audit_chain_no_update")  # an attacker with the file can drop triggers
    conn.execute("DROP TRIGGER audit_chain_no_delete")
    conn.execute(sql)
    conn.commit()
    conn.close()


@pytest.mark.parametrize(
    "sql, bad_seq",
    [
        ("UPDATE audit_chain SET detail = '{\"amount\": 1}' WHERE seq = 3", 3),
        ("UPDATE audit_chain SET customer_id = 'c2' WHERE seq = 2", 2),
        ("UPDATE audit_chain SET client = '{}' WHERE seq = 4", 4),
        ("DELETE FROM audit_chain WHERE seq = 2", 3),
    ],
)
def test_tampering_shows(tmp_path, sql, bad_seq):
    path = tmp_path / "audit.db"
    log = AuditLog(path, key=b"k" * 32)
    _fill(log)
    log.close()
    _tamper(path, sql)
    check = AuditLog(path, key=b"k" * 32).verify()
    assert not check.ok and check.first_bad_seq == bad_seq


def test_keyed_chain_cannot_be_recomputed_without_the_key(tmp_path):
    """Rewriting a row and recomputing every later hash verifies under no key, but not under the real one."""
    path = tmp_path / "audit.db"
    log = AuditLog(path, key=b"k" * 32)
    _fill(log)
    log.close()
    _tamper(path, "DELETE FROM audit_chain")
    forger = AuditLog(path)  # no key: a plain SHA-256 chain of made-up rows
    forger.append(
        [AuditRow("policy", "nothing", {}, "answered")], customer_id="c1", session_id="s1", client={}
    )
    assert forger.verify().ok
    assert not AuditLog(path, key=b"k" * 32).verify().ok


def test_odd_text_is_stored_and_read_back():
    """Issue 20's repro: a lone surrogate in a turn made that session's audit read fail for good."""
    log = AuditLog()
    log.append(
        [AuditRow("intent", "unknown", {"text": "pay \ud800 now"})],
        customer_id="c1",
        session_id="s1",
        client={},
    )
    assert log.entries(session_id="s1")[0]["detail"]["text"] == "pay \ud800 now"
    assert log.verify().ok


def test_huge_detail_is_cut_not_dropped():
    log = AuditLog()
    log.append(
        [AuditRow("asr", "transcript", {"text": "x" * 200_000})], customer_id="c1", session_id="s1", client={}
    )
    detail = log.entries()[0]["detail"]
    assert detail["truncated"] is True and detail["chars"] > 200_000
