"""Model building (roles, LoRA targets, quantization scope, per-role learning rates) and data checks."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import demo_paths, demo_split, model_inputs

from vlm_recipes.data.lengths import check_lengths, sample_lengths
from vlm_recipes.data.rows import load_split
from vlm_recipes.errors import DataError, UnsupportedModelError
from vlm_recipes.families import family_for_model_type
from vlm_recipes.families.qwen2_vl import QWEN2_VL
from vlm_recipes.methods.recipe_trainer import role_parameter_groups
from vlm_recipes.methods.trainer import ConfigInputs
from vlm_recipes.model.build import build_stage_model, load_processor
from vlm_recipes.recipe import load_recipe
from vlm_recipes.recipes.schema import DataSettings


def test_roles_use_the_longest_prefix():
    assert QWEN2_VL.role_of("model.visual.blocks.0.attn.qkv.weight") == "vision"
    assert QWEN2_VL.role_of("model.visual.merger.mlp.0.weight") == "projector"
    assert QWEN2_VL.role_of("model.language_model.layers.0.mlp.up_proj.weight") == "llm"
    assert QWEN2_VL.role_of("lm_head.weight") == "llm"
    assert QWEN2_VL.role_of("model.visualizer.x") is None  # a prefix matches whole name parts only


def test_quantization_skip_list_uses_full_module_paths():
    # `visual` alone still quantizes the tower (bitsandbytes matches full paths), and lm_head must be
    # named: any explicit skip list replaces transformers' default skips.
    skip = QWEN2_VL.quantization_skip_modules(["vision", "projector", "lm_head"])
    assert skip == ["model.visual", "model.visual.merger", "lm_head"]


def test_unknown_family_lists_the_supported_ones():
    with pytest.raises(UnsupportedModelError, match="Supported families: qwen2-vl"):
        family_for_model_type("llava")


def test_joint_lora_stage_builds_adapters_per_role_and_keeps_vision_unquantized(demo_model_dir):
    stage = load_recipe("r4-joint").stages[0]
    built = build_stage_model(str(demo_model_dir), stage, "fp32", "cpu")
    roles_with_lora = {QWEN2_VL.role_of(t) for t in built.lora_targets}
    assert roles_with_lora == {"vision", "projector", "llm"}
    assert not any(t.startswith("lm_head") for t in built.lora_targets)
    for name, param in built.model.named_parameters():
        plain = name.removeprefix("base_model.model.")
        assert param.requires_grad == ("lora_" in name), name
        if param.dtype == torch.uint8:  # 4-bit weights: only inside the language model's decoder
            assert QWEN2_VL.role_of(plain) == "llm" and not plain.startswith("lm_head"), name

    groups = role_parameter_groups(built.model, QWEN2_VL, stage, decay_names={"nothing decays"})
    rates = {group["role"]: group["lr"] for group in groups}
    assert rates == {
        "vision": pytest.approx(5e-5),
        "projector": pytest.approx(2e-4),
        "llm": pytest.approx(2e-4),
    }


def test_full_stage_keeps_fp32_master_weights_for_trained_roles(demo_model_dir):
    stage = load_recipe("r2-vision-only", ["precision=bf16"]).stages[0]
    built = build_stage_model(str(demo_model_dir), stage, "bf16", "cpu")
    for name, param in built.model.named_parameters():
        role = QWEN2_VL.role_of(name)
        if role in ("vision", "projector"):
            assert param.requires_grad and param.dtype == torch.float32, name
        else:
            assert not param.requires_grad and param.dtype == torch.bfloat16, name


def test_pixel_bounds_reach_the_processor_and_lengths_match_it(demo_model_dir):
    processor = load_processor(
        str(demo_model_dir), DataSettings(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 9), QWEN2_VL
    )
    ds, _ = demo_split("demo:eval", "test", 6)
    predicted = sample_lengths(ds, processor, QWEN2_VL)
    for row, expected in zip(ds, predicted, strict=True):
        out = model_inputs(processor, [row])
        assert out["input_ids"].shape[1] == expected
        assert max((out["image_grid_thw"].prod(-1) // 4).tolist()) <= 9


def test_token_counts_are_remembered_until_data_or_processor_change(demo_model_dir, tmp_path, monkeypatch):
    import shutil

    from PIL import Image

    from vlm_recipes.caches.token_counts import remembered_token_counts as remembered
    from vlm_recipes.data import lengths, rows
    from vlm_recipes.demo.dataset import ensure_demo_dataset

    copy = tmp_path / "copy"
    shutil.copytree(ensure_demo_dataset(), copy)
    counted = []
    real_count = lengths._count_tokens
    monkeypatch.setattr(
        lengths, "_count_tokens", lambda ds, p, f, v: counted.append(len(ds)) or real_count(ds, p, f, v)
    )
    processor = load_processor(str(demo_model_dir), DataSettings(), QWEN2_VL)

    def counts():
        ds, _ = load_split(str(copy / "train-images.jsonl"), "train", 6)
        return lengths.sample_token_counts(rows.undecoded(ds), processor, QWEN2_VL, remember=remembered)

    first = counts()
    assert counts() == first and counted == [6], "the second look reads what the first one counted"
    # the same file name, another image
    first_image = json.loads((copy / "train-images.jsonl").read_text().splitlines()[0])["images"][0]
    Image.new("RGB", (56, 56)).save(copy / first_image)
    assert counts()[0] != first[0] and counted == [6, 6]
    processor.image_processor.size = {"shortest_edge": 28 * 28 * 4, "longest_edge": 28 * 28 * 9}
    counts()
    assert counted == [6, 6, 6]


def test_a_sample_longer_than_max_length_is_refused(demo_model_dir):
    processor = load_processor(str(demo_model_dir), DataSettings(), QWEN2_VL)
    ds, _ = demo_split("demo:train", "train", 8)
    with pytest.raises(DataError, match=r"demo:train row train-\d+: longer than max_length: \d+ tokens > 10"):
        check_lengths(ds, processor, QWEN2_VL, 10, "demo:train")


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


GOOD = {
    "messages": [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "red"}]},
    ],
    "images": ["a.png"],
}


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"images": []}, "line 2: no messages"),
        ({**GOOD, "messages": GOOD["messages"][:1]}, "line 2: no assistant turn"),
        ({**GOOD, "images": []}, "line 2: image count mismatch: 1 image parts in messages but 0 images"),
        ({**GOOD, "images": ["missing.png"]}, "line 2: image not found"),
    ],
)
def test_bad_rows_are_named_by_file_and_line(tmp_path, row, message):
    from PIL import Image

    Image.new("RGB", (56, 56)).save(tmp_path / "a.png")
    path = write_jsonl(tmp_path / "train.jsonl", [GOOD, row])
    with pytest.raises(DataError) as error:
        load_split(str(path), "train", None)
    assert message in str(error.value) and str(path) in str(error.value)


def test_user_jsonl_with_relative_images_loads(tmp_path):
    from PIL import Image

    Image.new("RGB", (56, 56), "red").save(tmp_path / "a.png")
    ds, _ = load_split(str(write_jsonl(tmp_path / "train.jsonl", [GOOD, GOOD])), "train", None)
    assert len(ds) == 2 and ds[0]["images"][0].size == (56, 56)


def test_missing_data_file_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="data file not found"):
        load_split(str(tmp_path / "nope.jsonl"), "train", None)


def test_group_by_length_batches_samples_of_similar_total_length(demo_model_dir, tmp_path):
    """The sampler groups by text + image tokens (Trainer cannot infer lengths of image samples)."""
    from vlm_recipes.data.stage_data import load_stage_data
    from vlm_recipes.decisions import Environment
    from vlm_recipes.methods.sft import SFT

    stage = load_recipe(
        "r2-vision-only", ["training.group_by_length=true", "training.per_device_batch_size=8"]
    ).stages[0]
    data = load_stage_data(stage.data, paths=demo_paths(stage.data))
    processor = load_processor(str(demo_model_dir), stage.data, QWEN2_VL)
    data.train, lengths, _ = check_lengths(
        data.train, processor, QWEN2_VL, stage.data.max_length, "demo:train"
    )
    data.train = data.train.add_column("length", lengths)
    built = build_stage_model(str(demo_model_dir), stage, "fp32", "cpu", processor=processor)

    def padding_tokens(strategy: str) -> int:
        args = SFT().build_config(
            ConfigInputs(stage, tmp_path / strategy, "fp32", Environment("cpu", 0, False), has_eval=False)
        )
        args.train_sampling_strategy = strategy
        order = list(SFT().build_trainer(built, stage, args, data)._get_train_sampler())
        batches = [order[i : i + 8] for i in range(0, len(order), 8)]
        return sum(max(lengths[j] for j in b) * len(b) - sum(lengths[j] for j in b) for b in batches)

    assert padding_tokens("group_by_length") < 0.5 * padding_tokens("random")


def test_role_learning_rates_keep_trainers_no_decay_split(demo_model_dir, tmp_path):
    """Per-role learning rates used to drop Trainer's no-weight-decay group for biases and norms: with
    weight_decay > 0 that decayed them. The optimizer keeps both splits: role × (decay, no decay)."""
    from vlm_recipes.data.stage_data import load_stage_data
    from vlm_recipes.decisions import Environment
    from vlm_recipes.methods.sft import SFT

    stage = load_recipe(
        "r2-vision-only",
        [
            "training.weight_decay=0.1",
            "training.role_learning_rates={vision: 1.0e-5}",
            "data.max_train_samples=8",
        ],
    ).stages[0]
    data = load_stage_data(stage.data, paths=demo_paths(stage.data))
    built = build_stage_model(str(demo_model_dir), stage, "fp32", "cpu")
    args = SFT().build_config(
        ConfigInputs(stage, tmp_path, "fp32", Environment("cpu", 0, False), has_eval=False)
    )
    optimizer = SFT().build_trainer(built, stage, args, data).create_optimizer()
    names = {id(p): n for n, p in built.model.named_parameters()}
    by_param = {names[id(p)]: g for g in optimizer.param_groups for p in g["params"]}
    trainable = {n for n, p in built.model.named_parameters() if p.requires_grad}
    assert set(by_param) == trainable, "every trainable parameter in exactly one group"
    bias, norm = "model.visual.blocks.0.attn.qkv.bias", "model.visual.blocks.0.norm1.weight"
    weight, merger = "model.visual.blocks.0.attn.qkv.weight", "model.visual.merger.mlp.0.weight"
    assert by_param[bias]["weight_decay"] == 0.0 and by_param[norm]["weight_decay"] == 0.0
    assert by_param[weight]["weight_decay"] == pytest.approx(0.1)
    assert by_param[weight]["lr"] == pytest.approx(1e-5)  # the vision role's own rate
    assert by_param[merger]["lr"] == pytest.approx(
        stage.training.learning_rate
    )  # the projector's: the stage's
    assert type(optimizer).__name__.startswith("AdamW"), "Trainer's optimizer choice is kept"
