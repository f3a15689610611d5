"""`vlm-recipes demo-learns` (= python scripts/demo_learns.py): does the demo teach? For each demo model: its
pretraining (once, cached), then one seed recipe from that model at its start (learning rate ~0: the
pretrained model, through the same load and eval) and trained with each seed. Prints the Markdown table
docs/results/demo-learns.md shows.

    python scripts/demo_learns.py                                   # every demo:tiny-* model, r1, seeds 0,1
    python scripts/demo_learns.py --models demo:tiny-qwen2-vl --recipe r2-vision-only

A stage teaches when its eval loss falls, and its exact match rises, by more than the spread between the
seeds (max - min), on demo:teaching-eval (144 rows drawn as demo:eval's 48: on those, one row decided the
weakest towers' verdicts, demo/dataset.py); the table says which, and the command exits 1 when a model's stage
did not teach on either metric: the per-family check behind the suite's two-family teaching tests (13
pretrainings are 20-30 min on 2 cores, beyond CI's budget). The runs are kept under --output-dir.
"""

from __future__ import annotations

import argparse
import platform
from pathlib import Path

from vlm_recipes.benchmarking.processes import git_sha, processor_name
from vlm_recipes.cli.train import main as train
from vlm_recipes.comparison.teaching import teaching
from vlm_recipes.demo.models import DEMO_MODEL_IDS, PRETRAINED_PREFIX, ensure_demo_model
from vlm_recipes.files import read_json
from vlm_recipes.machine import detect_environment

TEACHING_EVAL = "demo:teaching-eval"  # 144 rows drawn as demo:eval's (demo/dataset.py says why)
AT_START = "1e-12"  # a learning rate that leaves the weights as they were (0 is refused)


def stage_metrics(run_dir: Path) -> dict:
    """The last stage's eval loss and exact match, as comparison/teaching.py takes them."""
    last = sorted(run_dir.glob("stage-*"))[-1]
    metrics = read_json(last / "metrics.json")
    return {"loss": metrics["eval_loss"], "exact": metrics["eval"]["all"]["exact_match"]}


def run(recipe: str, model: str, out: Path, name: str, *overrides: str) -> dict:
    args = ["--recipe", recipe, "--output-dir", str(out), "--run-name", name, f"model={model}", *overrides]
    if train(args) != 0:
        raise SystemExit(f"{recipe} on {model} failed: see {out}")
    return stage_metrics(out / recipe / name)


def main(argv: list[str] | None = None, prog: str = "demo_learns.py") -> int:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    models = [m for m in DEMO_MODEL_IDS if m.startswith(PRETRAINED_PREFIX)]
    parser.add_argument("--models", default=",".join(models), help="comma-separated demo model ids")
    parser.add_argument("--recipe", default="r1-llm-only")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--output-dir", type=Path, default=Path("runs/demo-learns"))
    parser.add_argument(
        "--precision",
        default="auto",
        choices=["auto", "bf16", "fp32"],
        help="every run's precision (fp32: the path every CPU takes, as the opt-in test runs it)",
    )
    parser.add_argument(
        "--eval",
        default=TEACHING_EVAL,
        help="the rows every run is scored on (default: demo:eval's kind of rows, three times as many)",
    )
    args = parser.parse_args(argv)
    seeds = args.seeds.split(",")
    # every run: the same precision (auto: the recipe's own) and the same eval rows
    overrides = [f"data.eval={args.eval}"] + (
        [] if args.precision == "auto" else [f"precision={args.precision}"]
    )
    rows = []
    for model in args.models.split(","):
        pretrained = ensure_demo_model(model)
        summary = read_json(pretrained / "pretraining.json")
        tag = model.removeprefix("demo:")
        # the start (learning rate ~0) and each seed: the same recipe, the same precision
        runs = {
            "start": f"training.learning_rate={AT_START}",
            **{f"seed{s}": f"training.seed={s}" for s in seeds},
        }
        metrics = {
            name: run(args.recipe, model, args.output_dir, f"{tag}-{name}", override, *overrides)
            for name, override in runs.items()
        }
        start, trained = metrics.pop("start"), list(metrics.values())
        rows.append((tag, summary, start, trained, teaching(start, trained)))

    print(
        f"\nMachine: {processor_name()}, {detect_environment().describe()}; git {git_sha()}; python {platform.python_version()}.\n"
        f"Command: python scripts/demo_learns.py --recipe {args.recipe} --seeds {args.seeds}"
        + (f" --precision {args.precision}" if args.precision != "auto" else "")
        + (f" --models {args.models}" if args.models != ",".join(models) else "")
        + (f" --eval {args.eval}" if args.eval != TEACHING_EVAL else "")
        + "\n"
    )
    print(
        "| model | pretraining | its eval loss | its exact match "
        "| eval loss at start → trained (fall / seed spread) "
        "| exact match at start → trained (rise / seed spread) |"
    )
    print("|---|---|---|---|---|---|")
    for tag, summary, start, trained, v in rows:
        took = f"{summary['wall_time_s']:.0f} s"
        losses = " / ".join(f"{t['loss']:.2f}" for t in trained)
        exacts = " / ".join(f"{t['exact']:.3f}" for t in trained)
        loss_mark = "teaches" if v.loss_teaches else "no"
        exact_mark = "teaches" if v.exact_teaches else "no"
        print(
            f"| {tag} | {took} | {summary['eval_loss']:.3f} | {summary['eval']['all']['exact_match']:.2f} "
            f"| {start['loss']:.2f} → {losses} ({v.loss_fall:.2f} / {v.loss_spread:.2f}: {loss_mark}) "
            f"| {start['exact']:.3f} → {exacts} "
            f"({v.exact_rise:+.3f} / {v.exact_spread:.3f}: {exact_mark}) |"
        )
    untaught = [tag for tag, *_, v in rows if not (v.loss_teaches and v.exact_teaches)]
    if untaught:
        print(f"\n{args.recipe} did not teach (eval loss and exact match) on: {', '.join(untaught)}")
        return 1
    print(f"\n{args.recipe} taught every model: eval loss and exact match beyond the seed spread")
    return 0
