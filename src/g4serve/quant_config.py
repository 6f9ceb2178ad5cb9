"""The ``quantization_config`` of compressed-tensors checkpoints, typed and checked, and the presets that
quantize bf16 weights at load (``--quantization``).

Served: FP8 e4m3 weights (per-tensor, per-channel or block scales; activations dynamic per token or per
group, static per tensor, or none) in ``float-quantized`` / ``naive-quantized`` form, and int4 weights
(``w4a16``: grouped or per-channel scales, optional zero points) in ``pack-quantized`` form. Anything else is
refused with a ``QuantConfigError`` naming the field, so a checkpoint never loads half-understood.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

FP8, INT4 = "fp8", "int4"
WEIGHT_STRATEGIES = {FP8: ("tensor", "channel", "block"), INT4: ("group", "channel")}
FORMATS = {FP8: ("float-quantized", "naive-quantized"), INT4: ("pack-quantized",)}
# Fields of compressed-tensors' QuantizationArgs that change nothing at inference, for the formats above.
_INERT_ARG_FIELDS = {"observer", "observer_kwargs", "scale_dtype", "zp_dtype"}
_ARG_FIELDS = {
    "num_bits",
    "type",
    "symmetric",
    "group_size",
    "strategy",
    "block_structure",
    "dynamic",
    "actorder",
} | _INERT_ARG_FIELDS
_TOP_FIELDS = {
    "config_groups",
    "quant_method",
    "format",
    "ignore",
    "kv_cache_scheme",
    "quantization_status",
    "global_compression_ratio",
    "sparsity_config",
    "transform_config",
    "moe_sparsity_config",
    "version",
}


class QuantConfigError(ValueError):
    """A ``quantization_config`` g4serve cannot serve; the message names the field."""


@dataclass(frozen=True)
class WeightQuant:
    """How one projection's weight is stored: ``kind`` fp8 or int4; the scale grid is ``block`` = (rows,
    cols) of weight per scale entry, 0 meaning the whole dimension (per-tensor: (0, 0); per-channel:
    (1, 0); FP8 block: (128, 128); int4 group g: (1, g))."""

    kind: str
    strategy: str
    block: tuple[int, int]
    symmetric: bool = True

    def scale_block(self, out_features: int, in_features: int) -> tuple[int, int]:
        """(rows, cols) of the weight per scale entry, for an [out, in] weight."""
        rows, cols = self.block
        return rows or out_features, cols or in_features


@dataclass(frozen=True)
class ActivationQuant:
    """FP8 activations: ``dynamic`` per ``token`` or ``group`` (of ``group_size``), or a static per-tensor
    ``input_scale`` from the checkpoint (``dynamic=False``)."""

    dynamic: bool
    strategy: str
    group_size: int | None = None


@dataclass(frozen=True)
class QuantScheme:
    name: str  # the config group's name
    targets: tuple[str, ...]
    weights: WeightQuant
    activations: ActivationQuant | None = None


@dataclass(frozen=True)
class QuantConfig:
    groups: tuple[QuantScheme, ...]
    ignore: tuple[str, ...] = ()
    format: str | None = None
    preset: str | None = None  # set when g4serve quantized the weights itself (``--quantization``)

    def scheme_for(self, module: str, is_linear: bool = True) -> QuantScheme | None:
        """The scheme of module ``module`` (Hugging Face name), as compressed-tensors matches it: an exact
        name, then a ``re:`` pattern (``re.match``), then the class name ``Linear``; None when no group
        targets it or ``ignore`` lists it."""
        if any(_name_matches(module, t) or (is_linear and t == "Linear") for t in self.ignore):
            return None
        for rank in (0, 1, 2):
            for scheme in self.groups:
                for target in sorted(scheme.targets, key=lambda t: ("re:" in t, t)):
                    if _target_rank(module, target, is_linear) == rank:
                        return scheme
        return None

    def describe(self) -> str:
        parts = []
        for s in self.groups:
            w = s.weights
            text = f"{w.kind} {w.strategy}" + (f" {w.block[1]}" if w.strategy == "group" else "")
            text += "" if w.symmetric else " asymmetric"
            if w.strategy == "block":
                text += f" {w.block[0]}x{w.block[1]}"
            a = s.activations
            if a is not None:
                text += f", activations {'dynamic' if a.dynamic else 'static'} per {a.strategy}"
            parts.append(text)
        return "; ".join(parts)


def _name_matches(name: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


def _target_rank(name: str, target: str, is_linear: bool) -> int:
    """0: exact name, 1: regex, 2: class name ``Linear``, 3: no match."""
    if target.startswith("re:"):
        return 1 if re.match(target[3:], name) else 3
    if target == name:
        return 0
    return 2 if (target == "Linear" and is_linear) else 3


def _fail(field: str, message: str) -> QuantConfigError:
    return QuantConfigError(f"quantization_config.{field}: {message}")


def _weight_quant(raw: Any, field: str) -> WeightQuant:
    if not isinstance(raw, dict):
        raise _fail(field, "must be an object (weight-only int4 or FP8 quantization)")
    unknown = sorted(set(raw) - _ARG_FIELDS)
    if unknown:
        raise _fail(field, f"unknown field(s) {', '.join(unknown)}")
    bits, qtype = raw.get("num_bits", 8), raw.get("type", "int")
    strategy = raw.get("strategy")
    if raw.get("dynamic", False) is not False:
        raise _fail(f"{field}.dynamic", f"dynamic weight quantization ({raw['dynamic']!r}) is not supported")
    if raw.get("actorder") not in (None, False, "weight", "static"):
        raise _fail(
            f"{field}.actorder",
            f"{raw['actorder']!r}: activation-ordered groups (g_idx) are not supported; "
            "'weight' ordering (no g_idx) is",
        )
    if (qtype, bits) == ("float", 8):
        kind = FP8
        if not raw.get("symmetric", True):
            raise _fail(f"{field}.symmetric", "FP8 weights must be symmetric")
    elif (qtype, bits) == ("int", 4):
        kind = INT4
    else:
        raise _fail(
            field,
            f"{bits}-bit {qtype} weights are not supported (g4serve serves 8-bit float (FP8 e4m3) and 4-bit "
            "int (w4a16) weights)",
        )
    if strategy not in WEIGHT_STRATEGIES[kind]:
        raise _fail(
            f"{field}.strategy",
            f"{strategy!r} is not supported for {kind} weights; choose {', '.join(WEIGHT_STRATEGIES[kind])}",
        )
    return WeightQuant(kind, strategy, _scale_block(raw, strategy, field), bool(raw.get("symmetric", True)))


def _power_of_two(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0 and value & (value - 1) == 0


def _scale_block(raw: dict, strategy: str, field: str) -> tuple[int, int]:
    if strategy == "tensor":
        return (0, 0)
    if strategy == "channel":
        return (1, 0)
    if strategy == "group":
        size = raw.get("group_size")
        if not _power_of_two(size) or size < 8:
            raise _fail(f"{field}.group_size", f"must be a power of two >= 8, got {size!r}")
        return (1, size)
    block = raw.get("block_structure")
    if not (isinstance(block, list) and len(block) == 2 and all(_power_of_two(b) and b >= 8 for b in block)):
        raise _fail(f"{field}.block_structure", f"must be [rows, cols], powers of two >= 8, got {block!r}")
    return (block[0], block[1])


def _activation_quant(raw: Any, weights: WeightQuant, field: str) -> ActivationQuant | None:
    if raw is None:
        return None
    if weights.kind == INT4:
        raise _fail(
            field, "int4 weights are served with 16-bit activations (w4a16); quantized activations are not"
        )
    if not isinstance(raw, dict):
        raise _fail(field, "must be an object or null")
    unknown = sorted(set(raw) - _ARG_FIELDS)
    if unknown:
        raise _fail(field, f"unknown field(s) {', '.join(unknown)}")
    if (raw.get("type", "int"), raw.get("num_bits", 8)) != ("float", 8):
        raise _fail(field, "only FP8 (8-bit float) activations are supported beside FP8 weights")
    if not raw.get("symmetric", True):
        raise _fail(f"{field}.symmetric", "asymmetric activations are not supported")
    return _activation_strategy(raw, field)


def _activation_strategy(raw: dict, field: str) -> ActivationQuant:
    dynamic, strategy = raw.get("dynamic", False), raw.get("strategy")
    if dynamic is True and strategy in ("token", "tensor"):
        return ActivationQuant(True, strategy)
    if dynamic is True and strategy == "group":
        size = raw.get("group_size")
        if not _power_of_two(size):
            raise _fail(f"{field}.group_size", f"must be a power of two, got {size!r}")
        return ActivationQuant(True, "group", size)
    if dynamic is False and strategy == "tensor":
        return ActivationQuant(False, "tensor")
    kind = "dynamic" if dynamic else "static"
    raise _fail(
        field,
        f"{kind} {strategy!r} activations are not supported (dynamic per token, per tensor or per group, "
        "or static per tensor)",
    )


# compressed-tensors' preset scheme names (a config group may name one and list its targets).
_PRESET_SCHEMES = {
    "FP8": (WeightQuant(FP8, "tensor", (0, 0)), ActivationQuant(False, "tensor")),
    "FP8_DYNAMIC": (WeightQuant(FP8, "channel", (1, 0)), ActivationQuant(True, "token")),
    "FP8_BLOCK": (WeightQuant(FP8, "block", (128, 128)), ActivationQuant(True, "group", 128)),
    "W4A16": (WeightQuant(INT4, "group", (1, 128)), None),
    "W4A16_ASYM": (WeightQuant(INT4, "group", (1, 128), symmetric=False), None),
}


def _scheme(name: str, raw: Any, top_format: str | None) -> QuantScheme:
    field = f"config_groups.{name}"
    if isinstance(raw, list):  # {"W4A16": ["Linear"]}: a compressed-tensors preset by name
        if name.upper() not in _PRESET_SCHEMES:
            raise _fail(
                field, f"preset scheme {name!r} is not supported; choose {', '.join(_PRESET_SCHEMES)}"
            )
        weights, acts = _PRESET_SCHEMES[name.upper()]
        return QuantScheme(name, tuple(_targets(raw, field)), weights, acts)
    if not isinstance(raw, dict):
        raise _fail(field, "must be an object")
    unknown = sorted(set(raw) - {"targets", "weights", "input_activations", "output_activations", "format"})
    if unknown:
        raise _fail(field, f"unknown field(s) {', '.join(unknown)}")
    if raw.get("output_activations") is not None:
        raise _fail(f"{field}.output_activations", "output quantization is not supported")
    weights = _weight_quant(raw.get("weights"), f"{field}.weights")
    fmt = raw.get("format") or top_format
    if fmt not in FORMATS[weights.kind]:
        raise _fail(
            f"{field}.format",
            f"{fmt!r} is not supported for {weights.kind} weights; "
            f"expected {' or '.join(FORMATS[weights.kind])}",
        )
    acts = _activation_quant(raw.get("input_activations"), weights, f"{field}.input_activations")
    return QuantScheme(name, tuple(_targets(raw.get("targets"), f"{field}.targets")), weights, acts)


def _targets(raw: Any, field: str) -> list[str]:
    if not isinstance(raw, list) or not raw or not all(isinstance(t, str) for t in raw):
        raise _fail(field, "must be a non-empty list of module names, 're:' patterns or 'Linear'")
    for t in raw:
        if t.startswith("re:"):
            try:
                re.compile(t[3:])
            except re.error as exc:
                raise _fail(field, f"{t!r} is not a valid regular expression ({exc})") from None
    return raw


def _check_top_level(raw: dict) -> None:
    unknown = sorted(set(raw) - _TOP_FIELDS)
    if unknown:
        raise _fail(unknown[0], "unknown field; this g4serve build does not know it")
    method = raw.get("quant_method", "compressed-tensors")
    if method != "compressed-tensors":
        raise QuantConfigError(
            f"quantization_config.quant_method: {method!r} checkpoints are not supported; g4serve serves "
            "compressed-tensors checkpoints (FP8 and int4 w4a16)"
        )
    status = raw.get("quantization_status", "compressed")
    if status != "compressed":
        raise _fail("quantization_status", f"expected 'compressed' weights, got {status!r}")
    for name in ("sparsity_config", "transform_config", "moe_sparsity_config"):
        if raw.get(name):
            raise _fail(name, "sparse, transformed or expert-pruned checkpoints are not supported")


def parse_quantization_config(raw: Any) -> QuantConfig:
    """A checkpoint's ``quantization_config`` (config.json) -> ``QuantConfig``; ``QuantConfigError`` naming
    the first field g4serve cannot serve."""
    if not isinstance(raw, dict):
        raise QuantConfigError("quantization_config: must be an object")
    _check_top_level(raw)
    top_format = raw.get("format")
    groups = raw.get("config_groups")
    # A KV-cache-only config (kv_cache_scheme, no weight groups) is read by the FP8 KV cache (kv_scales.py).
    if not isinstance(groups, dict) or not (groups or raw.get("kv_cache_scheme")):
        raise _fail("config_groups", "must be a non-empty object of quantization schemes")
    ignore = raw.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(t, str) for t in ignore):
        raise _fail("ignore", "must be a list of module names or 're:' patterns")
    schemes = tuple(_scheme(str(name), group, top_format) for name, group in groups.items())
    return QuantConfig(schemes, tuple(ignore), top_format)


# ---- presets: bf16 weights quantized at load by g4serve's own quantizer (layers/quant.py) --------------
# Every nn.Linear of the text decoder except the MoE router (tiny, and routing is sensitive to it).
PRESET_TARGETS = ("re:.*language_model\\.(?!.*router).*",)
QUANTIZATION_PRESETS: dict[str, QuantConfig] = {
    # FP8-Dynamic: per-channel weights, per-token activations
    "fp8": QuantConfig(
        (QuantScheme("fp8", PRESET_TARGETS, *_PRESET_SCHEMES["FP8_DYNAMIC"]),), format="float-quantized"
    ),
    # DeepSeek-style blocks: 128x128 weight blocks, per-token groups of 128 activations
    "fp8-block": QuantConfig(
        (QuantScheme("fp8-block", PRESET_TARGETS, *_PRESET_SCHEMES["FP8_BLOCK"]),), format="float-quantized"
    ),
    # int4 weights, groups of 128 / 32 along K, symmetric
    "w4a16": QuantConfig(
        (QuantScheme("w4a16", PRESET_TARGETS, *_PRESET_SCHEMES["W4A16"]),), format="pack-quantized"
    ),
    "w4a16-g32": QuantConfig(
        (QuantScheme("w4a16-g32", PRESET_TARGETS, WeightQuant(INT4, "group", (1, 32))),),
        format="pack-quantized",
    ),
}


def quantization_preset(name: str) -> QuantConfig:
    try:
        return replace(QUANTIZATION_PRESETS[name], preset=name)
    except KeyError:
        raise QuantConfigError(
            f"quantization: unknown preset {name!r}; choose {', '.join(QUANTIZATION_PRESETS)}"
        ) from None


__all__ = [
    "FP8",
    "INT4",
    "QUANTIZATION_PRESETS",
    "ActivationQuant",
    "QuantConfig",
    "QuantConfigError",
    "QuantScheme",
    "WeightQuant",
    "parse_quantization_config",
    "quantization_preset",
]
