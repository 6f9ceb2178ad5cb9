"""Hostile request shapes on the tiny model (CPU): what cannot be scheduled is refused at admission, and a
request aborted at any point of its life (before its media are encoded, mid-prefill chunk, preempted, with
its last token still on the way) gives back every KV block and media pin while the others run on exactly."""

from __future__ import annotations

import pytest
from test_engine import GREEDY, _image, _user, assert_pools_free, make_engine  # tests/engine is on sys.path

from g4serve.engine.request import RequestStatus
from g4serve.sampling_params import SamplingParams

LONG = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def _add(engine, rid: str, prompt, params=GREEDY) -> None:
    engine.add_request(engine.make_request(rid, engine.process_prompt(prompt), params))


def _assert_nothing_held(engine) -> None:
    assert not engine.requests and not engine.scheduler.waiting and not engine.scheduler.running
    assert not engine.encoder_cache._refs, f"media pins leaked: {engine.encoder_cache._refs}"
    engine.kv.reset_prefix_cache()
    assert_pools_free(engine)


def test_without_chunked_prefill_a_prompt_longer_than_a_step_is_refused(tiny_model_dir):
    """It could never be prefilled in one step: it waited at the queue's head forever, and every request
    behind it (100 steps: nothing ran)."""
    engine = make_engine(tiny_model_dir, enable_chunked_prefill=False, max_num_batched_tokens=32)
    with pytest.raises(ValueError, match=r"^prompt: 40 tokens .* max_num_batched_tokens is 32"):
        engine.make_request("big", engine.process_prompt({"prompt_token_ids": list(range(20, 60))}), GREEDY)
    _add(engine, "fits", {"prompt_token_ids": list(range(20, 52))})
    assert engine.run_until_finished()["fits"].error is None
    _assert_nothing_held(engine)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return make_engine(tiny_model_dir)


@pytest.fixture(scope="module")
def alone(engine) -> list[int]:
    _add(engine, "plain", _user("balance transfer card"), LONG)
    return engine.run_until_finished()["plain"].outputs[0].token_ids


def test_a_request_aborted_before_its_media_are_encoded_unpins_them(engine):
    _add(
        engine, "media", {"prompt": _user("<|image|>What is this?"), "multi_modal_data": {"image": _image(3)}}
    )
    assert engine.encoder_cache._refs  # pinned from admission, before any encode
    engine.abort_request("media")
    _assert_nothing_held(engine)


def _abort_at_points(engine, aborted: dict[str, str]) -> None:
    """One step's aborts: the first preempted request, and a request about to get (sync) or with its last
    token on the way (async)."""
    for r in list(engine.scheduler.waiting):
        if r.status is RequestStatus.PREEMPTED and r.request_id != "plain" and "preempted" not in aborted:
            aborted["preempted"] = r.request_id
            engine.abort_request(r.request_id)
    for r in list(engine.requests.values()):
        last = r.awaiting_last_token or r.num_output_tokens == r.max_output_tokens - 1
        if r.request_id.startswith("grow") and last and "last" not in aborted:
            aborted["last"] = r.request_id
            engine.abort_request(r.request_id)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_aborts_at_every_point_leak_nothing_and_leave_the_others_exact(
    tiny_model_dir, alone, async_scheduling
):
    # Room for a few of these sequences: their outputs preempt each other.
    engine = make_engine(
        tiny_model_dir, kv_cache_bytes=128 << 10, max_num_batched_tokens=32, async_scheduling=async_scheduling
    )
    _add(engine, "plain", _user("balance transfer card"), LONG)
    _add(engine, "prefill", _user("please read my last statement again " * 4))
    for i in range(6):
        _add(engine, f"grow{i}", _user(f"story {i}"), LONG)
    engine.step()
    prefill = engine.requests["prefill"]
    assert 0 < prefill.num_computed_tokens < len(prefill.prompt_token_ids)
    engine.abort_request("prefill")  # mid-prefill chunk
    aborted: dict[str, str] = {}
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
        _abort_at_points(engine, aborted)
    assert set(aborted) == {"preempted", "last"}, aborted
    assert outputs["plain"].outputs[0].token_ids == alone
    _assert_nothing_held(engine)
