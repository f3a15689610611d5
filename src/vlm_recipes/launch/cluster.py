"""Where a launch gets its numbers: the nodes, this node's index, the rendezvous host and port, the
processes per node and the restarts. Each comes from the first place that has it: the command line, then
SLURM (inside `srun`), then Kubernetes (Kubeflow's PET_ variables; PyTorchJob's MASTER_ADDR, MASTER_PORT,
WORLD_SIZE and RANK), else a default. A cluster scheduler only supplies numbers: torchrun's elastic agent
does the launching and the restarts. Every number comes back as a decision naming its source, for the log
and --dry-run. Pure: the environment is passed in."""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from dataclasses import dataclass

from vlm_recipes.decisions import Decision
from vlm_recipes.errors import GuardError
from vlm_recipes.runs.layout import NodeSettings

DEFAULT_PORT = 29500
SBATCH_EXAMPLE = "configs/slurm/train.sbatch"


@dataclass(frozen=True)
class Requested:
    """What the command line gave; None where a flag was not given."""

    nnodes: int | None = None
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    nproc_per_node: int | None = None
    max_restarts: int | None = None
    accelerate_config: str | None = None


@dataclass(frozen=True)
class Placement:
    node: NodeSettings
    nproc_per_node: int | None  # None: one process per visible GPU, one on a CPU
    decisions: tuple[Decision, ...]
    read_as_pods: tuple[str, ...] = ()  # PyTorchJob's RANK and WORLD_SIZE, read as this pod's node numbers

    @property
    def all_defaults(self) -> bool:
        return all(decision.reason.startswith("default") for decision in self.decisions)


# ---------------------------------------------------------------------------------------------
# SLURM's compressed host lists


def expand_hostlist(hostlist: str, variable: str = "the host list") -> list[str]:
    """SLURM's compressed host list (`node[01-03,07],gpu5`, `rack[1-2]-gpu[1-2]`) as host names, in order.
    Parsed here, not by `scontrol show hostnames`: scontrol is often missing inside the containers jobs
    run in (enroot/pyxis, Apptainer), and on a large job every node would query slurmctld at once."""
    hosts = []
    for item in _split_outside_brackets(hostlist, variable):
        pieces = []
        for part in re.split(r"(\[[^\[\]]*\])", item):
            if part.startswith("["):
                pieces.append(_expand_ranges(part[1:-1], hostlist, variable))
            elif "[" in part or "]" in part:
                raise GuardError(f"{variable}={hostlist}: unbalanced brackets in `{item}`")
            elif part:
                pieces.append([part])
        hosts += ["".join(choice) for choice in itertools.product(*pieces)]
    return hosts


def _split_outside_brackets(hostlist: str, variable: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, char in enumerate(hostlist):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise GuardError(f"{variable}={hostlist}: unbalanced brackets")
        if char == "," and depth == 0:
            items.append(hostlist[start:i])
            start = i + 1
    items.append(hostlist[start:])
    if depth or not all(items):
        raise GuardError(f"{variable}={hostlist}: not a SLURM host list (e.g. node[01-03],gpu5)")
    return items


def _expand_ranges(ranges: str, hostlist: str, variable: str) -> list[str]:
    """`01-03,07` -> 01 02 03 07: a range keeps the width of its first number (SLURM's zero padding)."""
    names = []
    for part in ranges.split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or not (high or low).isdigit() or int(high or low) < int(low):
            raise GuardError(f"{variable}={hostlist}: `[{ranges}]` is not a list of numbers and ranges")
        names += [str(n).zfill(len(low)) for n in range(int(low), int(high or low) + 1)]
    return names


# ---------------------------------------------------------------------------------------------
# What the schedulers set: {number: (value, where it came from)}


def from_slurm(environ: Mapping[str, str]) -> dict[str, tuple[object, str]]:
    """Inside `srun` (SLURM_STEP_ID set): the step's nodes, this node's index, the first host of the step,
    and the GPUs it gave this node. The batch script itself runs on the first node only: a job of several
    nodes there is refused, since the other nodes would never join."""
    if "SLURM_JOB_ID" not in environ:
        return {}
    job_nodes = _first(environ, "SLURM_JOB_NUM_NODES", "SLURM_NNODES")
    if "SLURM_STEP_ID" not in environ:
        if (
            job_nodes and job_nodes[0].isdigit() and int(job_nodes[0]) > 1
        ):  # an error only where no --nnodes overrides it
            outside = GuardError(
                f"this SLURM job has {job_nodes[0]} nodes ({job_nodes[1]}), but the command runs outside srun, "
                f"on one of them. Start it with `srun` (one task per node, as {SBATCH_EXAMPLE} does), or give "
                "--nnodes 1 to train on this node alone"
            )
            return {"nnodes": (outside, job_nodes[1])}
        return {}
    found: dict[str, tuple[object, str]] = {}
    if nodes := _first(environ, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"):
        found["nnodes"] = (_whole_number(environ, nodes[1]), nodes[1])
        tasks = _first(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
        if tasks and tasks[0].isdigit() and nodes[0].isdigit() and int(tasks[0]) > int(nodes[0]):
            raise GuardError(
                f"srun started {tasks[0]} tasks ({tasks[1]}) on {nodes[0]} node(s), and each would start its "
                "own processes. Run one task per node (`#SBATCH --ntasks-per-node=1`, as "
                f"{SBATCH_EXAMPLE} does): the runner starts one process per GPU itself (--nproc-per-node)"
            )
    if "SLURM_NODEID" in environ:
        found["node_rank"] = (_whole_number(environ, "SLURM_NODEID"), "SLURM_NODEID")
    if hostlist := _first(environ, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        first = expand_hostlist(hostlist[0], hostlist[1])[0]
        found["master_addr"] = (first, f"the first host of {hostlist[1]}={hostlist[0]}")
    # two jobs sharing their first node must not share a rendezvous port
    job = environ["SLURM_JOB_ID"]
    if job.isdigit():
        port = DEFAULT_PORT + int(job) % 1000
        found["master_port"] = (port, f"{DEFAULT_PORT} + SLURM_JOB_ID {job} mod 1000")
    if (gpus := environ.get("SLURM_GPUS_ON_NODE", "")).isdigit() and int(gpus) > 0:
        found["nproc_per_node"] = (int(gpus), "SLURM_GPUS_ON_NODE: one process per GPU of this node")
    return found


def from_kubernetes(environ: Mapping[str, str]) -> dict[str, tuple[object, str]]:
    """Kubeflow's PET_ variables (torchrun's own names for its flags: the Trainer's torch runtime, and a
    PyTorchJob with an elastic policy), then a PyTorchJob's MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK.
    In a pod those count pods, one node each; they are read only outside torchrun (no LOCAL_RANK)."""
    found: dict[str, tuple[object, str]] = {}
    pod = "KUBERNETES_SERVICE_HOST" in environ and "LOCAL_RANK" not in environ
    for name, pet, pod_variable in (
        ("nnodes", "PET_NNODES", "WORLD_SIZE"),
        ("node_rank", "PET_NODE_RANK", "RANK"),
    ):
        if pet in environ:
            found[name] = (_whole_number(environ, pet, nnodes=name == "nnodes"), pet)
        elif pod and pod_variable in environ:
            found[name] = (_whole_number(environ, pod_variable), f"{pod_variable} (PyTorchJob: pods)")
    if endpoint := environ.get("PET_RDZV_ENDPOINT"):
        host, _, port = endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise GuardError(f"PET_RDZV_ENDPOINT={endpoint}: give HOST:PORT")
        found["master_addr"] = (host, "PET_RDZV_ENDPOINT")
        found["master_port"] = (int(port), "PET_RDZV_ENDPOINT")
    for name, variables in (
        ("master_addr", ("PET_MASTER_ADDR", "MASTER_ADDR")),
        ("master_port", ("PET_MASTER_PORT", "MASTER_PORT")),
    ):
        for variable in variables:
            if name not in found and variable in environ and (variable.startswith("PET_") or pod):
                value = environ[variable]
                found[name] = (_whole_number(environ, variable) if name == "master_port" else value, variable)
    if (procs := environ.get("PET_NPROC_PER_NODE", "")).isdigit():
        found["nproc_per_node"] = (int(procs), "PET_NPROC_PER_NODE")
    if "PET_MAX_RESTARTS" in environ:
        found["max_restarts"] = (_whole_number(environ, "PET_MAX_RESTARTS"), "PET_MAX_RESTARTS")
    return found


def _first(environ: Mapping[str, str], *variables: str) -> tuple[str, str] | None:
    """(value, variable) of the first variable set."""
    return next(((environ[v], v) for v in variables if environ.get(v)), None)


def _whole_number(environ: Mapping[str, str], variable: str, nnodes: bool = False) -> int | GuardError:
    """The variable's number, or the error to raise if it is used (a flag given may override it)."""
    try:
        return _parse_whole_number(environ[variable], variable, nnodes)
    except GuardError as error:
        return error


def _parse_whole_number(value: str, variable: str, nnodes: bool) -> int:
    low, _, high = value.partition(":")
    if nnodes and high and low == high:  # torchrun's MIN:MAX, fixed
        value = low
    if nnodes and high and low != high:
        raise GuardError(
            f"{variable}={value}: an elastic range of nodes. Runs need a fixed number: node 0 creates the run "
            "directory, and the global batch is fixed per stage. Set minReplicas = maxReplicas, or give --nnodes N"
        )
    if not value.isdigit():
        raise GuardError(f"{variable}={value}: expected a whole number")
    return int(value)


# ---------------------------------------------------------------------------------------------
# The decision


def resolve_placement(requested: Requested, environ: Mapping[str, str]) -> Placement:
    """Each number from the command line, else SLURM, else Kubernetes, else its default (see the module)."""
    found = {**from_kubernetes(environ), **from_slurm(environ)}
    flags = {
        "nnodes": "--nnodes",
        "node_rank": "--node-rank",
        "master_addr": "--master-addr",
        "master_port": "--master-port",
        "nproc_per_node": "--nproc-per-node",
        "max_restarts": "--max-restarts",
    }
    defaults = {
        "nnodes": (1, "default"),
        "node_rank": (0, "default"),
        "master_addr": ("127.0.0.1", "default"),
        "master_port": (DEFAULT_PORT, "default"),
        "nproc_per_node": (None, "default"),
        "max_restarts": (0, "default"),
    }
    chosen = {
        name: (getattr(requested, name), flag)
        if getattr(requested, name) is not None
        else found.get(name, defaults[name])
        for name, flag in flags.items()
    }
    value = {name: chosen[name][0] for name in chosen}
    source = {name: chosen[name][1] for name in chosen}
    if errors := [v for v in value.values() if isinstance(v, GuardError)]:
        raise errors[0]
    if value["nnodes"] > 1 and source["node_rank"] == "default":  # every node would think itself node 0
        raise GuardError(
            f"{value['nnodes']} nodes ({source['nnodes']}) but no index for this node: give --node-rank (0 on "
            "the node that creates the run directory), or set PET_NODE_RANK"
        )
    if not 0 <= value["node_rank"] < value["nnodes"]:
        raise GuardError(
            f"node rank {value['node_rank']} ({source['node_rank']}) with {value['nnodes']} node(s) "
            f"({source['nnodes']}): give 0 to {value['nnodes'] - 1}"
        )
    node = NodeSettings(
        value["nnodes"],
        value["node_rank"],
        value["master_addr"],
        value["master_port"],
        requested.accelerate_config,
        value["max_restarts"],
    )
    pods = tuple(v for v in ("WORLD_SIZE", "RANK") if any(s.startswith(f"{v} ") for s in source.values()))
    return Placement(
        node, value["nproc_per_node"], describe_placement(node, value["nproc_per_node"], source), pods
    )


def describe_placement(node: NodeSettings, nproc_per_node: int | None, source: dict[str, str]) -> tuple:
    if node.nnodes > 1:
        where = f"c10d at {node.master_addr}:{node.master_port}"
        why = f"host: {source['master_addr']}; port: {source['master_port']}"
    else:
        where, why = "c10d at localhost, a free port", "default: one node"
    restarts = (
        f"torchrun's elastic agent restarts a failed group up to {node.max_restarts} time(s); it resumes "
        "from its last complete checkpoint"
        if node.max_restarts
        else "a failed rank fails the run (--max-restarts N restarts it)"
    )
    procs = str(nproc_per_node) if nproc_per_node else "one per visible GPU (1 on a CPU)"
    return (
        Decision("nodes", str(node.nnodes), source["nnodes"]),
        Decision("node-rank", str(node.node_rank), source["node_rank"]),
        Decision("processes-per-node", procs, source["nproc_per_node"]),
        Decision("rendezvous", where, why),
        Decision("restarts", str(node.max_restarts), f"{source['max_restarts']}: {restarts}"),
    )


def format_placement(placement: Placement, rendezvous_ids: list[str]) -> str:
    """The --dry-run's launch block: each number and where it came from, and each launched group's id."""
    lines = ["launch (every node runs this same command):"]
    lines += [f"    {d.guard:<19} {d.choice}  ({d.reason})" for d in placement.decisions]
    lines += [f"    {'rendezvous id':<19} {rendezvous}" for rendezvous in rendezvous_ids]
    return "\n".join(lines)
