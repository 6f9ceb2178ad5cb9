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

from g4serve.processing.limits import MediaBudget, MediaLimits, check_item_bytes, read_media_file

SAMPLING_RATE = 16_000
_MAX_KERNEL_ELEMENTS = 1 << 22
# Input windows one conv1d of `resample` unfolds at once (its im2col buffer, in floats): resampling 600 s of
# 48 kHz in one call unfolded 394M floats and grew the process by 760 MB; in pieces of 2**24, 250 MB, in
# the same time and to the same bits.
_MAX_UNFOLDED_ELEMENTS = 1 << 24
# Largest sample magnitude accepted. Float audio is nominally in [-1, 1]; PCM values stored as floats (up to
# 2**31) still make finite features, while NaN, infinities and values near float32's limit made the rFFT
# overflow and the log-mel features NaN (the model then answered <pad> tokens with NaN logprobs).
MAX_SAMPLE_MAGNITUDE = 2.0**32


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

    def _framing(self, length: int) -> tuple[int, int, np.ndarray]:
        """The semicausal framing of ``length`` samples: (the left padding, the samples one frame spans,
        the index in the unpadded signal of each frame's last window sample). A frame counts only if that
        sample is real audio."""
        pad_left = self.frame_length // 2
        size = self.frame_length + 1
        num_frames = max(0, (length + pad_left - size) // self.hop_length + 1)
        return pad_left, size, np.arange(num_frames) * self.hop_length + size - 1 - pad_left

    def _spectrogram(self, waveform: np.ndarray, num_valid: int) -> tuple[np.ndarray, np.ndarray]:
        # Keeps transformers' exact array shapes and dtypes ([1, L] float32 frames, float64 mel matmul) so the
        # FFT and BLAS take the same paths and produce the same bits.
        pad_left, size, frame_end = self._framing(len(waveform))
        if len(frame_end) == 0:
            return np.zeros((0, self.mel_filters.shape[1]), np.float32), np.zeros(0, bool)
        padded = np.pad(waveform[None, :], ((0, 0), (pad_left, 0)))
        frames = np.lib.stride_tricks.as_strided(
            padded,
            (1, len(frame_end), size),
            (padded.strides[0], padded.strides[1] * self.hop_length, padded.strides[1]),
        )[..., :-1]
        magnitude = np.abs(np.fft.rfft(frames * self.window, n=self.fft_length, axis=-1))
        log_mel = np.log(np.matmul(magnitude, self.mel_filters) + self.mel_floor)[0].astype(np.float32)
        mask = frame_end < num_valid
        return log_mel * mask[:, None], mask

    def _spectrograms_on(
        self, batch: list[np.ndarray], length: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``_spectrogram`` of each waveform, the batch at once in torch on ``device`` (``--media-on-gpu``):
        float32 frames times the window, a float32 rFFT as numpy's, its magnitudes times the float64 mel
        bank, so the features agree with the host's to float32 rounding. Features on ``device``, masks on the
        host."""
        pad_left, size, frame_end = self._framing(length)
        masks = torch.from_numpy(np.stack([frame_end < len(w) for w in batch]))
        if len(frame_end) == 0:
            return torch.zeros(len(batch), 0, self.mel_filters.shape[1], device=device), masks
        waves = torch.zeros(len(batch), pad_left + length, dtype=torch.float32)
        for i, w in enumerate(batch):
            waves[i, pad_left : pad_left + len(w)] = torch.from_numpy(w)
        frames = waves.to(device).unfold(-1, size, self.hop_length)[..., :-1]  # [B, frames, frame_length]
        window = torch.from_numpy(self.window).to(device)
        magnitude = torch.fft.rfft(frames * window, n=self.fft_length).abs()
        mel = torch.from_numpy(self.mel_filters).to(device)
        log_mel = torch.log(magnitude.double() @ mel + float(self.mel_floor)).float()
        return log_mel * masks.to(device)[..., None], masks

    def __call__(
        self, waveforms: np.ndarray | Sequence[np.ndarray], device: torch.device | str | None = None
    ) -> AudioFeatures:
        """Features for a batch of mono float waveforms at `sampling_rate` (one 1-D array = batch of one).
        ``device``: computed there with torch (``_spectrograms_on``); None: numpy, bit for bit as
        transformers."""
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
        if device is not None:
            return AudioFeatures(*self._spectrograms_on(batch, length, torch.device(device)))
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
    )[:, None]
    # Output frame j (``new`` samples) reads x[j * orig : j * orig + size]: the frames in pieces.
    size = kernel.shape[-1]
    frames = (x.shape[-1] - size) // orig + 1
    step = max(1, min((1 << 20) // new, _MAX_UNFOLDED_ELEMENTS // size))
    pieces = [
        torch.nn.functional.conv1d(
            x[..., j * orig : (min(frames, j + step) - 1) * orig + size], kernel, stride=orig
        )
        for j in range(0, frames, step)
    ]
    y = torch.cat(pieces, dim=-1).transpose(1, 2).reshape(-1)
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


# libsndfile formats read directly; anything else goes to PyAV, whose demuxers are whitelisted.
_SOUNDFILE_FORMATS = frozenset({"WAV", "WAVEX", "W64", "RF64", "FLAC", "OGG", "MP3", "AIFF", "CAF"})
# How files of those formats begin. libsndfile guesses a format from the bytes and parses its header before
# ``_SOUNDFILE_FORMATS`` is checked: only bytes that begin so reach it (not NIST, IRCAM, VOC, MAT4/5, PAF,
# XI, HTK, AVR, SVX, WVE, MPC2K, SDS, PVF or AU headers, which it also parses). Anything else goes to PyAV.
_SOUNDFILE_MAGIC = (b"RIFF", b"RIFX", b"RF64", b"BW64", b"riff", b"fLaC", b"OggS", b"caff", b"ID3")
_BLOCK_FRAMES = 1 << 16


class _NotForSoundfile(Exception):
    """libsndfile cannot (or may not) read these bytes: PyAV gets them."""


def check_sample_rate(rate: int, limits: MediaLimits) -> int:
    """``rate`` if it lies in the accepted range, else a ValueError naming the limits."""
    if isinstance(rate, (float, np.floating)) and math.isfinite(rate):
        rate = int(rate)  # as int() always took a float rate from the Python API
    if not isinstance(rate, (int, np.integer)) or isinstance(rate, bool):
        raise ValueError(f"audio sample rate must be a number of Hz, got {type(rate).__name__}")
    if not limits.audio_min_sample_rate <= rate <= limits.audio_max_sample_rate:
        raise ValueError(
            f"audio sample rate {int(rate)} Hz is outside {limits.audio_min_sample_rate}.."
            f"{limits.audio_max_sample_rate} Hz (audio_min_sample_rate, audio_max_sample_rate)"
        )
    return int(rate)


def _check_channels(channels: int, limits: MediaLimits) -> None:
    if channels > limits.audio_max_channels:
        raise ValueError(
            f"audio has {channels} channels, over the limit of {limits.audio_max_channels} "
            "(audio_max_channels)"
        )


def output_samples_cap(limits: MediaLimits, target_sr: int = SAMPLING_RATE) -> int:
    """Samples at ``target_sr`` kept of one clip: ``max_audio_seconds`` of them."""
    return math.ceil(limits.max_audio_seconds * target_sr)


def input_frames_needed(orig_sr: int, target_sr: int, limits: MediaLimits) -> int:
    """Source frames to decode so that resampling yields the first ``output_samples_cap`` samples exactly as
    resampling the whole clip would: the kept span plus the resampler's reach past it (both the sinc
    kernel and FFmpeg's filter), with room to spare."""
    out_cap = output_samples_cap(limits, target_sr)
    if orig_sr == target_sr:
        return out_cap
    gcd = math.gcd(orig_sr, target_sr)
    orig, new = orig_sr // gcd, target_sr // gcd
    width = math.ceil(6 * orig / (min(orig, new) * 0.99))
    margin = 2 * (width + orig) + 64 * math.ceil(orig_sr / target_sr) + 1024
    return math.ceil(out_cap * orig_sr / target_sr) + margin


def _frames_to_decode(orig_sr: int, target_sr: int, limits: MediaLimits) -> int:
    """Frames to read: what the kept seconds need, or one past the hard cap (reading it means too long)."""
    return min(input_frames_needed(orig_sr, target_sr, limits), limits.audio_max_frames + 1)


def _check_decoded_frames(n: int, limits: MediaLimits) -> None:
    if n > limits.audio_max_frames:
        raise ValueError(
            f"audio: more than {limits.audio_max_frames} sample frames to decode (audio_max_frames); "
            f"lower max_audio_seconds or send a lower sample rate"
        )


def _mono(chunk: np.ndarray) -> np.ndarray:
    """[C, n] float32 -> [n]: channels averaged (the same arithmetic on a block as on the whole clip)."""
    return chunk.mean(axis=0) if chunk.shape[0] > 1 else chunk[0]


def _decode_soundfile(data: bytes, target_sr: int, budget: MediaBudget) -> tuple[np.ndarray, int]:
    """Mono float32 and its rate, reading only the frames needed (every block charged to ``budget`` as it is
    read); ``_NotForSoundfile`` if libsndfile cannot read the bytes or the format is not one it is trusted
    with."""
    limits = budget.limits
    if not _may_be_for_soundfile(data):
        raise _NotForSoundfile
    try:
        import soundfile  # optional: without it PyAV decodes everything
    except ImportError:
        raise _NotForSoundfile from None
    try:
        f = soundfile.SoundFile(io.BytesIO(data))
    except (RuntimeError, TypeError, ValueError):  # LibsndfileError is a RuntimeError
        raise _NotForSoundfile from None
    with f:
        if f.format not in _SOUNDFILE_FORMATS:
            raise _NotForSoundfile
        sr = check_sample_rate(f.samplerate, limits)
        _check_channels(f.channels, limits)
        want = _frames_to_decode(sr, target_sr, limits)
        if 0 <= f.frames < want:
            want = f.frames
        budget.check_decoded_audio(want * f.channels)  # the header's length: refused before decoding
        blocks, got = [], 0
        while got < want:
            block = _read_block(f, min(_BLOCK_FRAMES, want - got))
            if len(block) == 0:
                break
            budget.charge_decoded_audio(block.size)  # a header may hide the length: counted as decoded
            blocks.append(_mono(block.T))
            got += len(block)
    _check_decoded_frames(got, limits)
    return (np.concatenate(blocks) if blocks else np.zeros(0, np.float32)), sr


def _may_be_for_soundfile(data: bytes) -> bool:
    """Whether ``data`` begins as a file of ``_SOUNDFILE_FORMATS`` does (MPEG audio: 11 sync bits)."""
    if data.startswith(_SOUNDFILE_MAGIC):
        return True
    if data.startswith(b"FORM"):
        return data[8:12] in (b"AIFF", b"AIFC")
    return len(data) > 1 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0


def _read_block(f, frames: int) -> np.ndarray:
    """Up to ``frames`` frames of an open ``soundfile.SoundFile``, [frames, channels] float32."""
    try:
        return f.read(frames, dtype="float32", always_2d=True)
    except (RuntimeError, TypeError, ValueError) as exc:  # LibsndfileError is a RuntimeError
        raise ValueError("could not decode audio: the data is corrupt or truncated") from exc


def ffmpeg_error(kind: str, exc: av.FFmpegError, demuxers: tuple[str, ...], opening: bool) -> ValueError:
    """A client-facing message for an FFmpeg failure: never a path, a file's existence or an object repr."""
    if opening and isinstance(exc, av.ArgumentError):
        # What avformat_open_input answers when the probed demuxer is not in format_whitelist.
        return ValueError(
            f"could not decode {kind}: format not allowed (allowed containers: {', '.join(demuxers)})"
        )
    if opening and isinstance(exc, av.InvalidDataError):
        return ValueError(f"could not decode {kind}: unrecognised or invalid data")
    reason = exc.strerror if isinstance(getattr(exc, "strerror", None), str) else type(exc).__name__
    return ValueError(f"could not decode {kind}: {reason}")


def open_media(
    data: bytes, kind: str, demuxers: tuple[str, ...], limits: MediaLimits
) -> av.container.InputContainer:
    """``av.open`` on in-memory bytes, allowing only ``demuxers`` and no protocols (so no demuxer can reach
    another file or URL), with bounded probing and decoder frame sizes."""
    try:
        return av.open(
            io.BytesIO(data),
            options=limits.codec_options(),
            container_options=limits.ffmpeg_options(demuxers),
        )
    except av.FFmpegError as exc:
        raise ffmpeg_error(kind, exc, demuxers, opening=True) from None
    except (OSError, ValueError):
        raise ValueError(f"could not decode {kind}: unrecognised or invalid data") from None


def _decode_pyav(data: bytes, target_sr: int, budget: MediaBudget) -> tuple[np.ndarray, int]:
    limits = budget.limits
    with open_media(data, "audio", limits.audio_demuxers, limits) as container:
        if not container.streams.audio:
            raise ValueError("could not decode audio: no audio stream")
        stream = container.streams.audio[0]
        if stream.codec_context is None:  # a codec FFmpeg has no decoder for (a WAV's unknown format tag)
            raise ValueError("could not decode audio: no decoder for its codec")
        if stream.rate:
            check_sample_rate(stream.rate, limits)
        if stream.channels:
            _check_channels(stream.channels, limits)
        try:
            chunks, sr = _decode_stream(container, stream, target_sr, budget)
        except av.FFmpegError as exc:
            raise ffmpeg_error("audio", exc, limits.audio_demuxers, opening=False) from None
    if sr is None or not chunks:
        return np.zeros(0, np.float32), sr or target_sr
    mono = np.concatenate(chunks)[: _frames_to_decode(sr, target_sr, limits)]
    _check_decoded_frames(len(mono), limits)
    return mono, sr


def _decode_stream(
    container, stream, target_sr: int, budget: MediaBudget
) -> tuple[list[np.ndarray], int | None]:
    """Mono chunks of the stream, decoding stopped as soon as the frames the kept seconds need are in (or
    the request's budget of decoded samples is spent)."""
    limits = budget.limits
    sr = stream.rate or None
    want = _frames_to_decode(sr, target_sr, limits) if sr else None
    # Only a sample-format change to packed float32; channels and rate stay as decoded. Packed: one plane.
    # PyAV finds a frame's planes by reading plane pointers until a null one, past the end of the pointers
    # of a planar frame with 8 or more channels: to_ndarray() of 7.1 audio crashed the process.
    to_float = av.AudioResampler(format="flt")
    chunks, got = [], 0
    for frame in container.decode(stream):
        check_sample_rate(frame.sample_rate, limits)
        _check_channels(frame.layout.nb_channels, limits)
        budget.charge_decoded_audio(frame.samples * frame.layout.nb_channels)
        if sr is None:
            sr = frame.sample_rate
            want = _frames_to_decode(sr, target_sr, limits)
        for f in to_float.resample(frame):
            chunks.append(_packed_mono(f))
            got += chunks[-1].shape[0]
        if got >= want:
            return chunks, sr
    chunks += [_packed_mono(f) for f in to_float.resample(None)]
    return chunks, sr


def _packed_mono(frame: av.AudioFrame) -> np.ndarray:
    """A packed float32 frame ([1, n x C] interleaved) -> [n] mono, averaged as ``_mono`` averages a
    libsndfile block (the same [n, C] layout, so the same bits)."""
    interleaved = frame.to_ndarray().reshape(-1, frame.layout.nb_channels)
    return _mono(interleaved.T)


def fit_waveform(
    mono: np.ndarray, sr: int, target_sr: int = SAMPLING_RATE, limits: MediaLimits | None = None
) -> np.ndarray:
    """A mono waveform at ``sr`` -> float32 at ``target_sr``, at most ``max_audio_seconds`` long: the rate is
    checked and the clip trimmed *before* resampling (to the span the kept seconds need), so neither a tiny
    nor a huge header rate can make resampling expensive."""
    limits = limits or MediaLimits()
    sr = check_sample_rate(sr, limits)
    want = input_frames_needed(sr, target_sr, limits)
    _check_decoded_frames(min(len(mono), want), limits)
    kept = check_samples(mono[:want])
    out = resample(kept, sr, target_sr)[: output_samples_cap(limits, target_sr)]
    return np.ascontiguousarray(out, dtype=np.float32)


def check_samples(wave: np.ndarray) -> np.ndarray:
    """``wave`` if every sample is a finite number within ``MAX_SAMPLE_MAGNITUDE``, else a ValueError."""
    # min/max propagate NaN, so one comparison each catches NaN, infinities and overflow.
    if wave.size and not (-MAX_SAMPLE_MAGNITUDE <= wave.min() and wave.max() <= MAX_SAMPLE_MAGNITUDE):
        raise ValueError(
            "audio samples must be finite numbers within +-2**32 (float audio is nominally in [-1, 1]); "
            "this audio holds NaN, an infinity or a larger value"
        )
    return wave


def load_audio(
    data: bytes | str | os.PathLike,
    target_sr: int = SAMPLING_RATE,
    limits: MediaLimits | None = None,
    budget: MediaBudget | None = None,
) -> np.ndarray:
    """Decode audio bytes or a file to float32 mono at `target_sr`, at most ``limits.max_audio_seconds``
    (default 30 s, what the model hears) of it. ``budget``: the request's, charged with every sample value
    (frames x channels) decoded; its limits are the ones applied (default: a budget of its own under
    ``limits``).

    libsndfile (soundfile) first, as transformers' soundfile backend does (wav, flac, ogg/vorbis/opus, mp3);
    anything it rejects (aac/m4a, webm, mp4 audio, ...) goes through PyAV/FFmpeg, restricted to the
    ``limits.audio_demuxers`` whitelist. A file is read into memory first (at most
    ``max_media_item_bytes``), so neither decoder ever opens a path. Only the frames the kept seconds need
    are decoded; the sample rate must lie in the accepted range, the samples must be finite (and within
    ``MAX_SAMPLE_MAGNITUDE``). Channels are averaged and the result is
    resampled with `resample` (torchaudio's sinc algorithm; transformers uses soxr, so resampled audio is
    close to, not identical with, transformers' loader).
    """
    budget = budget or MediaBudget(limits)
    limits = budget.limits
    if isinstance(data, (bytes, bytearray, memoryview)):
        data = bytes(data)
        check_item_bytes(len(data), limits.max_media_item_bytes)
    else:
        data = read_media_file(data, limits.max_media_item_bytes)
    try:
        mono, sr = _decode_soundfile(data, target_sr, budget)
    except _NotForSoundfile:
        mono, sr = _decode_pyav(data, target_sr, budget)
    if mono.size == 0:
        raise ValueError("audio contains no samples")
    return fit_waveform(mono, sr, target_sr, limits)
