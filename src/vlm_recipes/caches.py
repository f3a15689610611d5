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
row is missing from the cache. Pixels are stored losslessly as a codebook (`compact_pixels`): the image
processors resize 8-bit images before they rescale and normalize, so each colour channel holds at most 256
distinct floats, and a pixel is one byte (its index) instead of four: a 448x448 image takes 1.2 MB instead
of 4.8 MB, and reads back bit for bit.

A key also covers the versions of the libraries that made the entry (`library_versions`): a new
transformers, tokenizers, TRL, torch or Pillow may process the same row differently.

Size: the speed-up caches (preprocessed samples, vision features) are capped together by
`training.cache_max_gb` (`CacheBudget`): past the cap, the least recently used entries are deleted.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
import transformers
from PIL import Image
from safetensors.torch import load_file

from vlm_recipes.data.video import video_identity
from vlm_recipes.files import cache_dir, write_json, write_safetensors

log = logging.getLogger(__name__)

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


SPEEDUP_CACHE_KINDS = ("preprocessed", "vision-features")  # what training.cache_max_gb caps


def speedup_cache_root() -> Path:
    """`$VLM_RECIPES_SPEEDUP_CACHE`, by default the vlm-recipes cache (~/.cache/vlm-recipes)."""
    env = os.environ.get("VLM_RECIPES_SPEEDUP_CACHE")
    return Path(env).expanduser() if env else cache_dir()


def speedup_cache(kind: str) -> Path:
    """Where a speed-up keeps its entries: `kind`/ under `speedup_cache_root()`."""
    return speedup_cache_root() / kind


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


# --------------------------------------------------------------------------- the size cap

EVICT_DOWN_TO = 0.9  # of the cap: evictions come in batches, not at every write once the cap is reached


class CacheBudget:
    """The size cap of the speed-up caches under `root` (`training.cache_max_gb`): when a write takes their
    entries past `max_bytes`, the least recently used ones are deleted, down to 90% of the cap.

    Kept cheap: the entries are listed once, at the first write, and a running total is kept from then on.
    A read marks its entry used by setting its mtime to now (atime is unreliable under relatime and
    noatime). Entries this process wrote are deleted last (only when they alone pass the cap). Writes by
    other processes (DDP ranks, another run) after the listing are counted when this process reads them,
    so several writers together can pass the cap by what they wrote meanwhile."""

    def __init__(self, root: Path, max_bytes: int, kinds: tuple[str, ...] = SPEEDUP_CACHE_KINDS):
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.kinds = kinds
        # path -> (last used, bytes); None until the first write lists the directories
        self.entries: dict[Path, tuple[float, int]] | None = None
        self.total = 0
        self.own: set[Path] = set()
        self.evicted = {kind: [0, 0] for kind in kinds}  # entries, bytes
        self.logged = dict.fromkeys(kinds, 0)
        self.warned_own = False

    def used(self, path: Path) -> None:
        """`path` was read: it is now the most recently used entry."""
        now = time.time()
        try:
            os.utime(path, (now, now))
        except OSError:
            return  # evicted meanwhile by another process, or a read-only cache
        if self.entries is None:
            return  # the listing will see the new mtime
        if path not in self.entries:  # written by another process since the listing
            size = path.stat().st_size
            self.total += size
        else:
            size = self.entries[path][1]
        self.entries[path] = (now, size)

    def written(self, path: Path) -> None:
        """`path` was just written: count it, and evict if the cap is passed."""
        if self.entries is None:
            self._list()
        previous = self.entries.get(path, (0.0, 0))[1]
        size = path.stat().st_size
        self.entries[path] = (time.time(), size)
        self.total += size - previous
        self.own.add(path)
        if self.total > self.max_bytes:
            self._evict()

    def _list(self) -> None:
        self.entries = {}
        for kind in self.kinds:
            for path in (self.root / kind).rglob("*.safetensors"):
                with contextlib.suppress(FileNotFoundError):  # evicted meanwhile by another process
                    stat = path.stat()
                    self.entries[path] = (stat.st_mtime, stat.st_size)
        self.total = sum(size for _, size in self.entries.values())

    def _evict(self) -> None:
        assert self.entries is not None
        target = self.max_bytes * EVICT_DOWN_TO
        # other runs' entries first, each group least recently used first
        for path in sorted(self.entries, key=lambda p: (p in self.own, self.entries[p][0])):
            if self.total <= target:
                break
            if path in self.own and not self.warned_own:
                self.warned_own = True
                log.warning(
                    "the speed-up caches hold more than training.cache_max_gb (%.3g GB) for this run alone: "
                    "entries it wrote are evicted and will be made again; raise training.cache_max_gb",
                    self.max_bytes / 1e9,
                )
            size = self.entries.pop(path)[1]
            self.total -= size
            self.own.discard(path)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            counts = self.evicted.setdefault(path.relative_to(self.root).parts[0], [0, 0])
            counts[0] += 1
            counts[1] += size

    def eviction_stats(self, kind: str, since: tuple[int, int]) -> dict:
        """What the cap evicted of `kind` since `since` (an earlier `evicted[kind]`), logged at info level
        the first time it is asked for (once per stage)."""
        count, size = self.evicted[kind][0] - since[0], self.evicted[kind][1] - since[1]
        if self.evicted[kind][0] > self.logged[kind]:
            self.logged[kind] = self.evicted[kind][0]
            log.info(
                "%s cache: %d least recently used entries evicted (%.2f GB) to stay under "
                "training.cache_max_gb (%.3g GB)",
                kind,
                count,
                size / 1e9,
                self.max_bytes / 1e9,
            )
        return {"evicted": count, "evicted_gb": round(size / 1e9, 4)}


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


# Pixels as codebooks. A float tensor of at least this many elements is stored as the indices of its values
# in a table of its distinct values, per colour channel where the layout shows the channels: lossless (the
# table holds the floats' exact bits), one byte per pixel instead of four where a channel has at most 256
# values, which is the case after any processor that resizes 8-bit images before normalizing them.
CODEBOOK_MIN_ELEMENTS = 4096
CODEBOOK_PARTS = (".codes", ".codebook", ".shape")  # `pixel_values.codes`, ...: no processor key ends so
_BITS = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}


def compact_pixels(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors to store: each float tensor that a codebook makes smaller as `<key>.codes` (the indices,
    [outer, channels, inner]), `<key>.codebook` (the values, [channels, n]) and `<key>.shape`."""
    stored = {}
    for key, tensor in tensors.items():
        coded = (
            _codebook(tensor) if tensor.dtype in _BITS and tensor.numel() >= CODEBOOK_MIN_ELEMENTS else None
        )
        if coded is None:
            stored[key] = tensor
        else:
            stored[f"{key}.codes"], stored[f"{key}.codebook"] = coded
            stored[f"{key}.shape"] = torch.tensor(tensor.shape, dtype=torch.int64)
    return stored


def expand_pixels(stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors `compact_pixels` stored, bit for bit (dtype and shape included)."""
    tensors = {}
    for key, tensor in stored.items():
        if key.endswith(".codes"):
            name = key.removesuffix(".codes")
            book = stored[f"{name}.codebook"]
            channels, size = book.shape
            # each channel's values start at channel * size in the flattened codebook
            offsets = torch.arange(0, channels * size, size, dtype=torch.int32)[:, None]
            index = tensor.to(torch.int32).add_(offsets).reshape(-1)
            shape = stored[f"{name}.shape"].tolist()
            tensors[name] = torch.index_select(book.reshape(-1), 0, index).reshape(shape)
        elif not key.endswith(CODEBOOK_PARTS):
            tensors[key] = tensor
    return tensors


def _layouts(shape: torch.Size) -> list[tuple[int, int, int]]:
    """(outer, channels, inner) views of a pixel tensor to try, the colour channels apart first: images
    [..., 3, H, W] (SmolVLM, Gemma 3, LLaVA-OneVision), patch rows [..., 3 * T * P * P] (the Qwen line),
    then the whole tensor as one channel."""
    numel = shape.numel()
    layouts = []
    if len(shape) >= 3 and shape[-3] == 3:
        layouts.append((numel // (3 * shape[-2] * shape[-1]), 3, shape[-2] * shape[-1]))
    if shape[-1] % 3 == 0:
        layouts.append((numel // shape[-1], 3, shape[-1] // 3))
    return [*layouts, (1, 1, numel)]


def _codebook(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(codes, codebook) in the first layout whose channels have at most 256 values each (uint8 codes),
    else in the first with at most 32768 (int16 codes, where that is smaller); None: stored as is."""
    # distinct bit patterns, not floats: -0.0 stays apart from 0.0, and every NaN keeps its bits
    bits = tensor.detach().cpu().contiguous().view(_BITS[tensor.dtype])
    wide = None
    for outer, channels, inner in _layouts(tensor.shape):
        grouped = bits.reshape(outer, channels, inner)
        uniques = []
        for channel in range(channels):
            values, inverse = torch.unique(grouped[:, channel], return_inverse=True)
            if len(values) > 32768:
                break
            uniques.append((values, inverse))
        else:
            most = max(len(values) for values, _ in uniques)
            smaller = channels * most * tensor.element_size() < tensor.nbytes * 3 / 4  # the codebook's cost
            if most <= 256 and smaller:
                return _pack(uniques, torch.uint8, tensor.dtype)
            if wide is None and tensor.element_size() > 2 and smaller:
                wide = uniques
    return _pack(wide, torch.int16, tensor.dtype) if wide else None


def _pack(uniques: list, code_dtype: torch.dtype, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    codes = torch.stack([inverse.to(code_dtype) for _, inverse in uniques], 1)  # [outer, channels, inner]
    book = torch.zeros(len(uniques), max(len(v) for v, _ in uniques), dtype=uniques[0][0].dtype)
    for channel, (values, _) in enumerate(uniques):
        book[channel, : len(values)] = values
    return codes, book.view(dtype)


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
        if (stored := self._read(path)) is not None:
            self.hits += 1
            return expand_pixels(stored)
        self.misses += 1
        row = {**example, "images": [decoded(image) for image in example.get("images") or []]}
        sample = {k: v for k, v in self.padded([row]).items() if isinstance(v, torch.Tensor)}
        write_safetensors(path, compact_pixels(sample))
        if self.budget is not None:
            self.budget.written(path)
        return sample

    def _read(self, path: Path) -> dict[str, torch.Tensor] | None:
        try:
            stored = load_file(str(path))
        except FileNotFoundError:  # not made yet, or evicted
            return None
        if self.budget is not None:
            self.budget.used(path)
        return stored

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
