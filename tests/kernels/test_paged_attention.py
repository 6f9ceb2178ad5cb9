"""Paged decode / prefill kernels and the KV write against their torch references, and TritonAttention
against TorchAttention, on tiny shapes.

The kernels run in Triton's interpreter because the tensors are on the CPU (``g4serve.kernels._launch``
builds each kernel for both); no process-wide ``TRITON_INTERPRET`` is set, so nothing leaks into the
other test modules. Block 0 of every cache holds NaN and is never handed to a sequence: a kernel
that reads a freed (-1) block or an unmasked key outside its range turns the output into NaN.
"""

from __future__ import annotations

import pytest
import torch

import g4serve.kernels.paged_decode as paged_decode_module
from g4serve.config import FULL, SLIDING, TextConfig
from g4serve.engine.kv_cache import PagedKVCache
from g4serve.kernels.kv_cache_write import kv_cache_write, kv_cache_write_reference
from g4serve.kernels.paged_decode import decode_num_splits, paged_decode_attention, paged_decode_reference
from g4serve.kernels.paged_prefill import paged_prefill_attention, paged_prefill_reference
from g4serve.layers.attention import TorchAttention, TritonAttention, contiguous_metadata

TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


def _paged_cache(num_blocks: int, page: int, kv_heads: int, head_dim: int, dtype, gen):
    k = torch.randn(num_blocks * page, kv_heads, head_dim, generator=gen)
    v = torch.randn(num_blocks * page, kv_heads, head_dim, generator=gen)
    k[:page] = v[:page] = float("nan")  # block 0: poison, never allocated
    return k.to(dtype), v.to(dtype)


def _block_tables(
    seq_lens: list[int],
    page: int,
    num_blocks: int,
    gen,
    window: int | None = None,
    first_query_pos: list[int] | None = None,
) -> torch.Tensor:
    """Random distinct blocks (never block 0); with a window, blocks no query can see are freed (-1)
    the way KVCacheManager frees them."""
    width = max(-(-n // page) for n in seq_lens)
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    rows = []
    for i, n in enumerate(seq_lens):
        row = [perm.pop() for _ in range(-(-n // page))]
        if window is not None:
            first = first_query_pos[i] if first_query_pos else n - 1
            for j in range(max(0, first - window + 1) // page):
                row[j] = -1
        rows.append(row + [-1] * (width - len(row)))
    return torch.tensor(rows, dtype=torch.int32)


# ---- decode ---------------------------------------------------------------------------------------

DECODE_CASES = [
    # head_dim, q heads, kv heads, page, seq_lens, window, num_splits, block_n
    pytest.param(16, 2, 2, 4, [1, 9, 33], None, 1, 16, id="mha-d16"),
    pytest.param(32, 4, 2, 4, [8, 9, 12, 16, 17, 3], 8, 1, 16, id="gqa2-window-boundaries"),
    pytest.param(16, 8, 2, 8, [300, 5], None, 5, 16, id="gqa4-split5-long"),
    pytest.param(16, 4, 1, 8, [300, 47, 48, 49], 40, 3, 16, id="gqa4-window-split3-freed"),
    pytest.param(32, 4, 2, 16, [1], None, 4, 16, id="one-token-more-splits-than-tiles"),
]


@pytest.mark.parametrize("early_table", [False, True])  # (G4SERVE_DECODE_EARLY_TABLE: the same arithmetic)
@pytest.mark.parametrize("head_dim, hq, hkv, page, seq_lens, window, num_splits, block_n", DECODE_CASES)
def test_decode_matches_reference(
    monkeypatch, head_dim, hq, hkv, page, seq_lens, window, num_splits, block_n, early_table
):
    monkeypatch.setattr(paged_decode_module, "EARLY_TABLE", early_table)
    gen = torch.Generator().manual_seed(sum(seq_lens) + head_dim)
    k_cache, v_cache = _paged_cache(128, page, hkv, head_dim, torch.float32, gen)
    tables = _block_tables(seq_lens, page, 128, gen, window)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    q = torch.randn(len(seq_lens), hq, head_dim, generator=gen)
    out = paged_decode_attention(
        q, k_cache, v_cache, tables, lens, page, window=window, num_splits=num_splits, block_n=block_n
    )
    ref = paged_decode_reference(q, k_cache, v_cache, tables, lens, page, window=window)
    _close(out, ref, torch.float32)


@pytest.mark.parametrize("window", [None, 24])
def test_decode_splits_without_tiles_are_neither_written_nor_read(monkeypatch, window):
    """A CUDA graph fixes the split count for its longest context: short sequences leave most splits
    without tiles. Partial buffers start as NaN here, so a merge that read an unwritten split would
    return NaN; a split without tiles that wrote would leave no NaN behind."""
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = _paged_cache(128, 8, 2, 16, torch.float32, gen)
    seq_lens = [300, 5, 40]
    tables = _block_tables(seq_lens, 8, 128, gen, window)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    q = torch.randn(3, 4, 16, generator=gen)
    partials = []
    empty = torch.empty

    def nan_empty(*shape, **kw):
        t = empty(*shape, **kw).fill_(float("nan"))
        partials.append(t)
        return t

    monkeypatch.setattr(torch, "empty", nan_empty)
    monkeypatch.setattr(
        torch, "empty_like", lambda t, **kw: nan_empty(*t.shape, dtype=t.dtype, device=t.device)
    )
    out = paged_decode_attention(
        q, k_cache, v_cache, tables, lens, 8, window=window, num_splits=8, block_n=16
    )
    monkeypatch.undo()
    _close(out, paged_decode_reference(q, k_cache, v_cache, tables, lens, 8, window=window), torch.float32)
    part_m = next(t for t in partials if t.dim() == 3 and t.shape[-1] == 8)
    written = ~part_m.isnan()[:, 0]  # [sequence, split]
    # 300 keys: 19 tiles of 16 (2 in the window of 24), 3 per split; 5 keys: one tile; 40 keys: 3 (2).
    expected = [[True] * 7 + [False], [True] + [False] * 7, [True] * 3 + [False] * 5]
    if window:
        expected = [[True] * 2 + [False] * 6, [True] + [False] * 7, [True] * 2 + [False] * 6]
    assert written.tolist() == expected


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_half_precision_accumulates_in_fp32(dtype):
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache = _paged_cache(64, 8, 2, 32, dtype, gen)
    seq_lens = [70, 13]
    tables = _block_tables(seq_lens, 8, 64, gen)
    q = torch.randn(2, 4, 32, generator=gen).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, 8, num_splits=2, block_n=16)
    assert out.dtype == dtype
    ref = paged_decode_reference(q.float(), k_cache.float(), v_cache.float(), tables, lens, 8)
    _close(out, ref, dtype)


@pytest.mark.parametrize("head_dim, hq, hkv", [(256, 4, 2), (512, 8, 2)])
def test_decode_gemma_head_dims(head_dim, hq, hkv):
    gen = torch.Generator().manual_seed(head_dim)
    k_cache, v_cache = _paged_cache(16, 16, hkv, head_dim, torch.float32, gen)
    seq_lens = [40]
    tables = _block_tables(seq_lens, 16, 16, gen)
    # Gemma 4 RMS-normalises q and k and uses scale 1.0: scores are O(10), not O(1).
    q = torch.randn(1, hq, head_dim, generator=gen) * 0.3
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, 16, num_splits=2)
    ref = paged_decode_reference(q, k_cache, v_cache, tables, lens, 16)
    _close(out, ref, torch.float32)


def test_decode_bidirectional_span_and_auto_splits():
    """A query inside an image span also sees the span's later keys (hi past the query's position)."""
    gen = torch.Generator().manual_seed(7)
    k_cache, v_cache = _paged_cache(64, 4, 2, 16, torch.float32, gen)
    cache_lens = [30, 30, 12]
    tables = _block_tables(cache_lens, 4, 64, gen)
    ctx = torch.tensor([20, 30, 5], dtype=torch.int32)  # query positions 19, 29, 4
    lo = torch.tensor([15, -1, 2], dtype=torch.int32)
    hi = torch.tensor([26, -1, 12], dtype=torch.int32)
    q = torch.randn(3, 4, 16, generator=gen)
    for window in (None, 8):
        spans = {"span_lo": lo, "span_hi": hi}
        out = paged_decode_attention(
            q, k_cache, v_cache, tables, ctx, 4, window=window, num_sms=2, block_n=16, **spans
        )
        ref = paged_decode_reference(q, k_cache, v_cache, tables, ctx, 4, window=window, **spans)
        _close(out, ref, torch.float32)


def test_decode_split_policy():
    assert decode_num_splits(64, 8, 4096, 64, num_sms=132) == 2  # 512 programs already: little splitting
    assert decode_num_splits(1, 2, 16384, 32, num_sms=132) == 64  # capped
    assert decode_num_splits(1, 2, 100, 64, num_sms=132) == 1  # too short to split
    assert decode_num_splits(4, 2, 2048, 64, num_sms=132) == 8  # length-bound: >= 4 tiles per split
    # G4SERVE_DECODE_PROGRAMS_PER_SM's target: e4b at B = 64 (2 KV heads, 128 programs) in a graph
    assert decode_num_splits(64, 2, 1 << 17, 32, num_sms=132) == 5
    assert decode_num_splits(64, 2, 1 << 17, 32, num_sms=132, programs_per_sm=2) == 3
    assert decode_num_splits(64, 2, 1 << 17, 32, num_sms=132, programs_per_sm=1) == 2
    assert decode_num_splits(66, 2, 1 << 17, 32, num_sms=132, programs_per_sm=1) == 1


# ---- prefill --------------------------------------------------------------------------------------


def _varlen(before: list[int], query_lens: list[int]):
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    positions = torch.cat([torch.arange(b, b + n) for b, n in zip(before, query_lens)])
    seq_lens = torch.tensor([b + n for b, n in zip(before, query_lens)], dtype=torch.int32)
    return torch.tensor(starts, dtype=torch.int32), positions, seq_lens


def _spans_per_token(positions: torch.Tensor, starts: list[int], spans: dict[int, tuple[int, int]]):
    lo = torch.full_like(positions, -1, dtype=torch.int32)
    hi = lo.clone()
    for seq, (s_lo, s_hi) in spans.items():
        for t in range(starts[seq], starts[seq + 1]):
            if s_lo <= int(positions[t]) < s_hi:
                lo[t], hi[t] = s_lo, s_hi
    return lo, hi


PREFILL_CASES = [
    # head_dim, q heads, kv heads, page, context before the chunk, chunk lengths, window, spans
    pytest.param(16, 2, 2, 4, [0, 0], [9, 1], None, None, id="mha-fresh"),
    pytest.param(32, 4, 2, 4, [0, 5, 20], [7, 1, 13], None, None, id="gqa2-prefix-hits"),
    pytest.param(16, 8, 2, 8, [0, 33], [21, 18], 8, None, id="gqa4-window"),
    pytest.param(32, 4, 1, 4, [9, 0], [12, 16], 8, {0: (11, 17), 1: (2, 9)}, id="gqa4-window-spans"),
    pytest.param(16, 4, 2, 4, [3], [14], None, {0: (5, 12)}, id="causal-spans"),
]


@pytest.mark.parametrize("head_dim, hq, hkv, page, before, query_lens, window, spans", PREFILL_CASES)
def test_prefill_matches_reference(head_dim, hq, hkv, page, before, query_lens, window, spans):
    gen = torch.Generator().manual_seed(sum(query_lens) + head_dim)
    k_cache, v_cache = _paged_cache(64, page, hkv, head_dim, torch.float32, gen)
    starts, positions, seq_lens = _varlen(before, query_lens)
    tables = _block_tables(seq_lens.tolist(), page, 64, gen, window, first_query_pos=before)
    q = torch.randn(int(starts[-1]), hq, head_dim, generator=gen)
    span_kw = {}
    if spans:
        lo, hi = _spans_per_token(positions, starts.tolist(), spans)
        span_kw = {"span_lo": lo, "span_hi": hi}
    out = paged_prefill_attention(
        q,
        k_cache,
        v_cache,
        tables,
        seq_lens,
        starts,
        positions,
        page,
        max(query_lens),
        window=window,
        block_m=16,
        block_n=8,
        **span_kw,
    )
    ref = paged_prefill_reference(
        q, k_cache, v_cache, tables, seq_lens, starts, positions, page, window=window, **span_kw
    )
    _close(out, ref, torch.float32)


def test_prefill_subset_dv_chunks_and_bf16():
    """seq_indices leaves the other sequences' rows alone; split output dims; bf16 in, fp32 inside."""
    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        k_cache, v_cache = _paged_cache(64, 4, 2, 32, dtype, gen)
        starts, positions, seq_lens = _varlen([0, 6, 2], [10, 1, 5])
        tables = _block_tables(seq_lens.tolist(), 4, 64, gen)
        q = torch.randn(int(starts[-1]), 4, 32, generator=gen).to(dtype)
        out = torch.zeros_like(q)
        paged_prefill_attention(
            q,
            k_cache,
            v_cache,
            tables,
            seq_lens,
            starts,
            positions,
            4,
            10,
            seq_indices=torch.tensor([0, 2], dtype=torch.int32),
            out=out,
            block_m=16,
            block_n=8,
            dv_chunks=2,
        )
        ref = paged_prefill_reference(
            q.float(), k_cache.float(), v_cache.float(), tables, seq_lens, starts, positions, 4
        )
        assert (out[10] == 0).all()
        keep = torch.tensor([i for i in range(16) if i != 10])
        _close(out[keep], ref[keep], dtype)


@pytest.mark.parametrize("head_dim, hq, hkv", [(256, 4, 2), (512, 8, 2)])
def test_prefill_gemma_head_dims(head_dim, hq, hkv):
    gen = torch.Generator().manual_seed(head_dim + 1)
    k_cache, v_cache = _paged_cache(16, 16, hkv, head_dim, torch.float32, gen)
    starts, positions, seq_lens = _varlen([20], [12])
    tables = _block_tables(seq_lens.tolist(), 16, 16, gen)
    q = torch.randn(12, hq, head_dim, generator=gen) * 0.3
    out = paged_prefill_attention(q, k_cache, v_cache, tables, seq_lens, starts, positions, 16, 12, window=16)
    ref = paged_prefill_reference(q, k_cache, v_cache, tables, seq_lens, starts, positions, 16, window=16)
    _close(out, ref, torch.float32)


# ---- KV write ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_write_matches_reference(dtype):
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(7, 2, 32, generator=gen).to(dtype)
    v = torch.randn(7, 2, 32, generator=gen).to(dtype)
    slots = torch.tensor([3, -1, 17, 0, 9, -1, 31])
    caches = [torch.zeros(2, 32, 2, 32, dtype=dtype) for _ in range(2)]
    kv_cache_write(k, v, caches[0][0], caches[0][1], slots)
    kv_cache_write_reference(k, v, caches[1][0], caches[1][1], slots)
    assert torch.equal(caches[0], caches[1])


# ---- TritonAttention vs TorchAttention ---------------------------------------------------------------


def _text_config(hq: int = 4, hkv: int = 2, bidirectional: bool = True) -> TextConfig:
    # Two KV producers (sliding D=16, full D=32) and one KV-shared layer of each type.
    return TextConfig(
        num_hidden_layers=4,
        num_attention_heads=hq,
        num_key_value_heads=hkv,
        head_dim=16,
        global_head_dim=32,
        sliding_window=6,
        layer_types=[SLIDING, FULL, SLIDING, FULL],
        num_kv_shared_layers=2,
        use_bidirectional_attention="vision" if bidirectional else None,
    )


class _Sequences:
    """A tiny stand-in for KVCacheManager: random blocks per pool, sliding blocks freed out of window."""

    def __init__(self, cfg: TextConfig, page: int, num_blocks: int, gen):
        self.cfg, self.page = cfg, page
        self.free = {
            pool: (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist() for pool in (SLIDING, FULL)
        }
        self.tables: dict[str, list[list[int]]] = {SLIDING: [], FULL: []}
        self.computed: list[int] = []

    def add(self, computed: int = 0) -> None:
        self.computed.append(computed)
        for pool in (SLIDING, FULL):
            self.tables[pool].append([])
        self._grow(len(self.computed) - 1, computed)

    def _grow(self, i: int, total: int) -> None:
        for pool in (SLIDING, FULL):
            table = self.tables[pool][i]
            while len(table) * self.page < total:
                table.append(self.free[pool].pop())

    def step(self, query_lens: list[int], spans=None):
        for i, n in enumerate(query_lens):
            first = max(0, self.computed[i] - self.cfg.sliding_window + 1) // self.page
            for j in range(first):
                self.tables[SLIDING][i][j] = -1
            self._grow(i, self.computed[i] + n)
        meta = contiguous_metadata(self.computed, query_lens, self.tables, self.page, "cpu", spans)
        self.computed = [c + n for c, n in zip(self.computed, query_lens)]
        return meta


def _run_step(cfg, backends, meta, gen, dtype, keep=None):
    """Every layer of one forward pass on each backend; KV-shared layers run on ``keep`` tokens only."""
    outs = []
    t = meta.positions.shape[0]
    for layer in range(cfg.num_hidden_layers):
        shared = layer >= cfg.first_kv_shared_layer
        layer_meta = meta.select_queries(keep) if shared and keep is not None else meta
        rows = layer_meta.positions.shape[0]
        d, hkv = cfg.layer_head_dim(layer), cfg.layer_num_kv_heads(layer)
        q = torch.randn(rows, cfg.num_attention_heads, d, generator=gen).to(dtype)
        k = v = None
        if not shared:
            k = torch.randn(t, hkv, d, generator=gen).to(dtype)
            v = torch.randn(t, hkv, d, generator=gen).to(dtype)
        outs.append([b.attend(layer, q, k, v, layer_meta) for b in backends])
    return outs


@pytest.mark.parametrize(
    "dtype, hq, hkv", [(torch.float32, 4, 2), (torch.float32, 4, 1), (torch.bfloat16, 4, 2)]
)
def test_triton_backend_matches_torch_backend(dtype, hq, hkv):
    """Prefill with a prefix hit and an image span, a mixed chunk + decode step, decodes across the
    sliding window and block boundaries, and a fast-prefill step (KV-shared layers on kept tokens)."""
    gen = torch.Generator().manual_seed(11)
    cfg = _text_config(hq, hkv)
    page, num_blocks = 4, 48
    torch_cache = PagedKVCache(cfg, {SLIDING: num_blocks, FULL: num_blocks}, page, dtype, "cpu")
    triton_cache = PagedKVCache(cfg, {SLIDING: num_blocks, FULL: num_blocks}, page, dtype, "cpu")
    for layer, kv in triton_cache.kv.items():
        kv.normal_(generator=gen)
        kv[:, :page] = float("nan")  # block 0: never allocated
        torch_cache.kv[layer].copy_(kv)
        torch_cache.kv[layer][:, :page] = 0  # TorchAttention multiplies masked keys' values by 0
    backends = [TorchAttention(cfg, torch_cache), TritonAttention(cfg, triton_cache, decode_num_splits=None)]
    seqs = _Sequences(cfg, page, num_blocks, gen)
    seqs.add(0)
    seqs.add(0)
    seqs.add(8)  # prefix-cache hit: 8 tokens already in the cache
    spans = [[], [(3, 6)], [(9, 13)]]

    steps = [([11, 5, 6], None), ([1, 2, 1], None), ([1, 1, 1], None), ([1, 1, 1], None)]
    steps += [([1, 1, 1], None)] * 3
    steps += [([4, 0, 3], [3, 6])]  # fast prefill: KV-shared layers see only the last token of each chunk
    for query_lens, keep in steps:
        meta = seqs.step(query_lens, spans)
        for ref, out in _run_step(cfg, backends, meta, gen, dtype, keep):
            _close(out, ref, dtype)
    for layer in cfg.kv_producer_layers:  # the caches agree wherever a sequence owns a block
        for pool_table in seqs.tables.values():
            for table in pool_table:
                for block in table:
                    if block > 0:
                        rows = slice(block * page, (block + 1) * page)
                        assert torch.equal(torch_cache.kv[layer][:, rows], triton_cache.kv[layer][:, rows])


def test_triton_backend_decode_only_splits_and_subset_sequences():
    """Pure decode with forced splits, and a decode batch in which one sequence has no query."""
    gen = torch.Generator().manual_seed(12)
    cfg = _text_config(4, 2, bidirectional=False)
    page, num_blocks = 4, 64
    pools = {SLIDING: num_blocks, FULL: num_blocks}
    caches = [PagedKVCache(cfg, pools, page, torch.float32, "cpu") for _ in range(2)]
    backends = [TorchAttention(cfg, caches[0]), TritonAttention(cfg, caches[1], decode_num_splits=3)]
    seqs = _Sequences(cfg, page, num_blocks, gen)
    seqs.add(0)
    seqs.add(0)
    for query_lens, keep in [([30, 9], None), ([1, 1], None), ([1, 1], [0])]:
        meta = seqs.step(query_lens)
        for ref, out in _run_step(cfg, backends, meta, gen, torch.float32, keep):
            _close(out, ref, torch.float32)


# ---- in the engine ------------------------------------------------------------------------------------


def test_engine_greedy_tokens_unchanged_with_triton_backend(tiny_model_dir):
    """Chunked prefill, mixed batches, prefix-cache hits and sliding-window frees on the tiny model."""
    from g4serve.engine.engine import EngineConfig, LLMEngine
    from g4serve.sampling_params import SamplingParams

    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_model_dir),
            device="cpu",
            dtype="float32",
            kv_cache_bytes=4 << 20,
            max_num_batched_tokens=24,
            max_num_seqs=4,
            text_only=True,
        )
    )
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = ["a long question about the card payment statement " * 2, "Hi"]

    def run(tag: str) -> list[list[int]]:
        for i, prompt in enumerate(prompts):
            engine.add_request(engine.make_request(f"{tag}{i}", engine.process_prompt(prompt), params))
        results = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = out.outputs[0].token_ids
        return [results[f"{tag}{i}"] for i in range(len(prompts))]

    reference = run("torch")
    engine.runner.backend = TritonAttention(engine.model_config.text, engine.kv_cache)
    assert run("triton") == reference  # the second pass also hits the prefix cache
