"""The tiny offline builders, one module per family (``tiny/qwen2_vl.py``, ...), and what they share: a
byte-level BPE trained locally on the demo texts, the Qwen tokenizer, saving random weights.

The tiny models exist so that every recipe runs end to end with no model hub: the family's real
processor class, special tokens and chat template, a small tokenizer trained here, random weights. Each
module holds its builder and the settings of its demo models (``TINY``, ...); ``demo/models.py``'s
``DEMO_MODELS`` names them (demo id → family, builder, settings). A builder may read its family's module
(its published chat template); no family module imports anything here.
"""

from __future__ import annotations

import json
from pathlib import Path

MODEL_SEED = 0  # random weights of every tiny model are drawn from this seed
# Every tiny model's language model: 64 wide, 2 layers, 4 query heads over 2 key/value heads (head_dim 16)
TINY_TEXT_DIMS = {"hidden": 64, "intermediate": 128, "layers": 2, "heads": 4, "kv_heads": 2}


def train_byte_level_bpe(corpus: list[str], pretokenize_regex: str, vocab_size: int = 1024):
    """(vocab, merges) of a byte-level BPE trained on `corpus`, splitting text with the family's own
    pre-tokenizer regex so the merges mean what they would in the real tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pretokenize_regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    bpe.train_from_iterator(corpus, trainer)
    state = json.loads(bpe.to_str())["model"]
    return dict(state["vocab"]), [tuple(m) for m in state["merges"]]


def qwen_tokenizer(
    corpus: list[str],
    special_tokens: tuple[str, ...],
    added_tokens: tuple[str, ...] = (),
    qwen3_5: bool = False,
):
    """A Qwen2Tokenizer (the class of every Qwen-VL tokenizer up to Qwen3-VL) around a BPE trained on
    `corpus`; `qwen3_5`: a Qwen3_5Tokenizer with its own pre-tokenizer (letters with their combining marks,
    single digits), as Qwen3.5's tokenizer.json has it.

    `special_tokens` and then `added_tokens` are appended after the BPE vocab, in that order, as the real
    tokenizers number them; `special_tokens` must include <|endoftext|> (pad) and <|im_end|> (eos).
    `added_tokens` are never split but are not special (Qwen3's <think>, <tool_call>, ...): decoding
    with skip_special_tokens keeps them, as with the real tokenizer."""
    from tokenizers import AddedToken

    if qwen3_5:
        from transformers import Qwen3_5Tokenizer as tokenizer_class
        from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX
    else:
        from transformers import Qwen2Tokenizer as tokenizer_class
        from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    vocab, merges = train_byte_level_bpe(corpus, PRETOKENIZE_REGEX)
    for token in (*special_tokens, *added_tokens):
        vocab[token] = len(vocab)
    tok = tokenizer_class(
        vocab=vocab,
        merges=merges,
        unk_token=None,  # byte-level BPE covers every input, so no unk is needed
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=[t for t in special_tokens if t not in ("<|endoftext|>", "<|im_end|>")],
        model_max_length=4096,
    )
    if added_tokens:
        # already in the vocab: they keep their ids and are never split
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added_tokens])
    return tok


def qwen_generation(ids: dict[str, int]) -> dict[str, int | None]:
    """The generation config's token ids of a model with a `qwen_tokenizer`: <|im_end|> stops, no bos
    (`ids`: token -> id)."""
    return {"eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"], "bos_token_id": None}


def tiny_text_config(tok, dims: dict, **fields) -> dict:
    """A tiny language model's config fields: the vocabulary (the tokenizer's, rounded up to a multiple of
    64; the tokenizer never yields the rest) and `dims`' sizes, then the family's own `fields`."""
    return {
        **({"model_type": fields.pop("model_type")} if "model_type" in fields else {}),
        "vocab_size": -(-len(tok) // 64) * 64,
        "hidden_size": dims["hidden"],
        "intermediate_size": dims["intermediate"],
        "num_hidden_layers": dims["layers"],
        "num_attention_heads": dims["heads"],
        "num_key_value_heads": dims["kv_heads"],
        **fields,
    }


def save_tiny_model(out: Path, model_class, config, processor, dims: dict, **generation) -> None:
    """Random weights (reproducible, the caller's RNG untouched), generation config (`generation`: its
    token ids), processor: to `out`."""
    import torch
    from transformers import GenerationConfig

    # fork_rng keeps the caller's RNG state untouched while making the random init reproducible.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(MODEL_SEED)
        model = model_class._from_config(config, dtype=getattr(torch, dims.get("dtype", "float32")))
    model.generation_config = GenerationConfig(**generation)
    model.save_pretrained(out, max_shard_size="100GB")  # one model.safetensors, as demo/models.py expects
    processor.save_pretrained(out)  # tokenizer, image/video processor config and chat_template.jinja
