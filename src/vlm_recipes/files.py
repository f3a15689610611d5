"""Files every module writes or reads: atomic writers, JSON, and the vlm-recipes cache directory.

Whatever is written here is written whole or not at all: to a temporary file (or directory) first, then
renamed, so a crash or a concurrent writer never leaves half a file behind.
"""

from __future__ import annotations

import contextlib
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
    """`write(temporary path)`, then rename onto `path`: a reader never sees half a file, even with several
    processes writing the same path, and a crash leaves no partial entry behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    os.close(fd)
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it 0600: the file gets the mode open() would give it
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it; put it straight back
    os.umask(mask)
    return mask


def write_json(path: Path, data: Any) -> None:
    write_atomically(path, lambda tmp: Path(tmp).write_text(json.dumps(data, indent=2, default=str) + "\n"))


def write_safetensors(
    path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> None:
    contiguous = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    write_atomically(path, lambda tmp: save_file(contiguous, tmp, metadata=metadata))


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
        try:
            os.replace(tmp, target)  # fails if target exists and is non-empty, i.e. someone else won
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
