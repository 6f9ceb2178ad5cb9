"""Turns a scheduled batch into model inputs, runs the decoder and samples: ``prepare`` -> ``forward`` ->
``sample``.

``prepare(batch)`` packs a ``StepInputs``: the scheduled tokens of every request concatenated, how many
each had computed before, paged-cache addressing for both pools, bidirectional image spans, and the soft
tokens of any media the chunk covers. Only the last token of requests that finish their known tokens this
step needs logits; with fast prefill the KV-shared layers run on those tokens alone. Requests with a LoRA
adapter give each of their tokens the adapter's slot, so one forward mixes adapters. With async scheduling
a request's input token may be the previous step's sample, not yet on the host, and an MTP round's drafts
stay on the device: both are copied into the step's token ids on the device (``inputs.PendingTokens``).

``forward`` replays a CUDA graph when the runner owns one that fits the step (pure decodes; text or
mixed steps up to a token bucket; speculative verification, every row sampled), else runs the model
eagerly; ``sample`` applies the requests' sampling parameters, grammar masks and stop-token rules.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Protocol

import torch

from g4serve.engine.config import EngineConfig
from g4serve.engine.cuda_graphs import (
    DEFAULT_BATCH_SIZES,
    DEFAULT_TOKEN_BUCKETS,
    VERIFY_TOKEN_BUCKETS,
    DecodeGraphRunner,
    DraftGraphRunner,
    MixedGraphRunner,
    VerifyGraphRunner,
    sizes_up_to,
)
from g4serve.engine.encoder_runner import EncoderCache
from g4serve.engine.inputs import PendingTokens, gather_pending
from g4serve.engine.kv_cache import KVCacheManager
from g4serve.engine.request import Request
from g4serve.engine.scheduler import ScheduledBatch
from g4serve.layers.attention import AttentionBackend, contiguous_metadata
from g4serve.layers.lora import LoRABatch, LoRAWeights
from g4serve.layers.sampler import SamplerOutput, SamplingBatch, TokenCounts, sample
from g4serve.models.gemma4.assistant import Gemma4Assistant
from g4serve.models.gemma4.model import Gemma4Model
from g4serve.structured.bitmask import AllowedTokenMasks
from g4serve.transfer import fill_at, to_device


@dataclass
class StepInputs:
    """One step's model inputs, packed on the host (``ModelRunner.prepare``)."""

    token_ids: list[int] = field(default_factory=list)  # every sequence's new tokens, concatenated
    computed: list[int] = field(default_factory=list)  # tokens each sequence had computed before the step
    num_new_tokens: list[int] = field(default_factory=list)
    tables: dict[str, list[list[int]]] = field(default_factory=dict)  # pool -> each sequence's blocks
    spans: list = field(default_factory=list)  # each sequence's bidirectional (image) spans
    pending: PendingTokens | None = None  # input tokens still on the device (async scheduling, drafts)
    mm_rows: list[torch.Tensor] = field(default_factory=list)  # soft tokens of the media the step covers
    mm_positions: list[int] = field(default_factory=list)  # their flat rows
    keep: list[int] = field(default_factory=list)  # flat rows whose logits are needed
    sampled: list[Request] = field(default_factory=list)  # requests that sample a token, in row order
    sampled_seqs: list[int] = field(default_factory=list)  # their sequence index in the batch
    # each token's LoRA adapter slot (-1: none); None: no adapter in the step
    lora_slots: list[int] | None = None
    # Speculative decoding: a request verifying drafts samples every row from its last known token on; it
    # appears in ``sampled`` once per row.
    has_drafts: bool = False

    @property
    def is_pure_decode(self) -> bool:
        """One text token per sequence, every one sampled."""
        return not self.mm_rows and len(self.sampled) == len(self.computed) == len(self.token_ids)


class StepPublisher(Protocol):
    """Tensor parallel, rank 0: hands each step's inputs, then its samples, to the other ranks, which run the
    same forward (``engine.tensor_parallel.StepChannel``)."""

    def publish(self, step: StepInputs | None) -> None: ...

    def publish_samples(self, token_ids: torch.Tensor) -> None: ...


@dataclass
class StepResult:
    requests: list[Request]  # requests that sampled a token this step, in row order (once per row)
    output: SamplerOutput | None
    hidden: torch.Tensor | None = None  # the final hidden state of each row (``ModelRunner.keep_hidden``)


class ModelRunner:
    """Runs steps of ``model``. ``cuda_graphs``: capture decode and mixed-step CUDA graphs now (CUDA and the
    Triton backend only); ``graph_runners(capture=False)`` builds the same padded steps eagerly, which is
    how the CPU tests check them."""

    def __init__(
        self,
        model: Gemma4Model,
        backend: AttentionBackend,
        config: EngineConfig,
        pools: list[str],
        max_model_len: int,
        decodable_vocab_size: int | None = None,
        cuda_graphs: bool = False,
        lora_weights: LoRAWeights | None = None,
        num_speculative_tokens: int = 0,
        publisher: StepPublisher | None = None,
    ):
        self.model = model
        self.publisher = publisher  # tensor parallel, rank 0
        self.num_speculative_tokens = num_speculative_tokens
        self.lora_weights = lora_weights
        self.backend = backend
        self.config = config
        self.pools = pools
        self.max_model_len = max_model_len
        self.block_size = config.block_size
        self.fast_prefill = config.fast_prefill
        self.device = next(model.parameters()).device
        self.vocab_size = model.cfg.text.vocab_size
        self.decodable_vocab_size = min(decodable_vocab_size or self.vocab_size, self.vocab_size)
        self.token_masks = AllowedTokenMasks(self.vocab_size, self.device)
        # Penalised requests' prompt masks and output counts, by request id (released by LLMEngine._finish).
        self.token_counts = TokenCounts(self.vocab_size, self.device)
        self.decode_graphs: DecodeGraphRunner | None = None
        self.mixed_graphs: MixedGraphRunner | None = None
        self.verify_graphs: VerifyGraphRunner | None = None
        self.num_graph_steps = 0
        # An MTP drafter reads the target's final hidden state of each sampled row (``StepResult.hidden``).
        self.keep_hidden = False
        self._hidden: torch.Tensor | None = None
        if cuda_graphs:
            self.use_graphs(capture=True)

    def use_graphs(self, capture: bool) -> None:
        """Build the step graphs (``graph_runners``) and, with ``capture``, capture them now into one memory
        pool (steps never overlap); without, the same padded steps run eagerly (the CPU tests)."""
        self.decode_graphs, self.mixed_graphs, self.verify_graphs = self.graph_runners(capture)
        if capture:
            pool = torch.cuda.graph_pool_handle()
            for runner in (self.mixed_graphs, self.verify_graphs, self.decode_graphs):
                if runner is not None:
                    runner.capture(pool)

    def release_graphs(self) -> None:
        """Free the step graphs (and their memory pool); the runner steps eagerly afterwards."""
        self.decode_graphs = self.mixed_graphs = self.verify_graphs = None
        gc.collect()  # a graph referenced from a cycle goes now, not at some later collection
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def graph_runners(
        self, capture: bool
    ) -> tuple[DecodeGraphRunner, MixedGraphRunner, VerifyGraphRunner | None]:
        """Padded decode steps for every batch size up to ``max_cuda_graph_batch``; text / mixed steps up to
        ``max_num_batched_tokens`` tokens over up to ``max_num_seqs`` sequences, per token bucket; and with
        speculative decoding, verification steps of up to ``1 + k`` rows for each of as many sequences as
        the decode graphs hold."""
        cfg = self.config
        common = (self.model, self.backend, self.pools, self.block_size, self.max_model_len)
        max_batch = min(cfg.max_cuda_graph_batch or cfg.max_num_seqs, cfg.max_num_seqs)
        decode = DecodeGraphRunner(
            *common,
            sizes_up_to(max_batch, DEFAULT_BATCH_SIZES),
            self.device,
            capture=capture,
            decodable_vocab_size=self.decodable_vocab_size,
            lora_weights=self.lora_weights,
        )
        mixed = MixedGraphRunner(
            *common,
            sizes_up_to(cfg.max_num_batched_tokens, DEFAULT_TOKEN_BUCKETS),
            cfg.max_num_seqs,
            self.device,
            capture=capture,
            yoco=self.fast_prefill,
            decodable_vocab_size=self.decodable_vocab_size,
            lora_weights=self.lora_weights,
        )
        verify = None
        if self.num_speculative_tokens:
            rows = min(max_batch * (1 + self.num_speculative_tokens), cfg.max_num_batched_tokens)
            verify = VerifyGraphRunner(
                *common,
                sizes_up_to(rows, VERIFY_TOKEN_BUCKETS),
                max_batch,
                self.device,
                capture=capture,
                decodable_vocab_size=self.decodable_vocab_size,
                lora_weights=self.lora_weights,
            )
        return decode, mixed, verify

    def draft_graphs(self, drafter: Gemma4Assistant, num_steps: int, capture: bool) -> DraftGraphRunner:
        """MTP drafting rounds of ``num_steps`` as graphs for the batch sizes of the decode graphs, over this
        runner's model, backend and cache (``capture=False``: the padded rounds run eagerly)."""
        assert self.decode_graphs is not None, "draft graphs follow the decode graphs' batch sizes"
        graphs = DraftGraphRunner(
            drafter,
            self.model,
            self.backend,
            self.pools,
            self.block_size,
            self.max_model_len,
            self.decode_graphs.batch_sizes,
            num_steps,
            self.device,
            capture,
            self.decodable_vocab_size,
        )
        graphs.capture()
        return graphs

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
        inputs = self.prepare(batch, kv, encoder_cache, previous)
        self._hidden = None
        logits, greedy = self.forward(inputs)
        if logits is None:  # every sequence is still mid-prompt
            return StepResult([], None)
        output = self.sample(inputs.sampled, logits, greedy)
        if self.publisher is not None:  # the other ranks' next step may read these on the device
            self.publisher.publish_samples(output.token_ids)
        return StepResult(inputs.sampled, output, self._hidden)

    # ---- prepare -------------------------------------------------------------------------------------
    def prepare(
        self,
        batch: ScheduledBatch,
        kv: KVCacheManager,
        encoder_cache: EncoderCache,
        previous: StepResult | None = None,
    ) -> StepInputs:
        step = StepInputs(
            computed=[r.num_computed_tokens for r in batch.requests],
            num_new_tokens=list(batch.num_new_tokens),
            tables={pool: [] for pool in kv.pool_types},
        )
        pending_rows: list[int] = []
        pending_src: list[int] = []
        previous_rows: dict[int, int] | None = None
        device_drafts: dict[int, tuple] = {}  # id(DeviceDrafts) -> (its tokens, flat rows, sources)
        if self.lora_weights is not None and any(r.lora_slot >= 0 for r in batch.requests):
            step.lora_slots = [
                r.lora_slot for r, n in zip(batch.requests, batch.num_new_tokens) for _ in range(n)
            ]
        for seq, (request, n) in enumerate(zip(batch.requests, batch.num_new_tokens)):
            start, base = request.num_computed_tokens, len(step.token_ids)
            step.mm_rows.extend(self._mm_embeds(request, start, start + n, encoder_cache, base, step))
            chunk = request.token_ids_between(start, start + n)
            if request.draft_token_ids and len(chunk) == 1 < n:  # a decode with drafts to verify
                self._add_verification(step, seq, request, chunk, request.draft_token_ids[: n - 1], kv)
                if request.verifying_source is not None:  # their values are still on the device
                    drafts, index = request.verifying_source
                    _, rows, src = device_drafts.setdefault(id(drafts), (drafts.tokens, [], []))
                    width = drafts.tokens.shape[1]
                    rows += range(base + 1, base + n)
                    src += range(index * width, index * width + n - 1)
                continue
            if len(chunk) < n:  # the chunk ends on the token the previous step sampled
                assert len(chunk) == n - 1 and previous is not None, "only the last token may be pending"
                if previous_rows is None:
                    previous_rows = {id(r): row for row, r in enumerate(previous.requests)}
                pending_rows.append(base + n - 1)
                pending_src.append(previous_rows[id(request)])
                chunk.append(0)
            step.token_ids.extend(chunk)
            for pool, table in kv.block_tables(request.request_id).items():
                step.tables[pool].append(table)
            step.spans.append(request.bidirectional_spans)
            if start + n == request.num_tokens:
                step.keep.append(len(step.token_ids) - 1)
                step.sampled.append(request)
                step.sampled_seqs.append(seq)
        groups = list(device_drafts.values())
        if pending_rows:
            groups.insert(0, (previous.output.token_ids, pending_rows, pending_src))
        step.pending = gather_pending(groups)
        return step

    @staticmethod
    def _add_verification(
        step: StepInputs, seq: int, request: Request, chunk: list[int], drafts: list[int], kv: KVCacheManager
    ) -> None:
        """A decode with drafts: its last known token, then the drafts (now the request's ``verifying``;
        drafts still on the device are placeholders the caller has copied in there); every one of its rows
        samples."""
        first = len(step.token_ids)
        step.has_drafts = True
        request.verifying = list(drafts)
        request.verifying_source = request.draft_source
        step.token_ids.extend(chunk + drafts)
        for pool, table in kv.block_tables(request.request_id).items():
            step.tables[pool].append(table)
        step.spans.append(request.bidirectional_spans)
        for row in range(first, len(step.token_ids)):
            step.keep.append(row)
            step.sampled.append(request)
            step.sampled_seqs.append(seq)

    def _mm_embeds(
        self, request: Request, start: int, end: int, cache: EncoderCache, base: int, step: StepInputs
    ) -> list[torch.Tensor]:
        """Rows of the request's soft tokens that fall in token range [start, end), in order; their
        flat-batch rows (the request's chunk starts at row ``base``) are appended to ``step.mm_positions``."""
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
                    step.mm_positions.extend(range(base + lo - start, base + hi - start))
                row += e - s
        return out

    # ---- forward -------------------------------------------------------------------------------------
    def forward(self, step: StepInputs) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Logits [len(step.sampled), V] of the sampled rows (None when no row samples), and their greedy ids
        when a CUDA graph computed them. With ``keep_hidden`` the rows' final hidden states go to
        ``self._hidden``."""
        if self.publisher is not None:
            self.publisher.publish(step)
        decode, mixed, verify = self.decode_graphs, self.mixed_graphs, self.verify_graphs
        num_tokens, num_seqs = len(step.token_ids), len(step.computed)
        if step.has_drafts:  # several sampled rows per sequence
            if verify is None or step.mm_rows or num_tokens > verify.max_tokens or num_seqs > verify.max_seqs:
                return self._forward_eager(step), None
            outputs = verify.run(
                step.token_ids,
                step.computed,
                step.num_new_tokens,
                step.tables,
                pending=step.pending,
                lora_slots=step.lora_slots,
            )
            return self._graph_rows(outputs, step.keep, num_tokens)
        if decode is not None and step.is_pure_decode and num_tokens <= decode.max_batch:
            outputs = decode.run(step.token_ids, step.computed, step.tables, step.pending, step.lora_slots)
            return self._graph_rows(outputs, None, num_seqs)
        if (
            mixed is not None
            and (not step.mm_rows or mixed.media)
            and num_tokens <= mixed.max_tokens
            and num_seqs <= mixed.max_seqs
        ):
            outputs = mixed.run(
                step.token_ids,
                step.computed,
                step.num_new_tokens,
                step.tables,
                step.mm_rows,
                step.mm_positions,
                step.pending,
                step.lora_slots,
            )
            if not step.sampled:
                self.num_graph_steps += 1
                return None, None
            # rows of sequences still mid-prompt are dropped
            return self._graph_rows(outputs, step.sampled_seqs, num_seqs)
        return self._forward_eager(step), None

    def _graph_rows(
        self, outputs: tuple[torch.Tensor, ...], rows: list[int] | None, num_rows: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, greedy ids) of a graph step's ``rows`` (None or all ``num_rows``: every row), keeping the
        rows' hidden states when a drafter needs them."""
        self.num_graph_steps += 1
        logits, greedy, hidden = outputs
        if rows is not None and len(rows) < num_rows:
            index = to_device(rows, torch.long, self.device)
            logits, greedy, hidden = logits[index], greedy[index], hidden[index]
        if self.keep_hidden:
            self._hidden = hidden
        return logits, greedy

    def _forward_eager(self, step: StepInputs) -> torch.Tensor | None:
        """``forward`` without a CUDA graph: contiguous attention metadata and an eager forward."""
        meta = contiguous_metadata(
            step.computed, step.num_new_tokens, step.tables, self.block_size, self.device, step.spans
        )
        ids = to_device(step.token_ids, torch.long, self.device)
        if step.pending is not None:
            step.pending.write_into(ids)
        hidden = self.model(
            ids,
            meta,
            self.backend,
            mm_embeds=torch.cat(step.mm_rows) if step.mm_rows else None,
            mm_positions=to_device(step.mm_positions, torch.long, self.device) if step.mm_rows else None,
            keep_indices=step.keep if self.fast_prefill else None,
            lora=self._lora_batch(step),
        )
        if not step.sampled:
            return None
        if not self.fast_prefill:
            hidden = hidden[to_device(step.keep, torch.long, self.device)]
        if self.keep_hidden:
            self._hidden = hidden
        return self.model.compute_logits(hidden)

    def _lora_batch(self, step: StepInputs) -> LoRABatch | None:
        if step.lora_slots is None:
            return None
        return LoRABatch(self.lora_weights, to_device(step.lora_slots, torch.int32, self.device))

    # ---- sample --------------------------------------------------------------------------------------
    def sample(
        self, sampled: list[Request], logits: torch.Tensor, greedy: torch.Tensor | None = None
    ) -> SamplerOutput:
        """Sample one token per row. ``greedy``: the argmax over the decodable ids, already computed (inside
        a CUDA graph); a batch of plain greedy requests takes it as is."""
        if greedy is not None and all(_plain_greedy(r) for r in sampled):
            return SamplerOutput(greedy, None, None, None)
        # Grammar masks are built on the CPU while the device still runs the forward. Stop tokens wait
        # for min_tokens and ignore_eos unless the grammar allows nothing else; near max_tokens the
        # grammar is steered to close in time.
        # A request verifying drafts has one row per draft plus one: row j comes j tokens later, after
        # drafts[:j] (its grammar fills that row as if they were accepted).
        allowed = None
        if any(r.grammar is not None for r in sampled):
            offsets = _row_offsets(sampled)
            allowed = self.token_masks(
                [r.grammar for r in sampled],
                [
                    len(r.output_token_ids) + j >= r.sampling_params.min_tokens
                    and not r.sampling_params.ignore_eos
                    for r, j in zip(sampled, offsets)
                ],
                [r.max_output_tokens - len(r.output_token_ids) - j for r, j in zip(sampled, offsets)],
                [r.verifying[j] if j < len(r.verifying) else None for r, j in zip(sampled, offsets)],
            )
        allowed = self._withhold_stops_before_min_tokens(sampled, allowed)
        if self.decodable_vocab_size < self.vocab_size:
            # Ids past the tokenizer's vocabulary (padded embeddings; random presets on the small embedded
            # tokenizer) would decode to nothing: never sample them.
            logits[:, self.decodable_vocab_size :] = float("-inf")
        # the noise counter: the output position each row samples (pending outputs counted; a request
        # verifying drafts samples positions n, n + 1, ...)
        positions = [r.num_output_tokens + j for r, j in zip(sampled, _row_offsets(sampled))]
        sampling = SamplingBatch.build(
            [r.sampling_params for r in sampled],
            [r.sampling_params.seed for r in sampled],
            self.vocab_size,
            self.device,
            output_tokens=[r.output_token_ids for r in sampled],
            prompt_tokens=[r.prompt_token_ids for r in sampled],
            allowed=allowed,
            positions=positions,
            token_counts=self.token_counts,
            request_ids=[r.request_id for r in sampled],
        )
        return sample(logits, sampling)

    def _withhold_stops_before_min_tokens(
        self, sampled: list[Request], allowed: torch.Tensor | None
    ) -> torch.Tensor | None:
        """Free (unconstrained) rows short of ``min_tokens`` may not sample a stop token (vLLM semantics);
        constrained rows already got this from their grammar mask (a thought gate without a grammar, spec
        None, constrains no stop token)."""
        pending = [
            (row, r)
            for row, r in enumerate(sampled)
            if (r.grammar is None or r.grammar.spec is None) and r.min_tokens_pending
        ]
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
            fill_at(allowed, (index[0], index[1]), False)
        return allowed


def _row_offsets(sampled: list[Request]) -> list[int]:
    """Each row's index among its request's rows (consecutive: 0, 1, ... for a request verifying drafts)."""
    offsets, previous = [], None
    for request in sampled:
        offsets.append(offsets[-1] + 1 if request is previous else 0)
        previous = request
    return offsets


def _plain_greedy(request: Request) -> bool:
    """Greedy with nothing that reshapes the logits or asks for them: no grammar, penalties, logit bias,
    withheld stop tokens or logprobs."""
    p = request.sampling_params
    return (
        p.greedy
        and request.grammar is None
        and p.logprobs is None
        and not request.min_tokens_pending
        and not p.has_penalties
        and not p.logit_bias
    )
