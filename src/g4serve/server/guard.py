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
    """API key on every path but /health (and /metrics with --metrics-public); then the request's body, under
    the server's ``BodyLimits`` (``BodyLimitsMiddleware``, its budget counting a body from its headers). Each
    request's task is in ``in_flight`` while it runs, for the graceful shutdown.

    The budget counts a body until the request is handed to the engine (``body_handed_over``: the raw bytes
    and the parsed JSON they became are no longer needed, and the engine's own limits bound what the request
    became), or for a request that never gets there, until its answer starts (an error, a route without an
    engine request: no handler reads a body after it answered) or it ends without one (a client gone, an
    exception)."""

    def __init__(
        self,
        app: ASGIApp,
        config: ServerConfig,
        count_error: Callable[[int], None],
        in_flight: set[asyncio.Task],
        budget: BodyBudget,
    ):
        self.config = config
        self.count_error = count_error
        self.in_flight = in_flight
        self.bodies = BodyLimitsMiddleware(app, config.body_limits, "server", budget, on_refused=count_error)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.bodies.app(scope, receive, send)
            return
        config = self.config
        if config.api_key and not config.is_public(scope["path"]):
            authorization = next((v for k, v in scope["headers"] if k.lower() == b"authorization"), b"")
            if not api_key_matches(authorization.decode("latin-1"), config.api_key):
                self.count_error(401)
                message = "invalid or missing API key (send 'Authorization: Bearer <key>')"
                await error_response(401, message, None)(scope, receive, send)
                return
        task = asyncio.current_task()
        self.in_flight.add(task)
        try:
            await self.bodies(scope, receive, send)
        finally:
            self.in_flight.discard(task)


class BodyLimitsMiddleware:
    """Every HTTP request's body under ``limits``, whoever reads it (a JSON body, a multipart form, a route of
    its own): a declared length over the cap is a 413 before anything reads it; the bytes of bodies held at
    once count in ``budget`` (503 with Retry-After past it) until the answer starts, or until the handler
    calls ``body_handed_over``; and the whole body must arrive by the deadline (408, connection closed). The
    API server (``GuardMiddleware``) and the assistant run it; ``where`` names the process in its errors.

    ``hold_declared``: a body counts from its headers, at its declared length, so no read can outgrow the
    budget midway. An app whose routes check a token before they read a body (the assistant) counts bytes as
    they are read instead: a declared length alone, from a client without a token, then holds nothing."""

    def __init__(
        self,
        app: ASGIApp,
        limits: BodyLimits,
        where: str,
        budget: BodyBudget | None = None,
        hold_declared: bool = True,
        on_refused: Callable[[int], None] | None = None,
    ):
        self.app = app
        self.limits = limits
        self.where = where
        self.budget = budget if budget is not None else BodyBudget(limits.max_buffered_body_bytes)
        self.hold_declared = hold_declared
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        with self.budget.claim() as claim:
            try:
                admit_body(claim, headers, self.limits, self.where, self.hold_declared)
            except APIError as error:
                if self.on_refused is not None:
                    self.on_refused(error.status)
                await error.response()(scope, receive, send)
                return
            body = LimitedBody(receive, send, claim, self.limits, self.where)
            await self.app({**scope, _CLAIM_KEY: claim}, body.receive, body.send)


def declared_length(headers: Mapping[str, str]) -> int | None:
    """The body's Content-Length; None for a chunked body (uvicorn answers a malformed length with a 400)."""
    length = headers.get("content-length")
    return int(length) if length is not None and length.isdigit() else None


def admit_body(
    claim: BodyClaim, headers: Mapping[str, str], limits: BodyLimits, where: str, hold_declared: bool = True
) -> None:
    """The checks on a body's headers, before a byte of it is read: an ``APIError`` 413 for a declared length
    over the cap, 503 for one that does not fit in what is left of the budget (with ``hold_declared``, which
    holds it in ``claim``)."""
    length = declared_length(headers)
    if length is not None and length > limits.max_request_body_bytes:
        raise body_too_large(limits, where, length)
    if hold_declared and length:
        try:
            claim.grow_to(length)
        except OverBudget:
            raise over_budget(claim.budget, where) from None


def body_too_large(limits: BodyLimits, where: str, length: int | None = None) -> APIError:
    size = f" of {length} bytes" if length is not None else ""
    return APIError(
        413,
        f"request body{size} exceeds the {where}'s limit of {limits.max_request_body_bytes} bytes "
        "(--max-request-body-bytes)",
    )


def over_budget(budget: BodyBudget, where: str) -> APIError:
    # 503, not 429: the process as a whole is short of room, not this client over a rate of its own, and a
    # load balancer in front retries a 503 elsewhere. The connection stays open: uvicorn drops the rest of a
    # body sent whole and the client reads this answer (closing on an unread body can reset the connection
    # before it does).
    return APIError(
        503,
        f"request body: the {where}'s budget for buffered request bodies ({budget.limit_bytes} bytes, "
        "--max-buffered-body-bytes) is taken by other requests; retry later",
        headers={"Retry-After": "1"},
    )


def body_too_slow(limits: BodyLimits, where: str) -> APIError:
    # Closed: left open, uvicorn would go on reading (and dropping) the trickle as long as it came.
    return APIError(
        408,
        f"request body: the whole request body did not arrive within the {where}'s limit of "
        f"{limits.request_body_timeout_s:g} s (--request-body-timeout)",
        headers={"Connection": "close"},
    )


class LimitedBody:
    """A request's ``receive`` with its body under the limits, whoever reads it (a JSON body, a multipart
    form): each chunk grows the request's claim (503 past the budget, 413 past the cap), and every read of
    the body ends by the deadline, counted from the request's headers (408, connection closed). Once the body
    has arrived whole, or the claim was released, ``receive`` is the server's own again (disconnect polls).
    Its ``send`` releases the claim as the answer starts."""

    def __init__(self, receive: Receive, send: Send | None, claim: BodyClaim, limits: BodyLimits, where: str):
        self._receive = receive
        self._send = send
        self.claim = claim
        self.limits = limits
        self.where = where
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
            raise body_too_slow(self.limits, self.where) from None
        if message["type"] == "http.request":
            self._grow(len(message.get("body", b"")))
            self.whole = not message.get("more_body", False)
        return message

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.claim.release()
        assert self._send is not None, "a LimitedBody made without send only receives"
        await self._send(message)

    def _grow(self, chunk_bytes: int) -> None:
        self.size += chunk_bytes
        if self.size > self.limits.max_request_body_bytes:  # chunked (a declared length past it: refused)
            raise body_too_large(self.limits, self.where)
        try:
            self.claim.grow_to(self.size)
        except OverBudget:
            raise over_budget(self.claim.budget, self.where) from None
