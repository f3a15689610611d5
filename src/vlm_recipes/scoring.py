"""Scoring answers against references: pure functions, tested against hand-computed cases. Used after every
stage (evaluation/generation.py), by GRPO's rewards (methods/rewards.py), and by the comparison, so an answer
is scored the same way everywhere."""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass


def normalize_text(text: str) -> str:
    """Lower case, single spaces, no surrounding punctuation: `Red.` and ` red` are the same answer."""
    return re.sub(r"\s+", " ", text.strip().lower()).strip(" .!?;:,\"'")


THINK_END = "</think>"


def final_answer(text: str) -> str:
    """What a thinking model answers after its reasoning: the text after the last `</think>` (Qwen3.5's
    template opens `<think>` in the generation prompt and trains `<think>\n\n</think>\n\n` before every
    answer, so its generations start `</think>`), else the whole text. Scored as the answer; the rest is
    kept as `thinking` in predictions.jsonl."""
    return text.rsplit(THINK_END, 1)[1].strip() if THINK_END in text else text


def exact_match(prediction: str, reference: str) -> float:
    return float(normalize_text(prediction) == normalize_text(reference))


def parse_json_object(text: str) -> dict | None:
    """The first JSON object in a model's output (models often wrap it in prose or code fences)."""
    start = text.find("{")
    while start != -1:
        depth = 0
        for end in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            if depth == 0:
                try:
                    value = json.loads(text[start : end + 1])
                except json.JSONDecodeError:
                    break
                return value if isinstance(value, dict) else None
        start = text.find("{", start + 1)
    return None


_NUMBER = r"\s*(-?\d+(?:\.\d+)?)\s*"
# A box as models write one: [x1, y1, x2, y2] (JSON, Qwen2.5-VL's "bbox_2d") or (x1,y1),(x2,y2) (Qwen2-VL's
# <|box_start|>(x1,y1),(x2,y2)<|box_end|>); the first one in the text is the answer.
_BOX = re.compile(
    rf"\[{_NUMBER},{_NUMBER},{_NUMBER},{_NUMBER}\]|\({_NUMBER},{_NUMBER}\)\s*,?\s*\({_NUMBER},{_NUMBER}\)"
)


def first_box(text: str) -> tuple[float, float, float, float] | None:
    """The first box in a text, as (x1, y1, x2, y2) with its corners in order; None where there is none."""
    found = _BOX.search(text)
    if found is None:
        return None
    x1, y1, x2, y2 = (float(v) for v in found.groups() if v is not None)
    return min(x1, x2), min(y1, y2), max(x1, x2), max(y1, y2)


def box_iou(a: tuple[float, float, float, float], b: tuple[float, float, float, float]) -> float:
    """Intersection over union of two boxes (x1, y1, x2, y2) in the same coordinates; 0.0 when they do not
    overlap or have no area."""
    width = min(a[2], b[2]) - max(a[0], b[0])
    height = min(a[3], b[3]) - max(a[1], b[1])
    if width <= 0 or height <= 0:
        return 0.0
    intersection = width * height
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - intersection
    return intersection / union if union > 0 else 0.0


def flatten(obj: dict, prefix: str = "") -> dict[str, object]:
    """Nested objects become dotted keys: {"a": {"b": 1}} → {"a.b": 1}."""
    flat: dict[str, object] = {}
    for key, value in obj.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def _as_number(value) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip().replace(",", ""))
        except ValueError:
            return None
    return None


def values_match(predicted, reference, tolerance: float) -> bool:
    """Numbers match within a relative tolerance (at least `tolerance` absolute); anything else as text."""
    ref_num, pred_num = _as_number(reference), _as_number(predicted)
    if ref_num is not None and pred_num is not None:
        return math.isclose(pred_num, ref_num, rel_tol=tolerance, abs_tol=tolerance)
    return normalize_text(str(predicted)) == normalize_text(str(reference))


@dataclass
class FieldCounts:
    true_positive: int = 0
    false_positive: int = 0
    false_negative: int = 0
    parsed: bool = True


def json_field_counts(prediction: str, reference: dict, tolerance: float) -> FieldCounts:
    """Per field: right value → TP; wrong value → FP and FN; missing → FN; extra → FP.
    Unparseable output scores every reference field as missed."""
    ref = flatten(reference)
    parsed = parse_json_object(prediction)
    if parsed is None:
        return FieldCounts(false_negative=len(ref), parsed=False)
    pred = flatten(parsed)
    counts = FieldCounts()
    for key, value in ref.items():
        if key in pred and values_match(pred[key], value, tolerance):
            counts.true_positive += 1
        else:
            counts.false_negative += 1
            counts.false_positive += key in pred
    counts.false_positive += sum(1 for key in pred if key not in ref)
    return counts


def precision_recall_f1(tp: int, fp: int, fn: int) -> dict[str, float]:
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / (tp + fn) if tp + fn else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f1}


def row_exact_match(record: dict) -> float:
    """A prediction record's exact match: its own (the eval's, the best over the row's accepted answers), else
    its output against its reference."""
    scored = record.get("exact_match")
    return float(scored) if scored is not None else exact_match(record["output"], record["reference"])


def score_predictions(records: Iterable[dict], tolerance: float = 0.01, metrics: Iterable[str] = ()) -> dict:
    """Aggregate scores over prediction records (`reference`, `output`, optional `task` and `source`).

    Exact match for every row (row_exact_match); JSON field precision/recall/F1 for rows whose reference is
    a JSON object; the mean of each of `metrics` a record carries a score for (the benchmarks' metrics,
    scored per row by evaluation/benchmarks.py), over the rows that carry one (`rows_scored`). Also broken down per task
    (`task:<name>`) and per source of an eval mixture (`source:<path as the recipe names it>`) when rows
    carry one."""
    metrics = tuple(metrics)
    groups: dict[str, list[dict]] = defaultdict(list)
    for record in records:
        groups["all"].append(record)
        for key in ("task", "source"):
            if record.get(key):
                groups[f"{key}:{record[key]}"].append(record)
    scores = {}
    for name, rows in groups.items():
        entry: dict = {
            "rows": len(rows),
            "exact_match": sum(row_exact_match(r) for r in rows) / len(rows),
        }
        total = FieldCounts()
        json_rows = 0
        for r in rows:
            reference = parse_json_object(r["reference"])
            if reference is None or not r["reference"].strip().startswith("{"):
                continue
            counts = json_field_counts(r["output"], reference, tolerance)
            json_rows += 1
            total.true_positive += counts.true_positive
            total.false_positive += counts.false_positive
            total.false_negative += counts.false_negative
            total.parsed = total.parsed and counts.parsed
            entry.setdefault("_parsed", 0)
            entry["_parsed"] += counts.parsed
        if json_rows:
            entry["json_fields"] = precision_recall_f1(
                total.true_positive, total.false_positive, total.false_negative
            )
            entry["json_fields"]["parse_rate"] = entry.pop("_parsed") / json_rows
            entry["json_fields"]["rows"] = json_rows
        for metric in metrics:
            values = [r[metric] for r in rows if r.get(metric) is not None]
            if values:
                entry[metric] = sum(values) / len(values)
                entry.setdefault("rows_scored", {})[metric] = len(values)
        scores[name] = entry
    return scores


def text_of(content) -> str:
    """A message's text: its string, or its text parts joined."""
    if isinstance(content, str):
        return content
    return " ".join(p.get("text") or "" for p in content if p.get("type") == "text").strip()
