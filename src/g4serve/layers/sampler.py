"""Batched token sampling on the device: greedy and random rows, penalties, top-k/top-p/min-p,
per-request seeds, token masks (constrained decoding, min_tokens) and logprobs.

Random rows use the exponential-race form of Gumbel-max (argmax p/q with q ~ Exp(1)). The noise is
counter-based (``kernels/philox.py``): a function of the row's seed, the output position it samples and the
token, drawn for the whole batch in one launch. So a seeded request stays reproducible whatever else shares
the batch, on either device and under speculative decoding; unseeded rows get a fresh random seed per step
(from torch's default generator: ``torch.manual_seed`` makes them repeatable too). On CUDA, batches without
top-k take temperature, top-p and min-p in one kernel (``kernels/top_p_sample.py``) that returns the same
token as masking and racing here, without sorting the vocabulary; batches whose rows set a top-k of at most
128 (or no top-k and no top-p) sample over vocabulary chunks instead (``kernels/chunked_sample.py``: many
programs a row, the noise drawn in place; ``G4SERVE_CHUNKED_SAMPLING=0`` turns it off).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from g4serve import envs
from g4serve.kernels._launch import next_pow2
from g4serve.kernels.chunked_sample import MAX_TOP_K as CHUNK_MAX_TOP_K
from g4serve.kernels.chunked_sample import chunked_sample
from g4serve.kernels.philox import exponential_noise
from g4serve.kernels.top_p_sample import top_p_sample
from g4serve.sampling_params import SamplingParams
from g4serve.transfer import fill_at, to_device


@dataclass
class SamplingBatch:
    temperature: torch.Tensor  # [B] fp32 (0: greedy)
    top_k: torch.Tensor  # [B] long (0: off)
    top_p: torch.Tensor  # [B] fp32
    min_p: torch.Tensor  # [B] fp32
    seeds: torch.Tensor  # [B] int64: the noise key (the request's seed, or a fresh random one)
    positions: torch.Tensor  # [B] int64: the output position each row samples (the noise counter)
    all_greedy: bool
    num_logprobs: int | None  # max over rows; None: no logprobs requested
    # Optional [B, V] bool: True where a token is allowed. None: everything allowed.
    allowed: torch.Tensor | None = None
    # Penalties need the output history: [B, V] counts of generated tokens.
    output_counts: torch.Tensor | None = None
    repetition_penalty: torch.Tensor | None = None
    presence_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    prompt_mask: torch.Tensor | None = None  # [B, V] bool: token occurs in the prompt (repetition)
    logit_bias: torch.Tensor | None = None  # [B, V] fp32 added to the logits (OpenAI's logit_bias)
    # Which filters some row uses, known on the host: testing the device tensors would wait for the GPU.
    uses_top_k: bool = True
    uses_top_p: bool = True
    uses_min_p: bool = True
    max_top_k: int | None = None  # the largest top-k if every sampled row sets one, else None
    any_greedy: bool = True  # some row takes the argmax (temperature 0)
    # The chunked sampler's top-k candidates (``kernels/chunked_sample.py``): the sampled rows' largest top-k
    # rounded up to a power of two, 0 when none sets one; None when a row is not for it (top-k past its
    # MAX_TOP_K, or top-p without a top-k).
    chunk_top_k: int | None = None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        seeds: list[int | None],
        vocab_size: int,
        device: torch.device | str,
        output_tokens: list[list[int]] | None = None,
        prompt_tokens: list[list[int]] | None = None,
        allowed: torch.Tensor | None = None,
        positions: list[int] | None = None,
        token_counts: TokenCounts | None = None,
        request_ids: list[Hashable] | None = None,
    ) -> SamplingBatch:
        """``seeds``: each row's noise seed (None: a fresh random one); ``positions``: the output position
        each row samples (default 0), so a request's token t always races on the same noise.
        ``token_counts``: the penalised requests' token statistics kept from step to step, each row's under
        its ``request_ids`` entry; without it they are counted from the whole lists here."""
        # Called after the forward was launched: every host value goes in one copy that does not wait for it.
        penalties = any(p.has_penalties for p in params)
        greedy = [p.greedy for p in params]
        keys = _noise_keys(seeds, all(greedy))
        positions = positions if positions is not None else [0] * len(params)
        # seeds as two 32-bit words: every column is exact in fp64
        columns = [
            [
                0.0 if g else p.temperature,
                p.top_k,
                max(p.top_p, MIN_TOP_P),
                p.min_p,
                key & 0xFFFFFFFF,
                key >> 32,
                pos,
            ]
            for p, g, key, pos in zip(params, greedy, keys, positions)
        ]
        if penalties:
            for row, p in zip(columns, params):
                row += [
                    max(p.repetition_penalty, MIN_REPETITION_PENALTY),
                    p.presence_penalty,
                    p.frequency_penalty,
                ]
        packed = to_device(columns, torch.float64, device)  # fp64: top_k and the fp32 values exactly
        batch = cls(
            temperature=packed[:, 0].float(),
            top_k=packed[:, 1].long(),
            top_p=packed[:, 2].float(),
            min_p=packed[:, 3].float(),
            seeds=packed[:, 4].long() | (packed[:, 5].long() << 32),
            positions=packed[:, 6].long(),
            all_greedy=all(greedy),
            num_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=None),
            allowed=allowed,
            uses_top_k=any(0 < p.top_k < vocab_size for p in params),
            uses_top_p=any(p.top_p < 1 for p in params),
            uses_min_p=any(p.min_p > 0 for p in params),
            max_top_k=_max_top_k(params),
            any_greedy=any(greedy),
            chunk_top_k=_chunk_top_k(params, vocab_size),
        )
        if any(p.logit_bias for p in params):
            batch.logit_bias = _logit_bias(params, vocab_size, device)
        if penalties:
            batch.repetition_penalty = packed[:, 7].float()
            batch.presence_penalty = packed[:, 8].float()
            batch.frequency_penalty = packed[:, 9].float()
            counts = token_counts if token_counts is not None else TokenCounts(vocab_size, device)
            batch.prompt_mask, batch.output_counts = counts.rows(
                request_ids if request_ids is not None else list(range(len(params))),
                [p.has_penalties for p in params],
                prompt_tokens or [[] for _ in params],
                output_tokens or [[] for _ in params],
            )
        return batch


class TokenCounts:
    """The token statistics of penalised requests on the device, kept across their steps: for each, a
    [V] mask of the tokens its prompt holds (written once, at its first step) and a [V] count of each token
    it generated (advanced by the tokens new since its last step). A step gathers its rows' in one index.

    Counting from the whole lists at every step made a step's host time grow with the penalised requests'
    prompts and outputs (a 128k-token prompt and output: 28 ms a step on the 2-core CPU, 0.16 kept) and with
    the other rows' (64 rows of 32k tokens, one penalised: 305 ms; bench/hostile_inputs.py): now a step
    reads the new tokens only, and only the penalised rows'. Row 0 stays zero, for rows without penalties.
    The rows are one pool that doubles when full; ``release`` (the engine's, when a request finishes) zeroes
    a row for the next request, and holding them costs 5 bytes x V a live penalised request (1.3 MB at
    Gemma 4's 262k).
    A penalised request neither speculates nor rolls back, so its outputs only grow; a shorter list than
    counted is counted anew all the same."""

    def __init__(self, vocab_size: int, device: torch.device | str):
        self.vocab_size, self.device = vocab_size, torch.device(device)
        self.prompt_mask = torch.zeros(1, vocab_size, dtype=torch.bool, device=self.device)
        self.output_counts = torch.zeros(1, vocab_size, dtype=torch.float32, device=self.device)
        self.slots: dict[Hashable, int] = {}
        self.counted: dict[int, int] = {}  # slot -> output tokens counted
        self.free: list[int] = []

    def __len__(self) -> int:
        return len(self.slots)

    # Tensors made in a step are inference tensors, which only inference mode may update in place: every
    # update is made in it (``release`` runs where a request finishes, an abort included).
    @torch.inference_mode()
    def rows(
        self,
        keys: list[Hashable],
        penalised: list[bool],
        prompt_tokens: list[list[int]],
        output_tokens: list[list[int]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, V] prompt mask, [B, V] output counts) of the batch's rows, after counting what is new: the
        prompts of keys seen for the first time and every penalised row's outputs since its last step."""
        prompt_pairs: tuple[list[int], list[int]] = ([], [])
        output_pairs: tuple[list[int], list[int]] = ([], [])
        slots = []
        for key, on, prompt, outputs in zip(keys, penalised, prompt_tokens, output_tokens):
            if not on:
                slots.append(0)
                continue
            slot = self.slots.get(key)
            if slot is None:
                slot = self.slots[key] = self._take()
                _pairs(prompt_pairs, slot, prompt)
            counted = self.counted[slot]
            if len(outputs) < counted:
                self.output_counts[slot].zero_()
                counted = 0
            _pairs(output_pairs, slot, outputs[counted:])
            self.counted[slot] = len(outputs)
            slots.append(slot)
        n_prompt, n_output = len(prompt_pairs[0]), len(output_pairs[0])
        flat = to_device(
            [*prompt_pairs[0], *prompt_pairs[1], *output_pairs[0], *output_pairs[1], *slots],
            torch.long,
            self.device,
        )  # one copy
        prompt_index = flat[: 2 * n_prompt].view(2, n_prompt)
        output_index = flat[2 * n_prompt : 2 * (n_prompt + n_output)].view(2, n_output)
        if n_prompt:
            fill_at(self.prompt_mask, (prompt_index[0], prompt_index[1]), True)
        if n_output:
            ones = torch.ones(n_output, dtype=torch.float32, device=self.device)
            self.output_counts.index_put_((output_index[0], output_index[1]), ones, accumulate=True)
        index = flat[2 * (n_prompt + n_output) :]
        return self.prompt_mask[index], self.output_counts[index]

    @torch.inference_mode()
    def release(self, key: Hashable) -> None:
        """Forget ``key``'s request (finished or aborted): its row is zeroed for the next one. A step
        already launched has gathered its rows, and the zeroing queues behind it on the same stream."""
        slot = self.slots.pop(key, None)
        if slot is None:
            return
        self.prompt_mask[slot].zero_()
        self.output_counts[slot].zero_()
        del self.counted[slot]
        self.free.append(slot)

    def _take(self) -> int:
        if not self.free:
            have = self.output_counts.shape[0]
            grow = max(have - 1, 1)  # the pool doubles (row 0 aside)
            self.prompt_mask = torch.cat(
                [self.prompt_mask, self.prompt_mask.new_zeros(grow, self.vocab_size)]
            )
            self.output_counts = torch.cat(
                [self.output_counts, self.output_counts.new_zeros(grow, self.vocab_size)]
            )
            self.free = list(range(have + grow - 1, have - 1, -1))
        slot = self.free.pop()
        self.counted[slot] = 0
        return slot


def _pairs(pairs: tuple[list[int], list[int]], slot: int, tokens: list[int]) -> None:
    """Append (slot, token) for each of ``tokens`` to the two lists of ``pairs``."""
    pairs[0].extend([slot] * len(tokens))
    pairs[1].extend(tokens)


def _noise_keys(seeds: list[int | None], all_greedy: bool) -> list[int]:
    """Each row's noise key as an unsigned 64-bit int: its seed, or a random one drawn from torch's default
    generator (none when every row is greedy: no noise is drawn)."""
    missing = sum(seed is None for seed in seeds) if not all_greedy else 0
    fresh = iter(torch.randint(-(2**63), 2**63 - 1, (missing,)).tolist() if missing else [])
    return [(next(fresh, 0) if seed is None else seed) & (2**64 - 1) for seed in seeds]


def _logit_bias(params: list[SamplingParams], vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """[B, V] of each row's logit_bias (zero elsewhere), filled in one copy."""
    rows, ids, values = [], [], []
    for row, p in enumerate(params):
        for token, value in (p.logit_bias or {}).items():
            if token < vocab_size:
                rows.append(row)
                ids.append(token)
                values.append(float(value))
    bias = torch.zeros(len(params), vocab_size, dtype=torch.float32, device=device)
    index = to_device([rows, ids], torch.long, device)
    bias[index[0], index[1]] = to_device(values, torch.float32, device)
    return bias


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B]
    logprobs: torch.Tensor | None  # [B] logprob of the chosen token
    top_ids: torch.Tensor | None  # [B, N]
    top_logprobs: torch.Tensor | None  # [B, N]


def _apply_penalties(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    seen = (b.output_counts > 0) | b.prompt_mask
    rep = b.repetition_penalty.unsqueeze(1)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - b.frequency_penalty.unsqueeze(1) * b.output_counts
    return logits - b.presence_penalty.unsqueeze(1) * (b.output_counts > 0).float()


def _max_top_k(params: list[SamplingParams]) -> int | None:
    """The largest top-k of the sampled rows if every one sets a top-k (greedy rows take the argmax)."""
    sampled = [p for p in params if not p.greedy]
    return max(p.top_k for p in sampled) if sampled and all(p.top_k > 0 for p in sampled) else None


def _chunk_top_k(params: list[SamplingParams], vocab_size: int) -> int | None:
    """``SamplingBatch.chunk_top_k`` of these rows."""
    largest = 0
    for p in params:
        if p.greedy:
            continue
        k = p.top_k if 0 < p.top_k < vocab_size else 0
        if k > CHUNK_MAX_TOP_K or (k == 0 and p.top_p < 1):
            return None
        largest = max(largest, k)
    return next_pow2(largest) if largest else 0


# The device's floor under top_p: a validated top_p (in (0, 1]) as small as 1e-300 is 0 in fp32 (and a
# subnormal may be flushed to 0), a budget that would drop even the best token. Any top_p below the best
# token's probability keeps that token alone, as this does (it is at least 1 / vocabulary, far above).
MIN_TOP_P = 1e-30
# And under the repetition penalty (in (0, 100]): 1e-300 is 0 in fp32, and the seen tokens' logits divided by
# it were +inf. At 1e-30 they stay finite (|logit| < 1e8) and the best seen token still wins.
MIN_REPETITION_PENALTY = 1e-30

# A row's top-k candidates come from ``torch.topk`` instead of a sort of the whole vocabulary when every
# sampled row of the batch limits top-k to at most this many tokens.
MAX_TOPK_CANDIDATES = 1024


# CUDA batches without top-k sample through kernels/top_p_sample.py; False: the masks below and a sort (the
# A/B switch of bench/sampler.py).
SORT_FREE_TOP_P = True
# CUDA batches with top-k too (the kernel's radix select instead of torch.topk and the masks over its
# candidates): off, since on an H200 it was slower than torch.topk (1.39 against 0.97 ms at one row with
# top-k 50; bench/sampler.py, "sort-free" rows).
SORT_FREE_TOP_K = envs.get("G4SERVE_SORT_FREE_TOP_K") == "1"
# CUDA batches that ``SamplingBatch.chunk_top_k`` admits sample over vocabulary chunks
# (kernels/chunked_sample.py): on by default, since on an H100 e4b decode with Gemma's top-k 64 / top-p 0.95
# took 4.08 / 4.87 / 6.37 ms a step at B = 1 / 8 / 64 against 4.21 / 5.00 / 6.58 without it.
CHUNKED_SAMPLING = envs.get("G4SERVE_CHUNKED_SAMPLING") == "1"


def _candidates(logits: torch.Tensor, b: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(logits, ids) of each row's ``max_top_k`` best tokens, best first, when every sampled row sets a top-k
    of at most MAX_TOPK_CANDIDATES: the tokens past the largest k are dropped anyway. None otherwise."""
    if b.max_top_k is None or b.max_top_k > MAX_TOPK_CANDIDATES:
        return None
    return logits.topk(min(b.max_top_k, logits.shape[-1]), dim=-1)


def _filter_sorted(sorted_logits: torch.Tensor, b: SamplingBatch, vocab: int) -> torch.Tensor:
    """Top-k, then top-p over rows sorted best first (all of a row's tokens, or its candidates): -inf where
    they drop a token."""
    k = torch.where(b.top_k > 0, b.top_k.clamp(max=vocab), torch.full_like(b.top_k, vocab))
    kth = sorted_logits.gather(1, (k - 1).clamp(max=sorted_logits.shape[1] - 1).unsqueeze(1))
    drop = sorted_logits < kth
    if b.uses_top_p:
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        mass_before = probs.cumsum(dim=-1) - probs
        drop |= mass_before >= b.top_p.unsqueeze(1)
    return sorted_logits.masked_fill(drop, float("-inf"))


def _min_p(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    probs = logits.softmax(dim=-1)
    threshold = b.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


def _top_k_top_p_min_p(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """Mask (-inf) what top-k, then top-p, then min-p filter out, as transformers' warpers and vLLM do:
    top-k keeps the tokens scoring at least the k-th best (ties included), top-p is taken over the
    distribution renormalised to what top-k kept, min-p is relative to the most likely token."""
    if b.uses_top_k or b.uses_top_p:
        sorted_logits, order = _candidates(logits, b) or logits.sort(dim=-1, descending=True)
        kept = _filter_sorted(sorted_logits, b, logits.shape[-1])
        logits = torch.full_like(logits, float("-inf")).scatter_(-1, order, kept)
    if b.uses_min_p:
        logits = _min_p(logits, b)
    return logits


def _race(scaled: torch.Tensor, b: SamplingBatch, noise: torch.Tensor) -> torch.Tensor:
    """The exponential race ``argmax p / q`` over the tokens the filters keep, for rows of temperature-scaled
    logits. With top-k candidates it runs over them alone (min-p is relative to the best token, one of
    them): the same winner as masking the whole row, without passes over the vocabulary."""
    candidates = _candidates(scaled, b)
    if candidates is None:
        return (_top_k_top_p_min_p(scaled, b).softmax(dim=-1) / noise).argmax(dim=-1)
    values, ids = candidates
    kept = _filter_sorted(values, b, scaled.shape[-1])
    if b.uses_min_p:
        kept = _min_p(kept, b)
    winner = (kept.softmax(dim=-1) / noise.gather(1, ids)).argmax(dim=-1, keepdim=True)
    return ids.gather(1, winner).squeeze(1)


def _sample_rows(logits: torch.Tensor, temp: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """The race over fp32 ``logits`` with the batch's [B, V] noise: the one-program-a-row kernel on CUDA, the
    torch masks (or the top-k candidates) elsewhere."""
    noise = exponential_noise(b.seeds, b.positions, logits.shape[-1])
    if logits.is_cuda and SORT_FREE_TOP_P and (SORT_FREE_TOP_K or not b.uses_top_k):
        # Temperature, top-k, top-p and min-p in one kernel that searches the kept set instead of sorting.
        top_k = b.top_k if b.uses_top_k else None
        return top_p_sample(logits, temp, b.top_p, b.min_p, noise, top_k=top_k)
    return _race(logits / temp.unsqueeze(1), b, noise)


def sample(logits: torch.Tensor, b: SamplingBatch) -> SamplerOutput:
    """``logits`` [B, V] (any float dtype) -> one token per row."""
    chunked = logits.is_cuda and CHUNKED_SAMPLING and not b.all_greedy and b.chunk_top_k is not None
    if not chunked or b.output_counts is not None or b.logit_bias is not None or b.allowed is not None:
        logits = logits.float()  # (the chunked kernels read the model's dtype as it is)
    raw = logits
    if b.output_counts is not None:
        logits = _apply_penalties(logits, b)
    if b.logit_bias is not None:
        logits = logits + b.logit_bias
    if b.allowed is not None:
        logits = logits.masked_fill(~b.allowed, float("-inf"))
    if b.all_greedy:
        tokens = logits.argmax(dim=-1)
    else:
        temp = torch.where(b.temperature > 0, b.temperature, torch.ones_like(b.temperature))
        if chunked:
            # Many programs a row, the noise drawn in place: no [B, V] noise or float copy through memory.
            top_k = b.top_k if b.chunk_top_k else None
            sampled = chunked_sample(
                logits, temp, b.min_p, b.seeds, b.positions, top_k, b.top_p, b.chunk_top_k or 0
            )
        else:
            sampled = _sample_rows(logits, temp, b)
        # (no argmax pass over the vocabulary when every row samples)
        tokens = torch.where(b.temperature > 0, sampled, logits.argmax(dim=-1)) if b.any_greedy else sampled
    if b.num_logprobs is None:
        return SamplerOutput(tokens, None, None, None)
    logprobs = raw.float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    top_ids = top_vals = None
    if b.num_logprobs > 0:
        top_vals, top_ids = logprobs.topk(b.num_logprobs, dim=-1)
    return SamplerOutput(tokens, chosen, top_ids, top_vals)
