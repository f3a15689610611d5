"""The SFT stage's trainer: TRL's SFTTrainer with the recipe's mixin (RecipeTrainer), TRL's metrics kept on
the device and read on the host once, when they are logged. Imported when an SFT stage builds its trainer
(methods/sft.py)."""

from __future__ import annotations

import torch
from trl import SFTTrainer

from vlm_recipes.methods.recipe_trainer import RecipeTrainerMixin
from vlm_recipes.speedups.loss_positions import LastLayerAtLossPositions
from vlm_recipes.speedups.packing import is_packed
from vlm_recipes.speedups.sequence_parallel import SequenceShard


class RecipeTrainer(RecipeTrainerMixin, SFTTrainer):
    """The SFT stage's trainer. TRL's logged metrics (entropy, mean_token_accuracy, num_tokens, aux_loss) are
    kept on the device and read on the host once, when they are logged: TRL's compute_loss reads each
    every step (`if num_valid > 0`, `.item()`), and on a GPU each read waits for the step's last kernel."""

    loss_positions: LastLayerAtLossPositions | None = None  # training.loss_positions_only
    sequence_shard: SequenceShard | None = None  # sequence_parallel_size > 1

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.loss_positions is not None:
            inputs = self.loss_positions.select(inputs)  # kept set through backward (checkpointing)
        if self.sequence_shard is not None and model.training and not return_outputs:
            if num_items_in_batch is None:
                raise RuntimeError("sequence parallelism needs the Trainer's token count of the global batch")
            inputs = self.sequence_shard.split(inputs)  # kept active through backward (checkpointing)
            # every rank of a sequence group counted the same rows; each sums only its own piece's tokens
            num_items_in_batch = num_items_in_batch / self.sequence_shard.groups.size
        if return_outputs or not self._trls_token_loss():
            return self._trls_compute_loss(model, inputs, return_outputs, num_items_in_batch)
        # TRL's compute_loss reads the host for its metrics and offers no switch: its token-loss branch (the
        # one every recipe takes) is repeated here, its loss computed as TRL does, op for op; every other
        # branch is TRL's own (_trls_compute_loss).
        inputs["use_cache"] = False
        if self.aux_loss_enabled:
            inputs["output_router_logits"] = True
        outputs = model(**inputs, fused_lm_head=True)
        per_token_loss = -outputs.log_probs  # zero on ignored positions
        if self.args.loss_type == "dft":
            per_token_loss = per_token_loss * outputs.log_probs.exp().detach()
        num_tokens = outputs.label_mask.sum() if num_items_in_batch is None else num_items_in_batch
        loss = per_token_loss.sum() / torch.as_tensor(num_tokens).clamp(min=1)
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * (self.accelerator.num_processes // self.get_tp_size())
        if self.aux_loss_enabled:
            steps = self.current_gradient_accumulation_steps if num_items_in_batch is not None else 1
            loss = loss + self.router_aux_loss_coef * outputs.aux_loss / steps
        self._keep_metrics(inputs, outputs)
        return loss

    def _trls_token_loss(self) -> bool:
        """Whether TRL's compute_loss takes its token-loss branch: no custom loss, no label smoothing, no
        sequence parallelism (TRL's branch for DeepSpeed Ulysses)."""
        parallelism = getattr(self.accelerator, "parallelism_config", None)
        return (
            self.compute_loss_func is None
            and (self.label_smoother is None or self.args.loss_type != "nll")
            and not (parallelism is not None and getattr(parallelism, "sp_enabled", False))
        )

    def _trls_compute_loss(self, model, inputs, return_outputs, num_items_in_batch):
        """TRL's own compute_loss (it reads its metrics on the host), with a packed batch's tokens counted."""
        counted_before = self._total_train_tokens
        if isinstance(counted_before, torch.Tensor):
            self._total_train_tokens = counted_before.clone()  # TRL adds to it in place
        result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if model.training and is_packed(inputs):
            self._total_train_tokens = counted_before + self._tokens_in_batch(inputs)
            self._metrics["train"]["num_tokens"] = [self._total_train_tokens]
        return result

    def _keep_metrics(self, inputs, outputs) -> None:
        """TRL's metrics of this batch, as device tensors (read by `log`): the same values, `num_valid == 0`
        giving 0.0 as TRL's does, without a branch on a tensor."""
        mode = "train" if self.model.training else "eval"
        gather = self.accelerator.gather_for_metrics
        metrics = self._metrics[mode]
        # Entropy and token accuracy: both zero on ignored positions
        num_valid = gather(outputs.label_mask.sum()).sum()
        entropy_sum = gather(outputs.entropy.detach().sum()).sum()
        num_correct = gather(outputs.is_top1.sum()).sum()
        metrics["entropy"].append(torch.where(num_valid > 0, entropy_sum / num_valid, 0.0))
        metrics["mean_token_accuracy"].append(torch.where(num_valid > 0, num_correct / num_valid, 0.0))
        if mode == "train":
            self._total_train_tokens = self._total_train_tokens + self._tokens_in_batch(inputs)
        metrics["num_tokens"] = [self._total_train_tokens]
        if self.aux_loss_enabled:
            metrics["aux_loss"].append(gather(outputs.aux_loss.detach()).mean())

    def _tokens_in_batch(self, inputs) -> torch.Tensor:
        """The batch's real tokens, every rank's, on the device. A padding-free batch has no attention mask:
        its tokens are its packed row's length (TRL counts `position_ids.size(1)`, the batch axis of the
        multimodal position ids, i.e. 1). Made by a device fill, not a host-to-device copy (which syncs)."""
        gather = self.accelerator.gather_for_metrics
        if "attention_mask" in inputs:
            tokens = gather(inputs["attention_mask"].sum()).sum()
        elif "position_ids" in inputs:
            position_ids = inputs["position_ids"]
            tokens = gather(position_ids.new_full((), position_ids.shape[-1], dtype=torch.long)).sum()
        else:
            raise ValueError("Expected 'attention_mask' or 'position_ids' in inputs.")
        repeats = self._tp_size * (self.sequence_shard.groups.size if self.sequence_shard is not None else 1)
        return tokens // repeats  # tensor-parallel ranks and a sequence group's ranks repeat every token

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """TRL's log (it averages its metrics), their device tensors read first, all in one host read."""
        read_on_the_host(self._metrics["train" if self.model.training else "eval"])
        super().log(logs, start_time)

    def training_step(self, *args, **kwargs):
        try:
            return super().training_step(*args, **kwargs)
        finally:
            self._forget_loss_positions()

    def prediction_step(self, *args, **kwargs):
        try:
            return super().prediction_step(*args, **kwargs)
        finally:
            self._forget_loss_positions()

    def _forget_loss_positions(self) -> None:
        """After the step's backward: any other forward (generation) runs the whole last layer, and the whole
        row on every rank of a sequence group."""
        if self.loss_positions is not None:
            self.loss_positions.positions = None
        if self.sequence_shard is not None:
            self.sequence_shard.release()


def read_on_the_host(metrics: dict[str, list]) -> None:
    """Every tensor among the metrics' values replaced by its value as a Python number, in one host read.
    float64 holds each exactly (an fp32, bf16 or fp16 value; a token count below 2**53), so TRL's average of
    these numbers is the average of what `.item()` would have read."""
    where = [(values, i) for values in metrics.values() for i, v in enumerate(values) if torch.is_tensor(v)]
    if not where:
        return
    device = where[0][0][where[0][1]].device
    kept = [values[i].detach().reshape(()).to(device, torch.float64) for values, i in where]
    for (values, i), number in zip(where, torch.stack(kept).tolist(), strict=True):
        values[i] = number
