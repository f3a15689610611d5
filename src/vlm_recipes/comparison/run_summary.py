"""What one finished run's files say (run.json, each stage's metrics.json and report.json), for comparing runs; which runs
under a runs directory are finished. Nothing is computed again: a run is read from its files only."""

from __future__ import annotations

import statistics
import sys
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path

from vlm_recipes.benchmark_metrics import METRICS
from vlm_recipes.errors import RunNotComparable
from vlm_recipes.files import read_json
from vlm_recipes.recipes.schema import DEFAULT_METHOD
from vlm_recipes.runs.manifest import run_state


def score_labels() -> dict[str, str]:
    """Every score an eval row's prediction record may carry, by its heading: exact match, then each
    benchmark metric's (asked when shown: a metric registered after import shows too)."""
    return {"exact_match": "exact match"} | {name: metric.heading for name, metric in METRICS.items()}


AT_START = "@start"  # a measure's column before the last stage's step 1: `eval_reward@start`


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
    time_s: float
    samples_per_s: float | None
    peak_memory_gb: float | None
    eval_signature: str | None
    last_method: str = DEFAULT_METHOD  # the last stage's method
    # what the last stage's losses are (TrainingMethod.loss_kind): likelihood, preference, policy, divergence
    loss_kind: str = "likelihood"
    loss_curve: list[tuple[int, float]] = field(
        default_factory=list
    )  # steps counted across likelihood stages
    preference_curve: list[tuple[int, float]] = field(default_factory=list)  # the DPO and KTO stages' losses
    reward_curve: list[tuple[int, float]] = field(default_factory=list)  # the GRPO stages' mean reward
    stage_boundaries: list[int] = field(default_factory=list)
    rewards: str | None = None  # a GRPO last stage: what its reward sums, e.g. "exact_match + 0.1 length[64]"
    # the last stage's method's measures (TrainingMethod.measures, from its metrics.json: DPO's eval reward
    # accuracy, GRPO's eval reward, a distillation's KL to its teacher): key → value at the end and before
    # step 1, and key → {heading, higher_is_better}
    measures: dict[str, float] = field(default_factory=dict)
    measures_at_start: dict[str, float] = field(default_factory=dict)
    measure_about: dict[str, dict] = field(default_factory=dict)
    eval_loss_curve: list[tuple[int, float]] = field(default_factory=list)  # the SFT stages' eval losses
    task_scores: dict[str, dict[str, float]] = field(default_factory=dict)  # task → metric → its score
    source_scores: dict[str, dict[str, float]] = field(default_factory=dict)  # an eval mixture's, per source
    # the last stage's eval_<metric> of each benchmark metric its eval computed (metric → mean over its rows)
    benchmark_scores: dict[str, float] = field(default_factory=dict)
    # stage name → its report.json's data.mixture (each source's share, rows drawn, tokens): the stages
    # trained on a mixture of sources only
    mixtures: dict[str, list[dict]] = field(default_factory=dict)

    def value(self, name: str) -> float | None:
        """A column's value: a benchmark metric's mean, a measure of the last stage's method (`<key>@start`:
        before its step 1), or the attribute (None where not computed)."""
        if name in METRICS:
            return self.benchmark_scores.get(name)
        if name.endswith(AT_START):
            return self.measures_at_start.get(name.removesuffix(AT_START))
        if name in {f.name for f in fields(self)}:
            return getattr(self, name)
        return self.measures.get(name)  # a method's measure, which other runs' methods may not have


def load_run(run_dir: Path) -> RunSummary:
    """A finished run's numbers; RunNotComparable (a ValueError) says why another run has none."""
    status, why = run_state(run_dir)
    if status != "finished":
        raise RunNotComparable(f"{run_dir}: cannot compare this run: {why}")
    manifest = read_json(run_dir / "run.json")
    stage_metrics = [read_json(Path(s["dir"]) / "metrics.json") for s in manifest["stages"]]
    last = stage_metrics[-1]
    methods = [s.get("method", DEFAULT_METHOD) for s in manifest["stages"]]
    kinds = [method_record(m, method)["loss"] for m, method in zip(stage_metrics, methods, strict=True)]
    sampled = kinds[-1] == "policy"  # a GRPO or RLOO last stage: its reward is the measure
    about = method_record(last, methods[-1])["measures"]
    at_start = last.get("eval_at_start") or {}
    curves, boundaries = _curves(kinds, stage_metrics)
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
        time_s=sum(m.get("wall_time_s") or 0.0 for m in stage_metrics),
        samples_per_s=statistics.mean(throughput) if throughput else None,
        peak_memory_gb=max((m for m in memory if m is not None), default=None),
        eval_signature=last.get("eval_signature"),
        last_method=methods[-1],
        loss_kind=kinds[-1],
        loss_curve=curves["likelihood"],
        preference_curve=curves["preference"],
        reward_curve=curves["reward"],
        stage_boundaries=boundaries[:-1],
        rewards=reward_formula(manifest, methods[-1]) if sampled else None,
        eval_loss_curve=curves["likelihood_eval"],
        task_scores=task_scores(last.get("eval") or {}),
        source_scores=task_scores(last.get("eval") or {}, "source:"),
        benchmark_scores={
            name: last[metric.key] for name, metric in METRICS.items() if last.get(metric.key) is not None
        },
        mixtures=training_mixtures(manifest),
        measures={key: last[key] for key in about if last.get(key) is not None},
        measures_at_start={key: at_start[key] for key in about if at_start.get(key) is not None},
        measure_about=about,
    )


def method_record(metrics: dict, name: str) -> dict:
    """What a stage's metrics.json says of its method `name` (its loss kind, its measures). Only for a run
    from before it said are the methods asked (methods.recorded_method: TRL comes with them)."""
    if metrics.get("method"):
        return metrics["method"]
    from vlm_recipes.methods import recorded_method

    return recorded_method(metrics, name)


def training_mixtures(manifest: dict) -> dict[str, list[dict]]:
    """Each stage trained on a mixture → its report.json's `data.mixture` (a stage without report.json, or
    on a single source, has none)."""
    out = {}
    for stage in manifest["stages"]:
        report = Path(stage["dir"]) / "report.json"
        mixture = ((read_json(report) if report.exists() else {}).get("data") or {}).get("mixture")
        if mixture:
            out[stage["name"]] = mixture
    return out


def task_scores(scores: dict, prefix: str = "task:") -> dict[str, dict[str, float]]:
    """The last stage's eval scores per task (`task:<name>` in metrics.json's eval), or per source of an eval
    mixture (`prefix` "source:"): exact match, the JSON field F1 where the group's references are JSON, and
    each benchmark metric that scored some of its rows."""
    out = {}
    for name, entry in scores.items():
        if name.startswith(prefix):
            out[name.removeprefix(prefix)] = (
                {"exact_match": entry["exact_match"]}
                | ({"json_f1": entry["json_fields"]["f1"]} if entry.get("json_fields") else {})
                | {m: entry[m] for m in METRICS if entry.get(m) is not None}
            )
    return out


def reward_formula(manifest: dict, method: str) -> str | None:
    """The last stage's rewards as its recipe names them in its `method`'s section, weighted: "exact_match +
    json_f1 + 0.1 length[64]" (None when run.json does not record the recipe). Two GRPO recipes' rewards
    compare only when equal."""
    stages = (manifest.get("resolved_recipe") or {}).get("stages") or []
    last = stages[-1] if stages else {}
    rewards = (last.get(last.get("method", method)) or {}).get("rewards")
    if not rewards:
        return None
    parts = []
    for reward in rewards:
        setting = reward.get("pattern") or reward.get("target_length")
        term = reward["name"] + (f"[{setting}]" if setting is not None else "")
        weight = reward.get("weight", 1.0)
        parts.append(term if weight == 1.0 else f"{weight:g} {term}")
    return " + ".join(parts)


def _curves(
    kinds: list[str], stage_metrics: list[dict]
) -> tuple[dict[str, list[tuple[int, float]]], list[int]]:
    """Per loss kind, its stages' curve with steps counted across all stages: the loss of SFT stages
    ("likelihood", and their eval loss, "likelihood_eval"), of DPO and KTO stages ("preference"), of a
    distillation ("divergence"), the mean reward of GRPO and RLOO stages ("reward": their policy loss says
    nothing beside a likelihood); and the step at which each stage ends."""
    curves: dict[str, list[tuple[int, float]]] = defaultdict(list)
    offset, boundaries = 0, []
    for kind, metrics in zip(kinds, stage_metrics, strict=True):
        if kind == "policy":
            points = metrics.get("reward_curve") or []
            curves["reward"] += [
                (offset + p["step"], p["reward"]) for p in points if p.get("reward") is not None
            ]
        else:
            curves[kind] += [(offset + p["step"], p["loss"]) for p in metrics["loss_curve"]]
            if kind == "likelihood":
                curves["likelihood_eval"] += [
                    (offset + p["step"], p["loss"]) for p in metrics.get("eval_loss_curve", [])
                ]
        offset += metrics["steps"]
        boundaries.append(offset)
    return curves, boundaries


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
