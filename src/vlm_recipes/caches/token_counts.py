"""Token counts per sample (always on): the length check before loading reads them instead of running the
processor again over the same rows."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable
from pathlib import Path

from vlm_recipes.caches.keys import (
    TOKEN_COUNT_LIBRARIES,
    digest_of,
    processor_digest,
    row_parts,
    versions_key,
)
from vlm_recipes.files import cache_dir, write_atomically

log = logging.getLogger(__name__)


def remembered_token_counts(
    rows, processor, count: Callable[[], list[tuple[int, int]]], settings: str = ""
) -> list[tuple[int, int]]:
    """`count()`, remembered on disk under a key of the rows (messages, images, videos), the processor
    and the `settings` the count also depends on (video sampling): the next stage on the same data, the
    next run or another seed skips the recount."""
    n_rows = 0

    def parts():  # the rows' parts hashed as they are read: none kept (a million rows)
        nonlocal n_rows
        yield processor_digest(processor)
        yield from [settings] if settings else []
        for row in rows:
            yield from row_parts(row)
            n_rows += 1
        yield versions_key(*TOKEN_COUNT_LIBRARIES)

    path = cache_dir() / "token-counts" / f"{digest_of(parts())}.json"
    if path.exists() and (remembered := _read_counts(path, n_rows)) is not None:
        return remembered
    counts = count()
    try:  # one line, by json's C encoder: indented, a million pairs pass through millions of Python strings
        write_atomically(path, lambda tmp: Path(tmp).write_text(json.dumps(counts, separators=(",", ":"))))
    except OSError as error:  # a cache is only a copy: a full or read-only disk costs a recount next time
        log.warning("token counts cache: cannot write %s (%s): counted again next time", path, error.strerror)
    return counts


def _read_counts(path: Path, n_rows: int) -> list[tuple[int, int]] | None:
    """The remembered counts, one (text, image) pair of integers per row; None, with the entry deleted,
    where it is unreadable or not that (cut short, garbled)."""
    try:
        counts = [tuple(pair) for pair in json.loads(path.read_text())]
        if len(counts) == n_rows and all(len(c) == 2 and all(type(v) is int for v in c) for c in counts):
            return counts
        why = f"not {n_rows} pairs of integers"
    except (OSError, ValueError, TypeError) as error:
        why = str(error)
    log.warning("token counts cache: damaged entry %s (%s): deleted, counted again", path, why)
    with contextlib.suppress(OSError):
        path.unlink()
    return None
