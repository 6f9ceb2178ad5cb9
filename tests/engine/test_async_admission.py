"""AsyncLLMEngine admits a request once: ``validate`` runs ``LLMEngine.make_request`` (length, token ids,
grammar) and returns the request unqueued, ``add`` streams that request without checking it again, and
``generate`` is the two in a row. Tiny model on CPU; each test drives its own ``asyncio.run``."""

from __future__ import annotations

import asyncio

import pytest

from g4serve.engine.async_engine import AsyncLLMEngine
from g4serve.engine.config import EngineConfig
from g4serve.engine.engine import LLMEngine
from g4serve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=4)
PROMPT = "<|turn>user\nhello there<turn|>\n<|turn>model\n"


@pytest.fixture
def aengine(tiny_model_dir, monkeypatch):
    config = EngineConfig(
        model=str(tiny_model_dir), device="cpu", dtype="float32", kv_cache_bytes=16 << 20, max_num_seqs=8
    )
    engine = AsyncLLMEngine(LLMEngine(config))
    engine.admitted = []  # the request ids make_request saw, in order
    make_request = engine.engine.make_request

    def counted(request_id, *args, **kwargs):
        engine.admitted.append(request_id)
        return make_request(request_id, *args, **kwargs)

    monkeypatch.setattr(engine.engine, "make_request", counted)
    yield engine
    engine.shutdown()


def test_validate_then_add_admits_once(aengine):
    async def main():
        processed = await aengine.process(PROMPT)
        request = await aengine.validate(processed, GREEDY, request_id="one")
        assert request.request_id == "one" and not aengine.engine.requests  # admitted, not queued
        deltas = [d async for d in aengine.add(request)]
        return deltas

    deltas = asyncio.run(main())
    assert deltas[-1].finished and deltas[-1].num_output_tokens == 4
    assert aengine.admitted == ["one"]


def test_generate_admits_once(aengine):
    async def main():
        processed = await aengine.process(PROMPT)
        return [d async for d in aengine.generate(processed, GREEDY)]

    assert asyncio.run(main())[-1].finished
    assert len(aengine.admitted) == 1 and aengine.admitted[0].startswith("req-")


def test_refused_admission_queues_nothing(aengine):
    async def main():
        processed = await aengine.process(PROMPT)
        with pytest.raises(ValueError, match="max_tokens"):
            await aengine.validate(processed, SamplingParams(max_tokens=aengine.max_model_len))
        running = aengine.generate(processed, SamplingParams(temperature=0, max_tokens=20), request_id="dup")
        await running.__anext__()
        # An id in use is refused before make_request (and its grammar compile) runs.
        with pytest.raises(ValueError, match="request_id"):
            await aengine.validate(processed, GREEDY, request_id="dup")
        await running.aclose()

    asyncio.run(main())
    assert len(aengine.admitted) == 2  # the refused one (its check ran) and "dup"; not the duplicate
    assert aengine.admitted[1] == "dup"
