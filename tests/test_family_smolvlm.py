"""SmolVLM as a family: token counts from image sizes alone equal the processor's (tiles, rows and columns,
split and unsplit, every aspect ratio), what data.min/max_pixels mean for it, and a two-stage recipe with
padding-free packing and the vision feature cache, end to end.

Its published dimensions (meta device), tiny model, assistant mask and speed-ups are checked with the other
families in tests/test_families.py, tests/test_speedups.py and tests/test_dpo.py."""

from __future__ import annotations

from pathlib import Path

import datasets
import pytest
from conftest import TINY_MODELS
from PIL import Image
from test_families import (
    assert_r3_trains_packed_with_the_feature_cache,
)
from transformers import AutoProcessor

from vlm_recipes.data.lengths import sample_lengths, sample_token_counts
from vlm_recipes.families.smolvlm import SMOLVLM, tile_grid
from vlm_recipes.model.build import load_processor
from vlm_recipes.recipes.schema import DataSettings

MODEL = TINY_MODELS["smolvlm"]
# (height, width): tiny, square at and above the tile, wide 4:1, tall 1:4, odd (17x32: where the processor
# and its own get_number_of_image_patches disagree at a longest edge of 100), far beyond max_pixels
SIZES = [(10, 12), (64, 64), (128, 128), (50, 200), (400, 100), (33, 77), (17, 32), (97, 131), (1000, 700)]


@pytest.fixture(scope="module")
def model_dir(private_demo_cache) -> Path:
    from vlm_recipes.demo.models import ensure_demo_model

    return ensure_demo_model(MODEL)


def rows_with_images(directory: Path, sizes: list[list[tuple[int, int]]]) -> datasets.Dataset:
    """One row per list of image sizes (empty: a text-only row), images as PNG files."""
    rows = []
    for i, image_sizes in enumerate(sizes):
        paths = []
        for j, (height, width) in enumerate(image_sizes):
            path = directory / f"{i}-{j}.png"
            Image.new("RGB", (width, height), (40 * j, 120, 200)).save(path)
            paths.append(str(path))
        content = [{"type": "image"} for _ in paths] + [{"type": "text", "text": "What is shown?"}]
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": content},
                    {"role": "assistant", "content": [{"type": "text", "text": "a square, 12 px"}]},
                ],
                "images": paths,
            }
        )
    return datasets.Dataset.from_list(rows)


def processor_lengths(processor, ds: datasets.Dataset) -> list[tuple[int, int]]:
    """(tokens, <image> tokens) of each row as the processor itself tokenizes it, pixels and all."""
    out = []
    for row in ds:
        text = processor.apply_chat_template(row["messages"], tokenize=False)
        images = [Image.open(path) for path in row["images"]]
        ids = processor(text=[text], images=[images] if images else None)["input_ids"][0]
        ids = ids.tolist() if hasattr(ids, "tolist") else ids
        out.append((len(ids), ids.count(processor.image_token_id)))
    return out


SETTINGS = {
    "tiny default (2x2 tiles)": {},
    "max_pixels of the seed recipes": {"max_pixels": 448 * 448},  # longest edge 448: 7x7 tiles
    "longest edge not a multiple of the tile": {"size": {"longest_edge": 100}},
    "unsplit": {"do_image_splitting": False},
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_token_counts_equal_the_processors_for_every_size_and_aspect_ratio(model_dir, tmp_path, setting):
    options = dict(SETTINGS[setting])
    processor = load_processor(
        str(model_dir), DataSettings(max_pixels=options.pop("max_pixels", None)), SMOLVLM
    )
    for name, value in options.items():
        setattr(processor.image_processor, name, value)
    ds = rows_with_images(tmp_path, [[size] for size in SIZES] + [[(50, 200), (64, 64)], []])
    expected = processor_lengths(processor, ds)
    assert sample_lengths(ds, processor, SMOLVLM) == [n for n, _ in expected]
    counts = sample_token_counts(ds, processor, SMOLVLM)
    assert [image for _, image in counts] == [image for _, image in expected]
    assert SMOLVLM.image_token_counts(processor, SIZES) == [image for _, image in expected[: len(SIZES)]]


def test_max_pixels_sets_the_longest_edge_and_min_pixels_is_refused(model_dir):
    processor = load_processor(str(model_dir), DataSettings(max_pixels=448 * 448), SMOLVLM)
    assert processor.image_processor.size["longest_edge"] == 448  # 7 tiles of 64 px
    assert tile_grid(processor.image_processor, 1000, 700) == (7, 5)
    assert tile_grid(processor.image_processor, 30, 30) == (7, 7), "small images are upscaled"
    odd = load_processor(str(model_dir), DataSettings(max_pixels=300 * 300), SMOLVLM)
    assert odd.image_processor.size["longest_edge"] == 256, "rounded down to whole tiles"
    tiny = load_processor(str(model_dir), DataSettings(max_pixels=10), SMOLVLM)
    assert tiny.image_processor.size["longest_edge"] == 64, "at least one tile"
    with pytest.raises(ValueError, match="smolvlm: data.min_pixels has no meaning"):
        load_processor(str(model_dir), DataSettings(min_pixels=64 * 64), SMOLVLM)


def test_tiny_processor_writes_smolvlms_image_layout(model_dir):
    processor = AutoProcessor.from_pretrained(model_dir)
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}], tokenize=False
    )
    out = processor(text=[text], images=[[Image.new("RGB", (128, 64))]], return_tensors="pt")
    decoded = processor.tokenizer.decode(out["input_ids"][0])
    tile = "<fake_token_around_image><row_1_col_{}>" + "<image>" * 4
    glob = "\n\n<fake_token_around_image><global-img>" + "<image>" * 4 + "<fake_token_around_image>"
    assert decoded == f"<|im_start|>User:{tile.format(1)}{tile.format(2)}{glob}Hi<end_of_utterance>\n"
    assert tuple(out["pixel_values"].shape) == (1, 3, 3, 64, 64)  # 1x2 tiles + the global view
    assert tuple(out["pixel_attention_mask"].shape) == (1, 3, 64, 64)


@pytest.mark.e2e
def test_two_stage_recipe_with_packing_and_feature_cache_runs_end_to_end(model_dir, tmp_path):
    assert_r3_trains_packed_with_the_feature_cache(tmp_path, MODEL, SMOLVLM)
