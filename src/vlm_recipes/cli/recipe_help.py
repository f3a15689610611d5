"""`train --list` (the recipes one can run) and `train --schema` (every key a recipe file may set)."""

from __future__ import annotations

import dataclasses
import types
import typing


def list_recipes() -> str:
    from vlm_recipes.recipe import load_recipe
    from vlm_recipes.recipes.load import available_recipes
    from vlm_recipes.recipes.validate import RecipeError

    lines = []
    for name, path in available_recipes().items():
        try:
            recipe = load_recipe(str(path))
            stages = " → ".join(s.name for s in recipe.stages)
            lines.append(f"{name:<18} {recipe.description}\n{'':<18} stages: {stages}")
        except RecipeError as exc:
            lines.append(f"{name:<18} (invalid: {len(exc.problems)} problem(s); run it to see them)")
    return "\n".join(lines)


def listed_entries(hint) -> type | None:
    """The entry dataclass of a hint that takes one value or a list of entries (`str | list[DataSource]`)."""
    if typing.get_origin(hint) not in (typing.Union, types.UnionType):
        return None
    lists = [typing.get_args(o)[0] for o in typing.get_args(hint) if typing.get_origin(o) is list]
    return next((item for item in lists if dataclasses.is_dataclass(item)), None)


def describe_schema() -> str:
    from vlm_recipes.recipes.schema import STAGE_DEFAULT_SECTIONS, Recipe, Stage

    def walk(cls, indent: str) -> list[str]:
        out = []
        for f in dataclasses.fields(cls):
            if f.name in ("source_file", "stages", "settings") or (cls is Recipe and f.name == "name"):
                continue  # not keys of a file: the name is the file's, stages and method sections below
            hint = typing.get_type_hints(cls)[f.name]
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            if dataclasses.is_dataclass(hint):
                out.append(f"{indent}{f.name}:  # {f.metadata.get('help', '')}")
                out += walk(hint, indent + "  ")
            elif entries := listed_entries(hint):  # one value or a list of entries (data.train: a mixture)
                out.append(
                    f"{indent}{f.name}: {default!r}  # {f.metadata.get('help', '')}; a list's entries:"
                )
                out += walk(entries, indent + "    ")
            elif typing.get_origin(hint) is list and dataclasses.is_dataclass(
                item := typing.get_args(hint)[0]
            ):
                listed = [dataclasses.asdict(entry) for entry in default]
                out.append(f"{indent}{f.name}:  # {f.metadata.get('help', '')}; default {listed}; each:")
                out += walk(item, indent + "    ")
            else:
                bounds = f.metadata.get("range")
                allowed = f" [{bounds}]" if bounds else ""
                out.append(f"{indent}{f.name}: {default!r}  # {f.metadata.get('help', '')}{allowed}")
        return out

    from vlm_recipes.recipe import registered_methods

    lines = ["# recipe file (top level)"] + walk(Recipe, "")
    lines += ["extends: null  # another recipe to start from", "stages:  # each stage:"]
    lines += walk(Stage, "  ")
    for name, method in registered_methods().items():  # each method's own section, from its module
        if method.settings is not None:
            about = " ".join(method.settings.__doc__.split()).split(". ")[0].rstrip(".")
            lines.append(f"  {name}:  # {about}; read when method is {name}")
            lines += walk(method.settings, "    ")
    lines += [
        "",
        f"# {', '.join(STAGE_DEFAULT_SECTIONS)} and the methods' sections may also be set at the top level, as "
        "defaults for every stage (a method's section: for the stages of that method); `- use: recipe:stage` "
        "reuses a stage of another recipe.",
    ]
    return "\n".join(lines)
