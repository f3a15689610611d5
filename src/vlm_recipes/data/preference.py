"""Preference rows (method: dpo), in TRL's conversational preference format:

    {"prompt":   [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "…"}]}],
     "chosen":   [{"role": "assistant", "content": [{"type": "text", "text": "the right answer"}]}],
     "rejected": [{"role": "assistant", "content": [{"type": "text", "text": "a plausible wrong one"}]}],
     "images":   ["images/0001.png"]}         # paths relative to the data file, one per image part

Checked like SFT rows (rows.py), before the model loads; the length check counts prompt + each answer.
"""

from __future__ import annotations

import datasets

from vlm_recipes.data.lengths import lengths_within, sample_lengths
from vlm_recipes.data.rows import (
    RowFormat,
    count_image_parts,
    image_problem,
    undecoded,
)
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


def preference_row_problem(
    row: dict, image_root, allow_remote_images: bool = False
) -> tuple[str, str] | None:
    """(reason, detail) for a preference row that cannot be trained on, or None."""
    for key, answer in (("prompt", False), ("chosen", True), ("rejected", True)):
        if row.get(key) is None:
            return f"no {key}", f"the row needs `{key}` (preference rows: prompt, chosen, rejected, images)"
        if detail := messages_problem(row[key], key, answer):
            return f"bad {key}", detail
    images = row.get("images") or []
    placeholders = count_image_parts(row["prompt"])
    if count_image_parts(row["chosen"]) + count_image_parts(row["rejected"]):
        return "image in answer", "images belong in the prompt, not in chosen or rejected"
    if placeholders != len(images):
        return "image count mismatch", f"{placeholders} image parts in prompt but {len(images)} images"
    for image in images:
        if problem := image_problem(image, image_root, allow_remote_images):
            return problem
    return None


PREFERENCE: RowFormat = (preference_row_problem, ("prompt", "chosen", "rejected", "images"))


def check_preference_lengths(
    ds: datasets.Dataset,
    processor,
    family: Family,
    max_length: int | None,
    source: str,
    on_bad_sample: str = "fail",
    video=None,  # preference rows hold no video (refused at the row check)
) -> tuple[datasets.Dataset, list[int], dict[str, int]]:
    """Refuse pairs whose prompt + chosen or prompt + rejected is longer than max_length (image tokens
    counted): DPOTrainer would cut the answer, comparing truncated log-probabilities.

    Returns the dataset (without too-long rows under `skip`), each row's longer side, and the skip count."""

    def longer_side(rows: datasets.Dataset) -> list[int]:
        plain = undecoded(rows)
        images = plain["images"] if "images" in plain.column_names else [[]] * len(plain)
        sides = []
        for answer in ("chosen", "rejected"):
            messages = [p + a for p, a in zip(plain["prompt"], plain[answer], strict=True)]
            both = datasets.Dataset.from_dict({"messages": messages, "images": images})
            sides.append(sample_lengths(both, processor, family))
        return [max(c, r) for c, r in zip(*sides, strict=True)]

    return lengths_within(
        ds,
        longer_side,
        max_length,
        source,
        on_bad_sample,
        "pair(s) with prompt + answer longer than the stage's max length (raise dpo.max_length or "
        "data.max_length, or lower data.max_pixels so images take fewer tokens)",
    )
