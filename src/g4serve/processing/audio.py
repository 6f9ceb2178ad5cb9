"""Gemma 4 audio preprocessing: decoding/resampling to 16 kHz mono and the log-mel front end,
bit-identical to transformers' Gemma4AudioFeatureExtractor with its default settings."""

from __future__ import annotations

import io
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import av
import numpy as np
import torch

SAMPLING_RATE = 16_000
_MAX_KERNEL_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class AudioFeatures:
    input_features: torch.Tensor  # float32 [B, T, num_mel_bins]; zero on padded frames
    input_features_mask: torch.Tensor  # bool [B, T]; True for frames fully inside the real audio


def mel_filter_bank(
    num_frequency_bins: int,
    num_mel_filters: int,
    min_frequency: float,
    max_frequency: float,
    sampling_rate: int,
) -> np.ndarray:
    """HTK-scale triangular filters without normalisation, float64 [num_frequency_bins, num_mel_filters].

    Same formula (and operation order, so the same bits) as transformers.audio_utils.mel_filter_bank with
    mel_scale="htk", norm=None.
    """
    mel_min, mel_max = (2595.0 * np.log10(1.0 + f / 700.0) for f in (min_frequency, max_frequency))
    mel_points = np.linspace(mel_min, mel_max, num_mel_filters + 2)
    filter_freqs = 700.0 * (np.power(10, mel_points / 2595.0) - 1.0)
    fft_freqs = np.linspace(0, sampling_rate // 2, num_frequency_bins)
    filter_diff = np.diff(filter_freqs)
    slopes = filter_freqs[None, :] - fft_freqs[:, None]
    down = -slopes[:, :-2] / filter_diff[:-1]
    up = slopes[:, 2:] / filter_diff[1:]
    return np.maximum(np.zeros(1), np.minimum(down, up))


class AudioFeatureExtractor:
    """Log-mel features: semicausal framing, periodic Hann window, |rFFT|, HTK mel bank, log(mel + floor).

    Waveforms are truncated to `max_length` samples, right-padded with zeros to the batch's longest rounded up
    to `pad_to_multiple_of`, and a frame is valid only if its whole analysis window lies in real audio.
    """

    def __init__(
        self,
        sampling_rate: int = SAMPLING_RATE,
        num_mel_bins: int = 128,
        frame_length_ms: float = 20.0,
        hop_length_ms: float = 10.0,
        min_frequency: float = 0.0,
        max_frequency: float = 8000.0,
        mel_floor: float = 1e-3,
        max_length: int = 480_000,
        pad_to_multiple_of: int = 128,
    ):
        self.sampling_rate = sampling_rate
        self.frame_length = round(sampling_rate * frame_length_ms / 1000.0)
        self.hop_length = round(sampling_rate * hop_length_ms / 1000.0)
        self.fft_length = 2 ** math.ceil(math.log2(self.frame_length))
        self.max_length = max_length
        self.pad_to_multiple_of = pad_to_multiple_of
        self.mel_floor = np.array(mel_floor, dtype=np.float64)
        # Periodic Hann: the first `frame_length` points of a symmetric window one sample longer.
        self.window = np.hanning(self.frame_length + 1)[:-1].astype(np.float32)
        self.mel_filters = mel_filter_bank(
            self.fft_length // 2 + 1, num_mel_bins, min_frequency, max_frequency, sampling_rate
        )

    def _truncate_length(self) -> int:
        return -(-self.max_length // self.pad_to_multiple_of) * self.pad_to_multiple_of

    def _spectrogram(self, waveform: np.ndarray, num_valid: int) -> tuple[np.ndarray, np.ndarray]:
        # Keeps transformers' exact array shapes and dtypes ([1, L] float32 frames, float64 mel matmul) so the
        # FFT and BLAS take the same paths and produce the same bits.
        pad_left = self.frame_length // 2
        padded = np.pad(waveform[None, :], ((0, 0), (pad_left, 0)))
        size = self.frame_length + 1
        num_frames = (padded.shape[1] - size) // self.hop_length + 1
        if num_frames <= 0:
            return np.zeros((0, self.mel_filters.shape[1]), np.float32), np.zeros(0, bool)
        frames = np.lib.stride_tricks.as_strided(
            padded,
            (1, num_frames, size),
            (padded.strides[0], padded.strides[1] * self.hop_length, padded.strides[1]),
        )[..., :-1]
        magnitude = np.abs(np.fft.rfft(frames * self.window, n=self.fft_length, axis=-1))
        log_mel = np.log(np.matmul(magnitude, self.mel_filters) + self.mel_floor)[0].astype(np.float32)
        # A frame counts only if the last sample of its window is real audio.
        frame_end = np.arange(num_frames) * self.hop_length + size - 1 - pad_left
        mask = frame_end < num_valid
        return log_mel * mask[:, None], mask

    def __call__(self, waveforms: np.ndarray | Sequence[np.ndarray]) -> AudioFeatures:
        """Features for a batch of mono float waveforms at `sampling_rate` (one 1-D array = batch of one)."""
        if isinstance(waveforms, np.ndarray) and waveforms.ndim == 1:
            waveforms = [waveforms]
        if len(waveforms) == 0:
            raise ValueError("no audio given")
        batch = []
        for i, w in enumerate(waveforms):
            w = np.asarray(w)
            if w.ndim != 1:
                raise ValueError(f"audio {i}: expected a 1-D mono waveform, got shape {w.shape}")
            if w.size == 0:
                raise ValueError(f"audio {i} has no samples")
            if not np.issubdtype(w.dtype, np.floating):
                raise ValueError(
                    f"audio {i}: expected float samples in [-1, 1], got {w.dtype} (scale PCM first)"
                )
            batch.append(w[: self._truncate_length()].astype(np.float32))
        longest = max(len(w) for w in batch)
        length = -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of
        features, masks = zip(*(self._spectrogram(np.pad(w, (0, length - len(w))), len(w)) for w in batch))
        return AudioFeatures(torch.from_numpy(np.stack(features)), torch.from_numpy(np.stack(masks)))


def num_audio_soft_tokens(
    num_samples: int, audio_seq_length: int = 750, frame_length: int = 320, hop_length: int = 160
) -> int:
    """Gemma4Processor._compute_audio_num_tokens: valid mel frames through two stride-2 convs, capped."""
    t = (num_samples + frame_length // 2 - (frame_length + 1)) // hop_length + 1
    if t <= 0:
        return 0
    for _ in range(2):  # conv kernel 3, stride 2, padding 1
        t = (t + 2 - 3) // 2 + 1
    return min(t, audio_seq_length)


def num_audio_soft_tokens_from_mask(mask: torch.Tensor | np.ndarray) -> int:
    """Gemma4Processor.replace_audio_token's count: subsample the frame mask as the two convs do."""
    mask = np.asarray(mask)
    for _ in range(2):
        mask = mask[::2][: (len(mask) - 1) // 2 + 1]
    return int(mask.sum())


def resample(waveform: np.ndarray, orig_sr: int, target_sr: int) -> np.ndarray:
    """Band-limited sinc resampling (Hann window, 6 zero crossings, rolloff 0.99).

    The algorithm and defaults of torchaudio.functional.resample, written in plain torch; output length is
    ceil(len * target_sr / orig_sr).
    """
    if orig_sr <= 0 or target_sr <= 0:
        raise ValueError(f"sample rates must be positive, got {orig_sr} -> {target_sr}")
    if orig_sr == target_sr:
        return waveform
    gcd = math.gcd(orig_sr, target_sr)
    orig, new = orig_sr // gcd, target_sr // gcd
    zero_crossings, rolloff = 6, 0.99
    base = min(orig, new) * rolloff
    width = math.ceil(zero_crossings * orig / base)
    if new * (2 * width + orig) > _MAX_KERNEL_ELEMENTS:
        return _resample_ffmpeg(waveform, orig_sr, target_sr)
    # One filter phase per output sample modulo `new`, each spanning the input window around it.
    idx = torch.arange(-width, width + orig, dtype=torch.float32)[None, None] / orig
    t = (torch.arange(0, -new, -1, dtype=torch.float32)[:, None, None] / new + idx) * base
    t = t.clamp_(-zero_crossings, zero_crossings)
    window = torch.cos(t * math.pi / zero_crossings / 2) ** 2
    t *= math.pi
    kernel = torch.where(t == 0, torch.tensor(1.0), t.sin() / t) * (window * (base / orig))
    x = torch.nn.functional.pad(
        torch.from_numpy(np.ascontiguousarray(waveform, np.float32))[None], (width, width + orig)
    )
    y = torch.nn.functional.conv1d(x[:, None], kernel, stride=orig).transpose(1, 2).reshape(-1)
    return y[: math.ceil(new * len(waveform) / orig)].numpy()


def _resample_ffmpeg(waveform: np.ndarray, orig_sr: int, target_sr: int) -> np.ndarray:
    # Fallback for near-coprime rate pairs, whose exact polyphase kernel would need gigabytes.
    frame = av.AudioFrame.from_ndarray(
        np.ascontiguousarray(waveform, np.float32)[None], format="fltp", layout="mono"
    )
    frame.sample_rate = orig_sr
    resampler = av.AudioResampler(format="fltp", layout="mono", rate=target_sr)
    chunks = [f.to_ndarray()[0] for f in resampler.resample(frame) + resampler.resample(None)]
    out = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
    n = math.ceil(len(waveform) * target_sr / orig_sr)
    return np.pad(out, (0, max(0, n - len(out))))[:n]


def _decode_soundfile(data: io.BytesIO | str) -> tuple[np.ndarray, int]:
    import soundfile  # optional: without it PyAV decodes everything

    with soundfile.SoundFile(data) as f:
        return f.read(dtype="float32", always_2d=True).T, f.samplerate


def _decode_pyav(data: io.BytesIO | str) -> tuple[np.ndarray, int]:
    with av.open(data) as container:
        if not container.streams.audio:
            raise ValueError("no audio stream")
        stream = container.streams.audio[0]
        # Only a sample-format change to planar float32; channels and rate stay as decoded.
        to_float = av.AudioResampler(format="fltp")
        chunks = [f.to_ndarray() for frame in container.decode(stream) for f in to_float.resample(frame)]
        chunks += [f.to_ndarray() for f in to_float.resample(None)]
        if not chunks:
            return np.zeros((1, 0), np.float32), stream.rate
        return np.concatenate(chunks, axis=1), stream.rate


def load_audio(data: bytes | str | os.PathLike, target_sr: int = SAMPLING_RATE) -> np.ndarray:
    """Decode audio bytes or a file to float32 mono at `target_sr`.

    libsndfile (soundfile) first, as transformers' soundfile backend does (wav, flac, ogg/vorbis/opus, mp3);
    anything it rejects (aac/m4a, webm, mp4 audio, ...) goes through PyAV/FFmpeg. Channels are averaged and
    the result is resampled with `resample` (torchaudio's sinc algorithm; transformers uses soxr, so
    resampled audio is close to, not identical with, transformers' loader).
    """

    def source() -> io.BytesIO | str:
        return (
            io.BytesIO(bytes(data)) if isinstance(data, (bytes, bytearray, memoryview)) else os.fspath(data)
        )

    try:
        waveform, sr = _decode_soundfile(source())
    except (ImportError, RuntimeError, TypeError) as sf_error:  # LibsndfileError is a RuntimeError
        try:
            waveform, sr = _decode_pyav(source())
        except (av.FFmpegError, OSError, ValueError) as av_error:
            raise ValueError(f"could not decode audio: {av_error} (soundfile: {sf_error})") from av_error
    if waveform.size == 0:
        raise ValueError("audio contains no samples")
    mono = waveform.mean(axis=0) if waveform.shape[0] > 1 else waveform[0]
    return np.ascontiguousarray(resample(mono, sr, target_sr), dtype=np.float32)
