"""A dataset read in parallel: its rows checked (rows.py) and their tokens counted (lengths.py) by datasets'
map over contiguous shards, one process per core, when the rows are many enough to pay for the processes.
The results are the ones one process gives, in the rows' order."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import datasets

log = logging.getLogger(__name__)

# A process reads at least this many rows: below it, starting one costs more than it saves (a row ~1 ms)
MIN_ROWS_PER_PROCESS = 2000


def parallel_processes(rows: int) -> int:
    """How many processes read `rows` rows: one per core this process may run on, each with at least
    MIN_ROWS_PER_PROCESS rows (the demo's and the tests' datasets: one, this process)."""
    return max(1, min(len(os.sched_getaffinity(0)), rows // MIN_ROWS_PER_PROCESS))


def per_row(ds: datasets.Dataset, function: Callable[[dict], list], what: str) -> list[list]:
    """`function(row)` (a list of plain values) for every row, in the rows' order: in this process, or over
    contiguous shards in several where the rows are many (`what`: the log's and the progress bar's words)."""
    processes = parallel_processes(len(ds))
    if processes == 1:
        return [function(row) for row in ds]
    log.info("  %s: %d rows in %d processes", what, len(ds), processes)
    done = ds.map(
        lambda row: {"value": function(row)}, num_proc=processes, remove_columns=ds.column_names, desc=what
    )
    return done["value"]
