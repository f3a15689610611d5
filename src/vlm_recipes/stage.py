"""Run one stage: data → guards → model → SFTTrainer → final/ model dir. The only place an SFTTrainer is built."""

from __future__ import annotations

import logging
import os
import resource
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForImageTextToText
from trl import SFTConfig, SFTTrainer

from vlm_recipes.build import BuiltModel, build_stage_model, detect_family, load_processor, model_for_final
from vlm_recipes.checkpoint import (
    ADAPTER_DIR,
    FINAL_DIR,
    mark_done,
    read_provenance,
    save_final_model,
    write_json,
    write_jsonl,
)
from vlm_recipes.data import (
    StageData,
    check_lengths,
    dataset_signature,
    has_text_only_rows,
    load_stage_data,
    undecoded,
)
from vlm_recipes.demo import cache_dir
from vlm_recipes.evaluate import evaluate_generation
from vlm_recipes.frozen_vision import VisionFeatureCache, run_without_grad
from vlm_recipes.guards import (
    Decision,
    Environment,
    GuardError,
    apply_parallelism,
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
from vlm_recipes.inspect import inspect_model
from vlm_recipes.packing import (
    PER_SAMPLE_SDPA,
    PaddingFreeVisionCollator,
    attend_per_sample,
    is_packed,
    rope_index_of,
)
from vlm_recipes.parallel import ParallelPlan, ProcessGroup, batch_decision
from vlm_recipes.resilience import (
    CheckpointCallback,
    FaultInjectionCallback,
    InterruptCallback,
    NonFiniteCallback,
    StageInterrupted,
    TrainingDiverged,
    complete_checkpoints,
    restore_trainable,
)
from vlm_recipes.roles import count_params_by_role, params_by_role
from vlm_recipes.sample_cache import PreprocessedSampleCollator
from vlm_recipes.schema import Recipe, Stage
from vlm_recipes.sparse_dropout import use_sparse_lora_dropout
from vlm_recipes.timing import StepTimer

log = logging.getLogger(__name__)


@dataclass
class StageContext:
    recipe: Recipe
    stage: Stage
    index: int  # 1-based
    stage_dir: Path
    source: str  # resolved init_from: a model id or directory
    env: Environment
    group: ProcessGroup = field(default_factory=ProcessGroup)  # this process's place in a launched group
    parallel: ParallelPlan = field(default_factory=lambda: ParallelPlan("single", 1))
    decisions: list[Decision] = field(default_factory=list)


def build_sft_config(
    stage: Stage,
    output_dir: Path,
    precision: str,
    env: Environment,
    has_eval: bool,
    distributed: bool = False,
    unused_possible: bool = True,
) -> SFTConfig:
    t = stage.training
    return SFTConfig(
        output_dir=str(output_dir),
        num_train_epochs=t.epochs,
        max_steps=t.max_steps,
        per_device_train_batch_size=t.per_device_batch_size,
        per_device_eval_batch_size=t.eval_batch_size,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        learning_rate=t.learning_rate,
        lr_scheduler_type=t.lr_scheduler,
        warmup_steps=t.warmup_ratio,  # transformers 5: a float < 1 is a ratio of total steps
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        logging_steps=t.logging_steps,
        logging_first_step=True,
        # Eval loss at the end of the stage, and every `eval_steps` if the recipe asks.
        eval_strategy="steps" if has_eval and stage.evaluation.eval_steps else "no",
        eval_steps=stage.evaluation.eval_steps,
        # Checkpoints to resume from (final/ is saved by the stage itself); at least two are kept, so one
        # is complete even while the next is being written.
        save_strategy="steps" if t.save_steps > 0 else "no",
        save_steps=t.save_steps if t.save_steps > 0 else 500,
        save_total_limit=t.save_total_limit,
        logging_nan_inf_filter=False,  # a NaN loss must show, not be averaged away
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        use_cpu=env.device == "cpu",
        seed=t.seed,
        data_seed=t.seed,
        report_to=[r for r in t.report_to if r != "none"] or "none",
        activation_checkpointing=t.gradient_checkpointing,
        activation_checkpointing_kwargs={"use_reentrant": False} if t.gradient_checkpointing else None,
        # Lengths are checked before training (data.check_lengths): the collator must never truncate
        # through image tokens.
        max_length=None,
        assistant_only_loss=True,
        dataloader_num_workers=t.dataloader_workers,
        remove_unused_columns=False,
        # Lengths come from data.check_lengths (text + image tokens): the sampler cannot infer them for images.
        train_sampling_strategy="group_by_length" if t.group_by_length else "random",
        length_column_name="length",
        ddp_backend="gloo" if distributed and env.device == "cpu" else None,
        # Every trainable tensor gets a gradient in every step, unless the vision side trains and a batch
        # has no image: only then must DDP search the graph for unused parameters (slower).
        ddp_find_unused_parameters=distributed and unused_possible,
    )


def role_optimizer(built: BuiltModel, stage: Stage) -> torch.optim.Optimizer | None:
    """AdamW with one parameter group per role when the recipe sets per-role learning rates."""
    role_lrs = stage.training.role_learning_rates
    if not role_lrs:
        return None
    groups = []
    for role, params in params_by_role(built.model, built.family).items():
        trainable = [p for _, p in params if p.requires_grad]
        if trainable:
            lr = role_lrs.get(role, stage.training.learning_rate)
            groups.append(
                {"params": trainable, "lr": lr, "weight_decay": stage.training.weight_decay, "role": role}
            )
    return torch.optim.AdamW(groups, lr=stage.training.learning_rate)


def _trainable_summary(counts: dict[str, dict[str, int]]) -> str:
    parts = [f"{role} {c['trainable']:,}/{c['total']:,}" for role, c in counts.items() if c["total"]]
    return "trainable/total per role: " + ", ".join(parts)


def apply_guards(
    built: BuiltModel, stage: Stage, precision: str, env: Environment, sharded: bool = False
) -> list[Decision]:
    """The after-loading guards, in order; each returns its decision or raises GuardError."""
    device = (
        torch.device(f"cuda:{torch.cuda.current_device()}") if env.device == "cuda" else torch.device("cpu")
    )
    device = None if sharded else device  # model-parallel: every module stays on the GPU it was placed on
    quant = stage.quantization
    trainable_dtype = stage.training.trainable_dtype
    decisions = [
        verify_quantization_scope(built.model, built.family, quant.mode, quant.skip_roles),
        cast_frozen_to_compute(built.model, built.compute_dtype),
        apply_trainable_dtype(built.model, trainable_dtype, built.compute_dtype, "after loading"),
        place_tensors(built.model, device),
        check_precision_agrees(precision, built.model),
    ]
    if env.device == "cpu" and (decision := keep_cpu_4bit_weights_trainable(built.model)):
        decisions.append(decision)
    return decisions


class RecipeTrainer(SFTTrainer):
    """SFTTrainer whose resume restores the trainable tensors from the runner's own checkpoint file
    (see resilience.CheckpointCallback); optimizer, scheduler, RNG and data position come from Trainer."""

    sample_cache: PreprocessedSampleCollator | None = None  # training.preprocessed_cache

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        restored = restore_trainable(model or self.model, Path(resume_from_checkpoint))
        log.info("  restored %d trainable tensors from %s", restored, resume_from_checkpoint)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # TRL counts a padding-free batch's tokens as `position_ids.size(1)`: the batch axis of the 4-row
        # multimodal position ids, i.e. 1. Count the packed row's length instead.
        counted_before = self._total_train_tokens
        result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if model.training and is_packed(inputs):
            length = torch.tensor(inputs["position_ids"].shape[-1], device=inputs["position_ids"].device)
            tokens = self.accelerator.gather_for_metrics(length).sum().item()
            self._total_train_tokens = counted_before + tokens
            self._metrics["train"]["num_tokens"] = [self._total_train_tokens]
        return result


def build_trainer(
    built: BuiltModel,
    stage: Stage,
    args: SFTConfig,
    data: StageData,
    decisions: list[Decision] | None = None,
    callbacks: list | None = None,
) -> SFTTrainer:
    """The one SFTTrainer of a stage, with the parallelism and trainable-dtype guards applied."""
    apply_parallelism(args)
    trainer = RecipeTrainer(
        model=built.model,
        args=args,
        train_dataset=data.train,
        eval_dataset=data.eval,
        processing_class=built.processor,
        optimizers=(role_optimizer(built, stage), None),
        callbacks=callbacks,
    )
    decision = apply_trainable_dtype(
        trainer.model, stage.training.trainable_dtype, built.compute_dtype, "after SFTTrainer was built"
    )
    log.info("  %s", decision)
    if decisions is not None:
        decisions.append(decision)
    wrap_collator(trainer, built, stage)
    return trainer


def wrap_collator(trainer: RecipeTrainer, built: BuiltModel, stage: Stage) -> None:
    """The speed-ups that change how batches are made; TRL's collator still does all the processing."""
    if stage.training.preprocessed_cache:
        trainer.sample_cache = PreprocessedSampleCollator(
            trainer.data_collator, speedup_cache("preprocessed")
        )
        trainer.data_collator = trainer.sample_cache
        # images are decoded only for rows the cache does not have yet
        trainer.train_dataset = undecoded(trainer.train_dataset)
        if trainer.eval_dataset is not None:
            trainer.eval_dataset = undecoded(trainer.eval_dataset)
    if stage.training.padding_free:
        trainer.data_collator = PaddingFreeVisionCollator(trainer.data_collator, rope_index_of(built.model))


def prepare_resume(stage_dir: Path) -> Path | None:
    """The last complete checkpoint of an interrupted stage; incomplete ones are reported and removed."""
    complete, incomplete = complete_checkpoints(stage_dir / "checkpoints")
    for partial in incomplete:
        log.warning("  %s was interrupted while being written: ignored and removed", partial)
        shutil.rmtree(partial, ignore_errors=True)
    return complete[-1] if complete else None


def run_stage(ctx: StageContext, resume_from: Path | None = None) -> dict:
    """Train one stage (from `resume_from`, a complete checkpoint, if given) and write its directory."""
    stage, stage_dir = ctx.stage, ctx.stage_dir
    started = time.time()
    stage_dir.mkdir(parents=True, exist_ok=True)
    transformers.set_seed(stage.training.seed)

    # Every data check runs before the model loads: a bad row costs seconds, not a model load.
    log.info("stage %d `%s`: checking data", ctx.index, stage.name)
    data: StageData = load_stage_data(stage.data)
    quantized = stage.quantization.mode != "none"
    precision = decide_precision(stage.precision, ctx.env, quantized)
    ctx.decisions += [precision, decide_parallelism(ctx.env, ctx.group.world_size)]
    if backend := check_quantization_backend(stage.quantization.mode, ctx.env):
        ctx.decisions.append(backend)
    detect_family(
        ctx.source, ctx.recipe.trust_remote_code
    )  # an unsupported model fails before anything loads
    processor = load_processor(ctx.source, stage.data, ctx.recipe.trust_remote_code)
    policy = stage.data.on_bad_sample
    data.train, lengths, skipped = check_lengths(
        data.train, processor, stage.data.max_length, data.train_source, policy
    )
    if skipped:
        data.skipped.setdefault("train", {}).update(skipped)
    if data.eval is not None:
        data.eval, eval_lengths, skipped = check_lengths(
            data.eval, processor, stage.data.max_length, data.eval_source or "", policy
        )
        if skipped:
            data.skipped.setdefault("eval", {}).update(skipped)

    log.info(
        "stage %d `%s`: loading %s%s",
        ctx.index,
        stage.name,
        ctx.source,
        f" ({stage.quantization.mode})" if quantized else "",
    )
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
    ctx.decisions += apply_guards(built, stage, precision.choice, ctx.env, sharded)
    ctx.decisions.append(check_same_start(built.model, ctx.group))
    vision_trains = stage.train.vision != "frozen" or stage.train.projector != "frozen"
    feature_cache = speed_up_frozen_vision(built, stage, vision_trains, ctx.decisions)
    speed_up_model(built, stage, ctx.decisions)
    t = stage.training
    ctx.decisions.append(
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
    if ctx.group.is_main:
        for decision in ctx.decisions:
            log.info("  %s", decision)
    counts = count_params_by_role(built.model, built.family)
    log.info("  %s", _trainable_summary(counts))
    if stage.training.group_by_length:  # Trainer groups eval batches by length too
        data.train = data.train.add_column("length", lengths)
        if data.eval is not None:
            data.eval = data.eval.add_column("length", eval_lengths)

    report = {
        "stage": stage.name,
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
            "max_sample_tokens": max(lengths),
            "skipped_rows": data.skipped,
        },
        "resumed_from": str(resume_from) if resume_from else None,
    }
    main = ctx.group.is_main  # only rank 0 writes the stage directory; the others wait at barriers
    if main:
        write_json(stage_dir / "report.json", report)

    text_only_rows = has_text_only_rows(data.train)
    args = build_sft_config(
        stage,
        stage_dir / "checkpoints",
        precision.choice,
        ctx.env,
        data.eval is not None,
        ctx.group.distributed,
        unused_possible=vision_trains and text_only_rows,
    )
    nonfinite, interrupt = NonFiniteCallback(stage.training.nan_policy), InterruptCallback()
    timer = StepTimer()
    callbacks = [
        CheckpointCallback(ctx.index),
        nonfinite,
        interrupt,
        FaultInjectionCallback(ctx.index),
        timer,
    ]
    trainer = build_trainer(built, stage, args, data, ctx.decisions, callbacks)
    if resume_from is not None:
        log.info("stage %d `%s`: resuming from %s", ctx.index, stage.name, resume_from)
    reset_peak_memory(ctx.env)
    interrupt.install()
    try:
        train_output = trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    finally:
        interrupt.uninstall()
    check_stopped_early(ctx, nonfinite, interrupt)

    eval_metrics = trainer.evaluate() if data.eval is not None else {}
    metrics = _collect_metrics(trainer, train_output, eval_metrics, started)
    metrics["peak_memory"] = peak_memory(ctx.env)
    metrics["params_by_role"] = counts
    metrics["skipped_steps"] = nonfinite.skipped_steps
    if feature_cache is not None:
        metrics["vision_feature_cache"] = feature_cache.stats()
    if trainer.sample_cache is not None:
        metrics["preprocessed_cache"] = trainer.sample_cache.stats()
    metrics.update(timer.summary())
    report["dtypes_after_training"] = dtype_histogram(built.model)
    # FSDP and DeepSpeed hold the weights in shards: gathering them is a collective, on every rank, and
    # a sharded model generates only with every rank taking part, so its answers come from final/ instead.
    sharded = ctx.parallel.mode in ("fsdp", "deepspeed")
    generate = data.eval is not None and stage.evaluation.generate and main
    if data.eval is not None:
        metrics["eval_signature"] = dataset_signature(data.eval_source, data.eval)
    if generate and not sharded:
        metrics["eval"] = evaluate_stage(trainer.model, built, stage, data, stage_dir)
    gathered = gather_sharded_state(trainer) if sharded else None
    if main:
        log.info("stage %d `%s`: saving final model", ctx.index, stage.name)
        save_stage_outputs(ctx, built, trainer.accelerator.unwrap_model(trainer.model), gathered)
        if generate and sharded:
            final_model = load_final_for_eval(stage_dir / FINAL_DIR, built, ctx)
            metrics["eval"] = evaluate_stage(final_model, built, stage, data, stage_dir)
        metrics["wall_time_s"] = round(time.time() - started, 2)
        write_json(stage_dir / "metrics.json", metrics)
        write_json(stage_dir / "report.json", report)
        mark_done(stage_dir)
    ctx.group.barrier()  # the next stage, on every rank, loads the final/ just written
    return ctx.group.broadcast(metrics)


def speedup_cache(kind: str) -> Path:
    """Where a speed-up keeps its entries: `kind`/ under `$VLM_RECIPES_SPEEDUP_CACHE`, by default under the
    vlm-recipes cache (~/.cache/vlm-recipes)."""
    env = os.environ.get("VLM_RECIPES_SPEEDUP_CACHE")
    return (Path(env).expanduser() if env else cache_dir()) / kind


def speed_up_frozen_vision(
    built: BuiltModel, stage: Stage, vision_trains: bool, decisions: list[Decision]
) -> VisionFeatureCache | None:
    """A frozen vision side computes its features without autograd, and from the feature cache if asked."""
    if vision_trains:
        return None
    run_without_grad(built.model)
    decisions.append(
        Decision(
            "frozen-vision",
            "image features computed without autograd",
            "vision tower and projector are frozen: no gradient can reach them, and with activation "
            "checkpointing + LoRA transformers would otherwise run backward through the whole tower",
        )
    )
    if not stage.training.vision_feature_cache:
        return None
    cache = VisionFeatureCache(speedup_cache("vision-features"), built.model).install()
    decisions.append(
        Decision(
            "vision-feature-cache",
            str(cache.directory),
            "training.vision_feature_cache is on and the tower is frozen: each image's features are "
            "computed once per tower weights and processed image, then read back",
        )
    )
    return cache


def speed_up_model(built: BuiltModel, stage: Stage, decisions: list[Decision]) -> None:
    """The speed-ups that change how the model computes, never what: per-sample attention for packed
    rows, sparse LoRA dropout."""
    if stage.training.padding_free and attend_per_sample(built.model):
        decisions.append(
            Decision(
                "per-sample-attention",
                f"text attention {PER_SAMPLE_SDPA}",
                "training.padding_free is on and the model uses sdpa: each packed sample is attended on its "
                "own, causally, instead of densely over the whole row under a block mask",
            )
        )
    if stage.training.sparse_lora_dropout:
        swapped = use_sparse_lora_dropout(built.model)
        decisions.append(
            Decision(
                "sparse-lora-dropout",
                f"{swapped} LoRA dropouts draw only the dropped positions",
                "training.sparse_lora_dropout is on: the same drop probability per element, a fraction of "
                "the random numbers",
            )
        )


def check_same_start(model: torch.nn.Module, group: ProcessGroup) -> Decision:
    """Every rank must start a stage from the same weights (a stale final/ on one node would not show:
    DDP would silently overwrite it with rank 0's). Compared by a cheap per-tensor fingerprint."""
    with torch.no_grad():
        fingerprint = [
            round(float(p.detach().double().sum()), 6) if p.is_floating_point() else int(p.sum())
            for p in model.parameters()
        ]
    fingerprints = group.gather(fingerprint)
    if any(f != fingerprints[0] for f in fingerprints):
        different = [rank for rank, f in enumerate(fingerprints) if f != fingerprints[0]]
        raise GuardError(
            f"ranks {different} loaded different weights than rank 0: is the output dir shared by "
            "every node, and the same for all of them?"
        )
    where = f"identical on {group.world_size} ranks" if group.distributed else "one rank"
    return Decision("same-start", where, f"fingerprint of {len(fingerprint)} tensors compared")


def check_stopped_early(
    ctx: StageContext, nonfinite: NonFiniteCallback, interrupt: InterruptCallback
) -> None:
    """A stage that stopped on NaN/inf or Ctrl-C is not finished: say why and what is kept."""
    complete, _ = complete_checkpoints(ctx.stage_dir / "checkpoints")
    last = (
        f"the last complete checkpoint is {complete[-1]}" if complete else "no checkpoint was saved before it"
    )
    if nonfinite.diverged_at is not None:
        raise TrainingDiverged(
            f"stage {ctx.index} `{ctx.stage.name}` stopped at step {nonfinite.diverged_at}: {nonfinite.reason}; "
            f"the weights were not updated with it, and {last}. Lower training.learning_rate, check the data, "
            "or set training.nan_policy: skip_step to drop such steps."
        )
    if interrupt.requested:
        raise StageInterrupted(f"stage {ctx.index} `{ctx.stage.name}` interrupted; {last}")


def load_final_for_eval(final_dir: Path, built: BuiltModel, ctx: StageContext) -> torch.nn.Module:
    device = f"cuda:{torch.cuda.current_device()}" if ctx.env.device == "cuda" else "cpu"
    model = AutoModelForImageTextToText.from_pretrained(
        final_dir, dtype=built.compute_dtype, trust_remote_code=ctx.recipe.trust_remote_code
    )
    return model.to(device).eval()


def gather_sharded_state(trainer: SFTTrainer) -> dict[str, torch.Tensor]:
    """The whole state dict of a sharded model (accelerate gathers FSDP / ZeRO-3 shards to rank 0), keyed
    like the unwrapped model's parameters."""
    state = trainer.accelerator.get_state_dict(trainer.model)
    return {name: tensor.detach().cpu() for name, tensor in (state or {}).items()}


def save_stage_outputs(
    ctx: StageContext,
    built: BuiltModel,
    trained: torch.nn.Module,
    gathered_state: dict[str, torch.Tensor] | None = None,
) -> None:
    provenance = read_provenance(ctx.source) + [
        {
            "recipe": ctx.recipe.name,
            "stage": ctx.stage.name,
            "index": ctx.index,
            "init_from": ctx.stage.init_from,
            "source": ctx.source,
            "train": {role: getattr(ctx.stage.train, role) for role in ("vision", "projector", "llm")},
            "quantization": ctx.stage.quantization.mode,
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
    ]
    adapter_dir = None
    if built.lora_targets:
        adapter_dir = ctx.stage_dir / ADAPTER_DIR
        shutil.rmtree(adapter_dir, ignore_errors=True)
        trained.save_pretrained(str(adapter_dir), state_dict=gathered_state)
    quantized = ctx.stage.quantization.mode != "none"
    model = model_for_final(
        built, trained, adapter_dir, quantized, ctx.recipe.trust_remote_code, gathered_state
    )
    save_final_model(model, built.processor, ctx.stage_dir, provenance)


def evaluate_stage(model, built: BuiltModel, stage: Stage, data: StageData, stage_dir: Path) -> dict:
    """Greedy answers for the eval split, scored; predictions saved beside the metrics."""
    settings = stage.evaluation
    # The same autocast as training: trainable fp32 and frozen half-precision weights meet in one forward.
    autocast = built.compute_dtype if built.compute_dtype != torch.float32 else None
    scores, records = evaluate_generation(
        model,
        built.processor,
        data.eval,
        settings.max_new_tokens,
        settings.batch_size,
        settings.numeric_tolerance,
        desc=f"evaluating {stage.name}",
        autocast_dtype=autocast,
    )
    write_jsonl(stage_dir / "predictions.jsonl", records)
    overall = scores["all"]
    fields = overall.get("json_fields")
    log.info(
        "  eval: exact match %.3f on %d rows%s",
        overall["exact_match"],
        overall["rows"],
        f"; JSON field F1 {fields['f1']:.3f}" if fields else "",
    )
    return scores


def _collect_metrics(trainer, train_output, eval_metrics: dict, started: float) -> dict:
    history = trainer.state.log_history
    curve = [{"step": e["step"], "loss": e["loss"]} for e in history if "loss" in e]
    eval_curve = [{"step": e["step"], "loss": e["eval_loss"]} for e in history if "eval_loss" in e]
    runtime = train_output.metrics.get("train_runtime") or 0.0
    tokens = max((e.get("num_tokens", 0) for e in history), default=0)  # TRL counts non-padding tokens
    return {
        "train_loss": train_output.training_loss,
        "final_train_loss": curve[-1]["loss"] if curve else None,
        "eval_loss": eval_metrics.get("eval_loss"),
        "steps": trainer.state.global_step,
        "epochs": trainer.state.epoch,
        "train_runtime_s": runtime,
        "train_samples_per_second": train_output.metrics.get("train_samples_per_second"),
        "train_tokens_per_second": tokens / runtime if runtime else None,
        "loss_curve": curve,
        "eval_loss_curve": eval_curve,
        "train_time_s": round(time.time() - started, 2),
    }


def reset_peak_memory(env: Environment) -> None:
    if env.device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_memory(env: Environment) -> dict:
    """GPU: peak allocated/reserved during the stage. CPU: the process's peak RSS so far."""
    if env.device == "cuda":
        return {
            "device": "cuda",
            "allocated_gb": torch.cuda.max_memory_allocated() / 2**30,
            "reserved_gb": torch.cuda.max_memory_reserved() / 2**30,
        }
    return {"device": "cpu", "rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
