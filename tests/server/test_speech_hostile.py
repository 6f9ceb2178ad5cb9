"""Hostile uploads to ``/v1/audio/transcriptions`` and ``/v1/audio/translations`` and hostile ``input_audio``
on chat completions, beyond tests/server/test_audio_transcriptions.py: files that crashed the server
process, raised a 500, fed NaN to the model or cost far more to decode than their size, and form fields
that were blamed on the wrong field. Each is a 400 naming the field, and the server answers the next
request. Also the streamed translation's marker search, which was quadratic in the reply."""

from __future__ import annotations

import base64
import io
import struct
import time

import av
import httpx
import numpy as np
import pytest
import soundfile

from g4serve.processing.asr_prompt import TranscriptStream, TranslationStream, extract_translation

pytest.importorskip("python_multipart")
SR = 16_000
MODEL = {"model": "tiny", "max_completion_tokens": "4"}


def _tone(seconds: float = 0.5) -> np.ndarray:
    return (0.3 * np.sin(2 * np.pi * 330 * np.arange(round(seconds * SR)) / SR)).astype(np.float32)


def _float_wav(samples: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, SR, format="WAV", subtype="FLOAT")
    return buffer.getvalue()


def _wav_tag(tag: int, bits: int = 16) -> bytes:
    """A WAV whose format tag FFmpeg has no decoder for (libsndfile refuses it too)."""
    block = bits // 8
    fmt = struct.pack("<HHIIHH", tag, 1, SR, SR * block, block, bits)
    data = bytes(16_000)
    riff = b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt + b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(riff)) + riff


def _mka_7_1(seconds: float = 0.5) -> bytes:
    """Matroska (PyAV decodes it, libsndfile cannot) holding 7.1 PCM: PyAV's planar frames of 8 channels
    made ``to_ndarray`` read past their plane pointers, a segmentation fault of the server."""
    pcm = (np.random.default_rng(0).standard_normal((1, round(seconds * SR) * 8)) * 3000).astype(np.int16)
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="matroska") as container:
        stream = container.add_stream("pcm_s16le", rate=SR, layout="7.1")
        frame = av.AudioFrame.from_ndarray(pcm, format="s16", layout="7.1")
        frame.sample_rate = SR
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            container.mux(packet)
    return buffer.getvalue()


def _post(server, files, data, path: str = "transcriptions") -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/audio/{path}", files=files, data=data, timeout=60)


def _chat(server, audio: bytes) -> httpx.Response:
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(audio).decode(), "format": "wav"}}
    body = {
        "model": "tiny",
        "max_tokens": 2,
        "messages": [{"role": "user", "content": [part, {"type": "text", "text": "hi"}]}],
    }
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)


def test_seven_one_audio_is_heard_and_the_server_lives(server):
    mka = _mka_7_1()
    r = _post(server, {"file": ("a.mka", mka)}, MODEL)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["input_token_details"]["audio_tokens"] > 0
    assert _chat(server, mka).status_code == 200
    server.wait_idle()


NAN = _tone()
NAN[100:200] = np.nan
INF = _tone()
INF[7] = np.inf
HUGE = _tone()
HUGE[7] = 3e38
BAD_FILES = {
    "no-decoder-tag-0": (_wav_tag(0), "could not decode audio"),
    "no-decoder-float-16-bit": (_wav_tag(3), "could not decode audio"),
    "nan-samples": (_float_wav(NAN), "samples must be finite"),
    "inf-samples": (_float_wav(INF), "samples must be finite"),
    "overflowing-samples": (_float_wav(HUGE), "samples must be finite"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_audio_is_a_400_naming_the_file_not_a_500(server, case):
    """A WAV without a decoder was a 500 (AttributeError); NaN, infinite or float32-max samples were heard
    as NaN features, and the model answered <pad> tokens with NaN logprobs."""
    data, words = BAD_FILES[case]
    began = time.perf_counter()
    for path in ("transcriptions", "translations"):
        r = _post(server, {"file": ("a.wav", data)}, MODEL, path)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "file" and words in error["message"], error
    chat = _chat(server, data)
    assert chat.status_code == 400, chat.text
    assert words in chat.json()["error"]["message"]
    assert time.perf_counter() - began < 1.5
    server.wait_idle()
    ok = _post(server, {"file": ("a.wav", _float_wav(_tone()))}, MODEL)
    assert ok.status_code == 200, ok.text


def test_the_decoded_samples_cap_names_the_file(server, monkeypatch):
    """A file whose decoding passes the request's budget of frames x channels is a 400 ``file`` (not
    ``multi_modal_data``, the chat API's name for the request's media)."""
    speech = server.app.state.serving_speech
    monkeypatch.setattr(
        speech, "media_limits", type(speech.media_limits)(max_request_decoded_audio_samples=SR)
    )
    stereo = io.BytesIO()
    soundfile.write(stereo, np.zeros((SR, 2), np.float32), SR, format="WAV", subtype="PCM_16")
    r = _post(server, {"file": ("a.wav", stereo.getvalue())}, MODEL)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "file", error
    assert error["message"].startswith("file: decoding the audio") and "frames x channels" in error["message"]


@pytest.mark.parametrize("token", ["<|audio|>", "<|image|>", "<|video|>"])
def test_a_media_placeholder_in_the_prompt_is_the_prompts_fault(server, token):
    """The prompt joins the instruction as text: a media placeholder in it made the processor count one
    placeholder too many, and the 400 blamed ``file``."""
    r = _post(server, {"file": ("a.wav", _float_wav(_tone()))}, {**MODEL, "prompt": f"say {token} twice"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "prompt" and token in error["message"], error
    server.wait_idle()


def test_a_streamed_translation_without_its_marker_is_linear():
    """TranslationStream copied and searched the whole reply for ``English:`` on every delta: 120,000
    deltas of a reply that never says it took 20 s of the event loop (quadratic)."""
    stream = TranscriptStream(extract=True)
    began = time.perf_counter()
    for _ in range(100_000):
        assert stream.feed("abcd") == ""
    assert stream.end_clip() == "abcd" * 100_000
    whitespace = TranscriptStream(extract=False)
    whitespace.feed("words")
    for _ in range(100_000):
        whitespace.feed(" \n")
    assert whitespace.feed("more") == " \n" * 100_000 + "more"
    assert time.perf_counter() - began < 1.0


@pytest.mark.parametrize(
    "pieces",
    [
        ["Hallo.\nEngl", "ish:", " Hel", "lo."],
        ["Hallo.\nE", "n", "g", "l", "i", "s", "h", ":", "  Hello."],
        ["Hallo.\nEnglish: Hello. English: twice"],
        ["no", " marker"],
        ["English:"],
        ["Eng", "lish", ": ", "", "x"],
    ],
)
def test_the_marker_is_found_however_the_reply_is_split(pieces):
    stream = TranslationStream()
    sent = "".join(stream.feed(p) for p in pieces) + stream.finish()
    assert sent == extract_translation("".join(pieces))
