"""``POST /v1/responses`` (OpenAI's Responses API), ``GET``/``DELETE /v1/responses/{id}``, its ``cancel``
and ``input_items``. The request becomes chat messages and chat fields, rendered and checked by the chat
endpoint's own code (the oldest turns dropped to fit with ``truncation: "auto"``); the output is parsed by
``Gemma4OutputParser`` into reasoning, message and function_call items, answered whole, as the Responses
event stream, or run as a background task read back with ``GET``. ``previous_response_id`` reads the
bounded ``ResponseStore``."""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from g4serve.engine.async_engine import EngineDeadError
from g4serve.processing.chat import split_chat_messages
from g4serve.processing.processor import ProcessedPrompt
from g4serve.server.errors import APIError
from g4serve.server.gemma4_output import Gemma4OutputParser, ParsedDelta
from g4serve.server.json_body import json_response
from g4serve.server.protocol import ChatCompletionRequest
from g4serve.server.response_store import EventLog, ResponseStore, StoredResponse
from g4serve.server.responses_protocol import ResponsesRequest, input_messages, response_items
from g4serve.server.serving_base import (
    OpenAIServing,
    WaitingLimit,
    budget_named,
    check_logprob_entries,
    run_watching_client,
)
from g4serve.server.serving_chat import MAX_MESSAGES, OpenAIServingChat, chat_logprobs, template_messages

log = logging.getLogger("g4serve.server")

_THOUGHT_STATES = ("label", "reasoning")
_MESSAGE_INDEX = re.compile(r"^messages\[(\d+)\]")
_FINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")
_RUNNING = ("queued", "in_progress")
MAX_LIST_LIMIT = 100  # input_items: OpenAI's page sizes, 1 to 100 (default 20)
# A response is kept whole (its output items, the store, the final event) and written at once, so its
# logprob entries are bounded tighter than a chat answer's: 2^18 entries (12,483 tokens of 20 top logprobs)
# are 20 MB of JSON, 0.4 s to write on the 2-core CPU.
MAX_RESPONSE_LOGPROB_ENTRIES = 1 << 18
# A running background stream keeps its newest events for GET ?stream=true&starting_after=N: at most 1/8 of
# --responses-store-max-bytes of them (32 MiB by default), all running ones together at most the store's
# bytes, and whatever the bytes its newest 32 events: a stream's end comes at once (its open item's done
# events, each holding all of its text and logprobs, then the final event, the whole response: 7 MB for 2,947
# tokens with 20 top logprobs), and a client that follows it gets it whole. Every event was kept before (8.8
# MB for those 2,947 tokens), unbounded until the response was stored, and past the store's bytes it was not
# stored at all.
EVENT_SHARE = 8
KEPT_EVENTS = 32


class _Background:
    """A background response while its task runs: the run (whose ``response`` GET shows), the conversation's
    items, and for a streamed one its newest server-sent events (an ``EventLog``)."""

    def __init__(self, run: _Run, history: list, items: list, events: EventLog | None):
        self.run = run
        self.history = history
        self.items = items
        self.events = events
        self.task: asyncio.Task | None = None
        self.done = False
        self.changed = asyncio.Event()  # replaced on every change; waiters hold the old one

    def wake(self) -> None:
        changed, self.changed = self.changed, asyncio.Event()
        changed.set()


class OpenAIServingResponses(OpenAIServing):
    def __init__(
        self, *args, chat: OpenAIServingChat, store: ResponseStore, in_flight: set | None = None, **kwargs
    ):
        super().__init__(*args, **kwargs)
        self.chat = chat
        self.store = store
        # Background tasks join the app's in-flight set: the shutdown lets them finish within the drain
        # timeout, then cancels them (as it does running HTTP requests).
        self.in_flight: set[asyncio.Task] = in_flight if in_flight is not None else set()
        self.background: dict[tuple[str, str], _Background] = {}
        # Running or queued background responses: as many as the server lets wait (--max-waiting-requests),
        # or the engine's batch (--max-num-seqs) where that limit is off.
        self.max_background = self.config.max_waiting_requests or self.engine.config.max_num_seqs
        self.event_bytes = 0  # the events the running background streams keep, in all
        # Past this, the largest lose their oldest events: the store's bytes, or more while the newest
        # events, kept whatever the budget, fill it (then 1/8 of it later: not a sort of the logs each event).
        self.trim_at = self.store.max_bytes

    # ---- GET / DELETE / cancel / input_items ------------------------------------------------------------
    def _stored(self, request: Request, response_id: str, where: str = "response_id") -> StoredResponse:
        entry = self.store.get(self._owner(request), response_id)
        if entry is None:
            raise APIError(404, f"{where}: no stored response {response_id[:64]!r}", where)
        return entry

    def retrieve(self, request: Request, response_id: str):
        """The response (a running background one as it stands), or with ``?stream=true`` a background
        stream's events after ``starting_after``, then the live ones until it ends."""
        stream = _query_bool(request, "stream")
        after = _query_int(request, "starting_after", -1)
        job = self.background.get((self._owner(request), response_id))
        if job is None:
            entry = self._stored(request, response_id)
            if not stream:
                return Response(entry.body, media_type="application/json")
            events = entry.events
        else:
            if not stream:  # written at once, so as it stands now: no copy needed
                return json_response(job.run.response)
            events = job.events
        if events is None:
            raise APIError(
                400,
                f"stream: response {response_id[:64]!r} was not created with background=true and "
                "stream=true: it has no events to stream",
                "stream",
            )
        if after + 1 < events.first:
            raise APIError(400, _dropped(events.first), "starting_after")
        return StreamingResponse(_replay(events, after, job), media_type="text/event-stream")

    async def delete(self, request: Request, response_id: str) -> dict[str, Any]:
        owner = self._owner(request)
        job = self.background.get((owner, response_id))
        if job is not None:  # a running background response: stopped, then forgotten
            await _cancelled(job)
        self._stored(request, response_id)
        self.store.delete(owner, response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    async def cancel(self, request: Request, response_id: str) -> Response:
        """Cancel a background response: its engine request is aborted (its KV blocks freed), and it is kept
        ``cancelled`` with the output so far. Cancelling it again answers the same; a finished or a
        foreground response is a 400."""
        job = self.background.get((self._owner(request), response_id))
        if job is not None:
            await _cancelled(job)
            return json_response(job.run.response)
        entry = self._stored(request, response_id)
        response = entry.response
        if not response.get("background"):
            raise APIError(
                400,
                "response_id: only a response created with background=true can be cancelled",
                "response_id",
            )
        if response["status"] != "cancelled":
            raise APIError(
                400,
                f"response_id: cannot cancel a response that has finished (status {response['status']!r})",
                "response_id",
            )
        return Response(entry.body, media_type="application/json")

    def input_items(self, request: Request, response_id: str) -> Response:
        """The items of the conversation that led to the response (earlier turns' inputs and outputs with
        ``previous_response_id``, then this request's input), in OpenAI's list shape and paging."""
        job = self.background.get((self._owner(request), response_id))
        items = job.items if job is not None else self._stored(request, response_id).items
        limit = _query_int(request, "limit", 20)
        if not 1 <= limit <= MAX_LIST_LIMIT:
            raise APIError(400, f"limit: must be between 1 and {MAX_LIST_LIMIT}", "limit")
        order = request.query_params.get("order", "desc")
        if order not in ("asc", "desc"):
            raise APIError(400, "order: must be 'asc' or 'desc'", "order")
        ordered = items if order == "asc" else items[::-1]
        start = 0
        after = request.query_params.get("after")
        if after is not None:
            start = next((i + 1 for i, item in enumerate(ordered) if item.get("id") == after), None)
            if start is None:
                raise APIError(400, f"after: no item {after[:64]!r} in this response's input", "after")
        page = ordered[start : start + limit]
        return json_response(
            {
                "object": "list",
                "data": page,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": start + limit < len(ordered),
            }
        )

    @staticmethod
    def _owner(request: Request) -> str:
        return ResponseStore.owner(request.headers.get("authorization"))

    # ---- POST ------------------------------------------------------------------------------------------
    async def create(self, request: Request):
        received = time.monotonic()
        req: ResponsesRequest = await self.read(request, ResponsesRequest)
        req.check()
        model_name = self.check_model(req.model)
        owner = self._owner(request)
        if req.background:
            self._check_background_room()
        history: list[dict[str, Any]] = []
        items: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            previous = self._previous(owner, req.previous_response_id)
            history = list(previous.history)
            items = [*previous.items, *previous.response["output"]]
        known_calls = {
            c["id"]: c["function"]["name"] for m in history for c in m.get("tool_calls") or () if "id" in c
        }
        turn = input_messages(req.input, known_calls)
        items += response_items(req.input, {item["id"] for item in items})
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        chat_req = self._chat_request(req)
        tools, forced = self.chat.tool_plan(chat_req)
        thinking = self.chat.thinking(chat_req)
        budget = "max_output_tokens" if req.max_output_tokens is not None else None
        with budget_named(budget):
            params = self.sampling_params(chat_req, req.max_output_tokens, req.num_logprobs())
        # As in chat: with thinking on, a grammar (text.format, a forced call) waits for the thought to close.
        params, _ = self.chat.reasoning_plan(chat_req, params, thinking)
        # The markers must reach the parser; it keeps every special token out of the answer.
        params = replace(params, skip_special_tokens=False)
        params = OpenAIServingChat.force_call(params, forced, "text.format")
        specials = frozenset(self.tokenizer.convert_ids_to_tokens(self.tokenizer.special_token_ids)) - {None}
        parse_tools = bool(tools) and chat_req.tool_choice != "none"
        prompt = _Prompt(system, history, turn, chat_req, tools, thinking)
        processed = await self._fit(prompt, req)
        room = self.engine.max_model_len - len(processed.token_ids)
        check_logprob_entries(
            1,
            min(req.max_output_tokens or room, room),
            params.logprobs,
            "top_logprobs",
            MAX_RESPONSE_LOGPROB_ENTRIES,
        )
        response_id = f"resp_{uuid.uuid4().hex}"
        with budget_named(budget):
            admitted = await self.admit(processed, params, response_id, 0, model_name)
        if req.background:
            self._check_background_room()  # again: others may have started while this one was prepared
        streams = self.stream(admitted, request)
        run = _Run(
            _skeleton(req, response_id, model_name),
            Gemma4OutputParser(specials, parse_tools),
            len(processed.token_ids),
            self.merged(streams, received),
            raise_errors=not (req.stream or req.background),
            want_logprobs=params.logprobs is not None,
            special_tokens=specials,
        )
        conversation = [*history, *turn]
        if req.background:
            return self._start_background(owner, run, conversation, items, req.stream)
        if req.store:

            def on_done(response: dict[str, Any]) -> None:
                self.store.put(owner, response, _history(conversation, response), items)

            run.on_done = on_done
        if req.stream:
            return StreamingResponse(_sse(run.events()), media_type="text/event-stream")
        return await self._whole(request, run.events())

    def _previous(self, owner: str, response_id: str) -> StoredResponse:
        if (owner, response_id) in self.background:
            raise APIError(
                400,
                f"previous_response_id: response {response_id[:64]!r} is still running in the background; "
                "wait until GET /v1/responses/{id} shows it finished",
                "previous_response_id",
            )
        entry = self.store.get(owner, response_id)
        if entry is None:
            raise APIError(
                404, f"previous_response_id: no stored response {response_id[:64]!r}", "previous_response_id"
            )
        return entry

    def _chat_request(self, req: ResponsesRequest) -> ChatCompletionRequest:
        """The chat fields this request amounts to, for the chat endpoint's own checks and rendering."""
        fields: dict[str, Any] = {
            "messages": [],
            "model": req.model,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "tools": req.chat_tools(),
            "tool_choice": req.chat_tool_choice(),
            "parallel_tool_calls": req.parallel_tool_calls,
            "reasoning_effort": req.effort,
            "response_format": req.response_format(),
            "cache_salt": req.cache_salt,
        }
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
        except ValidationError as exc:
            err = exc.errors()[0]
            raise APIError(400, f"{err['loc'][0]}: {err['msg']}", str(err["loc"][0])) from None

    # ---- the prompt, and truncation ---------------------------------------------------------------------
    async def _fit(self, prompt: _Prompt, req: ResponsesRequest) -> ProcessedPrompt:
        """The processed prompt of the whole conversation when it fits ``max_model_len`` with the output
        budget (``max_output_tokens``, else one token); otherwise, with ``truncation: "auto"``, of the
        longest tail of whole turns that fits (a binary search over the turns' starts: each try renders and
        tokenizes). A conversation that does not fit, or whose last turn alone does not, is a 400 naming
        ``input``."""
        limit = self.engine.max_model_len
        budget = req.max_output_tokens or 1
        if budget >= limit:
            raise APIError(
                400,
                f"max_output_tokens: {budget} leaves no room for the input within max_model_len={limit}",
                "max_output_tokens",
            )
        budget_text = f"max_output_tokens={budget}" if req.max_output_tokens else "one output token"
        whole, size = await self._try(prompt, 0, limit - budget)
        if whole is not None:
            return whole
        advice = "shorten it, lower max_output_tokens, or set truncation to 'auto' to drop the oldest turns"
        if req.truncation != "auto":
            raise APIError(
                400,
                f"input: the conversation ({size}) and {budget_text} exceed max_model_len={limit}: {advice}",
                "input",
            )
        starts = prompt.turn_starts()
        last, size = (None, size) if not starts else await self._try(prompt, starts[-1], limit - budget)
        if last is None:
            raise APIError(
                400,
                f"input: even the last turn alone ({size}) and {budget_text} exceed max_model_len={limit}, "
                "so truncation 'auto' cannot make it fit",
                "input",
            )
        low, high, best = 0, len(starts) - 1, last  # starts[high] fits; find the first start that does
        while low < high:
            middle = (low + high) // 2
            processed, _ = await self._try(prompt, starts[middle], limit - budget)
            if processed is None:
                low = middle + 1
            else:
                high, best = middle, processed
        log.debug("responses: truncation dropped %d of %d messages", starts[high], len(prompt.conversation))
        return best

    async def _try(self, prompt: _Prompt, start: int, max_tokens: int) -> tuple[ProcessedPrompt | None, str]:
        """(the processed prompt of the conversation from message ``start`` on, or None where it is longer
        than ``max_tokens``; its size in words)."""
        kept = prompt.kept(start)
        count = len(prompt.system) + len(kept)
        # More than one prompt takes: as a conversation that does not fit, known before its messages are
        # split and checked (a 100,000-item input split ~17 times by the truncation search held the loop 2 s).
        if count > MAX_MESSAGES:
            return None, f"{count} messages, over the {MAX_MESSAGES} a prompt takes"
        messages, media = await self._split(prompt, kept)
        text = await self.chat.render(prompt.chat_req, messages, prompt.tools, prompt.thinking)
        try:
            processed = await self.process(
                {"prompt": text, "multi_modal_data": media.as_dict()}, False, prompt.chat_req.cache_salt
            )
        except APIError as exc:
            if exc.message.startswith("prompt:") and "cannot fit" in exc.message:  # refused before tokenizing
                return None, f"{len(text)} characters"
            raise
        size = len(processed.token_ids)
        return (processed if size <= max_tokens else None), f"{size} tokens"

    async def _split(self, prompt: _Prompt, kept: list[int]):
        """Chat messages ready for the template (the conversation's messages ``kept``), and their media,
        checked as the chat endpoint checks them; an error names the Responses field
        (``input[2].content[1]...``), not the chat message."""
        messages = [*prompt.system, *(prompt.conversation[i] for i in kept)]
        first_input = len(prompt.history)

        def rename(match: re.Match) -> str:
            index = int(match.group(1)) - len(prompt.system)
            if index < 0:
                return "instructions"
            original = kept[index]
            return f"input[{original - first_input}]" if original >= first_input else "previous_response_id"

        try:
            root = self.config.allowed_local_media_path
            messages, media = split_chat_messages(
                messages, allow_local_files=root is not None, local_media_root=root, allow_objects=False
            )
        except ValueError as exc:
            raise APIError(400, _MESSAGE_INDEX.sub(rename, str(exc)), "input") from None
        try:
            self.check_media(media.as_dict())
        except APIError as exc:
            raise APIError(exc.status, exc.message.replace("messages:", "input:", 1), "input") from None
        try:  # off the event loop, as chat does it
            messages = await asyncio.to_thread(template_messages, messages)
        except APIError as exc:
            raise APIError(400, _MESSAGE_INDEX.sub(rename, exc.message), "input") from None
        return messages, media

    # ---- running it -------------------------------------------------------------------------------------
    async def _whole(self, request: Request, events: AsyncIterator[dict]) -> Response:
        """Run the events to the end for a non-streaming answer; a client disconnect aborts the request."""
        final: dict[str, Any] = {}

        async def consume() -> None:
            async for event in events:
                if event["type"] in _FINAL_EVENTS:
                    final.update(event["response"])

        await run_watching_client(request, consume())
        return json_response(final)

    def _check_background_room(self) -> None:
        if len(self.background) >= self.max_background:
            retry = WaitingLimit.RETRY_AFTER_S
            raise APIError(
                429,
                f"background: {len(self.background)} background responses are running, the server's limit "
                f"(--max-waiting-requests, or --max-num-seqs without it); retry after {retry} s",
                "background",
                headers={"Retry-After": str(retry)},
            )

    def _start_background(self, owner: str, run: _Run, conversation: list, items: list, stream: bool):
        """Run the response as a server task, not tied to this connection; answer at once (queued), or with
        ``stream`` the events as they come (a dropped connection resumes with GET ``?stream=true``)."""
        key = (owner, run.response["id"])
        job = _Background(run, conversation, items, EventLog() if stream else None)
        queued = copy.deepcopy(run.response)

        async def drive() -> None:
            async for event in run.events():
                self._emit(job, event)

        job.task = task = asyncio.create_task(drive(), name=f"g4-background-{key[1]}")
        self.background[key] = job
        self.in_flight.add(task)
        task.add_done_callback(lambda t: self._background_done(owner, key, job, t))
        if stream:
            return StreamingResponse(_replay(job.events, -1, job), media_type="text/event-stream")
        return queued

    def _emit(self, job: _Background, event: dict[str, Any]) -> None:
        """Keep a streamed job's event (its oldest dropped past its share, and past the budget of all), and
        wake its readers."""
        log = job.events
        if log is not None:
            line = _sse_line(event, log.end)
            log.append(line)
            self.event_bytes += len(line) - log.trim(self.store.max_bytes // EVENT_SHARE, KEPT_EVENTS)
            if self.event_bytes > self.trim_at:
                self._trim_largest()
        job.wake()

    def _trim_largest(self) -> None:
        """The running streams together keep more than the store's bytes: the largest lose their oldest events
        first, all of them down to one level, until 7/8 of the budget is left (so this runs once per 1/8)."""
        target = self.store.max_bytes - self.store.max_bytes // EVENT_SHARE
        logs = sorted(
            (job.events for job in self.background.values() if job.events is not None),
            key=lambda log: log.num_bytes,
            reverse=True,
        )
        level = _level([log.num_bytes for log in logs], target)
        for log in logs:
            if log.num_bytes <= level:
                break
            self.event_bytes -= log.trim(level, KEPT_EVENTS)
        self.trim_at = max(self.store.max_bytes, self.event_bytes + self.store.max_bytes // EVENT_SHARE)

    def _background_done(
        self, owner: str, key: tuple[str, str], job: _Background, task: asyncio.Task
    ) -> None:
        """The task ended (finished, cancelled, or failed in our code): the response gets its final state and
        moves from the running set to the store."""
        self.in_flight.discard(task)
        run = job.run
        if run.response["status"] in _RUNNING:
            if task.cancelled():
                events = run.cancel()
            else:
                exc = task.exception()
                log.error("background response %s failed", key[1], exc_info=exc)
                events = run.fail(f"internal error ({type(exc).__name__})")
            for event in events:
                self._emit(job, event)
        if job.events is not None:
            self.event_bytes -= job.events.num_bytes
            self.trim_at = max(self.store.max_bytes, self.trim_at - job.events.num_bytes)
        self.store.put(owner, run.response, _history(job.history, run.response), job.items, job.events)
        self.background.pop(key, None)
        job.done = True
        job.wake()


class _Prompt:
    """What the prompt is rendered from: the instructions' system turn, the earlier turns' messages
    (``previous_response_id``), this request's and the chat fields."""

    def __init__(
        self, system: list, history: list, turn: list, chat_req: ChatCompletionRequest, tools, thinking
    ):
        self.system = system
        self.history = history
        self.conversation = [*history, *turn]
        self.chat_req = chat_req
        self.tools = tools
        self.thinking = thinking

    def kept(self, start: int) -> list[int]:
        """The messages a prompt from message ``start`` on holds: those from there, and system ones."""
        return [i for i, m in enumerate(self.conversation) if i >= start or m.get("role") == "system"]

    def turn_starts(self) -> list[int]:
        """The messages (after the first) at which truncation may cut: a user message (so whole turns go),
        after which no function output answers a call made before it."""
        conversation = self.conversation
        declared: dict[str, int] = {}
        call_of: list[int | None] = []  # a tool message's call: the message that made it
        for j, message in enumerate(conversation):
            for call in message.get("tool_calls") or ():
                declared[call.get("id")] = j
            call_of.append(
                declared.get(message.get("tool_call_id"), j) if message["role"] == "tool" else None
            )
        starts, earliest_call = [], len(conversation)
        for i in range(len(conversation) - 1, 0, -1):
            if call_of[i] is not None:
                earliest_call = min(earliest_call, call_of[i])
            if conversation[i]["role"] == "user" and earliest_call >= i:
                starts.append(i)
        return starts[::-1]


async def _cancelled(job: _Background) -> None:
    """Cancel a background task and wait until it has ended (its engine request aborted)."""
    job.task.cancel()
    await asyncio.wait({job.task})


def _level(sizes: list[int], target: int) -> int:
    """The level to cut ``sizes`` (largest first) down to so that they sum to at most ``target``."""
    total, top = sum(sizes), 0
    for k, size in enumerate(sizes, 1):
        top += size
        below = sizes[k] if k < len(sizes) else 0
        if total - top + k * below <= target:  # cutting the k largest to `below` is enough
            return max((target - (total - top)) // k, below)
    return 0


def _dropped(first: int) -> str:
    return (
        f"starting_after: the events before sequence number {first} are no longer kept (a background stream "
        f"keeps only its newest events); resume from {first - 1} or later, or GET the response without "
        "stream for its output so far"
    )


async def _replay(events: EventLog, after: int, job: _Background | None) -> AsyncIterator[str]:
    """A background stream's events numbered after ``after``, then (while it runs) the new ones as they
    come, until it ends. Closing this leaves the task running. A reader that falls behind the kept events
    gets an ``error`` event (``param`` ``starting_after``) and the end of the stream."""
    index = max(after + 1, 0)
    while True:
        if index < events.first:
            message = _dropped(events.first)
            error = {"type": "error", "code": "events_dropped", "message": message, "param": "starting_after"}
            yield _sse_line(error, index)
            return
        if index < events.end:
            yield events.get(index)
            index += 1
        elif job is None or job.done:
            return
        else:
            await job.changed.wait()


def _history(conversation: list, response: dict[str, Any]) -> list[dict[str, Any]]:
    return [*conversation, *_output_messages(response["output"])]


def _query_bool(request: Request, name: str) -> bool:
    value = request.query_params.get(name, "false").lower()
    if value not in ("true", "false", "1", "0"):
        raise APIError(400, f"{name}: must be true or false", name)
    return value in ("true", "1")


def _query_int(request: Request, name: str, default: int) -> int:
    value = request.query_params.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise APIError(400, f"{name}: must be an integer", name) from None


def _skeleton(req: ResponsesRequest, response_id: str, model: str) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "queued" if req.background else "in_progress",
        "background": bool(req.background),
        "model": model,
        "output": [],
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "metadata": req.metadata or {},
        "parallel_tool_calls": req.parallel_tool_calls,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_logprobs": req.top_logprobs,
        "tool_choice": req.tool_choice or "auto",
        "tools": req.tools or [],
        "max_output_tokens": req.max_output_tokens,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": req.effort, "summary": None},
        "store": req.store,
        "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
        "truncation": req.truncation or "disabled",
        "user": req.user,
        "usage": None,
    }


def _output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages of the next turn's history (thoughts dropped)."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [
        {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        for item in output
        if item["type"] == "function_call" and item["status"] == "completed"
    ]
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return [message]


class _Run:
    """One response's engine output -> output items and the Responses events, in order (without their
    ``sequence_number``, which ``_sse`` adds). The last event carries the whole response. With
    ``want_logprobs``, output_text parts and their deltas carry the logprobs of the tokens that made their
    text (tokens of the thought channel, of calls, and special tokens have none there)."""

    def __init__(
        self,
        skeleton,
        parser: Gemma4OutputParser,
        input_tokens: int,
        deltas,
        raise_errors: bool,
        want_logprobs: bool = False,
        special_tokens: frozenset[str] = frozenset(),
    ):
        self.response = skeleton
        self.parser = parser
        self.input_tokens = input_tokens
        self.deltas = deltas
        self.raise_errors = raise_errors
        self.want_logprobs = want_logprobs
        self.special_tokens = special_tokens
        self.on_done = None
        self.items: list[dict[str, Any]] = skeleton["output"]
        # The item being streamed; its text (``_text``) in pieces, joined once as it closes: appending a delta
        # to one string copied all of it, and a long answer cost the event loop its length squared.
        self.open: dict[str, Any] | None = None
        self.pending_space: list[str] = []  # whitespace that opens no message on its own
        self.pending_logprobs: list = []  # of tokens whose text has not reached an item yet
        self.output_tokens = self.reasoning_tokens = self.cached_tokens = 0

    def snapshot(self, kind: str) -> dict[str, Any]:
        return {"type": kind, "response": copy.deepcopy(self.response)}

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        yield self.snapshot("response.created")
        if self.response["status"] == "queued":  # a background response: it runs now
            yield self.snapshot("response.queued")
            self.response["status"] = "in_progress"
        yield self.snapshot("response.in_progress")
        finish_reason = None
        try:
            async for _, delta in self.deltas:
                if delta.finished:
                    finish_reason = delta.finish_reason
                for event in self._feed(*self._parse(delta)):
                    yield event
        except (EngineDeadError, RuntimeError) as exc:
            if self.raise_errors:
                raise
            for event in self.fail(str(exc)):
                yield event
            return
        finally:
            await self.deltas.aclose()
        for event in self._finish():
            yield event
        if finish_reason == "length":
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
            yield self._conclude("incomplete")
        else:
            yield self._conclude("completed")

    def _parse(self, delta) -> tuple[ParsedDelta, list]:
        """The delta's parsed text and its tokens' logprobs; the token counts."""
        was_thinking = self.parser.state in _THOUGHT_STATES
        parsed = self.parser.feed(delta.text)
        if delta.finished:
            last = self.parser.finish()
            parsed.content += last.content
            parsed.reasoning += last.reasoning
            parsed.tool_calls += last.tool_calls
        logprobs = []
        if self.want_logprobs and delta.logprobs:  # the entries of the delta's tokens
            entries = delta.logprobs
            # Special tokens never reach the text: they have no logprobs there either.
            skip = self.special_tokens
            logprobs = [e for e in entries if next(iter(e.values())).decoded_token not in skip]
        self.output_tokens += len(delta.token_ids)
        if was_thinking or parsed.reasoning or self.parser.state in _THOUGHT_STATES:
            self.reasoning_tokens += len(delta.token_ids)
        self.cached_tokens = delta.num_cached_tokens
        return parsed, logprobs

    def cancel(self) -> list[dict[str, Any]]:
        """The events that end a cancelled response: its open item closed (``incomplete``), status
        ``cancelled`` with the output and usage so far (no final event: OpenAI has none for this)."""
        events = self._close("incomplete")
        self._conclude("cancelled")
        return events

    def fail(self, message: str) -> list[dict[str, Any]]:
        events = self._close("incomplete")
        self.response["error"] = {"code": "server_error", "message": message}
        return [*events, self._conclude("failed")]

    def _conclude(self, status: str) -> dict[str, Any]:
        self.response["status"] = status
        self.response["usage"] = {
            "input_tokens": self.input_tokens,
            "input_tokens_details": {"cached_tokens": self.cached_tokens},
            "output_tokens": self.output_tokens,
            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            "total_tokens": self.input_tokens + self.output_tokens,
        }
        # Final: nothing changes the response after this, so the store and the last event share it (copies
        # of a response with 20 top logprobs a token cost 1.4 s each per 12,483 tokens on the 2-core CPU).
        if self.on_done is not None:
            self.on_done(self.response)
        return {"type": f"response.{status}", "response": self.response}

    # ---- items ---------------------------------------------------------------------------------------
    def _feed(self, parsed: ParsedDelta, logprobs: list = ()) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        self.pending_logprobs += logprobs
        if parsed.reasoning:
            if self._open_type() != "reasoning":
                events += self._close()
                events += self._add({"type": "reasoning", "summary": [], "content": []}, "rs")
                events.append(self._part_event("added", {"type": "reasoning_text", "text": ""}))
            self.open["_text"].append(parsed.reasoning)
            events.append(
                self._item_event("response.reasoning_text.delta", delta=parsed.reasoning, content_index=0)
            )
        if parsed.content:
            if self._open_type() == "message":
                events.append(self._text_delta(parsed.content))
            elif not parsed.content.strip():  # (what is pending is whitespace too)
                self.pending_space.append(parsed.content)
            else:
                events += self._open_message()
                events.append(self._text_delta("".join([*self.pending_space, parsed.content])))
                self.pending_space = []
        elif parsed.reasoning or parsed.tool_calls:
            self.pending_logprobs = []  # their tokens made no message text
        for call in parsed.tool_calls:
            if call.id is not None:
                events += self._close()
                item = {"type": "function_call", "call_id": call.id, "name": call.name, "arguments": ""}
                events += self._add(item, "fc")
                self.open["_call"] = call.index
            if call.arguments:  # the parser keeps them whole, for the item's final form (``_close``)
                events.append(
                    self._item_event("response.function_call_arguments.delta", delta=call.arguments)
                )
        return events

    def _finish(self) -> list[dict[str, Any]]:
        events = self._close()
        if not self.items:  # a response always has its message, if only an empty one
            events += self._open_message()
            if self.pending_space:
                events.append(self._text_delta("".join(self.pending_space)))
            events += self._close()
        return events

    def _open_type(self) -> str | None:
        return self.open["type"] if self.open is not None else None

    def _add(self, item: dict[str, Any], prefix: str) -> list[dict[str, Any]]:
        item = {"id": f"{prefix}_{uuid.uuid4().hex}", **item, "status": "in_progress"}
        self.open = {**item, "_text": [], "_logprobs": [], "_index": len(self.items)}
        self.items.append(item)
        return [
            {"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": dict(item)}
        ]

    def _open_message(self) -> list[dict[str, Any]]:
        events = self._close()
        events += self._add({"type": "message", "role": "assistant", "content": []}, "msg")
        events.append(self._part_event("added", _output_text("")))
        return events

    def _text_delta(self, text: str) -> dict[str, Any]:
        logprobs = chat_logprobs(self.pending_logprobs)["content"] if self.pending_logprobs else []
        self.pending_logprobs = []
        self.open["_text"].append(text)
        self.open["_logprobs"] += logprobs
        return self._item_event("response.output_text.delta", delta=text, content_index=0, logprobs=logprobs)

    def _item_event(self, kind: str, **fields) -> dict[str, Any]:
        return {"type": kind, "item_id": self.open["id"], "output_index": self.open["_index"], **fields}

    def _part_event(self, stage: str, part: dict[str, Any]) -> dict[str, Any]:
        return self._item_event(f"response.content_part.{stage}", content_index=0, part=part)

    def _close(self, status: str = "completed") -> list[dict[str, Any]]:
        """The done events of the open item, which takes its final form in the output (``status``
        ``incomplete`` where the response ends before the item did)."""
        item = self.open
        if item is None:
            return []
        events: list[dict[str, Any]] = []
        kind, text = item["type"], "".join(item["_text"])
        final = {k: v for k, v in item.items() if not k.startswith("_")}
        final["status"] = status
        if kind == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            events.append(self._item_event("response.reasoning_text.done", text=text, content_index=0))
            events.append(self._part_event("done", part))
            final["content"] = [part]
        elif kind == "message":
            part = _output_text(text, item["_logprobs"])
            events.append(
                self._item_event(
                    "response.output_text.done", text=text, content_index=0, logprobs=item["_logprobs"]
                )
            )
            events.append(self._part_event("done", part))
            final["content"] = [part]
        else:
            call = self.parser.tool_calls[item["_call"]]
            final["arguments"] = call["arguments"]
            if not call["complete"]:
                final["status"] = "incomplete"
            events.append(
                self._item_event(
                    "response.function_call_arguments.done", arguments=final["arguments"], name=final["name"]
                )
            )
        self.items[item["_index"]] = final
        events.append({"type": "response.output_item.done", "output_index": item["_index"], "item": final})
        self.open = None
        return events


def _output_text(text: str, logprobs: list | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": list(logprobs or [])}


def _sse_line(event: dict[str, Any], sequence_number: int) -> str:
    payload = json.dumps({**event, "sequence_number": sequence_number}, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {payload}\n\n"


async def _sse(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """The Responses event stream: ``event:`` and ``data:`` lines, numbered in order (no ``[DONE]``)."""
    sequence_number = 0
    try:
        async for event in events:
            yield _sse_line(event, sequence_number)
            sequence_number += 1
    finally:
        await events.aclose()
