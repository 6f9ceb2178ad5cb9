"""The attention-backend interface of the text decoder and its plain-PyTorch reference.

The model hands every attention layer a flat batch of tokens (all sequences of a step
concatenated) plus an ``AttentionMetadata``; the backend writes the new K/V into a paged
cache and attends over it. Pools: one per layer type ("sliding_attention", "full_attention"),
so the engine can free sliding-window blocks early. KV-shared layers write nothing and read
the cache of their source layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

import torch
import torch.nn.functional as F

from g4serve.config import FULL, SLIDING, TextConfig
from g4serve.transfer import to_device


@dataclass
class AttentionMetadata:
    """Addressing for one step: B sequences, T query tokens in total (flat)."""

    positions: torch.Tensor  # [T] long, absolute position of each query token
    query_start_loc: torch.Tensor  # [B+1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [B] int32, context length of each sequence after this step
    slot_mapping: dict[str, torch.Tensor]  # pool -> [T] long, cache slot to write (-1: skip)
    block_tables: dict[str, torch.Tensor]  # pool -> [B, max_blocks] int32 (-1: no block)
    block_size: int
    query_start_loc_cpu: list[int] = field(default_factory=list)
    seq_lens_cpu: list[int] = field(default_factory=list)
    # Per sequence: (start, end) absolute position ranges whose tokens attend to each other
    # in both directions on sliding layers (images, when the config asks for it).
    bidirectional_spans: list[list[tuple[int, int]]] | None = None
    # Set by CUDA-graph captures, whose CPU lists are placeholders: the longest context the captured
    # step may serve, which fixes each layer's split-KV count for every replay.
    max_decode_len: int | None = None
    # Set by CUDA-graph captures of mixed (prefill + decode) steps: every sequence goes to the varlen
    # kernel, whose grid covers this many query tokens per sequence (shorter ones exit early).
    captured_query_len: int | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    def select_queries(self, token_indices: list[int]) -> AttentionMetadata:
        """Metadata for a subset of the query tokens (sorted), e.g. the last token of each prompt.

        Used for fast prefill past the last KV-producing layer: the cache is already complete,
        so the subset only changes which queries are computed, never what is written.
        """
        starts = self.query_start_loc_cpu
        counts = [0] * self.num_seqs
        seq = 0
        for idx in token_indices:
            while idx >= starts[seq + 1]:
                seq += 1
            counts[seq] += 1
        new_starts = [0]
        for c in counts:
            new_starts.append(new_starts[-1] + c)
        idx_t = to_device(token_indices, torch.long, self.positions.device)
        return replace(
            self,
            positions=self.positions[idx_t],
            query_start_loc=to_device(new_starts, torch.int32, self.positions.device),
            query_start_loc_cpu=new_starts,
            slot_mapping={k: torch.full_like(v[idx_t], -1) for k, v in self.slot_mapping.items()},
        )


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
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(k_cache, v_cache, slots) for a KV-producing layer whose prologue kernel writes its new K/V rows
        itself (then ``attend`` gets k = v = None); None: pass k/v to ``attend`` instead."""
        ...


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


class TorchAttention:
    """Reference backend: gathers each sequence's K/V from the paged cache and runs masked attention.

    Exact rather than fast: a Python loop over sequences, fp32 softmax. Triton backends must
    match it.
    """

    def __init__(self, cfg: TextConfig, cache: PagedKVCache):
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


def contiguous_metadata(
    seq_lens_before: list[int],
    query_lens: list[int],
    block_tables: dict[str, list[list[int]]],
    block_size: int,
    device: torch.device | str,
    bidirectional_spans: list[list[tuple[int, int]]] | None = None,
) -> AttentionMetadata:
    """Build metadata for sequences that extend their context by ``query_lens`` tokens.

    ``block_tables[pool][i]`` lists the blocks of sequence i in position order (entries may be
    -1 for blocks a sliding pool has already freed).
    """
    positions: list[int] = []
    starts = [0]
    slot_maps: dict[str, list[int]] = {pool: [] for pool in block_tables}
    for i, (before, n) in enumerate(zip(seq_lens_before, query_lens)):
        starts.append(starts[-1] + n)
        for p in range(before, before + n):
            positions.append(p)
            for pool, tables in block_tables.items():
                block = tables[i][p // block_size]
                slot_maps[pool].append(block * block_size + p % block_size if block >= 0 else -1)
    seq_lens = [b + n for b, n in zip(seq_lens_before, query_lens)]
    width = max([len(t) for tables in block_tables.values() for t in tables] + [1])
    tables_t = {
        pool: to_device([t + [-1] * (width - len(t)) for t in tables], torch.int32, device)
        for pool, tables in block_tables.items()
    }
    return AttentionMetadata(
        positions=to_device(positions, torch.long, device),
        query_start_loc=to_device(starts, torch.int32, device),
        seq_lens=to_device(seq_lens, torch.int32, device),
        slot_mapping={p: to_device(s, torch.long, device) for p, s in slot_maps.items()},
        block_tables=tables_t,
        block_size=block_size,
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
        bidirectional_spans=bidirectional_spans,
    )
