"""``/v1/audio/transcriptions`` and ``/v1/audio/translations`` on the tiny model (it has an audio tower),
driven by the official ``openai`` client and raw multipart HTTP.

The random model's transcript is noise: the tests hold the API contract (shapes, formats, events, errors)
and that the text is what the engine itself produces greedily for Gemma 4's ASR/AST instruction with
the same audio, not what it says."""

from __future__ import annotations

import base64
import io
import json
import struct

import httpx
import numpy as np
import pytest
import soundfile

from g4serve.processing.asr_prompt import (
    TranslationStream,
    extract_translation,
    language_name,
    speech_instruction,
    speech_messages,
)
from g4serve.sampling_params import SamplingParams

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


def _direct(llm, task: str, language: str | None, wav: bytes, prompt: str | None = None) -> str:
    """The engine's own greedy answer to Gemma 4's instruction with this audio, through ``LLM.chat``."""
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}
    text = {"type": "text", "text": speech_instruction(task, language, prompt)}
    out = llm.chat(
        [{"role": "user", "content": [part, text]}], SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    )
    return out[0].outputs[0].text


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
    "too-long": ({"file": ("a.wav", _wav(31.0))}, MODEL, "file", "longer than 30 s"),
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
