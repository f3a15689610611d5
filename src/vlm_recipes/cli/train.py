"""`vlm-recipes train` (also `python scripts/train_recipe.py`, `python -m vlm_recipes`): parse arguments,
check them and the recipes (jobs.py), then plan or run each job and turn how it ended into an exit code.

Every value given on the command line is checked before anything trains (jobs.py)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from vlm_recipes.cli.jobs import build_jobs, check_flags, resume_command
from vlm_recipes.cli.process import select_gpus, sigterm_stops_like_ctrl_c
from vlm_recipes.cli.recipe_help import describe_schema, list_recipes
from vlm_recipes.errors import GuardError
from vlm_recipes.logs import is_main_process, setup_logging

DEFAULT_RECIPE = "r3-two-stage"


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
    # Under SLURM (srun) or Kubernetes (PyTorchJob, Kubeflow's PET_ variables) these four are read from the
    # scheduler's variables; a flag given wins (launch/cluster.py)
    parser.add_argument(
        "--nnodes", type=int, help="machines in a multi-node run (default: 1, or the scheduler's)"
    )
    parser.add_argument("--node-rank", type=int, help="this machine's index in a multi-node run (default: 0)")
    parser.add_argument("--master-addr", help="rendezvous host: node 0's address (default: 127.0.0.1)")
    parser.add_argument("--master-port", type=int, help="rendezvous port on node 0 (default: 29500)")
    parser.add_argument(
        "--max-restarts",
        type=int,
        help="times torchrun's elastic agent restarts a failed process group, which resumes from its last "
        "complete checkpoint (default: 0)",
    )
    parser.add_argument("--until-stage", type=int, help=argparse.SUPPRESS)  # the launcher's children
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides")
    return parser


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

    from vlm_recipes.errors import EXIT_BAD_INPUT, BadInput, StageInterrupted, StageStopped
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
        return EXIT_BAD_INPUT

    from vlm_recipes.comparison.answers import format_answers_text, side_by_side
    from vlm_recipes.comparison.report_page import write_run_page
    from vlm_recipes.comparison.run_table import format_summary
    from vlm_recipes.launch.launcher import LaunchFailed
    from vlm_recipes.runner import run_recipe
    from vlm_recipes.runs.layout import RunOptions

    run_dirs: list[Path] = []
    try:
        if args.gpu is not None:
            select_gpus(args.gpu)
        placement = place_this_node(args)
        node, nproc_per_node = placement.node, placement.nproc_per_node
        if node.nnodes > 1 and not (args.run_name or args.resume):
            raise GuardError(
                "a multi-node run needs the same --run-name on every node (a timestamp would differ)"
            )
        if args.dry_run:  # planned for the processes the command asks for (per-rank memory)
            from vlm_recipes.launch.cluster import format_placement
            from vlm_recipes.plan import format_plan, plan_recipe

            ids = []
            for recipe, run_name in jobs:
                options = RunOptions(args.output_dir, run_name, nproc_per_node=nproc_per_node, node=node)
                print(format_plan(recipe, plan_recipe(recipe, options)))
                ids += launched_groups(recipe, options)
            print(format_placement(placement, ids))
            return 0
        for recipe, run_name in jobs:
            options = RunOptions(
                args.output_dir, run_name, bool(args.resume), args.until_stage, nproc_per_node, node
            )
            run_dirs.append(run_recipe(recipe, options))
            if args.until_stage is None and is_main_process():
                print("\n" + format_summary(run_dirs[-1]))
                if answers := format_answers_text(side_by_side([("", run_dirs[-1])])):
                    print("\n" + answers)
                print(f"\nReport page (the image beside every answer): {write_run_page(run_dirs[-1])}")
    except BadInput as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except LaunchFailed as exc:  # torchrun reports any failed child as its own failure (exit 1)
        # one line: the first failing rank, its host and its error; the exit code a single process returns
        code = exc.recorded_exit_code()
        then = (
            ""
            if code == EXIT_BAD_INPUT
            else f" Continue with:\n  {resume_command(args, base_name, exc.resume_overrides)}"
        )
        print(f"\nerror: {str(exc).rstrip('.')}.{then}", file=sys.stderr)
        return code
    except (StageInterrupted, KeyboardInterrupt) as exc:
        detail = f"{exc}\n" if isinstance(exc, StageInterrupted) else ""
        print(
            f"\ninterrupted: {detail}finished stages are kept. Continue with:\n  {resume_command(args, base_name)}",
            file=sys.stderr,
        )
        return StageInterrupted.exit_code
    except StageStopped as exc:  # diverged, a full disk, out of memory: the message says why and what to do
        changes = getattr(exc, "resume_overrides", ())  # after a NaN stop: what to change, not a replay
        continue_with = f"Continue with:\n  {resume_command(args, base_name, changes)}"
        print(f"\nerror: {str(exc).rstrip('.')}. {continue_with}", file=sys.stderr)
        return exc.exit_code
    if len(run_dirs) > 1 and args.until_stage is None and is_main_process():
        from vlm_recipes.comparison.report_page import write_comparison
        from vlm_recipes.comparison.tables import format_comparison

        comparison, markdown, png, page = write_comparison(
            run_dirs, args.output_dir / "comparisons" / base_name
        )
        print("\n" + format_comparison(comparison))
        print(f"\nComparison: {markdown}\nPlot:       {png}\nPage:       {page}")
    return 0


def place_this_node(args):
    """The nodes, this node's index, the rendezvous, processes per node and restarts: from the flags, else
    the scheduler's variables, else defaults (launch/cluster.py); logged where any is not a default. A
    launched child takes none of them: its launcher placed it."""
    import logging
    import os

    from vlm_recipes.launch.cluster import Placement, Requested, resolve_placement
    from vlm_recipes.ranks import launched
    from vlm_recipes.runs.layout import NodeSettings

    if launched():
        return Placement(NodeSettings(accelerate_config=args.accelerate_config), args.nproc_per_node, ())
    flags = ("nnodes", "node_rank", "master_addr", "master_port", "nproc_per_node", "max_restarts")
    requested = Requested(
        **{name: getattr(args, name) for name in flags}, accelerate_config=args.accelerate_config
    )
    placement = resolve_placement(requested, os.environ)
    for variable in placement.read_as_pods:  # a pod's count, not this process's: accelerate would misread it
        os.environ.pop(variable, None)
    if not placement.all_defaults:
        for decision in placement.decisions:
            logging.getLogger(__name__).info("launch: %s", decision)
    return placement


def launched_groups(recipe, options) -> list[str]:
    """What the dry run says of each group of stages it would launch: its stages and rendezvous id."""
    from vlm_recipes.errors import GuardError
    from vlm_recipes.launch.launcher import rendezvous_id
    from vlm_recipes.machine import detect_environment
    from vlm_recipes.plan import plan_parallel
    from vlm_recipes.runner import stage_groups
    from vlm_recipes.runs.layout import run_dir_for

    try:
        groups = stage_groups(plan_parallel(recipe, detect_environment(), options))
    except GuardError:  # the plan above says why
        return []
    run_dir, first, described = run_dir_for(recipe, options), 1, []
    for last, plan, _ in groups:
        if plan.launches_processes:
            stages = f"stage {last}" if first == last else f"stages {first}-{last}"
            described.append(f"{rendezvous_id(run_dir, last)} ({recipe.name} {stages}, {plan.mode})")
        first = last + 1
    return described
