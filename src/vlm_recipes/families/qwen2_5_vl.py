"""Qwen2.5-VL: Qwen2-VL's layout, processor and 3-D RoPE, with a different vision tower (the tiny offline
builder of `demo:tiny-qwen2.5-vl`: `demo/tiny/qwen2_5_vl.py`).

What differs from Qwen2-VL (transformers' models/qwen2_5_vl):
- the tower (`Qwen2_5_VisionTransformerPretrainedModel`): RMSNorm, a gated (SwiGLU) MLP, and windowed
  attention: every layer but those in `fullatt_block_indexes` attends within windows of
  `window_size` pixels (112 px: 4x4 merged tokens), which the FLOP formula counts per window;
- its config names the tower width `hidden_size` and the merger output `out_hidden_size` (Qwen2-VL:
  `embed_dim` and `hidden_size`);
- `get_rope_index` also takes `second_per_grid_ts` (video timing; images need none).
The module names (`model.visual`, `model.visual.merger`, `model.language_model`, `lm_head`), the image
processor (Qwen2VLImageProcessor, 14 px patches, 2x2 merge) and the chat template are Qwen2-VL's.
"""

from __future__ import annotations

from vlm_recipes.families.base import VisionGeometry
from vlm_recipes.families.qwen2_vl import QWEN_VL_ROLES, Qwen2VLFamily


class Qwen2_5_VLFamily(Qwen2VLFamily):  # noqa: N801 (transformers' spelling)
    """Qwen2.5-VL: Qwen2-VL with a windowed-attention tower."""

    # lmms-eval 0.7.3's --model for a stage's final/ (cli/lmms_eval.py)
    lmms_eval_models = {"qwen2_5_vl": "qwen2_5_vl"}

    box_format = "resized_pixels"  # `{"bbox_2d": [...]}` in pixels of the image as the processor resized it

    def vision_geometry(self, config) -> VisionGeometry:
        vision = config.vision_config
        merge = vision.spatial_merge_size
        return VisionGeometry(
            patches_per_token=merge**2,
            width=vision.hidden_size,
            layers=vision.depth,
            # get_vision_window_index: a window is window_size // merge // patch_size merged tokens a side
            window=vision.window_size // merge // vision.patch_size,
            full_attention_layers=len({i for i in vision.fullatt_block_indexes if 0 <= i < vision.depth}),
        )


QWEN2_5_VL = Qwen2_5_VLFamily(name="qwen2.5-vl", model_types=("qwen2_5_vl",), role_prefixes=QWEN_VL_ROLES)
