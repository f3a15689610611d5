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
# or a lower one. Rooms on one floor may import each other (no cycle between their modules).
FLOORS = [
    ["cli", "__main__"],
    ["runner"],
    ["launch"],
    ["stages"],
    ["plan", "rank_memory"],
    ["evaluation"],
    ["methods"],
    ["speedups"],
    ["model"],
    ["runs"],
    ["data", "caches"],
    ["recipes"],
    ["demo"],
    ["families"],
    ["errors", "decisions", "roles", "ranks", "versions", "files", "logs", "scoring"],
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
    assert not homeless, f"give these a room in FLOORS (and README's map): {homeless}"


def test_arrows_run_downward_only():
    upward = [
        f"{module} -> {dep}"
        for module, deps in sorted(import_graph().items())
        if module != "vlm_recipes"
        for dep in sorted(deps)
        if floor_of(dep) < floor_of(module)
    ]
    assert not upward, "imports from a lower room to a higher one: " + "; ".join(upward)


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


def test_run_stage_reads_as_a_short_list_of_steps():
    tree = ast.parse((PACKAGE / "stages" / "run.py").read_text())
    run_stage = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "run_stage")
    assert run_stage.end_lineno - run_stage.lineno < 60


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
    """`pip install .` (not editable) copies only .py files and the package-data globs: a built-in recipe,
    an accelerate config or a benchmark recipe outside them would be missing from an installed package."""
    import tomllib

    globs = tomllib.loads((PACKAGE.parents[1] / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]["vlm_recipes"]
    data_files = [
        p
        for p in PACKAGE.rglob("*")
        if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts
    ]
    assert len(data_files) >= 11  # five recipes, four accelerate configs, two benchmark recipes
    unshipped = [
        str(p.relative_to(PACKAGE))
        for p in data_files
        if not any(p.relative_to(PACKAGE).match(g) for g in globs)
    ]
    assert not unshipped, f"add to [tool.setuptools.package-data] in pyproject.toml: {unshipped}"
