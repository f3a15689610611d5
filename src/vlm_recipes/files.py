"""Files every module writes or reads: atomic writers, JSON, and the vlm-recipes cache directory.

Whatever is written here is written whole or not at all: to a temporary file (or directory) first, then
renamed, so a crash or a concurrent writer never leaves half a file behind. And durably, as databases write:
the file (every file of a directory) is fsynced before the rename and its directory after, so a power cut
cannot leave a renamed name over blocks that never reached the disk (a file cut short, or zeros).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

log = logging.getLogger(__name__)

# Temp dirs older than this are leftovers of killed builds; younger ones may belong to a live builder.
STALE_TMP_SECONDS = 3600


def cache_dir() -> Path:
    """Root of the vlm-recipes cache: ``$VLM_RECIPES_CACHE`` or ``~/.cache/vlm-recipes``."""
    env = os.environ.get("VLM_RECIPES_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "vlm-recipes"


def write_atomically(path: Path, write: Callable[[str], None]) -> None:
    """`write(temporary path)`, fsync, then rename onto `path` and fsync its directory: a reader never sees
    half a file, even with several processes writing the same path, and neither a crash nor a power cut
    leaves a partial entry behind."""
    _write_atomically(path, write, durable=True)


def _write_atomically(path: Path, write: Callable[[str], None], durable: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    os.close(fd)
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it 0600: the file gets the mode open() would give it
    try:
        write(tmp)
        if durable:
            fsync_file(Path(tmp))
        os.replace(tmp, path)
        if durable:
            fsync_dir(path.parent)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def fsync_file(path: Path) -> None:
    """Flush a written file's data to the disk (its page cache, whichever process wrote it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (a rename into it, the files made in it) to the disk. A filesystem that
    cannot fsync a directory (some network and FUSE ones answer EINVAL) is left to its own guarantees."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as error:
        if error.errno in (errno.EACCES, errno.EPERM):  # Windows opens no directory: its renames are durable
            return
        raise
    try:
        os.fsync(fd)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def fsync_tree(directory: Path) -> None:
    """One pass over a directory written in place: every file fsynced, then every directory (deepest
    first, `directory` itself last), so all of it is on the disk before it is renamed into place or marked
    complete."""
    for parent, _, files in os.walk(directory, topdown=False):
        for name in files:
            path = Path(parent) / name
            if not path.is_symlink():
                fsync_file(path)
        fsync_dir(Path(parent))


def publish_dir(partial: Path, target: Path) -> Path:
    """Put a directory written whole at `partial` in place as `target`, durably: its files fsynced, one
    rename (an old `target` moved aside first, removed after), the parent fsynced. After a crash or a power
    cut `target` is absent, the old one whole, or the new one whole; never new names over unwritten blocks."""
    fsync_tree(partial)
    aside = _move_aside(target) if target.exists() else None
    os.replace(partial, target)
    fsync_dir(target.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    return target


DISCARDED = ".discarded-"  # `.<name>.discarded-<random>`: a directory moved aside to be removed


def discard_dir(path: Path) -> None:
    """Remove a directory so that no crash leaves part of it looking whole: one rename out of the way
    (fsynced), then the removal. Leftovers of earlier discards in the same parent go too."""
    for leftover in path.parent.glob(f".*{DISCARDED}*"):
        shutil.rmtree(leftover, ignore_errors=True)
    if path.exists():
        shutil.rmtree(_move_aside(path), ignore_errors=True)


def _move_aside(path: Path) -> Path:
    aside = Path(tempfile.mkdtemp(prefix=f".{path.name}{DISCARDED}", dir=path.parent)) / path.name
    os.replace(path, aside)
    fsync_dir(path.parent)
    return aside.parent


# The digest of a finished stage's files (DONE's record). xxh3-128 when xxhash is installed (datasets, a
# dependency, requires it), else blake2b-128. Measured on the tiny default model's final/ (7 files, 1.2 MB,
# page cache warm, one core of an AMD EPYC): xxh3 0.4 ms, blake2b 2.6 ms; over 512 MiB in memory xxh3 hashes
# 9.7 GiB/s and blake2b 0.65 GiB/s, so a 7B model's 15 GB final/ costs a disk read (its speed), not xxh3's.
try:
    import xxhash

    FILE_DIGEST = "xxh3_128"
except ImportError:  # pragma: no cover - datasets installs it
    xxhash = None
    FILE_DIGEST = "blake2b_128"


def file_digest(path: Path, algorithm: str = FILE_DIGEST) -> str | None:
    """The hex digest of a file's bytes by `algorithm` (FILE_DIGEST or blake2b_128); None when this
    machine lacks it."""
    if algorithm == "xxh3_128" and xxhash is not None:
        make = xxhash.xxh3_128
    elif algorithm == "blake2b_128":
        make = lambda: hashlib.blake2b(digest_size=16)  # noqa: E731
    else:
        return None
    with open(path, "rb") as f:
        return hashlib.file_digest(f, make).hexdigest()


def _umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it; put it straight back
    os.umask(mask)
    return mask


def write_json(path: Path, data: Any) -> None:
    write_atomically(path, lambda tmp: Path(tmp).write_text(json.dumps(data, indent=2, default=str) + "\n"))


def write_safetensors(
    path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> None:
    """Atomic but not fsynced: its writer is the speed-up caches, one entry a sample, each entry checked by
    its digest at every read and made again when damaged; a disk flush per entry would cost more."""
    contiguous = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    _write_atomically(path, lambda tmp: save_file(contiguous, tmp, metadata=metadata), durable=False)


def write_jsonl(path: Path, rows: list[dict]) -> None:
    text = "".join(json.dumps(row, default=str) + "\n" for row in rows)
    write_atomically(path, lambda tmp: Path(tmp).write_text(text))


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def build_dir_atomically(
    target: Path, required: tuple[str, ...], build: Callable[[Path], None], what: str
) -> Path:
    """Build ``target`` via ``build(tmp_dir)`` unless complete; publish it with one atomic rename.

    A reader therefore sees either no directory or a finished one.  Concurrent builders each work in
    their own temp dir; the first rename wins and the losers discard their copy (the bytes are identical).
    """
    if _is_complete(target, required):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _sweep_stale_tmp(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp makes it 0700, which would stick to the published directory
    try:
        log.info("Building %s in %s", what, target)
        build(tmp)
        if target.exists() and not _is_complete(target, required):
            # Incomplete leftover (files deleted by hand, or a pre-atomic copy): move it out of the way.
            # The rename-aside is atomic too, so a racing builder cannot see it half-deleted.
            trash = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
            with contextlib.suppress(OSError):  # another builder got there first
                os.replace(target, trash / "stale")
            shutil.rmtree(trash, ignore_errors=True)
        fsync_tree(tmp)
        try:
            os.replace(tmp, target)  # fails if target exists and is non-empty, i.e. someone else won
            fsync_dir(target.parent)
        except OSError:
            if not _is_complete(target, required):
                raise
            log.debug("%s appeared in %s meanwhile; discarding this build", what, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _is_complete(target: Path, required: tuple[str, ...]) -> bool:
    return all((target / name).is_file() for name in required)


def _sweep_stale_tmp(target: Path) -> None:
    cutoff = time.time() - STALE_TMP_SECONDS
    for leftover in target.parent.glob(f".{target.name}.tmp-*"):
        try:
            if leftover.stat().st_mtime < cutoff:
                shutil.rmtree(leftover, ignore_errors=True)
        except OSError:
            pass  # vanished meanwhile
