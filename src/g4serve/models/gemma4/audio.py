"""Gemma 4 audio tower (USM-style conformer): log-mel frames -> 4x time-subsampled soft tokens.

Parameter names follow the Hugging Face checkpoints (relative to ``model.audio_tower``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from g4serve.config import AudioConfig
from g4serve.kernels.act_mul import ACTIVATIONS
from g4serve.layers.norm import RMSNorm
from g4serve.models.gemma4.multimodal import ClippableLinear

# The reference builds these norms with the default eps instead of cfg.rms_norm_eps.
_DEFAULT_EPS = 1e-6


def _clip_bound(cfg: AudioConfig, dtype: torch.dtype) -> float:
    # Training-time guard value; capped so that clamping never overflows half-precision types.
    return min(cfg.gradient_clipping, torch.finfo(dtype).max)


class SubSampleConvLayer(nn.Module):
    """3×3 stride-2 conv over (time, mel) + channel LayerNorm + ReLU; padded frames are zeroed first."""

    def __init__(self, in_channels: int, out_channels: int, eps: float):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=3, stride=2, padding=1, bias=False)
        self.norm = nn.LayerNorm(out_channels, eps=eps, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.conv((x * mask[:, None, :, None]).to(self.conv.weight.dtype))
        x = F.relu(self.norm(x.permute(0, 2, 3, 1))).permute(0, 3, 1, 2).contiguous()
        return x, mask[:, ::2]


class SubSampleConvProjection(nn.Module):
    def __init__(self, cfg: AudioConfig):
        super().__init__()
        c0, c1 = cfg.subsampling_conv_channels
        self.layer0 = SubSampleConvLayer(1, c0, cfg.rms_norm_eps)
        self.layer1 = SubSampleConvLayer(c0, c1, cfg.rms_norm_eps)
        # Sized as in the reference; it equals (mel bins / 4) * c1 only because c0 == n_mels == 128.
        self.input_proj_linear = nn.Linear((c0 // 4) * c1, cfg.hidden_size, bias=False)

    def forward(self, features: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, mask = self.layer0(features.unsqueeze(1), mask)
        x, mask = self.layer1(x, mask)
        B, _, T, _ = x.shape
        return self.input_proj_linear(x.permute(0, 2, 3, 1).reshape(B, T, -1)), mask


class RelPositionalEncoding(nn.Module):
    """Sinusoidal embeddings [sin | cos] of the query-key distances context//2, ..., 1, 0 (in that order)."""

    def __init__(self, cfg: AudioConfig):
        super().__init__()
        self.hidden_size = cfg.hidden_size
        past = cfg.attention_context_left - 1
        self.context_size = cfg.attention_chunk_size + past + cfg.attention_context_right
        self.register_buffer("inv_timescales", self._inv_timescales(), persistent=False)

    def _inv_timescales(self) -> torch.Tensor:
        n = self.hidden_size // 2
        return torch.exp(torch.arange(n, dtype=torch.float32) * -(math.log(10_000.0) / max(n - 1, 1)))

    def init_nonpersistent_buffers(self) -> None:
        self.inv_timescales = self._inv_timescales().to(self.inv_timescales.device)

    def forward(self, dtype: torch.dtype) -> torch.Tensor:
        # fp32 table (transformers computes it in the model dtype, which is coarse in bf16).
        distance = torch.arange(self.context_size // 2, -1, -1, device=self.inv_timescales.device)
        t = distance[:, None] * self.inv_timescales.float()
        return torch.cat([t.sin(), t.cos()], dim=-1).to(dtype)


class AudioAttention(nn.Module):
    """Chunked local self-attention with Transformer-XL relative position logits, soft-capped, in fp32.

    The sequence is cut into blocks of ``chunk_size`` queries; each block attends to a window of
    ``context_size`` keys starting ``max_past`` frames before the block.
    """

    def __init__(self, cfg: AudioConfig):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.chunk_size = cfg.attention_chunk_size
        self.max_past = cfg.attention_context_left - 1
        self.max_future = cfg.attention_context_right
        self.context_size = self.chunk_size + self.max_past + self.max_future
        self.invalid_logit = cfg.attention_invalid_logits_value
        self.logit_cap = cfg.attention_logit_cap
        # Lingvo-style learned per-dim query scale: softplus(0) == ln 2, so per_dim_scale = 0 gives 1/sqrt(d).
        self.q_scale = self.head_dim**-0.5 / math.log(2)
        self.k_scale = math.log(1 + math.e) / math.log(2)

        hidden, clip = cfg.hidden_size, cfg.use_clipped_linears
        self.q_proj = ClippableLinear(hidden, hidden, clip)
        self.k_proj = ClippableLinear(hidden, hidden, clip)
        self.v_proj = ClippableLinear(hidden, hidden, clip)
        self.post = ClippableLinear(hidden, hidden, clip)
        self.relative_k_proj = nn.Linear(hidden, hidden, bias=False)
        self.per_dim_scale = nn.Parameter(torch.zeros(self.head_dim))
        self.register_buffer("softcap", torch.tensor(self.logit_cap), persistent=False)

    def init_nonpersistent_buffers(self) -> None:
        self.softcap = torch.tensor(self.logit_cap, device=self.softcap.device)

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, H, D] -> [B, num_blocks, chunk, H, D] (zero-padded at the end)."""
        B, T, H, D = x.shape
        num_blocks = -(-T // self.chunk_size)
        x = F.pad(x, (0, 0, 0, 0, 0, num_blocks * self.chunk_size - T))
        return x.reshape(B, num_blocks, self.chunk_size, H, D)

    def _block_context(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, H, D] -> [B, num_blocks, context, H, D]; block b: frames b*chunk - past + [0, context)."""
        x = F.pad(x, (0, 0, 0, 0, self.max_past, self.max_future + self.chunk_size - 1))
        return torch.movedim(x.unfold(1, self.context_size, self.chunk_size), -1, 2).contiguous()

    def _rel_shift(self, x: torch.Tensor) -> torch.Tensor:
        """[..., chunk, P] logits per distance -> [..., chunk, context] per key (Transformer-XL, appendix B).

        Row i is shifted right by i, so key offset o reads distance index o - i; keys farther back than
        the P encoded distances (and keys ahead of the query) read the zero padding.
        """
        *lead, chunk, num_distances = x.shape
        x = F.pad(x, (0, self.context_size + 1 - num_distances))
        x = x.reshape(*lead, chunk * (self.context_size + 1))
        return x[..., : chunk * self.context_size].reshape(*lead, chunk, self.context_size)

    def forward(self, x: torch.Tensor, rel_pos: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
        """x [B, T, hidden], rel_pos [P, hidden], attend [B, 1, num_blocks, chunk, context] bool."""
        B, T, _ = x.shape
        shape = (B, T, self.num_heads, self.head_dim)
        q = self.q_proj(x).float().view(shape) * self.q_scale * F.softplus(self.per_dim_scale)
        k = self.k_proj(x).float().view(shape) * self.k_scale
        v = self.v_proj(x).float().view(shape)

        q = self._blocks(q).permute(0, 3, 1, 2, 4)  # [B, H, nb, chunk, D]
        k = self._block_context(k).permute(0, 3, 1, 4, 2)  # [B, H, nb, D, context]
        v = self._block_context(v).permute(0, 3, 1, 2, 4)  # [B, H, nb, context, D]
        num_blocks = q.shape[2]

        content_logits = q @ k
        rel_k = self.relative_k_proj(rel_pos).view(-1, self.num_heads, self.head_dim).float()
        position_logits = q.reshape(B, self.num_heads, -1, self.head_dim) @ rel_k.permute(1, 2, 0)
        position_logits = position_logits.reshape(B, self.num_heads, num_blocks, self.chunk_size, -1)
        logits = content_logits + self._rel_shift(position_logits)
        logits = torch.tanh(logits / self.softcap) * self.softcap
        logits = logits.masked_fill(~attend, self.invalid_logit)

        out = F.softmax(logits, dim=-1, dtype=torch.float32) @ v
        out = out.permute(0, 2, 3, 1, 4).reshape(B, num_blocks * self.chunk_size, -1)[:, :T]
        return self.post(out.to(x.dtype))


class AudioFeedForward(nn.Module):
    """Macaron half-step FFN: the branch output is scaled by residual_weight before the residual add."""

    def __init__(self, cfg: AudioConfig):
        super().__init__()
        self.cfg = cfg
        hidden, clip = cfg.hidden_size, cfg.use_clipped_linears
        self.ffw_layer_1 = ClippableLinear(hidden, hidden * 4, clip)
        self.ffw_layer_2 = ClippableLinear(hidden * 4, hidden, clip)
        self.pre_layer_norm = RMSNorm(hidden, _DEFAULT_EPS)
        self.post_layer_norm = RMSNorm(hidden, _DEFAULT_EPS)
        self.act_fn = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bound = _clip_bound(self.cfg, x.dtype)
        h = self.pre_layer_norm(torch.clamp(x, -bound, bound))
        h = self.ffw_layer_2(self.act_fn(self.ffw_layer_1(h)))
        h = self.post_layer_norm(torch.clamp(h, -bound, bound))
        return h * self.cfg.residual_weight + x


class AudioLightConv1d(nn.Module):
    """GLU -> causal depthwise conv over time -> norm -> activation -> projection, with a residual."""

    def __init__(self, cfg: AudioConfig):
        super().__init__()
        self.cfg = cfg
        hidden, clip = cfg.hidden_size, cfg.use_clipped_linears
        self.linear_start = ClippableLinear(hidden, hidden * 2, clip)
        self.linear_end = ClippableLinear(hidden, hidden, clip)
        self.depthwise_conv1d = nn.Conv1d(hidden, hidden, cfg.conv_kernel_size, groups=hidden, bias=False)
        self.pre_layer_norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.conv_norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.act_fn = ACTIVATIONS[cfg.hidden_act]

    def _causal_depthwise_conv(self, h: torch.Tensor) -> torch.Tensor:
        """Per-channel conv over time with left padding only, so frames never see the future (or padding).

        Written as one multiply-add per tap rather than F.conv1d: elementwise ops give the same bits
        whatever the batch size and padded length, which the CPU conv kernels do not. Accumulates in
        fp32, as conv kernels do.
        """
        w = self.depthwise_conv1d.weight[:, 0, :].float()  # [hidden, kernel]
        kernel, T = w.shape[1], h.shape[1]
        x = F.pad(h.float(), (0, 0, kernel - 1, 0))
        out = x[:, :T] * w[:, 0]
        for tap in range(1, kernel):
            out = out + x[:, tap : tap + T] * w[:, tap]
        return out.to(h.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self._causal_depthwise_conv(F.glu(self.linear_start(self.pre_layer_norm(x)), dim=-1))
        bound = _clip_bound(self.cfg, h.dtype)
        h = self.act_fn(self.conv_norm(torch.clamp(h, -bound, bound)))
        return self.linear_end(h) + x


class AudioLayer(nn.Module):
    """Conformer block: FFN/2 -> local self-attention -> light conv -> FFN/2 -> norm, with clamps."""

    def __init__(self, cfg: AudioConfig):
        super().__init__()
        self.cfg = cfg
        self.feed_forward1 = AudioFeedForward(cfg)
        self.feed_forward2 = AudioFeedForward(cfg)
        self.self_attn = AudioAttention(cfg)
        self.lconv1d = AudioLightConv1d(cfg)
        self.norm_pre_attn = RMSNorm(cfg.hidden_size, _DEFAULT_EPS)
        self.norm_post_attn = RMSNorm(cfg.hidden_size, _DEFAULT_EPS)
        self.norm_out = RMSNorm(cfg.hidden_size, _DEFAULT_EPS)

    def forward(self, x: torch.Tensor, rel_pos: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
        bound = _clip_bound(self.cfg, self.norm_pre_attn.weight.dtype)
        x = self.feed_forward1(x)
        h = self.self_attn(self.norm_pre_attn(torch.clamp(x, -bound, bound)), rel_pos, attend)
        x = self.norm_post_attn(torch.clamp(h, -bound, bound)) + x
        x = self.feed_forward2(self.lconv1d(x))
        return self.norm_out(torch.clamp(x, -bound, bound))


class Gemma4AudioModel(nn.Module):
    def __init__(self, cfg: AudioConfig):
        super().__init__()
        self.cfg = cfg
        self.subsample_conv_projection = SubSampleConvProjection(cfg)
        self.rel_pos_enc = RelPositionalEncoding(cfg)
        self.layers = nn.ModuleList(AudioLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.output_proj = nn.Linear(cfg.hidden_size, cfg.output_proj_dims, bias=True)

    def _blocked_attention_mask(self, valid: torch.Tensor) -> torch.Tensor:
        """Frame validity [B, T] -> may-attend mask [B, 1, num_blocks, chunk, context] (attention's layout).

        A key is usable if it is a real frame and lies in the sliding window of the reference
        (``sliding_window_mask_function((context_left - 1, context_right))``): 0 <= q - k < context_left - 1
        or 0 < k - q < context_right. Rows of queries past the end are sliced off later.
        """
        cfg = self.cfg
        chunk, future = cfg.attention_chunk_size, cfg.attention_context_right
        past = cfg.attention_context_left - 1
        context = chunk + past + future
        key_valid = F.pad(valid, (past, future + chunk - 1), value=False).unfold(1, context, chunk)
        q_idx = torch.arange(chunk, device=valid.device)[:, None]
        k_idx = torch.arange(context, device=valid.device)[None, :] - past
        dist = q_idx - k_idx
        in_window = ((dist >= 0) & (dist < past)) | ((dist < 0) & (-dist < future))
        return (key_valid[:, :, None, :] & in_window)[:, None]

    def forward(
        self, input_features: torch.Tensor, input_features_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-mel features [B, T, n_mels] with validity mask [B, T] (None = all valid)
        -> (hidden [B, T', output_proj_dims], validity [B, T'] bool), T' = ceil(ceil(T / 2) / 2)."""
        if input_features_mask is None:
            input_features_mask = input_features.new_ones(input_features.shape[:2], dtype=torch.bool)
        h, mask = self.subsample_conv_projection(input_features, input_features_mask.bool())
        rel_pos = self.rel_pos_enc(h.dtype)
        attend = self._blocked_attention_mask(mask)
        for layer in self.layers:
            h = layer(h, rel_pos, attend)
        return self.output_proj(h), mask
