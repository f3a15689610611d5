"""The tiny offline Qwen2-VL (`demo:tiny-qwen2-vl`, `demo:bench-qwen2-vl`, `demo:qwen2-vl-2b-shaped`), and
what the tiny Qwen-VL builders share (`tiny/qwen2_5_vl.py`, `tiny/qwen3_vl.py`, `tiny/qwen3_5.py`): the
special tokens, the text model config, the tower fields of Qwen2.5-VL and later, the last step (config with
the vision token ids, saving: `save_qwen_vl`)."""

from __future__ import annotations

from pathlib import Path

from vlm_recipes.demo.tiny import TinyModel, qwen_generation, qwen_tokenizer, save_tiny_model
from vlm_recipes.demo.tiny.dims import TINY_TEXT_DIMS, tiny_text_config

# The Qwen-VL special tokens, in the order the real tokenizers number them (right after the BPE vocab).
QWEN_VL_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
MIN_PIXELS = 28 * 28 * 4  # at least 4 merged image tokens per image (the most: the dims' max_pixels)


def qwen2_vl_processor(processor_class, corpus: list[str], dims: dict):
    """Qwen2-VL's processor (`processor_class`: Qwen2.5-VL's too): a tokenizer with the Qwen-VL special
    tokens and Qwen2-VL-2B-Instruct's chat template, 14 px patches merged 2x2, between MIN_PIXELS and the
    dims' max_pixels."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLVideoProcessor
    from trl.chat_template_utils import qwen2_5_vl_chat_template

    tok = qwen_tokenizer(corpus, QWEN_VL_SPECIAL_TOKENS)
    # TRL matches this template byte for byte (it is Qwen2-VL-2B-Instruct's, and Qwen2.5-VL-*-Instruct
    # ship it too) and swaps in its training variant with {% generation %} markers for assistant-only loss.
    tok.chat_template = qwen2_5_vl_chat_template
    size = {"shortest_edge": MIN_PIXELS, "longest_edge": dims["max_pixels"]}
    return processor_class(
        image_processor=Qwen2VLImageProcessor(size=size, patch_size=14, temporal_patch_size=2, merge_size=2),
        tokenizer=tok,
        video_processor=Qwen2VLVideoProcessor(size=size),  # v5 processors want it passed explicitly
        chat_template=qwen2_5_vl_chat_template,
    )


def build_tiny_qwen2_vl(out: Path, dims: dict, corpus: list[str]) -> None:
    import transformers

    processor = qwen2_vl_processor(transformers.Qwen2VLProcessor, corpus, dims)
    tower = {
        "depth": dims["vision_depth"],
        "embed_dim": dims["vision_dim"],
        "num_heads": dims["vision_heads"],
        "mlp_ratio": dims.get("vision_mlp_ratio", 2),
        "hidden_size": dims["hidden"],  # merger output = text hidden size
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    text = qwen2_text_config(processor.tokenizer, dims)
    save_qwen_vl(out, transformers.Qwen2VLForConditionalGeneration, processor, dims, text, tower)


def qwen_text_config(tok, dims: dict, **extra) -> dict:
    """The text model config every tiny Qwen-VL shares (<|endoftext|> pads); `extra` adds or replaces keys."""
    return tiny_text_config(tok, dims, pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"), **extra)


def qwen2_text_config(tok, dims: dict) -> dict:
    """Qwen2's text model, as Qwen2-VL and Qwen2.5-VL configure it."""
    return qwen_text_config(
        tok,
        dims,
        max_window_layers=dims["layers"],
        # head_dim/2 rotary frequencies, split over (temporal, height, width): tiny 16 -> [2, 3, 3]
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": dims["mrope"]},
        bos_token_id=None,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
    )


def qwen_vision_config(dims: dict, patch_size: int, **extra) -> dict:
    """The tower of Qwen2.5-VL and later (Qwen3-VL's, Qwen3.5's): `patch_size` px patches, two frames deep,
    merged 2x2 into the text model's width; `extra` adds keys."""
    return {
        "depth": dims["vision_depth"],
        "hidden_size": dims["vision_dim"],
        "intermediate_size": dims["vision_intermediate"],
        "num_heads": dims["vision_heads"],
        "out_hidden_size": dims["hidden"],  # merger output = text hidden size
        "patch_size": patch_size,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        **extra,
    }


def save_qwen_vl(
    out: Path, model_class, processor, dims: dict, text_config: dict, vision_config: dict
) -> None:
    """The last step of every tiny Qwen-VL: `model_class`'s config of the text model, the tower and the
    vision token ids (image, video, vision start/end), embeddings tied as the dims say; saved with random
    weights, the processor and the Qwen generation config."""
    tok = processor.tokenizer
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_VL_SPECIAL_TOKENS}
    config = model_class.config_class(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=dims.get("tie_embeddings", False),
    )
    save_tiny_model(out, model_class, config, processor, dims, **qwen_generation(ids))


# What build_tiny_qwen2_vl builds, one dict per demo model (BUILDS below)
TINY = {
    **TINY_TEXT_DIMS,
    "mrope": [2, 3, 3],
    "vision_depth": 2,
    "vision_dim": 32,
    "vision_heads": 2,
    "max_pixels": 28 * 28 * 16,  # at most 16 merged image tokens per image: fast on CPU
}


BENCH = {
    "hidden": 512,
    "intermediate": 1376,
    "layers": 4,
    "heads": 8,
    "kv_heads": 4,
    "mrope": [8, 12, 12],
    "vision_depth": 4,
    "vision_dim": 256,
    "vision_heads": 4,
    "max_pixels": 28 * 28 * 64,
}


QWEN2_VL_2B_SHAPED = {  # Qwen/Qwen2-VL-2B-Instruct's config.json
    "hidden": 1536,
    "intermediate": 8960,
    "layers": 28,
    "heads": 12,
    "kv_heads": 2,
    "mrope": [16, 24, 24],
    "vision_depth": 32,
    "vision_dim": 1280,
    "vision_heads": 16,
    "vision_mlp_ratio": 4,
    "vocab": 151936,  # rows past the local tokenizer's are never produced, but cost what they cost
    "tie_embeddings": True,
    "dtype": "bfloat16",
    "max_pixels": 28 * 28 * 256,
}


# Qwen2-VL-2B's widths with its depths and vocabulary cut in proportion (1/7: 28 -> 4 decoder layers,
# 151,936 -> 21,760 vocabulary rows, 32 -> 5 tower blocks), so that each role keeps its share of a training
# step's FLOPs (tests/test_benchmark.py bounds them within 10 points of the real model's, `vlm-recipes bench`
# prints both) in ~1/7 of its time. Keeping the real vocabulary would need all 28 layers: with 4, the LM
# head alone would be 5/9 of the language model and every speed-up that skips it would look better than it is.
BENCH_WIDE = {
    **{k: v for k, v in QWEN2_VL_2B_SHAPED.items() if k not in ("layers", "vision_depth", "vocab")},
    "layers": 4,
    "vision_depth": 5,
    "vocab": 21760,  # 151,936 x 4/28, rounded up to a multiple of 64; the local tokenizer's rows come first
}


# The demo models this module builds: demo id -> what it builds (demo/models.py finds them here)
BUILDS = {
    "demo:tiny-qwen2-vl": TinyModel("qwen2_vl", build_tiny_qwen2_vl, TINY),
    # ~16M parameters, for scripts/benchmark.py
    "demo:bench-qwen2-vl": TinyModel("qwen2_vl", build_tiny_qwen2_vl, BENCH),
    # Qwen2-VL-2B's widths, 1/7 of its depth (CPU bench)
    "demo:bench-qwen2-vl-wide": TinyModel("qwen2_vl", build_tiny_qwen2_vl, BENCH_WIDE),
    # Qwen2-VL-2B's dimensions, random weights (GPU bench)
    "demo:qwen2-vl-2b-shaped": TinyModel("qwen2_vl", build_tiny_qwen2_vl, QWEN2_VL_2B_SHAPED),
}
