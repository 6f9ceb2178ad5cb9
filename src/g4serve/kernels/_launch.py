"""Builds each kernel twice: compiled for CUDA tensors, interpreted for CPU tensors.

``triton.jit`` decides at decoration time whether a kernel is compiled or interpreted (from the
``TRITON_INTERPRET`` variable), so a process could otherwise run only one of the two. Holding both
lets the CPU tests run the exact kernel source in Triton's interpreter without a process-wide
variable that would also turn the GPU tests' kernels into interpreted ones. The interpreter's
internals are imported on the first CPU launch only: CUDA use never touches them.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch
import triton
import triton.language as tl

from g4serve import envs

_INTERPRETED_HELPERS: dict = {}


@contextmanager
def _jit_helpers_interpreted():
    """Lets an interpreted kernel call ``triton.language``'s own jitted helpers (``tl.max``, ``tl.sum``,
    ``tl.cdiv``...), which are compiled-mode objects unless ``TRITON_INTERPRET=1`` was set before
    triton was imported. Active only while a CPU launch runs."""
    if triton.knobs.runtime.interpret:
        yield
        return
    from triton.language import standard as tl_standard
    from triton.runtime.interpreter import InterpretedFunction, _patch_lang
    from triton.runtime.jit import JITFunction

    original = JITFunction.__call__

    def call(self, *args, **kwargs):
        helper = _INTERPRETED_HELPERS.get(self.fn)
        if helper is None:
            helper = _INTERPRETED_HELPERS[self.fn] = InterpretedFunction(self.fn).rewrite()
        return helper(*args, **kwargs)

    # The helpers live in triton.language.standard: patch its view of the language once per launch
    # (InterpretedFunction.__call__ would redo it on every helper call, a third of the run time).
    scope = _patch_lang(tl_standard.cdiv.fn)
    JITFunction.__call__ = call
    try:
        yield
    finally:
        JITFunction.__call__ = original
        scope.restore()


class _InterpretedLauncher:
    def __init__(self, kernel: DualKernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            with _jit_helpers_interpreted():
                return self.kernel.interpreted()[grid](*args, **kwargs)

        return launch


class DualKernel:
    """``kernel[device][grid](*args, **meta)``: the compiled kernel on CUDA, the interpreter on CPU."""

    def __init__(self, fn):
        self.fn = fn
        self.compiled = triton.jit(fn)
        self._interpreted = None

    def interpreted(self):
        if self._interpreted is None:
            from triton.runtime.interpreter import InterpretedFunction

            self._interpreted = InterpretedFunction(self.fn)
        return self._interpreted

    def __getitem__(self, device: torch.device):
        return _InterpretedLauncher(self) if device.type == "cpu" else self.compiled


def dot_settings(dtype: torch.dtype, device: torch.device) -> tuple[bool, str]:
    """(upcast, input_precision) for the kernels' ``tl.dot`` calls.

    fp32 inputs use IEEE products (TF32 would cost ~1e-3 and the fp32 path exists to match the torch
    reference to ~1e-5). The interpreter multiplies bf16 tiles as raw integers (it stores bf16 as
    uint16), so on CPU 16-bit operands are widened to fp32 first; they hold 16-bit values either way,
    so the products equal a tensor core's bf16/fp16 x bf16/fp16 -> fp32.
    """
    upcast = device.type == "cpu" and dtype != torch.float32
    precision = "ieee" if dtype == torch.float32 or upcast else "tf32"
    return upcast, precision


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@functools.cache
def sm_count(device_index: int) -> int:
    """Streaming multiprocessors of CUDA device ``device_index`` (tile and split choices)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


PDL_MAX_ROWS = 64


def pdl(device: torch.device, rows: int) -> dict:
    """Launch options for programmatic dependent launch (Hopper and later): the kernel may be scheduled while
    the previous one in the stream drains, and waits (``gdc_wait``, first thing in every kernel that takes
    ``USE_PDL``) until that kernel's writes are visible. Only for decode-sized launches (at most
    ``PDL_MAX_ROWS`` token rows): on an H100 it takes ~0.3 ms off an e4b batch-1 decode step (548 kernels,
    captured CUDA graph), but made the vision encoder's graph 25% slower (6.8 vs 5.4 ms for six 480p
    frames) and prefill 2-5% slower. G4SERVE_PDL=0 turns it off (A/B runs)."""
    if device.type != "cuda" or rows > PDL_MAX_ROWS or not _pdl_supported(device.index or 0):
        return {"USE_PDL": False}
    return {"USE_PDL": True, "launch_pdl": True}


@functools.cache
def _pdl_supported(index: int) -> bool:
    return envs.get("G4SERVE_PDL") != "0" and torch.cuda.get_device_capability(index)[0] >= 9


@triton.jit
def wait_for_previous_kernel(USE_PDL: tl.constexpr):
    """Early in a kernel launched with ``pdl``: wait until the previous kernel's writes are visible, then let
    the next kernel be scheduled. A no-op without ``USE_PDL``. Only loads of what no kernel of the step writes
    may come before it (weights; lengths and block tables, written before the step): since every kernel
    lets its successor launch only after this wait, all kernels but the previous one have finished then."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


_COUNTERS: dict[tuple[torch.device, str], torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []  # replaced by larger ones, kept: captured graphs may still use them


def launch_counters(device: torch.device, count: int, kernel: str) -> torch.Tensor | None:
    """``kernel``'s int32 counters on ``device`` (at least ``count``; zero between launches: a launch's last
    program resets what it counted), for kernels whose last program of a group finishes the group's work
    (split-K GEMMs). Made outside CUDA-graph capture, on the kernel's first launch that needs them (an
    engine's eager runs before each capture); None while capturing before that: the caller then launches
    the way that needs none. Launches on one device share them, so they must not run
    concurrently on two streams (a step's kernels run on its one stream)."""
    counters = _COUNTERS.get((device, kernel))
    if counters is None or counters.numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        if counters is not None:
            _OUTGROWN.append(counters)
        counters = _COUNTERS[(device, kernel)] = torch.zeros(
            max(4096, count), dtype=torch.int32, device=device
        )
    return counters
