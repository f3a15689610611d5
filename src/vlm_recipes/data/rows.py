"""Datasets for a stage: load them and check every row before the model loads.

Files in LLaMA-Factory's, ms-swift's and LLaVA's shapes are read as they are (data/formats.py) and turned
into the conversational format TRL and the field use:

    {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "…"}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "…"}]}],
     "images": ["images/0001.png"]}            # paths relative to the data file, or decoded images

A row may hold several images (one `{"type": "image"}` part each, in order), none (text-only rows), and,
for the Qwen line, videos: `{"type": "video"}` parts and a `videos` list of files or folders of frames
(data/video.py). Every split has an `images` column, empty lists included, so TRL treats text-only and
video-only datasets as the vision datasets they are (its text collator has no processor for them).

The collator is TRL's DataCollatorForVisionLanguageModeling with `assistant_only_loss` (labels are the
assistant tokens only, marked by the chat template's generation markers), which data/collate.py extends
to videos.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import datasets
import pyarrow.compute as pc
from PIL import Image

from vlm_recipes.data.formats import EVAL_COLUMNS
from vlm_recipes.data.parallel import problems_per_row
from vlm_recipes.data.sources import BadRow, read_source
from vlm_recipes.data.video import VideoSampling, plan_frames, read_header
from vlm_recipes.errors import DataError, VideoError
from vlm_recipes.families import FAMILIES
from vlm_recipes.families.base import Family
from vlm_recipes.recipes.schema import Stage

log = logging.getLogger(__name__)

MAX_LISTED_PROBLEMS = 10


def fail_or_skip(bad: list[BadRow], policy: str, source: str, what: str = "bad row(s)") -> dict[str, int]:
    """`fail`: raise listing the first bad rows. `skip`: return the count per reason. `report` (the data
    check command): log every bad row, then return the count per reason."""
    if not bad:
        return {}
    if policy == "fail":
        shown = "\n  ".join(str(b) for b in bad[:MAX_LISTED_PROBLEMS])
        more = f"\n  … and {len(bad) - MAX_LISTED_PROBLEMS} more" if len(bad) > MAX_LISTED_PROBLEMS else ""
        raise DataError(
            f"{len(bad)} {what} in {source}:\n  {shown}{more}\n"
            "Fix or remove these rows, or set data.on_bad_sample: skip to train without them."
        )
    counts = dict(Counter(b.reason for b in bad))
    if policy == "report":
        log.warning("%s: %d %s:\n  %s", source, len(bad), what, "\n  ".join(str(b) for b in bad))
    else:
        log.warning("%s: skipped %d %s: %s", source, len(bad), what, counts)
    return counts


def count_image_parts(messages: list, kind: str = "image") -> int:
    """The `{"type": kind}` content parts of a message list."""
    count = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            count += sum(1 for part in content if isinstance(part, dict) and part.get("type") == kind)
    return count


@dataclass(frozen=True)
class VideoRules:
    """How a stage reads video rows: `factor` is the model's frame-side multiple (patch x merge); None
    means videos are refused, for the reason given."""

    sampling: VideoSampling
    factor: int | None
    refusal: str = ""


def video_rules(stage: Stage, family: Family, processor, method_takes_video: bool) -> VideoRules:
    """How the stage's rows may hold videos: a family that takes them, under a method that does
    (TrainingMethod.takes_video); the reason if not."""
    sampling = VideoSampling.from_settings(stage.data)
    factor = family.video_frame_factor(processor)
    if factor is None:
        takes = [f.name for f in FAMILIES if f.takes_video]
        why = f"{family.name} takes no video here (the families that do: {', '.join(takes)})"
        return VideoRules(sampling, None, why)
    if not method_takes_video:
        return VideoRules(sampling, None, f"method {stage.method} takes images only (TRL's collator)")
    return VideoRules(sampling, factor)


def video_row_problem(row: dict, video_root: Path | None, rules: VideoRules | None) -> tuple[str, str] | None:
    """(reason, detail) for a row whose videos cannot be used, or None. Every message list of the row
    counts (`messages`, or a preference row's `prompt`, `chosen` and `rejected`)."""
    videos = row.get("videos") or []
    parts = sum(
        count_image_parts(row[key], "video")
        for key in ("messages", "prompt", "chosen", "rejected")
        if isinstance(row.get(key), list)
    )
    if not videos and not parts:
        return None
    if rules is None or rules.factor is None:
        return "video not supported", rules.refusal if rules else "this stage takes no video"
    if parts != len(videos):
        return "video count mismatch", f"{parts} video parts in messages but {len(videos)} videos"
    for video in videos:
        if not isinstance(video, str):
            return "bad video", f"a video is a file or folder path, got {type(video).__name__}"
        path = Path(video) if video_root is None else video_root / video
        if not path.exists():
            return "video not found", str(path)
        try:  # the header only: the frames are decoded when the sample is collated
            plan_frames(read_header(path, rules.sampling), rules.sampling, rules.factor)
        except VideoError as exc:
            return "unreadable video", str(exc) if str(path) in str(exc) else f"{path}: {exc}"
    return None


def is_remote(image: str) -> bool:
    return image.startswith(("http://", "https://"))


def row_problem(
    row: dict, image_root: Path | None, allow_remote_images: bool = False
) -> tuple[str, str] | None:
    """(reason, detail) for a row that cannot be trained on, or None."""
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        return "no messages", "the row needs a `messages` list"
    roles = [m.get("role") if isinstance(m, dict) else None for m in messages]
    if any(r not in ("system", "user", "assistant") for r in roles):
        return "bad roles", f"roles must be system/user/assistant, got {roles}"
    if "assistant" not in roles:
        return "no assistant turn", "nothing to learn from"
    return images_problem(row, "messages", image_root, allow_remote_images)


def images_problem(
    row: dict, key: str, image_root: Path | None, allow_remote_images: bool
) -> tuple[str, str] | None:
    """(reason, detail) for a row whose `images` do not match the image parts of its `key` messages one for
    one, or name an image that cannot be used; None: they are fine. Every row format's check ends with it."""
    images = row.get("images") or []
    placeholders = count_image_parts(row[key])
    if placeholders != len(images):
        return "image count mismatch", f"{placeholders} image parts in {key} but {len(images)} images"
    for image in images:
        if problem := image_problem(image, image_root, allow_remote_images):
            return problem
    return None


def image_problem(image, image_root: Path | None, allow_remote_images: bool) -> tuple[str, str] | None:
    """(reason, detail) for an image a row names that cannot be used, or None."""
    if not isinstance(image, str):
        return None  # already decoded (hub datasets)
    if is_remote(image):
        if not allow_remote_images:
            return "remote image", f"{image}: set data.allow_remote_images: true to download images"
        return None
    path = Path(image) if image_root is None else image_root / image
    if not path.is_file():
        return "image not found", str(path)
    try:
        with Image.open(path) as opened:
            opened.verify()  # reads the file through: catches corrupt and truncated images
    except Exception as exc:  # PIL raises many types for broken files
        return "corrupt image", f"{path}: {exc}"
    return None


# A row format: its check, (reason, detail) or None for a row, and the columns kept.
# (the row check, the columns kept); ALL_COLUMNS keeps every column (GRPO's rewards read any of them)
RowFormat = tuple[Callable[[dict, Path | None, bool], tuple[str, str] | None], tuple[str, ...]]
ALL_COLUMNS: tuple[str, ...] = ("*",)
MESSAGES: RowFormat = (row_problem, ("messages", "images"))


def row_problems(
    ds: datasets.Dataset, check, image_root, allow_remote_images: bool, video
) -> dict[int, tuple[str, str]]:
    """The rows that cannot be trained on, by index, with (reason, detail): their format's check (each image
    opened and read through), then their videos'. Over many rows, in parallel (parallel.py)."""

    def problem_of(row: dict) -> tuple[str, str] | None:
        return check(row, image_root, allow_remote_images) or video_row_problem(row, image_root, video)

    return problems_per_row(ds, problem_of, "checking rows")


def load_split(*args, **kwargs) -> tuple[datasets.Dataset, dict[str, int]]:
    """read_split's rows and skipped counts, without the source's format."""
    rows, skipped, _ = read_split(*args, **kwargs)
    return rows, skipped


def read_split(
    source: str,
    split: str,
    max_samples: int | None,
    on_bad_sample: str = "fail",
    allow_remote_images: bool = False,
    row_format: RowFormat | None = None,
    video: VideoRules | None = None,
    path: str | None = None,
    extra_columns: tuple[str, ...] = (),
) -> tuple[datasets.Dataset, dict[str, int], str]:
    """Load one split (from `path`, where the recipe's `source` was found when the run was planned: a
    demo id's file; else `source` itself), check every row (`messages` rows, or another format such as preference.PREFERENCE
    for method dpo; videos by `video`), and turn image paths into decodable Image features and video paths
    into paths from the working directory. The row format's columns are kept, `id`, `task` and
    `extra_columns` beside them (an eval split's formats.EVAL_COLUMNS).

    Returns the dataset, the count of skipped rows per reason (`on_bad_sample: skip`) and the format the source
    was in (a mixture reports each one's)."""
    check, columns = row_format or MESSAGES
    loaded = read_source(path or source, split)
    ds, image_root, where, bad = loaded.ds, loaded.root, loaded.where, loaded.bad
    if max_samples is not None:
        ds = ds.select(range(min(max_samples, len(ds))))
    # by index, not by place: a JSON array's rows may share a line (the rows refused as the file was read
    # are not in `ds`)
    problems = row_problems(ds, check, image_root, allow_remote_images, video)
    bad += [BadRow(where[index], *problem) for index, problem in sorted(problems.items())]
    skipped = fail_or_skip(bad, on_bad_sample, source)
    if skipped and problems:
        ds = ds.select([i for i in range(len(ds)) if i not in problems])
    if len(ds) == 0:
        after = f" after skipping {sum(skipped.values())} bad rows" if skipped else ""
        raise DataError(f"{source}: the dataset is empty{after}")
    log.info("data: %s, %s", source, _summary(ds, loaded.format))
    if "images" in ds.column_names and image_root is not None and _holds_paths(ds):
        root = str(image_root)
        ds = ds.map(
            lambda row: {"images": [p if is_remote(p) else str(Path(root) / p) for p in row["images"] or []]},
            desc="image paths",
        )
        ds = ds.cast_column("images", datasets.List(datasets.Image()))
    elif _holds_nothing(ds):  # no row has an image: the column TRL's vision collator reads, typed
        ds = ds.cast_column("images", datasets.List(datasets.Image()))
    if "videos" in ds.column_names and image_root is not None:
        root = str(image_root)
        ds = ds.map(
            lambda row: {"videos": [str(Path(root) / p) for p in row["videos"] or []]}, desc="video paths"
        )
    keep = (
        ds.column_names
        if columns == ALL_COLUMNS
        else [c for c in (*columns, "videos") if c in ds.column_names]
    )
    extra = [c for c in ds.column_names if c not in keep and c not in ("id", "task", *extra_columns)]
    return (ds.remove_columns(extra) if extra else ds), skipped, loaded.format


def _summary(ds: datasets.Dataset, fmt: str) -> str:
    """`sharegpt conversations (LLaMA-Factory, LLaVA) format, 6 rows, 8 images, 2 videos`."""
    counts = [f"{fmt} format", f"{len(ds)} rows"]
    table = ds.with_format("arrow")  # counted in Arrow: no row read into Python (a million rows)
    for column in ("images", "videos"):
        if column in ds.column_names:
            counts.append(f"{pc.sum(pc.list_value_length(table[column])).as_py() or 0} {column}")
    return ", ".join(counts)


def _holds_nothing(ds: datasets.Dataset) -> bool:
    feature = ds.features.get("images")
    inner = getattr(feature, "feature", None)
    return isinstance(inner, datasets.Value) and inner.dtype == "null"


def _holds_paths(ds: datasets.Dataset) -> bool:
    feature = ds.features["images"]
    inner = getattr(feature, "feature", None)
    return isinstance(inner, datasets.Value) and inner.dtype in ("string", "large_string")


def dataset_signature(source: str | None, ds: datasets.Dataset) -> str:
    """Identifies an eval set, so runs measured on different data are never compared as equals: its rows'
    turns and what the metrics read beside them (references, options, boxes: formats.EVAL_COLUMNS), so two
    files with the same questions and other `answers` are two eval sets."""
    digest = hashlib.sha256()
    read = ("id", "messages", "prompt", "chosen", "rejected", *EVAL_COLUMNS)
    for row in ds.select_columns([c for c in read if c in ds.column_names]):
        digest.update(json.dumps(row, sort_keys=True, default=str).encode())
    return f"{source}|{len(ds)} rows|{digest.hexdigest()[:12]}"


def undecoded(ds: datasets.Dataset) -> datasets.Dataset:
    """The same rows with image columns left as file references (no pixel decoding)."""
    if "images" not in ds.column_names:
        return ds
    return ds.cast_column("images", datasets.List(datasets.Image(decode=False)))
