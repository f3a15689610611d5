"""RefCOCO's Acc@0.5: the scorer's port and the metric, scoring the rows with a reference box.
Standard library only (the box reader is scoring.py's); tests/test_paper_metrics.py checks the port."""

from __future__ import annotations

from collections.abc import Sequence

from vlm_recipes.benchmark_metrics.metric import BenchmarkMetric, Box, Targets
from vlm_recipes.scoring import box_iou, first_box

# RefCOCO Acc@0.5: no scorer ships with the dataset; papers count IoU >= 0.5, as lmms-eval's refcoco task
# does (EvolvingLMMs-Lab/lmms-eval lmms_eval/tasks/refcoco/utils_rec.py at
# 75571cfe0fa36ca5ec2e6aa2bb268f9d38295af3: compute_iou, compute_accuracy(threshold=0.5)) and Qwen-VL's
# eval_mm/evaluate_grounding.py (`iou >= 0.5`).


def _box_of(value) -> Box | None:
    """A box from text (the iou reward's reader, scoring.first_box: the first [x1, y1, x2, y2] or
    (x1,y1),(x2,y2)) or from four numbers; its corners in order, as first_box puts them."""
    if isinstance(value, str):
        return first_box(value)
    if isinstance(value, Sequence) and len(value) == 4 and all(isinstance(v, int | float) for v in value):
        x1, y1, x2, y2 = (float(v) for v in value)
        return min(x1, x2), min(y1, y2), max(x1, x2), max(y1, y2)
    raise TypeError(f"a box is text or [x1, y1, x2, y2], not {value!r}")


def box_acc50(predicted_box, reference_box) -> float:
    """RefCOCO Acc@0.5 of one answer: 1.0 where the IoU of the predicted and reference boxes ([x1, y1, x2,
    y2], the same coordinates; or text, read as the iou reward reads it) is >= 0.5, else 0.0. An answer with
    no box scores 0 (lmms-eval reads it as [0, 0, 0, 0], no overlap). Unlike lmms-eval, corners given in the
    wrong order are put in order (first_box's rule), and boxes with no area score 0 rather than dividing by
    zero. A reference with no box is an error."""
    reference = _box_of(reference_box)
    if reference is None:
        raise ValueError(f"the reference has no box: {reference_box!r}")
    predicted = _box_of(predicted_box)
    if predicted is None:
        return 0.0
    return float(box_iou(predicted, reference) >= 0.5)


def _answer_acc50(answer: str, targets: Targets, answer_box: Box | None) -> float:
    """The answer's box converted to the reference's frame where it was, else the answer as written."""
    return box_acc50(list(answer_box) if answer_box is not None else answer, list(targets.box))


BOX_ACC50 = BenchmarkMetric(
    name="box_acc50",
    heading="box Acc@0.5",
    needs="a reference box (a `solution` box, or an answer that is a box)",
    scores_row=lambda targets: targets.box is not None,
    score=_answer_acc50,
    by_default=True,  # a reference box is a grounding question
    mark="*",
)
