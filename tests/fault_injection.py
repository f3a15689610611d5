#!/usr/bin/env python
"""Testing only: `scripts/train_recipe.py ARGS`, killed with SIGKILL (no cleanup runs) at the point named by
$VLM_RECIPES_FAULT, as a crash, a lost node or the OOM killer would:

    stage<i>:step<n>         after optimizer step n of stage i
    stage<i>:checkpoint<n>   while checkpoint n of stage i is being written (trainable weights saved, no COMPLETE)
    between<i>               after stage i finished, before stage i+1 starts
    <point>@rank<r>          at <point> in launched rank r only (the others are then stopped by their
                             launcher, as torchrun / accelerate stop a group when one process dies)

With $VLM_RECIPES_RAISE the point raises instead (mocked, as this machine cannot run out of memory on
demand): `oom` torch.OutOfMemoryError, `disk-full` OSError ENOSPC (no file named: the run's disk), `nan` this
rank's losses NaN from that step on (DDP's all-reduce then spreads it to every rank's gradients).

The hooks are installed here, from outside the package, so production code carries no test switches.
Launched process groups rerun this file (the launcher relaunches argv[0]), so the faults reach them too.
A fault strikes once: a group torchrun's elastic agent restarted (TORCHELASTIC_RESTART_COUNT > 0) runs on.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
from pathlib import Path

import torch
from transformers import TrainerCallback

from vlm_recipes.cli.train import main
from vlm_recipes.methods import checkpoints as stage_checkpoints
from vlm_recipes.stages import run as stage_run

FAULT = os.environ.get("VLM_RECIPES_FAULT", "")
RAISE = os.environ.get("VLM_RECIPES_RAISE", "")
current_stage = [0]
losses_nan = [False]


def kill_at(point: str) -> None:
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if FAULT not in (point, f"{point}@rank{os.environ.get('RANK')}") or restarted:
        return
    print(f"fault injection: {RAISE or 'SIGKILL'} at {point}", file=sys.stderr, flush=True)
    if RAISE == "oom":
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (mocked)")
    if RAISE == "disk-full":
        raise OSError(errno.ENOSPC, "No space left on device (mocked)")
    if RAISE == "nan":
        losses_nan[0] = True
        return
    os.kill(os.getpid(), signal.SIGKILL)


class KillAfterStep(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        kill_at(f"stage{current_stage[0]}:step{state.global_step}")


def install() -> None:
    run_stage, make_trainer, save_file = (
        stage_run.run_stage,
        stage_run.make_trainer,
        stage_checkpoints.save_file,
    )
    save_shards = stage_checkpoints.save_trainable_shards

    def run_stage_then_maybe_kill(ctx, *args, **kwargs):
        current_stage[0] = ctx.index
        metrics = run_stage(ctx, *args, **kwargs)
        kill_at(f"between{ctx.index}")
        return metrics

    def make_trainer_with_kill(*args, **kwargs):
        trainer, callbacks, decisions = make_trainer(*args, **kwargs)
        trainer.add_callback(KillAfterStep())
        compute_loss = trainer.compute_loss

        def loss_maybe_nan(*args, **kwargs):
            loss = compute_loss(*args, **kwargs)
            if not losses_nan[0]:
                return loss
            return (loss[0] * float("nan"), *loss[1:]) if isinstance(loss, tuple) else loss * float("nan")

        trainer.compute_loss = loss_maybe_nan
        return trainer, callbacks, decisions

    def save_then_maybe_kill(tensors, filename, *args, **kwargs):
        save_file(tensors, filename, *args, **kwargs)
        if Path(filename).name == stage_checkpoints.TRAINABLE_FILE:  # before the COMPLETE marker
            step = Path(filename).parent.name.removeprefix("checkpoint-")
            kill_at(f"stage{current_stage[0]}:checkpoint{step}")

    def save_shards_then_maybe_kill(model, shards):  # FSDP2: every rank writes its own shards
        save_shards(model, shards)
        kill_at(f"stage{current_stage[0]}:checkpoint{shards.parent.name.removeprefix('checkpoint-')}")

    stage_run.run_stage = run_stage_then_maybe_kill
    stage_run.make_trainer = make_trainer_with_kill
    stage_checkpoints.save_file = save_then_maybe_kill
    stage_checkpoints.save_trainable_shards = save_shards_then_maybe_kill


if __name__ == "__main__":
    install()
    sys.exit(main())
