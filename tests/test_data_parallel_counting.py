"""A dataset read in parallel (data/parallel.py: datasets' map over contiguous shards, one process per core):
the row checks and the length check's token counts the same, in the same order, as one process gives; a bad
row and a refused image named at their row in either; a small dataset read in the process itself."""

from __future__ import annotations

import json
import logging

import datasets
import pytest
from conftest import single_image_demo_file
from PIL import Image

from vlm_recipes.data import parallel
from vlm_recipes.data.lengths import RefusedImages, sample_token_counts
from vlm_recipes.data.parallel import parallel_processes
from vlm_recipes.data.rows import load_split, undecoded
from vlm_recipes.errors import DataError
from vlm_recipes.families.qwen2_vl import QWEN2_VL
from vlm_recipes.machine import Cores, usable_cores
from vlm_recipes.model.build import load_processor
from vlm_recipes.recipes.schema import DataSettings


@pytest.fixture(scope="module")
def rows_and_processor(demo_model_dir, tmp_path_factory):
    """The demo's one-image rows, many times over with their images of several sizes, undecoded as the check
    reads them."""
    directory = tmp_path_factory.mktemp("many")
    one_image = [json.loads(line) for line in single_image_demo_file(directory).read_text().splitlines()]
    rows = [
        {**row, "id": f"{i}", "messages": said_again(row["messages"], i // len(one_image))}
        for i, row in enumerate(one_image * 4)
    ]
    rows[-5]["images"] = ["no-such-image.png"]  # a bad row, in the second process's shard
    path = directory / "many.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    ds, skipped = load_split(str(path), "train", None, on_bad_sample="skip")
    bad_id = str(len(rows) - 5)
    assert skipped == {"image not found": 1} and bad_id not in ds["id"]
    processor = load_processor(str(demo_model_dir), DataSettings(), QWEN2_VL)
    return undecoded(ds), processor, path, bad_id


def said_again(messages: list[dict], times: int) -> list[dict]:
    """The conversation with its question's text longer by `times` words: each copy of a row counts apart."""
    first, *rest = messages
    parts = [
        {**part, "text": part["text"] + " again" * times} if part.get("type") == "text" else part
        for part in first["content"]
    ]
    return [{**first, "content": parts}, *rest]


def counts_in(ds: datasets.Dataset, processor, processes: int, monkeypatch) -> list[tuple[int, int]]:
    """The counts with the rows split over `processes` processes (a process's share lowered to force it)."""
    monkeypatch.setattr(parallel, "MIN_ROWS_PER_PROCESS", max(1, len(ds) // processes))
    monkeypatch.setattr(parallel, "usable_cores", lambda: Cores(processes))  # cores mocked: 2 or more
    assert parallel_processes(len(ds)) == processes
    return sample_token_counts(ds, processor, QWEN2_VL)


def test_counting_in_two_processes_gives_one_process_counts_in_order(rows_and_processor, monkeypatch):
    ds, processor, _, _ = rows_and_processor
    one = counts_in(ds, processor, 1, monkeypatch)
    two = counts_in(ds, processor, 2, monkeypatch)
    assert len(one) == len(ds) > 100
    assert two == one  # every row's (text, image) tokens, in the rows' order
    assert len({vision for _, vision in one}) > 3  # images of several sizes, questions of several lengths:
    assert one[: len(one) // 2] != one[len(one) // 2 :]  # no two shards alike, so an order mixed up shows


def test_a_refused_image_is_named_at_its_row_in_either(rows_and_processor, tmp_path, monkeypatch):
    ds, processor, _, _ = rows_and_processor
    strip = tmp_path / "strip.png"
    Image.new("RGB", (2400, 4)).save(strip)  # Qwen: "absolute aspect ratio must be smaller than 200"
    late = len(ds) - 3  # in the second process's shard
    images = [
        [{"path": str(strip), "bytes": None}] if i == late else row for i, row in enumerate(ds["images"])
    ]
    bad = ds.remove_columns("images").add_column("images", images, feature=ds.features["images"])
    for processes in (1, 2):
        with pytest.raises(RefusedImages) as refused:
            counts_in(bad, processor, processes, monkeypatch)
        assert list(refused.value.rows) == [late] and "4x2400 px" in refused.value.rows[late]


def test_checking_rows_in_two_processes_finds_what_one_process_finds(rows_and_processor, monkeypatch):
    """The file's rows checked (each image opened and read through) in one and in two processes: the same bad
    rows, named by their ids, and the same rows kept, in order."""
    _, _, path, bad_id = rows_and_processor
    read = {}
    for processes in (1, 2):
        monkeypatch.setattr(parallel, "MIN_ROWS_PER_PROCESS", 60)
        monkeypatch.setattr(parallel, "usable_cores", lambda n=processes: Cores(n))
        with pytest.raises(DataError) as refused:
            load_split(str(path), "train", None)
        ds, skipped = load_split(str(path), "train", None, on_bad_sample="skip")
        read[processes] = (str(refused.value), skipped, ds["id"])
    assert read[2] == read[1]
    assert f"many.jsonl:line {int(bad_id) + 1}" in read[1][0] and "image not found" in read[1][0]


def test_a_small_dataset_is_counted_in_this_process():
    assert parallel_processes(50) == 1
    many = parallel.MIN_ROWS_PER_PROCESS * 64
    assert parallel_processes(many) == min(usable_cores().count, parallel.MAX_PROCESSES)


def test_the_processes_are_said_in_the_log_with_why(monkeypatch, caplog):
    """The choice and its reason in the log; past MAX_PROCESSES, not one process per core."""
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(parallel, "usable_cores", lambda: Cores(64))  # 64 cores mocked
    monkeypatch.setattr(parallel, "MIN_ROWS_PER_PROCESS", 10)
    monkeypatch.setattr(parallel, "MAX_PROCESSES", 2)
    ds = datasets.Dataset.from_dict({"n": list(range(100))})
    odd = {n: ("odd", str(n)) for n in range(1, 100, 2)}
    assert parallel.problems_per_row(ds, lambda row: odd.get(row["n"]), "checking rows") == odd
    assert "checking rows: 100 rows in 2 processes (64 cores, 10+ rows each, at most 2)" in caplog.text
    assert parallel.processes_decision(15, 1) == (
        "15 rows in 1 process (under 20 rows: a second process costs more than it saves)"
    )
