"""Images and video frames prepared on a device (``--media-on-gpu``, processing/device_media.py), run on the
CPU: ``decode_jpeg`` there is libjpeg-turbo and the float resize the arithmetic the GPU runs, so the path
is checked here against the host path (which matches transformers bit for bit); tests/gpu/test_media_gpu.py
runs it on CUDA with nvJPEG."""

from __future__ import annotations

import argparse
import io
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import PIL.Image
import pytest
import torch

from g4serve.config import preset
from g4serve.engine.config import EngineConfig
from g4serve.engine_args import add_engine_arguments, engine_config_from_args
from g4serve.processing import device_media
from g4serve.processing.device_media import DeviceMedia, device_jpeg_size
from g4serve.processing.image import resize_to_patch_budget
from g4serve.processing.limits import MediaBudgetError, MediaLimits
from g4serve.processing.processor import Gemma4Processor
from g4serve.processing.tiny_tokenizer import write_tiny_tokenizer
from g4serve.processing.tokenizer import Tokenizer
from tests.processing.test_media_hostile import _video as _video_file

LIMITS = {"image": 8, "video": 2, "audio": 0}


def picture(height: int, width: int, seed: int = 0) -> np.ndarray:
    """Smooth gradients plus noise: the resize and the JPEG both have something to do."""
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:height, 0:width]
    base = np.stack([xs * 255 / width, ys * 255 / height, (xs + ys) % 256], axis=-1)
    return (base + rng.integers(-20, 20, base.shape)).clip(0, 255).astype(np.uint8)


def jpeg(pixels: np.ndarray, mode: str = "RGB", **save) -> bytes:
    buffer = io.BytesIO()
    image = PIL.Image.fromarray(pixels)
    image = image.convert(mode) if mode != "RGB" else image
    image.save(buffer, format="JPEG", quality=90, **save)
    return buffer.getvalue()


def _png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    PIL.Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def _rotated_jpeg(pixels: np.ndarray) -> bytes:
    exif = PIL.Image.Exif()
    exif[device_media.EXIF_ORIENTATION] = 6  # rotate 90 degrees clockwise to display
    return jpeg(pixels, exif=exif.tobytes())


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_pretrained(write_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def host(tokenizer) -> Gemma4Processor:
    return Gemma4Processor(tokenizer, preset("tiny"))


@pytest.fixture(scope="module")
def device(tokenizer) -> Gemma4Processor:
    return Gemma4Processor(tokenizer, preset("tiny"), media_device="cpu")


def _images(processor: Gemma4Processor, images: list, **kw):
    prompt = {"prompt": processor.image_token * len(images), "multi_modal_data": {"image": images}}
    return processor.process(prompt, LIMITS, **kw)


def _assert_same_layout(a, b) -> list[torch.Tensor]:
    """Same tokens, spans and patch positions; the absolute pixel differences per item."""
    assert a.token_ids == b.token_ids
    assert len(a.mm_items) == len(b.mm_items)
    diffs = []
    for x, y in zip(a.mm_items, b.mm_items):
        assert x.spans == y.spans and x.modality == y.modality and x.content_hash != ""
        assert torch.equal(x.data["position_ids"], y.data["position_ids"])
        px, py = x.data["pixel_values"], y.data["pixel_values"]
        assert px.dtype == py.dtype == torch.uint8 and px.shape == py.shape
        diffs.append((px.int() - py.int()).abs())
    return diffs


@pytest.fixture
def float_host(host, monkeypatch):
    """The host path with the device path's float resize: what the device path must give bit for bit here
    (decode_jpeg on the CPU is libjpeg-turbo, as PIL)."""
    from g4serve.processing import processor as module

    for name in ("preprocess_images", "preprocess_video"):
        original = getattr(module, name)
        monkeypatch.setattr(
            module, name, lambda *a, _f=original, **kw: _f(*a, **{**kw, "float_resize": True})
        )
    return host


def _check(device_out, float_out, host_out, on_host: tuple[int, ...] = ()) -> None:
    """Bit for bit the float-resize host path, and near the exact host path (transformers' bytes); the
    items ``on_host`` (what the device does not take) bit for bit the exact host path."""
    for i, (to_float, to_host) in enumerate(
        zip(_assert_same_layout(device_out, float_out), _assert_same_layout(device_out, host_out))
    ):
        if i in on_host:
            assert int(to_host.max()) == 0
            continue
        assert int(to_float.max()) == 0
        # torch's uint8 kernel clamps between its two passes, the float path only at the end: where bicubic
        # overshoots at sharp edges the two differ by many levels, elsewhere by at most one
        assert to_host.float().mean() < 0.3 and (to_host <= 1).float().mean() > 0.99


def test_images_on_the_device_match_the_host_path(host, device, float_host):
    images = [
        jpeg(picture(480, 854)),  # resized
        jpeg(picture(96, 144, seed=1), mode="L"),  # grayscale JPEG: RGB as PIL converts it
        _png(picture(200, 300, seed=2)),  # not a JPEG: the host path, exactly
        jpeg(picture(480, 854, seed=3), progressive=True),
    ]
    on_device = _images(device, images)
    on_host = _images(host, images)
    _check(on_device, _images(float_host, images), on_host, on_host=(2,))
    assert on_device.mm_items[2].data["pixel_values"].device.type == "cpu"


def test_the_float_resize_is_near_the_uint8_kernel():
    pixels = torch.from_numpy(picture(480, 854)).permute(2, 0, 1)
    exact = resize_to_patch_budget(pixels, 16, 630, 3)
    floated = resize_to_patch_budget(pixels, 16, 630, 3, float_resize=True)
    assert floated.dtype == torch.uint8 and floated.shape == exact.shape == (3, 288, 528)
    diff = (floated.int() - exact.int()).abs()
    assert diff.float().mean() < 0.3 and (diff <= 1).float().mean() > 0.99


def test_frames_resized_together_equal_one_at_a_time(monkeypatch):
    """On a GPU the float resize takes a video's frames in one call: the same bytes as frame by frame (each
    output pixel's arithmetic does not depend on the batch). Checked on the CPU, batched by force."""
    from g4serve.processing import image

    frames = torch.stack([torch.from_numpy(picture(120, 214, seed=s)).permute(2, 0, 1) for s in range(5)])
    assert image._float_resize_chunk(frames) == 1  # the CPU: one at a time
    one_by_one = resize_to_patch_budget(frames, 16, 630, 3, float_resize=True)
    assert one_by_one.shape[-2:] != frames.shape[-2:]  # resized indeed
    calls = []
    monkeypatch.setattr(image, "_float_resize_chunk", lambda batch: calls.append(len(batch)) or 3)
    together = resize_to_patch_budget(frames, 16, 630, 3, float_resize=True)  # chunks of 3 and 2
    assert calls == [5] and torch.equal(together, one_by_one)


def test_which_jpegs_the_device_decodes():
    limits = MediaLimits()
    pixels = picture(48, 64)
    assert device_jpeg_size(jpeg(pixels), limits) == (64, 48)
    assert device_jpeg_size(jpeg(pixels, mode="L"), limits) == (64, 48)
    assert device_jpeg_size(jpeg(pixels, mode="CMYK"), limits) is None  # the host converts CMYK
    assert device_jpeg_size(_rotated_jpeg(pixels), limits) is None  # the host applies EXIF rotation
    assert device_jpeg_size(_png(pixels), limits) is None
    assert device_jpeg_size(b"\xff\xd8\xff" + b"\0" * 64, limits) is None  # the magic, then garbage
    assert device_jpeg_size(jpeg(pixels), MediaLimits(max_media_pixels=64 * 48 - 1)) is None
    assert device_jpeg_size(jpeg(pixels), MediaLimits(image_formats=("PNG",))) is None


def test_what_the_device_does_not_decode_still_matches(host, device, float_host):
    pixels = picture(120, 160, seed=4)
    images = [_rotated_jpeg(pixels), jpeg(pixels, mode="CMYK")]
    on_device, on_host = _images(device, images), _images(host, images)
    _check(on_device, _images(float_host, images), on_host, on_host=(0, 1))
    assert on_device.mm_items[0].data["position_ids"].shape[1] == 2520  # rotated: 160 high, 120 wide


def test_bad_jpegs_get_the_host_paths_errors(host, device):
    good = jpeg(picture(48, 64))
    truncated = good[: len(good) // 2]
    for processor in (host, device):
        with pytest.raises(ValueError, match=r"^image\[1\]: could not decode image"):
            _images(processor, [good, truncated])


def test_the_request_pixel_budget_counts_device_decodes_once(device, monkeypatch):
    images = [jpeg(picture(48, 64)), jpeg(picture(48, 64, seed=1))]
    exact = MediaLimits(max_request_pixels=2 * 48 * 64)
    assert _images(device, images, media_limits=exact)
    with pytest.raises(MediaBudgetError, match="max_request_pixels"):
        _images(device, images, media_limits=MediaLimits(max_request_pixels=2 * 48 * 64 - 1))

    # nvJPEG refusing a stream the host decodes: the host path takes it, its pixels charged once
    def refuse(self, blobs):
        raise RuntimeError("nvjpeg: refused")

    monkeypatch.setattr(DeviceMedia, "_decode", refuse)
    assert _images(device, images, media_limits=exact)


def test_the_budget_refuses_before_the_device_decodes(device, monkeypatch):
    calls = []
    monkeypatch.setattr(DeviceMedia, "_decode", lambda self, blobs: calls.append(len(blobs)))
    images = [jpeg(picture(48, 64))] * 3
    with pytest.raises(MediaBudgetError):
        _images(device, images, media_limits=MediaLimits(max_request_pixels=2 * 48 * 64))
    assert calls == []


def test_without_a_jpeg_decoder_the_host_decodes(tokenizer, host, float_host, monkeypatch):
    def missing(self, blobs):
        raise RuntimeError("torchvision was not compiled with nvjpeg support")

    monkeypatch.setattr(DeviceMedia, "_decode", missing)
    processor = Gemma4Processor(tokenizer, preset("tiny"), media_device="cpu")
    assert not processor.media.decodes_jpeg
    images = [jpeg(picture(96, 128))]
    _check(_images(processor, images), _images(float_host, images), _images(host, images), on_host=(0,))


def _video(processor: Gemma4Processor, video):
    prompt = {"prompt": processor.video_token, "multi_modal_data": {"video": [video]}}
    return processor.process(prompt, LIMITS)


def test_videos_of_jpeg_frames_and_containers_on_the_device(host, device, float_host):
    frames = [picture(240, 426, seed=i) for i in range(40)]
    jpegs = [jpeg(f) for f in frames]  # 40 frames: 32 sampled, only those decoded
    on_device = _video(device, jpegs)
    _check(on_device, _video(float_host, jpegs), _video(host, jpegs))
    assert on_device.mm_items[0].data["pixel_values"].shape[0] == 32
    container = _video_file(np.stack(frames[:12]))
    _check(_video(device, container), _video(float_host, container), _video(host, container))


def test_video_frame_errors_are_the_host_paths(host, device):
    frames = [jpeg(picture(48, 64, seed=i)) for i in range(4)]
    truncated = frames[2][: len(frames[2]) // 2]  # a header the device takes, a stream it refuses
    with pytest.raises(ValueError, match=r"^video\[0\]: frame 2: could not decode image"):
        _video(device, frames[:2] + [truncated] + frames[3:])
    for processor in (host, device):  # not a JPEG the device takes: the host path decodes the video
        with pytest.raises(ValueError, match=r"^video\[0\]: could not decode image"):
            _video(processor, frames[:2] + [b"\xff\xd8\xff garbage"] + frames[3:])
        with pytest.raises(ValueError, match=r"^video\[0\]: video frames differ in size"):
            _video(processor, frames[:3] + [jpeg(picture(32, 64))])


def test_media_on_gpu_needs_a_cuda_device():
    with pytest.raises(ValueError, match="^media_on_gpu: needs a CUDA device"):
        EngineConfig(device="cpu", media_on_gpu=True)


def test_media_on_gpu_is_on_for_cuda_engines_that_serve_media():
    """Unset, the config decides: on for CUDA (the config opens no device), off on the CPU and for text only;
    ``--no-media-on-gpu`` keeps a CUDA engine on the host path, which matches transformers exactly."""
    assert EngineConfig(device="cuda").media_on_gpu is True
    assert EngineConfig(device="cuda:1").media_on_gpu is True
    assert EngineConfig(device="cpu").media_on_gpu is False
    assert EngineConfig(device="cuda", text_only=True).media_on_gpu is False
    assert EngineConfig(device="cuda", media_on_gpu=False).media_on_gpu is False
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    for argv, want in (([], None), (["--media-on-gpu"], True), (["--no-media-on-gpu"], False)):
        assert parser.parse_args(argv).media_on_gpu is want
    assert engine_config_from_args(parser.parse_args(["--device", "cuda"])).media_on_gpu is True
    assert (
        engine_config_from_args(parser.parse_args(["--device", "cuda", "--no-media-on-gpu"])).media_on_gpu
        is False
    )


def run_media_prompts(engine, image: tuple[int, int], frame: tuple[int, int]) -> None:
    """JPEG images, a video of JPEG frames and an audio clip, prepared from several threads at once (as the
    server's workers do), then run together: the media inputs live on the processor's media device, each
    prompt's greedy tokens equal the same prompt run alone, and every KV block comes back. The GPU test
    (tests/gpu/test_media_gpu.py) runs it on CUDA."""
    from g4serve.sampling_params import SamplingParams

    turn = "<|turn>user\n{}<turn|>\n<|turn>model\n"
    prompts = [
        {
            "prompt": turn.format("<|image|>What is it?"),
            "multi_modal_data": {"image": jpeg(picture(*image, i))},
        }
        for i in range(3)
    ]
    frames = [jpeg(picture(*frame, 10 + i)) for i in range(6)]
    prompts.append({"prompt": turn.format("<|video|>What happens?"), "multi_modal_data": {"video": [frames]}})
    clip = (0.2 * np.random.default_rng(0).standard_normal(24_000)).astype(np.float32)
    prompts.append({"prompt": turn.format("<|audio|>Transcribe."), "multi_modal_data": {"audio": clip}})
    with ThreadPoolExecutor(4) as pool:
        processed = list(pool.map(engine.process_prompt, prompts))
    device = engine.processor.media.device
    for p in processed:
        inputs = [item.data.get("pixel_values", item.data.get("input_features")) for item in p.mm_items]
        assert inputs and all(t.device.type == device.type for t in inputs)
    params = SamplingParams(temperature=0, max_tokens=6)
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


def test_an_engine_runs_what_the_device_path_prepares(tiny_model_dir, host):
    """The engine with the device processor, on the CPU (``run_media_prompts``)."""
    from g4serve.engine.engine import LLMEngine

    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_model_dir), device="cpu", dtype="float32", kv_cache_bytes=16 << 20,
            max_num_batched_tokens=512,
        )
    )  # fmt: skip
    engine.processor = Gemma4Processor(
        engine.tokenizer, engine.model_config, engine.processor.settings, media_device="cpu"
    )
    run_media_prompts(engine, image=(64, 96), frame=(48, 64))


def test_a_decode_that_disagrees_with_the_header_goes_to_the_host(device, host, float_host, monkeypatch):
    """nvJPEG and PIL parse the header separately: pixels of any other size than PIL's are not used."""
    decode = DeviceMedia._decode
    monkeypatch.setattr(DeviceMedia, "_decode", lambda self, blobs: [t[:, 1:] for t in decode(self, blobs)])
    images = [jpeg(picture(96, 128))]
    _check(_images(device, images), _images(float_host, images), _images(host, images), on_host=(0,))


def test_audio_features_on_the_device_match_the_host(host, device):
    """Log-mel features in torch (a batch of clips of different lengths at once) against numpy's, which
    match transformers bit for bit: float32 rounding apart, the same masks and soft-token counts."""
    from g4serve.processing.audio import AudioFeatureExtractor

    rng = np.random.default_rng(0)
    clips = [(0.2 * rng.standard_normal(n)).astype(np.float32) for n in (16_000, 41_337, 3_000)]
    extractor = AudioFeatureExtractor()
    on_host, on_device = extractor(clips), extractor(clips, device="cpu")
    assert on_device.input_features.shape == on_host.input_features.shape
    assert torch.equal(on_device.input_features_mask, on_host.input_features_mask)
    torch.testing.assert_close(on_device.input_features, on_host.input_features, atol=2e-5, rtol=1e-5)
    assert on_host.input_features.abs().max() > 1  # log-mel values of order one, not a degenerate case
    tiny = extractor([np.zeros(10, np.float32)], device="cpu")  # shorter than one window
    assert tiny.input_features.shape[1] == tiny.input_features_mask.shape[1]

    prompt = {"prompt": host.audio_token * 2, "multi_modal_data": {"audio": clips[:2]}}
    a, b = device.process(prompt, {"audio": 2}), host.process(prompt, {"audio": 2})
    assert a.token_ids == b.token_ids
    for x, y in zip(a.mm_items, b.mm_items):
        assert torch.equal(x.data["input_features_mask"], y.data["input_features_mask"])
        torch.testing.assert_close(x.data["input_features"], y.data["input_features"], atol=2e-5, rtol=1e-5)


@pytest.fixture
def bounded(tokenizer):
    """A processor whose media device holds little: frames of 64x96, two of them per batch and in flight."""
    processor = Gemma4Processor(tokenizer, preset("tiny"), media_device="cpu")
    frame = 64 * 96
    processor.media = DeviceMedia(
        "cpu", max_frame_pixels=frame, max_batch_pixels=2 * frame, max_in_flight_pixels=2 * frame
    )
    return processor


def test_device_memory_is_bounded_across_threads(bounded, host, float_host, monkeypatch):
    """Images over the frame bound take the host path; the rest go in batches within the batch bound; and
    all threads together never hold more than the in-flight bound (a thread past it waits)."""
    media = bounded.media
    seen = []
    decode = DeviceMedia.decode

    def watched(self, blobs, sizes, budget):
        seen.append(self.in_flight_pixels)
        return decode(self, blobs, sizes, budget)

    monkeypatch.setattr(DeviceMedia, "decode", watched)
    images = [jpeg(picture(64, 96, seed=i)) for i in range(3)] + [
        jpeg(picture(65, 96, seed=9))
    ]  # 4th too big
    with ThreadPoolExecutor(6) as pool:
        outs = list(pool.map(lambda _: _images(bounded, images), range(6)))
    assert len(seen) == 6 * 2 and max(seen) <= media.max_in_flight_pixels  # batches of 2 + 1 per request
    assert media.in_flight_pixels == 0
    reference = (_images(float_host, images), _images(host, images))
    for out in outs:
        _check(out, *reference, on_host=(3,))
        assert out.mm_items[3].data["pixel_values"].device.type == "cpu"


def test_a_video_over_the_batch_bound_takes_the_host_path(bounded, host):
    frames = [jpeg(picture(64, 96, seed=i)) for i in range(3)]  # three frames: over two frames' batch
    on_device, on_host = _video(bounded, frames), _video(host, frames)
    assert torch.equal(on_device.mm_items[0].data["pixel_values"], on_host.mm_items[0].data["pixel_values"])
    assert _video(bounded, frames[:2]).mm_items[0].data["pixel_values"].shape[0] == 2  # two fit
    big = [jpeg(picture(65, 96, seed=i)) for i in range(2)]  # each frame over the frame bound
    assert torch.equal(
        _video(bounded, big).mm_items[0].data["pixel_values"],
        _video(host, big).mm_items[0].data["pixel_values"],
    )
