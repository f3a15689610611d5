"""InternVL 3.5 (model_type `internvl`: OpenGVLab/InternVL3_5-*-HF, and the InternVL3-*-hf checkpoints of the same
classes): roles, image features, pixel bounds, exact token counts, FLOP geometry (the tiny offline builder of
`demo:tiny-internvl`: `demo/tiny/internvl.py`).

Modules (transformers 5.24): an InternViT tower `model.vision_tower` (a patch convolution, a CLS token, learned
positions, pre-norm layers with layer scale), the projector `model.multi_modal_projector` (LayerNorm and two
linear layers with GELU), a Qwen3 text model `model.language_model` (1-D RoPE, causal) and `lm_head` (its own
matrix on the published checkpoints).

How InternVLProcessor turns an image into tokens (its image processor: GotOcr2ImageProcessor, `crop_to_patches`):
1. the tile grid (columns x rows) whose aspect ratio is closest to the image's is picked among the grids of
   `min_patches`..`max_patches` tiles (1..12 on InternVL3.5; a tie goes to more tiles while they cover under
   twice the image's area); the image is stretched onto that grid of `size` tiles (448 px) and cut, and when
   that makes more than one tile a thumbnail (the whole image squeezed into one tile) is appended;
2. each tile is one 448 px image to the tower: 32x32 patches of 14 px, pixel-shuffled 0.5 (2x2 patches into
   one token) to `image_seq_length` = 256 tokens;
3. the text gets, per image, `<img>`, 256 x tiles `<IMG_CONTEXT>`, `</img>`. The model's features fill the
   `<IMG_CONTEXT>` tokens only, so those are the image tokens here; `<img>` and `</img>` are text.
`pixel_values` is [tiles, 3, 448, 448]: every image's tiles end to end, as plain images; nothing in the batch
says which tile is whose (the model never needs to: each tile's features are its own).

data.max_pixels sets `max_patches`: the most whole tiles whose pixels fit in max_pixels (the grid an image is
stretched onto holds at most max_pixels; the thumbnail, one more tile, comes with any grid of several). Under
one tile's pixels is refused: every image is at least one tile. data.min_pixels sets `min_patches`: the fewest
tiles that hold min_pixels (a grid of at least that many tiles, so small images are enlarged onto it).

The tower sees each tile on its own: the vision feature cache keeps one entry per tile (its pixels; the key does
not need its image) and padding-free packing needs only 1-D positions restarting per sample. Video: refused at
the data check (`video_frame_factor` is None): InternVLProcessor stacks a batch's videos into one
[videos, frames, ...] tensor, so videos of different lengths (the frame plan takes data.video_fps frames a
second) cannot share a batch.
"""

from __future__ import annotations

import logging

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from vlm_recipes.families.base import LLAVA_STYLE_ROLES, Family, VisionGeometry, count_expanded_tokens
from vlm_recipes.families.pixel_units import fewest_units, most_units
from vlm_recipes.families.training_templates import turn_bodies_in_the_loss

log = logging.getLogger(__name__)

# The chat template of OpenGVLab's -HF checkpoints, byte for byte: the text OpenGVLab/InternVL's
# internvl_chat/tools/internvl_custom2hf.py (5d8ab0e), which made the InternVL3.5 -HF releases, and transformers'
# convert_internvl_weights_to_hf.py write. Each image is one <IMG_CONTEXT> (the processor expands it), each video
# one <video>; no system prompt of its own. TRL ships neither it nor a training variant.
INTERNVL_CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n'}}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\\n' }}"
    "{% elif content['type'] == 'video' %}{{ '<video>\\n' }}{% elif content['type'] == 'text' %}"
    "{{ content['text'] }}{% endif %}{% endfor %}{% endif %}{{'<|im_end|>\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{'<|im_start|>assistant\\n' }}{% endif %}"
)
# The training variant: the same text, an assistant turn's content and its <|im_end|>\n inside {% generation %}
INTERNVL_TRAINING_CHAT_TEMPLATE = turn_bodies_in_the_loss(
    INTERNVL_CHAT_TEMPLATE,
    "{{'<|im_start|>' + message['role'] + '\\n'}}",
    "{% endfor %}{% if add_generation_prompt",
)


def tiles_per_image(processor, sizes: list[tuple[int, int]]) -> list[int]:
    """Tiles (the thumbnail included) the processor cuts each image of (height, width) into: its own
    `_get_num_multimodal_tokens`, with the processor's image defaults (`crop_to_patches`) merged as on a call."""
    return list(processor._get_num_multimodal_tokens(image_sizes=sizes)["num_image_patches"])


class InternVLFamily(Family):
    """InternVL: tiles plus a thumbnail through an InternViT tower, pixel shuffle, an MLP projector, Qwen3."""

    # its merged embeddings reach `language_model`, split there; proven equal to one process (docs/parallel.md)
    sequence_parallel_refusal = None

    # lmms-eval 0.7.3's --model for a stage's final/ (cli/lmms_eval.py): `internvl_hf` (`internvl`, `internvl2` and
    # `internvl3` load OpenGVLab's remote code)
    lmms_eval_models = {"internvl": "internvl_hf"}

    box_format = "relative_1000"  # `<box>[[x1, y1, x2, y2]]</box>`, 0-1000 across the image

    # every image's tiles along the first dimension, as any image tensor (named: a sample of 1 tile is
    # [1, 3, H, W], which a 3-token sample would mistake for a per-token tensor)
    image_padding = {"pixel_values": "concatenated"}

    # ---------------------------------------------------------------- the vision feature cache
    # A unit is one tile: its pixels, and its (height, width). get_image_features takes the tiles alone (its
    # second argument is the vision_feature_layer, which the model's forward passes as None: the config's).

    def image_units(
        self, pixel_values: torch.Tensor, feature_layer=None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if pixel_values.dim() != 4:
            raise ValueError(f"{self.name}: pixel_values of shape {tuple(pixel_values.shape)}, expected 4-D")
        if feature_layer is not None:
            raise ValueError(
                f"{self.name}: the vision feature cache computes features with the config's vision_feature_layer; "
                f"got vision_feature_layer={feature_layer}"
            )
        return [(tile, torch.tensor(tile.shape[-2:])) for tile in pixel_values]

    def batch_image_units(self, units: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple:
        # the tiles alone: transformers fills vision_feature_layer from the config only when it is not passed
        return (torch.stack([tile for tile, _ in units]),)

    def split_images(self, pixel_values: torch.Tensor, feature_layer=None) -> list[torch.Tensor]:
        return [tile for tile, _ in self.image_units(pixel_values, feature_layer)]

    def join_image_features(self, images: list[dict[str, torch.Tensor]]) -> BaseModelOutputWithPooling:
        # pooler_output: [tiles, image_seq_length, hidden], the only thing the model reads
        return BaseModelOutputWithPooling(pooler_output=torch.stack([image["features"] for image in images]))

    # ---------------------------------------------------------------- pixel bounds and token counts

    def apply_pixel_bounds(self, image_processor, min_pixels: int | None, max_pixels: int | None) -> None:
        tile = image_processor.size["height"] * image_processor.size["width"]
        side = f"{image_processor.size['height']}x{image_processor.size['width']} px"
        if max_pixels is not None:
            image_processor.max_patches = most_units(self.name, max_pixels, tile, f"tile of {side}")
            log.info(
                "%s: data.max_pixels=%d -> max_patches %d", self.name, max_pixels, image_processor.max_patches
            )
        if min_pixels is not None:
            most = ("max_patches", image_processor.max_patches)
            fewest = fewest_units(self.name, min_pixels, tile, f"tiles of {side}", most)
            image_processor.min_patches = fewest
            log.info("%s: data.min_pixels=%d -> min_patches %d", self.name, min_pixels, fewest)

    def image_token_counts(self, processor, sizes: list[tuple[int, int]]) -> list[int]:
        """<IMG_CONTEXT> tokens per image: image_seq_length per tile (<img> and </img> are counted as text)."""
        return [processor.image_seq_length * tiles for tiles in tiles_per_image(processor, sizes)]

    def count_tokens(
        self, processor, texts: list[str], sizes: list[list[tuple[int, int]]]
    ) -> list[tuple[int, int]]:
        """Each <IMG_CONTEXT> expanded by the processor's own `replace_image_token` from the image's tile count,
        then the whole text tokenized as the processor does: (text + <img> / </img>, <IMG_CONTEXT> tokens)."""

        def expand(image_sizes: list[tuple[int, int]], index: int) -> str:
            tiles = tiles_per_image(processor, image_sizes)
            return processor.replace_image_token({"num_patches": tiles}, image_idx=index)

        return count_expanded_tokens(processor, texts, sizes, expand)

    # the published template, with each assistant turn (its <|im_end|> included) marked for the loss
    training_chat_templates = {INTERNVL_CHAT_TEMPLATE: INTERNVL_TRAINING_CHAT_TEMPLATE}

    def vision_geometry(self, config) -> VisionGeometry:
        vision = config.vision_config
        shuffle = round(1 / config.downsample_ratio)  # pixel shuffle 0.5: 2x2 patches into one token
        side = vision.image_size[0] // vision.patch_size[0] // shuffle  # a tile's tokens per side
        # every tile is attended on its own. Its CLS token (one per tile, dropped before the projector) is left
        # out: 1 of 1025 tokens a tile on InternViT
        return VisionGeometry.of_tower(vision, patches_per_token=shuffle**2, tile_side=side)


INTERNVL = InternVLFamily(name="internvl", model_types=("internvl",), role_prefixes=LLAVA_STYLE_ROLES)
