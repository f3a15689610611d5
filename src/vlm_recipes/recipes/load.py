"""Load recipes from YAML: find the file, resolve `extends` and `use`, apply CLI overrides, then validate
(`validate.py`).

A recipe file:

    description: one line
    model: demo:tiny-qwen2-vl          # or Qwen/Qwen2-VL-2B-Instruct
    extends: r1-llm-only               # optional: start from another recipe file
    data: {...}  training: {...}       # optional: defaults for every stage (also precision, quantization, lora)
    stages:
      - name: vision-full              # a stage written out
        train: {vision: full}
      - use: r1-llm-only:llm-lora      # a stage of another recipe, keys beside `use` override it

Precedence, lowest first: schema defaults, the used recipe's defaults, this file's defaults, the used
stage's own keys, keys written beside `use`, CLI overrides. A file that `extends` another without
listing stages of its own changes the inherited stages: its sections apply to each of them.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlm_recipes.recipes.overrides import apply_overrides, name_origins
from vlm_recipes.recipes.schema import RECIPE_FILE_KEYS, STAGE_DEFAULT_SECTIONS, MethodSections, Recipe, Stage
from vlm_recipes.recipes.validate import (
    Problem,
    RecipeError,
    check_recipe,
    convert,
    did_you_mean,
    keys_not_taken,
)
from vlm_recipes.recipes.yaml_text import display_path, read_yaml
from vlm_recipes.shipped import shipped_dir

__all__ = [  # RecipeError and Problem live in validate.py; importing them from here keeps working
    "Problem",
    "RecipeError",
    "apply_overrides",
    "available_recipes",
    "find_recipe_file",
    "read_recipe",
    "read_recipe_from_run",
    "recipe_to_dict",
    "resolve_recipe_dict",
]

BUILTIN_RECIPES_DIR = shipped_dir("recipes")  # the repository's recipes/, or the installed package's copy


# ---------------------------------------------------------------------------------------------
# Finding recipe files


def recipe_search_dirs() -> list[Path]:
    """./recipes first (a user's own recipe of the same name wins), then the built-in recipes."""
    dirs = [Path.cwd() / "recipes", BUILTIN_RECIPES_DIR]
    unique: list[Path] = []
    for d in dirs:
        if d.is_dir() and d.resolve() not in [u.resolve() for u in unique]:
            unique.append(d)
    return unique


def available_recipes() -> dict[str, Path]:
    """Recipe name → file, for every recipe in the search directories (the first found wins)."""
    found: dict[str, Path] = {}
    for directory in recipe_search_dirs():
        for path in sorted(directory.glob("*.yaml")):
            found.setdefault(path.stem, path)
    return found


def find_recipe_file(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise RecipeError([Problem(name_or_path, "recipe file not found")], "Cannot load recipe")
        return path
    recipes = available_recipes()
    if name_or_path in recipes:
        return recipes[name_or_path]
    hint = did_you_mean(name_or_path, recipes)
    listing = ", ".join(recipes) or "none"
    raise RecipeError(
        [
            Problem(
                name_or_path, f"unknown recipe{hint} Available: {listing} (or pass a path to a .yaml file)"
            )
        ],
        "Cannot load recipe",
    )


def deep_merge(base: dict, override: dict) -> dict:
    """Mappings merge key by key; anything else in `override` replaces what `base` had."""
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


# ---------------------------------------------------------------------------------------------
# Resolving extends / use into plain stage mappings


@dataclass
class _RawRecipe:
    path: Path
    top: dict  # top-level keys other than stages, after `extends`
    stages: list[tuple[dict, dict]]  # (defaults inherited from used recipes, stage keys)


def stage_defaults(top: dict, sections: MethodSections) -> dict:
    """A recipe file's sections that are defaults for its stages: STAGE_DEFAULT_SECTIONS and the methods'
    own sections (`dpo:`, ...; a method's section is read by the stages of that method only)."""
    methods = sections.names(top)
    return {k: v for k, v in top.items() if k in STAGE_DEFAULT_SECTIONS or k in methods}


def _read_extended(
    path: Path, chain: tuple[str, ...], problems: list[Problem], sections: MethodSections
) -> dict:
    """A recipe file's keys with its `extends` chain merged underneath (the file's own keys win)."""
    data = read_yaml(path)
    for unknown in set(data) - set(RECIPE_FILE_KEYS) - set(sections.names(data)):
        known = [*RECIPE_FILE_KEYS, *sections.types]
        problems.append(
            Problem(f"{display_path(path)}: {unknown}", f"unknown key{did_you_mean(unknown, known)}")
        )
    if "extends" not in data:
        return data
    own = {k: v for k, v in data.items() if k != "extends"}
    parent_path = _find_in_chain(data["extends"], chain, problems, f"{display_path(path)}: extends")
    if parent_path is None:
        return own
    parent = _read_extended(parent_path, (*chain, str(parent_path.resolve())), problems, sections)
    parent.pop("description", None)  # a description describes one file
    defaults = stage_defaults(own, sections)
    if "stages" not in own and defaults and isinstance(parent.get("stages"), list):
        # The file changes the parent's stages rather than adding new ones: its sections reach every
        # inherited stage, even keys a stage set itself (`extends: r1` + `lora: {rank: 8}` means rank 8).
        parent["stages"] = [deep_merge(s, defaults) if isinstance(s, dict) else s for s in parent["stages"]]
    return deep_merge(parent, own)


def _find_in_chain(name: Any, chain: tuple[str, ...], problems: list[Problem], where: str) -> Path | None:
    """Find a referenced recipe file, reporting a bad reference or a reuse cycle as a problem."""
    if not isinstance(name, str):
        problems.append(Problem(where, f"expected a recipe name or path, got {name!r}"))
        return None
    try:
        path = find_recipe_file(name)
    except RecipeError as exc:
        problems.extend(Problem(where, p.message) for p in exc.problems)
        return None
    if str(path.resolve()) in chain:
        names = " → ".join(Path(c).stem for c in (*chain, str(path.resolve())))
        problems.append(Problem(where, f"recipes reuse each other in a cycle: {names}"))
        return None
    return path


def _load_raw(
    path: Path, chain: tuple[str, ...], problems: list[Problem], sections: MethodSections
) -> _RawRecipe:
    chain = (*chain, str(path.resolve()))
    data = _read_extended(path, chain, problems, sections)
    methods = sections.names(data)
    top = {k: v for k, v in data.items() if k != "stages" and (k in RECIPE_FILE_KEYS or k in methods)}
    stages_raw = data.get("stages")
    if not isinstance(stages_raw, list) or not stages_raw:
        problems.append(Problem(f"{display_path(path)}: stages", "a recipe needs a non-empty list of stages"))
        return _RawRecipe(path, top, [])
    stages: list[tuple[dict, dict]] = []
    for i, entry in enumerate(stages_raw):
        where = f"{display_path(path)}: stages[{i}]"
        if not isinstance(entry, dict):
            problems.append(
                Problem(where, "each stage must be a mapping (name, train, …) or {use: recipe:stage}")
            )
            continue
        if "use" not in entry:
            stages.append(({}, entry))
            continue
        stages.extend(_expand_use(entry, where, chain, problems, sections))
    return _RawRecipe(path, top, stages)


def _expand_use(
    entry: dict, where: str, chain: tuple[str, ...], problems: list[Problem], sections: MethodSections
) -> list[tuple[dict, dict]]:
    ref = entry["use"]
    local = {k: v for k, v in entry.items() if k != "use"}
    if not isinstance(ref, str):
        problems.append(Problem(f"{where}.use", f"expected `recipe` or `recipe:stage`, got {ref!r}"))
        return []
    recipe_name, _, stage_name = ref.partition(":")
    used_path = _find_in_chain(recipe_name, chain, problems, f"{where}.use")
    if used_path is None:
        return []
    used = _load_raw(used_path, chain, problems, sections)
    used_defaults = stage_defaults(used.top, sections)
    picked = used.stages
    if stage_name:
        picked = [s for s in used.stages if s[1].get("name") == stage_name]
        if not picked:
            names = [s[1].get("name", "?") for s in used.stages]
            problems.append(
                Problem(
                    f"{where}.use",
                    f"recipe `{recipe_name}` has no stage `{stage_name}`"
                    f"{did_you_mean(stage_name, names)} Its stages: {', '.join(names)}",
                )
            )
            return []
    if local and len(picked) > 1:
        problems.append(
            Problem(
                f"{where}",
                f"`use: {ref}` brings {len(picked)} stages; name one (`{recipe_name}:<stage>`) "
                "to override its keys",
            )
        )
        return []
    return [(deep_merge(used_defaults, inherited), deep_merge(keys, local)) for inherited, keys in picked]


def resolve_recipe_dict(name_or_path: str, sections: MethodSections) -> tuple[Path, dict]:
    """Read a recipe file with everything it reuses into one plain mapping (not yet validated)."""
    problems: list[Problem] = []
    raw = _load_raw(find_recipe_file(name_or_path), (), problems, sections)
    if problems:
        raise RecipeError(problems, f"Recipe {display_path(raw.path)} is not valid")
    defaults = stage_defaults(raw.top, sections)
    stages = [deep_merge(deep_merge(inherited, defaults), keys) for inherited, keys in raw.stages]
    resolved = {k: v for k, v in raw.top.items() if k not in defaults}
    resolved["name"] = raw.path.stem
    resolved["stages"] = stages
    return raw.path, resolved


# ---------------------------------------------------------------------------------------------
# The entry point


def read_recipe(
    name_or_path: str,
    sections: MethodSections,
    overrides: list[str] | None = None,
    labels: dict[str, str] | None = None,
) -> Recipe:
    """Load, resolve, override and validate a recipe (recipe.py's load_recipe hands down the methods).
    Raises RecipeError listing every problem.

    `labels` maps an override to how the user wrote it (`training.epochs=-1.0` → `--epochs -1`), for errors."""
    path, resolved = resolve_recipe_dict(name_or_path, sections)
    origins: dict[str, str] = {}
    if overrides:
        resolved, origins = apply_overrides(resolved, overrides, sections, labels)
    where = display_path(path)
    problems: list[Problem] = []
    stages = [
        build_stage(s, f"{where}: stages[{i}]", problems, sections)
        for i, s in enumerate(resolved.pop("stages"))
    ]
    name = resolved.pop("name")
    recipe = convert(Recipe, resolved, f"{where}:", problems)
    if not problems:
        recipe.name, recipe.stages, recipe.source_file = name, stages, str(path)
        problems = check_recipe(recipe, where) + method_problems(recipe, where, sections)
    if problems:
        name_origins(problems, origins, f"{where}: ")
        raise RecipeError(problems, f"Recipe {where} is not valid")
    return recipe


def build_stage(raw: dict, where: str, problems: list[Problem], sections: MethodSections) -> Stage:
    """A stage mapping → Stage, its method's section typed by the method (`settings`). Sections of other
    methods (a recipe's top-level `dpo:` reaches its sft stages too) are checked and left out."""
    own = {k: v for k, v in raw.items() if k not in sections.names(raw)}
    stage = convert(Stage, own, where, problems)
    if MethodSections.asked_for(stage) and stage.method not in sections.methods:
        listed = ", ".join(sections.methods)
        problems.append(
            Problem(
                f"{where}.method",
                f"unknown method `{stage.method}`{did_you_mean(stage.method, sections.methods)} Methods: {listed}",
            )
        )
        return stage
    for name in sections.names(raw):
        settings = convert(sections.types[name], raw[name], f"{where}.{name}", problems)
        if name == stage.method:
            stage.settings = settings
    if stage.settings is None and MethodSections.asked_for(stage) and stage.method in sections.types:
        stage.settings = sections.types[stage.method]()
    return stage


def method_problems(recipe: Recipe, where: str, sections: MethodSections) -> list[Problem]:
    """What each stage's method finds wrong with it: the stage keys it does not take, and its own checks
    (methods/<method>.py: problems)."""
    problems = []
    for i, stage in enumerate(recipe.stages):
        if MethodSections.asked_for(stage):
            method, at = sections.methods[stage.method], f"{where}: stages[{i}]"
            problems += keys_not_taken(stage, method, at, sections.methods)
            problems += method.problems(stage, at, recipe.stages[:i])
    return problems


def recipe_to_dict(recipe: Recipe) -> dict:
    """The resolved recipe as plain data (saved in run.json, printed by --dry-run): each stage's method
    section under the method's name, as the recipe file writes it."""
    out = dataclasses.asdict(recipe)
    for stage in out["stages"]:
        settings = stage.pop("settings")
        if settings is not None:
            stage[stage["method"]] = settings
    return out


def read_recipe_from_run(
    run_dir: Path, sections: MethodSections, overrides: list[str] | None = None
) -> Recipe:
    """The recipe exactly as a run recorded it in run.json (a later edit of the YAML does not leak in), with
    `overrides` applied and checked (--resume's few: cli/jobs.RESUMABLE_KEYS)."""
    manifest_path = Path(run_dir) / "run.json"
    if not manifest_path.is_file():
        raise RecipeError([Problem(str(run_dir), "no run.json here: not a run directory")], "Cannot resume")
    try:
        resolved = dict(json.loads(manifest_path.read_text(encoding="utf-8"))["resolved_recipe"])
        origins: dict[str, str] = {}
        if overrides:
            resolved, origins = apply_overrides(resolved, overrides, sections)
        stages_raw = resolved.pop("stages")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        raise RecipeError(
            [Problem(str(manifest_path), f"unreadable run record ({type(exc).__name__}: {exc})")],
            "Cannot resume",
        ) from None
    problems: list[Problem] = []
    where = str(manifest_path)
    stages = [build_stage(s, f"{where}: stages[{i}]", problems, sections) for i, s in enumerate(stages_raw)]
    name, source_file = resolved.pop("name", Path(run_dir).parent.name), resolved.pop("source_file", "")
    recipe = convert(Recipe, resolved, f"{manifest_path}:", problems)
    if not problems and overrides:
        recipe.name, recipe.stages, recipe.source_file = name, stages, source_file
        problems = check_recipe(recipe, where) + method_problems(recipe, where, sections)
    if problems:
        name_origins(problems, origins, f"{where}: ")
        raise RecipeError(problems, f"Cannot resume from {manifest_path}")
    recipe.name, recipe.stages, recipe.source_file = name, stages, source_file
    return recipe
