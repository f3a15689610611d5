"""What every method's trainer shares (TRL's trainer subclassed in <method>_trainer.py and
preference_trainers.py, sampling_trainers.py): the mixin that resumes from the runner's checkpoints and gives
each role its learning rate, and the guards after the trainer is built (TrainingMethod.prepare_trainer)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch
from transformers.integrations.integration_utils import TensorBoardCallback, default_logdir

from vlm_recipes.caches.preprocessed import PreprocessedSampleCollator
from vlm_recipes.decisions import Decision
from vlm_recipes.families.base import Family
from vlm_recipes.families.parameters import params_by_role
from vlm_recipes.methods import sharding
from vlm_recipes.methods.callbacks import NonFiniteCallback
from vlm_recipes.methods.checkpoints import keep_the_asked_learning_rates, restore_trainable
from vlm_recipes.recipes.schema import Stage

log = logging.getLogger(__name__)


def keep_tensorboard_under_the_checkpoints(trainer) -> None:
    """TensorBoard's events under the stage's checkpoints/runs/, from the first log on. transformers names
    that directory when training begins; an eval before step 1 (evaluate_at_start) opened its writer first,
    on SummaryWriter's default, ./runs/ in whatever directory the user ran from."""
    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, TensorBoardCallback) and callback.logging_dir is None:
            callback.logging_dir = str(Path(trainer.args.output_dir) / default_logdir())


def role_parameter_groups(
    model: torch.nn.Module, family: Family, stage: Stage, decay_names: set[str]
) -> list[dict]:
    """Optimizer groups per role and decay: a role's learning rate from `training.role_learning_rates`
    (else the stage's), weight decay only on the parameters Trainer decays (not biases and norms)."""
    t = stage.training
    groups = []
    for role, params in params_by_role(model, family).items():
        lr = t.role_learning_rates.get(role, t.learning_rate)
        for decays in (True, False):
            trainable = [p for name, p in params if p.requires_grad and (name in decay_names) == decays]
            if trainable:
                decay = t.weight_decay if decays else 0.0
                groups.append({"params": trainable, "lr": lr, "weight_decay": decay, "role": role})
    return groups


class RecipeTrainerMixin:
    """What every method's trainer shares (put before the TRL trainer in the bases): resume restores the
    trainable tensors from the runner's own checkpoint file (see checkpoints.CheckpointCallback; optimizer,
    scheduler, RNG and data position come from Trainer), and the per-role optimizer groups."""

    sample_cache: PreprocessedSampleCollator | None = None  # training.preprocessed_cache
    sharding_decisions: list[Decision] = []  # FSDP: what the trainer's construction decided (report.json)
    role_groups: Callable[[set[str]], list[dict]] | None = None  # training.role_learning_rates

    def create_optimizer(self, model=None):
        """Trainer's optimizer (its class, its decay / no-decay split), with one group per role and split
        when the recipe sets per-role learning rates."""
        if self.optimizer is not None or self.role_groups is None:
            return super().create_optimizer(model)
        opt_model = self.model if model is None else model
        groups = self.role_groups(set(self.get_decay_parameter_names(opt_model)))
        optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, opt_model)
        self.optimizer = optimizer_cls(groups, **optimizer_kwargs)
        return self.optimizer

    def create_accelerator_and_postprocess(self):
        self.sharding_decisions = sharding.fsdp_decisions(self.model)
        if buffers := sharding.carry_buffers_through_the_sharded_load(self.model):
            self.sharding_decisions.append(buffers)
        with sharding.fsdp_on_cpu_ranks(self.sharding_decisions):
            super().create_accelerator_and_postprocess()

    def _get_grad_norm(self, model, grad_norm=None):
        """Trainer's gradient norm of this optimizer step (computed anyway), also handed to the NaN/inf guard,
        which keeps it on the device (callbacks.NonFiniteCallback)."""
        grad_norm = super()._get_grad_norm(model, grad_norm)
        for callback in self.callback_handler.callbacks:
            if isinstance(callback, NonFiniteCallback):
                callback.see_grad_norm(grad_norm, self.state.global_step + 1)
        return grad_norm

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        restored = restore_trainable(model or self.model, Path(resume_from_checkpoint))
        log.info("  restored %d trainable tensors from %s", restored, resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint):
        """Trainer's restore, then the learning rates this resume asked for (--resume with
        training.learning_rate=..., as a NaN stop suggests) rather than the checkpoint's."""
        asked = list(getattr(self.lr_scheduler, "base_lrs", []))
        super()._load_optimizer_and_scheduler(checkpoint)
        for old, new in keep_the_asked_learning_rates(self.optimizer, self.lr_scheduler, asked):
            log.info("  learning rate %g -> %g: this resume's, not the checkpoint's", old, new)


def every_batch_reaches_the_trained_tower(model: torch.nn.Module, family: Family) -> Decision | None:
    """When the vision tower or projector trains, a forward hook adds 0 x the sum of their trainable weights
    to the input embeddings, so every batch's loss reaches them, images or not (nothing when they are frozen).

    A batch of text rows never runs the tower. In one process, in a stage training only the tower (r2), its
    loss then reaches no trained weight and backward fails ("element 0 of tensors does not require grad");
    on one rank of several, that rank's backward would run none of the collectives the image rank's runs.
    Through the embeddings the tower's weights are used inside the forward (DDP counts them used) and every
    rank's backward takes the same path (FSDP gathers the same units). The gradient added is exactly zero,
    so a batch with images gets its gradient bit for bit; a batch of text rows gives the tower a zero
    gradient, not none (AdamW steps its moments), in one process and on N ranks alike.

    Not a zero leaf or 0 x weights added to the loss after the forward (tried: DDP hangs on the zero leaf;
    under FSDP the text rank's backward still skips the decoder layers the image rank's gathers, gloo:
    "Received data size doesn't match expected size"), nor a dummy image through the tower (LLaMA-Factory,
    ms-swift: each family's processor would have to make one, and the tower runs for nothing). Under FSDP
    the tower and projector are in the root unit (wrap_language_layers_only), gathered into plain tensors
    before any module runs; weights still sharded here (DTensor: units an accelerate config names; ZeRO-3
    partitions) are left out, to their own unit's collectives as before."""
    from torch.distributed.tensor import DTensor

    by_role = params_by_role(model, family)
    trained = {name for role in ("vision", "projector") for name, p in by_role[role] if p.requires_grad}
    if not trained:
        return None

    def add_zero_times_tower(module, args, output):
        if not torch.is_grad_enabled():
            return output
        # whole weights only: not an FSDP shard (DTensor) nor a ZeRO-3 partition (ds_id; untested, GPUs only)
        whole = [
            p
            for n, p in model.named_parameters()
            if n in trained and not isinstance(p, DTensor) and not hasattr(p, "ds_id")
        ]
        if not whole:
            return output
        # summed in fp32: an fp16 sum could overflow, and 0 x inf is NaN
        return output + 0.0 * sum(p.sum(dtype=torch.float32) for p in whole).to(output.dtype)

    model.get_input_embeddings().register_forward_hook(add_zero_times_tower)
    decision = Decision(
        "rows-without-images",
        f"0 x the {len(trained)} trained tower / projector tensors added to the input embeddings",
        "a batch without images still reaches what trains (zero gradient): backward runs, and every rank "
        "runs the same collectives",
    )
    return decision
