"""A server with speculative decoding: completions and streams as without it, and the acceptance counters in
``/metrics`` per draft position."""

from __future__ import annotations

import httpx
import pytest

openai = pytest.importorskip("openai")

SPEC = '{"method": "ngram", "num_speculative_tokens": 3}'
PROMPT = [30, 31, 32, 33, 34, 30, 31, 32, 33, 34, 30, 31, 32]


def test_spec_server_answers_and_counts(server_factory, tiny_model_dir):
    plain = server_factory(tiny_model_dir, "--served-model-name", "tiny")
    spec = server_factory(tiny_model_dir, "--served-model-name", "tiny", "--speculative-config", SPEC)
    answers = []
    for running in (plain, spec):
        client = openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="unused", max_retries=0)
        whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0)
        streamed = client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stream=True
        )
        assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
        answers.append(whole.choices[0].text)
        running.wait_idle()
    assert answers[0] == answers[1]
    metrics = httpx.get(f"{spec.base_url}/metrics").text
    lines = [line for line in metrics.splitlines() if line.startswith("g4serve_spec_decode_")]
    drafted = spec.engine.spec_stats.drafted
    assert drafted and f'g4serve_spec_decode_draft_tokens{{position="0"}} {float(drafted[0])}' in lines
    assert any(line.startswith('g4serve_spec_decode_acceptance_rate{position="0"}') for line in lines)
