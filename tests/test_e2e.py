"""End to end on the tiny model: the four seed recipes and a new three-stage recipe, through the CLI.

For every stage: frozen parameters are bit-identical to the stage's source, trained ones changed,
and final/ is a complete model directory that from_pretrained loads alone.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import TRAIN, demo_split, model_inputs, write_recipe
from transformers import AutoModelForImageTextToText

from vlm_recipes.cli.train import main
from vlm_recipes.demo.models import ensure_demo_model
from vlm_recipes.families.qwen2_vl import QWEN2_VL
from vlm_recipes.files import read_json

pytestmark = pytest.mark.e2e

QUICK = [
    "--max-steps",
    "3",
    "training.per_device_batch_size=4",
    "data.max_eval_samples=8",
    "training.logging_steps=1",
    "precision=fp32",  # the same path on any CPU (tests/test_families.py runs the seeds in bf16 too)
]


def run_cli(recipe: str, output_dir: Path, *extra: str) -> Path:
    code = main(["--recipe", recipe, "--output-dir", str(output_dir), "--run-name", "test", *QUICK, *extra])
    assert code == 0
    return output_dir / Path(recipe).stem / "test"


def load_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """Parameters by module name (transformers 5 saves Qwen2-VL under its original hub key names,
    so the files are read through from_pretrained, as every user of final/ does)."""
    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    return {name: p.detach() for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def seed_runs(tmp_path_factory, private_demo_cache) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("runs")
    return {
        name: run_cli(name, out) for name in ("r1-llm-only", "r2-vision-only", "r3-two-stage", "r4-joint")
    }


def assert_stage_trained_what_it_should(stage: dict, recipe_stage: dict) -> None:
    """Frozen: bit-identical to the source. LoRA: only the adapted linear weights moved. Full: all moved."""
    before = load_weights(Path(stage["source"]))
    after = load_weights(Path(stage["final_model"]))
    assert before.keys() == after.keys()
    report = read_json(Path(stage["dir"]) / "report.json")
    lora_weights = {f"{m}.weight" for m in report["lora_targets"]}
    modes = recipe_stage["train"]
    for name, old in before.items():
        role = QWEN2_VL.role_of(name)
        changed = not torch.equal(old, after[name])
        mode = modes[role]
        if mode == "frozen" or (mode == "lora" and name not in lora_weights):
            assert not changed, f"{stage['name']}: {name} ({role}, {mode}) changed"
        else:
            assert changed, f"{stage['name']}: {name} ({role}, {mode}) did not change"
    assert lora_weights or all(m != "lora" for m in modes.values())


@pytest.mark.parametrize("recipe", ["r1-llm-only", "r2-vision-only", "r3-two-stage", "r4-joint"])
def test_seed_recipe_trains_exactly_its_roles(seed_runs, recipe):
    run_dir = seed_runs[recipe]
    manifest = read_json(run_dir / "run.json")
    assert manifest["status"] == "finished"
    resolved = manifest["resolved_recipe"]
    assert len(manifest["stages"]) == len(resolved["stages"])
    for stage, recipe_stage in zip(manifest["stages"], resolved["stages"], strict=True):
        stage_dir = Path(stage["dir"])
        assert (stage_dir / "DONE").is_file()
        assert stage["steps"] == 3 and stage["eval_loss"] is not None
        metrics = read_json(stage_dir / "metrics.json")
        assert metrics["loss_curve"] and all(p["loss"] > 0 for p in metrics["loss_curve"])
        assert_stage_trained_what_it_should(stage, recipe_stage)
        # the demo's first eval rows: a video row and a two-image row among them, answered
        tasks = {json.loads(line)["task"] for line in (stage_dir / "predictions.jsonl").open()}
        assert {"motion", "pair"} <= tasks
        dtypes = read_json(stage_dir / "report.json")["dtypes_after_training"]
        assert set(dtypes["trainable"]) == {"fp32"}, (
            "trainable weights keep fp32 masters (LoRA: fp32 adapters)"
        )
        precision = next(
            d["choice"]
            for d in read_json(stage_dir / "report.json")["decisions"]
            if d["guard"] == "precision"
        )
        assert set(dtypes["frozen"]) <= {precision, "uint8"}, "frozen weights are in the compute dtype"
        audit = read_json(stage_dir / "report.json")["freeze_audit"]
        for role, mode in recipe_stage["train"].items():
            if mode == "frozen":  # bit for bit as the stage's source had it
                assert audit[role]["changed"] == 0 and audit[role]["identical"] > 0, (role, audit)
            else:
                assert audit[role]["changed"] > 0, (role, audit)


def test_run_manifest_records_provenance(seed_runs):
    manifest = read_json(seed_runs["r3-two-stage"] / "run.json")
    for key in ("resolved_recipe", "versions", "git_sha", "seeds", "hardware", "command"):
        assert key in manifest
    assert manifest["versions"]["transformers"].startswith("5.")
    stage1, stage2 = manifest["stages"]
    assert stage2["source"] == stage1["final_model"]
    chain = json.loads((Path(stage2["final_model"]) / "provenance.json").read_text())
    assert [c["stage"] for c in chain] == ["vision-full", "llm-lora"]
    assert manifest["final_model"] == stage2["final_model"]


def test_r3_stage2_loads_stage1_weights(seed_runs):
    """The 4-bit load of stage 1's final/ keeps the tuned vision tower: compare the loaded model itself."""
    from vlm_recipes.model.build import build_stage_model
    from vlm_recipes.recipe import load_recipe

    stage1_final = seed_runs["r3-two-stage"] / "stage-1-vision-full" / "final"
    stage2 = load_recipe("r3-two-stage").stages[1]
    built = build_stage_model(str(stage1_final), stage2, "fp32", "cpu")
    loaded = {n.removeprefix("base_model.model."): p for n, p in built.model.named_parameters()}
    stage1 = load_weights(stage1_final)
    base = load_weights(ensure_demo_model())
    vision = [n for n in stage1 if QWEN2_VL.role_of(n) in ("vision", "projector")]
    assert vision
    for name in vision:
        assert torch.equal(loaded[name].detach(), stage1[name]), name
    assert any(not torch.equal(stage1[n], base[n]) for n in vision), "stage 1 did not change the tower"
    quantized = [n for n, p in built.model.named_parameters() if p.dtype == torch.uint8]
    assert quantized and all(
        QWEN2_VL.role_of(n.removeprefix("base_model.model.")) == "llm" for n in quantized
    )


def test_final_model_loads_alone_and_generates(seed_runs):
    from transformers import AutoProcessor

    final = seed_runs["r3-two-stage"] / "stage-2-llm-lora" / "final"
    model = AutoModelForImageTextToText.from_pretrained(final)
    processor = AutoProcessor.from_pretrained(final)
    row = demo_split("demo:eval", "test", 1)[0][0]
    prompt = {"messages": [m for m in row["messages"] if m["role"] != "assistant"], "images": row["images"]}
    inputs = model_inputs(processor, [prompt], add_generation_prompt=True)
    out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > inputs["input_ids"].shape[1]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_new_three_stage_recipe_runs_without_code(tmp_path, precision):
    path = write_recipe(
        tmp_path,
        "projector-vision-llm",
        """
# Run: python scripts/train_recipe.py --recipe projector-vision-llm.yaml
description: projector only, then vision tower, then LoRA on the language model
model: demo:tiny-qwen2-vl
stages:
  - name: projector
    train: {projector: full}
    training: {learning_rate: 1.0e-3}
  - use: r2-vision-only:vision-full
    init_from: previous
    train: {projector: frozen}
    training: {gradient_checkpointing: true}
  - use: r1-llm-only:llm-lora
    init_from: previous
""",
    )
    # fp32 merges in place; bf16 rounds frozen weights while training, so final/ is rebuilt from the source
    # group_by_length: batches by text + image tokens, eval included (a regression: eval lacked the lengths)
    run_dir = run_cli(str(path), tmp_path / "runs", f"precision={precision}", "training.group_by_length=true")
    manifest = read_json(run_dir / "run.json")
    assert [s["name"] for s in manifest["stages"]] == ["projector", "vision-full", "llm-lora"]
    for stage, recipe_stage in zip(manifest["stages"], manifest["resolved_recipe"]["stages"], strict=True):
        assert_stage_trained_what_it_should(stage, recipe_stage)
    assert manifest["stages"][1]["source"] == manifest["stages"][0]["final_model"]


def test_rerun_refuses_then_resume_skips_done_stages(seed_runs, capsys):
    run_dir = seed_runs["r2-vision-only"]
    out = run_dir.parent.parent
    args = ["--recipe", "r2-vision-only", "--output-dir", str(out), "--run-name", "test", *QUICK]
    assert main(args) == 2
    assert "--resume" in capsys.readouterr().err
    before = (run_dir / "stage-1-vision-full" / "DONE").read_text()
    assert main([*args, "--resume"]) == 0
    assert (run_dir / "stage-1-vision-full" / "DONE").read_text() == before  # not retrained


def test_dry_run_plans_without_training(tmp_path, capsys):
    assert main(["--recipe", "r3-two-stage", "--dry-run", "--output-dir", str(tmp_path)]) == 0
    plan = capsys.readouterr().out
    assert "stage 2: llm-lora  (from stage 1 (vision-full) final/)" in plan
    assert "4bit nf4, kept unquantized: vision, projector, lm_head" in plan
    assert not any(tmp_path.iterdir())


def test_list_shows_every_seed_recipe(capsys):
    assert main(["--list"]) == 0
    listing = capsys.readouterr().out
    for name in ("r1-llm-only", "r2-vision-only", "r3-two-stage", "r4-joint"):
        assert name in listing


def test_bad_input_exits_2_without_traceback(tmp_path):
    result = subprocess.run(
        [
            *TRAIN,
            "--recipe",
            "r3-two-stag",
            "--output-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "did you mean `r3-two-stage`?" in result.stderr
    assert "Traceback" not in result.stderr
