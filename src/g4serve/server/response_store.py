"""The stored responses behind ``previous_response_id``, ``GET``/``DELETE /v1/responses/{id}`` and
``GET /v1/responses/{id}/input_items``: in memory, least recently used out first, bounded by a count and by
bytes. Entries belong to the API key that created them (a digest of the ``Authorization`` header), so one
key's client never reads another's."""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from g4serve.server.json_body import json_body


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the response object as it was answered
    history: list[dict[str, Any]]  # the conversation as chat messages, this response's output included
    num_bytes: int
    # The conversation's Responses items before this response's output (GET .../input_items).
    items: list[dict[str, Any]] = field(default_factory=list)
    # A background stream's newest server-sent events, for GET ?stream=true (else None).
    events: EventLog | None = None
    # The response as JSON, written once: GET answers these bytes (re-encoding a response of 455 tokens
    # with 20 top logprobs each held the event loop 0.2-0.7 s a GET on the 2-core CPU).
    body: bytes = b""


class EventLog:
    """A background stream's server-sent events, numbered from 0, of which the newest are kept: ``trim``
    drops the oldest (``first`` is then the number of the oldest kept). ``num_bytes``: the kept events'
    length (their JSON is ASCII). Iterating gives the kept events, oldest first."""

    def __init__(self) -> None:
        self._lines: list[str | None] = []  # _lines[i] is event _base + i (None once dropped)
        self._base = 0
        self.first = 0
        self.num_bytes = 0

    @property
    def end(self) -> int:
        """The number the next event gets."""
        return self._base + len(self._lines)

    def append(self, line: str) -> None:
        self._lines.append(line)
        self.num_bytes += len(line)

    def get(self, number: int) -> str | None:
        """Event ``number``, or None where it is dropped or not there yet."""
        return self._lines[number - self._base] if self.first <= number < self.end else None

    def trim(self, max_bytes: int, keep: int) -> int:
        """Drop the oldest events until at most ``max_bytes`` are kept, never the newest ``keep``; the bytes
        freed."""
        freed = 0
        while self.num_bytes > max_bytes and self.end - self.first > keep:
            i = self.first - self._base
            freed += len(self._lines[i])
            self._lines[i] = None
            self.first += 1
        self.num_bytes -= freed
        if self.first - self._base > len(self._lines) // 2:  # the list shrinks as it slides (amortized O(1))
            del self._lines[: self.first - self._base]
            self._base = self.first
        return freed

    def __iter__(self):
        return iter(self._lines[self.first - self._base :])


class ResponseStore:
    def __init__(self, max_entries: int, max_bytes: int):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def owner(authorization: str | None) -> str:
        """The key entries are filed under: the credential's digest (never the credential itself)."""
        return hashlib.sha256((authorization or "").encode()).hexdigest()

    def put(
        self,
        owner: str,
        response: dict[str, Any],
        history: list[dict[str, Any]],
        items: list[dict[str, Any]] | None = None,
        events: EventLog | None = None,
    ) -> bool:
        """Store (evicting the least recently used past the bounds); False when the entry alone is too big.
        Its bytes count every part: the response, the messages, the items and the events, each as JSON (so
        a media data URL counts in the messages and again in the items). Events that do not fit beside the
        rest are dropped, oldest first (the response is worth more than its replay)."""
        items = items or []
        body = json_body(response)
        num_bytes = len(body) + sum(len(json.dumps(part, separators=(",", ":"))) for part in (history, items))
        if events is not None:
            events.trim(max(self.max_bytes - num_bytes, 0), keep=0)
            num_bytes += events.num_bytes
        if self.max_entries < 1 or num_bytes > self.max_bytes:
            return False
        key = (owner, response["id"])
        self.delete(owner, response["id"])
        self._entries[key] = StoredResponse(response, history, num_bytes, items, events, body)
        self.num_bytes += num_bytes
        while len(self._entries) > self.max_entries or self.num_bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.num_bytes -= evicted.num_bytes
        return True

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        entry = self._entries.get((owner, response_id))
        if entry is not None:
            self._entries.move_to_end((owner, response_id))
        return entry

    def delete(self, owner: str, response_id: str) -> bool:
        entry = self._entries.pop((owner, response_id), None)
        if entry is None:
            return False
        self.num_bytes -= entry.num_bytes
        return True
