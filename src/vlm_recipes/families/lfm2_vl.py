"""LFM2-VL (model_type `lfm2_vl`: LiquidAI/LFM2-VL-450M, -1.6B, -3B): roles, image features, pixel bounds, exact
token counts, the training chat template (the tiny offline builder of `demo:tiny-lfm2-vl`: `demo/tiny/lfm2_vl.py`).

Modules (transformers 5.24, models/lfm2_vl): a SigLIP2 NaFlex tower `model.vision_tower` (patches embedded by a
linear layer, its 16x16 position grid resized to each image's patch grid), the projector
`model.multi_modal_projector` (pixel unshuffle by `downsample_factor`, LayerNorm, two linear layers with GELU), the
LFM2 language model `model.language_model` (short-convolution layers beside full-attention ones, 1-D RoPE) and
`lm_head` (tied to the embeddings).

How Lfm2VlProcessor turns an image into tokens (Lfm2VlImageProcessor.resize_and_split):
1. an image whose pixels exceed `max_image_tokens` tokens' area times `max_pixels_tolerance` (a token is
   `encoder_patch_size` x `downsample_factor` px a side) is cut into the grid of `min_tiles`..`max_tiles` tiles of
   `tile_size` px whose aspect ratio is closest to its own, and a thumbnail follows (`use_thumbnail`);
2. an image kept whole, and the thumbnail, are resized (`smart_resize`) to whole tokens a side, between
   `min_image_tokens` and `max_image_tokens` tokens;
3. the text gets, per image, <|image_start|>, then per tile <|img_row_R_col_C|> and its <image> tokens, then
   <|img_thumbnail|> and the thumbnail's, then <|image_end|>. The model's features fill the <image> tokens
   only, so those are the image tokens here; the markers are text.
`pixel_values` is [tiles, patches, 3 x patch^2]: every image's tiles (a whole image: one) end to end, each padded
to one budget of patches with `pixel_attention_mask` marking the real ones and `spatial_shapes` its patch grid.
The tower attends within each tile, so the vision feature cache keeps one entry per tile.

data.max_pixels sets `max_image_tokens` (an image kept whole, or the thumbnail, holds at most max_pixels, but
for an aspect ratio past it: the processor keeps one token on the short side) and `max_tiles` (the most whole
tiles whose pixels fit in it; under `min_tiles` of them, no image is cut); the thumbnail comes with any grid.
data.min_pixels sets `min_image_tokens`: small images are enlarged to it.

Padding-free packing is refused: LFM2's short convolutions run along the whole row (see PACKING_REFUSAL). FLOP
counts are refused (see FLOPS_REFUSAL). No video: Lfm2VlProcessor takes images only.
"""

from __future__ import annotations

import logging

import torch

from vlm_recipes.errors import UnsupportedModelError
from vlm_recipes.families.base import (
    LLAVA_STYLE_ROLES,
    DecoderLayer,
    Family,
    VisionGeometry,
    count_expanded_tokens,
)
from vlm_recipes.families.pixel_units import fewest_units, most_units
from vlm_recipes.families.training_templates import turn_bodies_in_the_loss

log = logging.getLogger(__name__)

# LFM2-VL's chat template, byte for byte (434 characters): LiquidAI/LFM2-VL-450M's chat_template.jinja (as vendored
# in github.com/varun00391/local-finetuned-model, LiquidAI:LFM2-VL-450M/lfm2-450m/), the string transformers'
# tests/models/lfm2_vl/test_processing_lfm2_vl.py sets on LiquidAI/LFM2-VL-1.6B's processor, and LFM2-VL-3B's (its
# tokenizer_config.json). It writes <|startoftext|> itself; a turn ends in <|im_end|> and a newline. TRL ships no
# training variant of it (its lfm2 templates are the text models'). The tiny model (demo/tiny/lfm2_vl.py) takes it.
LFM2_VL_CHAT_TEMPLATE = (
    "{{bos_token}}{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}{{ '<image>' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{'<|im_end|>\n'}}{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n' }}{% endif %}"
)
# The same text, each assistant turn's body marked for the loss: the answer, <|im_end|> and the newline after
# it (as TRL's lfm2 training template marks LFM2's turns)
LFM2_VL_TRAINING_CHAT_TEMPLATE = turn_bodies_in_the_loss(
    LFM2_VL_CHAT_TEMPLATE,
    "{{'<|im_start|>' + message['role'] + '\n'}}",
    "{% endfor %}{% if add_generation_prompt %}",
)

PACKING_REFUSAL = (
    "lfm2-vl's short-convolution layers (Lfm2ShortConv) mix each token with the conv_L_cache - 1 before it "
    "along the whole row, and transformers 5.24 passes them no sample bounds: in a packed row each sample "
    "would start from the end of the one before it. Set training.padding_free: false"
)
FLOPS_REFUSAL = (
    "lfm2-vl: FLOP counts need a formula for its short-convolution decoder layers (10 of 16 in "
    "LFM2-VL-1.6B), which the formula takes for attention layers, and for its tower, which runs every tile "
    "padded to one budget of patches"
)


def image_layout(image_processor, height: int, width: int) -> tuple[int, int, int, int]:
    """(rows, cols, height, width) of an image of (height, width) as Lfm2VlImageProcessor.resize_and_split
    lays it out: its tile grid (1, 1: kept whole) and the size it, or its thumbnail, is resized to. The
    processor's own size rules, given the sizes alone."""
    ip = image_processor
    min_tiles, max_tiles = (ip.min_tiles, ip.max_tiles) if ip.do_image_splitting else (1, 1)
    patch, factor = ip.encoder_patch_size, ip.downsample_factor
    large = ip._is_image_too_large(height, width, ip.max_image_tokens, patch, factor, ip.max_pixels_tolerance)
    resized_width, resized_height = ip.smart_resize(
        height, width, factor, ip.min_image_tokens, ip.max_image_tokens, patch
    )
    if large and not min_tiles == max_tiles == 1:
        cols, rows, *_ = ip._get_grid_layout(height, width, min_tiles, max_tiles, ip.tile_size)
        return rows, cols, resized_height, resized_width
    return 1, 1, resized_height, resized_width


class Lfm2VlFamily(Family):
    """LFM2-VL: tiles and a thumbnail through a SigLIP2 NaFlex tower, a pixel-unshuffle MLP projector, LFM2."""

    sequence_parallel_refusal = (
        "its short-convolution layers read the tokens just before each one, across a cut, outside attention "
        "where the all-to-all gathers the row"
    )

    # every image's tiles along the first dimension, each padded to one patch budget (named: a one-tile sample's
    # [1, patches, ...] could pass for a per-token tensor)
    image_padding = {
        "pixel_values": "concatenated",
        "pixel_attention_mask": "concatenated",
        "spatial_shapes": "concatenated",
    }
    # LFM2's layer: operator_norm, then self_attn (or conv), ffn_norm, then feed_forward; the loss-positions cut
    # takes a last layer that attends (a short-convolution one is refused by its parts)
    decoder_layer = DecoderLayer(
        input_norm="operator_norm",
        attention_output="out_proj",
        post_attention_norm="ffn_norm",
        mlp="feed_forward",
    )
    # the published template, with each assistant turn (its <|im_end|> and newline) marked for the loss
    training_chat_templates = {LFM2_VL_CHAT_TEMPLATE: LFM2_VL_TRAINING_CHAT_TEMPLATE}

    # ---------------------------------------------------------------- the vision feature cache
    # A unit is one tile: its padded patches and its patch grid (the grid says which patches are real).

    def image_units(
        self, pixel_values: torch.Tensor, spatial_shapes
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if pixel_values.dim() != 3:
            raise ValueError(f"{self.name}: pixel_values of shape {tuple(pixel_values.shape)}, expected 3-D")
        return list(zip(pixel_values, torch.as_tensor(spatial_shapes), strict=True))

    def batch_image_units(self, units: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple:
        """(pixel_values, spatial_shapes, pixel_attention_mask) of these tiles: the mask marks each tile's first
        rows x cols patches real, as the processor pads them."""
        pixels = torch.stack([patches for patches, _ in units])
        shapes = torch.stack([shape for _, shape in units])
        real = shapes.prod(-1)
        mask = (torch.arange(pixels.shape[1], device=pixels.device)[None] < real[:, None]).to(torch.int32)
        return pixels, shapes, mask

    def split_images(self, pixel_values: torch.Tensor, spatial_shapes) -> list[torch.Tensor]:
        return [patches for patches, _ in self.image_units(pixel_values, spatial_shapes)]

    def join_image_features(self, images: list[dict[str, torch.Tensor]]):
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        # pooler_output: one [tokens, hidden] tensor per tile, which the model concatenates (all it reads)
        return BaseModelOutputWithPooling(pooler_output=[image["features"] for image in images])

    # ---------------------------------------------------------------- pixel bounds and token counts

    def apply_pixel_bounds(self, image_processor, min_pixels: int | None, max_pixels: int | None) -> None:
        ip = image_processor
        token = (ip.encoder_patch_size * ip.downsample_factor) ** 2  # pixels of one image token
        if max_pixels is not None:
            ip.max_image_tokens = most_units(self.name, max_pixels, token, "image token")
            ip.min_image_tokens = min(ip.min_image_tokens, ip.max_image_tokens)
            tiles = max_pixels // ip.tile_size**2
            if tiles < ip.min_tiles:
                ip.do_image_splitting = False
            else:
                ip.max_tiles = tiles
            # the patch budget every tile is padded to, as Lfm2VlImageProcessor.__init__ derives it (a processor
            # loaded from these settings has it; so must this one, whose settings key the caches)
            tile_patches = (ip.tile_size // ip.encoder_patch_size) ** 2 if ip.do_image_splitting else 0
            ip.max_num_patches = max(ip.max_image_tokens * ip.downsample_factor**2, tile_patches)
            log.info(
                "%s: data.max_pixels=%d -> max_image_tokens %d, %s",
                self.name,
                max_pixels,
                ip.max_image_tokens,
                f"max_tiles {tiles}" if ip.do_image_splitting else "no image cut into tiles",
            )
        if min_pixels is not None:
            most = ("max_image_tokens", ip.max_image_tokens)
            fewest = fewest_units(self.name, min_pixels, token, "image tokens", most)
            ip.min_image_tokens = fewest
            log.info("%s: data.min_pixels=%d -> min_image_tokens %d", self.name, min_pixels, fewest)

    def image_token_counts(self, processor, sizes: list[tuple[int, int]]) -> list[int]:
        """<image> tokens per image: each tile's and the thumbnail's, or the whole image's (markers are text)."""
        counts = []
        for height, width in sizes:
            rows, cols, resized_height, resized_width = image_layout(processor.image_processor, height, width)
            per_tile, whole = processor._get_image_num_tokens([resized_height, resized_width])
            if rows * cols > 1:
                counts.append(
                    rows * cols * per_tile + (whole if processor.image_processor.use_thumbnail else 0)
                )
            else:
                counts.append(whole)
        return counts

    def count_tokens(
        self, processor, texts: list[str], sizes: list[list[tuple[int, int]]]
    ) -> list[tuple[int, int]]:
        """Each <image> expanded by the processor's own `replace_image_token` from the image's layout, then the
        whole text tokenized as the processor does: (text + the markers, <image> tokens)."""
        markers = getattr(processor, "use_image_special_tokens", True)

        def expand(image_sizes: list[tuple[int, int]], index: int) -> str:
            rows, cols, height, width = image_layout(processor.image_processor, *image_sizes[index])
            layout = {"image_rows": [rows], "image_cols": [cols], "image_sizes": [[height, width]]}
            return processor.replace_image_token(layout, image_idx=0, use_image_special_tokens=markers)

        return count_expanded_tokens(processor, texts, sizes, expand)

    # ---------------------------------------------------------------- training

    def padding_free_refusal(self) -> str | None:
        return PACKING_REFUSAL

    def vision_geometry(self, config) -> VisionGeometry:
        raise UnsupportedModelError(FLOPS_REFUSAL)


LFM2_VL = Lfm2VlFamily(name="lfm2-vl", model_types=("lfm2_vl",), role_prefixes=LLAVA_STYLE_ROLES)
