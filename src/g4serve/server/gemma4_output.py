"""Gemma 4's output syntax, parsed as it streams: the thought channel ``<|channel>thought\\n...<channel|>``
becomes reasoning, ``<|tool_call>call:f{k:<|"|>v<|"|>}<tool_call|>`` becomes a tool call whose arguments
are translated to JSON on the fly, and everything else is content. A marker split across deltas, or spelled
in ordinary characters, is held back until it is whole, so no marker and no special token reaches content.
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from dataclasses import dataclass, field

from g4serve.server.errors import MAX_JSON_DEPTH

THOUGHT_OPEN, THOUGHT_CLOSE = "<|channel>", "<channel|>"
CALL_OPEN, CALL_CLOSE = "<|tool_call>call:", "<tool_call|>"
QUOTE = '<|"|>'  # Gemma 4's string delimiter inside tool calls
_MARKERS = (THOUGHT_OPEN, THOUGHT_CLOSE, CALL_OPEN, CALL_CLOSE)
_MARKER_TOKENS = frozenset({THOUGHT_OPEN, THOUGHT_CLOSE, "<|tool_call>", CALL_CLOSE})
_THOUGHT_LABEL = "thought"
_NAME_RUN = re.compile(r"[A-Za-z0-9_.\-]+")
_SPACE_RUN = re.compile(r"\s+")
_LITERAL = re.compile(r"-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?|true|false|null")
# Outside a string: punctuation, a run of whitespace, a run of bare characters, or a "<" (a quote, a marker).
_ARG_TOKEN = re.compile(r"[{}\[\],:]|\s+|[^{}\[\],:<\s]+|<")
_BRACKETED = re.compile(r"<[^<>]*>")  # the shape of every Gemma 4 special token
_PIECE = re.compile(r"[^<>]+|<|>")


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


@functools.lru_cache(maxsize=8)
def _alternation(markers: tuple[str, ...]) -> re.Pattern:
    return re.compile("|".join(map(re.escape, markers)))


@dataclass(frozen=True)
class _Specials:
    """What to take out of content and reasoning: ``bracketed`` tokens (``<...>``, all of Gemma 4's) go
    through ``_Stripper``; ``other`` (a regex, or None) matches any other special token."""

    bracketed: frozenset[str]
    longest: int
    other: re.Pattern | None


@functools.lru_cache(maxsize=16)
def _specials(tokens: frozenset[str]) -> _Specials:
    """Cached: a server builds a parser per choice from the same thousands of special tokens."""
    tokens = frozenset(t for t in tokens if isinstance(t, str) and t)
    bracketed = frozenset(t for t in tokens | _MARKER_TOKENS if _BRACKETED.fullmatch(t))
    others = sorted((t for t in tokens if t not in bracketed), key=len, reverse=True)
    other = re.compile("|".join(map(re.escape, others))) if others else None
    return _Specials(bracketed, max(map(len, bracketed)), other)


class _Stripper:
    """Takes special tokens out of text as it streams: one spelled across deltas, or one formed once the
    tokens inside it are gone (``<|tool<eos>_call>``), goes too. Text that may still turn out to be one (from
    an unclosed ``<`` on) is held back until the next piece; ``flush`` lets it go. The result does not depend
    on how the text is split, and each character costs the same."""

    MAX_OPEN = 8  # "<" nested inside one another that may each still close into a token

    def __init__(self, specials: _Specials) -> None:
        self.specials = specials
        self.held = ""  # from the first "<" that may still open a token
        self.opens: list[int] = []  # where in ``held`` each such "<" stands (opens[0] == 0)

    def feed(self, text: str) -> str:
        out: list[str] = []
        for match in _PIECE.finditer(text):
            piece = match.group()
            if piece == "<":
                self._open(out)
            elif piece == ">":
                self._close(out)
            elif self.opens:
                self.held += piece
                if len(self.held) - self.opens[-1] >= self.specials.longest:  # too long for any token
                    self._release(out)
            else:
                out.append(piece)
        return self._clean("".join(out))

    def flush(self) -> str:
        out: list[str] = []
        self._release(out)
        return self._clean("".join(out))

    def _open(self, out: list[str]) -> None:
        if len(self.opens) == self.MAX_OPEN:  # the outermost goes out as text; bounded work per "<"
            cut = self.opens[1]
            out.append(self.held[:cut])
            self.held, self.opens = self.held[cut:], [at - cut for at in self.opens[1:]]
        self.opens.append(len(self.held))
        self.held += "<"

    def _close(self, out: list[str]) -> None:
        if not self.opens:
            out.append(">")
        elif self.held[self.opens[-1] :] + ">" in self.specials.bracketed:
            self.held = self.held[: self.opens.pop()]
        else:  # no token holds a ">" inside: nothing before this one can still become a token
            self.held += ">"
            self._release(out)

    def _release(self, out: list[str]) -> None:
        out.append(self.held)
        self.held, self.opens = "", []

    def _clean(self, text: str) -> str:
        other = self.specials.other
        return other.sub("", text) if other is not None and text else text


class _ArgsTranslator:
    """Gemma 4 call arguments (``{k:<|"|>v<|"|>,n:3,l:[...]}``) to JSON text, a piece at a time. Outside a
    string, a marker (``<tool_call|>`` before the closing brace, ``<|channel>``) ends the arguments there."""

    def __init__(self, markers: tuple[str, ...]) -> None:
        self.markers = markers
        self.in_string = False
        self.bare: list[str] = []  # an unquoted key or literal being read
        self.stack: list[str] = []  # "{" or "["
        self.deepest = 0
        self.done = False

    def feed(self, text: str, pos: int, final: bool) -> tuple[str, int]:
        """(JSON out, where in ``text`` it stopped: after the closing brace, at a marker, or before text held
        back until more arrives)."""
        out: list[str] = []
        while pos < len(text) and not self.done:
            if self.in_string:
                pos = self._string(text, pos, final, out)
                if self.in_string:
                    break
                continue
            match = _ARG_TOKEN.match(text, pos)
            token = match.group()
            if token == "<":
                step = self._angle(text, pos, final, out)
                if step == 0:
                    break
                pos += step
                continue
            if token in ("{", "}", "[", "]", ",", ":"):
                self._punctuation(token, out)
            elif not token[0].isspace():
                self.bare.append(token)
            pos = match.end()
        return "".join(out), pos

    def _string(self, text: str, pos: int, final: bool, out: list[str]) -> int:
        end = text.find(QUOTE, pos)
        if end < 0:
            keep = 0 if final else _held_suffix(text[-len(QUOTE) :], (QUOTE,))
            end = max(pos, len(text) - keep)
            out.append(json.dumps(text[pos:end])[1:-1])
            return end
        out.append(json.dumps(text[pos:end])[1:-1] + '"')
        self.in_string = False
        return end + len(QUOTE)

    def _angle(self, text: str, pos: int, final: bool, out: list[str]) -> int:
        """Characters taken at a "<": a string's opening quote, a marker (none taken: the arguments end),
        none while a quote or marker may still be arriving, else one bare character."""
        if text.startswith(QUOTE, pos):
            out.append('"')
            self.in_string = True
            return len(QUOTE)
        if any(text.startswith(m, pos) for m in self.markers):
            out.append(self._flush(False))
            self.done = True
            return 0
        rest = text[pos : pos + 32]
        arriving = len(rest) == len(text) - pos and any(m.startswith(rest) for m in (QUOTE, *self.markers))
        if arriving and not final:
            return 0
        self.bare.append("<")
        return 1

    def _punctuation(self, ch: str, out: list[str]) -> None:
        out.append(self._flush(ch == ":"))
        if ch in "{[":
            self.stack.append(ch)
            self.deepest = max(self.deepest, len(self.stack))
        elif ch in "}]" and self.stack:
            self.stack.pop()
            if not self.stack:
                self.done = True
        out.append(ch)

    def _flush(self, is_key: bool) -> str:
        bare = "".join(self.bare)
        self.bare.clear()
        if not bare:
            return ""
        if is_key or not _LITERAL.fullmatch(bare):
            return json.dumps(bare)
        return bare


class _Out:
    """One ``feed``'s output, in pieces joined once (``ParsedDelta``): adding to a string copies it."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[tuple[ToolCallDelta, list[str]]] = []

    def arguments(self, index: int, text: str) -> None:
        if not (self.calls and self.calls[-1][0].index == index):
            self.calls.append((ToolCallDelta(index), []))
        self.calls[-1][1].append(text)

    def delta(self) -> ParsedDelta:
        calls = []
        for call, parts in self.calls:
            call.arguments = "".join(parts)
            calls.append(call)
        return ParsedDelta("".join(self.content), "".join(self.reasoning), calls)


class Gemma4OutputParser:
    """Feed decoded text (special tokens kept); get content, reasoning and tool-call deltas back.

    The text is read once, left to right, with an index (no copies of what is left at each marker), so a
    whole answer fed at once costs what its deltas fed one by one cost: linear in its length.
    """

    def __init__(self, special_tokens: frozenset[str] | set[str] = frozenset(), parse_tools: bool = True):
        self.parse_tools = parse_tools
        self.markers = _MARKERS if parse_tools else (THOUGHT_OPEN, THOUGHT_CLOSE)
        specials = _specials(frozenset(special_tokens))
        # Every special token and marker other than the ones a state waits for is taken out of its text:
        # the content's and the reasoning's each as one stream, however markers split them.
        self._content = _Stripper(specials)
        self._reasoning = _Stripper(specials)
        self._content_closers = (THOUGHT_OPEN, CALL_OPEN) if parse_tools else (THOUGHT_OPEN,)
        self.state = "content"
        self.buffer = ""  # text not parsed yet: a marker, a quote or a label still arriving
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
        """The calls closed with valid JSON arguments (or, without their close marker, at the end)."""
        return [c for c in self.tool_calls if c["complete"]]

    def _join_arguments(self) -> None:
        if self._arg_parts:
            self._calls[-1]["arguments"] += "".join(self._arg_parts)
            self._arg_parts.clear()

    # ---- the state machine -----------------------------------------------------------------------
    def _run(self, final: bool) -> ParsedDelta:
        out, buf, pos = _Out(), self.buffer, 0
        while True:
            before = (self.state, pos)
            pos = getattr(self, f"_in_{self.state}")(buf, pos, out, final)
            if (self.state, pos) == before:
                break
        self.buffer = buf[pos:]
        if final:
            out.content.append(self._content.flush())
            out.reasoning.append(self._reasoning.flush())
        return out.delta()

    def _find(self, buf: str, pos: int, final: bool, closers: tuple[str, ...]) -> tuple[int, int, str | None]:
        """(end of the text before the first of ``closers``, where the text after it starts, that closer);
        without one, the text runs to what may be the start of a closer still arriving."""
        if hit := _alternation(closers).search(buf, pos):  # stops at the first: a find each would not
            return hit.start(), hit.end(), hit.group()
        keep = 0 if final else _held_suffix(buf[-32:], closers)
        end = max(pos, len(buf) - keep)
        return end, end, None

    def _in_content(self, buf: str, pos: int, out: _Out, final: bool) -> int:
        end, after, marker = self._find(buf, pos, final, self._content_closers)
        out.content.append(self._content.feed(buf[pos:end]))
        if marker is not None:
            if marker == THOUGHT_OPEN:
                self.state, self._label, self.reasoning_started = "label", "", True
            else:
                self.state = "name"
                self._name_parts.clear()
        return after

    def _in_label(self, buf: str, pos: int, out: _Out, final: bool) -> int:
        want = _THOUGHT_LABEL + "\n"
        n = 0
        while pos + n < len(buf) and len(self._label) + n < len(want):
            if buf[pos + n] != want[len(self._label) + n]:
                break
            n += 1
        self._label += buf[pos : pos + n]
        pos += n
        mismatch = pos < len(buf) and self._label != want
        if self._label == want or mismatch or (final and pos == len(buf)):
            self.state = "reasoning"
        return pos

    def _in_reasoning(self, buf: str, pos: int, out: _Out, final: bool) -> int:
        end, after, marker = self._find(buf, pos, final, (THOUGHT_CLOSE,))
        out.reasoning.append(self._reasoning.feed(buf[pos:end]))
        if marker is not None:
            self.state = "content"
        return after

    def _in_name(self, buf: str, pos: int, out: _Out, final: bool) -> int:
        if match := _NAME_RUN.match(buf, pos):
            self._name_parts.append(match.group())
            pos = match.end()
        if buf.startswith("{", pos):
            self._join_arguments()  # the previous call's, before this one opens
            name = "".join(self._name_parts)
            call = {"id": f"call_{uuid.uuid4().hex[:24]}", "name": name, "arguments": "", "complete": False}
            self._calls.append(call)
            out.calls.append((ToolCallDelta(len(self._calls) - 1, call["id"], name), []))
            self._args = _ArgsTranslator(self.markers)
            self.state = "args"
        elif pos < len(buf) or final:  # not a call after all: nothing of it is content
            self.state = "content"
        return pos

    def _in_args(self, buf: str, pos: int, out: _Out, final: bool) -> int:
        text, pos = self._args.feed(buf, pos, final)
        if text:
            self._arg_parts.append(text)
            out.arguments(len(self._calls) - 1, text)
        if self._args.done:
            self._join_arguments()
            self.state = "close"
        return pos

    def _in_close(self, buf: str, pos: int, out: _Out, final: bool) -> int:
        if match := _SPACE_RUN.match(buf, pos):  # set aside, not scanned again with every delta that follows
            self._gap.append(match.group())
            pos = match.end()
        rest = buf[pos : pos + len(CALL_CLOSE)]
        call = self._calls[-1]
        if rest == CALL_CLOSE or not CALL_CLOSE.startswith(rest) or final:
            call["complete"] = self._args.deepest <= MAX_JSON_DEPTH and self._valid(call["arguments"])
            if rest == CALL_CLOSE:
                pos += len(CALL_CLOSE)
            else:  # no close marker: the whitespace is content
                out.content.append(self._content.feed("".join(self._gap)))
            self.state = "content"
            self._gap.clear()
        return pos

    @staticmethod
    def _valid(arguments: str) -> bool:
        """Whether a call's arguments are one JSON object. Random weights close a call on any text
        (``{a b::}``), or nest it deeper than a request's JSON may be (a grammar can steer output there):
        such a call is not returned, as one the client would send back in its history for the server to
        refuse (and past Python's recursion limit, one that failed the response)."""
        try:
            return isinstance(json.loads(arguments), dict)
        except (ValueError, RecursionError):
            return False


__all__ = ["CALL_CLOSE", "CALL_OPEN", "QUOTE", "THOUGHT_CLOSE", "THOUGHT_OPEN", "Gemma4OutputParser"]
