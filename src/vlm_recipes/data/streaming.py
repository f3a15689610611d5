"""`data.streaming: true`: the training rows read as they are trained on, never all at once, so a dataset
larger than memory, or than the patience for checking it whole, trains from its first rows.

The rows come one at a time from their file (sources.stream_source: .json / .jsonl read here, parquet, csv,
folders and hub ids by datasets' streaming mode). Each is checked as it comes, as a read split's rows are
before training: its images opened and read through, its videos' headers read, its tokens counted (image
and video tokens included) against data.max_length. A bad or too-long row stops the stage naming its place
(`on_bad_sample: fail`), or is skipped and counted (`skip`). The rows kept are shuffled in a window of
data.shuffle_buffer rows (datasets' buffer shuffle, with training.seed; another order each pass), then their
images decoded by datasets' Image feature, as a read split's are.

What a stream cannot give before training, and what stands in for it (said in the log): its row count
(training.max_steps sets the stage's length, and is required); every row checked before the model loads
(the first HEAD_ROWS are, so a broken file fails in seconds; the rest as they are trained on); every row's
length (what a mixture's draw and group_by_length need: both refused at load, recipes/validate.py).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import count, islice
from pathlib import Path

import datasets

from vlm_recipes.data.arrow_rows import with_every_key
from vlm_recipes.data.lengths import check_lengths, count_batch
from vlm_recipes.data.rows import (
    MESSAGES,
    BadRow,
    RowFormat,
    VideoRules,
    fail_or_skip,
    is_remote,
    video_row_problem,
)
from vlm_recipes.data.sources import stream_source
from vlm_recipes.errors import DataError
from vlm_recipes.families.base import Family
from vlm_recipes.recipes.schema import DataSettings

log = logging.getLogger(__name__)

HEAD_ROWS = 100  # rows read and checked before the model loads
BATCH_ROWS = 64  # rows checked and counted at a time


@dataclass
class StreamCounts:
    """What the stream read and kept in this process (a dataloader worker counts its own), for metrics.json."""

    read: int = 0
    kept: int = 0
    skipped: Counter = field(default_factory=Counter)
    longest: int = 0  # tokens, image and video tokens included

    def record(self) -> dict:
        return {
            "rows_read": self.read,
            "rows_kept": self.kept,
            "skipped": dict(self.skipped),
            "longest": self.longest,
        }


@dataclass(frozen=True)
class Stream:
    """Where a stage's training rows stream from, and how each is checked."""

    source: str  # as the recipe names it
    path: str  # where it is read (a demo id's file)
    split: str
    settings: DataSettings
    processor: object
    family: Family
    max_length: int | None
    video: VideoRules | None = None
    row_format: RowFormat = MESSAGES

    def rows(self, counts: StreamCounts) -> Iterator[dict]:
        """The rows kept, in the file's order, images and videos as paths from the working directory."""
        rows, root = stream_source(self.path, self.split)
        limit = self.settings.max_train_samples
        rows = islice(rows, limit) if limit else rows  # the first N rows, as a read split's
        while block := list(islice(rows, BATCH_ROWS)):
            counts.read += len(block)
            yield from self._checked(block, root, counts)

    def _checked(self, block: list, root: Path | None, counts: StreamCounts) -> list[dict]:
        check, columns = self.row_format
        allow_remote, policy = self.settings.allow_remote_images, self.settings.on_bad_sample
        bad, good = [], []
        for row, at in block:
            if isinstance(row, BadRow):
                bad.append(row)
            elif problem := check(row, root, allow_remote) or video_row_problem(row, root, self.video):
                bad.append(BadRow(at, *problem))
            else:
                good.append((_from_working_directory(row, root, columns), at))
        counts.skipped.update(fail_or_skip(bad, policy, self.source))
        good, lengths = self._lengths(good, counts)
        kept = []
        for (row, at), length in zip(good, lengths, strict=True):
            if self.max_length is not None and length > self.max_length:
                tokens = f"{length} tokens > {self.max_length}"
                too_long = [BadRow(at, "longer than max_length", tokens)]
                counts.skipped.update(fail_or_skip(too_long, policy, self.source, check_lengths.too_long))
                continue
            counts.longest = max(counts.longest, length)
            kept.append(row)
        counts.kept += len(kept)
        return kept

    def _lengths(self, good: list[tuple[dict, str]], counts: StreamCounts) -> tuple[list, list[int]]:
        """Each row's tokens, image and video tokens included (lengths.py's count, from the files' headers);
        the rows with an image the processor refuses reported or left out first."""
        if not good:
            return [], []
        batch = {key: [row.get(key) for row, _ in good] for key in ("messages", "images", "videos")}
        sampling = self.video.sampling if self.video is not None and any(batch["videos"]) else None
        counted = count_batch(batch, self.processor, self.family, sampling)
        if refused := [(i, why) for i, why in enumerate(counted["refused"]) if why]:
            bad = [BadRow(good[i][1], "image the processor refuses", why) for i, why in refused]
            what = "row(s) with an image the processor refuses (crop or pad it)"
            counts.skipped.update(fail_or_skip(bad, self.settings.on_bad_sample, self.source, what))
            return self._lengths([g for i, g in enumerate(good) if not counted["refused"][i]], counts)
        return good, [
            text + vision
            for text, vision in zip(counted["text_tokens"], counted["vision_tokens"], strict=True)
        ]


def _from_working_directory(row: dict, root: Path | None, columns: tuple[str, ...]) -> dict:
    """The row's columns the method trains on, its media paths made relative to the working directory."""
    kept = {key: row[key] for key in (*columns, "videos", "id") if key in row}
    if root is not None:
        for key in ("images", "videos"):
            if kept.get(key):
                kept[key] = [
                    p if not isinstance(p, str) or is_remote(p) else str(root / p) for p in kept[key]
                ]
    kept.setdefault("images", [])
    return kept


def streamed_split(
    stream: Stream, seed: int, counts: StreamCounts
) -> tuple[datasets.IterableDataset, datasets.Dataset]:
    """The training split as datasets' IterableDataset (rows checked as they are read, shuffled in a window,
    images decoded), and its first HEAD_ROWS rows, read and checked now: a broken file fails before the model
    loads, and the checks that look at a split's rows (rows.refuse_nothing_to_see) look at these."""
    head = StreamCounts()
    checked = list(islice(stream.rows(head), HEAD_ROWS))
    if not checked:
        raise DataError(f"{stream.source}: no row to train on in its first {head.read} rows")
    log.info(
        "data: %s streamed (data.streaming): its first %d rows checked now, the rest as they are trained on; "
        "shuffled in a window of %d rows (data.shuffle_buffer); no row count, so training.max_steps sets the "
        "stage's length",
        stream.source,
        head.read,
        stream.settings.shuffle_buffer,
    )
    rows = datasets.IterableDataset.from_generator(_rows_of, gen_kwargs={"stream": stream, "counts": counts})
    a_pass = rows.shuffle(seed=seed, buffer_size=stream.settings.shuffle_buffer)
    endless = datasets.IterableDataset.from_generator(_every_pass, gen_kwargs={"a_pass": a_pass})
    return endless.map(_decoded_images), datasets.Dataset.from_list(with_every_key(checked))


def _rows_of(stream: Stream, counts: StreamCounts) -> Iterator[dict]:
    yield from stream.rows(counts)


def _every_pass(a_pass: datasets.IterableDataset) -> Iterator[dict]:
    """Pass 0, 1, 2, ... one after another, pass k in its own order (datasets' set_epoch(k)); ends only if a
    pass gives no row.

    Trainer counts a stream's every step in its epoch 0: resumed at step n, it skips n batches of epoch 0 and
    then starts epoch 1. A stream that ended each pass there would resume inside its second pass at that
    pass's first row. One endless epoch makes its count right: the n batches skipped are the n trained.
    (datasets' repeat() gives every pass the first pass's order; shuffling after it mixes passes.)"""
    for number in count():
        a_pass.set_epoch(number)
        given = False
        for row in a_pass:
            given = True
            yield row
        if not given:
            return


IMAGE = datasets.Image()


def _decoded_images(row: dict) -> dict:
    """A row's image paths decoded by datasets' Image feature (EXIF orientation applied), as a read split's."""
    images = [
        IMAGE.decode_example({"path": p, "bytes": None}) if isinstance(p, str) else p
        for p in row["images"] or []
    ]
    return {"images": images}
