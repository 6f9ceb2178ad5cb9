"""A flood of new JSON schemas on the server: past ``COMPILES_WAITING`` new grammars at once a request is a
429 with ``Retry-After`` naming ``response_format``, and plain requests are answered meanwhile."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from g4serve.engine.async_engine import COMPILES_WAITING
from g4serve.structured.backend import StructuredOutputBackend

SLOW_S = 1.5


@pytest.fixture
def slow_compiles(monkeypatch):
    compile_uncached = StructuredOutputBackend._compile_uncached

    def slow(backend, spec):
        time.sleep(SLOW_S)
        return compile_uncached(backend, spec)

    monkeypatch.setattr(StructuredOutputBackend, "_compile_uncached", slow)


def _schema_request(i: int) -> dict:
    schema = {
        "type": "object",
        "properties": {f"server_{i}": {"type": "integer"}},
        "required": [f"server_{i}"],
    }
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "a number"}],
        "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
    }


def test_a_schema_flood_is_refused_with_retry_after_and_text_is_served(server, slow_compiles):
    async def main():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            flood = [
                asyncio.ensure_future(client.post("/v1/chat/completions", json=_schema_request(i)))
                for i in range(COMPILES_WAITING + 3)
            ]
            await asyncio.sleep(0.3)
            began = time.monotonic()
            plain = await client.post(
                "/v1/chat/completions",
                json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            )
            plain_s = time.monotonic() - began
            return plain, plain_s, await asyncio.gather(*flood)

    plain, plain_s, answers = asyncio.run(main())
    assert plain.status_code == 200 and plain_s < SLOW_S / 2, (plain.status_code, plain_s)
    busy = [a for a in answers if a.status_code == 429]
    assert len(busy) == 3, [a.status_code for a in answers]
    assert busy[0].headers["retry-after"] == "1"
    error = busy[0].json()["error"]
    assert error["param"].startswith("response_format") and "new grammars are compiling" in error["message"]
    assert sum(a.status_code == 200 for a in answers) == COMPILES_WAITING
