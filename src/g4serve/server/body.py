"""Large JSON request bodies, read without stalling the event loop.

A chat request carrying a video is one JSON object with a string of tens of megabytes in it. Joined and
handed to ``json.loads``, then base64-decoded, it holds the event loop for about 100 ms on a small host:
every stream the server is writing waits that long. Threads do not help, as both calls keep the GIL.

``JsonBodyReader`` takes the body as it arrives instead. Small bodies are kept and parsed whole, as before.
Past ``stream_from`` bytes each chunk is scanned (C-speed ``find`` calls) for the string literals in it: a
string of at least ``min_blob`` bytes whose base64 payload (all of it, or what follows a data: URL's comma)
decodes strictly is decoded chunk by chunk as it arrives (``processing.streamed_base64``) and stands in
the JSON text as a short placeholder; everything else is passed through unchanged. ``json.loads`` then
parses the few kilobytes left, and the placeholders become the strings ``json.loads`` would have given,
their decoded bytes remembered for the request. The loop is yielded to every ``yield_every`` bytes scanned.

With ``digest`` (the router, which only keys requests) every long string without an escape is hashed as
it arrives instead, and stands in the parsed value as its first 4 KB followed by its digest: the key of a
media part then follows its content, and a long text turn keys by its leading characters as before,
without the router ever holding either as one string.

A string with an escape in it, or whose payload is not strict base64, stays in the JSON text: the value is
exactly what ``json.loads`` of the whole body gives, and so is every error (its position counted in the
shortened text). A body of many short strings, which the scan would only slow down, goes to ``json.loads``
as it is once the scan has met more strings and escapes than a budget per byte.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

from g4serve.processing.streamed_base64 import Base64Stream, remember

_QUOTE, _BACKSLASH = b'"', b"\\"
# A data: URL's header ("data:video/mp4;base64,") is found within this many bytes of the string's start.
_HEADER_BYTES = 256
# Digesting, a long string's stand-in starts with this many of its bytes: the affinity key reads the first
# 512 characters of a user turn (the router's default --prefix-chars), which fit in 4 KB of UTF-8.
_DIGEST_HEAD_BYTES = 4096


class Blob(NamedTuple):
    """What a placeholder stands for: the string (or, digesting, the digest's stand-in) and the bytes its
    payload decoded to (None when digesting)."""

    text: str
    payload_start: int
    decoded: bytes | None


class _Digest:
    """A long string's content hashed as it arrives (the router's affinity key needs no more of it)."""

    __slots__ = ("_hash",)

    def __init__(self) -> None:
        self._hash = hashlib.blake2b(digest_size=16)

    def feed(self, piece: bytes) -> None:
        self._hash.update(piece)  # hashlib lets go of the GIL for large pieces

    def close(self) -> bool:
        return True

    def result(self) -> str:
        return self._hash.hexdigest()


class _LongString:
    """The string literal being scanned: its raw JSON text (in pieces, joined once: a growing buffer would
    copy itself as it grew), and its payload decoded (or, ``digest``, hashed) as it arrives."""

    __slots__ = ("pieces", "head", "head_bytes", "size", "payload_start", "stream", "escaped", "digest")

    def __init__(self, digest: bool = False) -> None:
        self.pieces: list[bytes] = []
        self.head = b""  # the first head_bytes
        self.head_bytes = _DIGEST_HEAD_BYTES if digest else _HEADER_BYTES
        self.size = 0
        self.payload_start = 0
        self.stream: Base64Stream | _Digest | None = None
        self.escaped = False
        self.digest = digest

    def add(self, piece: bytes, min_blob: int) -> None:
        self.pieces.append(piece)
        self.size += len(piece)
        if len(self.head) < self.head_bytes:
            self.head = (self.head + piece)[: self.head_bytes]
        if self.escaped:
            return
        if self.stream is not None:
            self.stream.feed(piece)
        elif self.size >= min(min_blob, _HEADER_BYTES):
            self._start()

    def _start(self) -> None:
        if self.digest:
            self.stream = _Digest()
            self.stream.feed(b"".join(self.pieces))
            return
        self.payload_start = 0
        if self.head.startswith(b"data:"):
            comma = self.head.find(b",")
            if comma >= 0 and b";base64" in self.head[:comma]:
                self.payload_start = comma + 1
        self.stream = Base64Stream()
        self.stream.feed(b"".join(self.pieces)[self.payload_start :])

    def raw(self) -> bytes:
        return b"".join(self.pieces)

    def is_blob(self, min_blob: int) -> bool:
        """The finished string: whether it leaves the JSON text (long, no escape, its payload all decoded,
        a data: URL's header printable ASCII, as JSON's text of it is then the string itself)."""
        if self.escaped or self.size < min_blob:
            return False
        if self.stream is None:
            self._start()
        header = self.head[: self.payload_start]
        return self.stream.close() and header.isascii() and all(c >= 0x20 for c in header)

    async def blob(self) -> Blob:
        """The string and its decoded payload; the large joins in a thread, where they let go of the GIL
        (only the ASCII decoding of the text holds it). Digesting: the digest's stand-in."""
        if self.digest:  # its leading text, then the digest of all of it
            head = self.head.decode("utf-8", "ignore")
            return Blob(f"{head}\x00g4serve-digest:{self.stream.result()}", 0, None)
        raw = await asyncio.to_thread(b"".join, self.pieces)
        decoded = await asyncio.to_thread(self.stream.result)
        return Blob(str(raw, "ascii"), self.payload_start, decoded)


class JsonBodyReader:
    """Feed a body's chunks (``await feed(chunk)``), then ``await finish()``: the JSON text, and what its
    placeholders stand for (``put_blobs`` puts them back into the parsed value)."""

    def __init__(
        self,
        stream_from: int = 1 << 18,
        min_blob: int = 1 << 16,
        yield_every: int = 1 << 18,
        digest: bool = False,
    ):
        self.stream_from, self.min_blob, self.yield_every = stream_from, min_blob, yield_every
        self.digest = digest  # long strings become a digest's stand-in, not decoded (the router's key)
        self._kept: list[bytes] = []  # the body while it is small
        self._size = 0
        self._streaming = False
        self._text = bytearray()  # the JSON text, long strings replaced
        self._string: _LongString | None = None  # inside a string literal
        self._after_backslash = False  # the last chunk ended on an escape's backslash
        self._unyielded = 0
        self._scanned = 0
        self._events = 0  # strings closed and escapes met: the scan's Python-level steps
        self._passthrough = False  # too many short strings: the rest goes to json.loads as it is
        self._nonce = secrets.token_hex(8)
        self._blobs: dict[str, _LongString] = {}  # placeholder -> its string

    @property
    def size(self) -> int:
        return self._size

    async def feed(self, chunk: bytes) -> None:
        self._size += len(chunk)
        if not self._streaming:
            self._kept.append(chunk)
            if self._size < self.stream_from:
                return
            self._streaming = True
            chunk, self._kept = b"".join(self._kept), []
        self._scanned += len(chunk)
        if self._passthrough:
            self._text += chunk
        else:
            self._scan(chunk)
        self._unyielded += len(chunk)
        if self._unyielded >= self.yield_every:
            self._unyielded = 0
            await asyncio.sleep(0)  # queued chunks would otherwise be scanned back to back

    async def finish(self) -> tuple[bytes, dict[str, Blob]]:
        """The JSON text to parse, and what its placeholders stand for."""
        if not self._streaming:
            return b"".join(self._kept), {}
        if self._string is not None:  # unterminated string: json.loads reports it
            self._text += _QUOTE + self._string.raw()
            self._string = None
        return bytes(self._text), {key: await string.blob() for key, string in self._blobs.items()}

    def _scan(self, chunk: bytes) -> None:
        pos, end = 0, len(chunk)
        while pos < end:
            if self._events > 64 + self._scanned // 256:  # many short strings or escapes: json.loads wins
                self._pass_through(chunk[pos:])
                return
            if self._string is None:
                quote = chunk.find(_QUOTE, pos)
                if quote < 0:
                    self._text += chunk[pos:]
                    return
                self._text += chunk[pos:quote]
                self._string = _LongString(self.digest)
                pos = quote + 1
                continue
            if self._after_backslash:  # the escaped character (a \uXXXX's digits need no care)
                self._string.add(chunk[pos : pos + 1], self.min_blob)
                self._after_backslash = False
                pos += 1
                continue
            quote = chunk.find(_QUOTE, pos)
            stop = quote if quote >= 0 else end
            backslash = chunk.find(_BACKSLASH, pos, stop)
            if backslash >= 0:
                self._events += 1
                self._string.add(chunk[pos : backslash + 1], self.min_blob)
                self._string.escaped = True
                self._after_backslash = True
                pos = backslash + 1
                continue
            self._string.add(chunk[pos:stop], self.min_blob)
            if quote < 0:
                return
            self._close_string()
            pos = quote + 1

    def _pass_through(self, rest: bytes) -> None:
        """From here on the body's bytes go to ``json.loads`` as they are (a string begun so far too: its raw
        bytes are the body's)."""
        if self._string is not None:
            self._text += _QUOTE + self._string.raw()
            self._string = None
        self._text += rest
        self._passthrough = True

    def _close_string(self) -> None:
        string, self._string = self._string, None
        self._events += 1
        if not string.is_blob(self.min_blob):
            self._text += _QUOTE + string.raw() + _QUOTE
            return
        name = f"g4serve-blob:{self._nonce}:{len(self._blobs)}"
        self._blobs["\x00" + name] = string
        self._text += b'"\\u0000' + name.encode() + _QUOTE


async def read_into(reader: JsonBodyReader, stream: AsyncIterator[bytes], max_bytes: int) -> bool:
    """Feed ``stream`` to ``reader``; False as soon as it passes ``max_bytes``."""
    async for chunk in stream:
        if reader.size + len(chunk) > max_bytes:
            return False
        await reader.feed(chunk)
    return True


def put_blobs(value: Any, blobs: dict[str, Blob]) -> Any:
    """``value`` (parsed JSON) with every placeholder string replaced by its string, in place and without
    recursing; each one's decoded bytes are remembered for this request (``streamed_base64.remember``)."""
    if not blobs:
        return value
    for blob in blobs.values():
        if blob.decoded is not None:
            remember(blob.text, blob.payload_start, blob.decoded)
    texts = {key: blob.text for key, blob in blobs.items()}
    if isinstance(value, str):
        return texts.get(value, value)
    stack = [value]
    while stack:
        node = stack.pop()
        for key, child in _children(node, texts):
            if isinstance(child, str):
                if child in texts:
                    node[key] = texts[child]
            elif isinstance(child, (dict, list)):
                stack.append(child)
    return value


def _children(node: dict | list, texts: dict[str, str]) -> list[tuple[Any, Any]]:
    """(key or index, child) of ``node``; a dict with a placeholder among its keys is rebuilt first, in the
    same order, with the key's string."""
    if isinstance(node, list):
        return list(enumerate(node))
    if any(key in texts for key in node):
        pairs = [(texts.get(key, key), child) for key, child in node.items()]
        node.clear()
        node.update(pairs)
    return list(node.items())
