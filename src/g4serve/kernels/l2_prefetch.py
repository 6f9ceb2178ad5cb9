"""Asks the GPU's L2 cache to fetch weights a decode step is about to read, without waiting for them.

A batch-1 decode step streams every weight once, and between its GEMVs run kernels that hardly touch memory
(norms, the attention prologue, decode attention and its merge): HBM idles there, ~0.8 ms of an e4b step on
an H100. A prefetch issued before such a stretch lets HBM fill L2 with the next projections' first bytes
meanwhile; those GEMVs then read them from L2 (docs/architecture.md, "L2 prefetch").

One launch takes up to ``MAX_REGIONS`` byte ranges (grid axis 1 picks the range). Each lane of a program
covers ``CHUNK`` bytes of its range:

- ``BULK``: one ``cp.async.bulk.prefetch.L2`` per lane (Hopper's bulk-copy unit fetches the whole chunk);
- else one ``prefetch.global.L2`` per 128-byte line, the lane walking its chunk.

Neither instruction returns data or can fault the kernel's result: the launch changes no tensor, only what
L2 holds. But its programs do not finish before the lines arrive, so a kernel that waits for this one waits
for the fetch: in a chain of dependent launches it costs what loading the bytes costs (bench/l2_prefetch.py),
and the decode step launches it on a stream of its own (``layers.prefetch``). With ``USE_PDL`` the next kernel
is let in at once and this one exits only after the previous kernel finished (its ``gdc_wait``), so a chain's
ordering passes through it unchanged.

CUDA only (Hopper and later for the bulk form): the interpreter has no inline PTX, and on the CPU path there
is no cache to warm, so ``l2_prefetch`` does nothing there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from g4serve.kernels._launch import pdl

MAX_REGIONS = 4
LINE = 128  # bytes a prefetch.global.L2 asks for
ALIGN = 16  # the bulk form's address and size granularity


@triton.jit
def _l2_prefetch_kernel(
    a0, n0, a1, n1, a2, n2, a3, n3,
    CHUNK: tl.constexpr, LANES: tl.constexpr, BULK: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may start: nothing here is read by it
    region = tl.program_id(1)
    base = tl.where(region == 0, a0, tl.where(region == 1, a1, tl.where(region == 2, a2, a3))).to(tl.int64)
    size = tl.where(region == 0, n0, tl.where(region == 1, n1, tl.where(region == 2, n2, n3))).to(tl.int64)
    lane = tl.program_id(0) * LANES + tl.arange(0, LANES)
    start = lane.to(tl.int64) * CHUNK
    length = tl.minimum(size - start, CHUNK)
    if BULK:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s64 p, $2, 0; "
            "@p cp.async.bulk.prefetch.L2.global [$1], $3; mov.u32 $0, 0; }",
            "=r,l,l,r",
            [base + start, length, length.to(tl.int32)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
    else:
        for line in tl.static_range(0, CHUNK, 128):
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.gt.s64 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                "=r,l,l",
                [base + start + line, length - line],
                dtype=tl.int32,
                is_pure=False,
                pack=1,
            )
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # exit after the previous kernel: the next one's wait covers both


def clip(tensor: torch.Tensor, offset: int, nbytes: int) -> tuple[int, int] | None:
    """(address, bytes) of ``tensor``'s storage bytes [offset, offset + nbytes), shrunk inward to 16-byte
    boundaries and to the tensor's own bytes; None when nothing is left."""
    total = tensor.numel() * tensor.element_size()
    begin = tensor.data_ptr() + max(0, offset)
    end = tensor.data_ptr() + min(total, offset + nbytes)
    begin = -(-begin // ALIGN) * ALIGN
    end = end // ALIGN * ALIGN
    return (begin, end - begin) if end > begin else None


def launch_shape(sizes: Sequence[int], chunk: int, lanes: int) -> tuple[int, int]:
    """The grid (programs, regions) that gives every ``chunk`` of the largest region a lane."""
    per_program = chunk * lanes
    return max(-(-size // per_program) for size in sizes), len(sizes)


def launch_args(
    spans: Sequence[tuple[int, int]], bulk: bool, chunk: int | None, lanes: int
) -> tuple[tuple[int, int], list[int], dict]:
    """(grid, arguments, meta-parameters) of the launch that prefetches ``spans`` ((address, bytes), at most
    ``MAX_REGIONS``, 16-byte aligned): ``chunk`` bytes a lane (default 64 KB in bulk, 4 KB by lines)."""
    if len(spans) > MAX_REGIONS:
        raise ValueError(f"l2_prefetch takes at most {MAX_REGIONS} ranges a launch, got {len(spans)}")
    chunk = chunk or (1 << 16 if bulk else 1 << 12)
    args: list[int] = []
    for address, size in list(spans) + [(0, 0)] * (MAX_REGIONS - len(spans)):
        args += [address, size]
    meta = dict(CHUNK=chunk, LANES=lanes, BULK=bulk, num_warps=max(1, lanes // 32))
    return launch_shape([n for _, n in spans], chunk, lanes), args, meta


def l2_prefetch(
    regions: Sequence[tuple[torch.Tensor, int, int]],
    bulk: bool = True,
    chunk: int | None = None,
    lanes: int = 32,
    dependent: bool = True,
) -> None:
    """Start fetching ``regions`` (tensor, byte offset, bytes) into L2: one launch of at most ``MAX_REGIONS``
    ranges, on the current stream (captured into CUDA graphs like any kernel). Ranges on the CPU, or empty
    after alignment, are skipped. ``dependent``: with programmatic dependent launch, for a launch inside a
    chain of such kernels. The launch finishes only when its lines have arrived (measured on an H100: a
    kernel's prefetches hold it like loads), so a chain waits for it; ``layers.prefetch`` launches it on a
    stream of its own beside the chain."""
    spans = [span for t, off, n in regions if t.is_cuda and (span := clip(t, off, n)) is not None]
    if not spans:
        return
    device = next(t.device for t, _, _ in regions if t.is_cuda)
    grid, args, meta = launch_args(spans, bulk, chunk, lanes)
    launch = pdl(device, 1) if dependent else {"USE_PDL": False}
    _l2_prefetch_kernel[grid](*args, **meta, **launch)
