"""The benchmarks' own metrics computed at a stage's end from what its eval rows carry: VQAv2's `answers`
in a user's TRL file scored by VQA accuracy into predictions.jsonl, metrics.json, run.json and the end-of-run
table; options (a list with a letter answer, MMBench's A/B/C/D columns) giving option accuracy by default;
an unknown metric named at load; and the columns scoring the eval only, never what SFT trains on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import training_chat_template
from PIL import Image
from transformers import AutoModelForImageTextToText
from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

from vlm_recipes.benchmark_metrics.vqa_accuracy import vqa_accuracy
from vlm_recipes.cli.train import main
from vlm_recipes.comparison.run_table import format_summary
from vlm_recipes.data.collate import VideoCollator
from vlm_recipes.data.formats import EVAL_COLUMNS
from vlm_recipes.data.rows import load_split
from vlm_recipes.data.stage_data import load_stage_data
from vlm_recipes.errors import DataError
from vlm_recipes.evaluation.benchmarks import answer_scores
from vlm_recipes.evaluation.generation import answer_box_in_pixels, generate_answers, prompts_from_rows
from vlm_recipes.evaluation.metrics import decide_eval_metrics
from vlm_recipes.families import FAMILIES
from vlm_recipes.files import read_json
from vlm_recipes.model.build import load_processor
from vlm_recipes.recipes.schema import DataSettings, Stage

QUESTIONS = ["What colour is it?", "How many shapes?", "Is it round?", "What is on the left?"]
# A stage as short as one can be: one step of LoRA on the unquantized language model at a rate that moves
# no greedy answer (the test knows the model's answers beforehand), 4 rows each way, 4 new tokens.
SHORT = [
    "--recipe",
    "r1-llm-only",
    "--max-steps",
    "1",
    "quantization.mode=none",
    "training.learning_rate=1e-12",
    "training.per_device_batch_size=2",
    "data.max_train_samples=4",
    "data.max_eval_samples=4",
    "evaluation.max_new_tokens=4",
]


def image_files(directory: Path, count: int) -> list[str]:
    names = []
    for i in range(count):
        Image.new("RGB", (56, 56), (40 * i, 200, 255 - 40 * i)).save(directory / f"img{i}.png")
        names.append(f"img{i}.png")
    return names


def trl_row(i: int, question: str, reply_text: str, image: str, **columns) -> dict:
    """A row in TRL's conversational form (its messages' answer what SFT trains on), extra columns beside."""
    user = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}
    reply = {"role": "assistant", "content": [{"type": "text", "text": reply_text}]}
    return {"id": f"q{i}", "messages": [user, reply], "images": [image], **columns}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def vqav2_answers(answers: list[str]) -> list[dict]:
    """VQAv2's own answer records, as its annotation files give them."""
    return [{"answer": a, "answer_confidence": "yes", "answer_id": i + 1} for i, a in enumerate(answers)]


def test_a_users_vqav2_file_gets_vqa_accuracy_in_every_record_metrics_run_and_table(
    demo_model_dir, tmp_path, capsys, caplog
):
    caplog.set_level("INFO")
    images = image_files(tmp_path, 4)
    path = tmp_path / "vqa.jsonl"
    write_jsonl(path, [trl_row(i, q, "red", images[i]) for i, q in enumerate(QUESTIONS)])

    # the model's greedy answers, as the stage's eval will generate them (a rate of 1e-12 moves none)
    family = next(f for f in FAMILIES if f.name == "qwen2-vl")
    processor = load_processor(str(demo_model_dir), DataSettings(max_pixels=200704), family)
    model = AutoModelForImageTextToText.from_pretrained(demo_model_dir, dtype=torch.float32)
    rows, _ = load_split(str(path), "test", None, extra_columns=EVAL_COLUMNS)
    expected = generate_answers(model, processor, prompts_from_rows(rows), max_new_tokens=4, batch_size=8)
    del model

    # ten references a row: the model's answer four times, twice, never, once
    others = ["red", "blue", "green", "two", "yes", "no", "a cat", "left", "3", "round"]
    references = [[expected[i]] * n + others[: 10 - n] for i, n in enumerate([4, 2, 0, 1])]
    write_jsonl(
        path,
        [
            trl_row(i, q, "red", images[i], answers=vqav2_answers(references[i]))
            for i, q in enumerate(QUESTIONS)
        ],
    )
    args = ["--output-dir", str(tmp_path / "runs"), "--run-name", "t", f"data.train={path}"]
    assert main([*SHORT, *args, f"data.eval={path}"]) == 0

    stage = read_json(tmp_path / "runs" / "r1-llm-only" / "t" / "run.json")["stages"][0]
    records = [
        json.loads(line) for line in (Path(stage["dir"]) / "predictions.jsonl").read_text().splitlines()
    ]
    assert [r["output"] for r in records] == expected, "the stage's eval generates the answers known before"
    # the official formula, recomputed from the answers and the file's references
    official = [vqa_accuracy(r["output"], refs) for r, refs in zip(records, references, strict=True)]
    assert [r["vqa_accuracy"] for r in records] == official
    # by hand: each reference left out in turn, min(1, matches among the other nine / 3), over the ten.
    # 2 of 10: 2 x 1/3 (a matching one left out) + 8 x 2/3; 4 of 10: at least 3 left every time;
    # 1 of 10: 9 x 1/3; none: 0
    assert records[1]["vqa_accuracy"] == pytest.approx((2 * 1 / 3 + 8 * 2 / 3) / 10) == pytest.approx(0.6)
    assert records[0]["vqa_accuracy"] == 1.0 and records[2]["vqa_accuracy"] == 0.0
    assert records[3]["vqa_accuracy"] == pytest.approx(9 * 1 / 3 / 10) == pytest.approx(0.3)

    metrics = read_json(Path(stage["dir"]) / "metrics.json")
    assert metrics["eval_vqa_accuracy"] == pytest.approx(sum(official) / 4) == pytest.approx(0.475)
    assert metrics["eval"]["all"]["rows_scored"] == {"vqa_accuracy": 4}
    assert stage["eval_vqa_accuracy"] == metrics["eval_vqa_accuracy"]
    assert "eval_option_accuracy" not in metrics and "eval_anls" not in metrics
    decisions = {d["guard"]: d for d in read_json(Path(stage["dir"]) / "report.json")["decisions"]}
    assert decisions["eval-metrics"]["choice"] == "vqa_accuracy, exact_match"
    reason = decisions["eval-metrics"]["reason"]
    assert "4 of 4 rows carry ten annotators' answers (`answers`, VQAv2's shape)" in reason
    assert "on 4 rows; vqa_accuracy 0.475 (4 rows)" in caplog.text
    table = capsys.readouterr().out
    assert "exact match     VQA acc" in table and " 0.475 " in table
    assert "option acc" not in table


def options_rows(images: list[str]) -> list[dict]:
    """Multiple-choice rows as the common datasets ship them: a list of options answered by a letter, a
    list answered by the option's text, MMBench's A/B/C/D columns (the right one in `answer`, D empty for a
    three-option question), and a row with none (not scored by option accuracy)."""
    return [
        trl_row(0, "Which shape?", "B", images[0], options=["circle", "square", "star"]),
        trl_row(1, "Which colour?", "blue", images[1], choices=["red", "blue"]),
        trl_row(2, "Where?", "(C)", images[2], A="left", B="right", C="top", D="bottom", answer="C"),
        trl_row(3, "How many?", "2", images[3], A="1", B="2", C="3", D=None, answer="B"),
        trl_row(4, "Describe it.", "a red square", images[0]),
    ]


def as_openai_style(row: dict) -> dict:
    """The row as LLaMA-Factory's and ms-swift's files hold it: string contents with <image> placeholders."""
    texts = [(m["role"], "".join(p.get("text") or "<image>" for p in m["content"])) for m in row["messages"]]
    return row | {"messages": [{"role": role, "content": text} for role, text in texts]}


@pytest.mark.parametrize("shape", ["trl", "openai-style"])
def test_rows_with_options_get_option_accuracy_by_default(tmp_path, shape):
    """Read as the stage reads them (its data check, before the model loads): the options survive the file
    readers (TRL's rows, and the chat shapes turned into them) into the eval split, the default names option
    accuracy, and the answers are scored by it."""
    images = image_files(tmp_path, 4)
    rows = options_rows(images)
    path = write_jsonl(tmp_path / "mc.jsonl", rows if shape == "trl" else [as_openai_style(r) for r in rows])
    stage = Stage(name="s", data=DataSettings(train=str(path), eval=str(path)))
    data = load_stage_data(stage.data)
    assert {"options", "choices", "A", "D", "answer"} <= set(data.eval.column_names)
    assert "options" not in data.train.column_names, "the train split keeps what SFT reads"
    decision = decide_eval_metrics(stage, data)
    assert decision.choice == "option_accuracy, exact_match" == ", ".join(data.eval_metrics)
    assert "4 of 5 rows carry options" in decision.reason

    prompts = prompts_from_rows(data.eval)
    assert [p.targets.correct for p in prompts[:4]] == ["B", "B", "C", "B"]
    assert prompts[3].targets.options == {"A": "1", "B": "2", "C": "3"}
    answers = ["The answer is B.", "red", "C", "(A) 1", "anything"]
    scored = [answer_scores(a, p.targets, data.eval_metrics) for a, p in zip(answers, prompts, strict=True)]
    assert scored == [{"option_accuracy": s} for s in (1.0, 0.0, 1.0, 0.0)] + [{}]


def test_an_answer_that_is_no_option_is_a_data_error_naming_the_row(tmp_path):
    images = image_files(tmp_path, 1)
    path = write_jsonl(tmp_path / "mc.jsonl", [trl_row(0, "Which?", "E", images[0], options=["a", "b"])])
    stage = Stage(name="s", data=DataSettings(train=str(path), eval=str(path)))
    with pytest.raises(DataError, match=r"row q0: its answer 'E' is neither an option's letter \(A, B\)"):
        decide_eval_metrics(stage, load_stage_data(stage.data))


def test_an_unknown_eval_metric_fails_at_load_naming_the_key_and_the_choices(tmp_path, capsys):
    assert (
        main(["--recipe", "r1-llm-only", "--output-dir", str(tmp_path), "data.eval_metrics=[vqa_acc]"]) == 2
    )
    err = capsys.readouterr().err
    assert "data.eval_metrics[0]" in err and "got 'vqa_acc'; did you mean `vqa_accuracy`?" in err
    assert (
        "vqa_accuracy | anls | relaxed_accuracy | option_accuracy | box_acc50 | exact_match | json_f1" in err
    )


def test_the_extra_columns_leave_a_rows_training_tokens_as_they_are(demo_model_dir, tmp_path):
    """The same rows with and without `answers`, options and an `answer`, through the collator SFTTrainer
    trains with (the eval loss reads the eval split, which keeps them): the same tokens and labels."""
    images = image_files(tmp_path, 4)
    plain = [trl_row(i, q, "red", images[i]) for i, q in enumerate(QUESTIONS)]
    extra = [
        plain[0] | {"answers": ["red"] * 10},
        plain[1] | {"options": ["red", "blue"]},
        plain[2] | {"A": "red", "B": "blue", "answer": "A"},
        plain[3] | {"answers": ["red", "crimson"]},
    ]
    with_columns = load_stage_data(
        DataSettings(
            train=str(write_jsonl(tmp_path / "plain.jsonl", plain)),
            eval=str(write_jsonl(tmp_path / "extra.jsonl", extra)),
        )
    ).eval
    assert {"answers", "options", "A", "answer"} <= set(with_columns.column_names)
    without, _ = load_split(str(tmp_path / "plain.jsonl"), "test", None, extra_columns=EVAL_COLUMNS)
    assert not {"answers", "options", "A", "answer"} & set(without.column_names)

    family = next(f for f in FAMILIES if f.name == "qwen2-vl")
    processor = load_processor(str(demo_model_dir), DataSettings(), family)
    trl = DataCollatorForVisionLanguageModeling(
        processor, assistant_only_loss=True, chat_template=training_chat_template(processor)
    )
    collate = VideoCollator.extending(trl, videos=None)
    batch, expected = collate(list(with_columns)), collate(list(without))
    assert batch.keys() == expected.keys()
    for key in expected:
        assert torch.equal(batch[key], expected[key]), key
    assert (expected["labels"] != -100).any(), "the answers are what it learns"


def test_a_grounding_prompt_rows_pixel_box_is_scored_against_the_answer_in_the_models_frame():
    """A `solution` box is in pixels of the row's image (as the iou reward reads it); the model answers in its
    family's frame (Qwen2-VL: 0-1000 across the image): box_acc50 converts the answer first. An answer that
    is itself a box (an SFT row's, in the frame the model is taught) is compared as written."""
    image = Image.new("RGB", (200, 100))
    question = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Where?"}]}
    grpo_row = {"id": "g", "prompt": [question], "solution": "[20, 10, 100, 60]", "images": [image]}
    (prompt,) = prompts_from_rows([grpo_row])
    assert prompt.targets.box == (20, 10, 100, 60) and prompt.targets.box_in_pixels
    answer = "(100,100),(500,600)"  # 0-1000: x 20-100 and y 10-60 of a 200 x 100 image
    box = answer_box_in_pixels(answer, prompt, processor=None, box_format="relative_1000")
    assert box == pytest.approx((20, 10, 100, 60))
    assert answer_scores(answer, prompt.targets, ["box_acc50"], box) == {"box_acc50": 1.0}
    assert answer_scores(answer, prompt.targets, ["box_acc50"]) == {"box_acc50": 0.0}, "read as written"

    sft_row = trl_row(0, "Where?", '{"bbox_2d": [100, 100, 500, 600]}', "img.png") | {"images": [image]}
    (prompt,) = prompts_from_rows([sft_row])
    assert prompt.targets.box == (100, 100, 500, 600) and not prompt.targets.box_in_pixels
    assert answer_box_in_pixels(answer, prompt, processor=None, box_format="relative_1000") is None
    assert answer_scores(answer, prompt.targets, ["box_acc50"]) == {"box_acc50": 1.0}


def test_the_end_of_run_table_has_a_column_per_metric_some_stage_computed(tmp_path):
    stages = [
        {"index": 1, "name": "sft", "method": "sft", "steps": 1, "final_train_loss": 1.0, "eval_loss": 2.0,
         "exact_match": 0.25, "wall_time_s": 1.0, "eval_anls": 0.5},
        {"index": 2, "name": "more", "method": "sft", "steps": 1, "final_train_loss": 1.0, "eval_loss": 2.0,
         "exact_match": 0.5, "wall_time_s": 1.0, "eval_anls": 0.75, "eval_box_acc50": 0.125},
    ]  # fmt: skip
    run = {"recipe": "r", "final_model": "m", "stages": stages}
    (tmp_path / "run.json").write_text(json.dumps(run))
    lines = format_summary(tmp_path).splitlines()
    header = next(line for line in lines if line.lstrip().startswith("#"))
    assert header.endswith("exact match        ANLS box Acc@0.5    time")
    first, second = (line.split() for line in lines if line.lstrip().startswith(("1 ", "2 ")))
    assert first[5:8] == ["0.250", "0.500", "-"] and second[5:8] == ["0.500", "0.750", "0.125"]
    stages[1].pop("eval_box_acc50")
    (tmp_path / "run.json").write_text(json.dumps(run))
    assert "Acc@0.5" not in format_summary(tmp_path) and "VQA acc" not in format_summary(tmp_path)
