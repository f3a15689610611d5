"""Validate a resolved recipe: every value against its schema type and range, then what types cannot say
(impossible combinations, references to stages and models that do not exist).

Every problem found is collected, each naming the file and key path, and raised as one RecipeError, so a
user fixes them all in one go.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import logging
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlm_recipes.errors import BadInput
from vlm_recipes.recipes.data_sources import sources_problems
from vlm_recipes.recipes.fields import Choices, Range
from vlm_recipes.recipes.schema import QUANT_SKIPPABLE, RENAMED_KEYS, Recipe, StageMethod
from vlm_recipes.recipes.sequence_parallel_keys import sequence_parallel_problems
from vlm_recipes.roles import ROLES

log = logging.getLogger(__name__)

STAGE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")


@dataclass
class Problem:
    where: str  # file (and key path) the problem is in
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


class RecipeError(BadInput, ValueError):
    """A recipe (or an override of it, or a command-line value) is not valid. Carries every problem found."""

    def __init__(self, problems: list[Problem], title: str = "Recipe is not valid"):
        self.problems = problems
        lines = [f"{title} ({len(problems)} problem{'s' if len(problems) != 1 else ''}):"]
        lines += [f"  - {p}" for p in problems]
        super().__init__("\n".join(lines))


def did_you_mean(word: str, choices: typing.Iterable[str]) -> str:
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean `{match[0]}`?" if match else ""


def key_path(where: str, key: str) -> str:
    """`file: stages[0]` + `lora` → `file: stages[0].lora`; the top level `file:` + `model` → `file: model`."""
    return f"{where} {key}" if where.endswith(":") else f"{where}.{key}"


# ---------------------------------------------------------------------------------------------
# Typed conversion: mapping → dataclasses, collecting every problem


def convert(
    hint: Any, value: Any, where: str, problems: list[Problem], bounds: Range | Choices | None = None
) -> Any:
    """Check `value` against a type hint (a number against its schema range, a name against its choices)
    and return it converted (dataclasses built, numbers coerced)."""
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return _convert_dataclass(hint, value, where, problems)
    if origin in (typing.Union, types.UnionType):
        options = [o for o in typing.get_args(hint) if o is not type(None)]
        if value is None and len(options) < len(typing.get_args(hint)):
            return None
        # text or a list of entries (data.train: one source, or a mixture): the value's shape picks
        lists = [o for o in options if typing.get_origin(o) is list]
        inner = lists[0] if isinstance(value, list) and lists else [o for o in options if o not in lists][0]
        return convert(inner, value, where, problems, bounds)
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
        return [convert(item, v, f"{where}[{i}]", problems, bounds) for i, v in enumerate(value)]
    if origin is dict:
        _, item = typing.get_args(hint)
        if not isinstance(value, dict):
            problems.append(Problem(where, f"expected a mapping, got {value!r}"))
            return {}
        return {str(k): convert(item, v, f"{where}.{k}", problems, bounds) for k, v in value.items()}
    if hint is bool:
        if not isinstance(value, bool):
            problems.append(Problem(where, f"expected true or false, got {value!r}"))
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(Problem(where, f"expected a whole number, got {value!r}"))
            return value
        return _in_range(value, bounds, where, problems)
    if hint is float:
        if isinstance(value, str):  # YAML reads 2e-4 (no dot) as a string
            with contextlib.suppress(ValueError):
                value = float(value)
        if isinstance(value, bool) or not isinstance(value, int | float):
            problems.append(Problem(where, f"expected a number, got {value!r}"))
            return value
        return _in_range(float(value), bounds, where, problems)
    if hint is str:
        if not isinstance(value, str):
            problems.append(Problem(where, f"expected text, got {value!r}"))
            return value
        return _in_range(value, bounds, where, problems)  # a name's Choices
    raise TypeError(f"schema type {hint!r} is not supported by the recipe loader")


def _in_range(value, bounds: Range | Choices | None, where: str, problems: list[Problem]):
    if bounds is not None and (problem := bounds.problem(value)):
        problems.append(Problem(where, problem))
    return value


def _convert_dataclass(cls: type, value: Any, where: str, problems: list[Problem]) -> Any:
    if isinstance(value, str) and (shorthand := getattr(cls, "SHORTHAND", None)):
        value = {shorthand: value}  # `- a.jsonl` in a list of sources is `{path: a.jsonl}`
    if not isinstance(value, dict):
        problems.append(Problem(where, f"expected a mapping of keys, got {value!r}"))
        return cls()
    hints = typing.get_type_hints(cls)
    bounds = {f.name: f.metadata.get("range") for f in dataclasses.fields(cls)}
    renamed = RENAMED_KEYS.get(cls, {})
    kwargs = {}
    for key, item in value.items():
        at = key_path(where, str(key))
        if key in renamed:  # an old name: read as the new one, unless both are given
            if (new := renamed[key]) in value:
                problems.append(Problem(at, f"renamed `{new}`, which is set too: keep `{new}` only"))
                continue
            note_renamed(where, key, renamed[key])
            key = renamed[key]
        if key not in hints or not _is_recipe_key(cls, key):
            problems.append(Problem(at, f"unknown key{did_you_mean(str(key), hints)}"))
            continue
        kwargs[key] = convert(hints[key], item, at, problems, bounds[key])
    return cls(**kwargs)


def _is_recipe_key(cls: type, key: str) -> bool:
    """A field a recipe file may set: not the loader's own (Recipe.source_file, Stage.settings)."""
    found = next(f for f in dataclasses.fields(cls) if f.name == key)
    return key != "source_file" and found.metadata.get("recipe_key", True)


_NOTED: set[tuple[str, str]] = set()


def note_renamed(where: str, old: str, new: str) -> None:
    """A renamed key given by its old name, at `where` (a recipe section or an override): one line per file
    or override and key."""
    noted = (where.partition(": ")[0], old)
    if noted not in _NOTED:
        _NOTED.add(noted)
        log.warning("%s: `%s` is deprecated, now `%s` (same values; the old name works)", where, old, new)


# ---------------------------------------------------------------------------------------------
# Semantic checks: what types cannot say


def model_source_problem(source: str) -> str | None:
    """Why a model source cannot be found, judged without touching the network."""
    if source.startswith("demo:"):
        # the tiny builders' ids, read without transformers or torch (the registry, demo/models.py, imports
        # every family's classes: seconds): a bad command line or recipe is reported at once
        from vlm_recipes.demo.tiny import every_build

        if source in (ids := every_build()):
            return None
        return f"unknown demo model `{source}`: the demo models are {', '.join(ids)}"
    looks_local = source.startswith(("/", "./", "../", "~")) or Path(source).expanduser().exists()
    if looks_local and not (Path(source).expanduser() / "config.json").is_file():
        return f"`{source}` is not a model directory (no config.json there)"
    return None


def check_recipe(recipe: Recipe, where: str) -> list[Problem]:
    """Problems of a typed recipe that no single key shows (ranges and types are checked by `convert`)."""
    problems: list[Problem] = []
    if not recipe.model:
        problems.append(Problem(f"{where}: model", "no model given: set `model:` (e.g. demo:tiny-qwen2-vl)"))
    elif problem := model_source_problem(recipe.model):
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
        problems += _source_problems(recipe, stage, at, seen)
        problems += _quantization_problems(stage, modes, at)
        problems += _streaming_problems(stage, at)
        problems += [Problem(f"{at}.{key}", why) for key, why in sequence_parallel_problems(stage)]
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
        data = stage.data
        if data.min_pixels is not None and data.max_pixels is not None and data.min_pixels > data.max_pixels:
            problems.append(
                Problem(
                    f"{at}.data.min_pixels",
                    f"{data.min_pixels} is above data.max_pixels ({data.max_pixels}): no image size fits",
                )
            )
        if data.video_min_pixels > data.video_max_pixels:
            problems.append(
                Problem(
                    f"{at}.data.video_min_pixels",
                    f"{data.video_min_pixels} is above data.video_max_pixels ({data.video_max_pixels}): no "
                    "frame size fits",
                )
            )
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


def _source_problems(recipe: Recipe, stage, at: str, seen: list[str]) -> list[Problem]:
    """init_from, demo data and mixtures' entries that point nowhere (recipes/data_sources.py)."""
    problems = []
    init = stage.init_from
    if init.startswith("stage:"):
        ref = init.removeprefix("stage:")
        if ref not in seen:
            later = ref in [s.name for s in recipe.stages]
            why = "comes later; a stage can only start from an earlier one" if later else "does not exist"
            problems.append(Problem(f"{at}.init_from", f"stage `{ref}` {why}{did_you_mean(ref, seen)}"))
    is_model_source = init not in ("base", "previous") and not init.startswith("stage:")
    if is_model_source and (problem := model_source_problem(init)):
        problems.append(Problem(f"{at}.init_from", problem))
    for key in ("train", "eval"):
        problems += [
            Problem(f"{at}.{path}", why) for path, why in sources_problems(getattr(stage.data, key), key)
        ]
    return problems


def _quantization_problems(stage, modes: dict[str, str], at: str) -> list[Problem]:
    problems = []
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
    return problems


def keys_not_taken(stage, method: StageMethod, at: str, methods: Mapping[str, StageMethod]) -> list[Problem]:
    """The stage's keys its method does not take, each naming the methods that do (`methods`: the registry
    recipe.py hands down): the last layer cut to the labelled positions, and rows read from a stream."""

    def taken_by(attribute: str) -> str:
        return " and ".join(m.name for m in methods.values() if getattr(m, attribute))

    problems = []
    if stage.training.loss_positions_only and not method.takes_loss_positions_cut:
        problems.append(
            Problem(
                f"{at}.training.loss_positions_only",
                f"is for {taken_by('takes_loss_positions_cut')} stages (a {stage.method} loss reads its own "
                "positions); remove it from this stage",
            )
        )
    if stage.sequence_parallel_size > 1 and not method.takes_sequence_parallel:
        problems.append(
            Problem(
                f"{at}.sequence_parallel_size",
                f"is proven for {taken_by('takes_sequence_parallel')} stages only (a {stage.method} loss is "
                "not split by token counts over a sequence group yet); set it to 1 for this stage",
            )
        )
    if stage.data.streaming and not method.takes_streamed_rows:
        problems.append(
            Problem(
                f"{at}.method",
                f"with data.streaming: streaming is for {taken_by('takes_streamed_rows')} stages; a "
                f"{stage.method} stage reads its rows whole",
            )
        )
    return problems


def _streaming_problems(stage, at: str) -> list[Problem]:
    """What a stream cannot give: a row count (the stage's length), every row's length before training (a
    mixture's draw, group_by_length). Whether the stage's method reads a stream, it says (keys_not_taken)."""
    if not stage.data.streaming:
        return []
    cannot = [
        (
            stage.training.max_steps < 1,
            "training.max_steps",
            "set it: a stream has no row count to count epochs by",
        ),
        (
            isinstance(stage.data.train, list),
            "data.train",
            "a mixture is drawn from its sources' counted rows: list one source, or set data.streaming: false",
        ),
        (
            stage.training.group_by_length,
            "training.group_by_length",
            "needs every row's length before training; set it to false",
        ),
        (
            stage.training.preprocessed_cache,
            "training.preprocessed_cache",
            "re-types a read split's image column, and a stream's rows carry paths: set it to false",
        ),
    ]
    return [Problem(f"{at}.{key}", f"with data.streaming: {why}") for refused, key, why in cannot if refused]
