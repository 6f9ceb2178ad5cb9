"""Processed media kept by their encoded bytes, so a media item sent again skips its preparation.

A chat client sends the whole conversation at every turn, its images and videos included; an agent loop
re-sends the same screenshot. Decoding, resizing and cutting patches again costs a video of six 480p
frames ~5 ms on the GPU path and ~13 ms on the host's (``bench/preprocess_media.py``). This cache keys an
item by BLAKE3 over its modality, the request's ``MediaLimits`` (they decide refusals and audio
truncation) and its encoded bytes, and keeps what processing made of it: the encoder inputs in host
memory, the prompt text its soft tokens expand to, and what it charged to the request's media budget
(a hit charges the same, so a request is refused or admitted exactly as without the cache). Items prepared
on the GPU are read back to the host on the cache's own thread (``MediaCache.put``): the request that
prepared them does not wait for that copy (~1 ms of a video's ~5 ms preparation), a hit on an item still
being copied waits for it.

The key is also the item's content hash (the encoder cache's and the prefix cache's key): an item the
processor keys needs no read-back of its processed tensors to hash them. Only items given as bytes are
keyed (what the server's data URLs and uploads become); decoded images, arrays and local-file paths are
processed and hashed by content as before. Bounded by bytes (``--mm-processor-cache-gb``, as vLLM names
it), least recently used first out; thread-safe (the server's preprocessing threads share one).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import blake3
import torch

from g4serve.processing.limits import MediaLimits

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CachedMedia:
    data: dict[str, torch.Tensor]  # the encoder inputs (in host memory once kept: MediaCache.put)
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
        # key -> (bytes, the item, or the future of its host copy while the copier makes it)
        self._items: OrderedDict[str, tuple[int, CachedMedia | Future[CachedMedia]]] = OrderedDict()
        self._lock = threading.Lock()
        self._copier: ThreadPoolExecutor | None = None

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: str) -> CachedMedia | None:
        """The item kept under ``key``; one whose host copy is still being made is waited for (a read-back
        of a few MB), one whose copy failed is dropped and counts as a miss."""
        with self._lock:
            entry = self._items.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
        item = entry[1]
        if isinstance(item, Future):
            try:
                item = item.result()
            except Exception:  # the copy failed (logged by the copier): as if never kept
                with self._lock:
                    if self._items.get(key) is entry:
                        del self._items[key]
                        self.bytes -= entry[0]
                    self.misses += 1
                return None
        with self._lock:
            self.hits += 1
        return item

    def stats(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "bytes": self.bytes, "items": len(self._items)}

    def put(self, key: str, item: CachedMedia, later: bool | None = None) -> None:
        """Keep ``item``; one larger than the whole cache is not kept. Its tensors must never be written
        again and, where on a device, finished (their stream synchronised). Device tensors are copied to the
        host on the cache's own thread and stream (``later``; None: where any tensor is off the host), so
        the request that made them goes on to the engine without waiting for their read-back."""
        size = item.nbytes
        if size > self.max_bytes:
            return
        if later is None:
            later = any(t.device.type != "cpu" for t in item.data.values())
        if later:
            if self._copier is None:
                with self._lock:
                    if self._copier is None:
                        self._copier = ThreadPoolExecutor(1, thread_name_prefix="g4-media-cache")
            kept: CachedMedia | Future[CachedMedia] = self._copier.submit(_host_copy, item)
        else:
            kept = replace(item, data=to_host(item.data))
        entry = (size, kept)
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.bytes -= old[0]
            self._items[key] = entry
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, evicted = self._items.popitem(last=False)
                self.bytes -= evicted[0]


_copy_streams: dict[torch.device, torch.cuda.Stream] = {}  # the copiers' read-back streams, by device


def _host_copy(item: CachedMedia) -> CachedMedia:
    """``item`` with host copies of its tensors, read back on the copiers' own stream (the engine's and the
    media workers' streams never wait for it)."""
    try:
        devices = {t.device for t in item.data.values() if t.is_cuda}
        if not devices:
            return replace(item, data=to_host(item.data))
        (device,) = devices
        stream = _copy_streams.get(device) or _copy_streams.setdefault(device, torch.cuda.Stream(device))
        with torch.cuda.stream(stream):
            return replace(item, data=to_host(item.data))
    except Exception:
        log.exception("the processed-media cache could not copy an item to the host; it is not kept")
        raise


def to_host(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Host copies of ``tensors`` for the cache: a device tensor is read back into pageable memory
    (page-locked copies measured no faster and would pin up to the cache's size); a host tensor is kept as
    it is, or cloned where it is a view into a larger batch (so the cache counts what it holds)."""
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
