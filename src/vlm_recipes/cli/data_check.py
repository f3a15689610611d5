"""`vlm-recipes data check PATH`: a dataset read as a stage would read it, without loading a model.

It prints the file's format, its rows, images and videos, the token lengths (image and video tokens
counted by the stage's family, from file headers), and every problem: rows the stage would refuse, images
the processor cannot take, samples over the stage's max length. Exit 2 when there is a problem.
"""

from __future__ import annotations

import argparse
import sys

from vlm_recipes.errors import EXIT_BAD_INPUT, BadInput
from vlm_recipes.logs import setup_logging


def main(argv: list[str] | None = None, prog: str = "vlm-recipes data") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    actions = parser.add_subparsers(dest="action", required=True)
    check = actions.add_parser(
        "check",
        help="read a dataset with a stage's family and limits; list every problem",
        description="Read a dataset with a recipe stage's model family, processor and limits, without "
        "loading the model: format, rows, images, videos, token lengths and every problem. Exit 2 on a "
        "problem.",
    )
    check.add_argument(
        "path",
        help="a .jsonl / .json / .parquet / .csv file, a folder, path/dataset_info.json#name, or demo:train",
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
    setup_logging()
    try:
        problems, lengths = check_dataset(args.path, args.recipe, args.stage, args.overrides)
    except BadInput as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(length_line(lengths))
    if problems:
        listed = ", ".join(f"{n} {reason}" for reason, n in problems.items())
        print(f"problems: {listed} (each listed above); fix or remove these rows", file=sys.stderr)
        return EXIT_BAD_INPUT
    print("no problems")
    return 0


def check_dataset(path: str, recipe_name: str, stage_number: int, overrides: list[str]):
    """(problems counted per reason, token length of each usable row) for `path` read by the stage."""
    from vlm_recipes.caches.token_counts import remembered_token_counts
    from vlm_recipes.data.lengths import refuse_too_long
    from vlm_recipes.data.rows import load_split, video_rules
    from vlm_recipes.demo.dataset import resolve_data_source
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
    source = resolve_model_source(
        recipe.model if chained else init
    )  # a chained stage's processor is the base's
    family, _ = detect_family(source, recipe.trust_remote_code)
    processor = load_processor(source, stage.data, family, recipe.trust_remote_code)
    method, video = method_of(stage), video_rules(stage, family, processor)
    print(f"read as {recipe.name} stage {stage_number} ({stage.name}, method {stage.method}): {family.name}")
    with_videos = video.factor is not None
    rows, problems = load_split(
        path,
        stage.data.train_split,
        None,
        "report",
        stage.data.allow_remote_images,
        method.row_format,
        video,
        resolve_data_source(path, with_videos),
    )
    # every usable row's length (images the processor refuses reported), then the rows over the limit
    rows, lengths, refused = method.check_lengths(
        rows, processor, family, None, path, "report", video.sampling, remembered_token_counts
    )
    limit = method.max_length(stage)
    _, _, too_long = refuse_too_long(
        rows, lengths, limit, path, "report", f"sample(s) longer than {limit} tokens"
    )
    for reason, n in (refused | too_long).items():
        problems[reason] = problems.get(reason, 0) + n
    return problems, lengths


def length_line(lengths: list[int]) -> str:
    """`tokens per sample: p50 412, p90 655, p99 901, max 1,024 (N samples)`."""
    if not lengths:
        return "tokens per sample: no usable sample"
    ordered = sorted(lengths)

    def at(share: float) -> int:
        return ordered[min(len(ordered) - 1, int(share * len(ordered)))]

    shown = ", ".join(f"{name} {at(share):,}" for name, share in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)))
    return f"tokens per sample: {shown}, max {ordered[-1]:,} ({len(ordered)} samples)"
