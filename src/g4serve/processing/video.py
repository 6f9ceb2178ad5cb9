"""Gemma 4 video preprocessing: PyAV decoding, frame sampling and per-frame patchify, matching
transformers' Gemma4VideoProcessor (defaults: 32 uniformly sampled frames, 70 soft tokens per frame)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import av
import numpy as np
import PIL.Image
import torch

from .audio import ffmpeg_error, open_media
from .image import check_max_soft_tokens, image_to_tensor, patchify, rescale_pixels, resize_to_patch_budget
from .limits import MediaBudget, MediaLimits, check_item_bytes, limits_of, read_media_file
from .pool import map_in_pool

DEFAULT_NUM_FRAMES = 32
# transformers' Gemma4Processor.replace_video_token assumes this when the frame rate is unknown.
FALLBACK_FPS = 24.0


@dataclass(frozen=True)
class VideoFrames:
    # uint8 [F, H, W, 3] RGB; a tensor may be a view of [F, 3, H, W] on a GPU (--media-on-gpu)
    frames: np.ndarray | torch.Tensor
    timestamps_s: list[float]
    fps: float | None  # source frame rate; None when unknown (timestamps then assume FALLBACK_FPS)
    frame_indices: list[int]  # positions of `frames` in the source video


@dataclass(frozen=True)
class VideoFeatures:
    pixel_values: torch.Tensor  # float32 [F, max_patches, 3 * patch_size**2] (uint8 0-255 with rescale=False)
    position_ids: torch.Tensor  # int64 [F, max_patches, 2] as (x, y); (-1, -1) marks padding
    num_soft_tokens_per_frame: int
    timestamps_s: list[float]


def sample_frame_indices(total_num_frames: int, num_frames: int = DEFAULT_NUM_FRAMES) -> list[int]:
    """transformers' default_sample_indices_fn: `arange(n) * total // n`.

    transformers raises when `num_frames > total_num_frames`; we keep every frame instead, which equals its
    output with `num_frames=total_num_frames` (or `do_sample_frames=False`).
    """
    if total_num_frames <= 0:
        raise ValueError("video has no frames")
    if num_frames <= 0:
        raise ValueError(f"`num_frames` must be positive, got {num_frames}")
    n = min(num_frames, total_num_frames)
    return [i * total_num_frames // n for i in range(n)]


def video_frames_at(
    frames: np.ndarray | torch.Tensor, indices: Sequence[int], fps: float | None
) -> VideoFrames:
    rate = fps or FALLBACK_FPS
    return VideoFrames(frames, [i / rate for i in indices], fps, list(indices))


@dataclass(frozen=True)
class _Encoded:
    """A video's bytes (read into memory: FFmpeg never gets a path) and the limits to decode them under."""

    data: bytes
    limits: MediaLimits


def _encoded(source: str | os.PathLike | bytes | _Encoded, limits: MediaLimits | None = None) -> _Encoded:
    if isinstance(source, _Encoded):
        return source
    limits = limits or MediaLimits()
    if isinstance(source, (bytes, bytearray, memoryview)):
        check_item_bytes(len(source), limits.max_media_item_bytes)
        return _Encoded(bytes(source), limits)
    try:
        return _Encoded(read_media_file(source, limits.max_media_item_bytes), limits)
    except ValueError as e:
        raise ValueError(f"could not decode video: {e}") from None


def open_video(
    source: str | os.PathLike | bytes | _Encoded, limits: MediaLimits | None = None
) -> av.container.InputContainer:
    """PyAV's container over a video's bytes (a file is read first), under ``limits``: the allowed demuxers
    only, no protocols, bounded probing."""
    enc = _encoded(source, limits)
    # The audio demuxers too, so an audio file sent as video is answered "no video stream".
    demuxers = tuple(dict.fromkeys(enc.limits.video_demuxers + enc.limits.audio_demuxers))
    return open_media(enc.data, "video", demuxers, enc.limits)


def _check_frame_count(count: int, limits: MediaLimits) -> None:
    if count > limits.max_video_frames:
        raise ValueError(
            f"video has {count} frames, over the limit of {limits.max_video_frames} (max_video_frames)"
        )


def _check_frame_size(width: int, height: int, limits: MediaLimits) -> None:
    if width * height > limits.max_media_pixels:
        raise ValueError(
            f"video frames of {width}x{height} exceed the limit of {limits.max_media_pixels} pixels per "
            "frame (max_media_pixels)"
        )


def _check_decoded_pixels(total: int, limits: MediaLimits) -> None:
    if total > limits.video_max_decoded_pixels:
        raise ValueError(
            f"decoding this video takes more than {limits.video_max_decoded_pixels} pixels over all its "
            "frames (video_max_decoded_pixels); send a shorter or smaller video"
        )


def check_decoded_frame(width: int, height: int, count: int, decoded: int, limits: MediaLimits) -> None:
    """Refuse a decoded frame past the caps, whatever the header announced: ``count`` frames decoded so far
    with this one, ``decoded`` pixels over all of them."""
    _check_frame_size(width, height, limits)
    _check_frame_count(count, limits)
    _check_decoded_pixels(decoded, limits)


def check_video_header(
    stream: av.video.stream.VideoStream,
    wanted: set[int] | None,
    limits: MediaLimits,
    budget: MediaBudget | None,
) -> None:
    """Refuse from the header alone, before anything decodes: frame size, frame count, total work, and the
    pixels the sampled frames will keep."""
    if stream.codec_context is None:
        raise ValueError("could not decode video: no decoder for its codec")
    width, height = stream.codec_context.width, stream.codec_context.height
    _check_frame_size(width, height, limits)
    _check_frame_count(stream.frames, limits)
    _check_decoded_pixels(max(stream.frames, (max(wanted) + 1) if wanted else 0) * width * height, limits)
    if budget is not None and wanted:
        budget.check_pixels(len(wanted) * width * height)


def _decode(
    source: str | os.PathLike | bytes | _Encoded, wanted: set[int] | None, budget: MediaBudget | None = None
) -> tuple[dict[int, np.ndarray], int]:
    """Decode the first video stream in order; RGB arrays for `wanted` indices, plus the number of frames
    seen. Every decoded frame counts against the frame, per-frame pixel and total pixel caps, whatever size
    the header announced; the kept frames against the request's pixel budget."""
    enc = _encoded(source)
    limits = enc.limits
    picked: dict[int, np.ndarray] = {}
    count = decoded = kept = 0
    last = max(wanted) if wanted else -1
    with open_video(enc) as container:
        if not container.streams.video:
            raise ValueError("could not decode video: no video stream")
        stream = container.streams.video[0]
        check_video_header(stream, wanted, limits, budget)
        stream.thread_type = "AUTO"
        stream.codec_context.options = {**stream.codec_context.options, **limits.codec_options()}
        try:
            for frame in container.decode(stream):
                if wanted is not None and count > last:
                    break
                pixels = frame.width * frame.height
                decoded += pixels
                check_decoded_frame(frame.width, frame.height, count + 1, decoded, limits)
                if wanted is not None and count in wanted:
                    kept += pixels
                    if budget is not None:
                        budget.check_pixels(kept)
                    # Same conversion as transformers' read_video_pyav.
                    picked[count] = frame.to_ndarray(format="rgb24")
                count += 1
        except av.ArgumentError:
            # What the decoder answers for a frame over its max_pixels option (or a malformed one).
            raise ValueError(
                "could not decode video: invalid data, or a frame over the limit of "
                f"{limits.max_media_pixels} pixels (max_media_pixels)"
            ) from None
        except av.FFmpegError as e:
            raise ffmpeg_error("video", e, limits.video_demuxers, opening=False) from None
    return picked, count


def _probe(source: str | os.PathLike | bytes | _Encoded) -> tuple[int, float | None]:
    with open_video(source) as container:
        if not container.streams.video:
            raise ValueError("could not decode video: no video stream")
        stream = container.streams.video[0]
        # transformers' read_video_pyav uses these header fields verbatim.
        return stream.frames, float(stream.average_rate) if stream.average_rate else None


def load_video(
    source: str | os.PathLike | bytes,
    num_frames: int = DEFAULT_NUM_FRAMES,
    limits: MediaLimits | None = None,
    budget: MediaBudget | None = None,
) -> VideoFrames:
    """Decode a video file (path or raw bytes: mp4, webm, ...) and sample frames like transformers' PyAV
    loader.

    A file is read into memory first (at most ``max_media_item_bytes``); FFmpeg only gets bytes and only the
    ``limits.video_demuxers``. The header's frame size and count are checked before decoding, every decoded
    frame again (``max_media_pixels``, ``max_video_frames``, ``video_max_decoded_pixels``), and the kept
    frames count against ``budget`` (the request's ``max_request_pixels``), charged once they are in.
    """
    enc = _encoded(source, limits_of(limits, budget))
    total, fps = _probe(enc)
    _check_frame_count(total, enc.limits)
    if total <= 0:
        # Containers such as webm carry no frame count: count by decoding (transformers fails here).
        total = _decode(enc, None)[1]
    indices = sample_frame_indices(total, num_frames)
    picked, seen = _decode(enc, set(indices), budget)
    if len(picked) < len(indices):
        # The header over-promised frames; resample over what actually decodes.
        indices = sample_frame_indices(seen, num_frames)
        picked, _ = _decode(enc, set(indices), budget)
    sizes = {picked[i].shape for i in indices}
    if len(sizes) > 1:
        raise ValueError(f"video frames differ in size: {sorted(shape[:2] for shape in sizes)}")
    frames = np.stack([picked[i] for i in indices])
    if budget is not None:
        budget.charge_pixels(frames.shape[0] * frames.shape[1] * frames.shape[2])
    return video_frames_at(frames, indices, fps)


def _frame_to_hwc(frame: PIL.Image.Image | np.ndarray) -> np.ndarray:
    if isinstance(frame, np.ndarray) and frame.ndim == 3 and frame.shape[-1] == 3 and frame.dtype == np.uint8:
        return frame
    if isinstance(frame, PIL.Image.Image) and frame.mode == "RGB" and frame.info.get("transparency") is None:
        return np.asarray(frame)  # what image_to_tensor reads, without its CHW round trip
    return image_to_tensor(frame).permute(1, 2, 0).numpy()


def sample_video_frames(
    frames: np.ndarray | Sequence[Any],
    fps: float | None = None,
    num_frames: int = DEFAULT_NUM_FRAMES,
    load: Callable[[Any], PIL.Image.Image | np.ndarray] | None = None,
) -> VideoFrames:
    """Sample frames: a uint8 [F, H, W, C] array, or a list of PIL images / HWC arrays, or of anything
    ``load`` turns into one (encoded images). Only the sampled frames are loaded, side by side in the media
    pool with their HWC conversion.

    Mirrors Gemma4VideoProcessor on array input with `do_sample_frames=True`; `fps=None` means unknown.
    """
    if len(frames) == 0:
        raise ValueError("video has no frames")
    indices = sample_frame_indices(len(frames), num_frames)
    if isinstance(frames, np.ndarray):  # views, converted only if not uint8 HWC already
        picked = [_frame_to_hwc(frames[i]) for i in indices]
    else:
        picked = map_in_pool(lambda i: _frame_to_hwc(load(frames[i]) if load else frames[i]), indices)
    if len({f.shape for f in picked}) > 1:
        raise ValueError(f"video frames differ in size: {sorted({f.shape[:2] for f in picked})}")
    return video_frames_at(np.stack(picked), indices, fps)


def preprocess_video(
    video: VideoFrames | np.ndarray | Sequence[PIL.Image.Image | np.ndarray],
    max_soft_tokens: int = 70,
    patch_size: int = 16,
    pooling_kernel_size: int = 3,
    rescale: bool = True,
    float_resize: bool = False,
) -> VideoFeatures:
    """Gemma4VideoProcessor._preprocess on already-sampled frames (raw frames count as frames 0..F-1 at
    24 fps). ``rescale=False``: uint8 patches, as ``preprocess_images``; frames in a tensor on a GPU give
    patches there (``float_resize`` as ``resize_to_patch_budget``)."""
    check_max_soft_tokens(max_soft_tokens)
    if not isinstance(video, VideoFrames):
        video = sample_video_frames(video, num_frames=len(video) or 1)
    max_patches = max_soft_tokens * pooling_kernel_size**2
    frames = video.frames if isinstance(video.frames, torch.Tensor) else torch.from_numpy(video.frames)
    pixels = frames.permute(0, 3, 1, 2)  # a channels-last view: what the resize wants
    pixels = resize_to_patch_budget(pixels, patch_size, max_patches, pooling_kernel_size, float_resize)
    patches, positions = patchify(pixels, patch_size, max_patches)
    if rescale:
        # The video processor sets do_normalize=True with mean 0 / std 1, so transformers fuses the 1/255
        # rescale into normalize(): a true division by 255, which rounds differently from the image path.
        patches = rescale_pixels(patches, video=True)
    num_real = (pixels.shape[-2] // patch_size) * (pixels.shape[-1] // patch_size)
    return VideoFeatures(patches, positions, num_real // pooling_kernel_size**2, list(video.timestamps_s))


def format_timestamp(seconds: float) -> str:
    return f"{int(seconds // 60):02d}:{int(seconds % 60):02d}"


def video_prompt_text(
    timestamps_s: Sequence[float], num_soft_tokens: int, boi: str, video_token: str, eoi: str
) -> str:
    """Gemma4Processor.replace_video_token: "mm:ss <boi><video>*n<eoi>" per frame, joined by spaces."""
    return " ".join(f"{format_timestamp(t)} {boi}{video_token * num_soft_tokens}{eoi}" for t in timestamps_s)
