"""What one step tells the attention backends: ``AttentionMetadata`` and its builder ``contiguous_metadata``.

The model hands every attention layer a flat batch of tokens (all sequences of a step
concatenated) plus an ``AttentionMetadata``: positions, query bounds, context lengths and, per
pool, the cache slots to write and the block tables to read. Pools: one per layer type
("sliding_attention", "full_attention"), so the engine can free sliding-window blocks early.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

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
