"""Counter-based sampling noise: Exp(1) draws keyed by (seed, position, token), a whole batch in one launch.

A row's noise is a pure function of its request's 64-bit seed, the output position being sampled and the
token id: Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11; Triton's
``tl.philox``) with the seed as its key and (token, position low word, position high word, ``STREAM``) as
its counter. So a seeded request draws the same noise whatever shares its batch, on the CPU as on a GPU,
after a preemption, and at a verified draft's position as at a plain decode step; and a batch of seeded and
unseeded rows needs no generator objects nor a launch per row. The counter's first output word x becomes a
uniform ``u = ((x >> 9) + 0.5) / 2^23``, strictly inside (0, 1) in fp32, and the noise ``-log(u)`` > 0.

The torch reference computes the same words with 64-bit integer arithmetic (products split in 16-bit halves,
no overflow): bit for bit the kernel's words and uniforms; the logarithm may round one ulp apart between
devices. It is the CPU path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from g4serve.kernels._launch import DualKernel

STREAM = 0  # the counter's last word: sampling noise (other uses of a request's seed take other streams)
_STREAM = tl.constexpr(STREAM)
# The uniform's 23 top bits of the word, plus one half: at most 2^23 - 0.5, exact in fp32, so u < 1 strictly.
# (With 24 bits, 2^24 - 0.5 rounded to 2^24: u = 1.0 and the noise -0.0 for one word in 2^24.)
UNIFORM_SHIFT, UNIFORM_SCALE = 9, 1.0 / 8388608.0
_UNIFORM_SHIFT, _UNIFORM_SCALE = tl.constexpr(UNIFORM_SHIFT), tl.constexpr(UNIFORM_SCALE)
BLOCK = 2048  # tokens per program

MASK32 = 0xFFFFFFFF
ROUND_A, ROUND_B = 0xD2511F53, 0xCD9E8D57  # Philox4x32 multipliers
KEY_A, KEY_B = 0x9E3779B9, 0xBB67AE85  # Weyl key increments


@triton.jit
def exponential_draws(seed, position, tokens):
    """A row's Exp(1) noise at int32 token ids ``tokens`` (a 1-D block): ``seed`` and ``position`` are the
    row's int64 scalars. The one definition the noise kernel and the chunked sampler's race share."""
    zero = tokens * 0
    pos_lo = zero + (position & 0xFFFFFFFF).to(tl.int32)
    pos_hi = zero + (position >> 32).to(tl.int32)
    x, _, _, _ = tl.philox(seed, tokens, pos_lo, pos_hi, zero + _STREAM)
    u = ((x >> _UNIFORM_SHIFT).to(tl.float32) + 0.5) * _UNIFORM_SCALE
    return -tl.log(u)


def _exponential_noise_fn(Seeds, Positions, Out, V, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    noise = exponential_draws(tl.load(Seeds + row), tl.load(Positions + row), offs)
    tl.store(Out + row * stride_o + offs, noise, mask=offs < V)


_exponential_noise = DualKernel(_exponential_noise_fn)


def exponential_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """seeds, positions [B] int64 -> Exp(1) noise [B, vocab_size] fp32; CUDA: one launch, elsewhere the
    torch reference (the same values)."""
    if not seeds.is_cuda:
        return exponential_noise_reference(seeds, positions, vocab_size)
    rows = seeds.shape[0]
    out = torch.empty(rows, vocab_size, dtype=torch.float32, device=seeds.device)
    if rows:
        grid = (rows, triton.cdiv(vocab_size, BLOCK))
        _exponential_noise[seeds.device][grid](seeds, positions, out, vocab_size, out.stride(0), BLOCK=BLOCK)
    return out


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of ``a * b`` for a 32-bit constant and 32-bit values held in int64."""
    low_half = a * (b & 0xFFFF)  # < 2^48
    mid = a * (b >> 16) + (low_half >> 16)  # the product >> 16, < 2^49
    return mid >> 16, ((mid & 0xFFFF) << 16) | (low_half & 0xFFFF)


def philox4x32_reference(counter: list[torch.Tensor], key: list[torch.Tensor], rounds: int = 10):
    """Philox4x32-``rounds`` on 32-bit words held in int64 tensors (broadcast together): 4 output words."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(rounds):
        hi_b, lo_b = _mulhilo(ROUND_B, c2)
        hi_a, lo_a = _mulhilo(ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + KEY_A) & MASK32, (k1 + KEY_B) & MASK32
    return c0, c1, c2, c3


def exponential_noise_reference(
    seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    device = seeds.device
    seeds = seeds.long().cpu().unsqueeze(1)
    positions = positions.long().cpu().unsqueeze(1)
    tokens = torch.arange(vocab_size, dtype=torch.int64).unsqueeze(0)
    counter = [tokens, positions & MASK32, (positions >> 32) & MASK32, torch.full_like(tokens, STREAM)]
    key = [seeds & MASK32, (seeds >> 32) & MASK32]
    return noise_from_words(philox4x32_reference(counter, key)[0]).to(device)


def noise_from_words(x: torch.Tensor) -> torch.Tensor:
    """Philox output words (32-bit values in int64) -> Exp(1) noise, as the kernel computes it."""
    u = ((x >> UNIFORM_SHIFT).float() + 0.5) * UNIFORM_SCALE
    return -u.log()


__all__ = [
    "exponential_draws",
    "exponential_noise",
    "exponential_noise_reference",
    "noise_from_words",
    "philox4x32_reference",
]
