"""Prompt + media -> token ids and encoder inputs, exactly as transformers' Gemma4Processor.

Each ``<|image|>`` / ``<|video|>`` / ``<|audio|>`` placeholder in the prompt is expanded into
begin/end markers around one soft token per encoder output vector; the media become
``MultimodalItem`` s that record where their soft tokens sit and carry a content hash
(for the encoder cache and prefix caching).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import torch

from g4serve.config import Gemma4Config
from g4serve.processing.audio import (
    SAMPLING_RATE,
    AudioFeatureExtractor,
    check_samples,
    fit_waveform,
    load_audio,
    num_audio_soft_tokens,
    output_samples_cap,
)
from g4serve.processing.chat import LocalFile
from g4serve.processing.device_media import DeviceMedia
from g4serve.processing.image import load_image, preprocess_images
from g4serve.processing.limits import (
    MediaBudget,
    MediaBudgetError,
    MediaLimits,
    check_item_bytes,
    read_media_file,
)
from g4serve.processing.media_cache import (
    CachedMedia,
    MediaCache,
    encoded_parts,
    media_key,
)
from g4serve.processing.nvdec import NvdecVideos
from g4serve.processing.pool import map_in_pool
from g4serve.processing.tokenizer import Tokenizer
from g4serve.processing.video import (
    VideoFrames,
    load_video,
    preprocess_video,
    sample_frame_indices,
    sample_video_frames,
    video_frames_at,
    video_prompt_text,
)


@dataclass(eq=False)  # compared by identity: `data` holds tensors
class MultimodalItem:
    modality: str  # "image" | "video" | "audio"
    spans: list[tuple[int, int]]  # [start, end) token index ranges of this item's soft tokens
    data: dict[str, torch.Tensor]  # encoder inputs
    content_hash: str

    @property
    def offset(self) -> int:
        return self.spans[0][0]

    @property
    def num_tokens(self) -> int:
        return sum(end - start for start, end in self.spans)


@dataclass
class ProcessedPrompt:
    prompt: str | None
    token_ids: list[int]
    mm_items: list[MultimodalItem] = field(default_factory=list)
    # The prompt's ``cache_salt`` (set by ``LLMEngine.process_prompt``): its KV blocks are shared only with
    # requests of the same salt.
    cache_salt: str | None = None


@dataclass
class ProcessorSettings:
    image_max_soft_tokens: int = 280
    video_max_soft_tokens: int = 70
    video_num_frames: int = 32
    patch_size: int = 16
    pooling_kernel_size: int = 3
    audio_seq_length: int = 750

    @classmethod
    def from_dir(cls, model_dir: str | Path | None) -> ProcessorSettings:
        s = cls()
        if model_dir is None:
            return s
        path = Path(model_dir)
        proc = _read_json(path / "processor_config.json")
        image = proc.get("image_processor") or _read_json(path / "preprocessor_config.json")
        video = proc.get("video_processor") or _read_json(path / "video_preprocessor_config.json")
        s.image_max_soft_tokens = image.get("max_soft_tokens", s.image_max_soft_tokens)
        s.patch_size = image.get("patch_size", s.patch_size)
        s.pooling_kernel_size = image.get("pooling_kernel_size", s.pooling_kernel_size)
        s.video_max_soft_tokens = video.get("max_soft_tokens", s.video_max_soft_tokens)
        s.video_num_frames = video.get("num_frames", s.video_num_frames)
        s.audio_seq_length = proc.get("audio_seq_length", s.audio_seq_length)
        return s


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc


def content_hash(modality: str, *tensors: torch.Tensor) -> str:
    """The encoder-cache and prefix-cache key of a media item: BLAKE3 over its processed tensors, read in
    place (6 frames of 480p are ~12 MB: BLAKE3's SIMD and threads hash them in a few ms, where blake2b
    plus a bytes copy took ~25 ms of every video request's preprocessing)."""
    h = blake3.blake3(modality.encode(), max_threads=blake3.blake3.AUTO)
    for t in tensors:
        h.update(str(tuple(t.shape)).encode())
        h.update(memoryview(t.detach().cpu().contiguous().numpy()).cast("B"))
    return h.hexdigest(length=16)


class Gemma4Processor:
    def __init__(
        self,
        tokenizer: Tokenizer,
        cfg: Gemma4Config,
        settings: ProcessorSettings | None = None,
        media_device: torch.device | str | None = None,
        cache_bytes: int = 0,
        nvdec: NvdecVideos | None = None,
    ):
        """``media_device``: decode (JPEG), resize and patchify images and video frames there
        (``processing.device_media``); None: on the host, bit for bit as transformers. ``cache_bytes``:
        keep processed media items given as bytes, up to this many bytes (``processing.media_cache``).
        ``nvdec``: container videos it takes are decoded by NVDEC (``processing.nvdec``; with a media
        device)."""
        if nvdec is not None and media_device is None:
            raise ValueError("NVDEC decoding needs a media device (--media-on-gpu)")
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.settings = settings or ProcessorSettings()
        self.media = DeviceMedia(media_device) if media_device is not None else None
        self.cache = MediaCache(cache_bytes) if cache_bytes > 0 else None
        self.nvdec = nvdec
        self.audio_extractor = AudioFeatureExtractor()
        tok = tokenizer
        self.image_token, self.video_token, self.audio_token = (
            tok.image_token,
            tok.video_token,
            tok.audio_token,
        )
        self.boi, self.eoi, self.boa, self.eoa = tok.boi_token, tok.eoi_token, tok.boa_token, tok.eoa_token
        self.placeholder_ids = {
            "image": cfg.image_token_id,
            "video": cfg.video_token_id,
            "audio": cfg.audio_token_id,
        }

    @classmethod
    def from_pretrained(
        cls, model_dir: str | Path, tokenizer: Tokenizer, cfg: Gemma4Config
    ) -> Gemma4Processor:
        return cls(tokenizer, cfg, ProcessorSettings.from_dir(model_dir))

    # ---- media decoding --------------------------------------------------------------------
    @staticmethod
    def _read(value: Any, limits: MediaLimits) -> Any:
        """Local files (``LocalFile``, or a path string from the Python API) -> their bytes, read here with
        the per-item byte cap (and the ``--allowed-local-media-path`` check again), so no decoder ever gets
        a path; anything else as it is."""
        if isinstance(value, LocalFile):
            return read_media_file(value.path, limits.max_media_item_bytes, value.root)
        if isinstance(value, (str, Path)):
            return read_media_file(value, limits.max_media_item_bytes)
        return value

    def _load_image(self, value: Any, budget: MediaBudget | None = None) -> Any:
        budget = budget or MediaBudget()
        value = self._read(value, budget.limits)
        if isinstance(value, (bytes, bytearray)):
            return load_image(bytes(value), budget=budget)
        return value

    def _load_on_host(self, value: Any, label: str, budget: MediaBudget, charged: bool) -> Any:
        """``_load_image`` with its errors named ``label``; ``charged``: a JPEG the media device was charged
        for and then refused, decoded under the limits alone (its pixels are in ``budget`` already)."""
        target = MediaBudget(budget.limits) if charged else budget
        return _named(label, lambda v: self._load_image(v, target), value)

    def _load_video(self, value: Any, budget: MediaBudget | None = None) -> VideoFrames:
        budget = budget or MediaBudget()
        limits = budget.limits
        if isinstance(value, VideoFrames):
            return value
        value = self._read(value, limits)
        if isinstance(value, (bytes, bytearray)):
            return load_video(bytes(value), num_frames=self.settings.video_num_frames, budget=budget)
        _check_frame_list(value, limits)
        # A sequence of frames (PIL images, HWC arrays, encoded images), or a (T, H, W, C) array; encoded
        # frames are decoded only if sampled, in parallel.
        load = (lambda v: self._load_image(v, budget)) if isinstance(value, (list, tuple)) else None
        return sample_video_frames(value, num_frames=self.settings.video_num_frames, load=load)

    def _load_audio(self, value: Any, budget: MediaBudget | None = None) -> np.ndarray:
        budget = budget or MediaBudget()
        limits = budget.limits
        value = self._read(value, limits)
        if isinstance(value, tuple):  # (waveform, sampling_rate)
            wave, rate = value
            wave = np.asarray(wave, dtype=np.float32)
            if wave.ndim == 2:  # (channels, samples) -> mono
                wave = wave.mean(axis=0)
            wave = fit_waveform(wave, rate, SAMPLING_RATE, limits)
        elif isinstance(value, (bytes, bytearray)):
            wave = load_audio(bytes(value), budget=budget)
        else:
            wave = check_samples(np.asarray(value, dtype=np.float32)[: output_samples_cap(limits)])
        budget.charge_audio(len(wave), SAMPLING_RATE)
        return wave

    # ---- main entry ------------------------------------------------------------------------
    def process(
        self,
        prompt: str | dict,
        limits: dict[str, int],
        add_special_tokens: bool = True,
        *,
        media_limits: MediaLimits | None = None,
    ) -> ProcessedPrompt:
        """A prompt as ``LLM.generate`` takes it: a string, or a dict with ``prompt`` or ``prompt_token_ids``
        and ``multi_modal_data`` (one item or a list per modality, at most ``limits[modality]`` each).
        ``media_limits``: the caps of decoding its media and the request's media budget (default
        ``MediaLimits()``)."""
        if isinstance(prompt, str):
            return self(prompt=prompt, add_special_tokens=add_special_tokens)
        if not isinstance(prompt, dict):
            raise ValueError(f"prompt: expected a string or a dict, got {type(prompt).__name__}")
        mm = prompt.get("multi_modal_data") or {}
        unknown = set(mm) - {"image", "video", "audio"}
        if unknown:
            raise ValueError(f"multi_modal_data: unknown modality {sorted(unknown)[0]!r}")
        media = {k: (v if isinstance(v, list) else [v]) for k, v in mm.items()}
        for modality, values in media.items():
            if len(values) > limits.get(modality, 0):
                raise ValueError(
                    f"multi_modal_data.{modality}: {len(values)} item(s) exceed limit_mm_per_prompt "
                    f"({limits.get(modality, 0)})"
                )
        if prompt.get("prompt") is not None and prompt.get("prompt_token_ids") is not None:
            raise ValueError("prompt: give either 'prompt' or 'prompt_token_ids', not both")
        return self(
            prompt=prompt.get("prompt"),
            prompt_token_ids=prompt.get("prompt_token_ids"),
            images=media.get("image"),
            videos=media.get("video"),
            audio=media.get("audio"),
            add_special_tokens=add_special_tokens,
            media_limits=media_limits,
        )

    def __call__(
        self,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        images: list[Any] | None = None,
        videos: list[Any] | None = None,
        audio: list[Any] | None = None,
        add_special_tokens: bool = True,
        media_limits: MediaLimits | None = None,
    ) -> ProcessedPrompt:
        images, videos, audio = list(images or []), list(videos or []), list(audio or [])
        budget = MediaBudget(media_limits)
        _check_encoded_media({"image": images, "video": videos, "audio": audio}, budget.limits)
        expansions: dict[str, list[str]] = {"image": [], "video": [], "audio": []}
        items: dict[str, list[tuple[dict[str, torch.Tensor], str]]] = {"image": [], "video": [], "audio": []}
        keep = _Keep(self.cache, budget.limits)
        images, videos, audio = (
            keep.look_up(m, v) for m, v in zip(("image", "video", "audio"), (images, videos, audio))
        )

        with self.media.preparing() if self.media is not None else contextlib.nullcontext():
            self._images_and_videos(images, videos, budget, items, expansions, keep)
            if audio:
                self._audio(audio, budget, items, expansions, keep)

        if prompt is not None:
            text = self._expand_text(prompt, expansions)
            token_ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        elif prompt_token_ids is not None:
            token_ids = self._expand_ids(list(prompt_token_ids), expansions)
        else:
            raise ValueError("prompt: either a prompt string or prompt_token_ids is required")
        processed = ProcessedPrompt(prompt, token_ids, self._locate(token_ids, items))
        keep.store()  # a whole request processed
        return processed

    def _images_and_videos(
        self,
        images: list[Any],
        videos: list[Any],
        budget: MediaBudget,
        items: dict[str, list[tuple[dict[str, torch.Tensor], str]]],
        expansions: dict[str, list[str]],
        keep: _Keep,
    ) -> None:
        """Decode, resize and patchify (on the media device what it takes); add each item's inputs and
        content hash to ``items``, its prompt text to ``expansions``. Items ``keep`` found cached are taken
        from it (their pixels charged to ``budget`` again); the others it keeps."""
        todo = [i for i, v in enumerate(images) if not isinstance(v, _Hit)]
        features = iter(self._image_features([images[i] for i in todo], budget, names=todo))
        for i, value in enumerate(images):
            if isinstance(value, _Hit):
                keep.reuse(value, budget, items, expansions)
                continue
            data, n, pixels = next(features)
            expansion = f"{self.boi}{self.image_token * n}{self.eoi}"
            keep.add("image", i, data, expansion, items, expansions, pixels=pixels)
        for i, value in enumerate(videos):
            if isinstance(value, _Hit):
                keep.reuse(value, budget, items, expansions)
                continue
            before = budget.pixels
            frames, feats = _named(f"video[{i}]", lambda v: self._video_features(v, budget), value)
            data = {"pixel_values": feats.pixel_values, "position_ids": feats.position_ids}
            expansion = video_prompt_text(
                frames.timestamps_s, feats.num_soft_tokens_per_frame, self.boi, self.video_token, self.eoi
            )
            keep.add("video", i, data, expansion, items, expansions, pixels=budget.pixels - before)

    def _preprocess_images(
        self, loaded: list[Any], on_device: bool
    ) -> list[tuple[dict[str, torch.Tensor], int]]:
        """Each image's encoder inputs (uint8 patches: the encoder rescales them on the device, a quarter of
        the bytes to copy and hash) and soft-token count."""
        s = self.settings
        feats = preprocess_images(
            loaded,
            max_soft_tokens=s.image_max_soft_tokens,
            patch_size=s.patch_size,
            pooling_kernel_size=s.pooling_kernel_size,
            rescale=False,
            float_resize=on_device,
        )
        return [
            (
                {
                    "pixel_values": feats.pixel_values[i : i + 1],
                    "position_ids": feats.position_ids[i : i + 1],
                },
                n,
            )
            for i, n in enumerate(feats.num_soft_tokens)
        ]

    def _image_features(
        self, images: list[Any], budget: MediaBudget, names: list[int] | None = None
    ) -> list[tuple[dict[str, torch.Tensor], int, int]]:
        """(inputs, soft tokens, decoded pixels) of each image. On the host, bit for bit as transformers;
        with a media device, the JPEGs it takes are decoded, resized and patchified there, in batches of its
        ``max_batch_pixels`` under its in-flight budget. ``names``: each image's index in the request (for
        errors), else its position."""
        if not images:
            return []
        names = names if names is not None else list(range(len(images)))
        media = self.media
        if media is None:
            loaded = _decode_all(lambda v: self._load_image(v, budget), images, name="image", names=names)
            pixels = [_pixels(image) for image in loaded]
            return [(*f, n) for f, n in zip(self._preprocess_images(loaded, False), pixels)]
        raw = [
            _named(f"image[{names[i]}]", lambda v: self._read(v, budget.limits), v)
            for i, v in enumerate(images)
        ]
        sizes = [media.jpeg_size(v, budget.limits) for v in raw]
        out: list[Any] = [None] * len(raw)
        refused: set[int] = set()
        for batch in media.batches([i for i, size in enumerate(sizes) if size], sizes):
            with media.reserve(sum(sizes[i][0] * sizes[i][1] for i in batch)):  # type: ignore[index]
                decoded = media.decode([raw[i] for i in batch], [sizes[i] for i in batch], budget)  # type: ignore[misc]
                refused.update(i for i, t in zip(batch, decoded) if t is None)
                ok = [(i, t) for i, t in zip(batch, decoded) if t is not None]
                for (i, t), feature in zip(
                    ok, self._preprocess_images([t for _, t in ok], True) if ok else []
                ):
                    out[i] = (*feature, _pixels(t))
        host = [i for i, feature in enumerate(out) if feature is None]

        def load(i: int) -> Any:
            return self._load_on_host(raw[i], f"image[{names[i]}]", budget, charged=i in refused)

        if host:
            loaded = map_in_pool(load, host)
            for i, image, feature in zip(host, loaded, self._preprocess_images(loaded, False)):
                out[i] = (*feature, _pixels(image))
        return out

    def _video_features(self, value: Any, budget: MediaBudget) -> tuple[VideoFrames, Any]:
        """A video's frames and patches: on the host, bit for bit as transformers; with a media device, a
        list of JPEG frames it takes is decoded there, other frames within its bounds are uploaded, and
        both are resized and patchified there (under its in-flight budget)."""
        s = self.settings
        media = self.media
        with contextlib.ExitStack() as held:
            frames = self._jpeg_frames_on_device(value, budget, held) if media is not None else None
            if frames is None and self.nvdec is not None:
                value = self._read(value, budget.limits)
                frames = self._nvdec_frames(value, budget, held)
            if frames is None:
                frames = self._load_video(value, budget)
                shape = frames.frames.shape  # [F, H, W, 3]
                if (
                    media is not None
                    and shape[1] * shape[2] <= media.max_frame_pixels
                    and (shape[0] * shape[1] * shape[2] <= media.max_batch_pixels)
                ):
                    held.enter_context(media.reserve(shape[0] * shape[1] * shape[2]))
                    frames = dataclasses.replace(
                        frames, frames=torch.as_tensor(frames.frames).to(media.device)
                    )
            on_device = (
                media is not None
                and isinstance(frames.frames, torch.Tensor)
                and (frames.frames.device.type == media.device.type)
            )
            feats = preprocess_video(
                frames,
                max_soft_tokens=s.video_max_soft_tokens,
                patch_size=s.patch_size,
                pooling_kernel_size=s.pooling_kernel_size,
                rescale=False,
                float_resize=on_device,
            )
        return frames, feats

    def _nvdec_frames(
        self, value: Any, budget: MediaBudget, held: contextlib.ExitStack
    ) -> VideoFrames | None:
        """A container video's sampled frames decoded by NVDEC, under a reservation of the media device's
        in-flight budget that ``held`` keeps until the patches are made; None: the host path decodes it."""
        media, nvdec = self.media, self.nvdec
        assert media is not None and nvdec is not None
        if not isinstance(value, (bytes, bytearray)):
            return None
        with contextlib.ExitStack() as reserved:  # given back at once if the host path takes the video
            frames = nvdec.load(
                bytes(value),
                budget.limits,
                self.settings.video_num_frames,
                budget,
                reserve=lambda pixels: reserved.enter_context(media.reserve(pixels)),
            )
            if frames is not None:
                held.enter_context(reserved.pop_all())
        return frames

    def _jpeg_frames_on_device(
        self, value: Any, budget: MediaBudget, held: contextlib.ExitStack
    ) -> VideoFrames | None:
        """A list of encoded frames whose sampled ones are JPEGs the media device takes, of one size and
        within its batch: those frames decoded there in one call (a stream nvJPEG refuses decoded on the
        host and uploaded), under a reservation ``held`` keeps until the patches are made. None: the
        host path decodes the video."""
        media = self.media
        assert media is not None
        if not isinstance(value, (list, tuple)) or not value:
            return None
        _check_frame_list(value, budget.limits)
        indices = sample_frame_indices(len(value), self.settings.video_num_frames)
        raw = [_named(f"frame {i}", lambda v: self._read(v, budget.limits), value[i]) for i in indices]
        sizes = [media.jpeg_size(v, budget.limits) for v in raw]
        if None in sizes or len(set(sizes)) > 1:
            return None  # the host path decodes (and reports frames of different sizes)
        width, height = sizes[0]  # type: ignore[misc]
        if len(raw) * width * height > media.max_batch_pixels:
            return None
        held.enter_context(media.reserve(len(raw) * width * height))
        decoded = media.decode(raw, sizes, budget)  # type: ignore[arg-type]
        for k, tensor in enumerate(decoded):
            if tensor is None:
                decoded[k] = media.upload(
                    self._load_on_host(raw[k], f"frame {indices[k]}", budget, charged=True)
                )
        stacked = torch.stack(decoded).permute(0, 2, 3, 1)  # type: ignore[arg-type]  # [F, H, W, 3] view
        return video_frames_at(stacked, indices, None)

    def _audio(
        self,
        audio: list[Any],
        budget: MediaBudget,
        items: dict[str, list[tuple[dict[str, torch.Tensor], str]]],
        expansions: dict[str, list[str]],
        keep: _Keep,
    ) -> None:
        """Decode the clips on the host; their log-mel features there, or on the media device (the clips
        ``keep`` found cached taken from it)."""
        todo = [i for i, v in enumerate(audio) if not isinstance(v, _Hit)]
        waves = [_named(f"audio[{i}]", lambda v: self._load_audio(v, budget), audio[i]) for i in todo]
        if waves:
            feats = self.audio_extractor(waves, device=self.media.device if self.media is not None else None)
        fresh = iter(range(len(waves)))
        for i, value in enumerate(audio):
            if isinstance(value, _Hit):
                keep.reuse(value, budget, items, expansions)
                continue
            k = next(fresh)
            data = {
                "input_features": feats.input_features[k : k + 1],
                "input_features_mask": feats.input_features_mask[k : k + 1],
            }
            n = num_audio_soft_tokens(len(waves[k]), self.settings.audio_seq_length)
            expansion = f"{self.boa}{self.audio_token * n}{self.eoa}"
            keep.add("audio", i, data, expansion, items, expansions, audio_samples=len(waves[k]))

    def _expand_text(self, prompt: str, expansions: dict[str, list[str]]) -> str:
        placeholders = {"image": self.image_token, "video": self.video_token, "audio": self.audio_token}
        # Replace placeholders in order of appearance, each modality consuming its own list.
        for modality, token in placeholders.items():
            count = prompt.count(token)
            if count != len(expansions[modality]):
                raise ValueError(
                    f"multi_modal_data.{modality}: the prompt has {count} {token} placeholder(s) "
                    f"but {len(expansions[modality])} {modality} input(s) were given"
                )
        out, i = [], 0
        counters = {m: 0 for m in placeholders}
        while i < len(prompt):
            for modality, token in placeholders.items():
                if prompt.startswith(token, i):
                    out.append(expansions[modality][counters[modality]])
                    counters[modality] += 1
                    i += len(token)
                    break
            else:
                out.append(prompt[i])
                i += 1
        return "".join(out)

    def _expand_ids(self, ids: list[int], expansions: dict[str, list[str]]) -> list[int]:
        out: list[int] = []
        counters = {m: 0 for m in expansions}
        by_id = {v: k for k, v in self.placeholder_ids.items()}
        for tid in ids:
            modality = by_id.get(tid)
            if modality is None:
                out.append(tid)
                continue
            if counters[modality] >= len(expansions[modality]):
                raise ValueError(
                    f"multi_modal_data.{modality}: more placeholders in prompt_token_ids than inputs"
                )
            out.extend(
                self.tokenizer.encode(expansions[modality][counters[modality]], add_special_tokens=False)
            )
            counters[modality] += 1
        for modality, used in counters.items():
            if used != len(expansions[modality]):
                raise ValueError(
                    f"multi_modal_data.{modality}: {len(expansions[modality])} input(s) "
                    f"but {used} placeholder(s)"
                )
        return out

    def _locate(self, token_ids: list[int], items: dict[str, list]) -> list[MultimodalItem]:
        """Find the soft-token runs of each item; a video contributes one run per frame."""
        runs: dict[str, list[tuple[int, int]]] = {"image": [], "video": [], "audio": []}
        by_id = {v: k for k, v in self.placeholder_ids.items()}
        i = 0
        while i < len(token_ids):
            modality = by_id.get(token_ids[i])
            if modality is None:
                i += 1
                continue
            j = i
            while j < len(token_ids) and token_ids[j] == token_ids[i]:
                j += 1
            runs[modality].append((i, j))
            i = j
        result = []
        for modality, entries in items.items():
            cursor = 0
            for data, digest in entries:
                frames = data["pixel_values"].shape[0] if modality == "video" else 1
                spans = runs[modality][cursor : cursor + frames]
                cursor += frames
                result.append(MultimodalItem(modality, spans, data, digest))
            if cursor != len(runs[modality]):
                raise ValueError(f"multi_modal_data.{modality}: placeholder tokens do not match the inputs")
        result.sort(key=lambda it: it.offset)
        return result


@dataclass(frozen=True)
class _Hit:
    """A media item the processed-media cache held, standing in the request's list for its value."""

    modality: str
    cached: CachedMedia


class _Keep:
    """One request's use of the processed-media cache (``processing.media_cache``; None: no cache): which of
    its items the cache held, and the processed items to keep once the whole request is processed."""

    def __init__(self, cache: MediaCache | None, limits: MediaLimits):
        self.cache = cache
        self.limits = limits
        self.keys: dict[tuple[str, int], str] = {}  # (modality, index) -> key, for the items looked up
        self.pending: list[tuple[str, CachedMedia]] = []

    def look_up(self, modality: str, values: list[Any]) -> list[Any]:
        """``values``, each item the cache holds replaced by its ``_Hit``; the keys of the others kept."""
        if self.cache is None:
            return values
        out = []
        for i, value in enumerate(values):
            parts = encoded_parts(value)
            if parts is None:
                out.append(value)
                continue
            key = self.keys[(modality, i)] = media_key(modality, parts, self.limits)
            cached = self.cache.get(key)
            out.append(value if cached is None else _Hit(modality, cached))
        return out

    @staticmethod
    def reuse(hit: _Hit, budget: MediaBudget, items: dict, expansions: dict[str, list[str]]) -> None:
        """A cached item into the request, charged to its budget as its processing was."""
        cached = hit.cached
        if cached.pixels:
            budget.charge_pixels(cached.pixels)
        if cached.audio_samples:
            budget.charge_audio(cached.audio_samples, SAMPLING_RATE)
        items[hit.modality].append((cached.data, cached.content_hash))
        expansions[hit.modality].append(cached.expansion)

    def add(
        self,
        modality: str,
        index: int,
        data: dict[str, torch.Tensor],
        expansion: str,
        items: dict,
        expansions: dict[str, list[str]],
        pixels: int = 0,
        audio_samples: int = 0,
    ) -> None:
        """A processed item into the request, hashed by its key where it has one (no read-back), else by
        its tensors; a keyed item is queued for the cache."""
        key = self.keys.get((modality, index))
        items[modality].append((data, key or content_hash(modality, *data.values())))
        expansions[modality].append(expansion)
        if key is not None and self.cache is not None:
            cached = CachedMedia(data, key, expansion, pixels, audio_samples)
            self.pending.append((key, cached))

    def store(self) -> None:
        """The queued items into the cache, once the whole request is processed and its device work
        finished (``DeviceMedia.preparing`` synchronised its stream): their read-back to the host runs on
        the cache's thread, not this request's."""
        for key, cached in self.pending:
            self.cache.put(key, cached)  # type: ignore[union-attr]
        self.pending.clear()


def _pixels(image: Any) -> int:
    """Pixels of a decoded image as its decoding charged them: a PIL image's, or a device-decoded [3, H, W]
    tensor's (other inputs are not cached: 0)."""
    if isinstance(image, torch.Tensor) and image.dim() == 3:
        return image.shape[1] * image.shape[2]
    size = getattr(image, "size", None)
    return size[0] * size[1] if isinstance(size, tuple) else 0


def _decode_all(load, values: list | tuple, name: str | None = None, names: list[int] | None = None) -> list:
    """``load`` on every encoded input (bytes, paths, data already decoded pass through), the encoded ones
    in parallel threads: JPEG/PNG decoding releases the GIL, so a video's frames decode side by side.
    Failures name the input (``name[i]: ...``, ``i`` from ``names`` if given) when ``name`` is given, and
    the first one in order wins."""
    encoded = (bytes, bytearray, str, LocalFile)

    def one(i: int, value: Any) -> Any:
        if not isinstance(value, encoded):
            return value
        return _named(f"{name}[{names[i] if names else i}]", load, value) if name else load(value)

    if sum(isinstance(v, encoded) for v in values) < 2:
        return [one(i, v) for i, v in enumerate(values)]
    return map_in_pool(lambda iv: one(*iv), list(enumerate(values)))


def _named(where: str, load, value: Any) -> Any:
    """Decode one media input; failures name the input (``image[1]: could not decode image: ...``), except
    the request's budget, which names ``multi_modal_data``."""
    try:
        return load(value)
    except MediaBudgetError:
        raise
    except (ValueError, OSError, TypeError) as exc:
        raise ValueError(f"{where}: {exc}") from exc


def _encoded_size(value: Any) -> int:
    """Encoded bytes of one input: its length, a local file's size, 0 for already-decoded media (and for a
    file that cannot be read, whose reader reports it)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return len(value)
    if isinstance(value, (LocalFile, str, Path)):
        try:
            return os.stat(value.path if isinstance(value, LocalFile) else value).st_size
        except (OSError, ValueError):
            return 0
    return 0


def _check_frame_list(frames: Any, limits: MediaLimits) -> None:
    if hasattr(frames, "__len__") and len(frames) > limits.max_video_frames:
        raise ValueError(
            f"{len(frames)} frames exceed the limit of {limits.max_video_frames} (max_video_frames)"
        )


def _check_encoded_media(media: dict[str, list[Any]], limits: MediaLimits) -> None:
    """Before anything decodes: each item's (and each frame's) encoded size, the frame count of frame lists,
    and the request's encoded total."""
    total = 0
    for modality, values in media.items():
        for i, value in enumerate(values):
            if modality == "video" and isinstance(value, (list, tuple)):
                _named(f"video[{i}]", lambda v: _check_frame_list(v, limits), value)
                parts = value
            else:
                parts = [value]
            for part in parts:
                size = _encoded_size(part)
                _named(f"{modality}[{i}]", lambda n: check_item_bytes(n, limits.max_media_item_bytes), size)
                total += size
    if total > limits.max_media_bytes:
        raise MediaBudgetError(
            f"multi_modal_data: {total} bytes of encoded media exceed the limit of {limits.max_media_bytes} "
            "per request (max_media_bytes)"
        )


def bidirectional_spans(items: list[MultimodalItem]) -> list[tuple[int, int]]:
    """Token ranges that attend bidirectionally on sliding layers: each image and each video frame."""
    return [span for item in items if item.modality in ("image", "video") for span in item.spans]
