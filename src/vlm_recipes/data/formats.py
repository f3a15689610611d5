"""The chat files people already have, read as they are and turned into TRL's conversational rows.

Three shapes are read, detected per file and logged once (`data: sharegpt conversations (llava), 6 rows,
8 images`):

- TRL conversational: `messages` (or `prompt` / `chosen` / `rejected`) whose contents are lists of
  `{"type": "image"}` / `{"type": "text", ...}` parts, `images` and `videos` beside them. Contents may also
  be plain strings (text-only turns).
- OpenAI-style `messages` with `role` / `content` strings holding `<image>` and `<video>` placeholders, plus
  `images` / `videos` lists: LLaMA-Factory's sharegpt with OpenAI tags (its `mllm_demo.json`) and
  ms-swift's format (preference rows: a `rejected_response` beside the chosen last turn).
- ShareGPT `conversations` with `from` / `value` (`human`, `gpt`, `system`), placeholders in the strings,
  an `images` list or LLaVA's single `image` (LLaVA-Instruct); preference rows with `chosen` / `rejected`
  turns (LLaMA-Factory's ranking datasets).

A LLaMA-Factory `dataset_info.json` entry may be named instead of a file (`path/dataset_info.json#name`):
its `file_name`, `columns` and `tags` say where the turns are (data/sources.py reads it into ChatTags).

A placeholder becomes an image or video part where it stands in the text, and the text around it is kept
as it is (LLaMA-Factory puts the image tokens in place of `<image>` the same way), so the same row in
either form gives the same tokens.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass, replace

from vlm_recipes.errors import DataError

PLACEHOLDER = re.compile(r"<(image|video)>")
MEDIA = ("image", "video")
# Columns an eval row may carry for the benchmarks' metrics (evaluation/benchmarks.py), read as the common
# datasets ship them: several references (`answers`), a multiple-choice question's options (`options` or
# `choices`, or one column per letter, MMBench's A, B, C, D) and its right one (`answer`), a box
# (`solution`). They only score the eval: what a row trains on is its messages.
EVAL_COLUMNS = ("answers", "answer", "options", "choices", "solution", *string.ascii_uppercase)


@dataclass(frozen=True)
class ChatTags:
    """Where a chat file keeps its turns: the `columns` and `tags` of LLaMA-Factory's dataset_info.json."""

    name: str
    messages: str = "messages"
    role: str = "role"
    content: str = "content"
    user: str = "user"
    assistant: str = "assistant"
    system: str = "system"
    images: str = "images"
    videos: str = "videos"
    system_column: str = "system"  # a system prompt kept in its own column (LLaMA-Factory)
    chosen: str = "chosen"
    rejected: str = "rejected"

    def roles(self) -> dict[str, str]:
        return {self.user: "user", self.assistant: "assistant", self.system: "system"}


OPENAI_STYLE = ChatTags("OpenAI-style messages with <image>/<video> placeholders (LLaMA-Factory, ms-swift)")
SHAREGPT = ChatTags(
    "sharegpt conversations (LLaMA-Factory, LLaVA)",
    messages="conversations",
    role="from",
    content="value",
    user="human",
    assistant="gpt",
)
TRL = "TRL conversational"


@dataclass
class FileFormat:
    """What a file turned out to be: TRL's rows as they are, or a chat shape with its tags."""

    tags: ChatTags | None  # None: TRL conversational

    @property
    def name(self) -> str:
        return TRL if self.tags is None else self.tags.name


class RowError(DataError):
    """A row that cannot be read in its file's format: (reason, detail) as rows.BadRow counts them."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


def detect(rows: list[dict], where: list[str], source: str, tags: ChatTags | None = None) -> FileFormat:
    """The file's format from its rows (a dataset_info.json entry's tags win). Rows in two shapes are a
    DataError naming the first that differs."""
    shapes = ShapeWatch(source, tags)
    for row, at in zip(rows, where, strict=True):
        shapes.see(row, at)
    return shapes.format(rows[0] if rows else None)


class ShapeWatch:
    """A file's format, found from its rows as they are read one by one: the first row that shows a shape
    sets it, and a later row in another shape is a DataError naming both (a dataset_info.json entry's tags
    set it before any row)."""

    def __init__(self, source: str, tags: ChatTags | None = None):
        self.source, self.tags = source, tags
        self.seen: FileFormat | None = FileFormat(tags) if tags is not None else None
        self.first_at = ""

    def see(self, row: dict, at: str) -> None:
        if self.tags is not None or (found := _row_shape(row)) is None:
            return  # text-only string turns read alike in every shape
        if self.seen is None:
            self.seen, self.first_at = found, at
        elif found.name != self.seen.name:
            raise DataError(
                f"{at}: a row in {found.name} form, but {self.first_at} is in {self.seen.name} form: "
                "give every row of a file the same shape"
            )

    def format(self, first_row: dict | None) -> FileFormat:
        """The shape seen, or, where no row showed one, TRL's (text-only turns as strings, read as they are)
        if `first_row` has turns at all."""
        if self.seen is not None:
            return self.seen
        if first_row is not None and not any(
            key in first_row for key in ("messages", "conversations", "prompt")
        ):
            raise DataError(
                f"{self.source}: rows with keys {sorted(first_row)} are in no format the runner reads. "
                "Accepted: TRL conversational (`messages` with content parts), OpenAI-style `messages` with "
                "`<image>` placeholders and an `images` list (LLaMA-Factory, ms-swift), or sharegpt "
                "`conversations` with `from`/`value` (LLaVA); see README, 'Your data'"
            )
        return FileFormat(None)


def _row_shape(row: dict) -> FileFormat | None:
    """The shape one row shows, or None where it could be any (text-only string turns)."""
    turns = row.get("conversations")
    if isinstance(turns, list):
        first = turns[0] if turns and isinstance(turns[0], dict) else {}
        tags = (
            SHAREGPT
            if "from" in first or "value" in first
            else replace(OPENAI_STYLE, messages="conversations")
        )
        return FileFormat(tags)
    for key in ("messages", "prompt", "chosen", "rejected"):
        turns = row.get(key)
        if isinstance(turns, list) and any(
            isinstance(turn, dict) and isinstance(turn.get("content"), list) for turn in turns
        ):
            return FileFormat(None)
    texts = [
        turn.get("content")
        for key in ("messages", "prompt", "chosen", "rejected")
        for turn in (row.get(key) if isinstance(row.get(key), list) else [])
        if isinstance(turn, dict)
    ]
    has_placeholder = any(isinstance(t, str) and PLACEHOLDER.search(t) for t in texts)
    media = has_placeholder or row.get("images") or row.get("videos")
    if "messages" in row and ("rejected_response" in row or media):
        return FileFormat(OPENAI_STYLE)
    return None


def to_trl(row: dict, fmt: FileFormat) -> dict:
    """One row in TRL's conversational form: `messages` (or `prompt`, `chosen`, `rejected`) of content
    parts, `images` (always, maybe empty) and `videos` (when the row has any), `id` kept.

    Raises RowError for a row that cannot be read: an unknown role, a turn that is not text, placeholders
    that disagree in number with the files listed."""
    if fmt.tags is None:
        return _trl_row(row)
    tags = fmt.tags
    media = {"image": _listed(row, tags.images, "image"), "video": _listed(row, tags.videos, "video")}
    turns = row.get(tags.messages)
    if not isinstance(turns, list) or not turns:
        raise RowError("no messages", f"the row needs a `{tags.messages}` list of turns")
    messages = [_message(turn, tags, i) for i, turn in enumerate(turns)]
    system = row.get(tags.system_column)
    if isinstance(system, str) and system and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": [{"type": "text", "text": system}]})
    out: dict = {"id": row["id"]} if "id" in row else {}
    if "rejected_response" in row or tags.chosen in row or tags.rejected in row:
        out.update(_preference(row, messages, tags))
        where = out["prompt"] + out["chosen"] + out["rejected"]
    else:
        out["messages"] = messages
        where = messages
    for kind in MEDIA:
        placed = sum(1 for m in where for p in m["content"] if p["type"] == kind)
        if placed != len(media[kind]):
            listed = tags.images if kind == "image" else tags.videos
            raise RowError(
                f"{kind} count mismatch",
                f"{placed} <{kind}> placeholder(s) in the text but {len(media[kind])} file(s) in "
                f"`{listed}`: put one <{kind}> where each {kind} belongs in the text",
            )
    out["images"] = media["image"]
    if media["video"]:
        out["videos"] = media["video"]
    return out | {key: row[key] for key in EVAL_COLUMNS if key in row and key not in out}


def _trl_row(row: dict) -> dict:
    """TRL rows as they are, text-only string contents as one text part (one Arrow column cannot hold
    strings and lists; the chat templates render both alike) and an `images` list on every row."""
    out = dict(row)
    for key in ("messages", "prompt", "chosen", "rejected"):
        turns = out.get(key)
        if isinstance(turns, list):
            out[key] = [
                {**turn, "content": [{"type": "text", "text": turn["content"]}]}
                if isinstance(turn, dict) and isinstance(turn.get("content"), str)
                else turn
                for turn in turns
            ]
    out["images"] = out.get("images") or []
    return out


def _listed(row: dict, key: str, single: str) -> list:
    """A row's image or video files: a list, or LLaVA's single `image` string."""
    value = row.get(key)
    if value is None and key == f"{single}s":
        value = row.get(single)
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def _message(turn, tags: ChatTags, index: int) -> dict:
    if not isinstance(turn, dict):
        raise RowError("bad turn", f"turn {index} is {type(turn).__name__}, not an object")
    role = tags.roles().get(turn.get(tags.role))
    if role is None:
        known = "/".join(tags.roles())
        raise RowError(
            "unknown role",
            f"turn {index}: `{tags.role}` is {turn.get(tags.role)!r}; this file's roles are {known}"
            " (a dataset_info.json entry's `tags` maps other names)",
        )
    text = turn.get(tags.content)
    if not isinstance(text, str):
        raise RowError(
            "bad turn", f"turn {index}: `{tags.content}` must be a string, got {type(text).__name__}"
        )
    return {"role": role, "content": content_parts(text)}


def content_parts(text: str) -> list[dict]:
    """`"<image>What is it?"` as `[{"type": "image"}, {"type": "text", "text": "What is it?"}]`: each
    placeholder a part where it stands, the text between kept exactly, no empty text parts."""
    parts: list[dict] = []
    at = 0
    for found in PLACEHOLDER.finditer(text):
        if found.start() > at:
            parts.append({"type": "text", "text": text[at : found.start()]})
        parts.append({"type": found.group(1)})
        at = found.end()
    if at < len(text) or not parts:
        parts.append({"type": "text", "text": text[at:]})
    return parts


def _preference(row: dict, messages: list[dict], tags: ChatTags) -> dict:
    """prompt / chosen / rejected from LLaMA-Factory's ranking rows (`chosen` and `rejected` turns after
    the prompt's) or ms-swift's (the chosen answer last in `messages`, `rejected_response` beside it)."""
    if "rejected_response" in row:
        if messages[-1]["role"] != "assistant":
            raise RowError("bad prompt", "with `rejected_response`, the last turn is the chosen answer")
        rejected = row["rejected_response"]
        if not isinstance(rejected, str):
            raise RowError("bad rejected", "`rejected_response` must be a string")
        answer = {"role": "assistant", "content": content_parts(rejected)}
        return {"prompt": messages[:-1], "chosen": messages[-1:], "rejected": [answer]}
    answers = {}
    for key in (tags.chosen, tags.rejected):
        turn = row.get(key)
        if isinstance(turn, str):
            turn = {tags.role: tags.assistant, tags.content: turn}
        if not isinstance(turn, dict):
            raise RowError(f"bad {key}", f"`{key}` must be one assistant turn")
        answers[key] = [_message(turn, tags, len(messages))]
    return {"prompt": messages, "chosen": answers[tags.chosen], "rejected": answers[tags.rejected]}
