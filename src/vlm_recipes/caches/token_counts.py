"""Token counts per sample (always on): the length check before loading reads them instead of running the
processor again over the same rows."""

from __future__ import annotations

import json
from collections.abc import Callable

from vlm_recipes.caches.keys import (
    TOKEN_COUNT_LIBRARIES,
    content_digest,
    processor_digest,
    row_parts,
    versions_key,
)
from vlm_recipes.files import cache_dir, write_json


def remembered_token_counts(
    rows, processor, count: Callable[[], list[tuple[int, int]]], settings: str = ""
) -> list[tuple[int, int]]:
    """`count()`, remembered on disk under a key of the rows (messages, images, videos), the processor
    and the `settings` the count also depends on (video sampling): the next stage on the same data, the
    next run or another seed skips the recount."""
    parts = [processor_digest(processor), *([settings] if settings else [])]
    for row in rows:
        parts += row_parts(row)
    parts.append(versions_key(*TOKEN_COUNT_LIBRARIES))
    path = cache_dir() / "token-counts" / f"{content_digest(*parts)}.json"
    if path.exists():
        return [tuple(pair) for pair in json.loads(path.read_text())]
    counts = count()
    write_json(path, counts)
    return counts
