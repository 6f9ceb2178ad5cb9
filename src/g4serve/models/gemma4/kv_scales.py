"""Scales of an FP8 (e4m3) KV cache: per (layer, KV head) K and V scales from the checkpoint, else 1.0.

A checkpoint calibrated for an FP8 KV cache (compressed-tensors / llm-compressor, ModelOpt) holds them as
vLLM reads them, after ``layers.N.self_attn.``: ``k_scale`` / ``v_scale``, ``attn.k_scale`` /
``attn.v_scale``, ``k_proj.k_scale`` / ``v_proj.v_scale`` (ModelOpt), or the deprecated ``kv_scale``
(both); one value (per tensor) or one per KV head. ``q_scale`` / ``prob_scale`` (FP8 attention math) are
recognised and not used: attention here multiplies in the model's dtype and accumulates in fp32.

Why 1.0 is the right default for Gemma 4: K and V are RMS-normalised per head just before the cache (k_norm
with a weight, v_norm without), so a head's vector has 2-norm sqrt(D) (times the k_norm weight): every
element satisfies |V| <= sqrt(D) and |K| <= sqrt(D) * max|k_norm.weight|, i.e. at most 16 (D=256) or 22.6
(D=512) for unit weights, far inside e4m3's +-448. e4m3's relative precision (3 mantissa bits, 2^-4 at
worst) is the same at every magnitude of its normal range (down to 2^-6), so a calibrated scale could only
move values between ranges, not make them finer. ``fp8_kv_scales`` checks the bound per layer from the
loaded weights and warns where saturation is possible. (The tiny test model: max |K| 2.5, |V| 3.6.)
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open

from g4serve.config import TextConfig
from g4serve.distributed.sharding import rank_kv_heads
from g4serve.kernels.kv_cache_write import FP8_MAX
from g4serve.models.gemma4.model import Gemma4Model

log = logging.getLogger(__name__)

# Checkpoint names (model.language_model.layers..., model.layers...) and the loader's local names alike.
KV_SCALE_PARAM = re.compile(
    r"^(?:model\.)?(?:language_model\.)?layers\.(\d+)\.self_attn\.(?:attn\.|k_proj\.|v_proj\.)?"
    r"(k_scale|v_scale|kv_scale|q_scale|prob_scale)$"
)
_ROWS = {"k_scale": [0], "v_scale": [1], "kv_scale": [0, 1]}  # rows of the [2, Hkv] (K, V) scales


def is_kv_scale_name(name: str) -> bool:
    """Whether a checkpoint tensor is an FP8 KV-cache (or attention) scale, which the loader leaves alone."""
    return KV_SCALE_PARAM.match(name) is not None


def _tensor_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file (the loader has checked the files when it loaded the model)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return {name: model_dir / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    single = model_dir / "model.safetensors"
    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


def _per_head(path: Path, name: str, heads: int) -> torch.Tensor:
    with safe_open(str(path), framework="pt") as f:
        values = f.get_tensor(name).float().flatten()
    if values.numel() not in (1, heads):
        raise ValueError(
            f"{path.name}: {name} has {values.numel()} values; expected 1 (per tensor) or {heads} "
            "(per KV head)"
        )
    if not bool((torch.isfinite(values) & (values > 0)).all()):
        raise ValueError(f"{path.name}: {name} must hold finite positive scales, got {values.tolist()}")
    return values.expand(heads)


def read_kv_scales(model_dir: str | Path, text: TextConfig) -> dict[int, torch.Tensor]:
    """[2, Hkv] fp32 (K row, V row) per KV-producing layer with scales in the checkpoint (a missing K or V
    scale is 1.0). KV-shared layers' scales are ignored: those layers read their source layer's cache."""
    model_dir = Path(model_dir)
    found: dict[int, dict[str, tuple[str, Path]]] = {}
    for name, path in _tensor_files(model_dir).items():
        match = KV_SCALE_PARAM.match(name)
        if match and match.group(2) in _ROWS and int(match.group(1)) < text.first_kv_shared_layer:
            found.setdefault(int(match.group(1)), {})[match.group(2)] = (name, path)
    scales = {}
    for layer, names in sorted(found.items()):
        heads = text.layer_num_kv_heads(layer)
        scale = torch.ones(2, heads)
        for kind, (name, path) in names.items():
            scale[_ROWS[kind]] = _per_head(path, name, heads)
        scales[layer] = scale
    return scales


def fp8_kv_scales(model: Gemma4Model, model_dir: str | Path | None) -> dict[int, torch.Tensor]:
    """The FP8 cache's scales per KV-producing layer (the checkpoint's, or none: 1.0), after checking that
    scaled K and V stay inside e4m3's range (the bound in the module docstring); a warning names the layers
    where they could saturate."""
    text = model.cfg.text
    plan = model.shard_plan
    if model_dir is None:
        scales = {}
    elif plan is None:
        scales = read_kv_scales(model_dir, text)
    else:  # tensor parallel: the checkpoint's scales (all its KV heads), then the heads this rank holds
        scales = {
            layer: scale[:, rank_kv_heads(plan.text.layer_num_kv_heads(layer), plan.rank, plan.size)]
            for layer, scale in read_kv_scales(model_dir, plan.text).items()
        }
    log.info(
        "FP8 KV cache: checkpoint scales for %d of %d layers, 1.0 elsewhere",
        len(scales),
        len(text.kv_producer_layers),
    )
    for layer in text.kv_producer_layers:
        attn = model.language_model.layers[layer].self_attn
        root_d = attn.head_dim**0.5
        scale = scales.get(layer, torch.ones(2, attn.num_kv_heads))
        k_bound = root_d * float(attn.k_norm.weight.detach().abs().max()) / float(scale[0].min())
        v_bound = root_d / float(scale[1].min())
        if max(k_bound, v_bound) > FP8_MAX:
            log.warning(
                "FP8 KV cache: layer %d's K / V can reach %.0f / %.0f after scaling, past e4m3's %.0f: such "
                "values are saturated",
                layer,
                k_bound,
                v_bound,
                FP8_MAX,
            )
    return scales


__all__ = ["KV_SCALE_PARAM", "fp8_kv_scales", "is_kv_scale_name", "read_kv_scales"]
