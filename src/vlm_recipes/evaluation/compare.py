"""Compare runs: a table, comparison.md and a PNG, read from run files only (run.json, metrics.json).

Runs of one recipe with different seeds are aggregated (mean ± std), so a difference smaller than the
seed noise shows as such. Runs measured on different eval sets are never put in one table: each eval
set gets its own, and the split is flagged. Only finished runs are compared: a failed, interrupted or
still running one is skipped with the reason (found under a runs directory) or refused (named).
"""

from __future__ import annotations

import statistics
import sys
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from vlm_recipes.errors import RunNotComparable
from vlm_recipes.files import read_json
from vlm_recipes.runs.manifest import run_state


@dataclass
class RunSummary:
    run_dir: Path
    recipe: str
    seed: str
    stages: list[str]
    trainable_params: int  # summed over stages
    train_loss: float | None  # last stage's final logged train loss
    eval_loss: float | None  # last stage's eval loss
    exact_match: float | None
    json_f1: float | None
    reward_accuracy: float | None  # a DPO last stage: chosen scored above rejected on the eval pairs
    reward_margin: float | None
    time_s: float
    samples_per_s: float | None
    peak_memory_gb: float | None
    eval_signature: str | None
    last_method: str = "sft"  # the last stage's method: a dpo stage's losses are preference losses
    loss_curve: list[tuple[int, float]] = field(default_factory=list)  # steps counted across SFT stages
    preference_curve: list[tuple[int, float]] = field(default_factory=list)  # the DPO stages' losses
    stage_boundaries: list[int] = field(default_factory=list)


def load_run(run_dir: Path) -> RunSummary:
    """A finished run's numbers; RunNotComparable (a ValueError) says why another run has none."""
    status, why = run_state(run_dir)
    if status != "finished":
        raise RunNotComparable(f"{run_dir}: cannot compare this run: {why}")
    manifest = read_json(run_dir / "run.json")
    stage_metrics = [read_json(Path(s["dir"]) / "metrics.json") for s in manifest["stages"]]
    last = stage_metrics[-1]
    methods = [s.get("method", "sft") for s in manifest["stages"]]
    curves: dict[str, list[tuple[int, float]]] = {"sft": [], "dpo": []}
    offset, boundaries = 0, []
    for method, metrics in zip(methods, stage_metrics, strict=True):
        curves[method] += [(offset + p["step"], p["loss"]) for p in metrics["loss_curve"]]
        offset += metrics["steps"]
        boundaries.append(offset)
    overall = (last.get("eval") or {}).get("all", {})
    memory = [_peak_gb(m.get("peak_memory")) for m in stage_metrics]
    throughput = [m["train_samples_per_second"] for m in stage_metrics if m.get("train_samples_per_second")]
    return RunSummary(
        run_dir=run_dir,
        recipe=manifest["recipe"],
        seed=",".join(str(s) for s in manifest.get("seeds", [])),
        stages=[s["name"] for s in manifest["stages"]],
        trainable_params=sum(
            sum(r["trainable"] for r in m.get("params_by_role", {}).values()) for m in stage_metrics
        ),
        train_loss=last.get("final_train_loss"),
        eval_loss=last.get("eval_loss"),
        exact_match=overall.get("exact_match"),
        json_f1=(overall.get("json_fields") or {}).get("f1"),
        reward_accuracy=last.get("eval_reward_accuracy"),
        reward_margin=last.get("eval_reward_margin"),
        time_s=sum(m.get("wall_time_s") or 0.0 for m in stage_metrics),
        samples_per_s=statistics.mean(throughput) if throughput else None,
        peak_memory_gb=max((m for m in memory if m is not None), default=None),
        eval_signature=last.get("eval_signature"),
        last_method=methods[-1],
        loss_curve=curves["sft"],
        preference_curve=curves["dpo"],
        stage_boundaries=boundaries[:-1],
    )


def _peak_gb(peak: dict | None) -> float | None:
    if not peak:
        return None
    return peak.get("allocated_gb", peak.get("rss_gb"))


def _say_skipped(run_dir: Path, why: str) -> None:
    print(f"skipped {run_dir}: {why}", file=sys.stderr)


def find_runs(
    output_dir: Path, latest: bool, on_skip: Callable[[Path, str], None] | None = _say_skipped
) -> list[Path]:
    """Finished runs under output_dir (`<recipe>/<run>/run.json`), oldest first; with `latest`, the newest
    finished run per recipe. Each run left out for not being finished is passed to `on_skip` with the
    reason (default: said on stderr); with `latest`, only those newer than the run picked instead."""
    runs = sorted(output_dir.glob("*/*/run.json"), key=lambda p: p.stat().st_mtime)
    finished: list[Path] = []
    skipped: list[tuple[Path, str]] = []
    for path in runs:
        status, why = run_state(path.parent)
        if status == "finished":
            finished.append(path.parent)
        else:
            skipped.append((path.parent, why))
    if latest:
        newest: dict[str, Path] = {}
        for run in finished:
            newest[run.parent.name] = run
        finished = list(newest.values())
        order = {p.parent: i for i, p in enumerate(runs)}
        picked = {run.parent.name: order[run] for run in finished}
        skipped = [(run, why) for run, why in skipped if order[run] > picked.get(run.parent.name, -1)]
    if on_skip is not None:
        for run, why in skipped:
            on_skip(run, why)
    return finished


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
    ("time s", "time_s", "{:.1f}"),
    ("samples/s", "samples_per_s", "{:.1f}"),
    ("peak mem GB", "peak_memory_gb", "{:.2f}"),
]


def table_rows(rows: list[RecipeRow]) -> list[list[str]]:
    out = []
    for row in rows:
        cells = [row.recipe, str(len(row.runs)), " → ".join(row.runs[0].stages)]
        cells += [row.cell(attr, fmt) for _, attr, fmt in COLUMNS[3:]]
        out.append(cells)
    return out


def format_table(rows: list[RecipeRow]) -> str:
    header = [c[0] for c in COLUMNS]
    body = table_rows(rows)
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(header)]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))
    out = [line, "-" * len(line)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in body]
    return "\n".join(out)


def format_markdown(comparison: Comparison, png_name: str | None) -> str:
    lines = ["# Recipe comparison", ""]
    lines += [f"> ⚠ {w}" for w in comparison.warnings] + ([""] if comparison.warnings else [])
    for signature, rows in comparison.groups.items():
        lines += [f"## Eval set `{signature}`", ""]
        header = [c[0] for c in COLUMNS]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(r) + " |" for r in table_rows(rows)]
        lines += ["", "Runs: " + ", ".join(f"`{run.run_dir}`" for row in rows for run in row.runs), ""]
    lines.append(
        "Values are mean ± std over seeds where a recipe ran more than once. Losses and metrics are "
        "the last stage's; a DPO stage's eval loss is its preference loss, its exact match scores the "
        "chosen answers."
    )
    if png_name:
        lines += ["", f"![loss curves and metrics]({png_name})"]
    return "\n".join(lines) + "\n"


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
    """Three panels: train-loss curves (steps counted across stages, stage boundaries dashed), eval loss,
    and task metrics (exact match, JSON field F1, DPO's reward accuracy), with error bars over seeds."""
    import matplotlib.pyplot as plt

    rows = [row for group in comparison.groups.values() for row in group]
    colors = [f"C{i % 10}" for i in range(len(rows))]
    fig, (curves, losses, tasks) = plt.subplots(1, 3, figsize=(15, 4.5), dpi=100)
    preference = curves.twinx() if any(run.preference_curve for row in rows for run in row.runs) else None
    for row, color in zip(rows, colors, strict=True):
        for k, run in enumerate(row.runs):
            style = {"color": color, "alpha": 0.9 if k == 0 else 0.35}
            for axis, points, line in (
                (curves, run.loss_curve, "-"),
                (preference, run.preference_curve, ":"),
            ):
                if points:
                    steps, values = zip(*points, strict=True)
                    marker = "." if len(steps) < 30 else None
                    label = row.recipe if k == 0 and axis is curves else None
                    axis.plot(steps, values, line, marker=marker, label=label, **style)
            for boundary in run.stage_boundaries:
                curves.axvline(boundary, color=color, linestyle="--", linewidth=0.8, alpha=0.5)
    curves.set(
        title="train loss (dashed: stage boundaries)", xlabel="optimizer step, all stages", ylabel="SFT loss"
    )
    if preference is not None:
        preference.set_ylabel("DPO loss (dotted)")
    curves.legend(fontsize=8)

    # A DPO last stage's eval loss is a preference loss: not a bar beside cross-entropies.
    sft_rows = [row for row in rows if row.runs[0].last_method == "sft"]
    means, errors = _mean_and_std(sft_rows, "eval_loss")
    sft_colors = [c for row, c in zip(rows, colors, strict=True) if row in sft_rows]
    losses.bar([r.recipe for r in sft_rows], means, yerr=errors, capsize=4, color=sft_colors)
    losses.set(
        title="eval loss, last stage if SFT (lower is better)", ylabel="loss (error bars: std over seeds)"
    )
    losses.set_ylim(0, max(means, default=1.0) * 1.15 or 1.0)

    names = [r.recipe for r in rows]
    metrics = [("exact_match", "exact match"), ("json_f1", "JSON field F1")]
    if any(row.values("reward_accuracy") for row in rows):
        metrics.append(("reward_accuracy", "reward accuracy (DPO)"))
    width = 0.8 / len(metrics)
    positions = range(len(rows))
    for k, (attr, label) in enumerate(metrics):
        means, errors = _mean_and_std(rows, attr)
        shift = (k - (len(metrics) - 1) / 2) * width
        tasks.bar([p + shift for p in positions], means, width, yerr=errors, capsize=3, label=label)
    tasks.set_xticks(list(positions), names)
    tasks.set(title="task metrics on the eval set (higher is better)", ylim=(0, 1), ylabel="score")
    tasks.legend(fontsize=8)
    for axis in (losses, tasks):
        axis.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    return fig


def _mean_and_std(rows: list[RecipeRow], attr: str) -> tuple[list[float], list[float]]:
    means = [statistics.mean(r.values(attr)) if r.values(attr) else 0.0 for r in rows]
    errors = [statistics.stdev(r.values(attr)) if len(r.values(attr)) > 1 else 0.0 for r in rows]
    return means, errors


def write_comparison(run_dirs: list[Path], out_dir: Path) -> tuple[Comparison, Path, Path]:
    """Load runs, compare, write comparison.md and comparison.png into out_dir."""
    comparison = compare_runs([load_run(Path(d)) for d in run_dirs])
    out_dir.mkdir(parents=True, exist_ok=True)
    png = plot_comparison(comparison, out_dir / "comparison.png")
    md = out_dir / "comparison.md"
    md.write_text(format_markdown(comparison, png.name))
    return comparison, md, png


def format_comparison(comparison: Comparison) -> str:
    parts = [f"warning: {w}" for w in comparison.warnings]
    for signature, rows in comparison.groups.items():
        parts += ["", f"Eval set {signature}", format_table(rows)]
    return "\n".join(parts)
