"""Compare, seeds, sweeps, predict and the notebook, on demo runs; and a metric that measures learning."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import REPO, demo_split, write_recipe
from PIL import Image

from vlm_recipes.cli.compare import main as compare_main
from vlm_recipes.cli.train import main
from vlm_recipes.comparison.report_page import write_run_page
from vlm_recipes.comparison.run_summary import load_run
from vlm_recipes.comparison.tables import compare_runs
from vlm_recipes.files import read_json

pytestmark = pytest.mark.e2e
QUICK = [
    "--max-steps",
    "2",
    "training.per_device_batch_size=4",
    "data.max_eval_samples=8",
    "evaluation.eval_steps=1",
]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, private_demo_cache) -> Path:
    out = tmp_path_factory.mktemp("sweep")
    code = main(
        [
            "--recipe",
            "r1-llm-only,r2-vision-only",
            "--seeds",
            "0,1",
            "--output-dir",
            str(out),
            "--run-name",
            "s",
            *QUICK,
        ]
    )
    assert code == 0
    return out


def test_sweep_with_seeds_ends_with_a_comparison(sweep):
    runs = sorted(p.parent.relative_to(sweep).as_posix() for p in sweep.glob("*/*/run.json"))
    assert runs == [
        "r1-llm-only/s-seed0",
        "r1-llm-only/s-seed1",
        "r2-vision-only/s-seed0",
        "r2-vision-only/s-seed1",
    ]
    assert read_json(sweep / "r1-llm-only" / "s-seed1" / "run.json")["seeds"] == [1]
    assert all((sweep / run / "report.html").is_file() for run in runs)  # each run's own page
    assert (sweep / "comparisons" / "s" / "comparison.html").is_file()
    markdown = (sweep / "comparisons" / "s" / "comparison.md").read_text()
    assert "| r1-llm-only | 2 | llm-lora |" in markdown and "| r2-vision-only | 2 | vision-full |" in markdown
    assert " ± " in markdown  # two seeds: mean ± std
    with Image.open(sweep / "comparisons" / "s" / "comparison.png") as png:
        png.verify()
    with Image.open(sweep / "comparisons" / "s" / "comparison.png") as png:
        assert png.size == (1700, 500)


def test_stage_metrics_and_predictions_are_written(sweep):
    stage_dir = sweep / "r1-llm-only" / "s-seed0" / "stage-1-llm-lora"
    metrics = read_json(stage_dir / "metrics.json")
    for key in (
        "loss_curve",
        "eval_loss",
        "train_samples_per_second",
        "train_tokens_per_second",
        "peak_memory",
        "params_by_role",
        "eval_signature",
        "wall_time_s",
    ):
        assert metrics.get(key) is not None, key
    assert set(metrics["eval"]) >= {"all", "task:shapes", "task:nutrition"}
    assert [p["step"] for p in metrics["eval_loss_curve"]] == [
        1,
        2,
        2,
    ]  # every step (eval_steps=1), then final
    predictions = [json.loads(line) for line in (stage_dir / "predictions.jsonl").read_text().splitlines()]
    assert len(predictions) == 8
    base = {"id", "task", "prompt", "reference", "output", "exact_match", "images", "videos"}
    # beside them, the row's score by each benchmark metric that scores it (demo:eval's rows carry answers
    # or options: docs/evaluation.md)
    assert all(base <= set(p) <= base | {"vqa_accuracy", "option_accuracy"} for p in predictions)
    assert any("vqa_accuracy" in p for p in predictions) and any("option_accuracy" in p for p in predictions)
    media = [path for record in predictions for path in record["images"] + record["videos"]]
    assert media and all(Path(path).is_absolute() and Path(path).exists() for path in media)  # the page's
    assert list((stage_dir / "checkpoints").glob("runs/*/events.out.tfevents.*")), (
        "TensorBoard logs by default"
    )


def test_different_eval_sets_and_seeds_are_flagged_not_mixed(sweep, tmp_path):
    assert (
        main(
            [
                "--recipe",
                "r1-llm-only",
                "--output-dir",
                str(tmp_path),
                "--run-name",
                "other",
                "--max-steps",
                "1",
                "data.max_eval_samples=4",
            ]
        )
        == 0
    )
    runs = [
        load_run(sweep / "r1-llm-only" / "s-seed0"),
        load_run(sweep / "r1-llm-only" / "s-seed1"),
        load_run(sweep / "r2-vision-only" / "s-seed0"),
        load_run(tmp_path / "r1-llm-only" / "other"),
    ]
    comparison = compare_runs(runs)
    assert len(comparison.groups) == 2
    assert any("2 different eval sets" in w for w in comparison.warnings)
    assert any("different seeds" in w for w in comparison.warnings)
    big = next(rows for sig, rows in comparison.groups.items() if "8 rows" in sig)
    assert {r.recipe: len(r.runs) for r in big} == {"r1-llm-only": 2, "r2-vision-only": 1}


def test_compare_script_latest(sweep, tmp_path, capsys):
    assert compare_main(["--latest", "--output-dir", str(sweep), "--out", str(tmp_path / "cmp")]) == 0
    printed = capsys.readouterr().out
    assert "r2-vision-only" in printed
    assert (tmp_path / "cmp" / "comparison.png").is_file()
    # each recipe's answers beside the reference, on 3 eval rows (the seed-1 runs: the latest)
    assert "Answers of each recipe's first run on 3 eval row(s)" in printed
    first = (sweep / "r1-llm-only" / "s-seed1" / "stage-1-llm-lora" / "predictions.jsonl").read_text()
    records = {r["id"]: r for r in map(json.loads, first.splitlines())}
    shown = re.findall(r"\n(eval-\d+) \(", printed)
    assert len(set(shown)) == 3 and set(shown) <= set(records), shown
    for record in (records[row_id] for row_id in shown):
        assert f"{record['id']} ({record['task']}): {record['prompt']}" in printed
        assert re.search(rf"\n  reference +{re.escape(record['reference'])}\n", printed)
    assert (
        printed.count("  r1-llm-only / llm-lora  ") == printed.count("  r2-vision-only / vision-full  ") == 3
    )
    markdown = (tmp_path / "cmp" / "comparison.md").read_text()
    assert "### Answers" in markdown and markdown.count("| r2-vision-only / vision-full | ") == 3
    assert compare_main([str(tmp_path / "nope")]) == 2


def test_notebook_runs_top_to_bottom_on_demo_runs(sweep, monkeypatch, capsys):
    notebook = json.loads((REPO / "notebooks" / "compare_recipes.ipynb").read_text())
    monkeypatch.setenv("VLM_RECIPES_RUNS", str(sweep))
    namespace: dict = {}
    for cell in notebook["cells"]:
        if cell["cell_type"] == "code":
            exec(compile("".join(cell["source"]), "compare_recipes.ipynb", "exec"), namespace)  # noqa: S102
    out = capsys.readouterr().out
    assert "4 finished runs" in out and "r2-vision-only" in out
    assert namespace["figure"].get_axes()


def test_predict_script_answers_an_image_and_scores_a_file(sweep, capsys, tmp_path):
    from vlm_recipes.cli.predict import main as predict_main
    from vlm_recipes.demo.dataset import ensure_demo_dataset

    run = sweep / "r2-vision-only" / "s-seed0"
    image = next((ensure_demo_dataset() / "images").glob("*.png"))
    assert (
        predict_main(
            [
                "--model",
                str(run),
                "--image",
                str(image),
                "--prompt",
                "What colour is the shape?",
                "--max-new-tokens",
                "3",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.strip()
    out = tmp_path / "p.jsonl"
    assert (
        predict_main(["--model", str(run), "--data", "demo:eval", "--max-samples", "3", "--output", str(out)])
        == 0
    )
    assert "exact match" in capsys.readouterr().out
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 3 and "motion" in {r["task"] for r in records}  # a video row, answered
    assert predict_main(["--model", str(run), "--image", "missing.png", "--prompt", "x"]) == 2

    clip = next((ensure_demo_dataset() / "videos").glob("*.mp4"))
    ask = ["--model", str(run), "--prompt", "Which way does the dot move?", "--max-new-tokens", "3"]
    capsys.readouterr()
    assert predict_main([*ask, "--video", str(clip)]) == 0 and capsys.readouterr().out.strip()
    assert predict_main([*ask, "--video", str(clip), "--image", str(image)]) == 0  # both at once
    assert predict_main([*ask, "--video", "missing.mp4"]) == 2
    assert "not found: missing.mp4" in capsys.readouterr().err
    broken = tmp_path / "broken.mp4"
    broken.write_text("not a video")
    assert predict_main([*ask, "--video", str(broken)]) == 2
    assert "not a readable video" in capsys.readouterr().err


def test_trained_model_beats_the_untrained_one_on_exact_match(tmp_path):
    """The metric measures something real: a short, aggressive full fine-tune on the demo data
    answers held-out questions that the random model cannot."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from vlm_recipes.demo.models import ensure_demo_model
    from vlm_recipes.evaluation.generation import evaluate_generation

    base = ensure_demo_model()
    untrained, _ = evaluate_generation(
        AutoModelForImageTextToText.from_pretrained(base),
        AutoProcessor.from_pretrained(base),
        demo_split("demo:eval", "test", None)[0],
        16,
        16,
        0.01,
    )
    recipe = write_recipe(
        tmp_path,
        "learn",
        """
description: everything trained at a high learning rate, learns the demo task in seconds
model: demo:tiny-qwen2-vl
stages:
  - name: all-full
    train: {vision: full, projector: full, llm: full}
    training: {learning_rate: 3.0e-3, epochs: 5, per_device_batch_size: 8, warmup_ratio: 0.05}
    evaluation: {max_new_tokens: 48, batch_size: 16}
""",
    )
    assert main(["--recipe", str(recipe), "--output-dir", str(tmp_path / "runs"), "--run-name", "t"]) == 0
    trained = read_json(tmp_path / "runs" / "learn" / "t" / "stage-1-all-full" / "metrics.json")["eval"]
    assert untrained["all"]["exact_match"] == 0.0
    assert trained["all"]["exact_match"] > untrained["all"]["exact_match"] + 0.05
    assert trained["all"]["json_fields"]["parse_rate"] > untrained["all"]["json_fields"]["parse_rate"]


# ------------------------------------------------------------------------------------------------ the page

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="needs Chromium (Debian: apt-get install chromium; .ci/run installs it)"
)
# Run in the real browser after the page's own script: what it shows, read back from the DOM. Each state sets
# the first section's filters (task: the first task offered, or every task), then lists the rows left visible.
PAGE_CHECK = """<script>
window.addEventListener('load', () => {
  const section = document.querySelector('div.answers');  // the first eval set's answers
  const visible = () => [...section.querySelectorAll('tr.answer-row')].filter(r => !r.hidden).map(r => r.dataset.id);
  const task = section.querySelector('.task-filter'), wrong = section.querySelector('.wrong-filter');
  const differ = section.querySelector('.differ-filter');
  const found = {
    images: [...document.querySelectorAll('img')].map(i => [i.complete && i.naturalWidth > 0, i.alt]),
    placeholders: document.querySelectorAll('.missing-media').length,
    answers: [...document.querySelectorAll('td.answer')].map(
      td => [td.closest('tr').dataset.id, td.dataset.who, (td.querySelector('.output') || td).textContent,
             td.classList.contains('right') ? 1 : td.classList.contains('wrong') ? 0 : null]),
    rows: [...section.querySelectorAll('tr.answer-row')].map(
      r => [r.dataset.id, r.dataset.task, r.dataset.wrong, r.dataset.differ]),
    differ_filter: differ !== null,
    shown: {initial: visible()},
  };
  const states = [['all', 0, 0, 0], ['task', 1, 0, 0], ['task+wrong', 1, 1, 0], ['wrong', 0, 1, 0],
                  ['differ', 0, 0, 1], ['wrong+differ', 0, 1, 1]];
  for (const [name, byTask, byWrong, byDiffer] of states) {
    if (byDiffer && differ === null) continue;
    task.value = byTask ? task.options[1].value : ''; task.dispatchEvent(new Event('change'));
    wrong.checked = !!byWrong; wrong.dispatchEvent(new Event('change'));
    if (differ !== null) { differ.checked = !!byDiffer; differ.dispatchEvent(new Event('change')); }
    found.shown[name] = visible();
  }
  found.first_task = task.options[1].value;
  const out = document.createElement('pre'); out.id = 'page-check'; out.textContent = JSON.stringify(found);
  document.body.appendChild(out);
});
</script></body>"""


def open_in_chromium(page: Path, tmp_path: Path) -> dict:
    """The page opened in headless Chromium with PAGE_CHECK added: what the browser shows."""
    checked = tmp_path / f"checked-{page.name}"
    checked.write_text(page.read_text().replace("</body>", PAGE_CHECK))
    flags = ["--headless=new", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=20000", "--dump-dom"]
    dom = subprocess.run(
        [CHROMIUM, *flags, checked.as_uri()], capture_output=True, text=True, timeout=120
    ).stdout
    found = re.search(r'<pre id="page-check">(.*?)</pre>', dom, re.S)
    assert found, dom[-2000:]
    return json.loads(html.unescape(found.group(1)))


def assert_filters_work(found: dict) -> None:
    """Each filter shows exactly its rows, and hides some: the page has rows of two tasks, rows whose answers
    are all right and rows with a wrong one (and, with several columns, rows answered alike and differently).
    With several columns the page opens on the rows whose answers differ."""
    rows, task = found["rows"], found["first_task"]
    ids = [r[0] for r in rows]

    def where(keep) -> list[str]:
        return [r[0] for r in rows if keep(r)]

    assert found["shown"]["all"] == ids
    assert found["shown"]["task"] == where(lambda r: r[1] == task) != ids
    assert found["shown"]["wrong"] == where(lambda r: r[2] == "1") != ids
    assert found["shown"]["task+wrong"] == where(lambda r: r[1] == task and r[2] == "1")
    if found["differ_filter"]:
        assert found["shown"]["initial"] == found["shown"]["differ"] == where(lambda r: r[3] == "1") != ids
        assert found["shown"]["wrong+differ"] == where(lambda r: r[2] == "1" and r[3] == "1")
    else:
        assert found["shown"]["initial"] == ids


@needs_chromium
def test_comparison_page_shows_every_image_and_the_answers_in_predictions(sweep, tmp_path):
    page = sweep / "comparisons" / "s" / "comparison.html"
    assert not re.search(r"""(src|href|url)\s*[=(]\s*["']?(https?:)?//""", page.read_text()), (
        "nothing fetched"
    )
    found = open_in_chromium(page, tmp_path)
    images = [ok for ok, alt in found["images"] if alt == "image"]
    assert images and all(ok for ok, _ in found["images"]), found["images"]  # every image decodes
    assert any(alt == "frame" for _, alt in found["images"]), "a clip's frames are shown"
    stages = {"r1-llm-only / llm-lora": "r1-llm-only", "r2-vision-only / vision-full": "r2-vision-only"}
    for row_id, who, shown, right in found["answers"]:
        stage = next((sweep / stages[who] / "s-seed0").glob("stage-1-*"))
        record = next(r for r in map(json.loads, (stage / "predictions.jsonl").open()) if r["id"] == row_id)
        as_shown = "".join(c if c.isprintable() or c in "\n\t" else "\ufffd" for c in record["output"])
        assert shown == as_shown and right == record["exact_match"], (row_id, who)
    assert len(found["answers"]) == 2 * len(found["rows"]) > 0
    task_rows = [r[0] for r in found["rows"] if r[1] == found["first_task"]]
    assert found["shown"]["task"] == task_rows != found["shown"]["all"]
    assert found["differ_filter"] and found["shown"]["initial"] == [
        r[0] for r in found["rows"] if r[3] == "1"
    ]


@needs_chromium
def test_a_missing_or_damaged_image_is_a_marked_placeholder(sweep, tmp_path):
    """A run whose predictions point at a deleted image and at a file that is not one: the page still shows
    every row, the two as marked placeholders, and every image it does embed decodes. One answer is made
    right, so the "any answer wrong" filter has rows to hide."""
    run = tmp_path / "r1-llm-only" / "copy"
    shutil.copytree(sweep / "r1-llm-only" / "s-seed0", run)
    stage = next(run.glob("stage-1-*"))
    manifest = read_json(run / "run.json")
    manifest["stages"][0]["dir"] = str(stage)
    (run / "run.json").write_text(json.dumps(manifest))
    records = [json.loads(line) for line in (stage / "predictions.jsonl").open()]
    with_images = [r for r in records if r["images"]]
    (tmp_path / "not-an-image.png").write_bytes(b"\x89PNG but not one")
    with_images[0]["images"] = [str(tmp_path / "deleted.png")]
    with_images[1]["images"] = [str(tmp_path / "not-an-image.png")]
    records[2] |= {"output": records[2]["reference"], "exact_match": 1.0}
    (stage / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    found = open_in_chromium(write_run_page(run), tmp_path)
    assert found["placeholders"] == 2 and all(ok for ok, _ in found["images"])
    assert [r[0] for r in found["rows"]] == [r["id"] for r in records]  # one column: every row
    assert_filters_work(found)
    page = (run / "report.html").read_text()
    assert "image no such file:<br>deleted.png" in page and "image cannot be decoded" in page
