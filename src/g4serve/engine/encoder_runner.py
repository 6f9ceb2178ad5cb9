"""Multimodal encoding batched across requests, cached by content hash.

Every image, video frame and audio clip pending in a step is encoded in one call per tower
and input shape (a 6-frame video is one call, not six), bounded by the scheduler's encoder
token budget. Outputs are kept in an LRU cache keyed by content hash, so a repeated image
costs nothing and prefills find their soft tokens ready. With ``overlap`` the encodes run on
a side CUDA stream ahead of the prefills that need them, off the decode steps' path.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from g4serve.engine.cuda_graphs import AudioGraphRunner, VisionGraphRunner
from g4serve.models.gemma4.model import Gemma4Model
from g4serve.models.gemma4.vision import pooling_cells_used
from g4serve.processing.image import rescale_pixels
from g4serve.processing.processor import MultimodalItem


class EncoderCache:
    """content hash -> soft tokens [n, hidden]; entries in use by unfinished prefills are pinned. A video
    encoded a few frames a step (``max_encoder_tokens_beside_decodes``) gathers its frames' soft tokens in a
    partial entry, which becomes a cached one with its last frame; prefills may read the frames it has."""

    def __init__(self, capacity_tokens: int):
        self.capacity_tokens = capacity_tokens
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._partial: dict[str, list[torch.Tensor]] = {}  # content hash -> soft tokens of the first frames
        self._refs: dict[str, int] = {}
        self.num_tokens = 0
        self.hits = 0
        self.misses = 0

    def __contains__(self, digest: str) -> bool:
        return digest in self._entries

    def get(self, digest: str) -> torch.Tensor:
        """The soft tokens of a cached item, or of the frames a partial one has so far."""
        if digest not in self._entries and digest in self._partial:
            return torch.cat(self._partial[digest])
        self._entries.move_to_end(digest)
        return self._entries[digest]

    def frames_done(self, digest: str) -> int:
        """Frames of a video encoded so far by earlier steps, while it is only partly encoded (else 0)."""
        return len(self._partial.get(digest, ()))

    def add_frames(self, digest: str, frames: list[torch.Tensor], total: int) -> None:
        """The soft tokens of a video's next frames; with its last one the video becomes a cached entry."""
        have = self._partial.setdefault(digest, [])
        have += frames
        if len(have) >= total:
            del self._partial[digest]
            self.put(digest, torch.cat(have))

    @property
    def num_partial(self) -> int:
        return len(self._partial)

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
            self._partial.pop(digest, None)  # no request waits for the rest of its frames any more
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


@dataclass
class _Encoding:
    """Items encoding on the side stream: their soft tokens once ``done`` has been reached."""

    outputs: dict[str, torch.Tensor]  # content hash -> soft tokens
    calls: list[EncoderCall]
    begin: torch.cuda.Event | None = None
    done: torch.cuda.Event | None = None  # None (CPU): encoded synchronously, ready at the next poll
    host_seconds: float = 0.0  # the CPU's encode time

    def ready(self) -> bool:
        return self.done is None or self.done.query()

    def seconds(self) -> float:
        return self.host_seconds if self.done is None else self.begin.elapsed_time(self.done) / 1e3


class EncoderRunner:
    """Encodes media in batches. Synchronous by default: ``run`` encodes before the step's forward. With
    ``overlap`` the engine ``start`` s encodes ahead of the steps that need them, on a side CUDA stream,
    and ``poll`` moves finished ones into the cache; decode steps keep running meanwhile. Nothing here
    reads the device back (soft-token counts and kept cells come from host-side inputs), so the host
    keeps launching steps while the encoder runs. ``cuda_graphs``: replay the vision and audio encoders as
    CUDA graphs (``VisionGraphRunner``, ``AudioGraphRunner``), on CUDA."""

    def __init__(
        self, model: Gemma4Model, cache: EncoderCache, overlap: bool = False, cuda_graphs: bool = False
    ):
        self.model = model
        self.cache = cache
        self.device = next(model.parameters()).device
        self.dtype = model.language_model.embed_tokens.weight.dtype
        self.calls: list[EncoderCall] = []
        self.vision_graphs: VisionGraphRunner | None = None
        if cuda_graphs and self.device.type == "cuda" and model.vision_tower is not None:
            self.vision_graphs = VisionGraphRunner(model, self.device)
        self.audio_graphs: AudioGraphRunner | None = None
        if cuda_graphs and self.device.type == "cuda" and model.audio_tower is not None:
            self.audio_graphs = AudioGraphRunner(model, self.device)
        self.stream: torch.cuda.Stream | None = None
        if overlap and self.device.type == "cuda":
            self.stream = torch.cuda.Stream(self.device)
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # weights loaded, buffers set
        self._encoding: list[_Encoding] = []
        self._timed: list[_Encoding] = []  # encodes run in the step (outputs cached already), not yet timed

    def in_flight(self, digest: str) -> bool:
        return any(digest in e.outputs for e in self._encoding)

    @property
    def num_in_flight(self) -> int:
        return sum(len(e.outputs) for e in self._encoding)

    def encode_images(
        self, pixels: torch.Tensor, positions: torch.Tensor, positions_cpu: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """Images / frames [B, N, 3*p*p] on the device -> per input soft tokens. Graph replays (and the
        side stream) take the fixed-shape encoder and keep the used cells by an index computed on the
        host from ``positions_cpu``; otherwise ``Gemma4Model.encode_images``."""
        if self.vision_graphs is None and self.stream is None:
            return self.model.encode_images(pixels, positions)
        if positions_cpu is None:
            positions_cpu = positions.cpu()
        no_padding = bool((positions_cpu >= 0).all())
        if self.vision_graphs is not None:  # graphs hold a bounded number of frames: chunks of that many
            encode, chunk = self.vision_graphs.encode_padded, self.vision_graphs.max_frames(pixels.shape[1])
        else:
            encode, chunk = self.model.encode_images_padded, pixels.shape[0]
        k = self.model.cfg.vision.pooling_kernel_size
        kept, counts = [], []
        for start in range(0, pixels.shape[0], chunk):
            end = start + chunk
            tokens, _ = encode(pixels[start:end], positions[start:end], no_padding)
            used = pooling_cells_used(positions_cpu[start:end], k, tokens.shape[1])
            index = used.flatten().nonzero().squeeze(1).to(self.device, non_blocking=True)
            kept.append(tokens.flatten(0, 1).index_select(0, index))  # a copy: the graph's outputs get reused
            counts += used.sum(dim=-1).tolist()
        return list(torch.split(torch.cat(kept) if len(kept) > 1 else kept[0], counts))

    def _new_items(self, items: list[MultimodalItem]) -> dict[str, MultimodalItem]:
        todo: dict[str, MultimodalItem] = {}
        for item in items:
            if (
                item.content_hash in self.cache
                or item.content_hash in todo
                or self.in_flight(item.content_hash)
            ):
                self.cache.hits += 1
            else:
                todo[item.content_hash] = item
                self.cache.misses += self.cache.frames_done(item.content_hash) == 0  # once per item
        return todo

    @torch.inference_mode()
    def run(
        self, items: list[MultimodalItem], frames: dict[str, int] | None = None
    ) -> list[tuple[frozenset[str], float]]:
        """Encode every item not cached yet, now (queued on the step's stream, ahead of its forward). On the
        CPU returns the encode as ``poll`` reports one (the content hashes encoded, the seconds spent); on
        CUDA nothing: ``poll`` reports its device time once it is done. A video encodes from the frames the
        cache has (``frames_done``) up to its entry in ``frames`` (content hash -> end frame: the scheduler's
        share of it beside decodes), else to its last."""
        todo = self._new_items(items)
        if not todo:
            return []
        t0 = time.perf_counter()
        if self.device.type == "cuda":
            begin = torch.cuda.Event(enable_timing=True)
            begin.record()
        partial: dict[str, list[torch.Tensor]] = {}
        outputs, calls = self._encode(list(todo.values()), frames or {}, partial)
        for digest, tokens in outputs.items():
            self.cache.put(digest, tokens)
        for digest, per_frame in partial.items():
            self.cache.add_frames(digest, per_frame, todo[digest].data["pixel_values"].shape[0])
        if self.device.type == "cuda":
            # Timed by events, read by a later ``poll``: waiting for the device here would stall the host
            # behind the encode and the step before it, so the next step's launch could not overlap them.
            done = torch.cuda.Event(enable_timing=True)
            done.record()
            self._timed.append(_Encoding(dict.fromkeys([*outputs, *partial]), calls, begin, done))
            return []
        seconds = time.perf_counter() - t0
        self._log_calls(calls, seconds)
        return [(frozenset([*outputs, *partial]), seconds)]

    @torch.inference_mode()
    def start(self, items: list[MultimodalItem]) -> None:
        """Launch the encoding of every item neither cached nor in flight, on the side stream (CUDA); its
        soft tokens reach the cache through ``poll`` once the device is done."""
        todo = self._new_items(items)
        if not todo:
            return
        if self.stream is None:  # CPU: encoded now, released at the next poll like a finished stream
            t0 = time.perf_counter()
            outputs, calls = self._encode(list(todo.values()), {}, {})
            self._encoding.append(_Encoding(outputs, calls, host_seconds=time.perf_counter() - t0))
            return
        with torch.cuda.stream(self.stream):
            begin, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            outputs, calls = self._encode(list(todo.values()), {}, {})
            done.record()
        self._encoding.append(_Encoding(outputs, calls, begin, done))

    def poll(self) -> list[tuple[frozenset[str], float]]:
        """Cache the soft tokens of finished encodes; for each finished encode (also those ``run`` queued in
        steps, once done), the content hashes it encoded and its seconds of device time. One encode may
        hold several items, of one request or of several; a video encoded in parts is in each part's."""
        finished = [(frozenset(timed.outputs), seconds) for timed, seconds in self._take_ready(self._timed)]
        main = torch.cuda.current_stream(self.device) if self.stream is not None else None
        for encoding, seconds in self._take_ready(self._encoding):
            for digest, tokens in encoding.outputs.items():
                if main is not None:
                    tokens.record_stream(main)  # made on the side stream, read by the steps on the main one
                self.cache.put(digest, tokens)
            finished.append((frozenset(encoding.outputs), seconds))
        return finished

    def _take_ready(self, pending: list[_Encoding]) -> list[tuple[_Encoding, float]]:
        """The finished encodes of ``pending``, taken out of it, with their seconds (their calls logged)."""
        ready = []
        for encoding in [e for e in pending if e.ready()]:
            pending.remove(encoding)
            seconds = encoding.seconds()
            self._log_calls(encoding.calls, seconds)
            ready.append((encoding, seconds))
        return ready

    def _log_calls(self, calls: list[EncoderCall], seconds: float) -> None:
        """Log the calls of one encode, sharing its time by soft tokens (the towers ran back to back)."""
        total = max(sum(c.num_tokens for c in calls), 1)
        for call in calls:
            call.seconds = seconds * call.num_tokens / total
        self.calls += calls

    def wait(self) -> None:
        """Block until the oldest encode in flight is done (when there is nothing else to run)."""
        if self._encoding and self._encoding[0].done is not None:
            self._encoding[0].done.synchronize()

    def _upload(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_cuda:
            # Prepared on the GPU (--media-on-gpu, on the processor's own stream, finished): freeing it must
            # wait for the kernels this stream queues on it.
            tensor.record_stream(torch.cuda.current_stream(tensor.device))
        # From pageable memory the host waits only until the bytes are staged, not for the stream's work.
        return tensor.to(self.device, non_blocking=True)

    def _encode(
        self,
        items: list[MultimodalItem],
        frames: dict[str, int],
        partial: dict[str, list[torch.Tensor]],
    ) -> tuple[dict[str, torch.Tensor], list[EncoderCall]]:
        """Soft tokens of ``items`` (one call per tower and input shape), by content hash. A video whole
        when none of its frames are encoded yet and ``frames`` stops it at no earlier frame, else the frames
        from the cache's ``frames_done`` up to that end, one tensor each into ``partial``."""
        outputs: dict[str, torch.Tensor] = {}
        calls: list[EncoderCall] = []
        groups: dict[int, list[tuple[MultimodalItem, tuple[int, int] | None]]] = {}
        for item in items:
            if item.modality in ("image", "video"):
                total = item.data["pixel_values"].shape[0]
                done, end = self.cache.frames_done(item.content_hash), frames.get(item.content_hash, total)
                span = (done, end) if done or end < total else None
                groups.setdefault(item.data["pixel_values"].shape[1], []).append((item, span))
        for group in groups.values():
            calls.append(self._encode_vision(group, outputs, partial))
        audio = [it for it in items if it.modality == "audio"]
        if audio:
            calls.append(self._encode_audio(audio, outputs))
        return outputs, calls

    def _pixels(self, item: MultimodalItem, span: tuple[int, int] | None = None) -> torch.Tensor:
        """An image's or video's patches (of the frames in ``span``) on the device in the model's dtype: the
        uint8 patches go up as they are and are rescaled there, exactly as the processor would."""
        pixels = item.data["pixel_values"]
        if span is not None:
            pixels = pixels[span[0] : span[1]]
        return rescale_pixels(self._upload(pixels), video=item.modality == "video").to(self.dtype)

    @torch.inference_mode()
    def capture_vision_buckets(self, items: list[MultimodalItem]) -> int:
        """Capture the vision graphs of every frame bucket for the frame shape of each of ``items`` (the
        engine's warm-up); returns how many were new. Nothing without vision graphs."""
        if self.vision_graphs is None:
            return 0
        new = 0
        for item in items:
            positions = item.data["position_ids"]
            no_padding = bool((positions >= 0).all())
            new += self.vision_graphs.capture_buckets(self._pixels(item), self._upload(positions), no_padding)
        return new

    def _encode_vision(
        self,
        items: list[tuple[MultimodalItem, tuple[int, int] | None]],
        outputs: dict[str, torch.Tensor],
        partial: dict[str, list[torch.Tensor]],
    ) -> EncoderCall:
        """One call for images and videos of one patch count; ``span``: a video's frames to encode, into
        ``partial`` (None: the whole item, into ``outputs``)."""
        pixels = torch.cat([self._pixels(it, span) for it, span in items])
        positions_cpu = torch.cat(
            [
                it.data["position_ids"][span[0] : span[1]] if span else it.data["position_ids"]
                for it, span in items
            ]
        )
        per_input = self.encode_images(
            pixels, positions_cpu.to(self.device, non_blocking=True), positions_cpu
        )
        cursor = 0
        for item, span in items:
            first, end = span or (0, item.data["pixel_values"].shape[0])
            if span is None:
                outputs[item.content_hash] = torch.cat(per_input[cursor : cursor + end])
            else:
                partial[item.content_hash] = per_input[cursor : cursor + end - first]
            cursor += end - first
        return EncoderCall("vision", len(items), len(per_input), sum(t.shape[0] for t in per_input), 0.0)

    def _encode_audio(self, items: list[MultimodalItem], outputs: dict[str, torch.Tensor]) -> EncoderCall:
        if self.audio_graphs is not None:
            # shortest first, so clips of like lengths share a graph; a chunk holds what its longest allows
            items = sorted(items, key=lambda it: it.data["input_features"].shape[1])
            chunks: list[list[MultimodalItem]] = [[]]
            for item in items:
                if len(chunks[-1]) >= self.audio_graphs.max_clips(item.data["input_features"].shape[1]):
                    chunks.append([])
                chunks[-1].append(item)
            per_clip = []
            for chunk in chunks:
                feats, masks = self._audio_batch(chunk)
                per_clip += self.audio_graphs.encode(feats, masks, [it.num_tokens for it in chunk])
        else:
            feats, masks = self._audio_batch(items)
            # On the side stream, counts come from the prompt's placeholders: no read-back of the mask.
            lengths = [it.num_tokens for it in items] if self.stream is not None else None
            per_clip = self.model.encode_audio(feats, masks, lengths)
        for item, tokens in zip(items, per_clip):
            outputs[item.content_hash] = tokens
        return EncoderCall("audio", len(items), len(items), sum(t.shape[0] for t in per_clip), 0.0)

    @torch.inference_mode()
    def capture_audio_buckets(self, item: MultimodalItem) -> int:
        """Capture the audio graphs of one clip at every frame bucket up to ``item``'s length (the engine's
        warm-up, with the longest clip the processor makes); returns how many were new."""
        if self.audio_graphs is None:
            return 0
        feats, masks = self._audio_batch([item])
        return self.audio_graphs.capture_buckets(feats, masks)

    def _audio_batch(self, items: list[MultimodalItem]) -> tuple[torch.Tensor, torch.Tensor]:
        """The clips' log-mel features [B, T, 128] and validity masks [B, T] on the device, padded to the
        longest (masked frames)."""
        length = max(it.data["input_features"].shape[1] for it in items)
        pad = torch.nn.functional.pad
        feats = torch.cat(
            [
                pad(
                    self._upload(it.data["input_features"]).to(self.dtype),
                    (0, 0, 0, length - it.data["input_features"].shape[1]),
                )
                for it in items
            ]
        )
        masks = torch.cat(
            [
                pad(
                    self._upload(it.data["input_features_mask"]),
                    (0, length - it.data["input_features_mask"].shape[1]),
                )
                for it in items
            ]
        )
        return feats, masks
