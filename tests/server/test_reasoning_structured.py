"""Structured output with thinking on, and max_reasoning_tokens, on /v1/chat/completions (tiny model, the
openai client). The random weights seldom open the thought channel: a logit bias on its marker does."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

openai = pytest.importorskip("openai")

SCHEMA = {
    "type": "object",
    "properties": {"account": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}},
    "required": ["account", "ok"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "balance", "schema": SCHEMA, "strict": True}}
USER = [{"role": "user", "content": "Balance of 4021 as JSON?"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def open_bias(server) -> dict[str, int]:
    return {str(server.engine.thought_markers.open_id): 100}


def _thinking_json(client, open_bias, seed: int, **kw):
    return client.chat.completions.create(
        model="tiny",
        messages=USER,
        reasoning_effort="high",
        response_format=FORMAT,
        logit_bias=open_bias,
        seed=seed,
        max_tokens=120,
        extra_body={"max_reasoning_tokens": 6},
        **kw,
    )


def test_json_schema_with_thinking_reasons_then_answers_once(server, client, open_bias):
    """vllm#54881 / #50938: with thinking on, a json_schema request skipped the reasoning and repeated the
    JSON. Here the thought comes back as reasoning_content and content is one JSON value under the schema."""
    for seed in range(4):
        resp = _thinking_json(client, open_bias, seed)
        message = resp.choices[0].message
        reasoning = message.model_extra["reasoning_content"]
        assert resp.choices[0].finish_reason == "stop" and reasoning
        jsonschema.validate(json.loads(message.content), SCHEMA)  # json.loads refuses a repeated value
        assert reasoning not in message.content and "<|" not in message.content + reasoning
        # The thought: its two markers and the 6 tokens the budget allows ("thought\n" label included).
        assert resp.usage.completion_tokens_details.reasoning_tokens == 8
    server.wait_idle()


def test_streamed_reasoning_then_content_equal_the_whole_answer(server, client, open_bias):
    whole = _thinking_json(client, open_bias, seed=7)
    stream = _thinking_json(client, open_bias, seed=7, stream=True, stream_options={"include_usage": True})
    reasoning, content, order, usage = "", "", [], None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            delta = choice.delta
            if delta.model_extra.get("reasoning_content"):
                reasoning += delta.model_extra["reasoning_content"]
                order.append("r")
            if delta.content:
                content += delta.content
                order.append("c")
    assert order == sorted(order, reverse=True) and "r" in order and "c" in order  # reasoning first
    assert reasoning == whole.choices[0].message.model_extra["reasoning_content"]
    assert content == whole.choices[0].message.content
    jsonschema.validate(json.loads(content), SCHEMA)
    assert usage.completion_tokens_details.reasoning_tokens == 8
    server.wait_idle()


def test_budget_closes_the_channel_then_content_follows(server, client, open_bias):
    resp = client.chat.completions.create(
        model="tiny",
        messages=USER,
        reasoning_effort="high",
        logit_bias=open_bias,
        seed=1,
        max_tokens=16,
        extra_body={"thinking_token_budget": 3, "ignore_eos": True},  # vLLM's name for it
    )
    message = resp.choices[0].message
    assert message.model_extra["reasoning_content"] is not None
    assert resp.usage.completion_tokens == 16 and resp.usage.completion_tokens_details.reasoning_tokens == 5
    ids = server.engine.tokenizer.encode(message.content or "", add_special_tokens=False)
    assert server.engine.thought_markers.open_id not in ids  # the bias cannot open a second thought


def test_thinking_off_reports_no_reasoning_tokens(client):
    resp = client.chat.completions.create(model="tiny", messages=USER, max_tokens=2)
    assert resp.usage.completion_tokens_details is None


def test_aborted_thinking_stream_frees_every_block(server, open_bias):
    body = {
        "model": "tiny",
        "messages": USER,
        "reasoning_effort": "high",
        "response_format": FORMAT,
        "logit_bias": open_bias,
        "max_tokens": 500,
        "max_reasoning_tokens": 400,
        "stream": True,
    }
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=30) as resp:
        lines = resp.iter_lines()
        seen = [next(lines) for _ in range(6)]
    assert any("reasoning_content" in line for line in seen)
    server.wait_idle()


@pytest.mark.parametrize(
    "extra",
    [
        {"max_reasoning_tokens": -1},
        {"max_reasoning_tokens": 2**31},
        {"max_reasoning_tokens": "8"},
        {"max_reasoning_tokens": 1.5},
        {"max_reasoning_tokens": 4, "thinking_token_budget": 5},
    ],
)
def test_bad_budgets_are_400(client, extra):
    with pytest.raises(openai.BadRequestError, match="max_reasoning_tokens"):
        client.chat.completions.create(
            model="tiny", messages=USER, max_tokens=2, reasoning_effort="high", extra_body=extra
        )
