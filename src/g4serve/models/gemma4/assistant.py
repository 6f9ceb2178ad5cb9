"""Gemma 4's multi-token-prediction drafter (transformers' ``Gemma4AssistantForCausalLM``).

A few decoder layers whose every attention is KV-shared with the *target* model: each layer's queries
attend over the target's paged K/V of the last KV-producing target layer of the same type (sliding or
full), so the drafter has no cache of its own and no prefill. Its input for a sequence is the target's
scaled embedding of the last token concatenated with the target's final hidden state at the position
before it, projected down (``pre_projection``); it returns logits over the vocabulary and its own last
hidden state projected back to the target's width (``post_projection``), the input of its next step.
Every draft step of one round uses the same RoPE position: that of the last token the target accepted.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from g4serve.config import ConfigError, TextConfig
from g4serve.layers.attention import AttentionBackend, AttentionMetadata
from g4serve.layers.norm import RMSNorm
from g4serve.layers.rotary import rope_cos_sin, text_inv_freq
from g4serve.models.gemma4.loader import (
    CheckpointError,
    _checkpoint_index,
    _copy_checked,
    init_random_weights,
    resolve_dtype,
)
from g4serve.models.gemma4.text import DecoderLayer

_TOP_KEYS = {
    "architectures",
    "backbone_hidden_size",
    "centroid_intermediate_top_k",
    "dtype",
    "torch_dtype",
    "model_type",
    "num_centroids",
    "text_config",
    "tie_word_embeddings",
    "transformers_version",
    "use_ordered_embeddings",
}


@dataclasses.dataclass
class AssistantConfig:
    text: TextConfig  # every layer KV-shared (num_kv_shared_layers == num_hidden_layers)
    backbone_hidden_size: int
    use_ordered_embeddings: bool = False
    num_centroids: int = 2048
    centroid_intermediate_top_k: int = 32

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> AssistantConfig:
        raw = json.loads((Path(model_dir) / "config.json").read_text())
        if raw.get("model_type") != "gemma4_assistant":
            raise ConfigError(
                f"{model_dir}: model_type {raw.get('model_type')!r} is not a Gemma 4 MTP drafter "
                "(gemma4_assistant)"
            )
        unknown = sorted(set(raw) - _TOP_KEYS)
        if unknown:
            raise ConfigError(f"{model_dir}: config.json: unknown keys {unknown}")
        text_raw = dict(raw["text_config"])
        layers = int(text_raw.get("num_hidden_layers", 0))
        if int(text_raw.get("num_kv_shared_layers", layers)) != layers:
            raise ConfigError("text_config.num_kv_shared_layers: every drafter layer must be KV-shared")
        if text_raw.get("hidden_size_per_layer_input") or text_raw.get("enable_moe_block"):
            raise ConfigError("text_config: a drafter has no per-layer embeddings and no MoE block")
        # TextConfig validates a target (some layer must produce K/V); the drafter's come from its target.
        text_raw["num_kv_shared_layers"] = 0
        text = TextConfig.from_dict(text_raw)
        text = dataclasses.replace(text, num_kv_shared_layers=text.num_hidden_layers)
        return cls(
            text=text,
            backbone_hidden_size=int(raw.get("backbone_hidden_size", 1536)),
            use_ordered_embeddings=bool(raw.get("use_ordered_embeddings", False)),
            num_centroids=int(raw.get("num_centroids", 2048)),
            centroid_intermediate_top_k=int(raw.get("centroid_intermediate_top_k", 32)),
        )


def target_kv_layers(target: TextConfig) -> dict[str, int]:
    """Per layer type, the target layer whose K/V the drafter reads: the last KV-producing layer of it."""
    out = {}
    for i in range(target.first_kv_shared_layer):
        out[target.layer_types[i]] = i
    return out


def check_compatible(cfg: AssistantConfig, target: TextConfig) -> None:
    """The drafter's attention must read the target's cache as it is laid out."""
    sources = target_kv_layers(target)
    if cfg.backbone_hidden_size != target.hidden_size:
        raise ConfigError(
            f"backbone_hidden_size: the drafter was trained for a {cfg.backbone_hidden_size}-wide target, "
            f"this target is {target.hidden_size}"
        )
    if cfg.text.vocab_size != target.vocab_size:
        raise ConfigError(
            f"text_config.vocab_size: {cfg.text.vocab_size}, the target's is {target.vocab_size}"
        )
    for i, layer_type in enumerate(cfg.text.layer_types):
        src = sources.get(layer_type)
        if src is None:
            raise ConfigError(f"text_config.layer_types[{i}]: the target has no {layer_type} layer")
        if cfg.text.layer_head_dim(i) != target.layer_head_dim(src):
            raise ConfigError(
                f"text_config: drafter layer {i} has head_dim {cfg.text.layer_head_dim(i)}, the target's "
                f"{layer_type} cache {target.layer_head_dim(src)}"
            )
        if cfg.text.num_attention_heads % target.layer_num_kv_heads(src):
            raise ConfigError(
                f"text_config.num_attention_heads: {cfg.text.num_attention_heads} is not a multiple of the "
                f"target's {target.layer_num_kv_heads(src)} KV heads"
            )


class MaskedEmbedder(nn.Module):
    """``use_ordered_embeddings``: logits only for the tokens of the top-k centroid clusters (the others get
    one less than the smallest computed logit), as transformers' ``Gemma4AssistantMaskedEmbedder``."""

    def __init__(self, cfg: AssistantConfig):
        super().__init__()
        text = cfg.text
        self.top_k = cfg.centroid_intermediate_top_k
        self.num_centroids = cfg.num_centroids
        self.vocab_size = text.vocab_size
        self.per_centroid = text.vocab_size // cfg.num_centroids
        self.centroids = nn.Linear(text.hidden_size, cfg.num_centroids, bias=False)
        self.register_buffer("token_ordering", torch.zeros(text.vocab_size, dtype=torch.long))

    def forward(self, hidden: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        top = torch.topk(self.centroids(hidden), k=self.top_k, dim=-1).indices  # [T, k]
        clusters = self.token_ordering.long().view(self.num_centroids, self.per_centroid)
        chosen = clusters[top].reshape(hidden.shape[0], -1)  # [T, k * per_centroid]
        logits = torch.einsum("td,tnd->tn", hidden, lm_head[chosen])
        # the fill stays a device tensor (no host sync), so a CUDA graph can hold the drafter
        out = (logits.min() - 1.0).expand(hidden.shape[0], self.vocab_size).contiguous()
        return out.scatter_(-1, chosen, logits)


class Gemma4Assistant(nn.Module):
    """The drafter; parameter names follow the checkpoint without its ``model.`` prefix."""

    def __init__(self, cfg: AssistantConfig, target: TextConfig):
        super().__init__()
        check_compatible(cfg, target)
        self.cfg = cfg
        text = cfg.text
        self.embed_tokens = nn.Embedding(text.vocab_size, text.hidden_size)  # the (tied) LM head
        self.layers = nn.ModuleList(DecoderLayer(text, i) for i in range(text.num_hidden_layers))
        sources = target_kv_layers(target)
        for layer in self.layers:
            layer.self_attn.kv_layer = sources[layer.layer_type]
        self.norm = RMSNorm(text.hidden_size, text.rms_norm_eps)
        self.pre_projection = nn.Linear(2 * cfg.backbone_hidden_size, text.hidden_size, bias=False)
        self.post_projection = nn.Linear(text.hidden_size, cfg.backbone_hidden_size, bias=False)
        self.masked_embedding = MaskedEmbedder(cfg) if cfg.use_ordered_embeddings else None
        for layer_type, inv in self._inv_freqs().items():
            self.register_buffer(f"{layer_type}_inv_freq", inv, persistent=False)

    def _inv_freqs(self) -> dict[str, torch.Tensor]:
        text = self.cfg.text
        out = {}
        for layer_type in set(text.layer_types):
            head_dim = next(text.layer_head_dim(i) for i, t in enumerate(text.layer_types) if t == layer_type)
            out[layer_type] = text_inv_freq(text.rope_parameters[layer_type], head_dim)
        return out

    def forward(
        self,
        token_embeds: torch.Tensor,
        target_hidden: torch.Tensor,
        rope_positions: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step for T sequences -> (logits [T, V], hidden [T, backbone] for the next step).

        ``token_embeds``: the target's scaled embeddings of the last tokens; ``target_hidden``: the target's
        final hidden states (or the previous step's ``hidden``). ``meta``: a decode step over the target's
        cache whose query of sequence i sits at position ``seq_len_i - 1``, so it sees every cached key and,
        on sliding layers, the last ``sliding_window`` of them (transformers' drafter masks); RoPE uses
        ``rope_positions`` instead (the last token's position).
        """
        h = F.linear(torch.cat([token_embeds, target_hidden], dim=-1), self.pre_projection.weight)
        tables = {
            t: rope_cos_sin(rope_positions, getattr(self, f"{t}_inv_freq"), h.dtype)
            for t in set(self.cfg.text.layer_types)
        }
        normed = None
        for i, layer in enumerate(self.layers):
            cos, sin = tables[layer.layer_type]
            next_norm = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            h, normed = layer(h, None, cos, sin, meta, backend, normed, next_norm)
        h = normed
        if self.masked_embedding is not None:
            logits = self.masked_embedding(h, self.embed_tokens.weight)
        else:
            logits = F.linear(h, self.embed_tokens.weight)
        return logits, F.linear(h, self.post_projection.weight)

    def draft(
        self,
        embed: Callable[[torch.Tensor], torch.Tensor],
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        rope_positions: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        num_steps: int,
        decodable_vocab_size: int | None = None,
    ) -> torch.Tensor:
        """A round of ``num_steps`` greedy steps from each sequence's last token (``embed``: the target's
        scaled embedding) and the target's hidden state -> drafts [T, num_steps]. Ids past
        ``decodable_vocab_size``, which the target never samples, are never drafted."""
        drafts = []
        for _ in range(num_steps):
            logits, hidden = self(embed(tokens), hidden, rope_positions, meta, backend)
            tokens = logits[:, :decodable_vocab_size].argmax(dim=-1)
            drafts.append(tokens)
        return torch.stack(drafts, dim=1)


RANDOM = "random"  # speculative_config.model: a drafter of benchmark shape with random weights


def random_assistant_config(target: TextConfig) -> AssistantConfig:
    """The shape benchmarks draft with when no drafter checkpoint is at hand: four layers (three sliding,
    one full) 1,024 wide with half the target's query heads, over the target's vocabulary through ordered
    embeddings (2,048 clusters, the top 32 scored), the defaults of transformers' assistant config."""
    sources = target_kv_layers(target)
    heads = target.num_attention_heads // 2
    if heads == 0 or any(heads % target.layer_num_kv_heads(i) for i in sources.values()):
        heads = target.num_attention_heads
    text = dataclasses.replace(
        target,
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=4,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        num_attention_heads=heads,
        head_dim=target.layer_head_dim(sources["sliding_attention"]),  # the caches it reads
        global_head_dim=target.layer_head_dim(sources["full_attention"]),
        num_kv_shared_layers=4,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        enable_moe_block=False,
        use_double_wide_mlp=False,
        num_experts=None,
        top_k_experts=None,
        moe_intermediate_size=None,
        per_layer_config=None,
    )
    ordered = target.vocab_size % 2048 == 0  # 2,048 clusters (a tiny target's vocabulary takes the full head)
    return AssistantConfig(text=text, backbone_hidden_size=target.hidden_size, use_ordered_embeddings=ordered)


def load_assistant(
    model_dir: str | Path,
    target: TextConfig,
    dtype: str | torch.dtype,
    device: str | torch.device,
    seed: int = 0,
) -> Gemma4Assistant:
    """Build the drafter of checkpoint ``model_dir`` for a target of config ``target``; load its weights.
    ``model_dir`` ``"random"``: ``random_assistant_config``'s drafter with seeded random weights (benchmarks,
    with ``forced_acceptance``: random weights draft nothing the target accepts)."""
    if str(model_dir) == RANDOM and not Path(model_dir).exists():
        return _random_assistant(random_assistant_config(target), target, dtype, device, seed)
    model_dir = Path(model_dir)
    net = _build(AssistantConfig.from_pretrained(model_dir), target, dtype, device)
    params = dict(net.state_dict(keep_vars=True))
    loaded = set()
    by_file: dict[Path, list[str]] = {}
    for hf_name, path in _checkpoint_index(model_dir).items():
        if hf_name != "lm_head.weight":  # tied to the embeddings
            by_file.setdefault(path, []).append(hf_name)
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for hf_name in names:
                name = hf_name.removeprefix("model.")
                if name not in params:
                    raise CheckpointError(
                        f"{model_dir}: unexpected tensor {hf_name} in the drafter checkpoint"
                    )
                _copy_checked(path, hf_name, f.get_tensor(hf_name), params[name])
                loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise CheckpointError(f"{model_dir}: drafter tensors missing: {missing[:8]}")
    return net.eval()


def _build(
    cfg: AssistantConfig, target: TextConfig, dtype: str | torch.dtype, device: str | torch.device
) -> Gemma4Assistant:
    with torch.device(device):
        net = Gemma4Assistant(cfg, target)
    net.to(resolve_dtype(dtype, device))  # floating-point tensors only: token_ordering stays long
    for layer_type, inv in net._inv_freqs().items():  # fp32 RoPE tables, whatever the weights' dtype
        setattr(net, f"{layer_type}_inv_freq", inv.to(device))
    return net


def _random_assistant(
    cfg: AssistantConfig, target: TextConfig, dtype: str | torch.dtype, device: str | torch.device, seed: int
) -> Gemma4Assistant:
    net = _build(cfg, target, dtype, device)
    init_random_weights(net, seed)  # N(0, 0.02) matrices, unit norms
    with torch.no_grad():
        for name, tensor in net.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):  # unit-variance q.k, as for the target
                tensor.fill_(tensor.shape[0] ** -0.25)
        if net.masked_embedding is not None:
            net.masked_embedding.token_ordering.copy_(torch.arange(cfg.text.vocab_size, device=device))
    return net.eval()


__all__ = [
    "AssistantConfig",
    "Gemma4Assistant",
    "load_assistant",
    "random_assistant_config",
    "target_kv_layers",
]
