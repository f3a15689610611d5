"""One writer per run directory: the process that creates or resumes a run holds an exclusive flock on
`.lock` for as long as it runs, and a second process (same --run-name, a second --resume) refuses. The
kernel drops the lock when the holder dies, however it dies, so a killed run can always be resumed. The
processes a launcher starts (torchrun, accelerate) share its lock: they inherit the locked file and are
told, through LOCK_HELD_ENV, not to take it again."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from vlm_recipes.errors import RunBusyError, RunExistsError
from vlm_recipes.recipes.schema import Recipe
from vlm_recipes.runs.layout import RunOptions, run_dir_for

LOCK_FILE = ".lock"


LOCK_HELD_ENV = "VLM_RECIPES_RUN_LOCK_HELD"  # a launcher tells its children: "I hold this run dir's lock"


def prepare_run_dir(recipe: Recipe, options: RunOptions) -> Path:
    """The run directory, created, with this process holding its lock (raises RunExistsError when it
    cannot be written: taken by a live process, already there without --resume, missing with --resume)."""
    run_dir = run_dir_for(recipe, options)
    if options.resume and not (run_dir / "run.json").exists():
        raise RunExistsError(f"--resume: no run at {run_dir} (check --output-dir and --run-name)")
    run_dir.mkdir(parents=True, exist_ok=True)
    lock_run_dir(run_dir)  # before looking at run.json: two processes started together see one outcome
    if (run_dir / "run.json").exists() and not options.resume:
        release_run_lock(run_dir)
        raise RunExistsError(
            f"run directory {run_dir} already exists. Continue it with --resume (finished stages are "
            f"skipped), or start a new run with another --run-name."
        )
    return run_dir


_held: dict[Path, int] = {}  # resolved run dir → descriptor of its locked .lock, in this process


def lock_run_dir(run_dir: Path) -> None:
    """Take the run directory's lock for this process, until release_run_lock or the process ends.
    Re-entrant; a no-op in a process whose launcher holds it. Raises RunBusyError naming the holder."""
    key = run_dir.resolve()
    if key in _held or os.environ.get(LOCK_HELD_ENV) == str(key):
        return
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # EWOULDBLOCK: a live process holds it
        os.close(fd)
        raise RunBusyError(
            f"run directory {run_dir} is in use by {describe_writer(current_holder(run_dir))}. A run "
            "directory has one writer: wait for that run to end (or stop it), or start a new run with "
            "another --run-name."
        ) from None
    record = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "command": " ".join(sys.argv),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    _held[key] = fd


def held_lock_fd(run_dir: Path) -> int | None:
    """The descriptor of the run's locked .lock in this process (a launcher hands it to its children)."""
    return _held.get(run_dir.resolve())


def release_run_lock(run_dir: Path | None = None) -> None:
    """Release one run directory's lock (or every lock this process holds)."""
    for key in [run_dir.resolve()] if run_dir is not None else list(_held):
        fd = _held.pop(key, None)
        if fd is not None:
            os.close(fd)  # closing the last descriptor of the open file releases the flock


def read_lock_holder(run_dir: Path) -> dict:
    """What the last holder of the run's lock wrote in it: pid, host, since, command (empty if nothing)."""
    try:
        return json.loads((run_dir / LOCK_FILE).read_text() or "{}")
    except (OSError, ValueError):
        return {}


def current_holder(run_dir: Path, wait_s: float = 2.0) -> dict:
    """The lock's holder, as it recorded itself. A holder writes its record just after it takes the lock, so a
    process refused in between reads the previous holder's record (a dead process) or none: it waits, up to
    `wait_s`, for a record that names a process not known to be gone."""
    deadline = time.monotonic() + wait_s
    while True:
        holder = read_lock_holder(run_dir)
        if (holder.get("pid") and holder_alive(holder) is not False) or time.monotonic() > deadline:
            return holder
        time.sleep(0.02)


def describe_holder(holder: dict) -> str:
    if not holder.get("pid"):
        return "another process"
    since = f" since {holder['since']}" if holder.get("since") else ""
    command = f" (`{holder['command']}`)" if holder.get("command") else ""
    return f"process {holder['pid']} on host {holder.get('host', '?')}{since}{command}"


def describe_writer(holder: dict) -> str:
    """Who holds a run's lock now: its holder, or the processes it launched when it is itself gone."""
    if holder_alive(holder) is False:
        return f"the processes launched by {describe_holder(holder)}, which is itself gone"
    return describe_holder(holder)


def holder_alive(holder: dict) -> bool | None:
    """Whether the lock's last holder still runs: True/False on this host, None when unknown."""
    if not holder.get("pid") or holder.get("host") != socket.gethostname():
        return None
    try:
        os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    except (ValueError, TypeError, OverflowError):
        return None
    return True


def lock_is_held(run_dir: Path) -> bool | None:
    """Whether a live process holds the run's lock (None: the run has no lock file). Probes with a
    shared lock, released at once."""
    try:
        fd = os.open(run_dir / LOCK_FILE, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)
