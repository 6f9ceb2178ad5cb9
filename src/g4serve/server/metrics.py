"""Prometheus metrics of one server: request latencies, queue and encoder time, load, KV use, cache hits.

Every metric lives in the server's own ``CollectorRegistry`` (no global state, so tests can
start several servers in one process). Engine gauges (running/waiting requests, KV use per
pool, prefix-cache hit rate, tokens/s) are read from ``engine.stats()`` at scrape time.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from g4serve.outputs import RequestMetrics

_LATENCY_BUCKETS_S = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_ITL_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1.0,
    2.5,
)

# How late the event loop wakes from a sleep: the time every stream's next write waits behind other callbacks.
_LOOP_LAG_BUCKETS_S = (0.0002, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)
LOOP_LAG_INTERVAL_S = 0.005


class _EngineCollector:
    """Reads the engine's live state when Prometheus scrapes."""

    def __init__(self, stats, throughput: _Throughput):
        self._stats = stats
        self._throughput = throughput

    def collect(self):
        stats = self._stats()
        running = GaugeMetricFamily("g4serve_num_requests_running", "Requests in the running batch")
        running.add_metric([], stats["num_running"])
        waiting = GaugeMetricFamily("g4serve_num_requests_waiting", "Requests waiting to be scheduled")
        waiting.add_metric([], stats["num_waiting"])
        kv = GaugeMetricFamily(
            "g4serve_kv_cache_usage_ratio", "Fraction of KV blocks in use, per pool", labels=["pool"]
        )
        for pool, used in stats["kv_usage"].items():
            kv.add_metric([pool], used)
        capacity = GaugeMetricFamily(
            "g4serve_kv_cache_capacity_tokens", "KV capacity in tokens, per pool", labels=["pool"]
        )
        for pool, tokens in stats["kv_capacity_tokens"].items():
            capacity.add_metric([pool], tokens)
        hit = GaugeMetricFamily(
            "g4serve_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / queried"
        )
        hit.add_metric([], stats["prefix_cache_hit_rate"])
        tps = GaugeMetricFamily(
            "g4serve_generation_tokens_per_second", "Generated tokens per second, last 10 s"
        )
        tps.add_metric([], self._throughput.rate(stats["generation_tokens_total"]))
        preempt = GaugeMetricFamily("g4serve_num_preemptions", "Preemptions (recompute) since start")
        preempt.add_metric([], stats["num_preemptions"])
        steps = GaugeMetricFamily("g4serve_num_steps", "Engine steps since start")
        steps.add_metric([], stats["num_steps"])
        overlapped = GaugeMetricFamily(
            "g4serve_num_overlapped_steps",
            "Steps launched before the previous step was read back (async scheduling)",
        )
        overlapped.add_metric([], stats["num_overlapped_steps"])
        forced = GaugeMetricFamily(
            "g4serve_generation_forced_tokens",
            "Output tokens appended by jump-forward (forced by a grammar, not decoded) since start",
        )
        forced.add_metric([], stats["forced_tokens_total"])
        decoded = GaugeMetricFamily(
            "g4serve_generation_decoded_tokens", "Output tokens sampled by the model since start"
        )
        decoded.add_metric([], stats["generation_tokens_total"] - stats["forced_tokens_total"])
        return [
            *_engine_thread(stats),
            *_media_caches(stats),
            running,
            waiting,
            kv,
            capacity,
            hit,
            tps,
            preempt,
            steps,
            overlapped,
            forced,
            decoded,
            *_spec(stats),
        ]


def _engine_thread(stats: dict) -> list:
    """The engine thread's wall and CPU time by phase (engine/step_profile.py), and its step intervals by
    step kind."""

    def by_phase(name: str, help_text: str, seconds: dict[str, float]) -> CounterMetricFamily:
        family = CounterMetricFamily(name, help_text, labels=["phase"])
        for phase, value in seconds.items():
            family.add_metric([phase], value)
        return family

    intervals = HistogramMetricFamily(
        "g4serve_engine_step_interval_seconds",
        "Time between consecutive steps' samples reaching the host, for steps with decode rows, by what "
        "the step carried beside them: nothing (decode), prompt tokens (prefill), media encodes (encode)",
        labels=["kind"],
    )
    for kind, h in stats.get("step_intervals", {}).items():
        intervals.add_metric([kind], h["buckets"], h["sum"])
    return [
        by_phase(
            "g4serve_engine_thread_seconds",
            "The engine thread's time by phase since start (engine/step_profile.py); per step with "
            "g4serve_num_steps",
            stats.get("engine_thread_seconds", {}),
        ),
        by_phase(
            "g4serve_engine_thread_cpu_seconds",
            "The engine thread's CPU time by phase since start; below g4serve_engine_thread_seconds by the "
            "time the thread waited off the CPU (the interpreter lock, the OS scheduler, the device)",
            stats.get("engine_thread_cpu_seconds", {}),
        ),
        intervals,
    ]


def _media_caches(stats: dict) -> list:
    """Lookups of the encoder cache (encoded media reused by content hash) and of the processed-media cache
    (``--mm-processor-cache-gb``: media reused by their encoded bytes), where the engine has them."""
    caches = {
        "encoder_cache": ("encoder cache", stats.get("encoder_cache_hits"), stats.get("encoder_cache_misses"))
    }
    processed = stats.get("mm_processor_cache")
    if processed:
        caches["mm_processor_cache"] = ("processed-media cache", processed["hits"], processed["misses"])
    out = []
    for name, (what, hits, misses) in caches.items():
        if hits is None:
            continue
        for suffix, value, verb in (("hits", hits, "found"), ("misses", misses, "did not find")):
            family = CounterMetricFamily(
                f"g4serve_{name}_{suffix}", f"Media items the {what} {verb} since start"
            )
            family.add_metric([], value)
            out.append(family)
    if processed:
        held = GaugeMetricFamily("g4serve_mm_processor_cache_bytes", "Bytes the processed-media cache holds")
        held.add_metric([], processed["bytes"])
        out.append(held)
    return out


def _spec(stats: dict) -> list[GaugeMetricFamily]:
    """Speculative decoding per draft position (0: a round's first draft): drafted, accepted, their ratio."""
    drafted = GaugeMetricFamily(
        "g4serve_spec_decode_draft_tokens", "Draft tokens verified since start", labels=["position"]
    )
    accepted = GaugeMetricFamily(
        "g4serve_spec_decode_accepted_tokens", "Draft tokens accepted since start", labels=["position"]
    )
    rate = GaugeMetricFamily(
        "g4serve_spec_decode_acceptance_rate", "Accepted / verified drafts since start", labels=["position"]
    )
    for i, (d, a) in enumerate(
        zip(stats.get("spec_drafted_tokens", []), stats.get("spec_accepted_tokens", []))
    ):
        drafted.add_metric([str(i)], d)
        accepted.add_metric([str(i)], a)
        rate.add_metric([str(i)], a / d if d else 0.0)
    return [drafted, accepted, rate]


class _Throughput:
    """Tokens/s over a sliding window of scrape-time samples."""

    def __init__(self, window_s: float = 10.0):
        self.window_s = window_s
        self.samples: deque[tuple[float, int]] = deque()

    def rate(self, total: int) -> float:
        now = time.monotonic()
        self.samples.append((now, total))
        while len(self.samples) > 2 and now - self.samples[0][0] > self.window_s:
            self.samples.popleft()
        t0, n0 = self.samples[0]
        return (total - n0) / (now - t0) if now > t0 else 0.0


class ServerMetrics:
    def __init__(self, engine_stats, model_name: str):
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        r = self.registry
        self.ttft = Histogram(
            "g4serve_time_to_first_token_seconds",
            "Arrival to first token",
            ["model_name"],
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        ).labels(**labels)
        self.itl = Histogram(
            "g4serve_inter_token_latency_seconds",
            "Time between consecutive output tokens",
            ["model_name"],
            buckets=_ITL_BUCKETS_S,
            registry=r,
        ).labels(**labels)
        self.e2e = Histogram(
            "g4serve_e2e_request_latency_seconds",
            "Arrival to last token",
            ["model_name"],
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        ).labels(**labels)
        self.queue = Histogram(
            "g4serve_request_queue_time_seconds",
            "Arrival to first scheduled",
            ["model_name"],
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        ).labels(**labels)
        self.encoder = Histogram(
            "g4serve_request_encoder_time_seconds",
            "Encoder time of a request's media",
            ["model_name"],
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        ).labels(**labels)
        # Before the engine: what a client's TTFT holds that the engine's (from arrival) does not.
        self.prepare = Histogram(
            "g4serve_request_prepare_time_seconds",
            "HTTP request received (handler entry) to engine arrival: body, parsing, chat "
            "template, media decoding and preprocessing, admission checks",
            ["model_name"],
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        ).labels(**labels)
        self.preprocess = Histogram(
            "g4serve_request_preprocess_time_seconds",
            "Prompt processing off the event loop: tokenization, media decoding, resizing, patches",
            ["model_name"],
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        ).labels(**labels)
        # The other stages before the engine, each request's time in them; what prepare holds beyond them
        # and preprocess is waiting (thread hand-offs, the event loop).
        self._stage = Histogram(
            "g4serve_request_stage_time_seconds",
            "A stage before the engine: read (body read, parsed and validated), parse (messages split into "
            "text and media parts), render (chat template), admit (the engine's admission checks)",
            ["model_name", "stage"],
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "g4serve_prompt_tokens", "Prompt tokens of finished requests", ["model_name"], registry=r
        ).labels(**labels)
        self.generation_tokens = Counter(
            "g4serve_generation_tokens", "Generated tokens of finished requests", ["model_name"], registry=r
        ).labels(**labels)
        self.cached_tokens = Counter(
            "g4serve_prefix_cache_hit_tokens",
            "Prompt tokens served from the prefix cache",
            ["model_name"],
            registry=r,
        ).labels(**labels)
        self._finished = Counter(
            "g4serve_request_success",
            "Finished requests by finish reason",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.errors = Counter(
            "g4serve_request_errors",
            "Requests rejected or failed, by HTTP status",
            ["model_name", "status"],
            registry=r,
        )
        self.loop_lag = Histogram(
            "g4serve_event_loop_lag_seconds",
            f"How late the server's event loop wakes from a {LOOP_LAG_INTERVAL_S * 1e3:g} ms sleep: what a "
            "stream's next write waits behind the loop's other work",
            buckets=_LOOP_LAG_BUCKETS_S,
            registry=r,
        )
        self._model_name = model_name
        r.register(_EngineCollector(engine_stats, _Throughput()))

    async def watch_event_loop(self, interval_s: float = LOOP_LAG_INTERVAL_S) -> None:
        """Sample the running loop's lateness every ``interval_s`` until cancelled (the app's lifespan)."""
        loop = asyncio.get_running_loop()
        while True:
            start = loop.time()
            await asyncio.sleep(interval_s)
            self.loop_lag.observe(max(loop.time() - start - interval_s, 0.0))

    def observe_finished(
        self,
        metrics: RequestMetrics | None,
        prompt_tokens: int,
        output_tokens: int,
        cached_tokens: int,
        finish_reason: str | None,
        received: float | None = None,
    ) -> None:
        """A finished engine request; ``received``: when its HTTP request reached the handler (monotonic
        clock, as the engine's arrival time), for the time spent before the engine."""
        self._finished.labels(self._model_name, finish_reason or "unknown").inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(output_tokens)
        self.cached_tokens.inc(cached_tokens)
        if metrics is None:
            return
        if metrics.ttft_s is not None:
            self.ttft.observe(metrics.ttft_s)
        for gap in metrics.itl_s:
            self.itl.observe(gap)
        if metrics.last_token_time is not None:
            self.e2e.observe(metrics.last_token_time - metrics.arrival_time)
        if metrics.queue_time_s is not None:
            self.queue.observe(metrics.queue_time_s)
        if metrics.encoder_time_s:
            self.encoder.observe(metrics.encoder_time_s)
        if received is not None:
            self.prepare.observe(max(metrics.arrival_time - received, 0.0))

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time the block as stage ``name`` of ``g4serve_request_stage_time_seconds`` (also when it raises:
        a refused request spent it too)."""
        began = time.monotonic()
        try:
            yield
        finally:
            self._stage.labels(self._model_name, name).observe(time.monotonic() - began)

    def observe_error(self, status: int) -> None:
        self.errors.labels(self._model_name, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
