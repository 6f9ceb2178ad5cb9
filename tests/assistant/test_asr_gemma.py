"""``--asr gemma`` on the embedded tiny model (random weights, with an audio tower): the request reaches the
engine with the audio and the vocabulary in the prompt, the transcript is the engine's text cleaned, and
timeouts, failures, a dead engine and models without an audio tower end as the pipeline expects."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import threading
import time

import numpy as np
import pytest

from g4serve_assistant.asr import Transcript, make_recognizer
from g4serve_assistant.asr_gemma import (
    DEFAULT_MAX_TOKENS,
    MAX_AUDIO_S,
    GemmaRecognizer,
    audio_engine_options,
    clean_transcript,
    domain_words,
    model_has_audio_tower,
    payee_aliases,
    vocabulary_text,
)
from g4serve_assistant.audio import SAMPLE_RATE
from g4serve_assistant.vocabulary import DomainVocabulary

needs_espeak = pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng is not installed")

PAYEES = ["John Smith", "José García", "Sean O'Brien", "City Electric"]
ALIASES = ["mom", "electric company"]


def vocab(version: int = 1, payees: list[str] = PAYEES) -> DomainVocabulary:
    return DomainVocabulary.build(payees, version=version, aliases=ALIASES)


def noise(seconds: float, seed: int = 0) -> np.ndarray:
    return (0.1 * np.random.default_rng(seed).standard_normal(int(seconds * SAMPLE_RATE))).astype(np.float32)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from g4serve.engine.async_engine import AsyncLLMEngine
    from g4serve.engine.engine import EngineConfig

    options = audio_engine_options(str(tiny_model_dir))
    eng = AsyncLLMEngine.from_config(
        EngineConfig(
            model=str(tiny_model_dir), device="cpu", dtype="float32", kv_cache_bytes=32 << 20, **options
        )
    )
    yield eng
    eng.shutdown()


class SpyEngine:
    """The real engine behind the surface the recogniser may use, recording each request."""

    def __init__(self, real):
        self.real, self.prompts, self.params, self.processed = real, [], [], []

    @property
    def tokenizer(self):
        return self.real.tokenizer

    @property
    def dead(self):
        return self.real.dead

    async def process(self, prompt, add_special_tokens=True):
        self.prompts.append(prompt)
        self.processed.append(await self.real.process(prompt, add_special_tokens=add_special_tokens))
        return self.processed[-1]

    def generate(self, processed, params):
        self.params.append(params)
        return self.real.generate(processed, params)


class ScriptedEngine:
    """Streams scripted text pieces, then hangs (or raises ``fail`` from process); records whether its
    stream was closed, which is how a real stream's request gets aborted."""

    def __init__(self, tokenizer, pieces=(), fail: Exception | None = None, dead=None):
        self.tokenizer, self.pieces, self.fail, self.dead = tokenizer, list(pieces), fail, dead
        self.closed = threading.Event()
        self.calls = 0

    async def process(self, prompt, add_special_tokens=True):
        self.calls += 1
        if self.fail is not None:
            raise self.fail

        class Processed:
            token_ids = [1, 2, 3]

        return Processed()

    async def generate(self, processed, params):
        from types import SimpleNamespace

        try:
            for i, text in enumerate(self.pieces):
                yield SimpleNamespace(
                    text=text,
                    finished=False,
                    finish_reason=None,
                    num_output_tokens=i + 1,
                    num_cached_tokens=0,
                )
            await asyncio.Event().wait()  # never finishes by itself
        finally:
            self.closed.set()


# ---- cleaning ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "raw, clean",
    [
        ('"Send $50 to John Smith."', "Send $50 to John Smith"),
        ("Transcription: pay City Electric $94.20!\nNote: the audio was noisy", "pay City Electric $94.20"),
        ("Here is the transcript: lock my card", "lock my card"),
        ("[noise] (silence)\n\n  Lock my debit card.  ", "Lock my debit card"),
        ("\u201cwhat\u2019s my balance?\u201d", "what's my balance"),
        ("I'd like -$50 \u2014 to 'Sean O\u2019Brien' on 2025-05-08 at 3:30.", None),
        ("**Send** `twenty` euros to Jos\u00e9 Garc\u00eda,", "Send twenty euros to Jos\u00e9 Garc\u00eda"),
        ("pay 1,200 dollars", "pay 1,200 dollars"),
        (" TheH\ufffd\ufffd\x00\x07 x", "TheH x"),
        ("<|audio|><turn|> hi", "hi"),
        ("", ""),
        ("...!?", ""),
        ("[no speech]", ""),
        ("\n\n\n", ""),
    ],
)
def test_clean_transcript_keeps_what_the_normalizer_reads_and_drops_the_rest(raw, clean):
    expected = "I'd like -$50 to Sean O'Brien on 2025-05-08 at 3:30" if clean is None else clean
    assert clean_transcript(raw) == expected


def test_clean_transcript_caps_length_at_a_word_boundary():
    raw = "send fifty dollars to john smith " * 40
    out = clean_transcript(raw, max_chars=50)
    assert len(out) <= 50 and raw.startswith(out) and not out.endswith(" ")
    assert out.split()[-1] in raw.split()  # no word cut in half
    assert clean_transcript("x" * 500, max_chars=20) == "x" * 20  # one endless "word" is still capped


def test_the_normalizer_reads_a_cleaned_gemma_transcript():
    from g4serve_assistant.normalize import normalize

    n = normalize(clean_transcript('"Send -$12.50 to John Smith."'))
    assert [(m.amount_minor, m.currency) for m in n.amounts] == [(-1250, "USD")]
    assert "john smith" in n.text


# ---- the prompt -------------------------------------------------------------------------------------------
def test_vocabulary_section_lists_payees_as_written_aliases_and_domain_words():
    v = vocab()
    text = vocabulary_text(v)
    assert "Payees: John Smith, José García, Sean O'Brien, City Electric." in text
    assert payee_aliases(v) == ["mom", "electric company"]  # not "john", "city" nor the corpus' "my mom"
    words = domain_words(v)
    assert {"balance", "transfer", "freeze", "savings", "representative"} <= set(words)
    assert not {"the", "my", "what", "to"} & set(words)
    # Cut to the budget with the names first: they are what a general recogniser gets wrong.
    small = vocabulary_text(v, max_chars=60)
    assert small.startswith("Payees: John Smith") and "Words customers often say" not in small
    assert len(small) < 120


def test_request_reaches_the_engine_with_the_audio_and_the_vocabulary(engine):
    spy = SpyEngine(engine)
    recognizer = GemmaRecognizer(spy, vocab())
    audio = noise(1.5)
    transcript = recognizer.transcribe(audio)

    (prompt,) = spy.prompts
    sent_audio, rate = prompt["multi_modal_data"]["audio"]
    assert rate == SAMPLE_RATE and np.array_equal(sent_audio, audio)
    text = prompt["prompt"]
    assert text.count(engine.tokenizer.audio_token) == 1
    for expected in ("John Smith", "José García", "Sean O'Brien", "electric company", "balance"):
        assert expected in text
    # Everything before the audio is instructions and vocabulary: one prefix for the prefix cache.
    assert text.index("John Smith") < text.index(engine.tokenizer.audio_token)
    (processed,) = spy.processed
    assert [item.modality for item in processed.mm_items] == ["audio"]
    (params,) = spy.params
    assert params.temperature == 0.0 and params.max_tokens == DEFAULT_MAX_TOKENS

    # The transcript is the engine's own greedy text for this request, cleaned.
    async def direct() -> str:
        return "".join([d.text async for d in engine.generate(processed, params)])

    raw = asyncio.run(direct())
    assert transcript.details["raw"] == raw
    assert transcript.text == clean_transcript(raw)
    assert transcript.recognizer == "gemma" and transcript.error is None and transcript.confidence is None
    assert transcript.audio_s == pytest.approx(1.5) and transcript.decode_ms > 0
    assert transcript.details["prompt_tokens"] == len(processed.token_ids)
    assert transcript.details["finish_reason"] in ("stop", "length", "first_line")


def test_a_new_vocabulary_reaches_new_streams_not_open_ones(engine):
    spy = SpyEngine(engine)
    recognizer = GemmaRecognizer(spy, vocab(version=1))
    open_stream = recognizer.stream()
    recognizer.update_vocabulary(vocab(version=2, payees=["Zbigniew Brzezinski"]))
    assert recognizer.vocabulary_version == 2
    open_stream.feed(noise(0.5))
    open_stream.finish()
    recognizer.transcribe(noise(0.5))
    old, new = (p["prompt"] for p in spy.prompts)
    assert "John Smith" in old and "Zbigniew" not in old
    assert "Zbigniew Brzezinski" in new and "John Smith" not in new


def test_audio_is_capped_at_what_the_model_hears_and_empty_audio_asks_nothing(engine):
    spy = SpyEngine(engine)
    recognizer = GemmaRecognizer(spy, vocab(), max_tokens=2)
    stream = recognizer.stream()
    chunk = noise(1.0)
    for _ in range(MAX_AUDIO_S + 2):
        assert stream.feed(chunk) is None  # whole-utterance: no partials
    transcript = stream.finish()
    assert transcript.audio_s == pytest.approx(MAX_AUDIO_S + 2)
    assert spy.prompts[-1]["multi_modal_data"]["audio"][0].size == MAX_AUDIO_S * SAMPLE_RATE
    with pytest.raises(RuntimeError):
        stream.feed(chunk)
    with pytest.raises(RuntimeError):
        stream.finish()

    empty = recognizer.transcribe(np.zeros(0, np.float32))
    assert empty.text == "" and empty.error is None and len(spy.prompts) == 1


# ---- failures ---------------------------------------------------------------------------------------------
def test_the_first_line_is_the_transcript_and_the_rest_is_not_generated(engine):
    scripted = ScriptedEngine(
        engine.tokenizer, ['"Send $50', " to John Smith.", '"\nNote:', " I am not sure"]
    )
    t = GemmaRecognizer(scripted, vocab(), timeout_s=5).transcribe(noise(0.5))
    assert t.text == "Send $50 to John Smith" and t.error is None
    assert t.details["finish_reason"] == "first_line"
    assert scripted.closed.wait(2)  # the stream was closed, so a real engine aborts the request


def test_a_timeout_is_an_empty_transcript_and_aborts_the_request(engine):
    scripted = ScriptedEngine(engine.tokenizer, ["send fifty"])  # no newline, never finishes
    recognizer = GemmaRecognizer(scripted, vocab(), timeout_s=0.3)
    start = time.perf_counter()
    t = recognizer.transcribe(noise(0.5))
    assert time.perf_counter() - start < 2
    assert t.text == "" and "timed out" in t.error
    assert scripted.closed.wait(2)


def test_a_failed_request_is_an_empty_transcript_and_a_dead_engine_raises(engine):
    failing = ScriptedEngine(engine.tokenizer, fail=ValueError("audio[0]: could not decode"))
    t = GemmaRecognizer(failing, vocab()).transcribe(noise(0.5))
    assert t.text == "" and t.error == "ValueError: audio[0]: could not decode"

    class EngineDeadError(RuntimeError):
        pass

    dead = EngineDeadError("engine is not running: it crashed (RuntimeError)")
    with pytest.raises(EngineDeadError, match="not running"):
        GemmaRecognizer(ScriptedEngine(engine.tokenizer, fail=dead, dead=dead), vocab()).transcribe(
            noise(0.5)
        )


def test_on_the_loop_it_submits_to_it_refuses_instead_of_deadlocking(engine):
    async def on_loop() -> None:
        recognizer = GemmaRecognizer(engine, vocab(), loop=asyncio.get_running_loop())
        with pytest.raises(RuntimeError, match="worker thread"):
            recognizer.transcribe(noise(0.5))
        # From a worker thread, the same recogniser and loop work.
        t = await asyncio.to_thread(recognizer.transcribe, noise(0.5))
        assert t.error is None and t.details["prompt_tokens"] > 0

    asyncio.run(on_loop())


def test_its_own_loop_thread_ends_with_the_recogniser(engine):
    import gc

    recognizer = GemmaRecognizer(engine, vocab())
    recognizer.transcribe(noise(0.3))
    names = lambda: [t.name for t in threading.enumerate() if t.name == "g4-asr-gemma"]  # noqa: E731
    assert names()
    del recognizer
    gc.collect()
    deadline = time.monotonic() + 3
    while names() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not names()


def test_make_recognizer_builds_gemma_only_with_an_engine(engine):
    assert isinstance(make_recognizer("gemma", vocab(), engine=engine), GemmaRecognizer)
    with pytest.raises(ValueError, match="needs the served model"):
        make_recognizer("gemma", vocab())
    with pytest.raises(ValueError, match="gemma"):
        make_recognizer("whisper", vocab())
    assert make_recognizer("pocketsphinx-general", engine=engine).name == "pocketsphinx-general"


# ---- which models can hear, and the CLI -------------------------------------------------------------------
def test_only_models_with_an_audio_tower_can_be_the_recogniser(tiny_model_dir, tmp_path):
    from g4serve.tiny import make_tiny

    assert model_has_audio_tower(None)  # the embedded tiny model
    assert model_has_audio_tower(str(tiny_model_dir))
    assert model_has_audio_tower("e2b") and model_has_audio_tower("e4b")
    assert not model_has_audio_tower("26b-a4b") and not model_has_audio_tower("31b")
    assert not model_has_audio_tower(str(make_tiny(tmp_path / "moe", "moe")))
    options = audio_engine_options("e4b")
    assert options["limit_mm_per_prompt"] == {"image": 0, "video": 0, "audio": 1}
    with pytest.raises(ValueError, match="31b has no audio tower"):
        audio_engine_options("31b")
    with pytest.raises(ValueError, match="preset"):
        model_has_audio_tower("no-such-model")


def test_cli_refuses_gemma_asr_with_no_llm(capsys):
    from g4serve_assistant.cli import main

    assert main(["--asr", "gemma", "--no-llm", "--db", ":memory:"]) == 2
    assert "--asr gemma: the recogniser is the served model, so it cannot run with --no-llm" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize("model", ["31b", "26b-a4b"])
def test_cli_refuses_gemma_asr_on_a_model_without_an_audio_tower_before_loading_it(model):
    from g4serve_assistant.cli import build_engine, build_parser

    args = build_parser().parse_args(["--asr", "gemma", "--model", model, "--device", "cpu"])
    start = time.perf_counter()
    with pytest.raises(ValueError, match=f"{model} has no audio tower"):
        build_engine(args)
    assert time.perf_counter() - start < 5  # from the config: a 31B preset's weights were never made


def test_cli_builds_the_engine_with_the_audio_tower_for_gemma_asr(tiny_model_dir):
    from g4serve_assistant.cli import build_engine, build_parser

    args = build_parser().parse_args(
        [
            "--asr",
            "gemma",
            "--model",
            str(tiny_model_dir),
            "--device",
            "cpu",
            "--kv-cache-bytes",
            str(16 << 20),
        ]
    )
    eng = build_engine(args)
    try:
        assert eng.config.limit_mm_per_prompt == {"image": 0, "video": 0, "audio": 1}
        assert not eng.config.text_only
        assert GemmaRecognizer(eng, vocab(), max_tokens=2).transcribe(noise(0.5)).error is None
    finally:
        eng.shutdown()
    text_args = build_parser().parse_args(["--model", str(tiny_model_dir), "--kv-cache-bytes", str(16 << 20)])
    text_engine = build_engine(text_args)
    try:
        assert text_engine.config.text_only_mode  # the pocketsphinx default still loads no tower
    finally:
        text_engine.shutdown()


# ---- a whole turn -----------------------------------------------------------------------------------------
@needs_espeak
def test_a_spoken_turn_through_the_assistant_with_gemma_asr(engine, tmp_path):
    from g4serve_assistant.audio import decode_wav
    from g4serve_assistant.db import DEMO_CUSTOMER_ID, demo_bank
    from g4serve_assistant.pipeline import NOT_HEARD_REPLY, Assistant, Caller

    wav = tmp_path / "say.wav"
    subprocess.run(
        ["espeak-ng", "-v", "en-us", "-s", "165", "-w", str(wav), "send fifty dollars to john smith"],
        check=True,
        capture_output=True,
    )
    speech = np.concatenate(
        [np.zeros(4800, np.float32), decode_wav(wav.read_bytes()), np.zeros(12800, np.float32)]
    )
    assistant = Assistant(demo_bank(), engine, recognizer="gemma")

    async def run():
        caller = Caller(customer_id=DEMO_CUSTOMER_ID, session_id="gemma-asr")
        spoken = await assistant.turn(caller, audio=speech)
        silent = await assistant.turn(caller, audio=np.zeros(SAMPLE_RATE, np.float32))
        recognizer = await asyncio.to_thread(assistant.recognizer, DEMO_CUSTOMER_ID)
        trimmed = await assistant.in_audio_thread(assistant.vad().trim, speech)
        again = await assistant.in_audio_thread(recognizer.transcribe, trimmed)
        return spoken.to_dict(), silent.to_dict(), recognizer, again

    try:
        spoken, silent, recognizer, again = asyncio.run(run())
    finally:
        assistant.close()
    assert isinstance(recognizer, GemmaRecognizer)
    assert "John Smith" in recognizer.prompt  # the demo customer's payees are in its prompt
    assert spoken["asr"]["recognizer"] == "gemma"
    assert spoken["asr"]["audio_s"] == pytest.approx(speech.size / SAMPLE_RATE, abs=0.01)
    # The turn's transcript is what the model says for the VAD-trimmed speech (greedy: the same each time).
    assert isinstance(again, Transcript) and again.error is None
    assert spoken["transcript"] == again.text
    assert spoken["stages"]["asr_final"] > 0
    # Silence never reaches the model: the VAD finds no speech, and the turn asks again.
    assert silent["transcript"] == "" and silent["reply"] == NOT_HEARD_REPLY


@pytest.mark.parametrize("raw", ["Send 1/2 dollars to John Smith.", "Send $1/2 to John", "Send ½ dollars."])
def test_a_fraction_in_a_gemma_transcript_is_no_amount(raw):
    """The slash was cleaned away, so "1/2 dollars" reached the normalizer as "1 2 dollars": $2.00."""
    from g4serve_assistant.normalize import normalize

    assert normalize(clean_transcript(raw)).amounts == []
