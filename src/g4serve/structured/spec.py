"""What a constrained request must produce: ``StructuredSpec`` parsed and validated from OpenAI's
``response_format`` (plus regex, choice and EBNF extensions), and its tokenizer-independent grammar.

Every error is a ``StructuredOutputError`` whose message starts with the offending field's path.
JSON Schema keywords that xgrammar would silently ignore are refused here, so an accepted schema is
one whose constrained output always validates.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from g4serve.structured.forced import MAX_FORCED_CHARS, forced_text_bound

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 1 << 18  # schemas, patterns and grammars longer than this are refused (compile cost)
MAX_CHOICES = 4096
MAX_MULTIPLE_OF = 1024  # xgrammar enforces an integer's multipleOf up to this
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_FIELDS = {
    "json_object": "response_format",
    "json_schema": "response_format.json_schema.schema",
    "regex": "response_format.regex",
    "choice": "response_format.choice",
    "grammar": "response_format.grammar",
}
# Keywords xgrammar parses but does not enforce (checked by fuzzing its grammars against jsonschema).
_UNSUPPORTED = (
    "not",
    "if",
    "then",
    "else",
    "dependentSchemas",
    "dependentRequired",
    "dependencies",
    "contains",
    "minContains",
    "maxContains",
    "$dynamicRef",
    "$recursiveRef",
)
# Where subschemas live (2020-12 and draft 7).
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = (
    "additionalProperties",
    "items",
    "additionalItems",
    "propertyNames",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "unevaluatedProperties",
    "unevaluatedItems",
    "contentSchema",
)
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf", "items")
# A pattern that names a double quote or a backslash would put it raw inside a JSON string.
_QUOTE_IN_PATTERN = re.compile(r'"|\\\\|\\x(22|5c)|\\u00(22|5c)', re.IGNORECASE)
# xgrammar prefixes its messages with "[hh:mm:ss] /path/file.cc:123: ".
_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class StructuredOutputError(ValueError):
    """An invalid or unsupported structured-output request; the message starts with the field path."""


@dataclass(frozen=True)
class StructuredSpec:
    """A constraint on a request's output: ``kind`` and its canonical ``value``.

    ``json_object``: any JSON object (value ""); ``json_schema``: the schema as compact JSON (key order
    kept: it is the order properties are generated in); ``regex``: the pattern; ``choice``: a JSON list
    of the allowed strings; ``grammar``: EBNF text with a ``root`` rule. Equal specs share one compiled
    grammar. Build specs with the class methods below, which validate them fully.
    """

    kind: str
    value: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise StructuredOutputError(
                f"response_format.type: must be one of {', '.join(KINDS)}; got {self.kind!r}"
            )
        if not isinstance(self.value, str):
            raise StructuredOutputError(f"{self.field}: must be a string, got {type(self.value).__name__}")

    @property
    def field(self) -> str:
        """Path of the response_format field this spec came from (used in error messages)."""
        return _FIELDS[self.kind]

    @property
    def schema(self) -> dict | None:
        """The JSON schema of a ``json_schema`` spec ({"type": "object"} for ``json_object``)."""
        if self.kind == "json_object":
            return {"type": "object"}
        return json.loads(self.value) if self.kind == "json_schema" else None

    # ---- constructors (validating) -----------------------------------------------------------
    @classmethod
    def json_object(cls) -> StructuredSpec:
        return cls("json_object")

    @classmethod
    def json_schema(
        cls, schema: Mapping[str, Any] | str, field: str = _FIELDS["json_schema"]
    ) -> StructuredSpec:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise StructuredOutputError(f"{field}: not valid JSON ({exc})") from None
        if not isinstance(schema, Mapping):
            raise StructuredOutputError(f"{field}: must be a JSON object, got {_type_name(schema)}")
        try:
            value = json.dumps(schema, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise StructuredOutputError(f"{field}: not serializable as JSON ({exc})") from None
        _check_size(field, value)
        spec = cls("json_schema", value)
        check_json_schema(json.loads(value), field)
        build_grammar(spec)
        return spec

    @classmethod
    def regex(cls, pattern: str) -> StructuredSpec:
        field = _FIELDS["regex"]
        if not isinstance(pattern, str) or not pattern:
            raise StructuredOutputError(f"{field}: must be a non-empty string, got {_type_name(pattern)}")
        _check_size(field, pattern)
        spec = cls("regex", pattern)
        build_grammar(spec)
        return spec

    @classmethod
    def choice(cls, choices: Sequence[str]) -> StructuredSpec:
        field = _FIELDS["choice"]
        if isinstance(choices, (str, bytes)) or not isinstance(choices, Sequence) or not choices:
            raise StructuredOutputError(
                f"{field}: must be a non-empty list of strings, got {_type_name(choices)}"
            )
        if len(choices) > MAX_CHOICES:
            raise StructuredOutputError(f"{field}: at most {MAX_CHOICES} choices, got {len(choices)}")
        for i, choice in enumerate(choices):
            if not isinstance(choice, str) or not choice:
                raise StructuredOutputError(
                    f"{field}[{i}]: must be a non-empty string, got {_type_name(choice)}"
                )
        value = json.dumps(list(choices), ensure_ascii=False)
        _check_size(field, value)
        spec = cls("choice", value)
        build_grammar(spec)
        return spec

    @classmethod
    def grammar(cls, ebnf: str) -> StructuredSpec:
        field = _FIELDS["grammar"]
        if not isinstance(ebnf, str) or not ebnf.strip():
            raise StructuredOutputError(f"{field}: must be a non-empty EBNF string, got {_type_name(ebnf)}")
        _check_size(field, ebnf)
        spec = cls("grammar", ebnf)
        build_grammar(spec)
        return spec

    @classmethod
    def from_response_format(cls, response_format: Mapping[str, Any] | None) -> StructuredSpec | None:  # noqa: C901 - validates the envelope, then one dispatch branch per response_format.type
        """Parse OpenAI's ``response_format``: ``{"type": "text"}`` (None), ``{"type": "json_object"}``,
        ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``; and the
        extensions ``{"type": "regex", "regex": ...}``, ``{"type": "choice", "choice": [...]}`` and
        ``{"type": "grammar", "grammar": <EBNF>}``."""
        if response_format is None:
            return None
        if not isinstance(response_format, Mapping):
            raise StructuredOutputError(
                f"response_format: must be an object, got {_type_name(response_format)}"
            )
        kind = response_format.get("type")
        if kind is None:
            raise StructuredOutputError("response_format.type: is required")
        if kind not in ("text", *KINDS):
            raise StructuredOutputError(
                f"response_format.type: must be one of text, {', '.join(KINDS)}; got {kind!r}"
            )
        payload = {
            "text": (),
            "json_object": (),
            "json_schema": ("json_schema",),
            "regex": ("regex",),
            "choice": ("choice",),
            "grammar": ("grammar",),
        }[kind]
        _no_unknown("response_format", response_format, {"type", *payload})
        for key in payload:
            if key not in response_format:
                raise StructuredOutputError(f"response_format.{key}: is required when type is {kind!r}")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls.json_object()
        if kind == "regex":
            return cls.regex(response_format["regex"])
        if kind == "choice":
            return cls.choice(response_format["choice"])
        if kind == "grammar":
            return cls.grammar(response_format["grammar"])
        return cls._from_json_schema_format(response_format["json_schema"])

    @classmethod
    def _from_json_schema_format(cls, js: Any) -> StructuredSpec:
        """``response_format.json_schema``: ``{"name": ..., "description": ..., "schema": {...},
        "strict": ...}``."""
        if not isinstance(js, Mapping):
            raise StructuredOutputError(
                f"response_format.json_schema: must be an object, got {_type_name(js)}"
            )
        _no_unknown("response_format.json_schema", js, {"name", "description", "schema", "strict"})
        name = js.get("name")
        if name is not None and (not isinstance(name, str) or not _NAME.fullmatch(name)):
            raise StructuredOutputError(
                "response_format.json_schema.name: must be 1-64 letters, digits, '_' or '-', got "
                + repr(name)
            )
        if js.get("description") is not None and not isinstance(js["description"], str):
            raise StructuredOutputError("response_format.json_schema.description: must be a string")
        if js.get("strict") is not None and not isinstance(js["strict"], bool):
            raise StructuredOutputError(
                f"response_format.json_schema.strict: must be a boolean, got {js['strict']!r}"
            )
        if "schema" not in js:
            raise StructuredOutputError("response_format.json_schema.schema: is required")
        # Output is always constrained, strict or not: a non-strict schema is enforced too.
        return cls.json_schema(js["schema"])


# ---- JSON Schema checks --------------------------------------------------------------------------
def check_json_schema(schema: dict, field: str = _FIELDS["json_schema"]) -> None:
    """Refuse schemas that are not valid JSON Schema (meta-schema check) or that use keywords the
    grammar would not enforce."""
    import jsonschema

    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = _join(field, list(exc.path))
        raise StructuredOutputError(f"{where}: not a valid JSON Schema: {exc.message}") from None
    for path, node in _subschemas(schema, field):
        _check_keywords(path, node)


def _check_keywords(path: str, node: dict) -> None:
    """Refuse a schema object's keywords that the grammar would not enforce."""
    for key in _UNSUPPORTED:
        if key in node:
            raise StructuredOutputError(f"{path}.{key}: is not supported by constrained decoding")
    if node.get("uniqueItems") is True:
        raise StructuredOutputError(f"{path}.uniqueItems: is not supported by constrained decoding")
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        raise StructuredOutputError(
            f"{path}.allOf: more than one subschema is not supported by constrained "
            "decoding; merge them into one schema"
        )
    if "multipleOf" in node and node.get("type") != "integer":
        raise StructuredOutputError(f"{path}.multipleOf: is only supported with type 'integer'")
    multiple = node.get("multipleOf")
    if isinstance(multiple, (int, float)) and not 0 < multiple <= MAX_MULTIPLE_OF:
        # xgrammar warns and drops the constraint (any integer would pass)
        raise StructuredOutputError(f"{path}.multipleOf: must lie in (0, {MAX_MULTIPLE_OF}]")
    ref = node.get("$ref")
    if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
        # a remote or relative URI: xgrammar warns and matches any JSON value
        raise StructuredOutputError(f"{path}.$ref: only references inside the schema ('#/...') are supported")
    _check_patterns(path, node)


def _check_patterns(path: str, node: dict) -> None:
    patterns = [(f"{path}.pattern", node["pattern"])] if isinstance(node.get("pattern"), str) else []
    patterns += [(f"{path}.patternProperties", p) for p in node.get("patternProperties") or {}]
    for where, pattern in patterns:
        if _QUOTE_IN_PATTERN.search(pattern):
            raise StructuredOutputError(
                f"{where}: a pattern that matches a double quote or a backslash is "
                "not supported by constrained decoding"
            )


def prepare_json_schema(schema: dict, field: str = _FIELDS["json_schema"]) -> dict:
    """The schema as the grammar builder needs it: xgrammar ignores ``required`` names missing from
    ``properties``, so declare each with the schema its value must follow (``additionalProperties``'). Beside
    ``patternProperties`` such a name is refused instead: which schema it follows would take running the
    client's pattern, and Python's backtracking ``re`` can take exponential time on one (``^(a+)+$`` against
    ``aaa…a!``) while it holds the interpreter, the event loop included."""
    schema = copy.deepcopy(schema)
    for path, node in _subschemas(schema, field):
        required = node.get("required")
        if not isinstance(required, list):
            continue
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        for name in required:
            if name in props:
                continue
            if node.get("patternProperties"):
                raise StructuredOutputError(
                    f"{path}.required: {name!r} is not in properties; beside patternProperties, declare "
                    "every required name in properties"
                )
            extra = node.get("additionalProperties", True)
            if extra is False:
                raise StructuredOutputError(
                    f"{path}.required: {name!r} is required but additionalProperties is "
                    "false, so no JSON value satisfies the schema"
                )
            props[name] = {} if extra is True else extra
        node["properties"] = props
    return schema


def _subschemas(schema: Any, path: str) -> Iterator[tuple[str, dict]]:
    """Every schema object inside ``schema`` (itself included), with its path."""
    if not isinstance(schema, dict):
        return
    yield path, schema
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                yield from _subschemas(sub, f"{path}.{key}.{name}")
    for key in _SCHEMA_ONE:
        if isinstance(schema.get(key), dict):
            yield from _subschemas(schema[key], f"{path}.{key}")
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                yield from _subschemas(sub, f"{path}.{key}[{i}]")


# ---- grammar ----------------------------------------------------------------------------------------
# JSON is generated on one line with json.dumps' separators: no free whitespace, so a model cannot
# loop on spaces or newlines (and no token holding a control character is ever needed).
JSON_FORMAT = {"any_whitespace": False}


def build_grammar(spec: StructuredSpec):
    """The spec's ``xgrammar.Grammar`` (tokenizer-independent; raises StructuredOutputError), refused where it
    could force more text at once than ``forced.MAX_FORCED_CHARS``."""
    grammar = _xgrammar_of(spec)
    bound = forced_text_bound(str(grammar))
    if bound > MAX_FORCED_CHARS:
        raise StructuredOutputError(
            f"{spec.field}: forces up to {bound} characters of fixed text (at most {MAX_FORCED_CHARS}): "
            "lower its repetition counts (minItems, minLength of fixed text, {n} in a regex or grammar)"
        )
    return grammar


def _xgrammar_of(spec: StructuredSpec):
    import xgrammar as xgr

    try:
        if spec.kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', **JSON_FORMAT)
        if spec.kind == "json_schema":
            schema = json.dumps(prepare_json_schema(json.loads(spec.value), spec.field))
            try:
                # strict_mode: no properties or items beyond those the schema names (still valid output).
                return xgr.Grammar.from_json_schema(schema, strict_mode=True, **JSON_FORMAT)
            except RuntimeError:
                # Some valid schemas (minItems without items, ...) only compile without strict mode.
                return xgr.Grammar.from_json_schema(schema, strict_mode=False, **JSON_FORMAT)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.value)
        if spec.kind == "choice":
            literals = " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(spec.value))
            return xgr.Grammar.from_ebnf(f"root ::= {literals}")
        return xgr.Grammar.from_ebnf(spec.value)
    except RuntimeError as exc:
        raise StructuredOutputError(f"{spec.field}: cannot compile: {clean_xgrammar_error(exc)}") from None


def clean_xgrammar_error(exc: BaseException) -> str:
    return _XGR_PREFIX.sub("", str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)


# ---- helpers -----------------------------------------------------------------------------------------
def _check_size(field: str, text: str) -> None:
    if len(text) > MAX_SPEC_CHARS:
        raise StructuredOutputError(f"{field}: too large ({len(text)} characters; at most {MAX_SPEC_CHARS})")


def _no_unknown(path: str, obj: Mapping, known: set[str]) -> None:
    for key in obj:
        if key not in known:
            raise StructuredOutputError(f"{path}.{key}: unknown field")


def _join(field: str, parts: list) -> str:
    return field + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts)


def _type_name(value: Any) -> str:
    names = {
        dict: "object",
        list: "array",
        str: "string",
        bool: "boolean",
        type(None): "null",
        int: "integer",
        float: "number",
    }
    return names.get(type(value), type(value).__name__)
