"""A full disk, told from any writer's error (the speed-up caches, final/, checkpoints, metrics, run.json).

What each writer raises when the disk is full (ENOSPC, or EDQUOT past a quota), as reproduced on a 300 KB
tmpfs with safetensors 0.8.0 and torch 2.14 (tests/test_disk_faults.py does it again where it may mount):

- Python's own writes: OSError [Errno 28] No space left on device, found anywhere in the error's chain
  (torch.save into a Python file object chains it under its RuntimeError "unexpected pos ...").
- safetensors' save_file (final/, checkpoints, the speed-up caches): SafetensorError("Error while
  serializing: I/O error: No space left on device (os error 28)"), not an OSError; the errno is read from
  the text (older safetensors wrote "IoError(Os { code: 28, kind: StorageFull, ... })").
- torch's raw writes (legacy torch.save, storage files): RuntimeError("write(): fd 3 failed with No space
  left on device"): the strerror text.
- torch.save to a path (Trainer's optimizer.pt, scheduler.pt, rng_state.pth): its zip writer's C++ stream
  drops the errno. Seen: RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs
  534") raised while closing, its __context__ RuntimeError("basic_ios::clear: iostream error"); the latter
  alone where the disk fills at the very end; miniz's "PytorchStreamWriter failed writing ...: file write
  failed" is the same failure. A failed write, not its cause: taken as a full disk only when the disk
  holding the run then has under NEARLY_FULL_BYTES free.

Nothing else is a full disk, however little space is free: a RuntimeError without one of these texts (a
CUDA out-of-memory error) is not.

Which disk filled: the path the error names (an OSError's filename, torch's `file <...>`), compared by its
filesystem (st_dev) with the run directory's; an error naming none is taken as the run's disk. Shared memory
(/dev/shm: torch's shared-memory tensors, which DataLoader workers hand batches over in) is told apart: its
fix is not free space on a disk.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError

FULL_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
NEARLY_FULL_BYTES = 16 * 2**20  # a torch.save write that failed with less free than this: a full disk
# an errno as safetensors (Rust's io::Error, new and old), and Python's str(OSError) inside a message, write it
ERRNO_IN_TEXT = re.compile(r"\(os error (\d+)\)|Os \{ code: (\d+)|\[Errno (\d+)\]")
TORCH_WRITE_FAILED = ("basic_ios::clear: iostream error", "unexpected pos", "PytorchStreamWriter failed")
SHARED_MEMORY = Path("/dev/shm")
# torch's words where shared memory ran out: its allocator's (posix_fallocate on /dev/shm), and its
# DataLoader's where a worker died of a bus error (the worker's own stderr line: "insufficient shared memory")
SHARED_MEMORY_TEXTS = ("shared memory(shm)", "out of shared memory", "insufficient shared memory")
# the file torch's allocator names (MapAllocator: "unable to write to file </torch_1_2_0>: ..."); a name
# starting /torch_ is a shm_open name, a file in /dev/shm
TORCH_FILE = re.compile(r"file <([^>]+)>")
RUN_DISK, ANOTHER_DISK, SHARED_MEMORY_FULL = "the run's disk", "another disk", "shared memory"


@dataclass(frozen=True)
class FullFilesystem:
    """A full filesystem told from an error: why (the message's words), which (RUN_DISK: the one holding the
    path asked about; ANOTHER_DISK; SHARED_MEMORY_FULL) and the file that could not be written, where the
    error names one."""

    reason: str
    kind: str
    path: Path | None


def is_disk_full(error: BaseException, where: Path) -> bool:
    """Whether `error` (or one in its __cause__ / __context__ chain) is the disk holding `where` full."""
    return full_disk_reason(error, where) is not None


def full_disk_reason(error: BaseException, where: Path) -> str | None:
    """What says that `error` is the disk holding `where` full, for the message ("No space left on device",
    "Disk quota exceeded", or torch.save's failed write and the space left); None where it is not one, or
    where another filesystem filled (full_filesystem tells which)."""
    full = full_filesystem(error, where)
    return full.reason if full is not None and full.kind == RUN_DISK else None


def full_filesystem(error: BaseException, where: Path) -> FullFilesystem | None:
    """The filesystem `error` says is full: shared memory, the disk holding `where`, or another one (the
    failing file is on another filesystem); None where the error is not a full filesystem."""
    if (shared := shared_memory_reason(error)) is not None:
        return FullFilesystem(shared, SHARED_MEMORY_FULL, failing_path(error))
    if (reason := _reason(error, where)) is None:
        return None
    path = failing_path(error)
    if path is None or same_filesystem(path, where):
        return FullFilesystem(reason, RUN_DISK, path)
    return FullFilesystem(
        reason, SHARED_MEMORY_FULL if same_filesystem(path, SHARED_MEMORY) else ANOTHER_DISK, path
    )


def shared_memory_reason(error: BaseException) -> str | None:
    """torch's words where shared memory ran out (its allocator's, or its DataLoader's for a worker killed by
    a bus error), or a full disk on a torch shm_open file; None otherwise."""
    for cause in chain(error):
        text = str(cause)
        named = TORCH_FILE.search(text)
        on_shm = named is not None and named.group(1).startswith("/torch_") and errno_in(text) is not None
        if isinstance(cause, RuntimeError) and (on_shm or any(t in text for t in SHARED_MEMORY_TEXTS)):
            number = errno_in(text)
            return os.strerror(number) if number else text.strip().splitlines()[0]
    return None


def failing_path(error: BaseException) -> Path | None:
    """The file a full-disk error in the chain could not write: an OSError's filename, or the file torch's
    allocator names (a shm_open name is a file in /dev/shm); None where none is named."""
    for cause in chain(error):
        if isinstance(cause, OSError) and cause.errno in FULL_DISK_ERRNOS and cause.filename:
            return Path(os.fsdecode(cause.filename))
        if isinstance(cause, RuntimeError) and (named := TORCH_FILE.search(str(cause))):
            name = named.group(1)
            return SHARED_MEMORY / name.lstrip("/") if name.startswith("/torch_") else Path(name)
    return None


def same_filesystem(path: Path, other: Path) -> bool:
    """Whether `path` and `other` (each by its nearest existing parent) are on one filesystem; True where
    either cannot be looked at (the run's disk, as an error naming no file is taken)."""
    devices = [_device(p) for p in (path, other)]
    return None in devices or devices[0] == devices[1]


def _device(path: Path) -> int | None:
    for existing in (path, *path.absolute().parents):
        try:
            return existing.stat().st_dev
        except OSError:
            continue
    return None


def _reason(error: BaseException, where: Path) -> str | None:
    """What says that `error` is a full disk (any disk): its errno, or torch.save's failed write with the
    disk holding `where` nearly full."""
    for cause in chain(error):
        if isinstance(cause, OSError):
            if cause.errno in FULL_DISK_ERRNOS:
                return os.strerror(cause.errno)
        elif isinstance(cause, SafetensorError | RuntimeError) and (number := errno_in(str(cause))):
            return os.strerror(number)
    for cause in chain(error):
        if isinstance(cause, RuntimeError) and any(text in str(cause) for text in TORCH_WRITE_FAILED):
            free = free_bytes(where)
            if free < NEARLY_FULL_BYTES:
                first_line = str(cause).strip().splitlines()[0]
                return f"torch.save's write failed: {first_line}, with {free / 2**20:.2f} MB free"
            return None
    return None


def errno_in(text: str) -> int | None:
    """ENOSPC or EDQUOT where `text` names it (its number in one of ERRNO_IN_TEXT's forms, or its
    strerror, as torch's "write(): fd 3 failed with No space left on device"); None otherwise."""
    for match in ERRNO_IN_TEXT.finditer(text):
        number = int(next(group for group in match.groups() if group))
        if number in FULL_DISK_ERRNOS:
            return number
    return next((number for number in FULL_DISK_ERRNOS if os.strerror(number) in text), None)


def chain(error: BaseException) -> Iterator[BaseException]:
    """`error`, then what it was raised from or while handling, and so on (each once)."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        yield cause
        cause = cause.__cause__ or cause.__context__


def free_bytes(where: Path) -> int:
    """Free bytes on the filesystem holding `where` (its nearest existing parent); a very large number
    where that cannot be read."""
    for path in (where, *where.parents):
        try:
            return shutil.disk_usage(path).free
        except OSError:
            continue
    return 2**63
