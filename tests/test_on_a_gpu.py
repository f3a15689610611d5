"""On an NVIDIA GPU, the user's command (`train_recipe.py --gpu 0`): every seed recipe and r3-two-stage for
every family train on CUDA in bf16, 4-bit stages on bitsandbytes' CUDA kernels, nothing left on the CPU;
Liger's kernels, where installed, train as torch's layers do.

Skipped where `nvidia-smi -L` lists no GPU, CI among them: the rest of the suite runs on the CPU on every
machine (tests/conftest.py), so what the GPU changes is tested here alone, in a fresh process that sees it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from conftest import GPUS, TINY_MODELS, run_train
from test_families import TINY_RUN

from vlm_recipes.files import read_json

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not GPUS, reason="needs an NVIDIA GPU (`nvidia-smi -L` lists none)"),
]

RECIPES = ("r1-llm-only", "r2-vision-only", "r3-two-stage", "r4-joint", "r5-sft-then-dpo")


def assert_trained_on_the_gpu(output_dir: Path, recipe: str) -> None:
    """Every stage finished in bf16 with all its tensors on cuda:0; a 4-bit stage ran bitsandbytes on CUDA."""
    manifest = read_json(output_dir / recipe / "t" / "run.json")
    assert manifest["status"] == "finished"
    for stage, recipe_stage in zip(manifest["stages"], manifest["resolved_recipe"]["stages"], strict=True):
        report = read_json(Path(stage["dir"]) / "report.json")
        decisions = {d["guard"]: d for d in report["decisions"]}
        assert decisions["precision"]["choice"] == "bf16", decisions["precision"]
        assert decisions["placement"]["choice"] == "all tensors on cuda:0", decisions["placement"]
        assert decisions["parallelism"]["choice"] == "single device", "one GPU: never DataParallel"
        assert decisions["host-memory"]["choice"] == "left to the allocator", "tensors live on the GPU"
        if recipe_stage["quantization"]["mode"] == "4bit":
            assert decisions["quantization-backend"]["reason"].endswith("run on cuda")
        assert stage["steps"] == 2 and stage["eval_loss"] is not None and stage["train_loss"] > 0


@pytest.mark.parametrize("recipe", RECIPES)
def test_seed_recipe_trains_on_the_gpu(recipe, tmp_path):
    done = run_train(
        "--recipe", recipe, "--gpu", GPUS[0], "--output-dir", str(tmp_path), "--run-name", "t", *TINY_RUN
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert_trained_on_the_gpu(tmp_path, recipe)


@pytest.mark.parametrize("family", [name for name in TINY_MODELS if name != "qwen2-vl"])
def test_every_family_trains_r3_on_the_gpu(family, tmp_path):
    args = ["--recipe", "r3-two-stage", "--gpu", GPUS[0], "--output-dir", str(tmp_path), "--run-name", "t"]
    done = run_train(*args, *TINY_RUN, f"model={TINY_MODELS[family]}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert_trained_on_the_gpu(tmp_path, "r3-two-stage")


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="needs liger-kernel installed")
def test_liger_kernels_train_as_torch_layers_do_on_the_gpu(tmp_path):
    """r1 (4-bit LoRA) for 6 steps with Liger's layer kernels and without: the same loss at every step up to
    rounding, far below what the 6 steps moved it. On Qwen3.5, which Liger 0.8.5 patches under transformers
    5.24 (it cannot import its Qwen2-VL patch there: speedups/liger.py)."""
    curves, eval_losses = {}, {}
    for liger in ("false", "true"):
        out = tmp_path / liger
        steps = ["--max-steps", "6", "training.logging_steps=1", "training.learning_rate=5e-3"]
        args = ["--recipe", "r1-llm-only", "--gpu", GPUS[0], "--output-dir", str(out), "--run-name", "t"]
        model = f"model={TINY_MODELS['qwen3.5']}"
        done = run_train(*args, *TINY_RUN, *steps, model, f"training.liger_kernels={liger}")
        assert done.returncode == 0, done.stderr[-3000:]
        stage = read_json(out / "r1-llm-only" / "t" / "run.json")["stages"][0]
        decisions = {d["guard"]: d for d in read_json(Path(stage["dir"]) / "report.json")["decisions"]}
        assert (decisions.get("liger-kernels", {}).get("choice", "off") != "off") == (liger == "true"), (
            decisions
        )
        metrics = read_json(Path(stage["dir"]) / "metrics.json")
        curves[liger] = [point["loss"] for point in metrics["loss_curve"]]
        eval_losses[liger] = stage["eval_loss"]
    moved = abs(curves["false"][0] - curves["false"][-1])
    apart = max(abs(a - b) for a, b in zip(curves["false"], curves["true"], strict=True))
    print(f"liger vs torch: loss curves {curves}, eval {eval_losses}; moved {moved:.4f}, apart {apart:.5f}")
    assert len(curves["false"]) == 6 and moved > 0.1, curves
    # moved / 20: a first bound, not yet set from a measured noise floor (this test has not run on a GPU
    # yet); its print is where the first GPU run's floor (the same run twice without Liger) is to be read
    assert apart < moved / 20, (apart, moved)
    assert abs(eval_losses["true"] - eval_losses["false"]) < moved / 20, eval_losses
