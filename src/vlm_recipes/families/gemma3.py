"""Gemma 3: roles, image features, token counts, FLOP geometry (the tiny offline builder of
`demo:tiny-gemma3`: `demo/tiny/gemma3.py`).

What differs from the Qwen line (transformers' models/gemma3):
- a SigLIP tower (`model.vision_tower`) sees every image resized to one fixed square (`size`, 896x896 on
  the real checkpoints: 64x64 patches of 14 px); the projector (`model.multi_modal_projector`) average-pools
  the patches to `mm_tokens_per_image` tokens (256) and multiplies them by a bare weight matrix (no
  nn.Linear: `projector: lora` has nothing to adapt, so the projector is trained fully, 2.9M parameters
  on the 4B model, and report.json says so in a `lora-role` decision);
- so every image costs the same tokens, whatever its size. `data.min_pixels` / `data.max_pixels` do not
  apply and are ignored (logged): there is no pixel budget to bound. The processor writes each image as
  "\\n\\n<start_of_image>" + 256 x <image_soft_token> + "<end_of_image>\\n\\n"; the newlines are text
  tokens and `count_tokens` counts them by tokenizing the expanded text, exactly as the processor does;
- pan-and-scan is off in training: Gemma3Processor passes its own `images_kwargs` on every call
  (`do_pan_and_scan: False` in transformers 5.23), over the image processor's saved `do_pan_and_scan`, and
  TRL's collator passes none. Turning it on means setting `processor.images_kwargs["do_pan_and_scan"]`
  (with `pan_and_scan_min_crop_size`, `_max_num_crops`, `_min_ratio_to_activate`) on the processor object;
  an image whose aspect ratio passes the threshold then becomes the whole image plus 2..max crops, each
  its own image sequence, and `count_tokens` counts them with the image processor's own crop rule and
  the settings the call uses (`pan_and_scan_settings`);
- `token_type_ids` mark image tokens, and the language model attends bidirectionally among one image's
  tokens (causally everywhere else). Padding-free packing is refused (`padding_free_refusal`): in a packed
  row transformers 5.23 looks up those image blocks at sample-local positions in the sliding-window
  layers' mask, and per-sample attention is causal only, so either way a packed row attends differently;
- 1-D RoPE (no multimodal position function); the chat template is Gemma's (`<start_of_turn>user` /
  `<start_of_turn>model`, `<end_of_turn>`), which TRL swaps for its training variant (assistant-only loss).
"""

from __future__ import annotations

import math

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from vlm_recipes.families.base import LLAVA_STYLE_ROLES, Family, VisionGeometry

PADDING_FREE_REFUSAL = (
    "gemma3 attends bidirectionally among each image's tokens (token_type_ids). In a packed row "
    "transformers 5.23 builds the sliding-window layers' mask with those image blocks looked up at "
    "sample-local positions (wrong for every sample but the first), and per-sample attention is causal "
    "only: a packed row would attend differently from the padded batch. Set training.padding_free: false"
)


class Gemma3Family(Family):
    """Gemma 3: SigLIP tower, pooling projector, a fixed number of tokens per image."""

    sequence_parallel_refusal = (
        "an image's tokens attend to each other both ways (a bidirectional block in the causal mask), which "
        "the split's causal attention does not build"
    )

    # lmms-eval 0.7.3's --model for a stage's final/ (cli/lmms_eval.py)
    lmms_eval_models = {"gemma3": "gemma3"}

    PAN_AND_SCAN_KEYS = (
        "do_pan_and_scan",
        "pan_and_scan_min_crop_size",
        "pan_and_scan_max_num_crops",
        "pan_and_scan_min_ratio_to_activate",
    )

    def split_images(
        self, pixel_values: torch.Tensor, grids: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        # one fixed-size image (or pan-and-scan crop) per row of pixel_values; no grids
        return list(pixel_values.split(1))

    def image_units(self, pixel_values: torch.Tensor, grids=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        # get_image_features takes pixel values only: an image's shape stands in for its grid in the key
        return [(pixels, torch.tensor(pixels.shape)) for pixels in self.split_images(pixel_values, grids)]

    def batch_image_units(self, units: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple:
        return (torch.cat([pixels for pixels, _ in units]),)

    def join_image_features(self, images: list[dict[str, torch.Tensor]]) -> BaseModelOutputWithPooling:
        # pooler_output: [images, mm_tokens_per_image, hidden], the only thing the model reads
        return BaseModelOutputWithPooling(pooler_output=torch.stack([image["features"] for image in images]))

    def apply_pixel_bounds(self, image_processor, min_pixels: int | None, max_pixels: int | None) -> None:
        import logging

        # Every image is resized to the processor's fixed square: no pixel budget exists to bound.
        size = image_processor.size
        logging.getLogger(__name__).info(
            "gemma3: data.min_pixels/max_pixels ignored: every image is resized to %sx%s and costs a fixed "
            "number of tokens (pan-and-scan is set in the processor config: do_pan_and_scan)",
            size["height"],
            size["width"],
        )

    def crops(self, processor, height: int, width: int) -> int:
        """Pan-and-scan crops of an image besides the whole image (0 when pan-and-scan is off), by the
        image processor's own rule (Gemma3ImageProcessor.pan_and_scan_batched) with the settings a
        processor call uses."""
        settings = pan_and_scan_settings(processor)
        if not settings["do_pan_and_scan"]:
            return 0
        min_crop, max_crops = settings["pan_and_scan_min_crop_size"], settings["pan_and_scan_max_num_crops"]
        long, short = max(height, width), min(height, width)
        if long / short < settings["pan_and_scan_min_ratio_to_activate"]:
            return 0
        n = min(int(math.floor(long / short + 0.5)), int(math.floor(long / min_crop)))
        n = min(max_crops, max(2, n))
        crop_long = int(math.ceil(long / n))
        return n if min(crop_long, short) >= min_crop else 0

    def image_token_counts(self, processor, sizes: list[tuple[int, int]]) -> list[int]:
        # <image_soft_token>s only (the model's image features): one sequence per image and per crop
        return [processor.image_seq_length * (1 + self.crops(processor, h, w)) for h, w in sizes]

    def count_tokens(
        self, processor, texts: list[str], sizes: list[list[tuple[int, int]]]
    ) -> list[tuple[int, int]]:
        """Expand each <start_of_image> the way Gemma3Processor.replace_image_token does, then tokenize:
        the newlines and boundary tokens around each image are counted as the tokenizer merges them."""

        def expand(image_sizes: list[tuple[int, int]], index: int) -> str:
            return self._image_text(processor, self.crops(processor, *image_sizes[index]))

        return self.count_expanded_images(processor, texts, sizes, processor.boi_token, expand)

    @staticmethod
    def _image_text(processor, crops: int) -> str:
        if not crops:
            return processor.full_image_sequence
        return (
            f"Here is the original image {processor.full_image_sequence} and here are some crops to help you "
            "see better " + " ".join([processor.full_image_sequence] * crops)
        )

    def padding_free_refusal(self) -> str | None:
        return PADDING_FREE_REFUSAL

    def vision_geometry(self, config) -> VisionGeometry:
        vision = config.vision_config
        patches = (vision.image_size // vision.patch_size) ** 2
        # the projector's average pool folds patches // mm_tokens_per_image patches into one token
        return VisionGeometry.of_tower(vision, patches_per_token=patches // config.mm_tokens_per_image)


def pan_and_scan_settings(processor) -> dict:
    """The pan-and-scan settings a processor call applies: Gemma3Processor passes its own `images_kwargs`
    (do_pan_and_scan False in transformers 5.23) on every call, over the image processor's attributes."""
    ip = processor.image_processor
    settings = {key: getattr(ip, key, None) for key in Gemma3Family.PAN_AND_SCAN_KEYS}
    settings.update({k: v for k, v in getattr(processor, "images_kwargs", {}).items() if k in settings})
    return settings


GEMMA3 = Gemma3Family(name="gemma3", model_types=("gemma3",), role_prefixes=LLAVA_STYLE_ROLES)
