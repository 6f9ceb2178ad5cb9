"""The paged KV cache's storage: ``PagedKVCache``, the tensors whose blocks ``blocks.py`` accounts for.

The attention backends (``layers.attention``) read and write it through the slot mappings and block
tables of ``AttentionMetadata``; they are handed this object and use only its ``kv``, ``scales`` and
``write`` (the ``KVTensors`` protocol there), since the layers sit below the engine.
"""

from __future__ import annotations

import torch

from g4serve.config import FULL, SLIDING, TextConfig
from g4serve.kernels.kv_cache_write import KV_FP8_DTYPE, quantize_kv_reference


def kv_cache_dtype(name: str, device: torch.device, backend: str) -> torch.dtype | None:
    """The storage dtype ``EngineConfig.kv_cache_dtype`` names (None for ``auto``: the model's), or a
    ValueError where an FP8 cache cannot work (asked before the model loads): Triton's e4m3 type needs
    compute capability 8.9 (Ada, Hopper) or newer, and the torch path needs float8 casts on the device."""
    if name == "auto":
        return None
    if device.type == "cuda" and backend == "triton":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise ValueError(
                f"kv_cache_dtype: {name} needs a GPU of compute capability 8.9 or newer (this one is "
                f"{major}.{minor}); use kv_cache_dtype auto"
            )
    try:
        ones = torch.ones(2, device=device)
        works = torch.equal(ones.to(KV_FP8_DTYPE).float(), ones)
    except (RuntimeError, TypeError):
        works = False
    if not works:
        raise ValueError(
            f"kv_cache_dtype: this torch ({torch.__version__}) cannot cast to float8_e4m3fn on "
            f"{device.type}; use kv_cache_dtype auto"
        )
    return KV_FP8_DTYPE


class PagedKVCache:
    """K/V storage: per KV-producing layer a [2, num_blocks * block_size, Hkv, D] tensor.

    Layers of one type share a pool: the same block id addresses the same token range in every
    layer of that type, so one block table per pool and sequence suffices. An FP8 (e4m3) cache also has
    ``scales[layer]``, a [2, Hkv] fp32 tensor (K row, V row): a value x is stored as x / scale, saturated to
    +-448 (``kernels.kv_cache_write``), and read back as stored * scale. ``scales`` gives a layer's scales
    (e.g. from the checkpoint); a layer without them gets 1.0.
    """

    def __init__(
        self,
        cfg: TextConfig,
        num_blocks: dict[str, int],
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        scales: dict[int, torch.Tensor] | None = None,
    ):
        self.block_size = block_size
        self.num_blocks = dict(num_blocks)
        self.dtype = dtype
        self.layer_pool: dict[int, str] = {}
        self.kv: dict[int, torch.Tensor] = {}
        self.scales: dict[int, torch.Tensor] = {}  # FP8 only
        for layer in cfg.kv_producer_layers:
            pool = cfg.layer_types[layer]
            self.layer_pool[layer] = pool
            heads = cfg.layer_num_kv_heads(layer)
            self.kv[layer] = torch.zeros(
                2, num_blocks[pool] * block_size, heads, cfg.layer_head_dim(layer), dtype=dtype, device=device
            )
            if dtype == KV_FP8_DTYPE:
                given = (scales or {}).get(layer)
                scale = torch.ones(2, heads) if given is None else given
                assert tuple(scale.shape) == (2, heads), f"layer {layer}: scales {tuple(scale.shape)}"
                self.scales[layer] = scale.to(device=device, dtype=torch.float32).contiguous()

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
        kv = self.kv[layer_idx]
        scales = self.scales.get(layer_idx)
        if scales is not None:  # FP8: quantized here; index_copy_ has no float8 kernel on CPU, so copy bytes
            kv = kv.view(torch.uint8)
            k = quantize_kv_reference(k, scales[0]).view(torch.uint8)
            v = quantize_kv_reference(v, scales[1]).view(torch.uint8)
        kv[0].index_copy_(0, slots, k.to(kv.dtype))
        kv[1].index_copy_(0, slots, v.to(kv.dtype))
