"""Preference stages (method: dpo): r5 end to end, DPO moves eval reward accuracy, the LoRA reference is the
adapter switched off (no second model), and bad preference rows are clear errors with exit 2."""

from __future__ import annotations

import json
import logging
import signal
from pathlib import Path

import pytest
import torch
from conftest import TINY_MODELS, demo_paths, distance_and_share_beyond, run_train, write_recipe
from peft.tuners.tuners_utils import BaseTunerLayer
from PIL import Image
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText

from vlm_recipes.cli.train import main
from vlm_recipes.comparison.answers import side_by_side
from vlm_recipes.comparison.run_summary import load_run
from vlm_recipes.comparison.run_table import format_summary
from vlm_recipes.comparison.tables import compare_runs, format_comparison
from vlm_recipes.data.preference import PREFERENCE
from vlm_recipes.data.rows import load_split
from vlm_recipes.data.stage_data import load_stage_data
from vlm_recipes.decisions import Environment
from vlm_recipes.errors import DataError
from vlm_recipes.files import read_json
from vlm_recipes.methods.dpo import DPO, DpoSettings
from vlm_recipes.methods.trainer import ConfigInputs
from vlm_recipes.model.build import build_stage_model, detect_family, load_processor
from vlm_recipes.recipes.schema import DataSettings, Stage, TrainingSettings, TrainModes

CPU = Environment(device="cpu", gpu_count=0, bf16_supported=False)
FAMILIES_BY_MODEL = {model: name for name, model in TINY_MODELS.items()}


def test_r5_sft_then_dpo_runs_end_to_end(tmp_path, private_demo_cache, capsys):
    quick = ["--max-steps", "2", "training.per_device_batch_size=4", "data.max_train_samples=8"]
    quick += ["data.max_eval_samples=8", "training.logging_steps=1"]
    code = main(["--recipe", "r5-sft-then-dpo", "--output-dir", str(tmp_path), "--run-name", "t", *quick])
    assert code == 0
    run = tmp_path / "r5-sft-then-dpo" / "t"
    stages = sorted(p for p in run.iterdir() if p.name.startswith("stage-"))
    assert [p.name for p in stages] == ["stage-1-vision-full", "stage-2-llm-lora", "stage-3-llm-dpo"]
    assert all((p / "DONE").is_file() for p in stages)
    dpo = stages[2]
    metrics = read_json(dpo / "metrics.json")
    assert 0.0 <= metrics["eval_reward_accuracy"] <= 1.0 and metrics["eval_reward_margin"] is not None
    assert metrics["steps"] == 2
    # Before step 1, on the same pairs: the reference is the starting policy, so every reward is 0 (the
    # margin exactly, and no pair's chosen above its rejected); the policy's own log-probability margin moved.
    start = metrics["eval_at_start"]
    assert start["eval_reward_margin"] == 0.0 and start["eval_reward_accuracy"] == 0.0
    assert start["eval_logp_margin"] != metrics["eval_logp_margin"]
    # Answers generated from each prompt and scored against its chosen answer, as after an SFT stage.
    assert metrics["eval"]["all"]["rows"] == 8
    assert len((dpo / "predictions.jsonl").read_text().splitlines()) == 8
    report = read_json(dpo / "report.json")
    assert report["data"]["train"] == "demo:preference-train"
    reference = {d["guard"]: d["choice"] for d in report["decisions"]}["dpo-reference"]
    assert reference == "the model with its LoRA adapter switched off"
    audit = report["freeze_audit"]
    assert audit is not None  # frozen roles identical to stage 2's final/, LoRA merged into final/
    provenance = read_json(dpo / "final" / "provenance.json")
    assert "stage-2-llm-lora" in json.dumps(provenance)

    # The comparison shows DPO's reward accuracy and margin beside the generation metrics.
    summary = load_run(run)
    assert summary.value("eval_reward_accuracy") == metrics["eval_reward_accuracy"]
    assert summary.value("eval_reward_margin") == metrics["eval_reward_margin"]
    table = format_comparison(compare_runs([summary]))
    assert "reward acc" in table and f"{metrics['eval_reward_accuracy']:.3f}" in table
    assert "reward acc" in format_summary(run)  # the end-of-run table too, from its start
    assert f"0.000 → {metrics['eval_reward_accuracy']:.3f}" in format_summary(run)
    assert summary.value("eval_reward_accuracy@start") == 0.0 and "reward acc at start" in table

    # The end-of-run summary puts each stage's answers beside the reference, from the predictions files: the
    # DPO stage's preference rows keep the demo rows' ids, so stages 1-2 answered them too.
    printed = capsys.readouterr().out
    assert "Answers on 3 eval row(s) (each stage answers at its end" in printed
    by_stage = [
        {r["id"]: r for r in map(json.loads, (p / "predictions.jsonl").read_text().splitlines())}
        for p in stages
    ]
    rows = side_by_side([("", run)])
    assert len({r.id for r in rows}) == 3 and all(r.id in by_stage[2] for r in rows)
    for row in rows:
        assert row.reference == by_stage[2][row.id]["reference"] and row.reference in printed
        assert row.answers == [
            (name, stage[row.id]["output"])
            for name, stage in zip(["vision-full", "llm-lora", "llm-dpo"], by_stage, strict=True)
        ]
        assert f"{row.id} ({row.task}): {row.prompt}" in printed


@pytest.mark.parametrize("model", list(TINY_MODELS.values()))
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_a_dpo_stage_trains_every_family(tmp_path, model, precision, private_demo_cache):
    """One DPO stage (LoRA on the language model) per family: guards, freeze audit, merged final/, reward
    metrics and generated answers."""
    recipe = write_recipe(
        tmp_path,
        "dpo",
        f"model: {model}\n"
        "stages:\n"
        "  - name: dpo\n"
        "    method: dpo\n"
        "    train: {llm: lora}\n"
        "    data: {train: demo:preference-train, eval: demo:preference-eval, max_train_samples: 8, "
        "max_eval_samples: 4}\n"
        "    evaluation: {max_new_tokens: 4}\n"
        "    training: {per_device_batch_size: 4, learning_rate: 1.0e-3}\n"
        f"    precision: {precision}\n",
    )
    code = main(
        ["--recipe", str(recipe), "--output-dir", str(tmp_path), "--run-name", "t", "--max-steps", "2"]
    )
    assert code == 0
    stage = tmp_path / "dpo" / "t" / "stage-1-dpo"
    metrics, report = read_json(stage / "metrics.json"), read_json(stage / "report.json")
    assert report["family"] == FAMILIES_BY_MODEL[model]
    assert metrics["steps"] == 2 and metrics["eval"]["all"]["rows"] == 4
    assert 0.0 <= metrics["eval_reward_accuracy"] <= 1.0
    audit = report["freeze_audit"]
    assert audit["vision"]["changed"] == 0 and audit["projector"]["changed"] == 0
    assert audit["llm"]["changed"] > 0  # the merged adapter
    guards = {d["guard"]: d["choice"] for d in report["decisions"]}
    assert guards["precision"] == precision and "dtype-boundary" in guards


def _dpo_stage(**training) -> Stage:
    return Stage(
        name="dpo",
        method="dpo",
        settings=DpoSettings(),
        train=TrainModes(llm="lora"),
        data=DataSettings(
            train="demo:preference-train",
            eval="demo:preference-eval",
            max_train_samples=32,
            max_eval_samples=16,
        ),
        training=TrainingSettings(report_to=["none"], save_steps=0, logging_steps=1, **training),
    )


def _dpo_trainer(tmp_path: Path, model_dir: Path, stage: Stage):
    family, _ = detect_family(str(model_dir))
    processor = load_processor(str(model_dir), stage.data, family)
    built = build_stage_model(str(model_dir), stage, "fp32", "cpu", processor=processor)
    data = load_stage_data(stage.data, PREFERENCE, paths=demo_paths(stage.data))
    args = DPO().build_config(ConfigInputs(stage, tmp_path / "checkpoints", "fp32", CPU, has_eval=True))
    return DPO().build_trainer(built, stage, args, data), built


def test_dpo_raises_eval_reward_accuracy(tmp_path, demo_model_dir):
    torch.manual_seed(0)
    # A rate meant for the tiny model (a real model would take ~5e-6 to 5e-5).
    stage = _dpo_stage(max_steps=8, learning_rate=3e-3, per_device_batch_size=8, lr_scheduler="constant")
    trainer, _ = _dpo_trainer(tmp_path, demo_model_dir, stage)
    before = trainer.evaluate()
    trainer.train()
    after = trainer.evaluate()
    # At the start the policy is the reference: every reward is 0, no pair is ranked right.
    assert before["eval_rewards/accuracies"] == 0.0
    assert after["eval_rewards/accuracies"] > before["eval_rewards/accuracies"]
    # The eval margin of a 0.3M-parameter model barely generalizes; on the pairs it trained on, it ranks
    # chosen over rejected.
    seen = trainer.evaluate(trainer.train_dataset)  # TRL names its reward metrics eval_ whatever the prefix
    assert seen["eval_rewards/accuracies"] > 0.5 and seen["eval_rewards/margins"] > 0


def test_lora_reference_is_the_adapter_switched_off(tmp_path, demo_model_dir):
    trainer, built = _dpo_trainer(tmp_path, demo_model_dir, _dpo_stage(max_steps=1))
    assert trainer.ref_model is None
    model = trainer.accelerator.unwrap_model(trainer.model)
    assert list(model.peft_config) == ["default"]  # no "ref" adapter copy either
    # Move the adapter off zero, so that adapter on and off give different answers.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)
    layer = next(m for m in model.modules() if isinstance(m, BaseTunerLayer))
    seen: list[bool] = []
    hook = layer.register_forward_pre_hook(lambda module, args: seen.append(module.disable_adapters))
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    try:
        trainer.compute_loss(trainer.model, batch)
    finally:
        hook.remove()
    assert sorted(seen) == [False, True]  # one policy pass with the adapter, one reference pass without
    assert not layer.disable_adapters  # switched back on after the reference pass


def _weight_bytes(*modules) -> int:
    """Bytes of the distinct tensors (parameters and buffers) the modules hold: a shared one counts once."""
    seen: dict[int, int] = {}
    for module in modules:
        if module is None:
            continue
        for tensor in [*module.parameters(), *module.buffers()]:
            seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return sum(seen.values())


def test_the_lora_reference_holds_no_second_copy_of_the_weights(tmp_path, demo_model_dir):
    """The weights a DPO trainer holds: with LoRA exactly the policy's (base + one adapter); a full
    fine-tune holds the policy and a reference copy, twice as much, which is what this test would see."""
    lora, _ = _dpo_trainer(tmp_path / "lora", demo_model_dir, _dpo_stage(max_steps=1))
    policy = lora.accelerator.unwrap_model(lora.model)
    assert _weight_bytes(policy, lora.ref_model) == _weight_bytes(policy)
    adapters = {n.split(".")[-2] for n, _ in policy.named_parameters() if "lora_" in n}
    assert adapters == {"default"}  # no "ref" adapter copy beside the stage's own

    stage = _dpo_stage(max_steps=1)
    stage.train = TrainModes(projector="full")
    full, _ = _dpo_trainer(tmp_path / "full", demo_model_dir, stage)
    assert full.ref_model is not None
    held = _weight_bytes(full.model, full.ref_model)
    assert held >= 1.9 * _weight_bytes(full.model)


@pytest.mark.parametrize(
    "stage_lines, refusal",
    [
        (
            "    train: {projector: full, llm: lora}\n",
            "mixed.yaml: stages[0].train: method dpo trains llm with LoRA and projector fully",
        ),
        (
            "    train: {llm: lora}\n    training: {loss_positions_only: true}\n",
            "mixed.yaml: stages[0].training.loss_positions_only: is for sft stages",
        ),
    ],
    ids=["lora-beside-full", "loss-positions-only"],
)
def test_dpo_stage_refusals(stage_lines, refusal, tmp_path, capsys, private_demo_cache):
    """Refused when the recipe loads, before anything is written."""
    recipe = write_recipe(
        tmp_path,
        "mixed",
        "model: demo:tiny-qwen2-vl\n"
        "stages:\n"
        "  - name: dpo\n"
        "    method: dpo\n"
        f"{stage_lines}"
        "    data: {train: demo:preference-train, eval: null}\n",
    )
    code = main(["--recipe", str(recipe), "--output-dir", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert refusal in err
    assert not (tmp_path / "runs").exists()


def _write_rows(tmp_path: Path, rows: list[dict]) -> Path:
    Image.new("RGB", (56, 56), (255, 0, 0)).save(tmp_path / "red.png")
    path = tmp_path / "prefs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _row(**changes) -> dict:
    row = {
        "prompt": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}
        ],
        "chosen": [{"role": "assistant", "content": [{"type": "text", "text": "red"}]}],
        "rejected": [{"role": "assistant", "content": [{"type": "text", "text": "blue"}]}],
        "images": ["red.png"],
    }
    row.update(changes)
    return {k: v for k, v in row.items() if v is not None}


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (_row(rejected=None), "prefs.jsonl:line 2: no rejected"),
        (_row(images=["red.png", "red.png"]), "prefs.jsonl:line 2: image count mismatch: 1 image parts"),
        (_row(images=["missing.png"]), "prefs.jsonl:line 2: image not found"),
        (
            _row(chosen=[{"role": "user", "content": [{"type": "text", "text": "red"}]}]),
            "prefs.jsonl:line 2: bad chosen",
        ),
    ],
)
def test_bad_preference_rows_are_named(tmp_path, bad, message):
    path = _write_rows(tmp_path, [_row(), bad])
    with pytest.raises(DataError, match=message.replace(".", r"\.")):
        load_split(str(path), "train", None, row_format=PREFERENCE)


def test_bad_preference_data_exits_2(tmp_path, capsys, private_demo_cache):
    path = _write_rows(tmp_path, [_row(), _row(rejected=None)])
    recipe = write_recipe(
        tmp_path,
        "bad-dpo",
        "model: demo:tiny-qwen2-vl\n"
        "stages:\n"
        "  - name: dpo\n"
        "    method: dpo\n"
        "    train: {llm: lora}\n"
        f"    data: {{train: {path}, eval: null}}\n",
    )
    code = main(["--recipe", str(recipe), "--output-dir", str(tmp_path / "runs"), "--max-steps", "1"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "prefs.jsonl:line 2: no rejected" in err and "Traceback" not in err


@pytest.mark.e2e
def test_a_killed_dpo_stage_resumes_to_the_uninterrupted_result(tmp_path, caplog, private_demo_cache):
    """SIGKILL after step 3 of 4 (checkpoint at step 2), then --resume: the final weights equal an
    uninterrupted run's exactly, having moved far from the start (an equality of unmoved weights would prove
    nothing), and the resumed reference is still the adapter switched off."""
    recipe = write_recipe(
        tmp_path,
        "dpo",
        "model: demo:tiny-qwen2-vl\n"
        "stages:\n"
        "  - name: dpo\n"
        "    method: dpo\n"
        "    train: {llm: lora}\n"
        "    data: {train: demo:preference-train, eval: null, max_train_samples: 16}\n"
        "    training: {per_device_batch_size: 4, save_steps: 2, learning_rate: 1.0e-3}\n",
    )

    def train(name: str, fault: str | None = None):
        return run_train(
            "--recipe", str(recipe), "--output-dir", str(tmp_path), "--run-name", name, fault=fault
        )

    def final_weights(name: str) -> dict[str, torch.Tensor]:
        model = AutoModelForImageTextToText.from_pretrained(tmp_path / "dpo" / name / "stage-1-dpo" / "final")
        return {n: p.detach() for n, p in model.named_parameters()}

    # The killed run is a real process; the uninterrupted run and the resume run in this one (the same
    # entry point, without another interpreter start).
    assert main(["--recipe", str(recipe), "--output-dir", str(tmp_path), "--run-name", "whole"]) == 0
    killed = run_train(
        "--recipe", str(recipe), "--output-dir", str(tmp_path), "--run-name", "killed", fault="stage1:step3"
    )
    assert killed.returncode == -signal.SIGKILL
    run_dir = tmp_path / "dpo" / "killed"
    caplog.set_level(logging.INFO)
    assert main(["--resume", str(run_dir)]) == 0
    assert f"resuming from {run_dir / 'stage-1-dpo' / 'checkpoints' / 'checkpoint-2'}" in caplog.text
    assert "dpo-reference: the model with its LoRA adapter switched off" in caplog.text
    whole, again = final_weights("whole"), final_weights("killed")
    from vlm_recipes.demo.models import ensure_demo_model

    start = AutoModelForImageTextToText.from_pretrained(ensure_demo_model("demo:tiny-qwen2-vl"))
    moved = max((whole[n] - p.detach()).abs().max().item() for n, p in start.named_parameters())
    assert moved > 1e-4, f"the weights did not move ({moved})"
    for name, value in whole.items():
        assert torch.equal(again[name], value), name


# One optimizer step of a DPO stage (LoRA, fp32, no dropout, lr 1e-3) over the same 16 demo pairs: one batch of
# 16, or 2 micro-batches of 8 accumulated. Each pair's sigmoid loss is averaged over the batch, so equal
# micro-batches weigh every pair alike. Adam's first step is lr x g / (|g| + eps): about lr for every element
# whose gradient is well above eps, and noise amplified for the few near it. Measured on a 2-core AMD EPYC
# on demo-v4's pairs: 2 x 8 ends 1.9e-5 from one batch at 1 element of 32,768 (4 x 4: 2.5e-5, also 1 element);
# leaving out half the pairs (a weighting bug) moves 4,855 elements by up to 2.0e-3. On demo-v5's: 2.9e-7, no
# element beyond 1e-5. Bounds: 2e-4 and 0.1 % of the elements beyond 1e-5, each 10x from both (demo-v4's
# floor and the effect). (Adam's step is blind to a uniform scale of the gradient:
# this proves the pairs' weighting, as the SFT test in test_families.py proves the tokens'.)
def test_gradient_accumulation_trains_a_dpo_stage_as_one_batch_does(tmp_path, demo_model_dir):
    stage = (
        "  - name: dpo\n    method: dpo\n    train: {llm: lora}\n    lora: {dropout: 0.0}\n    precision: fp32\n"
        "    data: {train: demo:preference-train, eval: null, max_train_samples: 16}\n"
        "    training: {max_steps: 1, learning_rate: 1.0e-3}\n    evaluation: {generate: false}\n"
    )
    recipe = write_recipe(tmp_path, "dpo-accumulation", f"model: {demo_model_dir}\nstages:\n{stage}")
    common = ["--recipe", str(recipe), "--output-dir", str(tmp_path)]
    assert main([*common, "--run-name", "one", "training.per_device_batch_size=16"]) == 0
    split = ["training.per_device_batch_size=8", "training.gradient_accumulation_steps=2"]
    assert main([*common, "--run-name", "accumulated", *split]) == 0
    adapter = "stage-1-dpo/adapter/adapter_model.safetensors"
    runs = tmp_path / "dpo-accumulation"
    one, accumulated = (load_file(runs / run / adapter) for run in ("one", "accumulated"))
    moved = max(t.abs().max().item() for k, t in one.items() if "lora_B" in k)
    distance, beyond = distance_and_share_beyond(one, accumulated, 1e-5)
    print(f"DPO, 2 x 8 accumulated against one batch of 16: {distance:.2e} ({beyond:.3%}), moved {moved:.2e}")
    assert moved > 1e-4 and distance < 2e-4 and beyond < 1e-3, (distance, beyond, moved)
