"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with the right HTTP status."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    413: "RequestEntityTooLarge",
    422: "UnprocessableEntityError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
# Messages from the engine and processors start with the field they are about: "max_tokens: ...".
_FIELD_PREFIX = re.compile(r"^([A-Za-z_][\w.\[\]'\"-]*):\s")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param if param is not None else param_of(message)

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param)


def param_of(message: str) -> str | None:
    match = _FIELD_PREFIX.match(message)
    return match.group(1) if match else None


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    error = {"message": message, "type": _TYPES.get(status, "Error"), "param": param, "code": status}
    return {"error": error}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


def health_response(engine: Any, **extra: Any) -> JSONResponse:
    """``GET /health`` of every g4serve app, one shape: ``{"status": "ok", **extra}`` with 200 while
    ``engine`` runs (or is None: an app serving without a model); once ``engine.dead`` is set, a 503 with
    ``"status": "unavailable"`` and ``extra`` beside the usual ``error`` object, so load balancers that
    read ``status`` and OpenAI clients that read ``error.message`` both understand it."""
    dead = getattr(engine, "dead", None)
    if dead is not None:
        body = {"status": "unavailable", **extra, **error_body(503, f"engine is not running: {dead!r}")}
        return JSONResponse(body, status_code=503)
    return JSONResponse({"status": "ok", **extra})


def bad_request(exc: Exception, prefix: str | None = None) -> APIError:
    """A user-input error from the engine or processing layer as a 400, keeping its field name."""
    message = str(exc) or type(exc).__name__
    if prefix and not message.startswith(prefix):
        message = f"{prefix}: {message}"
    return APIError(400, message)


def install_error_handlers(app: FastAPI, count_error: Callable[[int], None], log: logging.Logger) -> None:
    """The error responses of every g4serve app: an ``APIError`` as raised, HTTP errors with their status,
    request validation as a 400, anything else as a logged 500. ``count_error(status)`` sees the
    ``APIError``s and the 500s (the app's error metric)."""

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        count_error(exc.status)
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, str(exc))

    @app.exception_handler(Exception)
    async def _internal_error(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error")
        count_error(500)
        return error_response(500, f"internal error: {type(exc).__name__}")


async def read_json_object(request: Request, max_bytes: int) -> dict:
    """The request body as a JSON object, read in chunks up to ``max_bytes`` (413 past it); malformed JSON
    or another JSON type is a 400 naming ``body``."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise APIError(413, f"request body exceeds the limit of {max_bytes} bytes")
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise APIError(400, f"body: malformed JSON: {exc}", param="body") from None
    if not isinstance(body, dict):
        raise APIError(400, "body: must be a JSON object", param="body")
    return body
