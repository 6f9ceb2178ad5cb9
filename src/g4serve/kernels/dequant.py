"""A quantized weight written out dense in one launch, for the GEMMs that are better on cuBLAS.

At prefill sizes (and int4 decode batches past ``G4SERVE_INT4_DENSE_ROWS``) a quantized projection runs
fastest as its dense bf16 weight through cuBLAS: the weight is read once per call either way, and cuBLAS's
tensor-core GEMM beats the dequantizing 2-D grid of ``quant_matmul`` by a wide margin at large M (e4b int4
prefill of 2,048 tokens: 69 ms on that grid on an H200, bf16 20.8). The torch ``dequantize_reference``
builds five full-size temporaries to get there; this kernel reads the packed words (int4: compressed-tensors'
eight nibbles per int32) or FP8 bytes, the per-block scales and the zero points once, and writes the dense
weight once: (q - z) * s in fp32, rounded once to the output dtype, exactly the reference's arithmetic.
"""

from __future__ import annotations

import torch
import triton.language as tl

from g4serve.kernels._launch import DualKernel
from g4serve.kernels.quant_matmul import _dequant, _groups_per_tile, _load_raw, _round_to


def _dequantize_fn(
    W,
    S,
    Z,
    Out,
    N,
    K,
    num_groups,
    stride_w,
    stride_s,
    stride_z,
    stride_o,
    scale_bn,
    scale_bk,
    INT4: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    GROUPS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # the tile as quant_matmul's GEMMs read it: whole packed words, one scale (and zero point) per group
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rows < N
    k0 = tl.program_id(1) * BLOCK_K
    w, s, z = _load_raw(
        W, S, Z, rows, n_mask, k0, K, num_groups, stride_w, stride_s, stride_z, scale_bn, scale_bk,
        BLOCK_K, INT4, HAS_ZERO, GROUPS,
    )  # fmt: skip
    # (q - z) * s in fp32, rounded once to nearest even (_round_to: the interpreter's own bf16 cast truncates)
    dense = _round_to(_dequant(w, s, z, BLOCK_N, BLOCK_K, INT4, HAS_ZERO, GROUPS), Out.dtype.element_ty)
    cols = k0 + tl.arange(0, BLOCK_K)
    mask = n_mask[:, None] & (cols < K)[None, :]
    out = Out + rows.to(tl.int64)[:, None] * stride_o + cols[None, :]
    tl.store(out, dense.to(Out.dtype.element_ty), mask=mask)


_dequantize = DualKernel(_dequantize_fn)


def tile_k(scale_bk: int, k: int, widest: int = 512) -> int:
    """The widest power-of-two K tile up to ``widest`` that nests with the scale blocks (one tile spans
    whole scale blocks, or lies inside one)."""
    block = widest
    while block > 8 and not (scale_bk >= k or scale_bk % block == 0 or block % scale_bk == 0):
        block //= 2
    return block


def dequantize(
    weight: torch.Tensor,
    scale: torch.Tensor,
    scale_block: tuple[int, int],
    in_features: int,
    zero_point: torch.Tensor | None = None,
    dtype: torch.dtype = torch.bfloat16,
    block_n: int = 16,
    block_k: int | None = None,
) -> torch.Tensor:
    """The dense weight [N, in_features] in ``dtype`` of an int4 (int32 words [N, ceil(K / 8)]) or FP8
    ([N, K]) weight with per-block ``scale`` [ceil(N / bn), ceil(K / bk)] and int8 ``zero_point`` [N,
    ceil(K / bk)] (asymmetric int4); ``quant_matmul.dequantize_reference``'s result, bit for bit."""
    int4 = weight.dtype == torch.int32
    n = weight.shape[0]
    if zero_point is not None:
        assert int4, "zero points come with int4 weights"
    assert weight.stride(-1) == 1 and scale.stride(-1) == 1
    out = torch.empty(n, in_features, dtype=dtype, device=weight.device)
    if n and in_features:
        bn, bk = scale_block
        block_k = block_k or tile_k(bk, in_features)
        z = zero_point if zero_point is not None else scale
        _dequantize[weight.device][(-(-n // block_n), -(-in_features // block_k))](
            weight,
            scale,
            z,
            out,
            n,
            in_features,
            scale.shape[1],
            weight.stride(0),
            scale.stride(0),
            z.stride(0),
            out.stride(0),
            bn,
            bk,
            INT4=int4,
            HAS_ZERO=zero_point is not None,
            GROUPS=_groups_per_tile(block_k, bk, in_features),
            BLOCK_N=block_n,
            BLOCK_K=block_k,
        )
    return out
