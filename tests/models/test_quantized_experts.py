"""Quantized MoE experts (26B-A4B layout) stay quantized: compressed-tensors checkpoints whose experts are
stored per expert (written by ``quant_checkpoints.py`` with compressed-tensors' own quantizer) load into the
stacked quantized ``MoEExperts`` and compute exactly what compressed-tensors' decompression computes; a block
whose experts are quantized differently falls back to dequantizing, with a warning; ``--quantization``
presets quantize the experts too, from a dense checkpoint or random draws, with no dense copy allocated."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_fast_layout import prefill_logits

from g4serve.config import Gemma4Config
from g4serve.layers.moe import MoEExperts
from g4serve.layers.quant import QuantLinear
from g4serve.models.gemma4.loader import _quant_planner, build_model, init_random_weights, load_model

KINDS = {"fp8": torch.float8_e4m3fn, "int4": torch.int32}


def _load(path, **kw):
    return load_model(path, dtype="float32", device="cpu", with_vision=False, with_audio=False, **kw)


def _experts(model) -> list[MoEExperts]:
    return [layer.experts for layer in model.language_model.layers]


@pytest.mark.parametrize(
    "name,kind,blocks",
    [
        ("fp8-channel", "fp8", {"gate_up_proj": (1, 64), "down_proj": (1, 32)}),
        ("fp8-block-moe", "fp8", {"gate_up_proj": (64, 32), "down_proj": (64, 32)}),
        ("w4a16-moe", "int4", {"gate_up_proj": (1, 32), "down_proj": (1, 32)}),
    ],
)
def test_checkpoint_experts_stay_quantized_and_match_the_decompression(
    quantized_checkpoint, name, kind, blocks
):
    quantized, dense = quantized_checkpoint(name)
    model, reference = _load(quantized), _load(dense)
    for experts in _experts(model):
        assert experts.quantized and experts.scale_blocks == blocks
        weights = {
            n: p.dtype for n, p in experts.named_parameters() if not n.endswith(("_scale", "_zero_point"))
        }
        assert weights == {"gate_up_proj": KINDS[kind], "down_proj": KINDS[kind]}
    # every expert's weights are what compressed-tensors decompressed, bit for bit
    for ours, theirs in zip(_experts(model), _experts(reference), strict=True):
        for proj in ("gate_up_proj", "down_proj"):
            assert torch.equal(ours.dequantize(proj, torch.float32), theirs.get_parameter(proj))
    ids = list(range(10, 26))
    assert torch.equal(prefill_logits(model, ids), prefill_logits(reference, ids))


def test_experts_quantized_differently_are_dequantized_with_a_warning(quantized_checkpoint, tmp_path, caplog):
    """Expert 1's down_proj stored dense (ignored by the config): the block's down_proj cannot be one
    quantized tensor, so it is dequantized at load; gate_up stays quantized."""
    quantized, dense = quantized_checkpoint("w4a16-moe")
    bad = tmp_path / "mixed"
    shutil.copytree(quantized, bad)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"]["ignore"].append("re:.*experts\\.1\\.down_proj$")
    (bad / "config.json").write_text(json.dumps(config))
    tensors = load_file(bad / "model.safetensors")
    dense_tensors = load_file(dense / "model.safetensors")
    for layer in range(6):
        prefix = f"model.language_model.layers.{layer}.experts."
        for suffix in ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape"):
            tensors.pop(f"{prefix}1.down_proj.{suffix}")
        tensors[f"{prefix}1.down_proj.weight"] = dense_tensors[f"{prefix}down_proj"][1].clone()
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="g4serve.models.gemma4.quant_loader"):
        model = _load(bad)
    assert "dequantized to the model's dtype at load" in caplog.text
    for experts in _experts(model):
        assert experts.quant["down_proj"] is None and experts.down_proj.dtype == torch.float32
        assert experts.gate_up_proj.dtype == torch.int32
    ids = list(range(10, 26))
    assert torch.equal(prefill_logits(model, ids), prefill_logits(_load(dense), ids))


# ---- --quantization presets -------------------------------------------------------------------------------
def _substitute_dequantized(dense_model, quantized_model) -> None:
    """The dense model's projections and experts replaced by the quantized model's dequantized weights."""
    modules = dict(dense_model.named_modules())
    with torch.no_grad():
        for name, m in quantized_model.named_modules():
            if isinstance(m, QuantLinear):
                modules[name].weight.copy_(m.dequantize(torch.float32))
            elif isinstance(m, MoEExperts) and m.quantized:
                for proj in ("gate_up_proj", "down_proj"):
                    modules[name].get_parameter(proj).copy_(m.dequantize(proj, torch.float32))


def test_quantization_preset_quantizes_the_experts_of_a_dense_checkpoint(hf_checkpoint):
    model = _load(hf_checkpoint("moe"), quantization="fp8")
    reference = _load(hf_checkpoint("moe"))
    for experts, dense in zip(_experts(model), _experts(reference), strict=True):
        assert experts.gate_up_proj.dtype == experts.down_proj.dtype == torch.float8_e4m3fn
        assert experts.scale_blocks == {"gate_up_proj": (1, 64), "down_proj": (1, 32)}
        for proj in ("gate_up_proj", "down_proj"):
            w = dense.get_parameter(proj)
            assert (experts.dequantize(proj, torch.float32) - w).abs().max() <= w.abs().max() * 0.07
    assert not any("router" in n for n, m in model.named_modules() if isinstance(m, QuantLinear))
    _substitute_dequantized(reference, model)
    ids = list(range(10, 26))
    assert torch.equal(prefill_logits(model, ids), prefill_logits(reference, ids))


@pytest.mark.parametrize("preset", ["fp8", "fp8-block", "w4a16-g32"])
def test_quantization_preset_random_experts_are_the_dense_draws_quantized(hf_checkpoint, preset):
    """Random weights (as the 26b-a4b preset gets them): the dense model's draws, quantized, on a tiny MoE
    config; built on the meta device, so the experts are never allocated dense."""
    cfg = Gemma4Config.from_pretrained(hf_checkpoint("moe"))
    dense = build_model(cfg, torch.float32, "cpu", False, False)
    init_random_weights(dense, seed=3)
    model = build_model(cfg, torch.float32, "cpu", False, False, _quant_planner(cfg, preset, torch.float32))
    init_random_weights(model, seed=3)
    kind = torch.int32 if preset.startswith("w4a16") else torch.float8_e4m3fn
    for experts, ref in zip(_experts(model), _experts(dense), strict=True):
        assert experts.gate_up_proj.dtype == experts.down_proj.dtype == kind
        for proj in ("gate_up_proj", "down_proj"):
            w = ref.get_parameter(proj)
            error = (experts.dequantize(proj, torch.float32) - w).abs().max()
            assert error <= w.abs().max() * (0.07 if kind != torch.int32 else 0.15)
    _substitute_dequantized(dense, model)
    ids = list(range(10, 26))
    assert torch.equal(prefill_logits(model, ids), prefill_logits(dense, ids))
