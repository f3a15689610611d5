"""The tiny offline GLM-4.1V (`demo:tiny-glm4v`) and GLM-4.5V (`demo:tiny-glm4v-moe`): a byte-level BPE split
by GLM-4's pre-tokenizer pattern with GLM's special tokens numbered after it, Glm4vProcessor (14 px patches
merged 2x2, timestamps after each pair of video frames), a GLM-4V tower (2-D RoPE, learned positions
resampled to each image, a 2x2 downsampling convolution, the patch merger) and a GLM-4 text model (post-norms,
partial 3-D RoPE); for GLM-4.5V, GLM-4.5-Air's text model instead (pre-norm layers, a dense first layer, then
a few routed experts beside a shared one)."""

from __future__ import annotations

from pathlib import Path

from vlm_recipes.demo.tiny import TinyModel, byte_level_bpe, generation_ids, save_tiny_model
from vlm_recipes.demo.tiny.dims import TINY_MOE_DIMS, TINY_TEXT_DIMS, deepseek_moe_fields, tiny_text_config

# GLM-4's special tokens, in the order the GLM-4.1V tokenizer numbers them after its BPE vocab (151329 to
# 151344; the model config's image_token_id 151343 and video_token_id 151344). The added tokens after them
# (<think>, <answer>, ...) are left out here.
GLM4V_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
    "<|image|>",
    "<|video|>",
)
# GLM-4's pre-tokenizer pattern (THUDM's ChatGLM4Tokenizer `pat_str`, tiktoken's cl100k split)
GLM4_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
# the generation config stops at these (the published one also at id 151348, a token left out here)
STOP_TOKENS = ("<|endoftext|>", "<|user|>", "<|observation|>")


def glm4_tokenizer(corpus: list[str]):
    """A TokenizersBackend (the published tokenizer.json loads as one: PreTrainedTokenizerFast) around a
    byte-level BPE trained on `corpus` with GLM-4's pattern, the special tokens after it, nothing added by
    the tokenizer itself (the chat template writes [gMASK]<sop>); <|endoftext|> is eos and pad."""
    from tokenizers import AddedToken
    from transformers import TokenizersBackend

    bpe = byte_level_bpe(corpus, GLM4_PATTERN, last=GLM4V_SPECIAL_TOKENS)
    bpe.add_special_tokens([AddedToken(token, special=True) for token in GLM4V_SPECIAL_TOKENS])
    return TokenizersBackend(
        tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|endoftext|>", model_max_length=4096
    )


def build_tiny_glm4v(out: Path, dims: dict, corpus: list[str]) -> None:
    """With the published checkpoint's chat template (the family's GLM4V_CHAT_TEMPLATE). `dims` with `experts`:
    GLM-4.5V's Glm4vMoeForConditionalGeneration (same processor and tower)."""
    import transformers

    from vlm_recipes.families.glm4v_template import GLM4V_CHAT_TEMPLATE

    tok = glm4_tokenizer(corpus)
    tok.chat_template = GLM4V_CHAT_TEMPLATE
    # the processor compares temporal_patch_size x height x width with these bounds (an image is two frames)
    size = {"shortest_edge": dims["min_pixels"], "longest_edge": dims["max_pixels"]}
    processor = transformers.Glm4vProcessor(
        image_processor=transformers.Glm4vImageProcessor(
            size=size, patch_size=14, temporal_patch_size=2, merge_size=2
        ),
        tokenizer=tok,
        video_processor=transformers.Glm4vVideoProcessor(size=size),
        chat_template=GLM4V_CHAT_TEMPLATE,
    )
    ids = {t: tok.convert_tokens_to_ids(t) for t in GLM4V_SPECIAL_TOKENS}
    stops = [ids[t] for t in STOP_TOKENS]
    text = tiny_text_config(
        tok,
        dims,
        rms_norm_eps=1e-5,
        # half of each head rotates (GLM-4), its frequencies split over (temporal, height, width)
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": dims["mrope"],
        },
        pad_token_id=ids["<|endoftext|>"],
        eos_token_id=stops,
    )
    moe = "experts" in dims
    if moe:  # GLM-4.5-Air's: the first layers' MLP dense (intermediate_size), then routed and shared experts
        text |= deepseek_moe_fields(dims) | {"attention_bias": True}  # GLM-4.5-Air's biased q, k, v
    config_class, model_class = (
        (transformers.Glm4vMoeConfig, transformers.Glm4vMoeForConditionalGeneration)
        if moe
        else (transformers.Glm4vConfig, transformers.Glm4vForConditionalGeneration)
    )
    config = config_class(
        text_config=text,
        vision_config={
            "depth": dims["vision_depth"],
            "hidden_size": dims["vision_dim"],
            "num_heads": dims["vision_heads"],
            "intermediate_size": dims["vision_intermediate"],  # the merger's SwiGLU width
            "out_hidden_size": dims["hidden"],  # downsample and merger output = text hidden size
            "image_size": dims["vision_image_size"],  # its learned positions: (image_size / 14)^2
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "rms_norm_eps": 1e-5,
        },
        image_token_id=ids["<|image|>"],
        video_token_id=ids["<|video|>"],
        image_start_token_id=ids["<|begin_of_image|>"],
        image_end_token_id=ids["<|end_of_image|>"],
        video_start_token_id=ids["<|begin_of_video|>"],
        video_end_token_id=ids["<|end_of_video|>"],
        tie_word_embeddings=False,
    )
    generation = generation_ids(tok, eos=list(STOP_TOKENS), pad="<|endoftext|>")
    save_tiny_model(out, model_class, config, processor, dims, **generation)


# What build_tiny_glm4v builds, one dict per demo model (BUILDS below)
TINY = {
    **TINY_TEXT_DIMS,
    # 2 heads of 32 (the real 32 of 128): half of each rotates, 8 frequencies over (t, h, w), the real
    # [8, 12, 12] of 32 scaled
    "heads": 2,
    "kv_heads": 1,
    "mrope": [2, 3, 3],
    "vision_depth": 2,
    "vision_dim": 32,
    "vision_heads": 2,
    "vision_intermediate": 64,
    "vision_image_size": 112,  # an 8x8 learned position grid (the real one: 336 px, 24x24)
    # 4 to 16 merged tokens an image (the bounds count an image as 2 frames): fast on CPU
    "min_pixels": 2 * 28 * 28 * 4,
    "max_pixels": 2 * 28 * 28 * 16,
}


# a dense first layer, then two MoE layers (the real: 1 dense, 45 MoE), so the last layer is routed
TINY_MOE = {
    **TINY,
    **TINY_MOE_DIMS,  # beside one shared expert (the real: 128 routed, eight per token)
    "layers": 3,
    "dense_layers": 1,
}


# The demo models this module builds: demo id -> what it builds (demo/models.py finds them here)
BUILDS = {
    "demo:tiny-glm4v": TinyModel("glm4v", build_tiny_glm4v, TINY),
    "demo:tiny-glm4v-moe": TinyModel("glm4v_moe", build_tiny_glm4v, TINY_MOE),
}
