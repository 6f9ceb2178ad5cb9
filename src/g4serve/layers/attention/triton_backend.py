"""``TritonAttention``: the ``AttentionBackend`` on the paged Triton kernels; matches ``TorchAttention``.

Per layer: new K/V go into the cache (``kv_cache_write``, unless the layer's fused prologue kernel wrote
them: ``kv_write_target``), then sequences with one query token run the
split-KV decode kernel and sequences with more run the varlen prefill kernel, both straight over the
paged cache. What depends only on the step (which sequences decode, their context lengths, per-token
bidirectional ranges, the split count) is worked out once per ``AttentionMetadata`` and reused by
every layer. With an FP8 cache every kernel takes the source layer's [Hkv] K and V scales.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from g4serve.config import SLIDING, TextConfig
from g4serve.kernels._launch import sm_count
from g4serve.kernels.kv_cache_write import KV_FP8_DTYPE, kv_cache_write
from g4serve.kernels.paged_decode import decode_config, decode_num_splits, paged_decode_attention
from g4serve.kernels.paged_prefill import paged_prefill_attention
from g4serve.layers.attention.metadata import AttentionMetadata
from g4serve.layers.attention.torch_backend import KVTensors


@dataclass
class _StepPlan:
    """Step-level addressing shared by all layers of one forward pass."""

    num_decode: int = 0
    decode_rows: torch.Tensor | None = None  # token rows of the decode sequences; None: all rows, in order
    decode_seqs: torch.Tensor | None = None  # their sequence indices; None: every sequence, in order
    decode_ctx: torch.Tensor | None = None  # [num_decode] int32: query position + 1
    decode_max_len: int = 0
    num_prefill: int = 0
    prefill_seqs: torch.Tensor | None = None  # None: every sequence (zero-query ones exit at once)
    prefill_max_query_len: int = 0
    span_lo: torch.Tensor | None = None  # [T] int32, -1: the token is in no bidirectional span
    span_hi: torch.Tensor | None = None
    decode_tables: dict[str, torch.Tensor] = field(default_factory=dict)  # pool -> rows of decode_seqs


class TritonAttention:
    """Paged attention on Triton kernels; same constructor and results as ``TorchAttention``.

    ``decode_num_splits`` fixes the split-KV count (e.g. for CUDA-graph capture); None picks it per
    step from the longest context and the device's SM count. ``split_mixed`` runs the decode kernel on
    the single-token sequences of a mixed batch instead of sending everything to the prefill kernel.
    """

    def __init__(
        self,
        cfg: TextConfig,
        cache: KVTensors,
        decode_num_splits: int | None = None,
        split_mixed: bool = True,
    ):
        self.cfg = cfg
        self.cache = cache
        self.kv_source = [cfg.kv_source_layer(i) for i in range(cfg.num_hidden_layers)]
        self.bidirectional_vision = cfg.use_bidirectional_attention == "vision"
        self.fixed_num_splits = decode_num_splits
        self.split_mixed = split_mixed
        self._num_sms: int | None = None
        self._plan_meta: AttentionMetadata | None = None
        self._plan: _StepPlan | None = None

    # ---- per-step plan --------------------------------------------------------------------------
    def _sm_count(self, device: torch.device) -> int:
        if self._num_sms is None:
            cuda = device.type == "cuda"
            self._num_sms = sm_count(device.index or 0) if cuda else 8
        return self._num_sms

    def _plan_for(self, meta: AttentionMetadata) -> _StepPlan:
        if self._plan_meta is meta:
            return self._plan
        starts = meta.query_start_loc_cpu
        query_lens = [starts[i + 1] - starts[i] for i in range(meta.num_seqs)]
        device = meta.positions.device
        plan = _StepPlan()
        if meta.captured_query_len is not None:
            # A captured mixed step: the host knows only the bounds, so every sequence takes the varlen
            # kernel (zero-query padding sequences exit at once).
            plan.num_prefill = meta.num_seqs
            plan.prefill_max_query_len = meta.captured_query_len
            self._plan_meta, self._plan = meta, plan
            return plan
        decode = [i for i, n in enumerate(query_lens) if n == 1]
        prefill = [i for i, n in enumerate(query_lens) if n > 1]
        if decode and (not prefill or self.split_mixed):
            plan.num_decode = len(decode)
            if prefill:
                plan.decode_rows = torch.tensor([starts[i] for i in decode], dtype=torch.long, device=device)
            if len(decode) < meta.num_seqs:
                plan.decode_seqs = torch.tensor(decode, dtype=torch.long, device=device)
            rows_pos = meta.positions if plan.decode_rows is None else meta.positions[plan.decode_rows]
            plan.decode_ctx = (rows_pos + 1).to(torch.int32)
            plan.decode_max_len = meta.max_decode_len or max(meta.seq_lens_cpu[i] for i in decode)
        else:
            prefill = [i for i, n in enumerate(query_lens) if n > 0]
        if prefill:
            plan.num_prefill = len(prefill)
            plan.prefill_max_query_len = max(query_lens[i] for i in prefill)
            if plan.num_decode:
                plan.prefill_seqs = torch.tensor(prefill, dtype=torch.int32, device=device)
        if self.bidirectional_vision and meta.bidirectional_spans:
            plan.span_lo, plan.span_hi = self._token_spans(meta, query_lens)
        self._plan_meta, self._plan = meta, plan
        return plan

    @staticmethod
    def _token_spans(meta: AttentionMetadata, query_lens: list[int]):
        """Per query token, the [lo, hi) union of the bidirectional spans holding it (hi cut at its
        sequence's length), or (-1, -1): the compact form both kernels take."""
        entries = [
            (i, lo, hi)
            for i, spans in enumerate(meta.bidirectional_spans or [])
            for lo, hi in spans
            if lo < hi
        ]
        if not entries:
            return None, None
        device = meta.positions.device
        span = torch.tensor(entries, dtype=torch.long, device=device)  # [E, 3]: seq, lo, hi
        seq_of_token = torch.repeat_interleave(
            torch.arange(meta.num_seqs, device=device), torch.tensor(query_lens, device=device)
        )
        pos = meta.positions[:, None]
        inside = (span[None, :, 0] == seq_of_token[:, None]) & (span[None, :, 1] <= pos)
        inside &= pos < span[None, :, 2]
        lo = torch.where(inside, span[None, :, 1], torch.iinfo(torch.long).max).amin(1)
        hi = torch.where(inside, span[None, :, 2], -1).amax(1)
        hi = torch.minimum(hi, meta.seq_lens.long()[seq_of_token])
        found = inside.any(1)
        lo = torch.where(found, lo, -1).to(torch.int32)
        hi = torch.where(found, hi, -1).to(torch.int32)
        return lo, hi

    # ---- AttentionBackend -----------------------------------------------------------------------
    def _scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(k_scale, v_scale) [Hkv] of an FP8 cache's layer; (None, None) for an unquantized cache."""
        scales = self.cache.scales.get(layer)
        return (None, None) if scales is None else (scales[0], scales[1])

    def kv_write_target(self, layer_idx: int, meta: AttentionMetadata):
        """The layer's cache, slots and scales for the fused q/k/v prologue (``kernels.qkv_prep``) on CUDA."""
        kv = self.cache.kv[self.kv_source[layer_idx]]
        if not kv.is_cuda or self.kv_source[layer_idx] != layer_idx:
            return None
        return kv[0], kv[1], meta.slot_mapping[self.cfg.layer_types[layer_idx]], *self._scales(layer_idx)

    def attend(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        cfg = self.cfg
        layer_type = cfg.layer_types[layer_idx]
        src = self.kv_source[layer_idx]
        kv = self.cache.kv[src]
        k_scale, v_scale = self._scales(src)
        if k is not None:
            kv_cache_write(k, v, kv[0], kv[1], meta.slot_mapping[layer_type], k_scale, v_scale)
        q = q if q.stride(-1) == 1 else q.contiguous()
        out = torch.empty_like(q)
        if q.shape[0] == 0:
            return out
        plan = self._plan_for(meta)
        window = cfg.sliding_window if layer_type == SLIDING else None
        span_lo, span_hi = (plan.span_lo, plan.span_hi) if window is not None else (None, None)
        table = meta.block_tables[layer_type]
        bs = meta.block_size

        if plan.num_decode:
            rows = plan.decode_rows
            if plan.decode_seqs is None:
                dec_table = table
            else:
                dec_table = plan.decode_tables.get(layer_type)
                if dec_table is None:
                    dec_table = plan.decode_tables[layer_type] = table[plan.decode_seqs]
            num_splits = self.fixed_num_splits
            if num_splits is None:
                block_n = decode_config(q.shape[-1], kv.dtype == KV_FP8_DTYPE)["block_n"]
                kv_len = min(plan.decode_max_len, window + block_n) if window else plan.decode_max_len
                num_splits = decode_num_splits(
                    plan.num_decode, kv.shape[2], kv_len, block_n, self._sm_count(q.device)
                )

            def pick(t: torch.Tensor | None) -> torch.Tensor | None:
                return t if t is None or rows is None else t[rows]

            result = paged_decode_attention(
                pick(q),
                kv[0],
                kv[1],
                dec_table,
                plan.decode_ctx,
                bs,
                window=window,
                span_lo=pick(span_lo),
                span_hi=pick(span_hi),
                num_splits=num_splits,
                out=out if rows is None else None,
                k_scale=k_scale,
                v_scale=v_scale,
            )
            if rows is not None:
                out.index_copy_(0, rows, result)
        if plan.num_prefill:
            paged_prefill_attention(
                q,
                kv[0],
                kv[1],
                table,
                meta.seq_lens,
                meta.query_start_loc,
                meta.positions,
                bs,
                plan.prefill_max_query_len,
                window=window,
                span_lo=span_lo,
                span_hi=span_hi,
                seq_indices=plan.prefill_seqs,
                out=out,
                k_scale=k_scale,
                v_scale=v_scale,
            )
        return out
