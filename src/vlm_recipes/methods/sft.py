"""The SFT stage's method: TRL's SFTTrainer with the recipe's settings as an SFTConfig, its collator wrapped
by the video loader and the batch speed-ups, and the last layer at loss positions only when asked."""

from __future__ import annotations

import logging

import torch
from transformers.trainer_utils import unwrap_peft_model
from trl import SFTConfig, SFTTrainer
from trl.chat_template_utils import get_training_chat_template, has_generation_markers

from vlm_recipes.data.collate import VideoCollator
from vlm_recipes.data.lengths import check_lengths as check_message_lengths
from vlm_recipes.data.rows import MESSAGES
from vlm_recipes.data.video import VideoLoader, VideoSampling
from vlm_recipes.decisions import Decision
from vlm_recipes.methods.trainer import ConfigInputs, RecipeTrainerMixin, TrainerInputs, TrainingMethod
from vlm_recipes.recipes.schema import Stage
from vlm_recipes.speedups.install import compute_loss_positions_only, wrap_collator
from vlm_recipes.speedups.loss_positions import LastLayerAtLossPositions
from vlm_recipes.speedups.packing import is_packed

log = logging.getLogger(__name__)


class RecipeTrainer(RecipeTrainerMixin, SFTTrainer):
    """The SFT stage's trainer. TRL's logged metrics (entropy, mean_token_accuracy, num_tokens, aux_loss) are
    kept on the device and read on the host once, when they are logged: TRL's compute_loss reads each
    every step (`if num_valid > 0`, `.item()`), and on a GPU each read waits for the step's last kernel."""

    loss_positions: LastLayerAtLossPositions | None = None  # training.loss_positions_only

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.loss_positions is not None:
            inputs = self.loss_positions.select(inputs)  # kept set through backward (checkpointing)
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
        return tokens // self._tp_size  # tensor-parallel ranks repeat every token

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
        """After the step's backward: any other forward (generation) runs the whole last layer."""
        if self.loss_positions is not None:
            self.loss_positions.positions = None


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


def average_the_loss_over_the_global_batch(trainer: SFTTrainer, decisions: list[Decision] | None) -> None:
    """The loss as one process computes it over the whole global batch: the sum over every labelled token
    of every micro-batch and rank, divided by their count (`num_items_in_batch`, which the Trainer counts).

    Every family's forward hands its keyword arguments, `num_items_in_batch` among them, to its loss
    function, but seven classes say `accepts_loss_kwargs = False` (Qwen2.5-VL, Qwen3-VL, Qwen3.5 and its
    MoE, Gemma 4, GLM-4V and its MoE: transformers' workaround for Gemma 3's gradient accumulation, #37208,
    copied on). Told so, the Trainer averages each micro-batch over its own tokens, then averages the
    micro-batches and the ranks: a row in a short micro-batch weighs more, and gradient accumulation or a
    second rank trains differently from one process over the same rows (measured: Qwen2.5-VL's LoRA after 3
    steps on 2 ranks 3.9e-3 from one process's, twice as far as training moved it).
    `test_families::test_gradient_accumulation_trains_as_one_batch_does` proves it on every family."""
    if trainer.model_accepts_loss_kwargs:
        return
    trainer.model_accepts_loss_kwargs = True
    name = type(unwrap_peft_model(trainer.accelerator.unwrap_model(trainer.model))).__name__
    decision = Decision(
        "loss-average",
        "over every labelled token of the global batch (num_items_in_batch passed to the loss)",
        f"{name} says accepts_loss_kwargs = False, yet its forward hands num_items_in_batch to its loss: "
        "without it each micro-batch and rank is averaged on its own, and gradient accumulation or 2 ranks "
        "would not train as one process over the same rows",
    )
    if decisions is not None:
        decisions.append(decision)


def answers_by_prefix(processor, decisions: list[Decision] | None) -> bool:
    """Whether the loss's answers must be told by rendering each one's prefix (data/collate.py): where the
    chat template has no {% generation %} markers and TRL has no training variant of it."""
    template = processor.chat_template
    if not isinstance(template, str) or has_generation_markers(template):
        return False
    try:
        get_training_chat_template(processor)
        return False
    # ValueError: TRL knows no training variant of this template; RuntimeError: TRL cannot even check it with
    # this processor (MiniCPM-V 4.6's: its tool-call prefix check compares tensors as if they were lists)
    except (ValueError, RuntimeError):
        pass
    decision = Decision(
        "answer-tokens",
        "told by rendering each answer's prefix",
        "the chat template has no {% generation %} markers and TRL has no training variant of it: each "
        "answer's tokens are those between the conversation before it (with the generation prompt) and "
        "through it, rendered and processed again per row",
    )
    if decisions is not None:
        decisions.append(decision)
    return True


class SFT(TrainingMethod):
    """Supervised fine-tuning on `messages` rows: the loss on the assistant's answers."""

    name = "sft"
    row_format = MESSAGES
    takes_video = True  # data/collate.py extends TRL's collator to videos (the Qwen line's processors)
    takes_loss_positions_cut = True  # its loss reads the labelled positions only (speedups/loss_positions.py)
    takes_streamed_rows = True  # data/streaming.py reads `messages` rows
    check_lengths = staticmethod(check_message_lengths)
    trainer_class = RecipeTrainer

    def max_length(self, stage: Stage) -> int | None:
        """Longest conversation: data.max_length."""
        return stage.data.max_length

    def build_config(self, inputs: ConfigInputs) -> SFTConfig:
        return SFTConfig(
            **inputs.common_keywords(),
            # Lengths are checked before training (data.check_lengths): the collator must never truncate
            # through image tokens.
            max_length=None,
            assistant_only_loss=True,
        )

    def make_trainer(self, inputs: TrainerInputs) -> RecipeTrainer:
        """The one SFTTrainer of a stage, with the parallelism and trainable-dtype guards applied, its
        collator extended to videos and wrapped by the batch speed-ups the stage asks for."""
        built, stage, decisions = inputs.built, inputs.stage, inputs.decisions
        by_prefix = answers_by_prefix(built.processor, decisions)
        # by prefix: TRL labels every token, the collator keeps the answers
        inputs.args.assistant_only_loss = not by_prefix
        trainer = self.construct_trainer(inputs)
        average_the_loss_over_the_global_batch(trainer, decisions)
        self.prepare_trainer(trainer, inputs)
        videos = VideoLoader.for_model(built.family, built.processor, VideoSampling.from_settings(stage.data))
        trainer.data_collator = VideoCollator.extending(trainer.data_collator, videos, by_prefix)
        wrap_collator(trainer, built, stage, decisions)  # the batch speed-ups wrap TRL's SFT collator
        compute_loss_positions_only(trainer, built, stage, decisions)
        return trainer
