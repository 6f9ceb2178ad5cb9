"""The compiled Triton attention kernels on CUDA against their torch references, on Gemma 4 shapes (bf16).

E4B: 8 q heads over 2 KV heads, sliding D=256 (window 512) and global D=512; 31B-like: 32 over 16
heads at D=256 (window 1024) and 32 over 4 at D=512. Contexts from 1 to 8192 tokens, page size 16.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from g4serve.config import FULL, SLIDING, TextConfig
from g4serve.engine.kv_cache import PagedKVCache
from g4serve.kernels.kv_cache_write import kv_cache_write, kv_cache_write_reference
from g4serve.kernels.paged_decode import paged_decode_attention, paged_decode_reference
from g4serve.kernels.paged_prefill import paged_prefill_attention, paged_prefill_reference
from g4serve.layers.attention import TorchAttention, TritonAttention, contiguous_metadata

pytestmark = pytest.mark.gpu

PAGE = 16
SHAPES = [
    # q heads, kv heads, head_dim, window
    pytest.param(8, 2, 256, 512, id="e4b-sliding"),
    pytest.param(8, 2, 512, None, id="e4b-global"),
    pytest.param(32, 16, 256, 1024, id="31b-sliding"),
    pytest.param(32, 4, 512, None, id="31b-global"),
]
DECODE_LENS = [1, 17, 511, 512, 513, 1025, 4096, 8192]


def _cache(num_tokens: int, kv_heads: int, head_dim: int, gen: torch.Generator):
    """Paged K/V for ``num_tokens`` with RMS-normalised rows (as Gemma 4's k_norm / v_norm make them)."""
    num_blocks = -(-num_tokens // PAGE) + 1
    k = torch.randn(num_blocks * PAGE, kv_heads, head_dim, device="cuda", generator=gen)
    v = torch.randn(num_blocks * PAGE, kv_heads, head_dim, device="cuda", generator=gen)
    return k.bfloat16(), v.bfloat16(), num_blocks


def _tables(seq_lens: list[int], num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    perm = (torch.randperm(num_blocks - 1, device="cuda", generator=gen) + 1).tolist()
    width = max(-(-n // PAGE) for n in seq_lens)
    rows = []
    for n in seq_lens:
        row = [perm.pop() for _ in range(-(-n // PAGE))]
        rows.append(row + [-1] * (width - len(row)))
    return torch.tensor(rows, dtype=torch.int32, device="cuda")


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("hq, hkv, head_dim, window", SHAPES)
@pytest.mark.parametrize("num_splits", [None, 1])
def test_decode_vs_reference(hq, hkv, head_dim, window, num_splits):
    gen = torch.Generator("cuda").manual_seed(head_dim + hq)
    k, v, num_blocks = _cache(sum(DECODE_LENS) + PAGE * len(DECODE_LENS), hkv, head_dim, gen)
    tables = _tables(DECODE_LENS, num_blocks, gen)
    lens = torch.tensor(DECODE_LENS, dtype=torch.int32, device="cuda")
    # Scores of a few units to tens, as with Gemma 4's normalised q and k at scale 1.0.
    q = (torch.randn(len(DECODE_LENS), hq, head_dim, device="cuda", generator=gen) * 0.25).bfloat16()
    out = paged_decode_attention(
        q, k, v, tables, lens, PAGE, window=window, num_splits=num_splits, max_seq_len=max(DECODE_LENS)
    )
    ref = paged_decode_reference(q, k, v, tables, lens, PAGE, window=window)
    _close(out, ref)


@pytest.mark.parametrize("hq, hkv, head_dim, window", SHAPES)
def test_prefill_vs_reference(hq, hkv, head_dim, window):
    """A fresh 700-token prompt, a 512-token chunk after a 4096-token prefix hit, a 1-token chunk, and a
    chunk near 8192 with an image span on sliding layers."""
    gen = torch.Generator("cuda").manual_seed(head_dim + hq + 1)
    before, query_lens = [0, 4096, 300, 7900], [700, 512, 1, 292]
    seq_lens = [b + n for b, n in zip(before, query_lens)]
    k, v, num_blocks = _cache(sum(seq_lens) + PAGE * len(seq_lens), hkv, head_dim, gen)
    tables = _tables(seq_lens, num_blocks, gen)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    positions = torch.cat([torch.arange(b, b + n, device="cuda") for b, n in zip(before, query_lens)])
    q = (torch.randn(int(starts[-1]), hq, head_dim, device="cuda", generator=gen) * 0.25).bfloat16()
    span = {}
    if window:
        lo = torch.full((q.shape[0],), -1, dtype=torch.int32, device="cuda")
        hi = lo.clone()
        inside = (positions >= 7950) & (positions < 8150)  # sequence 3's tokens 7950..8149
        lo[inside], hi[inside] = 7950, 8150
        span = {"span_lo": lo, "span_hi": hi}
    out = paged_prefill_attention(
        q,
        k,
        v,
        tables,
        torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        starts,
        positions,
        PAGE,
        max(query_lens),
        window=window,
        **span,
    )
    ref = paged_prefill_reference(
        q,
        k,
        v,
        tables,
        torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        starts,
        positions,
        PAGE,
        window=window,
        **span,
    )
    _close(out, ref)


def test_kv_cache_write_vs_reference():
    gen = torch.Generator("cuda").manual_seed(0)
    k = torch.randn(300, 2, 512, device="cuda", generator=gen).bfloat16()
    v = torch.randn(300, 2, 512, device="cuda", generator=gen).bfloat16()
    slots = torch.randperm(4096, device="cuda", generator=gen)[:300]
    slots[::7] = -1
    caches = [torch.zeros(2, 4096, 2, 512, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    kv_cache_write(k, v, caches[0][0], caches[0][1], slots)
    kv_cache_write_reference(k, v, caches[1][0], caches[1][1], slots)
    assert torch.equal(caches[0], caches[1])


def test_backend_matches_torch_attention_e4b_layers():
    """TritonAttention vs TorchAttention over an E4B-shaped layer pair (sliding 256 / global 512, 8/2
    heads): a mixed prefill + decode step, then pure decode steps, bf16."""
    cfg = TextConfig(
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        global_head_dim=512,
        sliding_window=512,
        layer_types=[SLIDING, FULL],
    )
    gen = torch.Generator("cuda").manual_seed(3)
    num_blocks = 512
    pools = {SLIDING: num_blocks, FULL: num_blocks}
    caches = [PagedKVCache(cfg, pools, PAGE, torch.bfloat16, "cuda") for _ in range(2)]
    backends = [TorchAttention(cfg, caches[0]), TritonAttention(cfg, caches[1])]
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
    lens = [1500, 900, 40]
    tables = {
        pool: [[perm.pop() for _ in range(-(-(n + 8) // PAGE))] for n in lens] for pool in (SLIDING, FULL)
    }
    before = [0, 0, 0]
    for query_lens in ([1500, 900, 40], [1, 1, 1], [1, 1, 1]):
        meta = contiguous_metadata(before, query_lens, tables, PAGE, "cuda")
        before = [b + n for b, n in zip(before, query_lens)]
        t = sum(query_lens)
        for layer in (0, 1):
            d = cfg.layer_head_dim(layer)
            q = (torch.randn(t, 8, d, device="cuda", generator=gen) * 0.25).bfloat16()
            k = torch.randn(t, 2, d, device="cuda", generator=gen).bfloat16()
            v = torch.randn(t, 2, d, device="cuda", generator=gen).bfloat16()
            ref, out = (b.attend(layer, q, k, v, meta) for b in backends)
            _close(out, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_elementwise_kernels_on_e4b_shapes(dtype):
    """The fused chains against their references at E4B widths (hidden 2560, head dims 256/512, MLP 10240)."""
    from g4serve.kernels.act_mul import act_mul, act_mul_reference
    from g4serve.kernels.norm_rope import norm_rope, norm_rope_reference
    from g4serve.kernels.rms_norm import fused_rms_norm, fused_rms_norm_reference
    from g4serve.layers.rotary import rope_cos_sin, text_inv_freq

    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape, s=1.0):
        return (s * torch.randn(*shape, device="cuda", generator=gen)).to(dtype)

    for t in (1, 37, 512):
        x, res, w, w2 = rand(t, 2560, s=4), rand(t, 2560), rand(2560), rand(2560)
        scale = torch.tensor([0.5], device="cuda", dtype=dtype)
        got = fused_rms_norm(x, w, 1e-6, residual=res, scale=scale, next_weight=w2)
        ref = fused_rms_norm_reference(x, w, 1e-6, residual=res, scale=scale, next_weight=w2)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)
        for head_dim, rope in (
            (256, {"rope_theta": 10000.0}),
            (512, {"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": 0.25}),
        ):
            qkv = rand(t, 10 * head_dim, s=3)
            q = qkv[:, : 8 * head_dim].view(t, 8, head_dim)
            cos, sin = rope_cos_sin(torch.arange(t, device="cuda") * 7, text_inv_freq(rope, head_dim), dtype)
            wq = rand(head_dim)
            torch.testing.assert_close(
                norm_rope(q, wq, 1e-6, cos, sin).float(),
                norm_rope_reference(q, wq, 1e-6, cos, sin).float(),
                atol=tol,
                rtol=tol,
            )
        # the vision tower's q/k norm + axial RoPE (head_dim 64, x/y halves)
        from g4serve.layers.rotary import vision_cos_sin, vision_inv_freq

        qv = rand(t, 12, 64, s=3)
        cos, sin = vision_cos_sin(
            torch.randint(0, 48, (1, t, 2), device="cuda"), vision_inv_freq(100.0, 64), dtype
        )
        wv = rand(64)
        torch.testing.assert_close(
            norm_rope(qv, wv, 1e-6, cos[0], sin[0], sections=2).float(),
            norm_rope_reference(qv, wv, 1e-6, cos[0], sin[0], sections=2).float(),
            atol=tol,
            rtol=tol,
        )
        gate_up = rand(t, 2 * 10240, s=3)
        a, b = gate_up[:, :10240], gate_up[:, 10240:]
        torch.testing.assert_close(
            act_mul("gelu_pytorch_tanh", a, b).float(),
            act_mul_reference("gelu_pytorch_tanh", a, b).float(),
            atol=tol,
            rtol=tol,
        )


@pytest.mark.parametrize("m", [1, 2, 8, 9, 16, 33, 64])
def test_skinny_matmul_on_e4b_decode_shapes(m):
    """The decode GEMM kernel with its default tiles (plain, fused MLP gate/up, fused PLE gate) at every e4b
    projection shape, bf16, against fp32 products rounded where the unfused ops round: 9-64 rows on the
    swapped tiles, K split where the default splits it (twice: the split counters left at zero)."""
    from g4serve.kernels.act_mul import act_mul_reference
    from g4serve.kernels.gemv import GATE_UP, MUL, PLAIN, skinny_matmul

    gen = torch.Generator(device="cuda").manual_seed(m)
    act = "gelu_pytorch_tanh"
    shapes = [
        (PLAIN, 3072, 2560),
        (PLAIN, 6144, 2560),
        (PLAIN, 2560, 2048),
        (PLAIN, 2560, 4096),
        (PLAIN, 2560, 10240),
        (PLAIN, 2560, 256),
        (PLAIN, 10752, 2560),
        (PLAIN, 262144, 2560),
        (GATE_UP, 10240, 2560),
        (MUL, 256, 2560),
    ]
    for ep, n, k in shapes:
        x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        w = (torch.randn(2 * n if ep == GATE_UP else n, k, device="cuda", generator=gen) * k**-0.5).bfloat16()
        other = torch.randn(m, 42, n, device="cuda", generator=gen).bfloat16()[:, 5] if ep == MUL else None
        out = skinny_matmul(x, w, ep, act if ep != PLAIN else None, other)
        again = skinny_matmul(x, w, ep, act if ep != PLAIN else None, other)
        assert torch.equal(out, again), f"{ep=} {n=} {k=}: a second launch differs"
        ref = x.float() @ w.float().T
        if ep == GATE_UP:
            ref = act_mul_reference(act, *ref.bfloat16().chunk(2, dim=-1))
        elif ep == MUL:
            ref = act_mul_reference(act, ref.bfloat16(), other)
        torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=2e-2, msg=f"{ep=} {n=} {k=}")


@dataclass
class PrologueCase:
    """Inputs of the fused attention prologue: fused qkv rows, q/k norm weights, RoPE tables, KV slots
    (-1: none) and the [2, slots, KV heads, D] cache written."""

    qkv: torch.Tensor
    head_dim: int
    hq: int
    hkv: int
    v_is_k: bool
    wq: torch.Tensor
    wk: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    slots: torch.Tensor
    cache: torch.Tensor


def prologue_case(head_dim: int, v_is_k: bool, cache_dtype: torch.dtype) -> PrologueCase:
    """E4B's head counts (8 q heads over 2 KV heads; D=512 with proportional partial RoPE), 37 tokens into a
    64-slot cache of ``cache_dtype``, every fifth slot -1."""
    from g4serve.layers.rotary import rope_cos_sin, text_inv_freq

    gen = torch.Generator(device="cuda").manual_seed(head_dim)
    t, hq, hkv = 37, 8, 2
    width = (hq + hkv * (1 if v_is_k else 2)) * head_dim
    qkv = (3 * torch.randn(t, width, device="cuda", generator=gen)).bfloat16()
    wq, wk = (torch.randn(head_dim, device="cuda", generator=gen).bfloat16() for _ in range(2))
    rope = (
        {"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": 0.25}
        if head_dim == 512
        else {"rope_theta": 10000.0}
    )
    cos, sin = rope_cos_sin(
        torch.arange(t, device="cuda") * 13, text_inv_freq(rope, head_dim), torch.bfloat16
    )
    slots = torch.randperm(64, device="cuda", generator=gen)[:t]
    slots[::5] = -1
    cache = torch.zeros(2, 64, hkv, head_dim, device="cuda", dtype=cache_dtype)
    return PrologueCase(qkv, head_dim, hq, hkv, v_is_k, wq, wk, cos, sin, slots, cache)


def fused_and_unfused_prologue(c: PrologueCase, scales: tuple | torch.Tensor = ()):
    """The fused prologue (``qkv_prep``) into ``c.cache``, and norm_rope + kv_cache_write (with the KV
    ``scales`` of an FP8 cache) into a copy of it: (fused q, unfused q, unfused K, unfused cache)."""
    from g4serve.kernels.norm_rope import norm_rope
    from g4serve.kernels.qkv_prep import qkv_prep

    ref_cache = c.cache.clone()
    q = qkv_prep(
        c.qkv, c.hq, c.hkv, c.wq, c.wk, 1e-6, c.cos, c.sin, c.cache[0], c.cache[1], c.slots, *scales,
        v_is_k=c.v_is_k,
    )  # fmt: skip
    heads = c.qkv.view(c.qkv.shape[0], -1, c.head_dim)
    k_raw = heads[:, c.hq : c.hq + c.hkv]
    v_raw = k_raw if c.v_is_k else heads[:, c.hq + c.hkv :]
    k, v = norm_rope(k_raw, c.wk, 1e-6, c.cos, c.sin), norm_rope(v_raw, None, 1e-6)
    kv_cache_write(k, v, ref_cache[0], ref_cache[1], c.slots, *scales)
    return q, norm_rope(heads[:, : c.hq], c.wq, 1e-6, c.cos, c.sin), k, ref_cache


@pytest.mark.parametrize("head_dim,v_is_k", [(256, False), (512, False), (512, True)])
def test_qkv_prep_equals_unfused_kernels(head_dim, v_is_k):
    """The fused attention prologue on the GPU, bit for bit the unfused norm_rope + kv_cache_write."""
    case = prologue_case(head_dim, v_is_k, torch.bfloat16)
    q, q_ref, _, ref_cache = fused_and_unfused_prologue(case)
    assert torch.equal(q, q_ref)
    assert torch.equal(case.cache, ref_cache)


TOP_P_KINDS = [  # temperature, top-p and min-p: the kernel's default path
    dict(temperature=1.0, top_p=0.9),
    dict(temperature=0.7, top_p=0.5),
    dict(temperature=0.8),
    dict(temperature=1.0, top_p=0.95, min_p=0.05),
]
TOP_K_KINDS = [  # with top-k: the radix select (G4SERVE_SORT_FREE_TOP_K)
    dict(temperature=1.0, top_k=64, top_p=0.95),
    dict(temperature=0.8, top_k=50),
    dict(temperature=1.0, top_k=1),
    dict(temperature=1.0, top_k=4096, top_p=0.9, min_p=0.01),
]


@pytest.mark.parametrize("rows", [1, 64])
@pytest.mark.parametrize("kinds", [TOP_P_KINDS, TOP_K_KINDS], ids=["top_p", "top_k"])
def test_top_p_sample_matches_the_sort_over_gemma_vocabulary(rows, kinds):
    """The sort-free kernel against the sampler's torch masks and sort (and ``torch.topk``) on the same
    noise, over Gemma 4's 262,144 ids, flat to peaked logits: the same token in all but a few rows (the two
    paths round the mass at the top-p boundary and the race's ratios differently), each drawn token kept by
    the torch filters, and with top-k scoring at least the row's k-th best."""
    from g4serve.kernels.top_p_sample import top_p_sample
    from g4serve.layers.sampler import SamplingBatch, _top_k_top_p_min_p
    from g4serve.sampling_params import SamplingParams

    vocab, trials = 262144, 8
    top_k = kinds is TOP_K_KINDS
    gen = torch.Generator(device="cuda").manual_seed(rows + (100 if top_k else 0))
    params = [SamplingParams(**kinds[i % len(kinds)]) for i in range(rows)]
    b = SamplingBatch.build(params, [None] * rows, vocab, "cuda")
    same = total = 0
    for trial in range(trials):
        logits = torch.randn(rows, vocab, device="cuda", generator=gen) * (0.5 + trial)
        noise = torch.empty(rows, vocab, device="cuda").exponential_(generator=gen)
        got = top_p_sample(logits, b.temperature, b.top_p, b.min_p, noise, top_k=b.top_k if top_k else None)
        scaled = logits / b.temperature.unsqueeze(1)
        kept = _top_k_top_p_min_p(scaled, b)
        want = (kept.softmax(dim=-1) / noise).argmax(dim=-1)
        assert torch.isfinite(kept.gather(1, got.unsqueeze(1))).all()
        if top_k:
            kth = torch.stack([scaled[r].topk(int(b.top_k[r])).values[-1] for r in range(rows)])
            assert (scaled.gather(1, got.unsqueeze(1)).squeeze(1) >= kth).all()
        same += int((got == want).sum())
        total += rows
    assert same >= total - max(1, total // 100), (same, total)


CHUNKED_KINDS = [  # what the chunked sampler takes: top-k up to 128 (top-p, min-p on it), temperature, min-p
    dict(temperature=1.0, top_k=64, top_p=0.95),
    dict(temperature=0.8, top_k=50),
    dict(temperature=1.0, top_k=1),
    dict(temperature=1.0, top_k=128, top_p=0.9, min_p=0.01),
    dict(temperature=0.8),
    dict(temperature=1.2, min_p=0.05),
]


@pytest.mark.parametrize("rows", [1, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_sample_matches_the_sort_over_gemma_vocabulary(rows, dtype):
    """The chunked sampler on the device (its Philox noise drawn in place) against the sampler's torch masks
    and sort on the same noise, over Gemma 4's 262,144 ids, flat to peaked logits: the same token
    in all but a few rows (the two paths round the top-p mass and the race's ratios differently), each drawn
    token kept by the torch filters, and with top-k scoring at least the row's k-th best."""
    from g4serve.kernels.chunked_sample import chunked_sample
    from g4serve.kernels.philox import exponential_noise
    from g4serve.layers.sampler import SamplingBatch, _top_k_top_p_min_p
    from g4serve.sampling_params import SamplingParams

    vocab, trials = 262144, 6
    gen = torch.Generator(device="cuda").manual_seed(rows + 7)
    params = [SamplingParams(**CHUNKED_KINDS[i % len(CHUNKED_KINDS)]) for i in range(rows)]
    b = SamplingBatch.build(params, list(range(rows)), vocab, "cuda", positions=[3] * rows)
    assert b.chunk_top_k is not None
    same = total = 0
    for trial in range(trials):
        b.positions += 1  # fresh noise a trial
        logits = (torch.randn(rows, vocab, device="cuda", generator=gen) * (0.5 + trial)).to(dtype)
        got = chunked_sample(
            logits, b.temperature, b.min_p, b.seeds, b.positions, b.top_k, b.top_p, b.chunk_top_k
        )
        # the noise kernel: its words equal the CPU reference's (test_philox_noise_on_cuda_equals_the_cpu_
        # reference), which at 64 rows of 262,144 ids takes a minute on the host
        noise = exponential_noise(b.seeds, b.positions, vocab)
        scaled = logits.float() / b.temperature.unsqueeze(1)
        kept = _top_k_top_p_min_p(scaled, b)
        want = (kept.softmax(dim=-1) / noise).argmax(dim=-1)
        assert torch.isfinite(kept.gather(1, got.unsqueeze(1))).all()
        ks = b.top_k.clamp(min=1).tolist()
        kth = torch.stack([scaled[r].topk(ks[r]).values[-1] for r in range(rows)])
        has_k = b.top_k > 0
        assert (scaled.gather(1, got.unsqueeze(1)).squeeze(1)[has_k] >= kth[has_k]).all()
        same += int((got == want).sum())
        total += rows
    assert same >= total - max(1, total // 100), (same, total)


def test_pixel_rescale_on_cuda_equals_the_cpu_processor():
    """The engine uploads uint8 patches and rescales them on the device: every byte value must give the
    float32 the CPU processor gives, for images (multiply) and video frames (division)."""
    from g4serve.processing.image import rescale_pixels

    x = torch.arange(256, dtype=torch.uint8).reshape(1, 16, 16)
    for video in (False, True):
        assert torch.equal(rescale_pixels(x.cuda(), video=video).cpu(), rescale_pixels(x, video=video)), video


def test_philox_noise_on_cuda_equals_the_cpu_reference():
    """Sampling noise keyed by (seed, position, token): the compiled kernel draws the CPU reference's values
    over Gemma's vocabulary (the same Philox words; the log within a few ulps), so a seeded request samples
    the same noise on either device."""
    from g4serve.kernels.philox import exponential_noise, exponential_noise_reference

    seeds = torch.tensor([0, 7, -1, 2**62 + 3], dtype=torch.int64)
    positions = torch.tensor([0, 5, 2**33 + 1, 4096], dtype=torch.int64)
    got = exponential_noise(seeds.cuda(), positions.cuda(), 262_144).cpu()
    torch.testing.assert_close(got, exponential_noise_reference(seeds, positions, 262_144), rtol=1e-6, atol=0)
