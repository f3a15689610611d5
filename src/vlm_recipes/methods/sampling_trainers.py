"""The GRPO and RLOO stages' trainers: TRL's GRPOTrainer and RLOOTrainer (the same sampling and log-probability
code in TRL 1.16) with the recipe's mixin, the sampling speed-ups and LLaVA-OneVision's per-row image counts.
Imported when a sampling stage builds its trainer (methods/grpo.py's SamplingMethod)."""

from __future__ import annotations

import contextlib

import torch
from trl import GRPOTrainer, RLOOTrainer

from vlm_recipes.decisions import Decision
from vlm_recipes.errors import GuardError
from vlm_recipes.methods.recipe_trainer import RecipeTrainerMixin
from vlm_recipes.recipes.schema import Stage
from vlm_recipes.speedups import log_probs, sampling


class SamplingTrainerMixin:
    """What a sampling stage's trainer (GRPOTrainer, RLOOTrainer: the same sampling and log-probability code
    in TRL 1.16) adds: the sampling speed-ups, and LLaVA-OneVision's per-row image counts."""

    counts_images_per_row: bool = False  # the model's forward takes `batch_num_images` (LLaVA-OneVision)
    sample_with_merged_lora: bool = False  # <method>.sample_with_merged_lora (speedups/sampling.py)
    inverse_cdf_sampling: bool = False  # <method>.inverse_cdf_sampling (speedups/sampling.py)
    cpu_log_probs: bool = False  # <method>.cpu_log_probs (speedups/log_probs.py)

    def _generate_single_turn(self, *args, **kwargs):
        """TRL's sampling, with the sampling speed-ups the stage asks for around it."""
        model = self.accelerator.unwrap_model(self.model)
        with contextlib.ExitStack() as speedups:
            if self.sample_with_merged_lora:
                speedups.enter_context(sampling.lora_merged(model))
            if self.inverse_cdf_sampling:
                speedups.enter_context(sampling.inverse_cdf_sampling(self, model))
            return super()._generate_single_turn(*args, **kwargs)

    def _get_per_token_logps_and_entropies(self, model, input_ids, *args, num_images=None, **kwargs):
        """LLaVA-OneVision tiles a row's single image ("anyres") but not each of a row's several, and its
        forward tells them apart by `batch_num_images`: TRL 1.16 keeps that field for generation but drops it
        from the log-probability passes, so a prompt of two images met 5 tiles' worth of features where one
        tile each was sent ("split_with_sizes expects split_sizes to sum exactly to 8"). Here the batch goes
        in one chunk with its per-row counts."""
        kwargs.pop("batch_num_images", None)  # from the processor's fields, where TRL passes them all
        with log_probs.cpu_log_probs() if self.cpu_log_probs else contextlib.nullcontext():
            return self._log_probs_with_image_counts(model, input_ids, *args, num_images=num_images, **kwargs)

    def _log_probs_with_image_counts(self, model, input_ids, *args, num_images=None, **kwargs):
        if not (self.counts_images_per_row and num_images is not None):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, *args, num_images=num_images, **kwargs
            )
        counts = torch.tensor(num_images, device=input_ids.device)

        def with_counts(module, positional, keywords):
            return positional, {**keywords, "batch_num_images": counts}

        hook = model.register_forward_pre_hook(with_counts, with_kwargs=True)
        try:
            kwargs["batch_size"] = input_ids.size(0)  # one chunk: the counts are the whole batch's
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, *args, num_images=num_images, **kwargs
            )
        finally:
            hook.remove()


def sampling_speedups(trainer: SamplingTrainerMixin, model, stage: Stage) -> list[Decision]:
    """Switch on the sampling speed-ups the stage asks for (speedups/sampling.py); a refusal names why."""
    chosen, section = [], stage.method
    if stage.settings.sample_with_merged_lora:
        sharded = trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled
        why = "the weights are sharded across ranks" if sharded else sampling.merged_sampling_refusal(model)
        if why:
            raise GuardError(
                f"stage {stage.name}: {section}.sample_with_merged_lora is refused: {why}. Remove it"
            )
        trainer.sample_with_merged_lora = True
        chosen.append(
            Decision(
                "merged-sampling",
                "completions sampled with the LoRA adapter merged into a copy of the weights",
                f"{section}.sample_with_merged_lora is on: no adapter matmuls per sampled token; the loss "
                "still reads log-probabilities through the adapter, and the original weights are put back",
            )
        )
    if stage.settings.inverse_cdf_sampling:
        if why := sampling.inverse_cdf_refusal(trainer.args):
            raise GuardError(
                f"stage {stage.name}: {section}.inverse_cdf_sampling is refused: {why}. Remove it"
            )
        trainer.inverse_cdf_sampling = True
        chosen.append(
            Decision(
                "inverse-cdf-sampling",
                "each token drawn from the cumulative distribution of softmax(logits / temperature)",
                f"{section}.inverse_cdf_sampling is on: the same distribution as torch.multinomial's draw, "
                "one random number a row instead of one exponential per vocabulary entry",
            )
        )
    if stage.settings.cpu_log_probs:
        trainer.cpu_log_probs = True
        chosen.append(
            Decision(
                "cpu-log-probs",
                "the log-probability pass's LM head in one vocabulary tile, bf16 matmuls (on a CPU)",
                f"{section}.cpu_log_probs is on: TRL's fused head off a GPU runs its gradient matmuls in fp32 "
                "and ~10 element-wise passes over the logits; the same function in fewer (TRL's own on a GPU)",
            )
        )
    return chosen


class RecipeGRPOTrainer(SamplingTrainerMixin, RecipeTrainerMixin, GRPOTrainer):
    """The GRPO stage's trainer."""


class RecipeRLOOTrainer(SamplingTrainerMixin, RecipeTrainerMixin, RLOOTrainer):
    """The RLOO stage's trainer."""
