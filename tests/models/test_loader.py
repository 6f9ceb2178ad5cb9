"""g4serve.models.gemma4.loader: single-file and sharded checkpoints load the same weights in every dtype,
broken checkpoints fail with a CheckpointError naming the tensor or file, and presets get seeded random
weights (shape-only on the meta device, so even 31B costs nothing)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from g4serve.config import ConfigError, approx_param_count, preset
from g4serve.models.gemma4.loader import (
    CheckpointError,
    build_model,
    init_random_weights,
    load_model,
    local_name,
    resolve_dtype,
)

DOWN_PROJ = "model.language_model.layers.0.mlp.down_proj.weight"
NORM = "model.language_model.norm.weight"


@pytest.fixture(scope="module")
def tiny_weights(tiny_model_dir) -> dict[str, torch.Tensor]:
    return load_file(str(tiny_model_dir / "model.safetensors"))


@pytest.fixture(scope="module")
def tiny_fp32(tiny_model_dir):
    return load_model(tiny_model_dir, dtype="float32", device="cpu")


def _checkpoint(src: Path, out: Path, tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """A checkpoint directory with ``src``'s config and ``tensors`` as model.safetensors."""
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "config.json", out / "config.json")
    if tensors is not None:
        save_file(tensors, str(out / "model.safetensors"))
    return out


def _sharded(src: Path, out: Path, tensors: dict[str, torch.Tensor], num_shards: int = 3) -> Path:
    _checkpoint(src, out)
    names = sorted(tensors)
    weight_map = {}
    for k in range(num_shards):
        fname = f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
        part = names[k::num_shards]
        save_file({n: tensors[n] for n in part}, str(out / fname))
        weight_map.update({n: fname for n in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def _assert_matches_file(model, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    state = model.state_dict()
    checked = 0
    for hf_name, value in tensors.items():
        name = local_name(hf_name)
        if name is None or name not in state:
            continue
        assert state[name].dtype == dtype, name
        torch.testing.assert_close(state[name], value.to(dtype), rtol=0, atol=0, msg=name)
        checked += 1
    assert checked == len(state)  # every model tensor came from the file


# ---- loading -------------------------------------------------------------------------------------------


def test_single_file_loads_every_tensor_from_the_file(tiny_fp32, tiny_weights):
    _assert_matches_file(tiny_fp32, tiny_weights, torch.float32)
    # The tied LM head reads the (loaded) input embeddings.
    hidden = torch.randn(2, tiny_fp32.cfg.text.hidden_size)
    expected = hidden @ tiny_weights["model.language_model.embed_tokens.weight"].T
    cap = tiny_fp32.cfg.text.final_logit_softcapping
    torch.testing.assert_close(tiny_fp32.compute_logits(hidden), cap * torch.tanh(expected / cap))


def test_sharded_checkpoint_loads_identical_weights(tmp_path, tiny_model_dir, tiny_weights, tiny_fp32):
    sharded = _sharded(tiny_model_dir, tmp_path / "sharded", tiny_weights)
    assert not (sharded / "model.safetensors").exists()
    model = load_model(sharded, dtype="float32", device="cpu")
    single, shards = tiny_fp32.state_dict(), model.state_dict()
    assert single.keys() == shards.keys()
    for name in single:
        assert torch.equal(single[name], shards[name]), name


@pytest.mark.parametrize(
    "dtype,expected",
    [
        ("float32", torch.float32),
        ("fp32", torch.float32),
        ("bfloat16", torch.bfloat16),
        ("bf16", torch.bfloat16),
        ("float16", torch.float16),
        ("fp16", torch.float16),
        (torch.float16, torch.float16),
        ("auto", torch.float32),
    ],
)
def test_dtypes(tiny_model_dir, tiny_weights, dtype, expected):
    model = load_model(tiny_model_dir, dtype=dtype, device="cpu", with_audio=False)
    assert model.language_model.embed_tokens.weight.dtype == expected
    assert model.audio_tower is None
    tensors = {k: v for k, v in tiny_weights.items() if "audio" not in k}
    _assert_matches_file(model, tensors, expected)


def test_bf16_checkpoint_loads_into_fp32(tmp_path, tiny_model_dir, tiny_weights):
    bf16 = {k: v.to(torch.bfloat16) for k, v in tiny_weights.items()}
    model = load_model(_checkpoint(tiny_model_dir, tmp_path / "bf16", bf16), dtype="float32", device="cpu")
    _assert_matches_file(model, bf16, torch.float32)


def test_text_only_causal_lm_checkpoint(tmp_path, tiny_model_dir, tiny_weights, tiny_fp32):
    """Gemma4ForCausalLM names (model.layers..., no towers) map onto the same decoder."""
    out = tmp_path / "causal"
    out.mkdir()
    raw = json.loads((tiny_model_dir / "config.json").read_text())["text_config"]
    (out / "config.json").write_text(json.dumps(raw))
    prefix = "model.language_model."
    save_file(
        {"model." + k[len(prefix) :]: v for k, v in tiny_weights.items() if k.startswith(prefix)},
        str(out / "model.safetensors"),
    )
    model = load_model(out, dtype="float32", device="cpu")
    assert model.cfg.architecture == "Gemma4ForCausalLM"
    assert model.vision_tower is None and model.audio_tower is None
    ours = tiny_fp32.language_model.state_dict()
    for name, value in model.language_model.state_dict().items():
        assert torch.equal(value, ours[name]), name


def test_tied_lm_head_and_unused_shared_kv_tensors_are_ignored(
    tmp_path, tiny_model_dir, tiny_weights, tiny_fp32
):
    """transformers may save lm_head.weight, and keeps K/V projections for KV-shared layers that never run
    them."""
    cfg = tiny_fp32.cfg.text
    shared = cfg.first_kv_shared_layer
    assert f"language_model.layers.{shared}.self_attn.k_proj.weight" not in tiny_fp32.state_dict()
    tensors = dict(tiny_weights)
    tensors["lm_head.weight"] = torch.zeros_like(tiny_weights["model.language_model.embed_tokens.weight"])
    hd = cfg.layer_head_dim(shared)
    tensors[f"model.language_model.layers.{shared}.self_attn.k_proj.weight"] = torch.zeros(
        cfg.layer_num_kv_heads(shared) * hd, cfg.hidden_size
    )
    tensors[f"model.language_model.layers.{shared}.self_attn.k_norm.weight"] = torch.zeros(hd)
    model = load_model(
        _checkpoint(tiny_model_dir, tmp_path / "extra", tensors), dtype="float32", device="cpu"
    )
    assert torch.equal(
        model.language_model.embed_tokens.weight, tiny_weights["model.language_model.embed_tokens.weight"]
    )


def test_towers_left_out_need_no_tower_weights(tmp_path, tiny_model_dir, tiny_weights):
    text = {k: v for k, v in tiny_weights.items() if k.startswith("model.language_model.")}
    path = _checkpoint(tiny_model_dir, tmp_path / "text", text)
    model = load_model(path, dtype="float32", device="cpu", with_vision=False, with_audio=False)
    assert model.vision_tower is None and model.audio_tower is None
    with pytest.raises(CheckpointError, match=r"missing tensors: .*vision_tower\."):
        load_model(path, dtype="float32", device="cpu", with_audio=False)


# ---- errors ----------------------------------------------------------------------------------------------


def test_missing_tensor(tmp_path, tiny_model_dir, tiny_weights):
    tensors = {k: v for k, v in tiny_weights.items() if k != DOWN_PROJ}
    with pytest.raises(CheckpointError) as err:
        load_model(_checkpoint(tiny_model_dir, tmp_path / "c", tensors), dtype="float32", device="cpu")
    assert "missing" in str(err.value)
    assert "language_model.layers.0.mlp.down_proj.weight" in str(err.value)


def test_unexpected_tensor(tmp_path, tiny_model_dir, tiny_weights):
    bogus = "model.language_model.layers.0.mlp.extra_proj.weight"
    tensors = {**tiny_weights, bogus: torch.zeros(4, 4)}
    with pytest.raises(CheckpointError) as err:
        load_model(_checkpoint(tiny_model_dir, tmp_path / "c", tensors), dtype="float32", device="cpu")
    assert "unexpected" in str(err.value) and bogus in str(err.value)


def test_wrong_shape(tmp_path, tiny_model_dir, tiny_weights):
    hidden = tiny_weights[NORM].shape[0]
    tensors = {**tiny_weights, NORM: torch.ones(hidden + 1)}
    with pytest.raises(CheckpointError) as err:
        load_model(_checkpoint(tiny_model_dir, tmp_path / "c", tensors), dtype="float32", device="cpu")
    msg = str(err.value)
    assert NORM in msg and f"({hidden + 1},)" in msg and f"({hidden},)" in msg and "model.safetensors" in msg


def test_integer_tensor_for_a_weight(tmp_path, tiny_model_dir, tiny_weights):
    tensors = {**tiny_weights, NORM: torch.ones_like(tiny_weights[NORM], dtype=torch.int64)}
    with pytest.raises(CheckpointError) as err:
        load_model(_checkpoint(tiny_model_dir, tmp_path / "c", tensors), dtype="float32", device="cpu")
    assert NORM in str(err.value) and "int64" in str(err.value)


def test_unknown_dtype(tiny_model_dir):
    with pytest.raises(ValueError, match=r"dtype: unknown dtype 'float8'"):
        load_model(tiny_model_dir, dtype="float8", device="cpu")
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("int8", "cpu")
    assert resolve_dtype("auto", "cuda") == torch.bfloat16 and resolve_dtype("auto", "cpu") == torch.float32


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "header_only"])
def test_corrupt_single_file(tmp_path, tiny_model_dir, damage):
    path = _checkpoint(tiny_model_dir, tmp_path / "c")
    data = (tiny_model_dir / "model.safetensors").read_bytes()
    header_len = 8 + int.from_bytes(data[:8], "little")
    damaged = {
        "truncated": data[: len(data) // 2],
        "garbage": b"not a safetensors file" * 10,
        "empty": b"",
        "header_only": data[:header_len],
    }[damage]
    (path / "model.safetensors").write_bytes(damaged)
    with pytest.raises(CheckpointError) as err:
        load_model(path, dtype="float32", device="cpu")
    assert str(path / "model.safetensors") in str(err.value)


def test_truncated_shard(tmp_path, tiny_model_dir, tiny_weights):
    path = _sharded(tiny_model_dir, tmp_path / "s", tiny_weights)
    shard = path / "model-00002-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-16])
    with pytest.raises(CheckpointError) as err:
        load_model(path, dtype="float32", device="cpu")
    assert shard.name in str(err.value)


def test_index_errors(tmp_path, tiny_model_dir, tiny_weights):
    path = _sharded(tiny_model_dir, tmp_path / "s", tiny_weights)
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())

    # A tensor placed in a shard that does not hold it.
    moved = dict(index["weight_map"])
    wrong = next(f for f in set(moved.values()) if f != moved[DOWN_PROJ])
    moved[DOWN_PROJ] = wrong
    index_path.write_text(json.dumps({"weight_map": moved}))
    with pytest.raises(CheckpointError) as err:
        load_model(path, dtype="float32", device="cpu")
    assert DOWN_PROJ in str(err.value) and wrong in str(err.value)

    # A shard that does not exist.
    index_path.write_text(
        json.dumps({"weight_map": {**index["weight_map"], DOWN_PROJ: "model-gone.safetensors"}})
    )
    with pytest.raises(CheckpointError, match="model-gone.safetensors"):
        load_model(path, dtype="float32", device="cpu")

    # An index that is not an index.
    for text in ("{not json", json.dumps({"metadata": {}}), json.dumps({"weight_map": {DOWN_PROJ: 3}})):
        index_path.write_text(text)
        with pytest.raises(CheckpointError, match="model.safetensors.index.json"):
            load_model(path, dtype="float32", device="cpu")


def test_missing_files(tmp_path, tiny_model_dir):
    no_config = tmp_path / "no-config"
    no_config.mkdir()
    shutil.copy(tiny_model_dir / "model.safetensors", no_config)
    with pytest.raises(ConfigError, match="config.json"):
        load_model(no_config, dtype="float32", device="cpu")
    no_weights = _checkpoint(tiny_model_dir, tmp_path / "no-weights")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(no_weights, dtype="float32", device="cpu")
    with pytest.raises(CheckpointError, match="does-not-exist"):
        load_model(tmp_path / "does-not-exist", dtype="float32", device="cpu")


# ---- presets with random weights ---------------------------------------------------------------------------


def test_tiny_preset_random_weights_are_seeded():
    a = load_model("tiny", dtype="float32", device="cpu", seed=0)
    b = load_model("tiny", dtype="float32", device="cpu", seed=0)
    c = load_model("tiny", dtype="float32", device="cpu", seed=1)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys() == sc.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name
    q = "language_model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(sa[q], sc[q])
    assert sa[q].std().item() == pytest.approx(0.02, rel=0.1)  # N(0, 0.02) matrices
    assert torch.all(sa["language_model.norm.weight"] == 1)  # neutral norms
    assert all(torch.isfinite(v).all() or "max" in k or "min" in k for k, v in sa.items())
    assert a.language_model.embed_tokens.weight.shape == (1024, 64)


def test_init_random_weights_is_deterministic_in_place(tiny_fp32):
    model = build_model(tiny_fp32.cfg, torch.float32, "cpu")
    init_random_weights(model, seed=5)
    first = {k: v.clone() for k, v in model.state_dict().items()}
    init_random_weights(model, seed=5)
    assert all(torch.equal(first[k], v) for k, v in model.state_dict().items())


def test_31b_preset_on_the_meta_device_is_instant_and_allocates_nothing():
    t0 = time.perf_counter()
    model = load_model("31b", dtype="bfloat16", device="meta")
    elapsed = time.perf_counter() - t0
    assert elapsed < 10, f"building the 31B preset on meta took {elapsed:.1f}s"
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    cfg = preset("31b")
    n_text = sum(p.numel() for p in model.language_model.parameters())
    # approx_param_count leaves out the 1-D norm scales only.
    assert n_text == pytest.approx(approx_param_count(cfg), rel=1e-3)
    assert n_text == pytest.approx(30.7e9, rel=0.01)
    lm = model.language_model
    assert lm.embed_tokens.weight.shape == (262_144, 5376)
    full = lm.layers[5].self_attn  # a K=V global layer: 32 x 512 queries, 4 x 512 keys, no V projection
    assert full.q_proj.weight.shape == (32 * 512, 5376)
    assert full.k_proj.weight.shape == (4 * 512, 5376)
    assert getattr(full, "v_proj", None) is None
    sliding = lm.layers[0].self_attn
    assert sliding.k_proj.weight.shape == sliding.v_proj.weight.shape == (16 * 256, 5376)
