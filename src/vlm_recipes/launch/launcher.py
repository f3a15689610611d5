"""Start a stage's process group on this node (torchrun for DDP, accelerate launch for FSDP and DeepSpeed
with the configs shipped in the repository's configs/) and wait for it.

Never torch.nn.DataParallel: a stage that needs several devices either shards the model in one process
(model-parallel) or runs one process per device, launched here. What each stage needs is decided in
`plan.py`; the children continue the same run directory, sharing its lock (runs/lock.py).

Both launchers meet through torchrun's c10d rendezvous, and its elastic agent restarts a failed group
(--max-restarts): the children are given --resume, so a restarted group continues from the last complete
checkpoint. No supervisor of our own. Where the numbers come from (flags, SLURM, Kubernetes): cluster.py.
On several nodes, node 0 hosts the rendezvous store, and each node advertises the address it reaches node 0
from, rather than torchrun's guesses from the host name (tests/test_hosts.py: two hosts, a real SLURM).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from fcntl import ioctl
from pathlib import Path

from vlm_recipes.errors import GuardError, RunExistsError
from vlm_recipes.files import read_json
from vlm_recipes.launch.rank_failures import NODE_RANK_ENV, clear_records, root_cause
from vlm_recipes.plan import ParallelPlan
from vlm_recipes.runs.layout import NodeSettings
from vlm_recipes.runs.lock import LOCK_HELD_ENV, held_lock_fd
from vlm_recipes.shipped import shipped_dir

log = logging.getLogger(__name__)

CONFIGS_DIR = shipped_dir("configs")  # the repository's configs/, or the installed package's copy
DEFAULT_ACCELERATE_CONFIG = {"fsdp": "fsdp", "deepspeed": "zero2"}  # names of files in CONFIGS_DIR
SIOCGIFADDR = 0x8915  # Linux's ioctl: an interface's IPv4 address


# ---------------------------------------------------------------------------------------------
# Launching


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


def rendezvous_id(run_dir: Path, last_stage: int) -> str:
    """The same on every node (recipe and run name), and new for each launched group of stages: a node
    that starts the next group early never joins the previous group's closed rendezvous."""
    return f"{run_dir.parent.name}-{run_dir.name}-stage{last_stage}"


def rendezvous_endpoint(node: NodeSettings) -> str:
    """Node 0's address on several nodes; on one, a free port on this machine (as torchrun --standalone)."""
    return f"{node.master_addr}:{node.master_port}" if node.nnodes > 1 else "localhost:0"


def this_node_address(node: NodeSettings) -> str | None:
    """On several nodes, the address this node reaches node 0 from (node 0's own address on node 0): the
    kernel's choice of route, read from a UDP socket connected to node 0, which sends nothing. torchrun
    would advertise `socket.getfqdn()`, and gloo bind to what the host name resolves to. Both fail where the
    name resolves to a loopback address (Debian's /etc/hosts: 127.0.1.1), or names no reachable address
    (containers, network namespaces: seen in tests/test_hosts.py). None on one node, or where node 0's
    address does not resolve here (a dry run off the cluster). PET_LOCAL_ADDR, torchrun's own variable for
    --local-addr, wins where the user set it."""
    if node.nnodes == 1:
        return None
    if given := os.environ.get("PET_LOCAL_ADDR"):
        return given
    try:
        family, kind, _, _, address = socket.getaddrinfo(
            node.master_addr, node.master_port, type=socket.SOCK_DGRAM
        )[0]
        with socket.socket(family, kind) as probe:
            probe.connect(address)
            return probe.getsockname()[0]
    except OSError:
        return None


def interface_with_address(address: str) -> str | None:
    """The network interface holding an IPv4 address (Linux's SIOCGIFADDR), else None."""
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                request = ioctl(probe.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address, or not Linux
                continue
        if socket.inet_ntoa(request[20:24]) == address:
            return name
    return None


def rendezvous_flags(node: NodeSettings) -> list[str]:
    """On several nodes: which node hosts the rendezvous store, and the address this node advertises.
    torchrun guesses the host by comparing node 0's address with this machine's name and addresses; a miss
    (an address on a second interface, a name resolving to 127.0.1.1) leaves every node a client of a store
    nobody serves ("The connection to the C10d store has failed"). Node 0 hosts it, by definition of the
    rendezvous address; the others are told they do not, or one on node 0's machine could take its port."""
    if node.nnodes == 1:
        return []
    flags = ["--rdzv_conf", f"is_host={int(node.node_rank == 0)}"]
    if address := this_node_address(node):
        flags += ["--local_addr", address]
    return flags


def launch_command(
    plan: ParallelPlan, script_args: list[str], node: NodeSettings, rendezvous: str
) -> list[str]:
    """The command that starts one process per device on this node running `train_recipe.py script_args`,
    through torchrun's c10d rendezvous (id `rendezvous`) and its elastic agent, which restarts a failed
    group up to `node.max_restarts` times (the group resumes: its arguments hold --resume)."""
    script = str(Path(sys.argv[0]).resolve()) if sys.argv and sys.argv[0].endswith(".py") else "-m"
    target = [script] if script != "-m" else ["-m", "vlm_recipes"]
    if plan.mode == "ddp":
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(plan.processes_per_node),
            "--nnodes",
            str(node.nnodes),
            "--rdzv_backend",
            "c10d",
            "--rdzv_endpoint",
            rendezvous_endpoint(node),
            "--rdzv_id",
            rendezvous,
            "--max_restarts",
            str(node.max_restarts),
            *rendezvous_flags(node),
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
        "--rdzv_backend",
        "c10d",
        "--max_restarts",
        str(node.max_restarts),
        *rendezvous_flags(node)[:2],  # accelerate's own --rdzv_conf; --local_addr: PET_LOCAL_ADDR below
        *target,
        *script_args,
    ]


def launch_environment(plan: ParallelPlan, node: NodeSettings, rendezvous: str) -> dict[str, str]:
    """The launcher's environment. TORCH_DISABLE_SHARE_RDZV_TCP_STORE: with the agent's store shared, a
    restarted group reads the failed group's addresses from it, and gloo's first connection is refused
    (measured on torch 2.14; pytorch#135712, #167288); unshared, rank 0 of each group hosts a store of its
    own, new at each restart. Accelerate launch has no flag for the rendezvous id, nor on one machine for
    the endpoint: it hands its arguments to torchrun's parser, which reads each flag it is not given from
    PET_<FLAG> (torch.distributed.argparse_util); set here, they also override a pod's own PET_ values.
    On several nodes: gloo's interface (gloo_interface), and for accelerate this node's address."""
    common = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **gloo_interface(node)}
    if plan.mode == "ddp":
        return common
    local = {"PET_LOCAL_ADDR": address} if (address := this_node_address(node)) else {}
    return {
        **common,
        **local,
        "PET_RDZV_ID": rendezvous,
        "PET_RDZV_ENDPOINT": rendezvous_endpoint(node),
        "PET_NNODES": str(node.nnodes),
    }


def gloo_interface(node: NodeSettings) -> dict[str, str]:
    """On several nodes, gloo binds to the interface holding this node's address toward node 0
    (GLOO_SOCKET_IFNAME), unless the user chose one. Left alone, gloo binds to the address the host name
    resolves to, and falls back to the loopback interface, which no other node reaches."""
    if node.nnodes == 1 or "GLOO_SOCKET_IFNAME" in os.environ:
        return {}
    address = this_node_address(node)
    interface = interface_with_address(address) if address else None
    if not interface:
        return {}
    log.info(
        "gloo binds to %s, the interface holding %s (this node's address toward node 0)", interface, address
    )
    return {"GLOO_SOCKET_IFNAME": interface}


# ---------------------------------------------------------------------------------------------
# Inside a launched process: accelerate's process state (the one Trainer uses too)


def run_launched(command: list[str], run_dir: Path, env: dict[str, str], node_rank: int = 0) -> None:
    """Run a launcher command (torchrun / accelerate) to its end. The children are one writer with this
    process: they are told this process holds the run's lock, and inherit the locked file, so the lock
    stays held while any of them lives (even if this process is killed). A failed group raises
    LaunchFailed with the first failing rank's record (launch/rank_failures.py)."""
    clear_records(run_dir)  # the records of a group launched before
    env = {**env, NODE_RANK_ENV: str(node_rank)}  # each rank's record names its node
    # Every node's children are told: c10d ranks nodes by host and process id, so rank 0 (the writer) may
    # run on a node whose launcher does not hold the lock (node 0's does, for the whole group).
    child_env = {**os.environ, **env, LOCK_HELD_ENV: str(run_dir.resolve())}
    lock_fd = held_lock_fd(run_dir)
    process = subprocess.Popen(command, env=child_env, pass_fds=(lock_fd,) if lock_fd is not None else ())
    try:
        code = process.wait()
    except KeyboardInterrupt as exc:  # the children got Ctrl-C too; SIGTERM only this process: pass it on
        if exc.args == ("SIGTERM",):
            process.send_signal(signal.SIGTERM)  # torchrun and accelerate pass it to their workers
        log.warning(
            "%s: waiting for the launched processes to save and stop", exc.args[0] if exc.args else "Ctrl-C"
        )
        try:
            process.wait(timeout=300)
        except (KeyboardInterrupt, subprocess.TimeoutExpired):
            process.kill()
            process.wait()
        raise
    if code != 0:
        raise LaunchFailed(code, run_dir)


class LaunchFailed(RuntimeError):
    """A launched process group failed. Its message is the first failing rank's record: the rank, its host
    and node, and its error (or the rank that was lost); torchrun alone says only which process exited."""

    def __init__(self, code: int, run_dir: Path):
        self.cause = root_cause(run_dir)
        super().__init__(
            self.cause.message() if self.cause else f"the launched processes exited with code {code}"
        )
        self.code = code
        self.run_dir = run_dir
        self.resume_overrides = self.cause.resume_overrides if self.cause else ()

    def recorded_exit_code(self) -> int:
        """The exit code of the failing rank's error (bad input 2, diverged 3, ...), from its record, else
        from run.json, else the launcher's own."""
        if self.cause is not None:
            return self.cause.exit_code
        try:
            return int(read_json(self.run_dir / "run.json").get("exit_code") or self.code)
        except (OSError, ValueError, TypeError):
            return self.code


def wait_for(path: Path, seconds: float) -> None:
    deadline = time.time() + seconds
    while not path.exists():
        if time.time() > deadline:
            raise RunExistsError(f"{path} did not appear within {seconds:.0f} s: is node 0 running this run?")
        time.sleep(1.0)
