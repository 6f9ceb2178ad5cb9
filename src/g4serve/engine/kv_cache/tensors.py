"""The paged KV cache's storage: ``PagedKVCache``, the tensors whose blocks ``blocks.py`` accounts for.

The attention backends (``layers.attention``) read and write it through the slot mappings and block
tables of ``AttentionMetadata``; they are handed this object and use only its ``kv`` and ``write``
(the ``KVTensors`` protocol there), since the layers sit below the engine.
"""

from __future__ import annotations

import torch

from g4serve.config import FULL, SLIDING, TextConfig


class PagedKVCache:
    """K/V storage: per KV-producing layer a [2, num_blocks * block_size, Hkv, D] tensor.

    Layers of one type share a pool: the same block id addresses the same token range in every
    layer of that type, so one block table per pool and sequence suffices.
    """

    def __init__(
        self,
        cfg: TextConfig,
        num_blocks: dict[str, int],
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        self.block_size = block_size
        self.num_blocks = dict(num_blocks)
        self.layer_pool: dict[int, str] = {}
        self.kv: dict[int, torch.Tensor] = {}
        for layer in cfg.kv_producer_layers:
            pool = cfg.layer_types[layer]
            self.layer_pool[layer] = pool
            self.kv[layer] = torch.zeros(
                2,
                num_blocks[pool] * block_size,
                cfg.layer_num_kv_heads(layer),
                cfg.layer_head_dim(layer),
                dtype=dtype,
                device=device,
            )

    @staticmethod
    def bytes_per_block(cfg: TextConfig, block_size: int, dtype: torch.dtype) -> dict[str, int]:
        """Bytes one block costs in each pool, summed over the pool's KV-producing layers."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        out = {SLIDING: 0, FULL: 0}
        for layer in cfg.kv_producer_layers:
            out[cfg.layer_types[layer]] += (
                2 * block_size * cfg.layer_num_kv_heads(layer) * cfg.layer_head_dim(layer) * itemsize
            )
        return out

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        keep = slots >= 0
        if not bool(keep.all()):
            k, v, slots = k[keep], v[keep], slots[keep]
        self.kv[layer_idx][0].index_copy_(0, slots, k.to(self.kv[layer_idx].dtype))
        self.kv[layer_idx][1].index_copy_(0, slots, v.to(self.kv[layer_idx].dtype))
