"""Preference rows (method: dpo), in TRL's conversational preference format:

    {"prompt":   [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "…"}]}],
     "chosen":   [{"role": "assistant", "content": [{"type": "text", "text": "the right answer"}]}],
     "rejected": [{"role": "assistant", "content": [{"type": "text", "text": "a plausible wrong one"}]}],
     "images":   ["images/0001.png"]}         # paths relative to the data file, one per image part

Checked like SFT rows (rows.py), before the model loads; the length check counts prompt + each answer.

Unpaired rows (method: kto), TRL's unpaired preference format: one answer marked good or bad,

    {"prompt": [...], "completion": [{"role": "assistant", ...}], "label": true, "images": [...]}

or the preference rows above, each pair unpaired before training (chosen: label true; rejected: false), as
TRL's `unpair_preference_dataset` does, with the row's images kept beside both.
"""

from __future__ import annotations

import datasets

from vlm_recipes.data.lengths import LengthCheck, conversation_lengths
from vlm_recipes.data.rows import RowFormat, count_image_parts, images_problem
from vlm_recipes.families.base import Family


def messages_problem(value, key: str, answer: bool) -> str | None:
    if not isinstance(value, list) or not value:
        return f"the row needs a `{key}` list of messages"
    roles = [m.get("role") if isinstance(m, dict) else None for m in value]
    allowed = ("assistant",) if answer else ("system", "user", "assistant")
    if any(r not in allowed for r in roles) or (answer and len(roles) != 1):
        want = "one assistant message" if answer else "system/user/assistant messages"
        return f"`{key}` must hold {want}, got roles {roles}"
    if not answer and roles[-1] != "user":
        return f"`{key}` must end with a user message (the answer follows it), got roles {roles}"
    return None


def answered_row_problem(
    row: dict, answers: tuple[str, ...], kind: str, image_root, allow_remote_images: bool
) -> tuple[str, str] | None:
    """(reason, detail) for a row of a prompt and its `answers` (one assistant message each) that cannot be
    trained on, or None: every part there and well formed, images in the prompt only, one per image part,
    each readable. `kind`: the row formats, as the missing-key message names them."""
    for key, answer in (("prompt", False), *((name, True) for name in answers)):
        if row.get(key) is None:
            return f"no {key}", f"the row needs `{key}` ({kind})"
        if detail := messages_problem(row[key], key, answer):
            return f"bad {key}", detail
    if sum(count_image_parts(row[name]) for name in answers):
        return "image in answer", f"images belong in the prompt, not in {' or '.join(answers)}"
    return images_problem(row, "prompt", image_root, allow_remote_images)


def preference_row_problem(
    row: dict, image_root, allow_remote_images: bool = False
) -> tuple[str, str] | None:
    """(reason, detail) for a preference row that cannot be trained on, or None."""
    kind = "preference rows: prompt, chosen, rejected, images"
    return answered_row_problem(row, ("chosen", "rejected"), kind, image_root, allow_remote_images)


PREFERENCE: RowFormat = (preference_row_problem, ("prompt", "chosen", "rejected", "images"))


def unpaired_row_problem(row: dict, image_root, allow_remote_images: bool = False) -> tuple[str, str] | None:
    """(reason, detail) for a KTO row that cannot be trained on, or None: a preference pair, or a prompt
    with one `completion` and its boolean `label`."""
    if row.get("chosen") is not None or row.get("rejected") is not None:
        return preference_row_problem(row, image_root, allow_remote_images)
    kind = "KTO rows: prompt, completion, label, images; or prompt, chosen, rejected, images"
    if problem := answered_row_problem(row, ("completion",), kind, image_root, allow_remote_images):
        return problem
    if not isinstance(row.get("label"), bool):
        return (
            "bad label",
            f"`label` must be true (a good answer) or false (a bad one), got {row.get('label')!r}",
        )
    return None


UNPAIRED: RowFormat = (
    unpaired_row_problem,
    ("prompt", "completion", "label", "chosen", "rejected", "images"),
)


def unpaired(ds: datasets.Dataset) -> datasets.Dataset:
    """Preference pairs as unpaired rows, each pair's good row (chosen, label true) followed by its bad one
    (rejected, label false), both with the pair's prompt and images; unpaired rows as they are. Our own rather
    than TRL's `unpair_preference_dataset`, whose batched map doubles the rows but not the `images` column
    beside them, and puts every good row before every bad one: read in order, as an eval split is, a batch would
    hold one kind only and KTO's reward margin (good against bad within a batch) would never be measured."""
    if "chosen" not in ds.column_names:
        return ds

    def split_pairs(batch: dict) -> dict:
        twice = {column: [v for value in batch[column] for v in (value, value)] for column in batch}
        answers = zip(batch["chosen"], batch["rejected"], strict=True)
        out = {column: twice[column] for column in ("prompt", "images", "id", "task") if column in batch}
        out["completion"] = [answer for pair in answers for answer in pair]
        out["label"] = [True, False] * len(batch["prompt"])
        return out

    return ds.map(
        split_pairs, batched=True, remove_columns=ds.column_names, desc="unpairing preference pairs"
    )


def _completion_lengths(plain: datasets.Dataset, processor, family: Family, video, remember) -> list[int]:
    """Each unpaired row's prompt + completion (KTO rows hold no video: refused at the row check)."""
    messages = [p + c for p, c in zip(plain["prompt"], plain["completion"], strict=True)]
    return conversation_lengths(plain, messages, processor, family, remember)


def _longer_side(plain: datasets.Dataset, processor, family: Family, video, remember) -> list[int]:
    """Each pair's longer side, prompt + chosen or prompt + rejected (preference rows hold no video: refused
    at the row check)."""
    sides = [
        conversation_lengths(
            plain,
            [p + a for p, a in zip(plain["prompt"], plain[answer], strict=True)],
            processor,
            family,
            remember,
        )
        for answer in ("chosen", "rejected")
    ]
    return [max(c, r) for c, r in zip(*sides, strict=True)]


# KTO's: the rows unpaired (`unpaired`), then each prompt + completion longer than max_length refused:
# KTOTrainer would cut the answer
check_unpaired_lengths = LengthCheck(
    _completion_lengths,
    "row(s) with prompt + completion longer than the stage's max length (raise kto.max_length or "
    "data.max_length, or lower data.max_pixels so images take fewer tokens)",
    rows=unpaired,
)

# DPO's: a pair whose prompt + chosen or prompt + rejected is longer than max_length refused: DPOTrainer would
# cut the answer, comparing truncated log-probabilities
check_preference_lengths = LengthCheck(
    _longer_side,
    "pair(s) with prompt + answer longer than the stage's max length (raise dpo.max_length or "
    "data.max_length, or lower data.max_pixels so images take fewer tokens)",
)
