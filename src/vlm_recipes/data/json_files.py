"""A `.json` or `.jsonl` file's rows, read one at a time with their line numbers, so that a file of a million
rows is never in memory whole: one object per line (JSONL), or a JSON array of objects, read a block at a
time. A UTF-8 byte-order mark and CRLF line ends (Windows tools write both) are read as the text around them.

Python's json has no incremental reader, and datasets' json loader (pyarrow's) neither names lines nor
reads a file whose rows differ in keys; so the array is cut into rows here, with json's raw_decode."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from vlm_recipes.errors import DataError

READ_CHARS = 1 << 20  # an array's text is read this much at a time
# An array element still not decoded at this length is taken as broken (no dataset row is this long; a
# broken one would otherwise read the rest of the file into memory before saying so)
MAX_ROW_CHARS = 64 * 2**20


def json_rows(path: Path) -> Iterator[tuple[int, dict | str]]:
    """Each row of the file in order, as (line number, the row) or, for one that is not a JSON object,
    (line number, what is wrong with it). A row of an array that cannot be decoded ends the array."""
    with path.open(encoding="utf-8-sig") as stream:
        start = stream.read(4096).lstrip()
    with path.open(encoding="utf-8-sig") as stream:
        if start.startswith("["):
            yield from _array_rows(stream)
        else:
            yield from _line_rows(stream, path, start.startswith("{"))


def _line_rows(stream: TextIO, path: Path, starts_with_object: bool) -> Iterator[tuple[int, dict | str]]:
    """One object per line; the first line that is not one, where the file opens with `{`, may be one
    pretty-printed object (a dataset_info.json named as data): a DataError says how it is read."""
    first = True
    for number, line in enumerate(stream, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            if first and starts_with_object:
                _refuse_one_object(path)
            yield number, exc.msg
            continue
        finally:
            first = False
        yield (number, row) if isinstance(row, dict) else (number, "not an object")


def _refuse_one_object(path: Path) -> None:
    """A DataError where the whole file is one JSON object (read only when small enough to be one)."""
    if path.stat().st_size > MAX_ROW_CHARS:
        return
    try:
        whole = json.loads(path.read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError:
        return  # one object per line, the first broken
    if isinstance(whole, dict):
        raise DataError(
            f"{path} is one JSON object, not rows (a JSON array, or one object per line); a LLaMA-Factory "
            f"dataset_info.json is read by naming an entry: {path}#<name>"
        )


def _array_rows(stream: TextIO) -> Iterator[tuple[int, dict | str]]:
    """A JSON array's elements, each with the line it starts on, read a block at a time: `text` holds what
    is read and not yet decoded from `at` on; `line` is the line number at `counted`."""
    decoder = json.JSONDecoder()
    text, at, counted, line, ended = stream.read(READ_CHARS), 0, 0, 1, False

    def read_more() -> bool:
        """Drop what is decoded, append the next block (at least as much as is held, so a long row is read
        in a few steps); False at the file's end."""
        nonlocal text, at, counted, line, ended
        if ended:
            return False
        line += text.count("\n", counted, at)
        text, at, counted = text[at:], 0, 0
        block = stream.read(max(READ_CHARS, len(text)))
        ended = not block
        text += block
        return not ended

    at = text.index("[") + 1
    while True:
        at = _skip_space(text, at)
        if at >= len(text):
            if read_more():
                continue
            return
        if text[at] == "]":
            return
        try:
            row, end = decoder.raw_decode(text, at)
        except json.JSONDecodeError as exc:
            if len(text) - at < MAX_ROW_CHARS and read_more():
                continue  # the element may run on into the next block
            line += text.count("\n", counted, at)
            yield line, f"{exc.msg} (the rest of the array is not read)"
            return
        line += text.count("\n", counted, at)
        counted = at
        yield (line, row) if isinstance(row, dict) else (line, "not an object")
        at = _skip_space(text, end)
        while at >= len(text) and read_more():
            at = _skip_space(text, at)
        if at < len(text) and text[at] == ",":
            at += 1


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t\r\n":
        at += 1
    return at
