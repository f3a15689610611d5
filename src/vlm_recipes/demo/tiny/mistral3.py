"""The tiny offline Mistral 3 (`demo:tiny-mistral3`): a Tekken-style byte-level BPE (Mistral's pre-tokenizer
regex, the control tokens numbered first), PixtralProcessor with its [IMG] / [IMG_BREAK] / [IMG_END] rows, a
Pixtral tower (2-D RoPE) with the patch-merger projector, a Mistral text model."""

from __future__ import annotations

from pathlib import Path

from vlm_recipes.demo.tiny import TinyModel, byte_level_bpe, generation_ids, save_tiny_model
from vlm_recipes.demo.tiny.dims import TINY_TEXT_DIMS, TINY_VISION_DIMS, tiny_text_config, tiny_vision_config

# Tekken's control tokens, ranks 0..19 as mistral-common numbers them (Tekkenizer.DEPRECATED_SPECIAL_TOKENS:
# the real tokenizers fill ranks 20..999 with <SPECIAL_n>, left out here). The BPE vocab follows them.
MISTRAL_SPECIAL_TOKENS = (
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "[TOOL_CALLS]",
    "[IMG]",
    "<pad>",
    "[IMG_BREAK]",
    "[IMG_END]",
    "[PREFIX]",
    "[MIDDLE]",
    "[SUFFIX]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[TOOL_CONTENT]",
)
# Tekken's pre-tokenizer pattern (the one transformers' `fix_mistral_regex` restores, tokenization_utils_tokenizers)
TEKKEN_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
    r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)


def tekken_tokenizer(corpus: list[str]):
    """A TokenizersBackend built the way transformers converts a tekken.json (integrations/mistral:
    MistralConverter): the control tokens at ranks 0.., then a byte-level BPE trained on `corpus` with
    Tekken's pattern, ByteLevel decoding, no BOS added by the tokenizer (the chat template writes <s>)."""
    from tokenizers import AddedToken, processors
    from transformers import TokenizersBackend

    bpe = byte_level_bpe(corpus, TEKKEN_PATTERN, first=MISTRAL_SPECIAL_TOKENS, ignore_merges=True)
    bpe.add_special_tokens([AddedToken(token, special=True) for token in MISTRAL_SPECIAL_TOKENS])
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    return TokenizersBackend(
        tokenizer_object=bpe,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=4096,
    )


def build_tiny_mistral3(out: Path, dims: dict, corpus: list[str]) -> None:
    """With the published checkpoints' chat template (the family's MISTRAL3_CHAT_TEMPLATE)."""
    import transformers

    from vlm_recipes.families.mistral3_template import DEFAULT_SYSTEM_PROMPT_EXAMPLE, MISTRAL3_CHAT_TEMPLATE

    # the template writes the default system prompt into every conversation without one: its words are
    # learned as the real tokenizer has them, a few tokens each
    tok = tekken_tokenizer([*corpus, *[DEFAULT_SYSTEM_PROMPT_EXAMPLE] * 20])
    tok.chat_template = MISTRAL3_CHAT_TEMPLATE
    patch, merge = dims["patch"], dims["merge"]
    processor = transformers.PixtralProcessor(
        # as Mistral-Small-3.1's preprocessor_config.json: the tower's patch (the processor passes patch x
        # merge on every call), a longest edge (1540 px there), CLIP mean/std, bicubic
        image_processor=transformers.PixtralImageProcessor(
            patch_size={"height": patch, "width": patch}, size={"longest_edge": dims["longest_edge"]}
        ),
        tokenizer=tok,
        patch_size=patch,
        spatial_merge_size=merge,
        chat_template=MISTRAL3_CHAT_TEMPLATE,
    )
    ids = {t: tok.convert_tokens_to_ids(t) for t in MISTRAL_SPECIAL_TOKENS}
    generation = generation_ids(tok, eos="</s>", pad="<pad>", bos="<s>")
    config = transformers.Mistral3Config(
        text_config=tiny_text_config(
            tok,
            dims,
            model_type="mistral",
            head_dim=dims["hidden"] // dims["heads"],
            rope_theta=1e9,  # the real text model's
            sliding_window=None,
            **generation,  # the same bos, eos and pad
            tie_word_embeddings=False,
        ),
        vision_config=tiny_vision_config(
            dims,
            model_type="pixtral",
            head_dim=dims["vision_dim"] // dims["vision_heads"],
            hidden_act="silu",
            image_size=1540,
            patch_size=patch,
            rope_theta=10000.0,
        ),
        image_token_index=ids["[IMG]"],
        spatial_merge_size=merge,
        projector_hidden_act="gelu",
        multimodal_projector_bias=False,
        vision_feature_layer=-1,
        # the published lm_head is its own matrix: Mistral3Config's default (True, transformers 5.24) would tie it
        tie_word_embeddings=False,
    )
    save_tiny_model(out, transformers.Mistral3ForConditionalGeneration, config, processor, dims, **generation)


# What build_tiny_mistral3 builds, one dict per demo model (BUILDS below)
TINY = {
    **TINY_TEXT_DIMS,
    **TINY_VISION_DIMS,
    "patch": 14,  # the real tower's 14 px patches, merged 2x2: one token per 28x28 px
    "merge": 2,
    "longest_edge": 112,  # at most 4x4 tokens an image (the real: 1540 px, 55x55)
}


# The demo models this module builds: demo id -> what it builds (demo/models.py finds them here)
BUILDS = {
    "demo:tiny-mistral3": TinyModel("mistral3", build_tiny_mistral3, TINY),
}
