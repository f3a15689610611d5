"""Load recipes from YAML: find the file, resolve `extends` and `use`, apply CLI overrides, validate.

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
listing stages of its own changes the inherited stages: its sections apply to each of them. Every problem found is collected into one
RecipeError naming the file and key path, so a user fixes them all in one go.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from vlm_recipes.demo import DEMO_MODEL_IDS
from vlm_recipes.recipes.schema import (
    QUANT_SKIPPABLE,
    RECIPE_FILE_KEYS,
    ROLES,
    STAGE_DEFAULT_SECTIONS,
    Recipe,
    Stage,
)

BUILTIN_RECIPES_DIR = Path(__file__).resolve().parents[3] / "recipes"
STAGE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")


@dataclass
class Problem:
    where: str  # file (and key path) the problem is in
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


class RecipeError(ValueError):
    """A recipe (or an override of it) is not valid. Carries every problem found."""

    def __init__(self, problems: list[Problem], title: str = "Recipe is not valid"):
        self.problems = problems
        lines = [f"{title} ({len(problems)} problem{'s' if len(problems) != 1 else ''}):"]
        lines += [f"  - {p}" for p in problems]
        super().__init__("\n".join(lines))


def did_you_mean(word: str, choices: typing.Iterable[str]) -> str:
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean `{match[0]}`?" if match else ""


# ---------------------------------------------------------------------------------------------
# Finding recipe files


def recipe_search_dirs() -> list[Path]:
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


def read_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text())
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
# Overrides: key=value from the command line


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise RecipeError(
            [Problem(text, "an override is key=value, e.g. training.learning_rate=1e-4")], "Bad override"
        )
    key, _, value_text = text.partition("=")
    try:
        value = yaml.safe_load(value_text) if value_text.strip() else ""
    except yaml.YAMLError:
        value = value_text
    return key.strip().split("."), value


def apply_overrides(resolved: dict, overrides: list[str]) -> dict:
    """Apply `key=value` overrides. `stages.<name|index>.k=v` hits one stage; a stage key without
    that prefix (`training.epochs=2`) hits every stage; `model=…` sets the recipe's model."""
    result = copy.deepcopy(resolved)
    problems: list[Problem] = []
    stage_keys = [f.name for f in dataclasses.fields(Stage)]
    for text in overrides:
        path, value = parse_override(text)
        where = f"override `{text}`"
        head = path[0]
        if head == "stages":
            if len(path) < 3:
                problems.append(Problem(where, "use stages.<name or index>.<key>=value"))
                continue
            targets = _select_stage(result["stages"], path[1], where, problems)
            path = path[2:]
        elif head in ("model", "description", "trust_remote_code") and len(path) == 1:
            result[head] = value
            continue
        elif head in stage_keys:
            targets = result["stages"]
        else:
            known = ["model", "description", "trust_remote_code", "stages", *stage_keys]
            problems.append(Problem(where, f"unknown key `{head}`{did_you_mean(head, known)}"))
            continue
        error = _check_path(Stage, path)
        if error:
            problems.append(Problem(where, error))
            continue
        for stage in targets:
            node = stage
            for part in path[:-1]:
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    break
            else:
                node[path[-1]] = value
    if problems:
        raise RecipeError(problems, "Bad override")
    return result


def _select_stage(stages: list[dict], selector: str, where: str, problems: list[Problem]) -> list[dict]:
    if selector.isdigit():
        index = int(selector)
        if 1 <= index <= len(stages):  # 1-based, like the stage directories
            return [stages[index - 1]]
    for stage in stages:
        if stage.get("name") == selector:
            return [stage]
    names = [str(s.get("name")) for s in stages]
    problems.append(
        Problem(
            where,
            f"no stage `{selector}`{did_you_mean(selector, names)} "
            f"Stages: {', '.join(names)} (or their 1-based index)",
        )
    )
    return []


def _check_path(cls: type, path: list[str]) -> str | None:
    hints = typing.get_type_hints(cls)
    for i, part in enumerate(path):
        if part not in hints:
            return f"unknown key `{part}`{did_you_mean(part, hints)}"
        hint = hints[part]
        if dataclasses.is_dataclass(hint):
            hints = typing.get_type_hints(hint)
            continue
        if typing.get_origin(hint) is dict and i == len(path) - 2:
            return None  # e.g. training.role_learning_rates.vision
        return None if i == len(path) - 1 else f"`{part}` has no sub-keys"
    return "the override must name a value, not a whole section"


# ---------------------------------------------------------------------------------------------
# Typed conversion: mapping → dataclasses, collecting every problem


def convert(hint: Any, value: Any, where: str, problems: list[Problem]) -> Any:
    """Check `value` against a type hint and return it converted (dataclasses built, numbers coerced)."""
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return _convert_dataclass(hint, value, where, problems)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        (inner,) = [o for o in options if o is not type(None)]
        return convert(inner, value, where, problems)
    if origin is typing.Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            hint_text = did_you_mean(str(value), [str(c) for c in choices])
            problems.append(
                Problem(where, f"must be one of {' | '.join(map(str, choices))}, got {value!r}{hint_text}")
            )
        return value
    if origin is list:
        (item,) = typing.get_args(hint)
        if isinstance(value, str):  # `report_to: tensorboard` reads as a one-item list
            value = [value]
        if not isinstance(value, list):
            problems.append(Problem(where, f"expected a list, got {value!r}"))
            return []
        return [convert(item, v, f"{where}[{i}]", problems) for i, v in enumerate(value)]
    if origin is dict:
        _, item = typing.get_args(hint)
        if not isinstance(value, dict):
            problems.append(Problem(where, f"expected a mapping, got {value!r}"))
            return {}
        return {str(k): convert(item, v, f"{where}.{k}", problems) for k, v in value.items()}
    if hint is bool:
        if not isinstance(value, bool):
            problems.append(Problem(where, f"expected true or false, got {value!r}"))
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(Problem(where, f"expected a whole number, got {value!r}"))
        return value
    if hint is float:
        if isinstance(value, str):  # YAML reads 2e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, int | float):
            problems.append(Problem(where, f"expected a number, got {value!r}"))
            return value
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            problems.append(Problem(where, f"expected text, got {value!r}"))
        return value
    raise TypeError(f"schema type {hint!r} is not supported by the recipe loader")


def _convert_dataclass(cls: type, value: Any, where: str, problems: list[Problem]) -> Any:
    if not isinstance(value, dict):
        problems.append(Problem(where, f"expected a mapping of keys, got {value!r}"))
        return cls()
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, item in value.items():
        if key not in hints or key == "source_file":
            problems.append(Problem(f"{where}.{key}", f"unknown key{did_you_mean(str(key), hints)}"))
            continue
        kwargs[key] = convert(hints[key], item, f"{where}.{key}", problems)
    return cls(**kwargs)


# ---------------------------------------------------------------------------------------------
# Semantic checks: what types cannot say


def _model_source_problem(source: str) -> str | None:
    """Why a model source cannot be found, judged without touching the network."""
    if source.startswith("demo:") and source not in DEMO_MODEL_IDS:
        return f"unknown demo model `{source}`: the demo models are {', '.join(DEMO_MODEL_IDS)}"
    looks_local = source.startswith(("/", "./", "../", "~")) or Path(source).expanduser().exists()
    if looks_local and not (Path(source).expanduser() / "config.json").is_file():
        return f"`{source}` is not a model directory (no config.json there)"
    return None


def check_recipe(recipe: Recipe, where: str) -> list[Problem]:
    problems: list[Problem] = []
    if not recipe.model:
        problems.append(Problem(f"{where}: model", "no model given: set `model:` (e.g. demo:tiny-qwen2-vl)"))
    elif problem := _model_source_problem(recipe.model):
        problems.append(Problem(f"{where}: model", problem))
    seen: list[str] = []
    for i, stage in enumerate(recipe.stages):
        at = f"{where}: stages[{i}]"
        if not STAGE_NAME_RE.match(stage.name or ""):
            problems.append(
                Problem(
                    f"{at}.name", f"a stage needs a name of letters, digits, - and _ (got {stage.name!r})"
                )
            )
        elif stage.name in seen:
            problems.append(Problem(f"{at}.name", f"stage name `{stage.name}` is used twice"))
        modes = {role: getattr(stage.train, role) for role in ROLES}
        if all(mode == "frozen" for mode in modes.values()):
            problems.append(
                Problem(
                    f"{at}.train",
                    "every role is frozen, nothing would be trained: "
                    "set vision, projector or llm to lora or full",
                )
            )
        init = stage.init_from
        if init.startswith("stage:"):
            ref = init.removeprefix("stage:")
            if ref not in seen:
                later = ref in [s.name for s in recipe.stages]
                why = "comes later; a stage can only start from an earlier one" if later else "does not exist"
                problems.append(Problem(f"{at}.init_from", f"stage `{ref}` {why}{did_you_mean(ref, seen)}"))
        is_model_source = init not in ("base", "previous") and not init.startswith("stage:")
        if is_model_source and (problem := _model_source_problem(init)):
            problems.append(Problem(f"{at}.init_from", problem))
        for key in ("train", "eval"):
            source = getattr(stage.data, key)
            if (
                source
                and source.startswith("demo:")
                and source not in ("demo:train", "demo:eval", "demo:bench")
            ):
                problems.append(
                    Problem(f"{at}.data.{key}", f"unknown demo data `{source}`: use demo:train or demo:eval")
                )
        quant = stage.quantization
        for part in quant.skip_roles:
            if part not in QUANT_SKIPPABLE:
                problems.append(
                    Problem(
                        f"{at}.quantization.skip_roles",
                        f"unknown part `{part}`"
                        f"{did_you_mean(part, QUANT_SKIPPABLE)} Parts: {', '.join(QUANT_SKIPPABLE)}",
                    )
                )
        if quant.mode != "none":
            for role, mode in modes.items():
                if mode == "full" and role not in quant.skip_roles:
                    problems.append(
                        Problem(
                            f"{at}.train.{role}",
                            f"`full` training of a {quant.mode} quantized "
                            f"role is impossible: use lora, or add `{role}` to quantization.skip_roles",
                        )
                    )
        for section, mapping in (
            ("lora.targets", stage.lora.targets),
            ("training.role_learning_rates", stage.training.role_learning_rates),
        ):
            for role in mapping:
                if role not in ROLES:
                    problems.append(
                        Problem(
                            f"{at}.{section}.{role}",
                            f"unknown role{did_you_mean(role, ROLES)} Roles: {', '.join(ROLES)}",
                        )
                    )
        if stage.lora.rank < 1:
            problems.append(Problem(f"{at}.lora.rank", "must be at least 1"))
        if not 0.0 <= stage.lora.dropout < 1.0:
            problems.append(Problem(f"{at}.lora.dropout", "must be at least 0 and below 1 (0.05 is usual)"))
        if stage.training.save_total_limit < 2:
            problems.append(
                Problem(
                    f"{at}.training.save_total_limit",
                    "keep at least 2 checkpoints: the newest "
                    "may be incomplete when a run is killed while writing it",
                )
            )
        if stage.training.per_device_batch_size < 1:
            problems.append(Problem(f"{at}.training.per_device_batch_size", "must be at least 1"))
        if stage.training.dataloader_workers < 0:
            problems.append(Problem(f"{at}.training.dataloader_workers", "must be 0 or more"))
        vision_side = {role: modes[role] for role in ("vision", "projector") if modes[role] != "frozen"}
        if stage.training.vision_feature_cache and vision_side:
            trained = ", ".join(f"{role}: {mode}" for role, mode in vision_side.items())
            problems.append(
                Problem(
                    f"{at}.training.vision_feature_cache",
                    f"needs a frozen vision tower and projector, but this stage trains them ({trained}): "
                    "their features change every step. Set it to false for this stage",
                )
            )
        seen.append(stage.name)
    return problems


# ---------------------------------------------------------------------------------------------
# The entry point


def load_recipe(name_or_path: str, overrides: list[str] | None = None) -> Recipe:
    """Load, resolve, override and validate a recipe. Raises RecipeError listing every problem."""
    path, resolved = resolve_recipe_dict(name_or_path)
    if overrides:
        resolved = apply_overrides(resolved, overrides)
    problems: list[Problem] = []
    stages = [
        convert(Stage, s, f"{display_path(path)}: stages[{i}]", problems)
        for i, s in enumerate(resolved.pop("stages"))
    ]
    name = resolved.pop("name")
    recipe = convert(Recipe, resolved, display_path(path), problems)
    if not problems:
        recipe.name, recipe.stages, recipe.source_file = name, stages, str(path)
        problems = check_recipe(recipe, display_path(path))
    if problems:
        raise RecipeError(problems, f"Recipe {display_path(path)} is not valid")
    return recipe


def recipe_to_dict(recipe: Recipe) -> dict:
    """The resolved recipe as plain data (saved in run.json, printed by --dry-run)."""
    return dataclasses.asdict(recipe)


def load_recipe_from_run(run_dir: Path) -> Recipe:
    """The recipe exactly as a run recorded it in run.json (a later edit of the YAML does not leak in)."""
    import json

    manifest_path = Path(run_dir) / "run.json"
    if not manifest_path.is_file():
        raise RecipeError([Problem(str(run_dir), "no run.json here: not a run directory")], "Cannot resume")
    resolved = dict(json.loads(manifest_path.read_text())["resolved_recipe"])
    problems: list[Problem] = []
    stages = [
        convert(Stage, s, f"{manifest_path}: stages[{i}]", problems)
        for i, s in enumerate(resolved.pop("stages"))
    ]
    name, source_file = resolved.pop("name"), resolved.pop("source_file", "")
    recipe = convert(Recipe, resolved, str(manifest_path), problems)
    if problems:
        raise RecipeError(problems, f"Cannot resume from {manifest_path}")
    recipe.name, recipe.stages, recipe.source_file = name, stages, source_file
    return recipe
