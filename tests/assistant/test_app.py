"""The assistant's HTTP and WebSocket API on the tiny model: fast and Gemma turns, confirmation across turns,
streamed QnA, audio (espeak-ng speech, noise, silence) and a table of bad inputs that each get a 400."""

from __future__ import annotations

import base64
import io
import json
import shutil
import subprocess
import wave

import numpy as np
import pytest

pytest.importorskip("httpx")
from fastapi.testclient import TestClient  # noqa: E402

from g4serve_assistant.app import build_app, pcm16_chunks  # noqa: E402
from g4serve_assistant.audio import decode_wav, encode_wav  # noqa: E402
from g4serve_assistant.db import demo_db  # noqa: E402
from g4serve_assistant.extraction import candidate_ids  # noqa: E402
from g4serve_assistant.pipeline import NOT_HEARD_REPLY, Assistant  # noqa: E402

needs_espeak = pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng is not installed")


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    from g4serve.engine.async_engine import AsyncLLMEngine
    from g4serve.engine.engine import EngineConfig

    engine = AsyncLLMEngine.from_config(
        EngineConfig(
            model=str(tiny_model_dir), device="cpu", dtype="float32", kv_cache_bytes=32 << 20, text_only=True
        )
    )
    assistant = Assistant(demo_db(), engine)
    with TestClient(build_app(assistant)) as c:  # the lifespan warms up VAD, ASR and the grammars
        c.assistant = assistant
        yield c


def speech(text: str, tmp_path, pad_after_s: float = 1.0) -> np.ndarray:
    wav = tmp_path / "say.wav"
    subprocess.run(
        ["espeak-ng", "-v", "en-us", "-s", "165", "-w", str(wav), text], check=True, capture_output=True
    )
    audio = decode_wav(wav.read_bytes())
    return np.concatenate([np.zeros(4800, np.float32), audio, np.zeros(int(16000 * pad_after_s), np.float32)])


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_page_health_and_metrics(client):
    page = client.get("/")
    assert page.status_code == 200 and "getUserMedia" in page.text and "/v1/assistant/ws" in page.text
    health = client.get("/health")
    version = client.assistant.db.version
    assert health.status_code == 200
    assert health.json() == {"status": "ok", "llm": True, "payee_version": version}
    client.post("/v1/assistant/turn", json={"session_id": "metrics", "text": "what's my balance"})
    metrics = client.get("/metrics").text
    assert 'g4serve_assistant_stage_seconds_bucket{le="0.0002",path="fast",stage="normalize"}' in metrics
    assert "g4serve_assistant_turns_total" in metrics


def test_health_when_the_engine_died():
    """The OpenAI server's /health shape: ``status`` for health checkers, ``error`` for API clients."""
    from types import SimpleNamespace

    assistant = Assistant(demo_db(), None)
    assistant.engine = SimpleNamespace(dead=RuntimeError("boom"))  # only `dead` is read
    with TestClient(build_app(assistant, warmup=False, owns_engine=False)) as c:
        r = c.get("/health")
    assert r.status_code == 503
    assert r.json() == {
        "status": "unavailable",
        "llm": True,
        "payee_version": assistant.db.version,
        "error": {
            "message": "engine is not running: it crashed (RuntimeError)",
            "type": "ServiceUnavailableError",
            "param": None,
            "code": 503,
        },
    }


def test_fast_path_turn(client):
    r = client.post("/v1/assistant/turn", json={"session_id": "fast", "text": "what's my balance"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["intent"] == "balance_inquiry" and body["path"] == "fast"
    assert body["needs_confirmation"] is False and body["executed"] is False
    assert "$" in body["reply"]
    for stage in ("normalize", "lookup", "intent", "policy", "total"):
        assert stage in body["stages"], body["stages"]
    assert "llm" not in body["stages"]


def test_transfer_needs_a_confirmation_turn(client):
    db = client.assistant.db
    before = len(db.transfers(status="executed"))
    first = client.post(
        "/v1/assistant/turn", json={"session_id": "pay", "text": "send fifty dollars to John Smith"}
    )
    body = first.json()
    assert (
        body["intent"] == "transfer_money"
        and body["needs_confirmation"] is True
        and body["executed"] is False
    )
    assert body["entities"]["amount_minor"] == 5000 and body["entities"]["currency"] == "USD"
    assert body["entities"]["payee_id"] == "john_smith"
    assert any(c["id"] == "john_smith" for c in body["candidates"])
    assert len(db.transfers(status="executed")) == before  # nothing moved yet
    # Another session saying "yes" confirms nothing.
    other = client.post("/v1/assistant/turn", json={"session_id": "someone-else", "text": "yes"}).json()
    assert other["executed"] is False
    assert len(db.transfers(status="executed")) == before
    second = client.post("/v1/assistant/turn", json={"session_id": "pay", "text": "yes"}).json()
    assert second["executed"] is True and second["needs_confirmation"] is False
    executed = db.transfers(status="executed")
    assert len(executed) == before + 1
    assert executed[-1]["payee_id"] == "john_smith" and executed[-1]["amount_minor"] == 5000
    audit = client.get("/v1/assistant/audit", params={"session_id": "pay"}).json()["entries"]
    assert {"normalize", "intent", "policy", "execution", "turn"} <= {e["stage"] for e in audit}


def test_gemma_path_for_an_ambiguous_utterance(client):
    r = client.post("/v1/assistant/turn", json={"session_id": "unsure", "text": "send fifty to jon"})
    body = r.json()
    assert r.status_code == 200 and body["path"] == "gemma", body
    llm = body["llm"]
    assert llm["valid"] is True and llm["error"] is None
    assert llm["output"]["recipient_candidate_id"] in [*candidate_ids(len(llm["offered"])), None]
    offered_ids = [c["id"] for c in body["candidates"]][: len(llm["offered"])]
    assert llm["offered"] == offered_ids
    assert body["entities"].get("payee_id") in [*llm["offered"], None]
    assert body["stages"]["llm"] > 0 and "validation" in body["stages"]
    assert body["executed"] is False  # a model never moves money either


def test_qna_streams(client):
    with client.stream(
        "POST", "/v1/assistant/qna", json={"question": "when are your branches open", "max_tokens": 8}
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert events[0]["type"] == "documents" and events[0]["documents"][0]["doc_id"] == "branch-hours"
    assert events[-1]["type"] == "done" and events[-1]["path"] == "gemma"
    assert sum(e["type"] == "delta" for e in events) >= 1
    # The turn endpoint answers a question at once from the best document.
    turn = client.post(
        "/v1/assistant/turn", json={"session_id": "q", "text": "what are your branch hours"}
    ).json()
    assert turn["intent"] == "qna" and turn["documents"][0] == "branch-hours" and "9 am" in turn["reply"]


def _wav_with_no_samples() -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
    return out.getvalue()


BAD_TURNS = [
    ({}, "session_id"),
    ({"text": "hi"}, "session_id"),
    ({"session_id": 7, "text": "hi"}, "session_id"),
    ({"session_id": "", "text": "hi"}, "session_id"),
    ({"session_id": "x" * 200, "text": "hi"}, "session_id"),
    ({"session_id": "s"}, "text"),
    ({"session_id": "s", "text": "hi", "audio": "UklGRg=="}, "text"),
    ({"session_id": "s", "text": ""}, "text"),
    ({"session_id": "s", "text": ["hi"]}, "text"),
    ({"session_id": "s", "text": "a" * 5000}, "text"),
    ({"session_id": "s", "txt": "hi"}, "txt"),
    ({"session_id": "s", "audio": 12}, "audio"),
    ({"session_id": "s", "audio": "@@not base64@@"}, "audio"),
    ({"session_id": "s", "audio": b64(b"hello, this is not a wav file")}, "audio"),
    ({"session_id": "s", "audio": b64(_wav_with_no_samples())}, "audio"),
    ({"session_id": "s", "audio": ""}, "audio"),
]


@pytest.mark.parametrize(("body", "field"), BAD_TURNS)
def test_bad_turns_are_400_naming_the_field(client, body, field):
    r = client.post("/v1/assistant/turn", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["message"].startswith(field), error


def test_other_bad_requests(client):
    r = client.post("/v1/assistant/turn", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    r = client.post("/v1/assistant/turn", json=["session_id"])
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    for body, field in [
        ({}, "question"),
        ({"question": "  "}, "question"),
        ({"question": "hours", "max_tokens": 0}, "max_tokens"),
        ({"question": "hours", "session_id": 3}, "session_id"),
    ]:
        r = client.post("/v1/assistant/qna", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (body, r.text)
    assert client.get("/v1/assistant/audit").json()["error"]["param"] == "session_id"
    assert client.get("/health").status_code == 200  # still serving


def test_noise_and_silence_get_a_clear_answer(client):
    rng = np.random.default_rng(0)
    for audio in (np.zeros(16000, np.float32), (0.02 * rng.standard_normal(16000)).astype(np.float32)):
        r = client.post("/v1/assistant/turn", json={"session_id": "noise", "audio": b64(encode_wav(audio))})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["reply"] == NOT_HEARD_REPLY and body["transcript"] == "" and body["intent"] == "unknown"
        assert body["executed"] is False and "vad" in body["stages"]


@needs_espeak
def test_wav_turn_with_synthesized_speech(client, tmp_path):
    audio = speech("show my recent transactions", tmp_path)
    r = client.post("/v1/assistant/turn", json={"session_id": "voice", "audio": b64(encode_wav(audio))})
    assert r.status_code == 200, r.text
    body = r.json()
    assert "transactions" in body["transcript"], body["transcript"]
    assert body["intent"] == "recent_transactions" and body["path"] == "fast"
    for stage in ("decode", "vad", "asr_final", "normalize", "intent", "total"):
        assert stage in body["stages"], body["stages"]
    assert body["asr"]["recognizer"].startswith("pocketsphinx")


@needs_espeak
def test_websocket_streams_vad_partials_and_result(client, tmp_path):
    audio = speech("what's my balance", tmp_path)
    with client.websocket_connect("/v1/assistant/ws?session_id=ws-voice") as ws:
        assert ws.receive_json()["type"] == "ready"
        for chunk in pcm16_chunks(audio):
            ws.send_bytes(chunk)
        messages = []
        while True:
            msg = ws.receive_json()
            messages.append(msg)
            if msg["type"] == "result":
                break
        kinds = [(m["type"], m.get("event")) for m in messages]
        assert ("vad", "start") in kinds and ("vad", "end") in kinds
        assert kinds.index(("vad", "start")) < kinds.index(("vad", "end"))
        assert any(m["type"] == "partial" and m["text"] for m in messages)
        result = messages[-1]
        assert result["intent"] == "balance_inquiry", result["transcript"]
        assert "balance" in result["transcript"] and result["reply"].startswith("Your checking balance")
        for mark in ("audio_received", "vad_start", "vad_end", "asr_partial", "asr_final", "response_sent"):
            assert mark in result["timeline"], result["timeline"]
        assert result["stages"]["after_vad_end"] >= 0
        # Typed text on the same socket; then "end" with no speech gets the not-heard answer.
        ws.send_text(json.dumps({"type": "text", "text": "lock my credit card"}))
        typed = ws.receive_json()
        assert typed["type"] == "result" and typed["intent"] == "card_lock" and typed["transcript"] is None
        ws.send_text(json.dumps({"type": "end"}))
        assert ws.receive_json()["reply"] == NOT_HEARD_REPLY
        ws.send_text("garbage")
        assert ws.receive_json()["type"] == "error"
        ws.send_bytes(b"\x00")
        assert ws.receive_json()["param"] == "audio"


def test_websocket_needs_a_session_id(client):
    with client.websocket_connect("/v1/assistant/ws") as ws:
        msg = ws.receive_json()
        assert msg["type"] == "error" and msg["param"] == "session_id"


def test_cli_import_payees_and_a_no_llm_app(tmp_path, capsys):
    from g4serve.cli import build_parser, main
    from g4serve_assistant.cli import build_from_args
    from g4serve_assistant.db import BankDB

    db_path = tmp_path / "bank.db"
    csv_path = tmp_path / "payees.csv"
    csv_path.write_text("payee_id,display_name,relationship\nzed_newman,Zed Newman,friend\n")
    assert main(["assistant", "import-payees", str(csv_path), "--db", str(db_path)]) == 0
    assert "imported 1 payees" in capsys.readouterr().out
    db = BankDB(db_path)
    assert db.payee("zed_newman") is not None and db.payee("john_smith") is not None  # new db: demo data too
    db.close()
    assert main(["assistant", "import-payees", str(tmp_path / "missing.csv"), "--db", str(db_path)]) == 2
    bad = tmp_path / "bad.csv"
    bad.write_text("payee_id,name\nx,y\n")
    assert main(["assistant", "import-payees", str(bad), "--db", str(db_path)]) == 2
    assert "column" in capsys.readouterr().err

    args = build_parser().parse_args(["assistant", "--no-llm", "--db", str(db_path)])
    with TestClient(build_from_args(args)) as c:
        assert c.get("/health").json()["llm"] is False
        r = c.post(
            "/v1/assistant/turn", json={"session_id": "cli", "text": "send 10 dollars to Zed Newman"}
        ).json()
        assert r["entities"]["payee_id"] == "zed_newman" and r["needs_confirmation"] is True
        with c.stream("POST", "/v1/assistant/qna", json={"question": "what is the overdraft fee"}) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        assert events[-1]["path"] == "extractive" and "$25" in events[1]["text"]


def test_cli_default_db_is_in_the_cache_dir(tmp_path, monkeypatch, capsys):
    """Without ``--db`` the database goes to ``<G4SERVE_CACHE>/assistant/``, never the working directory."""
    from g4serve.cli import build_parser, main
    from g4serve_assistant.cli import build_from_args, default_db_path

    cache, work = tmp_path / "cache", tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv("G4SERVE_CACHE", str(cache))
    monkeypatch.chdir(work)
    args = build_parser().parse_args(["assistant", "--no-llm"])
    assert args.db is None and not cache.exists()  # parsing (and --help) creates nothing
    expected = cache / "assistant" / "assistant.db"
    assert default_db_path() == expected and expected.parent.is_dir()

    with TestClient(build_from_args(args)) as c:
        assert c.get("/health").json()["status"] == "ok"
    assert expected.is_file()
    csv_path = tmp_path / "payees.csv"
    csv_path.write_text("payee_id,display_name,relationship\nzed_newman,Zed Newman,friend\n")
    assert main(["assistant", "import-payees", str(csv_path)]) == 0
    assert f"imported 1 payees into {expected}" in capsys.readouterr().out
    assert list(work.iterdir()) == []  # no assistant.db, -wal or -shm here

    override = tmp_path / "bank.db"
    assert main(["assistant", "import-payees", str(csv_path), "--db", str(override)]) == 0
    assert override.is_file()


def test_a_lone_surrogate_is_a_400_and_the_audit_stays_readable(client):
    """Issue 20: text holding "\\ud800" was audited, and that session's audit read answered 500 forever."""
    raw = b'{"session_id": "surrogate", "text": "pay bob \\ud800 fifty dollars"}'
    r = client.post("/v1/assistant/turn", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "lone surrogate" in r.json()["error"]["message"]
    question = b'{"session_id": "surrogate", "question": "hours? \\udfff"}'
    r = client.post("/v1/assistant/qna", content=question, headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert client.get("/v1/assistant/audit", params={"session_id": "surrogate"}).status_code == 200
