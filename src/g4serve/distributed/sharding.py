"""How Gemma 4's text decoder splits over a tensor-parallel group, Megatron-style.

Per rank: a contiguous block of query heads (q_proj's rows, o_proj's columns) and the KV heads those queries
read; a contiguous block of each MLP's and each routed expert's intermediate units (gate/up rows, down
columns), or with expert parallelism a contiguous block of whole experts; a contiguous block of the
vocabulary in both embedding tables (the token embedding, which is also the tied LM head, and the per-layer
embeddings, by far the largest tensor of E2B/E4B). Everything else (norms, the router, the per-layer-input
gates and projections, the towers) is replicated.

Gemma 4 has few KV heads (31B's full layers: 4; the tiny test models: 1), so a group larger than a layer's KV
head count gives each rank one KV head, shared with the ranks beside it: rank r reads KV head
``r // (size / Hkv)``, which is the head its query heads map to under grouped-query attention. Each rank's
cache holds its own KV heads, so a replicated head is stored once per rank that reads it.

``shard_text_config`` gives the rank-local config (heads and intermediate sizes per rank; vocabulary, head
dims and everything else the checkpoint's): the model, its KV cache and its kernels are built from it as if it
were a smaller model. ``ShardPlan`` takes the rank's slice out of a checkpoint-shaped tensor, at load or at
random initialisation.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch

from g4serve.config import TextConfig


def kv_heads_per_rank(num_kv_heads: int, size: int) -> int:
    return num_kv_heads // size if num_kv_heads >= size else 1


def rank_kv_heads(num_kv_heads: int, rank: int, size: int) -> list[int]:
    """The KV heads rank ``rank`` holds (several, or one shared with its neighbours)."""
    if num_kv_heads >= size:
        per = num_kv_heads // size
        return list(range(rank * per, (rank + 1) * per))
    return [rank // (size // num_kv_heads)]


def vocab_rows_per_rank(vocab_size: int, size: int) -> int:
    """Rows of a vocab-parallel table per rank; the last rank's slice is padded with zero rows."""
    return -(-vocab_size // size)


def check_tensor_parallel(text: TextConfig, size: int, expert_parallel: bool = False) -> None:
    """A ValueError naming ``tensor_parallel_size`` when the model cannot split evenly over ``size`` ranks."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size: must be at least 1, got {size}")
    problems = []
    if text.num_attention_heads % size:
        problems.append(f"{text.num_attention_heads} query heads")
    for layer in range(text.num_hidden_layers):
        kv = text.layer_num_kv_heads(layer)
        if kv % size and size % kv:
            problems.append(f"layer {layer}'s {kv} KV heads (neither divides the other)")
            break
        if text.layer_intermediate_size(layer) % size:
            problems.append(f"layer {layer}'s MLP width {text.layer_intermediate_size(layer)}")
            break
    if text.enable_moe_block and expert_parallel and (text.num_experts or 0) % size:
        problems.append(f"{text.num_experts} experts")
    elif text.enable_moe_block and not expert_parallel and (text.moe_intermediate_size or 0) % size:
        problems.append(f"the experts' width {text.moe_intermediate_size}")
    if problems:
        raise ValueError(f"tensor_parallel_size: {size} ranks cannot split " + ", ".join(problems))


def shard_text_config(text: TextConfig, size: int, expert_parallel: bool = False) -> TextConfig:
    """The config of one rank's shard (the same on every rank). With ``expert_parallel`` the experts keep
    their width and ``num_experts`` stays the router's count (a rank holds ``num_experts / size``)."""
    if size == 1:
        return text
    check_tensor_parallel(text, size, expert_parallel)
    overrides = None
    if text.per_layer_config:
        overrides = {
            key: {k: kv_heads_per_rank(v, size) if k == "num_key_value_heads" else v for k, v in lc.items()}
            for key, lc in text.per_layer_config.items()
        }
    global_kv = text.num_global_key_value_heads
    return replace(
        text,
        num_attention_heads=text.num_attention_heads // size,
        num_key_value_heads=kv_heads_per_rank(text.num_key_value_heads, size),
        num_global_key_value_heads=None if global_kv is None else kv_heads_per_rank(global_kv, size),
        intermediate_size=text.intermediate_size // size,
        moe_intermediate_size=(
            text.moe_intermediate_size
            if text.moe_intermediate_size is None or expert_parallel
            else text.moe_intermediate_size // size
        ),
        per_layer_config=overrides,
    )


@dataclass(frozen=True)
class Shard:
    """Rank's slice of a tensor: ``index`` along ``dim`` (-1: a zero row, the vocabulary's padding), or with
    ``zero`` a tensor this rank holds as zeros (a row-parallel bias, added once, by rank 0)."""

    dim: int = 0
    index: torch.Tensor | None = None
    zero: bool = False

    def take(self, full: torch.Tensor) -> torch.Tensor:
        if self.zero:
            return torch.zeros_like(full)
        index = self.index.to(full.device)
        out = full.index_select(self.dim, index.clamp(min=0))
        pad = index < 0
        if bool(pad.any()):
            shape = [1] * out.ndim
            shape[self.dim] = -1
            out = out.masked_fill(pad.view(shape), 0)
        return out


_LAYER_PARAM = re.compile(
    r"language_model\.layers\.(\d+)\.(self_attn|mlp|experts)\.(\w+?)(?:\.(weight|bias))?$"
)


class ShardPlan:
    """Which slice of each checkpoint tensor rank ``rank`` of ``size`` holds, by parameter name (the names of
    ``Gemma4Model.state_dict``). ``text``: the checkpoint's (full) text config."""

    def __init__(self, text: TextConfig, rank: int, size: int, expert_parallel: bool = False):
        check_tensor_parallel(text, size, expert_parallel)
        self.text, self.rank, self.size, self.expert_parallel = text, rank, size, expert_parallel

    def shard(self, name: str) -> Shard | None:
        """``name``'s slice on this rank; None: replicated, every rank holds all of it."""
        if self.size == 1:
            return None
        if name == "language_model.embed_tokens.weight":
            return self._vocab(self.text.vocab_size)
        if name == "language_model.embed_tokens_per_layer.weight":
            return self._vocab(self.text.vocab_size_per_layer_input)
        match = _LAYER_PARAM.match(name)
        if match is None:
            return None
        layer, block, proj, kind = int(match.group(1)), match.group(2), match.group(3), match.group(4)
        if block == "self_attn":
            return self._attention(layer, proj, kind)
        if block == "mlp":
            return self._units(self.text.layer_intermediate_size(layer), proj, kind)
        return self._experts(proj)

    def take(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """``full`` (checkpoint-shaped) cut to this rank's slice of parameter ``name``."""
        shard = self.shard(name)
        return full if shard is None else shard.take(full)

    def full_shape(self, name: str, local_shape: torch.Size) -> tuple[int, ...]:
        """The checkpoint shape of parameter ``name``, whose shape on this rank is ``local_shape``."""
        shard = self.shard(name)
        if shard is None or shard.zero:
            return tuple(local_shape)
        shape = list(local_shape)
        shape[shard.dim] = self._full_rows(name, shard)
        return tuple(shape)

    # ---- the slices ---------------------------------------------------------------------------------
    def _full_rows(self, name: str, shard: Shard) -> int:
        if name.endswith("embed_tokens.weight"):
            return self.text.vocab_size
        if name.endswith("embed_tokens_per_layer.weight"):
            return self.text.vocab_size_per_layer_input
        # heads, units and experts split evenly: every rank's slice has the same length (replicated KV heads
        # aside)
        match = _LAYER_PARAM.match(name)
        layer, proj = int(match.group(1)), match.group(3)
        if proj in ("k_proj", "v_proj"):
            return self.text.layer_num_kv_heads(layer) * self.text.layer_head_dim(layer)
        return shard.index.numel() * self.size

    def _row_parallel_bias(self) -> Shard | None:
        """A row-parallel layer's bias joins the sum once: rank 0 holds it, the others zeros."""
        return Shard(zero=True) if self.rank else None

    def _vocab(self, vocab_size: int) -> Shard:
        per = vocab_rows_per_rank(vocab_size, self.size)
        rows = torch.arange(self.rank * per, (self.rank + 1) * per)
        return Shard(0, torch.where(rows < vocab_size, rows, -1))

    def _head_rows(self, heads: list[int], head_dim: int) -> torch.Tensor:
        return torch.cat([torch.arange(h * head_dim, (h + 1) * head_dim) for h in heads])

    def _attention(self, layer: int, proj: str, kind: str | None) -> Shard:
        head_dim = self.text.layer_head_dim(layer)
        per = self.text.num_attention_heads // self.size
        q_rows = self._head_rows(list(range(self.rank * per, (self.rank + 1) * per)), head_dim)
        if proj == "q_proj":
            return Shard(0, q_rows)
        if proj in ("k_proj", "v_proj"):
            heads = rank_kv_heads(self.text.layer_num_kv_heads(layer), self.rank, self.size)
            return Shard(0, self._head_rows(heads, head_dim))
        if proj == "o_proj":
            return Shard(1, q_rows) if kind == "weight" else self._row_parallel_bias()
        return None  # q_norm, k_norm: per head dim, replicated

    def _units(self, width: int, proj: str, kind: str | None) -> Shard:
        per = width // self.size
        rows = torch.arange(self.rank * per, (self.rank + 1) * per)
        if proj in ("gate_proj", "up_proj"):
            return Shard(0, rows)
        if proj == "down_proj":
            return Shard(1, rows) if kind == "weight" else self._row_parallel_bias()
        raise ValueError(f"tensor parallel: no rule for MLP projection {proj}")

    def _experts(self, proj: str) -> Shard:
        if self.expert_parallel:  # [E, ...]: whole experts
            per = self.text.num_experts // self.size
            return Shard(0, torch.arange(self.rank * per, (self.rank + 1) * per))
        width = self.text.moe_intermediate_size
        per = width // self.size
        rows = torch.arange(self.rank * per, (self.rank + 1) * per)
        if proj == "gate_up_proj":  # [E, 2I, H]: gate rows, then up rows
            return Shard(1, torch.cat([rows, rows + width]))
        if proj == "down_proj":  # [E, H, I]
            return Shard(2, rows)
        raise ValueError(f"tensor parallel: no rule for expert tensor {proj}")
