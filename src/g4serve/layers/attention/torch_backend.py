"""The attention-backend interface of the text decoder and its plain-PyTorch reference.

The model hands every attention layer a flat batch of tokens (all sequences of a step
concatenated) plus an ``AttentionMetadata`` (``metadata.py``); the backend writes the new K/V into a
paged cache and attends over it. KV-shared layers write nothing and read the cache of their source
layer. The cache's tensors belong to the engine (``engine.kv_cache.PagedKVCache``), which sits above
the layers: backends are handed the cache object and rely only on the ``KVTensors`` members. An FP8 cache
holds K/V divided by per-(layer, KV head) scales: writes quantize, reads multiply the scales back.
Also here: ``dense_attention``, the unpaged attention of the encoders.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from g4serve.config import SLIDING, TextConfig
from g4serve.kernels.kv_cache_write import dequantize_kv_reference
from g4serve.layers.attention.metadata import AttentionMetadata


class KVTensors(Protocol):
    """What the backends use of the paged KV cache (``engine.kv_cache.PagedKVCache``).

    ``kv[layer]``: a [2, num_blocks * block_size, Hkv, D] tensor (K then V) per KV-producing layer,
    addressed by the slots and block tables of ``AttentionMetadata``. ``scales[layer]``: for an FP8 (e4m3)
    cache, a [2, Hkv] fp32 tensor (K row, V row); the cache holds K / scale and V / scale. Empty otherwise.
    """

    kv: dict[int, torch.Tensor]
    scales: dict[int, torch.Tensor]

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store k/v [T, Hkv, D] at ``slots`` [T] of the layer's cache (slots < 0: skipped; FP8 quantizes)."""
        ...


class AttentionBackend(Protocol):
    def attend(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q [T, Hq, D]; k/v [T, Hkv, D] for KV-producing layers, None for shared ones.

        Returns [T, Hq, D]. The attention scale is 1.0 (Gemma 4 normalises q and k instead).
        """
        ...

    def kv_write_target(
        self, layer_idx: int, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
        """(k_cache, v_cache, slots, k_scale, v_scale) for a KV-producing layer whose prologue kernel writes
        its new K/V rows itself (then ``attend`` gets k = v = None; the scales are the FP8 cache's [Hkv] rows,
        else None); None: pass k/v to ``attend`` instead."""
        ...


class TorchAttention:
    """Reference backend: gathers each sequence's K/V from the paged cache and runs masked attention.

    Exact rather than fast: a Python loop over sequences, fp32 softmax. Triton backends must
    match it.
    """

    def __init__(self, cfg: TextConfig, cache: KVTensors):
        self.cfg = cfg
        self.cache = cache
        self.kv_source = [cfg.kv_source_layer(i) for i in range(cfg.num_hidden_layers)]
        self.bidirectional_vision = cfg.use_bidirectional_attention == "vision"

    def kv_write_target(self, layer_idx, meta):
        return None  # the reference path writes K/V itself, from the k/v it is given

    def attend(self, layer_idx, q, k, v, meta):
        cfg = self.cfg
        layer_type = cfg.layer_types[layer_idx]
        src = self.kv_source[layer_idx]
        if k is not None:
            self.cache.write(src, k, v, meta.slot_mapping[layer_type])
        kv = self.cache.kv[src]
        scales = self.cache.scales.get(src)  # FP8: [2, Hkv]
        block_table = meta.block_tables[layer_type]
        window = cfg.sliding_window if layer_type == SLIDING else None
        bs = meta.block_size
        out = torch.empty_like(q)
        starts = meta.query_start_loc_cpu
        for i in range(meta.num_seqs):
            q_lo, q_hi = starts[i], starts[i + 1]
            if q_hi == q_lo:
                continue
            q_pos = meta.positions[q_lo:q_hi]
            kv_hi = meta.seq_lens_cpu[i]
            kv_lo = 0
            if window is not None:
                kv_lo = max(0, int(q_pos.min()) - window + 1)
            kv_pos = torch.arange(kv_lo, kv_hi, device=q.device)
            blocks = block_table[i, kv_pos // bs].long()
            slots = blocks * bs + kv_pos % bs
            keys, values = kv[0][slots], kv[1][slots]  # [S, Hkv, D]
            if scales is not None:
                keys, values = (
                    dequantize_kv_reference(keys, scales[0]),
                    dequantize_kv_reference(values, scales[1]),
                )
            allowed = kv_pos[None, :] <= q_pos[:, None]
            if window is not None:
                if self.bidirectional_vision and meta.bidirectional_spans:
                    for s_lo, s_hi in meta.bidirectional_spans[i]:
                        in_q = (q_pos >= s_lo) & (q_pos < s_hi)
                        in_k = (kv_pos >= s_lo) & (kv_pos < s_hi)
                        allowed |= in_q[:, None] & in_k[None, :]
                allowed &= kv_pos[None, :] > q_pos[:, None] - window
            out[q_lo:q_hi] = _masked_attention(q[q_lo:q_hi], keys, values, allowed)
        return out


def _masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor
) -> torch.Tensor:
    """q [L, Hq, D], k/v [S, Hkv, D], allowed [L, S] -> [L, Hq, D]; scale 1.0.

    Scores, softmax and the weighted sum run in fp32 whatever the input dtype, as a flash kernel's
    accumulators do (Gemma 4's unscaled q·k reaches tens; bf16 scores would be off by ~0.1-0.25).
    In fp32 this is exactly transformers' eager attention.
    """
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("lhd,shd->hls", q.float(), k.float())
    scores = scores.masked_fill(~allowed[None], torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hls,shd->lhd", probs, v.float()).to(q.dtype)


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attend: torch.Tensor | None
) -> torch.Tensor:
    """Unscaled attention for encoders: q [B, H, N, D], k/v [B, Hkv, M, D], boolean ``attend``
    broadcastable to [B, H, N, M] (None: every key, which lets SDPA pick its flash kernel) -> [B, H, N, D].

    On CPU (the fp32 reference path) this is the eager matmul-softmax-matmul of transformers, so
    outputs match it to the bit; on accelerators it is SDPA (flash / memory-efficient kernels).
    """
    groups = q.shape[1] // k.shape[1]
    if q.device.type != "cpu":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attend, scale=1.0, enable_gqa=groups > 1)
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3))
    if attend is not None:
        scores = scores.masked_fill(~attend, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)
