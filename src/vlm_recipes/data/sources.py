"""Where a split's rows come from: a `.jsonl` / `.json` file (read here, so errors name lines), a
`.parquet` / `.csv` file or a folder (`datasets`), a LLaMA-Factory `dataset_info.json#entry`, or a hub
dataset id; whatever shape the rows are in (data/formats.py), they leave as TRL's conversational rows."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import datasets

from vlm_recipes.data.arrow_rows import LinePlaces, NumberedPlaces, RowsTable
from vlm_recipes.data.formats import ChatTags, FileFormat, RowError, ShapeWatch, detect, to_trl
from vlm_recipes.data.json_files import json_rows
from vlm_recipes.errors import DataError

log = logging.getLogger(__name__)

LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


@dataclass
class BadRow:
    """A row that cannot be trained on: where it is, why (counted per reason), and the details."""

    where: str  # "file.jsonl:line 7" or "source row 7"
    reason: str  # short category, counted in reports
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.where}: {self.reason}{': ' + self.detail if self.detail else ''}"


@dataclass
class Loaded:
    """A split as read: the rows in TRL's form, the folder image and video paths are relative to, where
    each row came from, the rows that could not be read, and the format the file was in."""

    ds: datasets.Dataset
    root: Path | None
    where: Sequence[str]  # arrow_rows' places: a number a row, not a string
    bad: list[BadRow]
    format: str


def read_source(source: str, split: str) -> Loaded:
    """A local file or folder, LLaMA-Factory dataset_info.json entries (`path#name` or `path#a,b`), or a
    hub dataset id, in any format data/formats.py reads, turned into TRL's conversational rows."""
    path = Path(source).expanduser()
    if "#" in source and source.partition("#")[0].endswith(".json"):
        return _read_entries(source)
    if path.suffix in (".json", ".jsonl"):
        return _read_json_files([(path, None)], path.parent)
    if path.suffix in LOCAL_FORMATS:
        if not path.is_file():
            raise DataError(f"data file not found: {path} (check data.train / data.eval)")
        ds = datasets.load_dataset(LOCAL_FORMATS[path.suffix], data_files=str(path), split="train")
        root, where = path.parent, NumberedPlaces(str(path), len(ds))
    elif path.is_dir():
        ds = datasets.load_dataset(str(path), split=split)
        root, where = path, NumberedPlaces(str(path), len(ds))
    else:  # anything else is a hub dataset id: a network fetch the recipe asked for
        log.info("loading dataset %s (split %s) from the hub", source, split)
        ds = datasets.load_dataset(source, split=split)
        root, where = None, NumberedPlaces(f"{source}[{split}]", len(ds))
    ds, fmt = _as_trl(ds, where, source)
    return Loaded(ds, root, where, [], fmt)


def _read_entries(source: str) -> Loaded:
    """One or more entries of a LLaMA-Factory dataset_info.json, as LLaMA-Factory reads `dataset: a,b`: their
    rows together, media paths relative to the dataset_info.json's folder (its `media_dir` default)."""
    files, root = entry_files(source)
    loaded = _read_json_files(files, root)
    if len(files) > 1:
        info, _, names = source.partition("#")
        loaded.format = f"sharegpt ({Path(info).name}#{names})"
    return loaded


def entry_files(source: str) -> tuple[list[tuple[Path, ChatTags | None]], Path]:
    """`info.json#a,b`: each entry's data file and tags, and the folder media paths are relative to (the
    dataset_info.json's, LLaMA-Factory's `media_dir` default)."""
    info, _, names = source.partition("#")
    files = [dataset_info_entry(f"{info}#{name.strip()}") for name in names.split(",")]
    return files, Path(info).expanduser().parent


def _read_json_files(files: list[tuple[Path, ChatTags | None]], root: Path) -> Loaded:
    """`.json` / `.jsonl` files' rows, one table of them in TRL's form (arrow_rows.py), each row's place
    (`file:line N`), the rows that could not be read, and the (first) file's format."""
    table = RowsTable()
    while True:
        places, bad = LinePlaces(), []
        formats = [_read_json_file(path, tags, table, places, bad) for path, tags in files]
        if (ds := table.finish()) is not None:
            return Loaded(ds, root, places, bad, formats[0])
        table = RowsTable(table.schema)  # a late row added a column: read again, every column known


def _read_json_file(
    path: Path, tags: ChatTags | None, table: RowsTable, places: LinePlaces, bad: list[BadRow]
) -> str:
    """A `.json` / `.jsonl` file's rows in TRL's form added to `table` (their places to `places`), the rows
    that cannot be read to `bad`; its format's name."""
    fmt, rows = json_file_rows(path, tags)
    for number, row in rows:
        if isinstance(row, BadRow):
            bad.append(row)
        else:
            table.add(row, f"{path}:line {number}")
            places.add(str(path), number)
    return fmt.name


def json_file_rows(
    path: Path, tags: ChatTags | None
) -> tuple[FileFormat, Iterator[tuple[int, dict | BadRow]]]:
    """A `.json` / `.jsonl` file's format and its rows one at a time in TRL's form with their line numbers,
    a BadRow for each that cannot be read. The format is the first row's that shows one (read ahead of the
    rest: usually the first row); a row in another is a DataError."""
    if not path.is_file():
        raise DataError(f"data file not found: {path} (check data.train / data.eval)")
    shapes, first = ShapeWatch(str(path), tags), None
    for number, row in json_rows(path):
        if isinstance(row, dict):
            first = first or row
            shapes.see(row, f"{path}:line {number}")
            if shapes.seen is not None:
                break
    fmt = shapes.format(first)

    def rows() -> Iterator[tuple[int, dict | BadRow]]:
        for number, row in json_rows(path):
            at = f"{path}:line {number}"
            if isinstance(row, str):
                yield number, BadRow(at, "unreadable JSON", row)
                continue
            shapes.see(row, at)
            try:
                yield number, to_trl(row, fmt)
            except RowError as exc:
                yield number, BadRow(at, exc.reason, exc.detail)

    return fmt, rows()


def stream_source(source: str, split: str) -> tuple[Iterator[tuple[dict | BadRow, str]], Path | None]:
    """`data.streaming`'s rows: those of read_source, one at a time as they are read, each with its place (a
    BadRow where one cannot be read), and the folder media paths are relative to. .json / .jsonl files and
    dataset_info.json entries are read here; parquet, csv, folders and hub ids by datasets' streaming mode."""
    path = Path(source).expanduser()
    if "#" in source and source.partition("#")[0].endswith(".json"):
        files, root = entry_files(source)
        return _stream_json_files(files), root
    if path.suffix in (".json", ".jsonl"):
        return _stream_json_files([(path, None)]), path.parent
    if path.suffix in LOCAL_FORMATS:
        if not path.is_file():
            raise DataError(f"data file not found: {path} (check data.train / data.eval)")
        ds = datasets.load_dataset(
            LOCAL_FORMATS[path.suffix], data_files=str(path), split="train", streaming=True
        )
        root, prefix = path.parent, str(path)
    elif path.is_dir():
        ds, root, prefix = datasets.load_dataset(str(path), split=split, streaming=True), path, str(path)
    else:  # a hub dataset id: a network fetch the recipe asked for
        log.info("streaming dataset %s (split %s) from the hub", source, split)
        ds, root, prefix = (
            datasets.load_dataset(source, split=split, streaming=True),
            None,
            f"{source}[{split}]",
        )
    media = ("images", "image", "videos", "video")
    head = [{k: v for k, v in row.items() if k not in media} for row in ds.take(100)]
    fmt = detect(head, [f"{prefix} row {i}" for i in range(len(head))], source)

    def rows() -> Iterator[tuple[dict | BadRow, str]]:
        for index, row in enumerate(ds):
            at = f"{prefix} row {index}"
            try:
                yield to_trl(row, fmt), at
            except RowError as exc:
                yield BadRow(at, exc.reason, exc.detail), at

    return rows(), root


def _stream_json_files(files: list[tuple[Path, ChatTags | None]]) -> Iterator[tuple[dict | BadRow, str]]:
    for path, tags in files:
        _, rows = json_file_rows(path, tags)
        for number, row in rows:
            yield row, f"{path}:line {number}"


def _as_trl(ds: datasets.Dataset, where: Sequence[str], source: str) -> tuple[datasets.Dataset, str]:
    """A table's rows in TRL's form (formats are told apart by the first rows; a row that cannot be read
    is a DataError naming it), with an `images` column."""
    head = ds.select(range(min(len(ds), 100))).select_columns(
        [c for c in ds.column_names if c not in ("images", "image", "videos", "video")]
    )
    fmt = detect(head.to_list(), where[: len(head)], source)
    if fmt.tags is not None:

        def convert(row, index):
            try:
                return to_trl(row, fmt)
            except RowError as exc:
                raise DataError(f"{where[index]}: {exc.reason}: {exc.detail}") from exc

        ds = ds.map(convert, with_indices=True, remove_columns=ds.column_names, desc="reading rows")
    if "images" not in ds.column_names:
        ds = ds.add_column("images", [[]] * len(ds))
    return ds, fmt.name


def dataset_info_entry(source: str) -> tuple[Path, ChatTags | None]:
    """`path/dataset_info.json#name`: the data file the entry names and its tags (None: detect them).

    LLaMA-Factory's defaults apply where the entry is silent: formatting `alpaca` (which this runner does
    not read: a DataError says so), sharegpt's `conversations` / `from` / `value` / `human` / `gpt`."""
    info_path, _, name = source.partition("#")
    path = Path(info_path).expanduser()
    if not path.is_file():
        raise DataError(f"dataset_info file not found: {path} (check data.train / data.eval)")
    try:
        info = json.loads(path.read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from exc
    if name not in info:
        raise DataError(f"{path}: no entry {name!r}; its entries are {', '.join(sorted(info)) or 'none'}")
    entry = info[name]
    if "file_name" not in entry:
        raise DataError(
            f"{path}#{name}: only entries with a local `file_name` are read here (hub and script entries: "
            "name the dataset in data.train directly)"
        )
    formatting = entry.get("formatting", "alpaca")
    if formatting != "sharegpt":
        raise DataError(
            f"{path}#{name}: formatting {formatting!r} is not read by this runner; vision datasets use "
            "`formatting: sharegpt` (LLaMA-Factory's mllm_demo does)"
        )
    columns, tags = entry.get("columns", {}), entry.get("tags", {})
    if entry.get("ranking") and not ({"chosen", "rejected"} <= set(columns)):
        raise DataError(f"{path}#{name}: a ranking entry needs `columns.chosen` and `columns.rejected`")
    chat = ChatTags(
        f"sharegpt ({path.name}#{name})",
        messages=columns.get("messages", "conversations"),
        role=tags.get("role_tag", "from"),
        content=tags.get("content_tag", "value"),
        user=tags.get("user_tag", "human"),
        assistant=tags.get("assistant_tag", "gpt"),
        system=tags.get("system_tag", "system"),
        images=columns.get("images", "images"),
        videos=columns.get("videos", "videos"),
        system_column=columns.get("system", "system"),
        chosen=columns.get("chosen", "chosen"),
        rejected=columns.get("rejected", "rejected"),
    )
    return path.parent / entry["file_name"], chat
