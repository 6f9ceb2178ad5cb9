"""Quantized weights at load: which modules are quantized, and how their tensors become ``QuantLinear``s.

A ``QuantPlan`` is made on the meta model before any memory is allocated. Its modules are filled in one of
three ways: ``checkpoint`` (a compressed-tensors checkpoint's FP8 / packed int4 tensors, converted to
``QuantLinear``'s layout), ``quantize`` (dense weights, from a checkpoint or random, quantized by g4serve's
own quantizer: ``--quantization``), ``dequantize`` (quantized tensors of a module the fast path keeps in
the model's dtype, such as a tower's projection: dequantized exactly into its weight), or ``expert`` (one
routed expert's gate / up / down projection, stored per expert: dequantized into its slice of the stacked
expert weights). Only the text decoder's ``nn.Linear`` projections become ``QuantLinear``: the MoE kernels
take bf16 experts, so a quantized 26B-A4B checkpoint's experts cost bf16 memory (a warning says how much).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from g4serve.kernels.quant_matmul import dequantize_reference, unpack_int4
from g4serve.layers.quant import QuantLinear
from g4serve.quant_config import FP8, INT4, QuantConfig, QuantScheme

# Tensor names compressed-tensors adds to a quantized module (besides FP8's ``weight``).
QUANT_SUFFIXES = (
    "weight_packed",
    "weight_scale",
    "weight_zero_point",
    "weight_shape",
    "weight_g_idx",
    "weight_global_scale",
    "input_scale",
    "input_zero_point",
    "input_global_scale",
    "output_scale",
)
log = logging.getLogger(__name__)
_SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F64": torch.float64,
}
# One routed expert's projection, as compressed-tensors checkpoints of MoE models store them
_EXPERT = re.compile(r"^(?P<experts>.*\.experts)\.(?P<index>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)$")


class QuantLoadError(ValueError):
    """Quantized tensors that cannot be loaded; the message names them (the loader re-raises it as a
    ``CheckpointError``)."""


@dataclass
class ModulePlan:
    hf_name: str  # the module's name in Hugging Face checkpoints
    scheme: QuantScheme | None  # None: a dense expert projection
    mode: str  # "checkpoint", "quantize", "dequantize" or "expert"
    scale_dtype: torch.dtype = torch.float32
    tensors: dict[str, str] = field(default_factory=dict)  # suffix -> checkpoint tensor name


@dataclass
class QuantPlan:
    config: QuantConfig
    modules: dict[str, ModulePlan]  # local module name -> plan

    def claims(self, local_tensor: str) -> bool:
        """Whether the loader leaves this (local) tensor to ``load_quantized``."""
        module, _, suffix = local_tensor.rpartition(".")
        plan = self.modules.get(module)
        if plan is None:
            return False
        return (
            suffix == "weight"
            or plan.mode == "expert"
            or (plan.mode != "quantize" and suffix in QUANT_SUFFIXES)
        )


def _module_of(name: str) -> tuple[str, str]:
    module, _, suffix = name.rpartition(".")
    return module, suffix


def plan_checkpoint(
    model: nn.Module, config: QuantConfig, hf_to_local: dict[str, str], dtypes: dict[str, str]
) -> QuantPlan:
    """The plan of a compressed-tensors checkpoint: every module with quantization tensors (``hf_to_local``:
    checkpoint tensor -> local name, None-free; ``dtypes``: checkpoint tensor -> safetensors dtype)."""
    modules = dict(model.named_modules())
    plans: dict[str, ModulePlan] = {}
    for hf_tensor, local in hf_to_local.items():
        hf_module, suffix = _module_of(hf_tensor)
        if _EXPERT.match(_module_of(local)[0]):
            _plan_expert(plans, config, hf_tensor, local, dtypes)
            continue
        if suffix not in QUANT_SUFFIXES:
            continue
        local_module = _module_of(local)[0]
        module = modules.get(local_module)
        if module is None or not isinstance(getattr(module, "weight", None), torch.Tensor):
            raise QuantLoadError(
                f"{hf_tensor}: {hf_module} is quantized, but this model has no such projection (Gemma 4 ties "
                "the LM head to the embeddings: keep lm_head in the checkpoint's ignore list)"
            )
        plan = plans.get(local_module)
        if plan is None:
            scheme = config.scheme_for(hf_module, isinstance(module, nn.Linear))
            if scheme is None:
                raise QuantLoadError(
                    f"{hf_tensor}: {hf_module} has quantization tensors, but no config group of "
                    "quantization_config targets it (or ignore lists it)"
                )
            decoder = local_module.startswith("language_model.") and isinstance(module, nn.Linear)
            plan = plans[local_module] = ModulePlan(
                hf_module, scheme, "checkpoint" if decoder else "dequantize"
            )
            plan.tensors["weight"] = f"{hf_module}.weight"
        plan.tensors[suffix] = hf_tensor
        if suffix == "weight_scale":
            plan.scale_dtype = _SAFETENSORS_DTYPES.get(dtypes.get(hf_tensor, "F32"), torch.float32)
    _check_experts(modules, plans)
    return QuantPlan(config, plans)


def _plan_expert(plans: dict, config: QuantConfig, hf_tensor: str, local: str, dtypes: dict) -> None:
    hf_module, suffix = _module_of(hf_tensor)
    local_module = _module_of(local)[0]
    plan = plans.get(local_module)
    if plan is None:
        plan = plans[local_module] = ModulePlan(hf_module, None, "expert")
    plan.tensors[suffix] = hf_tensor
    if suffix in QUANT_SUFFIXES and plan.scheme is None:
        plan.scheme = config.scheme_for(hf_module)
        if plan.scheme is None:
            raise QuantLoadError(
                f"{hf_tensor}: {hf_module} has quantization tensors, but no config group of "
                "quantization_config targets it (or ignore lists it)"
            )


def _check_experts(modules: dict[str, nn.Module], plans: dict[str, ModulePlan]) -> None:
    """Every expert of a block stored per expert must be there, with all three projections."""
    found: dict[str, set[tuple[int, str]]] = {}
    for local, p in plans.items():
        if p.mode == "expert":
            m = _EXPERT.match(local)
            found.setdefault(m["experts"], set()).add((int(m["index"]), m["proj"]))
    if found:
        log.warning(
            "%d MoE blocks hold per-expert (quantized) projections: dequantized to the model's dtype at load "
            "(the fused MoE kernels take dense experts)",
            len(found),
        )
    for experts, have in found.items():
        block = modules.get(experts)
        if block is None or not hasattr(block, "gate_up_proj"):
            raise QuantLoadError(f"{experts}: per-expert tensors, but this model has no such MoE block")
        want = {(e, proj) for e in range(block.num_experts) for proj in ("gate_proj", "up_proj", "down_proj")}
        if have != want:
            missing = sorted(want - have)[:4]
            raise QuantLoadError(f"{experts}: expert projections missing or unexpected (e.g. {missing})")


def plan_quantize(model: nn.Module, config: QuantConfig, dtype: torch.dtype) -> QuantPlan:
    """The plan of ``--quantization``: the text decoder's ``nn.Linear`` projections the preset targets."""
    plans = {}
    for name, module in model.named_modules():
        if not (name.startswith("language_model.") and isinstance(module, nn.Linear)):
            continue
        scheme = config.scheme_for(f"model.{name}")
        if scheme is not None:
            scale_dtype = torch.float32 if scheme.weights.kind == FP8 else dtype
            plans[name] = ModulePlan(f"model.{name}", scheme, "quantize", scale_dtype)
    return QuantPlan(config, plans)


def swap_quantized_modules(model: nn.Module, plan: QuantPlan, dtype: torch.dtype) -> None:
    """Replace the planned ``nn.Linear``s by ``QuantLinear``s (on the meta device, before allocation)."""
    for name, p in plan.modules.items():
        if p.mode in ("dequantize", "expert"):
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, attr)
        q = QuantLinear(
            linear.in_features,
            linear.out_features,
            p.scheme.weights,
            p.scheme.activations,
            bias=linear.bias is not None,
            scale_dtype=p.scale_dtype,
            device=linear.weight.device,
            compute_dtype=dtype,
        )
        setattr(parent, attr, q)


# ---- loading ------------------------------------------------------------------------------------------
def _required(plan: ModulePlan) -> set[str]:
    w = plan.scheme.weights
    names = {"weight_scale"} | ({"weight"} if w.kind == FP8 else {"weight_packed", "weight_shape"})
    if w.kind == INT4 and not w.symmetric:
        names.add("weight_zero_point")
    if plan.scheme.activations is not None and not plan.scheme.activations.dynamic:
        names.add("input_scale")
    return names


def _layout(plan: ModulePlan, t: dict[str, torch.Tensor], n: int, k: int):
    """Checkpoint tensors -> (weight, scale, zero points, input scale) in ``QuantLinear``'s layout."""
    w = plan.scheme.weights
    block = w.scale_block(n, k)
    grid = (-(-n // block[0]), -(-k // block[1]))
    name = plan.hf_name
    if "weight_g_idx" in t:
        raise QuantLoadError(f"{name}.weight_g_idx: activation-ordered groups (g_idx) are not supported")
    if w.kind == FP8:
        weight = _checked(t["weight"], f"{name}.weight", (n, k), torch.float8_e4m3fn)
    else:
        shape = t["weight_shape"].flatten().tolist()
        if shape != [n, k]:
            raise QuantLoadError(f"{name}.weight_shape: is {shape}, expected {[n, k]}")
        weight = _checked(t["weight_packed"], f"{name}.weight_packed", (n, -(-k // 8)), torch.int32)
    scale = t["weight_scale"]
    if scale.numel() != grid[0] * grid[1] or (scale.dim() == 2 and tuple(scale.shape) != grid):
        raise QuantLoadError(
            f"{name}.weight_scale: has shape {tuple(scale.shape)}, expected {grid} ({w.strategy})"
        )
    if not scale.is_floating_point():
        raise QuantLoadError(f"{name}.weight_scale: has dtype {scale.dtype}, expected a float")
    zero = None
    if "weight_zero_point" in t and w.kind == INT4 and not w.symmetric:
        packed = _checked(
            t["weight_zero_point"], f"{name}.weight_zero_point", (-(-n // 8), grid[1]), torch.int32
        )
        zero = unpack_int4(packed.t().contiguous(), n).t().contiguous()  # packed along N (compressed-tensors)
    input_scale = t.get("input_scale")
    if input_scale is not None and input_scale.numel() != 1:
        raise QuantLoadError(f"{name}.input_scale: static activation scales must be per tensor (one value)")
    return weight, scale.reshape(grid), zero, input_scale


def _checked(t: torch.Tensor, name: str, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    if tuple(t.shape) != shape or t.dtype != dtype:
        raise QuantLoadError(f"{name}: is {t.dtype} {tuple(t.shape)}, expected {dtype} {shape}")
    return t


def _fill(module: nn.Module, plan: ModulePlan, tensors: dict[str, torch.Tensor]) -> None:
    if plan.mode == "quantize":
        module.quantize_from(tensors["weight"])
        return
    if isinstance(module, QuantLinear):
        n, k = module.out_features, module.in_features
    else:
        n, k = module.weight.shape
    weight, scale, zero, input_scale = _layout(plan, tensors, n, k)
    if isinstance(module, QuantLinear):
        module.weight.copy_(weight)
        module.weight_scale.copy_(scale)
        if zero is not None:
            module.weight_zero_point.copy_(zero)
        if module.input_scale is not None:
            module.input_scale.copy_(input_scale.float().reshape(1))
        return
    block = plan.scheme.weights.scale_block(n, k)
    module.weight.copy_(dequantize_reference(weight, scale, block, k, zero, module.weight.dtype))


def _fill_expert(
    model: nn.Module, local: str, plan: ModulePlan, tensors: dict[str, torch.Tensor]
) -> set[str]:
    """One expert's projection into its slice of the stacked weights: gate_up_proj [E, 2I, H] (gate rows
    first), down_proj [E, H, I]."""
    m = _EXPERT.match(local)
    experts, e, proj = model.get_submodule(m["experts"]), int(m["index"]), m["proj"]
    inter = experts.down_proj.shape[2]
    if proj == "down_proj":
        target = experts.down_proj[e]
    else:
        target = experts.gate_up_proj[e, :inter] if proj == "gate_proj" else experts.gate_up_proj[e, inter:]
    n, k = target.shape
    if plan.scheme is None:
        dense = tensors.get("weight")
        if dense is None or tuple(dense.shape) != (n, k) or not dense.is_floating_point():
            raise QuantLoadError(f"{plan.hf_name}.weight: expected a float tensor of shape {(n, k)}")
    else:
        weight, scale, zero, _ = _layout(plan, tensors, n, k)
        block = plan.scheme.weights.scale_block(n, k)
        dense = dequantize_reference(weight, scale, block, k, zero, target.dtype)
    target.copy_(dense)
    return {f"{m['experts']}.gate_up_proj" if proj != "down_proj" else f"{m['experts']}.down_proj"}


def _reads(plan: QuantPlan, files: dict[str, Path]) -> dict[Path, list[tuple[str, str, str]]]:
    """(local module, suffix, checkpoint tensor) to read, per file."""
    by_file: dict[Path, list[tuple[str, str, str]]] = {}
    for local, p in plan.modules.items():
        if p.mode == "quantize":
            wanted = {"weight": p.tensors.get("weight", f"{p.hf_name}.weight")}
        elif p.mode == "expert" or p.scheme is None:
            wanted = dict(p.tensors)
            if p.scheme is not None and sorted(_required(p) - set(wanted)):
                raise QuantLoadError(
                    f"{p.hf_name}: missing quantization tensors {', '.join(_required(p) - set(wanted))}"
                )
        else:
            wanted = dict(p.tensors)
            if p.scheme.weights.kind == INT4:
                wanted.pop("weight", None)  # pack-quantized: weight_packed instead
            missing = sorted(_required(p) - set(wanted))
            if missing:
                raise QuantLoadError(f"{p.hf_name}: missing quantization tensors {', '.join(missing)}")
        for suffix, hf in wanted.items():
            if hf not in files:
                raise QuantLoadError(f"{hf}: missing from the checkpoint")
            by_file.setdefault(files[hf], []).append((local, suffix, hf))
    return by_file


@torch.no_grad()
def load_quantized(model: nn.Module, plan: QuantPlan, files: dict[str, Path]) -> set[str]:
    """Fill every planned module from the checkpoint; returns the local parameter names it filled."""
    by_file = _reads(plan, files)
    counts: dict[str, int] = {}
    for entries in by_file.values():
        for local, _, _ in entries:
            counts[local] = counts.get(local, 0) + 1
    gathered: dict[str, dict[str, torch.Tensor]] = {}
    filled: set[str] = set()
    for path, entries in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for local, suffix, hf in entries:
                gathered.setdefault(local, {})[suffix] = f.get_tensor(hf)
                if len(gathered[local]) != counts[local]:
                    continue
                # the module's last tensor: convert it now
                if plan.modules[local].mode == "expert":
                    filled |= _fill_expert(model, local, plan.modules[local], gathered.pop(local))
                    continue
                module = model.get_submodule(local)
                _fill(module, plan.modules[local], gathered.pop(local))
                filled.update(f"{local}.{n}" for n, _ in module.named_parameters(recurse=False))
    return filled


__all__ = [
    "QUANT_SUFFIXES",
    "ModulePlan",
    "QuantLoadError",
    "QuantPlan",
    "load_quantized",
    "plan_checkpoint",
    "plan_quantize",
    "swap_quantized_modules",
]
