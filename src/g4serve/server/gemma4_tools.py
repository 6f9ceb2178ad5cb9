"""OpenAI ``tools`` for Gemma 4: checking them, and the EBNF grammar that forces a well-formed call
(``tool_choice`` ``required`` or named) whose arguments follow the function's JSON schema, in Gemma 4's own
argument syntax (unquoted keys, strings between ``<|"|>``). Keys come in sorted order, as the chat template
renders them.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any

from g4serve.server.errors import APIError
from g4serve.structured.spec import MAX_SPEC_CHARS

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
# Schema keywords the grammar enforces or that do not constrain values; anything else is refused.
_KNOWN = {
    "type",
    "properties",
    "required",
    "items",
    "enum",
    "description",
    "title",
    "default",
    "additionalProperties",
    "maxLength",
    "minItems",
    "maxItems",
    "nullable",
    "$schema",
    "examples",
}
MAX_CALLS = 8  # parallel calls one forced answer may hold
MAX_TOOLS = 128  # OpenAI's limit; the forced call's grammar is built from all of them on the event loop
MAX_BOUND = 2**31 - 1  # a maxLength / minItems / maxItems the grammar takes


def check_tools(tools: list[dict[str, Any]]) -> dict[str, dict]:
    """``{name: parameters schema}``; a 400 naming the field for a malformed tool, or more than
    ``MAX_TOOLS``. The keywords the chat template walks (``properties``, ``required``, ``items``) must have
    their JSON Schema types, here rather than as the template's own error naming ``messages``."""
    if len(tools) > MAX_TOOLS:
        raise APIError(400, f"tools: at most {MAX_TOOLS} functions, got {len(tools)}", "tools")
    out: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if tool.get("type", "function") != "function" or not isinstance(tool.get("function"), dict):
            raise APIError(400, f"{where}: must be {{'type': 'function', 'function': {{...}}}}", where)
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise APIError(400, f"{where}.function.name: must be 1-64 letters, digits, '_' or '-'", where)
        if name in out:
            raise APIError(400, f"{where}.function.name: {name!r} is declared twice", where)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise APIError(400, f"{where}.function.parameters: must be a JSON schema object", where)
        _check_schema(params, f"{where}.function.parameters", where)
        out[name] = params
    return out


def _check_schema(schema: dict, where: str, param: str) -> None:
    """``properties`` an object of schemas, ``required`` a list of names, ``items`` a schema (or a list of
    them), through every nested schema; iterative, as a body may nest 64 levels. Schemas may be booleans."""
    stack = [(schema, where)]
    while stack:
        node, at = stack.pop()
        props, required, items = node.get("properties"), node.get("required"), node.get("items")
        if props is not None:
            if not isinstance(props, dict) or not all(isinstance(v, (dict, bool)) for v in props.values()):
                raise APIError(400, f"{at}.properties: must be an object of JSON schemas", param)
            stack += [(v, f"{at}.properties.{k}") for k, v in props.items() if isinstance(v, dict)]
        if required is not None and not (
            isinstance(required, list) and all(isinstance(r, str) for r in required)
        ):
            raise APIError(400, f"{at}.required: must be a list of property names", param)
        listed = items if isinstance(items, list) else [items]
        if items is not None and not all(isinstance(v, (dict, bool)) for v in listed):
            raise APIError(400, f"{at}.items: must be a JSON schema", param)
        stack += [(v, f"{at}.items") for v in listed if isinstance(v, dict)]


def _bound(schema: dict, key: str, default: int | None, where: str) -> int | None:
    """``schema[key]``, a length or count bound the grammar repeats by (``default`` where absent or null);
    a 400 naming it unless a non-negative integer within ``MAX_BOUND``: 1e400 is infinite, 10^30 overflows
    the grammar's parser, a string or a float is no bound."""
    value = schema.get(key)
    if value is None:
        return default
    if not (isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_BOUND):
        raise APIError(
            400, f"{where}.{key}: must be an integer in [0, {MAX_BOUND}], got {str(value)[:40]}", "tools"
        )
    return value


class _Builder:
    """The rules of a forced call's grammar, built on the event loop: it stops with a 400 once they pass
    ``MAX_SPEC_CHARS``, the size the grammar would be refused at anyway (100,000 properties took 0.23 s
    to build in full on the 2-core CPU before that refusal)."""

    def __init__(self) -> None:
        self.rules: list[str] = []
        self.count = 0
        self.chars = 0

    def rule(self, body: str, hint: str = "r") -> str:
        self.count += 1
        name = f"{hint}{self.count}"
        self.rules.append(f"{name} ::= {body}")
        self.chars += len(self.rules[-1]) + 1
        self.check_size()
        return name

    def check_size(self, pending: int = 0) -> None:
        """A 400 once the rules, and ``pending`` characters of one being built, pass ``MAX_SPEC_CHARS``."""
        if self.chars + pending > MAX_SPEC_CHARS:
            raise APIError(
                400,
                f"tools: the forced call's grammar is too large (over {MAX_SPEC_CHARS} characters)",
                "tools",
            )

    def alternatives(self, items: list, make: Callable[[Any], str], hint: str) -> str:
        """A rule of ``make(item)`` for each of ``items``, refused as soon as its text is too large: a body
        holds 30 million numbers in a 64 MiB enum (numbers are not among the values it counts), and their
        literals took 2.6 s of the event loop a million before the rule's size was checked."""
        options, pending = [], 0
        for item in items:
            options.append(make(item))
            pending += len(options[-1]) + 3
            self.check_size(pending)
        return self.rule(" | ".join(options), hint)

    def value(self, schema: Any, where: str) -> str:  # noqa: C901 - one branch per JSON type
        if not isinstance(schema, dict):
            raise APIError(400, f"{where}: must be a JSON schema object", "tools")
        unknown = set(schema) - _KNOWN
        if unknown:
            raise APIError(
                400,
                f"{where}: {sorted(unknown)[0]!r} is not supported when the call is forced "
                "(tool_choice required or named)",
                "tools",
            )
        if "enum" in schema:
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                raise APIError(400, f"{where}.enum: must be a non-empty list", "tools")
            return self.alternatives(values, lambda v: _literal(v, where), "enum")
        kind = schema.get("type")
        if isinstance(kind, list):
            if not kind:
                raise APIError(400, f"{where}.type: must be a type name or a non-empty list of them", "tools")
            return self.alternatives(
                kind, lambda k: self.value({**schema, "type": _type_name(k, where)}, where), "any"
            )
        if kind == "string":
            limit = _bound(schema, "maxLength", None, where)
            chars = f"[^<\\\\]{{0,{limit}}}" if limit is not None else "[^<\\\\]*"
            return self.rule(f'"<|\\"|>" {chars} "<|\\"|>"', "str")
        if kind == "integer":
            return self.rule('"-"? ("0" | [1-9] [0-9]{0,15})', "int")
        if kind == "number":
            return self.rule('"-"? ("0" | [1-9] [0-9]{0,15}) ("." [0-9]{1,15})?', "num")
        if kind == "boolean":
            return self.rule('"true" | "false"', "bool")
        if kind == "null":
            return self.rule('"null"', "null")
        if kind == "array":
            item = self.value(schema.get("items", {"type": "string"}), f"{where}.items")
            lo, hi = _bound(schema, "minItems", 0, where), _bound(schema, "maxItems", 16, where)
            if lo > hi:
                raise APIError(400, f"{where}: minItems exceeds maxItems", "tools")
            if hi == 0:
                return self.rule('"[]"', "arr")
            rest = f'("," {item}){{{max(lo - 1, 0)},{hi - 1}}}'
            body = f'"[" {item} {rest} "]"'
            return self.rule(body + (' | "[]"' if lo == 0 else ""), "arr")
        if kind == "object" or (kind is None and "properties" in schema):
            return self.object(schema, where)
        raise APIError(400, f"{where}.type: {kind!r} is not supported when the call is forced", "tools")

    def object(self, schema: dict, where: str) -> str:
        props = schema.get("properties") or {}
        required = set(schema.get("required") or [])
        missing = required - set(props)
        if missing:
            raise APIError(
                400, f"{where}.required: {sorted(missing)[0]!r} has no schema in properties", "tools"
            )
        keys = sorted(props)
        for key in keys:
            if not _KEY.fullmatch(key):
                raise APIError(
                    400, f"{where}.properties: key {key!r} cannot be a Gemma 4 argument name", "tools"
                )
        items = [f'"{k}:" {self.value(props[k], f"{where}.properties.{k}")}' for k in keys]
        # first[i]: members from i on, none written yet; after[i]: from i on, after one was written.
        first, after = ['""'] * (len(keys) + 1), ['""'] * (len(keys) + 1)
        for i in range(len(keys) - 1, -1, -1):
            if keys[i] in required:
                after[i] = self.rule(f'"," {items[i]} {after[i + 1]}', "a")
                first[i] = self.rule(f"{items[i]} {after[i + 1]}", "f")
            else:
                after[i] = self.rule(f'("," {items[i]})? {after[i + 1]}', "a")
                first[i] = self.rule(f"{items[i]} {after[i + 1]} | {first[i + 1]}", "f")
        return self.rule(f'"{{" {first[0]} "}}"', "obj")


def _type_name(kind: Any, where: str) -> str:
    if not isinstance(kind, str):
        raise APIError(400, f"{where}.type: must be a type name or a non-empty list of them", "tools")
    return kind


def _literal(value: Any, where: str) -> str:
    if isinstance(value, str):
        if "<" in value or "\\" in value:
            raise APIError(400, f"{where}.enum: values with '<' or '\\\\' are not supported", "tools")
        return json.dumps(f'<|"|>{value}<|"|>')
    if isinstance(value, float) and not math.isfinite(value):  # 1e400: no JSON writes it
        raise APIError(400, f"{where}.enum: numbers must be finite", "tools")
    if isinstance(value, bool) or value is None or isinstance(value, (int, float)):
        return json.dumps(json.dumps(value))
    raise APIError(400, f"{where}.enum: only strings, numbers, booleans and null are supported", "tools")


def forced_call_grammar(schemas: dict[str, dict], names: list[str], parallel: bool) -> str:
    """EBNF: one call (or up to ``MAX_CALLS`` with ``parallel``) of one of ``names``."""
    builder = _Builder()
    calls = []
    index = {name: i for i, name in enumerate(schemas)}
    for name in names:
        args = builder.object(
            schemas[name] if schemas[name].get("type", "object") == "object" else {},
            f"tools[{index[name]}].function.parameters",
        )
        calls.append(builder.rule(f'"<|tool_call>call:{name}" {args} "<tool_call|>"', "call"))
    call = builder.rule(" | ".join(calls), "calls")
    root = f"{call}{{1,{MAX_CALLS}}}" if parallel else call
    return "\n".join([f"root ::= {root}", *builder.rules])


__all__ = ["MAX_CALLS", "MAX_TOOLS", "check_tools", "forced_call_grammar"]
