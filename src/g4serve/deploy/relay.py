"""The HTTP edge both routers share: a request's body (read under the limits of ``server.body_budget``, the
server's own) and key, a replica's answer passed on to the client, and what the client sees when the replica
fails or the router waits on a client that left.

Event streams pass through as they arrive, a whole event at a time: if the replica dies mid-stream the
client gets the events sent so far, then an ``error`` event and ``[DONE]`` (the server's own shape for a
failed stream), never half an event. Other answers are read whole first, so a replica that dies before it
finished one becomes a plain 502 rather than a truncated body under a 200.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from g4serve.deploy.affinity import REPLICA_HEADER, AffinityKey, parse_object, payload_affinity
from g4serve.server.body import JsonBodyReader, put_blobs, read_into
from g4serve.server.body_budget import BodyBudget, BodyClaim, BodyLimits
from g4serve.server.errors import APIError
from g4serve.server.guard import LimitedBody, admit_body

# Per-connection headers (RFC 9110 section 7.6.1) and the ones the response object computes itself.
HOP_BY_HOP = frozenset(
    (
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "host",
    )
)
_EVENT_END = b"\n\n"
# What is left of a body to parse past this size is parsed in a worker thread (a body of many short strings,
# which the reader does not shorten), and a body past it joined there (bytes.join lets go of the GIL).
_INLINE_PARSE_BYTES = 256 << 10
_DISCONNECT_POLL_S = 0.5
T = TypeVar("T")


def error_body(status: int, message: str) -> dict[str, Any]:
    """The server's error object (``g4serve.server.errors``), for the statuses only the router gives."""
    kind = {
        400: "BadRequestError",
        408: "RequestTimeoutError",
        413: "RequestEntityTooLarge",
        502: "BadGatewayError",
        503: "ServiceUnavailableError",
    }
    return {"error": {"message": message, "type": kind.get(status, "Error"), "param": None, "code": status}}


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status, headers=headers)


def forwardable(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(name, value) for name, value in headers if name.lower() not in HOP_BY_HOP]


class ClientGone(Exception):
    """The client disconnected while the router waited for the replica."""


async def unless_client_leaves(request: Request, work: Awaitable[T]) -> T:
    """``await work``, cancelled (``ClientGone``) if the client disconnects first: a non-streaming answer
    comes whole at the end, and a replica should not compute minutes of tokens nobody will read
    (cancelling the wait closes the replica's connection, which aborts the request there)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


@dataclass
class ReadBody:
    """A request's body as it is forwarded, and its JSON object as the affinity key reads it: every long
    string without an escape hashed while the body arrived (``server.body``, digesting), so a 20 MB video
    is never parsed, copied or digested whole on the event loop. None: not a JSON object."""

    raw: bytes
    payload: dict | None


async def read_body(request: Request, max_bytes: int) -> ReadBody | None:
    """The request body, or None past ``max_bytes`` (read no further)."""
    chunks, reader = [], JsonBodyReader(digest=True)

    async def kept() -> AsyncIterator[bytes]:  # the chunks, kept for forwarding as they are read
        async for chunk in request.stream():
            chunks.append(chunk)
            yield chunk

    if not await read_into(reader, kept(), max_bytes):
        return None
    text, blobs = await reader.finish()
    # what is left to parse is small unless the body was many short strings (or escaped ones)
    small = len(text) <= _INLINE_PARSE_BYTES
    payload = parse_object(text) if small else await asyncio.to_thread(parse_object, text)
    if not blobs:  # nothing left the text: it is the body, byte for byte
        raw = text
    else:
        raw = await asyncio.to_thread(b"".join, chunks)  # a blob is at least 64 KB: a large join
    return ReadBody(raw, put_blobs(payload, blobs) if payload is not None else None)


class RequestBodies:
    """Reads a router's request bodies under its ``BodyLimits``, with one budget for the process it runs in,
    by the server's own checks (``server.guard``: ``admit_body``, ``LimitedBody``). ``on_refused(status)`` is
    told of each request it answers itself (the standalone router's metrics)."""

    def __init__(self, limits: BodyLimits, on_refused: Callable[[int], None] | None = None):
        self.limits = limits
        self.budget = BodyBudget(limits.max_buffered_body_bytes)
        self.on_refused = on_refused

    @contextlib.asynccontextmanager
    async def held(self, request: Request) -> AsyncIterator[ReadBody | Response]:
        """The body, or the router's own answer: 413 past the per-request cap, 503 past the budget for bodies
        held at once, 408 past the deadline for reading it (a slowloris client), 499 for a client gone. The
        body counts in the budget, from its declared length on, until the block ends."""
        with self.budget.claim() as claim:
            yield await self._read(request, claim)

    async def _read(self, request: Request, claim: BodyClaim) -> ReadBody | Response:
        try:
            admit_body(claim, request.headers, self.limits, "router")
            limited = LimitedBody(request.receive, None, claim, self.limits, "router")
            body = await read_body(
                Request(request.scope, limited.receive), self.limits.max_request_body_bytes
            )
        except APIError as error:
            if self.on_refused is not None:
                self.on_refused(error.status)
            return error_response(error.status, error.message, error.headers)
        except ClientDisconnect:
            return Response(status_code=499)  # nobody reads it
        assert body is not None, "LimitedBody refuses a body past the cap first"
        return body


def request_key(request: Request, body: ReadBody, prefix_chars: int) -> AffinityKey:
    """The request's affinity key. The parsed body is let go: parsed, a body of many short strings is ten
    times its bytes, and only the bytes are needed while the replica answers (minutes, for a long one)."""
    key = payload_affinity(request.headers, lambda: body.payload, prefix_chars)
    body.payload = None
    return key


def replica_failed_event(replica: str, exc: BaseException) -> bytes:
    message = (
        f"replica {replica} failed while streaming this response ({type(exc).__name__}); the response is "
        "incomplete: retry the request"
    )
    return b"data: " + json.dumps(error_body(502, message), separators=(",", ":")).encode() + _EVENT_END


async def whole_events(
    chunks: AsyncIterator[bytes], replica: str, on_failure: Callable[[BaseException], None]
) -> AsyncIterator[bytes]:
    """``chunks`` of an event stream re-cut at event boundaries; a failure of the replica ends the stream
    with an error event and ``[DONE]`` after calling ``on_failure(exc)``."""
    # Searched from the last read on (less one byte: an event's end may straddle two reads): re-searching
    # and re-copying all that is pending took quadratic time for a long event (a 32 MB one: 6.8 s).
    pending = bytearray()
    try:
        async for chunk in chunks:
            if not pending and chunk.endswith(_EVENT_END):  # the usual read: whole events, passed as they are
                yield chunk
                continue
            searched = max(len(pending) - 1, 0)
            pending += chunk
            end = pending.rfind(_EVENT_END, searched)
            if end >= 0:
                complete = bytes(pending[: end + 2])
                del pending[: end + 2]
                yield complete
    except Exception as exc:  # the replica's failure, whatever its transport calls it
        on_failure(exc)
        yield replica_failed_event(replica, exc)
        yield b"data: [DONE]\n\n"
        return
    if pending:
        yield bytes(pending)


def is_event_stream(headers: Iterable[tuple[str, str]]) -> bool:
    return any(
        name.lower() == "content-type" and value.startswith("text/event-stream") for name, value in headers
    )


async def relay(
    request: Request,
    status: int,
    headers: list[tuple[str, str]],
    chunks: AsyncIterator[bytes],
    replica: str,
    on_failure: Callable[[BaseException], None],
    close: Callable[[], Awaitable[None]],
) -> Response:
    """The client's response for a replica's answer that has begun (``status`` and ``headers`` received).
    ``close`` runs once when the answer is over: read whole, failed, or the client went away."""
    passed = [*forwardable(headers), (REPLICA_HEADER, replica)]
    if not is_event_stream(headers):
        try:
            body = await unless_client_leaves(request, _read_all(chunks))
        except ClientGone:
            return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
        except Exception as exc:
            on_failure(exc)
            return error_response(
                502, f"replica {replica} failed before finishing its response ({type(exc).__name__})"
            )
        finally:
            await close()
        response = Response(body, status_code=status)
        _set_headers(response, passed)
        return response
    response = _ClosingStream(whole_events(chunks, replica, on_failure), close, status_code=status)
    _set_headers(response, passed)
    return response


async def _read_all(chunks: AsyncIterator[bytes]) -> bytes:
    return b"".join([chunk async for chunk in chunks])


class _ClosingStream(StreamingResponse):
    """A streaming response that calls ``close`` however it ends, even when the client left before the first
    byte (its body generator then never starts, so a ``finally`` inside it would never run)."""

    def __init__(self, content: AsyncIterator[bytes], close: Callable[[], Awaitable[None]], status_code: int):
        super().__init__(content, status_code=status_code)
        self._close = close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._close()


def _set_headers(response: Response, headers: list[tuple[str, str]]) -> None:
    # raw_headers keeps repeated names (set-cookie) and drops the defaults the constructor put there
    # (a content-type the replica set already).
    names = {name.lower() for name, _ in headers}
    kept = [(k, v) for k, v in response.raw_headers if k.decode("latin-1") not in names]
    response.raw_headers = kept + [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers]
