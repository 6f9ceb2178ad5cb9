"""Linear projections with quantized weights (FP8 e4m3 or packed int4), their forward on each device, and
g4serve's own quantizer (``--quantization`` presets quantize bf16 weights at load with it).

``QuantLinear`` keeps a compressed-tensors checkpoint's bytes as they are (FP8 weights; int4 in its int32
packing) with one scale per block of the weight (``scale_block``: per tensor, channel, 128x128 block or
group) and, for asymmetric int4, int8 zero points per scale entry. The CPU path dequantizes to the compute
dtype and runs ``F.linear`` (the exact reference). On CUDA, FP8 weights of schemes with dynamic activation
scales run on the FP8 tensor cores with their activations quantized too, as the scheme says: up to
``SKINNY_ROWS`` rows (decode) ``kernels/fp8_matmul.py`` (per token and 128-column group), past them plain
projections ``torch._scaled_mm`` (per-token scales). int4 decode rows take whichever of torch's own
int4 kernel (``kernels/int4_tinygemm.py``: 2-7 rows) and ``kernels/quant_matmul.py`` (its own int4 tiles:
one row, 8-16 rows) was faster there (``G4SERVE_INT4_MATMUL``), and more rows its dense weight, written by
one launch (``kernels/dequant.py``), through cuBLAS (``G4SERVE_INT4_DENSE_ROWS``). Gated FP8 prefill
projections, static activation scales and FP8 weights on older GPUs run ``kernels/quant_matmul.py``
(dequantized in registers, 16-bit products; W8A8's 128 x 128 tiles were slower there: 31B TTFT at 2,048
tokens 451 against 354 ms); ``G4SERVE_FP8_MATMUL=dequant`` sends FP8 decode there too (the A/B of bench
runs).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from g4serve import envs
from g4serve.kernels.act_mul import act_mul
from g4serve.kernels.dequant import dequantize
from g4serve.kernels.fp8_matmul import fp8_matmul, fp8_matmul_quantized, fp8_matmul_supported
from g4serve.kernels.fp8_rows import quantize_rows_fp8
from g4serve.kernels.gemv import GATE_UP, MUL, PLAIN, epilogue_reference
from g4serve.kernels.int4_tinygemm import TinygemmWeight, pack_tinygemm, tinygemm_matmul, tinygemm_supported
from g4serve.kernels.quant_matmul import SKINNY_ROWS, dequantize_reference, quant_matmul, unpack_int4
from g4serve.quant_config import FP8, INT4, ActivationQuant, WeightQuant

log = logging.getLogger(__name__)

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
# Rows past SKINNY_ROWS on CUDA: "triton" (default) multiplies in quant_matmul's 2-D grid; "dequant" writes
# the dense weight once per call and runs cuBLAS (the A/B alternative for bench runs).
PREFILL_PATH = envs.get("G4SERVE_QUANT_PREFILL")
# int4 projections on at least this many rows take that dense path (the weight dequantized by one launch,
# then cuBLAS): e4b on an H200 (issue 22), a step at B = 16 / 32 / 64 took 7.11 / 12.17 / 20.88 ms on
# tinygemm, 7.99 / 8.20 / 8.67 dense; a 2,048-token prefill 31.53 ms on the 2-D grid, 26.30 dense (512:
# 18.06 / 12.64).
INT4_DENSE_ROWS = envs.get_int("G4SERVE_INT4_DENSE_ROWS")
# int4 projections at decode sizes on torch's tinygemm (kernels/int4_tinygemm.py: the weights repacked once,
# by prepare_int4_layouts) or on kernels/quant_matmul.py ("triton"); "auto" takes the faster of the two at
# each row count (TINYGEMM_AUTO_ROWS on tinygemm). e4b on an H100 (issue 22), a decode step at B = 1 / 2 / 4 /
# 8 / 16: tinygemm 3.25 / 3.37 / 3.77 / 4.97 / 7.30 ms, the Triton kernel (its own int4 tiles, PTX planes)
# 3.10 / 4.89 / 4.84 / 4.86 / 4.96, and 2.84 at B = 1 with its one-row planes (another machine: 3.10 before
# them). tinygemm's layout sits beside the checkpoint's words, which the dense path reads.
INT4_MATMUL = envs.get("G4SERVE_INT4_MATMUL")
TINYGEMM_AUTO_ROWS = range(2, 8)
# FP8 weights with dynamic activation scales: "w8a8" (default) quantizes activations and multiplies on the FP8
# tensor cores; "dequant" takes the in-register dequantizing kernel with 16-bit activations.
FP8_MATMUL = envs.get("G4SERVE_FP8_MATMUL")


class QuantLinear(nn.Module):
    """``nn.Linear(in_features, out_features)`` with a quantized weight.

    Parameters (all ``requires_grad=False``): ``weight`` float8_e4m3fn [N, K] or int32 [N, ceil(K / 8)];
    ``weight_scale`` [ceil(N / bn), ceil(K / bk)] (fp32, or the checkpoint's float dtype) for ``scale_block``
    = (bn, bk); ``weight_zero_point`` int8 [N, ceil(K / bk)] (asymmetric int4); ``input_scale`` fp32 [1] (FP8
    static activations)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        weights: WeightQuant,
        activations: ActivationQuant | None = None,
        bias: bool = False,
        scale_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        scale_block: tuple[int, int] | None = None,
        compute_dtype: torch.dtype = torch.bfloat16,
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.compute_dtype = compute_dtype  # the activations' dtype (the model's)
        self.kind = weights.kind
        self.activations = activations
        self.scale_block = scale_block or weights.scale_block(out_features, in_features)
        bn, bk = self.scale_block
        grid = (-(-out_features // bn), -(-in_features // bk))
        if self.kind == FP8:
            weight = torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn, device=device)
        else:
            weight = torch.empty(out_features, -(-in_features // 8), dtype=torch.int32, device=device)
        self.weight = frozen(weight)
        self.weight_scale = frozen(torch.empty(grid, dtype=scale_dtype, device=device))
        self.weight_zero_point = None
        if self.kind == INT4 and not weights.symmetric:
            self.weight_zero_point = frozen(torch.zeros(grid, dtype=torch.int8, device=device))
        self.input_scale = None
        if activations is not None and not activations.dynamic:
            self.input_scale = frozen(torch.ones(1, dtype=torch.float32, device=device))
        self.bias = frozen(torch.empty(out_features, dtype=compute_dtype, device=device)) if bias else None
        self.tinygemm: TinygemmWeight | None = None  # prepare_tinygemm's layout, when the engine asks for it

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.kind}, scale_block={self.scale_block}"

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The dense weight [N, K] in ``dtype``: the CPU path's weight and the oracle of the kernels (torch),
        and on CUDA the input of the dense path's cuBLAS GEMM (``kernels/dequant.py``, the same bits)."""
        fn = dequantize if self.weight.is_cuda else dequantize_reference
        return fn(
            self.weight, self.weight_scale, self.scale_block, self.in_features, self.weight_zero_point, dtype
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quant_linear(x, self)

    def offer_quantized_input(self, x: torch.Tensor, xq: torch.Tensor, sx: torch.Tensor) -> None:
        """``x`` already quantized for the W8A8 GEMM (``fp8_matmul.quantize_groups``' values and scales, by
        the kernel that wrote ``x``): this layer's next call takes them if it is handed that very tensor."""
        self._quantized_input = (x, xq, sx)

    def take_quantized_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The offered (values, scales) when ``x`` is the offered tensor, else None; the offer ends either
        way."""
        held = getattr(self, "_quantized_input", None)
        self._quantized_input = None
        return held[1:] if held is not None and held[0] is x else None

    def row_scales(self) -> torch.Tensor:
        """[1, N] fp32: each output row's weight scale (FP8 with one scale column: ``torch._scaled_mm``'s
        ``scale_b``). Built once and kept until ``weight_scale`` changes (its version counter), so prefill
        steps, captured or not, launch no gather for it."""
        key = (self.weight_scale.data_ptr(), self.weight_scale._version)
        cached = getattr(self, "_row_scales", None)
        if cached is None or cached[0] != key:
            rows = torch.arange(self.out_features, device=self.weight_scale.device) // self.scale_block[0]
            scales = self.weight_scale[:, 0].float()[rows].reshape(1, -1).contiguous()
            self._row_scales = cached = (key, scales)
        return cached[1]

    @torch.no_grad()
    def prepare_tinygemm(self) -> bool:
        """Repack an int4 weight of a shape tinygemm takes into its layout (``self.tinygemm``, beside the
        checkpoint's words, which the CPU reference and prefill keep using); False where it does not apply."""
        applies = self.kind == INT4 and tinygemm_supported(
            self.out_features, self.in_features, self.scale_block
        )
        self.tinygemm = None
        if applies:
            self.tinygemm = pack_tinygemm(
                self.weight, self.weight_scale, self.weight_zero_point, self.in_features, self.scale_block[1]
            )
        return applies

    @torch.no_grad()
    def quantize_from(self, weight: torch.Tensor) -> None:
        """Fill this layer from a dense [N, K] weight with g4serve's quantizer (``quantize_weight``)."""
        q, scale, zero = quantize_weight(
            weight, self.kind, self.scale_block, self.weight_zero_point is not None
        )
        self.weight.copy_(q)
        self.weight_scale.copy_(scale)
        if zero is not None:
            self.weight_zero_point.copy_(zero)


def frozen(t: torch.Tensor) -> nn.Parameter:
    """A parameter that is never trained (quantized bytes, scales, zero points)."""
    return nn.Parameter(t, requires_grad=False)


def prepare_int4_layouts(model: nn.Module) -> int:
    """Unless ``G4SERVE_INT4_MATMUL=triton``, every int4 ``QuantLinear`` of ``model`` that tinygemm takes gets
    its layout (after ``fuse_projections``, so stacked projections are repacked once); the count."""
    if INT4_MATMUL == "triton":
        return 0
    count = sum(m.prepare_tinygemm() for m in model.modules() if isinstance(m, QuantLinear))
    if count:
        log.info("int4 projections on tinygemm: %d repacked", count)
    return count


# ---- forward ----------------------------------------------------------------------------------------------
def quant_linear(
    x: torch.Tensor,
    layer: QuantLinear,
    epilogue: int = PLAIN,
    activation: str | None = None,
    other: torch.Tensor | None = None,
) -> torch.Tensor:
    """``layer(x)``, or with ``gemv``'s epilogues (``GATE_UP``: act(gate) * up of a stacked layer; ``MUL``:
    act(layer(x)) * other). CPU and other non-CUDA tensors: the reference (dense weight, then F.linear)."""
    quantized = layer.take_quantized_input(x)
    if not x.is_cuda or x.dim() != 2 or x.stride(-1) != 1:
        return _dense(x, layer, epilogue, activation, other)
    m = x.shape[0]
    if m > SKINNY_ROWS and _scaled_mm_ok(x, layer):
        # Prefill on the FP8 tensor cores, a gated projection's epilogue in one elementwise pass after it (the
        # dequantizing 2-D grid it took before made E4B's FP8 prefill twice as slow as bf16's)
        return epilogue_after(_fp8_scaled_mm(x, layer), epilogue, activation, other)
    if (m > SKINNY_ROWS and PREFILL_PATH == "dequant") or (layer.kind == INT4 and m >= INT4_DENSE_ROWS):
        return _dense(x, layer, epilogue, activation, other)
    if epilogue == MUL and other.stride(-1) != 1:
        other = other.contiguous()
    if layer.tinygemm is not None and x.dtype == torch.bfloat16 and _takes_tinygemm(m):
        y = epilogue_after(tinygemm_matmul(x, layer.tinygemm), epilogue, activation, other)
    elif m <= SKINNY_ROWS and _fp8_matmul_ok(x, layer):
        args = (layer.weight, layer.weight_scale, layer.scale_block, epilogue, activation, other)
        if quantized is not None:  # quantized by the kernel that wrote x (``layers.fused.add_rms_norm``)
            y = fp8_matmul_quantized(*quantized, x.dtype, *args)
        else:
            y = fp8_matmul(x, *args)
    else:
        y = quant_matmul(
            x,
            layer.weight,
            layer.weight_scale,
            layer.scale_block,
            layer.in_features,
            layer.weight_zero_point,
            epilogue,
            activation,
            other,
        )
    if layer.bias is not None:
        assert epilogue == PLAIN, "fused epilogues take bias-free projections"
        y += layer.bias
    return y


def _takes_tinygemm(m: int) -> bool:
    """Whether ``m`` rows of an int4 projection with a tinygemm layout take tinygemm (``INT4_MATMUL``)."""
    return m <= SKINNY_ROWS if INT4_MATMUL == "tinygemm" else m in TINYGEMM_AUTO_ROWS


def epilogue_after(y: torch.Tensor, epilogue: int, activation: str | None, other) -> torch.Tensor:
    """An epilogue in one elementwise pass after a GEMM that has none (``torch._scaled_mm``, tinygemm)."""
    if epilogue == GATE_UP:
        return act_mul(activation, *y.chunk(2, dim=-1))
    return act_mul(activation, y, other) if epilogue == MUL else y


def _dense(x, layer: QuantLinear, epilogue: int, activation: str | None, other) -> torch.Tensor:
    """The dense weight, then F.linear and the unfused epilogue: the CPU reference, and on CUDA the path
    where cuBLAS beats the dequantizing kernels (``G4SERVE_QUANT_PREFILL``, ``G4SERVE_INT4_DENSE_ROWS``)."""
    return epilogue_reference(F.linear(x, layer.dequantize(x.dtype), layer.bias), epilogue, activation, other)


def takes_fp8_groups(x: torch.Tensor, layer: nn.Module) -> bool:
    """Whether ``layer(x)`` runs the W8A8 GEMM on ``quantize_groups(x)`` (FP8 weights with dynamic activation
    scales, decode-sized CUDA rows): the input a producing kernel may quantize for it."""
    if not isinstance(layer, QuantLinear) or not x.is_cuda or x.dim() != 2 or x.stride(-1) != 1:
        return False
    return 0 < x.shape[0] <= SKINNY_ROWS and _fp8_matmul_ok(x, layer)


def _scaled_mm_ok(x: torch.Tensor, layer: QuantLinear) -> bool:
    """FP8 weights with one scale per row (per channel, per tensor, or per part of a stacked projection)
    and quantized activations, on FP8 tensor cores (compute capability 8.9+), in shapes cuBLASLt takes (K
    and N multiples of 16, row-wise scales)."""
    if layer.kind != FP8 or layer.activations is None or layer.scale_block[1] < layer.in_features:
        return False
    if x.dtype != torch.bfloat16:
        return False
    if layer.in_features % 16 or layer.out_features % 16:
        return False
    return _fp8_tensor_cores(x.device.index or 0)


# One token row against a weight smaller than this (E4B's per-layer-input gate and projection, 0.6M
# elements): the dequantizing kernel, 1.5-3.4 us on an H100, beats quantizing the row first (the quantizer
# alone takes ~1.3 us; W8A8 3.5-5.7 us in all). From 2 rows on, W8A8 wins these too (5.6 vs 16 us at 8).
W8A8_MIN_ONE_ROW_ELEMENTS = 1 << 21


def _fp8_matmul_ok(x: torch.Tensor, layer: QuantLinear) -> bool:
    """FP8 weights whose scheme quantizes activations dynamically, with weight scales constant over every
    128-column activation group, 16-bit activations, on FP8 tensor cores (``kernels/fp8_matmul.py``); not
    for one row against a small weight (``W8A8_MIN_ONE_ROW_ELEMENTS``)."""
    if x.shape[0] == 1 and layer.weight.numel() < W8A8_MIN_ONE_ROW_ELEMENTS:
        return False
    return (
        FP8_MATMUL == "w8a8"
        and layer.kind == FP8
        and layer.activations is not None
        and layer.activations.dynamic
        and x.dtype in (torch.bfloat16, torch.float16)
        and fp8_matmul_supported(layer.scale_block, layer.in_features)
        and _fp8_tensor_cores(x.device.index or 0)
    )


@functools.cache
def _fp8_tensor_cores(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 9)


def _fp8_scaled_mm(x: torch.Tensor, layer: QuantLinear) -> torch.Tensor:
    # Per-token groups (FP8-block's activation scheme) reduce to per token here: the weight has one scale
    # per row, so the whole row of x may share one; finer groups would only refine the rounding.
    xq, x_scale = quantize_rows_fp8(x, layer.input_scale)  # one launch; quantize_rows_reference's bits
    return torch._scaled_mm(
        xq,
        layer.weight.t(),
        scale_a=x_scale,
        scale_b=layer.row_scales(),
        bias=layer.bias,
        out_dtype=x.dtype,
    )


# ---- g4serve's quantizer (presets and --quantization on dense checkpoints) ---------------------------------
def _block_view(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """[N, K] zero-padded to whole blocks -> [N / bn, K / bk, bn * bk]."""
    bn, bk = block
    n, k = w.shape
    padded = F.pad(w, (0, -k % bk, 0, -n % bn))
    gn, gk = padded.shape[0] // bn, padded.shape[1] // bk
    return padded.reshape(gn, bn, gk, bk).transpose(1, 2).reshape(gn, gk, bn * bk)


@torch.no_grad()
def quantize_weight(
    weight: torch.Tensor, kind: str, scale_block: tuple[int, int], asymmetric: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A dense [N, K] weight -> (quantized weight, scales, zero points or None) in ``QuantLinear``'s layout,
    with compressed-tensors' min-max formulas: FP8 s = max|w| / 448; int4 symmetric s = max|w| / 7.5,
    asymmetric s = (max - min) / 15 with z = round(-8 - min / s); q = round(w / s + z), clamped."""
    w = weight.float()
    n, k = w.shape
    blocks = _block_view(w, scale_block)
    zero = None
    if kind == FP8:
        scale = (blocks.abs().amax(-1) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    elif not asymmetric:
        scale = (blocks.abs().amax(-1) / 7.5).clamp_min(torch.finfo(torch.float32).tiny)
    else:
        lo, hi = blocks.amin(-1).clamp_max(0), blocks.amax(-1).clamp_min(0)
        scale = ((hi - lo) / 15).clamp_min(torch.finfo(torch.float32).tiny)
        zero = torch.round(-8 - lo / scale).clamp(-8, 7)
    full_scale = _expand_blocks(scale, scale_block, (n, k))
    if kind == FP8:
        q = (w / full_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return q, scale, None
    z = _expand_blocks(zero, scale_block, (n, k)) if zero is not None else 0.0
    q = torch.round(w / full_scale + z).clamp(-8, 7).to(torch.int32)
    return pack_int4(q), scale, zero.to(torch.int8) if zero is not None else None


def _expand_blocks(t: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    rows = torch.arange(shape[0], device=t.device) // block[0]
    cols = torch.arange(shape[1], device=t.device) // block[1]
    return t[rows][:, cols]


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int [N, K] in [-8, 7] -> int32 [N, ceil(K / 8)] in compressed-tensors' packing (element 8j + i in
    nibble i of word j, stored as q + 8; padding nibbles 0)."""
    n, k = q.shape
    u = F.pad((q.to(torch.int64) + 8), (0, -k % 8)).reshape(n, -1, 8)
    shifts = torch.arange(0, 32, 4, device=q.device, dtype=torch.int64)
    words = (u << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


# ---- stacking projections (``fuse_projections``) ---------------------------------------------------------
@torch.no_grad()
def stack_linears(parts: list[nn.Module]) -> nn.Module:
    """One projection computing ``parts`` side by side (outputs concatenated in order).

    Dense parts give an ``nn.Linear``. Quantized parts of one kind stay quantized: weights and zero points
    concatenated along N, scales on a common grid (per-tensor scales become per-channel ones, blocks that
    do not tile a part's rows become per-row entries: all exact). Mixed parts (dense beside quantized, FP8
    beside int4) give an ``nn.Linear`` of the dequantized weights, also exact."""
    quant = [p for p in parts if isinstance(p, QuantLinear)]
    if not quant:
        return _stack_dense([p.weight for p in parts], [p.bias for p in parts])
    if len(quant) < len(parts) or len({p.kind for p in quant}) > 1:
        log.warning("stacking projections quantized differently: they are dequantized to one dense GEMM")
        dtype = quant[0].compute_dtype
        weights = [p.dequantize(dtype) if isinstance(p, QuantLinear) else p.weight for p in parts]
        return _stack_dense(weights, [p.bias for p in parts])
    return _stack_quantized(quant)


def _stack_dense(weights: list[torch.Tensor], biases: list[torch.Tensor | None]) -> nn.Linear:
    weight = torch.cat(weights)
    fused = nn.Linear(
        weight.shape[1], weight.shape[0], bias=biases[0] is not None, device=weight.device, dtype=weight.dtype
    )
    fused.weight.copy_(weight)
    if fused.bias is not None:
        fused.bias.copy_(torch.cat(biases))
    return fused


def _common_grid(parts: list[QuantLinear]) -> tuple[int, int]:
    """The scale block every part can be written on exactly: the parts' own when they share it and it tiles
    each part's rows, else per row; along K the finest of the parts' blocks (they nest: powers of two)."""
    k = parts[0].in_features
    cols = min(p.scale_block[1] for p in parts)
    if any(p.scale_block[1] % cols and p.scale_block[1] < k for p in parts):
        cols = 1
    rows = {p.scale_block[0] for p in parts}
    bn = rows.pop() if len(rows) == 1 else 1
    if any(p.out_features % bn for p in parts):
        bn = 1
    return bn, cols


def _stack_quantized(parts: list[QuantLinear]) -> QuantLinear:
    first = parts[0]
    k = first.in_features
    bn, bk = _common_grid(parts)
    acts = {p.activations for p in parts}
    # One input, one activation scale: the largest static scale covers every part's range.
    activations = acts.pop() if len(acts) == 1 else ActivationQuant(True, "token")
    scale_dtype = (
        torch.float32 if len({p.weight_scale.dtype for p in parts}) > 1 else first.weight_scale.dtype
    )
    zeros = any(p.weight_zero_point is not None for p in parts)
    scheme = WeightQuant(first.kind, "stacked", (bn, bk), symmetric=not zeros)
    n = sum(p.out_features for p in parts)
    device = first.weight.device
    fused = QuantLinear(
        k, n, scheme, activations, first.bias is not None, scale_dtype, device, (bn, bk), first.compute_dtype
    )
    fused.weight.copy_(torch.cat([p.weight for p in parts]))
    fused.weight_scale.copy_(torch.cat([_regrid(p.weight_scale, p, (bn, bk)) for p in parts]).to(scale_dtype))
    if zeros:
        fused.weight_zero_point.copy_(torch.cat([_regrid_zeros(p, (1, bk)) for p in parts]))
    if fused.input_scale is not None:
        fused.input_scale.copy_(torch.stack([p.input_scale for p in parts]).amax().reshape(1))
    if fused.bias is not None:
        fused.bias.copy_(torch.cat([p.bias for p in parts]))
    return fused


def _regrid(t: torch.Tensor, part: QuantLinear, block: tuple[int, int]) -> torch.Tensor:
    """``t`` on ``part``'s scale grid -> the same values on the finer grid ``block``."""
    n, k = part.out_features, part.in_features
    rows = torch.arange(0, n, block[0], device=t.device) // part.scale_block[0]
    cols = torch.arange(0, k, block[1], device=t.device) // part.scale_block[1]
    return t[rows][:, cols]


def _regrid_zeros(part: QuantLinear, block: tuple[int, int]) -> torch.Tensor:
    if part.weight_zero_point is None:
        return torch.zeros(
            part.out_features, -(-part.in_features // block[1]), dtype=torch.int8, device=part.weight.device
        )
    return _regrid(part.weight_zero_point, part, block)


__all__ = [
    "INT4_MATMUL",
    "PREFILL_PATH",
    "QuantLinear",
    "pack_int4",
    "prepare_int4_layouts",
    "quant_linear",
    "quantize_weight",
    "stack_linears",
    "unpack_int4",
]
