"""The affinity key of an OpenAI request: what it shares with other requests, so the router can send it
where that is already cached (the prefix cache's KV blocks, the encoder cache's image features).

Priority: an operator's pin (``X-G4Serve-Replica``), then the session (``X-Session-Id``, else the body's
``user``), then a digest of the shared prefix: the model, the tools, the system prompt and the first user
turn (its media when it has any, else its leading text). Anything unreadable (not JSON, odd shapes, too
deep) has no key; the request is still forwarded and the replica answers it (a 400 for a bad body).
"""

from __future__ import annotations

import hashlib
import json
import reprlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

SESSION_HEADER = "x-session-id"
# Requests: route to this replica only (an operator reading one replica's /metrics). Responses: the replica
# that answered.
REPLICA_HEADER = "x-g4serve-replica"
DEFAULT_PREFIX_CHARS = 512
# How many leading messages are searched for the first user turn: a conversation's prefix is at its start,
# and a body of a million tiny messages costs no more than this.
MAX_PREFIX_MESSAGES = 64
_TEXT_PART_TYPES = ("text", "input_text")

KeyKind = Literal["replica", "session", "prefix", "none"]


@dataclass(frozen=True)
class AffinityKey:
    kind: KeyKind
    value: str  # a hex digest; the replica name for "replica"; "" for "none"

    @property
    def routed(self) -> bool:
        """Whether the key names where the request should go (a "none" key goes to the least loaded)."""
        return self.kind != "none"


NO_KEY = AffinityKey("none", "")


def request_affinity(
    headers: Mapping[str, str], body: bytes, prefix_chars: int = DEFAULT_PREFIX_CHARS
) -> AffinityKey:
    """The key of one request; ``headers`` is looked up by lower-case name (Starlette's ``Headers`` is
    case-insensitive already). Never raises on any body."""
    return payload_affinity(headers, lambda: parse_object(body), prefix_chars)


def payload_affinity(
    headers: Mapping[str, str], payload: Callable[[], dict | None], prefix_chars: int = DEFAULT_PREFIX_CHARS
) -> AffinityKey:
    """``request_affinity`` of a body already parsed: ``payload()`` gives its JSON object (or None), called
    only when no header decides. Never raises."""
    pinned = (headers.get(REPLICA_HEADER) or "").strip()
    if pinned:
        return AffinityKey("replica", pinned)
    session = (headers.get(SESSION_HEADER) or "").strip()
    if session:
        return AffinityKey("session", _digest(["session", session]))
    parsed = payload()
    if parsed is None:
        return NO_KEY
    return body_affinity(parsed, prefix_chars)


def parse_object(body: bytes) -> dict | None:
    """``body`` as a JSON object, or None for anything else (malformed, too deep for the parser, a list)."""
    if not body.lstrip()[:1] == b"{":
        return None
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return None
    return payload if isinstance(payload, dict) else None


def body_affinity(payload: dict[str, Any], prefix_chars: int = DEFAULT_PREFIX_CHARS) -> AffinityKey:
    """The key of a parsed chat, completion or responses body (other shapes: ``NO_KEY``)."""
    user = payload.get("user")
    if isinstance(user, str) and user.strip():
        return AffinityKey("session", _digest(["session", user.strip()]))
    # A salt parts the engine's prefix cache (KV blocks are shared only under one salt): so does it the key.
    pieces = ["model", _text(payload.get("model")), "cache_salt", _text(payload.get("cache_salt"))]
    if isinstance(payload.get("messages"), list):  # /v1/chat/completions
        pieces += _chat_prefix(payload["messages"], payload.get("tools"), prefix_chars)
    elif "prompt" in payload:  # /v1/completions
        pieces += _completion_prefix(payload["prompt"], prefix_chars)
    elif "input" in payload:  # /v1/responses
        pieces += ["instructions", _text(payload.get("instructions"))]
        value = payload["input"]
        turns = [{"role": "user", "content": value}] if isinstance(value, str) else value
        pieces += _chat_prefix(turns if isinstance(turns, list) else [], payload.get("tools"), prefix_chars)
    else:
        return NO_KEY
    return AffinityKey("prefix", _digest(pieces))


def _chat_prefix(messages: list, tools: Any, prefix_chars: int) -> list[str]:
    """The system and developer turns in full, then the first user turn: its media digests when it has media
    (every question about one image meets where that image is cached), else its first ``prefix_chars``
    characters of text (a conversation keeps its key as it grows, since later turns are not read)."""
    pieces = ["tools", _json_digest(tools) if tools else ""]
    for message in messages[:MAX_PREFIX_MESSAGES]:
        if not isinstance(message, dict):
            continue
        role = message.get("role")
        texts, media = _content(message.get("content"))
        if role in ("system", "developer"):
            pieces += ["system", *texts]
        elif role == "user":
            if media:
                return [*pieces, "user-media", *media]
            return [*pieces, "user-text", "".join(texts)[:prefix_chars]]
    return pieces


def _content(content: Any) -> tuple[list[str], list[str]]:
    """(text pieces, media digests) of a message's content: a string or a list of parts."""
    if isinstance(content, str):
        return [content], []
    if not isinstance(content, list):
        return [], []
    texts, media = [], []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type") in _TEXT_PART_TYPES:
            texts.append(_text(part.get("text")))
        elif isinstance(part, dict):
            # An image_url, input_audio, video_url or input_image part: its URL or base64 data decides what
            # the encoder sees, so a digest of the whole part stands for the media's content.
            media.append(_json_digest(part))
    return texts, media


def _completion_prefix(prompt: Any, prefix_chars: int) -> list[str]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of prompts: the first one decides
    if isinstance(prompt, str):
        return ["prompt-text", prompt[:prefix_chars]]
    if isinstance(prompt, list):
        # token ids: about four characters each
        return ["prompt-ids", ",".join(_text(t) for t in prompt[: max(1, prefix_chars // 4)])]
    return []


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    # reprlib stops at 6 levels and a few items: a plain repr of a body's "model": [[[...]]] as deep as the
    # parser took in a worker thread raised RecursionError on the event loop's deeper stack, and of a 60 MB
    # list took 1.4 s there
    return "" if value is None else reprlib.repr(value)[:64]


def _json_digest(value: Any) -> str:
    try:
        text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError):  # keys of mixed types, NaN and such
        text = repr(type(value))
    return _digest([text])


def _digest(pieces: list[str]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for piece in pieces:
        data = piece.encode("utf-8", "surrogatepass")  # JSON may carry lone surrogates: hash them anyway
        h.update(len(data).to_bytes(8, "little"))  # length-prefixed, so ("ab", "c") != ("a", "bc")
        h.update(data)
    return h.hexdigest()
