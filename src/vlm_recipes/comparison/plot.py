"""The comparison's figure (comparison.png: train curves, eval loss, task metrics, each recipe's mean ± std
over seeds); the tables are tables.py's, the files a comparison writes report_page.py's."""

from __future__ import annotations

from pathlib import Path

from vlm_recipes.benchmark_metrics import METRICS
from vlm_recipes.comparison.tables import (
    Comparison,
    RecipeRow,
    mean_std,
    spread_marks,
)

EVERY_EVAL = [("exact_match", "exact match", "o"), ("json_f1", "JSON field F1", "s")]
MEASURE_MARKERS = "^v<>pd"  # the methods' scores (DPO's reward accuracy, GRPO's mean reward, ...), in turn


def task_metrics(rows: list[RecipeRow]) -> list[tuple[str, str, str]]:
    """The panel's metrics, (attribute, label, marker): exact match and JSON field F1, each benchmark metric
    with its own mark, then each measure of the runs' methods where higher is better (a score: DPO's reward
    accuracy, GRPO's mean reward; a distance such as the KL to a teacher is the table's)."""
    about = {key: a for row in rows for r in row.runs for key, a in r.measure_about.items()}
    scores = [
        (key, f"{a['heading']} ({row_method(rows, key)})")
        for key, a in about.items()
        if a["higher_is_better"]
    ]
    markers = (MEASURE_MARKERS * len(scores))[: len(scores)]
    benchmarks = [(name, metric.heading, metric.mark) for name, metric in METRICS.items()]
    measures = [(key, label, marker) for (key, label), marker in zip(scores, markers, strict=True)]
    return EVERY_EVAL + benchmarks + measures


def row_method(rows: list[RecipeRow], key: str) -> str:
    """The methods whose runs measure `key`, upper-cased as the legend names them: "DPO", "GRPO, RLOO"."""
    return ", ".join(
        dict.fromkeys(r.last_method.upper() for row in rows for r in row.runs if key in r.measure_about)
    )


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
    GRPO's mean reward, the benchmarks' metrics). Eval loss and metrics are each recipe's mean ± std over
    seeds on an axis that spans the values (not from 0), so 6.85 against 6.87 shows; the eval-loss panel
    shades the best recipe's mean ± std, and a recipe further from it than the seed spread has `*`."""
    import matplotlib.pyplot as plt

    rows = [row for group in comparison.groups.values() for row in group]
    colors = [f"C{i % 10}" for i in range(len(rows))]
    fig, (curves, losses, tasks) = plt.subplots(1, 3, figsize=(17, 5), dpi=100)
    draw_train_curves(curves, rows, colors)
    _eval_losses(losses, comparison, dict(zip(map(id, rows), colors, strict=True)))
    _task_metrics(tasks, rows, colors)
    for axis in (losses, tasks):  # recipe names slanted, each ending under its own tick
        plt.setp(axis.get_xticklabels(), rotation=25, ha="right", rotation_mode="anchor")
    fig.tight_layout()
    return fig


# The curves drawn on the second axis, not comparable with SFT losses: (RunSummary attribute, line, label).
TWIN_CURVES = [
    ("preference_curve", ":", "DPO loss (dotted)"),
    ("reward_curve", "-.", "GRPO mean reward (dash-dot)"),
]


def draw_train_curves(curves, rows: list[RecipeRow], colors: list[str]) -> None:
    """SFT losses on the left axis, every seed's run drawn, eval losses as diamonds on the same axis; DPO
    losses and GRPO rewards, where a run has them, on a second axis."""
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
            if run.eval_loss_curve:
                steps, values = zip(*run.eval_loss_curve, strict=True)
                curves.plot(steps, values, "D", markersize=5, markerfacecolor="none", **style)
            for boundary in run.stage_boundaries:
                curves.axvline(boundary, color=color, linestyle="--", linewidth=0.8, alpha=0.5)
    title = "train loss" + " and reward" * any(a == "reward_curve" for a, _, _ in twins)
    evals = "; ◇: eval loss" * any(run.eval_loss_curve for run in runs)
    curves.set(
        title=f"{title}\n(dashed: stage boundaries{evals})",
        xlabel="optimizer step, all stages",
        ylabel="SFT loss",
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
        sft = [row for row in group if row.runs[0].loss_kind == "likelihood" and row.values("eval_loss")]
        if not sft:
            continue
        marks = spread_marks(sft, "eval_loss")
        stats = [mean_std(row, "eval_loss") for row in sft]
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
    for attr, label, marker in task_metrics(rows):
        values = [v for row in rows for v in row.values(attr)]
        if any(values):
            shown.append((attr, label, marker))
        elif values:
            zero.append(label)
        elif attr not in METRICS:  # a benchmark metric only an eval whose rows it scores has: not named
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
                mean, std = mean_std(row, attr)
                axis.errorbar(x + shift, mean, yerr=std or 0.0, fmt=marker, color=color, capsize=3)
        axis.plot([], [], marker, color="black", label=label)  # the legend names the markers
    _score_limits(axis, [v for attr, _, _ in shown for row in rows for v in row.values(attr)])
    axis.set_xticks(range(len(rows)), [row.recipe for row in rows])
    if not_shown:
        axis.set_xlabel("not shown: " + "; ".join(not_shown), fontsize=8)
    axis.set_ylabel("score: mean ± std over seeds")
    # the legend beside the panel: over it, it hid points
    axis.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))


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
