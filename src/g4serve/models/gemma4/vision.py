"""Gemma 4 vision tower: patches -> ViT encoder with axial 2-D RoPE -> k×k average pooling -> soft tokens.

Parameter names follow the Hugging Face checkpoints (relative to ``model.vision_tower``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from g4serve.config import VisionConfig
from g4serve.layers.attention import dense_attention
from g4serve.layers.fused import act_mul, add_rms_norm, norm_rope
from g4serve.layers.norm import RMSNorm
from g4serve.layers.rotary import vision_cos_sin, vision_inv_freq
from g4serve.models.gemma4.multimodal import ClippableLinear


class VisionPatchEmbedder(nn.Module):
    """Linear patch projection plus learned x- and y-position embeddings (zero for padding patches)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.input_proj = nn.Linear(3 * cfg.patch_size**2, cfg.hidden_size, bias=False)
        table = torch.ones(2, cfg.position_embedding_size, cfg.hidden_size)  # [x | y, position, hidden]
        self.position_embedding_table = nn.Parameter(table)

    def forward(
        self, pixel_values: torch.Tensor, positions: torch.Tensor, is_pad: torch.Tensor
    ) -> torch.Tensor:
        # The processor leaves pixels in [0, 1]; Gemma 4 maps them to [-1, 1] in the model.
        x = self.input_proj((2 * (pixel_values - 0.5)).to(self.input_proj.weight.dtype))
        pos = positions.clamp(min=0)  # padding is (-1, -1); any valid index will do, it is zeroed below
        pos_emb = F.embedding(pos[..., 0], self.position_embedding_table[0]) + F.embedding(
            pos[..., 1], self.position_embedding_table[1]
        )
        return x + torch.where(is_pad.unsqueeze(-1), 0.0, pos_emb)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.num_kv_groups = cfg.num_attention_heads // cfg.num_key_value_heads
        q_dim, kv_dim = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        clip = cfg.use_clipped_linears
        self.q_proj = ClippableLinear(cfg.hidden_size, q_dim, clip)
        self.k_proj = ClippableLinear(cfg.hidden_size, kv_dim, clip)
        self.v_proj = ClippableLinear(cfg.hidden_size, kv_dim, clip)
        self.o_proj = ClippableLinear(q_dim, cfg.hidden_size, clip)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.v_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, with_scale=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: torch.Tensor | None
    ) -> torch.Tensor:
        B, N, _ = x.shape
        rows, shape = (B * N, -1, self.head_dim), (B, N, -1, self.head_dim)
        cos, sin = cos.reshape(B * N, -1), sin.reshape(B * N, -1)
        # apply_axial_rope(q_norm(q), cos, sin), the same for k, and v_norm(v): one fused pass each on CUDA
        q = norm_rope(self.q_proj(x).view(rows), self.q_norm, cos, sin, sections=2).view(shape)
        k = norm_rope(self.k_proj(x).view(rows), self.k_norm, cos, sin, sections=2).view(shape)
        v = norm_rope(self.v_proj(x).view(rows), self.v_norm).view(shape)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        # q_norm/k_norm carry the softmax temperature, so the dot product is not scaled.
        out = dense_attention(q, k, v, attend)
        return self.o_proj(out.transpose(1, 2).reshape(B, N, -1))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        clip = cfg.use_clipped_linears
        self.gate_proj = ClippableLinear(cfg.hidden_size, cfg.intermediate_size, clip)
        self.up_proj = ClippableLinear(cfg.hidden_size, cfg.intermediate_size, clip)
        self.down_proj = ClippableLinear(cfg.intermediate_size, cfg.hidden_size, clip)
        self.activation = cfg.hidden_activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(act_mul(self.activation, self.gate_proj(x), self.up_proj(x)))


class VisionEncoderLayer(nn.Module):
    """Pre-norm block with an extra norm on each branch output ("sandwich" norms)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.self_attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: torch.Tensor | None,
        normed: torch.Tensor | None = None,
        next_norm: RMSNorm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (h, ``next_norm(h)``). ``normed``: this layer's ``input_layernorm(h)`` when the previous layer
        computed it in its last residual add (one pass over h instead of two)."""
        # h = h + post_attention_layernorm(attn); x = pre_feedforward_layernorm(h);
        # h = h + post_ff_norm(mlp(x))
        attn = self.self_attn(normed if normed is not None else self.input_layernorm(h), cos, sin, attend)
        h, x = add_rms_norm(
            attn, self.post_attention_layernorm, residual=h, next_norm=self.pre_feedforward_layernorm
        )
        return add_rms_norm(self.mlp(x), self.post_feedforward_layernorm, residual=h, next_norm=next_norm)


class VisionEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(VisionEncoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self) -> torch.Tensor:
        return vision_inv_freq(self.cfg.rope_parameters["rope_theta"], self.cfg.head_dim)

    def init_nonpersistent_buffers(self) -> None:
        """Recompute the fp32 RoPE frequencies after the module was materialised from the meta device."""
        self.inv_freq = self._inv_freq().to(self.inv_freq.device)

    def forward(
        self, h: torch.Tensor, positions: torch.Tensor, is_valid: torch.Tensor | None
    ) -> torch.Tensor:
        """``is_valid`` [B, N]: the real patches; None: all are (no mask, so SDPA may take its flash
        kernel)."""
        cos, sin = vision_cos_sin(positions, self.inv_freq, h.dtype)
        # Bidirectional attention; every query (padding ones too) sees only the image's real patches.
        attend = is_valid[:, None, None, :] if is_valid is not None else None
        normed = None
        for i, layer in enumerate(self.layers):
            next_norm = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else None
            h, normed = layer(h, cos, sin, attend, normed, next_norm)
        return h


def avg_pool_by_position(
    h: torch.Tensor, positions: torch.Tensor, k: int, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Average the patches of each k×k cell of the patch grid -> ([B, length, D], cell used [B, length]).

    Padding patches (zero rows) land in cell 0 and add nothing. Pooling is a one-hot matmul, as in the
    reference: it is deterministic on GPU (a scatter-add would not be) and cheap next to the encoder.
    """
    cell = _pooling_cell(positions, k)
    weights = F.one_hot(cell, length).float() / k**2  # [B, N, length]
    pooled = weights.transpose(1, 2) @ h.float()
    return pooled.to(h.dtype), _cells_used(cell, length)


def _pooling_cell(positions: torch.Tensor, k: int) -> torch.Tensor:
    """The k×k pooling cell of each patch [B, N]; padding patches fall in cell 0."""
    pos = positions.clamp(min=0)
    cells_per_row = (pos[..., 0].amax(dim=-1, keepdim=True) + 1) // k
    return pos[..., 0] // k + cells_per_row * (pos[..., 1] // k)


def pooling_cells_used(positions: torch.Tensor, k: int, length: int) -> torch.Tensor:
    """Which of the ``length`` cells hold a soft token [B, length] (``avg_pool_by_position``'s mask), from the
    positions alone: the host computes it from CPU positions instead of reading the device's back."""
    return _cells_used(_pooling_cell(positions, k), length)


def _cells_used(cell: torch.Tensor, length: int) -> torch.Tensor:
    used = torch.zeros(cell.shape[0], length, dtype=torch.bool, device=cell.device)
    return used.scatter_(1, cell, True)


class Gemma4VisionModel(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embedder = VisionPatchEmbedder(cfg)
        self.encoder = VisionEncoder(cfg)
        if cfg.standardize:
            self.register_buffer("std_bias", torch.zeros(cfg.hidden_size))
            self.register_buffer("std_scale", torch.ones(cfg.hidden_size))

    def forward(self, pixel_values: torch.Tensor, pixel_position_ids: torch.Tensor) -> torch.Tensor:
        """Patches [B, N, 3*p*p] with (x, y) positions [B, N, 2] ((-1, -1) = padding)
        -> soft tokens [total_soft_tokens, hidden], images in batch order, padding removed."""
        h, is_used = self._pooled(pixel_values, pixel_position_ids)
        return self._finish(h[is_used]).to(h.dtype)

    def forward_padded(
        self, pixel_values: torch.Tensor, pixel_position_ids: torch.Tensor, no_padding: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fixed-shape variant (CUDA graphs): soft tokens for every pooling cell [B, L, hidden] and which
        cells hold one [B, L]; ``forward`` equals ``out[is_used]``. ``no_padding``: the caller checked that
        every patch is real (video frames of one size), so attention runs without a mask."""
        h, is_used = self._pooled(pixel_values, pixel_position_ids, no_padding)
        return self._finish(h).to(h.dtype), is_used

    def _pooled(self, pixel_values: torch.Tensor, pixel_position_ids: torch.Tensor, no_padding: bool = False):
        k = self.cfg.pooling_kernel_size
        is_pad = (pixel_position_ids == -1).all(dim=-1)
        h = self.patch_embedder(pixel_values, pixel_position_ids, is_pad)
        h = self.encoder(h, pixel_position_ids, None if no_padding else ~is_pad)
        h = h.masked_fill(is_pad.unsqueeze(-1), 0.0)
        return avg_pool_by_position(h, pixel_position_ids, k, pixel_values.shape[1] // k**2)

    def _finish(self, pooled: torch.Tensor) -> torch.Tensor:
        # The sqrt(hidden) scale can overflow fp16, and std_bias cancels large values: both stay in fp32.
        out = pooled.float() * self.cfg.hidden_size**0.5
        if self.cfg.standardize:
            out = (out - self.std_bias.float()) * self.std_scale.float()
        return out
