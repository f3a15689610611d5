"""Chain a recipe's stages: resolve each stage's weights source, skip finished stages, write run.json.

Layout: <output_dir>/<recipe>/<run_name>/run.json and stage-<i>-<name>/ beside it.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vlm_recipes.checkpoint import FINAL_DIR, is_done, read_json, stage_dir_name, write_json
from vlm_recipes.demo import resolve_model_source
from vlm_recipes.guards import Decision, Environment
from vlm_recipes.parallel import (
    NodeSettings,
    ParallelPlan,
    ProcessGroup,
    decide_parallel,
    launch_command,
    launched,
)
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


PARALLEL_ENV = "VLM_RECIPES_PARALLEL"  # the launcher tells its children the plan, for their reports


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


def plan_parallel(
    recipe: Recipe, env: Environment, options: RunOptions
) -> list[tuple[ParallelPlan, Decision]]:
    """How each stage uses the devices (pure decisions; raises GuardError for impossible requests)."""
    plans = []
    for stage in recipe.stages:
        footprint = gpu_memory = None
        if env.device == "cuda" and env.gpu_count > 1 and stage.parallel == "auto":
            from vlm_recipes.plan import estimate_footprint

            footprint = estimate_footprint(recipe, stage)
            gpu_memory = torch.cuda.get_device_properties(0).total_memory / 2**30
        plans.append(
            decide_parallel(
                stage.parallel,
                env,
                footprint,
                gpu_memory,
                options.nproc_per_node,
                options.node.nnodes,
                stage.training.max_memory_per_gpu,
            )
        )
    return plans


def run_recipe(recipe: Recipe, options: RunOptions) -> Path:
    """Run every stage of a recipe in order; returns the run directory.

    Stages that use one process run here; stages that need one process per device are run by child
    processes this one launches (torchrun / accelerate), which continue the same run directory."""
    if launched():  # a child of the launcher: train the stages it was given
        return train_stages(recipe, options, ProcessGroup.from_env())
    env = Environment.detect()
    plans = plan_parallel(recipe, env, options)
    if not any(plan.launches_processes for plan, _ in plans):
        return train_stages(recipe, options, ProcessGroup(), plans)
    return launch_stages(recipe, options, plans)


def launch_stages(recipe: Recipe, options: RunOptions, plans: list[tuple[ParallelPlan, Decision]]) -> Path:
    node = options.node
    run_dir = run_dir_for(recipe, options)
    if node.node_rank == 0:
        run_dir = prepare_run_dir(recipe, options)
        write_manifest(recipe, run_dir, options, Environment.detect())
    else:  # other nodes continue the run node 0 creates (the output dir is on a shared filesystem)
        wait_for(run_dir / "run.json", seconds=600)
    groups: list[tuple[int, ParallelPlan, Decision]] = []  # (last stage index, plan, decision)
    for index, (plan, decision) in enumerate(plans, start=1):
        if groups and groups[-1][1] == plan:
            groups[-1] = (index, plan, decision)
        else:
            groups.append((index, plan, decision))
    for last, plan, decision in groups:
        log.info("stages up to %d: %s", last, decision)
        resumed = dataclasses.replace(options, resume=True, until_stage=last)
        if not plan.launches_processes:
            if node.node_rank == 0:
                train_stages(recipe, resumed, ProcessGroup(), plans)
            continue
        command = launch_command(plan, ["--resume", str(run_dir), "--until-stage", str(last)], node)
        log.info("launching %d process(es) on this node: %s", plan.processes_per_node, " ".join(command))
        child_env = {**os.environ, PARALLEL_ENV: f"{plan.mode}:{decision.choice}"}
        code = subprocess.run(command, env=child_env).returncode
        if code != 0:
            raise LaunchFailed(code)
    return run_dir


class LaunchFailed(RuntimeError):
    """A launched process group failed; its processes printed why."""

    def __init__(self, code: int):
        super().__init__(f"the launched processes exited with code {code}")
        self.code = code


def wait_for(path: Path, seconds: float) -> None:
    deadline = time.time() + seconds
    while not path.exists():
        if time.time() > deadline:
            raise RunExistsError(f"{path} did not appear within {seconds:.0f} s: is node 0 running this run?")
        time.sleep(1.0)


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


def train_stages(
    recipe: Recipe,
    options: RunOptions,
    group: ProcessGroup,
    plans: list[tuple[ParallelPlan, Decision]] | None = None,
) -> Path:
    """Train the recipe's stages up to `options.until_stage` in this process (one rank of a group)."""
    from vlm_recipes.stage import StageContext, prepare_resume, run_stage  # heavy imports only when training

    env = Environment.detect()
    run_dir = prepare_run_dir(recipe, options) if group.is_main else run_dir_for(recipe, options)
    group.barrier()
    dirs = stage_dirs(recipe, run_dir)
    manifest = write_manifest(recipe, run_dir, options, env) if group.is_main else {"stages": []}
    if group.is_main:
        where = f"{group.world_size} processes" if group.distributed else "one process"
        log.info("run %s: %d stage(s) on %s, %s", run_dir, len(recipe.stages), env.describe(), where)
        if recipe.trust_remote_code:
            log.warning(
                "trust_remote_code: true (set in %s): Python code shipped with %s will run on this machine",
                recipe.source_file or "the recipe",
                recipe.model,
            )
    last = options.until_stage or len(recipe.stages)
    retrained = False  # once a stage trains again, every later stage must too: its input changed
    for index, (stage, stage_dir) in enumerate(zip(recipe.stages[:last], dirs, strict=False), start=1):
        source = resolve_source(recipe, stage, index, dirs)
        # Rank 0 looks at the disk and decides; every rank follows the same decision.
        done, resume_from = group.broadcast(
            _stage_start(index, stage, stage_dir, retrained, prepare_resume) if group.is_main else None
        )
        if done:
            metrics = read_json(stage_dir / "metrics.json")
        else:
            if group.is_main:
                log.info(
                    "stage %d/%d `%s` from %s",
                    index,
                    len(recipe.stages),
                    stage.name,
                    describe_source(recipe, stage, index),
                )
            group.barrier()
            plan, decision = plans[index - 1] if plans else launched_plan(group)
            ctx = StageContext(
                recipe,
                stage,
                index,
                stage_dir,
                source,
                env,
                group=group,
                parallel=plan,
                decisions=[decision],
            )
            metrics = run_stage(ctx, Path(resume_from) if resume_from else None)
            retrained = True
        if group.is_main:
            manifest["stages"].append(stage_summary(index, stage, stage_dir, source, metrics))
            write_json(run_dir / "run.json", manifest)
        maybe_fault(f"between{index}")
        group.barrier()

    if group.is_main and last == len(recipe.stages):
        manifest["status"] = "finished"
        manifest["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        manifest["final_model"] = str(dirs[-1] / FINAL_DIR)
        write_json(run_dir / "run.json", manifest)
    group.barrier()
    return run_dir


def launched_plan(group: ProcessGroup) -> tuple[ParallelPlan, Decision]:
    """In a launched child: the plan its launcher chose (passed in the environment)."""
    mode, _, choice = os.environ.get(PARALLEL_ENV, "ddp:").partition(":")
    plan = ParallelPlan(
        mode,
        int(os.environ.get("LOCAL_WORLD_SIZE", group.world_size)),
        max(1, group.world_size // int(os.environ.get("LOCAL_WORLD_SIZE", group.world_size))),
    )
    return plan, Decision("launch", choice or f"{group.world_size} processes", f"launched as {mode}")


def _stage_start(
    index: int, stage: Stage, stage_dir: Path, retrained: bool, prepare_resume
) -> tuple[bool, str | None]:
    """(already done?, checkpoint to resume from), after clearing what cannot be resumed."""
    if not retrained and is_done(stage_dir):
        log.info("stage %d `%s`: already done (%s), skipped", index, stage.name, stage_dir / "DONE")
        return True, None
    resume_from = prepare_resume(stage_dir) if stage_dir.exists() and not retrained else None
    if resume_from is None:
        if stage_dir.exists():
            log.info(
                "stage %d `%s`: unfinished, no complete checkpoint: starting it again", index, stage.name
            )
        shutil.rmtree(stage_dir, ignore_errors=True)
    return False, str(resume_from) if resume_from else None


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
