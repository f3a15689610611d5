"""The benchmarks' own metrics (benchmark_metrics/: one module each) as a stage's eval computes them: what an
eval row carries for them (`row_targets`), which of them an eval computes (`choose_eval_metrics`:
data.eval_metrics, else what the rows carry) and each answer's score by each (`answer_scores`).

A row carries, beside its answer (the assistant turn SFT trains on, the reference exact match reads), the
columns data/formats.EVAL_COLUMNS keeps, as the common datasets ship them:
- several references: `answers`, a list of strings or VQAv2's `{"answer": ...}` dicts. Ten or more, VQAv2's
  annotators: vqa_accuracy. Fewer, a few accepted answers (DocVQA's): exact match takes the best over them
  and the row's answer. anls and relaxed_accuracy take the best over them too, else over the row's answer;
- a multiple-choice question's options: `options` or `choices` (a list, MMMU's text of one, or a mapping
  letter -> text) or one column per letter (MMBench's A, B, C, D); its right option is `answer` (a letter,
  an option's text or, ScienceQA's, the option's index), else the row's answer (a letter or an option's
  text) (option_accuracy);
- a box: the row's `solution` (a grounding prompt row's, in pixels of its image, as the iou reward reads it)
  or its answer when the answer is a box and nothing else (`[x1, y1, x2, y2]`, `(x1,y1),(x2,y2)`,
  `{"bbox_2d": [...]}`: the frame the model is taught), read by scoring.first_box (box_acc50).
Which rows a metric scores, and whether it is chosen by default, is its module's (BenchmarkMetric)."""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Mapping, Sequence

from vlm_recipes.benchmark_metrics import METRICS
from vlm_recipes.benchmark_metrics.metric import Box, Targets, references_of
from vlm_recipes.benchmark_metrics.vqa_accuracy import VQA_ANSWERS
from vlm_recipes.data.formats import EVAL_COLUMNS
from vlm_recipes.errors import DataError
from vlm_recipes.scoring import first_box, normalize_text

LETTERS = tuple(c for c in EVAL_COLUMNS if len(c) == 1)  # A-Z
# a number standing alone (not the 2 of `bbox_2d`)
_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?")


def row_targets(row: Mapping, reference: str, where: str) -> Targets:
    """What `row` (its answer `reference`) carries for the metrics; a DataError naming `where` for a value
    that cannot be read (options whose right one is none of them, `answers` that are not answers)."""
    references = _references(row.get("answers"), where)
    options = _options(row, where)
    correct = _correct(row, options, reference, where) if options else None
    box, in_pixels = _box(row, reference)
    return Targets(reference, references, options, correct, box, in_pixels)


def _missing(value) -> bool:
    """No value: absent, null, or pandas' NaN for an empty cell (MMBench's TSV has no D for 3 options)."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def _references(value, where: str) -> tuple[str, ...]:
    if _missing(value):
        return ()
    try:
        return tuple(references_of(value))
    except TypeError as exc:
        raise DataError(f"{where}: `answers`: {exc}") from exc


def _options(row: Mapping, where: str) -> dict[str, str] | None:
    """The row's options by letter: `options` or `choices`, else its one-letter columns."""
    for key in ("options", "choices"):
        value = row.get(key)
        if _missing(value):
            continue
        if isinstance(value, str):  # MMMU ships its options as a list's text: "['cat', 'dog']"
            try:
                value = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                value = None
        if isinstance(value, Mapping) and all(k in LETTERS for k in value):
            options = {str(k): str(v) for k, v in value.items()}
        elif isinstance(value, Sequence) and not isinstance(value, str) and len(value) <= len(LETTERS):
            options = {letter: str(v) for letter, v in zip(LETTERS, value, strict=False)}
        else:
            raise DataError(
                f"{where}: `{key}` must be a list of options (or a mapping A, B, ... -> option), got "
                f"{row.get(key)!r}"
            )
        return options or None
    options = {c: str(row[c]) for c in LETTERS if not _missing(row.get(c)) and str(row[c]).strip()}
    return options if len(options) >= 2 else None


def _correct(row: Mapping, options: Mapping[str, str], reference: str, where: str) -> str:
    """The right option's letter: `answer` (a letter, an option's text, or its index), else the row's
    answer (a letter or an option's text)."""
    given = row.get("answer")
    column = not _missing(given)
    given = given if column else reference
    letters = list(options)
    if isinstance(given, int) and not isinstance(given, bool):
        if 0 <= given < len(letters):
            return letters[given]
    elif isinstance(given, str):
        letter = given.strip().strip("()").rstrip(".").strip()
        if letter in options:
            return letter
        matching = [k for k, text in options.items() if normalize_text(text) == normalize_text(given)]
        if len(matching) == 1:
            return matching[0]
    source = "its `answer`" if column else "its answer"
    raise DataError(
        f"{where}: {source} {given!r} is neither an option's letter ({', '.join(letters)}) nor one option's "
        "text: give the row its right option as `answer`"
    )


def only_box(text: str) -> Box | None:
    """The box a text is, when it is one and nothing else: its first box (scoring.first_box) where no other
    number stands in it (`{"bbox_2d": [1, 2, 3, 4]}` is a box, `[1, 2, 3, 4] and 5` is not)."""
    box = first_box(text)
    return box if box is not None and len(_NUMBER.findall(text)) == 4 else None


def _box(row: Mapping, reference: str) -> tuple[Box | None, bool]:
    solution = row.get("solution")
    if isinstance(solution, str) and (box := only_box(solution)) is not None:
        return box, True
    return only_box(reference), False


def scored_by(metric: str, targets: Targets) -> bool:
    """Whether a row is scored by a metric: whether it carries what the metric needs (its scores_row)."""
    return METRICS[metric].scores_row(targets)


def choose_eval_metrics(
    requested: Sequence[str] | None, targets: Sequence[Targets], source: str
) -> tuple[list[str], str]:
    """(the metrics the eval computes, why): `requested` (data.eval_metrics), or, unset, each metric chosen by
    default (BenchmarkMetric.by_default) that some row carries what it needs for (ten annotators' `answers`:
    vqa_accuracy; options: option_accuracy; a box: box_acc50); exact match always (the best over a row's few accepted `answers`), and JSON field F1 where references are
    JSON objects. A requested metric no row can be scored by is a DataError."""
    rows = len(targets)
    counts = {m: sum(scored_by(m, t) for t in targets) for m in METRICS}
    if requested is None:
        defaults = [metric for metric in METRICS.values() if metric.by_default]
        chosen = [metric.name for metric in defaults if counts[metric.name]]
        said = [f"{counts[m]} of {rows} rows carry {METRICS[m].needs}: {m}" for m in chosen]
        needs = [metric.needs for metric in defaults]
        either = f"{', '.join(needs[:-1])} or {needs[-1]}" if len(needs) > 1 else "".join(needs)
        why = "data.eval_metrics unset, from what the eval rows carry: " + (
            "; ".join(said) or f"no row carries {either}"
        )
    else:
        chosen = [m for m in METRICS if m in requested]
        for name in chosen:
            if not counts[name]:
                metric = METRICS[name]
                raise DataError(
                    f"data.eval_metrics asks for {name}, but no row of {source} carries {metric.needs} "
                    + metric.advice(targets)
                    + "(docs/evaluation.md, 'The benchmarks' own metrics')"
                )
        partly = [f"{m} on {counts[m]} of {rows} rows" for m in chosen if counts[m] < rows]
        why = "data.eval_metrics" + (
            f" ({', '.join(partly)}: the others lack what it reads)" if partly else ""
        )
    json_f1 = ["json_f1"] if any(t.is_json for t in targets) else []
    few = sum(0 < len(t.references) < VQA_ANSWERS for t in targets)
    exact = "; exact match always" + (
        f", on the {few} of {rows} rows with 1-{VQA_ANSWERS - 1} accepted `answers` (DocVQA's shape) the best "
        "over them: VQA accuracy would need 3 of 10 annotators to agree, and score a perfect answer 0 there"
        if few
        else ""
    )
    return [*chosen, "exact_match", *json_f1], why + exact


def answer_scores(
    answer: str, targets: Targets, metrics: Sequence[str], answer_box: Box | None = None
) -> dict[str, float]:
    """The answer's score by each of `metrics` among the benchmarks' that scores its row (scored_by).
    `answer_box`: the answer's box in the reference's frame where it was converted (a `solution` box is in
    the image's pixels); else the answer's first box, as written."""
    scores: dict[str, float] = {}
    for name in metrics:
        metric = METRICS.get(name)
        if metric is not None and metric.scores_row(targets):
            scores[name] = metric.score(answer, targets, answer_box)
    return scores
