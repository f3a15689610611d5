"""SmolVLM (SmolVLM2, model_type `smolvlm`) and Idefics3 (SmolVLM v1 checkpoints such as
HuggingFaceTB/SmolVLM-Instruct, model_type `idefics3`): roles, image features, pixel bounds, exact token
counts, FLOP geometry (the tiny offline builder of `demo:tiny-smolvlm`: `demo/tiny/smolvlm.py`).

Both name their modules alike (transformers 5.23): a SigLIP tower `model.vision_model`, a connector
`model.connector` (pixel shuffle by `scale_factor`, then one linear layer: the projector), a Llama text
model `model.text_model` with 1-D RoPE, and `lm_head`.

How the processor turns an image into tokens (SmolVLMImageProcessor / Idefics3ImageProcessor):
1. the image is resized so that its LONGEST edge is exactly `size["longest_edge"]` (small images are
   upscaled too), keeping the aspect ratio (the other side rounded up to an even number);
2. with `do_image_splitting`, each side is rounded up to a multiple of the tile side
   `max_image_size["longest_edge"]`; an image larger than one tile is cut into rows x cols tiles, and a
   global view (the whole image squeezed into one tile) is appended; without splitting the image is
   squeezed into one tile;
3. each tile becomes `image_seq_len` <image> tokens ((tile / patch)^2 / scale_factor^2), framed by
   <fake_token_around_image> and <row_R_col_C> (global view: <global-img>), a newline after each row.

`pixel_values` is (batch, tiles, 3, tile, tile), padded with all-zero tiles to the batch's most tiles,
with `pixel_attention_mask` (batch, tiles, tile, tile); the model drops the all-zero tiles.

data.max_pixels / data.min_pixels: SmolVLM has no pixel budget, it resizes every image to one longest
edge. `max_pixels` sets that edge: the largest multiple of the tile side whose square holds at most
max_pixels (at least one tile), i.e. a square image of max_pixels pixels is what every image is scaled to
fit. `min_pixels` is refused: every image, however small, is brought up to that edge, so there is no
lower bound to set.

Speed-ups: padding-free packing needs only 1-D positions (no `rope_index`); the vision feature cache
caches one entry per tile (its pixels and pixel mask are the key), which is exact because the tower sees
each tile on its own.
"""

from __future__ import annotations

import math

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from vlm_recipes.families.base import DtypeBoundary, Family, VisionGeometry, count_expanded_tokens
from vlm_recipes.families.longest_edge import set_longest_edge

_TILE_KEY = 3  # the pixel mask rides along as a 4th channel of a cached tile (see image_units)


def tile_grid(image_processor, height: int, width: int) -> tuple[int, int]:
    """(rows, cols) of tiles the image processor cuts an image of (height, width) into; (0, 0): one tile
    (no split). Mirrors `_preprocess` (resize, resize_for_vision_encoder, split_images) step by step: the
    processor's own `get_number_of_image_patches` differs from it when `size` is not a multiple of the
    tile."""
    import importlib

    module = importlib.import_module(type(image_processor).__module__)
    if not image_processor.do_image_splitting:
        return 0, 0
    if image_processor.do_resize:
        longest = image_processor.size.get("longest_edge")
        if not longest:
            raise ValueError("SmolVLM token counts need image_processor.size['longest_edge']")
        height, width = module._resize_output_size_rescale_to_max_len(height, width, max_len=longest)
        height, width = module._resize_output_size_scale_below_upper_bound(
            height, width, max_len=module.MAX_IMAGE_SIZE
        )
    tile = image_processor.max_image_size["longest_edge"]
    aspect_ratio = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect_ratio) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect_ratio) / tile) * tile
    if height > tile or width > tile:
        return math.ceil(height / tile), math.ceil(width / tile)
    return 0, 0


class SmolVLMFamily(Family):
    """SmolVLM / Idefics3: tiles of a fixed size through a SigLIP tower, pixel-shuffled by the connector."""

    # its merged embeddings reach `text_model`, split there; proven equal to one process (docs/parallel.md)
    sequence_parallel_refusal = None

    # why no lmms-eval 0.7.3 class loads a stage's final/ (cli/lmms_eval.py)
    no_lmms_eval_model = {
        "smolvlm": "no SmolVLM class; idefics2's counts the image tokens wrong",
        "idefics3": "no Idefics3 class; idefics2's counts the image tokens wrong",
    }

    tower_attribute = "vision_model"

    # a sample's tiles and their pixel masks, padded to the batch's most tiles (see the module docstring)
    image_padding = {"pixel_values": "per sample", "pixel_attention_mask": "per sample"}

    def dtype_boundaries(self) -> list[DtypeBoundary]:
        # SmolVLMModel.forward casts the image features to `self.dtype`, its first parameter's dtype (the
        # tower's: fp32 while it trains), not to the embeddings' they are scattered into; the embeddings are
        # brought to that dtype for the scatter, and the language model takes the result in its own.
        embeddings = DtypeBoundary(
            "text embeddings -> image-token scatter",
            "model.text_model.embed_tokens",
            side="output",
            dtype_of="model",
            why="SmolVLM casts image features to its first parameter's dtype",
        )
        return [embeddings, *super().dtype_boundaries()]

    # ---------------------------------------------------------------- the vision feature cache
    # A cached unit is one real tile. Its "pixels" are the tile with its pixel mask stacked as a 4th
    # channel (so the cache key covers both), its "grid" the tile's (height, width).

    def image_units(self, pixel_values: torch.Tensor, masks) -> list[tuple[torch.Tensor, torch.Tensor]]:
        tiles = pixel_values.reshape(-1, *pixel_values.shape[2:])
        if masks is None:  # as the model: every pixel real
            masks = torch.ones(tiles.shape[0], *tiles.shape[2:], dtype=torch.long, device=tiles.device)
        masks = masks.reshape(-1, *masks.shape[-2:])
        # the model drops all-zero tiles (batch padding) before its tower: so do the units
        real = (tiles == 0.0).sum(dim=(-1, -2, -3)) != tiles.shape[1:].numel()
        units = []
        for tile, mask in zip(tiles[real], masks[real], strict=True):
            pixels = torch.cat([tile, mask[None].to(tile.dtype)])
            units.append((pixels, torch.tensor(tile.shape[-2:])))
        return units

    def batch_image_units(self, units: list[tuple[torch.Tensor, torch.Tensor]]):
        stacked = torch.stack([pixels for pixels, _ in units])  # [tiles, 4, H, W]
        return stacked[None, :, :_TILE_KEY], stacked[None, :, _TILE_KEY].long()

    def split_images(self, pixel_values: torch.Tensor, grids) -> list[torch.Tensor]:
        return [pixels for pixels, _ in self.image_units(pixel_values, grids)]

    def split_image_features(self, output) -> list[dict[str, torch.Tensor]]:
        # pooler_output: one tensor per batch row, its tiles' tokens end to end; every tile has as many
        # tokens (the tower's last_hidden_state has one row per real tile)
        features = torch.cat(list(output.pooler_output))
        return [{"features": f} for f in features.chunk(output.last_hidden_state.shape[0])]

    def join_image_features(self, images: list[dict[str, torch.Tensor]]) -> BaseModelOutputWithPooling:
        # the model concatenates pooler_output before placing it at the <image> tokens
        return BaseModelOutputWithPooling(pooler_output=(torch.cat([i["features"] for i in images]),))

    # ---------------------------------------------------------------- pixel bounds and token counts

    def apply_pixel_bounds(self, image_processor, min_pixels: int | None, max_pixels: int | None) -> None:
        tile = image_processor.max_image_size["longest_edge"]
        resizing = (
            "its processor resizes every image so that its longest edge is size['longest_edge'], upscaling "
            "small ones"
        )
        set_longest_edge(self.name, image_processor, min_pixels, max_pixels, tile, resizing)

    def image_token_counts(self, processor, sizes: list[tuple[int, int]]) -> list[int]:
        """<image> tokens per image: image_seq_len per tile (the frame tokens are counted as text)."""
        counts = []
        for height, width in sizes:
            rows, cols = tile_grid(processor.image_processor, height, width)
            counts.append(processor.image_seq_len * (rows * cols + 1 if rows or cols else 1))
        return counts

    def count_tokens(
        self, processor, texts: list[str], sizes: list[list[tuple[int, int]]]
    ) -> list[tuple[int, int]]:
        """Each <image> expanded by the processor's own `replace_image_token` from the image's tile grid,
        then the whole text tokenized as the processor does: (text + frame tokens, <image> tokens)."""

        def expand(image_sizes: list[tuple[int, int]], index: int) -> str:
            rows, cols = tile_grid(processor.image_processor, *image_sizes[index])
            return processor.replace_image_token({"rows": [[rows]], "cols": [[cols]]}, image_idx=0)

        return count_expanded_tokens(processor, texts, sizes, expand)

    def vision_geometry(self, config) -> VisionGeometry:
        vision = config.vision_config
        side = vision.image_size // vision.patch_size // config.scale_factor  # merged tokens per tile side
        return VisionGeometry.of_tower(vision, patches_per_token=config.scale_factor**2, tile_side=side)


SMOLVLM = SmolVLMFamily(
    name="smolvlm",
    model_types=("smolvlm", "idefics3"),
    role_prefixes={
        "vision": ("model.vision_model",),
        "projector": ("model.connector",),
        "llm": ("model.text_model", "lm_head"),
    },
)
