"""Gemma 4's elementwise chains, one call each: Triton kernels for CUDA tensors (one pass instead of
5-15 small kernels), the torch reference elsewhere (bit-exact with transformers on the CPU path).

- ``add_rms_norm``: ``(residual + norm(x)) * scale``, optionally with the next norm of the result, and
  with ``x`` the sum of two normed branches (a MoE layer's dense and expert outputs);
- ``moe_input_norms``: a MoE layer's experts' input and router input, two norms of one row;
- ``norm_rope``: per-head q/k norm followed by RoPE or axial RoPE (or the v norm alone);
- ``act_mul``: the gate activation times the up projection (MLP and PLE gates);
- ``qkv_norm_rope_write``: a KV-producing layer's q/k/v norms, RoPE and the K/V cache write, from the
  fused QKV projection (CUDA only: the reference path keeps the separate ops);
- ``linear`` / ``gate_up_act`` / ``linear_act_mul``: projections, and projections with those gates fused,
  through the skinny-GEMM kernel at decode sizes (at most ``SKINNY_MAX_ROWS`` token rows), else cuBLAS;
  quantized projections (``layers.quant.QuantLinear``) through ``layers.quant.quant_linear``;
- ``decode_tail_block``: a dense layer's tail after attention (o_proj, norms, MLP, PLE) in one persistent
  launch at decode sizes (``kernels.decode_tail``), where ``G4SERVE_DECODE_TAIL=1`` turns it on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from g4serve import envs
from g4serve.kernels import act_mul as _act_mul
from g4serve.kernels import decode_tail as _decode_tail
from g4serve.kernels import gemv as _gemv
from g4serve.kernels import norm_rope as _norm_rope
from g4serve.kernels._launch import sm_count
from g4serve.kernels.qkv_prep import qkv_prep
from g4serve.kernels.rms_norm import (
    fp8_next_buffers,
    fused_rms_norm,
    fused_rms_norm_reference,
    moe_input_norms_reference,
)
from g4serve.kernels.rms_norm import moe_input_norms as _moe_input_norms
from g4serve.layers.moe import MoERouter
from g4serve.layers.norm import RMSNorm
from g4serve.layers.quant import QuantLinear, quant_linear, takes_fp8_groups

# A norm whose output feeds a W8A8 FP8 projection at decode sizes quantizes it for that projection in the same
# pass (its quantizing launch saved; bit for bit the same values). Off: on an H200 it gained nothing
# measurable (FP8 e4b decode B = 1 3.03 -> 3.05 ms, B = 8 3.49 -> 3.51), and on an H100 31B's FP8 step took
# 13.52 against 13.40 ms: one program then quantizes what 42 did in parallel (docs/benchmarks.md).
FP8_NORM_QUANT = envs.get("G4SERVE_FP8_NORM_QUANT") == "1"


def add_rms_norm(
    x: torch.Tensor,
    norm: RMSNorm,
    residual: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    next_norm: RMSNorm | None = None,
    next_proj: nn.Module | None = None,
    branches: tuple[RMSNorm, torch.Tensor, RMSNorm] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``out = (residual + norm(x)) * scale`` and ``next_norm(out)`` (None without ``next_norm``).
    ``next_proj``: the projection that reads ``next_norm(out)``; where it multiplies on the FP8 tensor cores
    (``quant.takes_fp8_groups``) and ``G4SERVE_FP8_NORM_QUANT=1``, the pass also quantizes that output for it
    (``QuantLinear.offer_quantized_input``). ``branches``: (norm_a, xb, norm_b), and ``x`` stands for
    ``norm_a(x) + norm_b(xb)``, summed in the same pass."""
    norms = [norm, next_norm, *(branches[::2] if branches is not None else ())]
    assert len({n.eps for n in norms if n is not None}) == 1, "one eps for the norms of a fused pass"
    fp8 = None
    if FP8_NORM_QUANT and next_norm is not None and next_proj is not None and takes_fp8_groups(x, next_proj):
        fp8 = fp8_next_buffers(x)
    fn = fused_rms_norm if x.is_cuda else fused_rms_norm_reference
    out, out2 = fn(
        x,
        norm.weight,
        norm.eps,
        residual=residual,
        scale=scale,
        next_weight=next_norm.weight if next_norm is not None else None,
        fp8_next=fp8,
        branches=(branches[1], branches[0].weight, branches[2].weight) if branches is not None else None,
    )
    if fp8 is not None:
        next_proj.offer_quantized_input(out2, *fp8)
    return out, out2


def moe_input_norms(x: torch.Tensor, norm: RMSNorm, router: MoERouter) -> tuple[torch.Tensor, torch.Tensor]:
    """(``norm(x)``, the router's normed input ``rms_norm(x) * router.scale * router.root``): a MoE layer's
    experts' input and its router's (``router.route`` takes it) from one pass over the residual stream."""
    assert norm.eps == router.eps, "one eps for both norms of a fused pass"
    fn = _moe_input_norms if x.is_cuda else moe_input_norms_reference
    return fn(x, norm.weight, router.scale, router.root, norm.eps)


def moe_route(router: MoERouter, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``router.route(x)`` with its projection through ``linear``: at one row the skinny kernel (with
    dependent launch) instead of cuBLAS's split-K GEMM and its reduce, two launches each MoE layer."""
    return router.route_logits(linear(x, router.proj))


def norm_rope(
    x: torch.Tensor,
    norm: RMSNorm,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    sections: int = 1,
) -> torch.Tensor:
    """x [T, H, D] -> ``apply_rope(norm(x), cos, sin)`` (just ``norm(x)`` without cos/sin); ``sections=2``:
    ``apply_axial_rope`` (the vision tower's x/y halves)."""
    if x.is_cuda and x.stride(-1) == 1:
        return _norm_rope.norm_rope(x, norm.weight, norm.eps, cos, sin, sections)
    return _norm_rope.norm_rope_reference(x, norm.weight, norm.eps, cos, sin, sections)


def act_mul(activation: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.is_cuda and a.stride(-1) == 1 and b.stride(-1) == 1:
        return _act_mul.act_mul(activation, a, b)
    return _act_mul.act_mul_reference(activation, a, b)


# Token rows up to which CUDA projections may take the skinny-GEMM kernel (``gemv.use_skinny`` decides per
# shape; the kernel takes up to ``gemv.DOT_MAX_ROWS``). G4SERVE_SKINNY_MAX_ROWS=0 turns it off (A/B
# benchmarks); a captured CUDA graph keeps the choice it was captured with.
SKINNY_MAX_ROWS = envs.get_int("G4SERVE_SKINNY_MAX_ROWS")


def _skinny(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, epilogue: int) -> bool:
    if not (x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= SKINNY_MAX_ROWS and bias is None):
        return False
    if x.dtype not in (torch.bfloat16, torch.float16) or x.stride(-1) != 1 or not weight.is_contiguous():
        return False
    n = weight.shape[0] // 2 if epilogue == _gemv.GATE_UP else weight.shape[0]
    return _gemv.use_skinny(x.shape[0], n, weight.shape[1], epilogue, sm_count(x.device.index or 0))


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; decode-sized CUDA inputs stream the weight through the skinny kernel."""
    return (
        _gemv.skinny_matmul(x, weight) if _skinny(x, weight, bias, _gemv.PLAIN) else F.linear(x, weight, bias)
    )


def linear(x: torch.Tensor, layer: nn.Linear | QuantLinear) -> torch.Tensor:
    if isinstance(layer, QuantLinear):
        return quant_linear(x, layer)
    return project(x, layer.weight, layer.bias)


def gate_up_act(x: torch.Tensor, layer: nn.Linear, activation: str) -> torch.Tensor:
    """``act(gate(x)) * up(x)`` for a stacked [gate; up] projection, fused in one pass at decode sizes."""
    if isinstance(layer, QuantLinear):
        return quant_linear(x, layer, _gemv.GATE_UP, activation)
    if _skinny(x, layer.weight, layer.bias, _gemv.GATE_UP):
        return _gemv.skinny_matmul(x, layer.weight, _gemv.GATE_UP, activation)
    gate, up = layer(x).chunk(2, dim=-1)
    return act_mul(activation, gate, up)


def linear_act_mul(x: torch.Tensor, layer: nn.Linear, other: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(layer(x)) * other`` (the PLE gate), fused in one pass at decode sizes."""
    if isinstance(layer, QuantLinear):
        return quant_linear(x, layer, _gemv.MUL, activation, other)
    if _skinny(x, layer.weight, layer.bias, _gemv.MUL) and other.stride(-1) == 1:
        return _gemv.skinny_matmul(x, layer.weight, _gemv.MUL, activation, other)
    return act_mul(activation, layer(x), other)


# The persistent kernel for a dense layer's tail after attention at decode sizes: off, since on an H200
# (bench/decode_tail.py) its first version took 119.5 us for an e4b tail against the separate launches' 51.5
# (one program per SM streamed too few weight tiles at once; docs/benchmarks.md); the version with 8 programs
# per SM took 105.8 us against 67.2 on an H100. A captured CUDA graph keeps the choice it was captured with.
DECODE_TAIL = envs.get("G4SERVE_DECODE_TAIL") == "1"


def decode_tail_applies(x: torch.Tensor, layers: list[nn.Module], counters: torch.Tensor | None) -> bool:
    """Whether ``decode_tail_block`` takes rows like ``x`` (the layer's input) through ``layers`` (the tail's
    projections): on, CUDA, 1-8 rows with a unit last stride, plain bias-free weights, a counter buffer."""
    if not (DECODE_TAIL and counters is not None and x.is_cuda and x.dim() == 2 and x.stride(-1) == 1):
        return False
    if not 0 < x.shape[0] <= _gemv.MAX_ROWS or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    return all(type(layer) is nn.Linear and layer.bias is None for layer in layers)


def decode_tail_block(
    attn: torch.Tensor,
    residual: torch.Tensor,
    o_proj: nn.Linear,
    post_attn_norm: RMSNorm,
    pre_ff_norm: RMSNorm,
    gate_up: nn.Linear,
    down: nn.Linear,
    post_ff_norm: RMSNorm,
    activation: str,
    counters: torch.Tensor,
    ple: tuple[nn.Linear, nn.Linear, torch.Tensor, RMSNorm] | None = None,
    scale: torch.Tensor | None = None,
    next_norm: RMSNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The separate ops ``o_proj`` -> ``add_rms_norm`` -> ``gate_up_act`` -> ``down`` -> ``add_rms_norm``
    [-> PLE gate, projection, ``add_rms_norm``] in one launch, where ``decode_tail_applies``. ``ple``: the
    per-layer input's (gate, projection, this layer's input [M, P], post norm); ``scale`` and ``next_norm``
    apply at the last norm."""
    norms = [post_attn_norm, pre_ff_norm, post_ff_norm, next_norm, ple[3] if ple is not None else None]
    assert len({n.eps for n in norms if n is not None}) == 1, "one eps for every norm of the fused tail"
    per_layer = None
    if ple is not None:
        gate, proj, inputs, post_norm = ple
        per_layer = _decode_tail.PerLayerInput(gate.weight, proj.weight, inputs, post_norm.weight)
    weights = _decode_tail.TailWeights(
        o_proj.weight,
        post_attn_norm.weight,
        pre_ff_norm.weight,
        gate_up.weight,
        down.weight,
        post_ff_norm.weight,
    )
    return _decode_tail.decode_tail(
        attn,
        residual,
        weights,
        post_ff_norm.eps,
        activation,
        counters,
        per_layer,
        scale,
        next_norm.weight if next_norm is not None else None,
    )


def qkv_norm_rope_write(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    q_norm: RMSNorm,
    k_norm: RMSNorm,
    cos: torch.Tensor,
    sin: torch.Tensor,
    target: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    v_is_k: bool,
) -> torch.Tensor:
    """q = rope(q_norm(q)) [T, Hq, D]; rope(k_norm(k)) and v_norm(v) written to ``target`` = (k_cache,
    v_cache, slots), one kernel. ``v_is_k``: V is the raw K projection (attention_k_eq_v)."""
    assert q_norm.eps == k_norm.eps
    return qkv_prep(
        qkv,
        num_heads,
        num_kv_heads,
        q_norm.weight,
        k_norm.weight,
        q_norm.eps,
        cos,
        sin,
        *target,
        v_is_k=v_is_k,
    )
