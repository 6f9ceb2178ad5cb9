"""``POST /v1/responses`` (OpenAI's Responses API), ``GET`` and ``DELETE /v1/responses/{id}``. The request
becomes chat messages and chat fields, rendered and checked by the chat endpoint's own code; the output is
parsed by ``Gemma4OutputParser`` into reasoning, message and function_call items, answered whole or as the
Responses event stream. ``previous_response_id`` reads the bounded ``ResponseStore``."""

from __future__ import annotations

import copy
import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from g4serve.engine.async_engine import EngineDeadError
from g4serve.processing.chat import split_chat_messages
from g4serve.server.errors import APIError
from g4serve.server.gemma4_output import Gemma4OutputParser, ParsedDelta
from g4serve.server.protocol import ChatCompletionRequest
from g4serve.server.response_store import ResponseStore
from g4serve.server.responses_protocol import ResponsesRequest, input_messages
from g4serve.server.serving_base import OpenAIServing, run_watching_client
from g4serve.server.serving_chat import OpenAIServingChat, _template_message

_THOUGHT_STATES = ("label", "reasoning")
_MESSAGE_INDEX = re.compile(r"^messages\[(\d+)\]")
_FINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")


class OpenAIServingResponses(OpenAIServing):
    def __init__(self, *args, chat: OpenAIServingChat, store: ResponseStore, **kwargs):
        super().__init__(*args, **kwargs)
        self.chat = chat
        self.store = store

    # ---- GET / DELETE ------------------------------------------------------------------------------
    def _stored(self, request: Request, response_id: str, where: str = "response_id"):
        entry = self.store.get(self._owner(request), response_id)
        if entry is None:
            raise APIError(404, f"{where}: no stored response {response_id[:64]!r}", where)
        return entry

    def retrieve(self, request: Request, response_id: str) -> dict[str, Any]:
        return self._stored(request, response_id).response

    def delete(self, request: Request, response_id: str) -> dict[str, Any]:
        self._stored(request, response_id)
        self.store.delete(self._owner(request), response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @staticmethod
    def _owner(request: Request) -> str:
        return ResponseStore.owner(request.headers.get("authorization"))

    # ---- POST ------------------------------------------------------------------------------------------
    async def create(self, request: Request):
        received = time.monotonic()
        req: ResponsesRequest = await self.read(request, ResponsesRequest)
        req.check()
        model_name = self.check_model(req.model)
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            history = list(self._stored(request, req.previous_response_id, "previous_response_id").history)
        known_calls = {
            c["id"]: c["function"]["name"] for m in history for c in m.get("tool_calls") or () if "id" in c
        }
        turn = input_messages(req.input, known_calls)
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        chat_req = self._chat_request(req)
        tools, forced = self.chat.tool_plan(chat_req)
        messages, media = self._split(system, history, turn)
        thinking = self.chat.thinking(chat_req)
        prompt = await self.chat.render(chat_req, messages, tools, thinking)
        params = self.sampling_params(chat_req, req.max_output_tokens, None)
        # As in chat: with thinking on, a grammar (text.format, a forced call) waits for the thought to close.
        params, _ = self.chat.reasoning_plan(chat_req, params, thinking)
        # The markers must reach the parser; it keeps every special token out of the answer.
        params = replace(params, skip_special_tokens=False)
        params = OpenAIServingChat.force_call(params, forced, "text.format")
        specials = frozenset(self.tokenizer.convert_ids_to_tokens(self.tokenizer.special_token_ids)) - {None}
        parse_tools = bool(tools) and chat_req.tool_choice != "none"
        processed = await self.process(
            {"prompt": prompt, "multi_modal_data": media.as_dict()}, add_special_tokens=False
        )
        response_id = f"resp_{uuid.uuid4().hex}"
        streams = self.stream(await self.admit(processed, params, response_id, 0))
        skeleton = _skeleton(req, response_id, model_name)
        run = _Run(
            skeleton,
            Gemma4OutputParser(specials, parse_tools),
            len(processed.token_ids),
            self.merged(streams, received),
            raise_errors=not req.stream,
        )
        on_done = None
        if req.store:
            owner = self._owner(request)

            def on_done(response: dict[str, Any]) -> None:
                self.store.put(owner, response, [*history, *turn, *_output_messages(response["output"])])

        run.on_done = on_done
        if req.stream:
            return StreamingResponse(_sse(run.events()), media_type="text/event-stream")
        return await self._whole(request, run.events())

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
        }
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
        except ValidationError as exc:
            err = exc.errors()[0]
            raise APIError(400, f"{err['loc'][0]}: {err['msg']}", str(err["loc"][0])) from None

    def _split(self, system: list, history: list, turn: list):
        """Chat messages ready for the template, and their media, checked as the chat endpoint checks them;
        an error names the Responses field (``input[2].content[1]...``), not the chat message."""
        messages = [*system, *history, *turn]
        first_input = len(system) + len(history)

        def rename(match: re.Match) -> str:
            index = int(match.group(1))
            return f"input[{index - first_input}]" if index >= first_input else "previous_response_id"

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
        try:
            messages = [_template_message(m, i) for i, m in enumerate(messages)]
        except APIError as exc:
            raise APIError(400, _MESSAGE_INDEX.sub(rename, exc.message), "input") from None
        return messages, media

    async def _whole(self, request: Request, events: AsyncIterator[dict]) -> dict[str, Any]:
        """Run the events to the end for a non-streaming answer; a client disconnect aborts the request."""
        final: dict[str, Any] = {}

        async def consume() -> None:
            async for event in events:
                if event["type"] in _FINAL_EVENTS:
                    final.update(event["response"])

        await run_watching_client(request, consume())
        return final


def _skeleton(req: ResponsesRequest, response_id: str, model: str) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "model": model,
        "output": [],
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "metadata": req.metadata or {},
        "parallel_tool_calls": req.parallel_tool_calls,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tool_choice": req.tool_choice or "auto",
        "tools": req.tools or [],
        "max_output_tokens": req.max_output_tokens,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": req.effort, "summary": None},
        "store": req.store,
        "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
        "truncation": "disabled",
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
    ``sequence_number``, which ``_sse`` adds). The last event carries the whole response."""

    def __init__(self, skeleton, parser: Gemma4OutputParser, input_tokens: int, deltas, raise_errors: bool):
        self.response = skeleton
        self.parser = parser
        self.input_tokens = input_tokens
        self.deltas = deltas
        self.raise_errors = raise_errors
        self.on_done = None
        self.items: list[dict[str, Any]] = skeleton["output"]
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.pending_space = ""  # whitespace that opens no message on its own

    def snapshot(self, kind: str) -> dict[str, Any]:
        return {"type": kind, "response": copy.deepcopy(self.response)}

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        yield self.snapshot("response.created")
        yield self.snapshot("response.in_progress")
        output_tokens = reasoning_tokens = cached = 0
        finish_reason = None
        try:
            async for _, delta in self.deltas:
                was_thinking = self.parser.state in _THOUGHT_STATES
                parsed = self.parser.feed(delta.text)
                if delta.finished:
                    last = self.parser.finish()
                    parsed.content += last.content
                    parsed.reasoning += last.reasoning
                    parsed.tool_calls += last.tool_calls
                    finish_reason = delta.finish_reason
                output_tokens += len(delta.token_ids)
                if was_thinking or parsed.reasoning or self.parser.state in _THOUGHT_STATES:
                    reasoning_tokens += len(delta.token_ids)
                cached = delta.num_cached_tokens
                for event in self._feed(parsed):
                    yield event
        except (EngineDeadError, RuntimeError) as exc:
            if self.raise_errors:
                raise
            self.response.update(status="failed", error={"code": "server_error", "message": str(exc)})
            yield self.snapshot("response.failed")
            return
        finally:
            await self.deltas.aclose()
        for event in self._finish():
            yield event
        self.response["usage"] = {
            "input_tokens": self.input_tokens,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": self.input_tokens + output_tokens,
        }
        if finish_reason == "length":
            self.response.update(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
        else:
            self.response["status"] = "completed"
        if self.on_done is not None:
            self.on_done(copy.deepcopy(self.response))
        yield self.snapshot("response.completed" if finish_reason != "length" else "response.incomplete")

    # ---- items ---------------------------------------------------------------------------------------
    def _feed(self, parsed: ParsedDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if parsed.reasoning:
            if self._open_type() != "reasoning":
                events += self._close()
                events += self._add({"type": "reasoning", "summary": [], "content": []}, "rs")
                events.append(self._part_event("added", {"type": "reasoning_text", "text": ""}))
            self.open["_text"] += parsed.reasoning
            events.append(
                self._item_event("response.reasoning_text.delta", delta=parsed.reasoning, content_index=0)
            )
        if parsed.content:
            if self._open_type() == "message":
                events.append(self._text_delta(parsed.content))
            elif not (self.pending_space + parsed.content).strip():
                self.pending_space += parsed.content
            else:
                events += self._open_message()
                events.append(self._text_delta(self.pending_space + parsed.content))
                self.pending_space = ""
        for call in parsed.tool_calls:
            if call.id is not None:
                events += self._close()
                item = {"type": "function_call", "call_id": call.id, "name": call.name, "arguments": ""}
                events += self._add(item, "fc")
                self.open["_call"] = call.index
            if call.arguments:
                self.open["arguments"] += call.arguments
                events.append(
                    self._item_event("response.function_call_arguments.delta", delta=call.arguments)
                )
        return events

    def _finish(self) -> list[dict[str, Any]]:
        events = self._close()
        if not self.items:  # a response always has its message, if only an empty one
            events += self._open_message()
            if self.pending_space:
                events.append(self._text_delta(self.pending_space))
            events += self._close()
        return events

    def _open_type(self) -> str | None:
        return self.open["type"] if self.open is not None else None

    def _add(self, item: dict[str, Any], prefix: str) -> list[dict[str, Any]]:
        item = {"id": f"{prefix}_{uuid.uuid4().hex}", **item, "status": "in_progress"}
        self.open = {**item, "_text": "", "_index": len(self.items)}
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
        self.open["_text"] += text
        return self._item_event("response.output_text.delta", delta=text, content_index=0, logprobs=[])

    def _item_event(self, kind: str, **fields) -> dict[str, Any]:
        return {"type": kind, "item_id": self.open["id"], "output_index": self.open["_index"], **fields}

    def _part_event(self, stage: str, part: dict[str, Any]) -> dict[str, Any]:
        return self._item_event(f"response.content_part.{stage}", content_index=0, part=part)

    def _close(self) -> list[dict[str, Any]]:
        """The done events of the open item, which takes its final form in the output."""
        item = self.open
        if item is None:
            return []
        events: list[dict[str, Any]] = []
        kind, text = item["type"], item["_text"]
        final = {k: v for k, v in item.items() if not k.startswith("_")}
        final["status"] = "completed"
        if kind == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            events.append(self._item_event("response.reasoning_text.done", text=text, content_index=0))
            events.append(self._part_event("done", part))
            final["content"] = [part]
        elif kind == "message":
            part = _output_text(text)
            events.append(
                self._item_event("response.output_text.done", text=text, content_index=0, logprobs=[])
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


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


async def _sse(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """The Responses event stream: ``event:`` and ``data:`` lines, numbered in order (no ``[DONE]``)."""
    sequence_number = 0
    try:
        async for event in events:
            payload = json.dumps({**event, "sequence_number": sequence_number}, separators=(",", ":"))
            sequence_number += 1
            yield f"event: {event['type']}\ndata: {payload}\n\n"
    finally:
        await events.aclose()
