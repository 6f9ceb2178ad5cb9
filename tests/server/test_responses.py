"""``/v1/responses`` on the tiny model, driven by the official openai client."""

from __future__ import annotations

import base64
import io
import json
import re
import time

import httpx
import numpy as np
import pytest

from g4serve.server.response_store import ResponseStore
from g4serve.server.serving_responses import _Prompt

openai = pytest.importorskip("openai")
soundfile = pytest.importorskip("soundfile")
Image = pytest.importorskip("PIL.Image")

TOOLS = [
    {
        "type": "function",
        "name": "get_balance",
        "description": "The balance of an account.",
        "parameters": {
            "type": "object",
            "properties": {"account": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
            "required": ["account"],
        },
    },
    {"type": "function", "name": "get_rate", "parameters": {"type": "object", "properties": {}}},
]
QUESTION = "What is the balance of account 4021?"
LONG = "Tell me a long story."  # greedy, the tiny model writes 600+ tokens without an end-of-turn


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def _png_data_url() -> str:
    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _wav_base64() -> str:
    t = np.arange(16000) / 16000
    buf = io.BytesIO()
    soundfile.write(buf, (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), 16000, format="WAV")
    return base64.b64encode(buf.getvalue()).decode()


def _finished(client, response_id: str, timeout_s: float = 30.0):
    """Poll a background response until it has left queued/in_progress."""
    deadline = time.monotonic() + timeout_s
    while True:
        resp = client.responses.retrieve(response_id)
        if resp.status not in ("queued", "in_progress"):
            return resp
        assert time.monotonic() < deadline, f"still {resp.status}"
        time.sleep(0.05)


def test_text_in_text_out(server, client):
    resp = client.responses.create(
        model="tiny", input=QUESTION, instructions="Be brief.", max_output_tokens=6, temperature=0
    )
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.model == "tiny"
    assert resp.status in ("completed", "incomplete")
    assert resp.usage.output_tokens <= 6 and resp.usage.input_tokens > 0
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    messages = [item for item in resp.output if item.type == "message"]
    assert messages and resp.output_text == "".join(c.text for m in messages for c in m.content)
    assert "<|" not in resp.output_text and "|>" not in resp.output_text
    # The same prompt through chat: the same tokens in, the same greedy text out.
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}],
        max_tokens=6,
        temperature=0,
    )
    assert chat.usage.prompt_tokens == resp.usage.input_tokens
    assert client.responses.retrieve(resp.id).output_text == resp.output_text
    server.wait_idle()


def test_streaming_events_in_order(server, client):
    events = list(
        client.responses.create(model="tiny", input=QUESTION, max_output_tokens=8, temperature=0, stream=True)
    )
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert kinds[2] == "response.output_item.added" and kinds[-2] == "response.output_item.done"
    final = events[-1].response
    whole = client.responses.create(model="tiny", input=QUESTION, max_output_tokens=8, temperature=0)
    assert final.output_text == whole.output_text
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = [e.text for e in events if e.type == "response.output_text.done"]
    assert done == [text] == [final.output_text]
    for e in events:
        if e.type == "response.output_text.delta":
            assert e.item_id == final.output[e.output_index].id
    server.wait_idle()


def test_function_tool_forced_then_output_round_trip(server, client):
    first = client.responses.create(
        model="tiny",
        input=QUESTION,
        tools=TOOLS,
        tool_choice={"type": "function", "name": "get_balance"},
        max_output_tokens=200,
    )
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_balance" and call.status == "completed" and call.call_id.startswith("call_")
    args = json.loads(call.arguments)
    assert isinstance(args["account"], str) and len(args["account"]) <= 12
    second = client.responses.create(
        model="tiny",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"balance": 1250.0}'}],
        tools=TOOLS,
        tool_choice="none",
        max_output_tokens=4,
        temperature=0,
    )
    assert second.previous_response_id == first.id
    assert not [item for item in second.output if item.type == "function_call"]
    # The continuation carries the first turn: more input tokens than the first request had.
    assert second.usage.input_tokens > first.usage.input_tokens
    with pytest.raises(openai.BadRequestError, match=r"input\[0\].call_id"):
        client.responses.create(
            model="tiny",
            previous_response_id=first.id,
            input=[{"type": "function_call_output", "call_id": "call_nope", "output": "1"}],
        )
    server.wait_idle()


def test_required_tool_choice_streams_arguments(server, client):
    events = list(
        client.responses.create(
            model="tiny",
            input=QUESTION,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_output_tokens=200,
            stream=True,
        )
    )
    final = events[-1].response
    calls = [item for item in final.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name in ("get_balance", "get_rate")
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == done.arguments == calls[0].arguments
    json.loads(deltas)
    server.wait_idle()


def test_reasoning_effort_adds_thinking_and_reasoning_items(server, client):
    plain = client.responses.create(model="tiny", input=QUESTION, max_output_tokens=1)
    thinking = client.responses.create(
        model="tiny", input=QUESTION, max_output_tokens=1, reasoning={"effort": "high"}
    )
    assert thinking.usage.input_tokens > plain.usage.input_tokens  # the <|think|> system turn
    assert thinking.reasoning.effort == "high"
    # The random model rarely opens the thought channel: the items and events of a parsed one.
    from g4serve.server.gemma4_output import Gemma4OutputParser, ParsedDelta
    from g4serve.server.serving_responses import _Run

    run = _Run({"output": []}, Gemma4OutputParser(), 0, None, raise_errors=True)
    events = run._feed(ParsedDelta(reasoning="think")) + run._feed(ParsedDelta(content="\n"))
    events += run._feed(ParsedDelta(content="answer")) + run._finish()
    kinds = [e["type"] for e in events]
    assert kinds.index("response.reasoning_text.delta") < kinds.index("response.output_text.delta")
    assert [i["type"] for i in run.items] == ["reasoning", "message"]
    assert run.items[0]["content"] == [{"type": "reasoning_text", "text": "think"}]
    assert run.items[1]["content"][0]["text"] == "\nanswer"  # the text kept whole
    alone = _Run({"output": []}, Gemma4OutputParser(), 0, None, raise_errors=True)
    alone._feed(ParsedDelta(reasoning="think"))
    alone._feed(ParsedDelta(content="\n"))
    alone._finish()
    assert [i["type"] for i in alone.items] == ["reasoning"]  # whitespace alone opens no message
    server.wait_idle()


def test_json_schema_output(server, client):
    schema = {
        "type": "object",
        "properties": {"amount": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["amount", "ok"],
        "additionalProperties": False,
    }
    resp = client.responses.create(
        model="tiny",
        input="Give me JSON.",
        text={"format": {"type": "json_schema", "name": "pay", "schema": schema, "strict": True}},
        max_output_tokens=60,
    )
    value = json.loads(resp.output_text)
    assert set(value) == {"amount", "ok"} and isinstance(value["amount"], int)
    # With reasoning on, the grammar waits for the thought channel (as chat does; vllm#54881): the answer is
    # still exactly one JSON value under the schema, and no marker leaks into it.
    for seed_effort in ("low", "high"):
        resp = client.responses.create(
            model="tiny",
            input="Give me JSON.",
            reasoning={"effort": seed_effort},
            text={"format": {"type": "json_schema", "name": "pay", "schema": schema, "strict": True}},
            max_output_tokens=200,
        )
        assert resp.status == "completed", resp
        value = json.loads(resp.output_text)
        assert set(value) == {"amount", "ok"} and "<|channel>" not in resp.output_text
    server.wait_idle()


def test_image_and_audio_input(server, client):
    resp = client.responses.create(
        model="tiny",
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Describe both."},
                    {"type": "input_image", "image_url": _png_data_url()},
                    {"type": "input_audio", "input_audio": {"data": _wav_base64(), "format": "wav"}},
                ],
            }
        ],
        max_output_tokens=2,
        temperature=0,
    )
    text_only = client.responses.create(model="tiny", input="Describe both.", max_output_tokens=2)
    # The image and audio soft tokens are in the prompt.
    assert resp.usage.input_tokens > text_only.usage.input_tokens + 50
    with pytest.raises(openai.BadRequestError, match=r"input\[0\].content\[1\]"):
        client.responses.create(
            model="tiny",
            input=[
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "x"},
                        {"type": "input_image", "image_url": "data:image/png;base64,@@@"},
                    ],
                }
            ],
        )
    server.wait_idle()


def test_store_bounds_and_eviction():
    store = ResponseStore(max_entries=2, max_bytes=2000)
    for i in range(3):
        assert store.put("a", {"id": f"resp_{i}"}, [{"role": "user", "content": "x"}])
    assert len(store) == 2 and store.get("a", "resp_0") is None  # least recently used out
    assert store.get("a", "resp_1") is not None  # now the most recent
    store.put("a", {"id": "resp_3"}, [])
    assert store.get("a", "resp_2") is None and store.get("a", "resp_1") is not None
    assert store.get("b", "resp_1") is None  # another key's client cannot read it
    assert not store.put("a", {"id": "big"}, [{"content": "x" * 3000}])  # alone over the byte bound
    store.put("a", {"id": "mid"}, [{"content": "x" * 1950}])  # the byte bound evicts the rest
    assert len(store) == 1 and store.num_bytes <= 2000
    assert store.delete("a", "mid") and store.num_bytes == 0


def test_store_false_unknown_ids_and_delete(server, client):
    kept = client.responses.create(model="tiny", input="hi", max_output_tokens=1)
    unkept = client.responses.create(model="tiny", input="hi", max_output_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    with pytest.raises(openai.NotFoundError, match="previous_response_id"):
        client.responses.create(model="tiny", input="hi", previous_response_id="resp_nope")
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)


def test_api_keys_own_their_responses(tiny_model_dir, server_factory):
    running = server_factory(tiny_model_dir, "--served-model-name", "tiny", "--api-key", "k1")
    own = openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="k1", max_retries=0)
    resp = own.responses.create(model="tiny", input="hi", max_output_tokens=1)
    assert own.responses.retrieve(resp.id).id == resp.id
    store = running.app.state.serving_responses.store
    assert store.get(ResponseStore.owner("Bearer k1"), resp.id) is not None
    assert store.get(ResponseStore.owner("Bearer k2"), resp.id) is None


def test_bad_input_is_400_naming_the_field(server, client):
    cases = [
        ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": []}, "input"),
        ({"input": [{"type": "computer_call"}]}, r"input\[0\].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, r"input\[0\].content\[0\]"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, r"tools\[0\].type"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
        ({"input": "x", "reasoning": {"effort": "max"}}, "reasoning.effort"),
        ({"input": "x", "reasoning": {"summary": "auto"}}, "reasoning.summary"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format"),
        ({"input": "x", "temperature": "hot"}, "temperature"),
        ({"input": "x", "model": "other"}, "model"),
    ]
    for body, field in cases:
        r = httpx.post(f"{server.base_url}/v1/responses", json={"model": "tiny", **body})
        assert r.status_code in (400, 404), (body, r.text)
        assert re.search(field, r.json()["error"]["message"]), (body, r.text)
    server.wait_idle()
    assert client.responses.create(model="tiny", input="still up", max_output_tokens=1).status


# ---- truncation ----------------------------------------------------------------------------------------
def _long_conversation() -> list[dict]:
    """A developer message, six long turns and a short last one: about 3,000 tokens, past max_model_len."""
    items = [{"role": "developer", "content": "Rules: be brief."}]
    for i in range(6):
        items.append({"role": "user", "content": f"turn {i} " + "word " * 150})
        items.append({"role": "assistant", "content": "noted " * 10})
    items.append({"role": "user", "content": "And now?"})
    return items


def test_truncation_auto_keeps_the_newest_turns_that_fit(server, client):
    items = _long_conversation()
    for truncation in ({}, {"truncation": "disabled"}):
        with pytest.raises(openai.BadRequestError, match=r"input: the conversation \(\d+ tokens\)") as info:
            client.responses.create(model="tiny", input=items, max_output_tokens=4, **truncation)
        assert info.value.param == "input"
    resp = client.responses.create(
        model="tiny", input=items, max_output_tokens=4, truncation="auto", temperature=0
    )
    assert resp.truncation == "auto" and resp.status in ("completed", "incomplete")
    # The prompt is the developer message and the longest tail of whole turns that leaves 4 output tokens.
    tok = server.app.state.engine.tokenizer

    def length(messages: list[dict]) -> int:
        messages = [{**m, "role": "system" if m["role"] == "developer" else m["role"]} for m in messages]
        text = tok.apply_chat_template(messages, add_generation_prompt=True)
        return len(tok.encode(text, add_special_tokens=False))

    starts = [k for k in range(1, len(items), 2) if length(items[:1] + items[k:]) + 4 <= 1024]
    assert starts[0] > 1  # some turns went
    assert resp.usage.input_tokens == length(items[:1] + items[starts[0] :])
    # The stored conversation is the whole one: a later turn can truncate differently.
    assert len(list(client.responses.input_items.list(resp.id))) == len(items)
    server.wait_idle()


def test_truncation_auto_refuses_what_cannot_fit(server, client):
    items = [
        {"role": "user", "content": "short"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "word " * 1100},
    ]
    with pytest.raises(openai.BadRequestError, match="even the last turn alone") as info:
        client.responses.create(model="tiny", input=items, max_output_tokens=4, truncation="auto")
    assert info.value.param == "input"
    with pytest.raises(openai.BadRequestError, match="even the last turn alone"):  # one turn, nothing to drop
        client.responses.create(model="tiny", input="word " * 1100, truncation="auto")
    with pytest.raises(openai.BadRequestError, match="max_output_tokens"):
        client.responses.create(model="tiny", input="hi", max_output_tokens=1024, truncation="auto")
    with pytest.raises(openai.BadRequestError, match="truncation"):
        client.responses.create(model="tiny", input="hi", truncation="sometimes")
    assert client.responses.create(model="tiny", input="still up", max_output_tokens=1).status


def test_truncation_cuts_only_between_whole_turns():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    conversation = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "user", "content": "meanwhile"},  # no cut: the call's output comes after it
        {"role": "tool", "tool_call_id": "c1", "name": "f", "content": "1"},
        {"role": "assistant", "content": "done"},
        {"role": "user", "content": "b"},
        {"role": "system", "content": "a late rule"},  # kept wherever the cut falls
        {"role": "user", "content": "c"},
    ]
    prompt = _Prompt([], conversation[:2], conversation[2:], None, None, False)
    assert prompt.turn_starts() == [5, 7]


# ---- background ----------------------------------------------------------------------------------------
def test_background_runs_to_the_end(server, client):
    fg = client.responses.create(model="tiny", input=QUESTION, max_output_tokens=8, temperature=0)
    bg = client.responses.create(
        model="tiny", input=QUESTION, max_output_tokens=8, temperature=0, background=True
    )
    assert bg.background and bg.status == "queued" and bg.id.startswith("resp_")
    done = _finished(client, bg.id)
    assert done.status == fg.status and done.background
    assert done.output_text == fg.output_text and done.usage.output_tokens == fg.usage.output_tokens
    assert done.usage.input_tokens == fg.usage.input_tokens
    with pytest.raises(openai.BadRequestError, match="has finished"):
        client.responses.cancel(bg.id)
    with pytest.raises(openai.BadRequestError, match="background=true") as info:
        client.responses.cancel(fg.id)
    assert info.value.param == "response_id"
    after = client.responses.create(
        model="tiny", previous_response_id=bg.id, input="More?", max_output_tokens=2
    )
    assert after.usage.input_tokens > done.usage.input_tokens
    with pytest.raises(openai.BadRequestError, match="background") as info:
        client.responses.create(model="tiny", input="x", background=True, store=False)
    assert info.value.param == "background"
    server.wait_idle()


def test_background_cancel_aborts_and_frees_every_kv_block(server, client):
    bg = client.responses.create(
        model="tiny", input=LONG, max_output_tokens=900, temperature=0, background=True
    )
    # Another key's client sees nothing of it: not to read, list, cancel or delete.
    other = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="someone-else", max_retries=0)
    for call in (other.responses.retrieve, other.responses.cancel, other.responses.delete):
        with pytest.raises(openai.NotFoundError):
            call(bg.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.input_items.list(bg.id)
    cancelled = client.responses.cancel(bg.id)
    assert cancelled.status == "cancelled" and cancelled.usage.output_tokens < 900
    server.wait_idle()  # the engine request aborted: no request left, every KV block free
    assert not server.app.state.serving_responses.background
    assert client.responses.retrieve(bg.id).status == "cancelled"
    assert client.responses.cancel(bg.id).status == "cancelled"  # again: the same answer
    assert [i.type for i in client.responses.input_items.list(bg.id)] == ["message"]
    # A running one cannot be continued yet; DELETE cancels it first.
    running = client.responses.create(
        model="tiny", input=LONG, max_output_tokens=900, temperature=0, background=True
    )
    with pytest.raises(openai.BadRequestError, match="still running") as info:
        client.responses.create(model="tiny", previous_response_id=running.id, input="and?")
    assert info.value.param == "previous_response_id"
    client.responses.delete(running.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(running.id)
    server.wait_idle()


def test_background_limit_is_a_429(server, client):
    serving = server.app.state.serving_responses
    limit, serving.max_background = serving.max_background, 0
    try:
        with pytest.raises(openai.RateLimitError, match="background"):
            client.responses.create(model="tiny", input="x", max_output_tokens=1, background=True)
    finally:
        serving.max_background = limit
    server.wait_idle()


def test_background_stream_resumes_after_a_dropped_connection(server, client):
    stream = client.responses.create(
        model="tiny", input=QUESTION, max_output_tokens=12, temperature=0, background=True, stream=True
    )
    first = []
    for event in stream:
        first.append(event)
        if len(first) == 5:
            break
    stream.close()  # the connection goes; the response runs on
    assert [e.type for e in first[:3]] == ["response.created", "response.queued", "response.in_progress"]
    assert first[0].response.status == "queued" and first[0].response.background
    response_id = first[0].response.id
    rest = list(client.responses.retrieve(response_id, stream=True, starting_after=first[-1].sequence_number))
    assert [e.sequence_number for e in rest] == list(range(5, 5 + len(rest)))
    final = rest[-1].response
    assert rest[-1].type in ("response.completed", "response.incomplete")
    replay = list(client.responses.retrieve(response_id, stream=True))  # finished: all of it again
    assert [e.type for e in replay] == [e.type for e in first + rest]
    text = "".join(e.delta for e in replay if e.type == "response.output_text.delta")
    whole = client.responses.create(model="tiny", input=QUESTION, max_output_tokens=12, temperature=0)
    assert text == final.output_text == whole.output_text
    with pytest.raises(openai.BadRequestError, match="stream"):  # created without background and stream
        client.responses.retrieve(whole.id, stream=True)
    server.wait_idle()


def test_shutdown_cancels_background_responses(tiny_model_dir, server_factory):
    running = server_factory(tiny_model_dir, "--served-model-name", "tiny", "--drain-timeout", "0")
    client = openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="k", max_retries=0)
    bg = client.responses.create(
        model="tiny", input=LONG, max_output_tokens=900, temperature=0, background=True
    )
    _ = client.responses.retrieve(bg.id)
    serving = running.app.state.serving_responses
    running.server.should_exit = True
    deadline = time.monotonic() + 20
    while serving.background and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not serving.background
    assert serving.store.get(ResponseStore.owner("Bearer k"), bg.id).response["status"] == "cancelled"
    engine = running.engine
    assert not engine.requests and all(p.num_free == p.num_blocks for p in engine.kv.pools.values())


# ---- include -------------------------------------------------------------------------------------------
def test_include_output_text_logprobs(server, client):
    fields = dict(model="tiny", input="hi", max_output_tokens=5, temperature=0)
    plain = client.responses.create(**fields)
    assert all(
        part.logprobs == [] for item in plain.output if item.type == "message" for part in item.content
    )
    resp = client.responses.create(**fields, include=["message.output_text.logprobs"], top_logprobs=2)
    assert resp.top_logprobs == 2 and resp.output_text == plain.output_text
    (message,) = [item for item in resp.output if item.type == "message"]
    part = message.content[0]
    assert part.logprobs and all(len(lp.top_logprobs) == 2 for lp in part.logprobs)
    assert "".join(lp.token for lp in part.logprobs) == part.text  # special tokens have none
    # The same numbers as chat's for those tokens (chat lists every token, special ones too).
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    chat_entries = iter((c.token, c.logprob) for c in chat.choices[0].logprobs.content)
    for lp in part.logprobs:  # a subsequence of chat's, in order
        assert any(
            token == lp.token and logprob == pytest.approx(lp.logprob) for token, logprob in chat_entries
        )
    events = list(
        client.responses.create(
            **fields, include=["message.output_text.logprobs"], top_logprobs=2, stream=True
        )
    )
    streamed = [lp.token for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert streamed == [lp.token for lp in part.logprobs]
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert [lp.token for lp in done.logprobs] == streamed
    # Accepted and nothing to do: input items always carry their image URLs.
    assert client.responses.create(**fields, include=["message.input_image.image_url"]).status
    server.wait_idle()


def test_include_refuses_what_it_cannot_give(server, client):
    cases = [
        ("reasoning.encrypted_content", "does not encrypt reasoning"),
        ("file_search_call.results", "built-in tools"),
        ("message.output_text.everything", "unknown value"),
    ]
    for value, message in cases:
        with pytest.raises(openai.BadRequestError, match=message) as info:
            client.responses.create(model="tiny", input="x", include=[value])
        assert info.value.param == "include"
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.responses.create(model="tiny", input="x", top_logprobs=21)


# ---- input items ---------------------------------------------------------------------------------------
def test_input_items_list_and_pages(server, client):
    first = client.responses.create(
        model="tiny",
        input=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        ],
        max_output_tokens=2,
        temperature=0,
    )
    second = client.responses.create(
        model="tiny", previous_response_id=first.id, input="again", max_output_tokens=2
    )
    items = list(client.responses.input_items.list(second.id, order="asc"))
    assert [(i.type, getattr(i, "role", None)) for i in items] == [
        ("message", "developer"),
        ("message", "user"),
        *[(o.type, getattr(o, "role", None)) for o in first.output],
        ("message", "user"),
    ]
    assert items[0].content[0].type == "input_text" and items[-1].content[0].text == "again"
    assert [i.id for i in items[2:-1]] == [o.id for o in first.output]  # the first turn's own output items
    assert len({i.id for i in items}) == len(items)
    page = client.responses.input_items.list(second.id, limit=2)  # newest first by default
    assert [i.id for i in page.data] == [items[-1].id, items[-2].id]
    assert page.first_id == items[-1].id and page.last_id == items[-2].id and page.has_more
    # The client pages with after=<last id> until has_more is false.
    assert [i.id for i in client.responses.input_items.list(second.id, limit=1)] == [
        i.id for i in items[::-1]
    ]
    url = f"{server.base_url}/v1/responses/{second.id}/input_items"
    for params, field in (
        ({"limit": 0}, "limit"),
        ({"limit": "x"}, "limit"),
        ({"order": "up"}, "order"),
        ({"after": "msg_nope"}, "after"),
    ):
        r = httpx.get(url, params=params, headers={"Authorization": "Bearer unused"})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_nope")
    # An item id the conversation has already (earlier output sent back, say) is replaced: ids never repeat.
    again = [{"type": "message", "role": "user", "content": "x", "id": items[0].id}]
    third = client.responses.create(
        model="tiny", previous_response_id=second.id, input=again, max_output_tokens=1
    )
    ids = [i.id for i in client.responses.input_items.list(third.id, limit=100)]
    assert len(ids) == len(set(ids)) == len(items) + len(second.output) + 1
    server.wait_idle()


def test_past_the_message_cap_truncation_drops_the_oldest_turns(server, client):
    """More input items than one prompt takes (``serving_chat.MAX_MESSAGES``) are a conversation that does
    not fit: refused naming ``input`` without truncation, and with truncation 'auto' its oldest turns go."""
    from g4serve.server.serving_chat import MAX_MESSAGES

    items = []
    for i in range(MAX_MESSAGES // 2 + 8):
        items += [{"role": "user", "content": f"n{i}"}, {"role": "assistant", "content": "ok"}]
    items.append({"role": "user", "content": "last"})
    with pytest.raises(openai.BadRequestError, match=r"input: the conversation \(\d+ messages") as info:
        client.responses.create(model="tiny", input=items, max_output_tokens=2)
    assert info.value.param == "input"
    resp = client.responses.create(model="tiny", input=items, max_output_tokens=2, truncation="auto")
    assert resp.status in ("completed", "incomplete") and resp.usage.input_tokens < 1024
    server.wait_idle()
