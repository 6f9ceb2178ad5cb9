"""Routed MoE experts as two grouped GEMMs in Triton (gate/up with the gated activation fused, then down
× routing weight), the fixed-shape alignment that feeds them, and the torch reference (per-expert loop).

Expert weights are bf16/fp32 tensors, or ``QuantExpertWeights`` (FP8 e4m3 or compressed-tensors' packed
int4, scales per block, optional zero points) dequantized tile by tile in registers (``quant_matmul``'s
``_load_raw`` / ``_dequant``; int4 unpacked nibble plane by nibble plane), each tile rounded to the activation
dtype before ``tl.dot`` as the reference's dequantized weight (``dequantize_reference``) is.
No step of ``fused_moe`` reads a device value on the host, so a whole MoE layer can be graph-captured.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from g4serve import envs
from g4serve.kernels._launch import DualKernel, dot_settings, next_pow2
from g4serve.kernels.act_mul import ACTIVATIONS
from g4serve.kernels.fp8_matmul import (
    GROUP,
    fp8_matmul_supported,
    quantize_activation_groups,
    quantize_groups,
)
from g4serve.kernels.fp8_rows import quantize_rows_fp8, quantize_rows_reference
from g4serve.kernels.quant_matmul import (
    PLANES_FP32,
    _dequant,
    _groups_per_tile,
    _int4_products,
    _load_raw,
    _round_to,
    dequantize_reference,
    int4_block_k,
    int4_planes,
    int4_swap,
)

GELU_TANH, SILU = 0, 1
_KINDS = {"gelu_pytorch_tanh": GELU_TANH, "gelu_tanh": GELU_TANH, "silu": SILU, "swish": SILU}

# Tokens per launch pair: bounds the [T*k, H] staging buffer (T=4096, k=8, H=2816 bf16: 185 MB) while
# leaving enough tokens per expert that the GEMMs stay compute-bound.
CHUNK_TOKENS = 4096
# Up to this many assignments (T*k) the single-program align kernel runs: at the smallest decode sizes one
# launch beats the others; its loops are serial in T*k, so past that the three-launch kernel runs. On an H200
# at 26B-A4B (bench/moe_kernels.py, graph replays: align_k against align_p) the one program took 3.0 / 6.0 /
# 10.0 / 17.6 / 30.1 us at 8 / 64 / 128 / 256 / 512 assignments, the three launches 6.3 / 8.8 / 12.3 / 14.9 /
# 14.9.
ALIGN_KERNEL_MAX_ASSIGNMENTS = 128
# Past that: "parallel" (``moe_align_parallel``: three launches, no sort; the default) or "sort"
# (``moe_align``: torch's stable sort, ~15 launches), the same outputs. G4SERVE_MOE_ALIGN picks. On an H200
# at 26B-A4B (bench/moe_kernels.py, graph replays) the three launches took 14.9 / 17.6 / 30.4 / 53.2 us at
# 512 / 4,096 / 16,384 / 32,768 assignments, the sort 65.1 / 80.4 / 124.2 / 113.4.
PREFILL_ALIGN = envs.get("G4SERVE_MOE_ALIGN")
# FP8 experts at this many assignments (T*k) or more multiply on the FP8 tensor cores (W8A8: activations
# quantized per token and 128-column group, ``_w8a8_products``) instead of dequantizing the weight to bf16
# tiles; 0: never. G4SERVE_MOE_W8A8_MIN sets it. Default 1, always: on an H200 at 26B-A4B the W8A8 experts
# were 1.08-1.24x faster than the dequantizing ones from 1 to 4,096 tokens (bench/moe_kernels.py --quant fp8),
# a 2,048-token FP8 prefill took 47.9 ms against 53.0 and a B = 1 decode step 3.76 ms against 3.83
# (bench/engine_microbench.py). Its outputs differ from the dequantizing path's by the activations' e4m3
# rounding, about 4.4% of their norm on random weights, as FP8 checkpoints' dynamic activation schemes do.
W8A8_MIN_ASSIGNMENTS = envs.get_int("G4SERVE_MOE_W8A8_MIN")
# W8A8 experts whose scales are constant along K (FP8-Dynamic: per channel, or per tensor) quantize the
# activations per token, the scheme such checkpoints name, instead of per 128-column group: the products then
# accumulate across K on the tensor cores and the scales multiply the sums once, where the groups' scales
# made every K step's products wait to be scaled. G4SERVE_MOE_W8A8_ROWS=0 keeps the groups (A/B runs).
W8A8_ROWS = envs.get_int("G4SERVE_MOE_W8A8_ROWS") != 0


def _group_m_setting() -> int | None:
    """G4SERVE_MOE_GROUP_M as a tile order: None (unset or empty), else a count of blocks >= 0."""
    if envs.get("G4SERVE_MOE_GROUP_M") in (None, ""):
        return None
    group_m = envs.get_int("G4SERVE_MOE_GROUP_M")
    if group_m < 0:
        raise ValueError(f"G4SERVE_MOE_GROUP_M: expected a count of blocks >= 0, got {group_m}")
    return group_m


# The tile order of the prefill-sized GEMMs (``GemmTiles.group_m``; more than 32 rows per expert, where an
# expert has several blocks and each block several N tiles): G4SERVE_MOE_GROUP_M sets every one's; None
# (unset): ``moe_tiles``'s measured orders.
PREFILL_GROUP_M = _group_m_setting()


@dataclass(frozen=True)
class GemmTiles:
    """One grouped GEMM's tiles. ``group_m``: the order programs take tiles in. 0: every block's first N
    tile, then every block's second, ... (the 2-D grid, block fastest): a block's A rows are read once per N
    tile, the whole batch apart. G > 0: G consecutive blocks (one or a few experts) through all their N
    tiles before the next G, so each A tile and each expert's weight tile is read while the others that use
    it run beside it (L2), not again from HBM."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 0


@dataclass(frozen=True)
class MoETiles:
    """``block_m`` rows of one expert per program (shared by both GEMMs: one alignment feeds both)."""

    block_m: int
    gate_up: GemmTiles  # N = intermediate (gate and up tiles side by side), K = hidden
    down: GemmTiles  # N = hidden, K = intermediate

    def ordered(self, group_m: int) -> MoETiles:
        """These tiles with both GEMMs in the tile order ``group_m`` (``GemmTiles.group_m``)."""
        return MoETiles(
            self.block_m,
            dataclasses.replace(self.gate_up, group_m=group_m),
            dataclasses.replace(self.down, group_m=group_m),
        )


@dataclass(frozen=True)
class QuantExpertWeights:
    """One stacked projection of every expert, quantized (``quant_matmul``'s layout with an expert dim).

    ``weight``: float8_e4m3fn [E, N, K] or int32 [E, N, ceil(K / 8)] (compressed-tensors' packing: nibble i of
    word j is element 8j + i, stored as q + 8). The N rows are ``parts`` equal parts (gate_up: 2, gate rows
    then up rows), each on its own scale grid, as the checkpoint stores each projection: ``scale``
    [E, parts * ceil(N / parts / bn), ceil(K / bk)] for ``scale_block`` = (bn, bk) (per tensor: one part's
    whole shape), so blocks that do not tile a part's rows (128-row blocks, I = 704) stay exact.
    ``zero_point``: int8 [E, N, ceil(K / bk)] (asymmetric int4)."""

    weight: torch.Tensor
    scale: torch.Tensor
    scale_block: tuple[int, int]
    in_features: int
    zero_point: torch.Tensor | None = None
    parts: int = 1

    @property
    def shape(self) -> tuple[int, int, int]:
        """(E, N, K) of the dense weight."""
        return (self.weight.shape[0], self.weight.shape[1], self.in_features)


def dequantize_expert(w: QuantExpertWeights, expert: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert ``expert``'s dense [N, K] weight in ``dtype``: each part by ``dequantize_reference``."""
    rows, scale_rows = w.weight.shape[1] // w.parts, w.scale.shape[1] // w.parts
    parts = [
        dequantize_reference(
            w.weight[expert, p * rows : (p + 1) * rows],
            w.scale[expert, p * scale_rows : (p + 1) * scale_rows],
            w.scale_block,
            w.in_features,
            None if w.zero_point is None else w.zero_point[expert, p * rows : (p + 1) * rows],
            dtype,
        )
        for p in range(w.parts)
    ]
    return torch.cat(parts)


def moe_tiles(num_assignments: int, num_experts: int, quantized: bool = False, itemsize: int = 2) -> MoETiles:
    """Tiles for Hopper bf16 from the mean rows per expert (T*k / E; 26B-A4B decode at T <= 64: <= 4).

    Small batches are weight-bandwidth bound: the smallest ``tl.dot`` M (16) and narrow N tiles so that
    even 8 touched experts spread over >= 132 programs. Larger batches want taller tiles for reuse. Past 64
    rows per expert (26B-A4B prefill chunks of 1,024+ tokens), 128 x 128 tiles (8 warps) for the gate/up
    GEMM and 128 x 256 for the down GEMM: searched on an H200 (``bench/moe_kernels.py --sweep``), the
    expert block took 857 / 1,335 us at T = 2,048 / 4,096 against 905 / 1,478 with the 64-row tiles. Their
    tile order (``--groups``, an H100): gate/up 4 blocks at a time through their N tiles, down 2 blocks and
    4 stages: at T = 4,096 gate/up 757 -> 728 us, down 513 -> 399 (T = 2,048: 481 -> 463, 341 -> 256).
    ``quantized`` weights (dequantized in registers, int4's K tiles of 256) and 4-byte activations (fp32:
    the tall tiles' pipeline needs 288 KB of shared memory, past the 227 KB of an SM) keep the 64-row tiles;
    the search covered bf16 only. The 64-row tiles go 4 blocks at a time through their N tiles (an H100):
    bf16 at T = 1,024 (64 rows per expert) gate/up 395 -> 387 us, down 254 -> 212; the FP8 experts' W8A8
    block 558 -> 492 us at T = 1,024 and 1,569 -> 1,329 at 4,096 (int4's not timed).
    """
    rows_per_expert = num_assignments / max(num_experts, 1)
    if rows_per_expert <= 8:
        return MoETiles(16, GemmTiles(32, 128, 4, 4), GemmTiles(64, 128, 4, 4))
    if rows_per_expert <= 32:
        return MoETiles(32, GemmTiles(64, 64, 4, 4), GemmTiles(64, 64, 4, 4))
    if rows_per_expert <= 64 or quantized or itemsize > 2:
        g = 4 if PREFILL_GROUP_M is None else PREFILL_GROUP_M
        return MoETiles(64, GemmTiles(64, 64, 4, 3, g), GemmTiles(128, 64, 8, 3, g))
    stages = 4 if rows_per_expert <= 160 else 3
    gate_up_g, down_g = (4, 2) if PREFILL_GROUP_M is None else (PREFILL_GROUP_M, PREFILL_GROUP_M)
    return MoETiles(128, GemmTiles(128, 64, 8, stages, gate_up_g), GemmTiles(256, 64, 8, 4, down_g))


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
    num_blocks = _align_blocks(n, num_experts, block_m)
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


def _align_blocks(n: int, num_experts: int, block_m: int) -> int:
    """Blocks of an alignment of ``n`` assignments: every expert that can be hit may waste ``block_m - 1``
    slots (a count from shapes alone)."""
    return -(-(n + min(num_experts, n) * (block_m - 1)) // block_m)


def _align_outputs(
    experts: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The alignment kernels' input as a contiguous flat view, and their two outputs, unfilled."""
    flat = experts.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    num_blocks = _align_blocks(flat.numel(), num_experts, block_m)
    sorted_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=flat.device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=flat.device)
    return flat, sorted_ids, block_expert


@triton.jit
def _chunk_counts(Experts, ids, n, e_ids):
    """How many of the assignments ``ids`` each expert has (one-hot rows of the chunk)."""
    ex = tl.load(Experts + ids, mask=ids < n, other=-1)
    return tl.sum((ex[:, None] == e_ids[None, :]).to(tl.int32), 0)


@triton.jit
def _place_chunk(Experts, SortedIds, ids, n, e_ids, first_slots):
    """Each of the assignments ``ids`` to its expert's ``first_slots`` entry plus its rank among the same
    expert's assignments earlier in the chunk (a column cumsum of the one-hot tile: token order, as the
    stable sort keeps it). Returns the chunk's counts per expert."""
    ex = tl.load(Experts + ids, mask=ids < n, other=-1)
    hit = (ex[:, None] == e_ids[None, :]).to(tl.int32)
    slot = tl.sum(hit * (tl.cumsum(hit, 0) - hit + first_slots[None, :]), 1)
    tl.store(SortedIds + slot, ids, mask=ids < n)
    return tl.sum(hit, 0)


@triton.jit
def _runs_tail(
    SortedIds,
    BlockExpert,
    n,
    counts,
    padded_starts,
    padded_ends,
    total,
    num_slots,
    num_blocks,
    BLOCK_M: tl.constexpr,
    FILL: tl.constexpr,
    B_BLOCK: tl.constexpr,
):
    """What both alignment kernels write once the runs are laid out: the sentinel n in each run's padding
    and in every slot past the last run (disjoint from the slots assignments take, so no ordering between
    the stores is needed), and each block's expert: the one whose run holds slot b * BLOCK_M, the number of
    runs ending at or before it (empty runs end where the previous one does, so they are skipped)."""
    pad_slots = (padded_starts + counts)[:, None] + tl.arange(0, BLOCK_M)[None, :]
    tl.store(SortedIds + pad_slots, tl.zeros_like(pad_slots) + n, mask=pad_slots < padded_ends[:, None])
    for s0 in range(0, num_slots, FILL):
        slots = s0 + tl.arange(0, FILL)
        tl.store(SortedIds + slots, tl.zeros_like(slots) + n, mask=(slots >= total) & (slots < num_slots))
    for b0 in range(0, num_blocks, B_BLOCK):
        blocks = b0 + tl.arange(0, B_BLOCK)
        first = blocks * BLOCK_M
        owner = tl.sum((padded_ends[None, :] <= first[:, None]).to(tl.int32), 1)
        tl.store(BlockExpert + blocks, tl.where(first < total, owner, -1), mask=blocks < num_blocks)


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

    Pass 1 counts assignments per expert, CHUNK at a time; the padded runs follow by a cumsum. Pass 2 places
    each chunk's assignments after those of the chunks before it, in token order (``_place_chunk``).
    """
    e_ids = tl.arange(0, E_BLOCK)
    lanes = tl.arange(0, CHUNK)
    counts = tl.zeros([E_BLOCK], tl.int32)
    for start in range(0, n, CHUNK):
        counts += _chunk_counts(Experts, start + lanes, n, e_ids)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_ends = tl.cumsum(padded, 0)
    padded_starts = padded_ends - padded
    total = tl.sum(padded, 0)

    _runs_tail(SortedIds, BlockExpert, n, counts, padded_starts, padded_ends, total, num_slots, num_blocks,
               BLOCK_M, FILL, CHUNK)  # fmt: skip

    next_slot = padded_starts
    for start in range(0, n, CHUNK):
        next_slot += _place_chunk(Experts, SortedIds, start + lanes, n, e_ids, next_slot)


_moe_align = DualKernel(_moe_align_fn)


def moe_align_kernel(
    experts: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``moe_align`` as one Triton program: the same outputs, bit for bit."""
    flat, sorted_ids, block_expert = _align_outputs(experts, num_experts, block_m)
    n = flat.numel()
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
            block_expert.shape[0],
            BLOCK_M=block_m,
            E_BLOCK=e_block,
            CHUNK=chunk,
            FILL=1024,
            num_warps=8,
        )
    return sorted_ids, block_expert


def _moe_chunk_counts_fn(Experts, ChunkCounts, n, E_BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """Program c: how many of assignments [c * CHUNK, (c + 1) * CHUNK) each expert has (one-hot rows)."""
    c = tl.program_id(0)
    e_ids = tl.arange(0, E_BLOCK)
    counts = _chunk_counts(Experts, c * CHUNK + tl.arange(0, CHUNK), n, e_ids)
    tl.store(ChunkCounts + c * E_BLOCK + e_ids, counts)


def _moe_layout_fn(
    ChunkCounts,
    ChunkBase,
    SortedIds,
    BlockExpert,
    n,
    num_chunks,
    num_slots,
    num_blocks,
    BLOCK_M: tl.constexpr,
    E_BLOCK: tl.constexpr,
    C_BLOCK: tl.constexpr,
    FILL: tl.constexpr,
):
    """One program over the chunks' counts: each expert's padded run (as ``_moe_align_fn``), the first slot
    of each (chunk, expert) pair in it (ChunkBase: the run's start plus the expert's assignments in earlier
    chunks), the sentinel in every slot no assignment takes, and each block's expert."""
    e_ids = tl.arange(0, E_BLOCK)
    rows = tl.arange(0, C_BLOCK)
    counts = tl.zeros([E_BLOCK], tl.int32)
    for c0 in range(0, num_chunks, C_BLOCK):
        tile = tl.load(ChunkCounts + (c0 + rows)[:, None] * E_BLOCK + e_ids[None, :],
                       mask=(c0 + rows < num_chunks)[:, None], other=0)  # fmt: skip
        counts += tl.sum(tile, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_ends = tl.cumsum(padded, 0)
    padded_starts = padded_ends - padded
    total = tl.sum(padded, 0)

    running = padded_starts
    for c0 in range(0, num_chunks, C_BLOCK):
        ok = (c0 + rows < num_chunks)[:, None]
        offs = (c0 + rows)[:, None] * E_BLOCK + e_ids[None, :]
        tile = tl.load(ChunkCounts + offs, mask=ok, other=0)
        tl.store(ChunkBase + offs, tl.cumsum(tile, 0) - tile + running[None, :], mask=ok)
        running += tl.sum(tile, 0)

    _runs_tail(SortedIds, BlockExpert, n, counts, padded_starts, padded_ends, total, num_slots, num_blocks,
               BLOCK_M, FILL, C_BLOCK)  # fmt: skip


def _moe_place_fn(Experts, ChunkBase, SortedIds, n, E_BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """Program c: each assignment of chunk c to its slot, after its expert's assignments in earlier chunks
    (``ChunkBase``) and in token order within the chunk (``_place_chunk``)."""
    c = tl.program_id(0)
    e_ids = tl.arange(0, E_BLOCK)
    base = tl.load(ChunkBase + c * E_BLOCK + e_ids)
    _place_chunk(Experts, SortedIds, c * CHUNK + tl.arange(0, CHUNK), n, e_ids, base)


_moe_chunk_counts = DualKernel(_moe_chunk_counts_fn)
_moe_layout = DualKernel(_moe_layout_fn)
_moe_place = DualKernel(_moe_place_fn)


def moe_align_parallel(
    experts: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``moe_align`` in three launches for prefill-sized steps, the same outputs bit for bit: the chunks'
    expert counts (one program per chunk of assignments), the runs' layout (one program), each assignment to
    its slot (one program per chunk). No sort and no host read, so it is capturable too; the one-program
    ``moe_align_kernel`` loops over every chunk twice, which is what makes it slow past decode sizes."""
    flat, sorted_ids, block_expert = _align_outputs(experts, num_experts, block_m)
    n = flat.numel()
    device = flat.device
    if not n:
        return sorted_ids, block_expert
    e_block = next_pow2(max(num_experts, 16))
    chunk = max(16, min(next_pow2(n), 16384 // e_block))  # a CHUNK x E_BLOCK one-hot tile per program
    num_chunks = -(-n // chunk)
    counts = torch.empty(num_chunks, e_block, dtype=torch.int32, device=device)
    base = torch.empty_like(counts)
    _moe_chunk_counts[device][(num_chunks,)](flat, counts, n, E_BLOCK=e_block, CHUNK=chunk, num_warps=8)
    _moe_layout[device][(1,)](
        counts,
        base,
        sorted_ids,
        block_expert,
        n,
        num_chunks,
        sorted_ids.shape[0],
        block_expert.shape[0],
        BLOCK_M=block_m,
        E_BLOCK=e_block,
        C_BLOCK=max(1, 4096 // e_block),
        FILL=1024,
        num_warps=8,
    )
    _moe_place[device][(num_chunks,)](flat, base, sorted_ids, n, E_BLOCK=e_block, CHUNK=chunk, num_warps=8)
    return sorted_ids, block_expert


@triton.jit
def _dequant_tile(
    W,
    S,
    Z,
    rows,
    row_ok,
    k0,
    K,
    num_groups,
    stride_wn,
    stride_sn,
    stride_zn,
    scale_bn,
    scale_bk,
    dot_ty: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUPS: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """The FP8 weight tile [BLOCK_N, BLOCK_K] of ``rows`` at K offset ``k0``, dequantized (q * s, exact in
    fp32) and rounded to the activation dtype ``dot_ty`` (UPCAST: as fp32 values, for the interpreter)."""
    w, s, z = _load_raw(
        W, S, Z, rows, row_ok, k0, K, num_groups, stride_wn, stride_sn, stride_zn, scale_bn, scale_bk,
        BLOCK_K, False, False, GROUPS,
    )  # fmt: skip
    wf = _dequant(w, s, z, BLOCK_N, BLOCK_K, False, False, GROUPS)
    if UPCAST:
        return _round_to(wf, dot_ty)
    else:
        return wf.to(dot_ty)  # round to nearest even on the GPU; fp32: unchanged


@triton.jit
def _w8a8_products(
    A,
    AS,
    W,
    S,
    rows,
    valid,
    cols,
    col_ok,
    K,
    num_groups,
    gate_offset,
    scale_up_offset,
    stride_am,
    stride_asm,
    stride_wn,
    stride_sn,
    scale_bn,
    scale_bk,
    GATED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROW_SCALE: tl.constexpr,
):
    """fp32 [BLOCK_M, BLOCK_N] sums over K groups of (e4m3 A rows @ e4m3 W rows^T) * a_scale * w_scale, and
    of the up rows for GATED (``fp8_matmul``'s math with an expert's weight; W and S at that expert).
    ROW_SCALE (the weight's scales constant along all of K, A's one per row): the products accumulate on the
    tensor cores across K and both scales multiply the sums once, as ``torch._scaled_mm`` does."""
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A + rows[:, None] * stride_am + offs_k[None, :]
    as_ptrs = AS + rows * stride_asm
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, mask=valid[:, None] & (offs_k < K - k0)[None, :], other=0.0)
        w, sw, _ = _load_raw(
            W, S, S, cols, col_ok, k0, K, num_groups, stride_wn, stride_sn, 0, scale_bn, scale_bk, BLOCK_K,
            False, False, 1,
        )  # fmt: skip
        if ROW_SCALE:
            acc = tl.dot(a, tl.trans(w), acc)
        else:
            sa = tl.load(as_ptrs + k0 // BLOCK_K, mask=valid, other=0.0)
            acc += tl.dot(a, tl.trans(w)) * sa[:, None] * tl.reshape(sw, [BLOCK_N])[None, :]
        if GATED:
            u, su, _ = _load_raw(
                W + gate_offset * stride_wn, S + scale_up_offset * stride_sn, S, cols, col_ok, k0, K,
                num_groups, stride_wn, stride_sn, 0, scale_bn, scale_bk, BLOCK_K, False, False, 1,
            )  # fmt: skip
            if ROW_SCALE:
                acc_up = tl.dot(a, tl.trans(u), acc_up)
            else:
                acc_up += tl.dot(a, tl.trans(u)) * sa[:, None] * tl.reshape(su, [BLOCK_N])[None, :]
        a_ptrs += BLOCK_K
    if ROW_SCALE:
        sa = tl.load(as_ptrs, mask=valid, other=0.0)
        scale_rows = (cols // scale_bn).to(tl.int64) * stride_sn
        acc = acc * sa[:, None] * tl.load(S + scale_rows, mask=col_ok, other=0.0)[None, :]
        if GATED:
            su = tl.load(S + scale_up_offset * stride_sn + scale_rows, mask=col_ok, other=0.0)
            acc_up = acc_up * sa[:, None] * su[None, :]
    return acc, acc_up


@triton.jit
def _grouped_tile(pid, num_programs, num_n, GROUP_M: tl.constexpr):
    """(block, N tile) of program ``pid`` of ``num_programs`` = blocks x ``num_n``: GROUP_M blocks at a time,
    block fastest within a group, then the group's next N tile (the last group may hold fewer blocks)."""
    num_m = num_programs // num_n
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    within = pid % per_group
    return first_m + within % group_size, within // group_size


def _moe_gemm_fn(  # noqa: C901 - Triton kernel body: its branches test tl.constexpr flags, specialised away at compile time
    A,
    W,
    Out,
    SortedIds,
    BlockExpert,
    RouteWeights,
    S,
    Z,
    N,
    K,
    num_assignments,
    gate_offset,
    stride_am,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    num_groups,
    stride_se,
    stride_sn,
    stride_ze,
    stride_zn,
    scale_bn,
    scale_bk,
    scale_up_offset,
    AS,
    stride_asm,
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
    QUANT: tl.constexpr,
    INT4: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    GROUPS: tl.constexpr,
    SWAP: tl.constexpr,
    PLANES: tl.constexpr,
    W8A8: tl.constexpr,
    W8A8_ROWS: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """Out[id, cols] = A[id // A_ROW_DIV] @ W[expert, cols].T for the BLOCK_M assignment ids of one block.

    GATED: W rows [cols] are the gate and [gate_offset + cols] the up projection; the epilogue stores
    ``act(gate) * up``. ROUTE_WEIGHT: rows are scaled by RouteWeights[id]. Rounding follows the unfused
    model: each projection to Out's dtype, then the activation, then the product (or the weight scaling).
    QUANT: W holds quantized weights (``QuantExpertWeights``: S scales, Z zero points, the up rows' scales
    ``scale_up_offset`` scale rows on); each tile is dequantized in registers and rounded to A's dtype (FP8:
    ``quant_matmul``'s ``_load_raw`` / ``_dequant``; int4: ``_int4_products``, SWAP its operand order).
    W8A8 (FP8 weights): A is e4m3 with a scale per row and 128-column group (AS,
    ``fp8_matmul.quantize_groups``), BLOCK_K is that group; each group's FP8 x FP8 product goes to the tensor
    cores as loaded and is scaled by its two scales (``_w8a8_products``). W8A8_ROWS: A's scale is one per
    row (``fp8_rows.quantize_rows_fp8``) and W's constant along K; the products accumulate across K.
    GROUP_M (``GemmTiles.group_m``) > 0: a 1-D grid, GROUP_M blocks through all their N tiles at a time.
    """
    if GROUP_M > 0:
        pid_m, pid_n = _grouped_tile(tl.program_id(0), tl.num_programs(0), tl.cdiv(N, BLOCK_N), GROUP_M)
    else:
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
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if W8A8:
        acc, acc_up = _w8a8_products(
            A, AS, W + expert * stride_we, S + expert * stride_se, rows, valid, cols, col_ok, K, num_groups,
            gate_offset, scale_up_offset, stride_am, stride_asm, stride_wn, stride_sn, scale_bn, scale_bk,
            GATED, BLOCK_M, BLOCK_N, BLOCK_K, W8A8_ROWS,
        )  # fmt: skip
    elif QUANT and INT4:
        acc, acc_up = _int4_products(
            A, W + expert * stride_we, S + expert * stride_se, Z + expert * stride_ze, rows, valid, cols,
            col_ok, K, num_groups, gate_offset, scale_up_offset, stride_am, stride_wn, stride_sn, stride_zn,
            scale_bn, scale_bk, GATED, BLOCK_M, BLOCK_N, BLOCK_K, HAS_ZERO, GROUPS, SWAP, UPCAST,
            DOT_PRECISION, PLANES, 0,
        )  # fmt: skip
    elif QUANT:
        w_base = W + expert * stride_we
        s_base = S + expert * stride_se
        z_base = Z + expert * stride_ze
        dot_ty = A.dtype.element_ty
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(a_ptrs, mask=valid[:, None] & (offs_k < K - k0)[None, :], other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
            wd = _dequant_tile(
                w_base, s_base, z_base, cols, col_ok, k0, K, num_groups, stride_wn, stride_sn, stride_zn,
                scale_bn, scale_bk, dot_ty, BLOCK_N, BLOCK_K, GROUPS, UPCAST,
            )  # fmt: skip
            acc = tl.dot(a, tl.trans(wd), acc, input_precision=DOT_PRECISION)
            if GATED:
                ud = _dequant_tile(
                    w_base + gate_offset * stride_wn, s_base + scale_up_offset * stride_sn,
                    z_base + gate_offset * stride_zn, cols, col_ok, k0, K, num_groups, stride_wn, stride_sn,
                    stride_zn, scale_bn, scale_bk, dot_ty, BLOCK_N, BLOCK_K, GROUPS, UPCAST,
                )  # fmt: skip
                acc_up = tl.dot(a, tl.trans(ud), acc_up, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K
    else:
        w_ptrs = W + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
        up_ptrs = w_ptrs + gate_offset * stride_wn
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
    w: torch.Tensor | QuantExpertWeights,
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
    a_scales: torch.Tensor | None = None,
) -> None:
    """``a_scales``: ``a`` is e4m3 with these per-(row, 128-column group) scales, or one per row where ``w``'s
    scales are constant along K; ``w`` FP8 (W8A8)."""
    quant = isinstance(w, QuantExpertWeights)
    weight = w.weight if quant else w
    k = w.shape[2]
    assert a.stride(-1) == 1 and weight.stride(-1) == 1 and out.stride(-1) == 1
    upcast, precision = dot_settings(a.dtype, a.device)
    num_n = -(-n // tiles.block_n)
    assert tiles.group_m >= 0, tiles
    grid = (block_expert.shape[0] * num_n,) if tiles.group_m > 0 else (block_expert.shape[0], num_n)
    block_k = GROUP if a_scales is not None else tiles.block_k
    if a_scales is not None:
        assert quant and weight.dtype == torch.float8_e4m3fn and fp8_matmul_supported(w.scale_block, k)
        assert a_scales.shape[1] == -(-k // GROUP) or _row_scaled(w), (
            "row scales need scales constant along K"
        )
    if quant:
        scale, zero = w.scale, w.zero_point
        int4 = weight.dtype == torch.int32
        if int4:
            block_k = int4_block_k(block_m)
        assert weight.is_contiguous() and scale.is_contiguous() and (zero is None or zero.is_contiguous())
        assert w.parts == (2 if activation else 1)
        quant_args = (
            scale.shape[2],
            scale.stride(0),
            scale.stride(1),
            zero.stride(0) if zero is not None else 0,
            zero.stride(1) if zero is not None else 0,
            *w.scale_block,
            scale.shape[1] // w.parts,  # the up rows' first scale row
        )
        quant_meta = dict(
            INT4=int4,
            HAS_ZERO=zero is not None,
            GROUPS=_groups_per_tile(block_k, w.scale_block[1], k),
            SWAP=int4 and int4_swap(block_m),
            PLANES=int4_planes(a, scale, block_m) if int4 else PLANES_FP32,
        )
    else:
        scale = zero = None
        quant_args = (0,) * 8
        quant_meta = dict(INT4=False, HAS_ZERO=False, GROUPS=1, SWAP=False, PLANES=PLANES_FP32)
    _moe_gemm[a.device][grid](
        a,
        weight,
        out,
        sorted_ids,
        block_expert,
        route_weights if route_weights is not None else a,
        scale if scale is not None else a,
        zero if zero is not None else a,
        n,
        k,
        out.shape[0],
        n if activation else 0,  # out has one row per assignment: T*k is the sentinel
        a.stride(0),
        weight.stride(0),
        weight.stride(1),
        weight.stride(2),
        out.stride(0),
        *quant_args,
        a_scales if a_scales is not None else a,
        a_scales.stride(0) if a_scales is not None else 0,
        A_ROW_DIV=a_row_div,
        GATED=activation is not None,
        ACT=_KINDS[activation] if activation else 0,
        ROUTE_WEIGHT=route_weights is not None,
        BLOCK_M=block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=block_k,
        EVEN_K=k % block_k == 0,
        UPCAST=upcast,
        DOT_PRECISION=precision,
        QUANT=quant,
        **quant_meta,
        W8A8=a_scales is not None,
        W8A8_ROWS=a_scales is not None and a_scales.shape[1] == 1,
        GROUP_M=tiles.group_m,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )


def fused_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor | QuantExpertWeights,
    down: torch.Tensor | QuantExpertWeights,
    experts: torch.Tensor,
    weights: torch.Tensor,
    activation: str,
    tiles: MoETiles | None = None,
    align_kernel_max: int = ALIGN_KERNEL_MAX_ASSIGNMENTS,
    w8a8_min: int | None = None,
    sum_slots: bool = True,
    w8a8_rows: bool | None = None,
) -> torch.Tensor:
    """x [T, H]; gate_up [E, 2I, H] (gate rows, then up rows); down [E, H, I]; experts [T, k] ids;
    weights [T, k] fp32 -> [T, H] in x's dtype: ``sum_j weights[t, j] * expert_j(x[t])``. Either weight may
    be ``QuantExpertWeights`` (gate_up in two parts), dequantized in registers to x's dtype.

    The k expert outputs of a token are summed in fp32 in slot order (deterministic), then rounded once.
    ``tiles`` overrides ``moe_tiles``; alignments of more than ``align_kernel_max`` assignments take the
    three-launch kernel (or torch's sort, ``PREFILL_ALIGN``) instead of the one-program kernel. FP8 experts
    (both projections) take the W8A8 products at ``w8a8_min`` assignments or more (0: never; None:
    ``W8A8_MIN_ASSIGNMENTS``): x and the gated activations quantized per token and 128-column group, or per
    token for a projection whose scales are constant along K with ``w8a8_rows`` (None: ``W8A8_ROWS``), as
    ``fused_moe_w8a8_reference``. ``sum_slots=False``: up to ``CHUNK_TOKENS`` tokens, the weighted expert
    outputs unsummed, [T, k, H] in x's dtype, for a kernel that reads them anyway to sum them in its own pass
    (``rms_norm.fused_rms_norm``'s branches: an fp32 sum in slot order, rounded once; one launch fewer).
    """
    if w8a8_min is None:
        w8a8_min = W8A8_MIN_ASSIGNMENTS
    if w8a8_rows is None:
        w8a8_rows = W8A8_ROWS
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = gate_up.shape
    inter = two_inter // 2
    top_k = experts.shape[1]
    x = x.contiguous()
    weights = weights.to(torch.float32).contiguous()
    sum_slots = sum_slots or num_tokens > CHUNK_TOKENS
    if not sum_slots and num_tokens == 0:
        return x.new_empty(0, top_k, hidden)
    out = torch.empty_like(x)
    quantized = isinstance(gate_up, QuantExpertWeights) or isinstance(down, QuantExpertWeights)
    w8a8_able = w8a8_min > 0 and x.element_size() == 2 and all(_w8a8_weights(w) for w in (gate_up, down))
    if w8a8_able:  # per projection: its activations' quantizer
        quantize_gate_up, quantize_down = (_w8a8_quantizer(w, w8a8_rows) for w in (gate_up, down))
    for start in range(0, num_tokens, CHUNK_TOKENS):
        stop = min(start + CHUNK_TOKENS, num_tokens)
        n = (stop - start) * top_k
        cfg = tiles or moe_tiles(n, num_experts, quantized, x.element_size())
        if n <= align_kernel_max:
            align = moe_align_kernel
        else:
            align = moe_align_parallel if PREFILL_ALIGN == "parallel" else moe_align
        sorted_ids, block_expert = align(experts[start:stop], num_experts, cfg.block_m)
        hidden_act = torch.empty(n, inter, dtype=x.dtype, device=x.device)
        w8a8 = w8a8_able and n >= w8a8_min
        a, a_scales = quantize_gate_up(x[start:stop]) if w8a8 else (x[start:stop], None)
        _grouped_gemm(
            a,
            gate_up,
            hidden_act,
            inter,
            sorted_ids,
            block_expert,
            cfg.block_m,
            cfg.gate_up,
            a_row_div=top_k,
            activation=activation,
            a_scales=a_scales,
        )
        per_slot = torch.empty(n, hidden, dtype=x.dtype, device=x.device)
        a, a_scales = quantize_down(hidden_act) if w8a8 else (hidden_act, None)
        _grouped_gemm(
            a,
            down,
            per_slot,
            hidden,
            sorted_ids,
            block_expert,
            cfg.block_m,
            cfg.down,
            a_row_div=1,
            route_weights=weights[start:stop].reshape(-1),
            a_scales=a_scales,
        )
        if not sum_slots:  # one chunk
            return per_slot.view(num_tokens, top_k, hidden)
        out[start:stop] = per_slot.view(stop - start, top_k, hidden).sum(1, dtype=torch.float32)
    return out


def _w8a8_quantizer(w: QuantExpertWeights, rows: bool, reference: bool = False):
    """The activations' quantizer for W8A8 products with ``w`` (the kernel's, or with ``reference`` its torch
    twin): per token where ``rows`` and ``w``'s scales allow it, else per token and 128-column group."""
    if rows and _row_scaled(w):
        return quantize_rows_reference if reference else (lambda a: quantize_rows_fp8(a, None))
    return quantize_activation_groups if reference else quantize_groups


def _row_scaled(w: QuantExpertWeights) -> bool:
    """Scales constant along all of K (per tensor or per channel): W8A8 may quantize activations per row."""
    return w.scale.shape[2] == 1


def _w8a8_weights(w: torch.Tensor | QuantExpertWeights) -> bool:
    """FP8 experts whose scales are constant within each 128-column activation group."""
    return (
        isinstance(w, QuantExpertWeights)
        and w.weight.dtype == torch.float8_e4m3fn
        and fp8_matmul_supported(w.scale_block, w.in_features)
    )


def _expert_weight(w: torch.Tensor | QuantExpertWeights, expert: int, dtype: torch.dtype) -> torch.Tensor:
    return dequantize_expert(w, expert, dtype) if isinstance(w, QuantExpertWeights) else w[expert]


def fused_moe_reference(
    x: torch.Tensor,
    gate_up: torch.Tensor | QuantExpertWeights,
    down: torch.Tensor | QuantExpertWeights,
    experts: torch.Tensor,
    weights: torch.Tensor,
    activation: str,
) -> torch.Tensor:
    """The model's expert loop (bit-exact with transformers); ``.tolist()`` syncs, so not capturable.
    Quantized weights: each hit expert's weight dequantized to x's dtype (``dequantize_expert``), then the
    same loop."""
    act = ACTIVATIONS[activation]
    out = torch.zeros_like(x)
    token_ids = torch.arange(x.shape[0], device=x.device).unsqueeze(1).expand_as(experts)
    for e in torch.unique(experts).tolist():
        hit = experts == e
        tokens = token_ids[hit]
        gate, up = torch.nn.functional.linear(x[tokens], _expert_weight(gate_up, e, x.dtype)).chunk(2, dim=-1)
        y = torch.nn.functional.linear(act(gate) * up, _expert_weight(down, e, x.dtype))
        y = y * weights[hit].unsqueeze(-1)
        out.index_add_(0, tokens, y.to(out.dtype))
    return out


def _w8a8_linear(xq: torch.Tensor, sx: torch.Tensor, w: QuantExpertWeights, expert: int) -> torch.Tensor:
    """fp32 products of group-quantized rows with expert ``expert``'s FP8 weight, group by group, each times
    its activation and weight scales (``fp8_matmul_reference``'s math, per part's scale grid); of rows
    quantized per token (``sx`` [M, 1]), the whole product times both scales."""
    rows, scale_rows = w.weight.shape[1] // w.parts, w.scale.shape[1] // w.parts
    bn, bk = w.scale_block
    sw = torch.cat(
        [
            w.scale[expert, p * scale_rows : (p + 1) * scale_rows].float().repeat_interleave(bn, dim=0)[:rows]
            for p in range(w.parts)
        ]
    )  # [N, ceil(K / bk)]
    weight = w.weight[expert].float()
    if sx.shape[1] == 1:  # a scale per row (and the weight's constant along K): one product, scaled once
        return (xq.float() @ weight.t()) * sx * sw[:, 0][None, :]
    y = torch.zeros(xq.shape[0], weight.shape[0], dtype=torch.float32, device=xq.device)
    for g, k0 in enumerate(range(0, w.in_features, GROUP)):
        part = xq[:, k0 : k0 + GROUP].float() @ weight[:, k0 : k0 + GROUP].t()
        y += part * sx[:, g : g + 1] * sw[:, k0 // bk][None, :]
    return y


def fused_moe_w8a8_reference(
    x: torch.Tensor,
    gate_up: QuantExpertWeights,
    down: QuantExpertWeights,
    experts: torch.Tensor,
    weights: torch.Tensor,
    activation: str,
    w8a8_rows: bool | None = None,
) -> torch.Tensor:
    """The W8A8 path's math in torch: each token quantized per 128-column group once (per token where
    ``w8a8_rows``, None: ``W8A8_ROWS``, and the projection's scales are constant along K), each hit expert's
    gate/up products rounded to x's dtype, the gated activation rounded and quantized again for the down
    products, those rounded and weighted; the k outputs summed in fp32 in slot order, then rounded."""
    rows = W8A8_ROWS if w8a8_rows is None else w8a8_rows
    quantize_gate_up, quantize_down = (_w8a8_quantizer(w, rows, reference=True) for w in (gate_up, down))
    act = ACTIVATIONS[activation]
    xq, sx = quantize_gate_up(x)
    top_k = experts.shape[1]
    per_slot = torch.zeros(x.shape[0], top_k, x.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(experts).tolist():
        hit = experts == e
        tokens, slots = hit.nonzero(as_tuple=True)
        gate, up = _w8a8_linear(xq[tokens], sx[tokens], gate_up, e).to(x.dtype).chunk(2, dim=-1)
        hq, hs = quantize_down(act(gate) * up)
        y = _w8a8_linear(hq, hs, down, e).to(x.dtype).float() * weights[tokens, slots].float().unsqueeze(-1)
        per_slot[tokens, slots] = y.to(x.dtype).float()
    return per_slot.sum(1).to(x.dtype)


__all__ = [
    "GemmTiles",
    "MoETiles",
    "QuantExpertWeights",
    "dequantize_expert",
    "fused_moe",
    "fused_moe_reference",
    "fused_moe_w8a8_reference",
    "moe_align",
    "moe_align_kernel",
    "moe_tiles",
]
