"""Quantized weights at load: which modules are quantized, and how their tensors become ``QuantLinear``s
and quantized MoE experts.

A ``QuantPlan`` is made on the meta model before any memory is allocated. Its modules are filled in one of
these ways: ``checkpoint`` (a compressed-tensors checkpoint's FP8 / packed int4 tensors, converted to
``QuantLinear``'s layout), ``quantize`` (dense weights, from a checkpoint or random, quantized by g4serve's
own quantizer: ``--quantization``; a routed-experts block's stacked ``gate_up_proj`` / ``down_proj`` too),
``dequantize`` (quantized tensors of a module the fast path keeps in the model's dtype, such as a tower's
projection: dequantized exactly into its weight), or ``expert`` (one routed expert's gate / up / down
projection, stored per expert: copied into its slices of the block's stacked quantized weights, gate and up
of expert e as rows [gate; up] of ``gate_up_proj[e]``). A block whose experts are quantized is kept
quantized (``MoEExperts`` with ``quant``; plan mode ``experts``) when each stacked projection has one scheme
over all its experts, which ``kernels/fused_moe.py`` dequantizes in registers; otherwise (experts or gate /
up quantized differently) that projection is dequantized to the model's dtype at load, with a warning.
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
from g4serve.layers.moe import PROJECTIONS, MoEExperts
from g4serve.layers.quant import QuantLinear
from g4serve.quant_config import FP8, INT4, QuantConfig, QuantScheme, WeightQuant

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
    scheme: QuantScheme | None  # None: a dense expert projection, or a block of experts from a checkpoint
    mode: str  # "checkpoint", "quantize", "dequantize", "expert" or "experts"
    scale_dtype: torch.dtype = torch.float32
    tensors: dict[str, str] = field(default_factory=dict)  # suffix -> checkpoint tensor name
    # A routed-experts block: how each stacked projection is kept (``MoEExperts``' ``quant``; None: dense)
    expert_quant: dict[str, WeightQuant | None] | None = None


@dataclass
class QuantPlan:
    config: QuantConfig
    modules: dict[str, ModulePlan]  # local module name -> plan

    def claims(self, local_tensor: str) -> bool:
        """Whether the loader leaves this (local) tensor to ``load_quantized``."""
        module, _, suffix = local_tensor.rpartition(".")
        plan = self.modules.get(module)
        if plan is None or plan.mode == "experts":  # "experts": filled by its per-expert projections
            return False
        if plan.mode == "quantize":
            return suffix in plan.tensors
        return suffix == "weight" or plan.mode == "expert" or suffix in QUANT_SUFFIXES


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
    _plan_expert_blocks(modules, plans)
    return QuantPlan(config, plans)


def _plan_expert(plans: dict, config: QuantConfig, hf_tensor: str, local: str, dtypes: dict) -> None:
    hf_module, suffix = _module_of(hf_tensor)
    local_module = _module_of(local)[0]
    plan = plans.get(local_module)
    if plan is None:
        plan = plans[local_module] = ModulePlan(hf_module, None, "expert")
    plan.tensors[suffix] = hf_tensor
    if suffix == "weight_scale":
        plan.scale_dtype = _SAFETENSORS_DTYPES.get(dtypes.get(hf_tensor, "F32"), torch.float32)
    if suffix in QUANT_SUFFIXES and plan.scheme is None:
        plan.scheme = config.scheme_for(hf_module)
        if plan.scheme is None:
            raise QuantLoadError(
                f"{hf_tensor}: {hf_module} has quantization tensors, but no config group of "
                "quantization_config targets it (or ignore lists it)"
            )


def _plan_expert_blocks(modules: dict[str, nn.Module], plans: dict[str, ModulePlan]) -> None:
    """Every expert of a block stored per expert must be there, with all three projections; each block gets
    an ``experts`` plan saying which of its stacked projections stay quantized (one scheme over all the
    experts' parts) and which are dequantized at load."""
    found: dict[str, dict[tuple[int, str], ModulePlan]] = {}
    for local, p in plans.items():
        if p.mode == "expert":
            m = _EXPERT.match(local)
            found.setdefault(m["experts"], {})[(int(m["index"]), m["proj"])] = p
    dequantized = 0
    for experts, have in found.items():
        block = modules.get(experts)
        if not isinstance(block, MoEExperts):
            raise QuantLoadError(f"{experts}: per-expert tensors, but this model has no such MoE block")
        want = {(e, proj) for e in range(block.num_experts) for proj in ("gate_proj", "up_proj", "down_proj")}
        if set(have) != want:
            missing = sorted(want - set(have))[:4]
            raise QuantLoadError(f"{experts}: expert projections missing or unexpected (e.g. {missing})")
        quant: dict[str, WeightQuant | None] = {}
        for stacked, parts in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
            schemes = {
                p.scheme.weights if p.scheme else None for (_, proj), p in have.items() if proj in parts
            }
            quant[stacked] = schemes.pop() if len(schemes) == 1 else None
            dequantized += len(schemes) > 0 and quant[stacked] is None
        scale_dtypes = {p.scale_dtype for p in have.values() if p.scheme is not None}
        scale_dtype = scale_dtypes.pop() if len(scale_dtypes) == 1 else torch.float32
        hf_block = next(iter(have.values())).hf_name.rsplit(".", 2)[0]
        plans[experts] = ModulePlan(hf_block, None, "experts", scale_dtype, expert_quant=quant)
    if dequantized:
        log.warning(
            "%d stacked MoE expert projections are quantized with differing schemes across their experts (or "
            "gate and up): dequantized to the model's dtype at load, which costs its memory (the fused MoE "
            "kernel takes one scheme per stacked projection)",
            dequantized,
        )


def plan_quantize(model: nn.Module, config: QuantConfig, dtype: torch.dtype) -> QuantPlan:
    """The plan of ``--quantization``: the text decoder's ``nn.Linear`` projections and routed-experts
    blocks the preset targets (``tensors``: the dense tensors each reads, by their default HF names)."""
    plans = {}
    for name, module in model.named_modules():
        experts = isinstance(module, MoEExperts)
        if not (name.startswith("language_model.") and (experts or isinstance(module, nn.Linear))):
            continue
        hf_name = f"model.{name}"
        scheme = config.scheme_for(hf_name, is_linear=not experts)
        if scheme is None:
            continue
        scale_dtype = torch.float32 if scheme.weights.kind == FP8 else dtype
        plan = plans[name] = ModulePlan(hf_name, scheme, "quantize", scale_dtype)
        if experts:
            plan.expert_quant = dict.fromkeys(PROJECTIONS, scheme.weights)
            plan.tensors = {proj: f"{hf_name}.{proj}" for proj in PROJECTIONS}
        else:
            plan.tensors = {"weight": f"{hf_name}.weight"}
    return QuantPlan(config, plans)


def swap_quantized_modules(model: nn.Module, plan: QuantPlan, dtype: torch.dtype) -> None:
    """Replace the planned ``nn.Linear``s by ``QuantLinear``s, and routed-experts blocks by quantized
    ``MoEExperts`` (on the meta device, before allocation: no dense copy of a quantized weight exists)."""
    for name, p in plan.modules.items():
        if p.mode in ("dequantize", "expert"):
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        if p.expert_quant is not None:
            if any(q is not None for q in p.expert_quant.values()):
                setattr(parent, attr, _quantized_experts(getattr(parent, attr), p, dtype))
            continue
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


def _quantized_experts(dense: MoEExperts, plan: ModulePlan, dtype: torch.dtype) -> MoEExperts:
    return MoEExperts(
        dense.num_experts,
        dense.hidden,
        dense.intermediate,
        dense.activation,
        quant=plan.expert_quant,
        scale_dtype=plan.scale_dtype,
        compute_dtype=dtype,
        device=dense.gate_up_proj.device,
    )


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
    if plan.mode == "quantize" and isinstance(module, MoEExperts):
        for name, dense in tensors.items():
            expected = module.dense_shape(name)
            if tuple(dense.shape) != expected or not dense.is_floating_point():
                raise QuantLoadError(f"{plan.tensors[name]}: expected a float tensor of shape {expected}")
            module.quantize_from(name, dense)
        return
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
    first), down_proj [E, H, I]; quantized as it is stored where the block keeps that projection quantized,
    else dequantized to the block's dtype."""
    m = _EXPERT.match(local)
    experts, e, proj = model.get_submodule(m["experts"]), int(m["index"]), m["proj"]
    stacked = "down_proj" if proj == "down_proj" else "gate_up_proj"
    filled = {f"{m['experts']}.{name}" for name, _ in experts.named_parameters() if name.startswith(stacked)}
    inter, hidden = experts.intermediate, experts.hidden
    n, k = (hidden, inter) if proj == "down_proj" else (inter, hidden)
    if experts.quant[stacked] is not None:
        assert plan.scheme is not None and plan.scheme.weights == experts.quant[stacked]
        # a static input_scale goes unused: the experts run weight-only (activations in the model's dtype)
        weight, scale, zero, _ = _layout(plan, tensors, n, k)
        experts.fill_expert(stacked, e, int(proj == "up_proj"), weight, scale, zero)
        return filled
    if proj == "down_proj":
        target = experts.down_proj[e]
    else:
        target = experts.gate_up_proj[e, :inter] if proj == "gate_proj" else experts.gate_up_proj[e, inter:]
    if plan.scheme is None:
        dense = tensors.get("weight")
        if dense is None or tuple(dense.shape) != (n, k) or not dense.is_floating_point():
            raise QuantLoadError(f"{plan.hf_name}.weight: expected a float tensor of shape {(n, k)}")
    else:
        weight, scale, zero, _ = _layout(plan, tensors, n, k)
        block = plan.scheme.weights.scale_block(n, k)
        dense = dequantize_reference(weight, scale, block, k, zero, target.dtype)
    target.copy_(dense)
    return filled


def _reads(plan: QuantPlan, files: dict[str, Path]) -> dict[Path, list[tuple[str, str, str]]]:
    """(local module, suffix, checkpoint tensor) to read, per file."""
    by_file: dict[Path, list[tuple[str, str, str]]] = {}
    for local, p in plan.modules.items():
        if p.mode == "experts":
            continue  # filled by its per-expert projections
        if p.mode == "quantize":
            wanted = dict(p.tensors) or {"weight": f"{p.hf_name}.weight"}
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
    shards = getattr(model, "shard_plan", None)  # tensor parallel: quantize this rank's slice
    for path, entries in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for local, suffix, hf in entries:
                tensor = f.get_tensor(hf)
                if shards is not None and plan.modules[local].mode == "quantize":
                    tensor = shards.take(f"{local}.{suffix}", tensor)
                gathered.setdefault(local, {})[suffix] = tensor
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
