"""The run directory: where a run and its stages live, what marks a stage finished, and run.json.

    runs/<recipe>/<run-name>/
      run.json              resolved recipe, versions, git sha, hardware, seeds, status, per-stage summary
      stage-<i>-<name>/
        final/              complete model dir (merged weights, config, processor, provenance.json)
        adapter/            the LoRA adapter, when the stage trained one
        checkpoints/        Trainer's working dir (logs, intermediate checkpoints)
        report.json         guard decisions, trainable parameters per role, sources, freeze audit
        metrics.json        losses, throughput, wall time
        DONE                written last: the stage is finished

A crash never leaves a half-written stage looking finished: final/ is renamed into place when whole, and
DONE is written after everything else.
"""

from __future__ import annotations

import importlib.metadata
import platform
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



class RunExistsError(RuntimeError):
    pass


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
