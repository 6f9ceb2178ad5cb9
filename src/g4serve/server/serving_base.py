"""What the OpenAI endpoints share (vLLM's ``OpenAIServing``): parsing a body into its pydantic model,
the model name, media limits, sampling parameters, prompt processing, admission, and the engine streams of
a request's choices (merged, or collected for a whole response) and their metrics.

Admission happens once per engine request: ``OpenAIServing.admit`` asks ``AsyncLLMEngine.validate`` (the
engine's own checks: prompt length, context, token ids, grammar) for every choice before anything streams,
and the admitted requests are what ``stream`` adds.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from fastapi import Request
from pydantic import BaseModel, ValidationError

from g4serve.engine.async_engine import RETRY_AFTER_S, AsyncLLMEngine, GrammarCompilerBusy, StreamDelta
from g4serve.processing.processor import ProcessedPrompt
from g4serve.sampling_params import SamplingParams, SamplingParamsError
from g4serve.server.config import ServerConfig
from g4serve.server.errors import APIError, bad_request, read_json_object
from g4serve.server.guard import body_handed_over
from g4serve.server.metrics import ServerMetrics
from g4serve.server.serving_models import OpenAIServingModels
from g4serve.server.streaming import Choice, accumulate

if TYPE_CHECKING:
    from g4serve.engine.request import Request as EngineRequest


# The parameters whose errors may name the engine's output budget, ``max_tokens``.
_BUDGET_PARAMS = ("max_tokens", "min_tokens")
# A whole (not streamed) answer keeps every choice's logprob entries until it is written: the engine's
# ``Logprob`` objects take ~230 bytes an entry (a token with 20 top logprobs 4.9 KB). Past this many
# entries (~1 GB) such a request is refused; 16 choices of 128k tokens with 20 top logprobs would hold 10 GB.
MAX_WHOLE_LOGPROB_ENTRIES = 1 << 22


def check_logprob_entries(
    choices: int,
    max_tokens: int,
    num_logprobs: int | None,
    field: str,
    limit: int = MAX_WHOLE_LOGPROB_ENTRIES,
) -> None:
    """A 400 naming ``field`` when ``choices`` x ``max_tokens`` tokens of ``1 + num_logprobs`` entries each
    pass ``limit``; nothing without logprobs."""
    if num_logprobs is None:
        return
    entries = choices * max_tokens * (1 + num_logprobs)
    if entries > limit:
        raise APIError(
            400,
            f"{field}: {choices} choice(s) x {max_tokens} tokens x {1 + num_logprobs} logprobs each "
            f"({entries} entries) exceed the {limit} one answer holds whole; stream it (stream=true), "
            "or lower the output budget, the choices or the top logprobs",
            field,
        )


@contextlib.contextmanager
def budget_named(field: str | None) -> Iterator[None]:
    """Errors about the output budget name the field the client sent (``field``: chat's
    ``max_completion_tokens``, the Responses API's ``max_output_tokens``; None: it sent ``max_tokens`` or
    none), not ``max_tokens``, the engine's and sampling parameters' name for it."""
    try:
        yield
    except APIError as exc:
        if field is None or exc.param not in _BUDGET_PARAMS:
            raise
        message = re.sub(r"\bmax_tokens\b", field, exc.message)
        param = field if exc.param == "max_tokens" else exc.param
        raise APIError(exc.status, message, param, exc.headers) from None


class WaitingLimit:
    """``--max-waiting-requests``: requests being prepared (tokenized, media decoded, admitted) plus those
    queued in the engine. Past the limit a new request is answered 429 with ``Retry-After`` before its body
    is read, so an overloaded server sheds load at the cost of a header, not of its latency."""

    RETRY_AFTER_S = 1

    def __init__(self, limit: int | None, engine: AsyncLLMEngine):
        self.limit = limit
        self.engine = engine
        self.num_preparing = 0  # the event loop's own count: no lock needed

    @property
    def num_waiting(self) -> int:
        return self.num_preparing + self.engine.num_waiting

    def check(self) -> None:
        if self.limit is not None and self.num_waiting >= self.limit:
            raise APIError(
                429,
                f"server busy: {self.num_waiting} requests are waiting (--max-waiting-requests "
                f"{self.limit}); retry after {self.RETRY_AFTER_S} s",
                headers={"Retry-After": str(self.RETRY_AFTER_S)},
            )

    @contextlib.contextmanager
    def preparing(self) -> Iterator[None]:
        self.num_preparing += 1
        try:
            yield
        finally:
            self.num_preparing -= 1


class OpenAIServing:
    """The base of one endpoint's serving object: its ``create(request)`` turns the HTTP request into
    admitted engine requests and answers with their output, whole or streamed."""

    def __init__(
        self,
        engine: AsyncLLMEngine,
        models: OpenAIServingModels,
        config: ServerConfig,
        metrics: ServerMetrics,
        waiting: WaitingLimit | None = None,
    ):
        self.engine = engine
        self.models = models
        self.config = config
        self.metrics = metrics
        self.tokenizer = engine.tokenizer
        # Shared by the endpoints of one app (build_app passes one); a serving object alone counts its own.
        self.waiting = waiting or WaitingLimit(config.max_waiting_requests, engine)

    # ---- request parsing ---------------------------------------------------------------------------
    async def read(self, request: Request, model: type[BaseModel]) -> Any:
        """The body as ``model``; a full waiting queue answers 429 before the body is even read."""
        self.waiting.check()
        with self.metrics.stage("read"):
            body = await read_json_object(request, self.config.max_request_body_bytes)
            try:
                return model.model_validate(body)
            except ValidationError as exc:
                err = exc.errors()[0]
                path = field_path(err["loc"], body) or "body"
                raise APIError(400, f"{path}: {err['msg']}", param=path) from None

    def check_model(self, name: str | None) -> str:
        return self.models.check_model(name)

    def check_media(self, media_lists: dict[str, list]) -> None:
        for modality, items in media_lists.items():
            limit = self.config.limit_mm_per_prompt.get(modality, 0)
            if len(items) > limit:
                raise APIError(
                    400,
                    f"messages: {len(items)} {modality} input(s) exceed the limit of {limit} per "
                    f"prompt (--limit-mm-per-prompt)",
                    param="messages",
                )

    @staticmethod
    def sampling_params(req, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if max_tokens is not None and max_tokens <= 0:
            raise APIError(400, f"max_tokens: must be at least 1, got {max_tokens}", param="max_tokens")
        if req.n > 16:
            raise APIError(400, f"n: at most 16 choices per request, got {req.n}", param="n")
        try:
            params = req.sampling_params(max_tokens, logprobs)
        except SamplingParamsError as exc:
            raise bad_request(exc) from None
        spec = structured_spec(req.response_format)
        if spec is not None:
            params = replace(params, structured_output=spec)
        return params

    async def process(
        self, prompt: str | dict, add_special_tokens: bool, cache_salt: str | None = None
    ) -> ProcessedPrompt:
        """Tokenize and preprocess off the event loop; a 400 naming the field for bad input. ``cache_salt``:
        the request's, so its KV blocks are shared only with requests of the same salt."""
        if cache_salt is not None:
            prompt = {**({"prompt": prompt} if isinstance(prompt, str) else prompt), "cache_salt": cache_salt}
        began = time.monotonic()
        try:
            with self.waiting.preparing():
                processed = await self.engine.process(prompt, add_special_tokens)
        except (ValueError, OSError) as exc:
            raise bad_request(exc) from None
        self.metrics.preprocess.observe(time.monotonic() - began)
        return processed

    # ---- admission and engine streams ------------------------------------------------------------------
    async def admit(
        self,
        processed: ProcessedPrompt,
        params: SamplingParams,
        base_id: str,
        priority: int,
        model_name: str | None = None,
    ) -> list[EngineRequest]:
        """The engine's admission checks, once per choice (``n`` > 1 fans out with seeds seed, seed+1, ...),
        before anything streams. ``model_name``: the checked ``model`` (a LoRA adapter's name runs the request
        with that adapter). Off the event loop: a new JSON schema compiles here (about a second on a
        262k vocabulary), into the grammar cache the other choices then hit."""
        if params.n == 1:
            children = [(base_id, params)]
        else:
            children = [(f"{base_id}-{i}", params.for_choice(i)) for i in range(params.n)]
        lora_name = self.models.lora_name(model_name) if model_name is not None else None
        try:
            with self.waiting.preparing(), self.metrics.stage("admit"):
                return [
                    await self.engine.validate(
                        processed, child, request_id=rid, priority=priority, lora_name=lora_name
                    )
                    for rid, child in children
                ]
        except ValueError as exc:
            raise bad_request(exc) from None
        except GrammarCompilerBusy as exc:
            raise APIError(429, str(exc), headers={"Retry-After": str(RETRY_AFTER_S)}) from None

    def stream(
        self, requests: list[EngineRequest], http_request: Request
    ) -> list[AsyncIterator[StreamDelta]]:
        """Hand the admitted requests to the engine; from here the HTTP request's body no longer counts in
        the server's budget for buffered bodies (``guard.body_handed_over``)."""
        streams = [self.engine.add(request) for request in requests]
        body_handed_over(http_request)
        return streams

    def record(self, delta: StreamDelta, received: float) -> None:
        if delta.finished:
            self.metrics.observe_finished(
                delta.metrics,
                delta.num_prompt_tokens,
                delta.num_output_tokens,
                delta.num_cached_tokens,
                delta.finish_reason,
                received=received,
            )

    async def merged(self, streams: list, received: float) -> AsyncIterator[tuple[int, StreamDelta]]:
        """Interleave several engine streams; closing this closes (and aborts) all of them. ``received``: when
        the HTTP request reached its handler (``time.monotonic``), for the prepare-time metric."""
        if len(streams) == 1:
            try:
                async for delta in streams[0]:
                    self.record(delta, received)
                    yield 0, delta
            finally:
                await streams[0].aclose()
            return
        queue: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(_pump(i, s, queue)) for i, s in enumerate(streams)]
        open_streams = len(tasks)
        try:
            while open_streams:
                index, item = await queue.get()
                if item is None:
                    open_streams -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                self.record(item, received)
                yield index, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def collect(
        self, request: Request, streams: list, n: int, received: float
    ) -> tuple[list[Choice], int]:
        """Run streams to the end for a non-streaming response; a client disconnect aborts them.

        Returns the choices and the prompt tokens served from the prefix cache."""
        choices = [Choice() for _ in range(n)]
        cached = 0

        async def consume() -> None:
            nonlocal cached
            async for index, delta in self.merged(streams, received):
                accumulate(choices[index], delta)
                cached = delta.num_cached_tokens

        await run_watching_client(request, consume())
        return choices, cached


async def run_watching_client(request: Request, work) -> None:
    """Runs the coroutine ``work`` to its end for a non-streaming answer, asking every 0.25 s whether the
    client is still there: a disconnect cancels it (its streams abort their requests) and is a 499. An
    engine failure inside ``work`` is re-raised."""
    task = asyncio.create_task(work)
    try:
        while not (await asyncio.wait({task}, timeout=0.25))[0]:
            if await request.is_disconnected():
                raise APIError(499, "client disconnected")
        task.result()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def _pump(index: int, stream, queue: asyncio.Queue) -> None:
    try:
        async for delta in stream:
            await queue.put((index, delta))
    except BaseException as exc:  # noqa: BLE001 - forwarded to the consumer
        await queue.put((index, exc))
        raise
    finally:
        await stream.aclose()
        await queue.put((index, None))


# ---- helpers ----------------------------------------------------------------------------------------
def field_path(loc: tuple, body: dict) -> str:
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


def structured_spec(response_format: dict | None):
    if response_format is None:
        return None
    from g4serve.structured import StructuredOutputError, StructuredSpec

    try:
        return StructuredSpec.from_response_format(response_format)
    except StructuredOutputError as exc:
        raise bad_request(exc) from None
