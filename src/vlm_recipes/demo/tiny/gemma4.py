"""The tiny offline Gemma 4 (`demo:tiny-gemma4`): a Gemma-style tokenizer (spaces as "▁", byte fallback)
with Gemma 4's special tokens, Gemma4Processor (its image, video and audio-feature processors, the current
google/gemma-4-*-it chat template), a variable-resolution vision tower pooling 3x3 patches into a token,
and a Gemma 4 text model, with no audio tower."""

from __future__ import annotations

from pathlib import Path

from vlm_recipes.demo.tiny import TinyModel, generation_ids, save_tiny_model
from vlm_recipes.demo.tiny.dims import TINY_TEXT_DIMS, TINY_VISION_DIMS, tiny_text_config, tiny_vision_config
from vlm_recipes.demo.tiny.gemma3 import train_gemma_bpe

# Gemma 4's special tokens, in the order the real tokenizer numbers them: pad, eos, bos, unk, mask; the tool
# declarations, calls and responses and the string escape (<|tool_response> is 50 there, a stop token of
# generation_config); the thinking switch and channel; the turn markers (105 and 106 there). The named ones
# are what tokenizer_config.json lists as std/etd, stc/etc, str/etr, escape, think, soc/eoc, sot/eot.
GEMMA4_SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")
GEMMA4_CONTROL_TOKENS = {
    "std_token": "<|tool>",
    "etd_token": "<tool|>",
    "stc_token": "<|tool_call>",
    "etc_token": "<tool_call|>",
    "str_token": "<|tool_response>",
    "etr_token": "<tool_response|>",
    "escape_token": '<|"|>',
    "think_token": "<|think|>",
    "soc_token": "<|channel>",
    "eoc_token": "<channel|>",
    "sot_token": "<|turn>",
    "eot_token": "<turn|>",
}
# The image and audio tokens (255999, 256000 and 258880-258884 there), appended after the BPE vocab here;
# <|video|> is the tokenizer's one extra special token (Gemma4Processor adds it if it is missing).
GEMMA4_MEDIA_TOKENS = {
    "boi_token": "<|image>",
    "boa_token": "<|audio>",
    "image_token": "<|image|>",
    "audio_token": "<|audio|>",
    "eoi_token": "<image|>",
    "eoa_token": "<audio|>",
}
VIDEO_TOKEN = "<|video|>"


def gemma4_tokenizer(corpus: list[str]):
    """A GemmaTokenizer (the class Gemma4Processor is given) around a BPE trained on `corpus` the way
    Gemma's is built (gemma3.py: `train_gemma_bpe`), the media tokens after it."""
    from tokenizers import AddedToken
    from transformers import GemmaTokenizer

    control = tuple(GEMMA4_CONTROL_TOKENS.values())
    # the template's own words (turn roles, the thought channel, tool calls and responses)
    template_words = ["user\n", "model\n", "system\n", "thought\n", "call:", "response:", "value:"]
    media = (*GEMMA4_MEDIA_TOKENS.values(), VIDEO_TOKEN)
    vocab, merges = train_gemma_bpe(corpus, (*GEMMA4_SPECIAL_TOKENS, *control), template_words, last=media)
    tok = GemmaTokenizer(
        vocab=vocab,
        merges=merges,
        extra_special_tokens=[VIDEO_TOKEN],
        model_max_length=4096,
        **GEMMA4_CONTROL_TOKENS,
        **GEMMA4_MEDIA_TOKENS,
    )
    # special added tokens in Gemma 4's tokenizer: never split, skipped when decoding
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    return tok


def build_tiny_gemma4(out: Path, dims: dict, corpus: list[str]) -> None:
    import transformers
    from trl.chat_template_utils import gemma4_v5_chat_template

    tok = gemma4_tokenizer(corpus)
    # the current google/gemma-4-*-it template (TRL's gemma4_v5)
    tok.chat_template = gemma4_v5_chat_template
    vision = {"patch_size": dims["patch_size"], "pooling_kernel_size": dims["pooling"]}
    processor = transformers.Gemma4Processor(
        feature_extractor=transformers.Gemma4AudioFeatureExtractor(),  # as published; the tiny model has no audio tower
        image_processor=transformers.Gemma4ImageProcessor(max_soft_tokens=dims["soft_tokens"], **vision),
        tokenizer=tok,
        video_processor=transformers.Gemma4VideoProcessor(max_soft_tokens=70, **vision),
        chat_template=gemma4_v5_chat_template,
        image_seq_length=dims["soft_tokens"],
    )
    ids = {t: tok.convert_tokens_to_ids(t) for t in (*GEMMA4_SPECIAL_TOKENS, *GEMMA4_CONTROL_TOKENS.values())}
    media = {name: tok.convert_tokens_to_ids(t) for name, t in GEMMA4_MEDIA_TOKENS.items()}
    config = transformers.Gemma4Config(
        text_config=tiny_text_config(
            tok,
            dims,
            vocab_size_per_layer_input=-(-len(tok) // 64) * 64,  # vocab_size's
            head_dim=dims["head_dim"],
            # the global layers' own geometry, and keys that are their values (the 26B and 31B's)
            global_head_dim=dims["global_head_dim"],
            num_global_key_value_heads=dims["global_kv_heads"],
            attention_k_eq_v=True,
            sliding_window=dims["sliding_window"],
            layer_types=["sliding_attention"] * (dims["layers"] - 1) + ["full_attention"],
            use_bidirectional_attention="vision",  # an image's tokens see each other (26B, 31B)
            hidden_size_per_layer_input=0,  # no per-layer embeddings (those are E2B's and E4B's)
            final_logit_softcapping=30.0,
            pad_token_id=ids["<pad>"],
            bos_token_id=ids["<bos>"],
            eos_token_id=ids["<eos>"],
        ),
        vision_config=tiny_vision_config(
            dims,
            num_key_value_heads=dims["vision_heads"],
            head_dim=dims["vision_dim"] // dims["vision_heads"],
            position_embedding_size=dims["vision_positions"],
            use_clipped_linears=True,  # as E2B and E4B's tower: clamps around every linear layer
            **vision,
        ),
        audio_config=None,
        boi_token_id=media["boi_token"],
        eoi_token_id=media["eoi_token"],
        image_token_id=media["image_token"],
        video_token_id=tok.convert_tokens_to_ids(VIDEO_TOKEN),
        boa_token_id=media["boa_token"],
        eoa_token_index=media["eoa_token"],
        audio_token_id=media["audio_token"],
        tie_word_embeddings=True,
    )
    config.eos_token_id = [ids["<eos>"], ids["<turn|>"]]  # as config.json: [1, 106]
    # as generation_config.json: <eos>, <turn|> and <|tool_response> (a turn handing over to a tool) stop
    stops = ["<eos>", "<turn|>", "<|tool_response>"]
    generation = generation_ids(tok, eos=stops, pad="<pad>", bos="<bos>")
    save_tiny_model(out, transformers.Gemma4ForConditionalGeneration, config, processor, dims, **generation)


# What build_tiny_gemma4 builds, one dict per demo model (BUILDS below)
TINY = {
    **TINY_TEXT_DIMS,
    "head_dim": 16,
    "global_head_dim": 32,  # the global layers' heads twice as wide, as the real 512 to 256
    "global_kv_heads": 1,
    # the real proportion: E2B's 512-token window holds an image at its 280-token budget and the question
    # after it. A 32-token window behind a 70-token image left the tiny model's sliding layer (1 of its 2)
    # blind to the image at the answer: its pretraining answered 0.67 of its colour questions (0.83 with
    # 128), and r1 from it 0.27 of the demo's shapes rows over seeds 0-5 (0.32). Two-image rows (~140
    # tokens) still pass the window.
    "sliding_window": 128,
    **TINY_VISION_DIMS,
    "vision_positions": 1024,  # rows and columns of patches the position table covers (the real: 10240)
    "patch_size": 16,  # the real geometry: a token is 3x3 patches of 16 px, so data.max_pixels means the same
    "pooling": 3,
    "soft_tokens": 70,  # the smallest budget (the real default: 280)
}


# The demo models this module builds: demo id -> what it builds (demo/models.py finds them here)
BUILDS = {
    "demo:tiny-gemma4": TinyModel("gemma4", build_tiny_gemma4, TINY),
}
