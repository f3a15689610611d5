"""The comparison reads differences where they are, from run summaries built by hand (no training): the figure's
axes span the values, not 0 to the largest; the table marks a difference from the best recipe larger than the
seed spread and leaves one within it unmarked; answers are put side by side from each stage's predictions."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import matplotlib
import pytest

from vlm_recipes.evaluation.compare import (
    compare_runs,
    comparison_figure,
    format_comparison,
    format_markdown,
    spread_marks,
)
from vlm_recipes.evaluation.predictions import format_answers_markdown, format_answers_text, side_by_side
from vlm_recipes.evaluation.run_summary import RunSummary

matplotlib.use("Agg")


def run(recipe: str, seed: int, eval_loss: float, method: str = "sft", **metrics) -> RunSummary:
    values = {"exact_match": 0.0, "json_f1": 0.0, "reward_accuracy": None, "reward_margin": None} | metrics
    return RunSummary(
        run_dir=Path(f"runs/{recipe}/s-seed{seed}"),
        recipe=recipe,
        seed=str(seed),
        stages=["llm-lora"],
        trainable_params=1000,
        train_loss=eval_loss + 0.01,
        eval_loss=eval_loss,
        time_s=1.0,
        samples_per_s=None,
        peak_memory_gb=None,
        eval_signature="demo:eval|48 rows|x",
        last_method=method,
        loss_curve=[(1, 7.0), (2, eval_loss)],
        **values,
    )


def two_seeds(recipe: str, mean: float, std: float, **metrics) -> list[RunSummary]:
    """Two runs whose eval losses have this mean and sample std (two values: mean ± std/√2·√2)."""
    half = std / 2**0.5
    runs = [run(recipe, 0, mean - half, **metrics), run(recipe, 1, mean + half, **metrics)]
    assert statistics.stdev(r.eval_loss for r in runs) == pytest.approx(std)
    return runs


def eval_loss_cells(table: str) -> dict[str, str]:
    """recipe → its eval-loss cell, from the text table (columns apart by two spaces or more)."""
    lines = table.splitlines()
    header = next(line for line in lines if line.startswith("recipe"))
    column = re.split(r"\s{2,}", header).index("eval loss")
    rows = [line for line in lines if line.startswith(("better", "worse"))]
    return {r.split()[0]: re.split(r"\s{2,}", r)[column] for r in rows}


def test_a_loss_difference_of_0_02_beyond_a_spread_of_0_005_is_marked_and_visible():
    comparison = compare_runs(two_seeds("better", 6.85, 0.005) + two_seeds("worse", 6.87, 0.005))
    cells = eval_loss_cells(format_comparison(comparison, answer_rows=0))
    assert cells == {"better": "6.8500 ± 0.0050 (best)", "worse": "6.8700 ± 0.0050 *"}
    assert "| 6.8700 ± 0.0050 \\* |" in format_markdown(comparison, None, answer_rows=0)

    losses = comparison_figure(comparison).axes[1]
    low, high = losses.get_ylim()
    assert 6.8 < low < 6.845 and 6.875 < high < 6.92, (low, high)  # spans the values, not from 0
    assert [t.get_text() for t in losses.get_xticklabels()] == ["better", "worse *"]


def test_a_difference_within_the_seed_spread_is_not_marked():
    comparison = compare_runs(two_seeds("better", 6.85, 0.005) + two_seeds("worse", 6.858, 0.005))
    cells = eval_loss_cells(format_comparison(comparison, answer_rows=0))
    assert cells == {"better": "6.8500 ± 0.0050 (best)", "worse": "6.8580 ± 0.0050"}
    losses = comparison_figure(comparison).axes[1]
    assert [t.get_text() for t in losses.get_xticklabels()] == ["better", "worse"]


def test_one_seed_has_no_spread_to_compare_against():
    comparison = compare_runs([run("better", 0, 6.80), run("worse", 0, 6.90)])
    text = format_comparison(comparison, answer_rows=0)
    assert eval_loss_cells(text) == {"better": "6.8000 (best)", "worse": "6.9000"}
    assert "no seed spread to compare the differences against" in text


def test_equal_metrics_mark_nobody_and_losses_of_dpo_and_sft_are_not_compared():
    rows = compare_runs(
        two_seeds("better", 6.85, 0.005) + [run("dpo", s, 0.69, method="dpo") for s in (0, 1)]
    ).groups["demo:eval|48 rows|x"]
    assert spread_marks(rows, "exact_match") == {"better": "", "dpo": ""}  # all 0.000
    assert spread_marks(rows, "eval_loss") == {"better": "", "dpo": ""}  # 0.69 is a preference loss


def test_a_task_panel_with_nothing_to_show_says_so():
    comparison = compare_runs(two_seeds("better", 6.85, 0.005) + two_seeds("worse", 6.87, 0.005))
    tasks = comparison_figure(comparison).axes[2]
    said = " ".join(t.get_text() for t in tasks.texts)
    assert said == "no task metric to show:\nexact match, JSON field F1: 0.000 in every run"


def test_task_metrics_above_zero_get_an_axis_that_spans_them():
    runs = two_seeds("better", 6.85, 0.005, exact_match=0.20) + two_seeds(
        "worse", 6.87, 0.005, exact_match=0.18
    )
    tasks = comparison_figure(compare_runs(runs)).axes[2]
    low, high = tasks.get_ylim()
    assert 0.1 < low < 0.18 and 0.2 < high < 0.3, (low, high)
    assert tasks.get_xlabel() == "not shown: JSON field F1: 0.000 in every run"


def write_run(root: Path, stages: dict[str, list[dict]]) -> Path:
    """A run directory holding run.json and each stage's predictions.jsonl."""
    listed = []
    for index, (name, records) in enumerate(stages.items(), 1):
        stage_dir = root / f"stage-{index}-{name}"
        stage_dir.mkdir(parents=True)
        (stage_dir / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        listed.append({"index": index, "name": name, "dir": str(stage_dir)})
    (root / "run.json").write_text(json.dumps({"stages": listed}))
    return root


def record(row_id: str, output: str, reference: str = "red") -> dict:
    return {
        "id": row_id,
        "task": "shapes",
        "prompt": "What colour?",
        "reference": reference,
        "output": output,
    }


def test_answers_side_by_side_match_rows_by_id_prompt_and_reference(tmp_path):
    first = [record("a", "blue"), record("b", "  two\nlines "), record("c", "*x*|y")]
    # the last stage (a preference split) answered b and c, and a row `a` whose reference differs
    last = [record("b", "yes"), record("c", ""), record("a", "red", reference="green")]
    rows = side_by_side([("", write_run(tmp_path, {"sft": first, "dpo": last}))], 2)
    assert [(r.id, r.reference, r.answers) for r in rows] == [
        ("b", "red", [("sft", "  two\nlines "), ("dpo", "yes")]),
        ("c", "red", [("sft", "*x*|y"), ("dpo", "")]),
    ]
    text, markdown = format_answers_text(rows), format_answers_markdown(rows)
    assert "  sft        two lines\n" in text and text.endswith("  dpo        (empty)")
    assert "| sft | \\*x\\*&#124;y |" in markdown  # a model's output is text, not markup
    rows = side_by_side([("", write_run(tmp_path / "other", {"dpo": last, "sft": first}))], 1)
    assert rows[0].answers == [("dpo", None), ("sft", "blue")]  # stage 1's `a` has another reference
    text = format_answers_text(rows)
    assert "(not evaluated on this row)" in text and "a (shapes): What colour?" in text


def test_an_eval_loss_panel_with_only_preference_losses_says_so():
    runs = [run("dpo", s, 0.69, method="dpo", reward_accuracy=0.4 + s / 10) for s in (0, 1)]
    losses = comparison_figure(compare_runs(runs)).axes[1]
    assert "no SFT eval loss to show" in " ".join(t.get_text() for t in losses.texts)
