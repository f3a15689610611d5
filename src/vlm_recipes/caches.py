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

A key also covers the versions of the libraries that made the entry (`library_versions`): a new
transformers, tokenizers, TRL, torch or Pillow may process the same row differently.

Size: the speed-up caches (preprocessed samples, vision features) are capped together by
`training.cache_max_gb` (`cache_storage.CacheBudget`): past the cap, the least recently used entries are
deleted.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
import transformers
from PIL import Image

from vlm_recipes.cache_storage import CacheBudget, compact_pixels, expand_pixels, read_entry, write_entry
from vlm_recipes.data.video import video_identity
from vlm_recipes.files import cache_dir, write_json

PAD_VALUES = {"labels": -100, "attention_mask": 0}  # input_ids: the tokenizer's pad id; others: 0

# The libraries whose output each cache stores: a new version of any of them gives new keys, so an entry
# made by the old one (a fixed resize, another tokenization) is never read.
# Preprocessed samples: TRL's collator, the processor (transformers, tokenizers), image processing (torch,
# torchvision), image decoding (Pillow), video decoding (av).
PREPROCESSED_SAMPLE_LIBRARIES = ("trl", "transformers", "tokenizers", "torch", "torchvision", "pillow", "av")
# Token counts: the processor's rules and tokenizer, and the image and video headers read (Pillow, av).
TOKEN_COUNT_LIBRARIES = ("transformers", "tokenizers", "pillow", "av")
# Vision features: the tower's code (transformers) and its kernels (torch).
VISION_FEATURE_LIBRARIES = ("torch", "transformers")


def library_versions(*names: str) -> str:
    """`name version` of each installed distribution (`name absent` where it is not installed)."""
    versions = []
    for name in names:
        try:
            versions.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{name} absent")
    return ", ".join(versions)


def speedup_cache_root() -> Path:
    """`$VLM_RECIPES_SPEEDUP_CACHE`, by default the vlm-recipes cache (~/.cache/vlm-recipes)."""
    env = os.environ.get("VLM_RECIPES_SPEEDUP_CACHE")
    return Path(env).expanduser() if env else cache_dir()


def speedup_cache(kind: str) -> Path:
    """Where a speed-up keeps its entries: `kind`/ under `speedup_cache_root()`."""
    return speedup_cache_root() / kind


_BUDGETS: dict[Path, CacheBudget] = {}


def speedup_cache_budget(max_gb: float | None) -> CacheBudget | None:
    """This process's cap over the speed-up caches (None: no cap). One per cache root, kept from stage to
    stage: the entries are listed once, and the entries this process wrote stay known as its own."""
    if max_gb is None:
        return None
    root = speedup_cache_root()
    budget = _BUDGETS.setdefault(root, CacheBudget(root, 0))
    budget.max_bytes = int(max_gb * 1e9)
    return budget


def content_digest(*parts: str | bytes | torch.Tensor) -> str:
    """The digest every cache key is: blake2b (128 bits) over the parts in order. A tensor contributes its
    dtype, shape and bytes (without a copy when it is contiguous and on the CPU)."""
    digest = hashlib.blake2b(digest_size=16)
    for part in parts:
        if isinstance(part, torch.Tensor):
            digest.update(f"{part.dtype} {tuple(part.shape)}".encode())
            digest.update(part.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy())
        else:
            digest.update(part.encode() if isinstance(part, str) else part)
    return digest.hexdigest()


# Gemma 3's; LLaVA-OneVision's (tokens per tile, the anyres_max_N scale-down, CLS dropped or not)
PROCESSOR_OWN_SETTINGS = (
    "images_kwargs",
    "image_seq_length",
    "num_image_tokens",
    "vision_aspect_ratio",
    "vision_feature_select_strategy",
)


def processor_digest(processor, chat_template: str | None = None) -> str:
    """The processor as it shapes samples: image settings, chat template, tokenizer, and the settings a
    processor passes on every call where it has them (Gemma 3: images_kwargs with pan-and-scan, tokens per
    image; the Qwen processors have none, so their digests are as they were)."""
    own = {k: getattr(processor, k) for k in PROCESSOR_OWN_SETTINGS if hasattr(processor, k)}
    return content_digest(
        processor.image_processor.to_json_string(),
        str(chat_template or processor.chat_template),
        _tokenizer_without_state(processor.tokenizer.backend_tokenizer),
        *([json.dumps(own, sort_keys=True, default=str)] if own else []),
    )


def _tokenizer_without_state(tokenizer) -> str:
    """The tokenizer as JSON without its padding and truncation state, which a padded call sets and TRL's
    training template resets: the same tokenizer must give the same digest whatever it did last."""
    from tokenizers import Tokenizer

    copy = Tokenizer.from_str(tokenizer.to_str())
    copy.no_padding()
    copy.no_truncation()
    return copy.to_str()


def image_identity(image) -> bytes:
    """What identifies an image's content: file path + size + mtime, the encoded bytes, or the pixels."""
    if isinstance(image, dict) and image.get("bytes"):
        return hashlib.blake2b(image["bytes"], digest_size=16).digest()
    path = image["path"] if isinstance(image, dict) else image
    if isinstance(path, str):
        stat = os.stat(path)
        return f"{path} {stat.st_size} {stat.st_mtime_ns}".encode()
    return hashlib.blake2b(path.tobytes() + f"{path.mode} {path.size}".encode(), digest_size=16).digest()


def row_parts(row: dict) -> list[bytes]:
    """A row's messages and its images' and videos' identities, as digest parts."""
    parts = [json.dumps(row["messages"], sort_keys=True, default=str).encode()]
    parts += [image_identity(image) for image in row.get("images") or []]
    return parts + [video_identity(video) for video in row.get("videos") or []]


def weights_digest(module: torch.nn.Module) -> str:
    """A digest of every parameter and buffer of the module (names, dtypes, shapes and values)."""
    parts: list[str | torch.Tensor] = [f"{type(module).__name__} transformers {transformers.__version__}"]
    for name, tensor in sorted(module.state_dict().items()):
        parts += [name, tensor]
    return content_digest(*parts)


# --------------------------------------------------------------------------- token counts


def remembered_token_counts(
    rows, processor, count: Callable[[], list[tuple[int, int]]], settings: str = ""
) -> list[tuple[int, int]]:
    """`count()`, remembered on disk under a key of the rows (messages, images, videos), the processor
    and the `settings` the count also depends on (video sampling): the next stage on the same data, the
    next run or another seed skips the recount."""
    parts = [processor_digest(processor), *([settings] if settings else [])]
    for row in rows:
        parts += row_parts(row)
    parts.append(library_versions(*TOKEN_COUNT_LIBRARIES))
    path = cache_dir() / "token-counts" / f"{content_digest(*parts)}.json"
    if path.exists():
        return [tuple(pair) for pair in json.loads(path.read_text())]
    counts = count()
    write_json(path, counts)
    return counts


# --------------------------------------------------------------------------- preprocessed samples


def decoded(image):
    """A PIL image, decoded the way `datasets.Image` decodes (undecoded rows carry a path or bytes)."""
    if not isinstance(image, dict | str):
        return image
    if isinstance(image, dict) and image.get("bytes"):
        opened = Image.open(io.BytesIO(image["bytes"]))
    else:
        opened = Image.open(image["path"] if isinstance(image, dict) else image)
    opened.load()
    return opened


class PreprocessedSampleCollator:
    """Wraps the padded collator SFTTrainer built: one row at a time through it on a miss, then the
    batch is assembled from the rows exactly as that collator pads it (right padding)."""

    def __init__(self, padded, root: Path, budget: CacheBudget | None = None):
        self.padded = padded
        processor = padded.processor
        self.pad_token_id = processor.tokenizer.pad_token_id
        self.directory = Path(root) / content_digest(
            processor_digest(processor, padded.chat_template),
            library_versions(*PREPROCESSED_SAMPLE_LIBRARIES),
        )
        self.budget = budget
        self.evicted_before = tuple(budget.evicted["preprocessed"]) if budget else (0, 0)
        self.hits = 0
        self.misses = 0

    def stats(self) -> dict:
        """Directory, hits and misses; with a cap, what it evicted of this cache (logged once)."""
        stats = {"directory": str(self.directory), "hits": self.hits, "misses": self.misses}
        if self.budget is not None:
            stats.update(self.budget.eviction_stats("preprocessed", self.evicted_before))
        return stats

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return assemble([self._sample(example) for example in examples], self.pad_token_id)

    def _sample(self, example: dict[str, Any]) -> dict[str, torch.Tensor]:
        path = self.directory / f"{self._key(example)}.safetensors"
        if (stored := read_entry(path, self.budget)) is not None:
            self.hits += 1
            return expand_pixels(stored)
        self.misses += 1
        row = {**example, "images": [decoded(image) for image in example.get("images") or []]}
        sample = {k: v for k, v in self.padded([row]).items() if isinstance(v, torch.Tensor)}
        write_entry(path, compact_pixels(sample), self.budget)
        return sample

    def _key(self, example: dict[str, Any]) -> str:
        videos = getattr(self.padded, "videos", None)  # data.collate.VideoCollator: frames by these settings
        settings = [videos.sampling.key()] if videos is not None and example.get("videos") else []
        if settings:  # and what the processor makes of the frames: Qwen2.5-VL's adds second_per_grid_ts
            processor = self.padded.processor  # where Qwen2-VL's, same image settings, does not
            settings += [type(processor).__name__, processor.video_processor.to_json_string()]
        return content_digest(*row_parts(example), *settings)


def assemble(samples: list[dict[str, torch.Tensor]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """One-row samples → a right-padded batch: per-token tensors padded, per-image tensors concatenated."""
    lengths = [s["input_ids"].shape[1] for s in samples]
    longest = max(lengths)
    batch: dict[str, torch.Tensor] = {}
    for key in dict.fromkeys(k for s in samples for k in s):
        present = [s[key] for s in samples if key in s]
        per_token = all(
            key in s and s[key].dim() >= 2 and s[key].shape[:2] == (1, n)
            for s, n in zip(samples, lengths, strict=True)
        )
        if per_token:
            pad = pad_token_id if key == "input_ids" else PAD_VALUES.get(key, 0)
            out = present[0].new_full((len(samples), longest, *present[0].shape[2:]), pad)
            for i, (tensor, n) in enumerate(zip(present, lengths, strict=True)):
                out[i, :n] = tensor[0]
            batch[key] = out
        elif key == "pixel_values" and any("image_sizes" in s for s in samples):
            batch[key] = _pad_tiles(present)
        elif key in PER_SAMPLE_IMAGE_KEYS and all(
            t.dim() >= PER_SAMPLE_IMAGE_KEYS[key] and t.shape[0] == 1 for t in present
        ):
            batch[key] = _pad_image_slots(samples, key)
        else:
            batch[key] = torch.cat(present)
    return batch


# Images kept per sample, [1, images, ..., H, W] (SmolVLM's tiles and their pixel masks): the processor pads
# a batch to its most images (all-zero images, which the model drops) and its largest H and W (zeros).
# Their least number of dimensions so: Gemma 3's pixel_values are [images, 3, H, W], concatenated.
PER_SAMPLE_IMAGE_KEYS = {"pixel_values": 5, "pixel_attention_mask": 4}


def _pad_tiles(present: list[torch.Tensor]) -> torch.Tensor:
    """Images as tiles, [images, tiles, 3, H, W] with `image_sizes` (LLaVA-OneVision's anyres): the
    processor pads every image to the batch's most tiles (all-zero tiles, which the model never reads) and
    keeps one row per image (none for a text-only sample)."""
    most = max(t.shape[1] for t in present)
    return torch.cat(
        [torch.cat([t, t.new_zeros(t.shape[0], most - t.shape[1], *t.shape[2:])], 1) for t in present]
    )


def _pad_image_slots(samples: list[dict[str, torch.Tensor]], key: str) -> torch.Tensor:
    present = [s[key] for s in samples if key in s]
    shape = [max(t.shape[d] for t in present) for d in range(1, present[0].dim())]
    out = present[0].new_zeros((len(samples), *shape))
    for i, sample in enumerate(samples):
        if key in sample:
            tensor = sample[key][0]
            out[(i, *(slice(0, n) for n in tensor.shape))] = tensor
    return out
