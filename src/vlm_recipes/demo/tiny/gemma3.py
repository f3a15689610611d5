"""The tiny offline Gemma 3 (`demo:tiny-gemma3`): a Gemma-style tokenizer (spaces as "▁", byte fallback),
Gemma3Processor, a SigLIP tower pooled to a fixed number of tokens per image."""

from __future__ import annotations

from pathlib import Path

from vlm_recipes.demo.tiny import TinyModel, generation_ids, save_tiny_model, vocab_and_merges
from vlm_recipes.demo.tiny.dims import TINY_VISION_DIMS, siglip_vision_config, tiny_text_config

# Gemma's special tokens: the first ones in the order the real tokenizer numbers them (<pad> 0, <eos> 1,
# <bos> 2, <unk> 3, <mask> 4; the turn markers at 105 and 106 there), then the image tokens (255999,
# 256000 and 262144 there), appended after the BPE vocab here.
GEMMA_SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>")
GEMMA_IMAGE_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
# The pieces Gemma's SentencePiece model is trained on: a word with the "▁" before it, each digit alone
# (split_digits), a run of punctuation; never one piece across words or digits. The BPE is trained on these
# pieces; GemmaTokenizer then encodes whole texts, as Gemma's tokenizer does, with merges that never cross
# them. Trained on whole texts instead, the BPE learned pieces like `0,"fat_g":1`: Gemma's demo models then
# learned the demo's JSON and answers far worse than every other family (r1 taught them no exact match).
SENTENCEPIECE_PIECES = r"▁?\p{L}+|\p{N}|▁?[^\p{L}\p{N}▁]+|▁"


def train_gemma_bpe(
    corpus: list[str], special_tokens: tuple[str, ...], template_words: list[str], last: tuple[str, ...]
):
    """(vocab, merges) of a BPE trained on `corpus` the way Gemma's is built: spaces replaced by "▁",
    digits split, byte fallback (<0x00>..<0xFF>, after `special_tokens` at ids 0..) for anything unseen;
    the chat template's own `template_words` learned whole; `last` numbered after the BPE vocab."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

    bytes_ = [f"<0x{i:02X}>" for i in range(256)]
    bpe = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    bpe.normalizer = normalizers.Replace(" ", "▁")
    bpe.pre_tokenizer = pre_tokenizers.Split(Regex(SENTENCEPIECE_PIECES), behavior="isolated")
    trainer = trainers.BpeTrainer(
        vocab_size=1024, special_tokens=[*special_tokens, *bytes_], show_progress=False
    )
    bpe.train_from_iterator([*corpus, *template_words * 50], trainer)
    vocab, merges = vocab_and_merges(bpe)
    for token in last:
        vocab[token] = len(vocab)
    return vocab, merges


def gemma_tokenizer(corpus: list[str]):
    """A GemmaTokenizer (the class Gemma3Processor is given) around a BPE trained on `corpus` the way
    Gemma's is built (`train_gemma_bpe`), the image tokens after it."""
    from tokenizers import AddedToken
    from transformers import GemmaTokenizer

    # the template's own words, and "\n\n" as one token, as in Gemma's vocab
    template_words = ["user\n", "model\n", "\n\n"]
    vocab, merges = train_gemma_bpe(corpus, GEMMA_SPECIAL_TOKENS, template_words, last=GEMMA_IMAGE_TOKENS)
    boi, eoi, image = GEMMA_IMAGE_TOKENS
    tok = GemmaTokenizer(
        vocab=vocab,
        merges=merges,
        extra_special_tokens={"boi_token": boi, "eoi_token": eoi, "image_token": image},
        model_max_length=4096,
    )
    # the turn markers are special added tokens in Gemma's tokenizer: never split, skipped when decoding
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in GEMMA_SPECIAL_TOKENS[5:]])
    return tok


def build_tiny_gemma3(out: Path, dims: dict, corpus: list[str]) -> None:
    import transformers
    from trl.chat_template_utils import gemma3_chat_template

    tok = gemma_tokenizer(corpus)
    # google/gemma-3-*-it's template (TRL's gemma3), which TRL swaps for its training variant with
    # {% generation %} markers for assistant-only loss.
    tok.chat_template = gemma3_chat_template
    side = dims["image_size"]
    processor = transformers.Gemma3Processor(
        image_processor=transformers.Gemma3ImageProcessor(
            size={"height": side, "width": side},
            do_pan_and_scan=False,
            pan_and_scan_min_crop_size=256,
            pan_and_scan_max_num_crops=4,
            pan_and_scan_min_ratio_to_activate=1.2,
        ),
        tokenizer=tok,
        chat_template=gemma3_chat_template,
        image_seq_length=dims["tokens_per_image"],
    )
    ids = {t: tok.convert_tokens_to_ids(t) for t in (*GEMMA_SPECIAL_TOKENS, *GEMMA_IMAGE_TOKENS)}
    config = transformers.Gemma3Config(
        text_config=tiny_text_config(
            tok,
            dims,
            head_dim=dims["head_dim"],
            query_pre_attn_scalar=dims["head_dim"],
            sliding_window=dims["sliding_window"],
            layer_types=["sliding_attention", "full_attention"][: dims["layers"]],
            pad_token_id=ids["<pad>"],
            bos_token_id=ids["<bos>"],
            eos_token_id=[ids["<eos>"], ids["<end_of_turn>"]],
        ),
        vision_config=siglip_vision_config(dims, image_size=side),
        mm_tokens_per_image=dims["tokens_per_image"],
        boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"],
        tie_word_embeddings=True,
    )
    # as gemma-3-*-it: a turn ends generation as well as <eos>
    generation = generation_ids(tok, eos=["<eos>", "<end_of_turn>"], pad="<pad>", bos="<bos>")
    save_tiny_model(out, transformers.Gemma3ForConditionalGeneration, config, processor, dims, **generation)


# What build_tiny_gemma3 builds, one dict per demo model (BUILDS below)
TINY = {
    "hidden": 64,
    "intermediate": 128,
    "layers": 2,  # one sliding-window layer, one global layer (the real pattern: 5 sliding, 1 global)
    "heads": 4,
    "kv_heads": 2,
    "head_dim": 16,
    "sliding_window": 32,
    **TINY_VISION_DIMS,
    "image_size": 56,  # 4x4 patches of 14 px, pooled 2x2 into 4 tokens (the real: 896 px, 64x64 -> 256)
    "tokens_per_image": 4,
}


# The demo models this module builds: demo id -> what it builds (demo/models.py finds them here)
BUILDS = {
    "demo:tiny-gemma3": TinyModel("gemma3", build_tiny_gemma3, TINY),
}
