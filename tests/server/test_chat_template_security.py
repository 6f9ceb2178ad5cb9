"""Request-supplied chat templates and ``chat_template_kwargs``: refused unless the server trusts them
(--trust-request-chat-template); then rendered in the sandboxed worker process, so a hostile template costs
its sender a 400 within the time limit while /health and other chats keep being answered."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from g4serve.processing.chat_template import ChatTemplateLimits

USER = [{"role": "user", "content": "What is my checking account balance?"}]
PLAIN = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
HOSTILE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
LIMIT_S = ChatTemplateLimits().timeout_s


def _chat(**fields):
    return {"model": "tiny", "messages": USER, "max_tokens": 4, "temperature": 0, **fields}


def _post(server, body, timeout=60) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=timeout)


def _assert_400(r: httpx.Response, param: str, text: str = "") -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: "), error
    assert text in error["message"], error


@pytest.fixture(scope="module")
def default_server(tiny_model_dir, server_factory):
    return server_factory(tiny_model_dir, "--served-model-name", "tiny", "--max-model-len", "512")


@pytest.fixture(scope="module")
def trusting_server(tiny_model_dir, server_factory):
    return server_factory(
        tiny_model_dir,
        "--served-model-name",
        "tiny",
        "--max-model-len",
        "512",
        "--trust-request-chat-template",
    )


def test_request_template_refused_by_default(default_server):
    r = _post(default_server, _chat(chat_template_kwargs={"chat_template": PLAIN}))
    _assert_400(r, "chat_template_kwargs.chat_template", "--trust-request-chat-template")
    # The model's own template with an ordinary keyword still works.
    r = _post(default_server, _chat(chat_template_kwargs={"enable_thinking": True}))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "key,value",
    [
        ("tools", [{"type": "function", "function": {"name": "transfer"}}]),
        ("messages", []),
        ("add_generation_prompt", False),
        ("bos_token", ""),
        ("documents", [{"title": "t", "text": "x"}]),
        ("_secret", 1),
    ],
)
def test_reserved_kwargs_refused(default_server, key, value):
    r = _post(default_server, _chat(chat_template_kwargs={key: value}))
    _assert_400(r, f"chat_template_kwargs.{key}", "set by the server")


def test_oversized_kwargs_refused(default_server):
    r = _post(default_server, _chat(chat_template_kwargs={"notes": ["x"] * 5000}))
    _assert_400(r, "chat_template_kwargs.notes", "values")


def test_trusted_request_template_is_used(trusting_server):
    r = _post(trusting_server, _chat(chat_template_kwargs={"chat_template": PLAIN}))
    assert r.status_code == 200, r.text
    tokenizer = trusting_server.engine.tokenizer
    expected = tokenizer.encode(f"user: {USER[0]['content']}\n", add_special_tokens=False)
    assert r.json()["usage"]["prompt_tokens"] == len(expected)
    # Reserved names stay reserved, the template's own errors are the caller's 400.
    r = _post(trusting_server, _chat(chat_template_kwargs={"chat_template": PLAIN, "tools": []}))
    _assert_400(r, "chat_template_kwargs.tools")
    r = _post(trusting_server, _chat(chat_template_kwargs={"chat_template": "{{ raise_exception('no') }}"}))
    _assert_400(r, "chat_template_kwargs.chat_template", "no")
    r = _post(trusting_server, _chat(chat_template_kwargs={"chat_template": "{{ ''.__class__.__mro__ }}"}))
    _assert_400(r, "chat_template_kwargs.chat_template", "unsafe")
    r = _post(trusting_server, _chat(chat_template_kwargs={"chat_template": "{{ 'x' * 10**10 }}"}))
    _assert_400(r, "chat_template_kwargs.chat_template", "would build")


def test_hostile_template_does_not_block_the_server(trusting_server):
    """A template that loops forever without output is answered with a 400 within the time limit, while a
    concurrent /health and a concurrent ordinary chat are answered at once."""
    base = trusting_server.base_url

    async def timed(coro):
        began = time.monotonic()
        r = await coro
        return r, time.monotonic() - began

    async def main():
        async with httpx.AsyncClient(base_url=base, timeout=60) as c:
            hostile = asyncio.create_task(
                timed(
                    c.post(
                        "/v1/chat/completions", json=_chat(chat_template_kwargs={"chat_template": HOSTILE})
                    )
                )
            )
            await asyncio.sleep(0.3)  # the worker is inside the loop now
            health = await timed(c.get("/health"))
            chat = await timed(c.post("/v1/chat/completions", json=_chat()))
            return await hostile, health, chat

    (r, hostile_s), (health, health_s), (chat, chat_s) = asyncio.run(main())
    _assert_400(r, "chat_template_kwargs.chat_template", "longer than the limit")
    assert hostile_s < LIMIT_S + 2.5, hostile_s
    assert health.status_code == 200 and health_s < 0.5, health_s
    assert chat.status_code == 200 and chat_s < LIMIT_S, (chat.text, chat_s)
    # The server (and its template worker) keep serving afterwards.
    assert _post(trusting_server, _chat(chat_template_kwargs={"chat_template": PLAIN})).status_code == 200
    trusting_server.wait_idle()


def test_output_limit(trusting_server):
    source = "{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}"
    began = time.monotonic()
    r = _post(trusting_server, _chat(chat_template_kwargs={"chat_template": source}))
    _assert_400(r, "chat_template_kwargs.chat_template", "exceeds the limit of 4194304 bytes")
    assert time.monotonic() - began < LIMIT_S + 1
