"""The sort-free top-k / top-p / min-p sampling kernel in Triton's interpreter against the sampler's torch
path (mask with the filters, then the exponential race) on the same noise: the same token for every row.
Top-k's radix select finds the k-th best exactly (ties, negatives, -inf and signed zeros); the launch compiles
to sm_90."""

from __future__ import annotations

import pytest
import torch

from g4serve.kernels.top_p_sample import top_p_sample
from g4serve.layers.sampler import SamplingBatch, _top_k_top_p_min_p
from g4serve.sampling_params import SamplingParams

VOCAB = 1000  # not a power of two: a partial last block


def _torch_path(logits, params, noise):
    b = SamplingBatch.build(params, [None] * len(params), logits.shape[1], "cpu")
    scaled = _top_k_top_p_min_p(logits / b.temperature.unsqueeze(1), b)
    return (scaled.softmax(dim=-1) / noise).argmax(dim=-1)


def _kernel(logits, params, noise, block):
    b = SamplingBatch.build(params, [None] * len(params), logits.shape[1], "cpu")
    top_k = b.top_k if b.uses_top_k else None
    return top_p_sample(logits, b.temperature, b.top_p, b.min_p, noise, block=block, top_k=top_k)


PARAMS = [
    SamplingParams(temperature=1.0, top_p=0.9),
    SamplingParams(temperature=0.7, top_p=0.5),
    SamplingParams(temperature=1.5, top_p=0.99),
    SamplingParams(temperature=1.0, top_p=0.05),  # about the top token only
    SamplingParams(temperature=0.8),  # temperature alone: the race over the whole row
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=1.2, top_p=0.8, min_p=0.02),
]


@pytest.mark.parametrize("block", [128, 1024])
def test_same_tokens_as_sorting(block):
    gen = torch.Generator().manual_seed(block)
    for trial in range(6):
        logits = torch.randn(len(PARAMS), VOCAB, generator=gen) * (1 + trial)  # flat to peaked
        noise = torch.empty(len(PARAMS), VOCAB).exponential_(generator=gen)
        assert torch.equal(_kernel(logits, PARAMS, noise, block), _torch_path(logits, PARAMS, noise)), trial


def test_masked_logits_are_never_drawn():
    """-inf logits (grammar masks, ids past the tokenizer), the row's best one included."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(len(PARAMS), VOCAB, generator=gen) * 3
    best = logits.argmax(dim=-1)
    logits[:, 500:] = float("-inf")
    logits[torch.arange(len(PARAMS)), best] = float("-inf")
    for _ in range(4):
        noise = torch.empty(len(PARAMS), VOCAB).exponential_(generator=gen)
        tokens = _kernel(logits, PARAMS, noise, 256)
        assert torch.equal(tokens, _torch_path(logits, PARAMS, noise))
        assert torch.isfinite(logits.gather(1, tokens.unsqueeze(1))).all()


def test_draw_frequencies_follow_the_top_p_set():
    """Many draws for one row: only the top-p tokens appear, at their renormalised probabilities."""
    logits = torch.tensor([[3.0, 2.5, 2.0, 0.0, -1.0, -2.0] + [-9.0] * 10])
    probs = logits.softmax(dim=-1)[0]
    params = [SamplingParams(temperature=1.0, top_p=0.9)] * 2000
    noise = torch.empty(len(params), logits.shape[1]).exponential_(generator=torch.Generator().manual_seed(2))
    tokens = _kernel(logits.expand(len(params), -1).contiguous(), params, noise, 16)
    kept = (probs.cumsum(0) - probs) < 0.9
    assert set(tokens.tolist()) <= set(kept.nonzero().squeeze(1).tolist())
    freq = torch.bincount(tokens, minlength=logits.shape[1]).float() / len(params)
    want = torch.where(kept, probs, 0.0) / probs[kept].sum()
    torch.testing.assert_close(freq, want, atol=0.04, rtol=0)


TOP_K_PARAMS = [
    SamplingParams(temperature=1.0, top_k=50, top_p=0.9),
    SamplingParams(temperature=0.7, top_k=1),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=1.3, top_k=VOCAB - 1, top_p=0.5),
    SamplingParams(temperature=1.0, top_k=VOCAB + 7),  # past the vocabulary: off
    SamplingParams(temperature=1.0, top_p=0.9),  # no top-k in a batch that has some
    SamplingParams(temperature=1.0, top_k=64, top_p=0.95, min_p=0.05),
]


@pytest.mark.parametrize("block", [128, 1024])
def test_top_k_rows_draw_what_sorting_draws(block):
    gen = torch.Generator().manual_seed(10 + block)
    for trial in range(5):
        logits = torch.randn(len(TOP_K_PARAMS), VOCAB, generator=gen) * (1 + trial)
        if trial >= 3:  # integer logits: ties at the k-th best, kept all (as torch's masks keep them)
            logits = logits.round()
        noise = torch.empty(len(TOP_K_PARAMS), VOCAB).exponential_(generator=gen)
        got = _kernel(logits, TOP_K_PARAMS, noise, block)
        assert torch.equal(got, _torch_path(logits, TOP_K_PARAMS, noise)), trial


def test_the_largest_top_k_a_request_may_send_is_off_not_wrapped():
    """top_k up to 2**31 - 1 passes request validation; the kernel reads it as int32: past the vocabulary it
    filters nothing, as no top-k at all."""
    from g4serve.sampling_params import MAX_INT_PARAM

    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(2, VOCAB, generator=gen) * 2
    noise = torch.empty(2, VOCAB).exponential_(generator=gen)
    flat, top_p = torch.ones(2), torch.tensor([1.0, 0.9])
    huge = torch.full((2,), MAX_INT_PARAM, dtype=torch.long)
    off = top_p_sample(logits, flat, top_p, torch.zeros(2), noise, block=256)
    assert torch.equal(top_p_sample(logits, flat, top_p, torch.zeros(2), noise, block=256, top_k=huge), off)


@pytest.mark.parametrize("k", [1, 2, 37, 500, VOCAB - 1])
def test_radix_select_finds_the_kth_best_exactly(k):
    """Noise that makes the race pick the least likely token the filters keep: with top-k alone that is a
    token scoring exactly the k-th best. Rows of negatives, -inf, signed zeros and heavy ties."""
    gen = torch.Generator().manual_seed(k)
    rows = [
        torch.randn(VOCAB, generator=gen) * 5 - 20,  # all negative
        torch.randn(VOCAB, generator=gen).round(),  # ties everywhere, both zeros' signs
        torch.where(torch.rand(VOCAB, generator=gen) < 0.3, float("-inf"), torch.randn(VOCAB, generator=gen)),
    ]
    rows[1][::7] = -0.0
    logits = torch.stack(rows)
    e = (logits - logits.max(dim=1, keepdim=True).values).exp()
    noise = (e * e).clamp_min(1e-30)  # e / noise = 1 / e: the race prefers the least likely kept token
    params = [SamplingParams(temperature=1.0, top_k=k)] * len(rows)
    tokens = _kernel(logits, params, noise, 256)
    kth = logits.topk(k, dim=1).values[:, -1]
    finite = torch.isfinite(kth)
    picked = logits.gather(1, tokens.unsqueeze(1)).squeeze(1)
    assert torch.equal(picked[finite], kth[finite])
    assert torch.isfinite(picked).all()  # a row with fewer than k finite logits still draws a finite one


def test_kernel_compiles_for_sm90(monkeypatch):
    """The interpreter does not apply the compiled language's rules: the top-k launch compiles to sm_90."""
    from test_kv_fp8_sm90_compile import _compile, _launches

    import g4serve.kernels.top_p_sample as module

    rows, vocab = 8, 262144
    logits = torch.empty(rows, vocab, device="meta")  # fp32, as ``sample`` hands them over
    noise = torch.empty(rows, vocab, device="meta")
    flat = torch.empty(rows, device="meta")
    top_k = torch.empty(rows, dtype=torch.int64, device="meta")
    launches = _launches(
        monkeypatch,
        module,
        "_top_p_sample",
        lambda: top_p_sample(logits, flat, flat, flat, noise, top_k=top_k),
    )
    for fn, args, kwargs in launches:
        _compile(fn, args, kwargs)
