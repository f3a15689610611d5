"""A disk that fills during a run: told apart from other failures, what it left half-written removed (so
that the message and the run's record of the failure have room), and one message with the way on.
Which errors are a full disk: full_disk.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from vlm_recipes.errors import DiskFull
from vlm_recipes.full_disk import (
    RUN_DISK,
    SHARED_MEMORY,
    SHARED_MEMORY_FULL,
    FullFilesystem,
    chain,
    free_bytes,
    full_filesystem,
)

if TYPE_CHECKING:
    from vlm_recipes.recipes.schema import Recipe


def remove_half_written(stage_dirs: list[Path]) -> list[Path]:
    """What a write cut short left in the stages' directories: `final.partial/`, `adapter.partial/`,
    checkpoints without their COMPLETE marker, atomic writes' temporary files, and directories moved aside to
    be removed (files.DISCARDED). Removed; the paths, for the log."""
    # imported here: is_disk_full stays light
    from vlm_recipes.files import DISCARDED
    from vlm_recipes.methods.checkpoints import complete_checkpoints
    from vlm_recipes.runs.layout import ADAPTER_DIR, FINAL_DIR

    removed = []
    for stage_dir in stage_dirs:
        partial = [stage_dir / f"{name}.partial" for name in (FINAL_DIR, ADAPTER_DIR)]
        partial += complete_checkpoints(stage_dir / "checkpoints")[1]
        if stage_dir.is_dir():
            partial += [*stage_dir.rglob("*.tmp"), *stage_dir.glob(f".*{DISCARDED}*")]
        for path in partial:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            elif path.exists():
                path.unlink(missing_ok=True)
            else:
                continue
            removed.append(path)
    return removed


def disk_full(error: BaseException, run_dir: Path, recipe: Recipe, stage_dirs: list[Path]) -> DiskFull:
    """The message for a run stopped by a full filesystem. The run's disk: once what was half-written is
    removed, the path, the space free now, and what the stage that was writing needs (from the plan's
    estimate). Shared memory or another disk: what filled and its fix; the run's files are left alone (their
    removal would free nothing there). A DiskFull raised with its own message (a data cache's) is kept."""
    if isinstance(error, DiskFull):
        return error
    full = full_filesystem(error, run_dir) or FullFilesystem(type(error).__name__, RUN_DISK, None)
    if full.kind == SHARED_MEMORY_FULL:
        return shared_memory_full(full)
    if full.kind != RUN_DISK:
        where = full.path or run_dir
        return DiskFull(
            f"the disk is full: writing {where} failed ({full.reason}); {free_bytes(where) / 2**30:.2f} GB "
            f"free there now. Free space on that disk (not the run's: {run_dir} was left as it was), then "
            "continue the run; finished stages are kept"
        )
    return run_disk_full(error, full, run_dir, recipe, stage_dirs)


def shared_memory_full(full: FullFilesystem) -> DiskFull:
    """Shared memory (/dev/shm) full: DataLoader workers hand batches over through it; a container's is 64 MB
    unless raised."""
    size = shutil.disk_usage(SHARED_MEMORY).total / 2**30 if SHARED_MEMORY.is_dir() else 0.0
    return DiskFull(
        f"shared memory is full: {full.reason} ({SHARED_MEMORY}, {size:.2f} GB in all). DataLoader workers "
        "hand batches over through it. Raise it (docker run --shm-size=8g, or --ipc=host; a Kubernetes "
        "emptyDir with medium: Memory on /dev/shm), or set training.dataloader_workers: 0 (no worker "
        "processes); the run directory was left as it was"
    )


def run_disk_full(
    error: BaseException, full: FullFilesystem, run_dir: Path, recipe: Recipe, stage_dirs: list[Path]
) -> DiskFull:
    from vlm_recipes.plan import estimate_disk_gb
    from vlm_recipes.runs.layout import is_done

    reason = full.reason  # read before the removal frees space
    removed = remove_half_written(stage_dirs)
    filename = next((c.filename for c in chain(error) if isinstance(c, OSError) and c.filename), None)
    message = f"the disk is full: writing {Path(filename or run_dir)} failed ({reason})"
    message += f"; {free_bytes(run_dir) / 2**30:.2f} GB free now"
    if removed:
        message += f", after removing {len(removed)} half-written file(s) and checkpoint(s)"
    pending = [
        (i, s) for i, (s, d) in enumerate(zip(recipe.stages, stage_dirs, strict=False), 1) if not is_done(d)
    ]
    if pending:
        index, stage = pending[0]
        try:
            need = f"about {estimate_disk_gb(recipe, stage):.2f} GB (final/ and its checkpoints)"
        except Exception:  # the estimate is a courtesy: the message must reach the user regardless
            need = "its final/ and checkpoints"
        message += f". Stage {index} `{stage.name}` writes {need}"
    return DiskFull(f"{message}. Free space on that disk, then continue the run; finished stages are kept")
