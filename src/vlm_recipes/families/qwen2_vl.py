"""Qwen2-VL: roles, image features, pixel bounds, token counts, positions for packing, FLOP geometry (the
tiny offline builder of `demo:tiny-qwen2-vl` and the benchmark's models: `demo/tiny/qwen2_vl.py`).

`Qwen2VLFamily` is also the base of Qwen2.5-VL and Qwen3-VL (`qwen2_5_vl.py`, `qwen3_vl.py`): the three
share the processor (Qwen2VLImageProcessor: patches end to end, t*h*w per image, smart_resize), the
inner model layout (`model.visual`, `model.language_model`) and the 3-D multimodal RoPE; they override
what differs."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPooling

from vlm_recipes.families.base import Family, VisionGeometry

# The batch keys the Qwen-VL `get_rope_index` takes (Qwen2.5-VL's also second_per_grid_ts, video timing;
# the others ignore it): the image and video grids and the token types place the 3-D positions.
QWEN_VL_ROPE_INDEX_KEYS = ("mm_token_type_ids", "image_grid_thw", "video_grid_thw", "second_per_grid_ts")


class Qwen2VLFamily(Family):
    """Qwen2-VL: a ViT (`model.visual`) whose merger (the projector) merges 2x2 patches into one token;
    3-D multimodal RoPE computed by the model's own `get_rope_index`."""

    # lmms-eval 0.7.3's --model for a stage's final/ (cli/lmms_eval.py)
    lmms_eval_models = {"qwen2_vl": "qwen2_vl"}

    tower_attribute = "visual"
    # `<|box_start|>(x1,y1),(x2,y2)<|box_end|>`, 0-1000 across the image (Qwen3-VL, Qwen3.5 and GLM-4.xV,
    # built on this class, answer in 0-1000 too, as `{"bbox_2d": [...]}`)
    box_format = "relative_1000"

    rope_index_keys = QWEN_VL_ROPE_INDEX_KEYS
    # the whole row's features and M-RoPE positions reach `language_model` as embeddings and positions, which
    # speedups/sequence_parallel.py splits (Qwen3-VL's DeepStack features too)
    sequence_parallel_refusal = None
    # the processor attribute naming the token a video's features fill (GLM-4V writes frames as images)
    video_feature_token = "video_token_id"

    def split_images(self, pixel_values: torch.Tensor, grids: torch.Tensor) -> list[torch.Tensor]:
        # pixel_values holds every image's patches end to end; an image has t*h*w of them
        return list(pixel_values.split(grids.prod(-1).tolist()))

    def join_image_features(self, images: list[dict[str, torch.Tensor]]) -> BaseModelOutputWithPooling:
        # pooler_output: the merged tokens of each image, already split per image by get_image_features
        return BaseModelOutputWithPooling(pooler_output=tuple(image["features"] for image in images))

    def apply_pixel_bounds(self, image_processor, min_pixels: int | None, max_pixels: int | None) -> None:
        set_pixel_budget(image_processor, min_pixels, max_pixels)

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
            pads = ids.count(getattr(processor, self.video_feature_token))
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


# Qwen2-VL and Qwen2.5-VL name their modules alike (Qwen3-VL adds DeepStack mergers to the projector)
QWEN_VL_ROLES = {
    "vision": ("model.visual",),
    "projector": ("model.visual.merger",),
    "llm": ("model.language_model", "lm_head"),
}

QWEN2_VL = Qwen2VLFamily(name="qwen2-vl", model_types=("qwen2_vl",), role_prefixes=QWEN_VL_ROLES)


def set_pixel_budget(image_processor, min_pixels: int | None, max_pixels: int | None) -> None:
    """The Qwen line's image processors size each image within a pixel budget, `size`'s shortest_edge and
    longest_edge in pixels (the generic family applies it to any processor that reads it so)."""
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
