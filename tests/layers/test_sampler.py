"""The sampler's filters against transformers' logits warpers (temperature, top-k, top-p, min-p, in
transformers' order), on both of its top-k paths, and its draws against the filtered distribution."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from g4serve.layers import sampler
from g4serve.layers.sampler import SamplingBatch, TokenCounts, _top_k_top_p_min_p, sample
from g4serve.sampling_params import SamplingParams

VOCAB = 512


def _hf_filtered(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    scores = logits.unsqueeze(0)
    ids = torch.zeros(1, 1, dtype=torch.long)
    scores = TemperatureLogitsWarper(p.temperature)(ids, scores)
    if p.top_k > 0:
        scores = TopKLogitsWarper(p.top_k)(ids, scores)
    if p.top_p < 1:
        scores = TopPLogitsWarper(p.top_p)(ids, scores)
    if p.min_p > 0:
        scores = MinPLogitsWarper(p.min_p)(ids, scores)
    return scores[0]


ROWS = [
    SamplingParams(temperature=0.7, top_k=40),
    SamplingParams(temperature=1.0, top_p=0.9),
    SamplingParams(temperature=1.3, top_k=50, top_p=0.8),  # top-p over the top-k renormalised
    SamplingParams(temperature=0.9, top_k=8, top_p=0.95, min_p=0.05),
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=2.0, top_k=300, top_p=0.5),
]


def _filtered(rows: list[SamplingParams], logits: torch.Tensor) -> torch.Tensor:
    batch = SamplingBatch.build(rows, [None] * len(rows), VOCAB, "cpu")
    temp = batch.temperature.unsqueeze(1)
    return _top_k_top_p_min_p(logits / temp, batch)


@pytest.mark.parametrize("candidates", [True, False], ids=["topk-candidates", "full-sort"])
def test_filters_match_transformers_warpers(candidates, monkeypatch):
    if not candidates:
        monkeypatch.setattr(sampler, "MAX_TOPK_CANDIDATES", 0)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(ROWS), VOCAB, generator=gen) * 3
    # Every row sets top-k in this batch (the candidate path); the mixed batch below takes the full sort.
    rows = [r for r in ROWS if r.top_k > 0]
    batches = [(rows, logits[: len(rows)]), (ROWS, logits)]
    for batch_rows, batch_logits in batches:
        got = _filtered(batch_rows, batch_logits)
        for row, (p, row_logits) in enumerate(zip(batch_rows, batch_logits)):
            want = _hf_filtered(row_logits, p)
            assert torch.equal(torch.isfinite(got[row]), torch.isfinite(want)), p
            torch.testing.assert_close(got[row].softmax(-1), want.softmax(-1))


def test_candidate_path_used_only_when_every_sampled_row_sets_top_k():
    build = lambda rows: SamplingBatch.build(rows, [None] * len(rows), VOCAB, "cpu")  # noqa: E731
    assert (
        build([SamplingParams(temperature=1, top_k=40), SamplingParams(temperature=1, top_k=7)]).max_top_k
        == 40
    )
    greedy = SamplingParams(temperature=0)  # takes the argmax whatever the filters say
    assert build([SamplingParams(temperature=1, top_k=40), greedy]).max_top_k == 40
    assert (
        build([SamplingParams(temperature=1, top_k=40), SamplingParams(temperature=1, top_p=0.9)]).max_top_k
        is None
    )


def test_candidate_race_draws_what_the_whole_row_draws(monkeypatch):
    """With top-k candidates the race runs over them alone: the same token, on the same noise, as masking
    the whole vocabulary and racing over it (top-k alone, with top-p, with min-p)."""
    from g4serve.layers.sampler import _race

    rows = [
        SamplingParams(temperature=1.0, top_k=40),
        SamplingParams(temperature=0.7, top_k=300, top_p=0.8),
        SamplingParams(temperature=1.0, top_k=8, top_p=0.95, min_p=0.05),
        SamplingParams(temperature=0, top_k=5),
    ]
    batch = SamplingBatch.build(rows, [None] * len(rows), VOCAB, "cpu")
    assert batch.max_top_k == 300
    gen = torch.Generator().manual_seed(4)
    for trial in range(8):
        scaled = (
            torch.randn(len(rows), VOCAB, generator=gen)
            * (1 + trial)
            / batch.temperature.clamp(min=1).unsqueeze(1)
        )
        noise = torch.empty(len(rows), VOCAB).exponential_(generator=gen)
        on_candidates = _race(scaled, batch, noise)
        monkeypatch.setattr(sampler, "MAX_TOPK_CANDIDATES", 0)
        whole_row = _race(scaled, batch, noise)
        monkeypatch.undo()
        assert torch.equal(on_candidates, whole_row), trial


@pytest.mark.parametrize("sort_free_top_k", [False, True])
def test_cuda_batches_take_the_sort_free_kernel_where_switched_on(sort_free_top_k, monkeypatch):
    """``sample`` on CUDA-looking rows (the kernel runs in Triton's interpreter on these CPU tensors): a batch
    with top-k takes the sort-free kernel only with G4SERVE_SORT_FREE_TOP_K, and either way draws the tokens
    the torch filters and race draw from the same seeds."""
    import g4serve.kernels.top_p_sample as kernel

    rows = [
        SamplingParams(temperature=1.0, top_k=40, top_p=0.9, seed=1),
        SamplingParams(temperature=0.7, top_k=3, seed=2),
        SamplingParams(temperature=1.0, top_p=0.8, seed=3),
        SamplingParams(temperature=0, seed=4),
    ]
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(5)) * 2
    batch = SamplingBatch.build(rows, [None] * len(rows), VOCAB, "cpu")
    want = sample(logits, batch).token_ids
    calls = []
    real = kernel.top_p_sample
    monkeypatch.setattr(sampler, "top_p_sample", lambda *a, **k: calls.append(k["top_k"]) or real(*a, **k))
    monkeypatch.setattr(sampler, "SORT_FREE_TOP_K", sort_free_top_k)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert torch.equal(sample(logits, batch).token_ids, want)
    assert len(calls) == (1 if sort_free_top_k else 0)
    assert not sort_free_top_k or torch.equal(calls[0], batch.top_k)


def test_draws_follow_the_filtered_distribution():
    """Many seeded draws of one row: frequencies within 4 sigma of the filtered probabilities, nothing
    outside the kept set."""
    gen = torch.Generator().manual_seed(1)
    row = torch.randn(VOCAB, generator=gen) * 2
    p = SamplingParams(temperature=0.8, top_k=12, top_p=0.9)
    n = 4000
    logits = row.expand(n, VOCAB).clone()
    batch = SamplingBatch.build([p] * n, [None] * n, VOCAB, "cpu")
    torch.manual_seed(2)
    tokens = sample(logits, batch).token_ids
    probs = _hf_filtered(row, p).softmax(-1)
    counts = torch.bincount(tokens, minlength=VOCAB).double() / n
    assert (counts[probs == 0] == 0).all()
    sigma = (probs * (1 - probs) / n).sqrt()
    assert ((counts - probs).abs() <= 4 * sigma + 1e-9).all()


def test_penalties_count_repeated_tokens_per_row():
    """Repetition penalty on every token seen in the prompt or the output (transformers' processor over
    prompt + output ids), frequency penalty times each output token's count, presence penalty once per
    output token: the batch's counts and prompt mask are built from all rows' tokens in one copy."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    from g4serve.layers.sampler import _apply_penalties

    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, VOCAB, generator=gen) * 4
    params = [
        SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(temperature=0.0, repetition_penalty=1.0, frequency_penalty=1.0),
        SamplingParams(temperature=1.0, repetition_penalty=0.8),
    ]
    outputs = [[7, 7, 7, 9, 100], [], [3, 3]]
    prompts = [[1, 2, 9], [5, 5, 6], []]
    b = SamplingBatch.build(params, [None] * 3, VOCAB, "cpu", output_tokens=outputs, prompt_tokens=prompts)
    got = _apply_penalties(logits, b)
    for i, p in enumerate(params):
        seen = (
            torch.tensor([prompts[i] + outputs[i]]) if prompts[i] + outputs[i] else torch.zeros(1, 0).long()
        )
        want = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(seen, logits[i : i + 1].clone())[0]
        counts = torch.zeros(VOCAB).index_add_(
            0, torch.tensor(outputs[i], dtype=torch.long), torch.ones(len(outputs[i]))
        )
        want = want - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
        torch.testing.assert_close(got[i], want, atol=1e-5, rtol=1e-5)
    assert b.output_counts[0, 7] == 3 and b.output_counts[2, 3] == 2


def test_penalties_read_only_the_penalised_rows_tokens():
    """One request with a penalty made every step build the counts and prompt mask from all rows' tokens: 64
    rows of 32k-token prompts cost 289 ms a step on the 2-core CPU (35 without the other rows' tokens, 0.5
    without the penalty), for every request beside it. Rows without penalties are not penalised whatever
    their counts, so their tokens are not read."""
    from g4serve.layers.sampler import _apply_penalties

    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(3, VOCAB, generator=gen) * 4
    params = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.5),
        SamplingParams(temperature=0.0),
    ]
    prompts = [list(range(200)), [1, 2, 9], list(range(300, 500))]
    outputs = [[4, 4, 8], [7, 7, 9], [11]]
    b = SamplingBatch.build(params, [None] * 3, VOCAB, "cpu", output_tokens=outputs, prompt_tokens=prompts)
    assert not b.prompt_mask[[0, 2]].any() and not b.output_counts[[0, 2]].any()
    alone = SamplingBatch.build(params[1:2], [None], VOCAB, "cpu", outputs[1:2], prompts[1:2])
    torch.testing.assert_close(_apply_penalties(logits, b)[1], _apply_penalties(logits[1:2], alone)[0])
    torch.testing.assert_close(_apply_penalties(logits, b)[[0, 2]], logits[[0, 2]])


def test_logit_bias_shifts_only_its_rows_tokens():
    """OpenAI's logit_bias: +100 all but forces a token, -100 bans one; rows without a bias are untouched,
    greedy or sampled."""
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    params = [
        SamplingParams(temperature=0, logit_bias={7: 100.0}),
        SamplingParams(temperature=0.8, seed=1, logit_bias={int(logits[1].argmax()): -100.0, 3: 100.0}),
        SamplingParams(temperature=0),
    ]
    batch = SamplingBatch.build(params, [p.seed for p in params], 50, "cpu")
    tokens = sample(logits.clone(), batch).token_ids.tolist()
    assert tokens == [7, 3, int(logits[2].argmax())]


@pytest.mark.parametrize(
    "bias,match",
    [
        ({5: float("inf")}, r"logit_bias\[5\]"),
        ({5: 101}, r"logit_bias\[5\]"),
        ({-1: 1.0}, "keys must be token ids"),
        ({2**40: 1.0}, "keys must be token ids"),
        ({i: 1.0 for i in range(1025)}, "at most 1024"),
        ([1, 2], "must map token ids"),
    ],
)
def test_logit_bias_is_validated(bias, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(logit_bias=bias)


@pytest.mark.parametrize("temperature", [1e-300, 1e-40, 1e-12, 1e-6])
def test_a_vanishing_temperature_draws_the_argmax(temperature):
    """A temperature that passes validation ([0, 100]) but is too small for fp32 arithmetic: 1e-300 becomes 0
    on the device (a sampled row read as greedy, or not), 1e-40 a subnormal whose inverse overflows (logits /
    t are +-inf, the softmax NaN, and the race drew token 0). Such a row takes the argmax, as vLLM treats
    temperatures under 1e-5, whatever else shares its batch."""
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(3, VOCAB, generator=gen) * 3
    want = logits.argmax(dim=-1)
    for others in ([], [SamplingParams(temperature=0)], [SamplingParams(temperature=1.0, top_k=5)]):
        rows = [SamplingParams(temperature=temperature), SamplingParams(temperature=temperature, top_p=0.9)]
        rows += others
        batch = SamplingBatch.build(rows, [None] * len(rows), VOCAB, "cpu")
        tokens = sample(logits[: len(rows)].clone(), batch).token_ids
        assert torch.equal(tokens[:2], want[:2]), (temperature, others)


@pytest.mark.parametrize("top_p", [1e-300, 1e-45, 1e-30])
def test_a_vanishing_top_p_keeps_the_best_token(top_p):
    """top_p in (0, 1] passes validation, but 1e-300 is 0 in fp32 (1e-45 a subnormal): a budget of 0 dropped
    even the best token, and the race over nothing drew token 0. The best token always stays."""
    gen = torch.Generator().manual_seed(12)
    logits = torch.randn(3, VOCAB, generator=gen) * 3
    rows = [
        SamplingParams(temperature=1.0, top_p=top_p),
        SamplingParams(temperature=0.5, top_k=20, top_p=top_p),
        SamplingParams(temperature=1.0, top_p=top_p, min_p=0.5),
    ]
    batch = SamplingBatch.build(rows, [None] * len(rows), VOCAB, "cpu")
    assert torch.equal(sample(logits.clone(), batch).token_ids, logits.argmax(dim=-1))


def test_a_vanishing_repetition_penalty_stays_finite():
    """repetition_penalty in (0, 100] passes validation, but 1e-300 is 0 in fp32: the seen tokens' logits
    divided by it were +inf (their softmax NaN, the race's draw token 0; the argmax the first +inf id). The
    seen token scoring highest wins, as it does for any penalty small enough."""
    logits = torch.zeros(2, VOCAB)
    logits[:, 5], logits[:, 9], logits[:, 40] = 1.0, 2.0, 30.0  # 40, unseen, leads before the penalty
    params = [SamplingParams(temperature=t, repetition_penalty=1e-300) for t in (0.0, 1.0)]
    b = SamplingBatch.build(params, [None] * 2, VOCAB, "cpu", output_tokens=[[5, 9], [5, 9]])
    assert sample(logits.clone(), b).token_ids.tolist() == [9, 9]


def test_token_counts_read_only_the_new_tokens_and_match_counting_anew(monkeypatch):
    """A penalised request's prompt is read once and its outputs as they grow: a step's host work and copy
    no longer grow with a long prompt or output (a 128k-token prompt cost ~20 ms a step on the CPU)."""
    copied = []
    real = sampler.to_device
    monkeypatch.setattr(
        sampler, "to_device", lambda values, *a: copied.append(len(values)) or real(values, *a)
    )
    counts = TokenCounts(VOCAB, "cpu")
    prompts = [list(range(40, 90)) * 20, [3, 4], [5]]
    outputs = [[7, 7, 8], [], [9]]
    on = [True, True, False]
    for step in range(4):
        copied.clear()
        got = counts.rows(["a", "b", "c"], on, prompts, outputs)
        if step:  # 2 (slot, id) numbers a new token, and the 3 rows' slots
            assert copied == [2 * 2 + 3]
        want = TokenCounts(VOCAB, "cpu").rows([0, 1, 2], on, prompts, outputs)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        outputs[0].append(11 + step)
        outputs[1].append(12)
    assert not got[0][2].any() and not got[1][2].any()  # the unpenalised row reads row 0: zeros
    shorter = counts.rows(["a"], [True], [prompts[0]], [[7]])  # never in the engine: counted anew
    assert shorter[1][0].nonzero().flatten().tolist() == [7] and shorter[1][0, 7] == 1
    counts.release("a")
    counts.release("a")  # twice: nothing more
    assert len(counts) == 1 and not counts.output_counts[1].any() and not counts.prompt_mask[1].any()
    reused = counts.rows(["d"], [True], [[6]], [[6, 6]])  # takes a's zeroed row
    assert counts.slots["d"] == 1 and reused[0][0].nonzero().flatten().tolist() == [6]
    assert reused[1][0, 6] == 2 and reused[1][0].sum() == 2
