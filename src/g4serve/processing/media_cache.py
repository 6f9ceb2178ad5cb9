"""Processed media kept by their encoded bytes, so a media item sent again skips its preparation.

A chat client sends the whole conversation at every turn, its images and videos included; an agent loop
re-sends the same screenshot. Decoding, resizing and cutting patches again costs a video of six 480p
frames ~5 ms on the GPU path and ~13 ms on the host's (``bench/preprocess_media.py``). This cache keys an
item by BLAKE3 over its modality, the request's ``MediaLimits`` (they decide refusals and audio
truncation) and its encoded bytes, and keeps what processing made of it: the encoder inputs in host
memory, the prompt text its soft tokens expand to, and what it charged to the request's media budget
(a hit charges the same, so a request is refused or admitted exactly as without the cache).

The key is also the item's content hash (the encoder cache's and the prefix cache's key): an item the
processor keys needs no read-back of its processed tensors to hash them. Only items given as bytes are
keyed (what the server's data URLs and uploads become); decoded images, arrays and local-file paths are
processed and hashed by content as before. Bounded by bytes (``--mm-processor-cache-gb``, as vLLM names
it), least recently used first out; thread-safe (the server's preprocessing threads share one).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import blake3
import torch

from g4serve.processing.limits import MediaLimits


@dataclass(frozen=True)
class CachedMedia:
    data: dict[str, torch.Tensor]  # the encoder inputs, in host memory
    content_hash: str
    expansion: str  # the prompt text the item's placeholder expands to
    pixels: int = 0  # charged to the request's MediaBudget when processed
    audio_samples: int = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.data.values()) + len(self.expansion)


def media_key(modality: str, parts: Sequence[bytes | bytearray], limits: MediaLimits) -> str:
    """The cache key and content hash of an item made of ``parts`` (one encoded file, or a video's frames)."""
    h = blake3.blake3(f"{modality}\0{limits!r}\0{len(parts)}".encode())
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return "raw:" + h.hexdigest(length=16)


def encoded_parts(value: object) -> list[bytes | bytearray] | None:
    """``value``'s encoded bytes as a key's parts: one file, or a list of encoded frames; None for anything
    else (decoded media, paths), which the processor does not key."""
    if isinstance(value, (bytes, bytearray)):
        return [value]
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, (bytes, bytearray)) for v in value):
        return list(value)
    return None


class MediaCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._items: OrderedDict[str, CachedMedia] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: str) -> CachedMedia | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return item

    def stats(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "bytes": self.bytes, "items": len(self._items)}

    def put(self, key: str, item: CachedMedia) -> None:
        """Keep ``item`` (its tensors must be on the host and never written again); one larger than the
        whole cache is not kept."""
        size = item.nbytes
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.bytes -= old.nbytes
            self._items[key] = item
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, evicted = self._items.popitem(last=False)
                self.bytes -= evicted.nbytes


def to_host(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Host copies of ``tensors`` for the cache: a device tensor is read back into pageable memory, as the
    content hash of its patches read it before the cache (page-locked copies measured no faster and would
    pin up to the cache's size); a host tensor is kept as it is, or cloned where it is a view into a larger
    batch (so the cache counts what it holds)."""
    out = {}
    for name, t in tensors.items():
        if t.is_cuda:
            out[name] = t.cpu()
        elif t.untyped_storage().nbytes() > t.numel() * t.element_size():
            out[name] = t.clone()
        else:
            out[name] = t
    return out


__all__ = ["CachedMedia", "MediaCache", "encoded_parts", "media_key", "to_host"]
