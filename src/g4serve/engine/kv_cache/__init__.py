"""The Gemma 4 paged KV cache, in two levels as in vLLM.

- ``blocks.py``: block accounting (``KVCacheManager``, one ``BlockPool`` per layer type, prefix caching);
  ids, ref counts and hashes only, never a tensor;
- ``tensors.py``: the storage (``PagedKVCache``), per KV-producing layer one K/V tensor addressed by
  those block ids (FP8 with per-head scales, or the model's dtype: ``kv_cache_dtype``).
"""

from g4serve.engine.kv_cache.blocks import BlockPool, KVCacheManager, SequenceBlocks
from g4serve.engine.kv_cache.tensors import PagedKVCache, kv_cache_dtype

__all__ = ["BlockPool", "KVCacheManager", "PagedKVCache", "SequenceBlocks", "kv_cache_dtype"]
