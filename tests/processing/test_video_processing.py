"""g4serve.processing.video against transformers: PyAV decoding + sampling, Gemma4VideoProcessor pixels,
and Gemma4Processor's timestamped prompt text."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import av
import numpy as np
import PIL.Image
import pytest
import torch
from transformers import Gemma4VideoProcessor
from transformers.models.gemma4.processing_gemma4 import Gemma4Processor
from transformers.video_utils import VideoMetadata, default_sample_indices_fn
from transformers.video_utils import load_video as hf_load_video

from g4serve.processing import video as video_module
from g4serve.processing.video import (
    VideoFrames,
    load_video,
    preprocess_video,
    sample_frame_indices,
    sample_video_frames,
    video_prompt_text,
)


def _frames(num_frames: int, height: int = 120, width: int = 160, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    frames = np.empty((num_frames, height, width, 3), np.uint8)
    for i in range(num_frames):
        frames[i, ..., 0] = (i * 5) % 256
        frames[i, ..., 1] = np.linspace(0, 255, width, dtype=np.uint8)[None, :]
        blocks = rng.integers(0, 256, (-(-height // 8), -(-width // 8)), dtype=np.uint8)
        frames[i, ..., 2] = blocks.repeat(8, 0).repeat(8, 1)[:height, :width]
    return frames


def _encode(path, frames: np.ndarray, fps: int, codec: str, container_format: str | None = None) -> None:
    with av.open(str(path), "w", format=container_format) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())


def _reference_pixels(frames: np.ndarray, metadata=None, **kwargs):
    kwargs.setdefault("do_sample_frames", False)
    return Gemma4VideoProcessor()(
        frames, video_metadata=metadata, return_metadata=True, return_tensors="pt", **kwargs
    )


def _assert_same(features, ref) -> None:
    assert torch.equal(features.pixel_values, ref["pixel_values_videos"])
    assert torch.equal(features.position_ids, ref["video_position_ids"])
    assert [features.num_soft_tokens_per_frame] == list(ref["num_soft_tokens_per_video"])


def test_sample_indices_match_transformers():
    for total in range(32, 400, 7):
        expected = default_sample_indices_fn(VideoMetadata(total_num_frames=total), num_frames=32)
        assert sample_frame_indices(total) == expected.tolist()
    # transformers refuses num_frames > total; we keep every frame (its num_frames=total result).
    for total in (1, 6, 31):
        expected = default_sample_indices_fn(VideoMetadata(total_num_frames=total), num_frames=total)
        assert sample_frame_indices(total) == expected.tolist() == list(range(total))


@pytest.mark.parametrize("num_frames", [1, 6])
def test_short_predecoded_videos_match_transformers(num_frames):
    frames = _frames(num_frames)
    ref = _reference_pixels(frames)
    for given in (frames, [PIL.Image.fromarray(f) for f in frames]):
        video = sample_video_frames(given)
        assert np.array_equal(video.frames, frames) and video.fps is None
        features = preprocess_video(video)
        _assert_same(features, ref)
        assert features.timestamps_s == [i / 24 for i in range(num_frames)]
    _assert_same(preprocess_video(frames), ref)  # raw frames go straight through


def test_long_predecoded_video_is_sampled_like_transformers():
    frames = _frames(45, 90, 200)
    ref = Gemma4VideoProcessor()(frames, return_metadata=True, return_tensors="pt")  # default sampling
    video = sample_video_frames(frames)
    metadata = ref["video_metadata"][0]
    assert video.frame_indices == list(metadata.frames_indices)
    _assert_same(preprocess_video(video), ref)
    # With a known frame rate the timestamps use it, as transformers' VideoMetadata does.
    ref = Gemma4VideoProcessor()(
        frames, video_metadata={"total_num_frames": 45, "fps": 30.0}, return_metadata=True
    )
    assert sample_video_frames(frames, fps=30.0).timestamps_s == ref["video_metadata"][0].timestamps


def test_encoded_frames_decode_only_when_sampled_in_order():
    """A list of encoded frames (what the server gets): the sampled ones are decoded side by side, in their
    order, into the same pixels as the decoded frames give; an unsampled frame is never decoded."""
    import io

    from g4serve.processing.image import load_image

    frames = _frames(45, 90, 200)
    blobs = []
    for f in frames:
        buf = io.BytesIO()
        PIL.Image.fromarray(f).save(buf, format="PNG")
        blobs.append(buf.getvalue())
    indices = sample_frame_indices(45, 32)
    unsampled = next(i for i in range(45) if i not in indices)
    blobs[unsampled] = b"not an image"
    calls = []

    def load(blob):
        calls.append(blob)
        return load_image(blob)

    video = sample_video_frames(blobs, num_frames=32, load=load)
    assert len(calls) == 32 and video.frame_indices == indices
    assert np.array_equal(video.frames, frames[indices])
    _assert_same(preprocess_video(video), _reference_pixels(frames[indices]))
    blobs[indices[3]] = b"corrupt"
    with pytest.raises(ValueError, match="could not decode image"):
        sample_video_frames(blobs, num_frames=32, load=load)


def test_max_soft_tokens_140_matches_transformers():
    frames = _frames(3, 300, 100)
    ref = _reference_pixels(frames, max_soft_tokens=140)
    _assert_same(preprocess_video(frames, max_soft_tokens=140), ref)
    with pytest.raises(ValueError, match="max_soft_tokens"):
        preprocess_video(frames, max_soft_tokens=71)


@pytest.mark.parametrize("codec", ["libx264", "mpeg4"])
def test_mp4_decoding_matches_transformers_pyav(tmp_path, codec):
    if codec not in av.codecs_available:
        pytest.skip(f"{codec} not in this PyAV build")
    path = tmp_path / "clip.mp4"
    _encode(path, _frames(48), 24, codec)
    processor = Gemma4VideoProcessor()
    sampler = functools.partial(processor.sample_frames, num_frames=processor.num_frames, fps=None)
    ref_frames, metadata = hf_load_video(str(path), backend="pyav", sample_indices_fn=sampler)

    for source in (path, str(path), path.read_bytes()):
        video = load_video(source)
        assert np.array_equal(video.frames, ref_frames)
        assert video.frame_indices == list(metadata.frames_indices)
        assert video.fps == metadata.fps == 24.0
        assert video.timestamps_s == metadata.timestamps

    ref = _reference_pixels(ref_frames, metadata=metadata)
    features = preprocess_video(video)
    _assert_same(features, ref)
    assert features.timestamps_s == metadata.timestamps


def test_webm_without_frame_count(tmp_path):
    if "libvpx" not in av.codecs_available:
        pytest.skip("no libvpx")
    path = tmp_path / "clip.webm"
    _encode(path, _frames(20, 64, 96), 10, "libvpx", "webm")
    video = load_video(path.read_bytes())  # webm headers carry no frame count: counted by decoding
    assert video.frames.shape == (20, 64, 96, 3) and video.frame_indices == list(range(20))
    assert video.fps == 10.0 and video.timestamps_s[-1] == pytest.approx(1.9)
    assert load_video(path, num_frames=8).frame_indices == [0, 2, 5, 7, 10, 12, 15, 17]


def test_header_overstating_frame_count(tmp_path, monkeypatch):
    path = tmp_path / "clip.mp4"
    frames = _frames(40)
    _encode(path, frames, 24, "mpeg4")
    real_probe = video_module._probe
    monkeypatch.setattr(video_module, "_probe", lambda source: (real_probe(source)[0] + 25, 24.0))
    video = load_video(path)  # indices past the real end cannot decode: resample over the 40 real frames
    assert video.frame_indices == sample_frame_indices(40) and len(video.frames) == 32
    assert np.array_equal(video.frames, sample_video_frames(_decode_all(path)).frames)


def _decode_all(path) -> np.ndarray:
    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def test_prompt_text_matches_processor():
    tokens = SimpleNamespace(boi_token="<B>", video_token="<|video|>", eoi_token="<E>")
    for fps, indices in ((None, [0, 1, 5]), (2.0, [0, 30, 121, 7201])):
        metadata = VideoMetadata(total_num_frames=8000, fps=fps, frames_indices=indices)
        expected = Gemma4Processor.replace_video_token(
            tokens, {"num_soft_tokens_per_video": [3], "video_metadata": [metadata]}, 0
        )
        video = VideoFrames(
            np.zeros((len(indices), 8, 8, 3), np.uint8), [i / (fps or 24) for i in indices], fps, indices
        )
        assert video_prompt_text(video.timestamps_s, 3, "<B>", "<|video|>", "<E>") == expected
    assert video_prompt_text([0.0, 75.9], 1, "[", "v", "]") == "00:00 [v] 01:15 [v]"


def test_bad_videos_raise(tmp_path):
    for bad in (b"", b"\x00\x00\x00\x18ftypmp42 garbage garbage", tmp_path / "missing.mp4"):
        with pytest.raises(ValueError, match="could not decode video"):
            load_video(bad)
    audio_only = tmp_path / "tone.wav"
    with av.open(str(audio_only), "w") as container:
        stream = container.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
        frame.sample_rate = 8000
        container.mux(stream.encode(frame))
        container.mux(stream.encode())
    with pytest.raises(ValueError, match="no video stream"):
        load_video(audio_only)
    with pytest.raises(ValueError, match="no frames"):
        sample_video_frames([])
    with pytest.raises(ValueError, match="differ in size"):
        sample_video_frames([np.zeros((8, 8, 3), np.uint8), np.zeros((8, 9, 3), np.uint8)])


def test_pil_frames_match_the_same_frames_as_an_array():
    """RGB PIL frames take the zero-copy path to HWC arrays; palette / alpha frames still convert like
    images."""
    frames = _frames(4, height=480, width=854)
    ours = preprocess_video(sample_video_frames([PIL.Image.fromarray(f) for f in frames], num_frames=4))
    _assert_same(ours, _reference_pixels(frames))
    rgba = [PIL.Image.fromarray(np.dstack([f, np.full(f.shape[:2], 255, np.uint8)])) for f in frames]
    assert torch.equal(
        preprocess_video(sample_video_frames(rgba, num_frames=4)).pixel_values, ours.pixel_values
    )


def test_channels_last_resize_gives_the_bytes_of_the_planar_resize():
    """resize_to_patch_budget resizes a channels-last copy (the fast uint8 kernels); the bytes must be those
    of torchvision's resize on planar input, which is what transformers runs."""
    import torchvision.transforms.v2.functional as tvF

    from g4serve.processing.image import aspect_ratio_preserving_size, resize_to_patch_budget

    planar = torch.from_numpy(_frames(3, height=200, width=300, seed=5)).permute(0, 3, 1, 2).contiguous()
    for budget in (70 * 9, 1120 * 9):  # a downscale and an upscale
        size = list(aspect_ratio_preserving_size(200, 300, 16, budget, 3))
        ref = tvF.resize(planar, size=size, interpolation=tvF.InterpolationMode.BICUBIC, antialias=True)
        out = resize_to_patch_budget(planar, 16, budget, 3)
        assert out.is_contiguous() and torch.equal(out, ref)
        assert torch.equal(resize_to_patch_budget(planar[0], 16, budget, 3), ref[0])  # one [3, H, W] image


def test_uint8_patches_rescale_to_the_transformers_values():
    """Video frames rescale by a true division (transformers' normalise by std 1/255), not the image path's
    multiply: ``rescale_pixels(video=True)`` gives its values bit for bit, the multiply does not."""
    from g4serve.processing.image import rescale_pixels

    frames = _frames(4, 96, 128, seed=3)
    raw = preprocess_video(frames, rescale=False)
    assert raw.pixel_values.dtype == torch.uint8
    ref = _reference_pixels(frames)["pixel_values_videos"]
    assert torch.equal(rescale_pixels(raw.pixel_values, video=True), ref)
    assert not torch.equal(rescale_pixels(raw.pixel_values), ref)
