"""The documentation names real tests: every `test_file::test_name` in README.md and docs/ (its folders
too) is a test function in tests/ (the family table's cells, each backed by the test it names, stay true when
a test is renamed). And docs/architecture.md's map names every module of the package, and only modules that
exist."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

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


def doc_stats():
    """scripts/doc_stats.py as a module (scripts/ is no package)."""
    spec = importlib.util.spec_from_file_location("doc_stats", REPO / "scripts" / "doc_stats.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def test_every_page_is_within_the_houses_limits():
    """README at most 15 KB, a docs page 30 KB; prose sentences a median of 20 words or fewer, none over 45
    (`python scripts/doc_stats.py --longest 3` shows the offenders)."""
    stats = doc_stats()
    over = {str(page.relative_to(REPO)): stats.over_limits(stats.page_stats(page)) for page in PAGES}
    assert len(over) > 10
    assert not {page: problems for page, problems in over.items() if problems}


def test_the_sentence_counter_sees_a_long_sentence_and_leaves_code_and_tables_out():
    stats = doc_stats()
    long = " ".join(["word"] * 50) + ". Short one."
    text = f"# A heading of many words\n\n{long}\n\n```\n{'code ' * 80}\n```\n\n| {'cell ' * 80} |\n- An item. Two.\n"
    assert [stats.words(s) for s in stats.sentences(text)] == [50, 2, 2, 1]


def anchors_of(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces to hyphens; a repeat
    gets -1, -2, ..."""
    found: set[str] = set()
    fenced = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if fenced or not (heading := re.match(r"#{1,6} (.+)", line)):
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in found:
            n += 1
            anchor = f"{slug}-{n}"
        found.add(anchor)
    return found


LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_every_link_between_the_pages_finds_its_page_and_heading():
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in anchors_of(linked):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
