"""Hostile chat templates: request-supplied templates render in a sandboxed worker process that stops
runaway loops, huge values, deep recursion and large outputs within its limits; the model's own template
still renders exactly as transformers renders it."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from g4serve.processing.chat_template import (
    MAX_KWARGS_DEPTH,
    ChatTemplateError,
    ChatTemplateLimitError,
    ChatTemplateLimits,
    RequestTemplateRenderer,
    cached_chat_template,
    check_chat_template_kwargs,
    linear_lookback,
    template_cache,
)
from g4serve.processing.tiny_tokenizer import gemma4_chat_template, write_tiny_tokenizer
from g4serve.processing.tokenizer import Tokenizer

TIMEOUT_S = 1.0
# A limit error must come back within the time limit plus the kill grace (1 s) plus a worker restart.
PROMPT_S = TIMEOUT_S + 2.0
VARS = {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True}
CONVERSATION = [
    {"role": "system", "content": "You are a bank assistant."},
    {"role": "user", "content": "What is my balance?"},
    {"role": "assistant", "content": "1,250.00 EUR."},
    {"role": "user", "content": "Thanks!"},
]


@pytest.fixture(scope="module")
def renderer() -> Iterator[RequestTemplateRenderer]:
    r = RequestTemplateRenderer(ChatTemplateLimits(timeout_s=TIMEOUT_S))
    yield r
    r.close()


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_pretrained(write_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


def _refused(renderer: RequestTemplateRenderer, source: str, match: str, within_s: float = PROMPT_S) -> float:
    began = time.monotonic()
    with pytest.raises(ChatTemplateLimitError, match=match):
        renderer.render(source, VARS)
    elapsed = time.monotonic() - began
    assert elapsed < within_s, f"took {elapsed:.2f} s"
    return elapsed


# ---- the model's own template ----
def test_model_template_matches_transformers(tok: Tokenizer, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(tok.name_or_path)
    for kwargs in ({}, {"enable_thinking": True}):
        ours = tok.apply_chat_template(CONVERSATION, add_generation_prompt=True, **kwargs)
        theirs = hf.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True, **kwargs)
        assert ours == theirs


def _call(name: str, args: dict) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": args}}


# Orders the previous-role search decides on: tool results between turns, an assistant after tool results
# (same model turn), consecutive assistants, a user after a tool result, a leading system message, thoughts.
LOOKBACK_CONVERSATIONS = [
    [
        {"role": "system", "content": "Bank assistant."},
        {"role": "user", "content": "Balance of 4021 and 7730?"},
        {"role": "assistant", "content": "", "tool_calls": [_call("get_balance", {"account": "4021"})]},
        {"role": "tool", "content": '{"balance": 1250.0}'},
        {"role": "tool", "content": '{"balance": 3310.5}'},
        {"role": "assistant", "content": "1,250.00 and 3,310.50.", "reasoning_content": "Add them up."},
        {"role": "assistant", "content": "Anything else?"},
        {"role": "user", "content": "No."},
    ],
    [
        {"role": "user", "content": "Rate?"},
        {"role": "assistant", "tool_calls": [_call("get_rate", {})], "reasoning_content": "Look it up."},
        {"role": "tool", "content": "3.1%"},
        {"role": "user", "content": "And yesterday?"},
        {"role": "assistant", "tool_calls": [_call("get_rate", {"day": -1})]},
        {"role": "tool", "content": "3.0%"},
    ],
]


def test_the_linear_lookback_renders_as_transformers(tok: Tokenizer) -> None:
    """Gemma 4's template, whose quadratic previous-role search ``compile_chat_template`` replaces by its
    linear equivalent (10,000 messages took 177 s to render), renders conversations that turn on that search
    exactly as transformers renders the template as written."""
    transformers = pytest.importorskip("transformers")
    assert linear_lookback(gemma4_chat_template()) != gemma4_chat_template()  # the block is found
    assert linear_lookback("{{ messages }}") == "{{ messages }}"
    hf = transformers.AutoTokenizer.from_pretrained(tok.name_or_path)
    for messages in LOOKBACK_CONVERSATIONS:
        for kwargs in ({}, {"enable_thinking": True}):
            for generation in (True, False):
                ours = tok.apply_chat_template(messages, add_generation_prompt=generation, **kwargs)
                theirs = hf.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=generation, **kwargs
                )
                assert ours == theirs


def test_request_template_renders_like_the_model_template(tok: Tokenizer, renderer) -> None:
    """The limited sandbox changes nothing for a well-behaved template: the model's own template, sent as
    a request template, gives the same prompt."""
    for kwargs in ({}, {"enable_thinking": True}):
        trusted = tok.apply_chat_template(CONVERSATION, add_generation_prompt=True, **kwargs)
        untrusted = tok.apply_request_chat_template(
            CONVERSATION, gemma4_chat_template(), renderer, add_generation_prompt=True, **kwargs
        )
        assert untrusted == trusted


def test_model_templates_cache_is_bounded() -> None:
    assert cached_chat_template.cache_info().maxsize == 32


# ---- time ----
def test_nested_loops_without_output_are_stopped(renderer) -> None:
    source = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    elapsed = _refused(renderer, source, "longer than the limit of 1 s")
    assert elapsed >= TIMEOUT_S * 0.9


def test_loop_with_output_under_the_limit_is_stopped_by_time(renderer) -> None:
    source = "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}"
    _refused(renderer, source, "longer than the limit")


def test_a_stuck_worker_is_killed(renderer) -> None:
    """A worker that does not answer at all (here: stopped) is killed after the limit plus its grace, and
    the next render gets a fresh one."""
    assert renderer.render("{{ messages[0].content }}", VARS) == "hi"
    pid = renderer.worker_pid
    os.kill(pid, signal.SIGSTOP)
    _refused(renderer, "{{ messages[0].content }}", "longer than the limit")
    assert renderer.render("{{ messages[0].content }}", VARS) == "hi"
    assert renderer.worker_pid not in (None, pid)


# ---- size ----
@pytest.mark.parametrize(
    ("source", "match"),
    [
        ("{{ 'x' * 10**10 }}", r"'\*' would build 10000000000"),
        ("{{ ['x'] * 10**9 }}", r"'\*' would build"),
        ("{{ range(10**9)|list|length }}", "range"),
        ("{% for i in range(10**9) %}{% endfor %}", "range"),
        ("{{ 2 ** (10**9) }}", "integer over"),
        (
            "{% set ns = namespace(x=3) %}{% for i in range(60) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
            "integer over",
        ),
        (
            "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
            "'~' would build",
        ),
        (
            "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
            r"'\+' would build",
        ),
        ("{{ ''|center(10**9) }}", "center"),
        ("{{ ''.ljust(10**9) }}", "ljust"),
        ("{{ '%0999999999d' % 1 }}", "format width"),
        ("{{ '%*d' % (10**9, 1) }}", "format width"),
        ("{{ '{:>999999999}'.format(1) }}", "format width"),
        ("{{ '%0999999999d'|format(1) }}", "format width"),
        ("{{ ('x' * 1000000)|replace('x', 'xxxxxxxxxx') }}", "replace"),
        ("{{ ('a\n' * 1000000)|indent(1000) }}", "indent"),
        ("{{ (['x' * 4000000] * 1000)|join }}", "join"),
        ("{{ ','.join(['x' * 4000000] * 1000) }}", "join"),
        ("{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}", "rendered prompt exceeds"),
    ],
)
def test_huge_values_and_outputs_are_refused(renderer, source: str, match: str) -> None:
    _refused(renderer, source, match)


def test_recursion_is_refused(renderer) -> None:
    _refused(renderer, "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursion")


def test_source_size_is_bounded(renderer) -> None:
    source = "{# " + "x" * (64 << 10) + " #}"
    _refused(renderer, source, "exceed the limit of 65536 bytes", within_s=0.5)


def test_memory_is_given_back(renderer) -> None:
    """A worker that hit a limit is replaced, so whatever it grew goes back to the system."""
    renderer.render("ok", VARS)
    pid = renderer.worker_pid
    _refused(renderer, "{{ 'x' * 10**10 }}", "would build")
    assert renderer.worker_pid is None
    assert renderer.render("ok", VARS) == "ok"
    assert renderer.worker_pid != pid


# ---- sandbox ----
@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__ }}",
        "{{ raise_exception.__globals__['os'] }}",
        "{{ namespace.__init__.__globals__ }}",
        "{{ cycler.__init__.__globals__.os.system('true') }}",
        "{{ messages.append(1) }}",
        "{% set ns = namespace() %}{% set ns._x = 1 %}",
    ],
)
def test_sandbox_blocks_internals(renderer, source: str) -> None:
    try:
        out = renderer.render(source, VARS)
    except ChatTemplateError as exc:
        assert "is unsafe" in str(exc) or "may not start with '_'" in str(exc)
    else:
        assert out == ""


def test_template_errors_are_reported(renderer) -> None:
    with pytest.raises(ChatTemplateError, match="syntax error at line 1"):
        renderer.render("{% for %}", VARS)
    with pytest.raises(ChatTemplateError, match="^no tools here$"):
        renderer.render("{{ raise_exception('no tools here') }}", VARS)
    assert renderer.render("{{ messages | length }}{{ '%05.1f' % 2.5 }}{{ '{:>4}'.format(7) }}", VARS) == (
        "1002.5   7"
    )


# ---- compiled templates ----
def test_compiled_request_templates_are_an_lru() -> None:
    cache = template_cache(ChatTemplateLimits(cache_size=4))
    for i in range(6):
        cache(f"template {i}")
    info = cache.cache_info()
    assert (info.currsize, info.maxsize, info.misses) == (4, 4, 6)
    cache("template 5")
    assert cache.cache_info().hits == 1
    cache("template 0")  # evicted: compiled again
    assert cache.cache_info().misses == 7


def test_many_distinct_templates_stay_fast(renderer) -> None:
    began = time.monotonic()
    for i in range(40):
        assert renderer.render(f"{{{{ {i} }}}}", VARS) == str(i)
    assert time.monotonic() - began < 5


# ---- chat_template_kwargs policy ----
@pytest.mark.parametrize(
    "key",
    [
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "bos_token",
        "eos_token",
        "image_token",
        "raise_exception",
        "_private",
        "__class__",
    ],
)
def test_reserved_kwargs_are_refused(key: str) -> None:
    with pytest.raises(ValueError, match=rf"^chat_template_kwargs\.{key}: set by the server"):
        check_chat_template_kwargs({key: "x"})


def test_kwargs_values_are_small_json() -> None:
    assert check_chat_template_kwargs({"enable_thinking": True, "chat_template": "x"}) == {
        "enable_thinking": True
    }
    assert check_chat_template_kwargs({"persona": {"name": "Ann", "tags": ["a", 1, 2.5, None]}})
    deep: object = 1
    for _ in range(MAX_KWARGS_DEPTH + 1):
        deep = [deep]
    with pytest.raises(ValueError, match=r"^chat_template_kwargs\.deep: nested deeper"):
        check_chat_template_kwargs({"deep": deep})
    with pytest.raises(ValueError, match=r"^chat_template_kwargs\.many: .* more than 1024 values"):
        check_chat_template_kwargs({"many": list(range(2000))})
    with pytest.raises(ValueError, match=r"^chat_template_kwargs\.text: .* bytes of text"):
        check_chat_template_kwargs({"text": "x" * (65 << 10)})
    with pytest.raises(ValueError, match=r"^chat_template_kwargs\.big: integers must fit in 64 bits"):
        check_chat_template_kwargs({"big": 10**30})
    with pytest.raises(ValueError, match="not a valid template variable name"):
        check_chat_template_kwargs({"a b": 1})
