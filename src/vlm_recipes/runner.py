"""Chain a recipe's stages: decide how each uses the devices, launch process groups where needed, skip
finished stages, resume an interrupted one, and keep run.json current, to the end: a run that stops early
records `failed` (with the error) or `interrupted` (Ctrl-C) in run.json, written by the process that stops.

The run directory's layout and its one-writer lock are in `runs/` (layout.py, lock.py; run.json in
manifest.py); one stage's work is `stages.run.run_stage`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path

from accelerate import PartialState

from vlm_recipes.decisions import Decision
from vlm_recipes.demo.models import resolve_model_source
from vlm_recipes.files import discard_dir, read_json, write_json
from vlm_recipes.launch.launcher import (
    launch_command,
    launch_environment,
    rendezvous_id,
    run_launched,
    wait_for,
)
from vlm_recipes.launch.rank_failures import PeerWatch, record_in_run_json
from vlm_recipes.logs import is_main_process
from vlm_recipes.machine import detect_environment
from vlm_recipes.plan import ParallelPlan, plan_parallel
from vlm_recipes.ranks import broadcast_from_main, launched, process_state, restarts
from vlm_recipes.recipes.data_sources import source_paths
from vlm_recipes.recipes.learning_rates import stage_learning_rates
from vlm_recipes.recipes.schema import Recipe, Stage
from vlm_recipes.runs.layout import (
    DONE_MARKER,
    FINAL_DIR,
    RunOptions,
    describe_source,
    finished_stage_problem,
    resolve_source,
    run_dir_for,
    stage_dirs,
)
from vlm_recipes.runs.lock import prepare_run_dir, release_run_lock
from vlm_recipes.runs.manifest import mark_run_ended, stage_summary, write_manifest

log = logging.getLogger(__name__)

PARALLEL_ENV = "VLM_RECIPES_PARALLEL"  # the launcher tells its children the plan, for their reports


def run_recipe(recipe: Recipe, options: RunOptions) -> Path:
    """Run every stage of a recipe in order; returns the run directory.

    Stages that use one process run here; stages that need one process per device are run by child
    processes this one launches (torchrun / accelerate), which continue the same run directory. This
    process holds the run directory's lock until it returns (its children share it)."""
    try:
        if launched():  # a child of the launcher: train the stages it was given
            restart, most = restarts()
            if restart and is_main_process():  # its arguments hold --resume: it continues the run
                log.warning(
                    "restart %d of at most %d: torchrun's elastic agent restarted the process group after a "
                    "process failed; the run continues from its last complete checkpoint",
                    restart,
                    most,
                )
            return train_stages(recipe, options, process_state())
        # a demo model is built (and pretrained) here, once, before any child
        resolve_model_source(recipe.model)
        env = detect_environment()
        plans = plan_parallel(recipe, env, options)
        if not any(plan.launches_processes for plan, _ in plans):
            return train_stages(recipe, options, process_state(), plans)
        return launch_stages(recipe, options, plans)
    finally:
        release_run_lock()


def launch_stages(recipe: Recipe, options: RunOptions, plans: list[tuple[ParallelPlan, Decision]]) -> Path:
    node = options.node
    run_dir = run_dir_for(recipe, options)
    if node.node_rank == 0:
        run_dir = prepare_run_dir(recipe, options)
        write_manifest(recipe, run_dir, options, detect_environment())
    else:  # other nodes continue the run node 0 creates (the output dir is on a shared filesystem)
        wait_for(run_dir / "run.json", seconds=600)
    try:
        for last, plan, decision in stage_groups(plans, options.until_stage):
            log.info("stages up to %d: %s", last, decision)
            resumed = dataclasses.replace(options, resume=True, until_stage=last)
            if not plan.launches_processes:
                if node.node_rank == 0:
                    train_stages(recipe, resumed, process_state(), plans)
                continue
            rendezvous = rendezvous_id(run_dir, last)
            command = launch_command(
                plan, ["--resume", str(run_dir), "--until-stage", str(last)], node, rendezvous
            )
            log.info("launching %d process(es) on this node: %s", plan.processes_per_node, " ".join(command))
            env = {
                PARALLEL_ENV: f"{plan.mode}:{decision.choice}",
                **launch_environment(plan, node, rendezvous),
            }
            run_launched(command, run_dir, env, node.node_rank)
    except BaseException as exc:
        cause = getattr(exc, "cause", None)  # LaunchFailed: the first rank that failed, as it recorded it
        if node.node_rank == 0 and cause is not None:
            record_in_run_json(run_dir, cause)
        elif node.node_rank == 0:  # what a child recorded (the error itself) is kept: it knows more
            status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
            mark_run_ended(run_dir, status, exc, keep_recorded=True)
        raise
    return run_dir


def stage_groups(
    plans: list[tuple[ParallelPlan, Decision]], until_stage: int | None = None
) -> list[tuple[int, ParallelPlan, Decision]]:
    """(last stage index, plan, decision): consecutive stages planned alike run as one group, one launch.
    --until-stage: the later stages' groups are not started."""
    groups: list[tuple[int, ParallelPlan, Decision]] = []
    for index, (plan, decision) in enumerate(plans[: until_stage or len(plans)], start=1):
        if groups and groups[-1][1] == plan:
            groups[-1] = (index, plan, decision)
        else:
            groups.append((index, plan, decision))
    return groups


def train_stages(
    recipe: Recipe,
    options: RunOptions,
    state: PartialState,
    plans: list[tuple[ParallelPlan, Decision]] | None = None,
) -> Path:
    """Train the recipe's stages up to `options.until_stage` in this process (one rank of a group).
    Rank 0 holds the run's lock (unless its launcher does) and records in run.json how the run ended."""
    env = detect_environment()
    run_dir = prepare_run_dir(recipe, options) if state.is_main_process else run_dir_for(recipe, options)
    state.wait_for_everyone()
    dirs = stage_dirs(recipe, run_dir)
    manifest = write_manifest(recipe, run_dir, options, env) if state.is_main_process else {"stages": []}
    watch = PeerWatch.start(run_dir, state.num_processes)  # None in one process
    try:
        _stage_by_stage(recipe, options, state, plans, env, run_dir, dirs, manifest)
    except BaseException as exc:
        error = _recorded_failure(exc, state, watch, recipe, run_dir, dirs, env)
        if error is exc:
            raise
        raise error from None
    if watch is not None:
        watch.finished()
    return run_dir


def _recorded_failure(exc, state, watch, recipe, run_dir, dirs, env) -> BaseException:
    """The error this rank ends with, recorded: rank 0 writes it into run.json, and each rank of a group
    records its own failure for the others and the launcher (launch/rank_failures.py). A rank whose error
    came from a peer's failure (a broken collective, its agent's SIGTERM) ends here, silently, with the
    peer's exit code (SystemExit)."""
    from vlm_recipes.errors import BadInput, StageInterrupted, StageStopped

    interrupted = isinstance(exc, KeyboardInterrupt | StageInterrupted)
    try:
        from vlm_recipes.full_disk import full_filesystem
        from vlm_recipes.stages.disk_full import disk_full
        from vlm_recipes.stages.out_of_memory import memory_error_in, out_of_memory
    except ImportError:  # what failed may be an import these need too (a package missing at
        full_filesystem = memory_error_in = None  # import): the run must still say it failed
    # memory first: out of memory is never a full disk (full_disk.py), but its message must win
    memory = not interrupted and memory_error_in is not None and memory_error_in(exc) is not None
    # the run's disk (half-written removed: room for the record), another one, or shared memory
    full = not (interrupted or memory) and full_filesystem is not None and bool(full_filesystem(exc, run_dir))
    own = memory or full or (isinstance(exc, BadInput | StageStopped) and not interrupted)
    if watch is not None and not own:
        watch.stop_if_a_peer_failed(interrupted)
    error = exc
    if memory:
        error = out_of_memory(exc, run_dir, recipe, dirs, env)  # half-written removed, one message
    elif full:
        error = disk_full(exc, run_dir, recipe, dirs)
    if state.is_main_process:
        mark_run_ended(run_dir, "interrupted" if interrupted else "failed", error)
    if watch is not None and not interrupted:
        watch.record_own(error)
    return error


def _stage_by_stage(recipe, options, state, plans, env, run_dir, dirs, manifest) -> None:
    """Each stage in order: skipped when done, resumed from its last complete checkpoint, or trained by
    `run_stage` with its model's family and config read here; run.json updated after each."""
    # heavy imports (transformers, TRL, PEFT) only when training
    from vlm_recipes.methods import method_of, recorded_method
    from vlm_recipes.model.build import detect_family
    from vlm_recipes.stages.checks import prepare_resume
    from vlm_recipes.stages.context import StageContext
    from vlm_recipes.stages.run import run_stage

    if state.is_main_process:
        where = f"{state.num_processes} processes" if state.num_processes > 1 else "one process"
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
        done, resume_from = broadcast_from_main(
            state,
            _stage_start(index, stage, stage_dir, retrained, prepare_resume)
            if state.is_main_process
            else None,
        )
        if done:
            metrics = read_json(stage_dir / "metrics.json")
        else:
            if state.is_main_process:
                log.info(
                    "stage %d/%d `%s` from %s",
                    index,
                    len(recipe.stages),
                    stage.name,
                    describe_source(recipe, stage, index),
                )
            state.wait_for_everyone()
            plan, decision = plans[index - 1] if plans else launched_plan(state)
            trained, rates = stage_learning_rates(recipe.model, stage)
            family, config = detect_family(
                source, recipe.trust_remote_code
            )  # refuses a model it cannot train
            data_paths = demo_data_paths(trained, family, method_of(trained))
            ctx = StageContext(
                recipe,
                trained,
                index,
                stage_dir,
                source,
                env,
                state=state,
                parallel=plan,
                family=family,
                model_config=config,
                data_paths=data_paths,
            )
            ctx.record(decision, rates)
            metrics = run_stage(ctx, Path(resume_from) if resume_from else None)
            retrained = True
        if state.is_main_process:
            method = recorded_method(metrics, stage.method)
            manifest["stages"].append(stage_summary(index, stage, stage_dir, source, metrics, method))
            write_json(run_dir / "run.json", manifest)
        state.wait_for_everyone()

    if state.is_main_process and last == len(recipe.stages):
        manifest["status"] = "finished"
        manifest["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        manifest["final_model"] = str(dirs[-1] / FINAL_DIR)
        write_json(run_dir / "run.json", manifest)
    state.wait_for_everyone()


def demo_data_paths(stage: Stage, family, method) -> dict[str, str]:
    """Where the stage's demo data ids (`demo:train`, ...) are on disk, built on first use: without their
    video rows where the stage cannot take videos (its model's family, or its method: takes_video). The
    stage reads these paths and never asks the demo again."""
    from vlm_recipes.demo.dataset import DEMO_DATA_PREFIX, resolve_data_source

    sources = source_paths(stage.data.train) + source_paths(stage.data.eval)  # a mixture's every source
    named = [s for s in sources if s.startswith(DEMO_DATA_PREFIX)]
    with_videos = method.takes_video and family.takes_video
    return {name: resolve_data_source(name, with_videos) for name in named}


def launched_plan(state: PartialState) -> tuple[ParallelPlan, Decision]:
    """In a launched child: the plan its launcher chose (passed in the environment)."""
    mode, _, choice = os.environ.get(PARALLEL_ENV, "ddp:").partition(":")
    world = state.num_processes
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    plan = ParallelPlan(mode, per_node, max(1, world // per_node))
    return plan, Decision("launch", choice or f"{world} processes", f"launched as {mode}")


def _stage_start(
    index: int, stage: Stage, stage_dir: Path, retrained: bool, prepare_resume
) -> tuple[bool, str | None]:
    """(already done?, checkpoint to resume from), after clearing what cannot be resumed. A finished stage
    whose files no longer match DONE's record (a power cut, a file changed) trains again from the start,
    its stale outputs moved out of the way first; the stages after it then do too (`retrained`)."""
    if not retrained and (stage_dir / DONE_MARKER).is_file():
        problem = finished_stage_problem(stage_dir)
        if problem is None:
            log.info("stage %d `%s`: already done (%s), skipped", index, stage.name, stage_dir / DONE_MARKER)
            return True, None
        log.warning(
            "stage %d `%s`: finished, but %s: training it again from the start, and the stages after it",
            index,
            stage.name,
            problem,
        )
        discard_dir(stage_dir)
        return False, None
    resume_from = prepare_resume(stage_dir) if stage_dir.exists() and not retrained else None
    if resume_from is None:
        if stage_dir.exists():
            why = "an earlier stage trained again" if retrained else "unfinished, no complete checkpoint"
            log.info("stage %d `%s`: %s: starting it again", index, stage.name, why)
        discard_dir(stage_dir)
    return False, str(resume_from) if resume_from else None
