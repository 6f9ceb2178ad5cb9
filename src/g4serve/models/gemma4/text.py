"""Gemma 4 text decoder over a flat batch of tokens.

Reads like the reference: scaled embeddings, per-layer embeddings (PLE), sliding/full
attention with per-type head dims and RoPE, q/k/v norms, KV sharing, dense MLP plus the
optional routed MoE block, per-layer scalar, soft-capped tied LM head. Attention goes
through an ``AttentionBackend`` so the engine can swap caches and kernels. Parameter
names follow the Hugging Face checkpoints (relative to ``model.language_model``).
"""

from __future__ import annotations

import torch
from torch import nn

from g4serve.config import TextConfig
from g4serve.distributed import SINGLE, TensorParallel
from g4serve.distributed.sharding import vocab_rows_per_rank
from g4serve.kernels.decode_tail import new_counters
from g4serve.layers.attention import AttentionBackend, AttentionMetadata
from g4serve.layers.fused import (
    act_mul,
    add_rms_norm,
    decode_tail_applies,
    decode_tail_block,
    gate_up_act,
    linear,
    linear_act_mul,
    moe_input_norms,
    moe_route,
    norm_rope,
    project,
    qkv_norm_rope_write,
)
from g4serve.layers.lora import LoRABatch
from g4serve.layers.moe import MoEExperts, MoERouter
from g4serve.layers.norm import RMSNorm
from g4serve.layers.quant import stack_linears
from g4serve.layers.rotary import rope_cos_sin, text_inv_freq


class ScaledEmbedding(nn.Embedding):
    """Embedding multiplied by a constant that is rounded to the weight dtype first (as Gemma does).

    Vocab-parallel under tensor parallelism: rank r holds rows [r * n, (r + 1) * n) of the table; a token
    outside them embeds as zeros there, and the sum over the ranks is the one rank's row (exactly)."""

    def __init__(self, num_embeddings: int, dim: int, scale: float, tp: TensorParallel = SINGLE):
        rows = vocab_rows_per_rank(num_embeddings, tp.size)
        super().__init__(rows, dim)
        self.tp, self.vocab_start = tp, tp.rank * rows
        self.scale = scale
        self.register_buffer("embed_scale", torch.tensor(scale), persistent=False)

    def init_nonpersistent_buffers(self) -> None:
        self.embed_scale = torch.tensor(self.scale, device=self.weight.device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(ids) * self.embed_scale.to(self.weight.dtype)
        local = ids - self.vocab_start
        held = (local >= 0) & (local < self.num_embeddings)
        rows = super().forward(torch.where(held, local, 0)) * held.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(rows * self.embed_scale.to(self.weight.dtype))


class TextAttention(nn.Module):
    """``cfg``: this rank's shard under tensor parallelism (its query and KV heads); o_proj's partial sums
    are added over the group."""

    def __init__(self, cfg: TextConfig, layer_idx: int, tp: TensorParallel = SINGLE):
        super().__init__()
        self.layer_idx = layer_idx
        self.tp = tp
        # The layer whose K/V this one attends over, by the backend's numbering: itself, or for an MTP
        # drafter's layers a layer of the target model (models/gemma4/assistant.py).
        self.kv_layer = layer_idx
        self.head_dim = cfg.layer_head_dim(layer_idx)
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.layer_num_kv_heads(layer_idx)
        self.is_kv_shared = layer_idx >= cfg.first_kv_shared_layer
        hidden, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        if not self.is_kv_shared:
            self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
            # attention_k_eq_v: full layers take V from the raw K projection.
            self.v_proj = (
                None
                if cfg.layer_uses_k_as_v(layer_idx)
                else nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
            )
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.v_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, with_scale=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.qkv_proj: nn.Linear | None = None  # q, k, v stacked (``fuse_projections``)
        self._v_in_qkv = False

    @property
    def input_projection(self) -> nn.Module:
        """The projection that reads the layer's normed input first: q/k/v stacked, or q alone."""
        return self.qkv_proj if self.qkv_proj is not None else self.q_proj

    @torch.no_grad()
    def fuse_projections(self) -> None:
        """Stack the q/k/v projections into one GEMM (the fast path; the split is a view per step)."""
        parts = [
            p
            for p in (self.q_proj, getattr(self, "k_proj", None), getattr(self, "v_proj", None))
            if p is not None
        ]
        if len(parts) == 1 or self.qkv_proj is not None:
            return
        self.qkv_proj = stack_linears(parts)  # quantized parts stay quantized (layers/quant.py)
        self.q_proj = self.k_proj = None
        if self.v_proj is not None:
            self.v_proj = None
            self._v_in_qkv = True

    def _fused_qkv(self, x: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        """The stacked q/k/v projection, each part plus its adapters' delta."""
        qkv = linear(x, self.qkv_proj)
        return qkv if lora is None else lora.add_fused(qkv, x, self.layer_idx, "qkv_proj")

    def _linear(self, x: torch.Tensor, layer: nn.Linear, name: str, lora: LoRABatch | None) -> torch.Tensor:
        y = linear(x, layer)
        return y if lora is None else lora.add(y, x, self.layer_idx, name)

    def _project(self, x: torch.Tensor, lora: LoRABatch | None):
        t = x.shape[0]
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.qkv_proj is None:
            q = self._linear(x, self.q_proj, "q_proj", lora).view(t, self.num_heads, self.head_dim)
            if self.is_kv_shared:
                return q, None, None
            k = self._linear(x, self.k_proj, "k_proj", lora).view(t, self.num_kv_heads, self.head_dim)
            v = k
            if self.v_proj is not None:
                v = self._linear(x, self.v_proj, "v_proj", lora).view(t, self.num_kv_heads, self.head_dim)
            return q, k, v
        qkv = self._fused_qkv(x, lora)
        q = qkv[:, :q_width].view(t, self.num_heads, self.head_dim)
        k = qkv[:, q_width : q_width + kv_width].view(t, self.num_kv_heads, self.head_dim)
        v = qkv[:, q_width + kv_width :].view(t, self.num_kv_heads, self.head_dim) if self._v_in_qkv else k
        return q, k, v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        lora: LoRABatch | None = None,
        project: bool = True,
    ) -> torch.Tensor:
        """The attention's output through ``o_proj`` (summed over the group), or with ``project=False`` the
        heads' output [T, Hq * D] before it (the persistent decode tail's input)."""
        t = x.shape[0]
        target = None
        if self.qkv_proj is not None and not self.is_kv_shared:
            target = backend.kv_write_target(self.layer_idx, meta)  # TritonAttention: on CUDA
        if target is not None:  # norms, RoPE and the K/V cache write in one kernel
            q = qkv_norm_rope_write(
                self._fused_qkv(x, lora),
                self.num_heads,
                self.num_kv_heads,
                self.q_norm,
                self.k_norm,
                cos,
                sin,
                target,
                v_is_k=not self._v_in_qkv,
            )
            out = backend.attend(self.layer_idx, q, None, None, meta)
        else:
            q, k_raw, v_raw = self._project(x, lora)  # v_raw is k_raw where attention_k_eq_v
            q = norm_rope(q, self.q_norm, cos, sin)  # apply_rope(q_norm(q), cos, sin)
            k = v = None
            if k_raw is not None:
                k = norm_rope(k_raw, self.k_norm, cos, sin)
                v = norm_rope(v_raw, self.v_norm)  # v_norm(v): no weight, no rotation
            out = backend.attend(self.kv_layer, q, k, v, meta)
        out = out.reshape(t, self.num_heads * self.head_dim)
        if not project:
            return out
        return self.tp.all_reduce(self._linear(out, self.o_proj, "o_proj", lora))


class GatedMLP(nn.Module):
    """``intermediate``: this rank's units under tensor parallelism; down_proj's partial sums are added over
    the group."""

    def __init__(
        self, hidden: int, intermediate: int, activation: str, layer_idx: int = 0, tp: TensorParallel = SINGLE
    ):
        super().__init__()
        self.layer_idx = layer_idx  # names its projections for LoRA adapters
        self.tp = tp
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.activation = activation
        self.intermediate = intermediate
        self.gate_up_proj: nn.Linear | None = None  # gate and up stacked (``fuse_projections``)

    @torch.no_grad()
    def fuse_projections(self) -> None:
        if self.gate_up_proj is not None:
            return
        self.gate_up_proj = stack_linears([self.gate_proj, self.up_proj])
        self.gate_proj = self.up_proj = None

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        if lora is not None:
            return self.tp.all_reduce(self._forward_lora(x, lora))
        if self.gate_up_proj is None:
            out = self.down_proj(act_mul(self.activation, self.gate_proj(x), self.up_proj(x)))
        else:
            out = linear(gate_up_act(x, self.gate_up_proj, self.activation), self.down_proj)
        return self.tp.all_reduce(out)

    def _forward_lora(self, x: torch.Tensor, lora: LoRABatch) -> torch.Tensor:
        """``forward`` with each projection plus its adapters' delta; the deltas join the gate and up
        outputs before the activation, so the fused gate/up/activation pass is split here."""
        i = self.layer_idx
        if self.gate_up_proj is None:
            gate = lora.add(linear(x, self.gate_proj), x, i, "gate_proj")
            up = lora.add(linear(x, self.up_proj), x, i, "up_proj")
        else:
            gate_up = lora.add_fused(linear(x, self.gate_up_proj), x, i, "gate_up_proj")
            gate, up = gate_up[:, : self.intermediate], gate_up[:, self.intermediate :]
        h = act_mul(self.activation, gate, up)
        return lora.add(linear(h, self.down_proj), h, i, "down_proj")


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, layer_idx: int, tp: TensorParallel = SINGLE):
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.tp = tp
        self.layer_type = cfg.layer_types[layer_idx]
        self.self_attn = TextAttention(cfg, layer_idx, tp)
        self.mlp = GatedMLP(
            hidden, cfg.layer_intermediate_size(layer_idx), cfg.hidden_activation, layer_idx, tp
        )
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)
        self.register_buffer("layer_scalar", torch.ones(1))
        self.ple_dim = cfg.hidden_size_per_layer_input
        if self.ple_dim:
            self.activation = cfg.hidden_activation
            self.per_layer_input_gate = nn.Linear(hidden, self.ple_dim, bias=False)
            self.per_layer_projection = nn.Linear(self.ple_dim, hidden, bias=False)
            self.post_per_layer_input_norm = RMSNorm(hidden, eps)
        self.enable_moe = cfg.enable_moe_block
        if self.enable_moe:
            self.router = MoERouter(hidden, cfg.num_experts, cfg.top_k_experts, eps)
            # expert parallel: this rank's experts, whole; else every expert, this rank's units of each
            self.num_local_experts = cfg.num_experts // tp.size if tp.expert_parallel else cfg.num_experts
            self.experts = MoEExperts(
                self.num_local_experts, hidden, cfg.moe_intermediate_size, cfg.hidden_activation
            )
            self.post_feedforward_layernorm_1 = RMSNorm(hidden, eps)
            self.post_feedforward_layernorm_2 = RMSNorm(hidden, eps)
            self.pre_feedforward_layernorm_2 = RMSNorm(hidden, eps)
        # the persistent decode tail's counters, made by ``fuse_projections`` on CUDA
        self.decode_counters: torch.Tensor | None = None

    @torch.no_grad()
    def fuse_projections(self) -> None:
        """The fast path's layout (stacked q/k/v and gate/up) and, on CUDA, the decode tail's counters."""
        self.self_attn.fuse_projections()
        self.mlp.fuse_projections()
        weight = self.self_attn.o_proj.weight
        if weight.is_cuda and self.decode_counters is None:
            self.decode_counters = new_counters(weight.device)

    def _takes_decode_tail(self, h: torch.Tensor, lora: LoRABatch | None) -> bool:
        """Whether the persistent decode kernel runs this layer's tail after attention for input rows ``h``
        (``layers.fused.decode_tail_applies``; a dense layer on one rank, no adapters)."""
        if lora is not None or self.enable_moe or self.tp.size != 1 or self.mlp.gate_up_proj is None:
            return False
        layers = [self.self_attn.o_proj, self.mlp.gate_up_proj, self.mlp.down_proj]
        if self.ple_dim:
            layers += [self.per_layer_input_gate, self.per_layer_projection]
        return decode_tail_applies(h, layers, self.decode_counters)

    def _decode_tail(
        self,
        attn: torch.Tensor,
        residual: torch.Tensor,
        per_layer_input: torch.Tensor | None,
        next_norm: RMSNorm | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``forward``'s ops after attention, from the heads' output before ``o_proj``, in one launch."""
        ple = None
        if self.ple_dim:
            ple = (
                self.per_layer_input_gate,
                self.per_layer_projection,
                per_layer_input,
                self.post_per_layer_input_norm,
            )
        return decode_tail_block(
            attn,
            residual,
            self.self_attn.o_proj,
            self.post_attention_layernorm,
            self.pre_feedforward_layernorm,
            self.mlp.gate_up_proj,
            self.mlp.down_proj,
            self.post_feedforward_layernorm,
            self.mlp.activation,
            self.decode_counters,
            ple,
            self.layer_scalar,
            next_norm,
        )

    def _local_experts(
        self, experts: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert parallel: the routed ids in this rank's numbering; a token's experts held elsewhere keep a
        valid id here and weigh 0, so the rank's sum is its experts' share alone."""
        local = experts - self.tp.rank * self.num_local_experts
        held = (local >= 0) & (local < self.num_local_experts)
        return torch.where(held, local, 0), torch.where(held, weights, 0)

    def forward(
        self,
        h: torch.Tensor,
        per_layer_input: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        normed: torch.Tensor | None = None,
        next_norm: RMSNorm | None = None,
        lora: LoRABatch | None = None,
        next_proj: nn.Module | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (the layer's output h, ``next_norm(h)`` or None). ``normed``: ``input_layernorm(h)`` when the
        previous layer already computed it (its ``next_norm``, fused into its last residual add).
        ``next_proj``: the next layer's ``input_projection``, which reads ``next_norm(h)``."""
        # Each add_rms_norm is one fused pass on CUDA; the comments spell out the unfused math.
        residual = h
        x = normed if normed is not None else self.input_layernorm(h)
        if self._takes_decode_tail(h, lora):  # decode sizes: everything after attention in one launch
            attn = self.self_attn(x, cos, sin, meta, backend, project=False)
            return self._decode_tail(attn, residual, per_layer_input, next_norm)
        h = self.self_attn(x, cos, sin, meta, backend, lora)
        # h = residual + post_attention_layernorm(h); x = pre_feedforward_layernorm(h)
        h, x = add_rms_norm(
            h,
            self.post_attention_layernorm,
            residual=residual,
            next_norm=self.pre_feedforward_layernorm,
            next_proj=self.mlp.gate_up_proj,
        )

        residual = h
        out = self.mlp(x, lora)
        branches = None
        if self.enable_moe:
            # The routed experts run beside the dense MLP, both fed from the residual stream. One pass makes
            # the experts' input pre_feedforward_layernorm_2(residual) and the router's.
            experts_in, routed = moe_input_norms(residual, self.pre_feedforward_layernorm_2, self.router)
            weights, experts = moe_route(self.router, routed)
            if self.num_local_experts < self.router.per_expert_scale.shape[0]:
                experts, weights = self._local_experts(experts, weights)
            # one rank: the k expert outputs of a token are summed by the next pass, which reads them anyway
            moe = self.experts(experts_in, experts, weights, sum_slots=self.tp.size != 1)
            moe = self.tp.all_reduce(moe)  # each rank's share: its units of every expert, or its experts
            # out becomes post_feedforward_layernorm_1(out) + post_feedforward_layernorm_2(moe), summed in the
            # next pass
            branches = (self.post_feedforward_layernorm_1, moe, self.post_feedforward_layernorm_2)
        if not self.ple_dim:
            # (residual + post_feedforward_layernorm(out)) * layer_scalar
            return add_rms_norm(
                out,
                self.post_feedforward_layernorm,
                residual=residual,
                scale=self.layer_scalar,
                next_norm=next_norm,
                next_proj=next_proj,
                branches=branches,
            )
        h, _ = add_rms_norm(out, self.post_feedforward_layernorm, residual=residual, branches=branches)
        # PLE: h = (h + post_per_layer_input_norm(projection(act(gate(h)) * per_layer_input))) * layer_scalar
        gate = linear_act_mul(h, self.per_layer_input_gate, per_layer_input, self.activation)
        return add_rms_norm(
            linear(gate, self.per_layer_projection),
            self.post_per_layer_input_norm,
            residual=h,
            scale=self.layer_scalar,
            next_norm=next_norm,
            next_proj=next_proj,
        )


class Gemma4TextModel(nn.Module):
    """``cfg``: the decoder's config, under tensor parallelism this rank's shard of it
    (``distributed.sharding.shard_text_config``); ``tp``: the rank's group."""

    def __init__(self, cfg: TextConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        if cfg.use_bidirectional_attention == "all":
            raise ValueError(
                "text_config.use_bidirectional_attention='all' describes a non-causal (encoder) variant; "
                "g4serve serves generative Gemma 4 models"
            )
        self.cfg, self.tp = cfg, tp
        self.embed_tokens = ScaledEmbedding(cfg.vocab_size, cfg.hidden_size, cfg.hidden_size**0.5, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ple_dim = cfg.hidden_size_per_layer_input
        if self.ple_dim:
            num_layers = cfg.num_hidden_layers
            self.embed_tokens_per_layer = ScaledEmbedding(
                cfg.vocab_size_per_layer_input, num_layers * self.ple_dim, self.ple_dim**0.5, tp
            )
            self.per_layer_model_projection = nn.Linear(
                cfg.hidden_size, num_layers * self.ple_dim, bias=False
            )
            self.per_layer_projection_norm = RMSNorm(self.ple_dim, cfg.rms_norm_eps)
        for layer_type, inv in self._inv_freqs().items():
            self.register_buffer(f"{layer_type}_inv_freq", inv, persistent=False)

    def _inv_freqs(self) -> dict[str, torch.Tensor]:
        cfg = self.cfg
        out = {}
        for layer_type in set(cfg.layer_types):
            head_dim = next(cfg.layer_head_dim(i) for i, t in enumerate(cfg.layer_types) if t == layer_type)
            out[layer_type] = text_inv_freq(cfg.rope_parameters[layer_type], head_dim)
        return out

    def init_nonpersistent_buffers(self) -> None:
        """Recompute fp32 RoPE tables after the module was materialised from the meta device."""
        for layer_type, inv in self._inv_freqs().items():
            setattr(self, f"{layer_type}_inv_freq", inv.to(self.norm.weight.device))

    def embed(self, text_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(text_ids)

    def per_layer_inputs(self, text_ids: torch.Tensor, inputs_embeds: torch.Tensor) -> torch.Tensor:
        """PLE: token-identity table plus a projection of the (merged) input embeddings -> [T, L, P]."""
        num_layers = self.cfg.num_hidden_layers
        identity = self.embed_tokens_per_layer(text_ids).reshape(-1, num_layers, self.ple_dim)
        context = linear(inputs_embeds, self.per_layer_model_projection) * (self.cfg.hidden_size**-0.5)
        context = self.per_layer_projection_norm(context.reshape(-1, num_layers, self.ple_dim))
        return (context + identity) * (2.0**-0.5)

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        text_ids: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        keep_indices: list[int] | torch.Tensor | None = None,
        kept_meta: AttentionMetadata | None = None,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        """Run the decoder. ``keep_indices``: query tokens whose hidden state is needed (sorted).

        When given, layers past the last KV producer run only on those tokens (YOCO fast
        prefill): those layers write no K/V, so the other tokens' states are never read again.
        Returns the final-normed hidden states of the kept tokens (all tokens if None).
        ``kept_meta``: the metadata of the kept queries, precomputed (CUDA-graph captures pass
        ``keep_indices`` as a device tensor and cannot derive it on the host); else derived here.
        ``lora``: the step's adapters per token (None: no adapter anywhere in the step).
        """
        cfg = self.cfg
        h = inputs_embeds
        ple = self.per_layer_inputs(text_ids, inputs_embeds) if self.ple_dim else None
        tables = {
            t: rope_cos_sin(meta.positions, getattr(self, f"{t}_inv_freq"), h.dtype)
            for t in set(cfg.layer_types)
        }
        sliced = False
        normed = (
            None  # the next layer's input_layernorm(h), fused into the previous layer's last residual add
        )
        for i, layer in enumerate(self.layers):
            if i == cfg.first_kv_shared_layer and keep_indices is not None and cfg.num_kv_shared_layers:
                idx = _as_index(keep_indices, h.device)
                h, normed = h[idx], normed[idx] if normed is not None else None
                ple = ple[idx] if ple is not None else None
                tables = {t: (c[idx], s[idx]) for t, (c, s) in tables.items()}
                meta = kept_meta if kept_meta is not None else meta.select_queries(keep_indices)
                lora = lora.select(idx) if lora is not None else None
                sliced = True
            cos, sin = tables[layer.layer_type]
            last = i + 1 == len(self.layers)
            next_norm = self.norm if last else self.layers[i + 1].input_layernorm
            next_proj = None if last else self.layers[i + 1].self_attn.input_projection
            h, normed = layer(
                h,
                ple[:, i] if ple is not None else None,
                cos,
                sin,
                meta,
                backend,
                normed,
                next_norm,
                lora,
                next_proj,
            )
        h = normed  # self.norm(h), from the last layer
        if keep_indices is not None and not sliced:
            h = h[_as_index(keep_indices, h.device)]
        return h

    def fuse_projections(self) -> None:
        """Lay the weights out for the fast path, once after loading: q/k/v and gate/up each become one GEMM.
        Only for accelerators: the CPU reference path keeps the separate (bit-exact) projections."""
        for layer in self.layers:
            layer.fuse_projections()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = project(hidden, self.embed_tokens.weight)
        if self.tp.size > 1:  # vocab-parallel: each rank's slice, side by side, less the last one's padding
            logits = self.tp.all_gather(logits)[:, : self.cfg.vocab_size]
        cap = self.cfg.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


def _as_index(rows: list[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    return rows if isinstance(rows, torch.Tensor) else torch.tensor(rows, dtype=torch.long, device=device)
