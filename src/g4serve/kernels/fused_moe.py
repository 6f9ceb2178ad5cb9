"""Routed MoE experts as two grouped GEMMs in Triton (gate/up with the gated activation fused, then down
× routing weight), the fixed-shape alignment that feeds them, and the torch reference (per-expert loop).

No step of ``fused_moe`` reads a device value on the host, so a whole MoE layer can be graph-captured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from g4serve.kernels._launch import DualKernel, dot_settings, next_pow2
from g4serve.kernels.act_mul import ACTIVATIONS

GELU_TANH, SILU = 0, 1
_KINDS = {"gelu_pytorch_tanh": GELU_TANH, "gelu_tanh": GELU_TANH, "silu": SILU, "swish": SILU}

# Tokens per launch pair: bounds the [T*k, H] staging buffer (T=4096, k=8, H=2816 bf16: 185 MB) while
# leaving enough tokens per expert that the GEMMs stay compute-bound.
CHUNK_TOKENS = 4096
# Up to this many assignments (T*k) the single-program align kernel runs: at decode sizes one launch beats
# the ~25 small launches of the torch ops; its loops are serial in T*k, so prefill-sized steps take the
# torch ops (bench/moe_kernels.py times both: align_kernel_ms / align_torch_ms).
ALIGN_KERNEL_MAX_ASSIGNMENTS = 4096


@dataclass(frozen=True)
class GemmTiles:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class MoETiles:
    """``block_m`` rows of one expert per program (shared by both GEMMs: one alignment feeds both)."""

    block_m: int
    gate_up: GemmTiles  # N = intermediate (gate and up tiles side by side), K = hidden
    down: GemmTiles  # N = hidden, K = intermediate


def moe_tiles(num_assignments: int, num_experts: int) -> MoETiles:
    """Tiles for H100 bf16 from the mean rows per expert (T*k / E; 26B-A4B decode at T <= 64: <= 4).

    Small batches are weight-bandwidth bound: the smallest ``tl.dot`` M (16) and narrow N tiles so that
    even 8 touched experts spread over >= 132 programs. Larger batches want taller tiles for reuse.
    """
    rows_per_expert = num_assignments / max(num_experts, 1)
    if rows_per_expert <= 8:
        return MoETiles(16, GemmTiles(32, 128, 4, 4), GemmTiles(64, 128, 4, 4))
    if rows_per_expert <= 32:
        return MoETiles(32, GemmTiles(64, 64, 4, 4), GemmTiles(64, 64, 4, 4))
    return MoETiles(64, GemmTiles(64, 64, 4, 3), GemmTiles(128, 64, 8, 3))


def moe_align(experts: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """experts [T, k] -> (sorted_ids [P] int32, block_expert [P // block_m] int32).

    ``sorted_ids`` lists the assignments ``t * k + j`` grouped by expert (token order within an expert),
    each expert's run padded to a multiple of ``block_m`` with the sentinel ``T * k``; block ``b`` covers
    ``sorted_ids[b * block_m : (b + 1) * block_m]``, all of expert ``block_expert[b]``, or -1 past the end.
    P depends on shapes only (every expert that can be hit may waste ``block_m - 1`` slots) and no op
    reads a device value back, so this is capturable in a CUDA graph.
    """
    flat = experts.reshape(-1).to(torch.int64)
    n = flat.numel()
    device = flat.device
    num_blocks = -(-(n + min(num_experts, n) * (block_m - 1)) // block_m)
    sorted_experts, order = torch.sort(flat, stable=True)
    # starts[e]: index of expert e's first assignment in sorted order (searchsorted, not bincount: bincount
    # sizes its output from the max value, a device sync).
    starts = torch.searchsorted(
        sorted_experts, torch.arange(num_experts + 1, device=device, dtype=flat.dtype)
    )
    counts = starts[1:] - starts[:-1]
    padded_ends = torch.cumsum((counts + block_m - 1) // block_m * block_m, 0)
    padded_starts = padded_ends - (counts + block_m - 1) // block_m * block_m
    # sorted position i of expert e goes to padded_starts[e] + (i - starts[e])
    shift = (padded_starts - starts[:-1])[sorted_experts]
    slots = shift + torch.arange(n, device=device)
    sorted_ids = torch.full((num_blocks * block_m,), n, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, slots, order.to(torch.int32))
    block_starts = torch.arange(num_blocks, device=device) * block_m
    # the expert whose padded run [padded_start, padded_end) holds the block (empty runs are skipped)
    block_expert = torch.searchsorted(padded_ends, block_starts, right=True)
    block_expert = torch.where(block_starts < padded_ends[-1:], block_expert, -1).to(torch.int32)
    return sorted_ids, block_expert


def _moe_align_fn(
    Experts,
    SortedIds,
    BlockExpert,
    n,
    num_slots,
    num_blocks,
    BLOCK_M: tl.constexpr,
    E_BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
    FILL: tl.constexpr,
):
    """``moe_align`` in one program (one launch instead of ~25 small torch ops; decode sizes).

    Pass 1 counts assignments per expert (one-hot rows of CHUNK assignments); the padded runs follow by a
    cumsum. Pass 2 places each assignment at its expert's next free slot, in token order: its rank among
    same-expert assignments earlier in the chunk is a column cumsum of the one-hot tile.
    """
    e_ids = tl.arange(0, E_BLOCK)
    lanes = tl.arange(0, CHUNK)
    counts = tl.zeros([E_BLOCK], tl.int32)
    for start in range(0, n, CHUNK):
        ex = tl.load(Experts + start + lanes, mask=start + lanes < n, other=-1)
        counts += tl.sum((ex[:, None] == e_ids[None, :]).to(tl.int32), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_ends = tl.cumsum(padded, 0)
    padded_starts = padded_ends - padded
    total = tl.sum(padded, 0)

    # The sentinel n in each run's padding and in every slot past the last run (disjoint from pass 2's
    # slots, so no ordering between the stores is needed).
    pad_slots = (padded_starts + counts)[:, None] + tl.arange(0, BLOCK_M)[None, :]
    tl.store(SortedIds + pad_slots, tl.zeros_like(pad_slots) + n, mask=pad_slots < padded_ends[:, None])
    for s0 in range(0, num_slots, FILL):
        slots = s0 + tl.arange(0, FILL)
        tl.store(SortedIds + slots, tl.zeros_like(slots) + n, mask=(slots >= total) & (slots < num_slots))
    # Block b belongs to the expert whose run holds slot b * BLOCK_M: the number of runs ending at or
    # before it (empty runs end where the previous one does, so they are skipped).
    for b0 in range(0, num_blocks, CHUNK):
        blocks = b0 + lanes
        first = blocks * BLOCK_M
        owner = tl.sum((padded_ends[None, :] <= first[:, None]).to(tl.int32), 1)
        tl.store(BlockExpert + blocks, tl.where(first < total, owner, -1), mask=blocks < num_blocks)

    next_slot = padded_starts
    for start in range(0, n, CHUNK):
        ids = start + lanes
        ex = tl.load(Experts + ids, mask=ids < n, other=-1)
        hit = (ex[:, None] == e_ids[None, :]).to(tl.int32)
        earlier = tl.cumsum(hit, 0) - hit
        slot = tl.sum(hit * (earlier + next_slot[None, :]), 1)
        tl.store(SortedIds + slot, ids, mask=ids < n)
        next_slot += tl.sum(hit, 0)


_moe_align = DualKernel(_moe_align_fn)


def moe_align_kernel(
    experts: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``moe_align`` as one Triton program: the same outputs, bit for bit."""
    flat = experts.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    n = flat.numel()
    num_blocks = -(-(n + min(num_experts, n) * (block_m - 1)) // block_m)
    sorted_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=flat.device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=flat.device)
    if n:
        e_block = next_pow2(max(num_experts, 16))
        # the one-hot tile is CHUNK x E_BLOCK: ~32 int32 per thread at 8 warps
        chunk = max(16, min(next_pow2(n), 8192 // e_block))
        _moe_align[flat.device][(1,)](
            flat,
            sorted_ids,
            block_expert,
            n,
            sorted_ids.shape[0],
            num_blocks,
            BLOCK_M=block_m,
            E_BLOCK=e_block,
            CHUNK=chunk,
            FILL=1024,
            num_warps=8,
        )
    return sorted_ids, block_expert


@triton.jit
def _round_to(x, dtype: tl.constexpr):
    """fp32 x rounded to ``dtype`` (round to nearest even), returned as fp32.

    bf16 by bit arithmetic: the same as the GPU's conversion, and also right in Triton's interpreter, whose
    fp32 -> bf16 cast truncates (a bias of half a bf16 step per rounding).
    """
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dtype).to(tl.float32)


def _moe_gemm_fn(
    A,
    W,
    Out,
    SortedIds,
    BlockExpert,
    RouteWeights,
    N,
    K,
    num_assignments,
    gate_offset,
    stride_am,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    A_ROW_DIV: tl.constexpr,
    GATED: tl.constexpr,
    ACT: tl.constexpr,
    ROUTE_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Out[id, cols] = A[id // A_ROW_DIV] @ W[expert, cols].T for the BLOCK_M assignment ids of one block.

    GATED: W rows [cols] are the gate and [gate_offset + cols] the up projection; the epilogue stores
    ``act(gate) * up``. ROUTE_WEIGHT: rows are scaled by RouteWeights[id]. Rounding follows the unfused
    model: each projection to Out's dtype, then the activation, then the product (or the weight scaling).
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(BlockExpert + pid_m).to(tl.int64)
    if expert < 0:  # a block past the last expert's padded run: fixed grids over-provision
        return
    ids = tl.load(SortedIds + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = ids < num_assignments
    rows = tl.where(valid, ids // A_ROW_DIV, 0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A + rows[:, None] * stride_am + offs_k[None, :]
    w_ptrs = W + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
    up_ptrs = w_ptrs + gate_offset * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a_mask = valid[:, None]
            w_mask = col_ok[None, :]
        else:
            k_ok = offs_k < K - k0
            a_mask = valid[:, None] & k_ok[None, :]
            w_mask = k_ok[:, None] & col_ok[None, :]
        a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        if GATED:
            u = tl.load(up_ptrs, mask=w_mask, other=0.0)
            if UPCAST:
                u = u.to(tl.float32)
            acc_up = tl.dot(a, u, acc_up, input_precision=DOT_PRECISION)
            up_ptrs += BLOCK_K * stride_wk
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk

    y = _round_to(acc, Out.dtype.element_ty)
    if GATED:
        # as kernels/act_mul.py: 0.5 g (1 + tanh(z)) = g sigmoid(2z); the activation rounded before the
        # product
        if ACT == 0:
            z = 0.7978845608028654 * (y + 0.044715 * y * y * y)
            g = y * tl.sigmoid(2.0 * z)
        else:
            g = y * tl.sigmoid(y)
        y = _round_to(g, Out.dtype.element_ty) * _round_to(acc_up, Out.dtype.element_ty)
    if ROUTE_WEIGHT:
        y = y * tl.load(RouteWeights + ids, mask=valid, other=0.0)[:, None]
    out_ptrs = Out + ids[:, None].to(tl.int64) * stride_om + cols[None, :]
    # rounded first, the cast in the store is exact
    tl.store(
        out_ptrs,
        _round_to(y, Out.dtype.element_ty).to(Out.dtype.element_ty),
        mask=valid[:, None] & col_ok[None, :],
    )


_moe_gemm = DualKernel(_moe_gemm_fn)


def _grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    n: int,
    sorted_ids: torch.Tensor,
    block_expert: torch.Tensor,
    block_m: int,
    tiles: GemmTiles,
    *,
    a_row_div: int,
    activation: str | None = None,
    route_weights: torch.Tensor | None = None,
) -> None:
    k = w.shape[2]
    assert a.stride(-1) == 1 and w.stride(-1) == 1 and out.stride(-1) == 1
    upcast, precision = dot_settings(a.dtype, a.device)
    grid = (block_expert.shape[0], -(-n // tiles.block_n))
    _moe_gemm[a.device][grid](
        a,
        w,
        out,
        sorted_ids,
        block_expert,
        route_weights if route_weights is not None else a,
        n,
        k,
        out.shape[0],
        n if activation else 0,  # out has one row per assignment: T*k is the sentinel
        a.stride(0),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        out.stride(0),
        A_ROW_DIV=a_row_div,
        GATED=activation is not None,
        ACT=_KINDS[activation] if activation else 0,
        ROUTE_WEIGHT=route_weights is not None,
        BLOCK_M=block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        EVEN_K=k % tiles.block_k == 0,
        UPCAST=upcast,
        DOT_PRECISION=precision,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )


def fused_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    activation: str,
    tiles: MoETiles | None = None,
    align_kernel_max: int = ALIGN_KERNEL_MAX_ASSIGNMENTS,
) -> torch.Tensor:
    """x [T, H]; gate_up [E, 2I, H] (gate rows, then up rows); down [E, H, I]; experts [T, k] ids;
    weights [T, k] fp32 -> [T, H] in x's dtype: ``sum_j weights[t, j] * expert_j(x[t])``.

    The k expert outputs of a token are summed in fp32 in slot order (deterministic), then rounded once.
    ``tiles`` overrides ``moe_tiles``; alignments of more than ``align_kernel_max`` assignments use the
    torch ops instead of the one-program kernel.
    """
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = gate_up.shape
    inter = two_inter // 2
    top_k = experts.shape[1]
    x = x.contiguous()
    weights = weights.to(torch.float32).contiguous()
    out = torch.empty_like(x)
    for start in range(0, num_tokens, CHUNK_TOKENS):
        stop = min(start + CHUNK_TOKENS, num_tokens)
        n = (stop - start) * top_k
        cfg = tiles or moe_tiles(n, num_experts)
        align = moe_align_kernel if n <= align_kernel_max else moe_align
        sorted_ids, block_expert = align(experts[start:stop], num_experts, cfg.block_m)
        hidden_act = torch.empty(n, inter, dtype=x.dtype, device=x.device)
        _grouped_gemm(
            x[start:stop],
            gate_up,
            hidden_act,
            inter,
            sorted_ids,
            block_expert,
            cfg.block_m,
            cfg.gate_up,
            a_row_div=top_k,
            activation=activation,
        )
        per_slot = torch.empty(n, hidden, dtype=x.dtype, device=x.device)
        _grouped_gemm(
            hidden_act,
            down,
            per_slot,
            hidden,
            sorted_ids,
            block_expert,
            cfg.block_m,
            cfg.down,
            a_row_div=1,
            route_weights=weights[start:stop].reshape(-1),
        )
        out[start:stop] = per_slot.view(stop - start, top_k, hidden).sum(1, dtype=torch.float32)
    return out


def fused_moe_reference(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    activation: str,
) -> torch.Tensor:
    """The model's expert loop (bit-exact with transformers); ``.tolist()`` syncs, so not capturable."""
    act = ACTIVATIONS[activation]
    out = torch.zeros_like(x)
    token_ids = torch.arange(x.shape[0], device=x.device).unsqueeze(1).expand_as(experts)
    for e in torch.unique(experts).tolist():
        hit = experts == e
        tokens = token_ids[hit]
        gate, up = torch.nn.functional.linear(x[tokens], gate_up[e]).chunk(2, dim=-1)
        y = torch.nn.functional.linear(act(gate) * up, down[e]) * weights[hit].unsqueeze(-1)
        out.index_add_(0, tokens, y.to(out.dtype))
    return out


__all__ = [
    "GemmTiles",
    "MoETiles",
    "fused_moe",
    "fused_moe_reference",
    "moe_align",
    "moe_align_kernel",
    "moe_tiles",
]
