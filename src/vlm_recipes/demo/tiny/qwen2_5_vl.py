"""The tiny offline Qwen2.5-VL (`demo:tiny-qwen2.5-vl`): Qwen2-VL's tokenizer, processor and text model,
the windowed-attention tower."""

from __future__ import annotations

from pathlib import Path

from vlm_recipes.demo.tiny import TINY_TEXT_DIMS, qwen_generation, qwen_tokenizer, save_tiny_model
from vlm_recipes.demo.tiny.qwen2_vl import (
    MIN_PIXELS,
    QWEN_VL_SPECIAL_TOKENS,
    qwen2_text_config,
    qwen_vision_token_ids,
)


def build_tiny_qwen2_5_vl(out: Path, dims: dict, corpus: list[str]) -> None:
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
    )
    from trl.chat_template_utils import qwen2_5_vl_chat_template

    # Qwen2.5-VL's tokenizer has Qwen2-VL's special tokens (plus unused FIM/tool ones left out here).
    tok = qwen_tokenizer(corpus, QWEN_VL_SPECIAL_TOKENS)
    # Qwen2.5-VL-*-Instruct ship this template (TRL's qwen2_5_vl one), which TRL swaps for its training
    # variant with {% generation %} markers for assistant-only loss.
    tok.chat_template = qwen2_5_vl_chat_template
    size = {"shortest_edge": MIN_PIXELS, "longest_edge": dims["max_pixels"]}
    processor = Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=size, patch_size=14, temporal_patch_size=2, merge_size=2),
        tokenizer=tok,
        video_processor=Qwen2VLVideoProcessor(size=size),
        chat_template=qwen2_5_vl_chat_template,
    )
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_VL_SPECIAL_TOKENS}
    config = Qwen2_5_VLConfig(
        text_config=qwen2_text_config(dims, len(tok), ids),
        vision_config={
            "depth": dims["vision_depth"],
            "hidden_size": dims["vision_dim"],
            "intermediate_size": dims["vision_intermediate"],
            "num_heads": dims["vision_heads"],
            "out_hidden_size": dims["hidden"],  # merger output = text hidden size
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": dims["window_size"],
            "fullatt_block_indexes": dims["fullatt_block_indexes"],
            "tokens_per_second": 2,
        },
        **qwen_vision_token_ids(ids),
        tie_word_embeddings=dims.get("tie_embeddings", False),
    )
    save_tiny_model(out, Qwen2_5_VLForConditionalGeneration, config, processor, dims, **qwen_generation(ids))


# What build_tiny_qwen2_5_vl builds, one dict per demo model (demo/models.py: DEMO_MODELS)
TINY = {
    **TINY_TEXT_DIMS,
    "mrope": [2, 3, 3],  # head_dim 16: 8 rotary frequencies over (t, h, w), Qwen2.5-VL's [16, 24, 24] scaled
    "vision_depth": 2,
    "vision_dim": 32,
    "vision_intermediate": 64,
    "vision_heads": 2,
    # 56 px windows (2x2 merged tokens) so the tiny images (up to 4x4 tokens) really are split in windows;
    # layer 0 windowed, layer 1 full, like each group of 8 in the real tower (full at 7, 15, 23, 31)
    "window_size": 56,
    "fullatt_block_indexes": [1],
    "max_pixels": 28 * 28 * 16,  # at most 16 merged image tokens per image: fast on CPU
}
