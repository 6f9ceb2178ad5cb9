"""Voice-activity detection and end-pointing with silero-vad: streaming start/end events for PCM chunks, and
speech segments / trimming for whole files."""

from __future__ import annotations

import functools
import threading
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from g4serve_assistant.audio import SAMPLE_RATE

WINDOW = 512  # samples per model step at 16 kHz (32 ms); the model accepts nothing else
_CONTEXT = 64  # samples of the previous window the model sees in front of each window
_STATE_SHAPE = (2, 1, 128)  # LSTM (h, c) of the 16 kHz model


@dataclass
class VadEvent:
    kind: str  # 'start' | 'end'
    t_s: float  # stream time of the (padded) speech boundary, seconds since the last reset


@functools.cache
def _silero_core() -> torch.jit.ScriptModule:
    """The 16 kHz network of the packaged silero-vad model, loaded once per process.

    The packaged wrapper keeps the LSTM state and context inside the module, so one instance could not
    serve two streams; its inner network is a pure function (window, state) -> (prob, state), which we
    call with per-stream state instead. It holds no mutable state, so threads can share it.
    """
    from silero_vad import load_silero_vad

    with warnings.catch_warnings():
        # torch.jit.load's and importlib.resources' deprecations, raised inside silero-vad: not ours to fix.
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        model = load_silero_vad(onnx=False)
    return model._model


class VoiceActivityDetector:
    """silero-vad with per-instance state: one instance per audio stream (feed/reset are not thread-safe
    on one instance; instances on different threads are fine, they share only the read-only network).

    Streaming: `feed` any chunk length; it emits 'start' when a window crosses `threshold` and 'end' after
    `min_silence_ms` below `threshold - 0.15` (hysteresis, as silero's VADIterator), times padded by
    `speech_pad_ms`. Whole file: `speech_segments` / `trim` run a fresh state over the audio.
    """

    def __init__(
        self,
        threshold: float = 0.5,
        min_silence_ms: int = 500,
        speech_pad_ms: int = 100,
        min_speech_ms: int = 250,
    ) -> None:
        if not 0.0 < threshold < 1.0:
            raise ValueError(f"threshold must be in (0, 1), got {threshold}")
        self.threshold = threshold
        self.neg_threshold = max(threshold - 0.15, 0.01)
        self.min_silence_ms = min_silence_ms
        self.speech_pad_ms = speech_pad_ms
        self.min_speech_ms = min_speech_ms
        self._core = _silero_core()
        self._lock = threading.Lock()  # guards against accidental concurrent feed() on one instance
        self.reset()

    def reset(self) -> None:
        """Forget all audio: the next feed() starts a new stream at t = 0."""
        self._pending = np.zeros(0, dtype=np.float32)
        self._context = torch.zeros(1, _CONTEXT)
        self._state = torch.zeros(_STATE_SHAPE)
        self._samples_done = 0
        self._triggered = False
        self._silence_since: int | None = None

    @property
    def in_speech(self) -> bool:
        return self._triggered

    @property
    def stream_s(self) -> float:
        """Seconds of audio the model has consumed since the last reset."""
        return self._samples_done / SAMPLE_RATE

    def feed(self, chunk: np.ndarray) -> list[VadEvent]:
        """Consume float32 16 kHz samples; return the speech start/end events they complete."""
        samples = np.asarray(chunk, dtype=np.float32).reshape(-1)
        events: list[VadEvent] = []
        with self._lock:
            self._pending = np.concatenate([self._pending, samples])  # a copy: never a view of the caller's
            usable = self._pending.size - self._pending.size % WINDOW
            windows, self._pending = self._pending[:usable], self._pending[usable:].copy()
            pad = SAMPLE_RATE * self.speech_pad_ms // 1000
            min_silence = SAMPLE_RATE * self.min_silence_ms // 1000
            for start in range(0, usable, WINDOW):
                prob = self._step(windows[start : start + WINDOW])
                window_start, self._samples_done = self._samples_done, self._samples_done + WINDOW
                if prob >= self.threshold:
                    self._silence_since = None
                    if not self._triggered:
                        self._triggered = True
                        events.append(VadEvent("start", max(0, window_start - pad) / SAMPLE_RATE))
                elif prob < self.neg_threshold and self._triggered:
                    if self._silence_since is None:
                        self._silence_since = window_start
                    if self._samples_done - self._silence_since >= min_silence:
                        self._triggered = False
                        end = min(self._silence_since + pad, self._samples_done)
                        self._silence_since = None
                        events.append(VadEvent("end", end / SAMPLE_RATE))
        return events

    def speech_probabilities(self, audio: np.ndarray) -> np.ndarray:
        """Per-window speech probability over `audio` (zero-padded to whole windows), from a fresh state."""
        samples = np.asarray(audio, dtype=np.float32).reshape(-1)
        padded = np.pad(samples, (0, -samples.size % WINDOW))
        context, state = torch.zeros(1, _CONTEXT), torch.zeros(_STATE_SHAPE)
        probs = np.zeros(padded.size // WINDOW, dtype=np.float32)
        with torch.inference_mode():
            windows = torch.from_numpy(padded).reshape(-1, WINDOW)
            for i in range(windows.shape[0]):
                window = windows[i : i + 1]
                out, state = self._core(torch.cat([context, window], dim=1), state)
                context = window[:, -_CONTEXT:]
                probs[i] = float(out)
        return probs

    def speech_segments(self, audio: np.ndarray) -> list[tuple[float, float]]:
        """(start_s, end_s) of each speech segment in a whole recording, padded and merged like silero's
        get_speech_timestamps; segments shorter than `min_speech_ms` are dropped."""
        from silero_vad import get_speech_timestamps_from_probs

        samples = np.asarray(audio, dtype=np.float32).reshape(-1)
        if samples.size < WINDOW:
            return []
        probs = self.speech_probabilities(samples)
        stamps = get_speech_timestamps_from_probs(
            probs.tolist(),
            sampling_rate=SAMPLE_RATE,
            threshold=self.threshold,
            min_speech_duration_ms=self.min_speech_ms,
            min_silence_duration_ms=self.min_silence_ms,
            speech_pad_ms=self.speech_pad_ms,
            neg_threshold=self.neg_threshold,
            audio_length_samples=samples.size,
        )
        return [(s["start"] / SAMPLE_RATE, s["end"] / SAMPLE_RATE) for s in stamps]

    def trim(self, audio: np.ndarray) -> np.ndarray | None:
        """The span from the first speech start to the last speech end (with padding); None if no speech.

        One span rather than the concatenated segments: pauses inside a command ("send fifty ... to John")
        are left for the recogniser, which models silence better than a splice.
        """
        segments = self.speech_segments(audio)
        if not segments:
            return None
        start, end = round(segments[0][0] * SAMPLE_RATE), round(segments[-1][1] * SAMPLE_RATE)
        return np.ascontiguousarray(np.asarray(audio, dtype=np.float32).reshape(-1)[start:end])

    def _step(self, window: np.ndarray) -> float:
        with torch.inference_mode():
            x = torch.from_numpy(window)[None]
            out, self._state = self._core(torch.cat([self._context, x], dim=1), self._state)
            self._context = x[:, -_CONTEXT:].clone()
        return float(out)
