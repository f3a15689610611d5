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

import yaml

from vlm_recipes.recipes.overrides import apply_overrides, name_origins
from vlm_recipes.recipes.schema import RECIPE_FILE_KEYS, STAGE_DEFAULT_SECTIONS, Recipe, Stage
from vlm_recipes.recipes.validate import Problem, RecipeError, check_recipe, convert, did_you_mean
from vlm_recipes.shipped import shipped_dir

__all__ = [  # RecipeError and Problem live in validate.py; importing them from here keeps working
    "Problem",
    "RecipeError",
    "apply_overrides",
    "available_recipes",
    "find_recipe_file",
    "load_recipe",
    "load_recipe_from_run",
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


def display_path(path: Path | str) -> str:
    """A path as the user would type it: relative to the working directory when inside it."""
    path = Path(path)
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def read_text(path: Path) -> str:
    """A recipe file's text: UTF-8 (a leading BOM is fine). Anything else is a RecipeError naming the file."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise RecipeError(
            [Problem(display_path(path), f"cannot read the file: {exc.strerror or exc}")],
            "Cannot read recipe",
        ) from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        kind = _binary_kind(raw)
        raise RecipeError(
            [
                Problem(
                    display_path(path),
                    f"not UTF-8 text{kind} (byte {exc.start}: {raw[exc.start : exc.start + 1]!r}): a recipe "
                    "is a YAML text file; save it as UTF-8",
                )
            ],
            "Cannot read recipe",
        ) from None


def _binary_kind(raw: bytes) -> str:
    """What a file that is not UTF-8 looks like, when its first bytes say so."""
    for magic, kind in (
        (b"\xff\xfe", "UTF-16 text"),
        (b"\xfe\xff", "UTF-16 text"),
        (b"\x89PNG", "a PNG image"),
        (b"\xff\xd8\xff", "a JPEG image"),
        (b"PK\x03\x04", "a zip archive"),
    ):
        if raw.startswith(magic):
            return f": it looks like {kind}"
    return ""


def read_yaml(path: Path) -> dict:
    text = read_text(path)
    if "\x00" in text:
        raise RecipeError(
            [
                Problem(
                    display_path(path),
                    "not UTF-8 text: it holds NUL bytes (UTF-16? binary?); save it as UTF-8",
                )
            ],
            "Cannot read recipe",
        )
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{display_path(path)}:{mark.line + 1}" if mark else display_path(path)
        raise RecipeError([Problem(where, f"YAML syntax error: {exc}")], "Cannot read recipe") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(
            [Problem(display_path(path), "a recipe must be a mapping of keys (description, model, stages…)")]
        )
    return data


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


def _read_extended(path: Path, chain: tuple[str, ...], problems: list[Problem]) -> dict:
    """A recipe file's keys with its `extends` chain merged underneath (the file's own keys win)."""
    data = read_yaml(path)
    for unknown in set(data) - set(RECIPE_FILE_KEYS):
        problems.append(
            Problem(
                f"{display_path(path)}: {unknown}", f"unknown key{did_you_mean(unknown, RECIPE_FILE_KEYS)}"
            )
        )
    if "extends" not in data:
        return data
    own = {k: v for k, v in data.items() if k != "extends"}
    parent_path = _find_in_chain(data["extends"], chain, problems, f"{display_path(path)}: extends")
    if parent_path is None:
        return own
    parent = _read_extended(parent_path, (*chain, str(parent_path.resolve())), problems)
    parent.pop("description", None)  # a description describes one file
    sections = {k: v for k, v in own.items() if k in STAGE_DEFAULT_SECTIONS}
    if "stages" not in own and sections and isinstance(parent.get("stages"), list):
        # The file changes the parent's stages rather than adding new ones: its sections reach every
        # inherited stage, even keys a stage set itself (`extends: r1` + `lora: {rank: 8}` means rank 8).
        parent["stages"] = [deep_merge(s, sections) if isinstance(s, dict) else s for s in parent["stages"]]
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


def _load_raw(path: Path, chain: tuple[str, ...], problems: list[Problem]) -> _RawRecipe:
    chain = (*chain, str(path.resolve()))
    data = _read_extended(path, chain, problems)
    top = {k: v for k, v in data.items() if k != "stages" and k in RECIPE_FILE_KEYS}
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
        stages.extend(_expand_use(entry, where, chain, problems))
    return _RawRecipe(path, top, stages)


def _expand_use(
    entry: dict, where: str, chain: tuple[str, ...], problems: list[Problem]
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
    used = _load_raw(used_path, chain, problems)
    used_defaults = {k: v for k, v in used.top.items() if k in STAGE_DEFAULT_SECTIONS}
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


def resolve_recipe_dict(name_or_path: str) -> tuple[Path, dict]:
    """Read a recipe file with everything it reuses into one plain mapping (not yet validated)."""
    problems: list[Problem] = []
    raw = _load_raw(find_recipe_file(name_or_path), (), problems)
    if problems:
        raise RecipeError(problems, f"Recipe {display_path(raw.path)} is not valid")
    defaults = {k: v for k, v in raw.top.items() if k in STAGE_DEFAULT_SECTIONS}
    stages = [deep_merge(deep_merge(inherited, defaults), keys) for inherited, keys in raw.stages]
    resolved = {k: v for k, v in raw.top.items() if k not in STAGE_DEFAULT_SECTIONS}
    resolved["name"] = raw.path.stem
    resolved["stages"] = stages
    return raw.path, resolved


# ---------------------------------------------------------------------------------------------
# The entry point


def load_recipe(
    name_or_path: str, overrides: list[str] | None = None, labels: dict[str, str] | None = None
) -> Recipe:
    """Load, resolve, override and validate a recipe. Raises RecipeError listing every problem.

    `labels` maps an override to how the user wrote it (`training.epochs=-1.0` → `--epochs -1`), for errors."""
    path, resolved = resolve_recipe_dict(name_or_path)
    origins: dict[str, str] = {}
    if overrides:
        resolved, origins = apply_overrides(resolved, overrides, labels)
    where = display_path(path)
    problems: list[Problem] = []
    stages = [
        convert(Stage, s, f"{where}: stages[{i}]", problems) for i, s in enumerate(resolved.pop("stages"))
    ]
    name = resolved.pop("name")
    recipe = convert(Recipe, resolved, f"{where}:", problems)
    if not problems:
        recipe.name, recipe.stages, recipe.source_file = name, stages, str(path)
        problems = check_recipe(recipe, where)
    if problems:
        name_origins(problems, origins, f"{where}: ")
        raise RecipeError(problems, f"Recipe {where} is not valid")
    return recipe


def recipe_to_dict(recipe: Recipe) -> dict:
    """The resolved recipe as plain data (saved in run.json, printed by --dry-run)."""
    return dataclasses.asdict(recipe)


def load_recipe_from_run(run_dir: Path) -> Recipe:
    """The recipe exactly as a run recorded it in run.json (a later edit of the YAML does not leak in)."""
    manifest_path = Path(run_dir) / "run.json"
    if not manifest_path.is_file():
        raise RecipeError([Problem(str(run_dir), "no run.json here: not a run directory")], "Cannot resume")
    try:
        resolved = dict(json.loads(manifest_path.read_text(encoding="utf-8"))["resolved_recipe"])
        stages_raw = resolved.pop("stages")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        raise RecipeError(
            [Problem(str(manifest_path), f"unreadable run record ({type(exc).__name__}: {exc})")],
            "Cannot resume",
        ) from None
    problems: list[Problem] = []
    stages = [convert(Stage, s, f"{manifest_path}: stages[{i}]", problems) for i, s in enumerate(stages_raw)]
    name, source_file = resolved.pop("name", Path(run_dir).parent.name), resolved.pop("source_file", "")
    recipe = convert(Recipe, resolved, f"{manifest_path}:", problems)
    if problems:
        raise RecipeError(problems, f"Cannot resume from {manifest_path}")
    recipe.name, recipe.stages, recipe.source_file = name, stages, source_file
    return recipe
