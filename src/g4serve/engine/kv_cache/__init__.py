"""The Gemma 4 paged KV cache, in two levels as in vLLM.

- ``blocks.py``: block accounting (``KVCacheManager``, one ``BlockPool`` per layer type, prefix caching);
  ids, ref counts and hashes only, never a tensor;
- ``tensors.py``: the storage (``PagedKVCache``), per KV-producing layer one K/V tensor addressed by
  those block ids.
"""

from g4serve.engine.kv_cache.blocks import BlockPool, KVCacheManager, SequenceBlocks
from g4serve.engine.kv_cache.tensors import PagedKVCache

__all__ = ["BlockPool", "KVCacheManager", "PagedKVCache", "SequenceBlocks"]
