"""The load generator: sends a workload's requests to an OpenAI-compatible server at a constant or
Poisson rate (open loop) or at a fixed concurrency (closed loop), and times every streamed chunk.

Send times are scheduled against one monotonic start time (request ``i`` goes out at ``t0 + offset_i``,
never "sleep after the previous send"), so a slow response or a late wake-up does not push later
sends back. Request bodies are built and JSON-encoded ahead of time in worker threads, off the send path.

``run_offline_point`` drives ``LLMEngine`` directly (no HTTP) at a fixed concurrency and records the
same per-request timings from the engine's own ``RequestMetrics``.

This module imports neither torch nor g4serve.server: it runs against any peer with httpx or aiohttp.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from g4serve.engine.step_profile import PHASES, STEP_KINDS

# Stage histograms whose mean g4serve's /metrics lets us split TTFT into (before the engine, queue, encoder,
# rest).
SERVER_HISTOGRAMS = {
    "prepare": "g4serve_request_prepare_time_seconds",
    "preprocess": "g4serve_request_preprocess_time_seconds",
    "queue": "g4serve_request_queue_time_seconds",
    "encoder": "g4serve_request_encoder_time_seconds",
    "ttft": "g4serve_time_to_first_token_seconds",
    "e2e": "g4serve_e2e_request_latency_seconds",
}
# The server's other stages before the engine (``g4serve_request_stage_time_seconds{stage}``), by mean.
SERVER_STAGES = ("read", "parse", "render", "admit")
SERVER_STAGE_HISTOGRAM = "g4serve_request_stage_time_seconds"
SERVER_COUNTERS = {
    "prompt_tokens": "g4serve_prompt_tokens_total",
    "generation_tokens": "g4serve_generation_tokens_total",
    "prefix_cache_hit_tokens": "g4serve_prefix_cache_hit_tokens_total",
}
# Histograms whose p50 / p95 / p99 between two scrapes each point reports: the engine's inter-token gaps (when
# a step hands the token over, before the event loop writes it out) and the event loop's lateness.
SERVER_QUANTILES = {
    "server_itl": "g4serve_inter_token_latency_seconds",
    "event_loop_lag": "g4serve_event_loop_lag_seconds",
}
MAX_ERROR_CHARS = 300


@dataclass
class RequestResult:
    """One request's timings; times are seconds on ``time.perf_counter``'s clock relative to the point's t0,
    except ``chunk_times_s``, which are relative to this request's send."""

    index: int
    scheduled_s: float | None  # open loop: when it was due; closed loop: None
    sent_s: float
    ttft_s: float | None = None
    e2e_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)  # arrival of each chunk that carries content
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    error: str | None = None
    text: str = ""
    # Offline (engine) runs know every token's time exactly: ITL gaps and TPOT come from these instead.
    token_times_s: list[float] | None = None
    stages: dict[str, float] | None = None  # offline: queue_s, encoder_s

    @property
    def ok(self) -> bool:
        return self.error is None

    def record(self) -> dict[str, Any]:
        """A JSON-able summary (``--save-requests``)."""
        return {
            "index": self.index,
            "scheduled_s": self.scheduled_s,
            "sent_s": self.sent_s,
            "ttft_s": self.ttft_s,
            "e2e_s": self.e2e_s,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "num_chunks": len(self.chunk_times_s),
            "error": self.error,
        }


@dataclass
class PointRun:
    """What one load point produced: per-request results and the wall-clock window of the point."""

    results: list[RequestResult]
    started_s: float  # perf_counter of t0
    send_window_s: float  # from t0 to the last send
    wall_s: float  # from t0 to the last completion (or the drain deadline)
    timed_out: int = 0  # requests still in flight at the drain deadline (counted as errors)
    # CPU seconds this process spent over the point (HTTP runs: the client's own load; a client near a whole
    # core delivers tokens late and in bursts, and its ITL and TTFT say more about itself than the server)
    client_cpu_s: float | None = None


class HTTPStatusError(Exception):
    def __init__(self, status: int, text: str):
        super().__init__(f"HTTP {status}: {text[:MAX_ERROR_CHARS]}")
        self.status = status


# ---- HTTP clients ----------------------------------------------------------------------------------------
class _HttpxClient:
    name = "httpx"

    def __init__(self, headers: dict[str, str], timeout_s: float):
        import httpx

        self._client = httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 30.0)),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        )

    async def get(self, url: str) -> tuple[int, str]:
        resp = await self._client.get(url)
        return resp.status_code, resp.text

    async def post(self, url: str, body: bytes) -> tuple[int, str]:
        resp = await self._client.post(url, content=body, headers={"content-type": "application/json"})
        return resp.status_code, resp.text

    async def stream_lines(self, url: str, body: bytes) -> AsyncIterator[str]:
        async with self._client.stream(
            "POST", url, content=body, headers={"content-type": "application/json"}
        ) as resp:
            if resp.status_code != 200:
                raise HTTPStatusError(resp.status_code, (await resp.aread()).decode(errors="replace"))
            async for line in resp.aiter_lines():
                yield line

    async def aclose(self) -> None:
        await self._client.aclose()


class _AiohttpClient:
    name = "aiohttp"

    def __init__(self, headers: dict[str, str], timeout_s: float):
        import aiohttp

        self._session = aiohttp.ClientSession(
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout_s, sock_connect=min(timeout_s, 30.0)),
            connector=aiohttp.TCPConnector(limit=0, force_close=False),
            read_bufsize=1 << 20,
        )

    async def get(self, url: str) -> tuple[int, str]:
        async with self._session.get(url) as resp:
            return resp.status, await resp.text()

    async def post(self, url: str, body: bytes) -> tuple[int, str]:
        async with self._session.post(url, data=body, headers={"content-type": "application/json"}) as resp:
            return resp.status, await resp.text()

    async def stream_lines(self, url: str, body: bytes) -> AsyncIterator[str]:
        async with self._session.post(url, data=body, headers={"content-type": "application/json"}) as resp:
            if resp.status != 200:
                raise HTTPStatusError(resp.status, await resp.text())
            buffer = b""
            async for chunk in resp.content.iter_any():
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    yield line.decode("utf-8", errors="replace").rstrip("\r")
            if buffer:
                yield buffer.decode("utf-8", errors="replace")

    async def aclose(self) -> None:
        await self._session.close()


def make_http_client(kind: str = "auto", api_key: str | None = None, timeout_s: float = 600.0):
    """An async client: ``aiohttp`` (lower per-chunk overhead) when installed, else ``httpx``."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    if kind == "auto":
        try:
            import aiohttp  # noqa: F401

            kind = "aiohttp"
        except ImportError:
            kind = "httpx"
    if kind == "aiohttp":
        return _AiohttpClient(headers, timeout_s)
    if kind == "httpx":
        return _HttpxClient(headers, timeout_s)
    raise ValueError(f"--http-client: expected auto, aiohttp or httpx, got {kind!r}")


# ---- one streamed request --------------------------------------------------------------------------------
async def stream_chat(  # noqa: C901 - one pass over an SSE stream: [DONE], error, choices and usage chunks update one request's timings
    client, url: str, body: bytes, index: int, t0: float, scheduled_s: float | None
) -> RequestResult:
    """Send one streaming chat request now; time the chunks that carry content and read ``usage``.

    The stream ends at ``data: [DONE]``, or at the end of the response after a chunk with ``finish_reason``
    for servers that send no ``[DONE]`` (transformers serve)."""
    start = time.perf_counter()
    result = RequestResult(index=index, scheduled_s=scheduled_s, sent_s=start - t0)
    first_s: float | None = None
    chunks: list[float] = []
    text: list[str] = []
    done = False
    finished = (
        False  # a choice carried finish_reason: servers that send no [DONE] (transformers serve) end here
    )
    try:
        async for line in client.stream_lines(url, body):
            if not line.startswith("data:"):
                continue
            now = time.perf_counter() - start
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if event.get("error"):
                err = event["error"]
                result.error = "stream error: " + str(
                    err.get("message", err) if isinstance(err, dict) else err
                )
                break
            carried = False
            for choice in event.get("choices") or []:
                delta = choice.get("delta") or {}
                piece = (
                    delta.get("content")
                    or delta.get("reasoning_content")
                    or delta.get("reasoning")
                    or choice.get("text")
                )  # /v1/completions peers
                if piece:
                    carried = True
                    text.append(piece)
                if first_s is None and (piece or choice.get("finish_reason")):
                    first_s = now
                finished = finished or bool(choice.get("finish_reason"))
            if carried:
                chunks.append(now)
            usage = event.get("usage")
            if usage:
                result.prompt_tokens = usage.get("prompt_tokens")
                result.output_tokens = usage.get("completion_tokens")
        if result.error is None and not (done or finished):
            result.error = "stream ended without [DONE]"
    except asyncio.CancelledError:
        result.error = "in flight at the drain deadline (cancelled)"
    except Exception as exc:  # noqa: BLE001 - every failure is a counted, reported error
        result.error = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
    result.e2e_s = time.perf_counter() - start
    result.ttft_s = first_s
    result.chunk_times_s = chunks
    result.text = "".join(text)
    if result.error is None:
        if first_s is None:
            result.error = "no token arrived"
        elif result.output_tokens is None:  # a peer that ignores include_usage: one token per chunk
            result.output_tokens = len(chunks)
    return result


# ---- request bodies, built ahead -------------------------------------------------------------------------
class Prefetcher:
    """Builds request bodies ``build(i)`` in worker threads, ``lookahead`` indices ahead of the sender."""

    def __init__(
        self,
        build: Callable[[int], bytes],
        pool: ThreadPoolExecutor,
        lookahead: int,
        limit: int | None = None,
    ):
        self._build, self._pool, self._lookahead, self._limit = build, pool, max(1, lookahead), limit
        self._futures: dict[int, Future] = {}
        self._next = 0

    def _fill(self, upto: int) -> None:
        if self._limit is not None:
            upto = min(upto, self._limit)
        while self._next < upto:
            self._futures[self._next] = self._pool.submit(self._build, self._next)
            self._next += 1

    async def prime(self) -> None:
        """Build the first ``lookahead`` bodies before the clock starts."""
        self._fill(self._lookahead)
        if self._futures:
            await asyncio.gather(*(asyncio.wrap_future(f) for f in self._futures.values()))

    async def get(self, index: int) -> bytes:
        self._fill(index + self._lookahead + 1)
        return await asyncio.wrap_future(self._futures.pop(index))

    def cancel(self) -> None:
        for future in self._futures.values():
            future.cancel()
        self._futures.clear()


def arrival_offsets(rate_qps: float, arrival: str, rng: random.Random) -> Iterator[float]:
    """Send offsets (s from t0): ``constant`` = i / rate; ``poisson`` = cumulative exponential gaps."""
    if rate_qps <= 0:
        raise ValueError(f"--rates: must be positive, got {rate_qps}")
    if arrival == "constant":
        i = 0
        while True:
            yield i / rate_qps
            i += 1
    elif arrival == "poisson":
        t = 0.0
        while True:
            yield t
            t += rng.expovariate(rate_qps)
    else:
        raise ValueError(f"--arrival: expected constant or poisson, got {arrival!r}")


def planned_offsets(
    rate_qps: float, arrival: str, seed: str, duration_s: float | None, num_requests: int | None
) -> list[float]:
    """The whole send plan of an open-loop point: offsets below ``duration_s``, at most ``num_requests``."""
    out = []
    for offset in arrival_offsets(rate_qps, arrival, random.Random(seed)):
        if (duration_s is not None and offset >= duration_s) or (
            num_requests is not None and len(out) >= num_requests
        ):
            break
        out.append(offset)
    return out


def _lookahead(count_hint: float, body_bytes: int, budget_bytes: int = 256 << 20) -> int:
    return int(max(8, min(count_hint, budget_bytes // max(body_bytes, 1))))


async def _drain(
    tasks: list[tuple[asyncio.Task, int, float | None]], t0: float, drain_timeout_s: float
) -> tuple[list[RequestResult], int]:
    """Wait (bounded) for in-flight requests; those still running are cancelled and count as errors."""
    if not tasks:
        return [], 0
    _, pending = await asyncio.wait([t for t, _, _ in tasks], timeout=drain_timeout_s)
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.wait(pending)
    results = []
    for task, index, scheduled in tasks:
        if task.cancelled():  # cancelled before it ever ran
            results.append(
                RequestResult(index, scheduled, math.nan, error="in flight at the drain deadline (cancelled)")
            )
        else:
            results.append(task.result())
    return results, len(pending)


async def run_rate_point(
    client,
    url: str,
    build: Callable[[int], bytes],
    pool: ThreadPoolExecutor,
    *,
    rate_qps: float,
    arrival: str = "constant",
    duration_s: float | None = None,
    num_requests: int | None = None,
    drain_timeout_s: float = 60.0,
    schedule_seed: str = "0",
) -> PointRun:
    """Open loop: request ``i`` is sent at ``t0 + offset_i`` whatever the server does."""
    offsets = planned_offsets(rate_qps, arrival, schedule_seed, duration_s, num_requests)
    first = build(0) if offsets else b""
    prefetch = Prefetcher(
        lambda i: first if i == 0 else build(i),
        pool,
        _lookahead(max(32, rate_qps * 10), len(first)),
        limit=len(offsets),
    )
    await prefetch.prime()
    tasks: list[tuple[asyncio.Task, int, float]] = []
    cpu0 = time.process_time()
    t0 = time.perf_counter() + 0.01
    try:
        for i, offset in enumerate(offsets):
            body = await prefetch.get(i)
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append((asyncio.create_task(stream_chat(client, url, body, i, t0, offset)), i, offset))
    finally:
        prefetch.cancel()
    send_window = time.perf_counter() - t0
    results, timed_out = await _drain(tasks, t0, drain_timeout_s)
    return PointRun(results, t0, send_window, time.perf_counter() - t0, timed_out, time.process_time() - cpu0)


async def run_concurrency_point(  # noqa: C901 - closed-loop driver: worker closure, send deadline and drain share one point's state
    client,
    url: str,
    build: Callable[[int], bytes],
    pool: ThreadPoolExecutor,
    *,
    concurrency: int,
    duration_s: float | None = None,
    num_requests: int | None = None,
    drain_timeout_s: float = 60.0,
) -> PointRun:
    """Closed loop: ``concurrency`` workers, each sending its next request when its last one finished.

    Sending ends after ``duration_s`` or once ``num_requests`` were sent; requests still in flight then get
    ``drain_timeout_s`` to finish."""
    if concurrency <= 0:
        raise ValueError(f"--concurrency: must be positive, got {concurrency}")
    first = build(0)
    prefetch = Prefetcher(
        lambda i: first if i == 0 else build(i),
        pool,
        _lookahead(max(32, 4 * concurrency), len(first)),
        limit=num_requests,
    )
    await prefetch.prime()
    next_index = 0
    results: list[RequestResult] = []
    in_flight: dict[asyncio.Task, int] = {}
    sending_done = asyncio.Event()
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    last_send = 0.0

    async def worker() -> None:
        nonlocal next_index, last_send
        while True:
            if (num_requests is not None and next_index >= num_requests) or (
                duration_s is not None and time.perf_counter() - t0 >= duration_s
            ):
                sending_done.set()
                return
            index = next_index
            next_index += 1
            body = await prefetch.get(index)
            last_send = time.perf_counter() - t0
            task = asyncio.create_task(stream_chat(client, url, body, index, t0, None))
            in_flight[task] = index
            try:
                results.append(await asyncio.shield(task))
            finally:
                in_flight.pop(task, None)

    workers = [asyncio.create_task(worker()) for _ in range(concurrency)]
    # Sending ends when a worker finds nothing left to send, when the duration is up (even if every worker
    # is still waiting on a long request), or when a worker failed.
    waiter = asyncio.create_task(sending_done.wait())
    await asyncio.wait([waiter, *workers], timeout=duration_s, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    sending_done.set()
    _, pending = await asyncio.wait(workers, timeout=drain_timeout_s)
    for w in pending:
        w.cancel()
    timed_out = len(in_flight)
    stragglers = dict(in_flight)
    for task in stragglers:
        task.cancel()
    for task, index in stragglers.items():
        try:
            results.append(await task)
        except asyncio.CancelledError:  # cancelled before it ever ran
            results.append(
                RequestResult(index, None, math.nan, error="in flight at the drain deadline (cancelled)")
            )
    if pending:
        await asyncio.wait(pending)
    prefetch.cancel()
    for w in workers:
        if not w.cancelled() and w.exception() is not None:
            raise w.exception()
    results.sort(key=lambda r: r.index)
    return PointRun(results, t0, last_send, time.perf_counter() - t0, timed_out, time.process_time() - cpu0)


# ---- the server's own metrics ------------------------------------------------------------------------------
def parse_prometheus(text: str) -> dict[str, float]:
    """``{sample name: value}`` summed over label sets (``x_sum``, ``x_count``, ``y_total``...), and each
    labelled sample under its name with its labels as written (``x_total{phase="wait"}``)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        labelled = None
        if "{" in line:
            name, _, rest = line.partition("{")
            labels, _, rest = rest.rpartition("}")
            labelled = f"{name.strip()}{{{labels}}}"
        else:
            name, _, rest = line.partition(" ")
        try:
            value = float(rest.split()[0])
        except (ValueError, IndexError):
            continue
        if math.isfinite(value):
            out[name.strip()] = out.get(name.strip(), 0.0) + value
            if labelled is not None:
                out[labelled] = value
    return out


async def scrape_metrics(client, base_url: str) -> dict[str, float] | None:
    """The server's /metrics, parsed, or None where it has none (a peer without Prometheus metrics)."""
    try:
        status, text = await client.get(base_url.rstrip("/") + "/metrics")
    except Exception:  # noqa: BLE001 - a peer without /metrics is fine
        return None
    if status != 200:
        return None
    parsed = parse_prometheus(text)
    return parsed if any(f"{name}_count" in parsed for name in SERVER_HISTOGRAMS.values()) else None


def finished_requests(base_url: str, timeout_s: float = 5.0) -> float | None:
    """The server's finished requests so far (``g4serve_request_success_total``, every reason), or None."""
    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=timeout_s) as r:
            return parse_prometheus(r.read().decode()).get("g4serve_request_success_total", 0.0)
    except OSError:
        return None


def wait_for_finished(base_url: str, count: int, timeout_s: float = 120.0, poll_s: float = 0.2) -> bool:
    """Block until the server has finished ``count`` more requests than when called, or ``timeout_s`` passed;
    whether it got there. A run meant to go beside media load starts once the media arrive: a media bench
    builds its first ~10 s of bodies (JPEG frames) before it sends, longer than a text point lasts."""
    start = finished_requests(base_url)
    deadline = time.monotonic() + timeout_s
    while start is not None and time.monotonic() < deadline:
        now = finished_requests(base_url)
        if now is not None and now - start >= count:
            return True
        time.sleep(poll_s)
    return False


def server_stage_split(
    before: dict[str, float] | None, after: dict[str, float] | None
) -> dict[str, Any] | None:
    """Mean prepare / preprocess / queue / encoder / TTFT / E2E time of the requests the server finished (the
    preprocess histogram: processed) during the point."""
    if before is None or after is None:
        return None
    out: dict[str, Any] = {}
    for key, name in SERVER_HISTOGRAMS.items():
        count = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
        total = after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0)
        out[f"{key}_mean_s"] = total / count if count > 0 else None
        out[f"{key}_count"] = int(count)
    out.update(stage_means(before, after))
    for key, name in SERVER_COUNTERS.items():
        if name in after:
            out[key] = int(after[name] - before.get(name, 0.0))
    for key, name in SERVER_QUANTILES.items():
        for q in (0.5, 0.95, 0.99):
            value = histogram_quantile(before, after, name, q)
            if value is not None:
                out[f"{key}_p{round(q * 100)}_s"] = value
    steps = step_interval_split(before, after)
    if steps:
        out["step_intervals"] = steps
    out.update(engine_thread_split(before, after))
    return out


def stage_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """``stage_<stage>_mean_s``: the mean time in each of ``SERVER_STAGES`` of the requests that went through
    it between the two scrapes (none where the server does not report stages)."""

    def grew(sample: str, stage: str) -> float:
        name = f"{SERVER_STAGE_HISTOGRAM}_{sample}"
        return labelled_sum(after, name, stage=stage) - labelled_sum(before, name, stage=stage)

    out = {}
    for stage in SERVER_STAGES:
        count, total = grew("count", stage), grew("sum", stage)
        if count > 0:
            out[f"stage_{stage}_mean_s"] = total / count
    return out


def labelled_sum(scrape: dict[str, float], name: str, **labels: str) -> float:
    """Sample ``name`` summed over the label sets holding ``labels`` (``parse_prometheus``' labelled keys)."""
    total = 0.0
    for key, value in scrape.items():
        found = _label_set(key, name)
        if found is not None and all(found.get(k) == v for k, v in labels.items()):
            total += value
    return total


def _label_set(key: str, name: str) -> dict[str, str] | None:
    """The labels of ``parse_prometheus``' labelled key ``key`` if it is a sample of ``name``, else None."""
    prefix = f"{name}{{"
    if not key.startswith(prefix):
        return None
    found = dict(part.split("=", 1) for part in key[len(prefix) : -1].split(",") if "=" in part)
    return {k.strip(): v.strip().strip('"') for k, v in found.items()}


def histogram_quantile(
    before: dict[str, float],
    after: dict[str, float],
    name: str,
    q: float,
    labels: dict[str, str] | None = None,
) -> float | None:
    """The ``q``-quantile of what histogram ``name`` observed between two scrapes, interpolated linearly
    within its bucket as Prometheus' ``histogram_quantile`` does (the top finite bound where it falls past
    it); None where it observed nothing or is not served. Buckets of the label sets holding ``labels``,
    summed over their other labels."""
    counts: dict[float, float] = {}
    for key, value in after.items():
        found = _label_set(key, f"{name}_bucket")
        if found is None or any(found.get(k) != v for k, v in (labels or {}).items()):
            continue
        le = float(found.get("le", "nan"))
        counts[le] = counts.get(le, 0.0) + value - before.get(key, 0.0)
    bounds = sorted(b for b in counts if not math.isnan(b))
    total = counts.get(math.inf, 0.0)
    if not bounds or total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for bound in bounds:
        if counts[bound] >= rank:
            if math.isinf(bound):
                return lower
            share = (rank - below) / (counts[bound] - below) if counts[bound] > below else 1.0
            return lower + (bound - lower) * share
        lower, below = bound, counts[bound]
    return lower


def step_interval_split(before: dict[str, float], after: dict[str, float]) -> dict[str, dict[str, float]]:
    """By step kind (``step_profile.STEP_KINDS``): how many steps with decode rows the point saw and the
    p50 / p95 of their intervals (the engine-side ITL), from ``g4serve_engine_step_interval_seconds``."""
    name = "g4serve_engine_step_interval_seconds"
    out = {}
    for kind in STEP_KINDS:
        count_key = f'{name}_count{{kind="{kind}"}}'
        if count_key not in after:
            continue
        row: dict[str, float] = {"steps": int(after[count_key] - before.get(count_key, 0.0))}
        for q in (0.5, 0.95):
            value = histogram_quantile(before, after, name, q, {"kind": kind})
            if value is not None:
                row[f"p{round(q * 100)}_s"] = value
        out[kind] = row
    return out


def engine_thread_split(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """The engine thread's milliseconds per step in each phase during the point (``step_profile.py``; empty
    where the server does not report them), and its steps."""
    steps = after.get("g4serve_num_steps", 0.0) - before.get("g4serve_num_steps", 0.0)

    def per_step(metric: str) -> dict[str, float]:
        out = {}
        for phase in PHASES:
            name = f'{metric}{{phase="{phase}"}}'
            if name in after and steps > 0:
                out[phase] = (after[name] - before.get(name, 0.0)) / steps * 1e3
        return out

    phases = per_step("g4serve_engine_thread_seconds_total")
    if not phases:
        return {}
    out = {"engine_steps": int(steps), "engine_thread_ms_per_step": phases}
    cpu = per_step("g4serve_engine_thread_cpu_seconds_total")
    if cpu:  # the thread's CPU time by phase: wall minus CPU is time off the CPU (the GIL, the OS)
        out["engine_thread_cpu_ms_per_step"] = cpu
    return out


# ---- offline: the engine without HTTP ----------------------------------------------------------------------
def run_offline_point(  # noqa: C901 - the engine step loop with its send, drain-deadline and abort phases over one point's state
    engine,
    generate: Callable[[int], Any],
    prepare: Callable[[Any], tuple[Any, Any]],
    pool: ThreadPoolExecutor,
    *,
    concurrency: int,
    duration_s: float | None = None,
    num_requests: int | None = None,
    drain_timeout_s: float = 60.0,
    id_prefix: str = "bench",
) -> PointRun:
    """Keep ``concurrency`` requests in ``engine`` (an ``LLMEngine``) until the point ends.

    ``generate(i)`` makes the workload's request ``i`` (synthetic media: built ahead in ``pool``, untimed);
    ``prepare(request)`` returns ``(ProcessedPrompt, SamplingParams)``: its time (media decoding,
    tokenizing) counts in the request's TTFT, as it does for an HTTP client. The engine stamps
    ``time.monotonic``; only differences of its stamps are used."""
    if concurrency <= 0:
        raise ValueError(f"--concurrency: must be positive, got {concurrency}")
    lookahead = max(8, 2 * concurrency)
    futures: dict[int, Future] = {}

    def submit_ahead(index: int) -> None:
        limit = index + lookahead if num_requests is None else min(index + lookahead, num_requests)
        for j in range(index, limit):
            if j not in futures:
                futures[j] = pool.submit(generate, j)

    def fetch(index: int):
        submit_ahead(index)
        return futures.pop(index).result()

    submit_ahead(0)
    for future in list(futures.values()):  # the first requests are ready before the clock starts
        future.result()
    t0 = time.monotonic()
    results: dict[str, RequestResult] = {}
    submitted = 0
    last_send = 0.0

    def can_send() -> bool:
        if num_requests is not None and submitted >= num_requests:
            return False
        return duration_s is None or time.monotonic() - t0 < duration_s

    sending_ended: float | None = None
    while True:
        while len(engine.requests) < concurrency and can_send():
            request = fetch(submitted)
            sent = time.monotonic()
            rid = f"{id_prefix}-{submitted}"
            result = RequestResult(index=submitted, scheduled_s=None, sent_s=sent - t0)
            results[rid] = result
            try:
                processed, params = prepare(request)
                engine.add_request(engine.make_request(rid, processed, params, arrival_time=sent))
            except Exception as exc:  # noqa: BLE001 - counted and reported like an HTTP 400
                result.error = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
            last_send = sent - t0
            submitted += 1
        if sending_ended is None and not can_send():
            sending_ended = time.monotonic()
        if not engine.has_unfinished_requests():
            if sending_ended is None:
                continue
            break
        if sending_ended is not None and time.monotonic() - sending_ended > drain_timeout_s:
            break
        for out in engine.step():
            if out.finished and out.request_id in results:
                _record_offline(results[out.request_id], out)
    for future in futures.values():
        future.cancel()
    timed_out = 0
    for rid, result in results.items():
        if result.error is None and result.e2e_s is None:
            engine.abort_request(rid)
            result.error = "in flight at the drain deadline (aborted)"
            timed_out += 1
    ordered = sorted(results.values(), key=lambda r: r.index)
    return PointRun(ordered, t0, last_send, time.monotonic() - t0, timed_out)


def _record_offline(result: RequestResult, out) -> None:
    m = out.metrics
    completion = out.outputs[0]
    result.prompt_tokens = len(out.prompt_token_ids)
    result.output_tokens = len(completion.token_ids)
    result.text = completion.text
    if completion.finish_reason == "abort" or m is None or m.first_token_time is None:
        result.error = f"finished without tokens (finish_reason={completion.finish_reason})"
        return
    end = m.finished_time or m.last_token_time
    result.ttft_s = m.first_token_time - m.arrival_time
    result.e2e_s = end - m.arrival_time
    result.token_times_s = [t - m.arrival_time for t in m.token_times]
    result.chunk_times_s = list(result.token_times_s)
    result.stages = {"queue_s": m.queue_time_s, "encoder_s": m.encoder_time_s}
