"""Answers side by side: for a few eval rows, the reference and each stage's generated answer, read from the
`predictions.jsonl` every stage writes after training (nothing is generated again).

A stage answers once, at its end, so stage N's answers are also the model's answers before stage N+1. The
model before the first stage is not evaluated: that would be one more generation pass over the eval split,
as long as a stage's evaluation.
"""

from __future__ import annotations

import html
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from vlm_recipes.comparison.run_summary import score_labels
from vlm_recipes.files import read_json

ROWS_SHOWN = 3  # eval rows shown side by side by default
TEXT_WIDTH = 100  # an answer's characters on screen (the markdown shows up to MARKDOWN_WIDTH)
MARKDOWN_WIDTH = 400
WHEN = "each stage answers at its end: stage N's answer is the model's before stage N+1"
PICKED = "rows with right and wrong answers first, then rows whose answers differ"


@dataclass
class RowAnswers:
    """One eval row: its question and reference, and what each (run, stage) answered to it."""

    id: str
    task: str | None
    prompt: str
    reference: str
    answers: list[tuple[str, str | None]] = field(default_factory=list)  # (who, answer; None: not asked)
    right: list[bool | None] = field(default_factory=list)  # per answer: exact match (None: not scored)
    scores: list[dict[str, float]] = field(default_factory=list)  # per answer: its record's scores
    images: list[str] = field(default_factory=list)  # where its images and videos are (generation.row_media)
    videos: list[str] = field(default_factory=list)

    def answers_differ(self) -> bool:
        return len({" ".join(a.split()) for _, a in self.answers if a is not None}) > 1


def stage_predictions(run_dir: Path) -> list[tuple[str, dict[str, dict]]]:
    """Per stage of a run, in order: its name and its prediction records by row id (empty when the stage
    wrote none)."""
    stages = []
    for stage in read_json(run_dir / "run.json")["stages"]:
        path = Path(stage["dir"]) / "predictions.jsonl"
        lines = path.read_text().splitlines() if path.is_file() else []
        records = [json.loads(line) for line in lines if line.strip()]
        stages.append((stage["name"], {str(r["id"]): r for r in records}))
    return stages


def side_by_side(runs: list[tuple[str, Path]], rows: int = ROWS_SHOWN) -> list[RowAnswers]:
    """`rows` of the eval rows the first run's last stage answered, each with the answer of every stage of
    every run (`runs`: (label, run directory); a label prefixes the stage's name). A stage evaluated on other
    rows (a DPO stage's preference split) answered a row if it holds the same id, prompt and reference.

    The rows that show what training changed come first (PICKED): those one answer got right and another
    wrong, then those answered differently; within each, one row of every task before a second of any, in
    eval order. A lone stage's answers differ from nothing: its rows are one of every task, in order."""
    if rows <= 0 or not runs:
        return []
    per_run = [(label, stage_predictions(run_dir)) for label, run_dir in runs]
    last_stage = per_run[0][1][-1][1] if per_run[0][1] else {}
    candidates = []
    for r in last_stage.values():
        row = RowAnswers(str(r["id"]), r.get("task"), r.get("prompt") or "", r.get("reference") or "")
        row.images, row.videos = list(r.get("images") or []), list(r.get("videos") or [])
        for label, stages in per_run:
            for name, records in stages:
                record = records.get(row.id)
                same = record is not None and (record.get("prompt") or "", record.get("reference") or "") == (
                    row.prompt,
                    row.reference,
                )
                row.answers.append(
                    (f"{label} / {name}" if label else name, record["output"] if same else None)
                )
                right = (
                    record.get("exact_match") == 1.0
                    if same and record.get("exact_match") is not None
                    else None
                )
                row.right.append(right)
                row.scores.append(
                    {k: record[k] for k in score_labels() if record.get(k) is not None} if same else {}
                )
        rights = {right for right in row.right if right is not None}
        candidates.append((0 if len(rights) == 2 else 1 if row.answers_differ() else 2, row))
    seen: dict[tuple[int, str | None], int] = {}  # (tier, task): rows of that task already ranked in the tier
    ranked = []
    for position, (tier, row) in enumerate(candidates):
        nth = seen[tier, row.task] = seen.get((tier, row.task), -1) + 1
        ranked.append(((tier, nth, position), row))
    return [row for _, row in sorted(ranked, key=lambda pair: pair[0])[:rows]]


def format_scores(scores: dict[str, float]) -> str:
    """An answer's scores by name, e.g. "exact match 0 · VQA acc 0.67 · option acc 1" ("" without one)."""
    labels = score_labels()
    return " · ".join(f"{labels[k]} {round(v, 2):g}" for k, v in scores.items())


def _one_line(text: str, width: int) -> str:
    """An answer on one line: whitespace runs as one space, unprintable characters as �, cut at `width`."""
    flat = "".join(c if c.isprintable() else "\ufffd" for c in " ".join(text.split()))
    if not flat:
        return "(empty)"
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def format_answers_text(rows: list[RowAnswers], whose: str = "", width: int = TEXT_WIDTH) -> str:
    """Per row: `id (task): prompt`, then the reference and each answer, aligned (`whose`: who answered,
    for the title)."""
    if not rows:
        return ""
    who_width = max(len("reference"), *(len(who) for row in rows for who, _ in row.answers))
    lines = [f"Answers{whose} on {len(rows)} eval row(s) ({WHEN}; {PICKED}):"]
    for row in rows:
        lines += ["", f"{row.id}{f' ({row.task})' if row.task else ''}: {_one_line(row.prompt, width)}"]
        lines.append(f"  {'reference'.ljust(who_width)}  {_one_line(row.reference, width)}")
        for (who, answer), scores in zip(row.answers, row.scores, strict=True):
            shown = "(not evaluated on this row)" if answer is None else _one_line(answer, width)
            scored = f"  [{format_scores(scores)}]" if scores else ""
            lines.append(f"  {who.ljust(who_width)}  {shown}{scored}")
    return "\n".join(lines)


def _cell(text: str) -> str:
    """An answer as a markdown table cell: read as text, never as markup (a model's output may hold any)."""
    escaped = re.sub(r"([\\`*_\[\]])", r"\\\1", html.escape(_one_line(text, MARKDOWN_WIDTH)))
    return escaped.replace("|", "&#124;")


def format_answers_markdown(rows: list[RowAnswers], whose: str = "") -> str:
    """One small table per row: the reference, then each answer (and its scores, where it has some)."""
    if not rows:
        return ""
    lines = [f"Answers{whose} on {len(rows)} eval row(s); {WHEN}; {PICKED}.", ""]
    for row in rows:
        task = f" ({row.task})" if row.task else ""
        scored = any(row.scores)
        head = ["| | answer | score |", "|---|---|---|"] if scored else ["| | answer |", "|---|---|"]
        lines += [f"**{html.escape(row.id)}**{task}: {_cell(row.prompt)}", "", *head]
        lines.append(f"| reference | {_cell(row.reference)} |" + " |" * scored)
        for (who, answer), scores in zip(row.answers, row.scores, strict=True):
            shown = "*not evaluated on this row*" if answer is None else _cell(answer)
            lines.append(f"| {who} | {shown} |" + f" {format_scores(scores)} |" * scored)
        lines.append("")
    return "\n".join(lines)
