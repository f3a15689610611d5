"""Qwen3-VL: Qwen2-VL's layout with a new tower, DeepStack and interleaved mRoPE, and the tiny offline
builder (`demo:tiny-qwen3-vl`).

What differs from Qwen2-VL (transformers' models/qwen3_vl):
- 16 px patches (Qwen2-VL: 14), so images are resized to multiples of 32 px; image mean/std 0.5;
- the tower (`Qwen3VLVisionModel`) adds learned position embeddings (`pos_embed`, bilinearly resampled to
  each image's grid) and DeepStack: after the layers in `deepstack_visual_indexes`, a merger of its own
  (`model.visual.deepstack_merger_list.N`, a projector like `model.visual.merger`) turns the hidden states
  into one more set of image tokens, which the language model adds to its hidden states at the image
  positions after its first layers. `get_image_features` returns them as `deepstack_features` (one tuple
  per level, one tensor per image): a cached image must keep them, or the model silently loses them;
- the language model is Qwen3's (q/k RMSNorm, explicit head_dim) with interleaved 3-D RoPE;
- the chat template (TRL's qwen3_vl) has no default system prompt; the tokenizer adds <think>,
  <tool_call>, ... as unsplittable tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch

from vlm_recipes.families.qwen2_vl import (
    QWEN_VL_SPECIAL_TOKENS,
    Qwen2VLFamily,
    qwen_text_config,
    qwen_vision_token_ids,
    save_tiny_model,
)
from vlm_recipes.families.tiny import qwen_tokenizer

# Qwen3's added tokens that are not special (kept by decode(skip_special_tokens=True)), in its order.
_QWEN3_ADDED_TOKENS = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
_DEEPSTACK = "deepstack."  # cache key prefix of a DeepStack level's features: deepstack.0, deepstack.1, ...
_MIN_PIXELS, _MAX_PIXELS = 32 * 32 * 4, 32 * 32 * 16  # 4..16 merged image tokens per image: fast on CPU


class Qwen3VLFamily(Qwen2VLFamily):
    """Qwen3-VL: the image features are the merged tokens plus one set per DeepStack level."""

    def video_encoder(self) -> str | None:
        return None  # get_video_features calls get_image_features, which the speed-ups already hook

    def split_image_features(self, output) -> list[dict[str, torch.Tensor]]:
        levels = output.deepstack_features or []
        images = []
        for i, features in enumerate(output.pooler_output):
            image = {"features": features}
            image.update({f"{_DEEPSTACK}{level}": per_image[i] for level, per_image in enumerate(levels)})
            images.append(image)
        return images

    def join_image_features(self, images: list[dict[str, torch.Tensor]]):
        from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

        levels = {len([k for k in image if k.startswith(_DEEPSTACK)]) for image in images}
        if len(levels) > 1:
            raise ValueError(f"image features with different numbers of DeepStack levels: {sorted(levels)}")
        count = levels.pop() if levels else 0
        return BaseModelOutputWithDeepstackFeatures(
            pooler_output=tuple(image["features"] for image in images),
            deepstack_features=[
                tuple(image[f"{_DEEPSTACK}{level}"] for image in images) for level in range(count)
            ],
        )

    def build_tiny(self, out: Path, dims: dict, corpus: list[str]) -> None:
        build_tiny_qwen3_vl(out, dims, corpus)


_TINY = {
    "hidden": 64,
    "intermediate": 128,
    # 3 layers: a DeepStack level is added after text layer N, and one added after the last layer would
    # reach only the (unlabelled) image positions' logits, so it would never get a gradient
    "layers": 3,
    "heads": 4,
    "kv_heads": 2,
    "head_dim": 16,
    # 8 rotary frequencies, interleaved t/h/w: Qwen3-VL's [24, 20, 20] of 64, scaled
    "mrope": [4, 2, 2],
    "vision_depth": 3,
    "vision_dim": 32,
    "vision_intermediate": 64,
    "vision_heads": 2,
    "vision_positions": 64,  # an 8x8 learned grid (the real one: 48x48 = 2304)
    # two levels after intermediate layers, never the last, like the real [5, 11, 17] of 24 layers
    "deepstack": [0, 1],
    "max_pixels": _MAX_PIXELS,
}


def build_tiny_qwen3_vl(out: Path, dims: dict, corpus: list[str]) -> None:
    from transformers import (
        Qwen2VLImageProcessor,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )
    from trl.chat_template_utils import qwen3_vl_chat_template

    tok = qwen_tokenizer(corpus, QWEN_VL_SPECIAL_TOKENS, _QWEN3_ADDED_TOKENS)
    # Qwen3-VL-*-Instruct's template (TRL's qwen3_vl), which TRL swaps for its training variant with
    # {% generation %} markers for assistant-only loss.
    tok.chat_template = qwen3_vl_chat_template
    size = {"shortest_edge": _MIN_PIXELS, "longest_edge": dims["max_pixels"]}
    half = [0.5, 0.5, 0.5]  # Qwen3-VL's preprocessor_config.json (Qwen2-VL: the CLIP mean/std)
    processor = Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(
            size=size, patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=half, image_std=half
        ),
        tokenizer=tok,
        video_processor=Qwen3VLVideoProcessor(size=size, image_mean=half, image_std=half),
        chat_template=qwen3_vl_chat_template,
    )
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_VL_SPECIAL_TOKENS}
    config = Qwen3VLConfig(
        text_config=qwen_text_config(
            dims,
            len(tok),
            ids,
            head_dim=dims["head_dim"],
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 5e6,
                "mrope_section": dims["mrope"],
                "mrope_interleaved": True,
            },
        ),
        vision_config={
            "depth": dims["vision_depth"],
            "hidden_size": dims["vision_dim"],
            "intermediate_size": dims["vision_intermediate"],
            "num_heads": dims["vision_heads"],
            "out_hidden_size": dims["hidden"],  # merger output = text hidden size
            "num_position_embeddings": dims["vision_positions"],
            "deepstack_visual_indexes": dims["deepstack"],
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        **qwen_vision_token_ids(ids),
        tie_word_embeddings=dims.get("tie_embeddings", False),
    )
    save_tiny_model(out, Qwen3VLForConditionalGeneration, config, processor, ids, dims)


QWEN3_VL = Qwen3VLFamily(
    name="qwen3-vl",
    model_types=("qwen3_vl",),
    role_prefixes={
        "vision": ("model.visual",),
        # the DeepStack mergers project tower features into the language model, like the merger
        "projector": ("model.visual.merger", "model.visual.deepstack_merger_list"),
        "llm": ("model.language_model", "lm_head"),
    },
    lm_head_prefixes=("lm_head",),
    demo_models={"demo:tiny-qwen3-vl": _TINY},
)
