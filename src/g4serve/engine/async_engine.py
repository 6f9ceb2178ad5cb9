"""Asyncio front of the engine for the server: process, admit (``validate``), stream (``add``), abort.

The synchronous ``LLMEngine`` runs in one background thread that loops on ``step()`` while
work exists; prompt processing (tokenizing, decoding and resizing media) and admission run in a
thread pool so they never delay a step. Each request's outputs flow to the caller through an
asyncio queue as ``StreamDelta`` s (new text, new token ids, finish reason).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import torch

from g4serve import envs
from g4serve.engine.config import PREPROCESS_WORKERS, EngineConfig
from g4serve.engine.engine import AdapterNotLoadedError, LLMEngine
from g4serve.engine.request import Request
from g4serve.engine.torch_profile import TorchProfile
from g4serve.outputs import RequestMetrics, RequestOutput
from g4serve.processing.processor import ProcessedPrompt
from g4serve.processing.tokenizer import Tokenizer
from g4serve.sampling_params import SamplingParams
from g4serve.structured import StructuredSpec

log = logging.getLogger("g4serve.async_engine")


@dataclass
class StreamDelta:
    request_id: str
    text: str
    token_ids: list[int]  # the output tokens since the previous delta
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_output_tokens: int
    logprobs: list | None = None  # the entries of token_ids' tokens (a logprobs request), one each
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    num_forced_tokens: int = 0  # of the num_output_tokens, how many jump-forward appended (not sampled)

    @property
    def num_decoded_tokens(self) -> int:
        """Output tokens so far that the model sampled, one forward each."""
        return self.num_output_tokens - self.num_forced_tokens


# One step's deltas by the event loop of their streams.
_Batch = dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, StreamDelta]]]


class EngineDeadError(RuntimeError):
    """The engine thread crashed; the server should report 500s and restart."""


class GrammarCompilerBusy(Exception):
    """More new grammars than ``COMPILES_WAITING`` are compiling or queued: the request is refused (the server
    answers 429 with ``Retry-After``) instead of waiting behind them."""


class RequestFailedError(RuntimeError):
    """The engine could not run this request (a fault in its step, or ``status`` 400: the client's input,
    found only while it ran); the engine serves on."""

    def __init__(self, request_id: str, message: str, status: int = 500):
        super().__init__(message)
        self.request_id = request_id
        self.status = status


def set_switch_interval() -> None:
    """``G4SERVE_GIL_SWITCH_INTERVAL_US``: how long another thread may hold the interpreter lock once the
    engine thread asks for it (the server's event loop and media threads share this process with it)."""
    micros = envs.get("G4SERVE_GIL_SWITCH_INTERVAL_US")
    if micros:  # unset or empty: Python's own
        value = envs.get_float("G4SERVE_GIL_SWITCH_INTERVAL_US")
        if not 1 <= value <= 1e6:
            raise ValueError(f"G4SERVE_GIL_SWITCH_INTERVAL_US: expected 1 to 1,000,000, got {micros!r}")
        sys.setswitchinterval(value * 1e-6)
        log.info("interpreter switch interval: %g us", value)


# New grammars (JSON schemas, regexes, tools) compile on threads of their own, never in the preprocessing
# pool: a 40-byte schema can cost xgrammar seconds on a 262k vocabulary (bench/grammar_compile.py), and four
# such requests held every thread that tokenizes and decodes media for everyone. At most COMPILES_WAITING
# new grammars compile or wait at once; the next is refused (429) rather than queued behind them.
COMPILE_WORKERS = 2
COMPILES_WAITING = 8
RETRY_AFTER_S = 1

# A step on CUDA longer than this (seconds) is a device that stopped (G4SERVE_STEP_TIMEOUT_S overrides): the
# longest legitimate ones (an 8k-token prefill of 31B, a lazy graph capture, a kernel's first compile) take
# seconds.
STEP_TIMEOUT_S = 300.0


def step_timeout_s(device: torch.device) -> float:
    """``G4SERVE_STEP_TIMEOUT_S`` (seconds; 0: no limit), checked; unset: ``STEP_TIMEOUT_S`` on CUDA, no
    limit elsewhere (a CPU's long prefill is slow, not stuck)."""
    if envs.get("G4SERVE_STEP_TIMEOUT_S") in (None, ""):
        return STEP_TIMEOUT_S if device.type == "cuda" else 0.0
    value = envs.get_float("G4SERVE_STEP_TIMEOUT_S")
    if not value >= 0:
        raise ValueError(
            f"G4SERVE_STEP_TIMEOUT_S: expected seconds >= 0, got {envs.get('G4SERVE_STEP_TIMEOUT_S')!r}"
        )
    return value


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, preprocess_workers: int = PREPROCESS_WORKERS):
        self.engine = engine
        engine.copy_outputs = False  # _publish reads each output on the engine thread, before the next step
        self._commands: queue.SimpleQueue = queue.SimpleQueue()  # (kind, payload) from the event loop
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, Request]] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(
            preprocess_workers, thread_name_prefix="g4-preprocess"
        )
        self._compile_pool = concurrent.futures.ThreadPoolExecutor(
            COMPILE_WORKERS, thread_name_prefix="g4-grammar"
        )
        self._compiling: dict = {}  # spec -> its compile's future (the event loop's own: no lock)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._ids = itertools.count()
        self.dead: EngineDeadError | None = None  # why the engine stopped (its text is safe to show)
        self._step_started: float | None = None  # when the step running now began (monotonic; None: none)
        set_switch_interval()
        # G4SERVE_TORCH_PROFILER_DIR set: POST /start_profile and /stop_profile profile this engine thread
        self.profiler = TorchProfile.from_env()
        timeout_s = step_timeout_s(engine.device)  # checked before any thread starts
        self._thread = threading.Thread(target=self._loop, name="g4-engine", daemon=True)
        self._thread.start()
        self._watchdog: threading.Thread | None = None
        if timeout_s > 0:
            self._watchdog = threading.Thread(
                target=self._watch_steps, args=(timeout_s,), name="g4-engine-watchdog", daemon=True
            )
            self._watchdog.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncLLMEngine:
        return cls(LLMEngine(config))

    # ---- engine thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        engine = self.engine
        try:
            profile = engine.profile
            while not self._stop.is_set():
                t = profile.now()
                self._drain_commands()
                profile.add("commands", t)
                if not engine.has_unfinished_requests():
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                self._step_started = time.monotonic()
                try:
                    outputs = engine.step()  # fails a faulty step's requests itself, in their outputs
                except Exception as exc:  # a fault outside any step's requests: nobody may be left waiting
                    log.exception("engine step raised; failing every request")
                    self._fail_all(exc)
                    continue
                finally:
                    self._step_started = None
                if self._stop.is_set():  # shut down while the step ran (by the step watchdog: long past)
                    return
                t = profile.now()
                batch: _Batch = {}
                for out in outputs:
                    self._publish(out, batch)
                self._deliver(batch)
                profile.add("publish", t)
                if self.profiler is not None:
                    self.profiler.step()  # a profile past its time limit stops here
        except BaseException as exc:  # everything must reach the waiting clients
            log.exception("engine thread crashed")
            # Its type only: the exception's text may hold internals.
            self.dead = EngineDeadError(f"engine is not running: it crashed ({type(exc).__name__})")
            self.dead.__cause__ = exc
            for loop, q, _ in list(self._streams.values()):
                self._send(loop, q, self.dead)
            self._fail_calls()

    def step_running_s(self) -> float:
        """Seconds the engine thread has spent in the step it runs now; 0 between steps. A step that does not
        end (the device waiting for what never comes) grows it without bound: ``GET /health`` turns 503
        past ``G4SERVE_STEP_STALL_S``."""
        started = self._step_started
        return 0.0 if started is None else time.monotonic() - started

    def _watch_steps(self, timeout_s: float) -> None:
        """Stop the engine once a step has run past ``timeout_s`` (``G4SERVE_STEP_TIMEOUT_S``): a device that
        stopped never ends its step, and every client would wait on it. Each open stream and queued call
        ends with ``EngineDeadError`` (a 503), new requests are refused, ``/health`` answers 503; the stuck
        engine thread stays where it is (nothing interrupts a CUDA wait) and, were the step to end, leaves
        its loop without publishing."""
        while not self._stop.wait(min(1.0, timeout_s / 10)):
            running = self.step_running_s()
            if running > timeout_s:
                log.error(
                    "a step has run for %.1f s (G4SERVE_STEP_TIMEOUT_S=%g): stopping the engine",
                    running,
                    timeout_s,
                )
                self.dead = EngineDeadError(
                    f"engine is not running: a step ran past {timeout_s:g} s (G4SERVE_STEP_TIMEOUT_S); "
                    "restart the server"
                )
                self.shutdown(timeout_s=0.0)
                self._fail_calls()  # the engine thread, stuck, drains no more commands
                return

    def _fail_calls(self) -> None:
        """Settle the engine-thread calls still queued with the engine's death (the thread has stopped)."""
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "call":
                _fn, loop, future = payload
                try:
                    loop.call_soon_threadsafe(_settle, future, None, EngineDeadError(str(self.dead)))
                except RuntimeError:
                    pass

    @staticmethod
    def _send(loop: asyncio.AbstractEventLoop, q: asyncio.Queue, item: object) -> bool:
        """Hand ``item`` to a stream's event loop; False if that loop is closed (nobody will read it)."""
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:  # "Event loop is closed": must not take the engine thread down with it
            return False
        return True

    def _fail_stream(self, request_id: str, exc: BaseException) -> None:
        entry = self._streams.get(request_id)
        if entry is not None:
            loop, q, _ = entry
            self._send(loop, q, exc)

    def _fail_all(self, exc: Exception) -> None:
        """Fail every open stream (the engine's requests are aborted first, so none keeps its KV blocks)."""
        for request_id in list(self.engine.requests):
            self.engine.abort_request(request_id)
        for request_id in list(self._streams):
            self._fail_stream(
                request_id,
                RequestFailedError(request_id, f"internal error ({type(exc).__name__}) in the engine"),
            )

    def _drain_commands(self) -> None:
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                try:
                    self.engine.add_request(payload)
                except Exception as exc:  # a bad request fails alone, the engine serves on
                    if self.engine.requests.get(payload.request_id) is payload:
                        self.engine.abort_request(payload.request_id)
                    self._fail_stream(payload.request_id, _refused(payload.request_id, exc))
            elif kind == "abort":
                request = self.engine.requests.get(payload)
                if request is not None:
                    self.engine.abort_request(payload)
                    self._publish(self.engine.output_of(request))
            elif kind == "call":  # engine state changed between steps (LoRA loads); the caller awaits it
                self._call(*payload)

    @staticmethod
    def _call(fn, loop: asyncio.AbstractEventLoop, future: asyncio.Future) -> None:
        try:
            result, error = fn(), None
        except Exception as exc:
            result, error = None, exc
        try:
            loop.call_soon_threadsafe(_settle, future, result, error)
        except RuntimeError:  # the caller's loop is gone: nobody waits for it
            pass

    def _deliver(self, batch: _Batch) -> None:
        """A step's deltas, one hand-over per event loop (not one per stream: a step of 64 streams would
        wake the loop 64 times); a loop that closed without closing its streams stops their requests."""
        for loop, items in batch.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # "Event loop is closed"
                for _, delta in items:
                    self._orphaned(delta.request_id, delta.finished)

    def _orphaned(self, request_id: str, finished: bool) -> None:
        """The consumer's event loop closed without closing the stream: stop generating for it."""
        self._streams.pop(request_id, None)
        if not finished:
            self.engine.abort_request(request_id)

    def _publish(self, out: RequestOutput, batch: _Batch | None = None) -> None:
        """``out`` to its stream: into ``batch`` (handed over by ``_deliver`` once the step is published), or
        at once without one."""
        entry = self._streams.get(out.request_id)
        if entry is None:
            return
        loop, q, request = entry
        if out.error is not None:
            self._send(loop, q, RequestFailedError(out.request_id, out.error, out.error_status))
            return
        completion = out.outputs[0]
        try:
            # Here, on the engine thread, so text, tokens and finish state are read consistently.
            text = request.take_stream_delta()
            token_ids = request.take_token_delta()
            logprobs = request.take_logprob_delta()
        except Exception as exc:  # this request's state is broken: it fails alone
            log.exception("request %s: its output could not be streamed", out.request_id)
            self.engine.abort_request(out.request_id)
            message = f"internal error ({type(exc).__name__}) while streaming request {out.request_id}"
            self._send(loop, q, RequestFailedError(out.request_id, message))
            return
        delta = StreamDelta(
            request_id=out.request_id,
            text=text,
            token_ids=token_ids,
            finished=out.finished,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
            num_prompt_tokens=len(out.prompt_token_ids),
            num_output_tokens=len(completion.token_ids),
            logprobs=logprobs,
            metrics=out.metrics,
            num_cached_tokens=out.num_cached_tokens,
            num_forced_tokens=completion.num_forced_tokens,
        )
        if batch is not None:
            batch.setdefault(loop, []).append((q, delta))
            return
        if not self._send(loop, q, delta):
            self._orphaned(out.request_id, out.finished)

    # ---- event-loop side ---------------------------------------------------------------------------
    async def process(self, prompt: str | dict, add_special_tokens: bool = True) -> ProcessedPrompt:
        if self.dead is not None:
            raise EngineDeadError(str(self.dead))
        return await self._in_pool(self.engine.process_prompt, prompt, add_special_tokens)

    async def _compiled(self, params: SamplingParams) -> None:
        """Compile ``params``' new grammar on the grammar threads (``COMPILE_WORKERS``), so that making the
        request then finds it cached; requests for one new grammar share its compile.
        ``GrammarCompilerBusy`` past ``COMPILES_WAITING`` new grammars at once."""
        spec = params.structured_output
        if spec is None or not isinstance(spec, StructuredSpec):
            return  # none, or not a spec: make_request names what is wrong
        backend = self.engine.built_structured_backend  # the first build reads the vocabulary: not here
        if backend is not None and backend.cached(spec):
            return
        # shielded: a caller that leaves does not cancel the others' compile
        await self._from_pool(lambda: asyncio.shield(self._compile_future(spec)))

    def _compile_future(self, spec: StructuredSpec) -> asyncio.Future:
        """The compile of ``spec`` under way, or a new one on the grammar threads."""
        future = self._compiling.get(spec)
        if future is None:
            if len(self._compiling) >= COMPILES_WAITING:
                raise GrammarCompilerBusy(
                    f"{spec.field}: {len(self._compiling)} new grammars are compiling (at most "
                    f"{COMPILES_WAITING} at once); retry after {RETRY_AFTER_S} s"
                )
            future = asyncio.get_running_loop().run_in_executor(self._compile_pool, self._compile, spec)
            self._compiling[spec] = future
            future.add_done_callback(lambda _: self._compiling.pop(spec, None))
        return future

    def _compile(self, spec: StructuredSpec) -> None:
        self.engine.structured_backend.compile(spec)  # on a grammar thread: builds the backend the first time

    async def _in_pool(self, fn, *args):
        """``fn(*args)`` in the preprocessing pool (errors as ``_from_pool``)."""
        loop = asyncio.get_running_loop()
        return await self._from_pool(lambda: loop.run_in_executor(self._pool, fn, *args))

    async def _from_pool(self, submit):
        """``await submit()``, work of one of the engine's pools. Work the engine's stop cancelled before it
        ran (shutdown or the step watchdog cancel the pools' queues) raises ``EngineDeadError``, as every
        other call on a stopped engine does, rather than the pool's cancellation; the caller's own
        cancellation stays one."""
        try:
            return await submit()
        except (asyncio.CancelledError, RuntimeError) as exc:  # RuntimeError: the pool has shut down
            task = asyncio.current_task()
            if self.dead is None or (task is not None and task.cancelling()):
                raise
            raise EngineDeadError(str(self.dead)) from exc

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer (chat template, ``encode``, ``decode``); read-only use is thread-safe."""
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt + output tokens) one request may reach."""
        return self.engine.max_model_len

    @property
    def config(self) -> EngineConfig:
        """The engine's configuration (read-only)."""
        return self.engine.config

    @property
    def accepts_audio(self) -> bool:
        """Whether requests may carry audio: the model has an audio tower (Gemma 4 E2B, E4B), loaded because
        ``limit_mm_per_prompt`` lets audio in (not ``--text-only``)."""
        engine = self.engine
        return engine.model.audio_tower is not None and engine.config.limit_mm_per_prompt.get("audio", 0) > 0

    async def validate(
        self,
        processed: ProcessedPrompt,
        params: SamplingParams,
        priority: int = 0,
        request_id: str | None = None,
        lora_name: str | None = None,
    ) -> Request:
        """Admit a request: its length against ``max_model_len``, its token ids, and its structured-output
        grammar, compiled here (into the backend's grammar cache). Returns the engine request, not yet
        queued, for ``add``: this is the one place a request is checked. Raises ``ValueError`` /
        ``StructuredOutputError`` naming the field, ``GrammarCompilerBusy`` past ``COMPILES_WAITING`` new
        grammars. A new grammar compiles on the grammar threads, the rest runs in the preprocessing pool:
        neither stalls the event loop, and a slow compile holds no thread that prepares other requests."""
        if self.dead is not None:
            raise EngineDeadError(str(self.dead))
        request_id = request_id or self.new_request_id()
        self._check_free(request_id)  # early, before a grammar compiles; `add` checks again
        await self._compiled(params)
        request = await self._in_pool(
            lambda: self.engine.make_request(
                request_id, processed, params, priority=priority, lora_name=lora_name
            )
        )
        # It arrives once admitted and back on the event loop, not when the pool made it: the server's
        # stages before the engine (its "admit" includes the pool's hand-back) then end before arrival.
        request.arrival_time = request.metrics.arrival_time = time.monotonic()
        return request

    async def generate(
        self,
        processed: ProcessedPrompt,
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[StreamDelta]:
        """``validate`` then ``add``: submit one request and yield its deltas until it finishes; closing or
        cancelling the iterator aborts it."""
        request = await self.validate(processed, params, priority=priority, request_id=request_id)
        stream = self.add(request)
        try:
            async for delta in stream:
                yield delta
        finally:
            await stream.aclose()

    def _check_free(self, request_id: str) -> None:
        if request_id in self._streams:
            # The engine thread would refuse it too, but only after this stream had replaced the
            # running request's stream, leaving that consumer waiting forever.
            raise ValueError(f"request_id: {request_id!r} is already in use by a running request")

    async def add(self, request: Request) -> AsyncIterator[StreamDelta]:
        """Queue an admitted request (from ``validate``) and yield its deltas until it finishes; closing or
        cancelling the iterator aborts it."""
        if self.dead is not None:
            raise EngineDeadError(str(self.dead))
        request_id = request.request_id
        self._check_free(request_id)
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (loop, q, request)
        if self.dead is not None:  # shut down (from another thread) since the check above
            self._streams.pop(request_id, None)
            raise EngineDeadError(str(self.dead))
        self._commands.put(("add", request))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine already dropped it
                    if isinstance(item, RequestFailedError):
                        raise item  # made for this stream alone
                    raise EngineDeadError(str(item)) from item  # `dead`, shared: a fresh error per stream
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    async def _on_engine_thread(self, fn):
        """``fn()`` on the engine thread between two steps; its result, or its exception raised here."""
        if self.dead is not None:
            raise EngineDeadError(str(self.dead))
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._commands.put(("call", (fn, loop, future)))
        self._wake.set()
        return await future

    # ---- torch.profiler (G4SERVE_TORCH_PROFILER_DIR) ---------------------------------------------
    async def start_profile(self) -> None:
        """Start ``torch.profiler`` on the engine thread (``LookupError``: not enabled; ``ProfileError``: one
        runs already)."""
        profiler = self._profiler_or_raise()
        await self._on_engine_thread(profiler.start)

    async def stop_profile(self) -> dict[str, str]:
        """Stop it and write its files; their paths (``ProfileError``: none runs)."""
        profiler = self._profiler_or_raise()
        return await self._on_engine_thread(profiler.stop)

    def _profiler_or_raise(self) -> TorchProfile:
        if self.profiler is None:
            raise LookupError("profiling is off: start the server with G4SERVE_TORCH_PROFILER_DIR set")
        return self.profiler

    # ---- LoRA adapters -----------------------------------------------------------------------------
    async def load_lora(self, name: str, path: str, confine_to: str | None = None) -> None:
        """Read and check the adapter in the preprocessing pool (file reads), then load it into a slot on
        the engine thread. ``ValueError`` names what is wrong. ``confine_to``: as ``LLMEngine.load_lora``."""
        engine = self.engine
        engine.lora_registry().check_name(name)
        adapter = await self._in_pool(engine.read_lora, path, confine_to)
        await self._on_engine_thread(lambda: engine.add_lora(name, adapter))

    async def unload_lora(self, name: str) -> None:
        """Stop serving adapter ``name`` (``KeyError`` if none is loaded); running requests finish with it."""
        await self._on_engine_thread(lambda: self.engine.unload_lora(name))

    def lora_names(self) -> list[str]:
        lora = self.engine.lora
        return lora.names() if lora is not None else []

    def stats(self) -> dict:
        return self.engine.stats()

    @property
    def num_waiting(self) -> int:
        """Requests queued and not yet running: submitted to the engine thread, or waiting in its scheduler
        (read from the event loop: a length, exact enough for admission control)."""
        return self._commands.qsize() + len(self.engine.scheduler.waiting)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the engine thread (after the step in progress) and end every open stream with
        ``EngineDeadError``; later ``process``/``validate``/``add`` calls raise it at once. Idempotent."""
        if self.dead is None:
            self.dead = EngineDeadError("engine is not running: it was shut down")
        self._stop.set()
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._compile_pool.shutdown(wait=False, cancel_futures=True)
        for loop, q, _ in list(self._streams.values()):
            self._send(loop, q, self.dead)
        if not self._thread.is_alive():
            # The engine is ours alone now: return the unfinished requests' KV blocks and media pins.
            for request_id in list(self.engine.requests):
                self.engine.abort_request(request_id)
            self._fail_calls()
            self.engine.shutdown()  # its tensor-parallel workers


def _refused(request_id: str, exc: Exception) -> RequestFailedError:
    """Why the engine thread could not queue an admitted request. A ``ValueError`` is the client's, naming the
    field (400; 404 for an adapter unloaded since admission, as the model check answers an unknown one);
    anything else is ours, a 500 told without internals and logged with its traceback."""
    if not isinstance(exc, ValueError):
        log.exception("request %s: could not be added", request_id, exc_info=exc)
        return RequestFailedError(request_id, f"internal error ({type(exc).__name__})")
    log.info("request %s: refused when queued: %s", request_id, exc)
    status = 404 if isinstance(exc, AdapterNotLoadedError) else 400
    return RequestFailedError(request_id, str(exc), status)


def _put_all(items: list[tuple[asyncio.Queue, StreamDelta]]) -> None:
    for q, delta in items:
        q.put_nowait(delta)


def _settle(future: asyncio.Future, result, error: Exception | None) -> None:
    if future.done():  # the caller was cancelled
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
