"""g4serve.config: transformers-written config.json files parse to the same per-layer facts transformers
derives, configs round-trip, the presets have the published Gemma 4 shapes, and bad fields are rejected
with an error that names them."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from g4serve.config import (
    FULL,
    PRESETS,
    SLIDING,
    ConfigError,
    Gemma4Config,
    TextConfig,
    approx_param_count,
    preset,
)

VARIANTS = ["e", "moe", "31b"]  # the architectures of tests/conftest.py's transformers checkpoints


@pytest.fixture(scope="module")
def shared(request):
    """tests/conftest.py itself (by path: `import conftest` may find another directory's conftest)."""
    module = request.config.pluginmanager.get_plugin(str(Path(__file__).with_name("conftest.py")))
    assert sorted(module.VARIANTS) == sorted(VARIANTS)
    return module


@pytest.fixture(scope="module")
def hf_configs(tmp_path_factory, shared):
    """``variant -> (transformers Gemma4Config, directory holding the config.json it wrote)``."""
    from transformers import Gemma4Config as HFConfig

    out = {}
    for variant, spec in shared.VARIANTS.items():
        cfg = HFConfig(
            text_config=copy.deepcopy(spec["text"]),
            vision_config=dict(shared._VISION),
            audio_config=dict(shared._AUDIO) if spec["audio"] else None,
            **shared.TOKEN_IDS,
        )
        path = tmp_path_factory.mktemp(f"cfg-{variant}")
        cfg.save_pretrained(path)
        out[variant] = (cfg, path)
    return out


def _hf_kv_source(text_cfg) -> list[int]:
    """The layer whose K/V each layer reads, from transformers' kv_sharing_modes."""
    modes = text_cfg.kv_sharing_modes
    first_shared = text_cfg.num_hidden_layers - text_cfg.num_kv_shared_layers
    sources = []
    for i, mode in enumerate(modes):
        if mode != "reuse":
            sources.append(i)
            continue
        same_type = [j for j in range(first_shared) if text_cfg.layer_types[j] == text_cfg.layer_types[i]]
        sources.append(same_type[-1])
    return sources


# ---- transformers-written config.json ------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_transformers_config_json_parses_to_transformers_per_layer_facts(hf_configs, shared, variant):
    token_ids, vision, audio = shared.TOKEN_IDS, shared._VISION, shared._AUDIO
    hf, path = hf_configs[variant]
    raw = json.loads((path / "config.json").read_text())
    # transformers 5.23 writes per_layer_config (zero-based string keys) rather than global_head_dim.
    assert "per_layer_config" in raw["text_config"] and "global_head_dim" not in raw["text_config"]
    cfg = Gemma4Config.from_pretrained(path)
    t, ht = cfg.text, hf.text_config
    assert cfg.architecture == "Gemma4ForConditionalGeneration"
    assert t.layer_types == ht.layer_types
    assert t.num_hidden_layers == ht.num_hidden_layers
    assert t.sliding_window == ht.sliding_window
    assert t.num_kv_shared_layers == ht.num_kv_shared_layers
    assert t.hidden_size_per_layer_input == ht.hidden_size_per_layer_input
    assert t.attention_k_eq_v == ht.attention_k_eq_v
    assert t.enable_moe_block == ht.enable_moe_block
    assert t.use_bidirectional_attention == ht.use_bidirectional_attention
    assert t.eos_token_ids == [1, 6]
    assert t.rope_parameters == ht.rope_parameters
    for i in range(t.num_hidden_layers):
        assert t.layer_head_dim(i) == ht.per_layer_config[i].head_dim, f"layer {i}"
        assert t.layer_num_kv_heads(i) == ht.per_layer_config[i].num_key_value_heads, f"layer {i}"
    assert [t.kv_source_layer(i) for i in range(t.num_hidden_layers)] == _hf_kv_source(ht)
    # Top-level token ids, including transformers' odd spelling eoa_token_index.
    for name in (
        "boi_token_id",
        "eoi_token_id",
        "image_token_id",
        "video_token_id",
        "boa_token_id",
        "audio_token_id",
    ):
        assert getattr(cfg, name) == token_ids[name]
    assert cfg.eoa_token_id == token_ids["eoa_token_index"]
    assert cfg.vision is not None and cfg.vision.hidden_size == vision["hidden_size"]
    assert cfg.vision.num_hidden_layers == vision["num_hidden_layers"]
    assert cfg.vision.position_embedding_size == vision["position_embedding_size"]
    assert (cfg.audio is not None) == shared.VARIANTS[variant]["audio"]
    if cfg.audio is not None:
        assert cfg.audio.hidden_size == audio["hidden_size"]
        assert cfg.audio.subsampling_conv_channels == audio["subsampling_conv_channels"]
        assert cfg.audio.output_proj_dims == audio["output_proj_dims"]


def test_kv_sharing_facts_of_the_e_variant(hf_configs):
    t = Gemma4Config.from_pretrained(hf_configs["e"][1]).text
    # 12 layers, ([S]*5 + [F]) * 2, last 4 share: layers 8..11 read the last producer of their type.
    assert t.first_kv_shared_layer == 8
    assert t.kv_producer_layers == list(range(8))
    assert [t.kv_source_layer(i) for i in range(12)] == [0, 1, 2, 3, 4, 5, 6, 7, 7, 7, 7, 5]
    assert [t.layer_head_dim(i) for i in range(12)] == [16] * 5 + [32] + [16] * 5 + [32]


@pytest.mark.parametrize("variant", VARIANTS)
def test_config_round_trips_through_to_hf_dict(hf_configs, variant):
    cfg = Gemma4Config.from_pretrained(hf_configs[variant][1])
    again = Gemma4Config.from_hf_dict(json.loads(json.dumps(cfg.to_hf_dict())))
    assert again == cfg


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_round_trip_through_config_json(tmp_path, name):
    cfg = preset(name)
    cfg.save(tmp_path)
    assert Gemma4Config.from_pretrained(tmp_path) == cfg


def test_transformers_reads_the_config_g4serve_writes(tmp_path):
    """make-tiny checkpoints must mean the same thing to transformers as to g4serve."""
    from transformers import Gemma4Config as HFConfig

    from g4serve.tiny import tiny_config

    for variant in ("e", "moe", "31b"):
        ours = tiny_config(variant)
        ours.save(tmp_path / variant)
        ht = HFConfig.from_pretrained(tmp_path / variant).text_config
        t = ours.text
        assert ht.layer_types == t.layer_types
        assert ht.sliding_window == t.sliding_window
        for i in range(t.num_hidden_layers):
            assert ht.per_layer_config[i].head_dim == t.layer_head_dim(i), (variant, i)
            assert ht.per_layer_config[i].num_key_value_heads == t.layer_num_kv_heads(i), (variant, i)
        assert _hf_kv_source(ht) == [t.kv_source_layer(i) for i in range(t.num_hidden_layers)]


def test_bidirectional_all_halves_the_window_like_transformers(tmp_path, shared):
    from transformers import Gemma4Config as HFConfig

    text = dict(shared.VARIANTS["31b"]["text"], use_bidirectional_attention="all", sliding_window=512)
    hf = HFConfig(text_config=text, vision_config=dict(shared._VISION), **shared.TOKEN_IDS)
    hf.save_pretrained(tmp_path)
    cfg = Gemma4Config.from_pretrained(tmp_path)
    assert cfg.text.sliding_window == hf.text_config.sliding_window == 257
    # Writing it back must store the un-halved value, or every reload would halve it again.
    assert cfg.to_hf_dict()["text_config"]["sliding_window"] == 512
    assert Gemma4Config.from_hf_dict(cfg.to_hf_dict()).text.sliding_window == 257


def test_text_only_causal_lm_config(tmp_path, shared):
    from transformers import Gemma4TextConfig

    Gemma4TextConfig(**shared.VARIANTS["e"]["text"]).save_pretrained(tmp_path)
    cfg = Gemma4Config.from_pretrained(tmp_path)
    assert cfg.architecture == "Gemma4ForCausalLM"
    assert cfg.vision is None and cfg.audio is None
    assert cfg.text.num_kv_shared_layers == 4 and cfg.text.layer_head_dim(5) == 32


def test_global_head_dim_spelling_is_accepted():
    """Older transformers versions wrote global_head_dim / num_global_key_value_heads instead of
    per_layer_config."""
    raw = preset("tiny").to_hf_dict()
    raw["text_config"].update(global_head_dim=48, num_global_key_value_heads=1, attention_k_eq_v=True)
    t = Gemma4Config.from_hf_dict(raw).text
    assert [t.layer_head_dim(i) for i in range(6)] == [16, 16, 48, 16, 16, 48]
    assert [t.layer_num_kv_heads(i) for i in range(6)] == [2, 2, 1, 2, 2, 1]
    assert [t.layer_uses_k_as_v(i) for i in range(6)] == [False, False, True, False, False, True]


def test_strict_false_ignores_unknown_fields():
    raw = preset("tiny").to_hf_dict()
    raw["text_config"]["some_future_field"] = 1
    raw["vision_soft_tokens_per_image"] = 280  # a known top-level key
    raw["future_top_level"] = {"x": 1}
    with pytest.raises(ConfigError, match="future_top_level"):
        Gemma4Config.from_hf_dict(raw)
    cfg = Gemma4Config.from_hf_dict(raw, strict=False)
    assert cfg.text == preset("tiny").text


# ---- presets ----------------------------------------------------------------------------------------------


def _effective_params(cfg: Gemma4Config) -> int:
    """Text parameters without any embedding table (the "effective" size of the E models)."""
    t = cfg.text
    embeddings = (
        t.vocab_size * t.hidden_size
        + t.vocab_size_per_layer_input * t.num_hidden_layers * t.hidden_size_per_layer_input
    )
    return approx_param_count(cfg) - embeddings


def test_preset_names():
    assert set(PRESETS) == {"tiny", "e2b", "e4b", "26b-a4b", "31b"}
    with pytest.raises(ConfigError, match="preset") as err:
        preset("gemma-7b")
    assert "e4b" in str(err.value)


def test_e4b_preset_matches_the_published_config():
    """Every number in docs/gemma4.md's E4B section."""
    cfg = preset("e4b")
    t = cfg.text
    assert (t.hidden_size, t.num_hidden_layers, t.vocab_size, t.intermediate_size) == (
        2560,
        42,
        262_144,
        10240,
    )
    assert t.tie_word_embeddings and cfg.tie_word_embeddings
    assert t.layer_types == ([SLIDING] * 5 + [FULL]) * 7
    assert t.sliding_window == 512
    assert (t.num_attention_heads, t.num_key_value_heads) == (8, 2)
    assert {t.layer_head_dim(i) for i in range(42) if t.layer_types[i] == SLIDING} == {256}
    assert {t.layer_head_dim(i) for i in range(42) if t.layer_types[i] == FULL} == {512}
    assert t.rope_parameters[SLIDING] == {"rope_type": "default", "rope_theta": 10_000.0}
    assert t.rope_parameters[FULL] == {
        "rope_type": "proportional",
        "partial_rotary_factor": 0.25,
        "rope_theta": 1e6,
    }
    assert t.num_kv_shared_layers == 18 and t.kv_producer_layers == list(range(24))
    # Each shared layer reuses the last producer of its type: sliding -> 22, full -> 23.
    assert {t.kv_source_layer(i) for i in range(24, 42) if t.layer_types[i] == SLIDING} == {22}
    assert {t.kv_source_layer(i) for i in range(24, 42) if t.layer_types[i] == FULL} == {23}
    assert t.hidden_size_per_layer_input == 256 and t.vocab_size_per_layer_input == 262_144
    assert t.hidden_activation == "gelu_pytorch_tanh"
    assert t.final_logit_softcapping == 30.0
    assert not t.enable_moe_block and not t.attention_k_eq_v
    # ~7.6B stored parameters, ~3.5B of them embeddings, the PLE table ~2.8B.
    ple = t.vocab_size_per_layer_input * t.num_hidden_layers * t.hidden_size_per_layer_input
    assert ple == pytest.approx(2.8e9, rel=0.02)
    assert ple + t.vocab_size * t.hidden_size == pytest.approx(3.5e9, rel=0.02)
    assert approx_param_count(cfg) == pytest.approx(7.5e9, rel=0.03)
    assert _effective_params(cfg) == pytest.approx(4e9, rel=0.1)
    # Towers: vision 16 x 768, 12 heads of 64, patch 16, 3x3 pooling; audio present.
    v = cfg.vision
    assert (v.num_hidden_layers, v.hidden_size, v.num_attention_heads, v.head_dim) == (16, 768, 12, 64)
    assert (v.patch_size, v.pooling_kernel_size) == (16, 3)
    assert cfg.audio is not None
    # Special tokens.
    assert (cfg.boi_token_id, cfg.image_token_id, cfg.eoi_token_id, cfg.video_token_id, cfg.boa_token_id) == (
        255_999,
        258_880,
        258_882,
        258_884,
        256_000,
    )


def test_e2b_preset_is_an_effective_2b_e_model():
    cfg = preset("e2b")
    t = cfg.text
    assert t.vocab_size == 262_144 and t.hidden_size_per_layer_input == 256 and t.num_kv_shared_layers > 0
    assert t.layer_types[-1] == FULL and t.global_head_dim == 512 and t.head_dim == 256
    assert _effective_params(cfg) == pytest.approx(2e9, rel=0.1)
    assert cfg.vision.hidden_size == 768 and cfg.audio is not None


def test_26b_a4b_preset_is_a_4b_active_moe():
    cfg = preset("26b-a4b")
    t = cfg.text
    assert t.enable_moe_block and t.attention_k_eq_v and cfg.audio is None
    assert t.use_bidirectional_attention == "vision"
    assert t.hidden_size_per_layer_input == 0 and t.num_kv_shared_layers == 0
    assert cfg.vision.hidden_size == 1152 and cfg.vision.num_hidden_layers == 27
    total = approx_param_count(cfg)
    per_expert = 3 * t.hidden_size * t.moe_intermediate_size * t.num_hidden_layers
    active = total - (t.num_experts - t.top_k_experts) * per_expert
    assert total == pytest.approx(25.5e9, rel=0.04)
    assert active == pytest.approx(4e9, rel=0.1)
    for i in range(t.num_hidden_layers):
        if t.layer_types[i] == FULL:
            assert (t.layer_head_dim(i), t.layer_num_kv_heads(i), t.layer_uses_k_as_v(i)) == (512, 2, True)
        else:
            assert (t.layer_head_dim(i), t.layer_num_kv_heads(i), t.layer_uses_k_as_v(i)) == (256, 8, False)


def test_31b_preset_is_a_31b_dense_model():
    cfg = preset("31b")
    t = cfg.text
    assert not t.enable_moe_block and t.attention_k_eq_v and cfg.audio is None
    assert t.hidden_size_per_layer_input == 0 and t.num_kv_shared_layers == 0
    assert cfg.vision.hidden_size == 1152 and cfg.vision.num_hidden_layers == 27
    assert approx_param_count(cfg) == pytest.approx(31e9, rel=0.03)
    assert {t.layer_head_dim(i) for i in range(60) if t.layer_types[i] == FULL} == {512}


def test_tiny_preset_switches_every_feature_on():
    cfg = preset("tiny")
    t = cfg.text
    assert t.hidden_size_per_layer_input > 0 and t.num_kv_shared_layers > 0
    assert t.global_head_dim == 2 * t.head_dim
    assert set(t.layer_types) == {SLIDING, FULL}
    assert cfg.vision is not None and cfg.audio is not None
    # The ids of the tiny tokenizer's special tokens.
    from g4serve.processing.tiny_tokenizer import SPECIAL_TOKENS

    assert SPECIAL_TOKENS[cfg.image_token_id] == "<|image|>"
    assert SPECIAL_TOKENS[cfg.audio_token_id] == "<|audio|>"
    assert SPECIAL_TOKENS[cfg.video_token_id] == "<|video|>"
    assert SPECIAL_TOKENS[cfg.boi_token_id] == "<|image>" and SPECIAL_TOKENS[cfg.eoi_token_id] == "<image|>"
    assert [SPECIAL_TOKENS[i] for i in t.eos_token_ids] == ["<eos>", "<turn|>"]
    assert approx_param_count(cfg) < 1_000_000


# ---- errors name the field --------------------------------------------------------------------------------


def _set(path: str, value):
    def apply(raw: dict) -> None:
        *parents, leaf = path.split(".")
        cur = raw
        for key in parents:
            cur = cur[key]
        if value is _DELETE:
            del cur[leaf]
        else:
            cur[leaf] = value

    return apply


class _Delete:
    """The field removed instead of set (a stable repr: pytest-xdist's workers must collect the same ids)."""

    def __repr__(self) -> str:
        return "<deleted>"


_DELETE = _Delete()

BAD_FIELDS = [
    # unknown fields, in every section
    ("text_config.rope_scalling", 1, "rope_scalling"),
    ("vision_config.pooling_kernel", 3, "pooling_kernel"),
    ("audio_config.conv_kernel", 5, "conv_kernel"),
    ("mystery_token_id", 7, "mystery_token_id"),
    # inconsistent layer pattern
    ("text_config.layer_types", [SLIDING, SLIDING, FULL], "text_config.layer_types"),
    ("text_config.layer_types", [SLIDING] * 6, "text_config.layer_types"),
    ("text_config.layer_types", [SLIDING] * 5 + ["chunked_attention"], "text_config.layer_types[5]"),
    ("text_config.layer_types", "sliding_attention", "text_config.layer_types"),
    ("text_config.num_hidden_layers", 7, "text_config.layer_types"),
    # per_layer_config keys and values
    ("text_config.per_layer_config", {"6": {"head_dim": 32}}, "text_config.per_layer_config['6']"),
    ("text_config.per_layer_config", {"x": {"head_dim": 32}}, "text_config.per_layer_config['x']"),
    ("text_config.per_layer_config", {"2": {"intermediate_size": 32}}, "text_config.per_layer_config['2']"),
    ("text_config.per_layer_config", {"2": {"head_dim": 0}}, "text_config.per_layer_config['2'].head_dim"),
    (
        "text_config.per_layer_config",
        {"2": {"num_key_value_heads": 0}},
        "text_config.per_layer_config['2'].num_key_value_heads",
    ),
    (
        "text_config.per_layer_config",
        {"02": {"head_dim": 32}, "2": {"head_dim": 16}},
        "text_config.per_layer_config",
    ),
    ("text_config.per_layer_config", [{"head_dim": 32}], "text_config.per_layer_config"),
    # non-positive or non-integer sizes
    ("text_config.hidden_size", 0, "text_config.hidden_size"),
    ("text_config.hidden_size", -64, "text_config.hidden_size"),
    ("text_config.hidden_size", 64.0, "text_config.hidden_size"),
    ("text_config.hidden_size", True, "text_config.hidden_size"),
    ("text_config.vocab_size", None, "text_config.vocab_size"),
    ("text_config.num_attention_heads", 0, "text_config.num_attention_heads"),
    ("text_config.head_dim", -16, "text_config.head_dim"),
    ("text_config.global_head_dim", 0, "text_config.global_head_dim"),
    ("text_config.intermediate_size", 0, "text_config.intermediate_size"),
    ("text_config.sliding_window", 0, "text_config.sliding_window"),
    ("text_config.max_position_embeddings", 0, "text_config.max_position_embeddings"),
    ("text_config.hidden_size_per_layer_input", -1, "text_config.hidden_size_per_layer_input"),
    ("text_config.vocab_size_per_layer_input", 0, "text_config.vocab_size_per_layer_input"),
    ("text_config.num_global_key_value_heads", 0, "text_config.num_global_key_value_heads"),
    ("text_config.rms_norm_eps", -1e-6, "text_config.rms_norm_eps"),
    ("vision_config.hidden_size", 0, "vision_config.hidden_size"),
    ("vision_config.patch_size", -16, "vision_config.patch_size"),
    ("audio_config.num_hidden_layers", 0, "audio_config.num_hidden_layers"),
    ("audio_config.subsampling_conv_channels", [128], "audio_config.subsampling_conv_channels"),
    # num_kv_shared_layers out of range, or leaving a layer type without a K/V producer
    ("text_config.num_kv_shared_layers", 6, "text_config.num_kv_shared_layers"),
    ("text_config.num_kv_shared_layers", 9, "text_config.num_kv_shared_layers"),
    ("text_config.num_kv_shared_layers", -1, "text_config.num_kv_shared_layers"),
    ("text_config.num_kv_shared_layers", 4, "text_config.num_kv_shared_layers"),
    # head counts, RoPE, vocabulary, MoE
    ("text_config.num_attention_heads", 3, "text_config.num_key_value_heads"),
    ("vision_config.num_key_value_heads", 3, "vision_config.num_key_value_heads"),
    (
        "text_config.rope_parameters",
        {
            SLIDING: {"rope_type": "yarn", "rope_theta": 1e4},
            FULL: {"rope_type": "default", "rope_theta": 1e6},
        },
        "text_config.rope_parameters.sliding_attention.rope_type",
    ),
    (
        "text_config.rope_parameters",
        {SLIDING: {"rope_type": "default", "rope_theta": 1e4}},
        "text_config.rope_parameters",
    ),
    (
        "text_config.rope_parameters",
        {
            SLIDING: {"rope_type": "default", "rope_theta": 1e4},
            FULL: {"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": 1.5},
        },
        "text_config.rope_parameters.full_attention.partial_rotary_factor",
    ),
    ("text_config.eos_token_id", [1, 5000], "text_config.eos_token_id"),
    ("text_config.pad_token_id", -1, "text_config.pad_token_id"),
    ("text_config.hidden_activation", "relu", "text_config.hidden_activation"),
    ("text_config.use_bidirectional_attention", "text", "text_config.use_bidirectional_attention"),
    ("text_config.enable_moe_block", True, "text_config.num_experts"),
    ("image_token_id", -3, "image_token_id"),
    ("tie_word_embeddings", False, "tie_word_embeddings"),
    ("model_type", "gemma3", "model_type"),
    ("text_config", _DELETE, "text_config"),
    # transformers writes is_causal=false only for use_bidirectional_attention="all"
    ("text_config.is_causal", False, "text_config.is_causal"),
]


@pytest.mark.parametrize("path,value,field", BAD_FIELDS, ids=[f"{p}={v!r}"[:60] for p, v, _ in BAD_FIELDS])
def test_bad_field_is_rejected_naming_the_field(path, value, field):
    raw = preset("tiny").to_hf_dict()
    _set(path, value)(raw)
    with pytest.raises(ConfigError) as err:
        Gemma4Config.from_hf_dict(raw)
    assert field in str(err.value)


def test_moe_needs_top_k_at_most_num_experts():
    raw = preset("tiny").to_hf_dict()
    raw["text_config"].update(enable_moe_block=True, num_experts=4, top_k_experts=8, moe_intermediate_size=32)
    with pytest.raises(ConfigError, match="text_config.top_k_experts"):
        Gemma4Config.from_hf_dict(raw)


def test_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        Gemma4Config.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json"):
        Gemma4Config.from_pretrained(tmp_path)


def test_text_config_validate_catches_direct_construction():
    with pytest.raises(ConfigError, match="text_config.num_kv_shared_layers"):
        TextConfig(
            num_hidden_layers=6,
            layer_types=[SLIDING] * 5 + [FULL],
            num_kv_shared_layers=6,
            rope_parameters={SLIDING: {"rope_theta": 1.0}, FULL: {"rope_theta": 1.0}},
        ).validate()


def test_derived_head_dim_with_zero_heads_names_the_field():
    raw = preset("tiny").to_hf_dict()
    raw["text_config"].update(head_dim=None, num_attention_heads=0)
    with pytest.raises(ConfigError, match="text_config.num_attention_heads"):
        Gemma4Config.from_hf_dict(raw)
    raw["text_config"].update(num_attention_heads=4)
    assert (
        Gemma4Config.from_hf_dict(raw).text.head_dim == 16
    )  # hidden_size / heads, as transformers derives it
