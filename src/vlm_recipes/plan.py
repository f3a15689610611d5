"""The plan: per stage, how it uses the devices and what it trains, from where, into where. Decided once,
before anything heavy; the runner follows it and --dry-run prints it.

Devices (pure decisions): never torch.nn.DataParallel. One process with several GPUs either shards the
model (model-parallel, Trainer n_gpu forced to 1) or runs one process per GPU (DDP; FSDP and DeepSpeed
through accelerate), launched by `launch/`. The dry run builds the model on the `meta` device from its
config, so a plan costs no weights and no memory; stages whose source does not exist yet (a later
stage's input) are planned from the base config.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForImageTextToText

from vlm_recipes.decisions import Decision, Environment
from vlm_recipes.demo.models import config_source
from vlm_recipes.errors import GuardError
from vlm_recipes.families import family_for_config
from vlm_recipes.families.parameters import (
    count_params_by_role,
    expert_parameters_of_role,
    lora_target_modules,
    lora_target_parameters,
    routed_experts,
)
from vlm_recipes.machine import detect_environment
from vlm_recipes.model.guards import decide_precision
from vlm_recipes.rank_memory import quantized_weights, rank_memory
from vlm_recipes.recipes.data_sources import describe_sources
from vlm_recipes.recipes.learning_rates import learning_rate_scale
from vlm_recipes.recipes.schema import Recipe
from vlm_recipes.roles import ROLES
from vlm_recipes.runs.layout import RunOptions, describe_source, run_dir_for, stage_dirs
from vlm_recipes.speedups.sequence_parallel import sequence_plan

MULTI_PROCESS = ("ddp", "fsdp", "deepspeed")


@dataclass(frozen=True)
class ParallelPlan:
    mode: str  # single | model-parallel | ddp | fsdp | deepspeed
    processes_per_node: int
    nnodes: int = 1

    @property
    def world_size(self) -> int:
        return self.processes_per_node * self.nnodes

    @property
    def launches_processes(self) -> bool:
        return self.mode in MULTI_PROCESS


@dataclass(frozen=True)
class ModelFootprint:
    """Bytes a stage needs on one GPU, estimated from parameter counts (activations not included)."""

    weights_gb: float
    trainable_gb: float  # fp32 master weights + gradients + 2 Adam moments = 16 bytes per trainable param

    @property
    def total_gb(self) -> float:
        return self.weights_gb + self.trainable_gb


def decide_parallel(
    requested: str,
    env: Environment,
    footprint: ModelFootprint | None = None,
    gpu_memory_gb: float | None = None,
    nproc_per_node: int | None = None,
    nnodes: int = 1,
    max_memory_per_gpu: str | None = None,
    sequence_parallel_size: int = 1,
) -> tuple[ParallelPlan, Decision]:
    """Pick how a stage runs. `auto`: one device → single; several GPUs → DDP when the model fits one
    GPU (with 30% headroom for activations), else model-parallel sharding."""
    devices = env.gpu_count if env.device == "cuda" else 1
    procs = nproc_per_node or (devices if env.device == "cuda" else 1)
    if env.device == "cuda" and procs > devices:
        raise GuardError(
            f"--nproc-per-node {procs} but only {devices} GPU(s) are visible: one process per GPU"
        )
    mode = requested
    if mode == "auto":
        if nnodes > 1 or (nproc_per_node or 0) > 1:
            mode = "ddp"  # several processes were asked for
        elif env.device != "cuda" or devices == 1:
            mode = "single"
        elif footprint is None or gpu_memory_gb is None or footprint.total_gb * 1.3 <= gpu_memory_gb:
            mode = "ddp"
        else:
            mode = "model-parallel"
    if mode in MULTI_PROCESS and max_memory_per_gpu:
        raise GuardError(
            f"training.max_memory_per_gpu shards one model over several GPUs (a device_map), which {mode} cannot "
            "combine with one copy per process: use --parallel model-parallel, or drop max_memory_per_gpu"
        )
    if mode in MULTI_PROCESS:
        if env.device == "cpu" and mode == "deepspeed":
            raise GuardError("--parallel deepspeed needs GPUs; on CPU use fsdp or ddp (gloo), or single")
        plan = ParallelPlan(mode, procs, nnodes)
        if plan.world_size < 2:
            raise GuardError(
                f"--parallel {mode} needs at least 2 processes: add --nproc-per-node 2 (or more GPUs, or --nnodes)"
            )
    elif mode == "model-parallel":
        if env.device != "cuda" or devices < 2:
            raise GuardError(
                "--parallel model-parallel shards the model over GPUs: it needs at least 2 visible GPUs"
            )
        plan = ParallelPlan(mode, 1, 1)
    else:
        plan = ParallelPlan("single", 1, 1)
    if sequence_parallel_size > 1:
        check_sequence_groups(plan, sequence_parallel_size)
    return plan, Decision(
        "launch", describe_plan(plan, env), _reason(requested, plan, env, footprint, gpu_memory_gb)
    )


def check_sequence_groups(plan: ParallelPlan, size: int) -> None:
    """The ranks must form whole groups of `size` sequence ranks, one process per rank."""
    if plan.mode not in ("ddp", "fsdp"):
        raise GuardError(
            f"sequence_parallel_size {size} splits a row over processes: run the stage with --parallel ddp or "
            f"fsdp and --nproc-per-node a multiple of {size} (it would run as {plan.mode})"
        )
    if plan.world_size % size:
        raise GuardError(
            f"sequence_parallel_size {size} does not divide the {plan.world_size} processes: set "
            f"--nproc-per-node (times --nnodes) to a multiple of {size}, or stages.N.sequence_parallel_size to a "
            f"divisor of {plan.world_size}"
        )


def describe_plan(plan: ParallelPlan, env: Environment) -> str:
    if plan.mode == "single":
        return "one process, one device"
    if plan.mode == "model-parallel":
        return f"one process, model sharded over {env.gpu_count} GPUs (Trainer n_gpu forced to 1)"
    where = "GPU" if env.device == "cuda" else "CPU process (gloo)"
    nodes = f" on each of {plan.nnodes} nodes" if plan.nnodes > 1 else ""
    return f"{plan.mode.upper()} with {plan.processes_per_node} process(es){nodes}, one per {where}"


def _reason(requested: str, plan: ParallelPlan, env: Environment, footprint, gpu_memory_gb) -> str:
    if requested != "auto":
        return f"--parallel {requested}"
    if plan.mode == "single":
        return "one device visible" if env.device == "cuda" else "CPU"
    fits = ""
    if footprint is not None and gpu_memory_gb is not None:
        verb = "fits" if plan.mode == "ddp" else "does not fit"
        fits = f"; model needs ~{footprint.total_gb:.1f} GB, {verb} one {gpu_memory_gb:.0f} GB GPU"
    return f"{env.gpu_count} GPUs{fits}"


def batch_decision(
    plan: ParallelPlan,
    per_device: int,
    accumulation: int,
    rows: int | None,
    epochs: float,
    max_steps: int,
    lr: float,
    scheduler: str,
    warmup: float,
    sequence_parallel_size: int = 1,
) -> Decision:
    """What a user comparing 1 GPU and N GPUs must know: the global batch and the steps it gives (`rows`
    None: a stream's, not counted). The N ranks of a sequence group share their rows."""
    data_groups = plan.world_size // sequence_parallel_size
    global_batch = per_device * accumulation * data_groups
    if rows is None:  # data.streaming: no row count; validation requires max_steps
        length = f"rows streamed → {max_steps} steps (training.max_steps)"
    else:
        steps_per_epoch = max(1, -(-rows // (per_device * data_groups)) // accumulation)
        steps = max_steps if max_steps > 0 else int(steps_per_epoch * epochs)
        length = f"{rows} rows → {steps_per_epoch} steps/epoch, {steps} steps"
    return Decision(
        "batch",
        f"global batch {global_batch} = {per_device} per device × {accumulation} accumulation × "
        f"{plan.world_size} process(es)"
        + (f" / {sequence_parallel_size} sequence ranks" if sequence_parallel_size > 1 else ""),
        f"{length}; {scheduler} schedule, peak lr {lr:g}, warm-up {warmup:g} of the steps",
    )


def plan_parallel(
    recipe: Recipe, env: Environment, options: RunOptions
) -> list[tuple[ParallelPlan, Decision]]:
    """How each stage uses the devices (pure decisions; raises GuardError for impossible requests)."""
    plans = []
    for stage in recipe.stages:
        footprint = gpu_memory = None
        if env.device == "cuda" and env.gpu_count > 1 and stage.parallel == "auto":
            from vlm_recipes.plan import estimate_footprint

            footprint = estimate_footprint(recipe, stage)
            gpu_memory = torch.cuda.get_device_properties(0).total_memory / 2**30
        plans.append(
            decide_parallel(
                stage.parallel,
                env,
                footprint,
                gpu_memory,
                options.nproc_per_node,
                options.node.nnodes,
                stage.training.max_memory_per_gpu,
                stage.sequence_parallel_size,
            )
        )
    return plans


# ---------------------------------------------------------------------------------------------
# The dry run


def meta_model(source: str, trust_remote_code: bool):
    config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    towers = family_for_config(config, trust_remote_code).towers_left_out
    for name in towers:  # as stages load it (model/build.py: leave_out_towers)
        if getattr(config, name, None) is not None:
            setattr(config, name, None)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config, trust_remote_code=trust_remote_code)
    return config, model


def plan_recipe(recipe: Recipe, options: RunOptions, env: Environment | None = None) -> list[dict]:
    env = env or detect_environment()
    config, model = meta_model(config_source(recipe.model), recipe.trust_remote_code)
    family = family_for_config(config, recipe.trust_remote_code)
    counts = count_params_by_role(model, family)
    run_dir = run_dir_for(recipe, options)
    try:
        launches = [plan for plan, _ in plan_parallel(recipe, env, options)]
    except GuardError as exc:
        launches = [exc] * len(recipe.stages)
    plans = []
    for index, (stage, stage_dir) in enumerate(
        zip(recipe.stages, stage_dirs(recipe, run_dir), strict=True), 1
    ):
        roles = {}
        lora_roles = {r: stage.lora.targets.get(r, []) for r in ROLES if getattr(stage.train, r) == "lora"}
        lora_params = {r: 0 for r in ROLES}
        if lora_roles:
            modules = dict(model.named_modules())
            for name in lora_target_modules(model, family, lora_roles):
                layer = modules[name]
                lora_params[family.role_of(name)] += stage.lora.rank * (
                    layer.in_features + layer.out_features
                )
            parameters = dict(model.named_parameters())
            for name in lora_target_parameters(model, family, lora_roles):
                experts, out_features, in_features = parameters[name].shape  # a LoRA per expert
                lora_params[family.role_of(name)] += stage.lora.rank * experts * (in_features + out_features)
        for role in ROLES:
            mode = getattr(stage.train, role)
            total = counts[role]["total"]
            trainable = total if mode == "full" else lora_params[role]
            roles[role] = {"mode": mode, "total": total, "trainable": trainable}
        memory, launch = None, launches[index - 1]
        scale = learning_rate_scale(recipe.model)  # recipes/learning_rates.py: demo models train faster
        learning_rate = f"{stage.training.learning_rate * scale:g}" + (
            f" (the recipe's x{scale}, for a demo model)" if scale != 1 else ""
        )
        try:
            decision = decide_precision(stage.precision, env, stage.quantized)
            precision = f"{decision.choice} ({decision.reason})"
        except GuardError as exc:
            precision = f"ERROR: {exc}"
        else:
            if isinstance(launch, ParallelPlan):  # per process, as the stage's plan places it
                adapters = sum(lora_params.values())
                memory = rank_memory(
                    model, family, stage, decision.choice, adapters, launch.mode, launch.world_size
                )
        plans.append(
            {
                "index": index,
                "name": stage.name,
                "source": describe_source(recipe, stage, index),
                "roles": roles,
                "quantization": stage.quantization.mode
                if not stage.quantized
                else f"{stage.quantization.mode} {stage.quantization.quant_type}, kept unquantized: "
                f"{', '.join(stage.quantization.skip_roles) or 'nothing'}",
                "precision": precision,
                "parallel": describe_plan(launch, env)
                if isinstance(launch, ParallelPlan)
                else f"ERROR: {launch}",
                "memory": memory,
                "sequence": sequence_plan(stage, launch.world_size)
                if isinstance(launch, ParallelPlan)
                else None,
                "lora": f"rank {stage.lora.rank}, alpha {stage.lora.alpha}" if lora_roles else "-",
                "experts": describe_experts(model, family, stage, lora_roles),
                "data": f"{describe_sources(stage.data.train)} → eval {describe_sources(stage.data.eval or '-')}",
                "training": f"{stage.training.epochs:g} epoch(s), lr {learning_rate}, "
                f"batch {stage.training.per_device_batch_size} × accum "
                f"{stage.training.gradient_accumulation_steps}",
                "output_dir": str(Path(stage_dir)),
            }
        )
    return plans


def describe_experts(model, family, stage, lora_roles: dict[str, list[str]]) -> str | None:
    """What the stage does with a mixture-of-experts language model's experts and router, and the memory
    its experts take (None: a dense model). model/build.py (expert_decisions) says why."""
    experts = expert_parameters_of_role(model, family, "llm")
    if not experts:
        return None
    text = model.config.get_text_config()
    parameters = dict(model.named_parameters())
    count = sum(parameters[name].numel() for name in experts)
    mode = stage.train.llm
    if mode == "full":
        what = "trained in full; router trained with the load-balancing loss"
    elif lora_target_parameters(model, family, lora_roles):
        what = "LoRA per expert (target_parameters); router frozen"
    else:
        what = "frozen; router frozen"
    unquantized = " (unquantized: bitsandbytes quantizes nn.Linear only)" if stage.quantized else ""
    return (
        f"{routed_experts(text)} routed, {text.num_experts_per_tok} per token: {what}; {count:,} expert weights, "
        f"{count * 2 / 2**30:.1f} GB in bf16{unquantized}"
    )


def format_plan(recipe: Recipe, plans: list[dict]) -> str:
    lines = [f"Plan for recipe {recipe.name}: {recipe.description}", f"model: {recipe.model}", ""]
    for p in plans:
        lines.append(f"stage {p['index']}: {p['name']}  (from {p['source']})")
        for role, r in p["roles"].items():
            share = f"{100 * r['trainable'] / r['total']:.1f}%" if r["total"] else "-"
            lines.append(
                f"    {role:<10} {r['mode']:<7} trainable {r['trainable']:>14,} of {r['total']:>14,} ({share})"
            )
        keys = [
            "quantization",
            "precision",
            "parallel",
            "sequence",
            "memory",
            "lora",
            "experts",
            "data",
            "training",
        ]
        for key in (*keys, "output_dir"):
            if p.get(key) is not None:
                lines.append(f"    {key:<13} " + str(p[key]).replace("\n", "\n" + " " * 18))
        lines.append("")
    return "\n".join(lines)


def estimate_footprint(recipe: Recipe, stage) -> ModelFootprint:
    """GPU memory a stage needs for weights and optimizer state, from the model's config (no weights read)."""
    config, model = meta_model(config_source(recipe.model), recipe.trust_remote_code)
    family = family_for_config(config, recipe.trust_remote_code)
    parameters = dict(model.named_parameters())
    quantized_params = sum(parameters[name].numel() for name in quantized_weights(model, family, stage))
    total = sum(p.numel() for p in model.parameters())
    bits = {"4bit": 4, "8bit": 8}.get(stage.quantization.mode, 16)
    weights = (total - quantized_params) * 2 + quantized_params * bits / 8
    counts = count_params_by_role(model, family)
    trainable = sum(counts[r]["total"] for r in ROLES if getattr(stage.train, r) == "full")
    trainable += 0.02 * sum(counts[r]["total"] for r in ROLES if getattr(stage.train, r) == "lora")
    return ModelFootprint(weights_gb=weights / 2**30, trainable_gb=trainable * 16 / 2**30)


def estimate_disk_gb(recipe: Recipe, stage) -> float:
    """Disk a stage writes at most, from the model's config (no weights read): final/ (every weight in 16
    bits, 32 in an fp32 stage; merged, so a quantized stage's too) and its kept checkpoints (the trainable
    weights and Adam's two moments in fp32, 12 bytes a parameter)."""
    config, model = meta_model(config_source(recipe.model), recipe.trust_remote_code)
    family = family_for_config(config, recipe.trust_remote_code)
    counts = count_params_by_role(model, family)
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(counts[r]["total"] for r in ROLES if getattr(stage.train, r) == "full")
    trainable += 0.02 * sum(counts[r]["total"] for r in ROLES if getattr(stage.train, r) == "lora")
    kept = stage.training.save_total_limit if stage.training.save_steps > 0 else 1  # Ctrl-C saves one
    final = total * (4 if stage.precision == "fp32" else 2)
    return (final + kept * trainable * 12) / 2**30
