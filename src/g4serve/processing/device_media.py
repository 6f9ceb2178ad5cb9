"""Images and video frames prepared on the engine's GPU (``--media-on-gpu``).

On the host, a request of six 480p JPEG frames spends ~13 ms before the engine (two cores,
``bench/preprocess_media.py``): ~4 ms decoding, ~4 ms resizing, ~2 ms cutting patches, the rest copies and
the content hash. Here JPEGs are decoded by nvJPEG (torchvision's ``decode_jpeg`` on CUDA: the request's
images, or a video's sampled frames, in one batched call), resized and cut into patches on the device, and
the uint8 patches stay there for the vision encoder. A container video's frames, decoded on the host, are
uploaded and resized there too. Audio clips' log-mel features are computed on the device
(``AudioFeatureExtractor(..., device=)``).

What the device decodes is only what it would decode as the host does: a JPEG in an allowed format whose
header (parsed by PIL, no pixel decoded) announces 3-channel YCbCr or grayscale, no EXIF rotation, and a
size within ``max_media_pixels`` and ``DeviceMedia``'s own bounds. Anything else (PNG, CMYK, rotated, over
a limit, not parseable) and any JPEG nvJPEG refuses takes the host path (``image.load_image``, the uint8
resize), bit for bit as without this option and with its errors.

Numerics: nvJPEG's IDCT and chroma upsampling are not libjpeg-turbo's (torchvision's own test allows a
mean difference under 2 levels), and the resize runs in float32, clamped and rounded once at the end
(``resize_to_patch_budget(float_resize=True)``: what torchvision does for uint8 on CUDA, so what
transformers' processor computes with ``device="cuda"``). torch's uint8 kernel on the host, which matches
transformers' CPU processor bit for bit, clamps between its two passes: where bicubic overshoots at a sharp
edge the two differ by many levels, elsewhere by at most one (mean under 0.3 in tests/processing). Hence
opt-in. On the CPU, with libjpeg-turbo, this path equals the host decode plus the float resize bit for bit.

Streams: a thread's device work runs on its own side stream and is waited for before the item leaves
``preparing`` (its content hash reads the patches back anyway), so the engine gets finished tensors; the
engine records its stream on them when it reads them (``EncoderRunner._upload``), so their memory is not
reused while its kernels may still read it.
"""

from __future__ import annotations

import contextlib
import io
import logging
import threading
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import PIL.Image
import torch
from torchvision.io import ImageReadMode, decode_jpeg

from g4serve.processing.image import image_to_tensor
from g4serve.processing.limits import MediaBudget, MediaLimits

log = logging.getLogger(__name__)

# torchvision 0.29 deprecates its image codecs in favour of TorchCodec, which needs a system FFmpeg; the
# decoders still work and are what the device image has.
warnings.filterwarnings(
    "ignore",
    message="The image decoding and encoding capabilities of TorchVision",
    category=DeprecationWarning,
)

JPEG_MAGIC = b"\xff\xd8\xff"
EXIF_ORIENTATION = 0x0112
# DeviceMedia's bounds on device memory (pixels; uint8 RGB is 3 bytes a pixel, the float resize's copy of
# one frame 12): a frame up to 4K UHD (8.4M), a thread's batch up to 32 frames of 1080p (67M), all threads
# 134M pixels.
MAX_FRAME_PIXELS = 1 << 23
MAX_BATCH_PIXELS = 1 << 26
MAX_IN_FLIGHT_PIXELS = 1 << 27


def device_memory_bound(threads: int) -> int:
    """Bytes ``DeviceMedia`` may hold at once at the default bounds with ``threads`` preparing threads: the
    in-flight uint8 pixels, and each thread's float copy of one frame (what the engine keeps free for it)."""
    return 3 * MAX_IN_FLIGHT_PIXELS + threads * 12 * MAX_FRAME_PIXELS


def device_jpeg_size(data: bytes | bytearray, limits: MediaLimits) -> tuple[int, int] | None:
    """(width, height) of a JPEG the device may decode; None sends it to the host path (which decodes it or
    reports why not). Reads the header only."""
    if not bytes(data[:3]) == JPEG_MAGIC or "JPEG" not in limits.image_formats:
        return None
    if len(data) > limits.max_media_item_bytes:
        return None
    try:
        image = PIL.Image.open(io.BytesIO(data), formats=["JPEG"])
        orientation = image.getexif().get(EXIF_ORIENTATION, 1)
    except Exception:  # PIL's zoo of errors: the host path names it
        return None
    width, height = image.size
    if image.mode not in ("RGB", "L") or orientation != 1 or width * height > limits.max_media_pixels:
        return None
    return width, height


def _tiny_jpeg() -> bytes:
    buf = io.BytesIO()
    PIL.Image.new("RGB", (16, 16), (200, 100, 50)).save(buf, "JPEG")
    return buf.getvalue()


class DeviceMedia:
    """Decode, resize and patchify on ``device`` (a CUDA device when served; tests run it on the CPU, where
    ``decode_jpeg`` is libjpeg-turbo and the float resize the same arithmetic as on the GPU).

    What it holds of the device's memory is bounded, whatever requests send (the host path, which the
    per-request ``max_request_pixels`` bounds, has the machine's RAM; this has what the KV cache leaves):
    an image or frame over ``max_frame_pixels`` takes the host path; a thread decodes at most
    ``max_batch_pixels`` at once (a video whose sampled frames are more takes the host path); and all
    threads together hold at most ``max_in_flight_pixels`` of decoded or uploaded pixels (``reserve``:
    a thread past it waits). With the float resize's copy of one frame (4 bytes a pixel) that is about
    400 MB + 100 MB a thread at the defaults."""

    def __init__(
        self,
        device: torch.device | str,
        max_frame_pixels: int = MAX_FRAME_PIXELS,
        max_batch_pixels: int = MAX_BATCH_PIXELS,
        max_in_flight_pixels: int = MAX_IN_FLIGHT_PIXELS,
    ):
        self.device = torch.device(device)
        self.max_frame_pixels = max_frame_pixels
        self.max_batch_pixels = max_batch_pixels
        self.max_in_flight_pixels = max_in_flight_pixels
        self.in_flight_pixels = 0
        self._room = threading.Condition()
        self._local = threading.local()
        self.decodes_jpeg = self._probe()

    def _probe(self) -> bool:
        """Whether this torchvision decodes JPEG on the device (a build without nvJPEG raises)."""
        try:
            self._decode([_tiny_jpeg()])
            return True
        except RuntimeError as exc:
            log.warning("no JPEG decoding on %s (%s): images are decoded on the host", self.device, exc)
            return False

    @contextlib.contextmanager
    def preparing(self) -> Iterator[None]:
        """The block's device work on this thread's side stream (never the engine's), finished on exit."""
        if self.device.type != "cuda":
            yield
            return
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(stream):
            yield
        stream.synchronize()

    @contextlib.contextmanager
    def reserve(self, pixels: int) -> Iterator[None]:
        """Hold ``pixels`` of the in-flight budget for the block, waiting for room (a reservation over the
        whole budget runs once nothing else is in flight). The block's device work is finished on exit
        (its stream synchronised), so the memory it frees is free."""
        with self._room:
            self._room.wait_for(
                lambda: (
                    self.in_flight_pixels == 0 or self.in_flight_pixels + pixels <= self.max_in_flight_pixels
                )
            )
            self.in_flight_pixels += pixels
        try:
            yield
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
        finally:
            with self._room:
                self.in_flight_pixels -= pixels
                self._room.notify_all()

    def jpeg_size(self, value: Any, limits: MediaLimits) -> tuple[int, int] | None:
        """(width, height) of an encoded image this device decodes (``device_jpeg_size``, at most
        ``max_frame_pixels``); None: the host path."""
        if not self.decodes_jpeg or not isinstance(value, (bytes, bytearray)):
            return None
        size = device_jpeg_size(value, limits)
        return size if size is not None and size[0] * size[1] <= self.max_frame_pixels else None

    def batches(self, indices: Sequence[int], sizes: Sequence[tuple[int, int] | None]) -> list[list[int]]:
        """``indices`` in order, cut into runs of at most ``max_batch_pixels`` (each at least one)."""
        runs: list[list[int]] = []
        total = 0
        for i in indices:
            width, height = sizes[i]  # type: ignore[misc]
            if runs and total + width * height <= self.max_batch_pixels:
                runs[-1].append(i)
                total += width * height
            else:
                runs.append([i])
                total = width * height
        return runs

    def _decode(self, blobs: Sequence[bytes | bytearray]) -> list[torch.Tensor]:
        data = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs]
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=self.device)

    def decode(
        self, blobs: Sequence[bytes | bytearray], sizes: Sequence[tuple[int, int]], budget: MediaBudget
    ) -> list[torch.Tensor | None]:
        """uint8 [3, H, W] on the device for each JPEG of ``jpeg_size`` ``sizes``, in one batched call;
        None where nvJPEG refused the stream or decoded another size than the header said (two frame headers,
        say: the host path then decodes it). Every one is charged to ``budget`` first, as the host path
        charges before decoding."""
        for width, height in sizes:
            budget.charge_pixels(width * height)
        try:
            decoded: list[torch.Tensor | None] = list(self._decode(blobs))
        except RuntimeError:  # one bad stream fails the batch: each alone, the failures to the host
            decoded = [self._decode_or_none(blob) for blob in blobs]
        return [
            t if t is not None and tuple(t.shape) == (3, height, width) else None
            for t, (width, height) in zip(decoded, sizes)
        ]

    def _decode_or_none(self, blob: bytes | bytearray) -> torch.Tensor | None:
        try:
            return self._decode([blob])[0]
        except RuntimeError:
            return None

    def upload(self, image: Any) -> torch.Tensor:
        """A host-decoded image (PIL, array, tensor) as uint8 [3, H, W] on the device."""
        return image_to_tensor(image).to(self.device)
