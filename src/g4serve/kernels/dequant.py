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
from g4serve.kernels.quant_matmul import _round_to


def _dequantize_fn(
    W,
    S,
    Z,
    Out,
    N,
    K,
    stride_w,
    stride_s,
    stride_z,
    stride_o,
    SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr,
    INT4: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < N) & (cols[None, :] < K)
    rows64 = rows.to(tl.int64)[:, None]
    if INT4:
        # element 8j + i is nibble i of word j; the stored nibble is q + 8
        words = tl.load(W + rows64 * stride_w + cols[None, :] // 8, mask=mask, other=0)
        q = ((words >> ((cols[None, :] % 8) * 4)) & 0xF).to(tl.float32) - 8.0
    else:
        q = tl.load(W + rows64 * stride_w + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_ZERO:
        z = tl.load(Z + rows64 * stride_z + cols[None, :] // SCALE_BK, mask=mask, other=0)
        q = q - z.to(tl.float32)
    s = tl.load(S + (rows64 // SCALE_BN) * stride_s + cols[None, :] // SCALE_BK, mask=mask, other=0.0)
    # rounded to nearest even by _round_to (the interpreter's own bf16 cast truncates)
    dense = _round_to(q * s.to(tl.float32), Out.dtype.element_ty)
    tl.store(Out + rows64 * stride_o + cols[None, :], dense.to(Out.dtype.element_ty), mask=mask)


_dequantize = DualKernel(_dequantize_fn)


def dequantize(
    weight: torch.Tensor,
    scale: torch.Tensor,
    scale_block: tuple[int, int],
    in_features: int,
    zero_point: torch.Tensor | None = None,
    dtype: torch.dtype = torch.bfloat16,
    block_n: int = 32,
    block_k: int = 256,
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
        z = zero_point if zero_point is not None else scale
        _dequantize[weight.device][(-(-n // block_n), -(-in_features // block_k))](
            weight,
            scale,
            z,
            out,
            n,
            in_features,
            weight.stride(0),
            scale.stride(0),
            z.stride(0),
            out.stride(0),
            SCALE_BN=scale_block[0],
            SCALE_BK=scale_block[1],
            INT4=int4,
            HAS_ZERO=zero_point is not None,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
        )
    return out
