"""run.json: the resolved recipe, library versions, git sha, hardware and seeds; the run's status
(`running`, `finished`, `failed` with the error and its exit code, `interrupted`), per-stage summaries, and
the table printed at the end. `run_state` tells a run killed outright from a live one by its lock."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path

from vlm_recipes.decisions import Environment
from vlm_recipes.errors import exit_code_of
from vlm_recipes.files import read_json, write_json
from vlm_recipes.recipes.load import recipe_to_dict
from vlm_recipes.recipes.schema import BENCHMARK_METRICS, Recipe, Stage
from vlm_recipes.runs.layout import FINAL_DIR, RunOptions
from vlm_recipes.runs.lock import describe_holder, describe_writer, lock_is_held, read_lock_holder
from vlm_recipes.versions import library_versions

log = logging.getLogger(__name__)

LIBRARIES = (
    "vlm-recipes",
    "torch",
    "torchvision",
    "transformers",
    "trl",
    "peft",
    "accelerate",
    "datasets",
    "bitsandbytes",
    "tokenizers",
)


ENDED = ("finished", "failed", "interrupted")


def git_sha() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def run_state(run_dir: Path) -> tuple[str, str]:
    """(status, why the run cannot be used; "" when finished), from its run.json and its lock: `running`
    in run.json with nobody holding the lock is a run killed outright (status `dead`)."""
    try:
        manifest = read_json(run_dir / "run.json")
    except (OSError, ValueError) as exc:
        return "unreadable", f"run.json cannot be read ({exc})"
    status = manifest.get("status", "unknown")
    if status == "finished":
        return status, ""
    if status == "failed":
        return status, f"it failed: {manifest.get('error') or 'no error recorded'}"
    if status == "interrupted":
        return status, f"it was interrupted ({manifest.get('error') or 'Ctrl-C'}); continue it with --resume"
    if status != "running":
        return status, f"unexpected status {status!r} in run.json"
    holder = read_lock_holder(run_dir)
    held = lock_is_held(run_dir)
    if held:
        return status, f"it is still running ({describe_writer(holder)})"
    if held is False:
        return "dead", (
            f"it stopped without finishing ({describe_holder(holder)} is gone: killed or crashed); "
            "continue it with --resume"
        )
    return status, "it has not finished (no lock file: still running elsewhere, or stopped without a word)"


def mark_run_ended(
    run_dir: Path, status: str, error: BaseException | str, keep_recorded: bool = False
) -> None:
    """Record in run.json that the run ended early: `failed` with the error, or `interrupted`. With
    `keep_recorded` (a launcher, which only knows its children's exit code), an end a child already
    recorded is kept."""
    try:
        manifest = read_json(run_dir / "run.json")
    except (OSError, ValueError):
        return
    if keep_recorded and manifest.get("status") in ("failed", "interrupted"):
        return
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}".removesuffix(": ")
    code = 1 if isinstance(error, str) else exit_code_of(error)
    manifest.update(status=status, error=text, exit_code=code, ended_at=time.strftime("%Y-%m-%dT%H:%M:%S"))
    try:
        write_json(run_dir / "run.json", manifest)
    except OSError as error:  # a full disk: the process still exits with the error and its code
        log.warning("could not record the run's end in %s: %s", run_dir / "run.json", error)


def write_manifest(recipe: Recipe, run_dir: Path, options: RunOptions, env: Environment) -> dict:
    manifest = {
        "recipe": recipe.name,
        "run_name": run_dir.name,
        "run_dir": str(run_dir),
        "command": " ".join(sys.argv),
        "resolved_recipe": recipe_to_dict(recipe),
        "versions": library_versions(LIBRARIES),
        "git_sha": git_sha(),
        "seeds": sorted({s.training.seed for s in recipe.stages}),
        "hardware": env.describe(),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "status": "running",
        "stages": [],
    }
    previous = run_dir / "run.json"
    if options.resume and previous.exists():  # a continued run keeps its origin
        earlier = read_json(previous)
        manifest["started_at"] = earlier.get("started_at", manifest["started_at"])
        manifest["command"] = earlier.get("command", manifest["command"])
    write_json(previous, manifest)
    return manifest


# The benchmarks' metrics as metrics.json and run.json name them, and as the end-of-run table heads them.
BENCHMARK_KEYS = tuple(f"eval_{m}" for m in BENCHMARK_METRICS)
BENCHMARK_HEADS = {
    "eval_vqa_accuracy": "VQA acc",
    "eval_anls": "ANLS",
    "eval_relaxed_accuracy": "relaxed acc",
    "eval_option_accuracy": "option acc",
    "eval_box_acc50": "box Acc@0.5",
}


# The loss kinds of the methods of runs recorded before metrics.json named them (`method.loss`)
RECORDED_BEFORE = {"dpo": "preference", "kto": "preference", "grpo": "policy", "rloo": "policy"}
# Their measures, likewise: DPO's reward accuracy, GRPO's and RLOO's eval reward
MEASURED_BEFORE = {
    "dpo": {"eval_reward_accuracy": {"heading": "reward acc", "higher_is_better": True}},
    "grpo": {"eval_reward": {"heading": "reward", "higher_is_better": True}},
    "rloo": {"eval_reward": {"heading": "reward", "higher_is_better": True}},
}


def method_record(metrics: dict, method: str) -> dict:
    """What a stage's metrics.json says of its method (TrainingMethod.record): its loss kind and its
    measures; for a run recorded before it said, what its method's were then."""
    return metrics.get("method") or {
        "name": method,
        "loss": RECORDED_BEFORE.get(method, "likelihood"),
        "measures": MEASURED_BEFORE.get(method, {}),
    }


def stage_summary(index: int, stage: Stage, stage_dir: Path, source: str, metrics: dict) -> dict:
    """A stage's line of run.json: where it is, its losses, exact match, the benchmarks' metrics, and its
    method's measures (each with its heading, at the start too where the method measured its start)."""
    at_start = metrics.get("eval_at_start") or {}
    record = method_record(metrics, stage.method)
    return {
        "index": index,
        "name": stage.name,
        "method": stage.method,
        "loss_kind": record["loss"],
        "dir": str(stage_dir),
        "source": source,
        "final_model": str(stage_dir / FINAL_DIR),
        **{
            k: metrics.get(k) for k in ("train_loss", "final_train_loss", "eval_loss", "steps", "wall_time_s")
        },
        "exact_match": ((metrics.get("eval") or {}).get("all") or {}).get("exact_match"),
        "measures": {
            key: {**about, "value": metrics.get(key), "at_start": at_start.get(key)}
            for key, about in record["measures"].items()
        },
        # the benchmarks' metrics the stage's eval computed (data.eval_metrics), each the mean over its rows
        **{key: metrics[key] for key in BENCHMARK_KEYS if metrics.get(key) is not None},
    }


def format_summary(run_dir: Path) -> str:
    """The table printed at the end of a run: per stage its losses, exact match, a column per benchmark
    metric some stage's eval computed, and one per measure of its method (DPO's reward accuracy, GRPO's eval
    reward, ...), as start → end where the stage measured its start."""
    manifest = read_json(run_dir / "run.json")
    stages = manifest["stages"]
    benchmarks = [key for key in BENCHMARK_KEYS if any(s.get(key) is not None for s in stages)]
    measures = {k: m["heading"] for s in stages for k, m in (s.get("measures") or {}).items()}
    header = f"{'#':>2}  {'stage':<20} {'steps':>5} {'train loss':>10} {'eval loss':>9} {'exact match':>11}"
    header += "".join(f" {BENCHMARK_HEADS[key]:>11}" for key in benchmarks)
    header += "".join(f" {heading:>15}" for heading in measures.values()) + f" {'time':>7}"
    lines = [f"Recipe {manifest['recipe']} finished: {len(stages)} stage(s)", "", header, "-" * len(header)]
    for s in stages:
        train_loss, eval_loss = _losses(s)
        line = (
            f"{s['index']:>2}  {s['name']:<20} {s['steps'] or 0:>5} {_num(train_loss):>10} "
            f"{_num(eval_loss):>9} {_num(s.get('exact_match'), 3):>11}"
        )
        line += "".join(f" {_num(s.get(key), 3):>11}" for key in benchmarks)
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
    if stage.get("loss_kind", RECORDED_BEFORE.get(stage.get("method"))) == "policy":
        return None, None
    return stage["final_train_loss"], stage["eval_loss"]


def _num(value, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
