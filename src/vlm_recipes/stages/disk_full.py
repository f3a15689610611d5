"""A disk that fills during a run: told apart from other failures, what it left half-written removed (so
that the message and the run's record of the failure have room), and one message with the way on.

What the writers raise on a full disk varies: Python's own writes an OSError (ENOSPC, or EDQUOT past a
quota), torch.save's zip writer a RuntimeError ("unexpected pos ..."), its C++ streams "basic_ios::clear:
iostream error". The OSError is found anywhere in the error's chain; the others are taken as a full disk
when the run's filesystem has under NEARLY_FULL_BYTES free at that moment.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from vlm_recipes.errors import DiskFull
from vlm_recipes.methods.checkpoints import complete_checkpoints
from vlm_recipes.recipes.schema import Recipe
from vlm_recipes.runs.layout import is_done

FULL_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
NEARLY_FULL_BYTES = 16 * 2**20


def is_disk_full(error: BaseException, where: Path) -> bool:
    """Whether `error` is the disk holding `where` filling up."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno in FULL_DISK_ERRNOS:
            return True
        cause = cause.__cause__ or cause.__context__
    if not isinstance(error, RuntimeError | OSError):
        return False
    return free_bytes(where) < NEARLY_FULL_BYTES


def free_bytes(where: Path) -> int:
    """Free bytes on the filesystem holding `where` (its nearest existing parent); a very large number
    where that cannot be read."""
    for path in (where, *where.parents):
        try:
            return shutil.disk_usage(path).free
        except OSError:
            continue
    return 2**63


def remove_half_written(stage_dirs: list[Path]) -> list[Path]:
    """What a write cut short left in the stages' directories: `final.partial/`, checkpoints without their
    COMPLETE marker, and atomic writes' temporary files. Removed; the paths, for the log."""
    removed = []
    for stage_dir in stage_dirs:
        partial = [stage_dir / "final.partial", *complete_checkpoints(stage_dir / "checkpoints")[1]]
        partial += stage_dir.rglob("*.tmp") if stage_dir.is_dir() else []
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
    """The message for a run whose disk filled, once what was half-written is removed: the path, the space
    free now, and what the stage that was writing needs (from the plan's estimate)."""
    from vlm_recipes.plan import estimate_disk_gb

    removed = remove_half_written(stage_dirs)
    where = Path(getattr(error, "filename", None) or run_dir)
    message = f"the disk is full: writing {where} failed ({error.strerror if isinstance(error, OSError) and error.strerror else type(error).__name__})"
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
