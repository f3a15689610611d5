"""LLaVA-OneVision (model_type `llava_onevision`, e.g. llava-hf/llava-onevision-qwen2-7b-ov-hf): roles, image
features, pixel bounds, exact token counts, FLOP geometry (the tiny offline builder of
`demo:tiny-llava-onevision`: `demo/tiny/llava_onevision.py`).

Modules (transformers 5.23): a SigLIP tower `model.vision_tower`, a two-layer MLP projector
`model.multi_modal_projector` plus the learned `model.image_newline` vector (both the projector role), a
Qwen2 language model `model.language_model` with 1-D RoPE, and `lm_head`.

How the processor turns an image into <image> tokens (LlavaOnevisionProcessor, "anyres"):
1. a sample with ONE image: the best of `image_grid_pinpoints` for its size is picked
   (`select_best_resolution`); the image is resized into it, padded, and cut into tiles of the tower's
   side, plus the whole image squeezed into one tile (the base). Tokens: the base tile's
   (side / patch)^2, then the tiles' patch grid with the padding rows or columns removed ("unpadding"),
   scaled down bilinearly when it holds more than `vision_aspect_ratio` (anyres_max_N) tiles' worth by
   over 1.1x, with one `image_newline` token ending each row. The processor's own
   `_get_number_of_features` counts this; `count_tokens` calls it with each image's size;
2. a sample with SEVERAL images: each is padded to a square and becomes one tile: (side / patch)^2 + 1
   tokens (the +1: one image_newline);
3. `vision_feature_select_strategy` "default" drops the tower's first token (a CLS, absent from SigLIP):
   one token fewer per image. The published checkpoints use "full".

`pixel_values` is (images, tiles, 3, side, side), padded with all-zero tiles to the batch's most tiles,
with `image_sizes` (images, 2) and `batch_num_images` (images per sample).

data.min_pixels / data.max_pixels do not apply and are ignored (logged): the tiling is chosen from
`image_grid_pinpoints`, which the model's config holds as well as the processor (`get_image_features`
picks the grid again from `config.image_grid_pinpoints`), so restricting the processor's alone would make
the model read the tiles wrongly. To spend fewer tokens, lower `vision_aspect_ratio` or the pinpoints in
both the model config and the processor of the checkpoint.

Speed-ups: padding-free packing needs only 1-D positions (causal Qwen2, each image's features its own).
The vision feature cache keeps one entry per image (its real tiles and size): exact for samples of one
image, the anyres case; a sample of several images (the tiles chosen per batch from `batch_num_images`,
which the cache's lookup does not see) is refused when the cache meets it.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPooling

from vlm_recipes.families.base import LLAVA_STYLE_ROLES, Family, VisionGeometry

# llava-hf/llava-onevision-qwen2-*-ov-hf's chat_template (transformers' convert_llava_onevision_weights_to_hf.py
# writes it), byte for byte. TRL ships no variant of it: it already has {% generation %} markers, but they
# leave <|im_end|> out, so a model trained with it never learns to stop (TRL warns).
LLAVA_ONEVISION_CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n'}}{# Render all images first #}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\\n' }}"
    "{% endfor %}{# Render all video then #}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}{{ '<video>\\n' }}"
    "{% endfor %}{# Render all text next #}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] }}"
    "{% endfor %}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] }}{% endgeneration %}{% endfor %}{% endif %}"
    "{{'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)
# The training variant: renders the same text, its generation block also covers the turn's <|im_end|>\n
# (as TRL's qwen2_5_vl training template does), so the stop token is trained.
LLAVA_ONEVISION_TRAINING_CHAT_TEMPLATE = LLAVA_ONEVISION_CHAT_TEMPLATE.replace(
    "{% else %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] }}{% endgeneration %}{% endfor %}{% endif %}"
    "{{'<|im_end|>' + '\\n'}}",
    "{{'<|im_end|>' + '\\n'}}{% else %}{% generation %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] }}"
    "{% endfor %}{{'<|im_end|>' + '\\n'}}{% endgeneration %}{% endif %}",
)
MULTI_IMAGE_CACHE_REFUSAL = (
    "llava-onevision: the vision feature cache handles samples of one image only. A sample of several images "
    "has each image as one square tile (batch_num_images decides it per batch), which the cache's per-image "
    "lookup cannot reproduce exactly. Set training.vision_feature_cache: false for this data"
)
_IMAGE_NEWLINE = "model.image_newline"  # a parameter of the projector role (ends each row of tiles)
log = logging.getLogger(__name__)


def _real_tiles(pixels: torch.Tensor) -> int:
    """Tiles of one image before the all-zero batch padding (a processed tile is never all zeros: the
    normalization maps no 8-bit value to exactly 0)."""
    real = (pixels != 0).flatten(1).any(-1)
    return int(real.nonzero().max()) + 1 if real.any() else 0


class LlavaOnevisionFamily(Family):
    """LLaVA-OneVision: anyres tiles through a SigLIP tower, an MLP projector, image_newline tokens."""

    # its merged embeddings reach `language_model`, split there; proven equal to one process (docs/parallel.md)
    sequence_parallel_refusal = None

    # lmms-eval 0.7.3's --model for a stage's final/ (cli/lmms_eval.py): `llava_hf` (its `llava_onevision` loads
    # the LLaVA-NeXT repository's format)
    lmms_eval_models = {"llava_onevision": "llava_hf"}

    image_padding = {"pixel_values": "tiles"}  # each image's tiles, padded to the batch's most tiles

    def feature_cache_refusal(self, most_images_per_sample: int) -> str | None:
        return MULTI_IMAGE_CACHE_REFUSAL if most_images_per_sample > 1 else None

    def quantization_skip_modules(self, parts: list[str]) -> list[str]:
        # image_newline is a bare parameter, not a module: nothing for bitsandbytes to skip (or quantize)
        return [m for m in super().quantization_skip_modules(parts) if m != _IMAGE_NEWLINE]

    def projector_modules(self) -> tuple[str, ...]:
        return tuple(
            m for m in super().projector_modules() if m != _IMAGE_NEWLINE
        )  # a parameter, not a module

    def unread_parameters(self, model: nn.Module) -> list[str]:
        """The tower's post_layernorm and the layers after the deepest `vision_feature_layer`: the model reads
        the tower's hidden_states (index 0: the embeddings, i: after layer i - 1), never its last output."""
        config = model.config
        selected = config.vision_feature_layer
        layers = config.vision_config.num_hidden_layers
        deepest = max(i % (layers + 1) for i in ([selected] if isinstance(selected, int) else selected))
        tower = self.role_prefixes["vision"][0]
        unread = (
            f"{tower}.post_layernorm.",
            *(f"{tower}.encoder.layers.{i}." for i in range(deepest, layers)),
        )
        names = (name for name, _ in model.named_parameters())
        return [name for name in names if name.removeprefix("base_model.model.").startswith(unread)]

    # ---------------------------------------------------------------- the vision feature cache
    # A unit is one image: its real tiles (the batch padding cut off) and its original (height, width),
    # which picks the grid the tiles are read in.

    def image_units(self, pixel_values: torch.Tensor, image_sizes) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if pixel_values.dim() != 5:
            raise ValueError(f"{self.name}: pixel_values of shape {tuple(pixel_values.shape)}, expected 5-D")
        units = []
        for pixels, size in zip(pixel_values, image_sizes, strict=True):
            tiles = _real_tiles(pixels)
            if tiles < 2:  # anyres always gives the base and at least one tile; one: a multi-image sample
                raise ValueError(MULTI_IMAGE_CACHE_REFUSAL)
            units.append((pixels[:tiles], torch.as_tensor(size)))
        return units

    def batch_image_units(self, units: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple:
        most = max(pixels.shape[0] for pixels, _ in units)
        padded = [torch.cat([p, p.new_zeros(most - p.shape[0], *p.shape[1:])]) for p, _ in units]
        return torch.stack(padded), torch.stack([size for _, size in units])

    def split_images(self, pixel_values: torch.Tensor, image_sizes) -> list[torch.Tensor]:
        return [pixels for pixels, _ in self.image_units(pixel_values, image_sizes)]

    def join_image_features(self, images: list[dict[str, torch.Tensor]]) -> BaseModelOutputWithPooling:
        # pooler_output: one [tokens, hidden] tensor per image (base, unpadded tiles, newlines)
        return BaseModelOutputWithPooling(pooler_output=[image["features"] for image in images])

    # ---------------------------------------------------------------- pixel bounds and token counts

    def apply_pixel_bounds(self, image_processor, min_pixels: int | None, max_pixels: int | None) -> None:
        log.warning(
            "%s: data.min_pixels/max_pixels ignored: an image's tiles are chosen from image_grid_pinpoints, "
            "which the model config holds too (lower vision_aspect_ratio or the pinpoints in both to spend "
            "fewer tokens)",
            self.name,
        )

    @staticmethod
    def _one_image_tokens(processor, height: int, width: int, alone: bool) -> int:
        """<image> tokens of one image: anyres when it is its sample's only image, else one square tile."""
        ip = processor.image_processor
        side_h, side_w = (
            (ip.size["height"], ip.size["width"]) if "height" in ip.size else (ip.size["shortest_edge"],) * 2
        )
        if alone:
            tokens = processor._get_number_of_features(height, width, side_h, side_w)
        else:
            tokens = processor.num_image_tokens + 1  # + its image_newline
        return tokens - (processor.vision_feature_select_strategy == "default")

    def image_token_counts(self, processor, sizes: list[tuple[int, int]]) -> list[int]:
        """<image> tokens of each image of ONE sample (how many images it has decides the layout)."""
        return [self._one_image_tokens(processor, h, w, alone=len(sizes) == 1) for h, w in sizes]

    def count_tokens(
        self, processor, texts: list[str], sizes: list[list[tuple[int, int]]]
    ) -> list[tuple[int, int]]:
        """Each <image> is one special token in the template, which the processor repeats: the default
        count, with this family's per-sample image layout (`image_token_counts` gets one sample's sizes)."""
        for text, image_sizes in zip(texts, sizes, strict=True):
            if (found := text.count(processor.image_token)) != len(image_sizes):
                raise ValueError(f"{found} {processor.image_token} in the text, {len(image_sizes)} images")
        return super().count_tokens(processor, texts, sizes)

    # the published template, with the turn's <|im_end|> inside the loss (renders the same text)
    training_chat_templates = {LLAVA_ONEVISION_CHAT_TEMPLATE: LLAVA_ONEVISION_TRAINING_CHAT_TEMPLATE}

    def vision_geometry(self, config) -> VisionGeometry:
        vision = config.vision_config
        side = vision.image_size // vision.patch_size  # a tile's patches per side: one token each
        return VisionGeometry.of_tower(vision, patches_per_token=1, tile_side=side)  # each tile on its own


LLAVA_ONEVISION = LlavaOnevisionFamily(
    name="llava-onevision",
    model_types=("llava_onevision",),
    role_prefixes={**LLAVA_STYLE_ROLES, "projector": ("model.multi_modal_projector", _IMAGE_NEWLINE)},
)
