#!/usr/bin/env python
"""Benchmark vlm-recipes against a plain TRL script: same stage, model, data, seed and SFTConfig.

    python scripts/benchmark.py [--stages llm-lora,vision-full] [--steps 30] [--repeats 3] [--threads 2]
    python scripts/benchmark.py --model demo:qwen2-vl-2b-shaped --speedups    # on a GPU: real dimensions

Each run is a fresh process (imports and model loading count, peak memory is per run). Runs alternate
between the two ways after a warm-up pair, and the medians are compared as ours / baseline. The model is
the bench model (demo:bench-qwen2-vl, ~16M parameters, random weights) unless --model names another, and
the data has widely varying image sizes and answer lengths (demo:bench). Throughput is also given in model
TFLOP/s, and as MFU where the device's peak is known (the formula is printed with the table).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPES = {"llm-lora": "bench-llm-lora.yaml", "vision-full": "bench-vision-full.yaml"}
ROWS = [  # (label, key, higher is better)
    ("samples/s", "samples_per_s", True),
    ("text tokens/s", "text_tokens_per_s", True),
    ("image tokens/s", "image_tokens_per_s", True),
    ("step time median s", "step_time_median_s", False),
    ("step time p90 s", "step_time_p90_s", False),
    ("time to first step s", "time_to_first_step_s", False),
    ("total wall time s", "wall_s", False),
    ("model TFLOP/s", "model_tflops_per_s", True),
    ("MFU", "mfu", True),
    ("peak RSS GB", "peak_rss_gb", False),
    ("peak GPU allocated GB", "peak_gpu_allocated_gb", False),
    ("peak GPU reserved GB", "peak_gpu_reserved_gb", False),
    ("loss after N steps", "final_loss", None),
    ("loss curve vs TRL", "loss_curve_gap", None),  # max |ours - baseline| / baseline at logged steps
    ("eval loss (32 rows)", "eval_loss", None),
]
# Each one switchable; --speedups measures them together. The feature cache only exists for a frozen tower.
SPEEDUPS = {
    "llm-lora": [
        "training.padding_free=true",
        "training.preprocessed_cache=true",
        "training.vision_feature_cache=true",
        "training.sparse_lora_dropout=true",
    ],
    "vision-full": ["training.padding_free=true", "training.preprocessed_cache=true"],
}
# With the speed-ups off, ours computes what the baseline computes (the overhead check, losses step for
# step): for the QLoRA stage that means LoRA adapters in bf16, as TRL casts them. The recipes' default keeps
# fp32 master weights (the trainable-dtype guard), which the speed-up runs keep.
SAME_AS_BASELINE = {"llm-lora": ["training.trainable_dtype=compute"], "vision-full": []}
COLD_CACHE = "ours+speedups cold"  # the caches emptied before every run: a first epoch
WARM_CACHE = "ours+speedups"  # the caches the warm-up run filled: a later epoch, run or seed


def run_child(command: list[str], env: dict) -> None:
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"benchmark run failed ({result.returncode}): {' '.join(command)}\n{result.stderr[-3000:]}")


def run_ours(
    stage: str, steps: int, batch: int, precision: str, model: Path, out: Path, env: dict, extra: list[str]
) -> dict:
    run_name = f"run-{time.time_ns()}"
    command = [
        sys.executable,
        str(REPO / "scripts" / "train_recipe.py"),
        "--recipe",
        str(REPO / "benchmarks" / "recipes" / RECIPES[stage]),
        "--output-dir",
        str(out),
        "--run-name",
        run_name,
        "--max-steps",
        str(steps),
        f"training.per_device_batch_size={batch}",
        f"training.eval_batch_size={batch}",
        f"precision={precision}",
        f"model={model}",
        *extra,
    ]
    started = time.perf_counter()
    run_child(command, env)
    wall = time.perf_counter() - started
    stage_dir = next((out / Path(RECIPES[stage]).stem / run_name).glob("stage-1-*"))
    metrics = json.loads((stage_dir / "metrics.json").read_text())
    return {
        "way": "ours",
        "wall_s": wall,
        "steps": metrics["steps"],
        "train_runtime_s": metrics["train_runtime_s"],
        "final_loss": metrics["final_train_loss"],
        "loss_curve": {point["step"]: point["loss"] for point in metrics["loss_curve"]},
        "eval_loss": metrics.get("eval_loss"),
        "peak_rss_gb": metrics["peak_memory"].get("rss_gb"),
        "peak_gpu_allocated_gb": metrics["peak_memory"].get("allocated_gb"),
        "peak_gpu_reserved_gb": metrics["peak_memory"].get("reserved_gb"),
        **{k: metrics.get(k) for k in ("time_to_first_step_s", "step_time_median_s", "step_time_p90_s")},
    }


def run_baseline(
    stage: str, steps: int, batch: int, precision: str, model: Path, data: Path, env: dict
) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as result:
        command = [
            sys.executable,
            str(REPO / "benchmarks" / "baseline_trl.py"),
            "--stage",
            stage,
            "--model",
            str(model),
            "--data",
            str(data),
            "--steps",
            str(steps),
            "--batch-size",
            str(batch),
            "--out",
            result.name,
            *(["--bf16"] if precision == "bf16" else []),
        ]
        started = time.perf_counter()
        run_child(command, env)
        wall = time.perf_counter() - started
        return {**json.loads(Path(result.name).read_text()), "wall_s": wall}


def token_counts(model: Path, data: Path) -> list[tuple[int, int]]:
    """Text and image tokens of every sample, padding excluded (both ways see the same samples)."""
    from transformers import AutoProcessor

    from vlm_recipes.data.lengths import sample_token_counts
    from vlm_recipes.data.rows import load_split, undecoded
    from vlm_recipes.stages.build import detect_family

    family, _ = detect_family(str(model))
    processor = AutoProcessor.from_pretrained(model)
    family.apply_pixel_bounds(processor.image_processor, 3136, 200704)  # the bench recipes' pixel bounds
    ds, _ = load_split(str(data), "train", None)
    return sample_token_counts(undecoded(ds), processor, family)


def stage_flops_per_sample(stage: str, model: Path, counts: list[tuple[int, int]]) -> float:
    """Mean model FLOPs of one training sample of the stage (vlm_recipes.flops, formula printed)."""
    import torch
    from transformers import AutoModelForImageTextToText

    from vlm_recipes.evaluation.flops import flops_per_sample
    from vlm_recipes.recipes.load import load_recipe
    from vlm_recipes.recipes.schema import ROLES
    from vlm_recipes.stages.build import detect_family

    train = load_recipe(str(REPO / "benchmarks" / "recipes" / RECIPES[stage])).stages[0].train
    family, config = detect_family(str(model))
    with torch.device("meta"):  # shapes only: no memory, no init
        bare = AutoModelForImageTextToText.from_config(config)
    return flops_per_sample(bare, family, {role: getattr(train, role) for role in ROLES}, counts)


def loss_curve_gap(curve: dict, baseline_curve: dict) -> float | None:
    """The largest relative difference from the baseline's loss at the steps both logged."""
    common = set(map(int, curve)) & set(map(int, baseline_curve))
    gaps = [
        abs(curve.get(step, curve.get(str(step))) - baseline_curve.get(step, baseline_curve.get(str(step))))
        / abs(baseline_curve.get(step, baseline_curve.get(str(step))))
        for step in common
    ]
    return max(gaps) if gaps else None


def summarize(
    runs: list[dict],
    batch: int,
    text_per_sample: float,
    image_per_sample: float,
    flops_per_sample: float,
    peak_tflops: float | None,
) -> dict:
    summary = {}
    for key in (
        "wall_s",
        "train_runtime_s",
        "final_loss",
        "eval_loss",
        "peak_rss_gb",
        "peak_gpu_allocated_gb",
        "peak_gpu_reserved_gb",
        "time_to_first_step_s",
        "step_time_median_s",
        "step_time_p90_s",
    ):
        values = [r[key] for r in runs if r.get(key) is not None]
        summary[key] = statistics.median(values) if values else None
    samples_per_s = runs[0]["steps"] * batch / summary["train_runtime_s"]
    summary["samples_per_s"] = samples_per_s
    summary["text_tokens_per_s"] = samples_per_s * text_per_sample
    summary["image_tokens_per_s"] = samples_per_s * image_per_sample
    summary["model_tflops_per_s"] = samples_per_s * flops_per_sample / 1e12
    summary["mfu"] = summary["model_tflops_per_s"] / peak_tflops if peak_tflops else None
    return summary


def format_table(stage: str, summaries: dict[str, dict]) -> str:
    ways = [w for w in summaries if w != "baseline"]
    base = summaries["baseline"]
    header = f"{'metric':<22}" + "".join(f" {w:>18} {'/baseline':>9}" for w in ways) + f" {'plain TRL':>10}"
    lines = [f"stage {stage}", header]
    for label, key, _ in ROWS:
        if all(summary.get(key) is None for summary in summaries.values()):
            continue  # e.g. GPU memory on a CPU, MFU without a known peak
        row = f"{label:<22}"
        for way in ways:
            a, b = summaries[way].get(key), base.get(key)
            ratio = f"{a / b:.3f}" if a is not None and b else "-"
            row += f" {'-' if a is None else f'{a:.4g}':>18} {ratio:>9}"
        b = base.get(key)
        lines.append(row + f" {'-' if b is None else f'{b:.4g}':>10}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stages", default="llm-lora,vision-full")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument(
        "--repeats", type=int, default=3, help="measured runs per way, after one warm-up pair"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads in every run (fixed)")
    parser.add_argument(
        "--precision", choices=["bf16", "fp32"], help="default: what a stage picks on this machine"
    )
    parser.add_argument("--speedups", action="store_true", help="also run vlm-recipes with its speed-ups on")
    parser.add_argument(
        "--model",
        default="demo:bench-qwen2-vl",
        help="model id or directory; demo:qwen2-vl-2b-shaped is Qwen2-VL-2B's dimensions, random weights",
    )
    parser.add_argument(
        "--peak-tflops", type=float, help="the device's dense bf16 peak, for MFU (known GPUs: detected)"
    )
    parser.add_argument("--out", type=Path, default=Path("benchmark.json"))
    args = parser.parse_args()

    from vlm_recipes.data.demo_data import ensure_bench_dataset
    from vlm_recipes.demo import resolve_model_source
    from vlm_recipes.evaluation.flops import FORMULA, peak_tflops
    from vlm_recipes.stages.guards import Environment, decide_precision

    args.precision = args.precision or decide_precision("auto", Environment.detect(), quantized=False).choice
    model, data = Path(resolve_model_source(args.model)), ensure_bench_dataset() / "bench.jsonl"
    environment = Environment.detect()
    args.peak_tflops = args.peak_tflops or peak_tflops(environment.device)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(args.threads),
        "MKL_NUM_THREADS": str(args.threads),
        "TOKENIZERS_PARALLELISM": "false",
    }
    counts = token_counts(model, data)
    text_per_sample = statistics.mean(text for text, _ in counts)
    image_per_sample = statistics.mean(image for _, image in counts)
    report = {
        "machine": environment.describe(),
        "model": str(model),
        "peak_tflops": args.peak_tflops,
        "flops_formula": FORMULA,
        "threads": args.threads,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "precision": args.precision,
        "repeats": args.repeats,
        "tokens_per_sample": {"text": text_per_sample, "image": image_per_sample},
        "stages": {},
    }
    print(
        f"model {model}\nbench data {data}: {text_per_sample:.1f} text + {image_per_sample:.1f} image "
        f"tokens per sample on average\n{report['machine']}, {args.threads} threads, {args.steps} steps, "
        f"batch {args.batch_size}, {args.precision}, {args.repeats} repeats after a warm-up pair\n"
        f"model TFLOP/s and MFU: {FORMULA}; MFU against "
        f"{f'{args.peak_tflops:g} TFLOP/s' if args.peak_tflops else 'no known peak (--peak-tflops)'}\n"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for stage in args.stages.split(","):
            ways = ["ours", "baseline"]
            if args.speedups:
                ways += [COLD_CACHE, WARM_CACHE]
            runs: dict[str, list[dict]] = {way: [] for way in ways}
            flops = stage_flops_per_sample(stage, model, counts)
            report["stages"][stage] = {"flops_per_sample": flops}
            for repeat in range(args.repeats + 1):
                order = ways if repeat % 2 == 0 else list(reversed(ways))
                for way in order:
                    if way == "baseline":
                        result = run_baseline(
                            stage, args.steps, args.batch_size, args.precision, model, data, env
                        )
                    else:
                        extra = SAME_AS_BASELINE[stage] if way == "ours" else SPEEDUPS[stage]
                        caches = Path(tmp) / f"caches-{stage}-{way.replace(' ', '-')}"
                        if way == COLD_CACHE:
                            shutil.rmtree(caches, ignore_errors=True)
                        run_env = {**env, "VLM_RECIPES_SPEEDUP_CACHE": str(caches)}
                        result = run_ours(
                            stage,
                            args.steps,
                            args.batch_size,
                            args.precision,
                            model,
                            Path(tmp),
                            run_env,
                            extra,
                        )
                    print(
                        f"  {stage} {way:<14} {'warm-up' if repeat == 0 else f'run {repeat}'}: "
                        f"{result['wall_s']:.1f} s, loss {result['final_loss']:.4f}, eval {result['eval_loss']:.4f}",
                        flush=True,
                    )
                    if repeat > 0:
                        runs[way].append(result)
            summaries = {
                w: summarize(
                    runs[w], args.batch_size, text_per_sample, image_per_sample, flops, args.peak_tflops
                )
                for w in ways
            }
            baseline_curve = runs["baseline"][0]["loss_curve"]  # same seed: every run logs the same losses
            for way in ways:
                summaries[way]["loss_curve_gap"] = loss_curve_gap(runs[way][0]["loss_curve"], baseline_curve)
            report["stages"][stage].update(summary=summaries, runs=runs)
            print("\n" + format_table(stage, summaries) + "\n")
    args.out.write_text(json.dumps(report, indent=2))
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
