"""The run directory: where a run and its stages live, what marks a stage finished, and run.json.

    runs/<recipe>/<run-name>/
      .lock                 held (flock) by the one process writing the run; holds its pid and host
      run.json              resolved recipe, versions, git sha, hardware, seeds, status, per-stage summary
      stage-<i>-<name>/
        final/              complete model dir (merged weights, config, processor, provenance.json)
        adapter/            the LoRA adapter, when the stage trained one
        checkpoints/        Trainer's working dir (logs, intermediate checkpoints)
        report.json         guard decisions, trainable parameters per role, sources, freeze audit
        metrics.json        losses, throughput, wall time
        DONE                written last: the stage is finished

A crash never leaves a half-written stage looking finished: final/ is renamed into place when whole, and
DONE is written after everything else. run.json's `status` is `running` while the run trains, `finished` at
the end, `failed` (with `error`) or `interrupted` (Ctrl-C) when the process ended early and could say so;
a run killed outright (SIGKILL, power loss) stays `running`, which `.lock` tells apart from a live run.

One writer per run directory: the process that creates or resumes a run holds an exclusive flock on
`.lock` for as long as it runs, and a second process (same --run-name, a second --resume) refuses. The
kernel drops the lock when the holder dies, however it dies, so a killed run can always be resumed. The
processes a launcher starts (torchrun, accelerate) share its lock: they inherit the locked file and are
told, through LOCK_HELD_ENV, not to take it again.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import json
import os
import platform
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from vlm_recipes.demo import resolve_model_source
from vlm_recipes.files import read_json, write_json
from vlm_recipes.recipes.load import recipe_to_dict
from vlm_recipes.recipes.schema import Recipe, Stage
from vlm_recipes.stages.guards import Environment
from vlm_recipes.stages.parallel import NodeSettings

FINAL_DIR = "final"
ADAPTER_DIR = "adapter"
DONE_MARKER = "DONE"
PROVENANCE_FILE = "provenance.json"


def stage_dir_name(index: int, name: str) -> str:
    return f"stage-{index}-{name}"


def is_done(stage_dir: Path) -> bool:
    """DONE written, and final/ still a complete model directory (weights, config, processor)."""
    return (stage_dir / DONE_MARKER).is_file() and model_dir_problem(stage_dir / FINAL_DIR) is None


def model_dir_problem(model_dir: Path) -> str | None:
    """What makes a saved model directory unloadable, judged from its files (no weights are read)."""
    if not (model_dir / "config.json").is_file():
        return "no config.json"
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        missing = {f for f in read_json(index)["weight_map"].values() if not (model_dir / f).is_file()}
        if missing:
            return f"missing weight shards: {', '.join(sorted(missing))}"
    elif not (model_dir / "model.safetensors").is_file():
        return "no model.safetensors"
    if not any((model_dir / f).is_file() for f in ("processor_config.json", "preprocessor_config.json")):
        return "no processor"
    return None


def mark_done(stage_dir: Path) -> None:
    write_json(stage_dir / DONE_MARKER, {"finished_at": time.strftime("%Y-%m-%dT%H:%M:%S")})


def read_provenance(model_dir: str | Path) -> list[dict]:
    path = Path(model_dir) / PROVENANCE_FILE
    return read_json(path) if path.is_file() else []


LIBRARIES = (
    "vlm-recipes",
    "torch",
    "torchvision",
    "transformers",
    "trl",
    "peft",
    "accelerate",
    "datasets",
    "bitsandbytes",
    "tokenizers",
)


LOCK_FILE = ".lock"
LOCK_HELD_ENV = "VLM_RECIPES_RUN_LOCK_HELD"  # a launcher tells its children: "I hold this run dir's lock"
ENDED = ("finished", "failed", "interrupted")


class RunExistsError(RuntimeError):
    """The run directory cannot be used as asked (exists, missing, or another process writes it)."""


class RunBusyError(RunExistsError):
    """Another live process holds the run directory's lock."""


@dataclass
class RunOptions:
    output_dir: Path = Path("runs")
    run_name: str | None = None
    resume: bool = False
    until_stage: int | None = None  # the launcher's children train up to this stage
    nproc_per_node: int | None = None
    node: NodeSettings = field(default_factory=NodeSettings)


def run_dir_for(recipe: Recipe, options: RunOptions) -> Path:
    name = options.run_name or time.strftime("%Y%m%d-%H%M%S")
    return options.output_dir / recipe.name / name


def stage_dirs(recipe: Recipe, run_dir: Path) -> list[Path]:
    return [run_dir / stage_dir_name(i, s.name) for i, s in enumerate(recipe.stages, start=1)]


def resolve_source(recipe: Recipe, stage: Stage, index: int, dirs: list[Path]) -> str:
    """Where a stage's weights come from: the base model, an earlier stage's final/, or a model id/dir."""
    init = stage.init_from
    if init == "base" or (init == "previous" and index == 1):
        return resolve_model_source(recipe.model)
    if init == "previous":
        return str(dirs[index - 2] / FINAL_DIR)
    if init.startswith("stage:"):
        names = [s.name for s in recipe.stages]
        return str(dirs[names.index(init.removeprefix("stage:"))] / FINAL_DIR)
    return resolve_model_source(init)


def describe_source(recipe: Recipe, stage: Stage, index: int) -> str:
    """Human form of init_from for plans and summaries."""
    init = stage.init_from
    if init == "base" or (init == "previous" and index == 1):
        return f"base model {recipe.model}"
    if init == "previous":
        return f"stage {index - 1} ({recipe.stages[index - 2].name}) final/"
    if init.startswith("stage:"):
        return f"stage `{init.removeprefix('stage:')}` final/"
    return init


def library_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def git_sha() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


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


# ---------------------------------------------------------------------------------------------
# One writer per run directory

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
            f"run directory {run_dir} is in use by {describe_writer(read_lock_holder(run_dir))}. A run "
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


def run_state(run_dir: Path) -> tuple[str, str]:
    """(status, why the run cannot be used; "" when finished), from its run.json and its lock: `running`
    in run.json with nobody holding the lock is a run killed outright (status `dead`)."""
    try:
        manifest = read_json(run_dir / "run.json")
    except (OSError, ValueError) as exc:
        return "unreadable", f"run.json cannot be read ({exc})"
    status = manifest.get("status", "unknown")
    if status == "finished":
        return status, ""
    if status == "failed":
        return status, f"it failed: {manifest.get('error') or 'no error recorded'}"
    if status == "interrupted":
        return status, f"it was interrupted ({manifest.get('error') or 'Ctrl-C'}); continue it with --resume"
    if status != "running":
        return status, f"unexpected status {status!r} in run.json"
    holder = read_lock_holder(run_dir)
    held = lock_is_held(run_dir)
    if held:
        return status, f"it is still running ({describe_writer(holder)})"
    if held is False:
        return "dead", (
            f"it stopped without finishing ({describe_holder(holder)} is gone: killed or crashed); "
            "continue it with --resume"
        )
    return status, "it has not finished (no lock file: still running elsewhere, or stopped without a word)"


def mark_run_ended(
    run_dir: Path, status: str, error: BaseException | str, keep_recorded: bool = False
) -> None:
    """Record in run.json that the run ended early: `failed` with the error, or `interrupted`. With
    `keep_recorded` (a launcher, which only knows its children's exit code), an end a child already
    recorded is kept."""
    try:
        manifest = read_json(run_dir / "run.json")
    except (OSError, ValueError):
        return
    if keep_recorded and manifest.get("status") in ("failed", "interrupted"):
        return
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}".removesuffix(": ")
    manifest.update(status=status, error=text, ended_at=time.strftime("%Y-%m-%dT%H:%M:%S"))
    write_json(run_dir / "run.json", manifest)


def write_manifest(recipe: Recipe, run_dir: Path, options: RunOptions, env: Environment) -> dict:
    manifest = {
        "recipe": recipe.name,
        "run_name": run_dir.name,
        "run_dir": str(run_dir),
        "command": " ".join(sys.argv),
        "resolved_recipe": recipe_to_dict(recipe),
        "versions": library_versions(),
        "git_sha": git_sha(),
        "seeds": sorted({s.training.seed for s in recipe.stages}),
        "hardware": env.describe(),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "status": "running",
        "stages": [],
    }
    previous = run_dir / "run.json"
    if options.resume and previous.exists():  # a continued run keeps its origin
        earlier = read_json(previous)
        manifest["started_at"] = earlier.get("started_at", manifest["started_at"])
        manifest["command"] = earlier.get("command", manifest["command"])
    write_json(previous, manifest)
    return manifest


def stage_summary(index: int, stage: Stage, stage_dir: Path, source: str, metrics: dict) -> dict:
    return {
        "index": index,
        "name": stage.name,
        "method": stage.method,
        "dir": str(stage_dir),
        "source": source,
        "final_model": str(stage_dir / FINAL_DIR),
        **{
            k: metrics.get(k) for k in ("train_loss", "final_train_loss", "eval_loss", "steps", "wall_time_s")
        },
        "exact_match": ((metrics.get("eval") or {}).get("all") or {}).get("exact_match"),
        "eval_reward_accuracy": metrics.get("eval_reward_accuracy"),  # method dpo only
    }


def format_summary(run_dir: Path) -> str:
    """The table printed at the end of a run (with DPO's eval reward accuracy when a stage has one)."""
    manifest = read_json(run_dir / "run.json")
    stages = manifest["stages"]
    rewards = any(s.get("eval_reward_accuracy") is not None for s in stages)
    header = f"{'#':>2}  {'stage':<20} {'steps':>5} {'train loss':>10} {'eval loss':>9} {'exact match':>11}"
    header += f" {'reward acc':>10}" * rewards + f" {'time':>7}"
    lines = [f"Recipe {manifest['recipe']} finished: {len(stages)} stage(s)", "", header, "-" * len(header)]
    for s in stages:
        line = (
            f"{s['index']:>2}  {s['name']:<20} {s['steps'] or 0:>5} {_num(s['final_train_loss']):>10} "
            f"{_num(s['eval_loss']):>9} {_num(s.get('exact_match'), 3):>11}"
        )
        line += f" {_num(s.get('eval_reward_accuracy'), 3):>10}" * rewards
        lines.append(line + f" {(s['wall_time_s'] or 0):>6.1f}s")
    lines += ["", f"Final model: {manifest['final_model']}", f"Run record:  {run_dir / 'run.json'}"]
    return "\n".join(lines)


def _num(value, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
