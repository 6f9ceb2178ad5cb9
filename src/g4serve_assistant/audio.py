"""Audio input for the voice assistant: WAV (bytes, base64, data: URL) and raw PCM16 chunks to float32 mono
16 kHz, with errors a caller can show to a user."""

from __future__ import annotations

import base64
import binascii
import io
import struct
import wave

import numpy as np

from g4serve.processing.audio import resample
from g4serve.processing.limits import MediaLimits

SAMPLE_RATE = 16000

_WAVE_FORMAT_PCM = 0x0001
_WAVE_FORMAT_IEEE_FLOAT = 0x0003
_WAVE_FORMAT_EXTENSIBLE = 0xFFFE
_MAX_CHANNELS = 16
# the server's default audio limits
_MIN_SAMPLE_RATE, _MAX_SAMPLE_RATE = MediaLimits.audio_min_sample_rate, MediaLimits.audio_max_sample_rate


class AudioError(ValueError):
    """Audio the assistant cannot use; the message says why in words a user can act on."""


def pcm16_bytes_to_float(chunk: bytes) -> np.ndarray:
    """Little-endian signed 16-bit PCM to float32 in [-1, 1] (the WebSocket streaming format)."""
    if len(chunk) % 2:
        raise AudioError(f"audio: PCM16 chunk has an odd number of bytes ({len(chunk)})")
    return np.frombuffer(chunk, dtype="<i2").astype(np.float32) / 32768.0


def encode_wav(audio: np.ndarray, sample_rate: int = SAMPLE_RATE) -> bytes:
    """Float mono (or [frames, channels]) audio to a PCM16 WAV file; clips to [-1, 1]."""
    samples = np.asarray(audio, dtype=np.float32)
    channels = 1 if samples.ndim == 1 else samples.shape[1]
    pcm = (np.clip(samples, -1.0, 1.0) * 32767.0).round().astype("<i2")
    out = io.BytesIO()
    with wave.open(out, "wb") as writer:
        writer.setnchannels(channels)
        writer.setsampwidth(2)
        writer.setframerate(sample_rate)
        writer.writeframes(pcm.tobytes())
    return out.getvalue()


def decode_wav(data: bytes, max_seconds: float = 30.0) -> np.ndarray:
    """A WAV file (PCM 8/16/24/32-bit or float32/64, any rate, any channel count) to float32 mono 16 kHz.

    Raises AudioError for anything else, for audio with no samples and for audio longer than `max_seconds`
    (checked from the header, before any samples are converted, so a huge upload costs nothing).
    """
    data = bytes(data)
    if len(data) < 12 or data[:4] not in (b"RIFF", b"RF64") or data[8:12] != b"WAVE":
        raise AudioError("audio: not a WAV file (expected a RIFF/WAVE header)")
    fmt: tuple[int, int, int, int] | None = None
    payload: bytes | None = None
    pos = 12
    while pos + 8 <= len(data):
        chunk_id = data[pos : pos + 4]
        (size,) = struct.unpack_from("<I", data, pos + 4)
        body = data[pos + 8 : pos + 8 + size]
        if chunk_id == b"fmt ":
            fmt = _parse_fmt(body)
        elif chunk_id == b"data":
            # Streaming writers leave the size 0 or 0xFFFFFFFF; a truncated file ends early: take what is
            # there.
            payload = data[pos + 8 :] if size in (0, 0xFFFFFFFF) else body
            break
        pos += 8 + size + (size & 1)  # chunks are word-aligned
    if fmt is None:
        raise AudioError("audio: WAV file has no 'fmt ' chunk")
    if payload is None:
        raise AudioError("audio: WAV file has no 'data' chunk")
    format_tag, channels, sample_rate, bits = fmt
    frame_bytes = channels * (bits // 8)
    frames = len(payload) // frame_bytes
    if frames == 0:
        raise AudioError("audio: empty (no samples)")
    duration_s = frames / sample_rate
    if duration_s > max_seconds:
        raise AudioError(f"audio: longer than {max_seconds:g} s ({duration_s:.1f} s); send a shorter clip")
    samples = _to_float(payload[: frames * frame_bytes], format_tag, bits).reshape(frames, channels)
    mono = samples.mean(axis=1) if channels > 1 else samples[:, 0]
    mono = np.nan_to_num(mono, nan=0.0, posinf=1.0, neginf=-1.0)
    return np.ascontiguousarray(resample(mono, sample_rate, SAMPLE_RATE), dtype=np.float32)


def decode_base64_wav(b64: str, max_seconds: float = 30.0) -> np.ndarray:
    """Base64 WAV, bare or as a data: URL (`data:audio/wav;base64,...`), to float32 mono 16 kHz."""
    text = b64.strip()
    if text.startswith("data:"):
        header, sep, text = text.partition(",")
        if not sep or ";base64" not in header:
            raise AudioError("audio: data URL must be base64-encoded (data:audio/wav;base64,...)")
    if not text:
        raise AudioError("audio: empty")
    try:
        raw = base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError) as error:
        raise AudioError(f"audio: not valid base64 ({error})") from None
    return decode_wav(raw, max_seconds=max_seconds)


def _parse_fmt(body: bytes) -> tuple[int, int, int, int]:
    if len(body) < 16:
        raise AudioError("audio: WAV 'fmt ' chunk is truncated")
    format_tag, channels, sample_rate, _, _, bits = struct.unpack_from("<HHIIHH", body)
    if format_tag == _WAVE_FORMAT_EXTENSIBLE and len(body) >= 26:
        # The real format is the first two bytes of the SubFormat GUID.
        (format_tag,) = struct.unpack_from("<H", body, 24)
    if format_tag not in (_WAVE_FORMAT_PCM, _WAVE_FORMAT_IEEE_FLOAT):
        raise AudioError(f"audio: unsupported WAV encoding 0x{format_tag:04x}; send PCM or float WAV")
    if not _MIN_SAMPLE_RATE <= sample_rate <= _MAX_SAMPLE_RATE:
        # (a header's 2^31 Hz gave a 500 from the resampler; 100 MHz, 5 s and 730 MB on the audio thread)
        raise AudioError(
            f"audio: sample rate {sample_rate} Hz outside {_MIN_SAMPLE_RATE}-{_MAX_SAMPLE_RATE} Hz"
        )
    if not 1 <= channels <= _MAX_CHANNELS:
        raise AudioError(f"audio: {channels} channels")
    valid_bits = (8, 16, 24, 32) if format_tag == _WAVE_FORMAT_PCM else (32, 64)
    if bits not in valid_bits:
        raise AudioError(f"audio: unsupported sample size {bits} bits")
    return format_tag, channels, sample_rate, bits


def _to_float(payload: bytes, format_tag: int, bits: int) -> np.ndarray:
    if format_tag == _WAVE_FORMAT_IEEE_FLOAT:
        return np.frombuffer(payload, dtype="<f4" if bits == 32 else "<f8").astype(np.float32)
    if bits == 8:  # 8-bit WAV is unsigned
        return (np.frombuffer(payload, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    if bits == 24:
        raw = np.frombuffer(payload, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        ints = raw[:, 0] | (raw[:, 1] << 8) | (raw[:, 2] << 16)
        ints = np.where(ints >= 1 << 23, ints - (1 << 24), ints)
        return ints.astype(np.float32) / float(1 << 23)
    dtype = "<i2" if bits == 16 else "<i4"
    return np.frombuffer(payload, dtype=dtype).astype(np.float32) / float(1 << (bits - 1))
