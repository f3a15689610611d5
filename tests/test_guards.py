"""Guards: pure decisions on fake environments, and the failures they exist for, reproduced on CPU."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from conftest import REPO, demo_paths, model_inputs
from torch import nn
from transformers import (
    AutoModelForImageTextToText,
    BitsAndBytesConfig,
    Qwen2VLForConditionalGeneration,
    Trainer,
)
from trl import SFTTrainer

from vlm_recipes.data.stage_data import load_stage_data
from vlm_recipes.decisions import Environment
from vlm_recipes.errors import GuardError
from vlm_recipes.families.qwen2_vl import QWEN2_VL
from vlm_recipes.methods.sft import SFT
from vlm_recipes.methods.trainer import ConfigInputs
from vlm_recipes.model.build import build_stage_model
from vlm_recipes.model.guards import (
    cast_frozen_to_compute,
    check_precision_agrees,
    decide_parallelism,
    decide_precision,
    dtype_histogram,
    place_tensors,
    verify_quantization_scope,
)
from vlm_recipes.recipe import load_recipe
from vlm_recipes.stages.run import apply_guards

CPU = Environment("cpu", 0, bf16_supported=True)
CPU_NO_BF16 = Environment("cpu", 0, bf16_supported=False)
H100 = Environment("cuda", 1, bf16_supported=True, gpu_name="H100")
TWO_H100 = Environment("cuda", 2, bf16_supported=True, gpu_name="H100")
T4 = Environment("cuda", 1, bf16_supported=False, gpu_name="Tesla T4")


@pytest.mark.parametrize(
    ("requested", "env", "quantized", "choice", "reason"),
    [
        ("auto", CPU, False, "bf16", "CPU has native bf16"),
        ("auto", CPU_NO_BF16, False, "fp32", "CPU without native bf16"),
        ("auto", H100, False, "bf16", "GPU supports bf16"),
        ("auto", H100, True, "bf16", "quantized weights compute in bf16"),
        ("auto", T4, False, "fp16", "GPU does not support bf16"),
        ("auto", T4, True, "fp16", "GPU does not support bf16"),
        ("fp32", H100, False, "fp32", "set in the recipe"),
        ("fp16", H100, True, "fp16", "set in the recipe"),
        ("bf16", CPU_NO_BF16, False, "bf16", "set in the recipe"),
    ],
)
def test_precision_decision_table(requested, env, quantized, choice, reason):
    decision = decide_precision(requested, env, quantized)
    assert decision.choice == choice and reason in decision.reason


@pytest.mark.parametrize(
    ("requested", "env", "message"),
    [
        ("fp16", CPU, "fp16 was requested but this machine has no GPU"),
        ("bf16", T4, "Tesla T4 does not support it"),
    ],
)
def test_precision_contradiction_fails_before_loading(requested, env, message):
    with pytest.raises(GuardError, match=message):
        decide_precision(requested, env, quantized=False)


@pytest.fixture(scope="module")
def vision_stage():
    return load_recipe("r2-vision-only", ["data.max_train_samples=8", "data.max_eval_samples=4"]).stages[0]


def test_precision_reads_real_param_dtypes_not_model_dtype(demo_model_dir, vision_stage):
    built = build_stage_model(str(demo_model_dir), vision_stage, "bf16", "cpu")
    # model.dtype is the first parameter's: the trainable fp32 patch embedding, not the bf16 majority.
    assert built.model.dtype == torch.float32
    hist = dtype_histogram(built.model)
    assert hist["frozen"] == {"bf16": hist["frozen"]["bf16"]} and hist["trainable"] == {"fp32": 31}
    assert "Trainer bf16=True" in str(check_precision_agrees("bf16", built.model))


def test_fp16_training_of_fp16_weights_is_refused(demo_model_dir, vision_stage):
    stage = load_recipe("r2-vision-only", ["training.trainable_dtype=compute"]).stages[0]
    built = build_stage_model(str(demo_model_dir), stage, "fp16", "cpu")
    with pytest.raises(GuardError, match="set training.trainable_dtype: fp32"):
        check_precision_agrees("fp16", built.model)


# --- parallelism ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory, private_demo_cache) -> Path:
    """A stage-1 final/ to build stage-2 models from."""
    from vlm_recipes.cli.train import main

    out = tmp_path_factory.mktemp("runs")
    assert (
        main(
            [
                "--recipe",
                "r2-vision-only",
                "--output-dir",
                str(out),
                "--run-name",
                "ckpt",
                "--max-steps",
                "2",
                "data.max_eval_samples=4",
            ]
        )
        == 0
    )
    return out / "r2-vision-only" / "ckpt" / "stage-1-vision-full" / "final"


def _args_seeing_two_gpus(stage, tmp_path):
    args = SFT().build_config(ConfigInputs(stage, tmp_path, "fp32", CPU, has_eval=False))
    assert args.n_gpu == 0  # device setup runs here, on CPU
    args._n_gpu = 2  # what Trainer computes when one process sees two GPUs
    return args


@pytest.mark.parametrize("source", ["base", "checkpoint"])
def test_faked_two_gpus_never_dataparallel(source, demo_model_dir, checkpoint_dir, vision_stage, tmp_path):
    path = demo_model_dir if source == "base" else checkpoint_dir
    built = build_stage_model(str(path), vision_stage, "fp32", "cpu")
    data = load_stage_data(vision_stage.data, paths=demo_paths(vision_stage.data))

    trainer = SFT().build_trainer(
        built, vision_stage, _args_seeing_two_gpus(vision_stage, tmp_path / "a"), data
    )
    assert trainer.args.n_gpu == 1
    assert not isinstance(trainer._wrap_model(trainer.model), nn.DataParallel)

    # The same setup without the guard: Trainer wraps the model in DataParallel, and TRL's SFTTrainer
    # (1.16) refuses to start at all.
    plain = Trainer(model=built.model, args=_args_seeing_two_gpus(vision_stage, tmp_path / "b"))
    assert isinstance(plain._wrap_model(plain.model), nn.DataParallel)
    with pytest.raises(ValueError, match="DataParallel"):
        SFTTrainer(
            model=built.model,
            args=_args_seeing_two_gpus(vision_stage, tmp_path / "c"),
            train_dataset=data.train,
            processing_class=built.processor,
        )


def test_parallelism_decision_names_the_risk():
    assert "Trainer would wrap the model in DataParallel" in decide_parallelism(TWO_H100).reason
    assert decide_parallelism(H100).choice == "single device"


# --- dtypes ----------------------------------------------------------------------------------


def _forward_in_worker_thread(model, processor, rows) -> dict:
    """A forward pass in a fresh thread without autocast: what DataParallel's replicas run."""
    inputs = model_inputs(processor, rows)
    result = {}

    def forward():
        try:
            result["loss"] = model(**inputs, labels=inputs["input_ids"]).loss
        except RuntimeError as exc:
            result["error"] = str(exc)

    thread = threading.Thread(target=forward)
    thread.start()
    thread.join()
    return result


def test_stage2_forward_without_autocast_fails_with_fp32_frozen_modules_and_passes_guarded(checkpoint_dir):
    """The seeds' failure: `expected mat1 and mat2 to have the same dtype, float != BFloat16`.

    Frozen modules left in fp32 (norms saved or upcast in fp32) feed fp32 activations into bf16 layers;
    inside autocast that is hidden, in a DataParallel thread it crashes. Guard 3 casts them back."""
    stage = load_recipe("r3-two-stage").stages[1]
    built = build_stage_model(str(checkpoint_dir), stage, "bf16", "cpu")
    rows = list(load_stage_data(stage.data, paths=demo_paths(stage.data)).train.select(range(2)))
    for name, param in built.model.named_parameters():
        if "norm" in name and not param.requires_grad:
            param.data = param.data.float()

    unguarded = _forward_in_worker_thread(built.model, built.processor, rows)
    assert "same dtype" in unguarded.get("error", "")

    decision = cast_frozen_to_compute(built.model, torch.bfloat16)
    assert "tensors cast" in decision.reason and not decision.reason.startswith("0 ")
    guarded = _forward_in_worker_thread(built.model, built.processor, rows)
    assert "error" not in guarded and torch.isfinite(guarded["loss"])


def test_model_declared_fp32_modules_stay_fp32(demo_model_dir, monkeypatch):
    monkeypatch.setattr(Qwen2VLForConditionalGeneration, "_keep_in_fp32_modules_strict", ["lm_head"])
    stage = load_recipe("r1-llm-only").stages[0]
    built = build_stage_model(str(demo_model_dir), stage, "bf16", "cpu")
    decisions = apply_guards(built, stage, "bf16", CPU)
    params = dict(built.model.named_parameters())
    assert params["base_model.model.lm_head.weight"].dtype == torch.float32
    frozen = [
        p for n, p in params.items() if not p.requires_grad and p.is_floating_point() and "lm_head" not in n
    ]
    assert {p.dtype for p in frozen} == {torch.bfloat16}
    assert {p.dtype for p in params.values() if p.requires_grad} == {torch.float32}
    assert any("1 kept fp32 (lm_head)" in d.reason for d in decisions)


# --- quantization scope ----------------------------------------------------------------------


def test_quantized_skipped_part_is_caught(demo_model_dir):
    # A skip list that misses the vision tower (as `["visual"]` did): the tower gets quantized.
    config = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16, llm_int8_skip_modules=["lm_head"]
    )
    model = AutoModelForImageTextToText.from_pretrained(
        demo_model_dir, quantization_config=config, dtype=torch.bfloat16
    )
    with pytest.raises(GuardError, match="skip_roles were quantized anyway, e.g. model.visual"):
        verify_quantization_scope(model, QWEN2_VL, "4bit", ["vision", "projector", "lm_head"])


# --- placement -------------------------------------------------------------------------------


class ClippableLinear(nn.Module):
    """Gemma-style: clip bounds are buffers made with torch.tensor in __init__, so they stay on CPU
    when the weights are materialised elsewhere."""

    def __init__(self, device):
        super().__init__()
        self.linear = nn.Linear(4, 4, device=device)
        self.register_buffer("clip_max", torch.tensor(6.0))


def test_buffer_created_on_cpu_follows_its_module_parameters():
    model = nn.Sequential(ClippableLinear(device="meta"))  # `meta` stands in for the GPU on a CPU machine
    assert model[0].clip_max.device.type == "cpu"
    decision = place_tensors(model)
    assert model[0].clip_max.device.type == "meta"
    assert "moved 1 stranded: 0.clip_max" in decision.reason


def test_weights_never_loaded_are_an_error():
    model = nn.Sequential(ClippableLinear(device="cpu"))
    model[0].linear.weight = nn.Parameter(torch.empty(4, 4, device="meta"))
    with pytest.raises(GuardError, match="still on meta"):
        place_tensors(model, "cpu")


def test_zero_rotary_frequencies_are_an_error(demo_model_dir):
    model = AutoModelForImageTextToText.from_pretrained(demo_model_dir)
    model.model.language_model.rotary_emb.inv_freq.zero_()
    with pytest.raises(GuardError, match="rotary frequencies .*inv_freq"):
        place_tensors(model, "cpu")


# --- inspect ---------------------------------------------------------------------------------


def test_inspect_checkpoint_shows_per_role_dtypes_of_a_4bit_load(checkpoint_dir):
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "inspect_checkpoint.py"),
            str(checkpoint_dir),
            "--quantization",
            "4bit",
            "--precision",
            "bf16",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line for line in result.stdout.splitlines() if line.split()}
    assert "bf16" in rows["vision"] and "uint8" not in rows["vision"]
    assert "bf16" in rows["projector"] and "uint8" not in rows["projector"]
    assert "uint8" in rows["llm"]
    assert "uint8" not in rows["lm_head"]
    assert "DataParallel risk: no" in result.stdout
    assert "quantization: 4bit" in result.stdout


def test_qlora_adapters_stay_fp32_although_trl_casts_them_to_bf16(demo_model_dir, tmp_path):
    stage = load_recipe("r1-llm-only", ["data.max_train_samples=8", "data.max_eval_samples=4"]).stages[0]
    data = load_stage_data(stage.data, paths=demo_paths(stage.data))

    def lora_dtypes(model):
        return {p.dtype for n, p in model.named_parameters() if "lora_" in n}

    plain = build_stage_model(str(demo_model_dir), stage, "bf16", "cpu")
    SFTTrainer(
        model=plain.model,
        args=SFT().build_config(ConfigInputs(stage, tmp_path / "a", "bf16", CPU, has_eval=False)),
        train_dataset=data.train,
        processing_class=plain.processor,
    )
    assert lora_dtypes(plain.model) == {torch.bfloat16}  # TRL's QLoRA choice, without the guard

    built = build_stage_model(str(demo_model_dir), stage, "bf16", "cpu")
    decisions = []
    trainer = SFT().build_trainer(
        built,
        stage,
        SFT().build_config(ConfigInputs(stage, tmp_path / "b", "bf16", CPU, False)),
        data,
        decisions,
    )
    assert lora_dtypes(trainer.model) == {torch.float32}
    assert "were bf16" in decisions[-1].reason


def test_frozen_buffers_follow_their_module_and_rotary_frequencies_stay_fp32(demo_model_dir):
    model = AutoModelForImageTextToText.from_pretrained(demo_model_dir)  # fp32 checkpoint
    model.requires_grad_(False)
    norm = model.model.language_model.norm
    norm.register_buffer("scale", torch.ones(1))  # a float buffer beside a frozen weight
    cast_frozen_to_compute(model, torch.bfloat16)
    assert norm.weight.dtype == torch.bfloat16 and norm.scale.dtype == torch.bfloat16
    # A module without parameters keeps its buffers: rotary frequencies in bf16 would blur positions.
    assert model.model.language_model.rotary_emb.inv_freq.dtype == torch.float32


def _train_step_after_eval_pass(model, processor, rows):
    inputs = model_inputs(processor, rows)
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(**inputs)  # an eval pass
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**inputs, labels=inputs["input_ids"]).loss
    loss.backward()


def test_cpu_4bit_training_survives_an_eval_pass(demo_model_dir):
    """bitsandbytes repacks 4-bit weights for CPU inference in place (AVX512-BF16 CPUs) and the next
    training step fails; the guard keeps the weights trainable."""
    stage = load_recipe("r1-llm-only").stages[0]
    rows = list(load_stage_data(stage.data, paths=demo_paths(stage.data)).train.select(range(2)))

    unguarded = build_stage_model(str(demo_model_dir), stage, "bf16", "cpu")
    repacks = any(getattr(m, "support_avx512bf16_for_cpu", False) for m in unguarded.model.modules())
    if repacks:  # only CPUs with native bf16 take bitsandbytes' repacking path
        with pytest.raises(RuntimeError, match="in-place operation"):
            _train_step_after_eval_pass(unguarded.model, unguarded.processor, rows)

    built = build_stage_model(str(demo_model_dir), stage, "bf16", "cpu")
    decisions = apply_guards(built, stage, "bf16", CPU)
    assert any(d.guard == "cpu-4bit" for d in decisions) == repacks
    _train_step_after_eval_pass(built.model, built.processor, rows)
