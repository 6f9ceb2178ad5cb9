"""What chat and completion responses share: a choice accumulating its stream's deltas, logprob entries,
and the server-sent-event framing of a streamed response (a chunk per delta, then usage and ``[DONE]``)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from g4serve.engine.async_engine import EngineDeadError, StreamDelta
from g4serve.outputs import Logprob
from g4serve.server.protocol import usage

_MIN_LOGPROB = -9999.0  # JSON has no -inf; masked tokens report this floor (as vLLM does)


@dataclass
class Choice:
    """What one completion choice accumulates while its stream runs."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_forced_tokens: int = 0  # of token_ids, those jump-forward appended


def accumulate(choice: Choice, delta: StreamDelta, keep_logprobs: bool = True) -> None:
    choice.text.append(delta.text)
    if keep_logprobs:
        choice.logprobs.extend(delta_logprobs(choice, delta))
    choice.token_ids.extend(delta.token_ids)
    choice.num_forced_tokens = delta.num_forced_tokens
    if delta.finished:
        choice.finish_reason, choice.stop_reason = delta.finish_reason, delta.stop_reason


def delta_logprobs(choice: Choice, delta: StreamDelta) -> list[dict[int, Logprob]]:
    """The delta's tokens' logprobs (the engine hands over those of the delta's tokens only)."""
    return list(delta.logprobs or ())


def safe_logprob(logprob: float) -> float:
    # NaN to the floor too: JSON has no NaN, and a whole answer's entries are written after its status.
    return logprob if logprob >= _MIN_LOGPROB else _MIN_LOGPROB


def ranked(entry: dict[int, Logprob]) -> list[Logprob]:
    return [lp for lp in sorted(entry.values(), key=lambda lp: lp.rank or 0) if lp.rank is not None]


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def sse_error(exc: BaseException) -> str:
    status = 503 if isinstance(exc, EngineDeadError) else 500
    return sse({"error": {"message": str(exc), "type": "InternalServerError", "param": None, "code": status}})


async def sse_events(
    deltas: AsyncIterator[tuple[int, StreamDelta]],
    base: dict,
    include_usage: bool,
    choice_event,
    prompt_tokens: int | None = None,
    count_reasoning=None,
) -> AsyncIterator[str]:
    """Server-sent events of one response: a chunk per delta that ``choice_event(index, choice, delta,
    new_logprobs)`` turns into a choice (None: nothing to send yet), then usage and ``[DONE]``.
    ``count_reasoning(token_ids)``: a choice's reasoning tokens, for usage (None: not reported)."""
    extra = {"usage": None} if include_usage else {}
    choices: dict[int, Choice] = {}
    cached = 0
    try:
        async for index, delta in deltas:
            choice = choices.setdefault(index, Choice())
            new_logprobs = delta_logprobs(choice, delta)
            event = choice_event(index, choice, delta, new_logprobs)
            # Sent, so not kept: a stream would otherwise hold every token's logprob entries to its end
            # (~230 bytes an entry; no answer-size bound applies to a stream).
            accumulate(choice, delta, keep_logprobs=False)
            cached = delta.num_cached_tokens
            if prompt_tokens is None:  # chat: one prompt, shared by the choices
                prompt_tokens = delta.num_prompt_tokens
            if event is not None:
                yield sse({**base, "choices": [event], **extra})
    except (EngineDeadError, RuntimeError) as exc:
        yield sse_error(exc)
        yield "data: [DONE]\n\n"
        return
    finally:
        await deltas.aclose()
    if include_usage:
        completion_tokens = sum(len(c.token_ids) for c in choices.values())
        forced = sum(c.num_forced_tokens for c in choices.values())
        reasoning = (
            None if count_reasoning is None else sum(count_reasoning(c.token_ids) for c in choices.values())
        )
        total = usage(prompt_tokens or 0, completion_tokens, cached, forced, reasoning)
        yield sse({**base, "choices": [], "usage": total})
    yield "data: [DONE]\n\n"


def finish_fields(delta: StreamDelta) -> dict[str, Any]:
    if not delta.finished:
        return {"finish_reason": None}
    return {"finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason}
