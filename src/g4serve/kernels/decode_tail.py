"""A dense decoder layer's tail after attention, at decode sizes, in one persistent launch.

At batch 1-8, what follows a dense layer's attention is a chain of skinny GEMMs and norms, each its own
launch: ``o_proj``; ``add_rms_norm`` (post-attention norm into the residual, then the pre-feed-forward norm);
``gate_up`` with the activation fused; ``down``; ``add_rms_norm`` (post-feed-forward); and on E-type models
the per-layer input (PLE): its gate times the per-layer input, its projection, a last ``add_rms_norm`` (the
layer scalar, the next layer's input norm). Eight launches on E4B, five on 31B, each waiting for the one
before to drain before its weight stream is in full flow; the PLE GEMMs stream about a megabyte each, so
they are all launch and ramp. Here one grid of persistent programs takes the tail's tasks from a ticket
counter, in dependency order, phase by phase:

- ``o``: ``BN_O`` hidden columns of ``attn @ W_o^T`` (the attention output) into ``Yo``, and each tile's
  sum of squares (of the rounded outputs) a row;
- ``n1``, a chunk of ``norm_cols`` columns of a row each: ``h1 = residual + norm(Yo)`` into ``H1``, the
  norm's statistics from o's tile sums (a fixed-order sum: deterministic), and the chunk's sum of squares;
- ``n1b``, a chunk each: ``pre_ff_norm(h1)`` into ``X1``, its statistics from n1's chunk sums;
- ``a``: ``BN_A`` intermediate units of ``act(X1 W_gate^T) * (X1 W_up^T)`` into ``Inter``;
- ``b``: ``BN_B`` hidden columns of ``Inter @ W_down^T`` into ``Yd``, and its tile sums;
- ``n2``, a chunk each: ``h2 = H1 + norm(Yd)``; without PLE ``h2 * scale`` is the output, and ``n2b``
  its next norm;
- ``g`` (PLE): ``BN_G`` columns of ``act(h2 W_gate^T) * per_layer_input`` into ``G``;
- ``p`` (PLE): ``BN_P`` hidden columns of ``G @ W_proj^T`` into ``Yp``, and its tile sums;
- ``n3`` (PLE), a chunk each: ``(h2 + norm(Yp)) * scale``, the output, and ``n3b`` its next norm.

A norm is thus two short phases of many tasks, not a row's serial pass in one program while every other
waits (the first version's: three passes over the row, each a chain of L2 round trips).

A phase's task loads its first weight tile, then waits for the phase before it (a counter of its finished
tasks; a program waits once a phase), so each weight stream starts while the previous phase drains; a program
takes its next ticket while it works on the current one (or, with the config's ``grab``, several consecutive
tickets at a time, and counts a GEMM phase's finished tasks once a grab and before it leaves the phase). Where
its next ticket is the next column tile of the same phase, a task's last K iteration loads that task's first
tiles: a grab's tasks stream as one. ``decode_tail(trace=...)`` records each program's GPU clock at each
phase's end (``bench/decode_tail.py --trace``: the phases' timeline). Tickets follow the dependencies, so a
waiting task only waits on tasks that running programs already hold (and have counted or will count without
waiting): no deadlock whatever the grid size or residency, and Triton's interpreter (which runs the programs
one after another: the first takes every task in order) runs the same source on the CPU. Finished tiles are
published with a CTA barrier and a release increment and read after an acquire with L2-only (``.cg``) loads.
The last program to leave resets the counters for the next launch (and the next replay of a captured CUDA
graph): each call site owns one counter buffer. Every intermediate is rounded to the model dtype where the
separate ops round it (norm statistics in fp32): only reduction orders differ.

The fused path of ``layers.fused.decode_tail_block``, off unless ``G4SERVE_DECODE_TAIL=1``: interpreter
tests, sm_90 compile tests and GPU tests. ``bench/decode_tail.py`` times it against the separate launches:
on an H200 its first version was 2.3x slower at one row (1.4 TB/s of weights against 3.3): ~250 registers a
thread let one program per SM keep tiles in flight. Now each phase runs in its own loop (one loop over all
phases kept every phase's values live), one-row products are summed per tile, and the default tiles are
small: 64 registers, 8 programs per SM (``decode_tail_config``, checked by ptxas in the tests, and capped
there with ``max_registers``, Triton's ``maxnreg``: the device's Triton 3.6 build took more, so only 6
programs an SM ran at once and the rest started as the first left). On an H100 an e4b tail takes 110 us
against the separate launches' 66, whatever the grab or norm width: its phases stream their weights at 2.2-2.7
TB/s against the separate GEMVs' ~3.0, and the small phases (``o``, the norms, the PLE projections) add ~37 us
(the trace, docs/benchmarks.md). So it stays off.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from g4serve.kernels._launch import (
    DualKernel,
    dot_settings,
    next_pow2,
    pdl,
    sm_count,
    wait_for_previous_kernel,
)
from g4serve.kernels.act_mul import _KINDS
from g4serve.kernels.gemv import GATE_UP, MAX_ROWS, MUL, gated_epilogue, skinny_matmul_reference
from g4serve.kernels.rms_norm import fused_rms_norm_reference

# tickets handed out; finished tasks of phases o, n1, n1b, a, b, n2, n2b, g, p, n3, n3b; programs gone
COUNTERS = 13
# int32s between two counters: each on a 128-byte line of its own, so the programs spinning on one phase's
# counter and the increments of the others (every task takes a ticket and counts itself done) do not queue
# at the same L2 slice
COUNTER_STRIDE = 32
# a traced launch's records a program (``decode_tail(trace=...)``), each (clock ns, next ticket): its
# start (before its first grab; the program's index in place of a ticket), its first ticket in hand, the
# end of each phase (a tail without PLE leaves g, p, n3 and n3b unwritten, one with PLE n2b, one without a
# next norm n2b or n3b) and its exit
TRACE_PHASES = ("o", "n1", "n1b", "a", "b", "n2", "n2b", "g", "p", "n3", "n3b")
TRACE_SLOTS = len(TRACE_PHASES) + 3
# columns a norm task takes, where a config does not say (decode_tail_config's default)
NORM_COLS = 512
# the kernel's view of them (a jitted function reads constexpr globals only)
_COUNTERS = tl.constexpr(COUNTERS)
_STRIDE = tl.constexpr(COUNTER_STRIDE)
_SLOTS = tl.constexpr(TRACE_SLOTS)
_GONE = tl.constexpr(COUNTERS - 1)


@triton.jit
def _acquire_load(C, ASM: tl.constexpr):
    """The counter at C, read with acquire semantics: ``ld.acquire.gpu`` on the GPU (the L2 serves it on its
    read path), a read-modify-write of 0 in the interpreter (which runs no PTX)."""
    if ASM:
        return tl.inline_asm_elementwise(
            "ld.global.acquire.gpu.b32 $0, [$1];", "=r,l", [C], dtype=tl.int32, is_pure=False, pack=1
        )
    else:
        return tl.atomic_add(C, 0, sem="acquire")


@triton.jit
def _wait_count(C, target, ASM: tl.constexpr):
    """Spin until the counter at C reaches ``target`` (acquire loads: no read-modify-write queues at the
    counter's L2 slice beside the increments it waits for), then let every thread of the program on."""
    done = _acquire_load(C, ASM)
    while done < target:
        done = _acquire_load(C, ASM)
    tl.debug_barrier()


@triton.jit
def _signal(C, count=1):
    """Publish this program's stores: every thread's are issued (barrier), then a release increment of the
    counter at C by ``count`` finished tasks."""
    tl.debug_barrier()
    tl.atomic_add(C, count, sem="release")


@triton.jit
def _next_ticket(C, task, GRAB: tl.constexpr):
    """The ticket after ``task``: the counter at C hands them out GRAB at a time ([v, v + GRAB) to the program
    that added GRAB to v), so only a program's last ticket of a grab takes the next grab: fewer
    read-modify-writes at one address, which every task of the launch otherwise queues at."""
    ticket = task + 1
    if ticket % GRAB == 0:  # always, one ticket a grab
        ticket = tl.atomic_add(C, GRAB)
    return ticket


@triton.jit
def _count_done(C_done, finished, task, ticket, end):
    """One more of this program's tasks finished: counted at C_done (and the tally reset) at the last task
    of its grab or of the phase, where its next ticket is not the next task of the phase. Returns the
    tally."""
    finished += 1
    if (ticket != task + 1) | (ticket >= end):
        _signal(C_done, finished)
        finished = 0
    return finished


@triton.jit
def _stamp(Trace, slot, task, TRACE: tl.constexpr, ASM: tl.constexpr):
    """With TRACE, record where this program stands at ``slot`` (``TRACE_SLOTS`` a program): the GPU's
    nanosecond clock (``%globaltimer``; 0 in the interpreter) and ``task``, its next ticket."""
    if TRACE:
        now = task.to(tl.int64) * 0
        if ASM:
            now = tl.inline_asm_elementwise(
                "mov.u64 $0, %globaltimer;", "=l,r", [task], dtype=tl.int64, is_pure=False, pack=1
            )
        at = Trace + (tl.program_id(0) * _SLOTS + slot) * 2
        tl.store(at, now)
        tl.store(at + 1, task.to(tl.int64))


@triton.jit
def _products(  # noqa: C901 - Triton helper: its branches test tl.constexpr flags (WAIT, GATED, USE_DOT, UPCAST), specialised away at compile time
    X,
    stride_x,
    W,
    stride_w,
    up_offset,
    offs_m,
    m_mask,
    offs_n,
    n_mask,
    N,
    K,
    C,
    target,
    ready,
    w_pre,
    u_pre,
    preloaded,
    more,
    WAIT: tl.constexpr,
    GATED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
    ASM: tl.constexpr,
):
    """fp32 products of token rows ``X[offs_m, :K]`` with weight rows ``W[offs_n, :K]`` -> (y, y_up, the
    next task's first tiles), y and y_up [BLOCK_M, BLOCK_N] (``y_up``: the rows ``up_offset`` elements
    further, when GATED). The first weight tiles are ``w_pre``/``u_pre`` where ``preloaded``, else loaded
    here before the wait for X (WAIT 0: the previous kernel, under PDL; 1: unless ``ready``, the counter at C
    reaching ``target``, X then read from L2); each next one before the current tile's math, and where
    ``more`` (this program's next task is the next BLOCK_N rows), the last iteration loads that task's first
    tiles instead: the weight stream runs on across the tasks of a grab."""
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_w + offs_k[None, :]
    x_ptrs = X + offs_m[:, None] * stride_x + offs_k[None, :]
    w_mask = n_mask[:, None] & (offs_k < K)[None, :] & (preloaded == 0)
    w = tl.load(w_ptrs, mask=w_mask, other=0.0, eviction_policy="evict_first")
    w = tl.where(preloaded != 0, w_pre, w)
    u = w
    if GATED:
        u = tl.load(w_ptrs + up_offset, mask=w_mask, other=0.0, eviction_policy="evict_first")
        u = tl.where(preloaded != 0, u_pre, u)
    if WAIT == 0:
        wait_for_previous_kernel(USE_PDL)
    elif ready == 0:
        _wait_count(C, target, ASM)
    if USE_DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    else:  # one row: each tile's products summed over K at once, so no [BLOCK_N, BLOCK_K] fp32 stays live
        acc = tl.zeros([BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_N], tl.float32)
    next_rows = (offs_n + BLOCK_N < N) & (more != 0)
    for k0 in range(0, K, BLOCK_K):
        x_mask = m_mask[:, None] & ((k0 + offs_k) < K)[None, :]
        if WAIT == 0:
            x = tl.load(x_ptrs, mask=x_mask, other=0.0)
        else:
            x = tl.load(x_ptrs, mask=x_mask, other=0.0, cache_modifier=".cg")
        # the next tile: this task's next K tile, or past its last one the next task's first (or nothing)
        last = k0 + BLOCK_K >= K
        step = tl.where(last, BLOCK_N * stride_w - k0, BLOCK_K)
        rows = tl.where(last, next_rows, n_mask)
        next_mask = rows[:, None] & (offs_k < tl.where(last, K, K - k0 - BLOCK_K))[None, :]
        w_next = tl.load(w_ptrs + step, mask=next_mask, other=0.0, eviction_policy="evict_first")
        u_next = w_next
        if GATED:
            u_next = tl.load(
                w_ptrs + step + up_offset, mask=next_mask, other=0.0, eviction_policy="evict_first"
            )
        if USE_DOT:
            if UPCAST:
                x = x.to(tl.float32)
                w = w.to(tl.float32)
                u = u.to(tl.float32)
            acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
            if GATED:
                acc_up += tl.dot(x, tl.trans(u), input_precision=DOT_PRECISION)
        else:
            xf = x.to(tl.float32)  # [1, BLOCK_K]
            acc += tl.sum(w.to(tl.float32) * xf, axis=1)
            if GATED:
                acc_up += tl.sum(u.to(tl.float32) * xf, axis=1)
        w = w_next
        u = u_next
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if USE_DOT:
        y = acc
        y_up = acc_up
    else:
        y = acc[None, :]
        y_up = acc_up[None, :]
    return y, y_up, w, u


@triton.jit
def _gemm_phase(
    C,
    task,
    first,
    end,
    X,
    stride_x,
    W,
    E,
    stride_e,
    Y,
    C_wait,
    target,
    C_done,
    N,
    K,
    offs_m,
    m_mask,
    Sq,
    sq_stride,
    WAIT: tl.constexpr,
    SQ: tl.constexpr,
    EPILOGUE: tl.constexpr,
    ACT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
    ASM: tl.constexpr,
    GRAB: tl.constexpr,
):
    """A GEMM phase's tasks among this program's tickets [task, end) (tickets from ``first`` on are the
    phase's): task ``first + t`` writes columns [t * BLOCK_N, +BLOCK_N) of ``epilogue(X @ W^T)`` into Y [M, N]
    (contiguous), rounded to Y's dtype; W is [N, K], or [2N, K] stacked [gate; up] for ``GATE_UP``; E the
    ``MUL`` operand; with SQ, its rows' sums of squares (of the rounded outputs) into ``Sq[row, t]`` (row
    stride ``sq_stride``) for the norm after. Each takes the next ticket at C before it runs. The phase's
    counter at C_done counts them once a grab (and where the program leaves the phase, so no task it waits
    on later is uncounted). Returns the first ticket past the phase."""
    finished = 0
    ready = 0  # the phase before is done (this program saw its counter reach the target)
    preloaded = 0
    w_pre = tl.zeros([BLOCK_N, BLOCK_K], W.dtype.element_ty)
    u_pre = w_pre
    while task < end:
        ticket = _next_ticket(C, task, GRAB)
        more = (ticket == task + 1) & (ticket < end)  # the next task: the next column tile, this phase
        offs_n = (task - first) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        y, y_up, w_pre, u_pre = _products(
            X, stride_x, W, K, N * K, offs_m, m_mask, offs_n, n_mask, N, K, C_wait, target, ready, w_pre,
            u_pre, preloaded, more, WAIT, EPILOGUE == 1, BLOCK_M, BLOCK_N, BLOCK_K, USE_DOT, UPCAST,
            DOT_PRECISION, USE_PDL, ASM,
        )  # fmt: skip
        ready = 1
        preloaded = more.to(tl.int32)
        if EPILOGUE == 2:
            wait_for_previous_kernel(USE_PDL)  # E, the per-layer input, comes from an earlier kernel
        y = gated_epilogue(y, y_up, Y, E, offs_m, offs_n, m_mask, n_mask, stride_e, EPILOGUE, ACT)
        y = y.to(Y.dtype.element_ty)
        mask = m_mask[:, None] & n_mask[None, :]
        tl.store(Y + offs_m[:, None] * N + offs_n[None, :], y, mask=mask)
        if SQ:
            z = tl.where(mask, y.to(tl.float32), 0.0)
            tl.store(Sq + offs_m * sq_stride + (task - first), tl.sum(z * z, axis=1), mask=m_mask)
        finished = _count_done(C_done, finished, task, ticket, end)
        task = ticket
    return task


@triton.jit
def _sum_partials(Sq, row, sq_stride, T, SQ_BLOCK: tl.constexpr):
    """The sum of ``Sq[row, :T]`` (fp32 partial sums of squares), in a fixed order: deterministic."""
    ss = tl.zeros([SQ_BLOCK], tl.float32)
    for t0 in range(0, T, SQ_BLOCK):
        idx = t0 + tl.arange(0, SQ_BLOCK)
        ss += tl.load(Sq + row * sq_stride + idx, mask=idx < T, other=0.0, cache_modifier=".cg")
    return tl.sum(ss, 0)


@triton.jit
def _norm_phase(
    C,
    task,
    first,
    end,
    Y,
    Res,
    stride_r,
    NormW,
    Scale,
    Out,
    Sq,
    T,
    SqOut,
    sq_stride,
    C_wait,
    target,
    C_done,
    H,
    eps,
    HAS_RES: tl.constexpr,
    RES_WAIT: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    SQ_OUT: tl.constexpr,
    NCH: tl.constexpr,
    BLOCK_C: tl.constexpr,
    SQ_BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
    ASM: tl.constexpr,
    GRAB: tl.constexpr,
):
    """A norm phase's tasks among this program's tickets [task, end), once the phase before is done: task
    ``first + row * NCH + c`` writes columns [c * BLOCK_C, +BLOCK_C) of ``out = (res + rms_norm(y) * w) *
    scale`` for that row of the [M, H] GEMM output Y into Out (contiguous), its statistics from the GEMM's
    partial sums ``Sq[row, :T]``; with SQ_OUT the chunk's own sum of squares into ``SqOut[row, c]`` for the
    next norm. Without HAS_RES, ``rms_norm(y) * w`` alone: a next norm's phase, Y the norm phase's output and
    Sq its chunk sums (T = NCH). fp32 statistics, each intermediate rounded where the separate kernel rounds
    it. RES_WAIT: the residual is the previous kernel's output (wait for it under PDL). Returns the first
    ticket past the phase."""
    finished = 0
    ready = 0
    out_ty = Out.dtype.element_ty
    while task < end:
        ticket = _next_ticket(C, task, GRAB)
        row = (task - first) // NCH
        chunk = (task - first) % NCH
        cols = chunk * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = cols < H
        w = tl.load(NormW + cols, mask=mask, other=0.0).to(tl.float32)
        if ready == 0:
            _wait_count(C_wait, target, ASM)
            ready = 1
        if RES_WAIT:
            wait_for_previous_kernel(USE_PDL)
        denom = tl.sqrt(_sum_partials(Sq, row, sq_stride, T, SQ_BLOCK) / H + eps)
        x = tl.load(Y + row * H + cols, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        y = (x / denom * w).to(out_ty)
        if HAS_RES:
            r = tl.load(Res + row * stride_r + cols, mask=mask, other=0.0, cache_modifier=".cg")
            y = (r.to(tl.float32) + y.to(tl.float32)).to(out_ty)
        if HAS_SCALE:
            y = (y.to(tl.float32) * tl.load(Scale).to(tl.float32)).to(out_ty)
        tl.store(Out + row * H + cols, y, mask=mask)
        if SQ_OUT:
            z = y.to(tl.float32)
            tl.store(SqOut + row * sq_stride + chunk, tl.sum(z * z, 0))
        finished = _count_done(C_done, finished, task, ticket, end)
        task = ticket
    return task


def _decode_tail_fn(  # noqa: C901 - Triton kernel body: HAS_PLE specialised away at compile time
    X,
    Res,
    Wo,
    NormO,
    NextO,
    Wgu,
    Wd,
    NormF,
    Wpg,
    Pin,
    Wpp,
    NormP,
    NextW,
    Scale,
    Yo,
    H1,
    X1,
    Inter,
    Yd,
    H2,
    G,
    Yp,
    Out,
    Out2,
    Sq,
    C,
    Trace,
    M,
    H,
    Q,
    INTER,
    P,
    eps,
    stride_x,
    stride_r,
    stride_p,
    SQ_COLS,
    BLOCK_M: tl.constexpr,
    BN_O: tl.constexpr,
    BK_O: tl.constexpr,
    BN_A: tl.constexpr,
    BK_A: tl.constexpr,
    BN_B: tl.constexpr,
    BK_B: tl.constexpr,
    BN_G: tl.constexpr,
    BK_G: tl.constexpr,
    BN_P: tl.constexpr,
    BK_P: tl.constexpr,
    NCH: tl.constexpr,
    BLOCK_C: tl.constexpr,
    SQ_BLOCK: tl.constexpr,
    ACT: tl.constexpr,
    HAS_PLE: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_NEXT: tl.constexpr,
    USE_DOT: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
    ASM: tl.constexpr,
    GRAB: tl.constexpr,
    TRACE: tl.constexpr,
):
    num_o = tl.cdiv(H, BN_O)
    num_a = tl.cdiv(INTER, BN_A)
    num_b = tl.cdiv(H, BN_B)
    num_g = tl.cdiv(P, BN_G)
    num_p = tl.cdiv(H, BN_P)
    chunks = M * NCH  # a norm phase's tasks
    end_o = num_o
    end_n1 = end_o + chunks
    end_n1b = end_n1 + chunks
    end_a = end_n1b + num_a
    end_b = end_a + num_b
    end_n2 = end_b + chunks
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    # each phase's count of finished tasks (C itself hands out the tickets)
    Co, Cn1, Cn1b, Ca = C + 1 * _STRIDE, C + 2 * _STRIDE, C + 3 * _STRIDE, C + 4 * _STRIDE
    Cb, Cn2, Cn2b, Cg = C + 5 * _STRIDE, C + 6 * _STRIDE, C + 7 * _STRIDE, C + 8 * _STRIDE
    Cp, Cn3, Cn3b = C + 9 * _STRIDE, C + 10 * _STRIDE, C + 11 * _STRIDE
    # the sums of squares: per GEMM tile of o, b and p; per norm chunk of n1, n2 and n3 (a region each)
    region = M * SQ_COLS
    Sq_o, Sq_n1, Sq_b, Sq_n2, Sq_p, Sq_n3 = (
        Sq,
        Sq + region,
        Sq + 2 * region,
        Sq + 3 * region,
        Sq + 4 * region,
        Sq + 5 * region,
    )
    # Tickets only grow, so a program meets the phases in order: one loop a phase, each holding only its own
    # phase's values in registers (one loop over every phase kept them all live, ~120-160 registers a thread
    # at one row, so only 2-3 programs fit an SM).
    _stamp(Trace, 0, tl.program_id(0), TRACE, ASM)
    task = tl.atomic_add(C, GRAB)
    _stamp(Trace, 1, task, TRACE, ASM)
    task = _gemm_phase(
        C, task, 0, end_o, X, stride_x, Wo, Wo, 0, Yo, C, 0, Co, H, Q, offs_m, m_mask, Sq_o, SQ_COLS,
        0, True, 0, ACT, BLOCK_M, BN_O, BK_O, USE_DOT, UPCAST, DOT_PRECISION, USE_PDL, ASM, GRAB,
    )  # fmt: skip
    _stamp(Trace, 2, task, TRACE, ASM)
    task = _norm_phase(
        C, task, end_o, end_n1, Yo, Res, stride_r, NormO, Scale, H1, Sq_o, num_o, Sq_n1, SQ_COLS, Co, num_o,
        Cn1, H, eps, True, True, False, True, NCH, BLOCK_C, SQ_BLOCK, USE_PDL, ASM, GRAB,
    )  # fmt: skip
    _stamp(Trace, 3, task, TRACE, ASM)
    task = _norm_phase(  # the next norm
        C, task, end_n1, end_n1b, H1, H1, 0, NextO, NextO, X1, Sq_n1, NCH, Sq_n1, SQ_COLS, Cn1, chunks,
        Cn1b, H, eps, False, False, False, False, NCH, BLOCK_C, SQ_BLOCK, USE_PDL, ASM, GRAB,
    )  # fmt: skip
    _stamp(Trace, 4, task, TRACE, ASM)
    task = _gemm_phase(
        C, task, end_n1b, end_a, X1, H, Wgu, Wgu, 0, Inter, Cn1b, chunks, Ca, INTER, H, offs_m, m_mask, Sq, 0,
        1, False, 1, ACT, BLOCK_M, BN_A, BK_A, USE_DOT, UPCAST, DOT_PRECISION, USE_PDL, ASM, GRAB,
    )  # fmt: skip
    _stamp(Trace, 5, task, TRACE, ASM)
    task = _gemm_phase(
        C, task, end_a, end_b, Inter, INTER, Wd, Wd, 0, Yd, Ca, num_a, Cb, H, INTER, offs_m, m_mask, Sq_b,
        SQ_COLS, 1, True, 0, ACT, BLOCK_M, BN_B, BK_B, USE_DOT, UPCAST, DOT_PRECISION, USE_PDL, ASM, GRAB,
    )  # fmt: skip
    _stamp(Trace, 6, task, TRACE, ASM)
    if HAS_PLE:  # h2, the input of the PLE phases
        end_g = end_n2 + num_g
        end_p = end_g + num_p
        task = _norm_phase(
            C, task, end_b, end_n2, Yd, H1, H, NormF, Scale, H2, Sq_b, num_b, Sq_n2, SQ_COLS, Cb, num_b,
            Cn2, H, eps, True, False, False, False, NCH, BLOCK_C, SQ_BLOCK, USE_PDL, ASM, GRAB,
        )  # fmt: skip
        _stamp(Trace, 7, task, TRACE, ASM)
        task = _gemm_phase(
            C, task, end_n2, end_g, H2, H, Wpg, Pin, stride_p, G, Cn2, chunks, Cg, P, H, offs_m, m_mask, Sq,
            0, 1, False, 2, ACT, BLOCK_M, BN_G, BK_G, USE_DOT, UPCAST, DOT_PRECISION, USE_PDL, ASM, GRAB,
        )  # fmt: skip
        _stamp(Trace, 9, task, TRACE, ASM)
        task = _gemm_phase(
            C, task, end_g, end_p, G, P, Wpp, Wpp, 0, Yp, Cg, num_g, Cp, H, P, offs_m, m_mask, Sq_p, SQ_COLS,
            1, True, 0, ACT, BLOCK_M, BN_P, BK_P, USE_DOT, UPCAST, DOT_PRECISION, USE_PDL, ASM, GRAB,
        )  # fmt: skip
        _stamp(Trace, 10, task, TRACE, ASM)
        # the layer's outputs: h2 + the PLE projection's norm (n3, then n3b)
        first_out, y_out, res_out, norm_out, sq_in, tiles_in = end_p, Yp, H2, NormP, Sq_p, num_p
        sq_out, wait_out, done_out, done_next, slot_out = Sq_n3, Cp, Cn3, Cn3b, 11
    else:  # the layer's outputs: h1 + the down projection's norm (n2, then n2b)
        first_out, y_out, res_out, norm_out, sq_in, tiles_in = end_b, Yd, H1, NormF, Sq_b, num_b
        sq_out, wait_out, done_out, done_next, slot_out = Sq_n2, Cb, Cn2, Cn2b, 7
    end_out = first_out + chunks
    task = _norm_phase(
        C, task, first_out, end_out, y_out, res_out, H, norm_out, Scale, Out, sq_in, tiles_in, sq_out,
        SQ_COLS, wait_out, tiles_in, done_out, H, eps, True, False, HAS_SCALE, HAS_NEXT, NCH, BLOCK_C,
        SQ_BLOCK, USE_PDL, ASM, GRAB,
    )  # fmt: skip
    _stamp(Trace, slot_out, task, TRACE, ASM)
    if HAS_NEXT:
        task = _norm_phase(  # the next norm
            C, task, end_out, end_out + chunks, Out, Out, 0, NextW, NextW, Out2, sq_out, NCH, sq_out, SQ_COLS,
            done_out, chunks, done_next, H, eps, False, False, False, False, NCH, BLOCK_C, SQ_BLOCK, USE_PDL,
            ASM, GRAB,
        )  # fmt: skip
        _stamp(Trace, slot_out + 1, task, TRACE, ASM)
    # Every program has taken its last ticket before it counts itself out: the last one resets the counters.
    gone = tl.atomic_add(C + _GONE * _STRIDE, 1, sem="acq_rel")
    _stamp(Trace, _SLOTS - 1, task + gone * 0, TRACE, ASM)  # (after the count: the clock read waits for it)
    if gone == tl.num_programs(0) - 1:
        for k in tl.static_range(_COUNTERS):
            tl.atomic_xchg(C + k * _STRIDE, 0)


_decode_tail = DualKernel(_decode_tail_fn)


@dataclass(frozen=True)
class TailWeights:
    """A dense layer's weights after attention, as the model holds them after ``fuse_projections``:
    ``o`` [H, Q], ``gate_up`` [2I, H] ([gate; up] stacked), ``down`` [H, I], contiguous; the norms (post-
    attention, pre- and post-feed-forward) by their weights [H]."""

    o: torch.Tensor
    post_attn_norm: torch.Tensor
    pre_ff_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    post_ff_norm: torch.Tensor


@dataclass(frozen=True)
class PerLayerInput:
    """The PLE end of an E-type layer: ``gate`` [P, H] and ``proj`` [H, P] weights, the layer's per-layer
    input [M, P] (unit last stride), and ``post_norm``, the post-per-layer-input norm's weight."""

    gate: torch.Tensor
    proj: torch.Tensor
    inputs: torch.Tensor
    post_norm: torch.Tensor


def decode_tail_config(m: int, h: int, q: int, i: int, p: int) -> dict[str, int]:
    """Tiles and grid. One row: elementwise products (no tensor cores at M = 1), each tile summed over K at
    once; 512-column K tiles (1,024 for the PLE gate) of 2 (gate/up, the PLE phases) or 4 weight rows, 4
    warps. ptxas (sm_90a, e4b's sliding tail) gives that 64 registers a thread, so 8 programs fit an SM,
    each with its current and next tiles in flight (8 KB): ~64 KB of weights in flight per SM, what the
    separate GEMVs (32-48 registers, 10-16 programs per SM) keep. ``max_registers`` holds it to 64 where
    another Triton takes more (the H100's 3.6 build: 6 programs an SM ran at once without it, all 8 with
    it). The previous default (8 warps, [4-8, 1024] tiles, the PLE projection in 16-row tiles, fp32
    products kept per element) took ~250 registers: one program per SM streamed 1.4 TB/s on an H200 where
    the separate launches streamed 3.3. More rows: 16-row tensor-core tiles of 32 columns (16 for the PLE
    gate's narrow N), two programs per SM at 4 warps (167 registers). Norms in chunks of 512 columns (5
    tasks a row at E4B's 2,560). Starting points for ``bench/decode_tail.py --sweep`` on a GPU."""

    def k_tile(k: int, most: int) -> int:
        return min(most, max(16, next_pow2(k)))

    if m == 1:
        return {
            "norm_cols": NORM_COLS,
            "bn_o": 4,
            "bk_o": k_tile(q, 512),
            "bn_a": 2,
            "bk_a": k_tile(h, 512),
            "bn_b": 4,
            "bk_b": k_tile(i, 512),
            "bn_g": 2,
            "bk_g": k_tile(h, 1024),
            "bn_p": 2,
            "bk_p": k_tile(p, 512),
            "num_warps": 4,
            "programs_per_sm": 8,
            "max_registers": 64,
        }
    return {
        "norm_cols": NORM_COLS,
        "bn_o": 32,
        "bk_o": k_tile(q, 128),
        "bn_a": 32,
        "bk_a": k_tile(h, 128),
        "bn_b": 32,
        "bk_b": k_tile(i, 128),
        "bn_g": 16,
        "bk_g": k_tile(h, 128),
        "bn_p": 32,
        "bk_p": k_tile(p, 128),
        "num_warps": 4,
        "programs_per_sm": 2,
    }


def new_counters(device: torch.device | str) -> torch.Tensor:
    """A call site's counter buffer (``COUNTERS`` counters ``COUNTER_STRIDE`` apart): zeros, and zeros again
    after every launch."""
    return torch.zeros(COUNTERS * COUNTER_STRIDE, dtype=torch.int32, device=device)


def default_programs(config: dict[str, int], device: torch.device) -> int:
    """The grid ``decode_tail`` launches at most with ``config``: ``programs_per_sm`` on every SM of a CUDA
    device, 3 in the interpreter (so that several programs share the tickets)."""
    return 3 if device.type == "cpu" else config["programs_per_sm"] * sm_count(device.index or 0)


def new_trace(programs: int, device: torch.device | str) -> torch.Tensor:
    """A buffer for ``decode_tail(trace=...)``: [programs, TRACE_SLOTS, 2] int64, -1 where nothing was
    written."""
    return torch.full((programs, TRACE_SLOTS, 2), -1, dtype=torch.int64, device=device)


def decode_tail(
    attn: torch.Tensor,
    residual: torch.Tensor,
    weights: TailWeights,
    eps: float,
    activation: str,
    counters: torch.Tensor,
    ple: PerLayerInput | None = None,
    scale: torch.Tensor | None = None,
    next_norm: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
    programs: int | None = None,
    trace: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A dense layer's tail for ``attn`` [M, Q] (the attention output before ``o_proj``, M <= 8) and the
    layer input ``residual`` [M, H] -> (the layer's output, ``rms_norm(output, next_norm)`` or None), as
    ``decode_tail_reference`` computes them. The weights are never written by the kernel just before this
    one (their first tiles are read before the PDL wait). ``counters``:
    ``new_counters``, used by one call site at a time. ``programs``: the grid (default: by SM count on CUDA,
    3 in the interpreter so that several programs share the tickets). ``trace`` (a diagnostic,
    ``new_trace``): each program's records (``TRACE_SLOTS``) are written to its row."""
    m, q = attn.shape
    w = weights
    h, i = w.down.shape
    p = ple.gate.shape[0] if ple is not None else 0
    assert (
        0 < m <= MAX_ROWS and attn.stride(-1) == 1 and residual.shape == (m, h) and residual.stride(-1) == 1
    )
    assert w.o.shape == (h, q) and w.gate_up.shape == (2 * i, h)
    matrices = [w.o, w.gate_up, w.down]
    if ple is not None:
        assert ple.gate.shape == (p, h) and ple.proj.shape == (h, p) and ple.inputs.shape == (m, p)
        assert ple.inputs.stride(-1) == 1
        matrices += [ple.gate, ple.proj]
    assert all(t.is_contiguous() for t in matrices)
    assert counters.dtype == torch.int32 and counters.numel() == COUNTERS * COUNTER_STRIDE
    assert counters.device == attn.device
    cfg = config or decode_tail_config(m, h, q, i, p)

    def buffer(cols: int) -> torch.Tensor:
        return torch.empty((m, cols), dtype=attn.dtype, device=attn.device)

    yo, h1, x1, inter, yd, out = buffer(h), buffer(h), buffer(h), buffer(i), buffer(h), buffer(h)
    h2, g, yp = (buffer(h), buffer(p), buffer(h)) if ple is not None else (out, out, out)
    out2 = buffer(h) if next_norm is not None else out
    use_dot = m > 1
    upcast, precision = dot_settings(attn.dtype, attn.device)
    block_c = min(cfg.get("norm_cols", NORM_COLS), next_pow2(h))
    nch = -(-h // block_c)  # a norm phase's chunks a row
    tiles = [-(-h // cfg[key]) for key in ("bn_o", "bn_b", "bn_p")]  # the GEMMs that feed a norm
    sq_cols = max(*tiles, nch)
    sq = torch.empty(6 * m * sq_cols, dtype=torch.float32, device=attn.device)
    norm_phases = 3 + (next_norm is not None)  # n1, n1b, n2 (and n2b or n3b), n3 with PLE
    total = tiles[0] + -(-i // cfg["bn_a"]) + tiles[1] + (norm_phases + (ple is not None)) * m * nch
    if ple is not None:
        total += -(-p // cfg["bn_g"]) + tiles[2]
    if programs is None:
        programs = default_programs(cfg, attn.device)
    grid = max(1, min(programs, total))
    if trace is not None:
        assert trace.dtype == torch.int64 and trace.shape[0] >= grid and trace.shape[1:] == (TRACE_SLOTS, 2)
        assert trace.is_contiguous() and trace.device == attn.device
    some = w.post_ff_norm  # a valid pointer for the operands a variant does not read
    _decode_tail[attn.device][(grid,)](
        attn,
        residual,
        w.o,
        w.post_attn_norm,
        w.pre_ff_norm,
        w.gate_up,
        w.down,
        w.post_ff_norm,
        ple.gate if ple is not None else some,
        ple.inputs if ple is not None else some,
        ple.proj if ple is not None else some,
        ple.post_norm if ple is not None else some,
        next_norm if next_norm is not None else some,
        scale if scale is not None else some,
        yo,
        h1,
        x1,
        inter,
        yd,
        h2,
        g,
        yp,
        out,
        out2,
        sq,
        counters,
        trace if trace is not None else counters,
        m,
        h,
        q,
        i,
        max(p, 1),
        eps,
        attn.stride(0),
        residual.stride(0),
        ple.inputs.stride(0) if ple is not None else 0,
        sq_cols,
        BLOCK_M=16 if use_dot else 1,
        BN_O=cfg["bn_o"],
        BK_O=cfg["bk_o"],
        BN_A=cfg["bn_a"],
        BK_A=cfg["bk_a"],
        BN_B=cfg["bn_b"],
        BK_B=cfg["bk_b"],
        BN_G=cfg["bn_g"],
        BK_G=cfg["bk_g"],
        BN_P=cfg["bn_p"],
        BK_P=cfg["bk_p"],
        NCH=nch,
        BLOCK_C=block_c,
        SQ_BLOCK=min(1024, next_pow2(sq_cols)),
        ACT=_KINDS[activation],
        HAS_PLE=ple is not None,
        HAS_SCALE=scale is not None,
        HAS_NEXT=next_norm is not None,
        USE_DOT=use_dot,
        UPCAST=upcast,
        DOT_PRECISION=precision,
        **pdl(attn.device, m),
        ASM=attn.device.type == "cuda",
        GRAB=cfg.get("grab", 1),
        TRACE=trace is not None,
        num_warps=cfg["num_warps"],
        num_stages=1,
        **({"maxnreg": cfg["max_registers"]} if cfg.get("max_registers") else {}),
    )
    return out, (out2 if next_norm is not None else None)


def decode_tail_reference(
    attn: torch.Tensor,
    residual: torch.Tensor,
    weights: TailWeights,
    eps: float,
    activation: str,
    ple: PerLayerInput | None = None,
    scale: torch.Tensor | None = None,
    next_norm: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The separate ops the model runs without the kernel (``DecoderLayer.forward`` after attention)."""
    w = weights
    h1, x1 = fused_rms_norm_reference(
        F.linear(attn, w.o), w.post_attn_norm, eps, residual=residual, next_weight=w.pre_ff_norm
    )
    y = F.linear(skinny_matmul_reference(x1, w.gate_up, GATE_UP, activation), w.down)
    if ple is None:
        return fused_rms_norm_reference(
            y, w.post_ff_norm, eps, residual=h1, scale=scale, next_weight=next_norm
        )
    h2, _ = fused_rms_norm_reference(y, w.post_ff_norm, eps, residual=h1)
    gate = skinny_matmul_reference(h2, ple.gate, MUL, activation, ple.inputs)
    return fused_rms_norm_reference(
        F.linear(gate, ple.proj), ple.post_norm, eps, residual=h2, scale=scale, next_weight=next_norm
    )


__all__ = [
    "COUNTERS",
    "COUNTER_STRIDE",
    "TRACE_PHASES",
    "TRACE_SLOTS",
    "PerLayerInput",
    "TailWeights",
    "decode_tail",
    "decode_tail_config",
    "decode_tail_reference",
    "default_programs",
    "new_counters",
    "new_trace",
]
