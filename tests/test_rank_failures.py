"""One rank fails, and the whole job stops within seconds with one message (launch/rank_failures.py): the
failing rank, its host and its error, and the exit code one process would return. CPU ranks over gloo.

Each test has a timeout of its own: before, a lost node left the survivors in gloo's 30-minute wait."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from conftest import TRAIN, run_train, write_recipe
from test_data_streaming import STREAMING, colour_rows, write_rows
from test_parallel import QUICK, free_port

from vlm_recipes.files import read_json
from vlm_recipes.launch.rank_failures import LOST_AFTER_ENV, root_cause

STOPS_WITHIN = 60.0  # seconds from the failure to the last process's end (issue 77)
LOST_AFTER = 10.0  # the lost-node test's heartbeat timeout (the default is 120 s)


def left_running(run_dir: Path) -> list[str]:
    """The processes still working on `run_dir` (the ranks are given `--resume RUN_DIR`)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        line = " ".join(process.info["cmdline"] or [])
        if str(run_dir) in line and process.pid != os.getpid():
            found.append(line)
    return found


def process_tree(pid: int) -> list[psutil.Process]:
    """A launcher, torchrun's agent and its ranks (children first: none runs on while its parent stops)."""
    try:
        parent = psutil.Process(pid)
        return [*parent.children(recursive=True), parent]
    except psutil.NoSuchProcess:
        return []


def signal_if_alive(process: psutil.Process, number: int) -> None:
    with contextlib.suppress(psutil.NoSuchProcess):
        process.send_signal(number)


def freeze_node_1_once_trained(
    nodes: list[subprocess.Popen], stage_dir: Path, log: Path, timeout: float
) -> tuple[int, float]:
    """Once the stage has a complete checkpoint (training, past a collective save), every process of node 1
    frozen with SIGSTOP; node 0's exit code and the seconds from the freeze to its end. Both nodes' processes
    are killed after."""
    try:
        deadline = time.monotonic() + 240
        while not list((stage_dir / "checkpoints").glob("checkpoint-*/COMPLETE")):
            assert time.monotonic() < deadline and nodes[0].poll() is None, log.read_text()[-4000:]
            time.sleep(0.5)
        for process in process_tree(nodes[1].pid):  # torchrun starts each rank in a session of its own
            signal_if_alive(process, signal.SIGSTOP)
        frozen = time.monotonic()
        code = nodes[0].wait(timeout=timeout)
        return code, time.monotonic() - frozen
    finally:
        for node in nodes:
            for process in process_tree(node.pid):
                signal_if_alive(process, signal.SIGKILL)
            node.wait()


def final_message(stderr: str) -> str:
    """The launcher's last word: the line after torchrun's report."""
    return stderr.rstrip().split("\nerror: ")[-1]


@pytest.mark.e2e
def test_a_streamed_bad_row_met_mid_training_by_one_rank_stops_every_rank_with_exit_2(tmp_path):
    """The bad row, past the rows checked before the model loads, stops training inside Trainer. The rank
    whose record came first is named (either may read it first: seen both ways). Before: the same exit
    code, but the launcher said nothing of the rank or its host."""
    rows = colour_rows(tmp_path, 200)
    rows[180]["images"] = ["missing.png"]  # past the first 128 rows read (2 blocks of 64) before loading
    path = write_rows(tmp_path, rows)
    recipe = write_recipe(tmp_path, "stream", STREAMING.format(train=path, policy="fail", extra=""))
    flags = ["--recipe", str(recipe), "--output-dir", str(tmp_path), "--run-name", "bad", *QUICK]
    result = run_train(*flags, "--nproc-per-node", "2", timeout=300)
    ended = time.time()
    run_dir = tmp_path / "stream" / "bad"
    assert result.returncode == 2, result.stderr[-4000:]
    message, cause = final_message(result.stderr), root_cause(run_dir)
    assert message.startswith(f"rank {cause.place.rank} (host ") and "failed (exit 2): DataError" in message
    assert "train.jsonl:line 181: image not found" in message
    assert ended - cause.at < STOPS_WITHIN and not left_running(run_dir)
    manifest = read_json(run_dir / "run.json")
    assert manifest["exit_code"] == 2 and manifest["failed_rank"]["rank"] == cause.place.rank
    assert manifest["error"].startswith("DataError") and "line 181" in manifest["error"]


# what rank 1 raises after step 2 (mocked: this machine cannot run out of memory or fill its disk on demand,
# and a NaN loss on one rank is injected), the exit code, the rank named, and what the message says
RANK_1_FAULTS = {
    "oom": (5, "rank 1 ", "failed (exit 5): OutOfMemory: out of memory", "training.per_device_batch_size"),
    "disk-full": (4, "rank 1 ", "failed (exit 4): DiskFull: ", "free"),
    # DDP's all-reduce spreads rank 1's NaN to every rank's gradients: whichever rank stops first is named
    "nan": (3, "rank ", "failed (exit 3): TrainingDiverged: ", "learning_rate="),
}


@pytest.mark.e2e
@pytest.mark.parametrize("fault", list(RANK_1_FAULTS))
def test_a_fault_on_rank_1_mocked_stops_every_rank_with_its_exit_code(tmp_path, fault):
    """Rank 1 (not the writer of run.json) fails after step 2: out of memory (a torch.OutOfMemoryError), a
    full disk (OSError ENOSPC) or a NaN loss, raised in its place. Before: exit 1, with run.json holding
    rank 0's gloo error ("Connection closed by peer") and no word of the cause."""
    code, rank, says, way_on = RANK_1_FAULTS[fault]
    flags = ["--recipe", "r2-vision-only", "--output-dir", str(tmp_path), "--run-name", fault, *QUICK]
    result = run_train(
        *flags,
        "--nproc-per-node",
        "2",
        "--max-steps",
        "20",
        timeout=300,
        env={**os.environ, "VLM_RECIPES_RAISE": fault},
        fault="stage1:step2@rank1",
    )
    ended = time.time()
    run_dir = tmp_path / "r2-vision-only" / fault
    assert result.returncode == code, result.stderr[-4000:]
    message = final_message(result.stderr)
    assert message.startswith(rank) and says in message and way_on in message, message
    assert "Continue with" in message
    cause = root_cause(run_dir)
    assert ended - cause.at < STOPS_WITHIN and not left_running(run_dir)
    manifest = read_json(run_dir / "run.json")
    assert manifest["exit_code"] == code and manifest["failed_rank"]["rank"] == cause.place.rank
    assert "Connection closed by peer" not in result.stderr.split("fault injection")[-1]


@pytest.mark.e2e
def test_a_frozen_node_ends_the_other_within_the_heartbeat_timeout_naming_it(tmp_path):
    """Two "nodes" on localhost, one process each. Node 1's every process (its launcher, torchrun's
    agent and its rank) is frozen with SIGSTOP mid-training: as a host whose network is gone, it closes no
    connection, so gloo on node 0 waits (30 minutes by default). Its heartbeat stops; node 0 ends after
    VLM_RECIPES_LOST_AFTER (10 s here) with exit 6, naming node 1. Before: node 0 still waited at 90 s."""
    port = str(free_port())
    env = {**os.environ, LOST_AFTER_ENV: str(LOST_AFTER)}
    run_dir = tmp_path / "r2-vision-only" / "lost"
    logs = [tmp_path / f"node{rank}.err" for rank in (0, 1)]
    nodes = [
        subprocess.Popen(
            [
                *TRAIN,
                *("--recipe", "r2-vision-only", "--output-dir", str(tmp_path), "--run-name", "lost"),
                *("--nnodes", "2", "--node-rank", str(rank), "--nproc-per-node", "1"),
                *("--master-addr", "127.0.0.1", "--master-port", port, *QUICK, "--max-steps", "400"),
                "training.save_steps=4",
            ],
            stdout=subprocess.DEVNULL,
            stderr=logs[rank].open("w"),
            env=env,
        )
        for rank in (0, 1)
    ]
    code, stopped = freeze_node_1_once_trained(nodes, run_dir / "stage-1-vision-full", logs[0], timeout=90)
    err = logs[0].read_text()
    assert code == 6, err[-4000:]
    assert LOST_AFTER < stopped < LOST_AFTER + 30, stopped
    message = final_message(err)
    assert "node 1, pid" in message and "was lost: " in message and "(host " in message, message
    manifest = read_json(run_dir / "run.json")
    assert manifest["exit_code"] == 6 and manifest["error"] == root_cause(run_dir).error
