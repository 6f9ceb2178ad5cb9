"""Hostile model output for Gemma 4's tool-call and thought parser (``server/gemma4_output.py``): random
weights emit anything, and a whole (non-streamed) answer is parsed on the event loop in one piece.

Each case here failed before its fix: a whole answer's parse grew with the square of its number of markers
(every marker copied the rest of the answer, and every absent marker was searched for to its end), marker
text reached ``content`` and ``reasoning``, a call closed on arguments that are no JSON was returned (and
refused once the client sent it back in its history), and one ``{`` left open swallowed the rest of the
answer into arguments."""

from __future__ import annotations

import json
import random
import time

import httpx
import pytest

from g4serve.server.errors import APIError
from g4serve.server.gemma4_output import CALL_CLOSE, CALL_OPEN, QUOTE, Gemma4OutputParser
from g4serve.server.gemma4_tools import check_tools, forced_call_grammar

SPECIALS = frozenset(
    {"<turn|>", "<|turn>", "<eos>", "<|image|>", "<|tool_response>", "<tool_response|>", "<unused0>", QUOTE}
)
MARKERS = ("<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>")


def _parse(text: str, steps: list[int] | None = None):
    """(content, reasoning, streamed arguments by call, final calls) of ``text`` fed whole or in ``steps``."""
    parser = Gemma4OutputParser(SPECIALS)
    pieces, at = [], 0
    for step in steps or []:
        pieces.append(text[at : at + step])
        at += step
    pieces.append(text[at:])
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    args: dict[int, str] = {}
    for delta in deltas:
        for call in delta.tool_calls:
            args[call.index] = args.get(call.index, "") + call.arguments
    calls = [(c["name"], c["arguments"], c["complete"]) for c in parser.tool_calls]
    return "".join(d.content for d in deltas), "".join(d.reasoning for d in deltas), args, calls


def _seconds(text: str) -> float:
    best = float("inf")
    for _ in range(2):
        began = time.perf_counter()
        _parse(text)
        best = min(best, time.perf_counter() - began)
    return best


def test_a_whole_answer_is_parsed_in_linear_time():
    """``chat_message`` feeds a whole answer at once: 32,000 calls (1.1 MB) took 17 s of the event loop,
    32,000 thoughts 14 s and a 400,000-digit argument 2.8 s; now a fourfold answer costs about fourfold."""
    shapes = {
        "calls": lambda n: (CALL_OPEN + "f{a:1}" + CALL_CLOSE) * n,
        "thoughts": lambda n: "<|channel>thought\nx<channel|>y" * n,
        "bare argument": lambda n: CALL_OPEN + "f{a:" + "1" * (30 * n) + "}" + CALL_CLOSE,
        "html content": lambda n: "<b>x</b> <br>" * n,
    }
    for name, make in shapes.items():
        small, large = _seconds(make(1_500)), _seconds(make(6_000))
        assert large < 1.0, f"{name}: {large:.2f} s"
        assert large < 8 * small + 0.02, f"{name}: 4x the answer took {large / small:.1f}x the time"


def test_no_marker_reaches_content_or_reasoning():
    cases = {
        "a<channel|>b": ("ab", ""),  # a stray close marker, fed whole
        "<|channel>thought\nx<tool_call|>y<|tool_call>z<|channel>w<channel|>": ("", "xyzw"),
        "a<|tool<eos>_call>b": ("ab", ""),  # a marker formed once the token inside it is gone
        'a<|<|channel>thought\nx<channel|>"|>b': ("ab", "x"),  # one formed across a thought
        "a<unu<|image|>sed0>b<turn|>": ("ab", ""),
    }
    for text, expected in cases.items():
        for steps in (None, [1] * len(text), [3] * (len(text) // 3)):
            content, reasoning, _, _ = _parse(text, steps)
            assert (content, reasoning) == expected, (text, steps)


def test_a_call_closed_on_arguments_that_are_no_json_is_not_returned():
    """Its arguments would be refused once the client sent the call back in its history."""
    for args in ("{a b::}", "{a:1,}", "{,}", "{a:{b:1]]"):
        _, _, streamed, calls = _parse(CALL_OPEN + "f" + args + CALL_CLOSE + "after")
        assert [c[2] for c in calls] == [False], args
    _, _, _, calls = _parse(CALL_OPEN + "f{a:" + QUOTE + "x" + QUOTE + ",b:[1,true,null]}" + CALL_CLOSE)
    assert calls == [("f", '{"a":"x","b":[1,true,null]}', True)]
    for depth, complete in ((64, True), (65, False)):  # a request's JSON may nest 64 levels
        _, _, _, calls = _parse(CALL_OPEN + "f{a:" + "[" * (depth - 1) + "]" * (depth - 1) + "}" + CALL_CLOSE)
        assert calls[0][2] is complete, depth


def test_an_open_brace_does_not_swallow_the_rest_of_the_answer():
    """A marker outside a string ends the arguments: before, ``{`` left open took everything after it."""
    content, _, _, calls = _parse(CALL_OPEN + "f{a:{" + CALL_CLOSE + "Hello")
    assert content == "Hello" and calls[0][2] is False
    content, reasoning, _, calls = _parse(CALL_OPEN + "f{a:[<|channel>thought\nhm<channel|>done")
    assert (content, reasoning) == ("done", "hm") and calls[0][2] is False
    content, _, _, calls = _parse(CALL_OPEN + "f{a:" + CALL_OPEN + "g{}" + CALL_CLOSE + "ok")
    assert content == "ok" and [(c[0], c[2]) for c in calls] == [("f", False), ("g", True)]


_SOUP = [
    "<|channel>", "<channel|>", "thought\n", "<|tool_call>", "call:", "<tool_call|>", QUOTE, "{", "}", "[",
    "]", ",", ":", " ", "\n", "a", "1", "-1.5e3", "true", "<", "|", ">", "<|", "|>", "\\", '"', "<turn|>",
    "<eos>", "x.y", "é", "\x00", "<|tool", "_call>", "<eo", "s>", '<|"', "<chan", "nel|>", "<unused", "0>",
    "{a:", "}<tool_call|>",
]  # fmt: skip


def test_delimiter_soup_parses_the_same_however_it_is_split():
    """Random marker and token soup: no marker or special token in content or reasoning, the same result
    fed whole or a few characters at a time, streamed arguments equal to the call's, and every call returned
    holds a JSON object."""
    rng = random.Random(4)
    for _ in range(400):
        text = "".join(rng.choice(_SOUP) for _ in range(rng.randint(1, 80)))
        whole = _parse(text)
        steps = []
        while sum(steps) < len(text):
            steps.append(rng.randint(1, 7))
        assert _parse(text, steps) == whole, text
        content, reasoning, streamed, calls = whole
        for token in (*MARKERS, *SPECIALS):
            assert token not in content and token not in reasoning, (text, token)
        for index, (_, arguments, complete) in enumerate(calls):
            assert streamed.get(index, "") == arguments
            assert not complete or isinstance(json.loads(arguments), dict)


# ---- tool schemas -------------------------------------------------------------------------------------
def _tool(parameters) -> list[dict]:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


MALFORMED_SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "string"}}, "required": 5},
    {"type": "object", "properties": {"a": {"type": "string"}}, "required": [["a"]]},
    {"type": "object", "properties": {"a": {"type": "string"}}, "required": "a"},
    {"type": "object", "properties": "ab"},
    {"type": "object", "properties": ["a"]},
    {"type": "object", "properties": {"a": "string"}},
    {"type": "object", "properties": {"a": {"type": "array", "items": {"required": 5}}}},
    {"type": "object", "properties": {"a": {"type": "array", "items": 3}}},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"required": {}}}}}},
]


def test_malformed_tool_schemas_are_a_400_naming_the_tool():
    """``required: 5`` or ``properties: "ab"`` made a forced call's grammar builder raise TypeError (a 500),
    and the chat template raise its own error, a 400 naming ``messages`` ("'int' object is not iterable")."""
    for schema in MALFORMED_SCHEMAS:
        with pytest.raises(APIError) as info:
            forced_call_grammar(check_tools(_tool(schema)), ["f"], True)
        assert info.value.status == 400 and info.value.param.startswith("tools"), schema
    assert check_tools(_tool({"type": "object", "properties": {"a": True}, "required": ["a"]}))
    for prop, match in (
        ({"type": []}, "non-empty list"),
        ({"type": [["string"]]}, "non-empty list"),
        ({"enum": [float("inf")]}, "finite"),
    ):
        schemas = check_tools(_tool({"type": "object", "properties": {"a": prop}}))
        with pytest.raises(APIError, match=match):
            forced_call_grammar(schemas, ["f"], False)


def test_hostile_tools_are_a_400_from_the_server(server):
    """End to end: a forced call with ``required: 5`` was a 500; a million numbers in an enum held a template
    thread 8 s before the prompt was refused as too long; the next request is answered."""

    def post(**body):
        body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], **body}
        return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)

    bad = _tool({"type": "object", "properties": {"a": {"type": "string"}}, "required": 5})
    for choice in ("required", "auto"):
        r = post(tools=bad, tool_choice=choice)
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("tools"), r.text
    huge = _tool({"type": "object", "properties": {"a": {"type": "integer", "enum": [1] * 1_000_000}}})
    began = time.perf_counter()
    r = post(tools=huge)
    assert r.status_code == 400 and "JSON values" in r.json()["error"]["message"], r.text
    assert time.perf_counter() - began < 1.5
    assert post(tools=_tool({"type": "object", "properties": {}})).status_code == 200


def test_a_forced_call_over_a_huge_enum_is_refused_at_once():
    """A forced call's grammar is built on the event loop: the literals of an enum of a million numbers (3 MB;
    a 64 MiB body holds 30 million, which the body's count of values leaves out) took 2.6 s there before the
    rule was found too large."""
    for prop in ({"enum": [1] * 1_000_000}, {"type": ["string"] * 1_000_000}):
        schemas = check_tools(_tool({"type": "object", "properties": {"a": prop}}))
        began = time.perf_counter()
        with pytest.raises(APIError, match="too large"):
            forced_call_grammar(schemas, ["f"], False)
        assert time.perf_counter() - began < 0.5
