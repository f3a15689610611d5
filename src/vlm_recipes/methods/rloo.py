"""The RLOO stage's method: TRL's RLOOTrainer (REINFORCE Leave-One-Out) on the same prompt rows and rewards as
a GRPO stage, from the recipe's `rloo:` section. A completion's advantage is its reward against the mean of
the other completions of its prompt's group (GRPO: against the whole group's mean and std); TRL's default
keeps a KL term (beta 0.05) against the stage's start. TRL 1.16's RLOOTrainer samples and scores exactly as
its GRPOTrainer does, so everything a sampling stage needs (rewards, the sampling speed-ups, the reference,
the metrics) is methods/grpo.py's SamplingMethod."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from vlm_recipes.methods.grpo import SamplingMethod
from vlm_recipes.methods.sampling_settings import SampledCompletionSettings
from vlm_recipes.methods.trainer import ConfigInputs, StageParts
from vlm_recipes.recipes.fields import AT_LEAST_0, doc

if TYPE_CHECKING:
    from trl import RLOOConfig


@dataclass
class RlooSettings(SampledCompletionSettings):
    """REINFORCE Leave-One-Out (method: rloo): TRL's RLOOTrainer on `prompt` rows; a completion's advantage
    is its reward against the mean of the other completions of its group. TRL's default KL term (beta 0.05)."""

    beta: float = doc(
        "KL penalty towards the reference (the stage's start; with LoRA, the model with its adapter off), "
        "as TRL's RLOOTrainer applies it; 0: no reference pass",
        0.05,
        range=AT_LEAST_0,
    )
    normalize_advantages: bool = doc(
        "divide the advantages by their std over the generation batch (mean 0, std 1)", False
    )


class RLOO(SamplingMethod):
    """GRPO's rows and rewards, the `rloo:` section: a completion's advantage is its reward against the mean
    of the other completions of its group."""

    name = "rloo"
    settings = RlooSettings

    def parts(self) -> StageParts:
        from vlm_recipes.data.prompts import PROMPTS, check_prompt_lengths
        from vlm_recipes.methods.sampling_trainers import RecipeRLOOTrainer

        return StageParts(PROMPTS, check_prompt_lengths, RecipeRLOOTrainer)

    def build_config(self, inputs: ConfigInputs) -> RLOOConfig:
        from trl import RLOOConfig

        return RLOOConfig(
            **self.sampling_keywords(inputs),
            normalize_advantages=inputs.stage.settings.normalize_advantages,
        )
