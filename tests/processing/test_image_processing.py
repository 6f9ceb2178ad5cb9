"""g4serve.processing.image against transformers' Gemma4ImageProcessor: bit-identical pixels and positions."""

from __future__ import annotations

import io
import math

import numpy as np
import PIL.Image
import pytest
import torch
from transformers import Gemma4ImageProcessor
from transformers.models.gemma4.image_processing_gemma4 import get_aspect_ratio_preserving_size

from g4serve.processing.image import (
    aspect_ratio_preserving_size,
    load_image,
    num_soft_tokens_for_size,
    preprocess_images,
)

SIZES = [(100, 100), (300, 100), (64, 500), (1000, 30), (480, 640)]  # (height, width)


def _random_rgba(height: int, width: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (height, width, 4), dtype=np.uint8)
    pixels[..., 3] = np.where(rng.random((height, width)) < 0.5, 255, pixels[..., 3])  # mixed opacity
    return pixels


def _reference(images, max_soft_tokens: int = 280):
    return Gemma4ImageProcessor(max_soft_tokens=max_soft_tokens)(images, return_tensors="pt")


def _assert_same(ours, ref) -> None:
    assert ours.pixel_values.dtype == torch.float32 and ours.position_ids.dtype == torch.int64
    assert torch.equal(ours.pixel_values, ref["pixel_values"])
    assert torch.equal(ours.position_ids, ref["image_position_ids"])
    assert ours.num_soft_tokens == list(ref["num_soft_tokens_per_image"])


@pytest.mark.parametrize("max_soft_tokens", [70, 280])
@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L"])
@pytest.mark.parametrize("size", SIZES)
def test_pil_images_match_transformers(size, mode, max_soft_tokens):
    image = PIL.Image.fromarray(_random_rgba(*size), "RGBA").convert(mode)
    _assert_same(
        preprocess_images(image, max_soft_tokens=max_soft_tokens), _reference([image], max_soft_tokens)
    )


def test_mixed_batch_and_other_pil_modes():
    base = _random_rgba(90, 130, seed=1)
    palette = PIL.Image.fromarray(base[..., :3]).convert("P", palette=PIL.Image.Palette.ADAPTIVE)
    palette.info["transparency"] = 0
    images = [
        PIL.Image.fromarray(base, "RGBA").convert("LA"),
        palette,
        PIL.Image.fromarray(base[..., 0].astype(np.uint16) * 200),  # I;16
        PIL.Image.fromarray(_random_rgba(700, 20, seed=2)[..., :3]),
    ]
    _assert_same(preprocess_images(images, max_soft_tokens=140), _reference(images, 140))


@pytest.mark.parametrize("channels", [1, 3, 4])
def test_arrays_and_tensors_match_transformers(channels):
    hwc = _random_rgba(75, 110, seed=channels)[..., -channels:]
    for image in (hwc, torch.from_numpy(hwc), torch.from_numpy(hwc).permute(2, 0, 1)):
        _assert_same(preprocess_images(image), _reference([image]))
    # A 2-D array is a grayscale image (transformers wants a 1-channel dim for the same result).
    _assert_same(preprocess_images(hwc[..., 0]), _reference([hwc[..., :1]]))


def test_patch_layout_and_padding():
    features = preprocess_images(PIL.Image.fromarray(_random_rgba(100, 300)[..., :3]), max_soft_tokens=70)
    assert features.pixel_values.shape == (1, 630, 768) and features.position_ids.shape == (1, 630, 2)
    n_real = features.num_soft_tokens[0] * 9
    assert (features.position_ids[0, n_real:] == -1).all() and (features.pixel_values[0, n_real:] == 0).all()
    assert (features.position_ids[0, :n_real] >= 0).all()
    assert 0.0 <= features.pixel_values.min() and features.pixel_values.max() <= 1.0


def test_sizes_and_token_counts_match_transformers():
    rng = np.random.default_rng(0)
    sizes = [(int(h), int(w)) for h, w in rng.integers(1, 4000, (300, 2))] + [(1, 5000), (4000, 2), (48, 48)]
    for max_soft_tokens in (70, 140, 280, 560, 1120):
        max_patches = max_soft_tokens * 9
        for h, w in sizes:
            try:
                expected = get_aspect_ratio_preserving_size(h, w, 16, max_patches, 3)
            except ValueError:
                with pytest.raises(ValueError):
                    aspect_ratio_preserving_size(h, w, 16, max_patches, 3)
                continue
            assert aspect_ratio_preserving_size(h, w, 16, max_patches, 3) == expected
            assert num_soft_tokens_for_size(h, w, max_soft_tokens) == expected[0] * expected[1] // (
                16 * 16 * 9
            )
    # The pixel-free count agrees with what preprocessing reports.
    image = PIL.Image.fromarray(_random_rgba(333, 77)[..., :3])
    assert preprocess_images(image).num_soft_tokens == [num_soft_tokens_for_size(333, 77)]


def test_max_soft_tokens_validation():
    image = np.zeros((32, 32, 3), np.uint8)
    for call in (
        lambda: preprocess_images(image, max_soft_tokens=100),
        lambda: num_soft_tokens_for_size(32, 32, 64),
    ):
        with pytest.raises(ValueError, match="max_soft_tokens"):
            call()


@pytest.mark.parametrize(
    "bad, message",
    [
        (np.zeros((20, 20, 3), np.float32), "uint8"),
        (np.zeros((20, 20, 2), np.uint8), "channels"),
        (np.zeros((0, 20, 3), np.uint8), "channels"),
        ("not an image", "unsupported image type"),
        ([], "no images"),
    ],
)
def test_bad_images_raise(bad, message):
    with pytest.raises(ValueError, match=message):
        preprocess_images(bad)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_load_image_formats(fmt):
    source = PIL.Image.fromarray(_random_rgba(40, 60)[..., :3])
    buffer = io.BytesIO()
    source.save(buffer, format=fmt)
    image = load_image(buffer.getvalue())
    assert image.mode == "RGB" and image.size == (60, 40)
    if fmt == "PNG":
        assert np.array_equal(np.asarray(image), np.asarray(source))


def test_load_image_applies_exif_orientation_like_transformers():
    buffer = io.BytesIO()
    exif = PIL.Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise on display
    PIL.Image.fromarray(_random_rgba(40, 60)[..., :3]).save(buffer, format="JPEG", exif=exif)
    assert load_image(buffer.getvalue()).size == (40, 60)


@pytest.mark.parametrize("data", [b"", b"definitely not an image", b"\x89PNG\r\n\x1a\n" + b"\x00" * 40])
def test_load_image_garbage_raises(data):
    with pytest.raises(ValueError, match="could not decode image"):
        load_image(data)


def test_load_image_truncated_jpeg_raises():
    buffer = io.BytesIO()
    PIL.Image.fromarray(_random_rgba(64, 64)[..., :3]).save(buffer, format="JPEG")
    with pytest.raises(ValueError, match="could not decode image"):
        load_image(buffer.getvalue()[: math.floor(len(buffer.getvalue()) * 0.5)])


def test_parallel_decoding_keeps_order_and_names_the_first_bad_input():
    from g4serve.processing.processor import _decode_all

    blobs = []
    for shade in range(5):
        buf = io.BytesIO()
        PIL.Image.new("RGB", (32, 16), (shade * 40, 0, 0)).save(buf, format="PNG")
        blobs.append(buf.getvalue())
    decoded = _decode_all(load_image, [*blobs[:2], PIL.Image.new("RGB", (8, 8)), *blobs[2:]], name="image")
    assert [im.getpixel((0, 0))[0] for im in decoded] == [0, 40, 0, 80, 120, 160]
    with pytest.raises(ValueError, match=r"^image\[1\]: could not decode image"):
        _decode_all(load_image, [blobs[0], b"not an image", blobs[1], b"also bad"], name="image")


def test_uint8_patches_rescale_to_the_transformers_values():
    """``rescale=False`` (what the engine's processor asks for) leaves uint8 patches that ``rescale_pixels``
    turns into transformers' float32 values bit for bit; float input passes through."""
    from g4serve.processing.image import rescale_pixels

    images = [PIL.Image.fromarray(_random_rgba(h, w, seed=h)[..., :3]) for h, w in SIZES[:3]]
    raw = preprocess_images(images, max_soft_tokens=70, rescale=False)
    assert raw.pixel_values.dtype == torch.uint8
    ref = _reference(images, max_soft_tokens=70)
    assert torch.equal(rescale_pixels(raw.pixel_values), ref["pixel_values"])
    assert torch.equal(raw.position_ids, ref["image_position_ids"])
    floats = preprocess_images(images, max_soft_tokens=70).pixel_values
    assert rescale_pixels(floats) is floats
