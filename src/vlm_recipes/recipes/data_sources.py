"""What `data.train` and `data.eval` may name: one source (a string), or a mixture (a list of sources, each
with its share of the epoch's rows). The entry's type for the schema, and what is checked when a recipe
loads: demo ids that do not exist, files that are not there, entries whose weights and samples cannot mean
one draw. data/mixture.py loads a mixture and draws its rows."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from vlm_recipes.recipes.fields import AT_LEAST_1, Range, doc

DEMO_DATA = (
    "demo:train",
    "demo:eval",
    "demo:teaching-eval",
    "demo:bench",
    "demo:preference-train",
    "demo:preference-eval",
    "demo:prompt-train",
    "demo:prompt-eval",
    "demo:grounding-train",
    "demo:grounding-eval",
    "demo:grounding-sft-train",
    "demo:grounding-sft-eval",
    "demo:pretraining-train",
    "demo:pretraining-eval",
)
UNKNOWN_DEMO_DATA = (
    "use demo:train or demo:eval (demo:preference-train or demo:preference-eval for method: dpo or kto, "
    "demo:prompt-train or demo:prompt-eval for method: grpo or rloo; demo:grounding-train / -eval (prompt "
    "rows with boxes) and demo:grounding-sft-train / -eval; demo:teaching-eval: demo:eval's kind of rows, "
    "three times as many)"
)
# The files read here (sources.LOCAL_FORMATS): a path ending so names a file, never a hub dataset id.
FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


@dataclass
class DataSource:
    """One source of a mixture: `{path: ..., weight: w}` or `{path: ..., samples: n}`. A bare string in the
    list is `{path: that string}` (an eval list needs no weights)."""

    SHORTHAND: ClassVar[str] = "path"  # the key a bare string in the list stands for

    path: str = doc(
        "the source, as data.train takes one: a file, folder, dataset_info.json#entry, hub id or demo id", ""
    )
    weight: float | None = doc(
        "its share of the epoch's rows, normalised over the list's weights",
        None,
        range=Range(0, low_open=True, why="a share of the epoch's rows"),
    )
    samples: int | None = doc(
        "exactly this many of its rows an epoch (repeated where it has fewer)", None, range=AT_LEAST_1
    )


Sources = str | list[DataSource]  # data.train / data.eval: one source, or a mixture


def source_paths(value: Sources | None) -> list[str]:
    """Every source `data.train` or `data.eval` names, in order (none for null)."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else [entry.path for entry in value]


def entry_share(entry: DataSource) -> str:
    """`weight 0.5`, `samples 100` or `all rows`."""
    if entry.weight is not None:
        return f"weight {entry.weight:g}"
    return f"samples {entry.samples}" if entry.samples is not None else "all rows"


def describe_sources(value: Sources | None) -> str:
    """One line for a log, a plan or a report: the source, or each source of a mixture with its share."""
    if value is None or isinstance(value, str):
        return str(value)
    return " + ".join(f"{entry.path} ({entry_share(entry)})" for entry in value)


def sources_problems(value: Sources | None, key: str) -> list[tuple[str, str]]:
    """(key path, message) for each problem of `data.<key>` (train or eval): an unknown demo id, and in a
    mixture, an entry that names no file that is there, and shares that do not make one draw."""
    if value is None:
        return []
    if isinstance(value, str):
        return [(f"data.{key}", why)] if (why := _demo_problem(value)) else []
    if not value:
        return [(f"data.{key}", "an empty list: name one source, or list sources with their weights")]
    problems = []
    for i, entry in enumerate(value):
        at = f"data.{key}[{i}]"
        if not entry.path:
            problems.append((f"{at}.path", "no source given: set `path:` (a file, folder or dataset id)"))
        elif why := _demo_problem(entry.path) or _missing_file(entry.path):
            problems.append((f"{at}.path", why))
        if entry.weight is not None and entry.samples is not None:
            problems.append((at, "gives both `weight` and `samples`: keep one"))
    weighted = [i for i, e in enumerate(value) if e.weight is not None]
    counted = [i for i, e in enumerate(value) if e.samples is not None]
    if weighted and counted:
        problems.append(
            (
                f"data.{key}[{counted[0]}].samples",
                f"weights (data.{key}[{weighted[0]}]) and samples mixed in one list: give every entry a "
                f"`weight` (shares of data.max_{key}_samples, or of all rows) or every entry `samples` "
                "(rows an epoch)",
            )
        )
    bare = [i for i, e in enumerate(value) if e.weight is None and e.samples is None]
    if bare and key == "train":
        problems.append(
            (
                f"data.{key}[{bare[0]}]",
                "no `weight` or `samples`: give each source of a training mixture its share "
                "(`weight: 0.3`) or its rows an epoch (`samples: 1000`)",
            )
        )
    elif bare and weighted:
        problems.append(
            (
                f"data.{key}[{bare[0]}]",
                "no `weight`, where other entries have one: give every entry a weight, or none (every row "
                "of each source)",
            )
        )
    return problems


def _demo_problem(source: str) -> str | None:
    if source.startswith("demo:") and source not in DEMO_DATA:
        return f"unknown demo data `{source}`: {UNKNOWN_DEMO_DATA}"
    return None


def _missing_file(source: str) -> str | None:
    """Why a mixture's entry names a file that is not there (the words the loader says for one source); a
    path that may be a hub dataset id is left to the loader."""
    info, hashed, _ = source.partition("#")
    if hashed and info.endswith(".json"):
        if not Path(info).expanduser().is_file():
            return f"dataset_info file not found: {info} (check the path, or remove the entry)"
        return None
    path = Path(source).expanduser()
    local = path.suffix in FILE_SUFFIXES or source.startswith(("/", "./", "../", "~"))
    if local and not path.exists():
        return f"data file not found: {source} (check the path, or remove the entry)"
    return None
