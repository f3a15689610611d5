"""The tiny offline LFM2-VL (`demo:tiny-lfm2-vl`): LFM2's byte-level BPE (Llama 3's pre-tokenizer, the
control tokens numbered first, <|startoftext|> added in front), Lfm2VlProcessor with its <image> runs
between <|image_start|> / <|image_end|>, row/column-marked tiles and a thumbnail for larger images, a SigLIP2
NaFlex tower, the pixel-unshuffle MLP projector and LFM2's hybrid language model (short convolutions beside
full attention)."""

from __future__ import annotations

from pathlib import Path

from vlm_recipes.demo.tiny import TinyModel, byte_level_bpe, generation_ids, save_tiny_model
from vlm_recipes.demo.tiny.dims import TINY_TEXT_DIMS, TINY_VISION_DIMS, tiny_text_config, tiny_vision_config

MIRRORS = "LiquidAI/LFM2-VL-1.6B"

# LFM2's pre-tokenizer: Llama 3's split (llama.cpp's llama-vocab.cpp maps tokenizer_pre "lfm2" to LLAMA3)
LFM2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
# LFM2's control tokens, ids 0..13 as the published tokenizer numbers them
LFM2_CONTROL_TOKENS = (
    "<|pad|>",
    "<|startoftext|>",
    "<|endoftext|>",
    "<|fim_pre|>",
    "<|fim_mid|>",
    "<|fim_suf|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|tool_list_start|>",
    "<|tool_list_end|>",
    "<|tool_call_start|>",
    "<|tool_call_end|>",
    "<|tool_response_start|>",
    "<|tool_response_end|>",
)
# LFM2-VL's vision tokens, published as ids 396..500 (the <|reserved_n|> fillers 14..395 are left out): the
# placeholder, a marker per tile of a grid up to 10x10, the thumbnail's marker, the run's bounds
LFM2_VL_IMAGE_TOKENS = (
    "<image>",
    *(f"<|img_row_{row}_col_{col}|>" for row in range(1, 11) for col in range(1, 11)),
    "<|img_thumbnail|>",
    "<|image_start|>",
    "<|image_end|>",
    "<|image_split|>",
)
# the tokenizer's named vision tokens (tokenizer_config.json's extra_special_tokens), read by Lfm2VlProcessor
LFM2_VL_NAMED_TOKENS = {
    "image_token": "<image>",
    "image_start_token": "<|image_start|>",
    "image_end_token": "<|image_end|>",
    "image_thumbnail": "<|img_thumbnail|>",
}


def lfm2_tokenizer(corpus: list[str]):
    """A TokenizersBackend (the published tokenizer_class, PreTrainedTokenizerFast, is that class in
    transformers 5) shaped as LFM2's tokenizer.json: the special tokens first, then a byte-level BPE trained
    on `corpus` with LFM2's pattern, merges ignored for whole-vocab words, <|startoftext|> added in front
    (add_bos_token) as the published tokenizer does."""
    from tokenizers import AddedToken
    from transformers import TokenizersBackend

    specials = (*LFM2_CONTROL_TOKENS, *LFM2_VL_IMAGE_TOKENS)
    bpe = byte_level_bpe(corpus, LFM2_PATTERN, first=specials, ignore_merges=True)
    bpe.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in specials])
    return TokenizersBackend(
        tokenizer_object=bpe,
        bos_token="<|startoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        add_bos_token=True,
        extra_special_tokens=LFM2_VL_NAMED_TOKENS,
        model_max_length=4096,
    )


def build_tiny_lfm2_vl(out: Path, dims: dict, corpus: list[str]) -> None:
    """With the published checkpoint's chat template (the family module's LFM2_VL_CHAT_TEMPLATE)."""
    import transformers

    # imported here, not at the top: the family package imports torch, and `--list` reads this module
    from vlm_recipes.families.lfm2_vl import LFM2_VL_CHAT_TEMPLATE

    tok = lfm2_tokenizer(corpus)
    tok.chat_template = LFM2_VL_CHAT_TEMPLATE
    patch, factor = dims["patch"], dims["downsample"]
    processor = transformers.Lfm2VlProcessor(
        # LFM2-VL-1.6B's processor: 16 px patches merged 2x2 (one token per 32x32 px), images up to the token
        # budget kept whole, larger ones cut into tiles with a row/column marker each and a thumbnail
        image_processor=transformers.Lfm2VlImageProcessor(
            encoder_patch_size=patch,
            downsample_factor=factor,
            min_image_tokens=dims["min_image_tokens"],
            max_image_tokens=dims["max_image_tokens"],
            tile_size=dims["tile"],
            min_tiles=2,
            max_tiles=dims["max_tiles"],
            max_pixels_tolerance=dims["max_pixels_tolerance"],
            use_thumbnail=True,
            do_image_splitting=True,
        ),
        tokenizer=tok,
        chat_template=LFM2_VL_CHAT_TEMPLATE,
    )
    generation = generation_ids(tok, eos="<|im_end|>", pad="<|pad|>", bos="<|startoftext|>")
    layers = dims["layer_types"]
    config = transformers.Lfm2VlConfig(
        text_config=tiny_text_config(
            tok,
            dims,
            model_type="lfm2",
            num_hidden_layers=len(layers),
            layer_types=layers,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
            norm_eps=1e-5,
            conv_L_cache=3,
            conv_bias=False,
            # the published block_ff_dim goes through LFM2's SwiGLU sizing: 2/3 of it, rounded up to a
            # multiple of block_multiple_of (12288 -> 8192 there, 192 -> 128 here)
            block_auto_adjust_ff_dim=True,
            block_ffn_dim_multiplier=1.0,
            block_multiple_of=dims["block_multiple_of"],
            **generation,  # the same bos, eos and pad
            tie_word_embeddings=True,
        ),
        vision_config=tiny_vision_config(
            dims,
            model_type="siglip2_vision_model",
            num_channels=3,
            num_patches=dims["vision_positions"],
            patch_size=patch,
            hidden_act="gelu_pytorch_tanh",
            layer_norm_eps=1e-6,
            vision_use_head=False,
        ),
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        downsample_factor=factor,
        projector_hidden_size=dims["projector_hidden"],
        projector_hidden_act="gelu",
        projector_bias=True,
        projector_use_layernorm=True,
        tie_word_embeddings=True,  # LFM2 ties the lm_head to the embeddings
    )
    save_tiny_model(out, transformers.Lfm2VlForConditionalGeneration, config, processor, dims, **generation)


# What build_tiny_lfm2_vl builds, one dict per demo model (BUILDS below)
TINY = {
    **TINY_TEXT_DIMS,
    "intermediate": 192,  # block_ff_dim: an MLP 128 wide after LFM2's 2/3 sizing
    "block_multiple_of": 64,
    # one short-convolution layer, then full attention (the real: 10 conv + 6 attention layers)
    "layer_types": ["conv", "full_attention"],
    **TINY_VISION_DIMS,
    "vision_positions": 256,  # the real 16x16 position grid, resized to each image's patch grid
    "projector_hidden": 128,
    "patch": 16,  # the real tower's 16 px patches, unshuffled 2x2: one token per 32x32 px
    "downsample": 2,
    # 4..16 tokens an image kept whole (the real: 64..256); an image over 12 tokens' area (16 x 0.75; the real
    # tolerance 2.0) is cut into 2..4 tiles of 64 px (4 tokens each; the real: 512 px, 256 tokens, 2..10 tiles)
    # beside a thumbnail: the 112x140 demo labels give 2x2 tiles + a 4x4 thumbnail, 32 tokens
    "min_image_tokens": 4,
    "max_image_tokens": 16,
    "max_pixels_tolerance": 0.75,
    "tile": 64,
    "max_tiles": 4,
}


# The demo models this module builds: demo id -> what it builds (demo/models.py finds them here)
BUILDS = {
    "demo:tiny-lfm2-vl": TinyModel("lfm2_vl", build_tiny_lfm2_vl, TINY),
}
