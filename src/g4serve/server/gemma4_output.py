"""Gemma 4's output syntax, parsed as it streams: the thought channel ``<|channel>thought\\n...<channel|>``
becomes reasoning, ``<|tool_call>call:f{k:<|"|>v<|"|>}<tool_call|>`` becomes a tool call whose arguments
are translated to JSON on the fly, and everything else is content. A marker split across deltas, or spelled
in ordinary characters, is held back until it is whole, so no marker and no special token reaches content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

THOUGHT_OPEN, THOUGHT_CLOSE = "<|channel>", "<channel|>"
CALL_OPEN, CALL_CLOSE = "<|tool_call>call:", "<tool_call|>"
QUOTE = '<|"|>'  # Gemma 4's string delimiter inside tool calls
_MARKERS = (THOUGHT_OPEN, THOUGHT_CLOSE, CALL_OPEN, CALL_CLOSE)
_THOUGHT_LABEL = "thought"
_NAME_CHARS = re.compile(r"[A-Za-z0-9_.\-]")
_LITERAL = re.compile(r"-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?|true|false|null")


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


def _held_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a marker."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


class _ArgsTranslator:
    """Gemma 4 call arguments (``{k:<|"|>v<|"|>,n:3,l:[...]}``) to JSON text, a piece at a time."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.bare: list[str] = []  # an unquoted key or literal being read, a character at a time
        self.stack: list[str] = []  # "{" or "["
        self.done = False

    def feed(self, text: str) -> tuple[str, str]:  # noqa: C901 - one branch per syntax element
        """(JSON out, text left after the arguments' closing brace; held text stays inside)."""
        out, i = [], 0
        while i < len(text) and not self.done:
            if self.in_string:
                end = text.find(QUOTE, i)
                if end < 0:
                    keep = _held_suffix(text[i:], (QUOTE,))
                    chunk = text[i : len(text) - keep]
                    out.append(json.dumps(chunk)[1:-1])
                    return "".join(out), text[len(text) - keep :] if keep else ""
                out.append(json.dumps(text[i:end])[1:-1] + '"')
                self.in_string, i = False, end + len(QUOTE)
                continue
            if text.startswith(QUOTE, i):
                out.append('"')
                self.in_string, i = True, i + len(QUOTE)
                continue
            if QUOTE.startswith(text[i:]) and text[i:]:  # a delimiter still arriving
                return "".join(out), text[i:]
            ch = text[i]
            if ch in "{}[],:":
                out.append(self._flush(ch == ":"))
                if ch in "{[":
                    self.stack.append(ch)
                elif ch in "}]" and self.stack:
                    self.stack.pop()
                    if not self.stack:
                        self.done = True
                out.append(ch)
            elif not ch.isspace():
                self.bare.append(ch)
            i += 1
        return "".join(out), text[i:]

    def _flush(self, is_key: bool) -> str:
        bare = "".join(self.bare)
        self.bare.clear()
        if not bare:
            return ""
        if is_key or not _LITERAL.fullmatch(bare):
            return json.dumps(bare)
        return bare


class Gemma4OutputParser:
    """Feed decoded text (special tokens kept); get content, reasoning and tool-call deltas back."""

    def __init__(self, special_tokens: frozenset[str] | set[str] = frozenset(), parse_tools: bool = True):
        self.parse_tools = parse_tools
        self.markers = _MARKERS if parse_tools else (THOUGHT_OPEN, THOUGHT_CLOSE)
        # Other special tokens (<turn|>, <|tool_response>, <eos>, ...) never reach the client.
        others = sorted((t for t in special_tokens if t not in self.markers), key=len, reverse=True)
        self._strip = re.compile("|".join(map(re.escape, others))) if others else None
        self.state = "content"
        self.buffer = ""
        self.reasoning_started = False
        self._args: _ArgsTranslator | None = None
        self._label = ""  # "thought\n" after <|channel>, dropped
        # Text of one run (a name, the open call's arguments, the whitespace after a call) is kept in pieces
        # and joined once: appending to one string copies it, and a delta each made the run's cost its square.
        self._calls: list[dict] = []  # {"id", "name", "arguments", "complete"} (arguments: JSON text)
        self._arg_parts: list[str] = []  # the open call's arguments not yet in its "arguments"
        self._name_parts: list[str] = []
        self._gap: list[str] = []  # whitespace after a call's closing brace, before its close marker

    # ---- public ----------------------------------------------------------------------------------
    def feed(self, text: str) -> ParsedDelta:
        self.buffer += text
        return self._run(final=False)

    def finish(self) -> ParsedDelta:
        return self._run(final=True)

    @property
    def tool_calls(self) -> list[dict]:
        """Every call begun so far: ``{"id", "name", "arguments", "complete"}`` (arguments: JSON text)."""
        self._join_arguments()
        return self._calls

    @property
    def complete_calls(self) -> list[dict]:
        return [c for c in self.tool_calls if c["complete"]]

    def _join_arguments(self) -> None:
        if self._arg_parts:
            self._calls[-1]["arguments"] += "".join(self._arg_parts)
            self._arg_parts.clear()

    # ---- the state machine -----------------------------------------------------------------------
    def _run(self, final: bool) -> ParsedDelta:
        delta = ParsedDelta()
        while True:
            before = (self.state, len(self.buffer))
            getattr(self, f"_in_{self.state}")(delta, final)
            if (self.state, len(self.buffer)) == before:
                break
        return delta

    def _clean(self, text: str) -> str:
        return self._strip.sub("", text) if self._strip is not None else text

    def _emit_text(self, delta: ParsedDelta, final: bool, closing: tuple[str, ...]) -> str | None:
        """Emit text up to the first of ``closing``; return the marker found (consumed) or None."""
        hits = [(self.buffer.find(m), m) for m in closing if m in self.buffer]
        if hits:
            at, marker = min(hits)
            text, self.buffer = self.buffer[:at], self.buffer[at + len(marker) :]
        else:
            keep = 0 if final else _held_suffix(self.buffer, self.markers)
            if self._strip is not None and not final and "<" in self.buffer:
                tail = self.buffer[
                    self.buffer.rfind("<") :
                ]  # a special token spelled in characters, arriving
                if ">" not in tail and len(tail) <= 40:
                    keep = max(keep, len(tail))
            text, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep :]
            marker = None
        text = self._clean(text)
        if self.state == "content":
            delta.content += text
        else:
            delta.reasoning += text
        return marker

    def _in_content(self, delta: ParsedDelta, final: bool) -> None:
        marker = self._emit_text(delta, final, tuple(m for m in self.markers if m != THOUGHT_CLOSE))
        if marker == THOUGHT_OPEN:
            self.state, self._label, self.reasoning_started = "label", "", True
        elif marker == CALL_OPEN:
            self.state = "name"
            self._name_parts.clear()
        elif THOUGHT_CLOSE in self.buffer:  # a stray close marker: drop it
            self.buffer = self.buffer.replace(THOUGHT_CLOSE, "")

    def _in_label(self, delta: ParsedDelta, final: bool) -> None:
        want = _THOUGHT_LABEL + "\n"
        take = self.buffer[: len(want) - len(self._label)]
        n = 0
        while n < len(take) and take[n] == want[len(self._label) + n]:
            n += 1
        self._label += take[:n]
        self.buffer = self.buffer[n:]
        if self._label == want or n < len(take) or (final and not self.buffer):
            self.state = "reasoning"

    def _in_reasoning(self, delta: ParsedDelta, final: bool) -> None:
        marker = self._emit_text(delta, final, (THOUGHT_CLOSE,))
        if marker is not None:
            self.state = "content"

    def _in_name(self, delta: ParsedDelta, final: bool) -> None:
        i = 0
        while i < len(self.buffer) and _NAME_CHARS.match(self.buffer[i]):
            i += 1
        if i:
            self._name_parts.append(self.buffer[:i])
            self.buffer = self.buffer[i:]
        if self.buffer.startswith("{"):
            self._join_arguments()  # the previous call's, before this one opens
            name = "".join(self._name_parts)
            call = {"id": f"call_{uuid.uuid4().hex[:24]}", "name": name, "arguments": "", "complete": False}
            self._calls.append(call)
            delta.tool_calls.append(ToolCallDelta(len(self._calls) - 1, call["id"], name))
            self._args = _ArgsTranslator()
            self.state = "args"
        elif self.buffer or final:  # not a call after all: nothing of it is content
            self.state = "content"

    def _in_args(self, delta: ParsedDelta, final: bool) -> None:
        out, rest = self._args.feed(self.buffer)
        if out:
            self._arg_parts.append(out)
            index = len(self._calls) - 1
            if delta.tool_calls and delta.tool_calls[-1].index == index:
                delta.tool_calls[-1].arguments += out
            else:
                delta.tool_calls.append(ToolCallDelta(index, arguments=out))
        self.buffer = rest
        if self._args.done:
            self._join_arguments()
            self.state = "close"

    def _in_close(self, delta: ParsedDelta, final: bool) -> None:
        text = self.buffer.lstrip()
        if len(text) < len(self.buffer):  # set aside, not stripped again with every delta that follows
            self._gap.append(self.buffer[: len(self.buffer) - len(text)])
            self.buffer = text
        call = self._calls[-1]
        if text.startswith(CALL_CLOSE):
            self.buffer = text[len(CALL_CLOSE) :]
            call["complete"] = True
            self.state = "content"
            self._gap.clear()
        elif not CALL_CLOSE.startswith(text) or final:
            call["complete"] = self._valid(call["arguments"])
            self.buffer = "".join(self._gap) + self.buffer  # no close marker: the whitespace is content
            self.state = "content"
            self._gap.clear()

    @staticmethod
    def _valid(arguments: str) -> bool:
        """Whether a call's arguments parse as JSON; nested past Python's recursion limit (output a grammar
        can steer there) they count as invalid, the call incomplete, instead of failing the response."""
        try:
            json.loads(arguments)
        except (ValueError, RecursionError):
            return False
        return True


__all__ = ["CALL_CLOSE", "CALL_OPEN", "QUOTE", "THOUGHT_CLOSE", "THOUGHT_OPEN", "Gemma4OutputParser"]
