"""LLaVA-OneVision as a family: token counts from image sizes alone equal the processor's (anyres tiles,
unpadding, image_newline rows, the anyres_max_N scale-down, several images per sample, both feature
select strategies), what data.min/max_pixels mean for it, the training chat template (the stop token in the
loss), the feature cache's refusal of multi-image samples, and a two-stage recipe with padding-free packing
and the vision feature cache, end to end.

Its published dimensions (meta device), tiny model, assistant mask and speed-ups are checked with the other
families in tests/test_families.py, tests/test_speedups.py and tests/test_dpo.py."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from conftest import TINY_MODELS, model_inputs, single_image_demo_file
from PIL import Image
from test_families import (
    assert_r3_trains_packed_with_the_feature_cache,
)
from test_family_smolvlm import processor_lengths, rows_with_images
from transformers import AutoModelForImageTextToText, AutoProcessor

from vlm_recipes.cli.train import main
from vlm_recipes.data.lengths import sample_lengths, sample_token_counts
from vlm_recipes.families.llava_onevision import (
    LLAVA_ONEVISION,
    LLAVA_ONEVISION_CHAT_TEMPLATE,
    LLAVA_ONEVISION_TRAINING_CHAT_TEMPLATE,
)
from vlm_recipes.model.build import load_processor
from vlm_recipes.recipes.schema import DataSettings
from vlm_recipes.speedups.frozen_vision import VisionFeatureCache

MODEL = TINY_MODELS["llava-onevision"]
# (height, width): tiny, one tile, 2x2 tiles, wide 4:1, tall 1:4, odd sizes, far beyond the pinpoints
SIZES = [(10, 12), (28, 28), (56, 56), (50, 200), (400, 100), (33, 77), (17, 32), (97, 131), (1000, 700)]
SETTINGS = {
    "tiny default (anyres_max_2)": {},
    "max_pixels of the seed recipes (ignored)": {"max_pixels": 448 * 448},
    "published anyres_max_9: never scaled down here": {"vision_aspect_ratio": "anyres_max_9"},
    "anyres_max_1: every grid over one tile scaled down": {"vision_aspect_ratio": "anyres_max_1"},
    "feature select strategy default": {"vision_feature_select_strategy": "default"},
}


@pytest.fixture(scope="module")
def model_dir(private_demo_cache) -> Path:
    from vlm_recipes.demo.models import ensure_demo_model

    return ensure_demo_model(MODEL)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_token_counts_equal_the_processors_for_every_size_and_aspect_ratio(model_dir, tmp_path, setting):
    options = dict(SETTINGS[setting])
    data = DataSettings(max_pixels=options.pop("max_pixels", None))
    processor = load_processor(str(model_dir), data, LLAVA_ONEVISION)
    for name, value in options.items():
        setattr(processor, name, value)
    # one image per row (anyres), two and three images in a row (a square tile each), a text-only row
    several = [[(50, 200), (28, 28)], [(10, 12), (400, 100), (97, 131)], []]
    ds = rows_with_images(tmp_path, [[size] for size in SIZES] + several)
    expected = processor_lengths(processor, ds)
    assert sample_lengths(ds, processor, LLAVA_ONEVISION) == [n for n, _ in expected]
    counts = sample_token_counts(ds, processor, LLAVA_ONEVISION)
    assert [image for _, image in counts] == [image for _, image in expected]
    alone = [LLAVA_ONEVISION.image_token_counts(processor, [size])[0] for size in SIZES]
    assert alone == [image for _, image in expected[: len(SIZES)]]


def test_anyres_layout_of_the_tiny_processor(model_dir):
    """A 28x56 image: the base tile (2x2 patches: 4 tokens), then its 1x2 tiles as 2 rows of 4 patches,
    each row ended by an image_newline: 14 tokens, and the model's features are exactly as many."""
    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    image = Image.new("RGB", (56, 28), (10, 120, 200))  # width 56, height 28: pinpoint [28, 56]
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}], tokenize=False
    )
    out = processor(text=[text], images=[[image]], return_tensors="pt")
    assert tuple(out["pixel_values"].shape) == (1, 3, 3, 28, 28)  # base + 1x2 tiles
    # base 2x2 = 4; tiles: 2 rows x 4 columns of patches (no padding: 28x56 fills the pinpoint) + 2 newlines
    assert (out["input_ids"] == processor.image_token_id).sum() == 4 + 2 * 4 + 2
    with torch.no_grad():
        features = model.model.get_image_features(out["pixel_values"], out["image_sizes"], return_dict=True)
    assert [f.shape[0] for f in features.pooler_output] == [14]


def test_pixel_bounds_do_not_apply_and_are_logged(model_dir, caplog):
    before = AutoProcessor.from_pretrained(model_dir).image_processor
    with caplog.at_level(logging.WARNING):
        processor = load_processor(
            str(model_dir), DataSettings(min_pixels=4, max_pixels=448 * 448), LLAVA_ONEVISION
        )
    assert "llava-onevision: data.min_pixels/max_pixels ignored" in caplog.text
    assert processor.image_processor.image_grid_pinpoints == before.image_grid_pinpoints
    assert processor.image_processor.size == before.size


def test_training_template_renders_the_same_text_and_trains_the_stop_token(model_dir):
    processor = AutoProcessor.from_pretrained(model_dir)
    assert processor.chat_template == LLAVA_ONEVISION_CHAT_TEMPLATE
    assert load_processor(str(model_dir), DataSettings(), LLAVA_ONEVISION).chat_template == (
        LLAVA_ONEVISION_TRAINING_CHAT_TEMPLATE
    )
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "red"}]},
        {"role": "user", "content": [{"type": "text", "text": "And?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "blue"}]},
    ]
    for prompt in (True, False):
        render = {"tokenize": False, "add_generation_prompt": prompt}
        published = processor.apply_chat_template(messages, **render)
        training = processor.apply_chat_template(
            messages, chat_template=LLAVA_ONEVISION_TRAINING_CHAT_TEMPLATE, **render
        )
        assert training == published
    row = {"messages": messages[1:3], "images": [Image.new("RGB", (28, 28))] * 2}
    batch = model_inputs(
        processor,
        [row],
        chat_template=LLAVA_ONEVISION_TRAINING_CHAT_TEMPLATE,
        return_assistant_tokens_mask=True,
    )
    mask = batch["assistant_masks"][0].bool()
    assert processor.tokenizer.decode(batch["input_ids"][0][mask]) == "red<|im_end|>\n"


def test_feature_cache_refuses_a_sample_of_several_images(model_dir, tmp_path):
    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    row = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Hi"}],
            },
            {"role": "assistant", "content": [{"type": "text", "text": "red"}]},
        ],
        "images": [Image.new("RGB", (56, 28), (200, 0, 0)), Image.new("RGB", (28, 28), (0, 0, 200))],
    }
    batch = model_inputs(processor, [row])
    VisionFeatureCache(tmp_path, model, LLAVA_ONEVISION).install()
    with pytest.raises(ValueError, match="feature cache handles samples of one image only"), torch.no_grad():
        model(**batch)


@pytest.mark.e2e
def test_two_stage_recipe_with_packing_and_feature_cache_runs_end_to_end(model_dir, tmp_path):
    # the cache is refused on samples of several images (the demo's pair task): one-image rows
    data = [f"data.{split}={single_image_demo_file(tmp_path, split)}" for split in ("train", "eval")]
    assert_r3_trains_packed_with_the_feature_cache(tmp_path, MODEL, LLAVA_ONEVISION, *data)


def test_feature_cache_on_data_with_several_images_a_sample_is_refused_at_the_data_check(tmp_path, capsys):
    """The same refusal, before any model loads, when the data has a sample of two images."""
    Image.new("RGB", (56, 28), (200, 0, 0)).save(tmp_path / "a.png")
    row = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Same?"}],
            },
            {"role": "assistant", "content": [{"type": "text", "text": "yes"}]},
        ],
        "images": ["a.png", "a.png"],
    }
    (tmp_path / "two.jsonl").write_text(json.dumps(row) + "\n")
    args = ["--recipe", "r1-llm-only", f"model={MODEL}", "--output-dir", str(tmp_path / "runs")]
    code = main(
        [
            *args,
            f"data.train={tmp_path / 'two.jsonl'}",
            "data.eval=null",
            "training.vision_feature_cache=true",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2, err
    assert "training.vision_feature_cache is refused: llava-onevision" in err
    assert "Loading weights" not in err
