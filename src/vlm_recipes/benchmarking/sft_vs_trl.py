"""Benchmark vlm-recipes against a plain TRL script, in the scenarios a user runs.

    vlm-recipes bench --precision bf16 --scenarios first-epoch --repeats 3   # ~50 min on 2 cores
    vlm-recipes bench --model demo:bench-qwen2-vl --repeats 3   # the small model, every scenario
    vlm-recipes bench --readme benchmarks/results/cpu-2-cores-bf16-wide.json   # docs/results/sft-vs-trl.md's tables
    vlm-recipes bench --model demo:qwen2-vl-2b-shaped                # on a GPU: real dimensions

The default model, `demo:bench-qwen2-vl-wide`, has Qwen2-VL-2B's widths with its depth and vocabulary cut
to 1/7, so that the tower, projector, decoder layers and LM head keep their shares of a training step's
FLOPs (printed beside Qwen2-VL-2B's, from its published config on the meta device). MFU is model FLOP/s
over the device's peak: a GPU's published one, or on a CPU the matmul peak measured at the start in the
training dtype on the training threads.

Scenarios, each a row of the table. No run warms up the caches a measured run reads:
- first-epoch: one epoch on empty caches (token counts included), seed 0: every seed recipe's first run.
- second-seed: one epoch with seed 1 over the same data, reading the caches first-epoch's run left: the
  next seed, recipe or run over the same data.
- three-epochs: three epochs, caches empty at the start (they fill during the first).

Ways: plain TRL (`benchmarking/plain_trl_sft.py`, the script one writes by hand), vlm-recipes with its speed-ups
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
import platform
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

from vlm_recipes.benchmarking.processes import (
    git_sha,
    processor_name,
    run_baseline_script,
    run_recipe,
    threads_env,
)
from vlm_recipes.benchmarking.sft_tables import (
    BASELINE,
    OURS,
    SCENARIOS,
    SPEEDUPS_ON,
    TABLES_DOC,
    WAYS,
    WAYS_OF,
    compare,
    flops_skipped,
    fraction_computed,
    render_tables,
    update_readme,
    with_throughput,
)

HERE = Path(__file__).resolve().parent
BASELINE_SCRIPT = HERE / "plain_trl_sft.py"  # the plain TRL script one writes by hand
BENCH_RECIPES = HERE / "bench_recipes"
RECIPES = {"llm-lora": "bench-llm-lora.yaml", "vision-full": "bench-vision-full.yaml"}
SPEEDUPS = {  # each switchable; the feature cache only exists for a frozen tower
    "llm-lora": [
        "training.padding_free=true",
        "training.preprocessed_cache=true",
        "training.vision_feature_cache=true",
        "training.sparse_lora_dropout=true",
        "training.loss_positions_only=true",
        "training.matmul_patch_embedding=true",
        "training.liger_kernels=true",  # on a GPU with liger-kernel installed; off, logged, elsewhere
    ],
    "vision-full": [
        "training.padding_free=true",
        "training.preprocessed_cache=true",
        "training.loss_positions_only=true",
        "training.matmul_patch_embedding=true",
        "training.liger_kernels=true",
    ],
}
# Speed-ups off, ours computes what TRL computes, adapters in the compute dtype as TRL casts them for QLoRA
# (bf16), where that is bf16. Where it is fp32 (a CPU without native bf16) TRL still casts QLoRA adapters to
# bf16, which such a CPU emulates; ours keeps them in fp32 there. The speed-up runs keep the recipe default,
# fp32 adapters (the trainable-dtype guard).
SAME_AS_BASELINE = {"llm-lora": ["training.trainable_dtype=compute"], "vision-full": []}
LIBRARIES = ("torch", "transformers", "trl", "peft", "accelerate", "bitsandbytes", "datasets")


# --------------------------------------------------------------------------- running


WAY_NAMES = {"trl": BASELINE, "off": OURS, "on": SPEEDUPS_ON}  # --ways


def ways_of(scenario: str, asked: list[str]) -> list[str]:
    """The ways a scenario runs, of those asked: TRL and ours with the speed-ups on, and in first-epoch ours
    with them off (the runner's own cost)."""
    return [way for way in WAYS_OF.get(scenario, [BASELINE, SPEEDUPS_ON]) if way in asked]


def like_for_like_adapters(ways: list[str], precision: str) -> str | None:
    """The adapter dtype plain TRL's QLoRA stage must keep to compute what ours with the speed-ups off
    computes, when only those two run (the overhead check), or None where TRL's own cast already does.

    TRL casts QLoRA adapters to bf16 whatever the precision; ours keeps them in the compute dtype (the
    overhead way's `training.trainable_dtype=compute`). In fp32 that is fp32, and on a CPU without native
    bf16 TRL's bf16 adapters are emulated (50x slower matmuls on an AVX2 CPU): the two ways would time other
    arithmetic, not the runner's own cost."""
    return "fp32" if precision == "fp32" and SPEEDUPS_ON not in ways else None


def run_ours(stage: str, scenario: str, extra: list[str], setup: dict, caches: Path) -> dict:
    """One vlm-recipes run, its caches in `caches`."""
    epochs, seed, _, _ = SCENARIOS[scenario]
    settings = [
        f"training.seed={seed}",
        f"training.per_device_batch_size={setup['batch_size']}",
        f"training.eval_batch_size={setup['batch_size']}",
        f"data.eval={setup['data']}",
        *extra,
    ]
    recipe = BENCH_RECIPES / RECIPES[stage]
    wall, rss, metrics = run_recipe(recipe, scenario, settings, setup, caches, ("--epochs", str(epochs)))
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


def run_baseline(stage: str, scenario: str, setup: dict, caches: Path) -> dict:
    epochs, seed, _, _ = SCENARIOS[scenario]
    flags = {"stage": stage, "epochs": epochs, "seed": seed, "batch-size": setup["batch_size"]}
    if stage == "llm-lora" and setup.get("baseline_adapters"):
        flags["adapter-dtype"] = setup["baseline_adapters"]
    wall, rss, measured = run_baseline_script(BASELINE_SCRIPT, flags, setup, caches)
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


# --------------------------------------------------------------------------- what was run where


def describe_run(
    args,
    scenarios: list[str],
    environment,
    precision: str,
    model: dict,
    setup: dict,
    argv: list[str] | None = None,
) -> dict:
    """What the results file says of the run: code, libraries, machine, command, model, data, scenarios."""
    from vlm_recipes.benchmarking.flops import FORMULA

    return {
        "git_sha": git_sha(),
        "command": "vlm-recipes bench " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": {
            "description": environment.describe(),
            "processor": processor_name(),
            "instruction_set": environment.instruction_set or environment.gpu_name,
            "bf16": environment.bf16_reason or ("native" if environment.bf16_supported else "no"),
            "threads": args.threads,
            "platform": platform.platform(),
        },
        "libraries": {name: version(name) for name in LIBRARIES},
        "model": model,
        "rows": setup["rows"],
        "batch_size": args.batch_size,
        "precision": precision,
        "repeats": args.repeats,
        "baseline_adapters": setup.get("baseline_adapters"),
        "scenarios": {name: SCENARIOS[name][3] for name in scenarios},
        "speedups": {stage: SPEEDUPS[stage] for stage in setup["flops"]},
        "flops_formula": FORMULA,
        "flops_per_sample_by_role": setup["flops"],
        "last_layer_flops_per_position": setup["last_layer_flops"],
        "peak_tflops": setup["peak_tflops"],
        "peak_source": setup["peak_source"],
        "flop_shares": setup["flop_shares"],
    }


def main(argv: list[str] | None = None, prog: str = "vlm-recipes bench") -> int:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stages", default="llm-lora,vision-full")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--rows", type=int, default=128, help="bench rows per epoch (of 256)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1, help="runs per way and scenario (medians)")
    parser.add_argument(
        "--ways",
        default="trl,off,on",
        help="plain TRL (trl), ours with the speed-ups off (off: first epoch only, the runner's own cost), "
        "ours with them on (on); `--ways trl,off --scenarios first-epoch`: the overhead check alone",
    )
    parser.add_argument(
        "--without-overhead-check", action="store_true", help="the same as --ways trl,on (a short GPU lease)"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads in every run (fixed)")
    parser.add_argument("--precision", choices=["bf16", "fp32"], help="default: what a stage picks here")
    parser.add_argument("--model", default="demo:bench-qwen2-vl-wide", help="model id or directory")
    parser.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak, for MFU")
    parser.add_argument("--out", type=Path, default=Path("benchmark.json"))
    parser.add_argument(
        "--readme",
        type=Path,
        help="rewrite docs/results/sft-vs-trl.md's tables from this results file; no run",
    )
    args = parser.parse_args(argv)
    if args.readme:
        if not args.readme.is_file():
            parser.error(f"--readme {args.readme}: no such results file (--out writes one)")
        if not TABLES_DOC.is_file():
            parser.error(f"--readme: no {TABLES_DOC} here: run it in the repository's checkout")
        update_readme(json.loads(args.readme.read_text()))
        print(f"{TABLES_DOC}: tables from {args.readme}")
        return 0

    from vlm_recipes.benchmarking.bench_model import device_peak, model_about, render_shares, token_counts
    from vlm_recipes.demo.dataset import ensure_bench_dataset
    from vlm_recipes.demo.models import resolve_model_source
    from vlm_recipes.errors import EXIT_BAD_INPUT, UnsupportedModelError
    from vlm_recipes.machine import detect_environment
    from vlm_recipes.model.guards import decide_precision
    from vlm_recipes.recipe import load_recipe
    from vlm_recipes.roles import ROLES

    stages, asked = args.stages.split(","), args.scenarios.split(",")
    if unknown_ways := set(args.ways.split(",")) - set(WAY_NAMES):
        parser.error(f"--ways: unknown {sorted(unknown_ways)}; ways: {', '.join(WAY_NAMES)}")
    ways = [
        WAY_NAMES[name]
        for name in args.ways.split(",")
        if not (args.without_overhead_check and name == "off")
    ]
    if unknown := [name for name in asked + stages if name not in {**SCENARIOS, **RECIPES}]:
        parser.error(
            f"unknown --stages/--scenarios {unknown}; stages: {list(RECIPES)}, scenarios: {list(SCENARIOS)}"
        )
    scenarios = [name for name in SCENARIOS if name in asked]  # second-seed after first-epoch
    if lonely := [name for name in scenarios if len(ways_of(name, ways)) < 2]:
        parser.error(
            f"--scenarios {','.join(lonely)}: no way to compare with plain TRL among --ways {args.ways}"
        )
    if "second-seed" in scenarios and "first-epoch" not in scenarios:
        parser.error("--scenarios: second-seed reads the caches first-epoch's run leaves; name both")
    environment = detect_environment()
    precision = args.precision or decide_precision("auto", environment, quantized=False).choice
    model, data = Path(resolve_model_source(args.model)), ensure_bench_dataset() / "bench.jsonl"
    counts = token_counts(model, data, args.rows)
    trains = {stage: load_recipe(str(BENCH_RECIPES / RECIPES[stage])).stages[0].train for stage in stages}
    modes = {stage: {role: getattr(train, role) for role in ROLES} for stage, train in trains.items()}
    try:
        model_info, flops, last_layer_flops, shares = model_about(model, modes, counts)
    except UnsupportedModelError as error:  # the generic family: no FLOP formula for its architecture
        print(f"error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    peak, peak_source = device_peak(environment.device, precision, args.threads, args.peak_tflops)
    setup = {
        "model": model,
        "data": data,
        "rows": len(counts),
        "batch_size": args.batch_size,
        "precision": precision,
        "flops": flops,
        "last_layer_flops": last_layer_flops,
        "peak_tflops": peak,
        "peak_source": peak_source,
        "flop_shares": shares,
        "env": threads_env(args.threads),
        "baseline_adapters": like_for_like_adapters(ways, precision),
    }
    about = describe_run(args, scenarios, environment, precision, model_info, setup, argv)
    print(
        f"{about['machine']['description']}, {about['machine']['processor']}, {args.threads} threads\n"
        f"{model_info['name']}: {model_info['parameters'] / 1e6:.1f}M parameters; {setup['rows']} rows per "
        f"epoch, batch {args.batch_size}, {precision}, {args.repeats} repeat(s); git {about['git_sha']}\n"
        f"peak for MFU: {peak or 0:.3g} TFLOP/s ({peak_source})\n\n{render_shares(shares)}\n"
    )
    runs = {s: {c: {w: [] for w in ways_of(c, ways)} for c in scenarios} for s in stages}
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
                    # what has run so far, for a run cut short (a GPU lease's time limit): the full report
                    # replaces it at the end
                    args.out.write_text(json.dumps({"about": about, "partial": True, "runs": runs}, indent=2))
                    gpu = result.get("peak_gpu_allocated_gb")
                    print(
                        f"  {stage} {scenario} {way}, run {repeat + 1}: {result['wall_s']:.0f} s, "
                        f"{result['samples_per_s']:.2f} samples/s, {result['peak_rss_gb']:.2f} GB"
                        + (f" (GPU {gpu:.2f} GB)" if gpu is not None else "")
                        + f", eval loss {result['eval_loss']:.4f}",
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
