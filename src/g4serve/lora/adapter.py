"""Reads a PEFT LoRA adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) for the
Gemma 4 text decoder, and checks every part of it against the base model before any weight is used.

An adapter path is as hostile as a request body (the load endpoint takes one): the config is size-capped
JSON, the weights are safetensors only (``adapter_model.bin`` is a pickle, never unpickled), the file may
not be larger than the biggest adapter the model admits, and every tensor must name a projection the
decoder computes, with the shape, rank, float dtype and finite values (once scaled, in the serving dtype) it
must have. Every refusal is a ``LoRAAdapterError`` that quotes at most a short part of the files.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from g4serve.config import TextConfig
from g4serve.layers.lora import LORA_MODULES, projection_shapes
from g4serve.lora.patterns import AlphaPatterns

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
_HEADER_SLACK_BYTES = 1 << 20  # the safetensors JSON header beside the tensors
PEFT_DEFAULT_ALPHA = 8.0  # LoraConfig.lora_alpha when a config leaves it out (whatever its r)
# What PEFT saves adapters in (the model's dtype); fp8 and integer tensors are no LoRA weights.
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# PEFT options that change what the adapter computes beyond ``W + scale * B @ A`` on linear projections.
_UNSUPPORTED_OPTIONS = {
    "use_dora": "DoRA (use_dora) rescales the merged weight's columns",
    "fan_in_fan_out": "fan_in_fan_out adapters are for Conv1D layers, which Gemma 4 has none of",
    "layer_replication": "layer_replication changes the model's layer stack",
    "target_parameters": "target_parameters adapts raw parameters (e.g. MoE experts), not projections",
    "trainable_token_indices": "trainable_token_indices trains embedding rows",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) switches on mid-sequence",
    "use_qalora": "QA-LoRA pools its input groups",
    "use_bdlora": "block-diagonal LoRA",
}
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?P<prefix>(?:[\w]+\.)*?)layers\.(?P<layer>0|[1-9][0-9]{0,5})\."
    r"(?P<block>self_attn|mlp)\.(?P<module>\w+)\.lora_(?P<ab>[AB])(?:\.[\w-]+)?\.weight$"
)
# Where the decoder's layers sit: Gemma4ForConditionalGeneration, Gemma4ForCausalLM, a bare text model.
_DECODER_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.", "")


class LoRAAdapterError(ValueError):
    """The adapter cannot be served; the message says what is wrong and where."""


@dataclass
class LoRAAdapter:
    """A checked adapter: per (layer, module) A [r, in] and B [out, r] with ``alpha / r`` folded into B."""

    path: str
    rank: int  # the largest rank of any module
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def load_peft_adapter(
    path: str | Path, cfg: TextConfig, max_rank: int, dtype: torch.dtype, confine_to: str | Path | None = None
) -> LoRAAdapter:
    """Read and check the adapter in directory ``path`` for a decoder of config ``cfg``. ``confine_to``: a
    directory every file read must lie under once its links are resolved (a run-time load's ``--lora-root``:
    the directory named lies under it, but a file in it may link anywhere the server can read)."""
    root = Path(path)
    try:
        is_dir = root.is_dir()
    except OSError as exc:  # a name past NAME_MAX or PATH_MAX
        raise LoRAAdapterError(f"{path}: cannot be opened ({exc.strerror})") from None
    if not is_dir:
        raise LoRAAdapterError(f"{path}: is not a directory")
    files = _AdapterFiles(root, Path(confine_to).resolve() if confine_to is not None else None)
    scales = _Scales(_read_config(files))
    shapes = projection_shapes(cfg)
    pairs = sorted(_read_pairs(files, cfg, shapes, max_rank).items())
    ranks = {name: _checked_rank(name, a, b, shapes[key], max_rank) for key, (name, a, b) in pairs}
    scale = scales.of(ranks)
    weights = {key: _folded(name, a, b, scale[name], dtype) for key, (name, a, b) in pairs}
    return LoRAAdapter(str(path), max(ranks.values()), weights)


def _checked_rank(name: str, a: torch.Tensor, b: torch.Tensor, shape: tuple[int, int], max_rank: int) -> int:
    """The rank of one module's lora_A [r, in] and lora_B [out, r], checked against its projection."""
    n_in, n_out = shape
    r = a.shape[0] if a.ndim == 2 else -1
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != n_in or b.shape != (n_out, r):
        raise LoRAAdapterError(
            f"{WEIGHTS_NAME}: {name}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit "
            f"the projection ({n_in} -> {n_out}): expected [r, {n_in}] and [{n_out}, r]"
        )
    if r < 1:
        raise LoRAAdapterError(f"{WEIGHTS_NAME}: {name}: rank {r}: an adapter's rank is at least 1")
    if r > max_rank:
        raise LoRAAdapterError(f"{WEIGHTS_NAME}: {name}: rank {r} exceeds --max-lora-rank {max_rank}")
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise LoRAAdapterError(f"{WEIGHTS_NAME}: {name}: holds NaN or infinite values")
    return r


def _folded(
    name: str, a: torch.Tensor, b: torch.Tensor, scale: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, scale * B) in the serving dtype, still finite: a huge lora_alpha, or weights past float16's
    range, would make every token of the adapter's requests NaN."""
    a, b = a.to(dtype), (b.float() * scale).to(dtype)
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise LoRAAdapterError(
            f"{WEIGHTS_NAME}: {name}: holds NaN or infinite values once scaled by lora_alpha / r ({scale:g}) "
            f"and cast to {str(dtype).removeprefix('torch.')}"
        )
    return a, b


class _AdapterFiles:
    """The adapter directory's files, each resolved and, with ``confine_to``, required to lie under it. The
    resolved path is what is read, so a link swapped in after the check needs write access under the root
    (whoever has it can place any adapter there anyway)."""

    def __init__(self, root: Path, confine_to: Path | None):
        self.root = root
        self.confine_to = confine_to

    def __call__(self, name: str) -> Path:
        file = self.root / name
        if self.confine_to is None or not file.exists():
            return file
        resolved = file.resolve()
        if not resolved.is_relative_to(self.confine_to):
            raise LoRAAdapterError(f"{name}: lies outside the server's --lora-root (a link out of it)")
        return resolved


def _read_pairs(
    files: _AdapterFiles, cfg: TextConfig, shapes: dict[tuple[int, str], tuple[int, int]], max_rank: int
) -> dict[tuple[int, str], tuple[str, torch.Tensor, torch.Tensor]]:
    """(module name, lora_A, lora_B) per (layer, module) from the safetensors file, every key checked."""
    weights_file = _weights_file(files, shapes, max_rank)
    parts: dict[tuple[int, str], dict] = {}
    try:
        with safe_open(str(weights_file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                layer, module, ab, name = _parse_key(key, cfg)
                if (layer, module) not in shapes:
                    continue  # K/V of a KV-shared layer: the base model computes none, so PEFT's do nothing
                found = parts.setdefault((layer, module), {"name": name})
                if ab in found:
                    raise LoRAAdapterError(f"{WEIGHTS_NAME}: {key}: lora_{ab} given twice")
                found[ab] = _float_tensor(f, key)
    except LoRAAdapterError:
        raise
    except OSError as exc:  # its text would name the file's resolved path, which may be the server's
        raise LoRAAdapterError(f"{WEIGHTS_NAME}: cannot be read ({exc.strerror})") from None
    except Exception as exc:  # a truncated or corrupt file: safetensors' own message, no traceback
        raise LoRAAdapterError(f"{WEIGHTS_NAME}: cannot be read ({exc})") from None
    if not parts:
        raise LoRAAdapterError(f"{WEIGHTS_NAME}: holds no LoRA weights of the text decoder's projections")
    for found in parts.values():
        missing = next((ab for ab in "AB" if ab not in found), None)
        if missing:
            raise LoRAAdapterError(f"{WEIGHTS_NAME}: {found['name']} has lora_{missing} missing")
    return {key: (found["name"], found["A"], found["B"]) for key, found in parts.items()}


def _float_tensor(f, key: str) -> torch.Tensor:
    tensor = f.get_tensor(key)
    if tensor.dtype not in _FLOAT_DTYPES:
        raise LoRAAdapterError(
            f"{WEIGHTS_NAME}: {key}: dtype {str(tensor.dtype).removeprefix('torch.')}: expected float32, "
            "bfloat16 or float16"
        )
    return tensor


def _weights_file(
    files: _AdapterFiles, shapes: dict[tuple[int, str], tuple[int, int]], max_rank: int
) -> Path:
    """The safetensors file, if no larger than the largest adapter of rank <= ``max_rank`` (fp32)."""
    weights_file = files(WEIGHTS_NAME)
    if not weights_file.is_file():
        pickled = (files.root / "adapter_model.bin").exists()
        why = " (adapter_model.bin is a pickle, which g4serve never loads: save with safetensors)"
        raise LoRAAdapterError(f"{files.root}: has no {WEIGHTS_NAME}{why if pickled else ''}")
    largest = sum((n_in + n_out) * max_rank * 4 for n_in, n_out in shapes.values()) + _HEADER_SLACK_BYTES
    size = weights_file.stat().st_size
    if size > largest:
        raise LoRAAdapterError(
            f"{WEIGHTS_NAME}: {size} bytes is more than any adapter of rank <= {max_rank} for this model "
            f"({largest} bytes)"
        )
    return weights_file


def _read_config(files: _AdapterFiles) -> dict:
    file = files(CONFIG_NAME)
    if not file.is_file():
        raise LoRAAdapterError(f"{files.root}: has no {CONFIG_NAME}")
    try:
        if file.stat().st_size > MAX_CONFIG_BYTES:
            raise LoRAAdapterError(f"{CONFIG_NAME}: larger than {MAX_CONFIG_BYTES} bytes")
        config = json.loads(file.read_text(encoding="utf-8"))
    except OSError as exc:
        raise LoRAAdapterError(f"{CONFIG_NAME}: cannot be read ({exc.strerror})") from None
    except RecursionError:  # "[[[[..." past the parser's recursion limit: under the size cap, 1 MB deep
        raise LoRAAdapterError(f"{CONFIG_NAME}: nested too deeply") from None
    except ValueError as exc:  # UnicodeDecodeError too
        raise LoRAAdapterError(f"{CONFIG_NAME}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"{CONFIG_NAME}: expected a JSON object")
    _check_options(config)
    return config


def _check_options(config: dict) -> None:
    """Refuse what the config asks for that g4serve does not compute."""
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(
            f"{CONFIG_NAME}: peft_type {_brief(config.get('peft_type'))}: only LORA adapters are served"
        )
    for option, why in _UNSUPPORTED_OPTIONS.items():
        if config.get(option):
            raise LoRAAdapterError(f"{CONFIG_NAME}: {option} is not supported: {why}")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise LoRAAdapterError(f"{CONFIG_NAME}: bias: adapters that train biases are not supported")
    if config.get("modules_to_save"):
        raise LoRAAdapterError(
            f"{CONFIG_NAME}: modules_to_save: adapters that replace whole modules "
            f"({_brief(config['modules_to_save'])}) are not supported (serve a merged checkpoint instead)"
        )


def _brief(value: object, limit: int = 60) -> str:
    """A config value as an error may quote it: its repr, cut (a field may hold most of a megabyte)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


class _Scales:
    """``lora_alpha / r`` per module (``alpha_pattern`` overrides, rsLoRA's ``alpha / sqrt(r)``), matched as
    PEFT matches pattern keys (``patterns.AlphaPatterns``: a key names the module's full name or a dotted
    suffix of it)."""

    def __init__(self, config: dict):
        try:
            self.alpha = float(config.get("lora_alpha", PEFT_DEFAULT_ALPHA))
            patterns = {str(k): float(v) for k, v in (config.get("alpha_pattern") or {}).items()}
        except (TypeError, ValueError, AttributeError):
            raise LoRAAdapterError(f"{CONFIG_NAME}: lora_alpha and alpha_pattern must be numbers") from None
        self.rslora = config.get("use_rslora", False)
        if not isinstance(self.rslora, bool):
            raise LoRAAdapterError(
                f"{CONFIG_NAME}: use_rslora: expected true or false, got {_brief(self.rslora)}"
            )
        if not math.isfinite(self.alpha) or not all(map(math.isfinite, patterns.values())):
            raise LoRAAdapterError(f"{CONFIG_NAME}: lora_alpha must be finite")
        try:
            self.patterns = AlphaPatterns(patterns)
        except ValueError as exc:
            raise LoRAAdapterError(f"{CONFIG_NAME}: {exc}") from None

    def of(self, ranks: dict[str, int]) -> dict[str, float]:
        """The scale of each module (by name) of the given rank."""
        try:
            alphas = self.patterns.alphas(list(ranks), self.alpha)
        except ValueError as exc:
            raise LoRAAdapterError(f"{CONFIG_NAME}: {exc}") from None
        root = math.sqrt if self.rslora else float
        return {name: alphas[name] / root(r) for name, r in ranks.items()}


def _parse_key(key: str, cfg: TextConfig) -> tuple[int, str, str, str]:
    """(layer, module, "A"/"B", the module's name) of a PEFT tensor name; anything else is refused by name."""
    match = _KEY.match(key)
    if match is None or match["prefix"] not in _DECODER_PREFIXES:
        where = "the vision tower" if "vision" in key else "the audio tower" if "audio" in key else None
        if where is not None:
            raise LoRAAdapterError(
                f"{WEIGHTS_NAME}: {key}: adapts {where}; g4serve applies adapters to the text decoder only"
            )
        raise LoRAAdapterError(
            f"{WEIGHTS_NAME}: {key}: not a LoRA weight of a decoder projection ({', '.join(LORA_MODULES)})"
        )
    layer, module = int(match["layer"]), match["module"]
    if module not in LORA_MODULES:
        raise LoRAAdapterError(
            f"{WEIGHTS_NAME}: {key}: LoRA on {module} is not supported (adaptable: {', '.join(LORA_MODULES)})"
        )
    if layer >= cfg.num_hidden_layers:
        raise LoRAAdapterError(
            f"{WEIGHTS_NAME}: {key}: layer {layer} but the model has {cfg.num_hidden_layers}"
        )
    if module == "v_proj" and cfg.layer_uses_k_as_v(layer) and layer < cfg.first_kv_shared_layer:
        raise LoRAAdapterError(
            f"{WEIGHTS_NAME}: {key}: layer {layer} takes V from the K projection (attention_k_eq_v): "
            "it has no v_proj"
        )
    name = key.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]
    return layer, module, match["ab"], name


__all__ = ["LoRAAdapter", "LoRAAdapterError", "load_peft_adapter"]
