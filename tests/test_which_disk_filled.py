"""A full filesystem other than the run's: shared memory (/dev/shm, where DataLoader workers hand batches
over) or another disk. Neither is reported against the run directory, and neither removes the stage's
half-written files as a full run disk does; each stops the run with its own message and fix (exit 4).
torch's errors are those torch 2.14 raised with a 1 MB /dev/shm, from a real one where a private mount
namespace can be made (root), else raised in their place."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_disk_faults import RUN, no_space, small_disks, why_no_tmpfs  # noqa: F401 (small_disks: a fixture)

import vlm_recipes.full_disk as disk_errors
import vlm_recipes.stages.run as stage_run
from vlm_recipes.cli.train import main
from vlm_recipes.files import read_json
from vlm_recipes.full_disk import ANOTHER_DISK, RUN_DISK, SHARED_MEMORY, SHARED_MEMORY_FULL

# torch 2.14 with /dev/shm a 1 MB tmpfs: its allocator (share_memory_(), and a DataLoader worker's batch),
# the same re-raised in the training process (the worker's traceback as text), the write its older
# allocator made, and its DataLoader where a worker died of a bus error (its own words, from libtorch_python)
SHM_ALLOCATOR = (
    "unable to allocate shared memory(shm) for file </torch_1640_3376345745_0>: No space left on device (28)"
)
SHM_WORKER = (
    "Caught RuntimeError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
    '  File "torch/utils/data/_utils/collate.py", line 273, in collate_tensor_fn\n'
    "    storage = elem._typed_storage()._new_shared(numel, device=elem.device)\n"
    f"RuntimeError: {SHM_ALLOCATOR.replace('1640_3376345745_0', '1646_188028736_1')}\n"
)
SHM_WRITE = "unable to write to file </torch_1646_188028736_1>: No space left on device (28)"
SHM_BUS_ERROR = (
    "DataLoader worker (pid 1646) is killed by signal: Bus error. It is possible that dataloader's workers "
    "are out of shared memory. Please try to raise your shared memory limit."
)


def another_disk(request, tmp_path: Path) -> Path:
    """A folder on a filesystem that is neither tmp_path's nor /dev/shm's: a small tmpfs where root can
    mount one, else the first such of the home folder, /dev and /proc."""
    if why_no_tmpfs() is None:
        return request.getfixturevalue("small_disks")(tmp_path / "other-disk", "1m")
    taken = {tmp_path.stat().st_dev, *([SHARED_MEMORY.stat().st_dev] if SHARED_MEMORY.is_dir() else [])}
    found = next(
        (p for p in (Path.home(), Path("/dev"), Path("/proc")) if p.stat().st_dev not in taken), None
    )
    if found is None:
        pytest.skip("no filesystem other than the temporary folder's and /dev/shm's")
    return found


def test_a_full_filesystem_other_than_the_runs_is_not_the_runs_disk(request, tmp_path):
    """torch's shared-memory errors and a file in /dev/shm are shared memory; a file on another disk is that
    disk, full for it but not for the run; a file under the run directory (not made yet: its folder's
    disk) and an error naming no file are the run's, as before. (Before: every "No space left on device"
    was the run's disk.)"""
    elsewhere = another_disk(request, tmp_path)
    shared = [RuntimeError(text) for text in (SHM_ALLOCATOR, SHM_WORKER, SHM_WRITE, SHM_BUS_ERROR)]
    if SHARED_MEMORY.is_dir():
        shared.append(no_space(SHARED_MEMORY / "torch_1646_188028736_1"))
    for error in shared:
        assert not disk_errors.is_disk_full(error, tmp_path), str(error)
        assert disk_errors.full_filesystem(error, tmp_path).kind == SHARED_MEMORY_FULL, str(error)
    other = no_space(elsewhere / "rows.arrow")
    assert not disk_errors.is_disk_full(other, tmp_path)
    assert disk_errors.full_filesystem(other, tmp_path).kind == ANOTHER_DISK
    assert disk_errors.full_filesystem(other, tmp_path).path == elsewhere / "rows.arrow"
    assert disk_errors.is_disk_full(other, elsewhere), "full for its own disk"
    for own in (
        no_space(tmp_path / "run" / "stage-1" / "metrics.json"),
        RuntimeError("write(): fd 3 failed with No space left on device"),
    ):
        assert disk_errors.full_filesystem(own, tmp_path).kind == RUN_DISK
        assert disk_errors.is_disk_full(own, tmp_path)


# A DataLoader worker's batch (1 MB) past a 1 MB /dev/shm, in a process of its own mount namespace
REAL_SHM = """
import sys
from pathlib import Path
import torch
import torch.utils.data as data
from vlm_recipes.full_disk import is_disk_full

class Rows(data.Dataset):
    def __len__(self):
        return 2
    def __getitem__(self, index):
        return torch.zeros(2**18)

try:
    next(iter(data.DataLoader(Rows(), batch_size=2, num_workers=1)))
except RuntimeError as error:
    print(is_disk_full(error, Path(sys.argv[1])))
    print(str(error).strip().splitlines()[-1])
"""


def why_no_private_shm() -> str | None:
    if why_no_tmpfs() is not None:
        return f"a 1 MB /dev/shm is a tmpfs mounted in a private namespace: {why_no_tmpfs()}"
    if not shutil.which("unshare"):
        return "no unshare command"
    return None


@pytest.mark.skipif(sys.platform != "linux", reason="/dev/shm is Linux's")
def test_a_dataloader_worker_filling_a_real_shared_memory_is_not_the_runs_disk(tmp_path):
    if (why := why_no_private_shm()) is not None:
        pytest.skip(why)
    script = tmp_path / "shm.py"
    script.write_text(REAL_SHM)
    shell = f'mount -t tmpfs -o size=1m tmpfs /dev/shm && exec "{sys.executable}" "{script}" "{tmp_path}"'
    done = subprocess.run(["unshare", "-m", "sh", "-c", shell], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    said_full, text = done.stdout.strip().splitlines()[-2:]
    assert text.startswith("RuntimeError: unable to allocate shared memory(shm) for file </torch_"), text
    assert text.endswith(": No space left on device (28)"), text
    assert said_full == "False", "shared memory is not the run's disk"
    assert disk_errors.full_filesystem(RuntimeError(text), tmp_path).kind == SHARED_MEMORY_FULL


@pytest.mark.parametrize("fault", ["worker's batch", "bus error", "another disk"])
def test_shared_memory_or_another_disk_filling_stops_the_run_with_its_own_message_and_keeps_its_files(
    request, tmp_path, monkeypatch, capsys, fault
):
    """Stage 1 stops with a checkpoint half-written (no COMPLETE). Shared memory: its message (docker's
    --shm-size, training.dataloader_workers: 0); another disk: that disk's path; exit 4, the --resume
    command, run.json's record; the half-written checkpoint left where it is (removing it frees nothing
    there). (Before: the run's disk blamed and the checkpoint removed; a bus error a traceback.)"""
    elsewhere = another_disk(request, tmp_path) if fault == "another disk" else None
    error = {
        "worker's batch": RuntimeError(SHM_WORKER),
        "bus error": RuntimeError(SHM_BUS_ERROR),
        "another disk": no_space(elsewhere / "a file") if elsewhere else None,
    }[fault]
    half_written: list[Path] = []

    def run_stage(ctx, resume_from):
        half_written.append(ctx.stage_dir / "checkpoints" / "checkpoint-2" / "trainable.safetensors")
        half_written[0].parent.mkdir(parents=True)
        half_written[0].write_bytes(b"half")
        raise error

    monkeypatch.setattr(stage_run, "run_stage", run_stage)
    code = main([*RUN, "--output-dir", str(tmp_path / "runs"), "--run-name", "x"])
    err = capsys.readouterr().err
    assert code == 4, err
    assert "Traceback" not in err and "--resume" in err
    if elsewhere is None:
        assert "error: shared memory is full: " in err and "the disk is full" not in err
        assert "--shm-size" in err and "training.dataloader_workers: 0" in err
    else:
        assert (
            f"error: the disk is full: writing {elsewhere / 'a file'} failed (No space left on device)" in err
        )
        assert f"not the run's: {tmp_path / 'runs' / 'r3-two-stage' / 'x'} was left as it was" in err
    assert half_written[0].exists(), "the stage's files are left as they were"
    record = read_json(tmp_path / "runs" / "r3-two-stage" / "x" / "run.json")
    assert (record["status"], record["exit_code"]) == ("failed", 4), record
