"""`vlm-recipes train` (also `python scripts/train_recipe.py`, `python -m vlm_recipes`): parse arguments,
load the recipe, plan or run it.

Every value given on the command line is checked before anything trains: flags that set recipe keys
(--epochs, --max-steps, --seeds, --parallel) become overrides and are checked against the schema with them
(an error names the flag); the others are checked here (FLAG_RANGES)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import signal
import sys
import threading
import time
import typing
from pathlib import Path

from vlm_recipes.errors import GuardError
from vlm_recipes.logs import is_main_process, setup_logging

DEFAULT_RECIPE = "r3-two-stage"
# Numeric flags that are not recipe keys: (attribute, flag, lowest, highest or None)
FLAG_RANGES = [
    ("nproc_per_node", "--nproc-per-node", 1, None),
    ("nnodes", "--nnodes", 1, None),
    ("node_rank", "--node-rank", 0, None),  # and below --nnodes
    ("master_port", "--master-port", 1, 65535),
    ("until_stage", "--until-stage", 1, None),  # and at most the number of stages
]


def build_parser(prog: str = "train_recipe.py") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        allow_abbrev=False,  # `--epoch` must not silently mean `--epochs`
        description="Run a multi-stage VLM fine-tuning recipe.",
        epilog="Overrides: key=value, e.g. model=Qwen/Qwen2-VL-2B-Instruct training.learning_rate=1e-4 "
        "stages.llm-lora.lora.rank=32 (a stage key without `stages.` applies to every stage).",
    )
    parser.add_argument(
        "--recipe",
        default=DEFAULT_RECIPE,
        help=f"recipe name or .yaml path, or several separated by commas (default: {DEFAULT_RECIPE})",
    )
    parser.add_argument("--all", action="store_true", help="run every available recipe, then compare them")
    parser.add_argument("--seeds", help="run each recipe once per seed, e.g. 0,1,2 (compared as mean ± std)")
    parser.add_argument("--list", action="store_true", help="list the available recipes and exit")
    parser.add_argument(
        "--schema", action="store_true", help="print every recipe key with its meaning and exit"
    )
    parser.add_argument("--dry-run", action="store_true", help="print the plan per stage without training")
    parser.add_argument("--epochs", type=float, help="epochs for every stage")
    parser.add_argument("--max-steps", type=int, help="stop every stage after this many optimizer steps")
    parser.add_argument(
        "--output-dir", default="runs", type=Path, help="where runs are written (default: runs/)"
    )
    parser.add_argument("--run-name", help="run directory name (default: a timestamp)")
    parser.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=False,
        metavar="RUN_DIR",
        help="continue a run: RUN_DIR, or the one named by --recipe and --run-name (finished stages are skipped, "
        "an interrupted one continues from its last complete checkpoint)",
    )
    parser.add_argument("--gpu", help="GPU ids to use, e.g. 6,7 (sets CUDA_VISIBLE_DEVICES)")
    parser.add_argument(
        "--parallel",
        choices=["auto", "single", "model-parallel", "ddp", "fsdp", "deepspeed"],
        help="how several devices are used, for every stage (default: each stage's `parallel`, auto)",
    )
    parser.add_argument(
        "--nproc-per-node", type=int, help="processes per machine (default: one per visible GPU)"
    )
    parser.add_argument(
        "--accelerate-config",
        help="fsdp/deepspeed: a shipped accelerate config (fsdp, zero2, zero3) or a path",
    )
    parser.add_argument("--nnodes", type=int, default=1, help="machines in a multi-node run")
    parser.add_argument("--node-rank", type=int, default=0, help="this machine's index in a multi-node run")
    parser.add_argument("--master-addr", default="127.0.0.1", help="address of node 0 (multi-node)")
    parser.add_argument("--master-port", type=int, default=29500, help="rendezvous port on node 0")
    parser.add_argument("--until-stage", type=int, help=argparse.SUPPRESS)  # the launcher's children
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides")
    return parser


def list_recipes() -> str:
    from vlm_recipes.recipes.load import available_recipes, load_recipe
    from vlm_recipes.recipes.validate import RecipeError

    lines = []
    for name, path in available_recipes().items():
        try:
            recipe = load_recipe(str(path))
            stages = " → ".join(s.name for s in recipe.stages)
            lines.append(f"{name:<18} {recipe.description}\n{'':<18} stages: {stages}")
        except RecipeError as exc:
            lines.append(f"{name:<18} (invalid: {len(exc.problems)} problem(s); run it to see them)")
    return "\n".join(lines)


def describe_schema() -> str:
    from vlm_recipes.recipes.schema import STAGE_DEFAULT_SECTIONS, Recipe, Stage

    def walk(cls, indent: str) -> list[str]:
        out = []
        for f in dataclasses.fields(cls):
            if f.name in ("source_file", "stages") or (cls is Recipe and f.name == "name"):
                continue  # not keys of a file: the name is the file's, stages are listed below
            hint = typing.get_type_hints(cls)[f.name]
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            if dataclasses.is_dataclass(hint):
                out.append(f"{indent}{f.name}:  # {f.metadata.get('help', '')}")
                out += walk(hint, indent + "  ")
            else:
                bounds = f.metadata.get("range")
                allowed = f" [{bounds}]" if bounds else ""
                out.append(f"{indent}{f.name}: {default!r}  # {f.metadata.get('help', '')}{allowed}")
        return out

    lines = ["# recipe file (top level)"] + walk(Recipe, "")
    lines += ["extends: null  # another recipe to start from", "stages:  # each stage:"]
    lines += walk(Stage, "  ")
    lines += [
        "",
        f"# {', '.join(STAGE_DEFAULT_SECTIONS)} may also be set at the top level, as defaults for "
        "every stage; `- use: recipe:stage` reuses a stage of another recipe.",
    ]
    return "\n".join(lines)


def select_gpus(spec: str) -> None:
    """`--gpu 6,7`: make exactly those GPUs visible, before CUDA starts, and check they exist."""
    from vlm_recipes.errors import GuardError

    ids = [i.strip() for i in spec.split(",") if i.strip()]
    if not ids or not all(i.isdigit() for i in ids):
        raise GuardError(f"--gpu {spec}: give GPU ids separated by commas, e.g. --gpu 0 or --gpu 6,7")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
    import torch

    visible = torch.cuda.device_count()  # CUDA drops every id from the first one that does not exist
    if visible == 0:
        raise GuardError(
            f"--gpu {spec}: this machine has no usable CUDA GPU; leave out --gpu to train on the CPU"
        )
    if visible < len(ids):
        raise GuardError(
            f"--gpu {spec}: only {visible} of these GPU ids exist (ids {', '.join(ids[:visible])} work); "
            "`nvidia-smi -L` lists this machine's GPUs"
        )


def resume_command(args, run_name: str) -> str:
    if isinstance(args.resume, str):
        return f"{args.command} --resume {args.resume}"
    recipe = "<recipe>" if args.all else Path(args.recipe.split(",")[0]).stem
    return f"{args.command} --resume {args.output_dir / recipe / run_name}"


def check_flags(args) -> None:
    """The command line's own numbers and combinations (recipe keys are checked with the recipe)."""
    from vlm_recipes.recipes.validate import Problem, RecipeError

    problems = []
    for attr, flag, low, high in FLAG_RANGES:
        value = getattr(args, attr)
        if value is not None and (value < low or (high is not None and value > high)):
            bound = f"at least {low}" + (f" and at most {high}" if high is not None else "")
            problems.append(Problem(f"{flag} {value}", f"must be {bound}"))
    if args.nnodes >= 1 and not 0 <= args.node_rank < args.nnodes:
        problems.append(
            Problem(
                f"--node-rank {args.node_rank}", f"with --nnodes {args.nnodes}, give 0 to {args.nnodes - 1}"
            )
        )
    if args.seeds is not None:
        try:
            seeds = [int(s) for s in args.seeds.split(",")]
        except ValueError:
            seeds = []
        if not seeds:
            problems.append(
                Problem(f"--seeds {args.seeds}", "give whole numbers separated by commas, e.g. 0,1,2")
            )
        elif len(set(seeds)) != len(seeds):
            problems.append(
                Problem(f"--seeds {args.seeds}", "a seed is given twice (its runs would collide)")
            )
    if isinstance(args.resume, str):
        given = [
            flag
            for flag, value in (
                ("--epochs", args.epochs),
                ("--max-steps", args.max_steps),
                ("--seeds", args.seeds),
                ("--parallel", args.parallel),
                ("--run-name", args.run_name),
                ("--all", args.all or None),
                ("key=value overrides", args.overrides or None),
            )
            if value is not None
        ]
        if given:
            problems.append(
                Problem(
                    f"--resume {args.resume}",
                    f"continues the run exactly as its run.json records it; {', '.join(given)} cannot change "
                    "it. Leave them out, or start a new run with them",
                )
            )
    if problems:
        raise RecipeError(problems, "Bad command line")


def build_jobs(args, names: list[str], base_name: str) -> list:
    """(recipe, run name) per recipe and seed, every recipe validated before anything trains."""
    from vlm_recipes.recipes.load import load_recipe, load_recipe_from_run

    if isinstance(args.resume, str):  # --resume RUN_DIR: the recipe exactly as that run recorded it
        jobs = [(load_recipe_from_run(Path(args.resume)), Path(args.resume).name)]
    else:
        overrides = list(args.overrides)
        labels = {}  # override → the flag the user typed, for errors
        for flag, key, value in (
            ("--epochs", "training.epochs", args.epochs),
            ("--max-steps", "training.max_steps", args.max_steps),
            ("--parallel", "parallel", args.parallel),
        ):
            if value is not None:
                overrides.append(f"{key}={value}")
                labels[overrides[-1]] = f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}"
        seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else [None]
        jobs = []
        for name in names:
            for seed in seeds:
                extra = [f"training.seed={seed}"] if seed is not None else []
                if extra:
                    labels[extra[0]] = f"--seeds {args.seeds}"
                run_name = base_name if seed is None else f"{base_name}-seed{seed}"
                jobs.append((load_recipe(name, overrides + extra, labels), run_name))
    if args.until_stage is not None:
        from vlm_recipes.recipes.validate import Problem, RecipeError

        for recipe, _ in jobs:
            if args.until_stage > len(recipe.stages):
                raise RecipeError(
                    [
                        Problem(
                            f"--until-stage {args.until_stage}",
                            f"`{recipe.name}` has {len(recipe.stages)} stage(s)",
                        )
                    ],
                    "Bad command line",
                )
    return jobs


@contextlib.contextmanager
def sigterm_stops_like_ctrl_c():
    """SIGTERM (a scheduler stopping the job, `kill`, `docker stop`) stops the run as Ctrl-C does: the
    stage in training saves a checkpoint first (resilience.InterruptCallback), and run.json says
    `interrupted`, instead of the process vanishing with the run still marked `running`."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise KeyboardInterrupt("SIGTERM")

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None, prog: str = "train_recipe.py") -> int:
    with sigterm_stops_like_ctrl_c():
        return _main(argv, prog)


def _main(argv: list[str] | None, prog: str) -> int:
    args = build_parser(prog).parse_intermixed_args(argv)  # overrides may come before or after options
    args.command = "python scripts/train_recipe.py" if prog == "train_recipe.py" else prog
    setup_logging()
    if args.list:
        print(list_recipes())
        return 0
    if args.schema:
        print(describe_schema())
        return 0

    from vlm_recipes.errors import BadInput, StageInterrupted, StageStopped
    from vlm_recipes.recipes.load import available_recipes

    if isinstance(args.resume, str):
        args.output_dir = Path(args.resume).parent.parent
    names = (
        list(available_recipes()) if args.all else [n.strip() for n in args.recipe.split(",") if n.strip()]
    )
    base_name = args.run_name or time.strftime("%Y%m%d-%H%M%S")
    # The command line and every recipe are checked before the training stack (transformers, TRL, PEFT,
    # datasets: ~10 s of imports) is imported: a typo is reported at once.
    try:
        check_flags(args)
        jobs = build_jobs(args, names, base_name)
    except BadInput as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return exc.exit_code

    from vlm_recipes.launch.launcher import LaunchFailed
    from vlm_recipes.runner import run_recipe
    from vlm_recipes.runs.layout import NodeSettings, RunOptions
    from vlm_recipes.runs.manifest import format_summary

    run_dirs: list[Path] = []
    try:
        if args.gpu is not None:
            select_gpus(args.gpu)
        if args.nnodes > 1 and not (args.run_name or args.resume):
            raise GuardError(
                "a multi-node run needs the same --run-name on every node (a timestamp would differ)"
            )
        if args.dry_run:
            from vlm_recipes.plan import format_plan, plan_recipe

            for recipe, run_name in jobs:
                print(format_plan(recipe, plan_recipe(recipe, RunOptions(args.output_dir, run_name))))
            return 0
        node = NodeSettings(
            args.nnodes, args.node_rank, args.master_addr, args.master_port, args.accelerate_config
        )
        for recipe, run_name in jobs:
            options = RunOptions(
                args.output_dir, run_name, bool(args.resume), args.until_stage, args.nproc_per_node, node
            )
            run_dirs.append(run_recipe(recipe, options))
            if args.until_stage is None and is_main_process():
                print("\n" + format_summary(run_dirs[-1]))
    except BadInput as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return exc.exit_code
    except LaunchFailed as exc:  # the launched processes printed their own error
        # torchrun reports any failed child as its own failure (exit 1): the exit code a child recorded
        # in run.json is the one a single process would have returned
        return exc.recorded_exit_code()
    except (StageInterrupted, KeyboardInterrupt) as exc:
        detail = f"{exc}\n" if isinstance(exc, StageInterrupted) else ""
        print(
            f"\ninterrupted: {detail}finished stages are kept. Continue with:\n  {resume_command(args, base_name)}",
            file=sys.stderr,
        )
        return StageInterrupted.exit_code
    except StageStopped as exc:  # diverged: the message says at which step and why
        print(f"\nerror: {exc}", file=sys.stderr)
        return exc.exit_code
    if len(run_dirs) > 1 and args.until_stage is None and is_main_process():
        from vlm_recipes.evaluation.compare import format_comparison, write_comparison

        comparison, markdown, png = write_comparison(run_dirs, args.output_dir / "comparisons" / base_name)
        print("\n" + format_comparison(comparison))
        print(f"\nComparison: {markdown}\nPlot:       {png}")
    return 0
