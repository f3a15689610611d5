"""The comparison reads differences where they are, from run summaries built by hand (no training): the figure's
axes span the values, not 0 to the largest; the table marks a difference from the best recipe larger than the
seed spread and leaves one within it unmarked; answers are put side by side from each stage's predictions."""

from __future__ import annotations

import html
import json
import re
import statistics
from pathlib import Path

import matplotlib
import pytest

from vlm_recipes.comparison.answers import format_answers_markdown, format_answers_text, side_by_side
from vlm_recipes.comparison.plot import comparison_figure
from vlm_recipes.comparison.report_page import render_page, task_table, write_run_page
from vlm_recipes.comparison.run_summary import RunSummary, load_run
from vlm_recipes.comparison.run_table import format_summary
from vlm_recipes.comparison.tables import (
    compare_runs,
    format_comparison,
    format_markdown,
    spread_marks,
)
from vlm_recipes.methods import recorded_method
from vlm_recipes.recipes.schema import Stage
from vlm_recipes.runs.manifest import stage_summary

matplotlib.use("Agg")


LOSS_KINDS = {
    "dpo": "preference",
    "kto": "preference",
    "grpo": "policy",
    "rloo": "policy",
}  # TrainingMethod.loss_kind


# The methods' measures as their modules declare them (TrainingMethod.measures), as metrics.json records them
ABOUT = {
    "eval_reward_accuracy": {"heading": "reward acc", "higher_is_better": True},
    "eval_reward": {"heading": "reward", "higher_is_better": True},
}


def run(
    recipe: str, seed: int, eval_loss: float, method: str = "sft", measures=None, **metrics
) -> RunSummary:
    """A run's summary; `measures`: its last stage's method's measures, e.g. {"eval_reward_accuracy": 0.5}."""
    values = {"exact_match": 0.0, "json_f1": 0.0} | metrics
    measures = measures or {}
    values |= {"measures": measures, "measure_about": {key: ABOUT[key] for key in measures}}
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
        loss_kind=LOSS_KINDS.get(method, "likelihood"),
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
    rows = side_by_side([("", write_run(tmp_path / "other", {"dpo": last, "sft": first}))], 3)
    assert [r.id for r in rows] == ["b", "c", "a"]  # `a` last: one answer, nothing to differ from
    assert rows[2].answers == [("dpo", None), ("sft", "blue")]  # stage 1's `a` has another reference
    text = format_answers_text(rows)
    assert "(not evaluated on this row)" in text and "a (shapes): What colour?" in text


def test_the_rows_shown_first_are_those_training_changed(tmp_path):
    """Rows some stage got right and another wrong, then rows answered differently, then the rest; one row
    of each task before a second of any, in eval order within each."""

    def scored(row_id: str, task: str, output: str, reference: str) -> dict:
        return record(row_id, output, reference) | {"task": task, "exact_match": float(output == reference)}

    before = [
        scored("p1", "pair", "yes", "no"),  # same answer after: nothing changed
        scored("s1", "shapes", "yes", "red"),  # wrong, then a different wrong: changed
        scored("s2", "shapes", "yes", "red"),  # wrong, then right
        scored("s3", "shapes", "yes", "blue"),  # wrong, then right
        scored("p2", "pair", "yes", "no"),  # wrong, then right
    ]
    after = [
        scored("p1", "pair", "yes", "no"),
        scored("s1", "shapes", "blue", "red"),
        scored("s2", "shapes", "red", "red"),
        scored("s3", "shapes", "blue", "blue"),
        scored("p2", "pair", "no", "no"),
    ]
    run_dir = write_run(tmp_path, {"tower": before, "llm": after})
    assert [r.id for r in side_by_side([("", run_dir)], 5)] == ["s2", "p2", "s3", "s1", "p1"]
    assert [r.id for r in side_by_side([("", run_dir)], 2)] == ["s2", "p2"]
    lone = write_run(tmp_path / "lone", {"llm": after[1:]})  # one answer a row: one of each task first
    assert [r.id for r in side_by_side([("", lone)], 2)] == ["s1", "p2"]


def test_an_eval_loss_panel_with_only_preference_losses_says_so():
    runs = [
        run("dpo", s, 0.69, method="dpo", measures={"eval_reward_accuracy": 0.4 + s / 10}) for s in (0, 1)
    ]
    losses = comparison_figure(compare_runs(runs)).axes[1]
    assert "no SFT eval loss to show" in " ".join(t.get_text() for t in losses.texts)


def stage_metrics(steps: int, losses: list[float], **extra) -> dict:
    """A stage's metrics.json: its loss curve (one point per step), eval loss and exact match."""
    return {
        "loss_curve": [{"step": i, "loss": loss} for i, loss in enumerate(losses, 1)],
        "steps": steps,
        "final_train_loss": losses[-1],
        "eval_loss": losses[-1] + 0.1,
        "eval": {"all": {"exact_match": 0.25}},
        "wall_time_s": 2.0,
    } | extra


GRPO_METRICS = {
    "eval_reward": 1.375,  # exact match and format rewards summed: may exceed 1
    "eval_reward_std": 0.5,
    "eval_reward:exact_match": 0.5,
    "reward_curve": [
        {"step": 1, "reward": 0.5, "reward_std": 0.4, "completion_length": 12.0, "reward:exact_match": 0.0},
        {"step": 2, "reward": 1.25, "reward_std": 0.3, "completion_length": 9.0, "reward:exact_match": 0.5},
    ],
}


def write_finished_run(root: Path, stages: list[tuple[str, str, dict]], seed: int = 0) -> Path:
    """A finished run: run.json listing (name, method) stages as the runner does, each with its metrics.json."""
    summaries = []
    for index, (name, method, metrics) in enumerate(stages, 1):
        stage_dir = root / f"stage-{index}-{name}"
        stage_dir.mkdir(parents=True)
        (stage_dir / "metrics.json").write_text(json.dumps(metrics))
        stage = Stage(name=name, method=method)
        method_record = recorded_method(metrics, method)  # an older run's, without `method` in metrics.json
        summaries.append(stage_summary(index, stage, stage_dir, "previous", metrics, method_record))
    manifest = {"recipe": root.parent.name, "seeds": [seed], "status": "finished", "stages": summaries}
    manifest["final_model"] = summaries[-1]["final_model"]
    (root / "run.json").write_text(json.dumps(manifest))
    return root


def sft_then_grpo(root: Path) -> Path:
    sft = stage_metrics(3, [2.0, 1.5, 1.2])
    grpo = stage_metrics(2, [0.01, -0.02], **GRPO_METRICS)  # a policy loss: near 0
    return write_finished_run(root, [("llm-lora", "sft", sft), ("llm-grpo", "grpo", grpo)])


def test_a_run_ending_in_grpo_has_its_reward_and_reward_curve_not_its_loss_beside_sft_losses(tmp_path):
    summary = load_run(sft_then_grpo(tmp_path / "r6" / "t"))
    assert summary.last_method == "grpo" and summary.value("eval_reward") == 1.375
    assert summary.loss_curve == [(1, 2.0), (2, 1.5), (3, 1.2)]  # the SFT stage's only
    assert summary.reward_curve == [(4, 0.5), (5, 1.25)]  # steps counted after the SFT stage's 3
    assert summary.preference_curve == [] and summary.stage_boundaries == [3]

    figure = comparison_figure(compare_runs([summary]))
    twin = figure.axes[3]  # the reward curve's own axis, beside the SFT losses
    assert [list(line.get_xdata()) for line in twin.lines] == [[4, 5]]
    assert "GRPO mean reward" in twin.get_ylabel()
    assert "reward (GRPO)" in [t.get_text() for t in figure.axes[2].get_legend().get_texts()]
    low, high = figure.axes[2].get_ylim()
    assert high > 1.375, (low, high)  # a reward above 1 is not cut off at a score's 1.05


def reward_cells(table: str) -> dict[str, str]:
    """recipe → its reward cell, from the text table."""
    lines = table.splitlines()
    header = next(line for line in lines if line.startswith("recipe"))
    column = re.split(r"\s{2,}", header).index("reward")
    rows = [line for line in lines if line.startswith(("better", "worse", "sft"))]
    return {r.split()[0]: re.split(r"\s{2,}", r)[column] for r in rows}


def test_the_table_shows_the_grpo_reward_and_marks_the_best_recipe_by_it():
    runs = [run("better", s, 0.01, method="grpo", measures={"eval_reward": 1.30 + s / 100}) for s in (0, 1)]
    runs += [run("worse", s, -0.02, method="grpo", measures={"eval_reward": 0.80 + s / 100}) for s in (0, 1)]
    runs += [run("sft", 0, 6.85)]
    comparison = compare_runs(runs)
    text = format_comparison(comparison, answer_rows=0)
    assert reward_cells(text) == {"better": "1.305 ± 0.007 (best)", "worse": "0.805 ± 0.007 *", "sft": "-"}
    # a policy loss is near 0 by construction: a lower one is not a better recipe
    assert "(best)" not in eval_loss_cells(text)["worse"]
    assert "| 0.805 ± 0.007 \\* |" in format_markdown(comparison, None, answer_rows=0)


def test_grpo_recipes_are_ranked_by_reward_only_against_recipes_with_the_same_rewards(tmp_path):
    """A reward summing other functions (or weights) is another scale: its recipe is not marked against the
    best of a different sum, and the note under the table says what each reward sums."""
    runs = [
        run("better", s, 0.01, method="grpo", measures={"eval_reward": 1.30 + s / 100}, rewards="exact_match")
        for s in (0, 1)
    ]
    runs += [
        run(
            "worse",
            s,
            -0.02,
            method="grpo",
            measures={"eval_reward": 0.80 + s / 100},
            rewards="exact_match + 0.1 length[64]",
        )
        for s in (0, 1)
    ]
    text = format_comparison(compare_runs(runs), answer_rows=0)
    assert reward_cells(text) == {"better": "1.305 ± 0.007", "worse": "0.805 ± 0.007"}  # each alone: no mark
    assert (
        "reward = better: exact_match; worse: exact_match + 0.1 length[64] "
        "(different rewards: compared only within the same)" in text
    )
    # read from the recipe run.json records: the names, their settings and weights
    root = sft_then_grpo(tmp_path / "r6" / "t")
    manifest = json.loads((root / "run.json").read_text())
    rewards = [
        {"name": "exact_match", "weight": 1.0, "pattern": None, "target_length": None},
        {"name": "format", "weight": 0.5, "pattern": "<answer>.*</answer>", "target_length": None},
        {"name": "length", "weight": 0.1, "pattern": None, "target_length": 64},
    ]
    manifest["resolved_recipe"] = {
        "stages": [{"name": "llm-lora"}, {"name": "llm-grpo", "grpo": {"rewards": rewards}}]
    }
    (root / "run.json").write_text(json.dumps(manifest))
    assert load_run(root).rewards == "exact_match + 0.5 format[<answer>.*</answer>] + 0.1 length[64]"


def test_the_end_of_run_table_shows_the_reward_and_no_loss_for_a_grpo_stage(tmp_path):
    run_dir = sft_then_grpo(tmp_path / "r6" / "t")
    assert read_stages(run_dir)[1]["measures"]["eval_reward"]["value"] == 1.375
    lines = format_summary(run_dir).splitlines()
    header = next(line for line in lines if line.lstrip().startswith("#"))
    assert header.split()[-2:] == ["reward", "time"]
    sft, grpo = (line.split() for line in lines if line.lstrip().startswith(("1 ", "2 ")))
    assert sft[3:7] == ["1.2000", "1.3000", "0.250", "-"]  # train loss, eval loss, exact match, no reward
    assert grpo[3:7] == ["-", "-", "0.250", "1.375"]  # a policy loss is not a likelihood: not shown


def read_stages(run_dir: Path) -> list[dict]:
    return json.loads((run_dir / "run.json").read_text())["stages"]


# ---------------------------------------------------------------------------------------------
# The benchmarks' metrics (eval_<metric> in metrics.json, each row's score in predictions.jsonl)


def benchmark_run(root: Path, recipe: str, seed: int, **scores) -> RunSummary:
    """A finished one-stage run whose metrics.json holds `eval_<metric>` for each of `scores`."""
    metrics = stage_metrics(3, [2.0, 1.5, 1.2], **{f"eval_{m}": v for m, v in scores.items()})
    return load_run(write_finished_run(root / recipe / f"s-seed{seed}", [("llm-lora", "sft", metrics)], seed))


def column_cells(table: str, column: str) -> dict[str, str]:
    """recipe → its cell in `column`, from the text table (columns apart by two spaces or more)."""
    lines = table.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("recipe"))
    header = re.split(r"\s{2,}", lines[start])
    body = [re.split(r"\s{2,}", line) for line in lines[start + 2 :] if line.startswith(("better", "worse"))]
    return {cells[0]: cells[header.index(column)] for cells in body}


def test_a_benchmark_metric_beyond_the_seed_spread_is_marked_in_the_table_markdown_and_page(tmp_path):
    runs = [benchmark_run(tmp_path, "better", s, option_accuracy=0.80 + s / 50) for s in (0, 1)]
    runs += [benchmark_run(tmp_path, "worse", s, option_accuracy=0.60 + s / 50) for s in (0, 1)]
    comparison = compare_runs(runs)
    text = format_comparison(comparison, answer_rows=0)
    assert column_cells(text, "option acc") == {"better": "0.810 ± 0.014 (best)", "worse": "0.610 ± 0.014 *"}
    header = re.split(r"\s{2,}", next(line for line in text.splitlines() if line.startswith("recipe")))
    assert header[header.index("JSON F1") + 1] == "option acc"
    # the other benchmarks' metrics: no run has them, no column
    assert not {"VQA acc", "ANLS", "relaxed acc", "box Acc@0.5"} & set(header)
    markdown = format_markdown(comparison, None, answer_rows=0)
    assert "| JSON F1 | option acc |" in markdown and "| 0.610 ± 0.014 \\* |" in markdown
    head = next(line for line in markdown.splitlines() if line.startswith("| recipe"))
    assert "VQA acc" not in head and "ANLS" not in head and "box" not in head
    page = render_page(comparison, "t")
    assert '<td class="beyond">0.610 ± 0.014 *</td>' in page and "<th>option acc</th>" in page


def test_a_benchmark_metric_within_the_seed_spread_is_not_marked(tmp_path):
    runs = [benchmark_run(tmp_path, "better", s, option_accuracy=0.80 + s / 25) for s in (0, 1)]
    runs += [benchmark_run(tmp_path, "worse", s, option_accuracy=0.79 + s / 25) for s in (0, 1)]
    comparison = compare_runs(runs)
    text = format_comparison(comparison, answer_rows=0)
    # 0.010 apart, each spread 0.028: within it
    assert column_cells(text, "option acc") == {"better": "0.820 ± 0.028 (best)", "worse": "0.810 ± 0.028"}
    assert "| 0.810 ± 0.028 |" in format_markdown(comparison, None, answer_rows=0)


def test_the_table_shows_eval_vqa_accuracy_as_read_from_metrics_json(tmp_path):
    per_task = {"task:vqa": {"exact_match": 0.25, "vqa_accuracy": 0.5, "rows_scored": {"vqa_accuracy": 4}}}
    first = benchmark_run(tmp_path, "better", 0, vqa_accuracy=0.475)
    runs = [first, benchmark_run(tmp_path, "better", 1, vqa_accuracy=0.625)]
    metrics = stage_metrics(3, [2.0, 1.5, 1.2], eval={"all": {"exact_match": 0.25}, **per_task})
    runs.append(load_run(write_finished_run(tmp_path / "worse" / "t", [("llm-lora", "sft", metrics)])))
    assert first.benchmark_scores == {"vqa_accuracy": 0.475} and runs[2].benchmark_scores == {}
    assert runs[2].task_scores == {"vqa": {"exact_match": 0.25, "vqa_accuracy": 0.5}}
    # by hand: mean (0.475 + 0.625) / 2 = 0.55; sample std √(2 · 0.075² / 1) = 0.075 · √2 = 0.1061
    text = format_comparison(compare_runs(runs), answer_rows=0)
    assert column_cells(text, "VQA acc") == {"better": "0.550 ± 0.106", "worse": "-"}
    legend = comparison_figure(compare_runs(runs)).axes[2].get_legend().get_texts()
    assert "VQA acc" in [t.get_text() for t in legend]  # the task-metrics panel draws it too
    assert "VQA acc" in task_table(compare_runs(runs[2:]).groups["no eval set"])


def scored_record(row_id: str, output: str, reference: str, **scores) -> dict:
    return record(row_id, output, reference) | {"exact_match": float(output == reference)} | scores


def test_the_report_page_shows_each_rows_scores_beside_its_answer(tmp_path):
    """Two stages, three rows: each answer cell holds that row's answer and, beside it, that row's scores
    from that stage's record (exact match, then each benchmark metric the record carries)."""
    metrics = stage_metrics(3, [2.0, 1.5, 1.2], eval_vqa_accuracy=0.5)
    run_dir = write_finished_run(tmp_path / "r1" / "t", [("tower", "sft", metrics), ("llm", "sft", metrics)])
    stages = {
        "tower": [
            scored_record("q1", "blue", "red", vqa_accuracy=2 / 3, option_accuracy=1.0),
            scored_record("q2", "<b>two</b>", "two", vqa_accuracy=0.0),
            scored_record("q3", "A", "A", option_accuracy=1.0),
        ],
        "llm": [
            scored_record("q1", "red", "red", vqa_accuracy=1.0, option_accuracy=1.0),
            scored_record("q2", "two", "two", vqa_accuracy=0.3),
            scored_record("q3", "B", "A", option_accuracy=0.0),
        ],
    }
    for index, (name, records) in enumerate(stages.items(), 1):
        lines = "".join(json.dumps(r) + "\n" for r in records)
        (run_dir / f"stage-{index}-{name}" / "predictions.jsonl").write_text(lines)
    expected = {
        ("q1", "tower"): ("blue", "exact match 0 · VQA acc 0.67 · option acc 1"),
        ("q1", "llm"): ("red", "exact match 1 · VQA acc 1 · option acc 1"),
        ("q2", "tower"): ("<b>two</b>", "exact match 0 · VQA acc 0"),
        ("q2", "llm"): ("two", "exact match 1 · VQA acc 0.3"),
        ("q3", "tower"): ("A", "exact match 1 · option acc 1"),
        ("q3", "llm"): ("B", "exact match 0 · option acc 0"),
    }
    page = write_run_page(run_dir).read_text()
    assert '<span class="output">&lt;b&gt;two&lt;/b&gt;</span>' in page  # an answer is text, not markup
    shown = {}
    for row_id, cells in re.findall(r'<tr class="answer-row" data-id="([^"]*)"[^>]*>(.*?)</tr>', page, re.S):
        for who, cell in re.findall(r'<td class="answer [^"]*" data-who="([^"]*)">(.*?)</td>', cells, re.S):
            beside = re.fullmatch(
                r'<span class="sign">[^<]*</span><span class="output">(.*?)</span>'
                r'<span class="scores">(.*?)</span>',
                cell,
            )
            assert beside, cell
            shown[row_id, who.removeprefix("r1 / ")] = (html.unescape(beside[1]), html.unescape(beside[2]))
    assert shown == expected
    text = format_answers_text(side_by_side([("", run_dir)], 3))
    assert f"  {'llm'.ljust(len('reference'))}  red  [exact match 1 · VQA acc 1 · option acc 1]" in text
    markdown = format_answers_markdown(side_by_side([("", run_dir)], 3))
    assert "| tower | blue | exact match 0 · VQA acc 0.67 · option acc 1 |" in markdown


# A stage trained on a mixture of sources (report.json's data.mixture)

MIXTURE = [
    {
        "source": "demo:train",
        "format": "TRL conversational",
        "weight": 0.7,
        "source_rows": 48,
        "rows": 118,
        "tokens": 4130,
    },
    {
        "source": "extra.jsonl",
        "format": "sharegpt",
        "samples": 50,
        "source_rows": 20,
        "rows": 50,
        "tokens": 1750,
    },
]


def mixture_run(root: Path) -> Path:
    """A finished two-stage run whose second stage's report.json records its draw from two sources (the first
    stage's, from a single source, records none)."""
    metrics = stage_metrics(3, [2.0, 1.5, 1.2])
    run_dir = write_finished_run(root, [("tower", "sft", metrics), ("llm-lora", "sft", metrics)])
    (run_dir / "stage-1-tower" / "report.json").write_text(json.dumps({"data": {"mixture": None}}))
    report = {"data": {"mixture": MIXTURE, "eval_mixture": None}}
    (run_dir / "stage-2-llm-lora" / "report.json").write_text(json.dumps(report))
    return run_dir


def test_a_stage_trained_on_a_mixture_shows_each_sources_draw_in_compare_and_on_the_report_page(tmp_path):
    mixed = mixture_run(tmp_path / "runs" / "r3-mix" / "t")
    plain = write_finished_run(tmp_path / "runs" / "r1" / "t", [("llm", "sft", stage_metrics(2, [2.0, 1.0]))])
    assert load_run(mixed).mixtures == {"llm-lora": MIXTURE} and load_run(plain).mixtures == {}

    line = "mixture (r3-mix, llm-lora): demo:train 0.7 → 118 rows, extra.jsonl samples 50 → 50 rows"
    comparison = compare_runs([load_run(mixed), load_run(plain)])
    text = format_comparison(comparison, answer_rows=0)
    assert line in text.splitlines() and text.count("mixture (") == 1  # the plain run has none
    assert f"- {line}" in format_markdown(comparison, None, answer_rows=0).splitlines()

    page = write_run_page(mixed).read_text()
    assert "<h3>Training mixtures</h3>" in page and "<caption>r3-mix / llm-lora</caption>" in page
    rows = re.findall(r'<tr class="mixture-row">(.*?)</tr>', page)
    assert [re.findall(r"<td>(.*?)</td>", row) for row in rows] == [
        ["demo:train", "TRL conversational", "weight 0.7", "118", "4,130"],
        ["extra.jsonl", "sharegpt", "samples 50", "50", "1,750"],
    ]
    several = render_page(comparison, "Recipe comparison")  # comparison.html: the mixture run's table only
    assert several.count('<tr class="mixture-row">') == 2

    for page in (write_run_page(plain).read_text(), render_page(compare_runs([load_run(plain)]), "t")):
        assert "mixture" not in page
