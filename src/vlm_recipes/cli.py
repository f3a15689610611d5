"""`python scripts/train_recipe.py`: parse arguments, load the recipe, plan or run it."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
import typing
import warnings
from pathlib import Path

DEFAULT_RECIPE = "r3-two-stage"
EXIT_BAD_INPUT = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="train_recipe.py",
        description="Run a multi-stage VLM fine-tuning recipe.",
        epilog="Overrides: key=value, e.g. model=Qwen/Qwen2-VL-2B-Instruct training.learning_rate=1e-4 "
        "stages.llm-lora.lora.rank=32 (a stage key without `stages.` applies to every stage).",
    )
    parser.add_argument(
        "--recipe",
        default=DEFAULT_RECIPE,
        help=f"recipe name or .yaml path, or several separated by commas (default: {DEFAULT_RECIPE})",
    )
    parser.add_argument("--all", action="store_true", help="run every available recipe, then compare them")
    parser.add_argument("--seeds", help="run each recipe once per seed, e.g. 0,1,2 (compared as mean ± std)")
    parser.add_argument("--list", action="store_true", help="list the available recipes and exit")
    parser.add_argument(
        "--schema", action="store_true", help="print every recipe key with its meaning and exit"
    )
    parser.add_argument("--dry-run", action="store_true", help="print the plan per stage without training")
    parser.add_argument("--epochs", type=float, help="epochs for every stage")
    parser.add_argument("--max-steps", type=int, help="stop every stage after this many optimizer steps")
    parser.add_argument(
        "--output-dir", default="runs", type=Path, help="where runs are written (default: runs/)"
    )
    parser.add_argument("--run-name", help="run directory name (default: a timestamp)")
    parser.add_argument("--resume", action="store_true", help="continue the run named by --run-name")
    parser.add_argument("--gpu", help="GPU ids to use, e.g. 6,7 (sets CUDA_VISIBLE_DEVICES)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides")
    return parser


def setup_logging() -> None:
    # transformers 5.x renamed gradient checkpointing; PEFT and TRL still call the old names.
    warnings.filterwarnings(
        "ignore", message=".*is deprecated and will be removed in v6", category=FutureWarning
    )
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    for noisy in ("httpx", "urllib3", "datasets", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # bitsandbytes warns on every CPU import that an optional kernels package is missing; its
    # fallback works (and 4-bit on CPU is only ever the demo), so the warning is only noise.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


def list_recipes() -> str:
    from vlm_recipes.recipe import RecipeError, available_recipes, load_recipe

    lines = []
    for name, path in available_recipes().items():
        try:
            recipe = load_recipe(str(path))
            stages = " → ".join(s.name for s in recipe.stages)
            lines.append(f"{name:<18} {recipe.description}\n{'':<18} stages: {stages}")
        except RecipeError as exc:
            lines.append(f"{name:<18} (invalid: {len(exc.problems)} problem(s); run it to see them)")
    return "\n".join(lines)


def describe_schema() -> str:
    from vlm_recipes.schema import STAGE_DEFAULT_SECTIONS, Recipe, Stage

    def walk(cls, indent: str) -> list[str]:
        out = []
        for f in dataclasses.fields(cls):
            if f.name == "source_file" or f.name == "stages":
                continue
            hint = typing.get_type_hints(cls)[f.name]
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            if dataclasses.is_dataclass(hint):
                out.append(f"{indent}{f.name}:  # {f.metadata.get('help', '')}")
                out += walk(hint, indent + "  ")
            else:
                out.append(f"{indent}{f.name}: {default!r}  # {f.metadata.get('help', '')}")
        return out

    lines = ["# recipe file (top level)"] + walk(Recipe, "")
    lines += ["extends: null  # another recipe to start from", "stages:  # each stage:"]
    lines += walk(Stage, "  ")
    lines += [
        "",
        f"# {', '.join(STAGE_DEFAULT_SECTIONS)} may also be set at the top level, as defaults for "
        "every stage; `- use: recipe:stage` reuses a stage of another recipe.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.gpu is not None:
        # Before anything touches CUDA: this decides which devices the process can see.
        os.environ["CUDA_VISIBLE_DEVICES"] = args.gpu
    setup_logging()

    if args.list:
        print(list_recipes())
        return 0
    if args.schema:
        print(describe_schema())
        return 0

    from vlm_recipes.data import DataError
    from vlm_recipes.guards import GuardError
    from vlm_recipes.recipe import RecipeError, available_recipes, load_recipe
    from vlm_recipes.roles import UnsupportedModelError
    from vlm_recipes.runner import RunExistsError, RunOptions, format_summary, run_recipe

    overrides = list(args.overrides)
    if args.epochs is not None:
        overrides.append(f"training.epochs={args.epochs}")
    if args.max_steps is not None:
        overrides.append(f"training.max_steps={args.max_steps}")
    names = (
        list(available_recipes()) if args.all else [n.strip() for n in args.recipe.split(",") if n.strip()]
    )
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else [None]
    base_name = args.run_name or time.strftime("%Y%m%d-%H%M%S")
    try:
        # Every recipe is loaded and validated before the first one trains.
        jobs = []
        for name in names:
            for seed in seeds:
                extra = [f"training.seed={seed}"] if seed is not None else []
                run_name = base_name if seed is None else f"{base_name}-seed{seed}"
                jobs.append((load_recipe(name, overrides + extra), run_name))
        if args.dry_run:
            from vlm_recipes.plan import format_plan, plan_recipe

            for recipe, run_name in jobs:
                options = RunOptions(args.output_dir, run_name, args.resume)
                print(format_plan(recipe, plan_recipe(recipe, options)))
            return 0
        run_dirs = []
        for recipe, run_name in jobs:
            run_dirs.append(run_recipe(recipe, RunOptions(args.output_dir, run_name, args.resume)))
            print("\n" + format_summary(run_dirs[-1]))
    except (RecipeError, DataError, GuardError, UnsupportedModelError, RunExistsError) as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(
            "\ninterrupted: finished stages are kept; continue with --resume --run-name <name>",
            file=sys.stderr,
        )
        return 130
    if len(run_dirs) > 1:
        from vlm_recipes.report import format_comparison, write_comparison

        comparison, markdown, png = write_comparison(run_dirs, args.output_dir / "comparisons" / base_name)
        print("\n" + format_comparison(comparison))
        print(f"\nComparison: {markdown}\nPlot:       {png}")
    return 0
