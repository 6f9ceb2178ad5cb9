"""``POST /v1/chat/completions`` (vLLM's ``serving_chat``): messages and their media parts -> the chat
template -> one engine request per choice, answered whole or as server-sent events."""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from g4serve.engine.async_engine import StreamDelta
from g4serve.outputs import Logprob
from g4serve.processing.chat import split_chat_messages
from g4serve.processing.chat_template import (
    ChatTemplateError,
    RequestTemplateRenderer,
    check_chat_template_kwargs,
)
from g4serve.sampling_params import SamplingParamsError
from g4serve.server.errors import APIError, JsonBudget, bad_request, parse_json_text
from g4serve.server.gemma4_output import Gemma4OutputParser
from g4serve.server.gemma4_tools import check_tools, forced_call_grammar
from g4serve.server.json_body import JsonSlices, json_response
from g4serve.server.protocol import ChatCompletionRequest, usage
from g4serve.server.serving_base import OpenAIServing, budget_named, check_logprob_entries
from g4serve.server.streaming import Choice, finish_fields, ranked, safe_logprob, sse, sse_events
from g4serve.structured import StructuredOutputError, StructuredSpec
from g4serve.structured.reasoning import reasoning_token_count, thought_markers

# A conversation renders in a template thread that holds the interpreter lock while it runs (Gemma 4's
# template, made linear by gemma4_template.linear_template, ~50 us a message on the 2-core CPU): past this
# many messages a request is refused before rendering.
MAX_MESSAGES = 4096


def _check_length(messages: list) -> None:
    if len(messages) > MAX_MESSAGES:
        raise APIError(400, f"messages: at most {MAX_MESSAGES} messages, got {len(messages)}", "messages")


class OpenAIServingChat(OpenAIServing):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # The model's own template renders in these threads, never on the event loop.
        self.template_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="g4-chat-template")
        # Request-supplied templates (--trust-request-chat-template): a sandboxed worker process.
        self._renderer: RequestTemplateRenderer | None = None

    def close(self) -> None:
        """Stop the template threads and the request-template worker process (at app shutdown)."""
        self.template_pool.shutdown(wait=False, cancel_futures=True)
        if self._renderer is not None:
            self._renderer.close()

    async def create(self, request: Request):
        received = time.monotonic()
        req: ChatCompletionRequest = await self.read(request, ChatCompletionRequest)
        model_name = self.check_model(req.model)
        tools, forced = self.tool_plan(req)
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
            raise APIError(400, "top_logprobs: must be in [0, 20]", param="top_logprobs")
        with self.metrics.stage("parse"):
            try:
                root = self.config.allowed_local_media_path
                messages, media = split_chat_messages(
                    req.messages,
                    allow_local_files=root is not None,
                    local_media_root=root,
                    allow_objects=False,
                )
            except ValueError as exc:
                raise bad_request(exc) from None
            self.check_media(media.as_dict())
            # off the event loop: a call's arguments may hold millions of numbers the body's count leaves out
            messages = await asyncio.to_thread(template_messages, messages)
        thinking = self.thinking(req)
        with self.metrics.stage("render"):
            prompt = await self.render(req, messages, tools, thinking)
        budget = "max_completion_tokens" if req.max_completion_tokens is not None else None
        with budget_named(budget):
            params = self.sampling_params(req, req.effective_max_tokens(), req.num_logprobs())
        params, count_reasoning = self.reasoning_plan(req, params, thinking)
        parse = bool(tools) or thinking or params.max_reasoning_tokens is not None
        if parse:  # the markers must reach the parser; it keeps every special token out of the answer
            params = replace(params, skip_special_tokens=False)
        params = self.force_call(params, forced, "response_format")
        parser_factory = None
        if parse:
            specials = frozenset(self.tokenizer.convert_ids_to_tokens(self.tokenizer.special_token_ids)) - {
                None
            }
            parse_tools = bool(tools) and req.tool_choice != "none"
            parser_factory = functools.partial(Gemma4OutputParser, specials, parse_tools)
        processed = await self.process(
            {"prompt": prompt, "multi_modal_data": media.as_dict()}, False, req.cache_salt
        )
        if not req.stream:
            room = self.engine.max_model_len - len(processed.token_ids)
            check_logprob_entries(params.n, min(params.max_tokens or room, room), params.logprobs, "logprobs")
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        with budget_named(budget):
            admitted = await self.admit(processed, params, request_id, req.priority, model_name)
        streams = self.stream(admitted, request)
        created = int(time.time())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(
                chat_stream(
                    self.merged(streams, received),
                    request_id,
                    model_name,
                    created,
                    params.n,
                    include_usage,
                    params.logprobs is not None,
                    parser_factory,
                    count_reasoning,
                ),
                media_type="text/event-stream",
            )
        num_prompt_tokens = len(processed.token_ids)
        # A whole answer waits here for its choices. The body counted in the budget until the request was
        # in the engine, which holds what it needs: the parsed request (base64 media up to the body cap),
        # its messages and rendered prompt are let go of, not kept for the whole generation.
        del req, messages, media, prompt, tools, processed
        choices, cached = await self.collect(request, streams, params.n, received)
        want_logprobs = params.logprobs is not None
        return json_response(
            {
                "id": request_id,
                "object": "chat.completion",
                "created": created,
                "model": model_name,
                "choices": [
                    {
                        "index": i,
                        **chat_message(c, parser_factory),
                        "logprobs": chat_logprobs(c.logprobs, whole=True) if want_logprobs else None,
                        "stop_reason": c.stop_reason,
                    }
                    for i, c in enumerate(choices)
                ],
                "usage": usage(
                    num_prompt_tokens,
                    sum(len(c.token_ids) for c in choices),
                    cached,
                    sum(c.num_forced_tokens for c in choices),
                    None if count_reasoning is None else sum(count_reasoning(c.token_ids) for c in choices),
                ),
            }
        )

    def tool_plan(self, req: ChatCompletionRequest) -> tuple[list | None, str | None]:
        """(the tools the template renders, the grammar that forces a call or None)."""
        choice = req.tool_choice
        if not req.tools:
            if choice not in (None, "none", "auto"):
                raise APIError(400, "tool_choice: needs tools", "tool_choice")
            return None, None
        schemas = check_tools(req.tools)
        if choice in (None, "auto", "none"):
            return req.tools, None
        if choice == "required":
            return req.tools, forced_call_grammar(schemas, list(schemas), req.parallel_tool_calls)
        function = choice.get("function") if isinstance(choice, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
            raise APIError(
                400,
                "tool_choice: must be 'auto', 'none', 'required' or "
                '{"type": "function", "function": {"name": ...}}',
                "tool_choice",
            )
        if name not in schemas:
            raise APIError(400, f"tool_choice.function.name: no tool named {str(name)[:64]!r}", "tool_choice")
        return req.tools, forced_call_grammar(schemas, [name], False)

    @staticmethod
    def force_call(params, forced, format_field: str):
        """``params`` with the grammar of a forced tool call (``tool_plan``'s), if any; a forced call and a
        structured output format (``format_field``) cannot both hold."""
        if forced is None:
            return params
        if params.structured_output is not None:
            raise APIError(
                400, f"{format_field}: cannot be combined with a forced tool_choice", "tool_choice"
            )
        try:
            return replace(params, structured_output=StructuredSpec.grammar(forced))
        except StructuredOutputError as exc:
            raise APIError(400, f"tools: {exc}", "tools") from None

    def reasoning_plan(self, req: ChatCompletionRequest, params, thinking: bool):
        """(the parameters with thinking and the reasoning budget, the counter of a choice's reasoning
        tokens for usage or None). The grammar (response_format, a forced call) of a thinking request waits
        for the thought channel to close."""
        try:
            params = replace(params, thinking=thinking, max_reasoning_tokens=req.reasoning_budget())
        except SamplingParamsError as exc:
            raise bad_request(exc) from None
        markers = thought_markers(self.tokenizer)
        if markers is None or not (thinking or params.max_reasoning_tokens is not None):
            return params, None
        return params, functools.partial(reasoning_token_count, markers=markers)

    @staticmethod
    def thinking(req: ChatCompletionRequest) -> bool:
        """Whether thinking is on: ``chat_template_kwargs.enable_thinking`` (a boolean: the string "false"
        would be true to the template), else ``reasoning_effort`` (checked either way)."""
        if req.reasoning_effort not in (None, "none", "minimal", "low", "medium", "high"):
            raise APIError(
                400, "reasoning_effort: must be none, minimal, low, medium or high", "reasoning_effort"
            )
        kwargs = req.chat_template_kwargs or {}
        if "enable_thinking" in kwargs:
            if not isinstance(kwargs["enable_thinking"], bool):
                where = "chat_template_kwargs.enable_thinking"
                raise APIError(400, f"{where}: must be true or false", where)
            return kwargs["enable_thinking"]
        return req.reasoning_effort not in (None, "none")

    async def render(
        self, req: ChatCompletionRequest, messages: list, tools: list | None = None, thinking: bool = False
    ) -> str:
        """The prompt, rendered off the event loop: the model's chat template in a thread, or a template the
        request supplies (``chat_template_kwargs.chat_template``, only with --trust-request-chat-template)
        in the sandboxed worker process under its limits. Every template failure is a 400, as are more
        than ``MAX_MESSAGES`` messages."""
        _check_length(messages)
        raw = dict(req.chat_template_kwargs or {})
        source, where = raw.get("chat_template"), "chat_template_kwargs.chat_template"
        if req.chat_template is not None:  # the top-level field (vLLM's) wins over the kwarg
            source, where = req.chat_template, "chat_template"
        if source is not None:
            if not self.config.trust_request_chat_template:
                raise APIError(
                    400,
                    f"{where}: request-supplied chat templates are not accepted by this server "
                    "(start it with --trust-request-chat-template to allow them)",
                    where,
                )
            if not isinstance(source, str):
                raise APIError(400, f"{where}: must be a string", where)
        tokenizer = self.tokenizer
        try:  # the model's own special tokens (e.g. image_token) are the server's too
            kwargs = check_chat_template_kwargs(raw, reserved=frozenset(tokenizer.special_tokens_map))
        except ValueError as exc:
            raise bad_request(exc) from None
        if thinking:
            kwargs["enable_thinking"] = True
        call, executor, where = self._template_call(req, messages, source, kwargs, where, tools)
        try:
            return await asyncio.get_running_loop().run_in_executor(executor, call)
        except ChatTemplateError as exc:  # the template's raise_exception, a syntax error, a limit
            raise APIError(400, f"{where}: {exc}", where) from None
        except (ValueError, TypeError) as exc:
            raise bad_request(exc, "messages") from None
        except Exception as exc:  # noqa: BLE001 - a template error is the caller's input problem
            detail = str(exc)[:300] or type(exc).__name__
            raise APIError(400, f"{where}: the chat template could not be applied: {detail}", where) from None

    def _template_call(
        self, req: ChatCompletionRequest, messages: list, source, kwargs: dict, where: str, tools=None
    ):
        """(the render call, the executor it runs in, the field its errors name)."""
        tokenizer = self.tokenizer
        named = isinstance(tokenizer.chat_template, dict) and source in tokenizer.chat_template
        if source is None or named:  # the model's own template: trusted, rendered as transformers does
            call = functools.partial(
                tokenizer.apply_chat_template,
                messages,
                add_generation_prompt=req.add_generation_prompt,
                tools=tools,
                chat_template=source,  # None, or the name of one of the model's own templates
                data_as_text=not self.config.trust_message_control_tokens,
                **kwargs,
            )
            executor, where = self.template_pool, "messages"
        else:
            if self._renderer is None:
                self._renderer = RequestTemplateRenderer()
            renderer = self._renderer
            call = functools.partial(
                tokenizer.apply_request_chat_template,
                messages,
                source,
                renderer,
                add_generation_prompt=req.add_generation_prompt,
                data_as_text=not self.config.trust_message_control_tokens,
                **kwargs,
            )
            executor = renderer.executor
        return call, executor, where


def template_messages(messages: list[dict]) -> list[dict]:
    """The messages as the template takes them; their calls' arguments parsed under one ``JsonBudget``."""
    budget = JsonBudget()
    return [_template_message(m, i, budget) for i, m in enumerate(messages)]


def _template_message(message: dict, index: int, budget: JsonBudget) -> dict:
    """OpenAI sends a call's arguments as a JSON string; Gemma 4's template renders them from a dict."""
    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or not calls:
        return message
    if not isinstance(calls, list):
        raise APIError(400, f"messages[{index}].tool_calls: must be a list", "messages")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError(400, f"messages[{index}].tool_calls[{j}].function.name: is required", "messages")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            where = f"messages[{index}].tool_calls[{j}].function.arguments"
            args = parse_json_text(args, where, "messages", budget) if args.strip() else {}
        out.append({**call, "function": {**fn, "arguments": args}})
    return {**message, "tool_calls": out}


def chat_message(choice: Choice, parser_factory) -> dict[str, Any]:
    """The message and finish_reason of a whole choice."""
    text = "".join(choice.text)
    if parser_factory is None:
        return {"message": {"role": "assistant", "content": text}, "finish_reason": choice.finish_reason}
    parser = parser_factory()
    first, last = parser.feed(text), parser.finish()
    message: dict[str, Any] = {"role": "assistant", "content": (first.content + last.content) or None}
    if parser.reasoning_started:
        message["reasoning_content"] = first.reasoning + last.reasoning
    calls = parser.complete_calls
    finish = choice.finish_reason
    if calls:
        message["tool_calls"] = [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls
        ]
        finish = "tool_calls" if finish == "stop" else finish
    elif message["content"] is None:
        message["content"] = ""
    return {"message": message, "finish_reason": finish}


def token_entry(text: str | None, logprob: float) -> dict[str, Any]:
    text = text or ""
    return {"token": text, "logprob": safe_logprob(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(entries: list[dict[int, Logprob]], whole: bool = False) -> dict[str, Any]:
    """OpenAI's chat ``logprobs`` of ``entries``; ``whole`` (a whole answer's): made as its body is sent."""
    return {"content": JsonSlices(entries, _chat_content) if whole else _chat_content(entries)}


def _chat_content(entries) -> list[dict[str, Any]]:
    content = []
    for entry in entries:
        chosen = next(iter(entry.values()))
        item = token_entry(chosen.decoded_token, chosen.logprob)
        item["top_logprobs"] = [token_entry(lp.decoded_token, lp.logprob) for lp in ranked(entry)]
        content.append(item)
    return content


async def chat_stream(  # noqa: C901 - plain and parsed (tools, reasoning) deltas
    deltas: AsyncIterator[tuple[int, StreamDelta]],
    request_id: str,
    model: str,
    created: int,
    n: int,
    include_usage: bool,
    want_logprobs: bool,
    parser_factory=None,
    count_reasoning=None,
) -> AsyncIterator[str]:
    base = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}
    extra = {"usage": None} if include_usage else {}
    for i in range(n):
        yield sse(
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

    parsers: dict[int, Gemma4OutputParser] = {}
    called: set[int] = set()

    def parsed_event(index: int, delta: StreamDelta, new_logprobs) -> dict | None:
        parser = parsers.setdefault(index, parser_factory())
        out = parser.feed(delta.text)
        if delta.finished:
            last = parser.finish()
            out.content += last.content
            out.reasoning += last.reasoning
            out.tool_calls += last.tool_calls
        body: dict[str, Any] = {}
        if out.content:
            body["content"] = out.content
        if out.reasoning:
            body["reasoning_content"] = out.reasoning
        if out.tool_calls:
            called.add(index)
            body["tool_calls"] = [
                {
                    "index": t.index,
                    **({"id": t.id, "type": "function"} if t.id else {}),
                    "function": {**({"name": t.name} if t.name else {}), "arguments": t.arguments},
                }
                for t in out.tool_calls
            ]
        if not body and not delta.finished and not (want_logprobs and new_logprobs):
            return None
        finish = finish_fields(delta)
        if delta.finished and parser.complete_calls and delta.finish_reason == "stop":
            finish["finish_reason"] = "tool_calls"
        return {
            "index": index,
            "delta": body,
            "logprobs": chat_logprobs(new_logprobs) if want_logprobs else None,
            **finish,
        }

    def event(index: int, choice: Choice, delta: StreamDelta, new_logprobs) -> dict | None:
        if parser_factory is not None:
            return parsed_event(index, delta, new_logprobs)
        if not delta.text and not delta.finished and not (want_logprobs and new_logprobs):
            return (
                None  # held back (a possible stop string) or a token with no text yet, and no logprobs asked
            )
        return {
            "index": index,
            "delta": {"content": delta.text} if delta.text else {},
            "logprobs": chat_logprobs(new_logprobs) if want_logprobs else None,
            **finish_fields(delta),
        }

    async for line in sse_events(deltas, base, include_usage, event, count_reasoning=count_reasoning):
        yield line
