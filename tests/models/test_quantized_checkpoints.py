"""Quantized checkpoints (compressed-tensors FP8 and int4 w4a16) load and compute what compressed-tensors'
own decompression of them computes: checkpoints written by compressed-tensors from the tiny models
(``quant_checkpoints.py``), logits against the dense decompressed checkpoint, greedy tokens, the fused
fast-path layout; hostile and unsupported configs refused naming the field; ``--quantization`` presets."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from quant_checkpoints import SPECS
from safetensors.torch import load_file, save_file
from test_fast_layout import prefill_logits

from g4serve.config import ConfigError
from g4serve.layers.quant import QuantLinear, pack_int4, quantize_weight
from g4serve.models.gemma4.loader import CheckpointError, load_model


def _load(path, dtype="float32", **kw):
    return load_model(path, dtype=dtype, device="cpu", with_vision=False, with_audio=False, **kw)


def _greedy(model, prompt: list[int], steps: int = 3) -> list[int]:
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(prefill_logits(model, ids)[-1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("name", list(SPECS))
def test_quantized_checkpoint_matches_its_decompression(quantized_checkpoint, name):
    quantized, dense = quantized_checkpoint(name)
    model, reference = _load(quantized), _load(dense)
    layers = [m for m in model.language_model.modules() if isinstance(m, QuantLinear)]
    assert layers and model.cfg.quantization is not None
    ids = list(range(10, 26))
    expected = prefill_logits(reference, ids)
    torch.testing.assert_close(prefill_logits(model, ids), expected, atol=1e-5, rtol=0)
    assert _greedy(model, ids) == _greedy(reference, ids)
    mlps = [layer.mlp for layer in model.language_model.layers]
    quantized_mlps = [isinstance(mlp.gate_proj, QuantLinear) for mlp in mlps]
    model.language_model.fuse_projections()  # the CUDA layout: stacked quantized projections
    assert [isinstance(mlp.gate_up_proj, QuantLinear) for mlp in mlps] == quantized_mlps
    torch.testing.assert_close(prefill_logits(model, ids), expected, atol=1e-5, rtol=0)


def test_bf16_compute_matches_the_decompression_in_bf16(quantized_checkpoint):
    quantized, dense = quantized_checkpoint("w4a16-asym")
    ids = list(range(10, 30))
    torch.testing.assert_close(
        prefill_logits(_load(quantized, "bfloat16"), ids).float(),
        prefill_logits(_load(dense, "bfloat16"), ids).float(),
    )


@pytest.mark.parametrize("name", ["w4a16-g32", "w4a16-asym"])
def test_int4_checkpoints_repack_for_tinygemm(quantized_checkpoint, name, monkeypatch):
    """``G4SERVE_INT4_MATMUL=tinygemm``: the fast path repacks a compressed-tensors checkpoint's int4
    projections (stacked ones included) for tinygemm, and each multiplies as its decompressed weight does
    (torch's CPU twin of the CUDA kernel; bf16, so within bf16 steps)."""
    from g4serve.kernels.int4_tinygemm import tinygemm_matmul
    from g4serve.layers import quant

    monkeypatch.setattr(quant, "INT4_MATMUL", "tinygemm")
    model = _load(quantized_checkpoint(name)[0], "bfloat16")
    model.prepare_fast_path()
    layers = {n: m for n, m in model.language_model.named_modules() if isinstance(m, QuantLinear)}
    repacked = [m for m in layers.values() if m.tinygemm is not None]
    assert any(n.endswith("gate_up_proj") and m.tinygemm is not None for n, m in layers.items())  # stacked
    assert all(m.tinygemm is None for m in layers.values() if m.scale_block[0] != 1 or m.out_features % 16)
    gen = torch.Generator().manual_seed(0)
    for m in repacked:
        x = torch.randn(3, m.in_features, generator=gen).bfloat16()
        want = torch.nn.functional.linear(x.float(), m.dequantize(torch.float32))
        got = tinygemm_matmul(x, m.tinygemm).float()
        assert ((got - want).abs().max() / want.abs().max()).item() < 2e-2, m


def _copy(src: Path, dst: Path, config_edit=None, tensor_edit=None) -> Path:
    shutil.copytree(src, dst)
    if config_edit is not None:
        config = json.loads((dst / "config.json").read_text())
        config_edit(config["quantization_config"])
        (dst / "config.json").write_text(json.dumps(config))
    if tensor_edit is not None:
        tensors = load_file(dst / "model.safetensors")
        tensor_edit(tensors)
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _weights(q):
    return q["config_groups"]["group_0"]["weights"]


@pytest.mark.parametrize(
    "edit,field",
    [
        (lambda q: _weights(q).update(num_bits=8, type="int"), "config_groups.group_0.weights"),
        (lambda q: _weights(q).update(strategy="tensor_group"), "config_groups.group_0.weights.strategy"),
        (lambda q: _weights(q).update(actorder="group"), "config_groups.group_0.weights.actorder"),
        (lambda q: _weights(q).update(group_size=48), "config_groups.group_0.weights.group_size"),
        (lambda q: _weights(q).update(dynamic=True), "config_groups.group_0.weights.dynamic"),
        (lambda q: q.update(quant_method="gptq"), "quant_method"),
        (
            lambda q: q["config_groups"]["group_0"].update(format="nvfp4-pack-quantized"),
            "config_groups.group_0.format",
        ),
        (lambda q: q.update(quantization_status="frozen"), "quantization_status"),
        (lambda q: q.update(sparsity_config={"format": "sparse-24-bitmask"}), "sparsity_config"),
        (lambda q: q["config_groups"]["group_0"].update(output_activations={}), "output_activations"),
        (
            lambda q: q["config_groups"]["group_0"].update(
                input_activations={"num_bits": 8, "type": "float"}
            ),
            "input_activations",
        ),
        (lambda q: q["config_groups"]["group_0"].update(targets=["re:("]), "config_groups.group_0.targets"),
        (lambda q: q.update(config_groups={}), "config_groups"),
        (lambda q: q.update(surprise=1), "quantization_config.surprise"),
    ],
)
def test_unsupported_configs_are_refused_naming_the_field(quantized_checkpoint, tmp_path, edit, field):
    bad = _copy(quantized_checkpoint("w4a16-g32")[0], tmp_path / "bad", config_edit=edit)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.").replace("(", r"\(")):
        _load(bad)


def test_fp8_activation_schemes_are_refused_beside_int4(quantized_checkpoint, tmp_path):
    def edit(q):
        q["config_groups"]["group_0"]["input_activations"] = {
            "num_bits": 8,
            "type": "float",
            "strategy": "token",
        }

    bad = _copy(quantized_checkpoint("w4a16-g32")[0], tmp_path / "bad", config_edit=edit)
    with pytest.raises(ConfigError, match="w4a16"):
        _load(bad)


Q_PROJ = "model.language_model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda t: t.pop(f"{Q_PROJ}.weight_scale"), "missing quantization tensors weight_scale"),
        (lambda t: t.update({f"{Q_PROJ}.weight_shape": torch.tensor([64, 32])}), "weight_shape: is"),
        (lambda t: t.update({f"{Q_PROJ}.weight_g_idx": torch.zeros(64, dtype=torch.int32)}), "g_idx"),
        (lambda t: t.update({f"{Q_PROJ}.weight_scale": torch.ones(64, 3)}), "weight_scale: has shape"),
        (
            lambda t: t.update({f"{Q_PROJ}.weight_packed": t[f"{Q_PROJ}.weight_packed"].float()}),
            "weight_packed: is torch.float32",
        ),
        (lambda t: t.update({"lm_head.weight_scale": torch.ones(1)}), "ties the LM head"),
        (
            lambda t: t.update(
                {"model.language_model.layers.0.experts.0.gate_proj.weight_scale": torch.ones(1)}
            ),
            "per-expert tensors, but this model has no such MoE block",
        ),
    ],
)
def test_hostile_tensors_are_refused_naming_them(quantized_checkpoint, tmp_path, edit, message):
    bad = _copy(quantized_checkpoint("w4a16-g32")[0], tmp_path / "bad", tensor_edit=edit)
    with pytest.raises(CheckpointError, match=message):
        _load(bad)


def test_a_missing_expert_projection_is_refused(quantized_checkpoint, tmp_path):
    prefix = "model.language_model.layers.1.experts.2.up_proj."

    def edit(t):
        for name in [n for n in t if n.startswith(prefix)]:
            del t[name]

    bad = _copy(quantized_checkpoint("w4a16-moe")[0], tmp_path / "bad", tensor_edit=edit)
    with pytest.raises(
        CheckpointError, match=r"expert projections missing or unexpected \(e.g. \[\(2, 'up_proj'\)"
    ):
        _load(bad)


def test_quantized_tensors_of_an_ignored_module_are_refused(quantized_checkpoint, tmp_path):
    bad = _copy(
        quantized_checkpoint("w4a16-g32")[0],
        tmp_path / "bad",
        config_edit=lambda q: q["ignore"].append("re:.*q_proj$"),
    )
    with pytest.raises(CheckpointError, match="no config group of quantization_config targets it"):
        _load(bad)


def test_a_tower_projection_quantized_in_the_checkpoint_is_dequantized(quantized_checkpoint, tmp_path):
    """A quantized module the fast path keeps dense (here the audio embedding projection) loads exactly."""
    quantized, dense = quantized_checkpoint("w4a16-g32")
    proj = "model.embed_audio.embedding_projection"
    reference = load_file(dense / "model.safetensors")[f"{proj}.weight"]

    def edit(t):
        weight = t.pop(f"{proj}.weight")
        q, scale, _ = quantize_weight(weight, "int4", (1, 32))
        t[f"{proj}.weight_packed"], t[f"{proj}.weight_scale"] = q, scale
        t[f"{proj}.weight_shape"] = torch.tensor(list(weight.shape))

    def config(q):
        q["ignore"] = [t for t in q["ignore"] if t != proj]

    path = _copy(quantized, tmp_path / "tower", config_edit=config, tensor_edit=edit)
    model = load_model(path, dtype="float32", device="cpu")
    weight = model.embed_audio.embedding_projection.weight
    assert not isinstance(model.embed_audio.embedding_projection, QuantLinear)
    assert (weight - reference).abs().max() <= (reference.abs().amax(1, keepdim=True) / 7.5).max() / 2 + 1e-6


# ---- --quantization: g4serve's own quantizer --------------------------------------------------------------
@pytest.mark.parametrize("preset", ["fp8", "fp8-block", "w4a16", "w4a16-g32"])
def test_quantization_presets_quantize_the_dense_preset_weights(preset):
    dense = load_model("tiny", dtype="float32", with_vision=False, with_audio=False)
    model = load_model("tiny", dtype="float32", with_vision=False, with_audio=False, quantization=preset)
    assert model.cfg.quantization.preset == preset
    quantized = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert quantized and not any("router" in n for n in quantized)
    # the same random draws, quantized: the dense model with the dequantized weights computes the same logits
    dense_modules = dict(dense.named_modules())
    with torch.no_grad():
        for name, q in quantized.items():
            w = dense_modules[name].weight
            error = (q.dequantize(torch.float32) - w).abs().max()
            assert error <= w.abs().max() * (0.07 if q.kind == "fp8" else 0.08)
            w.copy_(q.dequantize(torch.float32))
    ids = list(range(10, 30))
    torch.testing.assert_close(prefill_logits(model, ids), prefill_logits(dense, ids), atol=1e-5, rtol=0)


def test_quantization_of_a_dense_checkpoint_and_refusal_of_a_quantized_one(
    hf_checkpoint, quantized_checkpoint
):
    model = _load(hf_checkpoint("31b"), quantization="w4a16-g32")
    assert isinstance(model.language_model.layers[0].mlp.down_proj, QuantLinear)
    with pytest.raises(CheckpointError, match="already quantized"):
        _load(quantized_checkpoint("fp8-block")[0], quantization="fp8")
    with pytest.raises(CheckpointError, match="unknown preset"):
        _load(hf_checkpoint("31b"), quantization="int3")


def test_quantizer_packs_as_compressed_tensors_does():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    gen = torch.Generator().manual_seed(0)
    for k in (64, 100):
        values = torch.randint(-8, 8, (6, k), generator=gen).to(torch.int8)
        assert torch.equal(pack_int4(values), pack_to_int32(values, 4))


@pytest.mark.parametrize(
    "kind,block,asym", [("fp8", (1, 96), False), ("int4", (1, 32), False), ("int4", (1, 32), True)]
)
def test_quantizer_matches_compressed_tensors_quantize(kind, block, asym):
    """Given the same scales, q = round(w / s + z) clamped is compressed-tensors' own ``quantize``."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize

    from g4serve.kernels.quant_matmul import unpack_int4

    w = torch.randn(16, 96, generator=torch.Generator().manual_seed(1)) * 0.05
    q, scale, zero = quantize_weight(w, kind, block, asym)
    if kind == "fp8":
        args = QuantizationArgs(num_bits=8, type="float", strategy="channel")
        theirs = quantize(w, scale, None, args, dtype=torch.float8_e4m3fn)
        assert torch.equal(q.float(), theirs.float())
    else:
        args = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=32, symmetric=not asym)
        theirs = quantize(w, scale, zero, args, dtype=torch.int8)
        assert torch.equal(unpack_int4(q, 96), theirs)


def test_engine_serves_a_quantized_preset_as_its_dequantized_weights():
    """``LLM(..., quantization=...)``: the engine's greedy tokens on the quantized tiny preset equal those of
    the dense preset whose projections hold the dequantized weights."""
    from g4serve.engine.engine import EngineConfig, LLMEngine
    from g4serve.sampling_params import SamplingParams

    kw = dict(model="tiny", device="cpu", dtype="float32", text_only=True, kv_cache_bytes=8 << 20)
    quantized = LLMEngine(EngineConfig(quantization="w4a16-g32", **kw))
    dense = LLMEngine(EngineConfig(**kw))
    modules = dict(dense.model.named_modules())
    with torch.no_grad():
        for name, q in quantized.model.named_modules():
            if isinstance(q, QuantLinear):
                modules[name].weight.copy_(q.dequantize(torch.float32))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def run(engine):
        engine.add_request(engine.make_request("0", engine.process_prompt("hello there"), params))
        return engine.run_until_finished()["0"].outputs[0].token_ids

    assert run(quantized) == run(dense)
