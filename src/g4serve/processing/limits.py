"""Caps on what one request's media may cost to decode, and the per-request budget that enforces them.

Every media input is decoded from bytes held in memory (local files are read here first, with a byte cap),
so FFmpeg and libsndfile never open a path; FFmpeg may only use the demuxers listed below (no concat, HLS,
image2 or network demuxers, no protocols), PIL only the image formats listed. Sizes are checked from the
headers before decoding and again on what actually decodes. Errors are ``ValueError`` s that name the
field and the limit; per-request totals raise ``MediaBudgetError`` (a ``ValueError``) starting with
``multi_modal_data:``.
"""

from __future__ import annotations

import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

AUDIO_DEMUXERS = (
    "wav", "w64", "flac", "ogg", "mp3", "aac", "matroska", "webm", "mov", "mp4", "m4a", "3gp", "aiff", "caf",
)  # fmt: skip
VIDEO_DEMUXERS = (
    "mov", "mp4", "m4a", "3gp", "matroska", "webm", "avi", "mpegts", "mpeg", "flv", "ogg", "gif",
)  # fmt: skip
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")  # JPEG includes MPO (phone cameras)


@dataclass(frozen=True)
class MediaLimits:
    # Encoded bytes of one media item: a data: URL payload, a local file, one frame of a frame list.
    max_media_item_bytes: int = 256 << 20
    # Encoded media bytes of one request, every item (and every frame) together.
    max_media_bytes: int = 512 << 20
    # Pixels of one decoded image or video frame (checked from the header, and again once decoded).
    max_media_pixels: int = 8192 * 8192
    # Decoded pixels one request keeps: its images plus the sampled frames of its videos (~1.6 GB as RGB).
    max_request_pixels: int = 1 << 29
    # PIL formats an image (or a frame of a frame list) may be in.
    image_formats: tuple[str, ...] = IMAGE_FORMATS
    # Lowest audio sample rate accepted, in Hz.
    audio_min_sample_rate: int = 1_000
    # Highest audio sample rate accepted, in Hz.
    audio_max_sample_rate: int = 384_000
    # Most audio channels accepted (they are averaged to mono).
    audio_max_channels: int = 64
    # Seconds of each clip decoded; the rest is dropped before resampling (the model hears the first 30 s).
    max_audio_seconds: float = 30.0
    # Hard cap on the sample frames decoded from one clip before resampling.
    audio_max_frames: int = 16_000_000
    # Seconds of audio (after trimming) in one request, all clips together.
    max_request_audio_seconds: float = 600.0
    # Sample values (frames x channels) decoded from one request's audio, all clips together, before the
    # channels are mixed to mono: decoding costs this, not the seconds kept (64 channels of silence in
    # Vorbis or Opus compress to ~5 KB/s). 2**26 holds 600 s of 48 kHz stereo (57.6M).
    max_request_decoded_audio_samples: int = 1 << 26
    # FFmpeg demuxers audio may be in (``format_whitelist``); libsndfile reads WAV/FLAC/OGG/MP3/AIFF/CAF.
    audio_demuxers: tuple[str, ...] = AUDIO_DEMUXERS
    # Frames one video may have (from its header, or counted while decoding); also the longest frame list.
    max_video_frames: int = 9_000
    # Pixels decoded over all frames of one video, the frames not sampled included (5 min of 1080p30).
    video_max_decoded_pixels: int = 1920 * 1080 * 9_000
    # FFmpeg demuxers a video may be in (``format_whitelist``; audio_demuxers too: "no video stream").
    video_demuxers: tuple[str, ...] = VIDEO_DEMUXERS
    # Bytes FFmpeg reads to detect the container and its streams (``probesize``).
    probe_bytes: int = 5_000_000
    # Microseconds of media FFmpeg analyses to find stream parameters (``analyzeduration``).
    analyze_us: int = 5_000_000
    # Streams a container may declare (``max_streams``).
    max_streams: int = 32

    def __post_init__(self) -> None:
        for name in (
            "max_media_item_bytes",
            "max_media_bytes",
            "max_media_pixels",
            "max_request_pixels",
            "audio_min_sample_rate",
            "audio_max_channels",
            "audio_max_frames",
            "max_request_decoded_audio_samples",
            "max_video_frames",
            "video_max_decoded_pixels",
            "probe_bytes",
            "analyze_us",
            "max_streams",
        ):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name}: must be positive")
        if self.audio_max_sample_rate < self.audio_min_sample_rate:
            raise ValueError("audio_max_sample_rate: must be >= audio_min_sample_rate")
        for name in ("max_audio_seconds", "max_request_audio_seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be positive")

    def ffmpeg_options(self, demuxers: tuple[str, ...]) -> dict[str, str]:
        """``container_options`` for ``av.open``: only these demuxers, no protocols (the input is always a
        Python file object, so nothing may open another file or URL), bounded probing."""
        return {
            "format_whitelist": ",".join(demuxers),
            "protocol_whitelist": "none",
            "probesize": str(self.probe_bytes),
            "analyzeduration": str(self.analyze_us),
            "max_streams": str(self.max_streams),
        }

    def codec_options(self) -> dict[str, str]:
        """Decoder options: the decoder itself refuses frames far over the pixel cap before allocating them
        (with slack: it counts padded sizes; every decoded frame is checked exactly afterwards)."""
        return {"max_pixels": str(min(2 * self.max_media_pixels + (1 << 20), 2**31 - 1))}


class MediaBudgetError(ValueError):
    """A per-request total exceeded; its message starts with ``multi_modal_data:``."""


class MediaBudget:
    """The running totals of one request (thread-safe: images and frames decode in the media pool)."""

    def __init__(self, limits: MediaLimits | None = None):
        self.limits = limits or MediaLimits()
        self.pixels = 0
        self.audio_samples = 0
        self.decoded_audio_samples = 0
        self._lock = threading.Lock()

    def check_pixels(self, n: int) -> None:
        """Refuse, without charging, if ``n`` more pixels would not fit (a prediction from headers)."""
        if self.pixels + n > self.limits.max_request_pixels:
            raise MediaBudgetError(self._pixels_message(self.pixels + n))

    def charge_pixels(self, n: int) -> None:
        with self._lock:
            if self.pixels + n > self.limits.max_request_pixels:
                raise MediaBudgetError(self._pixels_message(self.pixels + n))
            self.pixels += n

    def charge_audio(self, num_samples: int, sample_rate: int) -> None:
        cap = round(self.limits.max_request_audio_seconds * sample_rate)
        with self._lock:
            if self.audio_samples + num_samples > cap:
                raise MediaBudgetError(
                    f"multi_modal_data: the audio of this request exceeds "
                    f"{self.limits.max_request_audio_seconds:g} s (max_request_audio_seconds)"
                )
            self.audio_samples += num_samples

    def check_decoded_audio(self, n: int) -> None:
        """Refuse, without charging, if decoding ``n`` more sample values would not fit (from a header)."""
        if self.decoded_audio_samples + n > self.limits.max_request_decoded_audio_samples:
            raise MediaBudgetError(self._decoded_audio_message())

    def charge_decoded_audio(self, n: int) -> None:
        """``n`` sample values (frames x channels) just decoded; raises once the request's total is past its
        cap, so decoding stops within a block of it."""
        with self._lock:
            self.decoded_audio_samples += n
            if self.decoded_audio_samples > self.limits.max_request_decoded_audio_samples:
                raise MediaBudgetError(self._decoded_audio_message())

    def _decoded_audio_message(self) -> str:
        return (
            f"multi_modal_data: decoding the audio of this request needs more than "
            f"{self.limits.max_request_decoded_audio_samples} sample values (frames x channels, "
            "max_request_decoded_audio_samples); send a mono or stereo mix, or less audio"
        )

    def _pixels_message(self, total: int) -> str:
        return (
            f"multi_modal_data: the decoded images and video frames of this request need at least {total} "
            f"pixels, over the limit of {self.limits.max_request_pixels} (max_request_pixels)"
        )


def limits_of(limits: MediaLimits | None, budget: MediaBudget | None) -> MediaLimits:
    if limits is not None:
        return limits
    return budget.limits if budget is not None else MediaLimits()


def check_item_bytes(n: int, max_bytes: int) -> None:
    if n > max_bytes:
        raise ValueError(
            f"{n} encoded bytes exceed the limit of {max_bytes} per media item (max_media_item_bytes)"
        )


def is_within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def read_media_file(path: str | os.PathLike, max_bytes: int, root: str | os.PathLike | None = None) -> bytes:
    """The bytes of a local media file, at most ``max_bytes`` of them.

    With ``root``, the path (symlinks followed) must stay inside the resolved root; the check is repeated on
    the opened file itself, so a symlink swapped in after validation cannot escape. The error for a path
    outside the root is the same whether or not it exists.
    """
    where = os.fspath(path)
    target = Path(where)
    if root is not None:
        resolved_root = Path(root).resolve()
        try:
            target = target.resolve()
        except (OSError, RuntimeError):  # a symlink loop
            target = None
        if target is None or not is_within(target, resolved_root):
            raise ValueError(f"{where!r} is outside --allowed-local-media-path")
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    if root is not None:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(target, flags)
    except OSError as exc:
        raise ValueError(f"cannot read local media file {where!r}: {exc.strerror}") from None
    with os.fdopen(fd, "rb", closefd=True) as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"local media {where!r} is not a regular file")
        if root is not None and os.path.exists(f"/proc/self/fd/{f.fileno()}"):
            opened = Path(os.readlink(f"/proc/self/fd/{f.fileno()}"))
            if not is_within(opened, resolved_root):
                raise ValueError(f"{where!r} is outside --allowed-local-media-path")
        check_item_bytes(info.st_size, max_bytes)
        data = f.read(max_bytes + 1)
    check_item_bytes(len(data), max_bytes)
    return data


__all__ = [
    "AUDIO_DEMUXERS",
    "IMAGE_FORMATS",
    "VIDEO_DEMUXERS",
    "MediaBudget",
    "MediaBudgetError",
    "MediaLimits",
    "check_item_bytes",
    "limits_of",
    "read_media_file",
]
