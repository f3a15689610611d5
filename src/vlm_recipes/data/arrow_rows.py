"""Rows as they are read, written to an Arrow file a chunk at a time and memory-mapped back as a Dataset,
as datasets keeps its own cache: a split's rows are never all in Python at once, so reading a million rows
takes the memory of one chunk (the file's pages are the system's to drop).

The table's columns are those of every row, with the types all rows agree on, as `Dataset.from_list` over
all rows gives them. datasets' own writers (`Dataset.from_generator`, `ArrowWriter`) fix the columns and
types at the first batch, and a JSON file's rows may add a key late (a video row after image rows, an eval
column on some rows); so each chunk's schema is merged into the table's here, and where a later chunk adds
to it, the rows are read again with the whole schema known (the second pass is paid only by such files).

Where the file cannot be written (a read-only cache, or its disk or quota filling at any chunk), every row is
kept in memory: the chunks already written are read back from the file, then it is removed. Reading them back
costs a read of what is on disk, not a second parse of the source, and gives the same rows whichever chunk
the disk filled at; a split too large for memory then stops as out of memory, never with rows missing."""

from __future__ import annotations

import atexit
import bisect
import contextlib
import logging
import os
import shutil
import socket
import tempfile
from array import array
from collections.abc import Sequence
from pathlib import Path

import datasets
import pyarrow as pa

from vlm_recipes.errors import DataError
from vlm_recipes.files import cache_dir

log = logging.getLogger(__name__)

CHUNK_ROWS = 10_000  # rows held in Python at a time: a few tens of MB on chat rows


class RowsTable:
    """Rows added one at a time (`add`), each with where it was read; `finish` gives the Dataset, or None
    where a chunk after the first added columns or widened a type: then the rows are added again to a
    RowsTable made with this one's `schema`, which holds them all."""

    def __init__(self, schema: pa.Schema | None = None):
        self.schema, self.grew = schema, False
        self.first: tuple[dict, str] | None = (
            None  # the first row, which a row of another kind is named against
        )
        self.rows: list[dict] = []
        self.places: list[str] = []
        self.path: Path | None = None
        self.writer: pa.ipc.RecordBatchStreamWriter | None = None
        self.written = 0  # rows whose write to the file finished
        self.in_memory: list[pa.Table] | None = None  # where no file can be written

    def add(self, row: dict, at: str) -> None:
        if self.first is None:
            self.first = (row, at)
        self.rows.append(row)
        self.places.append(at)
        if len(self.rows) >= CHUNK_ROWS:
            self._flush()

    def finish(self) -> datasets.Dataset | None:
        if self.rows:
            self._flush()
        if self.writer is not None:
            try:
                self.writer.close()  # writes the stream's end marker: the disk may fill here too
            except OSError as error:
                self._keep_in_memory(error)
            self.writer = None
        if self.grew:
            self._discard()
            return None
        if self.schema is None:
            return datasets.Dataset.from_dict({})
        if self.in_memory is not None:
            return datasets.Dataset(datasets.table.InMemoryTable(pa.concat_tables(self.in_memory)))
        return datasets.Dataset.from_file(str(self.path))

    def _flush(self) -> None:
        rows, places = self.rows, self.places
        self.rows, self.places = [], []
        whole = with_every_key(rows)
        try:
            table = pa.Table.from_pylist(whole)
            merged = (
                table.schema
                if self.schema is None
                else pa.unify_schemas([self.schema, table.schema], promote_options="permissive")
            )
            if self.schema is not None and not merged.equals(self.schema):
                self.schema, self.grew = merged, True
            if self.grew:
                return  # the rows are read again with the whole schema: only the schema is wanted now
            if not table.schema.equals(merged):
                table = pa.Table.from_pylist(whole, schema=merged)  # this chunk left some column null
            self.schema = merged
            self._write(table)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, TypeError) as exc:
            raise self._kind_error(rows, places, exc) from exc

    def _write(self, table: pa.Table) -> None:
        if self.in_memory is not None:
            self.in_memory.append(table)
            return
        try:
            if self.writer is None:
                handle, name = tempfile.mkstemp(prefix="rows-", suffix=".arrow", dir=rows_directory())
                os.close(handle)
                self.path = Path(name)
                self.writer = pa.ipc.new_stream(str(self.path), table.schema)
            self.writer.write_table(table)
            self.written += table.num_rows
        except OSError as error:  # a full disk or a read-only cache: the rows are kept in memory instead
            self._keep_in_memory(error, table)

    def _keep_in_memory(self, error: OSError, table: pa.Table | None = None) -> None:
        """Every row so far in memory: the chunks written, read back from the file (then removed), and
        `table`, the chunk whose write failed."""
        log.warning(
            "  rows kept in memory: their table cannot be written under %s (%s)%s",
            cache_dir(),
            error,
            f"; the {self.written:,} rows written are read back" if self.written else "",
        )
        self.in_memory = self._written_back()
        self._discard()
        if table is not None:
            self.in_memory.append(table)

    def _written_back(self) -> list[pa.Table]:
        """The chunks whose write finished, read into memory: the batches up to `written` rows (a write cut
        short leaves part of a batch after them)."""
        if self.path is None or not self.written:
            return []
        batches, rows = [], 0
        with pa.OSFile(str(self.path)) as file:  # read, not memory-mapped: the file is removed next
            reader = pa.ipc.open_stream(file)
            while rows < self.written:
                batches.append(reader.read_next_batch())
                rows += batches[-1].num_rows
        return [pa.Table.from_batches(batches, schema=self.schema)]

    def _discard(self) -> None:
        if self.writer is not None:
            with contextlib.suppress(OSError):
                self.writer.close()
        if self.path is not None:
            self.path.unlink(missing_ok=True)
        self.writer, self.path = None, None

    def _kind_error(self, rows: list[dict], places: list[str], exc: Exception) -> DataError:
        """The first row giving a key another kind of value than the first row does, named; or the
        table's complaint where no such row is found."""
        first_row, first_at = self.first
        first = {key: json_kind(value) for key, value in first_row.items()}
        for row, at in zip(rows, places, strict=True):
            for key, value in row.items():
                if key in first and json_kind(value) != first[key]:
                    return DataError(
                        f"{at}: `{key}` is {json_kind(value)} but {first[key]} on {_line_of(first_at, at)}: "
                        f"give `{key}` the same kind of value in every row"
                    )
        return DataError(
            f"{first_at.rsplit(':line', 1)[0]}: rows cannot be read as one table ({exc}): check that every "
            "row has the same keys with the same kinds of values"
        )


def with_every_key(rows: list[dict]) -> list[dict]:
    """Each row with every key any row has, null where it has none: Arrow's from_pylist and datasets'
    from_list take the first row's keys only (a file whose video rows come after its image rows would lose
    `videos`)."""
    keys = dict.fromkeys(key for row in rows for key in row)
    return [{key: row.get(key) for key in keys} for row in rows]


def _line_of(first: str, at: str) -> str:
    """`line 1` where both rows are in one file, else the first row's whole place."""
    file, _, line = first.rpartition(":")
    return line if at.startswith(file + ":") else first


def json_kind(value) -> str:
    """The shape of a JSON value, nested lists and objects included (a list of strings vs of objects)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {json_kind(v)}" for k, v in sorted(value.items())) + "}"
    if isinstance(value, list):
        kinds = sorted({json_kind(v) for v in value})
        return f"a list of {' or '.join(kinds)}" if kinds else "a list"
    return {str: "a string", bool: "a boolean", int: "a number", float: "a number"}.get(type(value), "null")


class LinePlaces(Sequence[str]):
    """Where each row was read, `file:line N`, kept as the line numbers (4 bytes a row, not a string)."""

    def __init__(self) -> None:
        self.files: list[tuple[int, str]] = []  # (the first row read from it, file)
        self.lines = array("L")

    def add(self, file: str, line: int) -> None:
        if not self.files or self.files[-1][1] != file:
            self.files.append((len(self.lines), file))
        self.lines.append(line)

    def __len__(self) -> int:
        return len(self.lines)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        index = range(len(self))[index]
        file = self.files[bisect.bisect_right(self.files, (index, "\uffff")) - 1][1]
        return f"{file}:line {self.lines[index]}"


class NumberedPlaces(Sequence[str]):
    """`<source> row N` for each of a table's `rows` rows."""

    def __init__(self, source: str, rows: int) -> None:
        self.source, self.rows = source, rows

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return f"{self.source} row {range(self.rows)[index]}"


_directory: Path | None = None


def rows_directory() -> Path:
    """This process's folder for the rows' tables, under the vlm-recipes cache (on disk, where the system's
    temporary folder may be memory), removed as the process exits. A killed process's folder is removed by
    the next process on the same machine (the cache may be a network home shared by several)."""
    global _directory
    if _directory is None:
        root = cache_dir() / "rows"
        root.mkdir(parents=True, exist_ok=True)
        host = socket.gethostname()
        for folder in root.glob(f"{host}-*"):
            pid = folder.name.removeprefix(f"{host}-").partition("-")[0]
            if pid.isdigit() and not _running(int(pid)):
                shutil.rmtree(folder, ignore_errors=True)
        _directory = Path(tempfile.mkdtemp(prefix=f"{host}-{os.getpid()}-", dir=root))
        atexit.register(_remove, _directory, os.getpid())
    return _directory


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's
    return True


def _remove(folder: Path, owner: int) -> None:
    if os.getpid() == owner:  # not a forked worker exiting
        shutil.rmtree(folder, ignore_errors=True)
