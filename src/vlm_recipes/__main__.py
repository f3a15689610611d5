"""`python -m vlm_recipes ARGS` = `vlm-recipes train ARGS` (and `python -m vlm_recipes COMMAND ARGS` =
`vlm-recipes COMMAND ARGS`). The launcher relaunches a run this way for its torchrun/accelerate children."""

import sys
from pathlib import Path

if __name__ == "__main__":
    if not __package__:  # run as a file: its folder on sys.path would shadow top-level modules (data, logs…)
        here = Path(__file__).resolve().parent
        sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    from vlm_recipes.cli import run_as_module

    # How this command is recorded (run.json, the lock) and relaunched: `-m vlm_recipes`, never this file.
    sys.argv[0] = "python -m vlm_recipes"
    sys.exit(run_as_module(sys.argv[1:]))
