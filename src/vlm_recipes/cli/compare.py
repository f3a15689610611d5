"""`python scripts/compare_recipes.py` / `vlm-recipes compare`: compare finished runs."""

from __future__ import annotations

from pathlib import Path

from vlm_recipes.evaluation.compare import find_runs, format_comparison, write_comparison


def main(argv: list[str] | None = None) -> int:
    """Compare finished runs: a table on screen, comparison.md and comparison.png on disk."""
    import argparse
    import sys
    import time

    parser = argparse.ArgumentParser(prog="compare_recipes.py", description=main.__doc__)
    parser.add_argument("runs", nargs="*", type=Path, help="run directories (runs/<recipe>/<run-name>)")
    parser.add_argument("--latest", action="store_true", help="the newest finished run of each recipe")
    parser.add_argument(
        "--output-dir", type=Path, default=Path("runs"), help="where runs are (default: runs/)"
    )
    parser.add_argument("--out", type=Path, help="where to write (default: <output-dir>/comparisons/<time>)")
    args = parser.parse_args(argv)

    run_dirs = list(args.runs) or find_runs(args.output_dir, latest=True)
    if args.latest and args.runs:
        parser.error("give run directories or --latest, not both")
    missing = [d for d in run_dirs if not (d / "run.json").is_file()]
    if missing or not run_dirs:
        where = ", ".join(map(str, missing)) if missing else f"finished runs under {args.output_dir}"
        print(f"error: no run found: {where} (a run directory holds run.json)", file=sys.stderr)
        return 2
    out = args.out or args.output_dir / "comparisons" / time.strftime("%Y%m%d-%H%M%S")
    try:
        comparison, markdown, png = write_comparison(run_dirs, out)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_comparison(comparison))
    print(f"\nComparison: {markdown}\nPlot:       {png}")
    return 0
