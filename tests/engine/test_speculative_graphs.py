"""Speculative decoding through the CUDA-graph runners' padded steps: verification rows
(``VerifyGraphRunner``), hidden states for the MTP drafter from decode and mixed graphs, and whole drafting
rounds (``DraftGraphRunner``) give the greedy tokens of decoding without drafts; forced acceptance accepts
what it is told to.

On CPU the runners cannot capture, but they run exactly the padded forwards a graph replays (Triton kernels
in the interpreter); tests/gpu checks the captured replays.
"""

from __future__ import annotations

import pytest

from g4serve import LLM, SamplingParams

EAGER = dict(device="cpu", text_only=True, kv_cache_bytes=16 << 20, max_num_seqs=4)
ENGINE = dict(EAGER, attention_backend="triton")
PROMPTS = [
    [30, 31, 32, 33, 34, 30, 31, 32, 33, 34, 30, 31, 32],
    [100, 200, 300, 100, 200, 300, 100, 200],
    list(range(40, 75)),
]


def _tokens(llm: LLM, params: SamplingParams, prompts=PROMPTS) -> list[list[int]]:
    return [
        list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    ]


def _graphed(model_dir, speculative_config: dict) -> LLM:
    """An engine whose steps (and MTP rounds) all go through the graph runners' padded buffers."""
    llm = LLM(model_dir, speculative_config=speculative_config, **ENGINE)
    engine = llm.engine
    engine.runner.use_graphs(capture=False)
    proposer = engine.proposer
    if hasattr(proposer, "graphs"):
        proposer.graphs = engine.runner.draft_graphs(proposer.drafter, proposer.k, capture=False)
    return llm


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_verification_steps_through_the_padded_graph_match_plain_decoding(tiny_model_dir):
    want = _tokens(LLM(tiny_model_dir, **EAGER), GREEDY)
    llm = _graphed(tiny_model_dir, {"method": "ngram", "num_speculative_tokens": 3})
    runner = llm.engine.runner
    assert runner.verify_graphs.sizes == [2, 4, 8, 12, 16]  # up to 4 sequences x (1 + 3) rows
    assert _tokens(llm, GREEDY) == want
    assert runner.verify_graphs.num_runs > 0 and sum(llm.engine.spec_stats.accepted) > 0
    for pool in llm.engine.kv.pools.values():
        assert pool.num_free == pool.num_blocks


def test_mtp_rounds_and_hidden_states_from_the_padded_graphs_match_plain_decoding(mtp_drafter_ordered):
    target, drafter = mtp_drafter_ordered
    spec = {"method": "mtp", "model": str(drafter), "num_speculative_tokens": 2}
    eager = LLM(target, speculative_config=spec, **EAGER)
    want = _tokens(LLM(target, **EAGER), GREEDY)
    assert _tokens(eager, GREEDY) == want
    llm = _graphed(target, spec)
    engine = llm.engine
    assert _tokens(llm, GREEDY) == want
    # every step ran in a graph runner: the first decodes (hidden states from the mixed/decode graphs), then
    # verification; every drafting round ran in the draft runner, drafting what the eager rounds drafted
    runner = engine.runner
    assert runner.mixed_graphs.num_runs > 0 and runner.verify_graphs.num_runs > 0
    assert engine.proposer.graphs.num_runs == engine.proposer.num_graph_rounds > 0
    assert engine.spec_stats.drafted == eager.engine.spec_stats.drafted
    assert engine.spec_stats.accepted == eager.engine.spec_stats.accepted


@pytest.mark.parametrize("rate", [1.0, 0.0])
def test_forced_acceptance_accepts_as_told(mtp_drafter, rate):
    """Forced acceptance with the benchmarks' random drafter (1.0) and a checkpoint's (0.0)."""
    target, drafter = mtp_drafter
    model = "random" if rate == 1.0 else str(drafter)
    spec = {"method": "mtp", "model": model, "num_speculative_tokens": 3, "forced_acceptance": rate}
    llm = LLM(target, speculative_config=spec, **EAGER)
    params = SamplingParams(temperature=0, max_tokens=21, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert all(len(o.outputs[0].token_ids) == 21 for o in outs)
    stats = llm.engine.spec_stats
    assert stats.drafted[0] > 0
    if rate == 1.0:
        assert stats.accepted == stats.drafted  # every round takes all its drafts ...
        # ... so a request needs a prefill step and then one step per 4 tokens
        assert llm.engine.num_steps <= 1 + -(-20 // 4) + 1
    else:
        assert sum(stats.accepted) == 0
