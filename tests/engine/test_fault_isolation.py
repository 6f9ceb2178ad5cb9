"""A fault inside the engine harms only the requests it touched: faults injected into the scheduler, the
encoder, the runner's prepare / forward / sample and one request's detokenizer, with synchronous and async
scheduling. Every request ends (its tokens, or finish_reason "error" with a message naming it), nothing
hangs, every KV block comes back, and the engine then serves new requests exactly as before."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from test_engine import assert_pools_free, make_engine  # tests/engine is on sys.path

from g4serve.engine.async_engine import AsyncLLMEngine, RequestFailedError
from g4serve.engine.engine import LLMEngine
from g4serve.engine.request import Request
from g4serve.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
WORDS = "balance transfer card savings loan branch payment statement interest account".split()


def _user(text: str) -> str:
    return f"<|turn>user\n{text}<turn|>\n<|turn>model\n"


def _prompts() -> dict[str, object]:
    prompts: dict[str, object] = {
        f"r{i}": _user(" ".join(WORDS[: 2 + (i * 3) % 8]) * (1 + i % 3)) for i in range(5)
    }
    rng = np.random.default_rng(0)
    prompts["img"] = {
        "prompt": _user("<|image|>What is this?"),
        "multi_modal_data": {"image": rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)},
    }
    return prompts


class Fault(RuntimeError):
    pass


def _fail_on_call(obj, name: str, call: int) -> dict:
    """Make ``obj.name`` raise on its ``call``-th call (1-based); returns the call counter."""
    original = getattr(obj, name)
    calls = {"n": 0}

    def wrapper(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == call:
            raise Fault(f"injected fault in {name}")
        return original(*args, **kwargs)

    setattr(obj, name, wrapper)
    return calls


def _fail_detokenizer(monkeypatch, request_id: str, at_token: int) -> None:
    original = Request.append_token
    fired = []

    def append_token(self, token_id, *args, **kwargs):
        if self.request_id == request_id and len(self.output_token_ids) == at_token and not fired:
            fired.append(True)
            raise Fault("injected detokenizer fault")
        return original(self, token_id, *args, **kwargs)

    monkeypatch.setattr(Request, "append_token", append_token)


def _inject(engine: LLMEngine, point: str, monkeypatch) -> None:
    if point == "detokenizer":
        _fail_detokenizer(monkeypatch, "r1", at_token=3)
    elif point == "schedule":
        _fail_on_call(engine.scheduler, "schedule", 4)
    elif point == "encoder":
        _fail_on_call(engine.encoder, "run", 1)
    else:  # the runner: prepare, forward or sample, a few steps in (prefills and decodes under way)
        _fail_on_call(engine.runner, point, 4)


def _submit(engine: LLMEngine, prompts: dict) -> None:
    for rid, prompt in prompts.items():
        engine.add_request(engine.make_request(rid, engine.process_prompt(prompt), PARAMS))


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> dict[str, list[int]]:
    engine = make_engine(tiny_model_dir)
    _submit(engine, _prompts())
    return {rid: out.outputs[0].token_ids for rid, out in engine.run_until_finished().items()}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("point", ["prepare", "forward", "sample", "detokenizer", "schedule", "encoder"])
def test_fault_fails_only_its_requests(tiny_model_dir, reference, monkeypatch, point, async_scheduling):
    engine = make_engine(tiny_model_dir, async_scheduling=async_scheduling)
    _inject(engine, point, monkeypatch)
    prompts = _prompts()
    _submit(engine, prompts)
    steps = 0
    finished = {}
    while engine.has_unfinished_requests():
        steps += 1
        assert steps < 500, "the engine did not finish its requests"
        for out in engine.step():  # a fault never escapes step()
            if out.finished:
                finished[out.request_id] = out
    assert set(finished) == set(prompts), "every request ends, failed or not"
    failed = {rid for rid, out in finished.items() if out.outputs[0].finish_reason == "error"}
    assert failed, "the injected fault failed some request"
    for rid in failed:
        assert rid in finished[rid].error and "internal error (Fault)" in finished[rid].error
    if point == "detokenizer":
        assert failed == {"r1"}, "a fault in one request's read-back fails that request alone"
    if point == "encoder":
        assert "img" in failed
    for rid in set(prompts) - failed:
        assert finished[rid].outputs[0].token_ids == reference[rid], rid
        assert finished[rid].error is None
    assert not engine.requests
    assert_pools_free(engine)
    # The engine serves on, with the same results as an engine that never saw a fault.
    _submit(engine, prompts)
    again = engine.run_until_finished()
    assert {rid: out.outputs[0].token_ids for rid, out in again.items()} == reference
    assert_pools_free(engine)


def test_async_engine_tells_every_client(tiny_model_dir, reference):
    """Through AsyncLLMEngine: the failed requests' streams raise RequestFailedError naming them, the others
    finish with their tokens, none hangs, and later requests run normally."""
    engine = make_engine(tiny_model_dir)  # async scheduling (the default)
    _fail_on_call(engine.runner, "forward", 5)
    aengine = AsyncLLMEngine(engine)
    prompts = _prompts()

    async def one(rid, prompt):
        processed = await aengine.process(prompt)
        try:
            return [t async for d in aengine.generate(processed, PARAMS, request_id=rid) for t in d.token_ids]
        except RequestFailedError as exc:
            return exc

    async def main():
        first = await asyncio.wait_for(asyncio.gather(*(one(r, p) for r, p in prompts.items())), 60)
        second = await asyncio.wait_for(asyncio.gather(*(one(r, p) for r, p in prompts.items())), 60)
        return dict(zip(prompts, first)), dict(zip(prompts, second))

    try:
        first, second = asyncio.run(main())
        failed = {rid for rid, r in first.items() if isinstance(r, RequestFailedError)}
        assert failed
        for rid, result in first.items():
            if rid in failed:
                assert result.request_id == rid and rid in str(result)
                assert "0x" not in str(result) and "injected" not in str(result)
            else:
                assert result == reference[rid]
        assert second == reference
        assert aengine.dead is None
        assert not engine.requests
        assert_pools_free(engine)
    finally:
        aengine.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pytest -m gpu)")
@pytest.mark.parametrize("point", ["prepare", "forward", "sample", "detokenizer"])
def test_fault_on_cuda_with_graphs(tiny_model_dir, monkeypatch, point):
    """The same isolation on the GPU path: bf16, Triton attention, CUDA graphs, async scheduling. Faults
    fire mid-decode, where steps replay graphs; the engine then serves the same prompts exactly as a fresh
    engine does."""
    kw = dict(device="cuda", dtype="bfloat16", kv_cache_bytes=64 << 20)
    fresh = make_engine(tiny_model_dir, **kw)
    _submit(fresh, _prompts())
    reference = {rid: out.outputs[0].token_ids for rid, out in fresh.run_until_finished().items()}
    del fresh
    engine = make_engine(tiny_model_dir, **kw)
    assert engine.runner.decode_graphs is not None
    _inject(engine, point, monkeypatch)
    prompts = _prompts()
    _submit(engine, prompts)
    finished = engine.run_until_finished()
    assert set(finished) == set(prompts)
    failed = {rid for rid, out in finished.items() if out.outputs[0].finish_reason == "error"}
    assert failed
    for rid in set(prompts) - failed:  # bf16 in other batch shapes: complete, not bit-equal
        assert finished[rid].outputs[0].finish_reason == "length", rid
        assert len(finished[rid].outputs[0].token_ids) == PARAMS.max_tokens, rid
    assert_pools_free(engine)
    _submit(engine, prompts)
    again = engine.run_until_finished()
    assert {rid: out.outputs[0].token_ids for rid, out in again.items()} == reference
    assert_pools_free(engine)
