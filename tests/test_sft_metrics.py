"""RecipeTrainer keeps TRL's SFT metrics (entropy, mean_token_accuracy, num_tokens) on the device and reads
them once per logging step (tests/test_host_reads.py); what it logs and what it trains are TRL's own.

The same tiny stage (r1's LoRA, fp32, 2 micro-batches a step, a log every step, an evaluation every 2nd)
trained twice in this process: with RecipeTrainer's compute_loss and log, and with TRL's SFTTrainer's put
back. Every logged value (train and eval) and the trained weights are equal bit for bit: the loss is
computed by the same ops, and every metric is the same tensor read later, through float64, which holds it
exactly, then averaged by TRL's own log."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from trl import SFTTrainer

from vlm_recipes.cli.train import main
from vlm_recipes.methods.sft_trainer import RecipeTrainer, read_on_the_host
from vlm_recipes.stages import run as stage_run

STEPS, EVAL_STEPS = 6, 2
TIMINGS = ("runtime", "per_second")  # wall-clock keys of the log: differ from run to run


def train_r1(directory: Path, trls_own: bool, precision: str) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """r1's stage for STEPS steps, at a learning rate that makes the tiny model right about some tokens by
    the 3rd step (a token accuracy of 0 everywhere would compare nothing): the trainer's log history and
    the trained tensors."""
    captured, original_train = {}, stage_run.train

    def train_capturing_the_log(ctx, trainer, callbacks, resume_from):
        output = original_train(ctx, trainer, callbacks, resume_from)
        captured["history"] = trainer.state.log_history
        captured["trained"] = {
            name: p.detach().clone() for name, p in trainer.model.named_parameters() if p.requires_grad
        }
        return output

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(stage_run, "train", train_capturing_the_log)
        if trls_own:
            mp.setattr(RecipeTrainer, "compute_loss", SFTTrainer.compute_loss)
            mp.setattr(RecipeTrainer, "log", SFTTrainer.log)
        args = [
            *("--recipe", "r1-llm-only", "--output-dir", str(directory), "--run-name", "run"),
            *("--max-steps", str(STEPS), "training.logging_steps=1", f"evaluation.eval_steps={EVAL_STEPS}"),
            *("training.learning_rate=1e-2", "training.per_device_batch_size=2"),
            "training.gradient_accumulation_steps=2",  # each step's metrics: the average of 2 micro-batches'
            *("training.save_steps=0", "evaluation.generate=false", "training.report_to=[none]"),
            *("data.max_train_samples=32", "data.max_eval_samples=4", f"precision={precision}"),
        ]
        assert main(args) == 0
    return captured["history"], captured["trained"]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_logged_metrics_and_the_trained_weights_are_trls_own(tmp_path, precision):
    deferred, deferred_weights = train_r1(tmp_path / "deferred", trls_own=False, precision=precision)
    trls, trls_weights = train_r1(tmp_path / "trl", trls_own=True, precision=precision)

    assert [e.keys() for e in deferred] == [e.keys() for e in trls]
    logged = [{k: v for k, v in e.items() if not any(t in k for t in TIMINGS)} for e in trls]
    train_logs = [e for e in logged if "entropy" in e]
    eval_logs = [e for e in logged if "eval_entropy" in e]
    assert len(train_logs) == STEPS and len(eval_logs) == STEPS // EVAL_STEPS + 1  # and after training
    for e in train_logs:
        assert {"loss", "entropy", "mean_token_accuracy", "num_tokens"} <= e.keys()
    assert any(e["mean_token_accuracy"] > 0 for e in train_logs), "right about some tokens: a comparison"
    assert train_logs[-1]["num_tokens"] > train_logs[0]["num_tokens"] > 0
    differ = [
        (entry, key, ours[key], theirs)
        for entry, (ours, trls_entry) in enumerate(zip(deferred, logged, strict=True))
        for key, theirs in trls_entry.items()
        if ours[key] != theirs or type(ours[key]) is not type(theirs)
    ]
    assert not differ, f"logged values that differ from TRL's, (entry, key, ours, TRL's): {differ}"

    assert deferred_weights.keys() == trls_weights.keys() and trls_weights
    differ = [k for k in trls_weights if not torch.equal(deferred_weights[k], trls_weights[k])]
    assert not differ, f"{len(differ)} trained tensors differ from TRL's, e.g. {differ[:1]}"
    # and training moved them: LoRA's B matrices start at zero
    moved = max(t.abs().max().item() for k, t in trls_weights.items() if "lora_B" in k)
    print(f"{precision}: LoRA B moved up to {moved:.2e} from zero; ours and TRL's equal bit for bit")
    assert moved > 1e-3, moved


def a_trainer() -> SimpleNamespace:
    """What RecipeTrainer._keep_metrics uses of a trainer in training, on one process."""
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True),
        accelerator=Accelerator(cpu=True),
        _metrics={"train": {"entropy": [], "mean_token_accuracy": []}, "eval": {}},
        _total_train_tokens=0,
        _tp_size=1,
        sequence_shard=None,  # one process: no sequence group repeats the tokens
        aux_loss_enabled=False,
    )
    trainer._tokens_in_batch = RecipeTrainer._tokens_in_batch.__get__(trainer)
    return trainer


@pytest.mark.parametrize("labelled", [0, 3])
def test_a_batch_without_labelled_tokens_logs_zero_as_trl_does(labelled):
    """TRL logs 0.0 for the entropy and the accuracy of a batch without a labelled token (`if num_valid > 0`);
    kept on the device (`torch.where`, no branch on a tensor), they read the same: 0.0, not NaN."""
    trainer = a_trainer()
    label_mask = torch.zeros(1, 5, dtype=torch.bool)
    label_mask[0, :labelled] = True
    outputs = SimpleNamespace(
        label_mask=label_mask,
        entropy=torch.linspace(0.5, 2.5, 5)[None] * label_mask,
        is_top1=torch.tensor([[True, False, True, True, False]]) & label_mask,
    )
    inputs = {"attention_mask": torch.ones(1, 5, dtype=torch.long)}
    RecipeTrainer._keep_metrics(trainer, inputs, outputs)
    metrics = trainer._metrics["train"]
    read_on_the_host(metrics)
    # TRL's own expressions (trl/trainer/sft_trainer.py, SFTTrainer.compute_loss)
    num_valid, entropy_sum, num_correct = label_mask.sum(), outputs.entropy.sum(), outputs.is_top1.sum()
    entropy = (entropy_sum / num_valid).item() if num_valid > 0 else 0.0
    accuracy = (num_correct / num_valid).item() if num_valid > 0 else 0.0
    assert metrics == {"entropy": [entropy], "mean_token_accuracy": [accuracy], "num_tokens": [5.0]}
    assert labelled or entropy == accuracy == 0.0
