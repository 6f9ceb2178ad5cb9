"""Constrained decoding in the engine (tiny random model, CPU fp32): whatever the weights, every
constrained output validates, and unconstrained requests sharing its steps are unchanged."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from g4serve.engine.engine import EngineConfig, LLMEngine
from g4serve.engine.request import Request
from g4serve.sampling_params import SamplingParams
from g4serve.structured import StructuredOutputError, StructuredSpec

# Nested objects, enums, required and optional fields, integer/number/boolean/array types, closed objects;
# short keys, because the tiny vocabulary spells JSON almost one character per token.
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "amt": {"type": "number", "minimum": -100, "maximum": 100},
        "ok": {"type": "boolean"},
        "kind": {"enum": ["card", "loan"]},
        "note": {"type": "string", "maxLength": 4},
        "pts": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 9},
            "minItems": 1,
            "maxItems": 2,
        },
        "to": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Oslo", "Lima"]},
                "geo": {
                    "type": "object",
                    "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90}},
                    "required": ["lat"],
                    "additionalProperties": False,
                },
            },
            "required": ["city", "geo"],
            "additionalProperties": False,
        },
    },
    "required": ["id", "ok", "kind", "pts", "to"],
    "additionalProperties": False,
}
PROMPT = "<|turn>user\nDescribe the customer as JSON.<turn|>\n<|turn>model\n"
FREE_PROMPTS = [
    "<|turn>user\nWhat is my balance?<turn|>\n<|turn>model\n",
    "<|turn>user\nsavings loan branch payment<turn|>\n<|turn>model\n",
    "The capital of France is",
    "<|turn>user\nhi<turn|>\n<|turn>model\n",
]
GREEDY = SamplingParams(temperature=0, max_tokens=24)


def make_engine(model_dir, **kw) -> LLMEngine:
    args = {
        "model": str(model_dir),
        "device": "cpu",
        "dtype": "float32",
        "kv_cache_bytes": 16 << 20,
        "max_num_batched_tokens": 256,
        "max_num_seqs": 48,
        "text_only": True,
    }
    args.update(kw)
    return LLMEngine(EngineConfig(**args))


def run(engine: LLMEngine, requests: dict[str, tuple[str, SamplingParams]]) -> dict:
    for rid, (prompt, params) in requests.items():
        engine.add_request(engine.make_request(rid, engine.process_prompt(prompt), params))
    return {rid: out.outputs[0] for rid, out in engine.run_until_finished().items()}


def assert_pools_free(engine: LLMEngine) -> None:
    engine.kv.reset_prefix_cache()
    for name, pool in engine.kv.pools.items():
        assert pool.num_free == pool.num_blocks, f"{name} pool leaked {pool.num_used} blocks"


def assert_exact_text(engine: LLMEngine, out) -> None:
    """The text is the grammar's output, nothing more: the final stop token adds no text."""
    assert out.finish_reason == "stop" and out.stop_reason in engine.model_config.text.eos_token_ids
    assert out.token_ids[-1] == out.stop_reason
    assert out.text == engine.tokenizer.decode(out.token_ids[:-1], skip_special_tokens=True)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return make_engine(tiny_model_dir)


def test_schema_batch_with_free_requests(engine):
    alone = run(engine, {f"free{i}": (p, GREEDY) for i, p in enumerate(FREE_PROMPTS)})
    spec = StructuredSpec.from_response_format(
        {"type": "json_schema", "json_schema": {"name": "customer", "schema": SCHEMA, "strict": True}}
    )
    requests = {
        f"json{seed}": (
            PROMPT,
            SamplingParams(temperature=1.0, seed=seed, max_tokens=256, structured_output=spec),
        )
        for seed in range(30)
    }
    requests.update({f"free{i}": (p, GREEDY) for i, p in enumerate(FREE_PROMPTS)})  # one batch, shared steps
    results = run(engine, requests)
    for seed in range(30):
        out = results[f"json{seed}"]
        assert_exact_text(engine, out)
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert len({results[f"json{seed}"].text for seed in range(30)}) == 30  # really sampled
    for i in range(len(FREE_PROMPTS)):
        assert results[f"free{i}"].token_ids == alone[f"free{i}"].token_ids
    assert engine.structured_backend.cache_info()["misses"] == 1  # 30 requests, one compile
    assert_pools_free(engine)


def test_json_object_regex_and_choice(engine):
    choices = ["yes", "no", "maybe later", 'say "hi"']
    pattern = r"[A-Z]{2}-[0-9]{3,5}( ok)?"
    requests = {}
    for seed in range(6):
        requests[f"obj{seed}"] = (
            PROMPT,
            SamplingParams(
                temperature=1.0, seed=seed, max_tokens=160, structured_output=StructuredSpec.json_object()
            ),
        )
        requests[f"re{seed}"] = (
            PROMPT,
            SamplingParams(
                temperature=1.0, seed=seed, max_tokens=32, structured_output=StructuredSpec.regex(pattern)
            ),
        )
        requests[f"ch{seed}"] = (
            PROMPT,
            SamplingParams(
                temperature=1.0, seed=seed, max_tokens=32, structured_output=StructuredSpec.choice(choices)
            ),
        )
    results = run(engine, requests)
    for seed in range(6):
        assert_exact_text(engine, results[f"re{seed}"])
        assert re.fullmatch(pattern, results[f"re{seed}"].text)
        assert_exact_text(engine, results[f"ch{seed}"])
        assert results[f"ch{seed}"].text in choices
        # Free-form keys and strings outlast any budget on noise weights: the budget-aware closing ends them.
        assert_exact_text(engine, results[f"obj{seed}"])
        assert isinstance(json.loads(results[f"obj{seed}"].text), dict)
    assert max(len(results[f"obj{seed}"].token_ids) for seed in range(6)) > 100  # some were closed, not empty


def test_grammar_closes_within_max_tokens(engine):
    """Near max_tokens the grammar is steered to its end: outputs stay valid even when the model would
    go on (greedy noise loops inside strings forever; sampled noise rarely closes a free string)."""
    requests = {}
    for seed, max_tokens in enumerate([12, 30, 60]):
        for name, temperature in (("greedy", 0.0), ("sampled", 1.0)):
            params = SamplingParams(
                temperature=temperature,
                seed=seed,
                max_tokens=max_tokens,
                structured_output=StructuredSpec.json_object(),
            )
            requests[f"obj-{name}-{max_tokens}"] = (PROMPT, params)
    for seed in range(4):  # the schema needs ~105 tokens at least; sampled freely, often more than 125
        requests[f"schema{seed}"] = (
            PROMPT,
            SamplingParams(
                temperature=1.0,
                seed=seed,
                max_tokens=125,
                structured_output=StructuredSpec.json_schema(SCHEMA),
            ),
        )
    results = run(engine, requests)
    for rid, out in results.items():
        assert_exact_text(engine, out)
        value = json.loads(out.text)
        assert len(out.token_ids) <= requests[rid][1].max_tokens
        if rid.startswith("schema"):
            jsonschema.validate(value, SCHEMA)
        else:
            assert isinstance(value, dict)
    assert_pools_free(engine)


def test_stop_controls_cannot_break_the_grammar(engine):
    """min_tokens and ignore_eos hold stop tokens back only while the grammar allows something else;
    skip_special_tokens=False never lets the final stop token into the text."""
    choice = StructuredSpec.choice(["yes", "no"])
    digits = StructuredSpec.regex("[0-9]{1,6}")
    requests = {
        "min": (
            PROMPT,
            SamplingParams(temperature=1.0, seed=1, max_tokens=40, min_tokens=30, structured_output=choice),
        ),
        "eos": (
            PROMPT,
            SamplingParams(
                temperature=1.0,
                seed=2,
                max_tokens=40,
                ignore_eos=True,
                skip_special_tokens=False,
                structured_output=choice,
            ),
        ),
        "digits": (
            PROMPT,
            SamplingParams(temperature=1.0, seed=3, max_tokens=40, ignore_eos=True, structured_output=digits),
        ),
        "greedy": (
            PROMPT,
            SamplingParams(temperature=0, max_tokens=40, min_tokens=3, structured_output=digits),
        ),
    }
    results = run(engine, requests)
    for rid in ("min", "eos"):
        assert_exact_text(engine, results[rid])
        assert results[rid].text in ("yes", "no")
    # ignore_eos: no stop token until the regex allows no more digits.
    assert_exact_text(engine, results["digits"])
    assert len(results["digits"].text) == 6
    assert_exact_text(engine, results["greedy"])
    assert re.fullmatch("[0-9]{1,6}", results["greedy"].text) and len(results["greedy"].token_ids) >= 3
    assert_pools_free(engine)


def test_preempted_constrained_requests_stay_valid(tiny_model_dir):
    # Room for 512 tokens: six requests of ~150 tokens (prompt and ~90-120 sampled JSON tokens) cannot all
    # stay; preempted ones recompute and go on.
    engine = make_engine(tiny_model_dir, kv_cache_bytes=2 << 18, enable_prefix_caching=False)
    spec = StructuredSpec.json_schema(SCHEMA)
    results = run(
        engine,
        {
            f"j{seed}": (
                PROMPT,
                SamplingParams(temperature=1.0, seed=seed, max_tokens=256, structured_output=spec),
            )
            for seed in range(6)
        },
    )
    assert engine.scheduler.num_preemptions > 0
    for out in results.values():
        assert_exact_text(engine, out)
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert_pools_free(engine)


def test_aborted_constrained_request_frees_its_blocks(engine):
    params = SamplingParams(
        temperature=1.0, seed=0, max_tokens=200, structured_output=StructuredSpec.json_schema(SCHEMA)
    )
    engine.add_request(engine.make_request("abort-me", engine.process_prompt(PROMPT), params))
    for _ in range(4):
        engine.step()
    request = engine.requests["abort-me"]
    assert request.output_token_ids and not request.finished
    assert any(pool.num_used for pool in engine.kv.pools.values())
    engine.abort_request("abort-me")
    assert request.finish_reason == "abort"
    assert not engine.has_unfinished_requests() and not engine.requests
    assert_pools_free(engine)


def test_compile_errors_surface_before_scheduling(engine):
    processed = engine.process_prompt(PROMPT)
    bad = SamplingParams(
        structured_output=StructuredSpec("regex", "a{")
    )  # built directly: unchecked until compiled
    with pytest.raises(StructuredOutputError, match=r"^response_format.regex: cannot compile"):
        engine.make_request("bad", processed, bad)
    with pytest.raises(StructuredOutputError, match=r"^structured_output: expected a StructuredSpec"):
        engine.make_request("bad", processed, SamplingParams(structured_output={"type": "json_object"}))
    # A request built without make_request is checked by add_request, before anything is held for it.
    request = Request(
        request_id="bad",
        prompt_token_ids=processed.token_ids,
        sampling_params=bad,
        eos_token_ids=engine.model_config.text.eos_token_ids,
        tokenizer=engine.tokenizer,
    )
    with pytest.raises(StructuredOutputError):
        engine.add_request(request)
    assert not engine.requests and not engine.scheduler.waiting and not engine.scheduler.running
    assert "bad" not in engine.kv.seqs
    assert_pools_free(engine)


def test_llm_generate_with_structured_output(tiny_model_dir):
    from g4serve import LLM

    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", kv_cache_bytes=8 << 20, text_only=True)
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 50}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    params = [
        SamplingParams(
            temperature=1.0, seed=5, n=3, max_tokens=64, structured_output=StructuredSpec.json_schema(schema)
        ),
        SamplingParams(temperature=0, max_tokens=8),
    ]
    constrained, free = llm.generate([PROMPT, PROMPT], params)
    assert len(constrained.outputs) == 3
    for completion in constrained.outputs:
        assert completion.finish_reason == "stop"
        jsonschema.validate(json.loads(completion.text), schema)
    assert free.outputs[0].finish_reason in ("stop", "length")
    with pytest.raises(StructuredOutputError):
        llm.generate(PROMPT, SamplingParams(structured_output=StructuredSpec("choice", "[]")))
    assert not llm.engine.has_unfinished_requests()


def test_a_grammar_with_no_way_on_fails_its_request_as_the_clients_error(engine):
    """``a`` then a character no token holds: admission sees a first token, so the dead end shows only when
    the grammar's mask empties. The request fails with a 400 naming the format (not an internal 500), the
    requests beside it finish, and nothing is left held."""
    dead = SamplingParams(
        temperature=0, max_tokens=8, structured_output=StructuredSpec.regex("a[^\\x00-\\U0010FFFF]")
    )
    outs = {}
    for rid, (prompt, params) in {"dead": (PROMPT, dead), "free": (PROMPT, GREEDY)}.items():
        engine.add_request(engine.make_request(rid, engine.process_prompt(prompt), params))
    outs = engine.run_until_finished()
    failed = outs["dead"]
    assert failed.outputs[0].finish_reason == "error" and failed.error_status == 400
    assert failed.error.startswith("response_format.regex: no output satisfies it (after 1 output tokens")
    assert outs["free"].error is None and outs["free"].outputs[0].finish_reason in ("stop", "length")
    assert_pools_free(engine)
