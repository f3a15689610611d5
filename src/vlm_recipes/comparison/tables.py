"""Compare runs: a table, comparison.md and a PNG, read from run files only (run.json, metrics.json,
predictions.jsonl).

Runs of one recipe with different seeds are aggregated (mean ± std), and a difference from the best recipe
larger than the seed spread is marked (`spread_marks`), so a difference smaller than the seed noise shows as
such. Runs measured on different eval sets are never put in one table: each eval set gets its own, and the
split is flagged. Only finished runs are compared: a failed, interrupted or still running one is skipped
with the reason (found under a runs directory) or refused (named).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass

from vlm_recipes.benchmark_metrics import METRICS
from vlm_recipes.comparison.answers import (
    ROWS_SHOWN,
    RowAnswers,
    format_answers_markdown,
    format_answers_text,
    side_by_side,
)
from vlm_recipes.comparison.mixture_table import Draw, mixture_line
from vlm_recipes.comparison.run_summary import AT_START, RunSummary

# ---------------------------------------------------------------------------------------------
# Aggregation


@dataclass
class RecipeRow:
    recipe: str
    runs: list[RunSummary]

    def values(self, attr: str) -> list[float]:
        """The runs' known values of a column (`RunSummary.value`: an attribute or a benchmark metric)."""
        return [v for r in self.runs if (v := r.value(attr)) is not None]

    def cell(self, attr: str, fmt: str = "{:.4f}") -> str:
        values = self.values(attr)
        if not values:
            return "-"
        if len(values) == 1:
            return fmt.format(values[0])
        return f"{fmt.format(statistics.mean(values))} ± {fmt.format(statistics.stdev(values))}"


@dataclass
class Comparison:
    groups: dict[str, list[RecipeRow]]  # eval signature → rows
    warnings: list[str]


def compare_runs(runs: list[RunSummary]) -> Comparison:
    by_eval: dict[str, dict[str, list[RunSummary]]] = defaultdict(lambda: defaultdict(list))
    for run in runs:
        by_eval[run.eval_signature or "no eval set"][run.recipe].append(run)
    warnings = []
    if len(by_eval) > 1:
        warnings.append(
            f"runs were evaluated on {len(by_eval)} different eval sets; each gets its own table, never mixed"
        )
    groups = {}
    for signature, recipes in by_eval.items():
        seed_sets = {recipe: sorted({r.seed for r in rs}) for recipe, rs in recipes.items()}
        if len({tuple(s) for s in seed_sets.values()}) > 1:
            listed = "; ".join(f"{recipe}: {', '.join(s)}" for recipe, s in seed_sets.items())
            warnings.append(
                f"recipes were run with different seeds ({listed}): differences may be seed noise"
            )
        groups[signature] = [RecipeRow(recipe, rs) for recipe, rs in sorted(recipes.items())]
    return Comparison(groups, warnings)


# ---------------------------------------------------------------------------------------------
# Which differences are larger than the seed spread

# The columns that say how good a recipe is, and which way is better; the costs (parameters, time, memory)
# are not judged. And each benchmark metric (a score: higher is better), and each method's measures, as its
# runs record them.
HIGHER_IS_BETTER = {
    "train_loss": False,
    "eval_loss": False,
    "exact_match": True,
    "json_f1": True,
}
LOSSES = ("train_loss", "eval_loss")
NOT_JUDGED_LOSSES = ("policy",)  # a GRPO or RLOO stage's policy loss says nothing: lower is not better
SPREAD_RULE = "|mean − best mean| > std + best std, std over seeds"


def mean_std(row: RecipeRow, attr: str) -> tuple[float, float | None]:
    """Mean and sample std over seeds; std None with a single run (no spread known)."""
    values = row.values(attr)
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else None


def spread_marks(rows: list[RecipeRow], attr: str) -> dict[str, str]:
    """Per recipe, how its mean in `attr` stands against the best recipe's: "best"; "beyond" when the
    difference is larger than both seed spreads together (|mean − best mean| > std + best std); "" when
    within the spread, when it or the best ran once (no spread to compare against), or when every recipe
    has the same mean. Losses are compared between recipes whose last stage has the same method only (a DPO
    stage's loss is a preference loss); a GRPO stage's policy loss is not judged; rewards between recipes
    whose rewards sum the same functions with the same weights only."""
    marks = {row.recipe: "" for row in rows}
    comparable: dict[str | None, list[RecipeRow]] = defaultdict(list)
    for row in rows:
        loss = row.runs[0].loss_kind if attr in LOSSES else ""
        kind = row.runs[0].rewards if attr == "eval_reward" else loss
        if row.values(attr) and loss not in NOT_JUDGED_LOSSES:
            comparable[kind].append(row)
    for same in comparable.values():
        marks |= marks_against_best(
            {row.recipe: row.values(attr) for row in same}, higher_is_better(rows, attr)
        )
    return marks


def higher_is_better(rows: list[RecipeRow], attr: str) -> bool:
    """Which way a judged column is better: the fixed columns', a benchmark metric's (higher), or a method's
    measure as its runs record it."""
    if attr in HIGHER_IS_BETTER:
        return HIGHER_IS_BETTER[attr]
    if attr in METRICS:
        return True
    return next(
        r.measure_about[attr]["higher_is_better"] for row in rows for r in row.runs if attr in r.measure_about
    )


def judged(rows: list[RecipeRow], attr: str) -> bool:
    return (
        attr in HIGHER_IS_BETTER
        or attr in METRICS
        or any(attr in r.measure_about for row in rows for r in row.runs)
    )


def marks_against_best(values: dict[str, list[float]], higher_is_better: bool) -> dict[str, str]:
    """`spread_marks` for one set of comparable recipes: each recipe's values over seeds → its mark."""
    stats = {
        recipe: (statistics.mean(v), statistics.stdev(v) if len(v) > 1 else None)
        for recipe, v in values.items()
    }
    marks = {recipe: "" for recipe in values}
    if not stats:
        return marks
    best_mean = (max if higher_is_better else min)(mean for mean, _ in stats.values())
    best = [recipe for recipe, (mean, _) in stats.items() if mean == best_mean]
    if len(best) == len(stats):
        return marks  # one recipe, or all the same: nothing stands out
    best_stds = [stats[recipe][1] for recipe in best]
    # tied best recipes: the widest spread, so a mark never depends on which one is called best
    best_std = None if None in best_stds else max(best_stds)
    for recipe, (mean, std) in stats.items():
        if recipe in best:
            marks[recipe] = "best"
        elif std is not None and best_std is not None and abs(mean - best_mean) > std + best_std:
            marks[recipe] = "beyond"
    return marks


def rewards_note(rows: list[RecipeRow]) -> str:
    """What each GRPO recipe's reward sums, under the table ("" without one); says when they differ."""
    formulas = {
        row.recipe: row.runs[0].rewards for row in rows if row.runs[0].value("eval_reward") is not None
    }
    if not formulas:
        return ""
    listed = "; ".join(f"{recipe}: {formula or 'not recorded'}" for recipe, formula in formulas.items())
    differ = len(set(formulas.values())) > 1
    return f"reward = {listed}" + (" (different rewards: compared only within the same)" if differ else "")


def mixture_draws(rows: list[RecipeRow]) -> list[Draw]:
    """Each stage trained on a mixture, of each recipe's first run (seeds draw the same rows per source)."""
    return [(row.recipe, stage, draw) for row in rows for stage, draw in row.runs[0].mixtures.items()]


def spread_note(rows: list[RecipeRow]) -> str:
    """The legend of the marks under a table ("" with a single recipe: nothing is compared)."""
    if len(rows) < 2:
        return ""
    note = f"(best): best mean in its column; *: differs from the best by more than the seed spread ({SPREAD_RULE})."
    once = [row.recipe for row in rows if len(row.runs) < 2]
    if len(once) == len(rows):
        return (
            note + " One run per recipe: no seed spread to compare the differences against (run --seeds 0,1)."
        )
    if once:
        note += f" Not judged, one run only: {', '.join(once)}."
    return note


# ---------------------------------------------------------------------------------------------
# Tables

# The columns every table has, the costs last. Before the costs, shown_columns puts each benchmark metric some
# run has (a table of SFT recipes has no column of dashes), then each measure of the runs' methods.
COLUMNS = [
    ("recipe", None, None),
    ("runs", None, None),
    ("stages", None, None),
    ("trainable params", "trainable_params", "{:,.0f}"),
    ("train loss", "train_loss", "{:.4f}"),
    ("eval loss", "eval_loss", "{:.4f}"),
    ("exact match", "exact_match", "{:.3f}"),
    ("JSON F1", "json_f1", "{:.3f}"),
    ("time s", "time_s", "{:.1f}"),
    ("samples/s", "samples_per_s", "{:.1f}"),
    ("peak mem GB", "peak_memory_gb", "{:.2f}"),
]


MARKS = {"best": " (best)", "beyond": " *", "": ""}


def measure_columns(rows: list[RecipeRow]) -> list[tuple]:
    """A column per measure of the runs' last stages' methods (their metrics.json's `method.measures`), with
    its value before the stage's first step where a run measured it."""
    about = {key: a for row in rows for r in row.runs for key, a in r.measure_about.items()}
    columns = []
    for key, a in about.items():
        if any(row.values(key + AT_START) for row in rows):
            columns.append((f"{a['heading']} at start", key + AT_START, "{:.3f}"))
        if any(row.values(key) for row in rows):
            columns.append((a["heading"], key, "{:.3f}"))
    return columns


def shown_columns(rows: list[RecipeRow]) -> list[tuple]:
    benchmarks = [
        (m.heading, name, "{:.3f}") for name, m in METRICS.items() if any(r.values(name) for r in rows)
    ]
    costs = next(i for i, c in enumerate(COLUMNS) if c[1] == "time_s")
    return COLUMNS[:costs] + benchmarks + measure_columns(rows) + COLUMNS[costs:]


def table_rows(rows: list[RecipeRow]) -> tuple[list[str], list[list[str]]]:
    """The table's header and cells, a judged column's cells marked against its best (`spread_marks`)."""
    columns = shown_columns(rows)
    marks = {attr: spread_marks(rows, attr) for _, attr, _ in columns[3:] if judged(rows, attr)}
    out = []
    for row in rows:
        cells = [row.recipe, str(len(row.runs)), " → ".join(row.runs[0].stages)]
        for _, attr, fmt in columns[3:]:
            cell = row.cell(attr, fmt)
            cells.append(cell + MARKS[marks[attr][row.recipe]] if attr in marks else cell)
        out.append(cells)
    return [c[0] for c in columns], out


def format_table(rows: list[RecipeRow]) -> str:
    header, body = table_rows(rows)
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(header)]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))
    out = [line, "-" * len(line)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in body]
    return "\n".join(out)


FIRST_RUNS = " of each recipe's first run"


def group_answers(rows: list[RecipeRow], count: int = ROWS_SHOWN) -> list[RowAnswers]:
    """The first `count` eval rows with every stage's answer, of each recipe's first run."""
    return side_by_side([(row.recipe, row.runs[0].run_dir) for row in rows], count)


def format_markdown(comparison: Comparison, png_name: str | None, answer_rows: int = ROWS_SHOWN) -> str:
    lines = ["# Recipe comparison", ""]
    lines += [f"> ⚠ {w}" for w in comparison.warnings] + ([""] if comparison.warnings else [])
    for signature, rows in comparison.groups.items():
        lines += [f"## Eval set `{signature}`", ""]
        header, body = table_rows(rows)
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(r).replace("*", "\\*") + " |" for r in body]
        for note in filter(None, (spread_note(rows), rewards_note(rows))):
            lines += ["", note.replace("*", "\\*")]
        if draws := mixture_draws(rows):
            lines += [""] + [f"- {mixture_line(draw)}".replace("*", "\\*") for draw in draws]
        lines += ["", "Runs: " + ", ".join(f"`{run.run_dir}`" for row in rows for run in row.runs), ""]
        if answers := format_answers_markdown(group_answers(rows, answer_rows), FIRST_RUNS):
            lines += ["### Answers", "", answers, ""]
    lines.append(
        "Values are mean ± std over seeds where a recipe ran more than once. Losses and metrics are "
        "the last stage's (a benchmark's metric, such as VQA acc, the mean over the eval rows it scores); "
        "a DPO stage's eval loss is its preference loss, its exact match scores the "
        "chosen answers; a GRPO stage's losses are its policy loss (not judged), its reward the mean total "
        "reward of completions sampled for the eval prompts (higher is better)."
    )
    if png_name:
        lines += ["", f"![loss curves and metrics]({png_name})"]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# The figure


def format_comparison(comparison: Comparison, answer_rows: int = ROWS_SHOWN) -> str:
    """The text tables (one per eval set), each with its marks' legend and the answers side by side."""
    parts = [f"warning: {w}" for w in comparison.warnings]
    for signature, rows in comparison.groups.items():
        parts += ["", f"Eval set {signature}", format_table(rows)]
        parts += filter(None, (spread_note(rows), rewards_note(rows)))
        parts += [mixture_line(draw) for draw in mixture_draws(rows)]
        if answers := format_answers_text(group_answers(rows, answer_rows), FIRST_RUNS):
            parts += ["", answers]
    return "\n".join(parts)
