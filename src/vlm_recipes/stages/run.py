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
from vlm_recipes.data.mixture import draw_mixture
from vlm_recipes.data.rows import video_rules
from vlm_recipes.data.stage_data import StageData, has_text_only_rows, load_stage_data, refuse_nothing_to_see
from vlm_recipes.data.streaming import Stream, StreamCounts, streamed_split
from vlm_recipes.decisions import Decision, Environment
from vlm_recipes.evaluation.metrics import (
    decide_eval_metrics,
    evaluate_at_start,
    evaluate_stage,
    measure,
    reset_peak_memory,
)
from vlm_recipes.families.parameters import count_params_by_role
from vlm_recipes.files import write_json
from vlm_recipes.methods import method_of
from vlm_recipes.methods.callbacks import release_freed_host_memory, stage_callbacks
from vlm_recipes.methods.recipe_trainer import RecipeTrainerMixin
from vlm_recipes.methods.trainer import ConfigInputs, TrainingMethod
from vlm_recipes.model.audit import audit_freeze
from vlm_recipes.model.boundaries import install_dtype_boundaries
from vlm_recipes.model.build import BuiltModel, load_processor, load_stage_model
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
from vlm_recipes.stages.outputs import gather_sharded_state, load_final_for_eval, save_stage_outputs

log = logging.getLogger(__name__)


def run_stage(ctx: StageContext, resume_from: Path | None = None) -> dict:
    """Train one stage (from `resume_from`, a complete checkpoint, if given) and write its directory.

    Each step returns the decisions it made (its guards', speed-ups' and trainer's, each with its reason);
    `ctx.record` keeps and logs them once the step is done."""
    started = time.time()
    ctx.stage_dir.mkdir(parents=True, exist_ok=True)
    transformers.set_seed(ctx.stage.training.seed)
    if resume_from is not None:
        ctx.record(keep_the_global_batch(ctx, resume_from))

    method = method_of(ctx.stage)
    precision, decisions = check_machine(ctx, method)  # what this machine can do, before any file is read
    ctx.record(*decisions)
    data, processor, decision = check_data(ctx, method)  # every data check runs before the model loads
    ctx.record(decision)
    built, decisions = load_guarded_model(ctx, processor, precision)
    ctx.record(*decisions)
    feature_cache, decisions = speed_up(ctx, built, data)
    ctx.record(*decisions)
    report = stage_report(ctx, built, data, resume_from)
    if ctx.is_main:
        write_json(ctx.stage_dir / "report.json", report)

    trainer, callbacks, decisions = make_trainer(ctx, method, built, data, precision)
    ctx.record(*decisions)
    report["decisions"] = [d.to_dict() for d in ctx.decisions]  # with the trainer's own (dpo-reference)
    at_start = evaluate_at_start(trainer, method, data, ctx.stage_dir, resume_from, ctx.is_main)
    train_output = train(ctx, trainer, callbacks, resume_from)
    in_training = feature_cache.stats() if feature_cache is not None else None

    metrics = measure(trainer, train_output, method, built, data, callbacks, ctx.env, started)
    metrics["method"] = method.record(ctx.stage)
    if data.streamed is not None:  # what the stream read, kept and skipped in this process
        metrics["data_streamed"] = data.streamed.record()
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


def check_machine(ctx: StageContext, method: TrainingMethod) -> tuple[Decision, list[Decision]]:
    """The precision, parallelism, quantization backend and method's needs (GRPO's vLLM) this machine
    allows, and the speed-ups not proven for this family turned off: a stage the machine cannot run fails
    in a second. Returns the precision decision and all of them."""
    stage = ctx.stage
    precision = decide_precision(stage.precision, ctx.env, stage.quantized)
    return precision, [
        precision,
        decide_parallelism(ctx.env, ctx.state.num_processes, ctx.parallel.mode),
        check_quantization_backend(stage.quantization.mode, ctx.env),
        method.check_environment(stage, ctx.env),
        *turn_off_unproven_speedups(ctx.family, stage),
    ]


def check_data(ctx: StageContext, method: TrainingMethod) -> tuple[StageData, object, Decision | None]:
    """Rows checked, the model's processor loaded, every sample's length checked, what the eval's answers
    are scored by decided (from data.eval_metrics or the eval rows): a bad row costs seconds, not a model
    load."""
    stage = ctx.stage
    log.info("%s: checking data", ctx.title)
    family = ctx.family
    processor = load_processor(ctx.source, stage.data, family, ctx.recipe.trust_remote_code)
    video = video_rules(stage, family, processor, method.takes_video)
    data = load_stage_data(stage.data, method.parts().row_format, video, ctx.data_paths)
    policy, max_length = stage.data.on_bad_sample, method.max_length(stage)
    splits = {"train": (data.train, data.train_source)}
    if stage.data.streaming:  # checked as it is trained on (data/streaming.py)
        source = stage.data.train
        path = ctx.data_paths.get(source, source)
        stream = Stream(
            source, path, stage.data.train_split, stage.data, processor, family, max_length, video
        )
        data.streamed = StreamCounts()
        data.train, data.train_head = streamed_split(stream, stage.training.seed, data.streamed)
        data.lengths["train"] = []
        del splits["train"]
    refuse_nothing_to_see(stage, data)
    text_config = ctx.model_config.get_text_config() if ctx.model_config is not None else None
    refuse_inexact_speedups(family, stage, data, text_config)
    if data.eval is not None:
        splits["eval"] = (data.eval, data.eval_source or "")

    def measure(rows, source: str):
        return method.parts().check_lengths(
            rows, processor, family, max_length, source, policy, video.sampling, remembered_token_counts
        )

    for split, (rows, source) in splits.items():
        if mixture := data.mixtures.get(split):  # several sources: each counted once, then the epoch drawn
            rows, lengths, skipped = draw_mixture(mixture, measure, stage.training.seed)
        else:
            rows, lengths, skipped = measure(rows, source)
        if skipped:
            data.skipped.setdefault(split, {}).update(skipped)
        if stage.training.group_by_length:  # Trainer groups eval batches by length too
            rows = rows.add_column("length", lengths)
        setattr(data, split, rows)
        data.lengths[split] = lengths
    return data, processor, decide_eval_metrics(stage, data)


def load_guarded_model(
    ctx: StageContext, processor, precision: Decision
) -> tuple[BuiltModel, list[Decision]]:
    """The model loaded as the stage says (from the config the run read its family from), then every
    after-loading guard, then the same-start check."""
    stage = ctx.stage
    log.info(
        "%s: loading %s%s", ctx.title, ctx.source, f" ({stage.quantization.mode})" if stage.quantized else ""
    )
    sharded = ctx.parallel.mode == "model-parallel"
    built = load_stage_model(
        ctx.source,
        ctx.family,
        ctx.model_config,
        processor,
        stage,
        precision.choice,
        ctx.env.device,
        ctx.recipe.trust_remote_code,
        sharded,
    )
    guards = apply_guards(built, stage, precision.choice, ctx.env, sharded)
    return built, [*built.decisions, *guards, check_same_start(built.model, ctx)]


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


def speed_up(
    ctx: StageContext, built: BuiltModel, data: StageData
) -> tuple[VisionFeatureCache | None, list[Decision]]:
    """The model-side speed-ups the stage asks for, then the batch arithmetic."""
    stage, t = ctx.stage, ctx.stage.training
    model_side = speed_up_model(built, stage)  # first: the feature cache keys how the tower computes
    feature_cache, frozen_vision = speed_up_frozen_vision(built, stage)
    batch = batch_decision(
        ctx.parallel,
        t.per_device_batch_size,
        t.gradient_accumulation_steps,
        len(data.train) if data.streamed is None else None,
        t.epochs,
        t.max_steps,
        t.learning_rate,
        t.lr_scheduler,
        t.warmup_ratio,
        stage.sequence_parallel_size,
    )
    return feature_cache, [*model_side, *frozen_vision, batch]


def stage_report(ctx: StageContext, built: BuiltModel, data: StageData, resume_from: Path | None) -> dict:
    """report.json: every decision with its reason, parameters per role, what `vlm-recipes inspect` sees, the data."""
    counts = count_params_by_role(built.model, built.family)
    shown = [f"{role} {c['trainable']:,}/{c['total']:,}" for role, c in counts.items() if c["total"]]
    log.info("  trainable/total per role: %s", ", ".join(shown))
    return {
        "stage": ctx.stage.name,
        "index": ctx.index,
        "source": ctx.source,
        "family": built.family.name,
        "environment": ctx.env.describe(),
        "decisions": [d.to_dict() for d in ctx.decisions],
        "params_by_role": counts,
        "inspection": inspect_model(built.model, built.family, ctx.env, ctx.stage.quantized),
        "lora_targets": built.lora_targets,
        "data": {
            "train": data.train_source,
            "train_rows": len(data.train) if data.streamed is None else None,  # a stream: not counted
            "streaming": data.streamed is not None,
            "eval": data.eval_source,
            "eval_rows": len(data.eval) if data.eval is not None else 0,
            "max_sample_tokens": max(data.lengths["train"], default=None),
            "skipped_rows": data.skipped,
            # per source of a mixture, its share and the rows and tokens drawn (data/mixture.py); null: one source
            "mixture": data.mixtures["train"].report if "train" in data.mixtures else None,
            "eval_mixture": data.mixtures["eval"].report if "eval" in data.mixtures else None,
        },
        "resumed_from": str(resume_from) if resume_from else None,
    }


def make_trainer(
    ctx: StageContext, method: TrainingMethod, built: BuiltModel, data: StageData, precision: Decision
) -> tuple[RecipeTrainerMixin, dict, list[Decision]]:
    """The stage's trainer for its method (SFTTrainer, DPOTrainer, ...) with its callbacks (checkpoints,
    NaN/inf, Ctrl-C, step timing, host memory) and the speed-ups that change how batches are made; the
    decisions made on the way (host memory, the DPO reference, sharding, loss positions)."""
    args = method.build_config(
        ConfigInputs(
            ctx.stage,
            ctx.stage_dir / "checkpoints",
            precision.choice,
            ctx.env,
            data.eval is not None,
            ctx.distributed,
            unused_possible=(ctx.stage.vision_trains and has_text_only_rows(data.train_sample))
            or not built.family.reads_every_parameter,
        )
    )
    callbacks, host_memory = stage_callbacks(ctx.index, ctx.stage.training.on_nan, ctx.env)
    decisions: list[Decision] = [host_memory]  # and the trainer's own
    trainer = method.build_trainer(built, ctx.stage, args, data, decisions, list(callbacks.values()))
    return trainer, callbacks, decisions


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
        metrics.update(evaluate_stage(trainer.model, built, ctx.stage, data, ctx.stage_dir))
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
        metrics.update(evaluate_stage(final_model, built, ctx.stage, data, ctx.stage_dir))
    metrics["wall_time_s"] = round(time.time() - started, 2)
    write_json(ctx.stage_dir / "metrics.json", metrics)
    mark_done(ctx.stage_dir)
