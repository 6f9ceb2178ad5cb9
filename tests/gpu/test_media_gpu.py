"""Media prepared on the GPU (``--media-on-gpu``, processing/device_media.py): nvJPEG against libjpeg-turbo,
the CUDA float resize against the same arithmetic on the CPU, log-mel features against numpy's, and an
engine serving what it prepares."""

from __future__ import annotations

import io
import threading

import numpy as np
import PIL.Image
import pytest
import torch

from g4serve.engine.engine import EngineConfig, LLMEngine
from g4serve.processing.device_media import DeviceMedia
from g4serve.processing.image import preprocess_images
from g4serve.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu


def _picture(height: int, width: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:height, 0:width]
    base = np.stack([xs * 255 / width, ys * 255 / height, (xs + ys) % 256], axis=-1)
    return (base + rng.integers(-20, 20, base.shape)).clip(0, 255).astype(np.uint8)


def _jpeg(pixels: np.ndarray, mode: str = "RGB", **save) -> bytes:
    buffer = io.BytesIO()
    PIL.Image.fromarray(pixels).convert(mode).save(buffer, format="JPEG", quality=90, **save)
    return buffer.getvalue()


def _pil_pixels(data: bytes) -> torch.Tensor:
    return torch.from_numpy(np.array(PIL.Image.open(io.BytesIO(data)).convert("RGB"))).permute(2, 0, 1)


def test_nvjpeg_decodes_near_libjpeg_turbo():
    media = DeviceMedia("cuda")
    assert media.decodes_jpeg, "this torchvision cannot decode JPEG on CUDA"
    blobs = [
        _jpeg(_picture(480, 854, 0)),
        _jpeg(_picture(97, 131, 1), mode="L"),
        _jpeg(_picture(360, 640, 2), progressive=True),
        _jpeg(_picture(1080, 1920, 3), subsampling=0),  # 4:4:4
    ]
    decoded, refused = media.decode_jpegs(blobs, _budget())
    assert not refused
    for blob, tensor in zip(blobs, decoded):
        assert tensor is not None and tensor.is_cuda and tensor.dtype == torch.uint8
        reference = _pil_pixels(blob)
        assert tensor.shape == reference.shape
        mean = (tensor.cpu().float() - reference.float()).abs().mean().item()
        print(f"{tuple(reference.shape)}: mean |nvJPEG - libjpeg-turbo| {mean:.3f}")
        assert mean < 2  # torchvision's own bound for its CUDA decoder


def _budget():
    from g4serve.processing.limits import MediaBudget

    return MediaBudget()


def test_the_cuda_resize_and_patches_equal_the_cpu_float_path():
    images = [
        torch.from_numpy(_picture(h, w, s)).permute(2, 0, 1) for h, w, s in ((480, 854, 0), (90, 160, 1))
    ]
    on_cpu = preprocess_images(images, rescale=False, float_resize=True)
    on_gpu = preprocess_images([im.cuda() for im in images], rescale=False, float_resize=True)
    assert on_gpu.pixel_values.is_cuda and not on_gpu.position_ids.is_cuda
    assert torch.equal(on_gpu.position_ids, on_cpu.position_ids)
    diff = (on_gpu.pixel_values.cpu().int() - on_cpu.pixel_values.int()).abs()
    assert diff.max() <= 1 and diff.float().mean() < 0.01  # float rounding order only


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
    """Prompts with JPEG images and a video of JPEG frames, prepared on the GPU from several threads at
    once (as the server's workers do), then run together: the items' patches live on the GPU, greedy
    tokens equal each prompt run alone, and every KV block comes back."""
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
    turn = "<|turn>user\n{}<turn|>\n<|turn>model\n"
    prompts = [
        {
            "prompt": turn.format("<|image|>What is it?"),
            "multi_modal_data": {"image": _jpeg(_picture(480, 640, i))},
        }
        for i in range(4)
    ]
    frames = [_jpeg(_picture(240, 426, 10 + i)) for i in range(6)]
    prompts.append({"prompt": turn.format("<|video|>What happens?"), "multi_modal_data": {"video": [frames]}})
    clip = (0.2 * np.random.default_rng(0).standard_normal(24_000)).astype(np.float32)
    prompts.append({"prompt": turn.format("<|audio|>Transcribe."), "multi_modal_data": {"audio": clip}})
    processed: list = [None] * len(prompts)

    def prepare(i: int) -> None:
        processed[i] = engine.process_prompt(prompts[i])

    threads = [threading.Thread(target=prepare, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p in processed:
        inputs = [item.data.get("pixel_values", item.data.get("input_features")) for item in p.mm_items]
        assert inputs and all(t.is_cuda for t in inputs)
    params = SamplingParams(temperature=0, max_tokens=8)
    alone = []
    for i, p in enumerate(processed):
        engine.add_request(engine.make_request(f"alone{i}", p, params))
        alone.append(engine.run_until_finished()[f"alone{i}"].outputs[0].token_ids)
    for i, p in enumerate(processed):
        engine.add_request(engine.make_request(str(i), p, params))
    together = engine.run_until_finished()
    assert [together[str(i)].outputs[0].token_ids for i in range(len(prompts))] == alone
    for name, pool in engine.kv.pools.items():
        assert pool.num_free == pool.num_blocks, f"{name} pool leaked"
