"""Mistral 3 (model_type `mistral3`: Mistral-Small-3.1/3.2-24B, Ministral-3, Magistral-Small with vision): roles,
image features, pixel bounds, exact token counts, FLOP geometry (the tiny offline builder of
`demo:tiny-mistral3`: `demo/tiny/mistral3.py`; the chat template: `mistral3_template.py`).

Modules (transformers 5.24): a Pixtral tower `model.vision_tower` (a patch convolution, RMSNorm, attention
layers with 2-D RoPE over each image's own patch rows and columns), the projector
`model.multi_modal_projector` (RMSNorm, the patch merger folding 2x2 neighbouring patches into one token by a
linear layer, then two linear layers with GELU), a Mistral text model `model.language_model` (1-D RoPE, causal),
and `lm_head` (its own matrix on the published checkpoints).

How PixtralProcessor turns an image into tokens:
1. the image keeps its aspect ratio and is only ever shrunk, to fit a square of `size["longest_edge"]` (1540 px
   on Mistral-Small-3.1); each side is then rounded UP to whole tokens of patch x merge px (14 x 2 = 28), the
   image stretched to fill them: rows x cols tokens;
2. the text gets, per image, `rows` lines of `cols` [IMG] tokens, each line ended by [IMG_BREAK], the last
   one by [IMG_END] instead: rows x (cols + 1) tokens. The model's features fill the [IMG] tokens only, so
   those are the image tokens here; [IMG_BREAK] and [IMG_END] are text;
3. `pixel_values` is [images, 3, H, W], every image zero-padded to the batch's largest height and width, with
   `image_sizes` (each image's real size); the tower crops the padding off after the patch convolution.

data.max_pixels sets `size["longest_edge"]`: the largest multiple of 28 px whose square holds max_pixels, so
no image is resized to more pixels. data.min_pixels is refused: the processor never enlarges an image.

The tower concatenates a batch's images into one sequence and attends with a block-diagonal mask (each image
on its own; flash attention: by sequence lengths), so an image's features are its own: the vision feature
cache keeps one entry per image (its real pixels, the padding cut off, and its size), and padding-free packing
needs only 1-D positions restarting per sample. Video: none (a video row is refused at the data check).
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch
import torch.nn.functional as F
from transformers.modeling_outputs import BaseModelOutputWithPooling

from vlm_recipes.families.base import LLAVA_STYLE_ROLES, Family, VisionGeometry, count_expanded_tokens
from vlm_recipes.families.longest_edge import set_longest_edge
from vlm_recipes.families.mistral3_template import (
    MISTRAL3_CHAT_TEMPLATE,
    MISTRAL3_TRAINING_CHAT_TEMPLATE,
)

log = logging.getLogger(__name__)
# every mistral3 checkpoint merges 2x2 patches (config `spatial_merge_size`); a longest edge in multiples of
# 2 x patch keeps an image within max_pixels for a merge of 1 as well
_EDGE_MERGE = 2


def token_side(processor) -> int:
    """Pixels per image token along a side: the tower's patch times the merge (28 on the checkpoints)."""
    return processor.patch_size * processor.spatial_merge_size


def token_grid(processor, height: int, width: int) -> tuple[int, int]:
    """(rows, cols) of tokens of an image of (height, width): the image processor's own resize rule
    (`get_resize_output_image_size`: shrink into the longest edge, sides up to whole tokens), given a view of
    that shape with no pixels behind it."""
    from transformers.image_utils import ChannelDimension
    from transformers.models.pixtral.image_processing_pixtral import get_resize_output_image_size

    side = token_side(processor)
    edge = processor.image_processor.size["longest_edge"]
    shape_only = np.broadcast_to(np.zeros((1, 1, 3), dtype=np.uint8), (height, width, 3))
    resized = get_resize_output_image_size(
        shape_only, size=(edge, edge), patch_size=(side, side), input_data_format=ChannelDimension.LAST
    )
    return resized[0] // side, resized[1] // side


class Mistral3Family(Family):
    """Mistral 3: a Pixtral tower (2-D RoPE), a patch-merger projector, [IMG] rows ended by [IMG_BREAK]."""

    sequence_parallel_refusal = (
        "its Pixtral tower encodes every image in one sequence, with no output per image for the tower's split "
        "to gather (and 2 split steps ended 20x their floor, a cause not found yet)"
    )

    # lmms-eval 0.7.3's --model for a stage's final/ (cli/lmms_eval.py)
    lmms_eval_models = {"mistral3": "mistral3_vl"}

    # every image zero-padded to the batch's largest height and width (see the module docstring)
    image_padding = {"pixel_values": "sides"}

    # ---------------------------------------------------------------- the vision feature cache
    # A unit is one image: its pixels with the batch padding cut off, and its (height, width).

    def image_units(self, pixel_values: torch.Tensor, image_sizes) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if pixel_values.dim() != 4:
            raise ValueError(f"{self.name}: pixel_values of shape {tuple(pixel_values.shape)}, expected 4-D")
        sizes = torch.as_tensor(image_sizes).tolist()
        return [
            (pixels[:, :height, :width], torch.tensor([height, width]))
            for pixels, (height, width) in zip(pixel_values, sizes, strict=True)
        ]

    def batch_image_units(self, units: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple:
        height = max(pixels.shape[-2] for pixels, _ in units)
        width = max(pixels.shape[-1] for pixels, _ in units)
        padded = [F.pad(p, (0, width - p.shape[-1], 0, height - p.shape[-2])) for p, _ in units]
        return torch.stack(padded), torch.stack([size for _, size in units])

    def split_images(self, pixel_values: torch.Tensor, image_sizes) -> list[torch.Tensor]:
        return [pixels for pixels, _ in self.image_units(pixel_values, image_sizes)]

    def join_image_features(self, images: list[dict[str, torch.Tensor]]) -> BaseModelOutputWithPooling:
        # pooler_output: one [rows x cols, hidden] tensor per image, the only thing the model reads
        return BaseModelOutputWithPooling(pooler_output=tuple(image["features"] for image in images))

    # ---------------------------------------------------------------- pixel bounds and token counts

    def apply_pixel_bounds(self, image_processor, min_pixels: int | None, max_pixels: int | None) -> None:
        unit = image_processor.patch_size["height"] * _EDGE_MERGE
        resizing = (
            "its processor never enlarges an image (it shrinks one into size['longest_edge'] and rounds its "
            "sides up to whole tokens)"
        )
        if edge := set_longest_edge(self.name, image_processor, min_pixels, max_pixels, unit, resizing):
            log.info("%s: data.max_pixels=%d -> longest edge %d px", self.name, max_pixels, edge)

    def image_token_counts(self, processor, sizes: list[tuple[int, int]]) -> list[int]:
        """[IMG] tokens per image: rows x cols (each row's [IMG_BREAK] / [IMG_END] is counted as text)."""
        return [math.prod(token_grid(processor, height, width)) for height, width in sizes]

    def count_tokens(
        self, processor, texts: list[str], sizes: list[list[tuple[int, int]]]
    ) -> list[tuple[int, int]]:
        """Each [IMG] expanded by the processor's own `replace_image_token` from the image's token grid, then
        the whole text tokenized as the processor does: (text + [IMG_BREAK] / [IMG_END], [IMG] tokens)."""
        side = token_side(processor)

        def expand(image_sizes: list[tuple[int, int]], index: int) -> str:
            rows, cols = token_grid(processor, *image_sizes[index])
            return processor.replace_image_token({"image_sizes": [(rows * side, cols * side)]}, image_idx=0)

        return count_expanded_tokens(processor, texts, sizes, expand)

    # The published tokenizers (Mistral-Small-3.1's among them) were saved before transformers 5.0 with a
    # pre-tokenizer regex that splits text wrongly; transformers restores Tekken's own pattern only when asked
    # (it warns otherwise), and leaves a tokenizer saved by 5.x or of another family as it is: so always ask.
    processor_load_kwargs = {"fix_mistral_regex": True}

    # the published template, with each assistant turn (its </s> included) marked for the loss
    training_chat_templates = {MISTRAL3_CHAT_TEMPLATE: MISTRAL3_TRAINING_CHAT_TEMPLATE}

    def vision_geometry(self, config) -> VisionGeometry:
        # the patch merger folds 2x2 patches into one token
        return VisionGeometry.of_tower(config.vision_config, patches_per_token=config.spatial_merge_size**2)


MISTRAL3 = Mistral3Family(name="mistral3", model_types=("mistral3",), role_prefixes=LLAVA_STYLE_ROLES)
