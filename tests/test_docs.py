"""The documentation names real tests: every `test_file::test_name` in README.md and docs/ (its folders
too) is a test function in tests/ (the family table's cells, each backed by the test it names, stay true when
a test is renamed). And docs/architecture.md's map names every module of the package, and only modules that
exist."""

from __future__ import annotations

import ast
import re

from conftest import REPO

TEST_REFERENCE = re.compile(r"`(test_[a-z0-9_]+)::(test_[a-z0-9_]+)")


def test_every_test_the_docs_name_exists():
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]  # docs/families/, docs/results/ too
    named = {(page.name, *ref) for page in pages for ref in TEST_REFERENCE.findall(page.read_text())}
    assert len(named) > 50, "the family table alone names more"
    missing = []
    for page, module, name in sorted(named):
        source = REPO / "tests" / f"{module}.py"
        if not source.exists() or not re.search(rf"^def {name}\(", source.read_text(), re.MULTILINE):
            missing.append(f"{page}: {module}::{name}")
    assert not missing, "named in the docs, no such test:\n" + "\n".join(missing)


PACKAGE = REPO / "src" / "vlm_recipes"
MAP_ENTRY = re.compile(r"^- `([^`]+)`:", re.MULTILINE)  # a map entry: "- `data/rows.py`: what it does"


def modules_to_map() -> set[str]:
    """Every module of the package, by its path under src/vlm_recipes/; a package's `__init__.py` that holds
    only its docstring marks a folder and has nothing to map."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        body = ast.parse(path.read_text()).body
        if path.name == "__init__.py" and len(body) <= 1 and all(isinstance(n, ast.Expr) for n in body):
            continue
        found.add(path.relative_to(PACKAGE).as_posix())
    return found


def test_the_architecture_map_names_every_module_and_only_modules_that_exist():
    page = (REPO / "docs" / "architecture.md").read_text()
    named = set(MAP_ENTRY.findall(page[page.index("## Map of the package") :]))
    modules = modules_to_map()
    unmapped, gone = sorted(modules - named), sorted(n for n in named if not (PACKAGE / n).is_file())
    assert not unmapped, f"give these a line in docs/architecture.md's map: {unmapped}"
    assert not gone, f"docs/architecture.md's map names modules that do not exist: {gone}"
