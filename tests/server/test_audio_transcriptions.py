"""``/v1/audio/transcriptions`` and ``/v1/audio/translations`` on the tiny model (it has an audio tower),
driven by the official ``openai`` client and raw multipart HTTP.

The random model's transcript is noise: the tests hold the API contract (shapes, formats, events, errors)
and that the text is what the engine itself produces greedily for Gemma 4's ASR/AST instruction with
the same audio (clip by clip for a recording longer than the 30 s the model hears), not what it says."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import struct
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import soundfile

from g4serve.engine.async_engine import StreamDelta
from g4serve.processing.asr_prompt import (
    TranscriptStream,
    TranslationStream,
    extract_translation,
    join_transcripts,
    language_name,
    speech_instruction,
    speech_messages,
)
from g4serve.processing.audio import load_audio
from g4serve.processing.audio_chunks import speech_chunk_bounds
from g4serve.processing.limits import MediaLimits
from g4serve.sampling_params import SamplingParams
from g4serve.server.serving_base import OpenAIServing
from g4serve.server.serving_speech import ClipsInOrder, _TokenCounts, speech_stream

openai = pytest.importorskip("openai")
pytest.importorskip("python_multipart")
MAX_TOKENS = 10
EXTRA = {"max_completion_tokens": MAX_TOKENS}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    from g4serve import LLM

    return LLM(str(tiny_model_dir), device="cpu", dtype="float32", kv_cache_bytes=16 << 20)


def _wav(seconds: float = 1.0, rate: int = 16000, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    t = np.arange(int(rate * seconds)) / rate
    wave = 0.3 * np.sin(2 * np.pi * 330 * t) + 0.05 * rng.standard_normal(t.size)
    buf = io.BytesIO()
    soundfile.write(buf, wave.astype(np.float32), rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


WAV = _wav()
RATE = 16_000
# 70 s with two pauses in reach of a cut (28-30 s and 57.x-59.x s): three clips.
PAUSES = ((28.8, 29.2), (57.5, 57.9))


def _long_wav(seconds: float = 70.0) -> bytes:
    rng = np.random.default_rng(5)
    t = np.arange(round(RATE * seconds)) / RATE
    wave = 0.3 * np.sin(2 * np.pi * 330 * t) + 0.05 * rng.standard_normal(t.size)
    for start, end in PAUSES:
        wave[round(start * RATE) : round(end * RATE)] = 0.0
    buf = io.BytesIO()
    soundfile.write(buf, wave.astype(np.float32), RATE, format="WAV", subtype="PCM_16")
    return buf.getvalue()


LONG = _long_wav()


def _direct(llm, task: str, language: str | None, wav: bytes, prompt: str | None = None) -> str:
    """The engine's own greedy answer to Gemma 4's instruction with this audio, through ``LLM.chat``,
    stripped (as the server answers)."""
    return _direct_clips(llm, task, language, [wav], prompt)[0].strip()


def _direct_clips(llm, task: str, language: str | None, wavs: list[bytes], prompt: str | None = None):
    """``_direct`` of several clips, in one batch."""
    text = {"type": "text", "text": speech_instruction(task, language, prompt)}
    conversations = [
        [{"role": "user", "content": [{"type": "input_audio", "input_audio": _audio_part(wav)}, text]}]
        for wav in wavs
    ]
    out = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    return [o.outputs[0].text for o in out]


def _audio_part(wav: bytes) -> dict:
    return {"data": base64.b64encode(wav).decode(), "format": "wav"}


def _clips(wav: bytes) -> tuple[list[tuple[int, int]], list[bytes]]:
    """Where the server cuts this recording (the same decoding, the same cut function), and each clip as a
    WAV file of float samples (exact)."""
    wave = load_audio(wav, RATE, MediaLimits(max_audio_seconds=600.0))
    bounds = speech_chunk_bounds(wave, 30 * RATE, RATE)
    files = []
    for start, end in bounds:
        buf = io.BytesIO()
        soundfile.write(buf, wave[start:end], RATE, format="WAV", subtype="FLOAT")
        files.append(buf.getvalue())
    return bounds, files


@pytest.fixture(scope="module")
def long_answers(llm):
    """The clips of ``LONG`` and the engine's greedy transcription of each."""
    bounds, files = _clips(LONG)
    return bounds, _direct_clips(llm, "transcribe", None, files)


def _post(server, path: str = "transcriptions", files=None, data=None, **kw) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/audio/{path}", files=files, data=data, timeout=60, **kw)


def _error(r: httpx.Response) -> dict:
    return r.json()["error"]


def _assert_usage(usage, output_tokens: int | None = None) -> None:
    usage = usage if isinstance(usage, dict) else usage.model_dump()
    assert usage["type"] == "tokens"
    details = usage["input_token_details"]
    assert details["audio_tokens"] == 25  # 1 s of audio: 25 soft tokens (Gemma 4 hears 25 a second)
    assert details["text_tokens"] + details["audio_tokens"] == usage["input_tokens"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert 0 < usage["output_tokens"] <= MAX_TOKENS
    if output_tokens is not None:
        assert usage["output_tokens"] == output_tokens


# ---- the prompt ------------------------------------------------------------------------------------------
def test_instructions_follow_gemma4_audio_usage():
    asr = speech_instruction("transcribe", "German")
    assert asr.startswith("Transcribe the following speech segment in German into German text.")
    assert "Only output the transcription, with no newlines." in asr
    assert speech_instruction("transcribe", None).startswith(
        "Transcribe the following speech segment in its original language."
    )
    ast = speech_instruction("translate", "French")
    assert ast.startswith(
        "Transcribe the following speech segment in French, then translate it into English."
    )
    assert "then output the string 'English: ', then the translation in English." in ast
    # English speech is transcribed, not translated into itself.
    assert speech_instruction("translate", "English") == speech_instruction("transcribe", "English")
    assert speech_instruction("transcribe", None, "Anna, Zürich").endswith("Anna, Zürich")
    [turn] = speech_messages("transcribe", None)
    assert turn["role"] == "user" and [p["type"] for p in turn["content"]] == ["audio", "text"]
    assert language_name("en") == language_name("EN-us") == "English"
    with pytest.raises(ValueError, match="^language: "):
        language_name("klingon")


def test_translation_is_read_after_the_english_marker_also_when_streamed():
    reply = "Guten Morgen.\nEnglish:  Good morning."
    assert extract_translation(reply) == "Good morning."
    assert extract_translation("no marker here") == "no marker here"
    for pieces in (["Guten Morgen.\nEngl", "ish:", "  ", " Good", " morning."], [reply], ["no ", "marker"]):
        stream = TranslationStream()
        sent = "".join(stream.feed(p) for p in pieces) + stream.finish()
        assert sent == extract_translation("".join(pieces))


CLIP_REPLIES = [
    [" Guten", " Morgen. ", " \n"],
    ["  ", "\n"],  # a clip of silence: nothing said
    ["Wie geht", "'s?\nEng", "lish: How", " are you?  "],
    ["no marker ", " here "],
]


def test_clip_answers_are_stripped_and_joined_by_one_space_also_when_streamed():
    assert join_transcripts([" a b ", "", "  ", "c\n", "d"]) == "a b c d"
    assert join_transcripts([]) == join_transcripts(["  "]) == ""
    for extract in (False, True):
        stream = TranscriptStream(extract)
        sent = []
        for pieces in CLIP_REPLIES:
            sent += [stream.feed(piece) for piece in pieces] + [stream.end_clip()]
        replies = ["".join(pieces) for pieces in CLIP_REPLIES]
        expected = join_transcripts([extract_translation(r) if extract else r for r in replies])
        assert "".join(sent) == stream.text == expected
    assert expected == "Guten Morgen. How are you? no marker  here"


def test_clips_decoded_at_once_are_sent_in_clip_order():
    in_order = ClipsInOrder(len(CLIP_REPLIES), extract=False)
    arrivals = [(i, j) for i, pieces in enumerate(CLIP_REPLIES) for j in range(len(pieces))]
    arrivals.sort(key=lambda at: (-at[0], at[1]))  # the last clip first, each clip's own pieces in order
    sent = []
    for i, j in arrivals:
        pieces = in_order.add(i, CLIP_REPLIES[i][j], finished=j == len(CLIP_REPLIES[i]) - 1)
        assert not pieces or i == 0 or sent  # nothing of a later clip goes before the first clip's text
        sent += pieces
    assert "".join(sent) == join_transcripts(["".join(pieces) for pieces in CLIP_REPLIES])
    assert sent[0] == "Guten"


def _delta(index: int, text: str, finished: bool = False) -> StreamDelta:
    return StreamDelta(f"clip-{index}", text, [1], finished, "stop" if finished else None, None, 10, 1)


def test_a_failing_clip_ends_the_stream_with_an_error_and_closes_every_clip():
    closed = []

    async def clip(index: int, fail: bool):
        try:
            yield _delta(index, f"clip{index}")
            await asyncio.sleep(0.01)
            if fail:
                raise RuntimeError("internal error while streaming request clip-1")
            await asyncio.Event().wait()  # still decoding when the other clip fails
        finally:
            closed.append(index)

    async def run() -> list[dict]:
        serving = SimpleNamespace(record=lambda delta, received: None)
        deltas = OpenAIServing.merged(serving, [clip(0, False), clip(1, True), clip(2, False)], 0.0)
        events = speech_stream(deltas, 3, False, _TokenCounts(30, 25))
        return [json.loads(event[len("data: ") :]) async for event in events]

    events = asyncio.run(run())
    assert events[0] == {"type": "transcript.text.delta", "delta": "clip0"}
    assert len(events) == 2 and events[1]["error"]["code"] == 500, events
    assert sorted(closed) == [0, 1, 2]


# ---- happy paths ---------------------------------------------------------------------------------------
def test_json_transcript_is_the_engines_greedy_answer(server, client, llm):
    resp = client.audio.transcriptions.create(
        model="tiny", file=("clip.wav", WAV, "audio/wav"), language="de", extra_body=EXTRA
    )
    assert resp.text == _direct(llm, "transcribe", "German", WAV)
    _assert_usage(resp.usage)
    # temperature defaults to 0: the same audio gives the same text.
    again = client.audio.transcriptions.create(
        model="g4-tiny", file=("clip.wav", WAV), language="de", temperature=0, extra_body=EXTRA
    )
    assert again.text == resp.text
    # Without a language the instruction lets the model hear which; a prompt is passed on as context.
    hinted = client.audio.transcriptions.create(
        model="tiny", file=("clip.wav", WAV), prompt="Anna, Zürich", extra_body=EXTRA
    )
    assert hinted.text == _direct(llm, "transcribe", None, WAV, "Anna, Zürich")
    server.wait_idle()


def test_text_srt_vtt_and_verbose_json(server, client, llm):
    expected = _direct(llm, "transcribe", None, WAV)
    text = client.audio.transcriptions.create(
        model="tiny", file=("a.wav", WAV), response_format="text", extra_body=EXTRA
    )
    assert text == expected
    srt = client.audio.transcriptions.create(
        model="tiny", file=("a.wav", WAV), response_format="srt", extra_body=EXTRA
    )
    assert srt.startswith("1\n00:00:00,000 --> 00:00:01,000\n")
    vtt = client.audio.transcriptions.create(
        model="tiny", file=("a.wav", WAV), response_format="vtt", extra_body=EXTRA
    )
    assert vtt.startswith("WEBVTT\n\n00:00:00.000 --> 00:00:01.000\n")
    for cues in (srt, vtt):
        cue_text = cues.split("\n", 3 if cues is vtt else 2)[-1].strip()
        assert cue_text == "\n".join(line for line in expected.splitlines() if line.strip()).strip()
    verbose = client.audio.transcriptions.create(
        model="tiny",
        file=("a.wav", WAV),
        response_format="verbose_json",
        timestamp_granularities=["segment"],
        language="en",
        extra_body=EXTRA,
    )
    assert verbose.text == _direct(llm, "transcribe", "English", WAV)
    assert verbose.task == "transcribe" and verbose.language == "english" and verbose.duration == 1.0
    [segment] = verbose.segments
    assert (segment.start, segment.end, segment.text) == (0.0, 1.0, verbose.text)
    assert len(segment.tokens) == verbose.usage.output_tokens
    assert segment.avg_logprob <= 0 and segment.temperature == 0
    _assert_usage(verbose.usage, len(segment.tokens))
    server.wait_idle()


def test_streamed_transcript_events(server, client):
    whole = client.audio.transcriptions.create(model="tiny", file=("a.wav", WAV), extra_body=EXTRA)
    events = list(
        client.audio.transcriptions.create(model="tiny", file=("a.wav", WAV), stream=True, extra_body=EXTRA)
    )
    *deltas, done = events
    assert deltas and all(e.type == "transcript.text.delta" for e in deltas)
    assert done.type == "transcript.text.done"
    assert "".join(e.delta for e in deltas) == done.text == whole.text
    _assert_usage(done.usage, whole.usage.output_tokens)
    server.wait_idle()


def test_a_client_leaving_a_stream_frees_its_blocks(server):
    with httpx.stream(
        "POST",
        f"{server.base_url}/v1/audio/transcriptions",
        files={"file": ("a.wav", WAV)},
        data={"model": "tiny", "stream": "true", "max_completion_tokens": "200"},
        timeout=60,
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
        assert json.loads(first[len("data: ") :])["type"] == "transcript.text.delta"
    server.wait_idle()


def test_a_long_recording_is_heard_in_clips_and_joined(server, client, long_answers):
    bounds, answers = long_answers
    assert len(bounds) == 3
    resp = client.audio.transcriptions.create(model="tiny", file=("long.wav", LONG), extra_body=EXTRA)
    assert resp.text == join_transcripts(answers)
    usage = resp.usage.model_dump()
    assert abs(usage["input_token_details"]["audio_tokens"] - 25 * 70) <= 3  # 25 a second, in 3 clips
    assert usage["input_tokens"] == sum(usage["input_token_details"].values())
    # max_completion_tokens holds for each clip.
    assert 3 <= usage["output_tokens"] <= 3 * MAX_TOKENS
    verbose = client.audio.transcriptions.create(
        model="tiny", file=("long.wav", LONG), response_format="verbose_json", extra_body=EXTRA
    )
    assert verbose.text == resp.text and verbose.duration == 70.0
    segments = verbose.segments
    assert [(s.start, s.end) for s in segments] == [
        (round(a / RATE, 3), round(b / RATE, 3)) for a, b in bounds
    ]
    assert segments[0].start == 0.0 and segments[-1].end == verbose.duration
    for segment, following in zip(segments, segments[1:]):
        assert segment.start < segment.end == following.start < following.end
    # Each cut lands in the pause before its 30 s limit.
    for segment, (pause_start, pause_end) in zip(segments, PAUSES):
        assert pause_start < segment.end < pause_end
    assert [s.id for s in segments] == [0, 1, 2] and [s.text for s in segments] == [
        a.strip() for a in answers
    ]
    assert sum(len(s.tokens) for s in segments) == verbose.usage.output_tokens
    assert verbose.usage.input_tokens == usage["input_tokens"]
    # SRT: a cue per segment with text, at the segment's times.
    srt = client.audio.transcriptions.create(
        model="tiny", file=("long.wav", LONG), response_format="srt", extra_body=EXTRA
    )
    timings = [line for line in srt.splitlines() if " --> " in line]
    assert timings == [f"{_srt_time(s.start)} --> {_srt_time(s.end)}" for s in segments if s.text]
    assert srt.startswith("1\n") and len(timings) >= 1
    server.wait_idle()


def _srt_time(seconds: float) -> str:
    ms = round(seconds * 1000)
    return f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d},{ms % 1000:03d}"


def test_a_long_recording_streams_clip_after_clip(server, client, long_answers):
    _, answers = long_answers
    events = list(
        client.audio.transcriptions.create(
            model="tiny", file=("long.wav", LONG), stream=True, extra_body=EXTRA
        )
    )
    *deltas, done = events
    assert deltas and all(e.type == "transcript.text.delta" for e in deltas)
    # In clip order: the deltas spell the clips' answers one after the other.
    assert "".join(e.delta for e in deltas) == done.text == join_transcripts(answers)
    assert 3 <= done.usage.output_tokens <= 3 * MAX_TOKENS
    server.wait_idle()


def test_a_client_leaving_a_long_stream_aborts_every_clip(server):
    # The default output budget (up to 448 tokens a clip): clips are usually still decoding when the client
    # goes. The random model may end every clip early (EOS), and then there is no abort to observe.
    with httpx.stream(
        "POST",
        f"{server.base_url}/v1/audio/transcriptions",
        files={"file": ("long.wav", LONG)},
        data={"model": "tiny", "stream": "true"},
        timeout=60,
    ) as r:
        assert r.status_code == 200
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
        assert json.loads(first[len("data: ") :])["type"] == "transcript.text.delta"
        running = [rid for rid in list(server.engine.requests) if rid.startswith("trsc-")]
    server.wait_idle(timeout_s=5.0)  # aborted, not decoded to the end
    if not running:
        pytest.skip("every clip had finished before the first delta arrived: no abort to observe")


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the openai client's, on translations
def test_translation_is_english_text_from_the_ast_instruction(server, client, llm):
    resp = client.audio.translations.create(model="tiny", file=("a.wav", WAV), extra_body=EXTRA)
    # The random model never writes the "English:" marker: its whole answer is the text.
    expected = extract_translation(_direct(llm, "translate", None, WAV))
    assert resp.text == expected
    with_source = client.audio.translations.create(
        model="tiny", file=("a.wav", WAV), extra_body={**EXTRA, "language": "fr"}
    )
    assert with_source.text == extract_translation(_direct(llm, "translate", "French", WAV))
    text = client.audio.translations.create(
        model="tiny", file=("a.wav", WAV), response_format="text", extra_body=EXTRA
    )
    assert text == expected
    r = _post(
        server,
        "translations",
        files={"file": ("a.wav", WAV)},
        data={"model": "tiny", "stream": "true", **{k: str(v) for k, v in EXTRA.items()}},
    )
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1]["type"] == "transcript.text.done" and events[-1]["text"] == expected
    assert "".join(e["delta"] for e in events[:-1]) == expected
    server.wait_idle()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the openai client's, on translations
def test_a_long_translation_joins_each_clips_translation(server, client, llm):
    _, files = _clips(LONG)
    answers = _direct_clips(llm, "translate", None, files)
    expected = join_transcripts([extract_translation(answer) for answer in answers])
    resp = client.audio.translations.create(model="tiny", file=("long.wav", LONG), extra_body=EXTRA)
    assert resp.text == expected
    r = _post(
        server,
        "translations",
        files={"file": ("long.wav", LONG)},
        data={"model": "tiny", "stream": "true", **{k: str(v) for k, v in EXTRA.items()}},
    )
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1]["type"] == "transcript.text.done" and events[-1]["text"] == expected
    assert "".join(e["delta"] for e in events[:-1]) == expected
    server.wait_idle()


# ---- hostile and wrong input -------------------------------------------------------------------------------
def _wav_claiming(rate: int, num_bytes: int = 32_000) -> bytes:
    fmt = struct.pack("<HHIIHH", 1, 1, rate, (rate * 2) & 0xFFFFFFFF, 2, 16)
    data = bytes(num_bytes)
    riff = b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt + b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(riff)) + riff


FILE = {"file": ("a.wav", WAV, "audio/wav")}
MODEL = {"model": "tiny"}
HOSTILE = {
    "not-audio": (
        {"file": ("a.wav", b"this is a text file, not audio at all " * 20)},
        MODEL,
        "file",
        "could not decode audio",
    ),
    "ffconcat": (
        {"file": ("a.wav", b"ffconcat version 1.0\nfile '/etc/passwd'\n")},
        MODEL,
        "file",
        "could not decode audio",
    ),
    "hls": (
        {"file": ("a.m3u8", b"#EXTM3U\n#EXT-X-TARGETDURATION:10\n#EXTINF:10,\nfile:///etc/passwd\n")},
        MODEL,
        "file",
        "could not decode audio",
    ),
    # Over max_request_audio_seconds (600 s; at 1 kHz to stay under the body limit).
    "too-long": ({"file": ("a.wav", _wav(600.1, rate=1000))}, MODEL, "file", "longer than 600 s"),
    "huge-rate": ({"file": ("a.wav", _wav_claiming(1_000_000))}, MODEL, "file", "sample rate"),
    "rate-2^31": ({"file": ("a.wav", _wav_claiming(2**31))}, MODEL, "file", "audio"),
    "tiny-rate": ({"file": ("a.wav", _wav_claiming(1))}, MODEL, "file", "sample rate"),
    "empty-file": ({"file": ("a.wav", b"")}, MODEL, "file", "empty"),
    "missing-file": ({"other": ("a.wav", WAV)}, MODEL, "file", "required"),
    "file-as-text": ({"file": (None, "UklGRiQAAABXQVZF")}, MODEL, "file", "file part"),
    "model-as-file": ({**FILE, "model": ("m.txt", b"tiny")}, {}, "model", "text field"),
    "unknown-model": (FILE, {"model": "whisper-1"}, "model", "does not exist"),
    "temperature-word": (FILE, {**MODEL, "temperature": "hot"}, "temperature", "number"),
    "temperature-nan": (FILE, {**MODEL, "temperature": "nan"}, "temperature", "number"),
    "temperature-high": (FILE, {**MODEL, "temperature": "1.5"}, "temperature", "number"),
    "stream-word": (FILE, {**MODEL, "stream": "maybe"}, "stream", "true or false"),
    "stream-verbose": (FILE, {**MODEL, "stream": "true", "response_format": "srt"}, "stream", "json or text"),
    "format": (FILE, {**MODEL, "response_format": "xml"}, "response_format", "expected one of"),
    "language": (FILE, {**MODEL, "language": "klingon"}, "language", "ISO-639-1"),
    "max-tokens": (FILE, {**MODEL, "max_completion_tokens": "-3"}, "max_completion_tokens", "positive"),
    "max-tokens-huge": (
        FILE,
        {**MODEL, "max_completion_tokens": "100000"},
        "max_completion_tokens",
        "max_model_len",
    ),
    "prompt-long": (FILE, {**MODEL, "prompt": "x" * 5000}, "prompt", "at most"),
    "duplicate": (
        [("file", ("a.wav", WAV)), ("model", (None, "tiny")), ("model", (None, "tiny"))],
        None,
        "model",
        "more than once",
    ),
    "two-files": ([("file", ("a.wav", WAV)), ("file", ("b.wav", WAV))], MODEL, "file", "more than once"),
    "word-timestamps": (
        FILE,
        {**MODEL, "timestamp_granularities[]": "word"},
        "timestamp_granularities[]",
        "segment",
    ),
    "include": (FILE, {**MODEL, "include[]": "logprobs"}, "include[]", "not available"),
}


@pytest.mark.parametrize("path", ["transcriptions", "translations"])
@pytest.mark.parametrize("case", list(HOSTILE))
def test_bad_input_is_a_400_naming_the_field(server, case, path):
    files, data, param, words = HOSTILE[case]
    r = _post(server, path, files=files, data=data)
    assert r.status_code == (404 if case == "unknown-model" else 400), r.text
    error = _error(r)
    assert error["param"] == param and words in error["message"], error
    assert "/etc/passwd" not in r.text
    server.wait_idle()


def test_bodies_that_are_not_a_multipart_form(server, client):
    r = httpx.post(f"{server.base_url}/v1/audio/transcriptions", json={"file": "x", "model": "tiny"})
    assert r.status_code == 400 and _error(r)["param"] == "body", r.text
    broken = httpx.post(
        f"{server.base_url}/v1/audio/transcriptions",
        content=b"--abc\r\nContent-Disposition: form-data\r\n\r\nx\r\n--abc--\r\n",
        headers={"content-type": "multipart/form-data; boundary=abc"},
    )
    assert broken.status_code == 400 and _error(broken)["param"] == "body", broken.text
    odd = [
        (b"", "multipart/form-data"),  # no boundary
        (b"garbage", "multipart/form-data; boundary=abc"),
        (b"--abc\r\nX-No-Disposition: 1\r\n\r\nx\r\n--abc--\r\n", "multipart/form-data; boundary=abc"),
        (b"--abc\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\n\xff\xfe\r\n--abc--\r\n",
         "multipart/form-data; boundary=abc; charset=utf-8"),
        (b"--abc\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\ntiny\r\n--abc--\r\n",
         "multipart/form-data; boundary=abc; charset=no-such-charset"),
    ]  # fmt: skip
    for content, content_type in odd:
        r = httpx.post(
            f"{server.base_url}/v1/audio/transcriptions",
            content=content,
            headers={"content-type": content_type},
        )
        assert r.status_code in (400, 404), r.text
    many = [(f"f{i}", (f"{i}.wav", b"x")) for i in range(5)]
    too_many_files = _post(server, files=many, data=MODEL)
    assert too_many_files.status_code == 400 and _error(too_many_files)["param"] == "body"
    # The openai client's own error for one of them, and the server serves on with every block back.
    with pytest.raises(openai.BadRequestError) as info:
        client.audio.transcriptions.create(model="tiny", file=("a.txt", b"plain text"), extra_body=EXTRA)
    assert info.value.body["param"] == "file"
    server.wait_idle()
    assert client.audio.transcriptions.create(model="tiny", file=("a.wav", WAV), extra_body=EXTRA).text != ""


def test_a_body_over_the_limit_is_a_413(server):
    big = bytes(5 << 20)  # over the test server's --max-request-body-bytes (4 MiB)
    r = _post(server, files={"file": ("a.wav", big)}, data=MODEL)
    assert r.status_code == 413, r.text

    def chunked():  # no Content-Length: counted while reading
        yield b'--abc\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\n'
        for _ in range(5):
            yield bytes(1 << 20)
        yield b"\r\n--abc--\r\n"

    r = httpx.post(
        f"{server.base_url}/v1/audio/transcriptions",
        content=chunked(),
        headers={"content-type": "multipart/form-data; boundary=abc"},
        timeout=60,
    )
    assert r.status_code == 413, r.text
    server.wait_idle()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the openai client's, on translations
def test_a_model_without_an_audio_tower_says_so(server_factory, tiny_model_dir):
    running = server_factory(
        tiny_model_dir, "--served-model-name", "deaf", "--limit-mm-per-prompt", '{"audio": 0}'
    )
    assert not running.app.state.engine.accepts_audio
    c = openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="unused", max_retries=0)
    for create in (c.audio.transcriptions.create, c.audio.translations.create):
        with pytest.raises(openai.BadRequestError) as info:
            create(model="deaf", file=("a.wav", WAV))
        assert info.value.body["param"] == "model"
        assert "audio tower" in info.value.body["message"]
    running.wait_idle()
