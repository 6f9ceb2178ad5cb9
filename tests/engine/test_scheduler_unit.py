"""Scheduler policy with the real KVCacheManager and no model: admission, token budget, chunked prefill,
preemption, prefix-cache hits.

Pools are tiny (blocks of 4 tokens, a sliding window of 8) so that memory pressure takes a handful of
requests. Requests carry token ids only; a ``Harness`` stands in for ``LLMEngine`` around the scheduler.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import pytest

from g4serve.config import FULL, SLIDING, preset
from g4serve.engine.config import EngineConfig
from g4serve.engine.kv_cache import KVCacheManager
from g4serve.engine.request import Request, RequestStatus
from g4serve.engine.scheduler import ORDER_KEYS, ScheduledBatch, Scheduler
from g4serve.processing.tiny_tokenizer import build_tiny_tokenizer, tokenizer_config
from g4serve.processing.tokenizer import Tokenizer
from g4serve.sampling_params import SamplingParams

BS = 4
EOS = 1
SAMPLED = 500  # every "sampled" token (never EOS, so requests stop on max_tokens)
_fresh = itertools.count(600)  # distinct prompt token ids, so unrelated prompts share no block hash


@functools.cache
def tokenizer() -> Tokenizer:
    return Tokenizer(build_tiny_tokenizer(), tokenizer_config())


def prompt(n: int) -> list[int]:
    return [next(_fresh) for _ in range(n)]


def request(
    rid: str,
    tokens: list[int] | int,
    arrival: float,
    max_tokens: int = 16,
    priority: int = 0,
) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=prompt(tokens) if isinstance(tokens, int) else list(tokens),
        sampling_params=SamplingParams(max_tokens=max_tokens),
        eos_token_ids=[EOS],
        tokenizer=tokenizer(),
        priority=priority,
        arrival_time=arrival,
    )


class Harness:
    """The scheduler, its KV manager, and the engine's bookkeeping around a step, without a model.

    ``schedule()`` is ``Scheduler.schedule``. ``complete(batch)`` does what ``LLMEngine._launch`` and
    ``LLMEngine._complete`` do with synchronous scheduling once the model has run:

    - every scheduled request's ``num_computed_tokens`` advances by its ``num_new_tokens``, and its newly
      completed full blocks are registered with the prefix cache (``register_computed_blocks``);
    - a request whose chunk reached the end of its known tokens (``start + n == num_tokens``, the rows the
      model runner samples) gets one sampled token (``append_token(SAMPLED)``), its block hashes are
      extended over the new token (``_extend_block_hashes``) and the blocks registered again;
    - a request that finished (max_tokens) is removed from the scheduler, which frees its blocks
      (``LLMEngine._finish``).

    Block hashes are those of ``LLMEngine._extend_block_hashes`` for text-only requests: chained digests
    of every full block of the known tokens (prompt, then outputs).
    """

    def __init__(self, full: int = 64, sliding: int = 64, prefix_caching: bool = True, **config):
        text = dataclasses.replace(preset("tiny").text, sliding_window=8)  # layers S S F S S F
        self.kv = KVCacheManager(text, {FULL: full, SLIDING: sliding}, BS, prefix_caching)
        self.scheduler = Scheduler(EngineConfig(**config), self.kv, encoder_cached=lambda digest: True)

    def add(self, *requests: Request) -> None:
        for r in requests:
            self._extend_block_hashes(r)
            self.scheduler.add(r)

    def _extend_block_hashes(self, r: Request) -> None:
        have, full = len(r.block_hashes), r.num_known_tokens // BS
        if full > have:
            r.block_hashes += KVCacheManager.hash_blocks(
                r.token_ids_between(have * BS, full * BS), BS, previous=r.block_hashes[-1] if have else b""
            )

    def schedule(self) -> ScheduledBatch:
        return self.scheduler.schedule()

    def complete(self, batch: ScheduledBatch) -> None:
        sampled = []
        for r, n in zip(batch.requests, batch.num_new_tokens):
            if r.num_computed_tokens + n == r.num_tokens:
                sampled.append(r)
            r.num_computed_tokens += n
            self.kv.register_computed_blocks(r.request_id, r.block_hashes, r.num_computed_tokens)
        for r in sampled:
            r.append_token(SAMPLED)
            self._extend_block_hashes(r)
            self.kv.register_computed_blocks(r.request_id, r.block_hashes, r.num_computed_tokens)
            if r.finished:
                r.status = RequestStatus.FINISHED
                self.scheduler.remove(r)

    def step(self) -> ScheduledBatch:
        batch = self.schedule()
        self.complete(batch)
        return batch


def ids(requests: list[Request]) -> list[str]:
    return [r.request_id for r in requests]


# ---- admission ------------------------------------------------------------------------------------------


def test_waiting_requests_are_admitted_in_arrival_order():
    h = Harness()
    b, a, c = request("b", 3, arrival=2.0), request("a", 3, arrival=1.0), request("c", 3, arrival=3.0)
    h.add(b, a, c)
    batch = h.schedule()
    assert ids(batch.requests) == ["a", "b", "c"]
    assert batch.num_new_tokens == [3, 3, 3]
    assert ids(h.scheduler.running) == ["a", "b", "c"] and h.scheduler.waiting == []
    assert all(r.status is RequestStatus.RUNNING for r in (a, b, c))


def test_priority_value_goes_before_arrival():
    h = Harness(max_num_seqs=1, scheduling_policy="priority")
    early, urgent = request("early", 3, arrival=1.0), request("urgent", 3, arrival=2.0, priority=-1)
    h.add(early, urgent)
    assert ids(h.schedule().requests) == ["urgent"]
    assert ids(h.scheduler.waiting) == ["early"]


def test_fcfs_orders_by_arrival_alone():
    h = Harness(max_num_seqs=1)  # the default policy: a priority value orders nothing
    early, urgent = request("early", 3, arrival=1.0), request("urgent", 3, arrival=2.0, priority=-1)
    h.add(urgent, early)
    assert ids(h.schedule().requests) == ["early"]
    assert ids(h.scheduler.waiting) == ["urgent"]


def test_max_num_seqs_caps_running_requests():
    h = Harness(max_num_seqs=2)
    a = request("a", 3, arrival=1.0, max_tokens=1)
    b, c = request("b", 3, arrival=2.0), request("c", 3, arrival=3.0)
    h.add(a, b, c)
    batch = h.step()
    assert ids(batch.requests) == ["a", "b"] and ids(h.scheduler.waiting) == ["c"]
    assert a.finished and ids(h.scheduler.running) == ["b"]  # a's one token ends it: a slot frees up
    batch = h.step()
    assert ids(batch.requests) == ["b", "c"] and batch.num_new_tokens == [1, 3]


def test_token_budget_goes_to_decodes_first_then_prefills():
    h = Harness(max_num_batched_tokens=8)
    a, b = request("a", 2, arrival=1.0), request("b", 2, arrival=2.0)
    h.add(a, b)
    assert h.step().num_new_tokens == [2, 2]
    c = request("c", 20, arrival=0.0)  # the earliest arrival, but a long prompt
    h.add(c)
    batch = h.step()
    assert ids(batch.requests) == ["a", "b", "c"] and batch.num_new_tokens == [1, 1, 6]
    d = request("d", 2, arrival=0.5)
    h.add(d)
    batch = h.step()
    # c is running mid-prefill with the best priority, yet the decodes go first; d gets no budget.
    assert ids(batch.requests) == ["a", "b", "c"] and batch.num_new_tokens == [1, 1, 6]
    assert ids(h.scheduler.waiting) == ["d"] and d.status is RequestStatus.WAITING


def test_prefill_beside_decodes_is_capped_and_alone_takes_the_budget():
    h = Harness(max_num_batched_tokens=16, max_prefill_tokens_beside_decodes=5)
    h.add(request("alone", 40, arrival=0.0, max_tokens=1))
    assert h.step().num_new_tokens == [16]  # no decodes in the step: the whole budget
    h.step(), h.step()  # alone's last 8 tokens, then it finishes
    assert not h.scheduler.has_unfinished()
    short = request("short", 2, arrival=1.0, max_tokens=30)
    h.add(short)
    assert h.step().num_new_tokens == [2]
    h.add(request("long", 12, arrival=2.0), request("late", 3, arrival=3.0))
    batch = h.step()  # short decodes: long's chunk and any admission share 5 tokens
    assert ids(batch.requests) == ["short", "long"] and batch.num_new_tokens == [1, 5]
    assert ids(h.scheduler.waiting) == ["late"]  # the cap was spent by long
    batch = h.step()
    assert ids(batch.requests) == ["short", "long"] and batch.num_new_tokens == [1, 5]
    batch = h.step()  # long's last 2 tokens, then late's 3 within the same cap
    assert ids(batch.requests) == ["short", "long", "late"] and batch.num_new_tokens == [1, 2, 3]
    batch = h.step()
    assert batch.num_new_tokens == [1, 1, 1]  # three decodes


def test_the_prefill_cap_never_starves_a_span_longer_than_it():
    h = Harness(max_num_batched_tokens=32, max_prefill_tokens_beside_decodes=4)
    h.scheduler.bidirectional_spans = True
    h.add(request("decoder", 2, arrival=0.0, max_tokens=40))
    h.step()
    image = request("image", 30, arrival=1.0)
    image.bidirectional_spans = [(2, 14)]  # an image's 12 soft tokens, over the cap of 4
    h.add(image)
    chunks = [h.step().num_new_tokens for _ in range(5)]
    # 2 tokens of text up to the image, then the image whole (12, past the cap once), then 4 a step
    assert chunks == [[1, 2], [1, 12], [1, 4], [1, 4], [1, 4]]
    assert image.num_computed_tokens == 26


def test_the_prefill_cap_is_checked():
    for bad in (0, -1):
        with pytest.raises(ValueError, match="max_prefill_tokens_beside_decodes: must be positive"):
            EngineConfig(max_prefill_tokens_beside_decodes=bad)
    with pytest.raises(ValueError, match="needs chunked prefill"):
        EngineConfig(max_prefill_tokens_beside_decodes=64, enable_chunked_prefill=False)


def test_chunked_prefill_splits_a_long_prompt_across_steps():
    h = Harness(max_num_batched_tokens=8)
    r = request("r", 20, arrival=0.0)
    h.add(r)
    progress = []
    for _ in range(5):
        batch = h.step()
        progress.append((batch.num_new_tokens, r.num_computed_tokens, len(r.output_token_ids)))
    assert progress == [
        ([8], 8, 0),
        ([8], 16, 0),
        ([4], 20, 1),  # the last chunk reaches the end of the prompt: the first token is sampled
        ([1], 21, 2),
        ([1], 22, 3),
    ]


def test_without_chunked_prefill_a_prompt_over_the_remaining_budget_waits():
    h = Harness(max_num_batched_tokens=8, enable_chunked_prefill=False)
    a, b = request("a", 6, arrival=1.0), request("b", 6, arrival=2.0)
    h.add(a, b)
    batch = h.step()
    assert ids(batch.requests) == ["a"] and batch.num_new_tokens == [6]  # b (6 > 2 left) is not split
    batch = h.step()
    assert ids(batch.requests) == ["a", "b"] and batch.num_new_tokens == [1, 6]


def test_admission_stops_at_the_first_request_that_does_not_fit():
    h = Harness(full=4)
    x = request("x", 10, arrival=0.0)  # 3 of the 4 full blocks
    h.add(x)
    h.step()
    big, small = request("big", 8, arrival=1.0), request("small", 2, arrival=2.0)
    h.add(big, small)
    batch = h.step()
    # big needs 2 blocks, 1 is free; small would fit but does not overtake it (FCFS, no skipping).
    assert ids(batch.requests) == ["x"]
    assert ids(h.scheduler.waiting) == ["big", "small"]
    assert "big" not in h.kv.seqs and "small" not in h.kv.seqs


# ---- preemption -----------------------------------------------------------------------------------------


def preemption_setup(**priorities: int) -> tuple[Harness, list[Request]]:
    """Three 7-token requests filling a 6-block full pool (2 blocks each); the step after next needs a
    3rd block each."""
    h = Harness(full=6, scheduling_policy="priority")
    reqs = [
        request(rid, 7, arrival=float(i), max_tokens=3, priority=priorities.get(rid, 0))
        for i, rid in enumerate("abc")
    ]
    h.add(*reqs)
    assert h.step().num_new_tokens == [7, 7, 7]
    assert h.step().num_new_tokens == [1, 1, 1]  # position 7 is still in block 1
    assert h.kv.pools[FULL].num_free == 0
    return h, reqs


def test_out_of_blocks_preempts_the_latest_running_request():
    h, (a, b, c) = preemption_setup()
    c_blocks = list(h.kv.block_tables("c")[FULL])
    batch = h.schedule()  # a and b each need a 3rd block for position 8
    assert ids(batch.requests) == ["a", "b"] and batch.num_new_tokens == [1, 1]
    assert ids(batch.preempted) == ["c"] and h.scheduler.num_preemptions == 1
    assert c.status is RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert h.scheduler.waiting[0] is c and c not in h.scheduler.running
    assert "c" not in h.kv.seqs
    # c's blocks went to a and b.
    assert {h.kv.block_tables("a")[FULL][2], h.kv.block_tables("b")[FULL][2]} == set(c_blocks)
    assert c.output_token_ids == [SAMPLED, SAMPLED]  # kept: recomputed with the prompt later


def test_preempted_request_recomputes_prompt_and_outputs_later():
    h, (a, b, c) = preemption_setup()
    h.step()  # c preempted; a and b sample their 3rd (last) token and finish
    assert a.finished and b.finished and h.scheduler.running == []
    batch = h.step()
    assert ids(batch.requests) == ["c"]
    assert batch.num_new_tokens == [9]  # 7 prompt + 2 generated tokens, as one prefill
    assert c.output_token_ids == [SAMPLED] * 3 and c.finished and "c" not in h.kv.seqs


def test_preemption_victim_is_the_lowest_priority_not_the_latest():
    h, (a, b, c) = preemption_setup(a=5)  # a arrived first but has the worst priority value
    batch = h.schedule()
    assert ids(batch.preempted) == ["a"]
    assert ids(batch.requests) == ["b", "c"]


def test_fcfs_preempts_the_latest_whatever_its_priority_value():
    h, (a, b, c) = preemption_setup(a=5)
    h.scheduler.priority = ORDER_KEYS["fcfs"]
    batch = h.schedule()
    assert ids(batch.preempted) == ["c"]
    assert ids(batch.requests) == ["a", "b"]


def test_request_that_cannot_fit_alone_is_preempted_not_looped():
    h = Harness(full=2, max_num_batched_tokens=4)  # the full pool holds 8 tokens
    r = request("r", 6, arrival=0.0)  # its prompt fits; its outputs outgrow the pool
    h.add(r)
    assert h.step().num_new_tokens == [4]
    assert h.step().num_new_tokens == [2]
    assert h.step().num_new_tokens == [1]
    assert h.step().num_new_tokens == [1]
    batch = h.schedule()  # token 8 needs a 3rd block: no one else to preempt
    assert ids(batch.preempted) == ["r"] and batch.requests == []
    assert r.status is RequestStatus.PREEMPTED and h.scheduler.running == [] and h.scheduler.waiting == [r]
    for _ in range(3):  # later steps return at once, with nothing to run
        batch = h.step()
        assert batch.requests == [] and batch.preempted == []
    assert "r" not in h.kv.seqs


def test_a_prompt_that_cannot_fit_alone_is_never_admitted():
    """Admission checks that the full pool holds the whole prompt (test_scheduler_hostile.py); it never
    runs a chunk only to be preempted (the engine refuses it first: max_model_len)."""
    h = Harness(full=2, max_num_batched_tokens=4)
    r = request("r", 12, arrival=0.0)
    h.add(r)
    for _ in range(3):
        batch = h.step()
        assert batch.requests == [] and batch.preempted == []
    assert h.scheduler.waiting == [r] and "r" not in h.kv.seqs


# ---- prefix cache ---------------------------------------------------------------------------------------


def test_prefix_cache_hit_at_admission_skips_the_cached_tokens():
    h = Harness()
    shared = prompt(8)
    first = request("first", shared + prompt(1), arrival=0.0, max_tokens=1)
    h.add(first)
    h.step()
    assert first.finished and "first" not in h.kv.seqs  # its 2 full blocks stay cached
    cached = [h.kv.pools[FULL].lookup(d) for d in first.block_hashes[:2]]
    second = request("second", shared + prompt(3), arrival=1.0)
    h.add(second)
    batch = h.schedule()
    assert ids(batch.requests) == ["second"]
    assert second.num_computed_tokens == 8 and second.metrics.prefix_hit_tokens == 8
    assert batch.num_new_tokens == [3]
    assert h.kv.block_tables("second")[FULL][:2] == cached


def test_prefix_hit_leaves_the_last_prompt_token_to_compute():
    h = Harness()
    shared = prompt(8)
    h.add(request("first", shared + prompt(1), arrival=0.0, max_tokens=1))
    h.step()
    again = request("again", shared, arrival=1.0)  # the cached 8 tokens exactly: only 1 block may hit
    h.add(again)
    batch = h.schedule()
    assert again.num_computed_tokens == 4 and batch.num_new_tokens == [4]


def test_no_prefix_hit_without_prefix_caching():
    h = Harness(prefix_caching=False)
    shared = prompt(8)
    h.add(request("first", shared + prompt(1), arrival=0.0, max_tokens=1))
    h.step()
    second = request("second", shared + prompt(3), arrival=1.0)
    h.add(second)
    assert h.schedule().num_new_tokens == [11] and second.num_computed_tokens == 0


def test_requests_that_each_fit_alone_all_finish():
    """Every request fits the full pool alone (16 tokens, as kv_cache.planning.max_sequence_tokens
    guarantees), so all must finish. A waiting request whose admission fails gives its prefix hit back; when
    it kept the hit, no preemption could reclaim those blocks and the queue deadlocked."""
    h = Harness(full=4)
    shared = prompt(4)
    warm = request("warm", shared + prompt(1), arrival=0.0, max_tokens=1)
    h.add(warm)
    h.step()  # leaves the block of `shared` cached
    r = request("r", 8, arrival=1.0, max_tokens=8)  # 8 + 8 tokens: 4 blocks
    w = request("w", shared + prompt(9), arrival=2.0, max_tokens=3)  # 13 + 3 tokens: 4 blocks
    h.add(r, w)
    h.step()
    # r runs (2 blocks); w hit `shared` (1 block) but its other 3 blocks do not fit: it waits, and gives
    # the hit back instead of holding a block no preemption can reclaim.
    assert h.scheduler.running == [r] and h.scheduler.waiting == [w]
    assert w.num_computed_tokens == 0 and "w" not in h.kv.seqs
    for _ in range(40):
        h.step()
    assert r.finished and w.finished
