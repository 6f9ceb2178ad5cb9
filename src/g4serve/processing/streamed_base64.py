"""Base64 decoded while it arrives: a request body's large media strings are decoded chunk by chunk as the
HTTP body streams in (``server.body``), so no single step of the event loop decodes megabytes at once.

The parsed request holds the plain strings (``json.loads``'s values); what was decoded from them is
remembered for the request (``remember``, in a context variable: one table per request's task, keyed by
the string object itself), and ``decode_data_url`` / ``decode_base64`` in ``processing.chat`` take it from
there (``recall``) instead of decoding again. The streamed decoder only accepts what
``base64.b64decode(validate=True)`` accepts and decodes to the same bytes; on anything else (a character
outside the alphabet, padding before the end) it gives up, and the string is decoded the ordinary way,
with the ordinary error.
"""

from __future__ import annotations

import binascii
from contextvars import ContextVar

# id(text) -> (text, where its payload starts: 0 or after a data: URL's comma, the payload's bytes). The
# text is kept with its entry, so the id cannot be reused by another string while the entry lives.
_DECODED: ContextVar[dict[int, tuple[str, int, bytes]] | None] = ContextVar("g4serve_decoded", default=None)


def remember(text: str, payload_start: int, decoded: bytes) -> None:
    """``decoded`` is ``text[payload_start:]``'s base64 decoded, for the rest of this request's task."""
    table = _DECODED.get()
    if table is None:
        table = {}
        _DECODED.set(table)
    table[id(text)] = (text, payload_start, decoded)


def recall(text: str, payload_start: int) -> bytes | None:
    """What ``remember`` kept for this very string object and payload start, or None."""
    table = _DECODED.get()
    entry = table.get(id(text)) if table else None
    if entry is None or entry[0] is not text or entry[1] != payload_start:
        return None
    return entry[2]


class Base64Stream:
    """Decodes one string's base64 payload from the pieces of it fed in order. ``failed`` once a piece
    cannot be part of a payload ``b64decode(validate=True)`` accepts; ``close`` says whether all of it
    decoded, ``result`` gives the bytes."""

    __slots__ = ("_out", "_pending", "failed")

    def __init__(self) -> None:
        self._out: list[bytes] = []  # joined once at the end (a growing buffer would copy itself as it grew)
        self._pending = b""  # under 4 characters, or the padded last group
        self.failed = False

    def feed(self, piece: bytes) -> None:
        if self.failed:
            return
        data = self._pending + piece if self._pending else piece
        whole = len(data) - len(data) % 4
        if b"=" in data:  # padding: only the payload's last group may hold it
            whole = min(whole, data.index(b"=") // 4 * 4)
            if len(data) - whole > 4:
                self.failed = True
                return
        try:
            self._out.append(binascii.a2b_base64(data[:whole], strict_mode=True))
        except binascii.Error:
            self.failed = True
            return
        self._pending = bytes(data[whole:])

    def close(self) -> bool:
        """The payload is complete: whether all of it decoded (its bytes then in ``result``)."""
        if self.failed:
            return False
        if self._pending:
            if len(self._pending) != 4:  # b64decode: "Incorrect padding"
                self.failed = True
                return False
            try:
                self._out.append(binascii.a2b_base64(self._pending, strict_mode=True))
            except binascii.Error:
                self.failed = True
                return False
            self._pending = b""
        return True

    def result(self) -> bytes:
        """The decoded bytes, joined (``bytes.join`` lets go of the GIL on large joins: run it in a thread)"""
        return b"".join(self._out)
