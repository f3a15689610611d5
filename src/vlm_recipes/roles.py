"""Family adapters: which modules of a model make up each role (vision, projector, llm).

A role is a set of module-name prefixes; a parameter belongs to the role with the longest
matching prefix, so `model.visual.merger.*` is the projector although it sits inside
`model.visual`. Adding a model family means adding one FamilyAdapter to FAMILIES.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vlm_recipes.schema import ROLES


class UnsupportedModelError(ValueError):
    pass


class LoraTargetError(ValueError):
    pass


@dataclass(frozen=True)
class FamilyAdapter:
    name: str
    model_types: tuple[str, ...]  # config.model_type values this adapter handles
    role_prefixes: dict[str, tuple[str, ...]]  # role → module-name prefixes
    lm_head_prefixes: tuple[str, ...]  # the output head (part of llm; kept out of 4-bit by default)

    def role_of(self, name: str) -> str | None:
        """The role a parameter or module name belongs to (None: outside every role)."""
        best, best_len = None, -1
        for role, prefixes in self.role_prefixes.items():
            for prefix in prefixes:
                if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best_len:
                    best, best_len = role, len(prefix)
        return best

    def is_lm_head(self, name: str) -> bool:
        return any(name == p or name.startswith(p + ".") for p in self.lm_head_prefixes)

    def quantization_skip_modules(self, parts: list[str]) -> list[str]:
        """Full module paths for bitsandbytes' `llm_int8_skip_modules`.

        Full paths, because bitsandbytes matches `visual` against module names in a way that still
        quantizes `model.visual` (seen with transformers 5.23 / bitsandbytes 0.50), and lm_head must be
        listed explicitly: passing any skip list replaces transformers' default skips."""
        modules: list[str] = []
        for part in parts:
            modules.extend(self.lm_head_prefixes if part == "lm_head" else self.role_prefixes[part])
        return list(dict.fromkeys(modules))


QWEN2_VL = FamilyAdapter(
    name="qwen2-vl",
    model_types=("qwen2_vl", "qwen2_5_vl"),
    role_prefixes={
        "vision": ("model.visual",),
        "projector": ("model.visual.merger",),
        "llm": ("model.language_model", "lm_head"),
    },
    lm_head_prefixes=("lm_head",),
)

FAMILIES = (QWEN2_VL,)


def adapter_for_model_type(model_type: str) -> FamilyAdapter:
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    supported = ", ".join(t for f in FAMILIES for t in f.model_types)
    raise UnsupportedModelError(
        f"model type `{model_type}` is not supported yet. Supported: {supported}. "
        "A new family needs a FamilyAdapter in vlm_recipes/roles.py."
    )


def _unwrap_name(name: str) -> str:
    """Strip PEFT's wrapper prefix so names match the adapter's table."""
    return name.removeprefix("base_model.model.")


def params_by_role(model: nn.Module, family: FamilyAdapter) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """Parameters grouped by role (plus `other` for anything outside every role, e.g. LoRA-free extras)."""
    groups: dict[str, list[tuple[str, nn.Parameter]]] = {role: [] for role in (*ROLES, "other")}
    for name, param in model.named_parameters():
        groups[family.role_of(_unwrap_name(name)) or "other"].append((name, param))
    return groups


def linear_modules_of_role(model: nn.Module, family: FamilyAdapter, role: str) -> list[str]:
    """Names of the linear layers (quantized ones included) a LoRA on `role` adapts; lm_head excluded."""
    names = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and family.role_of(name) == role and not family.is_lm_head(name):
            names.append(name)
    return names


def lora_target_modules(
    model: nn.Module, family: FamilyAdapter, lora_roles: dict[str, list[str]]
) -> list[str]:
    """Full module names for PEFT's `target_modules`.

    `lora_roles` maps each role in lora mode to the suffixes to adapt (empty: all its linear layers).
    Full names keep a suffix like `proj` from catching layers of a role that is not in lora mode."""
    targets: list[str] = []
    for role, suffixes in lora_roles.items():
        linear = linear_modules_of_role(model, family, role)
        if suffixes:
            linear = [n for n in linear if any(n == s or n.endswith("." + s) for s in suffixes)]
        if not linear:
            wanted = ", ".join(suffixes) if suffixes else "any linear layer"
            names = sorted({n.rsplit(".", 1)[-1] for n in linear_modules_of_role(model, family, role)})
            raise LoraTargetError(
                f"lora.targets.{role}: no module of `{role}` matches {wanted}. Its linear layers end with: "
                f"{', '.join(names) or 'none'}"
            )
        targets.extend(linear)
    return targets


def count_params_by_role(model: nn.Module, family: FamilyAdapter) -> dict[str, dict[str, int]]:
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
