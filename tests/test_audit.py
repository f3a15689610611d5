"""The freeze audit: frozen roles come out of a stage bit for bit, and a changed one fails the stage."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from vlm_recipes.families.qwen2_vl import QWEN2_VL
from vlm_recipes.model.audit import FreezeAuditError, audit_freeze
from vlm_recipes.recipe import load_recipe


def saved_copy(source, out, change=None):
    """The model saved again, optionally with one parameter nudged by `change` (a name prefix)."""
    model = AutoModelForImageTextToText.from_pretrained(source, dtype=torch.float32)
    if change:
        name, param = next((n, p) for n, p in model.named_parameters() if n.startswith(change))
        with torch.no_grad():
            param.view(-1)[0] += 1e-3  # one element of one tensor: the smallest change there is
    model.save_pretrained(out)
    AutoProcessor.from_pretrained(source).save_pretrained(out)
    return out


def test_untouched_roles_count_as_identical_and_a_trained_role_as_changed(demo_model_dir, tmp_path):
    stage = load_recipe("r1-llm-only").stages[0]  # vision and projector frozen, llm LoRA
    final = saved_copy(demo_model_dir, tmp_path / "final", change="model.language_model.layers.0")
    audit = audit_freeze(str(demo_model_dir), final, QWEN2_VL, stage, torch.float32)
    assert audit["vision"]["changed"] == 0 and audit["vision"]["identical"] > 0
    assert audit["projector"]["changed"] == 0
    assert audit["llm"]["changed"] == 1


def test_a_frozen_role_that_changed_fails_the_stage(demo_model_dir, tmp_path):
    stage = load_recipe("r1-llm-only").stages[0]
    final = saved_copy(demo_model_dir, tmp_path / "final", change="model.visual.blocks.0")
    with pytest.raises(
        FreezeAuditError, match=r"1 tensor\(s\) of frozen roles changed.*model\.visual\.blocks\.0"
    ):
        audit_freeze(str(demo_model_dir), final, QWEN2_VL, stage, torch.float32)
