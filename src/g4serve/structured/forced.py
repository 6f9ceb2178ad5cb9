"""How much text a grammar can force at once: a bound read from xgrammar's own printed grammar.

Jump-forward and the closing planner ask xgrammar for the text the grammar forces from the current state
(``find_jump_forward_string``), on the engine thread and with no length limit; its cost grows with the square
of that text. A ``response_format`` of under 100 bytes can force megabytes: an array of 100,000 copies of one
``const`` held the engine thread 5 minutes while memory grew to 23 GB, and ``root ::= "a"{100000000}`` ran the
server out of memory. Such specs are refused when built (``spec.build_grammar``).

The bound: the literal characters of the grammar's longest alternative expanded at each repetition's minimum
count (``"a"{1000}`` is 1,000; ``[a-z]{5000}`` is none, since the model chooses each character; a rule that
refers back to itself adds nothing at that reference). Forced text is made of literal characters along one
path of alternatives, so it cannot be longer; closers forced by recursion the model opened itself (``")))"``)
are bounded by what it wrote. xgrammar prints every kind of spec (JSON schema, regex, EBNF, choice) in one
normalized EBNF, which is what is read here.
"""

from __future__ import annotations

import re

# 8,192 forced characters cost xgrammar ~0.2 s at worst (an array of one const: 52 ms for ~5,000, 243 ms
# for ~10,000 on the 2-core development CPU, bench/hostile_inputs.py, docs/benchmarks.md);
# a schema with 200 required 25-character names has ~5,000 literal characters.
MAX_FORCED_CHARS = 8192

_TOKEN = re.compile(
    r"""\s+|(?P<str>"(?:[^"\\]|\\.)*")|(?P<cls>\[(?:[^\]\\]|\\.)*\])|(?P<look>\(=)|(?P<open>\()|(?P<close>\))"""
    r"""|(?P<bar>\|)|(?P<rep>\{\s*(?P<lo>\d+)\s*(?:,\s*-?\d*\s*)?\})|(?P<post>[*+?])|(?P<name>[A-Za-z_][\w.]*)"""
)
_ESCAPE = re.compile(r"\\(?:x[0-9A-Fa-f]{2}|u[0-9A-Fa-f]{4}|U[0-9A-Fa-f]{8}|.)")


def _rules(text: str) -> dict[str, list[tuple[str, str]]]:
    """Rule name -> its body's tokens, from xgrammar's printed grammar (one ``name ::= body`` a line)."""
    rules = {}
    for line in text.splitlines():
        name, sep, body = line.partition(" ::= ")
        if sep:
            rules[name.strip()] = [
                (m.lastgroup, m["lo"] if m.lastgroup == "rep" else m[0])  # a repetition: its lower bound
                for m in _TOKEN.finditer(body)
                if m.lastgroup is not None
            ]
    return rules


def _body_value(tokens: list[tuple[str, str]], value_of: dict[str, int]) -> int:
    """The literal characters of a body's longest alternative at minimum counts; a rule not in ``value_of``
    (one being evaluated: a reference back into itself) adds nothing. Groups on a stack, not recursion:
    a regex can nest them thousands deep."""
    stack: list[tuple[int, int, bool]] = []  # the enclosing groups' (best, current, lookahead?)
    best = current = last = 0
    for kind, text in tokens:
        if kind in ("open", "look"):
            stack.append((best, current, kind == "look"))
            best = current = last = 0
        elif kind == "close" and stack:
            value = max(best, current)
            best, current, lookahead = stack.pop()
            last = 0 if lookahead else value  # a lookahead matches no text of its own
            current += last
        elif kind == "bar":
            best, current, last = max(best, current), 0, 0
        elif kind == "rep":  # {n, m}: n times in all
            current += last * (int(text) - 1)
        elif kind == "post":  # * and ? may match nothing; + at least once
            current -= last if text in "*?" else 0
        else:
            if kind == "str":
                last = len(_ESCAPE.sub("x", text[1:-1]))
            elif kind == "name":
                last = value_of.get(text, 0)
            else:  # a character class: the model's choice
                last = 0
            current += last
    return max(best, current)


def forced_text_bound(printed_grammar: str) -> int:
    """An upper bound on the characters ``printed_grammar`` (``str(xgrammar.Grammar)``) can force at once."""
    rules = _rules(printed_grammar)
    value_of: dict[str, int] = {}
    active: set[str] = set()
    stack = [("root", False)]  # depth first, without recursion: xgrammar's rules chain thousands deep
    while stack:
        name, expanded = stack.pop()
        if expanded:
            value_of[name] = _body_value(rules[name], value_of)
            active.discard(name)
            continue
        if name in value_of or name in active or name not in rules:
            continue
        active.add(name)
        stack.append((name, True))
        stack.extend((ref, False) for kind, ref in reversed(rules[name]) if kind == "name")
    return value_of.get("root", 0)
