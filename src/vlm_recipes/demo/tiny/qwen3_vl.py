"""The tiny offline Qwen3-VL (`demo:tiny-qwen3-vl`): Qwen2-VL's special tokens plus Qwen3's added ones,
16 px patches, a Qwen3 text model with interleaved mRoPE, DeepStack levels."""

from __future__ import annotations

from pathlib import Path

from vlm_recipes.demo.tiny import TinyModel, qwen_tokenizer
from vlm_recipes.demo.tiny.qwen2_vl import (
    QWEN_VL_SPECIAL_TOKENS,
    qwen_text_config,
    qwen_vision_config,
    save_qwen_vl,
)

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
    text = qwen3_text_config(processor.tokenizer, dims, rope_theta=5e6)
    tower = qwen3_vision_config(dims, deepstack_visual_indexes=dims["deepstack"])
    save_qwen_vl(out, transformers.Qwen3VLForConditionalGeneration, processor, dims, text, tower)


def qwen3_text_config(tok, dims: dict, rope_theta: float, rope: dict | None = None, **extra) -> dict:
    """Qwen3's text model with interleaved mRoPE (t/h/w frequencies interleaved), as Qwen3-VL and Qwen3.5
    configure it; `rope` adds rotary settings (Qwen3.5's partial rotary factor), `extra` adds keys."""
    rope_parameters = {"rope_type": "default", "rope_theta": rope_theta, **(rope or {})}
    rope_parameters |= {"mrope_section": dims["mrope"], "mrope_interleaved": True}
    return qwen_text_config(tok, dims, head_dim=dims["head_dim"], rope_parameters=rope_parameters, **extra)


def qwen3_vision_config(dims: dict, **extra) -> dict:
    """Qwen3-VL's tower (Qwen3.5's too, without DeepStack): 16 px patches, learned positions; `extra` adds
    keys."""
    return qwen_vision_config(dims, 16, num_position_embeddings=dims["vision_positions"], **extra)


# What build_tiny_qwen3_vl builds, one dict per demo model (BUILDS below)
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


# The demo models this module builds: demo id -> what it builds (demo/models.py finds them here)
BUILDS = {
    "demo:tiny-qwen3-vl": TinyModel("qwen3_vl", build_tiny_qwen3_vl, TINY),
}
