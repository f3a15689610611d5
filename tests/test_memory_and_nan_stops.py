"""A stage whose memory runs out, or whose loss turns NaN/inf, ends with its own message and exit code, keeps
what was finished, and `--resume` completes the run.

The memory errors are injected into a real stage of the tiny Qwen2-VL (r2's stage, 4 steps) in this process:
the host's MemoryError in a training step's forward, and the GPU's torch.OutOfMemoryError, which a CPU never
raises, mocked while final/ is written."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel, TrainerCallback

from vlm_recipes.cli.train import main
from vlm_recipes.decisions import Environment
from vlm_recipes.errors import DataError, OutOfMemory
from vlm_recipes.files import read_json
from vlm_recipes.recipe import load_recipe
from vlm_recipes.recipes.validate import RecipeError
from vlm_recipes.stages.out_of_memory import memory_error_in, out_of_memory

STEPS = 4
CUDA_OOM = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.06 GiB "
    "is free. Including non-PyTorch memory, this process has 78.12 GiB memory in use.\nIf reserved but "
    "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
)


def r2_args(out: Path, *settings: str) -> list[str]:
    return [
        *("--recipe", "r2-vision-only", "--output-dir", str(out), "--run-name", "run"),
        *("--max-steps", str(STEPS), "training.logging_steps=2", "training.save_steps=2"),
        *("evaluation.generate=false", "data.max_eval_samples=4", "data.max_train_samples=16"),
        *("training.per_device_batch_size=2", "precision=fp32", *settings),
    ]


class AtStep(TrainerCallback):
    """Once, at optimizer step `step`: raises `error` in the model's forward, or makes the gradients NaN."""

    def __init__(self, step: int, error: BaseException | None = None):
        self.step, self.error, self.now, self.fired = step, error, 0, False

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        def raise_in_forward(module, inputs):
            if self.now == self.step and self.error is not None and not self.fired:
                self.fired = True
                raise self.error

        def poison(grad):
            if self.now == self.step and self.error is None and not self.fired:
                self.fired = True
                return grad * float("nan")
            return grad

        model.register_forward_pre_hook(raise_in_forward)
        next(p for p in model.parameters() if p.requires_grad).register_hook(poison)

    def on_step_begin(self, args, state, control, **kwargs):
        self.now = state.global_step + 1


def inject(monkeypatch, fault: AtStep, *watching: TrainerCallback) -> None:
    import vlm_recipes.stages.run as stage_run

    stage_callbacks = stage_run.stage_callbacks

    def with_fault(*args, **kwargs):
        callbacks, decision = stage_callbacks(*args, **kwargs)
        return {**callbacks, "fault": fault, **{f"watching{i}": w for i, w in enumerate(watching)}}, decision

    monkeypatch.setattr(stage_run, "stage_callbacks", with_fault)


def resumes_to_the_end(run_dir: Path, resumed_from: str, caplog) -> None:
    caplog.set_level(logging.INFO)
    assert main(["--resume", str(run_dir)]) == 0
    assert f"resuming from {run_dir / 'stage-1-vision-full' / 'checkpoints' / resumed_from}" in caplog.text
    assert read_json(run_dir / "run.json")["status"] == "finished"
    assert (run_dir / "stage-1-vision-full" / "DONE").is_file()


def stopped_with(run_dir: Path, code: int, error: str) -> None:
    """run.json says failed, with the error and its exit code; nothing is marked done or published."""
    manifest = read_json(run_dir / "run.json")
    assert manifest["status"] == "failed" and manifest["exit_code"] == code, manifest
    assert manifest["error"].startswith(error), manifest["error"]
    stage = run_dir / "stage-1-vision-full"
    assert not (stage / "DONE").exists() and not (stage / "final").exists()
    assert not (stage / "final.partial").exists(), "half-written final/ removed"


def test_a_host_memory_error_in_a_training_step_says_what_to_lower_then_resume_completes(
    tmp_path, monkeypatch, capsys, caplog
):
    inject(monkeypatch, AtStep(3, MemoryError()))
    assert main(r2_args(tmp_path)) == OutOfMemory.exit_code == 5
    err = capsys.readouterr().err
    run_dir = tmp_path / "r2-vision-only" / "run"
    assert "error: out of memory in stage 1/1 `vision-full` (MemoryError); peak resident memory " in err
    assert "GB (this process; the machine has " in err
    for key in (
        "training.per_device_batch_size 2 -> 1 with training.gradient_accumulation_steps 1 -> 2",
        "data.max_length (now ",
        "data.max_pixels (now ",
        "training.gradient_checkpointing: true",
    ):
        assert key in err, key
    assert f"Continue with:\n  python scripts/train_recipe.py --resume {run_dir}\n" in err
    assert "Traceback" not in err
    stopped_with(run_dir, 5, "OutOfMemory: out of memory in stage 1/1 `vision-full` (MemoryError)")
    resumes_to_the_end(run_dir, "checkpoint-2", caplog)


def test_the_gpus_out_of_memory_error_mocked_while_final_is_written_publishes_nothing_then_resume_completes(
    tmp_path, monkeypatch, capsys, caplog
):
    """torch.OutOfMemoryError (CUDA's, raised by hand: this CPU has no GPU) after final.partial/ holds the
    weights: nothing is published from the half state, and the peak is the CPU's (the device trained on)."""
    save_pretrained, fired = PreTrainedModel.save_pretrained, []

    def save_then_run_out(self, save_directory, *args, **kwargs):
        save_pretrained(self, save_directory, *args, **kwargs)
        if Path(save_directory).name == "final.partial" and not fired:
            fired.append(save_directory)
            raise torch.OutOfMemoryError(CUDA_OOM)

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", save_then_run_out)
    assert main(r2_args(tmp_path)) == 5
    err = capsys.readouterr().err
    run_dir = tmp_path / "r2-vision-only" / "run"
    assert fired, "the error was injected"
    assert (
        "error: out of memory in stage 1/1 `vision-full` (torch.OutOfMemoryError: CUDA out of memory. Tried to "
        "allocate 2.00 GiB); peak resident memory" in err
    )
    assert re.search(r"Removed \d+ half-written file\(s\) and checkpoint\(s\)", err)  # final.partial/ too
    assert f"--resume {run_dir}\n" in err and "Traceback" not in err
    stopped_with(run_dir, 5, "OutOfMemory: out of memory in stage 1/1 `vision-full` (torch.OutOfMemoryError")
    resumes_to_the_end(run_dir, "checkpoint-2", caplog)


def test_the_message_on_a_gpu_names_its_peak_allocation_mocked(tmp_path, monkeypatch):
    """On CUDA the peak is torch.cuda.max_memory_allocated (metrics.json's), mocked here with the device."""
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 70 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a: 75 * 2**30)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda *a: type("P", (), {"total_memory": 80 * 2**30})
    )
    recipe = load_recipe(
        "r3-two-stage", ["training.per_device_batch_size=6", "training.gradient_accumulation_steps=2"]
    )
    dirs = [tmp_path / f"stage-{i}" for i in (1, 2)]
    (dirs[0] / "final.partial").mkdir(parents=True)
    try:
        raise RuntimeError("the step failed") from torch.OutOfMemoryError(CUDA_OOM)
    except RuntimeError as error:
        oom = out_of_memory(error, tmp_path, recipe, dirs, Environment("cuda", 1, True, "H100"))
    message = str(oom)
    assert message.startswith(
        f"out of memory in stage 1/2 `{recipe.stages[0].name}` (torch.OutOfMemoryError: CUDA out of memory. "
        "Tried to allocate 2.00 GiB); peak GPU memory 70.00 GB allocated (75.00 GB reserved of the GPU's "
        "80.00 GB). To fit, lower training.per_device_batch_size 6 -> 3 with "
        f"training.gradient_accumulation_steps 2 -> 4 (the same global batch), data.max_length (now "
        f"{recipe.stages[0].data.max_length})"
    ), message
    assert "Removed 1 half-written" in message and not (dirs[0] / "final.partial").exists()


@pytest.mark.parametrize(
    ("error", "memory"),
    [
        (MemoryError(), True),
        (torch.OutOfMemoryError("CUDA out of memory."), True),  # the GPU's, mocked
        (RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be reported later"), True),
        (RuntimeError("CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), True),
        (RuntimeError("boom"), False),
        (DataError("images/7.png: cannot be decoded"), False),  # already told apart, even from a MemoryError
    ],
    ids=["host", "gpu-mocked", "cuda-launch-mocked", "cublas-mocked", "other", "bad-input"],
)
def test_which_errors_are_memory_running_out(error, memory):
    try:
        try:
            raise MemoryError()
        except MemoryError:
            if isinstance(error, DataError):
                raise error from None
        raise error
    except BaseException as raised:
        assert (memory_error_in(raised) is not None) == memory


class LearningRates(TrainerCallback):
    """Each optimizer step's learning rate per optimizer group, as the optimizer holds it when the step begins."""

    def __init__(self):
        self.at: dict[int, list[float]] = {}

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        self.at[state.global_step + 1] = [group["lr"] for group in optimizer.param_groups]


def test_a_nan_stop_prints_a_resume_at_half_the_learning_rate_which_trains_at_it_and_completes(
    tmp_path, monkeypatch, capsys, caplog
):
    """The gradients of step 3 turn NaN: the stage stops at the next logging step (4), keeps checkpoint-2
    (the last good one). The printed command halves the stage's learning rates (its own and a role's):
    replayed unchanged, the same rows from the same weights would diverge again. Pasted, it is accepted
    (--resume otherwise refuses overrides), steps 3 and 4 train at half the rates the stopped run had, and
    the run completes; run.json records the rates it continued at."""
    fault, rates = AtStep(3), LearningRates()
    inject(monkeypatch, fault, rates)
    projector = "training.role_learning_rates.projector=4e-05"
    assert main(r2_args(tmp_path, projector)) == 3 and fault.fired
    err = capsys.readouterr().err
    run_dir = tmp_path / "r2-vision-only" / "run"
    checkpoints = run_dir / "stage-1-vision-full" / "checkpoints"
    assert "stage 1 `vision-full` stopped at step 3: gradients became NaN/inf" in err
    assert f"the last complete checkpoint is {checkpoints / 'checkpoint-2'}" in err
    assert "the command below halves the stage's learning rate" in err and "on_nan: skip_step" in err
    at = "stages.vision-full.training"
    printed = f"--resume {run_dir} {at}.learning_rate=1e-05 {at}.role_learning_rates.projector=2e-05"
    assert f"Continue with:\n  python scripts/train_recipe.py {printed}\n" in err
    stopped_with(run_dir, 3, "TrainingDiverged: stage 1 `vision-full` stopped at step 3")
    before = dict(rates.at)  # steps 1-4: the projector's groups at twice the tower's rate
    assert before[1] == [2e-05, 2e-05, 4e-05, 4e-05] and sorted(before) == [1, 2, 3, 4]
    caplog.set_level(logging.INFO)
    assert main(printed.split()) == 0  # the command as printed, after its program name
    assert f"resuming from {checkpoints / 'checkpoint-2'}" in caplog.text
    assert "learning rate 2e-05 -> 1e-05: this resume's, not the checkpoint's" in caplog.text
    for step in (3, 4):  # the same schedule, at half its height
        assert rates.at[step] == [rate / 2 for rate in before[step]], (step, before, rates.at)
    manifest = read_json(run_dir / "run.json")
    assert manifest["status"] == "finished" and (run_dir / "stage-1-vision-full" / "DONE").is_file()
    training = manifest["resolved_recipe"]["stages"][0]["training"]
    assert training["learning_rate"] == 1e-05 and training["role_learning_rates"] == {"projector": 2e-05}
    # a finished stage is not trained again: run.json would record a rate it never trained at
    assert main(["--resume", str(run_dir), "training.learning_rate=1e-06"]) == 2
    assert "changes stage(s) `vision-full`, finished: name the stage to continue" in capsys.readouterr().err


def test_on_nan_is_the_key_and_nan_policy_still_works_with_a_note(tmp_path, caplog):
    assert {s.training.on_nan for s in load_recipe("r3-two-stage").stages} == {"stop"}  # the default
    recipe = tmp_path / "old.yaml"
    recipe.write_text("extends: r3-two-stage\ntraining:\n  nan_policy: skip_step\n")
    with caplog.at_level(logging.WARNING):
        assert {s.training.on_nan for s in load_recipe(str(recipe)).stages} == {"skip_step"}
        overridden = load_recipe(str(recipe), ["training.on_nan=stop"])  # the override wins over the file
        assert {s.training.on_nan for s in overridden.stages} == {"stop"}
        by_override = load_recipe("r3-two-stage", ["stages.1.training.nan_policy=skip_step"])
        assert [s.training.on_nan for s in by_override.stages] == ["skip_step", "stop"]
    notes = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert notes == [
        f"{recipe}: stages[0].training: `nan_policy` is deprecated, now `on_nan` (same values; the old name "
        "works)",
        "override `stages.1.training.nan_policy=skip_step`: `nan_policy` is deprecated, now `on_nan` (same "
        "values; the old name works)",
    ], "one line per file or override"
    both = tmp_path / "both.yaml"
    both.write_text("extends: r3-two-stage\ntraining:\n  nan_policy: skip_step\n  on_nan: stop\n")
    with pytest.raises(RecipeError, match=r"nan_policy: renamed `on_nan`, which is set too: keep `on_nan`"):
        load_recipe(str(both))
