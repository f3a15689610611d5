"""What a stage measured: loss curves, throughput, peak memory, and the scored answers on the eval split.

The stage (stages/run.py) calls `decide_eval_metrics` when it checks its data, `evaluate_at_start` before
training, `measure` after it and `evaluate_stage` once its final model is known."""

from __future__ import annotations

import logging
import random
import resource
import time
from pathlib import Path

import torch

from vlm_recipes.benchmark_metrics import METRICS
from vlm_recipes.data.rows import dataset_signature
from vlm_recipes.data.stage_data import StageData
from vlm_recipes.data.video import VideoLoader, VideoSampling
from vlm_recipes.decisions import Decision, Environment
from vlm_recipes.evaluation.benchmarks import choose_eval_metrics
from vlm_recipes.evaluation.generation import eval_targets, evaluate_generation, row_media
from vlm_recipes.families.parameters import count_params_by_role
from vlm_recipes.files import read_json, write_json, write_jsonl
from vlm_recipes.machine import peak_rss_gb
from vlm_recipes.model.build import BuiltModel
from vlm_recipes.recipes.schema import Stage

log = logging.getLogger(__name__)


def decide_eval_metrics(stage: Stage, data: StageData) -> Decision | None:
    """What the stage's eval answers are scored by (data.eval_metrics, else what the eval rows carry), kept
    in `data.eval_metrics`; None without an eval split or answers to score (evaluation.generate off). Every
    eval row's references, options and box are read here, before the model loads: a row whose values
    cannot be read is a DataError naming it."""
    if data.eval is None or not stage.evaluation.generate:
        return None
    source = data.eval_source or "the eval split"
    targets = eval_targets(data.eval, source)
    data.eval_metrics, why = choose_eval_metrics(stage.data.eval_metrics, targets, source)
    return Decision("eval-metrics", ", ".join(data.eval_metrics), why)


def answers_box_format(stage: Stage, built: BuiltModel) -> str | None:
    """The frame the stage's model writes boxes in, as its iou reward reads them: the reward's box_format,
    else the family's."""
    for reward in getattr(stage.settings, "rewards", None) or ():  # a sampling method's rewards
        if reward.name == "iou" and reward.box_format:
            return reward.box_format
    return built.family.box_format


def evaluate_stage(model, built: BuiltModel, stage: Stage, data: StageData, stage_dir: Path) -> dict:
    """Greedy answers for the eval split, scored; predictions saved beside the metrics. Returns what
    metrics.json gains: `eval` (the scores overall, per task and per source of an eval mixture) and
    `eval_<metric>`, the mean of each of the benchmarks' metrics the eval computed."""
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
        videos=VideoLoader.for_model(built.family, built.processor, VideoSampling.from_settings(stage.data)),
        metrics=data.eval_metrics or None,
        box_format=answers_box_format(stage, built),
    )
    media = row_media(data.eval, stage_dir / "eval-images")  # for the report page, beside the answers
    write_jsonl(stage_dir / "predictions.jsonl", [r | m for r, m in zip(records, media, strict=True)])
    overall = scores["all"]
    fields = overall.get("json_fields")
    means = {metric.key: overall[name] for name, metric in METRICS.items() if name in overall}
    shown = [f"; {m} {overall[m]:.3f} ({overall['rows_scored'][m]} rows)" for m in METRICS if m in overall]
    log.info(
        "  eval: exact match %.3f on %d rows%s%s",
        overall["exact_match"],
        overall["rows"],
        f"; JSON field F1 {fields['f1']:.3f}" if fields else "",
        "".join(shown),
    )
    for name, entry in scores.items():  # an eval mixture: each source's exact match under the overall
        if name.startswith("source:"):
            source = name.removeprefix("source:")
            log.info("    %s: exact match %.3f on %d rows", source, entry["exact_match"], entry["rows"])
    return {"eval": scores, **means}


EVAL_AT_START = "eval-at-start.json"


def evaluate_at_start(
    trainer, method, data: StageData, stage_dir: Path, resume_from: Path | None, is_main: bool
):
    """A GRPO or DPO stage's eval metrics before its first step, on the split and with the rewards its end
    is measured on: what the stage changed is the end against this. None without an eval split, for a method
    whose start says nothing (SFT: its eval loss curve starts at its first eval), or on a resume whose start
    was not kept. The random state is put back afterwards: sampling the eval completions does not change
    which completions training samples."""
    if data.eval is None or not method.eval_at_start:
        return None
    kept = stage_dir / EVAL_AT_START
    if resume_from is not None:
        return read_json(kept) if kept.exists() else None
    python_state, devices = random.getstate(), list(range(torch.cuda.device_count()))
    with torch.random.fork_rng(devices=devices):
        start = method.eval_metrics(trainer.evaluate(metric_key_prefix="eval"))
    random.setstate(python_state)
    if is_main:
        write_json(kept, start)
    shown = {k: round(v, 4) for k, v in start.items() if isinstance(v, float)}
    log.info("  eval at start (before step 1): %s", shown)
    return start


def measure(
    trainer,
    train_output,
    method,
    built: BuiltModel,
    data: StageData,
    callbacks: dict,
    env: Environment,
    started: float,
) -> dict:
    """After training, with the stage's TrainingMethod and callbacks: eval loss, the loss curve, the
    method's own metrics, throughput, peak memory, parameters per role, skipped steps, cache hits and step
    times."""
    eval_metrics = trainer.evaluate() if data.eval is not None else {}
    metrics = collect_metrics(trainer, train_output, eval_metrics, started)
    metrics.update(method.eval_metrics(eval_metrics))
    metrics.update(method.train_metrics(trainer.state.log_history))
    metrics["peak_memory"] = peak_memory(env)
    metrics["params_by_role"] = count_params_by_role(built.model, built.family)
    metrics["skipped_steps"] = callbacks["nonfinite"].skipped_steps
    if trainer.sample_cache is not None:
        metrics["preprocessed_cache"] = trainer.sample_cache.stats()
    metrics.update(callbacks["timer"].summary())
    if data.eval is not None:
        metrics["eval_signature"] = dataset_signature(data.eval_source, data.eval)
    return metrics


def collect_metrics(trainer, train_output, eval_metrics: dict, started: float) -> dict:
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
    return {"device": "cpu", "rss_gb": peak_rss_gb(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)}
