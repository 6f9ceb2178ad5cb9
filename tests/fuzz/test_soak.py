"""Soak: at once, many concurrent streaming chats (small max_tokens), streams the client closes mid-way, and
a steady flow of malformed requests. Afterwards the engine holds no request and every KV block is free,
every well-formed stream got a 200 with all its tokens, every malformed request a 4xx, and the process RSS
(the server runs in this process) grew less than ``RSS_BOUND_MB`` over its value after a warm-up round.

Sizes: ``soak_streams``/``soak_cancels`` of fuzzlib (60 + 20 in CI, 300 + 100 with G4SERVE_FUZZ=full).
"""

from __future__ import annotations

import asyncio
import gc
import json
import time

import httpx
import pytest
from fuzzlib import MAX_BODY_BYTES, check_error_body, server_helpers, size, sse_payloads

RSS_BOUND_MB = 300
MAX_TOKENS = 6
CHAT = "/v1/chat/completions"


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def _chat(i: int) -> dict:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": f"Soak request {i}: what is my balance?"}],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0.7,
        "seed": i,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


_GOOD = json.dumps(_chat(0)).encode()
MALFORMED: list[tuple[str, bytes]] = [
    ("bad json", b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}'),
    ("not an object", b"[1, 2, 3]"),
    ("empty body", b""),
    ("wrong type max_tokens", _GOOD.replace(b'"max_tokens": 6', b'"max_tokens": "six"')),
    ("wrong type messages", b'{"messages": "hello", "max_tokens": 2}'),
    ("wrong type stream", _GOOD.replace(b'"stream": true', b'"stream": "yes"')),
    ("huge max_tokens", _GOOD.replace(b'"max_tokens": 6', b'"max_tokens": 18446744073709551616')),
    ("huge n", _GOOD.replace(b'"max_tokens": 6', b'"max_tokens": 6, "n": 18446744073709551616')),
    ("negative max_tokens", _GOOD.replace(b'"max_tokens": 6', b'"max_tokens": -5')),
    ("unknown model", _GOOD.replace(b'"model": "tiny"', b'"model": "no-such-model"')),
    ("unknown role", _GOOD.replace(b'"role": "user"', b'"role": "wizard"')),
    ("oversized", b'{"messages": [], "pad": "' + b"a" * (MAX_BODY_BYTES + 1) + b'"}'),
]


async def _stream(client: httpx.AsyncClient, i: int) -> tuple[int, int, str | None, bool]:
    """(status, completion tokens from usage, finish reason, saw [DONE])."""
    async with client.stream("POST", CHAT, json=_chat(i)) as resp:
        text = (await resp.aread()).decode()
    if resp.status_code != 200:
        return resp.status_code, -1, text[:300], False
    payloads = sse_payloads(text)
    usage = next((p["usage"] for p in payloads if isinstance(p, dict) and p.get("usage")), None)
    finish = [c.get("finish_reason") for p in payloads if isinstance(p, dict) for c in p.get("choices", [])]
    finish = [f for f in finish if f]
    tokens = (usage or {}).get("completion_tokens", -1)
    return 200, tokens, finish[-1] if finish else None, payloads[-1] == "[DONE]"


async def _cancelled(client: httpx.AsyncClient, i: int) -> int:
    """Open a stream, read its first event, then close the connection mid-stream."""
    async with client.stream("POST", CHAT, json=_chat(10_000 + i)) as resp:
        status = resp.status_code
        async for _line in resp.aiter_lines():
            break
    return status  # leaving the block closes the response (and its connection) before the stream ends


async def _malformed(base_url: str, stop: asyncio.Event, answers: list) -> None:
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        i = 0
        while not stop.is_set() or i < len(MALFORMED):
            name, raw = MALFORMED[i % len(MALFORMED)]
            resp = await client.post(CHAT, content=raw, headers={"content-type": "application/json"})
            answers.append((name, resp.status_code, resp.text))
            i += 1
            await asyncio.sleep(0.01)


async def _round(base_url: str, streams: int, cancels: int) -> tuple[list, list, list]:
    limits = httpx.Limits(max_connections=streams + cancels + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as client:
        stop, bad = asyncio.Event(), []
        flood = asyncio.create_task(_malformed(base_url, stop, bad))
        good_tasks = [asyncio.create_task(_stream(client, i)) for i in range(streams)]
        cancel_tasks = [asyncio.create_task(_cancelled(client, i)) for i in range(cancels)]
        good = await asyncio.gather(*good_tasks)
        cancelled = await asyncio.gather(*cancel_tasks)
        stop.set()
        await flood
    return good, cancelled, bad


@pytest.fixture(scope="module")
def soak_server(tiny_model_dir):
    helpers = server_helpers()
    running, thread = helpers.start_server(
        tiny_model_dir,
        "--served-model-name",
        "tiny",
        "--max-model-len",
        "256",
        "--max-request-body-bytes",
        str(MAX_BODY_BYTES),
        "--max-num-seqs",
        "64",
    )
    yield running
    helpers.stop_server(running, thread)


def test_soak(soak_server):
    streams, cancels = size("soak_streams"), size("soak_cancels")
    asyncio.run(_round(soak_server.base_url, size("soak_warmup"), size("soak_warmup") // 4))
    soak_server.wait_idle(timeout_s=60)
    gc.collect()
    before = rss_mb()
    began = time.monotonic()
    good, cancelled, bad = asyncio.run(_round(soak_server.base_url, streams, cancels))
    elapsed = time.monotonic() - began
    soak_server.wait_idle(timeout_s=60)  # 0 running, 0 waiting, every KV block free
    engine = soak_server.engine
    assert not engine.requests
    gc.collect()
    grown = rss_mb() - before
    print(
        f"soak: {streams} streams + {cancels} cancelled + {len(bad)} malformed in {elapsed:.1f} s; "
        f"RSS {before:.0f} MB -> +{grown:.0f} MB"
    )

    failures = [(i, g) for i, g in enumerate(good) if g != (200, MAX_TOKENS, "length", True)]
    assert not failures, f"{len(failures)}/{streams} streams not (200, {MAX_TOKENS} tokens): {failures[:5]}"
    assert all(status == 200 for status in cancelled), cancelled
    assert len(bad) >= len(MALFORMED)
    for name, status, text in bad:
        assert 400 <= status < 500, f"malformed request {name!r}: {status} {text[:300]}"
        check_error_body(status, text, name)
    assert grown < RSS_BOUND_MB, f"RSS grew by {grown:.0f} MB over the soak (bound {RSS_BOUND_MB} MB)"
    health = httpx.get(soak_server.base_url + "/health", timeout=30)
    assert health.status_code == 200
