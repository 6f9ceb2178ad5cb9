"""The checks every HTTP request passes before any handler runs: the API key and the body-size limit.

A plain ASGI middleware, not Starlette's ``BaseHTTPMiddleware``: that one wraps ``receive`` so that
``Request.is_disconnected()`` never sees the client go away, and a non-streaming request whose client
disconnected would run to its last token instead of being aborted.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from g4serve.server.config import ServerConfig
from g4serve.server.errors import error_response


def api_key_matches(authorization: str, api_key: str) -> bool:
    """``Authorization: Bearer <api_key>``, compared in constant time (no timing oracle on the key)."""
    return hmac.compare_digest(authorization.encode(), f"Bearer {api_key}".encode())


class GuardMiddleware:
    """API key on every path but /health (and /metrics with --metrics-public); a declared body over
    ``max_request_body_bytes`` is a 413 before anything reads it (``read_json_object`` bounds the rest).
    Each request's task is in ``in_flight`` while it runs, for the graceful shutdown."""

    def __init__(
        self,
        app: ASGIApp,
        config: ServerConfig,
        count_error: Callable[[int], None],
        in_flight: set[asyncio.Task],
    ):
        self.app = app
        self.config = config
        self.count_error = count_error
        self.in_flight = in_flight

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        config = self.config
        if config.api_key and not config.is_public(scope["path"]):
            if not api_key_matches(headers.get("authorization", ""), config.api_key):
                self.count_error(401)
                response = error_response(
                    401, "invalid or missing API key (send 'Authorization: Bearer <key>')"
                )
                await response(scope, receive, send)
                return
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > config.max_request_body_bytes:
            self.count_error(413)
            response = error_response(
                413,
                f"request body of {length} bytes exceeds the limit of {config.max_request_body_bytes} bytes",
            )
            await response(scope, receive, send)
            return
        task = asyncio.current_task()
        self.in_flight.add(task)
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight.discard(task)
