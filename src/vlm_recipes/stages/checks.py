"""Checks around training: every rank starts from the same weights, a stage that stopped early says why,
and an interrupted stage resumes from its last complete checkpoint."""

from __future__ import annotations

import logging
import shutil
from dataclasses import replace
from pathlib import Path

import torch

from vlm_recipes.decisions import Decision
from vlm_recipes.errors import GuardError, StageInterrupted, TrainingDiverged
from vlm_recipes.files import read_json
from vlm_recipes.methods.callbacks import InterruptCallback, NonFiniteCallback
from vlm_recipes.methods.checkpoints import GLOBAL_BATCH_FILE, complete_checkpoints
from vlm_recipes.ranks import gather_from_ranks
from vlm_recipes.recipes.schema import Stage
from vlm_recipes.stages.context import StageContext

log = logging.getLogger(__name__)


def prepare_resume(stage_dir: Path) -> Path | None:
    """The last complete checkpoint of an interrupted stage; incomplete ones are reported and removed."""
    complete, incomplete = complete_checkpoints(stage_dir / "checkpoints")
    for partial in incomplete:
        log.warning("  %s was interrupted while being written: ignored and removed", partial)
        shutil.rmtree(partial, ignore_errors=True)
    return complete[-1] if complete else None


def keep_the_global_batch(ctx: StageContext, checkpoint: Path) -> Decision | None:
    """A stage resumed on another number of ranks than wrote its checkpoint trains on with the same global
    batch: the same rows a step, the same optimizer steps. The shards re-shard to any number of ranks
    (torch.distributed.checkpoint), and Trainer skips the batches already trained by counting steps, so
    only the gradient accumulation changes: 4 processes x 2 rows become 2 x 2 rows x 2 accumulated."""
    record = checkpoint / GLOBAL_BATCH_FILE
    if not record.is_file():  # written before this file existed: the ranks are taken to be the same
        return None
    wrote = read_json(record)
    training, processes = ctx.stage.training, ctx.state.num_processes
    if wrote["processes"] == processes:
        return None
    global_batch = wrote["per_device"] * wrote["accumulation"] * wrote["processes"]
    per_step = training.per_device_batch_size * processes
    if wrote["per_device"] != training.per_device_batch_size or global_batch % per_step:
        fitting = [
            n for n in range(1, global_batch + 1) if global_batch % (n * training.per_device_batch_size) == 0
        ]
        raise GuardError(
            f"{checkpoint} was written by {wrote['processes']} processes, global batch {global_batch} = "
            f"{wrote['per_device']} per device x {wrote['accumulation']} accumulation x {wrote['processes']}; "
            f"{processes} processes with {training.per_device_batch_size} per device cannot make it. Resume "
            f"with --nproc-per-node one of {fitting}"
        )
    accumulation = global_batch // per_step
    ctx.stage = replace(ctx.stage, training=replace(training, gradient_accumulation_steps=accumulation))
    decision = Decision(
        "resume-ranks",
        f"gradient accumulation {wrote['accumulation']} -> {accumulation} on {processes} processes",
        f"{checkpoint.name} was written by {wrote['processes']}: the global batch stays {global_batch}",
    )
    return decision


def check_same_start(model: torch.nn.Module, ctx: StageContext) -> Decision:
    """Every rank must start a stage from the same weights (a stale final/ on one node would not show:
    DDP would silently overwrite it with rank 0's). Compared by a cheap per-tensor fingerprint."""
    with torch.no_grad():
        fingerprint = [
            round(float(p.detach().double().sum()), 6) if p.is_floating_point() else int(p.sum())
            for p in model.parameters()
        ]
    fingerprints = gather_from_ranks(ctx.state, fingerprint)
    if any(f != fingerprints[0] for f in fingerprints):
        different = [rank for rank, f in enumerate(fingerprints) if f != fingerprints[0]]
        raise GuardError(
            f"ranks {different} loaded different weights than rank 0: is the output dir shared by "
            "every node, and the same for all of them?"
        )
    where = f"identical on {ctx.state.num_processes} ranks" if ctx.distributed else "one rank"
    return Decision("same-start", where, f"fingerprint of {len(fingerprint)} tensors compared")


def check_stopped_early(
    ctx: StageContext, nonfinite: NonFiniteCallback, interrupt: InterruptCallback
) -> None:
    """A stage that stopped on NaN/inf or Ctrl-C is not finished: say why and what is kept."""
    complete, _ = complete_checkpoints(ctx.stage_dir / "checkpoints")
    last = (
        f"the last complete checkpoint is {complete[-1]}" if complete else "no checkpoint was saved before it"
    )
    if nonfinite.diverged_at is not None:
        calmer = half_the_learning_rates(ctx.recipe.stages[ctx.index - 1], ctx.index)
        raise TrainingDiverged(
            f"{ctx.title} stopped at step {nonfinite.diverged_at}: {nonfinite.reason}; "
            f"nothing trained after it is saved, and {last}. Resumed as it was, the same rows from the same "
            "weights would diverge again: the command below halves the stage's learning rate from there "
            "(halve it again if it diverges again). Else check the data, or set training.on_nan: skip_step "
            "to drop such steps.",
            calmer,
        )
    if interrupt.requested:
        raise StageInterrupted(f"{ctx.title} interrupted; {last}")


def half_the_learning_rates(stage: Stage, index: int) -> tuple[str, ...]:
    """--resume's overrides that halve a stage's learning rates (its own and each role's), as the recipe
    sets them (a demo model's scaling is applied again on top)."""
    at = f"stages.{index if stage.name.isdigit() else stage.name}.training"  # a digit selects by index
    t = stage.training
    roles = tuple(
        f"{at}.role_learning_rates.{role}={rate / 2!r}" for role, rate in t.role_learning_rates.items()
    )
    return (f"{at}.learning_rate={t.learning_rate / 2!r}", *roles)
