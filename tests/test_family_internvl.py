"""InternVL 3.5 as a family: token counts from image sizes alone equal the processor's (<img>, 4 tokens a tile,
</img>; every size and aspect ratio, several images a row, every pixel bound), what data.min/max_pixels mean for
it, the training chat template (same text, the stop token in the loss), the vision feature cache's tiles, the
preprocessed cache's batch, the tower's FLOPs with its CLS tokens, and a two-stage
recipe with padding-free packing and the vision feature cache, end to end.

Its published dimensions (meta device), tiny model, assistant mask, seed recipes, speed-ups (packed losses equal
unpacked ones) and DPO are checked with the other families in tests/test_families.py, tests/test_speedups.py,
tests/test_dpo.py and tests/test_family_features.py; its video refusal in tests/test_video.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import TINY_MODELS, assert_reads_back_the_batch, model_inputs, model_torch_can_count
from PIL import Image
from test_families import assert_r3_trains_packed_with_the_feature_cache
from test_family_smolvlm import processor_lengths, rows_with_images
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForImageTextToText, AutoProcessor
from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

from vlm_recipes.benchmarking.flops import matmul_params_by_role
from vlm_recipes.caches.preprocessed import PreprocessedSampleCollator
from vlm_recipes.data.lengths import sample_lengths, sample_token_counts
from vlm_recipes.families.internvl import (
    INTERNVL,
    INTERNVL_CHAT_TEMPLATE,
    INTERNVL_TRAINING_CHAT_TEMPLATE,
    tiles_per_image,
)
from vlm_recipes.model.build import load_processor
from vlm_recipes.recipes.schema import DataSettings

MODEL = TINY_MODELS["internvl"]
# (height, width): tiny, one tile, just over one tile, square 2x2, wide 4:1, tall 1:4, 3:2 (ties between grids),
# odd sizes, 3 px high, far beyond every grid
SIZES = [
    (10, 12),
    (56, 56),
    (57, 60),
    (112, 112),
    (50, 200),
    (400, 100),
    (112, 168),
    (33, 77),
    (97, 131),
    (3, 40),
    (900, 700),
]
SETTINGS = {
    "tiny default (max_patches 6)": {},
    "max_pixels of the seed recipes (max_patches 64)": {"max_pixels": 448 * 448},
    "max_pixels of one tile (no tiling)": {"max_pixels": 56 * 56},
    "min_pixels of 3 tiles": {"min_pixels": 3 * 56 * 56 - 1},
}


@pytest.fixture(scope="module")
def model_dir(private_demo_cache) -> Path:
    from vlm_recipes.demo.models import ensure_demo_model

    return ensure_demo_model(MODEL)


def chat(n_images: int, text: str = "Hi") -> list[dict]:
    content = [{"type": "image"} for _ in range(n_images)] + [{"type": "text", "text": text}]
    return [{"role": "user", "content": content}]


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_token_counts_equal_the_processors_for_every_size_and_aspect_ratio(model_dir, tmp_path, setting):
    """The length check's counts (sample_lengths, sample_token_counts) against InternVLProcessor with pixels: one
    image a row, two and three images a row, a text-only row."""
    processor = load_processor(str(model_dir), DataSettings(**SETTINGS[setting]), INTERNVL)
    several = [[(50, 200), (56, 56)], [(10, 12), (400, 100), (97, 131)], []]
    ds = rows_with_images(tmp_path, [[size] for size in SIZES] + several)
    expected = processor_lengths(processor, ds)
    assert sample_lengths(ds, processor, INTERNVL) == [n for n, _ in expected]
    assert [image for _, image in sample_token_counts(ds, processor, INTERNVL)] == [i for _, i in expected]
    alone = [INTERNVL.image_token_counts(processor, [size])[0] for size in SIZES]
    assert alone == [image for _, image in expected[: len(SIZES)]]
    tiles = {size: n for size, n in zip(SIZES, tiles_per_image(processor, SIZES), strict=True)}
    assert len(set(tiles.values())) > 1 or setting == "max_pixels of one tile (no tiling)", "grids differ"


def test_each_image_is_img_its_tiles_tokens_and_end_img(model_dir):
    """A 50x120 image: a 2x1 grid of 56 px tiles and the thumbnail, 3 tiles of 4 tokens; a 30x30 image: one tile
    (no thumbnail). Each image's <IMG_CONTEXT> run sits between <img> and </img>, and the model's features
    fill exactly those tokens, one [4, hidden] block per tile."""
    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    images = [Image.new("RGB", (120, 50), (10, 120, 200)), Image.new("RGB", (30, 30), (200, 0, 0))]
    text = processor.apply_chat_template(chat(2), tokenize=False)
    assert text == "<|im_start|>user\n<IMG_CONTEXT>\n<IMG_CONTEXT>\nHi<|im_end|>\n"
    out = processor(text=[text], images=[images], return_tensors="pt")
    assert tuple(out["pixel_values"].shape) == (3 + 1, 3, 56, 56), "tiles end to end, as plain images"
    context, start, end = processor.image_token_ids
    ids = out["input_ids"][0].tolist()
    first = ids.index(start)
    layout = (
        [start] + [context] * 12 + [end] + processor.tokenizer("\n")["input_ids"] + [start] + [context] * 4
    )
    assert ids[first : first + len(layout) + 1] == [*layout, end]
    assert ids.count(start) == ids.count(end) == 2 and ids.count(context) == 16
    assert INTERNVL.count_tokens(processor, [text], [[(50, 120), (30, 30)]]) == [(len(ids) - 16, 16)]
    with torch.no_grad():
        features = model.model.get_image_features(out["pixel_values"], return_dict=True).pooler_output
    assert tuple(features.shape[:2]) == (4, processor.image_seq_length) == (4, 4)


def test_pixel_bounds_set_the_tile_counts_and_refuse_what_no_grid_can_give(model_dir):
    seeds = load_processor(str(model_dir), DataSettings(max_pixels=200704), INTERNVL).image_processor
    assert (seeds.min_patches, seeds.max_patches) == (1, 64)  # 448x448 px of 56 px tiles
    bounded = load_processor(
        str(model_dir), DataSettings(min_pixels=3136 + 1, max_pixels=5 * 3136 + 10), INTERNVL
    )
    assert (bounded.image_processor.min_patches, bounded.image_processor.max_patches) == (2, 5)
    for height, width in SIZES + [(5000, 4000), (4, 3000)]:
        [tiles] = tiles_per_image(bounded, [(height, width)])
        assert 2 + 1 <= tiles <= 5 + 1, (height, width)  # the grid's tiles and a thumbnail
    with pytest.raises(ValueError, match="under one tile"):
        load_processor(str(model_dir), DataSettings(max_pixels=56 * 56 - 1), INTERNVL)
    with pytest.raises(ValueError, match="needs 3 tiles of 56x56 px, more than max_patches 2"):
        load_processor(str(model_dir), DataSettings(min_pixels=3 * 3136, max_pixels=2 * 3136), INTERNVL)


def test_training_template_renders_the_same_text_and_trains_the_stop_token(model_dir):
    processor = AutoProcessor.from_pretrained(model_dir)
    assert processor.chat_template == INTERNVL_CHAT_TEMPLATE
    assert (
        load_processor(str(model_dir), DataSettings(), INTERNVL).chat_template
        == INTERNVL_TRAINING_CHAT_TEMPLATE
    )
    system = {"role": "system", "content": [{"type": "text", "text": "Be brief."}]}
    turns = [
        *chat(2),
        {"role": "assistant", "content": [{"type": "text", "text": "red"}]},
        {"role": "user", "content": "And?"},  # plain strings too
        {"role": "assistant", "content": "blue"},
    ]
    for messages in ([system, *turns], turns, turns[:1]):
        for prompt in (True, False):
            render = {"tokenize": False, "add_generation_prompt": prompt}
            published = processor.apply_chat_template(messages, **render)
            training = processor.apply_chat_template(
                messages, chat_template=INTERNVL_TRAINING_CHAT_TEMPLATE, **render
            )
            assert published == training
    row = {"messages": [system, *turns], "images": [Image.new("RGB", (56, 56))] * 2}
    batch = model_inputs(
        processor, [row], chat_template=INTERNVL_TRAINING_CHAT_TEMPLATE, return_assistant_tokens_mask=True
    )
    mask = batch["assistant_masks"][0].bool()
    assert processor.tokenizer.decode(batch["input_ids"][0][mask]) == "red<|im_end|>\nblue<|im_end|>\n"


def test_feature_cache_units_are_the_tiles_and_give_back_the_batchs_features(model_dir):
    """One unit per tile, the same tile alone or in a batch; the units batched again (the feature layer left to
    the config, as the model's forward leaves it) give the features the batch gave."""
    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    # 30x30: one tile; 60x150: a 3x1 grid (2x1 is as near its ratio, and the larger grid wins a tie while it
    # covers under twice the image) and its thumbnail. A small image is enlarged onto a grid near its ratio:
    # 40x30 onto 3x2 tiles.
    small, large = Image.new("RGB", (30, 30), (0, 200, 0)), Image.new("RGB", (150, 60), (200, 0, 0))
    text = processor.apply_chat_template(chat(1), tokenize=False)
    alone = processor(text=[text], images=[[small]], return_tensors="pt")
    both = processor(text=[text, text], images=[[large], [small]], return_tensors="pt", padding=True)
    [(tile, size)] = INTERNVL.image_units(alone["pixel_values"], None)
    units = INTERNVL.image_units(both["pixel_values"], None)
    assert len(units) == 3 + 1 + 1 and torch.equal(units[-1][0], tile) and size.tolist() == [56, 56]
    owner = INTERNVL.image_encoder_owner(model)
    with torch.no_grad():
        batch = owner.get_image_features(both["pixel_values"], return_dict=True).pooler_output
        again = owner.get_image_features(*INTERNVL.batch_image_units(units), return_dict=True)
    joined = INTERNVL.join_image_features(INTERNVL.split_image_features(again))
    assert torch.equal(joined.pooler_output, batch)
    with pytest.raises(ValueError, match="config's vision_feature_layer"):
        INTERNVL.image_units(both["pixel_values"], -2)


def test_preprocessed_samples_of_different_sizes_assemble_to_the_collators_batch(model_dir, tmp_path):
    """pixel_values: every row's tiles end to end, as the processor concatenates them."""
    processor = AutoProcessor.from_pretrained(model_dir)
    padded = DataCollatorForVisionLanguageModeling(
        processor, assistant_only_loss=True, chat_template=INTERNVL_TRAINING_CHAT_TEMPLATE
    )
    ds = rows_with_images(tmp_path, [[(90, 30)], [(30, 100), (50, 50)], [], [(112, 112)]])
    stored = [dict(row) for row in ds]
    decoded = [{**row, "images": [Image.open(p).convert("RGB") for p in row["images"]]} for row in stored]
    expected = padded([dict(row) for row in decoded])
    sizes = [(90, 30), (30, 100), (50, 50), (112, 112)]
    assert expected["pixel_values"].shape[0] == sum(tiles_per_image(processor, sizes)) > len(sizes)
    cached = PreprocessedSampleCollator(padded, tmp_path / "cache", image_padding=INTERNVL.image_padding)
    assert_reads_back_the_batch(cached, stored, expected)


def test_vision_flops_are_the_formulas_plus_each_tiles_class_token(model_dir):
    """torch's count of the tower and projector on 3 images (7 tiles) is the formula's vision and projector terms
    (its patches, attention per tile) plus what each tile's CLS token adds: every tower matmul but the patch
    convolution once more, and (P + 1)^2 - P^2 more attention pairs a layer, P patches a tile."""
    model = model_torch_can_count(model_dir, INTERNVL).eval()
    processor = AutoProcessor.from_pretrained(model_dir)
    images = [Image.new("RGB", (120, 50)), Image.new("RGB", (30, 30)), Image.new("RGB", (60, 130))]
    text = processor.apply_chat_template(chat(3), tokenize=False)
    pixel_values = processor(text=[text], images=[images], return_tensors="pt")["pixel_values"]
    tiles = pixel_values.shape[0]
    geometry = INTERNVL.vision_geometry(model.config)
    params = matmul_params_by_role(model, INTERNVL)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        INTERNVL.image_encoder_owner(model).get_image_features(pixel_values)
    side, patches = geometry.window, geometry.window**2 * geometry.patches_per_token
    tokens = tiles * side**2
    formula = (
        2 * params["vision"] * tokens * geometry.patches_per_token
        + 2 * params["projector"] * tokens
        + 4 * geometry.width * sum(geometry.attention_pairs(side * side, (side, side)) for _ in range(tiles))
    )
    convolution = model.model.vision_tower.embeddings.patch_embeddings.projection.weight.numel()
    class_tokens = tiles * (
        2 * (params["vision"] - convolution)
        + 4 * geometry.width * geometry.layers * ((patches + 1) ** 2 - patches**2)
    )
    assert tiles == 3 + 1 + 3 and counter.get_total_flops() == formula + class_tokens


@pytest.mark.e2e
def test_two_stage_recipe_with_packing_and_feature_cache_runs_end_to_end(model_dir, tmp_path):
    assert_r3_trains_packed_with_the_feature_cache(tmp_path, MODEL, INTERNVL)
