"""Jump-forward decoding (``EngineConfig.jump_forward``) on the tiny random model: text the grammar forces
is appended at once and computed in one forward as a chunk. Outputs stay valid under their grammar, a
request takes one step per sampled token, the counts add up, KV blocks and the prefix cache stay exact
through aborts and faults mid-jump, and where the grammar forces single tokens greedy output is the
output of decoding them one by one."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest
import torch
from test_engine import assert_pools_free, make_engine  # tests/engine is on sys.path

from g4serve.engine.async_engine import AsyncLLMEngine
from g4serve.engine.engine import LLMEngine
from g4serve.llm import LLM
from g4serve.sampling_params import SamplingParams
from g4serve.structured import StructuredMatcher, StructuredSpec

# The shape of the assistant's compact extraction: an enum, a nullable enum, a nullable bounded string.
SCHEMA = {
    "type": "object",
    "properties": {
        "intent": {"enum": ["transfer_money", "bill_payment", "card_lock", "card_unlock", "balance"]},
        "candidate": {"enum": ["c1", "c2", None]},
        "amount_words": {"anyOf": [{"type": "string", "pattern": "^[a-z ]{1,12}$"}, {"type": "null"}]},
    },
    "required": ["intent", "candidate", "amount_words"],
    "additionalProperties": False,
}
# Every literal here is spelled by single-character tokens of the tiny vocabulary that no longer token
# starts with, and every choice is one character: where the grammar forces text, it forces one token.
SINGLE_TOKEN_GRAMMAR = """
root ::= "{" pair ";" pair ";" pair "}#|#"
pair ::= [a-e] "=" [0-9]
"""
PROMPTS = [
    "<|turn>user\nDescribe the customer as JSON.<turn|>\n<|turn>model\n",
    "<|turn>user\nsend fifty to jon<turn|>\n<|turn>model\n",
    "<|turn>user\nlock my card please<turn|>\n<|turn>model\n",
]


def _spec() -> StructuredSpec:
    return StructuredSpec.json_schema(SCHEMA)


def _params(seed: int | None = None, **kw) -> SamplingParams:
    args = {"temperature": 0.0} if seed is None else {"temperature": 1.0, "seed": seed}
    return SamplingParams(**{**args, "max_tokens": 200, "structured_output": _spec(), **kw})


def _run(engine: LLMEngine, requests: dict[str, tuple[str, SamplingParams]]) -> dict:
    for rid, (prompt, params) in requests.items():
        engine.add_request(engine.make_request(rid, engine.process_prompt(prompt), params))
    return {rid: out.outputs[0] for rid, out in engine.run_until_finished().items()}


@pytest.fixture(scope="module")
def jf_engine(tiny_model_dir) -> LLMEngine:
    return make_engine(tiny_model_dir, jump_forward=True, text_only=True)


@pytest.fixture(scope="module")
def plain_engine(tiny_model_dir) -> LLMEngine:
    return make_engine(tiny_model_dir, text_only=True)


def _scheduled_tokens(engine: LLMEngine) -> list[list[int]]:
    """Record each step's scheduled token counts (per request) as the engine runs."""
    steps: list[list[int]] = []
    original = engine.runner.execute

    def execute(batch, *args, **kwargs):
        steps.append(list(batch.num_new_tokens))
        return original(batch, *args, **kwargs)

    engine.runner.execute = execute
    return steps


def test_outputs_valid_one_step_per_sampled_token(tiny_model_dir):
    """Alone in the engine, a request takes one step per sampled token (its prompt fits one step): forced
    tokens cost no forward. Each token is computed once, a jump's tokens in one chunk; the last jump, which
    the grammar's forced end closes, is never computed."""
    engine = make_engine(tiny_model_dir, jump_forward=True, text_only=True, enable_prefix_caching=False)
    steps = _scheduled_tokens(engine)
    for seed in range(6):
        steps.clear()
        engine.num_steps = 0
        prompt = PROMPTS[seed % len(PROMPTS)]
        request = engine.make_request(f"r{seed}", engine.process_prompt(prompt), _params(seed))
        engine.add_request(request)
        out = engine.run_until_finished()[f"r{seed}"].outputs[0]
        jsonschema.validate(json.loads(out.text), SCHEMA)
        assert out.finish_reason == "stop" and out.token_ids[-1] in engine.model_config.text.eos_token_ids
        assert out.num_forced_tokens > out.num_decoded_tokens > 0
        assert out.num_forced_tokens + out.num_decoded_tokens == len(out.token_ids)
        assert engine.num_steps == len(steps) == out.num_decoded_tokens
        computed = sum(n for step in steps for n in step)
        assert computed == request.num_computed_tokens
        last_jump = len(request.prompt_token_ids) + len(out.token_ids) - computed
        assert 1 <= last_jump <= out.num_forced_tokens + 1
        assert max(n for step in steps[1:] for n in step) > 1, "a jump was computed as one chunk"
    assert_pools_free(engine)


def test_batch_of_samples_valid_and_counts_add_up(jf_engine, plain_engine):
    before = jf_engine.stats()
    requests = {f"s{seed}": (PROMPTS[seed % 3], _params(seed)) for seed in range(16)}
    requests["greedy"] = (PROMPTS[0], _params())
    digits = StructuredSpec.regex("[0-9]{1,6}( ok)?")  # the model may end it, or go on
    for seed in range(8):
        requests[f"re{seed}"] = (PROMPTS[seed % 3], _params(seed, structured_output=digits))
    requests["free"] = (PROMPTS[1], SamplingParams(temperature=0, max_tokens=12))  # shares the steps
    results = _run(jf_engine, requests)
    alone = _run(plain_engine, {"free": requests["free"]})["free"]
    assert results["free"].token_ids == alone.token_ids and results["free"].num_forced_tokens == 0
    constrained = [out for rid, out in results.items() if rid != "free"]
    for rid, out in results.items():
        if rid.startswith("re"):
            assert re.fullmatch("[0-9]{1,6}( ok)?", out.text), out.text
        elif rid != "free":
            jsonschema.validate(json.loads(out.text), SCHEMA)
    for out in constrained:
        assert out.finish_reason == "stop"
        assert out.text == jf_engine.tokenizer.decode(out.token_ids[:-1], skip_special_tokens=True)
    after = jf_engine.stats()
    forced = sum(out.num_forced_tokens for out in constrained)
    produced = sum(len(out.token_ids) for out in results.values())
    assert after["forced_tokens_total"] - before["forced_tokens_total"] == forced > 0
    assert after["generation_tokens_total"] - before["generation_tokens_total"] == produced
    assert_pools_free(jf_engine)


def _allowed_counts(matcher: StructuredMatcher, tokens: list[int], banned: set[int]) -> list[int]:
    """How many tokens, ``banned`` ones aside, the grammar allowed before each of ``tokens``."""
    vocab = matcher.vocab.vocab_size
    keep = torch.ones(vocab, dtype=torch.bool)
    keep[sorted(banned)] = False
    counts = []
    for token in tokens:
        bitmask = torch.empty(1, (vocab + 31) // 32, dtype=torch.int32)
        matcher._matcher.fill_next_token_bitmask(bitmask, 0)
        bits = ((bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab]
        counts.append(int((bits.bool() & keep).sum()))
        assert matcher.accept_token(token)
    return counts


def _single_token_params(tokenizer) -> SamplingParams:
    """Greedy over SINGLE_TOKEN_GRAMMAR with the byte-fallback spellings banned (logit bias -100): the tiny
    vocabulary spells every character as a byte token too, which the random model sometimes prefers; with
    them out, where the grammar forces text exactly one token may come next."""
    bias = {t: -100.0 for t in tokenizer.byte_token_ids}
    spec = StructuredSpec.grammar(SINGLE_TOKEN_GRAMMAR)
    return SamplingParams(temperature=0, max_tokens=40, structured_output=spec, logit_bias=bias)


def test_greedy_equals_decoding_where_the_grammar_forces_single_tokens(jf_engine, plain_engine):
    params = _single_token_params(jf_engine.tokenizer)
    requests = {str(i): (p, params) for i, p in enumerate(PROMPTS)}
    plain, jumped = _run(plain_engine, requests), _run(jf_engine, requests)
    eos = jf_engine.model_config.text.eos_token_ids
    banned = set(jf_engine.tokenizer.byte_token_ids)
    for rid in requests:
        a, b = plain[rid], jumped[rid]
        assert b.text == a.text and b.finish_reason == a.finish_reason == "stop"
        # The one freedom a forced end leaves: which stop id. Jump-forward takes the first one allowed.
        assert b.token_ids[:-1] == a.token_ids[:-1] and a.token_ids[-1] in eos and b.token_ids[-1] == eos[0]
        matcher = jf_engine.structured_backend.new_matcher(params.structured_output)
        counts = _allowed_counts(matcher, a.token_ids, banned)
        assert counts[-1] == len(eos)  # the grammar's end: only the stop tokens
        single = sum(c == 1 for c in counts[:-1])
        assert single == 10  # "{", 3 x "=", 2 x ";", "}", "#", "|", "#": every forced character
        assert (b.num_forced_tokens, b.num_decoded_tokens) == (single + 1, 6)  # + the stop token
        assert a.num_forced_tokens == 0


def test_max_tokens_counts_forced_tokens(jf_engine):
    """Forced tokens count toward max_tokens: the jump at admission leaves one token to the model, later
    jumps are cut at the budget, and the request ends by length with exactly max_tokens tokens."""
    for max_tokens in (1, 3, 9, 14, 20):
        out = _run(jf_engine, {"cut": (PROMPTS[0], _params(max_tokens=max_tokens))})["cut"]
        assert len(out.token_ids) <= max_tokens
        if out.finish_reason == "length":
            assert len(out.token_ids) == max_tokens
        assert out.num_decoded_tokens >= 1 and out.num_forced_tokens + out.num_decoded_tokens == len(
            out.token_ids
        )
    out = _run(jf_engine, {"cut": (PROMPTS[0], _params(max_tokens=3))})["cut"]
    assert (out.finish_reason, out.num_forced_tokens, out.num_decoded_tokens) == ("length", 2, 1)
    assert_pools_free(jf_engine)


def test_stop_string_inside_forced_text(jf_engine):
    """A stop string met inside forced text ends the request there, as it would have decoded; a request
    with stop strings takes its first jump after its first sample."""
    out = _run(jf_engine, {"stop": (PROMPTS[0], _params(stop=["didate"]))})["stop"]
    assert out.finish_reason == "stop" and out.stop_reason == "didate"
    assert out.text.startswith('{"intent": "') and out.text.endswith(', "can')
    assert out.num_forced_tokens > 0
    assert_pools_free(jf_engine)


def test_logprobs_requests_decode_every_token(jf_engine):
    out = _run(jf_engine, {"lp": (PROMPTS[0], _params(logprobs=2))})["lp"]
    jsonschema.validate(json.loads(out.text), SCHEMA)
    assert out.num_forced_tokens == 0 and len(out.logprobs) == len(out.token_ids)


def test_prefix_cache_reuses_forced_tokens(tiny_model_dir):
    """Text forced at admission is part of the known tokens, hashed like the prompt: an identical greedy
    request finds the blocks the first one computed, past its prompt (this prompt's last block is completed
    by the forced text), and outputs the same tokens. Usage counts only the prompt's part of the hit."""
    engine = make_engine(tiny_model_dir, jump_forward=True, text_only=True)
    prompt = "<|turn>user\nDescribe the customer please please as JSON.<turn|>\n<|turn>model\n"
    first = _run(engine, {"a": (prompt, _params())})["a"]
    prompt_len = len(engine.process_prompt(prompt).token_ids)
    request = engine.make_request("b", engine.process_prompt(prompt), _params())
    engine.add_request(request)
    known = request.num_tokens  # prompt + the text forced at admission
    bs = engine.config.block_size
    assert (known - 1) // bs * bs > prompt_len  # a full block ends inside the forced text
    second = engine.run_until_finished()["b"]
    assert second.metrics.prefix_hit_tokens == (known - 1) // bs * bs
    assert second.num_cached_tokens == prompt_len
    assert second.outputs[0].token_ids == first.token_ids
    assert_pools_free(engine)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_abort_mid_jump_frees_every_block(tiny_model_dir, async_scheduling):
    """Aborted with its forced tokens scheduled (sync) or in flight as a chunk (async): its blocks return."""
    engine = make_engine(tiny_model_dir, jump_forward=True, text_only=True, async_scheduling=async_scheduling)
    request = engine.make_request("r", engine.process_prompt(PROMPTS[0]), _params(seed=3))
    engine.add_request(request)
    steps = _scheduled_tokens(engine)
    while not (len(steps) > 1 and max(steps[-1]) > 1):  # until a jump's chunk has been launched
        engine.step()
        assert len(steps) < 50
    assert any(pool.num_used for pool in engine.kv.pools.values())
    engine.abort_request("r")
    assert request.finish_reason == "abort"
    while engine.has_unfinished_requests():
        engine.step()
    engine.kv.reset_prefix_cache()
    assert_pools_free(engine)


class Fault(RuntimeError):
    pass


@pytest.mark.parametrize("point", ["jump", "forward"])
def test_fault_mid_jump_fails_its_request_alone(tiny_model_dir, monkeypatch, point):
    """A fault while planning a jump fails that request alone; a fault in the forward of a step that
    computes a jump's chunk fails that step's requests. Every block comes back and the engine then
    serves exactly as before."""
    engine = make_engine(tiny_model_dir, jump_forward=True, text_only=True)
    requests = {f"r{i}": (PROMPTS[i], _params()) for i in range(3)}
    expected = _run(make_engine(tiny_model_dir, jump_forward=True, text_only=True), requests)
    if point == "jump":
        original = StructuredMatcher.jump_forward
        calls = {"n": 0}

        def jump_forward(self, sampled, budget):
            if sampled is not None:
                calls["n"] += 1
                if calls["n"] == 4:
                    raise Fault("injected fault in jump_forward")
            return original(self, sampled, budget)

        monkeypatch.setattr(StructuredMatcher, "jump_forward", jump_forward)
    else:
        steps = _scheduled_tokens(engine)
        inner = engine.runner.forward

        def forward(step):
            if len(steps) > 1 and max(steps[-1]) > 1 and not getattr(forward, "fired", False):
                forward.fired = True
                raise Fault("injected fault in forward")
            return inner(step)

        engine.runner.forward = forward
    results = _run(engine, requests)
    failed = {rid for rid, out in results.items() if out.finish_reason == "error"}
    assert failed and (len(failed) == 1 or point == "forward")
    for rid in set(requests) - failed:
        assert results[rid].token_ids == expected[rid].token_ids
    engine.kv.reset_prefix_cache()
    assert_pools_free(engine)
    monkeypatch.undo()
    again = _run(engine, requests)
    assert {rid: out.token_ids for rid, out in again.items()} == {
        rid: out.token_ids for rid, out in expected.items()
    }


def test_n_choices_jump_independently(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), device="cpu", dtype="float32", kv_cache_bytes=16 << 20, jump_forward=True)
    (result,) = llm.generate(PROMPTS[1], _params(seed=5, n=4))
    assert len(result.outputs) == 4
    texts = set()
    for i, out in enumerate(result.outputs):
        assert out.index == i
        jsonschema.validate(json.loads(out.text), SCHEMA)
        assert out.num_forced_tokens > 0 and out.num_forced_tokens + out.num_decoded_tokens == len(
            out.token_ids
        )
        texts.add(out.text)
    assert len(texts) > 1  # each choice samples its own way


def test_stream_carries_the_counts(tiny_model_dir):
    """Through AsyncLLMEngine: the streamed text adds up to the output, and the last delta holds the
    request's forced and decoded counts."""
    engine = AsyncLLMEngine(make_engine(tiny_model_dir, jump_forward=True, text_only=True))

    async def main():
        processed = await engine.process(PROMPTS[2])
        pieces, last = [], None
        async for delta in engine.generate(processed, _params(seed=1)):
            pieces.append(delta.text)
            last = delta
        return "".join(pieces), last

    try:
        text, last = asyncio.run(main())
    finally:
        engine.shutdown()
    jsonschema.validate(json.loads(text), SCHEMA)
    assert last.finished and last.num_forced_tokens > 0
    assert last.num_forced_tokens + last.num_decoded_tokens == last.num_output_tokens


def test_padded_graph_steps_match_eager(tiny_model_dir):
    """Jump chunks go through the mixed runner's padded buffers (what a CUDA graph replays), decodes through
    the decode runner's; greedy outputs equal the eager engine's."""

    def engine_with(backend: str) -> LLMEngine:
        return make_engine(
            tiny_model_dir,
            jump_forward=True,
            text_only=True,
            attention_backend=backend,
            max_num_seqs=4,
            max_num_batched_tokens=64,
        )

    requests = {str(i): (p, _params()) for i, p in enumerate(PROMPTS)}
    requests["free"] = (PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    expected = _run(engine_with("torch"), requests)
    engine = engine_with("triton")
    engine.runner.use_graphs(capture=False)
    got = _run(engine, requests)
    assert {r: o.token_ids for r, o in got.items()} == {r: o.token_ids for r, o in expected.items()}
    assert engine.runner.num_graph_steps == engine.num_steps
    assert_pools_free(engine)


@pytest.mark.gpu
def test_cuda_graphs_jump_forward(tiny_model_dir):
    """On CUDA with captured graphs (float32, so that greedy choices do not flip on rounding): valid outputs,
    one step per sampled token, every step a graph replay, and greedy equality with decoding where the
    grammar forces single tokens."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    jumped = make_engine(tiny_model_dir, device="cuda", jump_forward=True, text_only=True)
    plain = make_engine(tiny_model_dir, device="cuda", text_only=True)
    assert jumped.runner.decode_graphs is not None and jumped.runner.mixed_graphs is not None
    params = _single_token_params(jumped.tokenizer)
    requests = {str(i): (p, params) for i, p in enumerate(PROMPTS)}
    a, b = _run(plain, requests), _run(jumped, requests)
    for rid in requests:
        assert b[rid].text == a[rid].text and b[rid].token_ids[:-1] == a[rid].token_ids[:-1]
        assert b[rid].num_decoded_tokens == 6
    for seed in range(4):
        jumped.num_steps = jumped.runner.num_graph_steps = 0
        out = _run(jumped, {"s": (PROMPTS[seed % 3], _params(seed))})["s"]
        jsonschema.validate(json.loads(out.text), SCHEMA)
        assert jumped.num_steps == out.num_decoded_tokens < len(out.token_ids)
        assert jumped.runner.num_graph_steps == jumped.num_steps
    jumped.kv.reset_prefix_cache()
    assert_pools_free(jumped)
