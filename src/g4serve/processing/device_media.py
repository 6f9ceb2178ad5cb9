"""Images and video frames prepared on the engine's GPU (``--media-on-gpu``).

On the host, a request of six 480p JPEG frames spends ~13 ms before the engine (two cores,
``bench/preprocess_media.py``): ~4 ms decoding, ~4 ms resizing, ~2 ms cutting patches, the rest copies and
the content hash. Here JPEGs are decoded by nvJPEG (torchvision's ``decode_jpeg`` on CUDA: the request's
images, or a video's sampled frames, in one batched call), and every image and frame, whoever decoded it,
is resized and cut into patches on the device. The uint8 patches stay there for the vision encoder. Audio
clips' log-mel features are computed on the device too (``AudioFeatureExtractor(..., device=)``).

What the device decodes is only what it would decode as the host does: a JPEG in an allowed format whose
header (parsed by PIL, no pixel decoded) announces 3-channel YCbCr or grayscale, no EXIF rotation, and a
size within ``max_media_pixels``. Anything else (PNG, CMYK, rotated, over a limit, not parseable) and any
JPEG nvJPEG refuses goes through the host path (``image.load_image``), which gives the same errors as
without this option.

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
    ``decode_jpeg`` is libjpeg-turbo and the float resize the same arithmetic as on the GPU)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
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

    def _decode(self, blobs: Sequence[bytes | bytearray]) -> list[torch.Tensor]:
        data = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs]
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=self.device)

    def decode_jpegs(
        self, values: Sequence[Any], budget: MediaBudget
    ) -> tuple[list[torch.Tensor | None], set[int]]:
        """uint8 [3, H, W] on the device for each value the device decodes, None for the rest; and the
        indices of the JPEGs charged to ``budget`` (before decoding, as the host path charges) that nvJPEG
        then refused."""
        out: list[torch.Tensor | None] = [None] * len(values)
        if not self.decodes_jpeg:
            return out, set()
        picked, sizes = [], []
        for i, value in enumerate(values):
            size = device_jpeg_size(value, budget.limits) if isinstance(value, (bytes, bytearray)) else None
            if size is not None:
                budget.charge_pixels(size[0] * size[1])
                picked.append(i)
                sizes.append(size)
        if not picked:
            return out, set()
        try:
            decoded: list[torch.Tensor | None] = list(self._decode([values[i] for i in picked]))
        except RuntimeError:  # one bad stream fails the batch: each alone, the failures to the host
            decoded = [self._decode_or_none(values[i]) for i in picked]
        refused = set()
        for i, (width, height), tensor in zip(picked, sizes, decoded):
            # a stream whose frames disagree with the header PIL read (two SOF markers, say) is the host's
            if tensor is None or tuple(tensor.shape) != (3, height, width):
                refused.add(i)
            else:
                out[i] = tensor
        return out, refused

    def _decode_or_none(self, blob: bytes | bytearray) -> torch.Tensor | None:
        try:
            return self._decode([blob])[0]
        except RuntimeError:
            return None

    def upload(self, image: Any) -> torch.Tensor:
        """A host-decoded image (PIL, array, tensor) as uint8 [3, H, W] on the device."""
        return image_to_tensor(image).to(self.device)
