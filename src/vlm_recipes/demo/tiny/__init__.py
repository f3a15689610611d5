"""The tiny offline builders, one module per family (``tiny/qwen2_vl.py``, ...), and what they share: a
byte-level BPE trained locally on the demo texts, the Qwen tokenizer, the generation config's token ids,
saving random weights (``tiny/dims.py``: the sizes and the config fields made of them).

The tiny models exist so that every recipe runs end to end with no model hub: the family's real
processor class, special tokens and chat template, a small tokenizer trained here, random weights. Each
module holds its builder, the settings of its demo models (``TINY``, ...) and ``BUILDS``: demo id ->
``TinyModel`` (the model type it builds, builder, settings). ``every_build`` finds every module's
``BUILDS``, so a new module is all a new demo model needs. A builder may read its family's module (its
published chat template), inside the builder: a module is imported without transformers or torch, so a
recipe's `demo:` model is checked at once (recipes/validate.py). No family module imports anything here.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

MODEL_SEED = 0  # random weights of every tiny model are drawn from this seed


@dataclass(frozen=True)
class TinyModel:
    """What a demo model is built from: the config.json `model_type` the builder writes (the family naming
    that type trains it, else the generic family), the builder, and the settings it is built with."""

    model_type: str
    build: Callable[[Path, dict, list[str]], None]  # (out, dims, tokenizer corpus)
    dims: dict


def every_build() -> dict[str, TinyModel]:
    """Every module's BUILDS, in the modules' order: demo id -> what it builds."""
    found: dict[str, TinyModel] = {}
    for module in pkgutil.iter_modules(__path__):
        builds = getattr(importlib.import_module(f"{__name__}.{module.name}"), "BUILDS", {})
        for demo_id, built in builds.items():
            if demo_id in found:
                raise ValueError(f"demo/tiny/{module.name}.py: {demo_id} is built by another module too")
            found[demo_id] = built
    return found


def train_byte_level_bpe(
    corpus: list[str],
    pretokenize_regex: str,
    *,
    first: tuple[str, ...] = (),
    last: tuple[str, ...] = (),
):
    """(vocab, merges) of a byte-level BPE trained on `corpus`, splitting text with the family's own
    pre-tokenizer regex so the merges mean what they would in the real tokenizer; the family's `first`
    tokens numbered before the BPE vocab (ids 0..), its `last` ones after it, in their order."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = byte_level_pre_tokenizer(pretokenize_regex)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    bpe.train_from_iterator(corpus, trainer)
    vocab, merges = vocab_and_merges(bpe)
    vocab = {
        **{token: rank for rank, token in enumerate(first)},
        **{token: rank + len(first) for token, rank in vocab.items()},
    }
    for token in last:
        vocab[token] = len(vocab)
    return vocab, merges


def vocab_and_merges(bpe) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A trained BPE `tokenizers.Tokenizer`'s vocab (token -> id) and merges, to build a tokenizer from."""
    state = json.loads(bpe.to_str())["model"]
    return dict(state["vocab"]), [tuple(m) for m in state["merges"]]


def byte_level_pre_tokenizer(pretokenize_regex: str):
    """The family's regex split, then each piece mapped to byte-level symbols (as every byte-level BPE
    tokenizer.json here has it)."""
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pretokenize_regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def byte_level_bpe(
    corpus: list[str],
    pretokenize_regex: str,
    *,
    first: tuple[str, ...] = (),
    last: tuple[str, ...] = (),
    **bpe_options,
):
    """A `tokenizers.Tokenizer` around a byte-level BPE trained on `corpus` (`train_byte_level_bpe`: `first`
    and `last` numbered before and after it), shaped as the published tokenizer.json of a family with no
    tokenizer class of its own: the family's split then bytes, ByteLevel decoding; `bpe_options`:
    `models.BPE`'s (ignore_merges, ...). The caller adds its tokens and post-processor."""
    from tokenizers import Tokenizer, decoders, models

    vocab, merges = train_byte_level_bpe(corpus, pretokenize_regex, first=first, last=last)
    bpe = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, **bpe_options))
    bpe.pre_tokenizer = byte_level_pre_tokenizer(pretokenize_regex)
    bpe.decoder = decoders.ByteLevel()
    return bpe


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
    vocab, merges = train_qwen_bpe(corpus, (*special_tokens, *added_tokens), qwen3_5)
    extra_special = [t for t in special_tokens if t not in ("<|endoftext|>", "<|im_end|>")]
    return qwen_tokenizer_from(vocab, merges, extra_special, added_tokens, qwen3_5)


def train_qwen_bpe(corpus: list[str], last: tuple[str, ...], qwen3_5: bool = False):
    """`train_byte_level_bpe` with Qwen's pre-tokenizer (`qwen3_5`: Qwen3.5's), `last` after the BPE vocab."""
    if qwen3_5:
        from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX
    else:
        from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX
    return train_byte_level_bpe(corpus, PRETOKENIZE_REGEX, last=last)


def qwen_tokenizer_from(
    vocab: dict[str, int],
    merges: list,
    extra_special_tokens: list[str] | dict[str, str],
    not_special: tuple[str, ...] = (),
    qwen3_5: bool = False,
    **named_tokens: str,
):
    """A Qwen2Tokenizer (`qwen3_5`: a Qwen3_5Tokenizer) over a trained vocab, as every Qwen-based tokenizer
    here: <|im_end|> eos, <|endoftext|> pad, no unk; `extra_special_tokens` and `named_tokens` (bos_token,
    image_token, ...) as the family's tokenizer_config.json has them. `not_special`: tokens of the vocab
    never split but not special (Qwen3's <think>, <tool_call>, ...): decoding with skip_special_tokens keeps
    them, as with the real tokenizer."""
    from tokenizers import AddedToken

    if qwen3_5:
        from transformers import Qwen3_5Tokenizer as tokenizer_class
    else:
        from transformers import Qwen2Tokenizer as tokenizer_class

    tok = tokenizer_class(
        vocab=vocab,
        merges=merges,
        unk_token=None,  # byte-level BPE covers every input, so no unk is needed
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=extra_special_tokens,
        model_max_length=4096,
        **named_tokens,
    )
    if not_special:
        # already in the vocab: they keep their ids and are never split
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in not_special])
    return tok


def qwen_generation(ids: dict[str, int]) -> dict[str, int | None]:
    """The generation config's token ids of a model with a `qwen_tokenizer`: <|im_end|> stops, no bos
    (`ids`: token -> id)."""
    return {"eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"], "bos_token_id": None}


def generation_ids(tok, eos: str | list[str], pad: str, bos: str | None = None) -> dict:
    """The generation config's token ids, named by their tokens: `eos` (one or a list) stops generation,
    `pad` pads, `bos` (None: no bos)."""
    return {
        "eos_token_id": tok.convert_tokens_to_ids(eos),
        "pad_token_id": tok.convert_tokens_to_ids(pad),
        "bos_token_id": None if bos is None else tok.convert_tokens_to_ids(bos),
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
