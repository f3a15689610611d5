"""The KTO stage's trainer: TRL's KTOTrainer on answers marked good or bad (data/preference.py's unpaired
rows, or preference pairs unpaired), from the recipe's `kto:` section. Its reference is the stage's start:
with LoRA, the model with its adapter switched off, as for DPO (methods/dpo.py)."""

from __future__ import annotations

import random
from dataclasses import replace

from trl import KTOConfig, KTOTrainer

from vlm_recipes.data.preference import UNPAIRED, check_unpaired_lengths
from vlm_recipes.methods.dpo import AdapterOffReferenceMixin, build_preference_trainer
from vlm_recipes.methods.trainer import ConfigInputs, RecipeTrainerMixin, TrainingMethod, common_training_args
from vlm_recipes.recipes.schema import Stage


def kto_max_length(stage: Stage) -> int | None:
    """Longest prompt + answer: kto.max_length, else data.max_length."""
    return stage.kto.max_length if stage.kto.max_length is not None else stage.data.max_length


def build_kto_config(inputs: ConfigInputs) -> KTOConfig:
    k = inputs.stage.kto
    common = common_training_args(inputs)
    if estimates_kl(inputs.stage):  # the rows are shuffled once instead (build_kto_trainer)
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


def estimates_kl(stage: Stage) -> bool:
    """TRL's kto loss estimates its KL term from each row's completion paired with its batch neighbour's
    prompt, so it reads the rows in a fixed order (apo_zero_unpaired has no KL term)."""
    return stage.kto.loss_type == "kto"


class RecipeKTOTrainer(AdapterOffReferenceMixin, RecipeTrainerMixin, KTOTrainer):
    """The KTO stage's trainer."""


def build_kto_trainer(built, stage, args, data, decisions=None, callbacks=None) -> RecipeKTOTrainer:
    """The stage's KTOTrainer. Where the loss estimates a KL term, the training rows are shuffled once with
    the stage's seed and read in that order: unpaired pairs come good rows first, then bad ones, and a batch
    of one kind, or of one prompt's two answers side by side, would make a poor KL pairing."""
    if estimates_kl(stage):
        order = random.Random(stage.training.seed).sample(range(len(data.train)), len(data.train))
        lengths = {**data.lengths}
        if "train" in lengths:
            lengths["train"] = [lengths["train"][i] for i in order]
        data = replace(data, train=data.train.select(order), lengths=lengths)
    return build_preference_trainer(RecipeKTOTrainer, built, stage, args, data, decisions, callbacks)


def kto_eval_metrics(eval_metrics: dict) -> dict:
    """From TRL's eval logs: the reward margin (mean reward of the good answers minus the bad ones'; a reward
    is beta x the log-ratio to the reference, 0 at the start by construction), the policy's own
    log-probability margin (good minus bad, meaningful at the start too) and the KL estimate."""
    good, bad = eval_metrics.get("eval_logps/chosen"), eval_metrics.get("eval_logps/rejected")
    return {
        "eval_reward_margin": eval_metrics.get("eval_rewards/margins"),
        "eval_logp_margin": None if good is None or bad is None else good - bad,
        "eval_kl": eval_metrics.get("eval_kl"),
    }


KTO = TrainingMethod(
    name="kto",
    row_format=UNPAIRED,
    build_config=build_kto_config,
    build_trainer=build_kto_trainer,
    check_lengths=check_unpaired_lengths,
    max_length=kto_max_length,
    eval_metrics=kto_eval_metrics,
    eval_at_start=True,
)
