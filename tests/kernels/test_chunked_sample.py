"""The chunked sampler (``kernels/chunked_sample.py``) in Triton's interpreter against the sampler's torch
path (mask with top-k, top-p and min-p, then the exponential race) on the same Philox noise: the same token
for every row, with chunks of a few logits so that a row spans many programs. Ties at the k-th best (kept
all, counted over the row when they fill the candidates), -inf logits, bf16 logits read as they are, and the
four launches compile to sm_90."""

from __future__ import annotations

import torch

from g4serve.kernels.chunked_sample import MAX_TOP_K, chunked_sample
from g4serve.kernels.philox import exponential_noise_reference
from g4serve.kernels.top_p_sample import top_p_sample
from g4serve.layers.sampler import SamplingBatch, _top_k_top_p_min_p
from g4serve.sampling_params import SamplingParams

VOCAB = 300  # not a multiple of the chunk: a partial last chunk
CHUNK = 64  # five chunks a row (the interpreter runs tl.topk slowly: small chunks and k keep this file quick)


def _batch(params, vocab=VOCAB, seed=0):
    seeds = [seed * 1000 + i for i in range(len(params))]
    return SamplingBatch.build(params, seeds, vocab, "cpu", positions=[7 + i for i in range(len(params))])


def _torch_path(logits, b):
    noise = exponential_noise_reference(b.seeds, b.positions, logits.shape[1])
    scaled = _top_k_top_p_min_p(logits.float() / b.temperature.unsqueeze(1), b)
    return (scaled.softmax(dim=-1) / noise).argmax(dim=-1)


def _kernel(logits, b, chunk=CHUNK):
    k = b.chunk_top_k or 0
    return chunked_sample(
        logits, b.temperature, b.min_p, b.seeds, b.positions, b.top_k, b.top_p, k, chunk=chunk
    )


def _one_program_kernel(logits, b):
    """``top_p_sample``, which keeps ties at the top-p boundary together too (the torch masks cut them by
    position in the sort)."""
    noise = exponential_noise_reference(b.seeds, b.positions, logits.shape[1])
    return top_p_sample(logits.float(), b.temperature, b.top_p, b.min_p, noise, block=256, top_k=b.top_k)


PARAMS = [
    SamplingParams(temperature=1.0, top_k=5, top_p=0.9),
    SamplingParams(temperature=0.7, top_k=1),
    SamplingParams(temperature=1.3, top_k=8, top_p=0.5),
    SamplingParams(temperature=1.0, top_k=VOCAB + 7),  # past the vocabulary: off
    SamplingParams(temperature=0.8),  # temperature alone: the race over the whole row
    SamplingParams(temperature=1.0, top_k=8, top_p=0.95, min_p=0.05),
    SamplingParams(temperature=1.0, top_k=8, top_p=0.05),  # about the top token only
    SamplingParams(temperature=1.2, min_p=0.1),
    SamplingParams(temperature=1.0, top_k=8, top_p=1e-300),  # 0 in fp32: the best token alone
]


def test_same_tokens_as_masking_and_racing():
    gen = torch.Generator().manual_seed(0)
    for trial in range(4):
        logits = torch.randn(len(PARAMS), VOCAB, generator=gen) * (1 + 2 * trial)  # flat to peaked
        if trial >= 2:  # integer logits: ties at the k-th best, kept all (as torch's masks keep them)
            logits = logits.round()
        b = _batch(PARAMS, seed=trial)
        assert b.chunk_top_k == 8
        assert torch.equal(_kernel(logits, b), _torch_path(logits, b)), trial


def test_gemma_sampling_settings():
    """Gemma 4's generation config (temperature 1, top-k 64, top-p 0.95): the row's 64 best out of chunks of
    64 logits, each of which may hold all of them."""
    params = [SamplingParams(temperature=1.0, top_k=64, top_p=0.95)] * 2
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(5)) * 2
    logits[1, :64] += 20  # the whole top-64 set in one chunk
    b = _batch(params)
    assert b.chunk_top_k == 64
    assert torch.equal(_kernel(logits, b), _torch_path(logits, b))


def test_without_top_k_one_launch_fewer_and_the_same_tokens():
    params = [SamplingParams(temperature=t, min_p=m) for t in (0.5, 1.0, 2.0) for m in (0.0, 0.2)]
    logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(3)) * 3
    b = _batch(params)
    assert b.chunk_top_k == 0
    assert torch.equal(_kernel(logits, b), _torch_path(logits, b))


def test_ties_filling_the_candidates_are_counted_over_the_row():
    """Many tokens tie at the k-th best, more than the candidates hold: the top-k set keeps them all (as the
    sort of the whole row and ``top_p_sample`` do), and its mass, top-p's budget, counts them all."""
    logits = torch.full((3, VOCAB), -5.0)
    logits[:, :3] = torch.tensor([4.0, 3.0, 2.0])
    logits[:, 100:250] = 1.0  # 150 tokens tie at the 4th best
    params = [
        SamplingParams(temperature=1.0, top_k=4),
        SamplingParams(temperature=1.0, top_k=8, top_p=0.99),
        SamplingParams(temperature=1.0, top_k=8, top_p=0.6),
    ]
    for trial in range(3):
        b = _batch(params, seed=trial)
        assert torch.equal(_kernel(logits, b), _one_program_kernel(logits, b)), trial
    # top-k 4 keeps all 150 tied tokens: their mass outweighs the three best', so most draws are ties
    many = [params[0]] * 10
    draws = _kernel(logits[:1].expand(len(many), -1).contiguous(), _batch(many, seed=9)).tolist()
    assert sum(100 <= t < 250 for t in draws) >= 5
    assert all(t < 3 or 100 <= t < 250 for t in draws)


def test_masked_logits_are_never_drawn_and_bf16_logits_are_read_as_they_are():
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(len(PARAMS), VOCAB, generator=gen) * 3).bfloat16()
    best = logits.float().argmax(dim=-1)
    logits[:, 200:] = float("-inf")
    logits[torch.arange(len(PARAMS)), best] = float("-inf")
    b = _batch(PARAMS, seed=4)
    tokens = _kernel(logits, b)
    assert torch.equal(tokens, _torch_path(logits, b))
    assert torch.isfinite(logits.float().gather(1, tokens.unsqueeze(1))).all()


def test_chunk_top_k_routes_only_what_the_kernels_serve():
    assert _batch([SamplingParams(temperature=1.0, top_k=64, top_p=0.95)]).chunk_top_k == 64
    assert _batch([SamplingParams(temperature=1.0, top_k=50)]).chunk_top_k == 64  # rounded up
    assert _batch([SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=0)]).chunk_top_k == 4
    assert _batch([SamplingParams(temperature=1.0)]).chunk_top_k == 0
    assert _batch([SamplingParams(temperature=1.0, top_p=0.9)]).chunk_top_k is None  # top-p without top-k
    assert _batch([SamplingParams(temperature=1.0, top_k=MAX_TOP_K + 1)]).chunk_top_k is None
    assert _batch([SamplingParams(temperature=1.0, top_k=VOCAB, top_p=0.9)]).chunk_top_k is None  # k off
    assert _batch([SamplingParams(temperature=0, top_p=0.9)]).chunk_top_k == 0  # greedy rows do not count


def test_kernels_compile_for_sm90(monkeypatch):
    """The interpreter does not apply the compiled language's rules: every launch compiles to sm_90 at
    Gemma 4's vocabulary, with and without top-k."""
    from test_kv_fp8_sm90_compile import _compile, _launches

    import g4serve.kernels.chunked_sample as module

    rows, vocab = 8, 262144
    logits = torch.empty(rows, vocab, dtype=torch.bfloat16, device="meta")
    flat = torch.empty(rows, device="meta")
    ints = torch.empty(rows, dtype=torch.int64, device="meta")
    for k in (0, 64):
        with monkeypatch.context() as patch:
            launches = _launches(
                patch,
                module,
                "_chunk_scan _row_floor _chunk_race _race_winner",
                lambda k=k: chunked_sample(logits, flat, flat, ints, ints, ints, flat, k),
            )
        assert len(launches) == (4 if k else 3)
        for fn, args, kwargs in launches:
            _compile(fn, args, kwargs)
