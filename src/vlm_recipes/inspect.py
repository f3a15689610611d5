"""What the guards see in a model: dtypes, trainable counts and devices per role, stranded buffers,
fp32-kept modules, and what Trainer would do with it. Printed by scripts/inspect_checkpoint.py and
saved in every stage's report.json before training."""

from __future__ import annotations

from collections import Counter, defaultdict

import torch
from torch import nn

from vlm_recipes.guards import (
    Environment,
    GuardError,
    decide_parallelism,
    decide_precision,
    dtype_name,
    keep_fp32_patterns,
    module_devices,
)
from vlm_recipes.roles import FamilyAdapter, stored_numel


def inspect_model(model: nn.Module, family: FamilyAdapter, env: Environment, quantized: bool) -> dict:
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


def main(argv: list[str] | None = None) -> int:
    """Load a model directory (a stage's final/, or a hub id where reachable) and print the inspection."""
    import argparse
    import sys

    from vlm_recipes.build import detect_family, load_model
    from vlm_recipes.cli import setup_logging
    from vlm_recipes.demo import resolve_model_source
    from vlm_recipes.guards import DTYPES, place_tensors, verify_quantization_scope
    from vlm_recipes.roles import UnsupportedModelError
    from vlm_recipes.schema import QUANT_SKIPPABLE, QuantizationSettings

    parser = argparse.ArgumentParser(prog="inspect_checkpoint.py", description=main.__doc__)
    parser.add_argument("path", help="model directory, demo:tiny-qwen2-vl, or a hub id")
    parser.add_argument("--quantization", choices=["none", "4bit", "8bit"], default="none")
    parser.add_argument(
        "--skip-roles",
        nargs="*",
        choices=QUANT_SKIPPABLE,
        default=QuantizationSettings().skip_roles,
        help="parts kept out of quantization",
    )
    parser.add_argument(
        "--precision",
        choices=["auto", "bf16", "fp16", "fp32"],
        default="auto",
        help="compute dtype to load in (auto: what a stage would pick here)",
    )
    args = parser.parse_args(argv)
    setup_logging()

    env = Environment.detect()
    quantized = args.quantization != "none"
    try:
        source = resolve_model_source(args.path)
        family, _ = detect_family(source)
        precision = decide_precision(args.precision, env, quantized)
        quant = QuantizationSettings(mode=args.quantization, skip_roles=args.skip_roles)
        model = load_model(source, quant, family, DTYPES[precision.choice], env.device)
        checks = [str(verify_quantization_scope(model, family, quant.mode, quant.skip_roles))]
        info = inspect_model(model, family, env, quantized)  # before placement: show what loading left
        checks.append(str(place_tensors(model, None)))
    except (OSError, GuardError, UnsupportedModelError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    title = f"{args.path}: {family.name}, loaded {args.quantization} in {precision.choice}"
    print(format_inspection(info, title))
    print("\n".join(["guards:", *(f"  {c}" for c in checks)]))
    return 0
