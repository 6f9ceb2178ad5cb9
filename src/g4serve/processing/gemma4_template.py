"""Gemma 4's own chat template made linear in the size of a conversation, rendering the same text.

The template (google/gemma-4-*-it) has loops whose work grows with the square of what a request sends, each
step a sandboxed attribute read, in a template thread that holds the interpreter lock (2-core CPU):

* each message searches every earlier one for the previous non-tool role: 2,000 messages 7.5 s;
* each assistant message with ``tool_calls`` scans every later message for its results, on past the first
  that is no tool result: 4,095 messages, calls and results in turn, 18 s;
* each tool result searches all of its assistant message's calls for its ``tool_call_id``: one message of
  8,000 calls and 4,000 results, 237 s;
* a tool result's text parts, and the parts of a model message around its thoughts, are joined by adding
  to one string, which copies it each time: 20,000 parts of 100 characters, 6.4 s.

``linear_template`` replaces each such block by its linear equivalent, matched as written (whitespace and
``{# comments #}`` between its tags may differ; every tag trims the whitespace around it, so neither renders).
A block that is not found once exactly is left as written. The helpers it calls are ``TEMPLATE_GLOBALS``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import jinja2

_QUADRATIC_LOOKBACK = """
    {%- for message in loop_messages -%}
    {%- if message['role'] != 'tool' -%}
    {%- set ns.prev_message_type = None -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {%- set prev_nt = namespace(role=None, found=false) -%}
    {%- if loop.index0 > 0 -%}
        {%- for j in range(loop.index0 - 1, -1, -1) -%}
            {%- if not prev_nt.found -%}
                {%- if loop_messages[j]['role'] != 'tool' -%}
                    {%- set prev_nt.role = loop_messages[j]['role'] -%}
                    {%- set prev_nt.found = true -%}
                {%- endif -%}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
"""
# The same role, kept as the loop goes: that of the last non-tool message so far.
_LINEAR_LOOKBACK = (
    "{%- set g4_last_nt = namespace(role=None) -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if message['role'] != 'tool' -%}\n"
    "    {%- set ns.prev_message_type = None -%}\n"
    "    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}\n"
    "    {%- set prev_nt = namespace(role=g4_last_nt.role) -%}\n"
    "    {%- set g4_last_nt.role = message['role'] -%}\n"
)

# The results of a message's calls are the tool messages right after it: the scan stops at the first other.
_SCAN_PAST_RESULTS = """
    {%- elif loop_messages[k]['role'] != 'tool' -%}
        {%- set ns_tool_scan.stopped = true -%}
"""
_SCAN_TO_FIRST_OTHER = (
    "{%- elif loop_messages[k]['role'] != 'tool' -%}{%- set ns_tool_scan.stopped = true -%}{%- break -%}"
)

# A result's call: the last of the message's calls with its id, looked up in an index built once a message.
_SCAN_START = "{%- set ns_tool_scan = namespace(stopped=false) -%}"
_SCAN_START_INDEXED = _SCAN_START + "{%- set g4_calls = g4_tool_calls(message['tool_calls']) -%}"
_CALL_SEARCH = """
    {%- for tc in message['tool_calls'] -%}
        {%- if tc.get('id') == follow.get('tool_call_id') -%}
            {%- set ns_tname.name = tc['function']['name'] -%}
        {%- endif -%}
    {%- endfor -%}
"""
_CALL_LOOKUP = (
    "{%- set g4_tc = g4_calls.last(follow.get('tool_call_id')) -%}"
    "{%- if g4_tc is not none -%}{%- set ns_tname.name = g4_tc['function']['name'] -%}{%- endif -%}"
)

_TEXT_PARTS_ADDED = """
    {%- set ns_txt = namespace(s='') -%}
    {%- for part in tool_body -%}
        {%- if part.get('type') == 'text' -%}
            {%- set ns_txt.s = ns_txt.s + (part.get('text') | default('')) -%}
        {%- endif -%}
    {%- endfor -%}
"""
_TEXT_PARTS_JOINED = "{%- set ns_txt = namespace(s=g4_tool_text(tool_body)) -%}"

_STRIP_THINKING_ADDED = """
    {%- macro strip_thinking(text) -%}
    {%- set ns = namespace(result='') -%}
    {%- for part in text.split('<channel|>') -%}
        {%- if '<|channel>' in part -%}
            {%- set ns.result = ns.result + part.split('<|channel>')[0] -%}
        {%- else -%}
            {%- set ns.result = ns.result + part -%}
        {%- endif -%}
    {%- endfor -%}
    {{- ns.result | trim -}}
    {%- endmacro -%}
"""
_STRIP_THINKING_JOINED = (
    "{%- macro strip_thinking(text) -%}{{- g4_strip_thinking(text) | trim -}}{%- endmacro -%}"
)

_TAG = re.compile(r"\{%-.*?-%\}|\{\{-.*?-\}\}", re.S)
_BETWEEN_TAGS = r"(?:\s|\{#.*?#\})*"


def _block(text: str) -> re.Pattern:
    """``text``'s tags in order, with any whitespace or comments between them (and inside, any whitespace)."""
    tags = [r"\s+".join(map(re.escape, tag.split())) for tag in _TAG.findall(text)]
    return re.compile(_BETWEEN_TAGS.join(tags), re.S)


# Each rewrite: blocks (each found once exactly, or the template stays as written) and their replacements.
_REWRITES: list[tuple[tuple[re.Pattern, ...], tuple[str, ...]]] = [
    ((_block(_QUADRATIC_LOOKBACK),), (_LINEAR_LOOKBACK,)),
    ((_block(_SCAN_PAST_RESULTS),), (_SCAN_TO_FIRST_OTHER,)),
    ((_block(_SCAN_START), _block(_CALL_SEARCH)), (_SCAN_START_INDEXED, _CALL_LOOKUP)),
    ((_block(_TEXT_PARTS_ADDED),), (_TEXT_PARTS_JOINED,)),
    ((_block(_STRIP_THINKING_ADDED),), (_STRIP_THINKING_JOINED,)),
]


def _rewrite(template: str, blocks: tuple[re.Pattern, ...], replacements: tuple[str, ...]) -> str:
    if any(len(block.findall(template)) != 1 for block in blocks):
        return template
    for block, replacement in zip(blocks, replacements, strict=True):
        template = block.sub(lambda _: replacement, template, count=1)
    return template


def linear_template(template: str) -> str:
    """``template`` with each of Gemma 4's quadratic blocks it holds replaced by its linear equivalent;
    unchanged where it holds none, or names of ours already (``g4_``)."""
    if "g4_" in template:
        return template
    for blocks, replacements in _REWRITES:
        template = _rewrite(template, blocks, replacements)
    return template


def linear_lookback(template: str) -> str:
    """``template`` with Gemma 4's quadratic previous-role search replaced by its linear equivalent, where it
    holds that block (and no name of ours already); otherwise unchanged."""
    if "g4_" in template:
        return template
    return _rewrite(template, *_REWRITES[0])


# ---- the helpers the rewritten blocks call ----


def _no_get(value: Any) -> jinja2.UndefinedError:
    """What jinja raises for ``value.get(...)`` on a value without ``get``."""
    return jinja2.UndefinedError(f"'{type(value).__name__} object' has no attribute 'get'")


def _key(value: Any) -> Any:
    """A hashable stand-in equal to another's exactly when the JSON values are equal (``==``)."""
    if isinstance(value, Mapping):
        return (Mapping, frozenset((k, _key(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_key(v) for v in value))
    return value


class _ToolCallIndex:
    """A message's calls by id; ``last(id)``: the last call with that id, as the search it replaces finds.
    Built at the first lookup, which is where that search first read the calls."""

    def __init__(self, calls: Any) -> None:
        self.calls = calls
        self.by_id: dict[Any, Any] | None = None

    def last(self, call_id: Any) -> Any:
        if self.by_id is None:
            self.by_id = {}
            for call in self.calls:
                if not isinstance(call, Mapping):
                    raise _no_get(call)
                self.by_id[_key(call.get("id"))] = call
        return self.by_id.get(_key(call_id))


def _tool_text(parts: Any) -> str:
    """The text parts of a tool result, joined: what adding each ``part.get('text') | default('')`` to an
    empty string gives (a part whose text is no string fails as that addition does)."""
    pieces = []
    for part in parts:
        if not isinstance(part, Mapping):
            raise _no_get(part)
        if part.get("type") == "text":
            text = part.get("text")
            pieces.append(text if isinstance(text, str) else "" + text)
    return "".join(pieces)


def _strip_thinking(text: Any) -> str:
    """``text`` without earlier thoughts: of each piece after a ``<channel|>``, what comes before any
    ``<|channel>`` in it."""
    if not isinstance(text, str):
        raise jinja2.UndefinedError(f"'{type(text).__name__} object' has no attribute 'split'")
    return "".join(part.split("<|channel>", 1)[0] for part in text.split("<channel|>"))


TEMPLATE_GLOBALS: Mapping[str, Any] = {
    "g4_tool_calls": _ToolCallIndex,
    "g4_tool_text": _tool_text,
    "g4_strip_thinking": _strip_thinking,
}

__all__ = ["TEMPLATE_GLOBALS", "linear_lookback", "linear_template"]
