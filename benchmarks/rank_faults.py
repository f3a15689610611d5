"""How a launched group stops, or heals, when one rank fails: each fault the suite injects
(tests/test_rank_failures.py, tests/fault_injection.py), run as the tests run it on CPU ranks over gloo, timed
from the fault to the last process's end. Prints a markdown table and writes it as JSON, naming the machine
and the git sha.

    python benchmarks/rank_faults.py --out benchmarks/results/rank-faults-cpu-2-cores.json

The faults are the tests' own, imported from tests/, so the table measures what the suite proves. Out of
memory and a full disk are raised in the rank's place (this machine cannot run out of either on demand)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from conftest import TRAIN, run_train, write_recipe  # noqa: E402
from data_scale import machine  # noqa: E402
from test_data_streaming import STREAMING, colour_rows, write_rows  # noqa: E402
from test_parallel import QUICK, free_port  # noqa: E402
from test_rank_failures import final_message, freeze_node_1_once_trained  # noqa: E402

from vlm_recipes.launch.rank_failures import LOST_AFTER_ENV, root_cause  # noqa: E402

R2 = ["--recipe", "r2-vision-only", *QUICK]
STAGE = "stage-1-vision-full"
LOST_AFTER = 10.0


def kept(run_dir: Path) -> str:
    """What the failed stage kept: its complete checkpoints; it is never marked done."""
    stage = next(run_dir.glob("stage-1-*"))
    checkpoints = sorted(
        int(p.parent.name.removeprefix("checkpoint-"))
        for p in (stage / "checkpoints").glob("checkpoint-*/COMPLETE")
    )
    done = (stage / "DONE").exists()
    last = f"checkpoint-{checkpoints[-1]} complete" if checkpoints else "no checkpoint yet"
    return f"{last}; stage {'marked done (wrong)' if done else 'not marked done'}"


def stopped(result: subprocess.CompletedProcess, run_dir: Path, ended: float) -> dict:
    """A stopped group's row: its exit code, the seconds from the first failure's record to the end, the
    launcher's last line and what the stage kept."""
    return {
        "exit": result.returncode,
        "seconds": round(ended - root_cause(run_dir).at, 1),
        "said": final_message(result.stderr).split("\n")[0],
        "kept": kept(run_dir),
    }


def raised(work: Path, fault: str) -> dict:
    """Rank 1 raises `fault` after step 2 (tests/fault_injection.py)."""
    result = run_train(
        *R2,
        *("--output-dir", str(work), "--run-name", fault, "--nproc-per-node", "2", "--max-steps", "20"),
        "training.save_steps=2",
        timeout=600,
        env={**os.environ, "VLM_RECIPES_RAISE": fault},
        fault="stage1:step2@rank1",
    )
    ended = time.time()
    run_dir = work / "r2-vision-only" / fault
    return stopped(result, run_dir, ended)


def bad_row(work: Path) -> dict:
    """A streamed row past the first ones checked is missing its image: rank 0 meets it mid-training."""
    rows = colour_rows(work, 200)
    rows[180]["images"] = ["missing.png"]
    recipe = write_recipe(
        work, "stream", STREAMING.format(train=write_rows(work, rows), policy="fail", extra="")
    )
    flags = ["--recipe", str(recipe), "--output-dir", str(work), "--run-name", "bad", *QUICK[2:]]
    result = run_train(*flags, "--max-steps", "3", "--nproc-per-node", "2", timeout=600)
    ended = time.time()
    run_dir = work / "stream" / "bad"
    return stopped(result, run_dir, ended)


def lost_host(work: Path) -> dict:
    """Two nodes on localhost; node 1's processes frozen (SIGSTOP) mid-training, as a host whose network is
    gone: node 0's time from the freeze to its end, with VLM_RECIPES_LOST_AFTER=10."""
    port, run_dir = str(free_port()), work / "r2-vision-only" / "lost"
    logs = [work / f"node{rank}.err" for rank in (0, 1)]
    nodes = [
        subprocess.Popen(
            [
                *TRAIN,
                *R2,
                *("--output-dir", str(work), "--run-name", "lost", "--max-steps", "400"),
                *("--nnodes", "2", "--node-rank", str(rank), "--nproc-per-node", "1"),
                *("--master-addr", "127.0.0.1", "--master-port", port, "training.save_steps=4"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=logs[rank].open("w"),
            env={**os.environ, LOST_AFTER_ENV: str(LOST_AFTER)},
        )
        for rank in (0, 1)
    ]
    code, seconds = freeze_node_1_once_trained(nodes, run_dir / STAGE, logs[0], timeout=300)
    return {
        "exit": code,
        "seconds": round(seconds, 1),
        "said": final_message(logs[0].read_text()).split("\n")[0],
        "kept": kept(run_dir),
    }


def restarted(work: Path) -> dict:
    """Rank 1 SIGKILLed after step 3 with `--max-restarts 1`: the extra time against the same command
    uninterrupted, and whether it ends on the same weights."""
    common = [
        *R2,
        "--output-dir",
        str(work),
        "--nproc-per-node",
        "2",
        "--max-steps",
        "6",
        "training.save_steps=2",
    ]
    began = time.monotonic()
    plain = run_train(*common, "--run-name", "plain", timeout=600)
    plain_seconds = time.monotonic() - began
    began = time.monotonic()
    healed = run_train(
        *common, "--run-name", "healed", "--max-restarts", "1", timeout=600, fault="stage1:step3@rank1"
    )
    healed_seconds = time.monotonic() - began
    assert plain.returncode == 0, plain.stderr[-3000:]
    weights = [
        load_file(work / "r2-vision-only" / name / STAGE / "final" / "model.safetensors")
        for name in ("plain", "healed")
    ]
    same = all((weights[0][k] == weights[1][k]).all() for k in weights[0])
    said = [line for line in healed.stderr.splitlines() if "restart 1 of at most 1" in line]
    resumed = [line.rsplit("/", 1)[-1] for line in healed.stderr.splitlines() if "resuming from " in line]
    return {
        "exit": healed.returncode,
        "seconds": round(healed_seconds - plain_seconds, 1),
        "said": said[0].split(": ", 1)[-1] if said else "",
        "kept": f"resumed from {resumed[0] if resumed else '?'}; final weights {'the same as' if same else 'NOT the same as'} the run never killed",
    }


SCENARIOS = {
    "a bad row met mid-training (streamed)": bad_row,
    "out of memory on rank 1 (mocked)": lambda work: raised(work, "oom"),
    "a full disk on rank 1 (mocked)": lambda work: raised(work, "disk-full"),
    "a NaN loss on rank 1": lambda work: raised(work, "nan"),
    "a host lost (node 1 frozen)": lost_host,
    "a rank killed, --max-restarts 1": restarted,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    results = []
    for name, scenario in SCENARIOS.items():
        with tempfile.TemporaryDirectory() as work:
            result = {"fault": name, **scenario(Path(work))}
        print(json.dumps(result), flush=True)
        results.append(result)
    print(f"\n{machine()}, 2 CPU ranks over gloo, tiny Qwen2-VL demo model, git {sha.stdout.strip()}\n")
    print("| fault | exit | stopped (healed) in | what it said | what was kept |\n|---|---|---|---|---|")
    for r in results:
        said = r["said"] if len(r["said"]) <= 100 else r["said"][:99] + "…"
        print(f"| {r['fault']} | {r['exit']} | {r['seconds']} s | {said} | {r['kept']} |")
    if args.out:
        record = {"machine": machine(), "git": sha.stdout.strip(), "results": results}
        args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
