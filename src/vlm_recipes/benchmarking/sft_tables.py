"""The benchmark's arithmetic and its tables: medians per way, ratios against plain TRL, and the markdown
tables in docs/results/sft-vs-trl.md (`vlm-recipes bench --readme FILE` rewrites them from a results file)."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from vlm_recipes.errors import EXIT_BAD_INPUT

STAGE_TITLES = {"llm-lora": "r1 `llm-lora` (QLoRA)", "vision-full": "r2 `vision-full`"}
SCENARIOS = {  # name: (epochs, seed, caches: "empty" or "left by first-epoch", title)
    "first-epoch": (1, 0, "empty", "first epoch, empty caches"),
    "second-seed": (1, 1, "first-epoch's", "another seed, caches from the first run"),
    "three-epochs": (3, 0, "empty", "three epochs, caches empty at the start"),
}
BASELINE, OURS, SPEEDUPS_ON = "plain TRL", "vlm-recipes, speed-ups off", "vlm-recipes, speed-ups on"
WAYS = [BASELINE, OURS, SPEEDUPS_ON]
WAYS_OF = {"first-epoch": WAYS}  # the overhead check runs once
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
TABLES_DOC = (
    Path("docs") / "results" / "sft-vs-trl.md"
)  # in the checkout the command runs in (`--readme` keeps its old name)


def readme_markers(report: dict) -> tuple[str, str]:
    """Where a results file's tables go in TABLES_DOC: one block per precision (fp32's unnamed),
    bench model (the first bench model's unnamed) and, for the overhead check alone (no way with the
    speed-ups on), "speed-ups off"."""
    precision, model = report["about"]["precision"], report["about"]["model"]["name"]
    named = ([precision] if precision != "fp32" else []) + ([model] if model != "bench-qwen2-vl" else [])
    ways = {way for stage in report["stages"].values() for c in stage.values() for way in c["summary"]}
    if SPEEDUPS_ON not in ways:
        named.append("speed-ups off")
    if not named:
        return README_BEGIN, README_END
    label = ", ".join(named)
    return f"<!-- benchmark table ({label}): begin -->", f"<!-- benchmark table ({label}): end -->"


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


SPREAD = ("samples_per_s", "wall_s", "peak_rss_gb")  # shown as median (min-max)


def summarize(runs: list[dict]) -> dict:
    """Medians over the repeats of every measured value (None where no run has it), and the least and most
    of the headline values (`SPREAD`: `KEY_min`, `KEY_max`)."""
    summary = {}
    for key in MEASURED:
        values = [run[key] for run in runs if run.get(key) is not None]
        summary[key] = statistics.median(values) if values else None
        if key in SPREAD:
            summary[f"{key}_min"], summary[f"{key}_max"] = (
                (min(values), max(values)) if values else (None,) * 2
            )
    return summary


def spread(summary: dict, key: str) -> str:
    """`median (min-max)`, or the median alone from one run (or a results file from before the spread)."""
    low, high = summary.get(f"{key}_min"), summary.get(f"{key}_max")
    if low is None or low == high:
        return fmt(summary[key])
    return f"{fmt(summary[key])} ({fmt(low)}-{fmt(high)})"


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


def fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}g}" if abs(value) < 1000 else f"{value:.0f}"


def render_tables(report: dict) -> str:
    """TABLES_DOC's block: what was run where (short sentences, as the docs' prose), the headline table, the
    details table."""
    about = report["about"]
    machine, model = about["machine"], about["model"]
    libraries = ", ".join(f"{name} {v}" for name, v in about["libraries"].items())
    lines = [
        f"Measured on {machine['description']}, {machine['processor']}, {machine['threads']} threads. "
        f"Model: {model['name']} ({model['parameters'] / 1e6:.1f}M parameters, random weights). "
        f"{about['rows']} bench rows per epoch, batch {about['batch_size']}, {about['precision']}. "
        f"Median of {about['repeats']} run(s) per way, min-max beside it; git {about['git_sha']}. "
        f"Libraries: {libraries}.",
        f"Regenerate: `{about['command']}`, then `python scripts/benchmark.py --readme FILE`.",
        *(
            [
                f"Plain TRL's QLoRA adapters recast to {about['baseline_adapters']} once SFTTrainer is built, "
                "as vlm-recipes keeps them (TRL casts them to bf16): both ways compute the same."
            ]
            if about.get("baseline_adapters")
            else []
        ),
        "",
        "| stage | scenario | way | samples/s | ×TRL | ×off | wall time s | ×TRL | peak RSS GB | ×TRL "
        "| eval loss | vs TRL |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    details = [
        "",
        "| stage | scenario | way | time to first step s | step time median s | step time p90 s "
        "| model TFLOP/s run | MFU |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for stage, scenarios in report["stages"].items():
        for scenario, compared in scenarios.items():
            for way, summary in compared["summary"].items():
                versus = compared["versus_trl"].get(way, {})
                change = versus.get("eval_loss_change")
                head = f"| {STAGE_TITLES[stage]} | {SCENARIOS[scenario][3]} | {way} "
                lines.append(
                    head + f"| {spread(summary, 'samples_per_s')} | {fmt(versus.get('samples_per_s'))} "
                    f"| {fmt(versus.get('samples_per_s_vs_speedups_off'))} "
                    f"| {spread(summary, 'wall_s')} | {fmt(versus.get('wall_s'))} "
                    f"| {spread(summary, 'peak_rss_gb')} | {fmt(versus.get('peak_rss_gb'))} "
                    f"| {fmt(summary['eval_loss'], 5)} | {'-' if change is None else f'{change:+.2%}'} |"
                )
                details.append(
                    head + f"| {fmt(summary['time_to_first_step_s'])} | {fmt(summary['step_time_median_s'])} "
                    f"| {fmt(summary['step_time_p90_s'])} | {fmt(summary['model_tflops_per_s'])} "
                    f"| {'-' if summary['mfu'] is None else format(summary['mfu'], '.1%')} |"
                )
    return "\n".join(lines + details + peak_and_shares(about))


def peak_and_shares(about: dict) -> list[str]:
    """What MFU is a fraction of, and each stage's FLOP shares, the bench model's beside the real one's
    (results files from before either have neither)."""
    from vlm_recipes.benchmarking.flops import STEP_PARTS

    lines = []
    if about.get("peak_tflops"):
        peak, source = about["peak_tflops"], about.get("peak_source", "given")
        lines += ["", f"MFU: model TFLOP/s run over a peak of {peak:.3g} TFLOP/s ({source})."]
    if shares := about.get("flop_shares"):
        lines += [
            "",
            f"| stage | model | {' | '.join(STEP_PARTS)} |",
            "|---|---|" + "---:|" * len(STEP_PARTS),
        ]
        for stage, by_model in shares.items():
            for name, of_part in by_model.items():
                row = " | ".join(f"{of_part[part]:.1%}" for part in STEP_PARTS)
                lines.append(f"| {STAGE_TITLES[stage]} | {name} | {row} |")
    return lines


def update_readme(report: dict, readme: Path = TABLES_DOC) -> None:
    text = readme.read_text()
    first, last = readme_markers(report)
    if first not in text or last not in text:
        print(f"{readme}: the lines {first} and {last} mark where the tables go; add them", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    begin, end = text.index(first) + len(first), text.index(last)
    readme.write_text(text[:begin] + "\n" + render_tables(report) + "\n" + text[end:])
