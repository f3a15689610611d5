"""Benchmark vlm-recipes against a plain TRL script: `vlm-recipes bench`, see vlm_recipes/benchmarking/sft_vs_trl.py."""

import sys

from vlm_recipes.benchmarking.sft_vs_trl import main

if __name__ == "__main__":
    sys.exit(main(prog="scripts/benchmark.py"))
