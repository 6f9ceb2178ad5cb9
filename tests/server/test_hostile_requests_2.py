"""Hostile requests, second audit (logprobs, the Responses store, JSON shapes, template kwargs) against the
live tiny-model server: each gets a 4xx naming its field (or a safe result) without stalling the event loop
or holding memory out of proportion, and the requests running beside it are unharmed."""

from __future__ import annotations

import asyncio
import gc
import json
import time
import weakref

import httpx
import pytest
from test_hostile_requests import _assert_unharmed, _beside_long_requests, _chat, _error

from g4serve.outputs import Logprob

BUDGET = 1 << 18  # errors.MAX_JSON_VALUES


def _values_body(unit: bytes, size: int = 4_000_000) -> bytes:
    """A chat body (under the fixture's 4 MiB limit) with a field of many small JSON values."""
    head = json.dumps(_chat())[:-1].encode() + b', "x": ['
    return head + unit * ((size - len(head)) // len(unit)) + b"0]}"


def test_a_body_of_many_small_values_is_refused_before_it_is_parsed(server):
    """A 64 MiB body of ``{},{},...`` (the default --max-request-body-bytes) took 3 GB and 40 s of the event
    loop to parse and shape-check (json_shape walks every value in Python): 1.6 s and 190 MB at the
    fixture's 4 MiB. Bodies of more than 2^18 objects, arrays and strings are a 400 naming ``body``, counted
    at C speed before json.loads runs; brackets inside a string do not count."""
    began = time.monotonic()
    long, bad = _beside_long_requests(
        server, [_values_body(b"{},"), _values_body(b"[],"), _values_body(b'"ab",')]
    )
    _assert_unharmed(long)
    for r in bad:
        assert r.status_code == 400, r.text[:300]
        assert _error(r)["param"] == "body" and f"more than {BUDGET}" in _error(r)["message"]
    assert time.monotonic() - began < 60
    # 300,000 brackets inside one string: one value. The prompt is refused for its length, not the body.
    text = {"model": "tiny", "prompt": "{[" * 150_000, "max_tokens": 1}
    r = httpx.post(f"{server.base_url}/v1/completions", json=text, timeout=60)
    assert r.status_code == 400 and _error(r)["param"] == "prompt", r.text[:300]


def test_tool_call_arguments_share_one_json_budget(server):
    """Tool-call ``arguments`` are JSON inside strings, parsed one by one: 300 strings of 1,001 values each
    (each under the limit) make the 300,000-value body the limit refuses."""
    args = json.dumps([{}] * 1000)
    messages = []
    for i in range(300):
        call = {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": args}}
        messages += [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [call]}]
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=_chat(messages=messages), timeout=60)
    assert r.status_code == 400, r.text[:300]
    assert _error(r)["param"] == "messages" and f"more than {BUDGET}" in _error(r)["message"]
    server.wait_idle()


def _entries(tokens: int, top: int = 20) -> list[dict[int, Logprob]]:
    entries = []
    for t in range(tokens):
        entry = {t: Logprob(-0.5, rank=1, decoded_token=f" w{t}")}
        entry |= {10_000 + r: Logprob(-1.0 - r, rank=r, decoded_token=f" alt{r}") for r in range(2, top + 1)}
        entries.append(entry)
    return entries


def test_a_long_logprob_answer_is_written_a_slice_at_a_time():
    """16 choices x 1,000 tokens x 20 top logprobs (28 MB of JSON), returned as a dict, were walked by
    FastAPI's jsonable_encoder on the event loop: 13.9 s of it (2-core CPU), every stream stalled behind it.
    Now the body is dumped in C and the logprob entries a slice of 64 tokens at a time while it is sent:
    the event loop runs between slices (a concurrent /health: 14.9 s -> 0.4 s), and the JSON is what it
    was."""
    from g4serve.server.json_body import SLICE_ITEMS, json_response
    from g4serve.server.serving_chat import chat_logprobs

    entries = _entries(2000)
    body = {"choices": [{"index": i, "logprobs": chat_logprobs(entries, whole=True)} for i in range(2)]}

    async def main() -> tuple[bytes, int]:
        ticks, done = 0, False

        async def tick() -> None:
            nonlocal ticks
            while not done:
                await asyncio.sleep(0)
                ticks += 1

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0)
        before = ticks
        chunks = [chunk async for chunk in json_response(body).body_iterator]
        turns = ticks - before
        done = True
        await ticker
        return b"".join(chunks), turns

    raw, turns = asyncio.run(main())
    expected = {"choices": [{"index": i, "logprobs": chat_logprobs(entries)} for i in range(2)]}
    assert json.loads(raw) == expected
    assert turns >= 2 * 2000 // SLICE_ITEMS  # the loop ran between every two slices


def test_whole_answers_with_logprobs_keep_their_shape(server):
    """Chat and completion answers written in slices (more than one: 100 tokens, 64 a slice) parse, with an
    entry per token."""
    chat = _chat(max_tokens=100, n=2, ignore_eos=True, logprobs=True, top_logprobs=3)
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=chat, timeout=120)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json", r.text[:300]
    for choice in r.json()["choices"]:
        content = choice["logprobs"]["content"]
        assert len(content) == 100 and all(len(c["top_logprobs"]) == 3 for c in content)
    completion = {"model": "tiny", "prompt": ["a", "b"], "max_tokens": 100, "ignore_eos": True, "logprobs": 2}
    r = httpx.post(f"{server.base_url}/v1/completions", json=completion, timeout=120)
    assert r.status_code == 200, r.text[:300]
    for choice in r.json()["choices"]:
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(logprobs["top_logprobs"]) == len(logprobs["text_offset"]) == 100
        assert all(1 <= len(top) <= 2 for top in logprobs["top_logprobs"])  # keyed by text: may collide
    server.wait_idle()


def test_whole_answers_bound_their_logprob_entries(server):
    """A non-streamed answer keeps every choice's logprob entries (~230 bytes each) until it is written:
    256 completions x 1,000 tokens x 21 entries (5.4M entries, 1.2 GB; 16 x 128k x 21 on the real context:
    10 GB) are a 400 naming ``logprobs`` that says to stream, before any work; streamed, they are sent and
    dropped as they come."""
    body = {"model": "tiny", "prompt": ["a"] * 16, "n": 16, "max_tokens": 1000, "logprobs": 20}
    began = time.monotonic()
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and _error(r)["param"] == "logprobs", r.text[:300]
    assert "stream" in _error(r)["message"] and time.monotonic() - began < 5
    with httpx.stream(
        "POST", f"{server.base_url}/v1/completions", json={**body, "stream": True}, timeout=60
    ) as streamed:
        assert streamed.status_code == 200
        next(streamed.iter_lines())  # then the client leaves: every completion is aborted
    server.wait_idle()


def test_the_same_bound_for_responses():
    """A response keeps its output whole (items, store, final event), so its bound is tighter: 2^18 entries.
    The tiny model's context (1,024) cannot reach it; the check is the chat one's, with that limit."""
    from g4serve.server.errors import APIError
    from g4serve.server.serving_base import check_logprob_entries
    from g4serve.server.serving_responses import MAX_RESPONSE_LOGPROB_ENTRIES

    check_logprob_entries(1, 12_483, 20, "top_logprobs", MAX_RESPONSE_LOGPROB_ENTRIES)
    with pytest.raises(APIError, match=r"top_logprobs: .* \(262164 entries\) exceed the 262144"):
        check_logprob_entries(1, 12_484, 20, "top_logprobs", MAX_RESPONSE_LOGPROB_ENTRIES)
    check_logprob_entries(16, 10**6, None, "logprobs")  # no logprobs, no bound


class _Unwalkable(dict):
    """A stored response that fails whoever walks it again."""

    def items(self):
        raise AssertionError("the stored response was encoded again")

    def __iter__(self):
        raise AssertionError("the stored response was encoded again")


def test_a_stored_response_is_served_as_it_was_written(server):
    """GET /v1/responses/{id} re-encoded the stored response each time (jsonable_encoder on the event loop):
    0.2-0.7 s a GET for 455 tokens with 20 top logprobs on the 2-core CPU, minutes for a response near the
    store's 256 MiB entry bound, and any client may repeat it. The JSON written when it was stored is sent."""
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 8, "temperature": 0}
    body |= {"include": ["message.output_text.logprobs"], "top_logprobs": 20}
    created = httpx.post(f"{server.base_url}/v1/responses", json=body, timeout=60)
    assert created.status_code == 200, created.text[:300]
    store = server.app.state.serving_responses.store
    entry = store.get(store.owner(None), created.json()["id"])
    assert json.loads(entry.body) == created.json()
    entry.response = _Unwalkable(entry.response)
    r = httpx.get(f"{server.base_url}/v1/responses/{created.json()['id']}", timeout=30)
    assert r.status_code == 200, r.text[:300]
    assert r.json() == created.json()
    server.wait_idle()


def test_responses_truncation_counts_messages_before_splitting_them(server, monkeypatch):
    """With truncation 'auto', each try of the search over turns split and checked every message it kept
    before counting them: 100,000 one-word items (3.4 MB) held the event loop 2.3 s. A try with more
    messages than a prompt takes is refused from its count."""
    from g4serve.server import serving_responses
    from g4serve.server.serving_chat import MAX_MESSAGES

    split = serving_responses.split_chat_messages
    sizes = []

    def counting(messages, **kwargs):
        sizes.append(len(messages))
        return split(messages, **kwargs)

    monkeypatch.setattr(serving_responses, "split_chat_messages", counting)
    items = [{"role": "user", "content": "a"}] * 20_000
    body = {"model": "tiny", "input": items, "max_output_tokens": 2, "truncation": "auto"}
    r = httpx.post(f"{server.base_url}/v1/responses", json=body, timeout=60)
    assert r.status_code == 200, r.text[:300]
    assert sizes and max(sizes) <= MAX_MESSAGES
    server.wait_idle()


TEMPLATE_KWARGS = [
    (_chat(chat_template_kwargs={"enable_thinking": "false"}), "chat_template_kwargs.enable_thinking"),
    (_chat(chat_template_kwargs={"enable_thinking": {"a": 1}}), "chat_template_kwargs.enable_thinking"),
    (_chat(chat_template_kwargs={"enable_thinking": True}, reasoning_effort="max"), "reasoning_effort"),
    (_chat(reasoning_effort="x" * 10_000), "reasoning_effort"),
]


@pytest.mark.parametrize("body,param", TEMPLATE_KWARGS, ids=["string", "object", "effort-beside", "long"])
def test_thinking_switches_are_typed(server, body, param):
    """``enable_thinking: "false"`` turned thinking on (any non-empty string is true to the template), and a
    ``reasoning_effort`` beside ``enable_thinking`` was never checked: each is a 400 naming its field."""
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text[:300]
    assert _error(r)["param"] == param and len(r.content) < 2000


def test_a_stream_does_not_keep_what_it_has_sent():
    """A streamed answer kept every token's logprob entries (~230 bytes each) in its choices to the end,
    where no answer-size bound applies: 16 choices of 128k tokens with 20 top logprobs, 10 GB. They are
    dropped once sent."""
    from g4serve.engine.async_engine import StreamDelta
    from g4serve.server.streaming import sse_events

    kept = []
    alive = []

    async def deltas():
        # The engine's whole list, as it hands it over; its sent entries already dropped (None).
        for i in range(50):
            entries = [None] * i + _entries(1)
            kept.append(weakref.ref(next(iter(entries[-1].values()))))
            yield 0, StreamDelta("r", "a", [i], False, None, None, 1, i + 1, logprobs=entries)
        gc.collect()  # every delta sent, the stream still open
        alive.append(sum(ref() is not None for ref in kept))

    def event(index, choice, delta, new_logprobs):
        return {"index": index}

    async def main() -> None:
        async for _ in sse_events(deltas(), {}, False, event):
            pass

    asyncio.run(main())
    assert alive == [1]  # the last delta's, still in hand


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/chat/completions", _chat(max_tokens=8)),
        (
            "/v1/completions",
            {"model": "tiny", "prompt": ["balance " * 50, "hi"], "max_tokens": 8, "echo": True},
        ),
    ],
    ids=["chat", "completions"],
)
def test_a_whole_answer_does_not_keep_the_request_body_while_it_waits(server, monkeypatch, path, body):
    """The body counts in the server's budget until the request is in the engine; a whole (not streamed)
    answer then waits for the generation, and its handler kept the parsed request (base64 media up to the
    body cap, a few hundred of them at once) and its rendered prompt alive the whole time, outside it."""
    from g4serve.server.serving_base import OpenAIServing

    requests, alive = [], []
    read, collect = OpenAIServing.read, OpenAIServing.collect

    async def reading(self, request, model):
        parsed = await read(self, request, model)
        requests.append(weakref.ref(parsed))
        return parsed

    async def collecting(self, *args, **kwargs):
        gc.collect()
        alive.append(requests[-1]() is not None)
        return await collect(self, *args, **kwargs)

    monkeypatch.setattr(OpenAIServing, "read", reading)
    monkeypatch.setattr(OpenAIServing, "collect", collecting)
    r = httpx.post(server.base_url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert alive == [False]
    if "prompt" in body:  # the echoed prompts are kept
        first, second = (c["text"] for c in r.json()["choices"])
        assert first.startswith("balance " * 50) and second.startswith("hi")
