"""`vlm-recipes compare` / `python scripts/compare_recipes.py`: compare finished runs.

Without run directories, the newest finished run of each recipe under --output-dir; runs that are not
finished (failed, interrupted, running, killed) are skipped and named on stderr with the reason. A named
run that is not finished is an error (exit 2)."""

from __future__ import annotations

from pathlib import Path

from vlm_recipes.comparison.answers import ROWS_SHOWN
from vlm_recipes.comparison.report_page import write_comparison
from vlm_recipes.comparison.run_summary import find_runs
from vlm_recipes.comparison.tables import format_comparison
from vlm_recipes.errors import EXIT_BAD_INPUT, BadInput
from vlm_recipes.runs.manifest import run_state


def _not_comparable(run_dir: Path) -> str | None:
    status, why = run_state(run_dir)
    return None if status == "finished" else f"{run_dir}: {why}"


def main(argv: list[str] | None = None, prog: str = "compare_recipes.py") -> int:
    """Compare finished runs: a table on screen; comparison.md, comparison.png and the page comparison.html
    (the image beside every answer) on disk."""
    import argparse
    import sys
    import time

    parser = argparse.ArgumentParser(prog=prog, description=main.__doc__)
    parser.add_argument("runs", nargs="*", type=Path, help="run directories (runs/<recipe>/<run-name>)")
    parser.add_argument("--latest", action="store_true", help="the newest finished run of each recipe")
    parser.add_argument(
        "--output-dir", type=Path, default=Path("runs"), help="where runs are (default: runs/)"
    )
    parser.add_argument("--out", type=Path, help="where to write (default: <output-dir>/comparisons/<time>)")
    parser.add_argument(
        "--answers",
        type=int,
        default=ROWS_SHOWN,
        metavar="N",
        help=f"eval rows whose reference and answers (every stage's) are shown side by side, those with "
        f"right and wrong answers first (default: {ROWS_SHOWN}, 0: none)",
    )
    args = parser.parse_args(argv)

    if args.latest and args.runs:
        parser.error("give run directories or --latest, not both")
    run_dirs = list(args.runs) or find_runs(args.output_dir, latest=True)  # says which it skips and why
    missing = [d for d in run_dirs if not (d / "run.json").is_file()]
    if missing or not run_dirs:
        where = ", ".join(map(str, missing)) if missing else f"finished runs under {args.output_dir}"
        print(f"error: no run found: {where} (a run directory holds run.json)", file=sys.stderr)
        return EXIT_BAD_INPUT
    unfinished = [why for why in (_not_comparable(d) for d in run_dirs) if why]
    if unfinished:  # named runs: refused, all of them listed
        print(
            "error: only finished runs can be compared:\n" + "\n".join(f"  - {w}" for w in unfinished),
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    out = args.out or args.output_dir / "comparisons" / time.strftime("%Y%m%d-%H%M%S")
    try:
        comparison, markdown, png, page = write_comparison(run_dirs, out, args.answers)
    except BadInput as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(format_comparison(comparison, args.answers))
    print(f"\nComparison: {markdown}\nPlot:       {png}\nPage:       {page}")
    return 0
