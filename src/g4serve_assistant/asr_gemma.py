"""Gemma 4 as the assistant's speech recogniser (``--asr gemma``): the utterance's audio goes to the served
model (the assistant's ``AsyncLLMEngine``) with the domain vocabulary in the prompt, and the model's greedy
text, cleaned, is the transcript. Only E2B/E4B have the audio tower this needs."""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
import unicodedata
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from g4serve_assistant.audio import SAMPLE_RATE
from g4serve_assistant.transcript import Transcript
from g4serve_assistant.vocabulary import AMOUNT_SLOT, NAME_SLOT, DomainVocabulary, spoken_words

log = logging.getLogger("g4serve_assistant")

NAME = "gemma"
DEFAULT_MAX_TOKENS = 64  # ~45 words: a spoken request is a sentence or two, never a paragraph
DEFAULT_TIMEOUT_S = 15.0
DEFAULT_MAX_CHARS = 240
# Payee names, aliases and domain words together; past this the list is cut (names first) so the prompt stays
# well inside the assistant's max_model_len beside 30 s of audio (750 soft tokens).
DEFAULT_MAX_VOCABULARY_CHARS = 4000
MAX_AUDIO_S = 30  # the model hears 30 s of a clip; the engine drops the rest, so it is not even sent

# The fixed instructions come first and the vocabulary (which changes only with the payees) after them, all in
# the system turn: the whole text before the audio is then one prefix the engine's prefix cache serves.
GEMMA_ASR_INSTRUCTIONS = """You are the speech recogniser of a bank's voice assistant. You hear one short \
spoken request of a customer and write down the words they said, in English, on one line.
Rules:
- Write only the words spoken: no quotes, no labels, no comments, no answer to the request.
- Write amounts with digits as usual ($50, $12.50, 20 euros).
- When you hear one of the payees below, spell the name exactly as listed.
- If you hear no speech, write nothing."""
GEMMA_ASR_REQUEST = "Transcribe this request:"

# Common English words of the intent phrasings that need no mention: what is left are the domain words.
_FUNCTION_WORDS = frozenset(
    """a an and are can did do from get go have how i i'd in is it let like me my need now of off on
    over please right show someone tell that that's the this to toward want was were what what's when
    you""".split()
)


def domain_words(vocab: DomainVocabulary) -> list[str]:
    """The words of the intent phrasings that carry meaning (balance, transfer, freeze, ...), in order."""
    words: dict[str, None] = {}
    for template in vocab.templates:
        for word in spoken_words(template.replace(AMOUNT_SLOT, " ").replace(NAME_SLOT, " ")):
            if word not in _FUNCTION_WORDS:
                words[word] = None
    return list(words)


def payee_aliases(vocab: DomainVocabulary) -> list[str]:
    """Spoken name forms that are not a payee's name or first name ("mom", "electric company"); the "my ..."
    forms the corpus adds are left out, as the alias says it."""
    derived = set()
    for name in vocab.payee_names:
        words = spoken_words(name)
        if words:
            derived.update((" ".join(words), words[0]))
    forms = [f for f in vocab.names if f not in derived]
    present = set(forms)
    return [f for f in forms if not (f.startswith("my ") and f.removeprefix("my ") in present)]


def vocabulary_text(vocab: DomainVocabulary, max_chars: int = DEFAULT_MAX_VOCABULARY_CHARS) -> str:
    """The prompt's vocabulary section: payee names as written, their aliases, the domain words; cut to
    ``max_chars`` (names first: they are what a general recogniser gets wrong)."""
    sections = [
        ("Payees", list(dict.fromkeys(n.strip() for n in vocab.payee_names if n.strip()))),
        ("Other names customers use for payees", payee_aliases(vocab)),
        ("Words customers often say", domain_words(vocab)),
    ]
    lines, used, dropped = [], 0, 0
    for title, items in sections:
        kept: list[str] = []
        for item in items:
            cost = len(item) + 2
            if used + cost > max_chars:
                dropped += 1
                continue
            kept.append(item)
            used += cost
        if kept:
            lines.append(f"{title}: {', '.join(kept)}.")
    if dropped:
        log.warning(
            "gemma ASR: %d vocabulary entries left out of the prompt (over %d characters)", dropped, max_chars
        )
    return "\n".join(lines)


def messages(vocab_text: str) -> list[dict[str, Any]]:
    system = GEMMA_ASR_INSTRUCTIONS + ("\n\n" + vocab_text if vocab_text else "")
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": [{"type": "text", "text": GEMMA_ASR_REQUEST}, {"type": "audio"}]},
    ]


# ---- cleaning the model's text ----------------------------------------------------------------------------
_LABEL = re.compile(
    r"^(?:here(?: is|'s) (?:the |a )?)?(?:transcript(?:ion)?|text|customer|user)\s*:\s*", re.I
)
_TAGS = re.compile(r"\[[^\]]*\]|<[^>]*>|\([^)]*\)|\{[^}]*\}")
# What the normalizer reads besides letters and digits: currency signs, decimal points and thousands commas,
# times (3:30), dates (2025-05-08), a minus before an amount ("-$50"), apostrophes in words, "&", "%", and
# the slash of "1/2" (without it "1/2 dollars" became "1 2 dollars": $2.00).
_KEEP = set("$£€¥₹.,:'-&%/")
_QUOTE_LIKE = str.maketrans({"\u2019": "'", "\u2018": "'", "\u02bc": "'"})
_LONE_APOSTROPHE = re.compile(r"(?<![^\W\d_])'|'(?![^\W\d_])")  # not between two letters
_END_PUNCT = re.compile(r"[.,:](?!\d)|(?<!\d)[.,:]")  # sentence punctuation; 12.50, 1,200 and 3:30 stay
_LONE_DASH = re.compile(r"(?<![\w])-(?![\w$£€¥₹])|(?<=\w)-(?!\w)")


def clean_transcript(text: str, max_chars: int = DEFAULT_MAX_CHARS) -> str:
    """The model's text as a transcript: its first non-empty line, without labels ("Transcription:"), tags
    ("[noise]", "(silence)"), quotes, markup, control or replacement characters, or punctuation the
    normalizer does not read; cut to ``max_chars`` at a word boundary."""
    text = "".join(
        ch
        if ch in "\n\t " or unicodedata.category(ch)[0] not in "CZ"
        else ("\n" if ch in "\r\u2028" else " ")
        for ch in text.replace("\ufffd", " ")
    )
    line = next((ln for ln in text.split("\n") if _clean_line(ln)), "")
    line = _clean_line(line)
    if len(line) > max_chars:
        cut = line[: max_chars + 1]
        line = cut.rsplit(" ", 1)[0] if " " in cut else cut[:max_chars]
    return line.strip()


def _clean_line(line: str) -> str:
    line = _TAGS.sub(" ", line.translate(_QUOTE_LIKE)).strip()
    line = _LABEL.sub("", line)
    line = "".join(ch if ch.isalnum() or ch.isspace() or ch in _KEEP else " " for ch in line)
    line = _LONE_APOSTROPHE.sub(" ", line)
    line = _END_PUNCT.sub(" ", line)
    line = _LONE_DASH.sub(" ", line)
    return " ".join(line.split())


# ---- which models can hear ------------------------------------------------------------------------------
def model_has_audio_tower(model: str | None) -> bool:
    """Whether the checkpoint directory or preset ``model`` (None: the embedded tiny model) has an audio
    tower, from its config alone (no weights are read). Raises ValueError for a name that is neither."""
    from g4serve.config import Gemma4Config, preset

    if model is None:
        return preset("tiny").audio is not None  # the embedded model is the tiny preset's config
    if Path(model).is_dir():  # a directory of a preset's name wins, as in the engine's loader
        return Gemma4Config.from_pretrained(model, strict=False).audio is not None
    return preset(model).audio is not None


def audio_engine_options(model: str | None) -> dict[str, Any]:
    """Engine config overrides for ``--asr gemma``: the audio tower loaded (one clip per prompt), no vision
    tower. Raises ValueError naming the model when it cannot hear (26b-a4b, 31b)."""
    if not model_has_audio_tower(model):
        raise ValueError(
            f"--asr gemma: the model {model} has no audio tower (only Gemma 4 E2B and E4B hear audio); "
            "use another --asr or an E2B/E4B model"
        )
    return {"text_only": False, "limit_mm_per_prompt": {"image": 0, "video": 0, "audio": 1}}


# ---- the recogniser -------------------------------------------------------------------------------------
class GemmaStream:
    """One utterance: ``feed`` buffers (Gemma hears whole utterances, so there are no partials) and
    ``finish`` sends the audio to the model. Not thread-safe: one stream per connection."""

    def __init__(self, recognizer: GemmaRecognizer, prompt: str) -> None:
        self._recognizer = recognizer
        self._prompt = prompt
        self._chunks: list[np.ndarray] = []
        self._kept = 0
        self._samples = 0
        self._done = False

    def feed(self, pcm: np.ndarray) -> str | None:
        if self._done:
            raise RuntimeError("feed() after finish()")
        samples = np.asarray(pcm, dtype=np.float32).reshape(-1)
        self._samples += samples.size
        room = MAX_AUDIO_S * SAMPLE_RATE - self._kept
        if room > 0 and samples.size:
            self._chunks.append(samples[:room].copy())  # the caller may reuse its buffer
            self._kept += min(room, samples.size)
        return None

    def close(self) -> None:
        """Abandon the utterance (client gone); nothing was sent yet, so nothing to cancel. Idempotent."""
        self._done = True
        self._chunks = []

    def finish(self) -> Transcript:
        if self._done:
            raise RuntimeError("finish() called twice")
        self._done = True
        start = time.perf_counter()
        audio = np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.float32)
        self._chunks = []
        text, error, details = (
            ("", None, {}) if audio.size == 0 else self._recognizer.recognize(self._prompt, audio)
        )
        return Transcript(
            text=text,
            recognizer=NAME,
            audio_s=self._samples / SAMPLE_RATE,
            decode_ms=(time.perf_counter() - start) * 1000.0,
            error=error,
            details=details,
        )


class GemmaRecognizer:
    """The served Gemma model as a recogniser, with the interface of ``asr.PocketSphinxRecognizer``.

    Its methods are synchronous and run on the assistant's audio thread, while the engine is asynchronous:
    each utterance is one request submitted with ``run_coroutine_threadsafe`` onto ``loop`` (the event loop
    serving the engine, when the caller has it) and waited for at most ``timeout_s``. Without ``loop`` the
    recogniser runs one of its own in a daemon thread: the assistant makes recognisers in worker threads
    (``asyncio.to_thread``), where no loop runs to capture, and ``AsyncLLMEngine`` streams to whichever loop
    made the request. A timeout or a failed request is an empty transcript with ``error`` set (the turn then
    asks the speaker to say it again); a dead engine raises, as the extraction call does. Greedy,
    ``max_tokens`` short, and stopped at the end of the first line. ``confidence`` is None: the model gives
    no calibrated one.
    """

    name = NAME

    def __init__(
        self,
        engine: Any,
        vocabulary: DomainVocabulary | None = None,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        max_chars: int = DEFAULT_MAX_CHARS,
        max_vocabulary_chars: int = DEFAULT_MAX_VOCABULARY_CHARS,
    ) -> None:
        if engine is None:
            raise ValueError(
                "asr gemma: needs the served model (an AsyncLLMEngine); it cannot run without one"
            )
        if timeout_s <= 0 or max_tokens < 1 or max_chars < 1:
            raise ValueError("asr gemma: timeout_s, max_tokens and max_chars must be positive")
        self.engine = engine
        self.timeout_s = timeout_s
        self.max_tokens = max_tokens
        self.max_chars = max_chars
        self.max_vocabulary_chars = max_vocabulary_chars
        self.vocabulary_version = -1
        self.prompt = ""
        self.update_vocabulary(vocabulary or DomainVocabulary.build([]))  # before a thread exists to leak
        if loop is None:
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=_serve_forever, args=(loop,), name="g4-asr-gemma", daemon=True)
            thread.start()
            # The thread holds the loop, not the recogniser: when the recogniser goes, its loop stops.
            weakref.finalize(self, _stop_loop, loop)
        self.loop = loop

    def update_vocabulary(self, vocab: DomainVocabulary) -> None:
        """Render the prompt with ``vocab``'s names and words; streams already open keep the prompt they
        started with (one attribute assignment: a stream on the audio thread reads either prompt whole)."""
        text = vocabulary_text(vocab, self.max_vocabulary_chars)
        self.prompt = self.engine.tokenizer.apply_chat_template(messages(text), add_generation_prompt=True)
        self.vocabulary_version = vocab.version

    def stream(self) -> GemmaStream:
        return GemmaStream(self, self.prompt)

    def transcribe(self, audio: np.ndarray) -> Transcript:
        """One whole utterance (trim it with the VAD first)."""
        stream = self.stream()
        stream.feed(audio)
        return stream.finish()

    def recognize(self, prompt: str, audio: np.ndarray) -> tuple[str, str | None, dict[str, Any]]:
        """(transcript, error or None, details) for float32 16 kHz ``audio``; blocks the calling thread,
        which must not be the event loop's own (it would wait on itself)."""
        if self.loop.is_closed():
            raise RuntimeError("asr gemma: the event loop that served the engine is closed")
        try:
            on_loop = asyncio.get_running_loop() is self.loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            raise RuntimeError(
                "asr gemma: called on the engine's event loop, which it would block; call it from a worker "
                "thread (Assistant.in_audio_thread)"
            )
        future = asyncio.run_coroutine_threadsafe(self._generate(prompt, audio), self.loop)
        try:
            raw, details = future.result(timeout=self.timeout_s)
        except TimeoutError:
            future.cancel()  # cancels the task there: closing its stream aborts the request in the engine
            log.warning("gemma ASR: no transcript within %.1f s; the request was aborted", self.timeout_s)
            return "", f"timed out after {self.timeout_s:g} s", {}
        except Exception as exc:
            if self.engine.dead is not None:
                raise  # the engine is gone: the turn fails as every other engine call then does
            log.warning("gemma ASR: the request failed: %s: %s", type(exc).__name__, exc)
            return "", f"{type(exc).__name__}: {exc}", {}
        return clean_transcript(raw, self.max_chars), None, details

    async def _generate(self, prompt: str, audio: np.ndarray) -> tuple[str, dict[str, Any]]:
        from g4serve.sampling_params import SamplingParams

        processed = await self.engine.process(
            {"prompt": prompt, "multi_modal_data": {"audio": (audio, SAMPLE_RATE)}}, add_special_tokens=False
        )
        params = SamplingParams(temperature=0.0, max_tokens=self.max_tokens)
        pieces: list[str] = []
        details: dict[str, Any] = {"prompt_tokens": len(processed.token_ids), "finish_reason": None}
        stream = self.engine.generate(processed, params)
        try:
            async for delta in stream:
                pieces.append(delta.text)
                details["output_tokens"] = delta.num_output_tokens
                details["cached_tokens"] = delta.num_cached_tokens
                if delta.finished:
                    details["finish_reason"] = delta.finish_reason
                elif _first_line_ended("".join(pieces)):
                    details["finish_reason"] = "first_line"  # anything after it is not the transcript
                    break
        finally:
            await stream.aclose()  # aborts the request when we stopped it early
        details["raw"] = "".join(pieces)
        return details["raw"], details


def _serve_forever(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        loop.close()


def _stop_loop(loop: asyncio.AbstractEventLoop) -> None:
    try:
        loop.call_soon_threadsafe(loop.stop)
    except RuntimeError:  # closed already
        pass


def _first_line_ended(text: str) -> bool:
    """Whether ``text`` holds a complete line that cleans to words (the line ``clean_transcript`` keeps)."""
    lines = text.split("\n")
    return any(_clean_line(line) for line in lines[:-1])


__all__ = [
    "GEMMA_ASR_INSTRUCTIONS",
    "GemmaRecognizer",
    "GemmaStream",
    "audio_engine_options",
    "clean_transcript",
    "domain_words",
    "model_has_audio_tower",
    "payee_aliases",
    "vocabulary_text",
]
