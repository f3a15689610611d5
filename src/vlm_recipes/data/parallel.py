"""A dataset read in parallel: its rows checked (rows.py) and their tokens counted (lengths.py) by datasets'
map over contiguous shards, one process per core, when the rows are many enough to pay for the processes.
The results are the ones one process gives, in the rows' order."""

from __future__ import annotations

import logging
from collections.abc import Callable

import datasets
import pyarrow.compute as pc

from vlm_recipes.machine import Cores, usable_cores

log = logging.getLogger(__name__)

# A process reads at least this many rows: below it, starting one costs more than it saves (a row ~1 ms)
MIN_ROWS_PER_PROCESS = 2000
# Each process is a fork of this one (~0.55 GB resident on the demo model, most of it shared) sent the
# processor; past 16, the reads of the image files gain little and the memory adds up
MAX_PROCESSES = 16


def parallel_processes(rows: int, cores: Cores | None = None) -> int:
    """How many processes read `rows` rows: one per core this process may use (`usable_cores`: its CPU
    affinity or count, within its cgroup's CPU quota), each with at least MIN_ROWS_PER_PROCESS rows (the
    demo's and the tests' datasets: one, this process), at most MAX_PROCESSES."""
    cores = usable_cores() if cores is None else cores
    return max(1, min(cores.count, MAX_PROCESSES, rows // MIN_ROWS_PER_PROCESS))


def processes_decision(rows: int, processes: int, cores: Cores | None = None) -> str:
    """The log's words for parallel_processes' choice: `20,000 rows in 2 processes (2 cores, 2,000+ rows
    each, at most 16)`, the cores' limit named where there is one (`2 cores: cgroup quota 200000/100000 of
    16 on the machine; ...`)."""
    cores = usable_cores() if cores is None else cores
    if processes > 1:
        why = f"{cores}{';' if cores.limit else ','} {MIN_ROWS_PER_PROCESS:,}+ rows each, at most {MAX_PROCESSES}"
    elif cores.count == 1:
        why = str(cores)
    else:
        why = f"under {2 * MIN_ROWS_PER_PROCESS:,} rows: a second process costs more than it saves"
    return f"{rows:,} rows in {processes} process{'es' if processes > 1 else ''} ({why})"


def log_processes(what: str, rows: int, processes: int) -> None:
    """The choice logged where it is one to see: rows enough for a second process, or several processes."""
    if processes > 1 or rows >= MIN_ROWS_PER_PROCESS:
        log.info("  %s: %s", what, processes_decision(rows, processes))


def problems_per_row(
    ds: datasets.Dataset, problem_of: Callable[[dict], tuple[str, str] | None], what: str
) -> dict[int, tuple[str, str]]:
    """`problem_of(row)`, (reason, detail) or None, for every row: the rows with a problem by index (nothing
    kept for the others: a million rows). In this process, or over contiguous shards in several where the
    rows are many (`what`: the log's and the progress bar's words)."""
    processes = parallel_processes(len(ds))
    log_processes(what, len(ds), processes)
    if processes == 1:
        return {index: found for index, row in enumerate(ds) if (found := problem_of(row)) is not None}
    done = ds.map(
        lambda row: {"problem": list(problem_of(row) or ())},
        num_proc=processes,
        remove_columns=ds.column_names,
        features=datasets.Features({"problem": datasets.List(datasets.Value("string"))}),
        desc=what,
    )
    column = done.with_format("arrow")["problem"]  # read in Arrow: only the problems reach Python
    found = pc.indices_nonzero(pc.list_value_length(column))
    problems = column.take(found).to_pylist()
    return {index: tuple(problem) for index, problem in zip(found.to_pylist(), problems, strict=True)}
