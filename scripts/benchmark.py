#!/usr/bin/env python
"""Benchmark vlm-recipes against a plain TRL script, in the scenarios a user runs.

    python scripts/benchmark.py                          # both stages, every scenario -> benchmark.json
    python scripts/benchmark.py --stages llm-lora --scenarios first-epoch --repeats 3
    python scripts/benchmark.py --readme benchmarks/results/cpu-2-cores.json   # README's tables from a file
    python scripts/benchmark.py --model demo:qwen2-vl-2b-shaped                # on a GPU: real dimensions

Scenarios, each a row of the table. No run warms up the caches a measured run reads:
- first-epoch: one epoch on empty caches (token counts included), seed 0: every seed recipe's first run.
- second-seed: one epoch with seed 1 over the same data, reading the caches first-epoch's run left: the
  next seed, recipe or run over the same data.
- three-epochs: three epochs, caches empty at the start (they fill during the first).

Ways: plain TRL (`benchmarks/baseline_trl.py`, the script one writes by hand), vlm-recipes with its speed-ups
off (first-epoch only: the runner's own overhead, computing what TRL computes), and vlm-recipes with them on.
Every run is a fresh process, and both ways are measured over the same window and the same work: wall time
and peak RSS are the whole process's (`os.wait4`), samples/s is samples trained / the training loop's
runtime, the GPU peak (on a GPU) is reset before training and read after evaluating, on both sides. The
eval loss (the first 32 rows, after training) is the loss check. Model TFLOP/s counts the FLOPs actually
run: where the vision feature cache answered, the tower's and projector's are left out.

Within a repeat the ways alternate in order; medians over repeats are compared as ours / TRL.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPES = {"llm-lora": "bench-llm-lora.yaml", "vision-full": "bench-vision-full.yaml"}
STAGE_TITLES = {"llm-lora": "r1 `llm-lora` (QLoRA)", "vision-full": "r2 `vision-full`"}
SCENARIOS = {  # name: (epochs, seed, caches: "empty" or "left by first-epoch", title)
    "first-epoch": (1, 0, "empty", "first epoch, empty caches"),
    "second-seed": (1, 1, "first-epoch's", "another seed, caches from the first run"),
    "three-epochs": (3, 0, "empty", "three epochs, caches empty at the start"),
}
BASELINE, OURS, SPEEDUPS_ON = "plain TRL", "vlm-recipes, speed-ups off", "vlm-recipes, speed-ups on"
WAYS = [BASELINE, OURS, SPEEDUPS_ON]
WAYS_OF = {"first-epoch": WAYS}  # the overhead check runs once
SPEEDUPS = {  # each switchable; the feature cache only exists for a frozen tower
    "llm-lora": [
        "training.padding_free=true",
        "training.preprocessed_cache=true",
        "training.vision_feature_cache=true",
        "training.sparse_lora_dropout=true",
        "training.loss_positions_only=true",
        "training.matmul_patch_embedding=true",
    ],
    "vision-full": [
        "training.padding_free=true",
        "training.preprocessed_cache=true",
        "training.loss_positions_only=true",
        "training.matmul_patch_embedding=true",
    ],
}
# Speed-ups off, ours computes what TRL computes, adapters in the compute dtype as TRL casts them for QLoRA
# (bf16), where that is bf16. Where it is fp32 (a CPU without native bf16) TRL still casts QLoRA adapters to
# bf16, which such a CPU emulates; ours keeps them in fp32 there. The speed-up runs keep the recipe default,
# fp32 adapters (the trainable-dtype guard).
SAME_AS_BASELINE = {"llm-lora": ["training.trainable_dtype=compute"], "vision-full": []}
LIBRARIES = ("torch", "transformers", "trl", "peft", "accelerate", "bitsandbytes", "datasets")
MEASURED = (  # what every run reports; summaries are medians of these
    "wall_s",
    "peak_rss_gb",
    "peak_gpu_allocated_gb",
    "train_runtime_s",
    "samples_per_s",
    "model_tflops_per_s",
    "mfu",
    "time_to_first_step_s",
    "step_time_median_s",
    "step_time_p90_s",
    "final_loss",
    "eval_loss",
)
README_BEGIN, README_END = "<!-- benchmark table: begin -->", "<!-- benchmark table: end -->"


def readme_markers(report: dict) -> tuple[str, str]:
    """Where a results file's tables go in README: one block per precision (fp32's markers unnamed)."""
    precision = report["about"]["precision"]
    if precision == "fp32":
        return README_BEGIN, README_END
    return f"<!-- benchmark table ({precision}): begin -->", f"<!-- benchmark table ({precision}): end -->"


# --------------------------------------------------------------------------- running


def run_process(command: list[str], env: dict) -> tuple[float, float]:
    """Run a command to its end; its wall seconds and the whole process's peak RSS in GB."""
    with tempfile.TemporaryFile() as output:
        started = time.perf_counter()
        process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - started
        process.returncode = os.waitstatus_to_exitcode(status)
        if process.returncode != 0:
            output.seek(0)
            tail = output.read()[-3000:].decode(errors="replace")
            sys.exit(f"benchmark run failed ({process.returncode}): {' '.join(command)}\n{tail}")
    return wall, usage.ru_maxrss / 2**20  # Linux: kilobytes


def run_ours(stage: str, scenario: str, extra: list[str], setup: dict, caches: Path) -> dict:
    """One vlm-recipes run, its caches in `caches`."""
    epochs, seed, _, _ = SCENARIOS[scenario]
    out, run_name = caches / "runs", f"{scenario}-{time.time_ns()}"
    command = [
        sys.executable,
        str(REPO / "scripts" / "train_recipe.py"),
        "--recipe",
        str(REPO / "benchmarks" / "recipes" / RECIPES[stage]),
        "--output-dir",
        str(out),
        "--run-name",
        run_name,
        "--epochs",
        str(epochs),
        f"training.seed={seed}",
        f"training.per_device_batch_size={setup['batch_size']}",
        f"training.eval_batch_size={setup['batch_size']}",
        f"precision={setup['precision']}",
        f"model={setup['model']}",
        f"data.train={setup['data']}",
        f"data.eval={setup['data']}",
        f"data.max_train_samples={setup['rows']}",
        *extra,
    ]
    wall, rss = run_process(command, cache_env(setup["env"], caches))
    metrics = json.loads(next(out.glob(f"*/{run_name}/stage-1-*/metrics.json")).read_text())
    gpu = metrics["peak_memory"]
    return {
        "wall_s": wall,
        "peak_rss_gb": rss,
        "peak_gpu_allocated_gb": gpu.get("allocated_gb"),
        "train_runtime_s": metrics["train_runtime_s"],
        "final_loss": metrics["final_train_loss"],
        "eval_loss": metrics.get("eval_loss"),
        "loss_curve": {point["step"]: point["loss"] for point in metrics["loss_curve"]},
        "vision_fraction_computed": fraction_computed(metrics.get("vision_feature_cache")),
        "flops_skipped": flops_skipped(metrics.get("loss_positions_only"), setup["last_layer_flops"][stage]),
        **{k: metrics.get(k) for k in ("time_to_first_step_s", "step_time_median_s", "step_time_p90_s")},
    }


def fraction_computed(feature_cache: dict | None) -> float:
    """The share of images whose features the tower computed in the training loop (1 without the cache)."""
    if not feature_cache:
        return 1.0
    looked_up = feature_cache["in_training"]["hits"] + feature_cache["in_training"]["misses"]
    return feature_cache["in_training"]["misses"] / looked_up if looked_up else 1.0


def flops_skipped(loss_positions: dict | None, per_position: float) -> float:
    """The FLOPs training.loss_positions_only did not run: the last layer's and LM head's share at every
    unlabelled position trained on."""
    if not loss_positions:
        return 0.0
    counted = loss_positions["in_training"]
    return (counted["positions"] - counted["labelled"]) * per_position


def cache_env(env: dict, caches: Path) -> dict:
    """Every cache a run fills (datasets' Arrow files; ours: token counts and the speed-ups') in `caches`."""
    return {
        **env,
        "HF_DATASETS_CACHE": str(caches / "datasets"),
        "VLM_RECIPES_CACHE": str(caches),
        "VLM_RECIPES_SPEEDUP_CACHE": str(caches),
    }


def run_baseline(stage: str, scenario: str, setup: dict, caches: Path) -> dict:
    epochs, seed, _, _ = SCENARIOS[scenario]
    with tempfile.NamedTemporaryFile(suffix=".json") as result:
        command = [
            sys.executable,
            str(REPO / "benchmarks" / "baseline_trl.py"),
            f"--stage={stage}",
            f"--model={setup['model']}",
            f"--data={setup['data']}",
            f"--rows={setup['rows']}",
            f"--epochs={epochs}",
            f"--seed={seed}",
            f"--batch-size={setup['batch_size']}",
            f"--out={result.name}",
            *(["--bf16"] if setup["precision"] == "bf16" else []),
        ]
        wall, rss = run_process(command, cache_env(setup["env"], caches))
        measured = json.loads(Path(result.name).read_text())
    return {
        **measured,
        "wall_s": wall,
        "peak_rss_gb": rss,
        "vision_fraction_computed": 1.0,
        "flops_skipped": 0.0,
    }


def run_one(stage: str, scenario: str, way: str, setup: dict, caches: Path) -> dict:
    if way == BASELINE:
        result = run_baseline(stage, scenario, setup, caches)
    else:
        extra = SPEEDUPS[stage] if way == SPEEDUPS_ON else SAME_AS_BASELINE[stage]
        result = run_ours(stage, scenario, extra, setup, caches)
    epochs = SCENARIOS[scenario][0]
    return with_throughput(result, setup["rows"] * epochs, setup["flops"][stage], setup["peak_tflops"])


def with_throughput(run: dict, samples: int, flops_by_role: dict, peak_tflops: float | None) -> dict:
    """Samples/s in the training loop, and model TFLOP/s counting the FLOPs actually run: the tower's and
    projector's scaled by the share of images they computed (the rest came from the feature cache), less
    what the last layer skipped at unlabelled positions (training.loss_positions_only)."""
    vision = flops_by_role["vision"] + flops_by_role["projector"]
    flops_run = samples * (flops_by_role["llm"] + vision * run["vision_fraction_computed"])
    flops_run -= run["flops_skipped"]
    tflops = flops_run / run["train_runtime_s"] / 1e12
    return {
        **run,
        "samples": samples,
        "samples_per_s": samples / run["train_runtime_s"],
        "model_tflops_per_s": tflops,
        "mfu": tflops / peak_tflops if peak_tflops else None,
    }


# --------------------------------------------------------------------------- summarizing


def summarize(runs: list[dict]) -> dict:
    """Medians over the repeats of every measured value (None where no run has it)."""
    summary = {}
    for key in MEASURED:
        values = [run[key] for run in runs if run.get(key) is not None]
        summary[key] = statistics.median(values) if values else None
    return summary


def ratio(ours: float | None, baseline: float | None) -> float | None:
    return ours / baseline if ours is not None and baseline else None


def loss_curve_gap(curve: dict, baseline_curve: dict) -> float | None:
    """The largest relative difference from the baseline's loss at the steps both logged."""
    curve, baseline_curve = ({int(k): v for k, v in c.items()} for c in (curve, baseline_curve))
    gaps = [abs(curve[s] - baseline_curve[s]) / abs(baseline_curve[s]) for s in curve.keys() & baseline_curve]
    return max(gaps) if gaps else None


def compare(runs: dict[str, list[dict]]) -> dict:
    """One scenario of one stage: each way's summary, and each of ours against TRL's."""
    summaries = {way: summarize(way_runs) for way, way_runs in runs.items()}
    base = summaries[BASELINE]
    versus = {}
    for way in summaries:
        if way == BASELINE:
            continue
        ours = summaries[way]
        versus[way] = {
            "samples_per_s": ratio(ours["samples_per_s"], base["samples_per_s"]),
            "wall_s": ratio(ours["wall_s"], base["wall_s"]),
            "peak_rss_gb": ratio(ours["peak_rss_gb"], base["peak_rss_gb"]),
            "peak_gpu_allocated_gb": ratio(ours["peak_gpu_allocated_gb"], base["peak_gpu_allocated_gb"]),
            "eval_loss_change": ratio(ours["eval_loss"], base["eval_loss"]) - 1
            if ours["eval_loss"] is not None and base["eval_loss"]
            else None,
            "loss_curve_gap": loss_curve_gap(runs[way][0]["loss_curve"], runs[BASELINE][0]["loss_curve"]),
        }
    if OURS in summaries and SPEEDUPS_ON in summaries:  # the speed-ups alone, the runner's own cost apart
        versus[SPEEDUPS_ON]["samples_per_s_vs_speedups_off"] = ratio(
            summaries[SPEEDUPS_ON]["samples_per_s"], summaries[OURS]["samples_per_s"]
        )
    return {"summary": summaries, "versus_trl": versus, "runs": runs}


# --------------------------------------------------------------------------- the tables


def fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}g}" if abs(value) < 1000 else f"{value:.0f}"


def render_tables(report: dict) -> str:
    """The README's block: what was run where, the headline table, the details table."""
    about = report["about"]
    machine, model = about["machine"], about["model"]
    libraries = ", ".join(f"{name} {v}" for name, v in about["libraries"].items())
    lines = [
        f"Measured on {machine['description']}, {machine['processor']}, {machine['threads']} threads; "
        f"{model['name']} ({model['parameters'] / 1e6:.1f}M parameters, random weights), "
        f"{about['rows']} bench rows per epoch, batch {about['batch_size']}, {about['precision']}, "
        f"median of {about['repeats']} run(s) per way; git {about['git_sha']}; {libraries}.",
        f"Regenerate: `{about['command']}`, then `python scripts/benchmark.py --readme FILE`.",
        "",
        "| stage | scenario | way | samples/s | ×TRL | ×off | wall time s | ×TRL | peak RSS GB | ×TRL "
        "| eval loss | vs TRL |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    details = [
        "",
        "| stage | scenario | way | time to first step s | step time median s | step time p90 s "
        "| model TFLOP/s run |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for stage, scenarios in report["stages"].items():
        for scenario, compared in scenarios.items():
            for way, summary in compared["summary"].items():
                versus = compared["versus_trl"].get(way, {})
                change = versus.get("eval_loss_change")
                head = f"| {STAGE_TITLES[stage]} | {SCENARIOS[scenario][3]} | {way} "
                lines.append(
                    head + f"| {fmt(summary['samples_per_s'])} | {fmt(versus.get('samples_per_s'))} "
                    f"| {fmt(versus.get('samples_per_s_vs_speedups_off'))} "
                    f"| {fmt(summary['wall_s'])} | {fmt(versus.get('wall_s'))} "
                    f"| {fmt(summary['peak_rss_gb'])} | {fmt(versus.get('peak_rss_gb'))} "
                    f"| {fmt(summary['eval_loss'], 5)} | {'-' if change is None else f'{change:+.2%}'} |"
                )
                details.append(
                    head + f"| {fmt(summary['time_to_first_step_s'])} | {fmt(summary['step_time_median_s'])} "
                    f"| {fmt(summary['step_time_p90_s'])} | {fmt(summary['model_tflops_per_s'])} |"
                )
    return "\n".join(lines + details)


def update_readme(report: dict, readme: Path = REPO / "README.md") -> None:
    text = readme.read_text()
    first, last = readme_markers(report)
    if first not in text or last not in text:
        print(f"{readme}: the lines {first} and {last} mark where the tables go; add them", file=sys.stderr)
        sys.exit(2)
    begin, end = text.index(first) + len(first), text.index(last)
    readme.write_text(text[:begin] + "\n" + render_tables(report) + "\n" + text[end:])


# --------------------------------------------------------------------------- what was run where


def git_sha() -> str:
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True)
    return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "") if sha.returncode == 0 else "?"


def processor_name() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    try:
        cpu = Path("/proc/cpuinfo").read_text()
        name = next(
            line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("model name")
        )
    except (OSError, StopIteration):
        name = platform.processor() or platform.machine()
    return f"{name} ({torch.backends.cpu.get_cpu_capability()})"


def model_about(model: Path, stages: list[str], rows: list[tuple[int, int]]) -> tuple[dict, dict, dict]:
    """The model's size, each stage's mean FLOPs per sample by role, and each stage's FLOPs at a position
    that training.loss_positions_only skips when unlabelled (on the meta device: shapes only)."""
    import torch
    from transformers import AutoModelForImageTextToText

    from vlm_recipes.evaluation.flops import flops_per_sample_by_role, last_layer_flops_per_position
    from vlm_recipes.recipes.load import load_recipe
    from vlm_recipes.recipes.schema import ROLES
    from vlm_recipes.stages.build import detect_family

    family, config = detect_family(str(model))
    with torch.device("meta"):
        bare = AutoModelForImageTextToText.from_config(config)
    flops, last_layer = {}, {}
    for stage in stages:
        train = load_recipe(str(REPO / "benchmarks" / "recipes" / RECIPES[stage])).stages[0].train
        modes = {r: getattr(train, r) for r in ROLES}
        flops[stage] = flops_per_sample_by_role(bare, family, modes, rows)
        last_layer[stage] = last_layer_flops_per_position(bare, family, modes)
    parameters = sum(p.numel() for p in bare.parameters())
    return {"name": model.name, "parameters": parameters, "family": family.name}, flops, last_layer


def token_counts(model: Path, data: Path, rows: int) -> list[tuple[int, int]]:
    """Text and image tokens of every sample trained on, padding excluded (both ways see the same)."""
    from transformers import AutoProcessor

    from vlm_recipes.data.lengths import sample_token_counts
    from vlm_recipes.data.rows import load_split, undecoded
    from vlm_recipes.stages.build import detect_family

    family, _ = detect_family(str(model))
    processor = AutoProcessor.from_pretrained(model)
    family.apply_pixel_bounds(processor.image_processor, 3136, 200704)  # the bench recipes' pixel bounds
    ds, _ = load_split(str(data), "train", rows)
    return sample_token_counts(undecoded(ds), processor, family)


def describe_run(args, scenarios: list[str], environment, precision: str, model: dict, setup: dict) -> dict:
    """What the results file says of the run: code, libraries, machine, command, model, data, scenarios."""
    from vlm_recipes.evaluation.flops import FORMULA

    return {
        "git_sha": git_sha(),
        "command": "python scripts/benchmark.py " + " ".join(sys.argv[1:]),
        "machine": {
            "description": environment.describe(),
            "processor": processor_name(),
            "threads": args.threads,
            "platform": platform.platform(),
        },
        "libraries": {name: version(name) for name in LIBRARIES},
        "model": model,
        "rows": setup["rows"],
        "batch_size": args.batch_size,
        "precision": precision,
        "repeats": args.repeats,
        "scenarios": {name: SCENARIOS[name][3] for name in scenarios},
        "speedups": {stage: SPEEDUPS[stage] for stage in setup["flops"]},
        "flops_formula": FORMULA,
        "flops_per_sample_by_role": setup["flops"],
        "last_layer_flops_per_position": setup["last_layer_flops"],
        "peak_tflops": setup["peak_tflops"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stages", default="llm-lora,vision-full")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--rows", type=int, default=128, help="bench rows per epoch (of 256)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1, help="runs per way and scenario (medians)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in every run (fixed)")
    parser.add_argument("--precision", choices=["bf16", "fp32"], help="default: what a stage picks here")
    parser.add_argument("--model", default="demo:bench-qwen2-vl", help="model id or directory")
    parser.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak, for MFU")
    parser.add_argument("--out", type=Path, default=Path("benchmark.json"))
    parser.add_argument("--readme", type=Path, help="rewrite README's tables from this results file; no run")
    args = parser.parse_args()
    if args.readme:
        if not args.readme.is_file():
            parser.error(
                f"--readme {args.readme}: no such results file (scripts/benchmark.py --out writes one)"
            )
        update_readme(json.loads(args.readme.read_text()))
        print(f"README.md: tables from {args.readme}")
        return 0

    from vlm_recipes.data.demo_data import ensure_bench_dataset
    from vlm_recipes.demo import resolve_model_source
    from vlm_recipes.evaluation.flops import peak_tflops
    from vlm_recipes.stages.guards import Environment, decide_precision

    environment = Environment.detect()
    precision = args.precision or decide_precision("auto", environment, quantized=False).choice
    model, data = Path(resolve_model_source(args.model)), ensure_bench_dataset() / "bench.jsonl"
    stages, asked = args.stages.split(","), args.scenarios.split(",")
    if unknown := [name for name in asked + stages if name not in {**SCENARIOS, **RECIPES}]:
        parser.error(
            f"unknown --stages/--scenarios {unknown}; stages: {list(RECIPES)}, scenarios: {list(SCENARIOS)}"
        )
    scenarios = [name for name in SCENARIOS if name in asked]  # second-seed after first-epoch
    if "second-seed" in scenarios and "first-epoch" not in scenarios:
        parser.error("--scenarios: second-seed reads the caches first-epoch's run leaves; name both")
    counts = token_counts(model, data, args.rows)
    model_info, flops, last_layer_flops = model_about(model, stages, counts)
    setup = {
        "model": model,
        "data": data,
        "rows": len(counts),
        "batch_size": args.batch_size,
        "precision": precision,
        "flops": flops,
        "last_layer_flops": last_layer_flops,
        "peak_tflops": args.peak_tflops or peak_tflops(environment.device),
        "env": {
            **os.environ,
            "OMP_NUM_THREADS": str(args.threads),
            "MKL_NUM_THREADS": str(args.threads),
            "TOKENIZERS_PARALLELISM": "false",
        },
    }
    about = describe_run(args, scenarios, environment, precision, model_info, setup)
    print(
        f"{about['machine']['description']}, {about['machine']['processor']}, {args.threads} threads\n"
        f"{model_info['name']}: {model_info['parameters'] / 1e6:.1f}M parameters; {setup['rows']} rows per "
        f"epoch, batch {args.batch_size}, {precision}, {args.repeats} repeat(s); git {about['git_sha']}\n"
    )
    runs = {
        s: {c: {w: [] for w in WAYS_OF.get(c, [BASELINE, SPEEDUPS_ON])} for c in scenarios} for s in stages
    }
    with tempfile.TemporaryDirectory() as tmp:
        for repeat, stage in ((r, s) for r in range(args.repeats) for s in stages):
            for scenario in scenarios:
                ways = list(runs[stage][scenario])
                for way in ways if repeat % 2 == 0 else reversed(ways):
                    # each way its own caches (datasets' too): first-epoch fills them, second-seed reads
                    # them, three-epochs starts empty
                    run_of = "first-epoch" if SCENARIOS[scenario][2] != "empty" else scenario
                    caches = Path(tmp) / f"{stage}-{repeat}-{run_of}-{WAYS.index(way)}"
                    result = run_one(stage, scenario, way, setup, caches)
                    runs[stage][scenario][way].append(result)
                    print(
                        f"  {stage} {scenario} {way}, run {repeat + 1}: {result['wall_s']:.0f} s, "
                        f"{result['samples_per_s']:.2f} samples/s, {result['peak_rss_gb']:.2f} GB, "
                        f"eval loss {result['eval_loss']:.4f}",
                        flush=True,
                    )
    report = {
        "about": about,
        "stages": {s: {c: compare(runs[s][c]) for c in scenarios} for s in stages},
    }
    args.out.write_text(json.dumps(report, indent=2))
    print("\n" + render_tables(report) + f"\n\nwritten {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
