"""`vlm-recipes eval --lmms-eval TASK RUN`: one lmms-eval task on a stage's final/, the result filed beside
the stage's metrics.

RUN is a run directory (runs/<recipe>/<run-name>: its last finished stage, DONE written and final/ whole) or
a stage directory (its final/). lmms-eval, the optional extra (pip install 'vlm-recipes[lmms-eval]'), runs as
its own process: `python -m lmms_eval --model M --model_args pretrained=<stage>/final --tasks TASK ...`, its
output (results JSON, each sample's answer, lmms-eval.log) under <stage>/lmms-eval/<TASK>/. The metrics are
filed in <stage>/lmms-eval-<TASK>.json (written whole or not at all) and printed. The task's dataset comes
from where its YAML says, mostly the Hugging Face hub, which must be reachable.

What this relies on was read in lmms-eval 0.7.3's source (the PyPI wheel, EvolvingLMMs-Lab/lmms-eval):
- lmms_eval/__main__.py `cli_evaluate`: an error during the evaluation is printed and the process still
  exits 0, so a run counts as failed on a non-zero exit *or* no new results file.
- lmms_eval/loggers/evaluation_tracker.py `save_results_aggregated`: the results are written to
  <output_path>/<model name sanitized: pretrained's last two path parts joined by "__">/<date>_results.json.
- lmms_eval/evaluator.py `evaluate` and evaluator_utils.py `consolidate_results`: that JSON's "results" maps
  each task (and group) to {"alias", "samples", "<metric>,<filter>": value, "<metric>_stderr,<filter>": value
  or "N/A", ...}; "groups" (when shown), "n-samples", "higher_is_better", "config" (with "limit") and "date"
  sit beside it; its "lmms_eval_version" is a git branch@sha ("unknown@unknown" for a pip install), so the
  package's version is taken from its metadata instead.
- lmms_eval/models/__init__.py: the model names (AVAILABLE_SIMPLE_MODELS, AVAILABLE_CHAT_TEMPLATE_MODELS);
  api/model.py `create_from_arg_string`: --model_args is split on "," and "=", and --batch_size and --device
  are handed to the model's constructor beside them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

from vlm_recipes.errors import EXIT_BAD_INPUT, BadInput

INSTALL_HINT = "pip install 'vlm-recipes[lmms-eval]' (in a checkout: pip install -e '.[lmms-eval]')"
OUTPUT_DIR = "lmms-eval"  # <stage>/lmms-eval/<task>/: lmms-eval's own output and its log
LOG_FILE = "lmms-eval.log"
TASK_NAME = re.compile(r"[A-Za-z0-9_.+-]+")  # one task (or group) name: no list, wildcard or path
STAGE_DIR = re.compile(r"stage-(\d+)-.+")  # runs/layout.py stage_dir_name
# transformers' load report, one line per key: `<key> | MISSING |` is a weight the class made anew (its
# answers are not the stage's model), `| UNEXPECTED |` one of final/'s weights it left unread.
LOAD_REPORT = re.compile(r"\|\s*(MISSING|UNEXPECTED)\s*\|")


def lmms_eval_models() -> dict[str, str]:
    """config.json's model_type -> lmms-eval's --model (lmms_eval/models/{simple,chat}/<name>.py in 0.7.3): the
    class that loads a stage's final/ given as `pretrained=`, as each family module names it (its
    `lmms_eval_models`). Each was run on the family's tiny demo model (CPU, transformers 5.24) with all its
    weights loaded, but llama4's."""
    return _by_model_type("lmms_eval_models")


def no_lmms_eval_model() -> dict[str, str]:
    """model_type -> why no lmms-eval 0.7.3 class loads a stage's final/, as the family module says. Its generic
    `huggingface` class (chat/huggingface.py) passes `audios=` to the processor, which transformers 5 refuses."""
    return _by_model_type("no_lmms_eval_model")


def _by_model_type(attribute: str) -> dict[str, str]:
    from vlm_recipes.families import FAMILIES, GENERIC_WITH_KNOWLEDGE

    knowing = (*FAMILIES, *GENERIC_WITH_KNOWLEDGE.values())
    return {
        model_type: value for family in knowing for model_type, value in getattr(family, attribute).items()
    }


def output_dir(stage_dir: Path, task: str) -> Path:
    return stage_dir / OUTPUT_DIR / task


def result_path(stage_dir: Path, task: str) -> Path:
    """Where the result is filed: beside the stage's metrics.json."""
    return stage_dir / f"lmms-eval-{task}.json"


def find_stage(path: Path) -> Path:
    """The stage to evaluate: a run directory's last finished stage, or a stage directory with a whole
    final/. BadInput naming the path and why there is none."""
    from vlm_recipes.runs.layout import DONE_MARKER, FINAL_DIR, is_done, model_dir_problem

    if (path / "run.json").is_file():
        stages = sorted(
            (d for d in path.iterdir() if d.is_dir() and STAGE_DIR.fullmatch(d.name)),
            key=lambda d: int(STAGE_DIR.fullmatch(d.name).group(1)),
        )
        finished = [d for d in stages if is_done(d)]
        if finished:
            return finished[-1]
        why = (
            f"none of its stages finished ({', '.join(d.name for d in stages)}: no {DONE_MARKER}, or "
            f"{FINAL_DIR}/ incomplete)"
            if stages
            else "it has no stage directory yet"
        )
        raise BadInput(f"{path}: no finished stage to evaluate: {why}")
    if (path / FINAL_DIR).is_dir():
        if problem := model_dir_problem(path / FINAL_DIR):
            raise BadInput(f"{path / FINAL_DIR}: not a whole model directory ({problem})")
        return path
    if not path.is_dir():
        raise BadInput(f"{path}: no such directory")
    raise BadInput(f"{path}: neither a run directory (run.json) nor a stage directory (final/)")


def lmms_eval_model_for(model_dir: Path) -> str:
    """lmms-eval's model name for the model in `model_dir`, from its config.json's model_type."""
    config = model_dir / "config.json"
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError) as error:
        raise BadInput(f"{config} cannot be read ({error})") from error
    known = lmms_eval_models()
    if model_type in known:
        return known[model_type]
    why = no_lmms_eval_model().get(model_type, f"vlm-recipes knows {', '.join(sorted(known))}")
    raise BadInput(
        f"{config}: model_type `{model_type}` has no lmms-eval model that loads it ({why}): name one with "
        "--model (`python -m lmms_eval models` lists them)"
    )


def lmms_eval_command(
    stage_dir: Path,
    task: str,
    model: str,
    *,
    limit: float | None = None,
    batch_size: int = 1,
    device: str | None = None,
    include_path: Path | None = None,
    python: str = sys.executable,
) -> list[str]:
    """The lmms-eval command line that evaluates `stage_dir`'s final/ on `task`."""
    from vlm_recipes.runs.layout import FINAL_DIR

    if not TASK_NAME.fullmatch(task):
        raise BadInput(
            f"`{task}`: give one lmms-eval task name (`python -m lmms_eval tasks list` lists them)"
        )
    final = (stage_dir / FINAL_DIR).resolve()
    if "," in str(final) or "=" in str(final):  # lmms-eval splits --model_args on both
        raise BadInput(f"{final}: lmms-eval cannot take a model path with `,` or `=`: move or link the run")
    model_args = f"pretrained={final}"
    if device:  # most classes' device_map defaults to cuda or auto: it follows --device
        model_args += f",device_map={device}"
    command = [python, "-m", "lmms_eval", "--model", model, "--model_args", model_args, "--tasks", task]
    command += ["--batch_size", str(batch_size), "--output_path", str(output_dir(stage_dir, task).resolve())]
    command.append("--log_samples")  # each sample's prompt and answer, beside the results
    if limit is not None:
        command += ["--limit", f"{limit:g}"]
    if device:
        command += ["--device", device]
    if include_path is not None:
        command += ["--include_path", str(include_path.resolve())]
    return command


def results_files(directory: Path) -> dict[Path, float]:
    """lmms-eval's results files under `directory` and their modification times."""
    return {p: p.stat().st_mtime for p in directory.glob("*/*_results.json")}


def new_results(directory: Path, before: dict[Path, float]) -> Path | None:
    """The newest results file written since `before` was taken; None when the run wrote none."""
    written = [p for p, mtime in results_files(directory).items() if before.get(p) != mtime]
    return max(written, key=lambda p: p.stat().st_mtime, default=None)


def split_metrics(entry: dict) -> tuple[dict, dict]:
    """({"<metric>,<filter>": value}, {"<metric>_stderr...,<filter>": value or None}) of one task's entry
    in lmms-eval's "results"; its "alias" and "samples" are left out."""
    values, stderr = {}, {}
    for key, value in entry.items():
        metric, comma, _ = key.partition(",")
        if not comma:
            continue
        if re.search(r"_stderr(_clt|_clustered)?$", metric):
            stderr[key] = None if value == "N/A" else value
        else:
            values[key] = value
    return values, stderr


def result_record(results: dict, task: str, about: dict) -> dict:
    """What is filed for `task` from lmms-eval's results JSON (`results`): `about` (the stage, lmms-eval's
    model and version), then every task and group the JSON holds (a group's subtasks too) with its metrics
    and standard errors, the samples counted, and the --limit they were taken with."""
    per_task = {**results.get("groups", {}), **results["results"]}
    if task not in per_task:
        raise ValueError(f"no `{task}` in its results (it holds {', '.join(per_task) or 'none'})")
    split = {name: split_metrics(entry) for name, entry in per_task.items()}
    return {
        "task": task,
        **about,
        "limit": results.get("config", {}).get("limit"),
        "metrics": {name: values for name, (values, _) in split.items()},
        "stderr": {name: stderr for name, (_, stderr) in split.items() if stderr},
        "samples": results.get("n-samples", {}),
        "higher_is_better": results.get("higher_is_better", {}),
        "date": results.get("date"),
    }


def file_result(
    stage_dir: Path, task: str, results_file: Path, about: dict, command: list[str]
) -> tuple[Path, dict]:
    """Read lmms-eval's results JSON and file its record, with the results file and the command, at
    `result_path(stage_dir, task)`, atomically (files.write_json). (path, record)."""
    from vlm_recipes.files import write_json

    record = result_record(json.loads(results_file.read_text()), task, about)
    record |= {"results_file": str(results_file), "command": command}
    path = result_path(stage_dir, task)
    write_json(path, record)
    return path, record


def format_table(record: dict) -> str:
    """The filed metrics, one line each: task, metric (with its filter unless `none`), value, ± stderr."""

    def shown(value) -> str:
        return f"{value:.4g}" if isinstance(value, int | float) else json.dumps(value, default=str)

    rows = []
    for task, values in record["metrics"].items():
        for key, value in values.items():
            metric, _, kept = key.partition(",")
            stderr = record["stderr"].get(task, {}).get(f"{metric}_stderr,{kept}")
            name = metric if kept == "none" else f"{metric} ({kept})"
            rows.append((task, name, shown(value), f"± {shown(stderr)}" if stderr is not None else ""))
    if not rows:
        return f"lmms-eval reported no metric for {record['task']}"
    widths = [max(len(row[i]) for row in [("task", "metric", "value", ""), *rows]) for i in range(3)]
    lines = [f"{'task':<{widths[0]}}  {'metric':<{widths[1]}}  {'value':>{widths[2]}}"]
    lines += [f"{t:<{widths[0]}}  {m:<{widths[1]}}  {v:>{widths[2]}}  {s}".rstrip() for t, m, v, s in rows]
    return "\n".join(lines)


def run_logged(command: list[str], log: Path) -> int:
    """Run `command`, its output shown and kept in `log`; its exit code."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as kept:
        kept.write(f"$ {shlex.join(command)}\n")
        with subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
        ) as process:
            for line in process.stdout:
                sys.stdout.write(line)
                kept.write(line)
            return process.wait()


def weights_not_loaded(log_text: str) -> dict[str, int]:
    """{"MISSING": n, "UNEXPECTED": n}: the keys transformers' load report lists in lmms-eval's log (a
    class of another architecture than final/'s); empty when every weight was loaded."""
    counts: dict[str, int] = {}
    for status in LOAD_REPORT.findall(log_text):
        counts[status] = counts.get(status, 0) + 1
    return counts


def lmms_eval_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lmms_eval")
    except PackageNotFoundError:
        return None


def main(argv: list[str] | None = None, prog: str = "vlm-recipes eval") -> int:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.split("\n\nWhat")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--lmms-eval", dest="task", metavar="TASK", required=True, help="the lmms-eval task to run (mme, ...)"
    )
    parser.add_argument("run", type=Path, metavar="RUN", help="a run directory or a stage directory")
    parser.add_argument("--limit", type=float, metavar="N", help="only N samples (lmms-eval's --limit)")
    parser.add_argument("--batch-size", type=int, default=1, help="lmms-eval's --batch_size (default: 1)")
    parser.add_argument(
        "--model", help="lmms-eval's model name (default: from final/config.json's model_type)"
    )
    parser.add_argument(
        "--device", help="cuda, cuda:0, cpu (default: the lmms-eval model's own, mostly cuda)"
    )
    parser.add_argument(
        "--include-path", type=Path, metavar="DIR", help="a folder of task YAMLs (lmms-eval's --include_path)"
    )
    args = parser.parse_args(argv)
    from vlm_recipes.runs.layout import FINAL_DIR

    try:
        stage = find_stage(args.run)
        model = args.model or lmms_eval_model_for(stage / FINAL_DIR)
        command = lmms_eval_command(
            stage,
            args.task,
            model,
            limit=args.limit,
            batch_size=args.batch_size,
            device=args.device,
            include_path=args.include_path,
        )
    except BadInput as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if importlib.util.find_spec("lmms_eval") is None:
        print(f"error: lmms-eval is not installed: {INSTALL_HINT}", file=sys.stderr)
        return EXIT_BAD_INPUT

    output = output_dir(stage, args.task)
    log = output / LOG_FILE
    before = results_files(output)
    print(
        f"lmms-eval `{args.task}` on {stage / FINAL_DIR} (--model {model}), its output in {output}",
        flush=True,
    )
    try:
        code = run_logged(command, log)
    except KeyboardInterrupt:
        print(f"\ninterrupted: nothing filed; lmms-eval's log is {log}", file=sys.stderr)
        return 130
    written = new_results(output, before)
    if code != 0 or written is None:
        why = f"exit code {code}" if code else "it wrote no results: an error in the evaluation (it exits 0)"
        print(f"error: lmms-eval failed ({why}); nothing filed; its log is {log}", file=sys.stderr)
        return code or 1
    if not_loaded := weights_not_loaded(log.read_text(errors="replace")):
        listed = " and ".join(f"{n} {status}" for status, n in not_loaded.items())
        print(
            f"error: lmms-eval's `{model}` did not load {stage / FINAL_DIR} as saved ({listed} keys in its "
            f"load report): its answers are not the stage's model's; nothing filed (lmms-eval's own results "
            f"are in {written.parent}); name another class with --model; its log is {log}",
            file=sys.stderr,
        )
        return 1
    about = {
        "stage": str(stage),
        "model_dir": str(stage / FINAL_DIR),
        "lmms_eval_model": model,
        "lmms_eval_version": lmms_eval_version(),
    }
    try:
        filed, record = file_result(stage, args.task, written, about, command)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(
            f"error: lmms-eval's results {written} cannot be filed ({exc}); its log is {log}", file=sys.stderr
        )
        return 1
    limit = f" (--limit {record['limit']:g}: a check, not the benchmark's score)" if record["limit"] else ""
    print(f"\nlmms-eval {args.task} on {stage}{limit}\n{format_table(record)}\n\nfiled: {filed}")
    return 0
