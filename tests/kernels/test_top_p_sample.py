"""The sort-free top-p / min-p sampling kernel in Triton's interpreter against the sampler's torch path
(mask with the filters, then the exponential race) on the same noise: the same token for every row."""

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
    return top_p_sample(logits, b.temperature, b.top_p, b.min_p, noise, block=block)


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
