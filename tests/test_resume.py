"""Nothing lost: SIGKILL at any point and resume, Ctrl-C, NaN. Real processes, killed for real."""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import TRAIN, run_train
from transformers import AutoModelForImageTextToText

from vlm_recipes.cli.train import main
from vlm_recipes.decisions import Environment
from vlm_recipes.demo.models import resolve_model_source
from vlm_recipes.errors import GuardError
from vlm_recipes.files import DISCARDED, read_json, write_json
from vlm_recipes.recipe import load_recipe
from vlm_recipes.stages.checks import keep_the_global_batch
from vlm_recipes.stages.context import StageContext

pytestmark = pytest.mark.e2e

# Two stages, 6 steps each, a checkpoint every 2 steps; no generation (resume is about weights).
RECIPE_ARGS = [
    "--recipe",
    "r3-two-stage",
    "--max-steps",
    "6",
    "training.save_steps=2",
    "training.per_device_batch_size=4",
    "data.max_eval_samples=4",
    "evaluation.generate=false",
]


def train(
    out: Path, *extra: str, fault: str | None = None, run_name: str = "run"
) -> subprocess.CompletedProcess:
    return run_train(
        *RECIPE_ARGS, "--output-dir", str(out), "--run-name", run_name, *extra, fault=fault, timeout=300
    )


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    model = AutoModelForImageTextToText.from_pretrained(run_dir / "stage-2-llm-lora" / "final")
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, private_demo_cache) -> Path:
    """The uninterrupted run, in this process: the runs killed are real processes; the ones that finish
    (this one, and each resume) go through the same entry point without another interpreter start."""
    out = tmp_path_factory.mktemp("reference")
    assert main([*RECIPE_ARGS, "--output-dir", str(out), "--run-name", "run"]) == 0
    return out / "r3-two-stage" / "run"


@pytest.fixture(scope="module")
def reference(reference_run) -> dict[str, torch.Tensor]:
    return final_weights(reference_run)


@pytest.mark.parametrize(
    ("fault", "expect_resume"),
    [
        # during stage 1, while checkpoint 4 is written (killed after step 3 is the same resume, from 2)
        ("stage1:checkpoint4", "stage-1-vision-full/checkpoints/checkpoint-2"),
        ("between1", None),  # stage 1 done, stage 2 not started
        ("stage2:step5", "stage-2-llm-lora/checkpoints/checkpoint-4"),  # during stage 2
    ],
)
def test_sigkill_then_resume_matches_an_uninterrupted_run(
    reference, tmp_path, capsys, caplog, fault, expect_resume
):
    killed = train(tmp_path, fault=fault)
    assert killed.returncode == -signal.SIGKILL
    run_dir = tmp_path / "r3-two-stage" / "run"
    done_before = {p.parent.name: p.read_text() for p in run_dir.glob("stage-*/DONE")}
    assert "stage-2-llm-lora" not in done_before

    # the same command again (in this process: it stops before any model loads): refused, never overwritten
    args = [*RECIPE_ARGS, "--output-dir", str(tmp_path), "--run-name", "run"]
    assert main(args) == 2 and "--resume" in capsys.readouterr().err

    caplog.set_level(logging.INFO)
    assert main(["--resume", str(run_dir)]) == 0
    for stage, marker in done_before.items():  # finished stages were not retrained
        assert (run_dir / stage / "DONE").read_text() == marker
        assert f"`{stage.split('-', 2)[2]}`: already done" in caplog.text
    if expect_resume:
        assert f"resuming from {run_dir / expect_resume}" in caplog.text
    if fault == "stage1:checkpoint4":
        assert "checkpoint-4 was interrupted while being written: ignored and removed" in caplog.text

    assert read_json(run_dir / "run.json")["status"] == "finished"
    weights = final_weights(run_dir)
    for name, value in reference.items():
        # CPU kernels are deterministic here: resumed training equals uninterrupted training exactly.
        assert torch.equal(weights[name], value), name


def test_a_power_cut_that_cut_a_finished_stages_weights_short_is_found_and_trained_again(
    reference_run, reference, tmp_path, caplog
):
    """What an unsynced write looks like after a power cut: stage 1 finished (DONE written), then its
    final/model.safetensors cut to half. --resume names the file, trains stage 1 and the stage 2 built on it
    again, and ends bit for bit where the uninterrupted run did."""
    run_dir = tmp_path / "r3-two-stage" / "run"
    shutil.copytree(reference_run, run_dir)  # the finished run, as the power cut found it
    stages = sorted(p.name for p in run_dir.glob("stage-*"))
    recorded = {s: read_json(run_dir / s / "DONE")["files"] for s in stages}
    weights = run_dir / stages[0] / "final" / "model.safetensors"
    size = weights.stat().st_size
    os.truncate(weights, size // 2)

    caplog.set_level(logging.INFO)
    assert main(["--resume", str(run_dir)]) == 0
    assert (
        f"stage 1 `vision-full`: finished, but final/model.safetensors is {size // 2} bytes, DONE recorded "
        f"{size}: training it again from the start" in caplog.text
    )
    assert "stage 2 `llm-lora`: an earlier stage trained again: starting it again" in caplog.text
    assert "already done" not in caplog.text
    assert not list(run_dir.rglob(f"*{DISCARDED}*")), "the stale outputs were moved aside and removed"
    assert read_json(run_dir / "run.json")["status"] == "finished"
    for stage in stages:  # trained again: each weights file is the one the uninterrupted run wrote
        again = {f["path"]: f for f in read_json(run_dir / stage / "DONE")["files"]}
        before = next(f for f in recorded[stage] if f["path"] == "final/model.safetensors")
        assert again["final/model.safetensors"] == before, stage
    assert weights.stat().st_size == size

    resumed = final_weights(run_dir)
    start = AutoModelForImageTextToText.from_pretrained(
        resolve_model_source(load_recipe("r3-two-stage").model)
    )
    moved = {n: (resumed[n] - p.detach()).abs().max().item() for n, p in start.named_parameters()}
    print(
        f"moved from the start: largest {max(moved.values()):.3e}, {sum(m > 0 for m in moved.values())} of "
        f"{len(moved)} tensors"
    )
    # measured 1.5e-3 (45 of 58 tensors): far beyond fp32's rounding of these weights (~1e-8), so the
    # equality below is of trained weights, not of an untouched start
    assert max(moved.values()) > 5e-4 and sum(m > 0 for m in moved.values()) > len(moved) // 2, moved
    for name, value in reference.items():
        assert torch.equal(resumed[name], value), name


def r2_command(out: Path, *extra: str) -> list[str]:
    """Arguments for r2's stage into `out`/r2-vision-only/run, without generation (these tests are about stopping)."""
    return [
        "--recipe",
        "r2-vision-only",
        "--output-dir",
        str(out),
        "--run-name",
        "run",
        "evaluation.generate=false",
        "data.max_eval_samples=4",
        *extra,
    ]


def killed_and_resumed_r2(
    tmp_path: Path, extra: tuple[str, ...], fault: str, checkpoint: str, caplog
) -> Path:
    """r2's stage with `extra` run whole (into tmp_path/reference), then again killed at `fault` and resumed
    from `checkpoint`: asserts the resumed run ends with the weights of the whole one, and that the tower and
    projector trained (over half the tensors moved, one by more than 1e-3), so the equality is of trained
    weights. Returns the resumed run's directory."""
    reference = tmp_path / "reference"
    assert main(r2_command(reference, *extra)) == 0
    killed = run_train(*r2_command(tmp_path, *extra), fault=fault, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    run_dir = tmp_path / "r2-vision-only" / "run"
    caplog.set_level(logging.INFO)
    assert main(["--resume", str(run_dir)]) == 0
    assert f"resuming from {run_dir / 'stage-1-vision-full' / 'checkpoints' / checkpoint}" in caplog.text

    def weights(run: Path) -> dict[str, torch.Tensor]:
        model = AutoModelForImageTextToText.from_pretrained(run / "stage-1-vision-full" / "final")
        return {n: p.detach() for n, p in model.named_parameters()}

    resumed, uninterrupted = weights(run_dir), weights(reference / "r2-vision-only" / "run")
    start = AutoModelForImageTextToText.from_pretrained(resolve_model_source("demo:tiny-qwen2-vl"))
    moved = {n: (resumed[n] - p.detach()).abs().max().item() for n, p in start.named_parameters()}
    assert max(moved.values()) > 1e-3 and sum(m > 0 for m in moved.values()) > len(moved) // 2, moved
    for name, value in uninterrupted.items():
        assert torch.equal(resumed[name], value), name
    return run_dir


def test_the_last_steps_checkpoint_is_never_resumed_from(tmp_path):
    """Resuming at global_step == max_steps trains one step too many in transformers 5.23: the final
    step's checkpoint is left incomplete, so a stage killed after it redoes the last steps instead."""
    result = run_train(
        *r2_command(tmp_path, "--max-steps", "2", "training.save_steps=1", "data.max_train_samples=4"),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    checkpoints = tmp_path / "r2-vision-only" / "run" / "stage-1-vision-full" / "checkpoints"
    assert (checkpoints / "checkpoint-1" / "COMPLETE").is_file()
    assert not (checkpoints / "checkpoint-2" / "COMPLETE").exists()


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_or_sigterm_saves_a_checkpoint_and_says_how_to_resume(tmp_path, stop):
    command = [
        *TRAIN,
        *r2_command(
            tmp_path, "--max-steps", "400", "training.save_steps=0", "training.per_device_batch_size=2"
        ),
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stage_dir = tmp_path / "r2-vision-only" / "run" / "stage-1-vision-full"
    deadline = time.time() + 120
    while not (stage_dir / "report.json").exists() and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(2.0)  # inside the training loop
    process.send_signal(stop)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr[-3000:]
    assert f"--resume {tmp_path / 'r2-vision-only' / 'run'}" in stderr
    checkpoints = list((stage_dir / "checkpoints").glob("checkpoint-*/COMPLETE"))
    assert len(checkpoints) == 1 and not (stage_dir / "DONE").exists()
    step = int(checkpoints[0].parent.name.rsplit("-", 1)[1])
    assert 0 < step < 400
    assert read_json(tmp_path / "r2-vision-only" / "run" / "run.json")["status"] == "interrupted"


def test_nan_stops_the_stage_and_the_last_checkpoint_still_loads(tmp_path):
    result = run_train(
        *r2_command(
            tmp_path,
            "--max-steps",
            "6",
            "training.save_steps=1",
            "training.learning_rate=1e6",
            "training.per_device_batch_size=4",
        ),
        timeout=300,
    )  # a poisoned learning rate: step 1 blows the weights up
    assert result.returncode == 3, result.stderr[-3000:]
    assert "stopped at step" in result.stderr and "NaN/inf" in result.stderr
    assert f"--resume {tmp_path / 'r2-vision-only' / 'run'}" in result.stderr
    assert "Traceback" not in result.stderr
    stage_dir = tmp_path / "r2-vision-only" / "run" / "stage-1-vision-full"
    assert not (stage_dir / "DONE").exists()
    complete = sorted((stage_dir / "checkpoints").glob("checkpoint-*/COMPLETE"))
    assert complete, "the checkpoint before the divergence is kept"
    model = AutoModelForImageTextToText.from_pretrained(complete[-1].parent)
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize(
    ("processes", "accumulation"),
    [(4, None), (2, 2), (1, 4), (3, "one of [1, 2, 4]"), (8, "one of [1, 2, 4]")],
    ids=["same-ranks", "half", "one", "three", "more"],
)
def test_a_resume_on_other_ranks_keeps_the_global_batch_or_names_the_ranks_that_can(
    tmp_path, processes, accumulation
):
    """A checkpoint written by 4 processes of 2 rows (global batch 8) resumes on 2 with 2 micro-batches
    accumulated a step, on 1 with 4; 3 or 8 processes of 2 rows cannot make 8, and the error says which
    --nproc-per-node can. (On 4 ranks killed and 2 resumed, end to end: test_fsdp_stages.)"""
    recipe = load_recipe("r2-vision-only", ["training.per_device_batch_size=2"])
    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    ctx = StageContext(
        recipe,
        recipe.stages[0],
        1,
        tmp_path,
        "unused",
        Environment("cpu", 0, False),
        family=None,
        state=SimpleNamespace(),
    )
    ctx.state.num_processes = processes
    assert keep_the_global_batch(ctx, checkpoint) is None  # written before global_batch.json existed
    write_json(checkpoint / "global_batch.json", {"processes": 4, "per_device": 2, "accumulation": 1})
    if isinstance(accumulation, str):
        with pytest.raises(
            GuardError, match=rf"written by 4 processes, global batch 8 .*{re.escape(accumulation)}"
        ):
            keep_the_global_batch(ctx, checkpoint)
        return
    decision = keep_the_global_batch(ctx, checkpoint)
    if accumulation is None:
        assert decision is None and ctx.stage.training.gradient_accumulation_steps == 1
        return
    assert decision.choice == f"gradient accumulation 1 -> {accumulation} on {processes} processes"
    assert ctx.stage.training.gradient_accumulation_steps == accumulation
