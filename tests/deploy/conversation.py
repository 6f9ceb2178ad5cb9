"""A two-turn conversation through a router (standalone or Ray Serve): the second turn, keyed by the same
system prompt and first user turn, goes back to the first turn's replica and reuses its KV blocks."""

from __future__ import annotations

import httpx


def prefix_hit_tokens(client: httpx.Client, replica: str) -> float:
    """The replica's prefix-cache hit counter, read through the router (pinned to that replica)."""
    text = client.get("/metrics", headers={"X-G4Serve-Replica": replica}).text
    (line,) = [ln for ln in text.splitlines() if ln.startswith("g4serve_prefix_cache_hit_tokens_total")]
    return float(line.rsplit(" ", 1)[1])


def second_turn_hits_the_first_turns_replica(client: httpx.Client, body: dict) -> str:
    """Sends ``body`` (one user turn), then the conversation's second turn; asserts the second went to the
    same replica and reused at least half of the first prompt from its cache. Returns that replica."""
    one = client.post("/v1/chat/completions", json=body)
    replica = one.headers["x-g4serve-replica"]
    before = prefix_hit_tokens(client, replica)
    body = {
        **body,
        "messages": body["messages"]
        + [
            {"role": "assistant", "content": "100 EUR."},
            {"role": "user", "content": "Savings?"},
        ],
    }
    two = client.post("/v1/chat/completions", json=body)
    assert two.headers["x-g4serve-replica"] == replica
    cached = two.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= one.json()["usage"]["prompt_tokens"] // 2
    assert prefix_hit_tokens(client, replica) - before >= cached
    return replica
