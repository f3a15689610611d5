"""ChartQA's relaxed accuracy: the official scorer's port and the metric, the best over a row's
`answers`, else its answer (pix2struct's aggregate_metrics). Standard library only;
tests/test_paper_metrics.py checks the port."""

from __future__ import annotations

from vlm_recipes.benchmark_metrics.metric import BenchmarkMetric

# Relaxed accuracy: google-research/pix2struct pix2struct/metrics.py at
# 945f27e936c9464d9d7c133f1bd1f4f383be9e99 (relaxed_correctness; ChartQA, Masry et al. 2022, section 5.1).


def _to_float(text: str) -> float | None:
    """relaxed_correctness's _to_float: a trailing "%" divides by 100 (on either side); Python's float()
    otherwise, so " 12", "1e3" and "1_000" are numbers and "1,000", "$5" and "10 minutes" are not."""
    try:
        if text.endswith("%"):
            return float(text.rstrip("%")) / 100.0
        return float(text)
    except ValueError:
        return None


def relaxed_accuracy(prediction: str, reference: str, max_relative_change: float = 0.05) -> float:
    """ChartQA relaxed accuracy of one answer, 1.0 or 0.0, as pix2struct's relaxed_correctness(target,
    prediction): where both parse as numbers and the reference is not zero, |prediction - reference| /
    |reference| <= 5%; otherwise the two strings equal after lowercasing (no stripping, no other
    normalization). "31%" is 0.31: it matches "0.31" and not "31".

    One departure: a reference of 0 and an answer that parses as 0 ("0.0", "-0", "0%") score 1, numbers
    equal as numbers. pix2struct (every commit to 945f27e), lmms-eval's chartqa (75571cf) and VLMEvalKit
    (e8e78f0) compare them as text there, to avoid dividing by 0, and score "0.0" against "0" wrong; the
    paper's rule ("within 5% of the gold answer", Masry et al. 2022, 5.1) scores it right.
    Qwen-VL's evaluate_vqa.py (and code copied from it) passes the model's answer as `target`, so its
    relative error is over the answer, not the reference: 95.1 against 100 passes here (4.9%) and fails
    there (5.15%)."""
    prediction_float = _to_float(prediction)
    target_float = _to_float(reference)
    if prediction_float is not None and target_float:
        relative_change = abs(prediction_float - target_float) / abs(target_float)
        return float(relative_change <= max_relative_change)
    if prediction_float is not None and target_float == 0:  # the departure: 0 within 5% of 0 is 0 alone
        return float(prediction_float == 0)
    return float(prediction.lower() == reference.lower())


RELAXED_ACCURACY = BenchmarkMetric(
    name="relaxed_accuracy",
    heading="relaxed acc",
    needs="a reference answer",
    scores_row=lambda targets: True,
    score=lambda answer, targets, _box: max(relaxed_accuracy(answer, r) for r in targets.answers),
    # every row has an answer, and no column tells a chart question from another: asked for by name
    by_default=False,
    mark="X",
)
