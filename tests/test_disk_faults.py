"""Faults from the disk: a disk that fills at any write of a run stops it with one message and the way on,
and loses nothing; a cache entry that cannot be read as written is a miss; a cache directory that cannot be
written turns that cache off. ENOSPC is injected at each write point (a real small filesystem needs root
to mount); the speed-up caches' damaged entries are in test_speedups.py (the weights, bit for bit)."""

from __future__ import annotations

import errno
import json
import logging
from pathlib import Path

import pytest
import torch
import transformers.modeling_utils
from safetensors.torch import save_file

import vlm_recipes.files
from vlm_recipes.caches.storage import EntryStore, unwritable, write_entry
from vlm_recipes.caches.token_counts import remembered_token_counts
from vlm_recipes.cli.train import main
from vlm_recipes.errors import DiskFull
from vlm_recipes.files import read_json
from vlm_recipes.methods import checkpoints as stage_checkpoints
from vlm_recipes.stages import disk_full

RUN = [
    "--recipe",
    "r3-two-stage",
    "--max-steps",
    "2",
    "training.save_steps=1",
    "training.per_device_batch_size=4",
    "data.max_train_samples=8",
    "data.max_eval_samples=2",
    "evaluation.max_new_tokens=2",
    "precision=fp32",
]


def no_space(path) -> OSError:
    return OSError(errno.ENOSPC, "No space left on device", str(path))


# --------------------------------------------------------------------------- a full disk


def test_a_full_disk_is_read_from_the_error_chain_or_the_free_space(tmp_path, monkeypatch):
    try:
        try:
            raise no_space(tmp_path / "x")
        except OSError as inner:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos") from inner
    except RuntimeError as chained:
        assert disk_full.is_disk_full(chained, tmp_path)
    alone = RuntimeError("basic_ios::clear: iostream error")  # torch.save's C++ stream: no errno
    assert not disk_full.is_disk_full(alone, tmp_path), "plenty of space here"
    monkeypatch.setattr(disk_full, "free_bytes", lambda where: 1024)
    assert disk_full.is_disk_full(alone, tmp_path)
    assert not disk_full.is_disk_full(ValueError("a bug"), tmp_path), "only I/O errors"


def test_what_a_full_disk_left_half_written_is_removed_and_nothing_else(tmp_path):
    stage = tmp_path / "stage-2-llm-lora"
    kept = [stage / "checkpoints" / "checkpoint-1" / "COMPLETE", stage / "metrics.json"]
    cut = [stage / "checkpoints" / "checkpoint-2" / "trainable.safetensors", stage / "final.partial" / "a"]
    for path in [*kept, *cut, stage / "metrics.json.x1y2.tmp"]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
    removed = disk_full.remove_half_written([tmp_path / "stage-1-vision-full", stage])
    assert sorted(p.name for p in removed) == ["checkpoint-2", "final.partial", "metrics.json.x1y2.tmp"]
    assert all(p.exists() for p in kept) and not any(p.exists() for p in cut)


def fill_disk_at(monkeypatch, point: str) -> None:
    """ENOSPC at one write of stage 2, as a filling disk raises it there."""

    def stage_2(path) -> bool:
        return "stage-2-" in str(path)

    if point == "checkpoint":
        real = stage_checkpoints.save_file

        def save(tensors, filename, *args, **kwargs):
            if stage_2(filename):
                raise no_space(filename)
            real(tensors, filename, *args, **kwargs)

        monkeypatch.setattr(stage_checkpoints, "save_file", save)
    elif point == "final":
        real_save = transformers.modeling_utils.safe_save_file

        def save_weights(tensors, filename, *args, **kwargs):
            if stage_2(filename) and "final.partial" in str(filename):
                raise no_space(filename)
            return real_save(tensors, filename, *args, **kwargs)

        monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", save_weights)
    else:  # metrics.json, predictions.jsonl, run.json (after stage 2): our own atomic writes
        real_write = vlm_recipes.files.write_atomically

        def write(path, writer):
            path = Path(path)
            after_stage_2 = (path.parent / "stage-2-llm-lora" / "DONE").exists()  # for run.json
            if path.name == point and (stage_2(path) or (point == "run.json" and after_stage_2)):
                raise no_space(path)
            real_write(path, writer)

        monkeypatch.setattr(vlm_recipes.files, "write_atomically", write)


@pytest.mark.e2e
@pytest.mark.parametrize("point", ["checkpoint", "final", "metrics.json", "predictions.jsonl", "run.json"])
def test_a_disk_filling_in_stage_2_stops_with_one_message_and_resume_completes(
    tmp_path, capsys, monkeypatch, private_demo_cache, point
):
    args = [*RUN, "--output-dir", str(tmp_path), "--run-name", "full"]
    with monkeypatch.context() as full:
        fill_disk_at(full, point)
        code = main(args)
    err = capsys.readouterr().err
    assert code == DiskFull.exit_code == 4, err
    assert "Traceback" not in err
    assert "error: the disk is full" in err and "No space left on device" in err
    assert "--resume" in err and "finished stages are kept" in err
    if point != "run.json":
        assert "Stage 2 `llm-lora` writes about" in err and "GB (final/ and its checkpoints)" in err
    run_dir = tmp_path / "r3-two-stage" / "full"
    assert (run_dir / "stage-1-vision-full" / "DONE").exists()
    assert (run_dir / "stage-2-llm-lora" / "DONE").exists() == (point == "run.json")
    assert not list(run_dir.rglob("*.tmp")) and not list(run_dir.rglob("final.partial"))
    if point != "run.json":  # run.json itself could not be written: the exit code and message say it
        record = read_json(run_dir / "run.json")
        assert (record["status"], record["exit_code"]) == ("failed", 4) and "disk is full" in record["error"]

    assert main([*args, "--resume"]) == 0
    assert read_json(run_dir / "run.json")["status"] == "finished"
    assert (run_dir / "stage-2-llm-lora" / "DONE").exists()


# --------------------------------------------------------------------------- damaged cache entries


def entry(directory: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    tensors = {"pixel_values": torch.arange(4096, dtype=torch.float32).reshape(64, 64)}
    path = directory / "ab" / "entry.safetensors"
    write_entry(path, tensors, None)
    return path, tensors


@pytest.mark.parametrize("damage", ["cut short", "garbled", "empty", "no digest"])
def test_a_damaged_cache_entry_is_a_miss_deleted_and_counted(tmp_path, caplog, damage):
    path, tensors = entry(tmp_path)
    store = EntryStore("preprocessed", None)
    assert torch.equal(store.read(path)["pixel_values"], tensors["pixel_values"]) and store.damaged == 0
    data = path.read_bytes()
    if damage == "cut short":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbled":  # the header parses; a few bytes of the tensor changed
        path.write_bytes(data[:-100] + bytes(b ^ 1 for b in data[-100:-90]) + data[-90:])
    elif damage == "empty":
        path.write_bytes(b"")
    else:  # an entry written before entries carried a digest
        save_file(tensors, str(path))
    with caplog.at_level(logging.WARNING, logger="vlm_recipes.caches.storage"):
        assert store.read(path) is None
    assert store.damaged == 1 and not path.exists()
    assert "damaged entry" in caplog.text and "made again" in caplog.text
    assert store.read(path) is None and store.damaged == 1, "then simply missing"
    assert store.stats() == {"damaged": 1}


def test_a_damaged_token_count_entry_is_counted_again(tmp_path, monkeypatch, private_demo_cache):
    from transformers import AutoProcessor

    from vlm_recipes.demo.models import ensure_demo_model

    processor = AutoProcessor.from_pretrained(ensure_demo_model("demo:tiny-qwen2-vl"))
    monkeypatch.setenv("VLM_RECIPES_CACHE", str(tmp_path))
    rows, counted = [{"messages": [{"role": "user", "content": f"hi {i}"}]} for i in range(3)], []

    def count():
        counted.append(1)
        return [(5, 0)] * 3

    assert remembered_token_counts(rows, processor, count) == [(5, 0)] * 3
    path = next((tmp_path / "token-counts").glob("*.json"))
    for damaged in ("[[5, 0], [5", json.dumps([[5, 0]]), "null", json.dumps([[5, "0"]] * 3)):
        path.write_text(damaged)
        assert remembered_token_counts(rows, processor, count) == [(5, 0)] * 3
    assert len(counted) == 5, "each damaged entry counted again, and rewritten"
    assert remembered_token_counts(rows, processor, count) == [(5, 0)] * 3 and len(counted) == 5


# --------------------------------------------------------------------------- a cache that cannot be written


def test_a_cache_directory_that_cannot_be_written_turns_writing_off_and_the_reads_go_on(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    assert "a-file" in unwritable(blocker / "vision-features")
    assert unwritable(tmp_path / "fine") is None
    store = EntryStore("vision-features", None)
    with caplog.at_level(logging.WARNING, logger="vlm_recipes.caches.storage"):
        store.write(blocker / "ab" / "x.safetensors", {"x": torch.zeros(2)})
        store.write(blocker / "ab" / "y.safetensors", {"x": torch.zeros(2)})
    assert store.writes_off and "a-file" in store.writes_off
    assert caplog.text.count("cannot write") == 1, "said once"
    assert store.stats()["writes_off"] == store.writes_off


@pytest.mark.e2e
def test_a_stage_whose_cache_directory_cannot_be_written_trains_without_it(
    tmp_path, monkeypatch, private_demo_cache
):
    """The cache root is under a file (what a read-only or full disk makes of it: every write refused):
    the stage trains, and report.json says each cache is off and why."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("VLM_RECIPES_SPEEDUP_CACHE", str(blocker / "speedups"))
    args = [
        "--recipe",
        "r1-llm-only",
        "--max-steps",
        "1",
        "data.max_train_samples=4",
        "evaluation.generate=false",
    ]
    caches = ["training.preprocessed_cache=true", "training.vision_feature_cache=true"]
    assert main([*args, *caches, "--output-dir", str(tmp_path / "runs"), "--run-name", "ro"]) == 0
    report = read_json(next((tmp_path / "runs").rglob("report.json")))
    decisions = {d["guard"]: d for d in report["decisions"]}
    for guard in ("preprocessed-cache", "vision-feature-cache"):
        assert decisions[guard]["choice"] == "off" and "cannot be written" in decisions[guard]["reason"]
