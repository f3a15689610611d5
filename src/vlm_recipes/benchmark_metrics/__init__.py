"""The benchmarks' own metrics, one module each: its official scorer's port, what a row needs for it, whether
the eval chooses it by default, its heading and its plot mark (a BenchmarkMetric, metric.py). vqa_accuracy.py
(VQAv2), anls.py (DocVQA), relaxed_accuracy.py (ChartQA), option_accuracy.py (MMBench, MMMU, ScienceQA),
box_acc50.py (RefCOCO). Each port names the file and commit it ports; a comment marks where it departs, and
docs/evaluation.md lists those places.

Everything else asks METRICS below: the recipe's data.eval_metrics, the eval (evaluation/benchmarks.py),
metrics.json, run.json, the end-of-run table, `compare`, the pages and the figure. A new metric is its module
and one entry in METRICS; a plugin or a test calls register_metric instead. Standard library only, so reading
a recipe stays fast."""

from __future__ import annotations

import re

from vlm_recipes.benchmark_metrics.anls import ANLS
from vlm_recipes.benchmark_metrics.box_acc50 import BOX_ACC50
from vlm_recipes.benchmark_metrics.metric import BenchmarkMetric
from vlm_recipes.benchmark_metrics.option_accuracy import OPTION_ACCURACY
from vlm_recipes.benchmark_metrics.relaxed_accuracy import RELAXED_ACCURACY
from vlm_recipes.benchmark_metrics.vqa_accuracy import VQA_ACCURACY

# In the order the tables' columns take
METRICS: dict[str, BenchmarkMetric] = {
    metric.name: metric for metric in (VQA_ACCURACY, ANLS, RELAXED_ACCURACY, OPTION_ACCURACY, BOX_ACC50)
}
# What every eval computes beside them (scoring.score_predictions): data.eval_metrics may name these too
ALWAYS_COMPUTED = ("exact_match", "json_f1")
_NAME = re.compile(r"[a-z][a-z0-9_]*")  # a key of metrics.json (`eval_<name>`) and of an override's list


def register_metric(metric: BenchmarkMetric) -> BenchmarkMetric:
    """Add `metric` after the built-in ones: every eval, table, page and figure from then on shows it. A
    name taken, or one that is not lowercase letters, digits and `_`, is a ValueError."""
    if not _NAME.fullmatch(metric.name):
        raise ValueError(f"a metric's name is lowercase letters, digits and `_`, not {metric.name!r}")
    if metric.name in METRICS or metric.name in ALWAYS_COMPUTED:
        raise ValueError(f"a metric named {metric.name!r} is registered already")
    METRICS[metric.name] = metric
    return metric


def eval_metric_names() -> tuple[str, ...]:
    """What data.eval_metrics may name: the registered metrics, then the two every eval computes."""
    return (*METRICS, *ALWAYS_COMPUTED)
