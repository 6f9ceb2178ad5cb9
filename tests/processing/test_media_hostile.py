"""Hostile media bytes (issue 19): playlists that would make FFmpeg open files, sample rates that blow up
resampling, frame sizes and counts that blow up decoding, image bombs, local paths escaping
--allowed-local-media-path, and per-request media budgets. Each must be a quick, clear ValueError that
reveals nothing about the server's files."""

from __future__ import annotations

import fractions
import io
import os
import struct
import sys
import time
import tracemalloc
import wave as wave_io
import zlib

import av
import numpy as np
import PIL.Image
import pytest

from g4serve.config import preset
from g4serve.engine.config import EngineConfig
from g4serve.processing.audio import fit_waveform, load_audio, resample
from g4serve.processing.chat import LocalFile, split_chat_messages
from g4serve.processing.image import load_image
from g4serve.processing.limits import MediaBudget, MediaBudgetError, MediaLimits, read_media_file
from g4serve.processing.processor import Gemma4Processor
from g4serve.processing.tiny_tokenizer import write_tiny_tokenizer
from g4serve.processing.tokenizer import Tokenizer
from g4serve.processing.video import load_video

SR = 16_000


# ---- builders ----------------------------------------------------------------------------------------
def _wav(samples: np.ndarray, rate: int) -> bytes:
    buffer = io.BytesIO()
    with wave_io.open(buffer, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return buffer.getvalue()


def _frames(n: int, height: int = 48, width: int = 64) -> np.ndarray:
    frames = np.zeros((n, height, width, 3), np.uint8)
    frames[..., 0] = (np.arange(n) * 7 % 256)[:, None, None]
    frames[..., 1] = np.linspace(0, 255, width, dtype=np.uint8)
    return frames


def _video(
    frames: np.ndarray,
    fmt: str = "mp4",
    codec: str = "mpeg4",
    fps: int = 10,
    options: dict[str, str] | None = None,
) -> bytes:
    """uint8 [F, H, W, 3] RGB frames encoded by ``codec`` (with its ``options``) into a ``fmt`` container."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "yuv420p"
        stream.codec_context.options = options or {}
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return buffer.getvalue()


def _size_changing_ts() -> bytes:
    """MPEG-TS whose header (first sequence header) says 64x48; later frames are 640x480."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mpegts") as out:
        stream = out.add_stream("mpeg2video", rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        pts = 0
        for width, height in ((64, 48), (640, 480)):
            enc = av.CodecContext.create("mpeg2video", "w")
            enc.width, enc.height, enc.pix_fmt = width, height, "yuv420p"
            enc.time_base, enc.framerate = fractions.Fraction(1, 10), 10
            packets = []
            for i in range(5):
                frame = av.VideoFrame.from_ndarray(np.full((height, width, 3), i * 10, np.uint8), "rgb24")
                frame.pts = pts + i
                packets += enc.encode(frame)
            for packet in packets + enc.encode(None):
                packet.stream = stream
                out.mux(packet)
            pts += 5
    return buffer.getvalue()


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose IHDR claims width x height, with one tiny IDAT (a decompression bomb's header)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + chunk(b"IEND", b"")
    )


def _png(width: int = 64, height: int = 48) -> bytes:
    buffer = io.BytesIO()
    PIL.Image.fromarray(_frames(1, height, width)[0]).save(buffer, format="PNG")
    return buffer.getvalue()


def _data_url(data: bytes, mime: str = "image/png") -> str:
    import base64

    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


@pytest.fixture(scope="module")
def processor(tmp_path_factory) -> Gemma4Processor:
    tok = Tokenizer.from_pretrained(write_tiny_tokenizer(tmp_path_factory.mktemp("tok")))
    return Gemma4Processor(tok, preset("tiny"))


@pytest.fixture
def no_soundfile(monkeypatch):
    monkeypatch.setitem(sys.modules, "soundfile", None)  # import fails: PyAV decodes


LIMITS = {"image": 32, "video": 4, "audio": 8}


# ---- playlists: FFmpeg must never open a file -------------------------------------------------------
PLAYLISTS = {
    "ffconcat": "ffconcat version 1.0\nfile '{name}'\n",
    "m3u8": "#EXTM3U\n#EXT-X-TARGETDURATION:10\n#EXTINF:10,\n{name}\n#EXT-X-ENDLIST\n",
}


@pytest.mark.parametrize("kind", PLAYLISTS)
@pytest.mark.parametrize("modality", ["audio", "video"])
@pytest.mark.parametrize("sf", [True, False], ids=["soundfile", "pyav-only"])
def test_playlists_are_refused_without_revealing_files(tmp_path, monkeypatch, kind, modality, sf):
    if not sf:
        monkeypatch.setitem(sys.modules, "soundfile", None)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "real.wav").write_bytes(_wav(np.zeros(SR, np.float32), SR))
    (tmp_path / "real.mp4").write_bytes(_video(_frames(4)))
    load = load_audio if modality == "audio" else load_video
    ext = "wav" if modality == "audio" else "mp4"
    messages = []
    for name in (f"real.{ext}", f"missing.{ext}", "/etc/passwd", f"{tmp_path}/real.{ext}"):
        payload = PLAYLISTS[kind].format(name=name).encode()
        with pytest.raises(ValueError, match=f"could not decode {modality}") as info:
            load(payload)
        messages.append(str(info.value))
        assert name not in messages[-1] and "real" not in messages[-1] and "object at 0x" not in messages[-1]
    assert len(set(messages)) == 1  # the same answer whether the referenced file exists or not
    if kind == "ffconcat":
        assert "format not allowed" in messages[0]


def test_playlists_through_the_processor(processor, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.wav").write_bytes(_wav(np.zeros(SR, np.float32), SR))
    payload = PLAYLISTS["ffconcat"].format(name="x.wav").encode()
    prompt = {"prompt": f"hi {processor.audio_token}", "multi_modal_data": {"audio": payload}}
    with pytest.raises(ValueError, match=r"^audio\[0\]: could not decode audio: format not allowed"):
        processor.process(prompt, LIMITS)
    prompt = {"prompt": f"hi {processor.video_token}", "multi_modal_data": {"video": payload}}
    with pytest.raises(ValueError, match=r"^video\[0\]: could not decode video: format not allowed"):
        processor.process(prompt, LIMITS)


def test_demuxer_whitelist_is_configurable():
    data = _wav(np.zeros(SR, np.float32), SR)
    with pytest.raises(ValueError, match="format not allowed"):
        load_video(data, limits=MediaLimits(video_demuxers=("mov", "mp4"), audio_demuxers=("flac",)))


# ---- audio: rates and lengths ------------------------------------------------------------------------
@pytest.mark.parametrize("sf", [True, False], ids=["soundfile", "pyav-only"])
def test_one_hz_wav_is_refused_cheaply(monkeypatch, sf, wav_claiming):
    if not sf:
        monkeypatch.setitem(sys.modules, "soundfile", None)
    data = wav_claiming(1)  # 64 KB claiming 1 Hz: 32,000 s, which resampling x16,000 made 3.9 GB
    tracemalloc.start()
    began = time.perf_counter()
    with pytest.raises(ValueError, match=r"sample rate 1 Hz is outside 1000\.\.384000 Hz"):
        load_audio(data)
    elapsed = time.perf_counter() - began
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert elapsed < 0.5 and peak < 8 << 20


@pytest.mark.parametrize("rate", [2**31, 2**31 - 1, 2**32 - 1, 0, 999, 384_001])
def test_absurd_sample_rates_are_value_errors(rate, wav_claiming):
    with pytest.raises(ValueError, match="could not decode audio|sample rate"):
        load_audio(wav_claiming(rate))


def test_lowest_rate_is_trimmed_before_resampling(wav_claiming):
    data = wav_claiming(1_000)  # 32 s at 1 kHz: the model hears 30 s
    began = time.perf_counter()
    wave = load_audio(data)
    assert time.perf_counter() - began < 1.0
    assert wave.shape == (30 * SR,)


@pytest.mark.parametrize("rate", [22_050, 44_100, 16_001])
def test_long_audio_is_trimmed_exactly(rate, monkeypatch):
    rng = np.random.default_rng(rate)
    samples = (rng.standard_normal(int(rate * 31.5)) * 0.2).astype(np.float32)
    data = _wav(samples, rate)
    pcm = np.frombuffer(data[44:], "<i2").astype(np.float32) / 32768
    full = resample(pcm, rate, SR)[: 30 * SR]  # the old path: resample everything, the extractor truncates
    assert np.array_equal(load_audio(data), full)
    monkeypatch.setitem(sys.modules, "soundfile", None)
    assert np.array_equal(load_audio(data), full)
    assert np.array_equal(fit_waveform(pcm, rate), full)
    short = load_audio(data, limits=MediaLimits(max_audio_seconds=2.5))
    assert short.shape == (40_000,) and np.array_equal(short, full[:40_000])


def test_audio_frame_cap_and_channel_cap(wav_claiming):
    data = _wav(np.zeros(48_000 * 2, np.float32), 48_000)
    with pytest.raises(ValueError, match="audio_max_frames"):
        load_audio(data, limits=MediaLimits(audio_max_frames=50_000))
    with pytest.raises(ValueError, match="channels.*audio_max_channels"):
        load_audio(wav_claiming(16_000, num_bytes=100 * 2 * 10, channels=100))


def test_waveform_objects_obey_the_rate_range(processor):
    prompt = {"prompt": processor.audio_token, "multi_modal_data": {"audio": (np.zeros(64_000), 1)}}
    with pytest.raises(ValueError, match=r"^audio\[0\]: audio sample rate 1 Hz"):
        processor.process(prompt, LIMITS)


def test_garbage_audio_error_has_no_object_repr():
    with pytest.raises(ValueError) as info:
        load_audio(b"RIFF....WAVEgarbage" * 5)
    assert "object at 0x" not in str(info.value) and "<none>" not in str(info.value)


# ---- video: sizes and counts -------------------------------------------------------------------------
def test_frame_size_over_the_cap_is_refused_from_the_header():
    data = _video(_frames(4, 48, 64))
    # Refused by the header check, or (when FFmpeg's probing already hit the decoder's max_pixels and
    # left the size unknown) by the decoder before it allocates the frame: either way before decoding.
    with pytest.raises(ValueError, match=r"limit of 3071 pixels.*\(max_media_pixels\)"):
        load_video(data, limits=MediaLimits(max_media_pixels=64 * 48 - 1))
    assert load_video(data, limits=MediaLimits(max_media_pixels=64 * 48)).frames.shape == (4, 48, 64, 3)


def test_frames_larger_than_the_header_said_do_not_bypass_the_cap():
    data = _size_changing_ts()  # header: 64x48; later frames: 640x480
    with pytest.raises(ValueError, match="max_media_pixels"):
        load_video(data, limits=MediaLimits(max_media_pixels=64 * 48 * 4))
    with pytest.raises(ValueError, match="video_max_decoded_pixels"):
        load_video(data, limits=MediaLimits(video_max_decoded_pixels=64 * 48 * 8))


def test_too_many_frames_from_the_header_and_while_counting():
    mp4 = _video(_frames(20))
    limits = MediaLimits(max_video_frames=10)
    with pytest.raises(ValueError, match=r"20 frames, over the limit of 10 \(max_video_frames\)"):
        load_video(mp4, limits=limits)
    ts = _video(_frames(20), fmt="mpegts", codec="mpeg2video")  # no frame count in the header
    with pytest.raises(ValueError, match="max_video_frames"):
        load_video(ts, limits=limits)
    assert len(load_video(ts, num_frames=8).frames) == 8
    with pytest.raises(ValueError, match="video_max_decoded_pixels"):
        load_video(mp4, limits=MediaLimits(video_max_decoded_pixels=64 * 48 * 19))


def test_frame_list_too_long_is_refused_before_decoding(processor):
    frames = [b"not even an image"] * 100_000
    prompt = {"prompt": processor.video_token, "multi_modal_data": {"video": [frames]}}
    began = time.perf_counter()
    with pytest.raises(ValueError, match=r"^video\[0\]: 100000 frames exceed the limit of 9000"):
        processor.process(prompt, LIMITS)
    assert time.perf_counter() - began < 1.0


def test_video_pixels_count_against_the_request(processor):
    data = _video(_frames(4))
    prompt = {"prompt": processor.video_token, "multi_modal_data": {"video": data}}
    with pytest.raises(MediaBudgetError, match=r"^multi_modal_data: .*max_request_pixels"):
        processor.process(prompt, LIMITS, media_limits=MediaLimits(max_request_pixels=64 * 48 * 3))
    assert processor.process(prompt, LIMITS, media_limits=MediaLimits(max_request_pixels=64 * 48 * 4))


# ---- images ------------------------------------------------------------------------------------------
def test_image_bomb_is_refused_before_decoding():
    tracemalloc.start()
    with pytest.raises(
        ValueError, match=r"9000x9000 exceeds the limit of 67108864 pixels \(max_media_pixels\)"
    ):
        load_image(_png_header_only(9000, 9000))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 8 << 20
    with pytest.raises(ValueError, match="could not decode image"):  # past PIL's own bomb limit too
        load_image(_png_header_only(30_000, 30_000))
    with pytest.raises(ValueError, match="max_media_pixels"):
        load_image(_png(), limits=MediaLimits(max_media_pixels=100))


def test_image_formats_are_whitelisted():
    buffer = io.BytesIO()
    PIL.Image.new("RGB", (8, 8)).save(buffer, format="PPM")
    with pytest.raises(ValueError, match="not an image in an allowed format"):
        load_image(buffer.getvalue())
    assert load_image(buffer.getvalue(), limits=MediaLimits(image_formats=("PPM",))).size == (8, 8)
    with pytest.raises(ValueError, match="allowed format"):
        load_image(_png(), limits=MediaLimits(image_formats=("JPEG",)))


# ---- local paths -------------------------------------------------------------------------------------
def _video_message(frames: list) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "video", "video": frames}]}]


@pytest.fixture
def media_root(tmp_path):
    root = tmp_path / "media"
    root.mkdir()
    (root / "a.png").write_bytes(_png())
    (root / "sub").mkdir()
    (tmp_path / "secret.png").write_bytes(_png())
    os.symlink(tmp_path / "secret.png", root / "link.png")
    os.symlink(tmp_path / "nowhere.png", root / "dangling.png")
    return root


@pytest.mark.parametrize(
    "escape",
    [
        "{root}/../secret.png",
        "{root}/../missing.png",
        "{root}/link.png",
        "{root}/dangling.png",
        "/etc/passwd",
    ],
)
def test_nested_local_paths_must_stay_inside_the_root(media_root, escape):
    frames = [f"file://{media_root}/a.png", f"{media_root}/a.png", escape.format(root=media_root)]
    with pytest.raises(ValueError) as info:
        split_chat_messages(_video_message(frames), local_media_root=str(media_root))
    message = str(info.value)
    assert message == (
        f"messages[0].content[1].video[2]: {escape.format(root=media_root)!r} is outside "
        "--allowed-local-media-path"
    )


def test_local_paths_inside_the_root(media_root, processor):
    frames = [f"file://{media_root}/a.png", f"{media_root}/sub/../a.png"]
    messages = _video_message(frames) + [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": f"file://{media_root}/a.png"}}],
        }
    ]
    _, media = split_chat_messages(messages, local_media_root=media_root)
    resolved = str((media_root / "a.png").resolve())
    assert media.video == [[LocalFile(resolved, str(media_root.resolve()))] * 2]
    assert media.image == [LocalFile(resolved, str(media_root.resolve()))]
    prompt = {
        "prompt": f"{processor.image_token} {processor.video_token}",
        "multi_modal_data": media.as_dict(),
    }
    assert len(processor.process(prompt, LIMITS).mm_items) == 2
    with pytest.raises(ValueError, match=r"content\[1\]\.video\[0\]: .* is not a file under"):
        split_chat_messages(_video_message([str(media_root / "sub")]), local_media_root=media_root)
    with pytest.raises(ValueError, match="local files are not allowed"):
        split_chat_messages(_video_message(frames), allow_local_files=False, local_media_root=media_root)
    assert split_chat_messages(_video_message(frames))[1].video == [
        [LocalFile(frames[0][7:]), LocalFile(frames[1])]
    ]


def test_reading_rechecks_the_root(media_root, tmp_path):
    target = media_root / "swapped.png"
    target.write_bytes(_png())
    checked = LocalFile(str(target), str(media_root))
    target.unlink()
    os.symlink(tmp_path / "secret.png", target)  # swapped for a symlink after validation
    with pytest.raises(ValueError, match="outside --allowed-local-media-path"):
        read_media_file(checked.path, 1 << 20, checked.root)
    with pytest.raises(ValueError, match="max_media_item_bytes"):
        read_media_file(media_root / "a.png", 10)


def test_objects_can_be_refused(media_root):
    cases = [
        ({"type": "image", "image": [1, 2, 3]}, r"content\[0\]\.image: must be a string"),
        ({"type": "audio", "audio": {"array": [0.0]}}, r"content\[0\]\.audio: must be a string"),
        (
            {"type": "video", "video": ["data:image/png;base64,AAAA", [0, 0]]},
            r"content\[0\]\.video\[1\]: must",
        ),
        ({"type": "image_pil", "image_pil": 5}, r"content\[0\]\.image_pil: must be a string"),
    ]
    for part, message in cases:
        messages = [{"role": "user", "content": [part]}]
        with pytest.raises(ValueError, match=message):
            split_chat_messages(messages, allow_local_files=False, allow_objects=False)
        split_chat_messages(messages, allow_local_files=False)  # the Python API still takes objects
    frames = [_data_url(_png()), _data_url(_png())]
    _, media = split_chat_messages(_video_message(frames), allow_local_files=False, allow_objects=False)
    assert media.video == [[_png(), _png()]]


# ---- per-request budgets -----------------------------------------------------------------------------
def test_request_byte_budget(processor):
    png = _png()
    prompt = {"prompt": processor.image_token * 2, "multi_modal_data": {"image": [png, png]}}
    with pytest.raises(MediaBudgetError, match=r"^multi_modal_data: .*max_media_bytes"):
        processor.process(prompt, LIMITS, media_limits=MediaLimits(max_media_bytes=2 * len(png) - 1))
    with pytest.raises(ValueError, match=r"^image\[0\]: .*max_media_item_bytes"):
        processor.process(prompt, LIMITS, media_limits=MediaLimits(max_media_item_bytes=len(png) - 1))
    frames = {"prompt": processor.video_token, "multi_modal_data": {"video": [[png] * 3]}}
    with pytest.raises(MediaBudgetError, match="max_media_bytes"):
        processor.process(frames, LIMITS, media_limits=MediaLimits(max_media_bytes=3 * len(png) - 1))
    assert (
        len(
            processor.process(prompt, LIMITS, media_limits=MediaLimits(max_media_bytes=2 * len(png))).mm_items
        )
        == 2
    )


def test_request_pixel_and_audio_budgets(processor):
    png = _png()
    prompt = {"prompt": processor.image_token * 2, "multi_modal_data": {"image": [png, png]}}
    with pytest.raises(MediaBudgetError, match=r"^multi_modal_data: .*max_request_pixels"):
        processor.process(prompt, LIMITS, media_limits=MediaLimits(max_request_pixels=64 * 48 * 2 - 1))
    clip = _wav(np.zeros(SR, np.float32), SR)
    prompt = {"prompt": processor.audio_token * 2, "multi_modal_data": {"audio": [clip, clip]}}
    with pytest.raises(MediaBudgetError, match="max_request_audio_seconds"):
        processor.process(prompt, LIMITS, media_limits=MediaLimits(max_request_audio_seconds=1.5))
    budget = MediaBudget(MediaLimits(max_request_pixels=10))
    budget.charge_pixels(10)
    with pytest.raises(MediaBudgetError):
        budget.charge_pixels(1)


def test_normal_media_unchanged_by_the_limits(processor):
    tone = (0.3 * np.sin(np.arange(2 * 22_050) * 0.05)).astype(np.float32)
    media = {"image": [_png()], "video": [_video(_frames(6))], "audio": [_wav(tone, 22_050)]}
    prompt = {
        "prompt": f"{processor.image_token} {processor.video_token} {processor.audio_token}",
        "multi_modal_data": media,
    }
    default = processor.process(prompt, LIMITS)
    explicit = processor.process(prompt, LIMITS, media_limits=EngineConfig().media_limits())
    assert default.token_ids == explicit.token_ids
    for a, b in zip(default.mm_items, explicit.mm_items, strict=True):
        assert a.content_hash == b.content_hash


def test_engine_config_knobs():
    limits = EngineConfig(
        max_audio_seconds=10,
        max_video_frames=5,
        max_media_pixels=99,
        max_media_bytes=1000,
        max_request_pixels=777,
    ).media_limits()
    assert (limits.max_audio_seconds, limits.max_video_frames, limits.max_media_pixels) == (10, 5, 99)
    assert limits.max_request_pixels == 777
    assert limits.max_media_bytes == 1000 and limits.max_media_item_bytes == 1000
    assert limits.video_max_decoded_pixels == 5 * 1920 * 1080
    assert EngineConfig().media_limits() == MediaLimits()
    with pytest.raises(ValueError, match="max_video_frames"):
        MediaLimits(max_video_frames=0)
