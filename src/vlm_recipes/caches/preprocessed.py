"""The caches of vlm-recipes, keyed by one digest function.

- token counts (always on): each sample's text and image tokens, for the length check before loading;
- preprocessed samples (`training.preprocessed_cache`): each row's tokens, labels and processed pixels;
- vision features (`training.vision_feature_cache`, in `speedups/frozen_vision.py`): a frozen tower's
  output per image.

A key covers everything that makes an entry what it is: the processor (image settings, chat template,
tokenizer), the rows' messages and their images' content (a file's path, size and modification time, or
the bytes), the tower's weights. Any change gives another key, so a stale entry can never be read.
Entries are written atomically; every cache directory can be deleted at any time.

Preprocessed samples: TRL's vision collator decodes the images, resizes and normalizes them, renders the
chat template and tokenizes, for every batch of every epoch of every stage. With the cache each row is
processed once, by that same collator, and read back afterwards: next epoch, next run, next seed, and the
next stage when it uses the same processor settings (r3's two stages do). Images stay undecoded until a
row is missing from the cache. Pixels are stored losslessly as a codebook (`cache_storage.py`): the image
processors resize 8-bit images before they rescale and normalize, so each colour channel holds at most 256
distinct floats, and a pixel is one byte (its index) instead of four: a 448x448 image takes 1.2 MB instead
of 4.8 MB, and reads back bit for bit.

A key also covers the versions of the libraries that made the entry (`versions_key`): a new
transformers, tokenizers, TRL, torch or Pillow may process the same row differently.

Size: the speed-up caches (preprocessed samples, vision features) are capped together by
`training.cache_max_gb` (`cache_storage.CacheBudget`): past the cap, the least recently used entries are
deleted.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from PIL import Image

from vlm_recipes.caches.keys import (
    PREPROCESSED_SAMPLE_LIBRARIES,
    content_digest,
    processor_digest,
    row_parts,
    versions_key,
)
from vlm_recipes.caches.storage import CacheBudget, EntryStore, compact_pixels, expand_pixels
from vlm_recipes.data.images import upright_rgb

PAD_VALUES = {"labels": -100, "attention_mask": 0}  # input_ids: the tokenizer's pad id; others: 0


# --------------------------------------------------------------------------- token counts


# --------------------------------------------------------------------------- preprocessed samples


def decoded(image):
    """A PIL image, upright and in RGB as data/images.py gives every processor its images (undecoded rows
    carry a path or bytes)."""
    if not isinstance(image, dict | str):
        return upright_rgb(image)
    if isinstance(image, dict) and image.get("bytes"):
        opened = Image.open(io.BytesIO(image["bytes"]))
    else:
        opened = Image.open(image["path"] if isinstance(image, dict) else image)
    opened.load()
    return upright_rgb(opened)


class PreprocessedSampleCollator:
    """Wraps the padded collator SFTTrainer built: one row at a time through it on a miss, then the
    batch is assembled from the rows exactly as that collator pads it (right padding). `image_padding`:
    how the family's processor pads image tensors across a batch (`Family.image_padding`)."""

    def __init__(
        self,
        padded,
        root: Path,
        budget: CacheBudget | None = None,
        image_padding: Mapping[str, str] | None = None,
    ):
        self.padded = padded
        self.image_padding = dict(image_padding or {})
        processor = padded.processor
        self.pad_token_id = processor.tokenizer.pad_token_id
        self.directory = Path(root) / content_digest(
            processor_digest(processor, padded.chat_template),
            versions_key(*PREPROCESSED_SAMPLE_LIBRARIES),
        )
        self.budget = budget
        self.store = EntryStore("preprocessed", budget)
        self.evicted_before = tuple(budget.evicted["preprocessed"]) if budget else (0, 0)
        self.hits = 0
        self.misses = 0

    def stats(self) -> dict:
        """Directory, hits and misses; with a cap, what it evicted of this cache (logged once)."""
        stats = {
            "directory": str(self.directory),
            "hits": self.hits,
            "misses": self.misses,
            **self.store.stats(),
        }
        if self.budget is not None:
            stats.update(self.budget.eviction_stats("preprocessed", self.evicted_before))
        return stats

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        samples = [self._sample(example) for example in examples]
        return assemble(samples, self.pad_token_id, self.image_padding)

    def _sample(self, example: dict[str, Any]) -> dict[str, torch.Tensor]:
        path = self.directory / f"{self._key(example)}.safetensors"
        if (stored := self.store.read(path)) is not None:
            self.hits += 1
            return expand_pixels(stored)
        self.misses += 1
        row = {**example, "images": [decoded(image) for image in example.get("images") or []]}
        sample = {k: v for k, v in self.padded([row]).items() if isinstance(v, torch.Tensor)}
        self.store.write(path, compact_pixels(sample))
        return sample

    def _key(self, example: dict[str, Any]) -> str:
        videos = getattr(self.padded, "videos", None)  # data.collate.VideoCollator: frames by these settings
        settings = [videos.sampling.key()] if videos is not None and example.get("videos") else []
        if settings:  # and what the processor makes of the frames: Qwen2.5-VL's adds second_per_grid_ts
            processor = self.padded.processor  # where Qwen2-VL's, same image settings, does not
            settings += [type(processor).__name__, processor.video_processor.to_json_string()]
        return content_digest(*row_parts(example), *settings)


def assemble(
    samples: list[dict[str, torch.Tensor]], pad_token_id: int, image_padding: Mapping[str, str] | None = None
) -> dict[str, torch.Tensor]:
    """One-row samples → a right-padded batch: per-token tensors padded, image tensors as `image_padding`
    says (`Family.image_padding`: "per sample", "tiles" or "sides"), any other tensor concatenated."""
    image_padding = image_padding or {}
    lengths = [s["input_ids"].shape[1] for s in samples]
    longest = max(lengths)
    batch: dict[str, torch.Tensor] = {}
    for key in dict.fromkeys(k for s in samples for k in s):
        present = [s[key] for s in samples if key in s]
        per_token = key not in image_padding and all(
            key in s and s[key].dim() >= 2 and s[key].shape[:2] == (1, n)
            for s, n in zip(samples, lengths, strict=True)
        )
        if per_token:
            pad = pad_token_id if key == "input_ids" else PAD_VALUES.get(key, 0)
            out = present[0].new_full((len(samples), longest, *present[0].shape[2:]), pad)
            for i, (tensor, n) in enumerate(zip(present, lengths, strict=True)):
                out[i, :n] = tensor[0]
            batch[key] = out
        elif image_padding.get(key) == "tiles":
            batch[key] = _pad_tiles(present)
        elif image_padding.get(key) == "per sample":
            batch[key] = _pad_image_slots(samples, key)
        elif image_padding.get(key) == "sides":
            batch[key] = _pad_sides(present)
        else:
            batch[key] = torch.cat(present)
    return batch


def _pad_tiles(present: list[torch.Tensor]) -> torch.Tensor:
    """Images as tiles, [images, tiles, 3, H, W] (LLaVA-OneVision's anyres): the processor pads every image
    to the batch's most tiles (all-zero tiles, which the model never reads) and keeps one row per image
    (none for a text-only sample)."""
    most = max(t.shape[1] for t in present)
    return torch.cat(
        [torch.cat([t, t.new_zeros(t.shape[0], most - t.shape[1], *t.shape[2:])], 1) for t in present]
    )


def _pad_sides(present: list[torch.Tensor]) -> torch.Tensor:
    """Images [images, channels, H, W] (Mistral 3's Pixtral processor): every image zero-padded at its bottom
    and right to the batch's largest height and width (`image_sizes` keeps the real ones)."""
    height, width = (max(t.shape[d] for t in present) for d in (-2, -1))
    return torch.cat([F.pad(t, (0, width - t.shape[-1], 0, height - t.shape[-2])) for t in present])


def _pad_image_slots(samples: list[dict[str, torch.Tensor]], key: str) -> torch.Tensor:
    """Images kept per sample, [1, images, ..., H, W] (SmolVLM's tiles and their pixel masks): the processor
    pads a batch to its most images (all-zero images, which the model drops) and its largest H and W
    (zeros)."""
    present = [s[key] for s in samples if key in s]
    shape = [max(t.shape[d] for t in present) for d in range(1, present[0].dim())]
    out = present[0].new_zeros((len(samples), *shape))
    for i, sample in enumerate(samples):
        if key in sample:
            tensor = sample[key][0]
            out[(i, *(slice(0, n) for n in tensor.shape))] = tensor
    return out
