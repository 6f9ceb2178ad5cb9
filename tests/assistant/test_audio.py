"""The assistant's audio front end: WAV/PCM decoding, silero VAD end-pointing, the domain vocabulary and LM,
and pocketsphinx recognition of espeak-ng speech (VAD -> ASR -> transcript keywords)."""

from __future__ import annotations

import base64
import math
import shutil
import struct
import subprocess
import tempfile
import threading

import numpy as np
import pytest

from g4serve_assistant.asr import (
    PocketSphinxRecognizer,
    arpa_from_phrases,
    guess_pronunciation,
    jsgf_from_vocabulary,
    make_recognizer,
)
from g4serve_assistant.audio import (
    SAMPLE_RATE,
    AudioError,
    decode_base64_wav,
    decode_wav,
    encode_wav,
    pcm16_bytes_to_float,
)
from g4serve_assistant.vad import VoiceActivityDetector
from g4serve_assistant.vocabulary import DomainVocabulary, spoken_number, spoken_words

PAYEES = ["John Smith", "Maria Garcia", "Wei Chen", "Priya Patel", "City Electric"]
needs_espeak = pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng not installed")


def _synth(text: str, voice: str = "en-us") -> np.ndarray:
    """espeak-ng speech (22.05 kHz WAV) through decode_wav, so 16 kHz float32 mono."""
    with tempfile.NamedTemporaryFile(suffix=".wav") as f:
        subprocess.run(["espeak-ng", "-v", voice, "-w", f.name, text], check=True, capture_output=True)
        return decode_wav(f.read())


@pytest.fixture(scope="module")
def synth():
    cache: dict[tuple[str, str], np.ndarray] = {}

    def get(text: str, voice: str = "en-us") -> np.ndarray:
        if (text, voice) not in cache:
            cache[text, voice] = _synth(text, voice)
        return cache[text, voice]

    return get


@pytest.fixture(scope="module")
def vad() -> VoiceActivityDetector:
    return VoiceActivityDetector()


@pytest.fixture(scope="module")
def recognizer() -> PocketSphinxRecognizer:
    return PocketSphinxRecognizer(DomainVocabulary.build(PAYEES, version=1))


def _pad(audio: np.ndarray, before_s: float = 0.5, after_s: float = 1.0) -> np.ndarray:
    return np.concatenate(
        [
            np.zeros(int(before_s * SAMPLE_RATE), np.float32),
            audio,
            np.zeros(int(after_s * SAMPLE_RATE), np.float32),
        ]
    )


# ---- audio decoding ----------------------------------------------------------------------------------------


def _wav_bytes(
    payload: bytes, *, fmt: int = 1, channels: int = 1, rate: int = 16000, bits: int = 16
) -> bytes:
    block = channels * bits // 8
    fmt_chunk = struct.pack("<HHIIHH", fmt, channels, rate, rate * block, block, bits)
    body = (
        b"WAVE"
        + b"fmt "
        + struct.pack("<I", 16)
        + fmt_chunk
        + b"data"
        + struct.pack("<I", len(payload))
        + payload
    )
    return b"RIFF" + struct.pack("<I", len(body)) + body


def test_wav_round_trip_pcm16():
    tone = (0.5 * np.sin(2 * np.pi * 440 * np.arange(1600) / SAMPLE_RATE)).astype(np.float32)
    decoded = decode_wav(encode_wav(tone))
    assert decoded.dtype == np.float32 and decoded.shape == tone.shape
    np.testing.assert_allclose(decoded, tone, atol=1 / 32767)


@pytest.mark.parametrize(
    ("fmt", "bits", "dtype", "scale"),
    [
        (1, 8, np.uint8, None),
        (1, 24, None, None),
        (1, 32, "<i4", 2**31 - 1),
        (3, 32, "<f4", 1.0),
        (3, 64, "<f8", 1.0),
    ],
)
def test_wav_sample_formats(fmt, bits, dtype, scale):
    values = np.array([0.0, 0.5, -0.5, 0.25] * 100)
    if bits == 8:
        payload = (values * 127 + 128).astype(np.uint8).tobytes()
    elif bits == 24:
        ints = (values * (2**23 - 1)).astype(np.int32)
        payload = b"".join(int(i).to_bytes(3, "little", signed=True) for i in ints)
    else:
        payload = (values * scale).astype(dtype).tobytes()
    decoded = decode_wav(_wav_bytes(payload, fmt=fmt, bits=bits))
    np.testing.assert_allclose(decoded, values, atol=1e-2)


def test_wav_stereo_44k_is_downmixed_and_resampled():
    t = np.arange(44100) / 44100
    left, right = np.sin(2 * np.pi * 300 * t), np.zeros_like(t)
    stereo = np.stack([left, right], axis=1).astype(np.float32) * 0.8
    decoded = decode_wav(encode_wav(stereo, sample_rate=44100))
    assert decoded.shape == (SAMPLE_RATE,)
    assert abs(np.abs(decoded).max() - 0.4) < 0.02  # the mean of the channels


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "not a WAV file"),
        (b"ID3\x03\x00garbage-mp3" * 4, "not a WAV file"),
        (_wav_bytes(b""), "audio: empty"),
        (_wav_bytes(b"\x00\x00" * 10, rate=0), "audio: sample rate 0 Hz outside"),
        # a header's 2^31-1 Hz was a 500 (MemoryError in the resampler), 100 MHz 5 s on the audio thread
        (
            _wav_bytes(b"\x00\x00" * 10, rate=2**31 - 1),
            "audio: sample rate 2147483647 Hz outside 1000-384000",
        ),
        (_wav_bytes(b"\x00\x00" * 10, rate=100_000_007), "outside 1000-384000 Hz"),
        (_wav_bytes(b"\x00\x00" * 10, fmt=0x55), "unsupported WAV encoding"),
        (_wav_bytes(b"\x00\x00" * 10, bits=12), "unsupported sample size"),
        (_wav_bytes(b"\x00\x00" * 10, channels=0), "0 channels"),
        (b"RIFF\x04\x00\x00\x00WAVE", "no 'fmt ' chunk"),
    ],
)
def test_bad_wav_gives_actionable_error(data, message):
    with pytest.raises(AudioError, match=message):
        decode_wav(data)


def test_too_long_audio_is_refused_from_the_header():
    data = _wav_bytes(b"\x00\x00" * (SAMPLE_RATE * 31))
    with pytest.raises(AudioError, match="longer than 30 s"):
        decode_wav(data)
    assert decode_wav(data, max_seconds=40).shape == (SAMPLE_RATE * 31,)


def test_base64_and_data_url():
    wav = encode_wav(np.full(800, 0.25, np.float32))
    b64 = base64.b64encode(wav).decode()
    assert decode_base64_wav(b64).shape == (800,)
    assert decode_base64_wav("data:audio/wav;base64," + b64).shape == (800,)
    with pytest.raises(AudioError, match="not valid base64"):
        decode_base64_wav("not base64!!")
    with pytest.raises(AudioError, match="empty"):
        decode_base64_wav("  ")
    with pytest.raises(AudioError, match="base64"):
        decode_base64_wav("data:audio/wav," + b64)


def test_pcm16_chunks():
    chunk = np.array([0, 16384, -32768, 32767], dtype="<i2").tobytes()
    np.testing.assert_allclose(pcm16_bytes_to_float(chunk), [0.0, 0.5, -1.0, 32767 / 32768])
    assert pcm16_bytes_to_float(b"").shape == (0,)
    with pytest.raises(AudioError, match="odd number of bytes"):
        pcm16_bytes_to_float(b"\x00\x01\x02")


# ---- vocabulary, LM, pronunciations ------------------------------------------------------------------------


def test_spoken_numbers_and_words():
    assert spoken_number(0) == "zero"
    assert spoken_number(75) == "seventy five"
    assert spoken_number(250) == "two hundred fifty"
    assert spoken_number(12_005) == "twelve thousand five"
    assert spoken_words("García-López, O'Brien!") == ["garcia", "lopez", "o'brien"]


def test_vocabulary_covers_intents_amounts_and_payees():
    vocab = DomainVocabulary.build(PAYEES + ["José Núñez"], version=7, aliases=["mom"])
    words = vocab.words()
    assert vocab.version == 7 and vocab.payee_names[-1] == "José Núñez"
    for word in (
        "balance",
        "transfer",
        "lock",
        "card",
        "electric",
        "bill",
        "transactions",
        "person",
        "fifty",
        "hundred",
        "dollars",
        "cents",
        "smith",
        "garcia",
        "priya",
        "nunez",
        "mom",
    ):
        assert word in words, word
    assert any(p.startswith("transfer") and p.endswith("dollars to john smith") for p in vocab.phrases)
    assert any(p.endswith("to my mom") for p in vocab.phrases)
    assert len(vocab.weights) == len(vocab.phrases)
    # No payees yet: still a usable vocabulary, with no name slots left unfilled.
    empty = DomainVocabulary.build([])
    assert empty.phrases and not any("{" in p for p in empty.phrases)


def _parse_arpa(text: str) -> tuple[list[dict[tuple[str, ...], float]], list[dict[tuple[str, ...], float]]]:
    probs: list[dict] = [dict() for _ in range(4)]
    backoffs: list[dict] = [dict() for _ in range(4)]
    order = 0
    for line in text.splitlines():
        if line.startswith("\\") and line.endswith("-grams:"):
            order = int(line[1])
        elif order and line.strip() and not line.startswith("\\"):
            fields = line.split()
            gram = tuple(fields[1 : 1 + order])
            probs[order][gram] = 10 ** float(fields[0])
            if len(fields) > 1 + order:
                backoffs[order][gram] = 10 ** float(fields[1 + order])
    return probs, backoffs


def test_arpa_lm_is_normalised():
    """Every history's distribution, evaluated through the backoff weights, sums to one."""
    text = arpa_from_phrases(
        [
            ("send fifty dollars to john", 2.0),
            ("send ten dollars to maria", 1.0),
            ("what's my balance", 1.0),
            ("lock my card", 0.5),
            ("my card", 1.0),
        ]
    )
    probs, backoffs = _parse_arpa(text)
    vocab = [g[0] for g in probs[1] if g != ("<s>",)]

    def p(gram: tuple[str, ...]) -> float:
        if gram in probs[len(gram)]:
            return probs[len(gram)][gram]
        return backoffs[len(gram) - 1].get(gram[:-1], 1.0) * p(gram[1:])

    histories = [
        ("<s>",),
        ("my",),
        ("dollars",),
        ("<s>", "send"),
        ("send", "fifty"),
        ("lock", "my"),
        ("zzz",),
    ]
    for history in histories:
        history = tuple(w for w in history if w in vocab or w == "<s>")
        assert math.isclose(sum(p((*history, w)) for w in vocab), 1.0, abs_tol=1e-4), history
    with pytest.raises(ValueError):
        arpa_from_phrases([])


def test_letter_to_sound_uses_model_phones():
    phones = set(
        "AA AE AH AO AW AY B CH D DH EH ER EY F G HH IH IY JH K L M N NG OW OY P R S SH T TH UH UW V W Y Z "
        "ZH".split()
    )
    for name in ("priya", "okafor", "nkechi", "xiaoling", "siobhan", "aditi", "thabo", "q", "'"):
        guess = guess_pronunciation(name).split()
        assert guess and set(guess) <= phones, (name, guess)
    assert guess_pronunciation("priya") == "P R IY Y AA"


def test_jsgf_grammar_has_slots_and_compiles():
    vocab = DomainVocabulary.build(PAYEES)
    grammar = jsgf_from_vocabulary(vocab)
    assert "<amount> =" in grammar and "<name> =" in grammar and "priya patel" in grammar
    recognizer = PocketSphinxRecognizer(vocab, mode="jsgf")  # the decoder parses the grammar
    assert recognizer.name == "pocketsphinx-jsgf"


def test_make_recognizer_names():
    assert make_recognizer("pocketsphinx").name == "pocketsphinx-lm"
    with pytest.raises(ValueError, match="unknown recognizer"):
        make_recognizer("whisper")
    with pytest.raises(ValueError, match="unknown pocketsphinx mode"):
        PocketSphinxRecognizer(mode="fast")


def test_dictionary_has_names_cmudict_lacks(recognizer):
    assert recognizer.pronunciation("priya") == "P R IY Y AA"  # not in cmudict: letter-to-sound
    assert recognizer.pronunciation("smith") == "S M IH TH"
    assert recognizer.pronunciation("giraffe") is None  # out of the domain dictionary


# ---- VAD ---------------------------------------------------------------------------------------------------


def test_vad_silence_and_noise_have_no_speech(vad):
    silence = np.zeros(SAMPLE_RATE, np.float32)
    assert vad.speech_segments(silence) == [] and vad.trim(silence) is None
    assert vad.trim(np.zeros(100, np.float32)) is None
    hum = (0.05 * np.sin(2 * np.pi * 50 * np.arange(SAMPLE_RATE) / SAMPLE_RATE)).astype(np.float32)
    assert vad.trim(hum) is None


@needs_espeak
def test_vad_finds_speech_whole_file_and_streaming(vad, synth):
    speech = synth("lock my card")
    audio = _pad(speech, before_s=0.8, after_s=1.2)
    segments = vad.speech_segments(audio)
    assert len(segments) == 1
    start, end = segments[0]
    assert (
        0.5 < start < 1.0
        and 0.8 + speech.size / SAMPLE_RATE - 0.5 < end < 0.8 + speech.size / SAMPLE_RATE + 0.4
    )
    trimmed = vad.trim(audio)
    assert trimmed is not None and speech.size * 0.6 < trimmed.size < audio.size

    # Streaming in odd-sized chunks: one start and one end, where the whole-file pass put them.
    stream = VoiceActivityDetector()
    events = [e for i in range(0, audio.size, 700) for e in stream.feed(audio[i : i + 700])]
    assert [e.kind for e in events] == ["start", "end"]
    assert abs(events[0].t_s - start) < 0.1 and events[1].t_s > events[0].t_s + 0.4
    assert not stream.in_speech
    stream.reset()
    assert stream.feed(audio[:0]) == [] and stream.stream_s == 0.0


# ---- recognition of synthesised speech: VAD -> ASR ---------------------------------------------------------

CLEAR_UTTERANCES = [
    ("transfer fifty dollars to john smith", {"transfer", "fifty", "smith"}),
    ("send twenty five dollars to maria garcia", {"send", "twenty", "five", "garcia"}),
    ("transfer two hundred dollars to priya patel", {"transfer", "hundred", "priya", "patel"}),
    ("what's my balance", {"balance"}),
    ("show my recent transactions", {"recent", "transactions"}),
    ("lock my card", {"lock", "card"}),
    ("pay my electric bill", {"pay", "electric", "bill"}),
    ("i want to talk to a person", {"talk", "person"}),
]


@needs_espeak
@pytest.mark.parametrize(("utterance", "keywords"), CLEAR_UTTERANCES)
def test_clear_utterances_give_their_keywords(recognizer, vad, synth, utterance, keywords):
    speech = vad.trim(_pad(synth(utterance)))
    assert speech is not None
    transcript = recognizer.transcribe(speech)
    assert keywords <= set(transcript.text.split()), transcript.text
    assert transcript.recognizer == "pocketsphinx-lm" and transcript.confidence is not None
    assert 0.0 < transcript.confidence <= 1.0 and transcript.audio_s > 0.5 and transcript.decode_ms > 0


@needs_espeak
def test_streaming_gives_partials_then_final(recognizer, synth):
    """Chunks as a WebSocket client sends them, gated by streaming VAD events."""
    audio = _pad(synth("send forty dollars to city electric"))
    detector = VoiceActivityDetector()
    stream, partials, final, chunk = None, [], None, 1600  # 100 ms
    for i in range(0, audio.size, chunk):
        piece = audio[i : i + chunk]
        for event in detector.feed(piece):
            if event.kind == "start":
                stream = recognizer.stream()
                stream.feed(audio[round(event.t_s * SAMPLE_RATE) : i])  # pre-roll the VAD looked back over
            elif event.kind == "end" and stream is not None:
                final = stream.finish()
                stream = None
        if stream is not None and (partial := stream.feed(piece)) is not None:
            partials.append(partial)
    assert final is not None, "the VAD never ended the utterance"
    assert {"forty", "dollars", "city", "electric"} <= set(final.text.split()), final.text
    assert partials and final.partials == partials and len(set(partials)) == len(partials)
    with pytest.raises(RuntimeError):
        final_stream = recognizer.stream()
        final_stream.finish()
        final_stream.feed(audio[:1600])


@needs_espeak
def test_update_vocabulary_adds_a_new_payee(synth, vad):
    speech = vad.trim(_pad(synth("send forty dollars to aditi rao")))
    recognizer = PocketSphinxRecognizer(DomainVocabulary.build(PAYEES, version=1))
    before = recognizer.transcribe(speech).text
    assert "aditi" not in before.split()  # not a word the recogniser can say yet
    recognizer.update_vocabulary(DomainVocabulary.build([*PAYEES, "Aditi Rao"], version=2))
    assert recognizer.vocabulary_version == 2
    after = recognizer.transcribe(speech).text
    assert {"forty", "aditi", "rao"} <= set(after.split()), after


@needs_espeak
def test_concurrent_streams_share_one_recognizer(recognizer, vad, synth):
    utterances = {"lock my card": {"lock", "card"}, "what's my balance": {"balance"}}
    speech = {u: vad.trim(_pad(synth(u))) for u in utterances}
    results: dict[str, str] = {}
    errors: list[BaseException] = []

    def run(utterance: str) -> None:
        try:
            results[utterance] = recognizer.transcribe(speech[utterance]).text
        except BaseException as error:  # surfaced below, in the test thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(u,)) for u in utterances]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    for utterance, keywords in utterances.items():
        assert keywords <= set(results[utterance].split()), results


@needs_espeak
def test_general_model_fallback_runs(synth, vad):
    transcript = make_recognizer("pocketsphinx-general").transcribe(vad.trim(_pad(synth("lock my card"))))
    assert transcript.recognizer == "pocketsphinx-general" and isinstance(transcript.text, str)


def test_empty_and_silent_audio_give_empty_transcripts(recognizer, vad):
    empty = recognizer.transcribe(np.zeros(0, np.float32))
    assert empty.text == "" and empty.confidence is None and empty.audio_s == 0.0
    stream = recognizer.stream()
    assert stream.feed(np.zeros(0, np.float32)) is None
    assert stream.finish().text == ""
    silence = np.zeros(SAMPLE_RATE, np.float32)
    assert vad.trim(silence) is None  # the pipeline stops here: no speech, nothing to recognise
    assert recognizer.transcribe(silence).text == ""


def test_noise_does_not_crash(recognizer, vad):
    noise = (0.3 * np.random.default_rng(0).standard_normal(2 * SAMPLE_RATE)).astype(np.float32)
    speech = vad.trim(noise)
    transcript = recognizer.transcribe(noise if speech is None else speech)
    assert isinstance(transcript.text, str) and transcript.audio_s == pytest.approx(2.0, abs=0.01)
    clipped = recognizer.transcribe(np.full(SAMPLE_RATE, 5.0, np.float32))  # out of range: clipped, no crash
    assert isinstance(clipped.text, str)


@needs_espeak
def test_noisy_speech_does_not_crash(recognizer, vad, synth):
    speech = _pad(synth("transfer fifty dollars to john smith"))
    noisy = speech + (0.05 * np.random.default_rng(1).standard_normal(speech.size)).astype(np.float32)
    trimmed = vad.trim(noisy)
    transcript = recognizer.transcribe(noisy if trimmed is None else trimmed)
    assert isinstance(transcript.text, str)
