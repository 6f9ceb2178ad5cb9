"""The affinity key of a request (``g4serve.deploy.affinity``): sessions stick, conversations keep their key
as they grow, repeated images meet, different prefixes part, and no body makes the key function raise."""

from __future__ import annotations

import asyncio
import json
import random
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from g4serve.deploy.affinity import (
    MAX_PREFIX_MESSAGES,
    NO_KEY,
    AffinityKey,
    body_affinity,
    parse_object,
    request_affinity,
)
from g4serve.deploy.relay import read_body, request_key

SYSTEM = {"role": "system", "content": "You are a terse assistant for a bank."}
IMAGE_A = {
    "type": "image_url",
    "image_url": {"url": "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAAB"},
}
IMAGE_B = {
    "type": "image_url",
    "image_url": {"url": "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAIAAAAC"},
}


def key_of(body, headers=None, prefix_chars: int = 512) -> AffinityKey:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return request_affinity(headers or {}, raw, prefix_chars)


def chat(*messages, **fields) -> dict:
    return {"model": "tiny", "messages": list(messages), **fields}


def test_session_header_wins_over_body_and_user_field():
    body = chat(SYSTEM, {"role": "user", "content": "hi"}, user="alice")
    by_header = key_of(body, {"x-session-id": "s-1"})
    assert by_header.kind == "session"
    assert by_header == key_of(chat({"role": "user", "content": "something else"}), {"x-session-id": "s-1"})
    assert by_header != key_of(body, {"x-session-id": "s-2"})
    by_user = key_of(body)
    assert by_user.kind == "session" and by_user != by_header
    assert by_user == key_of(chat({"role": "user", "content": "other"}, user="alice"))
    # a blank session id or user is no session
    assert key_of(chat({"role": "user", "content": "hi"}, user="  "), {"x-session-id": " "}).kind == "prefix"


def test_replica_pin_wins_over_everything():
    key = key_of(
        chat({"role": "user", "content": "hi"}), {"x-g4serve-replica": "10.0.0.5:8000", "x-session-id": "s"}
    )
    assert key == AffinityKey("replica", "10.0.0.5:8000")


def test_a_conversation_keeps_its_key_as_it_grows():
    turn1 = [SYSTEM, {"role": "user", "content": "What is my balance?"}]
    turn2 = [
        *turn1,
        {"role": "assistant", "content": "100 EUR."},
        {"role": "user", "content": "And savings?"},
    ]
    assert key_of(chat(*turn1)) == key_of(chat(*turn2))
    assert key_of(chat(*turn1)).kind == "prefix"
    # sampling fields are not the prefix
    assert key_of(chat(*turn1, temperature=0.3, max_tokens=9, stream=True)) == key_of(chat(*turn1))


def test_a_cache_salt_parts_prefixes():
    """Blocks are shared only under one salt, so a salted prefix meets its cache where its salt went."""
    turn = [SYSTEM, {"role": "user", "content": "hello"}]
    plain = key_of(chat(*turn))
    salted = key_of(chat(*turn, cache_salt="tenant-a"))
    assert salted.kind == "prefix" and salted != plain
    assert salted == key_of(chat(*turn, cache_salt="tenant-a"))
    assert salted != key_of(chat(*turn, cache_salt="tenant-b"))
    completion = {"model": "tiny", "prompt": "hi"}
    assert key_of({**completion, "cache_salt": "a"}) != key_of(completion)


def test_prefix_parts_that_change_the_cached_prompt_change_the_key():
    base = key_of(chat(SYSTEM, {"role": "user", "content": "hello"}))
    assert base != key_of(
        chat({"role": "system", "content": "Other system"}, {"role": "user", "content": "hello"})
    )
    assert base != key_of(chat(SYSTEM, {"role": "user", "content": "goodbye"}))
    assert base != key_of({**chat(SYSTEM, {"role": "user", "content": "hello"}), "model": "adapter-1"})
    tools = [{"type": "function", "function": {"name": "get_balance", "parameters": {}}}]
    assert base != key_of(chat(SYSTEM, {"role": "user", "content": "hello"}, tools=tools))


def test_only_the_leading_prefix_chars_of_the_first_user_turn_count():
    long_a = "Summarize the following document. " + "x" * 600 + " ending A"
    long_b = "Summarize the following document. " + "x" * 600 + " ending B"
    assert key_of(chat({"role": "user", "content": long_a})) == key_of(
        chat({"role": "user", "content": long_b})
    )
    assert key_of(chat({"role": "user", "content": long_a}), prefix_chars=2000) != key_of(
        chat({"role": "user", "content": long_b}), prefix_chars=2000
    )


def test_questions_about_one_image_share_a_key_and_other_images_do_not():
    def ask(text, image):
        return chat(SYSTEM, {"role": "user", "content": [{"type": "text", "text": text}, image]})

    assert key_of(ask("Describe this.", IMAGE_A)) == key_of(ask("What colour is the car?", IMAGE_A))
    assert key_of(ask("Describe this.", IMAGE_A)) != key_of(ask("Describe this.", IMAGE_B))
    # a text-only turn keys on its text, not as an image turn would
    assert key_of(chat(SYSTEM, {"role": "user", "content": "Describe this."})) != key_of(
        ask("Describe this.", IMAGE_A)
    )


def test_completions_and_responses_bodies():
    prompt = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 5}
    assert key_of(prompt) == key_of({**prompt, "max_tokens": 50})
    assert key_of(prompt) != key_of({**prompt, "prompt": "Far away"})
    assert key_of({"prompt": ["Once upon a time", "x"]}) == key_of({"prompt": "Once upon a time"})
    assert key_of({"prompt": [1, 2, 3]}).kind == "prefix"
    assert key_of({"prompt": [1, 2, 3]}) != key_of({"prompt": [1, 2, 4]})
    assert key_of({"prompt": [[1, 2], [3]]}) == key_of({"prompt": [1, 2]})
    responses = {"model": "tiny", "instructions": "Be brief.", "input": "Hello"}
    assert key_of(responses).kind == "prefix"
    assert key_of(responses) == key_of({**responses, "max_output_tokens": 3})
    assert key_of(responses) != key_of({**responses, "instructions": "Be long."})
    items = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "Hello"}]}]}
    assert key_of(items) == key_of({"input": "Hello"})


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"not json",
        b"[1, 2, 3]",
        b'"a string"',
        b"{" * 100_000,  # the parser's recursion limit, far past any real body
        b'{"messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
        b'{"messages": "not a list"}',
        b'{"messages": [1, null, "x", [], {"role": 5, "content": {"a": 1}}]}',
        b'{"messages": [{"role": "user", "content": [1, null, {"type": 7}, {"type": "text", "text": 9}]}]}',
        b'{"prompt": {"weird": true}}',
        b'{"prompt": []}',
        b'{"input": 12, "instructions": ["x"]}',
        b'{"messages": [{"role": "user", "content": "\\ud800 lone surrogate"}]}',
        b'{"messages": [], "tools": [{"x": NaN}]}',
        b"\xff\xfe\x00garbage",
        b'{"user": 12, "model": ["m"]}',
        b'{"a": ' + b"9" * 5000 + b"}",  # past Python's int-conversion digit limit
    ],
)
def test_hostile_bodies_get_a_key_or_none_and_never_raise(raw):
    key = key_of(raw)
    assert key.kind in ("prefix", "none")


def test_non_chat_bodies_have_no_key():
    assert key_of(b"") == NO_KEY
    assert key_of({"file": "x"}) == NO_KEY  # not a generation request


def test_a_huge_conversation_reads_only_its_first_messages():
    filler = [{"role": "system", "content": f"rule {i}"} for i in range(MAX_PREFIX_MESSAGES)]
    a = key_of(chat(*filler, {"role": "user", "content": "A"}))
    b = key_of(chat(*filler, {"role": "user", "content": "B"}))
    assert a == b  # the first user turn is past the searched messages: the system turns decide


def test_random_json_never_raises():
    rng = random.Random(0)

    def junk(depth: int):
        choice = rng.randrange(7 if depth < 6 else 4)
        if choice == 0:
            return rng.randrange(-5, 5)
        if choice == 1:
            return rng.choice(["", "user", "system", "text", "image_url", "\u00e9"])
        if choice == 2:
            return None
        if choice == 3:
            return rng.random() < 0.5
        if choice == 4:
            return [junk(depth + 1) for _ in range(rng.randrange(4))]
        keys = ["role", "content", "type", "text", "messages", "prompt", "input", "user", "tools", "model"]
        return {rng.choice(keys): junk(depth + 1) for _ in range(rng.randrange(5))}

    for _ in range(2000):
        body = {rng.choice(["messages", "prompt", "input", "user", "model"]): junk(0) for _ in range(3)}
        assert body_affinity(body).kind in ("prefix", "session", "none")


def _deepest_parsed_in_a_thread() -> int:
    """The deepest nesting ``parse_object`` takes at the top of a worker thread's stack."""

    def deepest() -> int:
        depth = sys.getrecursionlimit()
        while parse_object(b'{"a": ' + b"[" * depth + b"]" * depth + b"}") is None:
            depth -= 5
        return depth

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(deepest).result()


@pytest.mark.parametrize("field", ["model", "prompt", "instructions", "text"])
def test_nesting_parsed_in_a_worker_thread_never_makes_the_key_raise(field):
    """The router parses a body past 256 KB in a worker thread, whose stack is shallow, and keys it on the
    event loop, deeper: ``repr`` of a non-string value as deep as that parser took (the ``model``, a token
    id, a text part's ``text``) raised RecursionError there, a 500 from the router for a body the replica
    should have answered (a 400)."""
    depth = _deepest_parsed_in_a_thread()
    nested = "[" * depth + "]" * depth
    raw = {
        "model": '{"model": %s, "messages": []}',
        "prompt": '{"prompt": [1, %s]}',
        "instructions": '{"input": "hi", "instructions": %s}',
        "text": '{"messages": [{"role": "user", "content": [{"type": "text", "text": %s}]}]}',
    }[field] % nested
    with ThreadPoolExecutor(1) as pool:
        payload = pool.submit(parse_object, raw.encode()).result()
    assert payload is not None

    def keyed_deeper(frames: int) -> AffinityKey:  # the event loop's stack under uvicorn and Starlette
        return body_affinity(payload) if frames == 0 else keyed_deeper(frames - 1)

    assert keyed_deeper(100).kind == "prefix"


class _Streamed:
    """What the router reads of a request: its headers and its body in chunks."""

    def __init__(self, raw: bytes, headers=None, chunk: int = 1 << 16):
        self.raw, self.headers, self.chunk = raw, headers or {}, chunk

    async def stream(self):
        for i in range(0, len(self.raw), self.chunk):
            yield self.raw[i : i + self.chunk]


def _routed(body: dict | bytes, headers=None, chunk: int = 1 << 16) -> tuple[bytes, AffinityKey]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = _Streamed(raw, headers, chunk)

    async def run():
        read = await read_body(request, 64 << 20)
        return read.raw, request_key(request, read, 512)

    return asyncio.run(run())


def test_large_media_are_keyed_by_their_digest_as_they_stream_in():
    """A body past 256 KB is read by the digesting body reader: its media strings are hashed as they arrive,
    never parsed whole. The forwarded bytes are the body's; the same image keys alike whatever follows it,
    another image apart; small bodies key exactly as before."""
    rng = random.Random(0)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "QUJD" * 150_000}}
    other = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "QUJE" * 150_000}}
    keys = []
    for part, question in ((image, "what is it?"), (image, "and its colour?"), (other, "what is it?")):
        body = chat(SYSTEM, {"role": "user", "content": [part, {"type": "text", "text": question}]})
        raw, key = _routed(body)
        assert raw == json.dumps(body).encode()
        assert key.kind == "prefix"
        keys.append(key)
    assert keys[0] == keys[1] != keys[2]
    small = chat(SYSTEM, {"role": "user", "content": [IMAGE_A, {"type": "text", "text": "?"}]})
    assert _routed(small) == (json.dumps(small).encode(), key_of(small))
    assert _routed(small, {"x-session-id": "s1"})[1] == key_of(small, {"x-session-id": "s1"})
    # a long text turn keys by its leading characters, as a short one does
    for text in ("yes " * 100_000, "été " * 100_000):  # raw UTF-8 in the body: no escape
        long_text = json.dumps(chat(SYSTEM, {"role": "user", "content": text}), ensure_ascii=False).encode()
        assert _routed(long_text)[1] == key_of(long_text)
    # an escaped long string (another encoder's '\/') stays in the text: keyed from the whole value
    escaped = json.dumps(chat(SYSTEM, {"role": "user", "content": "a/" * 200_000})).replace("/", "\\/")
    raw, key = _routed(escaped.encode(), chunk=rng.choice([1000, 1 << 16]))
    assert raw == escaped.encode() and key == key_of(escaped.encode())


@pytest.mark.parametrize("raw", [b"[" * 400_000, b'{"messages": ["' + b"x" * 300_000, b"\xff\xfe" * 200_000])
def test_large_hostile_bodies_are_forwarded_as_they_came_without_a_key(raw):
    """Past 256 KB the router scans as it reads: a body too deep, unterminated or not UTF-8 still reaches
    the replica byte for byte (which answers the 400), keyed by nothing."""
    forwarded, key = _routed(raw)
    assert forwarded == raw and key == NO_KEY
