"""Continuous-batching scheduler: which requests run this step, and how many tokens each.

Each step has a token budget (``max_num_batched_tokens``) and a sequence cap
(``max_num_seqs``). Running requests go first, decodes before partial prefills; then waiting
requests are admitted (in arrival order, or by priority then arrival with ``scheduling_policy="priority"``)
with chunked prefill. With ``max_prefill_tokens_beside_decodes``, a step that holds decodes gives prefill
chunks at most that many tokens (the decodes' step time stays bounded); a step without decodes gives them
the whole budget. ``max_encoder_tokens_beside_decodes`` bounds the step's media encodes the same way: a video
encodes the frames that fit (at least one a step) and its prefill follows the frames already
encoded. A waiting request is admitted only when the full pool holds the rest of its prompt. When the KV
pools run out, the last running request in that order is preempted (its blocks freed, recomputed later),
never one that sorts before the request needing room; nothing crashes. A chunk never splits a
bidirectional image span, and never starts on media whose encoder output is neither cached nor
affordable this step. With async scheduling a request's last sampled token may still be on the device:
it counts as a token to compute (the next step reads it on the device), and a request whose final token
is pending is not scheduled.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from g4serve.engine.config import EngineConfig
from g4serve.engine.kv_cache import KVCacheManager
from g4serve.engine.request import Request, RequestStatus
from g4serve.processing.processor import MultimodalItem

# With overlap_encoder, text before media still encoding runs ahead only if it is at least this long; shorter
# text waits and goes with the media: every step reads all the weights (~4 ms for E4B on an H100), more than a
# short chunk saves.
MIN_TEXT_BEFORE_PENDING_MEDIA = 256


@dataclass
class ScheduledBatch:
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    encoder_items: list[MultimodalItem] = field(default_factory=list)  # to encode before the forward
    # content hash -> the frames a video will have once this step's encodes ran, when fewer than all (the
    # encodes start after the frames the encoder cache has)
    encoder_frames: dict[str, int] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.requests)


@dataclass
class EncoderBudget:
    """Soft tokens the encoders may still produce this step. ``full``: the untouched budget (an item larger
    than it still runs, alone in its step); ``split``: beside decodes with
    ``max_encoder_tokens_beside_decodes``, where a video encodes the frames that fit, at least one."""

    left: int
    full: int
    split: bool = False

    def beside_decodes(self, cap: int | None) -> None:
        """The step holds decodes: the cap applies from here on (once)."""
        if cap is None or self.split:
            return
        used = self.full - self.left
        self.full, self.left, self.split = cap, max(0, cap - used), True


def by_arrival(request: Request) -> tuple:
    """``fcfs``: lower sorts first, arrival time alone."""
    return (request.arrival_time,)


def by_priority(request: Request) -> tuple:
    """``priority``: lower sorts first, the request's priority value, then arrival time."""
    return (request.priority, request.arrival_time)


# EngineConfig.scheduling_policy -> the order key.
ORDER_KEYS: dict[str, Callable[[Request], tuple]] = {"fcfs": by_arrival, "priority": by_priority}


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        kv: KVCacheManager,
        encoder_cached: Callable[[str], bool],
        priority: Callable[[Request], tuple] | None = None,
        encoder_in_flight: Callable[[str], bool] = lambda digest: False,
        bidirectional_spans: bool = False,
        encoder_frames_done: Callable[[str], int] = lambda digest: 0,
    ):
        """``config``: the step's limits (``max_num_seqs``, ``max_num_batched_tokens``,
        ``encoder_token_budget``, ``enable_chunked_prefill``, ``overlap_encoder``, ``scheduling_policy``).
        ``priority``: the order key (lower first), by default ``scheduling_policy``'s.
        ``bidirectional_spans``: the model attends bidirectionally inside images, so a chunk never splits
        one. With ``overlap_encoder`` media are encoded ahead, off the step (``EncoderRunner.start``): a chunk
        stops before media whose soft tokens are not cached yet, and the encodes it asks for run while other
        requests' steps go on. ``encoder_frames_done``: frames of a partly encoded video (the cache's)."""
        self.config = config
        self.bidirectional_spans = bidirectional_spans
        self.min_text_before_pending_media = MIN_TEXT_BEFORE_PENDING_MEDIA
        self.kv = kv
        self.encoder_cached = encoder_cached
        self.encoder_in_flight = encoder_in_flight
        self.encoder_frames_done = encoder_frames_done
        self.priority = priority or ORDER_KEYS[config.scheduling_policy]
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Drop a request (finished or aborted) and return all its blocks."""
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request.request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- helpers ----------------------------------------------------------------------------
    def _clip_to_spans(self, request: Request, start: int, num_new: int) -> int:
        """Shorten a chunk so it does not end inside a bidirectional span (0: wait for more budget)."""
        if not self.bidirectional_spans:
            return num_new
        end = start + num_new
        for s, e in request.bidirectional_spans:
            if s < end < e:
                # Tokens of a span see each other: the span's queries must all run in one chunk.
                return s - start if s > start else 0
        return num_new

    def _clip_to_encoder(
        self,
        request: Request,
        start: int,
        num_new: int,
        budget: EncoderBudget,
        batch: ScheduledBatch,
        decodes: bool,
    ) -> int:
        """Stop the chunk before media whose soft tokens are neither cached nor affordable now, or, for a
        video encoding a few frames a step, after the last frame it has. With ``overlap_encoder``, before
        any media not cached yet (or not at all, if the text before them is short); the encodes of all the
        request's media still ahead are started as the budget allows, so they run while its earlier chunks
        prefill. ``decodes``: the step holds a decode (``max_encoder_tokens_beside_decodes`` applies)."""
        if decodes:
            budget.beside_decodes(self.config.max_encoder_tokens_beside_decodes)
        if self.config.overlap_encoder:
            for item in request.mm_items:
                if item.spans[-1][1] <= start or self.encoder_cached(item.content_hash):
                    continue
                if item not in batch.encoder_items and not self.encoder_in_flight(item.content_hash):
                    self._afford(item, budget, batch)
                text = max(0, item.offset - start)
                if text < num_new:  # the chunk would reach these media
                    num_new = text if text >= self.min_text_before_pending_media else 0
            return num_new
        end = start + num_new
        for item in request.mm_items:
            if item.offset >= end or item.spans[-1][1] <= start or self.encoder_cached(item.content_hash):
                continue
            ready = self._afford(item, budget, batch)
            if ready < len(item.spans):
                return min(num_new, max(0, (item.spans[ready - 1][1] if ready else item.offset) - start))
        return num_new

    def _afford(self, item: MultimodalItem, budget: EncoderBudget, batch: ScheduledBatch) -> int:
        """Add ``item`` (or, splitting beside decodes, a video's next frames) to this step's encodes if the
        budget allows; returns how many of its spans (a video's frames) will have soft tokens before this
        step's forward."""
        if item in batch.encoder_items:
            return batch.encoder_frames.get(item.content_hash, len(item.spans))
        done = self.encoder_frames_done(item.content_hash)
        costs = [e - s for s, e in item.spans[done:]]
        take = len(costs)
        if sum(costs) > budget.left:
            if budget.split and item.modality == "video":
                take, spent = 0, 0
                while take < len(costs) and spent + costs[take] <= budget.left:
                    spent, take = spent + costs[take], take + 1
                if take == 0 and budget.left == budget.full:
                    take = 1  # one frame always goes, however small the cap
            elif budget.left != budget.full:
                take = 0  # an item larger than the whole budget runs alone in a step (it could never fit)
        if take == 0:
            return done
        budget.left -= sum(costs[:take])
        batch.encoder_items.append(item)
        if take < len(costs):
            batch.encoder_frames[item.content_hash] = done + take
        return done + take

    def _preempt(self, victim: Request, batch: ScheduledBatch) -> None:
        """Free a running request's blocks and queue it to recompute; scheduled in ``batch`` already (a decode
        of lower priority than a prefill after it), it leaves the batch and its tokens go back to the
        budget."""
        if victim in batch.requests:
            i = batch.requests.index(victim)
            del batch.requests[i], batch.num_new_tokens[i]
        self.running.remove(victim)
        self.kv.free(victim.request_id)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.draft_token_ids.clear()
        self.waiting.insert(0, victim)
        batch.preempted.append(victim)
        self.num_preemptions += 1

    # ---- the step -------------------------------------------------------------------------------
    def _prefill_limit(self, budget: int, prefill_used: int, decodes: bool) -> int:
        """Prefill tokens this step may still take: the budget, capped by
        ``max_prefill_tokens_beside_decodes`` once the step holds a decode."""
        cap = self.config.max_prefill_tokens_beside_decodes
        if cap is None or not decodes:
            return budget
        return max(0, min(budget, cap - prefill_used))

    def _chunk(self, request: Request, start: int, num_new: int, limit: int, budget: int) -> int:
        """``num_new`` tokens from ``start`` cut to ``limit`` and to the bidirectional spans. A span that
        starts here and is longer than the limit (the cap beside decodes) runs whole within the budget
        instead, so it is never starved."""
        clipped = self._clip_to_spans(request, start, min(num_new, limit))
        if clipped <= 0 and limit < budget:
            span_end = next((e for s, e in request.bidirectional_spans if s <= start < e), start)
            clipped = self._clip_to_spans(request, start, min(num_new, budget, span_end - start))
        return clipped

    def _allocate_running(self, request: Request, start: int, num_new: int, batch: ScheduledBatch) -> bool:
        """Blocks for a running request's chunk, preempting lower-priority requests not in ``batch`` as
        needed, the last in the order first (one already in ``batch`` leaves it); when none sorts after it,
        the request itself is preempted (recomputed when memory frees up). Decodes are scheduled before
        prefills: without the order check a decode took the blocks of an earlier or more urgent request's
        prefill, again at each of its blocks; without the batch's decodes among the victims, that prefill
        could only give way to them (test_scheduler_hostile.py)."""
        key = self.priority(request)
        while not self.kv.allocate(request.request_id, start, num_new):
            victims = [r for r in self.running if r is not request and self.priority(r) > key]
            if not victims:
                self._preempt(request, batch)
                return False
            self._preempt(max(victims, key=self.priority), batch)
        return True

    def schedule(self) -> ScheduledBatch:
        cfg = self.config
        batch = ScheduledBatch()
        budget = cfg.max_num_batched_tokens
        encoder_budget = EncoderBudget(cfg.encoder_token_budget, cfg.encoder_token_budget)
        decodes, prefill_used = False, 0  # whether the step holds a decode; its prefill tokens so far

        # Running requests: decodes (one token) first, then unfinished prefills.
        self.running.sort(key=lambda r: (r.num_tokens - r.num_computed_tokens > 1, self.priority(r)))
        for request in list(self.running):
            if budget <= 0:
                break
            if request not in self.running or request.awaiting_last_token:
                continue  # preempted below while making room for an earlier one, or about to finish
            start = request.num_computed_tokens
            decoding = request.num_tokens - start == 1
            if not decoding:
                request.draft_token_ids.clear()  # drafts follow a decode's one known token, nothing else
            num_new = min(request.num_tokens - start + len(request.draft_token_ids), budget)
            if request.draft_token_ids:  # speculative decoding: verify only the drafts that fit
                del request.draft_token_ids[max(0, num_new - 1) :]
            limit = budget if decoding else self._prefill_limit(budget, prefill_used, decodes)
            if limit <= 0:
                continue  # the prefill cap beside decodes is spent; other decodes may still run
            num_new = self._chunk(request, start, num_new, limit, budget)
            num_new = self._clip_to_encoder(request, start, num_new, encoder_budget, batch, decodes)
            if num_new <= 0:
                continue
            if self._allocate_running(request, start, num_new, batch):
                batch.requests.append(request)
                batch.num_new_tokens.append(num_new)
                if decoding:
                    decodes = True
                else:
                    prefill_used += num_new
            budget = cfg.max_num_batched_tokens - batch.num_tokens  # preempted decodes gave their tokens back

        self._admit_waiting(batch, budget, encoder_budget, prefill_used if decodes else None)
        return batch

    def _take_prefix_hit(self, request: Request) -> bool:
        """A request never scheduled yet starts after its cached prefix (True); others as they are."""
        if request.num_computed_tokens != 0 or request.request_id in self.kv.seqs:
            return False
        hit = self.kv.find_cached_prefix(request.request_id, request.block_hashes, request.num_tokens)
        request.num_computed_tokens = request.metrics.prefix_hit_tokens = hit
        return True

    def _full_blocks_promised(self) -> int:
        """Full-pool blocks the running requests still need for the tokens they have (the rest of a prompt
        being prefilled in chunks): not free for an admission."""
        return sum(
            self.kv.full_blocks_to_hold(r.request_id, r.num_computed_tokens, r.num_tokens)
            for r in self.running
        )

    def _release_prefix_hit(self, request: Request, fresh: bool) -> None:
        """A waiting request not admitted after all gives its prefix hit back: holding cached blocks that no
        preemption can reclaim, it could starve the running ones and itself (test_scheduler_unit.py)."""
        if fresh:
            self.kv.free(request.request_id)
            request.num_computed_tokens = request.metrics.prefix_hit_tokens = 0

    def _first_chunk(
        self,
        request: Request,
        budget: int,
        limit: int,
        encoder_budget: EncoderBudget,
        batch: ScheduledBatch,
        decodes: bool,
    ) -> int:
        """Tokens of a waiting request's first chunk this step: 0 when it must wait (-1: its media are
        encoding, later requests need not wait for it). ``decodes``: the step holds a decode."""
        cfg, start = self.config, request.num_computed_tokens
        num_new = request.num_tokens - start
        # Without chunked prefill a prompt waits for a step with room for it whole; a resumed request's prompt
        # and outputs may exceed any step, and are chunked rather than wait at the queue's head forever.
        if not cfg.enable_chunked_prefill and budget < num_new <= cfg.max_num_batched_tokens:
            return 0
        num_new = self._chunk(request, start, num_new, limit, budget)
        clipped = self._clip_to_encoder(request, start, num_new, encoder_budget, batch, decodes)
        if clipped <= 0 and num_new > 0 and cfg.overlap_encoder:
            return -1
        return clipped

    def _admit_waiting(
        self, batch: ScheduledBatch, budget: int, encoder_budget: EncoderBudget, prefill_used: int | None
    ) -> None:
        """Waiting requests, admitted into ``batch`` while the token budget (the prefill cap, with
        ``prefill_used`` tokens of it spent, when the step holds decodes), sequence slots and blocks last. A
        request is admitted only when the full pool holds the rest of its prompt beside what the running
        ones are promised: admitted on its first chunk alone, a prompt that could not fit filled the pool,
        was preempted by the next decode's block and admitted again, over and over (1,382 tokens computed
        for a 200-token prompt, test_scheduler_hostile.py)."""
        cfg = self.config
        self.waiting.sort(key=self.priority)
        admitted = []
        promised = self._full_blocks_promised()
        for request in self.waiting:
            limit = self._prefill_limit(budget, prefill_used or 0, prefill_used is not None)
            if limit <= 0 or len(self.running) + len(admitted) >= cfg.max_num_seqs:
                break
            if request.awaiting_last_token:  # preempted with its last token pending: it finishes unscheduled
                continue
            fresh = self._take_prefix_hit(request)
            start = request.num_computed_tokens
            num_new = self._first_chunk(
                request, budget, limit, encoder_budget, batch, prefill_used is not None
            )
            if num_new < 0:
                continue  # its media are encoding: later requests need not wait for them
            rest = self.kv.full_blocks_to_hold(request.request_id, start, request.num_tokens)
            if (
                num_new == 0
                or rest > self.kv.num_free_full() - promised
                or not self.kv.allocate(request.request_id, start, num_new)
            ):
                self._release_prefix_hit(request, fresh)
                break  # keep FCFS order: later requests wait behind this one
            promised += self.kv.full_blocks_to_hold(request.request_id, start, request.num_tokens)
            admitted.append(request)
            batch.requests.append(request)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
            if prefill_used is not None:
                prefill_used += num_new
        for request in admitted:
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
