"""What every method's trainer shares: the TrainingArguments every method sets the same way, the mixin
that resumes from the runner's checkpoints and gives each role its learning rate, the trainable-dtype
guard after the trainer is built, and TrainingMethod, what a method module declares."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import TrainingArguments

from vlm_recipes.caches.preprocessed import PreprocessedSampleCollator
from vlm_recipes.data.rows import RowFormat, StageData
from vlm_recipes.decisions import Decision, Environment
from vlm_recipes.families.base import Family
from vlm_recipes.families.parameters import params_by_role
from vlm_recipes.methods.resilience import restore_trainable
from vlm_recipes.methods.sharding import (
    carry_buffers_through_the_sharded_load,
    fsdp_decisions,
    fsdp_on_cpu_ranks,
)
from vlm_recipes.model.build import BuiltModel
from vlm_recipes.model.guards import apply_parallelism, apply_trainable_dtype
from vlm_recipes.recipes.schema import Stage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConfigInputs:
    """What a method's TrainingArguments (SFTConfig, DPOConfig, GRPOConfig, ...) are built from."""

    stage: Stage
    output_dir: Path  # the stage's checkpoints
    precision: str  # the precision guard's choice: bf16, fp16 or fp32
    env: Environment
    has_eval: bool
    distributed: bool = False
    unused_possible: bool = True  # a trained role may get no gradient in a step (DDP must search the graph)


def common_training_args(inputs: ConfigInputs) -> dict:
    """The recipe's training settings as TrainingArguments keywords, shared by every method's config."""
    stage, output_dir, precision, env = inputs.stage, inputs.output_dir, inputs.precision, inputs.env
    has_eval, distributed, unused_possible = inputs.has_eval, inputs.distributed, inputs.unused_possible
    t = stage.training
    return dict(
        output_dir=str(output_dir),
        num_train_epochs=t.epochs,
        max_steps=t.max_steps,
        per_device_train_batch_size=t.per_device_batch_size,
        per_device_eval_batch_size=t.eval_batch_size,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        learning_rate=t.learning_rate,
        lr_scheduler_type=t.lr_scheduler,
        warmup_steps=t.warmup_ratio,  # transformers 5: a float < 1 is a ratio of total steps
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        logging_steps=t.logging_steps,
        logging_first_step=True,
        # Eval loss at the end of the stage, and every `eval_steps` if the recipe asks.
        eval_strategy="steps" if has_eval and stage.evaluation.eval_steps else "no",
        eval_steps=stage.evaluation.eval_steps,
        # Checkpoints to resume from (final/ is saved by the stage itself); at least two are kept, so one
        # is complete even while the next is being written.
        save_strategy="steps" if t.save_steps > 0 else "no",
        save_steps=t.save_steps if t.save_steps > 0 else 500,
        save_total_limit=t.save_total_limit,
        logging_nan_inf_filter=False,  # a NaN loss must show, not be averaged away
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        use_cpu=env.device == "cpu",
        seed=t.seed,
        data_seed=t.seed,
        report_to=[r for r in t.report_to if r != "none"] or "none",
        activation_checkpointing=t.gradient_checkpointing,
        activation_checkpointing_kwargs={"use_reentrant": False} if t.gradient_checkpointing else None,
        dataloader_num_workers=t.dataloader_workers,
        remove_unused_columns=False,
        # Lengths come from data.check_lengths (text + image tokens): the sampler cannot infer them for images.
        train_sampling_strategy="group_by_length" if t.group_by_length else "random",
        length_column_name="length",
        ddp_backend="gloo" if distributed and env.device == "cpu" else None,
        # Every trainable tensor gets a gradient in every step, unless the vision side trains and a batch
        # has no image: only then must DDP search the graph for unused parameters (slower).
        ddp_find_unused_parameters=distributed and unused_possible,
    )


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
    trainable tensors from the runner's own checkpoint file (see resilience.CheckpointCallback; optimizer,
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
        self.sharding_decisions = fsdp_decisions(self.model)
        if buffers := carry_buffers_through_the_sharded_load(self.model):
            self.sharding_decisions.append(buffers)
        with fsdp_on_cpu_ranks(self.sharding_decisions):
            super().create_accelerator_and_postprocess()

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        restored = restore_trainable(model or self.model, Path(resume_from_checkpoint))
        log.info("  restored %d trainable tensors from %s", restored, resume_from_checkpoint)


def announce_method_settings(
    stage: Stage, decisions: list[Decision] | None, reference: Decision, unused: tuple[str, ...], why: str
) -> None:
    """A preference or RL stage's reference model (logged and recorded), and the `training` speed-ups it does
    not use (`why`: what makes its batches instead), said once each."""
    log.info("  %s", reference)
    if decisions is not None:
        decisions.append(reference)
    for key in unused:
        if getattr(stage.training, key):
            log.warning("  training.%s is not used by method %s (%s)", key, stage.method, why)


def construct_trainer(trainer_class: type, built: BuiltModel, args, data, callbacks, **method_arguments):
    """The TRL trainer of a stage: its model, config (DataParallel refused first), splits, processor and
    callbacks, with what the method adds (DPO's `ref_model`, GRPO's `reward_funcs`)."""
    apply_parallelism(args)
    return trainer_class(
        model=built.model,
        args=args,
        train_dataset=data.train,
        eval_dataset=data.eval,
        processing_class=built.processor,
        callbacks=callbacks,
        **method_arguments,
    )


def built_from(trainer) -> str:
    """For the trainable-dtype guard's log: after which TRL trainer was built (the last base of ours)."""
    return f"after {type(trainer).__bases__[-1].__name__} was built"


def prepare_trainer(
    trainer: RecipeTrainerMixin, built: BuiltModel, stage: Stage, decisions: list[Decision] | None, when: str
):
    """Per-role learning rates and the trainable-dtype guard (the TRL trainer may have cast adapters)."""
    if stage.training.role_learning_rates:
        trainer.role_groups = lambda decay_names: role_parameter_groups(
            trainer.model, built.family, stage, decay_names
        )
    decision = apply_trainable_dtype(trainer.model, stage.training.trainable_dtype, built.compute_dtype, when)
    log.info("  %s", decision)
    tower = every_batch_reaches_the_trained_tower(trainer.model, built.family)
    if decisions is not None:
        decisions += [*trainer.sharding_decisions, decision, *([tower] if tower else [])]
    return trainer


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
    log.info("  %s", decision)
    return decision


# (built, stage, its TrainingArguments, data, the stage's decisions, callbacks) -> the stage's trainer
BuildTrainer = Callable[
    [BuiltModel, Stage, TrainingArguments, StageData, list[Decision] | None, list | None], RecipeTrainerMixin
]


@dataclass(frozen=True)
class TrainingMethod:
    """What a method module declares (SFT, DPO, KTO, GRPO, RLOO): how its rows are checked, its config and
    trainer built, and what it adds to metrics.json; stages/run.py asks nothing else of a method."""

    name: str
    row_format: RowFormat  # the rows' check and kept columns (data.rows.load_split)
    build_config: Callable[[ConfigInputs], TrainingArguments]
    build_trainer: BuildTrainer
    # (ds, processor, family, max_length, source, on_bad_sample) -> (ds, lengths, skipped)
    check_lengths: Callable
    max_length: Callable[[Stage], int | None]
    eval_metrics: Callable[[dict], dict]  # trainer.evaluate()'s output -> extra keys of metrics.json
    # trainer.state.log_history -> extra keys of metrics.json (GRPO's reward curve)
    train_metrics: Callable[[list[dict]], dict] = lambda history: {}
    # eval_metrics measured before step 1 too (stages/metrics.evaluate_at_start): GRPO's reward, DPO's margin
    eval_at_start: bool = False
