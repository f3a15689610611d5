"""A mixture: `data.train` (or `data.eval`) as a list of sources, each `{path, weight}` or `{path, samples}`.

Each source is read and checked on its own (its own format; a bad row names its own file), and its rows'
lengths are counted once each. Then the epoch's rows are drawn, with the stage's seed:

- the epoch holds `data.max_train_samples` rows, or as many as the sources hold together; each weighted
  source gives its weight's share of them (normalised over the weights, by largest remainder, so the counts
  sum exactly); a `samples` source gives exactly that many (max_train_samples, if lower than their sum,
  shrinks every source in proportion);
- a source gives every row once per full pass, then a seeded choice of its rows for what is left: a small
  source repeats, a large one is subsampled;
- the training rows are shuffled together (an eval list keeps its sources in order, and each row's source
  in the `mixture_source` column).

The drawn rows are one datasets.Dataset before the trainer is built: a resumed stage draws the same rows in
the same order (the same seed, the same files), and Trainer's own resume skips the batches already trained.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction

import datasets
import numpy as np

from vlm_recipes.data.arrow_rows import with_every_key
from vlm_recipes.errors import DataError
from vlm_recipes.recipes.data_sources import DataSource, entry_share

log = logging.getLogger(__name__)

MIXTURE_SOURCE_COLUMN = "mixture_source"  # an eval list's rows: which source each came from (its path)


# (rows, where they are from) -> (rows kept, their lengths, skip counts): the stage's length check
Measure = Callable[[datasets.Dataset, str], tuple[datasets.Dataset, list[int], dict[str, int]]]


@dataclass
class MixturePart:
    entry: DataSource
    label: str  # `data.train[1]`: where the recipe lists it
    rows: datasets.Dataset  # its rows once each, checked
    format: str


@dataclass
class Mixture:
    """A split's sources, read and checked, before the draw; `report` (one row per source) after it."""

    split: str  # train or eval
    parts: list[MixturePart]
    total: int | None  # the epoch's rows where the split's max_*_samples sets them
    skipped: dict[str, int] = field(default_factory=dict)  # rows skipped while reading, per reason
    report: list[dict] = field(default_factory=list)

    def rows(self) -> datasets.Dataset:
        """Every source's rows once each, in the list's order: what the checks before the draw read."""
        return concatenate([part.rows for part in self.parts])


def load_mixture(
    entries: list[DataSource],
    split: str,
    limit: int | None,
    read: Callable[[str, int | None], tuple[datasets.Dataset, dict[str, int], str]],
) -> Mixture:
    """Read each source of a mixture (`read(path, max rows)`, the stage's reader: its rows, skip counts and
    format); an error names the entry.
    `limit`: the split's max_*_samples, the epoch's rows; an eval source without weight or samples is its
    first `limit` rows instead."""
    weighted = any(entry.weight is not None for entry in entries)
    parts, skipped = [], Counter()
    for i, entry in enumerate(entries):
        label = f"data.{split}[{i}]"
        bare = entry.weight is None and entry.samples is None
        try:
            rows, part_skipped, fmt = read(entry.path, limit if bare else None)
        except DataError as exc:
            raise DataError(f"{label} ({entry.path}): {exc}") from exc
        parts.append(MixturePart(entry, label, rows, fmt))
        skipped.update(part_skipped)
    total = limit if split == "train" or weighted else None
    return Mixture(split, parts, total, dict(skipped))


def draw_mixture(
    mixture: Mixture, measure: Measure, seed: int, logged: bool = True
) -> tuple[datasets.Dataset, list[int], dict[str, int]]:
    """The split's rows for an epoch, drawn from its sources with `seed` after `measure` (the stage's length
    check) counted each source's rows once; their lengths; the rows the length check skipped. The report of
    the draw is left in `mixture.report` and, where `logged`, logged as a table (`data check` prints it)."""
    kept, lengths, skipped = [], [], Counter()
    for part in mixture.parts:
        rows, part_lengths, part_skipped = measure(part.rows, f"{part.label} ({part.entry.path})")
        kept.append(rows)
        lengths.append(part_lengths)
        skipped.update(part_skipped)
    sizes = [len(rows) for rows in kept]
    counts = row_counts(sizes, [part.entry for part in mixture.parts], mixture.total)
    picks = draw_rows(sizes, counts, seed, shuffle=mixture.split == "train")
    offsets = np.cumsum([0, *sizes])[:-1]
    rows = concatenate(kept).select((offsets[picks[:, 0]] + picks[:, 1]).tolist())
    drawn_lengths = [lengths[p][r] for p, r in picks.tolist()]
    if mixture.split == "eval":
        sources = [mixture.parts[p].entry.path for p in picks[:, 0].tolist()]
        rows = rows.add_column(MIXTURE_SOURCE_COLUMN, sources)
    tokens = np.bincount(picks[:, 0], weights=drawn_lengths, minlength=len(sizes))
    mixture.report = [
        {
            "source": part.entry.path,
            "format": part.format,
            **share_of(part.entry),
            "source_rows": size,
            "rows": count,
            "tokens": int(tokens[i]),
        }
        for i, (part, size, count) in enumerate(zip(mixture.parts, sizes, counts, strict=True))
    ]
    drawn = "an epoch" if mixture.split == "train" else "the eval split"
    (log.info if logged else log.debug)(
        "data: %s mixture, %d rows %s (seed %d):\n%s",
        mixture.split,
        len(rows),
        drawn,
        seed,
        mixture_table(mixture.report),
    )
    return rows, drawn_lengths, dict(skipped)


def share_of(entry: DataSource) -> dict:
    """The share the recipe gave a source, as report.json records it."""
    if entry.weight is not None:
        return {"weight": entry.weight}
    return {"samples": entry.samples} if entry.samples is not None else {"all_rows": True}


def row_counts(sizes: list[int], entries: list[DataSource], total: int | None) -> list[int]:
    """Rows each source gives an epoch (see the module's docstring): weights share `total` (default: every
    source's rows together); samples are exact, shrunk in proportion to a lower `total`; an entry with
    neither (an eval list's) gives each of its rows once."""
    if entries and all(entry.weight is not None for entry in entries):
        return apportion(sum(sizes) if total is None else total, [entry.weight for entry in entries])
    counts = [
        size if entry.samples is None else entry.samples for entry, size in zip(entries, sizes, strict=True)
    ]
    if total is not None and total < sum(counts) and any(entry.samples is not None for entry in entries):
        return apportion(total, counts)
    return counts


def apportion(total: int, weights: list[float]) -> list[int]:
    """`total` split in proportion to `weights` into whole counts that sum to it exactly: each its quota
    rounded down, then one more to the largest remainders (the earlier entry on a tie). Weights are read as
    the decimals written (0.3 is 3/10), so the quotas are exact."""
    exact = [Fraction(repr(float(weight))) for weight in weights]
    quotas = [total * weight / sum(exact) for weight in exact]
    counts = [int(quota) for quota in quotas]
    by_remainder = sorted(range(len(quotas)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def draw_rows(sizes: list[int], counts: list[int], seed: int, shuffle: bool = True) -> np.ndarray:
    """(source, row) pairs, `counts[i]` of source i (of `sizes[i]` rows): every row once per full pass,
    then a seeded choice without repeats for the rest, all of them shuffled together (`shuffle`; else in
    source order). Each source draws from its own stream of `seed`, so changing one source's share leaves
    the rows another draws as they were."""
    streams = np.random.SeedSequence(seed).spawn(len(sizes) + 1)
    picks = []
    for source, (size, count, stream) in enumerate(zip(sizes, counts, streams, strict=False)):
        if count and not size:
            raise DataError(f"source {source} has no rows to draw {count} from")
        passes, rest = divmod(count, size) if size else (0, 0)
        chosen = np.sort(np.random.default_rng(stream).choice(size, rest, replace=False)) if rest else []
        rows = np.concatenate([np.tile(np.arange(size), passes), np.asarray(chosen, dtype=np.int64)])
        picks.append(np.stack([np.full(len(rows), source), rows], axis=1).astype(np.int64))
    pairs = np.concatenate(picks) if picks else np.zeros((0, 2), dtype=np.int64)
    if shuffle:
        pairs = pairs[np.random.default_rng(streams[-1]).permutation(len(pairs))]
    return pairs


def concatenate(parts: list[datasets.Dataset]) -> datasets.Dataset:
    """The sources' rows as one table. Columns one source lacks are null in its rows; sources whose columns
    hold different kinds of values (a content part with other keys) are read again as one table of rows."""
    try:
        return datasets.concatenate_datasets(parts)
    except ValueError:
        pass
    images = datasets.List(datasets.Image(decode=False))
    plain = [part.cast_column("images", images) if "images" in part.column_names else part for part in parts]
    rows = [row for part in plain for row in part.to_list()]
    table = datasets.Dataset.from_list(with_every_key(rows))
    return (
        table.cast_column("images", datasets.List(datasets.Image()))
        if "images" in table.column_names
        else table
    )


def mixture_table(report: list[dict]) -> str:
    """The draw as a small table: each source, its format, its share, the rows it has and gave, tokens."""
    total = sum(row["rows"] for row in report) or 1
    header = ("source", "format", "share", "has", "drawn", "of all", "tokens")
    lines = [
        (
            row["source"],
            row["format"],
            entry_share(DataSource(row["source"], row.get("weight"), row.get("samples"))),
            f"{row['source_rows']:,}",
            f"{row['rows']:,}",
            f"{row['rows'] / total:.1%}",
            f"{row['tokens']:,}",
        )
        for row in report
    ]
    widths = [max(len(cell) for cell in column) for column in zip(header, *lines, strict=True)]
    return "\n".join(
        "  " + "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in (header, *lines)
    )
