"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with the right HTTP status."""

from __future__ import annotations

import itertools
import json
import logging
import re
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from g4serve import envs
from g4serve.server.body import JsonBodyReader, put_blobs, read_into

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    413: "RequestEntityTooLarge",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
# Messages from the engine and processors start with the field they are about: "max_tokens: ...".
_FIELD_PREFIX = re.compile(r"^([A-Za-z_][\w.\[\]'\"-]*):\s")
# "<foo.Bar object at 0x7f...>" and bare addresses: what a repr leaks about the process, never sent.
_OBJECT_REPR = re.compile(r"<[^<>]{0,200}? at 0x[0-9a-fA-F]+>|\b0x[0-9a-fA-F]{6,}\b")
# JSON bodies nest at most this deep (a chat request with media parts is about 6; a JSON schema rarely 20):
# deeper structures are refused before any code recurses into them.
MAX_JSON_DEPTH = 64
# A JSON text holds at most this many objects, arrays and strings. json.loads makes 60-70 bytes of Python
# objects of each 3-byte "{}," and the shape check below walks them in Python: a 64 MiB body of them took 3 GB
# and 40 s of the event loop (2-core CPU). A chat of 4,096 messages with media parts holds about 50,000.
MAX_JSON_VALUES = 1 << 18
# What starts a value that costs a Python object (a string, an object, an array), strings skipped whole so
# that the brackets inside them do not count.
_VALUE_START = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[{]')
_TEXT_VALUE_START = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[{]')
# An error may quote the client's text (a model name, an unknown field, a format type): its message and
# ``param`` are cut to these lengths, so a 4 MB field never comes back as a 4 MB (or, message and param, 8 MB)
# answer.
MAX_ERROR_MESSAGE_CHARS = 1024
MAX_ERROR_PARAM_CHARS = 256


class APIError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param if param is not None else param_of(message)
        self.headers = headers

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.headers)


def param_of(message: str) -> str | None:
    match = _FIELD_PREFIX.match(message)
    return match.group(1) if match else None


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    message = _cut(_OBJECT_REPR.sub("<object>", message), MAX_ERROR_MESSAGE_CHARS)
    param = None if param is None else _cut(param, MAX_ERROR_PARAM_CHARS)
    error = {"message": message, "type": _TYPES.get(status, "Error"), "param": param, "code": status}
    return {"error": error}


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def error_response(
    status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def health_response(engine: Any, **extra: Any) -> JSONResponse:
    """``GET /health`` of every g4serve app, one shape: ``{"status": "ok", **extra}`` with 200 while
    ``engine`` runs (or is None: an app serving without a model); while ``engine_unavailable`` names a
    reason, a 503 with ``"status": "unavailable"`` and ``extra`` beside the usual ``error`` object, so load
    balancers that read ``status`` and OpenAI clients that read ``error.message`` both understand it."""
    message = engine_unavailable(engine)
    if message is not None:
        body = {"status": "unavailable", **extra, **error_body(503, message)}
        return JSONResponse(body, status_code=503)
    return JSONResponse({"status": "ok", **extra})


def engine_unavailable(engine: Any) -> str | None:
    """Why ``engine`` serves nothing now, safe to show, else None: it stopped (``engine.dead``), or its
    current step has run past ``G4SERVE_STEP_STALL_S`` seconds (a stalled device; 0: never checked).
    ``GET /health`` and Ray Serve's replica health check both ask it."""
    dead = getattr(engine, "dead", None)
    if dead is not None:
        # The engine's own EngineDeadError says why; any other exception's text may hold internals.
        message = str(dead)
        if not message.startswith("engine is not running"):
            message = f"engine is not running: it crashed ({type(dead).__name__})"
        return message
    running = getattr(engine, "step_running_s", None)
    limit = envs.get_float("G4SERVE_STEP_STALL_S")  # read at each check; ``serve`` checked it at start
    seconds = running() if running is not None else 0.0
    if limit > 0 and seconds > limit:
        return f"engine is stalled: its current step has run for {seconds:.0f} s (G4SERVE_STEP_STALL_S)"
    return None


def bad_request(exc: Exception, prefix: str | None = None) -> APIError:
    """A user-input error from the engine or processing layer as a 400, keeping its field name."""
    message = str(exc) or type(exc).__name__
    if prefix and not message.startswith(prefix):
        message = f"{prefix}: {message}"
    return APIError(400, message)


def install_error_handlers(app: FastAPI, count_error: Callable[[int], None], log: logging.Logger) -> None:
    """The error responses of every g4serve app: an ``APIError`` as raised, HTTP errors with their status,
    request validation as a 400, a client gone before its body arrived as a 499, anything else as a logged
    500. ``count_error(status)`` sees the ``APIError``s, the 499s and the 500s (the app's error metric)."""

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        count_error(exc.status)
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(_request: Request, _exc: ClientDisconnect) -> JSONResponse:
        # The client left before its whole body arrived: nobody reads the answer, and nothing failed here
        # (it was a logged 500 with a traceback).
        count_error(499)
        return error_response(499, "client disconnected before sending its whole body")

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        # The first error's field and message; str(exc) would echo the input back.
        errors = exc.errors()
        err = errors[0] if errors else {}
        path = ".".join(str(part) for part in err.get("loc", ()) if part != "body") or "body"
        return error_response(400, f"{path}: {err.get('msg', 'invalid request')}", path)

    @app.exception_handler(Exception)
    async def _internal_error(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error")
        count_error(500)
        return error_response(500, f"internal error: {type(exc).__name__}")


async def read_json_object(request: Request, max_bytes: int) -> dict:
    """The request body as a JSON object, read in chunks up to ``max_bytes`` (413 past it); malformed JSON
    or another JSON type is a 400 naming ``body``. A large body is scanned as it arrives, its base64 media
    decoded on the way (``server.body``), so parsing it never holds the event loop for long."""
    reader = JsonBodyReader()
    if not await read_into(reader, request.stream(), max_bytes):
        raise APIError(413, f"request body exceeds the limit of {max_bytes} bytes")
    text, blobs = await reader.finish()
    return put_blobs(parse_json_object(text), blobs)


def parse_json_object(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> dict:
    """``raw`` as a JSON object nested at most ``max_depth`` deep, of at most ``MAX_JSON_VALUES`` values;
    anything else is a 400 naming ``body``. Deeper or larger structures are refused here, so no later code
    (pydantic, JSON-schema compilers, templates) recurses into them, and json.loads never builds them."""
    if json_values(raw, MAX_JSON_VALUES) > MAX_JSON_VALUES:
        raise APIError(
            400, f"body: more than {MAX_JSON_VALUES} JSON objects, arrays and strings", param="body"
        )
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise APIError(400, f"body: malformed JSON: {exc}", param="body") from None
    except RecursionError:  # the parser itself gave up, far past max_depth
        raise APIError(400, f"body: JSON nested more than {max_depth} levels deep", param="body") from None
    except ValueError:  # an integer literal past Python's 4300-digit conversion limit
        raise APIError(400, "body: a JSON number has too many digits", param="body") from None
    if not isinstance(body, dict):
        raise APIError(400, "body: must be a JSON object", param="body")
    _check_shape(body, "body", "body", max_depth)
    return body


class JsonBudget:
    """The JSON values that the strings ``parse_json_text`` parses for one request may still hold: one
    budget for all of them, as many strings each under the limit would add up to a body it refuses."""

    def __init__(self, values: int = MAX_JSON_VALUES):
        self.values = values


def parse_json_text(
    text: str, where: str, param: str, budget: JsonBudget | None = None, max_depth: int = MAX_JSON_DEPTH
) -> Any:
    """JSON held in a string field (a tool call's ``arguments``) as its value, with the body's own limits:
    nested at most ``max_depth`` deep (``parse_json_object`` cannot see inside a string, and Python's parser
    and the template recurse), valid Unicode, and of at most ``budget``'s values, which it spends. Anything
    else is a 400 naming ``where``."""
    budget = JsonBudget() if budget is None else budget
    budget.values -= json_values(text, budget.values)
    if budget.values < 0:
        raise APIError(
            400, f"{where}: more than {MAX_JSON_VALUES} JSON objects, arrays and strings in all", param
        )
    try:
        value = json.loads(text)
    except RecursionError:
        raise APIError(400, f"{where}: JSON nested more than {max_depth} levels deep", param) from None
    except ValueError:
        raise APIError(400, f"{where}: not valid JSON", param) from None
    _check_shape(value, where, param, max_depth)
    return value


def json_values(text: bytes | str, limit: int) -> int:
    """How many strings, objects and arrays the JSON ``text`` holds, at C speed before anything parses it:
    the count of its quote pairs and opening brackets, an upper bound (those inside strings count too), or
    where that passes ``limit`` the exact count, taken up to ``limit + 1``."""
    marks = ('"', "{", "[") if isinstance(text, str) else (b'"', b"{", b"[")
    bound = text.count(marks[0]) // 2 + text.count(marks[1]) + text.count(marks[2])
    if bound <= limit:
        return bound
    pattern = _TEXT_VALUE_START if isinstance(text, str) else _VALUE_START
    return sum(1 for _ in itertools.islice(pattern.finditer(text), max(limit, 0) + 1))


def _check_shape(value: Any, where: str, param: str, max_depth: int) -> None:
    """A parsed JSON value nested at most ``max_depth`` deep, every string valid Unicode; else a 400."""
    depth, valid = json_shape(value)
    if depth > max_depth:
        raise APIError(400, f"{where}: JSON nested more than {max_depth} levels deep", param)
    if not valid:
        # JSON's "\ud800" escapes decode to lone surrogates, which are no text: they fail whatever encodes
        # them later (a tokenizer, a database row, a response), so they stop here.
        raise APIError(400, f"{where}: a string holds invalid Unicode (a lone surrogate)", param)


def json_shape(value: Any) -> tuple[int, bool]:
    """(how deep lists and dicts nest in ``value``, whether every string and key in it is valid Unicode),
    in one pass without recursing."""
    deepest, valid, stack = 0, True, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            valid = valid and valid_text(node)
            continue
        if isinstance(node, dict):
            valid = valid and all(valid_text(key) for key in node)
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list, str)))
    return deepest, valid


def valid_text(text: str) -> bool:
    """Whether ``text`` is valid Unicode: no lone surrogates, which JSON's "\\ud800" escapes decode to and
    which fail whatever encodes them later (a tokenizer, a database row, a response)."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
