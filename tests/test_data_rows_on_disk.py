"""A split's rows read a chunk at a time into a memory-mapped Arrow file (data/arrow_rows.py), a JSON array a
block at a time (data/json_files.py): the same rows, places and errors as one read of everything, with the
memory of one chunk."""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import tracemalloc

import datasets
import pyarrow as pa
import pytest

from vlm_recipes.data import arrow_rows, json_files
from vlm_recipes.data.sources import read_source
from vlm_recipes.errors import DataError


def chat_row(i: int, **extra) -> dict:
    question = {"type": "text", "text": f"What colour is shape {i}? [a, b]"}
    return {
        "messages": [
            {"role": "user", "content": [{"type": "image"}, question]},
            {"role": "assistant", "content": [{"type": "text", "text": "red"}]},
        ],
        "images": [f"images/{i}.jpg"],
        **extra,
    }


def write_jsonl(path, rows: list[dict]):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_a_json_array_read_in_small_blocks_gives_every_row_at_its_line(tmp_path, monkeypatch):
    """Rows spread over lines as editors write them (indented, several on a line, a `]` and `,` inside a
    string, a byte-order mark, CRLF ends), read 7 characters at a time: the rows json.loads gives, each at the
    line its `{` is on."""
    rows = [chat_row(i) for i in range(5)]
    text = "\ufeff[\r\n  " + json.dumps(rows[0], indent=2).replace("\n", "\r\n") + ",\r\n"
    text += json.dumps(rows[1]) + ", " + json.dumps(rows[2]) + ",\r\n\r\n"
    text += json.dumps(rows[3]) + ",\r\n" + json.dumps(rows[4]) + "\r\n]\r\n"
    path = tmp_path / "rows.json"
    path.write_bytes(text.encode())
    expected_lines = [2, 2 + json.dumps(rows[0], indent=2).count("\n") + 1]
    expected_lines += [expected_lines[1], expected_lines[1] + 2, expected_lines[1] + 3]
    for block in (7, 1 << 20):
        monkeypatch.setattr(json_files, "READ_CHARS", block)
        read = list(json_files.json_rows(path))
        assert [row for _, row in read] == rows == json.loads(text.lstrip("\ufeff"))
        assert [line for line, _ in read] == expected_lines


def test_a_broken_array_element_ends_the_array_at_its_line(tmp_path, monkeypatch):
    monkeypatch.setattr(json_files, "READ_CHARS", 5)
    path = tmp_path / "rows.json"
    path.write_text(
        "[\n" + json.dumps(chat_row(0)) + ",\n" + '{"messages": [}' + ",\n" + json.dumps(chat_row(2)) + "\n]"
    )
    read = list(json_files.json_rows(path))
    assert read[0] == (2, chat_row(0))
    assert read[1][0] == 3 and "the rest of the array is not read" in read[1][1]
    assert len(read) == 2


def test_rows_read_in_chunks_are_the_table_of_all_rows(tmp_path, monkeypatch):
    """Chunks of 3 rows where later ones add what the first had not: a `videos` column (row 7), an `answers`
    column (row 5), a content part with a key of its own (row 8), a number that is a float (row 4). The table
    is the one Dataset.from_list makes of all rows at once, read back from a file (memory-mapped)."""
    monkeypatch.setattr(arrow_rows, "CHUNK_ROWS", 3)
    rows = [chat_row(i, score=1) for i in range(10)]
    rows[4]["score"] = 0.5
    rows[5]["answers"] = ["red", "crimson"]
    rows[7]["videos"] = ["clip.mp4"]
    rows[7]["messages"][0]["content"].insert(0, {"type": "video"})
    rows[8]["messages"][0]["content"][1]["note"] = "a key only this part has"
    loaded = read_source(str(write_jsonl(tmp_path / "train.jsonl", rows)), "train")
    keys = list(dict.fromkeys(key for row in rows for key in row))
    everything = datasets.Dataset.from_list([{key: row.get(key) for key in keys} for row in rows])
    assert loaded.ds.features == everything.features
    assert loaded.ds.to_list() == everything.to_list()
    assert loaded.ds.to_list()[7]["videos"] == ["clip.mp4"] and loaded.ds[4]["score"] == 0.5
    assert loaded.ds.cache_files and loaded.ds.cache_files[0]["filename"].endswith(".arrow")
    assert list(loaded.where) == [f"{tmp_path / 'train.jsonl'}:line {n}" for n in range(1, 11)]


def test_a_late_row_of_another_kind_is_named_at_its_line(tmp_path, monkeypatch):
    monkeypatch.setattr(arrow_rows, "CHUNK_ROWS", 3)
    rows = [chat_row(i, answers=["red"]) for i in range(10)]
    rows[7]["answers"] = 5
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    with pytest.raises(
        DataError, match=r"train.jsonl:line 8: `answers` is a number but a list of a string on line 1"
    ):
        read_source(str(path), "train")


def python_peak_mb(path) -> float:
    tracemalloc.start()
    try:
        read_source(str(path), "train")
        return tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()


def test_reading_takes_the_memory_of_a_chunk_not_of_the_rows(tmp_path, monkeypatch):
    """4x the rows, the same peak of Python memory: measured 2.5 and 2.6 MB at 5,000 and 20,000 rows (chunks
    of 1,000); reading all rows into Python first, as before, took 13.3 and 53.2 MB."""
    monkeypatch.setattr(arrow_rows, "CHUNK_ROWS", 1000)
    few = python_peak_mb(write_jsonl(tmp_path / "few.jsonl", [chat_row(i) for i in range(5000)]))
    many = python_peak_mb(write_jsonl(tmp_path / "many.jsonl", [chat_row(i) for i in range(20000)]))
    assert many < 1.5 * few, f"{few:.1f} MB at 5,000 rows, {many:.1f} MB at 20,000"
    assert many < 10


def test_rows_are_kept_in_memory_where_the_disk_is_full_simulated(tmp_path, monkeypatch, caplog):
    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(pa.ipc, "new_stream", full_disk)
    rows = [chat_row(i) for i in range(4)]
    with caplog.at_level(logging.WARNING, logger="vlm_recipes.data.arrow_rows"):
        loaded = read_source(str(write_jsonl(tmp_path / "train.jsonl", rows)), "train")
    assert not loaded.ds.cache_files
    assert loaded.ds.to_list() == datasets.Dataset.from_list(rows).to_list()
    assert "rows kept in memory" in caplog.text and "No space left on device" in caplog.text


def test_a_killed_process_rows_folder_is_removed_by_the_next_on_its_machine(monkeypatch, private_demo_cache):
    """A folder named for a process that is gone is removed; one of a live process, or of another machine
    sharing the cache, is kept."""
    root = private_demo_cache / "rows"
    host = socket.gethostname()
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    gone, live, elsewhere = (
        root / f"{host}-{dead}-x",
        root / f"{host}-{os.getppid()}-x",
        root / f"other-{dead}-x",
    )
    for folder in (gone, live, elsewhere):
        folder.mkdir(parents=True)
        (folder / "rows.arrow").write_bytes(b"rows")
    monkeypatch.setattr(arrow_rows, "_directory", None)
    made = arrow_rows.rows_directory()
    assert made.is_dir() and made.name.startswith(f"{host}-{os.getpid()}-")
    assert not gone.exists() and live.exists() and elsewhere.exists()
