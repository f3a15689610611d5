"""Overrides: `key=value` from the command line, applied to a resolved recipe before it is validated.

`stages.<name|index>.k=v` hits one stage; a stage key without that prefix (`training.epochs=2`) hits every
stage; `model=…` sets the recipe's model. Each value is read as YAML (`1e-4` a number, `{llm: [q_proj]}` a
mapping). Where each value came from is kept, so an error about it names the override (or the flag, such as
`--epochs`, that became it) rather than the recipe file.
"""

from __future__ import annotations

import copy
import dataclasses
import typing
from typing import Any

import yaml

from vlm_recipes.recipes.schema import RENAMED_KEYS, MethodSections, Stage
from vlm_recipes.recipes.validate import Problem, RecipeError, did_you_mean, note_renamed

TOP_LEVEL_KEYS = ("model", "description", "trust_remote_code")


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


def apply_overrides(
    resolved: dict, overrides: list[str], sections: MethodSections, labels: dict[str, str] | None = None
) -> tuple[dict, dict[str, str]]:
    """(the recipe with `overrides` applied, origins): origins maps each key path an override set
    (`stages[0].training.epochs`, `model`) to how the user wrote it: `labels[text]` when given (e.g.
    `--epochs -1`), else the override itself."""
    result = copy.deepcopy(resolved)
    origins: dict[str, str] = {}
    problems: list[Problem] = []
    stage_keys = [f.name for f in dataclasses.fields(Stage) if f.metadata.get("recipe_key", True)]
    for text in overrides:
        path, value = parse_override(text)
        where = f"override `{text}`"
        label = (labels or {}).get(text, where)
        head = path[0]
        if head == "stages":
            if len(path) < 3:
                problems.append(Problem(where, "use stages.<name or index>.<key>=value"))
                continue
            targets = _select_stage(result["stages"], path[1], where, problems)
            path = path[2:]
        elif head in TOP_LEVEL_KEYS and len(path) == 1:
            result[head] = value
            origins[head] = label
            continue
        elif head in stage_keys or sections.names([head]):
            targets = list(range(len(result["stages"])))
        else:
            known = [*TOP_LEVEL_KEYS, "stages", *stage_keys, *sections.types]
            problems.append(Problem(where, f"unknown key `{head}`{did_you_mean(head, known)}"))
            continue
        # a method's section (`grpo.beta=0`) is checked against the method's dataclass
        section = sections.types[path[0]] if sections.names(path[:1]) else None
        path = _current_names(Stage, path, where) if section is None else path
        error = _check_path(Stage, path) if section is None else _check_path(section, path[1:])
        if error:
            problems.append(Problem(where, error))
            continue
        for index in targets:
            node = result["stages"][index]
            for part in path[:-1]:
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    break
            else:
                node[path[-1]] = value
                for old_name in _old_names(Stage, path):  # the override wins over the old name's value
                    node.pop(old_name, None)
                origins[f"stages[{index}].{'.'.join(path)}"] = label
    if problems:
        raise RecipeError(problems, "Bad override")
    return result, origins


def _select_stage(stages: list[dict], selector: str, where: str, problems: list[Problem]) -> list[int]:
    if selector.isdigit():
        index = int(selector)
        if 1 <= index <= len(stages):  # 1-based, like the stage directories
            return [index - 1]
    for index, stage in enumerate(stages):
        if stage.get("name") == selector:
            return [index]
    names = [str(s.get("name")) for s in stages]
    problems.append(
        Problem(
            where,
            f"no stage `{selector}`{did_you_mean(selector, names)} "
            f"Stages: {', '.join(names)} (or their 1-based index)",
        )
    )
    return []


def _section_of(cls: type, path: list[str]) -> type | None:
    """The dataclass holding the last key of `path` (a key path below `cls`), or None."""
    for part in path[:-1]:
        hint = typing.get_type_hints(cls).get(part)
        if not dataclasses.is_dataclass(hint):
            return None
        cls = hint
    return cls


def _current_names(cls: type, path: list[str], where: str) -> list[str]:
    """`path` with a renamed last key (schema.RENAMED_KEYS) given its current name, noted once."""
    renamed = RENAMED_KEYS.get(_section_of(cls, path), {})
    if path and path[-1] in renamed:
        note_renamed(where, path[-1], renamed[path[-1]])
        return [*path[:-1], renamed[path[-1]]]
    return path


def _old_names(cls: type, path: list[str]) -> list[str]:
    """The old names of the last key of `path`, which an override of it replaces."""
    renamed = RENAMED_KEYS.get(_section_of(cls, path), {})
    return [old for old, new in renamed.items() if new == path[-1]]


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


def name_origins(problems: list[Problem], origins: dict[str, str], prefix: str) -> None:
    """Say, in each problem about a value an override set, which override set it."""
    for problem in problems:
        for path, label in origins.items():
            full = f"{prefix}{path}"
            if problem.where == full or problem.where.startswith((f"{full}.", f"{full}[")):
                problem.message += f" (set by {label})"
                break
