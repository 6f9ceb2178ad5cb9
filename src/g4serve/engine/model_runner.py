"""Turns a scheduled batch into flat model inputs, runs the decoder and samples.

Inputs: the scheduled tokens of every request concatenated, their positions, paged-cache
addressing for both pools, bidirectional image spans, and the soft tokens of any media the
chunk covers. Only the last token of requests that finish their known tokens this step needs
logits; with fast prefill the KV-shared layers run on those tokens alone. With async scheduling
a request's input token may be the previous step's sample, not yet on the host: it is copied
into the step's token ids on the device (``PendingTokens``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from g4serve.engine.cuda_graphs import DecodeGraphRunner, MixedGraphRunner
from g4serve.engine.encoder_runner import EncoderCache
from g4serve.engine.kv_cache import KVCacheManager
from g4serve.engine.request import Request
from g4serve.engine.scheduler import ScheduledBatch
from g4serve.layers.attention import AttentionBackend, contiguous_metadata
from g4serve.layers.sampler import SamplerOutput, SamplingBatch, sample
from g4serve.models.gemma4.model import Gemma4Model
from g4serve.structured.bitmask import AllowedTokenMasks
from g4serve.transfer import to_device


@dataclass
class StepResult:
    requests: list[Request]  # requests that sampled a token this step, in row order
    output: SamplerOutput | None


@dataclass
class PendingTokens:
    """Input tokens still on the device: flat row ``rows[i]`` of this step takes ``tokens[src[i]]``."""

    rows: list[int]
    src: list[int]
    tokens: torch.Tensor

    def write_into(self, ids: torch.Tensor) -> None:
        k = len(self.rows)
        if self.rows == self.src and self.rows[-1] == k - 1:  # steady decode: same requests, same order
            ids[:k].copy_(self.tokens[:k])
            return
        index = to_device([self.rows, self.src], torch.long, ids.device)
        ids.index_copy_(0, index[0], self.tokens.index_select(0, index[1]))


class ModelRunner:
    def __init__(
        self,
        model: Gemma4Model,
        backend: AttentionBackend,
        block_size: int,
        fast_prefill: bool = True,
        decodable_vocab_size: int | None = None,
    ):
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.fast_prefill = fast_prefill
        self.device = next(model.parameters()).device
        self.vocab_size = model.cfg.text.vocab_size
        self.decodable_vocab_size = min(decodable_vocab_size or self.vocab_size, self.vocab_size)
        self.token_masks = AllowedTokenMasks(self.vocab_size, self.device)
        # Set by the engine when steps are replayed as CUDA graphs.
        self.decode_graphs: DecodeGraphRunner | None = None
        self.mixed_graphs: MixedGraphRunner | None = None
        self.num_graph_steps = 0

    def _mm_embeds(
        self, request: Request, start: int, end: int, cache: EncoderCache, base: int, positions: list[int]
    ) -> list[torch.Tensor]:
        """Rows of the request's soft tokens that fall in token range [start, end), in order; their
        flat-batch rows (the request's chunk starts at row ``base``) are appended to ``positions``."""
        out = []
        for item in request.mm_items:
            if item.offset >= end or item.spans[-1][1] <= start:
                continue
            tokens = cache.get(item.content_hash)
            row = 0
            for s, e in item.spans:
                lo, hi = max(s, start), min(e, end)
                if lo < hi:
                    out.append(tokens[row + lo - s : row + hi - s])
                    positions.extend(range(base + lo - start, base + hi - start))
                row += e - s
        return out

    def _withhold_stops_before_min_tokens(
        self, sampled: list[Request], allowed: torch.Tensor | None
    ) -> torch.Tensor | None:
        """Free (unconstrained) rows short of ``min_tokens`` may not sample a stop token (vLLM semantics);
        constrained rows already got this from their grammar mask."""
        pending = [(row, r) for row, r in enumerate(sampled) if r.grammar is None and r.min_tokens_pending]
        if not pending:
            return allowed
        if allowed is None:
            allowed = torch.ones(len(sampled), self.vocab_size, dtype=torch.bool, device=self.device)
        rows, cols = [], []
        for row, request in pending:
            stops = [t for t in request.stop_token_ids if t < self.vocab_size]
            rows += [row] * len(stops)
            cols += stops
        if rows:
            index = to_device([rows, cols], torch.long, self.device)
            allowed[index[0], index[1]] = False
        return allowed

    @torch.inference_mode()
    def execute(
        self,
        batch: ScheduledBatch,
        kv: KVCacheManager,
        encoder_cache: EncoderCache,
        previous: StepResult | None = None,
    ) -> StepResult:
        """Run one scheduled step. ``previous``: the launched step whose samples are not on the host yet
        (async scheduling); a request's pending token is read from its output on the device."""
        token_ids: list[int] = []
        pending_rows: list[int] = []
        pending_src: list[int] = []
        previous_rows: dict[int, int] | None = None
        mm_rows: list[torch.Tensor] = []
        mm_positions: list[int] = []
        keep: list[int] = []
        sampled: list[Request] = []
        sampled_seqs: list[int] = []  # batch index of each sampled request
        tables: dict[str, list[list[int]]] = {pool: [] for pool in kv.pool_types}
        spans = []
        for seq, (request, n) in enumerate(zip(batch.requests, batch.num_new_tokens)):
            start = request.num_computed_tokens
            mm_rows.extend(
                self._mm_embeds(request, start, start + n, encoder_cache, len(token_ids), mm_positions)
            )
            chunk = request.token_ids_between(start, start + n)
            if len(chunk) < n:  # the chunk ends on the token the previous step sampled
                assert len(chunk) == n - 1 and previous is not None, "only the last token may be pending"
                if previous_rows is None:
                    previous_rows = {id(r): row for row, r in enumerate(previous.requests)}
                pending_rows.append(len(token_ids) + n - 1)
                pending_src.append(previous_rows[id(request)])
                chunk.append(0)
            token_ids.extend(chunk)
            for pool, table in kv.block_tables(request.request_id).items():
                tables[pool].append(table)
            spans.append(request.bidirectional_spans)
            if start + n == request.num_tokens:
                keep.append(len(token_ids) - 1)
                sampled.append(request)
                sampled_seqs.append(seq)
        pending = (
            PendingTokens(pending_rows, pending_src, previous.output.token_ids) if pending_rows else None
        )
        computed = [r.num_computed_tokens for r in batch.requests]
        decode, mixed = self.decode_graphs, self.mixed_graphs
        if (
            not mm_rows
            and decode is not None
            and len(sampled) == len(batch.requests) == len(token_ids)
            and len(token_ids) <= decode.max_batch
        ):
            # A pure decode step: one text token per sequence, every one sampled.
            self.num_graph_steps += 1
            return StepResult(
                sampled, self._sample(sampled, *decode.run(token_ids, computed, tables, pending))
            )
        if (
            mixed is not None
            and (not mm_rows or mixed.media)
            and len(token_ids) <= mixed.max_tokens
            and len(batch.requests) <= mixed.max_seqs
        ):
            logits, greedy = mixed.run(
                token_ids, computed, batch.num_new_tokens, tables, mm_rows, mm_positions, pending
            )
            self.num_graph_steps += 1
            if not sampled:
                return StepResult([], None)
            if len(sampled) < len(batch.requests):  # rows of sequences still mid-prompt are dropped
                rows = to_device(sampled_seqs, torch.long, self.device)
                logits, greedy = logits[rows], greedy[rows]
            return StepResult(sampled, self._sample(sampled, logits, greedy))
        return self._execute_eager(
            batch, token_ids, computed, tables, spans, pending, mm_rows, mm_positions, keep, sampled
        )

    def _execute_eager(
        self,
        batch: ScheduledBatch,
        token_ids: list[int],
        computed: list[int],
        tables: dict[str, list[list[int]]],
        spans: list,
        pending: PendingTokens | None,
        mm_rows: list[torch.Tensor],
        mm_positions: list[int],
        keep: list[int],
        sampled: list[Request],
    ) -> StepResult:
        """``execute``'s path without a CUDA graph: contiguous attention metadata and an eager forward."""
        meta = contiguous_metadata(
            computed, batch.num_new_tokens, tables, self.block_size, self.device, spans
        )
        ids = to_device(token_ids, torch.long, self.device)
        if pending is not None:
            pending.write_into(ids)
        mm_embeds = torch.cat(mm_rows) if mm_rows else None
        positions = to_device(mm_positions, torch.long, self.device) if mm_rows else None
        hidden = self.model(
            ids,
            meta,
            self.backend,
            mm_embeds=mm_embeds,
            mm_positions=positions,
            keep_indices=keep if self.fast_prefill else None,
        )
        if not sampled:
            return StepResult([], None)
        if not self.fast_prefill:
            hidden = hidden[to_device(keep, torch.long, self.device)]
        return StepResult(sampled, self._sample(sampled, self.model.compute_logits(hidden)))

    def _sample(
        self, sampled: list[Request], logits: torch.Tensor, greedy: torch.Tensor | None = None
    ) -> SamplerOutput:
        """Sample one token per row. ``greedy``: the argmax over the decodable ids, already computed (inside
        a CUDA graph); a batch of plain greedy requests takes it as is."""
        if greedy is not None and all(_plain_greedy(r) for r in sampled):
            return SamplerOutput(greedy, None, None, None)
        # Grammar masks are built on the CPU while the device still runs the forward. Stop tokens wait
        # for min_tokens and ignore_eos unless the grammar allows nothing else; near max_tokens the
        # grammar is steered to close in time.
        allowed = None
        if any(r.grammar is not None for r in sampled):
            allowed = self.token_masks(
                [r.grammar for r in sampled],
                [
                    len(r.output_token_ids) >= r.sampling_params.min_tokens
                    and not r.sampling_params.ignore_eos
                    for r in sampled
                ],
                [r.max_output_tokens - len(r.output_token_ids) for r in sampled],
            )
        allowed = self._withhold_stops_before_min_tokens(sampled, allowed)
        if self.decodable_vocab_size < self.vocab_size:
            # Ids past the tokenizer's vocabulary (padded embeddings; random presets on the small embedded
            # tokenizer) would decode to nothing: never sample them.
            logits[:, self.decodable_vocab_size :] = float("-inf")
        for request in sampled:
            request.init_generator(self.device)
        sampling = SamplingBatch.build(
            [r.sampling_params for r in sampled],
            [r.generator for r in sampled],
            self.vocab_size,
            self.device,
            output_tokens=[r.output_token_ids for r in sampled],
            prompt_tokens=[r.prompt_token_ids for r in sampled],
            allowed=allowed,
        )
        return sample(logits, sampling)


def _plain_greedy(request: Request) -> bool:
    """Greedy with nothing that reshapes the logits or asks for them: no grammar, penalties, withheld stop
    tokens or logprobs."""
    p = request.sampling_params
    return (
        p.greedy
        and request.grammar is None
        and p.logprobs is None
        and not request.min_tokens_pending
        and not p.has_penalties
    )
