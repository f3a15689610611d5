"""Qwen2.5-VL: Qwen2-VL's layout, processor and 3-D RoPE, with a different vision tower, and the tiny
offline builder (`demo:tiny-qwen2.5-vl`).

What differs from Qwen2-VL (transformers' models/qwen2_5_vl):
- the tower (`Qwen2_5_VisionTransformerPretrainedModel`): RMSNorm, a gated (SwiGLU) MLP, and windowed
  attention: every layer but those in `fullatt_block_indexes` attends within windows of
  `window_size` pixels (112 px: 4x4 merged tokens), which the FLOP formula counts per window;
- its config names the tower width `hidden_size` and the merger output `out_hidden_size` (Qwen2-VL:
  `embed_dim` and `hidden_size`);
- `get_rope_index` also takes `second_per_grid_ts` (video timing; images need none).
The module names (`model.visual`, `model.visual.merger`, `model.language_model`, `lm_head`), the image
processor (Qwen2VLImageProcessor, 14 px patches, 2x2 merge) and the chat template are Qwen2-VL's.
"""

from __future__ import annotations

from pathlib import Path

from vlm_recipes.families.base import VisionGeometry
from vlm_recipes.families.qwen2_vl import (
    QWEN_VL_ROLES,
    QWEN_VL_SPECIAL_TOKENS,
    Qwen2VLFamily,
    qwen2_text_config,
    qwen_vision_token_ids,
    save_tiny_model,
)
from vlm_recipes.families.tiny import TINY_TEXT_DIMS, qwen_tokenizer

_MIN_PIXELS, _MAX_PIXELS = 28 * 28 * 4, 28 * 28 * 16  # 4..16 merged image tokens per image: fast on CPU


class Qwen2_5_VLFamily(Qwen2VLFamily):  # noqa: N801 (transformers' spelling)
    """Qwen2.5-VL: Qwen2-VL with a windowed-attention tower."""

    def vision_geometry(self, config) -> VisionGeometry:
        vision = config.vision_config
        merge = vision.spatial_merge_size
        return VisionGeometry(
            patches_per_token=merge**2,
            width=vision.hidden_size,
            layers=vision.depth,
            # get_vision_window_index: a window is window_size // merge // patch_size merged tokens a side
            window=vision.window_size // merge // vision.patch_size,
            full_attention_layers=len({i for i in vision.fullatt_block_indexes if 0 <= i < vision.depth}),
        )

    def build_tiny(self, out: Path, dims: dict, corpus: list[str]) -> None:
        build_tiny_qwen2_5_vl(out, dims, corpus)


_TINY = {
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
    "max_pixels": _MAX_PIXELS,
}


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
    size = {"shortest_edge": _MIN_PIXELS, "longest_edge": dims["max_pixels"]}
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
    save_tiny_model(out, Qwen2_5_VLForConditionalGeneration, config, processor, ids, dims)


QWEN2_5_VL = Qwen2_5_VLFamily(
    name="qwen2.5-vl",
    model_types=("qwen2_5_vl",),
    role_prefixes=QWEN_VL_ROLES,
    lm_head_prefixes=("lm_head",),
    demo_models={"demo:tiny-qwen2.5-vl": _TINY},
)
