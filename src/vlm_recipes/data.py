"""Datasets for a stage: load, check every row before the model loads, and measure sample lengths.

Rows use the conversational format TRL and the field use:

    {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "…"}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "…"}]}],
     "images": ["images/0001.png"]}            # paths relative to the data file, or decoded images

The collator is TRL's DataCollatorForVisionLanguageModeling with `assistant_only_loss`: labels are
the assistant tokens only, marked by the chat template's generation markers.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import datasets
from PIL import Image

from vlm_recipes.demo import resolve_data_source
from vlm_recipes.schema import DataSettings

log = logging.getLogger(__name__)

LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
MAX_LISTED_PROBLEMS = 10


class DataError(ValueError):
    """Rows that cannot be trained on; the message lists where they are and why."""


@dataclass
class StageData:
    train: datasets.Dataset
    eval: datasets.Dataset | None
    train_source: str
    eval_source: str | None


def _load_any(source: str, split: str) -> tuple[datasets.Dataset, Path | None]:
    """A local file/folder or a hub dataset id. Returns the dataset and the folder image paths are relative to."""
    path = Path(source).expanduser()
    if path.suffix in LOCAL_FORMATS:
        if not path.is_file():
            raise DataError(f"data file not found: {path}")
        ds = datasets.load_dataset(LOCAL_FORMATS[path.suffix], data_files=str(path), split="train")
        return ds, path.parent
    if path.is_dir():
        return datasets.load_dataset(str(path), split=split), path
    # Anything else is a hub dataset id: a network fetch the recipe asked for.
    log.info("loading dataset %s (split %s) from the hub", source, split)
    return datasets.load_dataset(source, split=split), None


def _count_image_parts(messages: list) -> int:
    count = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            count += sum(1 for part in content if isinstance(part, dict) and part.get("type") == "image")
    return count


def row_problem(row: dict, image_root: Path | None) -> str | None:
    """Why a row cannot be trained on, or None."""
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        return "no `messages` list"
    roles = [m.get("role") if isinstance(m, dict) else None for m in messages]
    if any(r not in ("system", "user", "assistant") for r in roles):
        return f"message roles must be system/user/assistant, got {roles}"
    if "assistant" not in roles:
        return "no assistant turn: nothing to learn from"
    images = row.get("images") or []
    placeholders = _count_image_parts(messages)
    if placeholders != len(images):
        return f"{placeholders} image parts in messages but {len(images)} images"
    for image in images:
        if isinstance(image, str):
            path = Path(image) if image_root is None else image_root / image
            if not path.is_file():
                return f"image not found: {path}"
    return None


def _check_rows(ds: datasets.Dataset, source: str, image_root: Path | None) -> None:
    problems = []
    for index, row in enumerate(ds):
        problem = row_problem(row, image_root)
        if problem:
            line = f"line {index + 1}" if Path(source).suffix == ".jsonl" else f"row {index}"
            problems.append(
                f"{source}:{line}: {problem}" if "line" in line else f"{source} {line}: {problem}"
            )
    if problems:
        shown = "\n  ".join(problems[:MAX_LISTED_PROBLEMS])
        more = (
            f"\n  … and {len(problems) - MAX_LISTED_PROBLEMS} more"
            if len(problems) > MAX_LISTED_PROBLEMS
            else ""
        )
        raise DataError(
            f"{len(problems)} bad row(s) in {source}:\n  {shown}{more}\nFix or remove these rows."
        )


def load_split(source: str, split: str, max_samples: int | None) -> datasets.Dataset:
    """Load one split, check its rows and turn image paths into decodable Image features."""
    resolved = resolve_data_source(source)
    ds, image_root = _load_any(resolved, split)
    if max_samples is not None:
        ds = ds.select(range(min(max_samples, len(ds))))
    if len(ds) == 0:
        raise DataError(f"{source}: the dataset is empty")
    _check_rows(ds, source, image_root)
    if "images" in ds.column_names and image_root is not None and _holds_paths(ds):
        root = str(image_root)
        ds = ds.map(lambda row: {"images": [str(Path(root) / p) for p in row["images"]]}, desc="image paths")
        ds = ds.cast_column("images", datasets.List(datasets.Image()))
    keep = [c for c in ("messages", "images") if c in ds.column_names]
    extra = [c for c in ds.column_names if c not in keep and c not in ("id", "task")]
    return ds.remove_columns(extra) if extra else ds


def _holds_paths(ds: datasets.Dataset) -> bool:
    feature = ds.features["images"]
    inner = getattr(feature, "feature", None)
    return isinstance(inner, datasets.Value) and inner.dtype in ("string", "large_string")


def load_stage_data(settings: DataSettings) -> StageData:
    train = load_split(settings.train, settings.train_split, settings.max_train_samples)
    eval_ds = None
    if settings.eval:
        eval_ds = load_split(settings.eval, settings.eval_split, settings.max_eval_samples)
    return StageData(train=train, eval=eval_ds, train_source=settings.train, eval_source=settings.eval)


def dataset_signature(source: str | None, ds: datasets.Dataset) -> str:
    """Identifies an eval set, so runs measured on different data are never compared as equals."""
    digest = hashlib.sha256()
    for row in ds.select_columns([c for c in ("id", "messages") if c in ds.column_names]):
        digest.update(json.dumps(row, sort_keys=True, default=str).encode())
    return f"{source}|{len(ds)} rows|{digest.hexdigest()[:12]}"


def sample_lengths(ds: datasets.Dataset, processor) -> list[int]:
    """Tokens per sample, image tokens included, computed from image sizes (no pixel processing)."""
    texts = [processor.apply_chat_template(row, tokenize=False) for row in ds["messages"]]
    text_lengths = [len(ids) for ids in processor.tokenizer(texts, add_special_tokens=False)["input_ids"]]
    lengths = []
    images_column = ds["images"] if "images" in ds.column_names else [[]] * len(ds)
    for text_length, images in zip(text_lengths, images_column, strict=True):
        sizes = [_image_size(image) for image in images or []]
        image_tokens = 0
        if sizes:
            image_tokens = sum(processor._get_num_multimodal_tokens(image_sizes=sizes)["num_image_tokens"])
        # Each image is one <|image_pad|> in the text, expanded to its token count by the processor.
        lengths.append(text_length - len(sizes) + image_tokens)
    return lengths


def _image_size(image) -> tuple[int, int]:
    if isinstance(image, dict) and image.get("path"):
        image = image["path"]
    if isinstance(image, str):
        with Image.open(image) as opened:  # reads the header only
            return opened.height, opened.width
    return image.height, image.width


def check_lengths(ds: datasets.Dataset, processor, max_length: int | None, source: str) -> list[int]:
    """Refuse samples longer than max_length: cutting through image tokens breaks the model
    ("image features and image tokens do not match"), and cutting the answer trains on nothing."""
    lengths = sample_lengths(
        ds.cast_column("images", datasets.List(datasets.Image(decode=False)))
        if "images" in ds.column_names
        else ds,
        processor,
    )
    if max_length is not None:
        too_long = [(i, n) for i, n in enumerate(lengths) if n > max_length]
        if too_long:
            listed = ", ".join(f"row {i} ({n} tokens)" for i, n in too_long[:MAX_LISTED_PROBLEMS])
            raise DataError(
                f"{len(too_long)} sample(s) in {source} are longer than data.max_length={max_length}: {listed}. "
                "Raise data.max_length, or lower data.max_pixels so images take fewer tokens."
            )
    return lengths
