"""What answers at once: `--list`, `--schema` and `--help` read recipes and the methods' sections without
importing the training stack (torch, transformers, TRL, PEFT, datasets: ~8 s on 2 cores). Their times are in
docs/development.md, measured, not asserted."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

TRAINING_STACK = ("torch", "transformers", "trl", "peft", "datasets", "accelerate", "bitsandbytes")
CONSOLE_SCRIPT = Path(sys.executable).parent / "vlm-recipes"  # what `pip install -e .` puts beside python

# (command after the interpreter, what its output must hold: the answer is whole, not cut short)
COMMANDS = {
    "train_recipe.py --list": (["scripts/train_recipe.py", "--list"], ["r1-llm-only", "r8-sft-then-distill"]),
    "train_recipe.py --schema": (
        ["scripts/train_recipe.py", "--schema"],
        ["learning_rate:", "  dpo:  #", "  grpo:  #", "  distill:  #", "teacher: ''"],
    ),
    "train_recipe.py --help": (["scripts/train_recipe.py", "--help"], ["usage: train_recipe.py"]),
    "-m vlm_recipes --help": (["-m", "vlm_recipes", "--help"], ["usage: python -m vlm_recipes"]),
    "-m vlm_recipes --list": (["-m", "vlm_recipes", "--list"], ["r5-sft-then-dpo"]),
    "-m vlm_recipes train --schema": (["-m", "vlm_recipes", "train", "--schema"], ["  kto:  #"]),
    "vlm-recipes --help": ([str(CONSOLE_SCRIPT), "--help"], ["usage: vlm-recipes COMMAND"]),
    "vlm-recipes train --list": ([str(CONSOLE_SCRIPT), "train", "--list"], ["r4-joint"]),
}


def imported_modules(argv: list[str]) -> tuple[subprocess.CompletedProcess, set[str]]:
    """The command run in a fresh interpreter under `-X importtime`, and the top-level modules it imported.
    A subprocess, because this test process has imported torch long before (conftest, other tests)."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", *argv], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    # importtime's lines: "import time: self | cumulative | <indent>module"
    names = {
        line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")
    }
    return done, {name.split(".")[0] for name in names}


@pytest.mark.parametrize("name", list(COMMANDS))
def test_list_schema_and_help_import_no_training_stack(name):
    argv, said = COMMANDS[name]
    if argv[0] == str(CONSOLE_SCRIPT) and not CONSOLE_SCRIPT.is_file():
        pytest.skip("the package is not installed with its scripts")
    done, modules = imported_modules(argv)
    assert done.returncode == 0, done.stderr[-3000:]
    for text in said:
        assert text in done.stdout, f"{name}: {text!r} missing from its answer"
    heavy = sorted(set(TRAINING_STACK) & modules)
    assert not heavy, f"{name} imported {heavy}"
