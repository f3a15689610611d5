"""On an NVIDIA GPU, the user's command (`train_recipe.py --gpu 0`): every seed recipe and r3-two-stage for
every family train on CUDA in bf16, 4-bit stages on bitsandbytes' CUDA kernels, nothing left on the CPU.

Skipped where `nvidia-smi -L` lists no GPU, CI among them: the rest of the suite runs on the CPU on every
machine (tests/conftest.py), so what the GPU changes is tested here alone, in a fresh process that sees it."""

from __future__ import annotations

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
