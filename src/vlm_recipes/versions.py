"""Which version of each library is installed: recorded in run.json and part of every cache key."""

from __future__ import annotations

import platform
from importlib import metadata


def installed_version(name: str) -> str | None:
    """The installed distribution's version, None when it is not installed."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def library_versions(names: tuple[str, ...]) -> dict[str, str]:
    """Python's version and each library's (`not installed` where absent), for run.json."""
    return {"python": platform.python_version()} | {
        name: installed_version(name) or "not installed" for name in names
    }
