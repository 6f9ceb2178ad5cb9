"""Running g4serve's FastAPI app without an HTTP server: one forwarded request at a time, its response as
the ASGI messages the app sends, and the app's lifespan (start-up, then the drain and engine shutdown).
A Ray Serve engine replica serves its router's handle calls this way, through the very same app (routes,
validation, errors, metrics) that ``g4serve serve`` puts behind uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from starlette.types import ASGIApp, Message


@dataclass(frozen=True)
class ForwardedRequest:
    method: str
    raw_path: str  # as the client sent it, percent-encoding kept
    query: str
    headers: list[tuple[str, str]]
    body: bytes

    def scope(self) -> dict[str, Any]:
        return {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": self.method,
            "scheme": "http",
            "path": unquote(self.raw_path),
            "raw_path": self.raw_path.encode("latin-1", "replace"),
            "root_path": "",
            "query_string": self.query.encode("latin-1", "replace"),
            "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in self.headers],
            "client": ("127.0.0.1", 0),
            "server": ("127.0.0.1", 80),
        }


async def call_app(app: ASGIApp, request: ForwardedRequest) -> AsyncIterator[Message]:
    """The app's ``http.response.*`` messages for ``request``, as it sends them. Closing this generator early
    (the caller went away, or Ray cancelled the call) tells the app its client disconnected, so the engine
    aborts the request and frees its KV blocks."""
    sent: asyncio.Queue[Message | None] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_given = False

    async def receive() -> Message:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await sent.put(message)

    async def run() -> None:
        try:
            await app(request.scope(), receive, send)
        finally:
            await sent.put(None)

    task = asyncio.create_task(run())
    try:
        while (message := await sent.get()) is not None:
            yield message
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                break
        await task  # the app's own exception, if it raised one instead of answering
    finally:
        disconnected.set()
        if not task.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(task, timeout=5.0)


class AppLifespan:
    """Drives an app's ASGI lifespan: ``await start()`` after building it, ``await stop()`` to shut down
    (for g4serve's app: let running requests finish, then shut the engine down)."""

    def __init__(self, app: ASGIApp):
        self.app = app
        self._inbox: asyncio.Queue[Message] = asyncio.Queue()
        self._outbox: asyncio.Queue[Message] = asyncio.Queue()
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self.app({"type": "lifespan"}, self._inbox.get, self._outbox.put))
        await self._exchange("startup")

    async def stop(self) -> None:
        if self._task is None or self._task.done():
            return
        await self._exchange("shutdown")
        await self._task

    async def _exchange(self, phase: str) -> None:
        await self._inbox.put({"type": f"lifespan.{phase}"})
        reply = await self._outbox.get()
        if reply["type"] != f"lifespan.{phase}.complete":
            raise RuntimeError(f"app lifespan {phase} failed: {reply.get('message', reply['type'])}")
