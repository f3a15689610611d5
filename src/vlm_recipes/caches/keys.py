"""The one digest every cache key is made of, and what goes into it: library versions, the processor
(settings, chat template, tokenizer), a row's messages and its images' and videos' identity, a module's
weights. Also where the speed-up caches live and their size cap."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

import torch
import transformers

from vlm_recipes.caches.storage import CacheBudget
from vlm_recipes.data.video import video_identity
from vlm_recipes.files import cache_dir
from vlm_recipes.versions import installed_version

# The libraries whose output each cache stores: a new version of any of them gives new keys, so an entry
# made by the old one (a fixed resize, another tokenization) is never read.
# Preprocessed samples: TRL's collator, the processor (transformers, tokenizers), image processing (torch,
# torchvision), image decoding (Pillow), video decoding (av).
PREPROCESSED_SAMPLE_LIBRARIES = ("trl", "transformers", "tokenizers", "torch", "torchvision", "pillow", "av")


# Token counts: the processor's rules and tokenizer, and the image and video headers read (Pillow, av).
TOKEN_COUNT_LIBRARIES = ("transformers", "tokenizers", "pillow", "av")


# Vision features: the tower's code (transformers) and its kernels (torch).
VISION_FEATURE_LIBRARIES = ("torch", "transformers")


def versions_key(*names: str) -> str:
    """`name version` of each installed distribution (`name absent` where it is not installed)."""
    return ", ".join(f"{name} {installed_version(name) or 'absent'}" for name in names)


def speedup_cache_root() -> Path:
    """`$VLM_RECIPES_SPEEDUP_CACHE`, by default the vlm-recipes cache (~/.cache/vlm-recipes)."""
    env = os.environ.get("VLM_RECIPES_SPEEDUP_CACHE")
    return Path(env).expanduser() if env else cache_dir()


def speedup_cache(kind: str) -> Path:
    """Where a speed-up keeps its entries: `kind`/ under `speedup_cache_root()`."""
    return speedup_cache_root() / kind


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
    return digest_of(parts)


def digest_of(parts: Iterable[str | bytes | torch.Tensor]) -> str:
    """content_digest over parts as they come (a generator over a million rows: none of them kept)."""
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


_BUDGETS: dict[Path, CacheBudget] = {}
