"""Preprocessed samples on disk: each row's tokens, labels and processed pixels, computed once.

TRL's vision collator decodes the images, resizes and normalizes them, renders the chat template and
tokenizes, for every batch of every epoch of every stage. With `training.preprocessed_cache` each row is
processed once, by that same collator, and read back afterwards: next epoch, next run, next seed, and the
next stage when it uses the same processor settings (r3's two stages do). Images stay undecoded until a
row is missing from the cache.

Entries live under `<root>/<processor digest>/`, the digest covering the image processor's settings,
the training chat template and the tokenizer; each entry's key covers the row's messages and its images'
content (a file's path, size and modification time, or the bytes). Any change gives another key, so a
stale entry cannot be read. Pixels are stored as the model receives them (float32): about 4.7 MB per
448x448 image; the cache directory can be deleted at any time.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from safetensors.torch import load_file

from vlm_recipes.checkpoint import write_safetensors
from vlm_recipes.data import image_identity

PAD_VALUES = {"labels": -100, "attention_mask": 0}  # input_ids: the tokenizer's pad id; others: 0


def processor_digest(processor, chat_template: str | None) -> str:
    digest = hashlib.blake2b(digest_size=16)
    digest.update(processor.image_processor.to_json_string().encode())
    digest.update(str(chat_template or processor.chat_template).encode())
    digest.update(processor.tokenizer.backend_tokenizer.to_str().encode())
    return digest.hexdigest()


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

    def __init__(self, padded, root: Path):
        self.padded = padded
        processor = padded.processor
        self.pad_token_id = processor.tokenizer.pad_token_id
        self.directory = Path(root) / processor_digest(processor, padded.chat_template)
        self.hits = 0
        self.misses = 0

    def stats(self) -> dict:
        return {"directory": str(self.directory), "hits": self.hits, "misses": self.misses}

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return assemble([self._sample(example) for example in examples], self.pad_token_id)

    def _sample(self, example: dict[str, Any]) -> dict[str, torch.Tensor]:
        path = self.directory / f"{self._key(example)}.safetensors"
        if path.exists():
            self.hits += 1
            return load_file(str(path))
        self.misses += 1
        row = {**example, "images": [decoded(image) for image in example.get("images") or []]}
        sample = {k: v for k, v in self.padded([row]).items() if isinstance(v, torch.Tensor)}
        write_safetensors(path, sample)
        return sample

    @staticmethod
    def _key(example: dict[str, Any]) -> str:
        digest = hashlib.blake2b(digest_size=16)
        digest.update(json.dumps(example["messages"], sort_keys=True, default=str).encode())
        for image in example.get("images") or []:
            digest.update(image_identity(image))
        return digest.hexdigest()


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
        else:
            batch[key] = torch.cat(present)
    return batch
