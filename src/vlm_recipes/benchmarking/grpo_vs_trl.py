"""The GRPO benchmark: a GRPO stage through vlm-recipes against plain TRL's GRPOTrainer
(`benchmarking/plain_trl_grpo.py`, the script one writes by hand), on the same model, prompts, seed and
settings (`benchmarking/bench_recipes/bench-llm-grpo.yaml`).

    vlm-recipes bench-grpo                                   # 1 repeat -> benchmark-grpo.json
    vlm-recipes bench-grpo --repeats 3 --out benchmarks/results/grpo-cpu-2-cores-bf16-wide.json
    vlm-recipes bench-grpo --model demo:bench-qwen2-vl --max-completion-length 16 --image-side 448  # the small one

The scenario is r6's GRPO stage: visual questions with short checkable answers (a colour, a shape, yes or no, a
count), a group of 8 completions of at most 128 tokens per prompt, one group a step, the images at the demo's
own sizes, on the wide bench model (`demo:bench-qwen2-vl-wide`, Qwen2-VL-2B's widths). TRL repeats each prompt,
image and all, once per completion, so its tower encodes every image 8 times to sample and 8 more for the
log-probabilities; with `training.vision_feature_cache` (frozen tower) vlm-recipes encodes it once and reads it
back. `grpo.sample_with_merged_lora` samples with the adapter merged into a copy of the weights, and
`grpo.inverse_cdf_sampling` draws each token without torch.multinomial (speedups/sampling.py), and
`grpo.cpu_log_probs` computes the log-probability pass's LM head on a CPU in fewer passes (speedups/log_probs.py).

Ways (`--ways` picks): plain TRL (trl), vlm-recipes without its speed-ups (off: the runner's own cost),
vlm-recipes with the feature cache (cache), vlm-recipes with every GRPO speed-up (on). Every run is a fresh process; wall time and peak RSS are the whole process's (`os.wait4`), samples/s is completions
trained / the training loop's runtime. Within a repeat the ways alternate in order; medians over repeats are
compared as ours / TRL. The reward is each way's mean over its steps (the check that both trained alike).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from vlm_recipes.benchmarking.processes import (
    git_sha,
    processor_name,
    run_baseline_script,
    run_recipe,
    threads_env,
)

HERE = Path(__file__).resolve().parent
BASELINE_SCRIPT = HERE / "plain_trl_grpo.py"
RECIPE = HERE / "bench_recipes" / "bench-llm-grpo.yaml"
BASELINE, CACHE_OFF, CACHE_ON = "plain TRL", "vlm-recipes, feature cache off", "vlm-recipes, feature cache on"
SPEEDUPS_ON = "vlm-recipes, speed-ups on"
WAYS = [BASELINE, CACHE_OFF, CACHE_ON, SPEEDUPS_ON]
WAY_NAMES = {"trl": BASELINE, "off": CACHE_OFF, "cache": CACHE_ON, "on": SPEEDUPS_ON}  # --ways
SPEEDUPS = {  # each way's switches
    CACHE_OFF: [],
    CACHE_ON: ["training.vision_feature_cache=true"],
    SPEEDUPS_ON: [
        "training.vision_feature_cache=true",
        "grpo.sample_with_merged_lora=true",
        "grpo.inverse_cdf_sampling=true",
        "grpo.cpu_log_probs=true",
    ],
}
IMAGE_SIDE = 448  # px: 32x32 patches of 14, merged 2x2 into 256 visual tokens (--image-side 448)
MEASURED = ("samples_per_s", "wall_s", "peak_rss_gb", "train_runtime_s", "mean_reward", "step_time_median_s")


def ensure_bench_prompts(side: int = IMAGE_SIDE) -> Path:
    """The demo's one-image prompt rows, each image scaled to side x side (0: as the demo drew it; built once,
    cached)."""
    from vlm_recipes.demo.dataset import VERSION, ensure_prompt_dataset
    from vlm_recipes.files import build_dir_atomically, cache_dir

    def build(out: Path) -> None:
        from PIL import Image

        source = ensure_prompt_dataset()
        (out / "images").mkdir()
        with open(out / "train.jsonl", "w", encoding="utf-8") as f:
            for line in (source / "train.jsonl").read_text(encoding="utf-8").splitlines():
                row = json.loads(line)
                if len(row["images"]) != 1:
                    continue
                image = Image.open(source / row["images"][0]).convert("RGB")
                name = f"images/{row['id']}.png"
                (image.resize((side, side), Image.Resampling.BICUBIC) if side else image).save(out / name)
                f.write(json.dumps({**row, "images": [name]}) + "\n")

    directory = cache_dir() / VERSION / f"bench-prompts-{side or 'demo'}"
    return build_dir_atomically(directory, ("train.jsonl",), build, "GRPO bench prompts")


def run_way(way: str, setup: dict, caches: Path) -> dict:
    """One fresh process of one way; what it measured, with samples/s and the mean reward."""
    if way == BASELINE:
        flags = {"max-completion-length": setup["max_completion_length"], "seed": setup["seed"]}
        wall, rss, measured = run_baseline_script(BASELINE_SCRIPT, flags, setup, caches)
        steps, runtime, curve = measured["steps"], measured["train_runtime_s"], measured["reward_curve"]
        step_time = measured.get("step_time_median_s")
    else:
        settings = [
            f"grpo.max_completion_length={setup['max_completion_length']}",
            f"training.seed={setup['seed']}",
            *SPEEDUPS[way],
        ]
        wall, rss, metrics = run_recipe(RECIPE, "grpo", settings, setup, caches)
        steps, runtime = metrics["steps"], metrics["train_runtime_s"]
        curve = {point["step"]: point["reward"] for point in metrics["reward_curve"]}
        step_time = metrics.get("step_time_median_s")
    return {
        "wall_s": wall,
        "peak_rss_gb": rss,
        "train_runtime_s": runtime,
        "samples_per_s": steps * setup["num_generations"] / runtime,
        "mean_reward": statistics.fmean(curve.values()) if curve else None,
        "reward_curve": curve,
        "step_time_median_s": step_time,
    }


def summarize(runs: dict[str, list[dict]]) -> dict:
    """Medians per way, and each of ours over TRL's."""
    medians = {
        way: {key: statistics.median(r[key] for r in way_runs if r[key] is not None) for key in MEASURED}
        for way, way_runs in runs.items()
    }
    base = medians[BASELINE]
    versus = {
        way: {k: medians[way][k] / base[k] for k in ("samples_per_s", "wall_s", "peak_rss_gb")}
        for way in medians
        if way != BASELINE
    }
    return {"medians": medians, "versus_trl": versus}


def render(report: dict) -> str:
    """The markdown table docs/results/grpo-vs-trl.md shows, its caption in short sentences as the docs' prose."""
    about, medians, versus = report["about"], report["summary"]["medians"], report["summary"]["versus_trl"]
    runs = report.get("runs", {})

    def spread(way: str, key: str, digits: int) -> str:
        """`median (min-max)` over the way's repeats; the median alone from one run."""
        values = [run[key] for run in runs.get(way, []) if run.get(key) is not None]
        shown = f"{medians[way][key]:.{digits}f}"
        low, high = (f"{min(values):.{digits}f}", f"{max(values):.{digits}f}") if values else (shown, shown)
        return shown if low == high else f"{shown} ({low}-{high})"

    images = (
        f"{about['image_side']}x{about['image_side']}" if about["image_side"] else "as the demo drew them"
    )
    lines = [
        f"{about['machine']}, {about['threads']} threads, {about['precision']}. Model: {about['model']}. "
        f"{about['rows']} prompts x {about['num_generations']} completions of at most "
        f"{about['max_completion_length']} tokens, images {images}. Seed {about['seed']}, median of "
        f"{about['repeats']} (min-max beside it); git {about['git_sha']}.",
        f"Regenerate: `{about['command']}`",
        "",
        "| way | samples/s | vs TRL | wall s | peak RSS GB | vs TRL | mean reward |",
        "|---|---|---|---|---|---|---|",
    ]
    for way in (way for way in WAYS if way in medians):
        m, v = medians[way], versus.get(way, {})
        ratio = f"{v['samples_per_s']:.2f}x" if v else "1"
        memory = f"{v['peak_rss_gb']:.2f}x" if v else "1"
        lines.append(
            f"| {way} | {spread(way, 'samples_per_s', 2)} | {ratio} | {spread(way, 'wall_s', 0)} | "
            f"{spread(way, 'peak_rss_gb', 2)} | {memory} | {m['mean_reward']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = "vlm-recipes bench-grpo") -> int:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=16, help="prompts, one group a step")
    parser.add_argument("--max-completion-length", type=int, default=128, help="r6's")
    parser.add_argument("--image-side", type=int, default=0, help="px; 0: the demo's own sizes (r6's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1, help="runs per way (medians)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in every run (fixed)")
    parser.add_argument("--precision", choices=["bf16", "fp32"], help="default: what a stage picks here")
    parser.add_argument("--model", default="demo:bench-qwen2-vl-wide", help="model id or directory")
    parser.add_argument(
        "--ways",
        default=",".join(WAY_NAMES),
        help=f"comma-separated, of {', '.join(WAY_NAMES)} (in that order)",
    )
    parser.add_argument("--out", type=Path, default=Path("benchmark-grpo.json"))
    args = parser.parse_args(argv)

    from vlm_recipes.demo.models import resolve_model_source
    from vlm_recipes.machine import detect_environment
    from vlm_recipes.model.guards import decide_precision
    from vlm_recipes.recipe import load_recipe

    if unknown := set(args.ways.split(",")) - set(WAY_NAMES):
        parser.error(f"--ways: unknown {sorted(unknown)}; ways: {', '.join(WAY_NAMES)}")
    environment = detect_environment()
    precision = args.precision or decide_precision("auto", environment, quantized=False).choice
    grpo = load_recipe(str(RECIPE)).stages[0].settings
    model = Path(resolve_model_source(args.model))
    setup = {
        "model": model,
        "data": ensure_bench_prompts(args.image_side) / "train.jsonl",
        "seed": args.seed,
        "image_side": args.image_side,
        "rows": args.rows,
        "num_generations": grpo.num_generations,
        "max_completion_length": args.max_completion_length,
        "precision": precision,
        "env": threads_env(args.threads),
    }
    about = {
        "git_sha": git_sha(),
        "command": f"{prog} " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": f"{environment.describe()}, {processor_name()}",
        "threads": args.threads,
        "model": model.name,
        **{k: setup[k] for k in ("rows", "num_generations", "max_completion_length", "image_side", "seed")},
        "precision": precision,
        "repeats": args.repeats,
    }
    print(f"{about['machine']}; {model.name}; git {about['git_sha']}", flush=True)
    ways = [WAY_NAMES[name] for name in WAY_NAMES if name in args.ways.split(",")]
    runs: dict[str, list[dict]] = {way: [] for way in ways}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for way in ways if repeat % 2 == 0 else reversed(ways):
                result = run_way(way, setup, Path(tmp) / f"{repeat}-{WAYS.index(way)}")  # empty caches
                runs[way].append(result)
                print(
                    f"  {way}, run {repeat + 1}: {result['wall_s']:.0f} s, {result['samples_per_s']:.2f} "
                    f"samples/s, {result['peak_rss_gb']:.2f} GB, mean reward {result['mean_reward']:.3f}",
                    flush=True,
                )
    report = {"about": about, "summary": summarize(runs), "runs": runs}
    args.out.write_text(json.dumps(report, indent=2))
    print("\n" + render(report) + f"\n\nwritten {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
