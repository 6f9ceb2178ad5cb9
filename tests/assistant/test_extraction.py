"""Gemma extraction on the tiny random model: the compact schema (intent, candidate, amount words), whose
constrained output always parses and validates, only offered candidates and heard amounts come back, no
date or other value comes from the model, and the prompt's fixed part is a token prefix of every prompt."""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass

import jsonschema
import pytest

from g4serve_assistant.extraction import (
    AMOUNT_PATTERN,
    AMOUNT_WORDS,
    EXTRACTION_SYSTEM,
    MAX_CANDIDATES,
    Extraction,
    Extractor,
    amount_of_words,
    candidate_ids,
    extraction_schema,
    heard_amounts,
    max_output_bytes,
    merge_into_result,
)
from g4serve_assistant.intents import INTENTS, IntentResult

REQUIRED = {"intent", "candidate", "amount_words"}


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


def _engine(model_dir, **kw):
    from g4serve.engine.async_engine import AsyncLLMEngine
    from g4serve.engine.engine import EngineConfig

    config = EngineConfig(
        model=str(model_dir), device="cpu", dtype="float32", kv_cache_bytes=32 << 20, text_only=True, **kw
    )
    return AsyncLLMEngine.from_config(config)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = _engine(tiny_model_dir, jump_forward=True)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def extractor(engine):
    return Extractor(engine)


# ---- the schema ------------------------------------------------------------------------------------------


def test_schema_is_compact_bounded_and_offers_only_candidate_ids():
    for n in range(MAX_CANDIDATES + 1):
        for heard in (True, False):
            schema = extraction_schema(n, heard)
            jsonschema.Draft202012Validator.check_schema(schema)
            assert set(schema["required"]) == set(schema["properties"]) == REQUIRED
            assert schema["additionalProperties"] is False
            assert schema["properties"]["intent"]["enum"] == list(INTENTS)
            assert schema["properties"]["candidate"]["enum"] == [*candidate_ids(n), None]
            assert max_output_bytes(schema) < 400  # every value is bounded
        assert extraction_schema(n, amount_heard=False)["properties"]["amount_words"] == {"type": "null"}
    with pytest.raises(ValueError, match="n_candidates"):
        extraction_schema(MAX_CANDIDATES + 1)


def test_amount_words_are_what_the_normalizer_reads():
    """Every word of the pattern is plain letters; amounts as customers say them fit it and map back to the
    amount the normalizer heard in the sentence; other words do not fit."""
    assert all(re.fullmatch("[a-z]+", w) for w in AMOUNT_WORDS)
    pattern = re.compile(AMOUNT_PATTERN)
    said = [
        ("send sixty pounds to jon", "sixty pounds"),
        ("give catherine twenty bucks", "twenty bucks"),
        ("transfer $120.50 to priya", "$120.50"),
        ("pay a hundred and five dollars and twenty cents", "a hundred and five dollars and twenty cents"),
        ("send fifty to jon", "fifty"),
        ("pay 12.50 euros and 3 dollars", "3 dollars"),
        ("send 1,250.50 euros to mum", "1,250.50 euros"),
        ("send minus fifty dollars to bob", "minus fifty dollars"),
    ]
    for sentence, words in said:
        assert pattern.fullmatch(words), words
        heard = heard_amounts(sentence)
        assert amount_of_words(words, heard) in heard, (sentence, words)
    for words in [
        "8888-00-95",
        "send it all",
        "fifty dollars to jon",
        "one two three four five six seven eight nine ten eleven",
    ]:
        assert not pattern.fullmatch(words), words


def test_amount_of_words_takes_only_a_heard_amount():
    heard = [(5000, "USD"), (2000, "EUR")]
    assert amount_of_words("fifty dollars", heard) == (5000, "USD")
    assert amount_of_words("twenty", heard) == (2000, "EUR")  # a bare number: the currency heard with it
    assert amount_of_words("twenty dollars", heard) is None  # said in another currency than heard
    assert amount_of_words("ninety nine dollars", heard) is None  # a number only the model read
    assert amount_of_words("fifty dollars and twenty euros", heard) is None  # two amounts: which?
    assert amount_of_words("fifty dollars", []) is None


# ---- the prompt ------------------------------------------------------------------------------------------


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


def test_prompt_examples_validate():
    """The examples in the fixed prompt are outputs the schema accepts (the model copies their shape)."""
    outputs = re.findall(r"Output: (\{.*\})", EXTRACTION_SYSTEM)
    assert len(outputs) == 3
    for text in outputs:
        out = json.loads(text)
        jsonschema.validate(out, extraction_schema(2, amount_heard=out["amount_words"] is not None))


# ---- the call ----------------------------------------------------------------------------------------------

CASES = [
    ("send fifty to jon", JONS),
    ("um the thing for the power", []),
    ("give catherine twenty bucks tomorrow", MANY),
    ("what", JONS[:1]),
]


def _check_calls(extractor: Extractor, results: list[Extraction]) -> None:
    fixed = len(extractor.fixed_prefix_ids)
    for (text, cands), r in zip(CASES, results, strict=True):
        offered = cands[:MAX_CANDIDATES]
        assert r.valid, (text, r.error, r.raw)
        assert r.finish_reason == "stop"
        out = json.loads(r.raw)
        assert out == r.output and set(out) == REQUIRED  # no missing and no extra fields
        assert r.amount_heard == bool(heard_amounts(text))
        jsonschema.validate(out, extraction_schema(len(offered), r.amount_heard))
        if not r.amount_heard:
            assert out["amount_words"] is None
        assert out["candidate"] in [*candidate_ids(len(offered)), None]
        assert r.offered == [c.payee_id for c in offered]
        assert r.payee_id is None or r.payee_id in r.offered
        assert r.llm_ms > 0 and r.output_tokens <= extractor.max_tokens
        assert r.decoded_tokens + r.forced_tokens == r.output_tokens and r.decoded_tokens >= 1
    # Prefix caching: after the first call, the fixed part comes from the cache (whole blocks of it).
    assert all(r.cached_tokens >= fixed - 16 for r in results[1:]), [r.cached_tokens for r in results]


def test_extraction_always_parses_validates_and_picks_an_offered_candidate(extractor):
    async def run_all() -> list[Extraction]:
        return [await extractor.extract(text, cands) for text, cands in CASES]

    results = asyncio.run(run_all())
    _check_calls(extractor, results)
    # Jump-forward: the keys, the punctuation and the rest of each value once it is unique are forced.
    for r in results:
        assert r.forced_tokens > r.decoded_tokens, (r.raw, r.forced_tokens, r.decoded_tokens)


def test_without_jump_forward_every_token_is_decoded(tiny_model_dir):
    engine = _engine(tiny_model_dir)
    try:
        extractor = Extractor(engine)

        async def run_all() -> list[Extraction]:
            return [await extractor.extract(text, cands) for text, cands in CASES]

        results = asyncio.run(run_all())
    finally:
        engine.shutdown()
    _check_calls(extractor, results)
    assert all(r.forced_tokens == 0 for r in results)


def test_validate_refuses_what_the_grammar_should_never_produce(extractor):
    good = {"intent": "transfer_money", "candidate": "c2", "amount_words": "fifty dollars"}
    assert extractor.validate(json.dumps(good), 2) == (good, None)
    for bad, n, heard, where in [
        ({**good, "extra": 1}, 2, True, "(root)"),
        ({**good, "candidate": "c3"}, 2, True, "candidate"),
        ({**good, "intent": "buy_stocks"}, 2, True, "intent"),
        ({**good, "amount_words": "fifty dollars to jon"}, 2, True, "amount_words"),
        ({**good, "amount_words": "fifty dollars"}, 2, False, "amount_words"),  # nothing was heard
        # Issue 20's repro: an impossible date passed validation. There is no field a date could be in.
        ({**good, "intent": "card_unlock", "date": "8888-00-95"}, 2, True, "(root)"),
        ({**good, "entities": {"date": "8888-00-95"}}, 2, True, "(root)"),
        ({**good, "amount_words": "8888-00-95"}, 2, True, "amount_words"),
    ]:
        output, error = extractor.validate(json.dumps(bad), n, heard)
        assert output is None and error.startswith(where), (bad, error)
    output, error = extractor.validate('{"intent": "transfer_mo', 2)
    assert output is None and error.startswith("not JSON")


# ---- the merge -----------------------------------------------------------------------------------------


def _extraction(words, cid="c2", intent="transfer_money", **extra) -> Extraction:
    out = {"intent": intent, "candidate": cid, "amount_words": words, **extra}
    return Extraction(
        output=out, raw=json.dumps(out), valid=True, error=None, offered=[c.payee_id for c in JONS]
    )


def _result(**entities) -> IntentResult:
    return IntentResult(
        intent="unknown",
        confidence=0.4,
        entities=entities,
        candidates=JONS,
        needs_llm=True,
        ambiguity_reason="multiple_amounts",
        rules=["r"],
    )


def test_merge_takes_choices_not_values():
    heard = [(5000, "USD"), (2000, "USD")]
    base = _result(amount_minor=5000, currency="USD", card="card_1")
    merged = merge_into_result(base, _extraction("ninety nine euros"), JONS, heard)
    assert merged.intent == "transfer_money" and not merged.needs_llm and "gemma_extraction" in merged.rules
    assert (merged.entities["amount_minor"], merged.entities["currency"]) == (5000, "USD")  # not the model's
    assert merged.entities["payee_id"] == "jon_smythe" and merged.entities["payee_name"] == "Jon Smythe"
    assert merged.entities["card"] == "card_1" and merged.ambiguity_reason is None
    # The model chooses among the amounts that were said, in its words.
    assert (
        merge_into_result(base, _extraction("twenty dollars"), JONS, heard).entities["amount_minor"] == 2000
    )
    assert merge_into_result(base, _extraction("twenty"), JONS, heard).entities["amount_minor"] == 2000
    # No amount heard: the model's words are dropped and the policy will ask.
    merged = merge_into_result(_result(), _extraction("ninety nine dollars"), JONS)
    assert "amount_minor" not in merged.entities and "currency" not in merged.entities
    # Candidates were offered and the model chose none: no payee survives, and the payee stays ambiguous.
    guessed = merge_into_result(_result(payee_id="john_smith"), _extraction(None, cid=None), JONS)
    assert "payee_id" not in guessed.entities and guessed.ambiguity_reason.startswith("ambiguous_payee")


def test_merge_never_takes_a_date_or_other_value_from_the_model():
    """Even an output that somehow skipped validation adds nothing but the choices: issue 20's card_unlock
    with date "8888-00-95" cannot reach the policy."""
    bad = _extraction(
        None, cid=None, intent="card_unlock", date="8888-00-95", entities={"date": "8888-00-95"}
    )
    merged = merge_into_result(_result(), bad, [], [])
    assert merged.intent == "card_unlock" and merged.entities == {}


def test_warmup_compiles_every_grammar_through_the_public_validate(engine, extractor):
    """``AsyncLLMEngine.validate`` checks a request as ``generate`` would, without queuing it; the warm-up
    compiles each candidate count's and amount shape's grammar through it, so no user's turn pays for a
    compile."""
    from g4serve.sampling_params import SamplingParams

    backend = engine.engine.structured_backend  # test-only peek at the grammar cache

    async def run() -> None:
        await extractor.warmup()
        processed = await engine.process(extractor.prompt("x", []), add_special_tokens=False)
        with pytest.raises(ValueError, match="max_model_len"):
            await engine.validate(processed, SamplingParams(max_tokens=engine.max_model_len))
        before = backend.cache_info()
        for n in range(MAX_CANDIDATES + 1):
            for heard in (True, False):
                await engine.validate(processed, extractor.params(n, heard))
        after = backend.cache_info()
        shapes = 2 * (MAX_CANDIDATES + 1)
        assert after["misses"] == before["misses"] and after["hits"] >= before["hits"] + shapes

    asyncio.run(run())
    assert not engine.engine.requests  # nothing was queued
