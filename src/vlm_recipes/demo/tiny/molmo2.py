"""The tiny offline Molmo2 (`demo:tiny-molmo2`): a Qwen2 tokenizer (Molmo2-4B's text model is Qwen3-4B) whose
Molmo tokens sit past the language model's vocabulary as in the published one, Molmo2Processor with its
overlapping crops (a low-res view, then high-res crops, pooled 2x2, <im_col> after each row), a SigLIP2-style
ViT whose layers are read by the attention-pooling adapter, a Qwen3-style text model."""

from __future__ import annotations

from pathlib import Path

from vlm_recipes.demo.tiny import (
    TinyModel,
    generation_ids,
    qwen_tokenizer_from,
    save_tiny_model,
    train_qwen_bpe,
)
from vlm_recipes.demo.tiny.dims import TINY_TEXT_DIMS, TINY_VISION_DIMS, tiny_text_config, tiny_vision_config

MIRRORS = "allenai/Molmo2-4B"

# Qwen3's chat tokens, numbered right after the BPE vocab as Qwen numbers them (<|endoftext|> pad, <|im_end|> eos;
# Molmo2's conversion sets bos = eos, and the processor prepends it to every prompt)
QWEN_CHAT_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# allenai/molmo2 olmo/tokenizer.py EXTRA_TOKENS (the 10 of Molmo2), in its order. The published tokenizer pads
# Qwen3's 151669 tokens with |<EXTRA_TOKENS_i>| up to the text model's vocab_size (151936), so these get
# 151936.. (<im_start> 151936, <im_end> 151937, <im_patch> 151938, ...): ids the embedding's
# additional_vocab_size rows cover but the lm_head (vocab_size rows) can never predict.
MOLMO2_TOKENS = (
    "<im_start>",
    "<im_end>",
    "<im_patch>",
    "<im_col>",
    "<low_res_im_start>",
    "<|image|>",
    "<im_low>",
    "<frame_start>",
    "<frame_end>",
    "<|video|>",
)


def molmo2_tokenizer(corpus: list[str]):
    """A Qwen2Tokenizer (the class of Molmo2-4B's tokenizer_config.json) around a BPE trained on `corpus` with
    Qwen's pre-tokenizer: the BPE vocab, Qwen's chat tokens, |<EXTRA_TOKENS_i>| up to a multiple of 64 (the
    text model's vocab_size), then MOLMO2_TOKENS. Returns (tokenizer, vocab_size)."""
    vocab, merges = train_qwen_bpe(corpus, QWEN_CHAT_TOKENS)
    vocab_size = -(-len(vocab) // 64) * 64
    padding = tuple(f"|<EXTRA_TOKENS_{i}>|" for i in range(vocab_size - len(vocab)))
    for token in (*padding, *MOLMO2_TOKENS):
        vocab[token] = len(vocab)
    extra_special = ["<|im_start|>", *padding, *MOLMO2_TOKENS]
    tok = qwen_tokenizer_from(vocab, merges, extra_special, bos_token="<|im_end|>")
    return tok, vocab_size


def build_tiny_molmo2(out: Path, dims: dict, corpus: list[str]) -> None:
    """With the published checkpoints' chat template (MOLMO2_CHAT_TEMPLATE)."""
    import transformers

    # the published checkpoints' chat template, byte for byte (the family module holds it, with the
    # training variant stages use: its last answer ends with <|im_end|>, each answer marked for the loss)
    from vlm_recipes.families.molmo2 import MOLMO2_CHAT_TEMPLATE

    tok, vocab_size = molmo2_tokenizer(corpus)
    tok.chat_template = MOLMO2_CHAT_TEMPLATE
    crop, patch = dims["crop"], 14
    size = {"height": crop, "width": crop}
    processor = transformers.Molmo2Processor(
        # as convert_molmo2_to_hf.py writes Molmo2-4B's but for the crop size and margins: 14 px patches
        # pooled 2x2, up to 8 overlapping crops (+ the low-res view), bilinear, ImageNet-standard mean/std (0.5)
        image_processor=transformers.Molmo2ImageProcessor(
            size=size,
            max_crops=dims["max_crops"],
            overlap_margins=dims["margins"],
            patch_size=patch,
            pooling_size=[2, 2],
        ),
        # frames pooled 3x3 as the published; 4 frames at most (the published: 64)
        video_processor=transformers.Molmo2VideoProcessor(
            size=size, patch_size=patch, pooling_size=[3, 3], num_frames=4
        ),
        tokenizer=tok,
        chat_template=MOLMO2_CHAT_TEMPLATE,
        # the published processor_config.json's: no <im_col> in the low-res view, which starts with
        # <low_res_im_start>; every call also returns mm_token_type_ids (required by the model in training)
        image_use_col_tokens=True,
        use_single_crop_col_tokens=False,
        use_single_crop_start_token=True,
        video_use_col_tokens=False,
        use_frame_special_tokens=True,
    )
    ids = {t: tok.convert_tokens_to_ids(t) for t in (*QWEN_CHAT_TOKENS, *MOLMO2_TOKENS)}
    head_dim = dims["hidden"] // dims["heads"]
    vision_head_dim = dims["vision_dim"] // dims["vision_heads"]
    config = transformers.Molmo2Config(
        text_config=tiny_text_config(
            tok,
            dims,
            model_type="molmo2_text",
            vocab_size=vocab_size,  # the Molmo tokens are past it, in the additional_vocab_size rows
            additional_vocab_size=128,
            head_dim=head_dim,
            qk_norm_type="qwen3",
            attention_bias=False,
            rope_parameters={"rope_type": "default", "rope_theta": 5e6},  # Qwen3-4B-Instruct-2507's
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
        vision_config=tiny_vision_config(
            dims,
            model_type="molmo2_vision",
            num_key_value_heads=dims["vision_heads"],
            head_dim=vision_head_dim,
            hidden_act="gelu_pytorch_tanh",
            image_size=[crop, crop],  # one position embedding per patch of a crop, never interpolated
            patch_size=patch,
        ),
        adapter_config={
            "model_type": "molmo2_adapter",
            # the published reads ViT layers [-3, -9] of 27 (kept: 25), concatenated; here the last two
            "vision_feature_layer": [-1, -2],
            "hidden_size": dims["vision_dim"],
            "num_attention_heads": dims["vision_heads"],
            "num_key_value_heads": dims["vision_heads"],
            "head_dim": vision_head_dim,
            "hidden_act": "silu",
            "intermediate_size": dims["intermediate"],  # the published: the text model's (9728)
            "text_hidden_size": dims["hidden"],
        },
        image_start_token_id=ids["<im_start>"],
        low_res_image_start_token_id=ids["<low_res_im_start>"],
        image_end_token_id=ids["<im_end>"],
        image_patch_id=ids["<im_patch>"],
        frame_start_token_id=ids["<frame_start>"],
        frame_end_token_id=ids["<frame_end>"],
        tie_word_embeddings=False,
    )
    generation = generation_ids(tok, eos="<|im_end|>", pad="<|endoftext|>", bos="<|im_end|>")
    save_tiny_model(out, transformers.Molmo2ForConditionalGeneration, config, processor, dims, **generation)


# What build_tiny_molmo2 builds, one dict per demo model (BUILDS below)
TINY = {
    **TINY_TEXT_DIMS,
    **TINY_VISION_DIMS,
    # crops of 56 px: 4x4 patches of 14 px (the real: 378 px, 27x27), overlapping by 1 patch each side (the
    # real: 4): a low-res view of 2x2 pooled tokens, then up to 8 crops tiling 28 px windows
    "crop": 56,
    "margins": [1, 1],
    "max_crops": 8,
}


# The demo models this module builds: demo id -> what it builds (demo/models.py finds them here)
BUILDS = {
    "demo:tiny-molmo2": TinyModel("molmo2", build_tiny_molmo2, TINY),
}
