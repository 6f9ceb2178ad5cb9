"""Gemma extraction on the tiny random model: the constrained output always parses and validates, only
offered candidates come back, and the prompt's fixed part is a token prefix of every prompt."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import jsonschema
import pytest

from g4serve_assistant.extraction import (
    EXTRACTION_SYSTEM,
    MAX_CANDIDATES,
    Extraction,
    Extractor,
    candidate_ids,
    extraction_schema,
    max_output_bytes,
    merge_into_result,
)
from g4serve_assistant.intents import INTENTS

REQUIRED = {
    "intent",
    "entities",
    "amount_minor",
    "currency",
    "recipient_candidate_id",
    "needs_confirmation",
    "ambiguity_reason",
}


@dataclass
class Cand:
    payee_id: str
    display_name: str
    relationship: str
    kind: str = "person"
    score: float = 80.0
    phonetic: bool = False


JONS = [Cand("john_smith", "John Smith", "friend"), Cand("jon_smythe", "Jon Smythe", "colleague")]
MANY = [Cand(f"p{i}", f"Payee Number{i}", "friend") for i in range(MAX_CANDIDATES + 2)]  # more than offered


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from g4serve.engine.async_engine import AsyncLLMEngine
    from g4serve.engine.engine import EngineConfig

    eng = AsyncLLMEngine.from_config(
        EngineConfig(
            model=str(tiny_model_dir), device="cpu", dtype="float32", kv_cache_bytes=32 << 20, text_only=True
        )
    )
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def extractor(engine):
    return Extractor(engine)


def test_schema_is_shallow_bounded_and_offers_only_candidate_ids():
    for n in range(MAX_CANDIDATES + 1):
        schema = extraction_schema(n)
        jsonschema.Draft202012Validator.check_schema(schema)
        assert set(schema["required"]) == REQUIRED and schema["additionalProperties"] is False
        assert schema["properties"]["entities"]["additionalProperties"] is False
        assert schema["properties"]["intent"]["enum"] == list(INTENTS)
        assert schema["properties"]["recipient_candidate_id"]["enum"] == [*candidate_ids(n), None]
        assert max_output_bytes(schema) < 400  # every string and integer is bounded
    with pytest.raises(ValueError, match="n_candidates"):
        extraction_schema(MAX_CANDIDATES + 1)


def test_fixed_prompt_part_is_a_token_prefix_of_every_prompt(extractor):
    tok = extractor.tokenizer
    fixed = extractor.fixed_prefix_ids
    assert EXTRACTION_SYSTEM in extractor.fixed_prefix and len(fixed) > 100
    cases = [
        ("send fifty to jon", JONS, "send $50.00 to jon"),
        ("pay the thing", [], None),
        ("give catherine twenty bucks", MANY[:MAX_CANDIDATES], None),
        ("", [], None),
    ]
    for transcript, candidates, normalized in cases:
        prompt = extractor.prompt(transcript, candidates, normalized)
        ids = tok.encode(prompt, add_special_tokens=False)
        assert ids[: len(fixed)] == fixed, transcript
        tail = prompt[len(extractor.fixed_prefix) :]
        assert tail.startswith("Transcript: ") and transcript in tail  # per-call text comes last
        for cid, cand in zip(candidate_ids(len(candidates)), candidates, strict=True):
            assert f"{cid}: {cand.display_name}" in tail
        assert "john_smith" not in prompt  # database ids never reach the model


def test_extraction_always_parses_validates_and_picks_an_offered_candidate(engine, extractor):
    cases = [
        ("send fifty to jon", JONS),
        ("um the thing for the power", []),
        ("give catherine twenty bucks tomorrow", MANY),
        ("what", JONS[:1]),
    ]

    async def run_all() -> list[Extraction]:
        return [await extractor.extract(text, cands) for text, cands in cases]

    results = asyncio.run(run_all())
    fixed = len(extractor.fixed_prefix_ids)
    for (text, cands), r in zip(cases, results, strict=True):
        offered = cands[:MAX_CANDIDATES]
        assert r.valid, (text, r.error, r.raw)
        assert r.finish_reason == "stop"
        out = json.loads(r.raw)
        assert out == r.output and set(out) == REQUIRED  # no missing and no extra fields
        jsonschema.validate(out, extraction_schema(len(offered)))
        assert out["recipient_candidate_id"] in [*candidate_ids(len(offered)), None]
        assert r.offered == [c.payee_id for c in offered]
        assert r.payee_id is None or r.payee_id in r.offered
        assert r.llm_ms > 0 and r.output_tokens <= extractor.max_tokens
    # Prefix caching: after the first call, the fixed part comes from the cache (whole blocks of it).
    assert all(r.cached_tokens >= fixed - 16 for r in results[1:]), [r.cached_tokens for r in results]


def test_validate_refuses_what_the_grammar_should_never_produce(extractor):
    good = {
        "intent": "transfer_money",
        "entities": {},
        "amount_minor": 5000,
        "currency": "USD",
        "recipient_candidate_id": "c2",
        "needs_confirmation": True,
        "ambiguity_reason": None,
    }
    assert extractor.validate(json.dumps(good), 2) == (good, None)
    for bad, n, where in [
        ({**good, "extra": 1}, 2, "(root)"),
        ({**good, "recipient_candidate_id": "c3"}, 2, "recipient_candidate_id"),
        ({**good, "intent": "buy_stocks"}, 2, "intent"),
        ({**good, "entities": {"iban": "x"}}, 2, "entities"),
        ({**good, "currency": "usd"}, 2, "currency"),
    ]:
        output, error = extractor.validate(json.dumps(bad), n)
        assert output is None and error.startswith(where), error
    output, error = extractor.validate('{"intent": "transfer_mo', 2)
    assert output is None and error.startswith("not JSON")


def test_merge_keeps_deterministic_entities_and_maps_the_candidate():
    from g4serve_assistant.intents import IntentResult

    heard = [(5000, "USD"), (2000, "USD")]
    base = IntentResult(
        intent="unknown",
        confidence=0.4,
        entities={"amount_minor": 5000, "currency": "USD"},
        candidates=JONS,
        needs_llm=True,
        ambiguity_reason="multiple_amounts",
        rules=["r"],
    )

    def extraction(amount_minor, currency, cid="c2") -> Extraction:
        out = {
            "intent": "transfer_money",
            "entities": {"payee_name": "jon"},
            "amount_minor": amount_minor,
            "currency": currency,
            "recipient_candidate_id": cid,
            "needs_confirmation": True,
            "ambiguity_reason": None,
        }
        return Extraction(
            output=out, raw=json.dumps(out), valid=True, error=None, offered=[c.payee_id for c in JONS]
        )

    merged = merge_into_result(base, extraction(9999, "EUR"), JONS, heard)
    assert merged.intent == "transfer_money" and not merged.needs_llm and "gemma_extraction" in merged.rules
    assert (merged.entities["amount_minor"], merged.entities["currency"]) == (
        5000,
        "USD",
    )  # not a model-only number
    assert merged.entities["payee_id"] == "jon_smythe" and merged.entities["payee_name"] == "Jon Smythe"
    # The model may choose among the amounts that were said.
    assert merge_into_result(base, extraction(2000, "USD"), JONS, heard).entities["amount_minor"] == 2000
    # No amount heard: the model's number is dropped and the policy will ask.
    bare = IntentResult(
        intent="unknown",
        confidence=0.4,
        entities={},
        candidates=JONS,
        needs_llm=True,
        ambiguity_reason=None,
        rules=[],
    )
    assert "amount_minor" not in merge_into_result(bare, extraction(9999, "USD"), JONS).entities
    # Candidates were offered and the model chose none: no payee survives.
    guessed = IntentResult(
        intent="transfer_money",
        confidence=0.6,
        entities={"payee_id": "john_smith"},
        candidates=JONS,
        needs_llm=True,
        ambiguity_reason=None,
        rules=[],
    )
    assert "payee_id" not in merge_into_result(guessed, extraction(None, None, cid=None), JONS).entities


def test_warmup_compiles_every_grammar_through_the_public_validate(engine, extractor):
    """``AsyncLLMEngine.validate`` checks a request as ``generate`` would, without queuing it; the warm-up
    compiles each candidate count's grammar through it, so no user's turn pays for a compile."""
    from g4serve.sampling_params import SamplingParams

    backend = engine.engine.structured_backend  # test-only peek at the grammar cache

    async def run() -> None:
        await extractor.warmup()
        processed = await engine.process(extractor.prompt("x", []), add_special_tokens=False)
        with pytest.raises(ValueError, match="max_model_len"):
            await engine.validate(processed, SamplingParams(max_tokens=engine.max_model_len))
        before = backend.cache_info()
        for n in range(MAX_CANDIDATES + 1):
            await engine.validate(processed, extractor.params(n))
        after = backend.cache_info()
        assert after["misses"] == before["misses"] and after["hits"] >= before["hits"] + MAX_CANDIDATES + 1

    asyncio.run(run())
    assert not engine.engine.requests  # nothing was queued
