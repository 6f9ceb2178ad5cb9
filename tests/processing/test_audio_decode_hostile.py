"""Hostile audio bytes beyond rates and lengths (tests/processing/test_media_hostile.py): a WAV whose codec
FFmpeg has no decoder for, float samples that are NaN, infinite or overflow the log-mel front end, and
compressed files with many channels whose decoding costs frames x channels. Each must be a quick
``ValueError`` (a 400 naming the input), never another exception (a 500) or garbage fed to the model."""

from __future__ import annotations

import io
import multiprocessing
import struct
import sys
import time

import av
import numpy as np
import pytest
import soundfile
import torch

from g4serve.config import preset
from g4serve.processing import audio as audio_module
from g4serve.processing.audio import fit_waveform, load_audio, resample
from g4serve.processing.limits import MediaBudget, MediaBudgetError, MediaLimits
from g4serve.processing.processor import Gemma4Processor
from g4serve.processing.tiny_tokenizer import write_tiny_tokenizer
from g4serve.processing.tokenizer import Tokenizer

SR = 16_000
LIMITS = {"image": 1, "video": 1, "audio": 8}


@pytest.fixture(scope="module")
def processor(tmp_path_factory) -> Gemma4Processor:
    tok = Tokenizer.from_pretrained(write_tiny_tokenizer(tmp_path_factory.mktemp("tok")))
    return Gemma4Processor(tok, preset("tiny"))


def _wav_header(tag: int = 1, bits: int = 16, channels: int = 1, num_bytes: int = 32_000) -> bytes:
    """A RIFF/WAVE file with any format tag and sample width in its ``fmt `` chunk."""
    block = max(1, channels * bits // 8) & 0xFFFF
    fmt = struct.pack("<HHIIHH", tag, channels, SR, (SR * block) & 0xFFFFFFFF, block, bits)
    data = bytes(num_bytes)
    riff = b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt + b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(riff)) + riff


def _sound(samples: np.ndarray, rate: int = SR, fmt: str = "WAV", subtype: str = "FLOAT") -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, format=fmt, subtype=subtype)
    return buffer.getvalue()


def _tone(seconds: float, rate: int = SR) -> np.ndarray:
    return (0.3 * np.sin(2 * np.pi * 330 * np.arange(round(seconds * rate)) / rate)).astype(np.float32)


# ---- a stream FFmpeg cannot decode -------------------------------------------------------------------
# libsndfile refuses these, PyAV opens them with an audio stream that has no decoder (no codec context):
# reading its rate raised AttributeError, a 500 for what is the client's bad file.
NO_DECODER = {
    "tag-0": _wav_header(tag=0),
    "float-16-bit": _wav_header(tag=3, bits=16),
    "extensible-without-extension": _wav_header(tag=0xFFFE),
    "tag-ffff": _wav_header(tag=0xFFFF),
    "pcm-0-bit": _wav_header(bits=0),
    "pcm-48-bit": _wav_header(bits=48),
}


@pytest.mark.parametrize("case", list(NO_DECODER))
def test_a_stream_without_a_decoder_is_a_value_error(case, processor):
    began = time.perf_counter()
    with pytest.raises(ValueError, match="could not decode audio"):
        load_audio(NO_DECODER[case])
    assert time.perf_counter() - began < 0.5
    prompt = {"prompt": processor.audio_token, "multi_modal_data": {"audio": NO_DECODER[case]}}
    with pytest.raises(ValueError, match=r"^audio\[0\]: could not decode audio"):
        processor.process(prompt, LIMITS)


# ---- eight channels or more through PyAV ---------------------------------------------------------------
def _mka(channels: int, seconds: float = 0.5) -> tuple[bytes, np.ndarray]:
    """Matroska (which libsndfile cannot read) holding PCM in ``channels`` channels, and its samples."""
    rng = np.random.default_rng(channels)
    pcm = (rng.standard_normal((round(SR * seconds), channels)) * 3000).astype(np.int16)
    layout = {2: "stereo", 8: "7.1"}.get(channels, f"{channels}c")
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="matroska") as container:
        stream = container.add_stream("pcm_s16le", rate=SR, layout=layout)
        frame = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout=layout)
        frame.sample_rate = SR
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            container.mux(packet)
    return buffer.getvalue(), pcm


def _exit_code_of(load, data: bytes) -> int | None:
    """``load(data)`` in a forked child: its exit code (a negative signal number if it crashed)."""

    def run() -> None:
        load(data)

    child = multiprocessing.get_context("fork").Process(target=run)
    child.start()
    child.join(30)
    return child.exitcode


@pytest.mark.parametrize("channels", [2, 8, 12, 24])
def test_eight_or_more_channels_through_pyav_do_not_crash_the_process(channels, monkeypatch):
    """PyAV's planar frames with 8 or more channels: to_ndarray() read past their plane pointers and the
    server died of a segmentation fault on a 256 KB 7.1 Matroska file (1 s of 16 kHz PCM)."""
    data, pcm = _mka(channels)
    assert _exit_code_of(load_audio, data) == 0
    expected = (pcm.astype(np.float32) / 32768).T.mean(axis=0)  # channels averaged, as libsndfile's blocks
    assert np.array_equal(load_audio(data), expected)
    wav = _sound(pcm, subtype="PCM_16")
    monkeypatch.setitem(sys.modules, "soundfile", None)  # import fails: PyAV decodes the WAV too
    assert _exit_code_of(load_audio, wav) == 0
    assert np.array_equal(load_audio(wav), expected)


# ---- samples that are no numbers, or too large for the features ------------------------------------------
def _spoiled(value: float) -> np.ndarray:
    wave = _tone(1.0)
    wave[100:200] = value
    return wave


BAD_SAMPLES = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf, "float32-max": 3e38}


@pytest.mark.parametrize("value", list(BAD_SAMPLES))
@pytest.mark.parametrize("subtype", ["FLOAT", "DOUBLE"])
def test_non_finite_or_huge_samples_are_refused(value, subtype, processor):
    """They made the log-mel features NaN or infinite: the model answered <pad> tokens with NaN logprobs."""
    data = _sound(_spoiled(BAD_SAMPLES[value]), subtype=subtype)
    with pytest.raises(ValueError, match="samples must be finite"):
        load_audio(data)
    for item in (data, (_spoiled(BAD_SAMPLES[value]), SR), _spoiled(BAD_SAMPLES[value])):
        prompt = {"prompt": processor.audio_token, "multi_modal_data": {"audio": item}}
        with pytest.raises(ValueError, match=r"^audio\[0\]: audio samples must be finite"):
            processor.process(prompt, LIMITS)


def test_loud_but_finite_float_audio_is_heard(processor):
    """Float audio past [-1, 1] (headroom, or PCM values stored as floats) is refused only past 2**32."""
    for scale in (1.5, 32_767.0, 2.0**31):
        wave = _tone(1.0) * np.float32(scale / 0.3)
        assert np.isfinite(fit_waveform(wave, SR)).all()
        prompt = {"prompt": processor.audio_token, "multi_modal_data": {"audio": _sound(wave)}}
        processed = processor.process(prompt, LIMITS)
        assert torch_finite(processed.mm_items[0].data["input_features"])
    nan_outside_the_kept_seconds = np.concatenate([_tone(1.0), np.full(SR, np.nan, np.float32)])
    limits = MediaLimits(max_audio_seconds=0.5)
    assert len(load_audio(_sound(nan_outside_the_kept_seconds), limits=limits)) == SR // 2


def torch_finite(tensor) -> bool:
    return bool(tensor.isfinite().all())


# ---- decoding work: frames x channels -------------------------------------------------------------------
def _decoded_samples(monkeypatch) -> list[int]:
    """Sample values (frames x channels) each decoded block held, as ``_mono`` saw them."""
    seen: list[int] = []
    mono = audio_module._mono

    def counting(chunk: np.ndarray) -> np.ndarray:
        seen.append(chunk.size)
        return mono(chunk)

    monkeypatch.setattr(audio_module, "_mono", counting)
    return seen


CAP = 1 << 20


@pytest.mark.parametrize("sf", [True, False], ids=["soundfile", "pyav-only"])
def test_many_channels_are_capped_while_decoding(monkeypatch, sf):
    """A compressed file of silence in many channels decodes frames x channels samples: 600 s of 64-channel
    Vorbis at 48 kHz is 288 KB and took 14 s of CPU and 800 MB to decode (30 s of 64-channel Opus, 388 KB,
    took 3.6 s). Decoding stops once the request's budget of decoded samples is spent."""
    data = _sound(np.zeros((SR * 12, 8), np.float32), fmt="FLAC", subtype="PCM_16")  # 1.5M samples
    assert len(data) < 20_000
    seen = _decoded_samples(monkeypatch)
    if not sf:
        monkeypatch.setitem(sys.modules, "soundfile", None)
    limits = MediaLimits(max_request_decoded_audio_samples=CAP)
    with pytest.raises(MediaBudgetError, match=r"^multi_modal_data: .*max_request_decoded_audio_samples"):
        load_audio(data, limits=limits)
    # soundfile knows the file's frames and refuses before decoding; PyAV stops within a frame of the cap.
    assert sum(seen) == 0 if sf else CAP <= sum(seen) < CAP + 8 * 8192
    ok = MediaLimits(max_request_decoded_audio_samples=SR * 12 * 8)
    assert len(load_audio(data, limits=ok)) == SR * 12


class _HeaderTrusted(MediaBudget):
    """A budget whose check from the header passes: as if the header understated the file's length."""

    def check_decoded_audio(self, n: int) -> None:
        pass


def test_libsndfile_blocks_are_counted_as_they_are_decoded(monkeypatch):
    data = _sound(np.zeros((SR * 12, 8), np.float32), fmt="FLAC", subtype="PCM_16")
    seen = _decoded_samples(monkeypatch)
    budget = _HeaderTrusted(MediaLimits(max_request_decoded_audio_samples=CAP))
    with pytest.raises(MediaBudgetError, match="max_request_decoded_audio_samples"):
        load_audio(data, budget=budget)
    assert sum(seen) <= CAP  # the block that passed the cap is refused before it is kept
    assert budget.decoded_audio_samples <= CAP + 8 * (1 << 16)


def test_the_decoded_samples_budget_spans_the_request(processor):
    """Eight clips of a chat request share one budget."""
    clip = _sound(np.zeros((SR, 4), np.float32), subtype="PCM_16")  # 64,000 samples each
    prompt = {"prompt": processor.audio_token * 4, "multi_modal_data": {"audio": [clip] * 4}}
    ok = MediaLimits(max_request_decoded_audio_samples=4 * 4 * SR)
    assert len(processor.process(prompt, LIMITS, media_limits=ok).mm_items) == 4
    tight = MediaLimits(max_request_decoded_audio_samples=4 * 4 * SR - 1)
    with pytest.raises(MediaBudgetError, match=r"^multi_modal_data: .*max_request_decoded_audio_samples"):
        processor.process(prompt, LIMITS, media_limits=tight)


def test_the_default_budget_holds_ten_minutes_of_48k_stereo():
    limits = MediaLimits()
    assert limits.max_request_decoded_audio_samples >= 601 * 48_000 * 2
    assert limits.max_request_decoded_audio_samples < 8 * 30 * 48_000 * 64  # eight 64-channel clips


# ---- resampling a long upload ------------------------------------------------------------------------
@pytest.mark.parametrize("rate", [48_000, 8_000, 44_100])
def test_resampling_unfolds_a_bounded_window_at_a_time(rate, monkeypatch):
    """A transcription resamples up to 600 s at once: at 48 kHz one conv1d unfolded 394M floats (the
    process grew by 760 MB for a 58 MB upload). In pieces, the same bits."""
    wave = (np.random.default_rng(rate).standard_normal(rate * 60) * 0.2).astype(np.float32)
    unfolded: list[int] = []
    conv1d = torch.nn.functional.conv1d

    def spy(x, kernel, stride):
        unfolded.append((x.shape[-1] - kernel.shape[-1]) // stride * kernel.shape[-1])
        return conv1d(x, kernel, stride=stride)

    monkeypatch.setattr(torch.nn.functional, "conv1d", spy)
    pieces = resample(wave, rate, SR)
    assert max(unfolded) <= 1 << 24 and (len(unfolded) > 1) == (rate == 48_000)  # 60 s: 115M floats
    monkeypatch.setattr(audio_module, "_MAX_UNFOLDED_ELEMENTS", 1 << 40)  # one conv1d, as before
    assert np.array_equal(pieces, resample(wave, rate, SR))


# ---- which bytes libsndfile parses -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "fmt", ["NIST", "IRCAM", "VOC", "MAT5", "MAT4", "PAF", "XI", "HTK", "AVR", "SVX", "AU"]
)
def test_libsndfile_parses_only_the_formats_it_is_trusted_with(fmt, monkeypatch):
    """libsndfile guessed the format from the bytes and parsed any of its ~25 formats' headers before the
    whitelist was checked; these now go straight to PyAV (whose demuxer whitelist refuses them)."""
    data = _sound(np.zeros(SR // 10, np.float32), fmt=fmt, subtype="DPCM_16" if fmt == "XI" else "PCM_16")
    opened: list[bytes] = []
    real = soundfile.SoundFile

    def spy(file, *args, **kwargs):
        opened.append(file.getvalue()[:4])
        return real(file, *args, **kwargs)

    monkeypatch.setattr(soundfile, "SoundFile", spy)
    with pytest.raises(ValueError, match="could not decode audio"):
        load_audio(data)
    assert opened == []


@pytest.mark.parametrize(
    "fmt, subtype",
    [("WAV", "PCM_16"), ("W64", "PCM_16"), ("RF64", "PCM_16"), ("FLAC", "PCM_16"), ("OGG", "VORBIS"),
     ("AIFF", "PCM_16"), ("CAF", "PCM_16"), ("WAV", "FLOAT")],
)  # fmt: skip
def test_the_trusted_formats_still_reach_libsndfile(fmt, subtype, monkeypatch):
    data = _sound(_tone(2.0), fmt=fmt, subtype=subtype)
    opened: list[str] = []
    real = soundfile.SoundFile

    def spy(file, *args, **kwargs):
        f = real(file, *args, **kwargs)
        opened.append(f.format)
        return f

    monkeypatch.setattr(soundfile, "SoundFile", spy)
    assert abs(len(load_audio(data)) - 2 * SR) < SR // 10
    assert opened == [fmt]


def test_mpeg_audio_may_reach_libsndfile():
    """MP3 begins with an ID3 tag or a frame's 11 sync bits (libsndfile 1.2 refuses what it writes itself
    from memory, "bad data offset", and PyAV decodes it)."""
    mp3 = _sound(_tone(2.0), fmt="MP3", subtype="MPEG_LAYER_III")
    assert audio_module._may_be_for_soundfile(mp3) and audio_module._may_be_for_soundfile(b"ID3\x04" + mp3)
    assert abs(len(load_audio(mp3)) - 2 * SR) < SR // 10
