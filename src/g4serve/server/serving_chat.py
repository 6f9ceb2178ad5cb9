"""``POST /v1/chat/completions`` (vLLM's ``serving_chat``): messages and their media parts -> the chat
template -> one engine request per choice, answered whole or as server-sent events."""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
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
from g4serve.server.errors import APIError, bad_request
from g4serve.server.protocol import ChatCompletionRequest, usage
from g4serve.server.serving_base import OpenAIServing
from g4serve.server.streaming import Choice, finish_fields, ranked, safe_logprob, sse, sse_events


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
        if req.tools:
            raise APIError(400, "tools: tool calling is not supported by this server", param="tools")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
            raise APIError(400, "top_logprobs: must be in [0, 20]", param="top_logprobs")
        try:
            root = self.config.allowed_local_media_path
            messages, media = split_chat_messages(
                req.messages, allow_local_files=root is not None, local_media_root=root, allow_objects=False
            )
        except ValueError as exc:
            raise bad_request(exc) from None
        self.check_media(media.as_dict())
        prompt = await self.render(req, messages)
        params = self.sampling_params(req, req.effective_max_tokens(), req.num_logprobs())
        processed = await self.process(
            {"prompt": prompt, "multi_modal_data": media.as_dict()}, add_special_tokens=False
        )
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = self.stream(await self.admit(processed, params, request_id, req.priority))
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
                ),
                media_type="text/event-stream",
            )
        choices, cached = await self.collect(request, streams, params.n, received)
        return {
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": model_name,
            "choices": [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": "".join(c.text)},
                    "logprobs": chat_logprobs(c.logprobs) if params.logprobs is not None else None,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                for i, c in enumerate(choices)
            ],
            "usage": usage(
                len(processed.token_ids),
                sum(len(c.token_ids) for c in choices),
                cached,
                sum(c.num_forced_tokens for c in choices),
            ),
        }

    async def render(self, req: ChatCompletionRequest, messages: list) -> str:
        """The prompt, rendered off the event loop: the model's chat template in a thread, or a template the
        request supplies (``chat_template_kwargs.chat_template``, only with --trust-request-chat-template)
        in the sandboxed worker process under its limits. Every template failure is a 400."""
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
        call, executor, where = self._template_call(req, messages, source, kwargs, where)
        try:
            return await asyncio.get_running_loop().run_in_executor(executor, call)
        except ChatTemplateError as exc:  # the template's raise_exception, a syntax error, a limit
            raise APIError(400, f"{where}: {exc}", where) from None
        except (ValueError, TypeError) as exc:
            raise bad_request(exc, "messages") from None
        except Exception as exc:  # noqa: BLE001 - a template error is the caller's input problem
            detail = str(exc)[:300] or type(exc).__name__
            raise APIError(400, f"{where}: the chat template could not be applied: {detail}", where) from None

    def _template_call(self, req: ChatCompletionRequest, messages: list, source, kwargs: dict, where: str):
        """(the render call, the executor it runs in, the field its errors name)."""
        tokenizer = self.tokenizer
        named = isinstance(tokenizer.chat_template, dict) and source in tokenizer.chat_template
        if source is None or named:  # the model's own template: trusted, rendered as transformers does
            call = functools.partial(
                tokenizer.apply_chat_template,
                messages,
                add_generation_prompt=req.add_generation_prompt,
                chat_template=source,  # None, or the name of one of the model's own templates
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
                **kwargs,
            )
            executor = renderer.executor
        return call, executor, where


def token_entry(text: str | None, logprob: float) -> dict[str, Any]:
    text = text or ""
    return {"token": text, "logprob": safe_logprob(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(entries: list[dict[int, Logprob]]) -> dict[str, Any]:
    content = []
    for entry in entries:
        chosen = next(iter(entry.values()))
        item = token_entry(chosen.decoded_token, chosen.logprob)
        item["top_logprobs"] = [token_entry(lp.decoded_token, lp.logprob) for lp in ranked(entry)]
        content.append(item)
    return {"content": content}


async def chat_stream(
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

    def event(index: int, choice: Choice, delta: StreamDelta, new_logprobs) -> dict | None:
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

    async for line in sse_events(deltas, base, include_usage, event):
        yield line
