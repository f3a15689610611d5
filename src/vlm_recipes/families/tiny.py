"""Pieces every family's tiny offline builder shares: a byte-level BPE trained locally on the demo texts.

The tiny models exist so that every recipe runs end to end with no model hub: the family's real
processor class, special tokens and chat template, a small tokenizer trained here, random weights.
"""

from __future__ import annotations

import json

MODEL_SEED = 0  # random weights of every tiny model are drawn from this seed


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
