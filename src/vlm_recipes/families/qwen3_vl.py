"""Qwen3-VL: Qwen2-VL's layout with a new tower, DeepStack and interleaved mRoPE (the tiny offline builder
of `demo:tiny-qwen3-vl`: `demo/tiny/qwen3_vl.py`).

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

import torch

from vlm_recipes.families.qwen2_vl import Qwen2VLFamily

_DEEPSTACK = "deepstack."  # cache key prefix of a DeepStack level's features: deepstack.0, deepstack.1, ...


class Qwen3VLFamily(Qwen2VLFamily):
    """Qwen3-VL: the image features are the merged tokens plus one set per DeepStack level."""

    # lmms-eval 0.7.3's --model for a stage's final/ (cli/lmms_eval.py), and why none loads the MoE
    lmms_eval_models = {"qwen3_vl": "qwen3_vl"}
    no_lmms_eval_model = {
        "qwen3_vl_moe": "qwen3_vl loads the dense class unless the path names the size (`A3B`)"
    }

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


QWEN3_VL = Qwen3VLFamily(
    name="qwen3-vl",
    model_types=("qwen3_vl", "qwen3_vl_moe"),  # Qwen3-VL-30B-A3B, -235B-A22B: the same layout, MoE blocks
    role_prefixes={
        "vision": ("model.visual",),
        # the DeepStack mergers project tower features into the language model, like the merger
        "projector": ("model.visual.merger", "model.visual.deepstack_merger_list"),
        "llm": ("model.language_model", "lm_head"),
    },
)
