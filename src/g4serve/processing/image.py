"""Gemma 4 image preprocessing: aspect-ratio-preserving resize, patchify and pad, bit-identical to
transformers' Gemma4ImageProcessor (torchvision backend). Also the shared patch helpers video.py uses."""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import PIL.Image
import PIL.ImageOps
import torch
from torchvision.transforms.v2 import functional as tvF

from g4serve.processing.limits import MediaBudget, MediaLimits, check_item_bytes, limits_of
from g4serve.processing.pool import map_in_pool

SUPPORTED_SOFT_TOKENS = (70, 140, 280, 560, 1120)
RESCALE_FACTOR = 1 / 255
ImageInput = PIL.Image.Image | np.ndarray | torch.Tensor


@dataclass(frozen=True)
class ImageFeatures:
    pixel_values: torch.Tensor  # float32 [B, max_patches, 3 * patch_size**2] (uint8 0-255 with rescale=False)
    position_ids: torch.Tensor  # int64 [B, max_patches, 2] as (x, y); (-1, -1) marks padding
    num_soft_tokens: list[int]


def check_max_soft_tokens(max_soft_tokens: int) -> None:
    if max_soft_tokens not in SUPPORTED_SOFT_TOKENS:
        raise ValueError(f"`max_soft_tokens` must be one of {SUPPORTED_SOFT_TOKENS}, got {max_soft_tokens!r}")


def aspect_ratio_preserving_size(
    height: int, width: int, patch_size: int, max_patches: int, pooling_kernel_size: int
) -> tuple[int, int]:
    """Largest (h, w), both multiples of pooling_kernel_size * patch_size, that fit in `max_patches`
    patches."""
    if height <= 0 or width <= 0:
        raise ValueError(f"image must be non-empty, got {height}x{width}")
    target_px = max_patches * patch_size**2
    factor = math.sqrt(target_px / (height * width))
    side = pooling_kernel_size * patch_size
    target_h = math.floor(factor * height / side) * side
    target_w = math.floor(factor * width / side) * side
    if target_h == 0 and target_w == 0:
        raise ValueError(f"cannot resize a {height}x{width} image: both sides round down to 0")
    # Extreme aspect ratios: pin the short side to one pooling cell, cap the long side.
    max_side = (max_patches // pooling_kernel_size**2) * side
    if target_h == 0:
        target_h, target_w = side, min(math.floor(width / height) * side, max_side)
    elif target_w == 0:
        target_h, target_w = min(math.floor(height / width) * side, max_side), side
    if target_h * target_w > target_px:
        raise ValueError(
            f"resizing {height}x{width} to {target_h}x{target_w} exceeds {max_patches} patches "
            f"of size {patch_size}"
        )
    return target_h, target_w


def num_soft_tokens_for_size(
    height: int, width: int, max_soft_tokens: int = 280, patch_size: int = 16, pooling_kernel_size: int = 3
) -> int:
    """Soft tokens an image of this size produces, without touching pixels (for request validation)."""
    check_max_soft_tokens(max_soft_tokens)
    h, w = aspect_ratio_preserving_size(
        height, width, patch_size, max_soft_tokens * pooling_kernel_size**2, pooling_kernel_size
    )
    return (h // patch_size) * (w // patch_size) // pooling_kernel_size**2


def load_image(
    data: bytes, limits: MediaLimits | None = None, budget: MediaBudget | None = None
) -> PIL.Image.Image:
    """Decode image bytes the way transformers.image_utils.load_image does (EXIF transpose,
    convert("RGB")).

    Only ``limits.image_formats`` are tried, and the size the header announces must fit
    ``max_media_pixels`` (and ``budget``, the request's ``max_request_pixels``) before any pixel decodes:
    a decompression bomb is a ValueError, never a warning or a gigabyte allocation."""
    limits = limits_of(limits, budget)
    check_item_bytes(len(data), limits.max_media_item_bytes)
    try:
        image = PIL.Image.open(io.BytesIO(data), formats=list(limits.image_formats))
    except PIL.UnidentifiedImageError:
        raise ValueError(
            f"could not decode image: not an image in an allowed format ({', '.join(limits.image_formats)})"
        ) from None
    except Exception as e:  # PIL raises a zoo of types (OSError, SyntaxError, DecompressionBombError...)
        raise ValueError(f"could not decode image: {e}") from e
    width, height = image.size
    if width * height > limits.max_media_pixels:
        raise ValueError(
            f"image of {width}x{height} exceeds the limit of {limits.max_media_pixels} pixels "
            "(max_media_pixels)"
        )
    if budget is not None:
        budget.charge_pixels(width * height)
    try:
        image.load()  # decode now so truncated/corrupt payloads fail here, not later
        image = PIL.ImageOps.exif_transpose(image)
        return image.convert("RGB")
    except Exception as e:  # PIL raises a zoo of types (OSError, SyntaxError, DecompressionBombError...)
        raise ValueError(f"could not decode image: {e}") from e


def _rgba_to_rgb(image: torch.Tensor) -> torch.Tensor:
    # Same float32 composite-over-white and dtype round trip as TorchvisionBackend.convert_to_rgb.
    image = tvF.to_dtype(image.movedim(-3, -1), torch.float32, scale=True)
    image = image[..., :3] * image[..., 3:] + (1 - image[..., 3:])
    return tvF.to_dtype(image, torch.uint8, scale=True).movedim(-1, -3)


def _pil_to_tensor(image: PIL.Image.Image) -> torch.Tensor:
    """uint8 [3, H, W] RGB tensor of a PIL image of any mode (alpha composited over white)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        white = PIL.Image.new("RGBA", image.size, (255, 255, 255, 255))
        image = PIL.Image.alpha_composite(white, image.convert("RGBA"))
    return torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1).contiguous()


def image_to_tensor(image: ImageInput) -> torch.Tensor:
    """uint8 [3, H, W] RGB tensor, converted like TorchvisionBackend.process_image.

    PIL images of any mode are converted by PIL (alpha composited over white); numpy arrays are HWC or HW;
    torch tensors are CHW when the first dim is 1/3/4 (transformers' rule), else HWC.
    """
    if isinstance(image, PIL.Image.Image):
        return _pil_to_tensor(image)
    if isinstance(image, np.ndarray):
        if image.ndim == 3:
            image = np.moveaxis(image, -1, 0)
        tensor = torch.from_numpy(np.ascontiguousarray(image))
    elif isinstance(image, torch.Tensor):
        tensor = image
        if tensor.ndim == 3 and tensor.shape[0] not in (1, 3, 4) and tensor.shape[-1] in (1, 3, 4):
            tensor = tensor.permute(2, 0, 1)
    else:
        # ValueError, not TypeError: every malformed request input maps to one client-error type.
        raise ValueError(  # noqa: TRY004
            f"unsupported image type {type(image).__name__}; expected a PIL image, numpy array or tensor"
        )
    if tensor.dtype != torch.uint8:
        raise ValueError(f"image arrays must be uint8 (0-255), got {tensor.dtype}")
    if tensor.ndim == 2:
        tensor = tensor[None]
    if tensor.ndim != 3 or tensor.shape[0] not in (1, 3, 4) or 0 in tensor.shape:
        raise ValueError(
            f"expected an image of shape HW, HWC or CHW with 1, 3 or 4 channels, got {tuple(image.shape)}"
        )
    tensor = tvF.grayscale_to_rgb(tensor)
    if tensor.shape[0] == 4:
        tensor = _rgba_to_rgb(tensor)
    return tensor.contiguous()


def resize_to_patch_budget(
    pixels: torch.Tensor,
    patch_size: int,
    max_patches: int,
    pooling_kernel_size: int,
    float_resize: bool = False,
) -> torch.Tensor:
    """Bicubic antialiased resize of uint8 [..., 3, H, W] to the patch budget, as Gemma4 processors do.

    The resize runs on a channels-last copy (none for a channels-last view such as decoded video frames):
    torch's antialiased uint8 kernels take it 2.5-4x faster than planar input (six 854x480 frames: 17.5 vs
    6.5 ms on two cores, bench/preprocess_media.py) and give the same bytes (tests/processing compare with
    transformers). Those kernels run one thread per call, so the frames of a video are resized in parallel
    (``processing.pool``).

    ``float_resize``: in float32, then clamped and rounded back to uint8, on any device: on the CPU one
    image at a time (the float copy is 4 bytes a pixel), on a GPU a video's frames together, up to
    ``FLOAT_RESIZE_BATCH_BYTES`` of float copy a call (seven launches for six frames, not forty-two; each
    output pixel's arithmetic is the same either way). That is what torchvision does for uint8 on CUDA (it
    has no uint8 bicubic kernel there), so the GPU media path (``processing.device_media``) computes the
    same on the CPU in tests. Near the uint8 kernel's bytes: it clamps only at the end, the uint8 kernel also
    between its two passes."""
    height, width = pixels.shape[-2:]
    target = aspect_ratio_preserving_size(height, width, patch_size, max_patches, pooling_kernel_size)
    if target == (height, width):
        return pixels
    batch = pixels.reshape(-1, *pixels.shape[-3:])
    out = batch.new_empty(batch.shape[0], batch.shape[1], *target)  # planar, as patchify reads it
    if float_resize:
        step = _float_resize_chunk(batch)
        for i in range(0, batch.shape[0], step):
            resized = tvF.resize(
                batch[i : i + step].to(torch.float32),
                size=list(target),
                interpolation=tvF.InterpolationMode.BICUBIC,
                antialias=True,
            )
            out[i : i + step].copy_(resized.clamp_(0, 255).round_())
        return out.reshape(*pixels.shape[:-2], *target)

    def resize(images: torch.Tensor) -> torch.Tensor:
        return tvF.resize(
            images.contiguous(memory_format=torch.channels_last),
            size=list(target),
            interpolation=tvF.InterpolationMode.BICUBIC,
            antialias=True,
        )

    if batch.shape[0] > 1 and not batch.is_cuda:
        # The uint8 kernel takes a batch on one thread: a video's frames go side by side (the same bytes).
        map_in_pool(lambda i: out[i : i + 1].copy_(resize(batch[i : i + 1])), range(batch.shape[0]))
    else:
        out.copy_(resize(batch))
    return out.reshape(*pixels.shape[:-2], *target)


# The float copy ``float_resize`` makes of the images it resizes in one call on a GPU.
FLOAT_RESIZE_BATCH_BYTES = 256 << 20


def _float_resize_chunk(batch: torch.Tensor) -> int:
    """How many images of ``batch`` [B, C, H, W] one float resize takes: all that fit
    ``FLOAT_RESIZE_BATCH_BYTES`` on a GPU, one on the CPU."""
    if not batch.is_cuda:
        return 1
    return max(1, FLOAT_RESIZE_BATCH_BYTES // max(4 * batch[0].numel(), 1))


def patchify(pixels: torch.Tensor, patch_size: int, max_patches: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., C, H, W] -> patches [..., max_patches, p*p*C] (row, col, channel order) and (x, y) positions."""
    *lead, channels, height, width = pixels.shape
    ph, pw = height // patch_size, width // patch_size
    n = len(lead)
    blocks = pixels.reshape(*lead, channels, ph, patch_size, pw, patch_size)
    blocks = blocks.permute(*range(n), n + 1, n + 3, n + 2, n + 4, n)  # [..., ph, pw, p, p, C], a view
    # One copy straight into the padded output (reshaping, then padding, copied a video's ~12 MB twice).
    rows = max(max_patches, ph * pw)
    patches = pixels.new_empty(*lead, rows, patch_size * patch_size * channels)
    patches[..., : ph * pw, :].view(*lead, ph, pw, patch_size, patch_size, channels).copy_(blocks)
    patches[..., ph * pw :, :] = 0
    xs, ys = torch.meshgrid(torch.arange(pw), torch.arange(ph), indexing="xy")
    positions = torch.full((*lead, rows, 2), -1, dtype=torch.long)
    positions[..., : ph * pw, :] = torch.stack([xs, ys], dim=-1).reshape(ph * pw, 2)
    return patches, positions


def rescale_pixels(pixels: torch.Tensor, video: bool = False) -> torch.Tensor:
    """uint8 patches from ``preprocess_images`` / ``preprocess_video`` with ``rescale=False`` -> the float32
    values the processors return by default, bit for bit, on any device: images ``x * (1/255)`` (transformers'
    image processor multiplies), video frames ``x / 255`` (its video processor fuses the rescale into a
    normalisation by std 1/255, a true division). Float input is returned as it is."""
    if pixels.dtype != torch.uint8:
        return pixels
    x = pixels.to(torch.float32)
    if video:
        # A 0-dim tensor on x's device, not a Python number: CUDA divides by a host scalar as a multiply by
        # its reciprocal, which rounds like the image path, not like the processor's division. Filled there
        # (``new_tensor`` would copy it up blocking: a stream sync in every step that encodes media).
        return x / torch.full((), 255.0, dtype=torch.float32, device=x.device)
    return x * RESCALE_FACTOR


def preprocess_images(
    images: ImageInput | Sequence[ImageInput],
    max_soft_tokens: int = 280,
    patch_size: int = 16,
    pooling_kernel_size: int = 3,
    rescale: bool = True,
    float_resize: bool = False,
) -> ImageFeatures:
    """Gemma4ImageProcessor defaults: resize to the soft-token budget, rescale by 1/255, patchify, pad.

    ``rescale=False`` leaves the patches uint8 (a quarter of the bytes to patchify, hash and upload; the
    engine rescales them on the device with ``rescale_pixels``). Images may be tensors on a GPU; the
    patches are then there too (``float_resize`` as ``resize_to_patch_budget``)."""
    check_max_soft_tokens(max_soft_tokens)
    if isinstance(images, (np.ndarray, torch.Tensor)) and images.ndim == 4:
        images = list(images)
    elif not isinstance(images, (list, tuple)):
        images = [images]
    if not images:
        raise ValueError("no images given")
    max_patches = max_soft_tokens * pooling_kernel_size**2
    all_patches, all_positions, num_soft_tokens = [], [], []
    for image in images:
        pixels = resize_to_patch_budget(
            image_to_tensor(image), patch_size, max_patches, pooling_kernel_size, float_resize
        )
        patches, positions = patchify(pixels, patch_size, max_patches)
        if rescale:
            patches = rescale_pixels(patches)
        num_real = (pixels.shape[-2] // patch_size) * (pixels.shape[-1] // patch_size)
        num_soft_tokens.append(num_real // pooling_kernel_size**2)
        all_patches.append(patches)
        all_positions.append(positions)
    return ImageFeatures(torch.stack(all_patches), torch.stack(all_positions), num_soft_tokens)
