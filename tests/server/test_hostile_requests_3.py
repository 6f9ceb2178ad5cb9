"""Hostile requests, third audit: what one request's output costs the event loop (and through the interpreter
lock, the engine thread every request shares) must grow with its length, not with its square.

Gemma 4's output parser and the Responses API's item builder run on the event loop for every delta of a
chat stream with tools or thinking, and of every Responses answer (whole ones too). A client steers the
model into a long run of one kind of text easily (a ``response_format`` regex beside ``tools``, a
``logit_bias`` of +100 on one token, or just a model degenerating into whitespace); each delta then copied
everything of that run so far, so a 128k-token answer cost minutes of interpreter time."""

from __future__ import annotations

import gc
import time

import pytest

from g4serve.server.gemma4_output import CALL_CLOSE, CALL_OPEN, QUOTE, THOUGHT_CLOSE, Gemma4OutputParser
from g4serve.server.serving_responses import _Run

SPECIALS = frozenset({"<turn|>", "<eos>"})
# A long answer's deltas: 100,000 tokens of 16 characters (Gemma 4's vocabulary holds runs of 31 spaces).
# In linear time they take 1-2 s on the 2-core CPU; each run below took 15 s to minutes when every delta
# copied the run so far (cut off at the budget), or its last deltas 2.5-19x as long as its first.
DELTAS = 100_000
PIECE = "abcdefghijklmnop"
BUDGET_S = 8.0
MAX_SLOWDOWN = 2.5


def _within_budget(feed, pieces: list[str]) -> list:
    """``feed(piece)`` for each of ``pieces``; the results. Fails once they take more than ``BUDGET_S``, or
    when the last tenth of them took over ``MAX_SLOWDOWN`` times the first tenth's time: each delta should
    cost the same, wherever it comes in the answer (the collector is off, or its passes over the results kept
    here would grow too)."""
    began, out, n = time.perf_counter(), [], len(pieces)
    marks = {}
    gc.disable()
    try:
        for i, piece in enumerate(pieces):
            if i in (1, n // 10, n - n // 10, n - 1):
                marks[i] = time.perf_counter()
            out.append(feed(piece))
            if i % 1000 == 0 and time.perf_counter() - began > BUDGET_S:
                pytest.fail(f"{i} of {n} deltas took over {BUDGET_S} s: the work grows with their square")
    finally:
        gc.enable()
    first, last = marks[n // 10] - marks[1], marks[n - 1] - marks[n - n // 10]
    assert last < MAX_SLOWDOWN * first + 0.05, f"the last deltas took {last / first:.1f}x the first's time"
    return out


def _feed_all(parser: Gemma4OutputParser, head: str, piece: str, tail: str = "") -> str:
    """Feed ``head``, ``piece`` DELTAS times and ``tail``; all the parsed content."""
    parsed = _within_budget(parser.feed, [head, *[piece] * DELTAS, tail])
    return "".join(p.content for p in parsed) + parser.finish().content


def test_a_long_bare_argument_is_parsed_in_linear_time():
    parser = Gemma4OutputParser(SPECIALS)
    _feed_all(parser, CALL_OPEN + "f{a:", PIECE, "}" + CALL_CLOSE)
    (call,) = parser.complete_calls
    assert call["arguments"] == '{"a":"' + PIECE * DELTAS + '"}'


def test_a_long_string_argument_is_parsed_in_linear_time():
    parser = Gemma4OutputParser(SPECIALS)
    _feed_all(parser, CALL_OPEN + "f{a:" + QUOTE, PIECE, QUOTE + "}" + CALL_CLOSE)
    (call,) = parser.complete_calls
    assert call["arguments"] == '{"a":"' + PIECE * DELTAS + '"}'


def test_whitespace_after_a_call_is_parsed_in_linear_time():
    """After a call's closing brace the parser waits for ``<tool_call|>``: whitespace kept it waiting, and it
    stripped the whole run again on every delta. The whitespace still reaches the content when no close
    marker follows, and is dropped before one."""
    parser = Gemma4OutputParser(SPECIALS)
    content = _feed_all(parser, CALL_OPEN + "f{}", " " * 16, "done")
    assert content == " " * 16 * DELTAS + "done"
    assert parser.complete_calls[0]["arguments"] == "{}"  # valid JSON, though no close marker came
    parser = Gemma4OutputParser(SPECIALS)
    content = _feed_all(parser, CALL_OPEN + "f{}", "\n", CALL_CLOSE + "after")
    assert content == "after" and parser.complete_calls[0]["arguments"] == "{}"


def test_a_long_tool_name_is_parsed_in_linear_time():
    parser = Gemma4OutputParser(SPECIALS)
    _feed_all(parser, CALL_OPEN, PIECE, "{}" + CALL_CLOSE)
    assert parser.complete_calls[0]["name"] == PIECE * DELTAS


def _run_deltas(pieces: list[str]) -> tuple[_Run, list[dict]]:
    """A Responses run fed ``pieces`` as one answer's deltas, and its events."""
    run = _Run({"id": "resp_x", "output": []}, Gemma4OutputParser(SPECIALS), 0, None, raise_errors=True)
    events = [e for batch in _within_budget(lambda p: run._feed(run.parser.feed(p)), pieces) for e in batch]
    return run, [*events, *run._feed(run.parser.finish()), *run._finish()]


def test_a_long_responses_answer_is_built_in_linear_time():
    piece = PIECE * 4  # the parser's work a delta is the larger part here: longer deltas, for a clear slope
    run, events = _run_deltas([piece] * DELTAS)
    assert run.items[0]["content"][0]["text"] == piece * DELTAS
    assert [e["text"] for e in events if e["type"] == "response.output_text.done"] == [piece * DELTAS]


def test_long_responses_reasoning_and_whitespace_are_built_in_linear_time():
    half = DELTAS // 2
    run, _ = _run_deltas(["<|channel>thought\n", *[PIECE] * half, THOUGHT_CLOSE, *[" " * 16] * half, "x"])
    reasoning, message = run.items
    assert reasoning["content"][0]["text"] == PIECE * half
    assert message["content"][0]["text"] == " " * 16 * half + "x"


def test_a_long_responses_call_is_built_in_linear_time():
    run, events = _run_deltas([CALL_OPEN + "f{a:" + QUOTE, *[PIECE] * DELTAS, QUOTE + "}" + CALL_CLOSE])
    (call,) = run.items
    assert call["arguments"] == '{"a":"' + PIECE * DELTAS + '"}' and call["status"] == "completed"
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert "".join(deltas) == call["arguments"]
