"""Where the engine thread's time goes, phase by phase, summed since start (``LLMEngine.profile``).

A decode step should be the device's time alone; what the host adds shows here. ``LLMEngine.step`` charges
``schedule`` (the scheduler and its bookkeeping), ``encode`` (launching media encodes, collecting finished
ones), ``launch`` (inputs built and uploaded, the forward and the sampler launched), ``wait`` (blocked on the
device for a step's samples, or on an encode when nothing else runs) and ``outputs`` (tokens appended,
detokenised, grammars advanced, outputs built); ``AsyncLLMEngine``'s loop adds ``commands`` (requests added
and aborted) and ``publish`` (outputs handed to the event loop). Host phases that grow under load while
``wait`` shrinks mean the host, not the GPU, sets the step time: the server's threads share the engine
thread's interpreter. ``/metrics`` serves the sums (``g4serve_engine_thread_seconds_total{phase}``) beside
``g4serve_num_steps``; ``g4serve bench`` reports them per step for each point.

Each phase also sums the thread's CPU time (``time.thread_time``). A host phase whose wall time exceeds its
CPU time spent the difference off the CPU: waiting for the interpreter lock while the server's other
threads (event loop, media preparation) hold it, or descheduled. That gap is what host contention costs a
step (``g4serve_engine_thread_cpu_seconds_total{phase}``; ``wait`` blocks on the device by design).
"""

from __future__ import annotations

import bisect
import time

PHASES = ("commands", "schedule", "encode", "launch", "wait", "outputs", "publish")
HOST_PHASES = tuple(p for p in PHASES if p != "wait")


Mark = tuple[float, float]  # (wall clock, this thread's CPU clock)


class StepProfile:
    """Seconds per phase since start (or the last ``reset``): wall time in ``seconds``, the engine thread's
    CPU time in ``cpu_seconds``."""

    def __init__(self) -> None:
        self.reset()

    @staticmethod
    def now() -> Mark:
        return time.perf_counter(), time.thread_time()

    def add(self, phase: str, since: Mark) -> Mark:
        """Charge the time since ``since`` (a ``now()``) to ``phase``; returns the present ``now()``."""
        now = time.perf_counter(), time.thread_time()
        self.seconds[phase] += now[0] - since[0]
        self.cpu_seconds[phase] += now[1] - since[1]
        return now

    def reset(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.cpu_seconds = dict.fromkeys(PHASES, 0.0)


# Steps by what they carried beside their decode rows: nothing (decode), prompt tokens (prefill), or media
# encodes run in the step (encode).
STEP_KINDS = ("decode", "prefill", "encode")
STEP_INTERVAL_BUCKETS_S = (
    0.002, 0.003, 0.004, 0.005, 0.006, 0.007, 0.008, 0.01, 0.012, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 1.0,
)  # fmt: skip


class StepIntervals:
    """The time between consecutive steps' samples reaching the host, for each step with a decode row: the
    engine-side inter-token latency of those rows, by the step's kind (``STEP_KINDS``). Tells which steps
    make a decode's tail: the ones carrying prefill or encodes, or plain decode steps slowed by something
    else on the GPU or the host. A histogram (``STEP_INTERVAL_BUCKETS_S``; ``counts[kind][i]``: intervals
    at most bucket ``i``'s bound, the last past every bound) with its sum."""

    def __init__(self) -> None:
        self.counts = {k: [0] * (len(STEP_INTERVAL_BUCKETS_S) + 1) for k in STEP_KINDS}
        self.sums = dict.fromkeys(STEP_KINDS, 0.0)
        self._last: float | None = None

    def observe(self, kind: str, has_decode_rows: bool) -> None:
        """A step's samples reached the host now."""
        now = time.perf_counter()
        if has_decode_rows and self._last is not None:
            interval = now - self._last
            i = bisect.bisect_left(STEP_INTERVAL_BUCKETS_S, interval)  # the first bound >= it, else past all
            self.counts[kind][i] += 1
            self.sums[kind] += interval
        self._last = now

    def snapshot(self) -> dict[str, dict]:
        """By kind: Prometheus' cumulative ``buckets`` ((upper bound, observations at most it), ``+Inf``
        last) and ``sum``."""
        bounds = [f"{b:g}" for b in STEP_INTERVAL_BUCKETS_S] + ["+Inf"]
        out = {}
        for kind in STEP_KINDS:
            total, buckets = 0, []
            for bound, n in zip(bounds, self.counts[kind]):
                total += n
                buckets.append((bound, total))
            out[kind] = {"buckets": buckets, "sum": self.sums[kind]}
        return out
