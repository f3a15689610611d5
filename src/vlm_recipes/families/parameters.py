"""A model's parameters by role (a family says which module paths each role holds), and what LoRA adapts in
each: its linear layers, and a mixture-of-experts block's fused expert weights where named."""

from __future__ import annotations

import torch
from torch import nn

from vlm_recipes.errors import LoraTargetError
from vlm_recipes.families.base import Family
from vlm_recipes.roles import ROLES


def _unwrap_name(name: str) -> str:
    """Strip PEFT's wrapper prefix so names match the adapter's table."""
    return name.removeprefix("base_model.model.")


def params_by_role(model: nn.Module, family: Family) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """Parameters grouped by role (plus `other` for anything outside every role, e.g. LoRA-free extras)."""
    groups: dict[str, list[tuple[str, nn.Parameter]]] = {role: [] for role in (*ROLES, "other")}
    for name, param in model.named_parameters():
        groups[family.role_of(_unwrap_name(name)) or "other"].append((name, param))
    return groups


def linear_modules_of_role(model: nn.Module, family: Family, role: str) -> list[str]:
    """Names of the linear layers (quantized ones included) a LoRA on `role` adapts; lm_head excluded."""
    names = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and family.role_of(name) == role and not family.is_lm_head(name):
            names.append(name)
    return names


def expert_parameters_of_role(model: nn.Module, family: Family, role: str) -> list[str]:
    """Names of a role's fused expert weights: the 3-D parameters of a mixture-of-experts block
    (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`, one [experts, out, in] tensor each), not
    `nn.Linear`, so LoRA adapts them only through PEFT's `target_parameters`, and bitsandbytes leaves
    them unquantized."""
    return [
        name
        for name, param in model.named_parameters()
        if param.dim() == 3 and ".experts." in name and family.role_of(_unwrap_name(name)) == role
    ]


def routed_experts(text_config) -> int | None:
    """A mixture-of-experts language model's routed experts (None: a dense one). Qwen's and Gemma 4's configs
    name them `num_experts`; GLM-4.5V's (DeepSeek's naming) `n_routed_experts`."""
    return getattr(text_config, "num_experts", None) or getattr(text_config, "n_routed_experts", None)


def _matches(name: str, suffixes: list[str]) -> bool:
    """`name` ends with one of `suffixes` at a dot, or (a parameter) its module does: `experts` names both
    of a block's expert weights."""
    module = name.rsplit(".", 1)[0]
    return any(n == s or n.endswith("." + s) for s in suffixes for n in (name, module))


def lora_target_modules(model: nn.Module, family: Family, lora_roles: dict[str, list[str]]) -> list[str]:
    """Full module names for PEFT's `target_modules`.


    `lora_roles` maps each role in lora mode to the suffixes to adapt (empty: all its linear layers, as
    LLaMA-Factory's `all`: a mixture-of-experts block's fused experts only when named, `experts`).
    Full names keep a suffix like `proj` from catching layers of a role that is not in lora mode."""
    targets: list[str] = []
    for role, suffixes in lora_roles.items():
        linear = linear_modules_of_role(model, family, role)
        experts = expert_parameters_of_role(model, family, role)
        if suffixes:
            linear = [n for n in linear if _matches(n, suffixes)]
            experts = [n for n in experts if _matches(n, suffixes)]
        if not linear and not (suffixes and experts):
            wanted = ", ".join(suffixes) if suffixes else "any linear layer"
            names = sorted({n.rsplit(".", 1)[-1] for n in linear_modules_of_role(model, family, role)})
            fused = (
                " Its fused expert weights: experts."
                if expert_parameters_of_role(model, family, role)
                else ""
            )
            raise LoraTargetError(
                f"lora.targets.{role}: no module of `{role}` matches {wanted}. Its linear layers end with: "
                f"{', '.join(names) or 'none'}.{fused}"
            )
        targets.extend(linear)
    return targets


def lora_target_parameters(model: nn.Module, family: Family, lora_roles: dict[str, list[str]]) -> list[str]:
    """Full parameter names for PEFT's `target_parameters`: the fused expert weights a role's
    `lora.targets` names (`experts`, or `gate_up_proj` / `down_proj`). PEFT adds a LoRA per expert
    beside the frozen 3-D weight (lora_A [rank x experts, in], lora_B [out, rank x experts])."""
    return [
        name
        for role, suffixes in lora_roles.items()
        if suffixes
        for name in expert_parameters_of_role(model, family, role)
        if _matches(name, suffixes)
    ]


def count_params_by_role(model: nn.Module, family: Family) -> dict[str, dict[str, int]]:
    """Total and trainable parameter counts per role (4-bit weights counted as stored elements × 2)."""
    counts = {}
    for role, params in params_by_role(model, family).items():
        total = sum(stored_numel(p) for _, p in params)
        trainable = sum(stored_numel(p) for _, p in params if p.requires_grad)
        counts[role] = {"total": total, "trainable": trainable}
    return counts


def stored_numel(param: torch.Tensor) -> int:
    # bitsandbytes packs two 4-bit values per uint8 element.
    if param.dtype == torch.uint8 and hasattr(param, "quant_state"):
        return param.numel() * 2
    return param.numel()
