"""Installing the speed-ups a stage asks for (what each changes in what is learned, exact, within rounding or
by design: docs/performance.md; the mechanisms live in `vlm_recipes/speedups/`), each logged as a decision
with its reason."""

from __future__ import annotations

import logging
from collections.abc import Callable

from transformers import Trainer

from vlm_recipes.caches.keys import speedup_cache, speedup_cache_budget
from vlm_recipes.caches.preprocessed import PreprocessedSampleCollator
from vlm_recipes.caches.storage import unwritable
from vlm_recipes.data.rows import undecoded
from vlm_recipes.data.stage_data import StageData
from vlm_recipes.decisions import Decision
from vlm_recipes.errors import GuardError
from vlm_recipes.families.base import Family
from vlm_recipes.model.build import BuiltModel
from vlm_recipes.recipes.schema import Stage
from vlm_recipes.speedups.frozen_vision import VisionFeatureCache, run_without_grad
from vlm_recipes.speedups.liger import use_liger_kernels
from vlm_recipes.speedups.loss_positions import LastLayerAtLossPositions, loss_positions_refusal
from vlm_recipes.speedups.packing import PER_SAMPLE_SDPA, PaddingFreeVisionCollator, attend_per_sample
from vlm_recipes.speedups.patch_embedding import use_matmul_patch_embedding
from vlm_recipes.speedups.sequence_parallel import sequence_parallel_refusal
from vlm_recipes.speedups.sparse_dropout import use_sparse_lora_dropout

log = logging.getLogger(__name__)


def turn_off_unproven_speedups(family: Family, stage: Stage) -> list[Decision]:
    """The speed-ups the stage asks for that its family cannot prove exact (the generic family's), off: the
    stage trains without them, each decision with why."""
    decisions = []
    for setting, why in family.unproven_speedups.items():
        if getattr(stage.training, setting):
            setattr(stage.training, setting, False)
            decisions.append(Decision(setting.replace("_", "-"), "off", f"{family.name}: {why}"))
    return decisions


def refuse_inexact_speedups(family: Family, stage: Stage, data: StageData, text_config) -> None:
    """Refuse, before the model loads, a speed-up the family cannot do exactly (with the family's reason)."""
    if stage.training.padding_free and (why := family.padding_free_refusal()):
        raise GuardError(f"stage `{stage.name}`: training.padding_free is refused for {family.name}: {why}")
    size = stage.sequence_parallel_size
    if size > 1 and (why := sequence_parallel_refusal(family, text_config, size)):
        raise GuardError(
            f"stage `{stage.name}`: sequence_parallel_size {size} is refused: {why}. Set "
            "stages.N.sequence_parallel_size=1 for it"
        )
    if stage.training.vision_feature_cache:
        splits = [
            ds for ds in (data.train_sample, data.eval) if ds is not None and "images" in ds.column_names
        ]
        most = max(
            (len(i or []) for ds in splits for i in undecoded(ds.select_columns(["images"]))["images"]),
            default=0,
        )
        if why := family.feature_cache_refusal(most):
            raise GuardError(f"stage `{stage.name}`: training.vision_feature_cache is refused: {why}")


def rope_index_of(built: BuiltModel):
    """The family's multimodal position function for padding-free packing (None: 1-D positions)."""
    return built.family.rope_index(built.model)


def cache_off(kind: str, decisions: list[Decision] | None) -> bool:
    """True, with a logged decision, where the `kind` speed-up cache's directory cannot be written (read-only,
    no permission, full): the stage trains without that cache, computing what it would have held."""
    if (why := unwritable(speedup_cache(kind))) is None:
        return False
    guard = {"vision-features": "vision-feature-cache"}.get(kind, f"{kind}-cache")
    if decisions is not None:
        decisions.append(
            Decision(guard, "off", f"its directory cannot be written ({why}): computed every time")
        )
    return True


def wrap_collator(
    trainer: Trainer, built: BuiltModel, stage: Stage, decisions: list[Decision] | None = None
) -> None:
    """The speed-ups that change how batches are made; TRL's collator still does all the processing."""
    if stage.training.preprocessed_cache and not cache_off("preprocessed", decisions):
        trainer.sample_cache = PreprocessedSampleCollator(
            trainer.data_collator,
            speedup_cache("preprocessed"),
            speedup_cache_budget(stage.training.cache_max_gb),
            image_padding=built.family.image_padding,
        )
        trainer.data_collator = trainer.sample_cache
        # images are decoded only for rows the cache does not have yet
        trainer.train_dataset = undecoded(trainer.train_dataset)
        if trainer.eval_dataset is not None:
            trainer.eval_dataset = undecoded(trainer.eval_dataset)
    if stage.training.padding_free:
        trainer.data_collator = PaddingFreeVisionCollator(
            trainer.data_collator, rope_index_of(built), built.family.rope_index_keys
        )


def speed_up_frozen_vision(
    built: BuiltModel, stage: Stage
) -> tuple[VisionFeatureCache | None, list[Decision]]:
    """A frozen vision side computes its features without autograd, and from the feature cache if asked;
    the cache (None: none) and the decisions."""
    if stage.vision_trains:
        return None, []
    run_without_grad(built.model, built.family)
    decisions = [
        Decision(
            "frozen-vision",
            "image features computed without autograd",
            "vision tower and projector are frozen: no gradient can reach them, and with activation "
            "checkpointing + LoRA transformers would otherwise run backward through the whole tower",
        )
    ]
    if not stage.training.vision_feature_cache or cache_off("vision-features", decisions):
        return None, decisions
    cache = VisionFeatureCache(
        speedup_cache("vision-features"),
        built.model,
        built.family,
        speedup_cache_budget(stage.training.cache_max_gb),
    ).install()
    decisions.append(
        Decision(
            "vision-feature-cache",
            str(cache.directory),
            "training.vision_feature_cache is on and the tower is frozen: each image's features are "
            "computed once per tower weights and processed image, then read back",
        )
    )
    return cache, decisions


def liger_kernels(built: BuiltModel, stage: Stage) -> list[Decision]:
    return [use_liger_kernels(built.model)]


def matmul_patch_embedding(built: BuiltModel, stage: Stage) -> list[Decision]:
    switched = use_matmul_patch_embedding(built.family.vision_tower(built.model))
    if not switched:
        raise GuardError(
            f"stage `{stage.name}`: training.matmul_patch_embedding: the {built.family.name} vision tower "
            "has no convolution over non-overlapping patches; remove the setting"
        )
    return [
        Decision(
            "matmul-patch-embedding",
            f"{', '.join(switched)} computed as a matmul",
            "training.matmul_patch_embedding is on: a convolution whose stride is its kernel is one "
            "linear map per patch, and the CPU convolution (its weight gradient most) is slower",
        )
    ]


def per_sample_attention(built: BuiltModel, stage: Stage) -> list[Decision]:
    if not built.family.text_positions_reach_attention:
        return [
            Decision(
                "per-sample-attention",
                "off: packed rows attended under transformers' block mask",
                f"the {built.family.name} text model hands its layers the 3-D multimodal positions, not the "
                "text ones each sample's bounds are read from",
            )
        ]
    if not attend_per_sample(built.model):
        return []
    return [
        Decision(
            "per-sample-attention",
            f"text attention {PER_SAMPLE_SDPA}",
            "training.padding_free is on and the model uses sdpa: each packed sample is attended on its "
            "own, causally, instead of densely over the whole row under a block mask",
        )
    ]


def sparse_lora_dropout(built: BuiltModel, stage: Stage) -> list[Decision]:
    swapped = use_sparse_lora_dropout(built.model)
    return [
        Decision(
            "sparse-lora-dropout",
            f"{swapped} LoRA dropouts draw only the dropped positions",
            "training.sparse_lora_dropout is on: the same drop probability per element, a fraction of "
            "the random numbers",
        )
    ]


# The speed-ups that change how the model computes, never what, by the `training` setting that asks for
# each, in the order they are installed; each returns its decisions.
MODEL_SPEEDUPS: dict[str, Callable[[BuiltModel, Stage], list[Decision]]] = {
    "liger_kernels": liger_kernels,
    "matmul_patch_embedding": matmul_patch_embedding,
    "padding_free": per_sample_attention,  # packed rows: each sample attended on its own
    "sparse_lora_dropout": sparse_lora_dropout,
}


def speed_up_model(built: BuiltModel, stage: Stage) -> list[Decision]:
    """Install the model speed-ups the stage asks for (MODEL_SPEEDUPS); their decisions."""
    decisions = []
    for setting, install in MODEL_SPEEDUPS.items():
        if getattr(stage.training, setting):
            decisions += install(built, stage)
    return decisions


def compute_loss_positions_only(
    trainer: Trainer, built: BuiltModel, stage: Stage, decisions: list[Decision] | None
) -> None:
    """The last decoder layer and the LM head computed only where the loss reads them."""
    if not stage.training.loss_positions_only:
        return
    if why := loss_positions_refusal(built.model, built.family.decoder_layer):
        raise GuardError(f"stage `{stage.name}`: training.loss_positions_only is refused: {why}")
    if trainer.compute_loss_func is not None or trainer.label_smoother is not None:
        raise GuardError(
            f"stage `{stage.name}`: training.loss_positions_only needs TRL's own token loss, not a custom "
            "loss or label smoothing (they read every position's logits)"
        )
    trainer.loss_positions = LastLayerAtLossPositions(built.model, built.family.decoder_layer)
    decision = Decision(
        "loss-positions-only",
        f"{type(trainer.loss_positions.layer).__name__} (the last) and the LM head at labelled positions",
        "training.loss_positions_only is on: the last layer's output at an unlabelled position only "
        "feeds a logit the loss masks out, so its output projection, MLP and logits are skipped there",
    )
    if decisions is not None:
        decisions.append(decision)
