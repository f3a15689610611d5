"""On an NVIDIA GPU, the user's command (`train_recipe.py --gpu 0`): every seed recipe and r3-two-stage for
every family train on CUDA in bf16, 4-bit stages on bitsandbytes' CUDA kernels, nothing left on the CPU;
every family's roles meet in any dtypes under CUDA's autocast; a training step makes the host wait for the
GPU only at logging steps; Liger's kernels train every family as torch's layers do, within the noise floor.

Skipped where `nvidia-smi -L` lists no GPU, CI among them: the rest of the suite runs on the CPU on every
machine (tests/conftest.py), so what the GPU changes is tested here alone, in a fresh process that sees it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import GPUS, TINY_MODELS, run_train
from test_dtype_boundaries import MODE_SETS
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


def run_gpu_check(*args: str, sees: str | None = GPUS[0] if GPUS else None) -> dict:
    """tests/gpu_checks.py ARGS in a process that sees GPU `sees` (None: the check picks it with --gpu); the
    JSON line it prints last."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    if sees is not None:
        env["CUDA_VISIBLE_DEVICES"] = sees
    check = Path(__file__).parent / "gpu_checks.py"
    done = subprocess.run(
        [sys.executable, str(check), *args], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("family", list(TINY_MODELS))
def test_roles_of_any_dtypes_meet_under_cuda_autocast(family):
    """Every split of the roles between trained, frozen and LoRA, built and guarded as a stage builds them on
    cuda:0: frozen weights cast to bf16 (but those a trained role computes with), trained ones fp32, every
    tensor on the GPU; a forward under CUDA's autocast, its backward, a forward without autocast and
    generate() all run (tests/gpu_checks.py; `--device cpu` runs the same check on a CPU)."""
    result = run_gpu_check("dtype-boundaries", family)
    assert [c["modes"] for c in result["checked"]] == MODE_SETS, result


MODEL_FORWARD = "the model's forward (transformers)"


def test_a_training_step_makes_the_host_wait_only_at_logging_steps(tmp_path):
    """r1 on the tiny Qwen2-VL, 8 steps, a log every 4th, under torch.cuda.set_sync_debug_mode("warn"):
    between logging steps no synchronising call from our code, callbacks, Trainer, TRL, accelerate (the
    batch's copy to the GPU: pinned and non-blocking), PEFT or bitsandbytes. The model's own forward
    (transformers' modeling code: image grids read on the host, masked_scatter's checks) is counted and
    printed, not bounded: it is not ours to change."""
    result = run_gpu_check("host-syncs", str(tmp_path), GPUS[0], sees=None)
    assert result["exit"] == 0, result
    print(f"syncs by step and asker: {result['syncs_by_step']}\nwhere: {result['where']}")
    logging_steps = set(result["logging_steps"])
    by_step = {int(step): by for step, by in result["syncs_by_step"].items()}
    between = {
        step: {who: n for who, n in by.items() if who != MODEL_FORWARD}
        for step, by in by_step.items()
        if step not in logging_steps
    }
    between = {step: by for step, by in between.items() if by}
    assert not between, f"syncs between logging steps, by step: {between}; where: {result['where']}"


def r1_loss_curve(out: Path, family: str, *settings: str) -> tuple[list[float], dict]:
    """r1's stage (4-bit LoRA) on `family`'s tiny model for 6 steps at a high learning rate, a log each step:
    its loss curve and its decisions."""
    args = ["--recipe", "r1-llm-only", "--gpu", GPUS[0], "--output-dir", str(out), "--run-name", "t"]
    steps = ["--max-steps", "6", "training.logging_steps=1", "training.learning_rate=5e-3"]
    done = run_train(*args, *TINY_RUN, *steps, f"model={TINY_MODELS[family]}", *settings)
    assert done.returncode == 0, done.stderr[-3000:]
    stage = read_json(out / "r1-llm-only" / "t" / "run.json")["stages"][0]
    decisions = {d["guard"]: d for d in read_json(Path(stage["dir"]) / "report.json")["decisions"]}
    metrics = read_json(Path(stage["dir"]) / "metrics.json")
    return [point["loss"] for point in metrics["loss_curve"]], decisions


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="needs liger-kernel installed")
@pytest.mark.parametrize("family", list(TINY_MODELS))
def test_liger_kernels_train_as_torch_layers_do_on_the_gpu(family, tmp_path):
    """r1 for 6 steps with Liger's kernels and without (a family whose types Liger's table lacks: off, skipped
    saying so): every step's loss as near torch's as the noise floor allows, the floor being the same training with each batch of 4 split into 2 micro-batches of 2 (the same
    gradient, its sums in another order: rounding alone), far below what the 6 steps moved the loss."""
    liger, decisions = r1_loss_curve(tmp_path / "on", family, "training.liger_kernels=true")
    # a family whose type and parts Liger's table lacks is off, saying so (tests/test_liger.py checks which)
    if "Liger has no kernels for model type" in decisions["liger-kernels"]["reason"]:
        pytest.skip(decisions["liger-kernels"]["reason"])
    assert decisions["liger-kernels"]["choice"] != "off", decisions["liger-kernels"]
    torch_layers, _ = r1_loss_curve(tmp_path / "off", family, "training.liger_kernels=false")
    split = ("training.per_device_batch_size=2", "training.gradient_accumulation_steps=2")
    floor_run, _ = r1_loss_curve(tmp_path / "floor", family, "training.liger_kernels=false", *split)
    floor = max(abs(a - b) for a, b in zip(torch_layers, floor_run, strict=True))
    apart = max(abs(a - b) for a, b in zip(torch_layers, liger, strict=True))
    moved = abs(torch_layers[0] - torch_layers[-1])
    print(
        f"{family}: moved {moved:.4f}, Liger apart {apart:.2e}, floor {floor:.2e}; {decisions['liger-kernels']['choice']}"
    )
    assert len(torch_layers) == 6 and moved > 0.1, torch_layers
    assert floor < moved / 100, (floor, moved)  # the floor is rounding, not another training
    assert apart <= 10 * floor, (apart, floor, torch_layers, liger)
