"""processing/nvdec.py on the CPU: g4serve's side of NVDEC decoding (PyAV's demuxing under the limits, the
Annex B packets, sampling, the caps, the NV12 -> RGB conversion, decoder reuse and flushing, the host path
for what it does not take), with a stand-in for PyNvVideoCodec whose decoder is FFmpeg's software H.264/HEVC
decoder fed the same packets. NVDEC itself: tests/gpu/test_nvdec_gpu.py."""

from __future__ import annotations

import ctypes
import io
from types import SimpleNamespace

import av
import numpy as np
import pytest
import torch

from g4serve.processing.limits import MediaBudget, MediaLimits
from g4serve.processing.nvdec import NvdecUnavailable, NvdecVideos, import_pynvvideocodec, nv12_to_rgb
from g4serve.processing.video import load_video
from tests.processing.test_media_hostile import _video as _video_file


def make_clip(
    frames: int = 12,
    width: int = 96,
    height: int = 64,
    codec: str = "libx264",
    fmt: str = "mp4",
    options: dict[str, str] | None = None,
    seed: int = 0,
) -> bytes:
    """A clip whose every frame differs (gradients moving by frame, offset by ``seed``), at 10 fps."""
    ys, xs = np.mgrid[0:height, 0:width]
    j = np.arange(frames)[:, None, None] + 7 * seed
    rgb = np.stack([(xs * 3 + 5 * j) % 256, (ys * 2 + 3 * j) % 256, (xs + ys + j) % 256], -1)
    return _video_file(rgb.astype(np.uint8), fmt=fmt, codec=codec, options=options)


class _Frame:
    def __init__(self, nv12: np.ndarray):
        self.nv12 = np.ascontiguousarray(nv12)

    def framesize(self) -> int:
        return self.nv12.nbytes

    def GetPtrToPlane(self, plane: int) -> int:  # noqa: N802 - PyNvVideoCodec's name
        return self.nv12.ctypes.data


class _Decoder:
    """FFmpeg's decoder behind PyNvVideoCodec's interface: Annex B in, NV12 frames out in display order,
    frames held back until more data or the end of the stream (an empty packet), as NVDEC holds them."""

    def __init__(self, stand_in: StandIn, codec: str, width: int, height: int):
        self.stand_in, self.codec, self.size = stand_in, codec, (width, height)
        self.ctx = av.CodecContext.create(codec, "r")
        self.out: list[_Frame] = []

    def Decode(self, packet) -> list[_Frame]:  # noqa: N802 - PyNvVideoCodec's name
        if self.stand_in.fail:
            raise RuntimeError("HW decode failed")
        if packet.bsl == 0:
            frames = self.ctx.decode(None)
            self.ctx = av.CodecContext.create(self.codec, "r")  # NVDEC's parser starts over after the end
        else:
            frames = self.ctx.decode(av.Packet(ctypes.string_at(packet.bsl_data, packet.bsl)))
        self.out = [
            _Frame(f.reformat(format="nv12").to_ndarray()) for f in frames
        ]  # valid until the next call
        return self.out


class StandIn:
    """The parts of PyNvVideoCodec that NvdecVideos uses."""

    cudaVideoCodec = SimpleNamespace(H264="h264", HEVC="hevc")  # noqa: N815 - PyNvVideoCodec's name

    def __init__(self):
        self.created: list[_Decoder] = []
        self.fail = False

    @staticmethod
    def PacketData():  # noqa: N802 - PyNvVideoCodec's name
        return SimpleNamespace(bsl_data=0, bsl=0, pts=0)

    def CreateDecoder(self, gpuid, codec, cudacontext, cudastream, usedevicememory, maxwidth, maxheight):  # noqa: N802
        decoder = _Decoder(self, codec, maxwidth, maxheight)
        self.created.append(decoder)
        return decoder


def host_frames(clip: bytes, num_frames: int, limits: MediaLimits | None = None):
    return load_video(clip, num_frames=num_frames, limits=limits)


def close(a: torch.Tensor, b: np.ndarray) -> tuple[float, int]:
    diff = (a.int() - torch.from_numpy(np.asarray(b)).int()).abs()
    return diff.float().mean().item(), int(diff.max())


TAGS = {
    "untagged": {},
    "bt709": {"colorspace": "bt709"},
    "bt601": {"colorspace": "smpte170m"},
    "full-range": {"color_range": "pc"},
    "bt709-full-range": {"colorspace": "bt709", "color_range": "pc"},
}


@pytest.mark.parametrize("options", TAGS.values(), ids=TAGS.keys())
def test_sampled_frames_match_the_host_paths_within_a_few_levels(options):
    clip = make_clip(options=options)
    nvdec = NvdecVideos("cpu", StandIn())
    got = nvdec.load(clip, MediaLimits(), num_frames=5)
    want = host_frames(clip, 5)
    assert got is not None and isinstance(got.frames, torch.Tensor)
    assert got.frame_indices == want.frame_indices and got.timestamps_s == want.timestamps_s
    assert got.fps == want.fps and tuple(got.frames.shape) == want.frames.shape
    mean, worst = close(got.frames, want.frames)
    assert mean < 1.5 and worst <= 4, (mean, worst)  # swscale's fixed-point tables against one rounding


def test_the_conversion_is_the_host_conversion_of_the_same_yuv():
    clip = make_clip(frames=3)
    with av.open(io.BytesIO(clip)) as container:
        frame = next(container.decode(video=0))
    nv12 = torch.from_numpy(frame.reformat(format="nv12").to_ndarray())
    mean, worst = close(nv12_to_rgb(nv12, frame.height, "bt601"), frame.to_ndarray(format="rgb24"))
    assert mean < 1.5 and worst <= 4
    wrong, _ = close(nv12_to_rgb(nv12, frame.height, "bt709"), frame.to_ndarray(format="rgb24"))
    assert wrong > 2 * mean + 1  # the matrix matters: the test can tell them apart


def test_hevc_is_decoded_too():
    clip = make_clip(codec="libx265", options={"x265-params": "log-level=none"})
    got = NvdecVideos("cpu", StandIn()).load(clip, MediaLimits(), num_frames=4)
    assert got is not None
    assert close(got.frames, host_frames(clip, 4).frames)[0] < 1.5


def test_a_video_stopped_early_leaves_nothing_for_the_next_one():
    """The first video's decode stops at its last sampled frame with frames still in the decoder; the
    decoder is kept for the next video of that size, whose frames must be its own."""
    first, second = make_clip(frames=30, seed=1), make_clip(frames=30, seed=2)
    stand_in = StandIn()
    nvdec = NvdecVideos("cpu", stand_in)
    early = nvdec.load(first, MediaLimits(), num_frames=2)  # frames 0 and 15 of 30
    assert early is not None and early.frame_indices == [0, 15]
    got = nvdec.load(second, MediaLimits(), num_frames=4)
    fresh = NvdecVideos("cpu", StandIn()).load(second, MediaLimits(), num_frames=4)
    assert got is not None and fresh is not None
    assert torch.equal(got.frames, fresh.frames)
    assert len(stand_in.created) == 1  # one decoder for both


def test_another_frame_size_gets_its_own_decoder():
    stand_in = StandIn()
    nvdec = NvdecVideos("cpu", stand_in)
    small, large = make_clip(width=64, height=48), make_clip(width=96, height=64)
    for clip in (small, large, large):
        got = nvdec.load(clip, MediaLimits(), num_frames=3)
        assert got is not None and close(got.frames, host_frames(clip, 3).frames)[0] < 1.5
    assert [d.size for d in stand_in.created] == [(64, 48), (96, 64)]


@pytest.mark.parametrize(
    "clip, why",
    [
        (lambda: make_clip(codec="mpeg4"), "a codec NVDEC is not used for here"),
        (lambda: make_clip(options={"colorspace": "bt2020nc"}), "a colour space the host converts otherwise"),
        (lambda: make_clip(fmt="matroska"), "no frame count in the header"),
    ],
    ids=["mpeg4", "bt2020", "no-frame-count"],
)
def test_what_it_does_not_take_goes_to_the_host_path(clip, why):
    assert NvdecVideos("cpu", StandIn()).load(clip(), MediaLimits(), num_frames=4) is None, why


def test_frames_over_its_own_size_cap_go_to_the_host_path():
    nvdec = NvdecVideos("cpu", StandIn(), max_frame_pixels=64 * 48)
    assert nvdec.load(make_clip(width=96, height=64), MediaLimits(), num_frames=4) is None


def test_a_decoder_error_sends_the_video_to_the_host_path_and_drops_the_decoder():
    stand_in = StandIn()
    nvdec = NvdecVideos("cpu", stand_in)
    clip = make_clip()
    stand_in.fail = True
    assert nvdec.load(clip, MediaLimits(), num_frames=4) is None
    stand_in.fail = False
    assert nvdec.load(clip, MediaLimits(), num_frames=4) is not None
    assert len(stand_in.created) == 2


def errors(fn) -> str:
    with pytest.raises(ValueError) as info:
        fn()
    return str(info.value)


@pytest.mark.parametrize(
    "limits",
    [MediaLimits(max_video_frames=5), MediaLimits(video_max_decoded_pixels=96 * 64 * 4)],
    ids=["frames", "decoded-pixels"],
)
def test_a_cap_is_refused_with_the_host_paths_error(limits):
    clip = make_clip(frames=12)
    nvdec = NvdecVideos("cpu", StandIn())
    assert errors(lambda: nvdec.load(clip, limits, num_frames=4)) == errors(
        lambda: host_frames(clip, 4, limits)
    )


def test_the_requests_pixel_budget_counts_the_kept_frames_as_on_the_host():
    clip = make_clip(frames=12)
    limits = MediaLimits(max_request_pixels=96 * 64 * 3)
    nvdec = NvdecVideos("cpu", StandIn())
    ours = errors(lambda: nvdec.load(clip, limits, num_frames=4, budget=MediaBudget(limits)))
    theirs = errors(lambda: load_video(clip, num_frames=4, budget=MediaBudget(limits)))
    assert ours == theirs
    budget = MediaBudget(MediaLimits())
    reserved: list[int] = []
    assert nvdec.load(clip, budget.limits, num_frames=4, budget=budget, reserve=reserved.append) is not None
    assert budget.pixels == 4 * 96 * 64 and reserved == [4 * 96 * 64]


def test_only_the_allowed_demuxers_open_it():
    clip = make_clip(fmt="matroska")
    limits = MediaLimits(video_demuxers=("mov", "mp4"), audio_demuxers=("wav",))
    nvdec = NvdecVideos("cpu", StandIn())
    assert errors(lambda: nvdec.load(clip, limits, num_frames=4)) == errors(
        lambda: host_frames(clip, 4, limits)
    )


# ---- through the processor and the engine's config ------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from g4serve.processing.tiny_tokenizer import write_tiny_tokenizer
    from g4serve.processing.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(write_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


def _processor(tokenizer, nvdec: NvdecVideos | None):
    from g4serve.config import preset
    from g4serve.processing.processor import Gemma4Processor

    return Gemma4Processor(tokenizer, preset("tiny"), media_device="cpu", nvdec=nvdec)


def _video(processor, clip: bytes):
    prompt = {"prompt": processor.video_token, "multi_modal_data": {"video": [clip]}}
    return processor.process(prompt, {"image": 0, "video": 1, "audio": 0})


def test_the_processor_decodes_container_videos_with_nvdec(tokenizer):
    """Same prompt, spans and patch positions as the host-decoded video on the same media device; patches
    within the conversion's few levels; and a video NVDEC fails on comes out exactly as without it."""
    clip = make_clip(frames=40, width=160, height=96)
    stand_in = StandIn()
    with_nvdec, without = _processor(tokenizer, NvdecVideos("cpu", stand_in)), _processor(tokenizer, None)
    ours, theirs = _video(with_nvdec, clip), _video(without, clip)
    assert ours.token_ids == theirs.token_ids and len(stand_in.created) == 1
    (x,), (y,) = ours.mm_items, theirs.mm_items
    assert x.spans == y.spans and torch.equal(x.data["position_ids"], y.data["position_ids"])
    diff = (x.data["pixel_values"].int() - y.data["pixel_values"].int()).abs()
    assert 0 < diff.float().mean() < 1.5
    stand_in.fail = True
    fallback = _video(with_nvdec, clip).mm_items[0]
    assert torch.equal(fallback.data["pixel_values"], y.data["pixel_values"])
    assert with_nvdec.media.in_flight_pixels == 0  # the reservation NVDEC took was given back


def test_its_errors_are_the_host_paths(tokenizer):
    clip = make_clip(frames=12)
    with_nvdec, without = _processor(tokenizer, NvdecVideos("cpu", StandIn())), _processor(tokenizer, None)
    limits = MediaLimits(max_video_frames=5)
    for processor in (with_nvdec, without):
        prompt = {"prompt": processor.video_token, "multi_modal_data": {"video": [clip]}}
        with pytest.raises(ValueError, match=r"^video\[0\]: video has 12 frames, over the limit of 5"):
            processor.process(prompt, {"image": 0, "video": 1, "audio": 0}, media_limits=limits)
    assert with_nvdec.media.in_flight_pixels == 0


def test_nvdec_needs_media_on_the_gpu():
    from g4serve.config import preset
    from g4serve.engine.config import EngineConfig
    from g4serve.processing.processor import Gemma4Processor

    with pytest.raises(ValueError, match="^video_decoder: nvdec needs media prepared on the GPU"):
        EngineConfig(device="cuda", media_on_gpu=False, video_decoder="nvdec")
    with pytest.raises(ValueError, match="^video_decoder: expected host or nvdec"):
        EngineConfig(device="cpu", video_decoder="gpu")
    assert EngineConfig(device="cuda", video_decoder="nvdec").video_decoder == "nvdec"
    with pytest.raises(ValueError, match="needs a media device"):
        Gemma4Processor(None, preset("tiny"), nvdec=NvdecVideos("cpu", StandIn()))


def test_without_nvdec_here_the_option_is_refused_by_name(monkeypatch):
    """No driver library (this machine) or no PyNvVideoCodec: a ValueError naming the option, which the CLI
    prints as ``g4serve serve: error: ...``."""
    monkeypatch.setattr(ctypes, "CDLL", lambda name: (_ for _ in ()).throw(OSError(f"{name}: not found")))
    with pytest.raises(NvdecUnavailable, match=r"^--video-decoder nvdec: the driver's NVDEC library") as info:
        import_pynvvideocodec()
    assert isinstance(info.value, ValueError)
    monkeypatch.setattr(ctypes, "CDLL", lambda name: None)
    monkeypatch.setitem(__import__("sys").modules, "PyNvVideoCodec", None)  # import fails
    with pytest.raises(
        NvdecUnavailable, match=r"needs NVIDIA's PyNvVideoCodec \(pip install pynvvideocodec\)"
    ):
        import_pynvvideocodec()
