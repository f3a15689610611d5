"""Gemma 4: roles, image features, pixel bounds, exact token counts, the training chat template, FLOP
geometry (the tiny offline builder of `demo:tiny-gemma4`: `demo/tiny/gemma4.py`).

What differs from Gemma 3 (transformers' models/gemma4):
- a variable-resolution tower (`model.vision_tower`): each image is resized, keeping its aspect ratio, to
  fill a budget of `max_soft_tokens` tokens (70, 140, 280, 560 or 1120; 280 on the real checkpoints) of
  3x3 patches of 16 px, so a token is 48x48 px and every image costs up to its budget whatever its size
  (small images are scaled up). The processor hands over each image's patches padded to the budget
  (`pixel_values` [images, max_patches, 768]) and their (x, y) positions (`image_position_ids`, -1 on
  padding), the second argument of `get_image_features`; the tower pools each image on its own;
- `data.max_pixels` picks the budget: the largest whose pixels (tokens x 48 x 48) fit in it, so the seed
  recipes' 200704 (448x448) gives 70 tokens an image; below 161280 px the smallest, 70, is taken (logged).
  `data.min_pixels` does not apply (every image is scaled to its budget) and is ignored (logged);
- the projector (`model.embed_vision`) is a norm and one linear layer; the processor writes each image as
  `<|image>` + its tokens x `<|image|>` + `<image|>`, and `count_tokens` counts them as it does;
- E2B and E4B have an audio tower and its embedder beside the vision tower
  (`model.audio_tower`, `model.embed_audio`). They are in roles as ms-swift's anchors put them (the audio
  tower with the vision tower, its embedder with the aligner: `vision` and `projector`), so every parameter
  of a published checkpoint has a role; but no stage here feeds audio, and Gemma4Config makes the tower
  optional: stages load the model without it (`towers_left_out`, a `towers-left-out` decision in
  report.json). The checkpoint's audio weights are left unread (transformers reports them as unexpected
  keys); nothing else changes, and final/ takes them back unchanged from the source (stages/outputs.py).
  26B-A4B and 31B have none;
- the text model: sliding-window and global layers (the global ones with their own head_dim, and on 26B
  and 31B one projection for keys and values), a learned `layer_scalar` on each layer's output, per-layer
  input embeddings on E2B/E4B (`embed_tokens_per_layer`, a lookup in the llm role), and on 26B/31B
  bidirectional attention among an image's tokens in the sliding layers (`mm_token_type_ids`). That last
  is why padding-free packing is refused, as for Gemma 3 (`padding_free_refusal`); the refusal is the
  family's, E2B/E4B included, because the data check runs before the model's config is read;
- chat template: `<|turn>user` / `<|turn>model`, `<turn|>`, a thinking channel; TRL has no training
  variant of it, so stages train with the published template plus generation markers
  (`gemma4_template.py`), which renders the same text and puts the answer and `<turn|>` in the loss;
- known training behaviour: LoRA fine-tuning of the 31B shows isolated pre-clip gradient-norm spikes
  (10^2 to 10^4 on ordinary-looking steps, transformers#45676, unsloth#5207; the attention runs at scale 1
  over RMS-normed queries and keys, so its softmax is sharp). training.max_grad_norm (1.0 by default)
  clips every step, and a NaN/inf gradient or loss stops the stage (training.on_nan: stop; skip_step
  drops the step instead); the issue points to the learning rate with clipping (axolotl#3987 lowers it).
  In fp16 the text MLP's gate and up projections overflow to inf (Unsloth's fp16 NaNs): stages train bf16
  or fp32; only `precision: auto` on a GPU without bf16 picks fp16, and there the NaN loss stops the stage.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPooling

from vlm_recipes.errors import GuardError
from vlm_recipes.families.base import Family, VisionGeometry
from vlm_recipes.families.gemma4_template import has_generation_markers, looks_like_gemma4, training_template

log = logging.getLogger(__name__)

SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)  # the image processor's max_soft_tokens values
AUDIO = ("model.audio_tower", "model.embed_audio")
AUDIO_LEFT_OUT = (
    "the audio tower and its embedder (model.audio_tower, model.embed_audio) read audio only, which no "
    "stage's data holds; the model is built without them (Gemma4Config.audio_config: None), their weights "
    "are not read, and final/ takes them back unchanged from the source"
)
PADDING_FREE_REFUSAL = (
    "gemma4 (26B-A4B and 31B) attends bidirectionally among each image's tokens in its sliding-window "
    "layers (mm_token_type_ids). In a packed row transformers 5.23 remaps that block overlay to "
    "sample-local positions (wrong for every sample but the first), and per-sample attention is causal "
    "only: a packed row would attend differently from the padded batch. Set training.padding_free: false"
)


class Gemma4Family(Family):
    """Gemma 4: a variable-resolution tower pooling 3x3 patches, a linear projector, no audio in training."""

    sequence_parallel_refusal = (
        "an image's tokens attend to each other both ways (a bidirectional block in the causal mask), which "
        "the split's causal attention does not build"
    )

    # lmms-eval 0.7.3's --model for a stage's final/ (cli/lmms_eval.py)
    lmms_eval_models = {"gemma4": "gemma4"}

    towers_left_out = {"audio_config": AUDIO_LEFT_OUT}
    # one image's patches and positions, [1, max_patches, ...]: never per token, whatever a sample's length
    image_padding = {"pixel_values": "concatenated", "image_position_ids": "concatenated"}

    def split_images(self, pixel_values: torch.Tensor, grids: torch.Tensor) -> list[torch.Tensor]:
        # one image per row, its patches padded to the budget; `grids`: their positions, row for row
        return list(pixel_values.split(1))

    def join_image_features(self, images: list[dict[str, torch.Tensor]]) -> BaseModelOutputWithPooling:
        # pooler_output: one [tokens, hidden] tensor per image, padding dropped (all the model reads)
        return BaseModelOutputWithPooling(pooler_output=tuple(image["features"] for image in images))

    def projector_modules(self) -> tuple[str, ...]:
        return ("model.embed_vision",)  # the vision tower's output enters it (embed_audio: audio's only)

    def unread_parameters(self, model: nn.Module) -> list[str]:
        # an audio tower a model was loaded with (stages leave it out) reads nothing of text and images
        return [name for name, _ in model.named_parameters() if _is_audio(name)]

    # ---------------------------------------------------------------- pixel bounds and token counts

    @staticmethod
    def token_side(image_processor) -> int:
        """Pixels on a side of one image token: pooling_kernel_size x patch_size (48 on the checkpoints)."""
        return image_processor.pooling_kernel_size * image_processor.patch_size

    def apply_pixel_bounds(self, image_processor, min_pixels: int | None, max_pixels: int | None) -> None:
        side = self.token_side(image_processor)
        if max_pixels is not None:
            fitting = [n for n in SOFT_TOKEN_BUDGETS if n * side * side <= max_pixels]
            budget = max(fitting, default=SOFT_TOKEN_BUDGETS[0])
            if not fitting:
                log.warning(
                    "%s: data.max_pixels %d is below the smallest image budget: %d tokens of %dx%d px (%d px)",
                    self.name,
                    max_pixels,
                    budget,
                    side,
                    side,
                    budget * side * side,
                )
            image_processor.max_soft_tokens = budget
        if min_pixels is not None:
            log.warning(
                "%s: data.min_pixels ignored: every image is resized (up or down) to fill its budget of "
                "max_soft_tokens tokens (data.max_pixels sets it)",
                self.name,
            )

    def image_token_counts(self, processor, sizes: list[tuple[int, int]]) -> list[int]:
        """<|image|> tokens of each image: its patches after the image processor's own resize, pooled."""
        from transformers.models.gemma4.image_processing_gemma4 import get_aspect_ratio_preserving_size

        ip = processor.image_processor
        pooling, patch = ip.pooling_kernel_size, ip.patch_size
        counts = []
        for height, width in sizes:
            h, w = get_aspect_ratio_preserving_size(
                height, width, patch, ip.max_soft_tokens * pooling**2, pooling
            )
            counts.append((h // patch) * (w // patch) // pooling**2)
        return counts

    def count_tokens(
        self, processor, texts: list[str], sizes: list[list[tuple[int, int]]]
    ) -> list[tuple[int, int]]:
        """Each <|image|> of the template expanded as Gemma4Processor.replace_image_token does (boundary
        tokens around the image's tokens), then the whole text tokenized as the processor does."""
        image = processor.image_token

        def expand(image_sizes: list[tuple[int, int]], index: int) -> str:
            [tokens] = self.image_token_counts(processor, [image_sizes[index]])
            return processor.boi_token + image * tokens + processor.eoi_token

        return self.count_expanded_images(processor, texts, sizes, image, expand)

    # ---------------------------------------------------------------- training

    def training_chat_template(self, processor) -> str | None:
        template = processor.chat_template
        if isinstance(template, dict):
            template = template.get("default")
        if not template or not looks_like_gemma4(template) or has_generation_markers(template):
            return None  # not Gemma 4's, or already marked (a stage's final/ saves the training variant)
        if (training := training_template(template)) is None:
            raise GuardError(
                "this Gemma 4 chat template has no training variant here (generation markers for the "
                "assistant-only loss): the revisions google/gemma-4-*-it ship since gemma4 (TRL's gemma4, "
                "gemma4_v4, gemma4_v5) have one. Update the model's chat_template.jinja to the current one"
            )
        return training

    def padding_free_refusal(self) -> str | None:
        return PADDING_FREE_REFUSAL

    def vision_geometry(self, config) -> VisionGeometry:
        vision = config.vision_config
        return VisionGeometry(
            patches_per_token=vision.pooling_kernel_size**2,  # the pooler averages 3x3 patches
            width=vision.num_attention_heads * vision.head_dim,
            layers=vision.num_hidden_layers,
        )


def _is_audio(name: str) -> bool:
    name = name.removeprefix("base_model.model.")
    return any(name == prefix or name.startswith(prefix + ".") for prefix in AUDIO)


GEMMA4 = Gemma4Family(
    name="gemma4",
    model_types=("gemma4",),
    role_prefixes={
        "vision": ("model.vision_tower", "model.audio_tower"),
        "projector": ("model.embed_vision", "model.embed_audio"),
        "llm": ("model.language_model", "lm_head"),
    },
)
