"""The tiny offline InternVL 3.5 (`demo:tiny-internvl`): Qwen3's tokenizer with InternVL's image tokens (<img>,
</img>, <IMG_CONTEXT>, ...), GotOcr2's dynamic tiling (small tiles plus a thumbnail), an InternViT tower with
pixel shuffle 0.5 into an MLP projector, a Qwen3 text model."""

from __future__ import annotations

from pathlib import Path

from vlm_recipes.demo.tiny import (
    TinyModel,
    qwen_generation,
    qwen_tokenizer_from,
    save_tiny_model,
    train_qwen_bpe,
)
from vlm_recipes.demo.tiny.dims import TINY_TEXT_DIMS, TINY_VISION_DIMS, tiny_text_config, tiny_vision_config
from vlm_recipes.demo.tiny.qwen3_vl import QWEN3_ADDED_TOKENS

# Qwen3's special tokens as InternVL3.5 keeps them (<|endoftext|> pad, <|im_end|> eos), then the tokens the
# InternVL -HF conversion adds in this order (OpenGVLab/InternVL internvl_chat/tools/internvl_custom2hf.py and
# transformers' convert_internvl_weights_to_hf.py: <img> ... </box>, then <video>)
QWEN3_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
INTERNVL_TOKENS = (
    "<img>",
    "</img>",
    "<IMG_CONTEXT>",
    "<quad>",
    "</quad>",
    "<ref>",
    "</ref>",
    "<box>",
    "</box>",
    "<video>",
)
# the tokenizer's named tokens InternVLProcessor reads (tokenizer.start_image_token, ...)
NAMED_TOKENS = {
    "start_image_token": "<img>",
    "end_image_token": "</img>",
    "context_image_token": "<IMG_CONTEXT>",
    "video_token": "<video>",
}
# InternVL's normalization (ImageNet mean and std, the -HF preprocessor_config.json's)
IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def internvl_tokenizer(corpus: list[str]):
    """A Qwen2Tokenizer (Qwen3's class) around a BPE trained on `corpus`: Qwen's special tokens, Qwen3's
    added ones (<think>, ...), InternVL's image tokens, numbered in that order after the BPE vocab."""
    from tokenizers import AddedToken

    vocab, merges = train_qwen_bpe(corpus, (*QWEN3_SPECIAL_TOKENS, *QWEN3_ADDED_TOKENS, *INTERNVL_TOKENS))
    tok = qwen_tokenizer_from(vocab, merges, NAMED_TOKENS, not_special=QWEN3_ADDED_TOKENS)
    # already in the vocab: they keep their ids, are never split, and are special (skipped when decoding)
    tok.add_tokens(
        [AddedToken(t, special=True, normalized=False) for t in INTERNVL_TOKENS], special_tokens=True
    )
    return tok


def build_tiny_internvl(out: Path, dims: dict, corpus: list[str]) -> None:
    """With the published checkpoints' chat template (the family's INTERNVL_CHAT_TEMPLATE)."""
    import transformers

    from vlm_recipes.families.internvl import INTERNVL_CHAT_TEMPLATE

    tok = internvl_tokenizer(corpus)
    tok.chat_template = INTERNVL_CHAT_TEMPLATE
    tile, patch = dims["tile"], dims["patch"]
    size = {"height": tile, "width": tile}
    tokens_per_tile = (tile // patch) ** 2 // 4  # pixel shuffle 0.5: 2x2 patches into one token
    processor = transformers.InternVLProcessor(
        image_processor=transformers.GotOcr2ImageProcessor(
            size=size,
            crop_to_patches=True,
            min_patches=1,
            max_patches=dims["max_patches"],
            image_mean=IMAGENET_MEAN,
            image_std=IMAGENET_STD,
        ),
        tokenizer=tok,
        video_processor=transformers.InternVLVideoProcessor(
            size=size, image_mean=IMAGENET_MEAN, image_std=IMAGENET_STD
        ),
        image_seq_length=tokens_per_tile,
        chat_template=INTERNVL_CHAT_TEMPLATE,
    )
    ids = {t: tok.convert_tokens_to_ids(t) for t in (*QWEN3_SPECIAL_TOKENS, *INTERNVL_TOKENS)}
    config = transformers.InternVLConfig(
        text_config=tiny_text_config(
            tok,
            dims,
            model_type="qwen3",
            head_dim=dims["hidden"] // dims["heads"],
            rope_theta=1e6,
            **qwen_generation(ids),  # the same pad and eos, no bos
            tie_word_embeddings=False,
        ),
        vision_config=tiny_vision_config(
            dims,
            image_size=tile,
            patch_size=patch,
            # InternViT-300M's (internvl_custom2hf.py's vit_300m_config): biased qkv, LayerNorm, no qk norm
            attention_bias=True,
            norm_type="layer_norm",
            use_qk_norm=False,
            use_mean_pooling=True,
        ),
        image_token_id=ids["<IMG_CONTEXT>"],
        image_seq_length=tokens_per_tile,
        downsample_ratio=0.5,
        projector_hidden_act="gelu",
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,  # the published lm_head is its own matrix (InternVLConfig defaults to tied)
    )
    save_tiny_model(
        out, transformers.InternVLForConditionalGeneration, config, processor, dims, **qwen_generation(ids)
    )


# What build_tiny_internvl builds, one dict per demo model (BUILDS below)
TINY = {
    **TINY_TEXT_DIMS,
    **TINY_VISION_DIMS,
    "tile": 56,  # 4x4 patches of 14 px, shuffled to 2x2 = 4 tokens a tile (the real: 448 px, 256 tokens)
    "patch": 14,
    "max_patches": 6,  # up to 6 tiles and a thumbnail (the real: 12): at most 28 tokens an image
}


# The demo models this module builds: demo id -> what it builds (demo/models.py finds them here)
BUILDS = {
    "demo:tiny-internvl": TinyModel("internvl", build_tiny_internvl, TINY),
}
