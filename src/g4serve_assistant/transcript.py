"""What every speech recogniser of the assistant returns and how it is driven (pocketsphinx in asr.py, the
served Gemma in asr_gemma.py): a ``Transcript``, a ``RecognizerStream`` and the ``Recognizer`` protocol."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from g4serve_assistant.vocabulary import DomainVocabulary


@dataclass
class Transcript:
    text: str
    partials: list[str] = field(default_factory=list)  # each distinct partial hypothesis, in order
    confidence: float | None = None  # in [0, 1]: mean word posterior, when the recogniser has one
    recognizer: str = ""
    audio_s: float = 0.0
    decode_ms: float = 0.0  # processing time spent in the recogniser, summed over feed() and finish()
    words: list[tuple[str, float]] = field(default_factory=list)  # (word, posterior) when available
    error: str | None = None  # why the text is empty when the recogniser failed (gemma: timeout, request)
    details: dict[str, Any] = field(default_factory=dict)  # recogniser-specific (gemma: tokens, raw output)


class RecognizerStream(Protocol):
    def feed(self, pcm: np.ndarray) -> str | None:
        """Take float32 16 kHz audio; return the new partial transcript if it changed, else None."""
        ...

    def finish(self) -> Transcript:
        """End the utterance and return the final transcript; the stream cannot be fed afterwards."""
        ...


class Recognizer(Protocol):
    name: str

    def stream(self) -> RecognizerStream: ...

    def transcribe(self, audio: np.ndarray) -> Transcript: ...

    def update_vocabulary(self, vocab: DomainVocabulary) -> None: ...
