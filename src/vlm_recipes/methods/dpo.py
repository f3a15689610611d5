"""The DPO stage's method: TRL's DPOTrainer on preference rows, with the family's processor, the recipe's
resume and per-role learning rates (RecipeTrainerMixin), and no second model for the reference when the
stage trains LoRA: the reference pass is the same model with its adapter switched off
(preference_trainers.py). What DPO and KTO share (PreferenceMethod) is here too: methods/kto.py builds KTO's
stage from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from vlm_recipes.methods.trainer import ConfigInputs, StageParts, TrainerInputs, TrainingMethod
from vlm_recipes.recipes.fields import ABOVE_0, doc, longest_in_tokens
from vlm_recipes.recipes.schema import Stage

if TYPE_CHECKING:
    from trl import DPOConfig

    from vlm_recipes.decisions import Decision
    from vlm_recipes.methods.recipe_trainer import RecipeTrainerMixin
    from vlm_recipes.model.build import BuiltModel

DpoLoss = Literal[
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
]


@dataclass
class DpoSettings:
    """Preference training (method: dpo): TRL's DPOTrainer on prompt / chosen / rejected rows."""

    beta: float = doc(
        "strength of the pull towards the reference model (the stage's start); lower: the policy may drift "
        "further from it",
        0.1,
        range=ABOVE_0,
    )
    loss_type: DpoLoss = doc(
        "TRL's DPO loss: sigmoid (the DPO paper), hinge, ipo, robust, apo_zero, ...", "sigmoid"
    )
    max_length: int | None = longest_in_tokens(
        "prompt + answer (chosen or rejected)", "pair", "data.max_length"
    )


def reference_decision(built: BuiltModel, stage: Stage) -> Decision:
    """A LoRA stage's reference is the model with the adapter off (validation refuses LoRA beside a fully
    trained role); a stage without LoRA gets a frozen copy, which TRL loads from the stage's source."""
    from vlm_recipes.decisions import Decision

    guard = f"{stage.method}-reference"
    if "lora" in (stage.train.vision, stage.train.projector, stage.train.llm):
        return Decision(guard, "the model with its LoRA adapter switched off", "no second model copy")
    return Decision(
        guard,
        f"a frozen copy loaded from {built.source}",
        "full fine-tune: no adapter to switch off",
    )


class PreferenceMethod(TrainingMethod):
    """What DPO and KTO share: the reference is the stage's start (with LoRA, the model with its adapter
    switched off), TRL's preference collator makes the batches, lengths are checked against
    <method>.max_length, and the eval metrics are measured before step 1 too."""

    eval_at_start = True
    loss_kind = "preference"

    def has_reference(self, stage: Stage) -> bool:
        return True

    def max_length(self, stage: Stage) -> int | None:
        """Longest prompt + answer: <method>.max_length (`dpo:` or `kto:`), else data.max_length."""
        own = stage.settings.max_length
        return own if own is not None else stage.data.max_length

    def make_trainer(self, inputs: TrainerInputs) -> RecipeTrainerMixin:
        """The stage's DPOTrainer or KTOTrainer (ref_model=None), with the parallelism and trainable-dtype
        guards applied."""
        from vlm_recipes.data.collate import UprightImagesCollator

        inputs.record(reference_decision(inputs.built, inputs.stage))
        inputs.warn_unused(("padding_free", "preprocessed_cache"), "TRL's preference collator")
        trainer = self.construct_trainer(inputs, ref_model=None)
        trainer.data_collator = UprightImagesCollator(trainer.data_collator)
        return self.prepare_trainer(trainer, inputs)


class DPO(PreferenceMethod):
    """Preference pairs (prompt, chosen, rejected), the recipe's `dpo:` section. Besides the generated
    answers (scored against `chosen`): eval reward accuracy and margin."""

    name = "dpo"
    settings = DpoSettings
    measures = {"eval_reward_accuracy": ("reward acc", True), "eval_reward_margin": ("reward margin", True)}
    measured_before = ("eval_reward_accuracy",)

    def parts(self) -> StageParts:
        from vlm_recipes.data.preference import PREFERENCE, check_preference_lengths
        from vlm_recipes.methods.preference_trainers import RecipeDPOTrainer

        return StageParts(PREFERENCE, check_preference_lengths, RecipeDPOTrainer)

    def build_config(self, inputs: ConfigInputs) -> DPOConfig:
        from trl import DPOConfig

        return DPOConfig(
            **inputs.common_keywords(),
            beta=inputs.stage.settings.beta,
            loss_type=[inputs.stage.settings.loss_type],
            # Lengths are checked before training (preference.check_preference_lengths): never cut.
            max_length=None,
        )

    def eval_metrics(self, eval_metrics: dict) -> dict:
        """Eval reward accuracy (chosen scored above rejected) and margin, from TRL's eval logs; and the
        policy's own preference, mean log p(chosen) - mean log p(rejected). The rewards are beta x the
        log-ratio to the reference, which is the policy as the stage starts: at the start they are 0 by
        construction, and the log-probability margin is what says which answer the model preferred before
        it was trained."""
        chosen, rejected = eval_metrics.get("eval_logps/chosen"), eval_metrics.get("eval_logps/rejected")
        return {
            "eval_reward_accuracy": eval_metrics.get("eval_rewards/accuracies"),
            "eval_reward_margin": eval_metrics.get("eval_rewards/margins"),
            "eval_logp_margin": None if chosen is None or rejected is None else chosen - rejected,
        }
