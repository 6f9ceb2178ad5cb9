"""Media prepared on the GPU (``--media-on-gpu``, processing/device_media.py): nvJPEG against libjpeg-turbo,
the CUDA float resize against the same arithmetic on the CPU, log-mel features against numpy's, and an
engine serving what it prepares."""

from __future__ import annotations

import io

import numpy as np
import PIL.Image
import pytest
import torch

from g4serve.engine.engine import EngineConfig, LLMEngine
from g4serve.processing.device_media import DeviceMedia
from g4serve.processing.image import preprocess_images
from g4serve.processing.limits import MediaBudget
from tests.processing.test_device_media import jpeg, picture, run_media_prompts

pytestmark = pytest.mark.gpu
DEVICE = "cuda"


def _pil_pixels(data: bytes) -> torch.Tensor:
    return torch.from_numpy(np.array(PIL.Image.open(io.BytesIO(data)).convert("RGB"))).permute(2, 0, 1)


def test_nvjpeg_decodes_near_libjpeg_turbo():
    media = DeviceMedia("cuda")
    assert media.decodes_jpeg, "this torchvision cannot decode JPEG on CUDA"
    blobs = [
        jpeg(picture(480, 854, 0)),
        jpeg(picture(97, 131, 1), mode="L"),
        jpeg(picture(360, 640, 2), progressive=True),
        jpeg(picture(1080, 1920, 3), subsampling=0),  # 4:4:4
    ]
    budget = MediaBudget()
    sizes = [media.jpeg_size(blob, budget.limits) for blob in blobs]
    assert None not in sizes
    decoded = media.decode(blobs, sizes, budget)
    for blob, tensor in zip(blobs, decoded):
        assert tensor is not None and tensor.is_cuda and tensor.dtype == torch.uint8
        reference = _pil_pixels(blob)
        assert tensor.shape == reference.shape
        mean = (tensor.cpu().float() - reference.float()).abs().mean().item()
        print(f"{tuple(reference.shape)}: mean |nvJPEG - libjpeg-turbo| {mean:.3f}")
        assert mean < 2  # torchvision's own bound for its CUDA decoder


def test_the_cuda_resize_and_patches_equal_the_cpu_float_path():
    images = [
        torch.from_numpy(picture(h, w, s)).permute(2, 0, 1) for h, w, s in ((480, 854, 0), (90, 160, 1))
    ]
    on_cpu = preprocess_images(images, rescale=False, float_resize=True)
    on_gpu = preprocess_images([im.cuda() for im in images], rescale=False, float_resize=True)
    assert on_gpu.pixel_values.is_cuda and not on_gpu.position_ids.is_cuda
    assert torch.equal(on_gpu.position_ids, on_cpu.position_ids)
    diff = (on_gpu.pixel_values.cpu().int() - on_cpu.pixel_values.int()).abs()
    assert diff.max() <= 1 and diff.float().mean() < 0.01  # float rounding order only


def test_video_frames_resized_together_on_cuda_equal_the_cpu_float_path():
    """A video's frames take one float resize on the GPU (``_float_resize_chunk``); the CPU does them one by
    one: the same arithmetic per pixel, so the same bytes up to float rounding order."""
    from g4serve.processing.image import _float_resize_chunk, resize_to_patch_budget

    frames = torch.stack([torch.from_numpy(picture(480, 854, s)).permute(2, 0, 1) for s in range(6)])
    assert _float_resize_chunk(frames.cuda()) >= 6
    on_gpu = resize_to_patch_budget(frames.cuda(), 16, 630, 3, float_resize=True).cpu()
    on_cpu = resize_to_patch_budget(frames, 16, 630, 3, float_resize=True)
    diff = (on_gpu.int() - on_cpu.int()).abs()
    assert diff.max() <= 1 and diff.float().mean() < 0.01


def test_audio_features_on_cuda_match_the_host():
    from g4serve.processing.audio import AudioFeatureExtractor

    rng = np.random.default_rng(0)
    clips = [(0.2 * rng.standard_normal(n)).astype(np.float32) for n in (16_000, 160_000, 3_000)]
    extractor = AudioFeatureExtractor()
    on_host, on_gpu = extractor(clips), extractor(clips, device="cuda")
    assert on_gpu.input_features.is_cuda and not on_gpu.input_features_mask.is_cuda
    assert torch.equal(on_gpu.input_features_mask, on_host.input_features_mask)
    diff = (on_gpu.input_features.cpu() - on_host.input_features).abs().max().item()
    print(f"log-mel on CUDA vs numpy: max |diff| {diff:.2e}")
    assert diff < 1e-4  # cuFFT's float32 rounding against pocketfft's


def test_an_engine_serves_media_prepared_on_the_gpu(hf_checkpoint):
    engine = LLMEngine(
        EngineConfig(
            model=str(hf_checkpoint("e")),
            device="cuda",
            dtype="float32",
            media_on_gpu=True,
            kv_cache_bytes=64 << 20,
            max_num_batched_tokens=512,
        )
    )
    run_media_prompts(engine, image=(480, 640), frame=(240, 426))


def _scan_start(blob: bytes) -> int:
    """The offset of the first entropy-coded byte: past the SOS segment."""
    sos = blob.index(b"\xff\xda")
    return sos + 2 + int.from_bytes(blob[sos + 2 : sos + 4], "big")


def _with_size(blob: bytes, height: int, width: int) -> bytes:
    """The baseline frame header (SOF0) saying another size than the scan holds."""
    sof = blob.index(b"\xff\xc0")
    return blob[: sof + 5] + height.to_bytes(2, "big") + width.to_bytes(2, "big") + blob[sof + 9 :]


def test_hostile_jpegs_leave_nvjpeg_and_the_device_working():
    """JPEGs whose headers pass ``device_jpeg_size`` but whose streams are hostile (truncated, the scan
    garbage or zeros, a frame header larger or smaller than the scan, an extra frame header, a progressive
    stream cut short, restart markers out of order or a bogus restart interval) go to nvJPEG,
    alone and in a batch with good ones: each comes back as pixels of its header's size or as None (the host
    path then decodes or refuses it), nothing raises, and the device still decodes the good ones afterwards
    (no sticky CUDA error)."""
    media = DeviceMedia("cuda")
    assert media.decodes_jpeg
    good = jpeg(picture(240, 320, 4))
    start = _scan_start(good)
    progressive = jpeg(picture(240, 320, 5), progressive=True)
    restarts = jpeg(picture(240, 320, 6), restart_marker_blocks=4)
    rst_start = _scan_start(restarts)
    rng = np.random.default_rng(0)
    hostile = {
        "truncated in the scan": good[: (start + len(good)) // 2],
        "truncated at the scan": good[:start],
        "random scan": good[:start] + rng.integers(0, 256, 4000, dtype=np.uint8).tobytes() + b"\xff\xd9",
        "zero scan": good[:start] + bytes(len(good) - start - 2) + b"\xff\xd9",
        "markers in the scan": good[:start] + b"\xff\xd0\xff\xc4\xff\xda" * 200 + b"\xff\xd9",
        "header larger": _with_size(good, 2000, 3000),
        "header smaller": _with_size(good, 16, 16),
        "two frames": good[:-2] + good[2:],
        # a progressive stream cut after its first scans; restart markers out of order and a bogus interval
        "progressive truncated": progressive[: len(progressive) // 3],
        "restart markers shuffled": restarts[:rst_start]
        + restarts[rst_start:].replace(b"\xff\xd1", b"\xff\xd5"),
        "restart interval bogus": restarts.replace(b"\xff\xdd\x00\x04", b"\xff\xdd\x00\x04\x00\x01", 1),
    }
    budget = MediaBudget()
    for name, blob in hostile.items():
        size = media.jpeg_size(blob, budget.limits)
        if size is None:  # refused from the header: never reaches nvJPEG
            continue
        for batch in ([blob], [good, blob, good]):
            out = media.decode(batch, [media.jpeg_size(b, budget.limits) for b in batch], budget)
            torch.cuda.synchronize()
            got = out[batch.index(blob)]
            assert got is None or tuple(got.shape) == (3, size[1], size[0]), name
            print(f"{name}: {'None' if got is None else 'pixels'}")
    (after,) = media.decode([good], [media.jpeg_size(good, budget.limits)], budget)
    assert after is not None
    assert (after.cpu().float() - _pil_pixels(good).float()).abs().mean().item() < 2


def test_the_media_cache_reads_gpu_items_back_on_its_own_thread(tmp_path):
    """A video prepared on the GPU goes to the engine on the device; the cache's host copy (made later, on
    the cache's thread) equals it, and the same bytes sent again come back from the cache."""
    from g4serve.config import preset
    from g4serve.processing.processor import Gemma4Processor
    from g4serve.processing.tiny_tokenizer import write_tiny_tokenizer
    from g4serve.processing.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(write_tiny_tokenizer(tmp_path))
    p = Gemma4Processor(tokenizer, preset("tiny"), media_device=DEVICE, cache_bytes=64 << 20)
    frames = [jpeg(picture(96, 144, seed=20 + i)) for i in range(4)]
    prompt = {"prompt": p.video_token, "multi_modal_data": {"video": [frames]}}
    first = p.process(prompt, {"video": 1})
    assert first.mm_items[0].data["pixel_values"].device.type == DEVICE  # positions are made on the host
    again = p.process(prompt, {"video": 1})
    assert p.cache.stats()["hits"] == 1
    assert again.mm_items[0].content_hash == first.mm_items[0].content_hash
    for name, t in first.mm_items[0].data.items():
        kept = again.mm_items[0].data[name]
        assert kept.device.type == "cpu" and torch.equal(kept, t.cpu())
