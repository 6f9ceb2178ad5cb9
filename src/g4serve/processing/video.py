"""Gemma 4 video preprocessing: PyAV decoding, frame sampling and per-frame patchify, matching
transformers' Gemma4VideoProcessor (defaults: 32 uniformly sampled frames, 70 soft tokens per frame)."""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import av
import numpy as np
import PIL.Image
import torch

from .image import check_max_soft_tokens, image_to_tensor, patchify, rescale_pixels, resize_to_patch_budget
from .pool import map_in_pool

DEFAULT_NUM_FRAMES = 32
# transformers' Gemma4Processor.replace_video_token assumes this when the frame rate is unknown.
FALLBACK_FPS = 24.0


@dataclass(frozen=True)
class VideoFrames:
    frames: np.ndarray  # uint8 [F, H, W, 3] RGB
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


def _video_frames(frames: np.ndarray, indices: Sequence[int], fps: float | None) -> VideoFrames:
    rate = fps or FALLBACK_FPS
    return VideoFrames(frames, [i / rate for i in indices], fps, list(indices))


def _open(source: str | os.PathLike | bytes) -> av.container.InputContainer:
    try:
        if isinstance(source, (bytes, bytearray, memoryview)):
            return av.open(io.BytesIO(bytes(source)))
        return av.open(os.fspath(source))
    except (av.FFmpegError, OSError, ValueError) as e:
        raise ValueError(f"could not decode video: {e}") from e


def _decode(source: str | os.PathLike | bytes, wanted: set[int] | None) -> tuple[dict[int, np.ndarray], int]:
    """Decode the first video stream in order; RGB arrays for `wanted` indices, plus the number of frames
    seen."""
    picked: dict[int, np.ndarray] = {}
    count = 0
    last = max(wanted) if wanted else -1
    with _open(source) as container:
        if not container.streams.video:
            raise ValueError("could not decode video: no video stream")
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        try:
            for frame in container.decode(stream):
                if wanted is not None and count > last:
                    break
                if wanted is not None and count in wanted:
                    # Same conversion as transformers' read_video_pyav.
                    picked[count] = frame.to_ndarray(format="rgb24")
                count += 1
        except av.FFmpegError as e:
            raise ValueError(f"could not decode video: {e}") from e
    return picked, count


def _probe(source: str | os.PathLike | bytes) -> tuple[int, float | None]:
    with _open(source) as container:
        if not container.streams.video:
            raise ValueError("could not decode video: no video stream")
        stream = container.streams.video[0]
        # transformers' read_video_pyav uses these header fields verbatim.
        return stream.frames, float(stream.average_rate) if stream.average_rate else None


def load_video(source: str | os.PathLike | bytes, num_frames: int = DEFAULT_NUM_FRAMES) -> VideoFrames:
    """Decode a video file (path or raw bytes: mp4, webm, ...) and sample frames like transformers' PyAV
    loader."""
    total, fps = _probe(source)
    if total <= 0:
        # Containers such as webm carry no frame count: count by decoding (transformers fails here).
        total = _decode(source, None)[1]
    indices = sample_frame_indices(total, num_frames)
    picked, seen = _decode(source, set(indices))
    if len(picked) < len(indices):
        # The header over-promised frames; resample over what actually decodes.
        indices = sample_frame_indices(seen, num_frames)
        picked, _ = _decode(source, set(indices))
    return _video_frames(np.stack([picked[i] for i in indices]), indices, fps)


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
    return _video_frames(np.stack(picked), indices, fps)


def preprocess_video(
    video: VideoFrames | np.ndarray | Sequence[PIL.Image.Image | np.ndarray],
    max_soft_tokens: int = 70,
    patch_size: int = 16,
    pooling_kernel_size: int = 3,
    rescale: bool = True,
) -> VideoFeatures:
    """Gemma4VideoProcessor._preprocess on already-sampled frames (raw frames count as frames 0..F-1 at
    24 fps). ``rescale=False``: uint8 patches, as ``preprocess_images``."""
    check_max_soft_tokens(max_soft_tokens)
    if not isinstance(video, VideoFrames):
        video = sample_video_frames(video, num_frames=len(video) or 1)
    max_patches = max_soft_tokens * pooling_kernel_size**2
    pixels = torch.from_numpy(video.frames).permute(0, 3, 1, 2)  # a channels-last view: what the resize wants
    pixels = resize_to_patch_budget(pixels, patch_size, max_patches, pooling_kernel_size)
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
