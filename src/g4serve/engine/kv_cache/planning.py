"""How many KV blocks each pool gets, and how long one sequence may then grow.

Pure functions of the model's text config and the engine's limits (no tensors), so the unit tests check
them without a model. ``kv_budget`` is the one place that asks the device how much memory is free.
"""

from __future__ import annotations

import torch

from g4serve.config import FULL, SLIDING, TextConfig
from g4serve.engine.kv_cache.tensors import PagedKVCache

CPU_KV_BYTES = 256 << 20  # the KV budget on CPU when none is given


def activation_reserve(text: TextConfig, max_num_batched_tokens: int, dtype: torch.dtype) -> int:
    """Bytes kept free for one step's activations (the widest intermediate, twice) plus 1 GiB of slack."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    width = max(text.intermediate_size * 2, text.vocab_size // 8, text.hidden_size * 8)
    return 2 * max_num_batched_tokens * width * itemsize + (1 << 30)


def kv_budget(device: torch.device, gpu_memory_utilization: float, reserve: int) -> int:
    """Bytes the KV cache may take: the allowed share of the GPU minus what others use and ``reserve``."""
    if device.type != "cuda":
        return CPU_KV_BYTES
    free, total = torch.cuda.mem_get_info(device)
    return int(total * gpu_memory_utilization) - (total - free) - reserve


def plan_kv_blocks(
    text: TextConfig,
    block_size: int,
    dtype: torch.dtype,
    budget: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int | None = None,
    prefix_caching: bool = False,
) -> dict[str, int]:
    """Blocks per pool within ``budget`` bytes. A sliding sequence holds its window (plus a block either
    side: partial blocks, drafts); a step's chunks add at most ``max_num_batched_tokens`` between them. The
    sliding pool takes that for ``max_num_seqs`` sequences, the full pool the rest. When both cannot have
    it, the sliding pool takes half the budget, or more as long as the full pool still holds one sequence
    of ``max_model_len`` tokens (default: the model's context). Sliding K/V can cost ten times the full
    layers' per token (31B: 50 sliding layers of 16 heads against 10 full layers of 4), so an even split
    starved 32 sliding sequences while the full pool had room for 32 of 10k tokens.

    With ``prefix_caching``, the sliding pool then grows until it holds as many tokens as the full pool,
    taking at most half the budget. A prefix hit needs the sliding K/V of the window before it, and freed
    sliding blocks stay cached only until the pool reuses them: a pool sized for the running windows alone
    forgot every prompt within seconds under load (e4b on an H200: 72k sliding tokens beside 6.7M full
    ones, so replaying a sweep's requests a minute later hit 6% of their tokens, the chat template's)."""
    if budget <= 0:
        raise MemoryError(
            "kv_cache: no memory left for the KV cache; lower max_num_batched_tokens or use a smaller model"
        )
    per_block = PagedKVCache.bytes_per_block(text, block_size, dtype)
    out = {SLIDING: 0, FULL: 0}
    if per_block[SLIDING]:
        need = max_num_seqs * (-(-text.sliding_window // block_size) + 2)
        need += -(-max_num_batched_tokens // block_size)
        share = budget
        if per_block[FULL]:
            longest = -(-(max_model_len or text.max_position_embeddings) // block_size) * per_block[FULL]
            share = budget - min(budget // 2, longest)
        out[SLIDING] = max(1, min(need, share // per_block[SLIDING]))
        if prefix_caching and per_block[FULL]:
            as_many_tokens = budget // (per_block[SLIDING] + per_block[FULL])
            at_most = (budget // 2) // per_block[SLIDING]  # the full pool keeps what the rule above gave it
            out[SLIDING] = max(out[SLIDING], min(as_many_tokens, at_most))
        budget -= out[SLIDING] * per_block[SLIDING]
    if per_block[FULL]:
        out[FULL] = max(1, budget // per_block[FULL])
    return out


def max_sequence_tokens(
    capacity: dict[str, int], text: TextConfig, block_size: int, max_num_batched_tokens: int
) -> int | None:
    """The longest sequence the pools hold alone (None: no limit). One sequence must always fit, or
    preemption could never make room for it: the full pool's capacity, and the sliding pool's when that is
    smaller than a window plus a chunk."""
    limit = capacity.get(FULL) or None
    sliding = capacity.get(SLIDING, 0)
    if sliding and sliding < text.sliding_window + max_num_batched_tokens + block_size:
        limit = min(limit or sliding, sliding - block_size)
    return limit
