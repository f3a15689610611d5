"""How a stage uses the devices: decisions (pure), the launcher command, and the process group.

Never torch.nn.DataParallel. One process with several GPUs either shards the model (model-parallel,
Trainer n_gpu forced to 1) or the runner launches one process per GPU (DDP through torchrun; FSDP and
DeepSpeed through accelerate with the configs in configs/accelerate/).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import PartialState
from accelerate.utils import broadcast_object_list, gather_object

from vlm_recipes.stages.guards import Decision, Environment, GuardError

CONFIGS_DIR = Path(__file__).resolve().parents[3] / "configs" / "accelerate"
DEFAULT_ACCELERATE_CONFIG = {"fsdp": "fsdp", "deepspeed": "zero2"}  # names of files in configs/accelerate/
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
        if env.device == "cpu" and mode != "ddp":
            raise GuardError(f"--parallel {mode} needs GPUs; on CPU use ddp (gloo) or single")
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
    return plan, Decision(
        "launch", describe_plan(plan, env), _reason(requested, plan, env, footprint, gpu_memory_gb)
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
    rows: int,
    epochs: float,
    max_steps: int,
    lr: float,
    scheduler: str,
    warmup: float,
) -> Decision:
    """What a user comparing 1 GPU and N GPUs must know: the global batch and the steps it gives."""
    global_batch = per_device * accumulation * plan.world_size
    steps_per_epoch = max(1, -(-rows // (per_device * plan.world_size)) // accumulation)
    steps = max_steps if max_steps > 0 else int(steps_per_epoch * epochs)
    return Decision(
        "batch",
        f"global batch {global_batch} = {per_device} per device × {accumulation} accumulation × "
        f"{plan.world_size} process(es)",
        f"{rows} rows → {steps_per_epoch} steps/epoch, {steps} steps; {scheduler} schedule, peak lr {lr:g}, "
        f"warm-up {warmup:g} of the steps",
    )


# ---------------------------------------------------------------------------------------------
# Launching


@dataclass(frozen=True)
class NodeSettings:
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    accelerate_config: str | None = None  # a name in configs/accelerate/ (zero3) or a path


def accelerate_config_path(mode: str, choice: str | None) -> Path:
    """`--accelerate-config zero3` or a path; by default fsdp.yaml for fsdp, zero2.yaml for deepspeed."""
    choice = choice or DEFAULT_ACCELERATE_CONFIG[mode]
    path = Path(choice)
    if path.suffix in (".yaml", ".yml", ".json"):
        if not path.is_file():
            raise GuardError(f"--accelerate-config {choice}: no such file")
        return path
    named = CONFIGS_DIR / f"{choice}.yaml"
    if not named.is_file():
        names = ", ".join(sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml")))
        raise GuardError(
            f"--accelerate-config {choice}: not one of {names} (or give a path to a config file)"
        )
    return named


def launch_command(plan: ParallelPlan, script_args: list[str], node: NodeSettings) -> list[str]:
    """The command that starts one process per device on this node running `train_recipe.py script_args`."""
    script = str(Path(sys.argv[0]).resolve()) if sys.argv and sys.argv[0].endswith(".py") else "-m"
    target = [script] if script != "-m" else ["-m", "vlm_recipes"]
    if plan.mode == "ddp":
        rendezvous = (
            ["--standalone"]
            if node.nnodes == 1
            else [
                "--nnodes",
                str(node.nnodes),
                "--node_rank",
                str(node.node_rank),
                "--master_addr",
                node.master_addr,
                "--master_port",
                str(node.master_port),
            ]
        )
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(plan.processes_per_node),
            *rendezvous,
            *target,
            *script_args,
        ]
    config = accelerate_config_path(plan.mode, node.accelerate_config)
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(config),
        "--num_processes",
        str(plan.world_size),
        "--num_machines",
        str(node.nnodes),
        "--machine_rank",
        str(node.node_rank),
        "--main_process_ip",
        node.master_addr,
        "--main_process_port",
        str(node.master_port),
        *target,
        *script_args,
    ]


# ---------------------------------------------------------------------------------------------
# Inside a launched process: accelerate's process state (the one Trainer uses too)


def process_state() -> PartialState:
    """This process's place in the group torchrun/accelerate launched (one process when not launched).
    Initialises the process group once; gloo on CPU."""
    return PartialState(cpu=not torch.cuda.is_available())


def broadcast_from_main(state: PartialState, value):
    """Rank 0's value, on every rank."""
    if state.num_processes == 1:
        return value
    return broadcast_object_list([value], from_process=0)[0]


def gather_from_ranks(state: PartialState, value) -> list:
    """Every rank's value, in rank order, on every rank."""
    if state.num_processes == 1:
        return [value]
    return gather_object([value])


def launched() -> bool:
    """True inside a process that torchrun or accelerate started (it must not launch again)."""
    return "LOCAL_RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1
