"""Prompt rows (method: grpo or rloo), in TRL's conversational prompt format, with the answer the rewards check:

    {"prompt":   [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "…"}]}],
     "solution": "the checkable answer",          # read by exact_match / json_f1 and by the eval
     "images":   ["images/0001.png"]}             # paths relative to the data file, one per image part

Every other column (a `task`, a bounding box, ...) reaches the reward functions as a keyword argument, as
TRL passes it. Checked like SFT rows (rows.py), before the model loads; the length check counts the prompt's
image tokens exactly, as TRL renders it (chat template with the generation prompt). A prompt too long is a
data error: GRPOTrainer would otherwise generate from a prompt cut through its image tokens.
"""

from __future__ import annotations

import datasets

from vlm_recipes.data.lengths import LengthCheck, conversation_lengths
from vlm_recipes.data.preference import messages_problem
from vlm_recipes.data.rows import ALL_COLUMNS, RowFormat, images_problem
from vlm_recipes.families.base import Family


def prompt_row_problem(row: dict, image_root, allow_remote_images: bool = False) -> tuple[str, str] | None:
    """(reason, detail) for a prompt row that cannot be trained on, or None."""
    if row.get("prompt") is None:
        return "no prompt", "the row needs `prompt` (prompt rows: prompt, solution, images)"
    if detail := messages_problem(row["prompt"], "prompt", answer=False):
        return "bad prompt", detail
    if "solution" in row and not isinstance(row["solution"], str):
        return "bad solution", f"`solution` must be text, got {type(row['solution']).__name__}"
    return images_problem(row, "prompt", image_root, allow_remote_images)


PROMPTS: RowFormat = (prompt_row_problem, ALL_COLUMNS)


def generation_prompt_tokens(processor, prompt: list[dict]) -> int:
    """Tokens the chat template adds after the prompt when asked to open the answer (`<|im_start|>assistant\\n`
    for Qwen): the prompt TRL generates from is the template's with add_generation_prompt=True."""
    tokenizer = getattr(processor, "tokenizer", processor)
    text_only = [{**m, "content": [p for p in m["content"] if p.get("type") == "text"]} for m in prompt]
    opened, closed = (
        processor.apply_chat_template(text_only, tokenize=False, add_generation_prompt=asked)
        for asked in (True, False)
    )
    return len(tokenizer(opened)["input_ids"]) - len(tokenizer(closed)["input_ids"])


def _prompt_lengths(plain: datasets.Dataset, processor, family: Family, video, remember) -> list[int]:
    """Each prompt as TRL generates from it (prompt rows with video: not yet; the row check refuses none, the
    family's processor decides)."""
    opened = generation_prompt_tokens(processor, plain[0]["prompt"])
    return [n + opened for n in conversation_lengths(plain, plain["prompt"], processor, family, remember)]


# GRPO's and RLOO's: prompts longer than `max_length` (<method>.max_prompt_length) refused
check_prompt_lengths = LengthCheck(
    _prompt_lengths,
    "prompt(s) longer than grpo.max_prompt_length (rloo.max_prompt_length in an rloo stage; raise it or "
    "data.max_length, or lower data.max_pixels so images take fewer tokens)",
)
