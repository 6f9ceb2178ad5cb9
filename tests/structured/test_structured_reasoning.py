"""Structured output after Gemma 4's thought channel, and the reasoning budget (structured/reasoning.py), in
the engine on the tiny random model (CPU fp32). The random weights seldom open or close the channel on their
own: a logit bias opens it, and the budget (or max_tokens) closes it."""

from __future__ import annotations

import json
from dataclasses import replace

import jsonschema
import pytest
import torch

from g4serve.sampling_params import SamplingParams, SamplingParamsError
from g4serve.structured import StructuredSpec
from g4serve.structured.reasoning import ANSWER, START, THOUGHT, ThoughtGate, reasoning_token_count
from tests.structured.test_structured_engine import SCHEMA, assert_pools_free, make_engine

THINKING_PROMPT = (
    "<|turn>system\n<|think|>\n<turn|>\n<|turn>user\nDescribe the customer as JSON.<turn|>\n<|turn>model\n"
)


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "jump-forward"])
def engine(request, tiny_model_dir):
    return make_engine(tiny_model_dir, jump_forward=request.param)


def _allowed(gate: ThoughtGate, vocab_size: int, budget: int | None = None) -> set[int]:
    bitmask = torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32)
    gate.fill_allowed(bitmask, 0, True, budget)
    bits = (bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return set(torch.nonzero(bits.flatten()).flatten().tolist()) & set(range(vocab_size))


def _run(engine, params: SamplingParams, rid: str, prompt: str = THINKING_PROMPT):
    return _run_all(engine, {rid: params}, prompt)[rid]


def _run_all(engine, requests: dict[str, SamplingParams], prompt: str = THINKING_PROMPT) -> dict:
    """Run the requests as one batch; their outputs by id."""
    for rid, params in requests.items():
        engine.add_request(engine.make_request(rid, engine.process_prompt(prompt), params))
    return {rid: out.outputs[0] for rid, out in engine.run_until_finished().items()}


def _split(engine, token_ids: list[int]) -> tuple[list[int], list[int], list[int]]:
    """(tokens before the thought, the thought's tokens between its markers, the tokens after it)."""
    markers = engine.thought_markers
    start, end = token_ids.index(markers.open_id), token_ids.index(markers.close_id)
    return token_ids[:start], token_ids[start + 1 : end], token_ids[end + 1 :]


def test_gate_states_and_masks(engine):
    backend = engine.structured_backend
    markers, vocab = engine.thought_markers, backend.vocab_size
    spec = StructuredSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    gate = ThoughtGate(markers, backend.new_matcher(spec), max_reasoning_tokens=2)
    plain = _allowed(ThoughtGate(markers, backend.new_matcher(spec)), vocab)  # same start, for comparison
    brace = engine.tokenizer.encode("{", add_special_tokens=False)[0]
    start = _allowed(gate, vocab)
    assert markers.open_id in start and brace in start and start == plain
    assert markers.close_id not in start and not set(backend.stop_token_ids) & start
    assert gate.accept_token(markers.open_id) and gate.state == THOUGHT
    thought = _allowed(gate, vocab)
    # Free but for the stop tokens (the answer must come) and a nested opening marker.
    assert thought == set(range(vocab)) - set(backend.stop_token_ids) - {markers.open_id}
    assert gate.accept_token(brace) and gate.accept_token(brace) and gate.num_reasoning_tokens == 2
    assert _allowed(gate, vocab) == {markers.close_id}  # the budget is spent
    assert gate.accept_token(markers.close_id) and gate.state == ANSWER
    assert brace in _allowed(gate, vocab) and markers.open_id not in _allowed(gate, vocab)
    assert not gate.accept_token(markers.open_id)  # the grammar, from its root
    assert gate.accept_token(brace) and not gate.is_completed()
    gate.rollback(3)
    assert (gate.state, gate.num_reasoning_tokens, gate.num_accepted) == (THOUGHT, 1, 2)
    assert gate.accept_token(brace) and _allowed(gate, vocab) == {markers.close_id}
    # Without a grammar: free at the start, the budget alone; after the thought no second one opens.
    free = ThoughtGate(markers, None, max_reasoning_tokens=1)
    assert _allowed(free, vocab) == set(range(vocab)) and free.accept_token(brace) and free.state == START
    assert free.accept_token(markers.open_id) and free.accept_token(brace)
    assert _allowed(free, vocab) == {markers.close_id}
    assert free.accept_token(markers.close_id) and _allowed(free, vocab) == set(range(vocab)) - {
        markers.open_id
    }


def test_json_schema_with_thinking_reasons_then_answers_once(engine):
    """vllm#54881 / #50938: with thinking on, a json_schema request skipped its reasoning and repeated the
    JSON. Here the thought comes first, closed at the budget, and the answer is one JSON value under the
    schema."""
    markers = engine.thought_markers
    spec = StructuredSpec.json_schema(SCHEMA)
    params = SamplingParams(
        temperature=1.0,
        max_tokens=300,
        structured_output=spec,
        thinking=True,
        max_reasoning_tokens=8,
        logit_bias={markers.open_id: 100.0},
        skip_special_tokens=False,
    )
    outs = _run_all(engine, {f"think{seed}": replace(params, seed=seed) for seed in range(6)})
    assert len({out.text for out in outs.values()}) == 6  # really sampled
    for out in outs.values():
        before, thought, answer = _split(engine, out.token_ids)
        assert before == [] and len(thought) == 8
        assert out.finish_reason == "stop" and answer[-1] in engine.model_config.text.eos_token_ids
        text = engine.tokenizer.decode(answer[:-1], skip_special_tokens=False)
        jsonschema.validate(json.loads(text), SCHEMA)  # one value: json.loads refuses a repeated one
        assert out.text.endswith("<channel|>" + text)
        assert reasoning_token_count(out.token_ids, markers) == 10
    assert_pools_free(engine)


def test_thought_closes_while_the_answer_still_fits(engine):
    """No budget, a model that would think forever: the channel closes early enough for the JSON to complete
    within max_tokens."""
    markers = engine.thought_markers
    budgets = {0: 150, 1: 175}  # the shortest JSON under SCHEMA is 109 tokens
    requests = {
        seed: SamplingParams(
            temperature=1.0,
            seed=seed,
            max_tokens=max_tokens,
            structured_output=StructuredSpec.json_schema(SCHEMA),
            thinking=True,
            logit_bias={markers.open_id: 100.0},
        )
        for seed, max_tokens in budgets.items()
    }
    outs = _run_all(engine, {f"fit{seed}": params for seed, params in requests.items()})
    for seed, max_tokens in budgets.items():
        out = outs[f"fit{seed}"]
        _, thought, answer = _split(engine, out.token_ids)
        assert out.finish_reason == "stop" and len(out.token_ids) <= max_tokens and len(thought) > 0
        jsonschema.validate(json.loads(engine.tokenizer.decode(answer[:-1])), SCHEMA)


def test_thinking_model_may_answer_at_once(engine):
    """The channel is optional: an answer that starts with the JSON is constrained from its first token."""
    params = SamplingParams(
        temperature=1.0,
        seed=3,
        max_tokens=200,
        structured_output=StructuredSpec.json_schema(SCHEMA),
        thinking=True,
        logit_bias={engine.thought_markers.open_id: -100.0},
    )
    out = _run(engine, params, "direct")
    assert engine.thought_markers.open_id not in out.token_ids and out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), SCHEMA)


def test_budget_without_a_grammar(engine):
    markers = engine.thought_markers
    params = SamplingParams(
        temperature=1.0,
        seed=0,
        max_tokens=24,
        ignore_eos=True,
        max_reasoning_tokens=5,
        logit_bias={markers.open_id: 100.0},
    )
    out = _run(engine, params, "free-budget")
    assert len(out.token_ids) == 24 and out.finish_reason == "length"
    before, thought, after = _split(engine, out.token_ids)
    assert before == [] and len(thought) == 5 and markers.open_id not in after
    assert reasoning_token_count(out.token_ids, markers) == 7
    # Without thinking or a budget, nothing is gated: the bias opens channel after channel.
    out = _run(
        engine,
        SamplingParams(temperature=1.0, seed=0, max_tokens=6, logit_bias={markers.open_id: 100.0}),
        "x",
    )
    assert out.token_ids.count(markers.open_id) == 6


def test_abort_mid_thought_frees_every_block(engine):
    params = SamplingParams(
        temperature=1.0,
        seed=0,
        max_tokens=300,
        structured_output=StructuredSpec.json_schema(SCHEMA),
        thinking=True,
        max_reasoning_tokens=200,
        logit_bias={engine.thought_markers.open_id: 100.0},
    )
    engine.add_request(engine.make_request("abort-thought", engine.process_prompt(THINKING_PROMPT), params))
    for _ in range(5):
        engine.step()
    request = engine.requests["abort-thought"]
    assert request.grammar.state == THOUGHT and not request.finished
    engine.abort_request("abort-thought")
    assert not engine.has_unfinished_requests() and not engine.requests
    assert_pools_free(engine)


@pytest.mark.parametrize("bad", [-1, 2**31, 1.5, "8", True])
def test_max_reasoning_tokens_is_validated(bad):
    with pytest.raises(SamplingParamsError, match="^max_reasoning_tokens: "):
        SamplingParams(max_reasoning_tokens=bad)
