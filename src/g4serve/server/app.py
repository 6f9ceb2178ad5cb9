"""The OpenAI-compatible HTTP API over ``AsyncLLMEngine``: the FastAPI application.

``build_app`` wires the parts: the serving objects (``serving_chat.OpenAIServingChat``,
``serving_completion.OpenAIServingCompletion``, ``serving_models.OpenAIServingModels``) on ``app.state``,
the routers of ``routes.py``, the error handlers, and ``guard.GuardMiddleware`` (the API key, checked before
anything reads the body, and the limits on request bodies: their size, the budget for the bodies held at
once, ``app.state.body_budget``, and the deadline for a body to arrive).
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

from g4serve.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestFailedError
from g4serve.server import routes
from g4serve.server.body_budget import BodyBudget
from g4serve.server.config import ServerConfig
from g4serve.server.errors import error_response, install_error_handlers, param_of
from g4serve.server.guard import GuardMiddleware
from g4serve.server.metrics import ServerMetrics
from g4serve.server.response_store import ResponseStore
from g4serve.server.serving_base import WaitingLimit
from g4serve.server.serving_chat import OpenAIServingChat
from g4serve.server.serving_completion import OpenAIServingCompletion
from g4serve.server.serving_models import OpenAIServingLoRA, OpenAIServingModels
from g4serve.server.serving_responses import OpenAIServingResponses
from g4serve.server.serving_speech import OpenAIServingSpeech

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
        watcher = asyncio.create_task(metrics.watch_event_loop())
        yield
        watcher.cancel()
        # Graceful shutdown: let running requests finish (uvicorn stopped accepting new ones); in_flight also
        # holds the background /v1/responses tasks, so they get the same drain and are cancelled after it.
        deadline = time.monotonic() + config.drain_timeout_s
        while in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for task in list(in_flight):
            task.cancel()  # aborts the request in the engine
        engine.shutdown()
        app.state.serving_chat.close()

    app = FastAPI(title="g4serve", version="0.1.0", lifespan=lifespan)
    app.state.engine = engine
    app.state.config = config
    app.state.metrics = metrics
    app.state.body_budget = body_budget = BodyBudget(config.body_limits.max_buffered_body_bytes)
    if config.lora_root is not None and not config.api_key:
        raise ValueError("lora_root: run-time LoRA loading needs an api_key")
    clash = sorted(set(served) & set(engine.lora_names()))
    if clash:
        raise ValueError(f"lora_modules: adapter name {clash[0]!r} is also a served model name")
    app.state.serving_models = models = OpenAIServingModels(
        served, engine.max_model_len, engine.lora_names, config.lora_root
    )
    app.state.serving_lora = OpenAIServingLoRA(engine, models, config.max_request_body_bytes)
    waiting = WaitingLimit(config.max_waiting_requests, engine)  # one queue limit for both endpoints
    app.state.serving_chat = OpenAIServingChat(engine, models, config, metrics, waiting)
    app.state.serving_completion = OpenAIServingCompletion(engine, models, config, metrics, waiting)
    app.state.serving_speech = OpenAIServingSpeech(engine, models, config, metrics, waiting)
    store = ResponseStore(config.responses_store_max_entries, config.responses_store_max_bytes)
    app.state.serving_responses = OpenAIServingResponses(
        engine,
        models,
        config,
        metrics,
        waiting,
        chat=app.state.serving_chat,
        store=store,
        in_flight=in_flight,
    )
    app.include_router(routes.system)
    app.include_router(routes.openai)

    install_error_handlers(app, metrics.observe_error, log)

    @app.exception_handler(EngineDeadError)
    async def _engine_error(_request: Request, exc: EngineDeadError) -> JSONResponse:
        status = 503 if engine.dead is not None else 500
        metrics.observe_error(status)
        return error_response(status, str(exc))

    @app.exception_handler(RequestFailedError)
    async def _request_failed(_request: Request, exc: RequestFailedError) -> JSONResponse:
        metrics.observe_error(exc.status)
        # the client's (4xx) names its field, as an APIError from the same words would
        return error_response(exc.status, str(exc), param_of(str(exc)) if exc.status < 500 else None)

    app.add_middleware(
        GuardMiddleware,
        config=config,
        count_error=metrics.observe_error,
        in_flight=in_flight,
        budget=body_budget,
    )

    return app
