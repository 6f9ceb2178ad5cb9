"""``cache_salt`` on the chat, completions and Responses APIs: a tenant cannot see (by its usage or by timing
its first token) that another tenant's prompt is in the prefix cache, unless both send the same salt."""

from __future__ import annotations

import httpx
import pytest

# ~60 tokens of the tiny tokenizer: several full 16-token blocks
PROMPT = "the quick brown fox jumps over the lazy dog and " * 6


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json={"model": "tiny", **body}, timeout=60)


def _cached(answer: httpx.Response) -> int:
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    return details.get("cached_tokens", 0)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "completions: " + PROMPT, "max_tokens": 2}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "chat: " + PROMPT}], "max_tokens": 2},
        ),
        ("/v1/responses", {"input": "responses: " + PROMPT, "max_output_tokens": 2, "store": False}),
    ],
)
def test_only_the_same_salt_hits_the_cache(server, path, body):
    first = _cached(_post(server, path, {**body, "cache_salt": "tenant-a"}))
    same = _cached(_post(server, path, {**body, "cache_salt": "tenant-a"}))
    other = _cached(_post(server, path, {**body, "cache_salt": "tenant-b"}))
    unsalted = _cached(_post(server, path, body))
    assert first == 0 and other == 0 and unsalted == 0
    assert same >= 32


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses"])
@pytest.mark.parametrize(
    ("salt", "message"),
    [
        ("", "cache_salt: must be a non-empty string"),
        (7, "cache_salt: Input should be a valid string"),
        ("s" * 1025, "cache_salt: 1025 characters, more than 1024"),
    ],
)
def test_a_bad_salt_is_a_400_naming_it(server, path, salt, message):
    body = {
        "/v1/completions": {"prompt": "hi", "max_tokens": 1},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
        "/v1/responses": {"input": "hi", "store": False, "max_output_tokens": 1},
    }[path]
    answer = _post(server, path, {**body, "cache_salt": salt})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["message"].startswith(message) and error["param"] == "cache_salt", error
