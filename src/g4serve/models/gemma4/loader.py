"""Build a Gemma 4 model and fill it from a Hugging Face checkpoint directory or random weights.

Checkpoints are read memory-mapped from safetensors (one file, or shards listed in
``model.safetensors.index.json``) under their Hugging Face names. Missing, unexpected or
mis-shaped tensors and unreadable files raise ``CheckpointError`` naming them. The model is
built on the meta device and materialised once on the target device, so even 31B-sized
random-weight presets start in seconds on a GPU.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from g4serve.config import Gemma4Config
from g4serve.distributed import SINGLE, TensorParallel
from g4serve.distributed.sharding import ShardPlan
from g4serve.layers.moe import MoEExperts
from g4serve.layers.quant import QuantLinear
from g4serve.models.gemma4.kv_scales import is_kv_scale_name
from g4serve.models.gemma4.model import Gemma4Model
from g4serve.models.gemma4.quant_loader import (
    QuantLoadError,
    QuantPlan,
    load_quantized,
    plan_checkpoint,
    plan_quantize,
    swap_quantized_modules,
)
from g4serve.quant_config import QuantConfigError, quantization_preset

log = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

_SHARED_KV_PARAM = re.compile(r"^language_model\.layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.")


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded; the message names the file or tensors at fault."""


def resolve_dtype(name: str | torch.dtype, device: torch.device | str) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype: unknown dtype {name!r}; choose auto, {', '.join(sorted(DTYPES))}") from None


def build_model(
    cfg: Gemma4Config,
    dtype: torch.dtype,
    device: torch.device | str,
    with_vision: bool = True,
    with_audio: bool = True,
    plan_quantization: Callable[[Gemma4Model], QuantPlan] | None = None,
    tp: TensorParallel = SINGLE,
) -> Gemma4Model:
    """Allocate an uninitialised model directly on ``device`` (weights must be loaded or randomised next).
    ``plan_quantization``: which projections are quantized (``quant_loader``), decided on the meta model so
    that their dense weights are never allocated; the plan is kept as ``model.quant_plan``. ``tp``: the
    tensor-parallel group whose rank's shard to build."""
    with torch.device("meta"):
        model = Gemma4Model(cfg, with_vision=with_vision, with_audio=with_audio, tp=tp)
    model = model.to(dtype=dtype)
    plan = plan_quantization(model) if plan_quantization is not None else None
    if plan is not None:
        swap_quantized_modules(model, plan, dtype)
    model = model.to_empty(device=device)
    model.quant_plan = plan
    for module in model.modules():
        init = getattr(module, "init_nonpersistent_buffers", None)
        if init is not None:
            init()
    return model.eval().requires_grad_(False)


def _checkpoint_index(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> file holding it."""
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index_path}: not a valid safetensors index ({exc})") from exc
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(f"{index_path}: weight_map must map tensor names to shard file names")
        files = {name: model_dir / fname for name, fname in weight_map.items()}
        for path in set(files.values()):
            if not path.is_file():
                raise CheckpointError(f"{index_path}: lists shard {path.name}, which does not exist")
        return files
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise CheckpointError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")
    try:
        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{single}: not a valid safetensors file ({exc})") from exc


def local_name(hf_name: str) -> str | None:
    """Map a Hugging Face tensor name onto this model's names (None: not a model tensor)."""
    if hf_name == "lm_head.weight":
        return None  # tied to the input embeddings
    if hf_name.startswith("model.language_model."):
        return hf_name[len("model.") :]
    for tower in ("vision_tower", "audio_tower", "embed_vision", "embed_audio"):
        if hf_name.startswith(f"model.{tower}."):
            return hf_name[len("model.") :]
    if hf_name.startswith("model."):  # Gemma4ForCausalLM: model.layers..., model.embed_tokens...
        return "language_model." + hf_name[len("model.") :]
    return hf_name


def _skipped_towers(model: Gemma4Model) -> tuple[str, ...]:
    """Name prefixes of the towers this model was built without; their checkpoint tensors are ignored."""
    return tuple(
        prefix
        for prefix, module in (
            ("vision_tower.", model.vision_tower),
            ("embed_vision.", model.embed_vision),
            ("audio_tower.", model.audio_tower),
            ("embed_audio.", model.embed_audio),
        )
        if module is None
    )


def _tensors_by_file(
    model: Gemma4Model, model_dir: Path, files: dict[str, Path], params: dict[str, torch.Tensor]
) -> dict[Path, list[tuple[str, str]]]:
    """The checkpoint tensors to load, as (checkpoint name, parameter name) per file; tensors of absent
    towers and unused KV-shared projections are skipped, any other tensor the model lacks is an error."""
    first_shared = model.cfg.text.first_kv_shared_layer
    skipped_towers = _skipped_towers(model)
    by_file: dict[Path, list[tuple[str, str]]] = {}
    unexpected = []
    for hf_name, path in files.items():
        name = local_name(hf_name)
        if name is None or name.startswith(skipped_towers):
            continue
        match = _SHARED_KV_PARAM.match(name)
        if match and int(match.group(1)) >= first_shared:
            continue  # transformers keeps these for KV-shared layers, which never use them
        if model.quant_plan is not None and model.quant_plan.claims(name):
            continue  # quantized (or to be quantized): load_quantized reads it
        if is_kv_scale_name(name):
            continue  # FP8 KV-cache scales: the engine reads them (kv_scales.read_kv_scales) for an FP8 cache
        if name not in params:
            unexpected.append(hf_name)
            continue
        by_file.setdefault(path, []).append((hf_name, name))
    if unexpected:
        raise CheckpointError(f"{model_dir}: unexpected tensors not in this model: {_names(unexpected)}")
    return by_file


def load_weights(model: Gemma4Model, model_dir: str | Path, progress: bool | None = None) -> None:
    model_dir = Path(model_dir)
    files = _checkpoint_index(model_dir)
    params = dict(model.state_dict(keep_vars=True))
    by_file = _tensors_by_file(model, model_dir, files, params)
    loaded: set[str] = set()
    total = sum(len(v) for v in by_file.values())
    show = sys.stderr.isatty() if progress is None else progress
    with tqdm(total=total, desc="loading weights", unit="tensor", disable=not show) as bar:
        for path, entries in by_file.items():
            try:
                with safe_open(str(path), framework="pt") as f:
                    in_file = set(f.keys())
                    for hf_name, name in entries:
                        if hf_name not in in_file:
                            raise CheckpointError(
                                f"{path.name}: does not contain tensor {hf_name}, which "
                                "model.safetensors.index.json places there"
                            )
                        tensor = f.get_tensor(hf_name)
                        if model.shard_plan is not None:  # tensor parallel: this rank's slice
                            tensor = _sharded(model.shard_plan, path, hf_name, name, tensor, params[name])
                        _copy_checked(path, hf_name, tensor, params[name])
                        loaded.add(name)
                        bar.update(1)
            except (SafetensorError, OSError) as exc:
                raise CheckpointError(f"{path}: not a valid safetensors file ({exc})") from exc
    if model.quant_plan is not None:
        try:
            loaded |= load_quantized(model, model.quant_plan, files)
        except (QuantLoadError, SafetensorError, OSError) as exc:
            raise CheckpointError(f"{model_dir}: {exc}") from exc
    missing = sorted(set(params) - loaded)
    if missing:
        raise CheckpointError(f"{model_dir}: missing tensors: {_names(missing)}")


def _copy_checked(path: Path, hf_name: str, tensor: torch.Tensor, target: torch.Tensor) -> None:
    """Copy checkpoint tensor ``hf_name`` of file ``path`` into ``target`` after checking shape and dtype."""
    if tuple(tensor.shape) != tuple(target.shape):
        raise CheckpointError(
            f"{path.name}: tensor {hf_name} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
        )
    if target.is_floating_point() and not tensor.is_floating_point():
        # copy_ would silently turn integer or bool data into weights.
        raise CheckpointError(
            f"{path.name}: tensor {hf_name} has dtype {tensor.dtype}, expected a floating-point tensor"
        )
    with torch.no_grad():
        target.copy_(tensor)


def _sharded(
    plan: ShardPlan, path: Path, hf_name: str, name: str, tensor: torch.Tensor, target: torch.Tensor
) -> torch.Tensor:
    """Checkpoint tensor ``hf_name`` cut to this rank's slice, after checking its full shape."""
    full = plan.full_shape(name, target.shape)
    if tuple(tensor.shape) != full:
        shape = tuple(tensor.shape)
        raise CheckpointError(f"{path.name}: tensor {hf_name} has shape {shape}, expected {full}")
    return plan.take(name, tensor)


def _names(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


@torch.no_grad()
def init_random_weights(model: Gemma4Model, seed: int = 0, std: float = 0.02) -> None:
    """Seeded random weights for benchmarks and tiny checkpoints: N(0, std) matrices, unit norms/scales.

    Text q/k norm scales are set to head_dim**-0.25 each, so unscaled q·k has unit variance as in a
    trained model; with unit scales the scores would reach ~±50, every softmax would be one-hot and
    bf16 rounding alone would change the argmax of attention (and of the output) from layer to layer.
    """
    device = next(model.parameters()).device
    if device.type == "meta":
        return  # shapes only (memory planning, tests): there is no storage to fill
    gen = torch.Generator(device=device).manual_seed(seed)
    quantized = {
        n: m
        for n, m in model.named_modules()
        if isinstance(m, QuantLinear) or (isinstance(m, MoEExperts) and m.quantized)
    }
    plan = getattr(model, "shard_plan", None)  # an MTP drafter (models/gemma4/assistant.py) has none
    for name, tensor in model.state_dict(keep_vars=True).items():
        module, _, leaf = name.rpartition(".")
        if module in quantized and _init_quantized(quantized[module], leaf, gen, std, plan, name):
            continue
        shard = plan.shard(name) if plan is not None else None
        # tensor parallel: the single-GPU model's tensor (the same generator state and shape), then the rank's
        # slice, so every group size serves the same random model
        full = tensor if shard is None else tensor.new_empty(plan.full_shape(name, tensor.shape))
        if name.startswith("language_model.") and name.endswith(("q_norm.weight", "k_norm.weight")):
            full.fill_(full.shape[0] ** -0.25)
        elif full.ndim <= 1 and not leaf.startswith(("input_", "output_")):
            # norms, layer scalars, router scales, per-dim scales: neutral values
            full.fill_(0.0 if leaf == "per_dim_scale" else 1.0)
        elif leaf in ("input_min", "output_min"):
            full.fill_(-float("inf"))
        elif leaf in ("input_max", "output_max"):
            full.fill_(float("inf"))
        else:
            full.normal_(0.0, std, generator=gen)
        if shard is not None:
            tensor.copy_(shard.take(full))


def _init_quantized(
    module: QuantLinear | MoEExperts,
    leaf: str,
    gen: torch.Generator,
    std: float,
    plan: ShardPlan | None = None,
    name: str = "",
) -> bool:
    """A quantized weight gets the dense preset's draw for it (same generator state, shape and dtype),
    quantized; its scales and zero points are written with it. False: ``leaf`` is a dense tensor. ``plan``:
    tensor parallel, the draw is the single-GPU model's (``name``: the parameter's), cut to this rank."""
    device = gen.device

    def draw(shape: tuple[int, ...]) -> torch.Tensor:
        if plan is not None and plan.shard(name) is not None:
            full = torch.empty(
                plan.full_shape(name, torch.Size(shape)), dtype=module.compute_dtype, device=device
            )
            return plan.take(name, full.normal_(0.0, std, generator=gen))
        return torch.empty(shape, dtype=module.compute_dtype, device=device).normal_(0.0, std, generator=gen)

    if isinstance(module, QuantLinear):
        if leaf == "weight":
            module.quantize_from(draw((module.out_features, module.in_features)))
        return leaf != "bias"
    if leaf.endswith(("_scale", "_zero_point")):
        return True
    if module.quant.get(leaf) is None:
        return False  # a dense projection beside a quantized one
    # experts: each expert's gate and up quantized on their own scale grids
    module.quantize_from(leaf, draw(module.dense_shape(leaf)))
    return True


def load_model(
    model: str | Path,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    with_vision: bool = True,
    with_audio: bool = True,
    strict_config: bool = True,
    seed: int = 0,
    quantization: str | None = None,
    tp: TensorParallel = SINGLE,
) -> Gemma4Model:
    """Load a checkpoint directory, or a preset name (``tiny``, ``e4b``, ...) with seeded random weights.
    ``quantization``: a preset of ``quant_config.QUANTIZATION_PRESETS`` quantizing the dense weights at load
    (a compressed-tensors checkpoint is served as it is quantized). ``tp``: load this rank's shard."""
    torch_dtype = resolve_dtype(dtype, device)
    cfg = model_config(model, strict_config)
    if tp.size > 1 and cfg.quantization is not None:
        raise CheckpointError(
            "tensor_parallel_size: a quantized checkpoint's tensors are not sharded yet; serve its bf16 "
            "checkpoint with --quantization (each rank quantizes its slice), or one GPU"
        )
    model_dir = checkpoint_dir(model)
    if model_dir is None:  # a preset
        net = build_model(
            cfg,
            torch_dtype,
            device,
            with_vision,
            with_audio,
            _quant_planner(cfg, quantization, torch_dtype),
            tp,
        )
        init_random_weights(net, seed)
        return net
    planner = _quant_planner(cfg, quantization, torch_dtype, _checkpoint_index(model_dir))
    net = build_model(cfg, torch_dtype, device, with_vision, with_audio, planner, tp)
    load_weights(net, model_dir)
    log.info("loaded %s (%s, %s)", model_dir, torch_dtype, device)
    return net


def model_config(model: str | Path, strict_config: bool = True) -> Gemma4Config:
    """The config of a checkpoint directory or of a preset, without loading weights."""
    from g4serve.config import preset

    model_dir = checkpoint_dir(model)
    if model_dir is None:
        return preset(model)
    return Gemma4Config.from_pretrained(model_dir, strict=strict_config)


def _quant_planner(
    cfg: Gemma4Config, quantization: str | None, dtype: torch.dtype, files: dict[str, Path] | None = None
) -> Callable[[Gemma4Model], QuantPlan] | None:
    """How ``build_model`` finds the quantized projections: from a compressed-tensors checkpoint's tensors,
    or the projections a ``--quantization`` preset targets (None: a dense model)."""
    if quantization and cfg.quantization is not None:
        raise CheckpointError(
            f"quantization: the checkpoint is already quantized ({cfg.quantization.describe()}); "
            "leave --quantization unset"
        )
    if quantization:
        try:
            cfg.quantization = quantization_preset(quantization)
        except QuantConfigError as exc:
            raise CheckpointError(str(exc)) from None
        hf_names = {local_name(n): n for n in files or {}}

        def plan_dense(model: Gemma4Model) -> QuantPlan:
            plan = plan_quantize(model, cfg.quantization, dtype)
            for local, p in plan.modules.items():
                p.tensors = {
                    suffix: hf_names.get(f"{local}.{suffix}", hf) for suffix, hf in p.tensors.items()
                }
            return plan

        return plan_dense
    if cfg.quantization is None or files is None:
        return None

    def plan_compressed(model: Gemma4Model) -> QuantPlan:
        skipped = _skipped_towers(model)
        hf_to_local = {n: local_name(n) for n in files}
        hf_to_local = {
            n: loc for n, loc in hf_to_local.items() if loc is not None and not loc.startswith(skipped)
        }
        try:
            return plan_checkpoint(model, cfg.quantization, hf_to_local, _scale_dtypes(files))
        except QuantLoadError as exc:
            raise CheckpointError(str(exc)) from None

    return plan_compressed


def _scale_dtypes(files: dict[str, Path]) -> dict[str, str]:
    """Checkpoint dtype (safetensors' name) of every ``weight_scale`` tensor, read from the file headers."""
    dtypes = {}
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        if name.endswith(".weight_scale"):
            by_file.setdefault(path, []).append(name)
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for name in names:
                dtypes[name] = f.get_slice(name).get_dtype()
    return dtypes


def checkpoint_dir(model: str | Path) -> Path | None:
    """The checkpoint directory ``model`` names, or None when it names a preset (a directory of the same
    name wins); ``CheckpointError`` when it is neither."""
    from g4serve.config import PRESETS

    if Path(model).is_dir():
        return Path(model)
    if isinstance(model, str) and model in PRESETS and not Path(model).exists():
        return None
    raise CheckpointError(
        f"model: {model} is neither a checkpoint directory nor a preset ({', '.join(PRESETS)})"
    )


SPECIAL_TOKENS = ("image", "video", "audio", "boi", "eoi", "boa", "eoa")  # the config's <name>_token_id


def adopt_tokenizer_special_ids(cfg: Gemma4Config, tokenizer) -> None:
    """Random-weight presets borrow the embedded tokenizer: point the config's special ids at its tokens
    (``tokenizer``: a ``g4serve.processing.tokenizer.Tokenizer``)."""
    for attr in SPECIAL_TOKENS:
        setattr(cfg, f"{attr}_token_id", tokenizer.token_to_id(getattr(tokenizer, f"{attr}_token")))
    eos = {tokenizer.eos_token_id, tokenizer.token_to_id("<turn|>")} - {None}
    cfg.text.eos_token_id = sorted(eos)
