"""The FP8 (e4m3) KV cache's kernels compile to sm_90 cubins on the CPU machine (Triton's bundled ptxas), as
``test_quant_matmul``'s GEMM does: the interpreter runs them on CPU without the compiled language's checks (a
variable assigned in both branches of a runtime ``if`` must keep one type; tiles' shapes, dtypes and layouts
must lower), so a kernel can pass every interpreter test and still be rejected on an H100.

Each launch is taken from the real wrapper (``qkv_prep``, ``kv_cache_write``, ``paged_decode_attention``,
``paged_prefill_attention``) called on meta tensors at E4B's shapes (bf16, 8 q heads over 2 KV heads,
sliding D=256 with window 512, global D=512): the wrapper's constexprs, tile configs and launch options, with
the kernel swapped for a recorder. Triton's own binder then specialises the recorded arguments as a CUDA
launch would (dtypes, 16-byte alignment, integers equal to 1), and ``triton.compile`` builds the cubin.
PDL (``pdl()`` turns it on only for CUDA tensors) is switched on by hand for the decode-sized launches.
"""

from __future__ import annotations

import pytest
import torch

import g4serve.kernels.kv_cache_write as kv_cache_write_module
import g4serve.kernels.paged_decode as paged_decode_module
import g4serve.kernels.paged_prefill as paged_prefill_module
import g4serve.kernels.qkv_prep as qkv_prep_module
from g4serve.kernels.kv_cache_write import KV_FP8_DTYPE, kv_cache_write
from g4serve.kernels.paged_decode import decode_config, paged_decode_attention
from g4serve.kernels.paged_prefill import paged_prefill_attention, prefill_config
from g4serve.kernels.qkv_prep import qkv_prep

HQ, HKV, PAGE, WINDOW = 8, 2, 16, 512
H100_SHARED_BYTES = 227 * 1024  # the most shared memory one program (block) of an H100 may take
META = "meta"


class _Recorder:
    """Stands in for a ``DualKernel``: ``recorder[device][grid](*args, **meta)`` records the launch."""

    def __init__(self, kernel, launches: list):
        self.fn = kernel.compiled
        self.launches = launches

    def __getitem__(self, key):
        if isinstance(key, torch.device):
            return self
        return lambda *args, **kwargs: self.launches.append((self.fn, args, kwargs))


def _launches(monkeypatch, module, names: str, call) -> list:
    """The (kernel, args, meta) of every launch ``call`` makes of ``module``'s kernels ``names``."""
    launches: list = []
    for name in names.split():
        monkeypatch.setattr(module, name, _Recorder(getattr(module, name), launches))
    call()
    assert launches
    return launches


def _compile(fn, args, kwargs, use_pdl: bool = False):
    """Specialise the launch as ``JITFunction.run`` does on a GPU (its binder and ``_pack_args``: Triton
    internals, as of 3.8), then compile it for sm_90; the compiled kernel (its ``metadata.shared``: bytes of
    shared memory a program needs)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    if use_pdl and "USE_PDL" in kwargs:
        kwargs = kwargs | {"USE_PDL": True, "launch_pdl": True}
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    assert "fp8e4nv" in " ".join(signature.values()) or "KV_FP8" not in signature
    try:
        compiled = triton.compile(
            ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__
        )
    except (FileNotFoundError, PermissionError) as exc:  # no bundled ptxas on this machine
        pytest.skip(f"Triton cannot reach ptxas here: {exc}")
    assert compiled.asm["cubin"]
    return compiled


def _cache(head_dim: int, num_blocks: int = 64) -> torch.Tensor:
    """A layer's K/V pool [2, S, Hkv, D] in e4m3, as ``PagedKVCache`` holds it."""
    return torch.empty(2, num_blocks * PAGE, HKV, head_dim, dtype=KV_FP8_DTYPE, device=META)


def _scales() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty(HKV, device=META), torch.empty(HKV, device=META)


def _i32(*shape: int) -> torch.Tensor:
    return torch.empty(*shape, dtype=torch.int32, device=META)


@pytest.mark.parametrize(
    "dtype,head_dim,use_pdl",
    [(torch.bfloat16, d, pdl) for d in (256, 512) for pdl in (False, True)] + [(torch.float32, 512, False)],
)
def test_kv_write_compiles(monkeypatch, dtype, head_dim, use_pdl):
    """The KV write's quantization (fp32 rounding, then the cast to e4m3) from bf16 and fp32 rows."""
    cache = _cache(head_dim)
    k, v = (torch.empty(40, HKV, head_dim, dtype=dtype, device=META) for _ in range(2))
    slots = torch.empty(40, dtype=torch.long, device=META)
    launches = _launches(
        monkeypatch,
        kv_cache_write_module,
        "_kv_cache_write",
        lambda: kv_cache_write(k, v, cache[0], cache[1], slots, *_scales()),
    )
    for fn, args, kwargs in launches:
        _compile(fn, args, kwargs, use_pdl)


@pytest.mark.parametrize("head_dim", [256, 512])
@pytest.mark.parametrize("v_is_k", [False, True])
@pytest.mark.parametrize("num_tokens,use_pdl", [(1, True), (40, False), (300, False)])
def test_qkv_prep_compiles(monkeypatch, head_dim, v_is_k, num_tokens, use_pdl):
    """The fused prologue into an FP8 cache (the q branch's rows stay fp32, the K/V branches' become e4m3):
    decode-sized launches (one token: num_tokens specialised to 1; with PDL and without), and a prefill-sized
    one (several token blocks)."""
    dtype = torch.bfloat16
    width = (HQ + HKV * (1 if v_is_k else 2)) * head_dim
    qkv = torch.empty(num_tokens, width, dtype=dtype, device=META)
    wq, wk = torch.empty(head_dim, dtype=dtype, device=META), torch.empty(head_dim, dtype=dtype, device=META)
    cos, sin = (torch.empty(num_tokens, head_dim, dtype=dtype, device=META) for _ in range(2))
    cache = _cache(head_dim)
    slots = torch.empty(num_tokens, dtype=torch.long, device=META)
    launches = _launches(
        monkeypatch,
        qkv_prep_module,
        "_qkv_prep",
        lambda: qkv_prep(
            qkv, HQ, HKV, wq, wk, 1e-6, cos, sin, cache[0], cache[1], slots, *_scales(), v_is_k=v_is_k
        ),
    )
    for fn, args, kwargs in launches:
        _compile(fn, args, kwargs, use_pdl)


DECODE_LAYERS = [
    pytest.param(256, WINDOW, False, id="sliding"),
    pytest.param(256, WINDOW, True, id="sliding-spans"),
    pytest.param(512, None, False, id="global"),
]


@pytest.mark.parametrize("head_dim,window,spans", DECODE_LAYERS)
@pytest.mark.parametrize("num_splits", [1, 8])
@pytest.mark.parametrize("use_pdl", [False, True])
def test_paged_decode_compiles(monkeypatch, head_dim, window, spans, num_splits, use_pdl):
    """Decode over an FP8 cache, unsplit and split-KV (the split kernel and its merge)."""
    batch = 4
    q = torch.empty(batch, HQ, head_dim, dtype=torch.bfloat16, device=META)
    cache = _cache(head_dim)
    span_lo, span_hi = (_i32(batch), _i32(batch)) if spans else (None, None)
    launches = _launches(
        monkeypatch,
        paged_decode_module,
        "_paged_decode _paged_decode_reduce",
        lambda: paged_decode_attention(
            q,
            cache[0],
            cache[1],
            _i32(batch, 64),
            _i32(batch),
            PAGE,
            window=window,
            span_lo=span_lo,
            span_hi=span_hi,
            num_splits=num_splits,
            k_scale=_scales()[0],
            v_scale=_scales()[1],
        ),
    )
    assert len(launches) == (2 if num_splits > 1 else 1)
    # the FP8 cache's own tiles (twice bf16's keys at D = 512), within an H100 SM's shared memory
    cfg = decode_config(head_dim, kv_fp8=True)
    assert cfg != decode_config(head_dim)
    _, _, meta = launches[0]
    assert (meta["BLOCK_N"], meta["num_warps"], meta["num_stages"]) == tuple(
        cfg[k] for k in ("block_n", "num_warps", "num_stages")
    )
    for fn, args, kwargs in launches:
        assert _compile(fn, args, kwargs, use_pdl).metadata.shared <= H100_SHARED_BYTES


PREFILL_LAYERS = [
    pytest.param(256, WINDOW, False, id="sliding"),
    pytest.param(256, WINDOW, True, id="sliding-spans"),
    pytest.param(512, None, False, id="global"),
]


@pytest.mark.parametrize("head_dim,window,spans", PREFILL_LAYERS)
@pytest.mark.parametrize("seq_indices", [False, True])
@pytest.mark.parametrize("small_tiles", [False, True])
def test_paged_prefill_compiles(monkeypatch, head_dim, window, spans, seq_indices, small_tiles):
    """Prefill over an FP8 cache with the H100 tile configs: the default tiles (D=512: output dims in two
    chunks) and the small tiles a launch of few programs gets; the mixed step's sequence subset."""
    num_tokens, num_seqs = 300, 2
    q = torch.empty(num_tokens, HQ, head_dim, dtype=torch.bfloat16, device=META)
    cache = _cache(head_dim)
    span_lo, span_hi = (_i32(num_tokens), _i32(num_tokens)) if spans else (None, None)
    tiles = {}
    if small_tiles:
        cfg = prefill_config(head_dim, HQ // HKV, num_programs_hint=1, num_sms=132)
        tiles = {k: cfg[k] for k in ("block_m", "block_n", "dv_chunks", "num_warps", "num_stages")}
    launches = _launches(
        monkeypatch,
        paged_prefill_module,
        "_paged_prefill",
        lambda: paged_prefill_attention(
            q,
            cache[0],
            cache[1],
            _i32(num_seqs, 64),
            _i32(num_seqs),
            _i32(num_seqs + 1),
            _i32(num_tokens),
            PAGE,
            max_query_len=num_tokens,
            window=window,
            span_lo=span_lo,
            span_hi=span_hi,
            seq_indices=_i32(1) if seq_indices else None,
            k_scale=_scales()[0],
            v_scale=_scales()[1],
            **tiles,
        ),
    )
    for fn, args, kwargs in launches:
        _compile(fn, args, kwargs)
