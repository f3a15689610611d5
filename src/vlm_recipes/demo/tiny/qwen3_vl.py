"""The tiny offline Qwen3-VL (`demo:tiny-qwen3-vl`): Qwen2-VL's special tokens plus Qwen3's added ones,
16 px patches, a Qwen3 text model with interleaved mRoPE, DeepStack levels."""

from __future__ import annotations

from pathlib import Path

from vlm_recipes.demo.tiny import qwen_generation, qwen_tokenizer, save_tiny_model
from vlm_recipes.demo.tiny.qwen2_vl import QWEN_VL_SPECIAL_TOKENS, qwen_text_config, qwen_vision_token_ids

# Qwen3's added tokens that are not special (kept by decode(skip_special_tokens=True)), in its order.
QWEN3_ADDED_TOKENS = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
MIN_PIXELS = 32 * 32 * 4  # at least 4 merged image tokens per image (the most: the dims' max_pixels)


def qwen3_vl_processor(corpus: list[str], dims: dict, chat_template: str, qwen3_5: bool = False):
    """Qwen3-VL's processor (also transformers' processor for Qwen3.5): a tokenizer with the Qwen-VL special
    tokens and Qwen3's added ones (`qwen3_5`: Qwen3.5's tokenizer class and pre-tokenizer) and
    `chat_template`; 16 px patches merged 2x2, between MIN_PIXELS and the dims' max_pixels, mean and std 0.5
    as in their preprocessor_config.json (Qwen2-VL: the CLIP mean/std)."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    tok = qwen_tokenizer(corpus, QWEN_VL_SPECIAL_TOKENS, QWEN3_ADDED_TOKENS, qwen3_5=qwen3_5)
    tok.chat_template = chat_template
    size = {"shortest_edge": MIN_PIXELS, "longest_edge": dims["max_pixels"]}
    half = [0.5, 0.5, 0.5]
    return Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(
            size=size, patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=half, image_std=half
        ),
        tokenizer=tok,
        video_processor=Qwen3VLVideoProcessor(size=size, image_mean=half, image_std=half),
        chat_template=chat_template,
    )


def build_tiny_qwen3_vl(out: Path, dims: dict, corpus: list[str]) -> None:
    import transformers
    from trl.chat_template_utils import qwen3_vl_chat_template

    # Qwen3-VL-*-Instruct's template (TRL's qwen3_vl), which TRL swaps for its training variant with
    # {% generation %} markers for assistant-only loss.
    processor = qwen3_vl_processor(corpus, dims, qwen3_vl_chat_template)
    tok = processor.tokenizer
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_VL_SPECIAL_TOKENS}
    config = transformers.Qwen3VLConfig(
        text_config=qwen_text_config(
            tok,
            dims,
            ids,
            head_dim=dims["head_dim"],
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 5e6,
                "mrope_section": dims["mrope"],
                "mrope_interleaved": True,
            },
        ),
        vision_config=qwen3_vision_config(dims, deepstack_visual_indexes=dims["deepstack"]),
        **qwen_vision_token_ids(ids),
        tie_word_embeddings=dims.get("tie_embeddings", False),
    )
    save_tiny_model(
        out, transformers.Qwen3VLForConditionalGeneration, config, processor, dims, **qwen_generation(ids)
    )


def qwen3_vision_config(dims: dict, **extra) -> dict:
    """Qwen3-VL's tower (Qwen3.5's too, without DeepStack): 16 px patches, learned positions; `extra` adds
    keys."""
    return {
        "depth": dims["vision_depth"],
        "hidden_size": dims["vision_dim"],
        "intermediate_size": dims["vision_intermediate"],
        "num_heads": dims["vision_heads"],
        "out_hidden_size": dims["hidden"],  # merger output = text hidden size
        "num_position_embeddings": dims["vision_positions"],
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        **extra,
    }


# What build_tiny_qwen3_vl builds, one dict per demo model (demo/models.py: DEMO_MODELS)
TINY = {
    "hidden": 64,
    "intermediate": 128,
    # 3 layers: a DeepStack level is added after text layer N, and one added after the last layer would
    # reach only the (unlabelled) image positions' logits, so it would never get a gradient
    "layers": 3,
    "heads": 4,
    "kv_heads": 2,
    "head_dim": 16,
    # 8 rotary frequencies, interleaved t/h/w: Qwen3-VL's [24, 20, 20] of 64, scaled
    "mrope": [4, 2, 2],
    "vision_depth": 3,
    "vision_dim": 32,
    "vision_intermediate": 64,
    "vision_heads": 2,
    "vision_positions": 64,  # an 8x8 learned grid (the real one: 48x48 = 2304)
    # two levels after intermediate layers, never the last, like the real [5, 11, 17] of 24 layers
    "deepstack": [0, 1],
    "max_pixels": 32 * 32 * 16,  # at most 16 merged image tokens per image: fast on CPU
}
