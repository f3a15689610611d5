"""Load a recipe: recipes/ reads the file (extends, use, overrides) and checks what every stage shares; each
stage's method, from its module in methods/, types its own section (`dpo:`, `grpo:`, ...) and checks the
stage. This module hands the methods down to the reader: recipes/ sits below methods/ and never imports it.

    recipe = load_recipe("r3-two-stage", ["training.epochs=2"])
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from vlm_recipes.recipes.load import read_recipe, read_recipe_from_run
from vlm_recipes.recipes.schema import MethodSections, Recipe, StageMethod


def registered_methods() -> Mapping[str, StageMethod]:
    """methods/'s registry, imported when a recipe needs it (TRL and torch come with it: seconds)."""
    from vlm_recipes.methods import METHODS

    return METHODS


def method_sections() -> MethodSections:
    return MethodSections(registered_methods)


def load_recipe(
    name_or_path: str, overrides: list[str] | None = None, labels: dict[str, str] | None = None
) -> Recipe:
    """Load, resolve, override and validate a recipe. Raises RecipeError listing every problem.

    `labels` maps an override to how the user wrote it (`training.epochs=-1.0` → `--epochs -1`), for errors."""
    return read_recipe(name_or_path, method_sections(), overrides, labels)


def load_recipe_from_run(run_dir: Path, overrides: list[str] | None = None) -> Recipe:
    """The recipe exactly as a run recorded it in run.json (a later edit of the YAML does not leak in), with
    --resume's overrides (cli/jobs.RESUMABLE_KEYS)."""
    return read_recipe_from_run(run_dir, method_sections(), overrides)
