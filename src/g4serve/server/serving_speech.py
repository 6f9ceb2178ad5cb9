"""``POST /v1/audio/transcriptions`` and ``POST /v1/audio/translations`` (OpenAI's speech-to-text API): a
multipart upload -> the audio decoded under the server's media caps -> Gemma 4's ASR or AST instruction
with the audio in one user turn -> one engine request through the audio tower (greedy unless
``temperature`` says otherwise), answered as json, text, verbose_json, srt or vtt, or streamed as
``transcript.text.delta`` / ``transcript.text.done`` events."""

from __future__ import annotations

import asyncio
import functools
import math
import time
import uuid
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.datastructures import FormData, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser

from g4serve.engine.async_engine import EngineDeadError, StreamDelta
from g4serve.processing.asr_prompt import (
    TranslationStream,
    extract_translation,
    language_name,
    speech_messages,
)
from g4serve.processing.audio import SAMPLING_RATE, load_audio, output_samples_cap
from g4serve.processing.processor import ProcessedPrompt
from g4serve.sampling_params import SamplingParams
from g4serve.server.errors import APIError
from g4serve.server.serving_base import OpenAIServing
from g4serve.server.streaming import Choice, sse, sse_error

RESPONSE_FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
STREAM_FORMATS = ("json", "text")
# Output tokens when the request sets no max_completion_tokens: Whisper's decoder limit; 30 s of speech
# is about 100 words.
DEFAULT_MAX_TOKENS = 448
MAX_PROMPT_CHARS = 4096
# The form: one file part, a few text fields of at most 64 KiB each (starlette refuses more while parsing);
# a second file part is parsed (within the body limit) so that the error can name its field.
MAX_FORM_FILES = 4
MAX_FORM_FIELDS = 32
MAX_FIELD_BYTES = 64 << 10
_TEXT_FIELDS = (
    "model",
    "language",
    "prompt",
    "response_format",
    "temperature",
    "stream",
    "max_completion_tokens",
)
_LIST_FIELDS = ("timestamp_granularities[]", "include[]")


@dataclass
class SpeechRequest:
    """One validated transcription or translation request."""

    task: str  # "transcribe" | "translate"
    model: str
    audio: bytes
    language: str | None  # the language's English name
    prompt: str | None
    response_format: str
    temperature: float
    stream: bool
    max_tokens: int | None

    @property
    def extracts_translation(self) -> bool:
        """An AST answer (transcription, newline, ``English: `` translation): English speech is only
        transcribed."""
        return self.task == "translate" and self.language != "English"


class OpenAIServingSpeech(OpenAIServing):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.media_limits = self.engine.config.media_limits()

    async def create(self, request: Request, task: str):
        received = time.monotonic()
        req = await self.read_speech(request, task)
        wave = await self.decode(req.audio)
        processed = await self.prepare(req, wave)
        params = self.speech_params(req, processed)
        request_id = f"{'trsc' if task == 'transcribe' else 'trsl'}-{uuid.uuid4().hex}"
        try:
            admitted = await self.admit(processed, params, request_id, priority=0)
        except APIError as exc:
            if exc.param == "max_tokens":  # this API's name for it
                raise APIError(
                    400, exc.message.replace("max_tokens", "max_completion_tokens"), None
                ) from None
            raise
        streams = self.stream(admitted)
        counts = _TokenCounts(len(processed.token_ids), sum(it.num_tokens for it in processed.mm_items))
        if req.stream:
            return StreamingResponse(
                speech_stream(self.merged(streams, received), req.extracts_translation, counts),
                media_type="text/event-stream",
            )
        choices, _ = await self.collect(request, streams, 1, received)
        return speech_response(req, choices[0], counts, len(wave) / SAMPLING_RATE)

    # ---- the form ----------------------------------------------------------------------------------
    async def read_speech(self, request: Request, task: str) -> SpeechRequest:
        """The multipart form as a ``SpeechRequest``; every field checked, a 400 naming the first bad one."""
        form = await self.read_form(request)
        try:
            return await self._validate(form, task)
        finally:
            await form.close()

    async def read_form(self, request: Request) -> FormData:
        """The body, read in chunks up to ``--max-request-body-bytes`` (413 past it), parsed as a multipart
        form of at most ``MAX_FORM_FILES`` file parts and ``MAX_FORM_FIELDS`` text fields of
        ``MAX_FIELD_BYTES`` each; a full waiting queue answers 429 before any of it is read."""
        self.waiting.check()
        content_type = request.headers.get("content-type", "")
        if not content_type.lower().startswith("multipart/form-data"):
            raise APIError(
                400, "body: must be multipart/form-data, with the audio in a 'file' part", param="body"
            )
        limit = self.config.max_request_body_bytes

        async def bounded() -> AsyncIterator[bytes]:
            size = 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise APIError(413, f"request body exceeds the limit of {limit} bytes")
                yield chunk

        parser = MultiPartParser(
            request.headers,
            bounded(),
            max_files=MAX_FORM_FILES,
            max_fields=MAX_FORM_FIELDS,
            max_part_size=MAX_FIELD_BYTES,
        )
        try:
            return await parser.parse()
        except MultiPartException as exc:
            raise APIError(400, f"body: invalid multipart form: {exc.message}", param="body") from None

    async def _validate(self, form: FormData, task: str) -> SpeechRequest:
        fields = _form_fields(form)
        model = self.check_model(_text(fields, "model"))
        if not self.engine.accepts_audio:
            raise APIError(
                400,
                f"model: '{model}' takes no audio: transcriptions and translations need a Gemma 4 model with "
                "an audio tower (E2B, E4B) served with audio inputs allowed (not --text-only, "
                "--limit-mm-per-prompt audio > 0)",
                param="model",
            )
        language = _text(fields, "language")
        if language is not None:
            try:
                language = language_name(language)
            except ValueError as exc:
                raise APIError(400, str(exc), param="language") from None
        prompt = _text(fields, "prompt")
        if prompt is not None and len(prompt) > MAX_PROMPT_CHARS:
            raise APIError(400, f"prompt: at most {MAX_PROMPT_CHARS} characters, got {len(prompt)}", "prompt")
        response_format, stream = _output_form(fields)
        temperature = _number(fields, "temperature", 0.0, 1.0)
        max_tokens = _positive_int(fields, "max_completion_tokens")
        return SpeechRequest(
            task=task,
            model=model,
            audio=await self._file_bytes(fields.get("file")),
            language=language,
            prompt=prompt or None,
            response_format=response_format,
            temperature=0.0 if temperature is None else temperature,
            stream=stream,
            max_tokens=max_tokens,
        )

    async def _file_bytes(self, upload: str | UploadFile | None) -> bytes:
        if upload is None:
            raise APIError(400, "file: required: the audio, as a multipart file part", param="file")
        if not isinstance(upload, UploadFile):
            raise APIError(400, "file: must be a file part (with a filename), not a text field", param="file")
        cap = self.media_limits.max_media_item_bytes
        if upload.size is not None and upload.size > cap:
            raise APIError(
                400, f"file: {upload.size} bytes exceed the limit of {cap} (max_media_item_bytes)", "file"
            )
        data = await upload.read(cap + 1)
        if len(data) > cap:
            raise APIError(400, f"file: more than {cap} bytes (max_media_item_bytes)", param="file")
        if not data:
            raise APIError(400, "file: the upload is empty", param="file")
        return data

    # ---- audio and prompt ----------------------------------------------------------------------------
    async def decode(self, data: bytes) -> np.ndarray:
        """The upload as 16 kHz mono, decoded off the event loop under the server's media caps (the demuxer
        whitelist, sample rate and channel limits, the decoded-frame cap). Audio longer than
        ``max_audio_seconds`` is refused, not cut: a transcript of part of the file would read as whole."""
        limits = self.media_limits
        # Decode a second past the cap: a clip that fills it is longer than the cap allows.
        probe = replace(limits, max_audio_seconds=limits.max_audio_seconds + 1.0)
        try:
            with self.waiting.preparing():
                wave = await asyncio.to_thread(load_audio, data, SAMPLING_RATE, probe)
        except (ValueError, OSError) as exc:
            raise APIError(400, f"file: {exc}", param="file") from None
        if len(wave) > output_samples_cap(limits):
            raise APIError(
                400,
                f"file: the audio is longer than {limits.max_audio_seconds:g} s, the most one request "
                "transcribes (--max-audio-seconds); send it in segments",
                param="file",
            )
        return wave

    async def prepare(self, req: SpeechRequest, wave: np.ndarray) -> ProcessedPrompt:
        """Gemma 4's instruction in the model's chat template (rendered in a thread), then the processor:
        the audio's log-mel features and its soft tokens in the prompt."""
        messages = speech_messages(req.task, req.language, req.prompt)
        render = functools.partial(self.tokenizer.apply_chat_template, messages, add_generation_prompt=True)
        prompt = await asyncio.to_thread(render)
        try:
            return await self.process({"prompt": prompt, "multi_modal_data": {"audio": [wave]}}, False)
        except APIError as exc:
            if exc.param and exc.param.startswith(("audio", "multi_modal_data")):
                raise APIError(400, f"file: {exc.message.partition(': ')[2]}", param="file") from None
            raise

    def speech_params(self, req: SpeechRequest, processed: ProcessedPrompt) -> SamplingParams:
        max_tokens = req.max_tokens
        if max_tokens is None:
            room = self.engine.max_model_len - len(processed.token_ids)
            if room <= 0:
                raise APIError(
                    400,
                    f"file: the prompt with this audio ({len(processed.token_ids)} tokens) leaves no room "
                    f"for a transcript in max_model_len={self.engine.max_model_len}",
                    param="file",
                )
            max_tokens = min(DEFAULT_MAX_TOKENS, room)
        logprobs = 0 if req.response_format == "verbose_json" else None  # avg_logprob of the segment
        return SamplingParams(temperature=req.temperature, max_tokens=max_tokens, logprobs=logprobs)


# ---- form fields -----------------------------------------------------------------------------------------
def _form_fields(form: FormData) -> dict[str, str | UploadFile]:
    """The known fields, each given once, text fields as text; list fields checked; the rest ignored (OpenAI
    fields this server does not implement, as the JSON endpoints ignore them)."""
    fields: dict[str, str | UploadFile] = {}
    for key, value in form.multi_items():
        if key in _LIST_FIELDS:
            _check_list_field(key, value)
        elif key in _TEXT_FIELDS or key == "file":
            if key in fields:
                raise APIError(400, f"{key}: given more than once", param=key)
            if key != "file" and not isinstance(value, str):
                raise APIError(400, f"{key}: must be a text field, not a file", param=key)
            fields[key] = value
    return fields


def _output_form(fields: dict) -> tuple[str, bool]:
    """(response_format, stream)."""
    response_format = _text(fields, "response_format") or "json"
    if response_format not in RESPONSE_FORMATS:
        raise APIError(
            400,
            f"response_format: expected one of {', '.join(RESPONSE_FORMATS)}, got {response_format[:40]!r}",
            param="response_format",
        )
    stream = _bool(fields, "stream")
    if stream and response_format not in STREAM_FORMATS:
        raise APIError(
            400,
            "stream: streamed answers are transcript.text events; response_format must be json or text, "
            f"not {response_format}",
            param="stream",
        )
    return response_format, stream


def _text(fields: dict, name: str) -> str | None:
    value = fields.get(name)
    return value if value is None or isinstance(value, str) else None


def _bool(fields: dict, name: str) -> bool:
    value = _text(fields, name)
    if value is None:
        return False
    lowered = value.strip().lower()
    if lowered not in ("true", "false"):
        raise APIError(400, f"{name}: must be true or false, got {value[:20]!r}", param=name)
    return lowered == "true"


def _number(fields: dict, name: str, low: float, high: float) -> float | None:
    value = _text(fields, name)
    if value is None:
        return None
    try:
        number = float(value) if len(value) <= 32 else math.nan
    except ValueError:
        number = math.nan
    if not (math.isfinite(number) and low <= number <= high):
        raise APIError(400, f"{name}: must be a number in [{low:g}, {high:g}], got {value[:20]!r}", name)
    return number


def _positive_int(fields: dict, name: str) -> int | None:
    value = _text(fields, name)
    if value is None:
        return None
    digits = value.strip()
    if not (digits.isascii() and digits.isdigit() and len(digits) <= 10 and 0 < int(digits) <= 2**31 - 1):
        raise APIError(400, f"{name}: must be a positive integer, got {value[:20]!r}", param=name)
    return int(digits)


def _check_list_field(name: str, value: Any) -> None:
    if not isinstance(value, str):
        raise APIError(400, f"{name}: must be a text field, not a file", param=name)
    if name == "timestamp_granularities[]" and value != "segment":
        raise APIError(
            400, f"{name}: only 'segment' timestamps are available, not {value[:20]!r}", param=name
        )
    if name == "include[]":
        raise APIError(400, f"{name}: {value[:20]!r} is not available from this server", param=name)


# ---- responses ------------------------------------------------------------------------------------------
@dataclass
class _TokenCounts:
    prompt_tokens: int
    audio_tokens: int

    def usage(self, output_tokens: int) -> dict[str, Any]:
        """OpenAI's token usage of a transcription."""
        return {
            "type": "tokens",
            "input_tokens": self.prompt_tokens,
            "input_token_details": {
                "text_tokens": self.prompt_tokens - self.audio_tokens,
                "audio_tokens": self.audio_tokens,
            },
            "output_tokens": output_tokens,
            "total_tokens": self.prompt_tokens + output_tokens,
        }


def speech_response(req: SpeechRequest, choice: Choice, counts: _TokenCounts, duration_s: float):
    reply = "".join(choice.text)
    text = extract_translation(reply) if req.extracts_translation else reply
    usage = counts.usage(len(choice.token_ids))
    if req.response_format == "json":
        return {"text": text, "usage": usage}
    if req.response_format == "text":
        return PlainTextResponse(text)
    if req.response_format == "srt":
        return PlainTextResponse(
            f"1\n{_timestamp(0.0, ',')} --> {_timestamp(duration_s, ',')}\n{_cue(text)}\n\n"
        )
    if req.response_format == "vtt":
        cue = f"{_timestamp(0.0, '.')} --> {_timestamp(duration_s, '.')}\n{_cue(text)}\n\n"
        return PlainTextResponse(f"WEBVTT\n\n{cue}", media_type="text/vtt")
    encoded = text.encode("utf-8")
    segment = {
        "id": 0,
        "seek": 0,
        "start": 0.0,
        "end": round(duration_s, 3),
        "text": text,
        "tokens": list(choice.token_ids),
        "temperature": req.temperature,
        "avg_logprob": _avg_logprob(choice),
        "compression_ratio": len(encoded) / len(zlib.compress(encoded)) if encoded else 0.0,
    }
    body = {
        "task": "transcribe" if req.task == "transcribe" else "translate",
        "language": req.language.lower() if req.language else None,
        "duration": round(duration_s, 3),
        "text": text,
        "segments": [segment],
        "usage": usage,
    }
    return JSONResponse(body)


def _avg_logprob(choice: Choice) -> float:
    chosen = []
    for token_id, entry in zip(choice.token_ids, choice.logprobs):
        logprob = entry.get(token_id) or next(iter(entry.values()), None)
        if logprob is not None and math.isfinite(logprob.logprob):
            chosen.append(logprob.logprob)
    return sum(chosen) / len(chosen) if chosen else 0.0


def _timestamp(seconds: float, decimal: str) -> str:
    millis = round(seconds * 1000)
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{decimal}{millis:03d}"


def _cue(text: str) -> str:
    """Cue text: no blank line (it would end the cue) and no ``-->`` (a timing line in WebVTT)."""
    lines = [line for line in text.replace("-->", "->").splitlines() if line.strip()]
    return "\n".join(lines)


async def speech_stream(
    deltas: AsyncIterator[tuple[int, StreamDelta]], extract: bool, counts: _TokenCounts
) -> AsyncIterator[str]:
    """OpenAI's transcription events: ``transcript.text.delta`` per piece of text, then
    ``transcript.text.done`` with the whole text and the usage. A translation sends nothing before the
    ``English:`` marker of the model's answer (all of it at the end when the marker never comes)."""
    translation = TranslationStream() if extract else None
    sent: list[str] = []
    output_tokens = 0
    try:
        async for _, delta in deltas:
            output_tokens += len(delta.token_ids)
            text = translation.feed(delta.text) if translation else delta.text
            if text:
                sent.append(text)
                yield sse({"type": "transcript.text.delta", "delta": text})
    except (EngineDeadError, RuntimeError) as exc:
        yield sse_error(exc)
        return
    finally:
        await deltas.aclose()
    rest = translation.finish() if translation else ""
    if rest:
        sent.append(rest)
        yield sse({"type": "transcript.text.delta", "delta": rest})
    yield sse({"type": "transcript.text.done", "text": "".join(sent), "usage": counts.usage(output_tokens)})


__all__ = ["OpenAIServingSpeech", "SpeechRequest", "speech_response", "speech_stream"]
