"""One console entry: `vlm-recipes train|compare|predict|inspect|bench`, and `python -m vlm_recipes`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from vlm_recipes.cli import COMMANDS
from vlm_recipes.cli import main as vlm_recipes

CONSOLE_SCRIPT = Path(sys.executable).parent / "vlm-recipes"  # what `pip install -e .` puts beside python


def test_train_lists_recipes(capsys, in_repo):
    assert vlm_recipes(["train", "--list"]) == 0
    assert "r1-llm-only" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["frobnicate", "--x"], []], ids=["unknown", "none"])
def test_unknown_or_missing_command_lists_the_commands(argv, capsys):
    assert vlm_recipes(argv) == 2
    err = capsys.readouterr().err
    assert ("unknown command `frobnicate`" if argv else "no command given") in err
    for command in ("train", "data", "compare", "predict", "inspect", "bench", "demo-learns"):
        assert f"\n  {command} " in err
    assert "Traceback" not in err


def test_help_lists_the_commands(capsys):
    assert vlm_recipes(["--help"]) == 0
    assert set(COMMANDS) == {
        "train",
        "data",
        "compare",
        "predict",
        "inspect",
        "eval",
        "bench",
        "bench-grpo",
        "demo-learns",
        "machine",
    }
    assert "benchmark against a plain TRL script" in capsys.readouterr().out  # the package ships it


def test_inspect_a_demo_model(capsys, demo_model_dir):
    assert vlm_recipes(["inspect", "demo:tiny-qwen2-vl"]) == 0
    out = capsys.readouterr().out
    assert "guards:" in out and "qwen2" in out.lower()


def test_compare_of_nothing_is_a_clear_error(tmp_path, capsys):
    assert vlm_recipes(["compare", str(tmp_path / "nope")]) == 2
    assert "no run found" in capsys.readouterr().err


def test_a_bad_input_exit_is_spelled_one_way():
    """A command refuses bad input with errors.EXIT_BAD_INPUT, BadInput's own exit code, never a literal 2."""
    import ast

    from vlm_recipes.errors import EXIT_BAD_INPUT, BadInput

    assert BadInput.exit_code == EXIT_BAD_INPUT == 2
    package = REPO / "src" / "vlm_recipes"

    def literal_two(node: ast.AST | None) -> bool:
        return isinstance(node, ast.Constant) and type(node.value) is int and node.value == 2

    literal = [
        f"{path.relative_to(package)}:{node.lineno}"
        for path in package.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if (isinstance(node, ast.Return) and path.parent.name == "cli" and literal_two(node.value))
        or (
            isinstance(node, ast.Call)
            and ast.unparse(node.func) == "sys.exit"
            and literal_two(node.args[0] if node.args else None)
        )
    ]
    assert not literal, f"return or exit with EXIT_BAD_INPUT: {literal}"


def test_bench_runs_from_the_package(capsys):
    with pytest.raises(SystemExit) as exit_info:
        vlm_recipes(["bench", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: vlm-recipes bench") and "--scenarios" in out


def test_train_usage_names_its_command(capsys):
    with pytest.raises(SystemExit):
        vlm_recipes(["train", "--help"])
    assert capsys.readouterr().out.startswith("usage: vlm-recipes train")


def run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO)


@pytest.mark.skipif(not CONSOLE_SCRIPT.is_file(), reason="the package is not installed with its scripts")
def test_console_script():
    listed = run([str(CONSOLE_SCRIPT), "train", "--list"])
    assert listed.returncode == 0 and "r4-joint" in listed.stdout, listed.stderr[-2000:]
    unknown = run([str(CONSOLE_SCRIPT), "trian"])
    assert unknown.returncode == 2 and "unknown command `trian`" in unknown.stderr


def test_python_dash_m_is_train_and_dispatches_commands():
    listed = run([sys.executable, "-m", "vlm_recipes", "--list"])  # python -m vlm_recipes ARGS = train ARGS
    assert listed.returncode == 0 and "r2-vision-only" in listed.stdout, listed.stderr[-2000:]
    compare = run([sys.executable, "-m", "vlm_recipes", "compare", "--help"])
    assert compare.returncode == 0 and compare.stdout.startswith("usage: vlm-recipes compare")


def test_a_launched_stage_relaunches_the_module(monkeypatch):
    """`vlm-recipes train` and `python -m vlm_recipes` relaunch their DDP children as `-m vlm_recipes`,
    which trains (the children get `--resume RUN_DIR --until-stage N`)."""
    from vlm_recipes.launch.launcher import launch_command
    from vlm_recipes.plan import ParallelPlan
    from vlm_recipes.runs.layout import NodeSettings

    for argv0 in (str(CONSOLE_SCRIPT), "python -m vlm_recipes"):  # what each entry leaves in sys.argv[0]
        monkeypatch.setattr(sys, "argv", [argv0, "--recipe", "r1-llm-only"])
        command = launch_command(
            ParallelPlan("ddp", 2),
            ["--resume", "runs/x/y", "--until-stage", "1"],
            NodeSettings(),
            "r-y-stage1",
        )
        assert command[-6:] == ["-m", "vlm_recipes", "--resume", "runs/x/y", "--until-stage", "1"]


def test_a_bad_command_line_or_recipe_is_reported_before_the_training_stack_loads():
    """A typo costs no import of torch, transformers, TRL or PEFT (~10 s): the command line and recipes are
    checked first, and recipes/ stays import-light."""
    check = (
        "import sys; from vlm_recipes.cli.train import main; "
        "code = main(sys.argv[1:]); "
        "print(code, sorted(m for m in ('torch', 'transformers', 'trl', 'peft') if m in sys.modules))"
    )
    for args in (["--recipe", "r3-two-stag"], ["--recipe", "r1-llm-only", "training.epochz=2"]):
        result = run([sys.executable, "-c", check, *args])
        assert result.stdout.split("\n")[-2] == "2 []", (args, result.stdout[-500:], result.stderr[-2000:])
        assert "did you mean" in result.stderr and "Traceback" not in result.stderr
