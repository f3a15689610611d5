"""A benchmark metric added in one place: a toy metric, registered by this test alone (register_metric), is
taken by data.eval_metrics, chosen by default from what the eval rows carry, scored into predictions.jsonl,
metrics.json and run.json, and shown in the end-of-run table, `compare`'s table, comparison.html and the
figure under its own heading and mark; `compare` marks the best recipe by it, higher being better."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from test_compare import benchmark_run, column_cells
from test_eval_metrics import SHORT, image_files, trl_row, write_jsonl
from transformers import AutoModelForImageTextToText

from vlm_recipes.benchmark_metrics import METRICS, register_metric
from vlm_recipes.benchmark_metrics.metric import BenchmarkMetric, Targets
from vlm_recipes.cli.compare import main as compare
from vlm_recipes.cli.train import main as train
from vlm_recipes.comparison.plot import comparison_figure
from vlm_recipes.comparison.report_page import render_page
from vlm_recipes.comparison.run_summary import load_run
from vlm_recipes.comparison.tables import compare_runs, format_comparison
from vlm_recipes.data.formats import EVAL_COLUMNS
from vlm_recipes.data.rows import load_split
from vlm_recipes.evaluation.generation import generate_answers, prompts_from_rows
from vlm_recipes.families import FAMILIES
from vlm_recipes.files import read_json
from vlm_recipes.model.build import load_processor
from vlm_recipes.recipe import load_recipe
from vlm_recipes.recipes.schema import DataSettings

QUESTIONS = ["What colour is it?", "How many shapes?", "Is it round?", "What is on the left?"]


def starts_with_reference(answer: str, targets: Targets, answer_box) -> float:
    """1 where the answer begins with the reference, case aside."""
    return float(answer.strip().lower().startswith(targets.reference.strip().lower()))


# The toy metric: every field a metric has, none of them a built-in one's
STARTS = BenchmarkMetric(
    name="starts_with_reference",
    heading="starts ref",
    needs="a one-word answer",
    scores_row=lambda targets: len(targets.reference.split()) == 1,
    score=starts_with_reference,
    by_default=True,
    mark="8",
)


@pytest.fixture
def registered():
    metric = register_metric(STARTS)
    yield metric
    del METRICS[metric.name]  # the other tests see the built-in metrics only


def test_a_registered_metric_is_taken_by_data_eval_metrics_and_a_taken_name_is_refused(registered):
    recipe = load_recipe("r1-llm-only", ["data.eval_metrics=[starts_with_reference,anls]"])
    assert recipe.stages[0].data.eval_metrics == ["starts_with_reference", "anls"]
    with pytest.raises(ValueError, match="registered already"):
        register_metric(STARTS)


def test_a_registered_metric_reaches_metrics_json_the_tables_the_page_and_the_figure(
    registered, demo_model_dir, tmp_path, capsys, caplog
):
    caplog.set_level("INFO")
    images = image_files(tmp_path, 4)
    path = tmp_path / "eval.jsonl"
    write_jsonl(path, [trl_row(i, q, "red", images[i]) for i, q in enumerate(QUESTIONS)])
    # the model's greedy answers, as the stage's eval will generate them (a rate of 1e-12 moves none)
    family = next(f for f in FAMILIES if f.name == "qwen2-vl")
    processor = load_processor(str(demo_model_dir), DataSettings(max_pixels=200704), family)
    model = AutoModelForImageTextToText.from_pretrained(demo_model_dir, dtype=torch.float32)
    rows, _ = load_split(str(path), "test", None, extra_columns=EVAL_COLUMNS)
    expected = generate_answers(model, processor, prompts_from_rows(rows), max_new_tokens=4, batch_size=8)
    del model
    assert all(answer.split() for answer in expected), expected
    # rows 0 and 3: the answer's first word (scored 1); row 1: a word it does not start with (0); row 2: two
    # words, not what the metric needs (not scored)
    references = [expected[0].split()[0], "zzzz", "not one", expected[3].split()[0]]
    write_jsonl(path, [trl_row(i, q, references[i], images[i]) for i, q in enumerate(QUESTIONS)])

    runs = tmp_path / "runs"
    args = ["--output-dir", str(runs), "--run-name", "t", "precision=fp32", f"data.train={path}"]
    assert train([*SHORT, *args, f"data.eval={path}"]) == 0
    end_of_run = capsys.readouterr().out

    run_dir = runs / "r1-llm-only" / "t"
    stage = read_json(run_dir / "run.json")["stages"][0]
    stage_dir = Path(stage["dir"])
    records = [json.loads(line) for line in (stage_dir / "predictions.jsonl").read_text().splitlines()]
    assert [r["output"] for r in records] == expected, "the stage's eval generates the answers known before"
    assert [r.get("starts_with_reference") for r in records] == [1.0, 0.0, None, 1.0]
    metrics = read_json(stage_dir / "metrics.json")
    assert metrics["eval_starts_with_reference"] == pytest.approx(2 / 3)
    assert metrics["eval"]["all"]["rows_scored"] == {"starts_with_reference": 3}
    assert stage["eval_starts_with_reference"] == metrics["eval_starts_with_reference"]
    decision = next(
        d for d in read_json(stage_dir / "report.json")["decisions"] if d["guard"] == "eval-metrics"
    )
    assert decision["choice"] == "starts_with_reference, exact_match"
    assert "3 of 4 rows carry a one-word answer: starts_with_reference" in decision["reason"]
    assert "starts_with_reference 0.667 (3 rows)" in caplog.text

    # the end-of-run table: its heading, its value
    header = next(line for line in end_of_run.splitlines() if line.lstrip().startswith("#"))
    assert re.search(r"exact match\s+starts ref\s+time$", header), header
    assert " 0.667 " in next(line for line in end_of_run.splitlines() if line.lstrip().startswith("1 "))

    # compare: its table, comparison.md, comparison.html and comparison.png
    out = tmp_path / "comparison"
    assert compare([str(run_dir), "--out", str(out), "--answers", "0"]) == 0
    table = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(table) if line.startswith("recipe"))
    columns = dict(
        zip(re.split(r"\s{2,}", table[header]), re.split(r"\s{2,}", table[header + 2]), strict=True)
    )
    assert columns["recipe"] == "r1-llm-only" and columns["starts ref"] == "0.667"
    assert "| starts ref |" in (out / "comparison.md").read_text()
    assert "<th>starts ref</th>" in (out / "comparison.html").read_text()
    assert (out / "comparison.png").stat().st_size > 0
    # the figure that PNG is: the task-metric panel draws it with its own mark
    figure = comparison_figure(compare_runs([load_run(run_dir)]))
    legend = figure.axes[2].get_legend()
    marks = {
        t.get_text(): h.get_marker() for t, h in zip(legend.get_texts(), legend.legend_handles, strict=True)
    }
    assert marks["starts ref"] == "8"


def test_compare_marks_the_best_recipe_by_a_registered_metric_higher_being_better(registered, tmp_path):
    runs = [benchmark_run(tmp_path, "better", s, starts_with_reference=0.80 + s / 50) for s in (0, 1)]
    runs += [benchmark_run(tmp_path, "worse", s, starts_with_reference=0.60 + s / 50) for s in (0, 1)]
    comparison = compare_runs(runs)
    text = format_comparison(comparison, answer_rows=0)
    assert column_cells(text, "starts ref") == {"better": "0.810 ± 0.014 (best)", "worse": "0.610 ± 0.014 *"}
    page = render_page(comparison, "t")
    assert '<td class="beyond">0.610 ± 0.014 *</td>' in page and "<th>starts ref</th>" in page
