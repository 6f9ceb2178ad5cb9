"""Gemma 4's own chat template on hostile tool conversations: its loops whose work grew with the square of a
conversation (``processing/gemma4_template.py``) render the same text in linear time, and what the template
walks value by value is bounded before it renders."""

from __future__ import annotations

import random
import time

import jinja2
import jinja2.ext
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from g4serve.processing.chat_template import compile_chat_template
from g4serve.processing.gemma4_template import linear_template
from g4serve.processing.tiny_tokenizer import gemma4_chat_template, write_tiny_tokenizer
from g4serve.processing.tokenizer import MAX_TEMPLATE_VALUES, Tokenizer

TEMPLATE = gemma4_chat_template()
# Google's own file says what each block does in {#- comments -#} between its tags.
COMMENTED = (
    TEMPLATE.replace(
        "{%- set prev_nt = namespace(role=None, found=false) -%}",
        "{#- Detect continuation: suppress a second <|turn>model -#}\n"
        "    {%- set prev_nt = namespace(role=None, found=false) -%}",
    )
    .replace(
        "{%- set ns_tool_scan = namespace(stopped=false) -%}",
        "{#- OpenAI Chat Completions: forward-scan consecutive role:tool messages -#}\n"
        "                {%- set ns_tool_scan = namespace(stopped=false) -%}",
    )
    .replace(
        "{%- for tc in message['tool_calls'] -%}",
        "{#- Resolve tool_call_id to function name -#}\n{%- for tc in message['tool_calls'] -%}",
    )
    .replace("{%- set ns = namespace(result='') -%}", "{#- go -#}{%- set ns = namespace(result='') -%}")
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_balance",
            "description": "The balance.",
            "parameters": {"type": "object", "properties": {"account": {"type": "string"}}},
        },
    }
]


def _as_written(template: str) -> jinja2.Template:
    """The template in transformers' environment, without the rewrites."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    return env.from_string(template)


def _render(template: jinja2.Template, messages: list, tools=None) -> str:
    try:
        return template.render(messages=messages, tools=tools, bos_token="<bos>", add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - both renders must fail alike
        return f"error: {type(exc).__name__}"


def _call(rng: random.Random, ids: list) -> dict:
    call = {"type": "function", "function": {"name": rng.choice(["f", "g", "h"]), "arguments": {"a": 1}}}
    if rng.random() < 0.9:
        call["id"] = rng.choice(ids)
    return call


def _tool_result(rng: random.Random, ids: list) -> dict:
    message = {"role": "tool", "content": rng.choice(["ok", "", '{"x": 1}'])}
    if rng.random() < 0.3:
        message["content"] = [
            rng.choice([{"type": "text", "text": "t"}, {"type": "image"}, {"type": "text", "text": "u"}])
            for _ in range(rng.randint(0, 3))
        ]
    if rng.random() < 0.8:
        message["tool_call_id"] = rng.choice(ids)
    if rng.random() < 0.6:  # a result that neither names its call nor matches its id fails the template
        message["name"] = "named"
    return message


def _conversation(rng: random.Random) -> list[dict]:
    ids = ["a", "b", "c", 1, 1.0, True, None, ["a"], {"k": 1}]
    messages: list[dict] = [{"role": "system", "content": "Bank."}] if rng.random() < 0.3 else []
    for _ in range(rng.randint(1, 12)):
        kind = rng.choice(["user", "assistant", "calls", "tool", "tool"])
        if kind == "user":
            messages.append({"role": "user", "content": "q"})
        elif kind == "assistant":
            text = rng.choice(["a", "x<|channel>thought\nhm<channel|>y", "<channel|>z<|channel>w", ""])
            content = rng.choice([text, [{"type": "text", "text": text}]])
            messages.append({"role": "assistant", "content": content})
        elif kind == "calls":
            message = {"role": "assistant", "tool_calls": [_call(rng, ids) for _ in range(rng.randint(1, 4))]}
            if rng.random() < 0.3:
                message["reasoning_content"] = "think"
            if rng.random() < 0.1:
                message["tool_responses"] = [{"name": "f", "response": {"v": 2}}]
            messages.append(message)
            messages += [_tool_result(rng, ids) for _ in range(rng.choice([0, 1, 2, 5]))]
        else:
            messages.append(_tool_result(rng, ids))
    return messages


@pytest.mark.parametrize("template", [TEMPLATE, COMMENTED], ids=["as-shipped", "commented"])
def test_rewritten_template_renders_what_the_template_as_written_renders(template):
    """Every rewrite is found (also with comments between its tags), and random tool conversations (calls
    and results in any order, ids repeated, equal across types, missing, unhashable; text and image parts;
    thoughts in model text) render the same text, or fail alike."""
    rewritten = linear_template(template)
    for marker in ("g4_last_nt", "{%- break -%}", "g4_calls.last", "g4_tool_text", "g4_strip_thinking"):
        assert marker in rewritten, marker
    ours, theirs = compile_chat_template(template), _as_written(template)
    rng = random.Random(7)
    for _ in range(300):
        messages = _conversation(rng)
        tools = TOOLS if rng.random() < 0.5 else None
        assert _render(ours, messages, tools) == _render(theirs, messages, tools), messages


def _seconds(messages: list) -> float:
    template = compile_chat_template(TEMPLATE)
    began = time.perf_counter()
    template.render(messages=messages, bos_token="<bos>", add_generation_prompt=True)
    return time.perf_counter() - began


def _call_with_id(i: int) -> dict:
    return {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": {}}}


def test_tool_conversations_render_in_linear_time():
    """Before (2-core CPU): 4,095 calls and results in turn 18 s, one message of 8,000 calls with 4,000
    results 237 s, a result of 20,000 text parts 6.4 s. Here at a fraction of those sizes (which took 4.1 s,
    2.5 s and 2.6 s): each well under a second."""
    user = [{"role": "user", "content": "hi"}]
    alternating = list(user)
    for i in range(1000):
        alternating += [
            {"role": "assistant", "tool_calls": [_call_with_id(i)]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": "ok"},
        ]
    many = [
        *user,
        {"role": "assistant", "tool_calls": [_call_with_id(i) for i in range(600)]},
        *({"role": "tool", "tool_call_id": f"c{i}", "content": "ok"} for i in range(600)),
    ]
    parts = [
        *user,
        {"role": "assistant", "tool_calls": [_call_with_id(0)]},
        {"role": "tool", "tool_call_id": "c0", "content": [{"type": "text", "text": "x" * 100}] * 12_000},
        {"role": "assistant", "content": ("y" * 100 + "<channel|>") * 12_000},
    ]
    for name, messages in (("alternating", alternating), ("one message", many), ("parts", parts)):
        assert _seconds(messages) < 1.0, name


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_pretrained(write_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


def test_values_the_template_walks_are_bounded(tok: Tokenizer):
    """1,000,000 numbers in an enum, a call's arguments or a tool result (3 MB) each held a template thread
    8 s (a 64 MiB body, minutes); past ``MAX_TEMPLATE_VALUES`` they are refused before rendering."""
    user = [{"role": "user", "content": "hi"}]
    numbers = [1] * (MAX_TEMPLATE_VALUES + 1)
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": numbers}}}
    calls = {"role": "assistant", "tool_calls": [call]}
    legacy = {**calls, "tool_responses": [{"name": "f", "response": numbers}]}
    for messages, tools in ((user, _enum_tool(numbers)), ([*user, calls], None), ([*user, legacy], None)):
        began = time.perf_counter()
        with pytest.raises(ValueError, match=f"more than {MAX_TEMPLATE_VALUES} JSON values"):
            tok.apply_chat_template(messages, True, tools)
        assert time.perf_counter() - began < 1.0
    assert tok.apply_chat_template(user, True, _enum_tool(numbers[:1000]))


def _enum_tool(values: list) -> list[dict]:
    schema = {"type": "object", "properties": {"a": {"type": "integer", "enum": values}}}
    return [{"type": "function", "function": {"name": "f", "parameters": schema}}]
