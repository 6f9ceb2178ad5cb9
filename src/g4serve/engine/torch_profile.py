"""A served engine under ``torch.profiler``, started and stopped over HTTP (``POST /start_profile``, ``POST
/stop_profile``), as vLLM's ``VLLM_TORCH_PROFILER_DIR`` does: the steps a live load makes, with their CPU ops
and CUDA kernels, where an offline bench cannot reproduce the load (videos arriving beside text streams).

Set ``G4SERVE_TORCH_PROFILER_DIR`` to a directory before ``g4serve serve`` and the two routes exist (with the
API key when the server has one); without it they answer 404. The profiler starts and stops on the engine
thread, between two steps. A stop writes, under the directory, the Chrome trace
(``g4serve-<time>.trace.json.gz``, for Perfetto or chrome://tracing) and the ops' table sorted by device time
(``g4serve-<time>.txt``), and returns both paths. A profile left running stops itself after
``G4SERVE_TORCH_PROFILER_MAX_S`` seconds (default 60: the trace grows with every step) at the next step.
With ``G4SERVE_TORCH_PROFILER_WITH_STACK=1`` (the default, as vLLM's) the trace holds every Python call of
every thread; ``bench/trace_summary.py`` sums the host time by thread and function.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from g4serve import envs


class ProfileError(ValueError):
    """A start while one runs, a stop with none running: the request's fault (400)."""


class TorchProfile:
    """At most one ``torch.profiler`` session of the engine thread; every method runs on that thread."""

    def __init__(self, directory: str | Path, max_seconds: float | None = None):
        self.directory = Path(directory)
        self.max_seconds = (
            max_seconds if max_seconds is not None else envs.get_float("G4SERVE_TORCH_PROFILER_MAX_S")
        )
        self._profiler: torch.profiler.profile | None = None
        self._started = 0.0
        self.last: dict[str, str] | None = None  # the files the last stop (or auto-stop) wrote

    @classmethod
    def from_env(cls) -> TorchProfile | None:
        directory = envs.get("G4SERVE_TORCH_PROFILER_DIR")
        return cls(directory) if directory else None

    @property
    def running(self) -> bool:
        return self._profiler is not None

    def start(self) -> None:
        if self._profiler is not None:
            raise ProfileError("profile: one is running already; POST /stop_profile first")
        self.directory.mkdir(parents=True, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with_stack = envs.get("G4SERVE_TORCH_PROFILER_WITH_STACK") == "1"
        profiler = torch.profiler.profile(activities=activities, record_shapes=False, with_stack=with_stack)
        profiler.start()
        self._profiler, self._started = profiler, time.monotonic()

    def stop(self) -> dict[str, str]:
        """Stop and write the trace and the table; their paths."""
        profiler = self._profiler
        if profiler is None:
            raise ProfileError("profile: none is running; POST /start_profile first")
        self._profiler = None
        profiler.stop()
        stem = self.directory / f"g4serve-{time.strftime('%Y%m%d-%H%M%S')}-{time.monotonic_ns() % 10**6:06d}"
        trace, table = Path(f"{stem}.trace.json.gz"), Path(f"{stem}.txt")
        profiler.export_chrome_trace(str(trace))
        sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        table.write_text(profiler.key_averages().table(sort_by=sort, row_limit=60) + "\n")
        self.last = {"trace": str(trace), "table": str(table)}
        return self.last

    def step(self) -> None:
        """Between two steps: stop a profile that has run past ``max_seconds``."""
        if self._profiler is not None and time.monotonic() - self._started > self.max_seconds:
            self.stop()


__all__ = ["ProfileError", "TorchProfile"]
