"""Turn OpenAI/vLLM-style chat messages into chat-template messages plus the media they carry.

Media parts (``image``, ``image_url``, ``video``, ``video_url``, ``audio``, ``input_audio``,
``audio_url``) become ``{"type": "image"|"video"|"audio"}`` placeholders for the template and
raw media entries, in order, for the processor. Errors name the offending field.
"""

from __future__ import annotations

import base64
import binascii
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from g4serve.processing.limits import is_within
from g4serve.processing.streamed_base64 import recall

_PART_MODALITY = {
    "image": "image",
    "image_url": "image",
    "image_pil": "image",
    "video": "video",
    "video_url": "video",
    "audio": "audio",
    "input_audio": "audio",
    "audio_url": "audio",
}


@dataclass
class MediaInputs:
    image: list[Any] = field(default_factory=list)
    video: list[Any] = field(default_factory=list)
    audio: list[Any] = field(default_factory=list)

    def as_dict(self) -> dict[str, list[Any]]:
        return {k: v for k, v in (("image", self.image), ("video", self.video), ("audio", self.audio)) if v}


@dataclass
class LocalFile:
    """A media reference to a local file (only allowed where the caller permits it). ``root``: the
    directory it was checked against (``split_chat_messages(local_media_root=...)``); the processor reads the
    file with the same check repeated on the opened file."""

    path: str
    root: str | None = None


@dataclass(frozen=True)
class _Policy:
    allow_local_files: bool
    local_media_root: Path | None
    allow_objects: bool


def decode_data_url(url: str, where: str) -> bytes:
    """``data:<mime>;base64,<payload>`` -> bytes (decoded already where the body reader streamed it)."""
    if not url.startswith("data:"):
        raise ValueError(f"{where}: expected a data: URL")
    comma = url.find(",", 0, 256)
    if comma > 0 and (decoded := recall(url, comma + 1)) is not None:  # the body reader checked the header
        return decoded
    header, sep, payload = url.partition(",")
    if not sep or ";base64" not in header:
        raise ValueError(f"{where}: only base64 data: URLs are supported")
    return decode_base64(payload, where)


def decode_base64(payload: str, where: str) -> bytes:
    if (decoded := recall(payload, 0)) is not None:
        return decoded
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"{where}: invalid base64 data ({exc})") from None


def _media_value(part: dict[str, Any], kind: str, where: str, policy: _Policy) -> Any:
    value = part.get(kind)
    if value is None:
        raise ValueError(f"{where}.{kind}: missing")
    if kind == "input_audio":
        if not isinstance(value, dict) or not isinstance(value.get("data"), str):
            raise ValueError(f"{where}.input_audio.data: must be a base64 string")
        return decode_base64(value["data"], f"{where}.input_audio.data")
    if kind.endswith("_url"):
        url = value.get("url") if isinstance(value, dict) else value
        if not isinstance(url, str):
            raise ValueError(f"{where}.{kind}.url: must be a string")
        return _url_value(url, f"{where}.{kind}.url", policy)
    if isinstance(value, str):
        return _url_value(value, f"{where}.{kind}", policy)
    if kind == "video" and isinstance(value, list):  # frames, each possibly a data: URL of an image
        return [_frame_value(f, f"{where}.video[{i}]", policy) for i, f in enumerate(value)]
    if not policy.allow_objects:
        raise ValueError(f"{where}.{kind}: must be a string (a data: URL), not {type(value).__name__}")
    return value  # already-decoded media: PIL image, array, frames, (waveform, rate), bytes


def _frame_value(frame: Any, where: str, policy: _Policy) -> Any:
    if isinstance(frame, str):
        return _url_value(frame, where, policy)
    if not policy.allow_objects:
        raise ValueError(f"{where}: must be a string (a data: URL of an image)")
    return frame


def _url_value(url: str, where: str, policy: _Policy) -> Any:
    if url.startswith("data:"):
        return decode_data_url(url, where)
    if url.startswith(("http://", "https://")):
        raise ValueError(f"{where}: remote URLs are not fetched; send the media as a base64 data: URL")
    path = url[len("file://") :] if url.startswith("file://") else url
    if not policy.allow_local_files:
        raise ValueError(f"{where}: local files are not allowed here; send the media as a base64 data: URL")
    root = policy.local_media_root
    if root is None:
        return LocalFile(path)
    try:
        resolved = Path(path).resolve()  # symlinks followed
    except (OSError, RuntimeError, ValueError):  # a symlink loop, a NUL byte
        resolved = None
    # One answer for every path outside the root, whether or not it exists there.
    if resolved is None or not is_within(resolved, root):
        raise ValueError(f"{where}: {path!r} is outside --allowed-local-media-path")
    if not resolved.is_file():
        raise ValueError(f"{where}: {path!r} is not a file under --allowed-local-media-path")
    return LocalFile(str(resolved), root=str(root))


def _content_part(part: Any, pwhere: str, media: MediaInputs, policy: _Policy) -> dict[str, Any]:
    """One validated content part, template-ready; a media part's value is appended to ``media``."""
    if not isinstance(part, dict):
        raise ValueError(f"{pwhere}: must be an object")
    kind = part.get("type")
    if not isinstance(kind, str):
        raise ValueError(f"{pwhere}.type: must be a string")
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{pwhere}.text: must be a string")
        return {"type": "text", "text": part["text"]}
    if kind in _PART_MODALITY:
        modality = _PART_MODALITY[kind]
        getattr(media, modality).append(_media_value(part, kind, pwhere, policy))
        return {"type": modality}
    raise ValueError(f"{pwhere}.type: unsupported content type {kind!r}")


def split_chat_messages(
    messages: list[dict[str, Any]],
    allow_local_files: bool = True,
    *,
    local_media_root: str | os.PathLike | None = None,
    allow_objects: bool = True,
) -> tuple[list[dict[str, Any]], MediaInputs]:
    """Validate messages; return template-ready messages and the media in prompt order.

    ``allow_local_files``: ``file://`` URLs and bare paths become ``LocalFile`` s (else an error).
    ``local_media_root``: every local path, video frames included, must resolve (symlinks followed) to a
    regular file inside this directory; the error for a path outside it does not say whether it exists.
    ``allow_objects=False``: a media value that is not a string (an already-decoded object) is an error,
    as it must be for JSON from the network."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: must be a non-empty list")
    policy = _Policy(
        allow_local_files,
        Path(local_media_root).resolve() if local_media_root is not None else None,
        allow_objects,
    )
    media = MediaInputs()
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise ValueError(f"{where}: must be an object")
        role = msg.get("role")
        if role not in ("system", "developer", "user", "assistant", "model", "tool"):
            raise ValueError(f"{where}.role: unknown role {role!r}")
        content = msg.get("content")
        if content is None:
            content = ""
        if isinstance(content, str):
            out.append({**msg, "content": content})
            continue
        if not isinstance(content, list):
            raise ValueError(f"{where}.content: must be a string or a list of parts")
        parts = [
            _content_part(part, f"{where}.content[{j}]", media, policy) for j, part in enumerate(content)
        ]
        out.append({**msg, "content": parts})
    return out, media
