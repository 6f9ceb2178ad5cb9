"""A server started with ``--jump-forward``: constrained responses report the tokens the grammar forced in
``usage.completion_tokens_details.forced_tokens`` (streamed or not, per choice summed), unconstrained ones
report nothing new, and /metrics counts forced and decoded tokens."""

from __future__ import annotations

import json

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("jsonschema")

USER = [{"role": "user", "content": "Lock my card, please."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "intent": {"enum": ["card_lock", "card_unlock", "transfer_money"]},
        "candidate": {"enum": ["c1", "c2", None]},
    },
    "required": ["intent", "candidate"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "intent", "schema": SCHEMA, "strict": True}}


def _gauge(text: str, name: str) -> float:
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


@pytest.fixture(scope="module")
def jf_server(tiny_model_dir, server_factory):
    return server_factory(tiny_model_dir, "--jump-forward", "--served-model-name", "tiny")


def test_usage_counts_forced_tokens(jf_server):
    import jsonschema

    client = openai.OpenAI(base_url=f"{jf_server.base_url}/v1", api_key="unused", max_retries=0)
    full = client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=120, temperature=0, response_format=FORMAT
    )
    jsonschema.validate(json.loads(full.choices[0].message.content), SCHEMA)
    forced = full.usage.completion_tokens_details.forced_tokens
    assert 0 < forced < full.usage.completion_tokens

    chunks = client.chat.completions.create(
        model="tiny",
        messages=USER,
        max_tokens=120,
        temperature=0,
        response_format=FORMAT,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [c.usage for c in chunks if c.usage is not None][-1]
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.completion_tokens_details.forced_tokens == forced

    many = client.completions.create(
        model="tiny",
        prompt="Lock my card: ",
        max_tokens=120,
        temperature=1.0,
        seed=3,
        n=3,
        extra_body={"response_format": FORMAT},
    )
    assert all(c.finish_reason == "stop" for c in many.choices)
    assert 0 < many.usage.completion_tokens_details.forced_tokens < many.usage.completion_tokens

    free = client.chat.completions.create(model="tiny", messages=USER, max_tokens=4)
    assert free.usage.completion_tokens_details is None  # nothing forced, nothing reported

    metrics = httpx.get(f"{jf_server.base_url}/metrics").text
    engine = jf_server.engine.stats()
    assert _gauge(metrics, "g4serve_generation_forced_tokens") == engine["forced_tokens_total"] > 0
    decoded = _gauge(metrics, "g4serve_generation_decoded_tokens")
    assert decoded == engine["generation_tokens_total"] - engine["forced_tokens_total"] > 0
    jf_server.wait_idle()
