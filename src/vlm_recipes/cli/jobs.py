"""What the command line asks to run: its own flags checked (FLAG_RANGES and combinations), then one
(recipe, run name) job per recipe and seed, every recipe validated with the flags that set its keys
(--epochs, --max-steps, --seeds, --parallel) as overrides, so an error names the flag."""

from __future__ import annotations

from pathlib import Path

# Numeric flags that are not recipe keys: (attribute, flag, lowest, highest or None)
FLAG_RANGES = [
    ("nproc_per_node", "--nproc-per-node", 1, None),
    ("nnodes", "--nnodes", 1, None),
    ("node_rank", "--node-rank", 0, None),  # and below --nnodes
    ("master_port", "--master-port", 1, 65535),
    ("max_restarts", "--max-restarts", 0, None),
    ("until_stage", "--until-stage", 1, None),  # and at most the number of stages
]


# What a resume may change, in the stages not finished: the size and clipping of the steps still to take,
# and what a NaN/inf does (after a NaN stop, the same rows from the same weights diverge again). Never what
# was trained or read: the model, the data, the batch, the schedule's length.
RESUMABLE_KEYS = (
    "training.learning_rate",
    "training.role_learning_rates",
    "training.max_grad_norm",
    "training.on_nan",
)


def resumable(override: str) -> bool:
    """An override --resume takes: a RESUMABLE_KEYS key, of every stage or of one (`stages.<name>.`)."""
    parts = override.partition("=")[0].strip().split(".")
    key = ".".join(parts[2:] if parts[0] == "stages" else parts)
    return any(key == k or key.startswith(f"{k}.") for k in RESUMABLE_KEYS)


def resume_command(args, run_name: str, overrides: tuple[str, ...] = ()) -> str:
    # run.json records the recipe, not the flags that place it: the processes are asked for again
    procs = f" --nproc-per-node {args.nproc_per_node}" if args.nproc_per_node else ""
    changes = "".join(f" {override}" for override in overrides)
    if isinstance(args.resume, str):
        return f"{args.command} --resume {args.resume}{procs}{changes}"
    recipe = "<recipe>" if args.all else Path(args.recipe.split(",")[0]).stem
    return f"{args.command} --resume {args.output_dir / recipe / run_name}{procs}{changes}"


def check_flags(args) -> None:
    """The command line's own numbers and combinations (recipe keys are checked with the recipe)."""
    from vlm_recipes.recipes.validate import Problem, RecipeError

    problems = []
    for attr, flag, low, high in FLAG_RANGES:
        value = getattr(args, attr)
        if value is not None and (value < low or (high is not None and value > high)):
            bound = f"at least {low}" + (f" and at most {high}" if high is not None else "")
            problems.append(Problem(f"{flag} {value}", f"must be {bound}"))
    # both given here; a number from SLURM or Kubernetes is checked where it is read (launch/cluster.py)
    both = args.nnodes is not None and args.node_rank is not None
    if both and args.nnodes >= 1 and not 0 <= args.node_rank < args.nnodes:
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
        refused = [override for override in args.overrides if not resumable(override)]
        given = [
            flag
            for flag, value in (
                ("--epochs", args.epochs),
                ("--max-steps", args.max_steps),
                ("--seeds", args.seeds),
                ("--parallel", args.parallel),
                ("--run-name", args.run_name),
                ("--all", args.all or None),
                ("key=value overrides", refused or None),
            )
            if value is not None
        ]
        if given:
            problems.append(
                Problem(
                    f"--resume {args.resume}",
                    f"continues the run exactly as its run.json records it; {', '.join(given)} cannot change "
                    "it. Leave them out, or start a new run with them (a resume may change only "
                    f"{', '.join(RESUMABLE_KEYS)})",
                )
            )
    if problems:
        raise RecipeError(problems, "Bad command line")


def build_jobs(args, names: list[str], base_name: str) -> list:
    """(recipe, run name) per recipe and seed, every recipe validated before anything trains."""
    from vlm_recipes.recipe import load_recipe, load_recipe_from_run

    if isinstance(args.resume, str):  # --resume RUN_DIR: the recipe as that run recorded it
        recipe = load_recipe_from_run(Path(args.resume), args.overrides)
        refuse_changing_finished_stages(Path(args.resume), recipe, args.overrides)
        jobs = [(recipe, Path(args.resume).name)]
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
    check_rewards_of(recipe for recipe, _ in jobs)
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


def check_rewards_of(recipes) -> None:
    """Every GRPO or RLOO stage's rewards can be built (a built-in's keys; a user's module:function imports and takes
    TRL's keyword arguments), before anything trains; every bad one is reported, under its key path."""

    def rewards_of(stage):  # a sampling method's section holds its rewards
        return getattr(stage.settings, "rewards", None)

    recipes = {recipe.name: recipe for recipe in recipes}
    if not any(rewards_of(stage) for recipe in recipes.values() for stage in recipe.stages):
        return  # and the methods' imports (TRL, PEFT: ~6 s) are left to the processes that train
    from vlm_recipes.methods.rewards import reward_problems
    from vlm_recipes.recipes.validate import Problem, RecipeError

    for recipe in recipes.values():
        problems = []
        for i, stage in enumerate(recipe.stages):
            if rewards_of(stage):
                at_rewards = f"stages[{i}].{stage.method}.rewards"
                for error in reward_problems(stage.settings.rewards, at_rewards):
                    at, _, said = str(error).partition(": ")  # the error starts with its key path
                    problems.append(Problem(f"{recipe.name}: {at}", said))
        if problems:
            raise RecipeError(problems, f"Recipe {recipe.name} is not valid")


def refuse_changing_finished_stages(run_dir: Path, recipe, overrides: list[str]) -> None:
    """--resume's overrides change the stages still to train: a finished stage is not trained again, so
    run.json would record for it a learning rate it never trained at."""
    if not overrides:
        return
    from vlm_recipes.recipe import load_recipe_from_run
    from vlm_recipes.recipes.validate import Problem, RecipeError
    from vlm_recipes.runs.layout import DONE_MARKER, stage_dir_name

    recorded = load_recipe_from_run(run_dir)
    finished = [
        stage.name
        for index, (stage, before) in enumerate(zip(recipe.stages, recorded.stages, strict=True), start=1)
        if stage != before and (run_dir / stage_dir_name(index, stage.name) / DONE_MARKER).is_file()
    ]
    if finished:
        names = ", ".join(f"`{name}`" for name in finished)
        raise RecipeError(
            [
                Problem(
                    " ".join(overrides),
                    f"changes stage(s) {names}, finished: name the stage to continue, "
                    "e.g. stages.<name>.training.learning_rate=...",
                )
            ],
            "Bad command line",
        )
