"""``cache_salt``: requests share cached KV blocks only when they carry the same salt (vLLM's field). Without
it, a tenant could learn whether another tenant sent a prompt by timing its own first token."""

from __future__ import annotations

import pytest

from g4serve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
# 40 ids past the tiny tokenizer's special and media placeholder tokens: two full 16-token blocks
PROMPT = [25 + (7 * i) % 400 for i in range(40)]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), device="cpu", text_only=True, kv_cache_bytes=8 << 20)


def _run(llm: LLM, salt: str | None, prompt: list[int]):
    request = {"prompt_token_ids": prompt}
    if salt is not None:
        request["cache_salt"] = salt
    return llm.generate([request], GREEDY)[0]


def test_blocks_are_shared_only_under_the_same_salt(llm):
    prompt = PROMPT[::-1]
    first = _run(llm, "tenant-a", prompt)
    same = _run(llm, "tenant-a", prompt)
    other = _run(llm, "tenant-b", prompt)
    unsalted = _run(llm, None, prompt)
    assert first.num_cached_tokens == 0
    assert same.num_cached_tokens == 32  # both full blocks, the last token left to compute
    assert other.num_cached_tokens == 0 and unsalted.num_cached_tokens == 0
    assert same.outputs[0].token_ids == first.outputs[0].token_ids == other.outputs[0].token_ids


def test_unsalted_requests_share_as_before(llm):
    first = _run(llm, None, PROMPT)
    again = _run(llm, None, PROMPT)
    salted = _run(llm, "tenant-a", PROMPT)
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 32
    assert salted.num_cached_tokens == 0


@pytest.mark.parametrize(
    ("salt", "message"),
    [
        ("", r"cache_salt: must be a non-empty string"),
        (7, r"cache_salt: must be a non-empty string"),
        ("x" * 1025, r"cache_salt: 1025 characters, more than 1024"),
        ("bad\ud800", r"cache_salt: invalid Unicode"),
    ],
)
def test_bad_salts_are_refused_naming_the_field(llm, salt, message):
    with pytest.raises(ValueError, match=message):
        _run(llm, salt, PROMPT)
