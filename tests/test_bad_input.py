"""Bad input: a clear error naming the file, key or row and the fix; exit code 2; no stage marked done.

One table, input → expected message fragment. Everything here fails before any model trains."""

from __future__ import annotations

import fcntl
import json
import os
import random
import shutil
import sys
from pathlib import Path

import pytest
from conftest import write_recipe
from PIL import Image

from vlm_recipes.cli.train import main
from vlm_recipes.data.rows import load_split
from vlm_recipes.demo.dataset import ensure_demo_dataset
from vlm_recipes.demo.models import ensure_demo_model

ROW = {
    "id": "r",
    "messages": [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": "What colour is the shape?"}],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "red"}]},
    ],
    "images": ["a.png"],
}


def data_file(tmp: Path, rows: list, raw_lines: list[str] = ()) -> str:
    Image.new("RGB", (56, 56), "red").save(tmp / "a.png")
    path = tmp / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "".join(line + "\n" for line in raw_lines))
    return str(path)


def recipe(tmp: Path, body: str) -> str:
    return str(write_recipe(tmp, "bad", "model: demo:tiny-qwen2-vl\n" + body))


LLM_LORA = "stages:\n  - name: s\n    train: {llm: lora}\n"


def case_data(tmp: Path, rows=(), raw=(), extra=()) -> list[str]:
    return [
        "--recipe",
        "r1-llm-only",
        f"data.train={data_file(tmp, list(rows), list(raw))}",
        "data.eval=null",
        *extra,
    ]


def corrupt_image(tmp: Path) -> list[str]:
    args = case_data(tmp, [ROW])
    (tmp / "a.png").write_bytes(b"not a png at all")
    return args


def truncated_image(tmp: Path) -> list[str]:
    args = case_data(tmp, [ROW])
    data = (tmp / "a.png").read_bytes()
    (tmp / "a.png").write_bytes(data[: len(data) // 2])
    return args


def no_processor(tmp: Path) -> list[str]:
    model = tmp / "model"
    shutil.copytree(ensure_demo_model(), model)
    for name in ("processor_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (model / name).unlink()
    return ["--recipe", "r1-llm-only", f"model={model}"]


def binary_recipe(data: bytes):
    """A recipe file holding `data` (not UTF-8 text)."""

    def make(tmp: Path) -> list[str]:
        (tmp / "bad.yaml").write_bytes(data)
        return ["--recipe", str(tmp / "bad.yaml")]

    return make


HELD_LOCKS: list[int] = []  # closed after each case


def run_in_use(tmp: Path) -> list[str]:
    """The run directory `bad` is locked by another holder (as by a live process: its own open file)."""
    run_dir = tmp / "runs" / "r1-llm-only" / "bad"
    run_dir.mkdir(parents=True)
    fd = os.open(run_dir / ".lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, json.dumps({"pid": 4242, "host": "gpu-7", "since": "2026-01-01T00:00:00"}).encode())
    HELD_LOCKS.append(fd)
    return ["--recipe", "r1-llm-only"]


def unreadable_run_record(tmp: Path) -> list[str]:
    run_dir = tmp / "runs" / "r1-llm-only" / "old"
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text('{"resolved_recipe": ')
    return ["--resume", str(run_dir)]


def other_family(tmp: Path) -> list[str]:
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained(tmp / "gpt2")
    return ["--recipe", "r1-llm-only", f"model={tmp / 'gpt2'}"]


CASES = {
    # command line
    "unknown recipe": (lambda t: ["--recipe", "r1-llm-onyl"], "unknown recipe; did you mean `r1-llm-only`?"),
    "gpu that does not exist": (lambda t: ["--gpu", "6,7"], "this machine has no usable CUDA GPU"),
    "gpu not an id": (lambda t: ["--gpu", "first"], "give GPU ids separated by commas"),
    "override unknown key": (
        lambda t: ["stages.llm-lora.lora.rnak=4"],
        "unknown key `rnak`; did you mean `rank`?",
    ),
    "feature cache on a trained tower": (
        lambda t: ["--recipe", "r2-vision-only", "training.vision_feature_cache=true"],
        "vision_feature_cache: needs a frozen vision tower and projector, but this stage trains them",
    ),
    "override wrong type": (
        lambda t: ["training.epochs=two"],
        "training.epochs: expected a number, got 'two'",
    ),
    # numbers out of range: flags that set recipe keys are checked as the keys (the error names the flag)
    "negative epochs": (
        lambda t: ["--epochs", "-1"],
        "stages[0].training.epochs: must be above 0, got -1.0 (set by --epochs -1)",
    ),
    "zero epochs": (lambda t: ["--epochs", "0"], "training.epochs: must be above 0, got 0.0"),
    "epochs not finite": (lambda t: ["--epochs", "nan"], "training.epochs: must be a finite number"),
    "zero max steps": (
        lambda t: ["--max-steps", "0"],
        "training.max_steps: must be -1 or at least 1, got 0 (set by --max-steps 0)",
    ),
    "negative seed": (
        lambda t: ["--seeds", "-1"],
        "training.seed: must be at least 0 and at most 4294967295 (numpy seeds are 32-bit), got -1 "
        "(set by --seeds -1)",
    ),
    "seeds not numbers": (lambda t: ["--seeds", "0,one"], "--seeds 0,one: give whole numbers separated by"),
    "seed twice": (lambda t: ["--seeds", "1,1"], "--seeds 1,1: a seed is given twice"),
    "zero processes per node": (
        lambda t: ["--nproc-per-node", "0"],
        "--nproc-per-node 0: must be at least 1",
    ),
    "zero nodes": (lambda t: ["--nnodes", "0"], "--nnodes 0: must be at least 1"),
    "node rank past the nodes": (
        lambda t: ["--nnodes", "2", "--node-rank", "2"],
        "--node-rank 2: with --nnodes 2, give 0 to 1",
    ),
    "negative node rank": (lambda t: ["--node-rank", "-1"], "--node-rank -1: must be at least 0"),
    "port out of range": (
        lambda t: ["--master-port", "70000"],
        "--master-port 70000: must be at least 1 and at most 65535",
    ),
    "negative restarts": (lambda t: ["--max-restarts", "-1"], "--max-restarts -1: must be at least 0"),
    "until-stage zero": (lambda t: ["--until-stage", "0"], "--until-stage 0: must be at least 1"),
    "until-stage past the stages": (
        lambda t: ["--until-stage", "3"],
        "--until-stage 3: `r1-llm-only` has 1 stage(s)",
    ),
    "override out of range": (
        lambda t: ["training.learning_rate=0"],
        "training.learning_rate: must be above 0, got 0.0 (set by override `training.learning_rate=0`)",
    ),
    "override not finite": (lambda t: ["training.learning_rate=.inf"], "must be a finite number (above 0)"),
    "per-role learning rate negative": (
        lambda t: ["training.role_learning_rates.llm=-1e-4"],
        "training.role_learning_rates.llm: must be above 0",
    ),
    "lora dropout of 1": (
        lambda t: ["lora.dropout=1"],
        "lora.dropout: must be at least 0 and below 1, got 1.0",
    ),
    "warm-up above 1": (lambda t: ["training.warmup_ratio=1.5"], "must be at least 0 and at most 1, got 1.5"),
    "one checkpoint kept": (
        lambda t: ["training.save_total_limit=1"],
        "save_total_limit: must be at least 2 (one checkpoint stays complete while the next is written)",
    ),
    "max_length zero": (lambda t: ["data.max_length=0"], "data.max_length: must be at least 1, got 0"),
    "eval every 0 steps": (
        lambda t: ["evaluation.eval_steps=0"],
        "evaluation.eval_steps: must be at least 1",
    ),
    "no new tokens": (lambda t: ["evaluation.max_new_tokens=0"], "max_new_tokens: must be at least 1"),
    "negative tolerance": (
        lambda t: ["evaluation.numeric_tolerance=-0.1"],
        "numeric_tolerance: must be at least 0",
    ),
    "min pixels above max pixels": (
        lambda t: ["data.min_pixels=200000", "data.max_pixels=3136"],
        "data.min_pixels: 200000 is above data.max_pixels (3136): no image size fits",
    ),
    "resume changing the recipe": (
        lambda t: ["--resume", str(t / "runs" / "r1-llm-only" / "old"), "--max-steps", "3", "lora.rank=4"],
        "continues the run exactly as its run.json records it; --max-steps, key=value overrides cannot change",
    ),
    "resume from an unreadable run.json": (unreadable_run_record, "run.json: unreadable run record"),
    "run directory in use": (
        run_in_use,
        "is in use by process 4242 on host gpu-7 since 2026-01-01T00:00:00. A run directory has one writer",
    ),
    # recipe files
    "yaml syntax": (lambda t: ["--recipe", recipe(t, "stages: [\n")], "bad.yaml:3: YAML syntax error"),
    "unknown key": (
        lambda t: ["--recipe", recipe(t, LLM_LORA + "    lora: {rnak: 4}\n")],
        "stages[0].lora.rnak: unknown key; did you mean `rank`?",
    ),
    "wrong type": (
        lambda t: ["--recipe", recipe(t, LLM_LORA + "    training: {epochs: [1]}\n")],
        "stages[0].training.epochs: expected a number",
    ),
    "range in a recipe file": (
        lambda t: [
            "--recipe",
            recipe(t, LLM_LORA + "    lora: {rank: 0}\n    training: {seed: 4294967296}\n"),
        ],
        "stages[0].lora.rank: must be at least 1, got 0",
    ),
    "recipe of random bytes": (
        binary_recipe(bytes(random.Random(0).randrange(256) for _ in range(200))),
        "bad.yaml: not UTF-8 text",
    ),
    "recipe saved as UTF-16": (
        binary_recipe("model: demo:tiny-qwen2-vl\n".encode("utf-16")),
        "bad.yaml: not UTF-8 text: it looks like UTF-16 text",
    ),
    "recipe saved as UTF-16 without BOM": (
        binary_recipe("model: demo:tiny-qwen2-vl\n".encode("utf-16-le")),
        "bad.yaml: not UTF-8 text: it holds NUL bytes",
    ),
    "png renamed to .yaml": (
        binary_recipe(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR"),
        "bad.yaml: not UTF-8 text: it looks like a PNG image",
    ),
    "missing stage name": (
        lambda t: ["--recipe", recipe(t, "stages:\n  - train: {llm: lora}\n")],
        "stages[0].name: a stage needs a name",
    ),
    "missing model": (lambda t: ["--recipe", str(write_recipe(t, "bad", LLM_LORA))], "model: no model given"),
    "empty stages": (
        lambda t: ["--recipe", recipe(t, "stages: []\n")],
        "a recipe needs a non-empty list of stages",
    ),
    "used stage missing": (
        lambda t: ["--recipe", recipe(t, "stages:\n  - use: r1-llm-only:vision\n")],
        "recipe `r1-llm-only` has no stage `vision`",
    ),
    "used recipe missing": (
        lambda t: ["--recipe", recipe(t, "stages:\n  - use: r7-nothing\n")],
        "unknown recipe",
    ),
    "reuse cycle": (
        lambda t: ["--recipe", recipe(t, f"extends: {t / 'bad.yaml'}\n" + LLM_LORA)],
        "cycle: bad → bad",
    ),
    "init_from a later stage": (
        lambda t: [
            "--recipe",
            recipe(t, LLM_LORA + "    init_from: stage:t\n  - name: t\n    train: {llm: lora}\n"),
        ],
        "stage `t` comes later",
    ),
    # impossible combinations
    "full training of a quantized role": (
        lambda t: ["stages.llm-lora.train.llm=full"],
        "`full` training of a 4bit quantized role is impossible",
    ),
    "all roles frozen": (lambda t: ["stages.llm-lora.train.llm=frozen"], "every role is frozen"),
    "lora target not in the model": (
        lambda t: ["stages.llm-lora.lora.targets={llm: [qkv_proj]}"],
        "lora.targets.llm: no module of `llm` matches qkv_proj",
    ),
    "fp16 without a GPU": (lambda t: ["precision=fp16"], "fp16 was requested but this machine has no GPU"),
    # data
    "data file missing": (lambda t: ["data.train=" + str(t / "none.jsonl")], "data file not found"),
    "unreadable json line": (
        lambda t: case_data(t, [ROW], ['{"messages": [']),
        "train.jsonl:line 2: unreadable JSON",
    ),
    "row without messages": (
        lambda t: case_data(t, [ROW, {"images": []}]),
        "train.jsonl:line 2: no messages",
    ),
    "no assistant turn": (
        lambda t: case_data(t, [{**ROW, "messages": ROW["messages"][:1]}]),
        "train.jsonl:line 1: no assistant turn",
    ),
    "image path missing": (lambda t: case_data(t, [{**ROW, "images": ["gone.png"]}]), "image not found"),
    "image corrupt": (corrupt_image, "train.jsonl:line 1: corrupt image"),
    "image truncated": (truncated_image, "train.jsonl:line 1: corrupt image"),
    "more image parts than images": (
        lambda t: case_data(t, [{**ROW, "images": []}]),
        "1 image parts in messages but 0 images",
    ),
    "more images than image parts": (
        lambda t: case_data(t, [{**ROW, "images": ["a.png", "a.png"]}]),
        "1 image parts in messages but 2 images",
    ),
    "remote image without permission": (
        lambda t: case_data(t, [{**ROW, "images": ["https://x.org/a.png"]}]),
        "set data.allow_remote_images: true",
    ),
    "empty after skipping": (
        lambda t: case_data(t, [{**ROW, "images": []}], extra=["data.on_bad_sample=skip"]),
        "the dataset is empty after skipping 1 bad rows",
    ),
    "image tokens exceed max_length": (lambda t: ["data.max_length=8"], "longer than max_length"),
    "a key with values of different kinds": (
        lambda t: case_data(t, [ROW, {**ROW, "images": "a.png"}]),
        "train.jsonl:line 2: `images` is a string but a list of a string on line 1",
    ),
    # models
    "model dir missing": (lambda t: ["model=" + str(t / "nowhere")], "is not a model directory"),
    "unsupported family": (other_family, "model type `gpt2` has no family module (those with one: qwen2_vl"),
    "processor missing": (no_processor, "no usable processor in"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_a_clear_error(name, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    make_args, message = CASES[name]
    args = make_args(tmp_path)
    if "--recipe" not in args and "--resume" not in args:
        args = ["--recipe", "r1-llm-only", *args]
    out = tmp_path / "runs"
    run = [] if "--resume" in args else ["--run-name", "bad"]  # --resume RUN_DIR names its run
    try:
        code = main([*args, "--output-dir", str(out), *run])
    finally:
        while HELD_LOCKS:
            os.close(HELD_LOCKS.pop())
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err
    assert "Traceback" not in err
    assert not list(out.glob("**/DONE")), "no stage may look finished"
    for record in out.glob("*/bad/run.json"):  # bad input found after the run began: the run says so
        manifest = json.loads(record.read_text())
        assert manifest["status"] == "failed", manifest["status"]
        assert message in manifest["error"]


def test_unknown_flag_is_rejected_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--recipe", "r1-llm-only", "--epoch", "2"])
    assert exit_info.value.code == 2
    assert (
        "unrecognized arguments: --epoch" in capsys.readouterr().err or "ambiguous" in capsys.readouterr().err
    )


def test_4bit_without_bitsandbytes_is_a_clear_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # what a machine without bitsandbytes gives
    code = main(["--recipe", "r1-llm-only", "--output-dir", str(tmp_path), "--run-name", "bad"])
    assert code == 2
    assert "quantization 4bit needs bitsandbytes" in capsys.readouterr().err


def test_skip_policy_trains_without_bad_rows_and_counts_them(tmp_path, capsys):
    good = dict(ROW)
    args = case_data(
        tmp_path,
        [good, good, {"images": []}, {**ROW, "images": ["gone.png"]}],
        ['{"broken'],
        extra=["data.on_bad_sample=skip", "--max-steps", "1"],
    )
    assert main([*args, "--output-dir", str(tmp_path / "runs"), "--run-name", "ok"]) == 0
    report = json.loads(next((tmp_path / "runs").glob("**/report.json")).read_text())
    assert report["data"]["train_rows"] == 2
    assert report["data"]["skipped_rows"]["train"] == {
        "unreadable JSON": 1,
        "no messages": 1,
        "image not found": 1,
    }


def test_demo_dataset_is_clean(private_demo_cache):
    assert (ensure_demo_dataset() / "train.jsonl").is_file()


def test_text_content_as_a_string_or_as_parts_mixes_in_one_file(tmp_path):
    """`"content": "text"` in one row and `[{"type": "text", ...}]` in another, both valid chat messages,
    load into one table as parts (Arrow alone refuses to mix them)."""
    text_only = {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]}
    ds, _ = load_split(data_file(tmp_path, [ROW, text_only]), "train", None)
    assert ds[1]["messages"][1]["content"] == [{"type": "text", "text": "hi"}]
    assert ds[0]["messages"][1]["content"] == [{"type": "text", "text": "red"}]
