"""Gemma 3 (families/gemma3.py): what differs from the Qwen line, on the tiny model (`demo:tiny-gemma3`).

The tests every family shares run on it too (tiny_family in tests/test_families.py, test_speedups.py,
test_dpo.py); here: exact token counts around images (newlines, boundaries, pan-and-scan crops), pixel
bounds that do not apply, the image tokens' bidirectional attention reaching training, and padding-free
packing refused with its reason. (The seed recipes run on it in test_families.py; r4's `projector: lora`
trains its bare projector matrix fully, a `lora-role` decision in report.json.)
"""

from __future__ import annotations

from pathlib import Path

import datasets
import pytest
import torch
from conftest import (
    TINY_MODELS,
    assert_image_tokens_attend_both_ways,
    assert_padding_free_refused_before_loading,
    demo_split,
)
from PIL import Image
from test_families import TINY_RUN
from transformers import AutoProcessor
from trl.chat_template_utils import get_training_chat_template
from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

from vlm_recipes.cli.train import main
from vlm_recipes.data.lengths import sample_lengths
from vlm_recipes.families.gemma3 import GEMMA3
from vlm_recipes.model.build import load_processor
from vlm_recipes.recipes.schema import DataSettings

MODEL = TINY_MODELS["gemma3"]
# (height, width): tiny, square, wide 4:1, tall 1:4, and larger than the seed recipes' max_pixels (448x448)
SIZES = {"tiny": (12, 12), "square": (448, 448), "wide": (100, 400), "tall": (400, 100), "huge": (1200, 1600)}


@pytest.fixture(scope="module")
def model_dir(private_demo_cache) -> Path:
    from vlm_recipes.demo.models import ensure_demo_model

    return ensure_demo_model(MODEL)


def chat(images: list[Image.Image], text: str = "Which colour is the shape?") -> list[dict]:
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    return [
        {"role": "user", "content": content},
        {"role": "assistant", "content": [{"type": "text", "text": "red"}]},
    ]


def rows_of_every_size() -> list[dict]:
    images = {name: Image.new("RGB", (w, h), (200, 30, 30)) for name, (h, w) in SIZES.items()}
    rows = [{"messages": chat([image]), "images": [image]} for image in images.values()]
    two = [images["wide"], images["tall"]]
    rows.append({"messages": chat(two, "Compare them."), "images": two})  # two images in one row
    rows.append({"messages": chat([], "Say red."), "images": []})  # text only
    return rows


@pytest.mark.parametrize("pan_and_scan", [False, True], ids=["plain", "pan-and-scan"])
def test_lengths_are_exactly_the_processors_for_every_size_and_aspect(model_dir, pan_and_scan):
    """family.count_tokens (through sample_lengths, as the length check runs it) against what
    Gemma3Processor tokenizes: "\\n\\n<start_of_image>" + N image tokens + "<end_of_image>\\n\\n" per image
    and per pan-and-scan crop, the newlines merged by the tokenizer as they fall."""
    processor = load_processor(str(model_dir), DataSettings(max_pixels=200704), GEMMA3)
    if pan_and_scan:  # on, the processor's way (its images_kwargs); crops from 32 px, so small images crop
        images_kwargs = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 32}
        processor.images_kwargs = {**type(processor).images_kwargs, **images_kwargs}
    rows = rows_of_every_size()
    ds = datasets.Dataset.from_list(rows)
    for row, counted in zip(rows, sample_lengths(ds, processor, GEMMA3), strict=True):
        text = processor.apply_chat_template(row["messages"], tokenize=False)
        out = processor(
            text=[text], images=[row["images"]] if row["images"] else None, add_special_tokens=False
        )
        assert len(out["input_ids"][0]) == counted, (pan_and_scan, [im.size for im in row["images"]])
        if row["images"]:
            crops = [GEMMA3.crops(processor, im.height, im.width) for im in row["images"]]
            own = processor.image_processor(images=row["images"], **processor.images_kwargs)["num_crops"]
            assert own == crops  # the image processor's own rule
    if pan_and_scan:  # the wide and tall images were cropped (4:1 -> 4 crops), the square ones not
        crops = [GEMMA3.crops(processor, *SIZES[k]) for k in ("square", "wide", "tall", "huge")]
        assert crops == [0, 4, 4, 2]  # 4:3 passes the 1.2 ratio: at least 2 crops


def test_pixel_bounds_do_not_apply_every_image_is_one_fixed_square(model_dir):
    plain = AutoProcessor.from_pretrained(model_dir)
    bounded = load_processor(str(model_dir), DataSettings(min_pixels=100, max_pixels=200704), GEMMA3)
    assert bounded.image_processor.size == plain.image_processor.size == {"height": 56, "width": 56}
    counts = GEMMA3.image_token_counts(bounded, list(SIZES.values()))
    assert counts == [bounded.image_seq_length] * len(SIZES) == [4] * len(SIZES)


def test_image_tokens_are_marked_for_bidirectional_attention_in_training_batches(model_dir):
    """TRL's collator passes the processor's token_type_ids (1 on image tokens), from which Gemma 3 lets an
    image's tokens attend to each other both ways: with them, the first image token's output changes (it
    sees the later tokens of its image) while the text before the image is untouched."""
    processor = AutoProcessor.from_pretrained(model_dir)
    collator = DataCollatorForVisionLanguageModeling(
        processor, assistant_only_loss=True, chat_template=get_training_chat_template(processor)
    )
    rows = [dict(r) for r in demo_split("demo:train", "train", 2)[0]][::-1]  # one image, then two (pair)
    batch = collator(rows)
    is_image = batch["input_ids"] == processor.tokenizer.image_token_id
    assert torch.equal(batch["token_type_ids"].bool(), is_image) and is_image.sum(1).tolist() == [4, 8]
    assert_image_tokens_attend_both_ways(model_dir, batch, is_image, "token_type_ids")


def run(tmp_path, recipe: str, *overrides: str) -> int:
    args = ["--recipe", recipe, "--output-dir", str(tmp_path), "--run-name", "t", *TINY_RUN, f"model={MODEL}"]
    return main([*args, *overrides])


def test_padding_free_is_refused_at_the_data_check_with_the_reason(tmp_path, capsys):
    code = run(tmp_path, "r1-llm-only", "training.padding_free=true")
    assert_padding_free_refused_before_loading(code, capsys.readouterr().err, "gemma3")


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_the_tiny_gemma_tokenizers_cut_pieces_as_gemmas_sentencepiece_does(family, private_demo_cache):
    """Gemma's SentencePiece splits digits and never makes a piece across words: `50` is `5`, `0`, and a word
    is one piece with its "▁" in front. The tiny tokenizers were once trained on whole texts, learned pieces
    like `0,"fat_g":1`, and Gemma's demo models then learned the demo far worse than every other family."""
    from vlm_recipes.demo.models import ensure_demo_model

    tokenizer = AutoProcessor.from_pretrained(ensure_demo_model(TINY_MODELS[family])).tokenizer
    text = '{"calories":50,"fat_g":14} Is it a square or a triangle?'
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids) == [
        '{"', "calories", '":', "5", "0", ',"', "fat", "_", "g", '":', "1", "4", "}",
        "▁Is", "▁it", "▁a", "▁square", "▁or", "▁a", "▁triangle", "?",
    ]  # fmt: skip
    assert tokenizer.decode(ids) == text
    pieces = [piece for piece in tokenizer.get_vocab() if not piece.startswith("<")]
    assert not [piece for piece in pieces if any(c.isdigit() for c in piece) and len(piece) > 1]
    assert not [piece for piece in pieces if "▁" in piece[1:]]
