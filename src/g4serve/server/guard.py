"""The checks every HTTP request passes before any handler runs: the API key, and the limits on request
bodies (the cap per body, the budget over all bodies held at once, the deadline for a body to arrive).

A plain ASGI middleware, not Starlette's ``BaseHTTPMiddleware``: that one wraps ``receive`` so that
``Request.is_disconnected()`` never sees the client go away, and a non-streaming request whose client
disconnected would run to its last token instead of being aborted.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Callable, Mapping

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from g4serve.server.body_budget import BodyBudget, BodyClaim, BodyLimits, OverBudget
from g4serve.server.config import ServerConfig
from g4serve.server.errors import APIError, error_response

# Where a request's ``BodyClaim`` is in its ASGI scope, for ``body_handed_over``.
_CLAIM_KEY = "g4serve.body_claim"


def api_key_matches(authorization: str, api_key: str) -> bool:
    """``Authorization: Bearer <api_key>``, compared in constant time (no timing oracle on the key)."""
    return hmac.compare_digest(authorization.encode(), f"Bearer {api_key}".encode())


def body_handed_over(request: Request) -> None:
    """The request is in the engine: its body stops counting in the budget (``GuardMiddleware``)."""
    claim = request.scope.get(_CLAIM_KEY)
    if claim is not None:
        claim.release()


class GuardMiddleware:
    """API key on every path but /health (and /metrics with --metrics-public); then the request's body,
    under the server's ``BodyLimits``: a declared length over the cap is a 413, and one that does not fit
    in what is left of ``budget`` a 503 with Retry-After, before anything reads it. Each request's task is in
    ``in_flight`` while it runs, for the graceful shutdown.

    The budget counts a body from the request's headers (its declared length at once, a chunked one as it
    arrives) until the request is handed to the engine (``body_handed_over``: the raw bytes and the parsed
    JSON they became are no longer needed, and the engine's own limits bound what the request became), or
    for a request that never gets there, until its answer starts (an error, a route without an engine
    request: no handler reads a body after it answered) or it ends without one (a client gone, an
    exception)."""

    def __init__(
        self,
        app: ASGIApp,
        config: ServerConfig,
        count_error: Callable[[int], None],
        in_flight: set[asyncio.Task],
        budget: BodyBudget,
    ):
        self.app = app
        self.config = config
        self.limits = config.body_limits
        self.count_error = count_error
        self.in_flight = in_flight
        self.budget = budget

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        refusal = self._refusal(scope["path"], headers)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        with self.budget.claim() as claim:
            try:
                claim.grow_to(declared_length(headers) or 0)  # refused before a byte of it is read
            except OverBudget:
                await self._refuse(over_budget(self.budget))(scope, receive, send)
                return
            scope = {**scope, _CLAIM_KEY: claim}
            body = LimitedBody(receive, send, claim, self.limits)
            task = asyncio.current_task()
            self.in_flight.add(task)
            try:
                await self.app(scope, body.receive, body.send)
            finally:
                self.in_flight.discard(task)

    def _refusal(self, path: str, headers: dict[str, str]) -> Response | None:
        """The answer for a request refused on its headers alone, else None."""
        config = self.config
        if config.api_key and not config.is_public(path):
            if not api_key_matches(headers.get("authorization", ""), config.api_key):
                message = "invalid or missing API key (send 'Authorization: Bearer <key>')"
                return self._refuse(APIError(401, message))
        length, cap = declared_length(headers), self.limits.max_request_body_bytes
        if length is not None and length > cap:  # at once, not after reading cap bytes of it
            return self._refuse(
                APIError(413, f"request body of {length} bytes exceeds the limit of {cap} bytes")
            )
        return None

    def _refuse(self, error: APIError) -> Response:
        self.count_error(error.status)
        return error_response(error.status, error.message, None, error.headers)


def declared_length(headers: Mapping[str, str]) -> int | None:
    """The body's Content-Length; None for a chunked body (uvicorn answers a malformed length with a 400)."""
    length = headers.get("content-length")
    return int(length) if length is not None and length.isdigit() else None


def over_budget(budget: BodyBudget) -> APIError:
    # 503, not 429: the server as a whole is short of room, not this client over a rate of its own, and a
    # load balancer in front retries a 503 elsewhere. The connection stays open: uvicorn drops the rest of a
    # body sent whole and the client reads this answer (closing on an unread body can reset the connection
    # before it does).
    return APIError(
        503,
        f"request body: the server's budget for buffered request bodies ({budget.limit_bytes} bytes, "
        "--max-buffered-body-bytes) is taken by other requests; retry later",
        headers={"Retry-After": "1"},
    )


class LimitedBody:
    """A request's ``receive`` with its body under the limits, whoever reads it (a JSON body, a multipart
    form): each chunk grows the request's claim (503 past the budget, 413 past the cap), and every read of
    the body ends by the deadline, counted from the request's headers (408, connection closed). Once the body
    has arrived whole, or the claim was released, ``receive`` is the server's own again (disconnect polls).
    Its ``send`` releases the claim as the answer starts."""

    def __init__(self, receive: Receive, send: Send, claim: BodyClaim, limits: BodyLimits):
        self._receive = receive
        self._send = send
        self.claim = claim
        self.limits = limits
        self.deadline = asyncio.get_running_loop().time() + limits.request_body_timeout_s
        self.size = 0
        self.whole = False

    async def receive(self) -> Message:
        if self.whole or self.claim.released:
            return await self._receive()
        try:
            async with asyncio.timeout_at(self.deadline):
                message = await self._receive()
        except TimeoutError:
            # Closed: left open, uvicorn would go on reading (and dropping) the trickle as long as it came.
            raise APIError(
                408,
                f"request body: the whole request body did not arrive within the server's limit of "
                f"{self.limits.request_body_timeout_s:g} s (--request-body-timeout)",
                headers={"Connection": "close"},
            ) from None
        if message["type"] == "http.request":
            self._grow(len(message.get("body", b"")))
            self.whole = not message.get("more_body", False)
        return message

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.claim.release()
        await self._send(message)

    def _grow(self, chunk_bytes: int) -> None:
        self.size += chunk_bytes
        cap = self.limits.max_request_body_bytes
        if self.size > cap:  # a chunked body (a declared length past it was refused at once)
            raise APIError(413, f"request body exceeds the limit of {cap} bytes")
        try:
            self.claim.grow_to(self.size)
        except OverBudget:
            raise over_budget(self.claim.budget) from None
