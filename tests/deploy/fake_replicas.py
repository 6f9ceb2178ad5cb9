"""ASGI apps served by uvicorn on 127.0.0.1 and a free port from a daemon thread, and fake g4serve replicas:
small apps with g4serve's /health and a chat endpoint that streams, waits or dies on request."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


class Served:
    """``with Served(app) as s: s.url``; uvicorn's own socket on port 0 (``http``: its parser, "auto" takes
    httptools where installed, else h11)."""

    def __init__(self, app, start_timeout_s: float = 20.0, http: str = "auto"):
        self.url = ""
        self.port = 0
        self._timeout_s = start_timeout_s
        config = uvicorn.Config(
            app, host="127.0.0.1", port=0, log_level="critical", timeout_graceful_shutdown=2, http=http
        )
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Served:
        self._thread.start()
        deadline = time.monotonic() + self._timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10)


def fake_replica(name: str) -> FastAPI:
    """A stand-in for ``g4serve serve``: ``app.state.healthy`` sets what /health answers, ``app.state.seen``
    holds the bodies it got, ``app.state.gate`` holds streams that ask to ``wait``. A chat body's
    ``events`` (default 3), ``die_after`` (crash after that event), ``split`` (send each event in two
    writes) and ``wait`` (after the first event, until the gate opens) shape the stream; ``slow`` holds a
    non-streaming answer up to 10 s, counting in ``app.state.abandoned`` a client that left meanwhile."""
    app = FastAPI()
    app.state.healthy = True
    app.state.seen = []
    app.state.abandoned = 0
    app.state.gate = threading.Event()

    @app.get("/health")
    async def health() -> JSONResponse:
        if app.state.healthy:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> JSONResponse:
        return JSONResponse({"replica": name, "requests": len(app.state.seen)})

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        try:
            body = json.loads(await request.body())
            assert isinstance(body, dict)
        except (ValueError, RecursionError, AssertionError):
            return JSONResponse({"error": {"message": "body: malformed JSON", "code": 400}}, status_code=400)
        app.state.seen.append(body)
        if body.get("slow") and await _abandoned(request):  # is the client's disconnect passed on?
            app.state.abandoned += 1
            return JSONResponse({})
        if not body.get("stream"):
            if body.get("die_after") is not None:
                return StreamingResponse(_dying_json(), media_type="application/json")
            return JSONResponse({"replica": name, "echo": body.get("messages")})
        return StreamingResponse(_events(name, body, app.state.gate), media_type="text/event-stream")

    return app


async def _abandoned(request: Request) -> bool:
    for _ in range(200):
        if await request.is_disconnected():
            return True
        await asyncio.sleep(0.05)
    return False


async def _dying_json():
    yield b'{"partial": '
    await asyncio.sleep(0.05)
    raise RuntimeError("replica crashed (fake)")


async def _events(name: str, body: dict, gate: threading.Event):
    for i in range(body.get("events", 3)):
        event = f"data: {json.dumps({'i': i, 'replica': name})}\n\n"
        if body.get("split"):
            yield event[:10]
            await asyncio.sleep(0.02)
            if body.get("die_after") == i:
                raise RuntimeError("replica crashed mid-event (fake)")
            yield event[10:]
        else:
            yield event
        if body.get("die_after") == i:
            await asyncio.sleep(0.02)
            raise RuntimeError("replica crashed (fake)")
        if body.get("wait") and i == 0:
            await asyncio.to_thread(gate.wait, 10)
        await asyncio.sleep(0.01)
    yield "data: [DONE]\n\n"
