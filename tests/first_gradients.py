#!/usr/bin/env python
"""Testing only: `scripts/train_recipe.py ARGS`, with every trained parameter's gradient of the first
optimizer step saved (after DDP's or FSDP's reduction, before the step) to $VLM_RECIPES_GRADIENTS by rank 0,
as a safetensors file of full tensors. The hook is installed here, from outside the package, so production
code carries no test switch; launched process groups rerun this file (the launcher relaunches argv[0])."""

from __future__ import annotations

import os
import sys

import torch
from safetensors.torch import save_file
from transformers import TrainerCallback

from vlm_recipes.cli.train import main
from vlm_recipes.stages import run as stage_run


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor  # an FSDP2 shard: gathered


class SaveFirstGradients(TrainerCallback):
    def __init__(self, model):
        self.model = model

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if state.global_step != 0:
            return
        grads = {
            name.replace("_fsdp_wrapped_module.", "").replace("module.", "", 1): full(p.grad).detach().float()
            for name, p in self.model.named_parameters()
            if p.grad is not None
        }
        if int(os.environ.get("RANK", "0")) == 0:
            save_file({k: v.contiguous() for k, v in grads.items()}, os.environ["VLM_RECIPES_GRADIENTS"])


MAKE_TRAINER = stage_run.make_trainer


def install() -> None:
    make_trainer = MAKE_TRAINER

    def make_trainer_saving_gradients(*args, **kwargs):
        trainer, callbacks, decisions = make_trainer(*args, **kwargs)
        trainer.add_callback(SaveFirstGradients(trainer.model))
        return trainer, callbacks, decisions

    stage_run.make_trainer = make_trainer_saving_gradients


def uninstall() -> None:
    stage_run.make_trainer = MAKE_TRAINER


if __name__ == "__main__":
    install()
    sys.exit(main(sys.argv[1:]))
