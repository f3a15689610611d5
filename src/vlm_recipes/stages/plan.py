"""The plan a --dry-run prints: per stage, what is trained, how, from where, into where.

The model is built on the `meta` device from its config, so a plan costs no weights and no memory,
and stages whose source does not exist yet (a later stage's input) are planned from the base config.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForImageTextToText

from vlm_recipes.demo import resolve_model_source
from vlm_recipes.families import family_for_model_type
from vlm_recipes.families.base import count_params_by_role, lora_target_modules
from vlm_recipes.recipes.schema import ROLES, Recipe
from vlm_recipes.runs import RunOptions, describe_source, run_dir_for, stage_dirs
from vlm_recipes.stages.guards import Environment, GuardError, decide_precision
from vlm_recipes.stages.parallel import ModelFootprint


def meta_model(source: str, trust_remote_code: bool):
    config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config, trust_remote_code=trust_remote_code)
    return config, model


def plan_recipe(recipe: Recipe, options: RunOptions, env: Environment | None = None) -> list[dict]:
    env = env or Environment.detect()
    config, model = meta_model(resolve_model_source(recipe.model), recipe.trust_remote_code)
    family = family_for_model_type(config.model_type)
    counts = count_params_by_role(model, family)
    run_dir = run_dir_for(recipe, options)
    plans = []
    for index, (stage, stage_dir) in enumerate(
        zip(recipe.stages, stage_dirs(recipe, run_dir), strict=True), 1
    ):
        roles = {}
        lora_roles = {r: stage.lora.targets.get(r, []) for r in ROLES if getattr(stage.train, r) == "lora"}
        lora_params = {r: 0 for r in ROLES}
        if lora_roles:
            modules = dict(model.named_modules())
            for name in lora_target_modules(model, family, lora_roles):
                layer = modules[name]
                lora_params[family.role_of(name)] += stage.lora.rank * (
                    layer.in_features + layer.out_features
                )
        for role in ROLES:
            mode = getattr(stage.train, role)
            total = counts[role]["total"]
            trainable = total if mode == "full" else lora_params[role]
            roles[role] = {"mode": mode, "total": total, "trainable": trainable}
        try:
            decision = decide_precision(stage.precision, env, stage.quantization.mode != "none")
            precision = f"{decision.choice} ({decision.reason})"
        except GuardError as exc:
            precision = f"ERROR: {exc}"
        plans.append(
            {
                "index": index,
                "name": stage.name,
                "source": describe_source(recipe, stage, index),
                "roles": roles,
                "quantization": stage.quantization.mode
                if stage.quantization.mode == "none"
                else f"{stage.quantization.mode} {stage.quantization.quant_type}, kept unquantized: "
                f"{', '.join(stage.quantization.skip_roles) or 'nothing'}",
                "precision": precision,
                "lora": f"rank {stage.lora.rank}, alpha {stage.lora.alpha}" if lora_roles else "-",
                "data": f"{stage.data.train} → eval {stage.data.eval or '-'}",
                "training": f"{stage.training.epochs:g} epoch(s), lr {stage.training.learning_rate:g}, "
                f"batch {stage.training.per_device_batch_size} × accum "
                f"{stage.training.gradient_accumulation_steps}",
                "output_dir": str(Path(stage_dir)),
            }
        )
    return plans


def format_plan(recipe: Recipe, plans: list[dict]) -> str:
    lines = [f"Plan for recipe {recipe.name}: {recipe.description}", f"model: {recipe.model}", ""]
    for p in plans:
        lines.append(f"stage {p['index']}: {p['name']}  (from {p['source']})")
        for role, r in p["roles"].items():
            share = f"{100 * r['trainable'] / r['total']:.1f}%" if r["total"] else "-"
            lines.append(
                f"    {role:<10} {r['mode']:<7} trainable {r['trainable']:>14,} of {r['total']:>14,} ({share})"
            )
        for key in ("quantization", "precision", "lora", "data", "training", "output_dir"):
            lines.append(f"    {key:<13} {p[key]}")
        lines.append("")
    return "\n".join(lines)


def estimate_footprint(recipe: Recipe, stage) -> ModelFootprint:
    """GPU memory a stage needs for weights and optimizer state, from the model's config (no weights read)."""
    config, model = meta_model(resolve_model_source(recipe.model), recipe.trust_remote_code)
    family = family_for_model_type(config.model_type)
    quantized_params = 0
    if stage.quantization.mode != "none":
        skip = stage.quantization.skip_roles
        for name, module in model.named_modules():
            part = "lm_head" if family.is_lm_head(name) else family.role_of(name)
            if isinstance(module, torch.nn.Linear) and part not in skip:
                quantized_params += module.weight.numel()
    total = sum(p.numel() for p in model.parameters())
    bits = {"4bit": 4, "8bit": 8}.get(stage.quantization.mode, 16)
    weights = (total - quantized_params) * 2 + quantized_params * bits / 8
    counts = count_params_by_role(model, family)
    trainable = sum(counts[r]["total"] for r in ROLES if getattr(stage.train, r) == "full")
    trainable += 0.02 * sum(counts[r]["total"] for r in ROLES if getattr(stage.train, r) == "lora")
    return ModelFootprint(weights_gb=weights / 2**30, trainable_gb=trainable * 16 / 2**30)
