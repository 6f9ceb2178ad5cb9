"""A tool call's arguments in the history are JSON text the server parses (OpenAI sends them as a string,
Gemma 4's template renders a dict): off the event loop. The body's value count leaves numbers out, so 8 MB of
``1,`` in one call's arguments held the loop 0.69 s (a 64 MiB body would hold it ~5 s) before the template's
own value budget refused it."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from g4serve.server import serving_chat, serving_responses

CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": [1, 2, 3]}'}}
HISTORY = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": "done"},
]


@pytest.fixture
def loops_seen(monkeypatch):
    seen = []
    parse = serving_chat.template_messages

    def recording(messages):
        try:
            asyncio.get_running_loop()
            seen.append("event loop")
        except RuntimeError:
            seen.append("off the loop")
        return parse(messages)

    monkeypatch.setattr(serving_chat, "template_messages", recording)
    monkeypatch.setattr(serving_responses, "template_messages", recording)
    return seen


def test_chat_parses_call_arguments_off_the_event_loop(server, loops_seen):
    body = {"model": "tiny", "max_tokens": 1, "messages": HISTORY}
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert loops_seen == ["off the loop"]


def test_responses_parse_call_arguments_off_the_event_loop(server, loops_seen):
    items = [
        {"role": "user", "content": "hi"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "done"},
    ]
    body = {"model": "tiny", "max_output_tokens": 1, "input": items, "store": False}
    r = httpx.post(f"{server.base_url}/v1/responses", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert loops_seen and set(loops_seen) == {"off the loop"}


def test_bad_arguments_are_still_a_400_naming_the_message(server, loops_seen):
    bad = {**CALL, "function": {"name": "f", "arguments": "{not json"}}
    messages = [HISTORY[0], {"role": "assistant", "tool_calls": [bad]}, HISTORY[2]]
    body = {"model": "tiny", "max_tokens": 1, "messages": messages}
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and "messages[1].tool_calls[0].function.arguments" in r.text, r.text
