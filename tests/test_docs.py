"""The documentation names real tests: every `test_file::test_name` in README.md and docs/ is a test function
in tests/ (the family table's cells, each backed by the test it names, stay true when a test is renamed)."""

from __future__ import annotations

import re

from conftest import REPO

TEST_REFERENCE = re.compile(r"`(test_[a-z0-9_]+)::(test_[a-z0-9_]+)")


def test_every_test_the_docs_name_exists():
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    named = {(page.name, *ref) for page in pages for ref in TEST_REFERENCE.findall(page.read_text())}
    assert len(named) > 50, "the family table alone names more"
    missing = []
    for page, module, name in sorted(named):
        source = REPO / "tests" / f"{module}.py"
        if not source.exists() or not re.search(rf"^def {name}\(", source.read_text(), re.MULTILINE):
            missing.append(f"{page}: {module}::{name}")
    assert not missing, "named in the docs, no such test:\n" + "\n".join(missing)
