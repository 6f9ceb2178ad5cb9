"""Grammar compiles run on threads of their own, so a client sending costly schemas cannot stall the
preparation of every other request. A 40-byte schema can cost xgrammar tens of seconds on a 262k
vocabulary (``{"type": "string", "maxLength": 100}``: 12 s in docs/benchmarks.md's measurement); here the
compiles are made slow on purpose, on the tiny model."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from g4serve.engine.async_engine import COMPILES_WAITING, AsyncLLMEngine, GrammarCompilerBusy
from g4serve.engine.config import PREPROCESS_WORKERS, EngineConfig
from g4serve.engine.engine import LLMEngine
from g4serve.sampling_params import SamplingParams
from g4serve.structured import StructuredSpec
from g4serve.structured.backend import StructuredOutputBackend

PROMPT = "<|turn>user\nhello there<turn|>\n<|turn>model\n"
SLOW_S = 1.5


def _params(i: int) -> SamplingParams:
    schema = {"type": "object", "properties": {f"field_{i}": {"type": "integer"}}, "required": [f"field_{i}"]}
    spec = StructuredSpec.from_response_format({"type": "json_schema", "json_schema": {"schema": schema}})
    return SamplingParams(temperature=0, max_tokens=4, structured_output=spec)


@pytest.fixture
def aengine(tiny_model_dir, monkeypatch):
    config = EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32", kv_cache_bytes=16 << 20)
    engine = AsyncLLMEngine(LLMEngine(config))
    compile_uncached = StructuredOutputBackend._compile_uncached
    engine.compile_threads = set()

    def slow(backend, spec):
        engine.compile_threads.add(threading.current_thread().name)
        time.sleep(SLOW_S)
        return compile_uncached(backend, spec)

    monkeypatch.setattr(StructuredOutputBackend, "_compile_uncached", slow)
    yield engine
    engine.shutdown()


def test_slow_compiles_leave_other_requests_prepared_at_once(aengine):
    """Finding: compiles ran in the preprocessing pool (4 threads), so 4 requests with new schemas held
    every thread that tokenizes and decodes media: a plain request waited for their compiles."""

    async def main():
        processed = await aengine.process(PROMPT)
        compiling = [
            asyncio.ensure_future(aengine.validate(processed, _params(i)))
            for i in range(PREPROCESS_WORKERS + 1)
        ]
        await asyncio.sleep(0.2)  # every compile has started or is queued
        began = time.monotonic()
        plain = await aengine.process(PROMPT + " and more")
        request = await aengine.validate(plain, SamplingParams(temperature=0, max_tokens=2))
        waited = time.monotonic() - began
        admitted = await asyncio.gather(*compiling)
        return waited, request, admitted

    waited, request, admitted = asyncio.run(main())
    assert waited < SLOW_S / 3, f"a plain request waited {waited:.2f} s behind grammar compiles"
    assert request.grammar is None and all(r.grammar is not None for r in admitted)
    assert aengine.compile_threads and all(n.startswith("g4-grammar") for n in aengine.compile_threads)


def test_a_compile_flood_is_refused_past_the_bound_and_a_known_schema_still_admits(aengine):
    async def main():
        processed = await aengine.process(PROMPT)
        known = await aengine.validate(processed, _params(-1))  # compiled once: cached from here on
        flood = [
            asyncio.ensure_future(aengine.validate(processed, _params(i)))
            for i in range(COMPILES_WAITING + 4)
        ]
        await asyncio.sleep(0.1)
        began = time.monotonic()
        again = await aengine.validate(processed, _params(-1))  # a cache hit waits for no compile
        hit_s = time.monotonic() - began
        results = await asyncio.gather(*flood, return_exceptions=True)
        return known, again, hit_s, results

    known, again, hit_s, results = asyncio.run(main())
    assert known.grammar is not None and again.grammar is not None and hit_s < SLOW_S / 3
    busy = [r for r in results if isinstance(r, GrammarCompilerBusy)]
    assert len(busy) == 4, results
    assert "response_format" in str(busy[0]) and "retry" in str(busy[0])
    assert sum(1 for r in results if not isinstance(r, BaseException)) == COMPILES_WAITING


def test_the_first_grammar_builds_the_backend_off_the_event_loop(tiny_model_dir, monkeypatch):
    """The grammar backend reads the whole vocabulary when first built (seconds at 262k tokens): the first
    structured request builds it on a grammar thread, not on the event loop."""
    config = EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32", kv_cache_bytes=16 << 20)
    engine = AsyncLLMEngine(LLMEngine(config))
    built_on = []
    init = StructuredOutputBackend.__init__

    def recording(self, *args, **kwargs):
        built_on.append(threading.current_thread().name)
        init(self, *args, **kwargs)

    monkeypatch.setattr(StructuredOutputBackend, "__init__", recording)

    async def main():
        processed = await engine.process(PROMPT)
        return await engine.validate(processed, _params(0))

    try:
        assert asyncio.run(main()).grammar is not None
    finally:
        engine.shutdown()
    assert len(built_on) == 1 and built_on[0].startswith("g4-grammar"), built_on
