"""`vlm-recipes COMMAND [ARGS]`: one entry for every tool (the `vlm-recipes` console script).

vlm-recipes train ...     run a recipe             (= python scripts/train_recipe.py ... = python -m vlm_recipes ...)
vlm-recipes compare ...   compare finished runs    (= python scripts/compare_recipes.py ...)
vlm-recipes predict ...   answer with a trained model (= python scripts/predict.py ...)
vlm-recipes inspect ...   what the guards see in a model (= python scripts/inspect_checkpoint.py ...)
vlm-recipes eval --lmms-eval TASK RUN   an lmms-eval task on a stage's final/ (the lmms-eval extra)
vlm-recipes data check PATH   a dataset read as a stage reads it: format, lengths, every problem
vlm-recipes bench ...     benchmark against plain TRL (= python scripts/benchmark.py ...)
vlm-recipes demo-learns   does the demo teach? each demo model at its start and trained (= python scripts/demo_learns.py)
vlm-recipes machine [--reprobe]   the device, cores and CPU bf16 a run finds here; the bf16 probe asked again
"""

from __future__ import annotations

import importlib
import sys

from vlm_recipes.errors import EXIT_BAD_INPUT

# command → (module with main(argv, prog), one line of help)
COMMANDS = {
    "train": ("vlm_recipes.cli.train", "run a recipe: stages, checkpoints, evaluation (`train --help`)"),
    "compare": (
        "vlm_recipes.cli.compare",
        "compare finished runs: table, comparison.md, comparison.png, comparison.html",
    ),
    "predict": ("vlm_recipes.cli.predict", "answer with a trained model: an image + prompt, or a data file"),
    "inspect": ("vlm_recipes.cli.inspect_checkpoint", "print what the guards see in a model directory"),
    "eval": (
        "vlm_recipes.cli.lmms_eval",
        "`eval --lmms-eval TASK RUN`: an lmms-eval task on a stage's final/, filed beside its metrics",
    ),
    "data": (
        "vlm_recipes.cli.data_check",
        "`data check PATH`: a dataset read as a stage reads it, every problem listed",
    ),
    "bench": (
        "vlm_recipes.benchmarking.sft_vs_trl",
        "benchmark against a plain TRL script, in the scenarios a user runs",
    ),
    "bench-grpo": (
        "vlm_recipes.benchmarking.grpo_vs_trl",
        "benchmark a GRPO stage against plain TRL's GRPOTrainer (the feature cache's speed-up)",
    ),
    "demo-learns": (
        "vlm_recipes.cli.demo_learns",
        "does the demo teach? each demo model's eval at a recipe's start and after it, per seed",
    ),
    "machine": (
        "vlm_recipes.cli.machine_report",
        "the device, cores and CPU bf16 a run finds here; `machine --reprobe` times the bf16 probe again",
    ),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [
        "usage: vlm-recipes COMMAND [ARGS]   (vlm-recipes COMMAND --help for its options)",
        "",
        "commands:",
    ]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Dispatch `vlm-recipes COMMAND ARGS` to the command's own main."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if not argv or argv[0] not in COMMANDS:
        problem = f"unknown command `{argv[0]}`" if argv else "no command given"
        print(f"vlm-recipes: error: {problem}\n\n{usage()}", file=sys.stderr)
        return EXIT_BAD_INPUT
    command, rest = argv[0], argv[1:]
    prog = f"vlm-recipes {command}"
    module = importlib.import_module(COMMANDS[command][0])
    return module.main(rest, prog=prog)


def run_as_module(argv: list[str]) -> int:
    """`python -m vlm_recipes ARGS`: `vlm-recipes train ARGS`, or `vlm-recipes ARGS` when ARGS start with
    a command name. The launcher relaunches itself this way (`-m vlm_recipes --resume RUN_DIR ...`)."""
    if argv and argv[0] in COMMANDS:
        return main(argv)
    from vlm_recipes.cli.train import main as train

    return train(argv, prog="python -m vlm_recipes")
