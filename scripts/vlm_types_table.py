"""The generic role finder over every model type transformers maps to AutoModelForImageTextToText: each
type's default config built on the meta device (no weights, no download), its roles found or the reason
not, as the Markdown table in docs/results/model-types.md, which docs/families.md links to.

    python scripts/vlm_types_table.py            # write the table into docs/results/model-types.md
    python scripts/vlm_types_table.py --check    # exit 1 if the table there is not what this gives
    python scripts/vlm_types_table.py --print    # print it, the doc untouched

The work is vlm_recipes.families.generic_table's; this is its command line.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from vlm_recipes.families.generic_table import markdown_table, table_in, type_rows, with_table

DOC = Path(__file__).resolve().parents[1] / "docs" / "results" / "model-types.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the doc's table is stale")
    parser.add_argument("--print", action="store_true", help="print the table, leave the doc as it is")
    parser.add_argument("--doc", type=Path, default=DOC)
    args = parser.parse_args(argv)

    began = time.perf_counter()
    rows = type_rows()
    table = markdown_table(rows)
    slowest = max(rows, key=lambda row: row.seconds)
    print(
        f"{len(rows)} model types built on meta in {time.perf_counter() - began:.1f} s "
        f"(slowest: {slowest.model_type}, {slowest.seconds:.1f} s)",
        file=sys.stderr,
    )
    if args.print:
        print(table)
        return 0
    document = args.doc.read_text()
    if args.check:
        if table_in(document) == table:
            print(f"{args.doc}: the table is current", file=sys.stderr)
            return 0
        print(f"{args.doc}: the table is stale; run python scripts/vlm_types_table.py", file=sys.stderr)
        return 1
    args.doc.write_text(with_table(document, table))
    print(f"{args.doc}: table written", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
