"""A frozen vision tower does no extra work: no autograd through it, and (opt-in) no forward either.

Both hook the same place: the `get_image_features` of the inner model the family names (Qwen2-VL's
`Qwen2VLModel`), which the model's forward calls for the images of a batch. What that returns is the
family's business: `family.split_image_features` turns it into one dict of tensors per image (stored as
is: the merged image tokens, and e.g. Qwen3-VL's DeepStack features) and `join_image_features` back.

- No gradient: with the vision tower and projector frozen, nothing upstream of the image features
  needs a gradient. transformers still asks for one when activation checkpointing meets PEFT
  (`enable_input_require_grads` hooks every input embedding, the vision patch embedding included), and
  then backward runs through the whole tower, recomputing its checkpointed blocks, for gradients nobody
  uses. The features are computed under `torch.no_grad()` instead.
- Feature cache: the features of an image cannot change while the tower is frozen, so they are kept on
  disk and reused (next epoch, next run, another seed). The key is the tower's weights and the image
  exactly as the tower receives it: its processed pixel values and grid (so processor settings and image
  content are both in it), the autocast dtype, and the torch and transformers versions. A stale entry
  cannot be hit: any change changes the key. Its size is capped with the preprocessed samples'
  (`training.cache_max_gb`, `cache_storage.CacheBudget`).
"""

from __future__ import annotations

import functools
import inspect
import logging
from pathlib import Path

import torch
from torch import nn

from vlm_recipes.caches.keys import VISION_FEATURE_LIBRARIES, content_digest, versions_key, weights_digest
from vlm_recipes.caches.storage import CacheBudget, EntryStore
from vlm_recipes.families.base import Family
from vlm_recipes.files import write_json
from vlm_recipes.speedups.patch_embedding import patch_convolution_as_matmul

log = logging.getLogger(__name__)


def encoder_methods(family: Family) -> tuple[str, ...]:
    """The methods of the family's encoder owner that run the vision tower: `get_image_features`, and the
    video one where it does not go through `get_image_features` (Qwen2-VL, Qwen2.5-VL)."""
    video = family.video_encoder()
    return ("get_image_features", *([video] if video else []))


def run_without_grad(model: nn.Module, family: Family) -> None:
    """Compute image (and video) features under no_grad (the caller has checked that vision and projector
    are frozen)."""
    owner = family.image_encoder_owner(model)
    for name in encoder_methods(family):
        setattr(owner, name, _without_grad(getattr(owner, name)))


def _without_grad(compute):
    @functools.wraps(compute)  # generate() reads its signature to pick the encoder's inputs
    def features(*args, **kwargs):
        with torch.no_grad():
            return compute(*args, **kwargs)

    return features


def computed_by(tower: nn.Module) -> str:
    """How the tower computes what the weights alone don't say (features computed another way can differ
    in the last bits, so they are kept apart)."""
    matmul = any(getattr(m.forward, "__func__", None) is patch_convolution_as_matmul for m in tower.modules())
    return "patch embedding: matmul" if matmul else "patch embedding: convolution"


class VisionFeatureCache:
    """Per-image vision features on disk, under `root/<digest of the tower's weights and the library
    versions>/`; installed on a model. With a `budget`, reads and writes count against the size cap."""

    def __init__(self, root: Path, model: nn.Module, family: Family, budget: CacheBudget | None = None):
        self.family = family
        self.owner = family.image_encoder_owner(model)
        tower = family.vision_tower(model)
        self.directory = Path(root) / content_digest(
            weights_digest(tower), versions_key(*VISION_FEATURE_LIBRARIES), computed_by(tower)
        )
        self.budget = budget
        self.store = EntryStore("vision-features", budget)
        self.evicted_before = tuple(budget.evicted["vision-features"]) if budget else (0, 0)
        about = self.directory / "tower.json"  # for a person looking in the directory
        if not about.exists():
            write_json(about, {"tower": type(tower).__name__, "family": family.name})
        self.hits = 0
        self.misses = 0

    def install(self) -> VisionFeatureCache:
        for name in encoder_methods(self.family):
            setattr(self.owner, name, self._cached(getattr(self.owner, name)))
        return self

    def _cached(self, compute):
        # generate() passes the encoder's inputs by the names in its signature (`pixel_values_videos`, ...):
        # show the model's own, and take the first two arguments by position or by those names
        first, second = list(inspect.signature(compute).parameters)[:2]

        @functools.wraps(compute)
        def features(*args, **kwargs):
            args = list(args)
            pixel_values = args.pop(0) if args else kwargs.pop(first)
            # the second argument: Qwen's grids, SmolVLM's pixel attention mask
            grids = args.pop(0) if args else kwargs.pop(second, None)
            return self.features(compute, pixel_values, grids, *args, **kwargs)

        return features

    def stats(self) -> dict:
        """Directory, hits, misses and hit rate; with a cap, what it evicted of this cache (logged once)."""
        looked_up = self.hits + self.misses
        stats = {
            "directory": str(self.directory),
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": round(self.hits / looked_up, 4) if looked_up else None,
            **self.store.stats(),
        }
        if self.budget is not None:
            stats.update(self.budget.eviction_stats("vision-features", self.evicted_before))
        return stats

    def features(self, compute, pixel_values, grids, *args, **kwargs):
        """What `compute` (the model's own encoder method) returns for these images or videos, each one read
        from the cache or computed (all misses in one call) and stored. A video's key is its frames' pixels
        and grid, as an image's is: the tower computes the same from the same input either way."""
        units = self.family.image_units(pixel_values, grids)
        if not units:
            return compute(pixel_values, grids, *args, **kwargs)
        autocast = self._autocast_dtype(pixel_values.device.type)
        keys = [self._key(pixels, grid, autocast) for pixels, grid in units]
        features = [self._load(key, pixel_values.device) for key in keys]
        # An image the batch holds several times is computed once: GRPO repeats each prompt, image and all,
        # once per sampled completion (TRL's RepeatSampler), so its group's copies share one tower pass.
        missing = list(dict.fromkeys(keys[i] for i, f in enumerate(features) if f is None))
        first_of = {key: keys.index(key) for key in missing}
        self.hits += len(features) - len(missing)
        self.misses += len(missing)
        if missing:
            inputs = self.family.batch_image_units([units[first_of[key]] for key in missing])
            # what the family rebuilt for these images replaces the batch's own (LFM2-VL's pixel mask)
            rebuilt = list(inspect.signature(compute).parameters)[: len(inputs)]
            kwargs = {name: value for name, value in kwargs.items() if name not in rebuilt}
            with torch.no_grad():
                computed = compute(*inputs, **{**kwargs, "return_dict": True})
            # every tensor the model reads (Qwen3-VL: its DeepStack features too), one dict per image
            by_key = dict(zip(missing, self.family.split_image_features(computed), strict=True))
            for key, image in by_key.items():
                self._store(key, image)
            features = [by_key.get(key, feature) for key, feature in zip(keys, features, strict=True)]
        return self.family.join_image_features(features)

    @staticmethod
    def _autocast_dtype(device_type: str) -> str:
        if torch.is_autocast_enabled(device_type):
            return str(torch.get_autocast_dtype(device_type))
        return "none"

    @staticmethod
    def _key(patches: torch.Tensor, grid: torch.Tensor, autocast: str) -> str:
        return content_digest(f"{tuple(grid.tolist())} autocast {autocast}", patches)

    def _path(self, key: str) -> Path:
        return self.directory / key[:2] / f"{key}.safetensors"

    def _load(self, key: str, device: torch.device) -> dict[str, torch.Tensor] | None:
        return self.store.read(self._path(key), str(device))

    def _store(self, key: str, image: dict[str, torch.Tensor]) -> None:
        self.store.write(self._path(key), image)
