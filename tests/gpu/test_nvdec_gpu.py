"""NVDEC (``--video-decoder nvdec``, processing/nvdec.py) on the device, with NVIDIA's PyNvVideoCodec
(skipped where it is not installed: carried in ``.whl-nvdec/``): its frames against the host's, a decoder
reused across videos and threads, and an engine serving the videos it decodes."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from g4serve.processing.limits import MediaLimits
from g4serve.processing.nvdec import NvdecUnavailable, NvdecVideos
from g4serve.processing.video import load_video
from tests.processing.test_nvdec import TAGS, close, make_clip

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def nvdec() -> NvdecVideos:
    try:
        return NvdecVideos("cuda")
    except NvdecUnavailable as exc:
        pytest.skip(str(exc))


def _load(nvdec: NvdecVideos, clip: bytes, num_frames: int):
    with torch.cuda.stream(torch.cuda.Stream()):  # as the processor's threads: a side stream of their own
        got = nvdec.load(clip, MediaLimits(), num_frames)
        torch.cuda.current_stream().synchronize()
    return got


@pytest.mark.parametrize("options", TAGS.values(), ids=TAGS.keys())
def test_nvdec_frames_match_the_host_path(nvdec, options):
    clip = make_clip(frames=40, width=320, height=240, options=options)
    got, want = _load(nvdec, clip, 8), load_video(clip, num_frames=8)
    assert got is not None and got.frames.device.type == "cuda"
    assert got.frame_indices == want.frame_indices and tuple(got.frames.shape) == want.frames.shape
    mean, worst = close(got.frames.cpu(), want.frames)
    assert mean < 1.5 and worst <= 4, (mean, worst)


def test_hevc_on_nvdec(nvdec):
    quiet = {"x265-params": "log-level=none"}
    clip = make_clip(frames=20, width=320, height=240, codec="libx265", options=quiet)
    got = _load(nvdec, clip, 4)
    assert got is not None and close(got.frames.cpu(), load_video(clip, num_frames=4).frames)[0] < 1.5


def test_a_reused_decoder_gives_each_video_its_own_frames(nvdec):
    """Stopped early (frames left in NVDEC), then another video on the same decoder: its frames are the
    ones a fresh decoder gives, bit for bit (H.264 decoding is exact); in four threads at once too."""
    clips = [make_clip(frames=60, width=320, height=240, seed=s) for s in range(4)]
    fresh = [_load(NvdecVideos("cuda"), clip, 6).frames.cpu() for clip in clips]
    _load(nvdec, clips[0], 2)  # frames 0 and 30 of 60
    for clip, want in zip(clips, fresh):
        assert torch.equal(_load(nvdec, clip, 6).frames.cpu(), want)
    with ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            got = list(pool.map(lambda c: _load(nvdec, c, 6).frames.cpu(), clips))
            assert all(torch.equal(g, w) for g, w in zip(got, fresh))


def test_an_engine_serves_videos_nvdec_decodes(tiny_model_dir):
    from g4serve.engine.engine import EngineConfig, LLMEngine
    from g4serve.sampling_params import SamplingParams

    try:
        engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), device="cuda", video_decoder="nvdec"))
    except NvdecUnavailable as exc:
        pytest.skip(str(exc))
    clip = make_clip(frames=30, width=320, height=240)
    turn = "<|turn>user\n{}<turn|>\n<|turn>model\n"
    prompt = {"prompt": turn.format("<|video|>What happens?"), "multi_modal_data": {"video": clip}}
    processed = engine.process_prompt(prompt)
    assert processed.mm_items[0].data["pixel_values"].device.type == "cuda"
    engine.add_request(engine.make_request("v", processed, SamplingParams(temperature=0, max_tokens=4)))
    assert len(engine.run_until_finished()["v"].outputs[0].token_ids) == 4
