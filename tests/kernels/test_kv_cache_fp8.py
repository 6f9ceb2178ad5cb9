"""The FP8 (e4m3) KV cache in the kernels, run in Triton's interpreter on CPU tensors.

The KV write and the fused attention prologue store the bytes the torch reference stores (x / scale,
saturated, rounded to nearest even); decode and prefill over an FP8 cache match their references, which
dequantize the same bytes with the same per-head scales. The scales differ per KV head and between K and V
everywhere, so a kernel that applied another head's scale, V's for K, or none would fail. Block 0 of every
cache holds e4m3 NaN and is never handed to a sequence.
"""

from __future__ import annotations

import pytest
import torch

from g4serve.config import FULL, SLIDING, TextConfig
from g4serve.engine.kv_cache import PagedKVCache
from g4serve.kernels.kv_cache_write import (
    FP8_MAX,
    KV_FP8_DTYPE,
    dequantize_kv_reference,
    kv_cache_write,
    kv_cache_write_reference,
    quantize_kv_reference,
)
from g4serve.kernels.norm_rope import norm_rope
from g4serve.kernels.paged_decode import paged_decode_attention, paged_decode_reference
from g4serve.kernels.paged_prefill import paged_prefill_attention, paged_prefill_reference
from g4serve.kernels.qkv_prep import qkv_prep, qkv_prep_reference
from g4serve.layers.attention import TorchAttention, TritonAttention, contiguous_metadata
from g4serve.layers.rotary import rope_cos_sin, text_inv_freq

NAN_BYTE = 0x7F  # e4m3fn NaN
# (K row, V row) per KV head: not powers of two (the division must round), K and V and the heads all differ;
# randn values up to ~4.5 stay below 448 after the division.
SCALES = torch.tensor([[0.031, 0.0173], [0.0119, 0.043]])


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _fp8_cache(num_blocks: int, page: int, head_dim: int, gen: torch.Generator):
    """Random K/V quantized under SCALES (two KV heads); block 0 poisoned with NaN."""
    rows = num_blocks * page
    k = quantize_kv_reference(torch.randn(rows, 2, head_dim, generator=gen), SCALES[0])
    v = quantize_kv_reference(torch.randn(rows, 2, head_dim, generator=gen), SCALES[1])
    _bytes(k)[:page] = _bytes(v)[:page] = NAN_BYTE
    return k, v


def _tables(seq_lens: list[int], page: int, num_blocks: int, gen, window=None, first_query_pos=None):
    """Distinct random blocks (never 0); with a window, the blocks no query sees are freed (-1)."""
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    width = max(-(-n // page) for n in seq_lens)
    rows = []
    for i, n in enumerate(seq_lens):
        row = [perm.pop() for _ in range(-(-n // page))]
        if window is not None:
            first = first_query_pos[i] if first_query_pos else n - 1
            row[: max(0, first - window + 1) // page] = [-1] * (max(0, first - window + 1) // page)
        rows.append(row + [-1] * (width - len(row)))
    return torch.tensor(rows, dtype=torch.int32)


def _close(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    assert torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


# ---- the write ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_stores_the_reference_bytes(dtype):
    gen = torch.Generator().manual_seed(1)
    k = (3 * torch.randn(9, 2, 32, generator=gen)).to(dtype)
    v = torch.randn(9, 2, 32, generator=gen).to(dtype)
    k[0, 1, :4] = torch.tensor([1e4, -1e4, 460.0 * SCALES[0, 1], -0.0])  # saturated both ways; -0 kept
    slots = torch.tensor([3, -1, 17, 0, 9, -1, 31, 30, 2])
    caches = [torch.zeros(2, 32, 2, 32, dtype=KV_FP8_DTYPE) for _ in range(2)]
    kv_cache_write(k, v, caches[0][0], caches[0][1], slots, SCALES[0], SCALES[1])
    kv_cache_write_reference(k, v, caches[1][0], caches[1][1], slots, SCALES[0], SCALES[1])
    assert torch.equal(_bytes(caches[0]), _bytes(caches[1]))
    assert caches[0][0, 3, 1, :3].float().tolist() == [FP8_MAX, -FP8_MAX, FP8_MAX]
    assert _bytes(caches[0])[0, 3, 1, 3] == 0x80  # -0.0
    unwritten = torch.ones(32, dtype=torch.bool)
    unwritten[slots[slots >= 0]] = False
    assert (_bytes(caches[0])[:, unwritten] == 0).all()
    # what the cache holds is the value to within e4m3's rounding (3 mantissa bits: 1/16 relative)
    stored = dequantize_kv_reference(caches[0][1, slots[slots >= 0]], SCALES[1])
    torch.testing.assert_close(stored, v[slots >= 0].float(), rtol=1 / 16, atol=2**-9 * 0.05)


def test_write_rounds_every_e4m3_value_tie_and_subnormal_as_torch():
    """Scale 1: every finite e4m3 value, every midpoint between neighbours (ties to even), values in the
    subnormal range and past 448 go through the kernel's fp32 rounding; the bytes are torch's cast's."""
    grid = torch.arange(256, dtype=torch.uint8).view(KV_FP8_DTYPE).float()
    grid = grid[torch.isfinite(grid)].sort().values
    gen = torch.Generator().manual_seed(2)
    x = torch.cat([grid, (grid[1:] + grid[:-1]) / 2, 0.01 * torch.randn(300, generator=gen)])
    x = torch.cat([x, torch.tensor([470.0, -1e30, 5e-4, -5e-4])])
    x = torch.nn.functional.pad(x, (0, 1024 - x.numel())).view(32, 1, 32)
    ones = torch.ones(1)
    cache = torch.zeros(2, 32, 1, 32, dtype=KV_FP8_DTYPE)
    kv_cache_write(x, x, cache[0], cache[1], torch.arange(32), ones, ones)
    assert torch.equal(_bytes(cache[0]), _bytes(x.clamp(-FP8_MAX, FP8_MAX).to(KV_FP8_DTYPE)))


# ---- decode / prefill over an FP8 cache --------------------------------------------------------------------

DECODE_CASES = [
    # head_dim, q heads, page, seq_lens, window, num_splits
    pytest.param(16, 4, 4, [1, 8, 9, 12, 16, 17], 8, 1, id="window-boundaries"),
    pytest.param(16, 8, 8, [300, 47, 48, 49], 40, 3, id="window-splits-freed"),
    pytest.param(256, 4, 16, [1, 47, 48, 49], 48, 2, id="d256-sliding"),
    pytest.param(512, 8, 16, [33, 64], None, 2, id="d512-global"),
]


@pytest.mark.parametrize("head_dim, hq, page, seq_lens, window, num_splits", DECODE_CASES)
def test_decode_over_fp8_cache_matches_reference(head_dim, hq, page, seq_lens, window, num_splits):
    gen = torch.Generator().manual_seed(head_dim + sum(seq_lens))
    num_blocks = sum(-(-n // page) for n in seq_lens) + 2
    k_cache, v_cache = _fp8_cache(num_blocks, page, head_dim, gen)
    tables = _tables(seq_lens, page, num_blocks, gen, window)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    # RMS-normed q times a k_norm-like weight: unscaled scores of Gemma 4's size
    q = torch.randn(len(seq_lens), hq, head_dim, generator=gen) * (0.3 if head_dim > 32 else 1.0)
    scales = {"k_scale": SCALES[0], "v_scale": SCALES[1]}
    out = paged_decode_attention(
        q, k_cache, v_cache, tables, lens, page, window=window, num_splits=num_splits, block_n=16, **scales
    )
    ref = paged_decode_reference(q, k_cache, v_cache, tables, lens, page, window=window, **scales)
    _close(out, ref, 2e-5)


PREFILL_CASES = [
    # head_dim, q heads, page, context before the chunk, chunk lengths, window, spans, q dtype
    pytest.param(32, 4, 4, [9, 0], [12, 16], 8, {0: (11, 17), 1: (2, 9)}, torch.float32, id="window-spans"),
    pytest.param(32, 4, 4, [0, 5, 20], [7, 1, 13], None, None, torch.bfloat16, id="prefix-hits-bf16"),
    pytest.param(256, 4, 16, [20], [12], 16, None, torch.float32, id="d256-sliding"),
    pytest.param(512, 8, 16, [0], [10], None, None, torch.float32, id="d512-global"),
]


@pytest.mark.parametrize("head_dim, hq, page, before, query_lens, window, spans, dtype", PREFILL_CASES)
def test_prefill_over_fp8_cache_matches_reference(
    head_dim, hq, page, before, query_lens, window, spans, dtype
):
    gen = torch.Generator().manual_seed(head_dim + sum(query_lens))
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    positions = torch.cat([torch.arange(b, b + n) for b, n in zip(before, query_lens)])
    seq_lens = torch.tensor([b + n for b, n in zip(before, query_lens)], dtype=torch.int32)
    num_blocks = sum(-(-int(n) // page) for n in seq_lens) + 2
    k_cache, v_cache = _fp8_cache(num_blocks, page, head_dim, gen)
    tables = _tables(seq_lens.tolist(), page, num_blocks, gen, window, first_query_pos=before)
    q = (torch.randn(int(starts[-1]), hq, head_dim, generator=gen) * (0.3 if head_dim > 32 else 1.0)).to(
        dtype
    )
    kw = {"window": window, "k_scale": SCALES[0], "v_scale": SCALES[1]}
    if spans:
        lo = torch.full_like(positions, -1, dtype=torch.int32)
        hi = lo.clone()
        for seq, (s_lo, s_hi) in spans.items():
            for t in range(int(starts[seq]), int(starts[seq + 1])):
                if s_lo <= int(positions[t]) < s_hi:
                    lo[t], hi[t] = s_lo, s_hi
        kw |= {"span_lo": lo, "span_hi": hi}
    tiles = {"block_m": 16, "block_n": 8} if head_dim <= 32 else {}
    out = paged_prefill_attention(
        q, k_cache, v_cache, tables, seq_lens, starts, positions, page, max(query_lens), **tiles, **kw
    )
    ref = paged_prefill_reference(
        q.float(), k_cache, v_cache, tables, seq_lens, starts, positions, page, **kw
    )
    _close(out, ref, 2e-5 if dtype == torch.float32 else 3e-2)


# ---- the fused prologue ------------------------------------------------------------------------------------


def _prologue_case(head_dim: int, v_is_k: bool, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(head_dim)
    t, hq, hkv = 5, 4, 2
    qkv = (3 * torch.randn(t, (hq + hkv * (1 if v_is_k else 2)) * head_dim, generator=gen)).to(dtype)
    wq, wk = torch.randn(head_dim, generator=gen).to(dtype), torch.randn(head_dim, generator=gen).to(dtype)
    rope = {"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": 0.25}
    cos, sin = rope_cos_sin(torch.tensor([0, 3, 7, 100, 511]), text_inv_freq(rope, head_dim), dtype)
    slots = torch.tensor([3, -1, 0, 7, 5])
    caches = [torch.zeros(2, 8, hkv, head_dim, dtype=KV_FP8_DTYPE) for _ in range(2)]
    return (qkv, hq, hkv, wq, wk, 1e-6, cos, sin), slots, caches


@pytest.mark.parametrize("head_dim, v_is_k", [(256, False), (512, True)])
def test_qkv_prep_into_fp8_cache_equals_unfused_kernels(head_dim, v_is_k):
    """bf16 projections: the prologue's cache bytes are norm_rope's rows quantized by the KV write."""
    args, slots, (fused, unfused) = _prologue_case(head_dim, v_is_k, torch.bfloat16)
    q = qkv_prep(*args, fused[0], fused[1], slots, SCALES[0], SCALES[1], v_is_k=v_is_k)
    qkv, hq, hkv, wq, wk, eps, cos, sin = args
    heads = qkv.view(qkv.shape[0], -1, head_dim)
    k_raw = heads[:, hq : hq + hkv]
    v_raw = k_raw if v_is_k else heads[:, hq + hkv :]
    k, v = norm_rope(k_raw, wk, eps, cos, sin), norm_rope(v_raw, None, eps)
    kv_cache_write(k, v, unfused[0], unfused[1], slots, SCALES[0], SCALES[1])
    assert torch.equal(q, norm_rope(heads[:, :hq], wq, eps, cos, sin))
    assert torch.equal(_bytes(fused), _bytes(unfused))


def test_qkv_prep_into_fp8_cache_matches_torch_reference():
    """fp32: the same bytes as the torch reference but where the two fp32 norms differ in the last bit right
    at an e4m3 rounding tie (one step apart there)."""
    args, slots, (fused, ref) = _prologue_case(64, False, torch.float32)
    q = qkv_prep(*args, fused[0], fused[1], slots, SCALES[0], SCALES[1])
    q_ref = qkv_prep_reference(*args, ref[0], ref[1], slots, SCALES[0], SCALES[1])
    torch.testing.assert_close(q, q_ref, atol=2e-6, rtol=2e-6)
    assert (_bytes(fused) != _bytes(ref)).float().mean() < 0.01
    for i in range(2):
        torch.testing.assert_close(
            dequantize_kv_reference(fused[i], SCALES[i]),
            dequantize_kv_reference(ref[i], SCALES[i]),
            rtol=0.126,
            atol=2**-9 * 0.05,
        )


# ---- TritonAttention against TorchAttention ---------------------------------------------------------------

BACKEND_CFG = TextConfig(  # two KV producers (sliding D=16, full D=32) and one KV-shared layer of each type
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    sliding_window=6,
    layer_types=[SLIDING, FULL, SLIDING, FULL],
    num_kv_shared_layers=2,
)


def _random_caches(pools: dict[str, int], page: int, gen) -> tuple[PagedKVCache, PagedKVCache]:
    """Two FP8 caches with the same random bytes (the cached prefix), block 0 NaN in the Triton one."""
    scales = {0: SCALES, 1: SCALES.flip(0)}
    caches = [PagedKVCache(BACKEND_CFG, pools, page, KV_FP8_DTYPE, "cpu", scales) for _ in range(2)]
    for layer, kv in caches[1].kv.items():
        for i in range(2):
            x = torch.randn(kv.shape[1:], generator=gen)
            _bytes(kv[i]).copy_(_bytes(quantize_kv_reference(x, scales[layer][i])))
        _bytes(caches[0].kv[layer]).copy_(_bytes(kv))
        _bytes(caches[0].kv[layer])[:, :page] = 0
        _bytes(kv)[:, :page] = NAN_BYTE  # a kernel that read block 0 would return NaN
    return caches[0], caches[1]


def _grow(tables, free, computed: list[int], query_lens: list[int], page: int) -> None:
    """Blocks for each sequence's new tokens; sliding blocks below the window freed (-1)."""
    for i, n in enumerate(query_lens):
        for pool, pool_tables in tables.items():
            while len(pool_tables[i]) * page < computed[i] + n:
                pool_tables[i].append(free[pool].pop())
        first = max(0, computed[i] - BACKEND_CFG.sliding_window + 1) // page
        tables[SLIDING][i][:first] = [-1] * first


def test_triton_backend_over_fp8_cache_matches_torch_backend():
    """Both backends write the same bytes and attend alike: a prefill with a prefix hit, a mixed step, and
    decodes across the sliding window (D=16) and on the full layer (D=32), KV-shared layers included."""
    gen = torch.Generator().manual_seed(21)
    cfg, page, num_blocks = BACKEND_CFG, 4, 24
    pools = {SLIDING: num_blocks, FULL: num_blocks}
    torch_cache, triton_cache = _random_caches(pools, page, gen)
    backends = [TorchAttention(cfg, torch_cache), TritonAttention(cfg, triton_cache)]
    free = {pool: (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist() for pool in pools}
    tables = {pool: [[free[pool].pop() for _ in range(2)], []] for pool in pools}  # seq 0: 8 cached tokens
    computed = [8, 0]
    for query_lens in ([5, 7], [1, 3], [1, 1], [1, 1], [1, 1]):
        _grow(tables, free, computed, query_lens, page)
        meta = contiguous_metadata(computed, query_lens, tables, page, "cpu")
        computed = [c + n for c, n in zip(computed, query_lens)]
        t = sum(query_lens)
        for layer in range(cfg.num_hidden_layers):
            d = cfg.layer_head_dim(layer)
            q = torch.randn(t, 4, d, generator=gen) * 0.5
            k = v = None
            if layer < cfg.first_kv_shared_layer:
                k, v = torch.randn(t, 2, d, generator=gen), torch.randn(t, 2, d, generator=gen)
            ref, out = (b.attend(layer, q, k, v, meta) for b in backends)
            _close(out, ref, 2e-5)
    for layer in cfg.kv_producer_layers:  # the same bytes in every block a sequence owns
        blocks = torch.tensor([b for table in tables[cfg.layer_types[layer]] for b in table if b > 0])
        rows = (blocks[:, None] * page + torch.arange(page)).flatten()
        assert torch.equal(_bytes(torch_cache.kv[layer][:, rows]), _bytes(triton_cache.kv[layer][:, rows]))
