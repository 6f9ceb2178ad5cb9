"""Speech recognition for the voice assistant: a recogniser interface with streaming partial transcripts and
the default offline recogniser, pocketsphinx, biased toward the banking domain by an n-gram LM (or a JSGF
grammar) and a pronunciation dictionary built at run time from a DomainVocabulary."""

from __future__ import annotations

import functools
import math
import os
import re
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from g4serve_assistant.audio import SAMPLE_RATE
from g4serve_assistant.transcript import Recognizer, RecognizerStream, Transcript
from g4serve_assistant.vocabulary import AMOUNT_SLOT, NAME_SLOT, DomainVocabulary, spoken_words

__all__ = ["Recognizer", "RecognizerStream", "Transcript", "make_recognizer"]

MODES = ("lm", "jsgf", "general")
_LEAD_SAMPLES = SAMPLE_RATE // 5  # 200 ms of silence around each utterance


# --------------------------------------------------------------------------------------------------------
# Pronunciations


@functools.cache
def _cmudict(path: str) -> dict[str, tuple[str, ...]]:
    """word -> pronunciations, parsed once per process (read-only after that, so safe to share)."""
    prons: dict[str, list[str]] = defaultdict(list)
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            head, _, phones = line.strip().partition(" ")
            if phones:
                prons[re.sub(r"\(\d+\)$", "", head)].append(phones.split("#")[0].strip())
    return {word: tuple(p) for word, p in prons.items()}


# Multi-letter spellings -> ARPAbet, each before any spelling it starts with ("tch" before "ch"). Tuned for
# names (many not English), which is what the dictionary lacks: vowels get their "continental" values
# (Priya, Maria, Okonkwo) rather than English ones.
_GRAPHEMES: tuple[tuple[str, str], ...] = (
    ("tch", "CH"),
    ("sch", "SH"),
    ("ph", "F"),
    ("sh", "SH"),
    ("ch", "CH"),
    ("th", "TH"),
    ("ng", "NG"),
    ("ck", "K"),
    ("qu", "K W"),
    ("wh", "W"),
    ("kh", "K"),
    ("zh", "ZH"),
    ("dh", "D"),
    ("bh", "B"),
    ("gh", "G"),
    ("xi", "SH IY"),
    ("ee", "IY"),
    ("ea", "IY"),
    ("oo", "UW"),
    ("ou", "AW"),
    ("ow", "OW"),
    ("oi", "OY"),
    ("oy", "OY"),
    ("ai", "AY"),
    ("ay", "EY"),
    ("ei", "EY"),
    ("ey", "EY"),
    ("ie", "IY"),
    ("au", "AO"),
    ("aw", "AO"),
    ("ue", "UW"),
    ("ao", "AW"),
)
_ENDINGS = {"or": "ER", "er": "ER", "ah": "AH"}
_LETTERS = {
    "a": "AA",
    "b": "B",
    "d": "D",
    "f": "F",
    "j": "JH",
    "k": "K",
    "l": "L",
    "m": "M",
    "n": "N",
    "o": "OW",
    "p": "P",
    "q": "K",
    "r": "R",
    "s": "S",
    "t": "T",
    "u": "UW",
    "v": "V",
    "w": "W",
    "x": "K S",
    "z": "Z",
}
_VOWELS = set("aeiouy")


def guess_pronunciation(word: str) -> str:  # noqa: C901 - letter-to-sound rules, one branch per rule in the order they apply
    """A letter-to-sound guess in the en-us model's phone set, for words the dictionary lacks.

    Rules, not a trained g2p (pocketsphinx 5 ships none): good enough for the recogniser to match a name
    it is told to expect, which is all the LM/grammar needs; wrong stress or vowel quality costs little.
    """
    letters = re.sub(r"[^a-z]", "", word.lower())
    phones: list[str] = []
    i = 0
    while i < len(letters):
        rest, prev = letters[i:], letters[i - 1] if i else ""
        nxt = letters[i + 1] if i + 1 < len(letters) else ""
        if i and letters[i] == prev and letters[i] not in _VOWELS:
            i += 1  # doubled consonant: one sound ("Patell", "Anna")
            continue
        ch = letters[i]
        if rest in _ENDINGS:  # unstressed endings English speakers reduce ("Okafor", "Schneider", "Aisha")
            phones.extend(_ENDINGS[rest].split())
            break
        digraph = next((g for g in _GRAPHEMES if len(g[0]) > 1 and rest.startswith(g[0])), None)
        if digraph is not None:
            phones.append(digraph[1])
            i += len(digraph[0])
            continue
        if ch == "c":
            phones.append("S" if nxt in ("e", "i", "y") else "K")
        elif ch == "g":
            phones.append("JH" if nxt in ("e", "i", "y") and i else "G")
        elif ch == "h":
            if not prev or nxt in _VOWELS:
                phones.append("HH")  # otherwise silent ("Johnson")
        elif ch == "y":
            phones.append("Y" if nxt in _VOWELS and nxt != "y" else "IY")
        elif ch == "e" and i == len(letters) - 1 and i >= 2 and prev not in _VOWELS:
            pass  # silent final e ("Jane", "Mike")
        elif ch == "e":
            phones.append("EH")
        elif ch == "i":
            # i before a vowel or a single consonant + vowel is long (Priya, Tina); before a cluster short.
            short = len(rest) >= 3 and rest[1] not in _VOWELS and rest[2] not in _VOWELS
            phones.append("IH" if short else "IY")
        else:
            phones.extend(_LETTERS.get(ch, "").split())
        i += 1
    return " ".join(phones) or "AH"


def pronunciations(words: Iterable[str], dict_path: str) -> dict[str, tuple[str, ...]]:
    """Pronunciations for `words`: every cmudict variant, else a letter-to-sound guess."""
    cmudict = _cmudict(dict_path)
    out: dict[str, tuple[str, ...]] = {}
    for word in sorted(set(words)):
        known = cmudict.get(word)
        if known is None and "'" in word:
            known = cmudict.get(word.replace("'", ""))
        out[word] = known or (guess_pronunciation(word),)
    return out


def dictionary_text(prons: dict[str, tuple[str, ...]]) -> str:
    lines = []
    for word, variants in prons.items():
        for k, phones in enumerate(variants):
            lines.append(f"{word} {phones}" if k == 0 else f"{word}({k + 1}) {phones}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------------
# Language model and grammar


def arpa_from_phrases(weighted_phrases: Iterable[tuple[str, float]], order: int = 3) -> str:  # noqa: C901 - one pass of the Witten-Bell estimator; splitting it would spread one formula over helpers
    """A backoff n-gram LM in ARPA format, Witten-Bell discounted, from weighted sentences.

    Witten-Bell because it needs no count-of-counts statistics (which a small synthetic corpus distorts)
    and copes with fractional counts. Weights are scaled so the rarest sentence counts 1: the type counts
    of Witten-Bell are then comparable with token counts.
    """
    phrases = [(p.split(), w) for p, w in weighted_phrases if p.split() and w > 0]
    if not phrases:
        raise ValueError("cannot build a language model from no phrases")
    scale = 1.0 / min(w for _, w in phrases)
    counts: list[dict[tuple[str, ...], float]] = [defaultdict(float) for _ in range(order + 1)]
    for words, weight in phrases:
        tokens = ["<s>", *words, "</s>"]
        for n in range(1, order + 1):
            for i in range(len(tokens) - n + 1):
                gram = tuple(tokens[i : i + n])
                if gram != ("<s>",):
                    counts[n][gram] += weight * scale
    # History statistics: total count and number of distinct followers.
    hist_total: dict[tuple[str, ...], float] = defaultdict(float)
    hist_types: dict[tuple[str, ...], int] = defaultdict(int)
    for n in range(2, order + 1):
        for gram, c in counts[n].items():
            hist_total[gram[:-1]] += c
            hist_types[gram[:-1]] += 1

    total_unigrams = sum(counts[1].values())
    prob: list[dict[tuple[str, ...], float]] = [{} for _ in range(order + 1)]
    prob[1] = {g: c / total_unigrams for g, c in counts[1].items()}
    for n in range(2, order + 1):
        for gram, c in counts[n].items():
            h = gram[:-1]
            prob[n][gram] = c / (hist_total[h] + hist_types[h])

    def backoff_prob(gram: tuple[str, ...]) -> float:
        # P(w | h) from the model as written, recursing through backoff weights.
        if len(gram) == 1:
            return prob[1].get(gram, 0.0)
        if gram in prob[len(gram)]:
            return prob[len(gram)][gram]
        return alpha.get(gram[:-1], 1.0) * backoff_prob(gram[1:])

    alpha: dict[tuple[str, ...], float] = {}
    followers: dict[tuple[str, ...], list[str]] = defaultdict(list)
    for n in range(2, order + 1):
        for gram in counts[n]:
            followers[gram[:-1]].append(gram[-1])
    for n in range(1, order):  # lower orders first: backoff_prob of order n+1 needs alpha of order n
        for h in [g for g in followers if len(g) == n]:
            seen = followers[h]
            left = 1.0 - sum(prob[n + 1][(*h, w)] for w in seen)
            lower = 1.0 - sum(backoff_prob((*h[1:], w)) for w in seen)
            alpha[h] = left / lower if lower > 1e-12 else 1.0

    def log10(p: float) -> str:
        return f"{math.log10(p):.6f}" if p > 0 else "-99.000000"

    unigrams = [("<s>",), *sorted(prob[1])]
    lines = ["\\data\\", f"ngram 1={len(unigrams)}"]
    lines += [f"ngram {n}={len(prob[n])}" for n in range(2, order + 1)]
    for n in range(1, order + 1):
        lines += ["", f"\\{n}-grams:"]
        grams = unigrams if n == 1 else sorted(prob[n])
        for gram in grams:
            p = prob[1].get(gram, 0.0) if n == 1 else prob[n][gram]
            row = f"{log10(p)} {' '.join(gram)}"
            if n < order and gram in alpha:
                row += f" {math.log10(max(alpha[gram], 1e-99)):.6f}"
            lines.append(row)
    lines += ["", "\\end\\", ""]
    return "\n".join(lines)


def jsgf_from_vocabulary(vocab: DomainVocabulary) -> str:
    """A JSGF grammar: every template, with <amount> and <name> rules for its slots."""

    def alternatives(items: Iterable[str]) -> str:
        return " | ".join(sorted({" ".join(spoken_words(s)) for s in items if spoken_words(s)}))

    slots = {AMOUNT_SLOT: "<amount>", NAME_SLOT: "<name>"}
    templates = []
    for template in vocab.templates:
        if NAME_SLOT in template and not vocab.names:
            continue
        pieces = re.split(r"(\{amount\}|\{name\})", template)
        body = " ".join(slots[p] if p in slots else " ".join(spoken_words(p)) for p in pieces)
        templates.append(" ".join(body.split()))
    rules = [
        "#JSGF V1.0;",
        "grammar banking;",
        f"public <command> = {' | '.join(f'( {t} )' for t in templates)};",
    ]
    rules.append(f"<amount> = {alternatives(vocab.amounts)};")
    if vocab.names:
        rules.append(f"<name> = {alternatives(vocab.names)};")
    return "\n".join(rules) + "\n"


# --------------------------------------------------------------------------------------------------------
# PocketSphinx


@dataclass(frozen=True)
class _DecoderRecipe:
    """Everything needed to make a decoder for one vocabulary version; immutable, so shared freely."""

    mode: str
    version: int
    dict_text: str | None = None
    lm_text: str | None = None
    jsgf_text: str | None = None

    def make(self) -> Any:
        import pocketsphinx

        if self.mode == "general":
            return pocketsphinx.Decoder(loglevel="FATAL")
        # The decoder reads its dictionary and LM from files: write them for the call, then delete.
        with tempfile.TemporaryDirectory(prefix="g4serve-asr-") as tmp:

            def written(name: str, text: str | None) -> str:
                path = os.path.join(tmp, name)
                with open(path, "w", encoding="utf-8") as f:
                    f.write(text or "")
                return path

            search = (
                {"lm": written("domain.arpa", self.lm_text)}
                if self.mode == "lm"
                else {"lm": None, "jsgf": written("domain.gram", self.jsgf_text)}
            )
            return pocketsphinx.Decoder(
                loglevel="FATAL", dict=written("domain.dict", self.dict_text), **search
            )


class PocketSphinxStream:
    """One utterance on one decoder. Not thread-safe: one stream per connection; it returns its decoder
    to the recogniser's pool when finished.

    Partials come from a live pass (live cepstral mean normalisation, CMN). The final transcript comes from
    a second pass over the whole utterance with the mean taken from the utterance itself (batch CMN): live
    CMN starts from a generic mean and needs several utterances to adapt to a new voice or microphone
    (45 espeak-ng commands, 3 voices: 3.6% WER with the batch pass; live only, 5-10% on decoders warmed by
    earlier utterances, up to 22% on fresh ones). The pass costs one more decode of the utterance at its
    end (~0.1 s per second of speech); final_pass=False trades that accuracy for latency.
    Call close() instead of finish() to abandon an utterance.
    """

    def __init__(
        self,
        decoder: Any,
        recipe: _DecoderRecipe,
        release: Callable[[Any, _DecoderRecipe], None],
        name: str,
        *,
        live: bool = True,
        final_pass: bool = True,
        noise_floor: float = 1e-3,
    ) -> None:
        self._decoder = decoder
        self._recipe = recipe
        self._release = release
        self._name = name
        self._live = live
        self._final_pass = final_pass or not live
        self._noise_floor = noise_floor
        # Seeded: the same audio always decodes to the same text, however it was chunked.
        self._rng = np.random.default_rng(0)
        self._pcm: list[bytes] = []
        self._partials: list[str] = []
        self._samples = 0
        self._decode_s = 0.0
        self._done = False
        if live:
            decoder.start_utt()

    def feed(self, pcm: np.ndarray) -> str | None:
        if self._done:
            raise RuntimeError("feed() after finish()")
        samples = np.asarray(pcm, dtype=np.float32).reshape(-1)
        if samples.size == 0:
            return None
        start = time.perf_counter()
        self._samples += samples.size
        if not self._pcm:
            # Lead-in silence: a VAD trims to ~100 ms before the first phone, and the decoder, which expects
            # to enter speech from silence, then mishears the first word ("pay" -> "three" on espeak speech).
            samples = np.concatenate([np.zeros(_LEAD_SAMPLES, np.float32), samples])
        data = self._pcm16(samples)
        self._pcm.append(data)
        text = ""
        if self._live:
            self._decoder.process_raw(data, False, False)
            hyp = self._decoder.hyp()
            text = _clean(hyp.hypstr) if hyp is not None else ""
        self._decode_s += time.perf_counter() - start
        if text and (not self._partials or text != self._partials[-1]):
            self._partials.append(text)
            return text
        return None

    def close(self) -> None:
        """Abandon the utterance (client gone): end it and return the decoder; idempotent."""
        if self._done:
            return
        self._done = True
        if self._live:
            self._decoder.end_utt()
        self._release(self._decoder, self._recipe)

    def _pcm16(self, samples: np.ndarray) -> bytes:
        if self._noise_floor > 0:
            # A -60 dBFS noise floor: digital silence (exact zeros, from synthesis or a muted mic) has no
            # defined log energy and drags the cepstral mean far from any the acoustic model saw (espeak-ng
            # commands: 36% WER without it, 3.6% with); microphone noise is louder than this anyway.
            samples = samples + self._noise_floor * self._rng.standard_normal(samples.size).astype(np.float32)
        return _to_pcm16(samples)

    def finish(self) -> Transcript:
        if self._done:
            raise RuntimeError("finish() called twice")
        self._done = True
        start = time.perf_counter()
        reusable = False
        try:
            decoder = self._decoder
            if self._live:
                decoder.end_utt()
            if self._final_pass and self._samples:
                tail = self._pcm16(np.zeros(_LEAD_SAMPLES, np.float32))  # trailing silence, as the lead-in
                decoder.start_utt()
                decoder.process_raw(b"".join([*self._pcm, tail]), False, True)  # full_utt: batch CMN
                decoder.end_utt()
            hyp = decoder.hyp() if self._samples else None
            text = _clean(hyp.hypstr) if hyp is not None else ""
            # Word posteriors from the lattice (already linear probabilities in pocketsphinx 5). Their mean
            # is the confidence: the whole-path posterior shrinks with length even when every word is sure.
            words = (
                [(re.sub(r"\(\d+\)$", "", seg.word), float(seg.prob)) for seg in decoder.seg()]
                if text
                else []
            )
            words = [(w, p) for w, p in words if _clean(w)]
            confidence = float(np.mean([p for _, p in words])) if words else None
            reusable = True
        finally:
            if reusable:  # a decoder that failed mid-utterance may be in any state: let it go
                self._release(self._decoder, self._recipe)
        self._decode_s += time.perf_counter() - start
        return Transcript(
            text=text,
            partials=list(self._partials),
            confidence=confidence,
            recognizer=self._name,
            audio_s=self._samples / SAMPLE_RATE,
            decode_ms=self._decode_s * 1000.0,
            words=words,
        )


class PocketSphinxRecognizer:
    """The default recogniser: offline, CPU, ships its en-us acoustic model in the pip package.

    mode 'lm' (default): a trigram LM from the vocabulary's phrases, dictionary limited to its words.
    mode 'jsgf': a grammar of the vocabulary's templates (rejects what it does not cover).
    mode 'general': the package's general English LM and dictionary, unbiased.
    Decoders are pooled per vocabulary version; update_vocabulary swaps the recipe under a lock, and
    streams already running finish on their old decoder, which is then dropped.
    """

    def __init__(
        self,
        vocabulary: DomainVocabulary | None = None,
        mode: str = "lm",
        *,
        max_idle: int = 4,
        final_pass: bool = True,
        noise_floor: float = 1e-3,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown pocketsphinx mode {mode!r}; choose one of {MODES}")
        self.mode = mode
        self.final_pass = final_pass
        self.noise_floor = noise_floor
        self.name = f"pocketsphinx-{mode}"
        self._max_idle = max_idle
        self._lock = threading.Lock()  # guards _recipe and _idle
        self._update_lock = threading.Lock()
        self._idle: list[Any] = []
        self._recipe = _DecoderRecipe(mode="general", version=-1)
        self.update_vocabulary(vocabulary or DomainVocabulary.build([]))

    @property
    def vocabulary_version(self) -> int:
        return self._recipe.version

    def update_vocabulary(self, vocab: DomainVocabulary) -> None:
        """Rebuild the dictionary and LM/grammar for `vocab` and make new streams use them (~0.2 s for a
        few payees, ~0.3 s for 300; the first call in a process also parses cmudict, ~1 s)."""
        with self._update_lock:  # serialises updates, so the last one called is the one that stays
            recipe = self._build_recipe(vocab)
            warm = recipe.make()  # built (and validated) outside the pool lock: streams keep running
            with self._lock:
                self._recipe = recipe
                self._idle = [warm]

    def stream(self) -> PocketSphinxStream:
        """A streaming utterance: feed() returns partials, finish() re-decodes for the final text."""
        return self._open(live=True)

    def _open(self, live: bool) -> PocketSphinxStream:
        with self._lock:
            recipe = self._recipe
            decoder = self._idle.pop() if self._idle else None
        if decoder is None:
            decoder = recipe.make()
        return PocketSphinxStream(
            decoder,
            recipe,
            self._release,
            self.name,
            live=live,
            final_pass=self.final_pass,
            noise_floor=self.noise_floor,
        )

    def transcribe(self, audio: np.ndarray) -> Transcript:
        """One whole utterance (trim it with the VAD first): a single batch-CMN pass, no partials."""
        stream = self._open(live=False)
        stream.feed(audio)
        return stream.finish()

    @contextmanager
    def _borrow(self) -> Iterator[Any]:
        with self._lock:
            recipe = self._recipe
            decoder = self._idle.pop() if self._idle else None
        decoder = decoder or recipe.make()
        try:
            yield decoder
        finally:
            self._release(decoder, recipe)

    def pronunciation(self, word: str) -> str | None:
        """The phones the current decoder uses for `word` (None if it cannot say it)."""
        with self._borrow() as decoder:
            return decoder.lookup_word(word.lower())

    def _release(self, decoder: Any, recipe: _DecoderRecipe) -> None:
        with self._lock:
            if recipe is self._recipe and len(self._idle) < self._max_idle:
                self._idle.append(decoder)

    def _build_recipe(self, vocab: DomainVocabulary) -> _DecoderRecipe:
        if self.mode == "general":
            return _DecoderRecipe(mode="general", version=vocab.version)
        import pocketsphinx

        dict_path = pocketsphinx.get_model_path("en-us/cmudict-en-us.dict")
        prons = pronunciations(vocab.words(), dict_path)
        if self.mode == "lm":
            return _DecoderRecipe(
                mode="lm",
                version=vocab.version,
                dict_text=dictionary_text(prons),
                lm_text=arpa_from_phrases(vocab.weighted_phrases()),
            )
        return _DecoderRecipe(
            mode="jsgf",
            version=vocab.version,
            dict_text=dictionary_text(prons),
            jsgf_text=jsgf_from_vocabulary(vocab),
        )


def make_recognizer(
    name: str = "pocketsphinx",
    vocabulary: DomainVocabulary | None = None,
    *,
    engine: Any = None,
    loop: Any = None,
) -> Recognizer:
    """A recogniser by name: 'pocketsphinx' (domain LM), 'pocketsphinx-jsgf', 'pocketsphinx-general', or
    'gemma' (the served model hears the audio: ``engine``, an AsyncLLMEngine with its audio tower loaded,
    and ``loop``, the event loop serving it, by default the running one; build a ``GemmaRecognizer`` for its
    other options). The pocketsphinx recognisers ignore ``engine`` and ``loop``."""
    if name in ("pocketsphinx", "pocketsphinx-lm"):
        return PocketSphinxRecognizer(vocabulary, mode="lm")
    if name.startswith("pocketsphinx-") and name.removeprefix("pocketsphinx-") in MODES:
        return PocketSphinxRecognizer(vocabulary, mode=name.removeprefix("pocketsphinx-"))
    if name == "gemma":
        from g4serve_assistant.asr_gemma import GemmaRecognizer

        return GemmaRecognizer(engine, vocabulary, loop=loop)
    raise ValueError(
        f"unknown recognizer {name!r}; available: pocketsphinx, pocketsphinx-jsgf, pocketsphinx-general, "
        "gemma"
    )


def _to_pcm16(samples: np.ndarray) -> bytes:
    return (np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


def _clean(text: str) -> str:
    # Filler and noise tokens ("<sil>", "[NOISE]") are not words; the dictionary's word forms are.
    return " ".join(w for w in text.split() if not (w.startswith(("<", "[", "+"))))
