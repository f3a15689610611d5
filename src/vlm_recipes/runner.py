"""Chain a recipe's stages: resolve each stage's weights source, skip finished stages, write run.json.

Layout: <output_dir>/<recipe>/<run_name>/run.json and stage-<i>-<name>/ beside it.
"""

from __future__ import annotations

import importlib.metadata
import logging
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from vlm_recipes.checkpoint import FINAL_DIR, is_done, read_json, stage_dir_name, write_json
from vlm_recipes.demo import resolve_model_source
from vlm_recipes.guards import Environment
from vlm_recipes.recipe import recipe_to_dict
from vlm_recipes.resilience import maybe_fault
from vlm_recipes.schema import Recipe, Stage

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


class RunExistsError(RuntimeError):
    pass


@dataclass
class RunOptions:
    output_dir: Path = Path("runs")
    run_name: str | None = None
    resume: bool = False


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
    run_dir = run_dir_for(recipe, options)
    if (run_dir / "run.json").exists() and not options.resume:
        raise RunExistsError(
            f"run directory {run_dir} already exists. Continue it with --resume (finished stages are "
            f"skipped), or start a new run with another --run-name."
        )
    if options.resume and not (run_dir / "run.json").exists():
        raise RunExistsError(f"--resume: no run at {run_dir} (check --output-dir and --run-name)")
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def run_recipe(recipe: Recipe, options: RunOptions) -> Path:
    """Run every stage of a recipe in order; returns the run directory."""
    from vlm_recipes.stage import StageContext, prepare_resume, run_stage  # heavy imports only when training

    env = Environment.detect()
    run_dir = prepare_run_dir(recipe, options)
    dirs = stage_dirs(recipe, run_dir)
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
    if options.resume:
        manifest["started_at"] = read_json(run_dir / "run.json").get("started_at", manifest["started_at"])
    write_json(run_dir / "run.json", manifest)
    log.info("run %s: %d stage(s) on %s", run_dir, len(recipe.stages), env.describe())
    if recipe.trust_remote_code:
        log.warning(
            "trust_remote_code: true (set in %s): Python code shipped with %s will run on this machine",
            recipe.source_file or "the recipe",
            recipe.model,
        )

    retrained = False  # once a stage trains again, every later stage must too: its input changed
    for index, (stage, stage_dir) in enumerate(zip(recipe.stages, dirs, strict=True), start=1):
        source = resolve_source(recipe, stage, index, dirs)
        if not retrained and is_done(stage_dir):
            log.info("stage %d `%s`: already done (%s), skipped", index, stage.name, stage_dir / "DONE")
            metrics = read_json(stage_dir / "metrics.json")
        else:
            resume_from = None
            if stage_dir.exists() and not retrained:
                resume_from = prepare_resume(stage_dir)
                if resume_from is None:
                    log.info(
                        "stage %d `%s`: unfinished, no complete checkpoint: starting it again",
                        index,
                        stage.name,
                    )
            if resume_from is None:
                shutil.rmtree(stage_dir, ignore_errors=True)
            log.info(
                "stage %d/%d `%s` from %s",
                index,
                len(recipe.stages),
                stage.name,
                describe_source(recipe, stage, index),
            )
            metrics = run_stage(StageContext(recipe, stage, index, stage_dir, source, env), resume_from)
            retrained = True
        manifest["stages"].append(stage_summary(index, stage, stage_dir, source, metrics))
        write_json(run_dir / "run.json", manifest)
        maybe_fault(f"between{index}")

    manifest["status"] = "finished"
    manifest["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    manifest["final_model"] = str(dirs[-1] / FINAL_DIR)
    write_json(run_dir / "run.json", manifest)
    return run_dir


def stage_summary(index: int, stage: Stage, stage_dir: Path, source: str, metrics: dict) -> dict:
    return {
        "index": index,
        "name": stage.name,
        "dir": str(stage_dir),
        "source": source,
        "final_model": str(stage_dir / FINAL_DIR),
        **{
            k: metrics.get(k) for k in ("train_loss", "final_train_loss", "eval_loss", "steps", "wall_time_s")
        },
        "exact_match": ((metrics.get("eval") or {}).get("all") or {}).get("exact_match"),
    }


def format_summary(run_dir: Path) -> str:
    """The table printed at the end of a run."""
    manifest = read_json(run_dir / "run.json")
    header = f"{'#':>2}  {'stage':<20} {'steps':>5} {'train loss':>10} {'eval loss':>9} {'exact match':>11} {'time':>7}"
    lines = [
        f"Recipe {manifest['recipe']} finished: {len(manifest['stages'])} stage(s)",
        "",
        header,
        "-" * len(header),
    ]
    for s in manifest["stages"]:
        lines.append(
            f"{s['index']:>2}  {s['name']:<20} {s['steps'] or 0:>5} {_num(s['final_train_loss']):>10} "
            f"{_num(s['eval_loss']):>9} {_num(s.get('exact_match'), 3):>11} {(s['wall_time_s'] or 0):>6.1f}s"
        )
    lines += ["", f"Final model: {manifest['final_model']}", f"Run record:  {run_dir / 'run.json'}"]
    return "\n".join(lines)


def _num(value, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
