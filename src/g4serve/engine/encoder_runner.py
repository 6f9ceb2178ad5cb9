"""Multimodal encoding batched across requests, cached by content hash.

Every image, video frame and audio clip pending in a step is encoded in one call per tower
and input shape (a 6-frame video is one call, not six), bounded by the scheduler's encoder
token budget. Outputs are kept in an LRU cache keyed by content hash, so a repeated image
costs nothing and prefills find their soft tokens ready.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from g4serve.models.gemma4.model import Gemma4Model
from g4serve.processing.processor import MultimodalItem


class EncoderCache:
    """content hash -> soft tokens [n, hidden]; entries in use by unfinished prefills are pinned."""

    def __init__(self, capacity_tokens: int):
        self.capacity_tokens = capacity_tokens
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._refs: dict[str, int] = {}
        self.num_tokens = 0
        self.hits = 0
        self.misses = 0

    def __contains__(self, digest: str) -> bool:
        return digest in self._entries

    def get(self, digest: str) -> torch.Tensor:
        self._entries.move_to_end(digest)
        return self._entries[digest]

    def put(self, digest: str, tokens: torch.Tensor) -> None:
        if digest in self._entries:
            return
        self._entries[digest] = tokens
        self.num_tokens += tokens.shape[0]
        self._evict()

    def acquire(self, digest: str) -> None:
        self._refs[digest] = self._refs.get(digest, 0) + 1

    def release(self, digest: str) -> None:
        count = self._refs.get(digest, 0) - 1
        if count <= 0:
            self._refs.pop(digest, None)
        else:
            self._refs[digest] = count
        self._evict()

    def _evict(self) -> None:
        if self.num_tokens <= self.capacity_tokens:
            return
        for digest in list(self._entries):
            if self.num_tokens <= self.capacity_tokens:
                break
            if digest not in self._refs:
                self.num_tokens -= self._entries.pop(digest).shape[0]


@dataclass
class EncoderCall:
    """One batched tower invocation (kept in a log for tests and metrics)."""

    tower: str
    num_items: int
    num_inputs: int  # images + frames, or audio clips
    num_tokens: int
    seconds: float


class EncoderRunner:
    def __init__(self, model: Gemma4Model, cache: EncoderCache):
        self.model = model
        self.cache = cache
        self.device = next(model.parameters()).device
        self.dtype = model.language_model.embed_tokens.weight.dtype
        self.calls: list[EncoderCall] = []
        self.vision_graphs = None  # a VisionGraphRunner when the engine replays encoder CUDA graphs

    def encode_images(self, pixels: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
        """Images / frames [B, N, 3*p*p] on the device -> per input soft tokens (graph replay when captured)."""
        if self.vision_graphs is not None:
            return self.vision_graphs.encode(pixels, positions)
        return self.model.encode_images(pixels, positions)

    @torch.inference_mode()
    def run(self, items: list[MultimodalItem]) -> float:
        """Encode every item not cached yet; returns the seconds spent."""
        todo: dict[str, MultimodalItem] = {}
        for item in items:
            if item.content_hash in self.cache or item.content_hash in todo:
                self.cache.hits += 1
            else:
                todo[item.content_hash] = item
        if not todo:
            return 0.0
        self.cache.misses += len(todo)
        t0 = time.perf_counter()
        vision = [it for it in todo.values() if it.modality in ("image", "video")]
        audio = [it for it in todo.values() if it.modality == "audio"]
        groups: dict[int, list[MultimodalItem]] = {}
        for item in vision:
            groups.setdefault(item.data["pixel_values"].shape[1], []).append(item)
        for group in groups.values():
            self._encode_vision(group)
        if audio:
            self._encode_audio(audio)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def _encode_vision(self, items: list[MultimodalItem]) -> None:
        t0 = time.perf_counter()
        pixels = torch.cat([it.data["pixel_values"] for it in items]).to(self.device, self.dtype, non_blocking=True)
        positions = torch.cat([it.data["position_ids"] for it in items]).to(self.device, non_blocking=True)
        per_input = self.encode_images(pixels, positions)
        cursor = 0
        for item in items:
            frames = item.data["pixel_values"].shape[0]
            self.cache.put(item.content_hash, torch.cat(per_input[cursor : cursor + frames]))
            cursor += frames
        self.calls.append(EncoderCall("vision", len(items), len(per_input), sum(t.shape[0] for t in per_input),
                                      time.perf_counter() - t0))

    def _encode_audio(self, items: list[MultimodalItem]) -> None:
        t0 = time.perf_counter()
        length = max(it.data["input_features"].shape[1] for it in items)
        feats = torch.cat([
            torch.nn.functional.pad(it.data["input_features"], (0, 0, 0, length - it.data["input_features"].shape[1]))
            for it in items
        ]).to(self.device, self.dtype)
        masks = torch.cat([
            torch.nn.functional.pad(it.data["input_features_mask"], (0, length - it.data["input_features_mask"].shape[1]))
            for it in items
        ]).to(self.device)
        per_clip = self.model.encode_audio(feats, masks)
        for item, tokens in zip(items, per_clip):
            self.cache.put(item.content_hash, tokens)
        self.calls.append(EncoderCall("audio", len(items), len(items), sum(t.shape[0] for t in per_clip),
                                      time.perf_counter() - t0))
