"""The stored responses behind ``previous_response_id`` and ``GET``/``DELETE /v1/responses/{id}``: in memory,
least recently used out first, bounded by a count and by bytes. Entries belong to the API key that created
them (a digest of the ``Authorization`` header), so one key's client never reads another's."""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the response object as it was answered
    history: list[dict[str, Any]]  # the conversation as chat messages, this response's output included
    num_bytes: int


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

    def put(self, owner: str, response: dict[str, Any], history: list[dict[str, Any]]) -> bool:
        """Store (evicting the least recently used past the bounds); False when the entry alone is too big."""
        num_bytes = len(json.dumps(response, separators=(",", ":"))) + len(
            json.dumps(history, separators=(",", ":"))
        )
        if self.max_entries < 1 or num_bytes > self.max_bytes:
            return False
        key = (owner, response["id"])
        self.delete(owner, response["id"])
        self._entries[key] = StoredResponse(response, history, num_bytes)
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
