"""LFM2-VL as a family: token counts from image sizes alone equal the processor's (tiles with their row and column
markers, a thumbnail, <|image_start|> and <|image_end|>; every size and aspect ratio, several images a row, every
pixel bound), what data.min/max_pixels mean for it, the training chat template (same text, the stop token in the
loss), the published tokens, the vision feature cache's tiles (a part of a batch computed alone, in fp32 and bf16),
the refusals (padding-free packing, the loss-positions cut on a convolution layer, FLOP counts), and a two-stage
recipe with the feature cache, end to end in bf16 and fp32.

Its published dimensions (LiquidAI/LFM2-VL-1.6B on the meta device: tests/published/lfm2_vl.json), tiny model,
assistant mask, seed recipes, speed-ups and DPO are checked with the other families in tests/test_families.py,
tests/test_speedups.py, tests/test_dpo.py and tests/test_family_features.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, TINY_MODELS, model_inputs
from PIL import Image
from test_families import TINY_RUN, assert_stage_trained_its_roles
from test_family_smolvlm import processor_lengths, rows_with_images
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor
from trl.chat_template_utils import get_training_chat_template

from vlm_recipes.cli.train import main
from vlm_recipes.data.lengths import sample_lengths, sample_token_counts
from vlm_recipes.families.generic import build_on_meta
from vlm_recipes.families.lfm2_vl import (
    LFM2_VL,
    LFM2_VL_CHAT_TEMPLATE,
    LFM2_VL_TRAINING_CHAT_TEMPLATE,
    image_layout,
)
from vlm_recipes.files import read_json
from vlm_recipes.model.build import load_processor
from vlm_recipes.recipes.schema import DataSettings
from vlm_recipes.speedups.frozen_vision import VisionFeatureCache
from vlm_recipes.speedups.loss_positions import loss_positions_refusal

MODEL = TINY_MODELS["lfm2-vl"]
# (height, width): under one token, kept whole (upscaled, exact tokens, odd sides), over the tolerance (a 2x2 grid,
# a 1x3 grid, far beyond every grid), wide and tall, 3 px high
SIZES = [
    (10, 12),
    (33, 33),
    (64, 64),
    (97, 95),
    (123, 77),
    (112, 140),
    (300, 90),
    (500, 500),
    (56, 200),
    (20, 400),
    (3, 40),
]
SETTINGS = {
    "tiny default (4..16 tokens, 2..4 tiles of 64 px)": {},
    "max_pixels of the seed recipes (196 tokens, up to 49 tiles)": {"max_pixels": 448 * 448},
    "max_pixels under two tiles (no image cut)": {"max_pixels": 2 * 64 * 64 - 1},
    "min_pixels of 9 tokens": {"min_pixels": 9 * 32 * 32},
}


@pytest.fixture(scope="module")
def model_dir(private_demo_cache) -> Path:
    from vlm_recipes.demo.models import ensure_demo_model

    return ensure_demo_model(MODEL)


def chat(n_images: int, text: str = "Hi") -> list[dict]:
    content = [{"type": "image"} for _ in range(n_images)] + [{"type": "text", "text": text}]
    return [{"role": "user", "content": content}]


def noise(height: int, width: int, seed: int) -> Image.Image:
    """An image whose tiles all differ (a blank one's tiles are equal, and the feature cache computes those once)."""
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8))


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_token_counts_equal_the_processors_for_every_size_and_aspect_ratio(model_dir, tmp_path, setting):
    """The length check's counts (sample_lengths, sample_token_counts) against Lfm2VlProcessor with pixels: one
    image a row, two and three images a row, a text-only row."""
    processor = load_processor(str(model_dir), DataSettings(**SETTINGS[setting]), LFM2_VL)
    several = [[(56, 200), (64, 64)], [(10, 12), (300, 90), (123, 77)], []]
    ds = rows_with_images(tmp_path, [[size] for size in SIZES] + several)
    expected = processor_lengths(processor, ds)
    assert sample_lengths(ds, processor, LFM2_VL) == [n for n, _ in expected]
    assert [image for _, image in sample_token_counts(ds, processor, LFM2_VL)] == [i for _, i in expected]
    alone = [LFM2_VL.image_token_counts(processor, [size])[0] for size in SIZES]
    assert alone == [image for _, image in expected[: len(SIZES)]]
    grids = {image_layout(processor.image_processor, *size)[:2] for size in SIZES}
    assert (len(grids) > 1) == processor.image_processor.do_image_splitting, "tiled in some settings only"


def test_each_image_is_its_tiles_and_thumbnail_between_image_start_and_end(model_dir):
    """A 112x140 image: a 2x2 grid of 64 px tiles, 4 tokens each, and an 8x8-patch thumbnail of 16 tokens; a 40x30
    image: kept whole, enlarged to 4 tokens' area at least (64x96 px, 6 tokens). The model's features fill
    exactly the <image> tokens, one block per tile."""
    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    images = [noise(112, 140, 0), noise(30, 40, 1)]
    text = processor.apply_chat_template(chat(2), tokenize=False)
    assert text == "<|startoftext|><|im_start|>user\n<image><image>Hi<|im_end|>\n"
    out = processor(text=[text], images=[images], return_tensors="pt")
    assert out["spatial_shapes"].tolist() == [[4, 4]] * 4 + [[8, 8], [4, 6]]
    tok = processor.tokenizer
    markers = ("<image>", "<|image_start|>", "<|image_end|>", "<|img_thumbnail|>")
    image, start, end, thumbnail = (tok.convert_tokens_to_ids(t) for t in markers)
    tiles = [tok.convert_tokens_to_ids(f"<|img_row_{r}_col_{c}|>") for r in (1, 2) for c in (1, 2)]
    first = [start, *(t for tile in tiles for t in (tile, *[image] * 4)), thumbnail, *[image] * 16, end]
    ids = out["input_ids"][0].tolist()
    at = ids.index(start)
    assert ids[at : at + len(first) + 8] == [*first, start, *[image] * 6, end]
    assert LFM2_VL.count_tokens(processor, [text], [[(112, 140), (30, 40)]]) == [(len(ids) - 38, 38)]
    with torch.no_grad():
        features = model.model.get_image_features(
            out["pixel_values"], out["spatial_shapes"], out["pixel_attention_mask"], return_dict=True
        ).pooler_output
    assert [len(tile) for tile in features] == [4, 4, 4, 4, 16, 6]


def test_pixel_bounds_set_the_token_budget_and_the_tiles_and_refuse_what_none_can_give(model_dir, tmp_path):
    seeds = load_processor(str(model_dir), DataSettings(max_pixels=448 * 448), LFM2_VL).image_processor
    assert (seeds.max_image_tokens, seeds.max_tiles, seeds.do_image_splitting) == (196, 49, True)
    whole = load_processor(str(model_dir), DataSettings(max_pixels=2 * 64 * 64 - 1), LFM2_VL)
    assert (whole.image_processor.max_image_tokens, whole.image_processor.do_image_splitting) == (7, False)
    for height, width in SIZES + [(4000, 3000)]:
        assert image_layout(whole.image_processor, height, width)[:2] == (1, 1)
        # the processor keeps a token on the short side: an image longer than 7:1 gets more (its own rule)
        if max(height, width) <= 4 * min(height, width):
            assert LFM2_VL.image_token_counts(whole, [(height, width)])[0] <= 7, (height, width)
    bounded = load_processor(str(model_dir), DataSettings(min_pixels=9 * 1024), LFM2_VL)
    assert (bounded.image_processor.min_image_tokens, bounded.image_processor.max_image_tokens) == (9, 16)
    default = load_processor(str(model_dir), DataSettings(), LFM2_VL)
    [enlarged], [small] = (LFM2_VL.image_token_counts(p, [(10, 12)]) for p in (bounded, default))
    assert enlarged >= 9 > small, (
        "a small image enlarged to 9 tokens' area at least (sides up to whole tokens)"
    )
    # the bounded settings are those a processor loaded from them has: the cache keys of stage 1 (bounded here)
    # and stage 2 (loaded from stage 1's final/) agree (before, the patch budget kept the model's 64)
    seeds_processor = load_processor(str(model_dir), DataSettings(max_pixels=448 * 448), LFM2_VL)
    seeds_processor.save_pretrained(tmp_path)
    again = AutoProcessor.from_pretrained(tmp_path).image_processor
    assert again.to_json_string() == seeds_processor.image_processor.to_json_string()
    with pytest.raises(ValueError, match="under one image token"):
        load_processor(str(model_dir), DataSettings(max_pixels=32 * 32 - 1), LFM2_VL)
    with pytest.raises(ValueError, match="needs 9 image tokens, more than max_image_tokens 4"):
        load_processor(str(model_dir), DataSettings(min_pixels=9 * 1024, max_pixels=4 * 1024), LFM2_VL)


def test_training_template_renders_the_same_text_and_trains_the_stop_token(model_dir):
    processor = AutoProcessor.from_pretrained(model_dir)
    # the published text, byte for byte, which TRL has no training variant of
    assert processor.chat_template == LFM2_VL_CHAT_TEMPLATE and len(LFM2_VL_CHAT_TEMPLATE) == 434
    with pytest.raises(ValueError, match="not training-compatible"):
        get_training_chat_template(processor)
    assert (
        load_processor(str(model_dir), DataSettings(), LFM2_VL).chat_template
        == LFM2_VL_TRAINING_CHAT_TEMPLATE
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
                messages, chat_template=LFM2_VL_TRAINING_CHAT_TEMPLATE, **render
            )
            assert published == training
    row = {"messages": [system, *turns], "images": [noise(30, 40, 2), noise(64, 64, 3)]}
    batch = model_inputs(
        processor, [row], chat_template=LFM2_VL_TRAINING_CHAT_TEMPLATE, return_assistant_tokens_mask=True
    )
    mask = batch["assistant_masks"][0].bool()
    assert processor.tokenizer.decode(batch["input_ids"][0][mask]) == "red<|im_end|>\nblue<|im_end|>\n"


def test_the_tiny_tokenizer_has_the_published_tokens(model_dir):
    """LFM2's tokenizer: <|startoftext|> begins a text (the template writes it), <|im_end|> ends a turn and
    generation, <|pad|> pads, <image> is the image placeholder the model's config names."""
    processor = AutoProcessor.from_pretrained(model_dir)
    tok = processor.tokenizer
    assert (tok.bos_token, tok.eos_token, tok.pad_token, processor.image_token) == (
        "<|startoftext|>",
        "<|im_end|>",
        "<|pad|>",
        "<image>",
    )
    assert AutoConfig.from_pretrained(model_dir).image_token_id == tok.convert_tokens_to_ids("<image>")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_feature_cache_computes_a_part_of_a_batch_alone_as_the_batch_does(model_dir, tmp_path, dtype):
    """One unit per tile. A batch whose images were partly seen: the unseen ones' tiles are computed alone, their
    pixel mask rebuilt for them (the batch's own mask is for all of its tiles), and the forward is the uncached
    one bit for bit (measured: 0.0 apart in fp32 and bf16)."""
    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype).eval()
    text = processor.apply_chat_template(chat(1), tokenize=False)
    seen, both, unseen = noise(112, 140, 4), noise(30, 40, 5), noise(300, 90, 6)

    def batch(images):
        return processor(
            text=[text] * len(images), images=[[i] for i in images], return_tensors="pt", padding=True
        )

    first, second = batch([seen, both]), batch([both, unseen])
    units = LFM2_VL.image_units(second["pixel_values"], second["spatial_shapes"])
    assert len(units) == second["pixel_values"].shape[0] == 1 + 3 + 1  # 40x30 whole; 1x3 tiles, a thumbnail
    pixels, shapes, mask = LFM2_VL.batch_image_units(units[1:])
    assert torch.equal(mask, second["pixel_attention_mask"][1:]) and torch.equal(
        shapes, second["spatial_shapes"][1:]
    )
    with torch.no_grad():
        expected = model(**second).logits
    cache = VisionFeatureCache(tmp_path, model, LFM2_VL).install()
    with torch.no_grad():
        model(**first)
        assert (cache.hits, cache.misses) == (0, 4 + 1 + 1)
        cached = model(**second).logits
    assert (cache.hits, cache.misses) == (1, 6 + 4), "the 40x30 image read, the 90x300 one's 4 tiles computed"
    assert torch.equal(cached, expected)


def run(tmp_path, recipe: str, *overrides: str) -> int:
    args = ["--recipe", recipe, "--output-dir", str(tmp_path), "--run-name", "t", *TINY_RUN, f"model={MODEL}"]
    return main([*args, *overrides])


def test_padding_free_is_refused_at_the_data_check_with_the_reason(tmp_path, capsys):
    assert run(tmp_path, "r1-llm-only", "training.padding_free=true") == 2
    err = capsys.readouterr().err
    assert "training.padding_free is refused for lfm2-vl" in err and "short-convolution layers" in err
    assert "padding_free: false" in err and "loading" not in err, "refused before the model loads"


def test_the_loss_positions_cut_takes_a_last_attention_layer_and_refuses_a_convolution_one(model_dir):
    """The tiny model ends in an attention layer, which LFM2's names for its parts make cuttable (tests/
    test_speedups.py proves the cut on it); LFM2-VL-1.6B ends in a short-convolution layer, refused by its parts."""
    tiny = AutoModelForImageTextToText.from_pretrained(model_dir)
    assert loss_positions_refusal(tiny, LFM2_VL.decoder_layer) is None
    assert loss_positions_refusal(tiny) is not None, "transformers' default names would not find its parts"
    fields = dict(json.loads((REPO / "tests" / "published" / "lfm2_vl.json").read_text())["config"])
    published = build_on_meta(AutoConfig.for_model(fields.pop("model_type"), **fields))
    refusal = loss_positions_refusal(published, LFM2_VL.decoder_layer)
    assert (
        refusal
        and "(Lfm2DecoderLayer) has parts ['conv', 'feed_forward', 'ffn_norm', 'operator_norm']" in refusal
    )


def test_the_benchmark_refuses_it_for_want_of_its_flop_formula(capsys, private_demo_cache):
    from vlm_recipes.benchmarking.sft_vs_trl import main as bench

    assert bench(["--model", MODEL, "--rows", "2", "--stages", "llm-lora"]) == 2
    err = capsys.readouterr().err
    assert "lfm2-vl: FLOP counts need a formula for its short-convolution decoder layers" in err
    assert "Traceback" not in err


@pytest.mark.e2e
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_two_stage_recipe_with_the_feature_cache_runs_end_to_end(model_dir, tmp_path, precision):
    """r3-two-stage (the tower in full, then LoRA on the 4-bit language model) with the vision feature cache in
    stage 2, where the tower is frozen: both stages finish, each trains exactly its roles, stage 2 fills the
    cache, and the precision decision is the one asked for."""
    cache = "stages.llm-lora.training.vision_feature_cache=true"
    assert run(tmp_path, "r3-two-stage", cache, f"precision={precision}") == 0
    manifest = read_json(tmp_path / "r3-two-stage" / "t" / "run.json")
    assert manifest["status"] == "finished"
    for stage, recipe_stage in zip(manifest["stages"], manifest["resolved_recipe"]["stages"], strict=True):
        report = read_json(Path(stage["dir"]) / "report.json")
        assert report["family"] == "lfm2-vl" and stage["steps"] == 2
        assert {d["guard"]: d["choice"] for d in report["decisions"]}["precision"] == precision
        assert_stage_trained_its_roles(stage, recipe_stage, LFM2_VL)
    metrics = read_json(Path(manifest["stages"][1]["dir"]) / "metrics.json")
    assert metrics["vision_feature_cache"]["misses"] > 0
