"""run.json: the resolved recipe, library versions, git sha, hardware and seeds; the run's status
(`running`, `finished`, `failed` with the error and its exit code, `interrupted`) and per-stage summaries
(comparison/run_table.py prints them at the end). `run_state` tells a run killed outright from a live one
by its lock."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path

from vlm_recipes.benchmark_metrics import METRICS
from vlm_recipes.decisions import Environment
from vlm_recipes.errors import exit_code_of
from vlm_recipes.files import read_json, write_json
from vlm_recipes.recipes.load import recipe_to_dict
from vlm_recipes.recipes.schema import Recipe, Stage
from vlm_recipes.runs.layout import FINAL_DIR, RunOptions
from vlm_recipes.runs.lock import describe_holder, describe_writer, lock_is_held, read_lock_holder
from vlm_recipes.versions import library_versions

log = logging.getLogger(__name__)

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


ENDED = ("finished", "failed", "interrupted")


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
    code = 1 if isinstance(error, str) else exit_code_of(error)
    manifest.update(status=status, error=text, exit_code=code, ended_at=time.strftime("%Y-%m-%dT%H:%M:%S"))
    try:
        write_json(run_dir / "run.json", manifest)
    except OSError as error:  # a full disk: the process still exits with the error and its code
        log.warning("could not record the run's end in %s: %s", run_dir / "run.json", error)


def write_manifest(recipe: Recipe, run_dir: Path, options: RunOptions, env: Environment) -> dict:
    manifest = {
        "recipe": recipe.name,
        "run_name": run_dir.name,
        "run_dir": str(run_dir),
        "command": " ".join(sys.argv),
        "resolved_recipe": recipe_to_dict(recipe),
        "versions": library_versions(LIBRARIES),
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
        manifest["restarts"] = earlier.get("restarts", [])
    from vlm_recipes.ranks import restarts  # imports torch: this module stays light for the CLI

    restart, most = restarts()
    if restart:  # torchrun's elastic agent restarted the group: the run records each restart
        manifest["restarts"] = [
            *manifest.get("restarts", []),
            {"restart": restart, "of_at_most": most, "at": time.strftime("%Y-%m-%dT%H:%M:%S")},
        ]
    write_json(previous, manifest)
    return manifest


def stage_summary(
    index: int, stage: Stage, stage_dir: Path, source: str, metrics: dict, method: dict
) -> dict:
    """A stage's line of run.json: where it is, its losses, exact match, the benchmarks' metrics, and its
    method's measures (each with its heading, at the start too where the method measured its start).
    `method`: what metrics.json says of the method (methods.recorded_method)."""
    at_start = metrics.get("eval_at_start") or {}
    return {
        "index": index,
        "name": stage.name,
        "method": stage.method,
        "loss_kind": method["loss"],
        "dir": str(stage_dir),
        "source": source,
        "final_model": str(stage_dir / FINAL_DIR),
        **{
            k: metrics.get(k) for k in ("train_loss", "final_train_loss", "eval_loss", "steps", "wall_time_s")
        },
        "exact_match": ((metrics.get("eval") or {}).get("all") or {}).get("exact_match"),
        "measures": {
            key: {**about, "value": metrics.get(key), "at_start": at_start.get(key)}
            for key, about in method["measures"].items()
        },
        # the benchmarks' metrics the stage's eval computed (data.eval_metrics), each the mean over its rows
        **{m.key: metrics[m.key] for m in METRICS.values() if metrics.get(m.key) is not None},
    }
