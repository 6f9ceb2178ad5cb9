"""``act(a) * b`` in one pass (the gated MLP's GELU-tanh/SiLU gate, and the PLE gate), and its torch
reference.

The activation's result is rounded to the input dtype before the product, as the unfused model rounds it.
``ACTIVATIONS`` (the torch activations named as in Gemma 4 configs) lives here, beside the kernel it is the
reference of; the models and ``fused_moe`` take it from here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton.language as tl

from g4serve.kernels._launch import DualKernel, pdl, wait_for_previous_kernel


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu_tanh": gelu_tanh,
    "silu": F.silu,
    "swish": F.silu,
}

GELU_TANH, SILU = 0, 1
_KINDS = {"gelu_pytorch_tanh": GELU_TANH, "gelu_tanh": GELU_TANH, "silu": SILU, "swish": SILU}


def _act_mul_fn(
    A,
    B,
    Out,
    n_cols,
    stride_a,
    stride_b,
    stride_o,
    ACT: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    a = tl.load(A + row * stride_a + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + row * stride_b + cols, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        # 0.5 a (1 + tanh(z)) = a sigmoid(2z): sigmoid exists on every backend and in the interpreter
        z = 0.7978845608028654 * (a + 0.044715 * a * a * a)
        g = a * tl.sigmoid(2.0 * z)
    else:
        g = a * tl.sigmoid(a)
    g = g.to(Out.dtype.element_ty).to(tl.float32)
    tl.store(Out + row * stride_o + cols, (g * b).to(Out.dtype.element_ty), mask=mask)


_act_mul = DualKernel(_act_mul_fn)


def act_mul(activation: str, a: torch.Tensor, b: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """``ACTIVATIONS[activation](a) * b`` for a, b [..., N] with unit last strides (e.g. the two halves of
    a fused gate/up projection) -> a new contiguous tensor in a's dtype."""
    n = a.shape[-1]
    a2d, b2d = a.reshape(-1, n), b.reshape(-1, n)
    assert a2d.stride(-1) == 1 and b2d.stride(-1) == 1
    out = torch.empty(a2d.shape, dtype=a.dtype, device=a.device)
    if a2d.shape[0]:
        _act_mul[a.device][(a2d.shape[0], -(-n // block))](
            a2d,
            b2d,
            out,
            n,
            a2d.stride(0),
            b2d.stride(0),
            out.stride(0),
            ACT=_KINDS[activation],
            BLOCK=block,
            **pdl(a.device, a2d.shape[0]),
            num_warps=4,
        )
    return out.view(a.shape)


def act_mul_reference(activation: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return ACTIVATIONS[activation](a) * b


__all__ = ["act_mul", "act_mul_reference"]
