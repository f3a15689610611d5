"""The RLOO stage's trainer: TRL's RLOOTrainer (REINFORCE Leave-One-Out) on the same prompt rows and rewards as
a GRPO stage, from the recipe's `rloo:` section. A completion's advantage is its reward against the mean of
the other completions of its prompt's group (GRPO: against the whole group's mean and std); TRL's default
keeps a KL term (beta 0.05) against the stage's start. TRL 1.16's RLOOTrainer samples and scores exactly as
its GRPOTrainer does, so everything a sampling stage needs (rewards, the sampling speed-ups, the reference,
the metrics) is methods/grpo.py's."""

from __future__ import annotations

from trl import RLOOConfig, RLOOTrainer

from vlm_recipes.data.prompts import PROMPTS, check_prompt_lengths
from vlm_recipes.methods.grpo import (
    SamplingTrainerMixin,
    build_sampling_trainer,
    grpo_eval_metrics,
    grpo_train_metrics,
    sampled_max_prompt_length,
    sampling_config,
)
from vlm_recipes.methods.trainer import ConfigInputs, RecipeTrainerMixin, TrainingMethod


def build_rloo_config(inputs: ConfigInputs) -> RLOOConfig:
    return RLOOConfig(
        **sampling_config(inputs),
        normalize_advantages=inputs.stage.rloo.normalize_advantages,
    )


class RecipeRLOOTrainer(SamplingTrainerMixin, RecipeTrainerMixin, RLOOTrainer):
    """The RLOO stage's trainer."""


def build_rloo_trainer(built, stage, args, data, decisions=None, callbacks=None) -> RecipeRLOOTrainer:
    return build_sampling_trainer(RecipeRLOOTrainer, built, stage, args, data, decisions, callbacks)


RLOO = TrainingMethod(
    name="rloo",
    row_format=PROMPTS,
    build_config=build_rloo_config,
    build_trainer=build_rloo_trainer,
    check_lengths=check_prompt_lengths,
    max_length=sampled_max_prompt_length,
    eval_metrics=grpo_eval_metrics,
    train_metrics=grpo_train_metrics,
    eval_at_start=True,
)
