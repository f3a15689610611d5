"""The SFT stage's method: TRL's SFTTrainer with the recipe's settings as an SFTConfig, its collator wrapped
by the video loader and the batch speed-ups, and the last layer at loss positions only when asked."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vlm_recipes.methods.trainer import ConfigInputs, StageParts, TrainerInputs, TrainingMethod
from vlm_recipes.recipes.schema import Stage

if TYPE_CHECKING:
    from trl import SFTConfig

    from vlm_recipes.decisions import Decision
    from vlm_recipes.methods.sft_trainer import RecipeTrainer


def average_the_loss_over_the_global_batch(trainer: RecipeTrainer, decisions: list[Decision] | None) -> None:
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
    from transformers.trainer_utils import unwrap_peft_model

    from vlm_recipes.decisions import Decision

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
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers

    from vlm_recipes.decisions import Decision

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
    takes_video = True  # data/collate.py extends TRL's collator to videos (the Qwen line's processors)
    takes_loss_positions_cut = True  # its loss reads the labelled positions only (speedups/loss_positions.py)
    takes_streamed_rows = True  # data/streaming.py reads `messages` rows
    takes_sequence_parallel = True  # its token loss, split by speedups/sequence_parallel.py

    def parts(self) -> StageParts:
        from vlm_recipes.data.lengths import check_lengths
        from vlm_recipes.data.rows import MESSAGES
        from vlm_recipes.methods.sft_trainer import RecipeTrainer

        return StageParts(MESSAGES, check_lengths, RecipeTrainer)

    def max_length(self, stage: Stage) -> int | None:
        """Longest conversation: data.max_length."""
        return stage.data.max_length

    def build_config(self, inputs: ConfigInputs) -> SFTConfig:
        from trl import SFTConfig

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
        from vlm_recipes.data.collate import VideoCollator
        from vlm_recipes.data.video import VideoLoader, VideoSampling
        from vlm_recipes.speedups.install import compute_loss_positions_only, wrap_collator

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
        if stage.sequence_parallel_size > 1:
            from vlm_recipes.speedups.sequence_parallel import install_sequence_parallel

            decision = install_sequence_parallel(trainer, built, stage.sequence_parallel_size)
            if decisions is not None:
                decisions.append(decision)
        return trainer
