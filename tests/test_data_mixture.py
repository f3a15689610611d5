"""Mixtures: `data.train` as a list of sources in their own formats, each with its weight or its samples,
drawn with the stage's seed; what report.json records; a stage killed mid-epoch on a mixture resumes to the
same weights; a bad mixture is a recipe error naming the entry.

Every source is written here: a TRL JSONL file, a LLaMA-Factory sharegpt file with its dataset_info.json,
and a LLaVA (ShareGPT conversations) file, with small PIL images."""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

import pytest
from conftest import OPENAI_TAGS, write_recipe
from PIL import Image
from test_resume import killed_and_resumed_r2

from vlm_recipes.cli.data_check import main as data_main
from vlm_recipes.cli.train import main
from vlm_recipes.data.mixture import MIXTURE_SOURCE_COLUMN, draw_mixture, row_counts
from vlm_recipes.data.stage_data import load_stage_data
from vlm_recipes.files import read_json
from vlm_recipes.recipe import load_recipe
from vlm_recipes.recipes.data_sources import DataSource
from vlm_recipes.recipes.schema import DataSettings
from vlm_recipes.scoring import score_predictions

COLOURS = ("red", "green", "blue", "yellow", "purple")
SIZES = {"trl": 5, "lf": 3, "llava": 7}  # rows per source: each smaller than its share, so each repeats


@pytest.fixture()
def sources(tmp_path) -> dict[str, str]:
    """The three sources (name -> what data.train names), each row asking `<name>-<i>: colour?`."""
    for colour in COLOURS:
        Image.new("RGB", (56, 56), colour).save(tmp_path / f"{colour}.png")

    def image(i: int) -> str:
        return f"{COLOURS[i % len(COLOURS)]}.png"

    trl = [
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image"}, {"type": "text", "text": f"trl-{i}: colour?"}],
                },
                {"role": "assistant", "content": [{"type": "text", "text": COLOURS[i % 5]}]},
            ],
            "images": [image(i)],
        }
        for i in range(SIZES["trl"])
    ]
    (tmp_path / "trl.jsonl").write_text("".join(json.dumps(row) + "\n" for row in trl))
    factory = [
        {
            "messages": [
                {"role": "user", "content": f"<image>lf-{i}: colour?"},
                {"role": "assistant", "content": COLOURS[i % 5]},
            ],
            "images": [image(i)],
        }
        for i in range(SIZES["lf"])
    ]
    (tmp_path / "factory.json").write_text(json.dumps(factory))
    info = {
        "mine": {
            "file_name": "factory.json",
            "formatting": "sharegpt",
            "columns": {"messages": "messages", "images": "images"},
            "tags": OPENAI_TAGS,
        }
    }
    (tmp_path / "dataset_info.json").write_text(json.dumps(info))
    llava = [
        {
            "id": f"llava-{i}",
            "conversations": [
                {"from": "human", "value": f"<image>\nllava-{i}: colour?"},
                {"from": "gpt", "value": COLOURS[i % 5]},
            ],
            "image": image(i),
        }
        for i in range(SIZES["llava"])
    ]
    (tmp_path / "llava.json").write_text(json.dumps(llava))
    return {
        "trl": str(tmp_path / "trl.jsonl"),
        "lf": f"{tmp_path / 'dataset_info.json'}#mine",
        "llava": str(tmp_path / "llava.json"),
    }


def mixture(sources: dict[str, str], shares: dict[str, dict]) -> list[DataSource]:
    return [DataSource(sources[name], **share) for name, share in shares.items()]


WEIGHTS = {"trl": {"weight": 0.5}, "lf": {"weight": 0.3}, "llava": {"weight": 0.2}}


def by_text(rows, source: str):
    """A stand-in for the stage's length check: each row's length is its question's characters."""
    return rows, [len(m[0]["content"][-1]["text"]) for m in rows["messages"]], {}


def drawn(sources, shares, seed: int, total: int | None = None, split: str = "train"):
    """The rows drawn from a mixture (and the mixture, with its report), as a stage draws them."""
    settings = DataSettings(train=mixture(sources, shares), eval=None, max_train_samples=total)
    if split == "eval":  # the train split one source, the eval split the list
        settings.train, settings.eval, settings.max_eval_samples = sources["trl"], settings.train, total
    data = load_stage_data(settings)
    rows, lengths, _ = draw_mixture(data.mixtures[split], by_text, seed)
    return rows, lengths, data.mixtures[split]


def questions(rows) -> list[str]:
    return [m[0]["content"][-1]["text"].split(":")[0].strip() for m in rows["messages"]]


def test_ten_thousand_draws_give_each_source_its_weight_in_one_seeded_order(sources):
    rows, lengths, mix = drawn(sources, WEIGHTS, seed=0, total=10_000)
    assert len(rows) == len(lengths) == 10_000
    order = questions(rows)
    per_source = Counter(question.split("-")[0] for question in order)
    assert per_source == {"trl": 5000, "lf": 3000, "llava": 2000}  # the rounded counts, exactly
    for name, share in WEIGHTS.items():
        assert abs(per_source[name] / 10_000 - share["weight"]) <= 0.02
    # a small source repeats: every row of it as often as the others, give or take one
    for name, size in SIZES.items():
        times = Counter(q for q in order if q.startswith(f"{name}-"))
        assert len(times) == size and max(times.values()) - min(times.values()) <= 1, times
    # the sources are shuffled together, not laid end to end
    assert len(set(order[:100])) > 10 and {q.split("-")[0] for q in order[:100]} == set(SIZES)
    assert [r["rows"] for r in mix.report] == [5000, 3000, 2000]
    assert [r["source_rows"] for r in mix.report] == [5, 3, 7]
    assert [r["format"] for r in mix.report] == [
        "TRL conversational",
        "sharegpt (dataset_info.json#mine)",
        "sharegpt conversations (LLaMA-Factory, LLaVA)",
    ]
    assert [r["weight"] for r in mix.report] == [0.5, 0.3, 0.2]
    assert sum(r["tokens"] for r in mix.report) == sum(lengths)
    assert mix.report[0]["tokens"] == sum(
        n for q, n in zip(order, lengths, strict=True) if q.startswith("trl")
    )

    again, _, _ = drawn(sources, WEIGHTS, seed=0, total=10_000)
    assert questions(again) == order  # the same seed: the same rows in the same order
    other, _, other_mix = drawn(sources, WEIGHTS, seed=1, total=10_000)
    assert questions(other) != order  # another seed: another order, the same counts
    assert [r["rows"] for r in other_mix.report] == [5000, 3000, 2000]


def test_samples_give_exactly_that_many_rows_and_an_unset_total_is_every_sources_rows(sources):
    rows, _, mix = drawn(sources, {"trl": {"samples": 12}, "lf": {"samples": 2}, "llava": {"samples": 7}}, 3)
    assert Counter(q.split("-")[0] for q in questions(rows)) == {"trl": 12, "lf": 2, "llava": 7}
    assert [r["samples"] for r in mix.report] == [12, 2, 7] and "weight" not in mix.report[0]
    # the same rows of a source whose share is all its rows: each once
    assert sorted(q for q in questions(rows) if q.startswith("llava")) == [f"llava-{i}" for i in range(7)]
    # no max_train_samples: the epoch is as many rows as the sources hold (15), shared by weight
    rows, _, mix = drawn(sources, WEIGHTS, seed=0)
    assert len(rows) == 15 and [r["rows"] for r in mix.report] == [8, 4, 3]  # 7.5, 4.5, 3.0 rounded to 15
    # max_train_samples below the samples' sum shrinks every source in proportion
    counts = row_counts([5, 3], [DataSource("a", samples=30), DataSource("b", samples=10)], 8)
    assert counts == [6, 2]


def test_an_eval_list_keeps_every_row_of_each_source_in_order_with_its_source(sources):
    rows, _, mix = drawn({k: sources[k] for k in ("trl", "llava")}, {"trl": {}, "llava": {}}, 0, split="eval")
    assert questions(rows) == [f"trl-{i}" for i in range(5)] + [f"llava-{i}" for i in range(7)]
    assert rows[MIXTURE_SOURCE_COLUMN] == [sources["trl"]] * 5 + [sources["llava"]] * 7
    assert [r.get("all_rows") for r in mix.report] == [True, True]
    # max_eval_samples: the first N rows of each source
    rows, _, _ = drawn({k: sources[k] for k in ("trl", "llava")}, {"trl": {}, "llava": {}}, 0, 2, "eval")
    assert questions(rows) == ["trl-0", "trl-1", "llava-0", "llava-1"]


def test_sources_whose_columns_hold_other_kinds_of_values_draw_as_one_table(tmp_path, sources):
    """A TRL file whose content parts carry a key the others lack (Arrow will not concatenate those tables
    as they are): its rows and the others' are read again as one table."""
    row = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image"}, {"type": "text", "text": "odd-0: colour?", "lang": "en"}],
            },
            {"role": "assistant", "content": [{"type": "text", "text": "red", "lang": "en"}]},
        ],
        "images": ["red.png"],
    }
    (tmp_path / "odd.jsonl").write_text(json.dumps(row) + "\n")
    rows, _, _ = drawn(
        {**sources, "odd": str(tmp_path / "odd.jsonl")}, {"trl": {"samples": 2}, "odd": {"samples": 2}}, 0
    )
    asked = questions(rows)
    assert asked.count("odd-0") == 2 and len([q for q in asked if q.startswith("trl-")]) == 2
    assert all(image.size == (56, 56) for images in rows["images"] for image in images)


def test_a_recipe_reads_a_mixture_and_bare_paths_in_an_eval_list(tmp_path, sources):
    body = f"""model: demo:tiny-qwen2-vl
data:
  train:
    - {{path: {sources["trl"]}, weight: 0.5}}
    - {{path: "{sources["lf"]}", weight: 0.3}}
    - {{path: {sources["llava"]}, weight: 0.2}}
  eval: [{sources["trl"]}, {sources["llava"]}]
stages:
  - name: s
    train: {{llm: lora}}
"""
    recipe = load_recipe(str(write_recipe(tmp_path, "mix", body)))
    data = recipe.stages[0].data
    assert data.train == mixture(sources, WEIGHTS)
    assert data.eval == [DataSource(sources["trl"]), DataSource(sources["llava"])]
    # a single string is one source, as before; an override replaces the mixture with it
    assert (
        load_recipe(str(tmp_path / "mix.yaml"), [f"data.train={sources['trl']}"]).stages[0].data.train
        == (sources["trl"])
    )


MIXTURE_STAGE = [
    "training.per_device_batch_size=2",
    "training.logging_steps=1",
    "precision=fp32",
    "evaluation.max_new_tokens=2",
]


def test_a_stage_trains_on_a_mixture_and_its_report_records_the_draw(tmp_path, sources, capsys, caplog):
    shares = ", ".join(
        f'{{path: "{sources[name]}", weight: {share["weight"]}}}' for name, share in WEIGHTS.items()
    )
    body = f"""model: demo:tiny-qwen2-vl
data:
  train: [{shares}]
  eval: ["{sources["trl"]}", "{sources["llava"]}"]
  max_train_samples: 20
  max_eval_samples: 2
stages:
  - name: mix
    train: {{llm: lora}}
"""
    recipe = str(write_recipe(tmp_path, "mix", body))
    out = tmp_path / "runs"
    assert main(["--recipe", recipe, "--dry-run", "--output-dir", str(out)]) == 0
    assert f"{sources['trl']} (weight 0.5) + {sources['lf']} (weight 0.3)" in capsys.readouterr().out

    caplog.set_level(logging.INFO)
    args = [
        "--recipe",
        recipe,
        "--max-steps",
        "2",
        "--output-dir",
        str(out),
        "--run-name",
        "run",
        *MIXTURE_STAGE,
    ]
    assert main(args) == 0
    stage_dir = out / "mix" / "run" / "stage-1-mix"
    report = read_json(stage_dir / "report.json")["data"]
    assert report["train_rows"] == 20 and report["eval_rows"] == 4
    assert [(r["source"], r["weight"], r["rows"]) for r in report["mixture"]] == [
        (sources["trl"], 0.5, 10),
        (sources["lf"], 0.3, 6),
        (sources["llava"], 0.2, 4),
    ]
    assert all(r["tokens"] > 0 for r in report["mixture"])
    assert [(r["source"], r["rows"]) for r in report["eval_mixture"]] == [
        (sources["trl"], 2),
        (sources["llava"], 2),
    ]
    assert (
        "data: train mixture, 20 rows an epoch (seed 42):" in caplog.text
        and "sharegpt (dataset_info.json#mine)" in caplog.text
    )
    answered = [json.loads(line) for line in (stage_dir / "predictions.jsonl").read_text().splitlines()]
    assert len(answered) == 4


def test_a_stage_on_a_mixture_killed_mid_epoch_resumes_to_the_same_weights(tmp_path, sources, caplog):
    shares = ", ".join(f'{{path: "{sources[n]}", weight: {s["weight"]}}}' for n, s in WEIGHTS.items())
    # 40 rows an epoch at 4 a step: 10 steps; 6 trained, killed after step 5, resumed from checkpoint 4
    extra = (
        f"data.train=[{shares}]",
        "data.max_train_samples=40",
        "data.eval=null",
        "precision=fp32",
        "training.per_device_batch_size=4",
        "training.save_steps=2",
        "training.learning_rate=1e-3",  # moves the weights far past fp32's rounding in 6 steps
        "--max-steps",
        "6",
    )
    run_dir = killed_and_resumed_r2(tmp_path, extra, "stage1:step5", "checkpoint-4", caplog)
    report = read_json(run_dir / "stage-1-vision-full" / "report.json")["data"]["mixture"]
    assert [r["rows"] for r in report] == [20, 12, 8]


def bad_mixture(tmp_path: Path, sources: dict[str, str], entries: str, extra: str = "") -> list[str]:
    body = f"model: demo:tiny-qwen2-vl\ndata:\n  train: {entries}\n{extra}stages:\n  - name: s\n    train: {{llm: lora}}\n"
    return ["--recipe", str(write_recipe(tmp_path, "bad", body))]


BAD_MIXTURES = {
    "unknown key": (
        '[{{path: "{trl}", weight: 1}}, {{path: "{llava}", wieght: 1}}]',
        "stages[0].data.train[1].wieght: unknown key; did you mean `weight`?",
    ),
    "negative weight": (
        '[{{path: "{trl}", weight: 1}}, {{path: "{llava}", weight: -0.3}}]',
        "stages[0].data.train[1].weight: must be above 0 (a share of the epoch's rows), got -0.3",
    ),
    "zero weight": (
        '[{{path: "{trl}", weight: 0}}, {{path: "{llava}", weight: 1}}]',
        "stages[0].data.train[0].weight: must be above 0 (a share of the epoch's rows), got 0.0",
    ),
    "weights and samples mixed": (
        '[{{path: "{trl}", weight: 0.5}}, {{path: "{llava}", samples: 10}}]',
        "stages[0].data.train[1].samples: weights (data.train[0]) and samples mixed in one list",
    ),
    "weight and samples in one entry": (
        '[{{path: "{trl}", weight: 0.5, samples: 3}}]',
        "stages[0].data.train[0]: gives both `weight` and `samples`: keep one",
    ),
    "an entry without a share": (
        '[{{path: "{trl}", weight: 0.5}}, "{llava}"]',
        "stages[0].data.train[1]: no `weight` or `samples`",
    ),
    "a missing file": (
        '[{{path: "{trl}", weight: 0.5}}, {{path: "{missing}", weight: 0.5}}]',
        "stages[0].data.train[1].path: data file not found: {missing} (check the path, or remove the entry)",
    ),
    "a missing dataset_info.json": (
        '[{{path: "{trl}", weight: 0.5}}, {{path: "{missing_info}#mine", weight: 0.5}}]',
        "stages[0].data.train[1].path: dataset_info file not found: {missing_info}",
    ),
    "an unknown demo id": (
        '[{{path: "{trl}", weight: 0.5}}, {{path: "demo:trian", weight: 0.5}}]',
        "stages[0].data.train[1].path: unknown demo data `demo:trian`",
    ),
    "an empty list": ("[]", "stages[0].data.train: an empty list"),
    "an entry of the wrong kind": (
        '[{{path: "{trl}", weight: 0.5}}, 3]',
        "stages[0].data.train[1]: expected a mapping",
    ),
}


@pytest.mark.parametrize("name", list(BAD_MIXTURES))
def test_a_bad_mixture_is_a_recipe_error_naming_the_entry(name, tmp_path, sources, capsys):
    names = {
        **sources,
        "missing": str(tmp_path / "none.jsonl"),
        "missing_info": str(tmp_path / "no" / "dataset_info.json"),
    }
    entries, message = (text.format(**names) for text in BAD_MIXTURES[name])
    out = tmp_path / "runs"
    code = main([*bad_mixture(tmp_path, sources, entries), "--output-dir", str(out), "--run-name", "bad"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"bad.yaml: {message}" in err
    assert "Traceback" not in err
    assert not out.exists(), "found when the recipe loads: no run begins"


def test_the_mixture_recipe_scores_each_eval_source_and_its_report_page_shows_them(tmp_path, caplog):
    """recipes/r3-two-stage-mixture.yaml end to end on the tiny demo model: its last stage's eval is scored
    per source (`source:<path as the recipe names it>`) as well as overall, every prediction keeps its
    source, and the run's report page has a row per source, and a table of its last stage's training draw
    (a row per source of the mixture, as report.json records it)."""
    caplog.set_level(logging.INFO)
    out = tmp_path / "runs"
    args = ["--recipe", "r3-two-stage-mixture", "--max-steps", "2", "--output-dir", str(out)]
    overrides = ["data.max_train_samples=8", "data.max_eval_samples=3", "training.per_device_batch_size=2"]
    assert (
        main([*args, "--run-name", "run", *overrides, "precision=fp32", "evaluation.max_new_tokens=2"]) == 0
    )
    run_dir = out / "r3-two-stage-mixture" / "run"
    stage_dir = run_dir / "stage-2-llm-lora"
    scores = read_json(stage_dir / "metrics.json")["eval"]
    sources = ["demo:eval", "demo:pretraining-eval"]
    per_source = [scores[f"source:{source}"] for source in sources]
    assert [entry["rows"] for entry in per_source] == [3, 3] and scores["all"]["rows"] == 6
    recombined = sum(entry["exact_match"] * entry["rows"] for entry in per_source) / scores["all"]["rows"]
    assert recombined == pytest.approx(scores["all"]["exact_match"])
    answered = [json.loads(line) for line in (stage_dir / "predictions.jsonl").read_text().splitlines()]
    assert [record["source"] for record in answered] == [sources[0]] * 3 + [sources[1]] * 3
    assert "    demo:pretraining-eval: exact match" in caplog.text
    page = (run_dir / "report.html").read_text()
    assert "<h3>Per-source metrics</h3>" in page
    for source, entry in zip(sources, per_source, strict=True):
        assert f'<tr class="source-row"><td>{source}</td><td class="">{entry["exact_match"]:.3f}' in page
    drawn = read_json(stage_dir / "report.json")["data"]["mixture"]  # the training draw
    assert [row["source"] for row in drawn] == ["demo:train", "demo:pretraining-train"]
    assert "<caption>r3-two-stage-mixture / llm-lora</caption>" in page
    for row in drawn:
        assert f'<tr class="mixture-row"><td>{row["source"]}</td><td>{row["format"]}</td>' in page
        assert f"<td>weight {row['weight']:g}</td><td>{row['rows']:,}</td><td>{row['tokens']:,}</td>" in page


def test_eval_scores_are_grouped_per_source_and_recombine_to_the_overall_ones():
    records = [
        {"reference": "red", "output": "red", "source": "a.jsonl", "task": "colour"},
        {"reference": "blue", "output": "green", "source": "a.jsonl", "task": "colour"},
        {"reference": "square", "output": "square", "source": "demo:eval", "task": "kind"},
        {"reference": '{"n": 1}', "output": '{"n": 1}', "source": "demo:eval"},
        {"reference": "circle", "output": "circle", "source": "demo:eval"},
    ]
    scores = score_predictions(records)
    assert (scores["source:a.jsonl"]["rows"], scores["source:a.jsonl"]["exact_match"]) == (2, 0.5)
    assert (scores["source:demo:eval"]["rows"], scores["source:demo:eval"]["exact_match"]) == (3, 1.0)
    assert (
        scores["source:demo:eval"]["json_fields"]["f1"] == 1.0
        and "json_fields" not in scores["source:a.jsonl"]
    )
    assert scores["all"]["exact_match"] == pytest.approx((2 * 0.5 + 3 * 1.0) / 5)
    assert scores["task:colour"]["rows"] == 2  # tasks are still grouped beside the sources


def mixture_recipe(tmp_path: Path, sources: dict[str, str]) -> list[str]:
    """`--recipe` of a recipe training on the three sources (20 rows an epoch), evaluated on two of them."""
    names = [
        f'{{path: "{sources[name]}", {key}: {share[key]}}}'
        for name, share in WEIGHTS.items()
        for key in share
    ]
    extra = f'  max_train_samples: 20\n  eval: ["{sources["trl"]}", "{sources["llava"]}"]\n'
    return bad_mixture(tmp_path, sources, f"[{', '.join(names)}]", extra)


def test_data_check_reads_each_source_of_a_mixture_and_prints_the_draw(
    tmp_path, sources, demo_model_dir, capsys
):
    assert data_main(["check", *mixture_recipe(tmp_path, sources)]) == 0
    out = capsys.readouterr().out.splitlines()
    formats = {"trl": "TRL conversational", "lf": "sharegpt (dataset_info.json#mine)", "llava": "sharegpt"}
    lines = [line for line in out if line.startswith("data.train[")]
    assert len(lines) == 3
    for i, (name, line) in enumerate(zip(formats, lines, strict=True)):
        # each source's line, as one source's: its format, its lengths over every row, its problems
        assert line.startswith(f"data.train[{i}] ({sources[name]}): {formats[name]}"), line
        assert "tokens per sample: p50 " in line and line.endswith(f"({SIZES[name]} samples); no problems")
    table = out[out.index("data.train draw: 20 rows an epoch (seed 42):") + 1 :][:4]
    assert table[0].split() == ["source", "format", "share", "has", "drawn", "of", "all", "tokens"]
    assert [(row.split()[-4], row.split()[-3]) for row in table[1:]] == [("5", "10"), ("3", "6"), ("7", "4")]
    assert out[-1] == "no problems"
    assert [line.split(":")[0] for line in out if line.startswith("data.eval[")] == [
        f"data.eval[0] ({sources['trl']})",
        f"data.eval[1] ({sources['llava']})",
    ]
    assert "data.eval draw: 12 rows (seed 42):" in out


def test_a_bad_row_in_one_source_of_a_mixture_is_named_as_for_one_source(
    tmp_path, sources, demo_model_dir, capsys, caplog
):
    llava = json.loads(Path(sources["llava"]).read_text())
    llava[4]["image"] = "gone.png"
    Path(sources["llava"]).write_text(json.dumps(llava, indent=1))  # a row a line or more: named by line
    caplog.set_level(logging.WARNING)
    recipe = mixture_recipe(tmp_path, sources)
    said = {}
    for how, argv, found in (("alone", [sources["llava"], *recipe], 1), ("mixture", recipe, 2)):
        caplog.clear()
        assert data_main(["check", *argv]) == 2
        captured = capsys.readouterr()  # the mixture: the file is data.train[2] and data.eval[1]
        assert f"problems: {found} image not found (each listed above)" in captured.err
        said[how] = [line.strip() for line in caplog.text.splitlines() if "gone.png" in line]
    line = next(
        i for i, text in enumerate(Path(sources["llava"]).read_text().splitlines(), 1) if "llava-4" in text
    )
    assert said["alone"] == [
        f"{sources['llava']}:line {line - 1}: image not found: {Path(sources['llava']).parent / 'gone.png'}"
    ]
    assert said["mixture"] == said["alone"] * 2
    assert f"data.train[2] ({sources['llava']}): sharegpt" in captured.out
    assert "(6 samples); 1 image not found" in captured.out
