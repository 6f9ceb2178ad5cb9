"""The OpenAI-compatible HTTP API over ``AsyncLLMEngine``: the FastAPI application.

``build_app`` wires the parts: the serving objects (``serving_chat.OpenAIServingChat``,
``serving_completion.OpenAIServingCompletion``, ``serving_models.OpenAIServingModels``) on ``app.state``,
the routers of ``routes.py``, the error handlers, and a middleware that checks the API key and the body
size before anything reads the body.
Every request is validated before it reaches the engine, so a bad one costs a 400 naming the field and
nothing else; a client that disconnects aborts its requests, which frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from g4serve.engine.async_engine import AsyncLLMEngine, EngineDeadError
from g4serve.server import routes
from g4serve.server.config import ServerConfig
from g4serve.server.errors import error_response, install_error_handlers
from g4serve.server.metrics import ServerMetrics
from g4serve.server.serving_chat import OpenAIServingChat
from g4serve.server.serving_completion import OpenAIServingCompletion
from g4serve.server.serving_models import OpenAIServingModels

log = logging.getLogger("g4serve.server")


__all__ = ["ServerConfig", "build_app"]


def build_app(engine: AsyncLLMEngine, config: ServerConfig) -> FastAPI:
    """The FastAPI application; ``engine`` is shut down with the app."""
    served = config.served_model_names
    metrics = ServerMetrics(engine.stats, served[0])
    in_flight: set[asyncio.Task] = set()

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        log.info("serving %s (max_model_len=%d)", ", ".join(served), engine.max_model_len)
        yield
        # Graceful shutdown: let running requests finish (uvicorn stopped accepting new ones).
        deadline = time.monotonic() + config.drain_timeout_s
        while in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for task in list(in_flight):
            task.cancel()  # aborts the request in the engine
        engine.shutdown()

    app = FastAPI(title="g4serve", version="0.1.0", lifespan=lifespan)
    app.state.engine = engine
    app.state.config = config
    app.state.metrics = metrics
    app.state.serving_models = models = OpenAIServingModels(served, engine.max_model_len)
    app.state.serving_chat = OpenAIServingChat(engine, models, config, metrics)
    app.state.serving_completion = OpenAIServingCompletion(engine, models, config, metrics)
    app.include_router(routes.system)
    app.include_router(routes.openai)

    install_error_handlers(app, metrics.observe_error, log)

    @app.exception_handler(EngineDeadError)
    async def _engine_error(_request: Request, exc: EngineDeadError) -> JSONResponse:
        status = 503 if engine.dead is not None else 500
        metrics.observe_error(status)
        return error_response(status, str(exc))

    @app.middleware("http")
    async def _guard(request: Request, call_next):
        """API key for /v1, and a body-size limit checked before anything reads the body."""
        if config.api_key and request.url.path.startswith("/v1"):
            if request.headers.get("authorization", "") != f"Bearer {config.api_key}":
                metrics.observe_error(401)
                return error_response(401, "invalid or missing API key (send 'Authorization: Bearer <key>')")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > config.max_request_body_bytes:
            metrics.observe_error(413)
            return error_response(
                413,
                f"request body of {length} bytes exceeds the limit of {config.max_request_body_bytes} bytes",
            )
        task = asyncio.current_task()
        in_flight.add(task)
        try:
            return await call_next(request)
        finally:
            in_flight.discard(task)

    return app
