"""The table printed at the end of a run, from its run.json: per stage its losses, exact match, the
benchmarks' metrics and its method's measures, each headed as `compare` heads it."""

from __future__ import annotations

from pathlib import Path

from vlm_recipes.benchmark_metrics import METRICS
from vlm_recipes.files import read_json


def format_summary(run_dir: Path) -> str:
    """The table printed at the end of a run: per stage its losses, exact match, a column per benchmark
    metric some stage's eval computed, and one per measure of its method (DPO's reward accuracy, GRPO's eval
    reward, ...), as start → end where the stage measured its start."""
    manifest = read_json(run_dir / "run.json")
    stages = manifest["stages"]
    benchmarks = [m for m in METRICS.values() if any(s.get(m.key) is not None for s in stages)]
    measures = {k: m["heading"] for s in stages for k, m in (s.get("measures") or {}).items()}
    header = f"{'#':>2}  {'stage':<20} {'steps':>5} {'train loss':>10} {'eval loss':>9} {'exact match':>11}"
    header += "".join(f" {metric.heading:>11}" for metric in benchmarks)
    header += "".join(f" {heading:>15}" for heading in measures.values()) + f" {'time':>7}"
    lines = [f"Recipe {manifest['recipe']} finished: {len(stages)} stage(s)", "", header, "-" * len(header)]
    for s in stages:
        train_loss, eval_loss = _losses(s)
        line = (
            f"{s['index']:>2}  {s['name']:<20} {s['steps'] or 0:>5} {_num(train_loss):>10} "
            f"{_num(eval_loss):>9} {_num(s.get('exact_match'), 3):>11}"
        )
        line += "".join(f" {_num(s.get(metric.key), 3):>11}" for metric in benchmarks)
        line += "".join(f" {_start_to_end((s.get('measures') or {}).get(key)):>15}" for key in measures)
        lines.append(line + f" {(s['wall_time_s'] or 0):>6.1f}s")
    lines += ["", f"Final model: {manifest['final_model']}", f"Run record:  {run_dir / 'run.json'}"]
    return "\n".join(lines)


def _start_to_end(measure: dict | None) -> str:
    """ "0.391 → 0.520" where the stage measured its start, else the end alone ("-": not measured)."""
    if not measure:
        return "-"
    start, end = measure.get("at_start"), _num(measure.get("value"), 3)
    return end if start is None else f"{_num(start, 3)} → {end}"


def _losses(stage: dict) -> tuple[float | None, float | None]:
    """A stage's final train loss and eval loss, as the table shows them: a policy loss (GRPO, RLOO) is not a
    likelihood, so not shown as one."""
    if stage.get("loss_kind") == "policy":
        return None, None
    return stage["final_train_loss"], stage["eval_loss"]


def _num(value, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
