"""AsyncLLMEngine on the tiny model (CPU, fp32): concurrent streams match the sync engine, streamed
text deltas add up to the final text, a consumer that goes away aborts its request and returns its
KV blocks, metrics are filled, a failing step fails only the requests in flight, and shutdown ends
every stream. Each test drives its own event loop with ``asyncio.run`` (no pytest-asyncio)."""

from __future__ import annotations

import asyncio
import threading
import time
from unittest import mock

import numpy as np
import pytest
import torch
from PIL import Image

from g4serve.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestFailedError, _put_all
from g4serve.engine.engine import EngineConfig, LLMEngine
from g4serve.engine.request import Request
from g4serve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8)
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
WORDS = [
    "balance",
    "transfer",
    "card",
    "savings",
    "loan",
    "branch",
    "payment",
    "statement",
    "interest",
    "account",
]


def make_engine(model_dir, **kw) -> LLMEngine:
    """As tests/engine/test_engine.py builds it: CPU, fp32, 16 MiB of KV cache."""
    args = {
        "model": str(model_dir),
        "device": "cpu",
        "dtype": "float32",
        "kv_cache_bytes": 16 << 20,
        "max_num_batched_tokens": 256,
        "max_num_seqs": 32,
    }
    args.update(kw)
    return LLMEngine(EngineConfig(**args))


def _user(text: str) -> str:
    return f"<|turn>user\n{text}<turn|>\n<|turn>model\n"


def _prompts(n: int) -> list[str]:
    return [_user(" ".join(WORDS[: 1 + (i * 7) % len(WORDS)]) * (1 + i % 3) + f" #{i}") for i in range(n)]


@pytest.fixture
def aengine(tiny_model_dir):
    engine = AsyncLLMEngine(make_engine(tiny_model_dir))
    yield engine
    engine.shutdown()


def _pools_full(engine: LLMEngine) -> bool:
    return all(pool.num_free == pool.num_blocks for pool in engine.kv.pools.values())


async def _wait_until(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


async def _collect(
    aengine: AsyncLLMEngine, prompt, params: SamplingParams, request_id: str | None = None
) -> list:
    processed = await aengine.process(prompt)
    return [delta async for delta in aengine.generate(processed, params, request_id=request_id)]


class _ScriptedTokens:
    """Wraps ``ModelRunner.execute`` so every sampled row emits the next token of a script."""

    def __init__(self, execute, script: list[int]):
        self.execute, self.script = execute, script

    def __call__(self, batch, kv, encoder_cache, previous=None):
        result = self.execute(batch, kv, encoder_cache, previous)
        if result.output is not None:
            ids = [self.script[request.num_output_tokens] for request in result.requests]
            result.output.token_ids = torch.tensor(ids, dtype=result.output.token_ids.dtype)
        return result


# ---- tests ---------------------------------------------------------------------------------------------


def _sync_outputs(engine: LLMEngine, prompts: list, params: SamplingParams) -> dict:
    for i, prompt in enumerate(prompts):
        engine.add_request(engine.make_request(str(i), engine.process_prompt(prompt), params))
    return {rid: out.outputs[0] for rid, out in engine.run_until_finished().items()}


@pytest.mark.parametrize(
    "overlap", [{"async_scheduling": False}, {"overlap_encoder": True}], ids=["sync-steps", "overlap-encoder"]
)
def test_concurrent_streams_match_sync_engine(tiny_model_dir, overlap):
    aengine = AsyncLLMEngine(make_engine(tiny_model_dir, **overlap))
    try:
        _concurrent_streams_match_sync_engine(tiny_model_dir, aengine)
    finally:
        aengine.shutdown()


def _concurrent_streams_match_sync_engine(tiny_model_dir, aengine):
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (64, 96, 3), dtype=np.uint8))
    audio = (0.2 * rng.standard_normal(16000)).astype(np.float32)
    prompts = _prompts(14) + [  # media are decoded and preprocessed in the thread pool, concurrently
        {"prompt": _user("<|image|>What is in the picture?"), "multi_modal_data": {"image": image}},
        {"prompt": _user("<|audio|>Transcribe this."), "multi_modal_data": {"audio": audio}},
    ]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = _sync_outputs(make_engine(tiny_model_dir), prompts, params)

    handovers = []

    async def main():
        loop = asyncio.get_running_loop()
        threadsafe = loop.call_soon_threadsafe

        def counted(callback, *args, **kwargs):  # the engine thread's hand-overs of deltas
            if callback is _put_all:
                handovers.append(len(args[0]))
            return threadsafe(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counted
        streams = await asyncio.gather(
            *(_collect(aengine, p, params, request_id=str(i)) for i, p in enumerate(prompts))
        )
        return {str(i): deltas for i, deltas in enumerate(streams)}

    streams = asyncio.run(main())
    # one hand-over a step, however many streams it carries
    assert sum(handovers) == sum(len(d) for d in streams.values())
    assert len(handovers) <= aengine.engine.num_steps and max(handovers) > 1
    for rid, deltas in streams.items():
        assert deltas[-1].finished and all(not d.finished for d in deltas[:-1])
        assert deltas[-1].finish_reason == expected[rid].finish_reason == "length"
        tokens = [t for d in deltas for t in d.token_ids]
        assert tokens == expected[rid].token_ids, rid
        assert [d.num_output_tokens for d in deltas] == list(range(1, len(tokens) + 1))  # one delta per token
        # Incremental detokenization: the text deltas add up to the final text.
        assert "".join(d.text for d in deltas) == expected[rid].text, rid
    # The 16 streams ran batched, not one after another (that would take a step per token).
    assert aengine.engine.num_steps < sum(len(c.token_ids) for c in expected.values()) // 2
    assert _pools_full(aengine.engine) and not aengine.engine.requests


def test_multibyte_characters_stream_whole(aengine, monkeypatch):
    tokenizer = aengine.engine.tokenizer
    text = "héllo wörld — ✓ 日本語 and € ok"
    script = tokenizer.encode(text, add_special_tokens=False)
    assert any(t in tokenizer.byte_token_ids for t in script)  # the tiny tokenizer spells these in bytes
    assert script[-1] not in tokenizer.byte_token_ids
    monkeypatch.setattr(
        aengine.engine.runner, "execute", _ScriptedTokens(aengine.engine.runner.execute, script)
    )

    async def main():
        plain = await _collect(
            aengine, _user("say it"), SamplingParams(max_tokens=len(script), ignore_eos=True)
        )
        stopped = await _collect(
            aengine, _user("say it"), SamplingParams(max_tokens=len(script), ignore_eos=True, stop=["wörld"])
        )
        return plain, stopped

    plain, stopped = asyncio.run(main())
    assert [t for d in plain for t in d.token_ids] == script
    assert "".join(d.text for d in plain) == text == tokenizer.decode(script, skip_special_tokens=True)
    assert all("\ufffd" not in d.text for d in plain)  # partial UTF-8 sequences are held back, never streamed
    assert sum(1 for d in plain if d.text == "") > 0
    # A stop string's prefix is held back too: the stream never shows what the final text drops.
    assert "".join(d.text for d in stopped) == "héllo "
    assert stopped[-1].finish_reason == "stop" and stopped[-1].stop_reason == "wörld"


def test_text_held_back_at_finish_is_flushed(aengine, monkeypatch):
    """A request that ends on the last byte of a multi-byte character still streams that character
    (the detokenizer is flushed when the request finishes; before 1737679 it was not)."""
    tokenizer = aengine.engine.tokenizer
    text = "price: 5 €"
    script = tokenizer.encode(text, add_special_tokens=False)
    assert script[-1] in tokenizer.byte_token_ids  # the request finishes on the last byte of "€"
    monkeypatch.setattr(
        aengine.engine.runner, "execute", _ScriptedTokens(aengine.engine.runner.execute, script)
    )
    deltas = asyncio.run(
        _collect(aengine, _user("price?"), SamplingParams(max_tokens=len(script), ignore_eos=True))
    )
    assert [t for d in deltas for t in d.token_ids] == script
    assert "".join(d.text for d in deltas) == text


def test_consumer_going_away_aborts_and_frees_blocks(aengine):
    engine = aengine.engine

    async def main():
        processed = await aengine.process(_user("tell me a long story about the bank " * 4))
        seen = {"broken": 0, "cancelled": 0}
        requests = {}

        async def break_early():
            async for delta in aengine.generate(processed, LONG, request_id="broken"):
                requests.setdefault("broken", aengine._streams["broken"][2])
                seen["broken"] += len(delta.token_ids)
                if seen["broken"] >= 3:
                    break  # the generator is dropped: its finalizer aborts the request

        async def until_cancelled():
            async for delta in aengine.generate(processed, LONG, request_id="cancelled"):
                requests.setdefault("cancelled", aengine._streams["cancelled"][2])
                seen["cancelled"] += len(delta.token_ids)

        survivor = asyncio.create_task(_collect(aengine, _user("short one"), GREEDY, request_id="survivor"))
        cancelled = asyncio.create_task(until_cancelled())
        await break_early()
        await _wait_until(lambda: seen["cancelled"] >= 2)
        assert "cancelled" in engine.requests and engine.requests["cancelled"].num_computed_tokens > 0
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        deltas = await survivor  # an abort next to it does not disturb another stream
        assert deltas[-1].finished and deltas[-1].finish_reason in ("stop", "length")
        await _wait_until(lambda: not engine.requests and _pools_full(engine), timeout_s=10)
        return seen, requests

    seen, requests = asyncio.run(main())
    assert seen["broken"] >= 3 and seen["cancelled"] >= 2
    for request in requests.values():  # aborted long before max_tokens, not run to the end
        assert request.finish_reason == "abort" and len(request.output_token_ids) < LONG.max_tokens // 2
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert all(c == 0 for pool in engine.kv.pools.values() for c in pool.ref_count)


def test_metrics_are_filled(aengine):
    prompt = _user("what is the interest rate on my savings account this month? " * 3)

    async def main():
        first = await _collect(aengine, prompt, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))
        again = await _collect(aengine, prompt, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))
        return first, again

    first, again = asyncio.run(main())
    n_prompt = first[-1].num_prompt_tokens
    assert n_prompt > 2 * aengine.engine.config.block_size
    for deltas in (first, again):
        last = deltas[-1]
        m = last.metrics
        assert last.num_output_tokens == 7 == sum(len(d.token_ids) for d in deltas)
        assert m.queue_time_s is not None and m.queue_time_s >= 0
        assert m.ttft_s is not None and m.ttft_s >= m.queue_time_s
        assert len(m.token_times) == 7 and len(m.itl_s) == 7 - 1 and all(x >= 0 for x in m.itl_s)
        assert m.first_token_time == m.token_times[0] and m.last_token_time == m.token_times[-1]
        assert m.finished_time is not None and m.finished_time >= m.last_token_time
        assert m.encoder_time_s == 0.0  # text only
    assert first[-1].num_cached_tokens == 0 and first[-1].metrics.prefix_hit_tokens == 0
    # The repeated prompt reuses every full block but the one holding its last token.
    bs = aengine.engine.config.block_size
    assert again[-1].num_cached_tokens == again[-1].metrics.prefix_hit_tokens == (n_prompt - 1) // bs * bs
    assert [t for d in again for t in d.token_ids] == [t for d in first for t in d.token_ids]


def test_failed_step_fails_requests_in_flight_and_engine_keeps_serving(tiny_model_dir, aengine, monkeypatch):
    engine = aengine.engine
    prompts = _prompts(4)
    expected = _sync_outputs(make_engine(tiny_model_dir), prompts, GREEDY)
    execute = engine.runner.execute
    calls = {"n": 0}

    def failing_once(batch, kv, encoder_cache, previous=None):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected step failure")
        return execute(batch, kv, encoder_cache, previous)

    monkeypatch.setattr(engine.runner, "execute", failing_once)

    async def outcome(prompt, request_id):
        try:
            return await _collect(aengine, prompt, GREEDY, request_id=request_id)
        except RequestFailedError as exc:
            return exc

    async def main():
        first = await asyncio.gather(*(outcome(p, f"a{i}") for i, p in enumerate(prompts)))
        after = await asyncio.gather(*(outcome(p, f"b{i}") for i, p in enumerate(prompts)))
        return first, after

    first, after = asyncio.run(main())
    failed = [r for r in first if isinstance(r, RequestFailedError)]
    # Each client is told which request failed, without the exception's text (it may hold internals).
    assert failed and all("internal error (RuntimeError)" in str(exc) for exc in failed)
    assert all(exc.request_id in str(exc) and "injected" not in str(exc) for exc in failed)
    for i, r in enumerate(first):  # a request added after the failed step runs normally
        if not isinstance(r, RequestFailedError):
            assert [t for d in r for t in d.token_ids] == expected[str(i)].token_ids
    for i, r in enumerate(after):
        assert not isinstance(r, BaseException), r
        assert [t for d in r for t in d.token_ids] == expected[str(i)].token_ids
    assert aengine.dead is None and aengine._thread.is_alive()
    assert _pools_full(engine) and not engine.requests


def test_bad_submissions_do_not_kill_the_engine(aengine):
    """A duplicate request id is refused at submission; the stream already using it keeps going."""
    engine = aengine.engine

    async def main():
        processed = await aengine.process(_user("hello there"))
        stream = aengine.generate(
            processed, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), request_id="dup"
        )
        first = await stream.__anext__()
        with pytest.raises(ValueError, match="request_id"):
            await aengine.generate(processed, GREEDY, request_id="dup").__anext__()
        rest = [d async for d in stream]
        return [first, *rest]

    deltas = asyncio.run(main())
    assert deltas[-1].finished and deltas[-1].num_output_tokens == 30
    assert aengine.dead is None and aengine._thread.is_alive()
    assert _pools_full(engine) and not engine.requests


def test_consumer_loop_closed_mid_stream(aengine):
    """A stream whose event loop is closed without closing the stream must not kill the engine thread."""
    engine = aengine.engine
    loop = asyncio.new_event_loop()
    processed = loop.run_until_complete(aengine.process(_user("a story please")))
    stream = aengine.generate(processed, LONG, request_id="orphan")
    loop.run_until_complete(stream.__anext__())
    orphan = aengine._streams["orphan"][2]
    loop.close()  # the stream is never closed: nothing will ever consume or abort it

    async def after():
        return await _collect(aengine, _user("still there?"), GREEDY)

    deltas = asyncio.run(asyncio.wait_for(after(), timeout=30))
    assert deltas[-1].finished
    assert aengine.dead is None and aengine._thread.is_alive()
    deadline = time.monotonic() + 10
    while (engine.requests or not _pools_full(engine)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not engine.requests and _pools_full(engine)
    assert orphan.finish_reason == "abort" and len(orphan.output_token_ids) < LONG.max_tokens // 2
    asyncio.run(stream.aclose())


def test_shutdown_ends_streams_and_refuses_new_requests(tiny_model_dir):
    aengine = AsyncLLMEngine(make_engine(tiny_model_dir))

    async def main():
        processed = await aengine.process(_user("a long story please"))
        received = []

        async def consume():
            async for delta in aengine.generate(processed, LONG):
                received.append(delta)

        task = asyncio.create_task(consume())
        await _wait_until(lambda: len(received) >= 2)
        t0 = time.monotonic()
        aengine.shutdown()
        assert time.monotonic() - t0 < 5
        with pytest.raises(EngineDeadError):  # the stream in flight ends instead of hanging
            await asyncio.wait_for(task, timeout=10)
        with pytest.raises(EngineDeadError):
            await aengine.generate(processed, GREEDY).__anext__()
        return received

    received = asyncio.run(main())
    assert received and not received[-1].finished
    assert not aengine._thread.is_alive() and aengine.dead is not None
    assert not aengine.engine.requests and _pools_full(aengine.engine)  # its blocks were returned
    aengine.shutdown()  # idempotent


def test_step_outputs_own_their_tokens_unless_the_async_engine_reads_them_at_once(tiny_model_dir):
    """A plain engine's step outputs keep the tokens of their step (a caller may hold them); the async engine
    reads each one on the engine thread before the next step, so its engine shares the request's list instead
    of copying a long output every step, and streams only the new tokens."""
    engine = make_engine(tiny_model_dir)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request(engine.make_request("r", engine.process_prompt(_user("hello")), params))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert len(outputs) >= 2 and outputs[-1].finished
    # each output kept the tokens of its own step: one more than the one before
    assert [len(o.outputs[0].token_ids) for o in outputs] == list(range(7 - len(outputs), 7))
    shared = AsyncLLMEngine(make_engine(tiny_model_dir))
    try:
        assert shared.engine.copy_outputs is False
    finally:
        shared.shutdown()


def test_switch_interval_from_the_environment(monkeypatch):
    """``G4SERVE_GIL_SWITCH_INTERVAL_US`` sets the interpreter's switch interval; out of range is refused with
    the variable's name; unset or empty leaves it alone."""
    import sys

    from g4serve.engine.async_engine import set_switch_interval

    default = sys.getswitchinterval()
    try:
        monkeypatch.setenv("G4SERVE_GIL_SWITCH_INTERVAL_US", "500")
        set_switch_interval()
        assert sys.getswitchinterval() == pytest.approx(500e-6)
        for bad in ("0", "-3", "2e6", "fast"):
            monkeypatch.setenv("G4SERVE_GIL_SWITCH_INTERVAL_US", bad)
            with pytest.raises(ValueError, match="G4SERVE_GIL_SWITCH_INTERVAL_US"):
                set_switch_interval()
        monkeypatch.setenv("G4SERVE_GIL_SWITCH_INTERVAL_US", "")
        set_switch_interval()
        monkeypatch.delenv("G4SERVE_GIL_SWITCH_INTERVAL_US")
        set_switch_interval()
        assert sys.getswitchinterval() == pytest.approx(500e-6)  # unset: left as it was
    finally:
        sys.setswitchinterval(default)


def test_step_running_s_counts_the_step_in_progress(aengine, monkeypatch):
    """``step_running_s`` is 0 between steps and grows while a step runs (what /health's stall check reads);
    a step that ends, even by raising, sets it back to 0."""
    engine = aengine.engine
    step, inside = engine.step, []

    def slow_step():
        inside.append(aengine.step_running_s())
        time.sleep(0.3)
        return step()

    assert aengine.step_running_s() == 0.0
    monkeypatch.setattr(engine, "step", slow_step)
    seen: list[float] = []

    async def main():
        task = asyncio.ensure_future(_collect(aengine, _prompts(1)[0], GREEDY))
        await _wait_until(lambda: inside)
        await asyncio.sleep(0.2)
        seen.append(aengine.step_running_s())
        await task

    asyncio.run(main())
    assert inside[0] < 0.1 and 0.15 < seen[0] < 5.0
    assert aengine.step_running_s() == 0.0


def test_a_step_past_the_step_timeout_stops_the_engine(tiny_model_dir, monkeypatch):
    """A step that never ends (a device that stopped) would leave every client waiting: past
    ``G4SERVE_STEP_TIMEOUT_S`` the watchdog ends each open stream and queued engine-thread call with
    ``EngineDeadError`` naming the limit, refuses new requests, and the engine thread, should its step end
    after all, leaves without publishing it."""
    monkeypatch.setenv("G4SERVE_STEP_TIMEOUT_S", "0.3")
    aengine = AsyncLLMEngine(make_engine(tiny_model_dir))
    engine = aengine.engine
    step, release, inside = engine.step, threading.Event(), threading.Event()

    def stuck_step():
        inside.set()
        release.wait(30)
        return step()

    monkeypatch.setattr(engine, "step", stuck_step)

    async def main():
        stream = asyncio.ensure_future(_collect(aengine, _prompts(1)[0], GREEDY))
        await _wait_until(inside.is_set)
        call = asyncio.ensure_future(aengine.unload_lora("x"))  # an engine-thread call, behind the step
        for task in (stream, call):
            with pytest.raises(EngineDeadError, match="G4SERVE_STEP_TIMEOUT_S"):
                await asyncio.wait_for(task, 10)

    began = time.monotonic()
    try:
        asyncio.run(main())
        assert time.monotonic() - began < 5
        with pytest.raises(EngineDeadError, match="step ran past 0.3 s"):
            asyncio.run(aengine.process(_prompts(1)[0]))
        release.set()
        aengine._thread.join(5)
        assert not aengine._thread.is_alive()
        aengine._watchdog.join(5)
        assert not aengine._watchdog.is_alive()
    finally:
        release.set()
        aengine.shutdown()


def test_the_step_timeout_is_checked_at_start(tiny_model_dir, monkeypatch):
    """A bad ``G4SERVE_STEP_TIMEOUT_S`` fails the engine's start with the variable's name; unset, CUDA engines
    get the default limit and CPU ones none; 0 starts no watchdog."""
    from g4serve.engine.async_engine import STEP_TIMEOUT_S, step_timeout_s

    for bad in ("-1", "nan", "soon"):
        monkeypatch.setenv("G4SERVE_STEP_TIMEOUT_S", bad)
        with pytest.raises(ValueError, match="G4SERVE_STEP_TIMEOUT_S"):
            step_timeout_s(torch.device("cpu"))
    engine = make_engine(tiny_model_dir)
    with pytest.raises(ValueError, match="G4SERVE_STEP_TIMEOUT_S"):
        AsyncLLMEngine(engine)  # before its threads start
    monkeypatch.delenv("G4SERVE_STEP_TIMEOUT_S")  # unset: a limit on CUDA, none on the CPU
    assert step_timeout_s(torch.device("cuda")) == STEP_TIMEOUT_S and step_timeout_s(torch.device("cpu")) == 0
    monkeypatch.setenv("G4SERVE_STEP_TIMEOUT_S", "2.5")
    assert step_timeout_s(torch.device("cpu")) == 2.5
    monkeypatch.setenv("G4SERVE_STEP_TIMEOUT_S", "0")
    aengine = AsyncLLMEngine(engine)
    try:
        assert aengine._watchdog is None
    finally:
        aengine.shutdown()


def test_work_queued_for_the_pool_when_the_engine_stops_ends_in_engine_dead(tiny_model_dir, monkeypatch):
    """Prompts still queued for the preprocessing pool when the engine stops (shut down, or by the step
    watchdog) end with ``EngineDeadError``, the 503 every other request of a stopped engine gets, not with
    the pool's cancellation (which a server turns into a dropped answer); a caller's own cancellation stays
    a cancellation."""
    aengine = AsyncLLMEngine(make_engine(tiny_model_dir), preprocess_workers=1)
    process, release, started = aengine.engine.process_prompt, threading.Event(), threading.Event()

    def slow_process(*args):
        started.set()
        release.wait(10)
        return process(*args)

    monkeypatch.setattr(aengine.engine, "process_prompt", slow_process)

    async def main():
        running = asyncio.ensure_future(aengine.process(_prompts(1)[0]))  # holds the pool's one worker
        await _wait_until(started.is_set)
        queued = asyncio.ensure_future(aengine.process(_prompts(2)[1]))
        mine = asyncio.ensure_future(aengine.process(_prompts(3)[2]))
        await asyncio.sleep(0.05)
        mine.cancel()
        aengine.shutdown(timeout_s=0.0)
        release.set()
        with pytest.raises(EngineDeadError, match="shut down"):
            await queued
        with pytest.raises(asyncio.CancelledError):
            await mine
        await running  # it had started: it finishes

    try:
        asyncio.run(main())
    finally:
        release.set()
        aengine.shutdown()


def test_a_stream_hands_over_its_logprobs_and_keeps_none(tiny_model_dir, aengine):
    """Each delta carries its tokens' logprob entries, the same as the synchronous engine's whole list, and
    the engine lets go of them: a stream of 128k tokens with 20 top logprobs held ~630 MB of entries."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    prompt = _user("What is my checking account balance?")
    held = []
    take = Request.take_logprob_delta

    def taking(request):
        taken = take(request)
        held.append(len(request.logprobs))
        return taken

    with mock.patch.object(Request, "take_logprob_delta", taking):
        deltas = asyncio.run(_collect(aengine, prompt, params))
    (want,) = _sync_outputs(make_engine(tiny_model_dir), [prompt], params).values()
    assert all(len(d.logprobs) == len(d.token_ids) for d in deltas)
    assert [e for d in deltas for e in d.logprobs] == want.logprobs
    assert held and set(held) == {0}
