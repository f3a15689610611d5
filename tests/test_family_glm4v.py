"""GLM-4.1V / GLM-4.6V-Flash as a family: token counts from image sizes alone equal the processor's (its own
resize, an image counted as two frames, small sides enlarged, every size and aspect ratio, several images a
row), what data.min/max_pixels mean for it, the training chat template (content parts as text, the last
answer's <|endoftext|> in the loss), the fix of transformers' placeholder masks for a batch holding an image
and a video, and a two-stage recipe with padding-free packing and the vision feature cache, end to end.

Its published dimensions (meta device), tiny model, assistant mask, speed-ups and DPO are checked with the
other families in tests/test_families.py, tests/test_speedups.py and tests/test_dpo.py; its video rows
(frames, timestamps in the prompt, exact counts, packing, caches) in tests/test_video.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import TINY_MODELS, model_inputs
from PIL import Image
from test_families import assert_r3_trains_packed_with_the_feature_cache
from test_family_smolvlm import processor_lengths, rows_with_images
from test_video import load_rows, video_collator, write_media
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

from vlm_recipes.data.lengths import sample_lengths, sample_token_counts
from vlm_recipes.families import family_for_model_type
from vlm_recipes.families.glm4v import GLM4V
from vlm_recipes.families.glm4v_masks import _FIXED, MODELS
from vlm_recipes.families.glm4v_template import GLM4V_CHAT_TEMPLATE, GLM4V_TRAINING_CHAT_TEMPLATE
from vlm_recipes.families.parameters import params_by_role
from vlm_recipes.model.build import load_processor
from vlm_recipes.recipes.schema import DataSettings

MODEL = TINY_MODELS["glm4v"]
TOKEN = 28  # px a side of one merged token: 14 px patches, merged 2x2
# (height, width): tiny (enlarged), one token, 3 px high, square, wide 4:1, tall 4:1, odd sizes, 15:1, large
SIZES = [(10, 12), (28, 28), (3, 40), (112, 112), (50, 200), (400, 100), (33, 77), (20, 300), (900, 700)]
SETTINGS = {
    "tiny default (4 to 16 tokens)": {},
    "the seed recipes' max_pixels": {"max_pixels": 200704},
    "min_pixels above the default": {"min_pixels": TOKEN * TOKEN * 9, "max_pixels": TOKEN * TOKEN * 30},
}


@pytest.fixture(scope="module")
def model_dir(private_demo_cache) -> Path:
    from vlm_recipes.demo.models import ensure_demo_model

    return ensure_demo_model(MODEL)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_token_counts_equal_the_processors_for_every_size_and_aspect_ratio(model_dir, tmp_path, setting):
    """The length check's counts (sample_lengths, sample_token_counts) against Glm4vProcessor with pixels:
    one image a row, two and three images a row, a text-only row."""
    processor = load_processor(str(model_dir), DataSettings(**SETTINGS[setting]), GLM4V)
    several = [[(50, 200), (28, 28)], [(10, 12), (400, 100), (97, 131)], []]
    ds = rows_with_images(tmp_path, [[size] for size in SIZES] + several)
    expected = processor_lengths(processor, ds)
    assert sample_lengths(ds, processor, GLM4V) == [n for n, _ in expected]
    assert [image for _, image in sample_token_counts(ds, processor, GLM4V)] == [i for _, i in expected]
    grids = processor.image_processor(images=[Image.new("RGB", (w, h)) for h, w in SIZES])["image_grid_thw"]
    assert GLM4V.image_token_counts(processor, SIZES) == (grids.prod(-1) // 4).tolist()


def test_pixel_bounds_count_an_image_as_two_frames(model_dir):
    """data.min/max_pixels bound one image's pixels; the processor compares two frames' with `size`, so the
    bounds reach it doubled, and every image's tokens stay within them (small images are enlarged)."""
    low, high = TOKEN * TOKEN * 9, TOKEN * TOKEN * 30
    processor = load_processor(str(model_dir), DataSettings(min_pixels=low, max_pixels=high), GLM4V)
    size = processor.image_processor.size
    assert (size["shortest_edge"], size["longest_edge"]) == (2 * low, 2 * high)
    counts = GLM4V.image_token_counts(processor, [*SIZES, (2000, 1500), (5, 5)])
    assert all(low <= n * TOKEN * TOKEN <= high for n in counts), counts
    assert max(counts) > 16, "larger than the tiny default allows: the bound reached the processor"


def test_training_template_prints_content_parts_as_text_and_trains_the_stop_token(model_dir):
    processor = AutoProcessor.from_pretrained(model_dir)
    assert processor.chat_template == GLM4V_CHAT_TEMPLATE
    assert load_processor(str(model_dir), DataSettings(), GLM4V).chat_template == GLM4V_TRAINING_CHAT_TEMPLATE
    as_strings = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": "red"},
        {"role": "user", "content": "And?"},
    ]
    for prompt in (True, False):  # string contents and no final answer: the published text, byte for byte
        render = {"tokenize": False, "add_generation_prompt": prompt}
        assert processor.apply_chat_template(as_strings, **render) == processor.apply_chat_template(
            as_strings, chat_template=GLM4V_TRAINING_CHAT_TEMPLATE, **render
        )
    parts = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "red"}]},
        {"role": "user", "content": [{"type": "text", "text": "And?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "blue"}]},
    ]
    published = processor.apply_chat_template(parts, tokenize=False)
    assert "[{'type': 'text', 'text': 'red'}]" in published, "the published text prints parts as a list"
    trained = processor.apply_chat_template(parts, tokenize=False, chat_template=GLM4V_TRAINING_CHAT_TEMPLATE)
    assert trained.endswith("<|assistant|>\nred<|user|>\nAnd?<|assistant|>\nblue<|endoftext|>")
    row = {"messages": parts, "images": [Image.new("RGB", (28, 28))]}
    batch = model_inputs(
        processor, [row], chat_template=GLM4V_TRAINING_CHAT_TEMPLATE, return_assistant_tokens_mask=True
    )
    mask = batch["assistant_masks"][0].bool()
    # both answers in the loss, and the stop token after the last one only
    assert processor.tokenizer.decode(batch["input_ids"][0][mask]) == "redblue<|endoftext|>"


def test_a_batch_with_an_image_and_a_video_is_masked_as_the_processor_types_its_tokens(model_dir, tmp_path):
    """transformers' own masks take every <|image|> token for an image's and a video's, and the batch fails;
    the fixed masks are the processor's mm_token_type_ids (1 image, 2 video), and the model runs it."""
    processor = load_processor(str(model_dir), DataSettings(), GLM4V)
    _, rows = load_rows(write_media(tmp_path), GLM4V, processor)
    batch = video_collator(GLM4V, processor)([dict(r) for r in rows])
    assert len(batch["image_grid_thw"]) and len(batch["video_grid_thw"]), "images and videos in one batch"
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    inner, inputs = model.model, {k: v for k, v in batch.items() if k != "labels"}
    embeds = inner.get_input_embeddings()(batch["input_ids"])
    with torch.no_grad():
        images = inner.get_image_features(batch["pixel_values"], batch["image_grid_thw"]).pooler_output
        videos = inner.get_video_features(batch["pixel_values_videos"], batch["video_grid_thw"]).pooler_output
    images, videos = torch.cat(images), torch.cat(videos)
    original = getattr(type(inner), _FIXED)
    with pytest.raises(ValueError, match="Image features and image tokens do not match"):
        original(inner, batch["input_ids"], embeds, image_features=images)
    image_mask, video_mask = inner.get_placeholder_mask(batch["input_ids"], embeds, images, videos)
    assert torch.equal(image_mask[..., 0], batch["mm_token_type_ids"] == 1)
    assert torch.equal(video_mask[..., 0], batch["mm_token_type_ids"] == 2)
    with torch.no_grad():
        assert torch.isfinite(model(**inputs).logits).all()


def test_every_glm4v_model_class_is_fixed_and_glm46v_is_the_family(model_dir):
    """GLM-4.6V's model (`glm46v`) and the MoE GLM-4.5V / 4.6V's are copies of GLM-4.1V's code, not
    subclasses: each gets the fix. A glm46v model of the tiny dimensions is this family, every parameter in
    a role."""
    import importlib

    for module_name, class_name in MODELS.items():
        model_class = getattr(importlib.import_module(module_name), class_name)
        assert hasattr(model_class, _FIXED), class_name
    fields = AutoConfig.from_pretrained(model_dir).to_dict()
    fields = {
        k: v for k, v in fields.items() if k not in ("model_type", "architectures", "transformers_version")
    }
    config = AutoConfig.for_model("glm46v", **fields)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    assert type(model).__name__ == "Glm46VForConditionalGeneration"
    family = family_for_model_type("glm46v")
    assert family is GLM4V and not params_by_role(model, family)["other"]


@pytest.mark.e2e
def test_two_stage_recipe_with_packing_and_feature_cache_runs_end_to_end(model_dir, tmp_path):
    assert_r3_trains_packed_with_the_feature_cache(tmp_path, MODEL, GLM4V)


# ---------------------------------------------------------------------------------- GLM-4.5V / 4.6V (MoE)

MOE = TINY_MODELS["glm4v-moe"]


@pytest.fixture(scope="module")
def moe_dir(private_demo_cache) -> Path:
    from vlm_recipes.demo.models import ensure_demo_model

    return ensure_demo_model(MOE)


def test_lora_on_every_linear_layer_keeps_the_dense_mlp_and_shared_experts_and_leaves_the_experts(moe_dir):
    """PEFT rewrites a glm4v_moe LoRA's `.gate_proj` / `.up_proj` / `.down_proj` targets into the fused experts
    (its transformers 4 conversion): layer 0's dense MLP and the shared experts would lose their adapters, and
    every expert and the router gain one. With the runner's targets kept as named, the linear layers get the
    adapters and the experts none; naming `experts` adapts the two fused weights of each MoE layer only."""
    from peft import LoraConfig, get_peft_model

    from vlm_recipes.families.glm4v import GLM4V_MOE
    from vlm_recipes.families.parameters import lora_target_modules, lora_target_parameters
    from vlm_recipes.model.peft_targets import keep_lora_targets_as_named

    keep_lora_targets_as_named()
    model = AutoModelForImageTextToText.from_pretrained(moe_dir, dtype=torch.float32)
    assert model.config.text_config.first_k_dense_replace == 1 and len(model.model.language_model.layers) == 3
    targets = lora_target_modules(model, GLM4V_MOE, {"llm": []})
    assert "model.language_model.layers.0.mlp.gate_proj" in targets
    assert "model.language_model.layers.2.mlp.shared_experts.down_proj" in targets
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.05, target_modules=targets))
    adapted = {n.removesuffix(".lora_A.default.weight") for n, _ in peft.named_parameters() if "lora_A" in n}
    assert adapted == {f"base_model.model.{t}" for t in targets}
    assert not any(".experts." in n or ".gate." in n for n in adapted)

    model = AutoModelForImageTextToText.from_pretrained(moe_dir, dtype=torch.float32)
    experts = lora_target_parameters(model, GLM4V_MOE, {"llm": ["experts"]})
    assert experts == [
        f"model.language_model.layers.{i}.mlp.experts.{w}"
        for i in (1, 2)
        for w in ("gate_up_proj", "down_proj")
    ]
    attention = lora_target_modules(model, GLM4V_MOE, {"llm": ["q_proj", "experts"]})
    config = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0, target_modules=attention, target_parameters=experts
    )
    peft = get_peft_model(model, config)
    trainable = [n for n, p in peft.named_parameters() if p.requires_grad]
    assert sum(".mlp.experts." in n for n in trainable) == 2 * len(experts)  # lora_A and lora_B each
    assert not any("shared_experts" in n or ".mlp.gate" in n for n in trainable)
