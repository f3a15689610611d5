#!/usr/bin/env python
"""Each page's size and its sentences' lengths in words (prose only: code, tables and headings left out), for
README.md and docs/*.md, against the house's limits (README 15 KB, a docs page 30 KB; a median sentence of 20
words or fewer, none over 45).

    python scripts/doc_stats.py            # the table
    python scripts/doc_stats.py --longest 3   # and each page's three longest sentences
    python scripts/doc_stats.py --check    # exit 1 where a page is over a limit

Standard library only: a page is text, and the counting rules are ours (below), so no tokenizer is needed.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LIMITS_KB = {"README.md": 15}
PAGE_LIMIT_KB = 30
MEDIAN_LIMIT = 20
LONGEST_LIMIT = 45

# A sentence ends at . ! ? (after a closing bracket, quote or backtick too) before a space and a capital, a
# digit, a bracket, a quote or a backtick: "e.g. the" and "3.5 s" stay inside one.
SENTENCE_END = re.compile(r"(?<=[.!?])[)\"'`*_]*\s+(?=[A-Z0-9(\[`\"'*_])")
LIST_ITEM = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s+")


def prose_blocks(text: str) -> list[str]:
    """The page's prose: paragraphs and list items, each one string; fenced code, tables, headings, HTML and
    images left out."""
    blocks, current, fenced = [], [], False

    def close() -> None:
        if current:
            blocks.append(" ".join(current))
            current.clear()

    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith(("```", "~~~")):
            fenced = not fenced
            close()
            continue
        if fenced or not stripped or stripped.startswith(("#", "|", "<", "![", ">")):
            close()
            continue
        if LIST_ITEM.match(line):
            close()
            stripped = LIST_ITEM.sub("", line).strip()
        current.append(stripped)
    close()
    return blocks


def sentences(text: str) -> list[str]:
    """The page's prose sentences."""
    return [s.strip() for block in prose_blocks(text) for s in SENTENCE_END.split(block) if s.strip()]


def words(sentence: str) -> int:
    return len(sentence.split())


def page_stats(path: Path) -> dict:
    text = path.read_text(encoding="utf-8")
    found = sentences(text)
    lengths = [words(s) for s in found] or [0]
    return {
        "page": str(path.relative_to(REPO)),
        "kb": len(text.encode()) / 1024,
        "limit_kb": LIMITS_KB.get(path.name if path.parent == REPO else "", PAGE_LIMIT_KB),
        "sentences": len(found),
        "median": statistics.median(lengths),
        "longest": max(lengths),
        "longest_sentences": sorted(found, key=words, reverse=True),
    }


def over_limits(stats: dict) -> list[str]:
    problems = []
    if stats["kb"] > stats["limit_kb"]:
        problems.append(f"{stats['kb']:.1f} KB > {stats['limit_kb']} KB")
    if stats["median"] > MEDIAN_LIMIT:
        problems.append(f"median {stats['median']:g} words > {MEDIAN_LIMIT}")
    if stats["longest"] > LONGEST_LIMIT:
        problems.append(f"longest {stats['longest']} words > {LONGEST_LIMIT}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pages", nargs="*", type=Path, help="pages (default: README.md and docs/*.md)")
    parser.add_argument("--longest", type=int, default=0, help="print each page's N longest sentences")
    parser.add_argument("--check", action="store_true", help="exit 1 where a page is over a limit")
    args = parser.parse_args(argv)
    pages = [p.resolve() for p in args.pages] or [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    print(f"{'page':<32} {'KB':>6} {'limit':>6} {'sentences':>9} {'median':>6} {'longest':>7}  over")
    failed = False
    for path in pages:
        stats = page_stats(path)
        problems = over_limits(stats)
        failed |= bool(problems)
        print(
            f"{stats['page']:<32} {stats['kb']:6.1f} {stats['limit_kb']:6d} {stats['sentences']:9d} "
            f"{stats['median']:6g} {stats['longest']:7d}  {'; '.join(problems) or '-'}"
        )
        for sentence in stats["longest_sentences"][: args.longest]:
            print(f"    {words(sentence)} words: {sentence}")
    return 1 if args.check and failed else 0


if __name__ == "__main__":
    sys.exit(main())
