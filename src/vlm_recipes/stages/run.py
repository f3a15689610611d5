"""Run one stage: check the data, load and guard the model, train, measure, write the stage directory.

`run_stage` is the whole story in named steps; each step is a function below it, in the same order.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
import transformers

from vlm_recipes.caches.token_counts import remembered_token_counts
from vlm_recipes.data.rows import (
    StageData,
    VideoRules,
    any_media_rows,
    dataset_signature,
    has_text_only_rows,
    load_stage_data,
)
from vlm_recipes.data.video import VideoSampling
from vlm_recipes.decisions import Decision, Environment
from vlm_recipes.errors import DataError
from vlm_recipes.evaluation.timing import StepTimer
from vlm_recipes.families import FAMILIES
from vlm_recipes.families.base import Family
from vlm_recipes.families.parameters import count_params_by_role
from vlm_recipes.files import write_json
from vlm_recipes.methods import method_of
from vlm_recipes.methods.grpo import check_generation_backend
from vlm_recipes.methods.host_memory import host_memory_release, release_freed_host_memory
from vlm_recipes.methods.resilience import CheckpointCallback, InterruptCallback, NonFiniteCallback
from vlm_recipes.methods.trainer import ConfigInputs, RecipeTrainerMixin
from vlm_recipes.model.audit import audit_freeze
from vlm_recipes.model.boundaries import install_dtype_boundaries
from vlm_recipes.model.build import BuiltModel, build_stage_model, load_processor
from vlm_recipes.model.guards import (
    apply_trainable_dtype,
    cast_frozen_to_compute,
    check_precision_agrees,
    check_quantization_backend,
    decide_parallelism,
    decide_precision,
    dtype_histogram,
    keep_cpu_4bit_weights_trainable,
    place_tensors,
    verify_quantization_scope,
)
from vlm_recipes.model.inspection import inspect_model
from vlm_recipes.plan import batch_decision
from vlm_recipes.ranks import broadcast_from_main
from vlm_recipes.recipes.schema import Stage
from vlm_recipes.runs.layout import FINAL_DIR, mark_done
from vlm_recipes.speedups.frozen_vision import VisionFeatureCache
from vlm_recipes.speedups.install import (
    refuse_inexact_speedups,
    speed_up_frozen_vision,
    speed_up_model,
    turn_off_unproven_speedups,
)
from vlm_recipes.stages.checks import check_same_start, check_stopped_early, keep_the_global_batch
from vlm_recipes.stages.context import StageContext
from vlm_recipes.stages.metrics import (
    collect_metrics,
    evaluate_at_start,
    evaluate_stage,
    peak_memory,
    reset_peak_memory,
)
from vlm_recipes.stages.outputs import gather_sharded_state, load_final_for_eval, save_stage_outputs

log = logging.getLogger(__name__)


def run_stage(ctx: StageContext, resume_from: Path | None = None) -> dict:
    """Train one stage (from `resume_from`, a complete checkpoint, if given) and write its directory."""
    started = time.time()
    ctx.stage_dir.mkdir(parents=True, exist_ok=True)
    transformers.set_seed(ctx.stage.training.seed)
    if resume_from is not None:
        ctx.record(keep_the_global_batch(ctx, resume_from))

    data, processor, precision = check_data(ctx)  # every data check runs before the model loads
    built = load_guarded_model(ctx, processor, precision)
    feature_cache = speed_up(ctx, built, data)
    report = stage_report(ctx, built, data, resume_from)
    if ctx.is_main:
        write_json(ctx.stage_dir / "report.json", report)

    trainer, callbacks = make_trainer(ctx, built, data, precision)
    report["decisions"] = [d.to_dict() for d in ctx.decisions]  # with the trainer's own (dpo-reference)
    at_start = evaluate_at_start(trainer, method_of(ctx.stage), data, ctx.stage_dir, resume_from, ctx.is_main)
    train_output = train(ctx, trainer, callbacks, resume_from)
    in_training = feature_cache.stats() if feature_cache is not None else None

    metrics = measure(ctx, built, trainer, train_output, data, callbacks, started)
    if at_start is not None:
        metrics["eval_at_start"] = at_start
    if feature_cache is not None:  # the training loop's lookups apart (the benchmark's FLOPs actually run)
        metrics["vision_feature_cache"] = {
            **feature_cache.stats(),
            "in_training": {k: in_training[k] for k in ("hits", "misses")},
        }
    if (cut := getattr(trainer, "loss_positions", None)) is not None:
        metrics["loss_positions_only"] = {"in_training": dict(cut.counted)}
    report["dtypes_after_training"] = dtype_histogram(built.model)
    finish(ctx, built, trainer, data, metrics, report, started)
    ctx.state.wait_for_everyone()  # the next stage, on every rank, loads the final/ just written
    return broadcast_from_main(ctx.state, metrics)


def check_data(ctx: StageContext) -> tuple[StageData, object, Decision]:
    """Rows checked, the model's family known, its processor loaded, every sample's length checked:
    a bad row or an unsupported model costs seconds, not a model load."""
    stage = ctx.stage
    log.info("%s: checking data", ctx.title)
    method = method_of(stage)
    family = ctx.family
    processor = load_processor(ctx.source, stage.data, family, ctx.recipe.trust_remote_code)
    video = video_rules(stage, family, processor)
    data = load_stage_data(stage.data, method.row_format, video, ctx.data_paths)
    refuse_nothing_to_see(stage, data)
    quantized = stage.quantization.mode != "none"
    precision = decide_precision(stage.precision, ctx.env, quantized)
    ctx.record(
        precision,
        decide_parallelism(ctx.env, ctx.state.num_processes, ctx.parallel.mode),
        check_quantization_backend(stage.quantization.mode, ctx.env),
        check_generation_backend(stage, ctx.env),
        *turn_off_unproven_speedups(family, stage),
    )
    refuse_inexact_speedups(family, stage, data)
    policy, max_length = stage.data.on_bad_sample, method.max_length(stage)
    splits = {"train": (data.train, data.train_source)}
    if data.eval is not None:
        splits["eval"] = (data.eval, data.eval_source or "")
    for split, (rows, source) in splits.items():
        rows, lengths, skipped = method.check_lengths(
            rows, processor, family, max_length, source, policy, video.sampling, remembered_token_counts
        )
        if skipped:
            data.skipped.setdefault(split, {}).update(skipped)
        if stage.training.group_by_length:  # Trainer groups eval batches by length too
            rows = rows.add_column("length", lengths)
        setattr(data, split, rows)
        data.lengths[split] = lengths
    return data, processor, precision


def refuse_nothing_to_see(stage: Stage, data: StageData) -> None:
    """A stage that trains only what looks at images, on rows without images or videos, would train
    nothing: no gradient reaches the tower or projector from a text-only row."""
    if stage.train.llm != "frozen" or not vision_trains(stage) or any_media_rows(data.train):
        return
    raise DataError(
        f"stage {stage.name!r} trains only the vision tower / projector, but no row of {data.train_source} "
        "has an image or a video: nothing would learn. Add image rows, or train the language model too "
        "(train.llm: lora)"
    )


def video_rules(stage: Stage, family: Family, processor) -> VideoRules:
    """How the stage's rows may hold videos: the Qwen line's SFT stages take them; the reason if not."""
    sampling = VideoSampling.from_settings(stage.data)
    factor = family.video_frame_factor(processor)
    if factor is None:
        takes = [f.name for f in FAMILIES if f.takes_video]
        why = f"{family.name} takes no video here (the families that do: {', '.join(takes)})"
        return VideoRules(sampling, None, why)
    if stage.method != "sft":
        return VideoRules(sampling, None, f"method {stage.method} takes images only (TRL's collator)")
    return VideoRules(sampling, factor)


def load_guarded_model(ctx: StageContext, processor, precision: Decision) -> BuiltModel:
    """The model loaded as the stage says, then every after-loading guard, then the same-start check."""
    stage = ctx.stage
    quantized = stage.quantization.mode != "none"
    log.info("%s: loading %s%s", ctx.title, ctx.source, f" ({stage.quantization.mode})" if quantized else "")
    sharded = ctx.parallel.mode == "model-parallel"
    built = build_stage_model(
        ctx.source,
        stage,
        precision.choice,
        ctx.env.device,
        ctx.recipe.trust_remote_code,
        processor,
        sharded=sharded,
    )
    ctx.record(*built.decisions, *apply_guards(built, stage, precision.choice, ctx.env, sharded))
    ctx.record(check_same_start(built.model, ctx))
    return built


def apply_guards(
    built: BuiltModel, stage: Stage, precision: str, env: Environment, sharded: bool = False
) -> list[Decision]:
    """The after-loading guards, in order; each returns its decision or raises GuardError."""
    device = (
        torch.device(f"cuda:{torch.cuda.current_device()}") if env.device == "cuda" else torch.device("cpu")
    )
    device = None if sharded else device  # model-parallel: every module stays on the GPU it was placed on
    quant = stage.quantization
    decisions = [
        verify_quantization_scope(built.model, built.family, quant.mode, quant.skip_roles),
        cast_frozen_to_compute(built.model, built.compute_dtype, built.frozen_in_trained_roles),
        apply_trainable_dtype(
            built.model, stage.training.trainable_dtype, built.compute_dtype, "after loading"
        ),
        place_tensors(built.model, device),
        check_precision_agrees(precision, built.model),
        install_dtype_boundaries(built.model, built.family),
    ]
    if env.device == "cpu" and (decision := keep_cpu_4bit_weights_trainable(built.model)):
        decisions.append(decision)
    return decisions


def speed_up(ctx: StageContext, built: BuiltModel, data: StageData) -> VisionFeatureCache | None:
    """The model-side speed-ups the stage asks for, then the batch arithmetic; every decision logged."""
    stage, t = ctx.stage, ctx.stage.training
    ctx.record(*speed_up_model(built, stage))  # first: the feature cache keys how the tower computes
    feature_cache, decisions = speed_up_frozen_vision(built, stage, vision_trains(stage))
    ctx.record(*decisions)
    ctx.record(
        batch_decision(
            ctx.parallel,
            t.per_device_batch_size,
            t.gradient_accumulation_steps,
            len(data.train),
            t.epochs,
            t.max_steps,
            t.learning_rate,
            t.lr_scheduler,
            t.warmup_ratio,
        )
    )
    return feature_cache


def vision_trains(stage: Stage) -> bool:
    return stage.train.vision != "frozen" or stage.train.projector != "frozen"


def stage_report(ctx: StageContext, built: BuiltModel, data: StageData, resume_from: Path | None) -> dict:
    """report.json: every decision with its reason, parameters per role, what `vlm-recipes inspect` sees, the data."""
    counts = count_params_by_role(built.model, built.family)
    log.info("  %s", _trainable_summary(counts))
    quantized = ctx.stage.quantization.mode != "none"
    return {
        "stage": ctx.stage.name,
        "index": ctx.index,
        "source": ctx.source,
        "family": built.family.name,
        "environment": ctx.env.describe(),
        "decisions": [d.to_dict() for d in ctx.decisions],
        "params_by_role": counts,
        "inspection": inspect_model(built.model, built.family, ctx.env, quantized),
        "lora_targets": built.lora_targets,
        "data": {
            "train": data.train_source,
            "train_rows": len(data.train),
            "eval": data.eval_source,
            "eval_rows": len(data.eval) if data.eval is not None else 0,
            "max_sample_tokens": max(data.lengths["train"]),
            "skipped_rows": data.skipped,
        },
        "resumed_from": str(resume_from) if resume_from else None,
    }


def _trainable_summary(counts: dict[str, dict[str, int]]) -> str:
    parts = [f"{role} {c['trainable']:,}/{c['total']:,}" for role, c in counts.items() if c["total"]]
    return "trainable/total per role: " + ", ".join(parts)


def make_trainer(
    ctx: StageContext, built: BuiltModel, data: StageData, precision: Decision
) -> tuple[RecipeTrainerMixin, dict]:
    """The stage's trainer for its method (SFTTrainer, DPOTrainer) with its callbacks (checkpoints, NaN/inf,
    Ctrl-C, step timing) and the speed-ups that change how batches are made."""
    method = method_of(ctx.stage)
    args = method.build_config(
        ConfigInputs(
            ctx.stage,
            ctx.stage_dir / "checkpoints",
            precision.choice,
            ctx.env,
            data.eval is not None,
            ctx.distributed,
            unused_possible=(vision_trains(ctx.stage) and has_text_only_rows(data.train))
            or not built.family.reads_every_parameter,
        )
    )
    callbacks = {
        "checkpoint": CheckpointCallback(ctx.index),
        "nonfinite": NonFiniteCallback(ctx.stage.training.nan_policy),
        "interrupt": InterruptCallback(),
        "timer": StepTimer(),
    }
    release, decision = host_memory_release(ctx.env)
    ctx.record(decision)
    if release is not None:
        callbacks["host_memory"] = release
    decisions: list[Decision] = []  # the trainer's own (the DPO reference, sharding, loss positions)
    trainer = method.build_trainer(built, ctx.stage, args, data, decisions, list(callbacks.values()))
    ctx.record(*decisions)
    return trainer, callbacks


def train(ctx: StageContext, trainer: RecipeTrainerMixin, callbacks: dict, resume_from: Path | None):
    """trainer.train(); a stage stopped by NaN/inf or Ctrl-C raises, saying why and what is kept."""
    if resume_from is not None:
        log.info("%s: resuming from %s", ctx.title, resume_from)
    reset_peak_memory(ctx.env)
    interrupt = callbacks["interrupt"]
    interrupt.install()
    try:
        output = trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    finally:
        interrupt.uninstall()
    check_stopped_early(ctx, callbacks["nonfinite"], interrupt)
    return output


def measure(
    ctx: StageContext,
    built: BuiltModel,
    trainer: RecipeTrainerMixin,
    train_output,
    data: StageData,
    callbacks: dict,
    started: float,
) -> dict:
    """Eval loss, the loss curve, throughput, peak memory, skipped steps and cache hits."""
    eval_metrics = trainer.evaluate() if data.eval is not None else {}
    metrics = collect_metrics(trainer, train_output, eval_metrics, started)
    metrics.update(method_of(ctx.stage).eval_metrics(eval_metrics))
    metrics.update(method_of(ctx.stage).train_metrics(trainer.state.log_history))
    metrics["peak_memory"] = peak_memory(ctx.env)
    metrics["params_by_role"] = count_params_by_role(built.model, built.family)
    metrics["skipped_steps"] = callbacks["nonfinite"].skipped_steps
    if trainer.sample_cache is not None:
        metrics["preprocessed_cache"] = trainer.sample_cache.stats()
    metrics.update(callbacks["timer"].summary())
    if data.eval is not None:
        metrics["eval_signature"] = dataset_signature(data.eval_source, data.eval)
    return metrics


def finish(
    ctx: StageContext,
    built: BuiltModel,
    trainer: RecipeTrainerMixin,
    data: StageData,
    metrics: dict,
    report: dict,
    started: float,
) -> None:
    """Answers on the eval split, final/ and adapter/, the freeze audit, report.json, metrics.json, and
    DONE last.

    FSDP and DeepSpeed hold the weights in shards: gathering them is a collective, on every rank, and a
    sharded model generates only with every rank taking part, so its answers come from final/ instead."""
    sharded = ctx.parallel.mode in ("fsdp", "deepspeed")
    generate = data.eval is not None and ctx.stage.evaluation.generate and ctx.is_main
    if generate and not sharded:
        metrics["eval"] = evaluate_stage(trainer.model, built, ctx.stage, data, ctx.stage_dir)
    gathered = gather_sharded_state(trainer) if sharded else None
    if not ctx.is_main:
        return
    release_freed_host_memory()  # evaluation's freed blocks, before the merge loads the base again
    log.info("%s: saving final model", ctx.title)
    save_stage_outputs(ctx, built, trainer.accelerator.unwrap_model(trainer.model), gathered)
    try:
        report["freeze_audit"] = audit_freeze(
            built.source,
            ctx.stage_dir / FINAL_DIR,
            built.family,
            ctx.stage,
            built.source_dtype,
            ctx.recipe.trust_remote_code,
        )
    finally:
        write_json(ctx.stage_dir / "report.json", report)  # a failed audit explains itself there too
    if generate and sharded:
        final_model = load_final_for_eval(ctx.stage_dir / FINAL_DIR, built, ctx)
        metrics["eval"] = evaluate_stage(final_model, built, ctx.stage, data, ctx.stage_dir)
    metrics["wall_time_s"] = round(time.time() - started, 2)
    write_json(ctx.stage_dir / "metrics.json", metrics)
    mark_done(ctx.stage_dir)
