"""The generic family: any image-text-to-text model no family module names, trained from the roles its own
module tree shows (generic.py's finder), with only what holds for every architecture.

What a family module knows and this one does not, and what it does instead:
- token counts: the model's own processor run on each row, with blank images of the row's sizes (slower
  than a family's rule from the image size, but exact for a processor whose count depends on the size);
- the dtype boundaries: where the projector takes the tower's output, and where the language model takes
  its input embeddings;
- pixel bounds: applied where the image processor sizes images by a pixel budget as the Qwen line's do
  (`size` = shortest_edge/longest_edge in pixels beside a `merge_size`); elsewhere the processor keeps its
  own sizes, and the log says so;
- the speed-ups whose exactness a family module proves for its architecture (packing, the loss-positions
  cut, the vision feature cache, the preprocessed-sample cache) are off, each with a logged decision
  (`UNPROVEN_SPEEDUPS`, speedups/install.py: turn_off_unproven_speedups); so are FLOP counts;
- no video: a row with one is refused at the data check, as for any family without video;
- another modality's tower (audio) is never fed, so it stays frozen even where its role trains in full, and
  DDP searches each step for parameters without a gradient (`reads_every_parameter`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import ClassVar

from PIL import Image
from torch import nn

from vlm_recipes.errors import UnsupportedModelError
from vlm_recipes.families.base import DtypeBoundary, Family, VisionGeometry
from vlm_recipes.families.generic import AUDIO_TOWER_NAMES, FoundRoles, inside
from vlm_recipes.families.qwen2_vl import set_pixel_budget

log = logging.getLogger(__name__)

# training.* settings the generic family turns off (with why), since no family module proves them exact
UNPROVEN_SPEEDUPS = {
    "padding_free": "packed rows need the model's position rule (multimodal RoPE) and attention proven per "
    "sample, which a family module states",
    "loss_positions_only": "cutting the last layer to the loss positions needs its decoder layer's parts "
    "known, which a family module states",
    "vision_feature_cache": "caching image features needs the shape of what get_image_features returns, "
    "one entry per image, which a family module states",
    "preprocessed_cache": "assembling a batch from cached one-row samples needs how the processor batches "
    "its image tensors, which a family module states",
}


@dataclass(frozen=True)
class GenericFamily(Family):
    """A `Family` whose roles were found in the model's module tree (`generic_family(config)`)."""

    found: FoundRoles | None = field(default=None, compare=False)
    unproven_speedups: ClassVar[dict[str, str]] = UNPROVEN_SPEEDUPS
    reads_every_parameter: ClassVar[bool] = False

    @classmethod
    def of(cls, found: FoundRoles) -> GenericFamily:
        """The family of a model with these roles; a subclass (a module in `GENERIC_WITH_KNOWLEDGE`) adds
        what its model type needs besides (a training chat template, a fix transformers lacks)."""
        return cls(
            name=found.model_type if cls is not GenericFamily else f"generic ({found.model_type})",
            model_types=(found.model_type,),
            role_prefixes=found.role_prefixes,
            lm_head_prefixes=found.lm_head_prefixes,
            found=found,
        )

    # ------------------------------------------------------------------ the vision tower

    @property
    def tower_attribute(self) -> str:  # type: ignore[override]  # per model, not per class
        return self.role_prefixes["vision"][0].rpartition(".")[2]

    def image_encoder_owner(self, model: nn.Module) -> nn.Module:
        """The module whose `get_image_features` runs the first tower: the innermost one holding it."""
        tower = self.vision_tower_of(model)
        owners = [
            module
            for module in model.modules()
            if callable(getattr(module, "get_image_features", None))
            and any(child is tower for child in module.modules())
        ]
        if not owners:
            raise UnsupportedModelError(
                f"{self.name}: no module with get_image_features holds the vision tower "
                f"{self.role_prefixes['vision'][0]}"
            )
        return min(owners, key=lambda module: sum(1 for _ in module.modules()))

    def vision_tower_of(self, model: nn.Module) -> nn.Module:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        return base.get_submodule(self.role_prefixes["vision"][0])

    def vision_tower(self, model: nn.Module) -> nn.Module:
        return self.vision_tower_of(model)

    def unread_parameters(self, model: nn.Module) -> list[str]:
        """The other modalities' towers (Qwen3-Omni's audio tower): a stage feeds images, text and video
        only, so no gradient reaches them; they stay frozen when the vision role trains in full."""
        towers = [t for t in self.role_prefixes["vision"] if t.rpartition(".")[2] in AUDIO_TOWER_NAMES]
        return [
            name
            for name, _ in model.named_parameters()
            if any(inside(name.removeprefix("base_model.model."), tower) for tower in towers)
        ]

    # ------------------------------------------------------------------ images and tokens

    def apply_pixel_bounds(self, image_processor, min_pixels: int | None, max_pixels: int | None) -> None:
        size = getattr(image_processor, "size", None) or {}
        if hasattr(image_processor, "merge_size") and {"shortest_edge", "longest_edge"} <= set(size):
            set_pixel_budget(image_processor, min_pixels, max_pixels)
            return
        log.warning(
            "data.min_pixels / data.max_pixels not applied: %s's %s sizes images its own way (size=%s); "
            "set its size in the model's processor_config.json instead",
            self.model_types[0],
            type(image_processor).__name__,
            dict(size),
        )

    def count_tokens(
        self, processor, texts: list[str], sizes: list[list[tuple[int, int]]]
    ) -> list[tuple[int, int]]:
        """The processor itself on each text, with a blank image of each size: exact where the count depends
        on the image's size only (every processor transformers ships)."""
        image_id = image_token_id(processor)
        counts = []
        for text, image_sizes in zip(texts, sizes, strict=True):
            images = [Image.new("RGB", (width, height)) for height, width in image_sizes]
            ids = processor(text=[text], images=[images] if images else None, add_special_tokens=False)
            ids = list(ids["input_ids"][0])
            image_tokens = ids.count(image_id) if image_id is not None else 0
            counts.append((len(ids) - image_tokens, image_tokens))
        return counts

    # ------------------------------------------------------------------ where roles meet

    def projector_modules(self) -> tuple[str, ...]:
        return self.found.projector_modules if self.found else ()

    def dtype_boundaries(self) -> list[DtypeBoundary]:
        """The tower's output into each projector module, and the input embeddings into the language model
        (where one module is the language model: not where it shares its module with the tower)."""
        boundaries = [
            DtypeBoundary("vision tower -> projector", prefix) for prefix in self.projector_modules()
        ]
        language_model = self.found.language_model if self.found else ""
        if language_model and language_model in self.role_prefixes["llm"]:
            boundaries.append(
                DtypeBoundary("image features -> language model", language_model, inputs=("inputs_embeds",))
            )
        return boundaries

    def vision_geometry(self, config) -> VisionGeometry:
        raise UnsupportedModelError(
            f"{self.name}: FLOP counts need the tower's patch geometry, which a family module states"
        )


def image_token_id(processor) -> int | None:
    """The id of the processor's image placeholder token (None: it names none)."""
    if isinstance(getattr(processor, "image_token_id", None), int):
        return processor.image_token_id
    token = getattr(processor, "image_token", None)
    return processor.tokenizer.convert_tokens_to_ids(token) if isinstance(token, str) else None
