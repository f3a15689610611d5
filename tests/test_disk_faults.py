"""Faults from the disk: a disk that fills at any write of a run stops it with one message and the way on,
and loses nothing; a cache entry that cannot be read as written is a miss; a cache directory that cannot be
written turns that cache off. ENOSPC is injected at each write point; each writer's own error (safetensors',
torch.save's) comes from a real full tmpfs where one can be mounted (root), else is raised in its place; the
speed-up caches' damaged entries are in test_speedups.py (the weights, bit for bit)."""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import pytest
import torch
import transformers.modeling_utils
from safetensors import SafetensorError
from safetensors.torch import save_file

import vlm_recipes.files
import vlm_recipes.full_disk as disk_errors
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


# --------------------------------------------------------------------------- real full disks

# What each writer raised on a full 300 KB tmpfs (safetensors 0.8.0, torch 2.14): raised in its place where
# no tmpfs can be mounted. torch.save to a path: its zip writer's C++ stream failed ("basic_ios::clear"),
# then its closing found the position wrong; the errno is lost on the way.
SAFETENSORS_NO_SPACE = "Error while serializing: I/O error: No space left on device (os error 28)"
TORCH_SAVE_NO_SPACE = (
    "basic_ios::clear: iostream error",
    "[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534",
)


def torch_save_no_space() -> RuntimeError:
    try:
        try:
            raise RuntimeError(TORCH_SAVE_NO_SPACE[0])
        except RuntimeError:
            raise RuntimeError(TORCH_SAVE_NO_SPACE[1])  # noqa: B904 (torch's own chain: a __context__)
    except RuntimeError as error:
        return error


RAISED = {  # each given the full disk's folder: Python's error names the file it could not write there
    "safetensors": lambda root: SafetensorError(SAFETENSORS_NO_SPACE),
    "torch.save": lambda root: torch_save_no_space(),
    "python": lambda root: no_space(root / "a file"),
}


@functools.cache
def why_no_tmpfs() -> str | None:
    """Why no small tmpfs can be mounted here (None where one can): it takes root and mount(8), and a
    container may refuse root too."""
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    if not (shutil.which("mount") and shutil.which("umount")):
        return "no mount or umount command"
    probe = Path(tempfile.mkdtemp(prefix="vlm-recipes-tmpfs-probe-"))
    try:
        tried = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(probe)], capture_output=True, text=True
        )
        if tried.returncode:
            return f"mount refused: {tried.stderr.strip() or tried.returncode}"
        subprocess.run(["umount", str(probe)], check=True)
    finally:
        probe.rmdir()
    return None


@pytest.fixture
def small_disks():
    """mount(directory, size): `directory` becomes a tmpfs of `size` bytes ("300k"), unmounted when the
    test ends; the test is skipped where no tmpfs can be mounted."""
    if (why := why_no_tmpfs()) is not None:
        pytest.skip(f"a real full disk is a small tmpfs: {why}")
    mounted: list[Path] = []

    def mount(directory: Path, size: str) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)], check=True)
        mounted.append(directory)
        return directory

    yield mount
    for directory in reversed(mounted):
        if subprocess.run(["umount", str(directory)], capture_output=True).returncode:
            subprocess.run(["umount", "--lazy", str(directory)], check=True)  # a file still open: detached


class FullDisk:
    """A directory whose disk fills when `write` is called: a real tmpfs (the writer then raises its own
    error), or, in mode "raised", one that does not (the writer's error as the tmpfs gave it is raised in
    its place, and its free space reads as none). `free()` makes room again."""

    HEADROOM = 64 * 1024  # left free by filling: less than any weight file, room to record the failure

    def __init__(self, mode: str, root: Path):
        self.mode, self.root = mode, root
        self.filler = root / "filler.bin"
        self.patch = pytest.MonkeyPatch()

    def fill(self) -> None:
        if self.mode == "raised":
            real = disk_errors.free_bytes
            self.patch.setattr(
                disk_errors,
                "free_bytes",
                lambda where: 0 if self.root in (where, *where.parents) else real(where),
            )
            return
        with self.filler.open("ab") as filler:
            while (free := shutil.disk_usage(self.root).free) > self.HEADROOM:
                filler.write(bytes(min(free - self.HEADROOM, 2**24)))
                filler.flush()

    def write(self, writer: str, write: Callable[[], object]) -> NoReturn:
        """The disk fills, then `write` (by `writer`: "safetensors", "torch.save", "python") fails."""
        self.fill()
        if self.mode == "raised":
            raise RAISED[writer](self.root)
        write()
        raise AssertionError(f"{writer} wrote on a full disk: {shutil.disk_usage(self.root)}")

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)
        self.patch.undo()


@pytest.fixture(params=["tmpfs", "raised"])
def full_disk(request, tmp_path):
    root = tmp_path / "disk"
    if request.param == "tmpfs":
        request.getfixturevalue("small_disks")(root, "64m")
    else:
        root.mkdir()
    disk = FullDisk(request.param, root)
    yield disk
    disk.free()


def error_of(write: Callable[[], object]) -> BaseException:
    try:
        write()
    except Exception as error:
        return error
    raise AssertionError("no error")


# --------------------------------------------------------------------------- a full disk


def test_each_writers_own_error_on_a_full_disk_is_a_full_disk(full_disk, tmp_path):
    tensors = {"x": torch.zeros(2**18)}  # 1 MB: past the headroom
    writes = {
        "safetensors": lambda: save_file(tensors, str(full_disk.root / "a.safetensors")),
        "torch.save": lambda: torch.save(tensors, full_disk.root / "b.pt"),
        "python": lambda: (full_disk.root / "c.json").write_bytes(bytes(2**20)),
    }
    errors = {writer: error_of(lambda w=writer: full_disk.write(w, writes[w])) for writer in writes}
    assert (
        type(errors["safetensors"]) is SafetensorError and str(errors["safetensors"]) == SAFETENSORS_NO_SPACE
    )
    assert {type(e) for e in disk_errors.chain(errors["torch.save"])} == {RuntimeError}
    torch_texts = [str(e) for e in disk_errors.chain(errors["torch.save"])]
    assert torch_texts in (list(reversed(TORCH_SAVE_NO_SPACE)), [TORCH_SAVE_NO_SPACE[0]]), torch_texts
    assert isinstance(errors["python"], OSError) and errors["python"].errno == errno.ENOSPC
    for writer, error in errors.items():
        assert disk_errors.is_disk_full(error, full_disk.root), writer
        why = disk_errors.full_disk_reason(error, full_disk.root)
        assert (
            why.startswith("torch.save's write failed: ")
            if writer == "torch.save"
            else why == "No space left on device"
        )
    roomy = tmp_path / "elsewhere"  # torch's stream says a write failed, not why: a full disk only if it is
    assert not disk_errors.is_disk_full(errors["torch.save"], roomy), "plenty of space there"
    assert disk_errors.is_disk_full(SafetensorError(SAFETENSORS_NO_SPACE), roomy), "the errno says it"


def test_a_full_disk_is_read_from_the_error_chain_and_nothing_else_is_one(tmp_path, monkeypatch):
    try:
        try:
            raise no_space(tmp_path / "x")
        except OSError as inner:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos") from inner
    except RuntimeError as chained:
        assert disk_errors.is_disk_full(chained, tmp_path)
    quota = [
        OSError(errno.EDQUOT, "Disk quota exceeded"),
        SafetensorError("Error while serializing: I/O error: Disk quota exceeded (os error 122)"),
        SafetensorError(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "..." })'
        ),
        RuntimeError("write(): fd 3 failed with No space left on device"),  # torch's raw writes
    ]
    assert all(disk_errors.is_disk_full(error, tmp_path) for error in quota)
    monkeypatch.setattr(disk_full, "free_bytes", lambda where: 1024)  # under NEARLY_FULL_BYTES
    out_of_memory = "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79.19 GiB"
    not_full = [
        RuntimeError(out_of_memory),
        torch.OutOfMemoryError(out_of_memory),
        ValueError("a bug"),
        OSError(errno.EIO, "Input/output error"),
        SafetensorError("Error while serializing: I/O error: Permission denied (os error 13)"),
    ]
    for error in not_full:
        assert not disk_errors.is_disk_full(error, tmp_path), f"{error!r}: not a full disk, however full"


def test_what_a_full_disk_left_half_written_is_removed_and_nothing_else(tmp_path):
    stage = tmp_path / "stage-2-llm-lora"
    kept = [stage / "checkpoints" / "checkpoint-1" / "COMPLETE", stage / "metrics.json"]
    cut = [
        stage / "checkpoints" / "checkpoint-2" / "trainable.safetensors",
        stage / "final.partial" / "a",
        stage / "adapter.partial" / "adapter_model.safetensors",
        stage / ".final.discarded-k3j2" / "final" / "model.safetensors",  # an old final/ moved aside
    ]
    for path in [*kept, *cut, stage / "metrics.json.x1y2.tmp"]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
    removed = disk_full.remove_half_written([tmp_path / "stage-1-vision-full", stage])
    assert sorted(p.name for p in removed) == [
        ".final.discarded-k3j2",
        "adapter.partial",
        "checkpoint-2",
        "final.partial",
        "metrics.json.x1y2.tmp",
    ]
    assert all(p.exists() for p in kept) and not any(p.exists() for p in cut)


def enospc(writer: str, filename, write: Callable[[], object]) -> NoReturn:
    raise no_space(filename)


def fill_disk_at(monkeypatch, point: str, fail: Callable[..., NoReturn] = enospc) -> None:
    """The disk full at one write of stage 2: `fail(writer, filename, write)` raises there what that writer
    raises (ENOSPC; or a FullDisk's `write`: the writer's own error, from a real full disk where it may)."""

    def stage_2(path) -> bool:
        return "stage-2-" in str(path)

    if point == "checkpoint":
        real = stage_checkpoints.save_file

        def save(tensors, filename, *args, **kwargs):
            if stage_2(filename):
                fail("safetensors", filename, lambda: real(tensors, filename, *args, **kwargs))
            real(tensors, filename, *args, **kwargs)

        monkeypatch.setattr(stage_checkpoints, "save_file", save)
    elif point == "final":
        real_save = transformers.modeling_utils.safe_save_file

        def save_weights(tensors, filename, *args, **kwargs):
            if stage_2(filename) and "final.partial" in str(filename):
                fail("safetensors", filename, lambda: real_save(tensors, filename, *args, **kwargs))
            return real_save(tensors, filename, *args, **kwargs)

        monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", save_weights)
    elif point == "optimizer.pt":  # Trainer's torch.save of the optimizer's state, in a checkpoint
        real_torch_save = torch.save

        def torch_save(obj, f, *args, **kwargs):
            if isinstance(f, str | os.PathLike) and stage_2(f) and Path(f).name == point:
                fail("torch.save", f, lambda: real_torch_save(obj, f, *args, **kwargs))
            return real_torch_save(obj, f, *args, **kwargs)

        monkeypatch.setattr(torch, "save", torch_save)
    else:  # metrics.json, predictions.jsonl, run.json (after stage 2): our own atomic writes
        real_write = vlm_recipes.files.write_atomically

        def write(path, writer):
            path = Path(path)
            after_stage_2 = (path.parent / "stage-2-llm-lora" / "DONE").exists()  # for run.json
            if path.name == point and (stage_2(path) or (point == "run.json" and after_stage_2)):
                fail("python", path, lambda: real_write(path, writer))
            real_write(path, writer)

        monkeypatch.setattr(vlm_recipes.files, "write_atomically", write)


@pytest.mark.e2e
@pytest.mark.parametrize("point", ["checkpoint", "final", "metrics.json", "predictions.jsonl", "run.json"])
def test_a_disk_filling_in_stage_2_stops_with_one_message_and_resume_completes(
    tmp_path, capsys, monkeypatch, private_demo_cache, point
):
    stops_with_one_message_then_resumes(tmp_path, capsys, monkeypatch, point, enospc)


@pytest.mark.e2e
@pytest.mark.parametrize("point", ["final", "checkpoint", "optimizer.pt"])
def test_a_writers_own_full_disk_error_stops_the_run_and_resume_completes(
    full_disk, capsys, monkeypatch, private_demo_cache, point
):
    """safetensors' SafetensorError (final/, a checkpoint's weights) and torch.save's RuntimeError (the
    checkpoint's optimizer.pt), from a real full tmpfs or raised in their place, stop the run as ENOSPC
    does; with room made, --resume completes."""

    def fail(writer, filename, write):
        full_disk.write(writer, write)

    stops_with_one_message_then_resumes(full_disk.root, capsys, monkeypatch, point, fail, full_disk.free)


def stops_with_one_message_then_resumes(
    output_dir: Path, capsys, monkeypatch, point: str, fail, make_room: Callable[[], None] = lambda: None
) -> None:
    """A run whose disk fills at `point` in stage 2 exits 4 with one message, what was half-written removed
    and its failure recorded; once there is room, --resume completes it."""
    args = [*RUN, "--output-dir", str(output_dir), "--run-name", "full"]
    with monkeypatch.context() as full:
        fill_disk_at(full, point, fail)
        code = main(args)
    err = capsys.readouterr().err
    assert code == DiskFull.exit_code == 4, err
    assert "Traceback" not in err
    why = "torch.save's write failed" if point == "optimizer.pt" else "No space left on device"
    assert "error: the disk is full" in err and why in err
    assert "--resume" in err and "finished stages are kept" in err
    if point != "run.json":
        assert "Stage 2 `llm-lora` writes about" in err and "GB (final/ and its checkpoints)" in err
    run_dir = output_dir / "r3-two-stage" / "full"
    assert (run_dir / "stage-1-vision-full" / "DONE").exists()
    assert (run_dir / "stage-2-llm-lora" / "DONE").exists() == (point == "run.json")
    assert not list(run_dir.rglob("*.tmp")) and not list(run_dir.rglob("final.partial"))
    assert not stage_checkpoints.complete_checkpoints(run_dir / "stage-2-llm-lora" / "checkpoints")[1]
    if point != "run.json":  # run.json itself could not be written: the exit code and message say it
        record = read_json(run_dir / "run.json")
        assert (record["status"], record["exit_code"]) == ("failed", 4) and "disk is full" in record["error"]

    make_room()
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


def test_a_cache_write_that_finds_the_disk_full_turns_writing_off_and_other_errors_propagate(
    full_disk, caplog, monkeypatch
):
    """What the writer raises for a full disk (safetensors: its SafetensorError, no OSError) turns the
    cache's writing off, said once, nothing half-written left; any other error of a write is raised, on a
    full disk too."""
    real = vlm_recipes.files.save_file

    def save(tensors, filename, **kwargs):
        full_disk.write("safetensors", lambda: real(tensors, filename, **kwargs))

    monkeypatch.setattr(vlm_recipes.files, "save_file", save)
    store, entry_tensors = EntryStore("preprocessed", None), {"pixel_values": torch.zeros(2**18)}
    with caplog.at_level(logging.WARNING, logger="vlm_recipes.caches.storage"):
        store.write(full_disk.root / "ab" / "x.safetensors", entry_tensors)
        store.write(full_disk.root / "ab" / "y.safetensors", entry_tensors)
    assert store.writes_off == f"{full_disk.root / 'ab'}: No space left on device"
    assert caplog.text.count("cannot write") == 1, "said once"
    assert not [*full_disk.root.rglob("*.tmp"), *full_disk.root.rglob("*.safetensors")], (
        "nothing half-written"
    )

    def out_of_memory(tensors, filename, **kwargs):
        raise RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB")

    monkeypatch.setattr(vlm_recipes.files, "save_file", out_of_memory)
    other = EntryStore("preprocessed", None)
    with pytest.raises(RuntimeError, match="out of memory"):
        other.write(full_disk.root / "ab" / "z.safetensors", entry_tensors)
    assert other.writes_off is None


CACHED_R1 = [
    "--recipe",
    "r1-llm-only",
    "--max-steps",
    "1",
    "data.max_train_samples=4",
    "evaluation.generate=false",
    "training.preprocessed_cache=true",
    "training.vision_feature_cache=true",
]


@pytest.mark.e2e
def test_a_stage_whose_cache_directory_cannot_be_written_trains_without_it(
    tmp_path, monkeypatch, private_demo_cache
):
    """The cache root is under a file (what a read-only or full disk makes of it: every write refused):
    the stage trains, and report.json says each cache is off and why."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("VLM_RECIPES_SPEEDUP_CACHE", str(blocker / "speedups"))
    assert main([*CACHED_R1, "--output-dir", str(tmp_path / "runs"), "--run-name", "ro"]) == 0
    report = read_json(next((tmp_path / "runs").rglob("report.json")))
    decisions = {d["guard"]: d for d in report["decisions"]}
    for guard in ("preprocessed-cache", "vision-feature-cache"):
        assert decisions[guard]["choice"] == "off" and "cannot be written" in decisions[guard]["reason"]


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["tmpfs", "raised"])
def test_a_cache_disk_that_fills_mid_stage_turns_writing_off_and_the_stage_finishes(
    request, tmp_path, monkeypatch, private_demo_cache, mode
):
    """As seen: a 300 KB filesystem as the speed-up cache, both caches on; it passes the check before
    training, then safetensors raises its own SafetensorError at a write (raised in its place where no
    tmpfs can be mounted). The stage finishes; metrics.json says which cache stopped writing, and why."""
    cache = tmp_path / "speedups"
    if mode == "tmpfs":
        request.getfixturevalue("small_disks")(cache, "300k")
    else:
        real = vlm_recipes.files.save_file

        def save(tensors, filename, **kwargs):
            if cache in Path(filename).parents:
                raise SafetensorError(SAFETENSORS_NO_SPACE)
            real(tensors, filename, **kwargs)

        monkeypatch.setattr(vlm_recipes.files, "save_file", save)
    monkeypatch.setenv("VLM_RECIPES_SPEEDUP_CACHE", str(cache))
    assert main([*CACHED_R1, "--output-dir", str(tmp_path / "runs"), "--run-name", "full"]) == 0
    metrics = read_json(next((tmp_path / "runs").rglob("metrics.json")))
    off = {key: metrics[key].get("writes_off") for key in ("preprocessed_cache", "vision_feature_cache")}
    assert any(off.values()), off
    assert all(why.endswith(": No space left on device") for why in off.values() if why), off
    assert all(off.values()) or mode == "tmpfs", "every write refused: both caches stop writing"
