"""StructuredSpec: OpenAI response_format shapes, extensions, and every error naming its field."""

from __future__ import annotations

import json
import re

import pytest

from g4serve.structured import StructuredOutputError, StructuredSpec

SCHEMA = {
    "type": "object",
    "properties": {"b": {"type": "integer"}, "a": {"type": "string"}},
    "required": ["b"],
}


def rf_schema(schema, **extra) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, **extra}}


def test_openai_shapes():
    assert StructuredSpec.from_response_format(None) is None
    assert StructuredSpec.from_response_format({"type": "text"}) is None
    assert StructuredSpec.from_response_format({"type": "json_object"}) == StructuredSpec("json_object", "")
    spec = StructuredSpec.from_response_format(rf_schema(SCHEMA, strict=True, description="d"))
    assert spec.kind == "json_schema"
    # Canonical: compact JSON that keeps the declared property order (the order of generation).
    assert spec.value == json.dumps(SCHEMA, separators=(",", ":"))
    assert list(spec.schema["properties"]) == ["b", "a"]
    assert spec.field == "response_format.json_schema.schema"
    # strict and name do not change the constraint: equal specs share one compiled grammar.
    assert (
        StructuredSpec.from_response_format({"type": "json_schema", "json_schema": {"schema": SCHEMA}})
        == spec
    )
    assert hash(StructuredSpec.json_schema(json.dumps(SCHEMA))) == hash(spec)


def test_extensions():
    assert StructuredSpec.from_response_format({"type": "regex", "regex": "[a-z]+"}) == StructuredSpec(
        "regex", "[a-z]+"
    )
    choice = StructuredSpec.from_response_format({"type": "choice", "choice": ["yes", "no", 'a "quoted" é']})
    assert choice.kind == "choice" and json.loads(choice.value) == ["yes", "no", 'a "quoted" é']
    grammar = StructuredSpec.from_response_format({"type": "grammar", "grammar": 'root ::= "a" | "b" root'})
    assert grammar.kind == "grammar"
    assert StructuredSpec.json_object().schema == {"type": "object"}


@pytest.mark.parametrize(
    ("response_format", "field"),
    [
        (["json_object"], "response_format: must be an object"),
        ({}, "response_format.type: is required"),
        ({"type": "xml"}, "response_format.type: must be one of"),
        ({"type": 3}, "response_format.type: must be one of"),
        ({"type": "text", "extra": 1}, "response_format.extra: unknown field"),
        ({"type": "json_object", "schema": {}}, "response_format.schema: unknown field"),
        ({"type": "json_schema"}, "response_format.json_schema: is required"),
        ({"type": "json_schema", "json_schema": "x"}, "response_format.json_schema: must be an object"),
        (
            {"type": "json_schema", "json_schema": {"name": "x"}},
            "response_format.json_schema.schema: is required",
        ),
        (
            {"type": "json_schema", "json_schema": {"schema": {}, "foo": 1}},
            "response_format.json_schema.foo: unknown field",
        ),
        (
            rf_schema(SCHEMA) | {"json_schema": {"name": "bad name!", "schema": SCHEMA}},
            "response_format.json_schema.name:",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": 5, "schema": SCHEMA}},
            "response_format.json_schema.name:",
        ),
        (rf_schema(SCHEMA, strict="yes"), "response_format.json_schema.strict: must be a boolean"),
        (rf_schema(SCHEMA, description=3), "response_format.json_schema.description: must be a string"),
        (rf_schema([1, 2]), "response_format.json_schema.schema: must be a JSON object, got array"),
        (rf_schema("{not json"), "response_format.json_schema.schema: not valid JSON"),
        (rf_schema({"type": "foo"}), "response_format.json_schema.schema.type: not a valid JSON Schema"),
        (
            rf_schema({"type": "object", "properties": {"a": {"type": "integer", "minimum": "0"}}}),
            "response_format.json_schema.schema.properties.a.minimum: not a valid JSON Schema",
        ),
        (
            rf_schema({"type": "object", "required": "a"}),
            "response_format.json_schema.schema.required: not a valid JSON",
        ),
        (
            rf_schema({"type": "array", "items": {"type": "integer", "not": {"const": 3}}}),
            "response_format.json_schema.schema.items.not: is not supported",
        ),
        (
            rf_schema({"anyOf": [{"type": "object", "if": {}, "then": {}}]}),
            "response_format.json_schema.schema.anyOf[0].if:",
        ),
        (
            rf_schema({"type": "array", "uniqueItems": True}),
            "response_format.json_schema.schema.uniqueItems:",
        ),
        (
            rf_schema({"type": "array", "contains": {"const": 1}}),
            "response_format.json_schema.schema.contains:",
        ),
        (
            rf_schema({"type": "object", "dependentRequired": {"a": ["b"]}}),
            "response_format.json_schema.schema.dependentRequired:",
        ),
        (
            rf_schema({"allOf": [{"type": "object"}, {"required": ["a"]}]}),
            "response_format.json_schema.schema.allOf: more than one",
        ),
        (
            rf_schema({"type": "number", "multipleOf": 0.5}),
            "response_format.json_schema.schema.multipleOf: is only supported",
        ),
        (
            rf_schema({"$defs": {"s": {"type": "string", "pattern": '^a"b$'}}, "$ref": "#/$defs/s"}),
            "response_format.json_schema.schema.$defs.s.pattern: a pattern that matches a double quote",
        ),
        (
            rf_schema(
                {
                    "type": "object",
                    "properties": {"a": {"type": "integer"}},
                    "required": ["zz"],
                    "additionalProperties": False,
                }
            ),
            "response_format.json_schema.schema.required: 'zz' is required but",
        ),
        (
            rf_schema({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}),
            "response_format.json_schema.schema: cannot compile: ",
        ),
        (
            rf_schema(
                {"type": "object", "properties": {"a": {"type": "string", "minLength": 5, "maxLength": 2}}}
            ),
            "response_format.json_schema.schema: cannot compile: ",
        ),
        (
            rf_schema({"type": "string", "description": "x" * (1 << 18)}),
            "response_format.json_schema.schema: too large",
        ),
        ({"type": "regex"}, "response_format.regex: is required"),
        ({"type": "regex", "regex": ""}, "response_format.regex: must be a non-empty string"),
        ({"type": "regex", "regex": ["a"]}, "response_format.regex: must be a non-empty string"),
        ({"type": "regex", "regex": "a{"}, "response_format.regex: cannot compile: Regex parsing error"),
        ({"type": "regex", "regex": "(?<=a)b"}, "response_format.regex: cannot compile: "),
        ({"type": "choice", "choice": []}, "response_format.choice: must be a non-empty list"),
        ({"type": "choice", "choice": "yes"}, "response_format.choice: must be a non-empty list"),
        ({"type": "choice", "choice": ["yes", 3]}, "response_format.choice[1]: must be a non-empty string"),
        ({"type": "choice", "choice": ["yes", ""]}, "response_format.choice[1]: must be a non-empty string"),
        (
            {"type": "grammar", "grammar": "root ::= "},
            "response_format.grammar: cannot compile: EBNF parser error",
        ),
        ({"type": "grammar", "grammar": 'start ::= "a"'}, "response_format.grammar: cannot compile: "),
        ({"type": "grammar", "grammar": "  "}, "response_format.grammar: must be a non-empty EBNF string"),
    ],
)
def test_errors_name_the_field(response_format, field):
    with pytest.raises(StructuredOutputError) as info:
        StructuredSpec.from_response_format(response_format)
    message = str(info.value)
    assert message.startswith(field), message
    assert "/project/" not in message and "\n" not in message  # xgrammar's source location is stripped
    assert isinstance(info.value, ValueError)


def test_direct_construction_checks_kind():
    with pytest.raises(StructuredOutputError, match="^response_format.type: must be one of"):
        StructuredSpec("yaml", "x")
    with pytest.raises(StructuredOutputError, match="^response_format.regex: must be a string"):
        StructuredSpec("regex", 3)


def test_required_without_property_is_declared():
    # xgrammar ignores required names missing from properties; the spec declares them so they appear.
    from g4serve.structured.spec import prepare_json_schema

    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "required": ["a", "x"],
        "additionalProperties": {"type": "string"},
    }
    prepared = prepare_json_schema(schema)
    assert prepared["properties"] == {"a": {"type": "integer"}, "x": {"type": "string"}}
    assert "x" not in schema["properties"]  # the caller's schema is untouched
    StructuredSpec.json_schema(schema)
    # beside patternProperties a required name must be declared: finding its schema would run the pattern
    with_patterns = schema | {"required": ["a", "y1"], "patternProperties": {"^y": {"type": "boolean"}}}
    with pytest.raises(StructuredOutputError, match=r"schema.required: 'y1' is not in properties"):
        StructuredSpec.json_schema(with_patterns)
    declared = with_patterns | {"properties": {"a": {"type": "integer"}, "y1": {"type": "boolean"}}}
    StructuredSpec.json_schema(declared)


def test_client_patterns_are_never_run_by_python_re():
    """``^(a+)+$`` against 40 a's and a '!' backtracks ~2^40 steps in Python's ``re``, holding the interpreter
    (the event loop, every stream) for hours: the spec refuses without running it, at once."""
    import time

    schema = {
        "type": "object",
        "patternProperties": {"^(a+)+$": {"type": "string"}},
        "required": ["a" * 40 + "!"],
    }
    StructuredSpec.json_schema({"type": "object"})  # imports, outside the clock
    began = time.perf_counter()
    with pytest.raises(StructuredOutputError, match=r"schema.required: 'a+!' is not in properties"):
        StructuredSpec.json_schema(schema)
    assert time.perf_counter() - began < 1.0


@pytest.mark.parametrize(
    "schema,where",
    [
        ({"type": "integer", "multipleOf": 1025}, "schema.multipleOf: must lie in (0, 1024]"),
        ({"$ref": "http://example.com/s.json"}, "schema.$ref: only references inside the schema"),
        ({"type": "object", "properties": {"a": {"$ref": "other.json#/x"}}}, "properties.a.$ref: only"),
    ],
)
def test_keywords_xgrammar_would_drop_are_refused(schema, where):
    """xgrammar warns and drops an integer multipleOf past 1,024 and a $ref outside the schema (any value
    would then pass), so an accepted schema would not bind its output."""
    with pytest.raises(StructuredOutputError, match=re.escape(where)):
        StructuredSpec.json_schema(schema)
    StructuredSpec.json_schema({"type": "integer", "multipleOf": 1024})
    StructuredSpec.json_schema({"$ref": "#/$defs/a", "$defs": {"a": {"type": "integer"}}})


@pytest.mark.parametrize(
    "make",
    [
        lambda: StructuredSpec.json_schema({"type": "array", "items": {"const": "x"}, "minItems": 100_000}),
        lambda: StructuredSpec.regex("(a{1000}){1000}"),
        lambda: StructuredSpec.grammar('root ::= "a"{100000000}'),
        # each rule doubles the one before: 2^21 characters from 20 short lines
        lambda: StructuredSpec.grammar(
            "\n".join(["root ::= r20", *(f"r{i} ::= r{i - 1} r{i - 1}" for i in range(1, 21)), 'r0 ::= "ab"'])
        ),
        lambda: StructuredSpec.choice(["x" * 9000]),
    ],
)
def test_specs_that_force_megabytes_of_text_are_refused(make):
    """xgrammar computes the forced text (jump-forward, the closing planner) on the engine thread with no
    limit, in time that grows with its square: a 100,000-item const array held it 5 minutes and 23 GB, and
    ``"a"{100000000}`` ran the server out of memory."""
    with pytest.raises(StructuredOutputError, match=r"forces up to \d+ characters of fixed text"):
        make()


def test_long_free_text_and_many_required_names_stay_allowed():
    """The bound counts fixed text only: characters the model chooses, and fixed pieces between them, pass."""
    from g4serve.structured.forced import MAX_FORCED_CHARS, forced_text_bound

    StructuredSpec.json_schema({"type": "string", "minLength": 50_000})
    StructuredSpec.regex("[a-z]{20000}")
    names = [f"field_{i:019d}" for i in range(200)]
    StructuredSpec.json_schema(
        {"type": "object", "properties": {n: {"type": "integer"} for n in names}, "required": names}
    )
    StructuredSpec.json_schema({"type": "array", "items": {"const": "x"}, "minItems": 1000})
    StructuredSpec.grammar('root ::= "(" root ")" | "x"')  # recursion adds nothing at its reference
    assert forced_text_bound('root ::= (("ab" [a-z]* "c"{3} r?))\nr ::= (("zz"))') == 5
    assert forced_text_bound('root ::= (("a") | ("bcd"{2, 5}) (=("e")))') == 6
    assert MAX_FORCED_CHARS == 8192
