"""What a cluster scheduler supplies (launch/cluster.py): SLURM's and Kubernetes' numbers for a launch, the
command line winning over both, and --dry-run saying where each number came from. Pure: each test hands
the resolver the environment a scheduler would set."""

from __future__ import annotations

import logging
import os
import re
import subprocess
from pathlib import Path

import pytest
from conftest import folder_like_a_clone

from vlm_recipes.cli.train import main
from vlm_recipes.errors import GuardError
from vlm_recipes.launch.cluster import Requested, expand_hostlist, resolve_placement
from vlm_recipes.launch.launcher import launch_command, launch_environment
from vlm_recipes.plan import ParallelPlan
from vlm_recipes.runs.layout import NodeSettings

# As Slurm 22.05's `scontrol show hostnames` (Debian 12) expands each, checked by hand
HOSTLISTS = {
    "node[01-03,07],gpu5": ["node01", "node02", "node03", "node07", "gpu5"],
    "rack[1-2]-gpu[08-10]": [f"rack{r}-gpu{g}" for r in (1, 2) for g in ("08", "09", "10")],
    "n[9-11]": ["n9", "n10", "n11"],
    "n[099-101]": ["n099", "n100", "n101"],
    "gpu[007-009,10]": ["gpu007", "gpu008", "gpu009", "gpu10"],
    "a[1],b": ["a1", "b"],
    "login": ["login"],
}

# `srun` on the second of two nodes of job 4321 with 8 GPUs each (the variables srun sets, and the job's)
SRUN_ON_NODE_1 = {
    "SLURM_JOB_ID": "4321",
    "SLURM_STEP_ID": "0",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NNODES": "2",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_NODEID": "1",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_STEP_NODELIST": "gpu[07-08]",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_GPUS_ON_NODE": "8",
}


@pytest.mark.parametrize("hostlist", HOSTLISTS)
def test_a_slurm_host_list_expands_as_scontrol_expands_it(hostlist):
    assert expand_hostlist(hostlist) == HOSTLISTS[hostlist]


@pytest.mark.parametrize("hostlist", ["n[10-9]", "n[01-", "n[a-b]", "n]1[", "n[1],,m", ""])
def test_a_broken_host_list_is_refused_naming_its_variable(hostlist):
    with pytest.raises(GuardError, match=re.escape(f"SLURM_STEP_NODELIST={hostlist}:")):
        expand_hostlist(hostlist, "SLURM_STEP_NODELIST")


def test_under_srun_every_number_comes_from_slurm():
    placement = resolve_placement(Requested(), SRUN_ON_NODE_1)
    assert placement.node == NodeSettings(2, 1, "gpu07", 29500 + 4321 % 1000)
    assert placement.nproc_per_node == 8
    reasons = {d.guard: d.reason for d in placement.decisions}
    assert reasons["nodes"] == "SLURM_STEP_NUM_NODES" and reasons["node-rank"] == "SLURM_NODEID"
    assert reasons["processes-per-node"].startswith("SLURM_GPUS_ON_NODE")
    assert reasons["rendezvous"] == (
        "host: the first host of SLURM_STEP_NODELIST=gpu[07-08]; port: 29500 + SLURM_JOB_ID 4321 mod 1000"
    )
    cpu_job = {k: v for k, v in SRUN_ON_NODE_1.items() if k != "SLURM_GPUS_ON_NODE"}
    assert resolve_placement(Requested(), cpu_job).nproc_per_node is None  # one process on a CPU


def test_flags_given_win_over_the_schedulers_numbers():
    given = Requested(nnodes=4, master_addr="10.0.0.9", master_port=4000, nproc_per_node=2, max_restarts=1)
    placement = resolve_placement(given, SRUN_ON_NODE_1)
    assert placement.node == NodeSettings(4, 1, "10.0.0.9", 4000, max_restarts=1)
    assert placement.nproc_per_node == 2
    reasons = {d.guard: d.reason for d in placement.decisions}
    assert reasons["nodes"] == "--nnodes" and reasons["node-rank"] == "SLURM_NODEID"
    assert reasons["rendezvous"] == "host: --master-addr; port: --master-port"
    assert reasons["restarts"].startswith("--max-restarts: torchrun's elastic agent restarts")


def test_slurm_runs_that_would_never_meet_are_refused():
    batch_script = {
        k: v for k, v in SRUN_ON_NODE_1.items() if not k.startswith(("SLURM_STEP", "SLURM_NODEID"))
    }
    with pytest.raises(GuardError, match="this SLURM job has 2 nodes .* outside srun"):
        resolve_placement(Requested(), batch_script)
    assert resolve_placement(Requested(nnodes=1), batch_script).node.nnodes == 1  # this node alone, asked
    with pytest.raises(GuardError, match=r"srun started 16 tasks .* Run one task per node"):
        resolve_placement(Requested(), {**SRUN_ON_NODE_1, "SLURM_STEP_NUM_TASKS": "16"})
    with pytest.raises(GuardError, match=r"node rank 1 \(SLURM_NODEID\) with 1 node\(s\) \(--nnodes\)"):
        resolve_placement(Requested(nnodes=1), SRUN_ON_NODE_1)


def test_a_pytorchjob_pod_is_a_node_and_kubeflow_pet_variables_are_torchruns():
    pod = {
        "KUBERNETES_SERVICE_HOST": "10.96.0.1",
        "MASTER_ADDR": "train-master-0",
        "MASTER_PORT": "23456",
        "WORLD_SIZE": "3",
        "RANK": "2",
    }
    placement = resolve_placement(Requested(), pod)
    assert placement.node == NodeSettings(3, 2, "train-master-0", 23456)
    assert placement.read_as_pods == (
        "WORLD_SIZE",
        "RANK",
    )  # counts of pods, dropped before accelerate reads them
    assert {d.guard: d.reason for d in placement.decisions}["nodes"] == "WORLD_SIZE (PyTorchJob: pods)"
    outside_a_pod = {k: v for k, v in pod.items() if k != "KUBERNETES_SERVICE_HOST"}
    assert resolve_placement(Requested(), outside_a_pod).node == NodeSettings()
    inside_torchrun = {**pod, "LOCAL_RANK": "0"}  # there they count processes
    assert resolve_placement(Requested(), inside_torchrun).node == NodeSettings()

    trainer = {  # Kubeflow Trainer's torch runtime
        "PET_NNODES": "2",
        "PET_NPROC_PER_NODE": "4",
        "PET_NODE_RANK": "1",
        "PET_MASTER_ADDR": "job-node-0-0.job",
        "PET_MASTER_PORT": "29400",
    }
    placement = resolve_placement(Requested(), trainer)
    assert placement.node == NodeSettings(2, 1, "job-node-0-0.job", 29400) and placement.nproc_per_node == 4
    elastic = {"PET_NNODES": "2:2", "PET_NODE_RANK": "0", "PET_RDZV_ENDPOINT": "job-worker-0:23456"}
    placement = resolve_placement(Requested(), {**elastic, "PET_MAX_RESTARTS": "3"})
    assert placement.node == NodeSettings(2, 0, "job-worker-0", 23456, max_restarts=3)
    with pytest.raises(GuardError, match=r"2 nodes \(PET_NNODES\) but no index for this node"):
        resolve_placement(Requested(), {k: v for k, v in elastic.items() if k != "PET_NODE_RANK"})
    with pytest.raises(GuardError, match="PET_NNODES=1:4: an elastic range of nodes"):
        resolve_placement(Requested(), {**elastic, "PET_NNODES": "1:4"})
    assert resolve_placement(Requested(nnodes=2), {**elastic, "PET_NNODES": "1:4"}).node.nnodes == 2


def test_the_dry_run_and_the_log_say_where_each_number_came_from(tmp_path, monkeypatch, capsys, caplog):
    """Under srun on node 1 of 2, a CPU job asked for 2 processes and a restart: the dry run states the
    nodes, ranks per node, the rendezvous (backend, endpoint, id) and the restarts, each with its source."""
    for variable, value in {**SRUN_ON_NODE_1, "SLURM_GPUS_ON_NODE": "0"}.items():
        monkeypatch.setenv(variable, value)
    args = ["--recipe", "r2-vision-only", "--run-name", "big", "--output-dir", str(tmp_path)]
    with caplog.at_level(logging.INFO, logger="vlm_recipes.cli.train"):
        assert main([*args, "--nproc-per-node", "2", "--max-restarts", "1", "--dry-run"]) == 0
    launch = capsys.readouterr().out.split("launch (every node runs this same command):\n")[1].splitlines()
    assert launch[:3] == [
        "    nodes               2  (SLURM_STEP_NUM_NODES)",
        "    node-rank           1  (SLURM_NODEID)",
        "    processes-per-node  2  (--nproc-per-node)",
    ]
    assert launch[3].startswith("    rendezvous          c10d at gpu07:29821  (host: the first host of")
    assert launch[4].startswith("    restarts            1  (--max-restarts: torchrun's elastic agent")
    assert launch[5] == "    rendezvous id       r2-vision-only-big-stage1 (r2-vision-only stage 1, ddp)"
    assert "launch: nodes: 2 (SLURM_STEP_NUM_NODES)" in caplog.text


def test_the_shipped_sbatch_example_plans_its_nodes_with_a_stand_in_srun(tmp_path):
    """No SLURM here: a stand-in `srun` (it drops its own options and runs the command once, as srun does
    on each node) runs the shipped example with the variables srun sets on node 1 of 2. The example's
    command, with --dry-run added, plans r3-two-stage on the 2 nodes SLURM gave it."""
    repo = Path(__file__).resolve().parents[1]
    srun = tmp_path / "bin" / "srun"
    srun.parent.mkdir()
    srun.write_text('#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    srun.chmod(0o755)
    env = {
        **os.environ,
        **SRUN_ON_NODE_1,
        "SLURM_GPUS_ON_NODE": "0",  # a CPU job: one process per node
        "PATH": f"{srun.parent}:{os.environ['PATH']}",
        "OUTPUT_DIR": str(tmp_path / "runs"),
    }
    sbatch = repo / "configs" / "slurm" / "train.sbatch"
    result = subprocess.run(
        ["bash", str(sbatch), "--dry-run"],
        cwd=folder_like_a_clone(tmp_path / "clone"),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    launch = result.stdout.split("launch (every node runs this same command):\n")[1]
    assert "nodes               2  (SLURM_STEP_NUM_NODES)" in launch
    assert "processes-per-node  one per visible GPU (1 on a CPU)  (default)" in launch
    assert "restarts            1  (--max-restarts" in launch
    assert "rendezvous id       r3-two-stage-slurm-4321-stage2 (r3-two-stage stages 1-2, ddp)" in launch
    assert not (tmp_path / "runs").exists()  # planned, nothing written


def test_on_several_nodes_node_0_hosts_the_store_and_each_node_advertises_its_address(monkeypatch):
    """torchrun guesses whether it hosts the rendezvous store from the host name, and advertises the host
    name's address; gloo binds to that address. Where the name resolves elsewhere (a second interface, a
    loopback address, a network namespace: tests/test_hosts.py) no node served the store. Node 0 hosts it,
    the others are told they do not (else one on node 0's machine could take its port first), and each
    advertises, and gloo binds to, the address it reaches node 0 from (here the loopback)."""
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    ddp, fsdp = ParallelPlan("ddp", 1), ParallelPlan("fsdp", 1)
    for rank in (0, 1):
        node = NodeSettings(2, rank, "127.0.0.1", 29400)
        flags = ["--rdzv_conf", f"is_host={int(rank == 0)}", "--local_addr", "127.0.0.1"]
        command = " ".join(launch_command(ddp, [], node, "r"))
        assert " ".join(flags) in command
        assert launch_environment(ddp, node, "r")["GLOO_SOCKET_IFNAME"] == "lo"
        # accelerate launch: its own --rdzv_conf; the address through torchrun's PET_LOCAL_ADDR
        assert " ".join(flags[:2]) in " ".join(launch_command(fsdp, [], node, "r"))
        assert launch_environment(fsdp, node, "r")["PET_LOCAL_ADDR"] == "127.0.0.1"
    one = NodeSettings()
    assert "--rdzv_conf" not in launch_command(ddp, [], one, "r")
    assert "GLOO_SOCKET_IFNAME" not in launch_environment(ddp, one, "r")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")  # the user's choices stay
    monkeypatch.setenv("PET_LOCAL_ADDR", "10.9.9.9")
    node = NodeSettings(2, 1, "127.0.0.1", 29400)
    assert "--local_addr 10.9.9.9" in " ".join(launch_command(ddp, [], node, "r"))
    assert "GLOO_SOCKET_IFNAME" not in launch_environment(ddp, node, "r")
