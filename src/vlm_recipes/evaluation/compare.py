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
from pathlib import Path

from vlm_recipes.evaluation.predictions import (
    ROWS_SHOWN,
    RowAnswers,
    format_answers_markdown,
    format_answers_text,
    side_by_side,
)
from vlm_recipes.evaluation.run_summary import RunSummary, load_run

# ---------------------------------------------------------------------------------------------
# Aggregation


@dataclass
class RecipeRow:
    recipe: str
    runs: list[RunSummary]

    def values(self, attr: str) -> list[float]:
        return [getattr(r, attr) for r in self.runs if getattr(r, attr) is not None]

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
# are not judged.
HIGHER_IS_BETTER = {
    "train_loss": False,
    "eval_loss": False,
    "exact_match": True,
    "json_f1": True,
    "reward_accuracy": True,
    "reward_margin": True,
    "reward": True,
}
LOSSES = ("train_loss", "eval_loss")
NOT_JUDGED_LOSSES = ("grpo",)  # a GRPO stage's policy loss is near 0 by construction: lower is not better
SPREAD_RULE = "|mean − best mean| > std + best std, std over seeds"


def _mean_std(row: RecipeRow, attr: str) -> tuple[float, float | None]:
    """Mean and sample std over seeds; std None with a single run (no spread known)."""
    values = row.values(attr)
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else None


def spread_marks(rows: list[RecipeRow], attr: str) -> dict[str, str]:
    """Per recipe, how its mean in `attr` stands against the best recipe's: "best"; "beyond" when the
    difference is larger than both seed spreads together (|mean − best mean| > std + best std); "" when
    within the spread, when it or the best ran once (no spread to compare against), or when every recipe
    has the same mean. Losses are compared between recipes whose last stage has the same method only (a DPO
    stage's loss is a preference loss); a GRPO stage's policy loss is not judged."""
    marks = {row.recipe: "" for row in rows}
    comparable: dict[str, list[RecipeRow]] = defaultdict(list)
    for row in rows:
        method = row.runs[0].last_method if attr in LOSSES else ""
        if row.values(attr) and method not in NOT_JUDGED_LOSSES:
            comparable[method].append(row)
    for same in comparable.values():
        stats = {row.recipe: _mean_std(row, attr) for row in same}
        pick = max if HIGHER_IS_BETTER[attr] else min
        best_mean = pick(mean for mean, _ in stats.values())
        best = [row.recipe for row in same if stats[row.recipe][0] == best_mean]
        if len(best) == len(same):
            continue  # one recipe, or all the same: nothing stands out
        best_stds = [stats[recipe][1] for recipe in best]
        # tied best recipes: the widest spread, so a mark never depends on which one is called best
        best_std = None if None in best_stds else max(best_stds)
        for recipe, (mean, std) in stats.items():
            if recipe in best:
                marks[recipe] = "best"
            elif std is not None and best_std is not None and abs(mean - best_mean) > std + best_std:
                marks[recipe] = "beyond"
    return marks


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

COLUMNS = [
    ("recipe", None, None),
    ("runs", None, None),
    ("stages", None, None),
    ("trainable params", "trainable_params", "{:,.0f}"),
    ("train loss", "train_loss", "{:.4f}"),
    ("eval loss", "eval_loss", "{:.4f}"),
    ("exact match", "exact_match", "{:.3f}"),
    ("JSON F1", "json_f1", "{:.3f}"),
    ("reward acc", "reward_accuracy", "{:.3f}"),
    ("reward margin", "reward_margin", "{:.4f}"),
    ("reward", "reward", "{:.3f}"),
    ("time s", "time_s", "{:.1f}"),
    ("samples/s", "samples_per_s", "{:.1f}"),
    ("peak mem GB", "peak_memory_gb", "{:.2f}"),
]


MARKS = {"best": " (best)", "beyond": " *", "": ""}


def table_rows(rows: list[RecipeRow]) -> list[list[str]]:
    """The table's cells, a judged column's cells marked against its best (`spread_marks`)."""
    marks = {attr: spread_marks(rows, attr) for _, attr, _ in COLUMNS[3:] if attr in HIGHER_IS_BETTER}
    out = []
    for row in rows:
        cells = [row.recipe, str(len(row.runs)), " → ".join(row.runs[0].stages)]
        for _, attr, fmt in COLUMNS[3:]:
            cell = row.cell(attr, fmt)
            cells.append(cell + MARKS[marks[attr][row.recipe]] if attr in marks else cell)
        out.append(cells)
    return out


def format_table(rows: list[RecipeRow]) -> str:
    header = [c[0] for c in COLUMNS]
    body = table_rows(rows)
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
        header = [c[0] for c in COLUMNS]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(r).replace("*", "\\*") + " |" for r in table_rows(rows)]
        if note := spread_note(rows):
            lines += ["", note.replace("*", "\\*")]
        lines += ["", "Runs: " + ", ".join(f"`{run.run_dir}`" for row in rows for run in row.runs), ""]
        if answers := format_answers_markdown(group_answers(rows, answer_rows), FIRST_RUNS):
            lines += ["### Answers", "", answers, ""]
    lines.append(
        "Values are mean ± std over seeds where a recipe ran more than once. Losses and metrics are "
        "the last stage's; a DPO stage's eval loss is its preference loss, its exact match scores the "
        "chosen answers; a GRPO stage's losses are its policy loss (not judged), its reward the mean total "
        "reward of completions sampled for the eval prompts (higher is better)."
    )
    if png_name:
        lines += ["", f"![loss curves and metrics]({png_name})"]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# The figure

TASK_METRICS = [
    ("exact_match", "exact match", "o"),
    ("json_f1", "JSON field F1", "s"),
    ("reward_accuracy", "reward accuracy (DPO)", "^"),
    ("reward", "mean reward (GRPO)", "v"),
]
ONE_METHOD_ONLY = ("reward_accuracy", "reward")  # only a DPO / GRPO last stage has one


def plot_comparison(comparison: Comparison, path: Path) -> Path:
    """Write the comparison figure as a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig = comparison_figure(comparison)
    fig.savefig(path)
    plt.close(fig)
    return path


def comparison_figure(comparison: Comparison):
    """Three panels: train curves (steps counted across stages, stage boundaries dashed; DPO losses and GRPO
    rewards on a second axis); eval loss; task metrics (exact match, JSON field F1, DPO's reward accuracy,
    GRPO's mean reward). Eval loss and metrics are each recipe's mean ± std over seeds on an axis that spans
    the values (not from 0), so 6.85 against 6.87 shows; the eval-loss panel shades the best recipe's mean ±
    std, and a recipe further from it than the seed spread has `*`."""
    import matplotlib.pyplot as plt

    rows = [row for group in comparison.groups.values() for row in group]
    colors = [f"C{i % 10}" for i in range(len(rows))]
    fig, (curves, losses, tasks) = plt.subplots(1, 3, figsize=(15, 4.5), dpi=100)
    _train_curves(curves, rows, colors)
    _eval_losses(losses, comparison, dict(zip(map(id, rows), colors, strict=True)))
    _task_metrics(tasks, rows, colors)
    for axis in (losses, tasks):
        axis.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    return fig


# The curves drawn on the second axis, not comparable with SFT losses: (RunSummary attribute, line, label).
TWIN_CURVES = [
    ("preference_curve", ":", "DPO loss (dotted)"),
    ("reward_curve", "-.", "GRPO mean reward (dash-dot)"),
]


def _train_curves(curves, rows: list[RecipeRow], colors: list[str]) -> None:
    """SFT losses on the left axis; DPO losses and GRPO rewards, where a run has them, on a second axis."""
    runs = [run for row in rows for run in row.runs]
    twins = [(attr, line, label) for attr, line, label in TWIN_CURVES if any(getattr(r, attr) for r in runs)]
    twin = curves.twinx() if twins else None
    for row, color in zip(rows, colors, strict=True):
        for k, run in enumerate(row.runs):
            style = {"color": color, "alpha": 0.9 if k == 0 else 0.35}
            drawn = [(curves, run.loss_curve, "-")] + [(twin, getattr(run, a), line) for a, line, _ in twins]
            label = row.recipe if k == 0 else None
            for axis, points, line in drawn:
                if points:
                    steps, values = zip(*points, strict=True)
                    marker = "." if len(steps) < 30 else None
                    axis.plot(steps, values, line, marker=marker, label=label, **style)
                    label = None  # one legend entry per recipe, on whichever axis its first curve is
            for boundary in run.stage_boundaries:
                curves.axvline(boundary, color=color, linestyle="--", linewidth=0.8, alpha=0.5)
    title = "train loss" + " and reward" * any(a == "reward_curve" for a, _, _ in twins)
    curves.set(
        title=f"{title} (dashed: stage boundaries)", xlabel="optimizer step, all stages", ylabel="SFT loss"
    )
    if twin is not None:
        twin.set_ylabel(", ".join(label for _, _, label in twins))
    handles = [h for axis in (curves, twin) if axis is not None for h in axis.get_legend_handles_labels()[0]]
    if handles:  # on the top axis, where no curve hides it
        (curves if twin is None else twin).legend(handles=handles, fontsize=8)


def _eval_losses(axis, comparison: Comparison, color_of: dict[int, str]) -> None:
    """Per eval set, its SFT recipes' eval loss as mean ± std, the best one's mean ± std shaded across them.
    A DPO last stage's eval loss is a preference loss, a GRPO one's a policy loss: not points beside
    cross-entropies."""
    names: list[str] = []
    for group in comparison.groups.values():
        sft = [row for row in group if row.runs[0].last_method == "sft" and row.values("eval_loss")]
        if not sft:
            continue
        marks = spread_marks(sft, "eval_loss")
        stats = [_mean_std(row, "eval_loss") for row in sft]
        best_mean, best_std = min(stats, key=lambda s: s[0])
        span = [len(names) - 0.4, len(names) + len(sft) - 0.6]
        axis.plot(span, [best_mean] * 2, "--", color="grey", linewidth=0.8)
        if best_std:
            axis.fill_between(
                span, best_mean - best_std, best_mean + best_std, color="grey", alpha=0.15, lw=0
            )
        for row, (mean, std) in zip(sft, stats, strict=True):
            x = len(names)
            axis.errorbar(x, mean, yerr=std or 0.0, fmt="o", color=color_of[id(row)], capsize=4)
            axis.annotate(f"{mean:.4f}", (x, mean), xytext=(7, 0), textcoords="offset points", fontsize=7)
            names.append(row.recipe + (" *" if marks[row.recipe] == "beyond" else ""))
    axis.set(title="eval loss, last stage if SFT (lower is better)")
    if any(name.endswith(" *") for name in names):
        axis.set_xlabel("*: further from the best (band: its mean ± std) than the seed spread", fontsize=8)
    if not names:
        _say(
            axis,
            "no SFT eval loss to show\n(a DPO last stage's is a preference loss,\na GRPO one's a policy loss)",
        )
        return
    axis.set_xticks(range(len(names)), names)
    axis.set_xlim(-0.6, len(names) - 0.2)
    axis.ticklabel_format(axis="y", useOffset=False)  # 6.85, not +6.8 and 0.05
    axis.set_ylabel("mean ± std over seeds (band: best ± std)")


def _task_metrics(axis, rows: list[RecipeRow], colors: list[str]) -> None:
    """Each metric someone scored above 0 as mean ± std per recipe; the others named, not drawn as empty."""
    shown, zero, missing = [], [], []
    for attr, label, marker in TASK_METRICS:
        values = [v for row in rows for v in row.values(attr)]
        if any(values):
            shown.append((attr, label, marker))
        elif values:
            zero.append(label)
        elif attr not in ONE_METHOD_ONLY:
            missing.append(label)
    not_shown = [f"{', '.join(zero)}: 0.000 in every run"] * bool(zero)
    not_shown += [f"{', '.join(missing)}: not measured"] * bool(missing)
    axis.set(title="task metrics on the eval set (higher is better)")
    if not shown:
        _say(axis, "no task metric to show:\n" + "\n".join(not_shown))
        return
    width = 0.6 / len(shown)
    for k, (attr, label, marker) in enumerate(shown):
        shift = (k - (len(shown) - 1) / 2) * width
        for x, (row, color) in enumerate(zip(rows, colors, strict=True)):
            if row.values(attr):
                mean, std = _mean_std(row, attr)
                axis.errorbar(x + shift, mean, yerr=std or 0.0, fmt=marker, color=color, capsize=3)
        axis.plot([], [], marker, color="black", label=label)  # the legend names the markers
    _score_limits(axis, [v for attr, _, _ in shown for row in rows for v in row.values(attr)])
    axis.set_xticks(range(len(rows)), [row.recipe for row in rows])
    if not_shown:
        axis.set_xlabel("not shown: " + "; ".join(not_shown), fontsize=8)
    axis.set_ylabel("score: mean ± std over seeds")
    axis.legend(fontsize=8)


def _score_limits(axis, values: list[float]) -> None:
    """Keep the axis within the scores' range [0, 1] (a std bar may reach past it), except on a side a value
    lies beyond (a GRPO reward is a sum of reward functions: it may exceed 1, or be negative)."""
    low, high = axis.get_ylim()
    axis.set_ylim(low if min(values) < 0 else max(low, -0.05), high if max(values) > 1 else min(high, 1.05))


def _say(axis, text: str) -> None:
    """A panel with nothing to draw says why, instead of staying blank."""
    axis.text(0.5, 0.5, text, ha="center", va="center", transform=axis.transAxes, fontsize=10)
    axis.set_xticks([])
    axis.set_yticks([])


def write_comparison(
    run_dirs: list[Path], out_dir: Path, answer_rows: int = ROWS_SHOWN
) -> tuple[Comparison, Path, Path]:
    """Load runs, compare, write comparison.md and comparison.png into out_dir."""
    comparison = compare_runs([load_run(Path(d)) for d in run_dirs])
    out_dir.mkdir(parents=True, exist_ok=True)
    png = plot_comparison(comparison, out_dir / "comparison.png")
    md = out_dir / "comparison.md"
    md.write_text(format_markdown(comparison, png.name, answer_rows))
    return comparison, md, png


def format_comparison(comparison: Comparison, answer_rows: int = ROWS_SHOWN) -> str:
    """The text tables (one per eval set), each with its marks' legend and the answers side by side."""
    parts = [f"warning: {w}" for w in comparison.warnings]
    for signature, rows in comparison.groups.items():
        parts += ["", f"Eval set {signature}", format_table(rows)]
        if note := spread_note(rows):
            parts.append(note)
        if answers := format_answers_text(group_answers(rows, answer_rows), FIRST_RUNS):
            parts += ["", answers]
    return "\n".join(parts)
