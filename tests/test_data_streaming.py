"""`data.streaming: true` (data/streaming.py): the training rows read as they are trained on. The rows a stream
gives are the rows and lengths a read split has; a bad row is named at its line (before the model loads when
it is among the first rows, while training after), or skipped and counted; the order is the seed's; the
memory is the shuffle window's, not the file's; what a stream cannot do is refused at load, naming the key."""

from __future__ import annotations

import json
import logging
import tracemalloc
from itertools import islice

import pytest
from conftest import write_recipe
from PIL import Image
from safetensors.torch import load_file
from test_resume import killed_and_resumed_r2
from transformers import AutoProcessor

from vlm_recipes.cli.train import main
from vlm_recipes.data import streaming
from vlm_recipes.data.lengths import sample_lengths
from vlm_recipes.data.rows import load_split, undecoded
from vlm_recipes.data.streaming import Stream, StreamCounts, streamed_split
from vlm_recipes.demo.models import resolve_model_source
from vlm_recipes.families import family_for_model_type
from vlm_recipes.files import read_json
from vlm_recipes.recipes.schema import DataSettings

COLOURS = ("red", "green", "blue", "yellow")


def colour_rows(directory, rows: int) -> list[dict]:
    """Rows asking the colour of one of four small images, answers of a few tokens; row i's id is i."""
    for colour in COLOURS:
        Image.new("RGB", (56, 56), colour).save(directory / f"{colour}.png")
    return [
        {
            "id": str(i),
            "messages": [
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"{i}: colour?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": COLOURS[i % 4]}]},
            ],
            "images": [f"{COLOURS[i % 4]}.png"],
        }
        for i in range(rows)
    ]


def without_nulls(value):
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    return [without_nulls(v) for v in value] if isinstance(value, list) else value


def write_rows(directory, rows: list[dict], name: str = "train.jsonl"):
    path = directory / name
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def model_and_processor(private_demo_cache):
    """The demo model's processor and family (Qwen2-VL)."""
    return AutoProcessor.from_pretrained(resolve_model_source("demo:tiny-qwen2-vl")), family_for_model_type(
        "qwen2_vl"
    )


def stream_of(path, model_and_processor, max_length=None, **settings) -> Stream:
    processor, family = model_and_processor
    data = DataSettings(train=str(path), eval=None, max_length=max_length, streaming=True, **settings)
    return Stream(str(path), str(path), "train", data, processor, family, max_length)


def test_a_stream_gives_the_rows_and_lengths_a_read_split_has(tmp_path, model_and_processor):
    path = write_rows(tmp_path, colour_rows(tmp_path, 150))
    counts = StreamCounts()
    streamed = list(stream_of(path, model_and_processor).rows(counts))
    read, _ = load_split(str(path), "train", None)
    plain = undecoded(read).to_list()
    # (a table gives every content part every key, null where a part has none)
    assert [row["messages"] for row in streamed] == [without_nulls(row["messages"]) for row in plain]
    assert [row["images"] for row in streamed] == [
        [image["path"] for image in row["images"]] for row in plain
    ]
    lengths = sample_lengths(undecoded(read), *model_and_processor)
    assert counts.read == counts.kept == 150 and counts.longest == max(lengths)


def test_a_streamed_split_is_shuffled_by_the_seed_in_its_window_and_anew_each_pass(
    tmp_path, model_and_processor
):
    path = write_rows(tmp_path, colour_rows(tmp_path, 120))
    stream = stream_of(path, model_and_processor, shuffle_buffer=50)

    def order(seed: int) -> list[str]:
        """The ids of the stream's first two passes (it never ends: Trainer counts its steps in one epoch)."""
        rows, _ = streamed_split(stream, seed, StreamCounts())
        return [row["id"] for row in islice(rows, 240)]

    both = order(0)
    first, second = both[:120], both[120:]
    assert sorted(first, key=int) == sorted(second, key=int) == [str(i) for i in range(120)]
    assert order(0) == both and order(1)[:120] != first and second != first
    assert first != [str(i) for i in range(120)]
    assert all(int(row_id) < 50 + place for place, row_id in enumerate(first))  # a window of 50 rows
    rows, head = streamed_split(stream, 0, StreamCounts())
    assert isinstance(next(iter(rows))["images"][0], Image.Image) and len(head) == 100


def test_bad_and_too_long_rows_are_skipped_and_counted_or_named_at_their_line(tmp_path, model_and_processor):
    rows = colour_rows(tmp_path, 40)
    rows[7]["images"] = ["missing.png"]
    rows[12]["messages"][1]["content"][0]["text"] = "a much longer answer " * 40
    path = write_rows(tmp_path, rows)
    counts = StreamCounts()
    kept = list(stream_of(path, model_and_processor, max_length=200, on_bad_sample="skip").rows(counts))
    assert counts.read == 40 and counts.kept == len(kept) == 38
    assert dict(counts.skipped) == {"image not found": 1, "longer than max_length": 1}
    assert "7" not in [row["id"] for row in kept] and "12" not in [row["id"] for row in kept]
    with pytest.raises(Exception, match=r"train.jsonl:line 8: image not found"):
        list(stream_of(path, model_and_processor, max_length=200).rows(StreamCounts()))
    rows[7]["images"] = ["red.png"]
    with pytest.raises(Exception, match=r"train.jsonl:line 13: longer than max_length: \d+ tokens > 200"):
        list(stream_of(write_rows(tmp_path, rows), model_and_processor, max_length=200).rows(StreamCounts()))


def test_streaming_holds_the_window_not_the_file(tmp_path, model_and_processor, monkeypatch):
    """4x the rows, the same peak of Python memory while the whole stream is read: measured 0.6 and 0.7 MB at
    500 and 2,000 rows in a window of 100; with a window holding every row, 1.3 and 4.7 MB."""

    def peak_mb(rows: int) -> float:
        path = write_rows(tmp_path, colour_rows(tmp_path, rows), f"rows-{rows}.jsonl")
        stream = stream_of(path, model_and_processor, shuffle_buffer=100)
        rows_of, _ = streamed_split(stream, 0, StreamCounts())
        tracemalloc.start()
        try:
            assert sum(1 for _ in islice(rows_of, rows)) == rows  # one pass of the endless stream
            return tracemalloc.get_traced_memory()[1] / 2**20
        finally:
            tracemalloc.stop()

    monkeypatch.setattr(streaming, "HEAD_ROWS", 10)
    few, many = peak_mb(500), peak_mb(2000)
    assert many < 1.5 * few, f"{few:.1f} MB at 500 rows, {many:.1f} MB at 2,000"


STREAMING = """model: demo:tiny-qwen2-vl
data:
  train: {train}
  eval: null
  streaming: true
  on_bad_sample: {policy}
  max_length: 200
stages:
  - name: stream
    train: {{llm: lora}}
{extra}"""
RUN = [
    "--max-steps",
    "3",
    "training.per_device_batch_size=4",
    "precision=fp32",
    "training.learning_rate=1e-3",
]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_streamed_stage_trains_and_records_what_the_stream_read_and_skipped(precision, tmp_path, caplog):
    rows = colour_rows(tmp_path, 40)
    rows[7]["images"] = ["missing.png"]
    path = write_rows(tmp_path, rows)
    recipe = write_recipe(tmp_path, "stream", STREAMING.format(train=path, policy="skip", extra=""))
    out = tmp_path / "runs"
    caplog.set_level(logging.INFO)
    args = [
        "--recipe",
        str(recipe),
        "--output-dir",
        str(out),
        "--run-name",
        "run",
        *RUN,
        f"precision={precision}",
    ]
    assert main(args) == 0
    stage = out / "stream" / "run" / "stage-1-stream"
    assert (stage / "DONE").exists()
    decisions = read_json(stage / "report.json")["decisions"]
    assert next(d for d in decisions if d["guard"] == "precision")["choice"] == precision
    report = read_json(stage / "report.json")["data"]
    assert report["streaming"] and report["train_rows"] is None
    streamed = read_json(stage / "metrics.json")["data_streamed"]
    assert streamed["skipped"] == {"image not found": streamed["rows_read"] - streamed["rows_kept"]} != {}
    assert "streamed (data.streaming): its first 40 rows checked now" in caplog.text
    assert "rows streamed → 3 steps (training.max_steps)" in caplog.text
    adapter = load_file(stage / "adapter" / "adapter_model.safetensors")
    assert max(t.abs().max().item() for k, t in adapter.items() if "lora_B" in k) > 1e-4  # B starts at zero


def test_a_bad_row_past_the_first_rows_stops_the_stage_naming_its_line(tmp_path, monkeypatch, capsys):
    """A row the first checks did not reach fails the stage while it trains: exit 2, its line named, the stage
    not done."""
    monkeypatch.setattr(streaming, "HEAD_ROWS", 5)
    rows = colour_rows(tmp_path, 40)
    rows[30]["images"] = ["missing.png"]
    path = write_rows(tmp_path, rows)
    recipe = write_recipe(tmp_path, "stream", STREAMING.format(train=path, policy="fail", extra=""))
    out = tmp_path / "runs"
    code = main(["--recipe", str(recipe), "--output-dir", str(out), "--run-name", "run", *RUN])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "train.jsonl:line 31: image not found" in err and "Traceback" not in err
    assert not (out / "stream" / "run" / "stage-1-stream" / "DONE").exists()


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("training.max_steps=-1", "training.max_steps"),
        ("training.group_by_length=true", "training.group_by_length"),
        ("training.preprocessed_cache=true", "training.preprocessed_cache"),
        ("method=dpo", "method"),
    ],
)
def test_what_a_stream_cannot_do_is_refused_at_load_naming_the_key(override, key, tmp_path, capsys):
    path = write_rows(tmp_path, colour_rows(tmp_path, 4))
    recipe = write_recipe(tmp_path, "stream", STREAMING.format(train=path, policy="fail", extra=""))
    code = main(["--recipe", str(recipe), "--dry-run", "training.max_steps=3", override])
    err = capsys.readouterr().err
    assert code == 2 and f"stages[0].{key}: with data.streaming:" in err and "Traceback" not in err


def test_a_mixture_is_refused_with_streaming(tmp_path, capsys):
    path = write_rows(tmp_path, colour_rows(tmp_path, 4))
    train = f"[{{path: {path}, weight: 1}}, {{path: {path}, weight: 2}}]"
    recipe = write_recipe(tmp_path, "stream", STREAMING.format(train=train, policy="fail", extra=""))
    code = main(["--recipe", str(recipe), "--dry-run", "training.max_steps=3"])
    err = capsys.readouterr().err
    assert code == 2 and "stages[0].data.train: with data.streaming: a mixture" in err


def test_a_streamed_stage_killed_inside_its_second_pass_resumes_to_the_same_weights(tmp_path, caplog):
    """20 rows at 4 a step: a pass is 5 steps. Killed after step 8, resumed from checkpoint 7, two batches
    into the second pass (the stream read again up to there): the weights of a run never killed. Trainer
    counts a stream's every step in its epoch 0; a stream that ended each pass there resumed at the second
    pass's first row, and its weights differed."""
    path = write_rows(tmp_path, colour_rows(tmp_path, 20))
    extra = (
        f"data.train={path}",
        "data.streaming=true",
        "data.shuffle_buffer=16",
        "data.eval=null",
        "precision=fp32",
        "training.per_device_batch_size=4",
        "training.save_steps=7",
        "training.learning_rate=1e-3",  # moves the weights far past fp32's rounding in 9 steps
        "--max-steps",
        "9",
    )
    killed_and_resumed_r2(tmp_path, extra, "stage1:step8", "checkpoint-7", caplog)
