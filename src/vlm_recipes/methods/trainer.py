"""What a training method is: TrainingMethod, the one protocol SFT, DPO, KTO, GRPO, RLOO and distill
implement (its config from ConfigInputs, its trainer from TrainerInputs, what it logs), and the
TrainingArguments every method sets the same way. What every method's trainer shares is recipe_trainer.py's.

Reading a recipe asks a method only for its section and checks (`settings`, `problems`, `takes_*`). So the
method modules import torch, transformers, TRL and the data modules where a stage is built (its config, rows
and trainer), and the loader, `--list` and `--schema` answer without them (tests/test_cli_startup.py)."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from vlm_recipes.recipes.schema import Stage
from vlm_recipes.recipes.validate import Problem
from vlm_recipes.roles import ROLES

if TYPE_CHECKING:  # the training stack, imported where a stage is built (above)
    from transformers import TrainingArguments

    from vlm_recipes.data.lengths import LengthCheck
    from vlm_recipes.data.rows import RowFormat
    from vlm_recipes.data.stage_data import StageData
    from vlm_recipes.decisions import Decision, Environment
    from vlm_recipes.methods.recipe_trainer import RecipeTrainerMixin
    from vlm_recipes.model.build import BuiltModel

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

    def common_keywords(self) -> dict:
        """The recipe's training settings as TrainingArguments keywords, the same in all methods' configs."""
        stage, env, distributed = self.stage, self.env, self.distributed
        t = stage.training
        return dict(
            output_dir=str(self.output_dir),
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
            eval_strategy="steps" if self.has_eval and stage.evaluation.eval_steps else "no",
            eval_steps=stage.evaluation.eval_steps,
            # Checkpoints to resume from (final/ is saved by the stage itself); at least two are kept, so one
            # is complete even while the next is being written.
            save_strategy="steps" if t.save_steps > 0 else "no",
            save_steps=t.save_steps if t.save_steps > 0 else 500,
            save_total_limit=t.save_total_limit,
            logging_nan_inf_filter=False,  # a NaN loss must show, not be averaged away
            bf16=self.precision == "bf16",
            fp16=self.precision == "fp16",
            use_cpu=env.device == "cpu",
            seed=t.seed,
            data_seed=t.seed,
            report_to=[r for r in t.report_to if r != "none"] or "none",
            activation_checkpointing=t.gradient_checkpointing,
            activation_checkpointing_kwargs={"use_reentrant": False} if t.gradient_checkpointing else None,
            dataloader_num_workers=t.dataloader_workers,
            # A batch goes to the GPU from pinned memory without waiting: a blocking copy synchronises the
            # host with the device at every step, each tensor of the batch (torch.cuda.set_sync_debug_mode
            # names it). Nothing to copy on a CPU.
            dataloader_pin_memory=env.device == "cuda",
            accelerator_config={"non_blocking": env.device == "cuda"},
            remove_unused_columns=False,
            # Lengths come from data.check_lengths (text + image tokens): the sampler cannot infer them for
            # images.
            train_sampling_strategy="group_by_length" if t.group_by_length else "random",
            length_column_name="length",
            ddp_backend="gloo" if distributed and env.device == "cpu" else None,
            # Every trainable tensor gets a gradient in every step, unless the vision side trains and a batch
            # has no image: only then must DDP search the graph for unused parameters (slower).
            ddp_find_unused_parameters=distributed and self.unused_possible,
        )


@dataclass(frozen=True)
class StageParts:
    """What a stage of a method is built from that needs the data modules or TRL (TrainingMethod.parts)."""

    row_format: RowFormat  # the rows' check and kept columns (data.rows.load_split)
    # data/'s length check of the rows: (rows, processor, family, max_length, source, on_bad_sample, video,
    # remember) -> (rows, tokens per row, rows skipped per reason); nothing is ever cut
    check_lengths: LengthCheck
    trainer_class: type[RecipeTrainerMixin]  # TRL's trainer with the recipe's mixins in front


@dataclass
class TrainerInputs:
    """What a stage's trainer is built from (TrainingMethod.make_trainer)."""

    built: BuiltModel
    stage: Stage
    args: TrainingArguments  # the method's config (TrainingMethod.build_config)
    data: StageData  # the stage's splits, their lengths checked
    decisions: list[Decision]  # what building the trainer decides is added here (the stage's report.json)
    callbacks: list | None = None

    def record(self, decision: Decision) -> None:
        """Keep a decision for the stage, which logs it and writes it to report.json (StageContext.record)."""
        self.decisions.append(decision)

    def warn_unused(self, keys: tuple[str, ...], why: str) -> None:
        """Say once each which of these `training` speed-ups the stage sets and its method does not use
        (`why`: what makes its batches instead)."""
        for key in keys:
            if getattr(self.stage.training, key):
                log.warning("  training.%s is not used by method %s (%s)", key, self.stage.method, why)


class TrainingMethod(ABC):
    """How a stage trains (the recipe's `method:`), one small class each: SFT (methods/sft.py), DPO and KTO
    (dpo.py, kto.py: PreferenceMethod), GRPO and RLOO (grpo.py, rloo.py: SamplingMethod). It checks its rows,
    builds its TRL config and trainer, and says what it adds to metrics.json; stages/run.py asks nothing
    else of a method."""

    name: str  # the recipe's `method:`
    settings: type | None = None  # the dataclass of the recipe's section named after the method; None: none
    eval_at_start: bool = (
        False  # eval_metrics measured before step 1 too (evaluation/metrics.evaluate_at_start)
    )
    # What its train and eval loss are: a likelihood (SFT), a preference loss (DPO, KTO), a policy loss
    # (GRPO, RLOO: lower is not better), a divergence from a teacher; losses compare within one kind only
    loss_kind: str = "likelihood"
    # The eval metrics it adds (eval_metrics' keys) that say how good the stage is: heading (the end-of-run
    # table's and compare's) and whether higher is better
    measures: dict[str, tuple[str, bool]] = {}
    # Those of its measures a run's metrics.json held before it recorded the method (`method`)
    measured_before: tuple[str, ...] = ()
    # What the rest of the package asks instead of testing the method's name: whether its rows may hold
    # videos (data/rows.video_rules, the demo's data), whether its loss takes training.loss_positions_only's
    # cut of the last layer, and whether it trains on a stream (data.streaming: `messages` rows only)
    takes_video: bool = False
    takes_loss_positions_cut: bool = False
    takes_streamed_rows: bool = False
    takes_sequence_parallel: bool = (
        False  # its loss is split over a sequence group (speedups/sequence_parallel.py)
    )

    def record(self, stage: Stage) -> dict:
        """What metrics.json keeps of the method (`method`), which the run's table and `compare` read: its
        loss kind and measures, and what else trained the stage (a teacher)."""
        return self._record(self.measures)

    def older_record(self) -> dict:
        """record() for a run from before metrics.json kept it: its loss kind and the measures it had then."""
        return self._record({key: self.measures[key] for key in self.measured_before})

    def _record(self, measures: dict[str, tuple[str, bool]]) -> dict:
        about = {key: {"heading": h, "higher_is_better": up} for key, (h, up) in measures.items()}
        return {"name": self.name, "loss": self.loss_kind, "measures": about}

    def has_reference(self, stage: Stage) -> bool:
        """The method measures the policy against a reference, the stage's start (DPO and KTO always, GRPO
        and RLOO with a KL term)."""
        return False

    def frozen_copies(self, stage: Stage) -> int:
        """Frozen copies of the model the method holds beside the one it trains, in the compute dtype
        (rank_memory.py counts them): the reference, when weights train in full; with LoRA the reference is
        the model with its adapter switched off, no copy."""
        full = "full" in (stage.train.vision, stage.train.projector, stage.train.llm)
        return int(full and self.has_reference(stage))

    def problems(self, stage: Stage, at: str, earlier: list[Stage]) -> list[Problem]:
        """What a stage of this method may not hold that no single key shows (`at`: its key path; `earlier`:
        the stages before it), checked when the recipe loads (recipe.py). A reference that is the model with
        its LoRA adapter off would move with a role trained fully beside the adapter."""
        modes = {role: getattr(stage.train, role) for role in ROLES}
        lora = [role for role, mode in modes.items() if mode == "lora"]
        full = [role for role, mode in modes.items() if mode == "full"]
        if not (self.has_reference(stage) and lora and full):
            return []
        return [
            Problem(
                f"{at}.train",
                f"method {stage.method} trains {', '.join(lora)} with LoRA and {', '.join(full)} fully: the "
                "reference (the model with its adapter off) would move with the fully trained roles. Train "
                "every role with LoRA, or every trained role fully",
            )
        ]

    @abstractmethod
    def parts(self) -> StageParts:
        """Its rows' format, their length check and its trainer class, imported here: only a stage being built
        needs them (reading a recipe, `--list` and `--schema` do not)."""

    @abstractmethod
    def max_length(self, stage: Stage) -> int | None:
        """The longest row its length check lets through, in tokens, image tokens included; None: no limit."""

    @abstractmethod
    def build_config(self, inputs: ConfigInputs) -> TrainingArguments:
        """The stage's TRL config (SFTConfig, DPOConfig, ...): inputs.common_keywords(), then its own."""

    @abstractmethod
    def make_trainer(self, inputs: TrainerInputs) -> RecipeTrainerMixin:
        """The stage's trainer: construct_trainer, what the method adds to it, prepare_trainer."""

    def build_trainer(self, built, stage, args, data, decisions=None, callbacks=None) -> RecipeTrainerMixin:
        """make_trainer on these TrainerInputs (stages/run.py's call); what it decides joins `decisions`."""
        kept = [] if decisions is None else decisions
        return self.make_trainer(TrainerInputs(built, stage, args, data, kept, callbacks))

    def check_environment(self, stage: Stage, env: Environment) -> Decision | None:
        """Before the model loads: what the method needs of this machine beyond the stage's model (GRPO's
        vLLM: a GPU and the package); its decision, or None when it needs nothing more."""
        return None

    def eval_metrics(self, eval_metrics: dict) -> dict:
        """trainer.evaluate()'s output -> the method's extra keys of metrics.json."""
        return {}

    def train_metrics(self, history: list[dict]) -> dict:
        """trainer.state.log_history -> the method's extra keys of metrics.json (GRPO's reward curve)."""
        return {}

    def construct_trainer(self, inputs: TrainerInputs, **method_arguments) -> RecipeTrainerMixin:
        """The method's trainer class on the stage's model, config (DataParallel refused first), splits,
        processor and callbacks, with what the method adds (DPO's `ref_model`, GRPO's `reward_funcs`)."""
        from vlm_recipes.model.guards import apply_parallelism

        apply_parallelism(inputs.args)
        return self.parts().trainer_class(
            model=inputs.built.model,
            args=inputs.args,
            train_dataset=inputs.data.train,
            eval_dataset=inputs.data.eval,
            processing_class=inputs.built.processor,
            callbacks=inputs.callbacks,
            **method_arguments,
        )

    def prepare_trainer(self, trainer: RecipeTrainerMixin, inputs: TrainerInputs) -> RecipeTrainerMixin:
        """Per-role learning rates, the trainable-dtype guard (the TRL trainer may have cast adapters), and
        the trained tower reached from batches without images."""
        from vlm_recipes.methods.recipe_trainer import (
            every_batch_reaches_the_trained_tower,
            keep_tensorboard_under_the_checkpoints,
            role_parameter_groups,
        )
        from vlm_recipes.model.guards import apply_trainable_dtype

        built, stage = inputs.built, inputs.stage
        keep_tensorboard_under_the_checkpoints(trainer)
        if stage.training.role_learning_rates:
            trainer.role_groups = lambda decay_names: role_parameter_groups(
                trainer.model, built.family, stage, decay_names
            )
        when = f"after {type(trainer).__bases__[-1].__name__} was built"  # the last base: TRL's trainer
        decision = apply_trainable_dtype(
            trainer.model, stage.training.trainable_dtype, built.compute_dtype, when
        )
        tower = every_batch_reaches_the_trained_tower(trainer.model, built.family)
        inputs.decisions += [*trainer.sharding_decisions, decision, *([tower] if tower else [])]
        return trainer
