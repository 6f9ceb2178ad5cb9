"""Tiny compressed-tensors checkpoints, written by compressed-tensors itself from the tiny Gemma 4 ones.

The oracle of the quantized-checkpoint tests: compressed-tensors applies its schemes to transformers' model
(``apply_quantization_config``), computes each weight's scales with its own ``calculate_qparams`` over the
min/max of the strategy's blocks, compresses (``ModelCompressor.compress_model``: FP8 casting, int4 packing
and zero-point packing) and writes ``quantization_config``; then decompresses the same model
(``decompress_model``: its own unpacking and dequantization) into a dense checkpoint beside it. g4serve
must load the first and compute what the second computes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

# name -> (variant, config groups as compressed-tensors QuantizationScheme kwargs, extra ignore patterns)
_FP8_DYNAMIC = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
_LINEAR = ["Linear"]
TOWERS = ["lm_head", "re:.*vision.*", "re:.*audio.*"]
SPECS: dict[str, tuple[str, dict, list[str]]] = {
    # FP8 per tensor with static activation scales (compressed-tensors' FP8 preset)
    "fp8-tensor": (
        "e",
        {
            "group_0": dict(
                targets=_LINEAR,
                weights=dict(num_bits=8, type="float", strategy="tensor"),
                input_activations=dict(num_bits=8, type="float", strategy="tensor", dynamic=False),
            )
        },
        [],
    ),
    # FP8-Dynamic: per-channel weights, per-token activations; the 26B-A4B layout, the routed experts
    # quantized per expert too (as for every "moe" spec)
    "fp8-channel": (
        "moe",
        {
            "group_0": dict(
                targets=_LINEAR,
                weights=dict(num_bits=8, type="float", strategy="channel"),
                input_activations=_FP8_DYNAMIC,
            )
        },
        ["re:.*router.*"],
    ),
    # int4 groups of 32, asymmetric, on the 26B-A4B layout with the routed experts quantized per expert too
    "w4a16-moe": (
        "moe",
        {
            "group_0": dict(
                targets=_LINEAR,
                weights=dict(num_bits=4, type="int", strategy="group", group_size=32, symmetric=False),
            )
        },
        ["re:.*router.*"],
    ),
    # FP8 blocks of 64 x 32 on the 26B-A4B layout, weight-only: the experts' gate and up (32 rows each) are
    # one partial block row each, as 128-row blocks are for 26B-A4B's I = 704
    "fp8-block-moe": (
        "moe",
        {
            "group_0": dict(
                targets=_LINEAR,
                weights=dict(num_bits=8, type="float", strategy="block", block_structure=[64, 32]),
            )
        },
        ["re:.*router.*"],
    ),
    # FP8 blocks (16 x 32 here: the tiny projections are 32-128 wide), weight-only; 31B layout
    "fp8-block": (
        "31b",
        {
            "group_0": dict(
                targets=_LINEAR,
                weights=dict(num_bits=8, type="float", strategy="block", block_structure=[16, 32]),
            )
        },
        [],
    ),
    # int4 groups of 32, symmetric; the PLE projection (K = 16) stays dense
    "w4a16-g32": (
        "e",
        {
            "group_0": dict(
                targets=_LINEAR, weights=dict(num_bits=4, type="int", strategy="group", group_size=32)
            )
        },
        ["re:.*per_layer_projection$"],
    ),
    # int4 asymmetric (zero points): groups of 128 where K allows it (down_proj, K = 128), 32 elsewhere
    "w4a16-asym": (
        "e",
        {
            "group_128": dict(
                targets=["re:.*mlp.down_proj$"],
                weights=dict(num_bits=4, type="int", strategy="group", group_size=128, symmetric=False),
            ),
            "group_32": dict(
                targets=_LINEAR,
                weights=dict(num_bits=4, type="int", strategy="group", group_size=32, symmetric=False),
            ),
        },
        ["re:.*per_layer_projection$"],
    ),
    # int4 groups of 128 (compressed-tensors' W4A16) on the 31B layout's 128-wide projections
    "w4a16-g128": (
        "31b",
        {
            "group_0": dict(
                targets=["re:.*mlp.down_proj$", "re:.*layers\\.[25]\\.self_attn\\.o_proj$"],
                weights=dict(num_bits=4, type="int", strategy="group", group_size=128),
            )
        },
        [],
    ),
}


def _min_max(w: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight's min and max per the strategy's blocks (an observer's job in llm-compressor)."""
    n, k = w.shape
    if args.strategy == "tensor":
        return w.amin().reshape(1), w.amax().reshape(1)
    if args.strategy == "channel":
        return w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    if args.strategy == "group":
        g = w.reshape(n, k // args.group_size, args.group_size)
        return g.amin(-1), g.amax(-1)
    bn, bk = args.block_structure
    padded = torch.nn.functional.pad(w, (0, -k % bk, 0, -n % bn))
    blocks = padded.reshape(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk).transpose(1, 2)
    return blocks.amin((-1, -2)), blocks.amax((-1, -2))


def _calibrate(module: torch.nn.Module) -> None:
    """Scales and zero points from the weight's min/max per the strategy's blocks, by compressed-tensors'
    ``calculate_qparams``."""
    from compressed_tensors.quantization.utils import calculate_qparams

    args = module.quantization_scheme.weights
    scale, zero = calculate_qparams(*_min_max(module.weight.detach(), args), args)
    module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(module.weight_scale.shape)
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data = zero.to(module.weight_zero_point.dtype).reshape(
            module.weight_zero_point.shape
        )
    if hasattr(module, "input_scale"):  # static activations: a fixed per-tensor scale
        module.input_scale.data = torch.full_like(module.input_scale, 0.05)


def _drop_quantization_tensors(path: Path) -> None:
    """The decompressed model keeps its scales as parameters: a dense checkpoint has only the weights."""
    from safetensors.torch import load_file, save_file

    quantization = {"weight_scale", "weight_zero_point", "weight_shape", "weight_packed", "input_scale"}
    tensors = {k: v for k, v in load_file(path).items() if k.rpartition(".")[2] not in quantization}
    save_file(tensors, path, metadata={"format": "pt"})


def _quantize_experts(quantized: Path, dense: Path, args) -> None:
    """The routed experts (3-D tensors in transformers' Gemma 4) quantized per expert, as compressed-tensors
    checkpoints of MoE models store them (``experts.E.gate_proj.weight_packed`` ...), with compressed-tensors'
    own quantize / pack / dequantize; the dense checkpoint gets the dequantized experts."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import load_file, save_file

    q_tensors, d_tensors = load_file(quantized / "model.safetensors"), load_file(dense / "model.safetensors")
    for name in [n for n in q_tensors if n.endswith("experts.gate_up_proj")]:
        prefix = name[: -len("gate_up_proj")]
        gate_up, down = q_tensors.pop(name), q_tensors.pop(prefix + "down_proj")
        inter = down.shape[2]
        for e in range(gate_up.shape[0]):
            parts = {"gate_proj": gate_up[e, :inter], "up_proj": gate_up[e, inter:], "down_proj": down[e]}
            for proj, w in parts.items():
                n, k = w.shape
                scale, zero = calculate_qparams(*_min_max(w, args), args)
                key = f"{prefix}{e}.{proj}."
                if args.type == "int":
                    q = quantize(w, scale, zero, args, dtype=torch.int8)
                    q_tensors[key + "weight_packed"] = pack_to_int32(q, 4)
                    q_tensors[key + "weight_shape"] = torch.tensor([n, k])
                    if not args.symmetric:
                        q_tensors[key + "weight_zero_point"] = pack_to_int32(
                            zero.to(torch.int8), 4, packed_dim=0
                        )
                else:
                    q = quantize(w, scale, None, args, dtype=torch.float8_e4m3fn)
                    q_tensors[key + "weight"] = q
                q_tensors[key + "weight_scale"] = scale
                w.copy_(dequantize(q, scale, zero if not args.symmetric else None, args).to(w.dtype))
        d_tensors[name], d_tensors[prefix + "down_proj"] = gate_up, down
    save_file(q_tensors, quantized / "model.safetensors", metadata={"format": "pt"})
    save_file(d_tensors, dense / "model.safetensors", metadata={"format": "pt"})


def build_quantized_checkpoint(base: Path, out: Path, name: str) -> tuple[Path, Path]:
    """(compressed checkpoint, its dense decompression) of spec ``name`` from tiny checkpoint ``base``."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import is_module_quantized
    from transformers import Gemma4ForConditionalGeneration

    _, groups, ignore = SPECS[name]
    model = Gemma4ForConditionalGeneration.from_pretrained(base, dtype=torch.float32).eval()
    schemes = {g: QuantizationScheme(**kwargs) for g, kwargs in groups.items()}
    apply_quantization_config(model, QuantizationConfig(config_groups=schemes, ignore=TOWERS + ignore))
    with torch.no_grad():
        for module in model.modules():
            if is_module_quantized(module):
                _calibrate(module)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    quantized, dense = out / "quantized", out / "dense"
    model.save_pretrained(quantized)
    compressor.update_config(quantized)
    compressor.decompress_model(model)
    model.save_pretrained(dense)
    _drop_quantization_tensors(dense / "model.safetensors")
    config = json.loads((dense / "config.json").read_text())
    config.pop("quantization_config", None)
    (dense / "config.json").write_text(json.dumps(config, indent=2))
    if SPECS[name][0] == "moe":
        _quantize_experts(quantized, dense, next(iter(schemes.values())).weights)
    for d in (quantized, dense):
        for f in base.iterdir():
            if f.is_file() and not f.name.endswith(".safetensors") and f.name not in ("config.json",):
                shutil.copy(f, d / f.name)
    return quantized, dense
