"""Mistral 3 as a family: token counts from image sizes alone equal the processor's (rows of [IMG] ended by
[IMG_BREAK] / [IMG_END], every size and aspect ratio, several images a row), what data.min/max_pixels mean for
it, the training chat template (same text, the stop token in the loss), the vision feature cache's and the
preprocessed cache's handling of the batch padding, and a two-stage recipe with padding-free packing and the
vision feature cache, end to end.

Its published dimensions (meta device), tiny model, assistant mask, speed-ups (packed losses equal unpacked ones:
tests/test_speedups.py) and DPO are checked with the other families in tests/test_families.py,
tests/test_speedups.py and tests/test_dpo.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import TINY_MODELS, assert_reads_back_the_batch, model_inputs
from PIL import Image
from test_families import PUBLISHED, assert_r3_trains_packed_with_the_feature_cache
from test_family_smolvlm import processor_lengths, rows_with_images
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor
from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

from vlm_recipes.caches.preprocessed import PreprocessedSampleCollator
from vlm_recipes.data.lengths import sample_lengths, sample_token_counts
from vlm_recipes.families.mistral3 import MISTRAL3, token_grid
from vlm_recipes.families.mistral3_template import MISTRAL3_CHAT_TEMPLATE, MISTRAL3_TRAINING_CHAT_TEMPLATE
from vlm_recipes.model.build import load_processor
from vlm_recipes.recipes.schema import DataSettings

MODEL = TINY_MODELS["mistral3"]
# (height, width): tiny, one token, just over one token, square, wide 4:1, tall 1:4, odd sizes, 3 px high (the
# processor's own _get_num_multimodal_tokens misreads it as channels-first), far beyond every longest edge
SIZES = [
    (10, 12),
    (28, 28),
    (29, 57),
    (112, 112),
    (50, 200),
    (400, 100),
    (33, 77),
    (97, 131),
    (3, 40),
    (900, 700),
]
SETTINGS = {
    "tiny default (longest edge 112)": {},
    "max_pixels of the seed recipes (longest edge 448)": {"max_pixels": 448 * 448},
    "max_pixels not a square of whole tokens": {"max_pixels": 100 * 70},
}


@pytest.fixture(scope="module")
def model_dir(private_demo_cache) -> Path:
    from vlm_recipes.demo.models import ensure_demo_model

    return ensure_demo_model(MODEL)


def image_token_kinds(processor, ids: list[int]) -> tuple[int, int, int]:
    """([IMG], [IMG_BREAK], [IMG_END]) tokens in a tokenized text."""
    return tuple(ids.count(i) for i in processor.image_token_ids)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_token_counts_equal_the_processors_for_every_size_and_aspect_ratio(model_dir, tmp_path, setting):
    """The length check's counts (sample_lengths, sample_token_counts) against PixtralProcessor with pixels:
    one image a row, two and three images a row, a text-only row."""
    processor = load_processor(str(model_dir), DataSettings(**SETTINGS[setting]), MISTRAL3)
    several = [[(50, 200), (28, 28)], [(10, 12), (400, 100), (97, 131)], []]
    ds = rows_with_images(tmp_path, [[size] for size in SIZES] + several)
    expected = processor_lengths(processor, ds)
    assert sample_lengths(ds, processor, MISTRAL3) == [n for n, _ in expected]
    assert [image for _, image in sample_token_counts(ds, processor, MISTRAL3)] == [i for _, i in expected]
    for (height, width), (_, img) in zip(SIZES, expected, strict=False):
        rows, cols = token_grid(processor, height, width)
        assert img == rows * cols == MISTRAL3.image_token_counts(processor, [(height, width)])[0]
        if height != 3:  # the processor's own count: rows x (cols + 1), [IMG_BREAK] / [IMG_END] included
            [own] = processor._get_num_multimodal_tokens(image_sizes=[(height, width)])["num_image_tokens"]
            assert own == rows * (cols + 1)


def test_each_image_is_rows_of_img_ended_by_img_break_and_the_last_by_img_end(model_dir):
    """A 50x90 image: 2 rows of 4 tokens (28 px each, sides rounded up), each row closed by [IMG_BREAK], the
    last by [IMG_END]: 10 tokens, of which the model's features fill the 8 [IMG]."""
    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    images = [Image.new("RGB", (90, 50), (10, 120, 200)), Image.new("RGB", (20, 20), (200, 0, 0))]
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Hi"}]}],
        tokenize=False,
    )
    out = processor(text=[text], images=[images], return_tensors="pt")
    assert out["image_sizes"].tolist() == [[56, 112], [28, 28]]
    assert tuple(out["pixel_values"].shape) == (2, 3, 56, 112), "each image padded to the largest sides"
    img, brk, end = processor.image_token_ids
    ids = out["input_ids"][0].tolist()
    first = ids.index(img)
    assert ids[first : first + 12] == [img] * 4 + [brk] + [img] * 4 + [end] + [img, end]
    assert image_token_kinds(processor, ids) == (8 + 1, 1, 2)
    with torch.no_grad():
        features = model.model.get_image_features(out["pixel_values"], out["image_sizes"], return_dict=True)
    assert [f.shape[0] for f in features.pooler_output] == [8, 1]


def test_pixel_bounds_set_the_longest_edge_and_min_pixels_is_refused(model_dir, tmp_path):
    processor = load_processor(str(model_dir), DataSettings(max_pixels=100 * 70), MISTRAL3)
    assert processor.image_processor.size["longest_edge"] == 56  # 83 px, down to whole 28 px tokens
    for height, width in SIZES + [(5000, 4000)]:
        rows, cols = token_grid(processor, height, width)
        assert rows * cols * 28 * 28 <= 100 * 70, (height, width)
    seeds = load_processor(str(model_dir), DataSettings(max_pixels=200704), MISTRAL3)
    assert seeds.image_processor.size["longest_edge"] == 448  # 16 x 16 tokens at most
    with pytest.raises(ValueError, match="data.min_pixels has no meaning for this family"):
        load_processor(str(model_dir), DataSettings(min_pixels=28 * 28), MISTRAL3)


def test_training_template_renders_the_same_text_and_trains_the_stop_token(model_dir):
    processor = AutoProcessor.from_pretrained(model_dir)
    assert processor.chat_template == MISTRAL3_CHAT_TEMPLATE
    assert load_processor(str(model_dir), DataSettings(), MISTRAL3).chat_template == (
        MISTRAL3_TRAINING_CHAT_TEMPLATE
    )
    system = {"role": "system", "content": [{"type": "text", "text": "Be brief."}]}
    turns = [
        {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "red"}]},
        {"role": "user", "content": [{"type": "text", "text": "And?"}]},
        {"role": "assistant", "content": "blue"},  # a plain string too
    ]
    for messages in ([system, *turns], turns, turns[:1]):
        for prompt in (True, False):
            render = {"tokenize": False, "add_generation_prompt": prompt}
            published = processor.apply_chat_template(messages, **render)
            assert published == processor.apply_chat_template(
                messages, chat_template=MISTRAL3_TRAINING_CHAT_TEMPLATE, **render
            )
            assert published.startswith("<s>[SYSTEM_PROMPT]")
            if messages[0] is not system:  # Mistral Small 3's default system prompt, dated today
                assert "You are Mistral Small 3, a Large Language Model" in published
    row = {"messages": [system, *turns[:2]], "images": [Image.new("RGB", (28, 28))] * 2}
    batch = model_inputs(
        processor, [row], chat_template=MISTRAL3_TRAINING_CHAT_TEMPLATE, return_assistant_tokens_mask=True
    )
    mask = batch["assistant_masks"][0].bool()
    assert processor.tokenizer.decode(batch["input_ids"][0][mask]) == "red</s>"


def test_feature_cache_units_are_the_images_without_the_batch_padding(model_dir):
    """An image's cache entry is the same alone and beside a larger image (which pads it in the batch), and the
    units batched again give the features the batch gave."""
    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    small, large = Image.new("RGB", (40, 30), (0, 200, 0)), Image.new("RGB", (112, 90), (200, 0, 0))
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}], tokenize=False
    )
    alone = processor(text=[text], images=[[small]], return_tensors="pt")
    both = processor(text=[text, text], images=[[large], [small]], return_tensors="pt", padding=True)
    [(pixels, size)] = MISTRAL3.image_units(alone["pixel_values"], alone["image_sizes"])
    units = MISTRAL3.image_units(both["pixel_values"], both["image_sizes"])
    assert both["pixel_values"].shape[-2:] != pixels.shape[-2:], "the small image is padded in the batch"
    assert torch.equal(units[1][0], pixels) and torch.equal(units[1][1], size)
    with torch.no_grad():
        batch = model.model.get_image_features(both["pixel_values"], both["image_sizes"], return_dict=True)
        again = model.model.get_image_features(*MISTRAL3.batch_image_units(units), return_dict=True)
    for a, b in zip(batch.pooler_output, again.pooler_output, strict=True):
        assert torch.equal(a, b)


def test_preprocessed_samples_of_different_sizes_assemble_to_the_collators_batch(model_dir, tmp_path):
    """pixel_values padded to the batch's largest height and width ("sides"), as PixtralProcessor pads them."""
    processor = AutoProcessor.from_pretrained(model_dir)
    padded = DataCollatorForVisionLanguageModeling(
        processor, assistant_only_loss=True, chat_template=MISTRAL3_TRAINING_CHAT_TEMPLATE
    )
    ds = rows_with_images(tmp_path, [[(90, 30)], [(30, 100), (50, 50)], [], [(112, 112)]])
    stored = [dict(row) for row in ds]
    decoded = [{**row, "images": [Image.open(p).convert("RGB") for p in row["images"]]} for row in stored]
    expected = padded([dict(row) for row in decoded])
    assert expected["pixel_values"].shape[0] == 4 and expected["image_sizes"].shape == (4, 2)
    cached = PreprocessedSampleCollator(padded, tmp_path / "cache", image_padding=MISTRAL3.image_padding)
    assert_reads_back_the_batch(cached, stored, expected)


def test_published_config_json_ties_lm_head_in_transformers_without_the_key():
    """Mistral-Small-3.1's config.json has no top-level tie_word_embeddings, and transformers 5.24's
    Mistral3Config defaults it to True: built from the file as is, lm_head would be the embeddings (the
    published checkpoint holds both; from_pretrained keeps them apart, with a warning). PUBLISHED sets False."""
    fields, count = PUBLISHED["Mistral-Small-3.1-24B"]
    fields = {k: v for k, v in fields.items() if k != "tie_word_embeddings"}
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    if not config.tie_word_embeddings:
        pytest.skip("this transformers reads config.json as untied: PUBLISHED's explicit False is redundant")
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == count - 131072 * 5120


def test_a_tokenizer_saved_before_transformers_5_tokenizes_with_tekkens_pattern(model_dir, tmp_path):
    """The published Mistral 3 tokenizers were saved before transformers 5.0 with a pre-tokenizer regex that
    splits text wrongly; transformers restores Tekken's own pattern only when asked (`fix_mistral_regex`),
    and only for a vocabulary over 100k (Tekken's: 131072). A copy of the tiny model made to look like one
    (config from 4.50, a per-character pre-tokenizer, the vocabulary padded to 131072): AutoProcessor alone
    tokenizes it per character; the processor a stage loads tokenizes as the tiny model's own tokenizer."""
    published = tmp_path / "saved-by-transformers-4"
    shutil.copytree(model_dir, published)
    config = json.loads((published / "config.json").read_text())
    (published / "config.json").write_text(json.dumps({**config, "transformers_version": "4.50.0"}))
    tokenizer = json.loads((published / "tokenizer.json").read_text())
    tokenizer["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\S|\s"
    vocab = tokenizer["model"]["vocab"]
    vocab.update({f"<SPECIAL_{i}>": i for i in range(len(vocab), 131072)})
    (published / "tokenizer.json").write_text(json.dumps(tokenizer))
    text = "Calories 250, fatG 12 per serving"
    tekken = AutoProcessor.from_pretrained(model_dir).tokenizer.tokenize(text)
    assert AutoProcessor.from_pretrained(published).tokenizer.tokenize(text) != tekken
    assert load_processor(str(published), DataSettings(), MISTRAL3).tokenizer.tokenize(text) == tekken
    assert load_processor(str(model_dir), DataSettings(), MISTRAL3).tokenizer.tokenize(text) == tekken


@pytest.mark.e2e
def test_two_stage_recipe_with_packing_and_feature_cache_runs_end_to_end(model_dir, tmp_path):
    assert_r3_trains_packed_with_the_feature_cache(tmp_path, MODEL, MISTRAL3)
