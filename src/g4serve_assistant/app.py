"""HTTP and WebSocket front of the voice banking assistant: turns (text or WAV), streamed QnA, streaming audio
with VAD end-pointing, the audit trail, Prometheus metrics and a small web page to talk to it."""

from __future__ import annotations

import contextlib
import json
import logging
from importlib import resources
from typing import Any

import numpy as np
from fastapi import APIRouter, FastAPI, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from g4serve.server.errors import (
    APIError,
    error_response,
    health_response,
    install_error_handlers,
    read_json_object,
)
from g4serve_assistant.audio import AudioError, decode_base64_wav, pcm16_bytes_to_float
from g4serve_assistant.pipeline import Assistant, StageClock
from g4serve_assistant.qna import answer_events

log = logging.getLogger("g4serve_assistant")

MAX_SESSION_ID_CHARS = 128
MAX_TEXT_CHARS = 1000
MAX_QNA_TOKENS = 256
_TURN_FIELDS = {"session_id", "text", "audio"}
_QNA_FIELDS = {"question", "session_id", "max_tokens"}


def _index_html() -> str:
    return (resources.files("g4serve_assistant") / "static" / "index.html").read_text(encoding="utf-8")


def build_app(
    assistant: Assistant,
    *,
    max_request_body_bytes: int = 8 << 20,
    warmup: bool = True,
    owns_engine: bool = True,
) -> FastAPI:
    """The assistant's FastAPI app; the engine (if any) is shut down with it when ``owns_engine``."""

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        if warmup:
            await assistant.warmup()
        yield
        assistant.close()
        if owns_engine and assistant.engine is not None:
            assistant.engine.shutdown()

    app = FastAPI(title="g4serve assistant", version="0.1.0", lifespan=lifespan)
    app.state.assistant = assistant
    metrics = assistant.metrics

    install_error_handlers(app, lambda status: metrics.errors.labels(status=str(status)).inc(), log)

    @app.middleware("http")
    async def _body_limit(request: Request, call_next):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_request_body_bytes:
            metrics.errors.labels(status="413").inc()
            return error_response(
                413, f"request body of {length} bytes exceeds the limit of {max_request_body_bytes} bytes"
            )
        return await call_next(request)

    page = _index_html()

    @app.get("/", response_class=HTMLResponse)
    async def index() -> HTMLResponse:
        return HTMLResponse(page)

    @app.get("/health")
    async def health() -> JSONResponse:
        engine = assistant.engine
        return health_response(engine, llm=engine is not None, payee_version=assistant.db.version)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    app.include_router(assistant_router(assistant, max_request_body_bytes))
    return app


def assistant_router(assistant: Assistant, max_request_body_bytes: int = 8 << 20) -> APIRouter:  # noqa: C901 - route closures of one FastAPI router: every route's request checks count towards the router
    """The ``/v1/assistant`` endpoints, mountable on any FastAPI app (the OpenAI server included)."""
    router = APIRouter()

    async def read_json(request: Request, allowed: set[str]) -> dict:
        body = await read_json_object(request, max_request_body_bytes)
        unknown = sorted(set(body) - allowed)
        if unknown:  # a typo ("txt") would otherwise read as a missing field
            raise APIError(
                400, f"{unknown[0]}: unknown field (expected {', '.join(sorted(allowed))})", param=unknown[0]
            )
        return body

    @router.post("/v1/assistant/turn")
    async def turn(request: Request) -> JSONResponse:
        clock = StageClock()
        body = await read_json(request, _TURN_FIELDS)
        session_id = check_session_id(body.get("session_id"))
        text, audio = body.get("text"), body.get("audio")
        if (text is None) == (audio is None):
            which = "both were given" if text is not None else "neither was given"
            raise APIError(400, f"text: give exactly one of 'text' or 'audio' ({which})", param="text")
        if text is not None:
            if not isinstance(text, str):
                raise APIError(400, f"text: must be a string, got {type(text).__name__}", param="text")
            if not text.strip():
                raise APIError(400, "text: must not be empty", param="text")
            if len(text) > MAX_TEXT_CHARS:
                raise APIError(
                    400, f"text: at most {MAX_TEXT_CHARS} characters, got {len(text)}", param="text"
                )
            result = await assistant.turn(session_id, text=text, clock=clock)
            return JSONResponse(result.to_dict())
        if not isinstance(audio, str):
            raise APIError(
                400, f"audio: must be a base64 WAV string, got {type(audio).__name__}", param="audio"
            )
        try:
            with clock.stage("decode"):
                samples = await assistant.in_audio_thread(decode_base64_wav, audio)
        except AudioError as exc:
            raise APIError(400, str(exc), param="audio") from None
        result = await assistant.turn(session_id, audio=samples, clock=clock)
        return JSONResponse(result.to_dict())

    @router.post("/v1/assistant/qna")
    async def qna(request: Request) -> StreamingResponse:  # noqa: C901 - request checks of the QnA endpoint, one guard per field, plus its SSE generator closure
        body = await read_json(request, _QNA_FIELDS)
        question = body.get("question")
        if not isinstance(question, str) or not question.strip():
            raise APIError(400, "question: required, a non-empty string", param="question")
        if len(question) > MAX_TEXT_CHARS:
            raise APIError(400, f"question: at most {MAX_TEXT_CHARS} characters", param="question")
        session_id = body.get("session_id")
        if session_id is not None:
            check_session_id(session_id)
        max_tokens = body.get("max_tokens", 96)
        if (
            isinstance(max_tokens, bool)
            or not isinstance(max_tokens, int)
            or not 1 <= max_tokens <= MAX_QNA_TOKENS
        ):
            raise APIError(
                400, f"max_tokens: must be an integer in [1, {MAX_QNA_TOKENS}]", param="max_tokens"
            )

        async def events():
            answer: list[str] = []
            done: dict[str, Any] = {}
            try:
                async for event in answer_events(question, assistant.knowledge, assistant.engine, max_tokens):
                    if event["type"] == "delta":
                        answer.append(event["text"])
                    elif event["type"] == "done":
                        done = event
                    yield f"data: {json.dumps(event, separators=(',', ':'))}\n\n"
            except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band
                log.exception("qna stream failed")
                yield f"data: {json.dumps({'type': 'error', 'message': f'{type(exc).__name__}: {exc}'})}\n\n"
            yield "data: [DONE]\n\n"
            assistant.metrics.qna.labels(path=done.get("path", "error")).inc()
            if session_id is not None:
                assistant.db.audit(
                    session_id,
                    "qna",
                    "answer",
                    {"question": question, "answer": "".join(answer), "path": done.get("path")},
                )

        return StreamingResponse(events(), media_type="text/event-stream")

    @router.get("/v1/assistant/audit")
    async def audit(session_id: str | None = None, limit: int = 200) -> JSONResponse:
        session_id = check_session_id(session_id)
        if not 1 <= limit <= 10_000:
            raise APIError(400, "limit: must be in [1, 10000]", param="limit")
        entries = assistant.db.audit_log(session_id)
        return JSONResponse({"session_id": session_id, "entries": entries[-limit:]})

    @router.websocket("/v1/assistant/ws")
    async def stream(ws: WebSocket) -> None:  # noqa: C901 - one websocket receive loop: audio frames and the protocol's end/reset/text control messages
        await ws.accept()
        try:
            session_id = check_session_id(ws.query_params.get("session_id"))
        except APIError as exc:
            await ws.send_json({"type": "error", "message": exc.message, "param": exc.param})
            await ws.close(code=1008)
            return
        await ws.send_json(
            {"type": "ready", "session_id": session_id, "sample_rate": 16000, "format": "pcm_s16le"}
        )
        utterance = assistant.listen()
        try:
            while True:
                message = await ws.receive()
                if message["type"] == "websocket.disconnect":
                    return
                if message.get("bytes") is not None:
                    try:
                        pcm = pcm16_bytes_to_float(message["bytes"])
                    except AudioError as exc:
                        await ws.send_json({"type": "error", "message": str(exc), "param": "audio"})
                        continue
                    if pcm.size == 0:
                        continue
                    events = await assistant.in_audio_thread(utterance.feed, pcm)
                    for event in events:
                        await ws.send_json(event)
                    if utterance.ended:
                        await finish_utterance(ws, session_id, utterance)
                    continue
                try:
                    control = json.loads(message.get("text") or "")
                except json.JSONDecodeError:
                    control = None
                kind = control.get("type") if isinstance(control, dict) else None
                if kind == "end":  # the client stopped talking (push-to-talk release, end of file)
                    await finish_utterance(ws, session_id, utterance)
                elif kind == "reset":
                    utterance.reset()
                elif kind == "text":
                    text = control.get("text")
                    if not isinstance(text, str) or not text.strip() or len(text) > MAX_TEXT_CHARS:
                        await ws.send_json(
                            {
                                "type": "error",
                                "param": "text",
                                "message": f"text: must be a non-empty string of at most {MAX_TEXT_CHARS} "
                                "characters",
                            }
                        )
                        continue
                    result = await assistant.turn(session_id, text=text)
                    await ws.send_json({"type": "result", **result.to_dict()})
                else:
                    await ws.send_json(
                        {
                            "type": "error",
                            "param": "type",
                            "message": (
                                "type: control messages are JSON objects with type 'end', 'reset' or 'text'"
                            ),
                        }
                    )
        except WebSocketDisconnect:
            return

    async def finish_utterance(ws: WebSocket, session_id: str, utterance) -> None:
        heard, clock = await assistant.in_audio_thread(utterance.finish)
        result = await assistant.decide(session_id, heard.text, clock, heard)
        await ws.send_json({"type": "result", **result.to_dict()})

    return router


def check_session_id(value: Any) -> str:
    if value is None:
        raise APIError(400, "session_id: required", param="session_id")
    if not isinstance(value, str) or not value.strip():
        raise APIError(400, "session_id: must be a non-empty string", param="session_id")
    if len(value) > MAX_SESSION_ID_CHARS:
        raise APIError(400, f"session_id: at most {MAX_SESSION_ID_CHARS} characters", param="session_id")
    return value


def pcm16_chunks(audio: np.ndarray, chunk_ms: int = 100) -> list[bytes]:
    """Float 16 kHz audio as the PCM16 chunks a streaming client sends (tests and the benchmark use it)."""
    pcm = (np.clip(np.asarray(audio, dtype=np.float32), -1.0, 1.0) * 32767.0).astype("<i2")
    step = 16 * chunk_ms
    return [pcm[i : i + step].tobytes() for i in range(0, pcm.size, step)]
