"""PEFT's ``alpha_pattern``: per-module ``lora_alpha`` by regex key, matched as PEFT matches it (the first key
in order for which ``re.match(rf"(.*\\.)?({key})$", module_name)`` succeeds), at a bounded cost.

A key comes from the adapter's file, and the stdlib matcher holds the interpreter lock while it runs: one
key that backtracks without end (``(.|.)*[0-9]``: 2^47 steps on a 47-character name) stopped every thread
of the server, the event loop and the engine included, for hours. So a key may repeat single characters only
(``.*``, ``\\d+``, ``[qv]?``), not groups, and use no look-arounds or back-references; its ways to match a
name (alternatives times repeat lengths) are bounded; and all matching shares a time budget.
"""

from __future__ import annotations

import re
import time
from re import _constants as sre  # the parse tree of the stdlib's own parser (Python >= 3.11)
from re import _parser

MAX_KEYS = 1024  # PEFT writes one key per module at most: 31B has 410 adaptable projections
MAX_KEY_CHARS = 256
# Longer than any module name an adapter can give (``adapter._KEY``: the longest is 51 characters).
NAME_CHARS = 64
# The ways two ``.*`` can split a name: ``.*\.q_proj``, ``layers\.1\d\..*`` and ``.*mlp.*`` all pass; three
# variable repeats or ``(.|.)`` thirteen times do not. A key at the bound matches a name in ~1 ms.
MAX_KEY_PATHS = (NAME_CHARS + 1) ** 2
MATCH_BUDGET_S = 1.0  # for every (module, key) match of one adapter

_ONE_CHAR = {sre.LITERAL, sre.NOT_LITERAL, sre.ANY, sre.IN}
_REPEATS = {sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT}


class _Unsafe(Exception):
    """A key whose matching cost is not bounded: the message says why."""


class AlphaPatterns:
    """The checked keys in order, each compiled once. ``ValueError`` (``alpha_pattern: ...``) for a key that
    is not a regex, or not one of bounded cost."""

    def __init__(self, patterns: dict[str, float]):
        if len(patterns) > MAX_KEYS:
            raise ValueError(f"alpha_pattern: {len(patterns)} keys; at most {MAX_KEYS}")
        self.keys = [(_compile(key), alpha) for key, alpha in patterns.items()]

    def alphas(self, names: list[str], default: float) -> dict[str, float]:
        """Each module name's ``lora_alpha``: the first matching key's, else ``default``."""
        deadline = time.monotonic() + MATCH_BUDGET_S
        found = {}
        for name in names:
            found[name] = default
            for regex, alpha in self.keys:
                if time.monotonic() > deadline:
                    raise ValueError(
                        f"alpha_pattern: matching its {len(self.keys)} keys took over {MATCH_BUDGET_S} s"
                    )
                if regex.match(name):
                    found[name] = alpha
                    break
        return found


def _compile(key: str) -> re.Pattern:
    if len(key) > MAX_KEY_CHARS:
        raise ValueError(f"alpha_pattern: a key of {len(key)} characters; at most {MAX_KEY_CHARS}")
    shown = key if len(key) <= 40 else f"{key[:40]}..."
    try:
        paths = _paths(_parser.parse(key))
        if paths > MAX_KEY_PATHS:
            raise _Unsafe(
                f"has too many ways to match a name ({paths} > {MAX_KEY_PATHS}: at most two variable "
                "repeats such as .*, fewer with alternatives)"
            )
        return re.compile(rf"(.*\.)?({key})$")
    except (re.error, RecursionError, OverflowError) as exc:
        raise ValueError(f"alpha_pattern: key {shown!r} is not a regex ({exc})") from None
    except _Unsafe as exc:
        raise ValueError(f"alpha_pattern: key {shown!r} {exc}") from None


def _paths(items) -> int:
    """An upper bound on the ways a backtracking matcher tries ``items`` (a parsed regex) against a name of
    ``NAME_CHARS`` characters: the product over the sequence of each alternative set's sum and each variable
    repeat's number of lengths."""
    total = 1
    for op, arg in items:
        if op in _ONE_CHAR or op is sre.AT:
            continue
        if op is sre.SUBPATTERN:
            total *= _paths(arg[-1])
        elif op is sre.BRANCH:
            total *= sum(_paths(alternative) for alternative in arg[1])
        elif op in _REPEATS:
            low, high, body = arg
            if len(body) != 1 or body[0][0] not in _ONE_CHAR:
                raise _Unsafe("repeats a group: only single characters may repeat (.*, \\d+, [qv]?)")
            total *= min(high, NAME_CHARS) - min(low, NAME_CHARS) + 1
        else:
            raise _Unsafe("uses a look-around, back-reference, conditional or atomic group")
    return total


__all__ = ["AlphaPatterns"]
