"""What the guards see in a model: dtypes, trainable counts and devices per role, stranded buffers,
fp32-kept modules, and what Trainer would do with it. Printed by scripts/inspect_checkpoint.py and
saved in every stage's report.json before training."""

from __future__ import annotations

from collections import Counter, defaultdict

import torch
from torch import nn

from vlm_recipes.decisions import Environment, dtype_name
from vlm_recipes.errors import GuardError
from vlm_recipes.families.base import Family
from vlm_recipes.families.parameters import stored_numel
from vlm_recipes.model.guards import decide_parallelism, decide_precision, keep_fp32_patterns, module_devices


def inspect_model(model: nn.Module, family: Family, env: Environment, quantized: bool) -> dict:
    """Facts about a loaded (possibly PEFT-wrapped, possibly quantized) model, per role."""
    roles: dict[str, dict] = defaultdict(
        lambda: {"dtypes": Counter(), "total": 0, "trainable": 0, "devices": set()}
    )
    for name, param in model.named_parameters():
        plain = name.removeprefix("base_model.model.")
        role = "lm_head" if family.is_lm_head(plain) else family.role_of(plain) or "other"
        entry = roles[role]
        count = stored_numel(param)
        entry["dtypes"][dtype_name(param.dtype)] += count
        entry["total"] += count
        entry["trainable"] += count if param.requires_grad else 0
        entry["devices"].add(str(param.device))
    devices = module_devices(model)
    off_device = []
    for module_name, module in model.named_modules():
        for bname, buffer in module.named_buffers(recurse=False):
            if buffer.device != devices[module_name]:
                off_device.append(
                    f"{module_name}.{bname} on {buffer.device} (module on {devices[module_name]})"
                )
    try:
        precision = str(decide_precision("auto", env, quantized))
    except GuardError as exc:
        precision = f"error: {exc}"
    return {
        "roles": {
            role: {**v, "dtypes": dict(v["dtypes"]), "devices": sorted(v["devices"])}
            for role, v in sorted(roles.items(), key=lambda kv: _ROLE_ORDER.index(kv[0]))
        },
        "buffers_off_device": off_device,
        "fp32_kept_modules": {
            "bf16": keep_fp32_patterns(model, torch.bfloat16),
            "fp16": keep_fp32_patterns(model, torch.float16),
        },
        "trainer": {
            "environment": env.describe(),
            "dataparallel_risk": env.device == "cuda" and env.gpu_count > 1,
            "parallelism": str(decide_parallelism(env)),
            "precision": precision,
        },
    }


_ROLE_ORDER = ["vision", "projector", "llm", "lm_head", "other"]


def format_inspection(info: dict, title: str) -> str:
    lines = [title, "", f"{'role':<10} {'parameters':>12} {'trainable':>12}  dtypes (parameters)  devices"]
    for role, r in info["roles"].items():
        dtypes = ", ".join(f"{d} {n:,}" for d, n in sorted(r["dtypes"].items(), key=lambda kv: -kv[1]))
        lines.append(
            f"{role:<10} {r['total']:>12,} {r['trainable']:>12,}  {dtypes}  {', '.join(r['devices'])}"
        )
    lines.append("")
    off = info["buffers_off_device"]
    lines.append(f"buffers off their module's device: {len(off)}" + "".join(f"\n  {b}" for b in off[:10]))
    kept = info["fp32_kept_modules"]
    lines.append(
        f"fp32-kept modules: under bf16 {kept['bf16'] or 'none'}; under fp16 {kept['fp16'] or 'none'}"
    )
    trainer = info["trainer"]
    lines.append(f"Trainer on {trainer['environment']}:")
    risk = "yes: it would wrap the model in DataParallel" if trainer["dataparallel_risk"] else "no"
    lines.append(f"  DataParallel risk: {risk}")
    lines.append(f"  {trainer['parallelism']}")
    lines.append(f"  {trainer['precision']}")
    return "\n".join(lines)
