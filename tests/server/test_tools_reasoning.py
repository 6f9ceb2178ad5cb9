"""Gemma 4 tool calling and reasoning on /v1/chat/completions, on the tiny model with the openai client."""

from __future__ import annotations

import json

import pytest

from g4serve.server.gemma4_output import Gemma4OutputParser

openai = pytest.importorskip("openai")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_balance",
            "description": "The balance of an account.",
            "parameters": {
                "type": "object",
                "properties": {
                    "account": {"type": "string", "maxLength": 12},
                    "currency": {"enum": ["EUR", "USD"]},
                    "days": {"type": "integer"},
                },
                "required": ["account"],
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "get_rate", "parameters": {"type": "object", "properties": {}}},
    },
]
USER = [{"role": "user", "content": "What is the balance of account 4021?"}]
SPECIALS = {"<turn|>", "<|tool_response>", "<eos>", "<|image|>"}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def _parse(text: str, step: int):
    parser = Gemma4OutputParser(SPECIALS)
    content, reasoning, args = "", "", {}
    for i in range(0, len(text), step):
        for d in (parser.feed(text[i : i + step]),):
            content, reasoning = content + d.content, reasoning + d.reasoning
            for t in d.tool_calls:
                args[t.index] = args.get(t.index, "") + t.arguments
    last = parser.finish()
    return content + last.content, reasoning + last.reasoning, args, parser.complete_calls


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_parser_streams_safely_in_any_chunking(step):
    """vllm#44522: no raw <|"|> (or any marker) leaks into content or arguments, however the text is split;
    text before the thought tag stays content (vllm#54881/#50938's escape)."""
    text = (
        "Sure <|channel>thought\nlook it up<channel|>ok<turn|>"
        '<|tool_call>call:get_balance{account:<|"|>40"2<1<|"|>,days:3,tags:[true,<|"|>a<|"|>]}<tool_call|>'
        "<|tool_call>call:get_rate{}<tool_call|><|tool_response>"
    )
    content, reasoning, args, calls = _parse(text, step)
    assert content == "Sure ok" and reasoning == "look it up"
    assert [c["name"] for c in calls] == ["get_balance", "get_rate"]
    assert json.loads(args[0]) == {"account": '40"2<1', "days": 3, "tags": [True, "a"]} and args[1] == "{}"
    for piece in (content, reasoning, *args.values()):
        assert "<|" not in piece and "|>" not in piece


def test_parser_holds_a_partial_marker_then_releases_plain_text():
    parser = Gemma4OutputParser(SPECIALS)
    assert parser.feed("a <|tool_").content == "a "
    assert parser.feed("callx").content == ""  # "<|tool_callx" is no marker, but could be a special token
    assert parser.finish().content == "<|tool_callx"


def test_arguments_nested_past_the_recursion_limit_make_an_incomplete_call():
    """A client grammar can steer the output into arguments nested ~1,200 deep: Python's JSON parser gives up
    (RecursionError), and the call counts as incomplete instead of failing the whole response."""
    depth = 1200
    text = "<|tool_call>call:get_rate{a:" + "[" * depth + "]" * depth + "}x"  # no closing marker: checked
    content, _, args, calls = _parse(text, 1000)
    assert calls == [] and args[0].count("[") == depth


def test_tools_render_like_transformers(server, client):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(server.app.state.engine.engine.config.model)
    resp = client.chat.completions.create(
        model="tiny", messages=USER, tools=TOOLS, max_tokens=1, temperature=0
    )
    ids = hf.apply_chat_template(USER, tools=TOOLS, add_generation_prompt=True, return_dict=False)
    assert resp.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice_is_always_parseable(client, parallel):
    """100 of 100 calls parse and follow the schema on the random tiny model, forced by the grammar."""
    resp = client.chat.completions.create(
        model="tiny",
        messages=USER,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=parallel,
        max_tokens=300,
        temperature=1.0,
        n=16,
        seed=1,
    )
    assert len(resp.choices) == 16
    for choice in resp.choices:
        # Up to 8 parallel calls may not fit in max_tokens; the calls returned are the complete ones.
        assert choice.finish_reason == "tool_calls" or (parallel and choice.finish_reason == "length"), choice
        calls = choice.message.tool_calls
        assert calls and (parallel or len(calls) == 1)
        for call in calls:
            args = json.loads(call.function.arguments)
            assert call.function.name in ("get_balance", "get_rate") and call.id.startswith("call_")
            if call.function.name == "get_balance":
                assert isinstance(args["account"], str) and len(args["account"]) <= 12
                assert set(args) <= {"account", "currency", "days"}
                assert args.get("currency", "EUR") in ("EUR", "USD")
                assert isinstance(args.get("days", 0), int)


def test_hundred_named_calls_parse(client):
    parsed = 0
    for seed in range(100 // 16 + 1):
        resp = client.chat.completions.create(
            model="tiny",
            messages=USER,
            tools=TOOLS,
            max_tokens=300,
            n=16,
            seed=seed,
            tool_choice={"type": "function", "function": {"name": "get_balance"}},
        )
        for choice in resp.choices:
            (call,) = choice.message.tool_calls
            assert call.function.name == "get_balance"
            json.loads(call.function.arguments)
            parsed += 1
    assert parsed >= 100


def test_streaming_tool_call_deltas(client):
    stream = client.chat.completions.create(
        model="tiny",
        messages=USER,
        tools=TOOLS,
        max_tokens=300,
        stream=True,
        seed=3,
        tool_choice={"type": "function", "function": {"name": "get_balance"}},
    )
    args, names, finish = "", [], None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            assert not delta.content or ("<|" not in delta.content and "|>" not in delta.content)
            for t in delta.tool_calls or []:
                assert t.index == 0
                if t.function.name:
                    names.append(t.function.name)
                args += t.function.arguments or ""
            finish = choice.finish_reason or finish
    assert names == ["get_balance"] and finish == "tool_calls"
    assert "account" in json.loads(args)


def test_agent_loop_call_result_answer(client):
    """Tool call (forced) -> tool result -> answer, as an agent framework drives it."""
    messages = list(USER)
    first = client.chat.completions.create(
        model="tiny",
        messages=messages,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=300,
        seed=5,
        parallel_tool_calls=False,
    )
    call = first.choices[0].message.tool_calls[0]
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"balance": 1250.0}'})
    final = client.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0
    )
    assert final.choices[0].message.tool_calls is None
    assert isinstance(final.choices[0].message.content, str)


def test_bad_tool_requests_are_400(client):
    with pytest.raises(openai.BadRequestError, match="no tool named"):
        client.chat.completions.create(
            model="tiny",
            messages=USER,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "x"}},
        )
    with pytest.raises(openai.BadRequestError, match="needs tools"):
        client.chat.completions.create(model="tiny", messages=USER, tool_choice="required")
    bad_args = [
        *USER,
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "get_rate", "arguments": "{oops"}}
            ],
        },
    ]
    with pytest.raises(openai.BadRequestError, match="arguments: not valid JSON"):
        client.chat.completions.create(model="tiny", messages=bad_args, tools=TOOLS)
    # JSON inside the arguments string gets the body's depth limit (Python's parser gave a 500 from ~990)
    for depth in (65, 990, 5000):
        bad_args[-1]["tool_calls"][0]["function"]["arguments"] = "[" * depth + "]" * depth
        with pytest.raises(openai.BadRequestError, match=r"arguments: JSON nested more than 64 levels"):
            client.chat.completions.create(model="tiny", messages=bad_args, tools=TOOLS)
    # a malformed function choice (not an object, a name that is not a string) is a 400 naming tool_choice
    for choice in (
        {"type": "function", "function": "get_rate"},
        {"type": "function", "function": {"name": ["get_rate"]}},
        {"type": "function", "function": {"name": {"a": 1}}},
    ):
        with pytest.raises(openai.BadRequestError, match="tool_choice: must be") as info:
            client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice=choice)
        assert info.value.body["param"] == "tool_choice"


def test_reasoning_effort_turns_thinking_on(server, client):
    plain = client.chat.completions.create(model="tiny", messages=USER, max_tokens=1)
    thinking = client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=1, reasoning_effort="high"
    )
    kwargs = client.chat.completions.create(
        model="tiny",
        messages=USER,
        max_tokens=1,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    think = server.engine.tokenizer.encode("<|think|>\n", add_special_tokens=False)
    assert thinking.usage.prompt_tokens == kwargs.usage.prompt_tokens
    # Thinking on adds a system turn with <|think|>: "<|turn>system\n<|think|>\n<turn|>\n".
    assert thinking.usage.prompt_tokens > plain.usage.prompt_tokens + len(think)


def _forced(schema_json: str) -> bytes:
    """A chat body forcing a call of one tool whose single argument has the schema ``schema_json`` (raw
    JSON text, so it may hold numbers Python's json would not write: 1e400, 10^30)."""
    return (
        '{"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], '
        '"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f", '
        '"parameters": {"type": "object", "properties": {"x": ' + schema_json + "}}}}]}"
    ).encode()


HOSTILE_SCHEMAS = [
    '{"type": "string", "maxLength": 1000000000000000000000000000000}',
    '{"type": "string", "maxLength": -5}',
    '{"type": "array", "maxItems": 1e400}',
    '{"type": "array", "maxItems": "many"}',
    '{"type": "array", "minItems": 1000000000000000000000000000000}',
    '{"type": "array", "items": {"type": "array", "maxItems": 100000000000000000000}}',
]


@pytest.mark.parametrize(
    "schema",
    HOSTILE_SCHEMAS,
    ids=["huge-len", "neg-len", "inf-items", "str-items", "huge-min", "huge-nested"],
)
def test_hostile_forced_tool_schemas_are_400(server, schema):
    """A forced call's argument schema becomes a grammar: bounds that overflow, are negative, infinite or
    not numbers are a 400 naming ``tools``, and the server answers the next request."""
    import httpx

    r = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        content=_forced(schema),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "tools"
    ok = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        content=_forced('{"type": "boolean"}'),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert ok.status_code == 200, ok.text


def test_tool_lists_and_forced_grammars_are_bounded(server):
    """The forced call's grammar is built on the event loop from the request's tools: 20,000 tools (a 1 MB
    body) took 4.0 s there (a lookup per tool over the whole list), and 100,000 properties 0.23 s for a
    grammar then refused as too large, while every stream waited. At most 128 tools (OpenAI's limit) are
    taken, and building stops once the grammar passes the structured-output size limit; each is a 400
    naming ``tools``."""
    import httpx

    def post(tools, choice="required"):
        body = {"model": "tiny", "max_tokens": 4, "messages": USER, "tools": tools, "tool_choice": choice}
        return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)

    many = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]
    for choice in ("required", "auto"):
        r = post(many, choice)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
        assert "at most 128" in r.json()["error"]["message"]
    props = {f"p{i}": {"type": "string", "maxLength": 8} for i in range(20_000)}
    wide = [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": props}}}
    ]
    r = post(wide)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    assert "too large" in r.json()["error"]["message"]
    r = post(many[:128])  # 128 pass the tools' checks; this tiny server's context is what they overflow
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
