"""The length check's token counts over many rows, in parallel (data/lengths.py: datasets' map over contiguous
shards, one process per core): the same counts, in the same order, as one process; a refused image named at
its row in either; a small dataset counted in the process itself."""

from __future__ import annotations

import json

import datasets
import pytest
from conftest import single_image_demo_file
from PIL import Image

from vlm_recipes.data import lengths
from vlm_recipes.data.lengths import RefusedImages, counting_processes, sample_token_counts
from vlm_recipes.data.rows import load_split, undecoded
from vlm_recipes.families.qwen2_vl import QWEN2_VL
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
    path = directory / "many.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    ds, _ = load_split(str(path), "train", None)
    processor = load_processor(str(demo_model_dir), DataSettings(), QWEN2_VL)
    return undecoded(ds), processor


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
    monkeypatch.setattr(lengths, "MIN_ROWS_PER_PROCESS", max(1, len(ds) // processes))
    monkeypatch.setattr(lengths.os, "sched_getaffinity", lambda pid: set(range(processes)))
    assert counting_processes(len(ds)) == processes
    return sample_token_counts(ds, processor, QWEN2_VL)


def test_counting_in_two_processes_gives_one_process_counts_in_order(rows_and_processor, monkeypatch):
    ds, processor = rows_and_processor
    one = counts_in(ds, processor, 1, monkeypatch)
    two = counts_in(ds, processor, 2, monkeypatch)
    assert len(one) == len(ds) > 100
    assert two == one  # every row's (text, image) tokens, in the rows' order
    assert len({vision for _, vision in one}) > 3  # images of several sizes, questions of several lengths:
    assert one[: len(one) // 2] != one[len(one) // 2 :]  # no two shards alike, so an order mixed up shows


def test_a_refused_image_is_named_at_its_row_in_either(rows_and_processor, tmp_path, monkeypatch):
    ds, processor = rows_and_processor
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


def test_a_small_dataset_is_counted_in_this_process():
    assert counting_processes(50) == 1
    assert counting_processes(lengths.MIN_ROWS_PER_PROCESS * 64) == len(lengths.os.sched_getaffinity(0))
