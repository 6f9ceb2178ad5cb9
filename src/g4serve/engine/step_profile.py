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
"""

from __future__ import annotations

import time

PHASES = ("commands", "schedule", "encode", "launch", "wait", "outputs", "publish")
HOST_PHASES = tuple(p for p in PHASES if p != "wait")


class StepProfile:
    """Seconds per phase since start (or the last ``reset``)."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)

    @staticmethod
    def now() -> float:
        return time.perf_counter()

    def add(self, phase: str, since: float) -> float:
        """Charge the time since ``since`` (a ``now()``) to ``phase``; returns the present ``now()``."""
        now = time.perf_counter()
        self.seconds[phase] += now - since
        return now

    def reset(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
