"""Qwen2-VL: roles, image features, pixel bounds, token counts, positions for packing, FLOP geometry, and
the tiny offline builder (`demo:tiny-qwen2-vl`).

`Qwen2VLFamily` is also the base of Qwen2.5-VL and Qwen3-VL (`qwen2_5_vl.py`, `qwen3_vl.py`): the three
share the processor (Qwen2VLImageProcessor: patches end to end, t*h*w per image, smart_resize), the
inner model layout (`model.visual`, `model.language_model`) and the 3-D multimodal RoPE; they override
what differs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPooling

from vlm_recipes.families.base import Family, VisionGeometry
from vlm_recipes.families.tiny import MODEL_SEED, TINY_TEXT_DIMS, qwen_tokenizer

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
_MIN_PIXELS, _MAX_PIXELS = 28 * 28 * 4, 28 * 28 * 16  # 4..16 merged image tokens per image: fast on CPU


class Qwen2VLFamily(Family):
    """Qwen2-VL: a ViT (`model.visual`) whose merger (the projector) merges 2x2 patches into one token;
    3-D multimodal RoPE computed by the model's own `get_rope_index`."""

    def image_encoder_owner(self, model: nn.Module) -> nn.Module:
        for module in model.modules():
            if callable(getattr(module, "get_image_features", None)) and hasattr(module, "visual"):
                return module
        raise ValueError(f"{type(model).__name__} has no vision tower with get_image_features")

    def vision_tower(self, model: nn.Module) -> nn.Module:
        return self.image_encoder_owner(model).visual

    def split_images(self, pixel_values: torch.Tensor, grids: torch.Tensor) -> list[torch.Tensor]:
        # pixel_values holds every image's patches end to end; an image has t*h*w of them
        return list(pixel_values.split(grids.prod(-1).tolist()))

    def split_image_features(self, output) -> list[dict[str, torch.Tensor]]:
        # pooler_output: the merged tokens of each image, already split per image by get_image_features
        return [{"features": features} for features in output.pooler_output]

    def join_image_features(self, images: list[dict[str, torch.Tensor]]) -> BaseModelOutputWithPooling:
        return BaseModelOutputWithPooling(pooler_output=tuple(image["features"] for image in images))

    def apply_pixel_bounds(self, image_processor, min_pixels: int | None, max_pixels: int | None) -> None:
        from transformers.image_utils import SizeDict

        # `size` is what the processor reads at call time (passing min/max_pixels per call is deprecated).
        bounds = {
            "shortest_edge": image_processor.size["shortest_edge"],
            "longest_edge": image_processor.size["longest_edge"],
        }
        if min_pixels is not None:
            bounds["shortest_edge"] = min_pixels
        if max_pixels is not None:
            bounds["longest_edge"] = max_pixels
        image_processor.size = SizeDict(**bounds)

    def image_token_counts(self, processor, sizes: list[tuple[int, int]]) -> list[int]:
        # qwen-vl-utils' smart_resize is the resize rule Qwen's image processors apply
        from qwen_vl_utils import smart_resize

        ip = processor.image_processor
        factor = ip.patch_size * ip.merge_size
        counts = []
        for height, width in sizes:
            h, w = smart_resize(
                height,
                width,
                factor=factor,
                min_pixels=ip.size["shortest_edge"],
                max_pixels=ip.size["longest_edge"],
            )
            counts.append((h // factor) * (w // factor))
        return counts

    def video_frame_factor(self, processor) -> int | None:
        video_processor = processor.video_processor
        return video_processor.patch_size * video_processor.merge_size

    def video_encoder(self) -> str | None:
        return "get_video_features"  # runs the tower itself (Qwen3-VL's calls get_image_features)

    def video_processor_kwargs(self, processor, metadata: list) -> dict:
        kwargs = {"do_resize": False, "do_sample_frames": False, "video_metadata": metadata}
        if hasattr(processor.video_processor, "cap_pixels_per_frame"):
            # qwen-vl-utils' behaviour, which transformers warns it will adopt; moot without resizing
            kwargs["cap_pixels_per_frame"] = True
        return kwargs

    def count_video_tokens(self, processor, plans: list) -> tuple[int, int]:
        # The processor's own expansion of the placeholder (Qwen3-VL: `<t seconds>` and boundary tokens
        # around each pair of frames), from the grid and times the frame plan gives.
        video_processor, tokenizer = processor.video_processor, processor.tokenizer
        text = video = 0
        for plan in plans:
            grid = plan.grid(video_processor.patch_size, video_processor.temporal_patch_size)
            inputs = {"video_grid_thw": torch.tensor([grid]), "video_metadata": [plan.metadata()]}
            ids = tokenizer(processor.replace_video_token(inputs, 0), add_special_tokens=False)["input_ids"]
            pads = ids.count(processor.video_token_id)
            text, video = text + len(ids) - pads - 1, video + pads
        return text, video

    def rope_index(self, model: nn.Module) -> Callable | None:
        for module in model.modules():
            if callable(getattr(module, "get_rope_index", None)):
                return module.get_rope_index
        return None

    def vision_geometry(self, config) -> VisionGeometry:
        vision = config.vision_config
        return VisionGeometry(
            patches_per_token=vision.spatial_merge_size**2,
            width=getattr(vision, "embed_dim", None) or vision.hidden_size,
            layers=getattr(vision, "depth", None) or vision.num_hidden_layers,
        )

    def build_tiny(self, out: Path, dims: dict, corpus: list[str]) -> None:
        build_tiny_qwen2_vl(out, dims, corpus)


_TINY = {
    **TINY_TEXT_DIMS,
    "mrope": [2, 3, 3],
    "vision_depth": 2,
    "vision_dim": 32,
    "vision_heads": 2,
    "max_pixels": _MAX_PIXELS,
}
_BENCH = {
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
_QWEN2_VL_2B_SHAPED = {  # Qwen/Qwen2-VL-2B-Instruct's config.json
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


def build_tiny_qwen2_vl(out: Path, dims: dict, corpus: list[str]) -> None:
    from transformers import (
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )
    from trl.chat_template_utils import qwen2_5_vl_chat_template

    tok = qwen_tokenizer(corpus, QWEN_VL_SPECIAL_TOKENS)
    # TRL matches this template byte for byte (it is Qwen2-VL-2B-Instruct's) and swaps in its
    # training variant with {% generation %} markers for assistant-only loss.
    tok.chat_template = qwen2_5_vl_chat_template
    size = {"shortest_edge": _MIN_PIXELS, "longest_edge": dims["max_pixels"]}
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=size, patch_size=14, temporal_patch_size=2, merge_size=2),
        tokenizer=tok,
        video_processor=Qwen2VLVideoProcessor(size=size),  # v5 processors want it passed explicitly
        chat_template=qwen2_5_vl_chat_template,
    )
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_VL_SPECIAL_TOKENS}
    config = Qwen2VLConfig(
        text_config=qwen2_text_config(dims, len(tok), ids),
        vision_config={
            "depth": dims["vision_depth"],
            "embed_dim": dims["vision_dim"],
            "num_heads": dims["vision_heads"],
            "mlp_ratio": dims.get("vision_mlp_ratio", 2),
            "hidden_size": dims["hidden"],  # merger output = text hidden size
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        **qwen_vision_token_ids(ids),
        tie_word_embeddings=dims.get("tie_embeddings", False),
    )
    save_tiny_model(out, Qwen2VLForConditionalGeneration, config, processor, ids, dims)


def save_tiny_model(out: Path, model_class, config, processor, ids: dict[str, int], dims: dict) -> None:
    """Random weights (reproducible, the caller's RNG untouched), generation config, processor: to `out`."""
    from transformers import GenerationConfig

    # fork_rng keeps the caller's RNG state untouched while making the random init reproducible.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(MODEL_SEED)
        model = model_class._from_config(config, dtype=getattr(torch, dims.get("dtype", "float32")))
    model.generation_config = GenerationConfig(
        eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"], bos_token_id=None
    )
    model.save_pretrained(out, max_shard_size="100GB")  # one model.safetensors, as _MODEL_FILES expects
    processor.save_pretrained(out)  # tokenizer, image/video processor config and chat_template.jinja


def qwen_text_config(dims: dict, vocab: int, ids: dict[str, int], **extra) -> dict:
    """The text model config every tiny Qwen-VL shares; `extra` adds or replaces keys."""
    return {
        "vocab_size": dims.get(
            "vocab", -(-vocab // 64) * 64
        ),  # rounded up; the tokenizer never yields the rest
        "hidden_size": dims["hidden"],
        "intermediate_size": dims["intermediate"],
        "num_hidden_layers": dims["layers"],
        "num_attention_heads": dims["heads"],
        "num_key_value_heads": dims["kv_heads"],
        "max_position_embeddings": 4096,
        "pad_token_id": ids["<|endoftext|>"],
        **extra,
    }


def qwen2_text_config(dims: dict, vocab: int, ids: dict[str, int]) -> dict:
    """Qwen2's text model, as Qwen2-VL and Qwen2.5-VL configure it."""
    return qwen_text_config(
        dims,
        vocab,
        ids,
        max_window_layers=dims["layers"],
        # head_dim/2 rotary frequencies, split over (temporal, height, width): tiny 16 -> [2, 3, 3]
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": dims["mrope"]},
        bos_token_id=None,
        eos_token_id=ids["<|im_end|>"],
    )


def qwen_vision_token_ids(ids: dict[str, int]) -> dict[str, int]:
    """The model config's ids of the image, video and vision start/end tokens."""
    return {
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
    }


# Qwen2-VL and Qwen2.5-VL name their modules alike (Qwen3-VL adds DeepStack mergers to the projector)
QWEN_VL_ROLES = {
    "vision": ("model.visual",),
    "projector": ("model.visual.merger",),
    "llm": ("model.language_model", "lm_head"),
}

QWEN2_VL = Qwen2VLFamily(
    name="qwen2-vl",
    model_types=("qwen2_vl",),
    role_prefixes=QWEN_VL_ROLES,
    lm_head_prefixes=("lm_head",),
    demo_models={
        "demo:tiny-qwen2-vl": _TINY,
        "demo:bench-qwen2-vl": _BENCH,  # ~16M parameters, for scripts/benchmark.py
        "demo:qwen2-vl-2b-shaped": _QWEN2_VL_2B_SHAPED,  # Qwen2-VL-2B's dimensions, random weights (GPU bench)
    },
)
