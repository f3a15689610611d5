"""Run directories: one writer each (a lock the kernel drops when its holder dies), run.json saying how a run
ended, outputs written durably and DONE's record of them, and comparison taking finished runs only."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import TRAIN

from vlm_recipes.cli.compare import main as compare_main
from vlm_recipes.cli.train import main
from vlm_recipes.comparison.run_summary import find_runs
from vlm_recipes.errors import RunBusyError
from vlm_recipes.files import FILE_DIGEST, publish_dir, read_json, write_json
from vlm_recipes.runs import layout
from vlm_recipes.runs.layout import finished_stage_problem, mark_done
from vlm_recipes.runs.lock import LOCK_HELD_ENV, lock_run_dir, release_run_lock
from vlm_recipes.runs.manifest import run_state

CONSOLE_SCRIPT = Path(sys.executable).parent / "vlm-recipes"
# r2's stage, short: a complete checkpoint every 2 steps, no generation (this is about the run directory)
QUICK = [
    "--recipe",
    "r2-vision-only",
    "--max-steps",
    "60",  # long enough to be killed after its first checkpoint, however fast the machine
    "training.save_steps=2",
    "training.per_device_batch_size=2",
    "data.max_eval_samples=4",
    "evaluation.generate=false",
]


def start(command: list[str], log: Path) -> subprocess.Popen:
    """A process with its output in a file (a pipe nobody reads would stall it)."""
    with log.open("w") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, text=True)


def wait_until(condition, seconds: float, what: str) -> None:
    deadline = time.time() + seconds
    while not condition():
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


@pytest.mark.e2e
def test_one_writer_per_run_dir_and_a_killed_run_resumes(tmp_path, private_demo_cache, demo_model_dir):
    run_dir = tmp_path / "r2-vision-only" / "same"
    args = [*QUICK, "--output-dir", str(tmp_path), "--run-name", "same"]
    entries = [
        [str(CONSOLE_SCRIPT), "train"] if CONSOLE_SCRIPT.is_file() else TRAIN,
        [sys.executable, "-m", "vlm_recipes"],
    ]
    # Two processes, the same run, started together (through both entries): one trains, one refuses.
    both = [start([*entry, *args], tmp_path / f"start-{i}.log") for i, entry in enumerate(entries)]
    wait_until(lambda: any(p.poll() is not None for p in both), 120, "one of the two to stop")
    loser = next(p for p in both if p.poll() is not None)
    winner = next(p for p in both if p is not loser)
    said = (tmp_path / f"start-{both.index(loser)}.log").read_text()
    assert loser.returncode == 2, said[-3000:]
    assert f"run directory {run_dir} is in use by process {winner.pid} on host" in said
    assert "Traceback" not in said

    # The one training is killed outright once a checkpoint is complete: it cannot say so, the lock can.
    checkpoints = run_dir / "stage-1-vision-full" / "checkpoints"
    wait_until(
        lambda: list(checkpoints.glob("checkpoint-*/COMPLETE")) or winner.poll() is not None,
        120,
        "a checkpoint",
    )
    assert winner.poll() is None, "the run ended before it could be killed"
    winner.kill()
    winner.wait()
    assert read_json(run_dir / "run.json")["status"] == "running"
    status, why = run_state(run_dir)
    assert status == "dead" and f"process {winner.pid}" in why and "--resume" in why

    # Two --resume at once: the kernel dropped the dead process's lock, so one continues; the other refuses.
    resumes = [start([*TRAIN, "--resume", str(run_dir)], tmp_path / f"resume-{i}.log") for i in range(2)]
    for process in resumes:
        process.wait(timeout=180)
    logs = [(tmp_path / f"resume-{i}.log").read_text() for i in range(2)]
    codes = [p.returncode for p in resumes]
    assert sorted(codes) == [0, 2], "\n".join(log[-2000:] for log in logs)
    refused = logs[codes.index(2)]
    assert f"is in use by process {resumes[codes.index(0)].pid} on host" in refused
    assert "resuming from" in logs[codes.index(0)]
    manifest = read_json(run_dir / "run.json")
    assert manifest["status"] == "finished" and manifest["stages"][0]["steps"] == 60


def test_a_refused_writer_names_the_holder_that_has_not_written_its_record_yet(tmp_path):
    """A holder writes who it is just after it takes the lock: a process refused in that moment read the last
    holder's record (a dead process) and named it, under load (the one-writer test above failed so once). It
    waits for the new record instead."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    dead = int(
        subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
        ).stdout
    )
    (run_dir / ".lock").write_text(
        json.dumps({"pid": dead, "host": socket.gethostname()})
    )  # the killed run's
    holder = os.open(run_dir / ".lock", os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the new holder: locked, its record not yet written

    def write_record():
        time.sleep(0.3)
        os.ftruncate(holder, 0)
        os.pwrite(holder, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode(), 0)

    writer = threading.Thread(target=write_record)
    writer.start()
    with pytest.raises(RunBusyError, match=f"in use by process {os.getpid()} on host"):
        lock_run_dir(run_dir)
    writer.join()
    os.close(holder)


def test_the_lock_is_reentrant_refuses_others_and_is_shared_with_launched_children(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lock_run_dir(run_dir)
    lock_run_dir(run_dir)  # the launcher, then its in-process stages: one holder
    assert json.loads((run_dir / ".lock").read_text())["pid"] == os.getpid()
    other = os.open(run_dir / ".lock", os.O_RDWR)  # another open file: as another process sees it
    with pytest.raises(BlockingIOError):
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    release_run_lock(run_dir)
    fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released: free for the next holder
    with pytest.raises(RunBusyError, match=f"in use by process {os.getpid()} on host"):
        lock_run_dir(run_dir)
    monkeypatch.setenv(LOCK_HELD_ENV, str(run_dir.resolve()))  # a child of the launcher holding it
    lock_run_dir(run_dir)
    os.close(other)


def test_a_directory_is_published_whole_each_file_fsynced_once_before_the_rename(tmp_path, monkeypatch):
    target, partial = tmp_path / "final", tmp_path / "final.partial"
    target.mkdir()
    (target / "old.bin").write_bytes(b"old")
    (partial / "sub").mkdir(parents=True)
    (partial / "model.safetensors").write_bytes(b"new")
    (partial / "sub" / "b.json").write_text("{}")
    synced, real_fsync = [], os.fsync

    def fsync(fd):
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    publish_dir(partial, target)
    files = [p for p in synced if p.name in ("model.safetensors", "b.json")]
    assert sorted(files) == [partial / "model.safetensors", partial / "sub" / "b.json"], "one pass, each once"
    assert synced.index(partial) > synced.index(partial / "sub"), "directories after what they hold"
    assert synced[-1] == tmp_path, "the rename is made durable: the parent fsynced after it"
    assert sorted(p.name for p in target.rglob("*")) == ["b.json", "model.safetensors", "sub"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"], "the old one moved aside and removed"


def finished_stage(stage: Path) -> Path:
    """A stage directory as a finished LoRA stage leaves it (small files), DONE written."""
    for name, data in {
        "final/config.json": b"{}",
        "final/model.safetensors": bytes(range(256)) * 64,
        "final/processor_config.json": b"{}",
        "adapter/adapter_model.safetensors": b"lora" * 100,
        "metrics.json": b"{}",
        "report.json": b"{}",
        "checkpoints/checkpoint-2/optimizer.pt": b"not recorded",
    }.items():
        (stage / name).parent.mkdir(parents=True, exist_ok=True)
        (stage / name).write_bytes(data)
    mark_done(stage)
    return stage


def test_done_records_each_output_file_and_a_changed_byte_of_the_same_size_is_caught(tmp_path):
    stage = finished_stage(tmp_path / "stage-1-x")
    record = read_json(stage / "DONE")
    assert record["digest"] == FILE_DIGEST
    assert [(f["path"], f["size"]) for f in record["files"]] == [
        ("final/config.json", 2),
        ("final/model.safetensors", 16384),
        ("final/processor_config.json", 2),
        ("adapter/adapter_model.safetensors", 400),
        ("report.json", 2),
        ("metrics.json", 2),
    ]
    assert finished_stage_problem(stage) is None

    weights = stage / "final" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:5000] + bytes([data[5000] ^ 1]) + data[5001:])  # one bit, same size
    assert finished_stage_problem(stage).startswith(f"final/model.safetensors changed: {FILE_DIGEST} ")
    weights.write_bytes(data[: len(data) // 2])  # cut short, as an unsynced write after a power cut
    assert finished_stage_problem(stage) == "final/model.safetensors is 8192 bytes, DONE recorded 16384"
    weights.write_bytes(data)
    assert finished_stage_problem(stage) is None
    (stage / "adapter" / "adapter_model.safetensors").unlink()
    assert finished_stage_problem(stage) == "adapter/adapter_model.safetensors is missing"
    (stage / "final" / "config.json").unlink()
    assert finished_stage_problem(stage) == "final/ has no config.json"
    (stage / "DONE").write_text('{"finished_at": "2026-')  # DONE itself cut short
    assert finished_stage_problem(stage).startswith("DONE cannot be read")


def test_a_done_written_before_the_record_still_counts_and_says_so_once(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(layout, "_told_unrecorded", [])
    old = [finished_stage(tmp_path / f"stage-{i}-x") for i in (1, 2)]
    for stage in old:
        write_json(stage / "DONE", {"finished_at": "2026-01-01T00:00:00"})
    with caplog.at_level(logging.INFO, logger="vlm_recipes.runs.layout"):
        assert [finished_stage_problem(stage) for stage in old] == [None, None]
    assert caplog.text.count("written before DONE recorded its files") == 1


def failing_stage(error: BaseException):
    def run_stage(ctx, resume_from):
        raise error

    return run_stage


@pytest.mark.parametrize(
    ("error", "code", "status", "recorded"),
    [
        (RuntimeError("boom"), None, "failed", "RuntimeError: boom"),
        ("diverged", 3, "failed", "TrainingDiverged: stopped at step 3: loss is NaN"),
        (KeyboardInterrupt(), 130, "interrupted", "KeyboardInterrupt"),
        ("interrupted", 130, "interrupted", "StageInterrupted: stage 1 interrupted; checkpoint-2 saved"),
    ],
    ids=["crash", "nan-stop", "ctrl-c", "ctrl-c-saved"],
)
def test_a_run_that_stops_early_says_so(tmp_path, monkeypatch, capsys, error, code, status, recorded):
    import vlm_recipes.stages.run as stage_run
    from vlm_recipes.errors import StageInterrupted, TrainingDiverged

    error = {
        "diverged": TrainingDiverged("stopped at step 3: loss is NaN"),
        "interrupted": StageInterrupted("stage 1 interrupted; checkpoint-2 saved"),
    }.get(error, error)
    monkeypatch.setattr(stage_run, "run_stage", failing_stage(error))
    args = [*QUICK, "--output-dir", str(tmp_path), "--run-name", "x"]
    if code is None:  # a crash is a bug: its traceback is kept, and run.json still says what happened
        with pytest.raises(RuntimeError, match="boom"):
            main(args)
    else:
        assert main(args) == code
    manifest = read_json(tmp_path / "r2-vision-only" / "x" / "run.json")
    assert manifest["status"] == status and manifest["error"] == recorded and manifest["ended_at"]
    capsys.readouterr()
    assert find_runs(tmp_path, latest=True) == []
    assert f"skipped {tmp_path / 'r2-vision-only' / 'x'}: it {'failed' if status == 'failed' else 'was'}" in (
        capsys.readouterr().err
    )


def test_a_run_whose_stage_fails_at_an_import_says_it_failed(tmp_path, monkeypatch):
    """A package missing at import (seen: qwen-vl-utils without `requests` on the GPU machine's image) fails
    the stage's imports, and with them the imports the failure's handler makes to tell a full disk: the
    run still records that it failed, and why."""
    import vlm_recipes.stages.run as stage_run

    monkeypatch.setattr(
        stage_run, "run_stage", failing_stage(ModuleNotFoundError("No module named 'requests'"))
    )
    monkeypatch.delitem(sys.modules, "vlm_recipes.stages.disk_full", raising=False)
    monkeypatch.setitem(sys.modules, "vlm_recipes.stages.disk_full", None)  # its import now fails too
    with pytest.raises(ModuleNotFoundError, match="requests"):
        main([*QUICK, "--output-dir", str(tmp_path), "--run-name", "x"])
    manifest = read_json(tmp_path / "r2-vision-only" / "x" / "run.json")
    assert manifest["status"] == "failed", manifest["status"]
    assert manifest["error"] == "ModuleNotFoundError: No module named 'requests'"


def fake_run(output_dir: Path, recipe: str, name: str, status: str, **extra) -> Path:
    """A run directory as a run leaves it, with one stage's metrics."""
    run_dir = output_dir / recipe / name
    stage_dir = run_dir / "stage-1-s"
    stage_dir.mkdir(parents=True)
    metrics = {
        "loss_curve": [{"step": 1, "loss": 2.0}],
        "steps": 1,
        "final_train_loss": 2.0,
        "eval_loss": 2.1,
    }
    (stage_dir / "metrics.json").write_text(json.dumps(metrics))
    stages = [{"name": "s", "dir": str(stage_dir)}]
    (run_dir / "run.json").write_text(
        json.dumps({"recipe": recipe, "status": status, "stages": stages, **extra})
    )
    time.sleep(0.02)  # distinct modification times: the newest run is the last written
    return run_dir


def test_compare_takes_finished_runs_and_says_what_it_skipped(tmp_path, capsys):
    done = fake_run(tmp_path, "r1", "a", "finished", seeds=[0])
    failed = fake_run(tmp_path, "r1", "b", "failed", error="DataError: data file not found: x.jsonl")
    interrupted = fake_run(tmp_path, "r1", "c", "interrupted", error="KeyboardInterrupt")
    dead = fake_run(tmp_path, "r2", "d", "running")
    (dead / ".lock").write_text(json.dumps({"pid": 2**22 + 12345, "host": os.uname().nodename}))
    live = fake_run(tmp_path, "r2", "e", "running")
    (live / ".lock").write_text(json.dumps({"pid": os.getpid(), "host": os.uname().nodename}))
    holding = os.open(live / ".lock", os.O_RDONLY)
    fcntl.flock(holding, fcntl.LOCK_EX)  # as the live run holds it

    try:
        assert compare_main(["--latest", "--output-dir", str(tmp_path), "--out", str(tmp_path / "cmp")]) == 0
    finally:
        os.close(holding)
    captured = capsys.readouterr()
    assert "r1" in captured.out and (tmp_path / "cmp" / "comparison.md").is_file()
    err = captured.err
    assert f"skipped {failed}: it failed: DataError: data file not found: x.jsonl" in err
    assert f"skipped {interrupted}: it was interrupted (KeyboardInterrupt); continue it with --resume" in err
    assert f"skipped {dead}: it stopped without finishing" in err
    assert f"skipped {live}: it is still running (process {os.getpid()}" in err

    assert compare_main([str(done), str(failed), str(dead)]) == 2  # named runs must all be finished
    err = capsys.readouterr().err
    assert "only finished runs can be compared" in err
    assert f"{failed}: it failed: DataError" in err and f"{dead}: it stopped without finishing" in err
    assert "Traceback" not in err


def test_latest_skips_only_runs_newer_than_the_one_it_picks(tmp_path, capsys):
    fake_run(tmp_path, "r1", "old-failure", "failed", error="boom")
    newest_done = fake_run(tmp_path, "r1", "done", "finished")
    assert find_runs(tmp_path, latest=True) == [newest_done]
    assert capsys.readouterr().err == ""  # an older failure was never a candidate
    assert find_runs(tmp_path, latest=False, on_skip=None) == [newest_done]
