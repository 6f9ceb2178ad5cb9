"""The Responses API request (``POST /v1/responses``) and its translation to the chat endpoint's terms:
input items -> chat messages, function tools, ``tool_choice``, ``reasoning.effort`` and ``text.format``
-> the chat fields that ``OpenAIServingChat`` already checks and renders; and the input items as the
Responses items that ``GET /v1/responses/{id}/input_items`` lists."""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr

from g4serve.server.errors import APIError

EFFORTS = ("none", "minimal", "low", "medium", "high")
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text")
MAX_METADATA_KEYS = 16  # OpenAI's limits on metadata: 16 pairs, keys of 64 and values of 512 characters
MAX_TOP_LOGPROBS = 20
INCLUDE_LOGPROBS = "message.output_text.logprobs"
# Accepted, and nothing to do: input items always carry their image URLs.
_INCLUDE_ALWAYS = ("message.input_image.image_url",)
# OpenAI's include values for built-in tools, which this server does not have.
_INCLUDE_BUILT_IN = (
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
)


class ResponsesRequest(BaseModel):
    # Unknown or unsupported fields are a 400 naming them ("prompt: Extra inputs are not permitted").
    model_config = ConfigDict(extra="forbid", strict=True)

    model: StrictStr | None = None
    input: StrictStr | list[dict[str, Any]]
    instructions: StrictStr | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool = True
    reasoning: dict[str, Any] | None = None
    max_output_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] | None = None
    stream: StrictBool = False
    store: StrictBool = True
    previous_response_id: StrictStr | None = None
    metadata: dict[StrictStr, StrictStr] | None = None
    user: StrictStr | None = None
    truncation: StrictStr | None = None  # "disabled" (None) or "auto"
    background: StrictBool | None = None
    include: list[StrictStr] | None = None
    top_logprobs: StrictInt | None = None
    cache_salt: StrictStr | None = None  # vLLM's: KV blocks shared only under the same salt

    def check(self) -> None:
        """The checks pydantic's types do not express; a 400 naming the field."""
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise APIError(400, "max_output_tokens: must be at least 1", "max_output_tokens")
        if self.truncation not in (None, "auto", "disabled"):
            raise APIError(400, "truncation: must be 'auto' or 'disabled'", "truncation")
        if self.background and not self.store:
            raise APIError(
                400,
                "background: a background response must be stored (store=true): it is read back with "
                "GET /v1/responses/{id}",
                "background",
            )
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise APIError(400, f"top_logprobs: must be in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs")
        for value in self.include or ():
            _check_include(value)
        self._check_metadata()
        self._check_reasoning()

    def _check_metadata(self) -> None:
        if self.metadata is None:
            return
        if len(self.metadata) > MAX_METADATA_KEYS:
            raise APIError(400, f"metadata: at most {MAX_METADATA_KEYS} pairs", "metadata")
        for key, value in self.metadata.items():
            if len(key) > 64 or len(value) > 512:
                raise APIError(400, "metadata: keys of at most 64, values of 512 characters", "metadata")

    def _check_reasoning(self) -> None:
        if self.reasoning is None:
            return
        for key in self.reasoning:
            if key != "effort":
                raise APIError(
                    400,
                    f"reasoning.{str(key)[:40]}: not supported (only reasoning.effort; the thought "
                    "channel comes back whole in the reasoning item's content)",
                    "reasoning",
                )
        if self.reasoning.get("effort") not in (*EFFORTS, None):
            raise APIError(400, f"reasoning.effort: must be one of {', '.join(EFFORTS)}", "reasoning")

    @property
    def effort(self) -> str | None:
        return (self.reasoning or {}).get("effort")

    def num_logprobs(self) -> int | None:
        """Alternatives per output token (``top_logprobs``), or None: logprobs come back only when
        ``include`` asks for them (as on OpenAI and vLLM)."""
        if INCLUDE_LOGPROBS not in (self.include or ()):
            return None
        return self.top_logprobs or 0

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """Responses function tools (flat) -> chat tools (``{"type": "function", "function": {...}}``)."""
        if not self.tools:
            return None
        out = []
        for i, tool in enumerate(self.tools):
            if tool.get("type") != "function":
                raise APIError(
                    400,
                    f"tools[{i}].type: only function tools are supported, got {tool.get('type')!r}",
                    "tools",
                )
            fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
            out.append({"type": "function", "function": fn})
        return out

    def chat_tool_choice(self) -> str | dict[str, Any] | None:
        choice = self.tool_choice
        if choice is None or isinstance(choice, str):
            return choice
        if choice.get("type") == "function" and isinstance(choice.get("name"), str):
            return {"type": "function", "function": {"name": choice["name"]}}
        raise APIError(
            400,
            "tool_choice: must be 'auto', 'none', 'required' or {\"type\": \"function\", \"name\": ...}",
            "tool_choice",
        )

    def response_format(self) -> dict[str, Any] | None:
        """``text.format`` -> the chat ``response_format`` (json_schema's fields sit one level up here)."""
        if self.text is None:
            return None
        for key in self.text:
            if key != "format":
                raise APIError(400, f"text.{str(key)[:40]}: not supported", "text")
        fmt = self.text.get("format")
        if fmt is None:
            return None
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise APIError(400, "text.format.type: must be text, json_object or json_schema", "text")
        if fmt["type"] == "text":
            return None
        if fmt["type"] == "json_object":
            return {"type": "json_object"}
        if not isinstance(fmt.get("schema"), dict):
            raise APIError(400, "text.format.schema: a json_schema format needs a schema object", "text")
        inner = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": inner}


def _check_include(value: str) -> None:
    if value == INCLUDE_LOGPROBS or value in _INCLUDE_ALWAYS:
        return
    shown = repr(value[:60])
    if value == "reasoning.encrypted_content":
        raise APIError(
            400,
            "include: reasoning.encrypted_content is not supported: this server does not encrypt reasoning "
            "for stateless reuse; keep the conversation with store=true and previous_response_id instead",
            "include",
        )
    if value in _INCLUDE_BUILT_IN:
        raise APIError(
            400, f"include: {shown} is for built-in tools, which this server does not have", "include"
        )
    supported = ", ".join((INCLUDE_LOGPROBS, *_INCLUDE_ALWAYS))
    raise APIError(400, f"include: unknown value {shown} (supported: {supported})", "include")


def input_messages(items: str | list[dict[str, Any]], known_calls: dict[str, str]) -> list[dict[str, Any]]:
    """The request's ``input`` as chat messages (content parts in the chat endpoint's names, so
    ``split_chat_messages`` checks and decodes the media). ``known_calls`` (call id -> function name, from the
    earlier turns) grows with this input's own function calls; an output for an unknown call is a 400."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise APIError(400, "input: must be a string or a non-empty list of items", "input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{where}: must be an object", "input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            out.append(_message(item, where))
        elif kind == "function_call":
            call = _function_call(item, where)
            known_calls[call["id"]] = call["function"]["name"]
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)  # consecutive calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append(_function_output(item, where, known_calls))
        elif kind == "reasoning":
            continue  # Gemma 4's template drops earlier turns' thoughts anyway
        else:
            raise APIError(400, f"{where}.type: unsupported input item type {str(kind)[:40]!r}", "input")
    return out


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    role = _ROLES.get(role) if isinstance(role, str) else None
    if role is None:
        raise APIError(400, f"{where}.role: must be user, system, developer or assistant", "input")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content: must be a string or a list of parts", "input")
    return {"role": role, "content": [_part(p, f"{where}.content[{j}]") for j, p in enumerate(content)]}


def _part(part: Any, where: str) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in _TEXT_PARTS:
        if not isinstance(part.get("text"), str):
            raise APIError(400, f"{where}.text: must be a string", "input")
        return {"type": "text", "text": part["text"]}
    if kind == "input_image":
        url = part.get("image_url")
        if not isinstance(url, str):
            detail = " (file_id is not supported: send image_url)" if "file_id" in part else ""
            raise APIError(400, f"{where}.image_url: must be a URL string{detail}", "input")
        return {"type": "image_url", "image_url": {"url": url}}
    if kind == "input_audio":
        return {"type": "input_audio", "input_audio": part.get("input_audio")}
    raise APIError(
        400, f"{where}.type: must be input_text, input_image or input_audio, got {str(kind)[:40]!r}", "input"
    )


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise APIError(400, f"{where}.{key}: must be a string", "input")
    return {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": item["name"], "arguments": item["arguments"]},
    }


def _function_output(item: dict[str, Any], where: str, known_calls: dict[str, str]) -> dict[str, Any]:
    call_id, output = item.get("call_id"), item.get("output")
    if not isinstance(call_id, str):
        raise APIError(400, f"{where}.call_id: must be a string", "input")
    if call_id not in known_calls:
        raise APIError(
            400, f"{where}.call_id: no function call {call_id[:64]!r} in this conversation", "input"
        )
    if isinstance(output, list):  # a list of input_text parts
        if not all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in output):
            raise APIError(400, f"{where}.output: only text parts are supported", "input")
        output = "".join(p["text"] for p in output)
    if not isinstance(output, str):
        raise APIError(400, f"{where}.output: must be a string", "input")
    return {"role": "tool", "tool_call_id": call_id, "name": known_calls[call_id], "content": output}


def response_items(items: str | list[dict[str, Any]], taken: set[str] | None = None) -> list[dict[str, Any]]:
    """The request's ``input`` (already checked by ``input_messages``) as the Responses items that
    ``GET /v1/responses/{id}/input_items`` lists: each with an ``id`` and a ``status``; message content as
    part lists. The id is the client's unless the conversation has it already (``taken``, which grows):
    pages continue ``after`` an id, so ids must not repeat (a client sending earlier output back)."""
    taken = set() if taken is None else taken
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    out = []
    for item in items:
        kind = item.get("type", "message")
        given = item.get("id")
        if kind == "message":
            assistant = item["role"] == "assistant"
            content = item["content"]
            if isinstance(content, str):
                content = [{"type": "input_text", "text": content}]
            parts = [_item_part(part, assistant) for part in content]
            entry = {"type": "message", "role": item["role"], "content": parts}
            prefix = "msg"
        elif kind == "function_call":
            entry = {k: item[k] for k in ("type", "call_id", "name", "arguments")}
            prefix = "fc"
        elif kind == "function_call_output":
            entry = {k: item[k] for k in ("type", "call_id", "output")}
            prefix = "fco"
        else:  # reasoning: as the client sent it
            entry = {k: v for k, v in item.items() if k != "id"}
            entry.setdefault("summary", [])
            prefix = "rs"
        item_id = given if isinstance(given, str) and given and given not in taken else None
        item_id = item_id or f"{prefix}_{uuid.uuid4().hex}"
        taken.add(item_id)
        out.append({"id": item_id, **entry, "status": "completed"})
    return out


def _item_part(part: dict[str, Any], assistant: bool) -> dict[str, Any]:
    kind = part["type"]
    if kind in _TEXT_PARTS:
        if assistant:
            return {"type": "output_text", "text": part["text"], "annotations": []}
        return {"type": "input_text", "text": part["text"]}
    if kind == "input_image":
        return {"type": "input_image", "image_url": part["image_url"], "detail": part.get("detail") or "auto"}
    return {"type": "input_audio", "input_audio": part.get("input_audio")}
