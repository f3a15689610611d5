"""A stage's data: both splits read and checked before any model loads (rows.py reads each source, mixture.py
holds a list of them), or, with data.streaming, the eval split read and the training rows streamed as they
are trained on (streaming.py); and the checks that look at a split's rows as a whole."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from types import MappingProxyType

import datasets

from vlm_recipes.data.cache_disk import cache_writes
from vlm_recipes.data.formats import EVAL_COLUMNS
from vlm_recipes.data.mixture import Mixture, load_mixture
from vlm_recipes.data.rows import RowFormat, VideoRules, read_split, undecoded
from vlm_recipes.data.streaming import StreamCounts
from vlm_recipes.errors import DataError
from vlm_recipes.recipes.data_sources import describe_sources
from vlm_recipes.recipes.schema import DataSettings, Stage


@dataclass
class StageData:
    train: datasets.Dataset
    eval: datasets.Dataset | None
    train_source: str  # as the recipe named it (a mixture: each source with its share, data/mixture.py)
    eval_source: str | None
    skipped: dict[str, dict[str, int]] = field(default_factory=dict)  # split → reason → rows skipped
    lengths: dict[str, list[int]] = field(default_factory=dict)  # split → tokens per row (length check)
    eval_metrics: list[str] = field(default_factory=list)  # what the eval's answers are scored by
    # split → its sources, where the recipe lists several: the split holds their rows once each until the
    # length check, then the epoch's draw (mixture.draw_mixture)
    mixtures: dict[str, Mixture] = field(default_factory=dict)
    # data.streaming: the training split is a datasets IterableDataset (data/streaming.py); its first rows,
    # checked before training, and what it has read
    train_head: datasets.Dataset | None = None
    streamed: StreamCounts | None = None

    @property
    def train_sample(self) -> datasets.Dataset:
        """The training rows a check before training looks at: all of them, or a stream's first rows."""
        return self.train_head if self.train_head is not None else self.train


def load_stage_data(
    settings: DataSettings,
    row_format: RowFormat | None = None,
    video: VideoRules | None = None,
    paths: Mapping[str, str] = MappingProxyType({}),
) -> StageData:
    """Both splits, checked; all of it before any model loads. `paths`: where the run's plan found a
    source that names no file (a demo id); reports keep the name the recipe gave. A split that lists several
    sources (a mixture) holds each source's rows once, with the sources in `mixtures`: the stage draws the
    epoch's rows from them once their lengths are counted (mixture.draw_mixture)."""
    eval_source = describe_sources(settings.eval) if settings.eval else None
    data = StageData(None, None, describe_sources(settings.train), eval_source)
    for split in ("train", "eval"):
        if not (source := getattr(settings, split)) or (split == "train" and settings.streaming):
            continue  # a stream is read as it is trained on (stages/run.py: check_data)
        read = partial(_read_source, settings, split, row_format, video, paths)
        limit = settings.max_train_samples if split == "train" else settings.max_eval_samples
        with cache_writes():  # the rows' tables and datasets' map files: a full disk named, exit 4
            if isinstance(source, str):
                rows, skipped, _ = read(source, limit)
            else:
                data.mixtures[split] = mixture = load_mixture(source, split, limit, read)
                rows, skipped = mixture.rows(), mixture.skipped
        setattr(data, split, rows)
        if skipped:
            data.skipped[split] = skipped
    return data


def _read_source(
    settings: DataSettings,
    split: str,
    row_format: RowFormat | None,
    video: VideoRules | None,
    paths: Mapping[str, str],
    source: str,
    limit: int | None,
) -> tuple[datasets.Dataset, dict[str, int], str]:
    """One source of a stage's `split` (train or eval), read as the stage's data settings say."""
    hub_split = settings.train_split if split == "train" else settings.eval_split
    policy, remote = settings.on_bad_sample, settings.allow_remote_images
    extra = EVAL_COLUMNS if split == "eval" else ()
    return read_split(source, hub_split, limit, policy, remote, row_format, video, paths.get(source), extra)


def has_text_only_rows(ds: datasets.Dataset) -> bool:
    """Whether some row has neither an image nor a video (read without decoding any image)."""
    columns = [c for c in ("images", "videos") if c in ds.column_names]
    if not columns:
        return True
    rows = undecoded(ds.select_columns(columns))
    return any(not any(row[c] for c in columns) for row in rows)


def refuse_nothing_to_see(stage: Stage, data: StageData) -> None:
    """A stage that trains only what looks at images, on rows without images or videos, would train
    nothing: no gradient reaches the tower or projector from a text-only row."""
    if stage.train.llm != "frozen" or not stage.vision_trains or any_media_rows(data.train_sample):
        return
    raise DataError(
        f"stage {stage.name!r} trains only the vision tower / projector, but no row of {data.train_source} "
        "has an image or a video: nothing would learn. Add image rows, or train the language model too "
        "(train.llm: lora)"
    )


def any_media_rows(ds: datasets.Dataset) -> bool:
    """Whether some row has an image or a video (read without decoding any image)."""
    columns = [c for c in ("images", "videos") if c in ds.column_names]
    rows = undecoded(ds.select_columns(columns)) if columns else []
    return any(any(row[c] for c in columns) for row in rows)
