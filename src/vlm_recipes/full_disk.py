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
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

from safetensors import SafetensorError

FULL_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
NEARLY_FULL_BYTES = 16 * 2**20  # a torch.save write that failed with less free than this: a full disk
# an errno as safetensors (Rust's io::Error, new and old), and Python's str(OSError) inside a message, write it
ERRNO_IN_TEXT = re.compile(r"\(os error (\d+)\)|Os \{ code: (\d+)|\[Errno (\d+)\]")
TORCH_WRITE_FAILED = ("basic_ios::clear: iostream error", "unexpected pos", "PytorchStreamWriter failed")


def is_disk_full(error: BaseException, where: Path) -> bool:
    """Whether `error` (or one in its __cause__ / __context__ chain) is the disk holding `where` full."""
    return full_disk_reason(error, where) is not None


def full_disk_reason(error: BaseException, where: Path) -> str | None:
    """What says that `error` is a full disk, for the message ("No space left on device", "Disk quota
    exceeded", or torch.save's failed write and the space left); None where it is not one."""
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
