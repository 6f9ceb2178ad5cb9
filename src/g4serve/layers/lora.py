"""Multi-adapter LoRA over a flat token batch: every adapter's weights stacked by slot, and a step's
token-to-slot map. The decoder calls ``LoRABatch.add(y, x, layer, module)`` after each adaptable projection,
so one step mixes adapters (and tokens without one) in the same GEMMs, as Punica and S-LoRA do."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from g4serve.config import TextConfig
from g4serve.kernels.lora import add_lora, add_lora_reference

# The projections an adapter may target, named as in the Hugging Face checkpoints.
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
LORA_MODULES = ATTENTION_MODULES + MLP_MODULES
# Projections the fast path computes as one GEMM (``fuse_projections``), their parts in output order.
FUSED_GROUPS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def projection_shapes(cfg: TextConfig) -> dict[tuple[int, str], tuple[int, int]]:
    """(layer, module) -> (in_features, out_features) of every projection the decoder computes.

    KV-shared layers compute no K/V (they read an earlier layer's cache) and ``attention_k_eq_v`` layers no
    V (V is the raw K projection): those projections are absent, so an adapter cannot change them."""
    hidden = cfg.hidden_size
    shapes = {}
    for i in range(cfg.num_hidden_layers):
        q_width = cfg.num_attention_heads * cfg.layer_head_dim(i)
        kv_width = cfg.layer_num_kv_heads(i) * cfg.layer_head_dim(i)
        inter = cfg.layer_intermediate_size(i)
        shapes[i, "q_proj"] = (hidden, q_width)
        if i < cfg.first_kv_shared_layer:
            shapes[i, "k_proj"] = (hidden, kv_width)
            if not cfg.layer_uses_k_as_v(i):
                shapes[i, "v_proj"] = (hidden, kv_width)
        shapes[i, "o_proj"] = (q_width, hidden)
        shapes[i, "gate_proj"] = (hidden, inter)
        shapes[i, "up_proj"] = (hidden, inter)
        shapes[i, "down_proj"] = (inter, hidden)
    return shapes


class LoRAWeights:
    """``max_loras`` slots of adapter weights, allocated once: per (layer, module) an A stack [S, R, in] and
    a B stack [S, out, R] (R = ``max_rank``; lower ranks are zero-padded and the adapter's ``alpha / r``
    scale is folded into B). An empty slot is all zeros. Fixed addresses keep CUDA graphs valid across
    adapter loads: a load copies into the slot, it never reallocates.

    ``fused``: the model computes q/k/v and gate/up as one GEMM each. Their adapters then live in one
    stack per group, A with the parts' ranks stacked [S, m*R, in] and B block-diagonal [S, sum(out), m*R]
    (the per-module stacks are views of its blocks), so a group's delta is one shrink and one expand into the
    fused output instead of a pair per part: at decode, where each op is mostly launch cost, 8 ops a layer
    instead of 14."""

    def __init__(
        self,
        shapes: dict[tuple[int, str], tuple[int, int]],
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        fused: bool = False,
    ):
        self.shapes = dict(shapes)
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = device
        self.group_a: dict[tuple[int, str], torch.Tensor] = {}
        self.group_b: dict[tuple[int, str], torch.Tensor] = {}
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.b: dict[tuple[int, str], torch.Tensor] = {}
        if fused:
            self._stack_groups()
        for key, (n_in, n_out) in shapes.items():
            if key not in self.a:
                self.a[key] = torch.zeros(max_loras, max_rank, n_in, dtype=dtype, device=device)
                self.b[key] = torch.zeros(max_loras, n_out, max_rank, dtype=dtype, device=device)
        # Modules some loaded adapter targets; the others skip the LoRA op entirely.
        self._targeted: dict[tuple[int, str], set[int]] = {k: set() for k in shapes}

    def _stack_groups(self) -> None:
        """Group stacks for every fused projection with more than one part, and the parts' views into them."""
        layers = sorted({layer for layer, _ in self.shapes})
        r, s = self.max_rank, self.max_loras
        for layer in layers:
            for group, parts in FUSED_GROUPS.items():
                present = [p for p in parts if (layer, p) in self.shapes]
                if len(present) < 2:
                    continue
                n_in = self.shapes[layer, present[0]][0]
                n_out = sum(self.shapes[layer, p][1] for p in present)
                a = torch.zeros(s, len(present) * r, n_in, dtype=self.dtype, device=self.device)
                b = torch.zeros(s, n_out, len(present) * r, dtype=self.dtype, device=self.device)
                self.group_a[layer, group], self.group_b[layer, group] = a, b
                row = 0
                for j, part in enumerate(present):
                    width = self.shapes[layer, part][1]
                    self.a[layer, part] = a[:, j * r : (j + 1) * r]
                    self.b[layer, part] = b[:, row : row + width, j * r : (j + 1) * r]
                    row += width

    @property
    def num_bytes(self) -> int:
        """Device bytes of the stacks (a part's stacks that are views of its group's are counted once)."""
        stacks = (self.a, self.b, self.group_a, self.group_b)
        storages = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for g in stacks for t in g.values()
        }
        return sum(storages.values())

    @torch.no_grad()
    def load(self, slot: int, weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write an adapter into ``slot``: per module (A [r, in], B [out, r] with the scale folded in)."""
        self.clear(slot)
        for key, (a, b) in weights.items():
            rank = a.shape[0]
            self.a[key][slot, :rank].copy_(a)
            self.b[key][slot, :, :rank].copy_(b)
            self._targeted[key].add(slot)

    @torch.no_grad()
    def clear(self, slot: int) -> None:
        for key, slots in self._targeted.items():
            if slot in slots:
                self.a[key][slot].zero_()
                self.b[key][slot].zero_()
                slots.discard(slot)

    def targets(self, key: tuple[int, str]) -> bool:
        return bool(self._targeted.get(key))

    def group_targets(self, layer: int, group: str) -> bool:
        return any(self.targets((layer, part)) for part in FUSED_GROUPS[group])


@dataclass
class LoRABatch:
    """One step's view of the adapters: ``token_slots`` [T] holds each token's slot (-1: none)."""

    weights: LoRAWeights
    token_slots: torch.Tensor
    # CUDA graphs capture every module (an adapter loaded after capture must still apply on replay).
    all_modules: bool = False

    def select(self, rows: torch.Tensor) -> LoRABatch:
        """The batch of the kept rows only (the decoder's YOCO fast prefill drops the other rows)."""
        return LoRABatch(self.weights, self.token_slots[rows], self.all_modules)

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, module: str) -> torch.Tensor:
        """``y += lora_B(lora_A(x))`` per token, in place; ``y`` may be a column slice of a fused output."""
        key = (layer, module)
        if key not in self.weights.a or not (self.all_modules or self.weights.targets(key)):
            return y
        op = add_lora if y.is_cuda else add_lora_reference  # the CPU path stays the exact fp32 reference
        op(y, x, self.weights.a[key], self.weights.b[key], self.token_slots)
        return y

    def add_fused(self, y: torch.Tensor, x: torch.Tensor, layer: int, group: str) -> torch.Tensor:
        """The deltas of a fused projection's parts (``FUSED_GROUPS[group]``) into its output ``y``, in place:
        one shrink and one expand over the group's stacks, or part by part into ``y``'s column slices."""
        weights = self.weights
        key = (layer, group)
        if key in weights.group_a:
            if self.all_modules or weights.group_targets(layer, group):
                op = add_lora if y.is_cuda else add_lora_reference
                op(y, x, weights.group_a[key], weights.group_b[key], self.token_slots)
            return y
        col = 0
        for part in FUSED_GROUPS[group]:
            if (layer, part) in weights.shapes:
                width = weights.shapes[layer, part][1]
                self.add(y[:, col : col + width], x, layer, part)
                col += width
        return y


__all__ = ["FUSED_GROUPS", "LORA_MODULES", "LoRABatch", "LoRAWeights", "projection_shapes"]
