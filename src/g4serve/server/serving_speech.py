"""``POST /v1/audio/transcriptions`` and ``POST /v1/audio/translations`` (OpenAI's speech-to-text API): a
multipart upload -> the audio decoded under the server's media caps and cut into clips of at most
``max_audio_seconds`` (at quiet moments) -> per clip, Gemma 4's ASR or AST instruction with the clip in one
user turn, one engine request through the audio tower (greedy unless ``temperature`` says otherwise), all
clips submitted together -> their answers joined in order, as json, text, verbose_json (a segment per
clip), srt or vtt, or streamed as ``transcript.text.delta`` / ``transcript.text.done`` events."""

from __future__ import annotations

import asyncio
import functools
import math
import time
import uuid
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.datastructures import FormData, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser

from g4serve.engine.async_engine import EngineDeadError, StreamDelta
from g4serve.processing.asr_prompt import (
    TranscriptStream,
    extract_translation,
    join_transcripts,
    language_name,
    speech_messages,
)
from g4serve.processing.audio import SAMPLING_RATE, load_audio, output_samples_cap
from g4serve.processing.audio_chunks import speech_chunk_bounds
from g4serve.processing.limits import MediaBudget, MediaBudgetError
from g4serve.processing.processor import ProcessedPrompt
from g4serve.sampling_params import SamplingParams
from g4serve.server.errors import APIError
from g4serve.server.serving_base import OpenAIServing, budget_named
from g4serve.server.streaming import Choice, sse, sse_error

if TYPE_CHECKING:
    from g4serve.engine.request import Request as EngineRequest

RESPONSE_FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
STREAM_FORMATS = ("json", "text")
# Output tokens of each clip when the request sets no max_completion_tokens: Whisper's decoder limit; 30 s
# of speech is about 100 words.
DEFAULT_MAX_TOKENS = 448
# A long recording at 48 kHz (most recorders') must decode up to max_request_audio_seconds, past the
# default frame cap of a single clip (audio_max_frames, 16M frames: 333 s at 48 kHz).
_LONG_AUDIO_RATE = 48_000
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
        bounds = speech_chunk_bounds(wave, max(output_samples_cap(self.media_limits), 2), SAMPLING_RATE)
        prompts = await self.prepare(req, [wave[start:end] for start, end in bounds])
        streams = self.stream(await self.admit_clips(req, prompts), request)
        counts = _TokenCounts.of(prompts)
        if req.stream:
            deltas = self.merged(streams, received)  # every clip decodes at once (one engine batch)
            return StreamingResponse(
                speech_stream(deltas, len(streams), req.extracts_translation, counts),
                media_type="text/event-stream",
            )
        choices, _ = await self.collect(request, streams, len(streams), received)
        clips = [_Clip(start / SAMPLING_RATE, end / SAMPLING_RATE) for start, end in bounds]
        return speech_response(req, choices, clips, counts, len(wave) / SAMPLING_RATE)

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
        prompt = self._check_prompt(_text(fields, "prompt"))
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

    def _check_prompt(self, prompt: str | None) -> str | None:
        """At most ``MAX_PROMPT_CHARS``, and no media placeholder: the processor would count it as one more
        media input than the request has."""
        if prompt is None:
            return None
        if len(prompt) > MAX_PROMPT_CHARS:
            raise APIError(400, f"prompt: at most {MAX_PROMPT_CHARS} characters, got {len(prompt)}", "prompt")
        tok = self.tokenizer
        for token in (tok.image_token, tok.video_token, tok.audio_token):
            if token and token in prompt:
                raise APIError(400, f"prompt: must not contain the media placeholder {token}", "prompt")
        return prompt

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
        whitelist, sample rate and channel limits, the decoded-frame cap, the budget of decoded sample values
        over all channels, finite samples). Audio longer than ``max_request_audio_seconds`` is refused, not
        cut: a transcript of part of the file would read as whole."""
        limits = self.media_limits
        cap_s = limits.max_request_audio_seconds
        # Decode a second past the cap: a recording that fills it is longer than the cap allows.
        probe = replace(
            limits,
            max_audio_seconds=cap_s + 1.0,
            audio_max_frames=max(limits.audio_max_frames, math.ceil((cap_s + 1.0) * _LONG_AUDIO_RATE)),
        )
        try:
            with self.waiting.preparing():
                wave = await asyncio.to_thread(load_audio, data, SAMPLING_RATE, budget=MediaBudget(probe))
        except MediaBudgetError as exc:  # "multi_modal_data: ...": the chat API's name for a request's media
            raise APIError(400, f"file: {str(exc).partition(': ')[2]}", param="file") from None
        except (ValueError, OSError) as exc:
            raise APIError(400, f"file: {exc}", param="file") from None
        if len(wave) > math.ceil(cap_s * SAMPLING_RATE):
            raise APIError(
                400,
                f"file: the audio is longer than {cap_s:g} s, the most one request transcribes "
                "(max_request_audio_seconds); send it in parts",
                param="file",
            )
        return wave

    async def prepare(self, req: SpeechRequest, clips: list[np.ndarray]) -> list[ProcessedPrompt]:
        """Gemma 4's instruction in the model's chat template (rendered once, in a thread), then the processor
        for each clip (in its pool, all at once): the clip's log-mel features and its soft tokens in the
        prompt."""
        messages = speech_messages(req.task, req.language, req.prompt)
        render = functools.partial(
            self.tokenizer.apply_chat_template,
            messages,
            add_generation_prompt=True,
            data_as_text=not self.config.trust_message_control_tokens,  # the client's prompt is words
        )
        prompt = await asyncio.to_thread(render)
        return list(await asyncio.gather(*(self._process_clip(prompt, clip) for clip in clips)))

    async def _process_clip(self, prompt: str, clip: np.ndarray) -> ProcessedPrompt:
        try:
            return await self.process({"prompt": prompt, "multi_modal_data": {"audio": [clip]}}, False)
        except APIError as exc:
            if exc.param and exc.param.startswith(("audio", "multi_modal_data")):
                raise APIError(400, f"file: {exc.message.partition(': ')[2]}", param="file") from None
            raise

    async def admit_clips(self, req: SpeechRequest, prompts: list[ProcessedPrompt]) -> list[EngineRequest]:
        """One admitted engine request per clip, each with its own output budget (``max_completion_tokens``
        or the default); none is queued before every clip is admitted."""
        base_id = f"{'trsc' if req.task == 'transcribe' else 'trsl'}-{uuid.uuid4().hex}"
        admitted = []
        for index, processed in enumerate(prompts):
            params = self.speech_params(req, processed)
            request_id = base_id if len(prompts) == 1 else f"{base_id}-{index}"
            with budget_named("max_completion_tokens"):  # this API's name for it, set or defaulted
                admitted += await self.admit(processed, params, request_id, 0, req.model)
        return admitted

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
class _Clip:
    """Where one clip lies in the recording, in seconds."""

    start_s: float
    end_s: float


@dataclass
class _TokenCounts:
    """The prompt tokens of every clip's request together."""

    prompt_tokens: int
    audio_tokens: int

    @classmethod
    def of(cls, prompts: list[ProcessedPrompt]) -> _TokenCounts:
        return cls(
            sum(len(p.token_ids) for p in prompts),
            sum(item.num_tokens for p in prompts for item in p.mm_items),
        )

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


def speech_response(
    req: SpeechRequest, choices: list[Choice], clips: list[_Clip], counts: _TokenCounts, duration_s: float
):
    """The answer to a whole (not streamed) request: ``choices[i]`` is what the model said of ``clips[i]``."""
    answers = [_answer(req, choice) for choice in choices]
    text = join_transcripts(answers)
    usage = counts.usage(sum(len(choice.token_ids) for choice in choices))
    if req.response_format == "json":
        return {"text": text, "usage": usage}
    if req.response_format == "text":
        return PlainTextResponse(text)
    segments = [
        _segment(index, req, choice, answer, clip)
        for index, (choice, answer, clip) in enumerate(zip(choices, answers, clips))
    ]
    if req.response_format == "srt":
        return PlainTextResponse(_cues(segments, ","))
    if req.response_format == "vtt":
        return PlainTextResponse(f"WEBVTT\n\n{_cues(segments, '.')}", media_type="text/vtt")
    body = {
        "task": "transcribe" if req.task == "transcribe" else "translate",
        "language": req.language.lower() if req.language else None,
        "duration": round(duration_s, 3),
        "text": text,
        "segments": segments,
        "usage": usage,
    }
    return JSONResponse(body)


def _answer(req: SpeechRequest, choice: Choice) -> str:
    """One clip's part of the transcript (stripped, as ``join_transcripts`` joins it)."""
    reply = "".join(choice.text)
    return (extract_translation(reply) if req.extracts_translation else reply).strip()


def _segment(index: int, req: SpeechRequest, choice: Choice, answer: str, clip: _Clip) -> dict[str, Any]:
    """A verbose_json segment: one clip, with its times in the recording."""
    encoded = answer.encode("utf-8")
    return {
        "id": index,
        "seek": round(clip.start_s * 100),  # in 10 ms frames, as Whisper's
        "start": round(clip.start_s, 3),
        "end": round(clip.end_s, 3),
        "text": answer,
        "tokens": list(choice.token_ids),
        "temperature": req.temperature,
        "avg_logprob": _avg_logprob(choice),
        "compression_ratio": len(encoded) / len(zlib.compress(encoded)) if encoded else 0.0,
    }


def _cues(segments: list[dict[str, Any]], decimal: str) -> str:
    """SRT (``,``) or WebVTT (``.``) cues: one per segment that has text, numbered for SRT."""
    cues = []
    for segment in (s for s in segments if s["text"]):
        number = f"{len(cues) + 1}\n" if decimal == "," else ""
        timing = f"{_timestamp(segment['start'], decimal)} --> {_timestamp(segment['end'], decimal)}"
        cues.append(f"{number}{timing}\n{_cue(segment['text'])}\n\n")
    return "".join(cues)


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


class ClipsInOrder:
    """The text of clips decoded at once, released in clip order: what a clip says waits until every clip
    before it has finished; ``add`` returns the pieces of the transcript that may be sent now."""

    def __init__(self, num_clips: int, extract: bool):
        self.transcript = TranscriptStream(extract)
        self._waiting: list[list[str]] = [[] for _ in range(num_clips)]
        self._finished = [False] * num_clips
        self._current = 0  # the clip being sent

    def add(self, index: int, text: str, finished: bool) -> list[str]:
        self._waiting[index].append(text)
        self._finished[index] = finished
        pieces: list[str] = []
        while self._current < len(self._waiting):
            waiting = self._waiting[self._current]
            pieces += [self.transcript.feed(t) for t in waiting]
            waiting.clear()
            if not self._finished[self._current]:
                break
            pieces.append(self.transcript.end_clip())
            self._current += 1
        return [piece for piece in pieces if piece]


async def speech_stream(
    deltas: AsyncIterator[tuple[int, StreamDelta]], num_clips: int, extract: bool, counts: _TokenCounts
) -> AsyncIterator[str]:
    """OpenAI's transcription events: ``transcript.text.delta`` per piece of text, clip after clip, then
    ``transcript.text.done`` with the whole text and the usage. A translation sends nothing of a clip before
    the ``English:`` marker of the model's answer (all of it at the clip's end when the marker never comes).
    Closing this (the client left) or a failing clip closes ``deltas``, which aborts every clip's request."""
    in_order = ClipsInOrder(num_clips, extract)
    output_tokens = 0
    try:
        async for index, delta in deltas:
            output_tokens += len(delta.token_ids)
            for piece in in_order.add(index, delta.text, delta.finished):
                yield sse({"type": "transcript.text.delta", "delta": piece})
    except (EngineDeadError, RuntimeError) as exc:
        yield sse_error(exc)
        return
    finally:
        await deltas.aclose()
    text = in_order.transcript.text
    yield sse({"type": "transcript.text.done", "text": text, "usage": counts.usage(output_tokens)})


__all__ = ["ClipsInOrder", "OpenAIServingSpeech", "SpeechRequest", "speech_response", "speech_stream"]
