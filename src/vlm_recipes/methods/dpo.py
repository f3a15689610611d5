"""The DPO stage's trainer: TRL's DPOTrainer on preference rows, with the family's processor, the
recipe's resume and per-role learning rates (RecipeTrainerMixin), and no second model for the reference
when the stage trains LoRA: the reference pass is the same model with its adapter switched off."""

from __future__ import annotations

from trl import DPOConfig, DPOTrainer

from vlm_recipes.data.collate import UprightImagesCollator
from vlm_recipes.data.preference import PREFERENCE, check_preference_lengths
from vlm_recipes.data.rows import StageData
from vlm_recipes.decisions import Decision
from vlm_recipes.methods.trainer import (
    ConfigInputs,
    RecipeTrainerMixin,
    TrainingMethod,
    announce_method_settings,
    built_from,
    common_training_args,
    construct_trainer,
    prepare_trainer,
)
from vlm_recipes.model.build import BuiltModel
from vlm_recipes.recipes.schema import Stage

REF_ADAPTER = "ref"  # the adapter copy TRL adds for a PeftModel passed without ref_model


def dpo_max_length(stage: Stage) -> int | None:
    """Longest prompt + answer: dpo.max_length, else data.max_length."""
    return stage.dpo.max_length if stage.dpo.max_length is not None else stage.data.max_length


def build_dpo_config(inputs: ConfigInputs) -> DPOConfig:
    return DPOConfig(
        **common_training_args(inputs),
        beta=inputs.stage.dpo.beta,
        loss_type=[inputs.stage.dpo.loss_type],
        # Lengths are checked before training (preference.check_preference_lengths): never cut.
        max_length=None,
    )


class AdapterOffReferenceMixin:
    """A preference trainer (DPOTrainer, KTOTrainer) whose LoRA reference is the adapter switched off. The
    stage's adapter is fresh (B = 0), so TRL's "ref" copy of it would compute exactly what the base computes;
    without the copy, TRL disables the adapters for the reference pass. That also holds on resume, where the
    restored adapter has moved."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        model = self.accelerator.unwrap_model(self.model)
        if self.ref_model is None and REF_ADAPTER in getattr(model, "peft_config", {}):
            model.delete_adapter(REF_ADAPTER)


class RecipeDPOTrainer(AdapterOffReferenceMixin, RecipeTrainerMixin, DPOTrainer):
    """The DPO stage's trainer."""


def reference_decision(built: BuiltModel, stage: Stage) -> Decision:
    """A LoRA stage's reference is the model with the adapter off (validation refuses LoRA beside a fully
    trained role); a stage without LoRA gets a frozen copy, which TRL loads from the stage's source."""
    guard = f"{stage.method}-reference"
    if "lora" in (stage.train.vision, stage.train.projector, stage.train.llm):
        return Decision(guard, "the model with its LoRA adapter switched off", "no second model copy")
    return Decision(
        guard,
        f"a frozen copy loaded from {built.source}",
        "full fine-tune: no adapter to switch off",
    )


def build_preference_trainer(
    trainer_class: type,
    built: BuiltModel,
    stage: Stage,
    args,
    data: StageData,
    decisions: list[Decision] | None = None,
    callbacks: list | None = None,
):
    """The stage's DPOTrainer or KTOTrainer (`trainer_class`, ref_model=None), with the parallelism and
    trainable-dtype guards applied."""
    reference = reference_decision(built, stage)
    unused = ("padding_free", "preprocessed_cache")
    announce_method_settings(stage, decisions, reference, unused, "TRL's preference collator")
    trainer = construct_trainer(trainer_class, built, args, data, callbacks, ref_model=None)
    trainer.data_collator = UprightImagesCollator(trainer.data_collator)
    return prepare_trainer(trainer, built, stage, decisions, built_from(trainer))


def build_dpo_trainer(built, stage, args, data, decisions=None, callbacks=None) -> RecipeDPOTrainer:
    return build_preference_trainer(RecipeDPOTrainer, built, stage, args, data, decisions, callbacks)


def dpo_eval_metrics(eval_metrics: dict) -> dict:
    """Eval reward accuracy (chosen scored above rejected) and margin, from TRL's eval logs; and the
    policy's own preference, mean log p(chosen) - mean log p(rejected). The rewards are beta x the log-ratio
    to the reference, which is the policy as the stage starts: at the start they are 0 by construction, and
    the log-probability margin is what says which answer the model preferred before it was trained."""
    chosen, rejected = eval_metrics.get("eval_logps/chosen"), eval_metrics.get("eval_logps/rejected")
    return {
        "eval_reward_accuracy": eval_metrics.get("eval_rewards/accuracies"),
        "eval_reward_margin": eval_metrics.get("eval_rewards/margins"),
        "eval_logp_margin": None if chosen is None or rejected is None else chosen - rejected,
    }


# Besides the generated answers (scored against `chosen`): eval reward accuracy and margin.
DPO = TrainingMethod(
    name="dpo",
    row_format=PREFERENCE,
    build_config=build_dpo_config,
    build_trainer=build_dpo_trainer,
    check_lengths=check_preference_lengths,
    max_length=dpo_max_length,
    eval_metrics=dpo_eval_metrics,
    eval_at_start=True,
)
