"""The OpenAI-compatible HTTP API over ``AsyncLLMEngine``.

``/v1/chat/completions`` and ``/v1/completions`` (streaming and not), ``/v1/models``,
``/health`` and ``/metrics``. Every request is validated before it reaches the engine, so a
bad one costs a 400 naming the field and nothing else; a client that disconnects aborts its
requests, which frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from g4serve.engine.async_engine import AsyncLLMEngine, EngineDeadError, StreamDelta
from g4serve.outputs import Logprob
from g4serve.processing.chat import LocalFile, split_chat_messages
from g4serve.processing.processor import ProcessedPrompt
from g4serve.sampling_params import SamplingParams, SamplingParamsError
from g4serve.server.errors import (
    APIError,
    bad_request,
    error_response,
    health_response,
    install_error_handlers,
    read_json_object,
)
from g4serve.server.metrics import ServerMetrics
from g4serve.server.protocol import ChatCompletionRequest, CompletionRequest, usage

log = logging.getLogger("g4serve.server")

_MIN_LOGPROB = -9999.0  # JSON has no -inf; masked tokens report this floor (as vLLM does)


@dataclass
class ServerConfig:
    served_model_names: list[str]
    api_key: str | None = None
    max_request_body_bytes: int = 64 << 20
    allowed_local_media_path: str | None = None  # local media files allowed only under this directory
    drain_timeout_s: float = 30.0
    limit_mm_per_prompt: dict[str, int] = field(default_factory=dict)


@dataclass
class _Choice:
    """What one completion choice accumulates while its stream runs."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


def build_app(engine: AsyncLLMEngine, config: ServerConfig) -> FastAPI:  # noqa: C901 - one closure holds every route handler; the restructure issue splits it into routers and serving classes
    """The FastAPI application; ``engine`` is shut down with the app."""
    served = config.served_model_names
    metrics = ServerMetrics(engine.stats, served[0])
    inner = engine.engine
    tokenizer = inner.tokenizer
    in_flight: set[asyncio.Task] = set()

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        log.info("serving %s (max_model_len=%d)", ", ".join(served), inner.max_model_len)
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
    app.state.metrics = metrics

    # ---- errors ---------------------------------------------------------------------------------
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

    # ---- plain endpoints -----------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> JSONResponse:
        return health_response(engine, model=served[0])

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict:
        created = int(time.time())
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": created,
                    "owned_by": "g4serve",
                    "root": served[0],
                    "max_model_len": inner.max_model_len,
                }
                for name in served
            ],
        }

    # ---- request parsing ---------------------------------------------------------------------------
    async def read_json(request: Request) -> dict:
        return await read_json_object(request, config.max_request_body_bytes)

    def parse(model: type[BaseModel], body: dict) -> Any:
        try:
            return model.model_validate(body)
        except ValidationError as exc:
            err = exc.errors()[0]
            path = _field_path(err["loc"], body) or "body"
            raise APIError(400, f"{path}: {err['msg']}", param=path) from None

    def check_model(name: str | None) -> str:
        if name is None or name in served:
            return name or served[0]
        raise APIError(
            404, f"model: the model '{name}' does not exist; this server serves {served}", param="model"
        )

    def check_media(media_lists: dict[str, list]) -> None:
        for modality, items in media_lists.items():
            limit = config.limit_mm_per_prompt.get(modality, 0)
            if len(items) > limit:
                raise APIError(
                    400,
                    f"messages: {len(items)} {modality} input(s) exceed the limit of {limit} per "
                    f"prompt (--limit-mm-per-prompt)",
                    param="messages",
                )
            for item in items:
                if isinstance(item, LocalFile):
                    _check_local_path(item.path, config.allowed_local_media_path)

    def sampling_params(req, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if max_tokens is not None and max_tokens <= 0:
            raise APIError(400, f"max_tokens: must be at least 1, got {max_tokens}", param="max_tokens")
        if req.n > 16:
            raise APIError(400, f"n: at most 16 choices per request, got {req.n}", param="n")
        try:
            params = req.sampling_params(max_tokens, logprobs)
        except SamplingParamsError as exc:
            raise bad_request(exc) from None
        spec = _structured_spec(req.response_format)
        if spec is not None:
            params = replace(params, structured_output=spec)
        return params

    async def process(prompt: str | dict, add_special_tokens: bool) -> ProcessedPrompt:
        began = time.monotonic()
        try:
            processed = await engine.process(prompt, add_special_tokens)
        except (ValueError, OSError) as exc:
            raise bad_request(exc) from None
        metrics.preprocess.observe(time.monotonic() - began)
        return processed

    async def validate(processed: ProcessedPrompt, params: SamplingParams) -> None:
        """Run the engine's own admission checks (prompt length, context, grammar) before streaming.

        Off the event loop: a new JSON schema compiles here (about a second on a 262k vocabulary),
        into the grammar cache that the request itself then hits."""
        try:
            await asyncio.get_running_loop().run_in_executor(
                None, inner.make_request, "validate", processed, params
            )
        except ValueError as exc:
            raise bad_request(exc) from None

    # ---- engine streams ----------------------------------------------------------------------------
    def start(processed: ProcessedPrompt, params: SamplingParams, base_id: str, priority: int):
        """One engine stream per choice (``n`` > 1 fans out with seeds seed, seed+1, ...)."""
        if params.n == 1:
            return [engine.generate(processed, params, request_id=base_id, priority=priority)]
        return [
            engine.generate(
                processed,
                replace(params, n=1, seed=None if params.seed is None else params.seed + i),
                request_id=f"{base_id}-{i}",
                priority=priority,
            )
            for i in range(params.n)
        ]

    def record(delta: StreamDelta, received: float) -> None:
        if delta.finished:
            metrics.observe_finished(
                delta.metrics,
                delta.num_prompt_tokens,
                delta.num_output_tokens,
                delta.num_cached_tokens,
                delta.finish_reason,
                received=received,
            )

    async def merged(streams: list, received: float) -> AsyncIterator[tuple[int, StreamDelta]]:
        """Interleave several engine streams; closing this closes (and aborts) all of them. ``received``: when
        the HTTP request reached its handler (``time.monotonic``), for the prepare-time metric."""
        if len(streams) == 1:
            try:
                async for delta in streams[0]:
                    record(delta, received)
                    yield 0, delta
            finally:
                await streams[0].aclose()
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, stream) -> None:
            try:
                async for delta in stream:
                    await queue.put((index, delta))
            except BaseException as exc:  # noqa: BLE001 - forwarded to the consumer
                await queue.put((index, exc))
                raise
            finally:
                await stream.aclose()
                await queue.put((index, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        open_streams = len(tasks)
        try:
            while open_streams:
                index, item = await queue.get()
                if item is None:
                    open_streams -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                record(item, received)
                yield index, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def collect(request: Request, streams: list, n: int, received: float) -> tuple[list[_Choice], int]:
        """Run streams to the end for a non-streaming response; a client disconnect aborts them.

        Returns the choices and the prompt tokens served from the prefix cache."""
        choices = [_Choice() for _ in range(n)]
        cached = 0

        async def consume() -> None:
            nonlocal cached
            async for index, delta in merged(streams, received):
                _accumulate(choices[index], delta)
                cached = delta.num_cached_tokens

        task = asyncio.create_task(consume())
        try:
            while not (await asyncio.wait({task}, timeout=0.25))[0]:
                if await request.is_disconnected():
                    raise APIError(499, "client disconnected")
            task.result()  # re-raises an engine failure
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        return choices, cached

    # ---- chat completions ----------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        received = time.monotonic()
        req: ChatCompletionRequest = parse(ChatCompletionRequest, await read_json(request))
        model_name = check_model(req.model)
        if req.tools:
            raise APIError(400, "tools: tool calling is not supported by this server", param="tools")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
            raise APIError(400, "top_logprobs: must be in [0, 20]", param="top_logprobs")
        try:
            messages, media = split_chat_messages(
                req.messages, allow_local_files=config.allowed_local_media_path is not None
            )
        except ValueError as exc:
            raise bad_request(exc) from None
        check_media(media.as_dict())
        try:
            prompt = tokenizer.apply_chat_template(
                messages, add_generation_prompt=req.add_generation_prompt, **(req.chat_template_kwargs or {})
            )
        except (ValueError, TypeError) as exc:
            raise bad_request(exc, "messages") from None
        except Exception as exc:  # noqa: BLE001 - a template error is the caller's input problem
            raise APIError(
                400, f"messages: the chat template could not be applied: {exc}", "messages"
            ) from None
        params = sampling_params(req, req.effective_max_tokens(), req.num_logprobs())
        processed = await process(
            {"prompt": prompt, "multi_modal_data": media.as_dict()}, add_special_tokens=False
        )
        await validate(processed, params)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = start(processed, params, request_id, req.priority)
        created = int(time.time())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(
                _chat_stream(
                    merged(streams, received),
                    request_id,
                    model_name,
                    created,
                    params.n,
                    include_usage,
                    params.logprobs is not None,
                ),
                media_type="text/event-stream",
            )
        choices, cached = await collect(request, streams, params.n, received)
        return {
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": model_name,
            "choices": [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": "".join(c.text)},
                    "logprobs": _chat_logprobs(c.logprobs) if params.logprobs is not None else None,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                for i, c in enumerate(choices)
            ],
            "usage": usage(len(processed.token_ids), sum(len(c.token_ids) for c in choices), cached),
        }

    # ---- completions ------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(request: Request):
        received = time.monotonic()
        req: CompletionRequest = parse(CompletionRequest, await read_json(request))
        model_name = check_model(req.model)
        if req.suffix:
            raise APIError(400, "suffix: not supported", param="suffix")
        if req.logprobs is not None and not 0 <= req.logprobs <= 20:
            raise APIError(400, "logprobs: must be in [0, 20]", param="logprobs")
        prompts = req.prompts()
        if not prompts or any(p == "" or p == {"prompt_token_ids": []} for p in prompts):
            raise APIError(400, "prompt: must not be empty", param="prompt")
        if len(prompts) * req.n > 256:
            raise APIError(400, "prompt: at most 256 completions per request", param="prompt")
        params = sampling_params(req, req.max_tokens if req.max_tokens is not None else 16, req.logprobs)
        processed_all = []
        for prompt in prompts:
            processed = await process(prompt, add_special_tokens=True)
            await validate(processed, params)
            processed_all.append(processed)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = []
        for p_index, processed in enumerate(processed_all):
            streams += start(processed, params, f"{request_id}-{p_index}", req.priority)
        created = int(time.time())
        prompt_tokens = sum(len(p.token_ids) for p in processed_all)
        echo_texts = [
            p.prompt if p.prompt is not None else tokenizer.decode(p.token_ids) for p in processed_all
        ]
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(
                _completion_stream(
                    merged(streams, received),
                    request_id,
                    model_name,
                    created,
                    prompt_tokens,
                    include_usage,
                    params.logprobs is not None,
                    echo_texts if req.echo else None,
                    params.n,
                ),
                media_type="text/event-stream",
            )
        choices, cached = await collect(request, streams, len(streams), received)
        return {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": model_name,
            "choices": [
                {
                    "index": i,
                    "text": (echo_texts[i // params.n] if req.echo else "") + "".join(c.text),
                    "logprobs": _completion_logprobs(c.logprobs) if params.logprobs is not None else None,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                for i, c in enumerate(choices)
            ],
            "usage": usage(prompt_tokens, sum(len(c.token_ids) for c in choices), cached),
        }

    return app


# ---- helpers ----------------------------------------------------------------------------------------
def _field_path(loc: tuple, body: dict) -> str:
    """pydantic's error location -> the request's field path ("messages.0.content" ->
    "messages[0].content")."""
    parts: list[str] = []
    node: Any = body
    for part in loc:
        if isinstance(part, int):
            parts.append(f"[{part}]")
            node = node[part] if isinstance(node, list) and part < len(node) else None
        elif isinstance(node, dict) and part in node:
            parts.append(("." if parts else "") + part)
            node = node[part]
        elif not parts:
            parts.append(str(part))
            node = None
        # else: a union-branch or type tag pydantic adds ("str", "list[int]"): not a field
    return "".join(parts)


def _check_local_path(path: str, allowed: str | None) -> None:
    if allowed is None:
        raise APIError(
            400,
            "messages: local media files are not allowed (start the server with --allowed-local-media-path)",
            param="messages",
        )
    resolved, root = Path(path).resolve(), Path(allowed).resolve()
    if root != resolved and root not in resolved.parents:
        raise APIError(400, f"messages: {path!r} is outside --allowed-local-media-path", param="messages")
    if not resolved.is_file():
        raise APIError(400, f"messages: local media file {path!r} does not exist", param="messages")


def _structured_spec(response_format: dict | None):
    if response_format is None:
        return None
    from g4serve.structured import StructuredOutputError, StructuredSpec

    try:
        return StructuredSpec.from_response_format(response_format)
    except StructuredOutputError as exc:
        raise bad_request(exc) from None


def _accumulate(choice: _Choice, delta: StreamDelta) -> None:
    choice.text.append(delta.text)
    choice.logprobs.extend(_new_logprobs(choice, delta))
    choice.token_ids.extend(delta.token_ids)
    if delta.finished:
        choice.finish_reason, choice.stop_reason = delta.finish_reason, delta.stop_reason


def _new_logprobs(choice: _Choice, delta: StreamDelta) -> list[dict[int, Logprob]]:
    """The delta's tokens' logprobs (the engine hands over the request's whole list)."""
    if not delta.logprobs:
        return []
    start = len(choice.token_ids)
    return list(delta.logprobs[start : start + len(delta.token_ids)])


def _safe(logprob: float) -> float:
    return max(logprob, _MIN_LOGPROB)


def _token_entry(text: str | None, logprob: float) -> dict[str, Any]:
    text = text or ""
    return {"token": text, "logprob": _safe(logprob), "bytes": list(text.encode("utf-8"))}


def _ranked(entry: dict[int, Logprob]) -> list[Logprob]:
    return [lp for lp in sorted(entry.values(), key=lambda lp: lp.rank or 0) if lp.rank is not None]


def _chat_logprobs(entries: list[dict[int, Logprob]]) -> dict[str, Any]:
    content = []
    for entry in entries:
        chosen = next(iter(entry.values()))
        item = _token_entry(chosen.decoded_token, chosen.logprob)
        item["top_logprobs"] = [_token_entry(lp.decoded_token, lp.logprob) for lp in _ranked(entry)]
        content.append(item)
    return {"content": content}


def _completion_logprobs(entries: list[dict[int, Logprob]]) -> dict[str, Any]:
    tokens, token_logprobs, top, offsets, offset = [], [], [], [], 0
    for entry in entries:
        chosen = next(iter(entry.values()))
        text = chosen.decoded_token or ""
        tokens.append(text)
        token_logprobs.append(_safe(chosen.logprob))
        top.append({lp.decoded_token or "": _safe(lp.logprob) for lp in _ranked(entry)} or None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def _sse_error(exc: BaseException) -> str:
    status = 503 if isinstance(exc, EngineDeadError) else 500
    return _sse(
        {"error": {"message": str(exc), "type": "InternalServerError", "param": None, "code": status}}
    )


async def _sse_events(
    deltas: AsyncIterator[tuple[int, StreamDelta]],
    base: dict,
    include_usage: bool,
    choice_event,
    prompt_tokens: int | None = None,
) -> AsyncIterator[str]:
    """Server-sent events of one response: a chunk per delta that ``choice_event(index, choice, delta,
    new_logprobs)`` turns into a choice (None: nothing to send yet), then usage and ``[DONE]``."""
    extra = {"usage": None} if include_usage else {}
    choices: dict[int, _Choice] = {}
    cached = 0
    try:
        async for index, delta in deltas:
            choice = choices.setdefault(index, _Choice())
            new_logprobs = _new_logprobs(choice, delta)
            event = choice_event(index, choice, delta, new_logprobs)
            _accumulate(choice, delta)
            cached = delta.num_cached_tokens
            if prompt_tokens is None:  # chat: one prompt, shared by the choices
                prompt_tokens = delta.num_prompt_tokens
            if event is not None:
                yield _sse({**base, "choices": [event], **extra})
    except (EngineDeadError, RuntimeError) as exc:
        yield _sse_error(exc)
        yield "data: [DONE]\n\n"
        return
    finally:
        await deltas.aclose()
    if include_usage:
        completion_tokens = sum(len(c.token_ids) for c in choices.values())
        yield _sse({**base, "choices": [], "usage": usage(prompt_tokens or 0, completion_tokens, cached)})
    yield "data: [DONE]\n\n"


def _finish_fields(delta: StreamDelta) -> dict[str, Any]:
    if not delta.finished:
        return {"finish_reason": None}
    return {"finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason}


async def _chat_stream(
    deltas: AsyncIterator[tuple[int, StreamDelta]],
    request_id: str,
    model: str,
    created: int,
    n: int,
    include_usage: bool,
    want_logprobs: bool,
) -> AsyncIterator[str]:
    base = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}
    extra = {"usage": None} if include_usage else {}
    for i in range(n):
        yield _sse(
            {
                **base,
                "choices": [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
                **extra,
            }
        )

    def event(index: int, choice: _Choice, delta: StreamDelta, new_logprobs) -> dict | None:
        if not delta.text and not delta.finished and not (want_logprobs and new_logprobs):
            return (
                None  # held back (a possible stop string) or a token with no text yet, and no logprobs asked
            )
        return {
            "index": index,
            "delta": {"content": delta.text} if delta.text else {},
            "logprobs": _chat_logprobs(new_logprobs) if want_logprobs else None,
            **_finish_fields(delta),
        }

    async for line in _sse_events(deltas, base, include_usage, event):
        yield line


async def _completion_stream(
    deltas: AsyncIterator[tuple[int, StreamDelta]],
    request_id: str,
    model: str,
    created: int,
    prompt_tokens: int,
    include_usage: bool,
    want_logprobs: bool,
    echo: list[str] | None,
    n: int,
) -> AsyncIterator[str]:
    base = {"id": request_id, "object": "text_completion", "created": created, "model": model}

    def event(index: int, choice: _Choice, delta: StreamDelta, new_logprobs) -> dict | None:
        first = not choice.token_ids
        text = (echo[index // n] if echo and first else "") + delta.text
        if not text and not delta.finished and not (want_logprobs and new_logprobs):
            return None
        return {
            "index": index,
            "text": text,
            "logprobs": _completion_logprobs(new_logprobs) if want_logprobs else None,
            **_finish_fields(delta),
        }

    async for line in _sse_events(deltas, base, include_usage, event, prompt_tokens):
        yield line
