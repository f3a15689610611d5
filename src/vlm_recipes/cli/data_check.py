"""`vlm-recipes data check [PATH]`: a dataset read as a stage would read it, without loading a model.

It prints the file's format, its rows, images and videos, the token lengths (image and video tokens
counted by the stage's family, from file headers), and every problem: rows the stage would refuse, images
the processor cannot take, samples over the stage's max length. Without PATH it reads the stage's own
`data.train` and `data.eval`; a split that lists several sources (a mixture) is checked source by source,
then drawn as the stage draws it (rows per source). Exit 2 when there is a problem.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vlm_recipes.errors import EXIT_BAD_INPUT, BadInput, DiskFull
from vlm_recipes.logs import setup_logging

if TYPE_CHECKING:
    import datasets

    from vlm_recipes.data.rows import VideoRules
    from vlm_recipes.families.base import Family
    from vlm_recipes.methods.trainer import TrainingMethod
    from vlm_recipes.recipes.data_sources import DataSource
    from vlm_recipes.recipes.schema import Recipe, Stage

OVERRIDE = re.compile(r"^[A-Za-z_][\w.\[\]]*=")  # `data.max_length=512`, read where PATH stands


def main(argv: list[str] | None = None, prog: str = "vlm-recipes data") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    actions = parser.add_subparsers(dest="action", required=True)
    check = actions.add_parser(
        "check",
        help="read a dataset with a stage's family and limits; list every problem",
        description="Read a dataset with a recipe stage's model family, processor and limits, without "
        "loading the model: format, rows, images, videos, token lengths and every problem. Without a "
        "path, the stage's own data.train and data.eval, each source of a mixture and its draw. Exit 2 "
        "on a problem.",
    )
    check.add_argument(
        "path",
        nargs="?",
        help="a .jsonl / .json / .parquet / .csv file, a folder, path/dataset_info.json#name, or demo:train "
        "(default: the stage's data.train and data.eval, a mixture's every source)",
    )
    check.add_argument(
        "--recipe", default="r1-llm-only", help="whose stage reads the data (default: r1-llm-only)"
    )
    check.add_argument("--stage", type=int, default=1, help="which stage of the recipe, from 1 (default: 1)")
    check.add_argument(
        "overrides",
        nargs="*",
        help="key=value overrides, as for train (model=demo:tiny-smolvlm data.max_length=512)",
    )
    args = parser.parse_args(argv)
    if args.path and OVERRIDE.match(args.path) and not Path(args.path).exists():
        args.path, args.overrides = None, [args.path, *args.overrides]  # `data check key=value`: no path
    setup_logging()
    from vlm_recipes.data.cache_disk import cache_writes

    try:
        with cache_writes():  # the rows' tables and datasets' map files: a full disk named, exit 4
            reader = stage_reader(args.recipe, args.stage, args.overrides)
            problems = check_dataset(reader, args.path) if args.path else check_stage_data(reader)
    except BadInput as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except DiskFull as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    if problems:
        listed = ", ".join(f"{n} {reason}" for reason, n in problems.items())
        print(f"problems: {listed} (each listed above); fix or remove these rows", file=sys.stderr)
        return EXIT_BAD_INPUT
    print("no problems")
    return 0


@dataclass
class StageReader:
    """How a recipe stage reads data: its family's processor, its method's rows and length check, its video
    rules; a problem is reported (logged, counted) rather than raised, so that every one is listed."""

    recipe: Recipe
    stage: Stage
    family: Family
    processor: Any
    method: TrainingMethod
    video: VideoRules

    def read(
        self, source: str, split: str, limit: int | None = None
    ) -> tuple[datasets.Dataset, dict[str, int], str]:
        """(rows, problems per reason, format) of one source of the stage's `split`."""
        from vlm_recipes.data.formats import EVAL_COLUMNS
        from vlm_recipes.data.rows import read_split
        from vlm_recipes.demo.dataset import resolve_data_source

        data = self.stage.data
        return read_split(
            source,
            data.train_split if split == "train" else data.eval_split,
            limit,
            "report",
            data.allow_remote_images,
            self.method.parts().row_format,
            self.video,
            resolve_data_source(source, self.video.factor is not None),
            EVAL_COLUMNS if split == "eval" else (),
        )

    def measure(self, rows: datasets.Dataset, source: str) -> Measured:
        """Every usable row's length, the images the processor refuses and the samples over the stage's
        limit reported, and the rows within it."""
        from vlm_recipes.caches.token_counts import remembered_token_counts
        from vlm_recipes.data.lengths import refuse_too_long

        rows, lengths, refused = self.method.parts().check_lengths(
            rows,
            self.processor,
            self.family,
            None,
            source,
            "report",
            self.video.sampling,
            remembered_token_counts,
        )
        limit = self.method.max_length(self.stage)
        kept, kept_lengths, too_long = refuse_too_long(
            rows, lengths, limit, source, "report", f"sample(s) longer than {limit} tokens"
        )
        return Measured(lengths, kept, kept_lengths, refused | too_long)


@dataclass
class Measured:
    lengths: list[int]  # every usable row's (the rows over the limit included)
    kept: datasets.Dataset  # the rows within the limit
    kept_lengths: list[int]
    problems: dict[str, int]


def stage_reader(recipe_name: str, stage_number: int, overrides: list[str]) -> StageReader:
    """The reader of stage `stage_number` of the recipe (its processor loaded, not its model); says which."""
    from vlm_recipes.data.rows import video_rules
    from vlm_recipes.demo.models import resolve_model_source
    from vlm_recipes.methods import method_of
    from vlm_recipes.model.build import detect_family, load_processor
    from vlm_recipes.recipe import load_recipe

    recipe = load_recipe(recipe_name, overrides)
    if not 1 <= stage_number <= len(recipe.stages):
        raise BadInput(f"--stage {stage_number}: `{recipe.name}` has {len(recipe.stages)} stage(s)")
    stage = recipe.stages[stage_number - 1]
    init = stage.init_from
    chained = init in ("base", "previous") or init.startswith("stage:")
    # a chained stage's processor is the base's
    source = resolve_model_source(recipe.model if chained else init)
    family, _ = detect_family(source, recipe.trust_remote_code)
    processor = load_processor(source, stage.data, family, recipe.trust_remote_code)
    print(f"read as {recipe.name} stage {stage_number} ({stage.name}, method {stage.method}): {family.name}")
    method = method_of(stage)
    video = video_rules(stage, family, processor, method.takes_video)
    return StageReader(recipe, stage, family, processor, method, video)


def check_dataset(reader: StageReader, path: str, split: str = "train", label: str = "") -> dict[str, int]:
    """Problems counted per reason in `path` read by the stage; every usable row's length printed."""
    rows, problems, _ = reader.read(path, split)
    measured = reader.measure(rows, path)
    print(f"{label}{length_line(measured.lengths)}")
    if (size := reader.stage.sequence_parallel_size) > 1 and measured.lengths:
        from vlm_recipes.speedups.sequence_parallel import group_share

        limit = reader.method.max_length(reader.stage)
        print(f"{label}sequence_parallel_size {size}: {group_share(max(measured.lengths), size, limit)}")
    return dict(Counter(problems) + Counter(measured.problems))


def check_stage_data(reader: StageReader) -> dict[str, int]:
    """Problems counted per reason in the stage's data.train and data.eval, each a single source (checked
    as a PATH is) or a mixture (check_mixture)."""
    problems = Counter()
    for split in ("train", "eval"):
        sources = getattr(reader.stage.data, split)
        if isinstance(sources, str):
            problems.update(check_dataset(reader, sources, split, f"data.{split} ({sources}): "))
        elif sources is not None:
            problems.update(check_mixture(reader, sources, split))
    return dict(problems)


def check_mixture(reader: StageReader, sources: list[DataSource], split: str) -> dict[str, int]:
    """A mixture's sources read, checked and measured one by one as the stage reads them (data/mixture.py),
    a line each (its format, lengths and problems), then drawn with the stage's seed: the draw printed, rows
    per source. Returns the problems of every source, counted per reason."""
    from vlm_recipes.data.mixture import draw_mixture, load_mixture, mixture_table

    data, seed = reader.stage.data, reader.stage.training.seed
    found: list[Counter] = []  # each source's problems, in the list's order

    def read(source: str, rows: int | None) -> tuple[datasets.Dataset, dict[str, int], str]:
        ds, problems, fmt = reader.read(source, split, rows)
        found.append(Counter(problems))
        return ds, problems, fmt

    mixture = load_mixture(
        sources, split, data.max_train_samples if split == "train" else data.max_eval_samples, read
    )
    parts = iter(zip(mixture.parts, found, strict=True))

    def measure(rows: datasets.Dataset, source: str) -> tuple[datasets.Dataset, list[int], dict[str, int]]:
        part, problems = next(parts)
        measured = reader.measure(rows, source)
        problems.update(measured.problems)
        listed = ", ".join(f"{n} {reason}" for reason, n in problems.items()) or "no problems"
        print(f"{part.label} ({part.entry.path}): {part.format}, {length_line(measured.lengths)}; {listed}")
        return measured.kept, measured.kept_lengths, {}

    rows, _, _ = draw_mixture(mixture, measure, seed, logged=False)  # the table is printed below
    epoch = " an epoch" if split == "train" else ""
    print(f"data.{split} draw: {len(rows):,} rows{epoch} (seed {seed}):\n{mixture_table(mixture.report)}")
    return dict(sum(found, Counter()))


def length_line(lengths: list[int]) -> str:
    """`tokens per sample: p50 412, p90 655, p99 901, max 1,024 (N samples)`."""
    if not lengths:
        return "tokens per sample: no usable sample"
    ordered = sorted(lengths)

    def at(share: float) -> int:
        return ordered[min(len(ordered) - 1, int(share * len(ordered)))]

    shown = ", ".join(f"{name} {at(share):,}" for name, share in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)))
    return f"tokens per sample: {shown}, max {ordered[-1]:,} ({len(ordered)} samples)"
