"""Block accounting for the Gemma 4 paged KV cache: one pool per layer type, prefix caching.

- Full-attention pool: a sequence's blocks grow with its context.
- Sliding-window pool: a sequence keeps only the blocks covering its last ``sliding_window``
  tokens (plus the tokens being computed); blocks that fall out of the window go back to the
  pool at once.
- KV-shared layers own no blocks: they read their producer layer's cache (see PagedKVCache).

Blocks are addressed by id; the tensors live in ``tensors.py: PagedKVCache``. Full blocks
are hashed by their tokens (chained with the previous block's hash, and the content hash of
any image/video/audio they overlap) and stay findable after their owner frees them, until the
pool needs the space (LRU), so later requests with the same prefix reuse them.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

from g4serve.config import FULL, SLIDING, TextConfig


class BlockPool:
    """Fixed set of block ids with reference counts and an LRU of free-but-cached blocks."""

    def __init__(self, name: str, num_blocks: int):
        self.name = name
        self.num_blocks = num_blocks
        self.ref_count = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> block id
        self._free_uncached = list(range(num_blocks - 1, -1, -1))
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # evictable, oldest first

    @property
    def num_free(self) -> int:
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def allocate(self) -> int:
        if self._free_uncached:
            block = self._free_uncached.pop()
        elif self._free_cached:
            block, _ = self._free_cached.popitem(last=False)
            self._forget(block)
        else:
            raise MemoryError(f"{self.name} pool: out of blocks")
        self.ref_count[block] = 1
        return block

    def touch(self, block: int) -> None:
        """Take a reference to a cached block (a prefix-cache hit)."""
        if self.ref_count[block] == 0:
            self._free_cached.pop(block, None)
        self.ref_count[block] += 1

    def release(self, block: int) -> None:
        self.ref_count[block] -= 1
        assert self.ref_count[block] >= 0, f"{self.name} pool: block {block} released twice"
        if self.ref_count[block] == 0:
            if self.block_hash[block] is not None:
                self._free_cached[block] = None
            else:
                self._free_uncached.append(block)

    def register_hash(self, block: int, digest: bytes) -> None:
        if self.block_hash[block] is not None or digest in self.cached:
            return  # already findable (possibly through another block with the same content)
        self.block_hash[block] = digest
        self.cached[digest] = block

    def lookup(self, digest: bytes) -> int | None:
        return self.cached.get(digest)

    def _forget(self, block: int) -> None:
        digest = self.block_hash[block]
        if digest is not None:
            self.cached.pop(digest, None)
            self.block_hash[block] = None

    def reset_prefix_cache(self) -> None:
        for block in list(self._free_cached):
            self._forget(block)
            self._free_uncached.append(block)
        self._free_cached.clear()


@dataclass
class SequenceBlocks:
    """The blocks one request holds, per pool, indexed by block position (-1: freed/none)."""

    tables: dict[str, list[int]] = field(default_factory=lambda: {FULL: [], SLIDING: []})
    block_hashes: list[bytes] = field(default_factory=list)  # hashes of the request's full blocks
    num_registered: int = 0  # leading full blocks already registered in the prefix cache


class KVCacheManager:
    def __init__(
        self, cfg: TextConfig, num_blocks: dict[str, int], block_size: int, enable_prefix_caching: bool = True
    ):
        self.block_size = block_size
        self.window = cfg.sliding_window
        self.pool_types = sorted(set(cfg.layer_types[: cfg.first_kv_shared_layer]))
        self.pools = {name: BlockPool(name, num_blocks[name]) for name in self.pool_types}
        self.enable_prefix_caching = enable_prefix_caching
        self.seqs: dict[str, SequenceBlocks] = {}
        self.prefix_queries = 0
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0

    # ---- capacity ----------------------------------------------------------------------------
    def capacity_tokens(self) -> dict[str, int]:
        return {name: pool.num_blocks * self.block_size for name, pool in self.pools.items()}

    def usage(self) -> dict[str, float]:
        return {name: pool.num_used / max(pool.num_blocks, 1) for name, pool in self.pools.items()}

    def _first_needed_block(self, pool: str, num_computed: int) -> int:
        """Lowest block position a sequence still needs when its next query starts at ``num_computed``."""
        if pool != SLIDING:
            return 0
        return max(0, num_computed - self.window + 1) // self.block_size

    def blocks_needed(self, seq_id: str, num_computed: int, num_new: int) -> dict[str, int]:
        seq = self.seqs.get(seq_id) or SequenceBlocks()
        need = {}
        total_blocks = -(-(num_computed + num_new) // self.block_size)
        for name in self.pool_types:
            have = len(seq.tables[name])
            first = self._first_needed_block(name, num_computed)
            need[name] = max(0, total_blocks - max(have, first))
        return need

    def can_allocate(self, seq_id: str, num_computed: int, num_new: int) -> bool:
        need = self.blocks_needed(seq_id, num_computed, num_new)
        freed = self._freeable_now(seq_id, num_computed)
        return all(need[n] <= self.pools[n].num_free + freed.get(n, 0) for n in self.pool_types)

    def full_blocks_to_hold(self, seq_id: str, num_computed: int, num_tokens: int) -> int:
        """Full-pool blocks a sequence must still take to hold ``num_tokens`` tokens (0 without a full pool).
        Its sliding blocks are not counted: they stay within a window and a chunk, however long it grows."""
        if FULL not in self.pools:
            return 0
        return self.blocks_needed(seq_id, num_computed, max(0, num_tokens - num_computed))[FULL]

    def num_free_full(self) -> int:
        """Free full-pool blocks, cached ones included (0 without a full pool)."""
        return self.pools[FULL].num_free if FULL in self.pools else 0

    def _freeable_now(self, seq_id: str, num_computed: int) -> dict[str, int]:
        seq = self.seqs.get(seq_id)
        if seq is None or SLIDING not in self.pools:
            return {}
        first = self._first_needed_block(SLIDING, num_computed)
        return {
            SLIDING: sum(
                1 for b in seq.tables[SLIDING][:first] if b >= 0 and self.pools[SLIDING].ref_count[b] == 1
            )
        }

    # ---- allocation ---------------------------------------------------------------------------
    def allocate(self, seq_id: str, num_computed: int, num_new: int) -> bool:
        """Make room for tokens [num_computed, num_computed + num_new); False (nothing changed) if full."""
        if not self.can_allocate(seq_id, num_computed, num_new):
            return False
        seq = self.seqs.setdefault(seq_id, SequenceBlocks())
        self.free_out_of_window(seq_id, num_computed)
        total_blocks = -(-(num_computed + num_new) // self.block_size)
        for name in self.pool_types:
            table = seq.tables[name]
            first = self._first_needed_block(name, num_computed)
            while len(table) < first:
                table.append(-1)
            while len(table) < total_blocks:
                table.append(self.pools[name].allocate())
        return True

    def free_out_of_window(self, seq_id: str, num_computed: int) -> None:
        """Give back sliding blocks no future query of this sequence can see."""
        seq = self.seqs.get(seq_id)
        if seq is None or SLIDING not in self.pools:
            return
        first = self._first_needed_block(SLIDING, num_computed)
        table = seq.tables[SLIDING]
        for i in range(min(first, len(table))):
            if table[i] >= 0:
                self.pools[SLIDING].release(table[i])
                table[i] = -1

    def free(self, seq_id: str) -> None:
        seq = self.seqs.pop(seq_id, None)
        if seq is None:
            return
        for name, table in seq.tables.items():
            # Release in reverse so the prefix's first blocks are the last to be evicted.
            for block in reversed(table):
                if block >= 0:
                    self.pools[name].release(block)

    def block_tables(self, seq_id: str) -> dict[str, list[int]]:
        return self.seqs[seq_id].tables

    # ---- prefix caching -------------------------------------------------------------------------
    @staticmethod
    def hash_blocks(
        token_ids: list[int],
        block_size: int,
        extra_keys: list[list[str]] | None = None,
        previous: bytes = b"",
    ) -> list[bytes]:
        """Chained digests of each full block of ``token_ids`` (extra_keys[i]: media hashes overlapping
        block i), continuing the chain after ``previous`` (the digest of the block before the first)."""
        out: list[bytes] = []
        prev = previous
        for i in range(len(token_ids) // block_size):
            h = hashlib.blake2b(prev, digest_size=16)
            h.update(repr(token_ids[i * block_size : (i + 1) * block_size]).encode())
            if extra_keys and extra_keys[i]:
                h.update("|".join(extra_keys[i]).encode())
            prev = h.digest()
            out.append(prev)
        return out

    def find_cached_prefix(self, seq_id: str, block_hashes: list[bytes], num_prompt_tokens: int) -> int:
        """Attach the longest usable cached prefix to a new sequence; returns the number of cached tokens.

        Full layers need every block of the prefix; sliding layers only the blocks in the window
        before the first token still to compute. At least one prompt token is always left to
        compute, so the request gets logits.
        """
        if not self.enable_prefix_caching:
            return 0
        self.prefix_queries += 1
        self.prefix_query_tokens += num_prompt_tokens
        max_blocks = (num_prompt_tokens - 1) // self.block_size
        hashes = block_hashes[:max_blocks]
        n = len(hashes)
        if FULL in self.pools:
            n = next((i for i, h in enumerate(hashes) if self.pools[FULL].lookup(h) is None), n)
        if SLIDING in self.pools:
            while n > 0:
                first = self._first_needed_block(SLIDING, n * self.block_size)
                if all(self.pools[SLIDING].lookup(h) is not None for h in hashes[first:n]):
                    break
                n -= 1
        if n == 0:
            return 0
        seq = self.seqs.setdefault(seq_id, SequenceBlocks())
        for name in self.pool_types:
            first = self._first_needed_block(name, n * self.block_size)
            for i in range(n):
                if i < first:
                    seq.tables[name].append(-1)
                    continue
                block = self.pools[name].lookup(hashes[i])
                self.pools[name].touch(block)
                seq.tables[name].append(block)
        seq.num_registered = n
        self.prefix_hit_tokens += n * self.block_size
        return n * self.block_size

    def register_computed_blocks(self, seq_id: str, block_hashes: list[bytes], num_computed: int) -> None:
        """Make this sequence's newly completed full blocks findable by later requests."""
        if not self.enable_prefix_caching:
            return
        seq = self.seqs.get(seq_id)
        if seq is None:
            return
        done = min(num_computed // self.block_size, len(block_hashes))
        for i in range(seq.num_registered, done):
            for name in self.pool_types:
                block = seq.tables[name][i] if i < len(seq.tables[name]) else -1
                if block >= 0:
                    self.pools[name].register_hash(block, block_hashes[i])
        seq.num_registered = max(seq.num_registered, done)

    def reset_prefix_cache(self) -> None:
        for pool in self.pools.values():
            pool.reset_prefix_cache()

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0
