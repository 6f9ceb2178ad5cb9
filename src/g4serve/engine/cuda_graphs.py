"""Decode steps replayed as CUDA graphs: one captured forward (embeddings → decoder → logits) per
batch-size bucket.

A decode step (every sequence adds one text token) has fixed shapes once its batch is padded to a
bucket, so the ~1,500 kernel launches of an E4B forward collapse into one graph launch. The step
writes its inputs into static buffers (token ids, positions, KV slots, block tables); padded rows
write nothing (slot -1) and attend to one key of block 0, and their logits are dropped.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from g4serve.layers.attention import AttentionBackend, AttentionMetadata
from g4serve.models.gemma4.model import Gemma4Model

log = logging.getLogger("g4serve.cuda_graphs")

# Buckets as vLLM's: fine steps at small batch where padding costs most, coarser above.
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def batch_sizes_up_to(max_batch: int) -> list[int]:
    sizes = [b for b in DEFAULT_BATCH_SIZES if b <= max_batch]
    if not sizes or sizes[-1] < max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphRunner:
    """Runs padded decode steps from static input buffers; with ``capture`` (CUDA) as graph replays.

    Without ``capture`` the same padded forward runs eagerly, which is how the CPU tests check the
    padding and buffer handling that the graphs replay. ``max_model_len`` bounds the contexts the graphs
    serve: it sizes the block tables and fixes each layer's split-KV count at capture time.
    """

    def __init__(self, model: Gemma4Model, backend: AttentionBackend, pools: list[str], block_size: int,
                 max_model_len: int, batch_sizes: list[int], device: torch.device, capture: bool):
        self.model = model
        self.backend = backend
        self.pools = list(pools)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_batch = self.batch_sizes[-1]
        self.device = device
        self.capture_enabled = capture
        self.max_blocks = -(-max_model_len // block_size)
        n, pin = self.max_batch, device.type == "cuda"
        self._num_int_rows = 2 + len(self.pools)  # token ids, positions, one KV-slot row per pool
        # Static inputs the graphs read: int64 rows, and int32 block tables [seq, pool, block].
        self._ints = torch.zeros(self._num_int_rows, n, dtype=torch.long, device=device)
        self._ints[2:] = -1  # padded rows write no KV
        self._tables = torch.zeros(n, len(self.pools), self.max_blocks, dtype=torch.int32, device=device)
        # A step packs only its rows (and only the table width it uses) contiguously into pinned memory,
        # uploads that in one copy per dtype, and scatters it into the static buffers on the device.
        self._ints_host = torch.zeros(self._ints.numel(), dtype=torch.long, pin_memory=pin)
        self._tables_host = torch.zeros(self._tables.numel(), dtype=torch.int32, pin_memory=pin)
        self._ints_staged = torch.empty_like(self._ints_host, device=device)
        self._tables_staged = torch.empty_like(self._tables_host, device=device)
        self._query_start = torch.arange(n + 1, dtype=torch.int32, device=device)
        self._seq_lens = torch.ones(n, dtype=torch.int32, device=device)  # read by prefill kernels only
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}

    def bucket(self, num_seqs: int) -> int | None:
        """The smallest captured batch size that holds ``num_seqs`` rows, or None if none does."""
        for size in self.batch_sizes:
            if size >= num_seqs:
                return size
        return None

    def _metadata(self, n: int) -> AttentionMetadata:
        # A fresh object per forward: backends cache per-step plans by metadata identity, and a capture
        # must record the plan's device ops rather than reuse tensors computed before it.
        return AttentionMetadata(
            positions=self._ints[1, :n],
            query_start_loc=self._query_start[: n + 1],
            seq_lens=self._seq_lens[:n],
            slot_mapping={pool: self._ints[2 + i, :n] for i, pool in enumerate(self.pools)},
            block_tables={pool: self._tables[:n, i] for i, pool in enumerate(self.pools)},
            block_size=self.block_size,
            query_start_loc_cpu=list(range(n + 1)),
            seq_lens_cpu=[1] * n,
            max_decode_len=self.max_model_len,
        )

    def _forward(self, n: int) -> torch.Tensor:
        hidden = self.model(self._ints[0, :n], self._metadata(n), self.backend)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per batch size, largest first so the smaller ones reuse its memory pool."""
        if not self.capture_enabled:
            return
        t0 = time.monotonic()
        pool = torch.cuda.graph_pool_handle()
        for n in reversed(self.batch_sizes):
            for _ in range(2):  # JIT-compiles kernels and settles cuBLAS heuristics outside the capture
                self._forward(n)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[n] = self._forward(n)
            self._graphs[n] = graph
        torch.cuda.synchronize(self.device)
        log.info("captured %d decode CUDA graphs (batch %s) in %.1fs", len(self._graphs),
                 ",".join(map(str, self.batch_sizes)), time.monotonic() - t0)

    @torch.inference_mode()
    def run(self, token_ids: list[int], positions: list[int], tables: dict[str, list[list[int]]]) -> torch.Tensor:
        """One decode step for ``len(token_ids)`` sequences -> logits [B, V] (a view of the graph's output,
        valid until the next step). ``tables[pool][i]``: sequence i's blocks in position order (-1: freed)."""
        b = len(token_ids)
        n = self.bucket(b)
        assert n is not None, f"batch {b} exceeds the largest decode graph ({self.max_batch})"
        bs = self.block_size
        num_rows = self._num_int_rows
        ints = self._ints_host.numpy()[: num_rows * n].reshape(num_rows, n)
        ints[0, :b] = token_ids
        ints[1, :b] = positions
        ints[:2, b:] = 0  # padded rows: token 0 at position 0 (one key to attend to) ...
        ints[2:, b:] = -1  # ... writing nothing
        width = max(len(rows[r]) for rows in tables.values() for r in range(b))
        staged = self._tables_host.numpy()[: n * len(self.pools) * width].reshape(n, len(self.pools), width)
        staged.fill(0)  # entries past a sequence's blocks are never read; 0 keeps padded rows in bounds
        pos = np.asarray(positions, dtype=np.int64)
        for i, pool in enumerate(self.pools):
            for r, table in enumerate(tables[pool]):
                staged[r, i, : len(table)] = table
            block = staged[np.arange(b), i, pos // bs].astype(np.int64)
            ints[2 + i, :b] = np.where(block >= 0, block * bs + pos % bs, -1)
        k, m = ints.size, staged.size
        self._ints_staged[:k].copy_(self._ints_host[:k], non_blocking=True)
        self._tables_staged[:m].copy_(self._tables_host[:m], non_blocking=True)
        self._ints[:, :n].copy_(self._ints_staged[:k].view(num_rows, n))
        self._tables[:n, :, :width].copy_(self._tables_staged[:m].view(n, len(self.pools), width))
        if n in self._graphs:
            self._graphs[n].replay()
            return self._outputs[n][:b]
        return self._forward(n)[:b]
