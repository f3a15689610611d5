"""Two hosts for real (issue 77): two network namespaces joined by a veth pair, each with its own address
(10.77.0.1 and 10.77.0.2), stand for two machines. r3-two-stage runs as 2 nodes x 1 process, one node in
each namespace, first started by hand through the runner's c10d rendezvous, then by a real SLURM (Debian's
slurmctld, two slurmd and munged) through the shipped configs/slurm/train.sbatch. Both end bit for bit
where 2 processes on one host end: the same 2 ranks, the same batches, and a gloo sum of 2 gradients is
the same in either order. So the floor is 0, and the test asserts equality.

A network namespace has its own interfaces and ports, not its own files: both see the same /tmp, as the
nodes of a cluster see its shared home. The run directory lives there. Root is needed (`ip netns`)."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import REPO, TRAIN, folder_like_a_clone, run_train
from safetensors.torch import load_file
from test_parallel import QUICK

from vlm_recipes.demo.models import ensure_demo_model
from vlm_recipes.files import read_json

STAGES = ("stage-1-vision-full", "stage-2-llm-lora")
R3 = ["--recipe", "r3-two-stage", *QUICK]
NODE_NAMES = ("node1", "node2")  # SLURM's node list: node[1-2]
ADDRESSES = ("10.77.0.1", "10.77.0.2")
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # every rank alike (torchrun sets it only for several per node)


# ---------------------------------------------------------------------------------------------
# Two hosts: network namespaces


@dataclass(frozen=True)
class Hosts:
    namespaces: tuple[str, str]
    interfaces: tuple[str, str]
    hosts_file: Path  # node1 and node2 by address: the cluster's name service

    def ip_netns_exec(self, host: int, command: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[host], *command]

    def on_host(self, host: int, command: list[str]) -> list[str]:
        """`command` in the host's network namespace, the node names resolving through `hosts_file`.
        Not `ip netns exec`: it mounts a fresh /sys without the cgroup hierarchies, and slurmd stops
        ("No filesystem mounted on /sys/fs/cgroup")."""
        bind_hosts = 'mount --bind "$0" /etc/hosts && exec "$@"'  # in a mount namespace of its own
        return [
            "nsenter",
            f"--net=/run/netns/{self.namespaces[host]}",
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            bind_hosts,
            str(self.hosts_file),
            *command,
        ]


def run_quietly(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def why_no_two_hosts() -> str | None:
    if os.geteuid() != 0:
        return "two hosts need root: ip netns and veth pairs"
    if missing := [tool for tool in ("ip", "nsenter", "unshare") if not shutil.which(tool)]:
        return f"two hosts need iproute2 and util-linux: {missing} not found"
    return None


def why_no_slurm() -> str | None:
    if missing := [tool for tool in SLURM_TOOLS if not shutil.which(tool)]:
        return (
            f"SLURM is not installed ({', '.join(missing)}): apt-get install slurm-wlm munge (.ci/run does)"
        )
    return None


SLURM_TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo")
# skipped before the shared one-host run starts, where the machine cannot run them
needs_two_hosts = pytest.mark.skipif(bool(why_no_two_hosts()), reason=why_no_two_hosts() or "")
needs_slurm = pytest.mark.skipif(bool(why_no_slurm()), reason=why_no_slurm() or "")


@pytest.fixture
def two_hosts(tmp_path) -> Iterator[Hosts]:
    """Two namespaces joined by a veth pair, loopback up, named uniquely per run (leftovers never
    collide). Torn down always: every process still inside is killed first, or its namespace outlives
    `ip netns del`."""
    if why := why_no_two_hosts():
        pytest.skip(why)
    tag = f"vr77{secrets.token_hex(3)}"
    namespaces, interfaces = (f"{tag}-a", f"{tag}-b"), (f"{tag}a", f"{tag}b")
    probe = run_quietly("ip", "netns", "add", namespaces[0])
    if probe.returncode != 0:
        pytest.skip(f"`ip netns add` is impossible here: {probe.stderr.strip()}")
    try:
        veth = run_quietly("ip", "link", "add", interfaces[0], "type", "veth", "peer", "name", interfaces[1])
        if veth.returncode != 0:
            pytest.skip(f"a veth pair is impossible here: {veth.stderr.strip()}")
        steps = [["ip", "netns", "add", namespaces[1]]]
        for namespace, interface, address in zip(namespaces, interfaces, ADDRESSES, strict=True):
            steps += [
                ["ip", "link", "set", interface, "netns", namespace],
                ["ip", "-n", namespace, "addr", "add", f"{address}/24", "dev", interface],
                ["ip", "-n", namespace, "link", "set", "lo", "up"],
                ["ip", "-n", namespace, "link", "set", interface, "up"],
            ]
        for step in steps:
            done = run_quietly(*step)
            assert done.returncode == 0, f"{' '.join(step)}: {done.stderr}"
        hosts_file = tmp_path / "hosts"
        names = "".join(f"{a} {n}\n" for a, n in zip(ADDRESSES, NODE_NAMES, strict=True))
        hosts_file.write_text(f"127.0.0.1 localhost\n{names}")
        yield Hosts(namespaces, interfaces, hosts_file)
    finally:
        for namespace in namespaces:
            for pid in run_quietly("ip", "netns", "pids", namespace).stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            run_quietly("ip", "netns", "del", namespace)
        run_quietly("ip", "link", "del", interfaces[0])  # only if the pair never left this namespace


# ---------------------------------------------------------------------------------------------
# The reference: 2 processes on one host


@pytest.fixture(scope="module")
def one_host(tmp_path_factory, private_demo_cache) -> Path:
    ensure_demo_model("demo:tiny-qwen2-vl")  # built once here, not raced by the nodes
    out = tmp_path_factory.mktemp("one-host")
    result = run_train(
        *R3, "--nproc-per-node", "2", "--output-dir", str(out), "--run-name", "one", env=threads()
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return out / "r3-two-stage" / "one"


def threads() -> dict[str, str]:
    return {**os.environ, **ONE_THREAD}


def final_weights(run_dir: Path, stage: str) -> dict[str, torch.Tensor]:
    return load_file(run_dir / stage / "final" / "model.safetensors")


def assert_ends_where_one_host_ends(run_dir: Path, one_host: Path) -> list[float]:
    """Both stages as 2 DDP ranks of a global batch of 8, each final/ equal to one host's, bit for bit;
    returns how far each stage moved the weights it started from (the equality is no accident of
    untrained weights)."""
    assert read_json(run_dir / "run.json")["status"] == "finished"
    moved = []
    started = load_file(ensure_demo_model("demo:tiny-qwen2-vl") / "model.safetensors")
    for stage in STAGES:
        decisions = {d["guard"]: d["choice"] for d in read_json(run_dir / stage / "report.json")["decisions"]}
        assert decisions["parallelism"].startswith("DistributedDataParallel"), decisions["parallelism"]
        assert "global batch 8 = 4 per device × 1 accumulation × 2 process(es)" in decisions["batch"]
        assert decisions["same-start"] == "identical on 2 ranks"
        here, reference = final_weights(run_dir, stage), final_weights(one_host, stage)
        assert here.keys() == reference.keys(), stage
        assert all(torch.equal(here[k], reference[k]) for k in here), stage
        moved.append(max((reference[k] - started[k]).abs().max().item() for k in started))
        started = reference
    assert min(moved) > 1e-5, moved  # measured: 4.0e-5 (stage 1, lr 2e-5), 9.0e-4 (stage 2)
    return moved


# ---------------------------------------------------------------------------------------------
# Two hosts by hand


@needs_two_hosts
def test_in_a_namespace_the_launcher_names_the_store_host_and_its_own_address(two_hosts):
    """The fix that made two hosts meet. There torchrun's own guesses miss: node 0 does not recognise
    10.77.0.1 as its own (the host name resolves elsewhere), so no node served the rendezvous store ("The
    connection to the C10d store has failed" on both). The launcher tells node 0 it hosts the store, each
    node advertises its address toward node 0, and gloo binds to that address's interface, not to the
    host name's (a loopback address here, which no other node reaches)."""
    probe = textwrap.dedent("""\
        import sys
        from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname
        from vlm_recipes.launch.launcher import launch_command, launch_environment
        from vlm_recipes.plan import ParallelPlan
        from vlm_recipes.runs.layout import NodeSettings
        try:  # torchrun's guess: is 10.77.0.1 this machine?
            guessed = _matches_machine_hostname("10.77.0.1")
        except OSError:  # the host name resolves nowhere: torchrun fails outright
            guessed = False
        node, plan = NodeSettings(2, int(sys.argv[1]), "10.77.0.1", 29400), ParallelPlan("ddp", 1)
        print(guessed, launch_environment(plan, node, "r").get("GLOO_SOCKET_IFNAME"))
        print(" ".join(launch_command(plan, [], node, "r")))
        """)
    for host in (0, 1):
        done = subprocess.run(
            two_hosts.ip_netns_exec(host, [sys.executable, "-c", probe, str(host)]),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        guessed, command = done.stdout.splitlines()
        assert guessed == f"False {two_hosts.interfaces[host]}"  # torchrun's guess misses; gloo's interface
        assert f"--rdzv_conf is_host={int(host == 0)} --local_addr {ADDRESSES[host]}" in command


@pytest.mark.e2e
@needs_two_hosts
def test_two_hosts_end_where_two_processes_on_one_host_end(two_hosts, one_host, tmp_path):
    """2 nodes x 1 process, node 0 in one namespace and node 1 in the other (`ip netns exec`), meeting at
    node 0's address through the runner's c10d rendezvous; the run directory on the /tmp both see."""
    port = "29400"  # the namespace is new: nothing else listens there
    nodes = [
        subprocess.Popen(
            two_hosts.ip_netns_exec(
                host,
                [
                    *TRAIN,
                    *R3,
                    "--output-dir",
                    str(tmp_path),
                    "--run-name",
                    "two-hosts",
                    "--nnodes",
                    "2",
                    "--node-rank",
                    str(host),
                    "--nproc-per-node",
                    "1",
                    "--master-addr",
                    ADDRESSES[0],
                    "--master-port",
                    port,
                ],
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=threads(),
        )
        for host in (0, 1)
    ]
    outputs = [node.communicate(timeout=600) for node in nodes]
    for host, (node, (_, err)) in enumerate(zip(nodes, outputs, strict=True)):
        assert node.returncode == 0, err[-4000:]
        assert f"--local_addr {ADDRESSES[host]}" in err  # the launch command, logged
    assert_ends_where_one_host_ends(tmp_path / "r3-two-stage" / "two-hosts", one_host)


# ---------------------------------------------------------------------------------------------
# A real SLURM on the two hosts

SLURMCTLD_PORT, SLURMD_PORT = 16817, 16818  # inside the namespaces: no other SLURM there


@dataclass(frozen=True)
class Slurm:
    hosts: Hosts
    env: dict[str, str]  # SLURM_CONF: the clients read the test's slurm.conf

    def run(self, *command: str, timeout: int = 60, **kwargs) -> subprocess.CompletedProcess:
        """A SLURM client on node1, the login node."""
        return subprocess.run(
            self.hosts.on_host(0, list(command)),
            env={**self.env, **kwargs.pop("env", {})},
            capture_output=True,
            text=True,
            timeout=timeout,
            **kwargs,
        )

    def wait_for_job(self, job: str, seconds: float) -> str:
        """`scontrol show job` once the job has ended. Polled each second: `sbatch --wait` polls ever
        more slowly, and returned 19 s after this job had ended."""
        deadline = time.time() + seconds
        while not re.search(
            r"JobState=(COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY)\b",
            shown := self.run("scontrol", "show", "job", job).stdout,
        ):
            assert time.time() < deadline, f"job {job} still running after {seconds:.0f} s:\n{shown}"
            assert "launch_failed" not in shown, (
                f"job {job} could not start (slurmd's log says why):\n{shown}"
            )
            time.sleep(1.0)
        return shown


def slurm_conf(root: Path) -> str:
    """One controller on node1, a node in each namespace. The container has no systemd and no cgroup
    delegation: processes are tracked by /proc (proctrack/linuxproc) and tasks are not confined."""
    controller = os.uname().nodename.split(".")[0]  # slurmctld runs where the host name is the controller's
    return f"""\
ClusterName=vr77
SlurmctldHost={controller}({ADDRESSES[0]})
SlurmctldPort={SLURMCTLD_PORT}
SlurmdPort={SLURMD_PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge.socket
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/linear
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
NodeName={NODE_NAMES[0]} NodeAddr={ADDRESSES[0]} CPUs=1 State=UNKNOWN
NodeName={NODE_NAMES[1]} NodeAddr={ADDRESSES[1]} CPUs=1 State=UNKNOWN
PartitionName=debug Nodes=node[1-2] Default=YES MaxTime=INFINITE State=UP
"""


@pytest.fixture
def slurm(two_hosts, tmp_path) -> Iterator[Slurm]:
    """munged with a key of its own, slurmctld on node1, a slurmd in each namespace (`slurmd -N`), every
    file under tmp_path; the daemons killed at teardown, then the namespaces with anything left inside."""
    if why := why_no_slurm():
        pytest.skip(why)
    # a short folder of its own (0700), not tmp_path: slurmstepd's sockets live under SlurmdSpoolDir, and a
    # path past 108 bytes (an AF_UNIX name's limit, as pytest-xdist's tmp_path gave) fails every job launch
    root = Path(tempfile.mkdtemp(prefix="slurm-", dir="/tmp"))
    (root / "state").mkdir()
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    (root / "slurm.conf").write_text(slurm_conf(root))
    env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}
    munged = [
        "munged",
        "--foreground",
        "--force",  # the socket's folder is root's alone (tmp_path): munged would only warn
        f"--key-file={key}",
        f"--socket={root}/munge.socket",
        f"--pid-file={root}/munged.pid",
        f"--log-file={root}/munged.log",
        f"--seed-file={root}/munged.seed",
    ]
    daemons: list[subprocess.Popen] = []

    def start(command: list[str], log: str) -> None:
        with open(root / log, "w") as out:
            daemons.append(subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env))

    try:
        start(munged, "munged.out")
        start(two_hosts.on_host(0, ["slurmctld", "-D", "-i"]), "slurmctld.out")
        for host, name in enumerate(NODE_NAMES):
            start(two_hosts.on_host(host, ["slurmd", "-D", "-N", name]), f"slurmd-{name}.out")
        cluster = Slurm(two_hosts, env)
        deadline = time.time() + 60
        while (states := cluster.run("sinfo", "-h", "-o", "%T %D").stdout.split()) != ["idle", "2"]:
            logs = "\n".join(p.name + ":\n" + p.read_text()[-1500:] for p in sorted(root.glob("*.out")))
            assert time.time() < deadline, f"the nodes never came up: sinfo {states}\n{logs}"
            time.sleep(0.5)
        yield cluster
    finally:
        for daemon in reversed(daemons):
            daemon.terminate()
            try:
                daemon.wait(timeout=15)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        for log in sorted(root.glob("*.log")):  # kept beside the test's other files, for a failure's reading
            shutil.copy(log, tmp_path / log.name)
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.e2e
@needs_two_hosts
@needs_slurm
def test_the_shipped_sbatch_example_runs_on_two_slurm_nodes_to_where_one_host_ends(slurm, one_host, tmp_path):
    """`sbatch configs/slurm/train.sbatch` on the 2 nodes: srun starts the runner on each, which
    reads the nodes, its node's index and the rendezvous host (node1, the first of node[1-2]) from SLURM.
    The job completes, the run finishes, and both stages end bit for bit where one host's 2 processes do."""
    folder = folder_like_a_clone(tmp_path / "job")
    submitted = slurm.run(
        "sbatch",
        "--parsable",
        str(REPO / "configs" / "slurm" / "train.sbatch"),
        *QUICK,
        cwd=folder,
        env={**ONE_THREAD, "OUTPUT_DIR": str(tmp_path / "runs")},
    )
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]  # JOBID[;CLUSTER]
    shown = slurm.wait_for_job(job, seconds=900)
    log_file = folder / f"vlm-recipes-{job}.out"  # the script's --output=%x-%j.out
    log = log_file.read_text() if log_file.exists() else ""
    assert "JobState=COMPLETED" in shown and "ExitCode=0:0" in shown, shown + log[-4000:]
    assert " NodeList=node[1-2]" in shown
    port = 29500 + int(job) % 1000
    for host in (0, 1):
        assert f"launch: node-rank: {host} (SLURM_NODEID)" in log
        assert f"--local_addr {ADDRESSES[host]}" in log
    assert log.count("launch: nodes: 2 (SLURM_STEP_NUM_NODES)") == 2
    assert (
        log.count(
            f"launch: rendezvous: c10d at node1:{port} (host: the first host of SLURM_STEP_NODELIST=node[1-2]; "
            f"port: 29500 + SLURM_JOB_ID {job} mod 1000)"
        )
        == 2
    )
    assert_ends_where_one_host_ends(tmp_path / "runs" / "r3-two-stage" / f"slurm-{job}", one_host)
