"""A training step of ours reads nothing back from the device between logging steps.

A host read of a tensor (`.item()`, `.tolist()`, `float(t)`, `bool(t)`, `.cpu()`) makes a GPU finish every
kernel queued so far before the next is launched: on an H100, a read every step empties the launch queue at
each step's end. The NaN/inf guard did exactly that (`if torch.isfinite(total_norm):` every step); it now keeps
its answer on the device and reads it at logging, evaluation and checkpoint steps, which Trainer syncs anyway.

TRL's SFTTrainer read its logged metrics every step (`if num_valid > 0`, `.item()` of the entropy, the token
accuracy and the token count): RecipeTrainer keeps them on the device and reads them once, when they are
logged (methods/sft.py).

Counted on the CPU by patching the tensor's reading methods during a real stage (tiny Qwen2-VL, r2's stage, 8
steps, a log every 4th): a read counts when the code asking for it is ours (vlm_recipes), a callback's or
TRL's (its trainers' metrics)."""

from __future__ import annotations

import sys
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainerCallback
from trl import SFTTrainer

from vlm_recipes.cli.train import main
from vlm_recipes.files import read_json

READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "cpu", "numpy")
PACKAGE = str(Path(__import__("vlm_recipes").__file__).parent)
TRL = str(Path(__import__("trl").__file__).parent)
STEPS, LOGGING_STEPS = 8, 4


def training_step_of_the_asker(frame) -> int | None:
    """The optimizer step (1-based) whose work asked for a read from `frame`, or None where a read stalls no
    device: outside the training loop (loading, evaluation after training, saving final/) and in the data
    loader (its tensors are made on the host, before they go to the device)."""
    after_the_step = False  # on_step_end, the log, evaluation and checkpoint run after global_step counts it
    while frame is not None:
        name = frame.f_code.co_name
        if name == "get_batch_samples":
            return None
        after_the_step |= name in ("on_step_end", "_maybe_log_save_evaluate")
        if name == "_inner_training_loop":
            trainer = frame.f_locals.get("self")
            return trainer.state.global_step + (0 if after_the_step else 1)
        frame = frame.f_back
    return None


def is_counted(frame) -> bool:
    """Code whose reads count: ours, a callback's, or TRL's (its trainer's compute_loss and log)."""
    return frame.f_code.co_filename.startswith((PACKAGE, TRL)) or isinstance(
        frame.f_locals.get("self"), TrainerCallback
    )


class Reads(Counter):
    """Host reads by training step (1-based), and where each step's were asked for (`where[step]`)."""

    def __init__(self):
        super().__init__()
        self.where: dict[int, Counter] = defaultdict(Counter)


@pytest.fixture()
def host_reads(monkeypatch):
    """Reads that our code, a callback or TRL asks for, by training step."""
    reads = Reads()
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            asker = sys._getframe(1)
            if is_counted(asker) and (step := training_step_of_the_asker(asker)) is not None:
                reads[step] += 1
                code = asker.f_code
                reads.where[step][f"{Path(code.co_filename).name}:{asker.f_lineno} {_name}"] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return reads


def train_r2(tmp_path: Path, *settings: str) -> int:
    return main(
        [
            *("--recipe", "r2-vision-only", "--output-dir", str(tmp_path), "--run-name", "run"),
            *("--max-steps", str(STEPS), f"training.logging_steps={LOGGING_STEPS}", "training.save_steps=0"),
            *("evaluation.generate=false", "data.max_eval_samples=4", "data.max_train_samples=32"),
            "training.per_device_batch_size=2",
            "precision=fp32",
            *settings,
        ]
    )


def test_our_code_callbacks_and_trl_read_the_device_only_at_logging_steps(tmp_path, host_reads):
    """Between logging steps nothing; at one, the NaN/inf guard's record and the logged metrics, once each."""
    assert train_r2(tmp_path) == 0
    logging_steps = {1, *range(LOGGING_STEPS, STEPS + 1, LOGGING_STEPS)}  # the first step logs too
    between = {step: dict(host_reads.where[step]) for step in host_reads if step not in logging_steps}
    assert not between, f"host reads between logging steps, by step: {between}"
    at_logging = {step: dict(host_reads.where[step]) for step in logging_steps}
    assert all(host_reads[step] <= 2 for step in logging_steps), at_logging


class ReadsEveryStep(TrainerCallback):
    """What the NaN/inf guard used to do: the gradients' norm read on the host before every optimizer step."""

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        norm = torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]).sum()
        if torch.isfinite(norm):
            return


def test_the_count_sees_a_callback_and_trl_reading_every_step(tmp_path, host_reads, monkeypatch):
    """The count above can fail: a callback reading every step is seen at every step, and so is TRL's own
    compute_loss (what RecipeTrainer ran before it kept the metrics on the device)."""
    import vlm_recipes.stages.run as stage_run
    from vlm_recipes.methods.sft_trainer import RecipeTrainer

    stage_callbacks = stage_run.stage_callbacks

    def with_a_reader(*args, **kwargs):
        callbacks, decision = stage_callbacks(*args, **kwargs)
        return {**callbacks, "reads_every_step": ReadsEveryStep()}, decision

    monkeypatch.setattr(stage_run, "stage_callbacks", with_a_reader)
    monkeypatch.setattr(RecipeTrainer, "compute_loss", SFTTrainer.compute_loss)
    assert train_r2(tmp_path) == 0
    for asker in (Path(__file__).name, "sft_trainer.py"):  # the callback's file, TRL's
        steps = [step for step, where in host_reads.where.items() if any(w.startswith(asker) for w in where)]
        assert sorted(steps) == list(range(1, STEPS + 1)), (asker, dict(host_reads.where))


class PoisonedGradientAt(TrainerCallback):
    """Makes step `step`'s gradients NaN as backward writes them (before Trainer's norm sees them), and
    counts the steps trained."""

    def __init__(self, step: int):
        self.step, self.now, self.steps_trained = step, 0, 0

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        def poison(grad):
            return grad * float("nan") if self.now == self.step else grad

        next(p for p in model.parameters() if p.requires_grad).register_hook(poison)

    def on_step_begin(self, args, state, control, **kwargs):
        self.now = state.global_step + 1

    def on_step_end(self, args, state, control, **kwargs):
        self.steps_trained += 1


def train_r2_with_nan_at(
    tmp_path: Path, monkeypatch, step: int, *settings: str
) -> tuple[int, PoisonedGradientAt]:
    import vlm_recipes.stages.run as stage_run

    poison, stage_callbacks = PoisonedGradientAt(step), stage_run.stage_callbacks

    def with_poison(*args, **kwargs):
        callbacks, decision = stage_callbacks(*args, **kwargs)
        return {**callbacks, "poison": poison}, decision

    monkeypatch.setattr(stage_run, "stage_callbacks", with_poison)
    return train_r2(tmp_path, *settings), poison


def test_a_nan_gradient_stops_the_stage_at_the_next_logging_step_naming_the_step(
    tmp_path, monkeypatch, capsys
):
    code, poison = train_r2_with_nan_at(tmp_path, monkeypatch, 2)
    assert code == 3  # TrainingDiverged
    assert poison.steps_trained == LOGGING_STEPS, "stopped at the first logging step after the bad one"
    assert "stopped at step 2: gradients became NaN/inf" in capsys.readouterr().err
    stage = tmp_path / "r2-vision-only" / "run" / "stage-1-vision-full"
    assert not (stage / "DONE").exists() and not list(stage.glob("checkpoints/checkpoint-*"))


def test_skip_step_drops_the_nan_step_and_trains_on(tmp_path, monkeypatch):
    code, poison = train_r2_with_nan_at(tmp_path, monkeypatch, 3, "training.nan_policy=skip_step")
    assert code == 0 and poison.steps_trained == STEPS
    stage = tmp_path / "r2-vision-only" / "run" / "stage-1-vision-full"
    assert read_json(stage / "metrics.json")["skipped_steps"] == 1
    weights = load_file(str(next((stage / "final").glob("*.safetensors"))))
    assert all(torch.isfinite(w).all() for w in weights.values())
