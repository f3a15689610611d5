"""The tiny offline LLaVA-OneVision (`demo:tiny-llava-onevision`): a Qwen2 tokenizer with the two tokens
the llava-hf conversion adds, anyres tiles through a SigLIP tower, a Qwen2 text model."""

from __future__ import annotations

from pathlib import Path

from vlm_recipes.demo.tiny import TinyModel, qwen_generation, qwen_tokenizer, save_tiny_model
from vlm_recipes.demo.tiny.dims import (
    TINY_TEXT_DIMS,
    TINY_VISION_DIMS,
    siglip_vision_config,
    tiny_text_config,
)

# Qwen2's chat tokens (<|endoftext|> pad, <|im_end|> eos), then the two the llava-hf conversion adds
LLAVA_ONEVISION_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>")


def build_tiny_llava_onevision(out: Path, dims: dict, corpus: list[str]) -> None:
    """With the published checkpoints' chat template (the family's LLAVA_ONEVISION_CHAT_TEMPLATE)."""
    import transformers

    from vlm_recipes.families.llava_onevision import LLAVA_ONEVISION_CHAT_TEMPLATE

    tok = qwen_tokenizer(corpus, LLAVA_ONEVISION_SPECIAL_TOKENS)
    tok.chat_template = LLAVA_ONEVISION_CHAT_TEMPLATE
    side = dims["tile"]
    size = {"height": side, "width": side}
    processor = transformers.LlavaOnevisionProcessor(
        image_processor=transformers.LlavaOnevisionImageProcessor(
            size=size, image_grid_pinpoints=dims["pinpoints"]
        ),
        tokenizer=tok,
        video_processor=transformers.LlavaOnevisionVideoProcessor(size=size),
        num_image_tokens=(side // 14) ** 2,
        vision_feature_select_strategy="full",
        chat_template=LLAVA_ONEVISION_CHAT_TEMPLATE,
        vision_aspect_ratio=dims["aspect_ratio"],
    )
    ids = {t: tok.convert_tokens_to_ids(t) for t in LLAVA_ONEVISION_SPECIAL_TOKENS}
    config = transformers.LlavaOnevisionConfig(
        text_config=tiny_text_config(
            tok,
            dims,
            model_type="qwen2",
            rope_theta=1e6,
            **qwen_generation(ids),  # the same pad and eos, no bos
            tie_word_embeddings=False,
        ),
        vision_config=siglip_vision_config(dims, image_size=side),
        image_token_index=ids["<image>"],
        video_token_index=ids["<video>"],
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
        image_grid_pinpoints=dims["pinpoints"],
        vision_aspect_ratio=dims["aspect_ratio"],
        tie_word_embeddings=False,
    )
    save_tiny_model(
        out,
        transformers.LlavaOnevisionForConditionalGeneration,
        config,
        processor,
        dims,
        **qwen_generation(ids),
    )


# What build_tiny_llava_onevision builds, one dict per demo model (BUILDS below)
TINY = {
    **TINY_TEXT_DIMS,
    **TINY_VISION_DIMS,
    "tile": 28,  # 2x2 patches of 14 px: 4 tokens per tile (the real: 384 px, 27x27 = 729)
    # up to 2x2 tiles (the real: up to 6x6 of 384 px); anyres_max_2 (the real: 9) so that a 2x2 grid is
    # scaled down and the interpolation branch runs too. An image: 4 + at most 16 + 4 tokens.
    "pinpoints": [[28, 28], [28, 56], [56, 28], [56, 56], [28, 84], [84, 28]],
    "aspect_ratio": "anyres_max_2",
}


# The demo models this module builds: demo id -> what it builds (demo/models.py finds them here)
BUILDS = {
    "demo:tiny-llava-onevision": TinyModel("llava_onevision", build_tiny_llava_onevision, TINY),
}
