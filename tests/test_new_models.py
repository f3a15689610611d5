"""The model types no family module names, trained through the generic family (families/generic_family.py):
each one's tiny offline build (demo/tiny/: the published processor and tokenizer classes, special tokens and
chat template, random weights), the published checkpoint it mirrors built on the meta device, and the seed
recipes end to end with the freeze audit, in bf16 and fp32. Which types these are, the registry says: every
demo model whose type no family names (a type a family module takes over leaves for the family tests)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import REPO, demo_split
from test_families import TINY_RUN, assert_stage_trained_its_roles
from test_generic_training import demo_rows
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

from vlm_recipes.cli.train import main
from vlm_recipes.data.collate import VideoCollator
from vlm_recipes.families import FAMILIES, family_for_config
from vlm_recipes.families.generic import roles_of_config
from vlm_recipes.families.generic_family import GenericFamily
from vlm_recipes.files import read_json
from vlm_recipes.methods.sft import answers_by_prefix
from vlm_recipes.model.build import load_processor
from vlm_recipes.recipes.schema import DataSettings


@dataclass(frozen=True)
class NewModel:
    demo_id: str
    model_type: str
    processor: str  # the published checkpoint's processor class
    published: Path  # tests/published/<name>.json: the checkpoint's config
    answer_labels: str  # what the loss reads of an answer: "{answer}" and the tokens around it


# What the loss reads of an answer on the published template, where it is not "{answer}<|im_end|>\n"
ANSWER_LABELS = {
    "molmo2": "{answer}<|im_end|>",
    "kimi_k25": "</think>{answer}<|im_end|>",  # the generation prompt ends in <think>; the empty thought closes it
    "llama4": "{answer}<|eot|>",
}
# The processor class of a type transformers maps to none: Qwen3-Omni's thinker ships the composite's
PROCESSORS = {"qwen3_omni_moe_thinker": "Qwen3OmniMoeProcessor"}


def published_configs() -> dict[str, Path]:
    """tests/published/'s checkpoint configs by model type."""
    paths = sorted((REPO / "tests" / "published").glob("*.json"))
    return {json.loads(path.read_text())["config"]["model_type"]: path for path in paths}


def new_models() -> dict[str, NewModel]:
    """Every demo model whose type no family module names, by type."""
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    from vlm_recipes.demo.models import DEMO_MODELS

    published = published_configs()
    return {
        demo.model_type: NewModel(
            demo_id,
            demo.model_type,
            PROCESSORS.get(demo.model_type) or PROCESSOR_MAPPING_NAMES[demo.model_type],
            published.get(demo.model_type, REPO / "tests" / "published" / f"{demo.model_type}.json"),
            ANSWER_LABELS.get(demo.model_type, "{answer}<|im_end|>\n"),
        )
        for demo_id, demo in DEMO_MODELS.items()
        if demo.family is None
    }


NEW_MODELS = new_models()


@pytest.fixture(scope="session", params=list(NEW_MODELS))
def new_model(request, private_demo_cache):
    """(NewModel, model directory): each built once per session."""
    from vlm_recipes.demo.models import ensure_demo_model

    model = NEW_MODELS[request.param]
    return model, ensure_demo_model(model.demo_id)


def test_every_published_config_is_a_new_models_or_a_familys():
    """Each generic demo model mirrors a checkpoint whose config is in tests/published/, and each config there
    is a generic demo model's or, once a family module names its type, the family tests' (test_families.py:
    PUBLISHED)."""
    known = {model_type for family in FAMILIES for model_type in family.model_types}
    published = published_configs()
    assert NEW_MODELS and all(model.published.is_file() for model in NEW_MODELS.values())
    assert set(published) == set(NEW_MODELS) | (set(published) & known)


def test_tiny_build_is_the_published_classes_and_the_generic_family_finds_its_roles(new_model):
    model, model_dir = new_model
    config = AutoConfig.from_pretrained(model_dir)
    assert config.model_type == model.model_type
    family = family_for_config(config)
    assert isinstance(family, GenericFamily)
    processor = AutoProcessor.from_pretrained(model_dir)
    assert type(processor).__name__ == model.processor
    loaded = AutoModelForImageTextToText.from_pretrained(model_dir)
    assert sum(p.numel() for p in loaded.parameters()) < 500_000
    found = family.found
    assert found.unassigned == () and all(found.parameters[role] > 0 for role in found.parameters)
    assert found.lora_targets["llm"] and found.lora_targets["vision"]


def test_published_checkpoint_builds_on_meta_with_its_roles_found(new_model):
    """The checkpoint's own configuration (tests/published/), its model built on the meta device: the code
    fits it without a download."""
    model, _ = new_model
    published = json.loads(model.published.read_text())
    fields = dict(published["config"])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    found = roles_of_config(config)
    assert found.unassigned == ()
    # the counts the publisher or an independent tally gives (as rounded there): of the whole model, or
    # of some roles ("vision+projector": their sum)
    expected = dict(published["published_parameters"])
    rounding, _ = expected.pop("rounding", 0), expected.pop("source")
    for roles, count in expected.items():
        counted = (
            sum(found.parameters.values())
            if roles == "total"
            else sum(found.parameters[role] for role in roles.split("+"))
        )
        assert abs(counted - count) <= count * rounding, (roles, counted, count)
    total = sum(found.parameters.values())
    assert total > 100 * 1_000_000, "a published model, not a tiny one"


def test_the_loss_reads_each_answer_and_its_end_of_turn_only(new_model):
    """As a stage trains: the processor loaded the family's way, the collator the SFT stage builds (the
    family's training template, or the answers told by prefix)."""
    model, model_dir = new_model
    family = family_for_config(AutoConfig.from_pretrained(model_dir))
    processor = load_processor(str(model_dir), DataSettings(), family)
    by_prefix = answers_by_prefix(processor, None)
    collator = VideoCollator(
        processor=processor,
        chat_template=family.training_chat_template(processor) or processor.chat_template,
        assistant_only_loss=not by_prefix,
        answers_by_prefix=by_prefix,
    )
    rows = demo_rows(3)[:3]
    batch = collator(rows)
    for index, row in enumerate(rows):
        labels = batch["labels"][index]
        answer = row["messages"][-1]["content"][0]["text"]
        read = processor.tokenizer.decode(labels[labels != -100])
        assert read == model.answer_labels.format(answer=answer), (read, answer)


def test_token_counts_from_image_sizes_are_the_processors_own(new_model):
    """The length check's counts (the processor on blank images of each row's sizes) equal the tokens the
    processor makes of the row's real images, as the collator does; every demo eval row, two-image ones too."""
    from conftest import model_inputs

    from vlm_recipes.data.lengths import sample_lengths

    _, model_dir = new_model
    family = family_for_config(AutoConfig.from_pretrained(model_dir))
    processor = load_processor(str(model_dir), DataSettings(), family)
    ds, _ = demo_split("demo:eval", "test", 8)
    ds = ds.filter(lambda row: not row.get("videos"))
    counted = sample_lengths(ds, processor, family)
    made = [model_inputs(processor, [row], add_special_tokens=False)["input_ids"].shape[1] for row in ds]
    assert counted == made and any(len(images) > 1 for images in ds["images"])


SEED_RUNS = [
    ("r1-llm-only", "bf16"),
    ("r1-llm-only", "fp32"),
    ("r3-two-stage", "bf16"),
    ("r3-two-stage", "fp32"),
    ("r4-joint", "bf16"),
    ("r4-joint", "fp32"),
]


@pytest.mark.e2e
@pytest.mark.parametrize(("recipe", "precision"), SEED_RUNS)
def test_seed_recipe_runs_end_to_end_on_a_new_model(new_model, recipe, precision, tmp_path):
    """Each stage finishes and trains exactly its roles (frozen: bit-identical; LoRA: only the adapted
    weights; full: every weight the loss reads), with the generic family's decisions in report.json."""
    model, _ = new_model
    args = ["--recipe", recipe, "--output-dir", str(tmp_path), "--run-name", "t", *TINY_RUN]
    assert main([*args, f"model={model.demo_id}", f"precision={precision}"]) == 0
    manifest = read_json(tmp_path / recipe / "t" / "run.json")
    assert manifest["status"] == "finished"
    for stage, recipe_stage in zip(manifest["stages"], manifest["resolved_recipe"]["stages"], strict=True):
        assert stage["steps"] == 2 and stage["eval_loss"] is not None
        report = read_json(Path(stage["dir"]) / "report.json")
        family = family_for_config(AutoConfig.from_pretrained(stage["source"]))
        assert report["family"] == family.name
        guards = {d["guard"]: d for d in report["decisions"]}
        assert guards["precision"]["choice"] == precision and "dtype-boundary" in guards
        assert_stage_trained_its_roles(stage, recipe_stage, family)
