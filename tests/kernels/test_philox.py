"""Counter-based sampling noise (kernels/philox.py): Philox4x32-10's published known-answer vectors, the
kernel (Triton's interpreter) equal to the torch reference up to the log's rounding, and the noise a function
of (seed, position, token) alone, Exp(1)-distributed."""

from __future__ import annotations

import math

import pytest
import torch

from g4serve.kernels import philox
from g4serve.kernels.philox import (
    exponential_noise,
    exponential_noise_reference,
    philox4x32_reference,
)


def seed_words(seed: int) -> int:
    """A request's seed (any Python int) as the signed 64-bit value whose bits key its noise (an int64 tensor
    element, as the sampler packs it)."""
    seed &= (1 << 64) - 1
    return seed - (1 << 64) if seed >= 1 << 63 else seed


# Random123's kat_vectors for philox4x32_10: (counter, key) -> output
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    (
        (0xFFFFFFFF,) * 4,
        (0xFFFFFFFF,) * 2,
        (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD),
    ),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize("counter, key, want", KAT)
def test_reference_matches_the_known_answers(counter, key, want):
    words = philox4x32_reference([torch.tensor([c]) for c in counter], [torch.tensor([k]) for k in key])
    assert [int(w) for w in words] == list(want)


def test_kernel_equals_the_reference():
    """The same Philox words and uniforms; only -log rounds differently (numpy's log in the interpreter,
    torch's in the reference, the GPU's own): a few ulps apart at most, where one wrong word is ~100%."""
    seeds = torch.tensor([seed_words(s) for s in (0, 7, -1, 2**63 + 5, 123456789)], dtype=torch.int64)
    positions = torch.tensor([0, 1, 2**31 + 3, 2**40 + 11, 5], dtype=torch.int64)
    vocab = 3 * philox.BLOCK // 2 + 17  # a ragged last block
    out = torch.empty(len(seeds), vocab)
    grid = (len(seeds), -(-vocab // philox.BLOCK))
    philox._exponential_noise[torch.device("cpu")][grid](
        seeds, positions, out, vocab, out.stride(0), BLOCK=philox.BLOCK
    )
    want = exponential_noise_reference(seeds, positions, vocab)
    torch.testing.assert_close(out, want, rtol=2.5e-7, atol=0)


def test_noise_is_a_function_of_seed_position_and_token():
    seeds = torch.tensor([3, 3, 4], dtype=torch.int64)
    positions = torch.tensor([10, 11, 10], dtype=torch.int64)
    noise = exponential_noise(seeds, positions, 500)
    alone = exponential_noise(seeds[:1], positions[:1], 500)
    assert torch.equal(noise[0], alone[0])  # the same draws whatever else is in the batch
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])
    assert torch.equal(exponential_noise(seeds[:1], positions[:1], 300)[0], noise[0, :300])  # per token


def test_noise_is_exponential():
    noise = exponential_noise(torch.arange(8, dtype=torch.int64), torch.zeros(8, dtype=torch.int64), 20_000)
    assert noise.min() > 0 and torch.isfinite(noise).all()
    assert abs(noise.mean().item() - 1.0) < 0.01 and abs(noise.var().item() - 1.0) < 0.03
    # P(q > 1) = 1/e
    assert abs((noise > 1).float().mean().item() - math.exp(-1)) < 0.005


def test_seed_words_wrap_to_64_bits():
    assert seed_words(5) == 5 and seed_words(-1) == -1 and seed_words(2**64 - 1) == -1
    assert seed_words(2**64 + 5) == 5 and seed_words(2**63) == -(2**63)


def test_kernel_compiles_for_sm90(monkeypatch):
    """The interpreter does not apply the compiled language's rules: the launch is compiled to sm_90 here."""
    from test_kv_fp8_sm90_compile import _compile, _launches

    seeds = torch.empty(3, dtype=torch.int64, device="meta")
    positions = torch.empty(3, dtype=torch.int64, device="meta")
    monkeypatch.setattr(philox, "exponential_noise_reference", lambda *a: None)  # meta: take the kernel path
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    launches = _launches(
        monkeypatch, philox, "_exponential_noise", lambda: exponential_noise(seeds, positions, 262144)
    )
    for fn, args, kwargs in launches:
        _compile(fn, args, kwargs)


def test_every_word_gives_positive_finite_noise():
    """The race divides by the noise: a draw of 0 (or -0.0) makes p / q infinite, or NaN where p is 0 (a token
    masked out), and ``argmax`` picks NaN. With 24 bits and +0.5 the largest word rounded to u = 1.0 in fp32
    (-log 1 = -0.0): one row in ~64 at Gemma's 262,144 tokens held such a token each step. Every word maps
    strictly inside (0, 1), in the reference and in the kernel's formula."""
    words = torch.tensor([0, 1, 255, 256, 511, 2**31, 2**32 - 512, 2**32 - 257, 2**32 - 256, 2**32 - 1])
    noise = philox.noise_from_words(words)
    assert (noise > 0).all() and torch.isfinite(noise).all()
    assert noise[-1] < noise[-5] < noise[0]  # larger words, smaller noise
    seeds = torch.zeros(1, dtype=torch.int64)
    kernel_words = torch.empty(1, 4 * philox.BLOCK)
    grid = (1, 4)
    philox._exponential_noise[torch.device("cpu")][grid](
        seeds, torch.zeros(1, dtype=torch.int64), kernel_words, 4 * philox.BLOCK, kernel_words.stride(0),
        BLOCK=philox.BLOCK,
    )  # fmt: skip
    assert (kernel_words > 0).all()
