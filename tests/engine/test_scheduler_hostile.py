"""No request may harm another through the scheduler: what a hostile client's requests (a prompt that cannot
fit beside the running ones, a request that outgrows the step budget, decodes of lower priority) did to the
others, on the real KVCacheManager and no model (``Harness`` of test_scheduler_unit.py)."""

from __future__ import annotations

import pytest
from test_scheduler_unit import Harness, ids, request  # tests/engine is on sys.path

from g4serve.config import FULL
from g4serve.engine.request import RequestStatus


def run_until(h: Harness, done, max_steps: int = 2000) -> list:
    """Step until ``done()``; every batch, in order."""
    batches = []
    while not done() and len(batches) < max_steps:
        batches.append(h.step())
    return batches


def computed_for(batches: list, r) -> int:
    return sum(n for b in batches for q, n in zip(b.requests, b.num_new_tokens) if q is r)


def preempted_count(batches: list, r) -> int:
    return sum(q is r for b in batches for q in b.preempted)


# ---- chunked prefill off ---------------------------------------------------------------------------------


def test_without_chunked_prefill_a_resumed_request_longer_than_a_step_still_runs():
    """A preempted request recomputes its prompt and its outputs: with chunked prefill off they may be more
    than a whole step's budget, and it waited at the queue's head forever, every request behind it too."""
    h = Harness(full=8, max_num_batched_tokens=8, enable_chunked_prefill=False)
    a = request("a", 6, arrival=0.0, max_tokens=20)
    b = request("b", 2, arrival=1.0, max_tokens=20)  # preempted when a and b outgrow the 8 blocks
    late = request("late", 2, arrival=2.0, max_tokens=2)
    h.add(a, b)
    batches = run_until(h, lambda: b.status is RequestStatus.PREEMPTED)
    assert b.num_tokens > 8  # its recompute exceeds any step
    h.add(late)
    batches = run_until(h, lambda: a.finished and b.finished and late.finished, max_steps=100)
    assert len(batches) < 100, f"stuck: waiting {ids(h.scheduler.waiting)}"
    assert max(n for batch in batches for n in batch.num_new_tokens) <= 8


# ---- preemption victims ----------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_a_decode_never_preempts_a_request_that_goes_before_it(policy):
    """Decodes are scheduled before prefills, so a decode short of a block found the request still
    prefilling among its victims and preempted it, though that one sorts first (more urgent, or under fcfs
    earlier: a resumed request prefills beside later ones' decodes). The victim must sort after the request
    that needs the room, or that request gives way itself. Here the urgent prompt was preempted at 52 of its
    60 tokens and computed 112."""
    h = Harness(
        full=20,
        max_num_batched_tokens=16,
        max_prefill_tokens_beside_decodes=4,
        scheduling_policy=policy,
        prefix_caching=False,
    )
    low = request("low", 13, arrival=1.0, max_tokens=40, priority=1)
    h.add(low)
    h.step()  # low decodes from here, one block every 4 steps
    urgent = request("urgent", 60, arrival=0.0, max_tokens=2, priority=-1)  # 4 tokens a step beside low
    h.add(urgent)
    batches = run_until(h, lambda: urgent.finished, max_steps=200)
    assert preempted_count(batches, urgent) == 0
    assert computed_for(batches, urgent) == 61  # its prompt once, then its first output
    run_until(h, lambda: low.finished)
    assert low.finished and h.kv.pools[FULL].num_free == 20


# ---- preemption storms -----------------------------------------------------------------------------------


def test_a_prompt_that_cannot_fit_beside_the_running_waits_instead_of_thrashing():
    """Admission took blocks for a prompt's first chunk only: a long prompt that could not fit beside the
    running decodes filled the pool chunk by chunk, was preempted by their next block, and was admitted again
    the next step. 4 decodes of 120 tokens beside a 200-token prompt (64 blocks of 4): it was preempted 22
    times and computed 1,382 prompt tokens instead of 200, in steps the decodes shared."""
    h = Harness(full=64, sliding=512, max_num_batched_tokens=16, prefix_caching=False)
    decodes = [request(f"d{i}", 4, arrival=float(i), max_tokens=120) for i in range(4)]
    h.add(*decodes)
    for _ in range(20):
        h.step()
    long = request("long", 200, arrival=10.0, max_tokens=2)
    h.add(long)
    batches = run_until(h, lambda: long.finished)
    assert long.finished and all(d.finished for d in decodes)
    assert preempted_count(batches, long) == 0
    assert computed_for(batches, long) == 201


def test_two_prompts_that_fit_alone_but_not_together_are_not_both_admitted():
    """Blocks promised to a running prefill's remaining chunks are not free for the next admission."""
    h = Harness(full=16, max_num_batched_tokens=16, prefix_caching=False)
    first = request("first", 40, arrival=0.0, max_tokens=2)  # 11 blocks with its outputs
    second = request("second", 40, arrival=1.0, max_tokens=2)
    h.add(first, second)
    batches = run_until(h, lambda: first.finished and second.finished)
    assert h.scheduler.num_preemptions == 0
    assert computed_for(batches, first) == computed_for(batches, second) == 41
    assert h.kv.pools[FULL].num_free == 16
