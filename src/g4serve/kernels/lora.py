"""Batched multi-adapter LoRA (Punica / S-LoRA style): ``y[t] += (x[t] @ A[s].T) @ B[s].T`` with
``s = token_slots[t]`` for every token of a flat batch at once, as two Triton kernels (shrink, expand),
and the torch reference (a loop over slots).

Why this shape:
- The launch grids depend on shapes only (T, S, N, R, K), never on the slot values: every (row block,
  slot) pair gets a program, which returns at once when none of its rows uses its slot. No host sync, no
  sort or ``unique`` of the slots, so one captured CUDA graph serves any mix of adapters per step.
- Shrink splits K: at decode sizes there are only S programs per 16-row block, and one SM streaming a
  whole [R, K] adapter (K=10240 for a down projection) is the slowest part of the op. Each K split
  writes its own fp32 partial ``[split, T, R_pad]`` (each row by the one program of its slot), and the
  expand sums the partials while loading them: deterministic, no atomics, no zeroing memset, no third
  kernel.
- The shrink result stays fp32 into the expand's ``tl.dot`` (B widened to fp32, exactly; ``tf32x3``
  products, see ``expand_precision``), so the only rounding is the final ``y + delta`` to y's dtype, as
  in the reference.
- Rows of other slots are masked out of every load and store, so programs never write the same element
  and rows with slot -1 keep their bits. The price: a row block holding k slots does its tile math k
  times. Decode blocks are 16 rows, so that is noise there; a prefill chunk is one run of one slot. A
  large batch with slots interleaved row by row pays it (H100, T=2048, R=64, 4 adapters: 2-2.7x the
  time of the same tokens in runs); sorting the tokens by slot once per step would remove it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton.language as tl

from g4serve.kernels._launch import DualKernel, dot_settings, next_pow2, pdl, wait_for_previous_kernel
from g4serve.kernels.fused_moe import _round_to

# Token rows up to which the decode tiles (16-row blocks, the smallest tl.dot M) are used.
DECODE_MAX_ROWS = 64
# Shrink programs per slot at decode sizes (K splits x row blocks), and the least K one split covers.
# From bench/lora_kernel.py --sweep on an H100 (R=64, 4 adapters): 256-wide splits for q at T=1 (10
# programs), 512 for down (20); at T=64, 512 and 1024-2048. More, narrower splits lose to the expand's
# summing of the partials; fewer leave one SM streaming too much of the adapter.
DECODE_SHRINK_PROGRAMS = 24
DECODE_MIN_SPLIT_K = 256
# Prefill: row blocks spread the work already; 2-4 splits of >= 1280 (T=2048: q 1280, down 2560-5120).
PREFILL_SHRINK_PROGRAMS = 64
PREFILL_MIN_SPLIT_K = 1280


@dataclass(frozen=True)
class LoraTiles:
    shrink_block_m: int  # token rows per shrink program
    block_k: int  # K step of the shrink loop
    k_per_split: int  # K covered by one shrink program (a multiple of block_k)
    shrink_warps: int
    shrink_stages: int
    expand_block_m: int  # token rows per expand program
    block_n: int  # output columns per expand program
    expand_warps: int


def lora_tiles(num_tokens: int, n: int, k: int) -> LoraTiles:
    """Tiles per shape (bench/lora_kernel.py --sweep, H100, bf16). Decode (T <= 64): 16-row blocks, K split
    into ~``DECODE_SHRINK_PROGRAMS`` shrink programs per slot, 128-column expand tiles. Prefill: 64-row
    blocks, 2-4 K splits, 64 x 128 expand tiles (larger tiles spilled: 2-7x slower in the sweep)."""
    if num_tokens <= DECODE_MAX_ROWS:
        block_m, programs, min_split = 16, DECODE_SHRINK_PROGRAMS, DECODE_MIN_SPLIT_K
    else:
        block_m, programs, min_split = 64, PREFILL_SHRINK_PROGRAMS, PREFILL_MIN_SPLIT_K
    m_blocks = -(-num_tokens // block_m)
    splits = max(1, min(-(-k // min_split), -(-programs // m_blocks)))
    block_k = 128
    k_per_split = -(-(-(-k // splits)) // block_k) * block_k
    return LoraTiles(block_m, block_k, k_per_split, 4, 2 if block_m == 16 else 3, block_m, 128, 4)


def _lora_shrink_fn(
    X,
    A,
    Slots,
    Partial,
    T,
    K,
    R,
    k_per_split,
    stride_xm,
    stride_as,
    stride_ar,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Partial[split, rows] = x[rows, K chunk] @ A[slot, :, K chunk].T for this block's rows of ``slot``."""
    wait_for_previous_kernel(USE_PDL)
    pid_m = tl.program_id(0)
    slot = tl.program_id(1)
    split = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    hit = tl.load(Slots + rows, mask=rows < T, other=-1) == slot
    if tl.max(hit.to(tl.int32), 0) == 0:
        return
    rows64 = rows.to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    k_start = split * k_per_split
    offs_k = k_start + tl.arange(0, BLOCK_K)
    x_ptrs = X + rows64[:, None] * stride_xm + offs_k[None, :]
    a_ptrs = A + slot.to(tl.int64) * stride_as + offs_r[None, :] * stride_ar + offs_k[:, None]
    r_ok = offs_r < R
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for k0 in range(0, k_per_split, BLOCK_K):
        if EVEN_K:
            x_mask = hit[:, None]
            a_mask = r_ok[None, :]
        else:
            k_ok = offs_k + k0 < K
            x_mask = hit[:, None] & k_ok[None, :]
            a_mask = k_ok[:, None] & r_ok[None, :]
        x = tl.load(x_ptrs, mask=x_mask, other=0.0)
        a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
            a = a.to(tl.float32)
        acc = tl.dot(x, a, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    # the padded rank columns hold zeros (A masked), so the expand may read all BLOCK_R of them
    p_ptrs = Partial + (split * T + rows64)[:, None] * BLOCK_R + offs_r[None, :]
    tl.store(p_ptrs, acc, mask=hit[:, None])


def _lora_expand_fn(
    Y,
    B,
    Slots,
    Partial,
    T,
    N,
    R,
    stride_ym,
    stride_bs,
    stride_bn,
    num_splits,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """y[rows, cols] += sum_split(Partial[split, rows]) @ B[slot, cols].T for the block's rows of ``slot``.

    Only the partials come from the previous kernel (the shrink, whose every program had waited for the
    kernel before it): under programmatic dependent launch the slots, B and y are read before waiting."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    hit = tl.load(Slots + rows, mask=rows < T, other=-1) == slot
    if tl.max(hit.to(tl.int32), 0) == 0:
        return
    rows64 = rows.to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    b_ptrs = B + slot.to(tl.int64) * stride_bs + cols[None, :].to(tl.int64) * stride_bn + offs_r[:, None]
    b = tl.load(b_ptrs, mask=(offs_r < R)[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    y_ptrs = Y + rows64[:, None] * stride_ym + cols[None, :]
    y_mask = hit[:, None] & col_ok[None, :]
    y = tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
    wait_for_previous_kernel(USE_PDL)
    # unrolled by 4: that many splits' loads in flight at once (fully unrolled, the 40 splits of a down
    # projection at T=1 ran 1.5x slower on an H100)
    p_ptrs = Partial + rows64[:, None] * BLOCK_R + offs_r[None, :]
    shrink = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for _ in tl.range(0, num_splits, loop_unroll_factor=4):
        shrink += tl.load(p_ptrs, mask=hit[:, None], other=0.0)
        p_ptrs += T * BLOCK_R
    delta = tl.dot(shrink, b, input_precision=DOT_PRECISION)
    # rounded once, to nearest even (_round_to: the interpreter's own bf16 cast truncates)
    out = _round_to(y + delta, Y.dtype.element_ty).to(Y.dtype.element_ty)
    tl.store(y_ptrs, out, mask=y_mask)


_lora_shrink = DualKernel(_lora_shrink_fn)
_lora_expand = DualKernel(_lora_expand_fn)


def expand_precision(dtype: torch.dtype, device: torch.device) -> str:
    """``tl.dot`` precision of the expand's fp32 shrink x fp32-widened B. 16-bit B is exact in TF32, so
    ``tf32x3`` (the shrink split into two TF32 parts) gives fp32 accuracy on the tensor cores: on an H100
    as many outputs off by a bf16 step from the fp32 reference as IEEE products, at up to 5x their speed
    (IEEE FMAs made the expand 85% of the op at T=2048, R=64). fp32 models keep IEEE products."""
    if device.type == "cpu" or dtype == torch.float32:
        return "ieee"
    return "tf32x3"


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    a_stack: torch.Tensor,
    b_stack: torch.Tensor,
    token_slots: torch.Tensor,
    tiles: LoraTiles | None = None,
) -> None:
    """``y[t] += (x[t] @ a_stack[s].T) @ b_stack[s].T`` in place for ``s = token_slots[t] >= 0``.

    x [T, K] and y [T, N] (may be a column slice of a wider tensor) with unit column strides, same dtype;
    a_stack [S, R, K], b_stack [S, N, R] (rank padded with zeros, scale folded into B); token_slots [T]
    int32/int64 in [-1, S). fp32 accumulation, the [T, R] shrink kept in fp32, y rounded once.
    Capturable in a CUDA graph (the grids depend on shapes only). ``tiles`` overrides ``lora_tiles``.
    """
    num_tokens, k = x.shape
    num_slots, rank, _ = a_stack.shape
    n = y.shape[1]
    assert y.shape[0] == num_tokens and a_stack.shape[2] == k and b_stack.shape == (num_slots, n, rank)
    assert x.stride(1) == 1 and y.stride(1) == 1 and a_stack.stride(2) == 1 and b_stack.stride(2) == 1
    assert y.dtype == x.dtype and token_slots.shape == (num_tokens,)
    if num_tokens == 0 or num_slots == 0 or rank == 0:
        return
    slots = token_slots.contiguous()
    cfg = tiles or lora_tiles(num_tokens, n, k)
    partial = lora_shrink(x, a_stack, slots, cfg)
    lora_expand(y, partial, b_stack, slots, cfg)


def lora_shrink(x: torch.Tensor, a_stack: torch.Tensor, slots: torch.Tensor, cfg: LoraTiles) -> torch.Tensor:
    """The first kernel: fp32 partials [splits, T, R_pad] of x @ A[slot].T (rows of slot -1 unwritten)."""
    num_tokens, k = x.shape
    num_slots, rank, _ = a_stack.shape
    block_r = max(16, next_pow2(rank))
    splits = -(-k // cfg.k_per_split)
    partial = torch.empty(splits, num_tokens, block_r, dtype=torch.float32, device=x.device)
    upcast, precision = dot_settings(x.dtype, x.device)
    _lora_shrink[x.device][(-(-num_tokens // cfg.shrink_block_m), num_slots, splits)](
        x,
        a_stack,
        slots,
        partial,
        num_tokens,
        k,
        rank,
        cfg.k_per_split,
        x.stride(0),
        a_stack.stride(0),
        a_stack.stride(1),
        BLOCK_M=cfg.shrink_block_m,
        BLOCK_R=block_r,
        BLOCK_K=cfg.block_k,
        EVEN_K=k % cfg.k_per_split == 0 and cfg.k_per_split % cfg.block_k == 0,
        UPCAST=upcast,
        DOT_PRECISION=precision,
        **pdl(x.device, num_tokens),
        num_warps=cfg.shrink_warps,
        num_stages=cfg.shrink_stages,
    )
    return partial


def lora_expand(
    y: torch.Tensor,
    partial: torch.Tensor,
    b_stack: torch.Tensor,
    slots: torch.Tensor,
    cfg: LoraTiles,
    precision: str | None = None,
) -> None:
    """The second kernel: y[rows] += sum(partial[:, rows]) @ B[slot].T, rounded once."""
    num_tokens, n = y.shape
    num_slots, _, rank = b_stack.shape
    if precision is None:
        precision = expand_precision(y.dtype, y.device)
    _lora_expand[y.device][(-(-num_tokens // cfg.expand_block_m), -(-n // cfg.block_n), num_slots)](
        y,
        b_stack,
        slots,
        partial,
        num_tokens,
        n,
        rank,
        y.stride(0),
        b_stack.stride(0),
        b_stack.stride(1),
        partial.shape[0],
        BLOCK_M=cfg.expand_block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_R=partial.shape[2],
        DOT_PRECISION=precision,
        **pdl(y.device, num_tokens),
        num_warps=cfg.expand_warps,
        num_stages=1,
    )


def add_lora_reference(
    y: torch.Tensor,
    x: torch.Tensor,
    a_stack: torch.Tensor,
    b_stack: torch.Tensor,
    token_slots: torch.Tensor,
) -> None:
    """``add_lora`` as a loop over slots with boolean row selection, in fp32 (syncs: not capturable)."""
    slots = token_slots.to(device=y.device, dtype=torch.int64)
    for s in range(a_stack.shape[0]):
        rows = slots == s
        if not bool(rows.any()):
            continue
        shrink = x[rows].float() @ a_stack[s].float().T
        delta = shrink @ b_stack[s].float().T
        y[rows] = (y[rows].float() + delta).to(y.dtype)


__all__ = [
    "LoraTiles",
    "add_lora",
    "add_lora_reference",
    "expand_precision",
    "lora_expand",
    "lora_shrink",
    "lora_tiles",
]
