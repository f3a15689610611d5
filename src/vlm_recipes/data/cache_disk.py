"""A disk that fills while a dataset is read. The rows' tables (arrow_rows.py) and the cache files datasets'
map writes beside them are under the vlm-recipes cache; datasets' own loads (parquet, the hub) under its
cache. Such a full disk stops with one message naming the folder and the variable that moves it (exit 4),
where datasets would end in an OSError traceback with no path."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import datasets

from vlm_recipes.errors import DiskFull
from vlm_recipes.files import cache_dir
from vlm_recipes.full_disk import SHARED_MEMORY_FULL, free_bytes, full_filesystem


@contextlib.contextmanager
def cache_writes() -> Iterator[None]:
    """A full disk under `with` (not shared memory: that is a training worker's, runner.py's to tell)
    raised as DiskFull naming the data caches; any other error as it is."""
    try:
        yield
    except DiskFull:
        raise
    except Exception as error:
        full = full_filesystem(error, cache_dir())
        if full is None or full.kind == SHARED_MEMORY_FULL:
            raise
        raise data_cache_full(full.reason, full.path) from error


def data_cache_full(reason: str, path: Path | None) -> DiskFull:
    """The message: what could not be written (datasets' errors name no file: then the folders a read
    writes in), the space free there, and how to make room or move them."""
    caches = {
        "VLM_RECIPES_CACHE": cache_dir() / "rows",  # the rows' tables, and datasets' map files beside them
        "HF_DATASETS_CACHE": Path(datasets.config.HF_DATASETS_CACHE),  # datasets' own loads, their maps
    }
    if path is not None:
        caches = {name: folder for name, folder in caches.items() if _under(path, folder)}
    what = f"writing {path}" if path is not None else "writing a dataset's cache files"
    message = f"the disk is full: {what} failed ({reason})"
    if path is not None and not caches:
        return DiskFull(f"{message}; {_free(path)} free there. Free space on that disk")
    held = [f"{folder} ({_free(folder)} free; {name} moves it)" for name, folder in caches.items()]
    return DiskFull(
        f"{message}. A read writes them under {' and '.join(held)}. Free space there, or point "
        f"{' or '.join(caches)} at a folder on a disk with room"
    )


def _free(path: Path) -> str:
    free = free_bytes(path)
    return f"{free / 2**30:.2f} GB" if free >= 2**30 else f"{free / 2**20:.1f} MB"


def _under(path: Path, folder: Path) -> bool:
    return path.absolute().is_relative_to(folder.expanduser().absolute())
