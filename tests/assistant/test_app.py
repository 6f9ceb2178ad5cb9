"""The assistant's HTTP and WebSocket API on the tiny model: fast and Gemma turns, confirmation across turns,
streamed QnA, audio (espeak-ng speech, noise, silence) and a table of bad inputs that each get a 400."""

from __future__ import annotations

import base64
import io
import json
import shutil
import subprocess
import wave

import jwt
import numpy as np
import pytest
from starlette.websockets import WebSocketDisconnect

pytest.importorskip("httpx")
from fastapi.testclient import TestClient  # noqa: E402

from g4serve_assistant.app import AccessSettings, build_app, pcm16_chunks  # noqa: E402
from g4serve_assistant.audio import decode_wav, encode_wav  # noqa: E402
from g4serve_assistant.db import DEMO_CUSTOMER_ID, demo_bank  # noqa: E402
from g4serve_assistant.pipeline import NOT_HEARD_REPLY, Assistant  # noqa: E402
from g4serve_assistant.transcript import Transcript  # noqa: E402
from g4serve_assistant.vad import VadEvent  # noqa: E402

needs_espeak = pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng is not installed")


ADMIN_KEY = "operator-key-0123456789"


class Customer:
    """A signed-in customer of the bank: a token from the admin route, a session from the server; every
    request carries both, and a yes names the action the client was last shown (as the page does)."""

    def __init__(self, client: TestClient, customer_id: str = DEMO_CUSTOMER_ID):
        self.client, self.customer_id = client, customer_id
        r = client.post("/v1/assistant/admin/tokens", json={"customer_id": customer_id}, headers=ADMIN)
        assert r.status_code == 200, r.text
        self.token = r.json()["token"]
        self.headers = {"authorization": f"Bearer {self.token}"}
        self.session_id = self.new_session()
        self.shown: dict[str, str | None] = {}  # per session: the pending action last shown

    def new_session(self) -> str:
        r = self.client.post("/v1/assistant/sessions", json={}, headers=self.headers)
        assert r.status_code == 201, r.text
        return r.json()["session_id"]

    def post(self, path: str, body: dict, **kwargs):
        return self.client.post(path, json=body, headers=self.headers, **kwargs)

    def turn(self, text: str | None = None, **body) -> dict:
        if text is not None:
            body["text"] = text
        body.setdefault("session_id", self.session_id)
        body.setdefault("action_id", self.shown.get(body["session_id"]))
        r = self.post("/v1/assistant/turn", body)
        assert r.status_code == 200, r.text
        result = r.json()
        self.shown[body["session_id"]] = (result["pending"] or {}).get("action_id")
        return result

    def audit(self) -> list[dict]:
        r = self.client.get(
            "/v1/assistant/audit", params={"session_id": self.session_id}, headers=self.headers
        )
        assert r.status_code == 200, r.text
        return r.json()["entries"]


ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


def access(**kwargs) -> AccessSettings:
    # Generous rates: a test module makes hundreds of requests as one customer from one address.
    limits = dict(customer_rate_per_min=60_000, customer_burst=1000, ip_rate_per_min=60_000, ip_burst=1000)
    return AccessSettings.ephemeral(admin_api_key=ADMIN_KEY, **(limits | kwargs))


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    from g4serve.engine.async_engine import AsyncLLMEngine
    from g4serve.engine.engine import EngineConfig

    engine = AsyncLLMEngine.from_config(
        EngineConfig(
            model=str(tiny_model_dir), device="cpu", dtype="float32", kv_cache_bytes=32 << 20, text_only=True
        )
    )
    assistant = Assistant(demo_bank(), engine)
    with TestClient(build_app(assistant, access())) as c:  # the lifespan warms up VAD, ASR and the grammars
        c.assistant = assistant
        c.db = assistant.bank.customer(DEMO_CUSTOMER_ID)
        yield c


@pytest.fixture
def alex(client) -> Customer:
    return Customer(client)


def speech(text: str, tmp_path, pad_after_s: float = 1.0) -> np.ndarray:
    wav = tmp_path / "say.wav"
    subprocess.run(
        ["espeak-ng", "-v", "en-us", "-s", "165", "-w", str(wav), text], check=True, capture_output=True
    )
    audio = decode_wav(wav.read_bytes())
    return np.concatenate([np.zeros(4800, np.float32), audio, np.zeros(int(16000 * pad_after_s), np.float32)])


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_page_health_and_metrics(client, alex):
    page = client.get("/")
    assert page.status_code == 200 and "getUserMedia" in page.text and "/v1/assistant/ws" in page.text
    assert (
        page.headers["x-frame-options"] == "DENY"
        and "frame-ancestors 'none'" in page.headers["content-security-policy"]
    )
    health = client.get("/health")
    assert health.status_code == 200 and health.json() == {"status": "ok", "llm": True}
    alex.turn("what's my balance")
    assert client.get("/metrics").status_code == 401  # the operator's key, as the admin routes
    metrics = client.get("/metrics", headers=ADMIN).text
    assert 'g4serve_assistant_stage_seconds_bucket{le="0.0002",path="fast",stage="normalize"}' in metrics
    assert "g4serve_assistant_turns_total" in metrics


def test_health_when_the_engine_died():
    """The OpenAI server's /health shape: ``status`` for health checkers, ``error`` for API clients."""
    from types import SimpleNamespace

    assistant = Assistant(demo_bank(), None)
    assistant.engine = SimpleNamespace(dead=RuntimeError("boom"))  # only `dead` is read
    with TestClient(build_app(assistant, access(), warmup=False, owns_engine=False)) as c:
        r = c.get("/health")
    assert r.status_code == 503
    assert r.json() == {
        "status": "unavailable",
        "llm": True,
        "error": {
            "message": "engine is not running: it crashed (RuntimeError)",
            "type": "ServiceUnavailableError",
            "param": None,
            "code": 503,
        },
    }


def test_fast_path_turn(alex):
    body = alex.turn("what's my balance")
    assert body["intent"] == "balance_inquiry" and body["path"] == "fast"
    assert body["needs_confirmation"] is False and body["executed"] is False
    assert "$" in body["reply"]
    for stage in ("normalize", "lookup", "intent", "policy", "total"):
        assert stage in body["stages"], body["stages"]
    assert "llm" not in body["stages"]


def test_transfer_needs_a_confirmation_turn_naming_the_action(client, alex):
    db = client.db
    before = len(db.transfers(status="executed"))
    body = alex.turn("send fifty dollars to John Smith")
    assert (
        body["intent"] == "transfer_money"
        and body["needs_confirmation"] is True
        and body["executed"] is False
    )
    assert body["entities"]["amount_minor"] == 5000 and body["entities"]["currency"] == "USD"
    assert body["entities"]["payee_id"] == "john_smith"
    assert (
        body["pending"]["action_id"] == body["action"]["action_id"]
        and body["pending"]["kind"] == "transfer_money"
    )
    assert any(c["id"] == "john_smith" for c in body["candidates"])
    assert len(db.transfers(status="executed")) == before  # nothing moved yet
    # Another session of the same customer saying "yes" (even naming the action) confirms nothing.
    other_session = alex.new_session()
    other = alex.turn("yes", session_id=other_session, action_id=body["pending"]["action_id"])
    assert other["executed"] is False
    # A yes that names no action, or another one, confirms nothing either.
    for named in (None, "a-forged"):
        r = alex.post(
            "/v1/assistant/turn", {"session_id": alex.session_id, "text": "yes", "action_id": named}
        )
        assert r.json()["executed"] is False and r.json()["refused"] == "confirmation_mismatch"
    assert len(db.transfers(status="executed")) == before
    second = alex.turn("yes")
    assert second["executed"] is True and second["needs_confirmation"] is False
    executed = db.transfers(status="executed")
    assert len(executed) == before + 1
    assert executed[-1]["payee_id"] == "john_smith" and executed[-1]["amount_minor"] == 5000
    audit = alex.audit()
    assert {"normalize", "intent", "policy", "execution", "turn"} <= {e["stage"] for e in audit}
    assert {e["customer_id"] for e in audit} == {DEMO_CUSTOMER_ID}
    assert all(e["client"]["token_id"] for e in audit if e["stage"] == "turn")


def test_gemma_path_for_an_ambiguous_utterance(alex):
    body = alex.turn("send fifty to steven")
    assert body["path"] == "gemma", body
    llm = body["llm"]
    assert llm["valid"] is True and llm["error"] is None
    assert body["entities"].get("payee_id") in [*llm["offered"], None]
    offered_ids = [c["id"] for c in body["candidates"]][: len(llm["offered"])]
    assert llm["offered"] == offered_ids
    assert body["stages"]["llm"] > 0 and "validation" in body["stages"]
    assert body["executed"] is False  # a model never moves money either


def test_qna_streams_and_is_audited(alex):
    with alex.client.stream(
        "POST",
        "/v1/assistant/qna",
        json={"question": "when are your branches open", "max_tokens": 8, "session_id": alex.session_id},
        headers=alex.headers,
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert events[0]["type"] == "documents" and events[0]["documents"][0]["doc_id"] == "branch-hours"
    assert events[-1]["type"] == "done" and events[-1]["path"] == "gemma"
    assert sum(e["type"] == "delta" for e in events) >= 1
    (row,) = [e for e in alex.audit() if e["stage"] == "qna"]
    assert row["outcome"] == "answered" and row["customer_id"] == DEMO_CUSTOMER_ID
    # The turn endpoint answers a question at once from the best document.
    turn = alex.turn("what are your branch hours")
    assert turn["intent"] == "qna" and turn["documents"][0] == "branch-hours" and "9 am" in turn["reply"]


def _wav_with_no_samples() -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
    return out.getvalue()


BAD_TURNS = [
    ({"session_id": None, "text": "hi"}, "session_id"),
    ({"session_id": 7, "text": "hi"}, "session_id"),
    ({"session_id": "", "text": "hi"}, "session_id"),
    ({"session_id": "x" * 200, "text": "hi"}, "session_id"),
    ({}, "text"),
    ({"text": "hi", "audio": "UklGRg=="}, "text"),
    ({"text": ""}, "text"),
    ({"text": ["hi"]}, "text"),
    ({"text": "a" * 5000}, "text"),
    ({"txt": "hi"}, "txt"),
    ({"text": "yes", "action_id": 5}, "action_id"),
    ({"text": "yes", "action_id": "a" * 100}, "action_id"),
    ({"audio": 12}, "audio"),
    ({"audio": "@@not base64@@"}, "audio"),
    ({"audio": b64(b"hello, this is not a wav file")}, "audio"),
    ({"audio": b64(_wav_with_no_samples())}, "audio"),
    ({"audio": ""}, "audio"),
]


@pytest.mark.parametrize(("body", "field"), BAD_TURNS)
def test_bad_turns_are_400_naming_the_field_and_audited(alex, body, field):
    body = {"session_id": alex.session_id, **body}
    if body["session_id"] is None:
        del body["session_id"]
    r = alex.post("/v1/assistant/turn", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["message"].startswith(field), error
    last = alex.client.assistant.audit.entries(limit=1)[0]
    assert (last["stage"], last["outcome"], last["detail"]["status"]) == ("http", "rejected", 400)
    assert last["customer_id"] == DEMO_CUSTOMER_ID  # the token was valid: the attempt is the customer's


def test_other_bad_requests(alex):
    client = alex.client
    r = client.post(
        "/v1/assistant/turn",
        content=b"{not json",
        headers={"content-type": "application/json", **alex.headers},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    r = alex.post("/v1/assistant/turn", ["session_id"])
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    for body, field in [
        ({"session_id": alex.session_id}, "question"),
        ({"question": "  ", "session_id": alex.session_id}, "question"),
        ({"question": "hours", "max_tokens": 0, "session_id": alex.session_id}, "max_tokens"),
        ({"question": "hours", "session_id": 3}, "session_id"),
        ({"question": "hours"}, "session_id"),
    ]:
        r = alex.post("/v1/assistant/qna", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (body, r.text)
    r = client.get("/v1/assistant/audit", headers=alex.headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == "session_id"
    assert client.get("/health").status_code == 200  # still serving


def test_noise_and_silence_get_a_clear_answer(alex):
    rng = np.random.default_rng(0)
    for audio in (np.zeros(16000, np.float32), (0.02 * rng.standard_normal(16000)).astype(np.float32)):
        body = alex.turn(audio=b64(encode_wav(audio)))
        assert body["reply"] == NOT_HEARD_REPLY and body["transcript"] == "" and body["intent"] == "unknown"
        assert body["executed"] is False and "vad" in body["stages"]


@needs_espeak
def test_wav_turn_with_synthesized_speech(alex, tmp_path):
    audio = speech("show my recent transactions", tmp_path)
    body = alex.turn(audio=b64(encode_wav(audio)))
    assert "transactions" in body["transcript"], body["transcript"]
    assert body["intent"] == "recent_transactions" and body["path"] == "fast"
    for stage in ("decode", "vad", "asr_final", "normalize", "intent", "total"):
        assert stage in body["stages"], body["stages"]
    assert body["asr"]["recognizer"].startswith("pocketsphinx")


def ws_auth(ws, customer: Customer, **override) -> dict:
    ws.send_text(
        json.dumps({"type": "auth", "token": customer.token, "session_id": customer.session_id, **override})
    )
    return ws.receive_json()


@needs_espeak
def test_websocket_streams_vad_partials_and_result(alex, tmp_path):
    audio = speech("what's my balance", tmp_path)
    with alex.client.websocket_connect("/v1/assistant/ws") as ws:
        assert ws_auth(ws, alex)["type"] == "ready"
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


def test_websocket_confirmation_names_the_action(client, alex):
    before = len(client.db.transfers(status="executed"))
    with client.websocket_connect("/v1/assistant/ws") as ws:
        assert ws_auth(ws, alex)["type"] == "ready"
        ws.send_text(json.dumps({"type": "text", "text": "send 12 dollars to Tom Wilson"}))
        proposal = ws.receive_json()
        assert proposal["needs_confirmation"] and proposal["pending"]["action_id"]
        ws.send_text(json.dumps({"type": "text", "text": "yes"}))  # names nothing
        assert ws.receive_json()["refused"] == "confirmation_mismatch"
        # The page declares the action it shows; a spoken or typed yes then confirms exactly that one.
        ws.send_text(json.dumps({"type": "action", "action_id": proposal["pending"]["action_id"]}))
        ws.send_text(json.dumps({"type": "text", "text": "yes"}))
        assert ws.receive_json()["executed"] is True
    assert len(client.db.transfers(status="executed")) == before + 1


@pytest.mark.parametrize(
    "first",
    [
        None,  # no auth message: the server closes after its timeout (here: a text turn instead)
        {"type": "text", "text": "send fifty dollars to John Smith"},
        {"type": "auth", "session_id": "S", "token": "forged.token.here"},
        {"type": "auth", "session_id": "made-up", "token": "T"},
    ],
)
def test_websocket_needs_a_token_and_the_customers_session(client, alex, first):
    first = first or {"type": "text", "text": "yes"}
    first = {k: (alex.session_id if v == "S" else alex.token if v == "T" else v) for k, v in first.items()}
    with client.websocket_connect("/v1/assistant/ws") as ws:
        ws.send_text(json.dumps(first))
        msg = ws.receive_json()
        assert msg["type"] == "error" and msg["code"] in (401, 403), msg
        with pytest.raises(WebSocketDisconnect) as closed:
            ws.receive_json()
        assert closed.value.code == 1008


def test_websocket_from_another_origin_is_refused(client, alex):
    """Issue 20's repro: a WebSocket with ``Origin: https://evil.example`` executed a transfer."""
    with pytest.raises(WebSocketDisconnect) as refused:
        with client.websocket_connect("/v1/assistant/ws", headers={"origin": "https://evil.example"}) as ws:
            ws_auth(ws, alex)
    assert refused.value.code == 1008
    last = client.assistant.audit.entries(limit=1)[0]
    assert (last["stage"], last["outcome"], last["client"]["origin"]) == (
        "ws",
        "rejected",
        "https://evil.example",
    )
    with client.websocket_connect("/v1/assistant/ws", headers={"origin": "http://testserver"}) as ws:
        assert ws_auth(ws, alex)["type"] == "ready"  # the app's own page


def test_the_issue_repros_no_longer_move_money(client, alex):
    """Issue 20: a second client reusing a victim's session id answered "yes" and executed a transfer; a
    cross-origin text/plain POST executed one too."""
    before = len(client.db.transfers(status="executed"))
    proposal = alex.turn("send 200 dollars to John Smith")
    action_id = proposal["pending"]["action_id"]
    attempts = [
        # no token at all, with the victim's session id and action id
        dict(json={"session_id": alex.session_id, "text": "yes", "action_id": action_id}),
        # another customer's valid token with the victim's session id
        dict(
            json={"session_id": alex.session_id, "text": "yes", "action_id": action_id},
            headers={"authorization": f"Bearer {Customer(client, 'cust-002').token}"},
        ),
        # a cross-site form post of the victim's browser (simple request: no preflight)
        dict(
            content=json.dumps({"session_id": alex.session_id, "text": "yes", "action_id": action_id}),
            headers={**alex.headers, "content-type": "text/plain", "origin": "https://evil.example"},
        ),
        dict(
            content=json.dumps({"session_id": alex.session_id, "text": "yes", "action_id": action_id}),
            headers={**alex.headers, "content-type": "text/plain"},
        ),
        dict(
            json={"session_id": alex.session_id, "text": "yes", "action_id": action_id},
            headers={**alex.headers, "origin": "https://evil.example"},
        ),
        dict(
            json={"session_id": alex.session_id, "text": "yes", "action_id": action_id},
            headers={**alex.headers, "sec-fetch-site": "cross-site"},
        ),
    ]
    statuses = [client.post("/v1/assistant/turn", **a).status_code for a in attempts]
    assert statuses == [401, 403, 403, 415, 403, 403]
    assert len(client.db.transfers(status="executed")) == before
    rejected = client.assistant.audit.entries(limit=len(attempts))
    assert [r["outcome"] for r in rejected] == ["rejected"] * len(attempts)
    assert [r["detail"]["status"] for r in rejected] == statuses
    assert alex.turn("yes")["executed"] is True  # the victim's own confirmation still works


def test_session_and_audit_reads_are_the_customers_own(client, alex):
    bea = Customer(client, "cust-002")
    alex.turn("what's my balance")
    r = client.get("/v1/assistant/audit", params={"session_id": alex.session_id}, headers=bea.headers)
    assert r.status_code == 403  # another customer's session: no such session for them
    r = client.get("/v1/assistant/audit", params={"session_id": alex.session_id})
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
    r = bea.post("/v1/assistant/qna", {"question": "branch hours", "session_id": alex.session_id})
    assert r.status_code == 403  # issue 20: /qna with any session id wrote into that session's audit
    assert all(e["customer_id"] == DEMO_CUSTOMER_ID for e in alex.audit())
    ended = client.delete(f"/v1/assistant/sessions/{alex.session_id}", headers=alex.headers)
    assert ended.status_code == 200
    r = alex.post("/v1/assistant/turn", {"session_id": alex.session_id, "text": "what's my balance"})
    assert r.status_code == 403


def test_tokens_expire_and_sessions_need_a_token(client):
    signer = client.app.state.gate.access.signer
    expired = jwt.encode(
        {"sub": DEMO_CUSTOMER_ID, "aud": "g4serve-assistant", "iat": 0, "exp": 1, "jti": "j"}, signer._secret
    )
    r = client.post("/v1/assistant/sessions", json={}, headers={"authorization": f"Bearer {expired}"})
    assert r.status_code == 401 and "expired" in r.json()["error"]["message"]
    assert client.post("/v1/assistant/sessions", json={}).status_code == 401
    unknown = signer.mint("cust-999")
    r = client.post("/v1/assistant/sessions", json={}, headers={"authorization": f"Bearer {unknown}"})
    assert r.status_code == 404


def test_admin_routes_need_the_operator_key(client, alex):
    for headers in ({}, alex.headers, {"authorization": "Bearer wrong-key-0123456789"}):
        assert (
            client.post(
                "/v1/assistant/admin/tokens", json={"customer_id": "cust-001"}, headers=headers
            ).status_code
            == 401
        )
        assert client.get("/v1/assistant/admin/audit/verify", headers=headers).status_code == 401
    check = client.get("/v1/assistant/admin/audit/verify", headers=ADMIN).json()
    assert check["ok"] is True and check["rows"] > 0 and len(check["head_hash"]) == 64
    rows = client.get(
        "/v1/assistant/admin/audit", params={"customer_id": "cust-001", "limit": 5}, headers=ADMIN
    )
    assert rows.status_code == 200 and len(rows.json()["entries"]) == 5
    r = client.post(
        "/v1/assistant/admin/tokens", json={"customer_id": "cust-001", "ttl_s": 10**9}, headers=ADMIN
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "ttl_s"


def test_rate_limits_per_customer_and_per_ip():
    assistant = Assistant(demo_bank(), None, recognizer=None)
    app = build_app(
        assistant,
        # Refills of 1 a second: the buckets run dry however slowly the machine runs the requests (at 10 a
        # second for the address, a loaded CI machine refilled it faster than the test drained it).
        access(customer_rate_per_min=60, customer_burst=3, ip_rate_per_min=60, ip_burst=12),
        warmup=False,
    )
    with TestClient(app) as c:
        alex, bea = Customer(c), Customer(c, "cust-002")
        codes = [
            c.post(
                "/v1/assistant/turn",
                json={"session_id": alex.session_id, "text": "balance"},
                headers=alex.headers,
            ).status_code
            for _ in range(4)
        ]
        assert codes == [200, 200, 429, 429]  # the session creation took one of the burst of 3
        r = c.post(
            "/v1/assistant/turn",
            json={"session_id": alex.session_id, "text": "balance"},
            headers=alex.headers,
        )
        assert int(r.headers["retry-after"]) >= 1
        assert bea.turn("what's my balance")["intent"] == "balance_inquiry"  # another customer is unaffected
        codes = [c.get("/v1/assistant/audit", params={"session_id": "x"}).status_code for _ in range(12)]
        assert codes[-1] == 429  # the address's own bucket runs dry, token or not


def test_cors_is_off_by_default_and_configurable():
    assistant = Assistant(demo_bank(), None, recognizer=None)
    with TestClient(build_app(assistant, access(), warmup=False)) as c:
        pre = c.options(
            "/v1/assistant/turn",
            headers={"origin": "https://app.bank.example", "access-control-request-method": "POST"},
        )
        assert "access-control-allow-origin" not in pre.headers
    app = build_app(assistant, access(cors_origins=("https://app.bank.example",)), warmup=False)
    with TestClient(app) as c:
        pre = c.options(
            "/v1/assistant/turn",
            headers={
                "origin": "https://app.bank.example",
                "access-control-request-method": "POST",
                "access-control-request-headers": "authorization,content-type",
            },
        )
        assert pre.headers["access-control-allow-origin"] == "https://app.bank.example"
        assert "access-control-allow-credentials" not in pre.headers
        alex = Customer(c)
        r = c.post(
            "/v1/assistant/turn",
            json={"session_id": alex.session_id, "text": "what's my balance"},
            headers={**alex.headers, "origin": "https://app.bank.example"},
        )
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.bank.example"


def test_test_login_is_off_unless_asked(client):
    assert client.get("/test-login").status_code == 404
    assistant = Assistant(demo_bank(), None, recognizer=None)
    with TestClient(build_app(assistant, access(test_login=True), warmup=False)) as c:
        assert c.get("/test-login").status_code == 200
        token = c.post("/test-login", json={"customer_id": "cust-002"}).json()["token"]
        session = c.post("/v1/assistant/sessions", json={}, headers={"authorization": f"Bearer {token}"})
        assert session.json()["customer_id"] == "cust-002"
        assert c.post("/test-login", json={"customer_id": "nobody"}).status_code == 404


def test_a_lone_surrogate_is_a_400_and_the_audit_stays_readable(alex):
    """Issue 20: text holding "\\ud800" was audited, and that session's audit read answered 500 forever."""
    sid = alex.session_id.encode()
    raw = b'{"session_id": "' + sid + b'", "text": "pay bob \\ud800 fifty dollars"}'
    headers = {"content-type": "application/json", **alex.headers}
    r = alex.client.post("/v1/assistant/turn", content=raw, headers=headers)
    assert r.status_code == 400 and "lone surrogate" in r.json()["error"]["message"]
    question = b'{"session_id": "' + sid + b'", "question": "hours? \\udfff"}'
    r = alex.client.post("/v1/assistant/qna", content=question, headers=headers)
    assert r.status_code == 400
    assert alex.audit() is not None


def test_a_lone_surrogate_over_the_websocket_is_refused_too(client, alex):
    """The WebSocket's text skipped the HTTP body parser's check: the turn ran (proposing the payment), its
    row reached the audit trail, and every read of it, the operator's included, answered 500."""
    with client.websocket_connect("/v1/assistant/ws") as ws:
        assert ws_auth(ws, alex)["type"] == "ready"
        ws.send_text('{"type": "text", "text": "pay \\ud800 fifty dollars to john smith"}')
        msg = ws.receive_json()
        assert msg["type"] == "error" and msg["param"] == "text" and "lone surrogate" in msg["message"]
    assert alex.audit() is not None


class HearsSpeechEverywhere:
    """A VAD that calls all audio speech (music, a stuck microphone): the stream reaches the recogniser."""

    def reset(self):
        self.started = False

    def feed(self, chunk):
        started, self.started = self.started, True
        return [] if started else [VadEvent("start", 0.0)]

    def trim(self, audio):
        return None  # a whole recording: no speech (the recogniser never runs)


class CountingRecognizer:
    """Counts the samples it is given to decode; hears nothing."""

    name = "counting"

    def __init__(self):
        self.samples = 0

    def update_vocabulary(self, vocab):
        pass

    def stream(self):
        return self

    def feed(self, pcm):
        self.samples += pcm.size

    def finish(self):
        return Transcript(text="", recognizer=self.name, audio_s=self.samples / 16000)


def audio_app(**limits) -> tuple[TestClient, Assistant, CountingRecognizer]:
    """An app without a model whose streamed audio always reaches a recogniser that counts it."""
    recognizer = CountingRecognizer()
    assistant = Assistant(demo_bank(), None, recognizer=recognizer)
    assistant.vad = HearsSpeechEverywhere  # one per stream, as the real one
    return TestClient(build_app(assistant, access(**limits), warmup=False)), assistant, recognizer


def pcm_s(seconds: float) -> bytes:
    return np.zeros(round(seconds * 16000), "<i2").tobytes()


def ws_drain(ws) -> list[dict]:
    """The messages the socket sent so far: everything before the answer to a control message of an unknown
    type, which every socket answers (with an error naming ``type``)."""
    ws.send_text(json.dumps({"type": "flush"}))
    messages = []
    while (msg := ws.receive_json()).get("param") != "type":
        messages.append(msg)
    return messages


def test_one_websocket_frame_cannot_bypass_the_utterance_cap():
    """Finding: one 90 s binary frame was transcribed whole (~12 s of the audio thread that every customer's
    speech waits for): the pre-roll handed over at the VAD start was not counted against the 30 s cap. A
    frame over 5 s is now refused and audited before it is decoded, and the socket stays usable."""
    client, assistant, recognizer = audio_app()
    with client as c:
        alex = Customer(c)
        with c.websocket_connect("/v1/assistant/ws") as ws:
            assert ws_auth(ws, alex)["type"] == "ready"
            ws.send_bytes(pcm_s(90))
            (refused,) = ws_drain(ws)
            assert (refused["type"], refused.get("param"), refused.get("code")) == ("error", "audio", 413)
            assert refused["message"].startswith("audio:") and "5 s" in refused["message"]
            assert recognizer.samples == 0
            ws.send_bytes(pcm_s(1))  # frames within the limit are heard as before
            assert ws.receive_json() == {"type": "vad", "event": "start", "t_s": 0.0}
            ws.send_text(json.dumps({"type": "end"}))
            assert ws.receive_json()["reply"] == NOT_HEARD_REPLY
        assert recognizer.samples == 16000
    rows = [r for r in assistant.audit.entries(DEMO_CUSTOMER_ID, alex.session_id) if r["stage"] == "ws"]
    assert [(r["outcome"], r["detail"]["status"]) for r in rows] == [("rejected", 413)]


def test_streamed_audio_is_charged_to_the_customers_rate():
    """Streamed audio cost nothing but its turn: one request's worth of rate bought up to 30 s of decoding,
    over and over. Now every 2 s of audio received costs one request (``audio_s_per_request``)."""
    # 6 a minute, a burst of 3: opening the session takes one, which leaves 4 s of audio; 20 s sent at
    # once cannot all pass, however slowly this machine runs the test (a token refills every 10 s).
    client, _, recognizer = audio_app(customer_rate_per_min=6, customer_burst=3)
    with client as c:
        alex = Customer(c)
        with c.websocket_connect("/v1/assistant/ws") as ws:
            assert ws_auth(ws, alex)["type"] == "ready"
            for _ in range(20):
                ws.send_bytes(pcm_s(1))
            errors = [m for m in ws_drain(ws) if m["type"] == "error"]
            # Reported once per run of refused frames, not once per frame.
            assert [(e["code"], e["param"]) for e in errors] == [(429, "audio")], errors
            assert 4 * 16000 <= recognizer.samples <= 6 * 16000
            ws.send_text(json.dumps({"type": "text", "text": "what's my balance"}))
            assert ws.receive_json()["code"] == 429  # the audio counts towards turns too


def test_uploaded_audio_is_charged_to_the_customers_rate():
    """A WAV turn of 30 s cost one request, as a typed one: 60 a minute bought 30 minutes of decoding."""
    client, _, _ = audio_app(customer_rate_per_min=6, customer_burst=3)
    with client as c:
        alex = Customer(c)
        # The turn takes one request and one was left: its 10 s (5 requests) pass, leaving a debt of 4.
        assert alex.turn(audio=b64(encode_wav(np.zeros(10 * 16000, np.float32))))["reply"] == NOT_HEARD_REPLY
        r = alex.post("/v1/assistant/turn", {"session_id": alex.session_id, "text": "what's my balance"})
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 30


def test_logging_out_cancels_the_pending_transfer(client, alex):
    """Finding: DELETE /v1/assistant/sessions/{id} ended the session, but the transfer it had proposed stayed
    'pending' in the bank. Logging out now cancels it, as a replacing request does, and audits that."""
    proposal = alex.turn("send 30 dollars to Tom Wilson")
    action_id, transfer_id = proposal["pending"]["action_id"], proposal["action"]["transfer_id"]
    assert client.db.transfer(transfer_id)["status"] == "pending"
    r = client.delete(f"/v1/assistant/sessions/{alex.session_id}", headers=alex.headers)
    assert r.status_code == 200 and r.json() == {"session_id": alex.session_id, "ended": True}
    assert client.db.transfer(transfer_id)["status"] == "cancelled"
    yes = {"session_id": alex.session_id, "text": "yes", "action_id": action_id}
    assert alex.post("/v1/assistant/turn", yes).status_code == 403
    with pytest.raises(ValueError):  # and the bank itself will not execute it under the action's key
        client.db.execute_transfer(transfer_id, idempotency_key=action_id)
    assert client.db.transfer(transfer_id)["status"] == "cancelled"
    rows = client.assistant.audit.entries(DEMO_CUSTOMER_ID, alex.session_id)
    assert [(r["event"], r["detail"].get("transfer_id")) for r in rows[-2:]] == [
        ("pending_ended", transfer_id),
        ("session_ended", None),
    ]


def test_admin_imports_need_the_key_and_validate(tmp_path):
    from g4serve_assistant.db import SQLiteBank

    bank = SQLiteBank(tmp_path / "bank.db")
    assistant = Assistant(bank, None, recognizer=None)
    with TestClient(build_app(assistant, access(), warmup=False)) as c:
        customers = (
            "customer_id,name,account_id,account_name,currency,balance_minor\nc-9,Ada,a1,checking,USD,1000\n"
        )
        payees = "payee_id,display_name,relationship\nzed,Zed Newman,friend\n"
        assert c.post("/v1/assistant/admin/import/customers", json={"csv": customers}).status_code == 401
        r = c.post("/v1/assistant/admin/import/customers", json={"csv": customers}, headers=ADMIN)
        assert r.status_code == 200, r.text
        r = c.post(
            "/v1/assistant/admin/import/payees", json={"csv": payees, "customer_id": "c-9"}, headers=ADMIN
        )
        assert r.status_code == 200 and r.json()["imported"] == 1
        bad = c.post(
            "/v1/assistant/admin/import/payees",
            json={"csv": "payee_id,name\nx,y\n", "customer_id": "c-9"},
            headers=ADMIN,
        )
        assert bad.status_code == 400 and "payees.csv: line 1" in bad.json()["error"]["message"]
        assert (
            c.post("/v1/assistant/admin/import/payees", json={"csv": payees}, headers=ADMIN).status_code
            == 400
        )
        assert (
            c.post("/v1/assistant/admin/import/secrets", json={"csv": payees}, headers=ADMIN).status_code
            == 404
        )
        ada = Customer(c, "c-9")
        r = ada.turn("send 5 dollars to Zed Newman")
        assert r["needs_confirmation"] and r["entities"]["payee_id"] == "zed"
        rows = c.get("/v1/assistant/admin/audit", params={"limit": 100}, headers=ADMIN).json()["entries"]
        assert {"import_customers", "import_payees"} <= {r["event"] for r in rows}
