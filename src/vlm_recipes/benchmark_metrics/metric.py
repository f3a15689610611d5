"""What a benchmark metric is (BenchmarkMetric: everything the eval, the tables and the figure ask of it) and
what an eval row carries for the metrics (Targets, read from the row by evaluation/benchmarks.row_targets).
Standard library only: recipes/schema.py asks the registry for the names data.eval_metrics takes."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from vlm_recipes.scoring import parse_json_object

Box = tuple[float, float, float, float]


@dataclass(frozen=True)
class Targets:
    """What one eval row carries for the metrics: its reference answer (the assistant turn, or a prompt
    row's solution), its `answers`, its options with the right one's letter, its reference box."""

    reference: str
    references: tuple[str, ...] = ()
    options: Mapping[str, str] | None = None
    correct: str | None = None
    box: Box | None = None
    box_in_pixels: bool = False  # a `solution` box: pixels of the row's image (the iou reward's reading)

    @property
    def is_json(self) -> bool:
        """The reference is a JSON object: JSON field F1 scores the row (scoring.score_predictions)."""
        return self.reference.strip().startswith("{") and parse_json_object(self.reference) is not None

    @property
    def answers(self) -> list[str]:
        """The row's `answers`, else its answer: what a metric takes the best over (pix2struct's
        aggregate_metrics)."""
        return list(self.references) or [self.reference]


def references_of(value) -> list[str]:
    """Reference answers as a list of strings, from a list of strings or of VQAv2-style answer dicts
    ({"answer": "2", "answer_confidence": "yes", "answer_id": 1}); a single string is one reference."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, Mapping) or not isinstance(value, Sequence):
        raise TypeError(
            f"references: a list of strings or of {{'answer': ...}} dicts, not {type(value).__name__}"
        )
    answers = []
    for item in value:
        if isinstance(item, str):
            answers.append(item)
        elif isinstance(item, Mapping) and isinstance(item.get("answer"), str):
            answers.append(item["answer"])
        else:
            raise TypeError(f"a reference answer is a string or an {{'answer': str}} dict, not {item!r}")
    return answers


def no_advice(targets: Sequence[Targets]) -> str:
    return ""


@dataclass(frozen=True)
class BenchmarkMetric:
    """One benchmark metric, all of it: the eval scores each row by it (evaluation/benchmarks.py),
    metrics.json and run.json keep its mean as `eval_<name>`, and the end-of-run table, `compare`, the
    pages and the figure show it under its heading and mark. A score in [0, 1], higher is better: the
    comparison marks the best recipe by it, and the figure draws it on the task-metric panel."""

    name: str  # what data.eval_metrics names; each scored row's key in predictions.jsonl
    heading: str  # its column in the tables, its entry in the pages and the figure's legend
    needs: str  # what a row needs for it, as the eval-metrics decision and its errors say it
    scores_row: Callable[[Targets], bool]  # whether a row carries what it needs
    # an answer's score on a row it scores; the box: the answer's, converted to the reference's frame where
    # the reference box is a `solution` in pixels (None: read the answer as written)
    score: Callable[[str, Targets, Box | None], float]
    by_default: bool  # chosen, data.eval_metrics unset, where some eval row carries what it needs
    mark: str  # its matplotlib marker on the figure's task-metric panel
    # asked for, and no row carries what it needs: what to do instead, from what the rows do carry
    advice: Callable[[Sequence[Targets]], str] = no_advice

    @property
    def key(self) -> str:
        """Its mean's key in metrics.json and run.json's stage summary."""
        return f"eval_{self.name}"
