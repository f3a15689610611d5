"""The tiny offline Qwen2.5-VL (`demo:tiny-qwen2.5-vl`): Qwen2-VL's tokenizer, processor and text model,
the windowed-attention tower."""

from __future__ import annotations

from pathlib import Path

from vlm_recipes.demo.tiny import TinyModel
from vlm_recipes.demo.tiny.dims import TINY_TEXT_DIMS
from vlm_recipes.demo.tiny.qwen2_vl import (
    qwen2_text_config,
    qwen2_vl_processor,
    qwen_vision_config,
    save_qwen_vl,
)


def build_tiny_qwen2_5_vl(out: Path, dims: dict, corpus: list[str]) -> None:
    import transformers

    # Qwen2-VL's special tokens (Qwen2.5-VL's unused FIM/tool ones left out), template and image processor
    processor = qwen2_vl_processor(transformers.Qwen2_5_VLProcessor, corpus, dims)
    tower = qwen_vision_config(
        dims,
        14,
        window_size=dims["window_size"],
        fullatt_block_indexes=dims["fullatt_block_indexes"],
        tokens_per_second=2,
    )
    text = qwen2_text_config(processor.tokenizer, dims)
    save_qwen_vl(out, transformers.Qwen2_5_VLForConditionalGeneration, processor, dims, text, tower)


# What build_tiny_qwen2_5_vl builds, one dict per demo model (BUILDS below)
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


# The demo models this module builds: demo id -> what it builds (demo/models.py finds them here)
BUILDS = {
    "demo:tiny-qwen2.5-vl": TinyModel("qwen2_5_vl", build_tiny_qwen2_5_vl, TINY),
}
