"""A recipe file's text read as YAML: UTF-8 only, every other kind of file named for what it looks like, a
syntax error with its line; and paths shown as the user would type them."""

from __future__ import annotations

from pathlib import Path

import yaml

from vlm_recipes.recipes.validate import Problem, RecipeError


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
