"""Engine steps replayed as CUDA graphs: one captured forward (embeddings → decoder → logits) per size bucket.

- ``DecodeGraphRunner``: pure decode steps (one text token per sequence), one graph per batch size,
  on the split-KV decode kernel.
- ``MixedGraphRunner``: prefill and mixed prefill+decode steps, one graph per token-count bucket for up
  to ``max_seqs`` sequences, on the varlen kernel, with YOCO fast prefill on fixed rows; media soft
  tokens enter through a fixed-shape row buffer and mask (models without bidirectional image spans).
- ``VerifyGraphRunner``: speculative-decoding steps, where every row of a sequence (its last token and
  its drafts) samples; the mixed step's graph with logits for every token row.
- ``DraftGraphRunner``: a round of MTP drafting (k drafter steps) per batch size.

Each graph also returns the final hidden states of its logit rows, which an MTP drafter starts from.

Padded to its bucket, a step has fixed shapes, so the ~1,000 kernel launches of an E4B forward collapse
into one graph launch. A step writes its inputs into static buffers (token ids, positions, KV slots,
block tables, sequence bounds); padded tokens write nothing (slot -1) and belong to no sequence, padded
sequences have no queries, and their rows are dropped. Media steps of models with bidirectional image
attention (26B-A4B, 31B) run eagerly.

With LoRA adapters enabled each size has a second graph that applies them: a token row holds each token's
adapter slot (-1: none), and the adapter weights sit at fixed addresses, so loads after capture apply on
replay. Steps without an adapter replay the plain graph and pay nothing for LoRA.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from g4serve.engine.inputs import PendingTokens
from g4serve.layers.attention import AttentionBackend, AttentionMetadata
from g4serve.layers.lora import LoRABatch, LoRAWeights
from g4serve.models.gemma4.assistant import Gemma4Assistant
from g4serve.models.gemma4.model import Gemma4Model
from g4serve.transfer import fill_at, to_device

log = logging.getLogger("g4serve.cuda_graphs")

# Buckets as vLLM's: fine steps at small batch where padding costs most, coarser above.
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
DEFAULT_TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
# Verification steps: 1 + k rows per sequence, so sizes track the decode batch sizes times a small k.
VERIFY_TOKEN_BUCKETS = (2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512, 768, 1024)


def sizes_up_to(limit: int, buckets: Sequence[int]) -> list[int]:
    """The buckets up to ``limit``, ending with ``limit`` itself (the largest step must have a graph)."""
    sizes = [b for b in buckets if b <= limit]
    if not sizes or sizes[-1] < limit:
        sizes.append(limit)
    return sizes


def _capture(
    forward: Callable[[], Any], pool, device: torch.device, stream: torch.cuda.Stream | None = None
) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Capture ``forward()`` into a graph on ``pool``, after two eager runs that JIT-compile the kernels
    and settle cuBLAS heuristics outside the capture; returns the graph and its static outputs.

    ``stream``: the stream captured on (None: torch's one default capture stream). torch gives cuBLAS a
    workspace per (handle, stream) and a captured GEMM keeps its address, so every graph captured on one
    stream shares one workspace (pytorch/pytorch#193402). Graphs that replay side by side on two streams
    must be captured on two streams: the encoders' graphs (``VisionGraphRunner``, ``AudioGraphRunner``) on
    their own, since with ``--overlap-encoder`` they replay on the encoder's stream beside the steps'
    graphs. Sharing it, an e4b server on an H200 (torch 2.11) stopped under 32 video QPS within a second of
    the first videos, its engine thread waiting for a step that never ended: in five runs of five, and in
    none with the encoders eager (``G4SERVE_ENCODER_GRAPHS=0``). The shared workspace is the cause this
    points to; the run with separate capture streams is still to come (docs/benchmarks.md).

    The capture forbids unsafe CUDA calls on this thread only ("thread_local"): the server's media threads
    (``--media-on-gpu``) keep decoding images and computing log-mels on their own streams while the engine
    thread captures an encoder graph for a shape first seen under load. In the default "global" mode one of
    their copies invalidated the capture and failed the step (32 audio QPS on an H200)."""
    for _ in range(2):
        forward()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
        outputs = forward()
    return graph, outputs


def _own_capture_stream(device: torch.device) -> torch.cuda.Stream | None:
    """A stream of its own to capture an encoder's graphs on (``_capture``: its own cuBLAS workspace)."""
    return torch.cuda.Stream(device) if device.type == "cuda" else None


class _GraphRunner:
    """Static inputs, their per-step upload, and capture/replay of one graph per size.

    Host side, a step packs only the rows it uses contiguously into pinned buffers, uploads them with
    one copy per dtype and scatters them into the static buffers on the device. Steps alternate between
    two sets of pinned buffers: with async scheduling step N+1 is packed while step N's upload may still
    wait in the stream, and the set it refills was last read by step N-1's upload, which came before the
    step N-1 sample the host has already read back.
    """

    def __init__(
        self,
        model: Gemma4Model,
        backend: AttentionBackend,
        pools: list[str],
        block_size: int,
        max_model_len: int,
        sizes: list[int],
        max_seqs: int,
        device: torch.device,
        capture: bool,
        decodable_vocab_size: int | None = None,
        lora_weights: LoRAWeights | None = None,
    ):
        self.model = model
        self.lora_weights = lora_weights
        self.decodable_vocab_size = decodable_vocab_size  # the greedy argmax skips ids past it
        self.backend = backend
        self.pools = list(pools)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.sizes = sorted(set(sizes))
        self.max_size = self.sizes[-1]
        self.max_seqs = max_seqs
        self.device = device
        self.capture_enabled = capture
        self.max_blocks = -(-max_model_len // block_size)
        # token ids, positions, one KV-slot row per pool, and with LoRA each token's adapter slot
        self.num_token_rows = 2 + len(self.pools) + (lora_weights is not None)
        self.lora_row = 2 + len(self.pools)
        self._tokens = torch.zeros(self.num_token_rows, self.max_size, dtype=torch.long, device=device)
        self._tokens[2:] = -1  # padded tokens write no KV
        self._tables = torch.zeros(
            max_seqs, len(self.pools), self.max_blocks, dtype=torch.int32, device=device
        )
        pin = device.type == "cuda"
        self._host_sets = [
            (
                torch.zeros(self._tokens.numel() + max_seqs, dtype=torch.long, pin_memory=pin),
                torch.zeros(self._tables.numel() + 2 * max_seqs + 1, dtype=torch.int32, pin_memory=pin),
            )
            for _ in range(2)
        ]
        self._num_runs = 0
        self._long_staged = torch.empty_like(self._host_sets[0][0], device=device)
        self._int_staged = torch.empty_like(self._host_sets[0][1], device=device)
        self._graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}  # (size, with LoRA)
        self._static_outputs: dict[tuple[int, bool], tuple[torch.Tensor, ...]] = {}

    def bucket(self, size: int) -> int | None:
        """The smallest captured size that holds ``size``, or None if none does."""
        for s in self.sizes:
            if s >= size:
                return s
        return None

    def _forward(self, n: int, lora: LoRABatch | None) -> torch.Tensor:
        """The final hidden states of the padded step of size ``n``: the rows whose logits are needed."""
        raise NotImplementedError

    def _lora(self, n: int, with_lora: bool) -> LoRABatch | None:
        if not with_lora:
            return None
        return LoRABatch(self.lora_weights, self._tokens[self.lora_row, :n], all_modules=True)

    def _pack_lora(self, tokens: np.ndarray, lora_slots: list[int] | None, count: int) -> bool:
        """Each token's adapter slot into the LoRA row; whether the step applies adapters."""
        if lora_slots is None or self.lora_weights is None:
            return False
        tokens[self.lora_row, :count] = lora_slots
        return True

    def _next_host_set(self) -> None:
        self._num_runs += 1

    @property
    def num_runs(self) -> int:
        """Steps run through this runner's padded buffers (graph replays, or eager runs without capture)."""
        return self._num_runs

    @property
    def _long_host(self) -> torch.Tensor:
        return self._host_sets[self._num_runs % 2][0]

    @property
    def _int_host(self) -> torch.Tensor:
        return self._host_sets[self._num_runs % 2][1]

    def _outputs(self, n: int, with_lora: bool = False) -> tuple[torch.Tensor, ...]:
        """(logits, greedy ids, hidden states) of the padded step's rows. The greedy choice rides along in the
        graph: an all-greedy step then needs no sampling launches; the hidden states are what an MTP drafter
        starts from."""
        hidden = self._forward(n, self._lora(n, with_lora))
        logits = self.model.compute_logits(hidden)
        return logits, logits[:, : self.decodable_vocab_size].argmax(dim=-1), hidden

    def _pack_tables(
        self,
        tables: dict[str, list[list[int]]],
        num_seqs: int,
        rows: int,
        token_pos: np.ndarray,
        token_seq: np.ndarray,
        slots: np.ndarray,
    ) -> np.ndarray:
        """Block tables of ``num_seqs`` sequences into the int32 staging ([rows, pools, width]) and each
        token's KV slot per pool into ``slots`` ([pools, tokens]; -1 where a sliding block was freed)."""
        width = max(len(t) for pool_tables in tables.values() for t in pool_tables)
        staged = self._int_host.numpy()[: rows * len(self.pools) * width].reshape(
            rows, len(self.pools), width
        )
        staged.fill(0)  # entries past a sequence's blocks are never read; 0 keeps padded rows in bounds
        bs = self.block_size
        for i, pool in enumerate(self.pools):
            for r in range(num_seqs):
                table = tables[pool][r]
                staged[r, i, : len(table)] = table
            block = staged[token_seq, i, token_pos // bs].astype(np.int64)
            slots[i] = np.where(block >= 0, block * bs + token_pos % bs, -1)
        return staged

    def _upload(
        self,
        tokens: np.ndarray,
        tables: np.ndarray,
        extra_long: np.ndarray | None = None,
        extra_int: np.ndarray | None = None,
        pending: PendingTokens | None = None,
    ) -> None:
        """Copy the packed host rows into the static buffers: ``tokens`` [token rows, n] (already in the
        long staging), ``tables`` [seqs, pools, width] (already in the int staging), then the extras;
        ``pending`` input tokens are then copied in on the device."""
        rows, n = tokens.shape
        k = tokens.size
        m = tables.size
        long_end = k + (extra_long.size if extra_long is not None else 0)
        int_end = m + (extra_int.size if extra_int is not None else 0)
        self._long_staged[:long_end].copy_(self._long_host[:long_end], non_blocking=True)
        self._int_staged[:int_end].copy_(self._int_host[:int_end], non_blocking=True)
        self._tokens[:, :n].copy_(self._long_staged[:k].view(rows, n))
        seqs, pools, width = tables.shape
        self._tables[:seqs, :, :width].copy_(self._int_staged[:m].view(seqs, pools, width))
        if pending is not None:
            pending.write_into(self._tokens[0])

    @torch.inference_mode()
    def capture(self, pool=None) -> None:
        """Capture one graph per size, largest first so the smaller ones reuse its memory."""
        if not self.capture_enabled:
            return
        t0 = time.monotonic()
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        variants = (False, True) if self.lora_weights is not None else (False,)
        for n in reversed(self.sizes):
            for with_lora in variants:
                key = (n, with_lora)
                self._graphs[key], self._static_outputs[key] = _capture(
                    lambda n=n, w=with_lora: self._outputs(n, w), pool, self.device
                )
        torch.cuda.synchronize(self.device)
        log.info(
            "captured %d %s CUDA graphs (sizes %s) in %.1fs",
            len(self._graphs),
            type(self).__name__,
            ",".join(map(str, self.sizes)),
            time.monotonic() - t0,
        )

    def _replay(self, n: int, with_lora: bool = False) -> tuple[torch.Tensor, ...]:
        """``_outputs`` of the padded step, from the graph when captured."""
        graph = self._graphs.get((n, with_lora))
        if graph is not None:
            graph.replay()
            return self._static_outputs[n, with_lora]
        return self._outputs(n, with_lora)


class DecodeGraphRunner(_GraphRunner):
    """Pure decode steps of up to ``max(batch_sizes)`` sequences; without ``capture`` (CPU tests) the same
    padded forward runs eagerly. ``max_model_len`` sizes the block tables and fixes each layer's split-KV
    count at capture time."""

    def __init__(
        self,
        model: Gemma4Model,
        backend: AttentionBackend,
        pools: list[str],
        block_size: int,
        max_model_len: int,
        batch_sizes: list[int],
        device: torch.device,
        capture: bool,
        decodable_vocab_size: int | None = None,
        lora_weights: LoRAWeights | None = None,
    ):
        super().__init__(
            model,
            backend,
            pools,
            block_size,
            max_model_len,
            batch_sizes,
            max(batch_sizes),
            device,
            capture,
            decodable_vocab_size,
            lora_weights,
        )
        self._query_start = torch.arange(self.max_batch + 1, dtype=torch.int32, device=device)
        self._seq_lens = torch.ones(
            self.max_batch, dtype=torch.int32, device=device
        )  # read by varlen kernels only

    @property
    def batch_sizes(self) -> list[int]:
        return self.sizes

    @property
    def max_batch(self) -> int:
        return self.max_size

    def _metadata(self, n: int) -> AttentionMetadata:
        # A fresh object per forward: backends cache per-step plans by metadata identity, and a capture
        # must record the plan's device ops rather than reuse tensors computed before it.
        return AttentionMetadata(
            positions=self._tokens[1, :n],
            query_start_loc=self._query_start[: n + 1],
            seq_lens=self._seq_lens[:n],
            slot_mapping={pool: self._tokens[2 + i, :n] for i, pool in enumerate(self.pools)},
            block_tables={pool: self._tables[:n, i] for i, pool in enumerate(self.pools)},
            block_size=self.block_size,
            query_start_loc_cpu=list(range(n + 1)),
            seq_lens_cpu=[1] * n,
            max_decode_len=self.max_model_len,
        )

    def _forward(self, n: int, lora: LoRABatch | None) -> torch.Tensor:
        return self.model(self._tokens[0, :n], self._metadata(n), self.backend, lora=lora)

    @torch.inference_mode()
    def run(
        self,
        token_ids: list[int],
        positions: list[int],
        tables: dict[str, list[list[int]]],
        pending: PendingTokens | None = None,
        lora_slots: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One decode step for ``len(token_ids)`` sequences -> logits [B, V], greedy ids [B] and final hidden
        states [B, H] (views of the graph's outputs, valid until this graph's next replay).
        ``tables[pool][i]``: sequence i's blocks in position order (-1: freed). ``pending``: input tokens
        still on the device. ``lora_slots``: each sequence's adapter slot (None: no adapter in the step)."""
        b = len(token_ids)
        n = self.bucket(b)
        assert n is not None, f"batch {b} exceeds the largest decode graph ({self.max_batch})"
        self._next_host_set()
        tokens = self._long_host.numpy()[: self.num_token_rows * n].reshape(self.num_token_rows, n)
        tokens[0, :b] = token_ids
        tokens[1, :b] = positions
        tokens[:2, b:] = 0  # padded rows: token 0 at position 0 (one key to attend to) ...
        tokens[2:, b:] = -1  # ... writing nothing
        with_lora = self._pack_lora(tokens, lora_slots, b)
        pos = np.asarray(positions, dtype=np.int64)
        staged = self._pack_tables(tables, b, n, pos, np.arange(b), tokens[2:, :b])
        self._upload(tokens, staged, pending=pending)
        return tuple(out[:b] for out in self._replay(n, with_lora))


class MixedGraphRunner(_GraphRunner):
    """Text steps of up to ``max(token_buckets)`` tokens over up to ``max_seqs`` sequences (prefill chunks,
    decodes, or both), one graph per token bucket. ``yoco``: layers past the last KV producer run on one
    row per sequence (its last token), as the eager fast prefill does; the graph returns [max_seqs, V]
    logits, one row per sequence."""

    all_rows = False  # VerifyGraphRunner: logits of every token row

    def __init__(
        self,
        model: Gemma4Model,
        backend: AttentionBackend,
        pools: list[str],
        block_size: int,
        max_model_len: int,
        token_buckets: list[int],
        max_seqs: int,
        device: torch.device,
        capture: bool,
        yoco: bool = True,
        decodable_vocab_size: int | None = None,
        lora_weights: LoRAWeights | None = None,
    ):
        super().__init__(
            model,
            backend,
            pools,
            block_size,
            max_model_len,
            token_buckets,
            max_seqs,
            device,
            capture,
            decodable_vocab_size,
            lora_weights,
        )
        self.yoco = yoco and bool(model.cfg.text.num_kv_shared_layers) and not self.all_rows
        # Media soft tokens ride in a fixed-shape row buffer plus mask. Models whose sliding layers attend
        # bidirectionally inside images (26B-A4B, 31B) keep media steps eager: their per-token span bounds
        # would change the attention kernel's specialisation.
        self.media = (
            not self.all_rows
            and model.cfg.text.use_bidirectional_attention != "vision"
            and (model.vision_tower is not None or model.audio_tower is not None)
        )
        if self.media:
            hidden = model.cfg.text.hidden_size
            dtype = model.language_model.embed_tokens.weight.dtype
            self._mm_rows = torch.zeros(self.max_tokens, hidden, dtype=dtype, device=device)
            self._mm_mask = torch.zeros(self.max_tokens, dtype=torch.bool, device=device)
            self._mm_set: torch.Tensor | None = None  # rows the previous media step marked
        s = max_seqs
        self._query_start = torch.zeros(s + 1, dtype=torch.int32, device=device)
        self._seq_lens = torch.zeros(s, dtype=torch.int32, device=device)
        self._last_rows = torch.zeros(s, dtype=torch.long, device=device)  # each sequence's last token row
        self._kept_start = torch.arange(s + 1, dtype=torch.int32, device=device)
        self._kept_slots = torch.full((s,), -1, dtype=torch.long, device=device)

    @property
    def max_tokens(self) -> int:
        return self.max_size

    def _metadata(self, n: int) -> AttentionMetadata:
        s = self.max_seqs
        return AttentionMetadata(
            positions=self._tokens[1, :n],
            query_start_loc=self._query_start,
            seq_lens=self._seq_lens,
            slot_mapping={pool: self._tokens[2 + i, :n] for i, pool in enumerate(self.pools)},
            block_tables={pool: self._tables[:, i] for i, pool in enumerate(self.pools)},
            block_size=self.block_size,
            query_start_loc_cpu=[0] * (s + 1),  # placeholders: the plan reads captured_query_len
            seq_lens_cpu=[0] * s,
            captured_query_len=n,
        )

    def _forward(self, n: int, lora: LoRABatch | None) -> torch.Tensor:
        s = self.max_seqs
        meta = self._metadata(n)
        positions = meta.positions
        if self.yoco:
            # The kept rows form a decode-shaped step: one query per sequence at its last position.
            kept = AttentionMetadata(
                positions=positions[self._last_rows],
                query_start_loc=self._kept_start,
                seq_lens=self._seq_lens,
                slot_mapping={pool: self._kept_slots for pool in self.pools},
                block_tables=meta.block_tables,
                block_size=self.block_size,
                query_start_loc_cpu=list(range(s + 1)),
                seq_lens_cpu=[1] * s,
                max_decode_len=self.max_model_len,
            )
            return self.model(
                self._tokens[0, :n],
                meta,
                self.backend,
                keep_indices=self._last_rows,
                kept_meta=kept,
                mm_dense=self._dense(n),
                lora=lora,
            )
        hidden = self.model(self._tokens[0, :n], meta, self.backend, mm_dense=self._dense(n), lora=lora)
        return hidden[self._last_rows]

    def _dense(self, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return (self._mm_mask[:n], self._mm_rows[:n]) if self.media else None

    def _place_media(self, rows: list[torch.Tensor], positions: list[int]) -> None:
        """Soft tokens into the static row buffer at their flat-batch rows; the last media step's marks
        are cleared first (outside the graph: a few small device ops, only around media steps)."""
        if self._mm_set is not None:
            fill_at(self._mm_mask, (self._mm_set,), False)
            self._mm_set = None
        if rows:
            where = to_device(positions, torch.long, self.device)
            self._mm_rows.index_copy_(0, where, torch.cat(rows).to(self._mm_rows.dtype))
            fill_at(self._mm_mask, (where,), True)
            self._mm_set = where

    @torch.inference_mode()
    def run(
        self,
        token_ids: list[int],
        computed: list[int],
        query_lens: list[int],
        tables: dict[str, list[list[int]]],
        mm_rows: list[torch.Tensor] | None = None,
        mm_positions: list[int] | None = None,
        pending: PendingTokens | None = None,
        lora_slots: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One step: sequence i adds ``query_lens[i]`` tokens after its ``computed[i]`` cached ones ->
        logits [num_seqs, V], greedy ids [num_seqs] and final hidden states [num_seqs, H], row i for
        sequence i's last new token (``all_rows``: [num_tokens, ...], one row per token), views valid until
        this graph's next replay. ``mm_rows`` / ``mm_positions``: soft tokens and their flat rows (only where
        ``self.media``). ``pending``: input tokens still on the device. ``lora_slots``: each
        token's adapter slot (None: no adapter in the step)."""
        assert self.media or not mm_rows, "this model's media steps are not graphed"
        if self.media and (mm_rows or self._mm_set is not None):
            self._place_media(mm_rows or [], mm_positions or [])
        t, b = len(token_ids), len(query_lens)
        n = self.bucket(t)
        assert n is not None and b <= self.max_seqs, f"{t} tokens / {b} sequences exceed the mixed graphs"
        self._next_host_set()
        lens = np.asarray(query_lens, dtype=np.int64)
        before = np.asarray(computed, dtype=np.int64)
        starts = np.zeros(b + 1, dtype=np.int64)
        np.cumsum(lens, out=starts[1:])
        token_seq = np.repeat(np.arange(b), lens)
        token_pos = np.arange(t) - starts[token_seq] + before[token_seq]
        tokens = self._long_host.numpy()[: self.num_token_rows * n].reshape(self.num_token_rows, n)
        tokens[0, :t] = token_ids
        tokens[1, :t] = token_pos
        tokens[:2, t:] = 0
        tokens[2:, t:] = -1
        with_lora = self._pack_lora(tokens, lora_slots, t)
        # Per sequence, in the long staging after the token rows: the row of its last token. Padding sequences
        # point at a padding token (position 0: one key to read) when there is one.
        last = self._long_host.numpy()[tokens.size : tokens.size + self.max_seqs]
        last[:b] = starts[1:] - 1
        last[b:] = t if t < n else 0
        staged = self._pack_tables(tables, b, self.max_seqs, token_pos, token_seq, tokens[2:, :t])
        # Sequence bounds, in the int staging after the tables: query starts (padding: empty at the end)
        # and context lengths (padding: 0).
        bounds = self._int_host.numpy()[staged.size : staged.size + 2 * self.max_seqs + 1]
        bounds[: b + 1] = starts
        bounds[b + 1 : self.max_seqs + 1] = t
        bounds[self.max_seqs + 1 : self.max_seqs + 1 + b] = before + lens
        bounds[self.max_seqs + 1 + b :] = 0
        self._upload(tokens, staged, extra_long=last, extra_int=bounds, pending=pending)
        k, m, s = tokens.size, staged.size, self.max_seqs
        self._last_rows.copy_(self._long_staged[k : k + s])
        self._query_start.copy_(self._int_staged[m : m + s + 1])
        self._seq_lens.copy_(self._int_staged[m + s + 1 : m + 2 * s + 1])
        return tuple(out[: t if self.all_rows else b] for out in self._replay(n, with_lora))


class VerifyGraphRunner(MixedGraphRunner):
    """Text steps whose every token row may sample: speculative decoding verifies each sequence's last token
    and its drafts in one step, ``1 + k`` query rows that all need logits (and, for an MTP drafter, hidden
    states). One graph per token bucket, on the varlen kernel, without fast prefill (every row is kept) or
    media; ``run`` returns [num_tokens, ...] rows, the caller picks the sampled ones."""

    all_rows = True

    def _forward(self, n: int, lora: LoRABatch | None) -> torch.Tensor:
        return self.model(self._tokens[0, :n], self._metadata(n), self.backend, lora=lora)


class DraftGraphRunner(DecodeGraphRunner):
    """A whole round of MTP drafting as one graph per batch size: ``num_steps`` argmax steps of the drafter,
    each feeding its token and hidden state to the next, for up to ``max(batch_sizes)`` sequences. The
    drafter reads the target's paged cache and writes none, so the step's KV slots are all -1; its queries sit
    where a decode of each sequence's last computed token would, and RoPE uses the position after that."""

    def __init__(
        self,
        drafter: Gemma4Assistant,
        target: Gemma4Model,
        backend: AttentionBackend,
        pools: list[str],
        block_size: int,
        max_model_len: int,
        batch_sizes: list[int],
        num_steps: int,
        device: torch.device,
        capture: bool,
        decodable_vocab_size: int | None = None,
    ):
        super().__init__(
            target,
            backend,
            pools,
            block_size,
            max_model_len,
            batch_sizes,
            device,
            capture,
            decodable_vocab_size,
        )
        self.drafter = drafter
        self.num_steps = num_steps
        width = drafter.cfg.backbone_hidden_size
        dtype = drafter.pre_projection.weight.dtype
        self._target_hidden = torch.zeros(self.max_batch, width, dtype=dtype, device=device)

    def _outputs(self, n: int, with_lora: bool = False) -> tuple[torch.Tensor, ...]:
        return (
            self.drafter.draft(
                self.model.language_model.embed,
                self._tokens[0, :n],
                self._target_hidden[:n],
                self._tokens[1, :n] + 1,
                self._metadata(n),
                self.backend,
                self.num_steps,
                self.decodable_vocab_size,
            ),
        )

    @torch.inference_mode()
    def draft(
        self,
        token_ids: list[int],
        computed: list[int],
        tables: dict[str, list[list[int]]],
        target_hidden: torch.Tensor,
    ) -> torch.Tensor:
        """Drafts [B, num_steps] for ``len(token_ids)`` sequences: sequence i's last token, its
        ``computed[i]`` cached tokens before it, its block tables and the target's hidden state [B, H] of the
        row that sampled the token (a view of the graph's output, valid until its next replay)."""
        b = len(token_ids)
        n = self.bucket(b)
        assert n is not None, f"batch {b} exceeds the largest draft graph ({self.max_batch})"
        self._next_host_set()
        tokens = self._long_host.numpy()[: self.num_token_rows * n].reshape(self.num_token_rows, n)
        tokens[0, :b] = token_ids
        tokens[1, :b] = np.asarray(computed) - 1  # the query's slot: a decode of the last cached token
        tokens[:2, b:] = 0
        pos = tokens[1, :b].copy()
        staged = self._pack_tables(tables, b, n, pos, np.arange(b), np.empty((len(self.pools), b), np.int64))
        tokens[2:] = -1  # the drafter writes no K/V
        self._upload(tokens, staged)
        self._target_hidden[:b].copy_(target_hidden)
        return self._replay(n)[0][:b]


# Patches one vision graph encodes at most: 64 video frames at 70 soft tokens (630 patches each), 16 images at
# 280 (2,520 each). Larger batches are encoded in chunks of the largest bucket.
MAX_PATCHES_PER_GRAPH = 64 * 630


def frame_buckets(num_patches: int) -> list[int]:
    """The frame counts vision graphs are captured for at ``num_patches`` patches a frame: powers of two up
    to the largest batch of at most ``MAX_PATCHES_PER_GRAPH`` patches (1 at least)."""
    top = max(1, MAX_PATCHES_PER_GRAPH // num_patches)
    return [1 << i for i in range(top.bit_length()) if 1 << i <= top]


class VisionGraphRunner:
    """The vision tower and projection as CUDA graphs, one per (frame bucket, patches a frame, dtype,
    padding): a batch of B frames is padded to the next bucket of ``frame_buckets`` by repeating its last
    frame (its outputs are dropped; the repeated frame keeps the batch's unmasked attention path), so a
    burst of requests whose frames add up to any count replays one of a few graphs instead of capturing a
    new shape. ``capture_buckets`` captures every bucket of a frame shape ahead of traffic (the engine's
    warm-up); other shapes are captured the first time they are seen, up to ``max_graphs``. The caller
    selects the kept soft tokens."""

    def __init__(self, model: Gemma4Model, device: torch.device, max_graphs: int = 32):
        self.model = model
        self.device = device
        self.max_graphs = max_graphs
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, tuple]] = {}
        self._pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.capture_stream = _own_capture_stream(device)

    def max_frames(self, num_patches: int) -> int:
        """The most frames one ``encode_padded`` call takes at ``num_patches`` patches a frame."""
        return frame_buckets(num_patches)[-1]

    @torch.inference_mode()
    def encode_padded(
        self, pixel_values: torch.Tensor, position_ids: torch.Tensor, no_padding: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``Gemma4Model.encode_images_padded`` by graph replay: (soft tokens [B, L, H], cells used [B, L]),
        views of the graph's static outputs (valid until its next replay). ``no_padding``: every patch is
        real (frames of one size), so the graph runs attention without a mask (flash). At most
        ``max_frames`` frames."""
        frames, num_patches = pixel_values.shape[:2]
        buckets = frame_buckets(num_patches)
        if frames > buckets[-1]:
            raise ValueError(f"{frames} frames of {num_patches} patches: at most {buckets[-1]} a graph")
        bucket = next(b for b in buckets if b >= frames)
        key = (bucket, *pixel_values.shape[1:], pixel_values.dtype, no_padding)
        entry = self._graphs.get(key)
        if entry is None and len(self._graphs) < self.max_graphs:
            entry = self._capture(key, _repeat_last(pixel_values, bucket), _repeat_last(position_ids, bucket))
        if entry is None:
            return self.model.encode_images_padded(pixel_values, position_ids, no_padding)
        graph, pixels, positions, (tokens, used) = entry
        pixels[:frames].copy_(pixel_values)
        pixels[frames:].copy_(pixel_values[-1:].expand(bucket - frames, *pixel_values.shape[1:]))
        positions[:frames].copy_(position_ids)
        positions[frames:].copy_(position_ids[-1:].expand(bucket - frames, *position_ids.shape[1:]))
        graph.replay()
        return tokens[:frames], used[:frames]

    @torch.inference_mode()
    def capture_buckets(
        self, pixel_values: torch.Tensor, position_ids: torch.Tensor, no_padding: bool
    ) -> int:
        """Capture the graph of every frame bucket for frames shaped as ``pixel_values`` [>=1, N, C] (its
        first frame repeated); returns how many were new."""
        new = 0
        for bucket in frame_buckets(pixel_values.shape[1]):
            key = (bucket, *pixel_values.shape[1:], pixel_values.dtype, no_padding)
            if key not in self._graphs and len(self._graphs) < self.max_graphs:
                self._capture(
                    key, _repeat_last(pixel_values[:1], bucket), _repeat_last(position_ids[:1], bucket)
                )
                new += 1
        return new

    def _capture(self, key: tuple, pixels: torch.Tensor, positions: torch.Tensor):
        t0 = time.monotonic()
        no_padding = key[-1]
        graph, outputs = _capture(
            lambda: self.model.encode_images_padded(pixels, positions, no_padding),
            self._pool,
            self.device,
            self.capture_stream,
        )
        self._graphs[key] = entry = (graph, pixels, positions, outputs)
        log.info("captured a vision-encoder CUDA graph for %s in %.2fs", key[:-2], time.monotonic() - t0)
        return entry


# Audio graphs: clips padded to a power-of-two frame count (10 ms frames; 30 s of audio is 3,000) and their
# number to a power of two, up to this many frames a graph. Eager, the tower launches ~2,700 kernels whatever
# the clip's length (28-37 ms on an H100); replayed, a 2 s clip takes 3.1 ms and a 30 s one 5.7 ms.
MIN_AUDIO_FRAMES = 128
MAX_AUDIO_FRAMES_PER_GRAPH = 16384


def audio_buckets(frames: int) -> tuple[int, list[int]]:
    """(the frame bucket of a clip of ``frames`` frames, the clip counts graphs are captured for at it)."""
    bucket = max(MIN_AUDIO_FRAMES, 1 << max(0, frames - 1).bit_length())
    top = max(1, MAX_AUDIO_FRAMES_PER_GRAPH // bucket)
    return bucket, [1 << i for i in range(top.bit_length()) if 1 << i <= top]


class AudioGraphRunner:
    """The audio tower and projection as CUDA graphs, one per (clip bucket, frame bucket, dtype): a batch of
    clips is padded along time to its frame bucket (masked frames, as any batch of clips of several lengths
    is) and in number to its clip bucket by repeating the last clip, whose outputs are dropped. Graphs are
    captured the first time a shape is seen, up to ``max_graphs``, or ahead of traffic (``capture_buckets``,
    the engine's warm-up); past the largest bucket the caller encodes in chunks."""

    def __init__(self, model: Gemma4Model, device: torch.device, max_graphs: int = 24):
        self.model = model
        self.device = device
        self.max_graphs = max_graphs
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.capture_stream = _own_capture_stream(device)

    def max_clips(self, frames: int) -> int:
        """The most clips of up to ``frames`` frames one ``encode`` call takes."""
        return audio_buckets(frames)[1][-1]

    @torch.inference_mode()
    def encode(self, features: torch.Tensor, mask: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
        """``Gemma4Model.encode_audio`` by graph replay: features [B, T, 128] and mask [B, T] (valid frames a
        prefix), ``lengths`` each clip's soft-token count -> per clip soft tokens (copies). At most
        ``max_clips(T)`` clips."""
        clips, frames = mask.shape
        frame_bucket, clip_buckets = audio_buckets(frames)
        if clips > clip_buckets[-1]:
            raise ValueError(f"{clips} audio clips of {frames} frames: at most {clip_buckets[-1]} a graph")
        bucket = next(b for b in clip_buckets if b >= clips)
        key = (bucket, frame_bucket, features.dtype)
        entry = self._graphs.get(key)
        if entry is None and len(self._graphs) < self.max_graphs:
            entry = self._capture(key, features[:1], mask[:1])
        if entry is None:
            return self.model.encode_audio(features, mask, lengths)
        graph, static_features, static_mask, tokens = entry
        static_features.zero_()
        static_mask.zero_()
        static_features[:clips, :frames].copy_(features)
        static_mask[:clips, :frames].copy_(mask)
        static_features[clips:] = static_features[clips - 1 : clips]
        static_mask[clips:] = static_mask[clips - 1 : clips]
        graph.replay()
        return [tokens[i, :n].clone() for i, n in enumerate(lengths)]

    @torch.inference_mode()
    def capture_buckets(self, features: torch.Tensor, mask: torch.Tensor, clips: int = 1) -> int:
        """Capture the graph of ``clips`` clips at every frame bucket up to the whole length of ``features``
        [1, T, 128] (a clip of the longest length the processor makes); returns how many were new."""
        new, frames = 0, MIN_AUDIO_FRAMES
        while True:
            bucket, clip_buckets = audio_buckets(frames)
            key = (next(b for b in clip_buckets if b >= clips), bucket, features.dtype)
            if key not in self._graphs and len(self._graphs) < self.max_graphs:
                self._capture(key, features[:1, :bucket], mask[:1, :bucket])
                new += 1
            if bucket >= features.shape[1]:
                return new
            frames = bucket + 1

    def _capture(self, key: tuple, features: torch.Tensor, mask: torch.Tensor):
        """Static inputs of ``key``'s shape holding ``features``' first clip, repeated; the graph's output is
        the soft tokens of every clip's frames [B, L, H]."""
        t0 = time.monotonic()
        clips, frames = key[0], key[1]
        static_features = features.new_zeros(clips, frames, features.shape[-1])
        static_mask = mask.new_zeros(clips, frames)
        length = min(frames, features.shape[1])
        static_features[:, :length] = features[:1, :length]
        static_mask[:, :length] = mask[:1, :length]

        def forward() -> torch.Tensor:
            hidden, _ = self.model.audio_tower(static_features, static_mask)
            return self.model.embed_audio(hidden)

        graph, tokens = _capture(forward, self._pool, self.device, self.capture_stream)
        self._graphs[key] = entry = (graph, static_features, static_mask, tokens)
        log.info("captured an audio-encoder CUDA graph for %s in %.2fs", key[:2], time.monotonic() - t0)
        return entry


def _repeat_last(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` [B, ...] extended to ``rows`` rows by repeating its last one (a new tensor)."""
    return torch.cat([t, t[-1:].expand(rows - t.shape[0], *t.shape[1:])]) if rows > t.shape[0] else t.clone()
