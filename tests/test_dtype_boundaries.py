"""The dtype-boundary guard on every family: roles in different dtypes (trained fp32 masters, frozen bf16,
LoRA adapters over a bf16 base) meet in one forward with autocast on (training), off (a user's own
generate()), and in generate(); the seeds' failures it exists for are reproduced without it."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import model_inputs, single_image_demo_rows

from vlm_recipes.decisions import Decision, Environment
from vlm_recipes.families.base import DtypeBoundary
from vlm_recipes.model.boundaries import decide_dtype_boundaries, install_dtype_boundaries
from vlm_recipes.model.build import build_stage_model, load_processor
from vlm_recipes.recipes.schema import DataSettings, Stage, TrainingSettings, TrainModes
from vlm_recipes.stages import run

CPU = Environment("cpu", 0, bf16_supported=True)
ROLES = ("vision", "projector", "llm")
# every way to split the roles between trained (fp32 masters) and frozen (bf16), and LoRA everywhere
MODE_SETS = [
    dict(zip(ROLES, modes, strict=True)) for modes in itertools.product(("frozen", "full"), repeat=3)
]
MODE_SETS.append(dict.fromkeys(ROLES, "lora"))


def stage_with(modes: dict[str, str]) -> Stage:
    return Stage(
        name="boundaries",
        train=TrainModes(**modes),
        precision="bf16",
        data=DataSettings(max_pixels=200704),
        training=TrainingSettings(report_to=["none"]),
    )


def guarded_bf16_model(model_dir, processor, modes: dict[str, str]):
    stage = stage_with(modes)
    built = build_stage_model(str(model_dir), stage, "bf16", "cpu", processor=processor)
    run.apply_guards(built, stage, "bf16", CPU)
    return built


@pytest.fixture(scope="module")
def batch_of(tiny_family):
    family, model_dir = tiny_family
    processor = load_processor(str(model_dir), DataSettings(max_pixels=200704), family)
    inputs = model_inputs(processor, single_image_demo_rows(2))
    return processor, inputs


def test_roles_of_any_dtypes_meet_with_autocast_on_and_off_and_in_generate(tiny_family, batch_of):
    family, model_dir = tiny_family
    processor, inputs = batch_of
    labels = inputs["input_ids"].clone()
    for modes in MODE_SETS:
        model = guarded_bf16_model(model_dir, processor, modes).model
        with torch.autocast("cpu", dtype=torch.bfloat16):  # as Trainer runs it
            loss = model(**inputs, labels=labels).loss
        assert torch.isfinite(loss), modes
        if any(mode != "frozen" for mode in modes.values()):
            loss.backward()
        model.eval()
        with torch.no_grad():  # no autocast: each crossing alone decides
            assert torch.isfinite(model(**inputs, labels=labels).loss), modes
            out = model.generate(**inputs, max_new_tokens=2, do_sample=False)
        assert out.shape[1] == inputs["input_ids"].shape[1] + 2, modes


@pytest.mark.parametrize(
    ("model", "modes", "left_out", "error"),
    [
        # r2's stage on SmolVLM: fp32 image features scattered into bf16 embeddings
        ("smolvlm", {"vision": "full", "projector": "full"}, "boundaries", "masked_scatter"),
        # r2's stage on LLaVA-OneVision: the tower's unread post_layernorm, frozen in bf16, fed by fp32 layers
        ("llava-onevision", {"vision": "full", "projector": "full"}, "trained-role dtype", "mixed dtype"),
        # a trained tower feeding a frozen projector that starts with a norm (Qwen's merger), no autocast
        ("qwen2-vl", {"vision": "full"}, "boundaries", "mixed dtype"),
    ],
)
def test_the_failures_the_guard_exists_for_without_it(model, modes, left_out, error, monkeypatch):
    from conftest import TINY_MODELS

    from vlm_recipes.demo.models import DEMO_MODELS, ensure_demo_model

    family = DEMO_MODELS[TINY_MODELS[model]].family
    model_dir = ensure_demo_model(TINY_MODELS[model])
    processor = load_processor(str(model_dir), DataSettings(max_pixels=200704), family)
    inputs = model_inputs(processor, single_image_demo_rows(2))
    stage = stage_with({"vision": "frozen", "projector": "frozen", "llm": "frozen", **modes})
    built = build_stage_model(str(model_dir), stage, "bf16", "cpu", processor=processor)
    if left_out == "boundaries":
        monkeypatch.setattr(run, "install_dtype_boundaries", lambda *a: Decision("dtype-boundary", "off", ""))
    else:
        built.frozen_in_trained_roles = []
    run.apply_guards(built, stage, "bf16", CPU)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=model != "qwen2-vl")
    with pytest.raises(RuntimeError, match=error), torch.no_grad(), autocast:
        built.model(**inputs)
    # and with the guard, the same forward runs
    monkeypatch.undo()
    guarded = guarded_bf16_model(model_dir, processor, stage.train.__dict__).model
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=model != "qwen2-vl"):
        assert torch.isfinite(guarded(**inputs).logits).all()


def test_the_decision_names_each_crossing_its_dtype_and_why():
    boundaries = [
        DtypeBoundary("vision tower -> projector", "model.visual.merger"),
        DtypeBoundary("image features -> language model", "model.language_model", inputs=("inputs_embeds",)),
    ]
    mixed = decide_dtype_boundaries(
        boundaries, [torch.float32, torch.bfloat16], {"vision": "fp32", "projector": "fp32", "llm": "bf16"}
    )
    assert mixed.guard == "dtype-boundary"
    assert "vision tower -> projector in fp32; image features -> language model in bf16" in mixed.reason
    assert "one dtype must win" in mixed.reason
    same = decide_dtype_boundaries(boundaries, [torch.bfloat16] * 2, dict.fromkeys(ROLES, "bf16"))
    assert "casts are no-ops" in same.reason


def test_a_boundary_naming_a_module_the_model_lacks_is_refused(demo_model_dir):
    from dataclasses import replace

    from vlm_recipes.errors import GuardError
    from vlm_recipes.families.qwen2_vl import QWEN2_VL

    built = build_stage_model(str(demo_model_dir), stage_with(dict.fromkeys(ROLES, "frozen")), "bf16", "cpu")
    wrong = replace(QWEN2_VL, role_prefixes={**QWEN2_VL.role_prefixes, "projector": ("model.visual.mergr",)})
    with pytest.raises(GuardError, match="no module `model.visual.mergr`"):
        install_dtype_boundaries(built.model, wrong)
