"""A disk that fills while a dataset is read: the rows' Arrow file (data/arrow_rows.py) keeps every row
whichever chunk the disk fills at, and datasets' own cache files (its map) filling the disk stop `data check`
and a stage with one message and exit 4, no traceback. The disk is a real small tmpfs where one can be
mounted (root), else the writer's error is raised in its place."""

from __future__ import annotations

import errno
import logging
import shutil
from pathlib import Path

import datasets
import datasets.arrow_writer
import pyarrow as pa
import pytest
from PIL import Image
from test_data_rows_on_disk import chat_row, write_jsonl
from test_disk_faults import small_disks  # noqa: F401 (a fixture)

from vlm_recipes.cli.data_check import main as data_main
from vlm_recipes.cli.train import main as train_main
from vlm_recipes.data import arrow_rows
from vlm_recipes.data.sources import read_source
from vlm_recipes.errors import DiskFull
from vlm_recipes.files import read_json

CHUNK = 1000  # rows a chunk: ~128 KB of chat rows in Arrow, 32 tmpfs pages
# pyarrow's own error for a full disk (as the 3 MB tmpfs gave it): an errno, no file named
ARROW_NO_SPACE = "Error writing bytes to file. Detail: [errno 28] No space left on device"


def fill_leaving(directory: Path, free: int) -> None:
    """`directory`'s disk filled until `free` bytes are left."""
    with (directory / "filler.bin").open("ab") as filler:
        while (left := shutil.disk_usage(directory).free) > free:
            filler.write(bytes(min(left - free, 2**20)))
            filler.flush()


@pytest.fixture(params=["tmpfs", "raised"])
def rows_disk(request, tmp_path, monkeypatch) -> tuple[str, Path]:
    """The cache whose rows/ folder is the disk that fills: a 2 MB tmpfs, or a folder (mode "raised")."""
    cache = tmp_path / "cache"
    if request.param == "tmpfs":
        request.getfixturevalue("small_disks")(cache / "rows", "2m")
    monkeypatch.setenv("VLM_RECIPES_CACHE", str(cache))
    monkeypatch.setattr(arrow_rows, "_directory", None)  # this process's rows folder made there
    return request.param, cache / "rows"


def chunk_bytes(rows: list[dict]) -> int:
    table = pa.Table.from_pylist(rows)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.tell()


def test_a_disk_that_fills_at_the_third_chunk_keeps_every_row(rows_disk, tmp_path, monkeypatch, caplog):
    """3,500 rows in chunks of 1,000; the disk fills in the third chunk's write (a real tmpfs left room for
    2.5 chunks; or the write cut half-way, then pyarrow's error raised). Every row is read, in order: the two
    chunks written come back from the file, which is then removed. (Before: the file was deleted with its
    2,000 rows, and 1,500 were read.)"""
    mode, rows_folder = rows_disk
    monkeypatch.setattr(arrow_rows, "CHUNK_ROWS", CHUNK)
    rows = [chat_row(i) for i in range(3500)]
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    if mode == "tmpfs":
        fill_leaving(rows_folder, int(2.5 * chunk_bytes(rows[:CHUNK])))
    else:
        real, writes = pa.ipc.RecordBatchStreamWriter.write_table, []

        def write_table(self, table, *args, **kwargs):
            writes.append(table.num_rows)
            if len(writes) == 3:  # the third chunk: half of it written, then the disk is full
                real(self, table.slice(0, table.num_rows // 2))
                raise OSError(errno.ENOSPC, ARROW_NO_SPACE)
            return real(self, table, *args, **kwargs)

        monkeypatch.setattr(pa.ipc.RecordBatchStreamWriter, "write_table", write_table)
    with caplog.at_level(logging.WARNING, logger="vlm_recipes.data.arrow_rows"):
        loaded = read_source(str(path), "train")
    assert len(loaded.ds) == len(rows) and not loaded.ds.cache_files
    assert loaded.ds.to_list() == datasets.Dataset.from_list(rows).to_list()
    assert "the 2,000 rows written are read back" in caplog.text, caplog.text
    assert "No space left on device" in caplog.text
    assert list(loaded.where)[-1] == f"{path}:line 3500"
    assert not list(rows_folder.rglob("rows-*.arrow")), "the file cut short is removed"


def image_rows(directory: Path, count: int) -> Path:
    """`count` chat rows, each with the one small JPEG."""
    (directory / "images").mkdir(parents=True)
    Image.new("RGB", (32, 32), "red").save(directory / "images" / "a.jpg")
    return write_jsonl(
        directory / "train.jsonl", [chat_row(i) | {"images": ["images/a.jpg"]} for i in range(count)]
    )


def fill_at_datasets_map(mode: str, rows_folder: Path, rows: Path, monkeypatch) -> None:
    """The disk fills at datasets' first map over the rows (its cache file is written beside their table):
    a real tmpfs with room for the rows' table and half as much again, or datasets' writer raising the error
    a full disk gave it (an errno, no file named)."""
    if mode == "tmpfs":
        fill_leaving(rows_folder, int(1.5 * rows.stat().st_size))  # the table is about the JSON's size
        return
    real = datasets.arrow_writer.ArrowWriter.write_table

    def write_table(self, *args, **kwargs):
        if self._path is not None:  # a cache file on disk (not a map kept in memory)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(datasets.arrow_writer.ArrowWriter, "write_table", write_table)


def test_data_check_whose_datasets_map_fills_the_disk_exits_4_naming_the_cache(
    rows_disk, tmp_path, monkeypatch, capsys, demo_model_dir
):
    """As seen on an 8 MB disk: the rows' table fits, datasets' map (the image paths) then fills the disk.
    One message naming the rows' folder, its free space and VLM_RECIPES_CACHE; exit 4, no traceback.
    (Before: datasets' OSError and its traceback.)"""
    mode, rows_folder = rows_disk
    rows = image_rows(tmp_path / "data", 2000)
    fill_at_datasets_map(mode, rows_folder, rows, monkeypatch)
    code = data_main(["check", str(rows), f"model={demo_model_dir}"])
    err = capsys.readouterr().err
    assert code == DiskFull.exit_code == 4, err
    assert "Traceback" not in err
    assert "error: the disk is full: writing a dataset's cache files failed (No space left on device)" in err
    assert f"under {rows_folder} (" in err and "VLM_RECIPES_CACHE moves it" in err
    assert "at a folder on a disk with room" in err


@pytest.mark.e2e
def test_a_stage_whose_datasets_map_fills_the_disk_stops_with_exit_4_and_the_resume_command(
    tmp_path, monkeypatch, capsys, demo_model_dir
):
    """The same in a stage's data check (before the model loads): exit 4 with the cache's message and the
    --resume command; run.json records it. (Before: the run's disk was blamed, `writing <run dir>`.)"""
    monkeypatch.setenv("VLM_RECIPES_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(arrow_rows, "_directory", None)
    rows = image_rows(tmp_path / "data", 8)
    fill_at_datasets_map("raised", tmp_path / "cache" / "rows", rows, monkeypatch)
    run = ["--recipe", "r1-llm-only", "--output-dir", str(tmp_path / "runs"), "--run-name", "x"]
    code = train_main([*run, f"model={demo_model_dir}", f"data.train={rows}", "data.eval=null"])
    err = capsys.readouterr().err
    assert code == 4, err
    assert "Traceback" not in err
    assert "writing a dataset's cache files failed" in err
    assert f"under {tmp_path / 'cache' / 'rows'} (" in err and "--resume" in err
    record = read_json(tmp_path / "runs" / "r1-llm-only" / "x" / "run.json")
    assert (record["status"], record["exit_code"]) == ("failed", 4), record
    assert "VLM_RECIPES_CACHE" in record["error"]
