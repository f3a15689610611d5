"""How a stage trains (`method:` in the recipe): each method's config builder, trainer builder, length
check and metrics. run_stage asks `method_of(stage)`; a new method (GRPO) is one more entry here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from vlm_recipes.data.collate import VideoCollator
from vlm_recipes.data.lengths import check_lengths
from vlm_recipes.data.preference import PREFERENCE, check_preference_lengths
from vlm_recipes.data.rows import MESSAGES, RowFormat
from vlm_recipes.data.video import VideoLoader, VideoSampling
from vlm_recipes.recipes.schema import Stage
from vlm_recipes.stages.dpo import build_dpo_config, build_dpo_trainer, dpo_eval_metrics, dpo_max_length
from vlm_recipes.stages.speedups import compute_loss_positions_only, wrap_collator
from vlm_recipes.stages.trainer import build_sft_config, build_trainer


@dataclass(frozen=True)
class TrainingMethod:
    name: str
    row_format: RowFormat  # the rows' check and kept columns (data.rows.load_split)
    # (stage, output_dir, precision, env, has_eval, distributed, unused_possible) -> TrainingArguments
    build_config: Callable
    # (built, stage, args, data, decisions, callbacks) -> a RecipeTrainerMixin trainer
    build_trainer: Callable
    # (ds, processor, family, max_length, source, on_bad_sample) -> (ds, lengths, skipped)
    check_lengths: Callable
    max_length: Callable[[Stage], int | None]
    eval_metrics: Callable[[dict], dict]  # trainer.evaluate()'s output -> extra keys of metrics.json


def _build_sft_trainer(built, stage, args, data, decisions=None, callbacks=None):
    trainer = build_trainer(built, stage, args, data, decisions, callbacks)
    videos = VideoLoader.for_model(built.family, built.processor, VideoSampling.from_settings(stage.data))
    trainer.data_collator = VideoCollator.extending(trainer.data_collator, videos)
    wrap_collator(trainer, built, stage)  # the batch speed-ups wrap TRL's SFT collator
    compute_loss_positions_only(trainer, built, stage, decisions)
    return trainer


METHODS: dict[str, TrainingMethod] = {
    "sft": TrainingMethod(
        name="sft",
        row_format=MESSAGES,
        build_config=build_sft_config,
        build_trainer=_build_sft_trainer,
        check_lengths=check_lengths,
        max_length=lambda stage: stage.data.max_length,
        eval_metrics=lambda eval_metrics: {},
    ),
    # Besides the generated answers (scored against `chosen`): eval reward accuracy and margin.
    "dpo": TrainingMethod(
        name="dpo",
        row_format=PREFERENCE,
        build_config=build_dpo_config,
        build_trainer=build_dpo_trainer,
        check_lengths=check_preference_lengths,
        max_length=dpo_max_length,
        eval_metrics=dpo_eval_metrics,
    ),
}


def method_of(stage: Stage) -> TrainingMethod:
    return METHODS[stage.method]
