"""KVCacheManager alone: block accounting, the sliding-window ring, KV-shared layers, prefix caching.

No model and no tensors: a small hand-built text config (the tiny preset's layer pattern
``S S F S S F`` with its last 2 layers KV-shared, window 8) and pools of a few blocks of 4 tokens.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from g4serve.config import FULL, SLIDING, TextConfig, preset
from g4serve.engine.kv_cache import KVCacheManager, PagedKVCache
from g4serve.engine.kv_cache.planning import max_sequence_tokens, plan_kv_blocks

BS = 4  # tokens per block
WINDOW = 8  # sliding window: a query at position p sees keys p-7 .. p


def text_config(num_kv_shared_layers: int = 2) -> TextConfig:
    """The tiny preset's text config (layers S S F S S F, sliding head_dim 16, global 32, 2 KV heads) with
    a window of 8."""
    return dataclasses.replace(
        preset("tiny").text, sliding_window=WINDOW, num_kv_shared_layers=num_kv_shared_layers
    )


def manager(full: int = 16, sliding: int = 16, prefix_caching: bool = True) -> KVCacheManager:
    return KVCacheManager(text_config(), {FULL: full, SLIDING: sliding}, BS, prefix_caching)


def hashes(tokens: list[int]) -> list[bytes]:
    return KVCacheManager.hash_blocks(tokens, BS)


def live(table: list[int]) -> list[int]:
    return [b for b in table if b >= 0]


def run_prefill(kv: KVCacheManager, seq_id: str, tokens: list[int]) -> list[bytes]:
    """Allocate and 'compute' ``tokens`` in one chunk, registering its full blocks as the engine does at
    launch; returns the block hashes."""
    digests = hashes(tokens)
    assert kv.allocate(seq_id, 0, len(tokens))
    kv.register_computed_blocks(seq_id, digests, len(tokens))
    return digests


def snapshot(kv: KVCacheManager) -> tuple:
    return (
        {n: (p.num_free, list(p.ref_count), dict(p.cached)) for n, p in kv.pools.items()},
        {s: {n: list(t) for n, t in seq.tables.items()} for s, seq in kv.seqs.items()},
    )


# ---- allocation -------------------------------------------------------------------------------------


def test_blocks_needed_rounds_up_to_whole_blocks():
    kv = manager()
    assert kv.blocks_needed("a", 0, 1) == {FULL: 1, SLIDING: 1}
    assert kv.blocks_needed("a", 0, 4) == {FULL: 1, SLIDING: 1}
    assert kv.blocks_needed("a", 0, 10) == {FULL: 3, SLIDING: 3}
    assert kv.capacity_tokens() == {FULL: 16 * BS, SLIDING: 16 * BS}


def test_block_table_grows_across_chunks():
    kv = manager()
    assert kv.allocate("a", 0, 10)  # tokens 0..9: 3 blocks per pool
    tables = kv.block_tables("a")
    assert [len(tables[FULL]), len(tables[SLIDING])] == [3, 3]
    first_blocks = list(tables[FULL])
    assert kv.blocks_needed("a", 10, 5) == {FULL: 1, SLIDING: 1}  # block 2 has room for 2 more tokens
    assert kv.allocate("a", 10, 5)  # tokens 10..14: ceil(15 / 4) = 4 blocks
    assert len(tables[FULL]) == 4 and tables[FULL][:3] == first_blocks  # grows, never reshuffles
    assert len(tables[SLIDING]) == 4  # query 10 still sees key 3 (block 0): nothing freed yet
    assert {n: p.num_used for n, p in kv.pools.items()} == {FULL: 4, SLIDING: 4}
    assert len(set(tables[FULL])) == 4  # distinct blocks
    assert kv.allocate("a", 15, 1)  # position 15 is still in block 3: no new block
    assert len(tables[FULL]) == 4
    # ... but query 15 sees keys 8..15 only: sliding blocks 0 and 1 went back to the pool.
    assert tables[SLIDING][:2] == [-1, -1]
    assert {n: p.num_used for n, p in kv.pools.items()} == {FULL: 4, SLIDING: 2}


def test_free_returns_every_block():
    kv = manager()
    assert kv.allocate("a", 0, 10)
    assert kv.allocate("b", 0, 7)
    assert kv.allocate("a", 10, 20)
    kv.free("a")
    kv.free("b")
    assert kv.seqs == {}
    for pool in kv.pools.values():
        assert pool.num_free == pool.num_blocks == 16
        assert pool.ref_count == [0] * 16
    kv.free("a")  # freeing an unknown / already freed sequence is a no-op
    assert all(p.num_free == 16 for p in kv.pools.values())


def test_allocation_failure_returns_false_and_changes_nothing():
    kv = manager(full=4, sliding=16)
    assert kv.allocate("a", 0, 12)  # 3 of the 4 full blocks
    before = snapshot(kv)
    assert not kv.can_allocate("b", 0, 8)
    assert kv.allocate("b", 0, 8) is False  # needs 2 full blocks, 1 is free
    assert kv.allocate("a", 12, 8) is False  # growing "a" by 2 blocks does not fit either
    assert snapshot(kv) == before
    assert "b" not in kv.seqs
    assert kv.allocate("b", 0, 4)  # exactly the last block still fits
    assert kv.pools[FULL].num_free == 0


def test_exhausted_pool_raises_in_block_pool():
    kv = manager(full=1)
    pool = kv.pools[FULL]
    pool.allocate()
    with pytest.raises(MemoryError, match="out of blocks"):
        pool.allocate()


# ---- sliding-window pool ------------------------------------------------------------------------------


def test_sliding_blocks_leave_the_window_full_blocks_stay():
    kv = manager(full=16, sliding=16)
    assert kv.allocate("a", 0, 8)
    for pos in range(8, 40):  # decode one token at a time up to 40 tokens
        assert kv.allocate("a", pos, 1)
    tables = kv.block_tables("a")
    # The next query (position 39) sees keys 32..39: blocks 8 and 9. Blocks 0..7 went back.
    assert len(tables[FULL]) == 10 and len(live(tables[FULL])) == 10
    assert tables[SLIDING][:8] == [-1] * 8
    assert len(live(tables[SLIDING])) == 2
    assert kv.pools[FULL].num_used == 10
    assert kv.pools[SLIDING].num_used == 2


def test_first_needed_sliding_block():
    kv = manager()
    # Query starting at p sees keys > p - 8: the first needed block is max(0, p - 7) // 4.
    got = {p: kv._first_needed_block(SLIDING, p) for p in (0, 7, 8, 10, 11, 12, 22)}
    assert got == {0: 0, 7: 0, 8: 0, 10: 0, 11: 1, 12: 1, 22: 3}
    assert kv._first_needed_block(FULL, 22) == 0


def test_sliding_pool_is_a_ring_for_one_sequence():
    """Three sliding blocks serve a 60-token sequence: allocation counts the blocks it is about to free."""
    kv = manager(full=16, sliding=3)
    assert kv.allocate("a", 0, 8)
    held = []
    for pos in range(8, 60):
        assert kv.allocate("a", pos, 1), pos
        held.append(len(live(kv.block_tables("a")[SLIDING])))
    assert max(held) == 3  # e.g. query 12 sees keys 5..12 (blocks 1, 2, 3)
    assert held[-1] == 2 and kv.pools[SLIDING].num_free == 1  # query 59 sees keys 52..59 (blocks 13, 14)
    assert kv.pools[FULL].num_used == 15  # ceil(60 / 4): the full pool kept every block
    kv.free("a")
    assert kv.pools[SLIDING].num_free == 3 and kv.pools[FULL].num_free == 16


def test_shared_out_of_window_block_is_not_counted_as_freeable():
    """can_allocate counts a sliding block leaving the window as available only if the sequence is its
    last holder: a block shared through the prefix cache stays in use."""
    kv = manager(full=16, sliding=4)
    digests = run_prefill(kv, "a", list(range(100, 112)))  # 12 tokens: sliding blocks s0 s1 s2
    assert kv.find_cached_prefix("b", digests, 13) == 12  # b shares s1 s2 (s0 is outside its window)
    assert kv.block_tables("b")[SLIDING][0] == -1
    assert kv._freeable_now("a", 12) == {SLIDING: 1}  # s0: only a holds it
    assert kv.allocate("a", 12, 1)  # frees s0, takes the last uncached block
    assert kv.allocate("b", 12, 1)  # takes (evicts) s0
    assert kv.pools[SLIDING].num_free == 0
    assert kv._freeable_now("a", 16) == {SLIDING: 0}  # s1 leaves a's window but b still reads it
    assert not kv.can_allocate("a", 16, 1)
    kv.free("b")
    assert kv.allocate("a", 16, 1)


# ---- KV-shared layers ------------------------------------------------------------------------------------


def test_kv_shared_layers_add_no_pool_and_no_bytes():
    # S S F S S F with the last 2 layers KV-shared: producers are layers 0, 1, 3 (sliding) and 2 (full).
    shared, unshared = text_config(num_kv_shared_layers=2), text_config(num_kv_shared_layers=0)
    assert shared.kv_producer_layers == [0, 1, 2, 3]
    kv = KVCacheManager(shared, {FULL: 8, SLIDING: 8}, BS)
    assert kv.pool_types == [FULL, SLIDING]  # one pool per layer type, not per layer
    assert kv.allocate("a", 0, 5)
    assert set(kv.block_tables("a")) == {FULL, SLIDING}
    # One 4-token fp32 block per layer: 2 (K, V) * 4 tokens * 2 KV heads * head_dim * 4 bytes.
    sliding_layer, full_layer = 2 * BS * 2 * 16 * 4, 2 * BS * 2 * 32 * 4
    assert (sliding_layer, full_layer) == (1024, 2048)
    assert PagedKVCache.bytes_per_block(shared, BS, torch.float32) == {
        SLIDING: 3 * sliding_layer,  # layer 4 reads layer 3's cache
        FULL: 1 * full_layer,  # layer 5 reads layer 2's cache
    }
    assert PagedKVCache.bytes_per_block(unshared, BS, torch.float32) == {
        SLIDING: 4 * sliding_layer,
        FULL: 2 * full_layer,
    }


def test_storage_has_tensors_for_producer_layers_only():
    cache = PagedKVCache(text_config(), {FULL: 3, SLIDING: 5}, BS, torch.float32, "cpu")
    shapes = {layer: tuple(t.shape) for layer, t in cache.kv.items()}  # layers 4, 5 (KV-shared): none
    assert shapes == {
        0: (2, 5 * BS, 2, 16),
        1: (2, 5 * BS, 2, 16),
        2: (2, 3 * BS, 2, 32),
        3: (2, 5 * BS, 2, 16),
    }


# ---- prefix cache --------------------------------------------------------------------------------------

PROMPT = list(range(100, 112))  # 12 tokens: 3 full blocks


def test_hash_blocks_chain_full_blocks_only():
    digests = hashes(PROMPT + [7, 8])  # 14 tokens: the partial 4th block gets no hash
    assert len(digests) == 3 and len(set(digests)) == 3
    assert hashes(PROMPT[:8]) == digests[:2]  # same prefix, same digests
    other = hashes([999] + PROMPT[1:])  # a different first token changes every later digest (chained)
    assert all(a != b for a, b in zip(other, digests))
    assert KVCacheManager.hash_blocks(PROMPT[4:], BS, previous=digests[0]) == digests[1:]


def test_same_prefix_shares_blocks():
    kv = manager()
    digests = run_prefill(kv, "a", PROMPT)
    a_full = list(kv.block_tables("a")[FULL])
    a_sliding = list(kv.block_tables("a")[SLIDING])
    # "b" = the same 12 tokens and 2 more: all 3 full blocks hit.
    assert kv.find_cached_prefix("b", digests, 14) == 12
    b = kv.block_tables("b")
    assert b[FULL] == a_full
    assert [kv.pools[FULL].ref_count[x] for x in a_full] == [2, 2, 2]
    # Sliding: a query at 12 sees keys 5..12, so block 0 is not needed, blocks 1 and 2 are shared.
    assert b[SLIDING] == [-1] + a_sliding[1:]
    assert [kv.pools[SLIDING].ref_count[x] for x in a_sliding] == [1, 2, 2]
    assert kv.pools[FULL].num_used == 3  # nothing new allocated for the hit
    assert (kv.prefix_queries, kv.prefix_query_tokens, kv.prefix_hit_tokens) == (1, 14, 12)


def test_hit_never_covers_the_whole_prompt():
    kv = manager()
    digests = run_prefill(kv, "a", PROMPT)
    # The identical 12-token prompt: at most (12 - 1) // 4 = 2 blocks, one token is left to compute.
    assert kv.find_cached_prefix("b", digests, 12) == 8
    assert len(kv.block_tables("b")[FULL]) == 2


def test_hit_stops_at_first_differing_block_and_partial_blocks_never_hit():
    kv = manager()
    run_prefill(kv, "a", PROMPT)
    assert kv.find_cached_prefix("b", hashes(PROMPT[:4] + [1, 2, 3, 4] + PROMPT[8:]), 13) == 4
    assert kv.find_cached_prefix("c", hashes(PROMPT[:10]), 10) == 8  # tokens 8, 9: a partial block
    assert kv.find_cached_prefix("d", hashes([5] + PROMPT[1:]), 13) == 0
    assert "d" not in kv.seqs


def test_blocks_not_yet_computed_are_not_findable():
    kv = manager()
    digests = hashes(PROMPT)
    assert kv.allocate("a", 0, 12)
    kv.register_computed_blocks("a", digests, 6)  # only block 0 is fully computed
    assert kv.find_cached_prefix("b", digests, 13) == 4


def test_prefix_caching_disabled_never_hits():
    kv = manager(prefix_caching=False)
    digests = run_prefill(kv, "a", PROMPT)
    assert kv.pools[FULL].cached == {}
    assert kv.find_cached_prefix("b", digests, 13) == 0


def test_freed_blocks_stay_findable_until_evicted():
    kv = manager()
    digests = run_prefill(kv, "a", PROMPT)
    a_full = list(kv.block_tables("a")[FULL])
    kv.free("a")
    assert kv.pools[FULL].num_free == 16  # cached blocks count as free
    assert [kv.pools[FULL].lookup(d) for d in digests] == a_full
    assert kv.find_cached_prefix("b", digests, 13) == 12
    assert kv.block_tables("b")[FULL] == a_full  # the very same blocks, taken back from the LRU
    assert [kv.pools[FULL].ref_count[x] for x in a_full] == [1, 1, 1]
    assert kv.pools[FULL].num_free == 13


def test_allocation_takes_uncached_blocks_before_evicting():
    kv = manager(full=4, sliding=4)
    digests = run_prefill(kv, "a", PROMPT)  # 3 blocks, all cached after the free
    kv.free("a")
    assert kv.allocate("b", 0, 4)  # the one never-hashed block first
    assert all(kv.pools[FULL].lookup(d) is not None for d in digests)
    assert kv.allocate("c", 0, 4)  # now one cached block must go
    assert sum(kv.pools[FULL].lookup(d) is not None for d in digests) == 2


def test_eviction_is_lru_and_a_prefix_tail_goes_first():
    kv = manager(full=4, sliding=4)
    a = run_prefill(kv, "a", PROMPT[:8])  # 2 blocks each
    kv.free("a")
    b = run_prefill(kv, "b", PROMPT[4:12])
    kv.free("b")
    pool = kv.pools[FULL]
    assert pool.num_free == 4 and len(pool.cached) == 4
    # "a" was freed first, and free() releases a sequence's last block first: a[1] is the oldest.
    assert kv.allocate("x", 0, 4)
    assert (pool.lookup(a[1]), pool.lookup(a[0]) is not None) == (None, True)
    assert kv.allocate("y", 0, 4)
    assert pool.lookup(a[0]) is None and all(pool.lookup(d) is not None for d in b)


def test_reused_cached_block_becomes_most_recent():
    kv = manager(full=4, sliding=4)
    a = run_prefill(kv, "a", PROMPT[:8])
    kv.free("a")
    b = run_prefill(kv, "b", PROMPT[4:12])
    kv.free("b")
    # A hit on a's prefix takes its blocks out of the LRU; freed again, they are the newest.
    assert kv.find_cached_prefix("c", a, 9) == 8
    kv.free("c")
    pool = kv.pools[FULL]
    assert kv.allocate("x", 0, 8)  # evicts 2 blocks: b's, not the recently used a's
    assert all(pool.lookup(d) is not None for d in a)
    assert all(pool.lookup(d) is None for d in b)


def test_referenced_cached_blocks_are_never_evicted():
    kv = manager(full=4, sliding=4)
    a = run_prefill(kv, "a", PROMPT[:8])  # still held by "a"
    b = run_prefill(kv, "b", PROMPT[4:12])
    kv.free("b")
    a_full = list(kv.block_tables("a")[FULL])
    assert kv.allocate("x", 0, 8)  # 2 blocks: both come from b's freed blocks
    assert not set(kv.block_tables("x")[FULL]) & set(a_full)
    assert all(kv.pools[FULL].lookup(d) is None for d in b)
    assert kv.allocate("y", 0, 1) is False  # only referenced blocks left: nothing to evict
    assert [kv.pools[FULL].lookup(d) for d in a] == a_full
    assert [kv.pools[FULL].ref_count[x] for x in a_full] == [1, 1]


def test_reset_prefix_cache_forgets_free_blocks_only():
    kv = manager()
    a = run_prefill(kv, "a", PROMPT[:8])
    b = run_prefill(kv, "b", PROMPT[4:12])
    kv.free("b")
    kv.reset_prefix_cache()
    assert all(kv.pools[FULL].lookup(d) is not None for d in a)  # still referenced by "a"
    assert all(kv.pools[FULL].lookup(d) is None for d in b)
    assert kv.pools[FULL].num_free == 14


# ---- planning: blocks per pool, the longest sequence ---------------------------------------------------
def test_plan_gives_the_sliding_pool_a_window_per_sequence_and_the_rest_to_full():
    text = text_config()
    per_block = PagedKVCache.bytes_per_block(text, BS, torch.float32)
    # each sliding sequence holds ceil(window 8 / 4) + 2 = 4 blocks; a step's chunks ceil(8 / 4) = 2 more
    budget = 1000 * per_block[FULL]
    plan = plan_kv_blocks(text, BS, torch.float32, budget, max_num_seqs=3, max_num_batched_tokens=8)
    assert plan == {SLIDING: 14, FULL: (budget - 14 * per_block[SLIDING]) // per_block[FULL]}
    # a small budget: the sliding pool takes half of it
    small = plan_kv_blocks(text, BS, torch.float32, 4 * per_block[FULL], 64, 8)
    assert small[SLIDING] == (2 * per_block[FULL]) // per_block[SLIDING]
    # or more, while the full pool still holds one sequence of max_model_len tokens (one block here)
    short = plan_kv_blocks(text, BS, torch.float32, 4 * per_block[FULL], 64, 8, max_model_len=BS)
    assert short[SLIDING] == (3 * per_block[FULL]) // per_block[SLIDING] and short[FULL] >= 1
    assert small[FULL] == (4 * per_block[FULL] - small[SLIDING] * per_block[SLIDING]) // per_block[FULL]
    with pytest.raises(MemoryError, match="kv_cache"):
        plan_kv_blocks(text, BS, torch.float32, 0, 4, 8)


def test_with_prefix_caching_the_sliding_pool_grows_to_the_full_pools_tokens_within_half_the_budget():
    """Cached prefixes need their sliding window too: with prefix caching the sliding pool grows past the
    running windows, to as many tokens as the full pool holds, but never past half the budget."""
    text = text_config()
    per_block = PagedKVCache.bytes_per_block(text, BS, torch.float32)
    both = per_block[SLIDING] + per_block[FULL]
    budget = 1000 * per_block[FULL]
    plain = plan_kv_blocks(text, BS, torch.float32, budget, max_num_seqs=3, max_num_batched_tokens=8)
    grown = plan_kv_blocks(text, BS, torch.float32, budget, 3, 8, prefix_caching=True)
    assert plain[SLIDING] == 14 < grown[SLIDING]
    assert grown[SLIDING] == min(budget // both, (budget // 2) // per_block[SLIDING])
    assert grown[FULL] == (budget - grown[SLIDING] * per_block[SLIDING]) // per_block[FULL]
    assert grown[SLIDING] * per_block[SLIDING] <= budget // 2
    if per_block[SLIDING] <= per_block[FULL]:  # the cap not reached: as many tokens in each pool
        assert abs(grown[SLIDING] - grown[FULL]) <= 1
    # a budget the running windows already fill past half: nothing changes
    tight = 4 * per_block[FULL]
    assert plan_kv_blocks(text, BS, torch.float32, tight, 64, 8, prefix_caching=True) == plan_kv_blocks(
        text, BS, torch.float32, tight, 64, 8
    )


def test_31b_with_an_fp8_cache_holds_32_sequences_of_8k_tokens():
    """The issue's capacity target, in the block manager's own accounting: 26 GB is a little less than the
    KV budget an H100 had left beside 31B's FP8 weights (26.2 GB measured, bench/spec_decode.py --fit)."""
    text = preset("31b").text
    plan = plan_kv_blocks(
        text,
        16,
        torch.float8_e4m3fn,
        26 * 10**9,
        max_num_seqs=32,
        max_num_batched_tokens=2048,
        prefix_caching=True,
    )
    kv = KVCacheManager(text, plan, 16)
    need = kv.blocks_needed("probe", 8192 - 1, 1)
    assert need[SLIDING] <= text.sliding_window // 16 + 2  # the window only
    assert all(32 * need[pool] <= plan[pool] for pool in need)


def test_the_longest_sequence_fits_both_pools_alone():
    text = text_config()
    assert max_sequence_tokens({FULL: 64, SLIDING: 64}, text, BS, 8) == 64  # the sliding ring suffices
    # a sliding pool smaller than window + chunk + a block caps the sequence too
    assert max_sequence_tokens({FULL: 64, SLIDING: 16}, text, BS, 8) == 12
    assert max_sequence_tokens({SLIDING: 64}, text, BS, 8) is None  # sliding-only, ring large enough
