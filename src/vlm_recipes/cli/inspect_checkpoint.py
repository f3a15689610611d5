"""`python scripts/inspect_checkpoint.py` / `vlm-recipes inspect`: what the guards see in a model directory."""

from __future__ import annotations

import argparse
import sys

from vlm_recipes.errors import EXIT_BAD_INPUT, BadInput
from vlm_recipes.logs import setup_logging
from vlm_recipes.machine import detect_environment
from vlm_recipes.model.guards import decide_precision
from vlm_recipes.model.inspection import format_inspection, inspect_model


def main(argv: list[str] | None = None, prog: str = "inspect_checkpoint.py") -> int:
    """Load a model directory (a stage's final/, or a hub id where reachable) and print the inspection."""

    from vlm_recipes.decisions import DTYPES
    from vlm_recipes.demo.models import resolve_model_source
    from vlm_recipes.model.build import detect_family, load_model
    from vlm_recipes.model.guards import place_tensors, verify_quantization_scope
    from vlm_recipes.recipes.schema import QUANT_SKIPPABLE, QuantizationSettings

    parser = argparse.ArgumentParser(prog=prog, description=main.__doc__)
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

    env = detect_environment()
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
    except (OSError, BadInput) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    title = f"{args.path}: {family.name}, loaded {args.quantization} in {precision.choice}"
    print(format_inspection(info, title))
    print("\n".join(["guards:", *(f"  {c}" for c in checks)]))
    return 0
