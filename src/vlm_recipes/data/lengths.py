"""Sample lengths in tokens, image and video tokens included, counted before the model loads: the length
check.

Image tokens are counted from each image's size (its file header), video tokens from each video's frame
plan (its container header: data/video.py), by the family's own rule, never by processing pixels. A stage
has the counts remembered on disk: it passes `remember` (caches/token_counts.py: remembered_token_counts),
so that data/ depends on nothing in caches/ (which builds its keys from data/).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import datasets
import pyarrow.compute as pc
from PIL import Image

from vlm_recipes.data.cache_disk import cache_writes
from vlm_recipes.data.images import upright_size
from vlm_recipes.data.parallel import log_processes, parallel_processes
from vlm_recipes.data.rows import BadRow, fail_or_skip, undecoded
from vlm_recipes.data.video import VideoSampling, plan_frames, read_header
from vlm_recipes.errors import DataError
from vlm_recipes.families.base import Family

log = logging.getLogger(__name__)

# (rows, processor, count, settings) -> count(), or what an earlier count of the same rows gave
Remember = Callable[..., list[tuple[int, int]]]


def sample_token_counts(
    ds: datasets.Dataset,
    processor,
    family: Family,
    video: VideoSampling | None = None,
    remember: Remember | None = None,
) -> list[tuple[int, int]]:
    """(text tokens, image and video tokens) per sample, computed from image sizes and video headers
    without processing pixels. Pass images undecoded (`Image(decode=False)`) and only headers are read.

    With `remember` (a stage's: caches.remembered_token_counts), remembered on disk for the next stage on
    the same data, the next run, another seed: keyed by the rows' messages, their images' and videos' files
    (path, size, modification time) or bytes, the processor (image settings, chat template, tokenizer) and
    the video sampling, so any change counts afresh."""
    columns = [c for c in ("messages", "images", "videos") if c in ds.column_names]
    if video is None or "videos" not in columns or not any(ds["videos"]):
        video = None  # no video to count (a family without video never gets here with one: rows.py)
    if remember is None:
        return _count_tokens(ds, processor, family, video)
    return remember(
        ds.select_columns(columns),
        processor,
        lambda: _count_tokens(ds, processor, family, video),
        _video_settings(processor, video) if video is not None else "",
    )


def _video_settings(processor, video: VideoSampling) -> str:
    """What a video's count depends on besides the rows and the image processor: the frame sampling, and
    the processor's video side (its patch sizes; Qwen3-VL's time text)."""
    return f"{video.key()} {type(processor).__name__} {processor.video_processor.to_json_string()}"


BATCH_ROWS = 500  # rows counted at a time


def _count_tokens(
    ds: datasets.Dataset, processor, family: Family, video: VideoSampling | None
) -> list[tuple[int, int]]:
    """Each row's (text tokens, image and video tokens). Over many rows, contiguous shards are counted in
    parallel by datasets' map (num_proc): the same counts, in the same order, as one process gives."""
    processes = parallel_processes(len(ds))
    log_processes("counting tokens", len(ds), processes)
    counts, refused = [], {}
    if processes == 1:  # batch by batch: the rows are never all in memory as Python objects
        for batch in ds.iter(BATCH_ROWS):
            counted = count_batch(batch, processor, family, video)
            refused.update((len(counts) + i, why) for i, why in enumerate(counted["refused"]) if why)
            counts += zip(counted["text_tokens"], counted["vision_tokens"], strict=True)
    else:
        with cache_writes():  # the counts' files, beside the rows' table: its disk may fill
            done = ds.map(
                count_batch,
                fn_kwargs={"processor": processor, "family": family, "video": video},
                batched=True,
                batch_size=BATCH_ROWS,
                num_proc=processes,
                remove_columns=ds.column_names,
                desc="counting tokens",
            ).with_format("arrow")  # read a column at a time: one list of pairs is what is kept
        counts = list(zip(done["text_tokens"].to_pylist(), done["vision_tokens"].to_pylist(), strict=True))
        found = pc.indices_nonzero(pc.binary_length(done["refused"]))
        refused = dict(zip(found.to_pylist(), done["refused"].take(found).to_pylist(), strict=True))
    if refused:
        raise RefusedImages(refused)
    return counts


def count_batch(batch: dict, processor, family: Family, video: VideoSampling | None) -> dict[str, list]:
    """Token counts of a batch of rows (columns as lists), and what the processor said of a row's image it
    refuses ("" for the others)."""
    rows = len(batch["messages"])
    texts = [processor.apply_chat_template(messages, tokenize=False) for messages in batch["messages"]]
    sizes = [[_image_size(image) for image in images or []] for images in batch.get("images") or [[]] * rows]
    refused = refused_image_sizes(processor, {size for row in sizes for size in row})
    why = ["; ".join(refused[s] for s in row if s in refused) for row in sizes]
    if any(why):
        return {"text_tokens": [0] * rows, "vision_tokens": [0] * rows, "refused": why}
    counts = family.count_tokens(processor, texts, sizes)
    if video is not None:
        factor = family.video_frame_factor(processor)
        for i, paths in enumerate(batch["videos"]):
            if paths:
                plans = [plan_frames(read_header(path, video), video, factor) for path in paths]
                text, frames = family.count_video_tokens(processor, plans)
                counts[i] = (counts[i][0] + text, counts[i][1] + frames)
    text_tokens, vision_tokens = (
        (list(column) for column in zip(*counts, strict=True)) if counts else ([], [])
    )
    return {"text_tokens": text_tokens, "vision_tokens": vision_tokens, "refused": [""] * rows}


class RefusedImages(DataError):
    """Rows with an image the processor cannot take: row index → what it said."""

    def __init__(self, rows: dict[int, str]):
        super().__init__(f"{len(rows)} row(s) with an image the processor refuses")
        self.rows = rows


def refused_image_sizes(processor, sizes: set[tuple[int, int]]) -> dict[tuple[int, int], str]:
    """The (height, width) sizes the processor refuses, with its words (Qwen's "absolute aspect ratio must
    be smaller than 200" for a 2400x4 strip). Each unusual size (a side under 32 px, or one side over 20x
    the other) is tried on a blank image of that size; usual sizes are not (a dataset has thousands)."""
    refused = {}
    for height, width in sorted(sizes):
        if min(height, width) >= 32 and max(height, width) <= 20 * min(height, width):
            continue
        try:
            processor.image_processor(images=[Image.new("RGB", (width, height))], return_tensors="pt")
        except Exception as exc:  # processors raise ValueError, ZeroDivisionError, RuntimeError, ...
            refused[(height, width)] = f"{height}x{width} px: {exc}"
    return refused


def lengths_of_usable_rows(
    ds: datasets.Dataset, lengths_of, source: str, on_bad_sample: str
) -> tuple[datasets.Dataset, list[int], dict[str, int]]:
    """`lengths_of(ds)`, after the rows whose images the processor refuses are reported (`fail`) or left
    out (`skip`). Returns the rows kept, their lengths and the skip count."""
    try:
        return ds, lengths_of(ds), {}
    except RefusedImages as refused:
        ids = ds["id"] if "id" in ds.column_names else list(range(len(ds)))
        bad = [
            BadRow(f"{source} row {ids[i]}", "image the processor refuses", detail)
            for i, detail in sorted(refused.rows.items())
        ]
        skipped = fail_or_skip(
            bad, on_bad_sample, source, "row(s) with an image the processor refuses (crop or pad it)"
        )
        kept = ds.select([i for i in range(len(ds)) if i not in refused.rows])
        if len(kept) == 0:
            raise DataError(f"{source}: every row has an image the processor refuses") from None
        return kept, lengths_of(kept), skipped


def sample_lengths(
    ds: datasets.Dataset,
    processor,
    family: Family,
    video: VideoSampling | None = None,
    remember: Remember | None = None,
) -> list[int]:
    """Tokens per sample, image and video tokens included (`remember`: as sample_token_counts)."""
    counts = sample_token_counts(ds, processor, family, video, remember)
    return [text + vision for text, vision in counts]


def _image_size(image) -> tuple[int, int]:
    if isinstance(image, dict) and image.get("path"):
        image = image["path"]
    if isinstance(image, str):
        with Image.open(image) as opened:  # reads the header only
            return upright_size(opened)
    return upright_size(image)


@dataclass(frozen=True)
class LengthCheck:
    """A method's length check (every method's `check_lengths`): `measure` counts each row's tokens, image and
    video tokens included, from the rows undecoded (images read as headers only); the rows whose images the
    processor refuses, then those longer than max_length, are refused (`too_long`: the error's words, how to
    fix them). `rows`: the rows measured and returned in place of those given (KTO's pairs, unpaired).

    Returns the rows kept (without the refused ones under `skip`), their lengths and the skip counts."""

    measure: Callable[[datasets.Dataset, Any, Family, VideoSampling | None, Remember | None], list[int]]
    too_long: str
    rows: Callable[[datasets.Dataset], datasets.Dataset] = lambda ds: ds

    def __call__(
        self,
        ds: datasets.Dataset,
        processor,
        family: Family,
        max_length: int | None,
        source: str,
        on_bad_sample: str = "fail",
        video: VideoSampling | None = None,
        remember: Remember | None = None,
    ) -> tuple[datasets.Dataset, list[int], dict[str, int]]:
        def lengths_of(rows: datasets.Dataset) -> list[int]:
            return self.measure(undecoded(rows), processor, family, video, remember)

        with cache_writes():  # a method's own map of the rows (KTO's unpairing) writes datasets' cache files
            rows = self.rows(ds)
        return lengths_within(rows, lengths_of, max_length, source, on_bad_sample, self.too_long)


# SFT's: cutting through image tokens breaks the model ("image features and image tokens do not match"), and
# cutting the answer trains on nothing
check_lengths = LengthCheck(
    sample_lengths,
    "sample(s) longer than data.max_length (raise it, or lower data.max_pixels so images take fewer "
    "tokens, or data.max_frames / data.video_max_pixels for videos)",
)


def conversation_lengths(
    rows: datasets.Dataset, messages: list[list[dict]], processor, family: Family, remember: Remember | None
) -> list[int]:
    """Tokens of each row's `messages` (a conversation made of its columns: a prompt and an answer) with the
    row's images, image tokens included: what preference and prompt rows measure."""
    images = rows["images"] if "images" in rows.column_names else [[]] * len(rows)
    conversations = datasets.Dataset.from_dict({"messages": messages, "images": images})
    return sample_lengths(conversations, processor, family, remember=remember)


def lengths_within(
    ds: datasets.Dataset, lengths_of, max_length: int | None, source: str, on_bad_sample: str, what: str
) -> tuple[datasets.Dataset, list[int], dict[str, int]]:
    """`lengths_of(ds)` for the rows whose images the processor takes, then the rows longer than
    `max_length` refused (`what`: how to fix them). Every method's length check (SFT, DPO, GRPO) is this.
    Returns the rows kept, their lengths and the skip counts."""
    ds, lengths, refused = lengths_of_usable_rows(ds, lengths_of, source, on_bad_sample)
    ds, lengths, too_long = refuse_too_long(ds, lengths, max_length, source, on_bad_sample, what)
    return ds, lengths, refused | too_long


def refuse_too_long(
    ds: datasets.Dataset,
    lengths: list[int],
    max_length: int | None,
    source: str,
    on_bad_sample: str,
    what: str,
) -> tuple[datasets.Dataset, list[int], dict[str, int]]:
    """The rows whose length exceeds max_length: an error listing them (`fail`), or dropped and counted
    (`skip`). Returns the dataset, the lengths kept and the skip count."""
    if max_length is None:
        return ds, lengths, {}
    over = [i for i, n in enumerate(lengths) if n > max_length]
    ids = (
        ds.select(over)["id"] if "id" in ds.column_names else over
    )  # the long rows' ids only (a million rows)
    bad = [
        BadRow(f"{source} row {row_id}", "longer than max_length", f"{lengths[i]} tokens > {max_length}")
        for i, row_id in zip(over, ids, strict=True)
    ]
    skipped = fail_or_skip(bad, on_bad_sample, source, what)
    if not skipped:
        return ds, lengths, {}
    keep = [i for i, n in enumerate(lengths) if n <= max_length]
    if not keep:
        raise DataError(f"{source}: every row is longer than max_length={max_length}")
    return ds.select(keep), [lengths[i] for i in keep], skipped
