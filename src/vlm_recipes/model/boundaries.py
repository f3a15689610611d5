"""The dtype-boundary guard: where roles of different dtypes meet, what crosses is cast to the receiver's.

A stage keeps trained weights in fp32 (master weights) and frozen ones in the compute dtype (bf16 on every
GPU and on CPUs with native bf16). Autocast runs the matmuls in bf16 either way, but not everything:
a frozen bf16 layer norm fed by a trained fp32 layer stops (`mixed dtype (CPU): expect parameter to have
scalar type of Float`), SmolVLM scatters fp32 image features into bf16 embeddings (`masked_scatter:
expected self and source to have same dtypes`) because it casts them to `self.dtype`, the first
parameter's, and without autocast (a user's own `generate()`) every fp32 -> bf16 matmul stops.

The family says where its roles meet (`Family.dtype_boundaries`); this guard decides the dtype of each
crossing from the weights actually loaded (pure: `decide_dtype_boundaries`), and installs one forward hook
per crossing (`install_dtype_boundaries`). A cast to the dtype a tensor already has is free, so crossings
between roles of one dtype cost nothing. The hooks hold with autocast on and off, in training, in
evaluation's `generate()` and in DPO's reference pass (the same modules, adapters switched off).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from vlm_recipes.decisions import Decision, dtype_name
from vlm_recipes.errors import GuardError
from vlm_recipes.families.base import DtypeBoundary, Family
from vlm_recipes.families.parameters import _unwrap_name


def modules_by_path(model: nn.Module) -> dict[str, nn.Module]:
    """Every module by its path in the model as loaded (a PEFT wrapper's prefix removed)."""
    return {_unwrap_name(name): module for name, module in model.named_modules()}


def weights_dtype(module: nn.Module) -> torch.dtype | None:
    """The dtype a module computes in: its first floating weight that is not a LoRA adapter's (adapters are
    fp32 beside a bf16 or 4-bit base, and PEFT casts their input itself). None: no floating weight."""
    for name, param in module.named_parameters():
        if param.is_floating_point() and "lora_" not in name:
            return param.dtype
    return None


def crossing_dtypes(boundaries: Iterable[DtypeBoundary], modules: dict[str, nn.Module]) -> list[torch.dtype]:
    """The dtype each crossing is cast to: that of `dtype_of`'s weights, or the receiving module's."""
    dtypes = []
    for boundary in boundaries:
        path = boundary.dtype_of or boundary.module
        for needed in (boundary.module, path):
            if needed not in modules:
                raise GuardError(
                    f"dtype boundary `{boundary.crossing}`: the model has no module `{needed}`; the family "
                    "module's dtype_boundaries do not match this checkpoint's module names"
                )
        dtype = weights_dtype(modules[path])
        if dtype is None:
            raise GuardError(f"dtype boundary `{boundary.crossing}`: `{path}` has no floating weight to read")
        dtypes.append(dtype)
    return dtypes


def decide_dtype_boundaries(
    boundaries: list[DtypeBoundary], dtypes: list[torch.dtype], role_dtypes: dict[str, str]
) -> Decision:
    """Pure: the crossings, each with the dtype it is cast to, and the roles' dtypes that make it needed."""
    crossings = "; ".join(
        f"{b.crossing} in {dtype_name(d)}" + (f" ({b.why})" if b.why else "")
        for b, d in zip(boundaries, dtypes, strict=True)
    )
    roles = ", ".join(f"{role} {dtype}" for role, dtype in role_dtypes.items())
    mixed = len(set(role_dtypes.values())) > 1
    choice = f"{len(boundaries)} crossing(s) cast to the receiver's dtype"
    why = f"roles hold {roles}" + (": where they meet one dtype must win" if mixed else "; casts are no-ops")
    return Decision("dtype-boundary", choice, f"{crossings}; {why}")


def role_dtypes(model: nn.Module, family: Family) -> dict[str, str]:
    """Per role, the dtypes of its floating base weights (not LoRA adapters), e.g. {'vision': 'fp32'}."""
    found: dict[str, set[str]] = {}
    for name, param in model.named_parameters():
        if not param.is_floating_point() or "lora_" in name:
            continue
        role = family.role_of(_unwrap_name(name)) or "other"
        found.setdefault(role, set()).add(dtype_name(param.dtype))
    return {role: "+".join(sorted(d)) for role, d in found.items()}


def install_dtype_boundaries(model: nn.Module, family: Family) -> Decision:
    """One forward hook per crossing the family declares, casting to the dtype of the receiver's weights
    (or `dtype_of`'s) as they are when it runs: the weights now loaded (run after the dtype guards), or the
    ones FSDP's mixed precision gathers in bf16 for the step. Returns the decision (from the weights now
    loaded), for the log and report.json."""
    boundaries = family.dtype_boundaries()
    modules = modules_by_path(model)
    dtypes = crossing_dtypes(boundaries, modules)
    for boundary, dtype in zip(boundaries, dtypes, strict=True):
        receiver = modules[boundary.module]
        source = modules[boundary.dtype_of or boundary.module]
        # a list of modules (Qwen3-VL's DeepStack mergers) is never called itself: each member receives
        for module in receiver if isinstance(receiver, nn.ModuleList) else [receiver]:
            if boundary.side == "output":
                module.register_forward_hook(_cast_output(source, dtype))
            else:
                module.register_forward_pre_hook(
                    _cast_inputs(source, dtype, boundary.inputs), with_kwargs=True
                )
    return decide_dtype_boundaries(boundaries, dtypes, role_dtypes(model, family))


def _cast(value, dtype: torch.dtype):
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
        return value.to(dtype)
    return value


def _dtype_now(source: nn.Module, loaded: torch.dtype) -> torch.dtype:
    """The dtype `source` computes in at this call: under FSDP2 its weights are the gathered ones, in the
    mixed-precision policy's dtype (bf16 for all roles), not the fp32 / bf16 mix they were loaded in."""
    return weights_dtype(source) or loaded


def _cast_inputs(source: nn.Module, loaded: torch.dtype, names: tuple[str, ...]):
    def hook(module, args, kwargs):
        dtype = _dtype_now(source, loaded)
        if names:
            return args, {k: _cast(v, dtype) if k in names else v for k, v in kwargs.items()}
        return tuple(_cast(a, dtype) for a in args), {k: _cast(v, dtype) for k, v in kwargs.items()}

    return hook


def _cast_output(source: nn.Module, loaded: torch.dtype):
    def hook(module, args, output):
        return _cast(output, _dtype_now(source, loaded))

    return hook
