"""The KTO stage's method: TRL's KTOTrainer on answers marked good or bad (data/preference.py's unpaired
rows, or preference pairs unpaired), from the recipe's `kto:` section. Its reference is the stage's start:
with LoRA, the model with its adapter switched off, as for DPO (methods/dpo.py)."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

from vlm_recipes.methods.dpo import PreferenceMethod
from vlm_recipes.methods.trainer import ConfigInputs, StageParts, TrainerInputs
from vlm_recipes.recipes.fields import ABOVE_0, doc, longest_in_tokens
from vlm_recipes.recipes.schema import Stage

if TYPE_CHECKING:
    from trl import KTOConfig

    from vlm_recipes.data.stage_data import StageData
    from vlm_recipes.methods.preference_trainers import RecipeKTOTrainer

KtoLoss = Literal["kto", "apo_zero_unpaired"]


@dataclass
class KtoSettings:
    """Preference training from answers marked good or bad (method: kto): TRL's KTOTrainer on prompt /
    completion / label rows, or on preference pairs (each pair unpaired: chosen good, rejected bad)."""

    beta: float = doc(
        "strength of the pull towards the reference model (the stage's start)", 0.1, range=ABOVE_0
    )
    loss_type: KtoLoss = doc("TRL's KTO loss: kto (the KTO paper) or apo_zero_unpaired", "kto")
    desirable_weight: float = doc(
        "weight of the good answers' loss (raise it where good answers are fewer than bad ones)",
        1.0,
        range=ABOVE_0,
    )
    undesirable_weight: float = doc("weight of the bad answers' loss", 1.0, range=ABOVE_0)
    max_length: int | None = longest_in_tokens("prompt + answer", "row", "data.max_length")


def estimates_kl(stage: Stage) -> bool:
    """TRL's kto loss estimates its KL term from each row's completion paired with its batch neighbour's
    prompt, so it reads the rows in a fixed order (apo_zero_unpaired has no KL term)."""
    return stage.settings.loss_type == "kto"


def shuffled_once(data: StageData, seed: int) -> StageData:
    """The training rows (and their lengths) in one order drawn with the stage's seed."""
    order = random.Random(seed).sample(range(len(data.train)), len(data.train))
    lengths = {**data.lengths}
    if "train" in lengths:
        lengths["train"] = [lengths["train"][i] for i in order]
    return replace(data, train=data.train.select(order), lengths=lengths)


class KTO(PreferenceMethod):
    """Answers marked good or bad, the recipe's `kto:` section. Besides the generated answers: the eval
    reward and log-probability margins of the good answers over the bad ones, and the KL estimate."""

    name = "kto"
    settings = KtoSettings
    measures = {"eval_reward_margin": ("reward margin", True)}

    def parts(self) -> StageParts:
        from vlm_recipes.data.preference import UNPAIRED, check_unpaired_lengths
        from vlm_recipes.methods.preference_trainers import RecipeKTOTrainer

        return StageParts(UNPAIRED, check_unpaired_lengths, RecipeKTOTrainer)

    def build_config(self, inputs: ConfigInputs) -> KTOConfig:
        from trl import KTOConfig

        k = inputs.stage.settings
        common = inputs.common_keywords()
        if estimates_kl(inputs.stage):  # the rows are shuffled once instead (make_trainer)
            common["train_sampling_strategy"] = "sequential"
        return KTOConfig(
            **common,
            beta=k.beta,
            loss_type=k.loss_type,
            desirable_weight=k.desirable_weight,
            undesirable_weight=k.undesirable_weight,
            # Lengths are checked before training (preference.check_unpaired_lengths): never cut.
            max_length=None,
        )

    def make_trainer(self, inputs: TrainerInputs) -> RecipeKTOTrainer:
        """The stage's KTOTrainer. Where the loss estimates a KL term, the training rows are shuffled once
        with the stage's seed and read in that order: unpaired pairs come good rows first, then bad ones, and
        a batch of one kind, or of one prompt's two answers side by side, would make a poor KL pairing."""
        if estimates_kl(inputs.stage):
            inputs = replace(inputs, data=shuffled_once(inputs.data, inputs.stage.training.seed))
        return super().make_trainer(inputs)

    def eval_metrics(self, eval_metrics: dict) -> dict:
        """From TRL's eval logs: the reward margin (mean reward of the good answers minus the bad ones'; a
        reward is beta x the log-ratio to the reference, 0 at the start by construction), the policy's own
        log-probability margin (good minus bad, meaningful at the start too) and the KL estimate."""
        good, bad = eval_metrics.get("eval_logps/chosen"), eval_metrics.get("eval_logps/rejected")
        return {
            "eval_reward_margin": eval_metrics.get("eval_rewards/margins"),
            "eval_logp_margin": None if good is None or bad is None else good - bad,
            "eval_kl": eval_metrics.get("eval_kl"),
        }
