"""Whole (not streamed) answers as JSON written by ``json.dumps``, their long arrays a slice at a time.

A handler that returns a dict has FastAPI walk it in Python (``jsonable_encoder``) on the event loop before
it is dumped: 16 choices of 1,000 tokens with 20 top logprobs each (28 MB of JSON) held the loop 13.9 s on
the 2-core CPU, and every stream with it. ``json_response`` dumps in C instead, and an array given as
``JsonSlices`` (a choice's logprob entries) is rendered and dumped a slice at a time while the body is sent,
the event loop free between slices: the formatted entries and the whole text never exist at once.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi.responses import Response, StreamingResponse

# Items rendered and dumped between two turns of the event loop: 64 tokens of 20 top logprobs are ~1,300
# entries, ~16 ms on the 2-core CPU.
SLICE_ITEMS = 64


class JsonSlices:
    """A JSON array of ``render(items[i : i + SLICE_ITEMS])`` for each slice, made as the body is sent."""

    def __init__(self, items: Sequence, render: Callable[[Sequence], list]):
        self.items = items
        self.render = render


def _dumps(value: Any, default=None) -> str:
    # What Starlette's JSONResponse writes: UTF-8, no NaN, no spaces.
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"), default=default)


def json_body(content: Any) -> bytes:
    """``content`` as the JSON bytes ``json_response`` sends (no ``JsonSlices`` in it)."""
    return _dumps(content).encode()


def json_response(content: Any, status_code: int = 200) -> Response:
    """``content`` as a JSON response; its ``JsonSlices`` rendered while the body is sent (chunked)."""
    slices: list[JsonSlices] = []
    marker = f"\x00g4serve-slices:{secrets.token_hex(16)}"

    def default(value: Any) -> str:
        if not isinstance(value, JsonSlices):
            raise TypeError(f"{type(value).__name__} is not JSON serializable")
        slices.append(value)
        return marker

    text = _dumps(content, default)
    if not slices:
        return Response(text.encode(), status_code, media_type="application/json")
    # Each placeholder stands where its array goes; no client text holds the random marker.
    around = text.split(_dumps(marker))
    return StreamingResponse(_pieces(around, slices), status_code, media_type="application/json")


async def _pieces(around: list[str], slices: list[JsonSlices]) -> AsyncIterator[bytes]:
    yield around[0].encode()
    for array, after in zip(slices, around[1:]):
        separator = "["
        for start in range(0, len(array.items), SLICE_ITEMS):
            rendered = array.render(array.items[start : start + SLICE_ITEMS])
            if rendered:
                yield (separator + _dumps(rendered)[1:-1]).encode()
                separator = ","
            await asyncio.sleep(0)
        yield ("[]" if separator == "[" else "]").encode() + after.encode()
