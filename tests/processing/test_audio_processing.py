"""g4serve.processing.audio against transformers' Gemma4AudioFeatureExtractor and Gemma4Processor's
audio token counts, plus decoding/resampling sanity."""

from __future__ import annotations

import io
import math
import sys
import wave as wave_io
from types import SimpleNamespace

import av
import numpy as np
import pytest
import torch
from transformers import Gemma4AudioFeatureExtractor
from transformers.audio_utils import mel_filter_bank as hf_mel_filter_bank
from transformers.models.gemma4.processing_gemma4 import Gemma4Processor

from g4serve.processing.audio import (
    AudioFeatureExtractor,
    load_audio,
    mel_filter_bank,
    num_audio_soft_tokens,
    num_audio_soft_tokens_from_mask,
    resample,
)

SR = 16_000


@pytest.fixture
def soundfile():
    # Not a declared g4serve dependency (load_audio falls back to PyAV without it).
    return pytest.importorskip("soundfile")


@pytest.fixture(scope="module")
def extractors():
    return AudioFeatureExtractor(), Gemma4AudioFeatureExtractor()


def _noise(num_samples: int, seed: int = 0, dtype=np.float32) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(num_samples) * 0.3).astype(dtype)


def _tone(seconds: float, rate: int, freq: float = 440.0, channels: int = 1) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    wave = 0.5 * np.sin(2 * np.pi * freq * t)
    return np.stack([wave] * channels, axis=1).astype(np.float32) if channels > 1 else wave.astype(np.float32)


def _dominant_freq(wave: np.ndarray, rate: int) -> float:
    return float(np.argmax(np.abs(np.fft.rfft(wave))) * rate / len(wave))


@pytest.mark.filterwarnings("ignore:At least one mel filter has all zero values")
def test_mel_filter_bank_matches_transformers(extractors):
    ours = mel_filter_bank(257, 128, 0.0, 8000.0, SR)
    ref = hf_mel_filter_bank(257, 128, 0.0, 8000.0, SR, norm=None, mel_scale="htk")
    assert ours.shape == (257, 128) and ours.dtype == np.float64
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-6)
    assert np.array_equal(ours, ref)  # same formula and op order: same bits
    assert np.array_equal(extractors[0].window, extractors[1].window)


@pytest.mark.parametrize(
    "lengths",
    [[SR], [5 * SR], [SR, 5 * SR, 333], [161, 160, 321, 100], [31 * SR], [480_001, 2000]],
    ids=["1s", "5s", "batch", "tiny", "over-30s", "truncation-edge"],
)
def test_features_match_transformers(extractors, lengths):
    ours, ref = extractors
    waves = [_noise(n, seed=i) for i, n in enumerate(lengths)]
    expected = ref(waves, return_tensors="np")
    got = ours(waves)
    assert got.input_features.dtype == torch.float32 and got.input_features_mask.dtype == torch.bool
    assert np.array_equal(got.input_features.numpy(), expected["input_features"])
    assert np.array_equal(got.input_features_mask.numpy(), expected["input_features_mask"])
    # A batch of one is exactly a single waveform's features, so batching never changes results.
    if len(lengths) > 1:
        alone = ours([waves[0]])
        n = alone.input_features.shape[1]
        assert np.array_equal(got.input_features[0, :n].numpy(), alone.input_features[0].numpy())


def test_float64_and_single_array_input(extractors):
    ours, ref = extractors
    samples = _noise(12_345, dtype=np.float64)
    expected = ref([samples], return_tensors="np")["input_features"]
    assert np.array_equal(ours([samples]).input_features.numpy(), expected)
    # transformers' extractor crashes on a bare 1-D array; ours treats it as a batch of one.
    assert np.array_equal(ours(samples).input_features.numpy(), expected)


def test_audio_token_counts_agree_with_processor(extractors):
    ours, ref = extractors
    fake = SimpleNamespace(
        feature_extractor=ref, audio_seq_length=750, boa_token="[", eoa_token="]", audio_token="a"
    )
    lengths = [*range(0, 2000, 7), 16_000, 79_999, 80_000, 479_999, 480_000, 480_001, 600_000]
    for n in lengths:
        expected = Gemma4Processor._compute_audio_num_tokens(fake, np.zeros(n), SR)
        assert num_audio_soft_tokens(n) == expected, n
    # replace_audio_token derives the count from the padded mask instead; both routes agree.
    waves = [_noise(n, seed=n) for n in lengths if n > 0]
    mask = ours(waves).input_features_mask
    for i, samples in enumerate(waves):
        from_length = num_audio_soft_tokens(len(samples))
        assert num_audio_soft_tokens_from_mask(mask[i]) == from_length, len(samples)
        text = Gemma4Processor.replace_audio_token(fake, {"input_features_mask": mask.numpy()}, i)
        assert text.count("a") == from_length


@pytest.mark.parametrize(
    "bad, message",
    [
        ([], "no audio"),
        ([np.zeros(0, np.float32)], "no samples"),
        ([np.zeros((2, 100), np.float32)], "1-D"),
        ([np.zeros(100, np.int16)], "float"),
    ],
)
def test_bad_waveforms_raise(extractors, bad, message):
    with pytest.raises(ValueError, match=message):
        extractors[0](bad)


def test_load_wav_16k_is_exact(tmp_path, soundfile):
    wave = _noise(SR)
    path = tmp_path / "a.wav"
    soundfile.write(path, wave, SR, subtype="FLOAT")
    assert np.array_equal(load_audio(path), wave)
    assert np.array_equal(load_audio(path.read_bytes()), wave)
    assert np.array_equal(load_audio(str(path)), wave)


def test_load_wav_44k_stereo_resamples(soundfile):
    buffer = io.BytesIO()
    soundfile.write(buffer, _tone(2.0, 44_100, channels=2), 44_100, format="WAV")
    wave = load_audio(buffer.getvalue())
    assert wave.dtype == np.float32 and wave.ndim == 1
    assert len(wave) == math.ceil(2 * 44_100 * SR / 44_100) == 32_000
    assert _dominant_freq(wave, SR) == pytest.approx(440, abs=1)
    np.testing.assert_allclose(wave[200:-200], _tone(2.0, SR)[200:-200], atol=2e-3)


@pytest.mark.parametrize("fmt", ["FLAC", "OGG", "MP3"])
def test_load_compressed_formats(fmt, soundfile):
    buffer = io.BytesIO()
    soundfile.write(buffer, _tone(1.0, 22_050, channels=2), 22_050, format=fmt)
    wave = load_audio(buffer.getvalue())
    assert abs(len(wave) - SR) < 0.1 * SR  # codec priming/padding may add a few frames
    assert _dominant_freq(wave, SR) == pytest.approx(440, abs=2)
    assert 0.3 < np.abs(wave).max() < 0.7


def test_load_pyav_only_container():
    if "libopus" not in av.codecs_available:
        pytest.skip("no libopus")
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="webm") as container:
        stream = container.add_stream("libopus", rate=48_000, layout="mono")
        tone = _tone(1.0, 48_000)
        for start in range(0, len(tone), 960):
            frame = av.AudioFrame.from_ndarray(tone[None, start : start + 960], format="flt", layout="mono")
            frame.sample_rate = 48_000
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    wave = load_audio(buffer.getvalue())  # libsndfile cannot read webm: the PyAV fallback decodes it
    assert abs(len(wave) - SR) < 0.1 * SR
    assert _dominant_freq(wave, SR) == pytest.approx(440, abs=2)


@pytest.mark.parametrize("rate", [8_000, 22_050, 48_000, 16_001])
def test_resample_preserves_tones(rate):
    wave = resample(_tone(1.0, rate), rate, SR)
    assert len(wave) == SR
    np.testing.assert_allclose(wave[200:-200], _tone(1.0, SR)[200:-200], atol=2e-3)


@pytest.mark.parametrize("data", [b"", b"RIFF....WAVEgarbage" * 5, b"\xff\xfb" + bytes(300)])
def test_load_audio_garbage_raises(data):
    with pytest.raises(ValueError, match="could not decode audio|no samples"):
        load_audio(data)


def test_load_audio_empty_raises(soundfile):
    buffer = io.BytesIO()
    soundfile.write(buffer, np.zeros((0, 1), np.float32), SR, format="WAV")
    with pytest.raises(ValueError, match="no samples"):
        load_audio(buffer.getvalue())


def test_pyav_fallback_matches_soundfile(monkeypatch):
    buffer = io.BytesIO()
    pcm = (_noise(8_000) * 32767).astype("<i2")
    with wave_io.open(buffer, "wb") as w:
        w.setnchannels(2)
        w.setsampwidth(2)
        w.setframerate(SR)
        w.writeframes(np.repeat(pcm, 2).tobytes())
    expected = pcm.astype(np.float32) / 32768
    monkeypatch.setitem(sys.modules, "soundfile", None)  # import fails: PyAV decodes
    assert np.array_equal(load_audio(buffer.getvalue()), expected)
