"""The distillation stage's method (method: distill): TRL's DistillationTrainer, on-policy as in GKD. The student
(the stage's model) samples a completion for each prompt, the teacher scores it, and the loss is the
generalized Jensen-Shannon divergence between their next-token distributions on it (`distill.beta`: 0 forward
KL, 0.5 JSD, 1 reverse KL). The rows are GRPO's prompt rows (data/prompts.py); images reach both models.

The teacher (`distill.teacher`) is a model directory or id, or `stage:<name>`, an earlier stage's final/. It is
loaded frozen (no gradient, eval mode), in the stage's compute dtype, is never saved (final/ holds the student
only), and is refused when its tokenizer differs from the student's: the divergence compares the two
distributions token id by token id.

What the stage measures on its eval prompts, at the start and the end: the mean per-token KL(teacher ‖ student)
on the teacher's own greedy completions, generated once and kept, so the start and the end score the same
tokens (TRL's eval loss is measured on freshly sampled completions and moves even when nothing trains), and how
often the student's most likely token is the teacher's there."""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from vlm_recipes.methods.trainer import ConfigInputs, StageParts, TrainerInputs, TrainingMethod
from vlm_recipes.recipes.fields import ABOVE_0, AT_LEAST_1, Range, doc
from vlm_recipes.recipes.schema import Stage
from vlm_recipes.recipes.validate import Problem, did_you_mean, model_source_problem

if TYPE_CHECKING:
    from trl import DistillationConfig

    from vlm_recipes.methods.recipe_trainer import RecipeTrainerMixin


@dataclass
class DistillSettings:
    """Distillation from a teacher VLM (method: distill): TRL's DistillationTrainer on `prompt` rows, the
    student's own completions scored by the teacher."""

    teacher: str = doc(
        "the teacher: `stage:<name>` (an earlier stage's final/), a model directory or a hub id; it must share "
        "the student's tokenizer",
        "",
    )
    beta: float = doc(
        "the divergence: 0 forward KL(teacher ‖ student), 0.5 Jensen-Shannon, 1 reverse KL (TRL's default)",
        0.5,
        range=Range(0, 1),
    )
    temperature: float = doc(
        "temperature of the student's sampling and of both distributions in the loss", 1.0, range=ABOVE_0
    )
    max_completion_length: int = doc(
        "longest completion the student samples, in tokens (and the teacher's greedy eval completions)",
        64,
        range=AT_LEAST_1,
    )


def teacher_source(stage: Stage, stage_dir: Path) -> str:
    """The teacher as a loadable source: `stage:<name>` → that stage's final/ in this run, else as written."""
    teacher = stage.settings.teacher
    if not teacher.startswith("stage:"):
        return teacher
    name = teacher.removeprefix("stage:")
    run_dir = stage_dir.parent
    found = [d for d in run_dir.iterdir() if re.fullmatch(rf"stage-\d+-{re.escape(name)}", d.name)]
    return str(found[0] / "final")


class Distill(TrainingMethod):
    """On-policy distillation from a teacher, the recipe's `distill:` section."""

    name = "distill"
    settings = DistillSettings
    eval_at_start = True
    loss_kind = "divergence"
    measures = {
        "eval_teacher_kl": ("KL to teacher", False),
        "eval_teacher_agreement": ("teacher's token", True),
    }

    def parts(self) -> StageParts:
        from vlm_recipes.data.prompts import PROMPTS, check_prompt_lengths
        from vlm_recipes.methods.distill_trainer import RecipeDistillationTrainer

        return StageParts(PROMPTS, check_prompt_lengths, RecipeDistillationTrainer)

    def frozen_copies(self, stage: Stage) -> int:
        return 1  # the teacher, counted at the student's size

    def problems(self, stage: Stage, at: str, earlier: list[Stage]) -> list[Problem]:
        teacher, where = stage.settings.teacher, f"{at}.distill.teacher"
        if not teacher:
            return [
                Problem(where, "a distill stage needs its teacher: `stage:<name>` or a model directory / id")
            ]
        if teacher.startswith("stage:"):
            names = [s.name for s in earlier]
            if (name := teacher.removeprefix("stage:")) not in names:
                return [Problem(where, f"no earlier stage `{name}`{did_you_mean(name, names)}")]
            return []
        if teacher.startswith("demo:"):
            return [
                Problem(where, "a demo model is no teacher: train one in an earlier stage (`stage:<name>`)")
            ]
        problem = model_source_problem(teacher)
        return [Problem(where, problem)] if problem else []

    def max_length(self, stage: Stage) -> int | None:
        """Longest prompt: what data.max_length leaves beside the longest completion."""
        if stage.data.max_length is None:
            return None
        return stage.data.max_length - stage.settings.max_completion_length

    def build_config(self, inputs: ConfigInputs) -> DistillationConfig:
        from trl import DistillationConfig

        d = inputs.stage.settings
        common = inputs.common_keywords()
        # TRL's own name for it (the common keywords' activation_checkpointing is Trainer's newer one)
        common["gradient_checkpointing"] = common.pop("activation_checkpointing")
        common.pop("activation_checkpointing_kwargs")
        return DistillationConfig(
            **common,
            beta=d.beta,
            temperature=d.temperature,
            max_completion_length=d.max_completion_length,
            disable_dropout=True,
        )

    def make_trainer(self, inputs: TrainerInputs) -> RecipeTrainerMixin:
        """The stage's DistillationTrainer with the frozen teacher beside the student."""
        from vlm_recipes.decisions import Decision
        from vlm_recipes.methods.distill_trainer import load_teacher, vision_token_ids

        built, stage = inputs.built, inputs.stage
        source = teacher_source(stage, Path(inputs.args.output_dir).parent)
        teacher = load_teacher(source, built.processor, built.compute_dtype, str(built.model.device))
        inputs.record(
            Decision(
                "distill-teacher",
                f"{source}, frozen, {sum(p.numel() for p in teacher.parameters()):,} parameters",
                "scores the student's own completions; never trained, never saved; same tokenizer as the student",
            )
        )
        inputs.warn_unused(
            ("padding_free", "preprocessed_cache", "group_by_length"), "TRL samples its own batches"
        )
        # TRL keeps the image token out of the student's samples; a sampled vision start / end or video token
        # would as surely break the image positions (Qwen's rope index counts vision starts): all kept out
        # (and the padding token, where it is not the end of text: TRL's masks read it as padding mid-answer)
        tokenizer = getattr(built.processor, "tokenizer", built.processor)
        pad = [tokenizer.pad_token_id] if tokenizer.pad_token_id not in (None, tokenizer.eos_token_id) else []
        inputs.args.generation_kwargs = {"suppress_tokens": vision_token_ids(built.model.config) + pad}
        # TRL pads the prompts on the left and keeps the processor's other per-token fields (Qwen's
        # mm_token_type_ids) as the processor padded them: a processor padding on the right puts a short
        # prompt's image tokens where its padding is. Its trainer gets a copy that pads on the left.
        processor = copy.deepcopy(built.processor)
        getattr(processor, "tokenizer", processor).padding_side = "left"
        inputs = replace(inputs, built=replace(built, processor=processor))
        trainer = self.construct_trainer(inputs, teacher_model=teacher)
        return self.prepare_trainer(trainer, inputs)

    def record(self, stage: Stage) -> dict:
        return super().record(stage) | {"teacher": stage.settings.teacher}

    def eval_metrics(self, eval_metrics: dict) -> dict:
        """The distance to the teacher on its fixed completions (lower KL, higher agreement: closer), and TRL's
        eval loss, the divergence on the student's freshly sampled completions."""
        return {
            "eval_teacher_kl": eval_metrics.get("eval_teacher_kl"),
            "eval_teacher_agreement": eval_metrics.get("eval_teacher_agreement"),
        }
