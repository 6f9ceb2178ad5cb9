"""``POST /v1/completions`` (vLLM's ``serving_completion``): one or more raw prompts (text or token ids),
``n`` choices each, with ``echo``, answered whole or as server-sent events."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from g4serve.engine.async_engine import StreamDelta
from g4serve.outputs import Logprob
from g4serve.server.errors import APIError
from g4serve.server.json_body import JsonSlices, json_response
from g4serve.server.protocol import CompletionRequest, usage
from g4serve.server.serving_base import OpenAIServing, check_logprob_entries
from g4serve.server.streaming import Choice, finish_fields, ranked, safe_logprob, sse_events


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, request: Request):
        received = time.monotonic()
        req: CompletionRequest = await self.read(request, CompletionRequest)
        model_name = self.check_model(req.model)
        prompts = self.check_prompts(req)
        params = self.sampling_params(req, req.max_tokens if req.max_tokens is not None else 16, req.logprobs)
        if not req.stream:
            max_tokens = min(params.max_tokens, self.engine.max_model_len)  # more is refused at admission
            check_logprob_entries(len(prompts) * params.n, max_tokens, params.logprobs, "logprobs")
        request_id = f"cmpl-{uuid.uuid4().hex}"
        processed_all, admitted = [], []
        for p_index, prompt in enumerate(prompts):
            processed = await self.process(prompt, True, req.cache_salt)
            admitted += await self.admit(
                processed, params, f"{request_id}-{p_index}", req.priority, model_name
            )
            processed_all.append(processed)
        streams = self.stream(admitted, request)
        created = int(time.time())
        prompt_tokens = sum(len(p.token_ids) for p in processed_all)
        # Token-id prompts are decoded (on the event loop) only when they are echoed.
        echo_texts = [
            p.prompt if p.prompt is not None else self.tokenizer.decode(p.token_ids)
            for p in (processed_all if req.echo else ())
        ]
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(
                completion_stream(
                    self.merged(streams, received),
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
        echo = req.echo
        # As in chat: a whole answer waits here, and the parsed request and its prompts are let go of (the
        # echoed texts, when asked for, are all it keeps).
        req = prompts = processed_all = processed = prompt = None
        choices, cached = await self.collect(request, streams, len(streams), received)
        want_logprobs = params.logprobs is not None
        return json_response(
            {
                "id": request_id,
                "object": "text_completion",
                "created": created,
                "model": model_name,
                "choices": [
                    {
                        "index": i,
                        "text": (echo_texts[i // params.n] if echo else "") + "".join(c.text),
                        "logprobs": completion_logprobs(c.logprobs, whole=True) if want_logprobs else None,
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                    for i, c in enumerate(choices)
                ],
                "usage": usage(
                    prompt_tokens,
                    sum(len(c.token_ids) for c in choices),
                    cached,
                    sum(c.num_forced_tokens for c in choices),
                ),
            }
        )

    @staticmethod
    def check_prompts(req: CompletionRequest) -> list:
        if req.suffix:
            raise APIError(400, "suffix: not supported", param="suffix")
        if req.logprobs is not None and not 0 <= req.logprobs <= 20:
            raise APIError(400, "logprobs: must be in [0, 20]", param="logprobs")
        prompts = req.prompts()
        if not prompts or any(p == "" or p == {"prompt_token_ids": []} for p in prompts):
            raise APIError(400, "prompt: must not be empty", param="prompt")
        if len(prompts) * req.n > 256:
            raise APIError(400, "prompt: at most 256 completions per request", param="prompt")
        return prompts


def completion_logprobs(entries: list[dict[int, Logprob]], whole: bool = False) -> dict[str, Any]:
    """OpenAI's completion ``logprobs`` of ``entries``; ``whole`` (a whole answer's): the top logprobs, 20
    a token, made as its body is sent."""
    tokens, token_logprobs, offsets, offset = [], [], [], 0
    for entry in entries:
        chosen = next(iter(entry.values()))
        text = chosen.decoded_token or ""
        tokens.append(text)
        token_logprobs.append(safe_logprob(chosen.logprob))
        offsets.append(offset)
        offset += len(text)
    top = JsonSlices(entries, _top_logprobs) if whole else _top_logprobs(entries)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def _top_logprobs(entries) -> list[dict[str, float] | None]:
    return [
        {lp.decoded_token or "": safe_logprob(lp.logprob) for lp in ranked(entry)} or None
        for entry in entries
    ]


async def completion_stream(
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

    def event(index: int, choice: Choice, delta: StreamDelta, new_logprobs) -> dict | None:
        first = not choice.token_ids
        text = (echo[index // n] if echo and first else "") + delta.text
        if not text and not delta.finished and not (want_logprobs and new_logprobs):
            return None
        return {
            "index": index,
            "text": text,
            "logprobs": completion_logprobs(new_logprobs) if want_logprobs else None,
            **finish_fields(delta),
        }

    async for line in sse_events(deltas, base, include_usage, event, prompt_tokens):
        yield line
