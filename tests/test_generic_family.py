"""The generic role finder (families/generic.py): on every family's models it finds the roles the family
module writes by hand, and it refuses, saying what is missing, what it cannot tell."""

from __future__ import annotations

import runpy

import pytest
import torch
from conftest import REPO
from test_families import PUBLISHED
from torch import nn
from transformers import AutoConfig

from vlm_recipes.errors import BadInput
from vlm_recipes.families import FAMILIES, family_for_model_type
from vlm_recipes.families.generic import RolesNotFound, build_on_meta, find_roles, roles_of_config
from vlm_recipes.families.generic_table import END, START, markdown_table, table_in, type_rows

# Where the finder and a family module may rightly disagree, by family name: {parameter prefix: why}.
# None today: every family's every parameter gets the family's role.
KNOWN_DIFFERENCES: dict[str, dict[str, str]] = {}


def assert_same_roles_as_the_family(family, model: nn.Module) -> None:
    found = find_roles(model)
    assert found.unassigned == (), found.unassigned[:5]
    known = KNOWN_DIFFERENCES.get(family.name, {})
    differ = [
        f"{name}: family {family.role_of(name)}, generic {found.role_of(name)}"
        for name, _ in model.named_parameters()
        if family.role_of(name) != found.role_of(name) and not name.startswith(tuple(known))
    ]
    assert not differ, differ[:10]
    assert found.lm_head_prefixes == family.lm_head_prefixes
    assert found.lora_targets["llm"], "the language model's linear layers"
    assert sum(found.parameters.values()) == sum(p.numel() for p in model.parameters())


def test_generic_roles_equal_each_familys_on_its_tiny_model(tiny_family):
    family, model_dir = tiny_family
    model = build_on_meta(AutoConfig.from_pretrained(model_dir))
    assert_same_roles_as_the_family(family, model)


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_generic_roles_equal_each_familys_on_its_published_dimensions(name):
    """The published configs (real shapes; Gemma 4 E4B with its audio tower) built on meta."""
    fields = dict(PUBLISHED[name][0])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    assert_same_roles_as_the_family(family_for_model_type(config.model_type), build_on_meta(config))


def test_qwen2_vl_merger_is_the_projector_though_it_sits_inside_the_tower():
    found = roles_of_config(AutoConfig.for_model("qwen2_vl"))
    assert found.role_prefixes == {
        "vision": ("model.visual",),
        "projector": ("model.visual.merger",),
        "llm": ("model.language_model", "lm_head"),
    }
    assert found.role_of("model.visual.merger.mlp.0.weight") == "projector"
    assert found.role_of("model.visual.blocks.0.attn.qkv.weight") == "vision"
    assert {"q_proj", "o_proj", "down_proj"} <= set(found.lora_targets["llm"])
    assert "qkv" in found.lora_targets["vision"]


def test_a_bare_parameter_of_the_module_holding_the_tower_is_the_projectors():
    """LLaVA-NeXT's image_newline ends each row of tiles: between the tower and the language model."""
    found = roles_of_config(AutoConfig.for_model("llava_next"))
    assert found.role_of("model.image_newline") == "projector"
    assert found.unassigned == ()


def test_encoder_decoder_and_text_only_models_are_refused_with_the_reason():
    with pytest.raises(RolesNotFound, match="^encoder-decoder: ") as refused:
        roles_of_config(AutoConfig.for_model("florence2"))
    assert isinstance(refused.value, BadInput), "the CLI prints it without a traceback"
    with pytest.raises(RolesNotFound, match="^no vision part: "):
        roles_of_config(AutoConfig.for_model("mistral4"))


def test_a_model_without_a_projector_is_refused_naming_what_was_looked_for():
    """BLIP's text decoder cross-attends to the tower's output: nothing projects it into the text."""
    with pytest.raises(RolesNotFound) as refused:
        roles_of_config(AutoConfig.for_model("blip"))
    message = str(refused.value)
    assert message.startswith("roles not found: no projector: none of multi_modal_projector,")
    assert "families/<name>.py" in message
    assert refused.value.short == "roles not found: no projector"


def test_a_tower_under_an_unknown_name_is_found_by_its_class_name_or_refused_naming_the_names_tried():
    model = build_on_meta(AutoConfig.for_model("qwen2_vl"))
    inner = model.model
    inner.eyes = inner.visual  # Qwen2VisionTransformerPretrainedModel under a name no list holds
    del inner.visual
    found = find_roles(model)
    assert found.role_prefixes["vision"] == ("model.eyes",)
    assert found.role_prefixes["projector"] == ("model.eyes.merger",)
    del inner.eyes
    with pytest.raises(RolesNotFound) as refused:
        find_roles(model)
    assert str(refused.value).startswith(
        "roles not found: no vision tower: none of vision_tower, visual, vision_model,"
    )
    assert "and no module class named *Vision*; a family module (families/<name>.py) would name it" in str(
        refused.value
    )


def test_unassigned_parameters_refuse_the_model_naming_them():
    """Janus' image-generation VQ-VAE is no role of an image-to-text model."""
    found = roles_of_config(AutoConfig.for_model("janus"))
    assert any(name.startswith("model.vqmodel.") for name in found.unassigned)
    assert found.refusal.startswith(f"{len(found.unassigned)} parameters outside every role (model.vqmodel.")


def test_meta_models_hold_no_memory():
    model = build_on_meta(AutoConfig.for_model("qwen2_vl"))
    assert {p.device for p in model.parameters()} == {torch.device("meta")}


# ---------------------------------------------------------------------------------------------- the table


def test_the_doc_table_is_what_the_finder_gives():
    """docs/results/model-types.md's table of every image-text-to-text type equals the one built now: all ~100
    types on meta, ~20 s on 2 cores (scripts/vlm_types_table.py --check does the same). The table names the
    transformers version it was made with; under another the types themselves differ, and the test says so
    rather than fail."""
    import transformers

    document = (REPO / "docs" / "results" / "model-types.md").read_text()
    written = table_in(document)
    if not written.startswith(f"transformers {transformers.__version__}:"):
        pytest.skip(f"the table was made with {written.split(':')[0]}; run python scripts/vlm_types_table.py")
    rows = type_rows()
    assert {row.family for row in rows if row.family} == {family.name for family in FAMILIES}
    assert written == markdown_table(rows), "stale: run python scripts/vlm_types_table.py"


def test_the_script_writes_the_table_and_check_fails_on_a_stale_one(tmp_path, monkeypatch):
    script = runpy.run_path(str(REPO / "scripts" / "vlm_types_table.py"))
    main = script["main"]
    few = ["llava", "florence2"]
    monkeypatch.setitem(main.__globals__, "type_rows", lambda: type_rows(few))
    doc = tmp_path / "model-types.md"
    doc.write_text(f"# Families\n\n{START}\nold\n{END}\n\nafter\n")
    assert main(["--check", "--doc", str(doc)]) == 1
    assert main(["--doc", str(doc)]) == 0
    assert main(["--check", "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith(f"# Families\n\n{START}\ntransformers ") and text.endswith(f"{END}\n\nafter\n")
    assert (
        "| `florence2` |  | refused: encoder-decoder: a decoder cross-attending to an encoder writes" in text
    )
    assert "Roles found: 1; refused: encoder-decoder 1." in text
