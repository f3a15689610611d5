"""Where a split's rows come from: a `.jsonl` / `.json` file (read here, so errors name lines), a
`.parquet` / `.csv` file or a folder (`datasets`), a LLaMA-Factory `dataset_info.json#entry`, or a hub
dataset id; whatever shape the rows are in (data/formats.py), they leave as TRL's conversational rows."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import datasets
import pyarrow as pa

from vlm_recipes.data.formats import ChatTags, RowError, detect, to_trl
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
    where: list[str]
    bad: list[BadRow]
    format: str


def read_source(source: str, split: str) -> Loaded:
    """A local file or folder, LLaMA-Factory dataset_info.json entries (`path#name` or `path#a,b`), or a
    hub dataset id, in any format data/formats.py reads, turned into TRL's conversational rows."""
    path = Path(source).expanduser()
    if "#" in source and source.partition("#")[0].endswith(".json"):
        return _read_entries(source)
    if path.suffix in (".json", ".jsonl"):
        rows, where, bad, fmt = _read_json_file(path)
        return Loaded(_dataset_from_rows(rows, where), path.parent, where, bad, fmt)
    if path.suffix in LOCAL_FORMATS:
        if not path.is_file():
            raise DataError(f"data file not found: {path} (check data.train / data.eval)")
        ds = datasets.load_dataset(LOCAL_FORMATS[path.suffix], data_files=str(path), split="train")
        root, where = path.parent, [f"{path} row {i}" for i in range(len(ds))]
    elif path.is_dir():
        ds = datasets.load_dataset(str(path), split=split)
        root, where = path, [f"{path} row {i}" for i in range(len(ds))]
    else:  # anything else is a hub dataset id: a network fetch the recipe asked for
        log.info("loading dataset %s (split %s) from the hub", source, split)
        ds = datasets.load_dataset(source, split=split)
        root, where = None, [f"{source}[{split}] row {i}" for i in range(len(ds))]
    ds, fmt = _as_trl(ds, where, source)
    return Loaded(ds, root, where, [], fmt)


def _read_json_file(
    path: Path, tags: ChatTags | None = None
) -> tuple[list[dict], list[str], list[BadRow], str]:
    """A `.json` / `.jsonl` file's rows in TRL's form, where each is (`file:line N`), the rows that could not
    be read, and the file's format."""
    if not path.is_file():
        raise DataError(f"data file not found: {path} (check data.train / data.eval)")
    raw, lines, unreadable = read_json_rows(path)
    bad = [BadRow(f"{path}:line {n}", "unreadable JSON", detail) for n, detail in unreadable]
    fmt = detect(raw, [f"{path}:line {n}" for n in lines], str(path), tags)
    rows, where = [], []
    for row, number in zip(raw, lines, strict=True):
        try:
            rows.append(to_trl(row, fmt))
            where.append(f"{path}:line {number}")
        except RowError as exc:
            bad.append(BadRow(f"{path}:line {number}", exc.reason, exc.detail))
    return rows, where, bad, fmt.name


def _read_entries(source: str) -> Loaded:
    """One or more entries of a LLaMA-Factory dataset_info.json, as LLaMA-Factory reads `dataset: a,b`: their
    rows together, media paths relative to the dataset_info.json's folder (its `media_dir` default)."""
    info, _, names = source.partition("#")
    rows, where, bad, formats = [], [], [], []
    for name in names.split(","):
        path, tags = dataset_info_entry(f"{info}#{name.strip()}")
        entry_rows, entry_where, entry_bad, fmt = _read_json_file(path, tags)
        rows += entry_rows
        where += entry_where
        bad += entry_bad
        formats.append(fmt)
    fmt = formats[0] if len(formats) == 1 else f"sharegpt ({Path(info).name}#{names})"
    return Loaded(_dataset_from_rows(rows, where), Path(info).expanduser().parent, where, bad, fmt)


def _as_trl(ds: datasets.Dataset, where: list[str], source: str) -> tuple[datasets.Dataset, str]:
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


def _dataset_from_rows(rows: list[dict], where: list[str]) -> datasets.Dataset:
    """One Arrow table of the rows, with every key any row has (`Dataset.from_list` keeps only the first
    row's: a file whose video rows come after its image rows would lose `videos`); rows that give a key
    values of different kinds are a DataError naming the first row that differs from the first."""
    if not rows:
        return datasets.Dataset.from_dict({})
    keys = list(dict.fromkeys(key for row in rows for key in row))
    try:
        return datasets.Dataset.from_list([{key: row.get(key) for key in keys} for row in rows])
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as exc:
        first = {key: _json_kind(value) for key, value in rows[0].items()}
        for row, at in zip(rows[1:], where[1:], strict=True):
            for key, value in row.items():
                if key in first and _json_kind(value) != first[key]:
                    raise DataError(
                        f"{at}: `{key}` is {_json_kind(value)} but {first[key]} on {_line_of(where[0], at)}: "
                        f"give `{key}` the same kind of value in every row"
                    ) from exc
        raise DataError(
            f"{where[0].rsplit(':line', 1)[0]}: rows cannot be read as one table ({exc}): check that every "
            "row has the same keys with the same kinds of values"
        ) from exc


def _line_of(first: str, at: str) -> str:
    """`line 1` where both rows are in one file, else the first row's whole place."""
    file, _, line = first.rpartition(":")
    return line if at.startswith(file + ":") else first


def _json_kind(value) -> str:
    """The shape of a JSON value, nested lists and objects included (a list of strings vs of objects)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_json_kind(v)}" for k, v in sorted(value.items())) + "}"
    if isinstance(value, list):
        kinds = sorted({_json_kind(v) for v in value})
        return f"a list of {' or '.join(kinds)}" if kinds else "a list"
    return {str: "a string", bool: "a boolean", int: "a number", float: "a number"}.get(type(value), "null")


def read_json_rows(path: Path) -> tuple[list[dict], list[int], list[tuple[int, str]]]:
    """A `.json` or `.jsonl` file's rows with their line numbers, and (line, problem) for what is not a
    JSON object: a JSON array of objects, or one object per line. A UTF-8 byte-order mark and CRLF line
    ends (Windows tools write both) are read as the text around them."""
    text = path.read_text(encoding="utf-8-sig")
    if text.lstrip().startswith("["):
        return _array_rows(text)
    if text.lstrip().startswith("{") and "\n" in text.strip():
        try:
            whole = json.loads(text)
        except json.JSONDecodeError:
            whole = None  # one object per line
        if isinstance(whole, dict):
            raise DataError(
                f"{path} is one JSON object, not rows (a JSON array, or one object per line); a LLaMA-Factory "
                f"dataset_info.json is read by naming an entry: {path}#<name>"
            )
    rows, lines, bad = [], [], []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            bad.append((number, f"unreadable JSON: {exc.msg}"))
            continue
        if not isinstance(row, dict):
            bad.append((number, "unreadable JSON: not an object"))
            continue
        rows.append(row)
        lines.append(number)
    return rows, lines, bad


def _array_rows(text: str) -> tuple[list[dict], list[int], list[tuple[int, str]]]:
    """A JSON array's objects, each with the line it starts on (so errors name lines, as for JSONL)."""
    decoder = json.JSONDecoder()
    rows, lines, bad = [], [], []
    at = text.index("[") + 1
    while True:
        at = _skip_space(text, at)
        if at >= len(text) or text[at] == "]":
            return rows, lines, bad
        line = text.count("\n", 0, at) + 1
        try:
            row, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError as exc:
            bad.append((line, f"unreadable JSON: {exc.msg} (the rest of the array is not read)"))
            return rows, lines, bad
        if isinstance(row, dict):
            rows.append(row)
            lines.append(line)
        else:
            bad.append((line, "unreadable JSON: not an object"))
        at = _skip_space(text, at)
        if at < len(text) and text[at] == ",":
            at += 1


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t\r\n":
        at += 1
    return at


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
