"""Benchmark vlm-recipes against a plain TRL script: `vlm-recipes bench`, see vlm_recipes/evaluation/bench.py."""

import sys

from vlm_recipes.evaluation.bench import main

if __name__ == "__main__":
    sys.exit(main(prog="scripts/benchmark.py"))
