"""The tiny offline SmolVLM (`demo:tiny-smolvlm`): SmolVLM2's GPT-2 style byte-level tokenizer and special
tokens, SmolVLMProcessor cutting images into tiles, a SigLIP tower, a Llama text model."""

from __future__ import annotations

from pathlib import Path

from vlm_recipes.demo.tiny import TinyModel, generation_ids, save_tiny_model, train_byte_level_bpe
from vlm_recipes.demo.tiny.dims import TINY_TEXT_DIMS, TINY_VISION_DIMS, tiny_text_config, tiny_vision_config

# GPT-2's pre-tokenizer regex (SmolLM2's tokenizer is a GPT-2 byte-level BPE), digits split one by one
# as SmolLM2's Digits(individual_digits=True) pre-tokenizer does.
_PRETOKENIZE_REGEX = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_ROW_COL_TOKENS = tuple(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))
# SmolVLM2's special tokens (SmolLM2's chat tokens, then the image ones SmolVLM adds)
SMOLVLM_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<global-img>",
    *_ROW_COL_TOKENS,
    "<fake_token_around_image>",
    "<image>",
    "<end_of_utterance>",
)


def smolvlm_tokenizer(corpus: list[str]):
    """A GPT2Tokenizer (the class SmolVLM2's tokenizer_config names) around a byte-level BPE trained on
    `corpus`, with SmolVLM2's special tokens appended and its eos / pad / bos."""
    from tokenizers import pre_tokenizers
    from transformers import GPT2Tokenizer

    vocab, merges = train_byte_level_bpe(corpus, _PRETOKENIZE_REGEX, last=SMOLVLM_SPECIAL_TOKENS)
    tok = GPT2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token="<|endoftext|>",
        bos_token="<|im_start|>",
        eos_token="<end_of_utterance>",
        pad_token="<|im_end|>",
        extra_special_tokens=[
            t for t in SMOLVLM_SPECIAL_TOKENS if t not in ("<|im_start|>", "<end_of_utterance>", "<|im_end|>")
        ],
        model_max_length=8192,
    )
    # SmolLM2's pre-tokenizer: digits one by one, then GPT-2's byte-level split
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return tok


def build_tiny_smolvlm(out: Path, dims: dict, corpus: list[str]) -> None:
    import transformers
    from trl.chat_template_utils import smolvlm_chat_template

    tok = smolvlm_tokenizer(corpus)
    # SmolVLM2-*-Instruct's template (TRL's smolvlm, byte-identical), which TRL swaps for its training
    # variant with {% generation %} markers for assistant-only loss.
    tok.chat_template = smolvlm_chat_template
    tile = {"longest_edge": dims["tile"]}
    size = {"longest_edge": dims["longest_edge"]}
    seq_len = (dims["tile"] // dims["patch"]) ** 2 // dims["scale_factor"] ** 2
    processor = transformers.SmolVLMProcessor(
        image_processor=transformers.SmolVLMImageProcessor(
            size=size, max_image_size=tile, do_image_splitting=True
        ),
        tokenizer=tok,
        video_processor=transformers.SmolVLMVideoProcessor(size=size, max_image_size=tile),
        image_seq_len=seq_len,
        chat_template=smolvlm_chat_template,
    )
    ids = {t: tok.convert_tokens_to_ids(t) for t in SMOLVLM_SPECIAL_TOKENS}
    config = transformers.SmolVLMConfig(
        text_config=tiny_text_config(
            tok,
            dims,
            model_type="llama",
            max_position_embeddings=8192,
            rms_norm_eps=1e-5,
            rope_theta=273768.0,
            pad_token_id=ids["<|im_end|>"],
            bos_token_id=ids["<|im_start|>"],
            eos_token_id=ids["<end_of_utterance>"],
            tie_word_embeddings=False,
        ),
        vision_config=tiny_vision_config(dims, image_size=dims["tile"], patch_size=dims["patch"]),
        scale_factor=dims["scale_factor"],
        image_token_id=ids["<image>"],
        tie_word_embeddings=False,
        pad_token_id=ids["<|im_end|>"],
    )
    generation = generation_ids(tok, eos="<end_of_utterance>", pad="<|im_end|>")
    save_tiny_model(out, transformers.SmolVLMForConditionalGeneration, config, processor, dims, **generation)


# What build_tiny_smolvlm builds, one dict per demo model (BUILDS below)
TINY = {
    **TINY_TEXT_DIMS,
    **TINY_VISION_DIMS,
    "tile": 64,  # 64 px tiles of 16 px patches: 4x4 patches, pixel-shuffled 2x2 into 4 tokens per tile
    "patch": 16,
    "scale_factor": 2,
    "longest_edge": 128,  # at most 2x2 tiles + the global view: 20 <image> tokens per image
}


# The demo models this module builds: demo id -> what it builds (demo/models.py finds them here)
BUILDS = {
    "demo:tiny-smolvlm": TinyModel("smolvlm", build_tiny_smolvlm, TINY),
}
