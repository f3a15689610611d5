"""The package's shape: its rooms are floors of one building, and arrows run downward only (no import from
a lower room to a higher one, no import cycle; function-level imports included); no module grows past
what a reader takes in at once."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "vlm_recipes"
MAX_LINES = 400
# The rooms from the top floor down, as one stage's trip takes them: a module imports from its own room
# or a lower floor. Every folder has a floor of its own; the package's loose base modules (the last floor)
# share one, and import none of each other. Comparison (reading finished runs) and benchmarking (timing runs
# against plain TRL) are the CLI's, beside the trip.
FLOORS = [
    ["__main__"],
    ["cli"],
    ["comparison"],
    ["benchmarking"],
    ["runner"],
    ["launch"],
    ["stages"],
    ["plan"],
    ["rank_memory"],
    ["evaluation"],
    ["recipe"],
    ["methods"],
    ["speedups"],
    ["model"],
    ["runs"],
    ["caches"],
    ["data"],
    ["recipes"],
    ["benchmark_metrics"],
    ["demo"],
    ["families"],
    ["machine"],
    ["errors", "decisions", "roles", "ranks", "versions", "files", "full_disk", "shipped", "logs", "scoring"],
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The package modules `path` imports anywhere in it (lazy imports inside functions too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vlm_recipes"):
            for alias in node.names:  # `from vlm_recipes.x import y` may import the module x.y
                child = f"{node.module}.{alias.name}"
                found.add(child if child in modules else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("vlm_recipes")}
    return {m for m in found if m in modules} - {module_name(path)}


def room_of(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def floor_of(module: str) -> int:
    return next(i for i, rooms in enumerate(FLOORS) if room_of(module) in rooms)


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: imports_of(path, set(paths)) for name, path in paths.items()}


def test_every_module_is_in_a_room_on_a_floor():
    homeless = sorted(
        m for m in import_graph() if m != "vlm_recipes" and not any(room_of(m) in r for r in FLOORS)
    )
    assert not homeless, f"give these a room in FLOORS (and a line in docs/architecture.md's map): {homeless}"


def test_arrows_run_downward_only():
    """An import goes to the module's own room or to a lower floor: never up, and never sideways to another
    room on the same floor (two rooms that import each other's floor belong on two floors)."""
    upward = [
        f"{module} -> {dep}"
        for module, deps in sorted(import_graph().items())
        if module != "vlm_recipes"
        for dep in sorted(deps)
        if floor_of(dep) < floor_of(module)
        or (floor_of(dep) == floor_of(module) and room_of(dep) != room_of(module))
    ]
    assert not upward, "imports from a lower room to a higher one, or across a floor: " + "; ".join(upward)


# What a stage runs on: the run's plan resolved the demo's ids (model, data) to paths before the stage, so
# none of these asks the demo anything while it trains.
TRAINING_ROOMS = ("stages", "data", "model", "methods", "speedups", "caches", "evaluation", "families")


def test_a_stage_never_asks_the_demo():
    asking = [
        f"{module} -> {dep}"
        for module, deps in sorted(import_graph().items())
        if room_of(module) in TRAINING_ROOMS
        for dep in sorted(deps)
        if room_of(dep) == "demo"
    ]
    assert not asking, "resolve demo ids when the run is planned (runner.py), not here: " + "; ".join(asking)


def test_no_import_cycles():
    graph = import_graph()
    # a package's __init__ re-exporting its own modules is not a cycle of the data flow
    graph = {
        m: {d for d in deps if not m.startswith(d + ".") and not d.startswith(m + ".")}
        for m, deps in graph.items()
    }
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                cycles.append(stack[stack.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep, [*stack, dep])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_module_is_too_long():
    long = {
        module_name(p): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"split these modules (over {MAX_LINES} lines): {long}"


def test_no_module_is_named_after_the_standard_library_or_a_room():
    """A module's name says what it is, once: `cli/inspect.py` read as the standard library's `inspect`, and a
    `cli/data.py` beside the data/ room as that room."""
    import sys

    rooms = {room for floor in FLOORS for room in floor}
    clashes = sorted(
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if p.stem in sys.stdlib_module_names or (p.parent != PACKAGE and p.stem in rooms)
    )
    assert not clashes, f"rename these modules: {clashes}"


def test_run_stage_reads_as_a_short_list_of_steps():
    tree = ast.parse((PACKAGE / "stages" / "run.py").read_text())
    run_stage = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "run_stage")
    assert run_stage.end_lineno - run_stage.lineno < 60


# Rooms and modules outside methods/ that may name a method, each with why. Everything else asks the method
# (TrainingMethod: takes_video, takes_loss_positions_cut, frozen_copies, older_record, ...).
MAY_NAME_A_METHOD = {
    "benchmarking": "it times one named method's recipes against plain TRL's trainer for that method",
    "vlm_recipes.recipes.schema": "it holds the default method (DEFAULT_METHOD), the stage's `method:` default",
}


def method_name_tests(tree: ast.AST, names: set[str]) -> list[int]:
    """Lines where a string equal to a method's name is compared against (==, !=, in), indexed by
    (`x["dpo"]`, `x.get("dpo")`), a lookup's default (`x.get("method", "sft")`), a dict's key, or a match
    case: a decision by the method's name."""

    def named(node: ast.AST | None) -> bool:
        return isinstance(node, ast.Constant) and node.value in names

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            found = any(named(n) for side in (node.left, *node.comparators) for n in ast.walk(side))
        elif isinstance(node, ast.Subscript):
            found = named(node.slice)
        elif isinstance(node, ast.Dict):
            found = any(named(key) for key in node.keys)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            found = node.func.attr in ("get", "pop", "setdefault") and any(named(a) for a in node.args)
        elif isinstance(node, ast.MatchValue):
            found = named(node.value)
        else:
            found = False
        if found:
            lines.append(node.lineno)
    return sorted(set(lines))


def test_no_module_outside_methods_decides_by_a_methods_name():
    """A method is its module and one registry line: code outside methods/ asks the method (does it take
    video, a loss-positions cut, a frozen copy; what it recorded before) and never tests its name."""
    from vlm_recipes.methods import METHODS

    names = set(METHODS)
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    deciding = [
        f"{module}:{line}"
        for module, path in sorted(paths.items())
        if room_of(module) != "methods"
        and module not in MAY_NAME_A_METHOD
        and room_of(module) not in MAY_NAME_A_METHOD
        for line in method_name_tests(ast.parse(path.read_text()), names)
    ]
    assert not deciding, "ask the method (a TrainingMethod attribute) instead of its name: " + ", ".join(
        deciding
    )
    assert names >= {"sft", "dpo", "grpo"}  # the registry was read


def test_no_module_outside_benchmark_metrics_names_a_metric():
    """A benchmark metric is its module and one registry line: the schema, the eval, the tables, the pages
    and the figure ask benchmark_metrics.METRICS, and no text of theirs is a metric's name or its key."""
    from vlm_recipes.benchmark_metrics import METRICS

    names = set(METRICS) | {metric.key for metric in METRICS.values()}
    naming = [
        f"{module_name(path)}:{node.lineno} {node.value!r}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if room_of(module_name(path)) != "benchmark_metrics"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and node.value in names
    ]
    assert not naming, "ask the metric (benchmark_metrics.METRICS) instead of naming it: " + ", ".join(naming)
    assert {"vqa_accuracy", "eval_box_acc50"} <= names  # the registry was read


def test_the_default_method_answers_what_reading_it_without_the_methods_assumes():
    """A stage of the default method is read, checked and planned without importing the methods
    (MethodSections.asked_for; TRL comes with them): that holds while the method has no section, takes every
    stage key and holds no frozen model, whatever its roles' modes."""
    import itertools

    from vlm_recipes.methods import METHODS
    from vlm_recipes.recipes.schema import DEFAULT_METHOD, MethodSections, Stage, TrainModes

    default = METHODS[DEFAULT_METHOD]
    assert default.settings is None and default.takes_loss_positions_cut and default.takes_streamed_rows
    for modes in itertools.product(("frozen", "lora", "full"), repeat=3):
        stage = Stage(method=DEFAULT_METHOD, train=TrainModes(*modes))
        assert not MethodSections.asked_for(stage)
        assert default.frozen_copies(stage) == 0 and default.problems(stage, "x", []) == [], modes


def test_every_error_is_bad_input_or_a_stopped_stage():
    """One error family each: the CLI catches BadInput (exit 2) and StageStopped (130, 3), so an error
    class of the package outside them would escape as a traceback. LaunchFailed carries a child's code."""
    import inspect
    import pkgutil

    import vlm_recipes
    from vlm_recipes.errors import BadInput, StageStopped
    from vlm_recipes.launch.launcher import LaunchFailed

    errors = set()
    for info in pkgutil.walk_packages(vlm_recipes.__path__, "vlm_recipes."):
        module = importlib.import_module(info.name)
        errors |= {
            c
            for _, c in inspect.getmembers(module, inspect.isclass)
            if issubclass(c, BaseException) and c.__module__.startswith("vlm_recipes")
        }
    outside = sorted(
        c.__name__ for c in errors if not issubclass(c, BadInput | StageStopped) and c is not LaunchFailed
    )
    assert not outside, f"derive these from errors.BadInput or errors.StageStopped: {outside}"
    assert len(errors) > 10  # the walk found the package's errors


def test_every_data_file_of_the_package_ships_in_the_wheel():
    """`pip install .` (not editable) copies only .py files and the package-data globs: a benchmark recipe
    or the demo's pretraining recipe outside them would be missing from an installed package (the built-in
    recipes and accelerate configs are top-level folders setup.py copies in: the wheel test below)."""
    import tomllib

    globs = tomllib.loads((PACKAGE.parents[1] / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]["vlm_recipes"]
    data_files = [
        p
        for p in PACKAGE.rglob("*")
        if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts
    ]
    assert len(data_files) >= 5  # three benchmark recipes, the bench model's config, the demo's recipe
    unshipped = [
        str(p.relative_to(PACKAGE))
        for p in data_files
        if not any(p.relative_to(PACKAGE).match(g) for g in globs)
    ]
    assert not unshipped, f"add to [tool.setuptools.package-data] in pyproject.toml: {unshipped}"


def test_recipes_and_configs_live_once_at_the_top_level():
    """The files a user reads, copies and edits are at the repository's top level, with no copy left in
    the package (the wheel gets its copies at build time)."""
    root = PACKAGE.parents[1]
    assert len(list((root / "recipes").glob("*.yaml"))) >= 7
    assert {p.stem for p in (root / "configs").glob("*.yaml")} >= {"ddp", "fsdp", "zero2", "zero3"}
    names = {p.name for p in [*(root / "recipes").glob("*.yaml"), *(root / "configs").glob("*.yaml")]}
    copies = [str(p.relative_to(root)) for p in PACKAGE.rglob("*.yaml") if p.name in names]
    assert not copies, f"recipes/ and configs/ hold these; delete the copies under src/: {copies}"


# What a build needs of the repository (copied, so the build leaves no build/ or egg-info in the checkout)
BUILD_INPUTS = ["pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "src", "recipes", "configs"]


def test_an_installed_wheel_carries_and_finds_the_recipes_and_configs(tmp_path):
    """A wheel built from the repository holds every recipe and config as package data, and the package
    installed from it (no checkout around) finds them through the same lookup as a clone does."""
    import os
    import shutil
    import subprocess
    import sys
    import zipfile

    from vlm_recipes.shipped import SHIPPED_KINDS

    root = PACKAGE.parents[1]
    source = tmp_path / "source"
    source.mkdir()
    for name in BUILD_INPUTS:
        if (root / name).is_dir():
            shutil.copytree(
                root / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
            )
        else:
            shutil.copy2(root / name, source / name)

    def run(command: list, **kwargs) -> str:
        result = subprocess.run(command, capture_output=True, text=True, timeout=120, **kwargs)
        assert result.returncode == 0, (command, result.stdout[-2000:], result.stderr[-3000:])
        return result.stdout

    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", tmp_path / "dist", source])
    (wheel,) = (tmp_path / "dist").glob("vlm_recipes-*.whl")
    shipped = {
        f"vlm_recipes/{inside}/{path.name}"
        for kind, inside in SHIPPED_KINDS.items()
        for path in (root / kind).glob("*.yaml")
    }
    missing = shipped - set(zipfile.ZipFile(wheel).namelist())
    assert not missing, f"setup.py's build_py did not copy these into the wheel: {sorted(missing)}"

    target, elsewhere = tmp_path / "installed", tmp_path / "elsewhere"
    run([*pip, "install", "--no-deps", "--no-index", "--target", target, wheel])
    elsewhere.mkdir()  # a working directory without recipes/
    check = (
        "import vlm_recipes; from vlm_recipes.recipes.load import find_recipe_file; "
        "from vlm_recipes.launch.launcher import accelerate_config_path; "
        "print(vlm_recipes.__file__); print(find_recipe_file('r3-two-stage')); "
        "print(accelerate_config_path('deepspeed', 'zero3'))"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    output = run([sys.executable, "-c", check], cwd=elsewhere, env=env)
    package, recipe, config = (Path(line) for line in output.splitlines()[-3:])
    assert package.is_relative_to(target), package  # the installed copy, not the checkout's src/
    assert recipe == target / "vlm_recipes" / SHIPPED_KINDS["recipes"] / "r3-two-stage.yaml"
    assert config == target / "vlm_recipes" / SHIPPED_KINDS["configs"] / "zero3.yaml"
