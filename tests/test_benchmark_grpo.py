"""The GRPO benchmark's code (`vlm-recipes bench-grpo`): its plain-TRL baseline runs, its prompts are what it
says, its arithmetic is right, and the table in docs/results/grpo-vs-trl.md is what the script writes from the
committed results. Speed itself is measured by the benchmark, never by a test."""

from __future__ import annotations

import json

import pytest
from conftest import REPO
from PIL import Image

from vlm_recipes.benchmarking import grpo_vs_trl, plain_trl_grpo

RESULTS = sorted((REPO / "benchmarks" / "results").glob("grpo-cpu-2-cores*.json"))  # fp32, bf16, bf16 wide


@pytest.mark.e2e
def test_baseline_grpo_script_trains_one_group_a_step_and_logs_the_reward(tmp_path, private_demo_cache):
    """The plain-TRL GRPO script stays runnable: a prompt's group of completions a step, the reward logged."""
    from vlm_recipes.demo.models import ensure_demo_model

    out = tmp_path / "baseline.json"
    model, data = ensure_demo_model("demo:tiny-qwen2-vl"), grpo_vs_trl.ensure_bench_prompts() / "train.jsonl"
    args = [f"--model={model}", f"--data={data}", "--rows=2", "--max-completion-length=4", f"--out={out}"]
    plain_trl_grpo.main(args)
    measured = json.loads(out.read_text())
    assert measured["steps"] == 2 and len(measured["reward_curve"]) == 2
    assert all(0.0 <= reward <= 1.0 for reward in measured["reward_curve"].values())
    assert measured["step_time_median_s"] > 0


def test_bench_prompts_are_the_demo_prompts_with_one_image_each_at_448(private_demo_cache):
    from vlm_recipes.demo.dataset import ensure_prompt_dataset

    directory = grpo_vs_trl.ensure_bench_prompts()
    rows = [json.loads(line) for line in (directory / "train.jsonl").read_text().splitlines()]
    demo = [json.loads(line) for line in (ensure_prompt_dataset() / "train.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == [r["id"] for r in demo if len(r["images"]) == 1]
    assert all(len(r["images"]) == 1 for r in rows)
    for row in rows[:5]:
        assert Image.open(directory / row["images"][0]).size == (448, 448)


def run(samples_per_s: float, rss: float, reward: float) -> dict:
    return {
        "samples_per_s": samples_per_s,
        "wall_s": 16 / samples_per_s + 10,
        "peak_rss_gb": rss,
        "train_runtime_s": 16 / samples_per_s,
        "mean_reward": reward,
        "step_time_median_s": 1.0,
    }


def test_summary_is_the_median_and_ratios_are_ours_over_trl():
    runs = {
        grpo_vs_trl.BASELINE: [run(2.0, 1.8, 0.1), run(2.2, 1.9, 0.1), run(0.5, 1.8, 0.1)],
        grpo_vs_trl.CACHE_OFF: [run(2.0, 1.7, 0.1)] * 3,
        grpo_vs_trl.CACHE_ON: [run(3.0, 1.8, 0.1), run(2.8, 1.8, 0.1), run(9.0, 1.8, 0.1)],
    }
    summary = grpo_vs_trl.summarize(runs)
    assert summary["medians"][grpo_vs_trl.BASELINE]["samples_per_s"] == 2.0, "the median (0.5 is an outlier)"
    versus = summary["versus_trl"][grpo_vs_trl.CACHE_ON]
    assert versus["samples_per_s"] == pytest.approx(1.5)
    assert versus["peak_rss_gb"] == pytest.approx(1.8 / 1.8)
    assert summary["versus_trl"][grpo_vs_trl.CACHE_OFF]["peak_rss_gb"] == pytest.approx(1.7 / 1.8)


@pytest.mark.parametrize("results", RESULTS, ids=lambda path: path.stem)
def test_the_docs_tables_are_generated_from_the_committed_results(results):
    report = json.loads(results.read_text())
    assert report["about"]["git_sha"] and "-dirty" not in report["about"]["git_sha"]
    precision = "bf16" if "-bf16" in results.stem else "fp32"
    assert report["about"]["repeats"] >= 3 and report["about"]["precision"] == precision
    assert grpo_vs_trl.render(report) in (REPO / "docs" / "results" / "grpo-vs-trl.md").read_text(), (
        f"docs/results/grpo-vs-trl.md's GRPO table differs from {results.relative_to(REPO)}: paste "
        f"`vlm-recipes bench-grpo`'s table (grpo_vs_trl.render of that file)"
    )


@pytest.mark.parametrize("results", RESULTS, ids=lambda path: path.stem)
def test_the_table_shows_each_ways_range_beside_its_median(results):
    report = json.loads(results.read_text())
    table = grpo_vs_trl.render(report)
    for way, runs in report["runs"].items():
        rate = [run["samples_per_s"] for run in runs]
        row = next(line for line in table.splitlines() if line.startswith(f"| {way} |"))
        if min(rate) != max(rate):
            assert f"({min(rate):.2f}-{max(rate):.2f})" in row, f"{way}: samples/s without its min-max"
