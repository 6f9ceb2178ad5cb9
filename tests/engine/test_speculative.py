"""Speculative decoding: greedy outputs identical to decoding without it (n-gram and MTP drafters, under
preemption and prefix caching), sampled outputs from the target's distribution, drafts withheld where the
next distribution depends on them, constrained requests verified against their grammar's draft chains, and
the acceptance counters."""

from __future__ import annotations

import re

import pytest
import torch

from g4serve import LLM, SamplingParams
from g4serve.engine.inputs import DeviceDrafts, gather_pending
from g4serve.engine.speculative import NgramProposer, SpeculativeConfig, verify
from g4serve.structured import StructuredSpec
from g4serve.structured.bitmask import AllowedTokenMasks

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
ENGINE = dict(device="cpu", text_only=True, kv_cache_bytes=16 << 20)
# Repetitive prompts: prompt lookup finds drafts, and a random model's greedy continuation often loops.
PROMPTS = [
    [30, 31, 32, 33, 34, 30, 31, 32, 33, 34, 30, 31, 32],
    [100, 200, 300, 100, 200, 300, 100, 200],
    list(range(40, 75)),
    [500, 501, 502, 503, 504, 505, 506, 507, 500, 501, 502],
]


def _tokens(llm: LLM, params: SamplingParams, prompts=PROMPTS) -> list[list[int]]:
    return [
        list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    ]


def test_verify_keeps_the_agreeing_prefix_and_one_target_token():
    assert verify([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]
    assert verify([5, 6, 7], [5, 9, 7, 8]) == [5, 9]
    assert verify([5, 6, 7], [4, 6, 7, 8]) == [4]
    assert verify([], [3]) == [3]


def test_ngram_lookup_takes_what_followed_the_latest_match():
    proposer = NgramProposer(SpeculativeConfig("ngram", num_speculative_tokens=3, prompt_lookup_max=3))
    assert proposer._lookup([1, 2, 3, 9, 1, 2, 3, 8, 7, 1, 2, 3], budget=5) == [8, 7, 1]
    assert proposer._lookup([1, 2, 3, 4], budget=5) == []
    assert proposer._lookup([4, 4, 4], budget=1) == [4]
    # a loop: the latest match has one token after it, an earlier one a full continuation
    assert proposer._lookup([7, 8, 7, 8, 7, 8, 7], budget=3) == [8, 7, 8]
    assert proposer._lookup([1, 2, 1, 2], budget=0) == []


@pytest.mark.parametrize(
    "raw,field",
    [
        ({"method": "eagle"}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "mtp"}, "model"),
        ({"method": "ngram", "extra": 1}, "extra"),
        ("{not json", "speculative_config"),
        ({"method": "ngram", "prompt_lookup_min": "2"}, "prompt_lookup_min"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
        ({"method": "mtp", "model": ["/a"]}, "model"),
        ({"method": "ngram", "forced_acceptance": 1.5}, "forced_acceptance"),
        ({"method": "ngram", "forced_acceptance": -0.1}, "forced_acceptance"),
        ({"method": "ngram", "forced_acceptance": "0.7"}, "forced_acceptance"),
        ({"method": "ngram", "forced_acceptance": True}, "forced_acceptance"),
        ({"method": "ngram", "forced_acceptance": float("nan")}, "forced_acceptance"),
    ],
)
def test_bad_configs_name_the_field(raw, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.parse(raw)


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    return LLM(tiny_model_dir, **ENGINE)


@pytest.fixture(scope="module")
def ngram(tiny_model_dir):
    return LLM(tiny_model_dir, speculative_config=NGRAM, **ENGINE)


def test_greedy_outputs_are_identical_with_ngram_drafts(plain, ngram):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = _tokens(plain, params)
    stats = ngram.engine.spec_stats
    before = sum(stats.accepted)
    assert _tokens(ngram, params) == want
    assert sum(stats.accepted) > before  # drafts were accepted, not only rejected
    assert sum(stats.drafted) > sum(stats.accepted)  # and some were rejected
    assert all(p.num_free == p.num_blocks for p in ngram.engine.kv.pools.values())


def test_stop_tokens_and_max_tokens_inside_accepted_drafts(plain, ngram):
    """An accepted draft that is a stop token ends the request there; max_tokens is never exceeded."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    loop = _tokens(plain, params)[0]
    stop = loop[10]
    stopped = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop])
    assert _tokens(ngram, stopped) == _tokens(plain, stopped)
    for n in (1, 2, 5, 7):
        short = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        got = _tokens(ngram, short)
        assert got == _tokens(plain, short) and all(len(t) == n for t in got)


def test_identical_under_preemption_and_prefix_hits(tiny_model_dir, plain, ngram):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want = _tokens(plain, params)
    small = LLM(
        tiny_model_dir, speculative_config=NGRAM, **{**ENGINE, "kv_cache_bytes": 96 << 10, "block_size": 4}
    )
    assert _tokens(small, params, PROMPTS * 2) == want * 2
    assert small.engine.scheduler.num_preemptions > 0
    # a prompt that extends an earlier request's prompt and output hits their blocks (drafts never cached)
    first = want[2]
    longer = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    again = ngram.generate([{"prompt_token_ids": PROMPTS[2] + first[:12]}], longer)[0]
    assert again.num_cached_tokens >= 32
    assert list(again.outputs[0].token_ids) == first[12:20]


def test_sampled_tokens_keep_the_target_distribution(plain, ngram):
    """Per position, the frequency of each token over many seeded requests agrees between decoding with and
    without drafts (top_k=2 keeps two outcomes, so 300 samples resolve their probability to ~0.03)."""
    prompt = {"prompt_token_ids": PROMPTS[1]}
    params = [
        SamplingParams(temperature=1.0, top_k=2, max_tokens=6, ignore_eos=True, seed=s) for s in range(300)
    ]

    def freqs(llm):
        outs = [list(o.outputs[0].token_ids) for o in llm.generate([prompt] * len(params), params)]
        return [torch.tensor([o[i] for o in outs]) for i in range(6)]

    base, spec = freqs(plain), freqs(ngram)
    accepted = sum(ngram.engine.spec_stats.accepted)
    for position in range(1, 4):  # the first token has no draft; later ones are verified drafts
        values = torch.cat([base[position], spec[position]]).unique()
        for v in values:
            p_base = (base[position] == v).float().mean()
            p_spec = (spec[position] == v).float().mean()
            sigma = max(float((p_base * (1 - p_base) * 2 / 300) ** 0.5), 0.01)
            assert abs(p_base - p_spec) < 4.5 * sigma, (position, int(v), float(p_base), float(p_spec))
    assert accepted > 0


def test_seeded_sampling_is_identical_with_and_without_drafts(plain, ngram):
    """A seeded request's noise is keyed by the output position it samples (kernels/philox.py), so a verified
    draft races on the same noise as the plain decode step at that position: the same tokens either way."""
    params = [
        SamplingParams(temperature=0.4, max_tokens=12, ignore_eos=True, seed=s, top_p=0.9) for s in range(4)
    ]
    prompts = [{"prompt_token_ids": PROMPTS[i % len(PROMPTS)]} for i in range(len(params))]
    accepted = sum(ngram.engine.spec_stats.accepted)
    want = [list(o.outputs[0].token_ids) for o in plain.generate(prompts, params)]
    assert [list(o.outputs[0].token_ids) for o in ngram.generate(prompts, params)] == want
    assert sum(ngram.engine.spec_stats.accepted) > accepted  # drafts were verified and taken


def test_requests_whose_distribution_depends_on_the_drafts_get_none(ngram):
    stats = ngram.engine.spec_stats
    before = sum(stats.drafted)
    penalized = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3)
    ngram.generate([{"prompt_token_ids": PROMPTS[0]}], penalized)
    waiting = SamplingParams(temperature=0, max_tokens=6, min_tokens=6)
    ngram.generate([{"prompt_token_ids": PROMPTS[1]}], waiting)
    assert sum(stats.drafted) == before


def test_mtp_drafter_greedy_outputs_are_identical(mtp_drafter):
    target, drafter = mtp_drafter
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = _tokens(LLM(target, **ENGINE), params)
    llm = LLM(
        target,
        speculative_config={"method": "mtp", "model": str(drafter), "num_speculative_tokens": 2},
        **ENGINE,
    )
    assert _tokens(llm, params) == want
    stats = llm.engine.spec_stats
    assert len(stats.drafted) == 2 and stats.drafted[0] > 0


def test_stale_drafts_never_reach_a_prefill(tiny_model_dir, plain):
    """Drafts belong to a decode's one known token: a request still prefilling (chunked, or recomputing after
    preemption) drops any it holds instead of verifying them against prompt rows."""
    llm = LLM(tiny_model_dir, speculative_config=NGRAM, max_num_batched_tokens=16, **ENGINE)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = PROMPTS[2]  # 35 tokens: three 16-token chunks
    request = engine.make_request("r", engine.process_prompt({"prompt_token_ids": prompt}), params)
    engine.add_request(request)
    engine.step()
    engine.step()
    assert request.num_tokens - request.num_computed_tokens == 3  # the last chunk, drafts would fit beside it
    request.draft_token_ids = [41, 42]  # as if proposed: the next step is still a prefill chunk
    out = engine.run_until_finished()["r"]
    assert list(out.outputs[0].token_ids) == _tokens(plain, params, [prompt])[0]


# ---- constrained decoding ------------------------------------------------------------------------------
REGEX = StructuredSpec.regex("(ab|cd|[a-z ]){4,40}")


def test_grammar_requests_speculate_and_stay_identical(plain, ngram):
    """Drafts of a constrained request are verified against masks of the grammar state they lead to: the
    greedy output is the one without drafts, and it still matches the grammar."""
    params = SamplingParams(temperature=0, max_tokens=24, structured_output=REGEX)
    prompts = ["abababab cdcdcd abab cd", "the the the the the"]
    want = [o.outputs[0].text for o in plain.generate(prompts, params)]
    stats = ngram.engine.spec_stats
    before = sum(stats.drafted), sum(stats.accepted)
    got = [o.outputs[0].text for o in ngram.generate(prompts, params)]
    assert got == want
    assert all(re.fullmatch("(ab|cd|[a-z ]){4,40}", text) for text in got)
    assert sum(stats.drafted) > before[0] and sum(stats.accepted) > before[1]


def test_draft_chain_masks_follow_the_drafts(ngram):
    """Row j of a verifying request gets the mask of its grammar after drafts 1..j; a refused draft leaves
    the rows after it unconstrained; the matcher ends where it started."""
    engine = ngram.engine
    matcher = engine.structured_backend.new_matcher(StructuredSpec.regex("[0-9]{2}x"))
    tok = engine.tokenizer
    digit, x = tok.encode("7", add_special_tokens=False)[0], tok.encode("x", add_special_tokens=False)[0]
    masks = AllowedTokenMasks(engine.model_config.text.vocab_size, "cpu")
    chain = masks([matcher] * 4, drafts=[digit, digit, x, None])
    alone = masks([matcher])[0]
    assert torch.equal(chain[0], alone) and matcher.num_accepted == 0
    assert chain[0, digit] and chain[1, digit] and not chain[1, x]
    assert chain[2, x] and not chain[2, digit]
    assert not chain[3, digit] and not chain[3, x]  # only the end: the grammar is complete
    refused = masks([matcher] * 3, drafts=[x, digit, None])
    assert torch.equal(refused[0], alone) and refused[1:].all() and matcher.num_accepted == 0


# ---- drafts left on the device -------------------------------------------------------------------------
def test_pending_sources_are_gathered_into_one_copy():
    """Input rows from two device sources (the previous step's samples and a drafting round) land in the
    step's ids in one index copy."""
    samples = torch.tensor([7, 8, 9])
    drafts = torch.tensor([[70, 71], [80, 81]])
    pending = gather_pending([(samples, [0], [2]), (drafts, [2, 3, 5], [2, 3, 1])])
    ids = torch.zeros(6, dtype=torch.long)
    pending.write_into(ids)
    assert ids.tolist() == [9, 0, 80, 81, 0, 71]
    assert gather_pending([(samples, [], [])]) is None


def test_mtp_drafts_stay_on_the_device_and_stale_ones_still_verify(mtp_drafter):
    """MTP rounds leave their drafts on the device: the verifying step reads them there, and the host learns
    them with that step's samples. With a token budget too small for every request's drafts, some requests
    skip a step and verify an older round's drafts later; greedy outputs stay those of plain decoding."""
    target, drafter = mtp_drafter
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    # Three short prompts prefill in one step and sample together; then two requests' 1 + 3 rows fill the
    # 8-token budget and the third waits with its round's drafts until they finish.
    prompts = [[30, 31], [100, 200], [500, 501]]
    want = _tokens(LLM(target, **ENGINE), params, prompts)
    spec = {"method": "mtp", "model": str(drafter), "num_speculative_tokens": 3}
    llm = LLM(target, speculative_config=spec, max_num_batched_tokens=8, **ENGINE)
    engine = llm.engine
    requests = [
        engine.make_request(f"r{i}", engine.process_prompt({"prompt_token_ids": p}), params)
        for i, p in enumerate(prompts)
    ]
    for request in requests:
        engine.add_request(request)
    rounds, verified, checked = [], [], []  # rounds proposed; (its round, the latest) per verification
    propose, prepare, accept = engine.proposer.propose, engine.runner.prepare, engine._accept_drafts

    def recording_propose(*args, **kwargs):
        rounds.append(propose(*args, **kwargs))
        return rounds[-1]

    def recording_prepare(batch, *args, **kwargs):
        for r in batch.requests:
            if r.draft_token_ids:
                verified.append((r.draft_source[0], rounds[-1]))
                r.expected_drafts = r.draft_source[0].tokens[r.draft_source[1], : len(r.draft_token_ids)]
        return prepare(batch, *args, **kwargs)

    def checking_accept(request, drafts, *args):
        # the host verifies the values the step read on the device, not the placeholders
        checked.append(drafts == request.expected_drafts[: len(drafts)].tolist())
        return accept(request, drafts, *args)

    engine.proposer.propose, engine.runner.prepare = recording_propose, recording_prepare
    engine._accept_drafts = checking_accept
    engine.run_until_finished()
    assert rounds and all(isinstance(r, DeviceDrafts) for r in rounds)
    assert any(mine is not latest for mine, latest in verified)  # a request verified an older round
    assert checked and all(checked)
    assert [list(r.output_token_ids) for r in requests] == want
    assert sum(engine.spec_stats.drafted) > 0


def test_mtp_with_a_grammar_request_in_the_batch_drafts_on_the_host(mtp_drafter):
    """A constrained request's drafts are cut by its grammar before the next step, so a round with one takes
    its drafts to the host; free requests beside it stay identical to plain decoding."""
    target, drafter = mtp_drafter
    free = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=10, structured_output=REGEX)
    prompts = [{"prompt_token_ids": PROMPTS[0]}, "abab cd ab"]
    plain_llm = LLM(target, **ENGINE)
    want = [o.outputs[0].token_ids for o in plain_llm.generate(prompts, [free, constrained])]
    spec = {"method": "mtp", "model": str(drafter), "num_speculative_tokens": 2}
    llm = LLM(target, speculative_config=spec, **ENGINE)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, [free, constrained])]
    assert [list(t) for t in got] == [list(t) for t in want]
    assert re.fullmatch("(ab|cd|[a-z ]){4,40}", llm.generate(prompts[1:], constrained)[0].outputs[0].text)


def test_warmup_runs_sampled_rows_and_leaves_no_trace(plain, monkeypatch):
    """``LLMEngine.warmup`` (run at start on CUDA) also takes sampled rows (noise, top-p, top-k, logprobs) so
    their kernels compile before the first client; afterwards the engine is as new: no requests, every KV
    block free, an empty prefix cache and zeroed counters, and greedy output unchanged."""
    from g4serve.layers import sampler

    engine = plain.engine
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = _tokens(plain, params)
    seen = []
    noise = sampler.exponential_noise
    monkeypatch.setattr(sampler, "exponential_noise", lambda *a: seen.append(a[0].tolist()) or noise(*a))
    engine.warmup()
    assert seen and all(0 in keys for keys in seen)  # sampled steps, the seeded row (seed 0) among them
    assert not engine.requests and engine.num_steps == 0 and engine.num_generated_tokens == 0
    assert all(p.num_free == p.num_blocks and not p.cached for p in engine.kv.pools.values())
    assert engine.kv.prefix_queries == 0
    assert _tokens(plain, params) == want
