"""Multiple-choice accuracy (MMBench, MMMU, ScienceQA): the official reader's port and the metric,
scoring the rows with options. Standard library only; tests/test_paper_metrics.py checks the port."""

from __future__ import annotations

import re
import string
from collections.abc import Mapping

from vlm_recipes.benchmark_metrics.metric import BenchmarkMetric

# Multiple choice: open-compass/VLMEvalKit vlmeval/utils/matching_util.py at
# e8e78f05f3080fe28154f2130321f17951c3be94 (can_infer_option, can_infer_text, can_infer; the file last
# changed in 2cf2a36c6e79b51faf676a7011b3a0f5b579814d).

_REFUSALS = (
    "Sorry, I can't help with images of people yet.",
    "I can't process this file.",
    "I'm sorry, but without the image provided",
    "Cannot determine the answer",
)
_API_FAILURE = "Failed to obtain answer via API"
_SEPARATORS = ".()[],:;!*#{}"
# Added in VLMEvalKit a67ace5 ("Match verbose Chain-of-Thought in eval"). It has no word boundary after the
# letter, so "the answer is clear" reads as C and "the answer is a cat" as A, when those are options. Kept.
_VERBOSE_ANSWER = re.compile(r"(?i)(?:correct\s+)?answer\s+is\s+\**([ABCD])\**")


def _can_infer_option(answer: str, choices: Mapping[str, str]) -> str | None:
    """can_infer_option: an option letter standing alone among the answer's last four words (after
    .()[],:;!*#{} become spaces), when exactly one letter does; "Z" for a refusal or a lone Z; then the
    "answer is X" pattern."""
    if _API_FAILURE in answer:
        return None
    if any(refusal in answer for refusal in _REFUSALS):
        return "Z"
    answer_mod = answer
    for c in _SEPARATORS:
        answer_mod = answer_mod.replace(c, " ")
    splits = [x.strip() for x in answer_mod.split()]
    count = sum(1 for c in choices if c in splits)
    if count == 1:
        # The official code first returns False (no letter) when "A" is a word of a 4+ word answer, a
        # quantifier more likely than an option, but only with the VERBOSE environment variable set (to
        # anything, "0" too); VLMEvalKit runs without it, and so does this port: "A cat" reads as A.
        for ch in choices:
            if ch in splits and splits.index(ch) > (len(splits) - 5):
                return ch
    elif count == 0 and "Z" in splits:  # official: count_choice(splits, {'Z', ''}) == 1
        return "Z"
    match = _VERBOSE_ANSWER.search(answer or "")
    if match and match.group(1).upper() in choices:
        return match.group(1).upper()
    return None


def _can_infer_text(answer: str, choices: Mapping[str, str]) -> str | None:
    """can_infer_text: the one option whose text (lowercased) is in the lowercased answer, a substring
    ("cat" is in "category"); none when several are, or when the answer is over twice the options' text."""
    answer = answer.lower()
    if len(answer) > 2 * sum(len(str(v)) for v in choices.values()):
        return None
    # The official code lowercases the caller's dict in place; this works on a copy.
    texts = {k: str(v).lower() for k, v in choices.items()}
    candidates = [k for k, text in texts.items() if text in answer]
    return candidates[0] if len(candidates) == 1 else None


def _lone_letter(answer: str, choices: Mapping[str, str]) -> str | None:
    """The departure: an answer that is one option letter and nothing else, in lower case ("b", "(b)", "b.")."""
    for c in _SEPARATORS:
        answer = answer.replace(c, " ")
    words = answer.split()
    letter = words[0].upper() if len(words) == 1 and len(words[0]) == 1 else None
    return letter if letter in choices else None


def option_letter(answer: str, options: Mapping[str, str]) -> str | None:
    """The option a multiple-choice answer picks, as VLMEvalKit's can_infer(answer, choices) reads it (its
    "exact matching" step, before any LLM judge): a letter ("B", "(B)", "The answer is (B).") first, else
    the one option whose text the answer contains. None where it cannot tell (VLMEvalKit's False: several
    letters or option texts, none, or a long answer); "Z" where the answer refuses ("Cannot determine the
    answer") or says Z, VLMEvalKit's "no option", which matches no option letter A-Y.

    One departure: where can_infer reads nothing, an answer that is a lone lowercase option letter ("b",
    "(b)", "b.") reads as that option. VLMEvalKit (e8e78f0) upper-cases no answer before can_infer (only its
    "answer is x" pattern's letter, a67ace5); a lowercase letter reads as an option only through its LLM judge,
    and without one scores Z, wrong. Answers of more words read as there: "a cat" is option text "cat"
    (B), not the letter A, and "A cat" is A.

    `options`: {"A": "dog", "B": "cat", ...}, the keys single capital letters (the official code asserts so,
    here a ValueError)."""
    if not all(isinstance(k, str) and len(k) == 1 and k in string.ascii_uppercase for k in options):
        raise ValueError(
            f"option keys are single capital letters (A, B, ...), not {sorted(map(str, options))}"
        )
    answer = str(answer)
    return (
        _can_infer_option(answer, options)
        or _can_infer_text(answer, options)
        or _lone_letter(answer, options)
    )


def option_accuracy(prediction: str, correct_letter: str, options: Mapping[str, str]) -> float:
    """1.0 where `option_letter` reads the prediction as the correct option, else 0.0 (VLMEvalKit scores an
    answer it cannot read as "Z", wrong, when no LLM judge is used). MMBench's circular evaluation (every
    rotation of the options right) is a later aggregation over rows, not this."""
    return float(option_letter(prediction, options) == correct_letter)


OPTION_ACCURACY = BenchmarkMetric(
    name="option_accuracy",
    heading="option acc",
    needs="options (`options`, `choices`, or A, B, ... columns)",
    scores_row=lambda targets: targets.options is not None,
    score=lambda answer, targets, _box: option_accuracy(answer, targets.correct, targets.options),
    by_default=True,  # a row with options is a multiple-choice question
    mark="h",
)
