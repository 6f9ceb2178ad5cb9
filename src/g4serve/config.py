"""Typed Gemma 4 configuration parsed from a Hugging Face ``config.json``, plus size presets.

The parser accepts both spellings transformers has used for the global-layer shapes
(``global_head_dim`` / ``num_global_key_value_heads`` and the newer ``per_layer_config``),
derives every per-layer fact the engine needs (head dim, KV heads, KV source layer), and
rejects unknown or inconsistent fields with an error that names the field.
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from g4serve.quant_config import QuantConfig, QuantConfigError, parse_quantization_config

SLIDING = "sliding_attention"
FULL = "full_attention"
LAYER_TYPES = (SLIDING, FULL)

# Keys every transformers PretrainedConfig serialises; they carry no architecture.
_GENERIC_KEYS = frozenset(
    {
        "_name_or_path",
        "architectures",
        "chunk_size_feed_forward",
        "dtype",
        "torch_dtype",
        "id2label",
        "label2id",
        "is_encoder_decoder",
        "model_type",
        "output_attentions",
        "output_hidden_states",
        "problem_type",
        "return_dict",
        "transformers_version",
        "initializer_range",
        "use_cache",
        "attention_dropout",
        "_attn_implementation_autoset",
        "tokenizer_class",
        "task_specific_params",
        "pruned_heads",
        "tie_encoder_decoder",
        "torchscript",
        "use_return_dict",
        "_commit_hash",
        "quantization_config",
        "base_model_tp_plan",
        "base_model_pp_plan",
        "_from_model_config",
    }
)


class ConfigError(ValueError):
    """A config.json field is unknown, missing or inconsistent; the message names the field."""


def _check_unknown(section: str, raw: dict[str, Any], known: set[str], strict: bool) -> None:
    unknown = sorted(set(raw) - known - _GENERIC_KEYS)
    if unknown and strict:
        raise ConfigError(
            f"{section}: unknown field(s) {', '.join(unknown)}; this g4serve build does not know them. "
            "Pass strict_config=False to ignore them."
        )


def _quantization(raw: dict[str, Any]) -> QuantConfig | None:
    if raw.get("quantization_config") is None:
        return None
    try:
        return parse_quantization_config(raw["quantization_config"])
    except QuantConfigError as exc:
        raise ConfigError(str(exc)) from None


def _require(cond: bool, field_name: str, message: str) -> None:
    if not cond:
        raise ConfigError(f"{field_name}: {message}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true/false are not sizes


def _is_positive_int(value: Any) -> bool:
    return _is_int(value) and value > 0


@dataclass
class TextConfig:
    vocab_size: int = 262_144
    hidden_size: int = 2560
    intermediate_size: int = 10240
    num_hidden_layers: int = 42
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 256
    global_head_dim: int = 512
    num_global_key_value_heads: int | None = None
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 131_072
    rms_norm_eps: float = 1e-6
    pad_token_id: int = 0
    eos_token_id: int | list[int] = 1
    bos_token_id: int | None = 2
    tie_word_embeddings: bool = True
    rope_parameters: dict[str, dict[str, Any]] = field(default_factory=dict)
    attention_bias: bool = False
    sliding_window: int = 512
    layer_types: list[str] = field(default_factory=list)
    final_logit_softcapping: float | None = 30.0
    use_bidirectional_attention: str | None = None
    vocab_size_per_layer_input: int = 262_144
    hidden_size_per_layer_input: int = 256
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = 0
    enable_moe_block: bool = False
    use_double_wide_mlp: bool = False
    num_experts: int | None = None
    top_k_experts: int | None = None
    moe_intermediate_size: int | None = None
    # Optional explicit per-layer overrides ({"7": {"head_dim": 512, "num_key_value_heads": 2}}).
    per_layer_config: dict[str, dict[str, int]] | None = None

    # ---- derived per-layer facts -------------------------------------------------------
    def layer_head_dim(self, layer_idx: int) -> int:
        override = self._override(layer_idx)
        if "head_dim" in override:
            return int(override["head_dim"])
        return self.global_head_dim if self.layer_types[layer_idx] == FULL else self.head_dim

    def layer_num_kv_heads(self, layer_idx: int) -> int:
        override = self._override(layer_idx)
        if "num_key_value_heads" in override:
            return int(override["num_key_value_heads"])
        if (
            self.layer_types[layer_idx] == FULL
            and self.attention_k_eq_v
            and self.num_global_key_value_heads is not None
        ):
            return self.num_global_key_value_heads
        return self.num_key_value_heads

    def _override(self, layer_idx: int) -> dict[str, int]:
        if not self.per_layer_config:
            return {}
        # transformers writes the layer keys zero-padded ("05"); compare them as integers.
        for key, override in self.per_layer_config.items():
            if int(key) == layer_idx:
                return override
        return {}

    def layer_uses_k_as_v(self, layer_idx: int) -> bool:
        return self.attention_k_eq_v and self.layer_types[layer_idx] == FULL

    @property
    def first_kv_shared_layer(self) -> int:
        return self.num_hidden_layers - self.num_kv_shared_layers

    def kv_source_layer(self, layer_idx: int) -> int:
        """The layer whose K/V this layer attends over (itself unless KV-shared)."""
        if layer_idx < self.first_kv_shared_layer:
            return layer_idx
        layer_type = self.layer_types[layer_idx]
        for src in range(self.first_kv_shared_layer - 1, -1, -1):
            if self.layer_types[src] == layer_type:
                return src
        raise ConfigError(
            f"num_kv_shared_layers: no earlier {layer_type} layer produces K/V for layer {layer_idx}"
        )

    @property
    def kv_producer_layers(self) -> list[int]:
        return list(range(self.first_kv_shared_layer))

    @property
    def last_kv_producer_layer(self) -> int:
        return self.first_kv_shared_layer - 1

    def layer_intermediate_size(self, layer_idx: int) -> int:
        double = self.use_double_wide_mlp and layer_idx >= self.first_kv_shared_layer
        return self.intermediate_size * (2 if double else 1)

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self.eos_token_id) if isinstance(self.eos_token_id, list) else [self.eos_token_id]

    # ---- parsing ------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any], strict: bool = True) -> TextConfig:
        raw = dict(raw)
        # transformers writes is_causal=false for use_bidirectional_attention="all"; it carries nothing more.
        is_causal = raw.pop("is_causal", None)
        known = {f.name for f in fields(cls)}
        _check_unknown("text_config", raw, known, strict)
        kwargs = {k: copy.deepcopy(v) for k, v in raw.items() if k in known}
        if kwargs.get("hidden_size_per_layer_input") is None:
            kwargs["hidden_size_per_layer_input"] = 0
        if (
            kwargs.get("head_dim") is None
            and _is_positive_int(kwargs.get("hidden_size"))
            and _is_positive_int(kwargs.get("num_attention_heads"))
        ):
            kwargs["head_dim"] = kwargs["hidden_size"] // kwargs["num_attention_heads"]
        if kwargs.get("global_head_dim") is None:
            kwargs.pop("global_head_dim", None)
        cfg = cls(**kwargs)
        # transformers halves the window of fully bidirectional configs on load; do the same.
        if cfg.use_bidirectional_attention == "all":
            cfg.sliding_window = cfg.sliding_window // 2 + 1
        if not cfg.layer_types:
            cfg.layer_types = [SLIDING if (i + 1) % 6 else FULL for i in range(cfg.num_hidden_layers)]
        if not cfg.rope_parameters:
            cfg.rope_parameters = default_rope_parameters()
        _require(
            is_causal is None or is_causal == (cfg.use_bidirectional_attention != "all"),
            "text_config.is_causal",
            f"{is_causal!r} contradicts use_bidirectional_attention={cfg.use_bidirectional_attention!r}",
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "global_head_dim",
            "sliding_window",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            _require(_is_positive_int(value), f"text_config.{name}", f"must be a positive int, got {value!r}")
        for name in ("hidden_size_per_layer_input", "num_kv_shared_layers"):
            value = getattr(self, name)
            _require(
                _is_int(value) and value >= 0,
                f"text_config.{name}",
                f"must be a non-negative int, got {value!r}",
            )
        _require(
            self.num_global_key_value_heads is None or _is_positive_int(self.num_global_key_value_heads),
            "text_config.num_global_key_value_heads",
            f"must be null or a positive int, got {self.num_global_key_value_heads!r}",
        )
        _require(
            isinstance(self.rms_norm_eps, (int, float))
            and not isinstance(self.rms_norm_eps, bool)
            and self.rms_norm_eps >= 0,
            "text_config.rms_norm_eps",
            f"must be a non-negative number, got {self.rms_norm_eps!r}",
        )
        _require(
            isinstance(self.layer_types, list),
            "text_config.layer_types",
            f"must be a list of layer types, got {type(self.layer_types).__name__}",
        )
        _require(
            len(self.layer_types) == self.num_hidden_layers,
            "text_config.layer_types",
            f"has {len(self.layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}",
        )
        _require(
            self.per_layer_config is None or isinstance(self.per_layer_config, dict),
            "text_config.per_layer_config",
            f"must be an object keyed by layer index, got {type(self.per_layer_config).__name__}",
        )
        self._validate_per_layer_config()
        for i, t in enumerate(self.layer_types):
            _require(t in LAYER_TYPES, f"text_config.layer_types[{i}]", f"unknown layer type {t!r}")
        _require(
            self.layer_types[-1] == FULL, "text_config.layer_types", "the last layer must be full_attention"
        )
        _require(
            0 <= self.num_kv_shared_layers < self.num_hidden_layers,
            "text_config.num_kv_shared_layers",
            f"must be in [0, {self.num_hidden_layers}), got {self.num_kv_shared_layers}",
        )
        if self.num_kv_shared_layers:
            producers = set(self.layer_types[: self.first_kv_shared_layer])
            _require(
                producers == set(self.layer_types),
                "text_config.num_kv_shared_layers",
                "every layer type of the shared layers needs an earlier layer of that type producing K/V",
            )
        self._validate_rope_parameters()
        self._validate_layer_heads()
        _require(
            self.hidden_activation in ("gelu_pytorch_tanh", "gelu_tanh"),
            "text_config.hidden_activation",
            f"unsupported activation {self.hidden_activation!r}",
        )
        _require(
            self.use_bidirectional_attention in (None, "vision", "all"),
            "text_config.use_bidirectional_attention",
            f"must be null, 'vision' or 'all', got {self.use_bidirectional_attention!r}",
        )
        if self.enable_moe_block:
            for name in ("num_experts", "top_k_experts", "moe_intermediate_size"):
                value = getattr(self, name)
                _require(
                    _is_positive_int(value),
                    f"text_config.{name}",
                    f"must be a positive int when enable_moe_block is true, got {value!r}",
                )
            _require(
                self.top_k_experts <= self.num_experts,
                "text_config.top_k_experts",
                f"{self.top_k_experts} exceeds num_experts={self.num_experts}",
            )
        if self.hidden_size_per_layer_input:
            _require(
                self.vocab_size_per_layer_input > 0,
                "text_config.vocab_size_per_layer_input",
                "must be positive",
            )
        self._validate_token_ids()

    def _validate_per_layer_config(self) -> None:
        seen_layers: dict[int, Any] = {}
        for key, override in (self.per_layer_config or {}).items():
            field_name = f"text_config.per_layer_config[{key!r}]"
            _require(
                str(key).isdigit() and int(key) < self.num_hidden_layers,
                field_name,
                f"is not a layer index in [0, {self.num_hidden_layers})",
            )
            # "05" and "5" name the same layer; two overrides for one layer are ambiguous.
            _require(
                int(key) not in seen_layers,
                field_name,
                f"layer {int(key)} is also given as {seen_layers.get(int(key))!r}",
            )
            seen_layers[int(key)] = key
            _require(
                isinstance(override, dict) and set(override) <= {"head_dim", "num_key_value_heads"},
                field_name,
                f"may only override head_dim and num_key_value_heads, got {override!r}",
            )
            for name, value in override.items():
                _require(
                    _is_positive_int(value), f"{field_name}.{name}", f"must be a positive int, got {value!r}"
                )

    def _validate_rope_parameters(self) -> None:
        for layer_type in set(self.layer_types):
            _require(
                layer_type in self.rope_parameters,
                "text_config.rope_parameters",
                f"missing entry for {layer_type}",
            )
            rope = self.rope_parameters[layer_type]
            rope_type = rope.get("rope_type", "default")
            _require(
                rope_type in ("default", "proportional"),
                f"text_config.rope_parameters.{layer_type}.rope_type",
                f"unsupported rope type {rope_type!r} (expected 'default' or 'proportional')",
            )
            _require(
                "rope_theta" in rope, f"text_config.rope_parameters.{layer_type}.rope_theta", "is required"
            )
            factor = rope.get("partial_rotary_factor", 1.0)
            _require(
                isinstance(factor, (int, float)) and not isinstance(factor, bool) and 0 < factor <= 1,
                f"text_config.rope_parameters.{layer_type}.partial_rotary_factor",
                f"must be in (0, 1], got {factor!r}",
            )

    def _validate_layer_heads(self) -> None:
        for i in range(self.num_hidden_layers):
            kv_heads = self.layer_num_kv_heads(i)
            _require(
                self.num_attention_heads % kv_heads == 0,
                "text_config.num_key_value_heads",
                (
                    f"layer {i}: {self.num_attention_heads} query heads are not a multiple of "
                    f"{kv_heads} KV heads"
                ),
            )
            _require(
                self.layer_head_dim(i) % 2 == 0, "text_config.head_dim", f"layer {i}: head dim must be even"
            )

    def _validate_token_ids(self) -> None:
        for name in ("pad_token_id", "bos_token_id"):
            value = getattr(self, name)
            if value is None and name == "bos_token_id":
                continue  # the model never reads it
            _require(
                _is_int(value) and 0 <= value < self.vocab_size,
                f"text_config.{name}",
                f"{value!r} is outside the vocabulary (size {self.vocab_size})",
            )
        for eos in self.eos_token_ids:
            _require(
                _is_int(eos) and 0 <= eos < self.vocab_size,
                "text_config.eos_token_id",
                f"{eos!r} is outside the vocabulary (size {self.vocab_size})",
            )

    def to_hf_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["model_type"] = "gemma4_text"
        if out["per_layer_config"] is None:
            out.pop("per_layer_config")
        if self.use_bidirectional_attention == "all":
            out["sliding_window"] = (self.sliding_window - 1) * 2
        return out


def default_rope_parameters() -> dict[str, dict[str, Any]]:
    return {
        SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
        FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
    }


@dataclass
class VisionConfig:
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 16
    num_attention_heads: int = 12
    num_key_value_heads: int = 12
    head_dim: int = 64
    hidden_activation: str = "gelu_pytorch_tanh"
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 131_072
    attention_bias: bool = False
    rope_parameters: dict[str, Any] = field(
        default_factory=lambda: {"rope_type": "axial", "rope_theta": 100.0}
    )
    pooling_kernel_size: int = 3
    patch_size: int = 16
    position_embedding_size: int = 10 * 1024
    use_clipped_linears: bool = False
    standardize: bool = False

    @classmethod
    def from_dict(cls, raw: dict[str, Any], strict: bool = True) -> VisionConfig:
        known = {f.name for f in fields(cls)}
        _check_unknown("vision_config", raw, known, strict)
        cfg = cls(**{k: copy.deepcopy(v) for k, v in raw.items() if k in known})
        if not cfg.rope_parameters:
            cfg.rope_parameters = {"rope_type": "axial", "rope_theta": 100.0}
        cfg.validate()
        return cfg

    def validate(self) -> None:
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "pooling_kernel_size",
            "patch_size",
            "position_embedding_size",
        ):
            value = getattr(self, name)
            _require(
                _is_positive_int(value), f"vision_config.{name}", f"must be a positive int, got {value!r}"
            )
        _require(
            self.rope_parameters.get("rope_type", "axial") == "axial",
            "vision_config.rope_parameters.rope_type",
            "only 'axial' 2-D RoPE is supported",
        )
        _require(self.head_dim % 4 == 0, "vision_config.head_dim", "must be divisible by 4 for 2-D RoPE")
        _require(
            self.num_attention_heads % self.num_key_value_heads == 0,
            "vision_config.num_key_value_heads",
            "must divide num_attention_heads",
        )

    def to_hf_dict(self) -> dict[str, Any]:
        return {**asdict(self), "model_type": "gemma4_vision"}


@dataclass
class AudioConfig:
    hidden_size: int = 1024
    num_hidden_layers: int = 12
    num_attention_heads: int = 8
    hidden_act: str = "silu"
    subsampling_conv_channels: list[int] = field(default_factory=lambda: [128, 32])
    conv_kernel_size: int = 5
    residual_weight: float = 0.5
    attention_chunk_size: int = 12
    attention_context_left: int = 13
    attention_context_right: int = 0
    attention_logit_cap: float = 50.0
    attention_invalid_logits_value: float = -1.0e9
    use_clipped_linears: bool = True
    rms_norm_eps: float = 1e-6
    gradient_clipping: float = 1e10
    output_proj_dims: int = 1536

    @classmethod
    def from_dict(cls, raw: dict[str, Any], strict: bool = True) -> AudioConfig:
        known = {f.name for f in fields(cls)}
        _check_unknown("audio_config", raw, known, strict)
        cfg = cls(**{k: copy.deepcopy(v) for k, v in raw.items() if k in known})
        cfg.subsampling_conv_channels = list(cfg.subsampling_conv_channels)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        for name in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "attention_chunk_size",
            "attention_context_left",
            "output_proj_dims",
            "conv_kernel_size",
        ):
            value = getattr(self, name)
            _require(
                _is_positive_int(value), f"audio_config.{name}", f"must be a positive int, got {value!r}"
            )
        _require(
            self.hidden_size % self.num_attention_heads == 0,
            "audio_config.num_attention_heads",
            "must divide hidden_size",
        )
        _require(
            len(self.subsampling_conv_channels) == 2,
            "audio_config.subsampling_conv_channels",
            "must list exactly two channel counts",
        )
        _require(
            self.hidden_act in ("silu", "swish"),
            "audio_config.hidden_act",
            f"unsupported {self.hidden_act!r}",
        )

    def to_hf_dict(self) -> dict[str, Any]:
        return {**asdict(self), "model_type": "gemma4_audio"}


@dataclass
class Gemma4Config:
    text: TextConfig
    vision: VisionConfig | None = None
    audio: AudioConfig | None = None
    boi_token_id: int = 255_999
    eoi_token_id: int = 258_882
    image_token_id: int = 258_880
    video_token_id: int = 258_884
    boa_token_id: int = 256_000
    eoa_token_id: int = 258_883
    audio_token_id: int = 258_881
    tie_word_embeddings: bool = True
    architecture: str = "Gemma4ForConditionalGeneration"
    # compressed-tensors checkpoints (FP8, int4 w4a16), or a preset quantized at load (``--quantization``)
    quantization: QuantConfig | None = None

    _TOP_KEYS = frozenset(
        {
            "text_config",
            "vision_config",
            "audio_config",
            "boi_token_id",
            "eoi_token_id",
            "image_token_id",
            "video_token_id",
            "boa_token_id",
            "eoa_token_index",
            "eoa_token_id",
            "audio_token_id",
            "tie_word_embeddings",
            "bos_token_id",
            "eos_token_id",
            "pad_token_id",
            "vision_soft_tokens_per_image",
        }
    )

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], strict: bool = True) -> Gemma4Config:
        model_type = raw.get("model_type")
        if model_type == "gemma4_text" or ("text_config" not in raw and "hidden_size" in raw):
            # A text-only Gemma4ForCausalLM checkpoint: the text config is the whole file.
            text = TextConfig.from_dict(raw, strict=strict)
            return cls(
                text=text,
                tie_word_embeddings=text.tie_word_embeddings,
                architecture="Gemma4ForCausalLM",
                quantization=_quantization(raw),
            )
        _require(model_type in (None, "gemma4"), "model_type", f"expected 'gemma4', got {model_type!r}")
        _require("text_config" in raw and isinstance(raw["text_config"], dict), "text_config", "is required")
        _check_unknown("config.json", raw, set(cls._TOP_KEYS), strict)
        text = TextConfig.from_dict(raw["text_config"], strict=strict)
        vision = VisionConfig.from_dict(raw["vision_config"], strict) if raw.get("vision_config") else None
        audio = AudioConfig.from_dict(raw["audio_config"], strict) if raw.get("audio_config") else None
        cfg = cls(text=text, vision=vision, audio=audio, quantization=_quantization(raw))
        for name in (
            "boi_token_id",
            "eoi_token_id",
            "image_token_id",
            "video_token_id",
            "boa_token_id",
            "audio_token_id",
            "tie_word_embeddings",
        ):
            if raw.get(name) is not None:
                setattr(cfg, name, raw[name])
        eoa = raw.get("eoa_token_id", raw.get("eoa_token_index"))
        if eoa is not None:
            cfg.eoa_token_id = eoa
        cfg.validate()
        return cfg

    def validate(self) -> None:
        for name in (
            "boi_token_id",
            "eoi_token_id",
            "image_token_id",
            "video_token_id",
            "boa_token_id",
            "eoa_token_id",
            "audio_token_id",
        ):
            # Placeholder ids may lie past the text vocabulary (the model embeds them as padding).
            value = getattr(self, name)
            _require(_is_int(value) and value >= 0, name, f"must be a non-negative token id, got {value!r}")
        _require(
            self.tie_word_embeddings,
            "tie_word_embeddings",
            "Gemma 4 ties the LM head to the input embeddings; untied checkpoints are not supported",
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, strict: bool = True) -> Gemma4Config:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"config.json: not found in {model_dir}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"config.json: not valid JSON ({exc})") from exc
        return cls.from_hf_dict(raw, strict=strict)

    def to_hf_dict(self) -> dict[str, Any]:
        return {
            "architectures": ["Gemma4ForConditionalGeneration"],
            "model_type": "gemma4",
            "text_config": self.text.to_hf_dict(),
            "vision_config": self.vision.to_hf_dict() if self.vision else None,
            "audio_config": self.audio.to_hf_dict() if self.audio else None,
            "boi_token_id": self.boi_token_id,
            "eoi_token_id": self.eoi_token_id,
            "image_token_id": self.image_token_id,
            "video_token_id": self.video_token_id,
            "boa_token_id": self.boa_token_id,
            "eoa_token_index": self.eoa_token_id,
            "audio_token_id": self.audio_token_id,
            "tie_word_embeddings": True,
        }

    def save(self, model_dir: str | Path) -> None:
        Path(model_dir).mkdir(parents=True, exist_ok=True)
        (Path(model_dir) / "config.json").write_text(json.dumps(self.to_hf_dict(), indent=2) + "\n")

    @property
    def multimodal_token_ids(self) -> tuple[int, int, int]:
        return (self.image_token_id, self.video_token_id, self.audio_token_id)


# ---- presets --------------------------------------------------------------------------------


def _pattern(num_layers: int, period: int) -> list[str]:
    return [SLIDING if (i + 1) % period else FULL for i in range(num_layers)]


def _preset_e2b() -> Gemma4Config:
    text = TextConfig(
        hidden_size=1536,
        intermediate_size=6144,
        num_hidden_layers=35,
        num_attention_heads=8,
        num_key_value_heads=1,
        head_dim=256,
        global_head_dim=512,
        sliding_window=512,
        layer_types=_pattern(35, 5),
        num_kv_shared_layers=20,
        hidden_size_per_layer_input=256,
        use_double_wide_mlp=True,
        rope_parameters=default_rope_parameters(),
        eos_token_id=[1, 106],
    )
    return Gemma4Config(text=text, vision=VisionConfig(), audio=AudioConfig())


def _preset_e4b() -> Gemma4Config:
    text = TextConfig(
        hidden_size=2560,
        intermediate_size=10240,
        num_hidden_layers=42,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        global_head_dim=512,
        sliding_window=512,
        layer_types=_pattern(42, 6),
        num_kv_shared_layers=18,
        hidden_size_per_layer_input=256,
        rope_parameters=default_rope_parameters(),
        eos_token_id=[1, 106],
    )
    return Gemma4Config(text=text, vision=VisionConfig(), audio=AudioConfig())


def _large_vision() -> VisionConfig:
    return VisionConfig(
        hidden_size=1152,
        intermediate_size=4304,
        num_hidden_layers=27,
        num_attention_heads=16,
        num_key_value_heads=16,
        head_dim=72,
    )


def _preset_26b_a4b() -> Gemma4Config:
    text = TextConfig(
        hidden_size=2816,
        intermediate_size=2112,
        num_hidden_layers=30,
        num_attention_heads=16,
        num_key_value_heads=8,
        num_global_key_value_heads=2,
        head_dim=256,
        global_head_dim=512,
        sliding_window=1024,
        layer_types=_pattern(30, 6),
        hidden_size_per_layer_input=0,
        attention_k_eq_v=True,
        enable_moe_block=True,
        num_experts=128,
        top_k_experts=8,
        moe_intermediate_size=704,
        max_position_embeddings=262_144,
        use_bidirectional_attention="vision",
        rope_parameters=default_rope_parameters(),
        eos_token_id=[1, 106],
    )
    return Gemma4Config(text=text, vision=_large_vision())


def _preset_31b() -> Gemma4Config:
    text = TextConfig(
        hidden_size=5376,
        intermediate_size=21504,
        num_hidden_layers=60,
        num_attention_heads=32,
        num_key_value_heads=16,
        num_global_key_value_heads=4,
        head_dim=256,
        global_head_dim=512,
        sliding_window=1024,
        layer_types=_pattern(60, 6),
        hidden_size_per_layer_input=0,
        attention_k_eq_v=True,
        max_position_embeddings=262_144,
        use_bidirectional_attention="vision",
        rope_parameters=default_rope_parameters(),
        eos_token_id=[1, 106],
    )
    return Gemma4Config(text=text, vision=_large_vision())


def _preset_tiny() -> Gemma4Config:
    """A few-MB model with every Gemma 4 feature switched on (PLE, KV sharing, 512-style global dims)."""
    text = TextConfig(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        sliding_window=16,
        layer_types=_pattern(6, 3),
        num_kv_shared_layers=2,
        vocab_size_per_layer_input=1024,
        hidden_size_per_layer_input=16,
        max_position_embeddings=4096,
        rope_parameters=default_rope_parameters(),
        eos_token_id=[1, 6],
    )
    vision = VisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        position_embedding_size=1024,
    )
    audio = AudioConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        subsampling_conv_channels=[128, 4],
        output_proj_dims=48,
    )
    # Token ids of the tiny tokenizer (see g4serve.processing.tiny_tokenizer.SPECIAL_TOKENS).
    return Gemma4Config(
        text=text,
        vision=vision,
        audio=audio,
        boi_token_id=10,
        eoi_token_id=11,
        image_token_id=12,
        boa_token_id=13,
        eoa_token_id=14,
        audio_token_id=15,
        video_token_id=16,
    )


PRESETS = {
    "tiny": _preset_tiny,
    "e2b": _preset_e2b,
    "e4b": _preset_e4b,
    "26b-a4b": _preset_26b_a4b,
    "31b": _preset_31b,
}


def preset(name: str) -> Gemma4Config:
    try:
        cfg = PRESETS[name]()
    except KeyError:
        raise ConfigError(f"preset: unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None
    cfg.text.validate()
    return cfg


def approx_param_count(cfg: Gemma4Config) -> int:
    """Parameters of the text decoder (embeddings included), for logs and memory planning."""
    t = cfg.text
    n = t.vocab_size * t.hidden_size
    if t.hidden_size_per_layer_input:
        n += t.vocab_size_per_layer_input * t.num_hidden_layers * t.hidden_size_per_layer_input
        n += t.hidden_size * t.num_hidden_layers * t.hidden_size_per_layer_input
    for i in range(t.num_hidden_layers):
        hd, kv = t.layer_head_dim(i), t.layer_num_kv_heads(i)
        n += 2 * t.hidden_size * t.num_attention_heads * hd
        if i < t.first_kv_shared_layer:
            n += t.hidden_size * kv * hd * (1 if t.layer_uses_k_as_v(i) else 2)
        n += 3 * t.hidden_size * t.layer_intermediate_size(i)
        if t.enable_moe_block:
            n += t.num_experts * 3 * t.hidden_size * t.moe_intermediate_size + t.hidden_size * t.num_experts
        if t.hidden_size_per_layer_input:
            n += 2 * t.hidden_size * t.hidden_size_per_layer_input
    return n


__all__ = [
    "AudioConfig",
    "ConfigError",
    "FULL",
    "Gemma4Config",
    "PRESETS",
    "SLIDING",
    "TextConfig",
    "VisionConfig",
    "approx_param_count",
    "preset",
]
