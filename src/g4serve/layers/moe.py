"""Gemma 4 routed mixture-of-experts block (26B-A4B): router and expert weights, dense or quantized.

CUDA tensors take the Triton kernels (fused routing, grouped expert GEMMs; no host sync, so capturable in
a CUDA graph); elsewhere the torch reference, bit-exact with transformers. Names follow the HF checkpoints.
"""

from __future__ import annotations

import torch
from torch import nn

from g4serve.kernels.fused_moe import QuantExpertWeights, dequantize_expert, fused_moe, fused_moe_reference
from g4serve.kernels.moe_route import moe_route, moe_route_reference
from g4serve.layers.norm import rms_norm
from g4serve.layers.quant import frozen, quantize_weight
from g4serve.quant_config import FP8, WeightQuant

# The stacked projections: name -> parts (gate_up holds each expert's gate rows, then its up rows)
PROJECTIONS = {"gate_up_proj": 2, "down_proj": 1}


class MoERouter(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, eps: float):
        super().__init__()
        self.top_k = top_k
        self.eps = eps
        self.hidden = hidden
        self.proj = nn.Linear(hidden, num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(hidden))
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts))

    @property
    def root(self) -> float:
        return self.hidden**-0.5

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] fp32, expert ids [T, k]); softmax, top-k, renormalise, per-expert
        scale."""
        return self.route(rms_norm(x, None, self.eps) * self.scale * self.root)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` from the router's normed input ``rms_norm(x) * scale * root`` (``layers.fused.
        moe_input_norms`` makes it beside the experts' input)."""
        return self.route_logits(self.proj(x))

    def route_logits(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``route`` from the router's logits ``proj(x)`` (``layers.fused.moe_route`` projects at decode
        sizes with the skinny kernel)."""
        route = moe_route if logits.is_cuda else moe_route_reference
        return route(logits, self.per_expert_scale, self.top_k)


class MoEExperts(nn.Module):
    """Every routed expert's projections, stacked: ``gate_up_proj`` [E, 2I, H] (gate rows, then up rows) and
    ``down_proj`` [E, H, I], Hugging Face's names and layout.

    ``quant`` maps a projection name to its ``WeightQuant`` to keep it quantized (a checkpoint's FP8 /
    packed int4 bytes, or ``--quantization``): then ``<name>`` holds float8_e4m3fn [E, N, K] or int32
    [E, N, ceil(K / 8)], ``<name>_scale`` [E, parts * ceil(N / parts / bn), ceil(K / bk)] (each part, gate
    and up, on its own scale grid, as checkpoints store them) and, asymmetric int4, ``<name>_zero_point``
    int8 [E, N, ceil(K / bk)]: ``fused_moe`` dequantizes them in registers (CUDA); the CPU path dequantizes
    each hit expert to the compute dtype and runs the reference."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        activation: str,
        quant: dict[str, WeightQuant | None] | None = None,
        scale_dtype: torch.dtype = torch.float32,
        compute_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.activation = activation
        self.compute_dtype = compute_dtype  # the activations' dtype (the model's), when quantized
        self.quant = {name: (quant or {}).get(name) for name in PROJECTIONS}
        self.scale_blocks: dict[str, tuple[int, int]] = {}
        for name, parts in PROJECTIONS.items():
            _, rows, cols = self.dense_shape(name)
            scheme = self.quant[name]
            if scheme is None:
                dense = torch.empty(num_experts, rows, cols, dtype=compute_dtype, device=device)
                setattr(self, name, nn.Parameter(dense))
                continue
            bn, bk = self.scale_blocks[name] = scheme.scale_block(rows // parts, cols)
            grid = (parts * -(-rows // parts // bn), -(-cols // bk))
            if scheme.kind == FP8:
                weight = torch.empty(num_experts, rows, cols, dtype=torch.float8_e4m3fn, device=device)
            else:
                weight = torch.empty(num_experts, rows, -(-cols // 8), dtype=torch.int32, device=device)
            setattr(self, name, frozen(weight))
            setattr(
                self,
                f"{name}_scale",
                frozen(torch.empty(num_experts, *grid, dtype=scale_dtype, device=device)),
            )
            zero = None
            if not scheme.symmetric:
                zero = frozen(torch.zeros(num_experts, rows, grid[1], dtype=torch.int8, device=device))
            setattr(self, f"{name}_zero_point", zero)

    def dense_shape(self, name: str) -> tuple[int, int, int]:
        """(E, N, K) of projection ``name``'s dense weight."""
        if name == "gate_up_proj":
            return (self.num_experts, 2 * self.intermediate, self.hidden)
        return (self.num_experts, self.hidden, self.intermediate)

    @property
    def quantized(self) -> bool:
        return any(q is not None for q in self.quant.values())

    def extra_repr(self) -> str:
        kinds = {n: f"{q.kind} {self.scale_blocks[n]}" for n, q in self.quant.items() if q is not None}
        return f"experts={self.num_experts}, hidden={self.hidden}, intermediate={self.intermediate}" + (
            f", quantized={kinds}" if kinds else ""
        )

    def projection(self, name: str) -> torch.Tensor | QuantExpertWeights:
        """The weight ``fused_moe`` takes for projection ``name``: the dense tensor, or the quantized view."""
        weight = getattr(self, name)
        if self.quant[name] is None:
            return weight
        return QuantExpertWeights(
            weight,
            getattr(self, f"{name}_scale"),
            self.scale_blocks[name],
            self.dense_shape(name)[2],
            getattr(self, f"{name}_zero_point"),
            PROJECTIONS[name],
        )

    def dequantize(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """Projection ``name``'s dense [E, N, K] weight in ``dtype`` (the oracle of the quantized paths)."""
        w = self.projection(name)
        if not isinstance(w, QuantExpertWeights):
            return w.to(dtype)
        return torch.stack([dequantize_expert(w, e, dtype) for e in range(self.num_experts)])

    @torch.no_grad()
    def fill_expert(
        self,
        name: str,
        expert: int,
        part: int,
        weight: torch.Tensor,
        scale: torch.Tensor,
        zero_point: torch.Tensor | None = None,
    ) -> None:
        """Copy one expert's quantized projection (part ``part`` of ``name``: gate 0, up 1) in
        ``QuantLinear``'s layout (weight [n, K or K / 8], scale grid, int8 zero points) into its slices."""
        rows, scale_rows = weight.shape[0], scale.shape[0]
        getattr(self, name)[expert, part * rows : (part + 1) * rows].copy_(weight)
        getattr(self, f"{name}_scale")[expert, part * scale_rows : (part + 1) * scale_rows].copy_(scale)
        zero = getattr(self, f"{name}_zero_point")
        if zero is not None:
            zero[expert, part * rows : (part + 1) * rows].copy_(zero_point)

    @torch.no_grad()
    def quantize_from(self, name: str, dense: torch.Tensor) -> None:
        """Fill projection ``name`` from its dense [E, N, K] weight with g4serve's quantizer
        (``layers.quant.quantize_weight``), each expert's parts (gate, up) on their own scale grid."""
        scheme = self.quant[name]
        parts = PROJECTIONS[name]
        num_experts, rows, cols = dense.shape
        block = self.scale_blocks[name]
        asymmetric = not scheme.symmetric
        part_rows = rows // parts
        if part_rows % block[0] == 0:
            # Blocks tile every part: a few experts' parts at a time quantized as one tall weight (the same
            # blocks; the chunks bound the fp32 temporaries at 26B-A4B sizes).
            chunk = max(1, (1 << 26) // (rows * cols))
            for start in range(0, num_experts, chunk):
                stop = min(start + chunk, num_experts)
                q, scale, zero = quantize_weight(
                    dense[start:stop].reshape(-1, cols), scheme.kind, block, asymmetric
                )
                getattr(self, name)[start:stop].copy_(q.view(stop - start, rows, -1))
                getattr(self, f"{name}_scale")[start:stop].copy_(
                    scale.view(stop - start, -1, scale.shape[-1])
                )
                if zero is not None:
                    getattr(self, f"{name}_zero_point")[start:stop].copy_(zero.view(stop - start, rows, -1))
            return
        for e in range(num_experts):
            for p in range(parts):
                q, scale, zero = quantize_weight(
                    dense[e, p * part_rows : (p + 1) * part_rows], scheme.kind, block, asymmetric
                )
                self.fill_expert(name, e, p, q, scale, zero)

    def forward(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, sum_slots: bool = True
    ) -> torch.Tensor:
        """x [T, H], experts / weights [T, k] -> [T, H]: each token's experts, weighted and summed.
        ``sum_slots=False``: on CUDA up to ``CHUNK_TOKENS`` tokens, [T, k, H] unsummed, for the next fused
        norm to sum (``fused_moe``); the reference always sums."""
        gate_up, down = self.projection("gate_up_proj"), self.projection("down_proj")
        if x.is_cuda:
            return fused_moe(x, gate_up, down, experts, weights, self.activation, sum_slots=sum_slots)
        return fused_moe_reference(x, gate_up, down, experts, weights, self.activation)


__all__ = ["PROJECTIONS", "MoEExperts", "MoERouter"]
