"""The streaming body reader (``server.body``): whatever the body and wherever its chunks split, the parsed
value is ``json.loads``'s and every error the whole body's; base64 media decoded on the way give the bytes
``b64decode(validate=True)`` gives, and anything it refuses falls back to it; the event loop is yielded to
while a large body is scanned; a body of many short strings or escapes is not scanned string by string."""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import random

import pytest

from g4serve.processing.chat import decode_base64, decode_data_url
from g4serve.processing.streamed_base64 import Base64Stream, recall
from g4serve.server import body as body_module
from g4serve.server.body import JsonBodyReader, put_blobs
from g4serve.server.errors import APIError, parse_json_object


def _chunks(raw: bytes, rng: random.Random) -> list[bytes]:
    out, pos = [], 0
    while pos < len(raw):
        step = rng.choice([1, 2, 3, 7, 64, 1000, 4096])
        out.append(raw[pos : pos + step])
        pos += step
    return out


def _read(raw: bytes, rng: random.Random, **reader_args) -> dict:
    """Parse ``raw`` fed in random chunks, in a task of its own (as a request is), and decode its media
    there: (parsed value, {path: decoded bytes or the error message})."""

    async def run():
        reader = JsonBodyReader(**reader_args)
        for chunk in _chunks(raw, rng):
            await reader.feed(chunk)
        text, blobs = await reader.finish()
        value = put_blobs(parse_json_object(text), blobs)
        return value, {key: _decode(text) for key, text in _strings(value)}

    return asyncio.run(run())


def _strings(value, path="") -> list[tuple[str, str]]:
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in [(path + "/" + k, k), *_strings(v, path + "/" + k)]]
    if isinstance(value, list):
        return [s for i, v in enumerate(value) for s in _strings(v, f"{path}/{i}")]
    return [(path, value)] if isinstance(value, str) else []


def _decode(text: str):
    try:
        if text.startswith("data:"):
            return decode_data_url(text, "x")
        return decode_base64(text, "x")
    except ValueError as exc:
        return str(exc)


def _b64(rng: random.Random, n: int) -> str:
    return base64.b64encode(rng.randbytes(n)).decode()


def _string(rng: random.Random) -> str:
    kind = rng.randrange(12)
    n = rng.choice([0, 1, 5, 40, 300, 3000])
    if kind == 0:
        return "data:image/png;base64," + _b64(rng, n)
    if kind == 1:
        return _b64(rng, n)
    if kind == 2:  # padding in the middle, a character outside the alphabet, a missing '='
        broken = rng.choice(["QQ==", "Q", "QQ=", "@", " ", "\n", "=QQQ", "QQ==QQ=="])
        text = _b64(rng, n) + broken + _b64(rng, 3)
        return rng.choice(["", "data:audio/wav;base64,"]) + text
    if kind == 3:  # a data: URL that is not base64, or whose comma comes late
        return rng.choice(["data:text/plain,", "data:" + "x" * 300 + ";base64,"]) + _b64(rng, n)
    if kind == 4:  # text with escapes and non-ASCII
        return "".join(rng.choice(["a", '"', "\\", "\n", "é", "\u2028", "/", "\x01", "€"]) for _ in range(n))
    if kind == 5:  # what the reader's placeholders look like
        return f"\x00g4serve-blob:{rng.randbytes(8).hex()}:0"
    if kind == 6:
        return "data:image/png;base64," + "\u00e9" + _b64(rng, n)
    return "".join(rng.choice("abc xyz") for _ in range(n))


def _document(rng: random.Random, depth: int = 0):
    kind = rng.randrange(8 if depth < 4 else 3)
    if kind == 0:
        return _string(rng)
    if kind == 1:
        return rng.choice([0, -1.5, 1e300, True, False, None, 12345678901234567890])
    if kind == 2:
        return _b64(rng, rng.choice([10, 3000]))
    if kind in (3, 4):
        return [_document(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {_string(rng) if rng.random() < 0.3 else f"k{i}": _document(rng, depth + 1) for i in range(4)}


def _dumps(value, rng: random.Random) -> bytes:
    text = json.dumps({"doc": value}, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1]))
    if rng.random() < 0.3:  # another encoder's escapes: '/' as '\/'
        text = text.replace("/", "\\/")
    return text.encode()


@pytest.mark.parametrize("seed", range(40))
def test_any_body_any_split_parses_as_json_loads_and_decodes_as_b64decode(seed):
    rng = random.Random(seed)
    raw = _dumps(_document(rng), rng)
    want = json.loads(raw)
    got, decoded = _read(raw, rng, stream_from=rng.choice([0, 100]), min_blob=rng.choice([1, 16, 200]))
    assert got == want
    assert [type(s) for _, s in _strings(got)] == [str] * len(_strings(got))
    assert decoded == {key: _decode(text) for key, text in _strings(want)}


@pytest.mark.parametrize(
    "raw",
    [
        b'{"a": "' + b"QUJD" * 100,  # unterminated string
        b'{"a": "' + b"QUJD" * 100 + b'"',  # unterminated object
        b'{"a": "' + b"QUJD" * 100 + b'\x01"}',  # a control character in a string
        b'{"a": "' + b"QUJD" * 100 + b'", }',
        b'["' + b"QUJD" * 100 + b'"]',  # not an object
        b'{"a": "\\' + b"QUJD" * 100 + b'"}',  # an invalid escape
        b'{"a": "' + b"QUJD" * 100 + b'"}  x',
    ],
)
def test_malformed_bodies_fail_as_the_whole_body_does(raw):
    with pytest.raises(APIError) as whole:
        parse_json_object(raw)
    with pytest.raises(APIError) as streamed:
        _read(raw, random.Random(0), stream_from=0, min_blob=16)
    assert streamed.value.status == whole.value.status == 400
    assert streamed.value.param == whole.value.param == "body"
    assert streamed.value.args[0].split(":")[:2] == whole.value.args[0].split(":")[:2]


@pytest.mark.parametrize("seed", range(30))
def test_base64_stream_accepts_what_b64decode_validate_accepts(seed):
    rng = random.Random(seed)
    text = base64.b64encode(rng.randbytes(rng.randrange(0, 50))).decode()
    broken = rng.random() < 0.6
    if broken:  # somewhere
        at = rng.randrange(len(text) + 1)
        text = text[:at] + rng.choice(["=", "==", "A", "@", "\n", "===", "-"]) + text[at:]
    try:
        want = base64.b64decode(text, validate=True)
    except binascii.Error:
        want = None
    stream = Base64Stream()
    for piece in _chunks(text.encode(), rng):
        stream.feed(piece)
    got = stream.result() if stream.close() else None
    # where it gives up, the ordinary decode runs (b64decode also takes excess '=' at the end); where it
    # does not, its bytes are b64decode's
    assert got is None or got == want
    if not broken:
        assert got == want


def test_large_media_are_decoded_while_the_body_arrives_and_recalled_once():
    rng = random.Random(1)
    payload = rng.randbytes(3 << 20)
    url = "data:video/mp4;base64," + base64.b64encode(payload).decode()
    raw = json.dumps({"messages": [{"content": [{"video_url": {"url": url}}]}]}).encode()

    async def run():
        reader = JsonBodyReader()
        for chunk in _chunks(raw, rng):
            await reader.feed(chunk)
        text, blobs = await reader.finish()
        assert len(text) < 200 and len(blobs) == 1  # the media left the JSON text
        value = put_blobs(parse_json_object(text), blobs)
        got = value["messages"][0]["content"][0]["video_url"]["url"]
        assert got == url and recall(got, url.index(",") + 1) == payload
        assert decode_data_url(got, "x") is recall(got, url.index(",") + 1)  # not decoded again
        assert recall(url, url.index(",") + 1) is None  # an equal but other string: not this one
        return got

    got = asyncio.run(run())
    assert asyncio.run(_recall_elsewhere(got)) is None  # another request's task knows nothing of it


async def _recall_elsewhere(text):
    return recall(text, text.index(",") + 1)


def test_the_loop_runs_between_the_chunks_of_a_large_body():
    raw = json.dumps({"a": base64.b64encode(bytes(4 << 20)).decode()}).encode()
    beats = 0

    async def heartbeat(stop: asyncio.Event):
        nonlocal beats
        while not stop.is_set():
            beats += 1
            await asyncio.sleep(0)

    async def run():
        stop = asyncio.Event()
        task = asyncio.create_task(heartbeat(stop))
        await asyncio.sleep(0)
        start = beats
        reader = JsonBodyReader(yield_every=1 << 18)
        for i in range(0, len(raw), 1 << 16):  # chunks already there: no await would give way by itself
            await reader.feed(raw[i : i + (1 << 16)])
        text, blobs = await reader.finish()
        stop.set()
        await task
        return beats - start, put_blobs(parse_json_object(text), blobs)

    ran, value = asyncio.run(run())
    assert ran >= len(raw) // (1 << 18) - 1
    assert value == json.loads(raw)


def test_many_short_strings_or_escapes_go_to_json_loads_unscanned(monkeypatch):
    steps = 0
    real_add = body_module._LongString.add

    def counting_add(self, piece, min_blob):
        nonlocal steps
        steps += 1
        return real_add(self, piece, min_blob)

    monkeypatch.setattr(body_module._LongString, "add", counting_add)
    for raw in (
        json.dumps({"a": ["x"] * 250_000}).encode(),  # 1.5 MB of one-letter strings (under MAX_JSON_VALUES)
        json.dumps({"a": "\n" * 1_000_000}).encode(),  # 2 MB of escapes in one string
    ):
        steps = 0
        got, _ = _read(raw, random.Random(0))
        assert got == json.loads(raw)
        # the budget of the first MB scanned (64 + 1 MB / 256 strings or escapes, each one or two steps),
        # not a step per string
        assert steps < 10_000, steps


@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 250_000,  # nested past the depth limit, in a body large enough to be scanned
        b'{"a": ' + b'{"b": ' * 100_000 + b'"x"' + b"}" * 100_001,
        b'{"a": ["' + b'", "'.join([b"QUJD" * 20_000] * 8) + b'"], "b": ' + b"[" * 70 + b"]" * 70 + b"}",
    ],
)
def test_deep_large_bodies_are_refused_as_whole_ones_are(raw):
    """The scan does not track nesting: the depth limit still holds on what it leaves, blobs or not."""
    with pytest.raises(APIError) as whole:
        parse_json_object(raw)
    with pytest.raises(APIError) as streamed:
        _read(raw, random.Random(0))
    assert streamed.value.status == whole.value.status == 400
    assert "nested more than" in streamed.value.args[0] and "nested more than" in whole.value.args[0]
